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
#include <utility>

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

template <class S, Element T>
struct DualEval<S, KLeaf<T>> {
  Eval<S, KLeaf<T>> e;
  bool active;
  DualEval(const KLeaf<T>& k, const void* const* ptrs, const char* splats, int target)
      : e(k, ptrs, splats), active(k.slot == target) {}
  void seek(const std::int64_t* offsets) { e.seek(offsets); }
  Dual<S> coeff(std::int64_t i) const { return {e.coeff(i), S(active ? 1 : 0)}; }
  template <bool C>
  Dual<batch_t<S>> packet(std::int64_t i) const {
    return {e.template packet<C>(i), batch_t<S>(S(active ? 1 : 0))};
  }
};

template <class S, Element T>
struct DualEval<S, Scalar<T>> {
  Eval<S, Scalar<T>> e;
  static constexpr bool active = false;
  DualEval(const Scalar<T>& k, const void* const* ptrs, const char* splats, int) : e(k, ptrs, splats) {}
  void seek(const std::int64_t*) {}
  Dual<S> coeff(std::int64_t i) const { return {e.coeff(i), S(0)}; }
  template <bool C>
  Dual<batch_t<S>> packet(std::int64_t i) const {
    return {e.template packet<C>(i), batch_t<S>(S(0))};
  }
};

template <class S, class Op, class... C>
struct DualEval<S, KExpr<Op, C...>> {
  std::tuple<DualEval<S, C>...> children;
  bool active;

  DualEval(const KExpr<Op, C...>& k, const void* const* ptrs, const char* splats, int target)
      : children(std::apply(
            [&](const auto&... ch) { return std::tuple<DualEval<S, C>...>{DualEval<S, C>(ch, ptrs, splats, target)...}; },
            k.children)),
        active(std::apply([](const auto&... ch) { return (false || ... || ch.active); }, children)) {}

  void seek(const std::int64_t* offsets) {
    std::apply([&](auto&... ch) { (ch.seek(offsets), ...); }, children);
  }
  Dual<S> coeff(std::int64_t i) const {
    return combine<S>(std::apply([&](const auto&... ch) { return std::make_tuple(ch.coeff(i)...); }, children));
  }
  template <bool Contig>
  Dual<batch_t<S>> packet(std::int64_t i) const {
    return combine<batch_t<S>>(
        std::apply([&](const auto&... ch) { return std::make_tuple(ch.template packet<Contig>(i)...); }, children));
  }

 private:
  static constexpr std::size_t N = sizeof...(C);

  template <class V, class Tup>
  Dual<V> combine(const Tup& d) const {
    return combine_impl<V>(d, std::make_index_sequence<N>{});
  }
  template <class V, class Tup, std::size_t... I>
  Dual<V> combine_impl(const Tup& d, std::index_sequence<I...>) const {
    const auto vals = std::tie(std::get<I>(d).v...);
    const V y = Op::apply(std::get<I>(d).v...);
    V t(0);
    if (active) {
      // Sum of d<I>(operands..., y) * tangent_I over the operands that depend on the target.
      auto partial = [&]<int J>(std::integral_constant<int, J>) {
        return std::apply([&](const auto&... v) { return Op::template d<J>(v..., y); }, vals);
      };
      ((t = std::get<I>(children).active
                ? t + partial(std::integral_constant<int, static_cast<int>(I)>{}) * std::get<I>(d).t
                : t),
       ...);
    }
    return {y, t};
  }
};

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

template <class S, class K, Element Tg>
struct Eval<S, KGrad<K, Tg>> {
  static constexpr bool simd = simd_lane_v<S>;
  DualEval<S, K> f;
  Eval<S, KLeaf<Tg>> g;
  Eval(const KGrad<K, Tg>& k, const void* const* ptrs, const char* splats)
      : f(k.fwd, ptrs, splats, k.target), g(k.grad, ptrs, splats) {}
  void seek(const std::int64_t* offsets) {
    f.seek(offsets);
    g.seek(offsets);
  }
  S coeff(std::int64_t i) const { return g.coeff(i) * f.coeff(i).t; }
  template <bool C>
  batch_t<S> packet(std::int64_t i) const {
    return g.template packet<C>(i) * f.template packet<C>(i).t;
  }
};

/// "grad_in2(mul(in0, in1)) * in3" for graph dumps.
template <class K, Element Tg>
std::string kernel_text(const KGrad<K, Tg>& k) {
  return "d/din" + std::to_string(k.target) + "(" + kernel_text(k.fwd) + ") * " + kernel_text(k.grad);
}

}  // namespace lazy::expr
