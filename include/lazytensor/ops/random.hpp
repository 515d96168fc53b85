#pragma once
// Random tensors from a counter-based generator (Philox4x32-10, Salmon et al., "Parallel
// Random Numbers: As Easy as 1, 2, 3", SC'11). A counter-based generator needs no state
// per thread: the value of element i is a pure function of (seed, counter(i)), so results
// are identical whatever the thread count and however the work is chunked.
//
// Streams: each call reserves a block of counters from its device's RngState at creation
// time (offset .. offset + blocks) and captures the seed; element i uses counter
// offset + i / P, where P is how many elements one 128-bit Philox output yields (4 for
// 32-bit draws, 2 for 64-bit draws): in the 4 * B words of a block of B consecutive
// counters, element j of the block reads word j (32-bit draws) or words 2j, 2j + 1. The
// values are computed lazily, at mark_step, by a RandomNode (graph/random_node.hpp, with
// Philox and the distributions), always a whole block at a time (block k holds the call's
// elements k * B * P ..), so a vectorized distribution gives every element the same bits
// whichever task computes it. set_rng_state / manual_seed restart the stream; mark_step
// advances the seed.

#include <cstdint>
#include <limits>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include <lazytensor/core/config.hpp>
#include <lazytensor/graph/submit.hpp>
#include <lazytensor/graph/random_node.hpp>
#include <lazytensor/tensor/device.hpp>
#include <lazytensor/tensor/tensor.hpp>

namespace lazy {

namespace detail {

/// Reserves the counters of `n` elements from the device stream and builds the node.
template <Element T, class D>
Tensor<T> make_random(D dist, const Shape& shape, const Device& dev, graph::NodeList inputs = {}) {
  graph::Device& eng = dev.engine();
  auto& rng = eng.rng();
  const auto blocks = static_cast<std::uint64_t>((shape.numel() + D::per_counter - 1) / D::per_counter);
  const std::uint64_t offset = rng.offset;
  rng.offset += blocks;
  return Tensor<T>(graph::submit(
      std::make_shared<graph::RandomNode<T, D>>(dist, shape, &eng, rng.seed, offset, std::move(inputs))));
}

template <class T>
constexpr std::int64_t exact_integer_limit() {
  if constexpr (std::is_same_v<T, bfloat16>) return std::int64_t{1} << 8;
  else if constexpr (std::is_same_v<T, float>) return std::int64_t{1} << 24;
  else return std::int64_t{1} << 53;
}

}  // namespace detail

/// Seeds the current device's random stream; alias of set_rng_state (torch.manual_seed).
inline void manual_seed(std::uint64_t seed) { set_rng_state(seed); }

/// Uniform values in [0, 1) (torch.rand). T: float, double or bfloat16. Lazy: drawn when
/// the tensor is materialized, identical whatever the thread count.
template <Element T>
  requires is_floating_v<T>
Tensor<T> rand(const Shape& shape, Device dev = device()) {
  return detail::make_random<T>(graph::detail::UniformDist<T>{}, shape, dev);
}

/// Standard normal values (torch.randn). T: float, double or bfloat16.
template <Element T>
  requires is_floating_v<T>
Tensor<T> randn(const Shape& shape, Device dev = device()) {
  return detail::make_random<T>(graph::detail::NormalDist<T>{}, shape, dev);
}

/// rand with t's shape and device.
template <Element T>
  requires is_floating_v<T>
Tensor<T> rand_like(const Tensor<T>& t) {
  return rand<T>(t.shape(), t.device());
}
/// randn with t's shape and device.
template <Element T>
  requires is_floating_v<T>
Tensor<T> randn_like(const Tensor<T>& t) {
  return randn<T>(t.shape(), t.device());
}

/// Integers uniform in [low, high) (torch.randint), stored as T (int32, int64, float,
/// double or bfloat16; default int64). lazy::Error when low >= high or when a bound does
/// not fit T (exactly, for floating T).
template <Element T = std::int64_t>
  requires(!std::is_same_v<T, bool>)
Tensor<T> randint(std::int64_t low, std::int64_t high, const Shape& shape, Device dev = device()) {
  if (low >= high) {
    throw Error("randint: expected low < high, got low=" + std::to_string(low) + ", high=" + std::to_string(high));
  }
  if constexpr (is_integral_v<T>) {
    if (low < std::numeric_limits<T>::min() || high - 1 > std::numeric_limits<T>::max()) {
      throw Error("randint: range [" + std::to_string(low) + ", " + std::to_string(high) + ") does not fit " +
                  dtype_name(dtype_of<T>()));
    }
  } else {
    constexpr std::int64_t lim = detail::exact_integer_limit<T>();
    if (low < -lim || high > lim) {
      throw Error("randint: range [" + std::to_string(low) + ", " + std::to_string(high) + ") is not exactly " +
                  "representable in " + dtype_name(dtype_of<T>()) + " (expected bounds within +-" +
                  std::to_string(lim) + ")");
    }
  }
  const std::uint64_t range = static_cast<std::uint64_t>(high) - static_cast<std::uint64_t>(low);
  return detail::make_random<T>(graph::detail::RandIntDist<T>{low, range}, shape, dev);
}

/// Integers uniform in [0, high) (torch.randint(high, size)).
template <Element T = std::int64_t>
  requires(!std::is_same_v<T, bool>)
Tensor<T> randint(std::int64_t high, const Shape& shape, Device dev = device()) {
  return randint<T>(0, high, shape, dev);
}

/// 1 with probability p, else 0, for every element (torch.empty(shape).bernoulli_(p)).
/// T: any element type (bool gives true/false). lazy::Error unless 0 <= p <= 1.
template <Element T>
Tensor<T> bernoulli(double p, const Shape& shape, Device dev = device()) {
  if (!(p >= 0.0 && p <= 1.0)) {
    throw Error("bernoulli: expected 0 <= p <= 1, got p=" + std::to_string(p));
  }
  return detail::make_random<T>(graph::detail::BernoulliDist<T>{p}, shape, dev);
}

/// Element i is 1 with probability probs[i], else 0 (torch.bernoulli(probs)); the result
/// has probs' shape, dtype and device. probs: a floating tensor or expression; values
/// outside [0, 1] raise lazy::Error when the kernel runs (next mark_step or read).
template <expr::ExprLike X>
  requires is_floating_v<expr::value_t<X>>
auto bernoulli(const X& probs) {
  using T = expr::value_t<X>;
  Tensor<T> p = [&] {
    if constexpr (std::is_same_v<X, Tensor<T>>) return probs;
    else if constexpr (expr::is_expr_node<X>::value) return Tensor<T>(probs);
    else return Tensor<T>(probs.to_leaf().node);
  }();
  return detail::make_random<T>(graph::detail::BernoulliTensorDist<T>{}, p.shape(), p.device(),
                                            {p.node()});
}

}  // namespace lazy

// Per-dtype templates the compiled runtime instantiates once (core/config.hpp).
#define LAZYTENSOR_RANDOM_INSTANCES(P, T)                                                                   \
  P template lazy::Tensor<T> lazy::detail::make_random<T, lazy::graph::detail::UniformDist<T>>(              \
      lazy::graph::detail::UniformDist<T>, const lazy::Shape&, const lazy::Device&, lazy::graph::NodeList); \
  P template lazy::Tensor<T> lazy::detail::make_random<T, lazy::graph::detail::NormalDist<T>>(               \
      lazy::graph::detail::NormalDist<T>, const lazy::Shape&, const lazy::Device&, lazy::graph::NodeList);
#define LAZYTENSOR_RANDINT_INSTANCES(P, T)                                                                  \
  P template lazy::Tensor<T> lazy::detail::make_random<T, lazy::graph::detail::RandIntDist<T>>(              \
      lazy::graph::detail::RandIntDist<T>, const lazy::Shape&, const lazy::Device&, lazy::graph::NodeList);
#if LAZYTENSOR_EXPLICIT_INSTANTIATION
LAZYTENSOR_FOR_FLOATING(LAZYTENSOR_RANDOM_INSTANCES, extern)
LAZYTENSOR_RANDINT_INSTANCES(extern, std::int32_t)
LAZYTENSOR_RANDINT_INSTANCES(extern, std::int64_t)
#endif
