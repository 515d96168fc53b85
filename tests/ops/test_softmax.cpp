// Tests of ops/softmax.hpp: softmax and log_softmax against a long double reference.

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include <lazytensor/tensor.hpp>
#include <lazytensor/ops/factories.hpp>
#include <lazytensor/ops/softmax.hpp>

#include "testing/helpers.hpp"

namespace {

using lazy_tests::random_values;

using lazy::Shape;
using lazy::Tensor;

/// Reference softmax / log_softmax of `x` (shape s) along dim d, in long double.
template <class T>
std::vector<long double> reference(const std::vector<T>& x, const Shape& s, int d, bool log) {
  std::int64_t outer = 1, inner = 1;
  const std::int64_t extent = s.rank() ? s[d] : 1;
  for (int i = 0; i < s.rank(); ++i) {
    if (i < d) outer *= s[i];
    if (i > d) inner *= s[i];
  }
  std::vector<long double> y(x.size());
  for (std::int64_t o = 0; o < outer; ++o) {
    for (std::int64_t c = 0; c < inner; ++c) {
      auto at = [&](std::int64_t r) { return (o * extent + r) * inner + c; };
      long double m = -INFINITY;
      for (std::int64_t r = 0; r < extent; ++r) m = std::max<long double>(m, x[at(r)]);
      long double sum = 0;
      for (std::int64_t r = 0; r < extent; ++r) sum += std::exp(static_cast<long double>(x[at(r)]) - m);
      for (std::int64_t r = 0; r < extent; ++r) {
        const long double z = static_cast<long double>(x[at(r)]) - m;
        y[at(r)] = log ? z - std::log(sum) : std::exp(z) / sum;
      }
    }
  }
  return y;
}

template <class T>
void check_against_reference(const std::vector<T>& x, const Shape& s, std::int64_t dim) {
  const int d = static_cast<int>(dim < 0 ? dim + std::max(s.rank(), 1) : dim);
  SCOPED_TRACE("shape " + s.str() + " dim " + std::to_string(dim));
  Tensor<T> t = lazy::from_vector(x, s);
  Tensor<T> sm = lazy::softmax(t, dim);
  Tensor<T> lsm = lazy::log_softmax(t, dim);
  EXPECT_EQ(sm.shape(), s);
  EXPECT_EQ(lsm.shape(), s);
  lazy::mark_step();
  const auto ys = sm.to_vector();
  const auto yl = lsm.to_vector();
  const auto rs = reference(x, s, d, false);
  const auto rl = reference(x, s, d, true);
  const double eps = std::numeric_limits<T>::epsilon();
  const std::int64_t extent = s.rank() ? s[d] : 1;
  for (std::size_t i = 0; i < x.size(); ++i) {
    const double r_s = static_cast<double>(rs[i]), r_l = static_cast<double>(rl[i]);
    const double tol_s = eps * r_s * (16 + 2 * std::sqrt(static_cast<double>(extent))) + std::numeric_limits<T>::min();
    ASSERT_NEAR(ys[i], r_s, tol_s) << "softmax @" << i;
    const double tol_l = 16 * eps * (1 + std::fabs(r_l) + std::log(static_cast<double>(extent)));
    ASSERT_NEAR(yl[i], r_l, tol_l) << "log_softmax @" << i;
  }
}

template <class T>
class SoftmaxTyped : public ::testing::Test {};
using SoftmaxTypes = ::testing::Types<float, double>;
TYPED_TEST_SUITE(SoftmaxTyped, SoftmaxTypes);

TYPED_TEST(SoftmaxTyped, EveryDimAgainstReference) {
  using T = TypeParam;
  const std::vector<Shape> shapes = {Shape{1},       Shape{7},         Shape{129},         Shape{1000},
                                     Shape{7, 129},  Shape{129, 7},    Shape{1, 1000},     Shape{1000, 1},
                                     Shape{3, 7, 129}, Shape{5, 1, 7}, Shape{2, 1000, 3},  Shape{4, 3, 1},
                                     Shape{64, 1000}, Shape{1000, 64}};
  unsigned seed = 1;
  for (const Shape& s : shapes) {
    const auto x = random_values<T>(s.numel(), seed++, -6, 6);
    for (int d = 0; d < s.rank(); ++d) {
      check_against_reference(x, s, d);
      check_against_reference(x, s, d - s.rank());  // the same dim, counted from the back
    }
  }
}

TYPED_TEST(SoftmaxTyped, RowsSumToOneAndLogMatches) {
  using T = TypeParam;
  const double eps = std::numeric_limits<T>::epsilon();
  for (std::int64_t len : {1, 2, 3, 7, 8, 15, 16, 17, 129, 1000}) {
    SCOPED_TRACE(len);
    const std::int64_t rows = 5;
    Tensor<T> x = lazy::from_vector(random_values<T>(rows * len, 100 + static_cast<unsigned>(len), -10, 10),
                                    Shape{rows, len});
    for (std::int64_t dim : {1, 0}) {
      Tensor<T> s = lazy::softmax(x, dim);
      Tensor<T> l = lazy::log_softmax(x, dim);
      auto vs = s.to_vector();
      auto vl = l.to_vector();
      const std::int64_t outer = dim == 1 ? rows : 1, extent = dim == 1 ? len : rows, inner = dim == 1 ? 1 : len;
      for (std::int64_t o = 0; o < outer; ++o)
        for (std::int64_t c = 0; c < inner; ++c) {
          long double total = 0;
          for (std::int64_t r = 0; r < extent; ++r) {
            const std::int64_t i = (o * extent + r) * inner + c;
            EXPECT_GE(vs[i], T(0));
            EXPECT_LE(vs[i], T(1));
            total += vs[i];
            // log_softmax == log(softmax) (where softmax is not tiny).
            if (vs[i] > T(1e-6)) {
              EXPECT_NEAR(vl[i], std::log(static_cast<double>(vs[i])), 32 * eps * (1 + std::fabs(double(vl[i]))));
            }
          }
          EXPECT_NEAR(static_cast<double>(total), 1.0, 4 * eps * static_cast<double>(extent) + 4 * eps);
        }
    }
  }
}

TYPED_TEST(SoftmaxTyped, LargeMagnitudeDoesNotOverflow) {
  using T = TypeParam;
  for (double mag : {1e4, -1e4, 3e4}) {
    SCOPED_TRACE(mag);
    // Rows [mag, mag + 1, mag + 2, ...]: softmax depends only on the differences.
    for (std::int64_t len : {1, 7, 129}) {
      std::vector<T> v(static_cast<std::size_t>(len));
      for (std::int64_t i = 0; i < len; ++i) v[i] = static_cast<T>(mag + static_cast<double>(i % 5));
      const Shape s{len};
      check_against_reference(v, s, 0);
      Tensor<T> sm = lazy::softmax(lazy::from_vector(v), 0);
      for (T y : sm.to_vector()) EXPECT_TRUE(std::isfinite(y));
    }
    // Columns too (strided path).
    std::vector<T> v(3 * 4);
    for (std::size_t i = 0; i < v.size(); ++i) v[i] = static_cast<T>(mag - static_cast<double>(i));
    check_against_reference(v, Shape{3, 4}, 0);
  }
  // Mixed huge values: one dominates.
  Tensor<T> x = lazy::tensor<T>({T(1e4), T(-1e4), T(0)});
  auto s = lazy::softmax(x, 0).to_vector();
  EXPECT_EQ(s[0], T(1));
  EXPECT_EQ(s[1], T(0));
  EXPECT_EQ(s[2], T(0));
  auto l = lazy::log_softmax(x, 0).to_vector();
  EXPECT_NEAR(l[0], 0, 1e-6);
  EXPECT_NEAR(l[1], -2e4, 2e4 * 1e-6);
  EXPECT_NEAR(l[2], -1e4, 1e4 * 1e-6);
}

TYPED_TEST(SoftmaxTyped, NegativeInfinityEntries) {
  using T = TypeParam;
  const T ninf = -std::numeric_limits<T>::infinity();
  for (std::int64_t len : {2, 7, 17, 129}) {
    std::vector<T> v(static_cast<std::size_t>(len));
    for (std::int64_t i = 0; i < len; ++i) v[i] = (i % 3 == 1) ? ninf : static_cast<T>(0.25 * double(i));
    // Row path (last dim) and strided path (first dim of a column).
    for (bool column : {false, true}) {
      SCOPED_TRACE(std::to_string(len) + (column ? " column" : " row"));
      const Shape s = column ? Shape{len, 1} : Shape{len};
      Tensor<T> x = lazy::from_vector(v, s);
      auto sm = lazy::softmax(x, 0).to_vector();
      auto lsm = lazy::log_softmax(x, 0).to_vector();
      const auto rs = reference(v, s, 0, false);
      for (std::int64_t i = 0; i < len; ++i) {
        if (i % 3 == 1) {
          EXPECT_EQ(sm[i], T(0)) << i;
          EXPECT_EQ(lsm[i], ninf) << i;
        } else {
          EXPECT_NEAR(sm[i], static_cast<double>(rs[i]), 64 * std::numeric_limits<T>::epsilon()) << i;
          EXPECT_TRUE(std::isfinite(lsm[i])) << i;
        }
      }
    }
  }
  // An all -inf row is NaN (0/0), as in torch; other rows are unaffected.
  Tensor<T> x = lazy::tensor<T>({{ninf, ninf, ninf}, {T(0), T(0), T(0)}});
  auto sm = lazy::softmax(x, 1).to_vector();
  auto lsm = lazy::log_softmax(x, 1).to_vector();
  for (int i = 0; i < 3; ++i) {
    EXPECT_TRUE(std::isnan(sm[i])) << i;
    EXPECT_TRUE(std::isnan(lsm[i])) << i;
    EXPECT_NEAR(sm[3 + i], 1.0 / 3, 4 * std::numeric_limits<T>::epsilon());
    EXPECT_NEAR(lsm[3 + i], -std::log(3.0), 8 * std::numeric_limits<T>::epsilon());
  }
}

TYPED_TEST(SoftmaxTyped, NaNPropagatesWithinItsRowOnly) {
  using T = TypeParam;
  const T nan = std::numeric_limits<T>::quiet_NaN();
  for (std::int64_t len : {3, 20}) {
    std::vector<T> v(static_cast<std::size_t>(2 * len), T(1));
    v[1] = nan;
    Tensor<T> x = lazy::from_vector(v, Shape{2, len});
    auto sm = lazy::softmax(x, 1).to_vector();
    for (std::int64_t i = 0; i < len; ++i) EXPECT_TRUE(std::isnan(sm[i])) << i;
    for (std::int64_t i = len; i < 2 * len; ++i) EXPECT_NEAR(sm[i], 1.0 / double(len), 1e-6) << i;
  }
}

TEST(Softmax, ZeroDimAndEmpty) {
  Tensor<float> s = lazy::scalar_tensor(3.5f);
  Tensor<float> y = lazy::softmax(s, 0);
  EXPECT_EQ(y.dim(), 0);
  EXPECT_EQ(y.item(), 1.f);
  EXPECT_EQ(lazy::log_softmax(s, -1).item(), 0.f);
  Tensor<double> e = lazy::zeros<double>({0, 5});
  EXPECT_EQ(lazy::softmax(e, 1).shape(), (Shape{0, 5}));
  EXPECT_EQ(lazy::softmax(e, 0).shape(), (Shape{0, 5}));
  EXPECT_EQ(lazy::log_softmax(e, 0).to_vector().size(), 0u);
  EXPECT_EQ(lazy::softmax(e, 1).to_vector().size(), 0u);
}

TEST(Softmax, BadDim) {
  Tensor<float> x = lazy::ones<float>({2, 3});
  EXPECT_THROW(lazy::softmax(x, 2), lazy::ShapeError);
  EXPECT_THROW(lazy::softmax(x, -3), lazy::ShapeError);
  EXPECT_THROW(lazy::log_softmax(x, 5), lazy::ShapeError);
  EXPECT_THROW(lazy::log_softmax(lazy::ones<double>({4}), 1), lazy::ShapeError);
  EXPECT_THROW(lazy::softmax(lazy::scalar_tensor(1.f), 1), lazy::ShapeError);
  try {
    lazy::softmax(x, 7);
    FAIL();
  } catch (const lazy::ShapeError& e) {
    EXPECT_NE(std::string(e.what()).find('7'), std::string::npos) << e.what();
  }
}

TEST(Softmax, ExpressionAndIntegerInputs) {
  std::vector<float> v = random_values<float>(3 * 9, 77, -2, 2);
  Tensor<float> x = lazy::from_vector(v, Shape{3, 9});
  // An element-wise expression operand.
  Tensor<float> y = lazy::softmax(x * 2.0f + 1.0f, 1);
  std::vector<float> v2(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) v2[i] = v[i] * 2.0f + 1.0f;
  const auto r = reference(v2, Shape{3, 9}, 1, false);
  auto got = y.to_vector();
  for (std::size_t i = 0; i < v.size(); ++i) EXPECT_NEAR(got[i], static_cast<double>(r[i]), 1e-6) << i;
  // Integer input computes in float.
  Tensor<std::int32_t> xi = lazy::tensor<std::int32_t>({{0, 1, 2}, {5, 5, 5}});
  auto yi = lazy::softmax(xi, 1);
  static_assert(std::is_same_v<decltype(yi), Tensor<float>>);
  const auto ri = reference(std::vector<double>{0, 1, 2, 5, 5, 5}, Shape{2, 3}, 1, false);
  auto gi = yi.to_vector();
  for (int i = 0; i < 6; ++i) EXPECT_NEAR(gi[i], static_cast<double>(ri[i]), 1e-6) << i;
  // bfloat16 input gives bfloat16.
  Tensor<lazy::bfloat16> xb = lazy::from_vector(std::vector<lazy::bfloat16>{0.f, 1.f, 2.f, 3.f});
  auto yb = lazy::log_softmax(xb, 0);
  static_assert(std::is_same_v<decltype(yb), Tensor<lazy::bfloat16>>);
  const auto rb = reference(std::vector<double>{0, 1, 2, 3}, Shape{4}, 0, true);
  auto gb = yb.to_vector();
  for (int i = 0; i < 4; ++i) EXPECT_NEAR(float(gb[i]), static_cast<double>(rb[i]), 2e-2) << i;
}

TEST(Softmax, DonatedInputAndThreads) {
  // The input is a pending temporary only the softmax reads: its buffer may be reused.
  auto& pool = lazy::graph::current_device().threads();
  const int saved = pool.size();
  const std::vector<float> v = random_values<float>(300 * 257, 5, -4, 4);
  std::vector<float> doubled(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) doubled[i] = v[i] * 2.0f;
  const auto r_row = reference(doubled, Shape{300, 257}, 1, false);
  const auto r_col = reference(doubled, Shape{300, 257}, 0, true);
  std::vector<float> first_row, first_col;
  for (int threads : {1, 2, 4}) {
    SCOPED_TRACE(threads);
    lazy::set_num_threads(threads);
    Tensor<float> x = lazy::from_vector(v, Shape{300, 257});
    Tensor<float> y_row = lazy::softmax(Tensor<float>(x * 2.0f), 1);
    Tensor<float> y_col = lazy::log_softmax(Tensor<float>(x * 2.0f), 0);
    lazy::mark_step();
    auto a = y_row.to_vector();
    auto b = y_col.to_vector();
    for (std::size_t i = 0; i < v.size(); ++i) {
      ASSERT_NEAR(a[i], static_cast<double>(r_row[i]), 1e-6 * (1 + 10 * static_cast<double>(r_row[i]))) << i;
      ASSERT_NEAR(b[i], static_cast<double>(r_col[i]), 2e-5 * (1 + std::fabs(static_cast<double>(r_col[i])))) << i;
    }
    if (first_row.empty()) {
      first_row = a;
      first_col = b;
    } else {
      EXPECT_EQ(a, first_row);  // per-row work: thread count does not change results
      EXPECT_EQ(b, first_col);
    }
  }
  lazy::set_num_threads(saved);
}

}  // namespace
