#pragma once
// Adding nodes to a device's pending graph.

#include <atomic>
#include <exception>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include <lazytensor/graph/executor.hpp>
#include <lazytensor/core/config.hpp>

namespace lazy::graph {

/// The device shared by `inputs`; throws DeviceError when they differ. With no inputs,
/// the current device.
Device& common_device(const NodeList& inputs, const char* op);

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
/// (`advance_rng`: with its random-stream advance, as mark_step in SPMD mode; without,
/// before reading values that several devices compute together, SPMD pieces), then waits
/// until each has at most that step in flight. A device that refuses its step (an earlier
/// step's error is stored on it) does not stop the others: every device runs its step or
/// gives it back, so the collectives they share see each member's attempt (Rendezvous::
/// abandon), never a peer left waiting for a device that was skipped. The first refusal is
/// rethrown after the waits.
void step_all_devices(bool advance_rng = false);

/// The random stream's advance after a step (as XLA's seed advance after mark_step).
inline void advance_random_stream(Device& dev) {
  auto& rng = dev.rng();
  rng.seed = hash_combine(rng.seed, 0x9e3779b97f4a7c15ull);
  rng.offset = 0;
}

/// Materializes `node` (and what it needs). A value a step is computing is waited for;
/// a pending one is computed now. Returns true when this read had to compute it (an
/// implicit sync). Re-throws a stored execution error; DeviceError for a value of another
/// process's device (Device::remote).
bool materialize(const NodePtr& node);

}  // namespace lazy::graph

#if LAZYTENSOR_HEADER_DEFINITIONS
namespace lazy::graph {

LAZYTENSOR_INLINE Device& common_device(const NodeList& inputs, const char* op) {
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

LAZYTENSOR_INLINE void step_all_devices(bool advance_rng) {
  auto& registry = DeviceRegistry::get();
  const int n = registry.count();
  std::exception_ptr refused;
  for (int i = 0; i < n; ++i) {
    Device& dev = registry.device(i);
    if (dev.remote()) {
      dev.drop_remote_trace();
      continue;
    }
    try {
      run_step(dev, collect_step(dev), /*wait_previous=*/false);
      if (advance_rng) advance_random_stream(dev);
    } catch (...) {
      if (!refused) refused = std::current_exception();
    }
  }
  for (int i = 0; i < n; ++i) registry.device(i).wait_below(2);
  if (refused) std::rethrow_exception(refused);
}

LAZYTENSOR_INLINE bool materialize(const NodePtr& node) {
  Device& dev = *node->device();
  if (dev.remote())
    throw DeviceError("materialize: the value lives on " + dev.str() + " of process " + std::to_string(dev.process()) +
                      "; this process holds only its own devices' pieces (read the sharded tensor as a whole)");
  if (!node->materialized() && !node->pending()) dev.wait_idle();
  dev.rethrow_stored_error();
  if (node->materialized()) return false;
  execute(dev, std::span(&node, 1));
  return true;
}

}  // namespace lazy::graph
#endif  // LAZYTENSOR_HEADER_DEFINITIONS
