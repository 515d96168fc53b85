#pragma once
// Parameter initializers, as torch.nn.init: each fills a floating tensor in place (without
// recording history) from the current device's random stream.

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>

#include <lazytensor/core/config.hpp>
#include <lazytensor/ops/random.hpp>
#include <lazytensor/ops/factories.hpp>
#include <lazytensor/tensor/tensor.hpp>

namespace lazy::nn::init {

/// Which fan kaiming_* scales by.
enum class FanMode { FanIn, FanOut };
/// The nonlinearity a gain is computed for (torch.nn.init.calculate_gain).
enum class Nonlinearity { Linear, Sigmoid, Tanh, ReLU, LeakyReLU };

/// torch.nn.init.calculate_gain.
double calculate_gain(Nonlinearity nl, double param = 0.01);

/// (fan_in, fan_out) of a weight: dim 1 and dim 0 sizes times the receptive field (the
/// product of the remaining dims), as torch computes them.
std::pair<double, double> fans(const Shape& s);

/// Fills with U(a, b). Error unless a <= b and b - a is finite in T, as libtorch (so NaN and
/// infinite bounds are errors too).
template <FloatingElement T>
Tensor<T>& uniform_(Tensor<T>& t, double a = 0, double b = 1) {
  if (!(a <= b)) {
    throw Error("uniform_ expects to return a [from, to) range, but found from=" +
                std::to_string(a) + " > to=" + std::to_string(b));
  }
  if (!(b - a <= static_cast<double>(std::numeric_limits<compute_t<T>>::max()))) {
    throw Error("uniform_ expects to-from <= std::numeric_limits<" + dtype_name(dtype_of<T>()) +
                ">::max(), but found to=" + std::to_string(b) + " and from=" + std::to_string(a) +
                " which result in to-from to exceed the limit");
  }
  NoGradGuard guard;
  // Drawn in float (the stream every dtype shares); double scales in double.
  if constexpr (std::is_same_v<T, double>)
    t.copy_(cast<double>(rand<float>(t.shape(), t.device())) * (b - a) + a);
  else
    t.copy_(rand<float>(t.shape(), t.device()) * static_cast<float>(b - a) + static_cast<float>(a));
  return t;
}
/// Fills with N(mean, std^2). Error unless std >= 0 (so a NaN std too), as libtorch.
template <FloatingElement T>
Tensor<T>& normal_(Tensor<T>& t, double mean = 0, double std = 1) {
  if (!(std >= 0.0))
    throw Error("normal_ expects std >= 0.0, but found std " + std::to_string(std));
  NoGradGuard guard;
  if constexpr (std::is_same_v<T, double>)
    t.copy_(cast<double>(randn<float>(t.shape(), t.device())) * std + mean);
  else
    t.copy_(randn<float>(t.shape(), t.device()) * static_cast<float>(std) + static_cast<float>(mean));
  return t;
}
/// Fills with `value`.
template <FloatingElement T>
Tensor<T>& constant_(Tensor<T>& t, double value) {
  NoGradGuard guard;
  t.fill_(value);
  return t;
}
/// Fills with zeros.
template <FloatingElement T>
Tensor<T>& zeros_(Tensor<T>& t) { return constant_(t, 0); }
/// Fills with ones.
template <FloatingElement T>
Tensor<T>& ones_(Tensor<T>& t) { return constant_(t, 1); }

/// Glorot uniform: U(-a, a), a = gain * sqrt(6 / (fan_in + fan_out)).
template <FloatingElement T>
Tensor<T>& xavier_uniform_(Tensor<T>& t, double gain = 1) {
  auto [in, out] = fans(t.shape());
  const double a = gain * std::sqrt(6.0 / (in + out));
  return uniform_(t, -a, a);
}
/// Glorot normal: N(0, std^2), std = gain * sqrt(2 / (fan_in + fan_out)).
template <FloatingElement T>
Tensor<T>& xavier_normal_(Tensor<T>& t, double gain = 1) {
  auto [in, out] = fans(t.shape());
  return normal_(t, 0, gain * std::sqrt(2.0 / (in + out)));
}
/// He uniform: U(-b, b), b = gain(nl, a) * sqrt(3 / fan).
template <FloatingElement T>
Tensor<T>& kaiming_uniform_(Tensor<T>& t, double a = 0, FanMode mode = FanMode::FanIn,
                                       Nonlinearity nl = Nonlinearity::LeakyReLU) {
  auto [in, out] = fans(t.shape());
  const double fan = mode == FanMode::FanIn ? in : out;
  const double bound = calculate_gain(nl, a) * std::sqrt(3.0 / fan);
  return uniform_(t, -bound, bound);
}
/// He normal: N(0, std^2), std = gain(nl, a) / sqrt(fan).
template <FloatingElement T>
Tensor<T>& kaiming_normal_(Tensor<T>& t, double a = 0, FanMode mode = FanMode::FanIn,
                                      Nonlinearity nl = Nonlinearity::LeakyReLU) {
  auto [in, out] = fans(t.shape());
  const double fan = mode == FanMode::FanIn ? in : out;
  return normal_(t, 0, calculate_gain(nl, a) / std::sqrt(fan));
}

#if LAZYTENSOR_HEADER_DEFINITIONS
LAZYTENSOR_INLINE double calculate_gain(Nonlinearity nl, double param) {
  switch (nl) {
    case Nonlinearity::Linear:
    case Nonlinearity::Sigmoid: return 1.0;
    case Nonlinearity::Tanh: return 5.0 / 3.0;
    case Nonlinearity::ReLU: return std::sqrt(2.0);
    case Nonlinearity::LeakyReLU: return std::sqrt(2.0 / (1.0 + param * param));
  }
  return 1.0;
}

LAZYTENSOR_INLINE std::pair<double, double> fans(const Shape& s) {
  if (s.rank() < 2) {
    throw ShapeError("init: fan in and fan out can not be computed for a tensor with fewer than 2 dimensions (shape " +
                     s.str() + ")");
  }
  double field = 1;
  for (int i = 2; i < s.rank(); ++i) field *= static_cast<double>(s[i]);
  return {static_cast<double>(s[1]) * field, static_cast<double>(s[0]) * field};
}
#endif  // LAZYTENSOR_HEADER_DEFINITIONS

}  // namespace lazy::nn::init

// Instantiated once in the compiled runtime (core/config.hpp).
#define LAZYTENSOR_NN_INIT_INSTANCES(P)                                                                           \
  P template lazy::Tensor<float>& lazy::nn::init::uniform_<float>(lazy::Tensor<float>&, double, double);            \
  P template lazy::Tensor<float>& lazy::nn::init::normal_<float>(lazy::Tensor<float>&, double, double);             \
  P template lazy::Tensor<float>& lazy::nn::init::constant_<float>(lazy::Tensor<float>&, double);                   \
  P template lazy::Tensor<float>& lazy::nn::init::zeros_<float>(lazy::Tensor<float>&);                              \
  P template lazy::Tensor<float>& lazy::nn::init::ones_<float>(lazy::Tensor<float>&);                               \
  P template lazy::Tensor<float>& lazy::nn::init::xavier_uniform_<float>(lazy::Tensor<float>&, double);             \
  P template lazy::Tensor<float>& lazy::nn::init::xavier_normal_<float>(lazy::Tensor<float>&, double);              \
  P template lazy::Tensor<float>& lazy::nn::init::kaiming_uniform_<float>(                                          \
      lazy::Tensor<float>&, double, lazy::nn::init::FanMode, lazy::nn::init::Nonlinearity);                        \
  P template lazy::Tensor<float>& lazy::nn::init::kaiming_normal_<float>(                                           \
      lazy::Tensor<float>&, double, lazy::nn::init::FanMode, lazy::nn::init::Nonlinearity);
#if LAZYTENSOR_EXPLICIT_INSTANTIATION
LAZYTENSOR_NN_INIT_INSTANCES(extern)
#endif
