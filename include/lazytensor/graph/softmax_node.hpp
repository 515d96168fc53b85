#pragma once
// SoftmaxNode, the kernel of softmax and log_softmax: fused row kernels (one pass for the
// max, one for the sum of exponentials, one to write; the row stays in cache between
// passes), vectorized when the reduced dim is the last, strided otherwise.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>

#include <lazytensor/core/simd.hpp>

#include <lazytensor/graph/device.hpp>
#include <lazytensor/graph/parallel.hpp>

namespace lazy::graph {

/// softmax (or log_softmax) of a [outer, R, inner] view over R.
template <class T, bool Log>
class SoftmaxNode final : public Node {
 public:
  SoftmaxNode(NodePtr in, int dim, std::int64_t outer, std::int64_t extent, std::int64_t inner)
      : Node(NodeKind::Reduction, dtype_of<T>(), in->shape(), in->device(), {in}), dim_(dim), outer_(outer),
        extent_(extent), inner_(inner) {}

  std::string op_name() const override { return Log ? "log_softmax" : "softmax"; }
  std::string describe() const override { return op_name() + "(%0, dim=" + std::to_string(dim_) + ")"; }

  /// Blocks along every dimension but the one normalized.
  std::optional<BlockRule> block_rule() const override {
    const int rank = shape().rank();
    BlockRule r{std::vector<bool>(static_cast<std::size_t>(rank), true), {std::vector<int>(static_cast<std::size_t>(rank))}};
    for (int o = 0; o < rank; ++o) r.input_dim[0][static_cast<std::size_t>(o)] = o;
    r.splittable[static_cast<std::size_t>(dim_)] = false;
    r.input_dim[0][static_cast<std::size_t>(dim_)] = -1;
    return r;
  }
  NodePtr with_inputs(NodeList inputs, Shape shape, Device*) const override {
    std::int64_t outer = 1, inner = 1;
    for (int d = 0; d < dim_; ++d) outer *= shape[d];
    for (int d = dim_ + 1; d < shape.rank(); ++d) inner *= shape[d];
    return std::make_shared<SoftmaxNode>(std::move(inputs[0]), dim_, outer, extent_, inner);
  }
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

}  // namespace lazy::graph
