#pragma once
// Parameter-free layers: activations, Flatten, Dropout.

#include <cstdint>
#include <string>

#include <lazytensor/core/config.hpp>
#include <lazytensor/nn/functional.hpp>
#include <lazytensor/nn/module.hpp>

namespace lazy::nn {

#define LAZY_ACTIVATION(NAME, FN)                                                              \
  /** Element-wise FN as a layer. */                                                            \
  class NAME##Impl : public Module {                                                           \
   public:                                                                                     \
    NAME##Impl() : Module(#NAME) {}                                                            \
    template <class = void>                                                                    \
    Tensor<float> forward(const Tensor<float>& x) const;                                       \
    void pretty_print(std::ostream& os) const override { os << #NAME "()"; }                   \
  };                                                                                           \
  template <class>                                                                             \
  Tensor<float> NAME##Impl::forward(const Tensor<float>& x) const {                            \
    return Tensor<float>(lazy::FN(x));                                                         \
  }                                                                                            \
  LAZY_MODULE(NAME)

LAZY_ACTIVATION(ReLU, relu);
LAZY_ACTIVATION(GELU, gelu);
LAZY_ACTIVATION(Tanh, tanh);
LAZY_ACTIVATION(Sigmoid, sigmoid);
LAZY_ACTIVATION(SiLU, silu);
#undef LAZY_ACTIVATION

/// Flattens dims start_dim..end_dim (default: all but the batch dim).
class FlattenImpl : public Module {
 public:
  explicit FlattenImpl(std::int64_t start_dim = 1, std::int64_t end_dim = -1)
      : Module("Flatten"), start_(start_dim), end_(end_dim) {}
  template <class = void>
  Tensor<float> forward(const Tensor<float>& x) const;
  void pretty_print(std::ostream& os) const override;

 private:
  std::int64_t start_, end_;
};
// (Outside the class, so not inline: see core/config.hpp.)
template <class>
Tensor<float> FlattenImpl::forward(const Tensor<float>& x) const {
  return flatten(x, start_, end_);
}
LAZY_MODULE(Flatten);

/// Zeroes inputs with probability p during training (scaling the rest by 1 / (1 - p));
/// the identity in eval mode.
class DropoutImpl : public Module {
 public:
  explicit DropoutImpl(double p = 0.5);
  template <class = void>
  Tensor<float> forward(const Tensor<float>& x) const;
  void pretty_print(std::ostream& os) const override;

 private:
  double p_;
};
template <class>
Tensor<float> DropoutImpl::forward(const Tensor<float>& x) const {
  return functional::dropout(x, p_, is_training());
}
LAZY_MODULE(Dropout);

#if LAZYTENSOR_HEADER_DEFINITIONS
LAZYTENSOR_INLINE void FlattenImpl::pretty_print(std::ostream& os) const {
  os << "Flatten(start_dim=" << start_ << ", end_dim=" << end_ << ")";
}

LAZYTENSOR_INLINE DropoutImpl::DropoutImpl(double p) : Module("Dropout"), p_(p) {
  if (p < 0 || p > 1) throw Error("Dropout: probability has to be between 0 and 1, but got " + std::to_string(p));
}

LAZYTENSOR_INLINE void DropoutImpl::pretty_print(std::ostream& os) const { os << "Dropout(p=" << p_ << ")"; }
#endif  // LAZYTENSOR_HEADER_DEFINITIONS

}  // namespace lazy::nn

// Instantiated once in the compiled runtime (core/config.hpp).
#define LAZYTENSOR_NN_ACTIVATION_INSTANCES(P)                                                      \
  P template lazy::Tensor<float> lazy::nn::ReLUImpl::forward<void>(const lazy::Tensor<float>&) const;    \
  P template lazy::Tensor<float> lazy::nn::GELUImpl::forward<void>(const lazy::Tensor<float>&) const;    \
  P template lazy::Tensor<float> lazy::nn::TanhImpl::forward<void>(const lazy::Tensor<float>&) const;    \
  P template lazy::Tensor<float> lazy::nn::SigmoidImpl::forward<void>(const lazy::Tensor<float>&) const; \
  P template lazy::Tensor<float> lazy::nn::SiLUImpl::forward<void>(const lazy::Tensor<float>&) const;    \
  P template lazy::Tensor<float> lazy::nn::FlattenImpl::forward<void>(const lazy::Tensor<float>&) const; \
  P template lazy::Tensor<float> lazy::nn::DropoutImpl::forward<void>(const lazy::Tensor<float>&) const;
#if LAZYTENSOR_EXPLICIT_INSTANTIATION
LAZYTENSOR_NN_ACTIVATION_INSTANCES(extern)
#endif
