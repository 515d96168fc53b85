// graph/plan_cache.hpp: the bounded, least-recently-used cache of execution plans, alone
// and behind mark_step (a graph that changes every step must not keep every plan).
#include <lazytensor/debug/metrics.hpp>
#include <lazytensor/tensor.hpp>
#include <lazytensor/graph/plan.hpp>
#include <lazytensor/graph/plan_cache.hpp>
#include <lazytensor/ops/factories.hpp>
#include <lazytensor/tensor.hpp>

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

namespace {

using lazy::graph::Plan;
using lazy::graph::PlanCache;

std::shared_ptr<const Plan> plan_with(std::uint64_t hash) {
  auto p = std::make_shared<Plan>();
  p->hash = hash;
  return p;
}

TEST(PlanCache, FindsWhatWasInserted) {
  PlanCache cache(4);
  EXPECT_EQ(cache.find(7), nullptr);
  cache.insert(7, plan_with(7));
  cache.insert(9, plan_with(9));
  ASSERT_NE(cache.find(7), nullptr);
  EXPECT_EQ(cache.find(7)->hash, 7u);
  EXPECT_EQ(cache.find(9)->hash, 9u);
  EXPECT_EQ(cache.find(8), nullptr);
  EXPECT_EQ(cache.size(), 2u);
}

TEST(PlanCache, InsertingAnExistingHashReplacesItsPlan) {
  PlanCache cache(2);
  cache.insert(1, plan_with(100));
  cache.insert(1, plan_with(200));
  EXPECT_EQ(cache.size(), 1u);
  EXPECT_EQ(cache.find(1)->hash, 200u);
}

// Against a reference model: a list of hashes in use order, trimmed from the old end.
TEST(PlanCache, EvictsTheLeastRecentlyUsedLikeAReferenceModel) {
  constexpr std::size_t kCapacity = 5;
  PlanCache cache(kCapacity);
  std::vector<std::uint64_t> model;  // most recently used last
  auto use = [&](std::uint64_t h) {
    std::erase(model, h);
    model.push_back(h);
    if (model.size() > kCapacity) model.erase(model.begin());
  };
  std::uint64_t state = 12345;
  for (int step = 0; step < 2000; ++step) {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    const std::uint64_t h = (state >> 33) % 12;
    const bool in_model = std::find(model.begin(), model.end(), h) != model.end();
    auto found = cache.find(h);
    ASSERT_EQ(found != nullptr, in_model) << "step " << step << " hash " << h;
    if (found) {
      EXPECT_EQ(found->hash, h);
    } else {
      cache.insert(h, plan_with(h));
    }
    use(h);
    ASSERT_EQ(cache.size(), model.size());
  }
}

TEST(PlanCache, ShrinkingTheCapacityEvictsTheOldest) {
  PlanCache cache(8);
  for (std::uint64_t h = 0; h < 8; ++h) cache.insert(h, plan_with(h));
  cache.find(0);  // 0 becomes the most recently used
  const auto evicted0 = lazy::debug::counter_value("PlanCacheEvictions");
  cache.set_capacity(3);
  EXPECT_EQ(cache.size(), 3u);
  EXPECT_EQ(lazy::debug::counter_value("PlanCacheEvictions"), evicted0 + 5);
  EXPECT_NE(cache.find(0), nullptr);
  EXPECT_NE(cache.find(7), nullptr);
  EXPECT_NE(cache.find(6), nullptr);
  EXPECT_EQ(cache.find(5), nullptr);
  cache.set_capacity(0);  // at least one plan
  EXPECT_EQ(cache.capacity(), 1u);
  EXPECT_EQ(cache.size(), 1u);
}

TEST(PlanCache, CapacityComesFromTheEnvironment) {
  ::unsetenv("LAZYTENSOR_PLAN_CACHE_SIZE");
  EXPECT_EQ(lazy::graph::env_plan_cache_size(), lazy::graph::kDefaultPlanCacheSize);
  ::setenv("LAZYTENSOR_PLAN_CACHE_SIZE", "17", 1);
  EXPECT_EQ(lazy::graph::env_plan_cache_size(), 17u);
  for (const char* bad : {"0", "-3", "ten", "12x"}) {
    ::setenv("LAZYTENSOR_PLAN_CACHE_SIZE", bad, 1);
    try {
      lazy::graph::env_plan_cache_size();
      ADD_FAILURE() << "accepted '" << bad << "'";
    } catch (const lazy::Error& e) {
      EXPECT_NE(std::string(e.what()).find("LAZYTENSOR_PLAN_CACHE_SIZE"), std::string::npos)
          << e.what();
      EXPECT_NE(std::string(e.what()).find(bad), std::string::npos) << e.what();
    }
  }
  ::unsetenv("LAZYTENSOR_PLAN_CACHE_SIZE");
}

// Behind mark_step: a new shape every step builds a new plan; the cache keeps only the
// newest ones, a repeated graph still hits, and the results stay right.
TEST(PlanCache, AGraphThatChangesEveryStepKeepsTheCacheBounded) {
  auto& cache = lazy::graph::current_device().plan_cache();
  const std::size_t old_capacity = cache.capacity();
  cache.set_capacity(16);
  const auto uncached0 = lazy::debug::counter_value("UncachedPlan");
  const auto evicted0 = lazy::debug::counter_value("PlanCacheEvictions");
  for (std::int64_t n = 1; n <= 64; ++n) {
    lazy::Tensor<float> x = lazy::full<float>({n}, 2.0f) * 3.0f + 1.0f;
    lazy::mark_step();
    EXPECT_EQ(x.to_vector(), std::vector<float>(static_cast<std::size_t>(n), 7.0f)) << "n=" << n;
  }
  EXPECT_GE(lazy::debug::counter_value("UncachedPlan") - uncached0, 64);
  EXPECT_LE(cache.size(), 16u);
  EXPECT_GE(lazy::debug::counter_value("PlanCacheEvictions") - evicted0, 64 - 16);
  // The newest graph is still cached: running it again builds nothing.
  const auto uncached1 = lazy::debug::counter_value("UncachedPlan");
  lazy::Tensor<float> again = lazy::full<float>({64}, 2.0f) * 3.0f + 1.0f;
  lazy::mark_step();
  EXPECT_EQ(again.to_vector(), std::vector<float>(64, 7.0f));
  EXPECT_EQ(lazy::debug::counter_value("UncachedPlan"), uncached1);
  cache.set_capacity(old_capacity);
}

}  // namespace
