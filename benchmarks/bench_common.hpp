#pragma once
// Helpers shared by the benchmark programs (not a benchmark itself: only bench_*.cpp are).
//
// Conventions, relied on by scripts/bench_report.py:
//   * names are BM_<Family>_<Variant>/<args>; the lazytensor variant is "Lazy", each peer has
//     its own variant name, and rows pair on <args>;
//   * every benchmark uses real (wall-clock) time, so a multi-threaded lazytensor kernel is
//     not flattered by CPU time of the calling thread only;
//   * every peer (Eigen, xtensor, libtorch) runs single-threaded, so the ratio rows pin
//     lazytensor to 1 thread too; thread scaling has its own benchmarks.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include <benchmark/benchmark.h>

#include <lazytensor/lazytensor.hpp>

namespace bench {

/// N random floats in [-1, 1), reproducible per seed.
inline std::vector<float> random_vector(std::int64_t n, unsigned seed) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> dist(-1.f, 1.f);
  std::vector<float> v(static_cast<std::size_t>(n));
  for (auto& x : v) x = dist(gen);
  return v;
}

/// Sets the current device's worker count for the lifetime of the guard (outside timing:
/// resizing joins and respawns the workers).
class DeviceThreads {
 public:
  explicit DeviceThreads(int n) : old_(lazy::graph::current_device().threads().size()) { set(n); }
  ~DeviceThreads() { set(old_); }
  DeviceThreads(const DeviceThreads&) = delete;
  DeviceThreads& operator=(const DeviceThreads&) = delete;

 private:
  static void set(int n) {
    if (lazy::get_num_threads() != n) lazy::set_num_threads(n);  // waits for steps in flight
  }
  int old_;
};

/// Largest relative difference of two float ranges (for the untimed self-checks).
template <class A, class B>
double max_rel_diff(const A* a, const B* b, std::int64_t n) {
  double worst = 0;
  for (std::int64_t i = 0; i < n; ++i) {
    const double x = a[i], y = b[i];
    worst = std::max(worst, std::abs(x - y) / std::max(1.0, std::abs(y)));
  }
  return worst;
}

/// Stops a benchmark with an error when a self-check failed.
inline bool check(benchmark::State& state, bool ok, const std::string& what) {
  if (!ok) state.SkipWithError(("self-check failed: " + what).c_str());
  return ok;
}

}  // namespace bench
