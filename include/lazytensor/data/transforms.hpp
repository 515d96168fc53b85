#pragma once
// Transforms applied to examples, as torch::data::transforms. Normalize runs on the host
// while the batch is built: datasets that convert raw bytes to floats (MNIST) fold it into
// that conversion, so normalizing costs nothing extra.

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <lazytensor/core/config.hpp>
#include <lazytensor/core/error.hpp>
#include <lazytensor/data/example.hpp>

namespace lazy::data::transforms {

/// (x - mean[c]) / stddev[c] on the data of each example, c being the channel: dimension 0
/// of an example, dimension 1 of a batch (a single mean/stddev applies to every element).
/// Computed in float, as libtorch's Normalize on a float tensor.
class Normalize {
 public:
  /// One mean and stddev for every channel.
  Normalize(double mean, double stddev);
  /// Per-channel means and standard deviations (equal, non-zero counts; stddev non-zero).
  Normalize(const std::vector<double>& mean, const std::vector<double>& stddev);

  /// Number of channels (1 when one mean applies to everything).
  std::size_t channels() const { return mean_.size(); }
  /// The normalized value of x in channel c.
  float operator()(float x, std::size_t c) const { return (x - mean_[c]) / stddev_[c]; }

  /// Checks that data with `channels` channels can be normalized; ShapeError otherwise.
  void check_channels(std::int64_t channels, const Shape& shape) const;

  /// x normalized, channels along `channel_dim` (a new tensor on x's device).
  Tensor<float> apply(const Tensor<float>& x, int channel_dim) const;

  /// Normalizes an example's data (channels along dimension 0).
  template <class Target>
  Example<Tensor<float>, Target> operator()(Example<Tensor<float>, Target> example) const {
    example.data = apply(example.data, 0);
    return example;
  }
  /// Normalizes a batch's data (channels along dimension 1).
  template <class Target>
  Example<Tensor<float>, Target> apply_batch(Example<Tensor<float>, Target> batch) const {
    batch.data = apply(batch.data, 1);
    return batch;
  }

  const std::vector<float>& mean() const { return mean_; }
  const std::vector<float>& stddev() const { return stddev_; }

 private:
  std::vector<float> mean_, stddev_;
};

#if LAZYTENSOR_HEADER_DEFINITIONS
LAZYTENSOR_INLINE Normalize::Normalize(double mean, double stddev)
    : Normalize(std::vector<double>{mean}, std::vector<double>{stddev}) {}

LAZYTENSOR_INLINE Normalize::Normalize(const std::vector<double>& mean,
                                       const std::vector<double>& stddev) {
  if (mean.empty() || mean.size() != stddev.size()) {
    throw ShapeError(
        "Normalize: expected as many means as standard deviations (at least one), got " +
        std::to_string(mean.size()) + " and " + std::to_string(stddev.size()));
  }
  for (std::size_t c = 0; c < mean.size(); ++c) {
    // Checked as the floats the transform divides by: 1e-50 is not 0 as a double.
    const float m = static_cast<float>(mean[c]), sd = static_cast<float>(stddev[c]);
    if (!std::isfinite(m) || !std::isfinite(sd) || sd == 0) {
      throw Error(
          "Normalize: expected a finite mean and a finite, non-zero stddev (as floats) for "
          "channel " +
          std::to_string(c) + ", got mean " + std::to_string(mean[c]) + " and stddev " +
          std::to_string(stddev[c]));
    }
    mean_.push_back(m);
    stddev_.push_back(sd);
  }
}

LAZYTENSOR_INLINE void Normalize::check_channels(std::int64_t channels, const Shape& shape) const {
  if (mean_.size() != 1 && static_cast<std::int64_t>(mean_.size()) != channels) {
    throw ShapeError("Normalize: " + std::to_string(mean_.size()) +
                     " channel means for data of shape " + shape.str() + ", which has " +
                     std::to_string(channels) + " channels");
  }
}

LAZYTENSOR_INLINE Tensor<float> Normalize::apply(const Tensor<float>& x, int channel_dim) const {
  const Shape& s = x.shape();
  const std::int64_t channels = channel_dim < s.rank() ? s[channel_dim] : 1;
  check_channels(channels, s);
  std::int64_t inner = 1;
  for (int d = channel_dim + 1; d < s.rank(); ++d) inner *= s[d];
  const float* src = x.data();
  detail::HostTensor<float> out(s, x.device());
  float* dst = out.data();
  const std::int64_t n = x.numel();
  for (std::int64_t i = 0; i < n; ++i) {
    const auto c =
        mean_.size() == 1 ? std::size_t{0} : static_cast<std::size_t>((i / inner) % channels);
    dst[i] = (*this)(src[i], c);
  }
  return std::move(out).finish();
}
#endif  // LAZYTENSOR_HEADER_DEFINITIONS

}  // namespace lazy::data::transforms
