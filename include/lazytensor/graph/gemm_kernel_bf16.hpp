#pragma once
// The bfloat16 GEMM behind autocast (and the products of bfloat16 tensors): each operand is
// rounded to bfloat16 (nearest even) while it is packed, the products accumulate in float,
// and each result is rounded to bfloat16 and held in float. One arithmetic, two paths,
// chosen from the user's flags and, where both are built, the core:
//
//  - native, where AVX512-BF16 is enabled and the core issues vdpbf16ps at the FMA's rate
//    (see native_bf16_gemm): the operands are packed as pairs of bfloat16 along k (a 32-bit
//    word per pair) and vdpbf16ps adds two products per float lane, twice the float
//    kernel's products per instruction;
//  - emulated, everywhere else: the rounded operands stay in float and go through the float
//    kernel (graph/gemm_kernel.hpp) with the two k-values of each pair swapped, so its FMA
//    chain adds the products in vdpbf16ps's order (the odd k of a pair, then the even) and
//    runs at the float rate.
//
// A product of two bfloat16 values is exact in float, so both paths add the same exact
// products in the same order, one rounding each: they agree to the bit for normal values
// (vdpbf16ps flushes denormal inputs and results to zero, including the float partial sums
// it reloads between passes over k; the emulation keeps them).
// The pair layout with vdpbf16ps's semantics spelled out in plain AVX-512 (SoftBf16) runs on
// any AVX-512 machine, so the native path's packing and tiling are tested where the
// instruction is missing.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include <lazytensor/core/bfloat16.hpp>
#include <lazytensor/core/env.hpp>
#include <lazytensor/graph/gemm_kernel.hpp>

namespace lazy::detail {

/// x rounded to bfloat16 (nearest even; a NaN stays a quiet NaN, as lazy::bfloat16) and
/// widened back to float, lane by lane.
template <class A>
xsimd::batch<float, A> round_to_bf16(const xsimd::batch<float, A>& x) {
  using U = xsimd::batch<std::uint32_t, A>;
  const U u = xsimd::bitwise_cast<U>(x);
  const U nearest = (u + U(0x7fffu) + ((u >> 16) & U(1u))) & U(0xffff0000u);
  const U quiet = (u | U(0x00400000u)) & U(0xffff0000u);
  return xsimd::select(xsimd::isnan(x), xsimd::bitwise_cast<xsimd::batch<float, A>>(quiet),
                       xsimd::bitwise_cast<xsimd::batch<float, A>>(nearest));
}

/// Rounds n floats to bfloat16 (held in float): dst may be src.
inline void round_to_bf16(const float* src, float* dst, std::int64_t n) {
  using batch = xsimd::batch<float>;
  constexpr std::int64_t L = batch::size;
  std::int64_t i = 0;
  for (; i + L <= n; i += L) round_to_bf16(batch::load_unaligned(src + i)).store_unaligned(dst + i);
  for (; i < n; ++i) dst[i] = static_cast<float>(bfloat16(src[i]));
}

/// The emulated path: rounded operands, pairs of k swapped, the float kernel.
struct EmulatedBf16Gemm {
  using Float = PackedGemm<float>;
  static constexpr bool kNative = false;

  /// Depth with the last pair completed by a zero.
  static std::int64_t even(std::int64_t k) { return k + (k & 1); }
  static std::int64_t panels(std::int64_t n) { return Float::panels(n); }
  /// Bytes of op(B) packed.
  static std::int64_t packed_bytes(std::int64_t k, std::int64_t n) {
    return Float::packed_size(even(k), n) * std::int64_t(sizeof(float));
  }

  /// Packs panels [p0, p1) of op(B) (k x n; stored n x k when `transposed`) into `out`.
  /// One panel at a time through a scratch of k x one panel (not a copy of B per thread).
  static void pack_b(const float* b, bool transposed, std::int64_t k, std::int64_t n, void* out, std::int64_t p0,
                     std::int64_t p1) {
    const std::int64_t ke = even(k);
    thread_local Scratch scratch;
    float* s = scratch.get(ke * Float::kTileCols);
    for (std::int64_t p = p0; p < p1; ++p) {
      const std::int64_t j0 = p * Float::kTileCols, w = std::min<std::int64_t>(Float::kTileCols, n - j0);
      if (transposed) {
        for (std::int64_t j = 0; j < w; ++j) round_swapped(b + (j0 + j) * k, k, s + j * ke);
      } else {
        for (std::int64_t kk = 0; kk < ke; ++kk) round_row(kk < k ? b + kk * n + j0 : nullptr, w, s + (kk ^ 1) * w);
      }
      Float::pack_b(s, transposed, ke, w, static_cast<float*>(out) + p * ke * Float::kTileCols, 0, 1);
    }
  }

  /// Rows [r0, r0 + rows) of op(A) * op(B), rounded to bfloat16 when `round`, into c
  /// (row-major, n columns, offset to row r0). op(A) is m x k, stored k x m when
  /// `a_transposed`.
  static void multiply(const float* a, bool a_transposed, std::int64_t m, std::int64_t k, std::int64_t n,
                       const void* packed_b, float* c, std::int64_t r0, std::int64_t rows, bool round = true) {
    const std::int64_t ke = even(k);
    thread_local Scratch scratch;
    float* s = scratch.get(rows * ke);
    if (a_transposed) {
      for (std::int64_t kk = 0; kk < ke; ++kk) round_row(kk < k ? a + kk * m + r0 : nullptr, rows, s + (kk ^ 1) * rows);
    } else {
      for (std::int64_t i = 0; i < rows; ++i) round_swapped(a + (r0 + i) * k, k, s + i * ke);
    }
    Float::multiply(s, a_transposed, rows, ke, n, static_cast<const float*>(packed_b), c, 0, rows);
    if (round) round_to_bf16(c, c, rows * n);
  }

 private:
  struct Scratch {
    std::vector<float, xsimd::aligned_allocator<float, 64>> v;
    float* get(std::int64_t n) {
      if (static_cast<std::int64_t>(v.size()) < n) v.resize(static_cast<std::size_t>(n));
      return v.data();
    }
  };

  // dst[0, w) = src rounded, or zeros when src is null (the pad row).
  static void round_row(const float* src, std::int64_t w, float* dst) {
    if (src) {
      round_to_bf16(src, dst, w);
    } else {
      std::fill_n(dst, w, 0.0f);
    }
  }

  // A row of k values rounded with each pair swapped: dst[i ^ 1] = round(src[i]), and
  // dst[k - 1] = 0 when k is odd (the pad before the last value).
  static void round_swapped(const float* src, std::int64_t k, float* dst) {
    using batch = xsimd::batch<float>;
    using U64 = xsimd::batch<std::uint64_t>;
    constexpr std::int64_t L = batch::size;
    std::int64_t i = 0;
    if constexpr (L >= 2) {
      for (; i + L <= k; i += L) {
        const U64 x = xsimd::bitwise_cast<U64>(round_to_bf16(batch::load_unaligned(src + i)));
        xsimd::bitwise_cast<batch>((x << 32) | (x >> 32)).store_unaligned(dst + i);
      }
    }
    if (k & 1) dst[k - 1] = 0.0f;
    for (; i < k; ++i) dst[i ^ 1] = static_cast<float>(bfloat16(src[i]));
  }
};

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__)
#if defined(__AVX512BF16__)
/// vdpbf16ps and vcvtneps2bf16 themselves.
struct NativeBf16 {
  /// 16 floats rounded to bfloat16 (nearest even).
  static __m256i to_bf16(__m512 x) {
    return (__m256i)_mm512_cvtneps_pbh(x);  // NOLINT: a vector bit cast
  }
  /// acc + a.odd * b.odd + a.even * b.even, lane by lane (pairs of bfloat16).
  static __m512 dot(__m512 acc, __m512i a, __m512i b) {
    return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);  // NOLINT: vector bit casts
  }
};
#endif

/// The same two operations in AVX-512F/BW: the rounding of lazy::bfloat16, and vdpbf16ps as
/// Intel defines it (the odd products' sum first; products of bfloat16 are exact in float,
/// so each step is one FMA).
struct SoftBf16 {
  static __m256i to_bf16(__m512 x) {
    const __m512i u = _mm512_castps_si512(x);
    const __m512i nearest = _mm512_add_epi32(
        u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))));
    const __m512i quiet = _mm512_or_si512(u, _mm512_set1_epi32(0x00400000));
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_mask_blend_epi32(nan, nearest, quiet), 16));
  }
  static __m512 dot(__m512 acc, __m512i a, __m512i b) {
    const __m512i high = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
    acc = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_and_si512(a, high)),
                          _mm512_castsi512_ps(_mm512_and_si512(b, high)), acc);
    return _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(a, 16)),
                           _mm512_castsi512_ps(_mm512_slli_epi32(b, 16)), acc);
  }
};

/// The pair layout on AVX-512: an 8 x 32 register tile (sixteen accumulators); a packed
/// panel holds, per pair of k, 32 words (k even in the low half, odd in the high half); a
/// packed tile of A holds, per pair, 8 words. `Isa` is NativeBf16 or SoftBf16.
template <class Isa>
struct PairBf16Gemm {
  static constexpr bool kNative = !std::is_same_v<Isa, SoftBf16>;
  static constexpr int kTileRows = 8;
  static constexpr int kTileCols = 32;

  static std::int64_t pairs(std::int64_t k) { return (k + 1) / 2; }
  static std::int64_t panels(std::int64_t n) { return (n + kTileCols - 1) / kTileCols; }
  static std::int64_t packed_bytes(std::int64_t k, std::int64_t n) {
    return pairs(k) * panels(n) * kTileCols * std::int64_t(sizeof(std::uint32_t));
  }
  /// Pairs per pass over k (the float kernel's depth blocks, halved).
  static std::int64_t pair_block(std::int64_t k) { return PackedGemm<float>::depth_block(2 * pairs(k)) / 2; }

  /// Packs panels [p0, p1) of op(B) (k x n; stored n x k when `transposed`) into `out`.
  static void pack_b(const float* b, bool transposed, std::int64_t k, std::int64_t n, void* out, std::int64_t p0,
                     std::int64_t p1) {
    const std::int64_t np = pairs(k);
    auto* words = static_cast<std::uint32_t*>(out);
    for (std::int64_t p = p0; p < p1; ++p) {
      const std::int64_t j0 = p * kTileCols, cols = std::min<std::int64_t>(kTileCols, n - j0);
      std::uint32_t* dst = words + p * np * kTileCols;
      if (!transposed) {
        // Rows 2q and 2q + 1, 16 columns at a time, interleaved into words.
        for (std::int64_t q = 0; q < np; ++q)
          for (int h = 0; h < 2; ++h) {
            const std::int64_t c0 = h * 16, cn = std::clamp<std::int64_t>(cols - c0, 0, 16);
            const __m256i even = load_row(b, 2 * q, k, n, j0 + c0, cn), odd = load_row(b, 2 * q + 1, k, n, j0 + c0, cn);
            _mm512_store_si512(dst + q * kTileCols + c0, interleave(even, odd));
          }
        continue;
      }
      // Stored [n, k]: a column's pairs are already words in its row; 16 columns x 16 pairs
      // at a time, then a register transpose.
      for (std::int64_t q0 = 0; q0 < np; q0 += 16) {
        const std::int64_t qn = std::min<std::int64_t>(16, np - q0);
        for (int h = 0; h < 2; ++h) {
          __m512 r[16];
          for (int j = 0; j < 16; ++j) {
            const std::int64_t col = h * 16 + j;
            r[j] = col < cols ? _mm512_castsi512_ps(row_words(b + (j0 + col) * k, 2 * q0, k)) : _mm512_setzero_ps();
          }
          transpose_16x16_registers(r);
          for (std::int64_t q = 0; q < qn; ++q) _mm512_store_ps(dst + (q0 + q) * kTileCols + h * 16, r[q]);
        }
      }
    }
  }

  /// Rows [r0, r0 + rows) of op(A) * op(B), rounded to bfloat16 when `round`, into c
  /// (offset to row r0).
  static void multiply(const float* a, bool a_transposed, std::int64_t m, std::int64_t k, std::int64_t n,
                       const void* packed_b, float* c, std::int64_t r0, std::int64_t rows, bool round = true) {
    const std::int64_t np = pairs(k), qc = pair_block(k), npanels = panels(n);
    const std::int64_t tiles = (rows + kTileRows - 1) / kTileRows;
    alignas(64) float tile[kTileRows * kTileCols] = {};
    thread_local std::vector<std::uint32_t, xsimd::aligned_allocator<std::uint32_t, 64>> packed_a;
    if (static_cast<std::int64_t>(packed_a.size()) < tiles * kTileRows * qc)
      packed_a.resize(static_cast<std::size_t>(tiles * kTileRows * qc));
    const auto* words_b = static_cast<const std::uint32_t*>(packed_b);
    for (std::int64_t q0 = 0; q0 < np; q0 += qc) {
      const std::int64_t qb = std::min(qc, np - q0);
      const bool accumulate = q0 > 0, last = round && q0 + qb == np;
      for (std::int64_t t = 0; t < tiles; ++t)
        pack_a(a, a_transposed, m, k, r0 + t * kTileRows, std::min<std::int64_t>(kTileRows, rows - t * kTileRows), q0,
               qb, packed_a.data() + t * kTileRows * qb);
      for (std::int64_t p = 0; p < npanels; ++p) {
        const std::int64_t j0 = p * kTileCols, tc = std::min<std::int64_t>(kTileCols, n - j0);
        const std::uint32_t* bp = words_b + (p * np + q0) * kTileCols;
        for (std::int64_t t = 0; t < tiles; ++t) {
          const std::int64_t i0 = t * kTileRows, tr = std::min<std::int64_t>(kTileRows, rows - i0);
          const std::uint32_t* ap = packed_a.data() + t * kTileRows * qb;
          float* cp = c + i0 * n + j0;
          if (tr == kTileRows && tc == kTileCols) {
            micro(ap, bp, qb, cp, n, accumulate, last);
            continue;
          }
          if (accumulate)
            for (std::int64_t i = 0; i < tr; ++i) std::copy_n(cp + i * n, tc, tile + i * kTileCols);
          micro(ap, bp, qb, tile, kTileCols, accumulate, last);
          for (std::int64_t i = 0; i < tr; ++i) std::copy_n(tile + i * kTileCols, tc, cp + i * n);
        }
      }
    }
  }

 private:
  // Row kk of a k x n matrix, columns [c0, c0 + cn), rounded (zeros past k or cn).
  static __m256i load_row(const float* b, std::int64_t kk, std::int64_t k, std::int64_t n, std::int64_t c0,
                          std::int64_t cn) {
    if (kk >= k || cn <= 0) return _mm256_setzero_si256();
    const __mmask16 mask = static_cast<__mmask16>((1u << cn) - 1u);
    return Isa::to_bf16(_mm512_maskz_loadu_ps(mask, b + kk * n + c0));
  }

  // Words j of (even, odd): even[j] in the low half, odd[j] in the high half.
  static __m512i interleave(__m256i even, __m256i odd) {
    const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(even), odd, 1);
    const __m512i order = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22,
                                           6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    return _mm512_permutexvar_epi16(order, both);
  }

  // The 16 words of a contiguous row from k-value k0 (32 values; zeros past k).
  static __m512i row_words(const float* row, std::int64_t k0, std::int64_t k) {
    const std::int64_t left = std::clamp<std::int64_t>(k - k0, 0, 32);
    const __mmask16 lo = static_cast<__mmask16>(left >= 16 ? 0xffffu : (1u << left) - 1u);
    const __mmask16 hi = static_cast<__mmask16>(left >= 32 ? 0xffffu : left > 16 ? (1u << (left - 16)) - 1u : 0u);
    const __m256i x0 = Isa::to_bf16(_mm512_maskz_loadu_ps(lo, row + k0));
    const __m256i x1 = Isa::to_bf16(_mm512_maskz_loadu_ps(hi, row + k0 + 16));
    return _mm512_inserti64x4(_mm512_castsi256_si512(x0), x1, 1);
  }

  // Rows [row, row + tr) and pairs [q0, q0 + qb) of op(A): out[q * 8 + i] is the word of
  // row i and pair q0 + q (zeros past tr and k).
  static void pack_a(const float* a, bool transposed, std::int64_t m, std::int64_t k, std::int64_t row,
                     std::int64_t tr, std::int64_t q0, std::int64_t qb, std::uint32_t* out) {
    if (transposed) {
      // Stored [k, m]: rows 2q and 2q + 1 give 8 values each; interleaved into 8 words.
      const __mmask16 mask = static_cast<__mmask16>((1u << tr) - 1u);
      const __m256i order = _mm256_set_epi16(15, 7, 14, 6, 13, 5, 12, 4, 11, 3, 10, 2, 9, 1, 8, 0);
      for (std::int64_t q = 0; q < qb; ++q) {
        const std::int64_t kk = 2 * (q0 + q);
        const __m512 even = _mm512_maskz_loadu_ps(mask, a + kk * m + row);
        const __m512 odd = kk + 1 < k ? _mm512_maskz_loadu_ps(mask, a + (kk + 1) * m + row) : _mm512_setzero_ps();
        const __m512 both = _mm512_insertf32x8(even, _mm512_castps512_ps256(odd), 1);
        _mm256_store_si256(reinterpret_cast<__m256i*>(out + q * kTileRows),
                           _mm256_permutexvar_epi16(order, Isa::to_bf16(both)));
      }
      return;
    }
    // Stored [m, k]: each row's pairs are words; 16 pairs of the 8 rows per register
    // transpose (8 rows of zeros).
    for (std::int64_t s = 0; s < qb; s += 16) {
      __m512 r[16];
      for (int i = 0; i < 16; ++i)
        r[i] = i < tr ? _mm512_castsi512_ps(row_words(a + (row + i) * k, 2 * (q0 + s), k)) : _mm512_setzero_ps();
      transpose_16x16_registers(r);
      const std::int64_t qn = std::min<std::int64_t>(16, qb - s);
      for (std::int64_t q = 0; q < qn; ++q)
        _mm256_store_si256(reinterpret_cast<__m256i*>(out + (s + q) * kTileRows),
                           _mm512_castsi512_si256(_mm512_castps_si512(r[q])));
    }
  }

  // x rounded to bfloat16, held in float.
  static __m512 rounded(__m512 x) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(Isa::to_bf16(x)), 16)); }

  // One 8 x 32 tile: c (row stride ldc) = [c +] ap * bp over qb pairs, rounded to bfloat16
  // when it is the `last` pass over k.
  static void micro(const std::uint32_t* __restrict ap, const std::uint32_t* __restrict bp, std::int64_t qb, float* c,
                    std::int64_t ldc, bool accumulate, bool last) {
    __m512 acc[kTileRows][2];
    for (int i = 0; i < kTileRows; ++i) {
      acc[i][0] = accumulate ? _mm512_loadu_ps(c + i * ldc) : _mm512_setzero_ps();
      acc[i][1] = accumulate ? _mm512_loadu_ps(c + i * ldc + 16) : _mm512_setzero_ps();
    }
    for (std::int64_t q = 0; q < qb; ++q) {
      const __m512i b0 = _mm512_load_si512(bp + q * kTileCols), b1 = _mm512_load_si512(bp + q * kTileCols + 16);
      for (int i = 0; i < kTileRows; ++i) {
        const __m512i av = _mm512_set1_epi32(static_cast<int>(ap[q * kTileRows + i]));
        acc[i][0] = Isa::dot(acc[i][0], av, b0);
        acc[i][1] = Isa::dot(acc[i][1], av, b1);
      }
    }
    for (int i = 0; i < kTileRows; ++i) {
      _mm512_storeu_ps(c + i * ldc, last ? rounded(acc[i][0]) : acc[i][0]);
      _mm512_storeu_ps(c + i * ldc + 16, last ? rounded(acc[i][1]) : acc[i][1]);
    }
  }
};
#endif

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__)
/// True when this process runs the native path. vdpbf16ps has two products per float lane,
/// but how often it issues depends on the core: AMD's Zen 4 issues it as often as an FMA
/// (twice the float kernel's products), Intel's Sapphire and Emerald Rapids once every two
/// cycles (measured on Emerald Rapids, 24 independent chains: 80 GFLOP/s against the FMA's
/// 167), half the float rate, where the emulated path keeps ~0.9 of it. So Intel cores take
/// the emulated path; LAZYTENSOR_NATIVE_BF16_GEMM=1 or 0 overrides. Decided once per
/// process: a packing and its multiplies must use the same layout.
inline bool native_bf16_gemm() {
  static const bool native = [] {
    if (const auto forced = core::env_switch("LAZYTENSOR_NATIVE_BF16_GEMM")) return *forced;
    __builtin_cpu_init();
    return !__builtin_cpu_is("intel");
  }();
  return native;
}

/// The bfloat16 GEMM of this build: the native or the emulated path, per native_bf16_gemm().
struct Bf16Gemm {
  using Native = PairBf16Gemm<NativeBf16>;
  using Emulated = EmulatedBf16Gemm;

  static bool native() { return native_bf16_gemm(); }
  static std::int64_t panels(std::int64_t n) { return native() ? Native::panels(n) : Emulated::panels(n); }
  static std::int64_t packed_bytes(std::int64_t k, std::int64_t n) {
    return native() ? Native::packed_bytes(k, n) : Emulated::packed_bytes(k, n);
  }
  static void pack_b(const float* b, bool transposed, std::int64_t k, std::int64_t n, void* out, std::int64_t p0,
                     std::int64_t p1) {
    if (native()) {
      Native::pack_b(b, transposed, k, n, out, p0, p1);
    } else {
      Emulated::pack_b(b, transposed, k, n, out, p0, p1);
    }
  }
  static void multiply(const float* a, bool a_transposed, std::int64_t m, std::int64_t k, std::int64_t n,
                       const void* packed_b, float* c, std::int64_t r0, std::int64_t rows, bool round = true) {
    if (native()) {
      Native::multiply(a, a_transposed, m, k, n, packed_b, c, r0, rows, round);
    } else {
      Emulated::multiply(a, a_transposed, m, k, n, packed_b, c, r0, rows, round);
    }
  }
};
#else
/// The bfloat16 GEMM of this build: the emulated path (no AVX512-BF16 in the flags).
struct Bf16Gemm : EmulatedBf16Gemm {
  static constexpr bool native() { return false; }
};
#endif

}  // namespace lazy::detail
