#pragma once
// The object every copy of a Tensor handle shares. In-place ops rebind `node`, so all
// copies see the new value (functionalization, as in libtorch/XLA).

#include <memory>
#include <mutex>

#include <lazytensor/graph/node.hpp>

namespace lazy::graph {

/// Shared state behind a tensor handle.
struct TensorImpl {
  explicit TensorImpl(NodePtr n) : node(std::move(n)) {}
  NodePtr node;
  bool requires_grad = false;  // used by autograd
};

}  // namespace lazy::graph
