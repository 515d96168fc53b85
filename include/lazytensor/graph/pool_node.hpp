#pragma once
// The kernels of max_pool2d and avg_pool2d, forward and backward (PoolNode and its two
// subclasses), with the per-row window loops they share. Every kernel works on whole (n, c)
// planes, one task owning a plane, one output row at a time, in a fixed order, so results
// never depend on the thread count (ops/pool.hpp describes the rules they follow).

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include <lazytensor/graph/device.hpp>
#include <lazytensor/graph/parallel.hpp>
#include <lazytensor/graph/window.hpp>
#include <lazytensor/core/config.hpp>

namespace lazy::graph {

namespace detail {

/// Calls f(base, x0, x1) for each tap (i, j) of the windows of output row oy, in row-major
/// tap order, skipping taps in the padding: output columns [x0, x1) read the input at
/// base + ox * sw (an offset into the plane).
template <class F>
void for_each_tap(const Window2d& g, std::int64_t oy, F&& f) {
  // Only the taps that can read inside the plane: a kernel much larger than the input
  // (allowed when padding keeps every window overlapping it) costs the input's size.
  const std::int64_t ys = oy * g.sh - g.ph;
  const std::int64_t i1 = std::min(g.kh, g.h - ys);
  const std::int64_t j0 = std::max<std::int64_t>(0, g.pw - (g.ow - 1) * g.sw),
                     j1 = std::min(g.kw, g.pw + g.w);
  for (std::int64_t i = std::max<std::int64_t>(0, -ys); i < i1; ++i) {
    const std::int64_t y = ys + i;
    for (std::int64_t j = j0; j < j1; ++j) {
      const auto [x0, x1] = g.valid_columns(j);
      if (x0 < x1) f(y * g.w - g.pw + j, x0, x1);
    }
  }
}

/// The maximum of each window of output row oy (NaN if the window holds one). Padding is
/// never a candidate (it acts as -inf); padding <= kernel / 2 keeps every window
/// overlapping the plane.
template <class T>
void pool_max_row(const T* plane, const Window2d& g, std::int64_t oy, T* best) {
  std::fill(best, best + g.ow, -std::numeric_limits<T>::infinity());
  for_each_tap(g, oy, [&](std::int64_t base, std::int64_t x0, std::int64_t x1) {
    for (std::int64_t ox = x0; ox < x1; ++ox) {
      const T v = plane[base + ox * g.sw];
      best[ox] = (v > best[ox] || v != v) ? v : best[ox];  // a NaN stays: nothing is > NaN
    }
  });
}

/// Where each window of output row oy has its maximum (an offset into the plane): the first
/// maximum in row-major tap order, or the first NaN (torch's rule).
template <class T>
void pool_argmax_row(const T* plane, const Window2d& g, std::int64_t oy, std::int64_t* at) {
  const std::int64_t ys = oy * g.sh - g.ph;
  const std::int64_t y0 = std::max<std::int64_t>(ys, 0), y1 = std::min(ys + g.kh, g.h);
  for (std::int64_t ox = 0; ox < g.ow; ++ox) {
    const std::int64_t xs = ox * g.sw - g.pw;
    const std::int64_t x0 = std::max<std::int64_t>(xs, 0), x1 = std::min(xs + g.kw, g.w);
    std::int64_t best = y0 * g.w + x0;
    T m = plane[best];
    for (std::int64_t y = y0; y < y1; ++y) {
      for (std::int64_t x = x0; x < x1; ++x) {
        const std::int64_t k = y * g.w + x;
        const T v = plane[k];
        // Branch-free selects on locals (the winner is data-dependent, so branches would
        // mispredict).
        const bool take = (v > m) | ((v != v) & (m == m));
        m = take ? v : m;
        best = take ? k : best;
      }
    }
    at[ox] = best;
  }
}

/// torch's divisor of window (oy, ox): kh * kw clipped to the padded plane when padding
/// counts, else the number of taps inside the plane.
std::int64_t avg_divisor(const Window2d& g, std::int64_t oy, std::int64_t ox,
                         bool count_include_pad);

/// Runs planes(p0, p1) on the device's workers, each task owning whole planes.
template <class F>
void for_planes(ExecContext& ctx, std::int64_t planes, std::int64_t elements, double cost, F&& f) {
  auto& pool = ctx.device.threads();
  const std::int64_t tasks =
      std::max<std::int64_t>(1, std::min(planes, task_count(pool, elements, cost)));
  pool.parallel_for(tasks, [&](std::int64_t t) {
    auto [p0, p1] = task_range(planes, tasks, t);
    if (p0 < p1) f(p0, p1);
  });
}

}  // namespace detail

/// Base of the pooling kernels: the window geometry, the mode, and their hash.
class PoolNode : public Node {
 public:
  PoolNode(DType dtype, Shape shape, Device* device, NodeList inputs, const Window2d& g,
           bool max, bool count_include_pad);
  LAZYTENSOR_INLINE std::uint64_t structural_hash() const override;
  LAZYTENSOR_INLINE std::string describe() const override;
  /// Work per element of the pooled output: one window.
  double window_cost() const { return static_cast<double>(g_.kh * g_.kw); }

 protected:
  Window2d g_;
  bool max_, count_include_pad_;
};

/// max_pool2d / avg_pool2d forward: [N, C, H, W] -> [N, C, OH, OW].
template <class T>
class Pool2dNode final : public PoolNode {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, double>,
                "pooling runs on float or double");

 public:
  Pool2dNode(NodePtr x, const Window2d& g, bool max, bool count_include_pad)
      : PoolNode(dtype_of<T>(), Shape{x->shape()[0], x->shape()[1], g.oh, g.ow}, x->device(), {x},
                 g, max, count_include_pad) {}
  std::string op_name() const override { return max_ ? "max_pool2d" : "avg_pool2d"; }
  double cost_per_element() const override { return window_cost(); }
  /// Plane by plane: images and channels split alike (lazy::spmd).
  std::optional<BlockRule> block_rule() const override { return leading_dims_rule(4, 2, 1); }
  NodePtr with_inputs(NodeList inputs, Shape, Device*) const override {
    return std::make_shared<Pool2dNode>(std::move(inputs[0]), g_, max_, count_include_pad_);
  }

 protected:
  void compute(ExecContext& ctx) override {
    const T* x = inputs()[0]->template data<T>();
    auto buf = allocate_output(ctx, false);
    T* y = static_cast<T*>(buf->data());
    const std::int64_t in_plane = g_.h * g_.w, out_plane = g_.oh * g_.ow;
    detail::for_planes(ctx, shape()[0] * shape()[1], numel(), cost_per_element(),
                       [&](std::int64_t p0, std::int64_t p1) {
                         for (std::int64_t p = p0; p < p1; ++p) {
                           for (std::int64_t oy = 0; oy < g_.oh; ++oy) {
                             T* row = y + p * out_plane + oy * g_.ow;
                             if (max_) {
                               detail::pool_max_row(x + p * in_plane, g_, oy, row);
                             } else {
                               average_row(x + p * in_plane, oy, row);
                             }
                           }
                         }
                       });
    set_buffer(std::move(buf));
  }

 private:
  // Window sums in row-major tap order, then the divisions.
  void average_row(const T* plane, std::int64_t oy, T* out) const {
    std::fill(out, out + g_.ow, T(0));
    detail::for_each_tap(g_, oy, [&](std::int64_t base, std::int64_t x0, std::int64_t x1) {
      for (std::int64_t ox = x0; ox < x1; ++ox) out[ox] += plane[base + ox * g_.sw];
    });
    for (std::int64_t ox = 0; ox < g_.ow; ++ox) {
      out[ox] /= static_cast<T>(detail::avg_divisor(g_, oy, ox, count_include_pad_));
    }
  }
};

/// Gradient of max_pool2d / avg_pool2d: [N, C, OH, OW] gradients -> [N, C, H, W]. Inputs:
/// the gradient, and for max pooling the forward's input (to find each window's argmax).
template <class T>
class Pool2dBackwardNode final : public PoolNode {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, double>,
                "pooling runs on float or double");

 public:
  Pool2dBackwardNode(NodePtr grad, NodePtr x, Shape image, const Window2d& g, bool max,
                     bool count_include_pad)
      : PoolNode(dtype_of<T>(), image, grad->device(),
                 x ? NodeList{grad, x} : NodeList{grad}, g, max,
                 count_include_pad) {}
  std::string op_name() const override {
    return max_ ? "max_pool2d_backward" : "avg_pool2d_backward";
  }
  /// Plane by plane, the gradient and the forward's input split alike.
  std::optional<BlockRule> block_rule() const override {
    return leading_dims_rule(4, 2, inputs().size());
  }
  NodePtr with_inputs(NodeList inputs, Shape shape, Device*) const override {
    NodePtr x = inputs.size() > 1 ? std::move(inputs[1]) : nullptr;
    return std::make_shared<Pool2dBackwardNode>(std::move(inputs[0]), std::move(x), std::move(shape), g_, max_,
                                                count_include_pad_);
  }
  double cost_per_element() const override {
    return std::max(
        1.0, window_cost() * static_cast<double>(g_.oh * g_.ow) / static_cast<double>(g_.h * g_.w));
  }

 protected:
  void compute(ExecContext& ctx) override {
    const T* gy = inputs()[0]->template data<T>();
    const T* x = max_ ? inputs()[1]->template data<T>() : nullptr;
    auto buf = allocate_output(ctx, false);
    T* dx = static_cast<T*>(buf->data());
    const std::int64_t in_plane = g_.h * g_.w, out_plane = g_.oh * g_.ow;
    // Each plane adds its output rows in order, each row's windows in tap order: a fixed
    // accumulation order per element.
    detail::for_planes(
        ctx, shape()[0] * shape()[1], numel(), cost_per_element(),
        [&](std::int64_t p0, std::int64_t p1) {
          std::vector<T> scratch(static_cast<std::size_t>(g_.ow));
          std::vector<std::int64_t> at(static_cast<std::size_t>(g_.ow));
          for (std::int64_t p = p0; p < p1; ++p) {
            T* d = dx + p * in_plane;
            std::fill(d, d + in_plane, T(0));
            for (std::int64_t oy = 0; oy < g_.oh; ++oy) {
              const T* g = gy + p * out_plane + oy * g_.ow;
              if (max_) {
                detail::pool_argmax_row(x + p * in_plane, g_, oy, at.data());
                for (std::int64_t ox = 0; ox < g_.ow; ++ox) d[at[ox]] += g[ox];
                continue;
              }
              T* share = scratch.data();
              for (std::int64_t ox = 0; ox < g_.ow; ++ox) {
                share[ox] = g[ox] / static_cast<T>(
                                        detail::avg_divisor(g_, oy, ox, count_include_pad_));
              }
              detail::for_each_tap(g_, oy,
                                   [&](std::int64_t base, std::int64_t x0, std::int64_t x1) {
                                     for (std::int64_t ox = x0; ox < x1; ++ox)
                                       d[base + ox * g_.sw] += share[ox];
                                   });
            }
          }
        });
    set_buffer(std::move(buf));
  }
};

}  // namespace lazy::graph

#if LAZYTENSOR_HEADER_DEFINITIONS
namespace lazy::graph::detail {

LAZYTENSOR_INLINE std::int64_t avg_divisor(const Window2d& g,
    std::int64_t oy,
    std::int64_t ox,
    bool count_include_pad) {
  const std::int64_t ys = oy * g.sh - g.ph, xs = ox * g.sw - g.pw;
  if (!count_include_pad) {
    return (std::min(ys + g.kh, g.h) - std::max<std::int64_t>(ys, 0)) *
           (std::min(xs + g.kw, g.w) - std::max<std::int64_t>(xs, 0));
  }
  return (std::min(ys + g.kh, g.h + g.ph) - ys) * (std::min(xs + g.kw, g.w + g.pw) - xs);
}

}  // namespace lazy::graph::detail
namespace lazy::graph {

LAZYTENSOR_INLINE PoolNode::PoolNode(DType dtype,
  Shape shape,
  Device* device,
  NodeList inputs,
  const Window2d& g,
  bool max,
  bool count_include_pad)
    : Node(NodeKind::Reduction, dtype, shape, device, std::move(inputs)),
      g_(g),
      max_(max),
      count_include_pad_(count_include_pad) {}

LAZYTENSOR_INLINE std::uint64_t PoolNode::structural_hash() const {
  return hash_combine(g_.hash(Node::structural_hash()),
                      (max_ ? 1u : 0u) | (count_include_pad_ ? 2u : 0u));
}

LAZYTENSOR_INLINE std::string PoolNode::describe() const {
  return op_name() + "(%0, " + g_.str() +
         (max_                 ? ""
          : count_include_pad_ ? ", count_include_pad"
                               : "") +
         ")";
}

}  // namespace lazy::graph
#endif  // LAZYTENSOR_HEADER_DEFINITIONS
