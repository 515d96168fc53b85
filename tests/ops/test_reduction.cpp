// Tests of ops/reduction.hpp (and graph/reduction_node.hpp, expr/reduce_ops.hpp): every
// reduction over all elements and over dims, against an independent long double reference;
// and of ops/statistics.hpp (var, std and their _mean forms), against a two-pass one.

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include <gtest/gtest.h>

#include <lazytensor/tensor.hpp>
#include <lazytensor/ops/factories.hpp>
#include <lazytensor/ops/reduction.hpp>
#include <lazytensor/ops/shape.hpp>
#include <lazytensor/ops/statistics.hpp>

#include "../autograd/gradcheck.hpp"

namespace {

using lazy::bfloat16;
using lazy::DType;
using lazy::Shape;
using lazy::Tensor;
using Dims = std::vector<std::int64_t>;
using LD = long double;

// The work from which kernels split across threads (core/tuning.hpp): 2^18 unless the
// environment lowers it, as the sanitizer builds do for this file (tests/CMakeLists.txt), so
// that the tests below reach the threaded paths with small inputs.
std::int64_t parallel_work() { return static_cast<std::int64_t>(lazy::core::tuning().parallel_work); }

template <class T>
constexpr bool is_float_v = lazy::is_floating_v<T>;

template <class T>
LD ld(T v) {
  if constexpr (std::is_same_v<T, bfloat16>) return static_cast<LD>(static_cast<float>(v));
  else return static_cast<LD>(v);
}

// ---- data -----------------------------------------------------------------------------

enum class Data { General, Prod };

/// Deterministic test data. General: floats in [-1, 1] (1/8 exact zeros), ints in [-50, 50],
/// random bools. Prod: values whose product stays representable (float: +-(1 + u/1024);
/// int: +-1 with at most ~20 twos).
template <class T>
std::vector<T> make_data(std::int64_t n, unsigned seed, Data kind = Data::General) {
  std::mt19937_64 rng(seed * 7919 + 17);
  std::uniform_real_distribution<double> u(-1, 1);
  std::vector<T> v(static_cast<std::size_t>(n));
  const std::int64_t two_every = std::max<std::int64_t>(1, n / 20);
  for (std::int64_t i = 0; i < n; ++i) {
    const double r = u(rng);
    const bool zero = (rng() % 8) == 0;
    if constexpr (std::is_same_v<T, bool>) {
      v[i] = r > 0;
    } else if constexpr (is_float_v<T>) {
      if (kind == Data::Prod) v[i] = static_cast<T>((r < 0 ? -1.0 : 1.0) * (1 + u(rng) / 1024));
      else v[i] = zero ? T(0) : static_cast<T>(r);
    } else {
      if (kind == Data::Prod) v[i] = static_cast<T>(i % two_every == 0 ? 2 : (r < 0 ? -1 : 1));
      else v[i] = zero ? T(0) : static_cast<T>(std::lround(r * 50));
    }
  }
  return v;
}

// ---- ops under test --------------------------------------------------------------------

enum class Op { Sum, Mean, Prod, Amax, Amin, Max, Min, Argmax, Argmin, Any, All, Logsumexp, Norm1, Norm2, NormInf, Norm0, Norm3 };

const char* op_name(Op op) {
  static const char* names[] = {"sum",    "mean",   "prod", "amax",      "amin",  "max",   "min",     "argmax", "argmin",
                                "any",    "all",    "logsumexp", "norm1", "norm2", "norm_inf", "norm0", "norm3"};
  return names[static_cast<int>(op)];
}

bool single_dim_op(Op op) { return op == Op::Max || op == Op::Min || op == Op::Argmax || op == Op::Argmin; }
bool is_norm(Op op) { return op >= Op::Norm1; }

/// Whether the op applies to element type T (as torch allows).
template <class T>
bool applies(Op op) {
  if (op == Op::Mean || is_norm(op)) return is_float_v<T>;
  if (op == Op::Logsumexp) return !std::is_same_v<T, bool>;
  return true;
}

/// Expected result dtype (torch's rules).
template <class T>
DType expected_dtype(Op op) {
  switch (op) {
    case Op::Sum:
    case Op::Prod: return is_float_v<T> ? lazy::dtype_of<T>() : DType::Int64;
    case Op::Argmax:
    case Op::Argmin: return DType::Int64;
    case Op::Any:
    case Op::All: return DType::Bool;
    case Op::Logsumexp: return is_float_v<T> ? lazy::dtype_of<T>() : DType::Float32;
    default: return lazy::dtype_of<T>();
  }
}

struct Got {
  Shape shape;
  DType dtype;
  std::vector<LD> v;
};

template <class U>
Got got(const Tensor<U>& t) {
  Got g{t.shape(), t.dtype, {}};
  for (auto x : t.to_vector()) g.v.push_back(ld(x));
  return g;
}

template <class T, class X>
Got run_op(Op op, const X& x, const Dims& dims, bool keepdim) {
  switch (op) {
    case Op::Sum: return got(lazy::sum(x, dims, keepdim));
    case Op::Mean:
      if constexpr (is_float_v<T>) return got(lazy::mean(x, dims, keepdim));
      else throw std::logic_error("mean of a non-float type");
    case Op::Prod: return got(lazy::prod(x, dims, keepdim));
    case Op::Amax: return got(lazy::amax(x, dims, keepdim));
    case Op::Amin: return got(lazy::amin(x, dims, keepdim));
    case Op::Max: return dims.empty() ? got(lazy::max(x)) : got(lazy::max(x, dims[0], keepdim));
    case Op::Min: return dims.empty() ? got(lazy::min(x)) : got(lazy::min(x, dims[0], keepdim));
    case Op::Argmax:
      return got(lazy::argmax(x, dims.empty() ? std::nullopt : std::optional<std::int64_t>(dims[0]), keepdim));
    case Op::Argmin:
      return got(lazy::argmin(x, dims.empty() ? std::nullopt : std::optional<std::int64_t>(dims[0]), keepdim));
    case Op::Any: return got(lazy::any(x, dims, keepdim));
    case Op::All: return got(lazy::all(x, dims, keepdim));
    case Op::Logsumexp:
      if constexpr (!std::is_same_v<T, bool>) return got(lazy::logsumexp(x, dims, keepdim));
      else throw std::logic_error("logsumexp of bool");
    default:
      if constexpr (is_float_v<T>) {
        const double p = op == Op::Norm1 ? 1 : op == Op::Norm2 ? 2 : op == Op::NormInf ? INFINITY : op == Op::Norm0 ? 0 : 3;
        return got(lazy::norm(x, p, dims, keepdim));
      } else {
        throw std::logic_error("norm of a non-float type");
      }
  }
}

// ---- the reference ---------------------------------------------------------------------

struct Ref {
  Shape shape;
  std::vector<LD> v;    ///< expected values
  std::vector<LD> mag;  ///< sum of |terms| (for the rounding tolerance)
  std::int64_t n = 0;   ///< elements per output
};

/// Independent reference: normalizes dims itself, walks the input in row-major order and
/// accumulates in long double. `dims` empty means all. `flat_index`: argmax over all
/// elements reports the flat index.
Ref reference(Op op, const std::vector<LD>& x, const Shape& s, const Dims& dims, bool keepdim) {
  const int r = s.rank();
  std::vector<char> red(static_cast<std::size_t>(r), dims.empty() ? 1 : 0);
  if (r > 0)
    for (auto d : dims) red[static_cast<std::size_t>(d < 0 ? d + r : d)] = 1;
  std::vector<std::int64_t> out_dims;
  std::int64_t n = 1;
  for (int i = 0; i < r; ++i) {
    if (!red[i]) out_dims.push_back(s[i]);
    else {
      n *= s[i];
      if (keepdim) out_dims.push_back(1);
    }
  }
  Ref R;
  R.shape = Shape(out_dims);
  R.n = n;
  std::int64_t out_n = 1;
  for (int i = 0; i < r; ++i)
    if (!red[i]) out_n *= s[i];
  const std::size_t on = static_cast<std::size_t>(out_n);
  std::vector<LD> acc(on), mag(on, 0), best(on);
  std::vector<std::int64_t> best_i(on, 0);
  std::vector<char> seen(on, 0);
  const LD inf = std::numeric_limits<LD>::infinity();
  auto init = [&](LD v) { std::fill(acc.begin(), acc.end(), v); };
  switch (op) {
    case Op::Prod: init(1); break;
    case Op::Amax: case Op::Max: case Op::NormInf: init(-inf); break;
    case Op::Amin: case Op::Min: init(inf); break;
    case Op::All: init(1); break;
    default: init(0);
  }
  std::vector<LD> shift(on, 0);
  // Walks the input in row-major order, calling f(element, output index, position within
  // its reduction).
  auto walk = [&](auto f) {
    std::vector<std::int64_t> idx(static_cast<std::size_t>(r), 0);
    for (std::size_t e = 0; e < x.size(); ++e) {
      std::int64_t o = 0, p = 0;
      for (int i = 0; i < r; ++i) {
        if (red[i]) p = p * s[i] + idx[i];
        else o = o * s[i] + idx[i];
      }
      f(e, static_cast<std::size_t>(o), p);
      for (int i = r - 1; i >= 0; --i) {
        if (++idx[i] < s[i]) break;
        idx[i] = 0;
      }
    }
  };
  if (op == Op::Logsumexp) {
    std::vector<LD> m(on, -inf);
    walk([&](std::size_t e, std::size_t o, std::int64_t) { m[o] = std::max(m[o], x[e]); });
    for (std::size_t o = 0; o < on; ++o) shift[o] = std::isinf(m[o]) ? 0 : m[o];
  }
  walk([&](std::size_t e, std::size_t o, std::int64_t pos) {
    const LD v = x[e];
    switch (op) {
      case Op::Sum: case Op::Mean: acc[o] += v; mag[o] += std::fabs(v); break;
      case Op::Prod: acc[o] *= v; break;
      case Op::Amax: case Op::Max:
        if (std::isnan(acc[o]) || std::isnan(v)) acc[o] = NAN;
        else acc[o] = std::max(acc[o], v);
        break;
      case Op::Amin: case Op::Min:
        if (std::isnan(acc[o]) || std::isnan(v)) acc[o] = NAN;
        else acc[o] = std::min(acc[o], v);
        break;
      case Op::Argmax: case Op::Argmin: {
        const bool better = !seen[o] || (!std::isnan(best[o]) && (std::isnan(v) || (op == Op::Argmax ? v > best[o] : v < best[o])));
        if (better) {
          best[o] = v;
          best_i[o] = pos;
          seen[o] = 1;
        }
        break;
      }
      case Op::Any: acc[o] = (acc[o] != 0 || v != 0) ? 1 : 0; break;
      case Op::All: acc[o] = (acc[o] != 0 && v != 0) ? 1 : 0; break;
      case Op::Logsumexp: {  // exp in double (1 ulp): plenty for a float or double result, and fast
        const LD t = std::exp(static_cast<double>(v - shift[o]));
        acc[o] += t;
        mag[o] += t;
        break;
      }
      case Op::Norm1: acc[o] += std::fabs(v); break;
      case Op::Norm2: acc[o] += v * v; break;
      case Op::NormInf: acc[o] = std::max(acc[o], std::fabs(v)); break;
      case Op::Norm0: acc[o] += (v != 0); break;
      case Op::Norm3: acc[o] += std::fabs(v) * v * v; break;
    }
  });
  R.v.resize(on);
  R.mag = mag;
  for (std::size_t o = 0; o < on; ++o) {
    switch (op) {
      case Op::Mean: R.v[o] = acc[o] / static_cast<LD>(n); R.mag[o] = mag[o] / static_cast<LD>(n); break;
      case Op::Argmax: case Op::Argmin: R.v[o] = static_cast<LD>(best_i[o]); break;
      case Op::Logsumexp: R.v[o] = std::log(acc[o]) + shift[o]; break;
      case Op::Norm2: R.v[o] = std::sqrt(acc[o]); break;
      case Op::Norm3: R.v[o] = std::cbrt(acc[o]); break;
      default: R.v[o] = acc[o];
    }
  }
  return R;
}

double eps_of(DType d) {
  switch (d) {
    case DType::Float32: return std::numeric_limits<float>::epsilon();
    case DType::Float64: return std::numeric_limits<double>::epsilon();
    case DType::BFloat16: return 1.0 / 128;
    default: return 0;
  }
}

/// Tolerance of op's result: rounding in the accumulation (sqrt(n) * eps * sum|x|) plus one
/// rounding to the output type. Exact for integer, bool, max/min and index results.
double tolerance(Op op, DType out, const Ref& r, std::size_t o) {
  if (out != DType::Float32 && out != DType::Float64 && out != DType::BFloat16) return 0;
  if (op == Op::Amax || op == Op::Amin || op == Op::Max || op == Op::Min || op == Op::NormInf) return 0;
  if (op == Op::Norm0) return out == DType::BFloat16 ? eps_of(DType::BFloat16) * static_cast<double>(r.v[o]) : 0;  // a count
  const double acc = out == DType::Float64 ? eps_of(DType::Float64) : eps_of(DType::Float32);  // bf16 accumulates in float
  const double store = out == DType::BFloat16 ? eps_of(DType::BFloat16) : 0;
  const double sq = 2 + 2 * std::sqrt(static_cast<double>(r.n));
  const double v = std::fabs(static_cast<double>(r.v[o])), m = static_cast<double>(r.mag[o]);
  switch (op) {
    case Op::Sum: case Op::Mean: return sq * acc * m + store * v;
    // A product's relative error is the sum of n roundings; 4 SIMD accumulators of long
    // chains drift more than a sum does (measured ~3 sqrt(n) eps for 1M floats near +-1).
    case Op::Prod: return 4 * sq * acc * v + store * v;
    case Op::Norm1: case Op::Norm2: return sq * acc * v + store * v;
    case Op::Norm3: return (8 + sq) * acc * v + store * v;
    case Op::Logsumexp: return acc * (8 + 4 * v + sq) + store * (v + 1);
    default: return 0;
  }
}

template <class T>
std::vector<LD> widen(const std::vector<T>& v) {
  std::vector<LD> w;
  w.reserve(v.size());
  for (auto x : v) w.push_back(ld(x));
  return w;
}

bool same_value(LD a, LD b) { return (std::isnan(a) && std::isnan(b)) || a == b; }

void compare(Op op, const Got& g, const Ref& r, DType want_dtype) {
  ASSERT_EQ(g.shape, r.shape);
  EXPECT_EQ(g.dtype, want_dtype);
  ASSERT_EQ(g.v.size(), r.v.size());
  for (std::size_t o = 0; o < g.v.size(); ++o) {
    const double tol = tolerance(op, g.dtype, r, o);
    if (tol == 0 || std::isnan(r.v[o]) || std::isinf(r.v[o])) {
      ASSERT_TRUE(same_value(g.v[o], r.v[o])) << "@" << o << ": got " << static_cast<double>(g.v[o]) << ", want "
                                              << static_cast<double>(r.v[o]);
    } else {
      ASSERT_NEAR(static_cast<double>(g.v[o]), static_cast<double>(r.v[o]), tol) << "@" << o;
    }
  }
}

/// Runs `f(dims, keepdim)` (op applied to a value of type T with values xv and shape s)
/// for keepdim false and true, and compares with the reference.
template <class T, class F>
void check_with(Op op, F f, const std::vector<LD>& xv, const Shape& s, const Dims& dims, bool both_keepdims = true) {
  const std::string what = std::string(op_name(op)) + " of " + s.str() + " over " + ::testing::PrintToString(dims) +
                           " dtype " + lazy::dtype_name(lazy::dtype_of<T>());
  Ref r = reference(op, xv, s, dims, false);
  {
    SCOPED_TRACE(what);
    compare(op, f(dims, false), r, expected_dtype<T>(op));
  }
  if (!both_keepdims) return;
  // keepdim only changes the shape: reduced dims stay as 1.
  std::vector<std::int64_t> kd;
  if (s.rank() > 0) {
    std::vector<char> red(static_cast<std::size_t>(s.rank()), dims.empty() ? 1 : 0);
    for (auto d : dims) red[static_cast<std::size_t>(d < 0 ? d + s.rank() : d)] = 1;
    for (int i = 0; i < s.rank(); ++i) kd.push_back(red[i] ? 1 : s[i]);
  }
  r.shape = Shape(kd);
  SCOPED_TRACE(what + " keepdim");
  compare(op, f(dims, true), r, expected_dtype<T>(op));
}

/// check_with for a tensor operand.
template <class T>
void check(Op op, const Tensor<T>& x, const std::vector<LD>& xv, const Shape& s, const Dims& dims,
           bool both_keepdims = true) {
  check_with<T>(op, [&](const Dims& d, bool k) { return run_op<T>(op, x, d, k); }, xv, s, dims, both_keepdims);
}

const std::vector<Op>& all_ops() {
  static const std::vector<Op> ops = {Op::Sum,    Op::Mean, Op::Prod,      Op::Amax,  Op::Amin,  Op::Max,
                                      Op::Min,    Op::Argmax, Op::Argmin,  Op::Any,   Op::All,   Op::Logsumexp,
                                      Op::Norm1,  Op::Norm2, Op::NormInf, Op::Norm0, Op::Norm3};
  return ops;
}

/// Every applicable op over all elements of x, and over each dims list, keepdim both ways.
template <class T>
void check_all_ops(const Shape& s, const std::vector<Dims>& dim_lists, unsigned seed, const std::vector<Op>& ops = all_ops(),
                   bool both_keepdims = true) {
  const auto general = make_data<T>(s.numel(), seed);
  const auto prodv = make_data<T>(s.numel(), seed + 1, Data::Prod);
  const Tensor<T> xg = lazy::from_vector(general, s), xp = lazy::from_vector(prodv, s);
  const auto wg = widen(general), wp = widen(prodv);
  for (Op op : ops) {
    if (!applies<T>(op)) continue;
    const bool p = op == Op::Prod || op == Op::Norm3;
    const Tensor<T>& x = p ? xp : xg;
    const auto& w = p ? wp : wg;
    const bool empty = s.numel() == 0;
    // Ops without an identity need a non-empty reduction.
    const bool needs_elems = op == Op::Amax || op == Op::Amin || op == Op::Max || op == Op::Min || op == Op::Argmax ||
                             op == Op::Argmin || op == Op::NormInf;
    if (!(empty && needs_elems)) {
      // max(x) / min(x) over everything have no keepdim form.
      check<T>(op, x, w, s, {}, both_keepdims && op != Op::Max && op != Op::Min);
    }
    for (const Dims& d : dim_lists) {
      if (single_dim_op(op) && d.size() != 1) continue;
      bool reduces_empty = false;
      if (s.rank() > 0)
        for (auto k : d) reduces_empty = reduces_empty || s[static_cast<int>(k < 0 ? k + s.rank() : k)] == 0;
      if (needs_elems && reduces_empty) continue;
      check<T>(op, x, w, s, d, both_keepdims);
    }
  }
}

template <class T>
class ReductionTyped : public ::testing::Test {};
using AllTypes = ::testing::Types<float, double, std::int32_t, std::int64_t, bool, bfloat16>;
TYPED_TEST_SUITE(ReductionTyped, AllTypes);

TYPED_TEST(ReductionTyped, AllElementsSmallSizes) {
  using T = TypeParam;
  for (std::int64_t n : {0, 1, 2, 3, 4, 5, 6, 7, 8, 15, 16, 17, 31, 33, 127, 128, 129, 4095, 4096, 4097, 8193}) {
    check_all_ops<T>(Shape{n}, {{0}, {-1}}, static_cast<unsigned>(n) + 1);
  }
  // 0-d tensors: a reduction over nothing (or over dim 0 / -1, which a 0-d tensor accepts).
  check_all_ops<T>(Shape{}, {{0}, {-1}}, 5);
}

TYPED_TEST(ReductionTyped, AllElementsAboveThreadingThreshold) {
  using T = TypeParam;
  // 4x the threshold (2^20 by default), and never fewer than 16 blocks (kReduceBlock).
  const std::int64_t n = std::max<std::int64_t>(4 * parallel_work(), 16 * lazy::graph::kReduceBlock) + 3;
  check_all_ops<T>(Shape{n}, {}, 11,
                   {Op::Sum, Op::Mean, Op::Prod, Op::Amax, Op::Amin, Op::Argmax, Op::Argmin, Op::Any, Op::All,
                    Op::Logsumexp, Op::Norm2, Op::NormInf, Op::Norm0},
                   /*both_keepdims=*/false);
}

TYPED_TEST(ReductionTyped, OverDims) {
  using T = TypeParam;
  // Single dims, adjacent groups, non-adjacent groups, negative dims.
  check_all_ops<T>(Shape{5, 7}, {{0}, {1}, {-1}, {-2}, {0, 1}, {1, 0}, {-1, 0}}, 21);
  check_all_ops<T>(Shape{5, 7, 9}, {{0}, {1}, {2}, {0, 1}, {1, 2}, {0, 2}, {2, 0}, {0, 1, 2}, {-1, -3}, {-2}}, 22);
  check_all_ops<T>(Shape{3, 4, 5, 6}, {{0, 2}, {1, 3}, {0, 3}, {1, 2}, {0, 1, 3}, {-4, -2, -1}, {3}}, 23);
  // Size-1 dims: reducing only them, or groups split by a size-1 dim (still adjacent).
  check_all_ops<T>(Shape{1, 7, 1, 5}, {{0}, {0, 2}, {1, 3}, {2, 3}, {0, 1}, {1}}, 24);
  // Widths around the SIMD batch and the column chunk (256) of the column path.
  check_all_ops<T>(Shape{3, 17, 257}, {{1}, {0, 1}, {2}}, 25);
  check_all_ops<T>(Shape{129, 127}, {{0}, {1}}, 26);
  // Empty dims.
  check_all_ops<T>(Shape{0, 5}, {{0}, {1}}, 27);
  check_all_ops<T>(Shape{5, 0}, {{0}, {1}}, 28);
  check_all_ops<T>(Shape{3, 0, 4}, {{1}, {0, 2}, {0}}, 29);
}

TYPED_TEST(ReductionTyped, OverDimsAboveThreadingThreshold) {
  using T = TypeParam;
  const std::vector<Op> ops = std::is_same_v<T, float> || std::is_same_v<T, double>
                                  ? std::vector<Op>{Op::Sum, Op::Mean, Op::Amax, Op::Argmin, Op::Logsumexp}
                                  : std::vector<Op>{Op::Sum, Op::Amin, Op::Argmax, Op::All};
  // 600 columns: more than two column blocks (kReduceColumns) for the column path's
  // tasks; rows enough for ~4.7x the threshold (2048 by default).
  const std::int64_t rows = std::max<std::int64_t>(parallel_work() / 128, 16);
  check_all_ops<T>(Shape{rows, 600}, {{0}, {1}}, 31, ops, /*both_keepdims=*/false);
  check_all_ops<T>(Shape{std::max<std::int64_t>(parallel_work() / 4096, 2), 100, 70}, {{0, 2}, {1}}, 32,
                   {Op::Sum, Op::Amax}, false);
}

// ---- dtypes --------------------------------------------------------------------------

TEST(Reduction, ResultTypes) {
  static_assert(std::is_same_v<decltype(lazy::sum(std::declval<Tensor<std::int32_t>>())), Tensor<std::int64_t>>);
  static_assert(std::is_same_v<decltype(lazy::sum(std::declval<Tensor<bool>>())), Tensor<std::int64_t>>);
  static_assert(std::is_same_v<decltype(lazy::sum(std::declval<Tensor<float>>())), Tensor<float>>);
  static_assert(std::is_same_v<decltype(lazy::sum(std::declval<Tensor<bfloat16>>())), Tensor<bfloat16>>);
  static_assert(std::is_same_v<decltype(lazy::prod(std::declval<Tensor<std::int32_t>>())), Tensor<std::int64_t>>);
  static_assert(std::is_same_v<decltype(lazy::amax(std::declval<Tensor<std::int32_t>>())), Tensor<std::int32_t>>);
  static_assert(std::is_same_v<decltype(lazy::argmax(std::declval<Tensor<double>>())), Tensor<std::int64_t>>);
  static_assert(std::is_same_v<decltype(lazy::any(std::declval<Tensor<float>>())), Tensor<bool>>);
  static_assert(std::is_same_v<decltype(lazy::mean(std::declval<Tensor<double>>())), Tensor<double>>);
  static_assert(std::is_same_v<decltype(lazy::norm(std::declval<Tensor<double>>())), Tensor<double>>);
  static_assert(std::is_same_v<decltype(lazy::logsumexp(std::declval<Tensor<std::int64_t>>())), Tensor<float>>);
  SUCCEED();
}

TEST(Reduction, IntegerSumDoesNotOverflowInt32) {
  std::vector<std::int32_t> v(1000, 2000000000);
  Tensor<std::int32_t> x = lazy::from_vector(v);
  EXPECT_EQ(lazy::sum(x).item(), 2000000000LL * 1000);
  Tensor<std::int32_t> y = lazy::from_vector(v, Shape{10, 100});
  auto s = lazy::sum(y, {1}).to_vector();
  for (auto e : s) EXPECT_EQ(e, 2000000000LL * 100);
  auto c = lazy::sum(y, {0}).to_vector();
  for (auto e : c) EXPECT_EQ(e, 2000000000LL * 10);
  // A bool sum counts.
  std::vector<bool> b(5000);
  for (std::size_t i = 0; i < b.size(); ++i) b[i] = i % 3 == 0;
  EXPECT_EQ(lazy::sum(lazy::from_vector(b)).item(), 1667);
}

// A count of a float comparison runs in the float lane; past 2^24 a float total cannot
// hold every count (2^24 + 1 rounds to 2^24), so the blocks' counts must add up in int64.
TEST(Reduction, CountsOfFloatComparisonsAreExactPast2To24) {
  const std::int64_t n = (std::int64_t{1} << 24) + 3;
  Tensor<float> x = lazy::ones<float>({n});
  EXPECT_EQ(lazy::sum(x > 0.f).item(), n);
  // Two rows of n: the rows path (a 1-D sum over dim 0 is the all-elements path).
  EXPECT_EQ(lazy::sum(lazy::ones<float>({2, n}) > 0.f, {1}).to_vector(), (std::vector<std::int64_t>{n, n}));
  // Columns: 2^24 + 3 rows of 2 columns, the second column counting every other row.
  std::vector<float> v(static_cast<std::size_t>(2 * n));
  for (std::int64_t r = 0; r < n; ++r) {
    v[static_cast<std::size_t>(2 * r)] = 1.f;
    v[static_cast<std::size_t>(2 * r + 1)] = r % 2 ? 1.f : -1.f;
  }
  auto cols = lazy::sum(lazy::from_vector(v, Shape{n, 2}) > 0.f, {0}).to_vector();
  ASSERT_EQ(cols.size(), 2u);
  EXPECT_EQ(cols[0], n);
  EXPECT_EQ(cols[1], n / 2);
  v.clear();
  v.shrink_to_fit();
  // A product of 0/1 values stays 0/1.
  EXPECT_EQ(lazy::prod(x > 0.f).item(), 1);
}

// PyTorch's integer sums and products wrap around in two's complement.
TEST(Reduction, Int64SumAndProductWrapAround) {
  const std::int64_t big = std::int64_t{1} << 62;
  Tensor<std::int64_t> x = lazy::full<std::int64_t>({5}, big);
  // 5 * 2^62 = 2^64 + 2^62 wraps to 2^62.
  EXPECT_EQ(lazy::sum(x).item(), big);
  EXPECT_EQ(lazy::sum(lazy::full<std::int64_t>({3, 5}, big), {1}).to_vector(), std::vector<std::int64_t>(3, big));
  // (2^31 + 1)^2 = 2^62 + 2^32 + 1 fits; cubed it wraps: the reference multiplies in uint64.
  const std::int64_t f = (std::int64_t{1} << 31) + 1;
  std::uint64_t ref = 1;
  for (int i = 0; i < 3; ++i) ref *= static_cast<std::uint64_t>(f);
  EXPECT_EQ(lazy::prod(lazy::full<std::int64_t>({3}, f)).item(), static_cast<std::int64_t>(ref));
}

TEST(Reduction, MeanOfIntegersIsDTypeError) {
  EXPECT_THROW(lazy::mean(lazy::ones<std::int32_t>({3})), lazy::DTypeError);
  EXPECT_THROW(lazy::mean(lazy::ones<std::int64_t>({3, 2}), {0}), lazy::DTypeError);
  EXPECT_THROW(lazy::mean(lazy::ones<bool>({3})), lazy::DTypeError);
  EXPECT_NO_THROW(lazy::mean(lazy::ones<bfloat16>({3})));
}

// ---- special values --------------------------------------------------------------------

template <class T>
class ReductionFloat : public ::testing::Test {};
using FloatTypes = ::testing::Types<float, double, bfloat16>;
TYPED_TEST_SUITE(ReductionFloat, FloatTypes);

TYPED_TEST(ReductionFloat, NaNPropagationOfAmaxAmin) {
  using T = TypeParam;
  const T nan = T(std::numeric_limits<float>::quiet_NaN());
  for (std::int64_t n : {1, 2, 7, 16, 33, 129, 5000, 70000}) {
    for (std::int64_t at : {std::int64_t{0}, n / 2, n - 1}) {
      SCOPED_TRACE(std::to_string(n) + " NaN at " + std::to_string(at));
      auto v = make_data<T>(n, 3);
      v[at] = nan;
      Tensor<T> x = lazy::from_vector(v);
      EXPECT_TRUE(std::isnan(float(lazy::amax(x).item())));
      EXPECT_TRUE(std::isnan(float(lazy::amin(x).item())));
      EXPECT_TRUE(std::isnan(float(lazy::max(x).item())));
      EXPECT_TRUE(std::isnan(float(lazy::sum(x).item())));
      EXPECT_EQ(lazy::argmax(x).item(), at);
      EXPECT_EQ(lazy::argmin(x).item(), at);
      // In a row (row path) and in a column (column path): only that slice is NaN.
      const std::int64_t cols = 3;
      std::vector<T> m(static_cast<std::size_t>(n * cols), T(1));
      for (std::int64_t i = 0; i < n; ++i) m[i * cols + 1] = v[i];
      Tensor<T> xm = lazy::from_vector(m, Shape{n, cols});
      auto cmax = lazy::amax(xm, {0}).to_vector();
      auto cmin = lazy::amin(xm, {0}).to_vector();
      EXPECT_EQ(float(cmax[0]), 1.f);
      EXPECT_TRUE(std::isnan(float(cmax[1])));
      EXPECT_TRUE(std::isnan(float(cmin[1])));
      EXPECT_EQ(float(cmin[2]), 1.f);
      EXPECT_EQ(lazy::argmax(xm, 0).to_vector()[1], at);
      Tensor<T> xt = lazy::from_vector(v, Shape{1, n});
      EXPECT_TRUE(std::isnan(float(lazy::amax(xt, {1}).item())));
      EXPECT_EQ(lazy::argmin(xt, 1).item(), at);
    }
  }
  // The first NaN wins argmax.
  Tensor<T> y = lazy::from_vector(std::vector<T>{T(1), nan, T(5), nan});
  EXPECT_EQ(lazy::argmax(y).item(), 1);
  EXPECT_EQ(lazy::argmin(y).item(), 1);
}

TYPED_TEST(ReductionFloat, Infinities) {
  using T = TypeParam;
  const float inf = std::numeric_limits<float>::infinity();
  Tensor<T> x = lazy::from_vector(std::vector<T>{T(-inf), T(-inf), T(-inf)});
  EXPECT_EQ(float(lazy::amax(x).item()), -inf);
  EXPECT_EQ(float(lazy::logsumexp(x).item()), -inf);  // not NaN
  Tensor<T> y = lazy::from_vector(std::vector<T>{T(1), T(inf), T(-2)});
  EXPECT_EQ(float(lazy::amax(y).item()), inf);
  EXPECT_EQ(float(lazy::logsumexp(y).item()), inf);
  EXPECT_EQ(lazy::argmax(y).item(), 1);
  EXPECT_EQ(float(lazy::norm(y, INFINITY).item()), inf);
  Tensor<T> z = lazy::from_vector(std::vector<T>{T(-inf), T(0), T(-inf), T(0)}, Shape{2, 2});
  auto l = lazy::logsumexp(z, {0}).to_vector();
  EXPECT_EQ(float(l[0]), -inf);
  EXPECT_NEAR(float(l[1]), std::log(2.0), 1e-2);
}

TYPED_TEST(ReductionFloat, LogsumexpLargeMagnitude) {
  using T = TypeParam;
  for (float base : {80.f, 1000.f, -1000.f}) {
    Tensor<T> x = lazy::from_vector(std::vector<T>{T(base), T(base), T(base - 1), T(base)});
    const double want = static_cast<double>(base) + std::log(3.0 + std::exp(-1.0));
    const double got = float(lazy::logsumexp(x).item());
    EXPECT_TRUE(std::isfinite(got)) << base;
    EXPECT_NEAR(got, want, std::fabs(want) * eps_of(lazy::dtype_of<T>()) + 1e-4) << base;
  }
}

TYPED_TEST(ReductionTyped, ArgmaxFirstOccurrenceOnTies) {
  using T = TypeParam;
  // All equal -> 0, along every path.
  for (std::int64_t n : {1, 5, 17, 300, 70000}) {
    Tensor<T> x = lazy::full<T>({n}, 1);
    EXPECT_EQ(lazy::argmax(x).item(), 0) << n;
    EXPECT_EQ(lazy::argmin(x).item(), 0) << n;
    Tensor<T> m = lazy::full<T>({n, 3}, 1);
    for (auto i : lazy::argmax(m, 0).to_vector()) EXPECT_EQ(i, 0);
    for (auto i : lazy::argmin(m, 1).to_vector()) EXPECT_EQ(i, 0);
  }
  // Ties between two positions -> the earlier.
  if constexpr (!std::is_same_v<T, bool>) {
    std::vector<T> v(40, T(0));
    v[3] = v[10] = v[39] = T(5);
    v[7] = v[20] = T(-5);
    Tensor<T> x = lazy::from_vector(v);
    EXPECT_EQ(lazy::argmax(x).item(), 3);
    EXPECT_EQ(lazy::argmin(x).item(), 7);
    EXPECT_EQ(lazy::argmax(x, 0).item(), 3);
    Tensor<T> c = lazy::from_vector(v, Shape{40, 1});
    EXPECT_EQ(lazy::argmax(c, 0).item(), 3);
    EXPECT_EQ(lazy::argmin(c, -2).item(), 7);
    // Over a flattened 2-D tensor: a flat index.
    Tensor<T> f = lazy::from_vector(v, Shape{4, 10});
    EXPECT_EQ(lazy::argmax(f).item(), 3);
    EXPECT_EQ(lazy::argmin(f).item(), 7);
    auto keep = lazy::argmax(f, std::nullopt, true);
    EXPECT_EQ(keep.shape(), (Shape{1, 1}));
    EXPECT_EQ(keep.item(), 3);
    auto rows = lazy::argmax(f, 1).to_vector();
    EXPECT_EQ(rows, (std::vector<std::int64_t>{3, 0, 1, 9}));  // row 2 is [-5, 0, ...]
  } else {
    Tensor<bool> x = lazy::tensor<bool>({false, true, false, true});
    EXPECT_EQ(lazy::argmax(x).item(), 1);
    EXPECT_EQ(lazy::argmin(x).item(), 0);
  }
}

TEST(Reduction, AnyAllPatterns) {
  for (std::int64_t n : {1, 2, 7, 8, 9, 33, 129, 4097, 70001}) {
    for (std::int64_t at : {std::int64_t{0}, n / 2, n - 1}) {
      SCOPED_TRACE(std::to_string(n) + " at " + std::to_string(at));
      std::vector<float> zeros(static_cast<std::size_t>(n), 0.f), ones(static_cast<std::size_t>(n), 1.f);
      zeros[at] = -0.5f;  // a single non-zero
      ones[at] = 0.f;     // a single zero
      EXPECT_TRUE(lazy::any(lazy::from_vector(zeros)).item());
      EXPECT_FALSE(lazy::all(lazy::from_vector(zeros)).item() && n > 1);
      EXPECT_FALSE(lazy::all(lazy::from_vector(ones)).item());
      EXPECT_EQ(lazy::any(lazy::from_vector(ones)).item(), n > 1);
      std::vector<std::int32_t> iz(static_cast<std::size_t>(n), 0);
      EXPECT_FALSE(lazy::any(lazy::from_vector(iz)).item());
      iz[at] = 7;
      EXPECT_TRUE(lazy::any(lazy::from_vector(iz)).item());
      EXPECT_TRUE(lazy::all(lazy::full<std::int64_t>({n}, -3)).item());
      std::vector<bool> bz(static_cast<std::size_t>(n), true);
      bz[at] = false;
      EXPECT_FALSE(lazy::all(lazy::from_vector(bz)).item());
      // NaN is non-zero.
      EXPECT_TRUE(lazy::all(lazy::full<float>({n}, std::nanf(""))).item());
    }
  }
}

// ---- empty and 0-d -------------------------------------------------------------------------

TEST(Reduction, EmptyReductions) {
  Tensor<float> e = lazy::zeros<float>({0});
  EXPECT_EQ(lazy::sum(e).item(), 0.f);
  EXPECT_EQ(lazy::prod(e).item(), 1.f);
  EXPECT_TRUE(std::isnan(lazy::mean(e).item()));  // 0 / 0, as torch
  EXPECT_FALSE(lazy::any(e).item());
  EXPECT_TRUE(lazy::all(e).item());
  EXPECT_EQ(lazy::norm(e).item(), 0.f);
  EXPECT_EQ(lazy::norm(e, 1).item(), 0.f);
  EXPECT_EQ(lazy::sum(lazy::zeros<std::int32_t>({0})).item(), 0);
  EXPECT_THROW(lazy::amax(e), lazy::ShapeError);
  EXPECT_THROW(lazy::amin(e), lazy::ShapeError);
  EXPECT_THROW(lazy::max(e), lazy::ShapeError);
  EXPECT_THROW(lazy::min(e), lazy::ShapeError);
  EXPECT_THROW(lazy::argmax(e), lazy::ShapeError);
  EXPECT_THROW(lazy::argmin(e), lazy::ShapeError);
  EXPECT_THROW(lazy::norm(e, INFINITY), lazy::ShapeError);
  // Reducing an empty dim of a tensor: sums are 0, extrema throw.
  Tensor<double> m = lazy::zeros<double>({0, 3});
  EXPECT_EQ(lazy::sum(m, {0}).to_vector(), (std::vector<double>{0, 0, 0}));
  EXPECT_EQ(lazy::prod(m, {0}).to_vector(), (std::vector<double>{1, 1, 1}));
  EXPECT_THROW(lazy::amax(m, {0}), lazy::ShapeError);
  EXPECT_THROW(lazy::argmax(m, 0), lazy::ShapeError);
  // Reducing a non-empty dim of an empty tensor is fine: the result is empty.
  EXPECT_EQ(lazy::amax(m, {1}).shape(), (Shape{0}));
  EXPECT_EQ(lazy::argmin(m, 1).shape(), (Shape{0}));
  EXPECT_EQ(lazy::amax(m, {1}, true).shape(), (Shape{0, 1}));
  // logsumexp of nothing is log(0) = -inf, as torch.logsumexp(torch.empty(0), 0).
  EXPECT_EQ(lazy::logsumexp(e).item(), -std::numeric_limits<float>::infinity());
  auto l = lazy::logsumexp(m, {0}).to_vector();
  ASSERT_EQ(l.size(), 3u);
  for (double v : l) EXPECT_EQ(v, -std::numeric_limits<double>::infinity());
}

TEST(Reduction, ZeroDim) {
  Tensor<float> s = lazy::scalar_tensor(-2.5f);
  EXPECT_EQ(lazy::sum(s).item(), -2.5f);
  EXPECT_EQ(lazy::sum(s).dim(), 0);
  EXPECT_EQ(lazy::sum(s, {0}, true).dim(), 0);
  EXPECT_EQ(lazy::mean(s, {-1}).item(), -2.5f);
  EXPECT_EQ(lazy::amax(s).item(), -2.5f);
  EXPECT_EQ(lazy::argmax(s).item(), 0);
  EXPECT_EQ(lazy::argmax(s, 0).item(), 0);
  EXPECT_EQ(lazy::argmax(s, 0, true).dim(), 0);
  EXPECT_EQ(lazy::norm(s, 1).item(), 2.5f);
  EXPECT_THROW(lazy::sum(s, {1}), lazy::ShapeError);
  EXPECT_THROW(lazy::argmax(s, 1), lazy::ShapeError);
}

TEST(Reduction, NormGradientIsZeroWhereTheNormIsZero) {
  // torch's norm_backward masks a zero norm; d sqrt(s) / ds = inf there gave 0 * inf = NaN.
  // (p < 1: each zero element's |x|^p has an infinite derivative too, masked as torch does.)
  for (double p : {2.0, 3.0, 0.5}) {
    SCOPED_TRACE(p);
    auto x = lazy::from_vector<double>({0, 0, 0, 3, -4, 0}, Shape{2, 3}).requires_grad_();
    lazy::sum(lazy::norm(x, p, {1})).backward();
    const auto g = x.grad().to_vector();
    // Row 0 (norm 0): zeros. Row 1: d/dx_i (sum |x|^p)^(1/p) = x_i |x_i|^(p-2) / n^(p-1).
    const double n = std::pow(std::pow(3.0, p) + std::pow(4.0, p), 1.0 / p);
    const std::vector<double> want = {0,
                                      0,
                                      0,
                                      3 * std::pow(3.0, p - 2) / std::pow(n, p - 1),
                                      -4 * std::pow(4.0, p - 2) / std::pow(n, p - 1),
                                      0};
    for (std::size_t i = 0; i < want.size(); ++i) EXPECT_NEAR(g[i], want[i], 1e-12) << i;
  }
  // The values themselves are unchanged, zero included.
  const auto v =
      lazy::norm(lazy::from_vector<float>({0, 0, 3, 4}, Shape{2, 2}), 2, {1}).to_vector();
  EXPECT_EQ(v, (std::vector<float>{0, 5}));
  // A negative p is not masked: a zero sum's root is +inf (|inf|^-2 = 0, 0^(-1/2) = inf).
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(lazy::norm(lazy::from_vector<float>({inf, inf}), -2).item(), inf);
  EXPECT_FLOAT_EQ(lazy::norm(lazy::from_vector<float>({3, 4}), -1).item(),
                  1.0f / (1.0f / 3 + 1.0f / 4));
}

TEST(Reduction, NormOfMinusInfinityIsTheSmallestMagnitude) {
  const auto x = lazy::from_vector<float>({3, -4, -1, 2}, Shape{2, 2});
  EXPECT_EQ(lazy::norm(x, -INFINITY).item(), 1.0f);
  EXPECT_EQ(lazy::norm(x, -INFINITY, {1}).to_vector(), (std::vector<float>{3, 1}));
}

TEST(Reduction, MaxAlongADimSendsTheGradientToTheIndexItReports) {
  // torch's max(x, dim) returns (values, indices); its backward goes to those indices
  // (the first extreme), where amax and max(x) split the gradient among ties.
  const std::vector<double> v = {1, 3, 3, 2, 2, 0};
  for (bool keepdim : {false, true}) {
    SCOPED_TRACE(keepdim);
    auto x = lazy::from_vector<double>(v, Shape{2, 3}).requires_grad_();
    lazy::sum(lazy::max(x, 1, keepdim) * 2.0).backward();
    EXPECT_EQ(x.grad().to_vector(), (std::vector<double>{0, 2, 0, 2, 0, 0}));
    auto y = lazy::from_vector<double>(v, Shape{2, 3}).requires_grad_();
    lazy::sum(lazy::min(y, 0, keepdim)).backward();  // columns (1, 2), (3, 2), (3, 0)
    EXPECT_EQ(y.grad().to_vector(), (std::vector<double>{1, 0, 0, 0, 1, 1}));
  }
  auto z = lazy::from_vector<double>(v, Shape{2, 3}).requires_grad_();
  lazy::sum(lazy::amax(z, {1})).backward();
  EXPECT_EQ(z.grad().to_vector(), (std::vector<double>{0, 0.5, 0.5, 0.5, 0.5, 0}))
      << "amax splits ties";
  // An expression operand, and a rank-0 tensor (its one element takes all).
  auto w = lazy::from_vector<double>(v, Shape{2, 3}).requires_grad_();
  lazy::sum(lazy::max(w * -1.0, 1)).backward();  // the first minimum of each row of w
  EXPECT_EQ(w.grad().to_vector(), (std::vector<double>{-1, 0, 0, 0, 0, -1}));
  auto s = lazy::scalar_tensor(2.0).requires_grad_();
  lazy::sum(lazy::max(s, 0) * 3.0).backward();
  EXPECT_EQ(s.grad().item(), 3.0);
}

// ---- errors ----------------------------------------------------------------------------------

TEST(Reduction, DimErrors) {
  Tensor<float> x = lazy::ones<float>({2, 3});
  EXPECT_THROW(lazy::sum(x, {2}), lazy::ShapeError);
  EXPECT_THROW(lazy::sum(x, {-3}), lazy::ShapeError);
  EXPECT_THROW(lazy::mean(x, {0, 5}), lazy::ShapeError);
  EXPECT_THROW(lazy::amax(x, {2}), lazy::ShapeError);
  EXPECT_THROW(lazy::max(x, 2), lazy::ShapeError);
  EXPECT_THROW(lazy::argmax(x, 2), lazy::ShapeError);
  EXPECT_THROW(lazy::argmin(x, -3), lazy::ShapeError);
  EXPECT_THROW(lazy::any(x, {3}), lazy::ShapeError);
  EXPECT_THROW(lazy::logsumexp(x, {2}), lazy::ShapeError);
  EXPECT_THROW(lazy::norm(x, 2, {4}), lazy::ShapeError);
  // Duplicates, also when written differently.
  EXPECT_THROW(lazy::sum(x, {0, 0}), lazy::ShapeError);
  EXPECT_THROW(lazy::sum(x, {1, -1}), lazy::ShapeError);
  EXPECT_THROW(lazy::prod(x, {-2, 0}), lazy::ShapeError);
  EXPECT_THROW(lazy::amin(x, {1, 1}), lazy::ShapeError);
  EXPECT_THROW(lazy::all(x, {0, -2}), lazy::ShapeError);
  try {
    lazy::sum(lazy::ones<float>({2, 3, 4}), {7});
    FAIL();
  } catch (const lazy::ShapeError& e) {
    EXPECT_NE(std::string(e.what()).find('7'), std::string::npos) << e.what();
  }
}

// ---- fused children ----------------------------------------------------------------------

TEST(Reduction, FusedChildren) {
  const std::int64_t n = 100003;
  const auto a = make_data<float>(n, 41), b = make_data<float>(n, 42);
  Tensor<float> A = lazy::from_vector(a), B = lazy::from_vector(b);
  // sum((a - b)^2)
  LD want = 0;
  for (std::int64_t i = 0; i < n; ++i) want += (static_cast<LD>(a[i]) - b[i]) * (static_cast<LD>(a[i]) - b[i]);
  const float eps = std::numeric_limits<float>::epsilon();
  EXPECT_NEAR(lazy::sum((A - B) * (A - B)).item(), static_cast<double>(want), (6 + 2 * std::sqrt(double(n))) * eps * double(want));
  // mean(exp(x))
  LD me = 0;
  for (auto v : a) me += std::exp(static_cast<LD>(v));
  me /= n;
  EXPECT_NEAR(lazy::mean(lazy::exp(A)).item(), static_cast<double>(me), (8 + 2 * std::sqrt(double(n))) * eps * double(me));
  // A scalar in the child.
  LD s2 = 0, sa = 0;
  for (auto v : a) {
    s2 += static_cast<LD>(v) * 2.5L;
    sa += std::fabs(static_cast<LD>(v)) * 2.5L;
  }
  EXPECT_NEAR(lazy::sum(A * 2.5f).item(), static_cast<double>(s2), (2 + 2 * std::sqrt(double(n))) * eps * double(sa));
  // amax / argmax / any of expressions.
  LD mx = -INFINITY;
  std::int64_t mi = 0;
  for (std::int64_t i = 0; i < n; ++i)
    if (static_cast<LD>(a[i]) - b[i] > mx) {
      mx = static_cast<LD>(a[i]) - b[i];
      mi = i;
    }
  EXPECT_EQ(lazy::amax(A - B).item(), static_cast<float>(a[mi] - b[mi]));
  EXPECT_EQ(lazy::argmax(A - B).item(), mi);
  EXPECT_FALSE(lazy::any(A - A).item());
  EXPECT_TRUE(lazy::all(A * A + 1.f).item());
}

TEST(Reduction, FusedChildrenWithBroadcastLeavesAndZeroDim) {
  const std::int64_t rows = 300, cols = 77;
  const auto x = make_data<double>(rows * cols, 51), bias = make_data<double>(cols, 52), col = make_data<double>(rows, 53);
  Tensor<double> X = lazy::from_vector(x, Shape{rows, cols}), Bv = lazy::from_vector(bias);
  Tensor<double> C = lazy::from_vector(col, Shape{rows, 1});
  Tensor<double> s = lazy::scalar_tensor(1.5);
  std::vector<LD> xb(x.size()), xc(x.size()), xs(x.size());
  for (std::int64_t i = 0; i < rows; ++i)
    for (std::int64_t j = 0; j < cols; ++j) {
      // The child is computed in double, element by element: the reference reduces those values.
      xb[i * cols + j] = static_cast<LD>(x[i * cols + j] + bias[j]);
      xc[i * cols + j] = static_cast<LD>(x[i * cols + j] * col[i]);
      xs[i * cols + j] = static_cast<LD>(x[i * cols + j] * 1.5);
    }
  const Shape sh{rows, cols};
  for (const Dims& d : std::vector<Dims>{{}, {0}, {1}, {0, 1}}) {
    check_with<double>(Op::Sum, [&](const Dims& dd, bool k) { return got(lazy::sum(X + Bv, dd, k)); }, xb, sh, d);
    check_with<double>(Op::Mean, [&](const Dims& dd, bool k) { return got(lazy::mean(X * C, dd, k)); }, xc, sh, d);
    check_with<double>(Op::Amax, [&](const Dims& dd, bool k) { return got(lazy::amax(X + Bv, dd, k)); }, xb, sh, d);
    check_with<double>(Op::Amin, [&](const Dims& dd, bool k) { return got(lazy::amin(X * C, dd, k)); }, xc, sh, d);
    // A 0-d leaf: a splat inside the fused loop.
    check_with<double>(Op::Sum, [&](const Dims& dd, bool k) { return got(lazy::sum(X * s, dd, k)); }, xs, sh, d);
    check_with<double>(Op::Amax, [&](const Dims& dd, bool k) { return got(lazy::amax(X * s, dd, k)); }, xs, sh, d);
    check_with<double>(Op::Logsumexp, [&](const Dims& dd, bool k) { return got(lazy::logsumexp(X + Bv, dd, k)); }, xb, sh, d);
    check_with<double>(Op::Norm2, [&](const Dims& dd, bool k) { return got(lazy::norm(X * s, 2, dd, k)); }, xs, sh, d);
  }
  auto argmax_of = [&](const auto& e) {
    return [&e](const Dims& dd, bool k) {
      return got(lazy::argmax(e, dd.empty() ? std::nullopt : std::optional<std::int64_t>(dd[0]), k));
    };
  };
  const auto xpb = X + Bv;
  const auto xts = X * s;
  const auto xtc = X * C;
  for (std::int64_t d : {0, 1}) {
    check_with<double>(Op::Argmax, argmax_of(xpb), xb, sh, {d});
    check_with<double>(Op::Argmax, argmax_of(xts), xs, sh, {d});
    check_with<double>(Op::Argmax, argmax_of(xtc), xc, sh, {d});
    check_with<double>(Op::Argmin, [&](const Dims& dd, bool k) { return got(lazy::argmin(X * s, dd[0], k)); }, xs, sh, {d});
  }
  check_with<double>(Op::Argmax, argmax_of(xts), xs, sh, {});
  // A 0-d tensor alone, and a 0-d tensor broadcast against a single element.
  Tensor<float> z = lazy::scalar_tensor(3.f);
  EXPECT_EQ(lazy::sum(z * lazy::ones<float>({1})).item(), 3.f);
  EXPECT_EQ(lazy::sum(z + lazy::zeros<float>({4, 5})).item(), 60.f);
  EXPECT_EQ(lazy::sum(z + lazy::zeros<float>({4, 5}), {0}).to_vector(), std::vector<float>(5, 12.f));
  EXPECT_EQ(lazy::sum(z + lazy::zeros<float>({4, 5}), {1}).to_vector(), std::vector<float>(4, 15.f));
}

TEST(Reduction, BroadcastChildOverNonAdjacentDims) {
  // A 3-D child with a row-bias leaf, reduced over dims 0 and 2 (not adjacent).
  const Shape sh{6, 5, 40};
  const auto x = make_data<float>(sh.numel(), 71), bias = make_data<float>(40, 72);
  Tensor<float> X = lazy::from_vector(x, sh), Bv = lazy::from_vector(bias);
  std::vector<LD> xb(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) xb[i] = static_cast<LD>(x[i] + bias[i % 40]);
  for (const Dims& d : std::vector<Dims>{{0, 2}, {2, 0}, {-1, -3}, {1}, {0, 1}}) {
    check_with<float>(Op::Sum, [&](const Dims& dd, bool k) { return got(lazy::sum(X + Bv, dd, k)); }, xb, sh, d);
    check_with<float>(Op::Amax, [&](const Dims& dd, bool k) { return got(lazy::amax(X + Bv, dd, k)); }, xb, sh, d);
    check_with<float>(Op::Mean, [&](const Dims& dd, bool k) { return got(lazy::mean(X + Bv, dd, k)); }, xb, sh, d);
  }
}

TEST(Reduction, GradientsReachLeavesOfOperandsWrittenOutFirst) {
  // Both paths that write an expression operand to memory before reducing it (a broadcast
  // inside it; dims that are not adjacent) take the gradient from the expression itself.
  const Shape sh{6, 5, 40};
  const auto x = make_data<double>(sh.numel(), 81), bias = make_data<double>(40, 82);
  const auto u = make_data<double>(6, 83), w = make_data<double>(5, 84);
  Tensor<double> X = lazy::from_vector(x, sh).requires_grad_();
  Tensor<double> Bv = lazy::from_vector(bias).requires_grad_();
  const Tensor<double> U = lazy::from_vector(u), W = lazy::from_vector(w);
  // L1: sum over (1, 2) of X * X + Bv (a broadcast leaf), weighted by u:
  // dL1/dX = 2 X u[i], dL1/dBv[k] = 5 sum(u).
  lazy::sum(lazy::sum(X * X + Bv, {1, 2}) * U).backward();
  // L2: mean over (2, 0) (not adjacent) of X * 3, weighted by w: dL2/dX = 3 w[j] / (6 * 40).
  lazy::sum(lazy::mean(X * 3.0, {2, 0}) * W).backward();
  const auto gx = X.grad().to_vector(), gb = Bv.grad().to_vector();
  double usum = 0;
  for (double v : u) usum += v;
  for (std::size_t i = 0; i < 6; ++i)
    for (std::size_t j = 0; j < 5; ++j)
      for (std::size_t k = 0; k < 40; ++k) {
        const std::size_t at = (i * 5 + j) * 40 + k;
        const double want = 2 * x[at] * u[i] + 3 * w[j] / 240.0;
        ASSERT_NEAR(gx[at], want, 1e-12 * (1 + std::abs(want))) << i << "," << j << "," << k;
      }
  for (std::size_t k = 0; k < 40; ++k)
    ASSERT_NEAR(gb[k], 5 * usum, 1e-12 * (1 + 5 * std::abs(usum))) << k;
}

TEST(Reduction, ExpressionValuesAreCapturedAtBuildTime) {
  Tensor<float> x = lazy::from_vector(std::vector<float>{1, 2, 3});
  Tensor<float> s = lazy::sum(x * 2.f);
  x += 10.f;
  EXPECT_EQ(s.item(), 12.f);
  EXPECT_EQ(lazy::sum(x).item(), 36.f);
  // The same with a pending operand, updated in place before anything ran.
  Tensor<double> y = lazy::full<double>({1000}, 0.5) * 2.0;
  Tensor<double> alias = y;
  Tensor<double> sy = lazy::sum(y, {0});
  Tensor<double> my = lazy::amax(y);
  y.mul_(3.0);  // rebinds the shared object: alias sees it, the reductions do not
  lazy::mark_step();
  EXPECT_EQ(sy.item(), 1000.0);
  EXPECT_EQ(my.item(), 1.0);
  EXPECT_EQ(lazy::sum(alias).item(), 3000.0);
}

// ---- determinism -------------------------------------------------------------------------

TEST(Reduction, OneElementInputInsideTheReducedExpression) {
  // A one-element tensor read at every index of the child (through a batch of its copies):
  // over everything (several blocks of kReduceBlock), along rows and down columns.
  const std::int64_t rows = 3, cols = 5000;
  std::vector<float> v(static_cast<std::size_t>(rows * cols));
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = static_cast<float>(i % 11) * 0.25f - 1.0f;
  const float sv = 1.5f;
  const auto a = lazy::from_vector<float>(v, Shape{rows, cols});
  const auto s = lazy::from_vector<float>({sv}, Shape{1});
  const float all = lazy::sum(a * s - s).item();
  const auto by_row = lazy::sum(a * s - s, {1}).to_vector();
  const auto by_col = lazy::amax(s - a * s, {0}).to_vector();
  double want_all = 0;
  for (std::int64_t r = 0; r < rows; ++r) {
    double want_row = 0;
    for (std::int64_t c = 0; c < cols; ++c) want_row += double(v[static_cast<std::size_t>(r * cols + c)]) * sv - sv;
    want_all += want_row;
    EXPECT_NEAR(by_row[static_cast<std::size_t>(r)], want_row, 1e-3) << "row " << r;
  }
  EXPECT_NEAR(all, want_all, 1e-2);
  for (std::int64_t c = 0; c < cols; ++c) {
    float want = -std::numeric_limits<float>::infinity();
    for (std::int64_t r = 0; r < rows; ++r) want = std::max(want, sv - v[static_cast<std::size_t>(r * cols + c)] * sv);
    ASSERT_EQ(by_col[static_cast<std::size_t>(c)], want) << "column " << c;
  }
}

TEST(Reduction, OneDimensionGivenAsAnInteger) {
  // torch::sum(x, 1): one dimension without braces, for every function that takes dims.
  const std::int64_t rows = 3, cols = 5;
  std::vector<float> v(static_cast<std::size_t>(rows * cols));
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = static_cast<float>(i % 7) - 2.5f;
  const auto x = lazy::from_vector<float>(v, Shape{rows, cols});
  const auto s1 = lazy::sum(x, 1).to_vector();
  const auto m0 = lazy::mean(x, 0, true);
  ASSERT_EQ(s1.size(), static_cast<std::size_t>(rows));
  ASSERT_EQ(m0.shape(), (Shape{1, cols}));
  const auto mv = m0.to_vector();
  for (std::int64_t r = 0; r < rows; ++r) {
    float want = 0;  // halves: exact in float
    for (std::int64_t c = 0; c < cols; ++c) want += v[static_cast<std::size_t>(r * cols + c)];
    EXPECT_EQ(s1[static_cast<std::size_t>(r)], want) << "row " << r;
  }
  for (std::int64_t c = 0; c < cols; ++c) {
    double want = 0;
    for (std::int64_t r = 0; r < rows; ++r) want += v[static_cast<std::size_t>(r * cols + c)];
    EXPECT_NEAR(mv[static_cast<std::size_t>(c)], want / rows, 1e-6) << "column " << c;
  }
  // The rest agree with the braced form, which the tests above check against references.
  EXPECT_EQ(lazy::prod(x, 1).to_vector(), lazy::prod(x, {1}).to_vector());
  EXPECT_EQ(lazy::amax(x, 0).to_vector(), lazy::amax(x, {0}).to_vector());
  EXPECT_EQ(lazy::amin(x, 1, true).shape(), (Shape{rows, 1}));
  EXPECT_EQ(lazy::logsumexp(x, 1).to_vector(), lazy::logsumexp(x, {1}).to_vector());
  EXPECT_EQ(lazy::norm(x, 2, 0).to_vector(), lazy::norm(x, 2, {0}).to_vector());
  EXPECT_EQ(lazy::any(x > 2.0f, 1).to_vector(), lazy::any(x > 2.0f, {1}).to_vector());
  EXPECT_EQ(lazy::all(x > -3.0f, 0).to_vector(), lazy::all(x > -3.0f, {0}).to_vector());
  // A negative dimension counts from the back; an empty list still means every dimension.
  EXPECT_EQ(lazy::sum(x, -1).to_vector(), s1);
  EXPECT_EQ(lazy::sum(x, {}).shape(), Shape{});
}

TEST(Reduction, BitwiseIdenticalAcrossThreadCounts) {
  auto& pool = lazy::graph::current_device().threads();
  const int saved = pool.size();
  // 16x the threshold (2^22 by default) and at least 64 blocks; a 2048 x 600 matrix by
  // default.
  const std::int64_t n = std::max<std::int64_t>(16 * parallel_work(), 64 * lazy::graph::kReduceBlock) + 5;
  const std::int64_t rows = std::max<std::int64_t>(parallel_work() / 128, 16);
  const auto v = make_data<float>(n, 61);
  const auto m = make_data<double>(rows * 600, 62);
  std::vector<std::vector<float>> results;
  std::vector<std::vector<double>> mresults;
  for (int threads : {1, 2, 4}) {
    lazy::set_num_threads(threads);
    ASSERT_EQ(pool.size(), threads);
    Tensor<float> x = lazy::from_vector(v);
    Tensor<double> y = lazy::from_vector(m, Shape{rows, 600});
    Tensor<float> s = lazy::sum(x);
    Tensor<float> me = lazy::mean(lazy::exp(x));
    Tensor<float> ss = lazy::sum(x * x);
    Tensor<float> lse = lazy::logsumexp(x);
    Tensor<double> r0 = lazy::sum(y, {0});
    Tensor<double> r1 = lazy::sum(y, {1});
    Tensor<double> n2 = lazy::norm(y, 2, {1});
    lazy::mark_step();
    results.push_back({s.item(), me.item(), ss.item(), lse.item()});
    std::vector<double> all = r0.to_vector();
    for (double d : r1.to_vector()) all.push_back(d);
    for (double d : n2.to_vector()) all.push_back(d);
    mresults.push_back(all);
  }
  lazy::set_num_threads(saved);
  for (std::size_t i = 1; i < results.size(); ++i) {
    for (std::size_t k = 0; k < results[0].size(); ++k) {
      // Bitwise: compare the representations, not only the values.
      EXPECT_EQ(std::bit_cast<std::uint32_t>(results[i][k]), std::bit_cast<std::uint32_t>(results[0][k])) << i << "," << k;
    }
    ASSERT_EQ(mresults[i].size(), mresults[0].size());
    for (std::size_t k = 0; k < mresults[0].size(); ++k) {
      ASSERT_EQ(std::bit_cast<std::uint64_t>(mresults[i][k]), std::bit_cast<std::uint64_t>(mresults[0][k])) << i << "," << k;
    }
  }
  // And the values are right.
  LD want = 0, mag = 0;
  for (auto x : v) {
    want += x;
    mag += std::fabs(static_cast<LD>(x));
  }
  EXPECT_NEAR(results[0][0], static_cast<double>(want),
              (2 + 2 * std::sqrt(double(n))) * std::numeric_limits<float>::epsilon() * double(mag));
}


// ---- var / std / var_mean / std_mean (ops/statistics.hpp) ------------------------------------

namespace stats_ref {

std::vector<std::int64_t> coords_in(std::int64_t f, const Shape& s) {
  std::vector<std::int64_t> c(static_cast<std::size_t>(s.rank()));
  for (int d = s.rank() - 1; d >= 0; --d) {
    c[d] = f % s[d];
    f /= s[d];
  }
  return c;
}

struct VarMoments {
  Shape shape;             // the result's shape (keepdim or not)
  std::vector<LD> var, mean;
};

/// Two-pass variance and mean in long double over `dims` (empty: all) of `in` (shape s),
/// divided by max(0, N - correction).
template <class T>
VarMoments var_moments(const std::vector<T>& in, const Shape& s, std::vector<std::int64_t> dims, double correction,
                bool keepdim) {
  std::vector<bool> reduced(static_cast<std::size_t>(s.rank()), dims.empty());
  for (auto d : dims) reduced[static_cast<std::size_t>(d < 0 ? d + s.rank() : d)] = true;
  Shape kept;  // reduced dims as size 1
  VarMoments m;
  for (int d = 0; d < s.rank(); ++d) {
    kept.push_back(reduced[d] ? 1 : s[d]);
    if (!reduced[d] || keepdim) m.shape.push_back(reduced[d] ? 1 : s[d]);
  }
  std::vector<std::vector<LD>> groups(static_cast<std::size_t>(kept.numel()));
  for (std::int64_t f = 0; f < s.numel(); ++f) {
    auto c = coords_in(f, s);
    std::int64_t g = 0;
    for (int d = 0; d < s.rank(); ++d) g = g * kept[d] + (reduced[d] ? 0 : c[d]);
    groups[static_cast<std::size_t>(g)].push_back(ld(in[static_cast<std::size_t>(f)]));
  }
  for (const auto& g : groups) {
    LD mean = 0, ss = 0;
    for (LD x : g) mean += x;
    mean /= static_cast<LD>(g.size());  // (0/0 = NaN for an empty group, as torch)
    for (LD x : g) ss += (x - mean) * (x - mean);
    const LD denom = std::max<LD>(0, static_cast<LD>(g.size()) - correction);
    m.mean.push_back(mean);
    m.var.push_back(ss / denom);
  }
  return m;
}

/// Expects `got` to hold `want` (shape and values) within a relative tolerance; NaN and inf
/// must match exactly.
template <class T>
void expect_stats_close(const Tensor<T>& got, const Shape& shape, const std::vector<LD>& want, double tol) {
  ASSERT_EQ(got.shape(), shape) << "got " << got.shape().str() << ", want " << shape.str();
  const auto v = got.to_vector();
  ASSERT_EQ(v.size(), want.size());
  for (std::size_t i = 0; i < want.size(); ++i) {
    const LD g = ld(v[i]);
    if (std::isnan(static_cast<double>(want[i])) || std::isinf(static_cast<double>(want[i]))) {
      EXPECT_EQ(std::isnan(static_cast<double>(g)), std::isnan(static_cast<double>(want[i]))) << i << ": got " << static_cast<double>(g);
      if (std::isinf(static_cast<double>(want[i]))) {
        EXPECT_EQ(static_cast<double>(g), static_cast<double>(want[i])) << i;
      }
      continue;
    }
    EXPECT_NEAR(static_cast<double>(g), static_cast<double>(want[i]),
                tol * std::max(1.0, std::fabs(static_cast<double>(want[i]))))
        << "element " << i;
  }
}

template <class T>
double stats_tol() {
  if constexpr (std::is_same_v<T, bfloat16>) return 1e-2;  // one bfloat16 rounding of the result
  else if constexpr (std::is_same_v<T, float>) return 2e-5;
  else return 1e-12;
}

std::vector<LD> roots(std::vector<LD> v) {
  for (auto& x : v) x = std::sqrt(x);
  return v;
}

}  // namespace stats_ref

TYPED_TEST(ReductionFloat, VarStdMatchTwoPassReference) {
  using T = TypeParam;
  using namespace stats_ref;
  const double tol = stats_tol<T>();
  const std::vector<std::pair<Shape, std::vector<Dims>>> cases = {
      {Shape{7}, {{}, {0}, {-1}}},
      {Shape{3, 4}, {{}, {0}, {1}, {-1, 0}}},
      {Shape{2, 3, 5}, {{}, {0, 2}, {-2}, {1, 2}, {0, 1, 2}}},
      {Shape{129, 3}, {{0}, {1}}},
      {Shape{1, 5}, {{0}, {1}}},  // N = 1 along dim 0: NaN with correction 1
      {Shape{1000, 70}, {{0}, {1}, {}}},
      {Shape{}, {{}}},
  };
  unsigned seed = 1;
  for (const auto& [s, dim_lists] : cases) {
    const auto in = make_data<T>(s.numel(), seed++);
    auto x = lazy::from_vector<T>(in, s);
    for (const Dims& dims : dim_lists) {
      for (double correction : {1.0, 0.0, 2.5, 5.0, 2000.0}) {
        for (bool keepdim : {false, true}) {
          SCOPED_TRACE("shape " + s.str() + " dims " + lazy::detail::list_str(dims) + " correction " +
                       std::to_string(correction) + " keepdim " + std::to_string(keepdim));
          const VarMoments m = var_moments(in, s, dims, correction, keepdim);
          expect_stats_close(lazy::var(x, dims, correction, keepdim), m.shape, m.var, tol);
          expect_stats_close(lazy::std(x, dims, correction, keepdim), m.shape, roots(m.var), tol);
          auto [v, mu] = lazy::var_mean(x, dims, correction, keepdim);
          expect_stats_close(v, m.shape, m.var, tol);
          expect_stats_close(mu, m.shape, m.mean, tol);
          auto [sd, mu2] = lazy::std_mean(x, dims, correction, keepdim);
          expect_stats_close(sd, m.shape, roots(m.var), tol);
          expect_stats_close(mu2, m.shape, m.mean, tol);
        }
      }
    }
  }
  // Defaults (all elements, correction 1), one dim as an integer, libtorch's bool overloads.
  const Shape s{4, 6};
  const auto in = make_data<T>(s.numel(), 77);
  auto x = lazy::from_vector<T>(in, s);
  expect_stats_close(lazy::var(x), Shape{}, var_moments(in, s, {}, 1, false).var, tol);
  expect_stats_close(lazy::var(x, 1), Shape{4}, var_moments(in, s, {1}, 1, false).var, tol);
  expect_stats_close(lazy::std(x, -2), Shape{6}, roots(var_moments(in, s, {0}, 1, false).var), tol);
  expect_stats_close(lazy::var(x, false), Shape{}, var_moments(in, s, {}, 0, false).var, tol);
  expect_stats_close(lazy::std(x, true), Shape{}, roots(var_moments(in, s, {}, 1, false).var), tol);
  expect_stats_close(std::get<0>(lazy::var_mean(x, false)), Shape{}, var_moments(in, s, {}, 0, false).var, tol);
  expect_stats_close(std::get<1>(lazy::std_mean(x, true)), Shape{}, var_moments(in, s, {}, 1, false).mean, tol);
  // A permuted (non-contiguous source) input, reduced over non-adjacent dims.
  const Shape s3{3, 4, 5};
  const auto in3 = make_data<T>(s3.numel(), 78);
  std::vector<T> pin;
  const Shape ps{5, 3, 4};  // permute(x, {2, 0, 1})
  for (std::int64_t k = 0; k < 5; ++k)
    for (std::int64_t i = 0; i < 3; ++i)
      for (std::int64_t j = 0; j < 4; ++j) pin.push_back(in3[static_cast<std::size_t>((i * 4 + j) * 5 + k)]);
  auto p = lazy::permute(lazy::from_vector<T>(in3, s3), {2, 0, 1});
  expect_stats_close(lazy::var(p, {0, 2}), Shape{3}, var_moments(pin, ps, {0, 2}, 1, false).var, tol);
  expect_stats_close(lazy::std(p, {-1}, 0, true), Shape{5, 3, 1}, roots(var_moments(pin, ps, {2}, 0, true).var), tol);
  // An expression operand: var(2x) = 4 var(x).
  if constexpr (!std::is_same_v<T, bfloat16>) {
    auto want = var_moments(in, s, {0}, 1, false).var;
    for (auto& w : want) w *= 4;
    expect_stats_close(lazy::var(x * T(2), 0), Shape{6}, want, tol);
  }
}

TEST(Reduction, VarStdSpecialValuesAndErrors) {
  // [1, 2, 4]: mean 7/3, squared deviations 16/9 + 1/9 + 25/9 = 42/9.
  auto x = lazy::from_vector<double>({1, 2, 4});
  EXPECT_DOUBLE_EQ(lazy::var(x).item(), 42.0 / 9 / 2);
  EXPECT_DOUBLE_EQ(lazy::var(x, 0, 0).item(), 42.0 / 9 / 3);
  EXPECT_DOUBLE_EQ(lazy::var(x, 0, 1.5).item(), 42.0 / 9 / 1.5);
  EXPECT_DOUBLE_EQ(lazy::std(x, 0, -1).item(), std::sqrt(42.0 / 9 / 4));
  // N - correction <= 0: inf for a non-zero sum of squares, NaN for a zero one.
  EXPECT_EQ(lazy::var(x, 0, 3).item(), std::numeric_limits<double>::infinity());
  EXPECT_EQ(lazy::std(x, 0, 7).item(), std::numeric_limits<double>::infinity());
  EXPECT_TRUE(std::isnan(lazy::var(lazy::from_vector<float>({5})).item()));
  EXPECT_TRUE(std::isnan(lazy::var(lazy::scalar_tensor(2.0)).item()));
  EXPECT_TRUE(std::isnan(lazy::std(lazy::zeros<float>({0})).item()));
  EXPECT_TRUE(std::isnan(std::get<1>(lazy::var_mean(lazy::zeros<double>({0}))).item()));
  auto e = lazy::var(lazy::zeros<float>({2, 0}), 1);
  ASSERT_EQ(e.shape(), Shape{2});
  for (float v : e.to_vector()) EXPECT_TRUE(std::isnan(v));
  EXPECT_EQ(lazy::var(lazy::zeros<float>({0, 3}), 1).shape(), Shape{0});
  // Constant input: (close to) zero.
  EXPECT_NEAR(lazy::std(lazy::full<float>({1000}, 0.1f)).item(), 0.0f, 1e-6f);
  // Floating dtypes only, as torch.
  EXPECT_THROW(lazy::var(lazy::ones<std::int32_t>({3})), lazy::DTypeError);
  EXPECT_THROW(lazy::std(lazy::ones<std::int64_t>({3, 2}), 0), lazy::DTypeError);
  EXPECT_THROW(lazy::var_mean(lazy::ones<bool>({3})), lazy::DTypeError);
  EXPECT_THROW(lazy::std_mean(lazy::ones<std::int32_t>({3}), true), lazy::DTypeError);
  // Bad dims.
  auto y = lazy::ones<float>({2, 3});
  EXPECT_THROW(lazy::var(y, 2), lazy::ShapeError);
  EXPECT_THROW(lazy::std(y, {-3}), lazy::ShapeError);
  EXPECT_THROW(lazy::var_mean(y, {0, 0}), lazy::ShapeError);
  EXPECT_THROW(lazy::std_mean(y, {1, -1}), lazy::ShapeError);
  try {
    lazy::var(lazy::ones<std::int32_t>({3}));
    FAIL();
  } catch (const lazy::DTypeError& err) {
    EXPECT_NE(std::string(err.what()).find("floating"), std::string::npos) << err.what();
    EXPECT_NE(std::string(err.what()).find("int32"), std::string::npos) << err.what();
  }
}

TEST(Reduction, VarStdGradients) {
  using gradcheck::input;
  using V = std::vector<Tensor<double>>;
  gradcheck::check("var over dim 1", [](const V& v) { return lazy::var(v[0], 1); }, {input(Shape{3, 5}, 1)});
  gradcheck::check("var over all, correction 0", [](const V& v) { return lazy::var(v[0], {}, 0); },
                   {input(Shape{2, 3, 2}, 2)});
  gradcheck::check("std over non-adjacent dims of a permuted input, keepdim",
                   [](const V& v) { return lazy::std(lazy::permute(v[0], {2, 0, 1}), {0, -1}, 1, true); },
                   {input(Shape{3, 4, 2}, 3)});
  gradcheck::check("var_mean and std_mean",
                   [](const V& v) {
                     auto [var, m] = lazy::var_mean(v[0], -1, 2);
                     auto [sd, m2] = lazy::std_mean(v[0], 0);
                     return Tensor<double>(var * 2.0 + m + sd * m2);
                   },
                   {input(Shape{3, 3}, 4)});
  // Analytic: d var / dx_i = 2 (x_i - mean) / (N - correction); std: that / (2 std).
  auto x = lazy::from_vector<double>({1, 2, 4, 3, 3, 3}, Shape{2, 3}).requires_grad_();
  lazy::sum(lazy::std(x, 1)).backward();
  const double sd = std::sqrt(42.0 / 9 / 2);
  const std::vector<double> g = x.grad().to_vector();
  const std::vector<double> want = {(1 - 7.0 / 3) / (2 * sd), (2 - 7.0 / 3) / (2 * sd), (4 - 7.0 / 3) / (2 * sd), 0, 0, 0};
  for (std::size_t i = 0; i < want.size(); ++i) EXPECT_NEAR(g[i], want[i], 1e-12) << i;
  // The constant row's std is 0: a zero gradient there, as torch's std_backward, not NaN.
  for (std::size_t i = 3; i < 6; ++i) EXPECT_EQ(g[i], 0.0) << i;
  // bfloat16 gradients flow too (computed in float, rounded).
  auto b = lazy::from_vector<bfloat16>({bfloat16(1.0f), bfloat16(3.0f)}).requires_grad_();
  lazy::var(b).backward();
  const auto gb = b.grad().to_vector();
  EXPECT_EQ(static_cast<float>(gb[0]), -2.0f);  // 2 (1 - 2) / 1
  EXPECT_EQ(static_cast<float>(gb[1]), 2.0f);
}

}  // namespace
