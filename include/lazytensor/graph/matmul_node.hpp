#pragma once
// GemmNode, the node behind matmul, linear and bmm: a batch of row-major products, on the
// packed kernel (graph/gemm_kernel.hpp) for float and double products of at least a register
// tile and on Eigen otherwise, produced in row blocks so that an element-wise consumer can
// run on each block while it is in cache (RowProducer, ElementwiseNode::fuse_producers).

#include <algorithm>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>

#include <lazytensor/graph/eigen_gemm.hpp>
#include <lazytensor/graph/elementwise_node.hpp>
#include <lazytensor/graph/gemm_kernel.hpp>
#include <lazytensor/graph/gemm_kernel_bf16.hpp>

namespace lazy::graph {

/// An operand as a GEMM reads it.
struct GemmOperand {
  NodePtr node;
  bool transposed;  ///< the node holds [.., cols, rows] and is read transposed
};

/// What the SPMD partitioner needs of a product: its operands' layouts and sizes, and the
/// same product over blocks.
class BlockGemm {
 public:
  virtual ~BlockGemm() = default;
  virtual bool a_transposed() const = 0;
  virtual bool b_transposed() const = 0;
  virtual std::int64_t batch_a() const = 0;
  virtual std::int64_t batch_b() const = 0;
  virtual std::int64_t rows() const = 0;
  virtual std::int64_t depth() const = 0;
  virtual std::int64_t cols() const = 0;
  /// True for a bfloat16 product (operands and result rounded to bfloat16).
  virtual bool bf16() const = 0;
  /// The product of [m, k] and [k, n] blocks (batches of `batch_a` and `batch_b` of them,
  /// 1 broadcasting), of shape `out`, on `device`, not submitted. `partial`: a partial sum
  /// over a block of k, whose bfloat16 result is left unrounded (the sum of the partials is
  /// rounded once).
  virtual NodePtr with_operands(GemmOperand a, GemmOperand b, std::int64_t m, std::int64_t k, std::int64_t n,
                                Shape out, Device* device, bool partial = false, std::int64_t batch_a = 1,
                                std::int64_t batch_b = 1) const = 0;
};

/// C[b] = op(A[b]) * op(B[b]) for a batch of row-major matrices; op is identity or
/// transpose. A batch count of 1 on either side broadcasts.
template <Element T>
class GemmNode final : public Node, public RowProducer, public BlockGemm {
 public:
  using Operand = GemmOperand;

  /// `bf16`: the product in bfloat16 (float only): operands rounded to bfloat16 as they are
  /// packed, float accumulation, the result rounded to bfloat16 (graph/gemm_kernel_bf16.hpp)
  /// unless `round_result` is false (a partial sum over a block of k). `packed_kernel`: on
  /// the packed kernel whatever the shapes (a block of a product that runs there, so that
  /// its bits are the whole product's).
  GemmNode(Operand a, Operand b, std::int64_t batch_a, std::int64_t batch_b, std::int64_t m, std::int64_t k,
           std::int64_t n, Shape out_shape, Device* device, bool bf16 = false, bool round_result = true,
           bool packed_kernel = false)
      : Node(NodeKind::Gemm, dtype_of<T>(), out_shape, device, {a.node, b.node}), ta_(a.transposed),
        tb_(b.transposed), bf16_(bf16), round_(bf16 && round_result), force_packed_(packed_kernel),
        batch_a_(batch_a), batch_b_(batch_b), m_(m), k_(k), n_(n) {
    if (bf16 && !std::is_same_v<T, float>)
      throw DTypeError("matmul: a bfloat16 product takes float operands, got " + dtype_name(dtype_of<T>()));
  }

  bool a_transposed() const override { return ta_; }
  bool b_transposed() const override { return tb_; }
  std::int64_t batch_a() const override { return batch_a_; }
  std::int64_t batch_b() const override { return batch_b_; }
  std::int64_t rows() const override { return m_; }
  std::int64_t depth() const override { return k_; }
  std::int64_t cols() const override { return n_; }
  bool bf16() const override { return bf16_; }
  NodePtr with_operands(GemmOperand a, GemmOperand b, std::int64_t m, std::int64_t k, std::int64_t n, Shape out,
                        Device* device, bool partial, std::int64_t batch_a, std::int64_t batch_b) const override {
    // The blocks run on the whole product's kernel: the packed kernel's sums do not depend
    // on the rows, Eigen's would differ from it.
    return std::make_shared<GemmNode>(std::move(a), std::move(b), batch_a, batch_b, m, k, n, out, device, bf16_,
                                      !partial, packed());
  }

  std::string op_name() const override { return "matmul"; }
  std::string describe() const override {
    return std::string("matmul(%0") + (ta_ ? "^T" : "") + ", %1" + (tb_ ? "^T" : "") + ") [" + std::to_string(m_) +
           "x" + std::to_string(k_) + "] x [" + std::to_string(k_) + "x" + std::to_string(n_) + "]" +
           (bf16_ ? (round_ ? " in bfloat16" : " in bfloat16, unrounded") : "");
  }
  double cost_per_element() const override { return 2.0 * static_cast<double>(k_); }
  std::uint64_t structural_hash() const override {
    return hash_combine(Node::structural_hash(), (ta_ ? 1u : 0u) | (tb_ ? 2u : 0u) | (bf16_ ? 4u : 0u) | (round_ ? 8u : 0u) | (force_packed_ ? 16u : 0u));
  }

  /// Rows per block. Eigen's blocking (and so the order of its k-sums) depends on the rows
  /// of a call, so blocks are fixed by the shapes alone; each Eigen call re-packs the
  /// right-hand side, so its blocks are as tall as the epilogue's cache allows (128 rows).
  /// The packed kernel's sums do not depend on the blocks and it packs the right-hand side
  /// once, so its blocks are shorter: 64 rows (even splits of common batches over threads)
  /// rounded up to whole register tiles, 66 on the 6-row tiles of AVX2 and SSE2, so that only
  /// a product's last block ends in a partial tile (256 rows: 43 tiles in blocks of 66, 44
  /// in blocks of 64, four of them partial). A small product is one block.
  std::int64_t row_width() const override { return n_; }
  std::int64_t row_block() const override {
    const std::int64_t rows = output_rows();
    if (rows * n_ * k_ <= (std::int64_t(1) << 16)) return std::max<std::int64_t>(rows, 1);
    if (!packed()) return 128;
    const std::int64_t tile = bf16_ && Bf16Kernel::native() ? 8 : Kernel::kTileRows;
    return (64 + tile - 1) / tile * tile;
  }

  /// Packs the right-hand side of every batch for the packed kernel (nothing for Eigen).
  void begin_rows(ExecContext& ctx) override {
    if (!packed()) return;
    if constexpr (std::is_same_v<T, float>) {
      if (bf16_) {
        pack_b_in_tasks<Bf16Kernel>(ctx, Bf16Kernel::packed_bytes(k_, n_));
        return;
      }
    }
    if constexpr (kHasPackedKernel) {
      pack_b_in_tasks<Kernel>(ctx, Kernel::packed_size(k_, n_) * std::int64_t(sizeof(T)));
    }
  }
  void end_rows() override { packed_b_.reset(); }

  void produce_rows(void* out, std::int64_t r0, std::int64_t r1) override {
    T* c = static_cast<T*>(out);
    const T* a = inputs()[0]->template data<T>();
    const T* b = inputs()[1]->template data<T>();
    const std::int64_t block = row_block();
    const bool use_packed = packed();
    if (use_packed && !packed_b_)
      throw std::logic_error("matmul: rows produced outside begin_rows/end_rows");
    // Rows of the output run over (batch, m); a range may span several batches. Calls are
    // cut at block boundaries and batch ends only (see row_block).
    while (r0 < r1) {
      const std::int64_t bi = r0 / m_, row = r0 % m_;
      const std::int64_t rows = std::min({r1 - r0, m_ - row, (r0 / block + 1) * block - r0});
      const T* ab = a + (batch_a_ == 1 ? 0 : bi) * m_ * k_;
      if constexpr (std::is_same_v<T, float>) {
        if (bf16_ && use_packed) {  // k == 0 is Eigen's (zeros)
          const auto* pb = static_cast<const unsigned char*>(packed_b_->data()) +
                           (batch_b_ == 1 ? 0 : bi) * Bf16Kernel::packed_bytes(k_, n_);
          Bf16Kernel::multiply(ab, ta_, m_, k_, n_, pb, c + r0 * n_, row, rows, round_);
          r0 += rows;
          continue;
        }
      }
      if constexpr (kHasPackedKernel) {
        if (use_packed) {
          const T* pb = static_cast<const T*>(packed_b_->data()) +
                        (batch_b_ == 1 ? 0 : bi) * Kernel::packed_size(k_, n_);
          Kernel::multiply(ab, ta_, m_, k_, n_, pb, c + r0 * n_, row, rows);
          r0 += rows;
          continue;
        }
      }
      gemm_block(ab, b + (batch_b_ == 1 ? 0 : bi) * k_ * n_, c + r0 * n_, row, rows);
      r0 += rows;
    }
  }

 protected:
  void compute(ExecContext& ctx) override {
    auto buf = allocate_output(ctx, false);
    auto& pool = ctx.device.threads();
    const std::int64_t rows = output_rows();
    if (n_ == 0 || rows == 0) {
      set_buffer(std::move(buf));
      return;
    }
    if (k_ == 0) {
      std::fill_n(static_cast<T*>(buf->data()), rows * n_, T(0));
      set_buffer(std::move(buf));
      return;
    }
    // Whole blocks per task (row_block): the same GEMM calls whatever the thread count.
    const std::int64_t block = row_block(), blocks = row_blocks(), tasks = row_tasks(pool);
    void* out = buf->data();
    {
      RowProducer::Session session(*this, ctx);
      pool.parallel_for(tasks, [&](std::int64_t t) {
        auto [b0, b1] = task_range(blocks, tasks, t);
        produce_rows(out, b0 * block, std::min(rows, b1 * block));
      });
    }
    set_buffer(std::move(buf));
  }

 private:
  static constexpr bool kHasPackedKernel = std::is_same_v<T, float> || std::is_same_v<T, double>;
  using Kernel = lazy::detail::PackedGemm<std::conditional_t<kHasPackedKernel, T, float>>;

  using Bf16Kernel = lazy::detail::Bf16Gemm;

  /// True when this product runs on a packed kernel (decided by dtype and shapes only;
  /// bfloat16 products always do: Eigen has no bfloat16 GEMM with float accumulation).
  bool packed() const {
    if (bf16_) return k_ > 0;
    if constexpr (kHasPackedKernel)
      return k_ > 0 && (force_packed_ || Kernel::suits(output_rows(), n_));
    else
      return false;
  }

  // Rows [row, row + rows) of op(A) * op(B) for one batch, into c (already offset).
  void gemm_block(const T* a, const T* b, T* c, std::int64_t row, std::int64_t rows) const {
    if constexpr (std::is_same_v<T, bool> || std::is_same_v<T, bfloat16>) {
      throw DTypeError("matmul: no product of " + dtype_name(dtype_of<T>()) + " values");  // ops/matmul.hpp refuses first
    } else {
      detail::eigen_gemm_rows(a, b, c, ta_, tb_, m_, k_, n_, row, rows);
    }
  }

  // Rows of the output: m of every batch.
  std::int64_t output_rows() const { return m_ * std::max(batch_a_, batch_b_); }
  // Row blocks of the output, row_block each.
  std::int64_t row_blocks() const {
    const std::int64_t block = row_block();
    return (output_rows() + block - 1) / block;
  }
  // Tasks the product's rows run as: whole blocks each, as many as its cost earns.
  std::int64_t row_tasks(const ThreadPool& pool) const {
    return std::max<std::int64_t>(1, std::min(task_count(pool, output_rows() * n_, cost_per_element()), row_blocks()));
  }

  // Packs op(B) of every batch (`bytes` each) with `Kernel`, panels split over the pool.
  template <class Kernel>
  void pack_b_in_tasks(ExecContext& ctx, std::int64_t bytes) {
    const std::int64_t panels = Kernel::panels(n_), jobs = batch_b_ * panels;
    packed_b_ = ctx.device.pool().acquire(padded_bytes(batch_b_ * bytes, 1));
    auto* out = static_cast<unsigned char*>(packed_b_->data());
    const T* b = inputs()[1]->template data<T>();
    auto& pool = ctx.device.threads();
    // As many tasks as the product's rows get (its workers are woken for them anyway), or
    // more when the packing alone is worth them: a 784 x 256 op(B) packs in 20-40 us, which
    // on one thread left the others idle before every product of the MLP step.
    const std::int64_t tasks = std::min(jobs, std::max(row_tasks(pool), task_count(pool, batch_b_ * k_ * n_, 1.0)));
    pool.parallel_for(tasks, [&](std::int64_t t) {
      auto [q0, q1] = task_range(jobs, tasks, t);
      // One call per batch the task's panels fall in (pack_b reads rows across them).
      for (std::int64_t q = q0; q < q1;) {
        const std::int64_t bi = q / panels, p = q % panels, count = std::min(q1 - q, panels - p);
        void* dst = out + bi * bytes;
        if constexpr (std::is_same_v<Kernel, Bf16Kernel>) {
          Kernel::pack_b(b + bi * k_ * n_, tb_, k_, n_, dst, p, p + count);
        } else {
          Kernel::pack_b(b + bi * k_ * n_, tb_, k_, n_, static_cast<T*>(dst), p, p + count);
        }
        q += count;
      }
    });
  }

  bool ta_, tb_, bf16_, round_, force_packed_;
  std::int64_t batch_a_, batch_b_, m_, k_, n_;
  std::shared_ptr<Buffer> packed_b_;  ///< op(B) packed, between begin_rows and end_rows
};

}  // namespace lazy::graph
