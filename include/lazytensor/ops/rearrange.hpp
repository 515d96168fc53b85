#pragma once
// Ops that move or mask elements without computing new values: flip, roll, repeat, tril,
// triu, masked_fill. Composites of the differentiable primitives (index_select, narrow +
// cat, reshape + expand, where over an arange mask), so their gradients come from those
// primitives' backward and no node of their own exists. Dim and size lists are `Dims`
// (ops/reduction.hpp): a braced list, a vector or one number, as libtorch's IntArrayRef.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include <lazytensor/ops/factories.hpp>
#include <lazytensor/ops/indexing.hpp>
#include <lazytensor/ops/reduction.hpp>
#include <lazytensor/ops/reshape.hpp>
#include <lazytensor/ops/shape_helpers.hpp>
#include <lazytensor/ops/slice.hpp>
#include <lazytensor/tensor/tensor.hpp>

namespace lazy {

namespace detail {

/// roll along one dim: out[i] = t[(i - shift) mod n], as cat(narrow(start..), narrow(..start)).
template <Element T>
Tensor<T> roll_dim(const Tensor<T>& t, std::int64_t shift, int d, bool& changed) {
  const std::int64_t n = t.shape()[d];
  if (n == 0 || t.numel() == 0) return t;
  const std::int64_t start = (n - shift % n) % n;  // shift % n is in (-n, n): no overflow
  if (start == 0) return t;
  changed = true;
  return cat({narrow(t, d, start, n - start), narrow(t, d, 0, start)}, d);
}

/// repeat in one expand: x viewed with a size-1 dim before each repeated dim, expanded
/// there, viewed back. Runs of dims that are not repeated merge into one dim. Empty when
/// that view would pass kMaxRank (the caller then repeats one dim at a time).
template <Element T>
Tensor<T> repeat_by_expand(const Tensor<T>& t, const Shape& padded, const std::vector<std::int64_t>& reps,
                           const Shape& out) {
  std::vector<std::int64_t> src, big;
  std::int64_t run = 1;
  bool in_run = false;
  for (std::size_t i = 0; i < reps.size(); ++i) {
    if (reps[i] == 1) {
      run *= padded[static_cast<int>(i)];
      in_run = true;
      continue;
    }
    if (in_run) {
      src.push_back(run);
      big.push_back(run);
      run = 1;
      in_run = false;
    }
    src.push_back(1);
    big.push_back(reps[i]);
    if (padded[static_cast<int>(i)] != 1) {
      src.push_back(padded[static_cast<int>(i)]);
      big.push_back(padded[static_cast<int>(i)]);
    }
  }
  if (in_run) {
    src.push_back(run);
    big.push_back(run);
  }
  if (src.size() > static_cast<std::size_t>(kMaxRank)) return Tensor<T>();
  return reshape(expand(reshape(t, src), big), out);
}

}  // namespace detail

/// Reverses the order of elements along each of `dims` (torch.flip); an empty list returns
/// x's values. ShapeError for a dim out of range or repeated. index_select with a reversed
/// arange per flipped dim of size > 1 (its backward is a scatter-add).
template <expr::ExprLike X>
auto flip(const X& x, const Dims& dims) {
  auto t = detail::as_tensor(x);
  using T = typename decltype(t)::value_type;
  const int r = t.dim();
  std::vector<char> seen(static_cast<std::size_t>(std::max(r, 1)), 0);
  std::vector<int> ds;
  for (auto dim : dims) {
    const int d = normalize_dim(dim, r, "flip");
    if (seen[static_cast<std::size_t>(d)]) {
      throw ShapeError("flip: dim " + std::to_string(d) + " appears multiple times in the list of dims " +
                       detail::list_str(dims) + " (expected each dim at most once)");
    }
    seen[static_cast<std::size_t>(d)] = 1;
    ds.push_back(d);
  }
  Tensor<T> out = t;
  bool changed = false;
  for (int d : ds) {
    if (r == 0 || t.shape()[d] <= 1) continue;
    const auto n = static_cast<double>(t.shape()[d]);
    out = index_select(out, d, arange<std::int64_t>(n - 1, -1, -1, t.device()));
    changed = true;
  }
  return changed ? out : detail::fresh_handle(t);
}

/// Rolls x's elements along `dims` by `shifts` (torch.roll): out[i] = x[(i - shift) mod n]
/// per dim, applied dim after dim (a dim may repeat). Without dims, x is rolled as if
/// flattened, by the single shift, and keeps its shape. ShapeError for no shifts, for
/// shifts and dims of different lengths (or several shifts without dims), and for dims out
/// of range (a 0-dim x has none). A cat of two narrows per rolled dim.
template <expr::ExprLike X>
auto roll(const X& x, const Dims& shifts, const Dims& dims = {}) {
  auto t = detail::as_tensor(x);
  using T = typename decltype(t)::value_type;
  if (shifts.empty()) throw ShapeError("roll: `shifts` required, got an empty list (expected one shift per dim)");
  bool changed = false;
  if (dims.empty()) {
    if (shifts.size() != 1) {
      throw ShapeError("roll: without dims exactly one shift is expected (the flattened tensor is rolled), got " +
                       std::to_string(shifts.size()) + " shifts " + detail::list_str(shifts));
    }
    Tensor<T> flat = reshape(t, Shape{t.numel()});
    Tensor<T> r = detail::roll_dim(flat, shifts[0], 0, changed);
    return changed ? reshape(r, t.shape()) : detail::fresh_handle(t);
  }
  if (shifts.size() != dims.size()) {
    throw ShapeError("roll: shifts and dimensions must align: got " + std::to_string(shifts.size()) + " shifts " +
                     detail::list_str(shifts) + " and " + std::to_string(dims.size()) + " dims " +
                     detail::list_str(dims));
  }
  if (t.dim() == 0) {
    throw ShapeError("roll: dimension specified as " + std::to_string(dims[0]) +
                     " but the tensor has no dimensions (a 0-dim tensor rolls only without dims)");
  }
  Tensor<T> out = t;
  for (std::size_t i = 0; i < dims.size(); ++i)
    out = detail::roll_dim(out, shifts[i], normalize_dim(dims[i], t.dim(), "roll"), changed);
  return changed ? out : detail::fresh_handle(t);
}

/// Tiles x (torch.Tensor.repeat): with k = repeats.size() >= x.dim(), x is viewed with
/// k - dim leading size-1 dims and copied repeats[i] times along dim i, so out.size(i) =
/// repeats[i] * size(i). ShapeError for fewer repeats than dims, a negative repeat, or more
/// than kMaxRank repeats. One expand between two views (one per repeated dim at high rank).
template <expr::ExprLike X>
auto repeat(const X& x, const Dims& repeats) {
  auto t = detail::as_tensor(x);
  using T = typename decltype(t)::value_type;
  const Shape& s = t.shape();
  const int k = static_cast<int>(repeats.size()), r = s.rank();
  if (k < r) {
    throw ShapeError("repeat: the number of repeats (" + std::to_string(k) +
                     ") can not be smaller than the number of dimensions of the tensor (" + std::to_string(r) +
                     "); repeats " + detail::list_str(repeats) + ", tensor shape " + s.str());
  }
  if (k > kMaxRank) {
    throw ShapeError("repeat: " + std::to_string(k) + " repeats " + detail::list_str(repeats) +
                     " would make a tensor of rank " + std::to_string(k) + ", expected at most " +
                     std::to_string(kMaxRank));
  }
  Shape padded, out;
  for (int i = 0; i < k; ++i) {
    const std::int64_t size = i < k - r ? 1 : s[i - (k - r)];
    if (repeats[static_cast<std::size_t>(i)] < 0) {
      throw ShapeError("repeat: repeats must be non-negative, got " + detail::list_str(repeats) +
                       " (tensor shape " + s.str() + ")");
    }
    std::int64_t n = 0;
    if (__builtin_mul_overflow(size, repeats[static_cast<std::size_t>(i)], &n)) n = kMaxElements + 1;
    padded.push_back(size);
    out.push_back(n);
  }
  out.check_size();
  if (out == s) return detail::fresh_handle(t);
  Tensor<T> once = detail::repeat_by_expand(t, padded, repeats, out);
  if (once.defined()) return once;
  // Past kMaxRank in one view: one dim at a time, each as [before, 1, size, after].
  Tensor<T> cur = reshape(t, padded);
  Shape cs = padded;
  for (int i = 0; i < k; ++i) {
    const std::int64_t rep = repeats[static_cast<std::size_t>(i)];
    if (rep == 1) continue;
    std::int64_t before = 1, after = 1;
    for (int j = 0; j < i; ++j) before *= cs[j];
    for (int j = i + 1; j < k; ++j) after *= cs[j];
    cur = reshape(expand(reshape(cur, {before, 1, cs[i], after}), {before, rep, cs[i], after}),
                  {before, rep * cs[i], after});
    cs[i] *= rep;
  }
  return reshape(cur, out);
}

namespace detail {

/// tril (Lower) / triu: x where the column minus the row of its last two dims is <= (>=)
/// `diagonal`, zero elsewhere; a where over an arange mask, broadcast over the batch dims.
template <bool Lower, expr::ExprLike X>
auto triangle(const X& x, std::int64_t diagonal, const char* op) {
  auto t = as_tensor(x);
  using T = typename decltype(t)::value_type;
  const Shape& s = t.shape();
  if (s.rank() < 2) {
    throw ShapeError(std::string(op) + ": expected a tensor with at least 2 dimensions, got shape " + s.str() +
                     " (" + std::to_string(s.rank()) + "-D)");
  }
  const std::int64_t m = s[s.rank() - 2], n = s[s.rank() - 1];
  // Every element kept: t's values (the extreme diagonals cannot overflow the tests below).
  if (Lower ? diagonal >= n - 1 : diagonal <= 1 - m) return fresh_handle(t);
  auto rows = reshape(arange<std::int64_t>(0, static_cast<double>(m), 1, t.device()), Shape{m, 1});
  auto cols = reshape(arange<std::int64_t>(0, static_cast<double>(n), 1, t.device()), Shape{1, n});
  const T zero = checked_scalar<T>(0, op);  // (a T, so that the result stays T, bool too)
  if constexpr (Lower) return Tensor<T>(where(cols - rows <= diagonal, t, zero));
  else return Tensor<T>(where(cols - rows >= diagonal, t, zero));
}

}  // namespace detail

/// The lower triangle of the last two dims (torch.tril): elements with column - row <=
/// `diagonal` kept, the others zero; batched over leading dims. ShapeError below 2 dims.
template <expr::ExprLike X>
auto tril(const X& x, std::int64_t diagonal = 0) {
  return detail::triangle<true>(x, diagonal, "tril");
}

/// The upper triangle of the last two dims (torch.triu): elements with column - row >=
/// `diagonal` kept, the others zero; batched over leading dims. ShapeError below 2 dims.
template <expr::ExprLike X>
auto triu(const X& x, std::int64_t diagonal = 0) {
  return detail::triangle<false>(x, diagonal, "triu");
}

/// x with `value` where `mask` is true (torch.masked_fill, out of place): mask and x
/// broadcast against each other, and the result has their broadcast shape, as torch's
/// (ShapeError naming both shapes when they do not broadcast). DTypeError when value does
/// not fit x's dtype. The gradient reaches x where mask is false.
template <expr::ExprLike X, expr::Number V>
auto masked_fill(const X& x, const Tensor<bool>& mask, V value) {
  auto t = detail::as_tensor(x);
  using T = typename decltype(t)::value_type;
  broadcast_shapes(t.shape(), mask.shape(), "masked_fill");
  return Tensor<T>(where(mask, detail::checked_scalar<T>(value, "masked_fill"), t));
}

/// masked_fill with a 0-dim tensor as the value (ShapeError for any other rank); the
/// gradient reaches `value` too (the sum over the filled elements).
template <expr::ExprLike X>
auto masked_fill(const X& x, const Tensor<bool>& mask, const Tensor<expr::value_t<X>>& value) {
  auto t = detail::as_tensor(x);
  using T = typename decltype(t)::value_type;
  if (value.dim() != 0) {
    throw ShapeError("masked_fill: expected a 0-dimensional value tensor, got shape " + value.shape().str() + " (" +
                     std::to_string(value.dim()) + " dimension(s))");
  }
  broadcast_shapes(t.shape(), mask.shape(), "masked_fill");
  return Tensor<T>(where(mask, value, t));
}

}  // namespace lazy
