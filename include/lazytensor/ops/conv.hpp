#pragma once
// conv2d as im2col + one batched GEMM (torch::nn::functional::conv2d), and unfold/fold
// (torch::nn::functional::unfold/fold), the im2col/col2im ops themselves.
//
// conv2d(x, w, b) = reshape(W [O, C*kh*kw] x cols[n] + b[:, None], [N, O, OH, OW]) with
// cols = im2col(x) [N, C*kh*kw, OH*OW]: the weight is shared by every image (a GEMM with a
// batch-1 left operand) and the output [N, O, OH*OW] is already NCHW; the bias add runs on
// the GEMM's row blocks while they are in cache (epilogue fusion). A 1x1 kernel with stride
// 1 and no padding needs no im2col: the image is its own column matrix (a view).
//
// Backward: im2col's rule is col2im; the GEMM's rule computes the column gradient as
// W^T x G[n] (W read transposed) and the weight gradient with ConvWeightGradNode, which sums
// G[n] x cols[n]^T over the images without materializing a transpose (matmul's generic rule
// would copy cols transposed and sum N products: ~1.7x slower at 32x64x32x32, 3x3); the bias
// gradient comes from the element-wise rule (a sum over N and the positions).

#include <cstdint>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include <lazytensor/autograd/record.hpp>
#include <lazytensor/core/config.hpp>
#include <lazytensor/graph/im2col.hpp>
#include <lazytensor/ops/factories.hpp>
#include <lazytensor/ops/matmul.hpp>
#include <lazytensor/ops/shape.hpp>
#include <lazytensor/ops/window.hpp>
#include <lazytensor/tensor/tensor.hpp>

namespace lazy {

namespace detail {

/// Columns [N, C*kh*kw, OH*OW] of `x`, with col2im as backward.
template <class T>
Tensor<T> im2col(const Tensor<T>& x, const graph::Window2d& g) {
  Tensor<T> cols(graph::submit(std::make_shared<graph::Im2colNode<T>>(x.node(), g)));
  autograd::record(cols, "Im2ColBackward0", {autograd::edge_of(x.impl())},
                   [g, image = x.shape()](const Tensor<T>& gc) {
                     return graph::NodeList{graph::submit(
                         std::make_shared<graph::Col2imNode<T>>(gc.node(), image, g))};
                   });
  return cols;
}

/// Images of shape `image` summed from columns, with im2col as backward.
template <class T>
Tensor<T> col2im(const Tensor<T>& cols, const Shape& image, const graph::Window2d& g) {
  Tensor<T> x(graph::submit(std::make_shared<graph::Col2imNode<T>>(cols.node(), image, g)));
  autograd::record(x, "Col2ImBackward0", {autograd::edge_of(cols.impl())},
                   [g](const Tensor<T>& gx) {
                     return graph::NodeList{
                         graph::submit(std::make_shared<graph::Im2colNode<T>>(gx.node(), g))};
                   });
  return x;
}

/// Backward of y[n] = W x cols[n] (W [O, K], cols [N, K, L]): dW = sum_n G[n] cols[n]^T by
/// ConvWeightGradNode, dcols[n] = W^T G[n] by one GEMM reading W transposed.
template <class T>
void record_conv_gemm(Tensor<T>& y, const Tensor<T>& w, const Tensor<T>& cols) {
  auto ew = autograd::edge_of(w.impl()), ec = autograd::edge_of(cols.impl());
  autograd::record(
      y, "ConvolutionBackward0", {ew, ec},
      [w = w.detach(), cols = cols.detach(), need_w = ew != nullptr,
       need_c = ec != nullptr](const Tensor<T>& g) {
        const std::int64_t N = cols.size(0), K = cols.size(1), L = cols.size(2), O = w.size(0);
        graph::NodeList grads(2);
        if (need_w) {
          grads[0] =
              graph::submit(std::make_shared<graph::ConvWeightGradNode<T>>(g.node(), cols.node()));
        }
        if (need_c) grads[1] = gemm(transpose(w, 0, 1), g, 1, N, K, O, L, Shape{N, K, L}).node();
        return grads;
      });
}

/// True for a window that reads every input element once, in order (1x1, stride 1, no
/// padding): the image [N, C, H, W] is then its own column matrix [N, C, H*W].
inline bool identity_window(const graph::Window2d& g) {
  return g.kh == 1 && g.kw == 1 && g.sh == 1 && g.sw == 1 && g.ph == 0 && g.pw == 0;
}

template <class T>
Tensor<T> conv2d_impl(const Tensor<T>& x, const Tensor<T>& weight, const Tensor<T>& bias,
                      Size2 stride, Size2 padding, Size2 dilation) {
  const Shape& xs = x.shape();
  const Shape& ws = weight.shape();
  check_nchw(xs, "conv2d", "input");
  if (ws.rank() != 4 || ws[0] == 0 || ws[1] == 0) {
    throw ShapeError("conv2d: expected a 4-D weight [out_channels, in_channels, kH, kW] with " +
                     std::string("non-zero channels, got shape ") + ws.str());
  }
  if (xs[1] != ws[1]) {
    throw ShapeError("conv2d: weight of shape " + ws.str() +
                     " expects input [N, C, H, W] with C = " + std::to_string(ws[1]) +
                     " channels, but got input of shape " + xs.str() + " with " +
                     std::to_string(xs[1]) + " channels");
  }
  if (bias.defined() && (bias.dim() != 1 || bias.size(0) != ws[0])) {
    throw ShapeError("conv2d: expected bias of shape (" + std::to_string(ws[0]) +
                     ",) for weight of shape " + ws.str() + ", got bias of shape " +
                     bias.shape().str());
  }
  const graph::Window2d g =
      window_over("conv2d", xs, Size2(ws[2], ws[3]), stride, padding, dilation);
  graph::NodeList nodes{x.node(), weight.node()};
  if (bias.defined()) nodes.push_back(bias.node());
  graph::common_device(nodes, "conv2d");

  const std::int64_t N = xs[0], C = xs[1], O = ws[0], K = C * g.kh * g.kw, L = g.oh * g.ow;
  const Shape out{N, O, g.oh, g.ow};
  if (N == 0) {
    // No image: nothing to compute, and zero gradients (GemmNode needs a batch of >= 1).
    Tensor<T> y = zeros<T>(out, x.device());
    std::vector<autograd::GradFnPtr> edges{autograd::edge_of(x.impl()),
                                           autograd::edge_of(weight.impl())};
    std::vector<Shape> shapes{xs, ws};
    if (bias.defined()) {
      edges.push_back(autograd::edge_of(bias.impl()));
      shapes.push_back(bias.shape());
    }
    autograd::record(y, "ConvolutionBackward0", std::move(edges),
                     [shapes, dev = x.device()](const Tensor<T>&) {
                       graph::NodeList grads;
                       for (const auto& s : shapes) grads.push_back(zeros<T>(s, dev).node());
                       return grads;
                     });
    return y;
  }
  Tensor<T> cols = identity_window(g) ? reshape(x, Shape{N, C, L}) : im2col(x, g);
  // A = weight [O, K] shared by every image (batch 1), B = cols[n] [K, L].
  Tensor<T> w2 = reshape(weight, Shape{O, K});
  Tensor<T> y = [&] {
    autograd::AutoGradMode off(false);  // recorded below, with the convolution's own rule
    return gemm(w2, cols, 1, N, O, K, L, Shape{N, O, L});
  }();
  record_conv_gemm(y, w2, cols);
  if (bias.defined()) y = y + reshape(bias, Shape{O, 1});
  return reshape(y, out);
}

}  // namespace detail

/// 2-D convolution (torch::nn::functional::conv2d with groups = 1): input [N, C, H, W],
/// weight [O, C, kH, kW], optional bias [O] (pass `{}` for none); returns
/// [N, O, OH, OW] with OH = (H + 2 * padding.h - dilation.h * (kH - 1) - 1) / stride.h + 1.
/// Padding is zeros. float and double; bfloat16 is computed in float and rounded once, as
/// are float operands under autocast (AutocastGuard).
/// ShapeError for ranks other than 4, a channel or bias size mismatch, a non-positive
/// stride or dilation, negative padding, or a dilated kernel larger than the padded input.
template <expr::ExprLike X>
Tensor<expr::value_t<X>> conv2d(const X& input, const Tensor<expr::value_t<X>>& weight,
                                const Tensor<expr::value_t<X>>& bias = {}, Size2 stride = 1,
                                Size2 padding = 0, Size2 dilation = 1) {
  using T = expr::value_t<X>;
  if constexpr (!is_floating_v<T>) {
    throw DTypeError("conv2d: expected a floating tensor (float, double or bfloat16), got " +
                     dtype_name(dtype_of<T>()));
  } else {
    Tensor<T> x = detail::as_tensor(input);
    if constexpr (std::is_same_v<T, bfloat16>) {
      Tensor<float> xf = cast<float>(x), wf = cast<float>(weight), bf;
      if (bias.defined()) bf = cast<float>(bias);
      return Tensor<bfloat16>(
          cast<bfloat16>(detail::conv2d_impl(xf, wf, bf, stride, padding, dilation)));
    } else {
      if constexpr (std::is_same_v<T, float>) {
        if (is_autocast_enabled()) {
          AutocastGuard off(false);
          Tensor<float> br;
          if (bias.defined()) br = detail::round_to_bf16(bias);
          return detail::round_to_bf16(detail::conv2d_impl(detail::round_to_bf16(x), detail::round_to_bf16(weight),
                                                           br, stride, padding, dilation));
        }
      }
      return detail::conv2d_impl(x, weight, bias, stride, padding, dilation);
    }
  }
}

/// Sliding local blocks of a batch of images (torch::nn::functional::unfold, i.e. im2col):
/// [N, C, H, W] -> [N, C * kH * kW, L], L = OH * OW output positions, zeros for padding.
/// float and double. ShapeError as conv2d.
template <Element T>
Tensor<T> unfold(const Tensor<T>& input, Size2 kernel_size, Size2 dilation = 1, Size2 padding = 0,
                 Size2 stride = 1) {
  if constexpr (!std::is_same_v<T, float> && !std::is_same_v<T, double>) {
    throw DTypeError("unfold: expected a float or double tensor, got " + dtype_name(dtype_of<T>()));
  } else {
    detail::check_nchw(input.shape(), "unfold", "input");
    const auto g =
        detail::window_over("unfold", input.shape(), kernel_size, stride, padding, dilation);
    return detail::im2col(input, g);
  }
}

/// Sums sliding local blocks into images (torch::nn::functional::fold, i.e. col2im, the
/// adjoint of unfold): [N, C * kH * kW, L] -> [N, C, output_size.h, output_size.w], where
/// L must be the number of block positions in the output. float and double.
template <Element T>
Tensor<T> fold(const Tensor<T>& input, Size2 output_size, Size2 kernel_size, Size2 dilation = 1,
               Size2 padding = 0, Size2 stride = 1) {
  if constexpr (!std::is_same_v<T, float> && !std::is_same_v<T, double>) {
    throw DTypeError("fold: expected a float or double tensor, got " + dtype_name(dtype_of<T>()));
  } else {
    const Shape& s = input.shape();
    if (s.rank() != 3)
      throw ShapeError("fold: expected a 3-D input [N, C * kH * kW, L], got shape " + s.str());
    if (kernel_size.h <= 0 || kernel_size.w <= 0) {
      throw ShapeError("fold: expected a positive kernel size, got " + kernel_size.str());
    }
    if (output_size.h <= 0 || output_size.w <= 0) {
      throw ShapeError("fold: expected a positive output size, got " + output_size.str());
    }
    std::int64_t kk = 0;
    if (__builtin_mul_overflow(kernel_size.h, kernel_size.w, &kk) || s[1] == 0 || s[1] % kk != 0) {
      throw ShapeError("fold: expected size(1) of the input " + s.str() +
                       " to be a non-zero multiple of kH * kW = " + std::to_string(kk));
    }
    const Shape image{s[0], s[1] / kk, output_size.h, output_size.w};
    const auto g = detail::window_over("fold", image, kernel_size, stride, padding, dilation);
    if (s[2] != g.oh * g.ow) {
      throw ShapeError("fold: expected input.size(2) = " + std::to_string(g.oh * g.ow) +
                       " blocks (" + detail::plane_str(g.oh, g.ow) + " for output size " +
                       output_size.str() + ", kernel " + kernel_size.str() + ", dilation " +
                       dilation.str() + ", padding " + padding.str() + ", stride " + stride.str() +
                       "), got input of shape " + s.str());
    }
    return detail::col2im(input, image, g);
  }
}

}  // namespace lazy

// Instantiated once by lazytensor::compiled (src/compiled.cpp): the convolution's GEMM
// plumbing, the im2col/col2im nodes and the derivative rules.
#define LAZYTENSOR_CONV_INSTANCES(P, T)                                                         \
  P template lazy::Tensor<T> lazy::detail::im2col<T>(const lazy::Tensor<T>&,                     \
                                                     const lazy::graph::Window2d&);              \
  P template lazy::Tensor<T> lazy::detail::col2im<T>(const lazy::Tensor<T>&, const lazy::Shape&, \
                                                     const lazy::graph::Window2d&);              \
  P template lazy::Tensor<T> lazy::detail::conv2d_impl<T>(                                       \
      const lazy::Tensor<T>&, const lazy::Tensor<T>&, const lazy::Tensor<T>&, lazy::Size2,       \
      lazy::Size2, lazy::Size2);
#if LAZYTENSOR_EXPLICIT_INSTANTIATION
LAZYTENSOR_CONV_INSTANCES(extern, float)
LAZYTENSOR_CONV_INSTANCES(extern, double)
#endif
