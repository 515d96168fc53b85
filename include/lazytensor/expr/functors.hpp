#pragma once
// Element-wise op functors. Each one says how it types its result (PyTorch promotion) and
// computes on a value `V` that is either a scalar or an xsimd batch of the kernel's lane
// type, so one definition serves the SIMD main loop and the scalar tail.

#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

#include <lazytensor/core/simd.hpp>

#include <lazytensor/core/dtype.hpp>

namespace lazy::ops {

namespace detail {
// Scalar counterpart of xsimd::select, so ops read the same for both kinds of V.
template <class V>
inline V select(bool c, const V& a, const V& b) {
  return c ? a : b;
}
using xsimd::select;

/// a != b that is true when either side is NaN. xsimd 8.1 compiles batch `!=` as an
/// ordered compare on AVX/AVX-512 (false with NaN), unlike C++ and SSE2.
template <class V>
inline auto not_equal(const V& a, const V& b) {
  return !(a == b);
}
/// And, or and exclusive or of two masks: a scalar bool or an xsimd batch_bool. Bools take the
/// logical operators (`&` and `|` on bools draw Clang's -Wbitwise-instead-of-logical in user
/// programs). Batches avoid xsimd 8.1's `^` (an or on AVX-512 masks) and `!=` (on SSE2 it
/// compares float masks as floats, and an all-ones mask is a NaN).
template <class M>
inline M mask_and(const M& x, const M& y) {
  if constexpr (std::is_same_v<M, bool>) {
    return x && y;
  } else {
    return x & y;
  }
}
template <class M>
inline M mask_or(const M& x, const M& y) {
  if constexpr (std::is_same_v<M, bool>) {
    return x || y;
  } else {
    return x | y;
  }
}
template <class M>
inline M mask_xor(const M& x, const M& y) {
  if constexpr (std::is_same_v<M, bool>) {
    return x != y;
  } else {
    return (x & !y) | (y & !x);
  }
}
/// True where a is NaN (false for integers).
template <class V>
inline auto is_nan(const V& a) {
  return not_equal(a, a);
}

/// 1 where the mask holds, else 0, for a scalar bool or an xsimd batch_bool.
template <class V, class M>
inline V from_bool(const M& m) {
  if constexpr (std::is_arithmetic_v<V>) {
    return m ? V(1) : V(0);
  } else {
    return xsimd::select(m, V(1), V(0));
  }
}
/// Element type of a scalar or an xsimd batch.
template <class V>
struct lane_value {
  using type = V;
};
template <class T, class A>
struct lane_value<xsimd::batch<T, A>> {
  using type = T;
};

/// a^b of integers as PyTorch computes it: wrapping (modulo 2^bits, by squaring on the
/// unsigned type) where the power leaves the type, and for a negative exponent the
/// truncated 1 / a^-b: 1 for a base of 1, -1 or 1 by parity for -1, else 0.
template <class V>
inline V int_pow(V a, V b) {
  if (b < 0) return a == V(1) ? V(1) : a == V(-1) ? ((b & 1) ? V(-1) : V(1)) : V(0);
  using U = std::make_unsigned_t<V>;
  U r = 1, x = static_cast<U>(a);
  for (U e = static_cast<U>(b); e; e >>= 1) {
    if (e & 1) r *= x;
    x *= x;
  }
  return static_cast<V>(r);
}

// Integer division by zero: PyTorch's CPU kernels raise, but a lazy graph, like XLA's,
// cannot stop inside a kernel (one that throws could leave a donated input buffer half
// written). So integers take XLA's values: x % 0 == x,
// x // 0 == -1; and INT_MIN // -1 == INT_MIN, INT_MIN % -1 == 0.

/// -a on the unsigned type: INT_MIN stays INT_MIN, as PyTorch's integers wrap.
template <class S>
inline S wrapping_neg(S a) {
  using U = std::make_unsigned_t<S>;
  return static_cast<S>(U(0) - static_cast<U>(a));
}

/// Python's modulo (torch.remainder): fmod, moved into the divisor's sign. Integers by
/// zero give the dividend (XLA's value, above); by -1 give 0 (INT_MIN % -1 overflows in C++).
template <class S>
inline S py_mod(S a, S b) {
  if constexpr (std::is_integral_v<S>) {
    if (b == 0) return a;
    if (b == -1) return 0;
    const S r = a % b;
    return r != 0 && ((r < 0) != (b < 0)) ? static_cast<S>(r + b) : r;
  } else {
    const S r = std::fmod(a, b);
    return r != 0 && ((r < 0) != (b < 0)) ? r + b : r;
  }
}
/// C's fmod (torch.fmod): the dividend's sign.
template <class S>
inline S c_fmod(S a, S b) {
  if constexpr (std::is_integral_v<S>) {
    if (b == 0) return a;
    return b == -1 ? S(0) : static_cast<S>(a % b);
  } else {
    return std::fmod(a, b);
  }
}
/// floor(a / b) (torch.floor_divide). Floating values as PyTorch computes them, from the
/// exact fmod rather than a rounded quotient; integers by zero give -1 (XLA's value, above),
/// and INT_MIN / -1 wraps to INT_MIN.
template <class S>
inline S floor_div(S a, S b) {
  if constexpr (std::is_integral_v<S>) {
    if (b == 0) return S(-1);
    if (b == -1) return wrapping_neg(a);
    const S q = static_cast<S>(a / b);
    return (a % b != 0) && ((a < 0) != (b < 0)) ? static_cast<S>(q - 1) : q;
  } else {
    if (b == 0) return a / b;
    const S mod = std::fmod(a, b);
    S div = (a - mod) / b;
    if (mod != 0 && ((b < 0) != (mod < 0))) div -= S(1);
    if (div == 0) return std::copysign(S(0), a / b);
    S q = std::floor(div);
    if (div - q > S(0.5)) q += S(1);
    return q;
  }
}
/// trunc(a / b) for the derivative of fmod.
template <class S>
inline S trunc_div(S a, S b) {
  if constexpr (std::is_integral_v<S>) {
    return b == 0 ? S(0) : b == -1 ? wrapping_neg(a) : static_cast<S>(a / b);
  } else {
    return std::trunc(a / b);
  }
}

/// Applies a scalar function of two values lane by lane (ops with no exact SIMD form).
template <class V, class F>
inline V map_lanes2(const V& a, const V& b, F f) {
  if constexpr (std::is_arithmetic_v<V>) {
    return f(a, b);
  } else {
    alignas(64) typename V::value_type x[V::size], y[V::size];
    a.store_aligned(x);
    b.store_aligned(y);
    for (std::size_t i = 0; i < V::size; ++i) x[i] = f(x[i], y[i]);
    return V::load_aligned(x);
  }
}

/// Applies a scalar function to every lane of a value.
template <class V, class F>
inline V map_lanes(const V& a, F f) {
  if constexpr (std::is_arithmetic_v<V>) {
    return f(a);
  } else {
    alignas(64) typename V::value_type tmp[V::size];
    a.store_aligned(tmp);
    for (auto& x : tmp) x = f(x);
    return V::load_aligned(tmp);
  }
}
}  // namespace detail

// ---- result-type rules ---------------------------------------------------------------

template <class A, class B = A>
using promoted = promote_t<A, B>;

#define LAZY_STRIP(...) __VA_ARGS__
// Each functor also declares its local derivative d<I>(operands..., y): the partial of
// the result y with respect to operand I, as an expression of the operands and y. The
// chain rule over an expression's type (expr/dual.hpp) turns these into one fused
// gradient kernel per leaf.
#define LAZY_UNARY_OP(NAME, STR, COST, RESULT, BODY, DERIV)      \
  struct NAME {                                                  \
    static constexpr const char* name = STR;                     \
    static constexpr double cost = COST;                         \
    template <class T>                                           \
    using result = LAZY_STRIP RESULT;                                       \
    template <class V>                                           \
    static V apply(const V& a) {                                 \
      using namespace detail;                                    \
      using std::exp, std::log, std::log1p, std::expm1, std::sqrt, std::abs, std::sin, std::cos, \
          std::tanh, std::erf, std::trunc, std::floor, std::ceil, std::nearbyint, std::log2, std::log10, std::tan, \
          std::asin, std::acos, std::atan, std::sinh, std::cosh, std::asinh, std::acosh, std::atanh;              \
      LAZY_STRIP BODY                                            \
    }                                                            \
    template <int I, class V>                                    \
    static V d([[maybe_unused]] const V& a, [[maybe_unused]] const V& y) { \
      using namespace detail;                                    \
      using std::exp, std::log, std::sqrt, std::sin, std::cos, std::erf, std::sinh, std::cosh; \
      return LAZY_STRIP DERIV;                                   \
    }                                                            \
  };

#define LAZY_BINARY_OP(NAME, STR, COST, RESULT, BODY, D0, D1) \
  struct NAME {                                       \
    static constexpr const char* name = STR;          \
    static constexpr double cost = COST;              \
    template <class A, class B>                       \
    using result = LAZY_STRIP RESULT;                            \
    template <class V>                                \
    static V apply(const V& a, const V& b) {          \
      using namespace detail;                         \
      using std::pow, std::atan2, std::hypot;         \
      LAZY_STRIP BODY                                 \
    }                                                 \
    template <int I, class V>                         \
    static V d([[maybe_unused]] const V& a, [[maybe_unused]] const V& b, [[maybe_unused]] const V& y) { \
      using namespace detail;                         \
      using std::pow, std::log;                       \
      if constexpr (I == 0) return LAZY_STRIP D0;     \
      else return LAZY_STRIP D1;                      \
    }                                                 \
  };

// Unary ops. Results of floating-only functions on integers are float, as in PyTorch.
LAZY_UNARY_OP(Neg, "neg", 1, (T), (return -a;), (V(-1)))
LAZY_UNARY_OP(Identity, "identity", 0.5, (T), (return a;), (V(1)))
LAZY_UNARY_OP(Exp, "exp", 8, (to_floating_t<T>), (return exp(a);), (y))
LAZY_UNARY_OP(Log, "log", 8, (to_floating_t<T>), (return log(a);), (V(1) / a))
LAZY_UNARY_OP(Log1p, "log1p", 10, (to_floating_t<T>), (return log1p(a);), (V(1) / (V(1) + a)))
LAZY_UNARY_OP(Expm1, "expm1", 10, (to_floating_t<T>), (return expm1(a);), (y + V(1)))
LAZY_UNARY_OP(Sqrt, "sqrt", 4, (to_floating_t<T>), (return sqrt(a);), (V(0.5) / y))
// Full-precision 1/sqrt: xsimd::rsqrt is an approximation on x86.
LAZY_UNARY_OP(Rsqrt, "rsqrt", 5, (to_floating_t<T>), (return V(1) / sqrt(a);), (V(-0.5) * y * y * y))
LAZY_UNARY_OP(Square, "square", 1, (T), (return a * a;), (V(2) * a))
// Integers: |INT_MIN| wraps to INT_MIN as in PyTorch, on the unsigned type (std::abs of it
// is undefined).
LAZY_UNARY_OP(Abs, "abs", 1, (T), (
  if constexpr (std::is_integral_v<V>) {
    return a < V(0) ? wrapping_neg(a) : a;
  } else {
    return abs(a);
  }), (from_bool<V>(a > V(0)) - from_bool<V>(a < V(0))))
LAZY_UNARY_OP(Sign, "sign", 2, (T), (return from_bool<V>(a > V(0)) - from_bool<V>(a < V(0));), (V(0)))
LAZY_UNARY_OP(Sin, "sin", 10, (to_floating_t<T>), (return sin(a);), (cos(a)))
LAZY_UNARY_OP(Cos, "cos", 10, (to_floating_t<T>), (return cos(a);), (-sin(a)))
LAZY_UNARY_OP(Tanh, "tanh", 10, (to_floating_t<T>), (return tanh(a);), (V(1) - y * y))
LAZY_UNARY_OP(Sigmoid, "sigmoid", 10, (to_floating_t<T>), (return V(1) / (V(1) + exp(-a));), (y * (V(1) - y)))
// relu keeps NaN (NaN < 0 is false), like torch.relu.
LAZY_UNARY_OP(Relu, "relu", 1, (T), (return select(a < V(0), V(0), a);), (from_bool<V>(y > V(0))))
// Exact (erf) GELU, torch's default approximate='none'.
LAZY_UNARY_OP(Gelu, "gelu", 12, (to_floating_t<T>), (return V(0.5) * a * (V(1) + erf(a * V(0.70710678118654752440)));),
              (V(0.5) * (V(1) + erf(a * V(0.70710678118654752440))) + a * V(0.39894228040143267794) * exp(V(-0.5) * a * a)))
LAZY_UNARY_OP(Silu, "silu", 10, (to_floating_t<T>), (return a / (V(1) + exp(-a));),
              ((V(1) + a - y) / (V(1) + exp(-a))))
// softplus with torch's default threshold 20: linear above it.
LAZY_UNARY_OP(Softplus, "softplus", 12, (to_floating_t<T>), (return select(a > V(20), a, log1p(exp(a)));),
              (select(a > V(20), V(1), V(1) / (V(1) + exp(-a)))))
LAZY_UNARY_OP(LogicalNot, "logical_not", 1, (bool), (return from_bool<V>(a == V(0));), (V(0)))
LAZY_UNARY_OP(Reciprocal, "reciprocal", 2, (to_floating_t<T>), (return V(1) / a;), (-y * y))
LAZY_UNARY_OP(Log2, "log2", 8, (to_floating_t<T>), (return log2(a);), (V(1) / (a * V(0.69314718055994530942))))
LAZY_UNARY_OP(Log10, "log10", 8, (to_floating_t<T>), (return log10(a);), (V(1) / (a * V(2.30258509299404568402))))
LAZY_UNARY_OP(Erf, "erf", 10, (to_floating_t<T>), (return erf(a);), (V(1.12837916709551257390) * exp(-a * a)))
// Trigonometric and hyperbolic functions and their inverses (float results, as in PyTorch).
// Outside an inverse's domain the value is NaN, and so is the derivative.
LAZY_UNARY_OP(Tan, "tan", 12, (to_floating_t<T>), (return tan(a);), (V(1) + y * y))
LAZY_UNARY_OP(Asin, "asin", 12, (to_floating_t<T>), (return asin(a);), (V(1) / sqrt(V(1) - a * a)))
LAZY_UNARY_OP(Acos, "acos", 12, (to_floating_t<T>), (return acos(a);), (V(-1) / sqrt(V(1) - a * a)))
LAZY_UNARY_OP(Atan, "atan", 12, (to_floating_t<T>), (return atan(a);), (V(1) / (V(1) + a * a)))
LAZY_UNARY_OP(Sinh, "sinh", 10, (to_floating_t<T>), (return sinh(a);), (cosh(a)))
LAZY_UNARY_OP(Cosh, "cosh", 10, (to_floating_t<T>), (return cosh(a);), (sinh(a)))
LAZY_UNARY_OP(Asinh, "asinh", 12, (to_floating_t<T>), (return asinh(a);), (V(1) / sqrt(a * a + V(1))))
LAZY_UNARY_OP(Acosh, "acosh", 12, (to_floating_t<T>), (return acosh(a);), (V(1) / sqrt(a * a - V(1))))
LAZY_UNARY_OP(Atanh, "atanh", 12, (to_floating_t<T>), (return atanh(a);), (V(1) / (V(1) - a * a)))
// Classification: bool results, integers are always finite.
LAZY_UNARY_OP(IsNan, "isnan", 1, (bool), (return from_bool<V>(is_nan(a));), (V(0)))
LAZY_UNARY_OP(IsInf, "isinf", 1, (bool), (
  if constexpr (std::is_integral_v<typename lane_value<V>::type>) {
    return V(0);
  } else {
    return from_bool<V>(abs(a) == V(std::numeric_limits<typename lane_value<V>::type>::infinity()));
  }), (V(0)))
LAZY_UNARY_OP(IsFinite, "isfinite", 1, (bool), (
  if constexpr (std::is_integral_v<typename lane_value<V>::type>) {
    return V(1);
  } else {
    return from_bool<V>(abs(a) < V(std::numeric_limits<typename lane_value<V>::type>::infinity()));  // false for NaN
  }), (V(0)))
// Rounding keeps the type (an integer is already whole) and has a zero derivative, as in
// PyTorch; round is half to even (nearbyint in the default rounding mode, torch.round).
LAZY_UNARY_OP(Floor, "floor", 1, (T), (if constexpr (std::is_integral_v<V>) return a; else return floor(a);), (V(0)))
LAZY_UNARY_OP(Ceil, "ceil", 1, (T), (if constexpr (std::is_integral_v<V>) return a; else return ceil(a);), (V(0)))
LAZY_UNARY_OP(Round, "round", 1, (T), (if constexpr (std::is_integral_v<V>) return a; else return nearbyint(a);), (V(0)))
LAZY_UNARY_OP(Trunc, "trunc", 1, (T), (if constexpr (std::is_integral_v<V>) return a; else return trunc(a);), (V(0)))

// Binary ops.
LAZY_BINARY_OP(Add, "add", 1, (promoted<A, B>), (return a + b;), (V(1)), (V(1)))
LAZY_BINARY_OP(Sub, "sub", 1, (promoted<A, B>), (return a - b;), (V(1)), (V(-1)))
LAZY_BINARY_OP(Mul, "mul", 1, (promoted<A, B>), (return a * b;), (b), (a))
LAZY_BINARY_OP(Div, "div", 2, (to_floating_t<promoted<A, B>>), (return a / b;), (V(1) / b), (-y / b))
// Modulo and floor division go lane by lane through the exact scalar forms above (a SIMD
// a - floor(a / b) * b rounds the quotient first: wrong by up to b for large a / b).
LAZY_BINARY_OP(Remainder, "remainder", 20, (promoted<A, B>),
               (return map_lanes2(a, b, [](auto x, auto y) { return py_mod(x, y); });), (V(1)),
               (-map_lanes2(a, b, [](auto x, auto y) { return floor_div(x, y); })))
LAZY_BINARY_OP(Fmod, "fmod", 20, (promoted<A, B>), (return map_lanes2(a, b, [](auto x, auto y) { return c_fmod(x, y); });),
               (V(1)), (-map_lanes2(a, b, [](auto x, auto y) { return trunc_div(x, y); })))
// Piecewise constant: a zero derivative, floor's (PyTorch refuses to differentiate it).
LAZY_BINARY_OP(FloorDivide, "floor_divide", 20, (promoted<A, B>),
               (return map_lanes2(a, b, [](auto x, auto y) { return floor_div(x, y); });), (V(0)), (V(0)))
// Batches: xsimd's pow maps a zero base to 0 for every exponent (0^0 and 0^-1 included),
// turns inf^0, NaN^0, 1^NaN and (-1)^inf into NaN, and tests an exponent's parity as
// is_even(b - 1), wrong once b - 1 == b (|b| >= 2^24 for float). So the power is taken of
// |a| and given its sign here, with the IEEE cases of std::pow/torch.pow patched in.
// Integers wrap as in PyTorch (int_pow) instead of going through double.
LAZY_BINARY_OP(Pow, "pow", 12, (promoted<A, B>), (
  if constexpr (std::is_integral_v<V>) {
    return int_pow(a, b);
  } else if constexpr (std::is_arithmetic_v<V>) {
    return V(pow(a, b));
  } else {
    using T = typename V::value_type;
    const V inf(std::numeric_limits<T>::infinity());
    const V ab = xsimd::abs(a);
    const auto integral = xsimd::trunc(b) == b;  // false for NaN, true for +-inf
    const V half = b * V(0.5);
    // Odd integers: floats of magnitude 2^24 (2^53) and above are all even.
    const auto odd = integral & not_equal(xsimd::trunc(half), half);
    const auto negative = a < V(0);
    V z = pow(ab, b);
    z = select(negative & odd, -z, z);
    z = select(negative & !integral & (ab < inf), V(std::numeric_limits<T>::quiet_NaN()), z);
    const auto zero_base = a == V(0);  // a signed zero keeps its sign for odd exponents
    z = select(zero_base, select(b < V(0), select(odd, xsimd::copysign(inf, a), inf), select(odd, a, V(0))), z);
    z = select(zero_base & is_nan(b), b, z);
    return select((b == V(0)) | (a == V(1)) | ((a == V(-1)) & (xsimd::abs(b) == inf)), V(1), z);
  }),
  // torch.pow's backward: b * a^(b-1) (0 where b == 0), and y * log(a) (0 where a == 0, b >= 0).
  (select(b == V(0), V(0), b * Pow::apply(a, b - V(1)))),
  (select((a == V(0)) & (b >= V(0)), V(0), y * log(a))))
// maximum/minimum propagate NaN from either side, like torch.maximum.
LAZY_BINARY_OP(Maximum, "maximum", 2, (promoted<A, B>), (return select((a > b) | is_nan(a), a, b);),
               (from_bool<V>(a > b) + V(0.5) * from_bool<V>(a == b)), (from_bool<V>(b > a) + V(0.5) * from_bool<V>(a == b)))
LAZY_BINARY_OP(Minimum, "minimum", 2, (promoted<A, B>), (return select((a < b) | is_nan(a), a, b);),
               (from_bool<V>(a < b) + V(0.5) * from_bool<V>(a == b)), (from_bool<V>(b < a) + V(0.5) * from_bool<V>(a == b)))
LAZY_BINARY_OP(Eq, "eq", 1, (bool), (return from_bool<V>(a == b);), (V(0)), (V(0)))
LAZY_BINARY_OP(Ne, "ne", 1, (bool), (return from_bool<V>(not_equal(a, b));), (V(0)), (V(0)))
LAZY_BINARY_OP(Lt, "lt", 1, (bool), (return from_bool<V>(a < b);), (V(0)), (V(0)))
LAZY_BINARY_OP(Le, "le", 1, (bool), (return from_bool<V>(a <= b);), (V(0)), (V(0)))
LAZY_BINARY_OP(Gt, "gt", 1, (bool), (return from_bool<V>(a > b);), (V(0)), (V(0)))
LAZY_BINARY_OP(Ge, "ge", 1, (bool), (return from_bool<V>(a >= b);), (V(0)), (V(0)))
LAZY_BINARY_OP(LogicalAnd, "logical_and", 1, (bool), (return from_bool<V>(mask_and(not_equal(a, V(0)), not_equal(b, V(0))));), (V(0)), (V(0)))
LAZY_BINARY_OP(LogicalXor, "logical_xor", 1, (bool), (return from_bool<V>(mask_xor(not_equal(a, V(0)), not_equal(b, V(0))));), (V(0)), (V(0)))
// atan2(a, b): the angle of the point (b, a), quadrant-aware; float results. xsimd 8.1's
// batch atan2 gives NaN where both are zero or both infinite: those take C's values here.
LAZY_BINARY_OP(Atan2, "atan2", 14, (to_floating_t<promoted<A, B>>), (
  if constexpr (std::is_arithmetic_v<V>) {
    return atan2(a, b);
  } else {
    const V pi(3.14159265358979323846), zero(0), inf(std::numeric_limits<typename V::value_type>::infinity());
    const auto b_negative = xsimd::copysign(V(1), b) < zero;  // -0 included
    const V both_zero = select(b_negative, pi, zero);
    const V both_inf = select(b_negative, pi * V(0.75), pi * V(0.25));
    V r = xsimd::atan2(a, b);
    r = select((a == zero) & (b == zero), xsimd::copysign(both_zero, a), r);
    return select((xsimd::abs(a) == inf) & (xsimd::abs(b) == inf), xsimd::copysign(both_inf, a), r);
  }), (b / (a * a + b * b)), (-a / (a * a + b * b)))
// sqrt(a^2 + b^2) without overflow or underflow in the squares (torch.hypot), lane by
// lane through the C library: xsimd 8.1's batch hypot squares directly (overflow above
// 1.8e19 in float, underflow below 1e-19), and a scaled form is off by up to 2 ulp where
// torch's is within half of one. An infinity wins over NaN, as in C. At (0, 0) the
// derivative is NaN, as torch's a / y.
LAZY_BINARY_OP(Hypot, "hypot", 20, (to_floating_t<promoted<A, B>>),
               (return map_lanes2(a, b, [](auto x, auto y) { return std::hypot(x, y); });), (a / y), (b / y))
LAZY_BINARY_OP(LogicalOr, "logical_or", 1, (bool), (return from_bool<V>(mask_or(not_equal(a, V(0)), not_equal(b, V(0))));), (V(0)), (V(0)))

#undef LAZY_UNARY_OP
#undef LAZY_BINARY_OP
#undef LAZY_STRIP

/// clamp(x, lo, hi) = min(max(x, lo), hi), as torch.clamp: NaN in any operand gives NaN, and
/// hi wins when lo > hi. One op rather than minimum(maximum(x, lo), hi): the ties of those
/// split the gradient in half at a bound, where torch's clamp_backward passes all of it to x
/// wherever lo <= x <= hi. A tensor bound gets it where it is the result
/// (clamp_backward_min_max: lo where x < lo < hi, hi where x > hi or hi < lo).
struct Clamp {
  static constexpr const char* name = "clamp";
  static constexpr double cost = 4;
  template <class X, class L, class H>
  using result = promoted<promoted<X, L>, H>;
  template <class V>
  static V apply(const V& x, const V& lo, const V& hi) {
    return Minimum::apply(Maximum::apply(x, lo), hi);
  }
  template <int I, class V>
  static V d(const V& x, const V& lo, const V& hi, const V&) {
    using namespace detail;
    if constexpr (I == 0)
      return from_bool<V>((x >= lo) & (x <= hi));
    else if constexpr (I == 1)
      return from_bool<V>((x < lo) & (lo < hi));
    else
      return from_bool<V>((x > hi) | (hi < lo));
  }
};

/// lerp(a, b, w) = a + w * (b - a), with torch.lerp's formula: from b's side where w >= 0.5,
/// so that w == 1 gives b exactly (torch's vector kernel fuses the multiply-adds, so the
/// low bits may differ from it).
struct Lerp {
  static constexpr const char* name = "lerp";
  static constexpr double cost = 4;
  template <class A, class B, class W>
  using result = promoted<promoted<A, B>, W>;
  template <class V>
  static V apply(const V& a, const V& b, const V& w) {
    using namespace detail;
    return select(w < V(0.5), a + w * (b - a), b - (b - a) * (V(1) - w));
  }
  template <int I, class V>
  static V d(const V& a, const V& b, const V& w, const V&) {
    if constexpr (I == 0) return V(1) - w;
    else if constexpr (I == 1) return w;
    else return b - a;
  }
};

/// where(cond, a, b): a where cond is non-zero.
struct Where {
  static constexpr const char* name = "where";
  static constexpr double cost = 2;
  template <class C, class A, class B>
  using result = promoted<A, B>;
  template <class V>
  static V apply(const V& c, const V& a, const V& b) {
    using namespace detail;
    return select(not_equal(c, V(0)), a, b);
  }
  template <int I, class V>
  static V d(const V& c, const V&, const V&, const V&) {
    using namespace detail;
    if constexpr (I == 0) return V(0);
    else if constexpr (I == 1) return from_bool<V>(not_equal(c, V(0)));
    else return from_bool<V>(c == V(0));
  }
};

/// Explicit conversion to U. Within a kernel values stay in the lane type; conversion to
/// an integer truncates toward zero and to bool tests for non-zero, as static_cast does.
template <Element U>
struct Cast {
  static constexpr const char* name = "cast";
  static constexpr double cost = 1;
  template <class T>
  using result = U;
  template <class V>
  static V apply(const V& a) {
    using namespace detail;
    if constexpr (std::is_same_v<U, bool>) {
      return from_bool<V>(not_equal(a, V(0)));
    } else if constexpr (is_integral_v<U>) {
      if constexpr (std::is_floating_point_v<V>) {
        return std::trunc(a);
      } else if constexpr (std::is_arithmetic_v<V>) {
        return a;
      } else if constexpr (std::is_floating_point_v<typename V::value_type>) {
        return xsimd::trunc(a);
      } else {
        return a;
      }
    } else if constexpr (std::is_same_v<U, bfloat16> || std::is_same_v<U, float>) {
      // Narrowing to a floating type rounds even inside a wider lane, as static_cast does
      // (x.to(bfloat16).to(float) in PyTorch): round each value through U.
      using S = typename detail::lane_value<V>::type;
      if constexpr (std::is_same_v<S, float> && std::is_same_v<U, float>) {
        return a;
      } else {
        return detail::map_lanes(a, [](S x) { return static_cast<S>(static_cast<float>(U(static_cast<float>(x)))); });
      }
    } else {
      return a;
    }
  }
  /// Conversions to floating types pass gradients straight through (rounding to bfloat16
  /// included, as torch does); conversions to integers and bool stop them.
  template <int I, class V>
  static V d(const V&, const V&) {
    return V(is_floating_v<U> ? 1 : 0);
  }
};

}  // namespace lazy::ops
