#pragma once
// Process-wide counters and timing metrics, named like PyTorch/XLA's. The lower layers
// record into them; lazy::debug reports them. A hot path looks a counter up once
// (function-local static) and then pays one relaxed atomic add.

#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>

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

/// A series of timed samples.
class Metric {
 public:
  void record(double ns) {
    std::lock_guard lock(mu_);
    if (data_.count == 0 || ns < data_.min_ns) data_.min_ns = ns;
    if (data_.count == 0 || ns > data_.max_ns) data_.max_ns = ns;
    data_.count++;
    data_.total_ns += ns;
  }
  MetricData data() const {
    std::lock_guard lock(mu_);
    return data_;
  }
  void reset() {
    std::lock_guard lock(mu_);
    data_ = {};
  }

 private:
  mutable std::mutex mu_;
  MetricData data_;
};

/// The registry of every counter and metric.
class Registry {
 public:
  static Registry& get() {
    // Never destroyed: devices' executor threads may still record into it while static
    // objects are destroyed at exit (their destruction order is not ours to choose).
    static Registry* r = new Registry;
    return *r;
  }
  Counter& counter(const std::string& name) {
    std::lock_guard lock(mu_);
    auto& p = counters_[name];
    if (!p) p = std::make_unique<Counter>();
    return *p;
  }
  Metric& metric(const std::string& name) {
    std::lock_guard lock(mu_);
    auto& p = metrics_[name];
    if (!p) p = std::make_unique<Metric>();
    return *p;
  }
  template <class F>
  void for_each(F&& f) const {
    std::lock_guard lock(mu_);
    for (auto& [n, c] : counters_) f(n, c.get(), static_cast<const Metric*>(nullptr));
    for (auto& [n, m] : metrics_) f(n, static_cast<const Counter*>(nullptr), m.get());
  }
  void reset() {
    std::lock_guard lock(mu_);
    for (auto& [n, c] : counters_) c->value.store(0);
    for (auto& [n, m] : metrics_) m->reset();
  }

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
  explicit ScopedTimer(Metric& m) : m_(m), t0_(std::chrono::steady_clock::now()) {}
  ~ScopedTimer() {
    m_.record(std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0_).count());
  }

 private:
  Metric& m_;
  std::chrono::steady_clock::time_point t0_;
};

}  // namespace lazy::core
