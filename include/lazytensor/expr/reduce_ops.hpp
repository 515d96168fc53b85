#pragma once
// Reduction functors: identity, combine (scalar or xsimd batch) and horizontal reduce.

#include <cstdint>
#include <limits>
#include <type_traits>

#include <lazytensor/core/simd.hpp>

#include <lazytensor/core/dtype.hpp>

namespace lazy::ops::reduce {

namespace detail {
template <class V>
struct scalar_of {
  using type = V;
};
template <class T, class A>
struct scalar_of<xsimd::batch<T, A>> {
  using type = T;
};
template <class V>
using scalar_of_t = typename scalar_of<V>::type;

/// a + b and a * b, wrapping like PyTorch's integer kernels (two's complement; signed
/// overflow in C++ arithmetic is undefined).
template <class V>
V wrapping_add(const V& a, const V& b) {
  if constexpr (std::is_integral_v<V> && std::is_signed_v<V>) {
    using U = std::make_unsigned_t<V>;
    return static_cast<V>(static_cast<U>(a) + static_cast<U>(b));
  } else {
    return a + b;
  }
}
template <class V>
V wrapping_mul(const V& a, const V& b) {
  if constexpr (std::is_integral_v<V> && std::is_signed_v<V>) {
    using U = std::make_unsigned_t<V>;
    return static_cast<V>(static_cast<U>(a) * static_cast<U>(b));
  } else {
    return a * b;
  }
}

template <class S, class V, class F>
S horizontal(const V& v, F f) {
  if constexpr (std::is_arithmetic_v<V>) {
    return v;
  } else {
    alignas(64) S tmp[V::size];
    v.store_aligned(tmp);
    S r = tmp[0];
    for (std::size_t k = 1; k < V::size; ++k) r = f(r, tmp[k]);
    return r;
  }
}
}  // namespace detail

/// Sum; integers and bool accumulate and return int64, as torch.sum.
struct Sum {
  static constexpr const char* name = "sum";
  template <class T>
  using result = std::conditional_t<is_floating_v<T>, T, std::int64_t>;
  template <class V>
  static V identity() {
    return V(0);
  }
  template <class V>
  static V combine(const V& a, const V& b) {
    return detail::wrapping_add(a, b);
  }
  template <class S, class V>
  static S horizontal(const V& v) {
    if constexpr (std::is_arithmetic_v<V>) return v;
    else if constexpr (std::is_integral_v<S>) return detail::horizontal<S>(v, detail::wrapping_add<S>);
    else return xsimd::hadd(v);
  }
};

/// Product; integers and bool return int64, as torch.prod.
struct Prod {
  static constexpr const char* name = "prod";
  template <class T>
  using result = std::conditional_t<is_floating_v<T>, T, std::int64_t>;
  template <class V>
  static V identity() {
    return V(1);
  }
  template <class V>
  static V combine(const V& a, const V& b) {
    return detail::wrapping_mul(a, b);
  }
  template <class S, class V>
  static S horizontal(const V& v) {
    return detail::horizontal<S>(v, detail::wrapping_mul<S>);
  }
};

// NaN tests on batches use xsimd::isnan: xsimd 8's AVX/AVX-512 `!=` compares with
// _CMP_NEQ_OQ (ordered), so there `nan != nan` is false and `a != a` never finds a NaN.

/// Maximum, NaN-propagating (torch.amax).
struct Max {
  static constexpr const char* name = "max";
  template <class T>
  using result = T;
  template <class V>
  static V identity() {
    using S = detail::scalar_of_t<V>;
    if constexpr (std::numeric_limits<S>::has_infinity) return V(-std::numeric_limits<S>::infinity());
    else return V(std::numeric_limits<S>::lowest());
  }
  template <class V>
  static V combine(const V& a, const V& b) {
    using xsimd::select;
    if constexpr (std::is_arithmetic_v<V>) return (a > b || a != a) ? a : b;
    else return select((a > b) | xsimd::isnan(a), a, b);  // not a != a: see the note above
  }
  template <class S, class V>
  static S horizontal(const V& v) {
    return detail::horizontal<S>(v, [](S a, S b) { return combine(a, b); });
  }
};

/// Minimum, NaN-propagating (torch.amin).
struct Min {
  static constexpr const char* name = "min";
  template <class T>
  using result = T;
  template <class V>
  static V identity() {
    using S = detail::scalar_of_t<V>;
    if constexpr (std::numeric_limits<S>::has_infinity) return V(std::numeric_limits<S>::infinity());
    else return V(std::numeric_limits<S>::max());
  }
  template <class V>
  static V combine(const V& a, const V& b) {
    using xsimd::select;
    if constexpr (std::is_arithmetic_v<V>) return (a < b || a != a) ? a : b;
    else return select((a < b) | xsimd::isnan(a), a, b);
  }
  template <class S, class V>
  static S horizontal(const V& v) {
    return detail::horizontal<S>(v, [](S a, S b) { return combine(a, b); });
  }
};

/// Any non-zero (fed with 0/1 values): max with identity 0.
struct Any : Max {
  static constexpr const char* name = "any";
  template <class T>
  using result = bool;
  template <class V>
  static V identity() {
    return V(0);
  }
};

/// All non-zero (fed with 0/1 values): min with identity 1.
struct All : Min {
  static constexpr const char* name = "all";
  template <class T>
  using result = bool;
  template <class V>
  static V identity() {
    return V(1);
  }
};

}  // namespace lazy::ops::reduce
