#pragma once
// Gradient clipping, as torch.nn.utils: clip_grad_norm_ scales every gradient by one factor
// so that their total norm is at most max_norm; clip_grad_value_ clamps each element.
// Both update the gradients in place (every handle on a gradient sees it) and stay lazy:
// the total norm is a pending 0-dim tensor, computed with the step at the next mark_step.

#include <cmath>
#include <limits>
#include <string>
#include <vector>

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
Tensor<float> clip_grad_norm_(const std::vector<Tensor<float>>& parameters, double max_norm,
                              double norm_type = 2.0, bool error_if_nonfinite = false);
/// The same for one parameter.
Tensor<float> clip_grad_norm_(const Tensor<float>& parameter, double max_norm, double norm_type = 2.0,
                              bool error_if_nonfinite = false);

/// Clamps every gradient element of `parameters` into [-clip_value, clip_value], in place
/// (`clip_value` >= 0).
void clip_grad_value_(const std::vector<Tensor<float>>& parameters, double clip_value);
/// The same for one parameter.
void clip_grad_value_(const Tensor<float>& parameter, double clip_value);

#if LAZYTENSOR_HEADER_DEFINITIONS
LAZYTENSOR_INLINE Tensor<float> clip_grad_norm_(const std::vector<Tensor<float>>& parameters, double max_norm,
                                                double norm_type, bool error_if_nonfinite) {
  const bool inf = std::isinf(norm_type) && norm_type > 0;
  if (!(norm_type >= 1.0) && !inf) {
    throw Error("clip_grad_norm_: norm_type must be >= 1 or infinity, got " + std::to_string(norm_type));
  }
  if (!(max_norm >= 0.0)) throw Error("clip_grad_norm_: max_norm must be >= 0, got " + std::to_string(max_norm));
  NoGradGuard no_grad;
  std::vector<Tensor<float>> grads;
  for (const auto& p : parameters) {
    if (p.defined() && p.grad().defined()) grads.push_back(p.grad());
  }
  if (grads.empty()) return zeros<float>(Shape{});
  // One partial per gradient (sum of |g|^p, or max |g|), then one combination.
  Tensor<float> acc;
  for (const auto& g : grads) {
    Tensor<float> part;
    if (inf) part = amax(abs(g));
    else if (norm_type == 2.0) part = sum(g * g);
    else if (norm_type == 1.0) part = sum(abs(g));
    else part = sum(pow(abs(g), static_cast<float>(norm_type)));
    if (!acc.defined()) acc = part;
    else if (inf) acc = maximum(acc, part);
    else acc = acc + part;
  }
  Tensor<float> total;
  if (inf || norm_type == 1.0) total = acc;
  else if (norm_type == 2.0) total = sqrt(acc);
  else total = pow(acc, static_cast<float>(1.0 / norm_type));
  if (error_if_nonfinite) {
    const float v = total.item();
    if (!std::isfinite(v)) {
      throw Error("clip_grad_norm_: the total norm of order " + std::to_string(norm_type) +
                  " of the gradients is non-finite (" + std::to_string(v) +
                  "), so it cannot be clipped; pass error_if_nonfinite = false to clip anyway");
    }
  }
  const Tensor<float> coef = minimum(static_cast<float>(max_norm) / (total + 1e-6f), 1.0f);
  for (auto& g : grads) g.mul_(coef);
  return total;
}

LAZYTENSOR_INLINE Tensor<float> clip_grad_norm_(const Tensor<float>& parameter, double max_norm, double norm_type,
                                                bool error_if_nonfinite) {
  return clip_grad_norm_(std::vector<Tensor<float>>{parameter}, max_norm, norm_type, error_if_nonfinite);
}

LAZYTENSOR_INLINE void clip_grad_value_(const std::vector<Tensor<float>>& parameters, double clip_value) {
  if (!(clip_value >= 0.0)) {
    throw Error("clip_grad_value_: clip_value must be >= 0, got " + std::to_string(clip_value));
  }
  NoGradGuard no_grad;
  const auto c = static_cast<float>(clip_value);
  for (const auto& p : parameters) {
    if (!p.defined()) continue;
    Tensor<float> g = p.grad();
    if (g.defined()) g.copy_(clamp(g, -c, c));
  }
}

LAZYTENSOR_INLINE void clip_grad_value_(const Tensor<float>& parameter, double clip_value) {
  clip_grad_value_(std::vector<Tensor<float>>{parameter}, clip_value);
}
#endif  // LAZYTENSOR_HEADER_DEFINITIONS

}  // namespace lazy::nn::utils
