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
  const std::int64_t eh = g.dh * (g.kh - 1) + 1, ew = g.dw * (g.kw - 1) + 1;
  if (g.h + 2 * g.ph < eh || g.w + 2 * g.pw < ew) {
    throw ShapeError(std::string(op) +
                     ": kernel size can't be greater than the padded input size: padded input " +
                     plane_str(g.h + 2 * g.ph, g.w + 2 * g.pw) + " (input " + image.str() +
                     ", padding " + padding.str() + "), dilated kernel " + plane_str(eh, ew) +
                     " (kernel " + kernel.str() + ", dilation " + dilation.str() + ")");
  }
  g.set_output_size();
  return g;
}

}  // namespace lazy::detail
#endif  // LAZYTENSOR_HEADER_DEFINITIONS
