#pragma once
// Helpers shared by the test files. Each folder's tests compile as one translation unit
// (tests/CMakeLists.txt), so a helper used by two files lives here, once.

#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <random>
#include <string>
#include <system_error>
#include <type_traits>
#include <vector>

#include <gtest/gtest.h>

#include <lazytensor/lazytensor.hpp>

namespace lazy_tests {

/// This test process's own directory under the system's temp dir, made on first use and
/// removed with everything in it when the process exits normally, unless a test failed or
/// LAZYTENSOR_KEEP_TEST_FILES is set (then kept for inspection, and its path printed). The
/// tests that write files of their own (checkpoints, logs, datasets, safetensors) put them
/// here, so that passing runs do not pile up files and parallel ones never share a name.
inline const std::string& scratch_dir() {
  struct Dir {
    std::string path = (std::filesystem::temp_directory_path() / ("lazytensor_test_" + std::to_string(::getpid())))
                           .string();
    Dir() {
      std::filesystem::remove_all(path);  // a crashed run's, if the pid came round again
      std::filesystem::create_directories(path);
    }
    ~Dir() {
      // (gtest's UnitTest is never destroyed, so it is still there when statics go.)
      if (std::getenv("LAZYTENSOR_KEEP_TEST_FILES") || ::testing::UnitTest::GetInstance()->Failed()) {
        std::fprintf(stderr, "test files kept in %s\n", path.c_str());
        return;
      }
      std::error_code ec;  // (nothing to do about a failure at exit)
      std::filesystem::remove_all(path, ec);
    }
  };
  static const Dir dir;
  return dir.path;
}

/// Directory `name` inside scratch_dir(), made if missing.
inline std::string scratch_subdir(const std::string& name) {
  const std::string d = scratch_dir() + "/" + name;
  std::filesystem::create_directories(d);
  return d;
}

/// `n` values drawn uniformly from [lo, hi) (mt19937_64 seeded with `seed`), converted to T.
template <class T>
std::vector<T> random_values(std::int64_t n, unsigned seed, double lo = -1, double hi = 1) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> d(lo, hi);
  std::vector<T> v(static_cast<std::size_t>(n));
  for (auto& x : v) x = static_cast<T>(d(rng));
  return v;
}

/// Any element as a double (bfloat16 through float).
template <class T>
double num(T v) {
  if constexpr (std::is_same_v<T, lazy::bfloat16>) return static_cast<double>(static_cast<float>(v));
  else return static_cast<double>(v);
}

/// True when float `f` is exactly a bfloat16 value (its low 16 bits are zero).
inline bool representable_in_bf16(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  return (u & 0xffffu) == 0;
}

/// The sizes every numerical test covers (DESIGN.md section 11).
inline const std::vector<std::int64_t> kSizes = {0, 1, 2, 3, 4, 5, 6, 7, 127, 128, 129};

/// A debug counter's current value.
inline std::int64_t counter(const char* name) { return lazy::debug::counter_value(name); }

/// Kernels run so far on this process.
inline std::int64_t kernels_run() { return counter("KernelsRun"); }

/// Sets device 0's worker count for one scope and restores the previous count.
struct ThreadsGuard {
  explicit ThreadsGuard(int n) : pool(lazy::graph::DeviceRegistry::get().device(0).threads()), old(pool.size()) {
    lazy::set_num_threads(n);
  }
  ~ThreadsGuard() { lazy::set_num_threads(old); }
  ThreadsGuard(const ThreadsGuard&) = delete;
  ThreadsGuard& operator=(const ThreadsGuard&) = delete;
  lazy::ThreadPool& pool;
  int old;
};

/// Eager mode on or off for one scope (off afterwards).
struct EagerGuard {
  explicit EagerGuard(bool on) { lazy::eager_mode(on); }
  ~EagerGuard() { lazy::eager_mode(false); }
  EagerGuard(const EagerGuard&) = delete;
  EagerGuard& operator=(const EagerGuard&) = delete;
};

}  // namespace lazy_tests
