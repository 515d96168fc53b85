#pragma once
// The object every copy of a Tensor handle shares. In-place ops rebind `node`, so all
// copies see the new value (functionalization, as in libtorch/XLA).

#include <cstddef>
#include <memory>
#include <vector>

#include <lazytensor/graph/node.hpp>
#include <lazytensor/core/config.hpp>

namespace lazy::autograd {
class GradFn;
}  // namespace lazy::autograd

namespace lazy::graph {

struct TensorImpl;

/// Per-tensor autograd state, allocated only for tensors that take part in autograd. Plain
/// data held by the tensor object; autograd/ (which calls it autograd::AutogradMeta) gives
/// it its meaning.
struct AutogradState {
  bool requires_grad = false;
  /// The function that produced this value (nullptr for leaves).
  std::shared_ptr<autograd::GradFn> grad_fn;
  /// A leaf's AccumulateGrad, shared by every expression that reads the leaf.
  std::weak_ptr<autograd::GradFn> accumulator;
  /// The accumulated gradient (leaves, or non-leaves with retain_grad()), as a tensor
  /// object of its own so that `p.grad()` handles can update it in place.
  std::shared_ptr<TensorImpl> grad;
  bool retains_grad = false;
};

/// A tensor object's reference to its value: a NodePtr that counts itself among the
/// node's handles (Node::has_handles), so that mark_step finds the pending values still
/// wanted by looking at the traced nodes. Why a count and not a list of live tensor
/// objects: every statement creates and drops a tensor object, and a count costs two
/// atomic adds where a list shared with other threads cost two locked updates.
class HandleNode {
 public:
  HandleNode() = default;
  explicit HandleNode(NodePtr n) noexcept : p_(std::move(n)) {
    if (p_) p_->add_handle();
  }
  HandleNode(const HandleNode&) = delete;
  ~HandleNode() {
    if (p_) p_->drop_handle();
  }
  /// Points at `n` (an in-place op's new value); the old node loses this handle.
  HandleNode& operator=(NodePtr n) noexcept {
    if (n) n->add_handle();
    if (p_) p_->drop_handle();
    p_ = std::move(n);
    return *this;
  }
  HandleNode& operator=(const HandleNode& other) noexcept { return *this = other.p_; }

  const NodePtr& ptr() const noexcept { return p_; }
  operator const NodePtr&() const noexcept { return p_; }  // NOLINT: reads as the NodePtr it is
  Node* get() const noexcept { return p_.get(); }
  Node* operator->() const noexcept { return p_.get(); }
  Node& operator*() const noexcept { return *p_; }
  explicit operator bool() const noexcept { return p_ != nullptr; }

 private:
  NodePtr p_;
};

/// Shared state behind a tensor handle.
struct TensorImpl {
  explicit TensorImpl(NodePtr n) : node(std::move(n)) {}
  TensorImpl(const TensorImpl&) = delete;
  TensorImpl& operator=(const TensorImpl&) = delete;
  HandleNode node;
  /// Autograd state; null for tensors that never took part in autograd.
  std::unique_ptr<AutogradState> autograd;

  /// The autograd state, created on first use.
  AutogradState& autograd_meta();
  /// True when gradients flow into this tensor.
  bool requires_grad() const { return autograd && autograd->requires_grad; }
};

}  // namespace lazy::graph

#if LAZYTENSOR_HEADER_DEFINITIONS
namespace lazy::graph {

LAZYTENSOR_INLINE AutogradState& TensorImpl::autograd_meta() {
  if (!autograd) autograd = std::make_unique<AutogradState>();
  return *autograd;
}

}  // namespace lazy::graph
#endif  // LAZYTENSOR_HEADER_DEFINITIONS
