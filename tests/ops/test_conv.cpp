// Tests of ops/conv.hpp: conv2d, unfold and fold against direct nested-loop references
// written here, their gradients against finite differences, the thread-count invariance
// of the parallel kernels, and the shape errors.

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "../autograd/gradcheck.hpp"

#include <lazytensor/ops/conv.hpp>

#include "testing/helpers.hpp"

namespace {

using lazy_tests::random_values;

using lazy::Shape;
using lazy::Size2;
using lazy::Tensor;

/// One convolution: sizes and window arguments.
struct ConvCase {
  std::int64_t n, c, h, w, o, kh, kw;
  Size2 stride = 1, padding = 0, dilation = 1;
  bool bias = true;
  std::string str() const {
    return "x [" + std::to_string(n) + ", " + std::to_string(c) + ", " + std::to_string(h) + ", " +
           std::to_string(w) + "], weight [" + std::to_string(o) + ", " + std::to_string(c) + ", " +
           std::to_string(kh) + ", " + std::to_string(kw) + "], stride " + stride.str() +
           ", padding " + padding.str() + ", dilation " + dilation.str() +
           (bias ? ", bias" : ", no bias");
  }
  std::int64_t oh() const { return (h + 2 * padding.h - dilation.h * (kh - 1) - 1) / stride.h + 1; }
  std::int64_t ow() const { return (w + 2 * padding.w - dilation.w * (kw - 1) - 1) / stride.w + 1; }
};

/// The definition of a cross-correlation, term by term, in long double; `mag` gets the sum
/// of |terms| of each output for the tolerance.
template <class T>
std::vector<long double> reference_conv(const ConvCase& k, const std::vector<T>& x,
                                        const std::vector<T>& w, const std::vector<T>& b,
                                        std::vector<long double>* mag = nullptr) {
  const std::int64_t OH = k.oh(), OW = k.ow();
  std::vector<long double> out(static_cast<std::size_t>(k.n * k.o * OH * OW));
  if (mag) mag->assign(out.size(), 0);
  for (std::int64_t n = 0; n < k.n; ++n)
    for (std::int64_t o = 0; o < k.o; ++o)
      for (std::int64_t oy = 0; oy < OH; ++oy)
        for (std::int64_t ox = 0; ox < OW; ++ox) {
          long double s = k.bias ? b[o] : 0,
                      m = k.bias ? std::fabs(static_cast<long double>(b[o])) : 0;
          for (std::int64_t c = 0; c < k.c; ++c)
            for (std::int64_t i = 0; i < k.kh; ++i)
              for (std::int64_t j = 0; j < k.kw; ++j) {
                const std::int64_t y = oy * k.stride.h - k.padding.h + i * k.dilation.h;
                const std::int64_t xx = ox * k.stride.w - k.padding.w + j * k.dilation.w;
                if (y < 0 || y >= k.h || xx < 0 || xx >= k.w) continue;
                const long double t =
                    static_cast<long double>(x[((n * k.c + c) * k.h + y) * k.w + xx]) *
                    w[((o * k.c + c) * k.kh + i) * k.kw + j];
                s += t;
                m += std::fabs(t);
              }
          const auto at = static_cast<std::size_t>(((n * k.o + o) * OH + oy) * OW + ox);
          out[at] = s;
          if (mag) (*mag)[at] = m;
        }
  return out;
}

template <class T>
Tensor<T> run_conv(const ConvCase& k, const std::vector<T>& x, const std::vector<T>& w,
                   const std::vector<T>& b) {
  Tensor<T> bias = k.bias ? lazy::from_vector<T>(b, Shape{k.o}) : Tensor<T>();
  return lazy::conv2d(lazy::from_vector<T>(x, Shape{k.n, k.c, k.h, k.w}),
                      lazy::from_vector<T>(w, Shape{k.o, k.c, k.kh, k.kw}), bias, k.stride,
                      k.padding, k.dilation);
}

template <class T>
void check_forward(const ConvCase& k, unsigned seed) {
  SCOPED_TRACE(k.str());
  const auto x = random_values<T>(k.n * k.c * k.h * k.w, seed);
  const auto w = random_values<T>(k.o * k.c * k.kh * k.kw, seed + 1);
  const auto b = random_values<T>(k.o, seed + 2);
  std::vector<long double> mag;
  const auto ref = reference_conv(k, x, w, b, &mag);
  Tensor<T> y = run_conv(k, x, w, b);
  ASSERT_EQ(y.shape(), (Shape{k.n, k.o, k.oh(), k.ow()}));
  const auto got = y.to_vector();
  const long double eps = std::is_same_v<T, float> ? 1e-6L : 1e-15L;
  for (std::size_t i = 0; i < ref.size(); ++i) {
    ASSERT_NEAR(static_cast<long double>(got[i]), ref[i], 4 * eps * (mag[i] + 1)) << "at " << i;
  }
}

const std::vector<ConvCase>& forward_cases() {
  static const std::vector<ConvCase> cases = {
      {1, 1, 5, 5, 1, 3, 3},                     // single channel, single image
      {3, 3, 7, 6, 4, 3, 3},                     // batch, channels, odd sizes
      {2, 3, 5, 7, 2, 1, 1},                     // 1x1: the image is its own column matrix
      {2, 3, 5, 7, 2, 1, 1, 2, 0, 1, false},     // 1x1 with stride: im2col
      {2, 2, 6, 5, 3, 1, 1, 1, 1},               // 1x1 with padding: zero border
      {2, 3, 8, 9, 2, 2, 3, {2, 1}, {1, 0}, 1},  // non-square kernel, stride and padding
      {3, 1, 9, 9, 2, 3, 3, 2, 1, 1, false},     // stride 2, padding 1, no bias
      {1, 3, 7, 8, 2, 3, 3, 1, 2, 1},            // padding 2
      {2, 2, 9, 10, 3, 3, 2, 1, 0, 2},           // dilation 2
      {2, 2, 11, 9, 3, 3, 3, 2, 2, {2, 3}},      // everything at once
      {1, 2, 3, 3, 2, 3, 3, 1, 0, 1},            // kernel = input: 1x1 output
      {1, 1, 1, 1, 1, 3, 3, 1, 1, 1},            // 1x1 input, padded to the kernel
      {2, 3, 4, 5, 2, 2, 2, 3, 1, 1, false},     // stride larger than the kernel
  };
  return cases;
}

TEST(Conv2d, ForwardDoubleAgainstDirectLoops) {
  unsigned seed = 1;
  for (const auto& k : forward_cases()) check_forward<double>(k, seed += 3);
}

TEST(Conv2d, ForwardFloatAgainstDirectLoops) {
  unsigned seed = 100;
  for (const auto& k : forward_cases()) check_forward<float>(k, seed += 3);
}

TEST(Conv2d, ExpressionInputAndDefaults) {
  const ConvCase k{2, 2, 5, 5, 3, 3, 3, 1, 0, 1, false};
  const auto x = random_values<double>(2 * 2 * 5 * 5, 7),
             w = random_values<double>(3 * 2 * 3 * 3, 8);
  std::vector<double> rx(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) rx[i] = std::max(0.0, x[i]) * 2;
  const auto ref = reference_conv<double>(k, rx, w, {});
  Tensor<double> xt = lazy::from_vector<double>(x, Shape{2, 2, 5, 5});
  Tensor<double> y =
      lazy::conv2d(lazy::relu(xt) * 2, lazy::from_vector<double>(w, Shape{3, 2, 3, 3}));
  const auto got = y.to_vector();
  ASSERT_EQ(got.size(), ref.size());
  for (std::size_t i = 0; i < ref.size(); ++i)
    EXPECT_NEAR(got[i], static_cast<double>(ref[i]), 1e-12) << i;
}

TEST(Conv2d, Bfloat16ComputesInFloatAndRoundsOnce) {
  const ConvCase k{1, 2, 6, 5, 2, 3, 3, 1, 1, 1};
  auto xf = random_values<float>(2 * 6 * 5, 3), wf = random_values<float>(2 * 2 * 9, 4),
       bf = random_values<float>(2, 5);
  std::vector<lazy::bfloat16> x, w, b;
  for (auto& v : xf) x.push_back(lazy::bfloat16(v)), v = static_cast<float>(x.back());
  for (auto& v : wf) w.push_back(lazy::bfloat16(v)), v = static_cast<float>(w.back());
  for (auto& v : bf) b.push_back(lazy::bfloat16(v)), v = static_cast<float>(b.back());
  const auto ref = reference_conv(k, xf, wf, bf);
  const auto got = run_conv(k, x, w, b).to_vector();
  ASSERT_EQ(got.size(), ref.size());
  for (std::size_t i = 0; i < ref.size(); ++i) {
    const double r = static_cast<double>(ref[i]);
    EXPECT_NEAR(static_cast<float>(got[i]), r, std::fabs(r) * (1.0 / 256) + 1e-5) << i;
  }
}

TEST(Conv2d, EmptyBatch) {
  Tensor<double> x = lazy::zeros<double>(Shape{0, 2, 5, 5});
  Tensor<double> w =
      lazy::from_vector<double>(random_values<double>(3 * 2 * 9, 1), Shape{3, 2, 3, 3});
  w.requires_grad_();
  Tensor<double> y = lazy::conv2d(x, w, {}, 1, 1);
  EXPECT_EQ(y.shape(), (Shape{0, 3, 5, 5}));
  lazy::sum(y).backward();
  const auto g = w.grad().to_vector();
  ASSERT_EQ(static_cast<std::int64_t>(g.size()), w.numel());
  for (double v : g) EXPECT_EQ(v, 0.0);
}

// Above the threading threshold (im2col, GEMM, col2im and the reductions of the weight
// and bias gradients all split): every thread count gives the same bits, forward and
// backward, and the forward matches the reference.
TEST(Conv2d, ThreadCountDoesNotChangeBits) {
  auto& pool = lazy::graph::current_device().threads();
  const int saved = pool.size();
  const ConvCase k{4, 8, 48, 47, 8, 3, 3, 1, 1, 1};
  const auto x = random_values<float>(k.n * k.c * k.h * k.w, 11);
  const auto w = random_values<float>(k.o * k.c * k.kh * k.kw, 12);
  const auto b = random_values<float>(k.o, 13);
  const auto gy = random_values<float>(k.n * k.o * k.oh() * k.ow(), 14);
  std::vector<long double> mag;
  const auto ref = reference_conv(k, x, w, b, &mag);
  std::vector<std::vector<float>> first;
  for (int threads : {1, 2, 4}) {
    SCOPED_TRACE("threads " + std::to_string(threads));
    lazy::set_num_threads(threads);
    Tensor<float> xt = lazy::from_vector<float>(x, Shape{k.n, k.c, k.h, k.w}).requires_grad_();
    Tensor<float> wt = lazy::from_vector<float>(w, Shape{k.o, k.c, k.kh, k.kw}).requires_grad_();
    Tensor<float> bt = lazy::from_vector<float>(b, Shape{k.o}).requires_grad_();
    Tensor<float> y = lazy::conv2d(xt, wt, bt, 1, 1);
    y.backward(lazy::from_vector<float>(gy, y.shape()));
    lazy::mark_step();
    std::vector<std::vector<float>> now{y.to_vector(), xt.grad().to_vector(), wt.grad().to_vector(),
                                        bt.grad().to_vector()};
    if (first.empty()) {
      first = now;
      for (std::size_t i = 0; i < ref.size(); ++i) {
        ASSERT_NEAR(static_cast<long double>(now[0][i]), ref[i], 4e-6L * (mag[i] + 1))
            << "at " << i;
      }
    } else {
      for (std::size_t t = 0; t < now.size(); ++t) EXPECT_EQ(now[t], first[t]) << "tensor " << t;
    }
  }
  lazy::set_num_threads(saved);
}

// ---- gradients ------------------------------------------------------------------------

using V = std::vector<Tensor<double>>;

TEST(Conv2dGrad, InputWeightBias) {
  using gradcheck::input;
  const auto conv = [](Size2 s, Size2 p, Size2 d) {
    return [=](const V& v) { return lazy::conv2d(v[0], v[1], v[2], s, p, d); };
  };
  gradcheck::check("3x3", conv(1, 0, 1),
                   {input(Shape{2, 2, 5, 4}, 1), input(Shape{3, 2, 3, 3}, 2), input(Shape{3}, 3)});
  gradcheck::check("2x3 stride 2 padding 1", conv({2, 2}, {1, 1}, 1),
                   {input(Shape{2, 2, 5, 6}, 4), input(Shape{2, 2, 2, 3}, 5), input(Shape{2}, 6)});
  gradcheck::check("dilation 2 padding 2", conv(1, 2, 2),
                   {input(Shape{1, 2, 4, 5}, 7), input(Shape{2, 2, 3, 2}, 8), input(Shape{2}, 9)});
  gradcheck::check(
      "mixed stride/padding/dilation", conv({2, 1}, {1, 2}, {1, 2}),
      {input(Shape{2, 1, 6, 5}, 10), input(Shape{3, 1, 3, 3}, 11), input(Shape{3}, 12)});
  gradcheck::check(
      "1x1 (no im2col)", conv(1, 0, 1),
      {input(Shape{2, 3, 3, 4}, 13), input(Shape{2, 3, 1, 1}, 14), input(Shape{2}, 15)});
  gradcheck::check(
      "no bias, relu after",
      [](const V& v) { return Tensor<double>(lazy::relu(lazy::conv2d(v[0], v[1], {}, 1, 1))); },
      {input(Shape{2, 2, 4, 4}, 16), input(Shape{2, 2, 3, 3}, 17)});
}

TEST(Conv2dGrad, OnlyWeightOrOnlyInput) {
  // Gradients flow to the operands that require them and nowhere else.
  Tensor<double> x =
      lazy::from_vector<double>(random_values<double>(2 * 2 * 4 * 4, 1), Shape{2, 2, 4, 4});
  Tensor<double> w =
      lazy::from_vector<double>(random_values<double>(3 * 2 * 9, 2), Shape{3, 2, 3, 3});
  w.requires_grad_();
  lazy::sum(lazy::conv2d(x, w)).backward();
  EXPECT_TRUE(w.grad().defined());
  EXPECT_FALSE(x.grad().defined());
  // d sum(conv(x, w)) / dw[o, c, i, j] = sum of x over the window positions of tap (i, j).
  const auto xv = x.to_vector();
  const auto g = w.grad().to_vector();
  for (std::int64_t o = 0; o < 3; ++o)
    for (std::int64_t c = 0; c < 2; ++c)
      for (std::int64_t i = 0; i < 3; ++i)
        for (std::int64_t j = 0; j < 3; ++j) {
          double s = 0;
          for (std::int64_t n = 0; n < 2; ++n)
            for (std::int64_t oy = 0; oy < 2; ++oy)
              for (std::int64_t ox = 0; ox < 2; ++ox)
                s += xv[((n * 2 + c) * 4 + oy + i) * 4 + ox + j];
          EXPECT_NEAR(g[((o * 2 + c) * 3 + i) * 3 + j], s, 1e-12);
        }
}

// ---- unfold / fold ----------------------------------------------------------------------

TEST(Unfold, MatchesDefinitionAndFoldIsItsAdjoint) {
  const ConvCase k{2, 3, 6, 7, 1, 2, 3, {2, 1}, {1, 1}, {1, 2}};
  const std::int64_t OH = k.oh(), OW = k.ow(), K = k.c * k.kh * k.kw, L = OH * OW;
  const auto x = random_values<double>(k.n * k.c * k.h * k.w, 21);
  Tensor<double> xt = lazy::from_vector<double>(x, Shape{k.n, k.c, k.h, k.w});
  Tensor<double> cols = lazy::unfold(xt, Size2(k.kh, k.kw), k.dilation, k.padding, k.stride);
  ASSERT_EQ(cols.shape(), (Shape{k.n, K, L}));
  const auto got = cols.to_vector();
  for (std::int64_t n = 0; n < k.n; ++n)
    for (std::int64_t c = 0; c < k.c; ++c)
      for (std::int64_t i = 0; i < k.kh; ++i)
        for (std::int64_t j = 0; j < k.kw; ++j)
          for (std::int64_t oy = 0; oy < OH; ++oy)
            for (std::int64_t ox = 0; ox < OW; ++ox) {
              const std::int64_t y = oy * k.stride.h - k.padding.h + i * k.dilation.h;
              const std::int64_t xx = ox * k.stride.w - k.padding.w + j * k.dilation.w;
              const double want = (y < 0 || y >= k.h || xx < 0 || xx >= k.w)
                                      ? 0.0
                                      : x[((n * k.c + c) * k.h + y) * k.w + xx];
              EXPECT_EQ(got[((n * K + (c * k.kh + i) * k.kw + j) * L) + oy * OW + ox], want);
            }
  // <unfold(x), u> == <x, fold(u)> for any u.
  const auto u = random_values<double>(k.n * K * L, 22);
  Tensor<double> f = lazy::fold(lazy::from_vector<double>(u, Shape{k.n, K, L}), Size2(k.h, k.w),
                                Size2(k.kh, k.kw), k.dilation, k.padding, k.stride);
  ASSERT_EQ(f.shape(), (Shape{k.n, k.c, k.h, k.w}));
  const auto fv = f.to_vector();
  long double lhs = 0, rhs = 0;
  for (std::size_t i = 0; i < u.size(); ++i) lhs += static_cast<long double>(got[i]) * u[i];
  for (std::size_t i = 0; i < x.size(); ++i) rhs += static_cast<long double>(x[i]) * fv[i];
  EXPECT_NEAR(static_cast<double>(lhs), static_cast<double>(rhs), 1e-12);
}

TEST(Unfold, Gradients) {
  using gradcheck::input;
  gradcheck::check("unfold",
                   [](const V& v) {
                     return lazy::unfold(v[0], {2, 3}, {1, 2}, 1, {2, 1});
                   },
                   {input(Shape{2, 2, 5, 6}, 31)});
  // fold: 3x3 kernel, stride 2, padding 1 over a 5x4 output: 3x2 block positions.
  gradcheck::check("fold",
                   [](const V& v) {
                     return lazy::fold(v[0], {5, 4}, 3, 1, 1, 2);
                   },
                   {input(Shape{2, 2 * 9, 6}, 32)});
}

// ---- errors -----------------------------------------------------------------------------

TEST(Conv2d, ShapeErrors) {
  auto z = [](Shape s) { return lazy::zeros<float>(s); };
  const auto x = z(Shape{2, 3, 8, 8}), w = z(Shape{4, 3, 3, 3});
  EXPECT_THROW(lazy::conv2d(z(Shape{3, 8, 8}), w), lazy::ShapeError);        // rank 3 input
  EXPECT_THROW(lazy::conv2d(z(Shape{1, 2, 3, 8, 8}), w), lazy::ShapeError);  // rank 5 input
  EXPECT_THROW(lazy::conv2d(x, z(Shape{4, 3, 3})), lazy::ShapeError);        // rank 3 weight
  EXPECT_THROW(lazy::conv2d(x, z(Shape{4, 2, 3, 3})), lazy::ShapeError);     // channel mismatch
  EXPECT_THROW(lazy::conv2d(x, w, z(Shape{3})), lazy::ShapeError);           // bias size
  EXPECT_THROW(lazy::conv2d(x, w, z(Shape{4, 1})), lazy::ShapeError);        // bias rank
  EXPECT_THROW(lazy::conv2d(x, z(Shape{4, 3, 9, 3})), lazy::ShapeError);     // kernel > input
  EXPECT_THROW(lazy::conv2d(x, z(Shape{4, 3, 5, 5}), {}, 1, 0, 2),
               lazy::ShapeError);                                         // dilated kernel > input
  EXPECT_THROW(lazy::conv2d(x, w, {}, 0), lazy::ShapeError);              // stride 0
  EXPECT_THROW(lazy::conv2d(x, w, {}, {1, -1}), lazy::ShapeError);        // negative stride
  EXPECT_THROW(lazy::conv2d(x, w, {}, 1, -1), lazy::ShapeError);          // negative padding
  EXPECT_THROW(lazy::conv2d(x, w, {}, 1, 0, 0), lazy::ShapeError);        // dilation 0
  EXPECT_THROW(lazy::conv2d(z(Shape{2, 3, 0, 8}), w), lazy::ShapeError);  // empty plane
  EXPECT_NO_THROW(lazy::conv2d(x, z(Shape{4, 3, 9, 9}), {}, 1, 1));       // kernel = padded input
  EXPECT_THROW(
      lazy::conv2d(lazy::zeros<int>(Shape{2, 3, 8, 8}), lazy::zeros<int>(Shape{4, 3, 3, 3})),
      lazy::DTypeError);
  try {
    lazy::conv2d(x, z(Shape{4, 2, 3, 3}));
    FAIL() << "no error";
  } catch (const lazy::ShapeError& e) {
    // The message names what was expected and what was found.
    const std::string m = e.what();
    EXPECT_NE(m.find("C = 2"), std::string::npos) << m;
    EXPECT_NE(m.find("3 channels"), std::string::npos) << m;
  }
  const auto cols = z(Shape{2, 3 * 4, 12});
  EXPECT_NO_THROW(lazy::fold(cols, {5, 4}, 2));  // 4 x 3 = 12 block positions
  EXPECT_THROW(lazy::fold(cols, {5, 4}, 2, 1, 0, 2),
               lazy::ShapeError);  // stride 2: 2 x 2 positions
  EXPECT_THROW(lazy::fold(z(Shape{2, 10, 12}), {5, 4}, 2, 1, 0, 1),
               lazy::ShapeError);  // 10 not a multiple of 4
  EXPECT_THROW(lazy::unfold(z(Shape{2, 8, 8}), 2), lazy::ShapeError);
}

TEST(Conv2d, WindowsPastTwoToTheSixtyAreShapeErrors) {
  // Sizes whose arithmetic wrapped: a kernel product of 2^64 (0 after wrapping: fold
  // divided by it, unfold allocated nothing and wrote past it), a dilated kernel of
  // INT64_MAX * 2 + 1 (-1 after wrapping: it fit every input).
  constexpr std::int64_t big = std::int64_t{1} << 32;
  EXPECT_THROW(lazy::fold(lazy::zeros<float>(Shape{1, 4, 1}), {2, 2}, {big, big}),
               lazy::ShapeError);
  EXPECT_THROW(
      lazy::unfold(lazy::zeros<float>(Shape{1, 1, 4, 4}), {big, big}, 1, {big / 2, big / 2}),
      lazy::ShapeError);
  const auto x = lazy::zeros<float>(Shape{1, 1, 5, 5}), w = lazy::zeros<float>(Shape{1, 1, 3, 3});
  const std::int64_t max = std::numeric_limits<std::int64_t>::max();
  EXPECT_THROW(lazy::conv2d(x, w, {}, 1, 0, max), lazy::ShapeError);
  EXPECT_THROW(lazy::conv2d(x, w, {}, 1, max / 2 + 1, 1), lazy::ShapeError);
  // Below the limit the same checks pass: a padding that keeps the output small.
  EXPECT_EQ(lazy::conv2d(x, w, {}, {4, 4}, 2, 1).shape(), (Shape{1, 1, 2, 2}));
}

}  // namespace
