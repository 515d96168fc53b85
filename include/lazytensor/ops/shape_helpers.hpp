#pragma once
// The helpers the shape ops share (ops/reshape.hpp, slice.hpp, indexing.hpp, and conv and
// pool for as_tensor): an operand as a tensor, size lists, views and permuted copies with
// their backward, expand's broadcast, and the autograd records of slices and tensor lists.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <lazytensor/autograd/record.hpp>
#include <lazytensor/graph/shape_backward.hpp>
#include <lazytensor/graph/shape_nodes.hpp>
#include <lazytensor/graph/submit.hpp>
#include <lazytensor/graph/transpose_hint.hpp>
#include <lazytensor/tensor/tensor.hpp>
#include <lazytensor/core/config.hpp>

namespace lazy::detail {

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

/// A new tensor object holding t's value, with a pass-through backward to t's history
/// (AliasBackward0; a node of its own, so that retain_grad and autograd::grad on the result
/// see its gradient only). What a shape op that changes nothing returns: views here are
/// values, so an in-place op on the result must leave `t` alone, as it does when the op
/// changes the shape (and as cat's result is always new in torch).
template <Element T>
Tensor<T> fresh_handle(const Tensor<T>& t) {
  Tensor<T> r(t.node());
  autograd::record(
      r, "AliasBackward0", {autograd::edge_of(t.impl())},
      [](const Tensor<T>& g) { return graph::NodeList{g.node()}; },
      autograd::Saves::nothing);
  return r;
}

/// A view of t with `shape` (same numel); a new handle of t's node (fresh_handle) when the
/// shape does not change.
/// A view of a pending view is made a view of that view's source, so chains stay short.
template <Element T>
Tensor<T> view_of(const Tensor<T>& t, const Shape& shape, const char* op) {
  graph::NodePtr src = t.node();
  if (src->shape() == shape) return fresh_handle(t);
  if (src->pending() && dynamic_cast<graph::ViewNode*>(src.get())) src = src->inputs()[0];
  Tensor<T> r(graph::submit(std::make_shared<graph::ViewNode>(op, std::move(src), shape)));
  autograd::record(
      r, "ViewBackward0", {autograd::edge_of(t.impl())},
      [in = t.shape()](const Tensor<T>& g) {
        return graph::NodeList{view_of(g, in, "view").node()};
      },
      autograd::Saves::nothing);
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
  if (identity) return fresh_handle(t);
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
  autograd::record(
      r, "PermuteBackward0", {autograd::edge_of(t.impl())},
      [inverse](const Tensor<T>& g) {
        return graph::NodeList{permute_impl(g, inverse, "permute").node()};
      },
      autograd::Saves::nothing);
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
  if (out == s) return fresh_handle(t);
  // The element-wise node broadcasts its leaves to `out`: a splat per expanded dim (and
  // its gradient sums back over them).
  return evaluate_as<T>(expr::make<ops::Identity>(t), out);
}

/// Records the backward of a slice of `t` (the gradient lands in zeros of t's shape).
template <Element T>
void record_slice(Tensor<T>& r, const Tensor<T>& t, int d, std::int64_t start, std::int64_t step) {
  if constexpr (is_floating_v<T>) {
    autograd::record(
        r, "SliceBackward0", {autograd::edge_of(t.impl())},
        [in = t.shape(), d, start, step](const Tensor<T>& g) {
          return graph::NodeList{graph::submit(
              std::make_shared<graph::SliceBackwardNode<T>>(g.node(), in, d, start, step))};
        },
        autograd::Saves::nothing);
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
graph::NodeList nodes_of(const std::vector<Tensor<T>>& ts) {
  graph::NodeList v;
  v.reserve(ts.size());
  for (const auto& t : ts) v.push_back(t.node());
  return v;
}

}  // namespace lazy::detail

#if LAZYTENSOR_HEADER_DEFINITIONS
namespace lazy::detail {

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
    } else if (__builtin_mul_overflow(known, sizes[i], &known)) {
      // Past int64, so past the shape bound too (a later zero does not bring it back).
      throw ShapeError(std::string(op) + ": the sizes " + list_str(sizes) +
                       " describe more elements than a shape may hold (2^60)");
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

}  // namespace lazy::detail
#endif  // LAZYTENSOR_HEADER_DEFINITIONS

// Per-dtype templates the compiled runtime instantiates once (core/config.hpp).
#define LAZYTENSOR_SHAPE_HELPERS_INSTANCES(P, T)                                                         \
  P template lazy::Tensor<T> lazy::detail::view_of<T>(const lazy::Tensor<T>&, const lazy::Shape&, const char*); \
  P template lazy::Tensor<T> lazy::detail::permute_impl<T>(const lazy::Tensor<T>&, std::vector<int>, const char*);
#if LAZYTENSOR_EXPLICIT_INSTANTIATION
LAZYTENSOR_FOR_ELEMENT(LAZYTENSOR_SHAPE_HELPERS_INSTANCES, extern)
#endif
