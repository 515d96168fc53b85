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
    template <FloatingElement T>                                                               \
    Tensor<T> forward(const Tensor<T>& x) const;                                               \
    /** The same on a pending expression. */                                                   \
    template <expr::Pending E>                                                                 \
    auto forward(const E& x) const {                                                           \
      return forward(lazy::eval(x));                                                           \
    }                                                                                          \
    void pretty_print(std::ostream& os) const override { os << #NAME "()"; }                   \
  };                                                                                           \
  template <FloatingElement T>                                                                 \
  Tensor<T> NAME##Impl::forward(const Tensor<T>& x) const {                                    \
    return Tensor<T>(lazy::FN(x));                                                             \
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
  template <FloatingElement T>
  Tensor<T> forward(const Tensor<T>& x) const;
  /// The same on a pending expression.
  template <expr::Pending E>
  auto forward(const E& x) const {
    return forward(lazy::eval(x));
  }
  LAZYTENSOR_INLINE void pretty_print(std::ostream& os) const override;

 private:
  std::int64_t start_, end_;
};
// (Outside the class, so not inline: see core/config.hpp.)
template <FloatingElement T>
Tensor<T> FlattenImpl::forward(const Tensor<T>& x) const {
  return flatten(x, start_, end_);
}
LAZY_MODULE(Flatten);

/// Zeroes inputs with probability p during training (scaling the rest by 1 / (1 - p));
/// the identity in eval mode.
class DropoutImpl : public Module {
 public:
  explicit DropoutImpl(double p = 0.5);
  template <FloatingElement T>
  Tensor<T> forward(const Tensor<T>& x) const;
  /// The same on a pending expression.
  template <expr::Pending E>
  auto forward(const E& x) const {
    return forward(lazy::eval(x));
  }
  LAZYTENSOR_INLINE void pretty_print(std::ostream& os) const override;

 private:
  double p_;
};
template <FloatingElement T>
Tensor<T> DropoutImpl::forward(const Tensor<T>& x) const {
  return functional::dropout(x, p_, is_training());
}
LAZY_MODULE(Dropout);

#if LAZYTENSOR_HEADER_DEFINITIONS
LAZYTENSOR_INLINE void FlattenImpl::pretty_print(std::ostream& os) const {
  os << "Flatten(start_dim=" << start_ << ", end_dim=" << end_ << ")";
}

LAZYTENSOR_INLINE DropoutImpl::DropoutImpl(double p) : Module("Dropout"), p_(p) {
  if (!(p >= 0 && p <= 1))
    throw Error("Dropout: probability has to be between 0 and 1, but got " + std::to_string(p));
}

LAZYTENSOR_INLINE void DropoutImpl::pretty_print(std::ostream& os) const { os << "Dropout(p=" << p_ << ")"; }
#endif  // LAZYTENSOR_HEADER_DEFINITIONS

}  // namespace lazy::nn

// Instantiated once in the compiled runtime (core/config.hpp).
#define LAZYTENSOR_NN_ACTIVATION_INSTANCES(P, T)                                                     \
  P template lazy::Tensor<T> lazy::nn::ReLUImpl::forward<T>(const lazy::Tensor<T>&) const;    \
  P template lazy::Tensor<T> lazy::nn::GELUImpl::forward<T>(const lazy::Tensor<T>&) const;    \
  P template lazy::Tensor<T> lazy::nn::TanhImpl::forward<T>(const lazy::Tensor<T>&) const;    \
  P template lazy::Tensor<T> lazy::nn::SigmoidImpl::forward<T>(const lazy::Tensor<T>&) const; \
  P template lazy::Tensor<T> lazy::nn::SiLUImpl::forward<T>(const lazy::Tensor<T>&) const;    \
  P template lazy::Tensor<T> lazy::nn::FlattenImpl::forward<T>(const lazy::Tensor<T>&) const; \
  P template lazy::Tensor<T> lazy::nn::DropoutImpl::forward<T>(const lazy::Tensor<T>&) const;
#if LAZYTENSOR_EXPLICIT_INSTANTIATION
LAZYTENSOR_FOR_FLOATING(LAZYTENSOR_NN_ACTIVATION_INSTANCES, extern)
#endif
