#pragma once
// The few operations autograd performs on gradients (a GradFn receives and returns graph
// nodes): sum a broadcast gradient back to an input's shape, convert dtype, add two
// gradients, make a constant. All build pending nodes. Each exists typed (instantiated for
// the dtypes a program uses) and, where the dtype is a run-time value, behind a table that
// the typed code fills.

#include <algorithm>
#include <atomic>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include <lazytensor/core/config.hpp>
#include <lazytensor/graph/elementwise_node.hpp>
#include <lazytensor/graph/reduction_node.hpp>
#include <lazytensor/graph/submit.hpp>

namespace lazy::autograd {

namespace detail {
template <Element T, class Op, class... Ks>
graph::NodePtr elementwise(const Shape& shape, graph::Device* dev, graph::NodeList inputs, Ks... ks) {
  using K = expr::KExpr<Op, Ks...>;
  return graph::submit(graph::elementwise_node<T>(K{{ks...}}, shape, dev, std::move(inputs)));
}
}  // namespace detail

// ---- typed operations: instantiated only for the dtypes a program differentiates ---------

/// `g` (dtype From) converted to To.
template <Element To, Element From>
graph::NodePtr cast_node_to(const graph::NodePtr& g) {
  if constexpr (std::is_same_v<To, From>) return g;
  else return detail::elementwise<To, ops::Cast<To>>(g->shape(), g->device(), {g}, expr::KLeaf<From>{0});
}

/// a + b for two gradients of dtype T and one shape.
template <Element T>
graph::NodePtr add_nodes_of(const graph::NodePtr& a, const graph::NodePtr& b) {
  return detail::elementwise<T, ops::Add>(a->shape(), a->device(), {a, b}, expr::KLeaf<T>{0}, expr::KLeaf<T>{1});
}

/// A pending tensor of dtype T and `shape` filled with `value`.
template <Element T>
graph::NodePtr full_node_of(const Shape& shape, graph::Device* dev, double value) {
  return detail::elementwise<T, ops::Identity>(shape, dev, {}, expr::Scalar<T>{static_cast<T>(value)});
}

/// Sums gradient `g` of dtype T (shape `from`) over the dimensions that were broadcast from
/// `to` (NumPy rules), giving a tensor of shape `to`. Each run of adjacent broadcast dims is
/// one deterministic reduction pass; the common cases (bias rows, per-channel columns) take
/// a single pass.
template <Element T>
graph::NodePtr sum_to_shape_of(const graph::NodePtr& g, const Shape& to) {
  const Shape& from = g->shape();
  if (from == to) return g;
  if (!broadcastable_to(to, from)) {
    throw ShapeError("autograd: gradient of shape " + from.str() + " cannot be summed to shape " + to.str());
  }
  const int r = from.rank(), off = r - to.rank();
  std::vector<char> reduced(static_cast<std::size_t>(r));
  for (int d = 0; d < r; ++d) reduced[d] = d < off || (to[d - off] == 1 && from[d] != 1);
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
    cur = graph::submit(graph::reduction_node<ops::reduce::Sum, S, T>(K{0}, out, geo, 1.0, cur->device(),
                                                                       graph::NodeList{cur}, cur_shape));
    cur_shape = next;
    hi = lo - 1;
  }
  return cur;
}

// ---- run-time dtype: a table filled by the typed code that records backward functions -----
//
// A GradFn hands gradients around as graph nodes whose dtype is a run-time value. Dispatching
// on it with a switch would compile every dtype's kernels into every program; instead, code
// that knows T (a Tensor<T> that starts requiring grad, an op recording its backward, an
// element-wise backward and the dtypes of its leaves) registers T's operations here, so a
// float-only program holds float kernels only. A gradient of dtype T only exists after such
// code ran, so a lookup finds its entry.

namespace detail {
using AddFn = graph::NodePtr (*)(const graph::NodePtr&, const graph::NodePtr&);
using SumToFn = graph::NodePtr (*)(const graph::NodePtr&, const Shape&);
using CastFn = graph::NodePtr (*)(const graph::NodePtr&);
inline constexpr int kDTypes = 6;

struct GradOpsTable {
  std::atomic<AddFn> add[kDTypes] = {};
  std::atomic<SumToFn> sum_to[kDTypes] = {};
  std::atomic<CastFn> cast[kDTypes][kDTypes] = {};  // [from][to]
};
inline GradOpsTable& grad_ops_table() {
  static GradOpsTable table;
  return table;
}

[[noreturn]] void missing_grad_op(const char* what, DType d, DType to);
}  // namespace detail

/// Makes the gradient operations of dtype T available to code that sees T at run time only.
template <Element T>
void register_grad_dtype() {
  if constexpr (is_floating_v<T>) {
    static const bool once = [] {
      auto& t = detail::grad_ops_table();
      const int d = static_cast<int>(dtype_of<T>());
      t.add[d].store(&add_nodes_of<T>, std::memory_order_release);
      t.sum_to[d].store(&sum_to_shape_of<T>, std::memory_order_release);
      return true;
    }();
    (void)once;
  }
}

/// Makes the conversion of gradients from dtype From to To available at run time.
template <Element From, Element To>
void register_grad_cast() {
  if constexpr (is_floating_v<From> && is_floating_v<To> && !std::is_same_v<From, To>) {
    static const bool once = [] {
      detail::grad_ops_table()
          .cast[static_cast<int>(dtype_of<From>())][static_cast<int>(dtype_of<To>())]
          .store(&cast_node_to<To, From>, std::memory_order_release);
      return true;
    }();
    (void)once;
  }
}

/// `g` converted to dtype `to`.
graph::NodePtr cast_node(const graph::NodePtr& g, DType to);

/// a + b for two gradients of one shape (b converted to a's dtype).
graph::NodePtr add_nodes(const graph::NodePtr& a, const graph::NodePtr& b);

/// sum_to_shape_of for a gradient whose dtype is known at run time only.
graph::NodePtr sum_to_shape(const graph::NodePtr& g, const Shape& to);

#if LAZYTENSOR_HEADER_DEFINITIONS
namespace detail {
[[noreturn]] LAZYTENSOR_INLINE void missing_grad_op(const char* what, DType d, DType to) {
  throw DTypeError(std::string("autograd: no ") + what + " for gradients of dtype " + dtype_name(d) +
                   (d == to ? std::string() : " to " + dtype_name(to)) +
                   " was compiled into this program (only floating point tensors have gradients)");
}
}  // namespace detail

LAZYTENSOR_INLINE graph::NodePtr cast_node(const graph::NodePtr& g, DType to) {
  if (g->dtype() == to) return g;
  auto f = detail::grad_ops_table()
               .cast[static_cast<int>(g->dtype())][static_cast<int>(to)]
               .load(std::memory_order_acquire);
  if (!f) detail::missing_grad_op("conversion", g->dtype(), to);
  return f(g);
}

LAZYTENSOR_INLINE graph::NodePtr add_nodes(const graph::NodePtr& a, const graph::NodePtr& b) {
  auto f = detail::grad_ops_table().add[static_cast<int>(a->dtype())].load(std::memory_order_acquire);
  if (!f) detail::missing_grad_op("addition", a->dtype(), a->dtype());
  return f(a, cast_node(b, a->dtype()));
}

LAZYTENSOR_INLINE graph::NodePtr sum_to_shape(const graph::NodePtr& g, const Shape& to) {
  if (g->shape() == to) return g;
  auto f = detail::grad_ops_table().sum_to[static_cast<int>(g->dtype())].load(std::memory_order_acquire);
  if (!f) detail::missing_grad_op("broadcast reduction", g->dtype(), g->dtype());
  return f(g, to);
}
#endif  // LAZYTENSOR_HEADER_DEFINITIONS

}  // namespace lazy::autograd

// Per-dtype templates the compiled runtime instantiates once (core/config.hpp).
#define LAZYTENSOR_NODE_OPS_INSTANCES(P, T)                                                                     \
  P template lazy::graph::NodePtr lazy::autograd::add_nodes_of<T>(const lazy::graph::NodePtr&,                  \
                                                                  const lazy::graph::NodePtr&);                 \
  P template lazy::graph::NodePtr lazy::autograd::full_node_of<T>(const lazy::Shape&, lazy::graph::Device*, double); \
  P template lazy::graph::NodePtr lazy::autograd::sum_to_shape_of<T>(const lazy::graph::NodePtr&, const lazy::Shape&); \
  P template void lazy::autograd::register_grad_dtype<T>();                                                       \
  P template lazy::graph::NodePtr lazy::autograd::cast_node_to<T, float>(const lazy::graph::NodePtr&);            \
  P template lazy::graph::NodePtr lazy::autograd::cast_node_to<T, double>(const lazy::graph::NodePtr&);           \
  P template lazy::graph::NodePtr lazy::autograd::cast_node_to<T, lazy::bfloat16>(const lazy::graph::NodePtr&);   \
  P template void lazy::autograd::register_grad_cast<T, float>();                                                 \
  P template void lazy::autograd::register_grad_cast<T, double>();                                                \
  P template void lazy::autograd::register_grad_cast<T, lazy::bfloat16>();
#if LAZYTENSOR_EXPLICIT_INSTANTIATION
LAZYTENSOR_FOR_FLOATING(LAZYTENSOR_NODE_OPS_INSTANCES, extern)
#endif
