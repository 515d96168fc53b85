#pragma once
// torch.nn.functional: losses and the functional forms of layers, in bfloat16, float or
// double (the input's dtype). Each takes a tensor or a pending expression.

#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>

#include <lazytensor/autograd/record.hpp>
#include <lazytensor/core/config.hpp>
#include <lazytensor/ops/random.hpp>
#include <lazytensor/ops/reduction.hpp>
#include <lazytensor/ops/shape.hpp>
#include <lazytensor/ops/softmax.hpp>

namespace lazy::nn {

/// How a loss reduces over the batch (torch's reduction='mean' | 'sum' | 'none').
enum class Reduction { Mean, Sum, None };

namespace functional {

namespace detail {
template <Element T>
Tensor<T> reduce(const Tensor<T>& per_sample, Reduction r) {
  switch (r) {
    case Reduction::Mean: return mean(per_sample);
    case Reduction::Sum: return sum(per_sample);
    case Reduction::None: break;
  }
  return per_sample;
}

/// Tensor<T> in a non-deduced context: T comes from another argument, and expressions
/// still convert.
template <class T>
using Arg = std::type_identity_t<Tensor<T>>;

/// A pending expression evaluated into a tensor; a tensor as it is.
template <class X>
decltype(auto) as_tensor(const X& x) {
  if constexpr (expr::Pending<X>) return lazy::eval(x);
  else return (x);
}

template <Element T, IndexElement I>
void check_targets(const Tensor<T>& input, const Tensor<I>& target, const char* op) {
  if (input.dim() != 2) {
    throw ShapeError(std::string(op) + ": expected input of shape (N, C), got " + input.shape().str());
  }
  if (target.dim() != 1 || target.size(0) != input.size(0)) {
    throw ShapeError(std::string(op) + ": expected target of shape (" + std::to_string(input.size(0)) +
                     ",) for input " + input.shape().str() + ", got " + target.shape().str());
  }
}
}  // namespace detail

/// Options of cross_entropy.
struct CrossEntropyOptions {
  Reduction reduction = Reduction::Mean;
  /// Mix the one-hot targets with the uniform distribution (torch's label_smoothing).
  double label_smoothing = 0.0;
};

/// Cross entropy of logits `input` [N, C] against class indices `target` [N] (torch's
/// F.cross_entropy). Its backward is one fused kernel, (softmax(x) - smoothed one-hot) * g,
/// rather than the composition of log_softmax, gather and the reduction. Class indices
/// outside [0, C) raise IndexError when the loss is computed.
template <IndexElement I, FloatingElement F>
Tensor<F> cross_entropy(const Tensor<F>& input, const Tensor<I>& target, CrossEntropyOptions opt = {}) {
  detail::check_targets(input, target, "cross_entropy");
  if (!(opt.label_smoothing >= 0 && opt.label_smoothing <= 1)) {  // (NaN too)
    throw Error("cross_entropy: label_smoothing must be in [0, 1], got " + std::to_string(opt.label_smoothing));
  }
  const std::int64_t n = input.size(0), c = input.size(1);
  const F eps = static_cast<F>(opt.label_smoothing);
  Tensor<F> logp;
  Tensor<F> per_sample;
  {
    NoGradGuard forward_only;  // the backward below is explicit
    logp = log_softmax(input, 1);
    Tensor<F> picked = reshape(gather(logp, 1, reshape(target, Shape{n, 1})), Shape{n});
    per_sample = eps == 0 ? Tensor<F>(-picked)
                          : Tensor<F>(-(1 - eps) * picked - (eps / static_cast<F>(c)) * sum(logp, {1}));
  }
  Tensor<F> loss = detail::reduce(per_sample, opt.reduction);
  autograd::record(loss, "CrossEntropyBackward0", {autograd::edge_of(input.impl())},
                   [logp = logp.detach(), target = target.detach(), n, c, eps, r = opt.reduction](const Tensor<F>& g) {
                     // d loss_i / d x_ij = softmax_ij - ((1 - eps) [j == t_i] + eps / C), times the
                     // incoming gradient (per sample for 'none', shared otherwise).
                     Tensor<F> gi = r == Reduction::None ? reshape(g, Shape{n, 1})
                                        : r == Reduction::Mean ? Tensor<F>(reshape(g, Shape{1, 1}) / static_cast<F>(n))
                                                               : reshape(g, Shape{1, 1});
                     Tensor<F> dx = (exp(logp) - (cast<F>(one_hot(target, c)) * (1 - eps) + eps / static_cast<F>(c))) * gi;
                     return graph::NodeList{dx.node()};
                   });
  return loss;
}

/// cross_entropy of a pending expression.
template <expr::Pending E, IndexElement I>
auto cross_entropy(const E& input, const Tensor<I>& target, CrossEntropyOptions opt = {}) {
  return cross_entropy(lazy::eval(input), target, opt);
}

/// Negative log likelihood of log-probabilities `input` [N, C] at class indices `target`.
template <IndexElement I, FloatingElement F>
Tensor<F> nll_loss(const Tensor<F>& input, const Tensor<I>& target, Reduction r = Reduction::Mean) {
  detail::check_targets(input, target, "nll_loss");
  const std::int64_t n = input.size(0);
  Tensor<F> picked = reshape(gather(input, 1, reshape(target, Shape{n, 1})), Shape{n});
  return detail::reduce(Tensor<F>(-picked), r);
}
/// nll_loss of a pending expression.
template <expr::Pending E, IndexElement I>
auto nll_loss(const E& input, const Tensor<I>& target, Reduction r = Reduction::Mean) {
  return nll_loss(lazy::eval(input), target, r);
}

/// Mean squared error (torch's F.mse_loss).
template <FloatingElement F>
Tensor<F> mse_loss(const Tensor<F>& input, const detail::Arg<F>& target, Reduction r = Reduction::Mean) {
  if (!(input.shape() == target.shape())) {
    throw ShapeError("mse_loss: input " + input.shape().str() + " and target " + target.shape().str() +
                     " must have the same shape");
  }
  Tensor<F> d = (input - target) * (input - target);
  return detail::reduce(d, r);
}
/// mse_loss of a pending expression.
template <expr::Pending E, class Y>
auto mse_loss(const E& input, const Y& target, Reduction r = Reduction::Mean) {
  return mse_loss(lazy::eval(input), detail::as_tensor(target), r);
}

/// Binary cross entropy on logits, computed stably: max(x, 0) - x * y + log(1 + e^-|x|).
template <FloatingElement F>
Tensor<F> binary_cross_entropy_with_logits(const Tensor<F>& input, const detail::Arg<F>& target,
                                           Reduction r = Reduction::Mean) {
  if (!(input.shape() == target.shape())) {
    throw ShapeError("binary_cross_entropy_with_logits: input " + input.shape().str() + " and target " +
                     target.shape().str() + " must have the same shape");
  }
  Tensor<F> l = relu(input) - input * target + log1p(exp(-abs(input)));
  return detail::reduce(l, r);
}
/// binary_cross_entropy_with_logits of a pending expression.
template <expr::Pending E, class Y>
auto binary_cross_entropy_with_logits(const E& input, const Y& target, Reduction r = Reduction::Mean) {
  return binary_cross_entropy_with_logits(lazy::eval(input), detail::as_tensor(target), r);
}

/// Zeroes elements with probability p and scales the rest by 1 / (1 - p) in training.
template <FloatingElement F>
Tensor<F> dropout(const Tensor<F>& x, double p = 0.5, bool training = true) {
  if (!(p >= 0 && p <= 1))
    throw Error("dropout: probability has to be between 0 and 1, but got " + std::to_string(p));
  if (!training || p == 0) return x;
  if (p == 1) return Tensor<F>(x * 0.0f);
  return Tensor<F>(x * bernoulli<F>(1 - p, x.shape(), x.device()) * static_cast<compute_t<F>>(1 / (1 - p)));
}
/// dropout of a pending expression.
template <expr::Pending E>
auto dropout(const E& x, double p = 0.5, bool training = true) {
  return dropout(lazy::eval(x), p, training);
}

/// Normalizes over the trailing dims `normalized` (torch's F.layer_norm); weight and bias
/// (optional: undefined tensors) have the normalized shape.
template <FloatingElement F>
Tensor<F> layer_norm(const Tensor<F>& x, const Shape& normalized, const detail::Arg<F>& weight,
                     const detail::Arg<F>& bias, double eps = 1e-5) {
  const int k = normalized.rank(), r = x.dim();
  bool ok = k >= 1 && k <= r;
  for (int i = 0; ok && i < k; ++i) ok = x.shape()[r - k + i] == normalized[i];
  if (!ok) {
    throw ShapeError("layer_norm: normalized_shape " + normalized.str() + " does not match the trailing dims of input " +
                     x.shape().str());
  }
  // (Not left to broadcasting: a weight of shape (1,) would scale every element alike.)
  for (const auto* p : {&weight, &bias}) {
    if (p->defined() && !(p->shape() == normalized)) {
      throw ShapeError(std::string("layer_norm: expected ") + (p == &weight ? "weight" : "bias") +
                       " of shape " + normalized.str() + ", got " + p->shape().str());
    }
  }
  std::vector<std::int64_t> dims;
  for (int i = r - k; i < r; ++i) dims.push_back(i);
  Tensor<F> mu = mean(x, dims, true);
  Tensor<F> xc = x - mu;
  Tensor<F> var = mean(xc * xc, dims, true);
  Tensor<F> y = xc * rsqrt(var + static_cast<F>(eps));
  if (weight.defined()) y = y * weight;
  if (bias.defined()) y = y + bias;
  return y;
}
/// layer_norm of a pending expression.
template <expr::Pending E>
auto layer_norm(const E& x, const Shape& normalized, const detail::Arg<typename E::value_type>& weight,
                const detail::Arg<typename E::value_type>& bias, double eps = 1e-5) {
  return layer_norm(lazy::eval(x), normalized, weight, bias, eps);
}

}  // namespace functional
}  // namespace lazy::nn

// Instantiated once in the compiled runtime (core/config.hpp): the losses and functional
// layers at every floating dtype, with either index dtype.
#define LAZYTENSOR_NN_FUNCTIONAL_INSTANCES(P, T)                                                                   \
  P template lazy::Tensor<T> lazy::nn::functional::detail::reduce<T>(const lazy::Tensor<T>&, lazy::nn::Reduction); \
  P template lazy::Tensor<T> lazy::nn::functional::cross_entropy<std::int32_t, T>(                                 \
      const lazy::Tensor<T>&, const lazy::Tensor<std::int32_t>&, lazy::nn::functional::CrossEntropyOptions);       \
  P template lazy::Tensor<T> lazy::nn::functional::cross_entropy<std::int64_t, T>(                                 \
      const lazy::Tensor<T>&, const lazy::Tensor<std::int64_t>&, lazy::nn::functional::CrossEntropyOptions);       \
  P template lazy::Tensor<T> lazy::nn::functional::nll_loss<std::int32_t, T>(                                      \
      const lazy::Tensor<T>&, const lazy::Tensor<std::int32_t>&, lazy::nn::Reduction);                             \
  P template lazy::Tensor<T> lazy::nn::functional::nll_loss<std::int64_t, T>(                                      \
      const lazy::Tensor<T>&, const lazy::Tensor<std::int64_t>&, lazy::nn::Reduction);                             \
  P template lazy::Tensor<T> lazy::nn::functional::mse_loss<T>(const lazy::Tensor<T>&,                             \
                                                                const lazy::nn::functional::detail::Arg<T>&,         \
                                                                lazy::nn::Reduction);                               \
  P template lazy::Tensor<T> lazy::nn::functional::binary_cross_entropy_with_logits<T>(                            \
      const lazy::Tensor<T>&, const lazy::nn::functional::detail::Arg<T>&, lazy::nn::Reduction);                   \
  P template lazy::Tensor<T> lazy::nn::functional::dropout<T>(const lazy::Tensor<T>&, double, bool);               \
  P template lazy::Tensor<T> lazy::nn::functional::layer_norm<T>(                                                  \
      const lazy::Tensor<T>&, const lazy::Shape&, const lazy::nn::functional::detail::Arg<T>&,                     \
      const lazy::nn::functional::detail::Arg<T>&, double);
#if LAZYTENSOR_EXPLICIT_INSTANTIATION
LAZYTENSOR_FOR_FLOATING(LAZYTENSOR_NN_FUNCTIONAL_INSTANCES, extern)
#endif
