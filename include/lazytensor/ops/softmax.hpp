#pragma once
// softmax and log_softmax as fused row kernels: one pass for the max, one for the sum of
// exponentials, one to write; the row stays in cache between passes.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>

#include <xsimd/xsimd.hpp>

#include <lazytensor/autograd/record.hpp>
#include <lazytensor/graph/elementwise_node.hpp>
#include <lazytensor/ops/reduction.hpp>
#include <lazytensor/tensor/tensor.hpp>

namespace lazy {

namespace graph {

/// softmax (or log_softmax) of a [outer, R, inner] view over R.
template <class T, bool Log>
class SoftmaxNode final : public Node {
 public:
  SoftmaxNode(NodePtr in, int dim, std::int64_t outer, std::int64_t extent, std::int64_t inner)
      : Node(NodeKind::Reduction, dtype_of<T>(), in->shape(), in->device(), {in}), dim_(dim), outer_(outer),
        extent_(extent), inner_(inner) {}

  std::string op_name() const override { return Log ? "log_softmax" : "softmax"; }
  std::string describe() const override { return op_name() + "(%0, dim=" + std::to_string(dim_) + ")"; }
  double cost_per_element() const override { return 12; }

 protected:
  void compute(ExecContext& ctx) override {
    const T* x = inputs()[0]->template data<T>();
    auto buf = allocate_output(ctx, inner_ == 1);  // a row kernel may write where it read
    T* y = static_cast<T*>(buf->data());
    auto& pool = ctx.device.threads();
    const std::int64_t units = outer_ * inner_;
    const std::int64_t tasks = std::min(std::max<std::int64_t>(units, 1), task_count(pool, numel(), 12.0));
    pool.parallel_for(tasks, [&](std::int64_t t) {
      auto [u0, u1] = task_range(units, tasks, t);
      if (inner_ == 1) {
        for (std::int64_t o = u0; o < u1; ++o) row(x + o * extent_, y + o * extent_);
      } else {
        for (std::int64_t u = u0; u < u1; ++u) {
          const std::int64_t o = u / inner_, c = u % inner_;
          strided(x + o * extent_ * inner_ + c, y + o * extent_ * inner_ + c);
        }
      }
    });
    set_buffer(std::move(buf));
  }

 private:
  void row(const T* x, T* y) const {
    using V = xsimd::batch<T>;
    constexpr std::int64_t W = V::size;
    const std::int64_t n = extent_;
    std::int64_t i = 0;
    V vm(-std::numeric_limits<T>::infinity());
    for (; i + W <= n; i += W) vm = xsimd::max(vm, V::load_unaligned(x + i));
    alignas(64) T lanes[W];
    vm.store_aligned(lanes);
    T m = lanes[0];
    for (std::int64_t k = 1; k < W; ++k) m = std::max(m, lanes[k]);
    for (; i < n; ++i) m = std::max(m, x[i]);
    if (std::isinf(m)) m = m > 0 ? m : T(0);  // all -inf: avoid inf - inf
    V vs(T(0));
    const V vmax(m);
    for (i = 0; i + W <= n; i += W) {
      V e = xsimd::exp(V::load_unaligned(x + i) - vmax);
      if constexpr (!Log) e.store_unaligned(y + i);
      vs += e;
    }
    T s = xsimd::hadd(vs);
    for (; i < n; ++i) {
      const T e = std::exp(x[i] - m);
      if constexpr (!Log) y[i] = e;
      s += e;
    }
    if constexpr (Log) {
      // (x - max) - log(sum): folding max + log(sum) into one shift first would round it to
      // the precision of max (ulp(1e4) ~ 1e-3 in float).
      const T ls = std::log(s);
      const V vls(ls);
      for (i = 0; i + W <= n; i += W) ((V::load_unaligned(x + i) - vmax) - vls).store_unaligned(y + i);
      for (; i < n; ++i) y[i] = (x[i] - m) - ls;
    } else {
      const V inv(T(1) / s);
      for (i = 0; i + W <= n; i += W) (V::load_unaligned(y + i) * inv).store_unaligned(y + i);
      for (; i < n; ++i) y[i] *= T(1) / s;
    }
  }

  void strided(const T* x, T* y) const {
    T m = -std::numeric_limits<T>::infinity();
    for (std::int64_t r = 0; r < extent_; ++r) m = std::max(m, x[r * inner_]);
    if (std::isinf(m)) m = m > 0 ? m : T(0);
    T s = 0;
    for (std::int64_t r = 0; r < extent_; ++r) s += std::exp(x[r * inner_] - m);
    const T ls = std::log(s), inv = T(1) / s;  // see row(): never round max + log(sum)
    for (std::int64_t r = 0; r < extent_; ++r) {
      y[r * inner_] = Log ? (x[r * inner_] - m) - ls : std::exp(x[r * inner_] - m) * inv;
    }
  }

  int dim_;
  std::int64_t outer_, extent_, inner_;
};

}  // namespace graph

namespace detail {
template <bool Log, class X>
auto softmax_impl(const X& x, std::int64_t dim, const char* op) {
  using V = expr::value_t<X>;
  using T = std::conditional_t<std::is_same_v<V, double>, double, float>;
  Tensor<T> t = [&] {
    if constexpr (std::is_same_v<X, Tensor<T>>) return x;
    else return Tensor<T>(cast<T>(x));
  }();
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
                     return std::vector<graph::NodePtr>{dx.node()};
                   });
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
