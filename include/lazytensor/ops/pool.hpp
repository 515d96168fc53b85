#pragma once
// max_pool2d and avg_pool2d (torch::nn::functional) and their derivative rules; the forward
// and backward kernels are in graph/pool_node.hpp.
//
// Every kernel works on whole (n, c) planes, one task owning a plane, one output row at a
// time, in a fixed order, so results never depend on the thread count. Forward kernels and
// the average pool's backward loop over the taps of the window in row-major order and, for
// each, over the row's windows (a branch-free, vectorizable inner loop). Max pooling keeps
// no index tensor: its backward recomputes each window's argmax from the saved input (the
// first maximum in row-major window order, as in torch; a NaN wins over numbers), whose
// value is the forward's maximum. Padding is -inf for max pooling (padded taps are
// skipped) and zeros for average pooling.

#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include <lazytensor/autograd/record.hpp>
#include <lazytensor/core/config.hpp>
#include <lazytensor/graph/pool_node.hpp>
#include <lazytensor/ops/shape.hpp>
#include <lazytensor/ops/window.hpp>
#include <lazytensor/tensor/tensor.hpp>

namespace lazy {

namespace detail {

/// Validated geometry of a pooling window over x ([N, C, H, W]); stride defaults to the
/// kernel, and padding may be at most half the kernel (torch's rule, which also keeps
/// every window overlapping the input).
graph::Window2d pool_window(const char* op, const Shape& x, Size2 kernel,
                                   const std::optional<Size2>& stride, Size2 padding);

/// Runs the pool on float or double tensors; bfloat16 goes through float (exact for max,
/// one rounding for the average).
template <class T, class F>
Tensor<T> pool_dispatch(const Tensor<T>& x, const char* op, F&& run) {
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double>) {
    return run(x);
  } else if constexpr (std::is_same_v<T, bfloat16>) {
    return Tensor<bfloat16>(cast<bfloat16>(run(Tensor<float>(cast<float>(x)))));
  } else {
    throw DTypeError(std::string(op) +
                     ": expected a floating tensor (float, double or bfloat16), got " +
                     dtype_name(dtype_of<T>()));
  }
}

template <class T>
Tensor<T> pool2d(const Tensor<T>& x, const graph::Window2d& g, bool max, bool count_include_pad) {
  Tensor<T> y(
      graph::submit(std::make_shared<graph::Pool2dNode<T>>(x.node(), g, max, count_include_pad)));
  autograd::record(
      y, max ? "MaxPool2DWithIndicesBackward0" : "AvgPool2DBackward0",
      {autograd::edge_of(x.impl())},
      [x = max ? x.detach() : Tensor<T>(), image = x.shape(), g, max,
       count_include_pad](const Tensor<T>& gy) {
        return graph::NodeList{
            graph::submit(std::make_shared<graph::Pool2dBackwardNode<T>>(
                gy.node(), max ? x.node() : nullptr, image, g, max, count_include_pad))};
      },
      max ? autograd::Saves::tensors : autograd::Saves::nothing);  // max pooling keeps its input
  return y;
}

}  // namespace detail

/// 2-D max pooling (torch::nn::functional::max_pool2d, no dilation or ceil_mode): input
/// [N, C, H, W] -> [N, C, OH, OW], OH = (H + 2 * padding.h - kernel.h) / stride.h + 1.
/// stride defaults to the kernel size; padding (at most half the kernel) acts as -inf.
/// Ties go to the first maximum in the window (row-major). float, double, bfloat16.
template <expr::ExprLike X>
Tensor<expr::value_t<X>> max_pool2d(const X& input, Size2 kernel_size,
                                    std::optional<Size2> stride = std::nullopt, Size2 padding = 0) {
  using T = expr::value_t<X>;
  Tensor<T> x = detail::as_tensor(input);
  const auto g = detail::pool_window("max_pool2d", x.shape(), kernel_size, stride, padding);
  return detail::pool_dispatch(x, "max_pool2d",
                               [&](const auto& t) { return detail::pool2d(t, g, true, false); });
}

/// 2-D average pooling (torch::nn::functional::avg_pool2d, no ceil_mode or
/// divisor_override): like max_pool2d, with zero padding; each window's sum is divided by
/// kernel.h * kernel.w when count_include_pad (the default), else by the number of taps
/// inside the input.
template <expr::ExprLike X>
Tensor<expr::value_t<X>> avg_pool2d(const X& input, Size2 kernel_size,
                                    std::optional<Size2> stride = std::nullopt, Size2 padding = 0,
                                    bool count_include_pad = true) {
  using T = expr::value_t<X>;
  Tensor<T> x = detail::as_tensor(input);
  const auto g = detail::pool_window("avg_pool2d", x.shape(), kernel_size, stride, padding);
  return detail::pool_dispatch(x, "avg_pool2d", [&](const auto& t) {
    return detail::pool2d(t, g, false, count_include_pad);
  });
}

}  // namespace lazy

#if LAZYTENSOR_HEADER_DEFINITIONS
namespace lazy::detail {

LAZYTENSOR_INLINE graph::Window2d pool_window(const char* op,
    const Shape& x,
    Size2 kernel,
    const std::optional<Size2>& stride,
    Size2 padding) {
  check_nchw(x, op, "input");
  if (kernel.h <= 0 || kernel.w <= 0) {
    throw ShapeError(std::string(op) + ": expected a positive kernel size, got " + kernel.str());
  }
  const Size2 s = stride.value_or(kernel);
  check_window_args(op, s, padding, 1);
  if (padding.h > kernel.h / 2 || padding.w > kernel.w / 2) {
    throw ShapeError(std::string(op) +
                     ": padding should be at most half of the kernel size, got padding " +
                     padding.str() + " for kernel " + kernel.str());
  }
  return window_over(op, x, kernel, s, padding, 1);
}

}  // namespace lazy::detail
#endif  // LAZYTENSOR_HEADER_DEFINITIONS

// Instantiated once by lazytensor::compiled (src/compiled.cpp): the pooling nodes' kernels
// and their derivative rules.
#define LAZYTENSOR_POOL_INSTANCES(P, T)                                                       \
  P template lazy::Tensor<T> lazy::detail::pool2d<T>(const lazy::Tensor<T>&,                 \
                                                     const lazy::graph::Window2d&, bool, bool);
#if LAZYTENSOR_EXPLICIT_INSTANTIATION
LAZYTENSOR_POOL_INSTANCES(extern, float)
LAZYTENSOR_POOL_INSTANCES(extern, double)
#endif
