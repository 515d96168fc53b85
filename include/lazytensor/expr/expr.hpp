#pragma once
// Expression nodes. They are thin: an op type and its operands. Leaves hold the graph node
// of a tensor's value at the time the expression was built (so `auto e = a + 1; a += 5;`
// keeps meaning the old `a`), scalars hold their value, and the shape is broadcast once,
// at construction, where a mismatch is reported against the line that built it.

#include <concepts>
#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <tuple>
#include <type_traits>
#include <utility>

#include <lazytensor/core/config.hpp>
#include <lazytensor/core/dtype.hpp>
#include <lazytensor/core/error.hpp>
#include <lazytensor/core/shape.hpp>
#include <lazytensor/expr/functors.hpp>

// What an operand refers to, declared here: the expression layer sits below the graph and
// autograd layers that define these classes, and only holds and compares pointers to them.
namespace lazy::graph {
class Node;
using NodePtr = std::shared_ptr<Node>;
}  // namespace lazy::graph
namespace lazy::autograd {
class GradFn;
using GradFnPtr = std::shared_ptr<GradFn>;
}  // namespace lazy::autograd

namespace lazy {

namespace expr {

/// A tensor operand: the graph node holding its value, and where its gradient goes
/// (null unless the tensor requires grad and grad mode was on when the leaf was made).
template <Element T>
struct Leaf {
  using value_type = T;
  graph::NodePtr node;
  autograd::GradFnPtr grad;
  /// The node's shape. A template only so that Node (graph/node.hpp, a higher layer) is
  /// complete where it is called, not here.
  template <class N = graph::Node>
  const Shape& shape() const {
    return static_cast<const N&>(*node).shape();
  }
};

/// A C++ number converted to the type it takes in the expression.
template <Element T>
struct Scalar {
  using value_type = T;
  T value;
  static Shape shape() { return {}; }
};

template <class X>
struct is_leaf : std::false_type {};
template <class T>
struct is_leaf<Leaf<T>> : std::true_type {};
template <class X>
struct is_scalar : std::false_type {};
template <class T>
struct is_scalar<Scalar<T>> : std::true_type {};

namespace detail {
/// Calls `f` with the operands of a node (a tuple of one, two or three): std::apply's job,
/// without the invoke and noexcept-deduction templates it instantiates for every node type
/// of every expression.
template <class Tuple, class F>
decltype(auto) unpack(Tuple& t, F&& f) {
  constexpr std::size_t n = std::tuple_size_v<std::remove_const_t<Tuple>>;
  static_assert(n >= 1 && n <= 3, "element-wise ops take one, two or three operands");
  if constexpr (n == 1) return f(std::get<0>(t));
  else if constexpr (n == 2) return f(std::get<0>(t), std::get<1>(t));
  else return f(std::get<0>(t), std::get<1>(t), std::get<2>(t));
}
}  // namespace detail

/// Type a kernel computes in: bool as int32, bfloat16 as float.
template <Element T>
using lane_of = std::conditional_t<std::is_same_v<T, bool>, std::int32_t, compute_t<T>>;
template <class A, class B>
using lane_combine = lane_of<promote_t<A, B>>;

}  // namespace expr

/// A lazy element-wise expression: Op applied to Children (leaves, scalars, expressions).
template <class Op, class... Children>
class Expr {
 public:
  using op_type = Op;
  using value_type = typename Op::template result<typename Children::value_type...>;

  explicit Expr(Children... c) : children_(std::move(c)...) {
    shape_ = expr::detail::unpack(children_, [](const auto&... ch) { return broadcast_all(ch.shape()...); });
  }

  const Shape& shape() const { return shape_; }
  std::int64_t numel() const { return shape_.numel(); }
  int dim() const { return shape_.rank(); }
  const std::tuple<Children...>& children() const { return children_; }

 private:
  static Shape broadcast_all(const Shape& s) { return s; }
  template <class... S>
  static Shape broadcast_all(const Shape& a, const Shape& b, const S&... rest) {
    return broadcast_all(broadcast_shapes(a, b, Op::name), rest...);
  }

  std::tuple<Children...> children_;
  Shape shape_;
};

namespace expr {

template <class X>
struct is_expr_node : std::false_type {};
template <class Op, class... C>
struct is_expr_node<Expr<Op, C...>> : std::true_type {};

/// A pending expression (`relu(a + b)`), not yet a tensor: layers and losses accept one
/// where they accept a tensor.
template <class X>
concept Pending = is_expr_node<std::remove_cvref_t<X>>::value;

/// Anything usable as a tensor operand: an Expr, or a handle with `to_leaf()` (Tensor).
template <class X>
concept ExprLike = is_expr_node<std::remove_cvref_t<X>>::value || requires(const X& x) {
  { x.to_leaf() };
};

/// Whether any tensor operand of `x` carries an autograd edge. Checked before anything is
/// built for the backward pass: a forward statement outside training then allocates
/// nothing for autograd.
template <class X>
bool any_leaf_grad(const X& x) {
  if constexpr (is_leaf<X>::value) {
    return x.grad != nullptr;
  } else if constexpr (is_expr_node<X>::value) {
    return detail::unpack(x.children(), [](const auto&... ch) { return (any_leaf_grad(ch) || ...); });
  } else {
    return false;
  }
}

/// A C++ number usable as a scalar operand.
template <class X>
concept Number = std::is_arithmetic_v<std::remove_cvref_t<X>> ||
                 std::is_same_v<std::remove_cvref_t<X>, bfloat16>;

/// The operand form of an expression-like value. A temporary expression is moved, not
/// copied: copying one copies every tensor reference below it (an atomic count each), and
/// `relu(a * w + b)` would copy the leaves of each level again at the next.
template <class X>
  requires ExprLike<X>
auto operand(X&& x) {
  if constexpr (is_expr_node<std::remove_cvref_t<X>>::value) {
    return std::remove_cvref_t<X>(std::forward<X>(x));
  } else {
    return x.to_leaf();
  }
}
template <ExprLike X>
using operand_t = decltype(operand(std::declval<const X&>()));
template <ExprLike X>
using value_t = typename operand_t<X>::value_type;

/// Converts a number to the type it takes next to a tensor of type T.
template <Element T, Number S>
Scalar<weak_scalar_t<T, std::remove_cvref_t<S>>> scalar_for(S s) {
  using U = weak_scalar_t<T, std::remove_cvref_t<S>>;
  if constexpr (std::is_same_v<U, bfloat16>) return {bfloat16(static_cast<float>(s))};
  else return {static_cast<U>(s)};
}

/// Lane (compute) type of a whole expression: the widest type any node uses.
template <class E>
struct lane;
template <Element T>
struct lane<Leaf<T>> {
  using type = lane_of<T>;
};
template <Element T>
struct lane<Scalar<T>> {
  using type = lane_of<T>;
};
template <class... Ts>
struct lane_fold;
template <class T>
struct lane_fold<T> {
  using type = T;
};
template <class A, class B, class... R>
struct lane_fold<A, B, R...> {
  using type = typename lane_fold<lane_combine<A, B>, R...>::type;
};
template <class Op, class... C>
struct lane<Expr<Op, C...>> {
  using type =
      typename lane_fold<lane_of<typename Expr<Op, C...>::value_type>, typename lane<C>::type...>::type;
};
template <class E>
using lane_t = typename lane<E>::type;

/// Builds Expr<Op, ...> from operands that may be tensors, expressions or numbers; a number
/// takes its type from the first tensor-like operand (PyTorch's weak scalars).
template <class Op, class First, class... Rest>
auto make(First&& first, Rest&&... rest) {
  if constexpr (ExprLike<First>) {
    using T = value_t<First>;
    auto conv = [](auto&& x) {
      if constexpr (ExprLike<std::remove_cvref_t<decltype(x)>>) return operand(std::forward<decltype(x)>(x));
      else return scalar_for<T>(x);
    };
    return Expr<Op, decltype(conv(std::forward<First>(first))), decltype(conv(std::forward<Rest>(rest)))...>(
        conv(std::forward<First>(first)), conv(std::forward<Rest>(rest))...);
  } else {
    // The first operand is a number: find the first tensor-like one for typing.
    using Anchor = std::tuple_element_t<0, decltype(std::tuple_cat(
        std::conditional_t<ExprLike<Rest>, std::tuple<value_t<Rest>>, std::tuple<>>{}...))>;
    auto conv = [](auto&& x) {
      if constexpr (ExprLike<std::remove_cvref_t<decltype(x)>>) return operand(std::forward<decltype(x)>(x));
      else return scalar_for<Anchor>(x);
    };
    return Expr<Op, decltype(conv(std::forward<First>(first))), decltype(conv(std::forward<Rest>(rest)))...>(
        conv(std::forward<First>(first)), conv(std::forward<Rest>(rest))...);
  }
}

template <class A, class B>
concept BinaryOperands = (ExprLike<A> && (ExprLike<B> || Number<B>)) || (Number<A> && ExprLike<B>);

namespace detail {
template <class X>
struct operand_value {
  using type = std::remove_cvref_t<X>;  // a number
};
template <ExprLike X>
struct operand_value<X> {
  using type = value_t<X>;
};
}  // namespace detail

namespace detail {
/// DTypeError for an integer tensor raised to an integer number that is negative or does
/// not fit its dtype `type` (out of line: one copy of the message code).
[[noreturn]] void bad_integer_power(long long exponent, DType type);
}  // namespace detail

/// An operand (tensor, expression or number) whose values are bool. PyTorch rejects
/// arithmetic that has no meaning on bool (negation, subtraction of two bools, abs, sign,
/// relu, pow of two bools, clamp); so do we, at compile time.
template <class X>
concept BoolValued = std::is_same_v<typename detail::operand_value<X>::type, bool>;

}  // namespace expr

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

#if LAZYTENSOR_HEADER_DEFINITIONS
namespace lazy::expr::detail {
LAZYTENSOR_INLINE void bad_integer_power(long long exponent, DType type) {
  if (exponent < 0) {
    throw DTypeError(
        "pow: integers to negative integer powers are not allowed (PyTorch's rule), got an "
        "integer base and the exponent " +
        std::to_string(exponent) + "; cast the base to a floating type first");
  }
  throw DTypeError("pow: the exponent " + std::to_string(exponent) +
                   " does not fit the result's dtype " + dtype_name(type) +
                   " (expected at most its largest value)");
}
}  // namespace lazy::expr::detail
#endif  // LAZYTENSOR_HEADER_DEFINITIONS
