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

}  // namespace lazy::expr
#endif  // LAZYTENSOR_HEADER_DEFINITIONS
