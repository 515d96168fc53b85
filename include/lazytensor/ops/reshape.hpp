#pragma once
// The shape ops that keep the elements: views (reshape/view, flatten, squeeze, unsqueeze),
// which share the input's buffer, so a view of a pending value is pending and nothing is
// copied; permutations (permute, transpose), copies unless only size-1 dims move; and
// expand, a broadcasting element-wise node.

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include <lazytensor/ops/shape_helpers.hpp>
#include <lazytensor/tensor/tensor.hpp>

namespace lazy {

// ---- views ------------------------------------------------------------------------------

/// A view of `x` with shape `sizes` (one entry may be -1: inferred). Shares x's buffer;
/// ShapeError if the element count differs. An expression is evaluated first.
template <expr::ExprLike X>
auto reshape(const X& x, std::initializer_list<std::int64_t> sizes) {
  return detail::reshape_impl(x, {sizes.begin(), sizes.size()}, "reshape");
}
/// reshape with the sizes in a vector.
template <expr::ExprLike X>
auto reshape(const X& x, const std::vector<std::int64_t>& sizes) {
  return detail::reshape_impl(x, sizes, "reshape");
}
/// reshape to a Shape.
template <expr::ExprLike X>
auto reshape(const X& x, const Shape& shape) {
  return detail::reshape_impl(x, detail::span_of(shape), "reshape");
}

/// Same as reshape (tensors are always contiguous here, so view never fails where reshape
/// would copy).
template <expr::ExprLike X>
auto view(const X& x, std::initializer_list<std::int64_t> sizes) {
  return detail::reshape_impl(x, {sizes.begin(), sizes.size()}, "view");
}
/// view with the sizes in a vector.
template <expr::ExprLike X>
auto view(const X& x, const std::vector<std::int64_t>& sizes) {
  return detail::reshape_impl(x, sizes, "view");
}
/// view as a Shape.
template <expr::ExprLike X>
auto view(const X& x, const Shape& shape) {
  return detail::reshape_impl(x, detail::span_of(shape), "view");
}

/// Merges dims start_dim..end_dim (inclusive, negative counts from the back) into one, as a
/// view. A 0-d tensor becomes 1-D with one element, as in torch.
template <expr::ExprLike X>
auto flatten(const X& x, std::int64_t start_dim = 0, std::int64_t end_dim = -1) {
  auto t = detail::as_tensor(x);
  const Shape& s = t.shape();
  const int a = normalize_dim(start_dim, s.rank(), "flatten"), b = normalize_dim(end_dim, s.rank(), "flatten");
  if (a > b) {
    throw ShapeError("flatten: start_dim (" + std::to_string(start_dim) + ", i.e. " + std::to_string(a) +
                     ") cannot come after end_dim (" + std::to_string(end_dim) + ", i.e. " + std::to_string(b) + ")");
  }
  if (s.rank() == 0) return detail::view_of(t, Shape{1}, "flatten");
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
  return detail::view_of(t, out, "flatten");
}

/// Removes every dim of size 1 (a view).
template <expr::ExprLike X>
auto squeeze(const X& x) {
  auto t = detail::as_tensor(x);
  Shape out;
  for (auto d : t.shape())
    if (d != 1) out.push_back(d);
  return detail::view_of(t, out, "squeeze");
}

/// Removes dim `dim` if its size is 1; otherwise returns x unchanged, as torch does.
template <expr::ExprLike X>
auto squeeze(const X& x, std::int64_t dim) {
  auto t = detail::as_tensor(x);
  const Shape& s = t.shape();
  const int d = normalize_dim(dim, s.rank(), "squeeze");
  if (s.rank() == 0 || s[d] != 1) return detail::fresh_handle(t);
  Shape out;
  for (int i = 0; i < s.rank(); ++i)
    if (i != d) out.push_back(s[i]);
  return detail::view_of(t, out, "squeeze");
}

/// Inserts a dim of size 1 at position `dim` (in [-rank-1, rank]), as a view.
template <expr::ExprLike X>
auto unsqueeze(const X& x, std::int64_t dim) {
  auto t = detail::as_tensor(x);
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
  return detail::view_of(t, out, "unsqueeze");
}

// ---- permutations -------------------------------------------------------------------------

/// Reorders the dims: out dim i is x's dim dims[i] (a permutation of 0..rank-1; negative
/// entries count from the back). A copy, unless only size-1 dims move (then a view).
template <expr::ExprLike X>
auto permute(const X& x, const std::vector<std::int64_t>& dims) {
  auto t = detail::as_tensor(x);
  const int r = t.dim();
  if (static_cast<int>(dims.size()) != r) {
    throw ShapeError("permute: number of dims don't match: the tensor has " + std::to_string(r) +
                     " dims (shape " + t.shape().str() + "), the permutation " +
                     detail::list_str(dims) + " has " + std::to_string(dims.size()));
  }
  std::vector<int> perm;
  std::vector<char> seen(static_cast<std::size_t>(r), 0);
  for (auto d : dims) {
    const int n = normalize_dim(d, r, "permute");
    if (seen[n]) {
      throw ShapeError("permute: repeated dim " + std::to_string(n) + " in the permutation " +
                       detail::list_str(dims) + " (expected each of 0.." + std::to_string(r - 1) +
                       " exactly once)");
    }
    seen[n] = 1;
    perm.push_back(n);
  }
  return detail::permute_impl(t, std::move(perm), "permute");
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
  auto t = detail::as_tensor(x);
  const int r = t.dim();
  const int a = normalize_dim(d0, r, "transpose"), b = normalize_dim(d1, r, "transpose");
  if (a == b || r == 0) return detail::fresh_handle(t);
  std::vector<int> perm(static_cast<std::size_t>(r));
  for (int i = 0; i < r; ++i) perm[i] = i;
  std::swap(perm[a], perm[b]);
  return detail::permute_impl(t, std::move(perm), "transpose");
}

/// torch's t(): the transpose of a 2-D tensor; 0-D and 1-D tensors are returned as is.
/// ShapeError for rank > 2.
template <expr::ExprLike X>
auto transpose(const X& x) {
  auto t = detail::as_tensor(x);
  if (t.dim() > 2) {
    throw ShapeError("transpose: t() expects a tensor with <= 2 dimensions, but got shape " + t.shape().str() +
                     " (" + std::to_string(t.dim()) + "-D)");
  }
  if (t.dim() < 2) return detail::fresh_handle(t);
  return transpose(t, 0, 1);
}

// ---- expand -------------------------------------------------------------------------------

/// Broadcasts x to `sizes` (torch.expand): new dims are prepended, a size-1 dim may grow,
/// -1 keeps a size. Materialized lazily by a broadcasting element-wise node.
template <expr::ExprLike X>
auto expand(const X& x, std::initializer_list<std::int64_t> sizes) {
  return detail::expand_impl(x, {sizes.begin(), sizes.size()});
}
/// expand with the sizes in a vector.
template <expr::ExprLike X>
auto expand(const X& x, const std::vector<std::int64_t>& sizes) {
  return detail::expand_impl(x, sizes);
}
/// expand to a Shape.
template <expr::ExprLike X>
auto expand(const X& x, const Shape& shape) {
  return detail::expand_impl(x, detail::span_of(shape));
}

}  // namespace lazy
