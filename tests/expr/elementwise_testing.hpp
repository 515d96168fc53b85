// Shared by the element-wise tests (tests/expr/test_elementwise*.cpp): scalar references
// written independently of the library, input generators, tolerances and op descriptors.
//
// Documented semantics the references model: a fused kernel converts every operand to its
// lane type (the widest type involved; bool computes as an integer, bfloat16 as float),
// computes every intermediate in it, and rounds once when storing.
#pragma once

#include <lazytensor/tensor.hpp>
#include <lazytensor/ops/factories.hpp>
#include <lazytensor/tensor.hpp>

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

namespace lazytest {


using lazy::Shape;
using lazy::Tensor;
using bf16 = lazy::bfloat16;
using i32 = std::int32_t;
using i64 = std::int64_t;

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr double kInf = std::numeric_limits<double>::infinity();

// ---- type helpers ---------------------------------------------------------------------

template <class T>
constexpr bool is_bool_v = std::is_same_v<T, bool>;
template <class T>
constexpr bool is_int_v = std::is_same_v<T, i32> || std::is_same_v<T, i64>;
template <class T>
constexpr bool is_fp_v = std::is_same_v<T, float> || std::is_same_v<T, double> || std::is_same_v<T, bf16>;
template <class T>
constexpr bool is_bf16_v = std::is_same_v<T, bf16>;

// PyTorch's result type of a floating-only op on T (written out, not taken from the library).
template <class T>
using flt_t = std::conditional_t<is_fp_v<T>, T, float>;

// Widest of several element types: bool < int32 < int64 < bfloat16 < float < double.
template <class T>
constexpr int rank_of() {
  if constexpr (is_bool_v<T>) return 0;
  else if constexpr (std::is_same_v<T, i32>) return 1;
  else if constexpr (std::is_same_v<T, i64>) return 2;
  else if constexpr (is_bf16_v<T>) return 3;
  else if constexpr (std::is_same_v<T, float>) return 4;
  else return 5;
}
template <class A, class B>
using wider_t = std::conditional_t<(rank_of<A>() >= rank_of<B>()), A, B>;
template <class T, class... R>
struct widest {
  using type = T;
};
template <class T, class U, class... R>
struct widest<T, U, R...> {
  using type = typename widest<wider_t<T, U>, R...>::type;
};

// The reference's model of a kernel lane for a set of types: values are first converted to
// the lane type L (the widest; bf16 -> float; bool/int -> their integer value), then the
// reference computes exactly (int64) or in double.
template <class... Ts>
struct RefLane {
  using W = typename widest<Ts...>::type;
  using L = std::conditional_t<is_bf16_v<W>, float, std::conditional_t<is_bool_v<W>, i64, W>>;
  using V = std::conditional_t<is_fp_v<W>, double, i64>;
  template <class T>
  static V in(T x) {
    if constexpr (is_bf16_v<T>) return static_cast<V>(static_cast<L>(float(x)));
    else return static_cast<V>(static_cast<L>(x));
  }
};

// Independent round-to-nearest-even float -> bfloat16 (integer arithmetic on the bits).
inline bf16 round_bf16(float f) {
  const std::uint32_t u = std::bit_cast<std::uint32_t>(f);
  if (std::isnan(f)) return bf16::from_bits(static_cast<std::uint16_t>((u >> 16) | 0x40));
  const std::uint32_t upper = u >> 16, lower = u & 0xffff;
  const bool up = lower > 0x8000 || (lower == 0x8000 && (upper & 1));
  return bf16::from_bits(static_cast<std::uint16_t>(up ? upper + 1 : upper));
}

// Converts a reference value to the stored result type R (what a store does).
template <class R, class V>
R to_result(V v) {
  if constexpr (is_bool_v<R>) return v != 0;
  else if constexpr (is_bf16_v<R>) return round_bf16(static_cast<float>(v));
  else return static_cast<R>(v);
}

template <class T>
double as_double(T v) {
  if constexpr (is_bf16_v<T>) return float(v);
  else return static_cast<double>(v);
}

template <class T>
std::string show(T v) {
  std::ostringstream os;
  os.precision(17);
  if constexpr (is_bf16_v<T>) os << float(v) << " (bf16 0x" << std::hex << v.bits << ")";
  else if constexpr (is_bool_v<T>) os << (v ? "true" : "false");
  else os << v;
  return os.str();
}

// ---- tolerances -----------------------------------------------------------------------

struct Tol {
  double rel = 0, abs = 0;
  int ulps = 0;  // bfloat16 units in the last place
};
// Exactly representable results (+ - * on ints, comparisons, selects, ...).
constexpr Tol kExact{};
// One correctly rounded op, possibly after a double rounding in the reference.
template <class R>
Tol rounding_tol() {
  if constexpr (std::is_same_v<R, float>) return {3e-7, 0, 0};
  else if constexpr (std::is_same_v<R, double>) return {5e-16, 0, 0};
  else if constexpr (is_bf16_v<R>) return {0, 0, 1};
  else return kExact;
}
// SIMD transcendental functions (xsimd) against std:: in double.
template <class R>
Tol transcendental_tol() {
  if constexpr (std::is_same_v<R, float>) return {1e-5, 1e-6, 0};
  else if constexpr (std::is_same_v<R, double>) return {1e-12, 1e-14, 0};
  else if constexpr (is_bf16_v<R>) return {0, 1e-5, 1};
  else return kExact;
}

inline int bf16_ordinal(bf16 v) { return (v.bits & 0x8000) ? -static_cast<int>(v.bits & 0x7fff) : static_cast<int>(v.bits); }

// True when `got` is acceptable for the exact reference value `ref` (want = ref stored as R).
template <class R>
bool close(R got, R want, double ref, Tol tol) {
  if constexpr (is_bool_v<R> || is_int_v<R>) {
    return got == want;
  } else if constexpr (is_bf16_v<R>) {
    const float g = got, w = want;
    if (std::isnan(w)) return std::isnan(g);
    if (std::isnan(g)) return false;
    if (got.bits == want.bits) return true;
    if (std::isinf(w) || std::isinf(g)) return false;
    return std::abs(bf16_ordinal(got) - bf16_ordinal(want)) <= tol.ulps || std::abs(double(g) - ref) <= tol.abs;
  } else {
    if (std::isnan(want)) return std::isnan(got);
    if (std::isnan(got)) return false;
    if (got == want) return true;
    if (std::isinf(want) || std::isinf(got)) return false;
    return std::abs(double(got) - ref) <= tol.rel * std::abs(ref) + tol.abs;
  }
}

// Collects mismatches and reports the first few with their inputs.
class Checker {
 public:
  explicit Checker(std::string what) : what_(std::move(what)) {}
  /// `inputs` describes element i's operands; called only on a mismatch.
  template <class R, class F>
  void check(std::int64_t i, R got, R want, double ref, Tol tol, const F& inputs) {
    if (close(got, want, ref, tol)) return;
    if (++failures_ <= 8) report(i, show(got), show(want), ref, inputs());
  }
  ~Checker() {
    if (failures_ > 8) ADD_FAILURE() << what_ << ": " << failures_ << " mismatches in total";
  }
  int failures() const { return failures_; }

 private:
  void report(std::int64_t i, const std::string& got, const std::string& want, double ref,
              const std::string& inputs) const {
    ADD_FAILURE() << what_ << " [" << i << "]: got " << got << ", want " << want << " (exact " << ref << ") for "
                  << inputs;
  }

  std::string what_;
  int failures_ = 0;
};

// One operand's values, shown in a failure message (type-erased, so that the checking loop
// below is compiled once per result type, not once per op and dtype: the element-wise tests
// run some 700 of them).
struct Column {
  const void* values;
  std::string (*show_at)(const void* values, std::int64_t i);
};
template <class T>
std::string show_element(const void* values, std::int64_t i) {
  return show<T>((*static_cast<const std::vector<T>*>(values))[static_cast<std::size_t>(i)]);
}
template <class T>
Column column(const std::vector<T>& v) {
  return {&v, &show_element<T>};
}

// What every element should hold: the reference's exact value and that value stored as R.
template <class R>
struct Expected {
  std::vector<R> want;
  std::vector<double> exact;
};
/// The reference values of n elements, ref_at(i) for each (an exact int64 or a double).
template <class R, class F>
Expected<R> expected(std::size_t n, const F& ref_at) {
  Expected<R> e{std::vector<R>(n), std::vector<double>(n)};
  for (std::size_t i = 0; i < n; ++i) {
    const auto r = ref_at(i);
    e.want[i] = to_result<R>(r);
    e.exact[i] = static_cast<double>(r);
  }
  return e;
}

// Checks got[i] against the expected values for every i.
template <class R>
void check_values(const std::string& what, const std::vector<R>& got, const Expected<R>& e, Tol tol,
                  std::initializer_list<Column> inputs) {
  ASSERT_EQ(got.size(), e.want.size()) << what;
  Checker c(what);
  for (std::size_t i = 0; i < got.size(); ++i) {
    c.check<R>(static_cast<std::int64_t>(i), got[i], e.want[i], e.exact[i], tol, [&] {
      std::string text;
      for (const Column& col : inputs) text += (text.empty() ? "" : ", ") + col.show_at(col.values, static_cast<std::int64_t>(i));
      return text;
    });
  }
}

// "op<float, int32> n=7": what a run of an op checks, for failure messages.
inline std::string label(const char* op, std::initializer_list<lazy::DType> dtypes, const std::string& tail) {
  std::string s = std::string(op) + "<";
  for (lazy::DType d : dtypes) s += (s.back() == '<' ? "" : ", ") + lazy::dtype_name(d);
  return s + "> " + tail;
}

// Checks one run of an op: the output's shape, then every value; `tail` follows the op and
// dtypes in failure messages. Compiled once per result type.
template <class R>
void check_output(const char* op, std::initializer_list<lazy::DType> dtypes, const std::string& tail,
                  const Shape& shape, const Tensor<R>& out, const Expected<R>& e, Tol tol,
                  std::initializer_list<Column> inputs) {
  const std::string what = label(op, dtypes, tail);
  ASSERT_EQ(out.shape(), shape) << what;
  check_values<R>(what, out.to_vector(), e, tol, inputs);
}
// The same for a run on n elements; `operands` describes the operands before the size
// ("(tensor, 2) ").
template <class R>
void check_run(const char* op, std::initializer_list<lazy::DType> dtypes, const std::string& operands,
               std::int64_t n, const Tensor<R>& out, const Expected<R>& e, Tol tol,
               std::initializer_list<Column> inputs) {
  check_output<R>(op, dtypes, operands + "n=" + std::to_string(n), Shape{n}, out, e, tol, inputs);
}

// ---- inputs ---------------------------------------------------------------------------

struct Domain {
  double lo = -10, hi = 10;       // floating inputs
  double ilo = -1000, ihi = 1000;  // int32 inputs
  double llo = -1000, lhi = 1000;  // int64 inputs
  bool nonzero = false;            // keep |x| away from 0 (divisors)
  bool coarse = false;             // few distinct values (multiples of 1/2), so ties occur
};

// splitmix64: cheap, deterministic.
struct Rng {
  std::uint64_t s;
  std::uint64_t next() {
    std::uint64_t z = (s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  double uniform(double lo, double hi) { return lo + (hi - lo) * static_cast<double>(next() >> 11) * 0x1p-53; }
  i64 integer(i64 lo, i64 hi) { return lo + static_cast<i64>(next() % static_cast<std::uint64_t>(hi - lo + 1)); }
};

template <class T>
std::vector<T> gen(std::int64_t n, const Domain& d, std::uint64_t seed) {
  Rng rng{seed * 1000003 + 17};
  std::vector<T> v;
  v.reserve(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) {
    if constexpr (is_bool_v<T>) {
      v.push_back(d.nonzero ? true : (rng.next() & 1) != 0);
    } else if constexpr (is_int_v<T>) {
      const double lo = std::is_same_v<T, i32> ? d.ilo : d.llo, hi = std::is_same_v<T, i32> ? d.ihi : d.lhi;
      i64 x = d.coarse ? rng.integer(-3, 3) : rng.integer(static_cast<i64>(std::ceil(lo)), static_cast<i64>(std::floor(hi)));
      if (d.nonzero && x == 0) x = 1;
      v.push_back(static_cast<T>(x));
    } else {
      double x = d.coarse ? 0.5 * static_cast<double>(rng.integer(-4, 4)) : rng.uniform(d.lo, d.hi);
      if (d.nonzero && std::abs(x) < 0.25) x = x < 0 ? -0.75 : 0.75;
      if constexpr (is_bf16_v<T>) v.push_back(round_bf16(static_cast<float>(x)));
      else v.push_back(static_cast<T>(x));
    }
  }
  return v;
}

template <class T>
Tensor<T> make(const std::vector<T>& v, const Shape& s) {
  return lazy::from_vector<T>(v, s);
}

// A C++ scalar of the natural kind for T: double for floating T, int for int32, long long
// for int64, bool for bool; its value drawn from the domain.
template <class T>
auto natural_scalar(const Domain& d, std::uint64_t seed) {
  const T v = gen<T>(1, d, seed)[0];
  if constexpr (is_bool_v<T>) return v;
  else if constexpr (std::is_same_v<T, i32>) return static_cast<int>(v);
  else if constexpr (std::is_same_v<T, i64>) return static_cast<long long>(v);
  else return as_double(v);
}

// Converts a C++ scalar to the type W it takes in the expression.
template <class W, class S>
W scalar_as(S s) {
  if constexpr (is_bf16_v<W>) return round_bf16(static_cast<float>(s));
  else return static_cast<W>(s);
}

// Sizes: 0, 1, 2..7, 127, 128, 129, and one above the threading threshold for this kernel
// (cost per element x elements >= core::tuning().parallel_work, which the sanitizer builds
// lower; and never fewer than two tasks' minimum of elements), plus an odd tail.
inline std::vector<std::int64_t> sizes_for(double cost_per_element) {
  const double least = std::max(std::ceil(lazy::core::tuning().parallel_work / cost_per_element),
                                2.0 * lazy::graph::kMinTaskItems);
  const auto big = static_cast<std::int64_t>(least) + 4099;
  return {0, 1, 2, 3, 4, 5, 6, 7, 127, 128, 129, big};
}

// A size list's entry standing for sizes_for's last: one above the threading threshold for
// the kernel under test, whose cost the runners read from the pending node of an earlier
// entry's statement (so no runner builds a statement only to learn it).
constexpr std::int64_t kThreaded = -1;
// Every size of sizes_for; fewer for the scalar-operand variants (same kernel loops, other
// operand kinds).
inline const std::vector<std::int64_t> kAllSizes{0, 1, 2, 3, 4, 5, 6, 7, 127, 128, 129, kThreaded};
inline const std::vector<std::int64_t> kFewSizes{0, 1, 5, 129, kThreaded};
// The size an entry stands for, `cost` being the kernel's cost per element.
inline std::int64_t resolve_size(std::int64_t entry, double cost) {
  if (entry != kThreaded) return entry;
  EXPECT_GT(cost, 0) << "kThreaded must follow an entry of at least one element";
  return sizes_for(cost > 0 ? cost : 1).back();
}

// Every test runs with 4 device threads, so large kernels really split into tasks even on a
// one-core CI machine; the default is restored at the end.
class FourThreads : public ::testing::Environment {
 public:
  void SetUp() override { lazy::set_num_threads(4); }
  void TearDown() override { lazy::set_num_threads(lazy::graph::default_device_threads()); }
};
inline const auto* const kFourThreadsEnv = ::testing::AddGlobalTestEnvironment(new FourThreads);

// Every dtype, for the typed suites and for for_each_dtype.
using AllTypes = ::testing::Types<float, double, i32, i64, bool, bf16>;

// Calls f.template operator()<T>() for every dtype T, in one test: the ops' tests loop over
// the dtypes rather than being typed suites, whose registration GoogleTest compiles once
// per test and type (a tenth of the element-wise tests' object code). Failure messages name
// the dtype.
template <class F>
void for_each_dtype(const F& f) {
  [&]<class... Ts>(::testing::Types<Ts...>) { (f.template operator()<Ts>(), ...); }(AllTypes{});
}

// ---- op descriptors -------------------------------------------------------------------
// Each names the op (as in error messages), says which dtypes it is meaningful for, its
// PyTorch result type, how to call it, the reference, the input domain and the tolerance.

template <class T>
constexpr bool not_bool = !is_bool_v<T>;

#define UNARY_FLOAT_FN(NAME, FN, REF, LO, HI, ILO, IHI)                           \
  struct NAME {                                                                  \
    static constexpr const char* name = #FN;                                     \
    template <class T>                                                           \
    static constexpr bool supports = true;                                       \
    template <class T>                                                           \
    using result = flt_t<T>;                                                     \
    template <class X>                                                           \
    static auto apply(const X& x) {                                              \
      return lazy::FN(x);                                                        \
    }                                                                            \
    template <class X>                                                           \
    static constexpr bool callable = requires(const X& x) { lazy::FN(x); };      \
    static double ref(double x) { return REF; }                                  \
    static Domain domain() { return {LO, HI, ILO, IHI, ILO, IHI, false, false}; } \
    template <class R>                                                           \
    static Tol tol() {                                                           \
      return transcendental_tol<R>();                                            \
    }                                                                            \
  };

UNARY_FLOAT_FN(Exp, exp, std::exp(x), -10, 10, -10, 10)
UNARY_FLOAT_FN(Log, log, std::log(x), 0.01, 100, 1, 1000)
UNARY_FLOAT_FN(Log1p, log1p, std::log1p(x), -0.99, 10, 0, 1000)
UNARY_FLOAT_FN(Expm1, expm1, std::expm1(x), -5, 5, -5, 5)
UNARY_FLOAT_FN(Sin, sin, std::sin(x), -10, 10, -10, 10)
UNARY_FLOAT_FN(Cos, cos, std::cos(x), -10, 10, -10, 10)
UNARY_FLOAT_FN(Tanh, tanh, std::tanh(x), -6, 6, -6, 6)
UNARY_FLOAT_FN(Sigmoid, sigmoid, 1.0 / (1.0 + std::exp(-x)), -25, 25, -25, 25)
UNARY_FLOAT_FN(Gelu, gelu, 0.5 * x * (1.0 + std::erf(x / std::sqrt(2.0))), -6, 6, -6, 6)
UNARY_FLOAT_FN(Silu, silu, x / (1.0 + std::exp(-x)), -20, 20, -20, 20)
UNARY_FLOAT_FN(Reciprocal, reciprocal, 1.0 / x, 0.05, 20, 1, 1000)
UNARY_FLOAT_FN(Log2, log2, std::log2(x), 0.01, 100, 1, 1000)
UNARY_FLOAT_FN(Log10, log10, std::log10(x), 0.01, 100, 1, 1000)
UNARY_FLOAT_FN(Erf, erf, std::erf(x), -4, 4, -4, 4)
UNARY_FLOAT_FN(Tan, tan, std::tan(x), -1.4, 1.4, -1, 1)
UNARY_FLOAT_FN(Asin, asin, std::asin(x), -0.99, 0.99, -1, 1)
UNARY_FLOAT_FN(Acos, acos, std::acos(x), -0.99, 0.99, -1, 1)
UNARY_FLOAT_FN(Atan, atan, std::atan(x), -20, 20, -1000, 1000)
UNARY_FLOAT_FN(Sinh, sinh, std::sinh(x), -8, 8, -8, 8)
UNARY_FLOAT_FN(Cosh, cosh, std::cosh(x), -8, 8, -8, 8)
UNARY_FLOAT_FN(Asinh, asinh, std::asinh(x), -100, 100, -1000, 1000)
UNARY_FLOAT_FN(Acosh, acosh, std::acosh(x), 1.01, 100, 1, 1000)
UNARY_FLOAT_FN(Atanh, atanh, std::atanh(x), -0.99, 0.99, 0, 0)
// torch.nn.functional.softplus(x, beta=1, threshold=20).
UNARY_FLOAT_FN(Softplus, softplus, x > 20 ? x : std::log1p(std::exp(x)), -25, 25, -25, 25)
#undef UNARY_FLOAT_FN

// sqrt and rsqrt are correctly rounded (or two roundings), not approximations.
struct Sqrt {
  static constexpr const char* name = "sqrt";
  template <class T>
  static constexpr bool supports = true;
  template <class T>
  using result = flt_t<T>;
  template <class X>
  static auto apply(const X& x) {
    return lazy::sqrt(x);
  }
  template <class X>
  static constexpr bool callable = requires(const X& x) { lazy::sqrt(x); };
  static double ref(double x) { return std::sqrt(x); }
  static Domain domain() { return {0, 1000, 0, 100000, 0, 100000}; }
  template <class R>
  static Tol tol() {
    return rounding_tol<R>();
  }
};
struct Rsqrt {
  static constexpr const char* name = "rsqrt";
  template <class T>
  static constexpr bool supports = true;
  template <class T>
  using result = flt_t<T>;
  template <class X>
  static auto apply(const X& x) {
    return lazy::rsqrt(x);
  }
  template <class X>
  static constexpr bool callable = requires(const X& x) { lazy::rsqrt(x); };
  static double ref(double x) { return 1.0 / std::sqrt(x); }
  static Domain domain() { return {0.001, 1000, 1, 100000, 1, 100000}; }
  template <class R>
  static Tol tol() {
    Tol t = rounding_tol<R>();
    t.rel *= 2;
    return t;
  }
};

// Ops that keep the input type and are exact.
#define UNARY_EXACT(NAME, STR, CALL, REF, SUPPORTS)         \
  struct NAME {                                            \
    static constexpr const char* name = STR;               \
    template <class T>                                     \
    static constexpr bool supports = SUPPORTS;             \
    template <class T>                                     \
    using result = T;                                      \
    template <class X>                                     \
    static auto apply(const X& x) {                        \
      return CALL;                                         \
    }                                                      \
    template <class X>                                     \
    static constexpr bool callable = requires(const X& x) { CALL; }; \
    template <class V>                                     \
    static V ref(V x) {                                    \
      return REF;                                          \
    }                                                      \
    static Domain domain() { return {}; }                  \
    template <class R>                                     \
    static Tol tol() {                                     \
      return kExact;                                       \
    }                                                      \
  };

UNARY_EXACT(Neg, "neg", -x, -x, not_bool<T>)
UNARY_EXACT(Square, "square", lazy::square(x), x* x, not_bool<T>)
UNARY_EXACT(Abs, "abs", lazy::abs(x), x < 0 ? -x : x, not_bool<T>)
UNARY_EXACT(Sign, "sign", lazy::sign(x), static_cast<V>((x > 0) - (x < 0)), not_bool<T>)
UNARY_EXACT(Relu, "relu", lazy::relu(x), x < 0 ? V(0) : x, not_bool<T>)
#undef UNARY_EXACT

// Rounding: exact, keeps the type; inputs on a grid of halves so that ties (round's
// half-to-even) occur.
#define UNARY_ROUNDING(NAME, FN, REF)                                                  \
  struct NAME {                                                                        \
    static constexpr const char* name = #FN;                                           \
    template <class T>                                                                 \
    static constexpr bool supports = not_bool<T>;                                      \
    template <class T>                                                                 \
    using result = T;                                                                  \
    template <class X>                                                                 \
    static auto apply(const X& x) {                                                    \
      return lazy::FN(x);                                                              \
    }                                                                                  \
    template <class X>                                                                 \
    static constexpr bool callable = requires(const X& x) { lazy::FN(x); };            \
    template <class V>                                                                 \
    static V ref(V x) {                                                                \
      if constexpr (std::is_integral_v<V>) return x;                                   \
      else return REF;                                                                 \
    }                                                                                  \
    static Domain domain() { return {-10, 10, -1000, 1000, -1000, 1000, false, true}; } \
    template <class R>                                                                 \
    static Tol tol() {                                                                 \
      return kExact;                                                                   \
    }                                                                                  \
  };
UNARY_ROUNDING(Floor, floor, std::floor(x))
UNARY_ROUNDING(Ceil, ceil, std::ceil(x))
UNARY_ROUNDING(Round, round, std::nearbyint(x))
UNARY_ROUNDING(Trunc, trunc, std::trunc(x))
#undef UNARY_ROUNDING

struct Not {
  static constexpr const char* name = "logical_not";
  template <class T>
  static constexpr bool supports = true;
  template <class T>
  using result = bool;
  template <class X>
  static auto apply(const X& x) {
    return !x;
  }
  template <class X>
  static constexpr bool callable = requires(const X& x) { !x; };
  template <class V>
  static V ref(V x) {
    return x == 0 ? 1 : 0;
  }
  static Domain domain() { return {-10, 10, -10, 10, -10, 10, false, true}; }
  template <class R>
  static Tol tol() {
    return kExact;
  }
};

// Binary ops. `ref` takes lane values (int64 or double).
template <class A, class B>
using promote = typename widest<A, B>::type;

#define STRIP(...) __VA_ARGS__
#define BINARY_OP(NAME, STR, CALL, REF, RESULT, SUPPORTS, DOMAIN_A, DOMAIN_B, TOL) \
  struct NAME {                                                                     \
    static constexpr const char* name = STR;                                        \
    template <class T>                                                              \
    static constexpr bool supports = SUPPORTS;                                      \
    template <class A, class B>                                                     \
    using result = STRIP RESULT;                                                    \
    template <class X, class Y>                                                     \
    static auto apply(const X& a, const Y& b) {                                     \
      return CALL;                                                                  \
    }                                                                               \
    template <class X, class Y>                                                     \
    static constexpr bool callable = requires(const X& a, const Y& b) { CALL; };    \
    template <class V>                                                              \
    static auto ref(V a, V b) {                                                     \
      return REF;                                                                   \
    }                                                                               \
    static Domain domain_a() { return DOMAIN_A; }                                   \
    static Domain domain_b() { return DOMAIN_B; }                                   \
    template <class R>                                                              \
    static Tol tol() {                                                              \
      return TOL;                                                                   \
    }                                                                               \
  };

// int64 operands of + - and comparisons use values far beyond 2^31 and 2^53 (but sums stay
// below 2^63), so a kernel that computes them in float, double or int32 shows up.
constexpr Domain kWide{-10, 10, -1000000000, 1000000000, -(0x1p61), 0x1p61};
constexpr Domain kMulDom{-10, 10, -40000, 40000, -3e9, 3e9};
constexpr Domain kDivisor{-10, 10, -1000, 1000, -1000, 1000, true};
constexpr Domain kCoarse{-10, 10, -3, 3, -3, 3, false, true};
constexpr Domain kPowBase{0.1, 5, -6, 6, -6, 6};
constexpr Domain kPowExp{-3, 3, 0, 6, 0, 6};

// Python's modulo and floor division, written from their definitions: integers by the
// classic ((a mod |b|) + |b|) mod |b| shifted into b's sign; floating values in long double
// (a - b * floor(a / b)).
template <class V>
V ref_pymod(V a, V b) {
  if constexpr (std::is_integral_v<V>) {
    const V m = b < 0 ? -b : b;
    const V r = ((a % m) + m) % m;  // in [0, |b|)
    return b < 0 && r != 0 ? r - m : r;
  } else {
    const long double q = std::floor(static_cast<long double>(a) / static_cast<long double>(b));
    return static_cast<V>(static_cast<long double>(a) - static_cast<long double>(b) * q);
  }
}
template <class V>
V ref_fmod(V a, V b) {
  if constexpr (std::is_integral_v<V>) return a % b;  // C's truncating remainder
  else return static_cast<V>(std::fmod(static_cast<long double>(a), static_cast<long double>(b)));
}
template <class V>
V ref_floordiv(V a, V b) {
  if constexpr (std::is_integral_v<V>) return (a - ref_pymod(a, b)) / b;
  else return static_cast<V>(std::floor(static_cast<long double>(a) / static_cast<long double>(b)));
}

BINARY_OP(Add, "add", a + b, a + b, (promote<A, B>), true, kWide, kWide, kExact)
BINARY_OP(Sub, "sub", a - b, a - b, (promote<A, B>), not_bool<T>, kWide, kWide, kExact)
BINARY_OP(Mul, "mul", a* b, a* b, (promote<A, B>), true, kMulDom, kMulDom, kExact)
BINARY_OP(Div, "div", a / b, static_cast<double>(a) / static_cast<double>(b), (flt_t<promote<A, B>>), true, kWide,
          kDivisor, rounding_tol<R>())
BINARY_OP(Remainder, "remainder", a % b, ref_pymod(a, b), (promote<A, B>), not_bool<T>, kWide, kDivisor,
          rounding_tol<R>())
BINARY_OP(Fmod, "fmod", lazy::fmod(a, b), ref_fmod(a, b), (promote<A, B>), not_bool<T>, kWide, kDivisor,
          rounding_tol<R>())
BINARY_OP(FloorDivide, "floor_divide", lazy::floor_divide(a, b), ref_floordiv(a, b), (promote<A, B>), not_bool<T>,
          kWide, kDivisor, kExact)
BINARY_OP(Maximum, "maximum", lazy::maximum(a, b), a < b ? b : a, (promote<A, B>), true, kWide, kWide, kExact)
BINARY_OP(Minimum, "minimum", lazy::minimum(a, b), b < a ? b : a, (promote<A, B>), true, kWide, kWide, kExact)
BINARY_OP(Eq, "eq", a == b, V(a == b), (bool), true, kCoarse, kCoarse, kExact)
BINARY_OP(Ne, "ne", a != b, V(a != b), (bool), true, kCoarse, kCoarse, kExact)
BINARY_OP(Lt, "lt", a < b, V(a < b), (bool), true, kCoarse, kCoarse, kExact)
BINARY_OP(Le, "le", a <= b, V(a <= b), (bool), true, kCoarse, kCoarse, kExact)
BINARY_OP(Gt, "gt", a > b, V(a > b), (bool), true, kCoarse, kCoarse, kExact)
BINARY_OP(Ge, "ge", a >= b, V(a >= b), (bool), true, kCoarse, kCoarse, kExact)
// `&` and `|` are logical on every dtype (docs/architecture.md), like logical_and/or.
BINARY_OP(And, "logical_and", a& b, V(a != 0 && b != 0), (bool), true, kCoarse, kCoarse, kExact)
BINARY_OP(Or, "logical_or", a | b, V(a != 0 || b != 0), (bool), true, kCoarse, kCoarse, kExact)
BINARY_OP(LogicalAnd, "logical_and", lazy::logical_and(a, b), V(a != 0 && b != 0), (bool), true, kCoarse, kCoarse,
          kExact)
BINARY_OP(LogicalOr, "logical_or", lazy::logical_or(a, b), V(a != 0 || b != 0), (bool), true, kCoarse, kCoarse,
          kExact)
BINARY_OP(Atan2, "atan2", lazy::atan2(a, b), std::atan2(static_cast<double>(a), static_cast<double>(b)),
          (flt_t<promote<A, B>>), true, kMulDom, kMulDom, transcendental_tol<R>())
BINARY_OP(Hypot, "hypot", lazy::hypot(a, b), std::hypot(static_cast<double>(a), static_cast<double>(b)),
          (flt_t<promote<A, B>>), true, kMulDom, kMulDom, transcendental_tol<R>())
BINARY_OP(LogicalXor, "logical_xor", lazy::logical_xor(a, b), V((a != 0) != (b != 0)), (bool), true, kCoarse, kCoarse,
          kExact)
#undef BINARY_OP
#undef STRIP

// a^b: in double for floating lanes; exact repeated multiplication for integer lanes.
struct Pow {
  static constexpr const char* name = "pow";
  template <class T>
  static constexpr bool supports = not_bool<T>;
  template <class A, class B>
  using result = promote<A, B>;
  template <class X, class Y>
  static auto apply(const X& a, const Y& b) {
    return lazy::pow(a, b);
  }
  template <class X, class Y>
  static constexpr bool callable = requires(const X& a, const Y& b) { lazy::pow(a, b); };
  template <class V>
  static V ref(V a, V b) {
    if constexpr (std::is_same_v<V, double>) {
      return std::pow(a, b);
    } else {
      V r = 1;
      for (V k = 0; k < b; ++k) r *= a;
      return r;
    }
  }
  static Domain domain_a() { return kPowBase; }
  static Domain domain_b() { return kPowExp; }
  template <class R>
  static Tol tol() {
    return transcendental_tol<R>();
  }
};

// ---- runners --------------------------------------------------------------------------

template <class Op, class T>
void run_unary() {
  using E = decltype(Op::apply(std::declval<const Tensor<T>&>()));
  using R = typename E::value_type;
  static_assert(std::is_same_v<R, typename Op::template result<T>>, "result type differs from PyTorch's");
  using RL = RefLane<T, R>;
  const Tol tol = Op::template tol<R>();
  double cost = 0;
  for (const std::int64_t entry : kAllSizes) {
    const std::int64_t n = resolve_size(entry, cost);
    const auto in = gen<T>(n, Op::domain(), static_cast<std::uint64_t>(n));
    const Tensor<R> out = Op::apply(make<T>(in, Shape{n}));
    if (n > 0) cost = out.node()->cost_per_element();
    const auto e = expected<R>(in.size(), [&](std::size_t i) { return Op::ref(RL::in(in[i])); });
    check_run<R>(Op::name, {lazy::dtype_of<T>()}, "", n, out, e, tol, {column(in)});
  }
}

// `sizes` may hold kThreaded after an entry of at least one element.
template <class Op, class A, class B = A>
void run_binary_tensors(const std::vector<std::int64_t>& sizes, std::uint64_t salt = 0) {
  using E = decltype(Op::apply(std::declval<const Tensor<A>&>(), std::declval<const Tensor<B>&>()));
  using R = typename E::value_type;
  static_assert(std::is_same_v<R, typename Op::template result<A, B>>, "result type differs from PyTorch's");
  using RL = RefLane<A, B, R>;
  const Tol tol = Op::template tol<R>();
  double cost = 0;
  for (const std::int64_t entry : sizes) {
    const std::int64_t n = resolve_size(entry, cost);
    const auto va = gen<A>(n, Op::domain_a(), salt + 2 * static_cast<std::uint64_t>(n));
    const auto vb = gen<B>(n, Op::domain_b(), salt + 2 * static_cast<std::uint64_t>(n) + 1);
    const Tensor<R> out = Op::apply(make<A>(va, Shape{n}), make<B>(vb, Shape{n}));
    if (n > 0) cost = out.node()->cost_per_element();
    const auto e = expected<R>(va.size(), [&](std::size_t i) { return Op::ref(RL::in(va[i]), RL::in(vb[i])); });
    check_run<R>(Op::name, {lazy::dtype_of<A>(), lazy::dtype_of<B>()}, "", n, out, e, tol, {column(va), column(vb)});
  }
}

// tensor OP scalar and scalar OP tensor, the scalar typed as PyTorch's weak scalars. `sizes`
// may hold kThreaded (sized from tensor OP scalar's kernel) after an entry of one element or more.
template <class Op, class T>
void run_binary_scalars(const std::vector<std::int64_t>& sizes) {
  const auto s_right = natural_scalar<T>(Op::domain_b(), 99);
  const auto s_left = natural_scalar<T>(Op::domain_a(), 98);
  using S = std::remove_cvref_t<decltype(s_right)>;
  using W = lazy::weak_scalar_t<T, S>;  // checked against PyTorch's table in test_dtype
  using ER = decltype(Op::apply(std::declval<const Tensor<T>&>(), s_right));
  using EL = decltype(Op::apply(s_left, std::declval<const Tensor<T>&>()));
  using RR = typename ER::value_type;
  using RLt = typename EL::value_type;
  static_assert(std::is_same_v<RR, typename Op::template result<T, W>>);
  static_assert(std::is_same_v<RLt, typename Op::template result<W, T>>);
  const W wr = scalar_as<W>(s_right), wl = scalar_as<W>(s_left);
  const std::string right = "(tensor, " + show(s_right) + ") ", left = "(" + show(s_left) + ", tensor) ";
  double cost = 0;
  for (const std::int64_t entry : sizes) {
    const std::int64_t n = resolve_size(entry, cost);
    const auto va = gen<T>(n, Op::domain_a(), 7 * static_cast<std::uint64_t>(n) + 3);
    const auto vb = gen<T>(n, Op::domain_b(), 7 * static_cast<std::uint64_t>(n) + 4);
    {
      using RL = RefLane<T, W, RR>;
      const Tensor<RR> out = Op::apply(make<T>(va, Shape{n}), s_right);
      if (n > 0) cost = out.node()->cost_per_element();
      const auto e = expected<RR>(va.size(), [&](std::size_t i) { return Op::ref(RL::in(va[i]), RL::in(wr)); });
      check_run<RR>(Op::name, {lazy::dtype_of<T>()}, right, n, out, e, Op::template tol<RR>(), {column(va)});
    }
    {
      using RL = RefLane<W, T, RLt>;
      const Tensor<RLt> out = Op::apply(s_left, make<T>(vb, Shape{n}));
      const auto e = expected<RLt>(vb.size(), [&](std::size_t i) { return Op::ref(RL::in(wl), RL::in(vb[i])); });
      check_run<RLt>(Op::name, {lazy::dtype_of<T>()}, left, n, out, e, Op::template tol<RLt>(), {column(vb)});
    }
  }
}

// Strides of an input of shape `in` in the coordinates of output shape `out`: 0 where the
// input is broadcast (missing or size-1 dimension).
inline std::array<std::int64_t, 8> bcast_strides(const Shape& out, const Shape& in) {
  std::array<std::int64_t, 8> st{};
  const int off = out.rank() - in.rank();
  std::int64_t acc = 1;
  for (int d = in.rank() - 1; d >= 0; --d) {
    st[static_cast<std::size_t>(d + off)] = in[d] == 1 ? 0 : acc;
    acc *= in[d];
  }
  return st;
}

inline Shape ref_broadcast(const Shape& a, const Shape& b) {
  const int r = std::max(a.rank(), b.rank());
  std::vector<std::int64_t> out(static_cast<std::size_t>(r));
  for (int k = 0; k < r; ++k) {
    const std::int64_t da = k < a.rank() ? a[a.rank() - 1 - k] : 1, db = k < b.rank() ? b[b.rank() - 1 - k] : 1;
    out[static_cast<std::size_t>(r - 1 - k)] = da == 1 ? db : da;
  }
  return Shape(out);
}

// Each output element's two operands, for inputs va of shape sa and vb of shape sb broadcast
// to `so` (an odometer over the output index). Per dtype, not per op.
template <class T>
void broadcast_operands(const std::vector<T>& va, const Shape& sa, const std::vector<T>& vb, const Shape& sb,
                        const Shape& so, std::vector<T>& xs, std::vector<T>& ys) {
  const auto size = static_cast<std::size_t>(so.numel());
  xs.resize(size);
  ys.resize(size);
  const auto st_a = bcast_strides(so, sa), st_b = bcast_strides(so, sb);
  std::array<std::int64_t, 8> idx{};
  std::int64_t ia = 0, ib = 0;
  for (std::size_t i = 0; i < size; ++i) {
    xs[i] = va[static_cast<std::size_t>(ia)];
    ys[i] = vb[static_cast<std::size_t>(ib)];
    for (int d = so.rank() - 1; d >= 0; --d) {
      const auto k = static_cast<std::size_t>(d);
      ia += st_a[k];
      ib += st_b[k];
      if (++idx[k] < so[d]) break;
      ia -= st_a[k] * so[d];
      ib -= st_b[k] * so[d];
      idx[k] = 0;
    }
  }
}

template <class Op, class T>
void run_broadcast(const Shape& sa, const Shape& sb) {
  using R = typename decltype(Op::apply(std::declval<const Tensor<T>&>(), std::declval<const Tensor<T>&>()))::value_type;
  using RL = RefLane<T, R>;
  const auto va = gen<T>(sa.numel(), Op::domain_a(), 41 + static_cast<std::uint64_t>(sa.numel()));
  const auto vb = gen<T>(sb.numel(), Op::domain_b(), 42 + static_cast<std::uint64_t>(sb.numel()));
  const Shape so = ref_broadcast(sa, sb);
  const Tensor<R> out = Op::apply(make<T>(va, sa), make<T>(vb, sb));
  std::vector<T> xs, ys;
  broadcast_operands(va, sa, vb, sb, so, xs, ys);
  const auto e = expected<R>(xs.size(), [&](std::size_t i) { return Op::ref(RL::in(T(xs[i])), RL::in(T(ys[i]))); });
  check_output<R>(Op::name, {lazy::dtype_of<T>()}, sa.str() + " with " + sb.str(), so, out, e, Op::template tol<R>(),
                  {column(xs), column(ys)});
}

}  // namespace lazytest
