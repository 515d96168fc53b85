#pragma once
// Samplers: which dataset indices an epoch visits, in which order. A DataLoader takes one
// (by default sequential, or RandomSampler when shuffle is on) and forwards set_epoch to it.

#include <cstddef>
#include <cstdint>
#include <numeric>
#include <string>
#include <vector>

#include <lazytensor/core/config.hpp>
#include <lazytensor/core/error.hpp>
#include <lazytensor/data/shuffle.hpp>

namespace lazy::data {

/// The order of the indices of one epoch over a dataset.
class Sampler {
 public:
  virtual ~Sampler() = default;
  /// The indices of the current epoch, for a dataset of `dataset_size` samples.
  virtual std::vector<std::size_t> indices(std::size_t dataset_size) const = 0;
  /// How many indices indices(dataset_size) returns.
  virtual std::size_t size(std::size_t dataset_size) const = 0;
  /// Selects the epoch (which shuffle a shuffling sampler uses).
  void set_epoch(std::uint64_t epoch) { epoch_ = epoch; }
  /// The selected epoch.
  std::uint64_t epoch() const { return epoch_; }

 private:
  std::uint64_t epoch_ = 0;
};

/// 0, 1, ..., n-1.
class SequentialSampler final : public Sampler {
 public:
  LAZYTENSOR_INLINE std::vector<std::size_t> indices(std::size_t n) const override;
  std::size_t size(std::size_t n) const override { return n; }
};

/// A permutation of 0..n-1 drawn from (seed, epoch) (data::permutation).
class RandomSampler final : public Sampler {
 public:
  explicit RandomSampler(std::uint64_t seed = 0) : seed_(seed) {}
  std::vector<std::size_t> indices(std::size_t n) const override {
    return permutation(n, seed_, epoch());
  }
  std::size_t size(std::size_t n) const override { return n; }
  std::uint64_t seed() const { return seed_; }

 private:
  std::uint64_t seed_;
};

/// The share of replica `rank` out of `num_replicas`, as torch.utils.data.DistributedSampler:
/// every replica draws the same permutation of 0..n-1 (from seed and epoch; the identity
/// when shuffle is off); without drop_last it is padded by repeating indices from its start
/// up to ceil(n / R) * R, with drop_last cut to floor(n / R) * R; replica r then takes
/// positions r, r + R, r + 2R, ... So each replica gets ceil(n / R) (floor with drop_last)
/// samples, and together the replicas cover the (padded) permutation exactly once.
class DistributedSampler final : public Sampler {
 public:
  /// IndexError when num_replicas is 0 or rank is not in [0, num_replicas).
  DistributedSampler(std::size_t num_replicas, std::size_t rank, bool shuffle = true,
                     std::uint64_t seed = 0, bool drop_last = false);

  std::size_t size(std::size_t n) const override {
    return drop_last_ ? n / num_replicas_ : (n + num_replicas_ - 1) / num_replicas_;
  }

  LAZYTENSOR_INLINE std::vector<std::size_t> indices(std::size_t n) const override;

  std::size_t num_replicas() const { return num_replicas_; }
  std::size_t rank() const { return rank_; }
  bool shuffle() const { return shuffle_; }
  std::uint64_t seed() const { return seed_; }
  bool drop_last() const { return drop_last_; }

 private:
  std::size_t num_replicas_, rank_;
  bool shuffle_;
  std::uint64_t seed_;
  bool drop_last_;
};

#if LAZYTENSOR_HEADER_DEFINITIONS
LAZYTENSOR_INLINE std::vector<std::size_t> SequentialSampler::indices(std::size_t n) const {
  std::vector<std::size_t> v(n);
  std::iota(v.begin(), v.end(), std::size_t{0});
  return v;
}

LAZYTENSOR_INLINE DistributedSampler::DistributedSampler(std::size_t num_replicas, std::size_t rank,
                                                         bool shuffle, std::uint64_t seed,
                                                         bool drop_last)
    : num_replicas_(num_replicas),
      rank_(rank),
      shuffle_(shuffle),
      seed_(seed),
      drop_last_(drop_last) {
  if (num_replicas == 0)
    throw IndexError("DistributedSampler: num_replicas must be at least 1, got 0");
  if (rank >= num_replicas) {
    throw IndexError("DistributedSampler: invalid rank " + std::to_string(rank) +
                     ", rank should be in the interval [0, " + std::to_string(num_replicas - 1) +
                     "]");
  }
}

LAZYTENSOR_INLINE std::vector<std::size_t> DistributedSampler::indices(std::size_t n) const {
  std::vector<std::size_t> all =
      shuffle_ ? permutation(n, seed_, epoch()) : SequentialSampler().indices(n);
  const std::size_t total = size(n) * num_replicas_;
  // Padding repeats the list from its start, cyclically when it must grow more than twice.
  for (std::size_t k = 0; all.size() < total; ++k) {
    const std::size_t repeat = all[k % n];
    all.push_back(repeat);
  }
  all.resize(total);
  std::vector<std::size_t> mine;
  mine.reserve(size(n));
  for (std::size_t i = rank_; i < total; i += num_replicas_) mine.push_back(all[i]);
  return mine;
}
#endif  // LAZYTENSOR_HEADER_DEFINITIONS

}  // namespace lazy::data
