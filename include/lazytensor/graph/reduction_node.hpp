#pragma once
// Reductions fused with their element-wise child: the child expression is evaluated inside
// the reduction loop, never written out. The child is viewed as [outer, R, inner] and
// reduced over R.
//
// Determinism: a span of R contiguous values is cut into fixed blocks of kReduceBlock
// elements, each reduced with 4 independent SIMD accumulators, and the block results are
// combined by a pairwise tree. Block boundaries depend only on the sizes, so results are
// bitwise identical whatever the number of threads.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <typeinfo>
#include <vector>

#include <lazytensor/core/small_vector.hpp>
#include <lazytensor/expr/dual.hpp>
#include <lazytensor/expr/evaluator.hpp>
#include <lazytensor/graph/chunk_reduction.hpp>
#include <lazytensor/graph/device.hpp>
#include <lazytensor/graph/parallel.hpp>
#include <lazytensor/expr/reduce_ops.hpp>
#include <lazytensor/core/config.hpp>

namespace lazy::graph {

/// Leaf size of the pairwise reduction tree (also the chunk of fused groups, see
/// chunk_reduction.hpp).
inline constexpr std::int64_t kReduceBlock = 4096;

/// How a child of shape `in` is reduced: [outer, R, inner].
struct ReduceGeometry {
  std::int64_t outer = 1, extent = 1, inner = 1;
};

namespace detail {

/// A batch of the child's values at [i, i + W) with the lanes from `count` on replaced by
/// the reduction's identity (the tail of a span; the read stays inside the padding).
template <class R, class S, bool C, class Ev>
inline expr::batch_t<S> masked_packet(const Ev& ev, std::int64_t i, std::int64_t count) {
  using V = expr::batch_t<S>;
  alignas(64) S tmp[V::size];
  ev.template packet<C>(i).store_aligned(tmp);
  for (std::int64_t k = count; k < static_cast<std::int64_t>(V::size); ++k) tmp[k] = R::template identity<S>();
  return V::load_aligned(tmp);
}

template <class R, class S, bool C, class Ev>
LAZY_KERNEL_LOOP S reduce_span(const Ev& ev, std::int64_t b, std::int64_t len) {
  const std::int64_t e = b + len;
  std::int64_t i = b;
  if constexpr (Ev::simd) {
    using V = expr::batch_t<S>;
    constexpr std::int64_t W = V::size;
    V a0 = R::template identity<V>(), a1 = a0, a2 = a0, a3 = a0;
    for (; i + 4 * W <= e; i += 4 * W) {
      a0 = R::combine(a0, ev.template packet<C>(i));
      a1 = R::combine(a1, ev.template packet<C>(i + W));
      a2 = R::combine(a2, ev.template packet<C>(i + 2 * W));
      a3 = R::combine(a3, ev.template packet<C>(i + 3 * W));
    }
    // At most four more batches, the last one partial: one masked body serves them all.
    for (; i < e; i += W) a0 = R::combine(a0, masked_packet<R, S, C>(ev, i, std::min(W, e - i)));
    return R::template horizontal<S>(R::combine(R::combine(a0, a1), R::combine(a2, a3)));
  } else {
    S a[4] = {R::template identity<S>(), R::template identity<S>(), R::template identity<S>(),
              R::template identity<S>()};
    for (; i + 4 <= e; i += 4) {
      for (int k = 0; k < 4; ++k) a[k] = R::combine(a[k], ev.coeff(i + k));
    }
    for (; i < e; ++i) a[0] = R::combine(a[0], ev.coeff(i));
    return R::combine(R::combine(a[0], a[1]), R::combine(a[2], a[3]));
  }
}

/// Combines the `n` partial results at `v` pairwise, in a fixed shape (overwriting them).
template <class R, class S>
S pairwise(S* v, std::size_t n) {
  if (n == 0) return R::template identity<S>();
  while (n > 1) {
    std::size_t j = 0;
    for (std::size_t i = 0; i + 1 < n; i += 2) v[j++] = R::combine(v[i], v[i + 1]);
    if (n % 2) v[j++] = v[n - 1];
    n = j;
  }
  return v[0];
}

/// Per-block partial results: the blocks of a statement that fits in L2 need no heap.
template <class S>
using Partials = core::SmallVector<S, 64>;

/// Input pointers of a node's kernel (most kernels read a handful of inputs).
using InputPointers = core::SmallVector<const void*, 8>;

/// Per input, 1 when it is a single element broadcast over a child of `child_numel`
/// elements (the kernel then reads that element for every index).
core::SmallVector<char, 8> splat_flags(const std::vector<NodePtr>& inputs,
                                              std::int64_t child_numel);

template <class R, class S, bool C, class Ev>
S reduce_range(const Ev& ev, std::int64_t b, std::int64_t len) {
  if (len <= kReduceBlock) return reduce_span<R, S, C>(ev, b, len);
  Partials<S> partial;
  partial.resize(static_cast<std::size_t>((len + kReduceBlock - 1) / kReduceBlock));
  for (std::size_t j = 0; j < partial.size(); ++j) {
    const std::int64_t o = static_cast<std::int64_t>(j) * kReduceBlock;
    partial[j] = reduce_span<R, S, C>(ev, b + o, std::min(kReduceBlock, len - o));
  }
  return pairwise<R>(partial.data(), partial.size());
}

}  // namespace detail

/// What the SPMD partitioner needs of a reduction: the child it reduces (viewed as
/// [outer, extent, inner]) and the same reduction over a block of it.
class BlockReduction {
 public:
  virtual ~BlockReduction() = default;
  virtual const Shape& child_shape() const = 0;
  virtual ReduceGeometry geometry() const = 0;
  /// The reduction's name ("sum", "prod", "max", "min", "any", "all"; "argmax" and
  /// "argmin", whose results over blocks of the reduced dimensions do not combine).
  virtual const char* reduce_name() const = 0;
  /// The same kernel and scale over `inputs` (blocks of this node's inputs, of `child`
  /// shape or single elements), producing `out` on `device`, not yet submitted.
  virtual NodePtr with_block(std::vector<NodePtr> inputs, Shape out, ReduceGeometry g, Shape child,
                             Device* device) const = 0;
};

/// Reduces kernel-form expression K (with lane S) by R into Tout, scaling by `scale`.
template <class K, class R, class S, Element Tout>
class ReductionNode final : public Node, public ChunkReduction, public BlockReduction {
 public:
  ReductionNode(K kernel, Shape out_shape, ReduceGeometry g, double scale, Device* device,
                std::vector<NodePtr> inputs, Shape child_shape)
      : Node(NodeKind::Reduction, dtype_of<Tout>(), out_shape, device, std::move(inputs)),
        kernel_(std::move(kernel)),
        g_(g),
        scale_(scale),
        child_shape_(child_shape),
        splat_(detail::splat_flags(this->inputs(), child_shape.numel())) {}

  std::string op_name() const override { return R::name; }
  std::string describe() const override {
    return std::string(R::name) + "(" + expr::kernel_text(kernel_) + ") over [" + std::to_string(g_.outer) +
           ", " + std::to_string(g_.extent) + ", " + std::to_string(g_.inner) + "]";
  }
  double cost_per_element() const override { return expr::kernel_cost<K>() + 1; }
  std::uint64_t structural_hash() const override {
    static const std::uint64_t kernel_hash = typeid(K).hash_code();  // hashes the type's name: once
    std::uint64_t h = hash_combine(Node::structural_hash(), kernel_hash);
    h = hash_combine(h, hash_shape(child_shape_));
    return hash_combine(h, static_cast<std::uint64_t>(g_.extent));
  }

  const Shape& child_shape() const override { return child_shape_; }
  ReduceGeometry geometry() const override { return g_; }
  const char* reduce_name() const override { return R::name; }
  NodePtr with_block(std::vector<NodePtr> inputs, Shape out, ReduceGeometry g, Shape child,
                     Device* device) const override {
    return std::make_shared<ReductionNode>(kernel_, out, g, scale_, device, std::move(inputs), child);
  }

  bool reduces_all() const override { return g_.outer == 1 && g_.inner == 1; }
  std::size_t partial_bytes() const override { return sizeof(S); }
  void reduce_chunk(const void* const* inputs, std::int64_t len, void* partial) const override {
    bool contig = true;
    for (char s : splat_) contig = contig && !s;
    const expr::Evaluator<S, K> ev(kernel_, inputs, splat_.data());
    *static_cast<S*>(partial) = contig ? detail::reduce_span<R, S, true>(ev, 0, len) : detail::reduce_span<R, S, false>(ev, 0, len);
  }
  void finish_partials(ExecContext& ctx, void* partials, std::int64_t count) override {
    auto buf = allocate_output(ctx, false);
    static_cast<Tout*>(buf->data())[0] = finish_value(
        detail::pairwise<R>(static_cast<S*>(partials), static_cast<std::size_t>(count)));
    set_buffer(std::move(buf));
    finish();
  }

 protected:
  void compute(ExecContext& ctx) override {
    const auto& ins = inputs();
    detail::InputPointers ptrs;
    ptrs.resize(ins.size());
    for (std::size_t i = 0; i < ins.size(); ++i) ptrs[i] = ins[i]->buffer()->data();
    auto buf = allocate_output(ctx, false);
    Tout* out = static_cast<Tout*>(buf->data());
    bool contig = true;
    for (char s : splat_) contig = contig && !s;
    if (contig) run<true>(ctx, ptrs, out);
    else run<false>(ctx, ptrs, out);
    set_buffer(std::move(buf));
  }

 private:
  Tout finish_value(S v) const {
    if (scale_ != 1.0) v = static_cast<S>(v * static_cast<S>(scale_));
    return expr::to_storage<Tout>(v);
  }

  template <bool C>
  void run(ExecContext& ctx, const detail::InputPointers& ptrs, Tout* out) {
    auto& pool = ctx.device.threads();
    const double cost = cost_per_element();
    const std::int64_t outer = g_.outer, R_ = g_.extent, inner = g_.inner;
    const std::int64_t total = outer * R_ * inner;
    auto eval = [&] { return expr::Evaluator<S, K>(kernel_, ptrs.data(), splat_.data()); };
    if (inner == 1 && outer == 1) {
      // One value: blocks in parallel, then the fixed pairwise tree.
      const std::int64_t blocks = (R_ + kReduceBlock - 1) / kReduceBlock;
      detail::Partials<S> partial;
      partial.resize(static_cast<std::size_t>(blocks));
      const std::int64_t tasks = std::min(blocks, task_count(pool, total, cost));
      pool.parallel_for(tasks, [&](std::int64_t t) {
        auto ev = eval();
        auto [b0, b1] = task_range(blocks, tasks, t);
        for (std::int64_t b = b0; b < b1; ++b) {
          const std::int64_t s = b * kReduceBlock;
          partial[b] = detail::reduce_span<R, S, C>(ev, s, std::min(kReduceBlock, R_ - s));
        }
      });
      out[0] = finish_value(detail::pairwise<R>(partial.data(), partial.size()));
    } else if (inner == 1) {
      const std::int64_t tasks = std::min(outer, task_count(pool, total, cost));
      pool.parallel_for(tasks, [&](std::int64_t t) {
        auto ev = eval();
        auto [o0, o1] = task_range(outer, tasks, t);
        for (std::int64_t o = o0; o < o1; ++o) out[o] = finish_value(detail::reduce_range<R, S, C>(ev, o * R_, R_));
      });
    } else {
      // Reduce across rows: vectorized along the inner dimension, R in order.
      constexpr std::int64_t kCols = 256;
      const std::int64_t col_chunks = (inner + kCols - 1) / kCols;
      const std::int64_t units = outer * col_chunks;
      const std::int64_t tasks = std::min(units, task_count(pool, total, cost));
      pool.parallel_for(tasks, [&](std::int64_t t) {
        auto ev = eval();
        auto [u0, u1] = task_range(units, tasks, t);
        for (std::int64_t u = u0; u < u1; ++u) {
          const std::int64_t o = u / col_chunks, c0 = (u % col_chunks) * kCols, c1 = std::min(inner, c0 + kCols);
          reduce_columns<C>(ev, out + o * inner, o * R_ * inner, c0, c1);
        }
      });
    }
  }

  template <bool C>
  LAZY_KERNEL_LOOP void reduce_columns(const expr::Evaluator<S, K>& ev, Tout* out, std::int64_t base, std::int64_t c0, std::int64_t c1) {
    const std::int64_t R_ = g_.extent, inner = g_.inner;
    if constexpr (expr::Evaluator<S, K>::simd) {
      // Whole batches of columns; the last may be partial (its extra lanes are computed
      // from padding and dropped).
      using V = expr::batch_t<S>;
      constexpr std::int64_t W = V::size;
      for (std::int64_t c = c0; c < c1; c += W) {
        V acc = R::template identity<V>();
        for (std::int64_t r = 0; r < R_; ++r) acc = R::combine(acc, ev.template packet<C>(base + r * inner + c));
        alignas(64) S tmp[W];
        acc.store_aligned(tmp);
        for (std::int64_t k = 0; k < std::min(W, c1 - c); ++k) out[c + k] = finish_value(tmp[k]);
      }
    } else {
      for (std::int64_t c = c0; c < c1; ++c) {
        S acc = R::template identity<S>();
        for (std::int64_t r = 0; r < R_; ++r) acc = R::combine(acc, ev.coeff(base + r * inner + c));
        out[c] = finish_value(acc);
      }
    }
  }

  K kernel_;
  ReduceGeometry g_;
  double scale_;
  Shape child_shape_;
  core::SmallVector<char, 8> splat_;
};

/// argmax / argmin (first occurrence; NaN counts as the extreme, as in torch).
template <class K, class S, bool IsMax>
class ArgReductionNode final : public Node, public BlockReduction {
 public:
  ArgReductionNode(K kernel, Shape out_shape, ReduceGeometry g, Device* device,
                   std::vector<NodePtr> inputs, Shape child_shape)
      : Node(NodeKind::Reduction, DType::Int64, out_shape, device, std::move(inputs)),
        kernel_(std::move(kernel)),
        g_(g),
        child_shape_(std::move(child_shape)),
        splat_(detail::splat_flags(this->inputs(), child_shape_.numel())) {}
  std::string op_name() const override { return IsMax ? "argmax" : "argmin"; }
  std::string describe() const override { return op_name() + "(" + expr::kernel_text(kernel_) + ")"; }

  const Shape& child_shape() const override { return child_shape_; }
  ReduceGeometry geometry() const override { return g_; }
  const char* reduce_name() const override { return IsMax ? "argmax" : "argmin"; }
  NodePtr with_block(std::vector<NodePtr> inputs, Shape out, ReduceGeometry g, Shape child,
                     Device* device) const override {
    return std::make_shared<ArgReductionNode>(kernel_, out, g, device, std::move(inputs), std::move(child));
  }

 protected:
  void compute(ExecContext& ctx) override {
    const auto& ins = inputs();
    detail::InputPointers ptrs;
    ptrs.resize(ins.size());
    for (std::size_t i = 0; i < ins.size(); ++i) ptrs[i] = ins[i]->buffer()->data();
    auto buf = allocate_output(ctx, false);
    auto* out = static_cast<std::int64_t*>(buf->data());
    auto& pool = ctx.device.threads();
    const std::int64_t units = g_.outer * g_.inner;
    const std::int64_t tasks = std::min(units, task_count(pool, units * g_.extent, 2.0));
    pool.parallel_for(tasks, [&](std::int64_t t) {
      expr::Evaluator<S, K> ev(kernel_, ptrs.data(), splat_.data());
      auto [u0, u1] = task_range(units, tasks, t);
      for (std::int64_t u = u0; u < u1; ++u) {
        const std::int64_t o = u / g_.inner, c = u % g_.inner;
        const std::int64_t base = o * g_.extent * g_.inner + c;
        S best = ev.coeff(base);
        std::int64_t best_i = 0;
        for (std::int64_t r = 1; r < g_.extent && best == best; ++r) {
          const S v = ev.coeff(base + r * g_.inner);
          if ((IsMax ? v > best : v < best) || v != v) {
            best = v;
            best_i = r;
          }
        }
        out[u] = best_i;
      }
    });
    set_buffer(std::move(buf));
  }

 private:
  K kernel_;
  ReduceGeometry g_;
  Shape child_shape_;
  core::SmallVector<char, 8> splat_;
};

}  // namespace lazy::graph

#if LAZYTENSOR_HEADER_DEFINITIONS
namespace lazy::graph::detail {

LAZYTENSOR_INLINE core::SmallVector<char, 8> splat_flags(const std::vector<NodePtr>& inputs,
    std::int64_t child_numel) {
  core::SmallVector<char, 8> flags;
  flags.resize(inputs.size());
  for (std::size_t i = 0; i < inputs.size(); ++i)
    flags[i] = inputs[i]->numel() == 1 && child_numel != 1 ? 1 : 0;
  return flags;
}

}  // namespace lazy::graph::detail
#endif  // LAZYTENSOR_HEADER_DEFINITIONS
