// Tests of io/safetensors.hpp (and io/json.hpp, io/file.hpp): bitwise round trips of every
// dtype, a file compared byte for byte with one assembled here from the format's
// description, every malformed variant rejected with FormatError, and atomic saves.

#include <dirent.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmath>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <iterator>
#include <limits>
#include <set>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "testing/helpers.hpp"

#include <lazytensor/tensor.hpp>
#include <lazytensor/io.hpp>
#include <lazytensor/ops/factories.hpp>
#include <lazytensor/ops/shape.hpp>

namespace {

using Bytes = std::vector<std::uint8_t>;
using lazy::AnyTensor;
using lazy::Shape;
using lazy::StateDict;

// A directory of this file's own in the process's scratch directory (removed at exit).
std::string temp_dir() {
  static const std::string dir = lazy_tests::scratch_subdir("safetensors");
  return dir;
}

std::string path_of(const std::string& name) { return temp_dir() + "/" + name; }

Bytes read_bytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return Bytes(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
}

std::string write_bytes(const std::string& name, const Bytes& b) {
  const std::string p = path_of(name);
  std::ofstream f(p, std::ios::binary | std::ios::trunc);
  f.write(reinterpret_cast<const char*>(b.data()), static_cast<std::streamsize>(b.size()));
  return p;
}

void append_le(Bytes& b, std::uint64_t v, int n) {
  for (int i = 0; i < n; ++i) b.push_back(static_cast<std::uint8_t>(v >> (8 * i)));
}

// A file from a header text (not padded unless the text is) and raw data.
Bytes file_of(const std::string& header, const Bytes& data) {
  Bytes b;
  append_le(b, header.size(), 8);
  b.insert(b.end(), header.begin(), header.end());
  b.insert(b.end(), data.begin(), data.end());
  return b;
}

Bytes bytes_of(const AnyTensor& t) {
  Bytes b(static_cast<std::size_t>(t.numel()) * lazy::dtype_size(t.dtype()));
  t.copy_bytes_to(b.data());
  return b;
}

std::set<std::string> dir_entries(const std::string& dir) {
  std::set<std::string> out;
  if (DIR* d = ::opendir(dir.c_str())) {
    while (dirent* e = ::readdir(d)) {
      const std::string n = e->d_name;
      if (n != "." && n != "..") out.insert(n);
    }
    ::closedir(d);
  }
  return out;
}

template <class T>
AnyTensor make(const std::vector<T>& v, const Shape& s) {
  return lazy::from_vector<T>(v, s);
}

// One tensor of every dtype and several awkward shapes, with extreme and special values.
StateDict sample_dict() {
  StateDict sd;
  const float nan_payload = [] {
    std::uint32_t bits = 0x7FC01234u;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
  }();
  sd.insert("f32", make<float>({1.5f, -0.0f, std::numeric_limits<float>::infinity(), nan_payload,
                                1e-45f, -3.25f},
                               Shape{2, 3}));
  sd.insert("f64", make<double>({std::numeric_limits<double>::max(), -1e-300, 0.1}, Shape{3}));
  sd.insert("i32", make<std::int32_t>({INT32_MIN, INT32_MAX, 0, -7}, Shape{2, 2}));
  sd.insert("i64", make<std::int64_t>({INT64_MIN, INT64_MAX, 42}, Shape{3, 1}));
  sd.insert("bool", make<bool>({true, false, false, true, true}, Shape{5}));
  std::vector<lazy::bfloat16> bf;
  for (std::uint16_t bits : {0x3F80, 0xBF80, 0x7F80, 0x0001, 0x8000, 0x7FC1})
    bf.push_back(lazy::bfloat16::from_bits(bits));
  sd.insert("bf16", make<lazy::bfloat16>(bf, Shape{3, 2}));
  sd.insert("scalar", make<double>({2.5}, Shape{}));
  sd.insert("empty", make<float>({}, Shape{0}));
  sd.insert("empty3d", make<std::int64_t>({}, Shape{3, 0, 2}));
  sd.insert("odd bool",
            make<bool>({true, true, false}, Shape{3}));  // 3 bytes: exercises alignment order
  sd.insert("big", lazy::arange<float>(1000));
  return sd;
}

void expect_same(const StateDict& a, const StateDict& b) {
  ASSERT_EQ(a.keys(), b.keys());
  for (const auto& [name, t] : a) {
    const AnyTensor& u = b.at(name);
    EXPECT_EQ(t.dtype(), u.dtype()) << name;
    EXPECT_EQ(t.shape(), u.shape()) << name;
    EXPECT_EQ(bytes_of(t), bytes_of(u)) << name;
  }
  EXPECT_EQ(a.metadata(), b.metadata());
}

TEST(Safetensors, RoundTripEveryDtypeBitwise) {
  StateDict sd = sample_dict();
  sd.metadata()["format"] = "pt";
  sd.metadata()["quote\"back\\slash"] = "line\nbreak\ttab\x01 é ☃ 🙂";
  const std::string p = path_of("all.safetensors");
  lazy::io::save_file(sd, p);
  const StateDict back = lazy::io::load(p);
  expect_same(sd, back);
  for (const auto& [name, t] : back) EXPECT_EQ(t.device(), lazy::Device(0)) << name;
  // onto another device
  const StateDict on1 = lazy::io::load(p, lazy::Device(1));
  expect_same(sd, on1);
  for (const auto& [name, t] : on1) EXPECT_EQ(t.device(), lazy::Device(1)) << name;
  // the data start 8-byte aligned and every tensor is aligned to its element size
  const Bytes raw = read_bytes(p);
  std::uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | raw[static_cast<std::size_t>(i)];
  EXPECT_EQ((8 + n) % 8, 0u);
}

TEST(Safetensors, SavesPendingTensorsAndEmptyDicts) {
  auto a = lazy::arange<float>(10);
  lazy::Tensor<float> pending = a * 3.0f + 1.0f;
  StateDict sd;
  sd.insert("y", pending);
  lazy::io::save_file(sd, path_of("pending.safetensors"));
  std::vector<float> want;
  for (int i = 0; i < 10; ++i) want.push_back(static_cast<float>(i) * 3.0f + 1.0f);
  EXPECT_EQ(lazy::io::load(path_of("pending.safetensors")).at("y").as<float>().to_vector(), want);

  StateDict empty;
  lazy::io::save_file(empty, path_of("empty.safetensors"));
  const Bytes want_bytes = file_of("{}      ", {});  // "{}" padded to 8 bytes with spaces
  EXPECT_EQ(read_bytes(path_of("empty.safetensors")), want_bytes);
  EXPECT_TRUE(lazy::io::load(path_of("empty.safetensors")).empty());
}

TEST(Safetensors, ByteExactAgainstAHandAssembledFile) {
  StateDict sd;
  sd.insert("w", make<float>({1.0f, -2.0f}, Shape{2}));
  sd.insert("n", make<std::int64_t>({5}, Shape{}));
  sd.metadata()["k"] = "v";
  const std::string p = path_of("tiny.safetensors");
  lazy::io::save_file(sd, p);

  // Header: compact JSON, __metadata__ first, tensors in insertion order; data laid out
  // by decreasing element size, so the I64 "n" comes first at [0, 8), then "w" at [8, 16).
  std::string header =
      R"({"__metadata__":{"k":"v"},"w":{"dtype":"F32","shape":[2],"data_offsets":[8,16]},)"
      R"("n":{"dtype":"I64","shape":[],"data_offsets":[0,8]}})";
  ASSERT_EQ(header.size(), 132u);
  header += "    ";  // padded to 136 bytes: 8 + 136 is a multiple of 8
  Bytes want;
  append_le(want, 136, 8);
  want.insert(want.end(), header.begin(), header.end());
  append_le(want, 5, 8);                                              // int64 5, little-endian
  for (std::uint8_t b : {0x00, 0x00, 0x80, 0x3F}) want.push_back(b);  // 1.0f = 0x3F800000
  for (std::uint8_t b : {0x00, 0x00, 0x00, 0xC0}) want.push_back(b);  // -2.0f = 0xC0000000
  EXPECT_EQ(read_bytes(p), want);
}

TEST(Safetensors, ReadsOtherValidSpellings) {
  // Pretty-printed, keys in another order, tensors listed out of data order, escapes in
  // names, padding with spaces and newlines: all valid JSON, as other writers produce.
  const std::string header =
      "{\n  \"b\\u00e9\\/x\" : { \"data_offsets\" : [ 4 , 6 ], \"shape\": [1], \"dtype\": \"BF16\" "
      "},\n"
      "  \"__metadata__\": {},\n"
      "  \"a\": {\"shape\": [], \"dtype\": \"I32\", \"data_offsets\": [0, 4]}\n}\n   ";
  Bytes data;
  append_le(data, 0xFFFFFFFEu, 4);  // int32 -2
  append_le(data, 0x4049, 2);       // bf16 3.140625
  const auto sd = lazy::io::load(write_bytes("pretty.safetensors", file_of(header, data)));
  ASSERT_EQ(sd.keys(), (std::vector<std::string>{"b\xC3\xA9/x", "a"}));
  EXPECT_EQ(sd.at("a").as<std::int32_t>().item(), -2);
  EXPECT_EQ(static_cast<float>(sd.at("b\xC3\xA9/x").as<lazy::bfloat16>().item()), 3.140625f);
  EXPECT_TRUE(sd.metadata().empty());
}

// ---- malformed files -------------------------------------------------------------------

void expect_format_error(const Bytes& file, const std::string& what) {
  const std::string p = write_bytes("bad.safetensors", file);
  try {
    lazy::io::load(p);
    ADD_FAILURE() << what << ": expected FormatError";
  } catch (const lazy::FormatError& e) {
    EXPECT_NE(std::string(e.what()).find(p), std::string::npos) << what << ": " << e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << what << ": expected FormatError, got " << e.what();
  }
}

// A header with one F32 tensor "t" of `shape` at `offsets`, and `data_bytes` zero bytes.
Bytes one_tensor(const std::string& dtype, const std::string& shape, const std::string& offsets,
                 std::size_t data_bytes) {
  return file_of(R"({"t":{"dtype":")" + dtype + R"(","shape":)" + shape + R"(,"data_offsets":)" +
                     offsets + "}}",
                 Bytes(data_bytes, 0));
}

TEST(Safetensors, MalformedHeadersAreFormatErrors) {
  const std::string ok_entry = R"({"dtype":"F32","shape":[2],"data_offsets":[0,8]})";
  const Bytes eight(8, 0);
  struct Case {
    std::string what;
    Bytes file;
  };
  std::vector<Case> cases = {
      {"header length beyond the file",
       [] {
         Bytes b;
         append_le(b, 100, 8);
         b.push_back('{');
         return b;
       }()},
      {"header length over 100 MB",
       [] {
         Bytes b;
         append_le(b, 100'000'001, 8);
         return b;
       }()},
      {"header length 2^63",
       [] {
         Bytes b;
         append_le(b, 1ull << 63, 8);
         b.push_back('{');
         return b;
       }()},
      {"header length 2^64-1",
       [] {
         Bytes b;
         append_le(b, ~0ull, 8);
         b.push_back('{');
         return b;
       }()},
      {"header length 0", file_of("", {})},
      {"not JSON", file_of("hello", {})},
      {"JSON array", file_of("[]", {})},
      {"leading space", file_of(" {}", {})},
      {"unterminated object", file_of("{", {})},
      {"unterminated string", file_of(R"({"t)", {})},
      {"missing value", file_of(R"({"t":})", {})},
      {"trailing comma", file_of("{\"t\":" + ok_entry + ",}", eight)},
      {"comment", file_of("{/* c */}", {})},
      {"single quotes", file_of("{'t':1}", {})},
      {"garbage after the object", file_of("{}x", {})},
      {"two objects", file_of("{}{}", {})},
      {"NUL padding", file_of(std::string("{}\0\0", 4), {})},
      {"invalid UTF-8 in a name", file_of("{\"\xFF\":" + ok_entry + "}", eight)},
      {"overlong UTF-8", file_of("{\"\xC0\xAF\":" + ok_entry + "}", eight)},
      {"control character in a name", file_of("{\"a\nb\":" + ok_entry + "}", eight)},
      {"bad escape", file_of("{\"a\\xb\":" + ok_entry + "}", eight)},
      {"lone surrogate", file_of("{\"\\ud800\":" + ok_entry + "}", eight)},
      {"short \\u escape", file_of("{\"\\u12\":" + ok_entry + "}", eight)},
      {"tensor entry not an object", file_of(R"({"t":[1,2]})", {})},
      {"unknown dtype", one_tensor("XYZ", "[2]", "[0,8]", 8)},
      {"unsupported dtype U64", one_tensor("U64", "[1]", "[0,8]", 8)},
      {"lower-case dtype", one_tensor("f32", "[2]", "[0,8]", 8)},
      {"dtype not a string",
       file_of(R"({"t":{"dtype":4,"shape":[2],"data_offsets":[0,8]}})", eight)},
      {"missing dtype", file_of(R"({"t":{"shape":[2],"data_offsets":[0,8]}})", eight)},
      {"missing shape", file_of(R"({"t":{"dtype":"F32","data_offsets":[0,8]}})", eight)},
      {"missing offsets", file_of(R"({"t":{"dtype":"F32","shape":[2]}})", eight)},
      {"unexpected key",
       file_of(R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"x":1}})", eight)},
      {"duplicate key in an entry",
       file_of(R"({"t":{"dtype":"F32","dtype":"F32","shape":[2],"data_offsets":[0,8]}})", eight)},
      {"three offsets", one_tensor("F32", "[2]", "[0,8,8]", 8)},
      {"one offset", one_tensor("F32", "[2]", "[8]", 8)},
      {"negative dim", one_tensor("F32", "[-2]", "[0,8]", 8)},
      {"fractional dim", one_tensor("F32", "[2.0]", "[0,8]", 8)},
      {"exponent dim", one_tensor("F32", "[2e0]", "[0,8]", 8)},
      {"leading zero", one_tensor("F32", "[02]", "[0,8]", 8)},
      {"dim beyond 64 bits", one_tensor("F32", "[18446744073709551616]", "[0,8]", 8)},
      {"dim beyond int64", one_tensor("F32", "[9223372036854775808]", "[0,8]", 8)},
      {"rank 9", one_tensor("F32", "[1,1,1,1,1,1,1,1,2]", "[0,8]", 8)},
      {"shape product overflows", one_tensor("F32", "[4294967296,4294967296,2]", "[0,8]", 8)},
      {"byte count overflows", one_tensor("F64", "[4611686018427387904]", "[0,8]", 8)},
      {"huge tensor claimed", one_tensor("F32", "[1099511627776]", "[0,4398046511104]", 8)},
      // Zero-sized, but the other sizes multiply past 2^63 (before the zero, or after it).
      {"zero-sized, sizes overflow before the zero", one_tensor("BOOL", "[4611686018427387904,2,0]", "[0,0]", 0)},
      {"zero-sized, sizes overflow after the zero",
       one_tensor("BOOL", "[0,9223372036854775807,9223372036854775807]", "[0,0]", 0)},
      {"zero-sized, sizes past 2^60", one_tensor("F32", "[0,1073741824,2147483648]", "[0,0]", 0)},
      {"shape/offset mismatch", one_tensor("F32", "[3]", "[0,8]", 8)},
      {"offsets reversed", one_tensor("F32", "[0]", "[8,0]", 8)},
      {"offsets beyond the buffer", one_tensor("F32", "[2]", "[0,8]", 4)},
      {"gap at the start", one_tensor("F32", "[2]", "[4,12]", 12)},
      {"trailing data", one_tensor("F32", "[2]", "[0,8]", 9)},
      {"overlapping tensors",
       file_of(
           R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
           Bytes(12, 0))},
      {"same range twice",
       file_of(
           R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"I32","shape":[2],"data_offsets":[0,8]}})",
           Bytes(8, 0))},
      {"gap between tensors",
       file_of(
           R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})",
           Bytes(12, 0))},
      {"duplicate tensor",
       file_of(
           R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
           Bytes(8, 0))},
      {"duplicate __metadata__", file_of(R"({"__metadata__":{},"__metadata__":{}})", {})},
      {"duplicate metadata key", file_of(R"({"__metadata__":{"k":"a","k":"b"}})", {})},
      {"metadata value not a string", file_of(R"({"__metadata__":{"k":1}})", {})},
      {"metadata not an object", file_of(R"({"__metadata__":"x"})", {})},
      {"bool byte 2", one_tensor("BOOL", "[2]", "[0,2]", 0)},
  };
  // the BOOL case needs its data: 1, 2
  cases.back().file.push_back(1);
  cases.back().file.push_back(2);
  for (std::size_t len = 0; len < 8; ++len)
    cases.push_back({"file of " + std::to_string(len) + " bytes", Bytes(len, 0)});
  for (const auto& c : cases) expect_format_error(c.file, c.what);
}

// A sparse file: a consistent header and data twice this machine's memory, next to nothing
// on disk. load refuses at once with OutOfMemoryError naming the file and the size, instead
// of asking the allocator for it (std::bad_alloc).
TEST(Safetensors, FileLargerThanMemoryIsAnOutOfMemoryError) {
  const std::uint64_t memory = lazy::detail::physical_memory_bytes();
  ASSERT_GT(memory, 0u);
  const std::uint64_t n = memory / 2 + 1, bytes = 4 * n;  // floats: 2x memory and a bit
  const std::string header = R"({"t":{"dtype":"F32","shape":[)" + std::to_string(n) +
                             R"(],"data_offsets":[0,)" + std::to_string(bytes) + "]}}";
  const std::string p = write_bytes("sparse.safetensors", file_of(header, {}));
  struct Unlink {
    std::string p;
    ~Unlink() { ::unlink(p.c_str()); }
  } cleanup{p};
  if (::truncate(p.c_str(), static_cast<off_t>(8 + header.size() + bytes)) != 0) {
    GTEST_SKIP() << "this file system cannot hold a sparse file of twice the memory (errno " << errno << ")";
  }
  try {
    lazy::io::load(p);
    ADD_FAILURE() << "loaded a file larger than memory";
  } catch (const lazy::OutOfMemoryError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find(p), std::string::npos) << m;
    EXPECT_NE(m.find(std::to_string(bytes) + " bytes"), std::string::npos) << m;
    EXPECT_NE(m.find("more than this machine's memory"), std::string::npos) << m;
  }
}

TEST(Safetensors, TruncatedAtEveryByteIsAFormatError) {
  const std::string p = path_of("full.safetensors");
  StateDict sd;
  sd.insert("a", make<float>({1, 2, 3}, Shape{3}));
  sd.insert("b", make<std::int64_t>({4, 5}, Shape{2}));
  sd.metadata()["m"] = "x";
  lazy::io::save_file(sd, p);
  const Bytes full = read_bytes(p);
  for (std::size_t len = 0; len < full.size(); ++len) {
    expect_format_error(Bytes(full.begin(), full.begin() + static_cast<std::ptrdiff_t>(len)),
                        "truncated to " + std::to_string(len));
  }
  Bytes longer = full;
  longer.push_back(0);
  expect_format_error(longer, "one byte appended");
}

TEST(Safetensors, RandomDamageNeverCrashes) {
  // Whatever byte changes, load returns a dict or raises FormatError (ASan-checked).
  StateDict sd = sample_dict();
  sd.metadata()["k"] = "v";
  lazy::io::save_file(sd, path_of("fuzz-src.safetensors"));
  const Bytes good = read_bytes(path_of("fuzz-src.safetensors"));
  std::uint64_t state = 7;
  for (int trial = 0; trial < 500; ++trial) {
    Bytes b = good;
    for (int k = 0; k <= trial % 3; ++k) {
      state = state * 6364136223846793005ull + 1442695040888963407ull;
      // mostly the header, where structure lives
      const std::size_t span = (state >> 60) < 12 ? std::min<std::size_t>(b.size(), 700) : b.size();
      b[(state >> 20) % span] = static_cast<std::uint8_t>(state >> 40);
    }
    const std::string p = write_bytes("fuzz.safetensors", b);
    try {
      lazy::io::load(p);
    } catch (const lazy::FormatError&) {
    }
  }
}

TEST(Safetensors, UnreadableFilesAreIoErrors) {
  EXPECT_THROW(lazy::io::load(path_of("missing.safetensors")), lazy::IoError);
  EXPECT_THROW(lazy::io::load(temp_dir()), lazy::IoError);
}

// ---- saving: validation and atomicity --------------------------------------------------

TEST(Safetensors, RejectsWhatTheFormatCannotHold) {
  StateDict reserved;
  reserved.insert("__metadata__", make<float>({1}, Shape{1}));
  EXPECT_THROW(lazy::io::save_file(reserved, path_of("x.safetensors")), lazy::FormatError);
  StateDict bad_name;
  bad_name.insert("\xFF", make<float>({1}, Shape{1}));
  EXPECT_THROW(lazy::io::save_file(bad_name, path_of("x.safetensors")), lazy::FormatError);
  StateDict undefined;
  undefined.insert("u", AnyTensor());
  EXPECT_THROW(lazy::io::save_file(undefined, path_of("x.safetensors")), lazy::Error);
  EXPECT_FALSE(dir_entries(temp_dir()).count("x.safetensors"));
}

class AtomicSave : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = temp_dir() + "/atomic";
    ::mkdir(dir_.c_str(), 0755);
    target_ = dir_ + "/model.safetensors";
    StateDict old;
    old.insert("old", make<std::int32_t>({1, 2, 3}, Shape{3}));
    lazy::io::save_file(old, target_);
    old_bytes_ = read_bytes(target_);
  }
  // The old file is intact and nothing else was left in the directory.
  void expect_untouched() {
    EXPECT_EQ(read_bytes(target_), old_bytes_);
    EXPECT_EQ(dir_entries(dir_), std::set<std::string>{"model.safetensors"});
  }
  std::string dir_, target_;
  Bytes old_bytes_;
};

TEST_F(AtomicSave, SuccessfulSaveReplacesTheFile) {
  StateDict sd;
  sd.insert("new", make<double>({4, 5}, Shape{2}));
  lazy::io::save_file(sd, target_);
  EXPECT_EQ(lazy::io::load(target_).keys(), std::vector<std::string>{"new"});
  EXPECT_EQ(dir_entries(dir_), std::set<std::string>{"model.safetensors"});
}

TEST_F(AtomicSave, MissingDirectoryIsAnIoError) {
  StateDict sd;
  sd.insert("x", make<float>({1}, Shape{1}));
  EXPECT_THROW(lazy::io::save_file(sd, dir_ + "/no/such/dir/model.safetensors"), lazy::IoError);
  expect_untouched();
}

TEST_F(AtomicSave, RenameFailureRemovesTheTempFile) {
  // The target is a non-empty directory: everything is written, then rename() refuses.
  const std::string blocker = dir_ + "/blocker";
  ::mkdir(blocker.c_str(), 0755);
  write_bytes("atomic/blocker/keep", Bytes{1});
  StateDict sd;
  sd.insert("x", lazy::arange<float>(5000));
  EXPECT_THROW(lazy::io::save_file(sd, blocker), lazy::IoError);
  EXPECT_EQ(dir_entries(blocker), std::set<std::string>{"keep"});
  ::unlink((blocker + "/keep").c_str());
  ::rmdir(blocker.c_str());
  expect_untouched();
}

TEST_F(AtomicSave, FailingComputationMidStreamLeavesTheOldFile) {
  // The second tensor's pending value fails (index out of range) after the first tensor's
  // bytes were written: the error propagates as is, the old file stays.
  auto src = lazy::arange<float>(8);
  auto bad_index = lazy::from_vector<std::int64_t>({0, 99}, Shape{2});
  StateDict sd;
  sd.insert("first", lazy::arange<float>(100000));
  sd.insert("second", AnyTensor(lazy::index_select(src, 0, bad_index)));
  EXPECT_THROW(lazy::io::save_file(sd, target_), lazy::IndexError);
  expect_untouched();
}

TEST_F(AtomicSave, DiskFullMidStreamIsAnIoError) {
  // A file size limit makes write() fail with EFBIG part-way through, like a full disk.
  struct rlimit saved {};
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &saved), 0);
  auto* old_handler = ::signal(SIGXFSZ, SIG_IGN);
  struct rlimit small = saved;
  small.rlim_cur = 64 * 1024;
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &small), 0);
  StateDict sd;
  sd.insert("big", lazy::arange<float>(1 << 16));  // 256 KiB
  bool io_error = false;
  try {
    lazy::io::save_file(sd, target_);
  } catch (const lazy::IoError& e) {
    io_error = true;
    EXPECT_NE(std::string(e.what()).find(target_), std::string::npos) << e.what();
  }
  ::setrlimit(RLIMIT_FSIZE, &saved);
  ::signal(SIGXFSZ, old_handler);
  EXPECT_TRUE(io_error);
  expect_untouched();
}

}  // namespace
