#pragma once
// The backward pass: walks the GradFn graph from the roots in dependency order, summing
// the gradients that reach each function before applying it. Every gradient is a pending
// node, so backward runs no kernel: forward, backward and the optimizer update of a step
// materialize together at the next mark_step.

#include <algorithm>
#include <deque>
#include <memory>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include <lazytensor/autograd/accumulate.hpp>
#include <lazytensor/core/config.hpp>

namespace lazy::autograd {

/// What a backward pass computes: with `capture` empty, gradients accumulate into leaves'
/// `.grad()`; otherwise the total gradient reaching each captured function is returned
/// instead, and no `.grad()` changes (torch.autograd.grad).
struct BackwardRequest {
  std::vector<std::pair<GradFnPtr, graph::NodePtr>> roots;  ///< (function, gradient of its output)
  bool retain_graph = false;
  std::vector<GradFnPtr> capture;
};

/// Runs a backward pass; returns one gradient per captured function (nullptr when none
/// reached it).
graph::NodeList run_backward(const BackwardRequest& req);

#if LAZYTENSOR_HEADER_DEFINITIONS
LAZYTENSOR_INLINE graph::NodeList run_backward(const BackwardRequest& req) {
  AutoGradMode no_grad(false);  // gradients of gradients are not recorded
  // Dependency counts over the graph reachable from the roots.
  std::unordered_map<GradFn*, int> deps;
  std::vector<GradFn*> stack;
  std::unordered_set<GradFn*> seen;
  for (const auto& [fn, g] : req.roots) {
    if (fn && seen.insert(fn.get()).second) stack.push_back(fn.get());
  }
  while (!stack.empty()) {
    GradFn* fn = stack.back();
    stack.pop_back();
    for (const auto& nx : fn->next) {
      if (!nx) continue;
      ++deps[nx.get()];
      if (seen.insert(nx.get()).second) stack.push_back(nx.get());
    }
  }
  // A function may be captured more than once (one input given twice): every slot gets it.
  std::unordered_map<GradFn*, std::vector<std::size_t>> captured;
  for (std::size_t i = 0; i < req.capture.size(); ++i) captured[req.capture[i].get()].push_back(i);
  graph::NodeList out(req.capture.size());

  std::unordered_map<GradFn*, graph::NodePtr> pending;
  auto add_grad = [&](GradFn* fn, const graph::NodePtr& g) {
    if (!g) return;
    if (!(g->shape() == fn->shape)) {
      throw ShapeError("autograd: " + fn->name() + " expected a gradient of shape " + fn->shape.str() + ", got " +
                       g->shape().str());
    }
    auto& slot = pending[fn];
    slot = slot ? add_nodes(slot, g) : g;
  };
  std::deque<GradFn*> ready;
  for (const auto& [fn, g] : req.roots) {
    if (!fn) continue;
    add_grad(fn.get(), g);
  }
  for (const auto& [fn, g] : req.roots) {
    if (fn && deps[fn.get()] == 0 && std::find(ready.begin(), ready.end(), fn.get()) == ready.end())
      ready.push_back(fn.get());
  }
  while (!ready.empty()) {
    GradFn* fn = ready.front();
    ready.pop_front();
    graph::NodePtr g;
    if (auto it = pending.find(fn); it != pending.end()) {
      g = std::move(it->second);
      pending.erase(it);
    }
    graph::NodeList grads;
    if (g) {
      for (const auto& w : fn->retained) {
        if (auto impl = w.lock()) accumulate_into(*impl, g);
      }
      if (auto c = captured.find(fn); c != captured.end()) {
        for (std::size_t slot : c->second) out[slot] = g;
      }
      // torch.autograd.grad leaves every .grad() alone; other functions still pass the
      // gradient on, so an input upstream of another captured one gets its share.
      if (!(req.capture.size() && dynamic_cast<AccumulateGrad*>(fn))) grads = fn->apply(g);
    }
    if (!req.retain_graph) fn->release_saved();
    for (std::size_t i = 0; i < fn->next.size(); ++i) {
      GradFn* nx = fn->next[i].get();
      if (!nx) continue;
      if (i < grads.size()) add_grad(nx, grads[i]);
      if (--deps[nx] == 0) ready.push_back(nx);
    }
  }
  return out;
}
#endif  // LAZYTENSOR_HEADER_DEFINITIONS

}  // namespace lazy::autograd
