#pragma once
// Evaluators: built per kernel run from a kernel-form expression and the input pointers.
// They carry what nodes do not: pointers, the splat flags, the lane type S, and the
// scalar (coeff) and SIMD (packet) access paths. Eigen's split, in short.

#include <cstdint>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <vector>

#include <xsimd/xsimd.hpp>

#include <lazytensor/expr/kernel_form.hpp>
#include <lazytensor/expr/layout.hpp>

namespace lazy::expr {

/// True when kernels with lane type S use xsimd batches (floating lanes); integer lanes run
/// the scalar loop, which compilers vectorize well enough for their rare use.
template <class S>
inline constexpr bool simd_lane_v = std::is_same_v<S, float> || std::is_same_v<S, double>;

template <class S>
using batch_t = xsimd::batch<S>;

/// Loads a batch of lane type S from storage of type T.
template <class S, class T>
inline batch_t<S> load_lane(const T* p) {
  if constexpr (std::is_same_v<S, T>) {
    return batch_t<S>::load_unaligned(p);
  } else if constexpr (std::is_same_v<T, bool>) {
    // The last batch may run into the buffer's padding, whose bytes can hold any value:
    // read bytes, since loading a bool that is neither 0 nor 1 is undefined behaviour.
    alignas(64) S tmp[batch_t<S>::size];
    const auto* bytes = reinterpret_cast<const unsigned char*>(p);
    for (std::size_t k = 0; k < batch_t<S>::size; ++k) tmp[k] = static_cast<S>(bytes[k] != 0);
    return batch_t<S>::load_aligned(tmp);
  } else {
    alignas(64) S tmp[batch_t<S>::size];
    for (std::size_t k = 0; k < batch_t<S>::size; ++k) tmp[k] = static_cast<S>(p[k]);
    return batch_t<S>::load_aligned(tmp);
  }
}

/// Converts a lane value to storage type T.
template <class T, class S>
inline T to_storage(S v) {
  if constexpr (std::is_same_v<T, bool>) return v != S(0);
  else if constexpr (std::is_same_v<T, bfloat16>) return bfloat16(static_cast<float>(v));
  else return static_cast<T>(v);
}

/// Stores a batch of lane type S to storage of type T.
template <class T, class S>
inline void store_lane(T* p, const batch_t<S>& b) {
  if constexpr (std::is_same_v<S, T>) {
    b.store_unaligned(p);
  } else {
    alignas(64) S tmp[batch_t<S>::size];
    b.store_aligned(tmp);
    for (std::size_t k = 0; k < batch_t<S>::size; ++k) p[k] = to_storage<T>(tmp[k]);
  }
}

template <class S, class K>
struct Eval;

template <class S, Element T>
struct Eval<S, KLeaf<T>> {
  const T* base;
  const T* ptr;
  bool splat;
  int slot;

  Eval(const KLeaf<T>& k, const void* const* ptrs, const char* splats)
      : base(static_cast<const T*>(ptrs[k.slot])), ptr(base), splat(splats[k.slot] != 0), slot(k.slot) {}
  void seek(const std::int64_t* offsets) { ptr = base + offsets[slot]; }
  S coeff(std::int64_t i) const { return static_cast<S>(static_cast<compute_t<T>>(ptr[splat ? 0 : i])); }
  template <bool Contig>
  batch_t<S> packet(std::int64_t i) const {
    if (!Contig && splat) return batch_t<S>(static_cast<S>(static_cast<compute_t<T>>(ptr[0])));
    if constexpr (std::is_same_v<T, bfloat16>) {
      alignas(64) S tmp[batch_t<S>::size];
      for (std::size_t k = 0; k < batch_t<S>::size; ++k) tmp[k] = static_cast<S>(float(ptr[i + k]));
      return batch_t<S>::load_aligned(tmp);
    } else {
      return load_lane<S>(ptr + i);
    }
  }
};

template <class S, Element T>
struct Eval<S, Scalar<T>> {
  S value;
  Eval(const Scalar<T>& s, const void* const*, const char*) : value(static_cast<S>(static_cast<compute_t<T>>(s.value))) {}
  void seek(const std::int64_t*) {}
  S coeff(std::int64_t) const { return value; }
  template <bool Contig>
  batch_t<S> packet(std::int64_t) const {
    return batch_t<S>(value);
  }
};

template <class S, class Op, class... C>
struct Eval<S, KExpr<Op, C...>> {
  std::tuple<Eval<S, C>...> children;

  Eval(const KExpr<Op, C...>& k, const void* const* ptrs, const char* splats)
      : children(std::apply([&](const auto&... ch) { return std::tuple<Eval<S, C>...>{Eval<S, C>(ch, ptrs, splats)...}; },
                            k.children)) {}
  void seek(const std::int64_t* offsets) {
    std::apply([&](auto&... ch) { (ch.seek(offsets), ...); }, children);
  }
  S coeff(std::int64_t i) const {
    return std::apply([&](const auto&... ch) { return Op::apply(ch.coeff(i)...); }, children);
  }
  template <bool Contig>
  batch_t<S> packet(std::int64_t i) const {
    return std::apply([&](const auto&... ch) { return Op::apply(ch.template packet<Contig>(i)...); }, children);
  }
};

/// Outputs at least this large are written with non-temporal stores: they cannot stay in
/// cache anyway, and streaming skips reading each output line before overwriting it.
inline constexpr std::int64_t kStreamingStoreBytes = std::int64_t(32) << 20;

/// Stores a batch at a batch-aligned address, bypassing the cache where the ISA allows.
template <class S>
inline void stream_store(S* p, const batch_t<S>& b) {
#if defined(__AVX512F__)
  if constexpr (batch_t<S>::size * sizeof(S) == 64) {
    if constexpr (std::is_same_v<S, float>) _mm512_stream_ps(p, b);
    else _mm512_stream_pd(p, b);
    return;
  }
#endif
#if defined(__AVX__)
  if constexpr (batch_t<S>::size * sizeof(S) == 32) {
    if constexpr (std::is_same_v<S, float>) _mm256_stream_ps(p, b);
    else _mm256_stream_pd(p, b);
    return;
  }
#endif
#if defined(__SSE2__)
  if constexpr (batch_t<S>::size * sizeof(S) == 16) {
    if constexpr (std::is_same_v<S, float>) _mm_stream_ps(p, b);
    else _mm_stream_pd(p, b);
    return;
  }
#endif
  b.store_aligned(p);
}

/// Orders earlier non-temporal stores before later loads of other threads.
inline void store_fence() {
#if defined(__SSE2__)
  _mm_sfence();
#endif
}

/// Evaluates `k` over the flat element range [b, e) of an output of `n` elements whose
/// inputs are all contiguous or single elements. A range ending at `n` finishes with one
/// whole batch that runs into the buffers' padding instead of a scalar tail. With
/// `Stream`, `out + b` must be batch-aligned and the caller fences after the kernel.
template <class S, class Tout, bool Contig, class K, bool Stream = false>
void eval_flat_range(const Eval<S, K>& ev_in, Tout* out, std::int64_t b, std::int64_t e, std::int64_t n) {
  // A local copy: stores through `out` may alias anything, which would otherwise force a
  // reload of every leaf pointer from *ev_in after each store.
  const Eval<S, K> ev = ev_in;
  std::int64_t i = b;
  if constexpr (simd_lane_v<S>) {
    constexpr std::int64_t W = batch_t<S>::size;
    if constexpr (Stream && std::is_same_v<S, Tout>) {
      for (; i + W <= e; i += W) stream_store<S>(out + i, ev.template packet<Contig>(i));
    }
    for (; i + W <= e; i += W) store_lane<Tout, S>(out + i, ev.template packet<Contig>(i));
    if (i < e && e == n) {
      store_lane<Tout, S>(out + i, ev.template packet<Contig>(i));
      return;
    }
  }
  for (; i < e; ++i) out[i] = to_storage<Tout>(ev.coeff(i));
}

/// Evaluates one row of `len` elements whose leaves were positioned with seek().
template <class S, class Tout, class K>
void eval_row(const Eval<S, K>& ev, Tout* out, std::int64_t len) {
  std::int64_t i = 0;
  if constexpr (simd_lane_v<S>) {
    constexpr std::int64_t W = batch_t<S>::size;
    for (; i + W <= len; i += W) store_lane<Tout, S>(out + i, ev.template packet<false>(i));
  }
  for (; i < len; ++i) out[i] = to_storage<Tout>(ev.coeff(i));
}

/// Evaluates rows [r0, r1) of a layout with several collapsed dimensions.
template <class S, class Tout, class K>
void eval_rows(Eval<S, K>& ev, const Layout& L, Tout* out, std::int64_t r0, std::int64_t r1) {
  const int outer = L.ndim - 1;
  const std::int64_t inner = L.inner();
  const std::size_t nin = L.stride.size();
  std::array<std::int64_t, kMaxRank> idx{};
  std::int64_t rem = r0;
  for (int d = outer - 1; d >= 0; --d) {
    idx[d] = rem % L.size[d];
    rem /= L.size[d];
  }
  std::vector<std::int64_t> off(nin);
  for (std::size_t k = 0; k < nin; ++k) {
    off[k] = 0;
    for (int d = 0; d < outer; ++d) off[k] += idx[d] * L.stride[k][d];
  }
  for (std::int64_t r = r0; r < r1; ++r) {
    ev.seek(off.data());
    eval_row<S, Tout>(ev, out + r * inner, inner);
    // Advance the odometer over the outer dimensions.
    for (int d = outer - 1; d >= 0; --d) {
      for (std::size_t k = 0; k < nin; ++k) off[k] += L.stride[k][d];
      if (++idx[d] < L.size[d]) break;
      for (std::size_t k = 0; k < nin; ++k) off[k] -= L.stride[k][d] * L.size[d];
      idx[d] = 0;
    }
  }
}

}  // namespace lazy::expr
