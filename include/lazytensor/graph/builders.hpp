#pragma once
// Turning expressions into pending graph nodes.

#include <memory>
#include <string>
#include <vector>

#include <lazytensor/graph/elementwise_node.hpp>
#include <lazytensor/graph/executor.hpp>

namespace lazy::graph {

/// The device shared by `inputs`; throws DeviceError when they differ. With no inputs,
/// the current device.
inline Device& common_device(const std::vector<NodePtr>& inputs, const char* op) {
  Device* d = inputs.empty() ? &current_device() : inputs.front()->device();
  for (const auto& in : inputs) {
    if (in->device() != d) {
      throw DeviceError(std::string(op) + ": expected all tensors on the same device, found " + d->str() +
                        " and " + in->device()->str());
    }
  }
  return *d;
}

/// Adds a node to its device's pending graph; in eager mode it runs at once.
inline NodePtr submit(NodePtr node) {
  if (node->device()->eager()) execute(*node->device(), {node});
  return node;
}

/// A pending node evaluating expression `e` into a tensor of type Tout and shape `shape`
/// (the expression's own shape, or one it broadcasts to).
template <Element Tout, class E>
NodePtr make_elementwise(const E& e, const Shape& shape) {
  std::vector<NodePtr> inputs;
  auto k = expr::to_kernel(e, inputs);
  Device& dev = common_device(inputs, E::op_type::name);
  return submit(std::make_shared<ElementwiseNode<decltype(k), Tout>>(std::move(k), shape, &dev, std::move(inputs)));
}

template <Element Tout, class E>
NodePtr make_elementwise(const E& e) {
  return make_elementwise<Tout>(e, e.shape());
}

/// Materializes `node` (and what it needs). Returns true when it was pending.
inline bool materialize(const NodePtr& node) {
  Device& dev = *node->device();
  dev.rethrow_stored_error();
  if (node->materialized()) return false;
  execute(dev, {node});
  return true;
}

}  // namespace lazy::graph
