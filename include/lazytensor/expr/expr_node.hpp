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
#include <vector>

#include <lazytensor/core/block_cache.hpp>
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
/// A list of nodes (a node's inputs, a step's nodes), its storage from the thread's block
/// cache (core/block_cache.hpp): every statement builds one and drops one, and malloc and
/// free were ~200 instructions of a small statement.
using NodeList = std::vector<NodePtr, core::BlockAllocator<NodePtr>>;
}  // namespace lazy::graph
namespace lazy::autograd {
class GradFn;
using GradFnPtr = std::shared_ptr<GradFn>;
}  // namespace lazy::autograd

namespace lazy {

namespace expr {

/// What a tensor operand holds: the graph node of its value, and where its gradient goes
/// (null unless the tensor requires grad and grad mode was on when the leaf was made).
/// Not a template, its destructor defined with the runtime: written in place, the two
/// references' releases were inlined into every expression type's destructor, a tenth of
/// an element-wise statement's code.
struct LeafRefs {
  graph::NodePtr node;
  autograd::GradFnPtr grad;

  LeafRefs(graph::NodePtr n, autograd::GradFnPtr g) noexcept : node(std::move(n)), grad(std::move(g)) {}
  LeafRefs(const LeafRefs&) = default;
  LeafRefs(LeafRefs&&) noexcept = default;
  LeafRefs& operator=(const LeafRefs&) = default;
  LeafRefs& operator=(LeafRefs&&) noexcept = default;
  LAZYTENSOR_INLINE ~LeafRefs();
};

/// A tensor operand of dtype T.
template <Element T>
struct Leaf : LeafRefs {
  using value_type = T;
  using LeafRefs::LeafRefs;
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
  const std::tuple<Children...>& children() const& { return children_; }
  /// The operands of an expression being consumed (expr::to_kernel moves its leaves out);
  /// the shape stays.
  std::tuple<Children...>&& children() && { return std::move(children_); }

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

}  // namespace lazy

#if LAZYTENSOR_HEADER_DEFINITIONS
namespace lazy::expr {
LAZYTENSOR_INLINE LeafRefs::~LeafRefs() = default;
}  // namespace lazy::expr

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
