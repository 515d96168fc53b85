#pragma once
// The kernels behind conv2d: im2col, its adjoint col2im (Caffe's layout), and the weight
// gradient (ConvWeightGradNode, at the end).
//
// im2col turns an image x [N, C, H, W] into columns [N, C*kh*kw, OH*OW]: row (c, i, j) of
// image n holds, for every output position, the input value under kernel tap (i, j) of
// channel c (zero where the tap falls into padding). A convolution is then one GEMM per
// image with the weight viewed as [O, C*kh*kw], and its output is already in NCHW order.
//
// col2im adds columns back into an image (the gradient of im2col). Each task owns whole
// (n, c) planes and adds the taps of a plane in a fixed order (i, j, output row, output
// column), so no two tasks write the same element and the sums do not depend on the
// thread count.

#include <algorithm>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include <lazytensor/graph/device.hpp>
#include <lazytensor/graph/eigen_gemm.hpp>
#include <lazytensor/graph/parallel.hpp>
#include <lazytensor/graph/window.hpp>

namespace lazy::graph {

namespace detail {

/// The kh*kw column rows of one channel plane `x` (h x w) into `rows` ([kh*kw, oh*ow]).
template <class T>
void im2col_plane(const T* x, T* rows, const Window2d& g) {
  const std::int64_t L = g.oh * g.ow;
  for (std::int64_t i = 0; i < g.kh; ++i) {
    const auto [y0, y1] = g.valid_rows(i);
    for (std::int64_t j = 0; j < g.kw; ++j) {
      T* row = rows + (i * g.kw + j) * L;
      const auto [x0, x1] = g.valid_columns(j);
      std::fill(row, row + y0 * g.ow, T(0));
      for (std::int64_t oy = y0; oy < y1; ++oy) {
        T* out = row + oy * g.ow;
        std::fill(out, out + x0, T(0));
        std::fill(out + x1, out + g.ow, T(0));
        if (x0 == x1) continue;  // (src below would point outside the plane)
        const T* src = x + (oy * g.sh - g.ph + i * g.dh) * g.w + (x0 * g.sw - g.pw + j * g.dw);
        if (g.sw == 1) {
          std::copy(src, src + (x1 - x0), out + x0);
        } else {
          for (std::int64_t ox = x0; ox < x1; ++ox) out[ox] = src[(ox - x0) * g.sw];
        }
      }
      std::fill(row + y1 * g.ow, row + L, T(0));
    }
  }
}

/// Adds the kh*kw column rows `rows` ([kh*kw, oh*ow]) of one channel into plane `x`
/// (h x w), which the caller zeroed.
template <class T>
void col2im_plane(const T* rows, T* x, const Window2d& g) {
  const std::int64_t L = g.oh * g.ow;
  for (std::int64_t i = 0; i < g.kh; ++i) {
    const auto [y0, y1] = g.valid_rows(i);
    for (std::int64_t j = 0; j < g.kw; ++j) {
      const T* row = rows + (i * g.kw + j) * L;
      const auto [x0, x1] = g.valid_columns(j);
      if (x0 == x1) continue;
      for (std::int64_t oy = y0; oy < y1; ++oy) {
        const T* in = row + oy * g.ow;
        T* dst = x + (oy * g.sh - g.ph + i * g.dh) * g.w + (x0 * g.sw - g.pw + j * g.dw);
        if (g.sw == 1) {
          for (std::int64_t ox = x0; ox < x1; ++ox) dst[ox - x0] += in[ox];
        } else {
          for (std::int64_t ox = x0; ox < x1; ++ox) dst[(ox - x0) * g.sw] += in[ox];
        }
      }
    }
  }
}

/// Tasks for `planes` independent planes of `per_plane` elements each costing `cost`.
inline std::int64_t plane_tasks(ThreadPool& pool, std::int64_t planes, std::int64_t per_plane,
                                double cost) {
  return std::max<std::int64_t>(1, std::min(planes, task_count(pool, planes * per_plane, cost)));
}

}  // namespace detail

/// Columns [N, C*kh*kw, OH*OW] of images [N, C, H, W] (see the header comment).
template <class T>
class Im2colNode final : public Node {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, double>,
                "im2col runs on float or double");

 public:
  Im2colNode(NodePtr x, const Window2d& g)
      : Node(NodeKind::Copy, dtype_of<T>(),
             Shape{x->shape()[0], x->shape()[1] * g.kh * g.kw, g.oh * g.ow}, x->device(), {x}),
        g_(g) {}
  std::string op_name() const override { return "im2col"; }
  std::string describe() const override { return "im2col(%0, " + g_.str() + ")"; }
  std::uint64_t structural_hash() const override { return g_.hash(Node::structural_hash()); }
  /// Image by image (lazy::spmd splits the batch).
  std::optional<BlockRule> block_rule() const override { return leading_dims_rule(3, 1, 1); }
  NodePtr with_inputs(NodeList inputs, Shape, Device*) const override {
    return std::make_shared<Im2colNode>(std::move(inputs[0]), g_);
  }

 protected:
  void compute(ExecContext& ctx) override {
    const T* x = inputs()[0]->template data<T>();
    const std::int64_t planes = shape()[0] * inputs()[0]->shape()[1];
    auto buf = allocate_output(ctx, false);
    T* cols = static_cast<T*>(buf->data());
    const std::int64_t in_plane = g_.h * g_.w, out_plane = g_.kh * g_.kw * g_.oh * g_.ow;
    auto& pool = ctx.device.threads();
    const std::int64_t tasks = detail::plane_tasks(pool, planes, out_plane, 1.0);
    pool.parallel_for(tasks, [&](std::int64_t t) {
      auto [p0, p1] = task_range(planes, tasks, t);
      for (std::int64_t p = p0; p < p1; ++p)
        detail::im2col_plane(x + p * in_plane, cols + p * out_plane, g_);
    });
    set_buffer(std::move(buf));
  }

 private:
  Window2d g_;
};

/// Images [N, C, H, W] summed from columns [N, C*kh*kw, OH*OW] (the adjoint of im2col).
template <class T>
class Col2imNode final : public Node {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, double>,
                "col2im runs on float or double");

 public:
  Col2imNode(NodePtr cols, Shape image, const Window2d& g)
      : Node(NodeKind::Copy, dtype_of<T>(), image, cols->device(), {cols}), g_(g) {}
  std::string op_name() const override { return "col2im"; }
  std::string describe() const override { return "col2im(%0, " + g_.str() + ")"; }
  std::uint64_t structural_hash() const override { return g_.hash(Node::structural_hash()); }
  /// Image by image.
  std::optional<BlockRule> block_rule() const override { return leading_dims_rule(4, 1, 1); }
  NodePtr with_inputs(NodeList inputs, Shape shape, Device*) const override {
    return std::make_shared<Col2imNode>(std::move(inputs[0]), std::move(shape), g_);
  }
  double cost_per_element() const override {
    return std::max(
        1.0, static_cast<double>(g_.kh * g_.kw * g_.oh * g_.ow) / static_cast<double>(g_.h * g_.w));
  }

 protected:
  void compute(ExecContext& ctx) override {
    const T* cols = inputs()[0]->template data<T>();
    const std::int64_t planes = shape()[0] * shape()[1];
    auto buf = allocate_output(ctx, false);
    T* x = static_cast<T*>(buf->data());
    const std::int64_t in_plane = g_.kh * g_.kw * g_.oh * g_.ow, out_plane = g_.h * g_.w;
    auto& pool = ctx.device.threads();
    const std::int64_t tasks =
        detail::plane_tasks(pool, planes, out_plane, cost_per_element());
    pool.parallel_for(tasks, [&](std::int64_t t) {
      auto [p0, p1] = task_range(planes, tasks, t);
      for (std::int64_t p = p0; p < p1; ++p) {
        T* plane = x + p * out_plane;
        std::fill(plane, plane + out_plane, T(0));
        detail::col2im_plane(cols + p * in_plane, plane, g_);
      }
    });
    set_buffer(std::move(buf));
  }

 private:
  Window2d g_;
};

/// What the SPMD partitioner needs of a sum over a batch: the node's value is the sum over
/// dimension 0 of its inputs (which all have it first) of per-item results.
class BlockBatchSum {
 public:
  virtual ~BlockBatchSum() = default;
  /// The same op over `inputs` (blocks of this node's inputs along dimension 0) on
  /// `device`, not submitted.
  virtual NodePtr with_batch(NodeList inputs, Device* device) const = 0;
};

/// The weight gradient of a convolution: dW [O, K] = sum over n of G[n] [O, L] x cols[n]^T,
/// with G [N, O, L] and cols [N, K, L]. The transposes are read through (Eigen layouts) and
/// the images are added in order. dW is computed in blocks of kBlock columns, each with its
/// own GEMM calls (which pack only that block's rows of cols); tasks take whole blocks. The
/// blocks depend on K only: Eigen's kernels sum in an order that depends on the shape of the
/// call, so splitting by thread count would change the bits.
template <class T>
class ConvWeightGradNode final : public Node, public BlockBatchSum {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, double>,
                "conv weight gradients run on float or double");

 public:
  static constexpr std::int64_t kBlock = 64;

  ConvWeightGradNode(NodePtr g, NodePtr cols)
      : Node(NodeKind::Gemm, dtype_of<T>(), Shape{g->shape()[1], cols->shape()[1]}, g->device(),
             {g, cols}) {}
  std::string op_name() const override { return "conv2d_weight_grad"; }
  NodePtr with_batch(NodeList inputs, Device*) const override {
    return std::make_shared<ConvWeightGradNode>(std::move(inputs[0]), std::move(inputs[1]));
  }
  double cost_per_element() const override {
    return 2.0 * static_cast<double>(inputs()[0]->shape()[0] * inputs()[0]->shape()[2]);
  }

 protected:
  void compute(ExecContext& ctx) override {
    const T* g = inputs()[0]->template data<T>();
    const T* cols = inputs()[1]->template data<T>();
    const std::int64_t N = inputs()[0]->shape()[0], O = shape()[0], K = shape()[1],
                       L = inputs()[0]->shape()[2];
    auto buf = allocate_output(ctx, false);
    T* out = static_cast<T*>(buf->data());
    const std::int64_t blocks = (K + kBlock - 1) / kBlock;
    auto& pool = ctx.device.threads();
    const std::int64_t tasks =
        std::max<std::int64_t>(1, std::min(blocks, task_count(pool, O * K, cost_per_element(), 1)));
    pool.parallel_for(tasks, [&](std::int64_t t) {
      auto [b0, b1] = task_range(blocks, tasks, t);
      for (std::int64_t blk = b0; blk < b1; ++blk) {
        const std::int64_t k0 = blk * kBlock, k1 = std::min(K, k0 + kBlock);
        for (std::int64_t o = 0; o < O; ++o) std::fill(out + o * K + k0, out + o * K + k1, T(0));
        for (std::int64_t n = 0; n < N; ++n) {
          detail::eigen_gemm_add_nt(g + n * O * L, cols + (n * K + k0) * L, out + k0, O, k1 - k0, L, K);
        }
      }
    });
    set_buffer(std::move(buf));
  }
};

}  // namespace lazy::graph
