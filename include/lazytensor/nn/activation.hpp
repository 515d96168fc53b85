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
    Tensor<float> forward(const Tensor<float>& x) const { return Tensor<float>(lazy::FN(x)); } \
    void pretty_print(std::ostream& os) const override { os << #NAME "()"; }                   \
  };                                                                                           \
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
  Tensor<float> forward(const Tensor<float>& x) const { return flatten(x, start_, end_); }
  void pretty_print(std::ostream& os) const override;

 private:
  std::int64_t start_, end_;
};
LAZY_MODULE(Flatten);

/// Zeroes inputs with probability p during training (scaling the rest by 1 / (1 - p));
/// the identity in eval mode.
class DropoutImpl : public Module {
 public:
  explicit DropoutImpl(double p = 0.5);
  template <class = void>
  Tensor<float> forward(const Tensor<float>& x) const { return functional::dropout(x, p_, is_training()); }
  void pretty_print(std::ostream& os) const override;

 private:
  double p_;
};
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
