#pragma once
// Shape ops, all lazy: views (reshape/view, flatten, squeeze, unsqueeze) share the input's
// buffer, so a view of a pending value is pending and nothing is copied; transpose/permute,
// narrow/slice, cat/stack, index_select, gather and one_hot build the copy nodes of
// graph/shape_nodes.hpp; expand is a broadcasting element-wise node. Each op records its
// backward (graph/shape_backward.hpp holds the scatter kernels those need).
//
// This header includes the four that hold them: ops/reshape.hpp (views, permutations,
// expand), ops/slice.hpp (slicing, cat/stack), ops/indexing.hpp (index_select, gather,
// one_hot), and ops/shape_helpers.hpp (what they share).

#include <lazytensor/ops/indexing.hpp>
#include <lazytensor/ops/reshape.hpp>
#include <lazytensor/ops/shape_helpers.hpp>
#include <lazytensor/ops/slice.hpp>
