// sort, argsort and topk (include/lazytensor/ops/sort.hpp) against references written here:
// a stable insertion sort and std::stable_sort over (value, index) pairs with an explicit
// NaN-aware order (NaN above every number), for every dtype, every dim, empty and size-1
// dims, ties, NaNs, expressions, gradients and errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include <lazytensor/ops/sort.hpp>
#include <lazytensor/ops/factories.hpp>
#include <lazytensor/tensor.hpp>

#include "../autograd/gradcheck.hpp"
#include "testing/helpers.hpp"

namespace sort_ref {

using lazy::Shape;
using lazy::Tensor;
using lazy_tests::num;

// ---- the reference ------------------------------------------------------------------------

// A value as the reference compares it: bool and integers exactly (int64 as itself, not
// through double), bfloat16 through float.
template <class T>
auto key_of(T v) {
  if constexpr (std::is_same_v<T, lazy::bfloat16>) return static_cast<float>(v);
  else if constexpr (std::is_same_v<T, bool>) return static_cast<int>(v);
  else return v;
}

template <class K>
bool nan_key(K v) {
  if constexpr (std::is_floating_point_v<K>) return std::isnan(v);
  else return false;
}

// Strict "a goes before b" without looking at positions: NaN above every number, NaNs
// equal to each other. Stability has to come from the algorithm that uses it.
template <class K>
bool goes_before(K a, K b, bool descending) {
  if (descending) {
    if (nan_key(b)) return false;
    if (nan_key(a)) return true;
    return a > b;
  }
  if (nan_key(a)) return false;
  if (nan_key(b)) return true;
  return a < b;
}

template <class T>
struct Expected {
  Shape shape;
  std::vector<T> values;
  std::vector<std::int64_t> indices;
};

// The first k of each row along d, ordered stably. `insertion`: a scalar insertion sort
// (small inputs), else std::stable_sort (large ones): two algorithms, neither the library's.
template <class T>
Expected<T> reference(const std::vector<T>& in, const Shape& s, int d, std::int64_t k, bool descending,
                      bool insertion = true) {
  Expected<T> e;
  if (s.rank() == 0) {
    e.shape = s;
    e.values = {in[0]};
    e.indices = {0};
    return e;
  }
  std::int64_t outer = 1, inner = 1;
  for (int i = 0; i < d; ++i) outer *= s[i];
  for (int i = d + 1; i < s.rank(); ++i) inner *= s[i];
  const std::int64_t n = s[d];
  e.shape = s;
  e.shape[d] = k;
  e.values.resize(static_cast<std::size_t>(e.shape.numel()));
  e.indices.resize(static_cast<std::size_t>(e.shape.numel()));
  using K = decltype(key_of(T{}));
  std::vector<std::pair<K, std::int64_t>> row;
  for (std::int64_t o = 0; o < outer; ++o) {
    for (std::int64_t c = 0; c < inner; ++c) {
      row.clear();
      for (std::int64_t j = 0; j < n; ++j) row.emplace_back(key_of(in[static_cast<std::size_t>((o * n + j) * inner + c)]), j);
      auto before = [&](const auto& a, const auto& b) { return goes_before(a.first, b.first, descending); };
      if (insertion) {
        for (std::size_t i = 1; i < row.size(); ++i) {
          auto cur = row[i];
          std::size_t j = i;
          while (j > 0 && before(cur, row[j - 1])) {  // strictly before: equal ones stay behind
            row[j] = row[j - 1];
            --j;
          }
          row[j] = cur;
        }
      } else {
        std::stable_sort(row.begin(), row.end(), before);
      }
      for (std::int64_t r = 0; r < k; ++r) {
        const auto at = static_cast<std::size_t>((o * k + r) * inner + c);
        e.indices[at] = row[static_cast<std::size_t>(r)].second;
        e.values[at] = in[static_cast<std::size_t>((o * n + row[static_cast<std::size_t>(r)].second) * inner + c)];
      }
    }
  }
  return e;
}

// Same value, NaN matching NaN and the sign of zero counted (the value must be the very
// element the index names).
template <class T>
bool same_value(T a, T b) {
  if constexpr (std::is_same_v<T, bool> || std::is_integral_v<T>) {
    return a == b;
  } else {
    const double x = num(a), y = num(b);
    if (std::isnan(x) || std::isnan(y)) return std::isnan(x) && std::isnan(y);
    return x == y && std::signbit(x) == std::signbit(y);
  }
}

template <class T>
void expect_values(const Tensor<T>& got, const Expected<T>& want, const std::string& what) {
  ASSERT_EQ(got.shape(), want.shape) << what << ": got shape " << got.shape().str() << ", want " << want.shape.str();
  const std::vector<T> v = got.to_vector();
  ASSERT_EQ(v.size(), want.values.size()) << what;
  for (std::size_t i = 0; i < v.size(); ++i) {
    if (!same_value<T>(v[i], want.values[i])) {
      ADD_FAILURE() << what << ": value " << i << ": got " << num<T>(v[i]) << ", want " << num<T>(want.values[i]);
      return;
    }
  }
}

template <class T>
void expect_indices(const Tensor<std::int64_t>& got, const Expected<T>& want, const std::string& what) {
  ASSERT_EQ(got.shape(), want.shape) << what << ": got shape " << got.shape().str() << ", want " << want.shape.str();
  const std::vector<std::int64_t> v = got.to_vector();
  ASSERT_EQ(v.size(), want.indices.size()) << what;
  for (std::size_t i = 0; i < v.size(); ++i) {
    if (v[i] != want.indices[i]) {
      ADD_FAILURE() << what << ": index " << i << ": got " << v[i] << ", want " << want.indices[i];
      return;
    }
  }
}

// ---- inputs -------------------------------------------------------------------------------

// Values with many ties (a few distinct values), and for floating types NaN, +-inf and -0
// sprinkled in; for integers their extremes.
template <class T>
std::vector<T> make_values(std::int64_t n, std::uint64_t seed, bool specials = true) {
  std::vector<T> v;
  v.reserve(static_cast<std::size_t>(n));
  std::uint64_t h = seed * 0x9e3779b97f4a7c15ull + 12345;
  for (std::int64_t i = 0; i < n; ++i) {
    h = h * 6364136223846793005ull + 1442695040888963407ull;
    const auto small = static_cast<int>((h >> 33) % 9) - 4;
    const auto pick = (h >> 45) % 13;
    if constexpr (std::is_same_v<T, bool>) {
      v.push_back(((h >> 33) & 1) != 0);
    } else if constexpr (std::is_integral_v<T>) {
      if (specials && pick == 0) v.push_back(std::numeric_limits<T>::max());
      else if (specials && pick == 1) v.push_back(std::numeric_limits<T>::min());
      else v.push_back(static_cast<T>(small));
    } else {
      float f = static_cast<float>(small) * 0.5f;
      if (specials && pick == 0) f = std::numeric_limits<float>::quiet_NaN();
      else if (specials && pick == 1) f = std::numeric_limits<float>::infinity();
      else if (specials && pick == 2) f = -std::numeric_limits<float>::infinity();
      else if (specials && pick == 3) f = -0.0f;
      v.push_back(static_cast<T>(f));
    }
  }
  return v;
}

inline const std::vector<Shape>& shapes() {
  static const std::vector<Shape> s = {Shape{7},       Shape{1},       Shape{0},       Shape{3, 5},
                                       Shape{4, 1},    Shape{1, 6},    Shape{0, 3},    Shape{3, 0},
                                       Shape{2, 3, 5}, Shape{2, 0, 3}, Shape{3, 1, 7}, Shape{2, 17, 3},
                                       Shape{2, 4, 33}};
  return s;
}

std::string label(const Shape& s, std::int64_t dim, bool descending) {
  return "shape " + s.str() + " dim " + std::to_string(dim) + (descending ? " descending" : " ascending");
}

int norm(std::int64_t dim, int rank) { return static_cast<int>(dim < 0 ? dim + std::max(rank, 1) : dim); }

template <class T>
class Sort : public ::testing::Test {};
template <class T>
class Argsort : public ::testing::Test {};
template <class T>
class Topk : public ::testing::Test {};
using Dtypes = ::testing::Types<float, double, lazy::bfloat16, std::int32_t, std::int64_t, bool>;
TYPED_TEST_SUITE(Sort, Dtypes);
TYPED_TEST_SUITE(Argsort, Dtypes);
TYPED_TEST_SUITE(Topk, Dtypes);

// ---- sort ---------------------------------------------------------------------------------

TYPED_TEST(Sort, MatchesReferenceOnEveryDimAndShape) {
  using T = TypeParam;
  std::uint64_t seed = 1;
  for (const Shape& s : shapes()) {
    const auto in = make_values<T>(s.numel(), seed++);
    const auto x = lazy::from_vector<T>(in, s);
    for (std::int64_t dim = -s.rank(); dim < s.rank(); ++dim) {
      for (bool desc : {false, true}) {
        const auto want = reference(in, s, norm(dim, s.rank()), s[norm(dim, s.rank())], desc);
        auto [v, i] = lazy::sort(x, dim, desc);
        expect_values(v, want, "sort " + label(s, dim, desc));
        expect_indices(i, want, "sort " + label(s, dim, desc));
      }
    }
    // The defaults: last dim, ascending.
    auto [v, i] = lazy::sort(x);
    const auto want = reference(in, s, s.rank() - 1, s[s.rank() - 1], false);
    expect_values(v, want, "sort() " + s.str());
    expect_indices(i, want, "sort() " + s.str());
  }
}

TYPED_TEST(Sort, ZeroDimTensorIsItsOwnSortWithIndexZero) {
  using T = TypeParam;
  const auto in = make_values<T>(1, 5, false);
  const auto x = lazy::from_vector<T>(in, Shape{});
  for (std::int64_t dim : {0, -1}) {
    for (bool desc : {false, true}) {
      auto [v, i] = lazy::sort(x, dim, desc);
      const auto want = reference(in, Shape{}, 0, 1, desc);
      expect_values(v, want, "0-d sort");
      expect_indices(i, want, "0-d sort");
      expect_indices(lazy::argsort(x, dim, desc), want, "0-d argsort");
      auto [tv, ti] = lazy::topk(x, 1, dim, !desc);
      expect_values(tv, want, "0-d topk");
      expect_indices(ti, want, "0-d topk");
    }
  }
  EXPECT_THROW(lazy::sort(x, 1), lazy::ShapeError);
  EXPECT_THROW(lazy::argsort(x, -2), lazy::ShapeError);
}

TYPED_TEST(Sort, ManyRowsAboveTheThreadingThresholdMatchStableSort) {
  using T = TypeParam;
  lazy_tests::ThreadsGuard threads(4);
  const Shape s{64, 1500};
  const auto in = make_values<T>(s.numel(), 77);
  const auto x = lazy::from_vector<T>(in, s);
  for (int dim : {0, 1}) {
    for (bool desc : {false, true}) {
      const auto want = reference(in, s, dim, s[dim], desc, /*insertion=*/false);
      auto [v, i] = lazy::sort(x, dim, desc);
      expect_values(v, want, "big sort " + label(s, dim, desc));
      expect_indices(i, want, "big sort " + label(s, dim, desc));
    }
  }
}

TYPED_TEST(Sort, LongStridedRowsReadInBlocksOfColumns) {
  // dim 0 of a (40000, 7) tensor: long rows 7 apart in memory, read a few at a time, as
  // many as the kernel's scratch holds (6 of 40000 entries), the last block partial.
  using T = TypeParam;
  const Shape s{40000, 7};
  const auto in = make_values<T>(s.numel(), 88);
  const auto x = lazy::from_vector<T>(in, s);
  for (bool desc : {false, true}) {
    const auto want = reference(in, s, 0, s[0], desc, /*insertion=*/false);
    auto [v, i] = lazy::sort(x, 0, desc);
    expect_values(v, want, "long strided sort " + label(s, 0, desc));
    expect_indices(i, want, "long strided sort " + label(s, 0, desc));
    const auto top = reference(in, s, 0, 5, desc, /*insertion=*/false);
    expect_indices(std::get<1>(lazy::topk(x, 5, 0, desc)), top, "long strided topk " + label(s, 0, desc));
  }
}

// ---- argsort ------------------------------------------------------------------------------

TYPED_TEST(Argsort, MatchesReferenceOnEveryDimAndShape) {
  using T = TypeParam;
  std::uint64_t seed = 101;
  for (const Shape& s : shapes()) {
    const auto in = make_values<T>(s.numel(), seed++);
    const auto x = lazy::from_vector<T>(in, s);
    for (std::int64_t dim = -s.rank(); dim < s.rank(); ++dim) {
      for (bool desc : {false, true}) {
        const auto want = reference(in, s, norm(dim, s.rank()), s[norm(dim, s.rank())], desc);
        expect_indices(lazy::argsort(x, dim, desc), want, "argsort " + label(s, dim, desc));
      }
    }
    expect_indices(lazy::argsort(x), reference(in, s, s.rank() - 1, s[s.rank() - 1], false), "argsort() " + s.str());
  }
}

// ---- topk ---------------------------------------------------------------------------------

TYPED_TEST(Topk, MatchesReferenceForEveryK) {
  using T = TypeParam;
  std::uint64_t seed = 201;
  for (const Shape& s : shapes()) {
    const auto in = make_values<T>(s.numel(), seed++);
    const auto x = lazy::from_vector<T>(in, s);
    for (std::int64_t dim = -s.rank(); dim < s.rank(); ++dim) {
      const int d = norm(dim, s.rank());
      const std::int64_t n = s[d];
      std::vector<std::int64_t> ks = {0, 1, 2, n / 2, n - 1, n};
      for (std::int64_t k : ks) {
        if (k < 0 || k > n) continue;
        for (bool largest : {true, false}) {
          for (bool sorted : {true, false}) {
            const std::string what = "topk k=" + std::to_string(k) + (largest ? " largest " : " smallest ") +
                                     (sorted ? "sorted " : "unsorted ") + label(s, dim, largest);
            const auto want = reference(in, s, d, k, largest);
            auto [v, i] = lazy::topk(x, k, dim, largest, sorted);
            expect_values(v, want, what);
            expect_indices(i, want, what);
          }
        }
      }
    }
    // The defaults: last dim, largest.
    const std::int64_t k = std::min<std::int64_t>(2, s[s.rank() - 1]);
    auto [v, i] = lazy::topk(x, k);
    const auto want = reference(in, s, s.rank() - 1, k, true);
    expect_values(v, want, "topk(x, k) " + s.str());
    expect_indices(i, want, "topk(x, k) " + s.str());
  }
}

TYPED_TEST(Topk, LongRowsSelectThenSortAboveTheThreadingThreshold) {
  using T = TypeParam;
  lazy_tests::ThreadsGuard threads(4);
  const Shape s{40, 3000};
  const auto in = make_values<T>(s.numel(), 301);
  const auto x = lazy::from_vector<T>(in, s);
  for (int dim : {0, 1}) {
    for (std::int64_t k : {std::int64_t{1}, std::int64_t{7}, s[dim] / 3, s[dim]}) {
      for (bool largest : {true, false}) {
        const auto want = reference(in, s, dim, k, largest, /*insertion=*/false);
        auto [v, i] = lazy::topk(x, k, dim, largest);
        const std::string what = "big topk k=" + std::to_string(k) + " " + label(s, dim, largest);
        expect_values(v, want, what);
        expect_indices(i, want, what);
      }
    }
  }
}

// ---- orderings spelled out by hand --------------------------------------------------------

template <class T>
void check_nan_order() {
  const T nan = static_cast<T>(std::numeric_limits<float>::quiet_NaN());
  const std::vector<T> in = {T(3), nan, T(1), nan, T(1), T(-2)};
  const auto x = lazy::from_vector<T>(in);
  // Ascending: -2 (5), 1 (2), 1 (4), 3 (0), then the NaNs in index order (1, 3).
  EXPECT_EQ(lazy::argsort(x).to_vector(), (std::vector<std::int64_t>{5, 2, 4, 0, 1, 3}));
  // Descending: the NaNs first, in index order, then 3, 1 (2), 1 (4), -2.
  EXPECT_EQ(lazy::argsort(x, 0, true).to_vector(), (std::vector<std::int64_t>{1, 3, 0, 2, 4, 5}));
  // The largest two are the NaNs; the smallest two, -2 and the first 1.
  EXPECT_EQ(std::get<1>(lazy::topk(x, 2)).to_vector(), (std::vector<std::int64_t>{1, 3}));
  EXPECT_EQ(std::get<1>(lazy::topk(x, 3)).to_vector(), (std::vector<std::int64_t>{1, 3, 0}));
  EXPECT_EQ(std::get<1>(lazy::topk(x, 2, 0, false)).to_vector(), (std::vector<std::int64_t>{5, 2}));
  EXPECT_EQ(std::get<1>(lazy::topk(x, 5, 0, false)).to_vector(), (std::vector<std::int64_t>{5, 2, 4, 0, 1}));
  auto [v, i] = lazy::sort(x, 0, true);
  const auto got = v.to_vector();
  EXPECT_TRUE(std::isnan(num(got[0])) && std::isnan(num(got[1])));
  EXPECT_EQ(num(got[2]), 3);
  EXPECT_EQ(num(got[5]), -2);
}

TEST(Sort, NaNIsAboveEveryNumberAndNaNsKeepTheirOrder) {
  check_nan_order<float>();
  check_nan_order<double>();
  check_nan_order<lazy::bfloat16>();
  // A row of NaNs only, and one with infinities next to NaN.
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(lazy::argsort(lazy::from_vector<float>({nan, nan, nan}), 0, true).to_vector(),
            (std::vector<std::int64_t>{0, 1, 2}));
  EXPECT_EQ(lazy::argsort(lazy::from_vector<float>({nan, inf, -inf, nan})).to_vector(),
            (std::vector<std::int64_t>{2, 1, 0, 3}));
  EXPECT_EQ(lazy::argsort(lazy::from_vector<float>({nan, inf, -inf, nan}), 0, true).to_vector(),
            (std::vector<std::int64_t>{0, 3, 1, 2}));
}

TEST(Sort, EqualValuesKeepTheirIndexOrder) {
  // Columns of a 2-D tensor (dim 0, strided rows) and rows (dim 1), both directions.
  const auto x = lazy::from_vector<std::int32_t>({2, 1, 1, 2, 2, 1, 1, 2}, Shape{4, 2});
  // Column 0: 2 1 2 1, ascending rows 1 3 0 2; column 1: 1 2 1 2, ascending rows 0 2 1 3.
  EXPECT_EQ(lazy::argsort(x, 0).to_vector(), (std::vector<std::int64_t>{1, 0, 3, 2, 0, 1, 2, 3}));
  // Descending: column 0 rows 0 2 1 3, column 1 rows 1 3 0 2.
  EXPECT_EQ(lazy::argsort(x, 0, true).to_vector(), (std::vector<std::int64_t>{0, 1, 2, 3, 1, 0, 3, 2}));
  EXPECT_EQ(lazy::argsort(x, 1).to_vector(), (std::vector<std::int64_t>{1, 0, 0, 1, 1, 0, 0, 1}));
  // -0.0 and 0.0 are equal: index order.
  EXPECT_EQ(lazy::argsort(lazy::from_vector<float>({0.0f, -0.0f, 0.0f, -1.0f})).to_vector(),
            (std::vector<std::int64_t>{3, 0, 1, 2}));
  EXPECT_EQ(lazy::argsort(lazy::from_vector<bool>({true, false, true, false}), 0, true).to_vector(),
            (std::vector<std::int64_t>{0, 2, 1, 3}));
}

TEST(Sort, IntegerExtremesOrderExactly) {
  const std::int64_t big = std::numeric_limits<std::int64_t>::max(), low = std::numeric_limits<std::int64_t>::min();
  // big and big - 1 are one double apart from nothing: compared as int64, not through double.
  const auto x = lazy::from_vector<std::int64_t>({big, big - 1, low, low + 1, 0});
  EXPECT_EQ(lazy::argsort(x).to_vector(), (std::vector<std::int64_t>{2, 3, 4, 1, 0}));
  auto [v, i] = lazy::topk(x, 2);
  EXPECT_EQ(v.to_vector(), (std::vector<std::int64_t>{big, big - 1}));
  EXPECT_EQ(i.to_vector(), (std::vector<std::int64_t>{0, 1}));
}

// ---- expressions and laziness -------------------------------------------------------------

TEST(Sort, TakesElementwiseExpressions) {
  const Shape s{3, 6};
  const auto a = make_values<float>(s.numel(), 401, false), b = make_values<float>(s.numel(), 402, false);
  const auto ta = lazy::from_vector<float>(a, s), tb = lazy::from_vector<float>(b, s);
  std::vector<float> twice(a.size()), diff(a.size());
  for (std::size_t j = 0; j < a.size(); ++j) twice[j] = a[j] * 2, diff[j] = a[j] - b[j];
  for (int dim : {0, 1}) {
    auto [v, i] = lazy::sort(ta * 2, dim, true);
    const auto want = reference(twice, s, dim, s[dim], true);
    expect_values(v, want, "sort(a * 2)");
    expect_indices(i, want, "sort(a * 2)");
    expect_indices(lazy::argsort(ta - tb, dim), reference(diff, s, dim, s[dim], false), "argsort(a - b)");
    auto [tv, ti] = lazy::topk(ta - tb, 2, dim, false);
    const auto want_top = reference(diff, s, dim, 2, false);
    expect_values(tv, want_top, "topk(a - b)");
    expect_indices(ti, want_top, "topk(a - b)");
  }
  // A comparison is a bool expression.
  auto [v, i] = lazy::sort(ta > tb);
  std::vector<bool> gt(a.size());
  for (std::size_t j = 0; j < a.size(); ++j) gt[j] = a[j] > b[j];
  const auto want = reference(gt, s, 1, s[1], false);
  expect_values(v, want, "sort(a > b)");
  expect_indices(i, want, "sort(a > b)");
}

TEST(Sort, RunsAtMarkStep) {
  const auto x = lazy::from_vector<float>(make_values<float>(12, 501, false), Shape{3, 4});
  lazy::mark_step();
  const auto before = lazy_tests::kernels_run();
  auto [v, i] = lazy::sort(x, 0);
  auto a = lazy::argsort(x);
  auto [tv, ti] = lazy::topk(x, 2);
  EXPECT_EQ(lazy_tests::kernels_run(), before);
  EXPECT_FALSE(v.node()->materialized());
  EXPECT_FALSE(i.node()->materialized());
  EXPECT_FALSE(a.node()->materialized());
  EXPECT_FALSE(tv.node()->materialized());
  EXPECT_EQ(i.node()->op_name(), "sort");
  EXPECT_EQ(a.node()->op_name(), "argsort");
  EXPECT_EQ(ti.node()->op_name(), "topk");
  lazy::mark_step();
  EXPECT_TRUE(v.node()->materialized());
  EXPECT_TRUE(a.node()->materialized());
  EXPECT_TRUE(ti.node()->materialized());
  EXPECT_GT(lazy_tests::kernels_run(), before);
}

// ---- gradients ----------------------------------------------------------------------------

// d(sum(values * w))/dx by hand: w at the source position of each value (the reference's
// indices, so nothing here comes from the library's answer).
template <class T>
std::vector<double> scattered(const Shape& s, int d, const Expected<T>& want, const std::vector<double>& w) {
  std::vector<double> g(static_cast<std::size_t>(s.numel()), 0.0);
  if (s.rank() == 0) {
    g[0] = w[0];
    return g;
  }
  std::int64_t inner = 1;
  for (int i = d + 1; i < s.rank(); ++i) inner *= s[i];
  const std::int64_t n = s[d], k = want.shape[d];
  for (std::size_t p = 0; p < want.indices.size(); ++p) {
    const auto pi = static_cast<std::int64_t>(p);
    const std::int64_t o = pi / (k * inner), c = pi % inner;
    g[static_cast<std::size_t>((o * n + want.indices[p]) * inner + c)] += w[p];
  }
  return g;
}

template <class T>
void check_value_gradient(const Shape& s, int dim, std::int64_t k, bool largest, bool full_sort) {
  const auto in = make_values<T>(s.numel(), 601 + static_cast<std::uint64_t>(s.numel()), false);
  std::vector<T> w;
  std::vector<double> wd;
  const auto want = reference(in, s, s.rank() ? dim : 0, full_sort ? (s.rank() ? s[dim] : 1) : k, largest);
  for (std::size_t p = 0; p < want.values.size(); ++p) {
    wd.push_back(static_cast<double>(p % 5) + 1);  // small integers: exact in every floating type
    w.push_back(static_cast<T>(wd.back()));
  }
  auto x = lazy::from_vector<T>(in, s).requires_grad_();
  Tensor<T> v;
  Tensor<std::int64_t> i;
  if (full_sort) std::tie(v, i) = lazy::sort(x, dim, largest);
  else std::tie(v, i) = lazy::topk(x, k, dim, largest);
  ASSERT_TRUE(v.requires_grad());
  EXPECT_FALSE(i.requires_grad());
  EXPECT_EQ(v.grad_fn()->name(), full_sort ? "SortBackward0" : "TopkBackward0");
  v.backward(lazy::from_vector<T>(w, v.shape()));
  lazy::mark_step();
  const Tensor<T> g = x.grad();
  ASSERT_TRUE(g.defined());
  ASSERT_EQ(g.shape(), s);
  const auto got = g.to_vector();
  const auto expect = scattered(s, s.rank() ? dim : 0, want, wd);
  for (std::size_t j = 0; j < got.size(); ++j) {
    EXPECT_EQ(num(got[j]), expect[j]) << (full_sort ? "sort" : "topk") << " shape " << s.str() << " dim " << dim
                                      << " element " << j;
  }
}

TEST(Sort, GradientOfValuesGoesBackToTheirSourcePositions) {
  for (bool desc : {false, true}) {
    check_value_gradient<double>(Shape{9}, 0, 0, desc, true);
    check_value_gradient<float>(Shape{3, 5}, 0, 0, desc, true);
    check_value_gradient<float>(Shape{3, 5}, 1, 0, desc, true);
    check_value_gradient<lazy::bfloat16>(Shape{2, 3, 4}, 1, 0, desc, true);
    check_value_gradient<double>(Shape{2, 3, 4}, 2, 0, desc, true);
    check_value_gradient<double>(Shape{}, 0, 0, desc, true);
    check_value_gradient<float>(Shape{0, 3}, 1, 0, desc, true);
  }
  // Central differences on distinct values (the order does not change within the step).
  gradcheck::check(
      "sort values", [](const std::vector<Tensor<double>>& xs) { return std::get<0>(lazy::sort(xs[0], 1, true)); },
      {gradcheck::input(Shape{3, 5}, 11)});
  gradcheck::check(
      "sort of an expression",
      [](const std::vector<Tensor<double>>& xs) { return std::get<0>(lazy::sort(xs[0] * 3 - xs[1], 0)); },
      {gradcheck::input(Shape{4, 3}, 12), gradcheck::input(Shape{4, 3}, 13)});
}

TEST(Topk, GradientOfValuesGoesToTheSelectedPositionsOnly) {
  for (bool largest : {true, false}) {
    check_value_gradient<double>(Shape{9}, 0, 3, largest, false);
    check_value_gradient<double>(Shape{9}, 0, 0, largest, false);
    check_value_gradient<float>(Shape{4, 6}, 0, 2, largest, false);
    check_value_gradient<float>(Shape{4, 6}, 1, 1, largest, false);
    check_value_gradient<lazy::bfloat16>(Shape{2, 5, 3}, 1, 4, largest, false);
    check_value_gradient<double>(Shape{2, 5, 3}, 2, 3, largest, false);
  }
  gradcheck::check(
      "topk values", [](const std::vector<Tensor<double>>& xs) { return std::get<0>(lazy::topk(xs[0], 2, 0)); },
      {gradcheck::input(Shape{5, 3}, 21)});
  gradcheck::check(
      "topk smallest",
      [](const std::vector<Tensor<double>>& xs) { return std::get<0>(lazy::topk(xs[0], 3, -1, false)); },
      {gradcheck::input(Shape{2, 6}, 22)});
}

TEST(Sort, IntegerAndBoolResultsCarryNoGradient) {
  auto x = lazy::from_vector<float>({3, 1, 2}).requires_grad_();
  auto [v, i] = lazy::sort(x);
  EXPECT_TRUE(v.requires_grad());
  EXPECT_FALSE(i.requires_grad());
  EXPECT_FALSE(lazy::argsort(x).requires_grad());
  auto [iv, ii] = lazy::sort(lazy::from_vector<std::int32_t>({3, 1, 2}));
  EXPECT_FALSE(iv.requires_grad());
}

// ---- errors -------------------------------------------------------------------------------

template <class F>
std::string message_of(F&& f) {
  try {
    f();
  } catch (const lazy::ShapeError& e) {
    return e.what();
  }
  return "(no ShapeError)";
}

TEST(Topk, KOutOfRangeIsAShapeErrorNamingKAndTheDimension) {
  const auto x = lazy::from_vector<float>(make_values<float>(6, 701), Shape{2, 3});
  const std::string msg = message_of([&] { lazy::topk(x, 5, 1); });
  EXPECT_NE(msg.find("topk"), std::string::npos) << msg;
  EXPECT_NE(msg.find("k (5)"), std::string::npos) << msg;
  EXPECT_NE(msg.find("dimension 1"), std::string::npos) << msg;
  EXPECT_NE(msg.find("size 3"), std::string::npos) << msg;
  EXPECT_THROW(lazy::topk(x, -1), lazy::ShapeError);
  EXPECT_THROW(lazy::topk(x, 4), lazy::ShapeError);
  EXPECT_THROW(lazy::topk(x, 3, 0), lazy::ShapeError);
  EXPECT_NO_THROW(lazy::topk(x, 2, 0));
  EXPECT_NO_THROW(lazy::topk(x, 0, -2));
  // An empty dimension takes only k = 0.
  const auto e = lazy::from_vector<float>({}, Shape{2, 0});
  EXPECT_THROW(lazy::topk(e, 1), lazy::ShapeError);
  auto [ev, ei] = lazy::topk(e, 0);
  EXPECT_EQ(ev.shape(), (Shape{2, 0}));
  EXPECT_EQ(ei.shape(), (Shape{2, 0}));
  // A 0-d tensor has one element; a 0-d result cannot hold none.
  const auto z = lazy::from_vector<float>({1.5f}, Shape{});
  EXPECT_THROW(lazy::topk(z, 0), lazy::ShapeError);
  EXPECT_THROW(lazy::topk(z, 2), lazy::ShapeError);
  lazy::mark_step();  // nothing bad was left pending
}

TEST(Sort, DimOutOfRangeIsAShapeError) {
  const auto x = lazy::from_vector<double>(make_values<double>(24, 801), Shape{2, 3, 4});
  for (std::int64_t dim : {3, -4, 100}) {
    const std::string msg = message_of([&] { lazy::sort(x, dim); });
    EXPECT_NE(msg.find("sort"), std::string::npos) << msg;
    EXPECT_NE(msg.find(std::to_string(dim)), std::string::npos) << msg;
    EXPECT_THROW(lazy::argsort(x, dim), lazy::ShapeError);
    EXPECT_THROW(lazy::topk(x, 1, dim), lazy::ShapeError);
  }
  const auto one = lazy::from_vector<double>({1.0, 2.0});
  EXPECT_THROW(lazy::sort(one, 1), lazy::ShapeError);
  EXPECT_THROW(lazy::sort(one, -2), lazy::ShapeError);
  lazy::mark_step();
}

}  // namespace sort_ref
