#pragma once
// LayerNorm and BatchNorm1d/2d, as torch.nn. Batch norm keeps running statistics as
// buffers (updated in training, used in eval), with torch's momentum convention and the
// unbiased batch variance in the running estimate.

#include <cstdint>
#include <string>
#include <vector>

#include <lazytensor/core/config.hpp>
#include <lazytensor/nn/functional.hpp>
#include <lazytensor/nn/init.hpp>
#include <lazytensor/nn/module.hpp>

namespace lazy::nn {

/// Normalizes over the trailing `normalized_shape` dims, with a learned affine map.
class LayerNormImpl : public Module {
 public:
  template <class = void>
  explicit LayerNormImpl(Shape normalized_shape, double eps = 1e-5, bool elementwise_affine = true);
  template <FloatingElement T>
  Tensor<T> forward(const Tensor<T>& x) const;
  /// The same on a pending expression.
  template <expr::Pending E>
  auto forward(const E& x) const {
    return forward(lazy::eval(x));
  }
  LAZYTENSOR_INLINE void pretty_print(std::ostream& os) const override;

  Tensor<float> weight, bias;

 private:
  Shape shape_;
  double eps_;
};
LAZY_MODULE(LayerNorm);

// (Outside the class, so not inline: see core/config.hpp.)
template <class>
LayerNormImpl::LayerNormImpl(Shape normalized_shape, double eps, bool elementwise_affine)
    : Module("LayerNorm"), shape_(normalized_shape), eps_(eps) {
  if (elementwise_affine) {
    weight = register_parameter("weight", ones<float>(normalized_shape));
    bias = register_parameter("bias", zeros<float>(normalized_shape));
  }
}

template <FloatingElement T>
Tensor<T> LayerNormImpl::forward(const Tensor<T>& x) const {
  return functional::layer_norm<T>(x, shape_, detail::param_as<T>(weight, *this), detail::param_as<T>(bias, *this),
                                   eps_);
}

/// Batch normalization over the channel dim 1 of [N, C] or [N, C, L] (Rank 1) or
/// [N, C, H, W] (Rank 2) inputs.
template <int Rank>
class BatchNormImpl : public Module {
 public:
  explicit BatchNormImpl(std::int64_t num_features, double eps = 1e-5, double momentum = 0.1, bool affine = true,
                         bool track_running_stats = true);

  /// (F is float: the input is a template-dependent type so that this body, which calls
  /// deduced-type reductions, is compiled only where a batch norm runs.)
  template <FloatingElement T>
  Tensor<T> forward(const Tensor<T>& x);
  /// The same on a pending expression.
  template <expr::Pending E>
  auto forward(const E& x) {
    return forward(lazy::eval(x));
  }

  void pretty_print(std::ostream& os) const override {
    os << name() << "(" << c_ << ", eps=" << eps_ << ", momentum=" << momentum_
       << ", affine=" << (weight.defined() ? "True" : "False") << ")";
  }

  Tensor<float> weight, bias;
  Tensor<float> running_mean, running_var;
  Tensor<std::int64_t> num_batches_tracked;

 private:
  std::int64_t c_;
  double eps_, momentum_;
};

// (Outside the class, so not inline: see core/config.hpp.)
template <int Rank>
BatchNormImpl<Rank>::BatchNormImpl(std::int64_t num_features, double eps, double momentum, bool affine,
                                   bool track_running_stats)
    : Module(Rank == 1 ? "BatchNorm1d" : "BatchNorm2d"), c_(num_features), eps_(eps), momentum_(momentum) {
  if (num_features <= 0) {
    throw ShapeError(name() + ": expected a positive num_features, got " +
                     std::to_string(num_features));
  }
  if (affine) {
    weight = register_parameter("weight", ones<float>({num_features}));
    bias = register_parameter("bias", zeros<float>({num_features}));
  }
  if (track_running_stats) {
    running_mean = zeros<float>({num_features});
    running_var = ones<float>({num_features});
    num_batches_tracked = zeros<std::int64_t>({});
    register_buffer("running_mean", running_mean);
    register_buffer("running_var", running_var);
    register_buffer("num_batches_tracked", num_batches_tracked);
  }
}

template <int Rank>
template <FloatingElement T>
Tensor<T> BatchNormImpl<Rank>::forward(const Tensor<T>& x) {
  using F = T;
  const int r = x.dim();
  const bool ok = Rank == 1 ? (r == 2 || r == 3) : r == 4;
  if (!ok || x.size(1) != c_) {
    throw ShapeError(name() + ": expected input of shape " +
                     (Rank == 1 ? "(N, " + std::to_string(c_) + ") or (N, " + std::to_string(c_) + ", L)"
                                : "(N, " + std::to_string(c_) + ", H, W)") +
                     ", got " + x.shape().str());
  }
  std::vector<std::int64_t> dims{0};
  for (int d = 2; d < r; ++d) dims.push_back(d);
  Shape stat;  // [1, C, 1, ...]
  for (int d = 0; d < r; ++d) stat.push_back(d == 1 ? c_ : 1);
  Tensor<F> y;
  if (is_training() || !running_mean.defined()) {
    const std::int64_t count = x.numel() / c_;
    if (is_training() && count <= 1) {
      throw Error(name() + ": expected more than 1 value per channel when training, got input " + x.shape().str());
    }
    Tensor<F> mu = mean(x, dims, true);
    Tensor<F> xc = x - mu;
    Tensor<F> var = mean(xc * xc, dims, true);
    y = xc * rsqrt(var + static_cast<compute_t<F>>(eps_));
    if (is_training() && running_mean.defined()) {
      NoGradGuard guard;
      Tensor<F> rm = detail::param_as<F>(running_mean, *this), rv = detail::param_as<F>(running_var, *this);
      const auto m = static_cast<compute_t<F>>(momentum_);
      const auto unbias = static_cast<compute_t<F>>(count) / static_cast<compute_t<F>>(count - 1);
      rm.copy_(rm * (1 - m) + reshape(mu, Shape{c_}) * m);
      rv.copy_(rv * (1 - m) + reshape(var, Shape{c_}) * (m * unbias));
      num_batches_tracked.add_(1);
    }
  } else {
    y = (x - reshape(detail::param_as<F>(running_mean, *this), stat)) *
        rsqrt(reshape(detail::param_as<F>(running_var, *this), stat) + static_cast<compute_t<F>>(eps_));
  }
  if (weight.defined()) {
    y = y * reshape(detail::param_as<F>(weight, *this), stat) + reshape(detail::param_as<F>(bias, *this), stat);
  }
  return y;
}

using BatchNorm1dImpl = BatchNormImpl<1>;
using BatchNorm2dImpl = BatchNormImpl<2>;
LAZY_MODULE(BatchNorm1d);
LAZY_MODULE(BatchNorm2d);

#if LAZYTENSOR_HEADER_DEFINITIONS
LAZYTENSOR_INLINE void LayerNormImpl::pretty_print(std::ostream& os) const {
  os << "LayerNorm(" << shape_.str() << ", eps=" << eps_ << ")";
}
#endif  // LAZYTENSOR_HEADER_DEFINITIONS

}  // namespace lazy::nn

// Instantiated once in the compiled runtime (core/config.hpp).
#define LAZYTENSOR_NN_NORMALIZATION_INSTANCES(P)                                \
  P template lazy::nn::LayerNormImpl::LayerNormImpl(lazy::Shape, double, bool); \
  P template class lazy::nn::BatchNormImpl<1>;                                  \
  P template class lazy::nn::BatchNormImpl<2>;
#define LAZYTENSOR_NN_NORMALIZATION_FORWARD_INSTANCES(P, T)                                             \
  P template lazy::Tensor<T> lazy::nn::LayerNormImpl::forward<T>(const lazy::Tensor<T>&) const;        \
  P template lazy::Tensor<T> lazy::nn::BatchNormImpl<1>::forward<T>(const lazy::Tensor<T>&);           \
  P template lazy::Tensor<T> lazy::nn::BatchNormImpl<2>::forward<T>(const lazy::Tensor<T>&);
#if LAZYTENSOR_EXPLICIT_INSTANTIATION
LAZYTENSOR_NN_NORMALIZATION_INSTANCES(extern)
LAZYTENSOR_FOR_FLOATING(LAZYTENSOR_NN_NORMALIZATION_FORWARD_INSTANCES, extern)
#endif
