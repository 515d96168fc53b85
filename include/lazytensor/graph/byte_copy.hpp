#pragma once
// The byte-copy helpers of the copy nodes (graph/shape_nodes.hpp, graph/index_nodes.hpp):
// one kernel per element size (1, 2, 4, 8 bytes) serves every dtype and keeps the code
// small. The element copy is a constant-size memcpy: one load and one store, valid whatever
// type wrote the buffer.

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include <lazytensor/core/shape.hpp>
#include <lazytensor/core/thread_pool.hpp>
#include <lazytensor/graph/node.hpp>
#include <lazytensor/graph/parallel.hpp>
#include <lazytensor/core/config.hpp>

namespace lazy::graph::detail {

/// Copies one element of N bytes (see the file comment for why memcpy).
template <std::size_t N>
inline void copy_elem(std::byte* dst, const std::byte* src) {
  std::memcpy(dst, src, N);
}

/// Calls f(std::integral_constant<std::size_t, N>{}) for an element size of N bytes, so a
/// kernel is instantiated once per size instead of once per dtype.
template <class F>
void with_elem_size(std::size_t bytes, F&& f) {
  switch (bytes) {
    case 1: f(std::integral_constant<std::size_t, 1>{}); break;
    case 2: f(std::integral_constant<std::size_t, 2>{}); break;
    case 4: f(std::integral_constant<std::size_t, 4>{}); break;
    default: f(std::integral_constant<std::size_t, 8>{}); break;
  }
}

/// A multi-index over `rank` dims (last fastest) that tracks two linear offsets, `a` and
/// `b`, with their own strides: typically an input offset and an output offset.
struct Odometer {
  int rank = 0;
  std::array<std::int64_t, kMaxRank> size{}, stride_a{}, stride_b{}, idx{};
  std::int64_t a = 0, b = 0;

  /// Positions the multi-index at linear position `lin` (row-major over `size`).
  void seek(std::int64_t lin);
  /// Advances by one position (carry from the last dim).
  void next();
};

/// Fills `segs` equal-length output segments of `len` elements each, segment s copied from
/// the contiguous input run starting at element `src_off(s)`. The split across threads is
/// over output elements, not segments, so one huge segment and a million tiny ones both
/// balance.
template <std::size_t N, class SrcOff>
void copy_segments(ThreadPool& pool, std::byte* dst, const std::byte* src, std::int64_t segs, std::int64_t len,
                   const SrcOff& src_off) {
  const std::int64_t n = segs * len;
  if (n == 0) return;
  const std::int64_t tasks = task_count(pool, n, 1.0);
  pool.parallel_for(tasks, [&](std::int64_t t) {
    auto [b, e] = task_range(n, tasks, t);
    if (len == 1) {  // gathers of single elements: no variable-size memcpy per element
      for (std::int64_t f = b; f < e; ++f) copy_elem<N>(dst + f * N, src + src_off(f) * N);
      return;
    }
    while (b < e) {
      const std::int64_t s = b / len, k = b % len, c = std::min(len - k, e - b);
      std::memcpy(dst + b * N, src + (src_off(s) + k) * N, static_cast<std::size_t>(c) * N);
      b += c;
    }
  });
}

inline const std::byte* bytes_of(const NodePtr& n) { return static_cast<const std::byte*>(n->buffer()->data()); }

/// Copies a box of `box` elements per dimension between two row-major arrays of `esize`-byte
/// elements: from `src` (shape `src_shape`) starting at `src_at` to `dst` (shape
/// `dst_shape`) starting at `dst_at`, innermost runs by memcpy.
void copy_box(const std::byte* src, const Shape& src_shape, const std::vector<std::int64_t>& src_at, std::byte* dst,
              const Shape& dst_shape, const std::vector<std::int64_t>& dst_at, const std::vector<std::int64_t>& box,
              std::size_t esize);

}  // namespace lazy::graph::detail

#if LAZYTENSOR_HEADER_DEFINITIONS
namespace lazy::graph::detail {

LAZYTENSOR_INLINE void Odometer::seek(std::int64_t lin) {
  a = b = 0;
  for (int d = rank - 1; d >= 0; --d) {
    idx[d] = lin % size[d];
    lin /= size[d];
    a += idx[d] * stride_a[d];
    b += idx[d] * stride_b[d];
  }
}

LAZYTENSOR_INLINE void Odometer::next() {
  for (int d = rank - 1; d >= 0; --d) {
    ++idx[d];
    a += stride_a[d];
    b += stride_b[d];
    if (idx[d] < size[d]) return;
    a -= stride_a[d] * size[d];
    b -= stride_b[d] * size[d];
    idx[d] = 0;
  }
}

LAZYTENSOR_INLINE void copy_box(const std::byte* src, const Shape& src_shape, const std::vector<std::int64_t>& src_at,
                                        std::byte* dst, const Shape& dst_shape, const std::vector<std::int64_t>& dst_at,
                                        const std::vector<std::int64_t>& box, std::size_t esize) {
  const int rank = src_shape.rank();
  for (auto b : box)
    if (b == 0) return;
  if (rank == 0) {
    std::memcpy(dst, src, esize);
    return;
  }
  // Row-major strides in elements.
  std::vector<std::int64_t> ss(static_cast<std::size_t>(rank), 1), ds(static_cast<std::size_t>(rank), 1);
  for (int d = rank - 1; d-- > 0;) {
    ss[static_cast<std::size_t>(d)] = ss[static_cast<std::size_t>(d) + 1] * src_shape[d + 1];
    ds[static_cast<std::size_t>(d)] = ds[static_cast<std::size_t>(d) + 1] * dst_shape[d + 1];
  }
  const std::size_t run = static_cast<std::size_t>(box.back()) * esize;
  std::vector<std::int64_t> c(static_cast<std::size_t>(rank), 0);  // the last entry stays 0
  for (;;) {
    std::int64_t so = 0, d_o = 0;
    for (int d = 0; d < rank; ++d) {
      so += (src_at[static_cast<std::size_t>(d)] + c[static_cast<std::size_t>(d)]) * ss[static_cast<std::size_t>(d)];
      d_o += (dst_at[static_cast<std::size_t>(d)] + c[static_cast<std::size_t>(d)]) * ds[static_cast<std::size_t>(d)];
    }
    std::memcpy(dst + static_cast<std::size_t>(d_o) * esize, src + static_cast<std::size_t>(so) * esize, run);
    int d = rank - 2;
    for (; d >= 0; --d) {
      if (++c[static_cast<std::size_t>(d)] < box[static_cast<std::size_t>(d)]) break;
      c[static_cast<std::size_t>(d)] = 0;
    }
    if (d < 0) return;
  }
}

}  // namespace lazy::graph::detail
#endif  // LAZYTENSOR_HEADER_DEFINITIONS
