#pragma once
// Variance and standard deviation: var, std, var_mean, std_mean (torch's, with
// `correction`). Composites of mean and sum (ops/reduction.hpp): two passes, the mean first,
// then the sum of squared deviations from it, both in compute_t<T> (bfloat16 in float,
// rounded once). Their gradients come from those reductions' backward; std's square root
// is masked where the variance is zero, so a constant slice gets a zero gradient, as
// torch's std_backward gives, not NaN.

#include <algorithm>
#include <concepts>
#include <cstdint>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

#include <lazytensor/ops/reduction.hpp>
#include <lazytensor/ops/reshape.hpp>
#include <lazytensor/ops/shape_helpers.hpp>
#include <lazytensor/tensor/tensor.hpp>

namespace lazy {

namespace detail {

/// DTypeError for a non-floating operand of var/std (as torch raises it).
template <class T>
[[noreturn]] void non_floating_statistic(const char* op) {
  throw DTypeError(std::string(op) + ": std and var only support floating point dtypes, got input dtype " +
                   dtype_name(dtype_of<T>()));
}

/// t in compute_t<T>: t itself, or (bfloat16) a cast expression fused into its readers.
template <Element T>
auto in_compute(const Tensor<T>& t) {
  if constexpr (std::is_same_v<compute_t<T>, T>) return t;
  else return cast<compute_t<T>>(t);
}

/// v of compute_t<T> as a T (no copy when they are the same type).
template <Element T>
Tensor<T> from_compute(const Tensor<compute_t<T>>& v) {
  if constexpr (std::is_same_v<compute_t<T>, T>) return v;
  else return Tensor<T>(cast<T>(v));
}

/// Variance (reduced dims kept) and mean (kept) of t over `dims`, in compute_t<T>: the sum of
/// squared deviations divided by max(0, N - correction), N the number of reduced elements
/// (0 gives inf, or NaN for a zero sum, as torch).
template <Element T>
std::pair<Tensor<compute_t<T>>, Tensor<compute_t<T>>> variance_parts(const Tensor<T>& t, const Dims& dims,
                                                                     double correction, const char* op) {
  using C = compute_t<T>;
  std::int64_t n = 1;
  for (int d : reduce_dims(t.shape(), dims, op)) n *= t.shape()[d];
  auto xc = in_compute(t);
  Tensor<C> m = mean(xc, dims, true);
  Tensor<C> ss = sum(square(xc - m), dims, true);
  const double denom = std::max(0.0, static_cast<double>(n) - correction);
  return {Tensor<C>(ss / static_cast<C>(denom)), m};
}

/// sqrt(v), with a zero gradient where v is zero (sqrt of 1 there, times 0).
template <class C>
Tensor<C> masked_sqrt(const Tensor<C>& v) {
  return Tensor<C>(sqrt(where(v == 0, C(1), v)) * cast<C>(v != 0));
}

/// `k` (reduced dims kept) with those dims dropped unless keepdim.
template <class C>
Tensor<C> drop_dims(const Tensor<C>& k, const Shape& in, const Dims& dims, bool keepdim, const char* op) {
  if (keepdim) return k;
  return reshape(k, reduced_shape(in, reduce_dims(in, dims, op), false));
}

/// var (Std false) or std of x, and its mean.
template <bool Std, class X>
auto statistic(const X& x, const Dims& dims, double correction, bool keepdim, const char* op) {
  auto t = as_tensor(x);
  using T = typename decltype(t)::value_type;
  if constexpr (!is_floating_v<T>) {
    non_floating_statistic<T>(op);
    return std::tuple<Tensor<float>, Tensor<float>>{};  // (the type statistic_t names)
  } else {
    auto [v, m] = variance_parts(t, dims, correction, op);
    if constexpr (Std) v = masked_sqrt(v);
    return std::tuple<Tensor<T>, Tensor<T>>{from_compute<T>(drop_dims(v, t.shape(), dims, keepdim, op)),
                                            from_compute<T>(drop_dims(m, t.shape(), dims, keepdim, op))};
  }
}

/// The result type of the statistics: x's dtype (a floating one; the others raise).
template <class X>
using statistic_t = std::conditional_t<is_floating_v<expr::value_t<X>>, expr::value_t<X>, float>;

}  // namespace detail

/// Variance over `dims` (all when empty; a braced list, a vector or one dim), the sum of
/// squared deviations from the mean divided by N - correction (torch.var; correction 1 is
/// Bessel's, 0 the population variance). N <= correction gives inf, or NaN when the
/// deviations are all zero (a single element with correction 1), as torch. Floating dtypes
/// only (DTypeError otherwise); ShapeError for dims out of range or repeated.
template <expr::ExprLike X>
Tensor<detail::statistic_t<X>> var(const X& x, const Dims& dims = {}, double correction = 1, bool keepdim = false) {
  return std::get<0>(detail::statistic<false>(x, dims, correction, keepdim, "var"));
}
/// Variance over all elements, unbiased (correction 1) or not (0): libtorch's var(x, bool).
/// Only an actual bool selects this (var(x, 1) is the variance over dim 1).
template <expr::ExprLike X, std::same_as<bool> B>
Tensor<detail::statistic_t<X>> var(const X& x, B unbiased) {
  return var(x, Dims{}, unbiased ? 1.0 : 0.0, false);
}

/// Standard deviation over `dims`: sqrt of var (torch.std; same arguments and errors). Its
/// gradient is zero where the result is zero (a constant slice), as torch's.
template <expr::ExprLike X>
Tensor<detail::statistic_t<X>> std(const X& x, const Dims& dims = {}, double correction = 1, bool keepdim = false) {
  return std::get<0>(detail::statistic<true>(x, dims, correction, keepdim, "std"));
}
/// Standard deviation over all elements, unbiased or not: libtorch's std(x, bool).
template <expr::ExprLike X, std::same_as<bool> B>
Tensor<detail::statistic_t<X>> std(const X& x, B unbiased) {
  return std(x, Dims{}, unbiased ? 1.0 : 0.0, false);
}

/// (variance, mean) over `dims`, the mean computed once for both (torch.var_mean; arguments
/// and errors as var's).
template <expr::ExprLike X>
std::tuple<Tensor<detail::statistic_t<X>>, Tensor<detail::statistic_t<X>>> var_mean(const X& x, const Dims& dims = {},
                                                                                     double correction = 1,
                                                                                     bool keepdim = false) {
  return detail::statistic<false>(x, dims, correction, keepdim, "var_mean");
}
/// (variance, mean) over all elements, unbiased or not: libtorch's var_mean(x, bool).
template <expr::ExprLike X, std::same_as<bool> B>
std::tuple<Tensor<detail::statistic_t<X>>, Tensor<detail::statistic_t<X>>> var_mean(const X& x, B unbiased) {
  return var_mean(x, Dims{}, unbiased ? 1.0 : 0.0, false);
}

/// (standard deviation, mean) over `dims` (torch.std_mean; as std).
template <expr::ExprLike X>
std::tuple<Tensor<detail::statistic_t<X>>, Tensor<detail::statistic_t<X>>> std_mean(const X& x, const Dims& dims = {},
                                                                                     double correction = 1,
                                                                                     bool keepdim = false) {
  return detail::statistic<true>(x, dims, correction, keepdim, "std_mean");
}
/// (standard deviation, mean) over all elements, unbiased or not: libtorch's std_mean(x, bool).
template <expr::ExprLike X, std::same_as<bool> B>
std::tuple<Tensor<detail::statistic_t<X>>, Tensor<detail::statistic_t<X>>> std_mean(const X& x, B unbiased) {
  return std_mean(x, Dims{}, unbiased ? 1.0 : 0.0, false);
}

}  // namespace lazy
