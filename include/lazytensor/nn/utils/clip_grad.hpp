#pragma once
// Gradient clipping, as torch.nn.utils: clip_grad_norm_ scales every gradient by one factor
// so that their total norm is at most max_norm; clip_grad_value_ clamps each element.
// Both update the gradients in place (every handle on a gradient sees it) and stay lazy:
// the total norm is a pending 0-dim tensor, computed with the step at the next mark_step.
// Templates over the gradients' dtype, so that their bodies (reductions with deduced types)
// are compiled only in programs that clip; lazytensor::compiled instantiates float once.

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include <lazytensor/any_tensor.hpp>
#include <lazytensor/core/config.hpp>
#include <lazytensor/core/error.hpp>
#include <lazytensor/ops/factories.hpp>
#include <lazytensor/ops/reduction.hpp>
#include <lazytensor/tensor/tensor.hpp>

namespace lazy::nn::utils {

/// Scales the gradients of `parameters` (those that have one) in place by
/// min(1, max_norm / (total_norm + 1e-6)), where total_norm is the `norm_type`-norm of all
/// gradients together (`norm_type` >= 1, or infinity for the largest magnitude). Returns
/// total_norm before clipping (0 when no parameter has a gradient). With
/// `error_if_nonfinite`, a NaN or infinite total norm raises lazy::Error (this reads the
/// norm, so it syncs).
template <Element T = float>
  requires is_floating_v<T>
Tensor<T> clip_grad_norm_(const std::vector<Tensor<T>>& parameters, double max_norm, double norm_type = 2.0,
                          bool error_if_nonfinite = false);
/// The same for one parameter.
template <Element T>
  requires is_floating_v<T>
Tensor<T> clip_grad_norm_(const Tensor<T>& parameter, double max_norm, double norm_type = 2.0,
                          bool error_if_nonfinite = false);

/// The same for parameters of a run-time dtype (Module::parameters()): the gradients must
/// share one dtype (DTypeError naming two that differ), in which the norm is returned.
template <class = void>
AnyTensor clip_grad_norm_(const std::vector<AnyTensor>& parameters, double max_norm, double norm_type = 2.0,
                          bool error_if_nonfinite = false);

/// Clamps every gradient element of `parameters` into [-clip_value, clip_value], in place
/// (`clip_value` >= 0).
template <Element T = float>
  requires is_floating_v<T>
void clip_grad_value_(const std::vector<Tensor<T>>& parameters, double clip_value);
/// The same for one parameter.
template <Element T>
  requires is_floating_v<T>
void clip_grad_value_(const Tensor<T>& parameter, double clip_value);
/// The same for parameters of a run-time dtype (Module::parameters()).
template <class = void>
void clip_grad_value_(const std::vector<AnyTensor>& parameters, double clip_value);

template <Element T>
  requires is_floating_v<T>
Tensor<T> clip_grad_norm_(const std::vector<Tensor<T>>& parameters, double max_norm, double norm_type,
                          bool error_if_nonfinite) {
  const bool inf = std::isinf(norm_type) && norm_type > 0;
  if (!(norm_type >= 1.0) && !inf) {
    throw Error("clip_grad_norm_: norm_type must be >= 1 or infinity, got " + std::to_string(norm_type));
  }
  if (!(max_norm >= 0.0)) throw Error("clip_grad_norm_: max_norm must be >= 0, got " + std::to_string(max_norm));
  NoGradGuard no_grad;
  std::vector<Tensor<T>> grads;
  for (const auto& p : parameters) {
    if (p.defined() && p.grad().defined()) grads.push_back(p.grad());
  }
  if (grads.empty()) return zeros<T>(Shape{});
  // One partial per gradient (sum of |g|^p, or max |g|), then one combination.
  Tensor<T> acc;
  for (const auto& g : grads) {
    Tensor<T> part;
    if (inf) part = amax(abs(g));
    else if (norm_type == 2.0) part = sum(g * g);
    else if (norm_type == 1.0) part = sum(abs(g));
    else part = sum(pow(abs(g), static_cast<T>(norm_type)));
    if (!acc.defined()) acc = part;
    else if (inf) acc = maximum(acc, part);
    else acc = acc + part;
  }
  Tensor<T> total;
  if (inf || norm_type == 1.0) total = acc;
  else if (norm_type == 2.0) total = sqrt(acc);
  else total = pow(acc, static_cast<T>(1.0 / norm_type));
  if (error_if_nonfinite) {
    const auto v = static_cast<double>(total.item());
    if (!std::isfinite(v)) {
      throw Error("clip_grad_norm_: the total norm of order " + std::to_string(norm_type) +
                  " of the gradients is non-finite (" + std::to_string(v) +
                  "), so it cannot be clipped; pass error_if_nonfinite = false to clip anyway");
    }
  }
  const Tensor<T> coef = minimum(static_cast<T>(max_norm) / (total + static_cast<T>(1e-6)), static_cast<T>(1));
  for (auto& g : grads) g.mul_(coef);
  return total;
}

template <Element T>
  requires is_floating_v<T>
Tensor<T> clip_grad_norm_(const Tensor<T>& parameter, double max_norm, double norm_type, bool error_if_nonfinite) {
  return clip_grad_norm_(std::vector<Tensor<T>>{parameter}, max_norm, norm_type, error_if_nonfinite);
}

template <Element T>
  requires is_floating_v<T>
void clip_grad_value_(const std::vector<Tensor<T>>& parameters, double clip_value) {
  if (!(clip_value >= 0.0)) {
    throw Error("clip_grad_value_: clip_value must be >= 0, got " + std::to_string(clip_value));
  }
  NoGradGuard no_grad;
  const auto c = static_cast<T>(clip_value);
  for (const auto& p : parameters) {
    if (!p.defined()) continue;
    Tensor<T> g = p.grad();
    if (g.defined()) g.copy_(clamp(g, -c, c));
  }
}

template <Element T>
  requires is_floating_v<T>
void clip_grad_value_(const Tensor<T>& parameter, double clip_value) {
  clip_grad_value_(std::vector<Tensor<T>>{parameter}, clip_value);
}

template <class>
AnyTensor clip_grad_norm_(const std::vector<AnyTensor>& parameters, double max_norm, double norm_type,
                          bool error_if_nonfinite) {
  const AnyTensor* first = nullptr;
  for (const auto& p : parameters) {
    if (!p.defined() || !p.grad().defined()) continue;
    if (!first) first = &p;
    else if (p.dtype() != first->dtype()) {
      throw DTypeError("clip_grad_norm_: gradients of dtypes " + dtype_name(first->dtype()) + " and " +
                       dtype_name(p.dtype()) + " in one call; clip each dtype's parameters separately");
    }
  }
  auto run = [&](auto tag) -> AnyTensor {
    using T = decltype(tag);
    std::vector<Tensor<T>> typed;
    for (const auto& p : parameters)
      if (p.defined() && p.dtype() == dtype_of<T>()) typed.push_back(p.template as<T>());
    return clip_grad_norm_<T>(typed, max_norm, norm_type, error_if_nonfinite);
  };
  switch (first ? first->dtype() : DType::Float32) {
    case DType::Float64: return run(double{});
    case DType::BFloat16: return run(bfloat16{});
    default: return run(float{});
  }
}

template <class>
void clip_grad_value_(const std::vector<AnyTensor>& parameters, double clip_value) {
  if (!(clip_value >= 0.0)) {
    throw Error("clip_grad_value_: clip_value must be >= 0, got " + std::to_string(clip_value));
  }
  for (const auto& p : parameters) {
    if (!p.defined()) continue;
    switch (p.dtype()) {
      case DType::Float64: clip_grad_value_(p.as<double>(), clip_value); break;
      case DType::BFloat16: clip_grad_value_(p.as<bfloat16>(), clip_value); break;
      case DType::Float32: clip_grad_value_(p.as<float>(), clip_value); break;
      default: break;  // integral tensors have no gradients
    }
  }
}

}  // namespace lazy::nn::utils

#define LAZYTENSOR_NN_CLIP_GRAD_INSTANCES(P)                                                                    \
  P template lazy::Tensor<float> lazy::nn::utils::clip_grad_norm_<float>(const std::vector<lazy::Tensor<float>>&, \
                                                                         double, double, bool);                \
  P template lazy::Tensor<float> lazy::nn::utils::clip_grad_norm_<float>(const lazy::Tensor<float>&, double,     \
                                                                         double, bool);                        \
  P template void lazy::nn::utils::clip_grad_value_<float>(const std::vector<lazy::Tensor<float>>&, double);   \
  P template void lazy::nn::utils::clip_grad_value_<float>(const lazy::Tensor<float>&, double);               \
  P template lazy::AnyTensor lazy::nn::utils::clip_grad_norm_<void>(const std::vector<lazy::AnyTensor>&, double, \
                                                                    double, bool);                            \
  P template void lazy::nn::utils::clip_grad_value_<void>(const std::vector<lazy::AnyTensor>&, double);
#if LAZYTENSOR_EXPLICIT_INSTANTIATION
LAZYTENSOR_NN_CLIP_GRAD_INSTANCES(extern)
#endif
