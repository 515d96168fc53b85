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
#include <cstddef>
#include <memory>
#include <string>
#include <typeinfo>
#include <vector>

#include <lazytensor/core/block_cache.hpp>
#include <lazytensor/core/small_vector.hpp>
#include <lazytensor/expr/dual.hpp>
#include <lazytensor/expr/evaluator.hpp>
#include <lazytensor/graph/chunk_reduction.hpp>
#include <lazytensor/graph/device.hpp>
#include <lazytensor/graph/parallel.hpp>
#include <lazytensor/expr/reduce_ops.hpp>
#include <lazytensor/core/config.hpp>

namespace lazy::graph {

/// How a child of shape `in` is reduced: [outer, R, inner].
struct ReduceGeometry {
  std::int64_t outer = 1, extent = 1, inner = 1;
};

namespace detail {

/// A batch of the child's values at [i, i + W) with the lanes from `count` on replaced by
/// the reduction's identity (the tail of a span; the read stays inside the padding).
template <class R, class S, class Ev>
inline expr::batch_t<S> masked_packet(const Ev& ev, std::int64_t i, std::int64_t count) {
  using V = expr::batch_t<S>;
  alignas(64) S tmp[V::size];
  ev.template packet<false>(i).store_aligned(tmp);
  for (std::int64_t k = count; k < static_cast<std::int64_t>(V::size); ++k) tmp[k] = R::template identity<S>();
  return V::load_aligned(tmp);
}

/// reduce_span for lanes without SIMD batches (integers, bool), four scalar accumulators.
/// Not auto-vectorized under GCC: GCC 12 at -O3 (AVX2 and AVX-512 targets) vectorized this
/// loop for int32 operands into wrong sums and products whenever the length was 8k..8k+3
/// (k >= 1); -O2 and Clang were right. tests/expr/o3_kernels.cpp checks at -O3.
template <class R, class S, class Ev>
LAZY_SCALAR_LOOP S reduce_span_scalar(const Ev& ev, std::int64_t b, std::int64_t len) {
  const std::int64_t e = b + len;
  std::int64_t i = b;
  S a[4] = {R::template identity<S>(), R::template identity<S>(), R::template identity<S>(),
            R::template identity<S>()};
  for (; i + 4 <= e; i += 4) {
    for (int k = 0; k < 4; ++k) a[k] = R::combine(a[k], ev.coeff(i + k));
  }
  for (; i < e; ++i) a[0] = R::combine(a[0], ev.coeff(i));
  return R::combine(R::combine(a[0], a[1]), R::combine(a[2], a[3]));
}

template <class R, class S, class Ev>
LAZY_KERNEL_LOOP S reduce_span(const Ev& ev, std::int64_t b, std::int64_t len) {
  const std::int64_t e = b + len;
  std::int64_t i = b;
  if constexpr (Ev::simd) {
    using V = expr::batch_t<S>;
    constexpr std::int64_t W = V::size;
    V a0 = R::template identity<V>(), a1 = a0, a2 = a0, a3 = a0;
    for (; i + 4 * W <= e; i += 4 * W) {
      a0 = R::combine(a0, ev.template packet<false>(i));
      a1 = R::combine(a1, ev.template packet<false>(i + W));
      a2 = R::combine(a2, ev.template packet<false>(i + 2 * W));
      a3 = R::combine(a3, ev.template packet<false>(i + 3 * W));
    }
    // At most four more batches, the last one partial: one masked body serves them all.
    for (; i < e; i += W) a0 = R::combine(a0, masked_packet<R, S>(ev, i, std::min(W, e - i)));
    return R::template horizontal<S>(R::combine(R::combine(a0, a1), R::combine(a2, a3)));
  } else {
    return reduce_span_scalar<R, S>(ev, b, len);
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

/// Per input, 1 when it is a single element broadcast over a child of `child_numel`
/// elements (the kernel then reads that element for every index).
core::SmallVector<char, 8> splat_flags(const NodeList& inputs,
                                              std::int64_t child_numel);

/// Reduces [b, b + len) block by block in lane S, combining the blocks' results in A.
template <class R, class S, class A, class Ev>
A reduce_range(const Ev& ev, std::int64_t b, std::int64_t len) {
  if (len <= kReduceBlock) return static_cast<A>(reduce_span<R, S>(ev, b, len));
  Partials<A> partial;
  partial.resize_for_overwrite(static_cast<std::size_t>((len + kReduceBlock - 1) / kReduceBlock));
  for (std::size_t j = 0; j < partial.size(); ++j) {
    const std::int64_t o = static_cast<std::int64_t>(j) * kReduceBlock;
    partial[j] = static_cast<A>(reduce_span<R, S>(ev, b + o, std::min(kReduceBlock, len - o)));
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
  virtual NodePtr with_block(NodeList inputs, Shape out, ReduceGeometry g, Shape child,
                             Device* device) const = 0;
};

/// The loops of one reduction (R, lane S, result Tout) of one kernel-form expression, behind
/// a virtual face: only these loops are compiled per expression, while the node that runs
/// them (ReductionNode: threads, partials, plans, SPMD blocks) is compiled once. `splat`
/// flags the inputs that are single elements broadcast over the child.
class ReduceKernel {
 public:
  virtual ~ReduceKernel() = default;
  /// The reduction's name (R::name).
  virtual const char* name() const = 0;
  /// The expression as text ("exp(in0)").
  virtual std::string text() const = 0;
  /// Estimated cost per element of the child (the expression's, plus one for the combine).
  virtual double cost() const = 0;
  /// Identity of the code (reducer, lane, result and expression form; never scalar values).
  virtual std::uint64_t hash() const = 0;
  /// Bytes of one partial result (sizeof(S)).
  virtual std::size_t partial_bytes() const = 0;
  /// Partials of blocks [b0, b1) of kReduceBlock elements of a span of `len` elements
  /// starting at element 0, into `partials` (indexed by block).
  virtual void blocks(const void* const* in, const char* splat, std::int64_t b0, std::int64_t b1,
                      std::int64_t len, void* partials) const = 0;
  /// Combines `count` partials pairwise (overwriting them) and writes the finished value
  /// (times `scale`, as Tout) to `out`.
  virtual void finish(void* partials, std::int64_t count, double scale, void* out) const = 0;
  /// Rows [o0, o1) of a child reduced over contiguous runs of `extent` (inner == 1).
  virtual void rows(const void* const* in, const char* splat, std::int64_t o0, std::int64_t o1,
                    std::int64_t extent, double scale, void* out) const = 0;
  /// Units [u0, u1) of a child reduced across rows (inner > 1): a unit is one outer index
  /// and kReduceColumns columns.
  virtual void columns(const void* const* in, const char* splat, std::int64_t u0, std::int64_t u1,
                       ReduceGeometry g, double scale, void* out) const = 0;
};

/// Columns of one unit of ReduceKernel::columns.
inline constexpr std::int64_t kReduceColumns = 256;

/// ReduceKernel's loops for kernel-form expression K reduced by R in lane S into Tout.
template <class K, class R, class S, Element Tout>
class ReduceLoops final : public ReduceKernel {
 public:
  using Ev = expr::Evaluator<S, K>;
  /// Type the blocks' results combine in. An integer result from a floating lane (bools
  /// counted, as in `sum(x > 0)`) is exact in the lane within one block (kReduceBlock
  /// << 2^24) but not beyond: the blocks' counts combine in the integer result type.
  using A = std::conditional_t<is_integral_v<Tout> && !is_integral_v<S>, Tout, S>;
  static_assert(alignof(A) <= alignof(std::max_align_t), "partials are kept in plain heap or stack storage");

  explicit ReduceLoops(K k) : k_(std::move(k)) {}

  const K& expression() const { return k_; }

  const char* name() const override { return R::name; }
  std::string text() const override { return expr::kernel_text(k_); }
  double cost() const override { return expr::kernel_cost<K>() + 1; }
  std::uint64_t hash() const override {
    static const std::uint64_t h = typeid(ReduceLoops).hash_code();  // hashes the type's name: once
    return h;
  }
  std::size_t partial_bytes() const override { return sizeof(A); }

  void blocks(const void* const* in, const char* splat, std::int64_t b0, std::int64_t b1,
              std::int64_t len, void* partials) const override {
    expr::SplatRoom<K> room;
    const Ev ev(k_, expr::EvalInputs{in, splat, room.bytes});
    A* p = static_cast<A*>(partials);
    for (std::int64_t b = b0; b < b1; ++b) {
      const std::int64_t s = b * kReduceBlock;
      p[b] = static_cast<A>(detail::reduce_span<R, S>(ev, s, std::min(kReduceBlock, len - s)));
    }
  }
  void finish(void* partials, std::int64_t count, double scale, void* out) const override {
    *static_cast<Tout*>(out) =
        finish_value(detail::pairwise<R>(static_cast<A*>(partials), static_cast<std::size_t>(count)), scale);
  }
  void rows(const void* const* in, const char* splat, std::int64_t o0, std::int64_t o1,
            std::int64_t extent, double scale, void* out) const override {
    expr::SplatRoom<K> room;
    const Ev ev(k_, expr::EvalInputs{in, splat, room.bytes});
    Tout* o = static_cast<Tout*>(out);
    for (std::int64_t r = o0; r < o1; ++r)
      o[r] = finish_value(detail::reduce_range<R, S, A>(ev, r * extent, extent), scale);
  }
  void columns(const void* const* in, const char* splat, std::int64_t u0, std::int64_t u1,
               ReduceGeometry g, double scale, void* out) const override {
    expr::SplatRoom<K> room;
    const Ev ev(k_, expr::EvalInputs{in, splat, room.bytes});
    column_units(ev, u0, u1, g, scale, static_cast<Tout*>(out));
  }

 private:
  template <class V>
  static Tout finish_value(V v, double scale) {
    if constexpr (std::is_same_v<V, S>) {
      if (scale != 1.0) v = static_cast<S>(v * static_cast<S>(scale));
      return expr::to_storage<Tout>(v);
    } else {
      return static_cast<Tout>(v);  // a count (A): integer results are never scaled
    }
  }

  // Reduce across rows: vectorized along the inner dimension, R in order.
  LAZY_KERNEL_LOOP static void column_units(const Ev& ev, std::int64_t u0, std::int64_t u1, ReduceGeometry g,
                                            double scale, Tout* out) {
    const std::int64_t extent = g.extent, inner = g.inner;
    const std::int64_t chunks = (inner + kReduceColumns - 1) / kReduceColumns;
    for (std::int64_t u = u0; u < u1; ++u) {
      const std::int64_t o = u / chunks, c0 = (u % chunks) * kReduceColumns;
      const std::int64_t c1 = std::min(inner, c0 + kReduceColumns), base = o * extent * inner;
      Tout* dst = out + o * inner;
      if constexpr (Ev::simd) {
        // Whole batches of columns; the last may be partial (its extra lanes are computed
        // from padding and dropped).
        using V = expr::batch_t<S>;
        constexpr std::int64_t W = V::size;
        for (std::int64_t c = c0; c < c1; c += W) {
          if constexpr (std::is_same_v<A, S>) {
            V acc = R::template identity<V>();
            for (std::int64_t r = 0; r < extent; ++r)
              acc = R::combine(acc, ev.template packet<false>(base + r * inner + c));
            alignas(64) S tmp[W];
            acc.store_aligned(tmp);
            for (std::int64_t k = 0; k < std::min(W, c1 - c); ++k) dst[c + k] = finish_value(tmp[k], scale);
          } else {
            // Counts: exact in the lane for one block of rows, then added up in A.
            A total[W];
            for (std::int64_t k = 0; k < W; ++k) total[k] = R::template identity<A>();
            for (std::int64_t r0 = 0; r0 < extent; r0 += kReduceBlock) {
              V acc = R::template identity<V>();
              for (std::int64_t r = r0; r < std::min(extent, r0 + kReduceBlock); ++r)
                acc = R::combine(acc, ev.template packet<false>(base + r * inner + c));
              alignas(64) S tmp[W];
              acc.store_aligned(tmp);
              for (std::int64_t k = 0; k < W; ++k) total[k] = R::combine(total[k], static_cast<A>(tmp[k]));
            }
            for (std::int64_t k = 0; k < std::min(W, c1 - c); ++k) dst[c + k] = finish_value(total[k], scale);
          }
        }
      } else {
        for (std::int64_t c = c0; c < c1; ++c) {
          if constexpr (std::is_same_v<A, S>) {
            S acc = R::template identity<S>();
            for (std::int64_t r = 0; r < extent; ++r) acc = R::combine(acc, ev.coeff(base + r * inner + c));
            dst[c] = finish_value(acc, scale);
          } else {
            A total = R::template identity<A>();
            for (std::int64_t r0 = 0; r0 < extent; r0 += kReduceBlock) {
              S acc = R::template identity<S>();
              for (std::int64_t r = r0; r < std::min(extent, r0 + kReduceBlock); ++r)
                acc = R::combine(acc, ev.coeff(base + r * inner + c));
              total = R::combine(total, static_cast<A>(acc));
            }
            dst[c] = finish_value(total, scale);
          }
        }
      }
    }
  }

  K k_;
};

/// Reduces a child expression ([outer, extent, inner], of `child_shape`) with a ReduceKernel
/// and scales by `scale`. Not a template: what depends on the expression is the kernel,
/// which ReductionNodeOf holds (one allocation per node, as one statement's fixed cost).
class ReductionNode : public Node, public ChunkReduction, public BlockReduction {
 public:
  /// (The runtime's, as Node's: ReductionNodeOf's destructors then only call it.)
  ~ReductionNode() override;
  std::string op_name() const override { return kernel_.name(); }
  LAZYTENSOR_INLINE std::string describe() const override;
  double cost_per_element() const override { return kernel_.cost(); }
  LAZYTENSOR_INLINE std::uint64_t structural_hash() const override;

  const Shape& child_shape() const override { return child_shape_; }
  ReduceGeometry geometry() const override { return g_; }
  const char* reduce_name() const override { return kernel_.name(); }

  bool reduces_all() const override { return g_.outer == 1 && g_.inner == 1; }
  std::size_t partial_bytes() const override { return kernel_.partial_bytes(); }
  LAZYTENSOR_INLINE void reduce_chunk(const void* const* inputs, std::int64_t len, void* partial) const override;
  LAZYTENSOR_INLINE void finish_partials(ExecContext& ctx, void* partials, std::int64_t count) override;

 protected:
  /// `kernel` is a member of the derived node: it is not touched here before that
  /// member is constructed.
  ReductionNode(const ReduceKernel& kernel, DType dtype, Shape out_shape, ReduceGeometry g, double scale,
                Device* device, NodeList inputs, Shape child_shape);

  LAZYTENSOR_INLINE void compute(ExecContext& ctx) override;

  double scale() const { return scale_; }

 private:
  const ReduceKernel& kernel_;
  ReduceGeometry g_;
  double scale_;
  Shape child_shape_;
  core::SmallVector<char, 8> splat_;
};

/// A ReductionNode holding its loops: kernel-form expression K reduced by R in lane S into
/// Tout.
template <class K, class R, class S, Element Tout>
class ReductionNodeOf final : public ReductionNode {
 public:
  ReductionNodeOf(K k, Shape out_shape, ReduceGeometry g, double scale, Device* device, NodeList inputs,
                  Shape child_shape)
      : ReductionNode(loops_, dtype_of<Tout>(), std::move(out_shape), g, scale, device, std::move(inputs),
                      std::move(child_shape)),
        loops_(std::move(k)) {}

  NodePtr with_block(NodeList inputs, Shape out, ReduceGeometry g, Shape child,
                     Device* device) const override {
    return std::make_shared<ReductionNodeOf>(loops_.expression(), std::move(out), g, scale(), device,
                                             std::move(inputs), std::move(child));
  }

 private:
  ReduceLoops<K, R, S, Tout> loops_;
};

/// A pending-node-to-be reducing kernel-form expression `k` (lane of the combine S) by R
/// into Tout (not yet submitted).
template <class R, class S, Element Tout, class K>
NodePtr reduction_node(K k, Shape out_shape, ReduceGeometry g, double scale, Device* device,
                       NodeList inputs, Shape child_shape) {
  return core::make_cached<ReductionNodeOf<K, R, S, Tout>>(std::move(k), std::move(out_shape), g, scale, device,
                                                            std::move(inputs), std::move(child_shape));
}

/// argmax / argmin (first occurrence; NaN counts as the extreme, as in torch).
template <class K, class S, bool IsMax>
class ArgReductionNode final : public Node, public BlockReduction {
 public:
  ArgReductionNode(K kernel, Shape out_shape, ReduceGeometry g, Device* device,
                   NodeList inputs, Shape child_shape)
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
  NodePtr with_block(NodeList inputs, Shape out, ReduceGeometry g, Shape child,
                     Device* device) const override {
    return std::make_shared<ArgReductionNode>(kernel_, out, g, device, std::move(inputs), std::move(child));
  }

 protected:
  void compute(ExecContext& ctx) override {
    const auto& ins = inputs();
    detail::InputPointers ptrs;
    ptrs.resize_for_overwrite(ins.size());
    for (std::size_t i = 0; i < ins.size(); ++i) ptrs[i] = ins[i]->buffer()->data();
    auto buf = allocate_output(ctx, false);
    auto* out = static_cast<std::int64_t*>(buf->data());
    auto& pool = ctx.device.threads();
    const std::int64_t units = g_.outer * g_.inner;
    const std::int64_t tasks = std::min(units, task_count(pool, units * g_.extent, 2.0));
    pool.parallel_for(tasks, [&](std::int64_t t) {
      expr::SplatRoom<K> room;
      const expr::Evaluator<S, K> ev(kernel_,
                                     expr::EvalInputs{ptrs.data(), splat_.data(), room.bytes});
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

LAZYTENSOR_INLINE core::SmallVector<char, 8> splat_flags(const NodeList& inputs,
    std::int64_t child_numel) {
  core::SmallVector<char, 8> flags;
  flags.resize_for_overwrite(inputs.size());
  for (std::size_t i = 0; i < inputs.size(); ++i)
    flags[i] = inputs[i]->numel() == 1 && child_numel != 1 ? 1 : 0;
  return flags;
}

}  // namespace lazy::graph::detail

namespace lazy::graph {

LAZYTENSOR_INLINE ReductionNode::ReductionNode(const ReduceKernel& kernel, DType dtype, Shape out_shape,
                                               ReduceGeometry g, double scale, Device* device,
                                               NodeList inputs, Shape child_shape)
    : Node(NodeKind::Reduction, dtype, std::move(out_shape), device, std::move(inputs)),
      kernel_(kernel),
      g_(g),
      scale_(scale),
      child_shape_(std::move(child_shape)),
      splat_(detail::splat_flags(this->inputs(), child_shape_.numel())) {}

LAZYTENSOR_INLINE ReductionNode::~ReductionNode() = default;

LAZYTENSOR_INLINE std::string ReductionNode::describe() const {
  return std::string(kernel_.name()) + "(" + kernel_.text() + ") over [" + std::to_string(g_.outer) + ", " +
         std::to_string(g_.extent) + ", " + std::to_string(g_.inner) + "]";
}

LAZYTENSOR_INLINE std::uint64_t ReductionNode::structural_hash() const {
  std::uint64_t h = hash_combine(Node::structural_hash(), kernel_.hash());
  h = hash_combine(h, hash_shape(child_shape_));
  return hash_combine(h, static_cast<std::uint64_t>(g_.extent));
}

LAZYTENSOR_INLINE void ReductionNode::reduce_chunk(const void* const* inputs, std::int64_t len, void* partial) const {
  kernel_.blocks(inputs, splat_.data(), 0, 1, len, partial);
}

LAZYTENSOR_INLINE void ReductionNode::finish_partials(ExecContext& ctx, void* partials, std::int64_t count) {
  auto buf = allocate_output(ctx, false);
  kernel_.finish(partials, count, scale_, buf->data());
  set_buffer(std::move(buf));
  finish();
}

LAZYTENSOR_INLINE void ReductionNode::compute(ExecContext& ctx) {
  const auto& ins = inputs();
  detail::InputPointers ptrs;
  ptrs.resize_for_overwrite(ins.size());
  for (std::size_t i = 0; i < ins.size(); ++i) ptrs[i] = ins[i]->buffer()->data();
  auto buf = allocate_output(ctx, false);
  void* out = buf->data();
  const ReduceKernel& k = kernel_;
  auto& pool = ctx.device.threads();
  const double cost = cost_per_element();
  const std::int64_t outer = g_.outer, extent = g_.extent, inner = g_.inner;
  const std::int64_t total = outer * extent * inner;
  const void* const* in = ptrs.data();
  const char* splat = splat_.data();
  if (inner == 1 && outer == 1) {
    // One value: blocks in parallel, then the fixed pairwise tree.
    const std::int64_t blocks = (extent + kReduceBlock - 1) / kReduceBlock;
    // Partials of any lane, in 2 KiB inline (512 floats' worth: a statement of up to 8 MiB
    // of floats needs no heap).
    core::SmallVector<std::max_align_t, 64> partial;
    const std::size_t bytes = static_cast<std::size_t>(blocks) * k.partial_bytes();
    partial.resize_for_overwrite((bytes + sizeof(std::max_align_t) - 1) / sizeof(std::max_align_t));
    const std::int64_t tasks = std::min(blocks, task_count(pool, total, cost));
    pool.parallel_for(tasks, [&](std::int64_t t) {
      auto [b0, b1] = task_range(blocks, tasks, t);
      k.blocks(in, splat, b0, b1, extent, partial.data());
    });
    k.finish(partial.data(), blocks, scale_, out);
  } else if (inner == 1) {
    const std::int64_t tasks = std::min(outer, task_count(pool, total, cost));
    pool.parallel_for(tasks, [&](std::int64_t t) {
      auto [o0, o1] = task_range(outer, tasks, t);
      k.rows(in, splat, o0, o1, extent, scale_, out);
    });
  } else {
    const std::int64_t units = outer * ((inner + kReduceColumns - 1) / kReduceColumns);
    const std::int64_t tasks = std::min(units, task_count(pool, total, cost));
    pool.parallel_for(tasks, [&](std::int64_t t) {
      auto [u0, u1] = task_range(units, tasks, t);
      k.columns(in, splat, u0, u1, g_, scale_, out);
    });
  }
  set_buffer(std::move(buf));
}

}  // namespace lazy::graph
#endif  // LAZYTENSOR_HEADER_DEFINITIONS
