#pragma once
// softmax and log_softmax (stable, along one dim) and their derivative rules; the fused row
// kernels are SoftmaxNode's (graph/softmax_node.hpp).

#include <cstdint>
#include <memory>
#include <type_traits>
#include <vector>

#include <lazytensor/autograd/record.hpp>
#include <lazytensor/core/config.hpp>
#include <lazytensor/graph/softmax_node.hpp>
#include <lazytensor/ops/reduction.hpp>
#include <lazytensor/tensor/tensor.hpp>

namespace lazy {

namespace detail {
/// softmax (log_softmax with `Log`) of a float or double tensor along `dim`, with its rule.
template <bool Log, class T>
Tensor<T> softmax_rows(const Tensor<T>& t, std::int64_t dim, const char* op) {
  const Shape& s = t.shape();
  const int d = normalize_dim(dim, s.rank(), op);
  std::int64_t outer = 1, inner = 1;
  const std::int64_t extent = s.rank() ? s[d] : 1;
  for (int i = 0; i < s.rank(); ++i) {
    if (i < d) outer *= s[i];
    if (i > d) inner *= s[i];
  }
  Tensor<T> r(graph::submit(std::make_shared<graph::SoftmaxNode<T, Log>>(t.node(), d, outer, extent, inner)));
  // softmax: dx = y * (g - sum(g * y)); log_softmax: dx = g - exp(y) * sum(g), along dim.
  autograd::record(r, Log ? "LogSoftmaxBackward0" : "SoftmaxBackward0", {autograd::edge_of(t.impl())},
                   [y = r.detach(), d](const Tensor<T>& g) {
                     Tensor<T> dx = Log ? Tensor<T>(g - exp(y) * sum(g, {d}, true))
                                        : Tensor<T>(y * (g - sum(g * y, {d}, true)));
                     return graph::NodeList{dx.node()};
                   });
  return r;
}

template <bool Log, class X>
auto softmax_impl(const X& x, std::int64_t dim, const char* op) {
  using V = expr::value_t<X>;
  using T = std::conditional_t<std::is_same_v<V, double>, double, float>;
  Tensor<T> r = [&] {
    if constexpr (std::is_same_v<X, Tensor<T>>) return softmax_rows<Log>(x, dim, op);
    else return softmax_rows<Log>(Tensor<T>(cast<T>(x)), dim, op);
  }();
  if constexpr (std::is_same_v<V, bfloat16>) return Tensor<bfloat16>(cast<bfloat16>(r));
  else return r;
}
}  // namespace detail

/// exp(x) / sum(exp(x)) along `dim`, computed stably.
template <expr::ExprLike X>
auto softmax(const X& x, std::int64_t dim) {
  return detail::softmax_impl<false>(x, dim, "softmax");
}

/// log(softmax(x)) along `dim`, computed stably as x - max - log(sum(exp(x - max))).
template <expr::ExprLike X>
auto log_softmax(const X& x, std::int64_t dim) {
  return detail::softmax_impl<true>(x, dim, "log_softmax");
}

}  // namespace lazy

// Instantiated once by lazytensor::compiled (src/compiled.cpp): the row kernels and the
// derivative rule's expressions of both softmax kinds.
#define LAZYTENSOR_SOFTMAX_INSTANCES(P, T)                                                   \
  P template lazy::Tensor<T> lazy::detail::softmax_rows<false, T>(const lazy::Tensor<T>&,   \
                                                                  std::int64_t, const char*); \
  P template lazy::Tensor<T> lazy::detail::softmax_rows<true, T>(const lazy::Tensor<T>&,    \
                                                                 std::int64_t, const char*);
#if LAZYTENSOR_EXPLICIT_INSTANTIATION
LAZYTENSOR_SOFTMAX_INSTANCES(extern, float)
LAZYTENSOR_SOFTMAX_INSTANCES(extern, double)
#endif
