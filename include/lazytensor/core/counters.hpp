#pragma once
// Process-wide counters and timing metrics, named like PyTorch/XLA's. The lower layers
// record into them; lazy::debug reports them. A hot path looks a counter up once
// (function-local static) and then writes its own thread's cell (core/thread_cells.hpp):
// no locked instruction. Reading sums the cells of every thread.

#include <algorithm>
#include <atomic>
#include <bit>
#include <cstdint>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include <lazytensor/core/clock.hpp>
#include <lazytensor/core/config.hpp>
#include <lazytensor/core/thread_cells.hpp>

namespace lazy::core {

/// A monotonically increasing event count.
class Counter final : public detail::CellOwner {
 public:
  Counter();
  ~Counter();
  Counter(const Counter&) = delete;
  Counter& operator=(const Counter&) = delete;

  /// Adds `n` (from any thread).
  void add(std::int64_t n = 1) {
    if (std::atomic<std::int64_t>* c = detail::ThreadCellHub::my_cell(slot_)) [[likely]] {
      c->store(c->load(std::memory_order_relaxed) + n, std::memory_order_relaxed);
    } else {
      add_shared(n);
    }
  }
  /// The sum of every add since construction or the last reset().
  std::int64_t value() const;
  void reset();

  LAZYTENSOR_INLINE void fold(const detail::ThreadCells& cells) override;

 private:
  void add_shared(std::int64_t n);
  std::int64_t cells_sum() const;  // with the hub's mutex held

  std::size_t slot_;
  std::int64_t shared_ = 0;  // exited threads' and slot-less adds (hub's mutex)
  std::int64_t base_ = 0;    // the sum at the last reset (hub's mutex)
};

/// Summary of timed samples, in nanoseconds.
struct MetricData {
  std::int64_t count = 0;
  double total_ns = 0, min_ns = 0, max_ns = 0;
};

/// A series of timed samples. Recording writes the thread's own cells (every read of a
/// small statement records two samples); a summary taken while another thread records
/// may see that sample in part.
class Metric final : public detail::CellOwner {
 public:
  Metric();
  ~Metric();
  Metric(const Metric&) = delete;
  Metric& operator=(const Metric&) = delete;

  /// Records a sample of `ns` nanoseconds (from any thread).
  void record(double ns) {
    if (std::atomic<std::int64_t>* c = detail::ThreadCellHub::my_cell(slot_)) [[likely]] {
      record_into(c, ns);
    } else {
      record_shared(ns);
    }
  }
  MetricData data() const;
  void reset();

  LAZYTENSOR_INLINE void fold(const detail::ThreadCells& cells) override;

 private:
  // A thread's cells: the epoch they belong to (reset() starts a new one), the count, and
  // the total, least and greatest sample (doubles, bit-cast).
  enum Cell { kEpoch, kCount, kTotal, kMin, kMax, kCells };
  static constexpr double kNone = std::numeric_limits<double>::infinity();

  void record_into(std::atomic<std::int64_t>* c, double ns) {
    const std::int64_t epoch = epoch_.load(std::memory_order_relaxed);
    if (c[kEpoch].load(std::memory_order_relaxed) != epoch) [[unlikely]] {
      put(c[kCount], 0);
      put(c[kTotal], bits(0.0));
      put(c[kMin], bits(kNone));
      put(c[kMax], bits(-kNone));
      c[kEpoch].store(epoch, std::memory_order_release);
    }
    put(c[kCount], get(c[kCount]) + 1);
    put(c[kTotal], bits(real(get(c[kTotal])) + ns));
    if (ns < real(get(c[kMin]))) put(c[kMin], bits(ns));
    if (ns > real(get(c[kMax]))) put(c[kMax], bits(ns));
  }
  void record_shared(double ns);
  static std::int64_t get(const std::atomic<std::int64_t>& c) { return c.load(std::memory_order_relaxed); }
  static void put(std::atomic<std::int64_t>& c, std::int64_t v) { c.store(v, std::memory_order_relaxed); }
  static std::int64_t bits(double v) { return std::bit_cast<std::int64_t>(v); }
  static double real(std::int64_t b) { return std::bit_cast<double>(b); }
  static void merge(MetricData& into, std::int64_t count, double total, double lo, double hi);
  // Merges a thread's cells into `into` when they belong to the current epoch.
  void merge_cells(MetricData& into, const detail::ThreadCells& cells) const;

  std::size_t slot_;
  std::atomic<std::int64_t> epoch_{1};  // cells start at 0: every thread's first sample starts its epoch
  MetricData shared_{0, 0, kNone, -kNone};  // exited threads' and slot-less samples (hub's mutex)
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

LAZYTENSOR_INLINE Counter::Counter() : slot_(detail::ThreadCellHub::get().reserve(1, this)) {}

LAZYTENSOR_INLINE Counter::~Counter() { detail::ThreadCellHub::get().release(slot_); }

LAZYTENSOR_INLINE std::int64_t Counter::cells_sum() const {
  std::int64_t v = shared_;
  if (slot_ != detail::ThreadCellHub::kNoSlot) {
    detail::ThreadCellHub::get().for_each_thread([&](const detail::ThreadCells& t) {
      if (auto* c = t.peek(slot_)) v += c->load(std::memory_order_relaxed);
    });
  }
  return v;
}

LAZYTENSOR_INLINE std::int64_t Counter::value() const {
  std::lock_guard lock(detail::ThreadCellHub::get().mutex());
  return cells_sum() - base_;
}

LAZYTENSOR_INLINE void Counter::reset() {
  std::lock_guard lock(detail::ThreadCellHub::get().mutex());
  base_ = cells_sum();
}

LAZYTENSOR_INLINE void Counter::add_shared(std::int64_t n) {
  std::lock_guard lock(detail::ThreadCellHub::get().mutex());
  shared_ += n;
}

LAZYTENSOR_INLINE void Counter::fold(const detail::ThreadCells& cells) {
  if (auto* c = cells.peek(slot_)) shared_ += c->load(std::memory_order_relaxed);
}

LAZYTENSOR_INLINE Metric::Metric() : slot_(detail::ThreadCellHub::get().reserve(kCells, this)) {}

LAZYTENSOR_INLINE Metric::~Metric() { detail::ThreadCellHub::get().release(slot_); }

LAZYTENSOR_INLINE void Metric::merge(MetricData& into, std::int64_t count, double total, double lo, double hi) {
  into.count += count;
  into.total_ns += total;
  into.min_ns = std::min(into.min_ns, lo);
  into.max_ns = std::max(into.max_ns, hi);
}

LAZYTENSOR_INLINE void Metric::record_shared(double ns) {
  std::lock_guard lock(detail::ThreadCellHub::get().mutex());
  merge(shared_, 1, ns, ns, ns);
}

LAZYTENSOR_INLINE void Metric::merge_cells(MetricData& into, const detail::ThreadCells& cells) const {
  const auto* c = cells.peek(slot_);
  if (!c || c[kEpoch].load(std::memory_order_acquire) != epoch_.load(std::memory_order_relaxed)) return;
  merge(into, get(c[kCount]), real(get(c[kTotal])), real(get(c[kMin])), real(get(c[kMax])));
}

LAZYTENSOR_INLINE void Metric::fold(const detail::ThreadCells& cells) { merge_cells(shared_, cells); }

LAZYTENSOR_INLINE MetricData Metric::data() const {
  auto& hub = detail::ThreadCellHub::get();
  std::lock_guard lock(hub.mutex());
  MetricData d = shared_;
  if (slot_ != detail::ThreadCellHub::kNoSlot)
    hub.for_each_thread([&](const detail::ThreadCells& t) { merge_cells(d, t); });
  if (d.count == 0) return {};
  return d;
}

LAZYTENSOR_INLINE void Metric::reset() {
  std::lock_guard lock(detail::ThreadCellHub::get().mutex());
  epoch_.fetch_add(1, std::memory_order_relaxed);
  shared_ = MetricData{0, 0, kNone, -kNone};
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
  for (auto& [n, c] : counters_) c->reset();
  for (auto& [n, m] : metrics_) m->reset();
}

LAZYTENSOR_INLINE ScopedTimer::~ScopedTimer() { m_.record(MetricClock::to_ns(t0_, MetricClock::now())); }

}  // namespace lazy::core
#endif  // LAZYTENSOR_HEADER_DEFINITIONS
