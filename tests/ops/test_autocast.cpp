// Autocast (core/autocast.hpp) and bfloat16 products (ops/matmul.hpp, ops/conv.hpp):
// under an AutocastGuard, matmul, linear, bmm and conv2d of float tensors equal a scalar
// reference that rounds the operands to bfloat16, accumulates in double and rounds the
// result to bfloat16; outside it they are float products. The guard is per thread and
// nests. bfloat16 tensors multiply the same way.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

#include <lazytensor/lazytensor.hpp>

#include "testing/helpers.hpp"

namespace {

using lazy::Shape;
using lazy::Tensor;

// bfloat16 rounding written from the definition (round to nearest, ties to even, on the top
// 16 bits of the float), independent of lazy::bfloat16.
float round_bf16(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  const std::uint32_t lsb = (u >> 16) & 1u;
  u += 0x7fffu + lsb;
  u &= 0xffff0000u;
  float r;
  std::memcpy(&r, &u, 4);
  return r;
}

// [m, k] x [k, n] with the operands rounded first when `autocast`, accumulated in double.
std::vector<float> reference_mm(const std::vector<float>& a, const std::vector<float>& b, int m, int k, int n,
                                bool autocast) {
  std::vector<float> c(static_cast<std::size_t>(m * n));
  for (int i = 0; i < m; ++i) {
    for (int j = 0; j < n; ++j) {
      double acc = 0;
      for (int p = 0; p < k; ++p) {
        const float x = a[static_cast<std::size_t>(i * k + p)], y = b[static_cast<std::size_t>(p * n + j)];
        acc += autocast ? static_cast<double>(round_bf16(x)) * round_bf16(y) : static_cast<double>(x) * y;
      }
      c[static_cast<std::size_t>(i * n + j)] = autocast ? round_bf16(static_cast<float>(acc)) : static_cast<float>(acc);
    }
  }
  return c;
}

// Within one bfloat16 step of the reference (the float sum may round to the neighbour).
void expect_bf16_close(const std::vector<float>& got, const std::vector<float>& want) {
  ASSERT_EQ(got.size(), want.size());
  for (std::size_t i = 0; i < got.size(); ++i) {
    EXPECT_TRUE(lazy_tests::representable_in_bf16(got[i])) << "element " << i << " = " << got[i] << " is not a bfloat16 value";
    EXPECT_NEAR(got[i], want[i], std::abs(want[i]) * 0x1p-7 + 1e-6) << "element " << i;
  }
}

const int kM = 7, kK = 37, kN = 13;  // remainders on every tile edge

TEST(Autocast, MatmulRoundsOperandsAndResultOnlyUnderTheGuard) {
  const auto a = lazy_tests::random_values<float>(kM * kK, 1), b = lazy_tests::random_values<float>(kK * kN, 2);
  const Tensor<float> ta = lazy::from_vector<float>(a, Shape{kM, kK}), tb = lazy::from_vector<float>(b, Shape{kK, kN});
  EXPECT_FALSE(lazy::is_autocast_enabled());
  std::vector<float> cast_result;
  {
    lazy::AutocastGuard guard;
    EXPECT_TRUE(lazy::is_autocast_enabled());
    EXPECT_EQ(lazy::get_autocast_dtype(), lazy::DType::BFloat16);
    cast_result = lazy::matmul(ta, tb).to_vector();
  }
  EXPECT_FALSE(lazy::is_autocast_enabled());
  expect_bf16_close(cast_result, reference_mm(a, b, kM, kK, kN, true));
  // Outside the guard: a float product (not rounded: most results have low bits set).
  const auto plain = lazy::matmul(ta, tb).to_vector();
  const auto want = reference_mm(a, b, kM, kK, kN, false);
  int unrounded = 0;
  for (std::size_t i = 0; i < plain.size(); ++i) {
    EXPECT_NEAR(plain[i], want[i], 1e-5) << i;
    unrounded += !lazy_tests::representable_in_bf16(plain[i]);
  }
  EXPECT_GT(unrounded, static_cast<int>(plain.size()) / 2);
}

TEST(Autocast, LinearAndBmmFollowTheSameRule) {
  const auto x = lazy_tests::random_values<float>(kM * kK, 3), w = lazy_tests::random_values<float>(kN * kK, 4);
  std::vector<float> wt(static_cast<std::size_t>(kK * kN));  // w^T, [k, n]
  for (int i = 0; i < kN; ++i)
    for (int p = 0; p < kK; ++p) wt[static_cast<std::size_t>(p * kN + i)] = w[static_cast<std::size_t>(i * kK + p)];
  const Tensor<float> tx = lazy::from_vector<float>(x, Shape{kM, kK}), tw = lazy::from_vector<float>(w, Shape{kN, kK});
  lazy::AutocastGuard guard;
  expect_bf16_close(lazy::linear(tx, tw).to_vector(), reference_mm(x, wt, kM, kK, kN, true));
  // bmm: two batches of the same product.
  const Tensor<float> twt = lazy::transpose(tw, 0, 1);
  const Tensor<float> bx = lazy::stack<float>({tx, tx}, 0), bw = lazy::stack<float>({twt, twt}, 0);
  const auto got = lazy::bmm(bx, bw).to_vector();
  auto want = reference_mm(x, wt, kM, kK, kN, true);
  want.insert(want.end(), want.begin(), want.end());
  expect_bf16_close(got, want);
}

TEST(Autocast, Conv2dRoundsOperandsBiasAndResult) {
  // 1 x 2 x 5 x 5 input, 3 x 2 x 3 x 3 kernel, bias: reference by direct summation.
  const auto x = lazy_tests::random_values<float>(50, 5), w = lazy_tests::random_values<float>(54, 6),
             b = lazy_tests::random_values<float>(3, 7);
  std::vector<float> want;
  for (int o = 0; o < 3; ++o) {
    for (int i = 0; i < 3; ++i) {
      for (int j = 0; j < 3; ++j) {
        double acc = round_bf16(b[static_cast<std::size_t>(o)]);
        for (int c = 0; c < 2; ++c)
          for (int u = 0; u < 3; ++u)
            for (int v = 0; v < 3; ++v)
              acc += static_cast<double>(round_bf16(x[static_cast<std::size_t>(c * 25 + (i + u) * 5 + j + v)])) *
                     round_bf16(w[static_cast<std::size_t>(((o * 2 + c) * 3 + u) * 3 + v)]);
        want.push_back(round_bf16(static_cast<float>(acc)));
      }
    }
  }
  lazy::AutocastGuard guard;
  const auto got = lazy::conv2d(lazy::from_vector<float>(x, Shape{1, 2, 5, 5}), lazy::from_vector<float>(w, Shape{3, 2, 3, 3}),
                                lazy::from_vector<float>(b, Shape{3}))
                       .to_vector();
  expect_bf16_close(got, want);
}

TEST(Autocast, GuardsNestAndStayOnTheirThread) {
  const auto a = lazy_tests::random_values<float>(kM * kK, 8), b = lazy_tests::random_values<float>(kK * kN, 9);
  const Tensor<float> ta = lazy::from_vector<float>(a, Shape{kM, kK}), tb = lazy::from_vector<float>(b, Shape{kK, kN});
  lazy::AutocastGuard on;
  {
    lazy::AutocastGuard off(false);
    EXPECT_FALSE(lazy::is_autocast_enabled());
    const auto plain = lazy::matmul(ta, tb).to_vector();
    const auto want = reference_mm(a, b, kM, kK, kN, false);
    for (std::size_t i = 0; i < plain.size(); ++i) EXPECT_NEAR(plain[i], want[i], 1e-5) << i;
  }
  EXPECT_TRUE(lazy::is_autocast_enabled());
  bool other_thread_sees_autocast = true;
  std::thread t([&] { other_thread_sees_autocast = lazy::is_autocast_enabled(); });
  t.join();
  EXPECT_FALSE(other_thread_sees_autocast);
}

TEST(Autocast, GradientsFlowThroughTheRoundedProduct) {
  // d/dx sum(linear(x, w) * g) = round(round(g) w_r) with w_r the rounded weight: the
  // gradient passes back through the casts, so it is rounded as torch's autocast rounds it.
  const int m = 3, k = 5, n = 4;
  const auto x = lazy_tests::random_values<float>(m * k, 10), w = lazy_tests::random_values<float>(n * k, 11),
             g = lazy_tests::random_values<float>(m * n, 12);
  Tensor<float> tx = lazy::from_vector<float>(x, Shape{m, k});
  tx.requires_grad_();
  {
    lazy::AutocastGuard guard;
    lazy::linear(tx, lazy::from_vector<float>(w, Shape{n, k})).backward(lazy::from_vector<float>(g, Shape{m, n}));
  }
  const auto got = tx.grad().to_vector();
  for (int i = 0; i < m; ++i) {
    for (int p = 0; p < k; ++p) {
      double acc = 0;
      for (int j = 0; j < n; ++j)
        acc += static_cast<double>(round_bf16(g[static_cast<std::size_t>(i * n + j)])) *
               round_bf16(w[static_cast<std::size_t>(j * k + p)]);
      const float want = round_bf16(static_cast<float>(acc));
      EXPECT_NEAR(got[static_cast<std::size_t>(i * k + p)], want, std::abs(want) * 0x1p-7 + 1e-6) << i << "," << p;
    }
  }
}

TEST(Autocast, PackedShapesAndBothGradientsOfLinear) {
  // Large enough for the packed bfloat16 GEMM on every instruction set (and odd depths, so
  // the last pair of k is padded): y = linear(x, w), dx = round(round(g) w_r),
  // dw = round(round(g)^T x_r), each a bfloat16 product with float accumulation.
  const int m = 70, k = 131, n = 45;
  const auto x = lazy_tests::random_values<float>(m * k, 21), w = lazy_tests::random_values<float>(n * k, 22),
             g = lazy_tests::random_values<float>(m * n, 23);
  Tensor<float> tx = lazy::from_vector<float>(x, Shape{m, k}), tw = lazy::from_vector<float>(w, Shape{n, k});
  tx.requires_grad_();
  tw.requires_grad_();
  std::vector<float> y;
  {
    lazy::AutocastGuard guard;
    Tensor<float> out = lazy::linear(tx, tw);
    y = out.to_vector();
    out.backward(lazy::from_vector<float>(g, Shape{m, n}));
  }
  // r x c results of sum_q f(i, q) * h(q, j) over d terms, operands rounded first.
  auto product = [](int r, int c, int d, auto f, auto h) {
    std::vector<float> out;
    for (int i = 0; i < r; ++i)
      for (int j = 0; j < c; ++j) {
        double acc = 0;
        for (int q = 0; q < d; ++q) acc += static_cast<double>(round_bf16(f(i, q))) * round_bf16(h(q, j));
        out.push_back(round_bf16(static_cast<float>(acc)));
      }
    return out;
  };
  auto at = [](const std::vector<float>& v, int i) { return v[static_cast<std::size_t>(i)]; };
  expect_bf16_close(y, product(m, n, k, [&](int i, int q) { return at(x, i * k + q); },
                               [&](int q, int j) { return at(w, j * k + q); }));
  expect_bf16_close(tx.grad().to_vector(), product(m, k, n, [&](int i, int q) { return at(g, i * n + q); },
                                                   [&](int q, int j) { return at(w, q * k + j); }));
  expect_bf16_close(tw.grad().to_vector(), product(n, k, m, [&](int i, int q) { return at(g, q * n + i); },
                                                   [&](int q, int j) { return at(x, q * k + j); }));
}

TEST(Autocast, OnlyBFloat16IsAnAutocastDtype) {
  EXPECT_THROW(lazy::AutocastGuard(true, lazy::DType::Float64), lazy::DTypeError);
  EXPECT_THROW(lazy::AutocastGuard(true, lazy::DType::Int32), lazy::DTypeError);
  EXPECT_FALSE(lazy::is_autocast_enabled());
}

TEST(BFloat16Products, MatmulAccumulatesInFloatAndRoundsOnce) {
  const auto a = lazy_tests::random_values<float>(kM * kK, 13), b = lazy_tests::random_values<float>(kK * kN, 14);
  std::vector<lazy::bfloat16> ab(a.begin(), a.end()), bb(b.begin(), b.end());
  const auto got = lazy::matmul(lazy::from_vector<lazy::bfloat16>(ab, Shape{kM, kK}),
                                lazy::from_vector<lazy::bfloat16>(bb, Shape{kK, kN}))
                       .to_vector();
  std::vector<float> as_float;
  for (auto v : got) as_float.push_back(static_cast<float>(v));
  expect_bf16_close(as_float, reference_mm(a, b, kM, kK, kN, true));
}

}  // namespace
