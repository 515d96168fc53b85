#pragma once
// The packed GEMM for float and double: the right-hand side is packed once per product
// into panels two SIMD registers wide and shared by every row block and thread; each row
// block packs a few rows of the left-hand side at a time and runs a register-tiled
// micro-kernel over all panels. Eigen's GEMM (the other dtypes, thin products) re-packs
// the right-hand side on every call and, on the AVX-512 machine we measure, runs at 60-70%
// of this kernel's rate (docs/architecture.md, "GEMM").
//
// Determinism: every output element is one FMA chain over k in order, split at depth
// blocks fixed by k alone, so the bits depend on the shapes only (not on row blocks,
// threads or which tile an element falls in).

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include <lazytensor/core/simd.hpp>  // (and the x86 intrinsics the target enables)

// Full unrolling keeps the accumulator tile in registers at -O2 too; UNROLL_4 unrolls the
// micro-kernel's depth loop (see there).
#if defined(__clang__)
#define LAZYTENSOR_UNROLL _Pragma("unroll")
#define LAZYTENSOR_UNROLL_4 _Pragma("unroll 4")
#elif defined(__GNUC__)
#define LAZYTENSOR_UNROLL _Pragma("GCC unroll 16")
#define LAZYTENSOR_UNROLL_4 _Pragma("GCC unroll 4")
#else
#define LAZYTENSOR_UNROLL
#define LAZYTENSOR_UNROLL_4
#endif

namespace lazy::detail {

#if defined(__AVX512F__)
/// Transposes 16 registers of 16 32-bit lanes in place: lane j of r[i] moves to lane i of
/// r[j]. Only shuffles, so the lanes move as bits (floats and pairs of bfloat16 alike).
inline void transpose_16x16_registers(__m512 r[16]) {
  __m512 t[16];
  // Pairs of rows interleaved, then pairs of pairs: lane L of r[4i + q] then holds
  // column 4L + q of rows 4i .. 4i + 3.
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  auto pd = [](__m512 x) { return _mm512_castps_pd(x); };
  for (int i = 0; i < 4; ++i) {
    r[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(pd(t[4 * i]), pd(t[4 * i + 2])));
    r[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(pd(t[4 * i]), pd(t[4 * i + 2])));
    r[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(pd(t[4 * i + 1]), pd(t[4 * i + 3])));
    r[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(pd(t[4 * i + 1]), pd(t[4 * i + 3])));
  }
  // Lane L of the four row groups gathered into output row 4L + q.
  for (int q = 0; q < 4; ++q) {
    const __m512 v0 = _mm512_shuffle_f32x4(r[q], r[4 + q], 0x88), w0 = _mm512_shuffle_f32x4(r[q], r[4 + q], 0xDD);
    const __m512 v1 = _mm512_shuffle_f32x4(r[8 + q], r[12 + q], 0x88),
                 w1 = _mm512_shuffle_f32x4(r[8 + q], r[12 + q], 0xDD);
    t[q] = _mm512_shuffle_f32x4(v0, v1, 0x88);
    t[8 + q] = _mm512_shuffle_f32x4(v0, v1, 0xDD);
    t[4 + q] = _mm512_shuffle_f32x4(w0, w1, 0x88);
    t[12 + q] = _mm512_shuffle_f32x4(w0, w1, 0xDD);
  }
  for (int i = 0; i < 16; ++i) r[i] = t[i];
}
#endif

#if defined(__AVX__)
/// Transposes 8 registers of 8 floats in place: lane j of r[i] moves to lane i of r[j].
inline void transpose_8x8_registers(__m256 r[8]) {
  __m256 t[8];
  // Interleave pairs of rows, then pairs of pairs: r[c] then holds column c of rows 0-3 in
  // its low half and column c + 4 in its high half (rows 4-7 in r[c + 4]).
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int h = 0; h < 2; ++h) {
    r[4 * h + 0] = _mm256_shuffle_ps(t[4 * h], t[4 * h + 2], 0x44);
    r[4 * h + 1] = _mm256_shuffle_ps(t[4 * h], t[4 * h + 2], 0xEE);
    r[4 * h + 2] = _mm256_shuffle_ps(t[4 * h + 1], t[4 * h + 3], 0x44);
    r[4 * h + 3] = _mm256_shuffle_ps(t[4 * h + 1], t[4 * h + 3], 0xEE);
  }
  for (int c = 0; c < 4; ++c) {
    t[c] = _mm256_permute2f128_ps(r[c], r[4 + c], 0x20);
    t[c + 4] = _mm256_permute2f128_ps(r[c], r[4 + c], 0x31);
  }
  for (int i = 0; i < 8; ++i) r[i] = t[i];
}
#endif

#if defined(__AVX512F__)
/// Transposes 8 registers of 8 doubles in place: lane j of r[i] moves to lane i of r[j].
inline void transpose_8x8_registers(__m512d r[8]) {
  __m512d t[8], u[8];
  // Pairs of rows interleaved: t[2i] holds the even columns of rows 2i, 2i + 1, t[2i + 1]
  // the odd ones.
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm512_unpacklo_pd(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_pd(r[2 * i], r[2 * i + 1]);
  }
  // 128-bit lanes of two row pairs gathered: u[4h + q] holds, for the four rows 4h .. 4h + 3,
  // columns q' and q' + 4 (q' = 0, 2, 1, 3 for q = 0, 1, 2, 3).
  for (int h = 0; h < 2; ++h) {
    u[4 * h + 0] = _mm512_shuffle_f64x2(t[4 * h], t[4 * h + 2], 0x88);
    u[4 * h + 1] = _mm512_shuffle_f64x2(t[4 * h], t[4 * h + 2], 0xDD);
    u[4 * h + 2] = _mm512_shuffle_f64x2(t[4 * h + 1], t[4 * h + 3], 0x88);
    u[4 * h + 3] = _mm512_shuffle_f64x2(t[4 * h + 1], t[4 * h + 3], 0xDD);
  }
  constexpr int column[4] = {0, 2, 1, 3};
  for (int q = 0; q < 4; ++q) {
    r[column[q]] = _mm512_shuffle_f64x2(u[q], u[4 + q], 0x88);
    r[column[q] + 4] = _mm512_shuffle_f64x2(u[q], u[4 + q], 0xDD);
  }
}
#endif

#if defined(__AVX__)
/// Transposes 4 registers of 4 doubles in place: lane j of r[i] moves to lane i of r[j].
inline void transpose_4x4_registers(__m256d r[4]) {
  const __m256d t0 = _mm256_unpacklo_pd(r[0], r[1]), t1 = _mm256_unpackhi_pd(r[0], r[1]);
  const __m256d t2 = _mm256_unpacklo_pd(r[2], r[3]), t3 = _mm256_unpackhi_pd(r[2], r[3]);
  r[0] = _mm256_permute2f128_pd(t0, t2, 0x20);
  r[1] = _mm256_permute2f128_pd(t1, t3, 0x20);
  r[2] = _mm256_permute2f128_pd(t0, t2, 0x31);
  r[3] = _mm256_permute2f128_pd(t1, t3, 0x31);
}
#endif

/// Packed GEMM kernel for T = float or double (see the file comment).
template <class T>
struct PackedGemm {
  using batch = xsimd::batch<T>;
  static constexpr int kLanes = static_cast<int>(batch::size);
  /// Rows of the register tile: 8 x 2 accumulators need the 32 registers of AVX-512;
  /// 16-register instruction sets (SSE2, AVX2) take 6 x 2: twelve accumulators, two B
  /// registers and one broadcast (BLIS's Haswell/Zen shape), eight FMAs per three loads
  /// and broadcasts where 4 x 2 had eight per six.
  static constexpr int kTileRows = XSIMD_WITH_AVX512F ? 8 : 6;
  /// Columns of the register tile (and of a packed panel): two registers.
  static constexpr int kTileCols = 2 * kLanes;

  /// True when the shapes suit the kernel: narrower or shorter products waste most of a
  /// tile on padding and go to Eigen (a decision made from the shapes alone).
  static bool suits(std::int64_t rows, std::int64_t n) { return n >= kLanes && rows >= kTileRows; }

  /// Depth of one pass over k: the deepest that keeps a packed panel of op(B) (kb rows of
  /// kTileCols values) within 16 KiB, half of a 32 KiB L1, so it stays there while the
  /// tiles of A stream past it: 128 on AVX-512, 256 on AVX2, 512 on SSE2, for floats and
  /// doubles alike (a panel at k = 256 that filled L1 was evicted by every tile; see
  /// docs/architecture.md, "GEMM"). The bound of 4 KiB per packed row of A never binds
  /// first. Split evenly (784 on AVX-512: seven passes of 112, not six of 128 and one of 16)
  /// and even (the bfloat16 kernel halves it into pairs). Where k is split does not change
  /// the bits: partial sums go through memory exactly.
  static std::int64_t depth_block(std::int64_t k) {
    constexpr std::int64_t panel = (16 * 1024) / (kTileCols * std::int64_t(sizeof(T)));
    constexpr std::int64_t limit = std::min<std::int64_t>(panel, 4096 / std::int64_t(sizeof(T)));
    if (k <= limit) return k;
    const std::int64_t blocks = (k + limit - 1) / limit, kc = (k + blocks - 1) / blocks;
    return kc + (kc & 1);
  }

  /// Most rows of op(A) packed at once (whole tiles): their packed block at k's depth block
  /// stays within 192 KiB, so it stays in L2 (512 KiB on a Zen 3) while every panel of op(B)
  /// streams past it. multiply splits more rows into even chunks; all 256 rows of a 256 x
  /// 784 x 256 double product packed at once ran at 0.88x OpenBLAS on a Zen 3.
  static std::int64_t block_rows(std::int64_t k) { return rows_per_block(depth_block(k)); }
  /// The same for a depth block of kc (multiply has it at hand).
  static std::int64_t rows_per_block(std::int64_t kc) {
    const std::int64_t tile_bytes = a_tile_stride(kc) * std::int64_t(sizeof(T));
    return std::max<std::int64_t>(1, (192 * 1024) / tile_bytes) * kTileRows;
  }

  /// Panels of kTileCols columns covering n columns.
  static std::int64_t panels(std::int64_t n) { return (n + kTileCols - 1) / kTileCols; }

  /// Elements of op(B) packed (k x n, columns padded to whole panels).
  static std::int64_t packed_size(std::int64_t k, std::int64_t n) {
    return k * panels(n) * kTileCols;
  }

  /// Packs panels [p0, p1) of op(B) (k x n; stored k x n, or n x k when `transposed`) into
  /// `out` (packed_size elements, aligned): panel p holds columns [p*kTileCols, ...) as k
  /// rows of kTileCols contiguous values, zero past n.
  static void pack_b(const T* b, bool transposed, std::int64_t k, std::int64_t n, T* out,
                     std::int64_t p0, std::int64_t p1) {
    if (!transposed) {
      // Row by row of B across the range's panels, so each source row is read once, front
      // to back. Panel by panel, every 128-byte read jumps a whole row ahead, which the
      // prefetcher follows poorly (256 x 784 from memory: 75 us against 46 us).
      const std::int64_t full = std::min(p1, n / kTileCols);  // panels without padding
      for (std::int64_t kk = 0; kk < k; ++kk) {
        const T* src = b + kk * n;
        for (std::int64_t p = p0; p < full; ++p) {
          T* row = out + (p * k + kk) * kTileCols;
          batch::load_unaligned(src + p * kTileCols).store_aligned(row);
          batch::load_unaligned(src + p * kTileCols + kLanes).store_aligned(row + kLanes);
        }
        for (std::int64_t p = std::max(p0, full); p < p1; ++p) {
          const std::int64_t cols = std::min<std::int64_t>(kTileCols, n - p * kTileCols);
          T* row = out + (p * k + kk) * kTileCols;
          for (std::int64_t j = 0; j < kTileCols; ++j)
            row[j] = j < cols ? src[p * kTileCols + j] : T(0);
        }
      }
      return;
    }
    for (std::int64_t p = p0; p < p1; ++p) {
      const std::int64_t j0 = p * kTileCols, cols = std::min<std::int64_t>(kTileCols, n - j0);
      T* dst = out + p * k * kTileCols;
      // Stored [n, k]: 16 k-values of each column at a time, so each source line is read
      // once while the destination rows are still in cache (16 x 16 register transposes
      // where available).
      for (std::int64_t k0 = 0; k0 < k; k0 += 16) {
        const std::int64_t k1 = std::min<std::int64_t>(k, k0 + 16);
        if (transpose_16x16(b + j0 * k + k0, k, dst + k0 * kTileCols, cols, k1 - k0)) continue;
        if (transpose_narrow_panel(b + j0 * k + k0, k, dst + k0 * kTileCols, cols, k1 - k0)) continue;
        for (std::int64_t j = 0; j < kTileCols; ++j) {
          if (j < cols) {
            const T* src = b + (j0 + j) * k;
            for (std::int64_t kk = k0; kk < k1; ++kk) dst[kk * kTileCols + j] = src[kk];
          } else {
            for (std::int64_t kk = k0; kk < k1; ++kk) dst[kk * kTileCols + j] = T(0);
          }
        }
      }
    }
  }

  /// Rows [r0, r0 + rows) of op(A) * op(B) into c (row-major, n columns, already offset
  /// to row r0). op(A) is m x k, stored m x k or, when `a_transposed`, k x m. `packed_b`
  /// comes from pack_b.
  static void multiply(const T* a, bool a_transposed, std::int64_t m, std::int64_t k,
                       std::int64_t n, const T* packed_b, T* c, std::int64_t r0,
                       std::int64_t rows) {
    if (rows <= 0) return;
    const std::int64_t kc = depth_block(k), np = panels(n);
    const std::int64_t tiles = (rows + kTileRows - 1) / kTileRows;
    // More rows than one packed block of A: even chunks of whole tiles, each a product of its
    // own (the bits do not change: they depend on k's blocks only).
    const std::int64_t chunk_tiles = rows_per_block(kc) / kTileRows;
    if (tiles > chunk_tiles) {
      const std::int64_t chunks = (tiles + chunk_tiles - 1) / chunk_tiles;
      for (std::int64_t q = 0, done = 0; q < chunks; ++q) {
        const std::int64_t end = std::min(rows, (tiles * (q + 1) / chunks) * kTileRows);
        multiply(a, a_transposed, m, k, n, packed_b, c + done * n, r0 + done, end - done);
        done = end;
      }
      return;
    }
    alignas(64) T tile[kTileRows * kTileCols] = {};
    const std::int64_t stride = a_tile_stride(kc);
    thread_local std::vector<T, xsimd::aligned_allocator<T, 64>> packed_a;
    if (static_cast<std::int64_t>(packed_a.size()) < tiles * stride) packed_a.resize(tiles * stride);
    for (std::int64_t k0 = 0; k0 < k; k0 += kc) {
      const std::int64_t kb = std::min(kc, k - k0);
      const bool accumulate = k0 > 0;
      // All rows of the chunk packed first; then each panel of op(B) (kb x 2 registers) is
      // loaded into L1 once and used by every tile of rows, instead of all of op(B) once
      // per tile.
      if (a_transposed) {
        pack_a_transposed(a, m, r0, rows, k0, kb, packed_a.data(), stride);
      } else {
        for (std::int64_t t = 0; t < tiles; ++t)
          pack_a(a, k, r0 + t * kTileRows, std::min<std::int64_t>(kTileRows, rows - t * kTileRows),
                 k0, kb, packed_a.data() + t * stride);
      }
      for (std::int64_t p = 0; p < np; ++p) {
        const std::int64_t j0 = p * kTileCols, tc = std::min<std::int64_t>(kTileCols, n - j0);
        const T* bp = packed_b + p * k * kTileCols + k0 * kTileCols;
        for (std::int64_t t = 0; t < tiles; ++t) {
          const std::int64_t i0 = t * kTileRows, tr = std::min<std::int64_t>(kTileRows, rows - i0);
          const T* ap = packed_a.data() + t * stride;
          T* cp = c + i0 * n + j0;
          if (tr == kTileRows && tc == kTileCols) {
            micro(ap, bp, kb, cp, n, accumulate);
            continue;
          }
          // An edge tile runs the same arithmetic on a full tile in registers' image.
          if (accumulate)
            for (std::int64_t i = 0; i < tr; ++i) std::copy_n(cp + i * n, tc, tile + i * kTileCols);
          // A panel of at most one register's columns (784 = 24.5 panels of 32) does half
          // the FMAs: the padding's half is not computed.
          if (tc <= kLanes)
            micro<1>(ap, bp, kb, tile, kTileCols, accumulate);
          else
            micro(ap, bp, kb, tile, kTileCols, accumulate);
          for (std::int64_t i = 0; i < tr; ++i) std::copy_n(tile + i * kTileCols, tc, cp + i * n);
        }
      }
    }
  }

 private:
  // dst[kk * kTileCols + j] = src[j * ld + kk] for a whole panel (cols == kTileCols = 32)
  // and 16 k-values, with AVX-512 float registers; false (nothing written) otherwise.
  static bool transpose_16x16([[maybe_unused]] const T* src, [[maybe_unused]] std::int64_t ld,
                              [[maybe_unused]] T* dst, std::int64_t cols, std::int64_t depth) {
#if defined(__AVX512F__)
    if constexpr (std::is_same_v<T, float> && kTileCols == 32) {
      if (cols != kTileCols || depth != 16) return false;
      for (int half = 0; half < 2; ++half) {
        __m512 r[16];
        for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(src + (half * 16 + i) * ld);
        transpose_16x16_registers(r);
        for (int i = 0; i < 16; ++i) _mm512_store_ps(dst + i * kTileCols + half * 16, r[i]);
      }
      return true;
    }
#endif
    (void)cols;
    (void)depth;
    return false;
  }

  // The same for a whole panel two registers of W values wide (16 floats on AVX2, 16
  // doubles on AVX-512, 8 on AVX) and a depth that is a multiple of W, through W x W
  // register transposes; false (nothing written) otherwise.
  static bool transpose_narrow_panel([[maybe_unused]] const T* src, [[maybe_unused]] std::int64_t ld,
                                     [[maybe_unused]] T* dst, [[maybe_unused]] std::int64_t cols,
                                     [[maybe_unused]] std::int64_t depth) {
#if defined(__AVX512F__)
    if constexpr (std::is_same_v<T, double> && kTileCols == 16)
      return transpose_panel<8>(src, ld, dst, cols, depth, [](const double* p) { return _mm512_loadu_pd(p); },
                                [](__m512d* r) { transpose_8x8_registers(r); },
                                [](double* p, __m512d v) { _mm512_store_pd(p, v); });
#endif
#if defined(__AVX__)
    // (Not an #elif of the branch above: an unoptimized GCC build hides AVX-512 from xsimd,
    // see core/simd.hpp, so an AVX-512 machine may run 8-wide double panels.)
    if constexpr (std::is_same_v<T, float> && kTileCols == 16)
      return transpose_panel<8>(src, ld, dst, cols, depth, [](const float* p) { return _mm256_loadu_ps(p); },
                                [](__m256* r) { transpose_8x8_registers(r); },
                                [](float* p, __m256 v) { _mm256_store_ps(p, v); });
    if constexpr (std::is_same_v<T, double> && kTileCols == 8)
      return transpose_panel<4>(src, ld, dst, cols, depth, [](const double* p) { return _mm256_loadu_pd(p); },
                                [](__m256d* r) { transpose_4x4_registers(r); },
                                [](double* p, __m256d v) { _mm256_store_pd(p, v); });
#endif
    return false;
  }

  // The loop of transpose_narrow_panel: W x W blocks, `load` reading W values into a
  // register, `transpose` transposing W registers, `store` writing one to aligned memory.
  template <int W, class Load, class Transpose, class Store>
  static bool transpose_panel(const T* src, std::int64_t ld, T* dst, std::int64_t cols, std::int64_t depth, Load load,
                              Transpose transpose, Store store) {
    static_assert(kTileCols == 2 * W);
    if (cols != kTileCols || depth % W != 0) return false;
    for (std::int64_t d = 0; d < depth; d += W)
      for (int half = 0; half < 2; ++half) {
        decltype(load(src)) r[W];
        for (int i = 0; i < W; ++i) r[i] = load(src + (half * W + i) * ld + d);
        transpose(r);
        for (int i = 0; i < W; ++i) store(dst + (d + i) * kTileCols + half * W, r[i]);
      }
    return true;
  }

  // out[kk * kTileRows + i] = src[i * ld + kk] for a whole tile of rows and the first
  // multiple of W of `depth` k-values, by W x W register transposes: 8 x 8 floats for
  // AVX-512's 8-row float tile; 4 x 4 doubles plus the last two rows interleaved for the
  // 6-row double tile of AVX. Returns how many k-values it packed (0: none). Element by
  // element, a row-major A's packing was ~14% of a 256 x 784 x 256 double product on a Zen 3
  // (scattered 8-byte stores); the float 6-row tile of AVX2 showed no such cost, and on a
  // Cascade Lake transposes for AVX-512's 8-row double tile changed nothing measurable
  // (reading A bounded it there). SSE2 packs element by element.
  static std::int64_t transpose_rows([[maybe_unused]] const T* src,
                                     [[maybe_unused]] std::int64_t ld,
                                     [[maybe_unused]] std::int64_t depth, [[maybe_unused]] T* out) {
#if defined(__AVX512F__)
    if constexpr (std::is_same_v<T, float> && kTileRows == 8) {
      const std::int64_t whole = depth / 8 * 8;
      for (std::int64_t kk = 0; kk < whole; kk += 8) {
        __m256 r[8];
        for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(src + i * ld + kk);
        transpose_8x8_registers(r);
        for (int c = 0; c < 8; ++c) _mm256_store_ps(out + (kk + c) * 8, r[c]);
      }
      return whole;
    }
#endif
#if defined(__AVX__)
    if constexpr (std::is_same_v<T, float> && kTileRows == 6) {
      // Eight k-values at a time: the six rows and two zero rows transposed, then each
      // k-value's six floats written by an eight-lane store that the next one overlaps. The
      // last store's two extra lanes land on the next k-value (written after it, by this
      // loop or pack_a's) or in the tile's padding (a_tile_stride). Element by element, the
      // fc1 forward product (256 x 784 x 256) took 3.5% longer on a Zen 4 (AVX2 build).
      const std::int64_t whole = depth / 8 * 8;
      for (std::int64_t kk = 0; kk < whole; kk += 8) {
        __m256 r[8];
        for (int i = 0; i < 6; ++i) r[i] = _mm256_loadu_ps(src + i * ld + kk);
        r[6] = r[7] = _mm256_setzero_ps();
        transpose_8x8_registers(r);
        for (int c = 0; c < 8; ++c) _mm256_storeu_ps(out + (kk + c) * 6, r[c]);
      }
      return whole;
    }
    if constexpr (std::is_same_v<T, double> && kTileRows == 6) {
      const std::int64_t whole = depth / 4 * 4;
      for (std::int64_t kk = 0; kk < whole; kk += 4) {
        __m256d r[4];
        for (int i = 0; i < 4; ++i) r[i] = _mm256_loadu_pd(src + i * ld + kk);
        const __m256d r4 = _mm256_loadu_pd(src + 4 * ld + kk),
                      r5 = _mm256_loadu_pd(src + 5 * ld + kk);
        transpose_4x4_registers(r);
        // k-value kk + c: rows 0-3 in r[c]; rows 4-5 in lo's (c = 0, 2) or hi's (c = 1, 3)
        // low or high half. Six doubles (kTileRows) per k-value, stored one after another.
        const __m256d lo = _mm256_unpacklo_pd(r4, r5), hi = _mm256_unpackhi_pd(r4, r5);
        double* o = out + kk * kTileRows;
        _mm256_storeu_pd(o, r[0]);
        _mm_storeu_pd(o + 4, _mm256_castpd256_pd128(lo));
        _mm256_storeu_pd(o + 6, r[1]);
        _mm_storeu_pd(o + 10, _mm256_castpd256_pd128(hi));
        _mm256_storeu_pd(o + 12, r[2]);
        _mm_storeu_pd(o + 16, _mm256_extractf128_pd(lo, 1));
        _mm256_storeu_pd(o + 18, r[3]);
        _mm_storeu_pd(o + 22, _mm256_extractf128_pd(hi, 1));
      }
      return whole;
    }
#endif
    return 0;
  }

  // Elements from one packed tile of A to the next at depth block kc: a tile's kTileRows x kc
  // values and one cache line more (a multiple of 32 bytes, as transpose_rows's aligned
  // stores need). Without the line, tiles sit a power of two apart (4 KiB for 8 floats x 128)
  // and every tile's lines map to the same L1 set, so packing a transposed A, which writes to
  // all tiles at once, evicted its own lines before filling them: 23% of the samples of a
  // 784 x 256 x 256 product on a Zen 5 (x^T g1; 0.81x OpenBLAS before, 1.00-1.08x after,
  // benchmarks/results.md).
  static std::int64_t a_tile_stride(std::int64_t kc) { return kTileRows * kc + 64 / std::int64_t(sizeof(T)); }

  // Rows [r0, r0 + rows) and depth [k0, k0 + kb) of op(A) stored k x m (transposed), into
  // consecutive tiles `stride` apart (zero past rows). Eight stored rows of A at a time are
  // dealt out to the tiles, so each tile receives eight consecutive k-values (8 x kTileRows
  // values, several cache lines) in one go while the eight source rows stream front to
  // back. Tile by tile, every tile re-read a line per k at a stride of m, which for m a
  // power of two (2 KiB for 256 doubles) falls into one or two L1 sets; row by row, each
  // tile's line was half-written and evicted between halves.
  static void pack_a_transposed(const T* a, std::int64_t m, std::int64_t r0, std::int64_t rows,
                                std::int64_t k0, std::int64_t kb, T* out, std::int64_t stride) {
    const std::int64_t whole = rows / kTileRows, tail = rows - whole * kTileRows;
    constexpr std::int64_t kStep = 8;
    for (std::int64_t kq = 0; kq < kb; kq += kStep) {
      const std::int64_t kend = std::min(kb, kq + kStep);
      // A fixed-length copy: one vector move, not a library call (an element loop compiles
      // to kTileRows scalar moves, src and dst may alias as far as GCC knows).
      for (std::int64_t t = 0; t < whole; ++t)
        for (std::int64_t kk = kq; kk < kend; ++kk)
          std::memcpy(out + t * stride + kk * kTileRows, a + (k0 + kk) * m + r0 + t * kTileRows,
                      sizeof(T) * kTileRows);
      if (tail > 0)
        for (std::int64_t kk = kq; kk < kend; ++kk) {
          const T* src = a + (k0 + kk) * m + r0 + whole * kTileRows;
          for (int i = 0; i < kTileRows; ++i)
            out[whole * stride + kk * kTileRows + i] = i < tail ? src[i] : T(0);
        }
    }
  }

  // Rows [row, row + tr) and depth [k0, k0 + kb) of op(A) stored m x k, k-major in tiles of
  // kTileRows (zero past tr).
  static void pack_a(const T* a, std::int64_t k, std::int64_t row, std::int64_t tr, std::int64_t k0,
                     std::int64_t kb, T* out) {
    std::int64_t done = 0;
    if (tr == kTileRows) done = transpose_rows(a + row * k + k0, k, kb, out);
    for (std::int64_t i = 0; i < kTileRows; ++i) {
      if (i < tr) {
        const T* src = a + (row + i) * k + k0;
        for (std::int64_t kk = done; kk < kb; ++kk) out[kk * kTileRows + i] = src[kk];
      } else {
        for (std::int64_t kk = 0; kk < kb; ++kk) out[kk * kTileRows + i] = T(0);
      }
    }
  }

  // One tile of kTileRows x kRegs registers (the first kRegs * kLanes columns of a panel):
  // c (row stride ldc) = [c +] ap * bp over kb.
  template <int kRegs = 2>
  static void micro(const T* __restrict ap, const T* __restrict bp, std::int64_t kb, T* c,
                    std::int64_t ldc, bool accumulate) {
    static_assert(kRegs == 1 || kRegs == 2);
    batch acc[kTileRows][kRegs];
    LAZYTENSOR_UNROLL
    for (int i = 0; i < kTileRows; ++i) {
      LAZYTENSOR_UNROLL
      for (int r = 0; r < kRegs; ++r)
        acc[i][r] = accumulate ? batch::load_unaligned(c + i * ldc + r * kLanes) : batch(T(0));
    }
    // Unrolled by 4 (measured: 14-15% faster in double, 2-5% in float, on a Cascade Lake,
    // AVX-512 and AVX2 builds; 2 and 8 were no better). A step issues ~23 (6 x 2 tile) or
    // ~29 (8 x 2) uops, three of them the loop's own counter, pointer and branch, against 6
    // or 8 cycles of FMAs at 4 uops per cycle: little slack, which the unrolling restores
    // (our reading; this machine's counters are not visible to measure it).
    LAZYTENSOR_UNROLL_4
    for (std::int64_t kk = 0; kk < kb; ++kk) {
      batch b[kRegs];
      LAZYTENSOR_UNROLL
      for (int r = 0; r < kRegs; ++r) b[r] = batch::load_aligned(bp + kk * kTileCols + r * kLanes);
      LAZYTENSOR_UNROLL
      for (int i = 0; i < kTileRows; ++i) {
        const batch av(ap[kk * kTileRows + i]);
        LAZYTENSOR_UNROLL
        for (int r = 0; r < kRegs; ++r) acc[i][r] = xsimd::fma(av, b[r], acc[i][r]);
      }
    }
    LAZYTENSOR_UNROLL
    for (int i = 0; i < kTileRows; ++i) {
      LAZYTENSOR_UNROLL
      for (int r = 0; r < kRegs; ++r) acc[i][r].store_unaligned(c + i * ldc + r * kLanes);
    }
  }
};

}  // namespace lazy::detail

#undef LAZYTENSOR_UNROLL
#undef LAZYTENSOR_UNROLL_4
