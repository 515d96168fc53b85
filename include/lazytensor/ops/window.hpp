#pragma once
// Argument checks shared by convolution and pooling: an NCHW input, positive strides and
// dilations, and the validated geometry (graph::Window2d) of a kernel over the input's
// planes. Window2d and the Size2 argument pairs are in graph/window.hpp.

#include <cstdint>
#include <string>

#include <lazytensor/core/error.hpp>
#include <lazytensor/core/shape.hpp>
#include <lazytensor/graph/window.hpp>
#include <lazytensor/core/config.hpp>

namespace lazy {

namespace detail {

/// "(a x b)", as torch prints plane sizes in conv/pool errors.
inline std::string plane_str(std::int64_t a, std::int64_t b) {
  return "(" + std::to_string(a) + " x " + std::to_string(b) + ")";
}

/// ShapeError unless x is [N, C, H, W] with C, H, W > 0 (N may be 0).
void check_nchw(const Shape& s, const char* op, const char* what);

/// ShapeError unless stride and dilation are positive and padding is not negative.
void check_window_args(const char* op, Size2 stride, Size2 padding, Size2 dilation);

/// The geometry of a kernel sliding over the planes of `image` ([N, C, H, W]), validated:
/// the dilated kernel must fit the padded input.
graph::Window2d window_over(const char* op, const Shape& image, Size2 kernel, Size2 stride,
                                   Size2 padding, Size2 dilation);

}  // namespace detail

}  // namespace lazy

#if LAZYTENSOR_HEADER_DEFINITIONS
namespace lazy::detail {

LAZYTENSOR_INLINE void check_nchw(const Shape& s, const char* op, const char* what) {
  if (s.rank() != 4) {
    throw ShapeError(std::string(op) + ": expected a 4-D " + what + " [N, C, H, W], got shape " +
                     s.str() + " (rank " + std::to_string(s.rank()) + ")");
  }
  if (s[1] == 0 || s[2] == 0 || s[3] == 0) {
    throw ShapeError(std::string(op) + ": expected non-zero channels, height and width in the " +
                     what + " [N, C, H, W], got shape " + s.str());
  }
}

LAZYTENSOR_INLINE void check_window_args(const char* op, Size2 stride, Size2 padding, Size2 dilation) {
  if (stride.h <= 0 || stride.w <= 0) {
    throw ShapeError(std::string(op) + ": expected a positive stride, got " + stride.str());
  }
  if (dilation.h <= 0 || dilation.w <= 0) {
    throw ShapeError(std::string(op) + ": expected a positive dilation, got " + dilation.str());
  }
  if (padding.h < 0 || padding.w < 0) {
    throw ShapeError(std::string(op) + ": expected a non-negative padding, got " + padding.str());
  }
}

LAZYTENSOR_INLINE graph::Window2d window_over(const char* op,
    const Shape& image,
    Size2 kernel,
    Size2 stride,
    Size2 padding,
    Size2 dilation) {
  if (kernel.h <= 0 || kernel.w <= 0) {
    throw ShapeError(std::string(op) + ": expected a positive kernel size, got " + kernel.str());
  }
  check_window_args(op, stride, padding, dilation);
  graph::Window2d g{kernel.h,   kernel.w,   stride.h, stride.w, padding.h, padding.w,
                    dilation.h, dilation.w, image[2], image[3], 0,         0};
  // Sizes in checked arithmetic: a huge kernel, dilation or padding would otherwise wrap
  // (undefined behaviour) into a window that passes the check below.
  std::int64_t eh = 0, ew = 0, hp = 0, wp = 0;
  const bool wraps = __builtin_mul_overflow(g.dh, g.kh - 1, &eh) ||
                     __builtin_mul_overflow(g.dw, g.kw - 1, &ew) ||
                     __builtin_mul_overflow(g.ph, 2, &hp) || __builtin_add_overflow(hp, g.h, &hp) ||
                     __builtin_mul_overflow(g.pw, 2, &wp) || __builtin_add_overflow(wp, g.w, &wp);
  if (wraps || eh >= kMaxElements || ew >= kMaxElements || hp > kMaxElements || wp > kMaxElements) {
    throw ShapeError(std::string(op) + ": the window (kernel " + kernel.str() + ", dilation " +
                     dilation.str() + ", padding " + padding.str() + ") over the input " +
                     image.str() + " spans more than 2^60 elements");
  }
  ++eh, ++ew;
  if (hp < eh || wp < ew) {
    throw ShapeError(std::string(op) +
                     ": kernel size can't be greater than the padded input size: padded input " +
                     plane_str(hp, wp) + " (input " + image.str() + ", padding " + padding.str() +
                     "), dilated kernel " + plane_str(eh, ew) + " (kernel " + kernel.str() +
                     ", dilation " + dilation.str() + ")");
  }
  g.set_output_size();
  // The taps of one window over all channels (unfold's rows, conv's GEMM depth, a pooling
  // window) and the windows of a plane must be countable too.
  std::int64_t taps = 0, windows = 0;
  if (__builtin_mul_overflow(image[1], g.kh, &taps) || __builtin_mul_overflow(taps, g.kw, &taps) ||
      taps > kMaxElements || __builtin_mul_overflow(g.oh, g.ow, &windows) ||
      windows > kMaxElements) {
    throw ShapeError(std::string(op) + ": kernel " + kernel.str() + " over " +
                     std::to_string(image[1]) + " channels, or the " + plane_str(g.oh, g.ow) +
                     " windows of the input " + image.str() + ", counts more than 2^60");
  }
  return g;
}

}  // namespace lazy::detail
#endif  // LAZYTENSOR_HEADER_DEFINITIONS
