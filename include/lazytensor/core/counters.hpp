#pragma once
// Process-wide counters and timing metrics, named like PyTorch/XLA's. The lower layers
// record into them; lazy::debug reports them. A hot path looks a counter up once
// (function-local static) and then pays one relaxed atomic add.

#include <atomic>
#include <cstdint>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include <lazytensor/core/clock.hpp>
#include <lazytensor/core/config.hpp>

namespace lazy::core {

/// A monotonically increasing event count.
struct Counter {
  std::atomic<std::int64_t> value{0};
  void add(std::int64_t n = 1) { value.fetch_add(n, std::memory_order_relaxed); }
};

/// Summary of timed samples, in nanoseconds.
struct MetricData {
  std::int64_t count = 0;
  double total_ns = 0, min_ns = 0, max_ns = 0;
};

/// A series of timed samples. Recording is lock-free (every read of a small statement
/// records two samples, and a mutex round trip would cost as much as the clock reads);
/// a summary taken while another thread records may see that sample in part.
class Metric {
 public:
  void record(double ns);
  MetricData data() const;
  void reset();

 private:
  static constexpr double kNone = std::numeric_limits<double>::infinity();
  std::atomic<std::int64_t> count_{0};
  std::atomic<double> total_{0}, min_{kNone}, max_{-kNone};
};

/// The registry of every counter and metric.
class Registry {
 public:
  static Registry& get();
  Counter& counter(const std::string& name);
  Metric& metric(const std::string& name);
  template <class F>
  void for_each(F&& f) const {
    std::lock_guard lock(mu_);
    for (auto& [n, c] : counters_) f(n, c.get(), static_cast<const Metric*>(nullptr));
    for (auto& [n, m] : metrics_) f(n, static_cast<const Counter*>(nullptr), m.get());
  }
  void reset();

 private:
  mutable std::mutex mu_;
  std::map<std::string, std::unique_ptr<Counter>> counters_;
  std::map<std::string, std::unique_ptr<Metric>> metrics_;
};

inline Counter& counter(const std::string& name) { return Registry::get().counter(name); }
inline Metric& metric(const std::string& name) { return Registry::get().metric(name); }

/// Records the lifetime of a scope into a metric.
class ScopedTimer {
 public:
  explicit ScopedTimer(Metric& m) : m_(m), t0_(MetricClock::now()) {}
  /// Timing from `t0`, a reading the caller already has.
  ScopedTimer(Metric& m, MetricClock::Ticks t0) : m_(m), t0_(t0) {}
  ~ScopedTimer();

 private:
  Metric& m_;
  MetricClock::Ticks t0_;
};

}  // namespace lazy::core

#if LAZYTENSOR_HEADER_DEFINITIONS
namespace lazy::core {

LAZYTENSOR_INLINE void Metric::record(double ns) {
  double lo = min_.load(std::memory_order_relaxed);
  while (ns < lo && !min_.compare_exchange_weak(lo, ns, std::memory_order_relaxed)) {
  }
  double hi = max_.load(std::memory_order_relaxed);
  while (ns > hi && !max_.compare_exchange_weak(hi, ns, std::memory_order_relaxed)) {
  }
  total_.fetch_add(ns, std::memory_order_relaxed);
  count_.fetch_add(1, std::memory_order_release);
}

LAZYTENSOR_INLINE MetricData Metric::data() const {
  MetricData d;
  d.count = count_.load(std::memory_order_acquire);
  if (d.count == 0) return d;
  d.total_ns = total_.load(std::memory_order_relaxed);
  d.min_ns = min_.load(std::memory_order_relaxed);
  d.max_ns = max_.load(std::memory_order_relaxed);
  return d;
}

LAZYTENSOR_INLINE void Metric::reset() {
  count_.store(0, std::memory_order_relaxed);
  total_.store(0, std::memory_order_relaxed);
  min_.store(kNone, std::memory_order_relaxed);
  max_.store(-kNone, std::memory_order_relaxed);
}

LAZYTENSOR_INLINE Registry& Registry::get() {
  // Never destroyed: devices' executor threads may still record into it while static
  // objects are destroyed at exit (their destruction order is not ours to choose).
  static Registry* r = new Registry;
  return *r;
}

LAZYTENSOR_INLINE Counter& Registry::counter(const std::string& name) {
  std::lock_guard lock(mu_);
  auto& p = counters_[name];
  if (!p) p = std::make_unique<Counter>();
  return *p;
}

LAZYTENSOR_INLINE Metric& Registry::metric(const std::string& name) {
  std::lock_guard lock(mu_);
  auto& p = metrics_[name];
  if (!p) p = std::make_unique<Metric>();
  return *p;
}

LAZYTENSOR_INLINE void Registry::reset() {
  std::lock_guard lock(mu_);
  for (auto& [n, c] : counters_) c->value.store(0);
  for (auto& [n, m] : metrics_) m->reset();
}

LAZYTENSOR_INLINE ScopedTimer::~ScopedTimer() { m_.record(MetricClock::to_ns(t0_, MetricClock::now())); }

}  // namespace lazy::core
#endif  // LAZYTENSOR_HEADER_DEFINITIONS
