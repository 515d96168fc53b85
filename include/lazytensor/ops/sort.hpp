#pragma once
// sort, argsort and topk. One kernel computes the int64 positions (graph/sort_node.hpp);
// the values are a gather of the input at them (GatherNode), so their gradient is gather's
// scatter-add into the input's shape (ScatterAddNode), and argsort pays for no values.

#include <cstdint>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include <lazytensor/autograd/record.hpp>
#include <lazytensor/graph/index_nodes.hpp>
#include <lazytensor/graph/shape_backward.hpp>
#include <lazytensor/graph/shape_nodes.hpp>
#include <lazytensor/graph/sort_node.hpp>
#include <lazytensor/graph/submit.hpp>
#include <lazytensor/ops/indexing.hpp>
#include <lazytensor/ops/shape_helpers.hpp>
#include <lazytensor/tensor/tensor.hpp>

namespace lazy {

namespace detail {

/// The positions of the first k elements of every row of t along d in sorted order.
template <Element T>
Tensor<std::int64_t> sorted_positions(const Tensor<T>& t, int d, std::int64_t k, bool descending, const char* op) {
  return Tensor<std::int64_t>(
      graph::submit(std::make_shared<graph::SortIndicesNode<T>>(t.node(), d, k, descending, op)));
}

/// t's values at `idx` along d, with gather's derivative (the positions are distinct
/// within a row, so the scatter-add only places each gradient element).
template <Element T>
Tensor<T> values_at(const Tensor<T>& t, int d, const Tensor<std::int64_t>& idx, const char* backward_name) {
  Tensor<T> r(graph::submit(std::make_shared<graph::GatherNode<std::int64_t>>(t.node(), idx.node(), d)));
  record_gathered(r, backward_name, t, d, idx);
  return r;
}

/// The size of t's dimension d, a 0-d tensor's being 1 (one element to order).
inline std::int64_t sorted_extent(const Shape& s, int d) { return s.rank() == 0 ? 1 : s[d]; }

}  // namespace detail

/// torch.sort: (values, indices) of x ordered along `dim`, for `auto [v, i] = sort(x)`.
/// Always stable (torch's stable=true): equal values keep their index order, so the
/// result does not depend on the thread count or on the sort algorithm, and there is no
/// `stable` flag to pass. NaN counts as larger than every number (last ascending, first
/// descending), NaNs in index order. A 0-d x gives itself and index 0 (dim 0 or -1).
/// Only the values carry a gradient (floating types): it goes back to where each value
/// came from.
template <expr::ExprLike X>
std::tuple<Tensor<expr::value_t<X>>, Tensor<std::int64_t>> sort(const X& x, std::int64_t dim = -1,
                                                                bool descending = false) {
  auto t = detail::as_tensor(x);
  const int d = normalize_dim(dim, t.dim(), "sort");
  auto idx = detail::sorted_positions(t, d, detail::sorted_extent(t.shape(), d), descending, "sort");
  auto values = detail::values_at(t, d, idx, "SortBackward0");
  return {std::move(values), std::move(idx)};
}

/// torch.argsort: the indices of sort(x, dim, descending) without the values (no gather
/// is computed). Stable, with NaN ordered as sort orders it.
template <expr::ExprLike X>
Tensor<std::int64_t> argsort(const X& x, std::int64_t dim = -1, bool descending = false) {
  auto t = detail::as_tensor(x);
  const int d = normalize_dim(dim, t.dim(), "argsort");
  return detail::sorted_positions(t, d, detail::sorted_extent(t.shape(), d), descending, "argsort");
}

/// torch.topk: the k largest (or with largest=false, smallest) elements along `dim` and
/// their indices, for `auto [v, i] = topk(x, k)`. The k are selected before they are
/// sorted, so a small k costs less than sort. The result is always sorted (largest first,
/// or smallest first): torch lets sorted=false return any order, and the sorted one is
/// that too, so the flag changes nothing. Ties take the lower index first, and NaN ranks as
/// the largest value, so the result is the first k of sort(x, dim, largest). k must be in
/// [0, size of dim] (ShapeError); a 0-d x has one element and takes k = 1 only, since a
/// 0-d result cannot be empty.
template <expr::ExprLike X>
std::tuple<Tensor<expr::value_t<X>>, Tensor<std::int64_t>> topk(const X& x, std::int64_t k, std::int64_t dim = -1,
                                                                bool largest = true, bool sorted = true) {
  (void)sorted;  // always sorted: see above
  auto t = detail::as_tensor(x);
  const Shape& s = t.shape();
  const int d = normalize_dim(dim, s.rank(), "topk");
  const std::int64_t size = detail::sorted_extent(s, d);
  if (s.rank() == 0 && k != 1) {
    throw ShapeError("topk: k (" + std::to_string(k) +
                     ") is out of range for a 0-dim tensor, which has one element (expected k = 1)");
  }
  if (k < 0 || k > size) {
    throw ShapeError("topk: k (" + std::to_string(k) + ") is out of range for dimension " + std::to_string(d) +
                     " of size " + std::to_string(size) + " (expected 0 <= k <= " + std::to_string(size) +
                     ", input shape " + s.str() + ")");
  }
  auto idx = detail::sorted_positions(t, d, k, largest, "topk");
  auto values = detail::values_at(t, d, idx, "TopkBackward0");
  return {std::move(values), std::move(idx)};
}

}  // namespace lazy
