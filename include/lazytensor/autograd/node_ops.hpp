#pragma once
// The few operations autograd performs on gradients whose dtype is known only at run time
// (a GradFn receives and returns graph nodes): sum a broadcast gradient back to an input's
// shape, convert dtype, add two gradients, make a constant. All build pending nodes.

#include <algorithm>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include <lazytensor/graph/elementwise_node.hpp>
#include <lazytensor/graph/reduction_node.hpp>
#include <lazytensor/graph/submit.hpp>

namespace lazy::autograd {

/// Calls f(std::type_identity<T>{}) for the floating dtype `d`; DTypeError otherwise.
template <class F>
decltype(auto) visit_floating(DType d, const char* what, F&& f) {
  switch (d) {
    case DType::Float32: return f(std::type_identity<float>{});
    case DType::Float64: return f(std::type_identity<double>{});
    case DType::BFloat16: return f(std::type_identity<bfloat16>{});
    default: break;
  }
  throw DTypeError(std::string(what) + ": only floating point tensors have gradients, found " + dtype_name(d));
}

namespace detail {
template <Element T, class Op, class... Ks>
graph::NodePtr elementwise(const Shape& shape, graph::Device* dev, std::vector<graph::NodePtr> inputs, Ks... ks) {
  using K = expr::KExpr<Op, Ks...>;
  return graph::submit(graph::elementwise_node<T>(K{{ks...}}, shape, dev, std::move(inputs)));
}
}  // namespace detail

/// `g` converted to dtype `to` (floating types).
inline graph::NodePtr cast_node(const graph::NodePtr& g, DType to) {
  if (g->dtype() == to) return g;
  return visit_floating(to, "cast", [&](auto to_t) {
    using U = typename decltype(to_t)::type;
    return visit_floating(g->dtype(), "cast", [&](auto from_t) {
      using T = typename decltype(from_t)::type;
      return detail::elementwise<U, ops::Cast<U>>(g->shape(), g->device(), {g}, expr::KLeaf<T>{0});
    });
  });
}

/// a + b for two gradients of one dtype and shape.
inline graph::NodePtr add_nodes(const graph::NodePtr& a, const graph::NodePtr& b) {
  return visit_floating(a->dtype(), "add", [&](auto t) {
    using T = typename decltype(t)::type;
    return detail::elementwise<T, ops::Add>(a->shape(), a->device(), {a, cast_node(b, a->dtype())},
                                            expr::KLeaf<T>{0}, expr::KLeaf<T>{1});
  });
}

/// A pending tensor of `shape` filled with `value`.
inline graph::NodePtr full_node(const Shape& shape, DType dtype, graph::Device* dev, double value) {
  return visit_floating(dtype, "full", [&](auto t) {
    using T = typename decltype(t)::type;
    return detail::elementwise<T, ops::Identity>(shape, dev, {}, expr::Scalar<T>{static_cast<T>(value)});
  });
}

/// Sums gradient `g` (shape `from`) over the dimensions that were broadcast from `to`
/// (NumPy rules), giving a tensor of shape `to`. Each run of adjacent broadcast dims is
/// one deterministic reduction pass; the common cases (bias rows, per-channel columns)
/// take a single pass.
inline graph::NodePtr sum_to_shape(const graph::NodePtr& g, const Shape& to) {
  const Shape& from = g->shape();
  if (from == to) return g;
  if (!broadcastable_to(to, from)) {
    throw ShapeError("autograd: gradient of shape " + from.str() + " cannot be summed to shape " + to.str());
  }
  const int r = from.rank(), off = r - to.rank();
  std::vector<char> reduced(static_cast<std::size_t>(r));
  for (int d = 0; d < r; ++d) reduced[d] = d < off || (to[d - off] == 1 && from[d] != 1);
  return visit_floating(g->dtype(), "sum_to_shape", [&](auto t) {
    using T = typename decltype(t)::type;
    using S = compute_t<T>;
    graph::NodePtr cur = g;
    Shape cur_shape = from;  // keepdim shape of `cur`, rank r
    // Innermost run first: later passes read less data.
    for (int hi = r - 1; hi >= 0;) {
      if (!reduced[hi]) {
        --hi;
        continue;
      }
      int lo = hi;
      while (lo > 0 && reduced[lo - 1]) --lo;
      graph::ReduceGeometry geo;
      for (int d = 0; d < r; ++d) {
        (d < lo ? geo.outer : d > hi ? geo.inner : geo.extent) *= cur_shape[d];
      }
      Shape next = cur_shape;
      for (int d = lo; d <= hi; ++d) next[d] = 1;
      bool more = false;
      for (int d = 0; d < lo; ++d) more = more || reduced[d];
      const Shape out = more ? next : to;  // the last pass writes the target shape directly
      using K = expr::KLeaf<T>;
      cur = graph::submit(std::make_shared<graph::ReductionNode<K, ops::reduce::Sum, S, T>>(
          K{0}, out, geo, 1.0, cur->device(), std::vector<graph::NodePtr>{cur}, cur_shape));
      cur_shape = next;
      hi = lo - 1;
    }
    return cur;
  });
}

}  // namespace lazy::autograd
