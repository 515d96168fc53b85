#pragma once
// Adding nodes to a device's pending graph.

#include <atomic>
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

/// Rewrites a node that reads a sharded value (NodeKind::Sharded) into per-device pieces.
/// lazy::spmd installs it (use_spmd); without it no node can read a sharded value.
using PartitionHook = NodePtr (*)(NodePtr node);

/// The installed partitioner (null outside SPMD mode). Atomic: installed once, read by
/// every submit.
inline std::atomic<PartitionHook>& partition_hook() {
  static std::atomic<PartitionHook> hook{nullptr};
  return hook;
}

/// Whether mark_step steps every device of the process instead of the current one (SPMD
/// mode: one program thread drives all devices).
inline std::atomic<bool>& step_every_device() {
  static std::atomic<bool> on{false};
  return on;
}

/// Adds a node to its device's pending graph; in eager mode it runs at once. A node that
/// reads a sharded value goes to the partitioner instead, which returns the node that
/// stands for the result (callers use the returned node, never the one they passed).
NodePtr submit(NodePtr node);

/// submit without the partitioner: for the partitioner's own nodes.
NodePtr submit_unpartitioned(NodePtr node);

/// Hands the pending values of every device to its executor, as a mark_step of each
/// without its random-stream advance: before reading values that several devices compute
/// together (SPMD pieces), where a collective on one device waits for its peers.
void step_all_devices();

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
  if (PartitionHook hook = partition_hook().load(std::memory_order_acquire)) {
    for (const auto& in : node->inputs())
      if (in->kind() == NodeKind::Sharded) return hook(std::move(node));
  }
  return submit_unpartitioned(std::move(node));
}

LAZYTENSOR_INLINE NodePtr submit_unpartitioned(NodePtr node) {
  Device& dev = *node->device();
  if (dev.eager())
    execute(dev, std::span(&node, 1));
  else dev.trace(node);
  return node;
}

LAZYTENSOR_INLINE void step_all_devices() {
  auto& registry = DeviceRegistry::get();
  const int n = registry.count();
  for (int i = 0; i < n; ++i) run_step(registry.device(i), collect_step(registry.device(i)), /*wait_previous=*/false);
  for (int i = 0; i < n; ++i) registry.device(i).wait_below(2);
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
