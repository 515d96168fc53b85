#pragma once
// Indexing by tensors: index_select, gather and one_hot. The index may still be pending, so
// its values are checked by the kernels (graph/index_nodes.hpp), which raise IndexError at
// the mark_step or read that runs them; the gradients are scatter-adds (graph/shape_backward.hpp).

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <lazytensor/autograd/record.hpp>
#include <lazytensor/graph/index_nodes.hpp>
#include <lazytensor/graph/shape_backward.hpp>
#include <lazytensor/graph/shape_nodes.hpp>
#include <lazytensor/graph/submit.hpp>
#include <lazytensor/ops/shape_helpers.hpp>
#include <lazytensor/tensor/tensor.hpp>

namespace lazy {

namespace detail {

/// Records `r` (x's values at `index` along `d`, index-shaped: gather, sort's values,
/// cummax's) as a gather for autograd under `name`: the gradient goes back to where each
/// value came from, a scatter-add into x's shape.
template <Element T, IndexElement I>
void record_gathered(Tensor<T>& r, const char* name, const Tensor<T>& x, int d, const Tensor<I>& index) {
  if constexpr (is_floating_v<T>) {
    autograd::record(r, name, {autograd::edge_of(x.impl())}, [in = x.shape(), d, idx = index.detach()](const Tensor<T>& g) {
      return graph::NodeList{
          graph::submit(std::make_shared<graph::ScatterAddNode<T, I>>(g.node(), idx.node(), in, d))};
    });
  }
}

}  // namespace detail

// ---- indexing ---------------------------------------------------------------------------

/// The slices of x at positions `index` (1-D, int32 or int64) along `dim`
/// (torch.index_select). Index values outside [0, size) raise IndexError when the kernel
/// runs (at the next mark_step or read), since the index may still be pending here.
template <expr::ExprLike X, IndexElement I>
auto index_select(const X& x, std::int64_t dim, const Tensor<I>& index) {
  auto t = detail::as_tensor(x);
  using T = typename decltype(t)::value_type;
  const Shape& s = t.shape();
  if (index.dim() > 1) {
    throw ShapeError("index_select: index must be a 1-D tensor (or 0-D), got shape " + index.shape().str());
  }
  const int d = normalize_dim(dim, s.rank(), "index_select");
  Shape out = s;
  if (s.rank() == 0) {
    if (index.numel() != 1) {
      throw ShapeError("index_select: a 0-dim input takes an index of exactly one element, got shape " +
                       index.shape().str());
    }
  } else {
    out[d] = index.numel();
    out.check_size();
  }
  graph::common_device({t.node(), index.node()}, "index_select");
  Tensor<T> r(graph::submit(std::make_shared<graph::IndexSelectNode<I>>(t.node(), index.node(), d, out)));
  if constexpr (is_floating_v<T>) {
    autograd::record(r, "IndexSelectBackward0", {autograd::edge_of(t.impl())},
                     [in = s, d, idx = index.detach()](const Tensor<T>& g) {
                       return graph::NodeList{
                           graph::submit(std::make_shared<graph::IndexAddNode<T, I>>(g.node(), idx.node(), in, d))};
                     });
  }
  return r;
}

/// torch.gather: out[i][j][k] = x[index[i][j][k]][j][k] for dim 0 (likewise for the other
/// dims). index has x's rank and index.size(d) <= x.size(d) for d != dim (ShapeError); the
/// result has index's shape. Out-of-range values raise IndexError when the kernel runs.
template <expr::ExprLike X, IndexElement I>
auto gather(const X& x, std::int64_t dim, const Tensor<I>& index) {
  auto t = detail::as_tensor(x);
  using T = typename decltype(t)::value_type;
  const Shape& s = t.shape();
  const Shape& is = index.shape();
  if (is.rank() != s.rank()) {
    throw ShapeError("gather: index tensor must have the same number of dimensions as the input: expected " +
                     std::to_string(s.rank()) + " (input shape " + s.str() + "), got " + std::to_string(is.rank()) +
                     " (index shape " + is.str() + ")");
  }
  const int d = normalize_dim(dim, s.rank(), "gather");
  for (int k = 0; k < s.rank(); ++k) {
    if (k != d && is[k] > s[k]) {
      throw ShapeError("gather: size of index (" + std::to_string(is[k]) + ") must not exceed the input's size (" +
                       std::to_string(s[k]) + ") in dimension " + std::to_string(k) + " (index shape " + is.str() +
                       ", input shape " + s.str() + ", gather dim " + std::to_string(d) + ")");
    }
  }
  graph::common_device({t.node(), index.node()}, "gather");
  Tensor<T> r(graph::submit(std::make_shared<graph::GatherNode<I>>(t.node(), index.node(), d)));
  detail::record_gathered(r, "GatherBackward0", t, d, index);
  return r;
}

/// torch.nn.functional.one_hot: int64 tensor of shape index.shape + (num_classes,) with a 1
/// at each index value. num_classes = -1 means max(index) + 1, which needs the values now:
/// that form materializes `index` (an implicit sync of just what index needs). Values < 0
/// or >= num_classes raise IndexError (when the kernel runs, for an explicit num_classes).
template <IndexElement I>
Tensor<std::int64_t> one_hot(const Tensor<I>& index, std::int64_t num_classes = -1) {
  if (num_classes < -1) {
    throw ShapeError("one_hot: num_classes must be -1 (infer) or >= 0, got " + std::to_string(num_classes));
  }
  if (index.dim() >= kMaxRank) {
    throw ShapeError("one_hot: the result would have rank " + std::to_string(index.dim() + 1) +
                     ", expected at most " + std::to_string(kMaxRank) + " (index shape " + index.shape().str() + ")");
  }
  if (num_classes == -1) {
    if (index.numel() == 0) {
      throw ShapeError("one_hot: cannot infer the number of classes from an empty index tensor (shape " +
                       index.shape().str() + "); pass num_classes");
    }
    const I* p = index.data();
    const auto [lo, hi] = std::minmax_element(p, p + index.numel());
    if (*lo < 0) throw IndexError("one_hot: class values must be non-negative, found " + std::to_string(*lo));
    if (static_cast<std::int64_t>(*hi) >= kMaxElements) {
      throw ShapeError("one_hot: class value " + std::to_string(*hi) +
                       " would make more than 2^60 classes");
    }
    num_classes = static_cast<std::int64_t>(*hi) + 1;
  }
  Shape out = index.shape();
  out.push_back(num_classes);
  return Tensor<std::int64_t>(graph::submit(std::make_shared<graph::OneHotNode<I>>(index.node(), num_classes, out)));
}

}  // namespace lazy
