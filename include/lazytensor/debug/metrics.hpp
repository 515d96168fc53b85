#pragma once
// Counters and metrics, named like PyTorch/XLA's (torch_xla.debug.metrics).
//
// Steps run asynchronously; every function here first waits for the steps issued on the
// calling thread's device, so that what it reports includes everything issued so far
// (other devices are not waited for: a replica must not wait on another's collectives).

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <lazytensor/core/config.hpp>
#include <lazytensor/core/counters.hpp>
#include <lazytensor/graph/device.hpp>

// Formatting is the definitions' alone: no <iomanip> in user TUs of the compiled runtime.
#if LAZYTENSOR_HEADER_DEFINITIONS
#include <iomanip>
#include <sstream>
#endif

namespace lazy::debug {

namespace detail {
/// Waits for the steps in flight on the current device (see the file comment).
inline void settle() { graph::current_device().wait_idle(); }
}  // namespace detail

/// Value of counter `name` (0 when it never fired), as met.counter_value.
std::int64_t counter_value(const std::string& name);

/// Summary of metric `name` (count, total, min, max in ns), if it was ever recorded.
std::optional<core::MetricData> metric_data(const std::string& name);

/// Names of the counters that fired.
std::vector<std::string> counter_names();

/// Resets every counter and metric to zero.
void clear_metrics();

namespace detail {
std::string fmt_ns(double ns);
}  // namespace detail

/// Every metric and counter, plus the buffer pool of device 0, in PyTorch/XLA's format.
std::string metrics_report();

/// One line: steps, syncs, kernels, time executing and bytes allocated.
std::string short_metrics_report();

#if LAZYTENSOR_HEADER_DEFINITIONS
LAZYTENSOR_INLINE std::int64_t counter_value(const std::string& name) {
  detail::settle();
  std::int64_t v = 0;
  core::Registry::get().for_each([&](const std::string& n, const core::Counter* c, const core::Metric*) {
    if (c && n == name) v = c->value();
  });
  return v;
}

LAZYTENSOR_INLINE std::optional<core::MetricData> metric_data(const std::string& name) {
  detail::settle();
  std::optional<core::MetricData> r;
  core::Registry::get().for_each([&](const std::string& n, const core::Counter*, const core::Metric* m) {
    if (m && n == name && m->data().count) r = m->data();
  });
  return r;
}

LAZYTENSOR_INLINE std::vector<std::string> counter_names() {
  detail::settle();
  std::vector<std::string> names;
  core::Registry::get().for_each([&](const std::string& n, const core::Counter* c, const core::Metric*) {
    if (c && c->value()) names.push_back(n);
  });
  return names;
}

LAZYTENSOR_INLINE void clear_metrics() {
  detail::settle();
  core::Registry::get().reset();
}

namespace detail {
LAZYTENSOR_INLINE std::string fmt_ns(double ns) {
  std::ostringstream os;
  os << std::fixed << std::setprecision(3);
  if (ns >= 1e9) os << ns / 1e9 << "s";
  else if (ns >= 1e6) os << ns / 1e6 << "ms";
  else if (ns >= 1e3) os << ns / 1e3 << "us";
  else os << ns << "ns";
  return os.str();
}
}  // namespace detail

LAZYTENSOR_INLINE std::string metrics_report() {
  detail::settle();
  std::ostringstream os;
  core::Registry::get().for_each([&](const std::string& n, const core::Counter*, const core::Metric* m) {
    if (!m) return;
    auto d = m->data();
    if (!d.count) return;
    os << "Metric: " << n << "\n  TotalSamples: " << d.count << "\n  Accumulator: " << detail::fmt_ns(d.total_ns)
       << "\n  Mean: " << detail::fmt_ns(d.total_ns / static_cast<double>(d.count))
       << "\n  Min: " << detail::fmt_ns(d.min_ns) << "\n  Max: " << detail::fmt_ns(d.max_ns) << "\n";
  });
  core::Registry::get().for_each([&](const std::string& n, const core::Counter* c, const core::Metric*) {
    if (c && c->value()) os << "Counter: " << n << "\n  Value: " << c->value() << "\n";
  });
  auto ps = graph::current_device().pool().stats();
  os << "Counter: BytesAllocated\n  Value: " << ps.fresh_bytes << "\n";
  os << "Counter: FreshAllocations\n  Value: " << ps.fresh_allocations << "\n";
  os << "Counter: PoolReuses\n  Value: " << ps.reuses << "\n";
  return os.str();
}

LAZYTENSOR_INLINE std::string short_metrics_report() {
  std::ostringstream os;
  auto exec = metric_data("ExecuteTime");
  os << "MarkStep=" << counter_value("MarkStep") << " ImplicitSync=" << counter_value("ImplicitSync")
     << " KernelsRun=" << counter_value("KernelsRun")
     << " ExecuteTime=" << detail::fmt_ns(exec ? exec->total_ns : 0)
     << " BytesAllocated=" << graph::current_device().pool().stats().fresh_bytes;
  return os.str();
}
#endif  // LAZYTENSOR_HEADER_DEFINITIONS

}  // namespace lazy::debug
