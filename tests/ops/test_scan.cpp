// Cumulative ops (include/lazytensor/ops/scan.hpp): cumsum, cumprod, cummax, cummin against
// scalar references written here (one walk per line along the scanned dim, over flat index
// arithmetic), for every dtype, rank and dim, and their gradients against finite
// differences and against the product rule written out term by term.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include <lazytensor/ops/factories.hpp>
#include <lazytensor/ops/scan.hpp>
#include <lazytensor/tensor.hpp>

#include "../autograd/gradcheck.hpp"
#include "testing/helpers.hpp"

namespace scan_ref {

using lazy::Shape;
using lazy::Tensor;
using lazy_tests::num;
using bf16 = lazy::bfloat16;
using i64 = std::int64_t;

// ---- reference -------------------------------------------------------------------------

/// torch's result type of cumsum / cumprod: int64 for integers and bool.
template <class T>
using result_t = std::conditional_t<lazy::is_floating_v<T>, T, i64>;

/// What torch's CPU kernels accumulate in: float for bfloat16, double for float and
/// double, and (here) uint64 for integers so the reference's own wraparound is defined.
template <class T>
using acc_t = std::conditional_t<std::is_same_v<T, bf16>, float,
                                 std::conditional_t<lazy::is_floating_v<T>, double, std::uint64_t>>;

/// float -> nearest bfloat16 value (ties to even), as a float; written from the format's
/// definition rather than taken from lazy::bfloat16.
inline float round_to_bf16(float f) {
  if (std::isnan(f)) return f;
  std::uint32_t u = std::bit_cast<std::uint32_t>(f);
  const std::uint32_t low = u & 0xffffu, keep = u & 0xffff0000u;
  const bool odd = (u >> 16) & 1u;
  if (low > 0x8000u || (low == 0x8000u && odd)) u = keep + 0x10000u;
  else u = keep;
  return std::bit_cast<float>(u);
}

template <class T>
acc_t<T> to_acc(T v) {
  if constexpr (std::is_same_v<acc_t<T>, std::uint64_t>) return static_cast<std::uint64_t>(static_cast<i64>(v));
  else return static_cast<acc_t<T>>(num(v));
}

template <class T>
result_t<T> from_acc(acc_t<T> a) {
  if constexpr (std::is_same_v<acc_t<T>, std::uint64_t>) return static_cast<i64>(a);  // modular (C++20)
  else if constexpr (std::is_same_v<T, bf16>) return bf16(round_to_bf16(a));          // exact: already rounded
  else return static_cast<T>(a);
}

std::vector<i64> strides_of(const Shape& s) {
  std::vector<i64> st(static_cast<std::size_t>(s.rank()), 1);
  for (int d = s.rank() - 2; d >= 0; --d) st[d] = st[d + 1] * s[d + 1];
  return st;
}

/// Calls line(start, stride, length) for every line of `s` along `dim` (a 0-d shape is one
/// line of one element): the flat offsets start + k * stride, k < length.
template <class F>
void for_each_line(const Shape& s, int dim, F&& line) {
  if (s.rank() == 0) return line(i64{0}, i64{1}, i64{1});
  if (dim < 0) dim += s.rank();
  const auto st = strides_of(s);
  for (i64 f = 0; f < s.numel(); ++f) {
    if ((f / st[dim]) % s[dim] == 0) line(f, st[dim], s[dim]);  // f has coordinate 0 along dim
  }
}

enum class Kind { Sum, Prod };

/// The running sum or product of x along dim (reverse: from the end).
template <class T>
std::vector<result_t<T>> ref_scan(const std::vector<T>& x, const Shape& s, int dim, Kind kind,
                                  bool reverse = false) {
  std::vector<result_t<T>> out(x.size());
  for_each_line(s, dim, [&](i64 start, i64 stride, i64 n) {
    acc_t<T> acc = kind == Kind::Sum ? acc_t<T>(0) : acc_t<T>(1);
    for (i64 k = 0; k < n; ++k) {
      const i64 at = start + (reverse ? n - 1 - k : k) * stride;
      acc = kind == Kind::Sum ? acc + to_acc(x[at]) : acc * to_acc(x[at]);
      out[at] = from_acc<T>(acc);
    }
  });
  return out;
}

template <class T>
bool is_nan(T v) {
  if constexpr (lazy::is_floating_v<T>) return std::isnan(num(v));
  else return false;
}

/// a >= b (max) or a <= b (min), in the type itself for integers (no double rounding).
template <class T>
bool at_least_as_extreme(T a, T b, bool max) {
  if constexpr (lazy::is_floating_v<T>) return max ? num(a) >= num(b) : num(a) <= num(b);
  else return max ? a >= b : a <= b;
}

/// cummax / cummin as torch documents and implements it: an element equal to the running
/// extreme replaces it (the later index), a NaN replaces anything, only a NaN replaces a NaN.
template <class T>
void ref_extreme(const std::vector<T>& x, const Shape& s, int dim, bool max, std::vector<T>& values,
                 std::vector<i64>& indices) {
  values.assign(x.size(), T{});
  indices.assign(x.size(), -1);
  for_each_line(s, dim, [&](i64 start, i64 stride, i64 n) {
    T best{};
    i64 where = -1;
    for (i64 k = 0; k < n; ++k) {
      const T v = x[start + k * stride];
      if (k == 0 || is_nan(v) || (!is_nan(best) && at_least_as_extreme(v, best, max))) {
        best = v;
        where = k;
      }
      values[start + k * stride] = best;
      indices[start + k * stride] = where;
    }
  });
}

/// dx(i) = sum over k >= i of g(k) * prod_{m <= k, m != i} x(m): the product rule, term by
/// term, with no division (so zeros in x are handled like any other value).
std::vector<double> ref_cumprod_grad(const std::vector<double>& x, const std::vector<double>& g, const Shape& s,
                                     int dim) {
  std::vector<double> dx(x.size(), 0.0);
  for_each_line(s, dim, [&](i64 start, i64 stride, i64 n) {
    for (i64 i = 0; i < n; ++i) {
      double total = 0;
      for (i64 k = i; k < n; ++k) {
        double term = g[start + k * stride];
        for (i64 m = 0; m <= k; ++m)
          if (m != i) term *= x[start + m * stride];
        total += term;
      }
      dx[start + i * stride] = total;
    }
  });
  return dx;
}

// ---- data and comparisons ----------------------------------------------------------------

/// Pseudo-random values per dtype: bool 0/1; integers in [-spread, spread]; floating in
/// [lo, hi) (bfloat16 rounded to its grid).
template <class T>
std::vector<T> data(i64 n, unsigned seed, int spread = 9, double lo = -2, double hi = 2) {
  std::mt19937_64 rng(seed);
  std::vector<T> v(static_cast<std::size_t>(n));
  for (auto&& e : v) {
    if constexpr (std::is_same_v<T, bool>) e = (rng() & 1u) != 0;
    else if constexpr (lazy::is_integral_v<T>) e = static_cast<T>(static_cast<int>(rng() % (2u * spread + 1)) - spread);
    else e = static_cast<T>(std::uniform_real_distribution<double>(lo, hi)(rng));
  }
  return v;
}

template <class T>
bool same(T a, T b) {
  if constexpr (lazy::is_floating_v<T>) {
    if (std::isnan(num(a)) || std::isnan(num(b))) return std::isnan(num(a)) && std::isnan(num(b));
    return num(a) == num(b) && std::signbit(num(a)) == std::signbit(num(b));
  } else {
    return a == b;
  }
}

/// Exact comparison (bit for bit but NaN payloads) of shape and values; first mismatch only.
template <class T>
void expect_equal(const Tensor<T>& t, const Shape& shape, const std::vector<T>& want, const std::string& what) {
  ASSERT_EQ(t.shape(), shape) << what << ": got shape " << t.shape().str();
  const std::vector<T> got = t.to_vector();
  ASSERT_EQ(got.size(), want.size()) << what;
  for (std::size_t i = 0; i < want.size(); ++i) {
    if (!same<T>(got[i], want[i])) {
      ADD_FAILURE() << what << ": element " << i << ": got " << num<T>(got[i]) << ", want " << num<T>(want[i]);
      return;
    }
  }
}

void expect_near(const std::vector<double>& got, const std::vector<double>& want, double tol, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (std::size_t i = 0; i < want.size(); ++i) {
    if (!(std::abs(got[i] - want[i]) <= tol * std::max(1.0, std::abs(want[i])))) {
      ADD_FAILURE() << what << ": element " << i << ": got " << got[i] << ", want " << want[i];
      return;
    }
  }
}

std::string label(const char* op, const Shape& s, int dim) { return std::string(op) + " " + s.str() + " dim " + std::to_string(dim); }

/// Shapes that cover rank 0-3, empty and size-1 dims, rows (dim last) and strided scans,
/// and inner sizes past the kernel's widest chunk of columns (4096): 4100 and 8198 columns
/// take two and three chunks, the last one narrow.
const std::vector<Shape>& shapes() {
  static const std::vector<Shape> all = {
      Shape{},        Shape{0},       Shape{1},       Shape{7},        Shape{129},    Shape{0, 3},
      Shape{3, 0},    Shape{1, 1},    Shape{4, 1},    Shape{1, 5},     Shape{3, 4},   Shape{2, 3, 4},
      Shape{2, 0, 3}, Shape{1, 3, 1}, Shape{3, 2, 5}, Shape{2, 3, 257}, Shape{2, 4100}, Shape{3, 2, 4099}};
  return all;
}

/// Every dim of s, each also as its negative form (0 and -1 for a 0-d shape).
std::vector<int> dims_of(const Shape& s) {
  std::vector<int> d;
  const int r = std::max(s.rank(), 1);
  for (int i = -r; i < r; ++i) d.push_back(i);
  return d;
}

// ---- typed suites: every dtype ------------------------------------------------------------

template <class T>
class Cumsum : public ::testing::Test {};
template <class T>
class Cumprod : public ::testing::Test {};
template <class T>
class Cummax : public ::testing::Test {};
using AllTypes = ::testing::Types<float, double, lazy::bfloat16, std::int32_t, std::int64_t, bool>;
TYPED_TEST_SUITE(Cumsum, AllTypes);
TYPED_TEST_SUITE(Cumprod, AllTypes);
TYPED_TEST_SUITE(Cummax, AllTypes);

static_assert(std::is_same_v<decltype(lazy::cumsum(std::declval<Tensor<std::int32_t>>(), 0)), Tensor<i64>>);
static_assert(std::is_same_v<decltype(lazy::cumsum(std::declval<Tensor<bool>>(), 0)), Tensor<i64>>);
static_assert(std::is_same_v<decltype(lazy::cumprod(std::declval<Tensor<i64>>(), 0)), Tensor<i64>>);
static_assert(std::is_same_v<decltype(lazy::cumsum(std::declval<Tensor<bf16>>(), 0)), Tensor<bf16>>);
static_assert(std::is_same_v<decltype(lazy::cumprod(std::declval<Tensor<float>>(), 0)), Tensor<float>>);
static_assert(std::is_same_v<decltype(lazy::cumsum<double>(std::declval<Tensor<float>>(), 0)), Tensor<double>>);
static_assert(std::is_same_v<decltype(lazy::cumsum<std::int32_t>(std::declval<Tensor<i64>>(), 0)),
                             Tensor<std::int32_t>>);
static_assert(std::is_same_v<decltype(lazy::cummax(std::declval<Tensor<std::int32_t>>(), 0)),
                             std::tuple<Tensor<std::int32_t>, Tensor<i64>>>);
static_assert(std::is_same_v<decltype(lazy::cummin(std::declval<Tensor<bool>>(), 0)),
                             std::tuple<Tensor<bool>, Tensor<i64>>>);
template <class D>
constexpr bool can_cumsum_as = requires(const Tensor<float>& t) { lazy::cumsum<D>(t, 0); };
static_assert(can_cumsum_as<double> && can_cumsum_as<std::int32_t> && !can_cumsum_as<bool>);

TYPED_TEST(Cumsum, EveryShapeAndDimAgainstReference) {
  using T = TypeParam;
  unsigned seed = 1;
  for (const Shape& s : shapes()) {
    const auto x = data<T>(s.numel(), ++seed);
    const auto xt = lazy::from_vector<T>(x, s);
    for (int d : dims_of(s)) expect_equal(lazy::cumsum(xt, d), s, ref_scan(x, s, d, Kind::Sum), label("cumsum", s, d));
  }
}

TYPED_TEST(Cumprod, EveryShapeAndDimAgainstReference) {
  using T = TypeParam;
  unsigned seed = 100;
  for (const Shape& s : shapes()) {
    // Factors near +-1 keep long floating products finite; integers may wrap (the reference wraps alike).
    const auto x = data<T>(s.numel(), ++seed, 3, 0.6, 1.4);
    const auto xt = lazy::from_vector<T>(x, s);
    for (int d : dims_of(s)) expect_equal(lazy::cumprod(xt, d), s, ref_scan(x, s, d, Kind::Prod), label("cumprod", s, d));
  }
}

TYPED_TEST(Cummax, ValuesAndIndicesEveryShapeAndDim) {
  using T = TypeParam;
  unsigned seed = 200;
  for (const Shape& s : shapes()) {
    // A spread of 2 (and bool) makes ties frequent: the later-index rule is exercised everywhere.
    auto x = data<T>(s.numel(), ++seed, 2);
    if constexpr (lazy::is_floating_v<T>) {
      for (auto& v : x) v = static_cast<T>(std::round(num(v)));  // ties among floats too
    }
    const auto xt = lazy::from_vector<T>(x, s);
    for (int d : dims_of(s)) {
      for (bool max : {true, false}) {
        std::vector<T> want_v;
        std::vector<i64> want_i;
        ref_extreme(x, s, d, max, want_v, want_i);
        auto [v, i] = max ? lazy::cummax(xt, d) : lazy::cummin(xt, d);
        expect_equal(v, s, want_v, label(max ? "cummax values" : "cummin values", s, d));
        expect_equal(i, s, want_i, label(max ? "cummax indices" : "cummin indices", s, d));
      }
    }
  }
}

TYPED_TEST(Cumsum, ZeroDimReturnsTheInput) {
  using T = TypeParam;
  const T v = data<T>(1, 7)[0];
  const auto x = lazy::from_vector<T>({v}, Shape{});
  for (int d : {0, -1}) {
    expect_equal(lazy::cumsum(x, d), Shape{}, std::vector<result_t<T>>{from_acc<T>(to_acc(v))}, "cumsum 0-d");
    expect_equal(lazy::cumprod(x, d), Shape{}, std::vector<result_t<T>>{from_acc<T>(to_acc(v))}, "cumprod 0-d");
    auto [mv, mi] = lazy::cummax(x, d);
    expect_equal(mv, Shape{}, std::vector<T>{v}, "cummax 0-d");
    expect_equal(mi, Shape{}, std::vector<i64>{0}, "cummax 0-d index");
    auto [nv, ni] = lazy::cummin(x, d);
    expect_equal(nv, Shape{}, std::vector<T>{v}, "cummin 0-d");
    expect_equal(ni, Shape{}, std::vector<i64>{0}, "cummin 0-d index");
  }
  EXPECT_THROW(lazy::cumsum(x, 1), lazy::ShapeError);
  EXPECT_THROW(lazy::cummax(x, -2), lazy::ShapeError);
}

TYPED_TEST(Cumsum, ManyThreadsAboveTheParallelThreshold) {
  using T = TypeParam;
  lazy_tests::ThreadsGuard threads(4);
  for (const Shape& s : {Shape{2, 300, 400}, Shape{700, 300}}) {
    const auto x = data<T>(s.numel(), 11, 5, 0.9, 1.1);
    const auto xt = lazy::from_vector<T>(x, s);
    for (int d = 0; d < s.rank(); ++d) {
      expect_equal(lazy::cumsum(xt, d), s, ref_scan(x, s, d, Kind::Sum), label("cumsum", s, d));
      expect_equal(lazy::cumprod(xt, d), s, ref_scan(x, s, d, Kind::Prod), label("cumprod", s, d));
      std::vector<T> want_v;
      std::vector<i64> want_i;
      ref_extreme(x, s, d, true, want_v, want_i);
      auto [v, i] = lazy::cummax(xt, d);
      expect_equal(v, s, want_v, label("cummax values", s, d));
      expect_equal(i, s, want_i, label("cummax indices", s, d));
    }
  }
}

// ---- dtype rules ---------------------------------------------------------------------------

TEST(Cumsum, Int64WrapsAroundLikeTwosComplement) {
  constexpr i64 kMax = std::numeric_limits<i64>::max(), kMin = std::numeric_limits<i64>::min();
  expect_equal(lazy::cumsum(lazy::from_vector<i64>({kMax, 1, 1}), 0), Shape{3}, {kMax, kMin, kMin + 1}, "up");
  expect_equal(lazy::cumsum(lazy::from_vector<i64>({kMin, -1}), 0), Shape{2}, {kMin, kMax}, "down");
  // Strided (dim 0 of a column) takes the same path through uint64.
  expect_equal(lazy::cumsum(lazy::from_vector<i64>({kMax, 5, 1, 6}, Shape{2, 2}), 0), Shape{2, 2},
               {kMax, 5, kMin, 11}, "strided");
}

TEST(Cumsum, IntegersAndBoolPromoteToInt64) {
  // int32 totals past 2^31 are exact in the int64 result: no wrap at int32.
  constexpr std::int32_t kMax32 = std::numeric_limits<std::int32_t>::max();
  expect_equal(lazy::cumsum(lazy::from_vector<std::int32_t>({kMax32, kMax32, 2}), 0), Shape{3},
               {i64{kMax32}, 2 * i64{kMax32}, 2 * i64{kMax32} + 2}, "int32");
  expect_equal(lazy::cumsum(lazy::from_vector<std::int32_t>({-5, -6}), 0), Shape{2}, {-5, -11}, "negative int32");
  expect_equal(lazy::cumsum(lazy::from_vector<bool>({true, false, true, true}), 0), Shape{4}, {1, 1, 2, 3}, "bool");
  expect_equal(lazy::cumprod(lazy::from_vector<bool>({true, true, false, true}), 0), Shape{4}, {1, 1, 0, 0},
               "bool product");
}

TEST(Cumprod, Int64WrapsAroundLikeTwosComplement) {
  constexpr i64 kMax = std::numeric_limits<i64>::max();
  // 2^62 * 4 = 2^64 = 0 mod 2^64; (2^63 - 1) * 2 = 2^64 - 2 = -2.
  expect_equal(lazy::cumprod(lazy::from_vector<i64>({i64{1} << 62, 4, 3}), 0), Shape{3}, {i64{1} << 62, 0, 0},
               "to zero");
  expect_equal(lazy::cumprod(lazy::from_vector<i64>({kMax, 2, -3}), 0), Shape{3}, {kMax, -2, 6}, "to -2");
  // (-3)^41 overflows int64: the reference multiplies in uint64 too.
  const std::vector<std::int32_t> x(41, -3);
  std::uint64_t p = 1;
  std::vector<i64> want;
  for (int k = 0; k < 41; ++k) want.push_back(static_cast<i64>(p *= static_cast<std::uint64_t>(i64{-3})));
  expect_equal(lazy::cumprod(lazy::from_vector<std::int32_t>(x), 0), Shape{41}, want, "(-3)^k");
  EXPECT_EQ(want[37], 1350851717672992089) << "(-3)^38 = 3^38, still exact";  // (the reference itself)
}

TEST(Cumsum, BFloat16SumsInFloatAndRoundsEachOutput) {
  // The running total is float (256, 257, 258, 259, 260); each output rounds it to the
  // bfloat16 grid (spacing 2 above 256, ties to even): 257 -> 256, 259 -> 260. Summing in
  // bfloat16 would stay at 256 forever (256 + 1 rounds back to 256).
  const std::vector<bf16> x = {bf16(256.0f), bf16(1.0f), bf16(1.0f), bf16(1.0f), bf16(1.0f)};
  const std::vector<bf16> want = {bf16(256.0f), bf16(256.0f), bf16(258.0f), bf16(260.0f), bf16(260.0f)};
  expect_equal(lazy::cumsum(lazy::from_vector<bf16>(x), 0), Shape{5}, want, "rows");
  // The same along a strided dim (two identical columns).
  std::vector<bf16> x2, want2;
  for (std::size_t i = 0; i < x.size(); ++i) x2.insert(x2.end(), {x[i], x[i]}), want2.insert(want2.end(), {want[i], want[i]});
  expect_equal(lazy::cumsum(lazy::from_vector<bf16>(x2, Shape{5, 2}), 0), Shape{5, 2}, want2, "strided");
}

TEST(Cumprod, BFloat16MultipliesInFloatAndRoundsEachOutput) {
  // 3^6 = 729 rounds to 728 (spacing 4); 3^7 = 2187 is computed from the float 729, not from
  // 728, and rounds to 2192 (spacing 16). A bfloat16 accumulator would give 728 * 3 = 2184,
  // a tie, rounded to even: 2176.
  const std::vector<bf16> x(7, bf16(3.0f));
  const std::vector<bf16> want = {bf16(3.0f),   bf16(9.0f),   bf16(27.0f),  bf16(81.0f),
                                  bf16(243.0f), bf16(728.0f), bf16(2192.0f)};
  expect_equal(lazy::cumprod(lazy::from_vector<bf16>(x), 0), Shape{7}, want, "rows");
  expect_equal(lazy::cumprod(lazy::from_vector<bf16>(x, Shape{7, 1}), 0), Shape{7, 1}, want, "column");
}

TEST(Cumsum, FloatAccumulatesInDoubleAsTorchCpu) {
  // 1 + 3e-8 is 1 in float (half an ulp of 1 is 5.96e-8); in double the sum reaches 1 + 6e-8,
  // which rounds up to the next float.
  const std::vector<float> x = {1.0f, 3e-8f, 3e-8f};
  const float up = std::nextafter(1.0f, 2.0f);
  expect_equal(lazy::cumsum(lazy::from_vector<float>(x), 0), Shape{3}, {1.0f, 1.0f, up}, "rows");
  expect_equal(lazy::cumsum(lazy::from_vector<float>(x, Shape{3, 1}), 0), Shape{3, 1}, {1.0f, 1.0f, up}, "column");
}

TEST(Cumsum, DtypeArgumentConvertsFirst) {
  const std::vector<float> xf = {0.1f, 0.2f, 0.3f};
  std::vector<double> want;
  double acc = 0;
  for (float v : xf) want.push_back(acc += static_cast<double>(v));
  expect_equal(lazy::cumsum<double>(lazy::from_vector<float>(xf), 0), Shape{3}, want, "float as double");
  // An int32 result wraps at 32 bits, as a cast of the int64 input to int32 first would.
  constexpr std::int32_t kMax32 = std::numeric_limits<std::int32_t>::max();
  expect_equal(lazy::cumsum<std::int32_t>(lazy::from_vector<i64>({kMax32, 1, (i64{1} << 32) + 2}), 0), Shape{3},
               std::vector<std::int32_t>{kMax32, std::numeric_limits<std::int32_t>::min(),
                                         std::numeric_limits<std::int32_t>::min() + 2},
               "int64 as int32");
  expect_equal(lazy::cumprod<float>(lazy::from_vector<std::int32_t>({2, 3, 4}), 0), Shape{3}, {2.0f, 6.0f, 24.0f},
               "int32 as float");
  // The gradient flows back through the conversion: d/dx of sum(cumsum(x)) is [3, 2, 1].
  auto xg = lazy::from_vector<float>(xf).requires_grad_();
  lazy::cumsum<double>(xg, 0).backward(lazy::from_vector<double>({1, 1, 1}));
  expect_equal(xg.grad(), Shape{3}, {3.0f, 2.0f, 1.0f}, "gradient through the dtype");
  // Naming the input's own type changes nothing.
  expect_equal(lazy::cumsum<float>(lazy::from_vector<float>(xf), 0), Shape{3},
               lazy::cumsum(lazy::from_vector<float>(xf), 0).to_vector(), "same type");
}

// ---- expressions, in-place reuse ---------------------------------------------------------

TEST(Cumsum, ExpressionInputs) {
  const Shape s{3, 4};
  const auto a = data<float>(12, 5), b = data<float>(12, 6);
  const auto at = lazy::from_vector<float>(a, s), bt = lazy::from_vector<float>(b, s);
  std::vector<float> twice(12), sum(12);
  for (int i = 0; i < 12; ++i) twice[i] = a[i] * 2, sum[i] = a[i] + b[i];
  expect_equal(lazy::cumsum(at * 2.0f, 0), s, ref_scan(twice, s, 0, Kind::Sum), "cumsum(a * 2, 0)");
  expect_equal(lazy::cumprod(at + bt, -1), s, ref_scan(sum, s, 1, Kind::Prod), "cumprod(a + b, -1)");
  std::vector<float> want_v;
  std::vector<i64> want_i;
  ref_extreme(sum, s, 0, false, want_v, want_i);
  auto [v, i] = lazy::cummin(at + bt, 0);
  expect_equal(v, s, want_v, "cummin(a + b, 0)");
  expect_equal(i, s, want_i, "cummin(a + b, 0) indices");
  // An integer expression promotes like an integer tensor.
  const auto k = lazy::from_vector<std::int32_t>({1, 2, 3});
  Tensor<i64> c = lazy::cumsum(k * 3, 0);
  expect_equal(c, Shape{3}, {3, 9, 18}, "cumsum(k * 3, 0)");
}

TEST(Cumsum, InputKeptByTheCallerIsUnchanged) {
  // The kernels may write into a donated input buffer; one the caller still holds never is.
  const auto x = data<double>(24, 9);
  const auto xt = lazy::from_vector<double>(x, Shape{2, 3, 4});
  auto y = lazy::cumsum(xt, 1);
  auto p = lazy::cumprod(xt * 1.0, 2);  // a temporary the scan may take over
  auto [m, i] = lazy::cummax(xt * 1.0, 0);
  lazy::mark_step();
  expect_equal(xt, Shape{2, 3, 4}, x, "input");
  expect_equal(y, Shape{2, 3, 4}, ref_scan(x, Shape{2, 3, 4}, 1, Kind::Sum), "cumsum");
  expect_equal(p, Shape{2, 3, 4}, ref_scan(x, Shape{2, 3, 4}, 2, Kind::Prod), "cumprod of a temporary");
  std::vector<double> want_v;
  std::vector<i64> want_i;
  ref_extreme(x, Shape{2, 3, 4}, 0, true, want_v, want_i);
  expect_equal(m, Shape{2, 3, 4}, want_v, "cummax of a temporary");
  expect_equal(i, Shape{2, 3, 4}, want_i, "cummax indices of a temporary");
}

// ---- cummax / cummin rules ------------------------------------------------------------------

TEST(Cummax, TiesTakeTheLaterIndex) {
  const auto x = lazy::from_vector<float>({1, 3, 3, 2, 3});
  auto [v, i] = lazy::cummax(x, 0);
  expect_equal(v, Shape{5}, {1, 3, 3, 3, 3}, "values");
  expect_equal(i, Shape{5}, {0, 1, 2, 2, 4}, "indices");
  auto [nv, ni] = lazy::cummin(lazy::from_vector<std::int32_t>({2, 1, 1, 2, 1}), 0);
  expect_equal(nv, Shape{5}, std::vector<std::int32_t>{2, 1, 1, 1, 1}, "cummin values");
  expect_equal(ni, Shape{5}, {0, 1, 2, 2, 4}, "cummin indices");
  // -0.0 == 0.0: a tie, so -0.0 takes over (value and index).
  auto [zv, zi] = lazy::cummax(lazy::from_vector<double>({0.0, -0.0}), 0);
  expect_equal(zv, Shape{2}, {0.0, -0.0}, "signed zero");
  expect_equal(zi, Shape{2}, {0, 1}, "signed zero index");
  // bool: every equal element takes over.
  auto [bv, bi] = lazy::cummax(lazy::from_vector<bool>({false, false, true, false, true}), 0);
  expect_equal(bv, Shape{5}, std::vector<bool>{false, false, true, true, true}, "bool values");
  expect_equal(bi, Shape{5}, {0, 1, 2, 2, 4}, "bool indices");
  // Large int64 values that doubles could not tell apart.
  constexpr i64 kMax = std::numeric_limits<i64>::max();
  auto [lv, li] = lazy::cummax(lazy::from_vector<i64>({kMax - 1, kMax, kMax - 1}), 0);
  expect_equal(lv, Shape{3}, {kMax - 1, kMax, kMax}, "int64 values");
  expect_equal(li, Shape{3}, {0, 1, 1}, "int64 indices");
}

TEST(Cummax, NaNPropagatesAndTheLatestNaNIsReported) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  for (bool max : {true, false}) {
    const std::vector<double> x = {1, nan, 5, nan, 0};
    auto [v, i] = max ? lazy::cummax(lazy::from_vector<double>(x), 0) : lazy::cummin(lazy::from_vector<double>(x), 0);
    expect_equal(v, Shape{5}, {1, nan, nan, nan, nan}, "values");
    expect_equal(i, Shape{5}, {0, 1, 1, 3, 3}, "indices");
    auto [fv, fi] = max ? lazy::cummax(lazy::from_vector<bf16>({bf16(nan), bf16(2.0f)}), 0)
                        : lazy::cummin(lazy::from_vector<bf16>({bf16(nan), bf16(2.0f)}), 0);
    expect_equal(fv, Shape{2}, {bf16(nan), bf16(nan)}, "leading NaN");
    expect_equal(fi, Shape{2}, {0, 0}, "leading NaN index");
    // Strided: column 0 meets a NaN at row 1, column 1 never does.
    const Shape s{3, 2};
    const std::vector<float> xs = {1, 4, static_cast<float>(nan), 2, 3, 9};
    auto [sv, si] = max ? lazy::cummax(lazy::from_vector<float>(xs, s), 0) : lazy::cummin(lazy::from_vector<float>(xs, s), 0);
    const float nf = static_cast<float>(nan);
    expect_equal(sv, s, max ? std::vector<float>{1, 4, nf, 4, nf, 9} : std::vector<float>{1, 4, nf, 2, nf, 2},
                 "strided values");
    expect_equal(si, s, max ? std::vector<i64>{0, 0, 1, 0, 1, 2} : std::vector<i64>{0, 0, 1, 1, 1, 1},
                 "strided indices");
  }
}

// ---- gradients --------------------------------------------------------------------------

TEST(Cumsum, GradientMatchesFiniteDifferences) {
  for (const Shape& s : {Shape{}, Shape{5}, Shape{3, 4}, Shape{2, 3, 4}, Shape{1, 4, 1}}) {
    for (int d : dims_of(s)) {
      gradcheck::check(label("cumsum", s, d), [d](const auto& xs) { return lazy::cumsum(xs[0], d); },
                       {gradcheck::input(s, 3)});
      gradcheck::check(label("cumsum of expression", s, d),
                       [d](const auto& xs) { return lazy::cumsum(xs[0] * xs[0], d); }, {gradcheck::input(s, 4)});
    }
  }
}

TEST(Cumsum, GradientIsTheReversedCumsumOnWideInputs) {
  // Inner sizes past the kernel's widest chunk (4096 columns), every dim, against the
  // reverse scan; threads, so that the parallel chunking runs too.
  lazy_tests::ThreadsGuard threads(3);
  for (const Shape& s : {Shape{3, 2, 4200}, Shape{600, 3}, Shape{40, 30, 400}}) {
    for (int d = 0; d < s.rank(); ++d) {
      auto x = lazy::from_vector<double>(data<double>(s.numel(), 21), s).requires_grad_();
      const auto w = data<double>(s.numel(), 22);
      lazy::cumsum(x, d).backward(lazy::from_vector<double>(w, s));
      expect_near(x.grad().to_vector(), ref_scan(w, s, d, Kind::Sum, /*reverse=*/true), 1e-12, label("dx", s, d));
    }
  }
  // bfloat16: the gradient is a bfloat16 reverse scan with float accumulation.
  auto xb = lazy::from_vector<bf16>(data<bf16>(12, 23), Shape{3, 4}).requires_grad_();
  const auto wb = data<bf16>(12, 24);
  lazy::cumsum(xb, 0).backward(lazy::from_vector<bf16>(wb, Shape{3, 4}));
  expect_equal(xb.grad(), Shape{3, 4}, ref_scan(wb, Shape{3, 4}, 0, Kind::Sum, true), "bf16 dx");
}

TEST(Cumprod, GradientMatchesFiniteDifferences) {
  for (const Shape& s : {Shape{}, Shape{6}, Shape{3, 4}, Shape{2, 3, 4}, Shape{2, 2, 260}}) {
    for (int d : dims_of(s)) {
      if (s.numel() > 100 && d != 1) continue;  // the wide shape: its strided dim is enough here
      gradcheck::check(label("cumprod", s, d), [d](const auto& xs) { return lazy::cumprod(xs[0], d); },
                       {gradcheck::input(s, 7, 0.5, 1.5)});
    }
  }
  // cumprod is a polynomial: finite differences stay valid across zeros.
  gradcheck::check("cumprod with zeros", [](const auto& xs) { return lazy::cumprod(xs[0], 1); },
                   {gradcheck::Input{Shape{2, 5}, {2, 0, 3, 0, 5, 0, 0, 1.5, -2, 0.5}}});
  gradcheck::check("cumprod of expression", [](const auto& xs) { return lazy::cumprod(xs[0] + xs[1], 0); },
                   {gradcheck::input(Shape{4, 3}, 8, 0.5, 1.5), gradcheck::input(Shape{4, 3}, 9, -0.2, 0.2)});
}

TEST(Cumprod, GradientIsExactWithZeros) {
  auto grad_of = [](const std::vector<double>& x, const std::vector<double>& g, const Shape& s, int d) {
    auto xt = lazy::from_vector<double>(x, s).requires_grad_();
    lazy::cumprod(xt, d).backward(lazy::from_vector<double>(g, s));
    return xt.grad().to_vector();
  };
  // By hand, y = [2, 0, 0, 0]: dx0 = g0 + x1 (...) = 1; dx1 = g1 x0 + g2 x0 x2 + g3 x0 x2 x3 =
  // 2*2 + 3*6 + 4*24 = 118; dx2 and dx3 carry the factor x1 = 0.
  EXPECT_EQ(grad_of({2, 0, 3, 4}, {1, 2, 3, 4}, Shape{4}, 0), (std::vector<double>{1, 118, 0, 0}));
  // Two zeros in a row: dx1 = g1 x0 = 2 (every later term holds x2 = 0); dx2 = 0 (x1).
  EXPECT_EQ(grad_of({2, 0, 0, 3}, {1, 1, 1, 1}, Shape{4}, 0), (std::vector<double>{1, 2, 0, 0}));
  // Two zeros apart: dx1 = g1 x0 + g2 x0 x2 = 2 + 6 = 8; everything past the second is 0.
  EXPECT_EQ(grad_of({2, 0, 3, 0, 5}, {1, 1, 1, 1, 1}, Shape{5}, 0), (std::vector<double>{1, 8, 0, 0, 0}));
  // A leading zero: dx0 = g0 + g1 x1 + g2 x1 x2 = 1 + 2 + 6 = 9.
  EXPECT_EQ(grad_of({0, 2, 3}, {1, 1, 1}, Shape{3}, 0), (std::vector<double>{9, 0, 0}));
  // Against the product rule term by term: rows and strided, one zero and two, several lines.
  const Shape s{3, 5, 4};
  std::vector<double> x = data<double>(s.numel(), 31, 0, 0.5, 1.5), g = data<double>(s.numel(), 32);
  for (i64 k : {0, 7, 13, 14, 22, 26, 41, 42, 59}) x[static_cast<std::size_t>(k)] = 0;
  for (int d : {0, 1, 2, -1}) {
    expect_near(grad_of(x, g, s, d), ref_cumprod_grad(x, g, s, d), 1e-12, label("dx with zeros", s, d));
  }
  // Wide and large: several chunks of columns, several tasks.
  lazy_tests::ThreadsGuard threads(3);
  // (Short scanned dims: the term-by-term reference costs extent^3 per line.)
  for (const auto& [w, d] : {std::pair{Shape{3, 4100}, 0}, std::pair{Shape{4, 300, 300}, 0},
                             std::pair{Shape{40, 30, 200}, 1}, std::pair{Shape{2000, 40}, 1}}) {
    std::vector<double> xw = data<double>(w.numel(), 33, 0, 0.5, 1.5), gw = data<double>(w.numel(), 34);
    for (std::size_t k = 0; k < xw.size(); k += 7) xw[k] = 0;
    expect_near(grad_of(xw, gw, w, d), ref_cumprod_grad(xw, gw, w, d), 1e-12, label("dx with zeros", w, d));
  }
  // float: the same within float rounding, through the double-accumulating kernel.
  std::vector<float> xf(x.begin(), x.end()), gf(g.begin(), g.end());
  auto xt = lazy::from_vector<float>(xf, s).requires_grad_();
  lazy::cumprod(xt, 1).backward(lazy::from_vector<float>(gf, s));
  const auto got = xt.grad().to_vector();
  expect_near(std::vector<double>(got.begin(), got.end()),
              ref_cumprod_grad(std::vector<double>(xf.begin(), xf.end()), std::vector<double>(gf.begin(), gf.end()), s, 1),
              1e-4, "float dx with zeros");
}

TEST(Cummax, GradientGoesToTheReportedIndices) {
  // x = [1, 3, 2, 5, 4]: indices [0, 1, 1, 3, 3], so dx = [w0, w1 + w2, 0, w3 + w4, 0].
  auto x = lazy::from_vector<double>({1, 3, 2, 5, 4}).requires_grad_();
  std::get<0>(lazy::cummax(x, 0)).backward(lazy::from_vector<double>({1, 10, 100, 1000, 10000}));
  EXPECT_EQ(x.grad().to_vector(), (std::vector<double>{1, 110, 0, 11000, 0}));
  // Ties: the later element receives the gradient from its position on.
  auto t = lazy::from_vector<double>({2, 2, 1}).requires_grad_();
  std::get<0>(lazy::cummax(t, 0)).backward(lazy::from_vector<double>({1, 10, 100}));
  EXPECT_EQ(t.grad().to_vector(), (std::vector<double>{1, 110, 0}));
  // Against a scatter of w at the reference indices, every dim, both ops.
  const Shape s{3, 4, 5};
  const auto xv = data<double>(s.numel(), 41), w = data<double>(s.numel(), 42);
  for (int d : {0, 1, 2, -2}) {
    for (bool max : {true, false}) {
      auto xt = lazy::from_vector<double>(xv, s).requires_grad_();
      auto [v, i] = max ? lazy::cummax(xt, d) : lazy::cummin(xt, d);
      v.backward(lazy::from_vector<double>(w, s));
      std::vector<double> ignored_v;
      std::vector<i64> idx;
      ref_extreme(xv, s, d, max, ignored_v, idx);
      std::vector<double> want(xv.size(), 0.0);
      for_each_line(s, d, [&](i64 start, i64 stride, i64 n) {
        for (i64 k = 0; k < n; ++k) want[start + idx[start + k * stride] * stride] += w[start + k * stride];
      });
      expect_near(xt.grad().to_vector(), want, 1e-12, label(max ? "cummax dx" : "cummin dx", s, d));
    }
  }
  gradcheck::check("cummax", [](const auto& xs) { return std::get<0>(lazy::cummax(xs[0], 1)); },
                   {gradcheck::input(Shape{3, 6}, 43)});
  gradcheck::check("cummin of expression", [](const auto& xs) { return std::get<0>(lazy::cummin(xs[0] * 3.0, 0)); },
                   {gradcheck::input(Shape{6, 2}, 44)});
}

TEST(Cumsum, GradientOfEmptyAndZeroDim) {
  auto e = lazy::from_vector<double>({}, Shape{0, 3}).requires_grad_();
  lazy::cumsum(e, 0).backward(lazy::from_vector<double>({}, Shape{0, 3}));
  EXPECT_EQ(e.grad().shape(), (Shape{0, 3}));
  auto p = lazy::from_vector<double>({}, Shape{2, 0}).requires_grad_();
  lazy::cumprod(p, 1).backward(lazy::from_vector<double>({}, Shape{2, 0}));
  EXPECT_EQ(p.grad().shape(), (Shape{2, 0}));
  auto z = lazy::from_vector<double>({3.0}, Shape{}).requires_grad_();
  lazy::cumprod(z, -1).backward(lazy::from_vector<double>({2.0}, Shape{}));
  EXPECT_EQ(z.grad().to_vector(), std::vector<double>{2.0});
  auto m = lazy::from_vector<double>({3.0}, Shape{}).requires_grad_();
  std::get<0>(lazy::cummin(m, 0)).backward(lazy::from_vector<double>({5.0}, Shape{}));
  EXPECT_EQ(m.grad().to_vector(), std::vector<double>{5.0});
}

// ---- errors --------------------------------------------------------------------------------

TEST(Cumsum, DimOutOfRangeNamesTheOpAndTheRange) {
  const auto x = lazy::from_vector<float>(data<float>(6, 1), Shape{2, 3});
  auto message_of = [](auto&& f) -> std::string {
    try {
      f();
    } catch (const lazy::ShapeError& e) {
      return e.what();
    }
    return "(no ShapeError)";
  };
  const std::string m = message_of([&] { (void)lazy::cumsum(x, 2); });
  EXPECT_NE(m.find("cumsum"), std::string::npos) << m;
  EXPECT_NE(m.find("[-2, 1]"), std::string::npos) << m;
  EXPECT_NE(m.find("got 2"), std::string::npos) << m;
  EXPECT_NE(message_of([&] { (void)lazy::cumprod(x, -3); }).find("cumprod"), std::string::npos);
  EXPECT_NE(message_of([&] { (void)lazy::cummax(x, 5); }).find("cummax"), std::string::npos);
  EXPECT_NE(message_of([&] { (void)lazy::cummin(x * 2.0f, -4); }).find("cummin"), std::string::npos);
  EXPECT_NE(message_of([&] { (void)lazy::cumsum<double>(x, 9); }).find("cumsum"), std::string::npos);
  // An undefined tensor is a lazy::Error, not a crash.
  EXPECT_THROW(lazy::cumsum(Tensor<float>(), 0), lazy::Error);
  EXPECT_THROW(lazy::cummax(Tensor<float>(), 0), lazy::Error);
}

}  // namespace scan_ref
