#pragma once
// The graph node of a fused element-wise kernel: one expression, one output, one pass.

#include <cstdint>
#include <string>
#include <typeinfo>
#include <vector>

#include <lazytensor/core/counters.hpp>
#include <lazytensor/expr/evaluator.hpp>
#include <lazytensor/expr/layout.hpp>
#include <lazytensor/graph/device.hpp>
#include <lazytensor/graph/parallel.hpp>

namespace lazy::graph {

/// A producer whose rows a consumer can compute block by block into its own buffer
/// (GEMM feeding an element-wise epilogue).
class RowProducer {
 public:
  virtual ~RowProducer() = default;
  /// Writes rows [r0, r1) of this node's value (viewed as rows x last dim) into `out`,
  /// a buffer laid out like this node's value. Runs on the calling thread only.
  virtual void produce_rows(void* out, std::int64_t r0, std::int64_t r1) = 0;
};

/// Evaluates kernel-form expression K into a tensor of type Tout.
template <class K, Element Tout>
class ElementwiseNode final : public Node {
 public:
  using S = expr::kernel_lane_t<K>;

  ElementwiseNode(K kernel, Shape shape, Device* device, std::vector<NodePtr> inputs)
      : Node(NodeKind::Elementwise, dtype_of<Tout>(), shape, device, std::move(inputs)),
        kernel_(std::move(kernel)) {
    std::vector<Shape> shapes;
    for (const auto& in : this->inputs()) shapes.push_back(in->shape());
    layout_ = expr::make_layout(shape, shapes);
  }

  std::string op_name() const override { return "fused"; }
  std::string describe() const override { return expr::kernel_text(kernel_); }
  double cost_per_element() const override { return expr::kernel_cost<K>(); }
  std::uint64_t structural_hash() const override {
    return hash_combine(hash_combine(Node::structural_hash(), typeid(K).hash_code()),
                        expr::scalar_classes(kernel_));
  }
  const expr::Layout& layout() const { return layout_; }

  void fuse_producers() override {
    // Take over a GEMM producer that nothing else reads: it then runs in row blocks, each
    // followed at once by this epilogue while the block is still in cache.
    const auto& ins = inputs();
    for (std::size_t i = 0; i < ins.size(); ++i) {
      if (ins[i]->kind() != NodeKind::Gemm) continue;
      auto* rp = dynamic_cast<RowProducer*>(ins[i].get());
      if (!rp || ins[i]->materialized() || ins[i]->dtype() != dtype() || !(ins[i]->shape() == shape()) ||
          shape().rank() < 1 || !(layout_.flat() || layout_.inner() == shape()[shape().rank() - 1]))
        continue;
      long holders = 0;
      for (const auto& p : ins) holders += (p == ins[i]);
      if (ins[i].use_count() != holders + 1) continue;  // + 1: the plan's reference
      ins[i]->set_deferred(true);
      fused_slot_ = static_cast<int>(i);
      return;
    }
  }

 protected:
  void compute(ExecContext& ctx) override {
    const auto& ins = inputs();
    std::vector<const void*> ptrs(ins.size());
    for (std::size_t i = 0; i < ins.size(); ++i) {
      ptrs[i] = static_cast<int>(i) == fused_slot_ ? nullptr : ins[i]->buffer()->data();
    }
    auto buf = allocate_output(ctx, fused_slot_ < 0);
    Tout* out = static_cast<Tout*>(buf->data());
    if (fused_slot_ >= 0) {
      ptrs[fused_slot_] = out;  // the epilogue reads the GEMM block in place
      run_with_producer(ctx, ptrs, out);
    } else {
      run(ctx, ptrs, out);
    }
    set_buffer(std::move(buf));
  }

  void finish() override {
    fused_slot_ = -1;
    Node::finish();
  }

 private:
  void run(ExecContext& ctx, const std::vector<const void*>& ptrs, Tout* out) const {
    const std::int64_t n = numel();
    if (n == 0) return;
    auto& pool = ctx.device.threads();
    const double cost = expr::kernel_cost<K>();
    if (layout_.flat()) {
      const std::int64_t tasks = task_count(pool, n, cost);
      const bool contig = !layout_.any_splat();
      const bool stream = n * static_cast<std::int64_t>(sizeof(Tout)) >= expr::kStreamingStoreBytes;
      pool.parallel_for(tasks, [&](std::int64_t t) {
        auto [b, e] = task_range(n, tasks, t, kPadElements);
        expr::Evaluator<S, K> ev(kernel_, ptrs.data(), layout_.splat.data());
        if (stream) {
          if (contig) expr::eval_flat_range<S, Tout, true, decltype(ev), true>(ev, out, b, e, n);
          else expr::eval_flat_range<S, Tout, false, decltype(ev), true>(ev, out, b, e, n);
          expr::store_fence();
        } else if (contig) {
          expr::eval_flat_range<S, Tout, true>(ev, out, b, e, n);
        } else {
          expr::eval_flat_range<S, Tout, false>(ev, out, b, e, n);
        }
      });
    } else {
      const std::int64_t rows = n / layout_.inner();
      const std::int64_t tasks = task_count(pool, n, cost);
      pool.parallel_for(std::min(tasks, rows), [&](std::int64_t t) {
        auto [r0, r1] = task_range(rows, std::min(tasks, rows), t);
        expr::Evaluator<S, K> ev(kernel_, ptrs.data(), layout_.splat.data());
        expr::eval_rows<S, Tout>(ev, layout_, out, r0, r1);
      });
    }
  }

  // Each thread runs the GEMM on its rows in as few calls as possible (every call re-packs
  // the right-hand matrix), in blocks of at most ~512 KiB of output so that the epilogue
  // rewrites them in place while they are still in L2.
  void run_with_producer(ExecContext& ctx, const std::vector<const void*>& ptrs, Tout* out) {
    auto* producer = dynamic_cast<RowProducer*>(inputs()[fused_slot_].get());
    const std::int64_t cols = shape()[shape().rank() - 1];
    const std::int64_t rows = cols ? numel() / cols : 0;
    if (rows == 0) return;
    auto& pool = ctx.device.threads();
    const std::int64_t threads = std::min<std::int64_t>(
        std::max(1, pool.size()), std::max<std::int64_t>(1, task_count(pool, numel(), producer_cost())));
    const std::int64_t row_bytes = cols * static_cast<std::int64_t>(sizeof(Tout));
    const std::int64_t by_cache = (rows * row_bytes + (512 << 10) - 1) / (512 << 10);
    const std::int64_t wanted = std::min(rows, std::max(threads, (by_cache + threads - 1) / threads * threads));
    const std::int64_t block = (rows + wanted - 1) / wanted;
    const std::int64_t blocks = (rows + block - 1) / block;
    const std::int64_t tasks = std::min(threads, blocks);
    pool.parallel_for(tasks, [&](std::int64_t t) {
      auto [b0, b1] = task_range(blocks, tasks, t);
      expr::Evaluator<S, K> ev(kernel_, ptrs.data(), layout_.splat.data());
      for (std::int64_t b = b0; b < b1; ++b) {
        const std::int64_t r0 = b * block, r1 = std::min(rows, r0 + block);
        producer->produce_rows(out, r0, r1);
        if (layout_.flat()) {
          if (layout_.any_splat()) expr::eval_flat_range<S, Tout, false>(ev, out, r0 * cols, r1 * cols, numel());
          else expr::eval_flat_range<S, Tout, true>(ev, out, r0 * cols, r1 * cols, numel());
        } else {
          expr::eval_rows<S, Tout>(ev, layout_, out, r0, r1);  // inner == cols (fuse_producers)
        }
      }
    });
    inputs()[fused_slot_]->set_deferred(false);
  }

  double producer_cost() const { return inputs()[fused_slot_]->cost_per_element(); }

  K kernel_;
  expr::Layout layout_;
  int fused_slot_ = -1;
};

}  // namespace lazy::graph
