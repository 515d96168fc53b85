// core/thread_pool.hpp: fork-join parallel_for. Also run under ThreadSanitizer.
#include <lazytensor/core/thread_pool.hpp>

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace {

using lazy::ThreadPool;

// Runs parallel_for(tasks) and checks every task index ran exactly once.
void expect_each_task_once(ThreadPool& pool, std::int64_t tasks) {
  std::vector<std::atomic<int>> hits(static_cast<std::size_t>(std::max<std::int64_t>(tasks, 0)));
  std::atomic<std::int64_t> out_of_range{0};
  pool.parallel_for(tasks, [&](std::int64_t t) {
    if (t < 0 || t >= tasks) {
      out_of_range.fetch_add(1);
      return;
    }
    hits[static_cast<std::size_t>(t)].fetch_add(1, std::memory_order_relaxed);
  });
  EXPECT_EQ(out_of_range.load(), 0) << "tasks " << tasks;
  std::int64_t wrong = 0;
  for (std::int64_t t = 0; t < tasks; ++t) {
    if (hits[static_cast<std::size_t>(t)].load() != 1) ++wrong;
  }
  EXPECT_EQ(wrong, 0) << "tasks " << tasks << ": " << wrong << " tasks did not run exactly once";
}

// Each of size() tasks waits until all have started: this completes only when the caller
// and every worker run one task at the same time. Returns false on timeout.
bool rendezvous(ThreadPool& pool) {
  const int n = pool.size();
  std::atomic<int> started{0};
  std::atomic<bool> timed_out{false};
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  pool.parallel_for(n, [&](std::int64_t) {
    started.fetch_add(1);
    while (started.load() < n) {
      if (std::chrono::steady_clock::now() > deadline) {
        timed_out.store(true);
        return;
      }
      std::this_thread::yield();
    }
  });
  return !timed_out.load();
}

TEST(ThreadPool, EachTaskRunsExactlyOnce) {
  for (int threads : {1, 2, 3, 4, 8}) {
    ThreadPool pool(threads);
    EXPECT_EQ(pool.size(), threads);
    for (std::int64_t tasks : {0, 1, 2, 3, 4, 5, 7, 8, 9, 16, 31, 64, 100, 1000, 10007}) {
      expect_each_task_once(pool, tasks);
    }
  }
}

TEST(ThreadPool, NegativeTaskCountRunsNothing) {
  ThreadPool pool(3);
  std::atomic<int> calls{0};
  pool.parallel_for(-5, [&](std::int64_t) { calls.fetch_add(1); });
  EXPECT_EQ(calls.load(), 0);
}

TEST(ThreadPool, WritesOfTasksAreVisibleAfterReturn) {
  // Plain (non-atomic) writes into disjoint slots must be visible to the caller once
  // parallel_for returns (TSan checks the happens-before edge).
  ThreadPool pool(4);
  for (int round = 0; round < 50; ++round) {
    std::vector<std::int64_t> out(1000, -1);
    pool.parallel_for(static_cast<std::int64_t>(out.size()), [&](std::int64_t t) { out[t] = t * t + round; });
    for (std::int64_t t = 0; t < 1000; ++t) ASSERT_EQ(out[t], t * t + round);
  }
}

TEST(ThreadPool, WorkersRunConcurrentlyWithTheCaller) {
  // Each of `n` tasks waits until all `n` have started: this completes only when the
  // caller and n - 1 workers each run one task at the same time.
  constexpr int n = 4;
  ThreadPool pool(n);
  std::atomic<int> started{0};
  std::atomic<bool> timed_out{false};
  std::mutex ids_mu;
  std::set<std::thread::id> ids;
  // One deadline for the whole loop, so a pool that never wakes its workers fails fast.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  pool.parallel_for(n, [&](std::int64_t) {
    {
      std::lock_guard lock(ids_mu);
      ids.insert(std::this_thread::get_id());
    }
    started.fetch_add(1);
    while (started.load() < n) {
      if (std::chrono::steady_clock::now() > deadline) {
        timed_out.store(true);
        return;
      }
      std::this_thread::yield();
    }
  });
  EXPECT_FALSE(timed_out.load());
  EXPECT_EQ(ids.size(), static_cast<std::size_t>(n));
  EXPECT_TRUE(ids.count(std::this_thread::get_id())) << "the calling thread takes part";
}

TEST(ThreadPool, SingleThreadRunsInlineInOrder) {
  ThreadPool pool(1);
  std::vector<std::int64_t> order;
  const auto me = std::this_thread::get_id();
  bool other_thread = false;
  pool.parallel_for(10, [&](std::int64_t t) {
    order.push_back(t);
    if (std::this_thread::get_id() != me) other_thread = true;
  });
  EXPECT_FALSE(other_thread);
  EXPECT_EQ(order, (std::vector<std::int64_t>{0, 1, 2, 3, 4, 5, 6, 7, 8, 9}));
}

struct TaskError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

TEST(ThreadPool, ExceptionPropagatesAfterAllTasksFinished) {
  for (int threads : {1, 2, 4}) {
    ThreadPool pool(threads);
    for (std::int64_t throwing : {0, 5, 63}) {
      std::atomic<int> ran{0};
      try {
        pool.parallel_for(64, [&](std::int64_t t) {
          ran.fetch_add(1);
          if (t == throwing) throw TaskError("task " + std::to_string(t) + " failed");
        });
        ADD_FAILURE() << "no exception (threads " << threads << ")";
      } catch (const TaskError& e) {
        EXPECT_EQ(std::string(e.what()), "task " + std::to_string(throwing) + " failed");
      }
      if (threads > 1) {
        // Documented: re-thrown after the others finished, so no task is still running and
        // none was abandoned.
        EXPECT_EQ(ran.load(), 64) << "threads " << threads;
      }
    }
    // The pool stays usable afterwards, and the old error does not resurface.
    expect_each_task_once(pool, 100);
  }
}

TEST(ThreadPool, ManyThrowingTasksReportOne) {
  ThreadPool pool(4);
  std::atomic<int> ran{0};
  EXPECT_THROW(pool.parallel_for(200,
                                 [&](std::int64_t) {
                                   ran.fetch_add(1);
                                   throw TaskError("x");
                                 }),
               TaskError);
  EXPECT_EQ(ran.load(), 200);
  expect_each_task_once(pool, 50);
}

TEST(ThreadPool, NestedCallsRunInline) {
  ThreadPool pool(4);
  std::atomic<int> mismatched{0};
  std::atomic<int> inner_calls{0};
  std::vector<std::atomic<int>> hits(16 * 8);
  pool.parallel_for(16, [&](std::int64_t outer) {
    const auto tid = std::this_thread::get_id();
    pool.parallel_for(8, [&](std::int64_t inner) {
      if (std::this_thread::get_id() != tid) mismatched.fetch_add(1);
      inner_calls.fetch_add(1);
      hits[static_cast<std::size_t>(outer * 8 + inner)].fetch_add(1);
    });
  });
  EXPECT_EQ(mismatched.load(), 0) << "nested loops must run on the thread that issued them";
  EXPECT_EQ(inner_calls.load(), 16 * 8);
  for (auto& h : hits) EXPECT_EQ(h.load(), 1);
  // After the nested use, the caller is not stuck in "worker" mode: a new top-level loop
  // still uses the workers.
  EXPECT_TRUE(rendezvous(pool));
}

TEST(ThreadPool, NestedExceptionPropagatesThroughOuterLoop) {
  ThreadPool pool(3);
  EXPECT_THROW(pool.parallel_for(6,
                                 [&](std::int64_t o) {
                                   pool.parallel_for(4, [&](std::int64_t i) {
                                     if (o == 2 && i == 3) throw TaskError("inner");
                                   });
                                 }),
               TaskError);
  expect_each_task_once(pool, 40);
}

TEST(ThreadPool, Resize) {
  ThreadPool pool(2);
  for (int n : {1, 4, 3, 1, 6, 2}) {
    pool.resize(n);
    EXPECT_EQ(pool.size(), n);
    EXPECT_TRUE(rendezvous(pool)) << "after resize(" << n << ")";  // the new workers wake up
    expect_each_task_once(pool, 257);
  }
  pool.resize(0);
  EXPECT_EQ(pool.size(), 1);
  pool.resize(-3);
  EXPECT_EQ(pool.size(), 1);
  expect_each_task_once(pool, 10);
  // resize(1) means no workers: everything runs on the caller.
  const auto me = std::this_thread::get_id();
  std::atomic<int> elsewhere{0};
  pool.parallel_for(100, [&](std::int64_t) {
    if (std::this_thread::get_id() != me) elsewhere.fetch_add(1);
  });
  EXPECT_EQ(elsewhere.load(), 0);
}

TEST(ThreadPool, ConstructDestroyRepeatedly) {
  for (int i = 0; i < 30; ++i) {
    ThreadPool pool(1 + i % 4);
    if (i % 2) expect_each_task_once(pool, 9);
  }
}

TEST(ThreadPool, StressManyShortLoops) {
  ThreadPool pool(4);
  std::int64_t total = 0;
  std::vector<std::int64_t> slots(8);
  for (int loop = 0; loop < 4000; ++loop) {
    const std::int64_t tasks = 2 + loop % 7;
    pool.parallel_for(tasks, [&](std::int64_t t) { slots[t] = t + 1; });
    for (std::int64_t t = 0; t < tasks; ++t) total += slots[t];
  }
  std::int64_t want = 0;
  for (int loop = 0; loop < 4000; ++loop) {
    const std::int64_t tasks = 2 + loop % 7;
    want += tasks * (tasks + 1) / 2;
  }
  EXPECT_EQ(total, want);
}

TEST(ThreadPool, ConcurrentSubmittersAreSerialized) {
  // Several external threads share one pool; each loop must still see its own tasks
  // exactly once.
  ThreadPool pool(3);
  std::atomic<int> bad{0};
  std::vector<std::thread> submitters;
  for (int s = 0; s < 3; ++s) {
    submitters.emplace_back([&, s] {
      for (int loop = 0; loop < 300; ++loop) {
        const std::int64_t tasks = 3 + (loop + s) % 11;
        std::vector<std::atomic<int>> hits(static_cast<std::size_t>(tasks));
        pool.parallel_for(tasks, [&](std::int64_t t) { hits[static_cast<std::size_t>(t)].fetch_add(1); });
        for (auto& h : hits)
          if (h.load() != 1) bad.fetch_add(1);
      }
    });
  }
  for (auto& t : submitters) t.join();
  EXPECT_EQ(bad.load(), 0);
}

}  // namespace
