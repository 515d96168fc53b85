#pragma once
// The operators and element-wise functions of tensors and expressions (`a * b + 1`,
// `relu(x)`, `where(c, a, b)`, ...): each builds an Expr node (expr/expr_node.hpp) and
// computes nothing; assigning it to a tensor, or reading it, makes it a pending node.

#include <concepts>
#include <cstdint>
#include <limits>
#include <optional>
#include <type_traits>
#include <utility>

#include <lazytensor/core/config.hpp>
#include <lazytensor/core/dtype.hpp>
#include <lazytensor/expr/expr_node.hpp>
#include <lazytensor/expr/functors.hpp>

namespace lazy {

// ---- operators ------------------------------------------------------------------------

#define LAZY_BINARY_OPERATOR(SYM, OP)                                   \
  template <class A, class B>                                          \
    requires expr::BinaryOperands<A, B>                                \
  auto operator SYM(A&& a, B&& b) {                                    \
    return expr::make<ops::OP>(std::forward<A>(a), std::forward<B>(b)); \
  }
LAZY_BINARY_OPERATOR(+, Add)
LAZY_BINARY_OPERATOR(*, Mul)
LAZY_BINARY_OPERATOR(/, Div)
LAZY_BINARY_OPERATOR(==, Eq)
LAZY_BINARY_OPERATOR(!=, Ne)
LAZY_BINARY_OPERATOR(<, Lt)
LAZY_BINARY_OPERATOR(<=, Le)
LAZY_BINARY_OPERATOR(>, Gt)
LAZY_BINARY_OPERATOR(>=, Ge)
LAZY_BINARY_OPERATOR(&, LogicalAnd)
LAZY_BINARY_OPERATOR(|, LogicalOr)
#undef LAZY_BINARY_OPERATOR

/// Element-wise subtraction (not with a bool operand, as in PyTorch: use the logical ops, or
/// cast the bool side first).
template <class A, class B>
  requires expr::BinaryOperands<A, B> && (!expr::BoolValued<A>) && (!expr::BoolValued<B>)
auto operator-(A&& a, B&& b) {
  return expr::make<ops::Sub>(std::forward<A>(a), std::forward<B>(b));
}

/// Element-wise negation (not of bool, as in PyTorch: use `!` / logical_not).
template <expr::ExprLike A>
  requires(!expr::BoolValued<A>)
auto operator-(A&& a) {
  return expr::make<ops::Neg>(std::forward<A>(a));
}
/// Element-wise logical not (a bool expression).
template <expr::ExprLike A>
auto operator!(A&& a) {
  return expr::make<ops::LogicalNot>(std::forward<A>(a));
}

// Unary functions. Those marked "not for bool" have no meaning on bool (PyTorch rejects
// them too): their constraint keeps a bool operand from compiling.

/// Element-wise e^x.
template <expr::ExprLike A>
auto exp(A&& a) {
  return expr::make<ops::Exp>(std::forward<A>(a));
}
/// Element-wise natural logarithm.
template <expr::ExprLike A>
auto log(A&& a) {
  return expr::make<ops::Log>(std::forward<A>(a));
}
/// Element-wise log(1 + x), accurate near 0.
template <expr::ExprLike A>
auto log1p(A&& a) {
  return expr::make<ops::Log1p>(std::forward<A>(a));
}
/// Element-wise e^x - 1, accurate near 0.
template <expr::ExprLike A>
auto expm1(A&& a) {
  return expr::make<ops::Expm1>(std::forward<A>(a));
}
/// Element-wise square root.
template <expr::ExprLike A>
auto sqrt(A&& a) {
  return expr::make<ops::Sqrt>(std::forward<A>(a));
}
/// Element-wise 1 / sqrt(x).
template <expr::ExprLike A>
auto rsqrt(A&& a) {
  return expr::make<ops::Rsqrt>(std::forward<A>(a));
}
/// Element-wise x * x (torch.square; one load of x where `x * x` has two). Not for bool.
template <expr::ExprLike A>
  requires(!expr::BoolValued<A>)
auto square(A&& a) {
  return expr::make<ops::Square>(std::forward<A>(a));
}
/// Element-wise absolute value. Not for bool.
template <expr::ExprLike A>
  requires(!expr::BoolValued<A>)
auto abs(A&& a) {
  return expr::make<ops::Abs>(std::forward<A>(a));
}
/// Element-wise sign: -1, 0 or 1. Not for bool.
template <expr::ExprLike A>
  requires(!expr::BoolValued<A>)
auto sign(A&& a) {
  return expr::make<ops::Sign>(std::forward<A>(a));
}
/// Element-wise sine.
template <expr::ExprLike A>
auto sin(A&& a) {
  return expr::make<ops::Sin>(std::forward<A>(a));
}
/// Element-wise cosine.
template <expr::ExprLike A>
auto cos(A&& a) {
  return expr::make<ops::Cos>(std::forward<A>(a));
}
/// Element-wise hyperbolic tangent.
template <expr::ExprLike A>
auto tanh(A&& a) {
  return expr::make<ops::Tanh>(std::forward<A>(a));
}
/// Element-wise logistic function 1 / (1 + e^-x).
template <expr::ExprLike A>
auto sigmoid(A&& a) {
  return expr::make<ops::Sigmoid>(std::forward<A>(a));
}
/// Element-wise max(x, 0), keeping NaN. Not for bool.
template <expr::ExprLike A>
  requires(!expr::BoolValued<A>)
auto relu(A&& a) {
  return expr::make<ops::Relu>(std::forward<A>(a));
}
/// Element-wise exact GELU, x * Phi(x).
template <expr::ExprLike A>
auto gelu(A&& a) {
  return expr::make<ops::Gelu>(std::forward<A>(a));
}
/// Element-wise x * sigmoid(x).
template <expr::ExprLike A>
auto silu(A&& a) {
  return expr::make<ops::Silu>(std::forward<A>(a));
}
/// Element-wise log(1 + e^x) (linear above 20).
template <expr::ExprLike A>
auto softplus(A&& a) {
  return expr::make<ops::Softplus>(std::forward<A>(a));
}
/// Element-wise 1 / x (torch.reciprocal; integers give float).
template <expr::ExprLike A>
auto reciprocal(A&& a) {
  return expr::make<ops::Reciprocal>(std::forward<A>(a));
}
/// Element-wise base-2 logarithm.
template <expr::ExprLike A>
auto log2(A&& a) {
  return expr::make<ops::Log2>(std::forward<A>(a));
}
/// Element-wise base-10 logarithm.
template <expr::ExprLike A>
auto log10(A&& a) {
  return expr::make<ops::Log10>(std::forward<A>(a));
}
/// Element-wise error function.
template <expr::ExprLike A>
auto erf(A&& a) {
  return expr::make<ops::Erf>(std::forward<A>(a));
}
/// Element-wise tangent.
template <expr::ExprLike A>
auto tan(A&& a) {
  return expr::make<ops::Tan>(std::forward<A>(a));
}
/// Element-wise arcsine (NaN outside [-1, 1]).
template <expr::ExprLike A>
auto asin(A&& a) {
  return expr::make<ops::Asin>(std::forward<A>(a));
}
/// Element-wise arccosine (NaN outside [-1, 1]).
template <expr::ExprLike A>
auto acos(A&& a) {
  return expr::make<ops::Acos>(std::forward<A>(a));
}
/// Element-wise arctangent.
template <expr::ExprLike A>
auto atan(A&& a) {
  return expr::make<ops::Atan>(std::forward<A>(a));
}
/// Element-wise hyperbolic sine.
template <expr::ExprLike A>
auto sinh(A&& a) {
  return expr::make<ops::Sinh>(std::forward<A>(a));
}
/// Element-wise hyperbolic cosine.
template <expr::ExprLike A>
auto cosh(A&& a) {
  return expr::make<ops::Cosh>(std::forward<A>(a));
}
/// Element-wise inverse hyperbolic sine.
template <expr::ExprLike A>
auto asinh(A&& a) {
  return expr::make<ops::Asinh>(std::forward<A>(a));
}
/// Element-wise inverse hyperbolic cosine (NaN below 1).
template <expr::ExprLike A>
auto acosh(A&& a) {
  return expr::make<ops::Acosh>(std::forward<A>(a));
}
/// Element-wise inverse hyperbolic tangent (NaN outside [-1, 1], infinite at +-1).
template <expr::ExprLike A>
auto atanh(A&& a) {
  return expr::make<ops::Atanh>(std::forward<A>(a));
}
/// True where x is NaN (never for integers).
template <expr::ExprLike A>
auto isnan(A&& a) {
  return expr::make<ops::IsNan>(std::forward<A>(a));
}
/// True where x is +-infinity.
template <expr::ExprLike A>
auto isinf(A&& a) {
  return expr::make<ops::IsInf>(std::forward<A>(a));
}
/// True where x is neither infinite nor NaN (always for integers).
template <expr::ExprLike A>
auto isfinite(A&& a) {
  return expr::make<ops::IsFinite>(std::forward<A>(a));
}
/// Element-wise largest whole number <= x, in x's type (integers unchanged; the gradient
/// is zero). Not for bool.
template <expr::ExprLike A>
  requires(!expr::BoolValued<A>)
auto floor(A&& a) {
  return expr::make<ops::Floor>(std::forward<A>(a));
}
/// Element-wise smallest whole number >= x, in x's type. Not for bool.
template <expr::ExprLike A>
  requires(!expr::BoolValued<A>)
auto ceil(A&& a) {
  return expr::make<ops::Ceil>(std::forward<A>(a));
}
/// Element-wise nearest whole number, halves to even (torch.round: round(2.5) == 2), in
/// x's type. Not for bool.
template <expr::ExprLike A>
  requires(!expr::BoolValued<A>)
auto round(A&& a) {
  return expr::make<ops::Round>(std::forward<A>(a));
}
/// Element-wise x with its fraction dropped (toward zero), in x's type. Not for bool.
template <expr::ExprLike A>
  requires(!expr::BoolValued<A>)
auto trunc(A&& a) {
  return expr::make<ops::Trunc>(std::forward<A>(a));
}
/// Element-wise logical not.
template <expr::ExprLike A>
auto logical_not(A&& a) {
  return expr::make<ops::LogicalNot>(std::forward<A>(a));
}

/// Element-wise a^b (not of two bool operands). Integers wrap where the power leaves their
/// type, as in PyTorch; a negative integer exponent of an integer base is a DTypeError when
/// given as a number ("integers to negative integer powers", PyTorch's rule) and truncates
/// toward zero elementwise when given as a tensor (1, +-1 for -1, else 0).
template <class A, class B>
  requires expr::BinaryOperands<A, B> && (!(expr::BoolValued<A> && expr::BoolValued<B>))
auto pow(A&& a, B&& b) {
  if constexpr (expr::Number<B> && std::is_integral_v<std::remove_cvref_t<B>> &&
                !std::is_same_v<std::remove_cvref_t<B>, bool>) {
    using V = typename expr::detail::operand_value<A>::type;
    if constexpr (is_integral_v<V> || std::is_same_v<V, bool>) {
      // The exponent becomes a weak scalar of the result type (int64 for a bool base).
      using R = std::conditional_t<std::is_same_v<V, bool>, std::int64_t, V>;
      if (std::cmp_less(b, 0) || std::cmp_greater(b, std::numeric_limits<R>::max()))
        expr::detail::bad_integer_power(static_cast<long long>(b), dtype_of<R>());
    }
  }
  return expr::make<ops::Pow>(std::forward<A>(a), std::forward<B>(b));
}
/// Element-wise remainder with the divisor's sign (torch.remainder, Python's %):
/// remainder(-3, 5) == 2. An integer divisor of 0 gives the dividend (XLA's value; PyTorch's
/// CPU kernel raises), a floating one NaN. Not of two bool operands.
template <class A, class B>
  requires expr::BinaryOperands<A, B> && (!(expr::BoolValued<A> && expr::BoolValued<B>))
auto remainder(A&& a, B&& b) {
  return expr::make<ops::Remainder>(std::forward<A>(a), std::forward<B>(b));
}
/// Element-wise remainder with the dividend's sign (torch.fmod, C's fmod):
/// fmod(-3, 5) == -3. An integer divisor of 0 gives the dividend (as remainder's), a floating
/// one NaN.
template <class A, class B>
  requires expr::BinaryOperands<A, B> && (!(expr::BoolValued<A> && expr::BoolValued<B>))
auto fmod(A&& a, B&& b) {
  return expr::make<ops::Fmod>(std::forward<A>(a), std::forward<B>(b));
}
/// Element-wise floor(a / b) in the operands' promoted type (torch.floor_divide, Python's
/// //); an integer divisor of 0 gives -1 (XLA's value; PyTorch's CPU kernel raises), a
/// floating one +-inf, and INT64_MIN // -1 wraps (PyTorch's CPU kernel traps there). Its gradient is zero, floor's,
/// where PyTorch refuses to differentiate it.
template <class A, class B>
  requires expr::BinaryOperands<A, B> && (!(expr::BoolValued<A> && expr::BoolValued<B>))
auto floor_divide(A&& a, B&& b) {
  return expr::make<ops::FloorDivide>(std::forward<A>(a), std::forward<B>(b));
}
/// `a % b` is remainder(a, b), as in PyTorch.
template <class A, class B>
  requires expr::BinaryOperands<A, B> && (!(expr::BoolValued<A> && expr::BoolValued<B>))
auto operator%(A&& a, B&& b) {
  return expr::make<ops::Remainder>(std::forward<A>(a), std::forward<B>(b));
}
/// Element-wise maximum (NaN-propagating).
template <class A, class B>
  requires expr::BinaryOperands<A, B>
auto maximum(A&& a, B&& b) {
  return expr::make<ops::Maximum>(std::forward<A>(a), std::forward<B>(b));
}
/// Element-wise minimum (NaN-propagating).
template <class A, class B>
  requires expr::BinaryOperands<A, B>
auto minimum(A&& a, B&& b) {
  return expr::make<ops::Minimum>(std::forward<A>(a), std::forward<B>(b));
}
/// atan2(a, b): the angle of the point (b, a) in (-pi, pi], quadrant-aware (torch.atan2;
/// float results).
template <class A, class B>
  requires expr::BinaryOperands<A, B>
auto atan2(A&& a, B&& b) {
  return expr::make<ops::Atan2>(std::forward<A>(a), std::forward<B>(b));
}
/// sqrt(a^2 + b^2) (torch.hypot), finite where the squares would overflow and non-zero
/// where they would underflow.
template <class A, class B>
  requires expr::BinaryOperands<A, B>
auto hypot(A&& a, B&& b) {
  return expr::make<ops::Hypot>(std::forward<A>(a), std::forward<B>(b));
}
/// Element-wise exclusive or of non-zero tests (torch.logical_xor).
template <class A, class B>
  requires expr::BinaryOperands<A, B>
auto logical_xor(A&& a, B&& b) {
  return expr::make<ops::LogicalXor>(std::forward<A>(a), std::forward<B>(b));
}
/// a + weight * (b - a) (torch.lerp; weight a tensor, an expression or a number), with
/// torch's formula: from b's side where weight >= 0.5, so that weight 1 gives b exactly.
/// Floating operands (torch refuses integers); the three broadcast.
template <expr::ExprLike A, expr::ExprLike B, class W>
  requires is_floating_v<expr::value_t<A>> && is_floating_v<expr::value_t<B>>
auto lerp(A&& a, B&& b, const W& weight) {
  return expr::make<ops::Lerp>(std::forward<A>(a), std::forward<B>(b), weight);
}
/// Element-wise logical and / or of non-zero tests.
template <class A, class B>
  requires expr::BinaryOperands<A, B>
auto logical_and(A&& a, B&& b) {
  return expr::make<ops::LogicalAnd>(std::forward<A>(a), std::forward<B>(b));
}
template <class A, class B>
  requires expr::BinaryOperands<A, B>
auto logical_or(A&& a, B&& b) {
  return expr::make<ops::LogicalOr>(std::forward<A>(a), std::forward<B>(b));
}
/// Clamps to [lo, hi] (hi wins when lo > hi); NaN stays NaN. The gradient passes to x
/// wherever lo <= x <= hi, bounds included, as torch.clamp's. Not for bool.
template <expr::ExprLike X, class L, class H>
  requires(!expr::BoolValued<X>)
auto clamp(X&& x, const L& lo, const H& hi) {
    return expr::make<ops::Clamp>(std::forward<X>(x), lo, hi);
}
/// Element-wise choice: a where cond is non-zero, b elsewhere (all three broadcast).
template <expr::ExprLike C, class A, class B>
auto where(C&& cond, A&& a, B&& b) {
  // A number operand takes its type from the other value operand, never from the condition.
  auto value = [](auto&& x, const auto& other) {
    using X = std::remove_cvref_t<decltype(x)>;
    using O = std::remove_cvref_t<decltype(other)>;
    if constexpr (expr::ExprLike<X>) {
      return expr::operand(std::forward<decltype(x)>(x));
    } else if constexpr (expr::ExprLike<O>) {
      return expr::scalar_for<expr::value_t<O>>(x);
    } else {
      // Both are numbers: their common type (spelled through X and O, so that the
      // branch is only instantiated when it is taken).
      return expr::scalar_for<weak_scalar_t<std::int64_t, std::common_type_t<X, O>>>(x);
    }
  };
  // (`other` is only read for its type, so `a` may have been moved from.)
  auto va = value(std::forward<A>(a), b);
  auto vb = value(std::forward<B>(b), a);
  return Expr<ops::Where, expr::operand_t<C>, decltype(va), decltype(vb)>(expr::operand(std::forward<C>(cond)),
                                                                          std::move(va), std::move(vb));
}
/// NaN, +inf and -inf replaced by `nan`, `posinf` and `neginf` (torch.nan_to_num; the
/// infinities default to the dtype's largest and lowest finite values). Floating only.
template <expr::ExprLike X>
  requires is_floating_v<expr::value_t<X>>
auto nan_to_num(const X& x, double nan = 0, std::optional<double> posinf = std::nullopt,
                std::optional<double> neginf = std::nullopt) {
  using T = expr::value_t<X>;
  // bfloat16's largest finite value is 0x7F7F (no numeric_limits for it).
  double largest = 3.3895313892515355e38;
  if constexpr (!std::is_same_v<T, bfloat16>) largest = static_cast<double>(std::numeric_limits<T>::max());
  const double inf = std::numeric_limits<double>::infinity();
  const auto& v = x;
  return where(isnan(v), nan, where(v == inf, posinf.value_or(largest), where(v == -inf, neginf.value_or(-largest), v)));
}
/// Explicit element type conversion.
template <Element U, expr::ExprLike X>
auto cast(X&& x) {
  return expr::make<ops::Cast<U>>(std::forward<X>(x));
}

}  // namespace lazy
