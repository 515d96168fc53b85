#pragma once
// The object every copy of a Tensor handle shares. In-place ops rebind `node`, so all
// copies see the new value (functionalization, as in libtorch/XLA).

#include <memory>

#include <lazytensor/autograd/function.hpp>
#include <lazytensor/graph/node.hpp>

namespace lazy::graph {

/// Shared state behind a tensor handle.
struct TensorImpl {
  explicit TensorImpl(NodePtr n) : node(std::move(n)) {}
  NodePtr node;
  /// Autograd state; null for tensors that never took part in autograd.
  std::unique_ptr<autograd::AutogradMeta> autograd;

  /// The autograd state, created on first use.
  autograd::AutogradMeta& autograd_meta() {
    if (!autograd) autograd = std::make_unique<autograd::AutogradMeta>();
    return *autograd;
  }
  /// True when gradients flow into this tensor.
  bool requires_grad() const { return autograd && autograd->requires_grad; }
};

}  // namespace lazy::graph
