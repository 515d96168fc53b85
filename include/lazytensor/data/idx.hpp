#pragma once
// The IDX format of MNIST and Fashion-MNIST (http://yann.lecun.com/exdb/mnist/), raw or
// gzip-compressed (detected by the gzip magic bytes 1f 8b, not by the file name):
//
//   00 00 <type> <rank>   magic: two zero bytes, the element type, the number of dims
//   rank x uint32         the dimensions, big-endian
//   data                  row-major elements, exactly as many as the dims describe
//
// The reader is strict and hostile-input safe: every header field is checked, the data
// must fill the file exactly (short = truncated, longer = corrupt), and memory is sized from
// the data actually present, never from what a header claims.
//
// gzip needs zlib: it is used when <zlib.h> is found (link ZLIB::ZLIB, or -lz); define
// LAZYTENSOR_WITH_ZLIB=0 to do without (compressed files then raise IoError).

#include <algorithm>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <new>
#include <optional>
#include <string>
#include <vector>

#include <lazytensor/core/buffer.hpp>
#include <lazytensor/core/config.hpp>
#include <lazytensor/core/error.hpp>
#include <lazytensor/core/shape.hpp>
#include <lazytensor/io/file.hpp>

#ifndef LAZYTENSOR_WITH_ZLIB
#if __has_include(<zlib.h>)
#define LAZYTENSOR_WITH_ZLIB 1
#else
#define LAZYTENSOR_WITH_ZLIB 0
#endif
#endif
// Only the definitions use zlib: a TU that just declares them (LAZYTENSOR_COMPILED) needs no
// <zlib.h>.
#if LAZYTENSOR_WITH_ZLIB && LAZYTENSOR_HEADER_DEFINITIONS
#include <zlib.h>
#endif

namespace lazy::data {

/// The contents of an IDX file of unsigned bytes (element type 0x08).
struct IdxArray {
  std::vector<std::int64_t> dims;  ///< the dimensions, outermost first
  std::vector<std::uint8_t> data;  ///< the elements, row-major
  /// Number of elements.
  std::int64_t numel() const;
};

namespace detail {

/// The IDX name of an element type code, or nullptr for an unknown code.
const char* idx_type_name(unsigned code);

std::string hex_byte(unsigned b);

/// Bytes of an uncompressed file, read sequentially.
class RawSource {
 public:
  explicit RawSource(io::detail::ReadFile& f) : f_(f) {}
  std::size_t read(void* dst, std::size_t n) { return f_.read(dst, n); }

 private:
  io::detail::ReadFile& f_;
};

#if LAZYTENSOR_WITH_ZLIB && LAZYTENSOR_HEADER_DEFINITIONS
/// The decompressed bytes of a gzip file (one or more concatenated members, as gzip -c
/// writes them). Corrupt or truncated compressed data, and anything after the last member
/// that is not another member, raise FormatError.
class GzipSource {
 public:
  explicit GzipSource(io::detail::ReadFile& f);
  GzipSource(const GzipSource&) = delete;
  GzipSource& operator=(const GzipSource&) = delete;
  ~GzipSource() { inflateEnd(&zs_); }

  /// Up to n decompressed bytes; fewer only at the clean end of the stream.
  std::size_t read(void* dst, std::size_t n);

 private:
  void refill();
  [[noreturn]] void fail(const std::string& what);

  io::detail::ReadFile& f_;
  std::vector<Bytef> in_;
  z_stream zs_{};
  bool eof_ = false;
  bool member_done_ = false;
};
#endif

/// Parses an IDX stream. `file_size` is the exact size of an uncompressed file (checked
/// before allocating); for a compressed stream it is unknown. Either way the data buffer
/// grows with the bytes actually read (geometrically, so at most about twice what arrived),
/// never from the header's claim alone.
[[noreturn]] void idx_fail(const std::string& path, const std::string& what);

template <class Source>
IdxArray parse_idx(Source& src, const std::string& path, std::optional<std::uint64_t> file_size) {
  unsigned char head[4];
  const std::size_t got = src.read(head, 4);
  if (got < 4) {
    idx_fail(path, (got == 0 ? std::string("truncated: the file is empty")
                             : "truncated: the file ends after " + std::to_string(got) + " bytes") +
                       ", expected the 4-byte IDX magic 00 00 <type> <rank>");
  }
  if (head[0] != 0 || head[1] != 0) {
    idx_fail(path, "not an IDX file: the magic bytes are " + hex_byte(head[0]) + " " +
                       hex_byte(head[1]) + " " + hex_byte(head[2]) + " " + hex_byte(head[3]) +
                       ", expected 00 00 <type> <rank>");
  }
  if (head[2] != 0x08) {
    const char* name = idx_type_name(head[2]);
    idx_fail(path, name ? "element type 0x" + hex_byte(head[2]) + " (" + name +
                              ") is not supported, expected 0x08 (unsigned byte)"
                        : "unknown element type 0x" + hex_byte(head[2]) +
                              ", expected 0x08 (unsigned byte)");
  }
  const unsigned rank = head[3];
  if (rank == 0 || rank > static_cast<unsigned>(kMaxRank)) {
    idx_fail(path, "the header declares " + std::to_string(rank) + " dimensions, expected 1 to " +
                       std::to_string(kMaxRank));
  }
  unsigned char raw_dims[4 * kMaxRank];
  const std::size_t dim_bytes = 4 * static_cast<std::size_t>(rank);
  if (const std::size_t g = src.read(raw_dims, dim_bytes); g < dim_bytes) {
    idx_fail(path, "truncated: the file ends inside the header (" + std::to_string(4 + g) + " of " +
                       std::to_string(4 + dim_bytes) + " header bytes present)");
  }
  IdxArray a;
  std::uint64_t numel = 1;
  std::string dims_text;
  for (unsigned d = 0; d < rank; ++d) {
    const unsigned char* p = raw_dims + 4 * d;
    const std::uint64_t v = (std::uint64_t{p[0]} << 24) | (std::uint64_t{p[1]} << 16) |
                            (std::uint64_t{p[2]} << 8) | p[3];
    if (v == 0) idx_fail(path, "dimension " + std::to_string(d) + " is 0, expected > 0");
    dims_text += (d ? " x " : "") + std::to_string(v);
    // The bound of every shape (core/shape.hpp), which keeps later sums and the allocation
    // arithmetic far from overflow.
    if (__builtin_mul_overflow(numel, v, &numel) || numel > static_cast<std::uint64_t>(kMaxElements)) {
      idx_fail(path, "the dimensions describe more than 2^60 elements (corrupt header?)");
    }
    a.dims.push_back(static_cast<std::int64_t>(v));
  }
  const std::string promise = "the header (dims " + dims_text + " of unsigned bytes) promises " +
                              std::to_string(numel) + " data bytes";
  if (file_size) {
    const std::uint64_t expected = 4 + dim_bytes + numel;
    if (*file_size < expected) {
      idx_fail(path, "truncated: " + promise + ", the file holds " +
                         std::to_string(*file_size - 4 - dim_bytes));
    }
    if (*file_size > expected) {
      idx_fail(path, "corrupt: " + std::to_string(*file_size - expected) +
                         " extra bytes after the data (" + promise + ")");
    }
    // A size the machine cannot hold fails now (a sparse file can claim any size).
    lazy::detail::check_fits_in_memory(numel, path + ": the data (" + promise + ")");
    try {
      a.data.reserve(static_cast<std::size_t>(numel));  // the size is known: one allocation
    } catch (const std::bad_alloc&) {
      throw OutOfMemoryError(path + ": cannot allocate " + lazy::detail::byte_size_text(numel) + " for the data (" +
                             promise + ")");
    }
  }
  constexpr std::size_t kChunk = std::size_t{1} << 20;
  std::size_t have = 0;
  try {
    while (have < numel) {
      const std::size_t want = static_cast<std::size_t>(std::min<std::uint64_t>(kChunk, numel - have));
      a.data.resize(have + want);
      const std::size_t g = src.read(a.data.data() + have, want);
      have += g;
      if (g < want) {
        if (file_size) idx_fail(path, "the file shrank while being read");
        idx_fail(path, "truncated: " + promise + ", the decompressed data holds " + std::to_string(have));
      }
    }
  } catch (const std::bad_alloc&) {
    throw OutOfMemoryError(path + ": out of memory after reading " + lazy::detail::byte_size_text(have) +
                           " of the data (" + promise + ")");
  }
  std::uint64_t extra = 0;
  unsigned char sink[4096];
  for (std::size_t g; (g = src.read(sink, sizeof sink)) > 0;) extra += g;
  if (extra)
    idx_fail(path,
             "corrupt: " + std::to_string(extra) + " extra bytes after the data (" + promise + ")");
  return a;
}

}  // namespace detail

/// Reads an IDX file of unsigned bytes, raw or gzip-compressed. IoError when the file
/// cannot be opened or read; FormatError naming the file and what was expected vs found
/// for anything malformed (magic, element type, dimensions, size, compressed data).
IdxArray read_idx(const std::string& path);

#if LAZYTENSOR_HEADER_DEFINITIONS
LAZYTENSOR_INLINE std::int64_t IdxArray::numel() const {
  std::int64_t n = 1;
  for (const auto d : dims) n *= d;
  return n;
}

namespace detail {

LAZYTENSOR_INLINE const char* idx_type_name(unsigned code) {
  switch (code) {
    case 0x08:
      return "unsigned byte";
    case 0x09:
      return "signed byte";
    case 0x0B:
      return "int16";
    case 0x0C:
      return "int32";
    case 0x0D:
      return "float32";
    case 0x0E:
      return "float64";
    default:
      return nullptr;
  }
}

LAZYTENSOR_INLINE std::string hex_byte(unsigned b) {
  char s[8];
  std::snprintf(s, sizeof s, "%02x", b & 0xFFu);
  return s;
}

#if LAZYTENSOR_WITH_ZLIB
LAZYTENSOR_INLINE GzipSource::GzipSource(io::detail::ReadFile& f)
    // The input buffer is never larger than the file: a small file costs a small buffer.
    : f_(f), in_(static_cast<std::size_t>(std::min<std::uint64_t>(1 << 16, f.size() + 1))) {
  if (inflateInit2(&zs_, 16 + MAX_WBITS) != Z_OK)  // the only failure left: memory
    throw OutOfMemoryError("cannot allocate zlib's inflate state");
}

LAZYTENSOR_INLINE std::size_t GzipSource::read(void* dst, std::size_t n) {
  auto* out = static_cast<Bytef*>(dst);
  std::size_t done = 0;
  while (done < n) {
    if (zs_.avail_in == 0 && !eof_) refill();
    if (member_done_) {
      if (zs_.avail_in == 0) break;  // clean end of the last member
      if (zs_.next_in[0] != 0x1f)
        fail("data after the end of the gzip stream is not another gzip member");
      if (inflateReset(&zs_) != Z_OK) fail("cannot restart for the next gzip member");
      member_done_ = false;
    }
    if (zs_.avail_in == 0)
      fail("truncated gzip stream (the compressed data ends before its end-of-stream marker)");
    const auto room = static_cast<uInt>(std::min<std::size_t>(n - done, UINT_MAX));
    zs_.next_out = out + done;
    zs_.avail_out = room;
    const int rc = inflate(&zs_, Z_NO_FLUSH);
    done += room - zs_.avail_out;
    if (rc == Z_STREAM_END)
      member_done_ = true;
    else if (rc == Z_MEM_ERROR)
      throw OutOfMemoryError("zlib ran out of memory while inflating");
    else if (rc != Z_OK && rc != Z_BUF_ERROR)
      fail(std::string("corrupt gzip data (") + (zs_.msg ? zs_.msg : "inflate error") + ")");
  }
  return done;
}

LAZYTENSOR_INLINE void GzipSource::refill() {
  const std::size_t got = f_.read(in_.data(), in_.size());
  zs_.next_in = in_.data();
  zs_.avail_in = static_cast<uInt>(got);
  eof_ = got == 0;
}

LAZYTENSOR_INLINE void GzipSource::fail(const std::string& what) {
  throw FormatError(f_.path() + ": " + what);
}
#endif  // LAZYTENSOR_WITH_ZLIB

LAZYTENSOR_INLINE void idx_fail(const std::string& path, const std::string& what) {
  throw FormatError(path + ": " + what);
}

}  // namespace detail

LAZYTENSOR_INLINE IdxArray read_idx(const std::string& path) {
  io::detail::ReadFile file(path);
  unsigned char magic[2] = {0, 0};
  const bool gzip = file.read_at(magic, 2, 0) == 2 && magic[0] == 0x1f && magic[1] == 0x8b;
  if (gzip) {
#if LAZYTENSOR_WITH_ZLIB
    detail::GzipSource src(file);
    return detail::parse_idx(src, path, std::nullopt);
#else
    throw IoError(path +
                  ": the file is gzip-compressed, but lazytensor was compiled without zlib "
                  "(install zlib's headers and link ZLIB::ZLIB)");
#endif
  }
  detail::RawSource src(file);
  return detail::parse_idx(src, path, file.size());
}
#endif  // LAZYTENSOR_HEADER_DEFINITIONS

}  // namespace lazy::data
