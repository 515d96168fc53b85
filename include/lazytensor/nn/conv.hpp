#pragma once
// nn::Conv2d, as torch::nn::Conv2d: a 2-D convolution layer over the functional
// lazy::conv2d (im2col + one GEMM, bias fused into the GEMM's row blocks), with PyTorch's
// initialization: kaiming_uniform(a = sqrt(5)) on the weight, i.e. U(-1/sqrt(fan_in),
// 1/sqrt(fan_in)) with fan_in = in_channels * kH * kW, and the same bound for the bias.
//
// Options are checked at construction (a layer that cannot run is never built); the input
// is checked by conv2d at forward. groups and padding modes other than zeros are not
// supported (conv2d has groups = 1 only), so Conv2dOptions does not offer them.

#include <cmath>
#include <cstdint>
#include <ostream>
#include <string>

#include <lazytensor/core/arg.hpp>
#include <lazytensor/core/config.hpp>
#include <lazytensor/nn/init.hpp>
#include <lazytensor/nn/module.hpp>
#include <lazytensor/ops/conv.hpp>
#include <lazytensor/ops/window.hpp>

namespace lazy::nn {

/// Options of Conv2d (torch::nn::Conv2dOptions): `Conv2dOptions(1, 32, 3).padding(1)`.
struct Conv2dOptions {
  /// in_channels -> out_channels with a kernel_size window (`3` or `{3, 5}`).
  Conv2dOptions(std::int64_t in_channels, std::int64_t out_channels, Size2 kernel_size)
      : in_channels_(in_channels), out_channels_(out_channels), kernel_size_(kernel_size) {}
  LAZY_ARG(std::int64_t, in_channels);
  LAZY_ARG(std::int64_t, out_channels);
  LAZY_ARG(Size2, kernel_size);
  /// Step of the window.
  LAZY_ARG(Size2, stride) = 1;
  /// Zeros added on each side of the input.
  LAZY_ARG(Size2, padding) = 0;
  /// Spacing between kernel taps.
  LAZY_ARG(Size2, dilation) = 1;
  /// Whether the layer has a learned bias.
  LAZY_ARG(bool, bias) = true;
};

/// A 2-D convolution: [N, in, H, W] -> [N, out, OH, OW]; `weight` is [out, in, kH, kW],
/// `bias` [out] (undefined without bias).
class Conv2dImpl : public Module {
 public:
  /// Conv2d(in_channels, out_channels, kernel_size) with default options.
  template <class = void>
  Conv2dImpl(std::int64_t in_channels, std::int64_t out_channels, Size2 kernel_size);

  /// ShapeError for non-positive channels, kernel size, stride or dilation, or a negative
  /// padding.
  template <class = void>
  explicit Conv2dImpl(const Conv2dOptions& options_);

  /// x [N, in_channels, H, W] -> [N, out_channels, OH, OW]; ShapeError (from conv2d) for
  /// another rank or channel count, or an input smaller than the dilated kernel.
  template <FloatingElement T>
  Tensor<T> forward(const Tensor<T>& x) const;
  /// The same on a pending expression.
  template <expr::Pending E>
  auto forward(const E& x) const {
    return forward(lazy::eval(x));
  }

  /// PyTorch's repr: `Conv2d(1, 32, kernel_size=(3, 3), stride=(1, 1), padding=(1, 1))`
  /// (padding, dilation and bias shown only when not the default).
  LAZYTENSOR_INLINE void pretty_print(std::ostream& os) const override;

  /// The options the layer was built with.
  const Conv2dOptions options;
  /// [out_channels, in_channels, kH, kW].
  Tensor<float> weight;
  /// [out_channels], or undefined.
  Tensor<float> bias;
};
LAZY_MODULE(Conv2d);

// (Outside the class, so not inline: see core/config.hpp.)
template <class>
Conv2dImpl::Conv2dImpl(std::int64_t in_channels, std::int64_t out_channels, Size2 kernel_size)
    : Conv2dImpl(Conv2dOptions(in_channels, out_channels, kernel_size)) {}

template <class>
Conv2dImpl::Conv2dImpl(const Conv2dOptions& options_) : Module("Conv2d"), options(options_) {
  const auto& o = options;
  if (o.in_channels() <= 0 || o.out_channels() <= 0) {
    throw ShapeError("Conv2d: expected positive in_channels and out_channels, got " +
                     std::to_string(o.in_channels()) + " and " +
                     std::to_string(o.out_channels()));
  }
  if (o.kernel_size().h <= 0 || o.kernel_size().w <= 0) {
    throw ShapeError("Conv2d: expected a positive kernel_size, got " + o.kernel_size().str());
  }
  lazy::detail::check_window_args("Conv2d", o.stride(), o.padding(), o.dilation());

  weight = register_parameter("weight", empty<float>({o.out_channels(), o.in_channels(),
                                                      o.kernel_size().h, o.kernel_size().w}));
  init::kaiming_uniform_(weight, std::sqrt(5.0));
  if (o.bias()) {
    bias = register_parameter("bias", empty<float>({o.out_channels()}));
    const double fan_in =
        static_cast<double>(o.in_channels() * o.kernel_size().h * o.kernel_size().w);
    const double bound = 1.0 / std::sqrt(fan_in);
    init::uniform_(bias, -bound, bound);
  }
}

template <FloatingElement T>
Tensor<T> Conv2dImpl::forward(const Tensor<T>& x) const {
  return conv2d(x, detail::param_as<T>(weight, *this), detail::param_as<T>(bias, *this), options.stride(),
                options.padding(), options.dilation());
}

#if LAZYTENSOR_HEADER_DEFINITIONS
LAZYTENSOR_INLINE void Conv2dImpl::pretty_print(std::ostream& os) const {
  const auto& o = options;
  os << "Conv2d(" << o.in_channels() << ", " << o.out_channels()
     << ", kernel_size=" << o.kernel_size().str() << ", stride=" << o.stride().str();
  if (!(o.padding() == Size2(0))) os << ", padding=" << o.padding().str();
  if (!(o.dilation() == Size2(1))) os << ", dilation=" << o.dilation().str();
  if (!o.bias()) os << ", bias=False";
  os << ")";
}
#endif  // LAZYTENSOR_HEADER_DEFINITIONS

}  // namespace lazy::nn

// Instantiated once in the compiled runtime (core/config.hpp).
#define LAZYTENSOR_NN_CONV_INSTANCES(P)                                                     \
  P template lazy::nn::Conv2dImpl::Conv2dImpl(std::int64_t, std::int64_t, lazy::Size2);    \
  P template lazy::nn::Conv2dImpl::Conv2dImpl(const lazy::nn::Conv2dOptions&);
#define LAZYTENSOR_NN_CONV_FORWARD_INSTANCES(P, T) \
  P template lazy::Tensor<T> lazy::nn::Conv2dImpl::forward<T>(const lazy::Tensor<T>&) const;
#if LAZYTENSOR_EXPLICIT_INSTANTIATION
LAZYTENSOR_NN_CONV_INSTANCES(extern)
LAZYTENSOR_FOR_FLOATING(LAZYTENSOR_NN_CONV_FORWARD_INSTANCES, extern)
#endif
