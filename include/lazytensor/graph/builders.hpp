#pragma once
// Turning expressions into pending graph nodes.

#include <memory>
#include <span>
#include <string>
#include <vector>

#include <lazytensor/autograd/accumulate.hpp>
#include <lazytensor/autograd/elementwise_grad.hpp>
#include <lazytensor/graph/elementwise_node.hpp>
#include <lazytensor/graph/submit.hpp>
#include <lazytensor/core/config.hpp>

namespace lazy::graph {

/// A pending node evaluating expression `e` into a tensor of type Tout and shape `shape`
/// (the expression's own shape, or one it broadcasts to). With `grad_fn`, also returns
/// the backward function (its `next` edges set) when a leaf of `e` requires grad.
template <Element Tout, class E>
NodePtr make_elementwise(const E& e, const Shape& shape, autograd::GradFnPtr* grad_fn = nullptr) {
  std::vector<NodePtr> inputs;
  std::vector<autograd::GradFnPtr> edges;
  // History is recorded where the expression is evaluated, if grad mode is on there.
  if (grad_fn && !autograd::is_grad_enabled()) grad_fn = nullptr;
  inputs.reserve(expr::leaf_count_v<E>);
  if (grad_fn) edges.reserve(expr::leaf_count_v<E>);
  auto k = expr::to_kernel(e, inputs, grad_fn ? &edges : nullptr);
  Device& dev = common_device(inputs, E::op_type::name);
  if constexpr (is_floating_v<Tout>) {
    if (grad_fn && autograd::any_edge(edges)) {
      auto fn = std::make_shared<autograd::ElementwiseGradFn<decltype(k), Tout>>(k, inputs);
      fn->next = std::move(edges);
      *grad_fn = std::move(fn);
    }
  }
  return submit(elementwise_node<Tout>(std::move(k), shape, &dev, std::move(inputs)));
}

template <Element Tout, class E>
NodePtr make_elementwise(const E& e) {
  return make_elementwise<Tout>(e, e.shape());
}

/// Materializes `node` (and what it needs). A value a step is computing is waited for;
/// a pending one is computed now. Returns true when this read had to compute it (an
/// implicit sync). Re-throws a stored execution error.
bool materialize(const NodePtr& node);

}  // namespace lazy::graph

#if LAZYTENSOR_HEADER_DEFINITIONS
namespace lazy::graph {

LAZYTENSOR_INLINE bool materialize(const NodePtr& node) {
  Device& dev = *node->device();
  if (!node->materialized() && !node->pending()) dev.wait_idle();
  dev.rethrow_stored_error();
  if (node->materialized()) return false;
  execute(dev, std::span(&node, 1));
  return true;
}

}  // namespace lazy::graph
#endif  // LAZYTENSOR_HEADER_DEFINITIONS
