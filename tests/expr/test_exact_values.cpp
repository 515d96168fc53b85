// expr/evaluator.hpp and functors.hpp: values a kernel's single wide lane would get wrong,
// checked against PyTorch's results worked out by hand: bool sums (true, not 2), int32
// arithmetic and casts inside int64 statements (wrapping at 2^31), int64 wrapping at 2^63,
// integer pow (by squaring, not through double), and pow of negative floats (sign by the
// exponent's parity, also for exponents of 2^24 and more).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include <lazytensor/tensor.hpp>

namespace {

using i32 = std::int32_t;
using i64 = std::int64_t;
using lazy::Tensor;

template <class A, class B>
constexpr bool can_subtract = requires(const A& a, const B& b) {
  a - b;
};
// PyTorch refuses subtraction with a bool on either side, tensor or number.
static_assert(can_subtract<Tensor<i32>, Tensor<i32>> && can_subtract<Tensor<float>, int>);
static_assert(!can_subtract<Tensor<bool>, Tensor<i32>> && !can_subtract<Tensor<i32>, Tensor<bool>>);
static_assert(!can_subtract<int, Tensor<bool>> && !can_subtract<Tensor<bool>, int> &&
              !can_subtract<Tensor<float>, bool>);

constexpr i32 kI32Max = std::numeric_limits<i32>::max();
constexpr i32 kI32Min = std::numeric_limits<i32>::min();

TEST(ExactValues, BoolSumsAreTrueInsideWiderStatements) {
  const auto a = lazy::from_vector<bool>({true, true});
  const auto b = lazy::from_vector<bool>({true, false});
  // PyTorch: bool + bool is logical or; the 2 of an int32 or float lane must not leak.
  EXPECT_EQ(Tensor<i32>((a + b) * lazy::from_vector<i32>({3, 3})).to_vector(),
            (std::vector<i32>{3, 3}));
  EXPECT_EQ(Tensor<float>((a + b) * 2.0f).to_vector(), (std::vector<float>{2.0f, 2.0f}));
  EXPECT_EQ(Tensor<bool>((a + b) == true).to_vector(), (std::vector<bool>{true, true}));
  EXPECT_EQ(Tensor<i64>(lazy::sum(a + b)).item(), 2);
  EXPECT_EQ(Tensor<bool>(a + true).to_vector(), (std::vector<bool>{true, true}));
}

TEST(ExactValues, Int32ArithmeticWrapsInsideInt64Statements) {
  const auto a = lazy::from_vector<i32>({65536, kI32Max});
  const auto zero = lazy::from_vector<i64>({0, 0});
  // 65536^2 = 2^32 wraps to 0; (2^31 - 1)^2 = 2^62 - 2^32 + 1 wraps to 1.
  EXPECT_EQ(Tensor<i64>(a * a + zero).to_vector(), (std::vector<i64>{0, 1}));
  EXPECT_EQ(Tensor<i32>(a * a).to_vector(), (std::vector<i32>{0, 1}));
  EXPECT_EQ(Tensor<i64>((a + 1) + zero).to_vector(), (std::vector<i64>{65537, kI32Min}));
  EXPECT_EQ(Tensor<i64>(lazy::sum(a * a)).item(),
            1);  // each product in int32, then summed in int64
  EXPECT_EQ(Tensor<i32>(lazy::amax(a + 1)).item(), 65537);
}

TEST(ExactValues, GradientsReadTheSameExactValues) {
  // The gradient kernel recomputes the forward values: a bool sum or an int32 product
  // inside it must be the forward's (PyTorch: d/dx sum(x * ((x > 0) + (x > -1))) = 1 1 0).
  auto x = lazy::from_vector<float>({0.5f, 2.0f, -3.0f});
  x.requires_grad_(true);
  lazy::sum(x * lazy::cast<float>((x > 0.0f) + (x > -1.0f))).backward();
  EXPECT_EQ(x.grad().to_vector(), (std::vector<float>{1.0f, 1.0f, 0.0f}));
  auto w = lazy::from_vector<float>({1.0f, 1.0f});
  w.requires_grad_(true);
  const auto i = lazy::from_vector<i32>({65536, 3});
  lazy::sum(w * lazy::cast<float>(i * i)).backward();  // 65536^2 wraps to 0 in int32
  EXPECT_EQ(w.grad().to_vector(), (std::vector<float>{0.0f, 9.0f}));
}

TEST(ExactValues, NarrowingCastsWrapInsideStatements) {
  const auto x = lazy::from_vector<i64>({(i64{1} << 32) + 5, -1});
  EXPECT_EQ(Tensor<i64>(lazy::cast<i32>(x) + x).to_vector(),
            (std::vector<i64>{(i64{1} << 32) + 10, -2}));
  EXPECT_EQ(Tensor<bool>(lazy::cast<i32>(x) == 5).to_vector(), (std::vector<bool>{true, false}));
}

TEST(ExactValues, Int64ArithmeticWraps) {
  const auto x =
      lazy::from_vector<i64>({std::numeric_limits<i64>::max(), std::numeric_limits<i64>::min()});
  EXPECT_EQ(
      Tensor<i64>(x + 1).to_vector(),
      (std::vector<i64>{std::numeric_limits<i64>::min(), std::numeric_limits<i64>::min() + 1}));
  EXPECT_EQ(Tensor<i64>(-x).to_vector(), (std::vector<i64>{std::numeric_limits<i64>::min() + 1,
                                                           std::numeric_limits<i64>::min()}));
  EXPECT_EQ(Tensor<i64>(x * 2).to_vector(), (std::vector<i64>{-2, 0}));
}

TEST(ExactValues, IntegerPowIsExactAndWraps) {
  const auto a = lazy::from_vector<i32>({2, 0, 100000, 3, -2});
  // 10^10 mod 2^32 = 1410065408; 3^31 mod 2^32 = 1264544299; (-2)^31 = INT32_MIN.
  EXPECT_EQ(Tensor<i32>(lazy::pow(a, 2)).to_vector(), (std::vector<i32>{4, 0, 1410065408, 9, 4}));
  EXPECT_EQ(Tensor<i32>(lazy::pow(a, lazy::from_vector<i32>({-1, -1, 2, 31, 31}))).to_vector(),
            (std::vector<i32>{0, 0, 1410065408, 1264544299, kI32Min}));
  // Negative tensor exponents truncate 1 / a^-b: 1 for 1, +-1 for -1 by parity, else 0.
  EXPECT_EQ(Tensor<i32>(lazy::pow(lazy::from_vector<i32>({1, -1, -1, 5}),
                                  lazy::from_vector<i32>({-7, -3, -4, -2})))
                .to_vector(),
            (std::vector<i32>{1, -1, 1, 0}));
  // Beyond 2^53, where a double loses digits: 3^39 and 7^22 are exact in int64.
  EXPECT_EQ(Tensor<i64>(lazy::pow(lazy::from_vector<i64>({3, 7}), lazy::from_vector<i64>({39, 22})))
                .to_vector(),
            (std::vector<i64>{4052555153018976267, 3909821048582988049}));
  EXPECT_THROW((void)lazy::pow(a, -1), lazy::DTypeError);  // PyTorch: a negative integer number
  EXPECT_THROW((void)lazy::pow(a, (i64{1} << 32) - 1), lazy::DTypeError);  // not an int32: no wrap to -1
  EXPECT_EQ(Tensor<i64>(lazy::pow(lazy::from_vector<bool>({true, false}), i64{1} << 40)).to_vector(),
            (std::vector<i64>{1, 0}));
  EXPECT_EQ(Tensor<i32>(lazy::abs(lazy::from_vector<i32>({kI32Min, -7}))).to_vector(), (std::vector<i32>{kI32Min, 7}));
}

/// pow of every (base, exponent) pair over `n` elements (the SIMD loop and its tail),
/// against std::pow of the same values.
template <class T>
void check_negative_base_pow(int n) {
  const std::vector<T> bases = {-1, -1, -1, -1, T(-2.5), T(-0.0), -INFINITY, -INFINITY,
                                -1, -2, -3, -1, -1,      -1,      -1,        T(-0.5)};
  const std::vector<T> exps = {INFINITY,    -INFINITY, T(1e30), T(3e9), T(1e30), T(-3e9),
                               T(2.5),      T(-2.5),   2,       2,      3,       4,
                               T(16777216), 5,         T(0.5),  T(-3)};
  std::vector<T> base, exp;
  for (int i = 0; i < n; ++i) {
    base.push_back(bases[static_cast<std::size_t>(i) % bases.size()]);
    exp.push_back(exps[static_cast<std::size_t>(i) % exps.size()]);
  }
  const auto got =
      Tensor<T>(lazy::pow(lazy::from_vector<T>(base), lazy::from_vector<T>(exp))).to_vector();
  for (std::size_t i = 0; i < base.size(); ++i) {
    const T want = std::pow(base[i], exp[i]);
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got[i])) << base[i] << "^" << exp[i] << " = " << got[i];
    } else if (std::isinf(want) || want == 0) {
      EXPECT_EQ(got[i], want) << base[i] << "^" << exp[i];
      EXPECT_EQ(std::signbit(got[i]), std::signbit(want)) << base[i] << "^" << exp[i];
    } else {
      EXPECT_NEAR(got[i], want, std::abs(want) * 4 * std::numeric_limits<T>::epsilon())
          << base[i] << "^" << exp[i];
    }
  }
}

TEST(ExactValues, PowOfNegativeFloatsFollowsTheExponentsParity) {
  for (int n : {1, 16, 37}) {
    check_negative_base_pow<float>(n);
    check_negative_base_pow<double>(n);
  }
  // A number exponent of 2^30 (even) with a negative base: positive.
  EXPECT_EQ(
      Tensor<float>(lazy::pow(lazy::from_vector<float>({-1.0f, -2.0f}), 1073741824.0f)).to_vector(),
      (std::vector<float>{1.0f, INFINITY}));
}

}  // namespace
