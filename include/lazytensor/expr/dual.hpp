#pragma once
// Gradient kernels of element-wise expressions, derived at compile time.
//
// The gradient of y = f(leaves...) with respect to one leaf is g * dy/dleaf, element by
// element. DualEval evaluates f on dual numbers (value, tangent) with the tangent seeded
// at the target leaf: each op combines its operands' tangents through its declared local
// derivatives (functors.hpp, d<I>), so the chain rule over the expression's type yields
// one fused kernel that recomputes the forward values it needs and never writes an
// intermediate. A leaf that appears twice (x * x) is one input slot, so its tangent
// counts both uses. Subtrees without the target skip their tangent arithmetic (a
// loop-invariant branch).

#include <cstdint>
#include <string>
#include <tuple>

#include <lazytensor/expr/evaluator.hpp>

namespace lazy::expr {

/// A value and its derivative with respect to the target leaf.
template <class V>
struct Dual {
  V v;
  V t;
};

template <class S, class K>
struct DualEval;

/// A subtree whose value is not floating (bool or integer) and which one lane would compute
/// wrong (needs_exact_v: bool sums, int32 wrapping): the forward kernel evaluates it node by
/// node, so the gradient kernel must read the same values. No gradient passes a value that
/// is not floating (its op's derivative is 0: a cast to an integer, a comparison), so its
/// tangent is 0 and its value comes from the exact evaluation, lane by lane.
template <class S, class K>
struct ExactDual {
  ExactEval<S, K> e;
  static constexpr bool active = false;
  ExactDual(const K& k, const EvalInputs& in, int) : e(k, in) {}
  void seek(const std::int64_t* offsets) { e.seek(offsets); }
  Dual<S> coeff(std::int64_t i) const { return {static_cast<S>(e.coeff(i)), S(0)}; }
  template <bool Contig>
  Dual<batch_t<S>> packet(std::int64_t i) const {
    return packet_n<Contig>(i, static_cast<std::int64_t>(batch_t<S>::size));
  }
  /// Lane by lane either way: only the first n lanes are read.
  template <bool Contig>
  Dual<batch_t<S>> packet_n(std::int64_t i, std::int64_t n) const {
    alignas(64) S tmp[batch_t<S>::size] = {};
    for (std::int64_t k = 0; k < n; ++k) tmp[k] = static_cast<S>(e.coeff(i + k));
    return {batch_t<S>::load_aligned(tmp), batch_t<S>(S(0))};
  }
};

/// The dual evaluator of child K: ExactDual where the forward kernel evaluates K exactly.
template <class S, class K>
using DualOf = std::conditional_t<!is_floating_v<typename K::value_type> && needs_exact_v<K>,
                                  ExactDual<S, K>, DualEval<S, K>>;

template <class S, Element T>
struct DualEval<S, KLeaf<T>> {
  Eval<S, KLeaf<T>> e;
  bool active;
  DualEval(const KLeaf<T>& k, const EvalInputs& in, int target)
      : e(k, in), active(k.slot == target) {}
  void seek(const std::int64_t* offsets) { e.seek(offsets); }
  Dual<S> coeff(std::int64_t i) const { return {e.coeff(i), S(active ? 1 : 0)}; }
  template <bool Contig>
  Dual<batch_t<S>> packet(std::int64_t i) const {
    return {e.template packet<Contig>(i), batch_t<S>(S(active ? 1 : 0))};
  }
  template <bool Contig>
  Dual<batch_t<S>> packet_n(std::int64_t i, std::int64_t n) const {
    return {e.template packet_n<Contig>(i, n), batch_t<S>(S(active ? 1 : 0))};
  }
};

template <class S, Element T>
struct DualEval<S, Scalar<T>> {
  Eval<S, Scalar<T>> e;
  static constexpr bool active = false;
  DualEval(const Scalar<T>& k, const EvalInputs& in, int) : e(k, in) {}
  void seek(const std::int64_t*) {}
  Dual<S> coeff(std::int64_t i) const { return {e.coeff(i), S(0)}; }
  template <bool Contig>
  Dual<batch_t<S>> packet(std::int64_t i) const {
    return {e.template packet<Contig>(i), batch_t<S>(S(0))};
  }
  template <bool Contig>
  Dual<batch_t<S>> packet_n(std::int64_t i, std::int64_t n) const {
    return {e.template packet_n<Contig>(i, n), batch_t<S>(S(0))};
  }
};

// Op nodes hold their children as named members, one specialization per arity (as Eval
// does, evaluator.hpp: std::tuple and std::apply cost a third of a small program's kernel
// compile time). The tangent sums d<I>(operands..., y) * tangent_I over the operands that
// depend on the target, in operand order.
template <class S, class Op, class C0>
struct DualEval<S, KExpr<Op, C0>> {
  DualOf<S, C0> c0;
  bool active;

  DualEval(const KExpr<Op, C0>& k, const EvalInputs& in, int target)
      : c0(std::get<0>(k.children), in, target), active(c0.active) {}
  void seek(const std::int64_t* offsets) { c0.seek(offsets); }
  Dual<S> coeff(std::int64_t i) const { return combine(c0.coeff(i)); }
  template <bool Contig>
  Dual<batch_t<S>> packet(std::int64_t i) const {
    return combine(c0.template packet<Contig>(i));
  }
  template <bool Contig>
  Dual<batch_t<S>> packet_n(std::int64_t i, std::int64_t n) const {
    return combine(c0.template packet_n<Contig>(i, n));
  }

 private:
  template <class V>
  Dual<V> combine(const Dual<V>& a) const {
    const V y = Op::apply(a.v);
    V t(0);
    if (active && c0.active) t = t + Op::template d<0>(a.v, y) * a.t;
    return {y, t};
  }
};

template <class S, class Op, class C0, class C1>
struct DualEval<S, KExpr<Op, C0, C1>> {
  DualOf<S, C0> c0;
  DualOf<S, C1> c1;
  bool active;

  DualEval(const KExpr<Op, C0, C1>& k, const EvalInputs& in, int target)
      : c0(std::get<0>(k.children), in, target),
        c1(std::get<1>(k.children), in, target),
        active(c0.active || c1.active) {}
  void seek(const std::int64_t* offsets) {
    c0.seek(offsets);
    c1.seek(offsets);
  }
  Dual<S> coeff(std::int64_t i) const { return combine(c0.coeff(i), c1.coeff(i)); }
  template <bool Contig>
  Dual<batch_t<S>> packet(std::int64_t i) const {
    return combine(c0.template packet<Contig>(i), c1.template packet<Contig>(i));
  }
  template <bool Contig>
  Dual<batch_t<S>> packet_n(std::int64_t i, std::int64_t n) const {
    return combine(c0.template packet_n<Contig>(i, n), c1.template packet_n<Contig>(i, n));
  }

 private:
  template <class V>
  Dual<V> combine(const Dual<V>& a, const Dual<V>& b) const {
    const V y = Op::apply(a.v, b.v);
    V t(0);
    if (active) {
      if (c0.active) t = t + Op::template d<0>(a.v, b.v, y) * a.t;
      if (c1.active) t = t + Op::template d<1>(a.v, b.v, y) * b.t;
    }
    return {y, t};
  }
};

template <class S, class Op, class C0, class C1, class C2>
struct DualEval<S, KExpr<Op, C0, C1, C2>> {
  DualOf<S, C0> c0;
  DualOf<S, C1> c1;
  DualOf<S, C2> c2;
  bool active;

  DualEval(const KExpr<Op, C0, C1, C2>& k, const EvalInputs& in, int target)
      : c0(std::get<0>(k.children), in, target),
        c1(std::get<1>(k.children), in, target),
        c2(std::get<2>(k.children), in, target),
        active(c0.active || c1.active || c2.active) {}
  void seek(const std::int64_t* offsets) {
    c0.seek(offsets);
    c1.seek(offsets);
    c2.seek(offsets);
  }
  Dual<S> coeff(std::int64_t i) const { return combine(c0.coeff(i), c1.coeff(i), c2.coeff(i)); }
  template <bool Contig>
  Dual<batch_t<S>> packet(std::int64_t i) const {
    return combine(c0.template packet<Contig>(i), c1.template packet<Contig>(i), c2.template packet<Contig>(i));
  }
  template <bool Contig>
  Dual<batch_t<S>> packet_n(std::int64_t i, std::int64_t n) const {
    return combine(c0.template packet_n<Contig>(i, n), c1.template packet_n<Contig>(i, n), c2.template packet_n<Contig>(i, n));
  }

 private:
  template <class V>
  Dual<V> combine(const Dual<V>& a, const Dual<V>& b, const Dual<V>& c) const {
    const V y = Op::apply(a.v, b.v, c.v);
    V t(0);
    if (active) {
      if (c0.active) t = t + Op::template d<0>(a.v, b.v, c.v, y) * a.t;
      if (c1.active) t = t + Op::template d<1>(a.v, b.v, c.v, y) * b.t;
      if (c2.active) t = t + Op::template d<2>(a.v, b.v, c.v, y) * c.t;
    }
    return {y, t};
  }
};

/// Whether the derivatives of kernel K with respect to its leaves are constants: the chain
/// rule through K multiplies only constant local derivatives (add, sub, neg, identity,
/// casts, comparisons; mul and div by an operand without tensor leaves). Then a gradient
/// kernel reads no leaf value that matters, and a backward function keeps no value for it
/// (libtorch's AddBackward0 saves nothing), so its graph can be run again after a
/// backward pass freed it. Conservative: false for anything else.
template <class K>
struct constant_tangent : std::false_type {};
template <Element T>
struct constant_tangent<KLeaf<T>> : std::true_type {};
template <Element T>
struct constant_tangent<Scalar<T>> : std::true_type {};

namespace detail {
template <class K>
struct has_leaf : std::false_type {};
template <Element T>
struct has_leaf<KLeaf<T>> : std::true_type {};
template <class Op, class... C>
struct has_leaf<KExpr<Op, C...>> : std::bool_constant<(has_leaf<C>::value || ...)> {};

/// Ops whose local derivatives are constants whatever the operands.
template <class Op>
struct constant_derivative
    : std::bool_constant<std::is_same_v<Op, ops::Neg> || std::is_same_v<Op, ops::Identity> ||
                         std::is_same_v<Op, ops::Add> || std::is_same_v<Op, ops::Sub> ||
                         std::is_same_v<Op, ops::Sign> || std::is_same_v<Op, ops::LogicalNot> ||
                         std::is_same_v<Op, ops::Eq> || std::is_same_v<Op, ops::Ne> ||
                         std::is_same_v<Op, ops::Lt> || std::is_same_v<Op, ops::Le> ||
                         std::is_same_v<Op, ops::Gt> || std::is_same_v<Op, ops::Ge> ||
                         std::is_same_v<Op, ops::LogicalAnd> ||
                         std::is_same_v<Op, ops::LogicalOr>> {};
template <Element U>
struct constant_derivative<ops::Cast<U>> : std::true_type {};

template <class Op, class... C>
struct constant_local : constant_derivative<Op> {};
// d(a * b)/da = b: constant when b reads no tensor (and symmetrically).
template <class C0, class C1>
struct constant_local<ops::Mul, C0, C1>
    : std::bool_constant<!has_leaf<C0>::value || !has_leaf<C1>::value> {};
// d(a / b)/da = 1 / b: constant when b reads no tensor (then no gradient flows into b).
template <class C0, class C1>
struct constant_local<ops::Div, C0, C1> : std::bool_constant<!has_leaf<C1>::value> {};
}  // namespace detail

template <class Op, class... C>
struct constant_tangent<KExpr<Op, C...>>
    : std::bool_constant<detail::constant_local<Op, C...>::value &&
                         (constant_tangent<C>::value && ...)> {};
template <class K>
inline constexpr bool constant_tangent_v = constant_tangent<K>::value;

namespace detail {
/// Leaf `slot` in a kernel: how often it occurs, and whether the kernel's derivative with
/// respect to it is exactly one. A kind of node not listed here counts as unknown (-1).
struct SlotPath {
  int count = 0;
  bool unit = false;
};
template <class K>
SlotPath slot_path(const K&, int) {
  return {-1, false};
}
template <Element T>
SlotPath slot_path(const Scalar<T>&, int) {
  return {};
}
template <Element T>
SlotPath slot_path(const KLeaf<T>& leaf, int slot) {
  return {leaf.slot == slot ? 1 : 0, leaf.slot == slot};
}
/// Whether Op passes its child `i`'s tangent through unchanged (times one).
template <class Op>
constexpr bool passes_tangent(std::size_t i) {
  return std::is_same_v<Op, ops::Add> || std::is_same_v<Op, ops::Identity> || (std::is_same_v<Op, ops::Sub> && i == 0);
}
template <class Op, class... C>
SlotPath slot_path(const KExpr<Op, C...>& k, int slot) {
  SlotPath r;
  std::size_t i = 0;
  auto visit = [&](const auto& child) {
    const SlotPath p = slot_path(child, slot);
    if (p.count < 0 || r.count < 0) {
      r.count = -1;
    } else if (p.count > 0) {
      using Child = std::decay_t<decltype(child)>;
      // The lane must not change on the way: a conversion is not a factor of one.
      constexpr bool same_lane = std::is_same_v<typename Child::value_type, typename KExpr<Op, C...>::value_type>;
      r.unit = p.unit && same_lane && passes_tangent<Op>(i);
      r.count += p.count;
    }
    ++i;
  };
  std::apply([&](const auto&... ch) { (visit(ch), ...); }, k.children);
  return r;
}
}  // namespace detail

/// Whether d(k)/d(leaf `slot`) is exactly one at every element: the leaf occurs once in `k`,
/// reached through add (either side), sub (its left side) and identity only, in one lane
/// type (`a + b` for a or b, `a - b` for a; not `a + a`, `-a`, `2 * a` or a cast). The
/// gradient of such a leaf is the incoming gradient itself, summed back over broadcast
/// dimensions: no kernel needs to write `g * 1`.
template <class K>
bool unit_tangent(const K& k, int slot) {
  const detail::SlotPath p = detail::slot_path(k, slot);
  return p.count == 1 && p.unit;
}

/// Kernel form of "g * d(fwd)/d(input `target`)": the forward kernel, the incoming
/// gradient as the last input slot, and the target slot (a run-time value: one kernel
/// type serves every leaf of the expression).
template <class K, Element Tg>
struct KGrad {
  using lane = lane_combine<klane_t<K>, Tg>;
  using value_type = lane;
  static constexpr bool is_grad_kernel = true;
  static constexpr double custom_cost = 3 * kernel_cost<K>() + 1;
  K fwd;
  KLeaf<Tg> grad;
  int target;
};

template <class K, Element Tg>
struct klane<KGrad<K, Tg>> {
  using type = typename KGrad<K, Tg>::lane;
};

template <class K, Element Tg>
struct leaf_count<KGrad<K, Tg>> : std::integral_constant<std::size_t, leaf_count<K>::value + 1> {};

template <class S, class K, Element Tg>
struct Eval<S, KGrad<K, Tg>> {
  static constexpr bool simd = simd_lane_v<S>;
  DualEval<S, K> f;
  Eval<S, KLeaf<Tg>> g;
  Eval(const KGrad<K, Tg>& k, const EvalInputs& in) : f(k.fwd, in, k.target), g(k.grad, in) {}
  void seek(const std::int64_t* offsets) {
    f.seek(offsets);
    g.seek(offsets);
  }
  S coeff(std::int64_t i) const { return g.coeff(i) * f.coeff(i).t; }
  template <bool Contig>
  batch_t<S> packet(std::int64_t i) const {
    return g.template packet<Contig>(i) * f.template packet<Contig>(i).t;
  }
  template <bool Contig>
  batch_t<S> packet_n(std::int64_t i, std::int64_t n) const {
    return g.template packet_n<Contig>(i, n) * f.template packet_n<Contig>(i, n).t;
  }
};

/// "d/din1(mul(in0, in1)) * in2" for graph dumps.
template <class K, Element Tg>
void append_text(std::string& s, const KGrad<K, Tg>& k) {
  detail::append_chars(s, "d/d");
  detail::append_slot(s, k.target);
  detail::append_chars(s, "(");
  append_text(s, k.fwd);
  detail::append_chars(s, ") * ");
  append_text(s, k.grad);
}

}  // namespace lazy::expr
