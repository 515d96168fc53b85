// Tests of data/idx.hpp and data/mnist.hpp: IDX files written here (raw, and gzip'd with
// zlib's deflate) read back; every malformed variant raises FormatError; the real
// Fashion-MNIST files (Debian's dataset-fashion-mnist) checked against an independent
// decode with zlib's gz* API.

#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "testing/helpers.hpp"

#include <lazytensor/data/idx.hpp>
#include <lazytensor/data/mnist.hpp>
#include <lazytensor/tensor.hpp>

namespace {

using Bytes = std::vector<std::uint8_t>;
using lazy::data::read_idx;

// A directory of this file's own in the process's scratch directory (removed at exit).
std::string temp_dir() {
  static const std::string dir = lazy_tests::scratch_subdir("idx");
  return dir;
}

std::string write_file(const std::string& name, const Bytes& bytes) {
  const std::string path = temp_dir() + "/" + name;
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  return path;
}

// An IDX file of unsigned bytes: 00 00 08 rank, big-endian dims, data.
Bytes idx_bytes(const std::vector<std::uint32_t>& dims, const Bytes& data,
                std::uint8_t type = 0x08) {
  Bytes b{0, 0, type, static_cast<std::uint8_t>(dims.size())};
  for (auto d : dims) {
    b.push_back(static_cast<std::uint8_t>(d >> 24));
    b.push_back(static_cast<std::uint8_t>(d >> 16));
    b.push_back(static_cast<std::uint8_t>(d >> 8));
    b.push_back(static_cast<std::uint8_t>(d));
  }
  b.insert(b.end(), data.begin(), data.end());
  return b;
}

// gzip-compresses with zlib's deflate (the reader uses inflate: an independent path).
Bytes gzip(const Bytes& raw) {
  z_stream zs{};
  EXPECT_EQ(deflateInit2(&zs, 9, Z_DEFLATED, 16 + MAX_WBITS, 8, Z_DEFAULT_STRATEGY), Z_OK);
  Bytes out(deflateBound(&zs, static_cast<uLong>(raw.size())) + 64);
  zs.next_in = const_cast<Bytef*>(raw.data());
  zs.avail_in = static_cast<uInt>(raw.size());
  zs.next_out = out.data();
  zs.avail_out = static_cast<uInt>(out.size());
  EXPECT_EQ(deflate(&zs, Z_FINISH), Z_STREAM_END);
  out.resize(zs.total_out);
  deflateEnd(&zs);
  return out;
}

Bytes pattern(std::size_t n) {
  Bytes b(n);
  for (std::size_t i = 0; i < n; ++i) b[i] = static_cast<std::uint8_t>((i * 37 + 11) % 256);
  return b;
}

// Expects FormatError whose message names the file.
void expect_format_error(const std::string& path, const std::string& what) {
  try {
    read_idx(path);
    ADD_FAILURE() << what << ": expected FormatError";
  } catch (const lazy::FormatError& e) {
    EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << what << ": expected FormatError, got " << e.what();
  }
}

TEST(Idx, RawAndGzipRoundTrip) {
  const Bytes data = pattern(3 * 4 * 5);
  const Bytes file = idx_bytes({3, 4, 5}, data);
  for (const auto& [name, bytes] : {std::pair{std::string("a-idx3-ubyte"), file},
                                    std::pair{std::string("a-idx3-ubyte.gz"), gzip(file)},
                                    // detection is by content: gzip without .gz, raw with .gz
                                    std::pair{std::string("b-idx3-ubyte"), gzip(file)},
                                    std::pair{std::string("b-idx3-ubyte.gz"), file}}) {
    const auto a = read_idx(write_file(name, bytes));
    EXPECT_EQ(a.dims, (std::vector<std::int64_t>{3, 4, 5})) << name;
    EXPECT_EQ(a.data, data) << name;
    EXPECT_EQ(a.numel(), 60);
  }
  const auto labels =
      read_idx(write_file("l-idx1-ubyte", idx_bytes({7}, Bytes{0, 1, 2, 3, 4, 5, 255})));
  EXPECT_EQ(labels.dims, std::vector<std::int64_t>{7});
  EXPECT_EQ(labels.data, (Bytes{0, 1, 2, 3, 4, 5, 255}));
}

TEST(Idx, LargeGzipAndConcatenatedMembers) {
  const Bytes data = pattern(3 << 20);  // several of the reader's chunks
  const Bytes file = idx_bytes({3, 1024, 1024}, data);
  EXPECT_EQ(read_idx(write_file("big.gz", gzip(file))).data, data);
  // gzip -c a b > c: two members, one stream of bytes
  const std::size_t cut = 1000;
  Bytes two = gzip(Bytes(file.begin(), file.begin() + cut));
  const Bytes rest = gzip(Bytes(file.begin() + cut, file.end()));
  two.insert(two.end(), rest.begin(), rest.end());
  EXPECT_EQ(read_idx(write_file("two.gz", two)).data, data);
}

TEST(Idx, MalformedHeadersAreFormatErrors) {
  const Bytes data = pattern(6);
  struct Case {
    const char* name;
    Bytes bytes;
  };
  const std::vector<Case> cases = {
      {"magic byte 0",
       [&] {
         auto b = idx_bytes({6}, data);
         b[0] = 1;
         return b;
       }()},
      {"magic byte 1",
       [&] {
         auto b = idx_bytes({6}, data);
         b[1] = 8;
         return b;
       }()},
      {"float type (unsupported)", idx_bytes({6}, data, 0x0D)},
      {"int32 type (unsupported)", idx_bytes({6}, data, 0x0C)},
      {"unknown type", idx_bytes({6}, data, 0x07)},
      {"rank 0", idx_bytes({}, data)},
      {"rank 9", idx_bytes({1, 1, 1, 1, 1, 1, 1, 1, 6}, data)},
      {"zero dim", idx_bytes({2, 0, 3}, data)},
      {"zero leading dim", idx_bytes({0}, {})},
      {"product overflows 64 bits", idx_bytes({0xFFFFFFFFu, 0xFFFFFFFFu, 0xFFFFFFFFu}, data)},
      {"2^60 elements claimed", idx_bytes({1u << 30, 1u << 30}, data)},
      {"extra bytes", idx_bytes({5}, data)},
      {"too few bytes", idx_bytes({7}, data)},
      {"text file", Bytes{'h', 'e', 'l', 'l', 'o', '\n'}},
      {"empty file", Bytes{}},
  };
  for (const auto& c : cases) {
    const std::string raw = write_file("bad-raw", c.bytes);
    expect_format_error(raw, c.name);
    const std::string gz = write_file("bad.gz", gzip(c.bytes));
    expect_format_error(gz, std::string(c.name) + " (gzip)");
  }
}

TEST(Idx, TruncatedAtEveryByteIsAFormatError) {
  const Bytes file = idx_bytes({2, 3, 4}, pattern(24));
  for (std::size_t len = 0; len < file.size(); ++len) {
    expect_format_error(
        write_file("trunc", Bytes(file.begin(), file.begin() + static_cast<std::ptrdiff_t>(len))),
        "raw truncated at " + std::to_string(len));
  }
  // a compressed file cut anywhere: either the IDX data or the gzip stream is short
  const Bytes gz = gzip(idx_bytes({64, 64}, pattern(4096)));
  for (std::size_t len = 0; len < gz.size(); ++len) {
    expect_format_error(
        write_file("trunc.gz", Bytes(gz.begin(), gz.begin() + static_cast<std::ptrdiff_t>(len))),
        "gzip truncated at " + std::to_string(len));
  }
}

TEST(Idx, CorruptGzipIsAFormatError) {
  const Bytes file = idx_bytes({10, 10}, pattern(100));
  const Bytes gz = gzip(file);
  auto flipped = [&](std::size_t pos) {
    Bytes b = gz;
    b[pos] ^= 0x5A;
    return b;
  };
  expect_format_error(write_file("crc.gz", flipped(gz.size() - 8)), "CRC32 trailer");
  expect_format_error(write_file("len.gz", flipped(gz.size() - 2)), "length trailer");
  expect_format_error(write_file("method.gz", flipped(2)), "compression method");
  expect_format_error(write_file("body.gz", flipped(gz.size() / 2)), "deflate body");
  Bytes garbage = gz;
  garbage.push_back('x');
  expect_format_error(write_file("garbage.gz", garbage), "trailing garbage");
  Bytes extra = gzip(idx_bytes({10, 10}, pattern(101)));  // one decompressed byte too many
  expect_format_error(write_file("extra.gz", extra), "extra decompressed bytes");
}

// A gzip file whose header claims far more than it holds: the buffer grows with the data
// that arrives, so the read ends in FormatError (truncated) with memory near the 32 MiB that
// arrived. Reserving from the compressed size (x1032, deflate's largest ratio) asked for
// ~35 GB here: std::bad_alloc on a 24 GiB machine.
TEST(Idx, GzipClaimFarBeyondItsDataIsAFormatError) {
  Bytes data(std::size_t{32} << 20);
  std::uint64_t x = 88172645463325252ull;  // xorshift: incompressible bytes
  for (auto& b : data) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    b = static_cast<std::uint8_t>(x >> 24);
  }
  expect_format_error(write_file("claim.gz", gzip(idx_bytes({1u << 30, 1u << 30}, data))),
                      "2^60 bytes claimed, 32 MiB present");
}

// A sparse file: a consistent header and an apparent size twice this machine's memory, next
// to nothing on disk. The reader refuses at once with OutOfMemoryError naming the file and
// the size, instead of asking the allocator for it (std::bad_alloc) or reading zeros.
TEST(Idx, FileLargerThanMemoryIsAnOutOfMemoryError) {
  const std::uint64_t memory = lazy::detail::physical_memory_bytes();
  ASSERT_GT(memory, 0u);
  const std::uint32_t rows = 1u << 20;
  const auto cols = static_cast<std::uint32_t>(2 * memory / rows + 1);
  const std::string path = write_file("sparse", idx_bytes({rows, cols}, {}));
  struct Unlink {
    std::string p;
    ~Unlink() { ::unlink(p.c_str()); }
  } cleanup{path};
  if (::truncate(path.c_str(), static_cast<off_t>(12 + std::uint64_t{rows} * cols)) != 0) {
    GTEST_SKIP() << "this file system cannot hold a sparse file of twice the memory (errno " << errno << ")";
  }
  try {
    read_idx(path);
    ADD_FAILURE() << "read a file larger than memory";
  } catch (const lazy::OutOfMemoryError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find(path), std::string::npos) << m;
    EXPECT_NE(m.find(std::to_string(std::uint64_t{rows} * cols) + " bytes"), std::string::npos) << m;
    EXPECT_NE(m.find("more than this machine's memory"), std::string::npos) << m;
  }
}

TEST(Idx, RandomDamageNeverCrashes) {
  // Whatever is flipped, the reader returns an array or raises FormatError (ASan-checked).
  const Bytes gz = gzip(idx_bytes({4, 8}, pattern(32)));
  std::uint64_t state = 12345;
  for (int trial = 0; trial < 300; ++trial) {
    Bytes b = gz;
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    b[(state >> 33) % b.size()] ^= static_cast<std::uint8_t>(1u << ((state >> 20) % 8));
    try {
      read_idx(write_file("fuzz.gz", b));
    } catch (const lazy::FormatError&) {
    }
  }
}

TEST(Idx, UnreadableFilesAreIoErrors) {
  EXPECT_THROW(read_idx(temp_dir() + "/does-not-exist"), lazy::IoError);
  EXPECT_THROW(read_idx(temp_dir()), lazy::IoError);  // a directory
}

// ---- MNIST on small synthetic files ---------------------------------------------------

std::string mnist_dir(const std::string& name, std::uint32_t images, std::uint32_t labels,
                      std::uint8_t max_label = 9) {
  const std::string dir = temp_dir() + "/" + name;
  ::mkdir(dir.c_str(), 0755);
  const std::string sub = name + "/";
  write_file(sub + "t10k-images-idx3-ubyte", idx_bytes({images, 2, 3}, pattern(images * 6)));
  Bytes l;
  for (std::uint32_t i = 0; i < labels; ++i)
    l.push_back(static_cast<std::uint8_t>(i % (max_label + 1u)));
  write_file(sub + "t10k-labels-idx1-ubyte.gz", gzip(idx_bytes({labels}, l)));
  return dir;
}

TEST(Mnist, SmallFilesAndValidation) {
  const lazy::data::MNIST m(mnist_dir("ok", 5, 5), lazy::data::MNIST::Mode::Test);
  ASSERT_EQ(m.size(), 5u);
  EXPECT_FALSE(m.is_train());
  const Bytes px = pattern(30);
  const auto b = m.get_batch({4, 0});
  EXPECT_EQ(b.data.shape(), (lazy::Shape{2, 1, 2, 3}));
  EXPECT_EQ(b.target.shape(), (lazy::Shape{2}));
  const auto v = b.data.to_vector();
  for (std::size_t k = 0; k < 6; ++k) {
    EXPECT_EQ(v[k], static_cast<float>(px[24 + k]) / 255.0f);
    EXPECT_EQ(v[6 + k], static_cast<float>(px[k]) / 255.0f);
  }
  EXPECT_EQ(b.target.to_vector(), (std::vector<std::int64_t>{4, 0}));
  const auto e = m.get(3);
  EXPECT_EQ(e.data.shape(), (lazy::Shape{1, 2, 3}));
  EXPECT_EQ(e.target.shape(), lazy::Shape{});
  EXPECT_EQ(e.target.item(), 3);
  EXPECT_THROW(m.get(5), lazy::IndexError);
  EXPECT_THROW(m.get_batch({0, 9}), lazy::IndexError);

  EXPECT_THROW(lazy::data::MNIST(mnist_dir("count", 5, 4), lazy::data::MNIST::Mode::Test),
               lazy::FormatError);
  EXPECT_THROW(lazy::data::MNIST(mnist_dir("label", 12, 12, 10), lazy::data::MNIST::Mode::Test),
               lazy::FormatError);
  EXPECT_THROW(lazy::data::MNIST(mnist_dir("ok", 5, 5), lazy::data::MNIST::Mode::Train),
               lazy::IoError);
}

// ---- the real Fashion-MNIST ----------------------------------------------------------

std::string fashion_dir() {
  const char* env = std::getenv("LAZYTENSOR_FASHION_MNIST_DIR");
  return env ? env : "/usr/share/datasets/fashion-mnist";
}

// The whole decompressed file, through zlib's gz* API (not the reader's inflate loop).
Bytes gunzip_file(const std::string& path) {
  gzFile f = gzopen(path.c_str(), "rb");
  EXPECT_NE(f, nullptr) << path << " (install Debian's dataset-fashion-mnist)";
  if (!f) return {};
  Bytes out;
  unsigned char buf[1 << 16];
  int n;
  while ((n = gzread(f, buf, sizeof buf)) > 0) out.insert(out.end(), buf, buf + n);
  gzclose(f);
  return out;
}

std::uint32_t be32(const Bytes& b, std::size_t at) {
  return (std::uint32_t{b[at]} << 24) | (std::uint32_t{b[at + 1]} << 16) |
         (std::uint32_t{b[at + 2]} << 8) | b[at + 3];
}

TEST(FashionMnist, RealFilesMatchAnIndependentDecode) {
  for (const auto mode : {lazy::data::MNIST::Mode::Train, lazy::data::MNIST::Mode::Test}) {
    const bool train = mode == lazy::data::MNIST::Mode::Train;
    const std::string prefix = fashion_dir() + (train ? "/train" : "/t10k");
    const lazy::data::MNIST m(fashion_dir(), mode);
    const std::size_t n = train ? 60000 : 10000;
    ASSERT_EQ(m.size(), n);
    EXPECT_EQ(m.rows(), 28);
    EXPECT_EQ(m.cols(), 28);

    const Bytes images = gunzip_file(prefix + "-images-idx3-ubyte.gz");
    const Bytes labels = gunzip_file(prefix + "-labels-idx1-ubyte.gz");
    ASSERT_EQ(images.size(), 16 + n * 784);
    ASSERT_EQ(labels.size(), 8 + n);
    EXPECT_EQ(be32(images, 0), 0x00000803u);  // unsigned bytes, 3 dims
    EXPECT_EQ(be32(images, 4), n);
    EXPECT_EQ(be32(labels, 0), 0x00000801u);
    EXPECT_EQ(Bytes(labels.begin() + 8, labels.end()), m.labels());

    // Fashion-MNIST is balanced: 10 classes of n / 10 items.
    std::vector<std::size_t> histogram(10, 0);
    for (auto l : m.labels()) {
      ASSERT_LT(l, 10);
      histogram[l]++;
    }
    std::size_t total = 0;
    for (auto h : histogram) {
      EXPECT_EQ(h, n / 10);
      total += h;
    }
    EXPECT_EQ(total, n);

    const std::vector<std::size_t> picks{0, 1, 777, n / 2, n - 1};
    const auto batch = m.get_batch(picks);
    ASSERT_EQ(batch.data.shape(), (lazy::Shape{5, 1, 28, 28}));
    const auto px = batch.data.to_vector();
    const auto tg = batch.target.to_vector();
    for (std::size_t b = 0; b < picks.size(); ++b) {
      EXPECT_EQ(tg[b], labels[8 + picks[b]]);
      for (std::size_t k = 0; k < 784; ++k) {
        const std::uint8_t p = images[16 + picks[b] * 784 + k];
        ASSERT_EQ(px[b * 784 + k], static_cast<float>(p) / 255.0f)
            << "image " << picks[b] << " pixel " << k;
      }
    }

    // Normalize folded into the conversion equals normalizing the [0, 1] floats.
    const lazy::data::transforms::Normalize norm(0.2860, 0.3530);
    const auto folded = m.map(norm).get_batch(picks).data.to_vector();
    for (std::size_t i = 0; i < px.size(); ++i)
      ASSERT_EQ(folded[i], (px[i] - 0.2860f) / 0.3530f) << i;
  }
}

}  // namespace
