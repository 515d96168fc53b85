#pragma once
// The kernel form of an expression: the same tree with every tensor leaf replaced by the
// index of a node input. A graph node stores this form, so it holds no handle of its own
// beyond its input list (buffer donation counts references on that list).

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include <lazytensor/core/config.hpp>
#include <lazytensor/expr/expr.hpp>

namespace lazy::expr {

/// A leaf reading node input number `slot`.
template <Element T>
struct KLeaf {
  using value_type = T;
  int slot;
};

/// An op over kernel-form children.
template <class Op, class... C>
struct KExpr {
  using op_type = Op;
  using value_type = typename Op::template result<typename C::value_type...>;
  std::tuple<C...> children;
};

template <class E>
struct kernel_form;
template <Element T>
struct kernel_form<Leaf<T>> {
  using type = KLeaf<T>;
};
template <Element T>
struct kernel_form<Scalar<T>> {
  using type = Scalar<T>;
};
template <class Op, class... C>
struct kernel_form<Expr<Op, C...>> {
  using type = KExpr<Op, typename kernel_form<C>::type...>;
};
template <class E>
using kernel_form_t = typename kernel_form<E>::type;

/// Lane type of a kernel-form expression (see lane_t).
template <class K>
struct klane;
template <Element T>
struct klane<KLeaf<T>> {
  using type = lane_of<T>;
};
template <Element T>
struct klane<Scalar<T>> {
  using type = lane_of<T>;
};
template <class Op, class... C>
struct klane<KExpr<Op, C...>> {
  using type = typename lane_fold<lane_of<typename KExpr<Op, C...>::value_type>,
                                  typename klane<C>::type...>::type;
};
template <class K>
using klane_t = typename klane<K>::type;

/// Number of tensor leaves in expression type E, repeats included: the most slots its
/// kernel form can need, so callers reserve the input list once instead of growing it.
/// (No primary definition: a new node form must say how many leaves it has, since kernel
/// evaluators size their splat room by it.)
template <class E>
struct leaf_count;
template <Element T>
struct leaf_count<Leaf<T>> : std::integral_constant<std::size_t, 1> {};
template <Element T>
struct leaf_count<Scalar<T>> : std::integral_constant<std::size_t, 0> {};
template <class Op, class... C>
struct leaf_count<Expr<Op, C...>>
    : std::integral_constant<std::size_t, (std::size_t{0} + ... + leaf_count<C>::value)> {};
// Kernel forms too: their leaves bound the input slots, which are numbered densely by first
// use (to_kernel).
template <Element T>
struct leaf_count<KLeaf<T>> : std::integral_constant<std::size_t, 1> {};
template <class Op, class... C>
struct leaf_count<KExpr<Op, C...>>
    : std::integral_constant<std::size_t, (std::size_t{0} + ... + leaf_count<C>::value)> {};
template <class E>
inline constexpr std::size_t leaf_count_v = leaf_count<std::remove_cvref_t<E>>::value;

/// Whether expression type E reads a floating tensor. Only floating tensors can require
/// grad, so an expression without one never records a backward function, and the code of
/// one is not compiled for it: a floating result computed from integers only
/// (`cast<float>(idx) * 0.5f`) costs its forward kernel only.
template <class E>
struct has_floating_leaf : std::false_type {};
template <Element T>
struct has_floating_leaf<Leaf<T>> : std::bool_constant<is_floating_v<T>> {};
template <class Op, class... C>
struct has_floating_leaf<Expr<Op, C...>> : std::bool_constant<(has_floating_leaf<C>::value || ...)> {};
template <class E>
inline constexpr bool has_floating_leaf_v = has_floating_leaf<std::remove_cvref_t<E>>::value;

/// Converts an expression to kernel form, appending its distinct leaf nodes to `inputs`.
/// With `edges`, a leaf's autograd edge is appended alongside, and two leaves share a slot
/// only when both node and edge agree (x * x.detach() has two slots: one gets a gradient).
namespace detail {
/// The slot of a leaf with `node` and `grad` already in `inputs` (and `edges`), or -1.
inline int existing_slot(const graph::NodePtr& node, const autograd::GradFnPtr& grad,
                         const graph::NodeList& inputs,
                         const std::vector<autograd::GradFnPtr>* edges) {
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    if (inputs[i] == node && (!edges || (*edges)[i] == grad)) return static_cast<int>(i);
  }
  return -1;
}
}  // namespace detail

template <Element T>
KLeaf<T> to_kernel(const Leaf<T>& l, graph::NodeList& inputs,
                   std::vector<autograd::GradFnPtr>* edges = nullptr) {
  if (const int s = detail::existing_slot(l.node, l.grad, inputs, edges); s >= 0) return {s};
  inputs.push_back(l.node);
  if (edges) edges->push_back(l.grad);
  return {static_cast<int>(inputs.size() - 1)};
}
template <Element T>
Scalar<T> to_kernel(const Scalar<T>& s, graph::NodeList&, std::vector<autograd::GradFnPtr>* = nullptr) {
  return s;
}
/// A leaf of an expression being consumed: its references move into `inputs` and `edges`
/// instead of being copied (an atomic count each, and another when the leaf dies).
template <Element T>
KLeaf<T> to_kernel(Leaf<T>&& l, graph::NodeList& inputs,
                   std::vector<autograd::GradFnPtr>* edges = nullptr) {
  if (const int s = detail::existing_slot(l.node, l.grad, inputs, edges); s >= 0) return {s};
  inputs.push_back(std::move(l.node));
  if (edges) edges->push_back(std::move(l.grad));
  return {static_cast<int>(inputs.size() - 1)};
}
template <class Op, class... C>
auto to_kernel(const Expr<Op, C...>& e, graph::NodeList& inputs,
               std::vector<autograd::GradFnPtr>* edges = nullptr) {
  return detail::unpack(e.children(), [&](const auto&... ch) {
    // Braced initialization evaluates left to right: slots follow operand order.
    return KExpr<Op, kernel_form_t<C>...>{std::tuple<kernel_form_t<C>...>{to_kernel(ch, inputs, edges)...}};
  });
}
/// An expression being consumed (a statement's temporary): its leaves move.
template <class Op, class... C>
auto to_kernel(Expr<Op, C...>&& e, graph::NodeList& inputs,
               std::vector<autograd::GradFnPtr>* edges = nullptr) {
  std::tuple<C...>&& children = std::move(e).children();
  return detail::unpack(children, [&](auto&... ch) {
    return KExpr<Op, kernel_form_t<C>...>{
        std::tuple<kernel_form_t<C>...>{to_kernel(std::move(ch), inputs, edges)...}};
  });
}

// has_floating_leaf of kernel forms.
template <Element T>
struct has_floating_leaf<KLeaf<T>> : std::bool_constant<is_floating_v<T>> {};
template <class Op, class... C>
struct has_floating_leaf<KExpr<Op, C...>>
    : std::bool_constant<(has_floating_leaf<C>::value || ...)> {};

/// Whether kernel K passes a floating leaf through a value that is not floating (a cast to
/// an integer or bool, a comparison): such a value carries no gradient, as in libtorch
/// (only floating tensors require grad), so its leaves get no edge there.
template <class K>
struct cuts_gradient : std::false_type {};
template <class Op, class... C>
struct cuts_gradient<KExpr<Op, C...>>
    : std::bool_constant<(!is_floating_v<typename KExpr<Op, C...>::value_type> &&
                          has_floating_leaf<KExpr<Op, C...>>::value) ||
                         (cuts_gradient<C>::value || ...)> {};

namespace detail {
/// Marks in `live` the slots that `k` reads through floating values only.
template <class K>
void mark_floating_slots(const K& k, std::vector<char>& live) {
  if constexpr (requires { k.slot; }) {
    if constexpr (is_floating_v<typename K::value_type>) live[static_cast<std::size_t>(k.slot)] = 1;
  } else if constexpr (requires { typename K::op_type; }) {
    if constexpr (is_floating_v<typename K::value_type>)
      unpack(k.children, [&](const auto&... ch) { (mark_floating_slots(ch, live), ...); });
  }
}
}  // namespace detail

/// Drops the edges (from to_kernel) of the slots that kernel `k` reads only through a value
/// that is not floating (see cuts_gradient): `cast<float>(x > 0)` and
/// `cast<float>(cast<int>(x))` do not require grad, `x * (x > 0)` does (through its first x).
template <class K>
void drop_cut_edges(const K& k, std::vector<autograd::GradFnPtr>& edges) {
  if constexpr (cuts_gradient<K>::value) {
    std::vector<char> live(edges.size());
    detail::mark_floating_slots(k, live);
    for (std::size_t i = 0; i < edges.size(); ++i)
      if (!live[i]) edges[i] = nullptr;
  }
}

/// The kernel form of a reduction's operand `x` (a tensor handle or an expression), read in
/// place: an expression is not copied first (a copy costs an atomic count per leaf), and a
/// handle gives its node alone (its autograd edge is the reduction's own business).
/// `consume`: `x` is the caller's temporary expression, not const whatever this parameter
/// says (the reductions take one parameter type for both, so that each operand type compiles
/// once): its leaves move into `inputs`.
template <class X>
auto operand_to_kernel(const X& x, graph::NodeList& inputs, bool consume = false) {
  if constexpr (is_expr_node<X>::value) {
    if (consume) return to_kernel(std::move(const_cast<X&>(x)), inputs);
    return to_kernel(x, inputs);
  } else {
    (void)consume;
    using T = typename decltype(x.to_leaf())::value_type;
    inputs.push_back(x.node());
    return KLeaf<T>{static_cast<int>(inputs.size() - 1)};
  }
}

/// Sum of the op costs of a kernel-form expression, per output element.
template <class K>
constexpr double kernel_cost() {
  if constexpr (requires { K::custom_cost; }) {
    return K::custom_cost;
  } else if constexpr (requires { typename K::op_type; }) {
    return []<class... C>(std::type_identity<std::tuple<C...>>) {
      return K::op_type::cost + (0.0 + ... + kernel_cost<C>());
    }(std::type_identity<decltype(K::children)>{});
  } else {
    return 0.0;
  }
}

namespace detail {
// The text's pieces, defined with the runtime: an expression type's append_text is only
// calls to these. Written inline, std::string's appends made a kernel's text a seventh of
// its statement's code (`a * b + a`: 4.6 of 34 KB).
/// Appends `text`.
LAZYTENSOR_INLINE void append_chars(std::string& s, const char* text);
/// Appends "inK" (input K).
LAZYTENSOR_INLINE void append_slot(std::string& s, int slot);
/// Appends `value` without trailing zeros ("2", "0.5").
LAZYTENSOR_INLINE void append_number(std::string& s, double value);
}  // namespace detail

/// Appends "add(mul(in0, in1), 2)", the expression as text for graph dumps (inK is input
/// K), to `s`. The per-node templates only pass names and numbers to the non-template
/// helpers above: every expression type instantiates them, so they stay small.
template <Element T>
void append_text(std::string& s, const KLeaf<T>& l) {
  detail::append_slot(s, l.slot);
}
template <Element T>
void append_text(std::string& s, const Scalar<T>& v) {
  detail::append_number(s, static_cast<double>(static_cast<compute_t<T>>(v.value)));
}
template <class Op, class... C>
void append_text(std::string& s, const KExpr<Op, C...>& k) {
  detail::append_chars(s, Op::name);
  detail::append_chars(s, "(");
  detail::unpack(k.children, [&](const auto&... ch) {
    int n = 0;
    ((detail::append_chars(s, n++ ? ", " : ""), append_text(s, ch)), ...);
  });
  detail::append_chars(s, ")");
}

/// The expression as text (see append_text).
template <class K>
std::string kernel_text(const K& k) {
  std::string s;
  append_text(s, k);
  return s;
}

}  // namespace lazy::expr

#if LAZYTENSOR_HEADER_DEFINITIONS
namespace lazy::expr::detail {

LAZYTENSOR_INLINE void append_chars(std::string& s, const char* text) { s += text; }

LAZYTENSOR_INLINE void append_slot(std::string& s, int slot) {
  s += "in";
  s += std::to_string(slot);
}

LAZYTENSOR_INLINE void append_number(std::string& s, double value) {
  std::string v = std::to_string(value);
  v.erase(v.find_last_not_of('0') + 1);
  if (!v.empty() && v.back() == '.') v.pop_back();
  s += v;
}

}  // namespace lazy::expr::detail
#endif  // LAZYTENSOR_HEADER_DEFINITIONS
