#pragma once
// Reduction operators of the collectives (xm.REDUCE_SUM, ...) and the element kernels that
// combine replica inputs.
//
// Semantics, per dtype:
//  - float, double: Sum, Mul, Min, Max; Min/Max propagate NaN (torch.minimum/maximum).
//  - bfloat16: as float, accumulated in float and rounded once at the end.
//  - int32, int64: Sum and Mul wrap around on overflow (two's complement, as torch);
//    And/Or are bitwise; Min, Max.
//  - bool: And/Or are logical; Sum acts as Or and Mul as And, as torch.distributed treats
//    bool tensors (the result stays bool); Min = And, Max = Or.
//  - `scale` multiplies the reduced value (in float for float/bfloat16, in double for
//    double); integral and bool tensors accept scale 1 only (DTypeError otherwise), since
//    the scaled value could not be stored in them.
// Inputs are always combined in rank order, ((x0 op x1) op x2) ..., element by element, so
// the result does not depend on timing and is the same on every replica.

#include <algorithm>
#include <cstdint>
#include <string>
#include <type_traits>

#include <lazytensor/core/config.hpp>
#include <lazytensor/core/dtype.hpp>
#include <lazytensor/core/error.hpp>
#include <lazytensor/expr/evaluator.hpp>

namespace lazy {

/// Reduction of an all_reduce / reduce_scatter (xm.REDUCE_SUM, REDUCE_MUL, ...).
enum class ReduceOp { Sum, Mul, And, Or, Min, Max };

/// Lower-case name ("sum", "mul", ...).
std::string reduce_op_name(ReduceOp op);

namespace dist::detail {

/// Throws DTypeError when `op` or `scale` does not apply to element type T (see the file
/// comment); `where` names the collective.
template <Element T>
void check_reduction(ReduceOp op, double scale, const char* where) {
  // The message is built only on failure: this runs for every traced collective.
  auto what = [&] {
    return std::string(where) + "(" + reduce_op_name(op) + ") on a " + dtype_name(dtype_of<T>()) +
           " tensor";
  };
  if (static_cast<unsigned>(op) > static_cast<unsigned>(ReduceOp::Max)) {
    throw Error(std::string(where) + ": invalid ReduceOp " + std::to_string(static_cast<int>(op)) +
                " (expected Sum, Mul, And, Or, Min or Max)");
  }
  if constexpr (is_floating_v<T>) {
    if (op == ReduceOp::And || op == ReduceOp::Or) {
      throw DTypeError(what() + ": and/or need an integral or bool tensor (found a floating dtype)");
    }
  } else if (scale != 1.0) {
    throw DTypeError(what() + ": scale must be 1 for integral and bool tensors, got " +
                     std::to_string(scale));
  }
}

/// Type in which values of T are combined.
template <Element T>
using accum_t = std::conditional_t<std::is_same_v<T, bool>, std::uint8_t, compute_t<T>>;

/// acc = acc op x for one element (the op is a template argument so the loops vectorize).
template <ReduceOp Op, class A>
inline A combine(A acc, A x) {
  if constexpr (std::is_same_v<A, std::uint8_t>) {  // bool stored as 0/1 bytes
    if constexpr (Op == ReduceOp::Sum || Op == ReduceOp::Or || Op == ReduceOp::Max)
      return acc | x;
    else
      return acc & x;
  } else if constexpr (std::is_integral_v<A>) {
    using U = std::make_unsigned_t<A>;  // wrap-around without undefined behaviour
    if constexpr (Op == ReduceOp::Sum)
      return static_cast<A>(static_cast<U>(acc) + static_cast<U>(x));
    else if constexpr (Op == ReduceOp::Mul)
      return static_cast<A>(static_cast<U>(acc) * static_cast<U>(x));
    else if constexpr (Op == ReduceOp::And)
      return acc & x;
    else if constexpr (Op == ReduceOp::Or)
      return acc | x;
    else if constexpr (Op == ReduceOp::Min)
      return std::min(acc, x);
    else
      return std::max(acc, x);
  } else {
    if constexpr (Op == ReduceOp::Sum)
      return acc + x;
    else if constexpr (Op == ReduceOp::Mul)
      return acc * x;
    // NaN wins: keep acc when it is NaN or smaller, else take x (NaN or not).
    else if constexpr (Op == ReduceOp::Min)
      return (acc < x || acc != acc) ? acc : x;
    else
      return (acc > x || acc != acc) ? acc : x;  // Max (And/Or rejected for floats)
  }
}

template <Element T>
inline accum_t<T> load_acc(const T* p, std::int64_t i) {
  if constexpr (std::is_same_v<T, bool>)
    return reinterpret_cast<const std::uint8_t*>(p)[i];
  else
    return static_cast<accum_t<T>>(p[i]);
}

/// out[i] = (in[0][i] op in[1][i] op ... op in[n-1][i]) * scale for i in [0, len), in rank
/// order. Blocks of 512 elements keep the accumulator in L1 while each input streams by.
/// With `Stream` (float/double, `out` batch-aligned), results bypass the cache: a large
/// output cannot stay there anyway, and it saves reading each line before writing it.
template <Element T, ReduceOp Op, bool Stream = false>
void reduce_span_op(T* out, const T* const* in, int n, std::int64_t len, double scale) {
  using A = accum_t<T>;
  constexpr std::int64_t kBlock = 512;
  alignas(64) A acc[kBlock];
  const A s = static_cast<A>(scale);  // only used by floating types (check_reduction)
  const bool scaled = scale != 1.0;
  for (std::int64_t b = 0; b < len; b += kBlock) {
    const std::int64_t m = std::min(kBlock, len - b);
    const T* first = in[0] + b;
    for (std::int64_t i = 0; i < m; ++i) acc[i] = load_acc(first, i);
    for (int j = 1; j < n; ++j) {
      const T* x = in[j] + b;
      for (std::int64_t i = 0; i < m; ++i) acc[i] = combine<Op>(acc[i], load_acc(x, i));
    }
    T* o = out + b;
    if constexpr (Stream) {
      using B = expr::batch_t<T>;
      constexpr std::int64_t W = B::size;
      std::int64_t i = 0;
      if (scaled) {
        for (; i + W <= m; i += W) expr::stream_store<T>(o + i, B::load_aligned(acc + i) * B(s));
      } else {
        for (; i + W <= m; i += W) expr::stream_store<T>(o + i, B::load_aligned(acc + i));
      }
      for (; i < m; ++i) o[i] = scaled ? acc[i] * s : acc[i];
    } else if constexpr (std::is_same_v<T, bool>) {
      auto* ob = reinterpret_cast<std::uint8_t*>(o);
      for (std::int64_t i = 0; i < m; ++i) ob[i] = acc[i];
    } else if constexpr (is_floating_v<T>) {
      if (scaled) {
        for (std::int64_t i = 0; i < m; ++i) o[i] = static_cast<T>(acc[i] * s);
      } else {
        for (std::int64_t i = 0; i < m; ++i) o[i] = static_cast<T>(acc[i]);
      }
    } else {
      for (std::int64_t i = 0; i < m; ++i) o[i] = acc[i];
    }
  }
}

template <Element T, ReduceOp Op>
void reduce_span_dispatch(T* out, const T* const* in, int n, std::int64_t len, double scale,
                          bool stream) {
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double>) {
    if (stream && reinterpret_cast<std::uintptr_t>(out) % sizeof(expr::batch_t<T>) == 0) {
      reduce_span_op<T, Op, true>(out, in, n, len, scale);
      expr::store_fence();
      return;
    }
  }
  reduce_span_op<T, Op>(out, in, n, len, scale);
}

/// Runtime-op entry of reduce_span_op; `stream` asks for non-temporal stores (honoured for
/// float and double outputs that are batch-aligned).
template <Element T>
void reduce_span(ReduceOp op, T* out, const T* const* in, int n, std::int64_t len, double scale,
                 bool stream = false) {
  if (len <= 0) return;
  switch (op) {
    case ReduceOp::Sum:
      return reduce_span_dispatch<T, ReduceOp::Sum>(out, in, n, len, scale, stream);
    case ReduceOp::Mul:
      return reduce_span_dispatch<T, ReduceOp::Mul>(out, in, n, len, scale, stream);
    case ReduceOp::Min:
      return reduce_span_dispatch<T, ReduceOp::Min>(out, in, n, len, scale, stream);
    case ReduceOp::Max:
      return reduce_span_dispatch<T, ReduceOp::Max>(out, in, n, len, scale, stream);
    case ReduceOp::And:
    case ReduceOp::Or:
      if constexpr (!is_floating_v<T>) {
        return op == ReduceOp::And ? reduce_span_op<T, ReduceOp::And>(out, in, n, len, scale)
                                   : reduce_span_op<T, ReduceOp::Or>(out, in, n, len, scale);
      }
      break;
  }
}

}  // namespace dist::detail
}  // namespace lazy

#if LAZYTENSOR_HEADER_DEFINITIONS
namespace lazy {
LAZYTENSOR_INLINE std::string reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum:
      return "sum";
    case ReduceOp::Mul:
      return "mul";
    case ReduceOp::And:
      return "and";
    case ReduceOp::Or:
      return "or";
    case ReduceOp::Min:
      return "min";
    case ReduceOp::Max:
      return "max";
  }
  return "?";
}
}  // namespace lazy
#endif  // LAZYTENSOR_HEADER_DEFINITIONS
