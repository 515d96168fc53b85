#pragma once
// Element types and PyTorch's type promotion rules.

#include <cstddef>
#include <cstdint>
#include <string>
#include <tuple>
#include <type_traits>

#include <lazytensor/core/bfloat16.hpp>
#include <lazytensor/core/config.hpp>

namespace lazy {

/// Runtime tag of a tensor's element type.
enum class DType { Bool, Int32, Int64, BFloat16, Float32, Float64 };

/// True for the element types a Tensor may hold.
template <class T>
inline constexpr bool is_element_v =
    std::is_same_v<T, bool> || std::is_same_v<T, std::int32_t> || std::is_same_v<T, std::int64_t> ||
    std::is_same_v<T, bfloat16> || std::is_same_v<T, float> || std::is_same_v<T, double>;

/// Constrains templates to the supported element types.
template <class T>
concept Element = is_element_v<T>;

/// Element types accepted for index tensors (index_select, gather, one_hot, targets).
template <class I>
concept IndexElement = std::is_same_v<I, std::int32_t> || std::is_same_v<I, std::int64_t>;

template <Element T>
constexpr DType dtype_of() {
  if constexpr (std::is_same_v<T, bool>) return DType::Bool;
  else if constexpr (std::is_same_v<T, std::int32_t>) return DType::Int32;
  else if constexpr (std::is_same_v<T, std::int64_t>) return DType::Int64;
  else if constexpr (std::is_same_v<T, bfloat16>) return DType::BFloat16;
  else if constexpr (std::is_same_v<T, float>) return DType::Float32;
  else return DType::Float64;
}

/// Bytes per element.
constexpr std::size_t dtype_size(DType d) {
  switch (d) {
    case DType::Bool: return 1;
    case DType::Int32: return 4;
    case DType::Int64: return 8;
    case DType::BFloat16: return 2;
    case DType::Float32: return 4;
    case DType::Float64: return 8;
  }
  return 0;
}

/// PyTorch-style name ("float32", "int64", ...).
std::string dtype_name(DType d);

template <class T>
inline constexpr bool is_floating_v =
    std::is_same_v<T, float> || std::is_same_v<T, double> || std::is_same_v<T, bfloat16>;
/// True for the floating dtypes (bfloat16, float32, float64): is_floating_v at run time.
constexpr bool is_floating(DType d) { return d == DType::BFloat16 || d == DType::Float32 || d == DType::Float64; }

/// Constrains templates to bfloat16, float and double.
template <class T>
concept FloatingElement = Element<T> && is_floating_v<T>;

template <class T>
inline constexpr bool is_integral_v = std::is_same_v<T, std::int32_t> || std::is_same_v<T, std::int64_t>;

namespace detail {
// Rank inside a category decides promotion: bool < int32 < int64 < bfloat16 < float < double.
template <class T>
constexpr int type_rank() {
  return static_cast<int>(dtype_of<T>());
}
template <int R>
using type_of_rank = std::tuple_element_t<
    R, std::tuple<bool, std::int32_t, std::int64_t, bfloat16, float, double>>;
}  // namespace detail

/// Result type of a binary op between two tensors (PyTorch's promote_types).
template <Element A, Element B>
using promote_t = detail::type_of_rank<(detail::type_rank<A>() > detail::type_rank<B>())
                                           ? detail::type_rank<A>()
                                           : detail::type_rank<B>()>;

/// Result type of floating-only ops (exp, /, ...): integral and bool become float.
template <Element T>
using to_floating_t = std::conditional_t<is_floating_v<T>, T, float>;

/// Type a C++ scalar takes next to a tensor of type T (PyTorch's weak scalars): it adopts
/// T unless its category (bool < integral < floating) is higher. A bfloat16 scalar counts
/// as floating.
template <Element T, class S>
using weak_scalar_t = std::conditional_t<
    std::is_floating_point_v<S> || std::is_same_v<S, bfloat16>, std::conditional_t<is_floating_v<T>, T, float>,
    std::conditional_t<std::is_same_v<S, bool>, T,
                       std::conditional_t<std::is_same_v<T, bool>, std::int64_t, T>>>;

/// Type in which a kernel computes values of type T (bfloat16 computes in float).
template <Element T>
using compute_t = std::conditional_t<std::is_same_v<T, bfloat16>, float, T>;

}  // namespace lazy

#if LAZYTENSOR_HEADER_DEFINITIONS
namespace lazy {

LAZYTENSOR_INLINE std::string dtype_name(DType d) {
  switch (d) {
    case DType::Bool: return "bool";
    case DType::Int32: return "int32";
    case DType::Int64: return "int64";
    case DType::BFloat16: return "bfloat16";
    case DType::Float32: return "float32";
    case DType::Float64: return "float64";
  }
  return "?";
}

}  // namespace lazy
#endif  // LAZYTENSOR_HEADER_DEFINITIONS
