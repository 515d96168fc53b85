// core/spin_lock.hpp: mutual exclusion under contention (a non-atomic counter and a
// two-field invariant that only hold if no two holders overlap), try_lock, and its use with
// std::lock_guard. Also run under ThreadSanitizer, which sees a data race if the lock's
// acquire/release ordering is wrong.
#include <lazytensor/core/spin_lock.hpp>

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

namespace {

TEST(SpinLock, TryLockFailsWhileHeldAndSucceedsAfter) {
  lazy::core::SpinLock m;
  EXPECT_TRUE(m.try_lock());
  EXPECT_FALSE(m.try_lock());
  bool other = true;
  std::thread([&] { other = m.try_lock(); }).join();
  EXPECT_FALSE(other);
  m.unlock();
  std::thread([&] { other = m.try_lock(); }).join();
  EXPECT_TRUE(other);
  m.unlock();
}

TEST(SpinLock, ExcludesConcurrentHolders) {
  lazy::core::SpinLock m;
  std::int64_t counter = 0;                 // plain: only correct under mutual exclusion
  std::int64_t a = 0, b = 0;                // invariant a == b between critical sections
  std::atomic<int> inside{0}, overlaps{0};  // a holder that sees another inside
  constexpr int kThreads = 4, kIters = 20000;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < kIters; ++i) {
        std::lock_guard lock(m);
        if (inside.fetch_add(1, std::memory_order_relaxed) != 0) overlaps.fetch_add(1);
        if (a != b) overlaps.fetch_add(1);
        ++a;
        ++counter;
        ++b;
        inside.fetch_sub(1, std::memory_order_relaxed);
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(overlaps.load(), 0);
  EXPECT_EQ(counter, std::int64_t{kThreads} * kIters);
  EXPECT_EQ(a, b);
}

TEST(SpinLock, WaiterGetsTheLockWhenTheHolderSleeps) {
  // The holder keeps it for a while (a preempted holder): the waiter must yield, not hang,
  // and get it once it is released.
  lazy::core::SpinLock m;
  m.lock();
  std::atomic<bool> got{false};
  std::thread waiter([&] {
    std::lock_guard lock(m);
    got = true;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_FALSE(got.load());
  m.unlock();
  waiter.join();
  EXPECT_TRUE(got.load());
}

}  // namespace
