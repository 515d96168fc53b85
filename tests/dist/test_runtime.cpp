// dist/spawn.hpp and dist/runtime.hpp: replica threads bound to their own devices, worker
// pools sized for the replicas and restored afterwards, steps in line when the replicas
// fill the cores, return values, runtime queries
// inside and outside spawn. Also run under TSan.
#include "dist_testing.hpp"
#include "testing/env_guard.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

namespace {

using dist_testing::Watchdog;
namespace dist = lazy::dist;
namespace rt = lazy::runtime;

TEST(Runtime, OutsideSpawnTheWorldIsOneReplica) {
  EXPECT_EQ(rt::world_size(), 1);
  EXPECT_EQ(rt::global_ordinal(), 0);
  EXPECT_EQ(rt::local_ordinal(), 0);
  EXPECT_EQ(rt::local_process_count(), 1);
  EXPECT_EQ(rt::local_device_count(), lazy::device_count());
  EXPECT_EQ(rt::global_device_count(), lazy::device_count());
  EXPECT_EQ(rt::addressable_device_count(), lazy::device_count());
  EXPECT_EQ(rt::device_type(), "CPU");
  EXPECT_TRUE(dist::is_master_ordinal());
  EXPECT_TRUE(dist::is_master_ordinal(false));
}

TEST(Runtime, InsideSpawnEachReplicaSeesItsPlace) {
  Watchdog dog;
  struct Seen {
    int world, global, local, procs, local_dev, global_dev, addressable, device;
    bool master, global_master;
    std::string type;
  };
  for (int world : {1, 3}) {
    std::vector<Seen> seen(static_cast<std::size_t>(world));
    dist::spawn(
        [&](int r) {
          seen[static_cast<std::size_t>(r)] = {rt::world_size(),
                                               rt::global_ordinal(),
                                               rt::local_ordinal(),
                                               rt::local_process_count(),
                                               rt::local_device_count(),
                                               rt::global_device_count(),
                                               rt::addressable_device_count(),
                                               lazy::device().index(),
                                               dist::is_master_ordinal(),
                                               dist::is_master_ordinal(false),
                                               rt::device_type()};
        },
        world);
    for (int r = 0; r < world; ++r) {
      const Seen& s = seen[static_cast<std::size_t>(r)];
      EXPECT_EQ(s.world, world);
      EXPECT_EQ(s.global, r);
      EXPECT_EQ(s.local, r);
      EXPECT_EQ(s.procs, world);
      EXPECT_EQ(s.local_dev, world);
      EXPECT_EQ(s.global_dev, world);
      EXPECT_EQ(s.addressable, 1);
      EXPECT_EQ(s.device, r) << "replica " << r << " must be bound to device " << r;
      EXPECT_EQ(s.master, r == 0);
      EXPECT_EQ(s.global_master, r == 0);
      EXPECT_EQ(s.type, "CPU");
    }
  }
  EXPECT_EQ(rt::world_size(), 1);  // the calling thread is still outside
}

TEST(Spawn, ReplicasRunConcurrentlyOnTheirOwnDevicesAndGraphs) {
  Watchdog dog;
  const int world = 3;
  std::vector<int> before(world);
  for (int r = 0; r < world; ++r)
    before[static_cast<std::size_t>(r)] =
        lazy::graph::DeviceRegistry::get().device(r).threads().size();
  std::vector<int> tensor_device(world), pool_size(world);
  std::vector<float> values(world);
  dist::spawn(
      [&](int r) {
        const auto i = static_cast<std::size_t>(r);
        // A pending value on this replica's device; its mark_step must not need the others.
        auto t = lazy::full<float>(lazy::Shape{4}, r) * 2.0f + 1.0f;
        lazy::Tensor<float> y = t;
        tensor_device[i] = y.device().index();
        pool_size[i] = lazy::graph::current_device().threads().size();
        dist::barrier("all started");  // all three are alive at the same time
        lazy::mark_step();
        values[i] = y.to_vector()[3];
      },
      world);
  const int hw = lazy::graph::default_device_threads();
  for (int r = 0; r < world; ++r) {
    const auto i = static_cast<std::size_t>(r);
    EXPECT_EQ(tensor_device[i], r);
    EXPECT_EQ(pool_size[i], std::max(1, hw / world));
    EXPECT_EQ(values[i], 2.0f * r + 1.0f);
    // Devices that existed before spawn get their worker count back.
    EXPECT_EQ(lazy::graph::DeviceRegistry::get().device(r).threads().size(), before[i]);
  }
}

TEST(Spawn, DevicesCreatedForReplicasKeepTheReplicaSize) {
  Watchdog dog;
  const int world = 7;  // no other test of this program uses device 6
  auto& registry = lazy::graph::DeviceRegistry::get();
  const int before = registry.count() >= world ? registry.device(world - 1).threads().size() : -1;
  dist::spawn([](int) {}, world);
  // A device spawn created keeps the replica size (no idle workers started for nothing);
  // one that existed (when the test is repeated) gets its size back.
  EXPECT_EQ(registry.device(world - 1).threads().size(),
            before >= 0 ? before : std::max(1, lazy::graph::default_device_threads() / world));
}

/// Replica devices' step mode during a spawn of `world` replicas, and whether each
/// replica's value was computed by the time its mark_step returned.
struct StepModes {
  std::vector<std::uint8_t> inline_steps, done_at_return;
};
StepModes step_modes(int world) {
  StepModes m{std::vector<std::uint8_t>(static_cast<std::size_t>(world)),
              std::vector<std::uint8_t>(static_cast<std::size_t>(world))};
  dist::spawn(
      [&](int r) {
        const auto i = static_cast<std::size_t>(r);
        m.inline_steps[i] = lazy::graph::current_device().inline_steps();
        // Large enough for the executor (not a tiny step that always runs in line).
        lazy::Tensor<float> y = lazy::sqrt(lazy::full<float>(lazy::Shape{1 << 16}, 4.0f + r));
        lazy::mark_step();
        m.done_at_return[i] = y.node()->materialized();
        EXPECT_EQ(y.to_vector()[100], std::sqrt(4.0f + r));
      },
      world);
  return m;
}

TEST(Spawn, ReplicasFillingEveryCoreRunTheirStepsOnTheirOwnThreads) {
  Watchdog dog;
  if (std::getenv("LAZYTENSOR_ASYNC")) GTEST_SKIP() << "LAZYTENSOR_ASYNC chooses the step mode";
  const int hw = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  if (hw > 64) GTEST_SKIP() << hw << " hardware threads: too many replica threads for a unit test";
  auto& dev0 = lazy::graph::DeviceRegistry::get().device(0);
  const StepModes full = step_modes(hw);
  for (int r = 0; r < hw; ++r) {
    const auto i = static_cast<std::size_t>(r);
    EXPECT_TRUE(full.inline_steps[i]) << "replica " << r;
    // In line: the step has run when mark_step returns (on the executor it may not have).
    EXPECT_TRUE(full.done_at_return[i]) << "replica " << r;
  }
  EXPECT_FALSE(dev0.inline_steps()) << "spawn must give device 0 its step mode back";
  if (hw >= 2) {
    // Fewer replicas than cores: the executor has a core of its own to overlap with.
    const StepModes half = step_modes(hw / 2);
    for (std::size_t i = 0; i < half.inline_steps.size(); ++i)
      EXPECT_FALSE(half.inline_steps[i]) << "replica " << i;
  }
}

TEST(Spawn, LazytensorAsyncKeepsReplicasOnTheirExecutors) {
  Watchdog dog;
  const StepModes m = [] {
    const lazy_tests::EnvGuard async("LAZYTENSOR_ASYNC", "1");
    const int hw = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    return step_modes(std::min(hw, 64));
  }();
  for (std::size_t i = 0; i < m.inline_steps.size(); ++i)
    EXPECT_FALSE(m.inline_steps[i]) << "replica " << i;
}

TEST(Spawn, ReturnsReplicaZerosResultOrNothing) {
  Watchdog dog;
  EXPECT_EQ(dist::spawn([](int r) { return std::to_string(r) + "!"; }, 4), "0!");
  int calls = 0;
  std::mutex mu;
  dist::spawn(
      [&](int) {
        std::lock_guard lock(mu);
        ++calls;
      },
      4);
  EXPECT_EQ(calls, 4);
  // A tensor from replica 0 is usable after spawn returned.
  auto t = dist::spawn(
      [](int r) {
        return dist::all_reduce(lazy::ReduceOp::Sum, lazy::from_vector<float>({1.0f + r}));
      },
      2);
  EXPECT_EQ(t.item(), 3.0f);
}

TEST(Spawn, SpawnsCanFollowEachOther) {
  Watchdog dog;
  for (int i = 0; i < 5; ++i) {
    const int world = 1 + i % 4;
    EXPECT_EQ(
        dist::spawn(
            [](int r) {
              return dist::all_reduce(lazy::ReduceOp::Sum, lazy::from_vector<int>({r})).item();
            },
            world),
        world * (world - 1) / 2);
  }
}

}  // namespace
