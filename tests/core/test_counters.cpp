// core/counters.hpp: counters and lock-free timing metrics, against totals computed
// serially, also with several threads recording at once. Also run under ThreadSanitizer.
#include <algorithm>
#include <cstdint>
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
  EXPECT_EQ(c.value.load(), 10000 * (1 + 2 + 3 + 4));
}

}  // namespace
