#pragma once
// The loader each replica of a Trainer iterates: with replicas and use_distributed_sampler,
// a loader over the same dataset whose sampler gives the replica its share (Lightning's
// DistributedSampler / DistributedSamplerWrapper injection); otherwise the user's loader.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include <lazytensor/core/error.hpp>
#include <lazytensor/data/data_loader.hpp>
#include <lazytensor/data/sampler.hpp>
#include <lazytensor/train/strategy.hpp>

namespace lazy::train::detail {

template <class L>
inline constexpr bool is_data_loader_v = false;
template <class D>
inline constexpr bool is_data_loader_v<data::DataLoader<D>> = true;

/// Replica `rank`'s share of an evaluation set: rank, rank + R, rank + 2R, ... Unlike a
/// DistributedSampler it does not pad the shares to one size, so every sample is evaluated
/// exactly once (evaluation loops have no per-batch collectives that would need equal
/// batch counts).
class ShardSampler final : public data::Sampler {
 public:
  ShardSampler(std::size_t replicas, std::size_t rank) : replicas_(replicas), rank_(rank) {}
  std::vector<std::size_t> indices(std::size_t n) const override {
    std::vector<std::size_t> mine;
    for (std::size_t i = rank_; i < n; i += replicas_) mine.push_back(i);
    return mine;
  }
  std::size_t size(std::size_t n) const override { return n > rank_ ? (n - rank_ + replicas_ - 1) / replicas_ : 0; }

 private:
  std::size_t replicas_, rank_;
};

/// A replica's share of a user's own sampler (Lightning's DistributedSamplerWrapper): the
/// sampler's indices for the epoch, padded to a multiple of R by repeating from the start
/// when `pad` (training: equal shares, so the replicas' steps pair up), then every R-th
/// from position `rank`. The replicas' threads share the sampler, so its epoch is set and
/// its indices taken under one lock.
class SamplerShard final : public data::Sampler {
 public:
  SamplerShard(data::Sampler& inner, std::size_t replicas, std::size_t rank, bool pad)
      : inner_(&inner), replicas_(replicas), rank_(rank), pad_(pad) {}
  std::vector<std::size_t> indices(std::size_t n) const override {
    std::vector<std::size_t> all;
    {
      std::lock_guard guard(lock());
      inner_->set_epoch(epoch());
      all = inner_->indices(n);
    }
    const std::size_t m = all.size();
    if (pad_ && m > 0) {
      const std::size_t total = (m + replicas_ - 1) / replicas_ * replicas_;
      for (std::size_t k = 0; all.size() < total; ++k) all.push_back(all[k % m]);
    }
    std::vector<std::size_t> mine;
    for (std::size_t i = rank_; i < all.size(); i += replicas_) mine.push_back(all[i]);
    return mine;
  }
  std::size_t size(std::size_t n) const override {
    std::size_t m = 0;
    {
      std::lock_guard guard(lock());
      inner_->set_epoch(epoch());  // (a sampler's size may depend on its epoch)
      m = inner_->size(n);
    }
    if (pad_) return (m + replicas_ - 1) / replicas_;
    return m > rank_ ? (m - rank_ + replicas_ - 1) / replicas_ : 0;
  }

 private:
  static std::mutex& lock() {
    static std::mutex m;
    return m;
  }
  data::Sampler* inner_;
  std::size_t replicas_, rank_;
  bool pad_;
};

/// The loader one replica iterates: the given one, or (with replicas) a loader over the
/// same dataset whose sampler gives this replica its share: a DistributedSampler for
/// training (equal shares, so the replicas' steps pair up) with the shuffle, seed and
/// drop_last of the loader's own sampler (a DistributedSampler's, or a RandomSampler's
/// seed), a ShardSampler for evaluation, and a SamplerShard of any other sampler (which
/// may select a subset: a training split).
template <class L>
class ReplicaLoader {
 public:
  ReplicaLoader(L& loader, const Strategy& s, bool distribute, bool training = true) : loader_(&loader) {
    if (!distribute || !s.is_distributed()) return;
    if constexpr (is_data_loader_v<L>) {
      data::DataLoaderOptions o = loader.options();
      data::Sampler* own_sampler = loader.sampler();
      bool shuffle = o.shuffle, drop_last = false;
      std::uint64_t seed = o.seed;
      if (const auto* d = dynamic_cast<const data::DistributedSampler*>(own_sampler)) {
        // (Its rank and replica count were one replica's; the settings hold for all.)
        shuffle = d->shuffle(), seed = d->seed(), drop_last = d->drop_last(), own_sampler = nullptr;
      } else if (const auto* r = dynamic_cast<const data::RandomSampler*>(own_sampler)) {
        shuffle = true, seed = r->seed(), own_sampler = nullptr;
      } else if (dynamic_cast<const data::SequentialSampler*>(own_sampler)) {
        own_sampler = nullptr;
      }
      o.shuffle = false;
      o.device = s.root_device();
      const auto world = static_cast<std::size_t>(s.world_size()), rank = static_cast<std::size_t>(s.global_rank());
      if (own_sampler) {
        own_ = data::make_data_loader(loader.dataset(),
                                      SamplerShard(*own_sampler, world, rank, training), o);
      } else if (training) {
        own_ = data::make_data_loader(
            loader.dataset(), data::DistributedSampler(world, rank, shuffle, seed, drop_last), o);
      } else {
        own_ = data::make_data_loader(loader.dataset(), ShardSampler(world, rank), o);
      }
      loader_ = own_.get();
    } else if (s.global_rank() != 0) {
      throw Error("Trainer: with replicas and use_distributed_sampler, the loader must be a lazy::data::DataLoader "
                  "(each replica gets its share of its dataset); set use_distributed_sampler = false to give every "
                  "replica the whole loader");
    }
  }
  L& get() { return *loader_; }

 private:
  L* loader_;
  std::unique_ptr<L> own_;
};

}  // namespace lazy::train::detail
