// core/bfloat16.hpp and core/dtype.hpp: bfloat16 rounding against an integer-arithmetic
// reference, exact widening, and the type promotion rules against PyTorch's table.
#include <lazytensor/core/bfloat16.hpp>
#include <lazytensor/core/dtype.hpp>

#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <type_traits>
#include <vector>

namespace {

using lazy::bfloat16;

// Independent reference: round-to-nearest-even of a float's bit pattern to its top 16 bits,
// written as an explicit comparison of the discarded half against one half ULP (no bias
// trick). NaN is reported separately by the caller.
std::uint16_t reference_bf16_bits(std::uint32_t u) {
  const std::uint32_t upper = u >> 16;
  const std::uint32_t lower = u & 0xffffu;
  bool round_up;
  if (lower > 0x8000u) round_up = true;
  else if (lower < 0x8000u) round_up = false;
  else round_up = (upper & 1u) != 0;  // exact tie: to even
  // Carry from the mantissa into the exponent is correct rounding (up to the next binade,
  // or to infinity from the largest finite value).
  return static_cast<std::uint16_t>(round_up ? upper + 1 : upper);
}

bool is_nan_bits32(std::uint32_t u) { return (u & 0x7f800000u) == 0x7f800000u && (u & 0x007fffffu) != 0; }
bool is_nan_bits16(std::uint16_t b) { return (b & 0x7f80u) == 0x7f80u && (b & 0x007fu) != 0; }

// Checks one float bit pattern; returns false (and records a failure) on mismatch.
bool check_pattern(std::uint32_t u) {
  const float f = std::bit_cast<float>(u);
  const bfloat16 b(f);
  if (is_nan_bits32(u)) {
    // NaN stays NaN, with its sign. (Rounding a NaN's payload could otherwise carry into
    // the exponent or truncate the payload to zero, producing infinity.)
    if (!is_nan_bits16(b.bits) || (b.bits >> 15) != (u >> 31)) {
      ADD_FAILURE() << std::hex << "NaN pattern 0x" << u << " -> 0x" << b.bits;
      return false;
    }
    return true;
  }
  const std::uint16_t want = reference_bf16_bits(u);
  if (b.bits != want) {
    ADD_FAILURE() << std::hex << "pattern 0x" << u << " (" << f << ") -> 0x" << b.bits << ", expected 0x" << want;
    return false;
  }
  return true;
}

TEST(BFloat16, RoundingMatchesReferenceOnStructuredPatterns) {
  // Every possible top half (all signs, exponents incl. 0 = denormals/zero and 255 =
  // inf/NaN, all mantissa tops), combined with the lower halves that decide rounding:
  // zero, just above zero, just below the tie, the tie, just above the tie, the max.
  const std::uint32_t lowers[] = {0x0000, 0x0001, 0x7fff, 0x8000, 0x8001, 0xc000, 0xffff, 0x4000};
  int failures = 0;
  for (std::uint32_t upper = 0; upper <= 0xffffu; ++upper) {
    for (std::uint32_t lo : lowers) {
      if (!check_pattern((upper << 16) | lo) && ++failures > 20) return;
    }
  }
}

TEST(BFloat16, RoundingMatchesReferenceOnRandomPatterns) {
  std::mt19937 rng(12345);
  int failures = 0;
  for (int i = 0; i < 2'000'000; ++i) {
    if (!check_pattern(rng()) && ++failures > 20) return;
  }
}

TEST(BFloat16, TiesRoundToEven) {
  // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: the even neighbour is 1.
  EXPECT_EQ(bfloat16(1.0f + 0x1p-8f).bits, 0x3f80);
  // 1 + 3 * 2^-8 is halfway between 1 + 2^-7 (odd) and 1 + 2^-6 (even).
  EXPECT_EQ(bfloat16(1.0f + 3 * 0x1p-8f).bits, 0x3f82);
  // Just above the tie rounds up.
  EXPECT_EQ(bfloat16(std::nextafter(1.0f + 0x1p-8f, 2.0f)).bits, 0x3f81);
  // Negative values are symmetric.
  EXPECT_EQ(bfloat16(-(1.0f + 0x1p-8f)).bits, 0xbf80);
  EXPECT_EQ(bfloat16(-(1.0f + 3 * 0x1p-8f)).bits, 0xbf82);
}

TEST(BFloat16, SpecialValues) {
  constexpr float inf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(bfloat16(0.0f).bits, 0x0000);
  EXPECT_EQ(bfloat16(-0.0f).bits, 0x8000);
  EXPECT_EQ(bfloat16(inf).bits, 0x7f80);
  EXPECT_EQ(bfloat16(-inf).bits, 0xff80);
  // The largest float rounds up to infinity (it is above bf16's max + half ULP).
  EXPECT_EQ(bfloat16(std::numeric_limits<float>::max()).bits, 0x7f80);
  // bf16's largest finite value survives.
  EXPECT_EQ(bfloat16(std::bit_cast<float>(0x7f7f0000u)).bits, 0x7f7f);
  // Smallest float denormal rounds to zero; a denormal at bf16's tie rounds to even.
  EXPECT_EQ(bfloat16(std::numeric_limits<float>::denorm_min()).bits, 0x0000);
  EXPECT_EQ(bfloat16(std::bit_cast<float>(0x00018000u)).bits, 0x0002);
  EXPECT_EQ(bfloat16(std::bit_cast<float>(0x00008000u)).bits, 0x0000);
  // NaNs: quiet, signalling, with payload only in the low half (would truncate to inf).
  for (std::uint32_t u : {0x7fc00000u, 0xffc00000u, 0x7f800001u, 0xff800001u, 0x7fffffffu, 0x7f80ffffu}) {
    const bfloat16 b(std::bit_cast<float>(u));
    EXPECT_TRUE(std::isnan(float(b))) << std::hex << u;
    EXPECT_EQ(b.bits >> 15, u >> 31) << std::hex << u;
  }
}

TEST(BFloat16, WideningIsExactAndRoundTrips) {
  for (std::uint32_t bits = 0; bits <= 0xffffu; ++bits) {
    const bfloat16 b = bfloat16::from_bits(static_cast<std::uint16_t>(bits));
    const float f = b;
    // Widening is exact: the float's bit pattern is the bf16 pattern followed by zeros.
    ASSERT_EQ(std::bit_cast<std::uint32_t>(f), bits << 16) << std::hex << bits;
    const bfloat16 back(f);
    if (is_nan_bits16(static_cast<std::uint16_t>(bits))) {
      EXPECT_TRUE(is_nan_bits16(back.bits)) << std::hex << bits;
    } else {
      ASSERT_EQ(back.bits, bits) << "round trip of 0x" << std::hex << bits;
    }
  }
}

TEST(BFloat16, ConstexprAndOtherConstructors) {
  static_assert(bfloat16(1.0f).bits == 0x3f80);
  static_assert(bfloat16(-2.0f).bits == 0xc000);
  static_assert(float(bfloat16::from_bits(0x4049)) == 3.140625f);
  static_assert(bfloat16(3.14159f).bits == 0x4049);
  static_assert(sizeof(bfloat16) == 2);
  EXPECT_EQ(bfloat16(1.5).bits, 0x3fc0);  // double
  EXPECT_EQ(bfloat16(3).bits, 0x4040);    // int
  EXPECT_EQ(bfloat16(257).bits, 0x4380);  // 257 is a tie between 256 and 258: to even (256)
  EXPECT_EQ(bfloat16(259).bits, 0x4382);  // 259 is a tie between 258 and 260: to even (260)
  EXPECT_EQ(bfloat16(true).bits, 0x3f80);
  EXPECT_EQ(bfloat16(false).bits, 0x0000);
  EXPECT_EQ(bfloat16().bits, 0x0000);
}

// ---- promotion rules ------------------------------------------------------------------

using lazy::DType;
using lazy::promote_t;
using lazy::to_floating_t;
using lazy::weak_scalar_t;
using bf16 = lazy::bfloat16;
using i32 = std::int32_t;
using i64 = std::int64_t;

// torch.promote_types for the six supported dtypes (no float16 involved, so the table is
// the chain bool < int32 < int64 < bfloat16 < float32 < float64).
static_assert(std::is_same_v<promote_t<bool, bool>, bool>);
static_assert(std::is_same_v<promote_t<bool, i32>, i32>);
static_assert(std::is_same_v<promote_t<bool, i64>, i64>);
static_assert(std::is_same_v<promote_t<bool, bf16>, bf16>);
static_assert(std::is_same_v<promote_t<bool, float>, float>);
static_assert(std::is_same_v<promote_t<bool, double>, double>);
static_assert(std::is_same_v<promote_t<i32, i32>, i32>);
static_assert(std::is_same_v<promote_t<i32, i64>, i64>);
static_assert(std::is_same_v<promote_t<i64, i32>, i64>);
static_assert(std::is_same_v<promote_t<i32, bf16>, bf16>);
static_assert(std::is_same_v<promote_t<i64, bf16>, bf16>);
static_assert(std::is_same_v<promote_t<i32, float>, float>);
static_assert(std::is_same_v<promote_t<i64, float>, float>);
static_assert(std::is_same_v<promote_t<i64, double>, double>);
static_assert(std::is_same_v<promote_t<bf16, float>, float>);
static_assert(std::is_same_v<promote_t<float, bf16>, float>);
static_assert(std::is_same_v<promote_t<bf16, double>, double>);
static_assert(std::is_same_v<promote_t<float, double>, double>);
static_assert(std::is_same_v<promote_t<double, float>, double>);
static_assert(std::is_same_v<promote_t<bf16, bf16>, bf16>);

// Floating-only ops (exp, true division): integral and bool give the default dtype float32.
static_assert(std::is_same_v<to_floating_t<bool>, float>);
static_assert(std::is_same_v<to_floating_t<i32>, float>);
static_assert(std::is_same_v<to_floating_t<i64>, float>);
static_assert(std::is_same_v<to_floating_t<bf16>, bf16>);
static_assert(std::is_same_v<to_floating_t<float>, float>);
static_assert(std::is_same_v<to_floating_t<double>, double>);

// Weak (wrapped-number) scalars: a Python int/float/bool next to a tensor.
// Same or lower category: the tensor's dtype wins.
static_assert(std::is_same_v<weak_scalar_t<float, double>, float>);
static_assert(std::is_same_v<weak_scalar_t<float, int>, float>);
static_assert(std::is_same_v<weak_scalar_t<float, bool>, float>);
static_assert(std::is_same_v<weak_scalar_t<bf16, double>, bf16>);
static_assert(std::is_same_v<weak_scalar_t<bf16, float>, bf16>);
static_assert(std::is_same_v<weak_scalar_t<bf16, long>, bf16>);
static_assert(std::is_same_v<weak_scalar_t<double, float>, double>);
static_assert(std::is_same_v<weak_scalar_t<double, int>, double>);
static_assert(std::is_same_v<weak_scalar_t<i32, int>, i32>);
static_assert(std::is_same_v<weak_scalar_t<i32, long long>, i32>);
static_assert(std::is_same_v<weak_scalar_t<i32, bool>, i32>);
static_assert(std::is_same_v<weak_scalar_t<i64, int>, i64>);
static_assert(std::is_same_v<weak_scalar_t<bool, bool>, bool>);
// Higher category: integral/bool tensor with a floating scalar is float32 (default dtype),
// a bool tensor with an integer scalar is int64.
static_assert(std::is_same_v<weak_scalar_t<i32, double>, float>);
static_assert(std::is_same_v<weak_scalar_t<i64, float>, float>);
static_assert(std::is_same_v<weak_scalar_t<bool, double>, float>);
static_assert(std::is_same_v<weak_scalar_t<bool, int>, i64>);
static_assert(std::is_same_v<weak_scalar_t<bool, long long>, i64>);
// A bfloat16 scalar is a floating number too (expr::Number accepts it).
static_assert(std::is_same_v<weak_scalar_t<i32, bf16>, float>);
static_assert(std::is_same_v<weak_scalar_t<bool, bf16>, float>);
static_assert(std::is_same_v<weak_scalar_t<float, bf16>, float>);

static_assert(std::is_same_v<lazy::compute_t<bf16>, float>);
static_assert(std::is_same_v<lazy::compute_t<i32>, i32>);
static_assert(std::is_same_v<lazy::compute_t<double>, double>);

static_assert(lazy::is_element_v<bool> && lazy::is_element_v<bf16> && lazy::is_element_v<i64>);
static_assert(!lazy::is_element_v<char> && !lazy::is_element_v<unsigned> && !lazy::is_element_v<long double>);

TEST(DType, TagsSizesAndNames) {
  EXPECT_EQ(lazy::dtype_of<bool>(), DType::Bool);
  EXPECT_EQ(lazy::dtype_of<i32>(), DType::Int32);
  EXPECT_EQ(lazy::dtype_of<i64>(), DType::Int64);
  EXPECT_EQ(lazy::dtype_of<bf16>(), DType::BFloat16);
  EXPECT_EQ(lazy::dtype_of<float>(), DType::Float32);
  EXPECT_EQ(lazy::dtype_of<double>(), DType::Float64);
  EXPECT_EQ(lazy::dtype_size(DType::Bool), sizeof(bool));
  EXPECT_EQ(lazy::dtype_size(DType::Int32), 4u);
  EXPECT_EQ(lazy::dtype_size(DType::Int64), 8u);
  EXPECT_EQ(lazy::dtype_size(DType::BFloat16), 2u);
  EXPECT_EQ(lazy::dtype_size(DType::Float32), 4u);
  EXPECT_EQ(lazy::dtype_size(DType::Float64), 8u);
  EXPECT_EQ(lazy::dtype_name(DType::Bool), "bool");
  EXPECT_EQ(lazy::dtype_name(DType::Int32), "int32");
  EXPECT_EQ(lazy::dtype_name(DType::Int64), "int64");
  EXPECT_EQ(lazy::dtype_name(DType::BFloat16), "bfloat16");
  EXPECT_EQ(lazy::dtype_name(DType::Float32), "float32");
  EXPECT_EQ(lazy::dtype_name(DType::Float64), "float64");
}

TEST(DType, PromotionAtRuntime) {
  // The same rules, through dtype_of, so a wrong alias shows up as a readable name.
  EXPECT_EQ(lazy::dtype_name(lazy::dtype_of<promote_t<i32, float>>()), "float32");
  EXPECT_EQ(lazy::dtype_name(lazy::dtype_of<promote_t<i64, bf16>>()), "bfloat16");
  EXPECT_EQ(lazy::dtype_name(lazy::dtype_of<promote_t<bool, i32>>()), "int32");
  EXPECT_EQ(lazy::dtype_name(lazy::dtype_of<weak_scalar_t<i32, double>>()), "float32");
  EXPECT_EQ(lazy::dtype_name(lazy::dtype_of<weak_scalar_t<bool, int>>()), "int64");
  EXPECT_EQ(lazy::dtype_name(lazy::dtype_of<to_floating_t<i64>>()), "float32");
}

}  // namespace
