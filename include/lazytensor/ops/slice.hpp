#pragma once
// Slicing (slice, narrow) and joining (cat, stack): copy nodes of graph/shape_nodes.hpp, each
// recording its backward (a slice's gradient lands in zeros of the input's shape, a join's is
// narrowed back into the pieces).

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <lazytensor/autograd/record.hpp>
#include <lazytensor/graph/shape_nodes.hpp>
#include <lazytensor/graph/submit.hpp>
#include <lazytensor/ops/reshape.hpp>
#include <lazytensor/ops/shape_helpers.hpp>
#include <lazytensor/tensor/tensor.hpp>

namespace lazy {

// ---- slicing ------------------------------------------------------------------------------

/// Elements start, start + step, ... below end along `dim` (torch slicing x[start:end:step]):
/// negative start/end count from the back, both are clamped to [0, size]; step must be > 0.
/// A copy (buffers never start at an offset), except a full-range slice which is x itself.
template <expr::ExprLike X>
auto slice(const X& x, std::int64_t dim, std::int64_t start = 0,
           std::int64_t end = std::numeric_limits<std::int64_t>::max(), std::int64_t step = 1) {
  auto t = detail::as_tensor(x);
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
  // (Not end - start + step - 1: a step near INT64_MAX would overflow.)
  const std::int64_t len = end == start ? 0 : (end - start - 1) / step + 1;
  if (start == 0 && len == size && (step == 1 || size <= 1)) return detail::fresh_handle(t);
  Shape out = s;
  out[d] = len;
  Tensor<T> r(graph::submit(std::make_shared<graph::SliceNode>("slice", t.node(), d, start, step, out)));
  detail::record_slice(r, t, d, start, step);
  return r;
}

/// `length` elements from `start` along `dim` (torch.narrow). start may be negative
/// (counting from the back); ShapeError if the range does not fit.
template <expr::ExprLike X>
auto narrow(const X& x, std::int64_t dim, std::int64_t start, std::int64_t length) {
  auto t = detail::as_tensor(x);
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
  if (start == 0 && length == size) return detail::fresh_handle(t);
  Shape out = s;
  out[d] = length;
  Tensor<T> r(graph::submit(std::make_shared<graph::SliceNode>("narrow", t.node(), d, start, 1, out)));
  detail::record_slice(r, t, d, start, 1);
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
  if (ts.empty()) return detail::fresh_handle(tensors.front());
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
  auto nodes = detail::nodes_of(ts);
  graph::Device& dev = graph::common_device(nodes, "cat");
  if (ts.size() == 1) return detail::fresh_handle(ts.front());
  std::int64_t outer = 1, inner = 1, total = 0;
  for (int k = 0; k < d; ++k) outer *= ref[k];
  for (int k = d + 1; k < r; ++k) inner *= ref[k];
  std::vector<std::int64_t> widths;
  for (const auto& t : ts) {
    widths.push_back(t.shape()[d] * inner);
    if (__builtin_add_overflow(total, t.shape()[d], &total)) total = kMaxElements + 1;  // too_large below
  }
  Shape out = ref;
  out[d] = total;
  out.check_size();
  Tensor<T> result(graph::submit(
      std::make_shared<graph::CatNode>("cat", dtype_of<T>(), std::move(nodes), out, &dev, outer, std::move(widths))));
  std::vector<std::int64_t> sizes;
  for (const auto& t : ts) sizes.push_back(t.shape()[d]);
  autograd::record(
      result, "CatBackward0", detail::edges_of(ts),
      [sizes, d](const Tensor<T>& g) {
        graph::NodeList gs;
        std::int64_t off = 0;
        for (auto len : sizes) {
          gs.push_back(narrow(g, d, off, len).node());
          off += len;
        }
        return gs;
      },
      autograd::Saves::nothing);
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
  auto nodes = detail::nodes_of(tensors);
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
  autograd::record(
      r, "StackBackward0", detail::edges_of(tensors),
      [n = tensors.size(), d, ref](const Tensor<T>& g) {
        graph::NodeList gs;
        for (std::size_t i = 0; i < n; ++i) {
          gs.push_back(reshape(narrow(g, d, static_cast<std::int64_t>(i), 1), ref).node());
        }
        return gs;
      },
      autograd::Saves::nothing);
  return r;
}
/// stack with a braced list: stack({a, b}, 0).
template <Element T>
Tensor<T> stack(std::initializer_list<Tensor<T>> tensors, std::int64_t dim = 0) {
  return stack(std::vector<Tensor<T>>(tensors), dim);
}

}  // namespace lazy
