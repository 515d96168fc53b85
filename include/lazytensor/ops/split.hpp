#pragma once
// Splitting a tensor into pieces along one dim: split (equal sizes, or the sizes given, as
// torch's split_with_sizes), chunk and unbind. Composites of narrow (ops/slice.hpp) and
// reshape: each piece records narrow's backward, so no node or backward of their own exists.
// A piece is a copy, not a view (narrow copies; views here are values, so an in-place op on
// a piece never writes through to the input). The gradient of k pieces is k slice
// scatters into the input's shape, summed: fine for the usual few pieces (q/k/v, gates).

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

#include <lazytensor/ops/reshape.hpp>
#include <lazytensor/ops/shape_helpers.hpp>
#include <lazytensor/ops/slice.hpp>
#include <lazytensor/tensor/tensor.hpp>

namespace lazy {

namespace detail {

/// ShapeError unless `s` has at least one dim (split, chunk, unbind need one to split).
inline void require_split_rank(const Shape& s, const char* op) {
  if (s.rank() == 0) {
    throw ShapeError(std::string(op) + ": expected at least a 1-dimensional tensor, got a 0-dim tensor (shape " +
                     s.str() + ")");
  }
}

/// The pieces of `t` along dim `d` with the given sizes (which sum to t's size there).
template <Element T>
std::vector<Tensor<T>> split_pieces(const Tensor<T>& t, int d, const std::vector<std::int64_t>& sizes) {
  std::vector<Tensor<T>> out;
  out.reserve(sizes.size());
  std::int64_t off = 0;
  for (auto len : sizes) {
    out.push_back(narrow(t, d, off, len));
    off += len;
  }
  return out;
}

/// torch's split: pieces of `size` along `d`, the last one smaller when `size` does not
/// divide the dim; one (empty) piece for an empty dim.
template <Element T>
std::vector<Tensor<T>> split_equal(const Tensor<T>& t, int d, std::int64_t size, const char* op) {
  const std::int64_t n = t.shape()[d];
  if (size < 0) {
    throw ShapeError(std::string(op) + ": expected split_size to be non-negative, got split_size=" +
                     std::to_string(size));
  }
  if (size == 0 && n != 0) {
    throw ShapeError(std::string(op) + ": split_size can only be 0 if the dimension size is 0, but got size " +
                     std::to_string(n) + " in dimension " + std::to_string(d) + " (shape " + t.shape().str() + ")");
  }
  std::vector<std::int64_t> sizes;
  if (size == 0 || n == 0) {
    sizes.push_back(0);
  } else {
    const std::int64_t count = n / size + (n % size != 0);  // (n + size - 1 could overflow)
    sizes.assign(static_cast<std::size_t>(count), size);
    sizes.back() = n - size * (count - 1);
  }
  return split_pieces(t, d, sizes);
}

}  // namespace detail

/// Splits x along `dim` into pieces of `split_size` elements (torch.split with an integer):
/// the last piece is smaller when split_size does not divide the dim; an empty dim gives one
/// empty piece. ShapeError for a 0-dim x, a negative split_size, or split_size 0 on a
/// non-empty dim. Each piece is a copy (narrow) with narrow's backward.
template <expr::ExprLike X>
std::vector<Tensor<expr::value_t<X>>> split(const X& x, std::int64_t split_size, std::int64_t dim = 0) {
  auto t = detail::as_tensor(x);
  detail::require_split_rank(t.shape(), "split");
  return detail::split_equal(t, normalize_dim(dim, t.dim(), "split"), split_size, "split");
}

/// Splits x along `dim` into pieces of the given sizes (torch.split with a list, i.e.
/// split_with_sizes). The sizes must be non-negative and sum to x's size in `dim`
/// (ShapeError otherwise).
template <expr::ExprLike X>
std::vector<Tensor<expr::value_t<X>>> split(const X& x, const std::vector<std::int64_t>& split_sizes,
                                            std::int64_t dim = 0) {
  auto t = detail::as_tensor(x);
  detail::require_split_rank(t.shape(), "split");
  const int d = normalize_dim(dim, t.dim(), "split");
  std::int64_t total = 0;
  bool overflow = false;  // (past int64: cannot match the size)
  for (auto v : split_sizes) {
    if (v < 0) {
      throw ShapeError("split: expected split_sizes to have only non-negative entries, but got split_sizes=" +
                       detail::list_str(split_sizes));
    }
    overflow = overflow || __builtin_add_overflow(total, v, &total);
  }
  if (overflow || total != t.shape()[d]) {
    throw ShapeError("split: expected split_sizes to sum exactly to " + std::to_string(t.shape()[d]) +
                     " (the input's size at dimension " + std::to_string(d) + ", shape " + t.shape().str() +
                     "), but got split_sizes=" + detail::list_str(split_sizes));
  }
  return detail::split_pieces(t, d, split_sizes);
}
/// split with the sizes as a braced list: split(x, {2, 3}, 1). (A one-element list is a
/// list of sizes, not a split_size.)
template <expr::ExprLike X>
std::vector<Tensor<expr::value_t<X>>> split(const X& x, std::initializer_list<std::int64_t> split_sizes,
                                            std::int64_t dim = 0) {
  return split(x, std::vector<std::int64_t>(split_sizes), dim);
}

/// Splits x along `dim` into at most `chunks` pieces (torch.chunk): each of
/// ceil(size / chunks) elements, the last one smaller, so fewer pieces come back when
/// that size covers the dim sooner (chunk(arange(6), 4) gives 3 pieces of 2). An empty dim
/// gives `chunks` empty pieces. ShapeError for chunks <= 0 or a 0-dim x.
template <expr::ExprLike X>
std::vector<Tensor<expr::value_t<X>>> chunk(const X& x, std::int64_t chunks, std::int64_t dim = 0) {
  auto t = detail::as_tensor(x);
  detail::require_split_rank(t.shape(), "chunk");
  if (chunks <= 0) {
    throw ShapeError("chunk: expected `chunks` to be greater than 0, got " + std::to_string(chunks));
  }
  const int d = normalize_dim(dim, t.dim(), "chunk");
  const std::int64_t n = t.shape()[d];
  if (n == 0) return detail::split_pieces(t, d, std::vector<std::int64_t>(static_cast<std::size_t>(chunks), 0));
  return detail::split_equal(t, d, n / chunks + (n % chunks != 0), "chunk");
}

/// The slices of x along `dim`, each without that dim (torch.unbind): size(dim) tensors of
/// x's shape minus `dim`. ShapeError for a 0-dim x.
template <expr::ExprLike X>
std::vector<Tensor<expr::value_t<X>>> unbind(const X& x, std::int64_t dim = 0) {
  auto t = detail::as_tensor(x);
  if (t.dim() == 0) {
    throw ShapeError("unbind: dimension specified as " + std::to_string(dim) +
                     " but the tensor has no dimensions (expected rank >= 1)");
  }
  const int d = normalize_dim(dim, t.dim(), "unbind");
  Shape piece;
  for (int i = 0; i < t.dim(); ++i)
    if (i != d) piece.push_back(t.shape()[i]);
  std::vector<Tensor<expr::value_t<X>>> out;
  out.reserve(static_cast<std::size_t>(t.shape()[d]));
  for (std::int64_t i = 0; i < t.shape()[d]; ++i) out.push_back(reshape(narrow(t, d, i, 1), piece));
  return out;
}

}  // namespace lazy
