// core/counters.hpp and core/thread_cells.hpp: counters and timing metrics (per-thread
// cells), against totals computed serially, also with several threads recording at once,
// read while they record, and after they exit. Also run under ThreadSanitizer.
#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include <lazytensor/core/counters.hpp>

namespace {

using lazy::core::Metric;

TEST(Metric, SummarizesCountTotalMinAndMax) {
  Metric m;
  EXPECT_EQ(m.data().count, 0);
  EXPECT_EQ(m.data().min_ns, 0.0) << "an empty metric reports zeros, not the sentinels";
  EXPECT_EQ(m.data().max_ns, 0.0);
  const std::vector<double> samples = {250, 40, 900, 40, 615.5};
  double total = 0;
  for (double s : samples) {
    m.record(s);
    total += s;
  }
  const auto d = m.data();
  EXPECT_EQ(d.count, 5);
  EXPECT_DOUBLE_EQ(d.total_ns, total);
  EXPECT_EQ(d.min_ns, *std::min_element(samples.begin(), samples.end()));
  EXPECT_EQ(d.max_ns, *std::max_element(samples.begin(), samples.end()));
  m.reset();
  EXPECT_EQ(m.data().count, 0);
  m.record(7);  // after a reset, the first sample is both extremes again
  EXPECT_EQ(m.data().min_ns, 7.0);
  EXPECT_EQ(m.data().max_ns, 7.0);
  EXPECT_EQ(m.data().total_ns, 7.0);
}

// Threads record disjoint integer samples (exact in double): nothing may be lost.
TEST(Metric, ThreadsRecordingAtOnceLoseNoSample) {
  Metric m;
  constexpr int kThreads = 4, kEach = 20000;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&m, t] {
      for (int i = 0; i < kEach; ++i) m.record(static_cast<double>(1 + t * kEach + i));
    });
  }
  for (auto& th : threads) th.join();
  const std::int64_t n = std::int64_t{kThreads} * kEach;
  const auto d = m.data();
  EXPECT_EQ(d.count, n);
  EXPECT_EQ(d.total_ns, static_cast<double>(n * (n + 1) / 2));
  EXPECT_EQ(d.min_ns, 1.0);
  EXPECT_EQ(d.max_ns, static_cast<double>(n));
}

TEST(Counter, ThreadsAddingAtOnceLoseNoIncrement) {
  lazy::core::Counter c;
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&c, t] {
      for (int i = 0; i < 10000; ++i) c.add(t + 1);
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(c.value(), 10000 * (1 + 2 + 3 + 4));
}

// A thread's cells are folded into their owner when it exits: adds and samples of threads
// that have ended still count, and a reset forgets them as it forgets the live ones.
TEST(Counter, AddsOfExitedThreadsCountAndResetForgetsThem) {
  lazy::core::Counter c;
  c.add(5);
  std::thread([&c] { c.add(7); }).join();
  EXPECT_EQ(c.value(), 12);
  c.reset();
  EXPECT_EQ(c.value(), 0);
  std::thread([&c] { c.add(3); }).join();
  c.add(1);
  EXPECT_EQ(c.value(), 4);
}

TEST(Metric, SamplesOfExitedThreadsCountAndResetForgetsThem) {
  Metric m;
  m.record(50);
  std::thread([&m] {
    m.record(10);
    m.record(90);
  }).join();
  auto d = m.data();
  EXPECT_EQ(d.count, 3);
  EXPECT_EQ(d.total_ns, 150.0);
  EXPECT_EQ(d.min_ns, 10.0);
  EXPECT_EQ(d.max_ns, 90.0);
  m.reset();
  EXPECT_EQ(m.data().count, 0);
  // A thread that recorded before the reset and records again afterwards starts afresh.
  std::thread([&m] { m.record(30); }).join();
  m.record(20);
  d = m.data();
  EXPECT_EQ(d.count, 2);
  EXPECT_EQ(d.total_ns, 50.0);
  EXPECT_EQ(d.min_ns, 20.0);
  EXPECT_EQ(d.max_ns, 30.0);
}

// A counter made after another was destroyed starts at zero in every thread (slots are
// not handed out twice), including a thread that wrote the old one's cell.
TEST(Counter, ANewCounterStartsAtZeroInThreadsThatUsedAnOldOne) {
  auto old_one = std::make_unique<lazy::core::Counter>();
  old_one->add(100);
  old_one.reset();
  lazy::core::Counter fresh;
  EXPECT_EQ(fresh.value(), 0);
  fresh.add(2);
  EXPECT_EQ(fresh.value(), 2);
}

// A thread that recorded before a reset and exits after it folds nothing of that epoch.
TEST(Metric, AThreadExitingAfterAResetFoldsNoStaleSamples) {
  Metric m;
  std::mutex mu;
  std::condition_variable cv;
  bool recorded = false, reset_done = false;
  std::thread t([&] {
    m.record(40);
    std::unique_lock lock(mu);
    recorded = true;
    cv.notify_all();
    cv.wait(lock, [&] { return reset_done; });
  });
  {
    std::unique_lock lock(mu);
    cv.wait(lock, [&] { return recorded; });
  }
  EXPECT_EQ(m.data().count, 1) << "a live thread's cells are read";
  m.reset();
  m.record(5);
  {
    std::lock_guard lock(mu);
    reset_done = true;
  }
  cv.notify_all();
  t.join();
  const auto d = m.data();
  EXPECT_EQ(d.count, 1);
  EXPECT_EQ(d.max_ns, 5.0) << "the exited thread's sample from before the reset is gone";
}

// Reads while threads keep adding: never above the final total, never going down, exact
// once they stop (their cells read live, then folded as they exit).
TEST(Counter, ReadsWhileThreadsAddAreMonotoneAndEndExact) {
  lazy::core::Counter c;
  std::atomic<bool> go{false};
  std::vector<std::thread> threads;
  for (int t = 0; t < 3; ++t) {
    threads.emplace_back([&c, &go] {
      while (!go.load()) std::this_thread::yield();
      for (int i = 0; i < 20000; ++i) c.add(1);
    });
  }
  go = true;
  std::int64_t last = 0;
  for (int k = 0; k < 200; ++k) {
    const std::int64_t v = c.value();
    EXPECT_GE(v, last);
    EXPECT_LE(v, 60000);
    last = v;
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(c.value(), 60000);
}

// Counters (one cell) and metrics (five) made in turn: the metrics' runs of cells reach
// past a chunk's end unless kept inside one. Each records its own index, read back exactly
// (an overrun would also be an out-of-bounds write, which ASan reports).
TEST(Metric, CellRunsNeverStraddleAChunk) {
  std::vector<std::unique_ptr<lazy::core::Counter>> counters;
  std::vector<std::unique_ptr<Metric>> metrics;
  const std::size_t n = 2 * lazy::core::detail::ThreadCells::kChunkCells / 6 + 8;
  for (std::size_t i = 0; i < n; ++i) {
    counters.push_back(std::make_unique<lazy::core::Counter>());
    metrics.push_back(std::make_unique<Metric>());
  }
  for (std::size_t i = 0; i < n; ++i) {
    counters[i]->add(static_cast<std::int64_t>(i));
    metrics[i]->record(static_cast<double>(i));
    metrics[i]->record(static_cast<double>(2 * i + 1));
  }
  for (std::size_t i = 0; i < n; ++i) {
    EXPECT_EQ(counters[i]->value(), static_cast<std::int64_t>(i)) << i;
    const auto d = metrics[i]->data();
    EXPECT_EQ(d.count, 2) << i;
    EXPECT_EQ(d.total_ns, static_cast<double>(3 * i + 1)) << i;
    EXPECT_EQ(d.min_ns, static_cast<double>(i)) << i;
    EXPECT_EQ(d.max_ns, static_cast<double>(2 * i + 1)) << i;
  }
}

// Past the last slot, counters and metrics record into their shared state under a mutex:
// still exact from several threads. This leaves no slot for counters made later in this
// process (they take the same path), so its suite is defined last: it runs after the
// others of this file.
TEST(CounterSlots, CountersBeyondTheSlotsStillCountExactly) {
  std::vector<std::unique_ptr<lazy::core::Counter>> many;
  for (std::size_t i = 0; i <= lazy::core::detail::ThreadCells::kMaxCells; ++i)
    many.push_back(std::make_unique<lazy::core::Counter>());
  lazy::core::Counter& last = *many.back();
  Metric m;
  std::vector<std::thread> threads;
  for (int t = 0; t < 3; ++t) {
    threads.emplace_back([&last, &m, t] {
      for (int i = 0; i < 1000; ++i) {
        last.add(t + 1);
        m.record(static_cast<double>(t + 1));
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(last.value(), 1000 * (1 + 2 + 3));
  const auto d = m.data();
  EXPECT_EQ(d.count, 3000);
  EXPECT_EQ(d.total_ns, 6000.0);
  EXPECT_EQ(d.min_ns, 1.0);
  EXPECT_EQ(d.max_ns, 3.0);
  last.reset();
  last.add(4);
  EXPECT_EQ(last.value(), 4);
}

}  // namespace
