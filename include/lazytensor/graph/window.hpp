#pragma once
// The geometry of a 2-D window sliding over [H, W] planes (Window2d), which the pooling and
// im2col kernels run over, and the (height, width) size pairs it is printed with (Size2,
// also the argument type of conv and pool: libtorch's ExpandingArray<2>). Argument checks
// that build a Window2d from user arguments are in ops/window.hpp.

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>

#include <lazytensor/graph/node.hpp>
#include <lazytensor/core/config.hpp>

namespace lazy {

/// A (height, width) pair: `3` means {3, 3}, `{3, 2}` means height 3 and width 2, as
/// libtorch's ExpandingArray<2> (kernel sizes, strides, paddings, dilations).
struct Size2 {
  std::int64_t h = 0;
  std::int64_t w = 0;
  /// The same value for both dimensions.
  Size2(std::int64_t v) : h(v), w(v) {}  // NOLINT(google-explicit-constructor): `stride = 2`
  /// Height and width.
  Size2(std::int64_t height, std::int64_t width) : h(height), w(width) {}
  /// "(h, w)", for error messages.
  /// (Appended piece by piece: GCC 12's -Wrestrict misfires on `"(" + std::to_string(h)`
  /// once inlined into some callers, and the headers-alone check builds with -Werror.)
  std::string str() const {
    std::string s = "(";
    s += std::to_string(h);
    s += ", ";
    s += std::to_string(w);
    s += ')';
    return s;
  }
  friend bool operator==(const Size2&, const Size2&) = default;
};

namespace graph {

/// Where a 2-D window lands: output position (oy, ox) reads input rows
/// oy * sh - ph + i * dh (i < kh) and columns ox * sw - pw + j * dw (j < kw) of an h x w
/// plane; positions outside the plane are padding.
struct Window2d {
  std::int64_t kh = 1, kw = 1;  ///< kernel
  std::int64_t sh = 1, sw = 1;  ///< stride
  std::int64_t ph = 0, pw = 0;  ///< padding
  std::int64_t dh = 1, dw = 1;  ///< dilation
  std::int64_t h = 0, w = 0;    ///< input plane
  std::int64_t oh = 0, ow = 0;  ///< output plane

  /// Fills oh/ow (torch's floor formula, no ceil_mode); the caller validated that the
  /// dilated kernel fits the padded input.
  void set_output_size();
  /// Output columns [first, last) whose kernel column j reads inside the plane.
  std::pair<std::int64_t, std::int64_t> valid_columns(std::int64_t j) const {
    return valid_range(pw - j * dw, w, sw, ow);
  }
  /// Output rows [first, last) whose kernel row i reads inside the plane.
  std::pair<std::int64_t, std::int64_t> valid_rows(std::int64_t i) const {
    return valid_range(ph - i * dh, h, sh, oh);
  }
  /// Folds every field into a structural hash.
  std::uint64_t hash(std::uint64_t seed) const;
  /// "kernel=(3, 3), stride=(1, 1), padding=(1, 1), dilation=(1, 1)", for graph dumps.
  std::string str() const;

 private:
  // Outputs o in [0, count) with 0 <= o * stride - shift < size.
  static std::pair<std::int64_t, std::int64_t> valid_range(std::int64_t shift, std::int64_t size,
                                                           std::int64_t stride,
                                                           std::int64_t count);
};

}  // namespace graph

}  // namespace lazy

#if LAZYTENSOR_HEADER_DEFINITIONS
namespace lazy::graph {

LAZYTENSOR_INLINE void Window2d::set_output_size() {
  oh = (h + 2 * ph - dh * (kh - 1) - 1) / sh + 1;
  ow = (w + 2 * pw - dw * (kw - 1) - 1) / sw + 1;
}

LAZYTENSOR_INLINE std::uint64_t Window2d::hash(std::uint64_t seed) const {
  for (std::int64_t v : {kh, kw, sh, sw, ph, pw, dh, dw, h, w})
    seed = hash_combine(seed, static_cast<std::uint64_t>(v));
  return seed;
}

LAZYTENSOR_INLINE std::string Window2d::str() const {
  return "kernel=" + Size2(kh, kw).str() + ", stride=" + Size2(sh, sw).str() +
         ", padding=" + Size2(ph, pw).str() + ", dilation=" + Size2(dh, dw).str();
}

LAZYTENSOR_INLINE std::pair<std::int64_t, std::int64_t> Window2d::valid_range(std::int64_t shift,
  std::int64_t size,
  std::int64_t stride,
  std::int64_t count) {
  const std::int64_t first = shift <= 0 ? 0 : (shift + stride - 1) / stride;
  const std::int64_t top = size - 1 + shift;  // o * stride <= top
  const std::int64_t last = top < 0 ? 0 : std::min(count, top / stride + 1);
  return {std::min(first, last), last};
}

}  // namespace lazy::graph
#endif  // LAZYTENSOR_HEADER_DEFINITIONS
