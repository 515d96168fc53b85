#pragma once
// nn::MaxPool2d and nn::AvgPool2d, as torch::nn: parameter-free layers over the functional
// lazy::max_pool2d / lazy::avg_pool2d. As in PyTorch the stride defaults to the kernel
// size; the options set it when they are constructed, so `options.stride()` is always the
// stride in use. Options are checked at construction; dilation, ceil_mode and
// divisor_override are not supported (the functional ops do not have them).

#include <cstdint>
#include <ostream>
#include <string>

#include <lazytensor/core/arg.hpp>
#include <lazytensor/core/config.hpp>
#include <lazytensor/nn/module.hpp>
#include <lazytensor/ops/pool.hpp>
#include <lazytensor/ops/window.hpp>

namespace lazy::nn {

namespace detail {

/// ShapeError unless the kernel and stride are positive and 0 <= padding <= kernel / 2
/// (torch's rule: every window must overlap the input).
void check_pool_options(const char* layer, Size2 kernel, Size2 stride, Size2 padding);

/// A size as PyTorch prints a pooling argument: `2` when square, `(2, 3)` otherwise.
std::string pool_size_str(Size2 s);

}  // namespace detail

/// Options of MaxPool2d (torch::nn::MaxPool2dOptions): `MaxPool2dOptions(3).stride(2)`.
struct MaxPool2dOptions {
  /// A kernel_size window; the stride starts equal to it.
  MaxPool2dOptions(Size2 kernel_size)  // NOLINT: MaxPool2d(2) reads naturally
      : kernel_size_(kernel_size), stride_(kernel_size) {}
  LAZY_ARG(Size2, kernel_size);
  /// Step of the window (default: the kernel size).
  LAZY_ARG(Size2, stride);
  /// Implicit -inf padding on each side, at most half the kernel.
  LAZY_ARG(Size2, padding) = 0;
};

/// Options of AvgPool2d (torch::nn::AvgPool2dOptions): `AvgPool2dOptions(2).padding(1)`.
struct AvgPool2dOptions {
  /// A kernel_size window; the stride starts equal to it.
  AvgPool2dOptions(Size2 kernel_size)  // NOLINT: AvgPool2d(2) reads naturally
      : kernel_size_(kernel_size), stride_(kernel_size) {}
  LAZY_ARG(Size2, kernel_size);
  /// Step of the window (default: the kernel size).
  LAZY_ARG(Size2, stride);
  /// Zero padding on each side, at most half the kernel.
  LAZY_ARG(Size2, padding) = 0;
  /// Whether padded zeros count in the divisor (kH * kW) or only the taps inside the input.
  LAZY_ARG(bool, count_include_pad) = true;
};

/// 2-D max pooling: [N, C, H, W] -> [N, C, OH, OW].
class MaxPool2dImpl : public Module {
 public:
  /// MaxPool2d(kernel_size) with default options (stride = kernel_size, no padding).
  explicit MaxPool2dImpl(Size2 kernel_size) : MaxPool2dImpl(MaxPool2dOptions(kernel_size)) {}
  /// ShapeError for a non-positive kernel size or stride, or a padding outside
  /// [0, kernel / 2].
  explicit MaxPool2dImpl(const MaxPool2dOptions& options_);
  /// ShapeError (from max_pool2d) unless x is [N, C, H, W] with a plane no smaller than the
  /// kernel once padded.
  template <FloatingElement T>
  Tensor<T> forward(const Tensor<T>& x) const;
  /// The same on a pending expression.
  template <expr::Pending E>
  auto forward(const E& x) const {
    return forward(lazy::eval(x));
  }
  /// PyTorch's repr: `MaxPool2d(kernel_size=2, stride=2, padding=0, dilation=1,
  /// ceil_mode=False)`.
  LAZYTENSOR_INLINE void pretty_print(std::ostream& os) const override;

  /// The options the layer was built with.
  const MaxPool2dOptions options;
};
LAZY_MODULE(MaxPool2d);

/// 2-D average pooling: [N, C, H, W] -> [N, C, OH, OW].
class AvgPool2dImpl : public Module {
 public:
  /// AvgPool2d(kernel_size) with default options (stride = kernel_size, no padding).
  explicit AvgPool2dImpl(Size2 kernel_size) : AvgPool2dImpl(AvgPool2dOptions(kernel_size)) {}
  /// ShapeError for a non-positive kernel size or stride, or a padding outside
  /// [0, kernel / 2].
  explicit AvgPool2dImpl(const AvgPool2dOptions& options_);
  /// ShapeError (from avg_pool2d) unless x is [N, C, H, W] with a plane no smaller than the
  /// kernel once padded.
  template <FloatingElement T>
  Tensor<T> forward(const Tensor<T>& x) const;
  /// The same on a pending expression.
  template <expr::Pending E>
  auto forward(const E& x) const {
    return forward(lazy::eval(x));
  }
  /// PyTorch's repr: `AvgPool2d(kernel_size=2, stride=2, padding=0)` (plus
  /// `count_include_pad=False` when set).
  LAZYTENSOR_INLINE void pretty_print(std::ostream& os) const override;

  /// The options the layer was built with.
  const AvgPool2dOptions options;
};
LAZY_MODULE(AvgPool2d);

// (Outside the classes, so not inline: see core/config.hpp.)
template <FloatingElement T>
Tensor<T> MaxPool2dImpl::forward(const Tensor<T>& x) const {
  return max_pool2d(x, options.kernel_size(), options.stride(), options.padding());
}

template <FloatingElement T>
Tensor<T> AvgPool2dImpl::forward(const Tensor<T>& x) const {
  return avg_pool2d(x, options.kernel_size(), options.stride(), options.padding(),
                    options.count_include_pad());
}

#if LAZYTENSOR_HEADER_DEFINITIONS
namespace detail {

LAZYTENSOR_INLINE void check_pool_options(const char* layer, Size2 kernel, Size2 stride, Size2 padding) {
  if (kernel.h <= 0 || kernel.w <= 0) {
    throw ShapeError(std::string(layer) + ": expected a positive kernel_size, got " + kernel.str());
  }
  lazy::detail::check_window_args(layer, stride, padding, 1);
  if (padding.h > kernel.h / 2 || padding.w > kernel.w / 2) {
    throw ShapeError(std::string(layer) +
                     ": padding should be at most half of the kernel size, got padding " +
                     padding.str() + " for kernel_size " + kernel.str());
  }
}

LAZYTENSOR_INLINE std::string pool_size_str(Size2 s) { return s.h == s.w ? std::to_string(s.h) : s.str(); }

}  // namespace detail

LAZYTENSOR_INLINE MaxPool2dImpl::MaxPool2dImpl(const MaxPool2dOptions& options_)
    : Module("MaxPool2d"), options(options_) {
  detail::check_pool_options("MaxPool2d", options.kernel_size(), options.stride(),
                             options.padding());
}

LAZYTENSOR_INLINE void MaxPool2dImpl::pretty_print(std::ostream& os) const {
  os << "MaxPool2d(kernel_size=" << detail::pool_size_str(options.kernel_size())
     << ", stride=" << detail::pool_size_str(options.stride())
     << ", padding=" << detail::pool_size_str(options.padding())
     << ", dilation=1, ceil_mode=False)";
}

LAZYTENSOR_INLINE AvgPool2dImpl::AvgPool2dImpl(const AvgPool2dOptions& options_)
    : Module("AvgPool2d"), options(options_) {
  detail::check_pool_options("AvgPool2d", options.kernel_size(), options.stride(),
                             options.padding());
}

LAZYTENSOR_INLINE void AvgPool2dImpl::pretty_print(std::ostream& os) const {
  os << "AvgPool2d(kernel_size=" << detail::pool_size_str(options.kernel_size())
     << ", stride=" << detail::pool_size_str(options.stride())
     << ", padding=" << detail::pool_size_str(options.padding());
  if (!options.count_include_pad()) os << ", count_include_pad=False";
  os << ")";
}
#endif  // LAZYTENSOR_HEADER_DEFINITIONS

}  // namespace lazy::nn

// Instantiated once in the compiled runtime (core/config.hpp).
#define LAZYTENSOR_NN_POOLING_INSTANCES(P, T)                                                                   \
  P template lazy::Tensor<T> lazy::nn::MaxPool2dImpl::forward<T>(const lazy::Tensor<T>&) const; \
  P template lazy::Tensor<T> lazy::nn::AvgPool2dImpl::forward<T>(const lazy::Tensor<T>&) const;
#if LAZYTENSOR_EXPLICIT_INSTANTIATION
LAZYTENSOR_FOR_FLOATING(LAZYTENSOR_NN_POOLING_INSTANCES, extern)
#endif
