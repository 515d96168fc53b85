#pragma once
// The planner and executor: order the pending nodes reachable from a set of roots, let
// nodes fuse with their producers, and run each kernel once its inputs exist.

#include <chrono>
#include <unordered_set>
#include <utility>
#include <vector>

#include <lazytensor/core/counters.hpp>
#include <lazytensor/graph/device.hpp>

namespace lazy::graph {

/// Pending nodes reachable from `roots`, producers before consumers (iterative DFS, so a
/// long chain of statements cannot overflow the stack).
inline std::vector<NodePtr> topological_order(const std::vector<NodePtr>& roots) {
  std::vector<NodePtr> order;
  std::unordered_set<const Node*> seen;
  std::vector<std::pair<Node*, std::size_t>> stack;
  std::vector<NodePtr> holders;  // keeps nodes alive while on the stack
  for (const auto& r : roots) {
    if (!r || r->materialized() || !seen.insert(r.get()).second) continue;
    stack.emplace_back(r.get(), 0);
    holders.push_back(r);
    while (!stack.empty()) {
      auto& [node, next] = stack.back();
      const auto& ins = node->inputs();
      if (next < ins.size()) {
        const NodePtr& in = ins[next++];
        if (!in->materialized() && seen.insert(in.get()).second) {
          stack.emplace_back(in.get(), 0);
        }
        continue;
      }
      // All inputs ordered: find the owning shared_ptr (the root or a consumer's input).
      Node* done = node;
      stack.pop_back();
      NodePtr owner;
      if (stack.empty()) {
        owner = r;
      } else {
        for (const auto& in : stack.back().first->inputs()) {
          if (in.get() == done) {
            owner = in;
            break;
          }
        }
      }
      order.push_back(std::move(owner));
    }
  }
  return order;
}

/// Materializes every pending node reachable from `roots` on `device`. Exceptions thrown
/// by a kernel propagate to the caller; the nodes not yet run stay pending.
inline void execute(Device& device, const std::vector<NodePtr>& roots) {
  static auto& execute_time = core::metric("ExecuteTime");
  static auto& kernels = core::counter("KernelsRun");
  std::vector<NodePtr> order = topological_order(roots);
  if (order.empty()) return;
  for (const auto& n : order) n->fuse_producers();
  std::vector<NodePtr> deferred;  // to undo the take-over if a kernel throws
  for (const auto& n : order)
    if (n->deferred()) deferred.push_back(n);
  core::ScopedTimer timer(execute_time);
  ExecContext ctx{device};
  std::int64_t ran = 0;
  try {
    for (auto& slot : order) {
      // Take the plan's reference, so a finished node is held only by its consumers and
      // handles (buffer donation counts on that).
      NodePtr n = std::move(slot);
      if (n->materialized() || n->deferred()) continue;
      n->run(ctx);
      ++ran;
    }
  } catch (...) {
    for (auto& n : deferred) n->set_deferred(false);
    kernels.add(ran);
    throw;
  }
  kernels.add(ran);
}

}  // namespace lazy::graph
