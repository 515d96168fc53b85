// Tests of io/stored_dtype.hpp and the safetensors dtypes lazytensor holds widened: the
// binary16 conversions against a decoder written from the IEEE definition here, and files of
// every stored dtype assembled byte by byte here (not by the library's writer), loaded,
// checked value by value, and saved back byte-identical.

#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <iterator>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "testing/helpers.hpp"

#include <lazytensor/io.hpp>
#include <lazytensor/ops/factories.hpp>
#include <lazytensor/tensor.hpp>

namespace {

using StBytes = std::vector<std::uint8_t>;
using lazy::io::detail::float_to_half;
using lazy::io::detail::half_to_float;

// binary16 from its definition: (-1)^s * 2^(e-15) * 1.m, or 2^-14 * 0.m when e == 0.
double half_reference(std::uint16_t h) {
  const int s = h >> 15, e = (h >> 10) & 0x1F, m = h & 0x3FF;
  double v;
  if (e == 0x1F) v = m ? std::numeric_limits<double>::quiet_NaN() : INFINITY;
  else if (e == 0) v = std::ldexp(m, -24);
  else v = std::ldexp(1024 + m, e - 25);
  return s ? -v : v;
}

// The half nearest to `f` (ties to the even pattern), by search over the ordered positives.
std::uint16_t nearest_half_reference(float f) {
  const double a = std::fabs(static_cast<double>(f));
  const std::uint16_t sign = std::signbit(f) ? 0x8000 : 0;
  if (a >= 65520.0) return sign | 0x7C00;  // half-way to 2^16 and beyond round to infinity
  std::uint16_t lo = 0, hi = 0x7BFF;       // largest finite half: 65504
  while (lo < hi) {                        // first pattern whose value is >= a
    const auto mid = static_cast<std::uint16_t>((lo + hi) / 2);
    if (half_reference(mid) < a) lo = static_cast<std::uint16_t>(mid + 1);
    else hi = mid;
  }
  std::uint16_t best = lo;
  if (lo > 0) {
    const double below = a - half_reference(lo - 1), above = half_reference(lo) - a;
    if (below < above || (below == above && ((lo - 1) % 2 == 0))) best = lo - 1;
  }
  return sign | best;
}

TEST(StoredDtype, HalfToFloatIsExactForEveryPattern) {
  for (std::uint32_t h = 0; h <= 0xFFFF; ++h) {
    const float f = half_to_float(static_cast<std::uint16_t>(h));
    const double want = half_reference(static_cast<std::uint16_t>(h));
    if (std::isnan(want)) {
      ASSERT_TRUE(std::isnan(f)) << std::hex << h;
    } else {
      ASSERT_EQ(static_cast<double>(f), want) << std::hex << h;
      ASSERT_EQ(std::signbit(f), (h & 0x8000) != 0) << std::hex << h;
    }
    // And back: every pattern, NaN payloads included, survives the round trip.
    ASSERT_EQ(float_to_half(f), h) << std::hex << h;
  }
}

TEST(StoredDtype, FloatToHalfRoundsToNearestEven) {
  std::vector<float> xs = {0.0f, -0.0f, 1.0f, 65504.0f, 65519.99f, 65520.0f, -65520.0f, 1e9f,
                           std::numeric_limits<float>::max(), std::ldexp(1.0f, -24),
                           std::ldexp(1.0f, -25), std::ldexp(1.5f, -25), std::ldexp(1.0f, -26),
                           std::ldexp(3.0f, -25), std::ldexp(1.0f, -14), std::ldexp(1023.5f, -24),
                           1.0f + std::ldexp(1.0f, -11), 1.0f + std::ldexp(3.0f, -11),
                           std::numeric_limits<float>::denorm_min()};
  std::mt19937 rng(7);
  // Random bit patterns over the exponents that matter: subnormal, normal and overflowing.
  std::uniform_int_distribution<std::uint32_t> mant(0, 0x7FFFFF), exp(95, 145), sign(0, 1);
  for (int i = 0; i < 200000; ++i) {
    const std::uint32_t bits = (sign(rng) << 31) | (exp(rng) << 23) | mant(rng);
    float f;
    std::memcpy(&f, &bits, 4);
    xs.push_back(f);
  }
  // Exact ties between neighbours, where round-to-even decides.
  for (std::uint16_t h = 0; h < 0x7BFF; h += 37) {
    xs.push_back(static_cast<float>((half_reference(h) + half_reference(h + 1)) / 2));
  }
  for (const float f : xs) {
    ASSERT_EQ(float_to_half(f), nearest_half_reference(f)) << f;
  }
  EXPECT_EQ(float_to_half(INFINITY), 0x7C00);
  EXPECT_EQ(float_to_half(-INFINITY), 0xFC00);
  EXPECT_TRUE(std::isnan(half_to_float(float_to_half(std::nanf("")))));
  // A NaN whose payload lies only in float's low bits is still a NaN in half.
  float low_payload;
  const std::uint32_t low_bits = 0x7F800001u;
  std::memcpy(&low_payload, &low_bits, 4);
  EXPECT_TRUE(std::isnan(half_to_float(float_to_half(low_payload))));
}

// ---- files of every stored dtype, written here ------------------------------------------

std::string st_path(const std::string& name) {
  return lazy_tests::scratch_dir() + "/stored_" + name;
}

StBytes st_read(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return StBytes(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
}

std::string st_write(const std::string& name, const StBytes& b) {
  const std::string p = st_path(name);
  std::ofstream f(p, std::ios::binary | std::ios::trunc);
  f.write(reinterpret_cast<const char*>(b.data()), static_cast<std::streamsize>(b.size()));
  return p;
}

void st_le(StBytes& b, std::uint64_t v, int n) {
  for (int i = 0; i < n; ++i) b.push_back(static_cast<std::uint8_t>(v >> (8 * i)));
}

// One tensor per stored dtype, with its extreme values, in decreasing element size (the
// order lazytensor's writer lays data out in), so the file below is also what save writes.
struct StoredCase {
  const char* name;
  const char* dtype;
  int size;
  std::vector<std::int64_t> values;  // the integers, or the F16 bit patterns
};

const std::vector<StoredCase>& stored_cases() {
  static const std::vector<StoredCase> cases = {
      {"u32", "U32", 4, {0, 1, 4294967295LL, 2147483648LL}},
      {"f16", "F16", 2, {0x3C00, 0xC000, 0x7BFF, 0x0001, 0x8000, 0x7C00, 0xFC00, 0x7E01, 0x03FF}},
      {"i16", "I16", 2, {-32768, 32767, 0, -1}},
      {"u16", "U16", 2, {0, 65535, 32768}},
      {"u8", "U8", 1, {0, 255, 128}},
      {"i8", "I8", 1, {-128, 127, -1, 0, 5}},
  };
  return cases;
}

// The file, as the safetensors format describes it: compact header, 8-byte aligned data.
StBytes stored_file() {
  std::string header = "{";
  StBytes data;
  for (const auto& c : stored_cases()) {
    const std::size_t begin = data.size();
    for (const auto v : c.values) st_le(data, static_cast<std::uint64_t>(v), c.size);
    if (header.size() > 1) header += ',';
    header += std::string("\"") + c.name + "\":{\"dtype\":\"" + c.dtype + "\",\"shape\":[" +
              std::to_string(c.values.size()) + "],\"data_offsets\":[" + std::to_string(begin) +
              "," + std::to_string(data.size()) + "]}";
  }
  header += '}';
  header.append((8 - header.size() % 8) % 8, ' ');
  StBytes file;
  st_le(file, header.size(), 8);
  file.insert(file.end(), header.begin(), header.end());
  file.insert(file.end(), data.begin(), data.end());
  return file;
}

TEST(StoredDtype, LoadsEveryWidenedDtypeExactly) {
  const auto sd = lazy::io::load(st_write("every.safetensors", stored_file()));
  ASSERT_EQ(sd.size(), stored_cases().size());
  for (const auto& c : stored_cases()) {
    SCOPED_TRACE(c.name);
    EXPECT_EQ(sd.stored_dtypes().at(c.name), c.dtype);
    const lazy::AnyTensor& t = sd.at(c.name);
    EXPECT_EQ(t.shape(), lazy::Shape{static_cast<std::int64_t>(c.values.size())});
    if (std::string(c.dtype) == "F16") {
      ASSERT_EQ(t.dtype(), lazy::DType::Float32);
      const auto got = t.as<float>().to_vector();
      for (std::size_t i = 0; i < c.values.size(); ++i) {
        const double want = half_reference(static_cast<std::uint16_t>(c.values[i]));
        if (std::isnan(want)) EXPECT_TRUE(std::isnan(got[i]));
        else EXPECT_EQ(static_cast<double>(got[i]), want) << i;
      }
    } else if (std::string(c.dtype) == "U32") {
      ASSERT_EQ(t.dtype(), lazy::DType::Int64);
      EXPECT_EQ(t.as<std::int64_t>().to_vector(), c.values);
    } else {
      ASSERT_EQ(t.dtype(), lazy::DType::Int32);
      const auto got = t.as<std::int32_t>().to_vector();
      EXPECT_EQ(std::vector<std::int64_t>(got.begin(), got.end()), c.values);
    }
  }
}

TEST(StoredDtype, SavingALoadedDictWritesTheFileBack) {
  const StBytes file = stored_file();
  const auto sd = lazy::io::load(st_write("in.safetensors", file));
  const std::string out = st_path("out.safetensors");
  lazy::io::save_file(sd, out);
  EXPECT_EQ(st_read(out), file);
}

TEST(StoredDtype, LargeTensorsConvertChunkByChunk) {
  // More elements than one conversion chunk holds, every F16 pattern several times over.
  const std::size_t n = 3 * 65536 + 11;
  StBytes data;
  for (std::size_t i = 0; i < n; ++i) st_le(data, (i * 40503u) & 0xFFFF, 2);
  std::string header = "{\"h\":{\"dtype\":\"F16\",\"shape\":[" + std::to_string(n) +
                       "],\"data_offsets\":[0," + std::to_string(2 * n) + "]}}";
  header.append((8 - header.size() % 8) % 8, ' ');
  StBytes file;
  st_le(file, header.size(), 8);
  file.insert(file.end(), header.begin(), header.end());
  file.insert(file.end(), data.begin(), data.end());
  const auto sd = lazy::io::load(st_write("large.safetensors", file));
  const auto got = sd.at("h").as<float>().to_vector();
  ASSERT_EQ(got.size(), n);
  for (std::size_t i = 0; i < n; ++i) {
    const double want = half_reference(static_cast<std::uint16_t>((i * 40503u) & 0xFFFF));
    if (std::isnan(want)) ASSERT_TRUE(std::isnan(got[i])) << i;
    else ASSERT_EQ(static_cast<double>(got[i]), want) << i;
  }
  const std::string out = st_path("large_out.safetensors");
  lazy::io::save_file(sd, out);
  EXPECT_EQ(st_read(out), file);
}

TEST(StoredDtype, RequestedNarrowingRoundsFloatsAndChecksIntegers) {
  lazy::StateDict sd;
  const std::vector<float> w = {0.1f, -3.14159f, 70000.0f, 1e-7f};
  sd.insert("w", lazy::from_vector<float>(w, lazy::Shape{4}));
  sd.insert("px", lazy::from_vector<std::int32_t>({0, 200, 255}, lazy::Shape{3}));
  sd.stored_dtypes()["w"] = "F16";
  sd.stored_dtypes()["px"] = "U8";
  const std::string p = st_path("narrowed.safetensors");
  lazy::io::save_file(sd, p);
  const StBytes file = st_read(p);
  ASSERT_GE(file.size(), 8u);
  std::uint64_t header_bytes = 0;
  for (int i = 7; i >= 0; --i) header_bytes = (header_bytes << 8) | file[i];
  EXPECT_EQ(file.size() - 8 - header_bytes, 4 * 2 + 3u) << "F16 and U8 data take 2 and 1 bytes";
  const auto back = lazy::io::load(p);
  const auto got = back.at("w").as<float>().to_vector();
  for (std::size_t i = 0; i < w.size(); ++i)
    EXPECT_EQ(static_cast<double>(got[i]), half_reference(nearest_half_reference(w[i])));
  EXPECT_EQ(back.at("px").as<std::int32_t>().to_vector(), (std::vector<std::int32_t>{0, 200, 255}));
  EXPECT_EQ(back.stored_dtypes(), sd.stored_dtypes());
}

void expect_save_error(const lazy::StateDict& sd, const std::string& needle) {
  const std::string p = st_path("refused.safetensors");
  ::unlink(p.c_str());
  try {
    lazy::io::save_file(sd, p);
    ADD_FAILURE() << "expected FormatError containing '" << needle << "'";
  } catch (const lazy::FormatError& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
  EXPECT_NE(::access(p.c_str(), F_OK), 0) << "nothing may be written";
}

TEST(StoredDtype, SaveRefusesWhatTheStoredDtypeCannotHold) {
  lazy::StateDict sd;
  sd.insert("px", lazy::from_vector<std::int32_t>({0, 256, 3}, lazy::Shape{3}));
  sd.stored_dtypes()["px"] = "U8";
  expect_save_error(sd, "element 1 is 256, which U8");
  sd.stored_dtypes()["px"] = "I8";
  expect_save_error(sd, "element 1 is 256, which I8");
  sd.stored_dtypes()["px"] = "F16";
  expect_save_error(sd, "is int32, but stored_dtypes asks for F16");
  sd.stored_dtypes()["px"] = "U64";
  expect_save_error(sd, "unsupported dtype 'U64'");
  sd.stored_dtypes().clear();
  sd.stored_dtypes()["nope"] = "U8";
  expect_save_error(sd, "stored_dtypes names 'nope'");

  lazy::StateDict wide;
  wide.insert("n", lazy::from_vector<std::int64_t>({-1}, lazy::Shape{1}));
  wide.stored_dtypes()["n"] = "U32";
  expect_save_error(wide, "element 0 is -1, which U32");
}

TEST(StoredDtype, DtypesWithoutAHolderAreNamedErrors) {
  for (const std::string dtype : {"U64", "F8_E4M3", "F8_E5M2", "F8_E8M0", "F4", "C64", "Q4"}) {
    std::string header = "{\"t\":{\"dtype\":\"" + dtype + "\",\"shape\":[1],\"data_offsets\":[0,8]}}";
    StBytes file;
    st_le(file, header.size(), 8);
    file.insert(file.end(), header.begin(), header.end());
    file.resize(file.size() + 8);
    const std::string p = st_write("unsupported.safetensors", file);
    try {
      lazy::io::load(p);
      ADD_FAILURE() << dtype << ": expected FormatError";
    } catch (const lazy::FormatError& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("dtype '" + dtype + "'"), std::string::npos) << what;
      EXPECT_NE(what.find(p), std::string::npos) << what;
    }
  }
}

}  // namespace
