#pragma once
// safetensors files (https://github.com/huggingface/safetensors), readable by the Python
// `safetensors` package:
//
//   [8 bytes]  N, the header length, unsigned little-endian
//   [N bytes]  a JSON object: "name": {"dtype": "F32", "shape": [2, 3], "data_offsets": [b, e]}
//              per tensor, plus an optional "__metadata__": {string: string}; padded with
//              spaces so that the data starts 8-byte aligned
//   [rest]     the tensors' bytes, little-endian, row-major; offsets are relative to the
//              start of this buffer, and the tensors tile it exactly (no gap, no overlap,
//              nothing after the last one)
//
// Writing streams one tensor at a time into a temporary file that replaces the target
// atomically; reading validates the whole header against the file size before allocating
// anything, then reads each tensor straight into a buffer of the target device.

#include <algorithm>
#include <bit>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <numeric>
#include <string>
#include <string_view>
#include <unordered_set>
#include <utility>
#include <vector>

#include <lazytensor/any_tensor.hpp>
#include <lazytensor/core/buffer.hpp>
#include <lazytensor/core/config.hpp>
#include <lazytensor/core/error.hpp>
#include <lazytensor/io/file.hpp>
#include <lazytensor/io/json.hpp>
#include <lazytensor/io/shard_index.hpp>
#include <lazytensor/io/stored_dtype.hpp>
#include <lazytensor/state_dict.hpp>

namespace lazy::io {

namespace detail {

static_assert(
    std::endian::native == std::endian::little,
    "lazy::io writes tensor bytes as they are in memory; safetensors needs little-endian");

/// Largest header accepted (and written): the limit of the reference implementation.
inline constexpr std::uint64_t kMaxSafetensorsHeader = 100'000'000;

/// One tensor as the header describes it.
struct SafetensorsEntry {
  std::string name;
  const StoredDType* stored = nullptr;  ///< as in the file
  DType dtype = DType::Float32;  ///< the dtype that holds it in memory
  Shape shape;
  std::uint64_t begin = 0;  ///< data_offsets, relative to the data buffer
  std::uint64_t end = 0;
};

/// A parsed header: tensors in header order, and the metadata.
struct SafetensorsHeader {
  std::vector<SafetensorsEntry> tensors;
  std::map<std::string, std::string> metadata;
};

void parse_tensor_entry(JsonCursor& cur, SafetensorsEntry& e);

/// Parses a header strictly; FormatError("<path>: ...") on anything malformed.
SafetensorsHeader parse_safetensors_header(std::string_view text, const std::string& path);

/// Checks that the tensors tile a data buffer of `buffer_bytes` exactly: each tensor's
/// byte range matches its shape and dtype, ranges neither overlap nor leave gaps, and the
/// last one ends where the file ends. FormatError("<path>: ...") otherwise.
void check_safetensors_layout(const SafetensorsHeader& h, std::uint64_t buffer_bytes,
                              const std::string& path);

/// The header text (padded to 8 bytes) for `sd`, whose tensors are stored as `stored` and
/// laid out in `order`.
std::string safetensors_header(const StateDict& sd, const std::vector<const StoredDType*>& stored,
                               const std::vector<std::size_t>& order);

/// Rejects what the format cannot store (before anything is written) and returns the dtype
/// each tensor is stored as: its own, or its entry in sd.stored_dtypes(), which must name a
/// tensor of the dict, a dtype that the tensor's dtype holds, and values that fit.
std::vector<const StoredDType*> check_saveable(const StateDict& sd, const std::string& path);

}  // namespace detail

/// Writes `sd` (tensors and metadata) to `path` as a safetensors file. Each tensor is
/// materialized and written in turn (the file is never assembled in memory), into a
/// temporary file in the same directory that is fsynced and renamed over `path`: a failure
/// leaves any previous file intact and no temporary file behind. Disk errors raise IoError;
/// an error computing a pending tensor propagates as is. Data are laid out by decreasing
/// element size (so each tensor is aligned to its element size, as the reference writer
/// does); the header lists tensors in the state dict's order.
void save_file(const StateDict& sd, const std::string& path);

/// Reads a safetensors file into a state dict (tensors in header order, materialized on
/// `dev`; the "__metadata__" entries in metadata()). IoError when the file cannot be read;
/// FormatError naming the file and the problem when it is not a valid safetensors file.
/// BOOL, I32, I64, BF16, F32 and F64 load as they are; F16 loads into float, U8, I8, I16 and
/// U16 into int32, U32 into int64 (all exact), each such tensor's file dtype recorded in
/// stored_dtypes() so that save_file writes it back; U64 and the 8-bit-or-smaller float
/// dtypes raise FormatError naming the dtype. Nothing is allocated for a tensor before the
/// whole header has been checked against the file's size.
/// A shard index (io::save with SaveOptions::shard_files, see shard_index.hpp) loads as the
/// whole tensors, assembled from its shard files.
StateDict load(const std::string& path, Device dev = device());

namespace detail {
/// load of one safetensors file.
StateDict load_safetensors_file(const std::string& path, Device dev);
}  // namespace detail

#if LAZYTENSOR_HEADER_DEFINITIONS
namespace detail {

LAZYTENSOR_INLINE void parse_tensor_entry(JsonCursor& cur, SafetensorsEntry& e) {
  const std::string ctx = "tensor '" + e.name + "': ";
  bool have_dtype = false, have_shape = false, have_offsets = false;
  cur.expect('{');
  if (!cur.accept('}')) {
    for (;;) {
      const std::string key = cur.string();
      cur.expect(':');
      if (key == "dtype") {
        if (have_dtype) cur.fail(ctx + "duplicate key 'dtype'");
        have_dtype = true;
        const std::string name = cur.string();
        std::string why;
        e.stored = find_stored_dtype(name, &why);
        if (!e.stored) cur.fail(ctx + why);
        e.dtype = e.stored->holds;
      } else if (key == "shape") {
        if (have_shape) cur.fail(ctx + "duplicate key 'shape'");
        have_shape = true;
        cur.expect('[');
        if (!cur.accept(']')) {
          for (;;) {
            if (e.shape.rank() == kMaxRank) {
              cur.fail(ctx + "shape has more than " + std::to_string(kMaxRank) +
                       " dimensions (the maximum rank)");
            }
            const std::uint64_t d = cur.uint64();
            if (d > static_cast<std::uint64_t>(INT64_MAX))
              cur.fail(ctx + "dimension " + std::to_string(d) + " is too large");
            try {
              e.shape.push_back(static_cast<std::int64_t>(d));
            } catch (const ShapeError& err) {
              cur.fail(ctx + err.what());
            }
            if (cur.accept(']')) break;
            cur.expect(',');
          }
        }
      } else if (key == "data_offsets") {
        if (have_offsets) cur.fail(ctx + "duplicate key 'data_offsets'");
        have_offsets = true;
        cur.expect('[');
        e.begin = cur.uint64();
        cur.expect(',');
        e.end = cur.uint64();
        if (cur.peek() != ']')
          cur.fail(ctx + "data_offsets must hold exactly two numbers [begin, end]");
        cur.expect(']');
      } else {
        cur.fail(ctx + "unexpected key '" + key + "' (expected dtype, shape and data_offsets)");
      }
      if (cur.accept('}')) break;
      cur.expect(',');
    }
  }
  if (!have_dtype) cur.fail(ctx + "missing 'dtype'");
  if (!have_shape) cur.fail(ctx + "missing 'shape'");
  if (!have_offsets) cur.fail(ctx + "missing 'data_offsets'");
}

LAZYTENSOR_INLINE SafetensorsHeader parse_safetensors_header(std::string_view text,
                                                             const std::string& path) {
  SafetensorsHeader h;
  JsonCursor cur(text, path);
  if (text.empty() || text.front() != '{')
    cur.fail("the header must be a JSON object starting with '{', found " + cur.found());
  std::unordered_set<std::string> keys;
  cur.expect('{');
  if (!cur.accept('}')) {
    for (;;) {
      std::string key = cur.string();
      cur.expect(':');
      if (!keys.insert(key).second) cur.fail("duplicate key '" + key + "'");
      if (key == "__metadata__") {
        cur.expect('{');
        if (!cur.accept('}')) {
          for (;;) {
            std::string k = cur.string();
            cur.expect(':');
            if (cur.peek() != '"')
              cur.fail("__metadata__ value of '" + k + "' must be a string, found " + cur.found());
            std::string v = cur.string();
            if (!h.metadata.emplace(k, std::move(v)).second)
              cur.fail("duplicate __metadata__ key '" + k + "'");
            if (cur.accept('}')) break;
            cur.expect(',');
          }
        }
      } else {
        SafetensorsEntry e;
        e.name = std::move(key);
        parse_tensor_entry(cur, e);
        h.tensors.push_back(std::move(e));
      }
      if (cur.accept('}')) break;
      cur.expect(',');
    }
  }
  cur.skip_ws();  // writers pad the header with spaces
  if (!cur.at_end()) cur.fail("unexpected data after the header's JSON object: " + cur.found());
  return h;
}

LAZYTENSOR_INLINE void check_safetensors_layout(const SafetensorsHeader& h,
                                                std::uint64_t buffer_bytes,
                                                const std::string& path) {
  const auto& ts = h.tensors;
  const auto fail = [&](const std::string& what) { throw FormatError(path + ": " + what); };
  for (const auto& e : ts) {
    if (e.end < e.begin) {
      fail("tensor '" + e.name + "': data_offsets [" + std::to_string(e.begin) + ", " +
           std::to_string(e.end) + "] end before they begin");
    }
    std::uint64_t numel = 1;
    for (const auto d : e.shape) {
      if (__builtin_mul_overflow(numel, static_cast<std::uint64_t>(d), &numel)) {
        fail("tensor '" + e.name + "': shape " + e.shape.str() +
             " has more elements than 64 bits can count");
      }
    }
    std::uint64_t nbytes = 0;
    if (__builtin_mul_overflow(numel, static_cast<std::uint64_t>(e.stored->size), &nbytes)) {
      fail("tensor '" + e.name + "': shape " + e.shape.str() +
           " has more bytes than 64 bits can count");
    }
    if (e.end - e.begin != nbytes) {
      fail("tensor '" + e.name + "': shape " + e.shape.str() + " of " +
           e.stored->name + " needs " + std::to_string(nbytes) +
           " bytes, but data_offsets [" + std::to_string(e.begin) + ", " + std::to_string(e.end) +
           "] hold " + std::to_string(e.end - e.begin));
    }
  }
  std::vector<std::size_t> order(ts.size());
  std::iota(order.begin(), order.end(), std::size_t{0});
  std::sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
    return std::pair(ts[a].begin, ts[a].end) < std::pair(ts[b].begin, ts[b].end);
  });
  std::uint64_t pos = 0;
  std::string prev = "the start of the data buffer";
  for (const std::size_t k : order) {
    const auto& e = ts[k];
    if (e.begin < pos) {
      fail("tensor '" + e.name + "' (data_offsets [" + std::to_string(e.begin) + ", " +
           std::to_string(e.end) + "]) overlaps " + prev + ", which ends at byte " +
           std::to_string(pos));
    }
    if (e.begin > pos) {
      fail("gap of " + std::to_string(e.begin - pos) + " bytes between " + prev +
           " (ends at byte " + std::to_string(pos) + ") and tensor '" + e.name +
           "' (starts at byte " + std::to_string(e.begin) +
           "): the offsets must cover the data buffer contiguously");
    }
    pos = e.end;
    prev = "tensor '" + e.name + "'";
  }
  if (pos > buffer_bytes) {
    fail("truncated: the header describes " + std::to_string(pos) +
         " bytes of tensor data, but only " + std::to_string(buffer_bytes) +
         " bytes follow the header");
  }
  if (pos < buffer_bytes) {
    fail(std::to_string(buffer_bytes - pos) +
         " bytes of trailing data after the last tensor (the header describes " +
         std::to_string(pos) + " bytes of tensor data, " + std::to_string(buffer_bytes) +
         " follow the header)");
  }
}

LAZYTENSOR_INLINE std::string safetensors_header(const StateDict& sd,
                                                 const std::vector<const StoredDType*>& stored,
                                                 const std::vector<std::size_t>& order) {
  const auto& items = sd.items();
  const auto stored_bytes = [&](std::size_t k) {
    return static_cast<std::uint64_t>(items[k].second.numel()) * stored[k]->size;
  };
  std::vector<std::uint64_t> begin(items.size());
  std::uint64_t pos = 0;
  for (const std::size_t k : order) {
    begin[k] = pos;
    pos += stored_bytes(k);
  }
  std::string h = "{";
  if (!sd.metadata().empty()) {
    append_json_string(h, "__metadata__");
    h += ":{";
    bool first = true;
    for (const auto& [k, v] : sd.metadata()) {
      if (!first) h += ',';
      first = false;
      append_json_string(h, k);
      h += ':';
      append_json_string(h, v);
    }
    h += '}';
  }
  for (std::size_t k = 0; k < items.size(); ++k) {
    const AnyTensor& t = items[k].second;
    if (h.size() > 1) h += ',';
    append_json_string(h, items[k].first);
    h += ":{\"dtype\":\"";
    h += stored[k]->name;
    h += "\",\"shape\":[";
    for (int d = 0; d < t.shape().rank(); ++d) {
      if (d) h += ',';
      h += std::to_string(t.shape()[d]);
    }
    h += "],\"data_offsets\":[" + std::to_string(begin[k]) + "," +
         std::to_string(begin[k] + stored_bytes(k)) + "]}";
  }
  h += '}';
  h.append((8 - h.size() % 8) % 8, ' ');  // the data then starts 8-byte aligned
  return h;
}

LAZYTENSOR_INLINE std::vector<const StoredDType*> check_saveable(const StateDict& sd,
                                                                 const std::string& path) {
  const std::string cannot = "cannot save '" + path + "': ";
  for (const auto& [name, t] : sd) {
    if (!t.defined()) throw Error(cannot + "tensor '" + name + "' is undefined");
    if (name == "__metadata__")
      throw FormatError(cannot + "'__metadata__' is reserved by safetensors, not a tensor name");
    if (!valid_utf8(name))
      throw FormatError(cannot + "tensor name '" + name + "' is not valid UTF-8");
  }
  for (const auto& [k, v] : sd.metadata()) {
    if (!valid_utf8(k) || !valid_utf8(v))
      throw FormatError(cannot + "metadata entry '" + k + "' is not valid UTF-8");
  }
  for (const auto& [name, dtype_in_file] : sd.stored_dtypes()) {
    if (!sd.contains(name)) {
      throw FormatError(cannot + "stored_dtypes names '" + name +
                        "', which is not a tensor of the state dict");
    }
  }
  std::vector<const StoredDType*> stored;
  for (const auto& [name, t] : sd) {
    const auto it = sd.stored_dtypes().find(name);
    if (it == sd.stored_dtypes().end()) {
      stored.push_back(&native_stored_dtype(t.dtype()));
      continue;
    }
    std::string why;
    const StoredDType* s = find_stored_dtype(it->second, &why);
    if (!s) throw FormatError(cannot + "stored_dtypes['" + name + "']: " + why);
    if (s->holds != t.dtype()) {
      throw FormatError(cannot + "tensor '" + name + "' is " + dtype_name(t.dtype()) +
                        ", but stored_dtypes asks for " + s->name + ", which is held in " +
                        dtype_name(s->holds));
    }
    std::string value;
    const auto n = static_cast<std::size_t>(t.numel());
    std::size_t bad = n;
    if (!s->native && n != 0)
      t.visit([&](const auto& typed) { bad = find_out_of_range(*s, typed.data(), n, &value); });
    if (bad != n) {
      throw FormatError(cannot + "tensor '" + name + "': element " + std::to_string(bad) + " is " +
                        value + ", which " + s->name + " (its stored dtype) cannot hold");
    }
    stored.push_back(s);
  }
  return stored;
}

}  // namespace detail

LAZYTENSOR_INLINE void save_file(const StateDict& sd, const std::string& path) {
  const std::vector<const detail::StoredDType*> stored = detail::check_saveable(sd, path);
  const auto& items = sd.items();
  std::vector<std::size_t> order(items.size());
  std::iota(order.begin(), order.end(), std::size_t{0});
  std::stable_sort(order.begin(), order.end(),
                   [&](std::size_t a, std::size_t b) { return stored[a]->size > stored[b]->size; });
  const std::string header = detail::safetensors_header(sd, stored, order);
  if (header.size() > detail::kMaxSafetensorsHeader) {
    throw FormatError("cannot save '" + path + "': the header would take " +
                      std::to_string(header.size()) + " bytes, more than safetensors' limit of " +
                      std::to_string(detail::kMaxSafetensorsHeader));
  }
  detail::AtomicFileWriter out(path);
  unsigned char len[8];
  for (int i = 0; i < 8; ++i)
    len[i] = static_cast<unsigned char>(static_cast<std::uint64_t>(header.size()) >> (8 * i));
  out.write(len, sizeof len);
  out.write(header.data(), header.size());
  std::vector<unsigned char> staging;  // narrowed chunks of tensors stored in another dtype
  for (const std::size_t k : order) {
    const AnyTensor& t = items[k].second;
    const auto n = static_cast<std::size_t>(t.numel());
    if (n == 0) continue;
    const detail::StoredDType& s = *stored[k];
    t.visit([&](const auto& typed) {
      if (s.native) return out.write(typed.data(), n * s.size);
      constexpr std::size_t kChunk = detail::kConvertChunk;
      staging.resize(std::min(n, kChunk) * s.size);
      const auto* src = reinterpret_cast<const unsigned char*>(typed.data());
      for (std::size_t i = 0; i < n; i += kChunk) {
        const std::size_t m = std::min(kChunk, n - i);
        detail::narrow(s, src + i * dtype_size(t.dtype()), staging.data(), m);
        out.write(staging.data(), m * s.size);
      }
    });
  }
  out.commit();
}

LAZYTENSOR_INLINE StateDict load(const std::string& path, Device dev) {
  // A safetensors file starts with its header's length, 8 bytes little endian; a shard
  // index with `{"format`, which read as such a length would be ~2^63, far past the
  // header limit: no valid safetensors file starts that way.
  char head[8] = {};
  {
    detail::ReadFile file(path);
    if (file.read_at(head, sizeof head, 0) != sizeof head) head[0] = 0;
  }
  if (std::string_view(head, sizeof head) == "{\"format")
    return detail::load_shard_index(path, dev, &detail::load_safetensors_file);
  return detail::load_safetensors_file(path, dev);
}

LAZYTENSOR_INLINE StateDict detail::load_safetensors_file(const std::string& path, Device dev) {
  detail::ReadFile file(path);
  const std::uint64_t size = file.size();
  if (size < 8) {
    throw FormatError(path + ": file is " + std::to_string(size) +
                      " bytes long, too short for the 8-byte header length of a safetensors file");
  }
  unsigned char len[8];
  if (file.read_at(len, 8, 0) != 8)
    throw FormatError(path + ": file shrank while reading the header length");
  std::uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | len[i];
  if (n > detail::kMaxSafetensorsHeader) {
    throw FormatError(
        path + ": header length " + std::to_string(n) + " exceeds safetensors' limit of " +
        std::to_string(detail::kMaxSafetensorsHeader) + " bytes (corrupt length field?)");
  }
  if (n > size - 8) {
    throw FormatError(path + ": header length " + std::to_string(n) + " but only " +
                      std::to_string(size - 8) +
                      " bytes follow the length field (truncated file or wrong header length)");
  }
  std::string text(static_cast<std::size_t>(n), '\0');
  if (file.read_at(text.data(), text.size(), 8) != text.size())
    throw FormatError(path + ": file shrank while reading the header");
  const detail::SafetensorsHeader header = detail::parse_safetensors_header(text, path);
  const std::uint64_t data_start = 8 + n;
  detail::check_safetensors_layout(header, size - data_start, path);

  // The data is read whole into buffers: a file whose data the machine cannot hold (a sparse
  // file's apparent size, consistent with its header) fails at once, naming the size.
  std::uint64_t held_bytes = 0;  // wider than the file's data when dtypes are widened
  for (const auto& e : header.tensors)
    held_bytes += (e.end - e.begin) / e.stored->size * dtype_size(e.dtype);
  lazy::detail::check_fits_in_memory(held_bytes, path + ": the tensors' data");
  StateDict sd;
  graph::Device& engine = dev.engine();
  std::vector<unsigned char> staging;  // chunks of tensors stored in a dtype we widen
  for (const auto& e : header.tensors) {
    const std::size_t nbytes = static_cast<std::size_t>(e.end - e.begin);
    const std::size_t n = nbytes / e.stored->size;
    auto buf = engine.pool().acquire(padded_bytes(e.shape.numel(), dtype_size(e.dtype)));
    const auto shrank = [&] {
      return FormatError(path + ": file shrank while reading tensor '" + e.name + "'");
    };
    if (e.stored->native) {
      if (file.read_at(buf->data(), nbytes, data_start + e.begin) != nbytes) throw shrank();
    } else {
      constexpr std::size_t kChunk = detail::kConvertChunk;
      staging.resize(std::min(n, kChunk) * e.stored->size);
      auto* dst = static_cast<unsigned char*>(buf->data());
      for (std::size_t i = 0; i < n; i += kChunk) {
        const std::size_t m = std::min(kChunk, n - i), bytes = m * e.stored->size;
        if (file.read_at(staging.data(), bytes, data_start + e.begin + i * e.stored->size) != bytes)
          throw shrank();
        detail::widen(*e.stored, staging.data(), dst + i * dtype_size(e.dtype), m);
      }
      sd.stored_dtypes()[e.name] = e.stored->name;
    }
    if (e.dtype == DType::Bool) {
      // A byte other than 0/1 read as bool is undefined behaviour; such a file is corrupt.
      const auto* p = static_cast<const unsigned char*>(buf->data());
      for (std::size_t i = 0; i < nbytes; ++i) {
        if (p[i] > 1) {
          throw FormatError(path + ": tensor '" + e.name + "': BOOL element " + std::to_string(i) +
                            " is " + std::to_string(p[i]) + ", expected 0 or 1");
        }
      }
    }
    sd.insert(e.name, lazy::detail::any_of_node(std::make_shared<graph::DataNode>(e.dtype, e.shape, &engine,
                                                                          std::move(buf))));
  }
  sd.metadata() = header.metadata;
  return sd;
}
#endif  // LAZYTENSOR_HEADER_DEFINITIONS

}  // namespace lazy::io
