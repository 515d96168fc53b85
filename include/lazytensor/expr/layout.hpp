#pragma once
// Broadcast layout of a kernel, resolved once when its node is built: the output's
// dimensions collapsed as far as every input allows, and each input's stride per collapsed
// dimension (0 where it is broadcast). The innermost stride of an input is always 0
// (splat) or 1 (contiguous load); a kernel is "flat" when one dimension remains.

#include <array>
#include <cstdint>
#include <span>
#include <vector>

#include <lazytensor/core/shape.hpp>
#include <lazytensor/core/small_vector.hpp>
#include <lazytensor/core/config.hpp>

namespace lazy::expr {

/// Collapsed iteration space of an element-wise kernel.
struct Layout {
  int ndim = 1;
  std::array<std::int64_t, kMaxRank> size{};
  /// Per input slot (inline for up to 4 inputs: no allocation for most kernels).
  core::SmallVector<std::array<std::int64_t, kMaxRank>, 4> stride;
  core::SmallVector<char, 8> splat;  ///< per input slot: innermost stride is 0

  bool flat() const { return ndim == 1; }
  std::int64_t inner() const { return size[ndim - 1]; }
  bool any_splat() const {
    for (char s : splat)
      if (s) return true;
    return false;
  }
};

/// Layout for writing `out` from inputs of the given shapes (each broadcastable to out).
Layout make_layout(const Shape& out, std::span<const Shape* const> inputs);

/// Walks the rows of a layout (a row: the innermost dimension, at one index of the outer
/// ones), giving each input slot's element offset at the row's start. Not a template: the
/// row loop of every expression (expr::eval_rows) shares this odometer, so an expression
/// compiles only its own seek, the inline step and the call of its inner loop.
class RowCursor {
 public:
  /// At row `r0` of `layout` (which must outlive the cursor).
  RowCursor(const Layout& layout, std::int64_t r0);
  RowCursor(const RowCursor&) = delete;
  RowCursor& operator=(const RowCursor&) = delete;
  /// Per input slot, the offset of the current row's first element.
  const std::int64_t* offsets() const { return off_; }
  /// Moves to the next row (past the last one, the offsets wrap to row 0's). Inline only
  /// the step along the innermost outer dimension (most rows): the carry is shared code.
  void next() {
    if (++last_ < last_size_) {
      // (Locals: stores through off_ could otherwise alias the members, reloaded each time.)
      std::int64_t* off = off_;
      const std::int64_t* step = step_;
      for (std::size_t k = 0, n = nin_; k < n; ++k) off[k] += step[k];
      return;
    }
    carry();
  }

 private:
  void carry();

  const Layout& L_;
  std::size_t nin_;
  std::int64_t last_ = 0, last_size_ = 1;  // the innermost outer dimension's index and size
  /// The row's index in each outer dimension but the innermost one (last_ counts that one;
  /// idx_[outer - 1] is only read by the constructor and goes stale after it).
  std::array<std::int64_t, kMaxRank> idx_{};
  core::SmallVector<std::int64_t, 16> store_;  // offsets, then steps (inline up to 8 inputs)
  std::int64_t* off_ = nullptr;
  std::int64_t* step_ = nullptr;
};

}  // namespace lazy::expr

#if LAZYTENSOR_HEADER_DEFINITIONS
namespace lazy::expr {

LAZYTENSOR_INLINE Layout make_layout(const Shape& out, std::span<const Shape* const> inputs) {
  const int r = out.rank();
  const std::size_t n = inputs.size();
  // The common case first: every input has the output's shape or is one element.
  bool flat = true;
  for (const Shape* s : inputs) flat = flat && (*s == out || s->numel() == 1);
  if (flat) {
    Layout L;
    L.stride.resize(n);
    L.splat.resize(n);
    L.ndim = 1;
    L.size[0] = out.numel();
    for (std::size_t k = 0; k < n; ++k) {
      const bool one = inputs[k]->numel() == 1 && out.numel() != 1;
      L.stride[k][0] = one ? 0 : 1;
      L.splat[k] = one ? 1 : 0;
    }
    return L;
  }
  // Uncollapsed strides in output coordinates, dropping output dims of size 1.
  std::vector<std::int64_t> sizes;
  std::vector<std::vector<std::int64_t>> strides(n);
  for (std::size_t k = 0; k < n; ++k) {
    const Shape& s = *inputs[k];
    auto cs = contiguous_strides(s);
    const int off = r - s.rank();
    for (int d = 0; d < r; ++d) {
      if (out[d] == 1) continue;
      const int sd = d - off;
      strides[k].push_back(sd >= 0 && s[sd] != 1 ? cs[sd] : 0);
    }
  }
  for (int d = 0; d < r; ++d)
    if (out[d] != 1) sizes.push_back(out[d]);

  Layout L;
  L.stride.resize(n);
  L.splat.assign(n, 0);
  if (sizes.empty()) {  // a single element
    L.ndim = 1;
    L.size[0] = out.numel();
    for (std::size_t k = 0; k < n; ++k) {
      L.stride[k][0] = 0;
      L.splat[k] = inputs[k]->numel() == 1 && out.numel() != 1 ? 1 : 0;
    }
    return L;
  }
  // Merge dimension d into d+1 while every input is contiguous across the pair.
  std::vector<std::int64_t> csize{sizes.back()};
  std::vector<std::vector<std::int64_t>> cstride(n);
  for (std::size_t k = 0; k < n; ++k) cstride[k].push_back(strides[k].back());
  for (int d = static_cast<int>(sizes.size()) - 2; d >= 0; --d) {
    bool mergeable = true;
    for (std::size_t k = 0; k < n && mergeable; ++k) {
      mergeable = strides[k][d] == cstride[k].front() * csize.front();
    }
    if (mergeable) {
      csize.front() *= sizes[d];
    } else {
      csize.insert(csize.begin(), sizes[d]);
      for (std::size_t k = 0; k < n; ++k) cstride[k].insert(cstride[k].begin(), strides[k][d]);
    }
  }
  L.ndim = static_cast<int>(csize.size());
  for (int d = 0; d < L.ndim; ++d) L.size[d] = csize[d];
  for (std::size_t k = 0; k < n; ++k) {
    for (int d = 0; d < L.ndim; ++d) L.stride[k][d] = cstride[k][d];
    L.splat[k] = cstride[k].back() == 0;
  }
  return L;
}

LAZYTENSOR_INLINE RowCursor::RowCursor(const Layout& layout, std::int64_t r0)
    : L_(layout), nin_(layout.stride.size()) {
  const int outer = L_.ndim - 1;
  for (int d = outer - 1; d >= 0; --d) {
    idx_[d] = r0 % L_.size[d];
    r0 /= L_.size[d];
  }
  store_.resize(2 * nin_);
  off_ = store_.data();
  step_ = off_ + nin_;
  for (std::size_t k = 0; k < nin_; ++k) {
    std::int64_t o = 0;
    for (int d = 0; d < outer; ++d) o += idx_[d] * L_.stride[k][d];
    off_[k] = o;
    step_[k] = outer > 0 ? L_.stride[k][outer - 1] : 0;
  }
  if (outer > 0) {
    last_ = idx_[outer - 1];
    last_size_ = L_.size[outer - 1];
  }
}

LAZYTENSOR_INLINE void RowCursor::carry() {
  // The innermost outer dimension wrapped: back to its start, then count up the next ones.
  const int outer = L_.ndim - 1;
  if (outer <= 0) return;
  const auto* stride = L_.stride.data();
  for (std::size_t k = 0; k < nin_; ++k) off_[k] -= step_[k] * (last_size_ - 1);
  last_ = 0;
  for (int d = outer - 2; d >= 0; --d) {
    for (std::size_t k = 0; k < nin_; ++k) off_[k] += stride[k][d];
    if (++idx_[d] < L_.size[d]) return;
    for (std::size_t k = 0; k < nin_; ++k) off_[k] -= stride[k][d] * L_.size[d];
    idx_[d] = 0;
  }
}

}  // namespace lazy::expr
#endif  // LAZYTENSOR_HEADER_DEFINITIONS
