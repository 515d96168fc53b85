#pragma once
// Evaluators: built per kernel run from a kernel-form expression and the input pointers.
// They carry what nodes do not: pointers, the splat flags, the lane type S, and the
// scalar (coeff) and SIMD (packet) access paths. Eigen's split, in short.

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <type_traits>

#include <lazytensor/core/simd.hpp>

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

/// Bytes a single-element input's broadcast copies take: one batch of lanes in its storage
/// type (at most 16 lanes of an 8-byte type).
inline constexpr std::size_t kSplatBytes = 128;

/// What an evaluator reads: per input slot, the data pointer and whether it is a single
/// element broadcast over the range (splat); `room` holds kSplatBytes per slot for the
/// broadcast copies of splat inputs (SplatRoom).
struct EvalInputs {
  const void* const* ptrs;
  const char* splats;
  std::byte* room;
};

/// Stack room for the broadcast copies of kernel K's splat inputs, kSplatBytes per slot.
/// Left uninitialized: only the blocks of splat inputs are written, by their leaves.
template <class K>
struct SplatRoom {
  static constexpr std::size_t kSlots = leaf_count<K>::value ? leaf_count<K>::value : 1;
  alignas(64) std::byte bytes[kSlots * kSplatBytes];
};

/// Fills a kSplatBytes block with copies of the `size`-byte element at `element`. The
/// pattern is built in a local buffer and copied out whole, so the block is written with
/// full-width stores, which the batch loads that follow read back forwarded (narrower
/// stores cannot forward to a wider load: a stall on every row of the rows path). Not a
/// template and not inlined: the leaves of integer, bool and bfloat16 inputs call it.
[[gnu::noinline]] inline void fill_splat(void* block, const void* element, std::size_t size) {
  alignas(64) unsigned char pattern[kSplatBytes];
  std::memcpy(pattern, element, size);
  for (std::size_t n = size; n < kSplatBytes; n *= 2) std::memcpy(pattern + n, pattern, n);
  std::memcpy(block, pattern, kSplatBytes);
}

template <class S, class K>
struct Eval;

/// A leaf reads element i at ptr[i * step]. A splat input points at a batch of copies of
/// its element with step 0, so a loop serves both kinds of input without a branch per
/// leaf; the step is loop-invariant, so compilers bump one pointer per leaf and batch. A
/// loop that knows every input is contiguous reads ptr[i] instead (packet<true>), one
/// index for all leaves, for the flat loop of the common case.
template <class S, Element T>
struct Eval<S, KLeaf<T>> {
  static constexpr bool simd = simd_lane_v<S>;
  static_assert((simd ? batch_t<S>::size : 1) * sizeof(T) <= kSplatBytes,
                "a batch of copies must fit in kSplatBytes");
  const T* base;
  const T* ptr;
  T* copies;  ///< this slot's block of the room (used when the input is a splat)
  std::int64_t step;
  int slot;

  Eval(const KLeaf<T>& k, const EvalInputs& in)
      : base(static_cast<const T*>(in.ptrs[k.slot])),
        ptr(base),
        copies(reinterpret_cast<T*>(in.room + static_cast<std::size_t>(k.slot) * kSplatBytes)),
        step(in.splats[k.slot] ? 0 : 1),
        slot(k.slot) {
    if (!step) broadcast(base);
  }
  /// Moves to a row (offsets per slot); a splat input's copies take the row's element.
  void seek(const std::int64_t* offsets) {
    ptr = base + offsets[slot];
    if (!step) broadcast(ptr);
  }
  S coeff(std::int64_t i) const { return static_cast<S>(static_cast<compute_t<T>>(ptr[i * step])); }
  /// `Contig`: the caller knows no input is a splat (step 1), which saves the compiler a
  /// pointer per leaf.
  template <bool Contig>
  batch_t<S> packet(std::int64_t i) const {
    const T* p = Contig ? ptr + i : ptr + i * step;
    if constexpr (std::is_same_v<T, bfloat16>) {
      alignas(64) S tmp[batch_t<S>::size];
      for (std::size_t k = 0; k < batch_t<S>::size; ++k) tmp[k] = static_cast<S>(float(p[k]));
      return batch_t<S>::load_aligned(tmp);
    } else {
      return load_lane<S>(p);
    }
  }
  /// The batch at i with only its first n lanes read (n < the batch's width; the others 0):
  /// a range's tail that must not read past its end (eval_range).
  template <bool Contig>
  batch_t<S> packet_n(std::int64_t i, std::int64_t n) const {
    const T* p = Contig ? ptr + i : ptr + i * step;
    alignas(64) S tmp[batch_t<S>::size] = {};
    for (std::int64_t k = 0; k < n; ++k) tmp[k] = static_cast<S>(static_cast<compute_t<T>>(p[k]));
    return batch_t<S>::load_aligned(tmp);
  }

 private:
  void broadcast(const T* element) {
    if constexpr (simd_lane_v<T>) {
      // Inline whole-batch stores: the rows path refills every row.
      for (std::size_t k = 0; k < kSplatBytes / sizeof(T); k += batch_t<T>::size)
        batch_t<T>(*element).store_aligned(copies + k);
    } else {
      fill_splat(copies, element, sizeof(T));
    }
    ptr = copies;
  }
};

template <class S, Element T>
struct Eval<S, Scalar<T>> {
  static constexpr bool simd = simd_lane_v<S>;
  S value;
  Eval(const Scalar<T>& s, const EvalInputs&)
      : value(static_cast<S>(static_cast<compute_t<T>>(s.value))) {}
  void seek(const std::int64_t*) {}
  S coeff(std::int64_t) const { return value; }
  template <bool Contig>
  batch_t<S> packet(std::int64_t) const {
    return batch_t<S>(value);
  }
  template <bool Contig>
  batch_t<S> packet_n(std::int64_t, std::int64_t) const {
    return batch_t<S>(value);
  }
};

// An op node's evaluator holds its children as named members, one specialization per arity
// (every op has one, two or three operands): through std::tuple and std::apply each node
// and method instantiated five layers of library templates (apply, __apply_impl, invoke,
// ...), a third of the compile time of a small program's kernels, and calls nested as deep
// at -O0 (the sanitizer builds).
template <class S, class Op, class C0>
struct Eval<S, KExpr<Op, C0>> {
  static constexpr bool simd = simd_lane_v<S>;
  Eval<S, C0> c0;

  Eval(const KExpr<Op, C0>& k, const EvalInputs& in) : c0(std::get<0>(k.children), in) {}
  void seek(const std::int64_t* offsets) { c0.seek(offsets); }
  S coeff(std::int64_t i) const { return Op::apply(c0.coeff(i)); }
  template <bool Contig>
  batch_t<S> packet(std::int64_t i) const {
    return Op::apply(c0.template packet<Contig>(i));
  }
  template <bool Contig>
  batch_t<S> packet_n(std::int64_t i, std::int64_t n) const {
    return Op::apply(c0.template packet_n<Contig>(i, n));
  }
};

template <class S, class Op, class C0, class C1>
struct Eval<S, KExpr<Op, C0, C1>> {
  static constexpr bool simd = simd_lane_v<S>;
  Eval<S, C0> c0;
  Eval<S, C1> c1;

  Eval(const KExpr<Op, C0, C1>& k, const EvalInputs& in)
      : c0(std::get<0>(k.children), in), c1(std::get<1>(k.children), in) {}
  void seek(const std::int64_t* offsets) {
    c0.seek(offsets);
    c1.seek(offsets);
  }
  S coeff(std::int64_t i) const { return Op::apply(c0.coeff(i), c1.coeff(i)); }
  template <bool Contig>
  batch_t<S> packet(std::int64_t i) const {
    return Op::apply(c0.template packet<Contig>(i), c1.template packet<Contig>(i));
  }
  template <bool Contig>
  batch_t<S> packet_n(std::int64_t i, std::int64_t n) const {
    return Op::apply(c0.template packet_n<Contig>(i, n), c1.template packet_n<Contig>(i, n));
  }
};

template <class S, class Op, class C0, class C1, class C2>
struct Eval<S, KExpr<Op, C0, C1, C2>> {
  static constexpr bool simd = simd_lane_v<S>;
  Eval<S, C0> c0;
  Eval<S, C1> c1;
  Eval<S, C2> c2;

  Eval(const KExpr<Op, C0, C1, C2>& k, const EvalInputs& in)
      : c0(std::get<0>(k.children), in),
        c1(std::get<1>(k.children), in),
        c2(std::get<2>(k.children), in) {}
  void seek(const std::int64_t* offsets) {
    c0.seek(offsets);
    c1.seek(offsets);
    c2.seek(offsets);
  }
  S coeff(std::int64_t i) const { return Op::apply(c0.coeff(i), c1.coeff(i), c2.coeff(i)); }
  template <bool Contig>
  batch_t<S> packet(std::int64_t i) const {
    return Op::apply(c0.template packet<Contig>(i), c1.template packet<Contig>(i), c2.template packet<Contig>(i));
  }
  template <bool Contig>
  batch_t<S> packet_n(std::int64_t i, std::int64_t n) const {
    return Op::apply(c0.template packet_n<Contig>(i, n), c1.template packet_n<Contig>(i, n), c2.template packet_n<Contig>(i, n));
  }
};

// ---- exact (per-node) evaluation -------------------------------------------------------
// PyTorch computes each op in its own type. One floating lane for a whole kernel matches
// that for floating values (a wider lane only rounds later), but not for integers, which a
// float lane cannot hold above 2^24 (2^53 for double): where(x > 0, i64_a, i64_b) or
// (i64_a + i64_b) * 0.5 must stay exact. Nor for an int32 op in an int64 lane (it wraps
// at 2^31 in PyTorch), nor for bool + bool (true in PyTorch, 2 in any wider lane). So
// kernels that mix int32/int64 values with a floating lane, integer kernels with any op,
// and kernels adding bools evaluate node by node, each op in its own type, on the scalar
// path; every other kernel keeps the single SIMD lane.

/// True when K holds an int32 or int64 value anywhere (leaf, scalar or op result).
template <class K>
struct has_integral : std::bool_constant<is_integral_v<typename K::value_type>> {};
template <class Op, class... C>
struct has_integral<KExpr<Op, C...>>
    : std::bool_constant<is_integral_v<typename KExpr<Op, C...>::value_type> || (has_integral<C>::value || ...)> {};

/// True when K adds bools: the only op with a bool result that can leave {0, 1} in a wider
/// lane (subtraction and negation of bools do not compile; products, extrema, comparisons
/// and casts of 0/1 values stay 0/1).
template <class K>
struct has_bool_sum : std::false_type {};
template <class Op, class... C>
struct has_bool_sum<KExpr<Op, C...>>
    : std::bool_constant<(std::is_same_v<Op, ops::Add> &&
                          std::is_same_v<typename KExpr<Op, C...>::value_type, bool>) ||
                         (has_bool_sum<C>::value || ...)> {};

template <class K>
struct is_op_node : std::false_type {};
template <class Op, class... C>
struct is_op_node<KExpr<Op, C...>> : std::true_type {};

/// True when kernel K must use per-node evaluation (see above).
template <class K>
inline constexpr bool needs_exact_v = (simd_lane_v<klane_t<K>> ? has_integral<K>::value
                                                               : is_op_node<K>::value) ||
                                      has_bool_sum<K>::value;

/// The lane a kernel's root produces: the single lane, or (per-node kernels) the lane of
/// the root's own type, so an int64 result is never squeezed through a float.
template <class K>
using kernel_lane_t = std::conditional_t<needs_exact_v<K>, lane_of<typename K::value_type>, klane_t<K>>;

/// Type an op computes in, given its operands' value types (PyTorch: comparisons and
/// where compute in the promoted operand type; everything else in its result type).
template <class Op, class... A>
struct op_compute {
  using type = typename Op::template result<A...>;
};
#define LAZY_PROMOTED_COMPUTE(OP)     \
  template <class A, class B>         \
  struct op_compute<ops::OP, A, B> {  \
    using type = promote_t<A, B>;     \
  };
LAZY_PROMOTED_COMPUTE(Eq)
LAZY_PROMOTED_COMPUTE(Ne)
LAZY_PROMOTED_COMPUTE(Lt)
LAZY_PROMOTED_COMPUTE(Le)
LAZY_PROMOTED_COMPUTE(Gt)
LAZY_PROMOTED_COMPUTE(Ge)
LAZY_PROMOTED_COMPUTE(LogicalAnd)
LAZY_PROMOTED_COMPUTE(LogicalOr)
#undef LAZY_PROMOTED_COMPUTE
template <class A>
struct op_compute<ops::LogicalNot, A> {
  using type = A;
};

/// The type an op of integer compute lane L runs in: int32 ops in int64, whose result then
/// narrows modulo 2^32 (C++20 conversions wrap), as PyTorch's int32 arithmetic wraps;
/// sums of two int32 values and their products fit. Others as they are.
template <class L>
using exact_lane_t = std::conditional_t<std::is_same_v<L, std::int32_t>, std::int64_t, L>;

/// Ops whose int64 results wrap modulo 2^64 in PyTorch: computed on the unsigned type, where
/// C++ defines that, instead of overflowing a signed one (undefined behaviour).
template <class Op>
inline constexpr bool wraps_v =
    std::is_same_v<Op, ops::Add> || std::is_same_v<Op, ops::Sub> || std::is_same_v<Op, ops::Mul> ||
    std::is_same_v<Op, ops::Neg> || std::is_same_v<Op, ops::Square>;

/// Op applied to values in lane L, integers wrapping as PyTorch's (see above).
template <class Op, class L, class... A>
inline L exact_apply(A... a) {
  if constexpr (std::is_same_v<L, std::int64_t> && wraps_v<Op>) {
    return static_cast<L>(Op::apply(static_cast<std::uint64_t>(static_cast<L>(a))...));
  } else {
    return Op::apply(static_cast<L>(a)...);
  }
}

/// Rounds a value computed in lane L to what a tensor of type V holds, in V's lane.
template <Element V, class L>
inline lane_of<V> round_to(L v) {
  if constexpr (std::is_same_v<V, bool>) return v != L(0) ? 1 : 0;
  else if constexpr (std::is_same_v<V, bfloat16>) return static_cast<float>(bfloat16(static_cast<float>(v)));
  else return static_cast<lane_of<V>>(v);
}

template <class S, class K>
struct ExactEval;

template <class S, Element T>
struct ExactEval<S, KLeaf<T>> : Eval<lane_of<T>, KLeaf<T>> {
  using Eval<lane_of<T>, KLeaf<T>>::Eval;
};
template <class S, Element T>
struct ExactEval<S, Scalar<T>> : Eval<lane_of<T>, Scalar<T>> {
  using Eval<lane_of<T>, Scalar<T>>::Eval;
};

/// Evaluates an op in its own compute type; coeff() returns the op's value in the lane of
/// its result type (S is unused below the root: each node picks its own).
template <class S, class Op, class... C>
struct ExactEval<S, KExpr<Op, C...>> {
  static constexpr bool simd = false;
  using V = typename KExpr<Op, C...>::value_type;
  std::tuple<ExactEval<S, C>...> children;

  ExactEval(const KExpr<Op, C...>& k, const EvalInputs& in)
      : children(detail::unpack(k.children, [&](const auto&... ch) {
          return std::tuple<ExactEval<S, C>...>{ExactEval<S, C>(ch, in)...};
        })) {}
  void seek(const std::int64_t* offsets) {
    detail::unpack(children, [&](auto&... ch) { (ch.seek(offsets), ...); });
  }
  lane_of<V> coeff(std::int64_t i) const {
    return detail::unpack(children, [&](const auto&... ch) { return apply(ch...)(i); });
  }

 private:
  template <class... E>
  auto apply(const E&... ch) const {
    return [&](std::int64_t i) -> lane_of<V> {
      if constexpr (std::is_same_v<Op, ops::Where>) {
        // The condition is tested in its own type (a NaN float is non-zero, not converted).
        const auto& [c, a, b] = std::tie(ch...);
        using L = lane_of<op_compute_t<ops::Where, typename C::value_type...>>;
        return round_to<V>(c.coeff(i) != 0 ? static_cast<L>(a.coeff(i)) : static_cast<L>(b.coeff(i)));
      } else if constexpr (is_cast<Op>::value) {
        // A conversion is a store into the target type (truncation, != 0, rounding).
        return round_to<V>(to_storage<V>((ch.coeff(i), ...)));
      } else {
        using L = exact_lane_t<lane_of<typename op_compute<Op, typename C::value_type...>::type>>;
        return round_to<V>(exact_apply<Op, L>(ch.coeff(i)...));
      }
    };
  }
  template <class O>
  struct is_cast : std::false_type {};
  template <Element U>
  struct is_cast<ops::Cast<U>> : std::true_type {};
  template <class O, class... A>
  using op_compute_t = typename op_compute<O, A...>::type;
};

/// Root evaluator of a kernel with lane S: converts the exact root value to S.
template <class S, class K>
struct ExactRoot {
  static constexpr bool simd = false;
  ExactEval<S, K> ev;
  ExactRoot(const K& k, const EvalInputs& in) : ev(k, in) {}
  void seek(const std::int64_t* offsets) { ev.seek(offsets); }
  S coeff(std::int64_t i) const { return static_cast<S>(ev.coeff(i)); }
};

/// The evaluator a kernel of lane S over K uses.
template <class S, class K>
using Evaluator = std::conditional_t<needs_exact_v<K>, ExactRoot<S, K>, Eval<S, K>>;

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

/// Keeps the optimizer from inlining a kernel loop into each of its callers: the loop is
/// called once per task, so the call costs nothing, and every inlined copy of an
/// expression's SIMD body would be compiled again.
///
/// GCC also gets no SLP vectorization inside them: the bodies are already xsimd batches,
/// and GCC 12 at -O3 with AVX-512 miscompiled the double sigmoid gradient kernel (lanes
/// 1-7 of the first batch came out 0) when both its loop and SLP vectorizers ran; either
/// off fixes it (tests/expr/o3_kernels.cpp checks at -O3).
///
/// LAZY_SCALAR_LOOP: a kernel loop over scalar lanes that GCC gets without either
/// vectorizer (GCC 12 at -O3 miscompiled the integer reductions' loop, reduction_node.hpp).
#if defined(__GNUC__) && !defined(__clang__)
#define LAZY_KERNEL_LOOP __attribute__((noinline, optimize("no-tree-slp-vectorize")))
#define LAZY_SCALAR_LOOP __attribute__((noinline, optimize("no-tree-vectorize")))
#elif defined(__GNUC__)
#define LAZY_KERNEL_LOOP __attribute__((noinline))
#define LAZY_SCALAR_LOOP __attribute__((noinline))
#else
#define LAZY_KERNEL_LOOP
#define LAZY_SCALAR_LOOP
#endif

/// Copies `bytes` bytes from `src` to `dst` bypassing the cache where the ISA allows
/// (both 64-byte aligned; the caller fences). Moves bits, whatever they encode. Not
/// inlined: it would crowd the registers of the slice loop calling it.
LAZY_KERNEL_LOOP inline void stream_copy(void* dst, const void* src, std::size_t bytes) {
  using B = batch_t<float>;
  constexpr std::size_t kBatchBytes = B::size * sizeof(float);
  auto* d = static_cast<float*>(dst);
  const auto* s = static_cast<const float*>(src);
  const std::size_t whole = bytes / kBatchBytes * kBatchBytes;
  for (std::size_t i = 0; i < whole / sizeof(float); i += B::size)
    stream_store<float>(d + i, B::load_aligned(s + i));
  if (whole < bytes)
    std::memcpy(static_cast<std::byte*>(dst) + whole, static_cast<const std::byte*>(src) + whole,
                bytes - whole);
}

/// Stores lanes [first, first + count) of `b` to `p` (the tail of a range).
template <class Tout, class S>
inline void store_partial(Tout* p, const batch_t<S>& b, std::int64_t first, std::int64_t count) {
  alignas(64) S tmp[batch_t<S>::size];
  b.store_aligned(tmp);
  for (std::int64_t k = 0; k < count; ++k) p[k] = to_storage<Tout>(tmp[first + k]);
}

/// Evaluates elements [b, e) of a kernel (indices relative to the evaluator's leaf
/// positions) into out[0, e - b). `Contig`: no input is a splat. The tail is one whole
/// batch of which only the owned lanes are stored, so no scalar copy of the expression is
/// compiled. `bounded`: the tail reads nothing past e, because elements there may belong to
/// another task that is writing them at that moment (the rows a fused producer is computing,
/// an output written in place over its input), a data race even though those lanes would be
/// thrown away. Its batch then ends at e when the range holds one (lanes already stored are
/// evaluated again and not stored), and a shorter range reads its leaves' first lanes only
/// (packet_n, several times slower than a batch load). Unbounded (a row with more rows of
/// the same task after it), the tail reads on into what follows, at worst a buffer's padding.
/// With `stream` (S == Tout only), stores bypass the cache (out batch-aligned; the caller
/// fences): a loop-invariant branch per batch rather than a loop of its own.
template <class S, class Tout, bool Contig, class Ev>
LAZY_KERNEL_LOOP void eval_range(const Ev& ev_in, Tout* out, std::int64_t b, std::int64_t e,
                                 bool stream, bool bounded = true) {
  // A local copy: stores through `out` may alias anything, which would otherwise force a
  // reload of every leaf pointer from *ev_in after each store.
  const Ev ev = ev_in;
  out -= b;
  if constexpr (Ev::simd) {
    constexpr std::int64_t W = batch_t<S>::size;
    std::int64_t i = b;
    for (; i + W <= e; i += W) {
      const batch_t<S> v = ev.template packet<Contig>(i);
      if constexpr (std::is_same_v<S, Tout>) {
        if (stream)
          stream_store<S>(out + i, v);
        else
          store_lane<Tout, S>(out + i, v);
      } else {
        store_lane<Tout, S>(out + i, v);
      }
    }
    if (i < e) {
      if (!bounded)
        store_partial<Tout, S>(out + i, ev.template packet<Contig>(i), 0, e - i);
      else if (e - b >= W)
        store_partial<Tout, S>(out + i, ev.template packet<Contig>(e - W), i - (e - W), e - i);
      else
        store_partial<Tout, S>(out + i, ev.template packet_n<Contig>(i, e - i), 0, e - i);
    }
  } else {
    for (std::int64_t i = b; i < e; ++i) out[i] = to_storage<Tout>(ev.coeff(i));
  }
}

/// Evaluates rows [r0, r1) of a layout with several collapsed dimensions. A row's tail may
/// read into the next row, which this call evaluates too (and which holds, in an output
/// written in place, the next row's inputs still); only the last row's tail is bounded.
template <class S, class Tout, class Ev>
LAZY_KERNEL_LOOP void eval_rows(Ev& ev, const Layout& L, Tout* out, std::int64_t r0, std::int64_t r1) {
  const std::int64_t inner = L.inner();
  RowCursor row(L, r0);
  for (std::int64_t r = r0; r < r1; ++r, row.next()) {
    ev.seek(row.offsets());
    eval_range<S, Tout, false>(ev, out + r * inner, 0, inner, false, r + 1 == r1);
  }
}

}  // namespace lazy::expr
