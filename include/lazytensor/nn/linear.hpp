#pragma once
// nn::Linear: y = x W^T + b, initialized as PyTorch does (kaiming uniform with a = sqrt(5),
// i.e. U(-1/sqrt(in), 1/sqrt(in)) for both weight and bias).

#include <cmath>
#include <cstdint>
#include <string>

#include <lazytensor/core/config.hpp>
#include <lazytensor/nn/init.hpp>
#include <lazytensor/nn/module.hpp>
#include <lazytensor/ops/matmul.hpp>

namespace lazy::nn {

/// A fully connected layer.
class LinearImpl : public Module {
 public:
  /// in_features -> out_features, with a bias unless `bias` is false.
  template <class = void>
  LinearImpl(std::int64_t in_features, std::int64_t out_features, bool bias = true);

  /// x [..., in_features] -> [..., out_features], in x's dtype (the layer's, after
  /// to(dtype)); bias and a following element-wise op run on the GEMM's row blocks.
  template <FloatingElement T>
  Tensor<T> forward(const Tensor<T>& x) const;
  /// The same on a pending expression.
  template <expr::Pending E>
  auto forward(const E& x) const {
    return forward(lazy::eval(x));
  }

  LAZYTENSOR_INLINE void pretty_print(std::ostream& os) const override;

  Tensor<float> weight;
  Tensor<float> bias;

 private:
  std::int64_t in_, out_;
};
LAZY_MODULE(Linear);

// (Outside the class, so not inline: see core/config.hpp.)
template <class>
LinearImpl::LinearImpl(std::int64_t in_features, std::int64_t out_features, bool bias)
    : Module("Linear"), in_(in_features), out_(out_features) {
  if (in_features <= 0 || out_features <= 0) {
    throw ShapeError("Linear: expected positive in_features and out_features, got " + std::to_string(in_features) +
                     " and " + std::to_string(out_features));
  }
  weight = register_parameter("weight", empty<float>({out_features, in_features}));
  init::kaiming_uniform_(weight, std::sqrt(5.0));
  if (bias) {
    this->bias = register_parameter("bias", empty<float>({out_features}));
    const double bound = 1.0 / std::sqrt(static_cast<double>(in_features));
    init::uniform_(this->bias, -bound, bound);
  }
}

template <FloatingElement T>
Tensor<T> LinearImpl::forward(const Tensor<T>& x) const {
  const Tensor<T> w = detail::param_as<T>(weight, *this);
  if (bias.defined()) return linear(x, w, detail::param_as<T>(bias, *this));
  return linear(x, w);
}

#if LAZYTENSOR_HEADER_DEFINITIONS
LAZYTENSOR_INLINE void LinearImpl::pretty_print(std::ostream& os) const {
  os << "Linear(in_features=" << in_ << ", out_features=" << out_ << ", bias=" << (bias.defined() ? "True" : "False")
     << ")";
}
#endif  // LAZYTENSOR_HEADER_DEFINITIONS

}  // namespace lazy::nn

// Instantiated once in the compiled runtime (core/config.hpp).
#define LAZYTENSOR_NN_LINEAR_INSTANCES(P)                                          \
  P template lazy::nn::LinearImpl::LinearImpl(std::int64_t, std::int64_t, bool);
#define LAZYTENSOR_NN_LINEAR_FORWARD_INSTANCES(P, T) \
  P template lazy::Tensor<T> lazy::nn::LinearImpl::forward<T>(const lazy::Tensor<T>&) const;
#if LAZYTENSOR_EXPLICIT_INSTANTIATION
LAZYTENSOR_NN_LINEAR_INSTANCES(extern)
LAZYTENSOR_FOR_FLOATING(LAZYTENSOR_NN_LINEAR_FORWARD_INSTANCES, extern)
#endif
