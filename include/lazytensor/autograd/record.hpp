#pragma once
// How an op records its explicit backward rule: a callable from the typed output gradient
// to the input gradients, wrapped as a GradFn and attached to the op's result when any
// operand needs a gradient. Rules capture detached tensors (values, no history), never the
// result's own handle, so no reference cycle forms.

#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <lazytensor/core/config.hpp>
#include <lazytensor/tensor/tensor.hpp>

namespace lazy::autograd {

/// What a backward rule keeps from forward. libtorch raises on a second backward only
/// through a function whose saved tensors the first one freed; a rule that captured
/// nothing but sizes and scalars (sum, view, permute, cat, ...) can run any number of times.
enum class Saves { tensors, nothing };

/// A backward rule given as a callable.
class FunctionGradFn final : public GradFn {
 public:
  using Backward = std::function<graph::NodeList(const graph::NodePtr&)>;
  FunctionGradFn(std::string name, Backward f, Saves saves = Saves::tensors)
      : name_(std::move(name)), f_(std::move(f)), saves_(saves) {}
  std::string name() const override { return name_; }
  LAZYTENSOR_INLINE graph::NodeList apply(const graph::NodePtr& grad) override;
  /// Drops the rule (and what it captured) unless it saved nothing.
  LAZYTENSOR_INLINE void release_saved() override;

 private:
  std::string name_;
  Backward f_;
  Saves saves_;
};

/// Where the gradient of operand `x` goes: a tensor's own edge, or for an element-wise
/// expression a backward function over its leaves (the expression need not be computed
/// for that: e.g. sum(a * b) never writes a * b).
template <expr::ExprLike X>
GradFnPtr operand_edge(const X& x) {
  if constexpr (expr::is_expr_node<X>::value) {
    using V = typename X::value_type;
    if constexpr (!is_floating_v<V> || !expr::has_floating_leaf_v<X>) {
      return nullptr;  // no floating tensor operand: nothing here can require grad
    } else {
      if (!is_grad_enabled() || !expr::any_leaf_grad(x)) return nullptr;
      graph::NodeList inputs;
      std::vector<GradFnPtr> edges;
      inputs.reserve(expr::leaf_count_v<X>);
      edges.reserve(expr::leaf_count_v<X>);
      auto k = expr::to_kernel(x, inputs, &edges);
      expr::drop_cut_edges(k, edges);  // no gradient through integer values
      if (!any_edge(edges)) return nullptr;
      // Owned through the base class (see make_elementwise).
      GradFnPtr fn = adopt_grad_fn(new ElementwiseGradFn<decltype(k), V>(k, inputs), std::move(edges));
      fn->dtype = dtype_of<V>();
      fn->shape = x.shape();
      fn->device = fn->next.empty() ? nullptr : inputs.front()->device();
      return fn;
    }
  } else {
    return edge_of(x.impl());
  }
}

/// The value of operand `x` as a backward rule keeps it: a tensor detached (its value now,
/// unaffected by later in-place updates, without history), an expression as is (its
/// leaves already hold the values it was built from).
template <expr::ExprLike X>
auto saved(const X& x) {
  if constexpr (expr::is_expr_node<X>::value) return x;
  else return x.detach();
}

/// The node of a gradient tensor, or nullptr for an undefined one (no gradient).
template <Element T>
graph::NodePtr node_or_null(const Tensor<T>& t) {
  return t.defined() ? t.node() : nullptr;
}

/// Makes `backward` (Tensor<T> grad of out -> input gradient nodes, in `edges` order) the
/// grad_fn of `out` when any edge is live. The rule runs with grad mode off. `saves`:
/// Saves::nothing when the rule captures no tensor (see Saves).
template <Element T, class F>
void record(Tensor<T>& out, const char* name, std::vector<GradFnPtr> edges, F backward,
            Saves saves = Saves::tensors) {
  if constexpr (!is_floating_v<T>) return;  // integer results carry no gradient
  if (!any_edge(edges)) return;
  register_grad_dtype<T>();
  auto fn = std::make_shared<FunctionGradFn>(
      name,
      [b = std::move(backward)](const graph::NodePtr& g) {
        AutoGradMode off(false);
        return b(Tensor<T>(cast_node(g, dtype_of<T>())));
      },
      saves);
  fn->next = std::move(edges);
  attach_grad_fn(*out.impl(), std::move(fn));
}

/// True when grad mode is on and any of the tensors requires grad.
template <class... Ts>
bool any_requires_grad(const Ts&... ts) {
  return is_grad_enabled() && (false || ... || ts.requires_grad());
}

#if LAZYTENSOR_HEADER_DEFINITIONS
LAZYTENSOR_INLINE graph::NodeList FunctionGradFn::apply(const graph::NodePtr& grad) {
  check_not_released();
  return f_(grad);
}

LAZYTENSOR_INLINE void FunctionGradFn::release_saved() {
  if (saves_ == Saves::nothing) return;
  f_ = nullptr;
  GradFn::release_saved();
}
#endif  // LAZYTENSOR_HEADER_DEFINITIONS

}  // namespace lazy::autograd
