#pragma once
// Adding nodes to a device's pending graph.

#include <memory>
#include <span>
#include <string>
#include <vector>

#include <lazytensor/graph/executor.hpp>
#include <lazytensor/core/config.hpp>

namespace lazy::graph {

/// The device shared by `inputs`; throws DeviceError when they differ. With no inputs,
/// the current device.
Device& common_device(const std::vector<NodePtr>& inputs, const char* op);

/// Adds a node to its device's pending graph; in eager mode it runs at once.
NodePtr submit(NodePtr node);

/// Materializes `node` (and what it needs). A value a step is computing is waited for;
/// a pending one is computed now. Returns true when this read had to compute it (an
/// implicit sync). Re-throws a stored execution error.
bool materialize(const NodePtr& node);

}  // namespace lazy::graph

#if LAZYTENSOR_HEADER_DEFINITIONS
namespace lazy::graph {

LAZYTENSOR_INLINE Device& common_device(const std::vector<NodePtr>& inputs, const char* op) {
  Device* d = inputs.empty() ? &current_device() : inputs.front()->device();
  for (const auto& in : inputs) {
    if (in->device() != d) {
      throw DeviceError(std::string(op) + ": expected all tensors on the same device, found " + d->str() +
                        " and " + in->device()->str());
    }
  }
  return *d;
}

LAZYTENSOR_INLINE NodePtr submit(NodePtr node) {
  Device& dev = *node->device();
  if (dev.eager())
    execute(dev, std::span(&node, 1));
  else dev.trace(node);
  return node;
}

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
