#pragma once
// Turning an expression into a pending graph node, with its backward function when a leaf
// requires grad: what `Tensor<T> t = expr;` and the in-place operators do.

#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

#include <lazytensor/autograd/accumulate.hpp>
#include <lazytensor/autograd/elementwise_grad.hpp>
#include <lazytensor/graph/elementwise_node.hpp>
#include <lazytensor/graph/submit.hpp>

namespace lazy::detail {

/// A pending node evaluating expression `e` into a tensor of type Tout and shape `shape`
/// (the expression's own shape when null, or one it broadcasts to). With `grad_fn`, also
/// returns the backward function (its `next` edges set) when a leaf of `e` requires grad.
/// A temporary `e` is consumed: its tensor references move on into the node (a copy would
/// cost two locked counts per leaf); a named one's distinct leaves are copied.
template <Element Tout, class E>
graph::NodePtr make_elementwise(E&& e, const Shape* shape, autograd::GradFnPtr* grad_fn = nullptr) {
  using X = std::remove_cvref_t<E>;
  graph::NodeList inputs;
  std::vector<autograd::GradFnPtr> edges;
  // History is recorded where the expression is evaluated, if grad mode is on there and a
  // leaf has some (otherwise no edge list: an allocation per statement that needs none).
  if (grad_fn && !(autograd::is_grad_enabled() && expr::any_leaf_grad(e))) grad_fn = nullptr;
  inputs.reserve(expr::leaf_count_v<X>);
  if (grad_fn) edges.reserve(expr::leaf_count_v<X>);
  const Shape& out = shape ? *shape : e.shape();  // an Expr keeps its shape when consumed
  auto k = expr::to_kernel(std::forward<E>(e), inputs, grad_fn ? &edges : nullptr);
  graph::Device& dev = graph::common_device(inputs, X::op_type::name);
  // Only floating tensors require grad: without a floating leaf, no backward code is
  // compiled for the expression.
  if constexpr (is_floating_v<Tout> && expr::has_floating_leaf_v<X>) {
    if (grad_fn) expr::drop_cut_edges(k, edges);  // no gradient through integer values
    if (grad_fn && autograd::any_edge(edges)) {
      // Owned through the base class: std::shared_ptr's control block is then one type
      // for every expression, not one more per expression (make_shared's would be).
      *grad_fn = autograd::adopt_grad_fn(new autograd::ElementwiseGradFn<decltype(k), Tout>(k, inputs), std::move(edges));
    }
  }
  return graph::submit(graph::elementwise_node<Tout>(std::move(k), out, &dev, std::move(inputs)));
}

}  // namespace lazy::detail
