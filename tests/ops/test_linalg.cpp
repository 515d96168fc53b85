// torch's linear-algebra vocabulary around matmul (include/lazytensor/ops/linalg.hpp): mm,
// mv, dot, outer, addmm, diagonal, diag, trace against loops over indices; gradients
// against central differences.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include <lazytensor/ops/factories.hpp>
#include <lazytensor/ops/linalg.hpp>
#include <lazytensor/tensor.hpp>

#include "../autograd/gradcheck.hpp"
#include "testing/helpers.hpp"

namespace linalg_ref {

/// Small integers in double: every product and sum below is exact.
inline std::vector<double> ints(std::int64_t n, unsigned seed) {
  auto v = lazy_tests::random_values<double>(n, seed, -5, 6);
  for (auto& x : v) x = std::floor(x);
  return v;
}

/// x[i][j] of a row-major [rows, cols] matrix.
inline double at(const std::vector<double>& x, std::int64_t cols, std::int64_t i, std::int64_t j) {
  return x[static_cast<std::size_t>(i * cols + j)];
}

}  // namespace linalg_ref

TEST(Linalg, ProductsMatchLoops) {
  using linalg_ref::at;
  const std::int64_t n = 5, k = 7, m = 3;
  const auto va = linalg_ref::ints(n * k, 1), vb = linalg_ref::ints(k * m, 2), vv = linalg_ref::ints(k, 3),
             vw = linalg_ref::ints(k, 4), vc = linalg_ref::ints(m, 5);
  const auto a = lazy::from_vector<double>(va, lazy::Shape{n, k}), b = lazy::from_vector<double>(vb, lazy::Shape{k, m});
  const auto v = lazy::from_vector<double>(vv), w = lazy::from_vector<double>(vw), c = lazy::from_vector<double>(vc);
  const auto mmv = lazy::mm(a, b).to_vector(), mvv = lazy::mv(a, v).to_vector();
  const auto addv = lazy::addmm(c, a, b, 0.5, -2).to_vector();
  for (std::int64_t i = 0; i < n; ++i) {
    double s = 0;
    for (std::int64_t p = 0; p < k; ++p) s += at(va, k, i, p) * vv[static_cast<std::size_t>(p)];
    EXPECT_EQ(mvv[static_cast<std::size_t>(i)], s);
    for (std::int64_t j = 0; j < m; ++j) {
      double t = 0;
      for (std::int64_t p = 0; p < k; ++p) t += at(va, k, i, p) * at(vb, m, p, j);
      EXPECT_EQ(at(mmv, m, i, j), t) << i << "," << j;
      EXPECT_EQ(at(addv, m, i, j), 0.5 * vc[static_cast<std::size_t>(j)] - 2 * t) << i << "," << j;
    }
  }
  double d = 0;
  for (std::int64_t p = 0; p < k; ++p) d += vv[static_cast<std::size_t>(p)] * vw[static_cast<std::size_t>(p)];
  const auto dt = lazy::dot(v, w);
  EXPECT_EQ(dt.dim(), 0);
  EXPECT_EQ(dt.item(), d);
  const auto o = lazy::outer(v, c).to_vector();
  ASSERT_EQ(o.size(), static_cast<std::size_t>(k * m));
  for (std::int64_t i = 0; i < k; ++i) {
    for (std::int64_t j = 0; j < m; ++j) EXPECT_EQ(at(o, m, i, j), vv[i] * vc[j]);
  }
  // beta == 0 ignores input, NaN included (torch's rule).
  const auto nan_in = lazy::full<double>(lazy::Shape{n, m}, std::numeric_limits<double>::quiet_NaN());
  const auto z = lazy::addmm(nan_in, a, b, 0.0).to_vector();
  EXPECT_EQ(z, mmv);
}

TEST(Linalg, DiagonalEveryOffsetAndDimPair) {
  const lazy::Shape s{3, 4, 5};
  const auto vx = linalg_ref::ints(s.numel(), 6);
  const auto x = lazy::from_vector<double>(vx, s);
  for (int d1 = 0; d1 < 3; ++d1) {
    for (int d2 = 0; d2 < 3; ++d2) {
      if (d1 == d2) continue;
      const int other = 3 - d1 - d2;
      for (std::int64_t off = -6; off <= 6; ++off) {
        const auto r = lazy::diagonal(x, off, d1, d2);
        // Reference: r[o][i] = x with coordinate d1 = i + max(-off, 0), d2 = i + max(off, 0).
        std::int64_t len = 0;
        while (true) {
          const std::int64_t r1 = len + std::max<std::int64_t>(-off, 0), r2 = len + std::max<std::int64_t>(off, 0);
          if (r1 >= s[d1] || r2 >= s[d2]) break;
          ++len;
        }
        ASSERT_EQ(r.shape(), (lazy::Shape{s[other], len})) << d1 << d2 << off;
        const auto got = r.to_vector();
        for (std::int64_t o = 0; o < s[other]; ++o) {
          for (std::int64_t i = 0; i < len; ++i) {
            std::int64_t c[3];
            c[other] = o;
            c[d1] = i + std::max<std::int64_t>(-off, 0);
            c[d2] = i + std::max<std::int64_t>(off, 0);
            EXPECT_EQ(got[static_cast<std::size_t>(o * len + i)], vx[static_cast<std::size_t>((c[0] * 4 + c[1]) * 5 + c[2])])
                << "dims " << d1 << "," << d2 << " offset " << off;
          }
        }
      }
    }
  }
}

TEST(Linalg, DiagAndTrace) {
  const auto v = lazy::from_vector<std::int32_t>({1, 2, 3});
  for (std::int64_t k = -2; k <= 2; ++k) {
    const auto m = lazy::diag(v, k);
    const std::int64_t size = 3 + std::abs(k);
    ASSERT_EQ(m.shape(), (lazy::Shape{size, size}));
    const auto g = m.to_vector();
    for (std::int64_t i = 0; i < size; ++i) {
      for (std::int64_t j = 0; j < size; ++j) {
        const std::int64_t e = j - i == k ? (k >= 0 ? i : j) : -1;  // element index on the diagonal
        EXPECT_EQ(g[static_cast<std::size_t>(i * size + j)], e >= 0 ? e + 1 : 0) << "k " << k << " at " << i << "," << j;
      }
    }
    // diag of that matrix at k gives v back.
    EXPECT_EQ(lazy::diag(m, k).to_vector(), (std::vector<std::int32_t>{1, 2, 3}));
  }
  const auto x = lazy::from_vector<float>({1, 2, 3, 4, 5, 6}, lazy::Shape{2, 3});
  EXPECT_EQ(lazy::trace(x).item(), 1.0f + 5.0f);
  EXPECT_EQ(lazy::diag(lazy::zeros<float>(lazy::Shape{0})).shape(), (lazy::Shape{0, 0}));
}

TEST(Linalg, BadRanksAndSizesRaiseShapeError) {
  const auto m = lazy::zeros<float>(lazy::Shape{2, 3}), v = lazy::zeros<float>(lazy::Shape{3});
  const auto t = lazy::zeros<float>(lazy::Shape{2, 3, 4});
  EXPECT_THROW(lazy::mm(m, v), lazy::ShapeError);
  EXPECT_THROW(lazy::mm(t, m), lazy::ShapeError);
  EXPECT_THROW(lazy::mm(m, m), lazy::ShapeError);  // inner sizes 3 and 2
  EXPECT_THROW(lazy::mv(v, v), lazy::ShapeError);
  EXPECT_THROW(lazy::dot(v, lazy::zeros<float>(lazy::Shape{4})), lazy::ShapeError);
  EXPECT_THROW(lazy::dot(m, m), lazy::ShapeError);
  EXPECT_THROW(lazy::outer(m, v), lazy::ShapeError);
  EXPECT_THROW(lazy::addmm(lazy::zeros<float>(lazy::Shape{3, 3}), m, lazy::zeros<float>(lazy::Shape{3, 3})),
               lazy::ShapeError);
  EXPECT_THROW(lazy::diagonal(v), lazy::ShapeError);
  EXPECT_THROW(lazy::diagonal(m, 0, 1, 1), lazy::ShapeError);
  EXPECT_THROW(lazy::diagonal(m, 0, 0, 2), lazy::Error);
  EXPECT_THROW(lazy::trace(t), lazy::ShapeError);
  EXPECT_THROW(lazy::diag(t), lazy::ShapeError);
}

TEST(Linalg, GradientsMatchFiniteDifferences) {
  using gradcheck::input;
  using lazy::Shape;
  gradcheck::check("mm", [](const auto& v) { return lazy::mm(v[0], v[1]); }, {input(Shape{3, 4}, 1), input(Shape{4, 2}, 2)});
  gradcheck::check("mv", [](const auto& v) { return lazy::mv(v[0], v[1]); }, {input(Shape{3, 4}, 3), input(Shape{4}, 4)});
  gradcheck::check("dot", [](const auto& v) { return lazy::dot(v[0], v[1]); }, {input(Shape{4}, 5), input(Shape{4}, 6)});
  gradcheck::check("outer", [](const auto& v) { return lazy::outer(v[0], v[1]); }, {input(Shape{3}, 7), input(Shape{2}, 8)});
  gradcheck::check(
      "addmm", [](const auto& v) { return lazy::addmm(v[0], v[1], v[2], 0.5, 3); },
      {input(Shape{2}, 9), input(Shape{3, 4}, 10), input(Shape{4, 2}, 11)});
  gradcheck::check(
      "diagonal", [](const auto& v) { return lazy::diagonal(v[0], -1, 2, 0); }, {input(Shape{3, 2, 4}, 12)});
  gradcheck::check("trace", [](const auto& v) { return lazy::trace(v[0]); }, {input(Shape{3, 4}, 13)});
  gradcheck::check("diag of a vector", [](const auto& v) { return lazy::diag(v[0], 1); }, {input(Shape{3}, 14)});
}

TEST(Linalg, IntegersStayIntegers) {
  // 16777217 is not a float; a factor applied in floating point would round it.
  const auto big = lazy::full<std::int64_t>(lazy::Shape{1, 1}, 16777217);
  const auto z = lazy::zeros<std::int64_t>(lazy::Shape{1, 1});
  EXPECT_EQ(lazy::addmm(big, z, z).to_vector(), (std::vector<std::int64_t>{16777217}));
  EXPECT_EQ(lazy::addmm(big, z, z, 3, 2).to_vector(), (std::vector<std::int64_t>{3 * 16777217LL}));
  EXPECT_THROW(lazy::addmm(big, z, z, 0.5), lazy::DTypeError);
  const auto m = lazy::from_vector<std::int32_t>({1, 2, 3, 4}, lazy::Shape{2, 2});
  const auto t = lazy::trace(m);
  static_assert(std::is_same_v<decltype(t), const lazy::Tensor<std::int64_t>>, "torch.trace of int32 is int64");
  EXPECT_EQ(t.item(), 5);
}
