#pragma once
// A device's cache of execution plans, by structural hash, bounded like PyTorch/XLA's
// compilation cache (XLA_COMPILATION_CACHE_SIZE): a program whose graph keeps changing
// (a new shape every step) would otherwise keep every plan it ever built. The least
// recently used plan goes first, so the few graphs a training loop repeats stay.

#include <cstddef>
#include <cstdint>
#include <list>
#include <memory>
#include <unordered_map>
#include <utility>

#include <lazytensor/core/counters.hpp>
#include <lazytensor/core/env.hpp>
#include <lazytensor/core/config.hpp>

namespace lazy::graph {

struct Plan;

/// Plans kept per device by default, as PyTorch/XLA's default compilation cache size.
inline constexpr std::size_t kDefaultPlanCacheSize = 1024;

/// The plan cache capacity: LAZYTENSOR_PLAN_CACHE_SIZE (a whole number >= 1), else
/// kDefaultPlanCacheSize. A malformed value is an Error naming it.
std::size_t env_plan_cache_size();

/// Plans by structural hash, at most capacity() of them, least recently used evicted
/// first. Used by the device's tracing thread only (not synchronized).
class PlanCache {
 public:
  using PlanPtr = std::shared_ptr<const Plan>;

  /// An empty cache holding at most `capacity` plans (at least one).
  explicit PlanCache(std::size_t capacity = env_plan_cache_size());

  /// The plan stored under `hash` (now the most recently used), or null.
  PlanPtr find(std::uint64_t hash);

  /// Stores `plan` under `hash` (replacing a plan stored there), evicting the least
  /// recently used plans beyond capacity().
  void insert(std::uint64_t hash, PlanPtr plan);

  /// Plans stored.
  std::size_t size() const { return index_.size(); }
  /// Most plans kept.
  std::size_t capacity() const { return capacity_; }
  /// Changes the capacity (at least one), evicting what no longer fits.
  void set_capacity(std::size_t capacity);
  /// Drops every plan.
  void clear();

 private:
  void trim();

  std::size_t capacity_;
  std::list<std::pair<std::uint64_t, PlanPtr>> order_;  // most recently used first
  std::unordered_map<std::uint64_t, std::list<std::pair<std::uint64_t, PlanPtr>>::iterator> index_;
};

}  // namespace lazy::graph

#if LAZYTENSOR_HEADER_DEFINITIONS
namespace lazy::graph {

LAZYTENSOR_INLINE std::size_t env_plan_cache_size() {
  const auto v = core::env_integer("LAZYTENSOR_PLAN_CACHE_SIZE", 1, "plans", "1024");
  return v ? static_cast<std::size_t>(*v) : kDefaultPlanCacheSize;
}

LAZYTENSOR_INLINE PlanCache::PlanCache(std::size_t capacity)
    : capacity_(capacity ? capacity : 1) {}

LAZYTENSOR_INLINE auto PlanCache::find(std::uint64_t hash) -> PlanPtr {
  const auto it = index_.find(hash);
  if (it == index_.end()) return nullptr;
  order_.splice(order_.begin(), order_, it->second);  // no allocation on a hit
  return it->second->second;
}

LAZYTENSOR_INLINE void PlanCache::insert(std::uint64_t hash, PlanPtr plan) {
  if (const auto it = index_.find(hash); it != index_.end()) {
    it->second->second = std::move(plan);
    order_.splice(order_.begin(), order_, it->second);
    return;
  }
  order_.emplace_front(hash, std::move(plan));
  index_.emplace(hash, order_.begin());
  trim();
}

LAZYTENSOR_INLINE void PlanCache::set_capacity(std::size_t capacity) {
  capacity_ = capacity ? capacity : 1;
  trim();
}

LAZYTENSOR_INLINE void PlanCache::clear() {
  index_.clear();
  order_.clear();
}

LAZYTENSOR_INLINE void PlanCache::trim() {
  static auto& evictions = core::counter("PlanCacheEvictions");
  while (index_.size() > capacity_) {
    index_.erase(order_.back().first);
    order_.pop_back();
    evictions.add();
  }
}

}  // namespace lazy::graph
#endif  // LAZYTENSOR_HEADER_DEFINITIONS
