#pragma once
// Shape ops, all lazy: views (reshape/view, flatten, squeeze, unsqueeze) share the input's
// buffer, so a view of a pending value is pending and nothing is copied; transpose/permute,
// narrow/slice, cat/stack, index_select, gather and one_hot build the copy nodes of
// graph/shape_nodes.hpp; expand is a broadcasting element-wise node. Each op records its
// backward (graph/shape_backward.hpp holds the scatter kernels those need).

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <memory>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <lazytensor/autograd/record.hpp>
#include <lazytensor/graph/builders.hpp>
#include <lazytensor/graph/parallel.hpp>
#include <lazytensor/graph/shape_nodes.hpp>
#include <lazytensor/graph/transpose_hint.hpp>
#include <lazytensor/graph/shape_backward.hpp>
#include <lazytensor/tensor/tensor.hpp>
#include <lazytensor/core/config.hpp>

namespace lazy {

namespace detail::shape_ops {

/// An operand as a tensor: a Tensor as is (the handle is copied), an expression evaluated
/// into a pending node.
template <expr::ExprLike X>
auto as_tensor(const X& x) {
  using T = expr::value_t<X>;
  if constexpr (std::is_same_v<X, Tensor<T>>) return x;
  else if constexpr (expr::is_expr_node<X>::value) return Tensor<T>(x);
  else return Tensor<T>(x.to_leaf().node);
}

std::string list_str(std::span<const std::int64_t> v);
inline std::string list_str(const Shape& s) { return list_str(std::span<const std::int64_t>(s.begin(), s.end())); }
inline std::span<const std::int64_t> span_of(const Shape& s) { return {s.begin(), static_cast<std::size_t>(s.rank())}; }

/// A view of t with `shape` (same numel), or t's own node when the shape does not change.
/// A view of a pending view is made a view of that view's source, so chains stay short.
template <Element T>
Tensor<T> view_of(const Tensor<T>& t, const Shape& shape, const char* op) {
  graph::NodePtr src = t.node();
  if (src->shape() == shape) return t;
  if (src->pending() && dynamic_cast<graph::ViewNode*>(src.get())) src = src->inputs()[0];
  Tensor<T> r(graph::submit(std::make_shared<graph::ViewNode>(op, std::move(src), shape)));
  autograd::record(r, "ViewBackward0", {autograd::edge_of(t.impl())}, [in = t.shape()](const Tensor<T>& g) {
    return std::vector<graph::NodePtr>{view_of(g, in, "view").node()};
  });
  return r;
}

/// Resolves a size list with at most one -1 against `numel` (torch's infer_size).
Shape infer_shape(std::span<const std::int64_t> sizes, std::int64_t numel, const char* op);

template <expr::ExprLike X>
auto reshape_impl(const X& x, std::span<const std::int64_t> sizes, const char* op) {
  auto t = as_tensor(x);
  return view_of(t, infer_shape(sizes, t.numel(), op), op);
}

/// A permuted copy, or a view when only size-1 dims move (the bytes are then in order).
template <Element T>
Tensor<T> permute_impl(const Tensor<T>& t, std::vector<int> perm, const char* op) {
  const graph::NodePtr& n = t.node();
  bool identity = true;
  for (std::size_t i = 0; i < perm.size(); ++i) identity = identity && perm[i] == static_cast<int>(i);
  if (identity) return t;
  if (graph::PermuteNode::make_plan(n->shape(), perm).keeps_order()) {
    return view_of(t, graph::PermuteNode::permuted_shape(n->shape(), perm), op);
  }
  std::vector<int> inverse(perm.size());
  for (std::size_t i = 0; i < perm.size(); ++i) inverse[static_cast<std::size_t>(perm[i])] = static_cast<int>(i);
  const bool swap_last_two = perm == graph::TransposeNode::last_two(static_cast<int>(perm.size()));
  graph::NodePtr source;  // transpose(transpose(s)) is s: no node, no copy
  if (swap_last_two && n->pending()) {
    if (auto* tr = dynamic_cast<graph::TransposeOfLastTwo*>(n.get()))
      source = tr->transpose_source();
  }
  Tensor<T> r =
      source ? Tensor<T>(source)
      : swap_last_two
          ? Tensor<T>(graph::submit(std::make_shared<graph::TransposeNode>(n)))
          : Tensor<T>(graph::submit(std::make_shared<graph::PermuteNode>(n, std::move(perm), op)));
  autograd::record(r, "PermuteBackward0", {autograd::edge_of(t.impl())}, [inverse](const Tensor<T>& g) {
    return std::vector<graph::NodePtr>{permute_impl(g, inverse, "permute").node()};
  });
  return r;
}

template <expr::ExprLike X>
auto expand_impl(const X& x, std::span<const std::int64_t> sizes) {
  using T = expr::value_t<X>;
  Tensor<T> t = as_tensor(x);
  const Shape& s = t.shape();
  const int r = s.rank();
  const auto k = static_cast<int>(sizes.size());
  if (k < r) {
    throw ShapeError("expand: the number of sizes provided (" + std::to_string(k) +
                     ") must be greater or equal to the number of dimensions in the tensor (" + std::to_string(r) +
                     "); target sizes " + list_str(sizes) + ", tensor sizes " + list_str(s));
  }
  if (k > kMaxRank) {
    throw ShapeError("expand: target sizes " + list_str(sizes) + " have rank " + std::to_string(k) +
                     ", expected at most " + std::to_string(kMaxRank));
  }
  Shape out;
  for (int i = 0; i < k; ++i) {
    const std::int64_t v = sizes[i];
    if (i < k - r) {
      if (v < 0) {
        throw ShapeError("expand: the expanded size of the tensor (" + std::to_string(v) +
                         ") isn't allowed in a leading, non-existing dimension " + std::to_string(i) +
                         "; target sizes " + list_str(sizes) + ", tensor sizes " + list_str(s));
      }
      out.push_back(v);
      continue;
    }
    const std::int64_t d = s[i - (k - r)];
    if (v == -1) {
      out.push_back(d);
    } else if (v < 0 || (v != d && d != 1)) {
      throw ShapeError("expand: the expanded size of the tensor (" + std::to_string(v) +
                       ") must match the existing size (" + std::to_string(d) + ") at non-singleton dimension " +
                       std::to_string(i) + "; target sizes " + list_str(sizes) + ", tensor sizes " + list_str(s));
    } else {
      out.push_back(v);
    }
  }
  if (out == s) return t;
  // The element-wise node broadcasts its leaves to `out`: a splat per expanded dim (and
  // its gradient sums back over them).
  return evaluate_as<T>(expr::make<ops::Identity>(t), out);
}

/// Records the backward of a slice of `t` (the gradient lands in zeros of t's shape).
template <Element T>
void record_slice(Tensor<T>& r, const Tensor<T>& t, int d, std::int64_t start, std::int64_t step) {
  if constexpr (is_floating_v<T>) {
    autograd::record(r, "SliceBackward0", {autograd::edge_of(t.impl())},
                     [in = t.shape(), d, start, step](const Tensor<T>& g) {
                       return std::vector<graph::NodePtr>{graph::submit(
                           std::make_shared<graph::SliceBackwardNode<T>>(g.node(), in, d, start, step))};
                     });
  }
}

/// Autograd edges of a list of tensors.
template <Element T>
std::vector<autograd::GradFnPtr> edges_of(const std::vector<Tensor<T>>& ts) {
  std::vector<autograd::GradFnPtr> e;
  e.reserve(ts.size());
  for (const auto& t : ts) e.push_back(autograd::edge_of(t.impl()));
  return e;
}

template <Element T>
std::vector<graph::NodePtr> nodes_of(const std::vector<Tensor<T>>& ts) {
  std::vector<graph::NodePtr> v;
  v.reserve(ts.size());
  for (const auto& t : ts) v.push_back(t.node());
  return v;
}

}  // namespace detail::shape_ops

// ---- views ------------------------------------------------------------------------------

/// A view of `x` with shape `sizes` (one entry may be -1: inferred). Shares x's buffer;
/// ShapeError if the element count differs. An expression is evaluated first.
template <expr::ExprLike X>
auto reshape(const X& x, std::initializer_list<std::int64_t> sizes) {
  return detail::shape_ops::reshape_impl(x, {sizes.begin(), sizes.size()}, "reshape");
}
/// reshape with the sizes in a vector.
template <expr::ExprLike X>
auto reshape(const X& x, const std::vector<std::int64_t>& sizes) {
  return detail::shape_ops::reshape_impl(x, sizes, "reshape");
}
/// reshape to a Shape.
template <expr::ExprLike X>
auto reshape(const X& x, const Shape& shape) {
  return detail::shape_ops::reshape_impl(x, detail::shape_ops::span_of(shape), "reshape");
}

/// Same as reshape (tensors are always contiguous here, so view never fails where reshape
/// would copy).
template <expr::ExprLike X>
auto view(const X& x, std::initializer_list<std::int64_t> sizes) {
  return detail::shape_ops::reshape_impl(x, {sizes.begin(), sizes.size()}, "view");
}
/// view with the sizes in a vector.
template <expr::ExprLike X>
auto view(const X& x, const std::vector<std::int64_t>& sizes) {
  return detail::shape_ops::reshape_impl(x, sizes, "view");
}
/// view as a Shape.
template <expr::ExprLike X>
auto view(const X& x, const Shape& shape) {
  return detail::shape_ops::reshape_impl(x, detail::shape_ops::span_of(shape), "view");
}

/// Merges dims start_dim..end_dim (inclusive, negative counts from the back) into one, as a
/// view. A 0-d tensor becomes 1-D with one element, as in torch.
template <expr::ExprLike X>
auto flatten(const X& x, std::int64_t start_dim = 0, std::int64_t end_dim = -1) {
  auto t = detail::shape_ops::as_tensor(x);
  const Shape& s = t.shape();
  const int a = normalize_dim(start_dim, s.rank(), "flatten"), b = normalize_dim(end_dim, s.rank(), "flatten");
  if (a > b) {
    throw ShapeError("flatten: start_dim (" + std::to_string(start_dim) + ", i.e. " + std::to_string(a) +
                     ") cannot come after end_dim (" + std::to_string(end_dim) + ", i.e. " + std::to_string(b) + ")");
  }
  if (s.rank() == 0) return detail::shape_ops::view_of(t, Shape{1}, "flatten");
  Shape out;
  std::int64_t merged = 1;
  for (int i = 0; i < s.rank(); ++i) {
    if (i < a || i > b) {
      out.push_back(s[i]);
    } else {
      merged *= s[i];
      if (i == b) out.push_back(merged);
    }
  }
  return detail::shape_ops::view_of(t, out, "flatten");
}

/// Removes every dim of size 1 (a view).
template <expr::ExprLike X>
auto squeeze(const X& x) {
  auto t = detail::shape_ops::as_tensor(x);
  Shape out;
  for (auto d : t.shape())
    if (d != 1) out.push_back(d);
  return detail::shape_ops::view_of(t, out, "squeeze");
}

/// Removes dim `dim` if its size is 1; otherwise returns x unchanged, as torch does.
template <expr::ExprLike X>
auto squeeze(const X& x, std::int64_t dim) {
  auto t = detail::shape_ops::as_tensor(x);
  const Shape& s = t.shape();
  const int d = normalize_dim(dim, s.rank(), "squeeze");
  if (s.rank() == 0 || s[d] != 1) return t;
  Shape out;
  for (int i = 0; i < s.rank(); ++i)
    if (i != d) out.push_back(s[i]);
  return detail::shape_ops::view_of(t, out, "squeeze");
}

/// Inserts a dim of size 1 at position `dim` (in [-rank-1, rank]), as a view.
template <expr::ExprLike X>
auto unsqueeze(const X& x, std::int64_t dim) {
  auto t = detail::shape_ops::as_tensor(x);
  const Shape& s = t.shape();
  if (s.rank() >= kMaxRank) {
    throw ShapeError("unsqueeze: the result would have rank " + std::to_string(s.rank() + 1) +
                     ", expected at most " + std::to_string(kMaxRank) + " (input shape " + s.str() + ")");
  }
  const int d = normalize_dim(dim, s.rank() + 1, "unsqueeze");
  Shape out;
  for (int i = 0; i < s.rank(); ++i) {
    if (i == d) out.push_back(1);
    out.push_back(s[i]);
  }
  if (d == s.rank()) out.push_back(1);
  return detail::shape_ops::view_of(t, out, "unsqueeze");
}

// ---- permutations -------------------------------------------------------------------------

/// Reorders the dims: out dim i is x's dim dims[i] (a permutation of 0..rank-1; negative
/// entries count from the back). A copy, unless only size-1 dims move (then a view).
template <expr::ExprLike X>
auto permute(const X& x, const std::vector<std::int64_t>& dims) {
  auto t = detail::shape_ops::as_tensor(x);
  const int r = t.dim();
  if (static_cast<int>(dims.size()) != r) {
    throw ShapeError("permute: number of dims don't match: the tensor has " + std::to_string(r) +
                     " dims (shape " + t.shape().str() + "), the permutation " +
                     detail::shape_ops::list_str(dims) + " has " + std::to_string(dims.size()));
  }
  std::vector<int> perm;
  std::vector<char> seen(static_cast<std::size_t>(r), 0);
  for (auto d : dims) {
    const int n = normalize_dim(d, r, "permute");
    if (seen[n]) {
      throw ShapeError("permute: repeated dim " + std::to_string(n) + " in the permutation " +
                       detail::shape_ops::list_str(dims) + " (expected each of 0.." + std::to_string(r - 1) +
                       " exactly once)");
    }
    seen[n] = 1;
    perm.push_back(n);
  }
  return detail::shape_ops::permute_impl(t, std::move(perm), "permute");
}
/// permute with a braced list: permute(x, {2, 0, 1}).
template <expr::ExprLike X>
auto permute(const X& x, std::initializer_list<std::int64_t> dims) {
  return permute(x, std::vector<std::int64_t>(dims));
}

/// Swaps dims d0 and d1 (a copy; for the last two dims a pending TransposeNode that a
/// matmul reads through without running it).
template <expr::ExprLike X>
auto transpose(const X& x, std::int64_t d0, std::int64_t d1) {
  auto t = detail::shape_ops::as_tensor(x);
  const int r = t.dim();
  const int a = normalize_dim(d0, r, "transpose"), b = normalize_dim(d1, r, "transpose");
  if (a == b || r == 0) return t;
  std::vector<int> perm(static_cast<std::size_t>(r));
  for (int i = 0; i < r; ++i) perm[i] = i;
  std::swap(perm[a], perm[b]);
  return detail::shape_ops::permute_impl(t, std::move(perm), "transpose");
}

/// torch's t(): the transpose of a 2-D tensor; 0-D and 1-D tensors are returned as is.
/// ShapeError for rank > 2.
template <expr::ExprLike X>
auto transpose(const X& x) {
  auto t = detail::shape_ops::as_tensor(x);
  if (t.dim() > 2) {
    throw ShapeError("transpose: t() expects a tensor with <= 2 dimensions, but got shape " + t.shape().str() +
                     " (" + std::to_string(t.dim()) + "-D)");
  }
  if (t.dim() < 2) return t;
  return transpose(t, 0, 1);
}

// ---- expand -------------------------------------------------------------------------------

/// Broadcasts x to `sizes` (torch.expand): new dims are prepended, a size-1 dim may grow,
/// -1 keeps a size. Materialized lazily by a broadcasting element-wise node.
template <expr::ExprLike X>
auto expand(const X& x, std::initializer_list<std::int64_t> sizes) {
  return detail::shape_ops::expand_impl(x, {sizes.begin(), sizes.size()});
}
/// expand with the sizes in a vector.
template <expr::ExprLike X>
auto expand(const X& x, const std::vector<std::int64_t>& sizes) {
  return detail::shape_ops::expand_impl(x, sizes);
}
/// expand to a Shape.
template <expr::ExprLike X>
auto expand(const X& x, const Shape& shape) {
  return detail::shape_ops::expand_impl(x, detail::shape_ops::span_of(shape));
}

// ---- slicing ------------------------------------------------------------------------------

/// Elements start, start + step, ... below end along `dim` (torch slicing x[start:end:step]):
/// negative start/end count from the back, both are clamped to [0, size]; step must be > 0.
/// A copy (buffers never start at an offset), except a full-range slice which is x itself.
template <expr::ExprLike X>
auto slice(const X& x, std::int64_t dim, std::int64_t start = 0,
           std::int64_t end = std::numeric_limits<std::int64_t>::max(), std::int64_t step = 1) {
  auto t = detail::shape_ops::as_tensor(x);
  using T = typename decltype(t)::value_type;
  const Shape& s = t.shape();
  if (s.rank() == 0) throw ShapeError("slice: cannot be applied to a 0-dim tensor (expected rank >= 1)");
  if (step <= 0) throw ShapeError("slice: step must be greater than zero, got " + std::to_string(step));
  const int d = normalize_dim(dim, s.rank(), "slice");
  const std::int64_t size = s[d];
  if (start < 0) start += size;
  if (end < 0) end += size;
  start = std::clamp<std::int64_t>(start, 0, size);
  end = std::clamp<std::int64_t>(end, start, size);
  const std::int64_t len = (end - start + step - 1) / step;
  if (start == 0 && len == size && (step == 1 || size <= 1)) return t;
  Shape out = s;
  out[d] = len;
  Tensor<T> r(graph::submit(std::make_shared<graph::SliceNode>("slice", t.node(), d, start, step, out)));
  detail::shape_ops::record_slice(r, t, d, start, step);
  return r;
}

/// `length` elements from `start` along `dim` (torch.narrow). start may be negative
/// (counting from the back); ShapeError if the range does not fit.
template <expr::ExprLike X>
auto narrow(const X& x, std::int64_t dim, std::int64_t start, std::int64_t length) {
  auto t = detail::shape_ops::as_tensor(x);
  using T = typename decltype(t)::value_type;
  const Shape& s = t.shape();
  if (s.rank() == 0) throw ShapeError("narrow: cannot be applied to a 0-dim tensor (expected rank >= 1)");
  const int d = normalize_dim(dim, s.rank(), "narrow");
  const std::int64_t size = s[d];
  if (start < -size || start > size) {
    throw ShapeError("narrow: start out of range (expected to be in range of [" + std::to_string(-size) + ", " +
                     std::to_string(size) + "], but got " + std::to_string(start) + ")");
  }
  if (start < 0) start += size;
  if (length < 0) throw ShapeError("narrow: length must be non-negative, got " + std::to_string(length));
  if (start > size - length) {
    throw ShapeError("narrow: start (" + std::to_string(start) + ") + length (" + std::to_string(length) +
                     ") exceeds dimension size (" + std::to_string(size) + ") of dimension " + std::to_string(d));
  }
  if (start == 0 && length == size) return t;
  Shape out = s;
  out[d] = length;
  Tensor<T> r(graph::submit(std::make_shared<graph::SliceNode>("narrow", t.node(), d, start, 1, out)));
  detail::shape_ops::record_slice(r, t, d, start, 1);
  return r;
}

// ---- cat / stack ----------------------------------------------------------------------------

/// Concatenates along `dim` (torch.cat). The tensors need the same rank and equal sizes
/// except in `dim` (ShapeError), and the same device (DeviceError). As in torch, 1-D empty
/// tensors (shape (0,)) are skipped whatever their rank.
template <Element T>
Tensor<T> cat(const std::vector<Tensor<T>>& tensors, std::int64_t dim = 0) {
  if (tensors.empty()) throw ShapeError("cat: expected a non-empty list of tensors, got an empty list");
  std::vector<Tensor<T>> ts;
  for (const auto& t : tensors)
    if (!(t.dim() == 1 && t.numel() == 0)) ts.push_back(t);
  if (ts.empty()) return tensors.front();
  const Shape& ref = ts.front().shape();
  const int r = ref.rank();
  if (r == 0) throw ShapeError("cat: zero-dimensional tensor (at position 0) cannot be concatenated (expected rank >= 1)");
  const int d = normalize_dim(dim, r, "cat");
  for (std::size_t i = 1; i < ts.size(); ++i) {
    const Shape& s = ts[i].shape();
    if (s.rank() != r) {
      throw ShapeError("cat: tensors must have the same number of dimensions: expected " + std::to_string(r) +
                       " (shape " + ref.str() + "), got " + std::to_string(s.rank()) + " (shape " + s.str() +
                       ") for tensor " + std::to_string(i));
    }
    for (int k = 0; k < r; ++k) {
      if (k != d && s[k] != ref[k]) {
        throw ShapeError("cat: sizes of tensors must match except in dimension " + std::to_string(d) +
                         ": expected size " + std::to_string(ref[k]) + " but got size " + std::to_string(s[k]) +
                         " in dimension " + std::to_string(k) + " for tensor " + std::to_string(i) + " (shapes " +
                         ref.str() + " and " + s.str() + ")");
      }
    }
  }
  auto nodes = detail::shape_ops::nodes_of(ts);
  graph::Device& dev = graph::common_device(nodes, "cat");
  if (ts.size() == 1) return ts.front();
  std::int64_t outer = 1, inner = 1, total = 0;
  for (int k = 0; k < d; ++k) outer *= ref[k];
  for (int k = d + 1; k < r; ++k) inner *= ref[k];
  std::vector<std::int64_t> widths;
  for (const auto& t : ts) {
    widths.push_back(t.shape()[d] * inner);
    total += t.shape()[d];
  }
  Shape out = ref;
  out[d] = total;
  Tensor<T> result(graph::submit(
      std::make_shared<graph::CatNode>("cat", dtype_of<T>(), std::move(nodes), out, &dev, outer, std::move(widths))));
  std::vector<std::int64_t> sizes;
  for (const auto& t : ts) sizes.push_back(t.shape()[d]);
  autograd::record(result, "CatBackward0", detail::shape_ops::edges_of(ts), [sizes, d](const Tensor<T>& g) {
    std::vector<graph::NodePtr> gs;
    std::int64_t off = 0;
    for (auto len : sizes) {
      gs.push_back(narrow(g, d, off, len).node());
      off += len;
    }
    return gs;
  });
  return result;
}
/// cat with a braced list: cat({a, b}, 1).
template <Element T>
Tensor<T> cat(std::initializer_list<Tensor<T>> tensors, std::int64_t dim = 0) {
  return cat(std::vector<Tensor<T>>(tensors), dim);
}

/// Stacks equal-shaped tensors along a new dim `dim` (in [-rank-1, rank]) (torch.stack).
template <Element T>
Tensor<T> stack(const std::vector<Tensor<T>>& tensors, std::int64_t dim = 0) {
  if (tensors.empty()) throw ShapeError("stack: expected a non-empty list of tensors, got an empty list");
  const Shape& ref = tensors.front().shape();
  for (std::size_t i = 1; i < tensors.size(); ++i) {
    if (!(tensors[i].shape() == ref)) {
      throw ShapeError("stack: expected each tensor to be equal size, but got " + ref.str() + " at entry 0 and " +
                       tensors[i].shape().str() + " at entry " + std::to_string(i));
    }
  }
  if (ref.rank() >= kMaxRank) {
    throw ShapeError("stack: the result would have rank " + std::to_string(ref.rank() + 1) + ", expected at most " +
                     std::to_string(kMaxRank));
  }
  const int d = normalize_dim(dim, ref.rank() + 1, "stack");
  auto nodes = detail::shape_ops::nodes_of(tensors);
  graph::Device& dev = graph::common_device(nodes, "stack");
  if (tensors.size() == 1) return unsqueeze(tensors.front(), d);
  std::int64_t outer = 1, inner = 1;
  for (int k = 0; k < d; ++k) outer *= ref[k];
  for (int k = d; k < ref.rank(); ++k) inner *= ref[k];
  Shape out;
  for (int k = 0; k <= ref.rank(); ++k) {
    if (k == d) out.push_back(static_cast<std::int64_t>(tensors.size()));
    if (k < ref.rank()) out.push_back(ref[k]);
  }
  std::vector<std::int64_t> widths(tensors.size(), inner);
  Tensor<T> r(graph::submit(
      std::make_shared<graph::CatNode>("stack", dtype_of<T>(), std::move(nodes), out, &dev, outer, std::move(widths))));
  autograd::record(r, "StackBackward0", detail::shape_ops::edges_of(tensors),
                   [n = tensors.size(), d, ref](const Tensor<T>& g) {
                     std::vector<graph::NodePtr> gs;
                     for (std::size_t i = 0; i < n; ++i) {
                       gs.push_back(reshape(narrow(g, d, static_cast<std::int64_t>(i), 1), ref).node());
                     }
                     return gs;
                   });
  return r;
}
/// stack with a braced list: stack({a, b}, 0).
template <Element T>
Tensor<T> stack(std::initializer_list<Tensor<T>> tensors, std::int64_t dim = 0) {
  return stack(std::vector<Tensor<T>>(tensors), dim);
}

// ---- indexing ---------------------------------------------------------------------------

/// The slices of x at positions `index` (1-D, int32 or int64) along `dim`
/// (torch.index_select). Index values outside [0, size) raise IndexError when the kernel
/// runs (at the next mark_step or read), since the index may still be pending here.
template <expr::ExprLike X, IndexElement I>
auto index_select(const X& x, std::int64_t dim, const Tensor<I>& index) {
  auto t = detail::shape_ops::as_tensor(x);
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
  }
  graph::common_device({t.node(), index.node()}, "index_select");
  Tensor<T> r(graph::submit(std::make_shared<graph::IndexSelectNode<I>>(t.node(), index.node(), d, out)));
  if constexpr (is_floating_v<T>) {
    autograd::record(r, "IndexSelectBackward0", {autograd::edge_of(t.impl())},
                     [in = s, d, idx = index.detach()](const Tensor<T>& g) {
                       return std::vector<graph::NodePtr>{
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
  auto t = detail::shape_ops::as_tensor(x);
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
  if constexpr (is_floating_v<T>) {
    autograd::record(r, "GatherBackward0", {autograd::edge_of(t.impl())},
                     [in = s, d, idx = index.detach()](const Tensor<T>& g) {
                       return std::vector<graph::NodePtr>{
                           graph::submit(std::make_shared<graph::ScatterAddNode<T, I>>(g.node(), idx.node(), in, d))};
                     });
  }
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
    num_classes = static_cast<std::int64_t>(*hi) + 1;
  }
  Shape out = index.shape();
  out.push_back(num_classes);
  return Tensor<std::int64_t>(graph::submit(std::make_shared<graph::OneHotNode<I>>(index.node(), num_classes, out)));
}

}  // namespace lazy

#if LAZYTENSOR_HEADER_DEFINITIONS
namespace lazy::detail::shape_ops {

LAZYTENSOR_INLINE std::string list_str(std::span<const std::int64_t> v) {
  std::string s = "[";
  for (std::size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s + "]";
}

LAZYTENSOR_INLINE Shape infer_shape(std::span<const std::int64_t> sizes, std::int64_t numel, const char* op) {
  if (sizes.size() > static_cast<std::size_t>(kMaxRank)) {
    throw ShapeError(std::string(op) + ": shape " + list_str(sizes) + " has rank " + std::to_string(sizes.size()) +
                     ", expected at most " + std::to_string(kMaxRank));
  }
  int infer = -1;
  std::int64_t known = 1;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    if (sizes[i] == -1) {
      if (infer >= 0) throw ShapeError(std::string(op) + ": only one dimension can be inferred (-1), got " + list_str(sizes));
      infer = static_cast<int>(i);
    } else if (sizes[i] < 0) {
      throw ShapeError(std::string(op) + ": invalid shape dimension " + std::to_string(sizes[i]) + " in " +
                       list_str(sizes) + " (expected sizes >= 0, or -1 once)");
    } else {
      known *= sizes[i];
    }
  }
  std::vector<std::int64_t> out(sizes.begin(), sizes.end());
  if (infer >= 0) {
    if (known == 0) {
      throw ShapeError(std::string(op) + ": cannot reshape a tensor of " + std::to_string(numel) + " elements into shape " +
                       list_str(sizes) + " because the unspecified dimension size -1 can be any value and is ambiguous");
    }
    if (numel % known != 0) {
      throw ShapeError(std::string(op) + ": shape " + list_str(sizes) + " is invalid for input of size " +
                       std::to_string(numel));
    }
    out[infer] = numel / known;
  } else if (known != numel) {
    throw ShapeError(std::string(op) + ": shape " + list_str(sizes) + " is invalid for input of size " +
                     std::to_string(numel) + " (expected " + std::to_string(known) + " elements)");
  }
  return Shape(out);
}

}  // namespace lazy::detail::shape_ops
#endif  // LAZYTENSOR_HEADER_DEFINITIONS
