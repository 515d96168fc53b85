// expr/: PyTorch's weak scalars — a C++ number on either side of every binary op, typed
// by the tensor unless its category is higher (int tensor * 0.5 -> float, bool + 1 ->
// int64) — and promotion between tensors of different dtypes, against the references in
// elementwise_testing.hpp.
#include "elementwise_testing.hpp"

#include <gtest/gtest.h>

namespace {

using namespace lazytest;  // NOLINT

#define SCALAR_TEST(OP)                                                                         \
  TEST(ElementwiseScalars, OP##WithScalars) {                                                   \
    for_each_dtype([]<class T>() {                                                              \
      if constexpr (OP::template supports<T>) {                                                 \
        run_binary_scalars<OP, T>(kFewSizes);                                                                           \
      } else {                                                                                  \
        /* rejected at compile time, with the scalar on either side */                          \
        EXPECT_FALSE((OP::template callable<Tensor<T>, T>)) << lazy::dtype_name(lazy::dtype_of<T>()); \
        EXPECT_FALSE((OP::template callable<T, Tensor<T>>)) << lazy::dtype_name(lazy::dtype_of<T>()); \
      }                                                                                         \
    });                                                                                         \
  }
SCALAR_TEST(Add)
SCALAR_TEST(Sub)
SCALAR_TEST(Mul)
SCALAR_TEST(Div)
SCALAR_TEST(Pow)
SCALAR_TEST(Maximum)
SCALAR_TEST(Minimum)
SCALAR_TEST(Eq)
SCALAR_TEST(Ne)
SCALAR_TEST(Lt)
SCALAR_TEST(Le)
SCALAR_TEST(Gt)
SCALAR_TEST(Ge)
SCALAR_TEST(And)
SCALAR_TEST(Or)
SCALAR_TEST(LogicalAnd)
SCALAR_TEST(LogicalOr)
#undef SCALAR_TEST

// ---- weak scalars and promotion -------------------------------------------------------

TEST(WeakScalar, TypesFollowPyTorch) {
  const auto i = lazy::from_vector<i32>({-3, 0, 5, 7}, Shape{4});
  const auto f = lazy::from_vector<float>({-1.5f, 0.25f, 2.0f, 3.0f}, Shape{4});
  const auto b = lazy::from_vector<bool>({true, false, true, false}, Shape{4});
  const auto h = lazy::from_vector<bf16>({bf16(1.0f), bf16(-2.5f), bf16(3.0f), bf16(0.5f)}, Shape{4});
  const auto d = lazy::from_vector<double>({1e-3, 2.0, -4.0, 8.5}, Shape{4});
  const auto l = lazy::from_vector<i64>({(1ll << 40) + 1, -5, 0, 9}, Shape{4});

  auto r1 = lazy::eval(i * 0.5);  // int tensor * float scalar -> float32
  static_assert(std::is_same_v<decltype(r1), Tensor<float>>);
  EXPECT_EQ(r1.to_vector(), (std::vector<float>{-1.5f, 0.0f, 2.5f, 3.5f}));

  auto r2 = lazy::eval(f * 2);  // float tensor * int scalar stays float32
  static_assert(std::is_same_v<decltype(r2), Tensor<float>>);
  EXPECT_EQ(r2.to_vector(), (std::vector<float>{-3.0f, 0.5f, 4.0f, 6.0f}));

  auto r3 = lazy::eval(b + 1);  // bool + int -> int64
  static_assert(std::is_same_v<decltype(r3), Tensor<i64>>);
  EXPECT_EQ(r3.to_vector(), (std::vector<i64>{2, 1, 2, 1}));

  auto r4 = lazy::eval(1 + b);
  static_assert(std::is_same_v<decltype(r4), Tensor<i64>>);
  EXPECT_EQ(r4.to_vector(), (std::vector<i64>{2, 1, 2, 1}));

  auto r5 = lazy::eval(f * 0.1);  // the double scalar becomes a float: computed as float * 0.1f
  static_assert(std::is_same_v<decltype(r5), Tensor<float>>);
  const auto g5 = r5.to_vector();
  const std::vector<float> fv{-1.5f, 0.25f, 2.0f, 3.0f};
  for (int k = 0; k < 4; ++k) EXPECT_EQ(g5[k], fv[k] * 0.1f);

  auto r6 = lazy::eval(h * 2.5);  // bf16 tensor keeps bf16
  static_assert(std::is_same_v<decltype(r6), Tensor<bf16>>);
  const auto g6 = r6.to_vector();
  const std::vector<float> hv{1.0f, -2.5f, 3.0f, 0.5f};
  for (int k = 0; k < 4; ++k) EXPECT_EQ(g6[k].bits, round_bf16(hv[k] * 2.5f).bits);

  auto r7 = lazy::eval(d + 1.5f);  // double stays double
  static_assert(std::is_same_v<decltype(r7), Tensor<double>>);
  EXPECT_EQ(r7.to_vector(), (std::vector<double>{1e-3 + 1.5, 3.5, -2.5, 10.0}));

  auto r8 = lazy::eval(l + 3);  // int64 stays int64, exactly
  static_assert(std::is_same_v<decltype(r8), Tensor<i64>>);
  EXPECT_EQ(r8.to_vector(), (std::vector<i64>{(1ll << 40) + 4, -2, 3, 12}));

  auto r9 = lazy::eval(i + i64(4));  // int64 scalar is weak next to int32
  static_assert(std::is_same_v<decltype(r9), Tensor<i32>>);
  EXPECT_EQ(r9.to_vector(), (std::vector<i32>{1, 4, 9, 11}));

  auto r10 = lazy::eval(0.5 - i);
  static_assert(std::is_same_v<decltype(r10), Tensor<float>>);
  EXPECT_EQ(r10.to_vector(), (std::vector<float>{3.5f, 0.5f, -4.5f, -6.5f}));

  auto r11 = lazy::eval(1 / i);  // true division
  static_assert(std::is_same_v<decltype(r11), Tensor<float>>);
  const auto g11 = r11.to_vector();
  EXPECT_EQ(g11[0], 1.0f / -3.0f);
  EXPECT_EQ(g11[1], std::numeric_limits<float>::infinity());
  EXPECT_EQ(g11[2], 0.2f);

  auto r12 = lazy::eval(i < 0.5);  // compared in float
  static_assert(std::is_same_v<decltype(r12), Tensor<bool>>);
  EXPECT_EQ(r12.to_vector(), (std::vector<bool>{true, true, false, false}));

  auto r13 = lazy::eval(b * true);
  static_assert(std::is_same_v<decltype(r13), Tensor<bool>>);
  EXPECT_EQ(r13.to_vector(), (std::vector<bool>{true, false, true, false}));

  auto r14 = lazy::eval(b * 2.5);  // bool * float -> float32
  static_assert(std::is_same_v<decltype(r14), Tensor<float>>);
  EXPECT_EQ(r14.to_vector(), (std::vector<float>{2.5f, 0.0f, 2.5f, 0.0f}));

  auto r15 = lazy::eval(i * bf16(0.5f));  // a bfloat16 scalar is a floating scalar
  static_assert(std::is_same_v<decltype(r15), Tensor<float>>);
  EXPECT_EQ(r15.to_vector(), (std::vector<float>{-1.5f, 0.0f, 2.5f, 3.5f}));

  auto r16 = lazy::eval(lazy::where(b, i, 0.5));  // where(cond, int, 0.5) -> float32
  static_assert(std::is_same_v<decltype(r16), Tensor<float>>);
  EXPECT_EQ(r16.to_vector(), (std::vector<float>{-3.0f, 0.5f, 5.0f, 0.5f}));

  auto r17 = lazy::eval(lazy::where(b, 1, 0));  // two int scalars -> int64
  static_assert(std::is_same_v<decltype(r17), Tensor<i64>>);
  EXPECT_EQ(r17.to_vector(), (std::vector<i64>{1, 0, 1, 0}));

  auto r18 = lazy::eval(lazy::where(b, 1.5, 0));  // float and int scalars -> float32
  static_assert(std::is_same_v<decltype(r18), Tensor<float>>);
  EXPECT_EQ(r18.to_vector(), (std::vector<float>{1.5f, 0.0f, 1.5f, 0.0f}));

  auto r19 = lazy::eval(lazy::pow(i, 2));
  static_assert(std::is_same_v<decltype(r19), Tensor<i32>>);
  EXPECT_EQ(r19.to_vector(), (std::vector<i32>{9, 0, 25, 49}));

  auto r20 = lazy::eval(lazy::pow(2.0, f));  // scalar base
  static_assert(std::is_same_v<decltype(r20), Tensor<float>>);
  const auto g20 = r20.to_vector();
  for (int k = 0; k < 4; ++k) EXPECT_NEAR(g20[k], std::pow(2.0, fv[k]), 1e-6 * std::pow(2.0, fv[k]));
}

TEST(Promotion, MixedTensorDtypes) {
  const std::int64_t n = 1000;
  run_binary_tensors<Add, i32, float>({0, 1, 7, n});
  run_binary_tensors<Add, float, double>({0, 1, 7, n});
  run_binary_tensors<Mul, double, float>({1, 7, n});
  run_binary_tensors<Add, i32, i64>({1, 7, n});  // int64 values beyond 2^31 stay exact
  run_binary_tensors<Sub, i64, i32>({1, 7, n});
  run_binary_tensors<Add, bool, i32>({1, 7, n});
  run_binary_tensors<Mul, i64, bf16>({1, 7, n});
  run_binary_tensors<Add, bf16, float>({1, 7, n});
  run_binary_tensors<Add, bf16, double>({1, 7, n});
  run_binary_tensors<Div, i32, i64>({1, 7, n});  // integer true division -> float32
  run_binary_tensors<Div, i32, i32>({1, 7, n});
  run_binary_tensors<Div, bool, float>({1, 7, n});
  run_binary_tensors<Lt, i32, float>({1, 7, n});
  run_binary_tensors<Eq, i64, double>({1, 7, n});
  run_binary_tensors<Maximum, i32, float>({1, 7, n});
  run_binary_tensors<Pow, float, i32>({1, 7, n});
  run_binary_tensors<Pow, i32, double>({1, 7, n});
}

TEST(Promotion, IntegerDivisionByZeroIsIeee) {
  auto a = lazy::from_vector<i32>({1, -1, 0, 7}, Shape{4});
  auto z = lazy::zeros<i32>({4});
  auto r = lazy::eval(a / z);
  static_assert(std::is_same_v<decltype(r), Tensor<float>>);
  const auto g = r.to_vector();
  EXPECT_EQ(g[0], std::numeric_limits<float>::infinity());
  EXPECT_EQ(g[1], -std::numeric_limits<float>::infinity());
  EXPECT_TRUE(std::isnan(g[2]));
  EXPECT_EQ(g[3], std::numeric_limits<float>::infinity());
}


}  // namespace
