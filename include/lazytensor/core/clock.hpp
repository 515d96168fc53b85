#pragma once

#include <lazytensor/core/config.hpp>
// The clock the metrics time with. Every read of a small statement takes two timings, so
// the clock is on the hot path: steady_clock costs ~24 ns a reading through the vDSO on
// the development VM, the x86 time-stamp counter ~10 ns. The counter is used where the
// CPU says it ticks at a constant rate whatever the power state (CPUID's invariant-TSC
// bit); elsewhere the clock is steady_clock itself.

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <optional>

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
// The counter is read with the compiler's builtin: <x86intrin.h>, which declares __rdtsc,
// adds every intrinsic header of the target to each translation unit for one instruction.
#include <cpuid.h>
#define LAZYTENSOR_DETAIL_TSC 1
#endif

namespace lazy::core {

/// Readings in ticks (`now()`), converted to nanoseconds by `to_ns`.
class MetricClock {
 public:
  using Ticks = std::int64_t;

  /// The current reading.
  static Ticks now() noexcept;

  /// Nanoseconds between readings `t0` and `t1` (0 if `t1` is earlier: counters of
  /// different cores may disagree by a few ticks).
  static double to_ns(Ticks t0, Ticks t1) noexcept {
    return static_cast<double>(std::max<Ticks>(t1 - t0, 0)) * state().ns_per_tick;
  }

  /// True when readings come from the time-stamp counter.
  static bool uses_tsc() noexcept { return state().tsc; }

 private:
  struct State {
    bool tsc = false;
    double ns_per_tick = 1.0;
  };

  static Ticks steady_ticks() noexcept;

  static const State& state() noexcept;

  // The counter's rate against steady_clock over ~200 us, once per process. Each end is a
  // steady_clock reading bracketed by two counter readings close together (a thread
  // preempted in between tries again), so the rate is good to ~0.05%.
  static State calibrate() noexcept;
};

}  // namespace lazy::core

#if LAZYTENSOR_HEADER_DEFINITIONS
namespace lazy::core {

LAZYTENSOR_INLINE auto MetricClock::now() noexcept -> Ticks {
#ifdef LAZYTENSOR_DETAIL_TSC
  if (state().tsc) return static_cast<Ticks>(__builtin_ia32_rdtsc());
#endif
  return steady_ticks();
}

LAZYTENSOR_INLINE auto MetricClock::steady_ticks() noexcept -> Ticks {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

LAZYTENSOR_INLINE auto MetricClock::state() noexcept -> const State& {
  static const State s = calibrate();
  return s;
}

LAZYTENSOR_INLINE auto MetricClock::calibrate() noexcept -> State {
  State s;
#ifdef LAZYTENSOR_DETAIL_TSC
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (__get_cpuid(0x80000000u, &a, &b, &c, &d) == 0 || a < 0x80000007u) return s;
  __get_cpuid(0x80000007u, &a, &b, &c, &d);
  if (!(d & (1u << 8))) return s;  // no invariant TSC
  struct Pair {
    Ticks steady;
    double tsc;
  };
  auto pair = []() -> std::optional<Pair> {
    for (int attempt = 0; attempt < 100; ++attempt) {
      const auto c0 = __builtin_ia32_rdtsc();
      const Ticks t = steady_ticks();
      const auto c1 = __builtin_ia32_rdtsc();
      if (c1 > c0 && c1 - c0 < 20'000)
        return Pair{t, 0.5 * (static_cast<double>(c0) + static_cast<double>(c1))};
    }
    return std::nullopt;
  };
  const auto p0 = pair();
  if (!p0) return s;
  while (steady_ticks() - p0->steady < 200'000) {
  }
  const auto p1 = pair();
  if (!p1 || p1->tsc <= p0->tsc) return s;
  s.tsc = true;
  s.ns_per_tick = static_cast<double>(p1->steady - p0->steady) / (p1->tsc - p0->tsc);
#endif
  return s;
}

}  // namespace lazy::core
#endif  // LAZYTENSOR_HEADER_DEFINITIONS
