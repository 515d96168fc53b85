#pragma once
// nn::Embedding: a lookup table of num_embeddings vectors (initialized N(0, 1) as torch).

#include <cstdint>
#include <string>

#include <lazytensor/core/config.hpp>
#include <lazytensor/nn/init.hpp>
#include <lazytensor/nn/module.hpp>
#include <lazytensor/ops/shape.hpp>

namespace lazy::nn {

/// Maps integer indices to learned vectors.
class EmbeddingImpl : public Module {
 public:
  template <class = void>
  EmbeddingImpl(std::int64_t num_embeddings, std::int64_t embedding_dim);
  /// indices of any shape -> indices.shape + [embedding_dim]. Out-of-range indices raise
  /// IndexError when computed.
  template <FloatingElement T = float, IndexElement I>
  Tensor<T> forward(const Tensor<I>& indices) const;
  LAZYTENSOR_INLINE void pretty_print(std::ostream& os) const override;

  Tensor<float> weight;

 private:
  std::int64_t n_, d_;
};
LAZY_MODULE(Embedding);

// (Outside the class, so not inline: see core/config.hpp.)
template <class>
EmbeddingImpl::EmbeddingImpl(std::int64_t num_embeddings, std::int64_t embedding_dim)
    : Module("Embedding"), n_(num_embeddings), d_(embedding_dim) {
  if (num_embeddings <= 0 || embedding_dim <= 0) {
    throw ShapeError("Embedding: expected positive sizes, got " + std::to_string(num_embeddings) + " and " +
                     std::to_string(embedding_dim));
  }
  weight = register_parameter("weight", empty<float>({num_embeddings, embedding_dim}));
  init::normal_(weight);
}

template <FloatingElement T, IndexElement I>
Tensor<T> EmbeddingImpl::forward(const Tensor<I>& indices) const {
  Shape out = indices.shape();
  out.push_back(d_);
  return reshape(index_select(detail::param_as<T>(weight, *this), 0, reshape(indices, Shape{indices.numel()})), out);
}

#if LAZYTENSOR_HEADER_DEFINITIONS
LAZYTENSOR_INLINE void EmbeddingImpl::pretty_print(std::ostream& os) const {
  os << "Embedding(" << n_ << ", " << d_ << ")";
}
#endif  // LAZYTENSOR_HEADER_DEFINITIONS

}  // namespace lazy::nn

// Instantiated once in the compiled runtime (core/config.hpp).
#define LAZYTENSOR_NN_EMBEDDING_INSTANCES(P) \
  P template lazy::nn::EmbeddingImpl::EmbeddingImpl(std::int64_t, std::int64_t);
#define LAZYTENSOR_NN_EMBEDDING_FORWARD_INSTANCES(P, T)                                                           \
  P template lazy::Tensor<T> lazy::nn::EmbeddingImpl::forward<T, std::int32_t>(const lazy::Tensor<std::int32_t>&) \
      const;                                                                                                     \
  P template lazy::Tensor<T> lazy::nn::EmbeddingImpl::forward<T, std::int64_t>(const lazy::Tensor<std::int64_t>&) \
      const;
#if LAZYTENSOR_EXPLICIT_INSTANTIATION
LAZYTENSOR_NN_EMBEDDING_INSTANCES(extern)
LAZYTENSOR_FOR_FLOATING(LAZYTENSOR_NN_EMBEDDING_FORWARD_INSTANCES, extern)
#endif
