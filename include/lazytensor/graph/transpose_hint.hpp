#pragma once
// A node that is the transpose of its input's last two dimensions can say so, so that a
// GEMM reads the source with a transposed layout instead of waiting for the copy.

#include <lazytensor/graph/node.hpp>

namespace lazy::graph {

/// Implemented by nodes whose value is `source()` with its last two dimensions swapped.
class TransposeOfLastTwo {
 public:
  virtual ~TransposeOfLastTwo() = default;
  virtual const NodePtr& transpose_source() const = 0;
};

}  // namespace lazy::graph
