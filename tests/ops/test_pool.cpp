// Tests of ops/pool.hpp: max_pool2d and avg_pool2d against direct nested-loop references
// written here (forward and backward), tie and NaN rules, gradients against finite
// differences, thread-count invariance, and the shape errors.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "../autograd/gradcheck.hpp"

#include <lazytensor/ops/pool.hpp>

#include "testing/helpers.hpp"

namespace {

using lazy_tests::random_values;

using lazy::Shape;
using lazy::Size2;
using lazy::Tensor;

struct PoolCase {
  std::int64_t n, c, h, w;
  Size2 kernel;
  std::optional<Size2> stride;
  Size2 padding = 0;
  Size2 s() const { return stride.value_or(kernel); }
  std::int64_t oh() const { return (h + 2 * padding.h - kernel.h) / s().h + 1; }
  std::int64_t ow() const { return (w + 2 * padding.w - kernel.w) / s().w + 1; }
  Shape in() const { return Shape{n, c, h, w}; }
  std::string str() const {
    return "x " + in().str() + ", kernel " + kernel.str() + ", stride " + s().str() + ", padding " +
           padding.str();
  }
};

/// Visits the taps of window (oy, ox) of plane p: f(flat input index) for taps inside the
/// input; returns the number of padded taps.
template <class F>
std::int64_t for_window(const PoolCase& k, std::int64_t p, std::int64_t oy, std::int64_t ox, F&& f) {
  std::int64_t padded = 0;
  for (std::int64_t i = 0; i < k.kernel.h; ++i)
    for (std::int64_t j = 0; j < k.kernel.w; ++j) {
      const std::int64_t y = oy * k.s().h - k.padding.h + i, x = ox * k.s().w - k.padding.w + j;
      if (y < 0 || y >= k.h || x < 0 || x >= k.w) {
        ++padded;
        continue;
      }
      f((p * k.h + y) * k.w + x);
    }
  return padded;
}

/// max: the largest value; its gradient goes to the first tap (row-major) holding it.
/// avg: the mean over kernel.h * kernel.w taps (padding counts as 0) or over the taps
/// inside the input.
struct Reference {
  std::vector<double> y, dx;
};
template <class T>
Reference pool_reference(const PoolCase& k, const std::vector<T>& x, const std::vector<T>& gy, bool max,
                    bool include_pad) {
  Reference r;
  const std::int64_t planes = k.n * k.c, OH = k.oh(), OW = k.ow();
  r.y.resize(static_cast<std::size_t>(planes * OH * OW));
  r.dx.assign(x.size(), 0.0);
  for (std::int64_t p = 0; p < planes; ++p)
    for (std::int64_t oy = 0; oy < OH; ++oy)
      for (std::int64_t ox = 0; ox < OW; ++ox) {
        const auto o = static_cast<std::size_t>((p * OH + oy) * OW + ox);
        const double g = gy.empty() ? 0.0 : static_cast<double>(gy[o]);
        if (max) {
          double best = -std::numeric_limits<double>::infinity();
          std::int64_t at = -1;
          for_window(k, p, oy, ox, [&](std::int64_t i) {
            if (at < 0 || x[i] > best) best = x[i], at = i;
          });
          r.y[o] = best;
          r.dx[at] += g;
        } else {
          long double s = 0;
          std::vector<std::int64_t> taps;
          const std::int64_t padded = for_window(k, p, oy, ox, [&](std::int64_t i) {
            s += x[i];
            taps.push_back(i);
          });
          const auto div =
              static_cast<double>(include_pad ? static_cast<std::int64_t>(taps.size()) + padded
                                              : static_cast<std::int64_t>(taps.size()));
          r.y[o] = static_cast<double>(s / div);
          for (auto i : taps) r.dx[i] += g / div;
        }
      }
  return r;
}

template <class T>
Tensor<T> run(const PoolCase& k, const Tensor<T>& x, bool max, bool include_pad) {
  return max ? lazy::max_pool2d(x, k.kernel, k.stride, k.padding)
             : lazy::avg_pool2d(x, k.kernel, k.stride, k.padding, include_pad);
}

const std::vector<PoolCase>& cases() {
  static const std::vector<PoolCase> c = {
      {1, 1, 4, 4, 2, std::nullopt},              // stride = kernel
      {3, 3, 7, 6, 2, std::nullopt},              // odd sizes: the last row/column is dropped
      {2, 3, 7, 9, 3, 2, 1},                      // overlapping windows with padding
      {2, 2, 8, 7, {2, 3}, Size2{1, 2}, {1, 1}},  // non-square kernel, stride 1 and 2
      {1, 3, 5, 5, 3, 1, 1},                      // stride 1, padding 1: same size
      {2, 1, 9, 8, {3, 2}, Size2{3, 1}, {1, 0}},
      {1, 2, 1, 1, 1, std::nullopt},  // 1x1
      {1, 1, 3, 3, 3, std::nullopt},  // kernel = input
  };
  return c;
}

template <class T>
void check_all(bool max, bool include_pad, unsigned seed) {
  for (const auto& k : cases()) {
    SCOPED_TRACE(k.str() + (max ? " max" : include_pad ? " avg include_pad" : " avg"));
    const auto x = random_values<T>(k.in().numel(), seed++);
    const auto gy = random_values<T>(k.n * k.c * k.oh() * k.ow(), seed++);
    const Reference ref = pool_reference(k, x, gy, max, include_pad);
    Tensor<T> xt = lazy::from_vector<T>(x, k.in()).requires_grad_();
    Tensor<T> y = run(k, xt, max, include_pad);
    ASSERT_EQ(y.shape(), (Shape{k.n, k.c, k.oh(), k.ow()}));
    y.backward(lazy::from_vector<T>(gy, y.shape()));
    const auto yv = y.to_vector(), dx = xt.grad().to_vector();
    const double tol = std::is_same_v<T, float> ? 2e-6 : 1e-14;
    for (std::size_t i = 0; i < yv.size(); ++i) {
      if (max)
        EXPECT_EQ(static_cast<double>(yv[i]), ref.y[i]) << "y at " << i;  // a max is exact
      else
        EXPECT_NEAR(yv[i], ref.y[i], tol) << "y at " << i;
    }
    for (std::size_t i = 0; i < dx.size(); ++i)
      EXPECT_NEAR(dx[i], ref.dx[i], 4 * tol) << "dx at " << i;
  }
}

TEST(MaxPool2d, ForwardBackwardAgainstDirectLoops) {
  check_all<double>(true, false, 1);
  check_all<float>(true, false, 50);
}

TEST(AvgPool2d, ForwardBackwardAgainstDirectLoops) {
  check_all<double>(false, true, 100);
  check_all<double>(false, false, 150);
  check_all<float>(false, true, 200);
  check_all<float>(false, false, 250);
}

TEST(MaxPool2d, TiesGoToTheFirstMaximumAndPaddingIsMinusInfinity) {
  // Overlapping 2x2 windows (stride 1) over rows of 1, 1, 2: each window's gradient goes to
  // its first (row-major) tap holding the maximum.
  Tensor<double> x =
      lazy::from_vector<double>({1, 1, 1, 1, 1, 1, 2, 2, 2}, Shape{1, 1, 3, 3}).requires_grad_();
  Tensor<double> y = lazy::max_pool2d(x, 2, 1);
  EXPECT_EQ(y.to_vector(), (std::vector<double>{1, 1, 2, 2}));
  lazy::sum(y).backward();
  // Window (0,0) picks x[0][0], (0,1) x[0][1], (1,0) x[2][0], (1,1) x[2][1].
  EXPECT_EQ(x.grad().to_vector(), (std::vector<double>{1, 1, 0, 0, 0, 0, 1, 1, 0}));
  // A tie inside one window at its 2nd and 3rd taps: the 2nd wins.
  Tensor<double> t = lazy::from_vector<double>({0, 3, 3, 1}, Shape{1, 1, 2, 2}).requires_grad_();
  lazy::sum(lazy::max_pool2d(t, 2)).backward();
  EXPECT_EQ(t.grad().to_vector(), (std::vector<double>{0, 1, 0, 0}));
  // Negative values beat the padding.
  Tensor<float> neg = lazy::full<float>(Shape{1, 1, 2, 2}, -5);
  EXPECT_EQ(lazy::max_pool2d(neg, 3, 1, 1).to_vector(), (std::vector<float>(4, -5.0f)));
}

TEST(MaxPool2d, NaNPropagates) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  Tensor<double> x = lazy::from_vector<double>({1, nan, 3, 4, 5, 6, 7, 8}, Shape{1, 1, 2, 4});
  const auto y = lazy::max_pool2d(x, 2).to_vector();
  ASSERT_EQ(y.size(), 2u);
  EXPECT_TRUE(std::isnan(y[0]));
  EXPECT_EQ(y[1], 8);
}

TEST(Pool2d, ExpressionInputAndBfloat16) {
  const PoolCase k{2, 2, 5, 6, 2, 2, 1};
  const auto x = random_values<float>(k.in().numel(), 7);
  std::vector<float> twice(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) twice[i] = 2 * x[i];
  const auto ref = pool_reference(k, twice, std::vector<float>{}, true, false);
  Tensor<float> xt = lazy::from_vector<float>(x, k.in());
  EXPECT_EQ(lazy::max_pool2d(xt * 2, k.kernel, k.stride, k.padding).to_vector(),
            std::vector<float>(ref.y.begin(), ref.y.end()));
  // bfloat16 runs in float: the max is exact, the mean rounded once.
  std::vector<lazy::bfloat16> xb;
  std::vector<float> xr;
  for (float v : x) xb.push_back(lazy::bfloat16(v)), xr.push_back(static_cast<float>(xb.back()));
  Tensor<lazy::bfloat16> bt = lazy::from_vector<lazy::bfloat16>(xb, k.in());
  const auto rmax = pool_reference(k, xr, std::vector<float>{}, true, false);
  const auto rav = pool_reference(k, xr, std::vector<float>{}, false, true);
  const auto gmax = lazy::max_pool2d(bt, k.kernel, k.stride, k.padding).to_vector();
  const auto gav = lazy::avg_pool2d(bt, k.kernel, k.stride, k.padding).to_vector();
  for (std::size_t i = 0; i < gmax.size(); ++i) {
    EXPECT_EQ(static_cast<double>(static_cast<float>(gmax[i])), rmax.y[i]);
    EXPECT_NEAR(static_cast<float>(gav[i]), rav.y[i], std::fabs(rav.y[i]) / 256 + 1e-6);
  }
}

// Above the threading threshold, forward and backward of both pools give the same bits for
// every thread count (and match the reference).
TEST(Pool2d, ThreadCountDoesNotChangeBits) {
  auto& pool = lazy::graph::current_device().threads();
  const int saved = pool.size();
  const PoolCase k{4, 16, 66, 65, 3, 2, 1};
  const auto x = random_values<float>(k.in().numel(), 31);
  const auto gy = random_values<float>(k.n * k.c * k.oh() * k.ow(), 32);
  for (bool max : {true, false}) {
    SCOPED_TRACE(max ? "max" : "avg");
    const Reference ref = pool_reference(k, x, gy, max, true);
    std::vector<float> y1, dx1;
    for (int threads : {1, 2, 4}) {
      SCOPED_TRACE("threads " + std::to_string(threads));
      lazy::set_num_threads(threads);
      Tensor<float> xt = lazy::from_vector<float>(x, k.in()).requires_grad_();
      Tensor<float> y = run(k, xt, max, true);
      y.backward(lazy::from_vector<float>(gy, y.shape()));
      lazy::mark_step();
      const auto yv = y.to_vector(), dx = xt.grad().to_vector();
      if (threads == 1) {
        y1 = yv;
        dx1 = dx;
        for (std::size_t i = 0; i < yv.size(); ++i) ASSERT_NEAR(yv[i], ref.y[i], 2e-6) << i;
        for (std::size_t i = 0; i < dx.size(); ++i) ASSERT_NEAR(dx[i], ref.dx[i], 1e-5) << i;
      } else {
        EXPECT_EQ(yv, y1);
        EXPECT_EQ(dx, dx1);
      }
    }
  }
  lazy::set_num_threads(saved);
}

// ---- gradients --------------------------------------------------------------------------

using V = std::vector<Tensor<double>>;

/// Distinct values at least 0.01 apart (a shuffled ramp), so a finite-difference step never
/// changes which tap is a window's maximum.
gradcheck::Input distinct(Shape s, unsigned seed) {
  std::vector<double> v(static_cast<std::size_t>(s.numel()));
  std::iota(v.begin(), v.end(), 0.0);
  std::shuffle(v.begin(), v.end(), std::mt19937_64(seed));
  for (auto& x : v) x = x * 0.01 - 0.3;
  return {s, v};
}

TEST(Pool2dGrad, MaxPool) {
  gradcheck::check("2x2", [](const V& v) { return lazy::max_pool2d(v[0], 2); },
                   {distinct(Shape{2, 2, 4, 5}, 1)});
  gradcheck::check("3x3 stride 2 padding 1",
                   [](const V& v) { return lazy::max_pool2d(v[0], 3, 2, 1); },
                   {distinct(Shape{1, 3, 5, 6}, 2)});
  gradcheck::check("3x2 stride (1, 2)",
                   [](const V& v) {
                     return lazy::max_pool2d(v[0], {3, 2}, Size2{1, 2}, {1, 0});
                   },
                   {distinct(Shape{2, 1, 5, 5}, 3)});
}

TEST(Pool2dGrad, AvgPool) {
  using gradcheck::input;
  for (bool include_pad : {true, false}) {
    const std::string mode = include_pad ? " include_pad" : " exclude_pad";
    gradcheck::check(
        "2x2" + mode,
        [=](const V& v) { return lazy::avg_pool2d(v[0], 2, std::nullopt, 0, include_pad); },
        {input(Shape{2, 2, 4, 5}, 4)});
    gradcheck::check("3x3 stride 2 padding 1" + mode,
                     [=](const V& v) { return lazy::avg_pool2d(v[0], 3, 2, 1, include_pad); },
                     {input(Shape{1, 3, 5, 6}, 5)});
    gradcheck::check("3x2 stride (1, 2)" + mode,
                     [=](const V& v) {
                       return lazy::avg_pool2d(v[0], {3, 2}, Size2{1, 2}, {1, 1}, include_pad);
                     },
                     {input(Shape{2, 1, 5, 5}, 6)});
  }
}

// ---- errors -----------------------------------------------------------------------------

TEST(Pool2d, AKernelFarLargerThanTheInputCostsTheInputsSize) {
  // Padding at most half the kernel lets a 2^20 x 2^20 kernel pool a 4 x 4 image: one
  // window holding the whole image. Its 2^40 taps, visited one by one, took hours; only
  // the 16 inside the image are read now.
  const std::int64_t k = std::int64_t{1} << 20;
  std::vector<float> v(16);
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = static_cast<float>((i * 7) % 16) - 5.0f;
  const auto x = lazy::from_vector<float>(v, Shape{1, 1, 4, 4});
  const auto mx = lazy::max_pool2d(x, k, std::nullopt, k / 2);
  ASSERT_EQ(mx.shape(), (Shape{1, 1, 1, 1}));
  EXPECT_EQ(mx.to_vector()[0], *std::max_element(v.begin(), v.end()));
  double sum = 0;
  for (float f : v) sum += f;
  const auto avg =
      lazy::avg_pool2d(x, k, std::nullopt, k / 2);  // divides by k * k (padding counts)
  EXPECT_FLOAT_EQ(avg.to_vector()[0],
                  static_cast<float>(sum / (static_cast<double>(k) * static_cast<double>(k))));
  const auto inside = lazy::avg_pool2d(x, k, std::nullopt, k / 2, false);  // by the 16 taps inside
  EXPECT_FLOAT_EQ(inside.to_vector()[0], static_cast<float>(sum / 16));
}

TEST(Pool2d, ShapeErrors) {
  const auto x = lazy::zeros<float>(Shape{2, 3, 8, 8});
  for (bool max : {true, false}) {
    SCOPED_TRACE(max ? "max" : "avg");
    auto pool = [&](const Tensor<float>& t, Size2 k, std::optional<Size2> s, Size2 p) {
      return max ? lazy::max_pool2d(t, k, s, p) : lazy::avg_pool2d(t, k, s, p);
    };
    EXPECT_THROW(pool(lazy::zeros<float>(Shape{3, 8, 8}), 2, std::nullopt, 0),
                 lazy::ShapeError);  // rank 3
    EXPECT_THROW(pool(lazy::zeros<float>(Shape{2, 0, 8, 8}), 2, std::nullopt, 0),
                 lazy::ShapeError);                                     // no channels
    EXPECT_THROW(pool(x, 0, std::nullopt, 0), lazy::ShapeError);        // kernel 0
    EXPECT_THROW(pool(x, {2, -1}, std::nullopt, 0), lazy::ShapeError);  // negative kernel
    EXPECT_THROW(pool(x, 2, 0, 0), lazy::ShapeError);                   // stride 0
    EXPECT_THROW(pool(x, 2, Size2{1, -2}, 0), lazy::ShapeError);        // negative stride
    EXPECT_THROW(pool(x, 3, 1, 2), lazy::ShapeError);                   // padding > kernel / 2
    EXPECT_THROW(pool(x, {4, 2}, 1, {1, 2}), lazy::ShapeError);         // padding.w > kernel.w / 2
    EXPECT_THROW(pool(x, 2, 1, -1), lazy::ShapeError);                  // negative padding
    EXPECT_THROW(pool(x, 9, std::nullopt, 0), lazy::ShapeError);        // kernel > input
    EXPECT_NO_THROW(pool(x, 9, std::nullopt, 1));  // kernel fits the padded input
    EXPECT_NO_THROW(pool(x, {4, 2}, 1, {2, 1}));   // padding = kernel / 2
  }
  EXPECT_THROW(lazy::max_pool2d(lazy::zeros<int>(Shape{1, 1, 4, 4}), 2), lazy::DTypeError);
  // A kernel past 2^60 taps cannot be counted.
  EXPECT_THROW(lazy::max_pool2d(x, std::int64_t{1} << 40, std::nullopt, std::int64_t{1} << 39),
               lazy::ShapeError);
  // Empty batch: nothing to pool, no error.
  EXPECT_EQ(lazy::max_pool2d(lazy::zeros<float>(Shape{0, 3, 4, 4}), 2).shape(),
            (Shape{0, 3, 2, 2}));
}

}  // namespace
