#pragma once
// The autograd graph, as in libtorch: every value computed from tensors that require grad
// records a GradFn that maps the gradient of its output to the gradients of its inputs,
// and points (`next`) at the functions that receive those. Leaves end in AccumulateGrad,
// which adds into the leaf's `.grad()`. Gradients are graph nodes too, so a backward pass
// only builds pending work; it runs at the next mark_step with the forward and the update.
//
// This header only needs the graph layer: tensors, expressions and ops include it.

#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include <lazytensor/core/config.hpp>
#include <lazytensor/core/error.hpp>
#include <lazytensor/graph/node.hpp>
#include <lazytensor/graph/tensor_impl.hpp>

namespace lazy::autograd {

class GradFn;
/// Where a gradient goes: the function that receives it (nullptr: nowhere, no grad).
using GradFnPtr = std::shared_ptr<GradFn>;

/// A backward function: gradient of its output -> gradients of its inputs.
class GradFn {
 public:
  virtual ~GradFn() = default;

  /// Name as libtorch prints it ("MulBackward0", "MmBackward0", ...).
  virtual std::string name() const = 0;
  /// Gradients of the inputs (one per entry of `next`; nullptr where none flows), given
  /// the gradient of the output (same dtype and shape as the output).
  virtual graph::NodeList apply(const graph::NodePtr& grad_output) = 0;
  /// Drops what forward saved for backward (after a backward without retain_graph).
  virtual void release_saved() { released_ = true; }
  /// True once release_saved() ran: a second backward through this function is an error.
  bool released() const { return released_; }

  /// Receivers of the input gradients, in input order.
  std::vector<GradFnPtr> next;
  /// Metadata of the output, to check and shape incoming gradients.
  DType dtype = DType::Float32;
  Shape shape;
  graph::Device* device = nullptr;
  /// Non-leaf tensors whose `.grad()` should be kept (retain_grad): filled by backward.
  std::vector<std::weak_ptr<graph::TensorImpl>> retained;

 protected:
  /// Raises the libtorch error for a second backward through a freed graph.
  void check_not_released() const;

 private:
  bool released_ = false;
};

/// Per-tensor autograd state (defined with the tensor object it belongs to).
using AutogradMeta = graph::AutogradState;

// ---- grad mode -------------------------------------------------------------------------

/// Whether operations record autograd history on this thread (torch.is_grad_enabled()).
inline bool& grad_mode() {
  thread_local bool enabled = true;
  return enabled;
}
/// True when autograd records history on this thread.
inline bool is_grad_enabled() { return grad_mode(); }
/// Turns history recording on or off for this thread (torch.set_grad_enabled).
inline void set_grad_enabled(bool on) { grad_mode() = on; }

/// Scope guard that sets grad mode and restores the previous mode on exit.
class AutoGradMode {
 public:
  explicit AutoGradMode(bool enabled) : prev_(grad_mode()) { grad_mode() = enabled; }
  ~AutoGradMode() { grad_mode() = prev_; }
  AutoGradMode(const AutoGradMode&) = delete;
  AutoGradMode& operator=(const AutoGradMode&) = delete;

 private:
  bool prev_;
};

}  // namespace lazy::autograd

namespace lazy {
/// Disables gradient recording in its scope (torch::NoGradGuard): optimizer updates,
/// evaluation loops.
class NoGradGuard : public autograd::AutoGradMode {
 public:
  NoGradGuard() : AutoGradMode(false) {}
};
}  // namespace lazy

#if LAZYTENSOR_HEADER_DEFINITIONS
namespace lazy::autograd {
LAZYTENSOR_INLINE void GradFn::check_not_released() const {
  if (released_) {
    throw Error("Trying to backward through the graph a second time (or directly access saved tensors after "
                "they have already been freed) in " + name() +
                ". Specify retain_graph=true if you need to backward through the graph a second time.");
  }
}
}  // namespace lazy::autograd
#endif  // LAZYTENSOR_HEADER_DEFINITIONS
