// Writing by index (include/lazytensor/ops/scatter.hpp): scatter, scatter_add,
// scatter_reduce, index_add and index_fill against scalar loops over coordinates, every
// dtype; gradients against central differences and hand-derived shares.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include <lazytensor/ops/factories.hpp>
#include <lazytensor/ops/scatter.hpp>
#include <lazytensor/tensor.hpp>

#include "../autograd/gradcheck.hpp"
#include "testing/helpers.hpp"

namespace scatter_ref {

using lazy::Shape;
using lazy::Tensor;

/// Coordinates of flat position p in shape s (row-major).
inline std::vector<std::int64_t> unravel(std::int64_t p, const Shape& s) {
  std::vector<std::int64_t> c(static_cast<std::size_t>(s.rank()));
  for (int d = s.rank() - 1; d >= 0; --d) {
    c[static_cast<std::size_t>(d)] = p % s[d];
    p /= s[d];
  }
  return c;
}
inline std::int64_t ravel(const std::vector<std::int64_t>& c, const Shape& s) {
  std::int64_t p = 0;
  for (int d = 0; d < s.rank(); ++d) p = p * s[d] + c[static_cast<std::size_t>(d)];
  return p;
}

/// The definition, one index position at a time, in double (then cast), with the
/// reduction written out: the values each target receives are collected first.
template <class T>
std::vector<T> scatter(const std::vector<T>& self, const Shape& ss, int dim,
                       const std::vector<std::int64_t>& index, const Shape& is,
                       const std::vector<T>& src, const Shape& srcs, const std::string& reduce,
                       bool include_self) {
  std::vector<std::vector<double>> got(self.size());
  std::vector<T> out = self;
  for (std::int64_t p = 0; p < is.numel(); ++p) {
    auto c = unravel(p, is);
    const T v = src[static_cast<std::size_t>(ravel(c, srcs))];
    c[static_cast<std::size_t>(dim)] = index[static_cast<std::size_t>(p)];
    const auto at = static_cast<std::size_t>(ravel(c, ss));
    if (reduce == "assign")
      out[at] = v;
    else
      got[at].push_back(lazy_tests::num(v));
  }
  if (reduce == "assign") return out;
  for (std::size_t i = 0; i < out.size(); ++i) {
    if (got[i].empty()) continue;
    std::vector<double> vals = got[i];
    if (include_self) vals.insert(vals.begin(), lazy_tests::num(self[i]));
    double r = vals[0];
    if (reduce == "sum" || reduce == "mean") {
      r = 0;
      for (double v : vals) r += v;
      if (reduce == "mean") {
        r /= static_cast<double>(vals.size());
        if constexpr (std::is_integral_v<T>) r = std::floor(r);
      }
    } else if (reduce == "prod") {
      r = 1;
      for (double v : vals) r *= v;
    } else {
      for (double v : vals) {
        if (std::isnan(r)) break;
        if (std::isnan(v) || (reduce == "amax" ? v > r : v < r)) r = v;
      }
    }
    out[i] = static_cast<T>(r);
  }
  return out;
}

template <class T>
std::vector<T> values(std::int64_t n, unsigned seed) {
  if constexpr (std::is_same_v<T, bool>) {
    auto v = lazy_tests::random_values<double>(n, seed);
    std::vector<T> b(v.size());
    for (std::size_t i = 0; i < v.size(); ++i) b[i] = v[i] > 0;
    return b;
  } else if constexpr (std::is_integral_v<T>) {
    return lazy_tests::random_values<T>(n, seed, -9, 10);
  } else {
    // Small integers: sums and products are exact in every floating dtype, bfloat16 included.
    auto v = lazy_tests::random_values<double>(n, seed, -4, 5);
    std::vector<T> r(v.size());
    for (std::size_t i = 0; i < v.size(); ++i) r[i] = static_cast<T>(std::floor(v[i]));
    return r;
  }
}

/// Index values in [0, size) from a fixed seed, with duplicates.
inline std::vector<std::int64_t> indices(std::int64_t n, std::int64_t size, unsigned seed) {
  auto v = lazy_tests::random_values<double>(n, seed, 0, static_cast<double>(size));
  std::vector<std::int64_t> r(v.size());
  for (std::size_t i = 0; i < v.size(); ++i)
    r[i] = std::min<std::int64_t>(size - 1, static_cast<std::int64_t>(v[i]));
  return r;
}

template <class T>
void expect_same(const std::vector<T>& got, const std::vector<T>& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const double g = lazy_tests::num(got[i]), w = lazy_tests::num(want[i]);
    if (std::isnan(w)) {
      EXPECT_TRUE(std::isnan(g)) << what << " at " << i;
    } else {
      EXPECT_EQ(g, w) << what << " at " << i;
    }
  }
}

struct Case {
  Shape self, index, src;
  int dim;
};

inline const std::vector<Case>& cases() {
  static const std::vector<Case> c = {
      {Shape{5}, Shape{7}, Shape{7}, 0},
      {Shape{4, 6}, Shape{3, 6}, Shape{3, 6}, 0},
      {Shape{4, 6}, Shape{4, 9}, Shape{4, 9}, 1},
      {Shape{4, 6}, Shape{2, 3}, Shape{3, 5}, 1},  // src larger than index: its leading part
      {Shape{3, 4, 5}, Shape{3, 2, 5}, Shape{3, 2, 5}, 1},
      {Shape{3, 4, 5}, Shape{2, 4, 8}, Shape{2, 4, 8}, 2},
      {Shape{3, 4, 5}, Shape{6, 3, 5}, Shape{6, 3, 5}, 0},
      {Shape{300, 40}, Shape{300, 64}, Shape{300, 64}, 1},  // several tasks
  };
  return c;
}

template <class T>
class ScatterTyped : public ::testing::Test {};
using ScatterDTypes =
    ::testing::Types<float, double, std::int32_t, std::int64_t, bool, lazy::bfloat16>;
TYPED_TEST_SUITE(ScatterTyped, ScatterDTypes);

TYPED_TEST(ScatterTyped, EveryModeMatchesTheDefinition) {
  using T = TypeParam;
  lazy_tests::ThreadsGuard threads(2);
  unsigned seed = 1;
  for (const auto& c : scatter_ref::cases()) {
    const auto self = scatter_ref::values<T>(c.self.numel(), seed++);
    const auto src = scatter_ref::values<T>(c.src.numel(), seed++);
    const auto idx = scatter_ref::indices(c.index.numel(), c.self[c.dim], seed++);
    const auto ts = lazy::from_vector<T>(self, c.self), tx = lazy::from_vector<T>(src, c.src);
    const auto ti = lazy::from_vector<std::int64_t>(idx, c.index);
    const std::string where =
        "self " + c.self.str() + " index " + c.index.str() + " dim " + std::to_string(c.dim);
    scatter_ref::expect_same(
        lazy::scatter(ts, c.dim, ti, tx).to_vector(),
        scatter_ref::scatter(self, c.self, c.dim, idx, c.index, src, c.src, "assign", true),
        "scatter " + where);
    scatter_ref::expect_same(
        lazy::scatter_add(ts, c.dim, ti, tx).to_vector(),
        scatter_ref::scatter(self, c.self, c.dim, idx, c.index, src, c.src, "sum", true),
        "scatter_add " + where);
    for (const char* reduce : {"sum", "prod", "mean", "amax", "amin"}) {
      if (std::is_same_v<T, bool> && std::string(reduce) == "mean")
        continue;  // refused: see BadInput
      for (bool include_self : {true, false}) {
        scatter_ref::expect_same(
            lazy::scatter_reduce(ts, c.dim, ti, tx, reduce, include_self).to_vector(),
            scatter_ref::scatter(self, c.self, c.dim, idx, c.index, src, c.src, reduce,
                                 include_self),
            std::string(reduce) + (include_self ? "" : " without self ") + where);
      }
    }
  }
}

}  // namespace scatter_ref

TEST(Scatter, ANumberAndInt32IndicesAndExpressions) {
  const auto x = lazy::from_vector<float>({1, 2, 3, 4, 5, 6}, lazy::Shape{2, 3});
  const auto i = lazy::from_vector<std::int32_t>({2, 0}, lazy::Shape{2, 1});
  // Each row: its column index[r][0] set to 9.
  scatter_ref::expect_same(lazy::scatter(x, 1, i, 9.0f).to_vector(),
                           std::vector<float>{1, 2, 9, 9, 5, 6}, "value");
  // An expression as self and as src.
  const auto s = lazy::from_vector<float>({10, 20}, lazy::Shape{2, 1});
  scatter_ref::expect_same(lazy::scatter_add(x * 2, 1, i, s + 1).to_vector(),
                           std::vector<float>{2, 4, 17, 29, 10, 12}, "exprs");
}

TEST(Scatter, DuplicatesTheLastWriteWinsAndSumsAddUp) {
  const auto x = lazy::zeros<double>(lazy::Shape{3});
  const auto i = lazy::from_vector<std::int64_t>({1, 1, 1, 0});
  const auto s = lazy::from_vector<double>({1, 2, 3, 4});
  scatter_ref::expect_same(lazy::scatter(x, 0, i, s).to_vector(), std::vector<double>{4, 3, 0},
                           "assign");
  scatter_ref::expect_same(lazy::scatter_add(x, 0, i, s).to_vector(), std::vector<double>{4, 6, 0},
                           "add");
  scatter_ref::expect_same(lazy::scatter_reduce(x + 1, 0, i, s, "mean").to_vector(),
                           std::vector<double>{2.5, 7.0 / 4, 1}, "mean");
  scatter_ref::expect_same(lazy::scatter_reduce(x + 1, 0, i, s, "mean", false).to_vector(),
                           std::vector<double>{4, 2, 1}, "mean without self");
}

TEST(Scatter, IntegerSumsWrapAndMeansFloor) {
  const std::int64_t big = std::numeric_limits<std::int64_t>::max();
  const auto x = lazy::from_vector<std::int64_t>({big, -7});
  const auto i = lazy::from_vector<std::int64_t>({0, 1, 1});
  const auto s = lazy::from_vector<std::int64_t>({1, 0, 0});
  const auto r = lazy::scatter_add(x, 0, i, s).to_vector();
  EXPECT_EQ(r[0], std::numeric_limits<std::int64_t>::min());
  // (-7 + 0 + 0) / 3 = -2.33: floor gives -3 (torch's rounding for integer means).
  EXPECT_EQ(lazy::scatter_reduce(x, 0, i, s, "mean").to_vector()[1], -3);
}

TEST(Scatter, NaNWinsInAmaxAndAmin) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const auto x = lazy::from_vector<float>({0, 5});
  const auto i = lazy::from_vector<std::int64_t>({0, 0, 1});
  const auto s = lazy::from_vector<float>({nan, 3, 7});
  const auto mx = lazy::scatter_reduce(x, 0, i, s, "amax").to_vector();
  EXPECT_TRUE(std::isnan(mx[0]));
  EXPECT_EQ(mx[1], 7);
  EXPECT_TRUE(std::isnan(lazy::scatter_reduce(x, 0, i, s, "amin").to_vector()[0]));
}

TEST(Scatter, BadInputRaisesNamedErrors) {
  const auto x = lazy::zeros<float>(lazy::Shape{2, 3});
  const auto s = lazy::ones<float>(lazy::Shape{2, 3});
  EXPECT_THROW(lazy::scatter(x, 1, lazy::zeros<std::int64_t>(lazy::Shape{2}), s),
               lazy::ShapeError);  // rank
  EXPECT_THROW(lazy::scatter(x, 1, lazy::zeros<std::int64_t>(lazy::Shape{3, 1}), s),
               lazy::ShapeError);  // > self
  EXPECT_THROW(lazy::scatter(x, 1, lazy::zeros<std::int64_t>(lazy::Shape{2, 4}), s),
               lazy::ShapeError);  // > src
  EXPECT_THROW(lazy::scatter(x, 2, lazy::zeros<std::int64_t>(lazy::Shape{2, 3}), s),
               lazy::Error);  // dim
  EXPECT_THROW(lazy::scatter_reduce(x, 1, lazy::zeros<std::int64_t>(lazy::Shape{2, 3}), s, "max"),
               lazy::Error);
  EXPECT_THROW(lazy::scatter_reduce(lazy::zeros<bool>(lazy::Shape{2}), 0,
                                    lazy::zeros<std::int64_t>(lazy::Shape{2}),
                                    lazy::zeros<bool>(lazy::Shape{2}), "mean"),
               lazy::DTypeError);
  // Out-of-range values are found by the kernel, at the read.
  auto r = lazy::scatter(x, 1, lazy::full<std::int64_t>(lazy::Shape{2, 3}, 3), s);
  EXPECT_THROW(r.to_vector(), lazy::IndexError);
  auto q = lazy::scatter_add(x, 0, lazy::full<std::int64_t>(lazy::Shape{1, 1}, -1), s);
  EXPECT_THROW(q.to_vector(), lazy::IndexError);
  EXPECT_THROW(lazy::index_add(x, 0, lazy::zeros<std::int64_t>(lazy::Shape{3}), s),
               lazy::ShapeError);
  EXPECT_THROW(lazy::index_add(x, 0, lazy::zeros<std::int64_t>(lazy::Shape{1, 1}), s),
               lazy::ShapeError);
  // An empty index leaves self as it is.
  scatter_ref::expect_same(
      lazy::scatter(x + 1, 0, lazy::zeros<std::int64_t>(lazy::Shape{0}), s).to_vector(),
      std::vector<float>(6, 1.0f), "empty index");
}

TEST(Scatter, GradientsMatchFiniteDifferences) {
  using gradcheck::input;
  const auto idx0 =
      lazy::from_vector<std::int64_t>({2, 0, 2, 1, 0, 2}, lazy::Shape{2, 3});  // dim 0 into 3 rows
  const auto idx1 =
      lazy::from_vector<std::int64_t>({1, 1, 3, 0, 2, 2}, lazy::Shape{2, 3});  // dim 1 into 4 cols
  gradcheck::check("scatter", [&](const auto& v) { return lazy::scatter(v[0], 1, idx1, v[1]); },
                   {input(lazy::Shape{2, 4}, 1), input(lazy::Shape{2, 3}, 2)});
  gradcheck::check("scatter, src larger than index",
                   [&](const auto& v) { return lazy::scatter(v[0], 1, idx1, v[1]); },
                   {input(lazy::Shape{2, 4}, 1), input(lazy::Shape{3, 5}, 2)});
  gradcheck::check("scatter value",
                   [&](const auto& v) { return lazy::scatter(v[0] * v[0], 0, idx0, 2.0); },
                   {input(lazy::Shape{3, 3}, 3)});
  gradcheck::check("scatter_add",
                   [&](const auto& v) { return lazy::scatter_add(v[0], 0, idx0, v[1]); },
                   {input(lazy::Shape{3, 3}, 4), input(lazy::Shape{2, 3}, 5)});
  for (bool include_self : {true, false}) {
    for (const char* reduce : {"sum", "mean", "prod", "amax", "amin"}) {
      // Distinct values (no ties): amax/amin are smooth there.
      gradcheck::check(std::string(reduce) + (include_self ? "" : " without self"),
                       [&](const auto& v) {
                         return lazy::scatter_reduce(v[0], 1, idx1, v[1], reduce, include_self);
                       },
                       {input(lazy::Shape{2, 4}, 6, 0.5, 2), input(lazy::Shape{2, 3}, 7, 0.5, 2)});
    }
  }
  gradcheck::check(
      "index_add",
      [&](const auto& v) {
        return lazy::index_add(v[0], 1, lazy::tensor<std::int64_t>({2, 0, 2}), v[1], 3);
      },
      {input(lazy::Shape{2, 4}, 8), input(lazy::Shape{2, 3}, 9)});
  gradcheck::check(
      "index_fill",
      [&](const auto& v) { return lazy::index_fill(v[0], 0, lazy::tensor<std::int64_t>({1}), -1); },
      {input(lazy::Shape{3, 2}, 10)});
}

TEST(Scatter, ProductGradientsWithZerosAreTheOtherFactors) {
  // Target 0 gets self 0 (a zero) and src 2, 3; target 1 gets self 5 and src 0, 0, 4;
  // target 2 gets self 7 and src 0. d(prod)/d(factor) = product of the other factors.
  const auto self = lazy::from_vector<double>({0, 5, 7}).requires_grad_();
  const auto src = lazy::from_vector<double>({2, 0, 3, 0, 4, 0}).requires_grad_();
  const auto idx = lazy::from_vector<std::int64_t>({0, 1, 0, 1, 1, 2});
  lazy::sum(lazy::scatter_reduce(self, 0, idx, src, "prod") * lazy::tensor<double>({1, 10, 100}))
      .backward();
  scatter_ref::expect_same(self.grad().to_vector(), std::vector<double>{6, 0, 0}, "self");
  // src: 2 -> 0*3; 0 -> 10*(5*0*4) = 0; 3 -> 0*2; 0 -> 0; 4 -> 0; the lone zero -> 100*7.
  scatter_ref::expect_same(src.grad().to_vector(), std::vector<double>{0, 0, 0, 0, 0, 700}, "src");
  // Finite differences agree where zeros sit (the product is a polynomial).
  gradcheck::check("prod with zeros",
                   [&](const auto& v) { return lazy::scatter_reduce(v[0], 0, idx, v[1], "prod"); },
                   {{lazy::Shape{3}, {0, 5, 7}}, {lazy::Shape{6}, {2, 0, 3, 0, 4, 0}}});
}

TEST(Scatter, AmaxGradientIsSharedBetweenTies) {
  const auto self = lazy::from_vector<double>({3, 1}).requires_grad_();
  const auto src = lazy::from_vector<double>({3, 2, 3, 0}).requires_grad_();
  const auto idx = lazy::from_vector<std::int64_t>({0, 0, 0, 1});
  lazy::sum(lazy::scatter_reduce(self, 0, idx, src, "amax") * lazy::tensor<double>({6, 1}))
      .backward();
  // Target 0: self 3 and src 3, 3 tie for the max: 6 shared three ways. Target 1: self 1 wins.
  scatter_ref::expect_same(self.grad().to_vector(), std::vector<double>{2, 1}, "self");
  scatter_ref::expect_same(src.grad().to_vector(), std::vector<double>{2, 0, 2, 0}, "src");
}

TEST(IndexAdd, MatchesTheDefinitionWithAlphaAndDuplicates) {
  const auto x = lazy::from_vector<std::int32_t>({1, 2, 3, 4, 5, 6}, lazy::Shape{3, 2});
  const auto s = lazy::from_vector<std::int32_t>({1, 1, 10, 10, 100, 100, 7, 7}, lazy::Shape{4, 2});
  const auto i = lazy::from_vector<std::int64_t>({2, 0, 2, 1});
  // Row 0 += 2*10, row 1 += 2*7, row 2 += 2*(1 + 100).
  scatter_ref::expect_same(lazy::index_add(x, 0, i, s, 2).to_vector(),
                           std::vector<std::int32_t>{21, 22, 17, 18, 207, 208}, "rows");
  const auto y = lazy::zeros<float>(lazy::Shape{2, 3});
  scatter_ref::expect_same(
      lazy::index_add(y, 1, lazy::tensor<std::int64_t>({2}), lazy::ones<float>(lazy::Shape{2, 1}))
          .to_vector(),
      std::vector<float>{0, 0, 1, 0, 0, 1}, "columns");
}

TEST(IndexFill, FillsTheNamedSlices) {
  const auto x = lazy::from_vector<std::int64_t>({1, 2, 3, 4, 5, 6}, lazy::Shape{2, 3});
  scatter_ref::expect_same(
      lazy::index_fill(x, 1, lazy::tensor<std::int64_t>({0, 2, 0}), -1).to_vector(),
      std::vector<std::int64_t>{-1, 2, -1, -1, 5, -1}, "columns");
  scatter_ref::expect_same(lazy::index_fill(x, 0, lazy::tensor<std::int32_t>({1}), 0).to_vector(),
                           std::vector<std::int64_t>{1, 2, 3, 0, 0, 0}, "rows");
}

TEST(Scatter, SrcOrIndexThatIsSelfIsReadBeforeItIsWritten) {
  // scatter(y, 0, i, y) with y's node held by nothing else: the output must not take y's
  // buffer, which the same kernel reads as src (this crashed).
  lazy::Tensor<float> y = lazy::from_vector<float>({1, 2, 3}) * 1.0f;
  y.to_vector();
  y = lazy::scatter(y, 0, lazy::tensor<std::int64_t>({1, 2, 0}), y);
  scatter_ref::expect_same(y.to_vector(), std::vector<float>{3, 1, 2}, "src is self");
  lazy::Tensor<std::int64_t> x = lazy::tensor<std::int64_t>({2, 0, 1}) * 1;
  x.to_vector();
  x = lazy::scatter_add(x, 0, x, lazy::tensor<std::int64_t>({10, 20, 30}));
  scatter_ref::expect_same(x.to_vector(), std::vector<std::int64_t>{22, 30, 11}, "index is self");
}

TEST(IndexAdd, AddsInOrderAndLeavesTheRestAlone) {
  // (1e8 + 4) + 4 rounds to 1e8 twice; 1e8 + (4 + 4) would be 100000008.
  const auto big = lazy::index_add(lazy::from_vector<float>({1e8f, -0.0f}), 0, lazy::tensor<std::int64_t>({0, 0}),
                                   lazy::from_vector<float>({4, 4}));
  const auto b = big.to_vector();
  EXPECT_EQ(b[0], 1e8f);
  EXPECT_TRUE(std::signbit(b[1])) << "an element no index names keeps its -0";
  const auto inf = lazy::index_add(lazy::from_vector<float>({1, 2}), 0, lazy::tensor<std::int64_t>({1}),
                                   lazy::from_vector<float>({1}), std::numeric_limits<float>::infinity());
  const auto f = inf.to_vector();
  EXPECT_EQ(f[0], 1.0f) << "alpha = inf leaves untouched elements finite";
  EXPECT_TRUE(std::isinf(f[1]));
  EXPECT_THROW(lazy::index_add(lazy::full<float>(lazy::Shape{}, 1), 0, lazy::tensor<std::int64_t>({0, 0}),
                               lazy::full<float>(lazy::Shape{}, 10)),
               lazy::ShapeError);
  EXPECT_THROW(lazy::index_add(lazy::zeros<std::int32_t>(lazy::Shape{2}), 0, lazy::tensor<std::int64_t>({0}),
                               lazy::ones<std::int32_t>(lazy::Shape{1}), 0.5),
               lazy::DTypeError);
  scatter_ref::expect_same(lazy::index_add(lazy::full<float>(lazy::Shape{}, 1), 0, lazy::tensor<std::int64_t>({0}),
                                           lazy::full<float>(lazy::Shape{}, 10), 2)
                               .to_vector(),
                           std::vector<float>{21}, "0-dim");
}

TEST(IndexFill, KeepsIntegersWrapsNegativeIndicesAndTakesZeroDim) {
  const auto x = lazy::from_vector<std::int64_t>({16777217, 5});
  // The value is converted to int64 first (torch: 2); 16777217 does not pass through float.
  scatter_ref::expect_same(lazy::index_fill(x, 0, lazy::tensor<std::int64_t>({1}), 2.5).to_vector(),
                           std::vector<std::int64_t>{16777217, 2}, "integer self");
  scatter_ref::expect_same(
      lazy::index_fill(lazy::tensor<float>({1, 2, 3}), 0, lazy::tensor<std::int64_t>({-1}), 0).to_vector(),
      std::vector<float>{1, 2, 0}, "negative index");
  scatter_ref::expect_same(
      lazy::index_fill(lazy::full<float>(lazy::Shape{}, 1), 0, lazy::tensor<std::int64_t>({0, 0}), 7).to_vector(),
      std::vector<float>{7}, "0-dim");
  auto bad = lazy::index_fill(lazy::tensor<float>({1, 2, 3}), 0, lazy::tensor<std::int64_t>({-4}), 0);
  try {
    bad.to_vector();
    ADD_FAILURE() << "expected IndexError";
  } catch (const lazy::IndexError& e) {
    EXPECT_NE(std::string(e.what()).find("index_fill"), std::string::npos) << e.what();
  }
}
