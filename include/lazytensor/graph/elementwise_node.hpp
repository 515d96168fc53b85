#pragma once
// The graph node of a fused element-wise kernel: one expression, one output, one pass.
//
// Split as Eigen splits expressions from evaluators: ElementwiseNode (not a template) owns
// the graph-side logic — layout, threading, GEMM epilogue fusion, donation — once for all
// kernels; a CompiledKernel<K, Tout> holds the kernel-form expression and only the loops
// that must be compiled per expression. That keeps each expression's cost in code (and
// compile time) to its SIMD loops, and gives the planner one interface to run any
// element-wise kernel over a range of elements.

#include <atomic>
#include <cstdint>
#include <memory>
#include <new>
#include <string>
#include <typeinfo>
#include <utility>
#include <vector>

#include <lazytensor/core/block_cache.hpp>
#include <lazytensor/core/counters.hpp>
#include <lazytensor/core/tuning.hpp>
#include <lazytensor/expr/dual.hpp>
#include <lazytensor/expr/evaluator.hpp>
#include <lazytensor/expr/layout.hpp>
#include <lazytensor/graph/device.hpp>
#include <lazytensor/graph/parallel.hpp>
#include <lazytensor/core/config.hpp>

namespace lazy::graph {

/// A producer whose rows a consumer can compute block by block into its own buffer
/// (GEMM feeding an element-wise epilogue).
class RowProducer {
 public:
  virtual ~RowProducer() = default;
  /// Writes rows [r0, r1) of this node's value (viewed as rows x last dim) into `out`,
  /// a buffer laid out like this node's value. Runs on the calling thread only. The
  /// producer cuts the range at fixed row_block() boundaries, so the values do not depend
  /// on how callers split the rows (bitwise-identical results for any thread count).
  virtual void produce_rows(void* out, std::int64_t r0, std::int64_t r1) = 0;
  /// The rows one block holds (callers split on multiples of it to avoid partial blocks).
  virtual std::int64_t row_block() const = 0;
  /// Elements per row (a product's n). Not always the value's last dim: a matrix times a
  /// vector has the value [m] and rows of one element.
  virtual std::int64_t row_width() const = 0;
  /// Called once on the executing thread before any produce_rows of a step (the producer
  /// may prepare shared state there, using the device's threads) ...
  virtual void begin_rows(ExecContext& ctx) { (void)ctx; }
  /// ... and once after the last one.
  virtual void end_rows() {}

  /// begin_rows / end_rows around a scope, end_rows also when the scope throws.
  class Session {
   public:
    Session(RowProducer& p, ExecContext& ctx);
    ~Session();
    Session(const Session&) = delete;
    Session& operator=(const Session&) = delete;

   private:
    RowProducer& p_;
  };
};

/// The per-expression part of an element-wise kernel: its loops.
class ElementwiseKernel {
 public:
  virtual ~ElementwiseKernel() = default;
  /// Kernels come from this thread's block cache (core/block_cache.hpp): one per
  /// element-wise statement. Sized delete: the virtual destructor passes the kernel's size.
  static void* operator new(std::size_t bytes) { return core::allocate_block(bytes); }
  static void operator delete(void* p, std::size_t bytes) noexcept { core::free_block(p, bytes); }
  // An over-aligned kernel (none today) would bypass the cache: blocks are aligned as
  // ::operator new aligns.
  static void* operator new(std::size_t bytes, std::align_val_t al) { return ::operator new(bytes, al); }
  static void operator delete(void* p, std::size_t, std::align_val_t al) noexcept {
    ::operator delete(p, al);
  }
  /// Elements [b, e) of a flat kernel (inputs of the output's shape, or single elements
  /// flagged in `splat`). `contig`: no splat. `stream`: non-temporal stores, out + b
  /// batch-aligned, the caller fences.
  virtual void flat(const void* const* in, const char* splat, void* out, std::int64_t b, std::int64_t e, bool contig,
                    bool stream) const = 0;
  /// Rows [r0, r1) of a kernel with a multi-dimensional broadcast layout.
  virtual void rows(const void* const* in, const expr::Layout& layout, void* out, std::int64_t r0,
                    std::int64_t r1) const = 0;
  /// The expression as text ("add(mul(in0, in1), 2)").
  virtual std::string text() const = 0;
  /// Estimated cost per element (1 = one add).
  virtual double cost() const = 0;
  /// Identity of the code: equal hashes, same kernel up to scalar values. Scalar values
  /// never enter it (not even 0 and +-1, which DESIGN allows: no kernel specializes on
  /// them), so a new learning rate or a schedule reaching 0 never changes a plan.
  virtual std::uint64_t hash() const = 0;

 private:
  friend class KernelRef;
  mutable std::atomic<std::int32_t> refs_{0};
};

/// Shared ownership of a kernel (nodes made by with_inputs share their original's).
/// Counted inside ElementwiseKernel rather than by std::shared_ptr: make_shared would
/// instantiate a control block and its allocator machinery for every expression type,
/// a fifth of what an element-wise statement costs to compile.
class KernelRef {
 public:
  /// Takes ownership of a kernel made with `new`.
  explicit KernelRef(const ElementwiseKernel* k) noexcept : k_(k) { retain(); }
  KernelRef(const KernelRef& o) noexcept : k_(o.k_) { retain(); }
  KernelRef(KernelRef&& o) noexcept : k_(std::exchange(o.k_, nullptr)) {}
  KernelRef& operator=(KernelRef o) noexcept {
    std::swap(k_, o.k_);
    return *this;
  }
  ~KernelRef() {
    if (k_ && k_->refs_.fetch_sub(1, std::memory_order_acq_rel) == 1) delete k_;
  }
  const ElementwiseKernel* operator->() const noexcept { return k_; }
  const ElementwiseKernel& operator*() const noexcept { return *k_; }

 private:
  void retain() const noexcept {
    if (k_) k_->refs_.fetch_add(1, std::memory_order_relaxed);
  }
  const ElementwiseKernel* k_;
};

/// The loops of kernel-form expression K writing Tout: expr::eval_range in two forms, for
/// flat ranges without splat inputs and for the rest (splat inputs, rows). `Lean`: the
/// general form only, for expressions only a rare path writes out (ops/reduction.hpp).
template <class K, Element Tout, bool Lean = false>
class CompiledKernel final : public ElementwiseKernel {
 public:
  using S = expr::kernel_lane_t<K>;
  using Ev = expr::Evaluator<S, K>;

  explicit CompiledKernel(K k) : k_(std::move(k)) {}

  void flat(const void* const* in, const char* splat, void* out_v, std::int64_t b, std::int64_t e, bool contig,
            bool stream) const override {
    Tout* out = static_cast<Tout*>(out_v) + b;
    expr::SplatRoom<K> room;
    const Ev ev(k_, expr::EvalInputs{in, splat, room.bytes});
    if constexpr (!Lean) {
      if (contig) {
        expr::eval_range<S, Tout, true>(ev, out, b, e, stream);
        return;
      }
    }
    expr::eval_range<S, Tout, false>(ev, out, b, e, can_stream && stream);
  }
  void rows(const void* const* in, const expr::Layout& layout, void* out, std::int64_t r0,
            std::int64_t r1) const override {
    expr::SplatRoom<K> room;
    Ev ev(k_, expr::EvalInputs{in, layout.splat.data(), room.bytes});
    expr::eval_rows<S, Tout>(ev, layout, static_cast<Tout*>(out), r0, r1);
  }
  std::string text() const override { return expr::kernel_text(k_); }
  double cost() const override { return expr::kernel_cost<K>(); }
  std::uint64_t hash() const override {
    static const std::uint64_t h = typeid(K).hash_code();  // hashes the type's name: once
    return h;
  }

  /// Whether this kernel can stream its stores (a SIMD lane that is the output type, and
  /// not the lean form).
  static constexpr bool can_stream = !Lean && Ev::simd && std::is_same_v<S, Tout>;

 private:
  K k_;
};

/// Evaluates an element-wise kernel into a tensor.
class ElementwiseNode final : public Node {
 public:
  ElementwiseNode(KernelRef kernel, bool can_stream, DType dtype, Shape shape,
                  Device* device, NodeList inputs);

  /// Element-wise: every output dimension splits; inputs aligned right (NumPy).
  std::optional<BlockRule> block_rule() const override { return aligned_block_rule(shape(), inputs()); }
  /// The same kernel over other inputs (the SPMD partitioner runs one per shard). The
  /// kernel is shared: it holds only the expression's form and scalars, never data.
  NodePtr with_inputs(NodeList inputs, Shape shape, Device* device) const override {
    return std::make_shared<ElementwiseNode>(kernel_, can_stream_, dtype(), shape, device, std::move(inputs));
  }

  std::string op_name() const override { return "fused"; }
  std::string describe() const override { return kernel_->text(); }
  double cost_per_element() const override { return kernel_->cost(); }
  /// (A constant stands for op_name(): hashing a string per node was a visible part of a
  /// step's planning.)
  std::uint64_t structural_hash() const override {
    return hash_combine(hash_combine(layout_hash(), 0x66757365644e6f64ull), kernel_->hash());
  }
  const expr::Layout& layout() const { return layout_; }
  const ElementwiseKernel& kernel() const { return *kernel_; }
  /// True when this node runs a GEMM producer in row blocks (see fuse_producers).
  bool takes_producer() const { return fused_slot_ >= 0; }
  /// True when the kernel can write its output with non-temporal stores.
  bool can_stream() const { return can_stream_; }

  LAZYTENSOR_INLINE void fuse_producers() override;

 protected:
  LAZYTENSOR_INLINE void compute(ExecContext& ctx) override;

  LAZYTENSOR_INLINE void finish() override;

 private:
  void run(ExecContext& ctx, const detail::InputPointers& ptrs, void* out) const;

  // The producer's row blocks (fixed by the shapes, not by the thread count), each
  // followed at once by the epilogue while it is still in cache.
  void run_with_producer(ExecContext& ctx, const detail::InputPointers& ptrs, void* out);

  double producer_cost() const { return inputs()[fused_slot_]->cost_per_element(); }

  static expr::Layout layout_of(const Shape& out, const NodeList& inputs);

  KernelRef kernel_;
  bool can_stream_;
  expr::Layout layout_;
  int fused_slot_ = -1;
};

/// A pending node running `kernel` (made with `new`, adopted at once) writing `dtype` of
/// `shape` on `device`, not yet submitted. Not a template: the node's allocation and the
/// kernel reference's release are compiled once, not in every expression's builder
/// (the kernel comes as a pointer and the inputs by reference, so that no call site holds
/// a cleanup of its own).
LAZYTENSOR_INLINE NodePtr make_elementwise_node(const ElementwiseKernel* kernel, bool can_stream, DType dtype,
                                                const Shape& shape, Device* device, NodeList&& inputs);

/// A pending-node-to-be for kernel-form expression `k` writing Tout of `shape` on `device`
/// (not yet submitted).
template <Element Tout, class K, bool Lean = false>
NodePtr elementwise_node(K k, const Shape& shape, Device* device, NodeList&& inputs) {
  using CK = CompiledKernel<K, Tout, Lean>;
  return make_elementwise_node(new CK(std::move(k)), CK::can_stream, dtype_of<Tout>(), shape, device,
                               std::move(inputs));
}

}  // namespace lazy::graph

#if LAZYTENSOR_HEADER_DEFINITIONS
namespace lazy::graph {

LAZYTENSOR_INLINE RowProducer::Session::Session(RowProducer& p, ExecContext& ctx) : p_(p) { p_.begin_rows(ctx); }

LAZYTENSOR_INLINE RowProducer::Session::~Session() { p_.end_rows(); }

LAZYTENSOR_INLINE NodePtr make_elementwise_node(const ElementwiseKernel* kernel, bool can_stream, DType dtype,
                                                const Shape& shape, Device* device, NodeList&& inputs) {
  KernelRef ref(kernel);  // first: owned from here on, whatever throws below
  return core::make_cached<ElementwiseNode>(std::move(ref), can_stream, dtype, shape, device, std::move(inputs));
}

LAZYTENSOR_INLINE ElementwiseNode::ElementwiseNode(KernelRef kernel,
  bool can_stream,
  DType dtype,
  Shape shape,
  Device* device,
  NodeList inputs)
    : Node(NodeKind::Elementwise, dtype, shape, device, std::move(inputs)), kernel_(std::move(kernel)),
      can_stream_(can_stream), layout_(layout_of(this->shape(), this->inputs())) {}

LAZYTENSOR_INLINE expr::Layout ElementwiseNode::layout_of(const Shape& out, const NodeList& inputs) {
  core::SmallVector<const Shape*, 8> shapes;  // (no allocation for up to 8 inputs)
  for (const auto& in : inputs) shapes.push_back(&in->shape());
  return expr::make_layout(out, std::span<const Shape* const>(shapes.data(), shapes.size()));
}

LAZYTENSOR_INLINE void ElementwiseNode::fuse_producers() {
  // Take over a GEMM producer that nothing else reads: it then runs in row blocks, each
  // followed at once by this epilogue while the block is still in cache.
  fused_slot_ = -1;
  const auto& ins = inputs();
  for (std::size_t i = 0; i < ins.size(); ++i) {
    if (ins[i]->kind() != NodeKind::Gemm) continue;
    auto* rp = dynamic_cast<RowProducer*>(ins[i].get());
    // Rows are the epilogue's last dim: they must be the producer's rows.
    if (!rp || !ins[i]->pending() || ins[i]->dtype() != dtype() || !(ins[i]->shape() == shape()) ||
        shape().rank() < 1 || shape()[shape().rank() - 1] != rp->row_width() ||
        !(layout_.flat() || layout_.inner() == shape()[shape().rank() - 1]))
      continue;
    long holders = 0;
    for (const auto& p : ins) holders += (p == ins[i]);
    if (ins[i].use_count() != holders + 1) continue;  // + 1: the plan's reference
    ins[i]->set_deferred(true);
    fused_slot_ = static_cast<int>(i);
    return;
  }
}

LAZYTENSOR_INLINE void ElementwiseNode::compute(ExecContext& ctx) {
  const auto& ins = inputs();
  detail::InputPointers ptrs;
  ptrs.resize_for_overwrite(ins.size());
  for (std::size_t i = 0; i < ins.size(); ++i) {
    ptrs[i] = static_cast<int>(i) == fused_slot_ ? nullptr : ins[i]->buffer()->data();
  }
  auto buf = allocate_output(ctx, fused_slot_ < 0);
  void* out = buf->data();
  if (fused_slot_ >= 0) {
    ptrs[fused_slot_] = out;  // the epilogue reads the GEMM block in place
    run_with_producer(ctx, ptrs, out);
  } else {
    run(ctx, ptrs, out);
  }
  set_buffer(std::move(buf));
}

LAZYTENSOR_INLINE void ElementwiseNode::finish() {
  fused_slot_ = -1;
  Node::finish();
}

LAZYTENSOR_INLINE void ElementwiseNode::run(ExecContext& ctx, const detail::InputPointers& ptrs, void* out) const {
  const std::int64_t n = numel();
  if (n == 0) return;
  auto& pool = ctx.device.threads();
  const double cost = kernel_->cost();
  const std::int64_t tasks = task_count(pool, n, cost);
  if (layout_.flat()) {
    const bool contig = !layout_.any_splat();
    const std::int64_t bytes = n * static_cast<std::int64_t>(dtype_size(dtype()));
    const bool stream = can_stream_ && contig && bytes >= core::tuning().streaming_store_bytes;
    pool.parallel_for(tasks, [&](std::int64_t t) {
      auto [b, e] = task_range(n, tasks, t, kPadElements);
      kernel_->flat(ptrs.data(), layout_.splat.data(), out, b, e, contig, stream);
      if (stream) expr::store_fence();
    });
  } else {
    const std::int64_t rows = n / layout_.inner();
    const std::int64_t rtasks = std::min(tasks, rows);
    pool.parallel_for(rtasks, [&](std::int64_t t) {
      auto [r0, r1] = task_range(rows, rtasks, t);
      kernel_->rows(ptrs.data(), layout_, out, r0, r1);
    });
  }
}

LAZYTENSOR_INLINE void ElementwiseNode::run_with_producer(ExecContext& ctx, const detail::InputPointers& ptrs, void* out) {
  auto* producer = dynamic_cast<RowProducer*>(inputs()[fused_slot_].get());
  const std::int64_t cols = shape()[shape().rank() - 1];
  const std::int64_t rows = cols ? numel() / cols : 0;
  if (rows == 0) return;
  auto& pool = ctx.device.threads();
  const std::int64_t block = std::max<std::int64_t>(1, producer->row_block());
  const std::int64_t blocks = (rows + block - 1) / block;
  const std::int64_t tasks = std::min(blocks, std::max<std::int64_t>(1, task_count(pool, numel(), producer_cost())));
  const bool contig = !layout_.any_splat();
  RowProducer::Session session(*producer, ctx);
  pool.parallel_for(tasks, [&](std::int64_t t) {
    auto [b0, b1] = task_range(blocks, tasks, t);
    for (std::int64_t b = b0; b < b1; ++b) {
      const std::int64_t r0 = b * block, r1 = std::min(rows, r0 + block);
      producer->produce_rows(out, r0, r1);
      if (layout_.flat()) kernel_->flat(ptrs.data(), layout_.splat.data(), out, r0 * cols, r1 * cols, contig, false);
      else kernel_->rows(ptrs.data(), layout_, out, r0, r1);  // inner == cols (fuse_producers)
    }
  });
  inputs()[fused_slot_]->set_deferred(false);
}

}  // namespace lazy::graph
#endif  // LAZYTENSOR_HEADER_DEFINITIONS
