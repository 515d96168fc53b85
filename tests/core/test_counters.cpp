// core/counters.hpp: counters and lock-free timing metrics, against totals computed
// serially, also with several threads recording at once. Also run under ThreadSanitizer.
#include <algorithm>
#include <cstdint>
#include <memory>
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

// Past the last slot, counters and metrics record into their shared state under a mutex:
// still exact from several threads. (This leaves no slot for counters made later in this
// test process; they take the same path.)
TEST(Counter, CountersBeyondTheSlotsStillCountExactly) {
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
