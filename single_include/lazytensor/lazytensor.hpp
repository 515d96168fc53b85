// lazytensor — single-header distribution, generated from include/lazytensor/lazytensor.hpp.
//
// GENERATED FILE — DO NOT EDIT. Regenerate with:
//   cmake -P scripts/amalgamate.cmake
//
// SPDX-License-Identifier: MIT
// Copyright (c) 2026 The lazytensor authors
#pragma once

// ---- begin lazytensor/lazytensor.hpp ----
// lazytensor: lazy tensors with fused, SIMD-vectorized kernels. Umbrella header: include
// this, or one module header, and link lazytensor::lazytensor.

// ---- begin lazytensor/any_tensor.hpp ----
// AnyTensor: a tensor whose element type is known at run time only. State dicts, file
// formats and optimizer state hold tensors of several dtypes side by side; AnyTensor
// carries them and converts back to Tensor<T> with a checked as<T>().

#include <cstring>
#include <memory>
#include <string>

// ---- begin lazytensor/core/config.hpp ----
// Where the non-template runtime (device, executor, planner, pools, thread pool, collectives'
// transport, file and format readers) is defined.
//
// Header-only, the default: the headers define it `inline`, and every translation unit that
// uses a part compiles that part again. With LAZYTENSOR_COMPILED (defined for users by the
// CMake target lazytensor::compiled) the headers only declare it, and the library defines it
// once: a user TU then compiles just the templates it names (kernels of its dtypes and ops).
// Templates are always defined in the headers.
//
// A header writes its runtime definitions after its declarations, as
//   #if LAZYTENSOR_HEADER_DEFINITIONS
//   LAZYTENSOR_INLINE void ThreadPool::resize(int threads) { ... }
//   #endif
// so both modes read the same text. LAZYTENSOR_INLINE goes on those definitions only, never
// on a declaration.

#if defined(LAZYTENSOR_BUILDING_RUNTIME)
// src/compiled.cpp: the one TU that defines the runtime, with external linkage.
#define LAZYTENSOR_HEADER_DEFINITIONS 1
#define LAZYTENSOR_INLINE
#elif defined(LAZYTENSOR_COMPILED)
#define LAZYTENSOR_HEADER_DEFINITIONS 0
#define LAZYTENSOR_INLINE
#else
#define LAZYTENSOR_HEADER_DEFINITIONS 1
#define LAZYTENSOR_INLINE inline
#endif

// The templates that depend on a dtype only (not on an expression): the typed autograd
// helpers, a tensor's sum, views and permutes, random draws. Header-only, every TU that uses
// one instantiates it again. With the compiled runtime the library instantiates them once:
// each header keeps a list macro, LAZYTENSOR_<NAME>_INSTANCES(P, T), that names its per-dtype
// templates with prefix P. The header expands it with P = extern (user TUs, and the library
// before its definitions), src/compiled.cpp (core, graph, ops) or src/compiled_frontend.cpp
// and src/compiled_nn_wide.cpp (nn, optim, train) with P empty at its end, after every
// header: one list, so the declarations and
// the definitions cannot disagree.
//
// The frontend (nn, optim) lists the templates whose arguments the library fixes: the
// `template <class = void>` functions and layers (at void), the losses and layers over a
// dtype (at the floating dtypes), the optimizers (class templates at their one argument).
// Their member templates are defined outside the class: one defined in the class is
// inline, and GCC, optimizing, instantiates an inline function in every TU that calls it
// (to inline it) even when an `extern template` declares it.
#if defined(LAZYTENSOR_BUILDING_RUNTIME) || defined(LAZYTENSOR_COMPILED)
#define LAZYTENSOR_EXPLICIT_INSTANTIATION 1
#else
#define LAZYTENSOR_EXPLICIT_INSTANTIATION 0
#endif

// X(P, T) for each floating dtype (the dtypes that have gradients) ...
#define LAZYTENSOR_FOR_FLOATING(X, P) X(P, float) X(P, double) X(P, lazy::bfloat16)
// ... and for every element type.
#define LAZYTENSOR_FOR_ELEMENT(X, P) \
  X(P, bool) X(P, std::int32_t) X(P, std::int64_t) LAZYTENSOR_FOR_FLOATING(X, P)

// The instruction set the kernels are compiled for (xsimd and the GEMM kernel choose theirs
// from the compiler's flags), coarsely: what a mismatch would change.
#if defined(__AVX512F__)
#define LAZYTENSOR_ISA avx512
#elif defined(__AVX2__) && defined(__FMA__)
#define LAZYTENSOR_ISA avx2_fma
#elif defined(__AVX__)
#define LAZYTENSOR_ISA avx
#else
#define LAZYTENSOR_ISA sse
#endif
#define LAZYTENSOR_ISA_SYMBOL_(isa) lazytensor_compiled_for_##isa
#define LAZYTENSOR_ISA_SYMBOL(isa) LAZYTENSOR_ISA_SYMBOL_(isa)

// lazytensor::compiled holds kernels too (its per-dtype templates: nn layers, reductions,
// random draws, GEMM), compiled for the instruction set of the build that made it. A program
// built for another one would run those at the library's (slower, or unsupported by the CPU)
// while its own run at its own: the library defines a symbol named after its instruction set
// and every user TU refers to the one named after its own, so a mismatch is a link error
// naming both sides ("undefined reference to lazytensor_compiled_for_avx2_fma"). Build the
// package with the flags of the programs that use it (or use it header-only).
#if LAZYTENSOR_EXPLICIT_INSTANTIATION
extern "C" const char LAZYTENSOR_ISA_SYMBOL(LAZYTENSOR_ISA);
#endif
#if defined(LAZYTENSOR_COMPILED) && !defined(LAZYTENSOR_BUILDING_RUNTIME) && (defined(__GNUC__) || defined(__clang__))
namespace lazy::detail {
[[gnu::used]] inline const char* const compiled_isa_check = &LAZYTENSOR_ISA_SYMBOL(LAZYTENSOR_ISA);
}  // namespace lazy::detail
#endif
// ---- end lazytensor/core/config.hpp ----
// ---- begin lazytensor/graph/convert_node.hpp ----
// ConvertNode: a tensor converted between floating dtypes (bfloat16, float, double) by a
// run-time choice of dtypes. AnyTensor::to(dtype), and through it Module::to(dtype) and the
// precision plugins, convert tensors whose dtype a program only knows at run time; one small
// node class for the six conversions keeps every translation unit that merely includes them
// free of per-dtype kernels (typed code converts with cast<T>, which fuses). Values round as
// static_cast does (to nearest even; double to bfloat16 through float, as cast<bfloat16>).

#include <cstdint>
#include <string>
#include <type_traits>

// ---- begin lazytensor/core/bfloat16.hpp ----
// bfloat16: the top 16 bits of an IEEE float. A storage type: arithmetic happens in float,
// conversion from float rounds to nearest even (NaN stays NaN).

#include <bit>
#include <cmath>
#include <cstdint>
#include <ostream>

namespace lazy {

/// 16-bit brain floating point value (storage type; computes in float).
struct bfloat16 {
  std::uint16_t bits = 0;

  constexpr bfloat16() = default;
  /// Converts from float with round-to-nearest-even.
  constexpr bfloat16(float f) : bits(round_bits(f)) {}  // NOLINT: implicit like torch
  constexpr bfloat16(double d) : bfloat16(static_cast<float>(d)) {}
  constexpr bfloat16(int i) : bfloat16(static_cast<float>(i)) {}
  constexpr bfloat16(long i) : bfloat16(static_cast<float>(i)) {}
  constexpr bfloat16(long long i) : bfloat16(static_cast<float>(i)) {}
  constexpr bfloat16(bool b) : bfloat16(b ? 1.0f : 0.0f) {}

  /// Exact widening conversion to float.
  constexpr operator float() const { return std::bit_cast<float>(std::uint32_t(bits) << 16); }

  /// Builds a value from its raw bit pattern.
  static constexpr bfloat16 from_bits(std::uint16_t b) {
    bfloat16 r;
    r.bits = b;
    return r;
  }

 private:
  static constexpr std::uint16_t round_bits(float f) {
    const std::uint32_t u = std::bit_cast<std::uint32_t>(f);
    if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x007fffffu) != 0) {
      return static_cast<std::uint16_t>((u >> 16) | 0x0040u);  // quiet NaN, keep sign
    }
    const std::uint32_t lsb = (u >> 16) & 1u;
    return static_cast<std::uint16_t>((u + 0x7fffu + lsb) >> 16);
  }
};

inline std::ostream& operator<<(std::ostream& os, bfloat16 v) { return os << float(v); }

}  // namespace lazy
// ---- end lazytensor/core/bfloat16.hpp ----
// ---- begin lazytensor/core/error.hpp ----
// Error hierarchy. Every failure reachable from the public API is one of these, with a
// message that says what was expected, what was found, and where.

#include <exception>
#include <stdexcept>
#include <string>


namespace lazy {

/// Base of every lazytensor error.
class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

/// Incompatible or invalid shapes, out-of-range dimensions.
class ShapeError : public Error {
 public:
  using Error::Error;
};

/// An op was given a dtype it does not support.
class DTypeError : public Error {
 public:
  using Error::Error;
};

/// An index value (gather, index_select, one_hot, ...) is out of range.
class IndexError : public Error {
 public:
  using Error::Error;
};

/// Tensors on different devices, or an unknown device.
class DeviceError : public Error {
 public:
  using Error::Error;
};

/// Invalid sharding annotation.
class ShardingError : public Error {
 public:
  using Error::Error;
};

/// Base of collective failures.
class CollectiveError : public Error {
 public:
  using Error::Error;
};

/// Replicas issued different collectives at the same sequence number.
class CollectiveMismatch : public CollectiveError {
 public:
  using CollectiveError::CollectiveError;
};

/// A participant did not arrive in time.
class CollectiveTimeout : public CollectiveError {
 public:
  using CollectiveError::CollectiveError;
};

/// Another replica failed; this one was woken up to stop.
class ReplicaAborted : public CollectiveError {
 public:
  using CollectiveError::CollectiveError;
};

/// Malformed or truncated file contents.
class FormatError : public Error {
 public:
  using Error::Error;
};

/// The operating system refused a file operation.
class IoError : public Error {
 public:
  using Error::Error;
};

/// Memory for a buffer could not be had: more than the machine holds, or the allocator
/// refused (torch.OutOfMemoryError). Names the size asked for.
class OutOfMemoryError : public Error {
 public:
  using Error::Error;
};

namespace detail {

/// The message of a caught exception: what() of a std::exception, else a placeholder.
std::string exception_message(const std::exception_ptr& e);

}  // namespace detail

}  // namespace lazy

#if LAZYTENSOR_HEADER_DEFINITIONS
namespace lazy::detail {

LAZYTENSOR_INLINE std::string exception_message(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& ex) {
    return ex.what();
  } catch (...) {
    return "an exception not derived from std::exception";
  }
}

}  // namespace lazy::detail
#endif  // LAZYTENSOR_HEADER_DEFINITIONS
// ---- end lazytensor/core/error.hpp ----
// ---- begin lazytensor/graph/device.hpp ----
// A device: the trace of pending nodes, the handles that can reach them, a worker pool, a
// buffer pool, an executor thread running submitted plans in order, the plan cache, a
// random-number stream and the step closures. Devices live for the whole process.
//
// Threads: one thread traces a device (its replica thread, or the user's), creating
// pending nodes and calling mark_step; the device's executor thread runs the plans
// mark_step hands it, using the worker pool. The tracing thread never looks inside a
// queued node, and waits for the executor (wait_idle) before it runs anything itself.

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <deque>
#include <exception>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

// ---- begin lazytensor/core/buffer.hpp ----
// Device memory: 64-byte aligned buffers padded to whole SIMD batches, recycled by a
// per-device pool so that a steady training loop stops touching the allocator.
//
// Large buffers (2 MiB and up) start on a 2 MiB boundary and ask Linux for transparent huge
// pages. Why: a kernel streaming 2^24 floats from DRAM walks 16k 4-KiB pages per array, and
// the TLB misses (doubly expensive under a hypervisor) cost 25-40% of the bandwidth on the
// development machine (20 -> 26-29 GB/s for sum((a - b)^2)). Most distributions leave THP in
// "madvise" mode, so without the hint the kernel never uses them. LAZYTENSOR_HUGE_PAGES=0
// turns the hint off.

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <memory>
#include <mutex>
#include <new>
#include <unordered_map>
#include <utility>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#endif
#if defined(__unix__) || defined(__APPLE__)
#include <unistd.h>
#endif

// ---- begin lazytensor/core/counters.hpp ----
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

// ---- begin lazytensor/core/clock.hpp ----

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
// ---- end lazytensor/core/clock.hpp ----

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
// ---- end lazytensor/core/counters.hpp ----
// ---- begin lazytensor/core/env.hpp ----
// Reading settings from the environment (LAZYTENSOR_*): a malformed value is an error
// naming the variable, never silently replaced by a default.

#include <cstdlib>
#include <optional>
#include <string>


namespace lazy::core {

/// The whole number in environment variable `name`, or nullopt when it is unset or empty.
/// Throws Error naming the variable, `what` it counts and an `example` when the value is
/// not a whole number >= `min`.
std::optional<long long> env_integer(const char* name, long long min, const char* what,
                                            const char* example);

/// The on/off switch in environment variable `name`: true for 1/on/true, false for
/// 0/off/false, nullopt when unset or empty. Throws Error naming the variable otherwise.
std::optional<bool> env_switch(const char* name);

}  // namespace lazy::core

#if LAZYTENSOR_HEADER_DEFINITIONS
namespace lazy::core {

LAZYTENSOR_INLINE std::optional<long long> env_integer(const char* name,
    long long min,
    const char* what,
    const char* example) {
  const char* env = std::getenv(name);
  if (!env || !*env) return std::nullopt;
  char* end = nullptr;
  const long long v = std::strtoll(env, &end, 10);
  if (end == env || *end != '\0' || v < min) {
    throw Error(std::string(name) + "='" + env + "' is not a number of " + what +
                " >= " + std::to_string(min) + " (expected e.g. " + example + ")");
  }
  return v;
}

LAZYTENSOR_INLINE std::optional<bool> env_switch(const char* name) {
  const char* env = std::getenv(name);
  if (!env || !*env) return std::nullopt;
  const std::string v = env;
  if (v == "1" || v == "on" || v == "true") return true;
  if (v == "0" || v == "off" || v == "false") return false;
  throw Error(std::string(name) + "='" + v +
              "' is not an on/off switch (expected 1, on, true, 0, off or false)");
}

}  // namespace lazy::core
#endif  // LAZYTENSOR_HEADER_DEFINITIONS
// ---- end lazytensor/core/env.hpp ----

namespace lazy {

/// Alignment of every buffer (one cache line, one AVX-512 register).
inline constexpr std::size_t kBufferAlign = 64;
/// Element counts are padded to a multiple of this, so a kernel's SIMD main loop reads and
/// writes whole batches (16 floats = one AVX-512 register) without a scalar tail.
inline constexpr std::int64_t kPadElements = 16;

/// Bytes a buffer of `numel` elements of `elem_size` bytes occupies after padding: rounded up
/// to whole batches, plus one more batch, so that a full SIMD batch loaded at any element
/// of the tensor stays inside the allocation (a kernel's tail reads a whole batch and
/// stores only the lanes it owns).
constexpr std::size_t padded_bytes(std::int64_t numel, std::size_t elem_size) {
  const std::int64_t n = ((numel < 1 ? 1 : numel) + kPadElements - 1) / kPadElements * kPadElements + kPadElements;
  const std::size_t bytes = static_cast<std::size_t>(n) * elem_size;
  return (bytes + kBufferAlign - 1) / kBufferAlign * kBufferAlign;
}

/// Buffers of at least this many bytes are aligned to it and advised to use huge pages.
inline constexpr std::size_t kHugePageBytes = std::size_t{2} << 20;

namespace detail {

inline std::size_t buffer_alignment(std::size_t bytes) {
  return bytes >= kHugePageBytes ? kHugePageBytes : kBufferAlign;
}

bool huge_pages_wanted();

/// Memory for a buffer of `bytes` bytes (see the file comment for large ones). Throws
/// OutOfMemoryError naming the size when it cannot be had (never std::bad_alloc).
void* allocate_buffer_memory(std::size_t bytes);

/// The machine's physical memory in bytes (0 when unknown).
std::uint64_t physical_memory_bytes();

/// Throws OutOfMemoryError naming `what` and the size when `bytes` exceeds the machine's
/// physical memory: a request that can never be met fails at once, before a reader spends
/// time on data it could not hold (a sparse file's apparent size, a header's claim).
void check_fits_in_memory(std::uint64_t bytes, const std::string& what);

/// A size for a message: "512 bytes", "1.5 GiB (1610612736 bytes)".
std::string byte_size_text(std::uint64_t bytes);

inline void free_buffer_memory(void* p, std::size_t bytes) {
  ::operator delete(p, std::align_val_t(buffer_alignment(bytes)));
}

}  // namespace detail

class BufferPool;

/// A block of aligned memory. Returned to its pool when the last reference goes.
class Buffer {
 public:
  Buffer(void* p, std::size_t bytes, std::shared_ptr<BufferPool> pool);
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  ~Buffer();

  void* data() const { return data_; }
  std::size_t bytes() const { return bytes_; }

  /// Marks a buffer handed to other devices' executors (a collective's shared output, a
  /// broadcast source). Such a buffer is never donated: its readers on other devices are
  /// not ordered with a donating write (a reference count seen at 1 is a relaxed read).
  /// Set before the buffer is published, so every later reader sees it.
  void mark_shared() noexcept { shared_.store(true, std::memory_order_relaxed); }
  /// Whether mark_shared() was called.
  bool shared() const noexcept { return shared_.load(std::memory_order_relaxed); }

 private:
  void* data_;
  std::size_t bytes_;
  std::atomic<bool> shared_{false};
  std::shared_ptr<BufferPool> pool_;
};

/// Pool statistics, for tests and metrics.
struct PoolStats {
  std::int64_t fresh_allocations = 0;  ///< blocks obtained from the system allocator
  std::int64_t fresh_bytes = 0;
  std::int64_t reuses = 0;  ///< blocks served from the free lists
  std::int64_t cached_bytes = 0;
};

/// Default bound of a pool's cached bytes: a quarter of the physical memory (4 GiB where
/// it cannot be read), or LAZYTENSOR_POOL_CACHE_BYTES (a whole number of bytes; 0 caches
/// nothing). A malformed value is an Error naming it.
std::size_t default_pool_cache_bytes();

/// Free lists keyed by exact padded size. Thread-safe.
///
/// A steady loop asks for the same sizes every step and finds them here. A program whose
/// shapes keep changing would leave a list behind for every size it ever used, so the
/// cached bytes are bounded (cache_limit()): past the bound, the lists of the sizes used
/// least recently go back to the system first.
class BufferPool : public std::enable_shared_from_this<BufferPool> {
 public:
  /// A pool caching at most `cache_limit` bytes of freed buffers.
  explicit BufferPool(std::size_t cache_limit = default_pool_cache_bytes());
  ~BufferPool();

  /// A buffer of at least `bytes` (already padded) bytes.
  std::shared_ptr<Buffer> acquire(std::size_t bytes);

  /// Takes back a buffer's memory: cached for reuse, or (past the cache limit) returned
  /// to the system along with the lists of the sizes used least recently.
  void release(void* p, std::size_t bytes);

  /// Returns every cached block to the system (what torch.cuda.empty_cache does).
  void empty_cache();

  /// Most bytes of freed buffers kept for reuse.
  std::size_t cache_limit() const;
  /// Changes the bound on cached bytes, returning what no longer fits to the system.
  void set_cache_limit(std::size_t bytes);

  PoolStats stats() const;

 private:
  struct SizeList {
    std::vector<void*> blocks;
    std::uint64_t used = 0;  // tick of the last acquire or release of this size
  };

  // Frees blocks until the cached bytes fit `limit`: whole lists of the least recently
  // used sizes first (the size just released is the most recent, so it goes last), and
  // drops the entries of sizes with no block left. Called with mu_ held: freeing under
  // the lock means a release (a destructor) never allocates. Eviction happens only while
  // shapes change, so the linear search for the oldest size costs a steady loop nothing.
  void evict_beyond(std::size_t limit);

  mutable std::mutex mu_;
  std::unordered_map<std::size_t, SizeList> free_;
  std::size_t limit_;
  std::uint64_t tick_ = 0;
  PoolStats stats_;
};

}  // namespace lazy

#if LAZYTENSOR_HEADER_DEFINITIONS
namespace lazy::detail {

LAZYTENSOR_INLINE bool huge_pages_wanted() {
  static const bool wanted = core::env_switch("LAZYTENSOR_HUGE_PAGES").value_or(true);
  return wanted;
}

LAZYTENSOR_INLINE std::uint64_t physical_memory_bytes() {
#if defined(_SC_PHYS_PAGES) && defined(_SC_PAGESIZE)
  const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGESIZE);
  return pages > 0 && page > 0 ? static_cast<std::uint64_t>(pages) * static_cast<std::uint64_t>(page) : 0;
#else
  return 0;
#endif
}

LAZYTENSOR_INLINE std::string byte_size_text(std::uint64_t bytes) {
  const char* units[] = {"bytes", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  double v = static_cast<double>(bytes);
  int u = 0;
  while (v >= 1024 && u < 6) v /= 1024, ++u;
  char text[64];
  const auto exact = static_cast<unsigned long long>(bytes);
  if (u == 0) std::snprintf(text, sizeof text, "%llu bytes", exact);
  else std::snprintf(text, sizeof text, "%.1f %s (%llu bytes)", v, units[u], exact);
  return text;
}

LAZYTENSOR_INLINE void check_fits_in_memory(std::uint64_t bytes, const std::string& what) {
  const std::uint64_t have = physical_memory_bytes();
  if (have && bytes > have) {
    throw OutOfMemoryError(what + " needs " + byte_size_text(bytes) + ", more than this machine's memory (" +
                           byte_size_text(have) + ")");
  }
}

LAZYTENSOR_INLINE void* allocate_buffer_memory(std::size_t bytes) {
  void* p = nullptr;
  try {
    p = ::operator new(bytes, std::align_val_t(buffer_alignment(bytes)));
  } catch (const std::bad_alloc&) {
    throw OutOfMemoryError("cannot allocate a buffer of " + byte_size_text(bytes));
  }
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  // Only whole huge pages inside the block: the advice must not reach memory we do not own.
  // A refusal (THP disabled, old kernel) only loses the speed-up, so the result is ignored.
  const std::size_t whole = bytes / kHugePageBytes * kHugePageBytes;
  if (whole > 0 && huge_pages_wanted()) (void)::madvise(p, whole, MADV_HUGEPAGE);
#endif
  return p;
}

}  // namespace lazy::detail
namespace lazy {

LAZYTENSOR_INLINE Buffer::Buffer(void* p, std::size_t bytes, std::shared_ptr<BufferPool> pool)
    : data_(p), bytes_(bytes), pool_(std::move(pool)) {}

LAZYTENSOR_INLINE std::size_t default_pool_cache_bytes() {
  static const std::size_t bytes = [] {
    if (const auto v = core::env_integer("LAZYTENSOR_POOL_CACHE_BYTES", 0, "bytes", "1073741824"))
      return static_cast<std::size_t>(*v);
#if defined(__linux__)
    const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGESIZE);
    if (pages > 0 && page > 0)
      return static_cast<std::size_t>(pages) * static_cast<std::size_t>(page) / 4;
#endif
    return std::size_t{4} << 30;
  }();
  return bytes;
}

LAZYTENSOR_INLINE BufferPool::BufferPool(std::size_t cache_limit) : limit_(cache_limit) {}

LAZYTENSOR_INLINE BufferPool::~BufferPool() { empty_cache(); }

LAZYTENSOR_INLINE std::shared_ptr<Buffer> BufferPool::acquire(std::size_t bytes) {
  void* p = nullptr;
  {
    std::lock_guard lock(mu_);
    auto it = free_.find(bytes);
    if (it != free_.end() && !it->second.blocks.empty()) {
      p = it->second.blocks.back();
      it->second.blocks.pop_back();
      it->second.used = ++tick_;
      stats_.reuses++;
      stats_.cached_bytes -= static_cast<std::int64_t>(bytes);
    } else {
      stats_.fresh_allocations++;
      stats_.fresh_bytes += static_cast<std::int64_t>(bytes);
    }
  }
  if (!p) {
    p = detail::allocate_buffer_memory(bytes);
  }
  try {
    return std::make_shared<Buffer>(p, bytes, shared_from_this());
  } catch (const std::bad_alloc&) {
    detail::free_buffer_memory(p, bytes);
    throw OutOfMemoryError("cannot allocate a buffer's control block");
  }
}

LAZYTENSOR_INLINE void BufferPool::release(void* p, std::size_t bytes) {
  {
    std::lock_guard lock(mu_);
    if (bytes <= limit_) {
      SizeList& list = free_[bytes];
      list.blocks.push_back(p);
      list.used = ++tick_;
      stats_.cached_bytes += static_cast<std::int64_t>(bytes);
      evict_beyond(limit_);
      return;
    }
  }
  detail::free_buffer_memory(p, bytes);  // larger than the whole cache
}

LAZYTENSOR_INLINE void BufferPool::empty_cache() {
  std::unordered_map<std::size_t, SizeList> lists;
  {
    std::lock_guard lock(mu_);
    lists.swap(free_);
    stats_.cached_bytes = 0;
  }
  for (auto& [bytes, list] : lists)
    for (void* p : list.blocks) detail::free_buffer_memory(p, bytes);
}

LAZYTENSOR_INLINE std::size_t BufferPool::cache_limit() const {
  std::lock_guard lock(mu_);
  return limit_;
}

LAZYTENSOR_INLINE void BufferPool::set_cache_limit(std::size_t bytes) {
  std::lock_guard lock(mu_);
  limit_ = bytes;
  evict_beyond(limit_);
}

LAZYTENSOR_INLINE PoolStats BufferPool::stats() const {
  std::lock_guard lock(mu_);
  return stats_;
}

LAZYTENSOR_INLINE void BufferPool::evict_beyond(std::size_t limit) {
  static auto& evictions = core::counter("PoolEvictedBytes");
  while (stats_.cached_bytes > static_cast<std::int64_t>(limit)) {
    auto victim = free_.end();
    for (auto it = free_.begin(); it != free_.end();) {
      if (it->second.blocks.empty()) {
        it = free_.erase(it);
        continue;
      }
      if (victim == free_.end() || it->second.used < victim->second.used) victim = it;
      ++it;
    }
    if (victim == free_.end()) break;
    const std::size_t bytes = victim->first;
    std::vector<void*>& blocks = victim->second.blocks;
    while (!blocks.empty() && stats_.cached_bytes > static_cast<std::int64_t>(limit)) {
      detail::free_buffer_memory(blocks.back(), bytes);
      blocks.pop_back();
      stats_.cached_bytes -= static_cast<std::int64_t>(bytes);
      evictions.add(static_cast<std::int64_t>(bytes));
    }
    if (blocks.empty()) free_.erase(victim);
  }
}

LAZYTENSOR_INLINE Buffer::~Buffer() {
  if (pool_) {
    pool_->release(data_, bytes_);
  } else {
    detail::free_buffer_memory(data_, bytes_);
  }
}

}  // namespace lazy
#endif  // LAZYTENSOR_HEADER_DEFINITIONS
// ---- end lazytensor/core/buffer.hpp ----
// ---- begin lazytensor/core/thread_pool.hpp ----

// Fork-join worker pool: a kernel splits its work into tasks, the calling thread takes part,
// and the call returns when every task is done. Nested calls run inline.
//
// Workers spin briefly before sleeping, and so does the caller waiting for the last task:
// the kernels of one mark_step come back to back, and a condition-variable round trip
// costs more than a small kernel.

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <type_traits>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#if defined(__SSE2__)
#include <immintrin.h>
#endif

namespace lazy {

/// A fixed set of worker threads running fork-join loops.
class ThreadPool {
 public:
  /// `threads` counts the caller: 1 means no worker threads at all.
  explicit ThreadPool(int threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  /// Number of threads a parallel loop uses, the caller included.
  int size() const { return threads_; }

  /// Changes the thread count; must not be called while a loop runs.
  void resize(int threads);

  /// Runs fn(task) for task in [0, tasks); returns when all have run. The first exception
  /// thrown by a task is re-thrown here after the others finished.
  template <class F>
  void parallel_for(std::int64_t tasks, F&& fn) {
    if (tasks <= 0) return;
    if (tasks == 1 || threads_ == 1 || in_worker()) {
      for (std::int64_t t = 0; t < tasks; ++t) fn(t);
      return;
    }
    // Everything below is the same for every loop body: one copy, not one per kernel.
    run_job(tasks, TaskRef{&fn, [](void* f, std::int64_t t) { (*static_cast<std::remove_reference_t<F>*>(f))(t); }});
  }

 private:
  // A non-owning reference to the caller's loop body: no allocation per parallel loop.
  struct TaskRef {
    void* fn = nullptr;
    void (*call)(void*, std::int64_t) = nullptr;
  };

  void run_job(std::int64_t tasks, TaskRef job);

  static constexpr int kSpin = 2000;  // some tens of microseconds of pause instructions

  static void pause() {
#if defined(__SSE2__)
    _mm_pause();
#else
    std::this_thread::yield();
#endif
  }

  static bool& in_worker() {
    thread_local bool flag = false;
    return flag;
  }

  bool finished() const {
    return pending_.load(std::memory_order_acquire) == 0 && active_.load(std::memory_order_acquire) == 0;
  }

  void drain();

  void worker_loop(std::uint64_t seen);

  void stop();

  int threads_ = 1;
  std::vector<std::thread> workers_;
  std::mutex submit_mu_;
  std::mutex mu_;
  std::condition_variable cv_, done_cv_;
  TaskRef job_;                                             // guarded by mu_
  std::int64_t tasks_ = 0;                                  // guarded by mu_
  std::exception_ptr error_;                                // guarded by mu_
  int sleepers_ = 0;                                        // guarded by mu_
  std::atomic<std::int64_t> next_{0};
  std::atomic<std::int64_t> pending_{0};
  std::atomic<int> active_{0};
  std::atomic<std::uint64_t> generation_{0};
  std::atomic<bool> stopping_{false};
};

}  // namespace lazy

#if LAZYTENSOR_HEADER_DEFINITIONS
namespace lazy {

LAZYTENSOR_INLINE ThreadPool::ThreadPool(int threads) { resize(threads); }

LAZYTENSOR_INLINE ThreadPool::~ThreadPool() { stop(); }

LAZYTENSOR_INLINE void ThreadPool::resize(int threads) {
  stop();
  threads_ = std::max(1, threads);
  stopping_.store(false);
  // Workers start from the generation current now, not when they first run: a loop
  // submitted before a new worker got scheduled must not be skipped by it.
  const std::uint64_t start = generation_.load();
  for (int i = 1; i < threads_; ++i) workers_.emplace_back([this, start] { worker_loop(start); });
}

LAZYTENSOR_INLINE void ThreadPool::run_job(std::int64_t tasks, TaskRef job) {
  std::lock_guard submit(submit_mu_);
  bool wake = false;
  {
    std::lock_guard lock(mu_);
    job_ = job;
    tasks_ = tasks;
    next_.store(0);
    pending_.store(tasks);
    error_ = nullptr;
    generation_.fetch_add(1, std::memory_order_release);
    wake = sleepers_ > 0;
  }
  if (wake) cv_.notify_all();
  in_worker() = true;
  drain();
  in_worker() = false;
  for (int spin = 0; spin < kSpin && !finished(); ++spin) pause();
  std::unique_lock lock(mu_);
  done_cv_.wait(lock, [&] { return finished(); });
  job_ = {};
  if (error_) std::rethrow_exception(std::exchange(error_, nullptr));
}

LAZYTENSOR_INLINE void ThreadPool::drain() {
  TaskRef job;
  std::int64_t tasks;
  {
    std::lock_guard lock(mu_);
    if (!job_.fn) return;
    job = job_;
    tasks = tasks_;
    active_.fetch_add(1);  // the submitter may not return while we hold its job
  }
  std::int64_t done = 0;
  for (std::int64_t t; (t = next_.fetch_add(1)) < tasks;) {
    try {
      job.call(job.fn, t);
    } catch (...) {
      std::lock_guard lock(mu_);
      if (!error_) error_ = std::current_exception();
    }
    ++done;
  }
  std::lock_guard lock(mu_);
  pending_.fetch_sub(done, std::memory_order_acq_rel);
  active_.fetch_sub(1, std::memory_order_acq_rel);
  if (finished()) done_cv_.notify_all();
}

LAZYTENSOR_INLINE void ThreadPool::worker_loop(std::uint64_t seen) {
  in_worker() = true;
  for (;;) {
    bool ready = false;
    for (int spin = 0; spin < kSpin; ++spin) {
      if (stopping_.load(std::memory_order_acquire)) return;
      if (generation_.load(std::memory_order_acquire) != seen) {
        ready = true;
        break;
      }
      pause();
    }
    if (!ready) {
      std::unique_lock lock(mu_);
      ++sleepers_;
      cv_.wait(lock, [&] { return stopping_.load() || generation_.load() != seen; });
      --sleepers_;
      if (stopping_.load()) return;
    }
    seen = generation_.load(std::memory_order_acquire);
    drain();
  }
}

LAZYTENSOR_INLINE void ThreadPool::stop() {
  {
    std::lock_guard lock(mu_);
    stopping_.store(true);
  }
  cv_.notify_all();
  for (auto& w : workers_) w.join();
  workers_.clear();
}

}  // namespace lazy
#endif  // LAZYTENSOR_HEADER_DEFINITIONS
// ---- end lazytensor/core/thread_pool.hpp ----
// ---- begin lazytensor/graph/plan_cache.hpp ----
// A device's cache of execution plans, by structural hash, bounded like PyTorch/XLA's
// compilation cache (XLA_COMPILATION_CACHE_SIZE): a program whose graph keeps changing
// (a new shape every step) would otherwise keep every plan it ever built. The least
// recently used plan goes first, so the few graphs a training loop repeats stay.

#include <cstddef>
#include <cstdint>
#include <list>
#include <memory>
#include <unordered_map>
#include <utility>


namespace lazy::graph {

struct Plan;

/// Plans kept per device by default, as PyTorch/XLA's default compilation cache size.
inline constexpr std::size_t kDefaultPlanCacheSize = 1024;

/// The plan cache capacity: LAZYTENSOR_PLAN_CACHE_SIZE (a whole number >= 1), else
/// kDefaultPlanCacheSize. A malformed value is an Error naming it.
std::size_t env_plan_cache_size();

/// Plans by structural hash, at most capacity() of them, least recently used evicted
/// first. Used by the device's tracing thread only (not synchronized).
class PlanCache {
 public:
  using PlanPtr = std::shared_ptr<const Plan>;

  /// An empty cache holding at most `capacity` plans (at least one).
  explicit PlanCache(std::size_t capacity = env_plan_cache_size());

  /// The plan stored under `hash` (now the most recently used), or null.
  PlanPtr find(std::uint64_t hash);

  /// Stores `plan` under `hash` (replacing a plan stored there), evicting the least
  /// recently used plans beyond capacity().
  void insert(std::uint64_t hash, PlanPtr plan);

  /// Plans stored.
  std::size_t size() const { return index_.size(); }
  /// Most plans kept.
  std::size_t capacity() const { return capacity_; }
  /// Changes the capacity (at least one), evicting what no longer fits.
  void set_capacity(std::size_t capacity);
  /// Drops every plan.
  void clear();

 private:
  void trim();

  std::size_t capacity_;
  std::list<std::pair<std::uint64_t, PlanPtr>> order_;  // most recently used first
  std::unordered_map<std::uint64_t, std::list<std::pair<std::uint64_t, PlanPtr>>::iterator> index_;
};

}  // namespace lazy::graph

#if LAZYTENSOR_HEADER_DEFINITIONS
namespace lazy::graph {

LAZYTENSOR_INLINE std::size_t env_plan_cache_size() {
  const auto v = core::env_integer("LAZYTENSOR_PLAN_CACHE_SIZE", 1, "plans", "1024");
  return v ? static_cast<std::size_t>(*v) : kDefaultPlanCacheSize;
}

LAZYTENSOR_INLINE PlanCache::PlanCache(std::size_t capacity)
    : capacity_(capacity ? capacity : 1) {}

LAZYTENSOR_INLINE auto PlanCache::find(std::uint64_t hash) -> PlanPtr {
  const auto it = index_.find(hash);
  if (it == index_.end()) return nullptr;
  order_.splice(order_.begin(), order_, it->second);  // no allocation on a hit
  return it->second->second;
}

LAZYTENSOR_INLINE void PlanCache::insert(std::uint64_t hash, PlanPtr plan) {
  if (const auto it = index_.find(hash); it != index_.end()) {
    it->second->second = std::move(plan);
    order_.splice(order_.begin(), order_, it->second);
    return;
  }
  order_.emplace_front(hash, std::move(plan));
  index_.emplace(hash, order_.begin());
  trim();
}

LAZYTENSOR_INLINE void PlanCache::set_capacity(std::size_t capacity) {
  capacity_ = capacity ? capacity : 1;
  trim();
}

LAZYTENSOR_INLINE void PlanCache::clear() {
  index_.clear();
  order_.clear();
}

LAZYTENSOR_INLINE void PlanCache::trim() {
  static auto& evictions = core::counter("PlanCacheEvictions");
  while (index_.size() > capacity_) {
    index_.erase(order_.back().first);
    order_.pop_back();
    evictions.add();
  }
}

}  // namespace lazy::graph
#endif  // LAZYTENSOR_HEADER_DEFINITIONS
// ---- end lazytensor/graph/plan_cache.hpp ----
// ---- begin lazytensor/graph/tensor_impl.hpp ----
// The object every copy of a Tensor handle shares. In-place ops rebind `node`, so all
// copies see the new value (functionalization, as in libtorch/XLA).

#include <cstddef>
#include <memory>
#include <mutex>
#include <vector>

// ---- begin lazytensor/graph/node.hpp ----
// Runtime graph nodes. A node is a type-erased kernel plus its inputs; once computed it
// keeps only its buffer and drops its inputs, so the graph behind it can be freed.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

// ---- begin lazytensor/core/dtype.hpp ----
// Element types and PyTorch's type promotion rules.

#include <cstddef>
#include <cstdint>
#include <string>
#include <tuple>
#include <type_traits>


namespace lazy {

/// Runtime tag of a tensor's element type.
enum class DType { Bool, Int32, Int64, BFloat16, Float32, Float64 };

/// True for the element types a Tensor may hold.
template <class T>
inline constexpr bool is_element_v =
    std::is_same_v<T, bool> || std::is_same_v<T, std::int32_t> || std::is_same_v<T, std::int64_t> ||
    std::is_same_v<T, bfloat16> || std::is_same_v<T, float> || std::is_same_v<T, double>;

/// Constrains templates to the supported element types.
template <class T>
concept Element = is_element_v<T>;

/// Element types accepted for index tensors (index_select, gather, one_hot, targets).
template <class I>
concept IndexElement = std::is_same_v<I, std::int32_t> || std::is_same_v<I, std::int64_t>;

template <Element T>
constexpr DType dtype_of() {
  if constexpr (std::is_same_v<T, bool>) return DType::Bool;
  else if constexpr (std::is_same_v<T, std::int32_t>) return DType::Int32;
  else if constexpr (std::is_same_v<T, std::int64_t>) return DType::Int64;
  else if constexpr (std::is_same_v<T, bfloat16>) return DType::BFloat16;
  else if constexpr (std::is_same_v<T, float>) return DType::Float32;
  else return DType::Float64;
}

/// Bytes per element.
constexpr std::size_t dtype_size(DType d) {
  switch (d) {
    case DType::Bool: return 1;
    case DType::Int32: return 4;
    case DType::Int64: return 8;
    case DType::BFloat16: return 2;
    case DType::Float32: return 4;
    case DType::Float64: return 8;
  }
  return 0;
}

/// PyTorch-style name ("float32", "int64", ...).
std::string dtype_name(DType d);

template <class T>
inline constexpr bool is_floating_v =
    std::is_same_v<T, float> || std::is_same_v<T, double> || std::is_same_v<T, bfloat16>;
/// True for the floating dtypes (bfloat16, float32, float64): is_floating_v at run time.
constexpr bool is_floating(DType d) { return d == DType::BFloat16 || d == DType::Float32 || d == DType::Float64; }

/// Constrains templates to bfloat16, float and double.
template <class T>
concept FloatingElement = Element<T> && is_floating_v<T>;

template <class T>
inline constexpr bool is_integral_v = std::is_same_v<T, std::int32_t> || std::is_same_v<T, std::int64_t>;

namespace detail {
// Rank inside a category decides promotion: bool < int32 < int64 < bfloat16 < float < double.
template <class T>
constexpr int type_rank() {
  return static_cast<int>(dtype_of<T>());
}
template <int R>
using type_of_rank = std::tuple_element_t<
    R, std::tuple<bool, std::int32_t, std::int64_t, bfloat16, float, double>>;
}  // namespace detail

/// Result type of a binary op between two tensors (PyTorch's promote_types).
template <Element A, Element B>
using promote_t = detail::type_of_rank<(detail::type_rank<A>() > detail::type_rank<B>())
                                           ? detail::type_rank<A>()
                                           : detail::type_rank<B>()>;

/// Result type of floating-only ops (exp, /, ...): integral and bool become float.
template <Element T>
using to_floating_t = std::conditional_t<is_floating_v<T>, T, float>;

/// Type a C++ scalar takes next to a tensor of type T (PyTorch's weak scalars): it adopts
/// T unless its category (bool < integral < floating) is higher. A bfloat16 scalar counts
/// as floating.
template <Element T, class S>
using weak_scalar_t = std::conditional_t<
    std::is_floating_point_v<S> || std::is_same_v<S, bfloat16>, std::conditional_t<is_floating_v<T>, T, float>,
    std::conditional_t<std::is_same_v<S, bool>, T,
                       std::conditional_t<std::is_same_v<T, bool>, std::int64_t, T>>>;

/// Type in which a kernel computes values of type T (bfloat16 computes in float).
template <Element T>
using compute_t = std::conditional_t<std::is_same_v<T, bfloat16>, float, T>;

}  // namespace lazy

#if LAZYTENSOR_HEADER_DEFINITIONS
namespace lazy {

LAZYTENSOR_INLINE std::string dtype_name(DType d) {
  switch (d) {
    case DType::Bool: return "bool";
    case DType::Int32: return "int32";
    case DType::Int64: return "int64";
    case DType::BFloat16: return "bfloat16";
    case DType::Float32: return "float32";
    case DType::Float64: return "float64";
  }
  return "?";
}

}  // namespace lazy
#endif  // LAZYTENSOR_HEADER_DEFINITIONS
// ---- end lazytensor/core/dtype.hpp ----
// ---- begin lazytensor/core/shape.hpp ----
// Shapes (rank 0..8, row-major) and NumPy broadcasting.

#include <algorithm>
#include <array>
#include <cstdint>
#include <initializer_list>
#include <span>
#include <string>
#include <vector>


namespace lazy {

/// Maximum tensor rank.
inline constexpr int kMaxRank = 8;

/// The largest product of a shape's non-zero sizes (2^60). Every shape keeps its non-zero
/// sizes' product at or below it, so an element count and any stride fit in int64, and any
/// byte size (elements up to 8 bytes, padded) in std::size_t, however they are multiplied,
/// even for a zero-sized shape whose other sizes are huge.
inline constexpr std::int64_t kMaxElements = std::int64_t{1} << 60;

/// A tensor's dimensions. Value type, fixed capacity, no allocation.
class Shape {
 public:
  Shape() = default;
  /// Builds a shape from its sizes; throws ShapeError on negative sizes, rank > 8, or sizes
  /// whose non-zero product exceeds kMaxElements.
  Shape(std::initializer_list<std::int64_t> dims) { assign(dims.begin(), dims.end()); }
  explicit Shape(std::span<const std::int64_t> dims) { assign(dims.begin(), dims.end()); }
  explicit Shape(const std::vector<std::int64_t>& dims) { assign(dims.begin(), dims.end()); }

  int rank() const { return rank_; }
  std::int64_t operator[](int i) const { return dims_[i]; }
  std::int64_t& operator[](int i) { return dims_[i]; }
  const std::int64_t* begin() const { return dims_.data(); }
  const std::int64_t* end() const { return dims_.data() + rank_; }

  /// Number of elements (1 for rank 0).
  std::int64_t numel() const {
    std::int64_t n = 1;
    for (int i = 0; i < rank_; ++i) n *= dims_[i];
    return n;
  }

  /// Size of dimension d, negative d counting from the back.
  std::int64_t size(int d) const;

  std::vector<std::int64_t> vec() const { return {begin(), end()}; }

  /// Appends a dimension (checked as the constructors check).
  void push_back(std::int64_t d) {
    if (rank_ == kMaxRank) throw ShapeError("rank exceeds the maximum of 8");
    if (d < 0) throw ShapeError("negative dimension " + std::to_string(d) + " in shape");
    Shape grown = *this;  // checked before this shape changes: a refused size leaves it intact
    grown.dims_[grown.rank_++] = d;
    grown.check_size();
    *this = grown;
  }

  /// Throws ShapeError when the product of the non-zero sizes exceeds kMaxElements. The
  /// constructors and push_back call it; code that grows a size through operator[] (cat,
  /// index_select) calls it after.
  void check_size() const {
    std::int64_t p = 1;
    for (int i = 0; i < rank_; ++i) {
      if (dims_[i] == 0) continue;
      if (__builtin_mul_overflow(p, dims_[i], &p) || p > kMaxElements) too_large();
    }
  }

  /// "(2, 3)" as PyTorch prints sizes; "()" for a scalar.
  std::string str() const;

  friend bool operator==(const Shape& a, const Shape& b) {
    return a.rank_ == b.rank_ && std::equal(a.begin(), a.end(), b.begin());
  }

 private:
  template <class It>
  void assign(It first, It last) {
    const auto n = std::distance(first, last);
    if (n > kMaxRank) {
      throw ShapeError("rank " + std::to_string(n) + " exceeds the maximum of 8");
    }
    rank_ = static_cast<int>(n);
    int i = 0;
    for (; first != last; ++first, ++i) {
      if (*first < 0) throw ShapeError("negative dimension " + std::to_string(*first) + " in shape");
      dims_[i] = *first;
    }
    check_size();
  }

  [[noreturn]] void too_large() const;

  std::array<std::int64_t, kMaxRank> dims_{};
  int rank_ = 0;
};

/// Normalizes a possibly negative dimension index for a tensor of the given rank; `op` names
/// the caller in the error. A rank-0 tensor accepts -1 and 0 as PyTorch does.
int normalize_dim(std::int64_t dim, int rank, const char* op);

inline std::int64_t Shape::size(int d) const { return dims_[normalize_dim(d, rank_, "size")]; }

/// Row-major strides of a shape, in elements.
std::array<std::int64_t, kMaxRank> contiguous_strides(const Shape& s);

/// NumPy broadcast of two shapes; throws ShapeError naming both shapes and the op.
Shape broadcast_shapes(const Shape& a, const Shape& b, const char* op);

/// True when `from` broadcasts to `to` (NumPy rules, `to` unchanged).
bool broadcastable_to(const Shape& from, const Shape& to);

}  // namespace lazy

#if LAZYTENSOR_HEADER_DEFINITIONS
namespace lazy {

LAZYTENSOR_INLINE void Shape::too_large() const {
  throw ShapeError("shape " + str() + " has too many elements (the product of its non-zero sizes exceeds 2^60)");
}

LAZYTENSOR_INLINE std::string Shape::str() const {
  std::string s = "(";
  for (int i = 0; i < rank_; ++i) {
    if (i) s += ", ";
    s += std::to_string(dims_[i]);
  }
  if (rank_ == 1) s += ",";
  return s + ")";
}

LAZYTENSOR_INLINE int normalize_dim(std::int64_t dim, int rank, const char* op) {
  const int r = std::max(rank, 1);
  if (dim < -r || dim >= r) {
    throw ShapeError(std::string(op) + ": dimension out of range (expected to be in range of [" +
                     std::to_string(-r) + ", " + std::to_string(r - 1) + "], but got " +
                     std::to_string(dim) + ")");
  }
  return static_cast<int>(dim < 0 ? dim + r : dim);
}

LAZYTENSOR_INLINE std::array<std::int64_t, kMaxRank> contiguous_strides(const Shape& s) {
  std::array<std::int64_t, kMaxRank> st{};
  std::int64_t acc = 1;
  for (int i = s.rank() - 1; i >= 0; --i) {
    st[i] = acc;
    acc *= s[i];
  }
  return st;
}

LAZYTENSOR_INLINE Shape broadcast_shapes(const Shape& a, const Shape& b, const char* op) {
  if (a == b) return a;
  const int r = std::max(a.rank(), b.rank());
  std::array<std::int64_t, kMaxRank> out{};
  for (int i = 0; i < r; ++i) {
    const int ia = i - (r - a.rank()), ib = i - (r - b.rank());
    const std::int64_t da = ia >= 0 ? a[ia] : 1, db = ib >= 0 ? b[ib] : 1;
    if (da != db && da != 1 && db != 1) {
      throw ShapeError(std::string(op) + ": shapes " + a.str() + " and " + b.str() +
                       " are not broadcastable (dimension " + std::to_string(i) + ": " +
                       std::to_string(da) + " vs " + std::to_string(db) + ")");
    }
    out[i] = da == 1 ? db : da;
  }
  return Shape(std::span<const std::int64_t>(out.data(), static_cast<std::size_t>(r)));  // checks the size once
}

LAZYTENSOR_INLINE bool broadcastable_to(const Shape& from, const Shape& to) {
  if (from.rank() > to.rank()) return false;
  const int off = to.rank() - from.rank();
  for (int i = 0; i < from.rank(); ++i) {
    if (from[i] != 1 && from[i] != to[i + off]) return false;
  }
  return true;
}

}  // namespace lazy
#endif  // LAZYTENSOR_HEADER_DEFINITIONS
// ---- end lazytensor/core/shape.hpp ----

namespace lazy::graph {

class Device;
class Node;
using NodePtr = std::shared_ptr<Node>;

/// What a node's kernel does, for the planner and for graph dumps.
/// `Sharded`: the whole value of a tensor sharded over a mesh (lazy::spmd), whose pieces are
/// nodes on the mesh's devices; it is never traced or planned, only read (which gathers).
enum class NodeKind { Data, Elementwise, Reduction, Gemm, View, Copy, Random, Host, Collective, Sharded };

/// Execution context handed to a kernel.
struct ExecContext {
  Device& device;
};

/// How a node computes block by block (read by the SPMD partitioner, lazy::spmd): for each
/// output dimension, whether a block along it can be computed alone (`splittable`), and for
/// each input the dimension of that input that has the output dimension's size and is cut
/// into the same blocks (`input_dim[input][output dim]`, -1: every block reads that input
/// whole along it, e.g. a broadcast). An input dimension no splittable output dimension
/// names must be whole in every block.
struct BlockRule {
  std::vector<bool> splittable;
  std::vector<std::vector<int>> input_dim;
};

/// A value in the pending graph of one device.
class Node {
 public:
  Node(NodeKind kind, DType dtype, Shape shape, Device* device, std::vector<NodePtr> inputs = {});
  virtual ~Node() { release_chain(inputs_); }
  Node(const Node&) = delete;
  Node& operator=(const Node&) = delete;

  NodeKind kind() const { return kind_; }
  DType dtype() const { return dtype_; }
  const Shape& shape() const { return shape_; }
  std::int64_t numel() const { return shape_.numel(); }
  Device* device() const { return device_; }
  std::uint64_t id() const { return id_; }
  const std::vector<NodePtr>& inputs() const { return inputs_; }

  /// Lifecycle: Pending (being traced; only the tracing thread touches it), Queued (handed
  /// to an execution plan: the tracing thread may hold it as an input but must not look
  /// inside), Ready (the buffer is set and immutable). Set with release, read with acquire,
  /// so a Ready node's buffer is visible to whoever sees the state.
  enum class State : std::uint8_t { Pending, Queued, Ready };
  State state() const { return state_.load(std::memory_order_acquire); }
  void set_state(State s) { state_.store(s, std::memory_order_release); }
  /// True while the node is still being traced: its inputs and kernel may be inspected.
  bool pending() const { return state() == State::Pending; }
  /// True once the value exists in a buffer.
  bool materialized() const { return state() == State::Ready; }
  const std::shared_ptr<Buffer>& buffer() const { return buffer_; }
  template <class T>
  const T* data() const {
    return static_cast<const T*>(buffer_->data());
  }

  /// Short op name ("add", "matmul", ...).
  virtual std::string op_name() const = 0;
  /// Longer description for graph dumps (the fused expression, reduction dims, ...).
  virtual std::string describe() const { return op_name(); }
  /// Hash of everything that determines the kernel's code and layout, but not its data
  /// (cached: a node's structure never changes).
  std::uint64_t hash() const;
  /// Computes the structural hash (override to add kernel parameters).
  virtual std::uint64_t structural_hash() const;
  /// Estimated cost per output element (1 = one add), used to decide threading.
  virtual double cost_per_element() const { return 1.0; }

  /// The node's block rule, or nullopt when it has none (the partitioner then gathers).
  virtual std::optional<BlockRule> block_rule() const { return std::nullopt; }
  /// The same kernel over `inputs` (blocks of this node's inputs as its block rule cuts
  /// them), producing `shape` on `device`, not yet submitted. Null without a block rule.
  virtual std::shared_ptr<Node> with_inputs(std::vector<std::shared_ptr<Node>> inputs, Shape shape,
                                            Device* device) const {
    (void)inputs, (void)shape, (void)device;
    return nullptr;
  }

  /// Computes the value into a buffer. Called once, after every input is materialized.
  void run(ExecContext& ctx);

  /// Ends a run from outside: the value is `buf` (or, without one, it lived only in a fused
  /// group's scratch and nothing can read it), and the inputs are released.
  void finish_with(std::shared_ptr<Buffer> buf);

  /// Planner hook, called once per plan before execution, while the plan holds one extra
  /// reference to every node in it: a node may take over (defer) a producer's work, e.g. an
  /// element-wise epilogue running a GEMM in row blocks.
  virtual void fuse_producers() {}
  /// True when a consumer has taken over this node's computation for the current plan.
  bool deferred() const { return deferred_; }
  void set_deferred(bool d) { deferred_ = d; }

  /// Makes this node a materialized value holding `buf` (used by data nodes and views).
  void set_buffer(std::shared_ptr<Buffer> buf);

  /// The planner's scratch: this node's position in the plan being built (valid while
  /// `plan_epoch` matches the planner's epoch). Touched by the planning thread only.
  std::int32_t plan_slot = -1;
  std::uint64_t plan_epoch = 0;

  /// Steals the buffer of input `i` when nothing else can observe it (buffer donation):
  /// this node is the input's only holder, the input's buffer is not shared (views), and
  /// the input has this node's dtype and element count.
  std::shared_ptr<Buffer> try_donate(std::size_t i);

  /// Donation to a fused group: takes the buffer of materialized `n` when exactly
  /// `holders` references to it exist (all held by the group's members, which read it at
  /// the positions they write) and no view shares the buffer. Else null.
  static std::shared_ptr<Buffer> take_buffer(const NodePtr& n, long holders);

 protected:
  virtual void compute(ExecContext& ctx) = 0;
  /// Drops the kernel's inputs and state after it ran.
  virtual void finish() { inputs_.clear(); }
  /// Allocates this node's output from the device pool, or takes a donated input buffer.
  std::shared_ptr<Buffer> allocate_output(ExecContext& ctx, bool allow_donation = true);

  std::vector<NodePtr>& mutable_inputs() { return inputs_; }

 private:
  /// Drops input references without recursion: a long pending chain (`a = a + 1` repeated
  /// 10^5 times, never computed) would otherwise be freed by nested destructor calls and
  /// overflow the stack. The outermost call drains a worklist; nested ones append to it.
  static void release_chain(std::vector<NodePtr>& inputs) noexcept;

  static std::uint64_t next_id();

  NodeKind kind_;
  DType dtype_;
  Shape shape_;
  Device* device_;
  std::vector<NodePtr> inputs_;
  std::shared_ptr<Buffer> buffer_;
  std::uint64_t id_;
  std::atomic<State> state_{State::Pending};
  bool deferred_ = false;
  mutable bool hash_valid_ = false;
  mutable std::uint64_t hash_ = 0;
};

/// A value that already exists (factories, reads from host memory, computed results).
class DataNode final : public Node {
 public:
  DataNode(DType dtype, Shape shape, Device* device, std::shared_ptr<Buffer> buf);
  std::string op_name() const override { return "data"; }

 protected:
  void compute(ExecContext&) override {}
};

/// The block rule of an op whose output dimension o reads dimension o - (rank - input rank)
/// of each input (dimensions aligned right, NumPy broadcasting), a size-1 input dimension
/// being read whole: element-wise kernels, conversions.
BlockRule aligned_block_rule(const Shape& out, const std::vector<NodePtr>& inputs);

/// Combines hashes (boost::hash_combine's mixing).
inline std::uint64_t hash_combine(std::uint64_t seed, std::uint64_t v) {
  return seed ^ (v + 0x9e3779b97f4a7c15ull + (seed << 6) + (seed >> 2));
}

std::uint64_t hash_shape(const Shape& s);

}  // namespace lazy::graph

#if LAZYTENSOR_HEADER_DEFINITIONS
namespace lazy::graph {

LAZYTENSOR_INLINE Node::Node(NodeKind kind, DType dtype, Shape shape, Device* device, std::vector<NodePtr> inputs)
    : kind_(kind), dtype_(dtype), shape_(shape), device_(device), inputs_(std::move(inputs)),
      id_(next_id()) {}

LAZYTENSOR_INLINE std::uint64_t Node::hash() const {
  if (!hash_valid_) {
    hash_ = structural_hash();
    hash_valid_ = true;
  }
  return hash_;
}

LAZYTENSOR_INLINE void Node::run(ExecContext& ctx) {
  compute(ctx);
  finish();
}

LAZYTENSOR_INLINE void Node::finish_with(std::shared_ptr<Buffer> buf) {
  if (buf) set_buffer(std::move(buf));
  else set_state(State::Ready);
  finish();
}

LAZYTENSOR_INLINE void Node::set_buffer(std::shared_ptr<Buffer> buf) {
  buffer_ = std::move(buf);
  set_state(State::Ready);
}

LAZYTENSOR_INLINE std::shared_ptr<Buffer> Node::take_buffer(const NodePtr& n, long holders) {
  if (!n->materialized() || !n->buffer_ || n.use_count() != holders || n->buffer_.use_count() != 1 ||
      n->buffer_->shared())
    return nullptr;
  return std::move(n->buffer_);
}

LAZYTENSOR_INLINE void Node::release_chain(std::vector<NodePtr>& inputs) noexcept {
  thread_local std::vector<NodePtr>* worklist = nullptr;
  if (worklist) {
    for (auto& p : inputs) worklist->push_back(std::move(p));
    inputs.clear();
    return;
  }
  std::vector<NodePtr> work = std::move(inputs);
  inputs.clear();
  worklist = &work;
  while (!work.empty()) {
    NodePtr n = std::move(work.back());
    work.pop_back();
    n.reset();  // a node destroyed here appends its own inputs to `work`
  }
  worklist = nullptr;
}

LAZYTENSOR_INLINE std::uint64_t Node::next_id() {
  static std::atomic<std::uint64_t> n{0};
  return ++n;
}

LAZYTENSOR_INLINE DataNode::DataNode(DType dtype, Shape shape, Device* device, std::shared_ptr<Buffer> buf)
    : Node(NodeKind::Data, dtype, shape, device) {
  set_buffer(std::move(buf));
}

LAZYTENSOR_INLINE BlockRule aligned_block_rule(const Shape& out, const std::vector<NodePtr>& inputs) {
  const int rank = out.rank();
  BlockRule r{std::vector<bool>(static_cast<std::size_t>(rank), true), {}};
  for (const auto& in : inputs) {
    const int off = rank - in->shape().rank();
    std::vector<int> map(static_cast<std::size_t>(rank), -1);
    for (int o = std::max(off, 0); o < rank; ++o)
      if (in->shape()[o - off] == out[o]) map[static_cast<std::size_t>(o)] = o - off;
    r.input_dim.push_back(std::move(map));
  }
  return r;
}

LAZYTENSOR_INLINE std::uint64_t hash_shape(const Shape& s) {
  std::uint64_t h = static_cast<std::uint64_t>(s.rank());
  for (auto d : s) h = hash_combine(h, static_cast<std::uint64_t>(d));
  return h;
}

LAZYTENSOR_INLINE std::uint64_t Node::structural_hash() const {
  std::uint64_t h = hash_combine(static_cast<std::uint64_t>(kind_), static_cast<std::uint64_t>(dtype_));
  h = hash_combine(h, hash_shape(shape_));
  for (const auto& in : inputs_) {
    h = hash_combine(h, static_cast<std::uint64_t>(in->dtype()));
    h = hash_combine(h, hash_shape(in->shape()));
  }
  return hash_combine(h, std::hash<std::string>{}(op_name()));
}

LAZYTENSOR_INLINE std::shared_ptr<Buffer> Node::try_donate(std::size_t i) {
  const NodePtr& in = inputs_[i];
  if (in->dtype() != dtype_ || in->numel() != numel()) return nullptr;
  long holders = 0;
  for (const auto& p : inputs_) holders += (p == in);
  return take_buffer(in, holders);
}

}  // namespace lazy::graph
#endif  // LAZYTENSOR_HEADER_DEFINITIONS
// ---- end lazytensor/graph/node.hpp ----

namespace lazy::autograd {
class GradFn;
}  // namespace lazy::autograd

namespace lazy::graph {

class HandleRegistry;
struct TensorImpl;

/// Per-tensor autograd state, allocated only for tensors that take part in autograd. Plain
/// data held by the tensor object; autograd/ (which calls it autograd::AutogradMeta) gives
/// it its meaning.
struct AutogradState {
  bool requires_grad = false;
  /// The function that produced this value (nullptr for leaves).
  std::shared_ptr<autograd::GradFn> grad_fn;
  /// A leaf's AccumulateGrad, shared by every expression that reads the leaf.
  std::weak_ptr<autograd::GradFn> accumulator;
  /// The accumulated gradient (leaves, or non-leaves with retain_grad()), as a tensor
  /// object of its own so that `p.grad()` handles can update it in place.
  std::shared_ptr<TensorImpl> grad;
  bool retains_grad = false;
};

/// Shared state behind a tensor handle.
struct TensorImpl {
  explicit TensorImpl(NodePtr n) : node(std::move(n)) {}
  ~TensorImpl();
  TensorImpl(const TensorImpl&) = delete;
  TensorImpl& operator=(const TensorImpl&) = delete;
  NodePtr node;
  /// Autograd state; null for tensors that never took part in autograd.
  std::unique_ptr<AutogradState> autograd;

  /// The autograd state, created on first use.
  AutogradState& autograd_meta();
  /// True when gradients flow into this tensor.
  bool requires_grad() const { return autograd && autograd->requires_grad; }

  /// The registry listing this handle (Device::register_handle), and its slot there.
  std::shared_ptr<HandleRegistry> registry;
  std::size_t registry_slot = 0;
};

/// The live handles of a device, so mark_step can find the pending values still wanted.
/// A handle adds itself when registered and removes itself when destroyed (O(1) each), so
/// a step looks at live handles only. Shared by the device and its handles: a handle that
/// outlives its device (a static tensor at exit) still finds the registry.
class HandleRegistry {
 public:
  void add(TensorImpl* impl);
  void remove(TensorImpl* impl);
  /// Calls f(impl) for every live handle; handles cannot be destroyed meanwhile.
  template <class F>
  void for_each(F&& f) {
    std::lock_guard lock(mu_);
    for (TensorImpl* impl : live_) f(*impl);
  }

 private:
  std::mutex mu_;
  std::vector<TensorImpl*> live_;
};

inline TensorImpl::~TensorImpl() {
  if (registry) registry->remove(this);
}

}  // namespace lazy::graph

#if LAZYTENSOR_HEADER_DEFINITIONS
namespace lazy::graph {

LAZYTENSOR_INLINE AutogradState& TensorImpl::autograd_meta() {
  if (!autograd) autograd = std::make_unique<AutogradState>();
  return *autograd;
}

LAZYTENSOR_INLINE void HandleRegistry::add(TensorImpl* impl) {
  std::lock_guard lock(mu_);
  impl->registry_slot = live_.size();
  live_.push_back(impl);
}

LAZYTENSOR_INLINE void HandleRegistry::remove(TensorImpl* impl) {
  std::lock_guard lock(mu_);
  TensorImpl* last = live_.back();
  live_[impl->registry_slot] = last;
  last->registry_slot = impl->registry_slot;
  live_.pop_back();
}

}  // namespace lazy::graph
#endif  // LAZYTENSOR_HEADER_DEFINITIONS
// ---- end lazytensor/graph/tensor_impl.hpp ----

namespace lazy::graph {

/// State of the counter-based random generator of a device.
struct RngState {
  std::uint64_t seed = 0x5eed;
  std::uint64_t offset = 0;  ///< Philox counters consumed so far in this step
};

/// One execution device (a CPU "core group" with its own pool and graph).
class Device {
 public:
  Device(int index, int threads);
  ~Device();
  Device(const Device&) = delete;
  Device& operator=(const Device&) = delete;

  int index() const { return index_; }
  /// "CPU:0", as torch_xla prints devices.
  std::string str() const { return "CPU:" + std::to_string(index_); }

  ThreadPool& threads() { return threads_; }
  /// Changes the number of threads kernels use, once the steps in flight have finished.
  void set_num_threads(int n);
  BufferPool& pool() { return *pool_; }

  // ---- the trace ----------------------------------------------------------------------

  /// Records a new pending node, in creation order.
  void trace(const NodePtr& n);
  /// Number of entries in the trace, dropped nodes not yet pruned included (for tests).
  std::size_t trace_size();
  /// Takes the trace (the caller puts back what it does not run, see keep_traced).
  std::vector<std::weak_ptr<Node>> take_trace();
  /// Returns nodes (in creation order) to the trace, which stays in creation order: the
  /// planner relies on producers coming before their consumers.
  void keep_traced(std::vector<std::weak_ptr<Node>> older);

  /// Registers a handle, so mark_step can find the pending values that are still wanted
  /// (once per handle; it leaves the registry when destroyed). A handle registered with
  /// another device moves here (a module moved by to(device)).
  void register_handle(const std::shared_ptr<TensorImpl>& impl);
  /// Calls f(node) for the node of every live handle whose value is still being traced.
  template <class F>
  void for_each_pending_root(F&& f) {
    handles_->for_each([&](TensorImpl& impl) {
      if (impl.node && impl.node->pending()) f(impl.node);
    });
  }

  // ---- execution ----------------------------------------------------------------------

  /// Runs `job` on the executor thread after the jobs before it.
  void enqueue(std::function<void()> job);
  /// Blocks until every enqueued job has finished.
  void wait_idle() { wait_below(1); }
  /// Blocks until fewer than `n` enqueued jobs are unfinished (running or waiting).
  void wait_below(std::int64_t n);
  /// True when jobs are enqueued or running.
  bool busy() { return outstanding_.load(std::memory_order_acquire) != 0; }
  /// Whether mark_step runs plans on the executor thread (default, LAZYTENSOR_ASYNC=0 turns
  /// it off) or on the calling thread.
  bool& async() { return async_; }
  /// Whether an asynchronous device runs every step on the calling thread anyway, storing
  /// its errors as the executor would (they surface at the next read or sync). spawn sets
  /// it for replicas that fill every core: the executor would only compete with the
  /// replica's own thread for a core, and each hand-off costs two thread wake-ups.
  bool& inline_steps() { return inline_steps_; }
  /// Whether an asynchronous device hands every step to its executor, however small. SPMD
  /// mode sets it: one thread steps every device, and a step holding a collective must not
  /// run on that thread, where it would wait for peers whose steps are not handed out yet.
  bool& queue_every_step() { return queue_every_step_; }
  /// Whether the user chose the step mode (LAZYTENSOR_ASYNC set): spawn then leaves it.
  static bool async_from_env() { return core::env_switch("LAZYTENSOR_ASYNC").has_value(); }

  /// The plans built so far, by structural hash (the most recently used ones, see
  /// plan_cache.hpp).
  PlanCache& plan_cache() { return plan_cache_; }
  /// Steps and plan rebuilds, for the re-planning warning.
  struct PlanStats {
    std::int64_t steps = 0, rebuilds_after_warmup = 0;
    bool warned = false;
    std::vector<std::uint64_t> last_signature;
  };
  PlanStats& plan_stats() { return plan_stats_; }

  RngState& rng() { return rng_; }
  bool& eager() { return eager_; }

  void add_step_closure(std::function<void()> f);
  std::vector<std::function<void()>> take_step_closures();

  /// Stores an execution error to be re-thrown at the next read or sync.
  void store_error(std::exception_ptr e);
  /// How many execution errors were ever stored: a queued step compares it with the
  /// count when it was queued, to learn that a step ahead of it failed.
  std::uint64_t failures() const { return failures_.load(std::memory_order_acquire); }
  /// Re-throws (once) a stored execution error.
  void rethrow_stored_error();

 private:
  void executor_loop();
  // At destruction (process exit): steps not started yet are dropped (nothing can read
  // their results any more), the running one finishes.
  void stop_executor();

  // A program that only reads values (item(), to_vector()) and never calls mark_step
  // keeps tracing: without pruning, the entries of its dropped nodes would pile up, and
  // each would pin its node's memory (make_shared puts the node in the control block a
  // weak_ptr keeps). Dropping them whenever the trace has doubled keeps the cost O(1)
  // per node and the trace at most twice the nodes still alive.
  // Ids of the newest and oldest live nodes of a list in creation order (0 and the
  // maximum when none is alive).
  static std::uint64_t newest_id(const std::vector<std::weak_ptr<Node>>& v);
  static std::uint64_t oldest_id(const std::vector<std::weak_ptr<Node>>& v);
  void prune_trace();
  // The next pruning comes when the trace has doubled from now.
  void rearm_pruning() { prune_at_ = std::max(kMinPruneAt, 2 * trace_.size()); }

  static bool default_async() { return core::env_switch("LAZYTENSOR_ASYNC").value_or(true); }

  int index_;
  std::shared_ptr<BufferPool> pool_;
  ThreadPool threads_;
  std::mutex mu_;
  std::vector<std::weak_ptr<Node>> trace_;
  static constexpr std::size_t kMinPruneAt = 1024;
  std::size_t prune_at_ = kMinPruneAt;
  std::shared_ptr<HandleRegistry> handles_ = std::make_shared<HandleRegistry>();
  RngState rng_;
  bool eager_ = false;
  bool async_ = default_async();
  bool inline_steps_ = false;
  bool queue_every_step_ = false;
  std::vector<std::function<void()>> closures_;
  std::atomic<std::uint64_t> failures_{0};
  std::exception_ptr error_;
  std::atomic<bool> has_error_{false};  // error_ is set (written under mu_)
  PlanCache plan_cache_;
  PlanStats plan_stats_;

  std::mutex exec_mu_;
  std::condition_variable exec_cv_, idle_cv_;
  std::deque<std::function<void()>> jobs_;
  // Changed under exec_mu_ (the condition variables' predicate), read without it by
  // wait_below's and busy()'s fast path.
  std::atomic<std::int64_t> outstanding_{0};
  bool stop_ = false;
  std::thread executor_;
};

/// Threads a device uses by default: LAZYTENSOR_NUM_THREADS, else the hardware threads.
int default_device_threads();

/// All devices of this process. Created on first use; never destroyed before exit.
class DeviceRegistry {
 public:
  static DeviceRegistry& get();
  /// Device `index`, created on first use.
  Device& device(int index);
  /// Number of devices created so far (at least 1).
  int count();

 private:
  std::mutex mu_;
  std::deque<std::unique_ptr<Device>> devices_;
};

/// Index of this thread's current device (replicas bind their thread to their device).
int& current_device_index();

/// This thread's current device.
inline Device& current_device() { return DeviceRegistry::get().device(current_device_index()); }

/// Points an existing handle at `node` (a parameter moved or reloaded in place); the
/// handle's registration follows the node's device, so that device's mark_step sees the
/// handle's later pending values.
void rebind(const std::shared_ptr<TensorImpl>& impl, NodePtr node);

}  // namespace lazy::graph

#if LAZYTENSOR_HEADER_DEFINITIONS
namespace lazy::graph {

LAZYTENSOR_INLINE Device::Device(int index, int threads)
    : index_(index), pool_(std::make_shared<BufferPool>()), threads_(threads) {}

LAZYTENSOR_INLINE Device::~Device() { stop_executor(); }

LAZYTENSOR_INLINE void Device::set_num_threads(int n) {
  wait_idle();
  threads_.resize(n);
}

LAZYTENSOR_INLINE void Device::trace(const NodePtr& n) {
  std::lock_guard lock(mu_);
  // Statements read and dropped before the next one (`sum(x).item()` in a loop) leave
  // their entry dead at the back: reuse it at once. A dead entry holds the node's memory
  // (weak references keep make_shared's block), so waiting for the next pruning would
  // cycle a fresh block through the cache on every statement.
  while (!trace_.empty() && trace_.back().expired()) trace_.pop_back();
  if (trace_.size() >= prune_at_) prune_trace();
  trace_.push_back(n);
}

LAZYTENSOR_INLINE std::size_t Device::trace_size() {
  std::lock_guard lock(mu_);
  return trace_.size();
}

LAZYTENSOR_INLINE std::vector<std::weak_ptr<Node>> Device::take_trace() {
  std::lock_guard lock(mu_);
  prune_at_ = kMinPruneAt;  // a large step must not leave a high threshold behind
  return std::exchange(trace_, {});
}

LAZYTENSOR_INLINE void Device::keep_traced(std::vector<std::weak_ptr<Node>> older) {
  if (older.empty()) return;
  std::lock_guard lock(mu_);
  if (newest_id(older) < oldest_id(trace_)) {
    // The common case (a step's unneeded nodes, older than anything traced since).
    older.insert(older.end(), trace_.begin(), trace_.end());
    trace_ = std::move(older);
  } else {
    // Errors return nodes out of order: a failed step's, then the next step's (newer, but
    // returned later), or a failed read's, still traced. Merge by id, once each.
    older.insert(older.end(), trace_.begin(), trace_.end());
    std::vector<std::pair<std::uint64_t, std::weak_ptr<Node>>> live;
    for (auto& w : older)
      if (auto n = w.lock()) live.emplace_back(n->id(), std::move(w));
    std::sort(live.begin(), live.end(),
              [](const auto& a, const auto& b) { return a.first < b.first; });
    trace_.clear();
    for (std::size_t i = 0; i < live.size(); ++i)
      if (i == 0 || live[i].first != live[i - 1].first)
        trace_.push_back(std::move(live[i].second));
  }
  rearm_pruning();
}

LAZYTENSOR_INLINE void Device::register_handle(const std::shared_ptr<TensorImpl>& impl) {
  if (impl->registry == handles_) return;
  if (impl->registry) impl->registry->remove(impl.get());
  impl->registry = handles_;
  handles_->add(impl.get());
}

LAZYTENSOR_INLINE void Device::enqueue(std::function<void()> job) {
  {
    std::lock_guard lock(exec_mu_);
    if (!executor_.joinable()) executor_ = std::thread([this] { executor_loop(); });
    jobs_.push_back(std::move(job));
    outstanding_.fetch_add(1, std::memory_order_relaxed);
  }
  exec_cv_.notify_all();
}

LAZYTENSOR_INLINE void Device::wait_below(std::int64_t n) {
  // Every read and eager op asks; the executor is usually idle by then. The acquire load
  // pairs with the release decrement, so a finished job's writes are visible.
  if (outstanding_.load(std::memory_order_acquire) < n) return;
  std::unique_lock lock(exec_mu_);
  idle_cv_.wait(lock, [&] { return outstanding_.load(std::memory_order_relaxed) < n; });
}

LAZYTENSOR_INLINE void Device::add_step_closure(std::function<void()> f) {
  std::lock_guard lock(mu_);
  closures_.push_back(std::move(f));
}

LAZYTENSOR_INLINE std::vector<std::function<void()>> Device::take_step_closures() {
  std::lock_guard lock(mu_);
  return std::exchange(closures_, {});
}

LAZYTENSOR_INLINE void Device::store_error(std::exception_ptr e) {
  std::lock_guard lock(mu_);
  if (!error_) error_ = e;
  has_error_.store(true, std::memory_order_release);
  failures_.fetch_add(1, std::memory_order_release);
}

LAZYTENSOR_INLINE void Device::rethrow_stored_error() {
  // Every read asks, and almost never finds one: no lock then. A store this load misses
  // raced with the caller, as if it came after the check. A caller that waited for the
  // step (wait_below) sees its error: the step stores it before the executor's release
  // of the job count.
  if (!has_error_.load(std::memory_order_acquire)) return;
  std::exception_ptr e;
  {
    std::lock_guard lock(mu_);
    e = std::exchange(error_, nullptr);
    has_error_.store(false, std::memory_order_relaxed);
  }
  if (e) std::rethrow_exception(e);
}

LAZYTENSOR_INLINE void Device::executor_loop() {
  for (;;) {
    std::function<void()> job;
    {
      std::unique_lock lock(exec_mu_);
      exec_cv_.wait(lock, [&] { return stop_ || !jobs_.empty(); });
      if (jobs_.empty()) return;  // stopping, nothing left
      job = std::move(jobs_.front());
      jobs_.pop_front();
    }
    job();  // jobs catch their own errors (store_error)
    job = nullptr;
    {
      std::lock_guard lock(exec_mu_);
      outstanding_.fetch_sub(1, std::memory_order_release);
    }
    idle_cv_.notify_all();
  }
}

LAZYTENSOR_INLINE void Device::stop_executor() {
  std::deque<std::function<void()>> dropped;
  {
    std::lock_guard lock(exec_mu_);
    stop_ = true;
    dropped.swap(jobs_);
    outstanding_.fetch_sub(static_cast<std::int64_t>(dropped.size()), std::memory_order_release);
  }
  exec_cv_.notify_all();
  if (executor_.joinable()) executor_.join();
}

LAZYTENSOR_INLINE std::uint64_t Device::newest_id(const std::vector<std::weak_ptr<Node>>& v) {
  for (auto it = v.rbegin(); it != v.rend(); ++it)
    if (const auto n = it->lock()) return n->id();
  return 0;
}

LAZYTENSOR_INLINE std::uint64_t Device::oldest_id(const std::vector<std::weak_ptr<Node>>& v) {
  for (const auto& w : v)
    if (const auto n = w.lock()) return n->id();
  return std::numeric_limits<std::uint64_t>::max();
}

LAZYTENSOR_INLINE void Device::prune_trace() {
  std::erase_if(trace_, [](const std::weak_ptr<Node>& w) { return w.expired(); });
  rearm_pruning();
}

LAZYTENSOR_INLINE int default_device_threads() {
  if (const char* env = std::getenv("LAZYTENSOR_NUM_THREADS")) {
    const int n = std::atoi(env);
    if (n > 0) return n;
  }
  return std::max(1u, std::thread::hardware_concurrency());
}

LAZYTENSOR_INLINE DeviceRegistry& DeviceRegistry::get() {
  static DeviceRegistry r;
  return r;
}

LAZYTENSOR_INLINE Device& DeviceRegistry::device(int index) {
  if (index < 0) throw DeviceError("device index must be >= 0, got " + std::to_string(index));
  std::lock_guard lock(mu_);
  while (static_cast<int>(devices_.size()) <= index) {
    devices_.push_back(std::make_unique<Device>(static_cast<int>(devices_.size()), default_device_threads()));
  }
  return *devices_[index];
}

LAZYTENSOR_INLINE int DeviceRegistry::count() {
  device(0);
  std::lock_guard lock(mu_);
  return static_cast<int>(devices_.size());
}

LAZYTENSOR_INLINE int& current_device_index() {
  thread_local int index = 0;
  return index;
}

LAZYTENSOR_INLINE void rebind(const std::shared_ptr<TensorImpl>& impl, NodePtr node) {
  Device* dev = node->device();
  impl->node = std::move(node);
  dev->register_handle(impl);
}

LAZYTENSOR_INLINE std::shared_ptr<Buffer> Node::allocate_output(ExecContext& ctx, bool allow_donation) {
  if (allow_donation) {
    for (std::size_t i = 0; i < inputs_.size(); ++i) {
      if (auto b = try_donate(i)) {
        static auto& donated = core::counter("DonatedBuffers");
        donated.add();
        return b;
      }
    }
  }
  return ctx.device.pool().acquire(padded_bytes(numel(), dtype_size(dtype_)));
}

}  // namespace lazy::graph
#endif  // LAZYTENSOR_HEADER_DEFINITIONS
// ---- end lazytensor/graph/device.hpp ----
// ---- begin lazytensor/graph/parallel.hpp ----
// When and how a kernel is split across a device's workers.

#include <algorithm>
#include <cstdint>


namespace lazy::graph {

/// Work (cost units x elements) below which a kernel runs on the calling thread: waking
/// workers and joining them costs a few microseconds, what ~2^18 simple SIMD element operations
/// take (workers spin between kernels; see ThreadPool).
inline constexpr double kParallelCostThreshold = 1 << 18;

/// Number of tasks for `n` items of `cost` each: 1 below the threshold, else a few per
/// thread (slack for a noisy, shared machine), never tasks smaller than `min_items`.
inline std::int64_t task_count(const ThreadPool& pool, std::int64_t n, double cost, std::int64_t min_items = 4096) {
  if (pool.size() <= 1 || cost * static_cast<double>(n) < kParallelCostThreshold) return 1;
  const std::int64_t by_size = std::max<std::int64_t>(1, n / std::max<std::int64_t>(1, min_items));
  return std::min<std::int64_t>(by_size, 4 * pool.size());
}

/// Splits [0, n) into `tasks` ranges whose starts are multiples of `align`.
inline std::pair<std::int64_t, std::int64_t> task_range(std::int64_t n, std::int64_t tasks, std::int64_t t,
                                                        std::int64_t align = 1) {
  const std::int64_t units = (n + align - 1) / align;
  const std::int64_t b = units * t / tasks * align, e = units * (t + 1) / tasks * align;
  return {std::min(b, n), std::min(e, n)};
}

}  // namespace lazy::graph
// ---- end lazytensor/graph/parallel.hpp ----

namespace lazy::graph {

/// `in` converted to the floating dtype `to` (the input's dtype must be floating too).
class ConvertNode final : public Node {
 public:
  ConvertNode(NodePtr in, DType to);

  std::string op_name() const override { return "convert"; }
  std::string describe() const override { return "convert(%0) -> " + dtype_name(dtype()); }
  std::optional<BlockRule> block_rule() const override { return aligned_block_rule(shape(), inputs()); }
  NodePtr with_inputs(std::vector<NodePtr> inputs, Shape, Device*) const override {
    return std::make_shared<ConvertNode>(std::move(inputs[0]), dtype());
  }

 protected:
  void compute(ExecContext& ctx) override;
};

/// `in` (float) with every element rounded to the nearest bfloat16 value, still float: the
/// operands and results of products under autocast (AutocastGuard). A node of its own, so a
/// float program that never autocasts holds no bfloat16 kernel.
class RoundToBFloat16Node final : public Node {
 public:
  explicit RoundToBFloat16Node(NodePtr in);

  std::string op_name() const override { return "round_bf16"; }
  std::optional<BlockRule> block_rule() const override { return aligned_block_rule(shape(), inputs()); }
  NodePtr with_inputs(std::vector<NodePtr> inputs, Shape, Device*) const override {
    return std::make_shared<RoundToBFloat16Node>(std::move(inputs[0]));
  }

 protected:
  void compute(ExecContext& ctx) override;
};

#if LAZYTENSOR_HEADER_DEFINITIONS
namespace detail {
// Elements [b, e) of src (dtype `from`) into dst (dtype `to`), both floating. Plain loops in
// one function: no per-dtype template to compile into every program that includes this.
inline void convert_elements(DType from, DType to, const void* src, void* dst, std::int64_t b, std::int64_t e) {
  auto load = [&](std::int64_t i) -> double {
    switch (from) {
      case DType::BFloat16: return static_cast<float>(static_cast<const bfloat16*>(src)[i]);
      case DType::Float32: return static_cast<const float*>(src)[i];
      default: return static_cast<const double*>(src)[i];
    }
  };
  switch (to) {
    case DType::BFloat16:  // through float, as cast<bfloat16> rounds a double
      for (std::int64_t i = b; i < e; ++i) static_cast<bfloat16*>(dst)[i] = bfloat16(static_cast<float>(load(i)));
      break;
    case DType::Float32:
      for (std::int64_t i = b; i < e; ++i) static_cast<float*>(dst)[i] = static_cast<float>(load(i));
      break;
    default:
      for (std::int64_t i = b; i < e; ++i) static_cast<double*>(dst)[i] = load(i);
      break;
  }
}
}  // namespace detail

LAZYTENSOR_INLINE ConvertNode::ConvertNode(NodePtr in, DType to)
    : Node(NodeKind::Copy, to, in->shape(), in->device(), {in}) {
  if (!is_floating(in->dtype()) || !is_floating(to)) {
    throw DTypeError("convert: converts between floating dtypes (bfloat16, float32, float64), got " +
                     dtype_name(in->dtype()) + " to " + dtype_name(to));
  }
}

LAZYTENSOR_INLINE void ConvertNode::compute(ExecContext& ctx) {
  const NodePtr& in = inputs()[0];
  auto buf = allocate_output(ctx, false);
  const void* src = in->buffer()->data();
  void* dst = buf->data();
  const DType from = in->dtype(), to = dtype();
  const std::int64_t n = numel();
  auto& pool = ctx.device.threads();
  const std::int64_t tasks = task_count(pool, n, 1.0);
  pool.parallel_for(tasks, [&](std::int64_t t) {
    auto [b, e] = task_range(n, tasks, t);
    detail::convert_elements(from, to, src, dst, b, e);
  });
  set_buffer(std::move(buf));
}
LAZYTENSOR_INLINE RoundToBFloat16Node::RoundToBFloat16Node(NodePtr in)
    : Node(NodeKind::Copy, DType::Float32, in->shape(), in->device(), {in}) {
  if (in->dtype() != DType::Float32) {
    throw DTypeError("round_bf16: expected a float32 tensor, got " + dtype_name(in->dtype()));
  }
}

LAZYTENSOR_INLINE void RoundToBFloat16Node::compute(ExecContext& ctx) {
  const float* src = inputs()[0]->data<float>();
  auto buf = allocate_output(ctx, true);  // in place when the input is not needed elsewhere
  float* dst = static_cast<float*>(buf->data());
  const std::int64_t n = numel();
  auto& pool = ctx.device.threads();
  const std::int64_t tasks = task_count(pool, n, 1.0);
  pool.parallel_for(tasks, [&](std::int64_t t) {
    auto [b, e] = task_range(n, tasks, t);
    for (std::int64_t i = b; i < e; ++i) dst[i] = static_cast<float>(bfloat16(src[i]));
  });
  set_buffer(std::move(buf));
}
#endif  // LAZYTENSOR_HEADER_DEFINITIONS

}  // namespace lazy::graph
// ---- end lazytensor/graph/convert_node.hpp ----
// ---- begin lazytensor/graph/submit.hpp ----
// Adding nodes to a device's pending graph.

#include <atomic>
#include <memory>
#include <span>
#include <string>
#include <vector>

// ---- begin lazytensor/graph/executor.hpp ----
// Running plans: a step's collection (what mark_step computes), plan lookup in the cache,
// the execution of single nodes and of fused element-wise groups (fused_group.hpp), the
// hand-off to the device's executor thread, and the synchronous path used by reads and
// eager mode. Errors inside a plan return its unrun nodes to the trace (they stay pending)
// and are stored on the device, to be re-thrown at the next read or sync.

#include <algorithm>
#include <cstddef>
#include <cstdio>
#include <span>
#include <unordered_set>
#include <utility>
#include <vector>

// ---- begin lazytensor/core/small_vector.hpp ----
// A vector of trivially copyable values that keeps up to N of them inline: per-node data
// with a handful of entries (a kernel's per-input strides) then costs no allocation, which
// matters when a step traces and frees hundreds of small nodes.

#include <algorithm>
#include <cstddef>
#include <memory>
#include <type_traits>

namespace lazy::core {

/// Fixed-capacity-inline vector (see the file comment). Only what its users need: resize,
/// assign, indexing, data, iteration, and stack use (push_back, back, pop_back).
template <class T, std::size_t N>
class SmallVector {
  static_assert(std::is_trivially_copyable_v<T>, "SmallVector holds trivially copyable values");

 public:
  SmallVector() = default;
  SmallVector(const SmallVector& o) { copy_from(o); }
  SmallVector& operator=(const SmallVector& o) {
    if (this != &o) copy_from(o);
    return *this;
  }
  SmallVector(SmallVector&& o) noexcept { move_from(o); }
  SmallVector& operator=(SmallVector&& o) noexcept {
    if (this != &o) move_from(o);
    return *this;
  }
  ~SmallVector() = default;

  /// Sets the size to n; new elements are value-initialized, kept ones keep their values.
  void resize(std::size_t n) {
    reserve(n);
    for (std::size_t i = size_; i < n; ++i) data()[i] = T{};
    size_ = n;
  }
  /// n copies of v.
  void assign(std::size_t n, const T& v) {
    reserve(n);
    std::fill_n(data(), n, v);
    size_ = n;
  }

  /// Appends v (growing the storage geometrically once past the inline capacity).
  void push_back(const T& v) {
    const T copy = v;  // v may be an element of this vector, which growing frees
    if (size_ == capacity()) reserve(std::max<std::size_t>(4, 2 * capacity()));
    data()[size_++] = copy;
  }
  /// The last element (the vector must not be empty).
  T& back() { return data()[size_ - 1]; }
  /// Removes the last element (the vector must not be empty).
  void pop_back() { --size_; }

  std::size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  T* data() { return heap_ ? heap_.get() : inline_; }
  const T* data() const { return heap_ ? heap_.get() : inline_; }
  T& operator[](std::size_t i) { return data()[i]; }
  const T& operator[](std::size_t i) const { return data()[i]; }
  T* begin() { return data(); }
  T* end() { return data() + size_; }
  const T* begin() const { return data(); }
  const T* end() const { return data() + size_; }

 private:
  void reserve(std::size_t n) {
    if (n <= capacity()) return;
    auto bigger = std::make_unique<T[]>(n);
    std::copy_n(data(), size_, bigger.get());
    heap_ = std::move(bigger);
    heap_capacity_ = n;
  }
  std::size_t capacity() const { return heap_ ? heap_capacity_ : N; }
  void copy_from(const SmallVector& o) {
    size_ = 0;
    reserve(o.size_);
    std::copy_n(o.data(), o.size_, data());
    size_ = o.size_;
  }
  void move_from(SmallVector& o) {
    if (o.heap_) {
      heap_ = std::move(o.heap_);
      heap_capacity_ = o.heap_capacity_;
    } else {
      heap_.reset();
      std::copy_n(o.inline_, o.size_, inline_);
    }
    size_ = o.size_;
    o.size_ = 0;
  }

  T inline_[N] = {};
  std::unique_ptr<T[]> heap_;
  std::size_t heap_capacity_ = 0;
  std::size_t size_ = 0;
};

}  // namespace lazy::core
// ---- end lazytensor/core/small_vector.hpp ----
// ---- begin lazytensor/graph/fused_group.hpp ----
// Running a fused element-wise group (a PlanStep with several members): every chunk of
// kFusionChunk elements goes through each member in order, so intermediates stay in cache.
// Members needed outside the group are written whole, the others only to a per-task
// scratch chunk; a reduction ending the group reduces each chunk to a partial.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

// ---- begin lazytensor/core/vectorizer_barrier.hpp ----
// Keeping the auto-vectorizer out of short bookkeeping loops.

#include <type_traits>

namespace lazy::core {

/// Makes `value` opaque to the optimizer at this point, so the loop computing it stays
/// scalar. For loops over a handful of elements run between kernel calls (the pointers a
/// sliced group advances per slice): vectorized at -O3 (GCC) or -O2 (clang), such a loop
/// becomes vector adds with a scalar remainder and costs more than the few additions it
/// replaces (6% of the three-statement chain at 2^24 floats, measured with GCC 12 -O3).
/// Pointers and integers only (the value passes through a general-purpose register). No
/// effect on compilers without GNU inline assembly.
template <class T>
requires std::is_pointer_v<T> || std::is_integral_v<T>
inline void hide_from_vectorizer([[maybe_unused]] T& value) {
#if defined(__GNUC__)
  asm("" : "+r"(value));
#endif
}

}  // namespace lazy::core
// ---- end lazytensor/core/vectorizer_barrier.hpp ----
// ---- begin lazytensor/graph/plan.hpp ----
// The planner: which pending nodes a step runs, in what order, grouped how, and the plan
// cache that lets a repeated step skip all of that.
//
// A step's nodes are taken in creation order (a valid topological order: inputs exist
// before their consumers). Its structural signature lists, per node, the node's own hash
// (op, kernel type, dtypes, shapes), where each input comes from (a node of this step, by
// position, or outside it) and whether anything outside the step still refers to the
// node (then its value must be written whole). Equal signatures get the same plan.
//
// Fusion across statements: element-wise nodes with flat layouts and the same number of
// elements (not necessarily adjacent in the program) form a group that runs chunk by chunk (each chunk through every member in
// order), so intermediates stay in cache; a member that nothing outside the group needs
// is computed into a chunk-sized scratch and never written whole. A reduction of every
// element of a child the group computes ends the group: it reduces each chunk as the chunk
// is made (see chunk_reduction.hpp).

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

// ---- begin lazytensor/graph/chunk_reduction.hpp ----
// The face a reduction shows to a fused element-wise group it ends: the group computes its
// child chunk by chunk and hands each chunk to the reduction, which keeps one partial
// result per chunk and combines them at the end.
//
// Only reductions of every element to one value take part: their blocks (kReduceBlock)
// are the group's chunks (kFusionChunk), both cut at the same multiples from element 0,
// so a fused reduction adds exactly the same numbers in the same order as an unfused one
// (bitwise-identical results, whatever the fusion or the thread count).

#include <cstddef>
#include <cstdint>

namespace lazy::graph {

struct ExecContext;

/// Implemented by reduction nodes that can end a fused group (see the file comment).
class ChunkReduction {
 public:
  virtual ~ChunkReduction() = default;
  /// True when every element of the child is reduced to one value: only then can the
  /// node end a group.
  virtual bool reduces_all() const = 0;
  /// Bytes of one partial result.
  virtual std::size_t partial_bytes() const = 0;
  /// Reduces `len` (<= one chunk) elements whose inputs start at `inputs` (an input of
  /// one element broadcast to all: its only element) into `partial`.
  virtual void reduce_chunk(const void* const* inputs, std::int64_t len, void* partial) const = 0;
  /// Combines `count` partials (in chunk order) into the node's value and finishes it;
  /// the partials may be overwritten.
  virtual void finish_partials(ExecContext& ctx, void* partials, std::int64_t count) = 0;
};

}  // namespace lazy::graph
// ---- end lazytensor/graph/chunk_reduction.hpp ----
// ---- begin lazytensor/graph/elementwise_node.hpp ----
// The graph node of a fused element-wise kernel: one expression, one output, one pass.
//
// Split as Eigen splits expressions from evaluators: ElementwiseNode (not a template) owns
// the graph-side logic — layout, threading, GEMM epilogue fusion, donation — once for all
// kernels; a CompiledKernel<K, Tout> holds the kernel-form expression and only the loops
// that must be compiled per expression. That keeps each expression's cost in code (and
// compile time) to its SIMD loops, and gives the planner one interface to run any
// element-wise kernel over a range of elements.

#include <cstdint>
#include <memory>
#include <string>
#include <typeinfo>
#include <vector>

// ---- begin lazytensor/expr/dual.hpp ----
// Gradient kernels of element-wise expressions, derived at compile time.
//
// The gradient of y = f(leaves...) with respect to one leaf is g * dy/dleaf, element by
// element. DualEval evaluates f on dual numbers (value, tangent) with the tangent seeded
// at the target leaf: each op combines its operands' tangents through its declared local
// derivatives (functors.hpp, d<I>), so the chain rule over the expression's type yields
// one fused kernel that recomputes the forward values it needs and never writes an
// intermediate. A leaf that appears twice (x * x) is one input slot, so its tangent
// counts both uses. Subtrees without the target skip their tangent arithmetic (a
// loop-invariant branch).

#include <cstdint>
#include <string>
#include <tuple>

// ---- begin lazytensor/expr/evaluator.hpp ----
// Evaluators: built per kernel run from a kernel-form expression and the input pointers.
// They carry what nodes do not: pointers, the splat flags, the lane type S, and the
// scalar (coeff) and SIMD (packet) access paths. Eigen's split, in short.

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <vector>

#include <xsimd/xsimd.hpp>

// ---- begin lazytensor/expr/kernel_form.hpp ----
// The kernel form of an expression: the same tree with every tensor leaf replaced by the
// index of a node input. A graph node stores this form, so it holds no handle of its own
// beyond its input list (buffer donation counts references on that list).

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

// ---- begin lazytensor/expr/expr.hpp ----
// Expression nodes. They are thin: an op type and its operands. Leaves hold the graph node
// of a tensor's value at the time the expression was built (so `auto e = a + 1; a += 5;`
// keeps meaning the old `a`), scalars hold their value, and the shape is broadcast once,
// at construction, where a mismatch is reported against the line that built it.

#include <concepts>
#include <cstdint>
#include <memory>
#include <tuple>
#include <type_traits>
#include <utility>

// ---- begin lazytensor/expr/functors.hpp ----
// Element-wise op functors. Each one says how it types its result (PyTorch promotion) and
// computes on a value `V` that is either a scalar or an xsimd batch of the kernel's lane
// type, so one definition serves the SIMD main loop and the scalar tail.

#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

#include <xsimd/xsimd.hpp>


namespace lazy::ops {

namespace detail {
// Scalar counterpart of xsimd::select, so ops read the same for both kinds of V.
template <class V>
inline V select(bool c, const V& a, const V& b) {
  return c ? a : b;
}
using xsimd::select;

/// a != b that is true when either side is NaN. xsimd 8.1 compiles batch `!=` as an
/// ordered compare on AVX/AVX-512 (false with NaN), unlike C++ and SSE2.
template <class V>
inline auto not_equal(const V& a, const V& b) {
  return !(a == b);
}
/// True where a is NaN (false for integers).
template <class V>
inline auto is_nan(const V& a) {
  return not_equal(a, a);
}

/// 1 where the mask holds, else 0, for a scalar bool or an xsimd batch_bool.
template <class V, class M>
inline V from_bool(const M& m) {
  if constexpr (std::is_arithmetic_v<V>) {
    return m ? V(1) : V(0);
  } else {
    return xsimd::select(m, V(1), V(0));
  }
}
/// Element type of a scalar or an xsimd batch.
template <class V>
struct lane_value {
  using type = V;
};
template <class T, class A>
struct lane_value<xsimd::batch<T, A>> {
  using type = T;
};

/// Applies a scalar function to every lane of a value.
template <class V, class F>
inline V map_lanes(const V& a, F f) {
  if constexpr (std::is_arithmetic_v<V>) {
    return f(a);
  } else {
    alignas(64) typename V::value_type tmp[V::size];
    a.store_aligned(tmp);
    for (auto& x : tmp) x = f(x);
    return V::load_aligned(tmp);
  }
}
}  // namespace detail

// ---- result-type rules ---------------------------------------------------------------

template <class A, class B = A>
using promoted = promote_t<A, B>;

#define LAZY_STRIP(...) __VA_ARGS__
// Each functor also declares its local derivative d<I>(operands..., y): the partial of
// the result y with respect to operand I, as an expression of the operands and y. The
// chain rule over an expression's type (expr/dual.hpp) turns these into one fused
// gradient kernel per leaf.
#define LAZY_UNARY_OP(NAME, STR, COST, RESULT, BODY, DERIV)      \
  struct NAME {                                                  \
    static constexpr const char* name = STR;                     \
    static constexpr double cost = COST;                         \
    template <class T>                                           \
    using result = LAZY_STRIP RESULT;                                       \
    template <class V>                                           \
    static V apply(const V& a) {                                 \
      using namespace detail;                                    \
      using std::exp, std::log, std::log1p, std::expm1, std::sqrt, std::abs, std::sin, std::cos, \
          std::tanh, std::erf, std::trunc;                       \
      LAZY_STRIP BODY                                            \
    }                                                            \
    template <int I, class V>                                    \
    static V d([[maybe_unused]] const V& a, [[maybe_unused]] const V& y) { \
      using namespace detail;                                    \
      using std::exp, std::log, std::sqrt, std::sin, std::cos, std::erf; \
      return LAZY_STRIP DERIV;                                   \
    }                                                            \
  };

#define LAZY_BINARY_OP(NAME, STR, COST, RESULT, BODY, D0, D1) \
  struct NAME {                                       \
    static constexpr const char* name = STR;          \
    static constexpr double cost = COST;              \
    template <class A, class B>                       \
    using result = LAZY_STRIP RESULT;                            \
    template <class V>                                \
    static V apply(const V& a, const V& b) {          \
      using namespace detail;                         \
      using std::pow;                                 \
      LAZY_STRIP BODY                                 \
    }                                                 \
    template <int I, class V>                         \
    static V d([[maybe_unused]] const V& a, [[maybe_unused]] const V& b, [[maybe_unused]] const V& y) { \
      using namespace detail;                         \
      using std::pow, std::log;                       \
      if constexpr (I == 0) return LAZY_STRIP D0;     \
      else return LAZY_STRIP D1;                      \
    }                                                 \
  };

// Unary ops. Results of floating-only functions on integers are float, as in PyTorch.
LAZY_UNARY_OP(Neg, "neg", 1, (T), (return -a;), (V(-1)))
LAZY_UNARY_OP(Identity, "identity", 0.5, (T), (return a;), (V(1)))
LAZY_UNARY_OP(Exp, "exp", 8, (to_floating_t<T>), (return exp(a);), (y))
LAZY_UNARY_OP(Log, "log", 8, (to_floating_t<T>), (return log(a);), (V(1) / a))
LAZY_UNARY_OP(Log1p, "log1p", 10, (to_floating_t<T>), (return log1p(a);), (V(1) / (V(1) + a)))
LAZY_UNARY_OP(Expm1, "expm1", 10, (to_floating_t<T>), (return expm1(a);), (y + V(1)))
LAZY_UNARY_OP(Sqrt, "sqrt", 4, (to_floating_t<T>), (return sqrt(a);), (V(0.5) / y))
// Full-precision 1/sqrt: xsimd::rsqrt is an approximation on x86.
LAZY_UNARY_OP(Rsqrt, "rsqrt", 5, (to_floating_t<T>), (return V(1) / sqrt(a);), (V(-0.5) * y * y * y))
LAZY_UNARY_OP(Square, "square", 1, (T), (return a * a;), (V(2) * a))
LAZY_UNARY_OP(Abs, "abs", 1, (T), (return abs(a);), (from_bool<V>(a > V(0)) - from_bool<V>(a < V(0))))
LAZY_UNARY_OP(Sign, "sign", 2, (T), (return from_bool<V>(a > V(0)) - from_bool<V>(a < V(0));), (V(0)))
LAZY_UNARY_OP(Sin, "sin", 10, (to_floating_t<T>), (return sin(a);), (cos(a)))
LAZY_UNARY_OP(Cos, "cos", 10, (to_floating_t<T>), (return cos(a);), (-sin(a)))
LAZY_UNARY_OP(Tanh, "tanh", 10, (to_floating_t<T>), (return tanh(a);), (V(1) - y * y))
LAZY_UNARY_OP(Sigmoid, "sigmoid", 10, (to_floating_t<T>), (return V(1) / (V(1) + exp(-a));), (y * (V(1) - y)))
// relu keeps NaN (NaN < 0 is false), like torch.relu.
LAZY_UNARY_OP(Relu, "relu", 1, (T), (return select(a < V(0), V(0), a);), (from_bool<V>(y > V(0))))
// Exact (erf) GELU, torch's default approximate='none'.
LAZY_UNARY_OP(Gelu, "gelu", 12, (to_floating_t<T>), (return V(0.5) * a * (V(1) + erf(a * V(0.70710678118654752440)));),
              (V(0.5) * (V(1) + erf(a * V(0.70710678118654752440))) + a * V(0.39894228040143267794) * exp(V(-0.5) * a * a)))
LAZY_UNARY_OP(Silu, "silu", 10, (to_floating_t<T>), (return a / (V(1) + exp(-a));),
              ((V(1) + a - y) / (V(1) + exp(-a))))
// softplus with torch's default threshold 20: linear above it.
LAZY_UNARY_OP(Softplus, "softplus", 12, (to_floating_t<T>), (return select(a > V(20), a, log1p(exp(a)));),
              (select(a > V(20), V(1), V(1) / (V(1) + exp(-a)))))
LAZY_UNARY_OP(LogicalNot, "logical_not", 1, (bool), (return from_bool<V>(a == V(0));), (V(0)))

// Binary ops.
LAZY_BINARY_OP(Add, "add", 1, (promoted<A, B>), (return a + b;), (V(1)), (V(1)))
LAZY_BINARY_OP(Sub, "sub", 1, (promoted<A, B>), (return a - b;), (V(1)), (V(-1)))
LAZY_BINARY_OP(Mul, "mul", 1, (promoted<A, B>), (return a * b;), (b), (a))
LAZY_BINARY_OP(Div, "div", 2, (to_floating_t<promoted<A, B>>), (return a / b;), (V(1) / b), (-y / b))
// xsimd's pow maps a zero base to 0 for every exponent (0^0 and 0^-1 included) and turns
// inf^0, NaN^0 and 1^NaN into NaN; patch those IEEE cases to agree with std::pow/torch.pow.
LAZY_BINARY_OP(Pow, "pow", 12, (promoted<A, B>), (
  if constexpr (std::is_arithmetic_v<V>) {
    return V(pow(a, b));
  } else {
    const V inf(std::numeric_limits<typename V::value_type>::infinity());
    const auto zero_base = a == V(0);
    const auto odd = xsimd::is_odd(b);  // a signed zero keeps its sign for odd exponents
    V z = pow(a, b);
    z = select(zero_base, select(b < V(0), select(odd, xsimd::copysign(inf, a), inf), select(odd, a, V(0))), z);
    z = select(zero_base & is_nan(b), b, z);
    return select((b == V(0)) | (a == V(1)), V(1), z);
  }),
  // torch.pow's backward: b * a^(b-1) (0 where b == 0), and y * log(a) (0 where a == 0, b >= 0).
  (select(b == V(0), V(0), b * Pow::apply(a, b - V(1)))),
  (select((a == V(0)) & (b >= V(0)), V(0), y * log(a))))
// maximum/minimum propagate NaN from either side, like torch.maximum.
LAZY_BINARY_OP(Maximum, "maximum", 2, (promoted<A, B>), (return select((a > b) | is_nan(a), a, b);),
               (from_bool<V>(a > b) + V(0.5) * from_bool<V>(a == b)), (from_bool<V>(b > a) + V(0.5) * from_bool<V>(a == b)))
LAZY_BINARY_OP(Minimum, "minimum", 2, (promoted<A, B>), (return select((a < b) | is_nan(a), a, b);),
               (from_bool<V>(a < b) + V(0.5) * from_bool<V>(a == b)), (from_bool<V>(b < a) + V(0.5) * from_bool<V>(a == b)))
LAZY_BINARY_OP(Eq, "eq", 1, (bool), (return from_bool<V>(a == b);), (V(0)), (V(0)))
LAZY_BINARY_OP(Ne, "ne", 1, (bool), (return from_bool<V>(not_equal(a, b));), (V(0)), (V(0)))
LAZY_BINARY_OP(Lt, "lt", 1, (bool), (return from_bool<V>(a < b);), (V(0)), (V(0)))
LAZY_BINARY_OP(Le, "le", 1, (bool), (return from_bool<V>(a <= b);), (V(0)), (V(0)))
LAZY_BINARY_OP(Gt, "gt", 1, (bool), (return from_bool<V>(a > b);), (V(0)), (V(0)))
LAZY_BINARY_OP(Ge, "ge", 1, (bool), (return from_bool<V>(a >= b);), (V(0)), (V(0)))
LAZY_BINARY_OP(LogicalAnd, "logical_and", 1, (bool), (return from_bool<V>(not_equal(a, V(0)) & not_equal(b, V(0)));), (V(0)), (V(0)))
LAZY_BINARY_OP(LogicalOr, "logical_or", 1, (bool), (return from_bool<V>(not_equal(a, V(0)) | not_equal(b, V(0)));), (V(0)), (V(0)))

#undef LAZY_UNARY_OP
#undef LAZY_BINARY_OP
#undef LAZY_STRIP

/// where(cond, a, b): a where cond is non-zero.
struct Where {
  static constexpr const char* name = "where";
  static constexpr double cost = 2;
  template <class C, class A, class B>
  using result = promoted<A, B>;
  template <class V>
  static V apply(const V& c, const V& a, const V& b) {
    using namespace detail;
    return select(not_equal(c, V(0)), a, b);
  }
  template <int I, class V>
  static V d(const V& c, const V&, const V&, const V&) {
    using namespace detail;
    if constexpr (I == 0) return V(0);
    else if constexpr (I == 1) return from_bool<V>(not_equal(c, V(0)));
    else return from_bool<V>(c == V(0));
  }
};

/// Explicit conversion to U. Within a kernel values stay in the lane type; conversion to
/// an integer truncates toward zero and to bool tests for non-zero, as static_cast does.
template <Element U>
struct Cast {
  static constexpr const char* name = "cast";
  static constexpr double cost = 1;
  template <class T>
  using result = U;
  template <class V>
  static V apply(const V& a) {
    using namespace detail;
    if constexpr (std::is_same_v<U, bool>) {
      return from_bool<V>(not_equal(a, V(0)));
    } else if constexpr (is_integral_v<U>) {
      if constexpr (std::is_floating_point_v<V>) {
        return std::trunc(a);
      } else if constexpr (std::is_arithmetic_v<V>) {
        return a;
      } else if constexpr (std::is_floating_point_v<typename V::value_type>) {
        return xsimd::trunc(a);
      } else {
        return a;
      }
    } else if constexpr (std::is_same_v<U, bfloat16> || std::is_same_v<U, float>) {
      // Narrowing to a floating type rounds even inside a wider lane, as static_cast does
      // (x.to(bfloat16).to(float) in PyTorch): round each value through U.
      using S = typename detail::lane_value<V>::type;
      if constexpr (std::is_same_v<S, float> && std::is_same_v<U, float>) {
        return a;
      } else {
        return detail::map_lanes(a, [](S x) { return static_cast<S>(static_cast<float>(U(static_cast<float>(x)))); });
      }
    } else {
      return a;
    }
  }
  /// Conversions to floating types pass gradients straight through (rounding to bfloat16
  /// included, as torch does); conversions to integers and bool stop them.
  template <int I, class V>
  static V d(const V&, const V&) {
    return V(is_floating_v<U> ? 1 : 0);
  }
};

}  // namespace lazy::ops
// ---- end lazytensor/expr/functors.hpp ----

// What an operand refers to, declared here: the expression layer sits below the graph and
// autograd layers that define these classes, and only holds and compares pointers to them.
namespace lazy::graph {
class Node;
using NodePtr = std::shared_ptr<Node>;
}  // namespace lazy::graph
namespace lazy::autograd {
class GradFn;
using GradFnPtr = std::shared_ptr<GradFn>;
}  // namespace lazy::autograd

namespace lazy {

namespace expr {

/// A tensor operand: the graph node holding its value, and where its gradient goes
/// (null unless the tensor requires grad and grad mode was on when the leaf was made).
template <Element T>
struct Leaf {
  using value_type = T;
  graph::NodePtr node;
  autograd::GradFnPtr grad;
  /// The node's shape. A template only so that Node (graph/node.hpp, a higher layer) is
  /// complete where it is called, not here.
  template <class N = graph::Node>
  const Shape& shape() const {
    return static_cast<const N&>(*node).shape();
  }
};

/// A C++ number converted to the type it takes in the expression.
template <Element T>
struct Scalar {
  using value_type = T;
  T value;
  static Shape shape() { return {}; }
};

template <class X>
struct is_leaf : std::false_type {};
template <class T>
struct is_leaf<Leaf<T>> : std::true_type {};
template <class X>
struct is_scalar : std::false_type {};
template <class T>
struct is_scalar<Scalar<T>> : std::true_type {};

/// Type a kernel computes in: bool as int32, bfloat16 as float.
template <Element T>
using lane_of = std::conditional_t<std::is_same_v<T, bool>, std::int32_t, compute_t<T>>;
template <class A, class B>
using lane_combine = lane_of<promote_t<A, B>>;

}  // namespace expr

/// A lazy element-wise expression: Op applied to Children (leaves, scalars, expressions).
template <class Op, class... Children>
class Expr {
 public:
  using op_type = Op;
  using value_type = typename Op::template result<typename Children::value_type...>;

  explicit Expr(Children... c) : children_(std::move(c)...) {
    shape_ = std::apply([](const auto&... ch) { return broadcast_all(ch.shape()...); }, children_);
  }

  const Shape& shape() const { return shape_; }
  std::int64_t numel() const { return shape_.numel(); }
  int dim() const { return shape_.rank(); }
  const std::tuple<Children...>& children() const { return children_; }

 private:
  static Shape broadcast_all(const Shape& s) { return s; }
  template <class... S>
  static Shape broadcast_all(const Shape& a, const Shape& b, const S&... rest) {
    return broadcast_all(broadcast_shapes(a, b, Op::name), rest...);
  }

  std::tuple<Children...> children_;
  Shape shape_;
};

namespace expr {

template <class X>
struct is_expr_node : std::false_type {};
template <class Op, class... C>
struct is_expr_node<Expr<Op, C...>> : std::true_type {};

/// A pending expression (`relu(a + b)`), not yet a tensor: layers and losses accept one
/// where they accept a tensor.
template <class X>
concept Pending = is_expr_node<std::remove_cvref_t<X>>::value;

/// Anything usable as a tensor operand: an Expr, or a handle with `to_leaf()` (Tensor).
template <class X>
concept ExprLike = is_expr_node<std::remove_cvref_t<X>>::value || requires(const X& x) {
  { x.to_leaf() };
};

/// Whether any tensor operand of `x` carries an autograd edge. Checked before anything is
/// built for the backward pass: a forward statement outside training then allocates
/// nothing for autograd.
template <class X>
bool any_leaf_grad(const X& x) {
  if constexpr (is_leaf<X>::value) {
    return x.grad != nullptr;
  } else if constexpr (is_expr_node<X>::value) {
    return std::apply([](const auto&... ch) { return (any_leaf_grad(ch) || ...); }, x.children());
  } else {
    return false;
  }
}

/// A C++ number usable as a scalar operand.
template <class X>
concept Number = std::is_arithmetic_v<std::remove_cvref_t<X>> ||
                 std::is_same_v<std::remove_cvref_t<X>, bfloat16>;

/// The operand form of an expression-like value.
template <ExprLike X>
auto operand(const X& x) {
  if constexpr (is_expr_node<X>::value) {
    return x;
  } else {
    return x.to_leaf();
  }
}
template <ExprLike X>
using operand_t = decltype(operand(std::declval<const X&>()));
template <ExprLike X>
using value_t = typename operand_t<X>::value_type;

/// Converts a number to the type it takes next to a tensor of type T.
template <Element T, Number S>
Scalar<weak_scalar_t<T, std::remove_cvref_t<S>>> scalar_for(S s) {
  using U = weak_scalar_t<T, std::remove_cvref_t<S>>;
  if constexpr (std::is_same_v<U, bfloat16>) return {bfloat16(static_cast<float>(s))};
  else return {static_cast<U>(s)};
}

/// Lane (compute) type of a whole expression: the widest type any node uses.
template <class E>
struct lane;
template <Element T>
struct lane<Leaf<T>> {
  using type = lane_of<T>;
};
template <Element T>
struct lane<Scalar<T>> {
  using type = lane_of<T>;
};
template <class... Ts>
struct lane_fold;
template <class T>
struct lane_fold<T> {
  using type = T;
};
template <class A, class B, class... R>
struct lane_fold<A, B, R...> {
  using type = typename lane_fold<lane_combine<A, B>, R...>::type;
};
template <class Op, class... C>
struct lane<Expr<Op, C...>> {
  using type =
      typename lane_fold<lane_of<typename Expr<Op, C...>::value_type>, typename lane<C>::type...>::type;
};
template <class E>
using lane_t = typename lane<E>::type;

/// Builds Expr<Op, ...> from operands that may be tensors, expressions or numbers; a number
/// takes its type from the first tensor-like operand (PyTorch's weak scalars).
template <class Op, class First, class... Rest>
auto make(const First& first, const Rest&... rest) {
  if constexpr (ExprLike<First>) {
    using T = value_t<First>;
    auto conv = [](const auto& x) {
      if constexpr (ExprLike<std::remove_cvref_t<decltype(x)>>) return operand(x);
      else return scalar_for<T>(x);
    };
    return Expr<Op, decltype(conv(first)), decltype(conv(rest))...>(conv(first), conv(rest)...);
  } else {
    // The first operand is a number: find the first tensor-like one for typing.
    using Anchor = std::tuple_element_t<0, decltype(std::tuple_cat(
        std::conditional_t<ExprLike<Rest>, std::tuple<value_t<Rest>>, std::tuple<>>{}...))>;
    auto conv = [](const auto& x) {
      if constexpr (ExprLike<std::remove_cvref_t<decltype(x)>>) return operand(x);
      else return scalar_for<Anchor>(x);
    };
    return Expr<Op, decltype(conv(first)), decltype(conv(rest))...>(conv(first), conv(rest)...);
  }
}

template <class A, class B>
concept BinaryOperands = (ExprLike<A> && (ExprLike<B> || Number<B>)) || (Number<A> && ExprLike<B>);

namespace detail {
template <class X>
struct operand_value {
  using type = std::remove_cvref_t<X>;  // a number
};
template <ExprLike X>
struct operand_value<X> {
  using type = value_t<X>;
};
}  // namespace detail

/// An operand (tensor, expression or number) whose values are bool. PyTorch rejects
/// arithmetic that has no meaning on bool (negation, subtraction of two bools, abs, sign,
/// relu, pow of two bools, clamp); so do we, at compile time.
template <class X>
concept BoolValued = std::is_same_v<typename detail::operand_value<X>::type, bool>;

}  // namespace expr

// ---- operators ------------------------------------------------------------------------

#define LAZY_BINARY_OPERATOR(SYM, OP)                                   \
  template <class A, class B>                                          \
    requires expr::BinaryOperands<A, B>                                \
  auto operator SYM(const A& a, const B& b) {                          \
    return expr::make<ops::OP>(a, b);                                  \
  }
LAZY_BINARY_OPERATOR(+, Add)
LAZY_BINARY_OPERATOR(*, Mul)
LAZY_BINARY_OPERATOR(/, Div)
LAZY_BINARY_OPERATOR(==, Eq)
LAZY_BINARY_OPERATOR(!=, Ne)
LAZY_BINARY_OPERATOR(<, Lt)
LAZY_BINARY_OPERATOR(<=, Le)
LAZY_BINARY_OPERATOR(>, Gt)
LAZY_BINARY_OPERATOR(>=, Ge)
LAZY_BINARY_OPERATOR(&, LogicalAnd)
LAZY_BINARY_OPERATOR(|, LogicalOr)
#undef LAZY_BINARY_OPERATOR

/// Element-wise subtraction (not of two bool operands, as in PyTorch: use logical ops).
template <class A, class B>
  requires expr::BinaryOperands<A, B> && (!(expr::BoolValued<A> && expr::BoolValued<B>))
auto operator-(const A& a, const B& b) {
  return expr::make<ops::Sub>(a, b);
}

/// Element-wise negation (not of bool, as in PyTorch: use `!` / logical_not).
template <expr::ExprLike A>
  requires(!expr::BoolValued<A>)
auto operator-(const A& a) {
  return expr::make<ops::Neg>(a);
}
/// Element-wise logical not (a bool expression).
template <expr::ExprLike A>
auto operator!(const A& a) {
  return expr::make<ops::LogicalNot>(a);
}

// Unary functions. Those marked "not for bool" have no meaning on bool (PyTorch rejects
// them too): their constraint keeps a bool operand from compiling.

/// Element-wise e^x.
template <expr::ExprLike A>
auto exp(const A& a) {
  return expr::make<ops::Exp>(a);
}
/// Element-wise natural logarithm.
template <expr::ExprLike A>
auto log(const A& a) {
  return expr::make<ops::Log>(a);
}
/// Element-wise log(1 + x), accurate near 0.
template <expr::ExprLike A>
auto log1p(const A& a) {
  return expr::make<ops::Log1p>(a);
}
/// Element-wise e^x - 1, accurate near 0.
template <expr::ExprLike A>
auto expm1(const A& a) {
  return expr::make<ops::Expm1>(a);
}
/// Element-wise square root.
template <expr::ExprLike A>
auto sqrt(const A& a) {
  return expr::make<ops::Sqrt>(a);
}
/// Element-wise 1 / sqrt(x).
template <expr::ExprLike A>
auto rsqrt(const A& a) {
  return expr::make<ops::Rsqrt>(a);
}
/// Element-wise x * x (torch.square; one load of x where `x * x` has two). Not for bool.
template <expr::ExprLike A>
  requires(!expr::BoolValued<A>)
auto square(const A& a) {
  return expr::make<ops::Square>(a);
}
/// Element-wise absolute value. Not for bool.
template <expr::ExprLike A>
  requires(!expr::BoolValued<A>)
auto abs(const A& a) {
  return expr::make<ops::Abs>(a);
}
/// Element-wise sign: -1, 0 or 1. Not for bool.
template <expr::ExprLike A>
  requires(!expr::BoolValued<A>)
auto sign(const A& a) {
  return expr::make<ops::Sign>(a);
}
/// Element-wise sine.
template <expr::ExprLike A>
auto sin(const A& a) {
  return expr::make<ops::Sin>(a);
}
/// Element-wise cosine.
template <expr::ExprLike A>
auto cos(const A& a) {
  return expr::make<ops::Cos>(a);
}
/// Element-wise hyperbolic tangent.
template <expr::ExprLike A>
auto tanh(const A& a) {
  return expr::make<ops::Tanh>(a);
}
/// Element-wise logistic function 1 / (1 + e^-x).
template <expr::ExprLike A>
auto sigmoid(const A& a) {
  return expr::make<ops::Sigmoid>(a);
}
/// Element-wise max(x, 0), keeping NaN. Not for bool.
template <expr::ExprLike A>
  requires(!expr::BoolValued<A>)
auto relu(const A& a) {
  return expr::make<ops::Relu>(a);
}
/// Element-wise exact GELU, x * Phi(x).
template <expr::ExprLike A>
auto gelu(const A& a) {
  return expr::make<ops::Gelu>(a);
}
/// Element-wise x * sigmoid(x).
template <expr::ExprLike A>
auto silu(const A& a) {
  return expr::make<ops::Silu>(a);
}
/// Element-wise log(1 + e^x) (linear above 20).
template <expr::ExprLike A>
auto softplus(const A& a) {
  return expr::make<ops::Softplus>(a);
}
/// Element-wise logical not.
template <expr::ExprLike A>
auto logical_not(const A& a) {
  return expr::make<ops::LogicalNot>(a);
}

/// Element-wise a^b (not of two bool operands).
template <class A, class B>
  requires expr::BinaryOperands<A, B> && (!(expr::BoolValued<A> && expr::BoolValued<B>))
auto pow(const A& a, const B& b) {
  return expr::make<ops::Pow>(a, b);
}
/// Element-wise maximum (NaN-propagating).
template <class A, class B>
  requires expr::BinaryOperands<A, B>
auto maximum(const A& a, const B& b) {
  return expr::make<ops::Maximum>(a, b);
}
/// Element-wise minimum (NaN-propagating).
template <class A, class B>
  requires expr::BinaryOperands<A, B>
auto minimum(const A& a, const B& b) {
  return expr::make<ops::Minimum>(a, b);
}
/// Element-wise logical and / or of non-zero tests.
template <class A, class B>
  requires expr::BinaryOperands<A, B>
auto logical_and(const A& a, const B& b) {
  return expr::make<ops::LogicalAnd>(a, b);
}
template <class A, class B>
  requires expr::BinaryOperands<A, B>
auto logical_or(const A& a, const B& b) {
  return expr::make<ops::LogicalOr>(a, b);
}
/// Clamps to [lo, hi]; NaN stays NaN. Not for bool.
template <expr::ExprLike X, class L, class H>
  requires(!expr::BoolValued<X>)
auto clamp(const X& x, const L& lo, const H& hi) {
  return minimum(maximum(x, lo), hi);
}
/// Element-wise choice: a where cond is non-zero, b elsewhere (all three broadcast).
template <expr::ExprLike C, class A, class B>
auto where(const C& cond, const A& a, const B& b) {
  // A number operand takes its type from the other value operand, never from the condition.
  auto value = [](const auto& x, const auto& other) {
    using X = std::remove_cvref_t<decltype(x)>;
    using O = std::remove_cvref_t<decltype(other)>;
    if constexpr (expr::ExprLike<X>) {
      return expr::operand(x);
    } else if constexpr (expr::ExprLike<O>) {
      return expr::scalar_for<expr::value_t<O>>(x);
    } else {
      // Both are numbers: their common type (spelled through X and O, so that the
      // branch is only instantiated when it is taken).
      return expr::scalar_for<weak_scalar_t<std::int64_t, std::common_type_t<X, O>>>(x);
    }
  };
  auto va = value(a, b);
  auto vb = value(b, a);
  return Expr<ops::Where, expr::operand_t<C>, decltype(va), decltype(vb)>(expr::operand(cond), va, vb);
}
/// Explicit element type conversion.
template <Element U, expr::ExprLike X>
auto cast(const X& x) {
  return expr::make<ops::Cast<U>>(x);
}

}  // namespace lazy
// ---- end lazytensor/expr/expr.hpp ----

namespace lazy::expr {

/// A leaf reading node input number `slot`.
template <Element T>
struct KLeaf {
  using value_type = T;
  int slot;
};

/// An op over kernel-form children.
template <class Op, class... C>
struct KExpr {
  using op_type = Op;
  using value_type = typename Op::template result<typename C::value_type...>;
  std::tuple<C...> children;
};

template <class E>
struct kernel_form;
template <Element T>
struct kernel_form<Leaf<T>> {
  using type = KLeaf<T>;
};
template <Element T>
struct kernel_form<Scalar<T>> {
  using type = Scalar<T>;
};
template <class Op, class... C>
struct kernel_form<Expr<Op, C...>> {
  using type = KExpr<Op, typename kernel_form<C>::type...>;
};
template <class E>
using kernel_form_t = typename kernel_form<E>::type;

/// Lane type of a kernel-form expression (see lane_t).
template <class K>
struct klane;
template <Element T>
struct klane<KLeaf<T>> {
  using type = lane_of<T>;
};
template <Element T>
struct klane<Scalar<T>> {
  using type = lane_of<T>;
};
template <class Op, class... C>
struct klane<KExpr<Op, C...>> {
  using type = typename lane_fold<lane_of<typename KExpr<Op, C...>::value_type>,
                                  typename klane<C>::type...>::type;
};
template <class K>
using klane_t = typename klane<K>::type;

/// Number of tensor leaves in expression type E, repeats included: the most slots its
/// kernel form can need, so callers reserve the input list once instead of growing it.
template <class E>
struct leaf_count : std::integral_constant<std::size_t, 0> {};
template <Element T>
struct leaf_count<Leaf<T>> : std::integral_constant<std::size_t, 1> {};
template <class Op, class... C>
struct leaf_count<Expr<Op, C...>>
    : std::integral_constant<std::size_t, (std::size_t{0} + ... + leaf_count<C>::value)> {};
template <class E>
inline constexpr std::size_t leaf_count_v = leaf_count<std::remove_cvref_t<E>>::value;

/// Converts an expression to kernel form, appending its distinct leaf nodes to `inputs`.
/// With `edges`, a leaf's autograd edge is appended alongside, and two leaves share a slot
/// only when both node and edge agree (x * x.detach() has two slots: one gets a gradient).
template <Element T>
KLeaf<T> to_kernel(const Leaf<T>& l, std::vector<graph::NodePtr>& inputs,
                   std::vector<autograd::GradFnPtr>* edges = nullptr) {
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    if (inputs[i] == l.node && (!edges || (*edges)[i] == l.grad)) return {static_cast<int>(i)};
  }
  inputs.push_back(l.node);
  if (edges) edges->push_back(l.grad);
  return {static_cast<int>(inputs.size() - 1)};
}
template <Element T>
Scalar<T> to_kernel(const Scalar<T>& s, std::vector<graph::NodePtr>&, std::vector<autograd::GradFnPtr>* = nullptr) {
  return s;
}
template <class Op, class... C>
auto to_kernel(const Expr<Op, C...>& e, std::vector<graph::NodePtr>& inputs,
               std::vector<autograd::GradFnPtr>* edges = nullptr) {
  return std::apply(
      [&](const auto&... ch) {
        // Braced initialization evaluates left to right: slots follow operand order.
        return KExpr<Op, kernel_form_t<C>...>{std::tuple<kernel_form_t<C>...>{to_kernel(ch, inputs, edges)...}};
      },
      e.children());
}

/// Sum of the op costs of a kernel-form expression, per output element.
template <class K>
constexpr double kernel_cost() {
  if constexpr (requires { K::custom_cost; }) {
    return K::custom_cost;
  } else if constexpr (requires { typename K::op_type; }) {
    return []<class... C>(std::type_identity<std::tuple<C...>>) {
      return K::op_type::cost + (0.0 + ... + kernel_cost<C>());
    }(std::type_identity<decltype(K::children)>{});
  } else {
    return 0.0;
  }
}

/// "add(mul(in0, in1), 2)": the expression as text, for graph dumps (inK is input K).
template <Element T>
std::string kernel_text(const KLeaf<T>& l) {
  std::string s = "in";
  s += std::to_string(l.slot);
  return s;
}
template <Element T>
std::string kernel_text(const Scalar<T>& s) {
  std::string v = std::to_string(static_cast<double>(static_cast<compute_t<T>>(s.value)));
  v.erase(v.find_last_not_of('0') + 1);
  if (!v.empty() && v.back() == '.') v.pop_back();
  return v;
}
template <class Op, class... C>
std::string kernel_text(const KExpr<Op, C...>& k) {
  std::string s = std::string(Op::name) + "(";
  bool first = true;
  std::apply(
      [&](const auto&... ch) {
        ((s.append(first ? "" : ", ").append(kernel_text(ch)), first = false), ...);
      },
      k.children);
  return s + ")";
}

}  // namespace lazy::expr
// ---- end lazytensor/expr/kernel_form.hpp ----
// ---- begin lazytensor/expr/layout.hpp ----
// Broadcast layout of a kernel, resolved once when its node is built: the output's
// dimensions collapsed as far as every input allows, and each input's stride per collapsed
// dimension (0 where it is broadcast). The innermost stride of an input is always 0
// (splat) or 1 (contiguous load); a kernel is "flat" when one dimension remains.

#include <array>
#include <cstdint>
#include <vector>


namespace lazy::expr {

/// Collapsed iteration space of an element-wise kernel.
struct Layout {
  int ndim = 1;
  std::array<std::int64_t, kMaxRank> size{};
  /// Per input slot (inline for up to 4 inputs: no allocation for most kernels).
  core::SmallVector<std::array<std::int64_t, kMaxRank>, 4> stride;
  core::SmallVector<char, 8> splat;  ///< per input slot: innermost stride is 0

  bool flat() const { return ndim == 1; }
  std::int64_t inner() const { return size[ndim - 1]; }
  bool any_splat() const {
    for (char s : splat)
      if (s) return true;
    return false;
  }
};

/// Layout for writing `out` from inputs of the given shapes (each broadcastable to out).
Layout make_layout(const Shape& out, const std::vector<Shape>& inputs);

}  // namespace lazy::expr

#if LAZYTENSOR_HEADER_DEFINITIONS
namespace lazy::expr {

LAZYTENSOR_INLINE Layout make_layout(const Shape& out, const std::vector<Shape>& inputs) {
  const int r = out.rank();
  const std::size_t n = inputs.size();
  // The common case first: every input has the output's shape or is one element.
  bool flat = true;
  for (const Shape& s : inputs) flat = flat && (s == out || s.numel() == 1);
  if (flat) {
    Layout L;
    L.stride.resize(n);
    L.splat.resize(n);
    L.ndim = 1;
    L.size[0] = out.numel();
    for (std::size_t k = 0; k < n; ++k) {
      const bool one = inputs[k].numel() == 1 && out.numel() != 1;
      L.stride[k][0] = one ? 0 : 1;
      L.splat[k] = one ? 1 : 0;
    }
    return L;
  }
  // Uncollapsed strides in output coordinates, dropping output dims of size 1.
  std::vector<std::int64_t> sizes;
  std::vector<std::vector<std::int64_t>> strides(n);
  for (std::size_t k = 0; k < n; ++k) {
    const Shape& s = inputs[k];
    auto cs = contiguous_strides(s);
    const int off = r - s.rank();
    for (int d = 0; d < r; ++d) {
      if (out[d] == 1) continue;
      const int sd = d - off;
      strides[k].push_back(sd >= 0 && s[sd] != 1 ? cs[sd] : 0);
    }
  }
  for (int d = 0; d < r; ++d)
    if (out[d] != 1) sizes.push_back(out[d]);

  Layout L;
  L.stride.resize(n);
  L.splat.assign(n, 0);
  if (sizes.empty()) {  // a single element
    L.ndim = 1;
    L.size[0] = out.numel();
    for (std::size_t k = 0; k < n; ++k) {
      L.stride[k][0] = 0;
      L.splat[k] = inputs[k].numel() == 1 && out.numel() != 1 ? 1 : 0;
    }
    return L;
  }
  // Merge dimension d into d+1 while every input is contiguous across the pair.
  std::vector<std::int64_t> csize{sizes.back()};
  std::vector<std::vector<std::int64_t>> cstride(n);
  for (std::size_t k = 0; k < n; ++k) cstride[k].push_back(strides[k].back());
  for (int d = static_cast<int>(sizes.size()) - 2; d >= 0; --d) {
    bool mergeable = true;
    for (std::size_t k = 0; k < n && mergeable; ++k) {
      mergeable = strides[k][d] == cstride[k].front() * csize.front();
    }
    if (mergeable) {
      csize.front() *= sizes[d];
    } else {
      csize.insert(csize.begin(), sizes[d]);
      for (std::size_t k = 0; k < n; ++k) cstride[k].insert(cstride[k].begin(), strides[k][d]);
    }
  }
  L.ndim = static_cast<int>(csize.size());
  for (int d = 0; d < L.ndim; ++d) L.size[d] = csize[d];
  for (std::size_t k = 0; k < n; ++k) {
    for (int d = 0; d < L.ndim; ++d) L.stride[k][d] = cstride[k][d];
    L.splat[k] = cstride[k].back() == 0;
  }
  return L;
}

}  // namespace lazy::expr
#endif  // LAZYTENSOR_HEADER_DEFINITIONS
// ---- end lazytensor/expr/layout.hpp ----

namespace lazy::expr {

/// True when kernels with lane type S use xsimd batches (floating lanes); integer lanes run
/// the scalar loop, which compilers vectorize well enough for their rare use.
template <class S>
inline constexpr bool simd_lane_v = std::is_same_v<S, float> || std::is_same_v<S, double>;

template <class S>
using batch_t = xsimd::batch<S>;

/// Loads a batch of lane type S from storage of type T.
template <class S, class T>
inline batch_t<S> load_lane(const T* p) {
  if constexpr (std::is_same_v<S, T>) {
    return batch_t<S>::load_unaligned(p);
  } else if constexpr (std::is_same_v<T, bool>) {
    // The last batch may run into the buffer's padding, whose bytes can hold any value:
    // read bytes, since loading a bool that is neither 0 nor 1 is undefined behaviour.
    alignas(64) S tmp[batch_t<S>::size];
    const auto* bytes = reinterpret_cast<const unsigned char*>(p);
    for (std::size_t k = 0; k < batch_t<S>::size; ++k) tmp[k] = static_cast<S>(bytes[k] != 0);
    return batch_t<S>::load_aligned(tmp);
  } else {
    alignas(64) S tmp[batch_t<S>::size];
    for (std::size_t k = 0; k < batch_t<S>::size; ++k) tmp[k] = static_cast<S>(p[k]);
    return batch_t<S>::load_aligned(tmp);
  }
}

/// Converts a lane value to storage type T.
template <class T, class S>
inline T to_storage(S v) {
  if constexpr (std::is_same_v<T, bool>) return v != S(0);
  else if constexpr (std::is_same_v<T, bfloat16>) return bfloat16(static_cast<float>(v));
  else return static_cast<T>(v);
}

/// Stores a batch of lane type S to storage of type T.
template <class T, class S>
inline void store_lane(T* p, const batch_t<S>& b) {
  if constexpr (std::is_same_v<S, T>) {
    b.store_unaligned(p);
  } else {
    alignas(64) S tmp[batch_t<S>::size];
    b.store_aligned(tmp);
    for (std::size_t k = 0; k < batch_t<S>::size; ++k) p[k] = to_storage<T>(tmp[k]);
  }
}

template <class S, class K>
struct Eval;

template <class S, Element T>
struct Eval<S, KLeaf<T>> {
  static constexpr bool simd = simd_lane_v<S>;
  const T* base;
  const T* ptr;
  bool splat;
  int slot;

  Eval(const KLeaf<T>& k, const void* const* ptrs, const char* splats)
      : base(static_cast<const T*>(ptrs[k.slot])), ptr(base), splat(splats[k.slot] != 0), slot(k.slot) {}
  void seek(const std::int64_t* offsets) { ptr = base + offsets[slot]; }
  S coeff(std::int64_t i) const { return static_cast<S>(static_cast<compute_t<T>>(ptr[splat ? 0 : i])); }
  template <bool Contig>
  batch_t<S> packet(std::int64_t i) const {
    if (!Contig && splat) return batch_t<S>(static_cast<S>(static_cast<compute_t<T>>(ptr[0])));
    if constexpr (std::is_same_v<T, bfloat16>) {
      alignas(64) S tmp[batch_t<S>::size];
      for (std::size_t k = 0; k < batch_t<S>::size; ++k) tmp[k] = static_cast<S>(float(ptr[i + k]));
      return batch_t<S>::load_aligned(tmp);
    } else {
      return load_lane<S>(ptr + i);
    }
  }
};

template <class S, Element T>
struct Eval<S, Scalar<T>> {
  static constexpr bool simd = simd_lane_v<S>;
  S value;
  Eval(const Scalar<T>& s, const void* const*, const char*) : value(static_cast<S>(static_cast<compute_t<T>>(s.value))) {}
  void seek(const std::int64_t*) {}
  S coeff(std::int64_t) const { return value; }
  template <bool Contig>
  batch_t<S> packet(std::int64_t) const {
    return batch_t<S>(value);
  }
};

// An op node's evaluator holds its children as named members, one specialization per arity
// (every op has one, two or three operands): through std::tuple and std::apply each node
// and method instantiated five layers of library templates (apply, __apply_impl, invoke,
// ...), a third of the compile time of a small program's kernels, and calls nested as deep
// at -O0 (the sanitizer builds).
template <class S, class Op, class C0>
struct Eval<S, KExpr<Op, C0>> {
  static constexpr bool simd = simd_lane_v<S>;
  Eval<S, C0> c0;

  Eval(const KExpr<Op, C0>& k, const void* const* ptrs, const char* splats) : c0(std::get<0>(k.children), ptrs, splats) {}
  void seek(const std::int64_t* offsets) { c0.seek(offsets); }
  S coeff(std::int64_t i) const { return Op::apply(c0.coeff(i)); }
  template <bool Contig>
  batch_t<S> packet(std::int64_t i) const {
    return Op::apply(c0.template packet<Contig>(i));
  }
};

template <class S, class Op, class C0, class C1>
struct Eval<S, KExpr<Op, C0, C1>> {
  static constexpr bool simd = simd_lane_v<S>;
  Eval<S, C0> c0;
  Eval<S, C1> c1;

  Eval(const KExpr<Op, C0, C1>& k, const void* const* ptrs, const char* splats)
      : c0(std::get<0>(k.children), ptrs, splats), c1(std::get<1>(k.children), ptrs, splats) {}
  void seek(const std::int64_t* offsets) {
    c0.seek(offsets);
    c1.seek(offsets);
  }
  S coeff(std::int64_t i) const { return Op::apply(c0.coeff(i), c1.coeff(i)); }
  template <bool Contig>
  batch_t<S> packet(std::int64_t i) const {
    return Op::apply(c0.template packet<Contig>(i), c1.template packet<Contig>(i));
  }
};

template <class S, class Op, class C0, class C1, class C2>
struct Eval<S, KExpr<Op, C0, C1, C2>> {
  static constexpr bool simd = simd_lane_v<S>;
  Eval<S, C0> c0;
  Eval<S, C1> c1;
  Eval<S, C2> c2;

  Eval(const KExpr<Op, C0, C1, C2>& k, const void* const* ptrs, const char* splats)
      : c0(std::get<0>(k.children), ptrs, splats), c1(std::get<1>(k.children), ptrs, splats),
        c2(std::get<2>(k.children), ptrs, splats) {}
  void seek(const std::int64_t* offsets) {
    c0.seek(offsets);
    c1.seek(offsets);
    c2.seek(offsets);
  }
  S coeff(std::int64_t i) const { return Op::apply(c0.coeff(i), c1.coeff(i), c2.coeff(i)); }
  template <bool Contig>
  batch_t<S> packet(std::int64_t i) const {
    return Op::apply(c0.template packet<Contig>(i), c1.template packet<Contig>(i), c2.template packet<Contig>(i));
  }
};

// ---- exact (per-node) evaluation -------------------------------------------------------
// PyTorch computes each op in its own type. One floating lane for a whole kernel matches
// that for floating values (a wider lane only rounds later), but not for integers, which a
// float lane cannot hold above 2^24 (2^53 for double): where(x > 0, i64_a, i64_b) or
// (i64_a + i64_b) * 0.5 must stay exact. Kernels that mix int32/int64 values with a
// floating lane therefore evaluate node by node, each op in its own type, on the scalar
// path; every other kernel keeps the single SIMD lane.

/// True when K holds an int32 or int64 value anywhere (leaf, scalar or op result).
template <class K>
struct has_integral : std::bool_constant<is_integral_v<typename K::value_type>> {};
template <class Op, class... C>
struct has_integral<KExpr<Op, C...>>
    : std::bool_constant<is_integral_v<typename KExpr<Op, C...>::value_type> || (has_integral<C>::value || ...)> {};

/// True when kernel K must use per-node evaluation (see above).
template <class K>
inline constexpr bool needs_exact_v = simd_lane_v<klane_t<K>> && has_integral<K>::value;

/// The lane a kernel's root produces: the single lane, or (per-node kernels) the lane of
/// the root's own type, so an int64 result is never squeezed through a float.
template <class K>
using kernel_lane_t = std::conditional_t<needs_exact_v<K>, lane_of<typename K::value_type>, klane_t<K>>;

/// Type an op computes in, given its operands' value types (PyTorch: comparisons and
/// where compute in the promoted operand type; everything else in its result type).
template <class Op, class... A>
struct op_compute {
  using type = typename Op::template result<A...>;
};
#define LAZY_PROMOTED_COMPUTE(OP)     \
  template <class A, class B>         \
  struct op_compute<ops::OP, A, B> {  \
    using type = promote_t<A, B>;     \
  };
LAZY_PROMOTED_COMPUTE(Eq)
LAZY_PROMOTED_COMPUTE(Ne)
LAZY_PROMOTED_COMPUTE(Lt)
LAZY_PROMOTED_COMPUTE(Le)
LAZY_PROMOTED_COMPUTE(Gt)
LAZY_PROMOTED_COMPUTE(Ge)
LAZY_PROMOTED_COMPUTE(LogicalAnd)
LAZY_PROMOTED_COMPUTE(LogicalOr)
#undef LAZY_PROMOTED_COMPUTE
template <class A>
struct op_compute<ops::LogicalNot, A> {
  using type = A;
};

/// Rounds a value computed in lane L to what a tensor of type V holds, in V's lane.
template <Element V, class L>
inline lane_of<V> round_to(L v) {
  if constexpr (std::is_same_v<V, bool>) return v != L(0) ? 1 : 0;
  else if constexpr (std::is_same_v<V, bfloat16>) return static_cast<float>(bfloat16(static_cast<float>(v)));
  else return static_cast<lane_of<V>>(v);
}

template <class S, class K>
struct ExactEval;

template <class S, Element T>
struct ExactEval<S, KLeaf<T>> : Eval<lane_of<T>, KLeaf<T>> {
  using Eval<lane_of<T>, KLeaf<T>>::Eval;
};
template <class S, Element T>
struct ExactEval<S, Scalar<T>> : Eval<lane_of<T>, Scalar<T>> {
  using Eval<lane_of<T>, Scalar<T>>::Eval;
};

/// Evaluates an op in its own compute type; coeff() returns the op's value in the lane of
/// its result type (S is unused below the root: each node picks its own).
template <class S, class Op, class... C>
struct ExactEval<S, KExpr<Op, C...>> {
  static constexpr bool simd = false;
  using V = typename KExpr<Op, C...>::value_type;
  std::tuple<ExactEval<S, C>...> children;

  ExactEval(const KExpr<Op, C...>& k, const void* const* ptrs, const char* splats)
      : children(std::apply(
            [&](const auto&... ch) { return std::tuple<ExactEval<S, C>...>{ExactEval<S, C>(ch, ptrs, splats)...}; },
            k.children)) {}
  void seek(const std::int64_t* offsets) {
    std::apply([&](auto&... ch) { (ch.seek(offsets), ...); }, children);
  }
  lane_of<V> coeff(std::int64_t i) const {
    return std::apply([&](const auto&... ch) { return apply(ch...)(i); }, children);
  }

 private:
  template <class... E>
  auto apply(const E&... ch) const {
    return [&](std::int64_t i) -> lane_of<V> {
      if constexpr (std::is_same_v<Op, ops::Where>) {
        // The condition is tested in its own type (a NaN float is non-zero, not converted).
        const auto& [c, a, b] = std::tie(ch...);
        using L = lane_of<op_compute_t<ops::Where, typename C::value_type...>>;
        return round_to<V>(c.coeff(i) != 0 ? static_cast<L>(a.coeff(i)) : static_cast<L>(b.coeff(i)));
      } else if constexpr (is_cast<Op>::value) {
        // A conversion is a store into the target type (truncation, != 0, rounding).
        return round_to<V>(to_storage<V>((ch.coeff(i), ...)));
      } else {
        using L = lane_of<typename op_compute<Op, typename C::value_type...>::type>;
        return round_to<V>(Op::apply(static_cast<L>(ch.coeff(i))...));
      }
    };
  }
  template <class O>
  struct is_cast : std::false_type {};
  template <Element U>
  struct is_cast<ops::Cast<U>> : std::true_type {};
  template <class O, class... A>
  using op_compute_t = typename op_compute<O, A...>::type;
};

/// Root evaluator of a kernel with lane S: converts the exact root value to S.
template <class S, class K>
struct ExactRoot {
  static constexpr bool simd = false;
  ExactEval<S, K> ev;
  ExactRoot(const K& k, const void* const* ptrs, const char* splats) : ev(k, ptrs, splats) {}
  void seek(const std::int64_t* offsets) { ev.seek(offsets); }
  S coeff(std::int64_t i) const { return static_cast<S>(ev.coeff(i)); }
};

/// The evaluator a kernel of lane S over K uses.
template <class S, class K>
using Evaluator = std::conditional_t<needs_exact_v<K>, ExactRoot<S, K>, Eval<S, K>>;

/// Outputs at least this large are written with non-temporal stores: they cannot stay in
/// cache anyway, and streaming skips reading each output line before overwriting it.
inline constexpr std::int64_t kStreamingStoreBytes = std::int64_t(32) << 20;

/// Stores a batch at a batch-aligned address, bypassing the cache where the ISA allows.
template <class S>
inline void stream_store(S* p, const batch_t<S>& b) {
#if defined(__AVX512F__)
  if constexpr (batch_t<S>::size * sizeof(S) == 64) {
    if constexpr (std::is_same_v<S, float>) _mm512_stream_ps(p, b);
    else _mm512_stream_pd(p, b);
    return;
  }
#endif
#if defined(__AVX__)
  if constexpr (batch_t<S>::size * sizeof(S) == 32) {
    if constexpr (std::is_same_v<S, float>) _mm256_stream_ps(p, b);
    else _mm256_stream_pd(p, b);
    return;
  }
#endif
#if defined(__SSE2__)
  if constexpr (batch_t<S>::size * sizeof(S) == 16) {
    if constexpr (std::is_same_v<S, float>) _mm_stream_ps(p, b);
    else _mm_stream_pd(p, b);
    return;
  }
#endif
  b.store_aligned(p);
}

/// Orders earlier non-temporal stores before later loads of other threads.
inline void store_fence() {
#if defined(__SSE2__)
  _mm_sfence();
#endif
}

/// Keeps the optimizer from inlining a kernel loop into each of its callers: the loop is
/// called once per task, so the call costs nothing, and every inlined copy of an
/// expression's SIMD body would be compiled again.
#if defined(__GNUC__)
#define LAZY_KERNEL_LOOP __attribute__((noinline))
#else
#define LAZY_KERNEL_LOOP
#endif

/// Copies `bytes` bytes from `src` to `dst` bypassing the cache where the ISA allows
/// (both 64-byte aligned; the caller fences). Moves bits, whatever they encode. Not
/// inlined: it would crowd the registers of the slice loop calling it.
LAZY_KERNEL_LOOP inline void stream_copy(void* dst, const void* src, std::size_t bytes) {
  using B = batch_t<float>;
  constexpr std::size_t kBatchBytes = B::size * sizeof(float);
  auto* d = static_cast<float*>(dst);
  const auto* s = static_cast<const float*>(src);
  const std::size_t whole = bytes / kBatchBytes * kBatchBytes;
  for (std::size_t i = 0; i < whole / sizeof(float); i += B::size)
    stream_store<float>(d + i, B::load_aligned(s + i));
  if (whole < bytes)
    std::memcpy(static_cast<std::byte*>(dst) + whole, static_cast<const std::byte*>(src) + whole,
                bytes - whole);
}

/// Stores the first `count` lanes of `b` to `p` (the tail of a range).
template <class Tout, class S>
inline void store_partial(Tout* p, const batch_t<S>& b, std::int64_t count) {
  alignas(64) S tmp[batch_t<S>::size];
  b.store_aligned(tmp);
  for (std::int64_t k = 0; k < count; ++k) p[k] = to_storage<Tout>(tmp[k]);
}

/// Evaluates elements [b, e) of a kernel into `out` (indices relative to the evaluator's
/// leaf positions). `Contig`: no leaf is a splatted single element. The tail is one whole
/// batch of which only the owned lanes are stored: buffers carry a spare batch of padding,
/// so the read stays in bounds, and no scalar copy of the expression is compiled. With
/// `Stream`, stores bypass the cache (out + b batch-aligned; the caller fences).
template <class S, class Tout, bool Contig, bool Stream, class Ev>
LAZY_KERNEL_LOOP void eval_range(const Ev& ev_in, Tout* out, std::int64_t b, std::int64_t e) {
  // A local copy: stores through `out` may alias anything, which would otherwise force a
  // reload of every leaf pointer from *ev_in after each store.
  const Ev ev = ev_in;
  if constexpr (Ev::simd) {
    constexpr std::int64_t W = batch_t<S>::size;
    std::int64_t i = b;
    for (; i + W <= e; i += W) {
      if constexpr (Stream) stream_store<S>(out + i, ev.template packet<Contig>(i));
      else store_lane<Tout, S>(out + i, ev.template packet<Contig>(i));
    }
    if (i < e) store_partial<Tout, S>(out + i, ev.template packet<Contig>(i), e - i);
  } else {
    for (std::int64_t i = b; i < e; ++i) out[i] = to_storage<Tout>(ev.coeff(i));
  }
}

/// Evaluates rows [r0, r1) of a layout with several collapsed dimensions.
template <class S, class Tout, class Ev>
LAZY_KERNEL_LOOP void eval_rows(Ev& ev, const Layout& L, Tout* out, std::int64_t r0, std::int64_t r1) {
  const int outer = L.ndim - 1;
  const std::int64_t inner = L.inner();
  const std::size_t nin = L.stride.size();
  std::array<std::int64_t, kMaxRank> idx{};
  std::int64_t rem = r0;
  for (int d = outer - 1; d >= 0; --d) {
    idx[d] = rem % L.size[d];
    rem /= L.size[d];
  }
  std::vector<std::int64_t> off(nin);
  for (std::size_t k = 0; k < nin; ++k) {
    off[k] = 0;
    for (int d = 0; d < outer; ++d) off[k] += idx[d] * L.stride[k][d];
  }
  for (std::int64_t r = r0; r < r1; ++r) {
    ev.seek(off.data());
    eval_range<S, Tout, false, false>(ev, out + r * inner, 0, inner);
    // Advance the odometer over the outer dimensions.
    for (int d = outer - 1; d >= 0; --d) {
      for (std::size_t k = 0; k < nin; ++k) off[k] += L.stride[k][d];
      if (++idx[d] < L.size[d]) break;
      for (std::size_t k = 0; k < nin; ++k) off[k] -= L.stride[k][d] * L.size[d];
      idx[d] = 0;
    }
  }
}

}  // namespace lazy::expr
// ---- end lazytensor/expr/evaluator.hpp ----

namespace lazy::expr {

/// A value and its derivative with respect to the target leaf.
template <class V>
struct Dual {
  V v;
  V t;
};

template <class S, class K>
struct DualEval;

template <class S, Element T>
struct DualEval<S, KLeaf<T>> {
  Eval<S, KLeaf<T>> e;
  bool active;
  DualEval(const KLeaf<T>& k, const void* const* ptrs, const char* splats, int target)
      : e(k, ptrs, splats), active(k.slot == target) {}
  void seek(const std::int64_t* offsets) { e.seek(offsets); }
  Dual<S> coeff(std::int64_t i) const { return {e.coeff(i), S(active ? 1 : 0)}; }
  template <bool C>
  Dual<batch_t<S>> packet(std::int64_t i) const {
    return {e.template packet<C>(i), batch_t<S>(S(active ? 1 : 0))};
  }
};

template <class S, Element T>
struct DualEval<S, Scalar<T>> {
  Eval<S, Scalar<T>> e;
  static constexpr bool active = false;
  DualEval(const Scalar<T>& k, const void* const* ptrs, const char* splats, int) : e(k, ptrs, splats) {}
  void seek(const std::int64_t*) {}
  Dual<S> coeff(std::int64_t i) const { return {e.coeff(i), S(0)}; }
  template <bool C>
  Dual<batch_t<S>> packet(std::int64_t i) const {
    return {e.template packet<C>(i), batch_t<S>(S(0))};
  }
};

// Op nodes hold their children as named members, one specialization per arity (as Eval
// does, evaluator.hpp: std::tuple and std::apply cost a third of a small program's kernel
// compile time). The tangent sums d<I>(operands..., y) * tangent_I over the operands that
// depend on the target, in operand order.
template <class S, class Op, class C0>
struct DualEval<S, KExpr<Op, C0>> {
  DualEval<S, C0> c0;
  bool active;

  DualEval(const KExpr<Op, C0>& k, const void* const* ptrs, const char* splats, int target)
      : c0(std::get<0>(k.children), ptrs, splats, target), active(c0.active) {}
  void seek(const std::int64_t* offsets) { c0.seek(offsets); }
  Dual<S> coeff(std::int64_t i) const { return combine(c0.coeff(i)); }
  template <bool Contig>
  Dual<batch_t<S>> packet(std::int64_t i) const {
    return combine(c0.template packet<Contig>(i));
  }

 private:
  template <class V>
  Dual<V> combine(const Dual<V>& a) const {
    const V y = Op::apply(a.v);
    V t(0);
    if (active && c0.active) t = t + Op::template d<0>(a.v, y) * a.t;
    return {y, t};
  }
};

template <class S, class Op, class C0, class C1>
struct DualEval<S, KExpr<Op, C0, C1>> {
  DualEval<S, C0> c0;
  DualEval<S, C1> c1;
  bool active;

  DualEval(const KExpr<Op, C0, C1>& k, const void* const* ptrs, const char* splats, int target)
      : c0(std::get<0>(k.children), ptrs, splats, target), c1(std::get<1>(k.children), ptrs, splats, target),
        active(c0.active || c1.active) {}
  void seek(const std::int64_t* offsets) {
    c0.seek(offsets);
    c1.seek(offsets);
  }
  Dual<S> coeff(std::int64_t i) const { return combine(c0.coeff(i), c1.coeff(i)); }
  template <bool Contig>
  Dual<batch_t<S>> packet(std::int64_t i) const {
    return combine(c0.template packet<Contig>(i), c1.template packet<Contig>(i));
  }

 private:
  template <class V>
  Dual<V> combine(const Dual<V>& a, const Dual<V>& b) const {
    const V y = Op::apply(a.v, b.v);
    V t(0);
    if (active) {
      if (c0.active) t = t + Op::template d<0>(a.v, b.v, y) * a.t;
      if (c1.active) t = t + Op::template d<1>(a.v, b.v, y) * b.t;
    }
    return {y, t};
  }
};

template <class S, class Op, class C0, class C1, class C2>
struct DualEval<S, KExpr<Op, C0, C1, C2>> {
  DualEval<S, C0> c0;
  DualEval<S, C1> c1;
  DualEval<S, C2> c2;
  bool active;

  DualEval(const KExpr<Op, C0, C1, C2>& k, const void* const* ptrs, const char* splats, int target)
      : c0(std::get<0>(k.children), ptrs, splats, target), c1(std::get<1>(k.children), ptrs, splats, target),
        c2(std::get<2>(k.children), ptrs, splats, target), active(c0.active || c1.active || c2.active) {}
  void seek(const std::int64_t* offsets) {
    c0.seek(offsets);
    c1.seek(offsets);
    c2.seek(offsets);
  }
  Dual<S> coeff(std::int64_t i) const { return combine(c0.coeff(i), c1.coeff(i), c2.coeff(i)); }
  template <bool Contig>
  Dual<batch_t<S>> packet(std::int64_t i) const {
    return combine(c0.template packet<Contig>(i), c1.template packet<Contig>(i), c2.template packet<Contig>(i));
  }

 private:
  template <class V>
  Dual<V> combine(const Dual<V>& a, const Dual<V>& b, const Dual<V>& c) const {
    const V y = Op::apply(a.v, b.v, c.v);
    V t(0);
    if (active) {
      if (c0.active) t = t + Op::template d<0>(a.v, b.v, c.v, y) * a.t;
      if (c1.active) t = t + Op::template d<1>(a.v, b.v, c.v, y) * b.t;
      if (c2.active) t = t + Op::template d<2>(a.v, b.v, c.v, y) * c.t;
    }
    return {y, t};
  }
};

/// Kernel form of "g * d(fwd)/d(input `target`)": the forward kernel, the incoming
/// gradient as the last input slot, and the target slot (a run-time value: one kernel
/// type serves every leaf of the expression).
template <class K, Element Tg>
struct KGrad {
  using lane = lane_combine<klane_t<K>, Tg>;
  using value_type = lane;
  static constexpr bool is_grad_kernel = true;
  static constexpr double custom_cost = 3 * kernel_cost<K>() + 1;
  K fwd;
  KLeaf<Tg> grad;
  int target;
};

template <class K, Element Tg>
struct klane<KGrad<K, Tg>> {
  using type = typename KGrad<K, Tg>::lane;
};

template <class S, class K, Element Tg>
struct Eval<S, KGrad<K, Tg>> {
  static constexpr bool simd = simd_lane_v<S>;
  DualEval<S, K> f;
  Eval<S, KLeaf<Tg>> g;
  Eval(const KGrad<K, Tg>& k, const void* const* ptrs, const char* splats)
      : f(k.fwd, ptrs, splats, k.target), g(k.grad, ptrs, splats) {}
  void seek(const std::int64_t* offsets) {
    f.seek(offsets);
    g.seek(offsets);
  }
  S coeff(std::int64_t i) const { return g.coeff(i) * f.coeff(i).t; }
  template <bool C>
  batch_t<S> packet(std::int64_t i) const {
    return g.template packet<C>(i) * f.template packet<C>(i).t;
  }
};

/// "grad_in2(mul(in0, in1)) * in3" for graph dumps.
template <class K, Element Tg>
std::string kernel_text(const KGrad<K, Tg>& k) {
  return "d/din" + std::to_string(k.target) + "(" + kernel_text(k.fwd) + ") * " + kernel_text(k.grad);
}

}  // namespace lazy::expr
// ---- end lazytensor/expr/dual.hpp ----

namespace lazy::graph {

/// A producer whose rows a consumer can compute block by block into its own buffer
/// (GEMM feeding an element-wise epilogue).
class RowProducer {
 public:
  virtual ~RowProducer() = default;
  /// Writes rows [r0, r1) of this node's value (viewed as rows x last dim) into `out`,
  /// a buffer laid out like this node's value. Runs on the calling thread only. The
  /// producer cuts the range at fixed row_block() boundaries, so the values do not depend
  /// on how callers split the rows (bitwise-identical results for any thread count).
  virtual void produce_rows(void* out, std::int64_t r0, std::int64_t r1) = 0;
  /// The rows one block holds (callers split on multiples of it to avoid partial blocks).
  virtual std::int64_t row_block() const = 0;
  /// Called once on the executing thread before any produce_rows of a step (the producer
  /// may prepare shared state there, using the device's threads) ...
  virtual void begin_rows(ExecContext& ctx) { (void)ctx; }
  /// ... and once after the last one.
  virtual void end_rows() {}

  /// begin_rows / end_rows around a scope, end_rows also when the scope throws.
  class Session {
   public:
    Session(RowProducer& p, ExecContext& ctx);
    ~Session();
    Session(const Session&) = delete;
    Session& operator=(const Session&) = delete;

   private:
    RowProducer& p_;
  };
};

/// The per-expression part of an element-wise kernel: its loops.
class ElementwiseKernel {
 public:
  virtual ~ElementwiseKernel() = default;
  /// Elements [b, e) of a flat kernel (inputs of the output's shape, or single elements
  /// flagged in `splat`). `contig`: no splat. `stream`: non-temporal stores, out + b
  /// batch-aligned, the caller fences.
  virtual void flat(const void* const* in, const char* splat, void* out, std::int64_t b, std::int64_t e, bool contig,
                    bool stream) const = 0;
  /// Rows [r0, r1) of a kernel with a multi-dimensional broadcast layout.
  virtual void rows(const void* const* in, const expr::Layout& layout, void* out, std::int64_t r0,
                    std::int64_t r1) const = 0;
  /// The expression as text ("add(mul(in0, in1), 2)").
  virtual std::string text() const = 0;
  /// Estimated cost per element (1 = one add).
  virtual double cost() const = 0;
  /// Identity of the code: equal hashes, same kernel up to scalar values. Scalar values
  /// never enter it (not even 0 and +-1, which DESIGN allows: no kernel specializes on
  /// them), so a new learning rate or a schedule reaching 0 never changes a plan.
  virtual std::uint64_t hash() const = 0;
};

/// The loops of kernel-form expression K writing Tout.
template <class K, Element Tout>
class CompiledKernel final : public ElementwiseKernel {
 public:
  using S = expr::kernel_lane_t<K>;
  using Ev = expr::Evaluator<S, K>;

  explicit CompiledKernel(K k) : k_(std::move(k)) {}

  void flat(const void* const* in, const char* splat, void* out_v, std::int64_t b, std::int64_t e, bool contig,
            bool stream) const override {
    Tout* out = static_cast<Tout*>(out_v);
    Ev ev(k_, in, splat);
    if constexpr (Ev::simd && std::is_same_v<S, Tout>) {
      if (stream) {
        expr::eval_range<S, Tout, true, true>(ev, out, b, e);
        return;
      }
    }
    if (contig) expr::eval_range<S, Tout, true, false>(ev, out, b, e);
    else expr::eval_range<S, Tout, false, false>(ev, out, b, e);
  }
  void rows(const void* const* in, const expr::Layout& layout, void* out, std::int64_t r0,
            std::int64_t r1) const override {
    Ev ev(k_, in, layout.splat.data());
    expr::eval_rows<S, Tout>(ev, layout, static_cast<Tout*>(out), r0, r1);
  }
  std::string text() const override { return expr::kernel_text(k_); }
  double cost() const override { return expr::kernel_cost<K>(); }
  std::uint64_t hash() const override {
    static const std::uint64_t h = typeid(K).hash_code();  // hashes the type's name: once
    return h;
  }

  /// Whether this kernel can stream its stores (a SIMD lane that is the output type).
  static constexpr bool can_stream = Ev::simd && std::is_same_v<S, Tout>;

 private:
  K k_;
};

/// Evaluates an element-wise kernel into a tensor.
class ElementwiseNode final : public Node {
 public:
  ElementwiseNode(std::shared_ptr<const ElementwiseKernel> kernel, bool can_stream, DType dtype, Shape shape,
                  Device* device, std::vector<NodePtr> inputs);

  /// Element-wise: every output dimension splits; inputs aligned right (NumPy).
  std::optional<BlockRule> block_rule() const override { return aligned_block_rule(shape(), inputs()); }
  /// The same kernel over other inputs (the SPMD partitioner runs one per shard). The
  /// kernel is shared: it holds only the expression's form and scalars, never data.
  NodePtr with_inputs(std::vector<NodePtr> inputs, Shape shape, Device* device) const override {
    return std::make_shared<ElementwiseNode>(kernel_, can_stream_, dtype(), shape, device, std::move(inputs));
  }

  std::string op_name() const override { return "fused"; }
  std::string describe() const override { return kernel_->text(); }
  double cost_per_element() const override { return kernel_->cost(); }
  std::uint64_t structural_hash() const override { return hash_combine(Node::structural_hash(), kernel_->hash()); }
  const expr::Layout& layout() const { return layout_; }
  const ElementwiseKernel& kernel() const { return *kernel_; }
  /// True when this node runs a GEMM producer in row blocks (see fuse_producers).
  bool takes_producer() const { return fused_slot_ >= 0; }
  /// True when the kernel can write its output with non-temporal stores.
  bool can_stream() const { return can_stream_; }

  void fuse_producers() override;

 protected:
  void compute(ExecContext& ctx) override;

  void finish() override;

 private:
  void run(ExecContext& ctx, const std::vector<const void*>& ptrs, void* out) const;

  // The producer's row blocks (fixed by the shapes, not by the thread count), each
  // followed at once by the epilogue while it is still in cache.
  void run_with_producer(ExecContext& ctx, const std::vector<const void*>& ptrs, void* out);

  double producer_cost() const { return inputs()[fused_slot_]->cost_per_element(); }

  std::shared_ptr<const ElementwiseKernel> kernel_;
  bool can_stream_;
  expr::Layout layout_;
  int fused_slot_ = -1;
};

/// A pending-node-to-be for kernel-form expression `k` writing Tout of `shape` on `device`
/// (not yet submitted).
template <Element Tout, class K>
NodePtr elementwise_node(K k, const Shape& shape, Device* device, std::vector<NodePtr> inputs) {
  using CK = CompiledKernel<K, Tout>;
  return std::make_shared<ElementwiseNode>(std::make_shared<const CK>(std::move(k)), CK::can_stream, dtype_of<Tout>(),
                                           shape, device, std::move(inputs));
}

}  // namespace lazy::graph

#if LAZYTENSOR_HEADER_DEFINITIONS
namespace lazy::graph {

LAZYTENSOR_INLINE RowProducer::Session::Session(RowProducer& p, ExecContext& ctx) : p_(p) { p_.begin_rows(ctx); }

LAZYTENSOR_INLINE RowProducer::Session::~Session() { p_.end_rows(); }

LAZYTENSOR_INLINE ElementwiseNode::ElementwiseNode(std::shared_ptr<const ElementwiseKernel> kernel,
  bool can_stream,
  DType dtype,
  Shape shape,
  Device* device,
  std::vector<NodePtr> inputs)
    : Node(NodeKind::Elementwise, dtype, shape, device, std::move(inputs)), kernel_(std::move(kernel)),
      can_stream_(can_stream) {
  std::vector<Shape> shapes;
  shapes.reserve(this->inputs().size());
  for (const auto& in : this->inputs()) shapes.push_back(in->shape());
  layout_ = expr::make_layout(shape, shapes);
}

LAZYTENSOR_INLINE void ElementwiseNode::fuse_producers() {
  // Take over a GEMM producer that nothing else reads: it then runs in row blocks, each
  // followed at once by this epilogue while the block is still in cache.
  fused_slot_ = -1;
  const auto& ins = inputs();
  for (std::size_t i = 0; i < ins.size(); ++i) {
    if (ins[i]->kind() != NodeKind::Gemm) continue;
    auto* rp = dynamic_cast<RowProducer*>(ins[i].get());
    if (!rp || !ins[i]->pending() || ins[i]->dtype() != dtype() || !(ins[i]->shape() == shape()) ||
        shape().rank() < 1 || !(layout_.flat() || layout_.inner() == shape()[shape().rank() - 1]))
      continue;
    long holders = 0;
    for (const auto& p : ins) holders += (p == ins[i]);
    if (ins[i].use_count() != holders + 1) continue;  // + 1: the plan's reference
    ins[i]->set_deferred(true);
    fused_slot_ = static_cast<int>(i);
    return;
  }
}

LAZYTENSOR_INLINE void ElementwiseNode::compute(ExecContext& ctx) {
  const auto& ins = inputs();
  std::vector<const void*> ptrs(ins.size());
  for (std::size_t i = 0; i < ins.size(); ++i) {
    ptrs[i] = static_cast<int>(i) == fused_slot_ ? nullptr : ins[i]->buffer()->data();
  }
  auto buf = allocate_output(ctx, fused_slot_ < 0);
  void* out = buf->data();
  if (fused_slot_ >= 0) {
    ptrs[fused_slot_] = out;  // the epilogue reads the GEMM block in place
    run_with_producer(ctx, ptrs, out);
  } else {
    run(ctx, ptrs, out);
  }
  set_buffer(std::move(buf));
}

LAZYTENSOR_INLINE void ElementwiseNode::finish() {
  fused_slot_ = -1;
  Node::finish();
}

LAZYTENSOR_INLINE void ElementwiseNode::run(ExecContext& ctx, const std::vector<const void*>& ptrs, void* out) const {
  const std::int64_t n = numel();
  if (n == 0) return;
  auto& pool = ctx.device.threads();
  const double cost = kernel_->cost();
  const std::int64_t tasks = task_count(pool, n, cost);
  if (layout_.flat()) {
    const bool contig = !layout_.any_splat();
    const bool stream = can_stream_ && contig &&
                        n * static_cast<std::int64_t>(dtype_size(dtype())) >= expr::kStreamingStoreBytes;
    pool.parallel_for(tasks, [&](std::int64_t t) {
      auto [b, e] = task_range(n, tasks, t, kPadElements);
      kernel_->flat(ptrs.data(), layout_.splat.data(), out, b, e, contig, stream);
      if (stream) expr::store_fence();
    });
  } else {
    const std::int64_t rows = n / layout_.inner();
    const std::int64_t rtasks = std::min(tasks, rows);
    pool.parallel_for(rtasks, [&](std::int64_t t) {
      auto [r0, r1] = task_range(rows, rtasks, t);
      kernel_->rows(ptrs.data(), layout_, out, r0, r1);
    });
  }
}

LAZYTENSOR_INLINE void ElementwiseNode::run_with_producer(ExecContext& ctx, const std::vector<const void*>& ptrs, void* out) {
  auto* producer = dynamic_cast<RowProducer*>(inputs()[fused_slot_].get());
  const std::int64_t cols = shape()[shape().rank() - 1];
  const std::int64_t rows = cols ? numel() / cols : 0;
  if (rows == 0) return;
  auto& pool = ctx.device.threads();
  const std::int64_t block = std::max<std::int64_t>(1, producer->row_block());
  const std::int64_t blocks = (rows + block - 1) / block;
  const std::int64_t tasks = std::min(blocks, std::max<std::int64_t>(1, task_count(pool, numel(), producer_cost())));
  const bool contig = !layout_.any_splat();
  RowProducer::Session session(*producer, ctx);
  pool.parallel_for(tasks, [&](std::int64_t t) {
    auto [b0, b1] = task_range(blocks, tasks, t);
    for (std::int64_t b = b0; b < b1; ++b) {
      const std::int64_t r0 = b * block, r1 = std::min(rows, r0 + block);
      producer->produce_rows(out, r0, r1);
      if (layout_.flat()) kernel_->flat(ptrs.data(), layout_.splat.data(), out, r0 * cols, r1 * cols, contig, false);
      else kernel_->rows(ptrs.data(), layout_, out, r0, r1);  // inner == cols (fuse_producers)
    }
  });
  inputs()[fused_slot_]->set_deferred(false);
}

}  // namespace lazy::graph
#endif  // LAZYTENSOR_HEADER_DEFINITIONS
// ---- end lazytensor/graph/elementwise_node.hpp ----

namespace lazy::graph {

/// One unit of execution: a single node, or a fused element-wise group.
struct PlanStep {
  enum class Kind : std::uint8_t { Single, Group };
  Kind kind = Kind::Single;
  /// Plan positions of the members, in execution order.
  std::vector<std::int32_t> members;
  /// Per member: its value is written to a whole buffer (else only to chunk scratch).
  std::vector<std::uint8_t> whole;
  /// Per member, per input: the producing member's index in this group, or -1.
  std::vector<std::vector<std::int32_t>> sources;
};

/// What a step runs, reusable for every step with the same signature.
struct Plan {
  std::uint64_t hash = 0;
  std::vector<std::uint64_t> signature;
  std::vector<PlanStep> steps;
  std::size_t num_nodes = 0;
  std::int64_t fused_groups = 0, fused_members = 0;
  /// Estimated work (element operations: elements touched times cost per element).
  double work = 0;
};

/// Steps with less estimated work than this run on the thread calling mark_step: waking
/// the executor thread costs more (15-50 us measured on a VM, where a wake-up is an
/// inter-processor interrupt) than running them. About 10 us of work.
inline constexpr double kInlineStepWork = 1 << 14;

/// Elements a fused group processes per chunk: a reduction block (kReduceBlock), 16 KiB of
/// floats.
inline constexpr std::int64_t kFusionChunk = 4096;

/// Element-wise members a fused group holds at most (a reduction ending a full group is
/// one more, with no scratch); the next statement starts a new group. Each
/// member a later one reads in the group keeps a chunk of scratch per task (16 KiB of
/// floats): 64 of them already fill a core's L2, so a longer group gains no locality and
/// would hold scratch in proportion to its length (a chain of 100000 statements asked for
/// 1.6 GB).
inline constexpr std::size_t kMaxGroupMembers = 64;

/// Elements of the slices a group reading more than kFusionSliceBytes runs its chunks in
/// (each member over one slice, then the next slice: see run_group).
inline constexpr std::int64_t kFusionSlice = 256;
/// Outside-input bytes above which a group runs sliced: more than L2 holds.
inline constexpr std::int64_t kFusionSliceBytes = std::int64_t(1) << 20;
/// Elements of the slices of a group reading at least kFusionMemoryBytes: its inputs
/// stream from memory, where shorter slices keep more of the streams' loads in flight.
inline constexpr std::int64_t kFusionMemorySlice = 128;
/// Outside-input bytes from which a group's inputs come from memory, not the last-level
/// cache: the size from which outputs are stored non-temporally, for the same reason.
inline constexpr std::int64_t kFusionMemoryBytes = expr::kStreamingStoreBytes;

namespace detail {

std::uint64_t next_plan_epoch();

/// Numbers the nodes (plan_slot) for this planning pass.
std::uint64_t number_nodes(const std::vector<NodePtr>& nodes);

inline std::int32_t plan_slot_of(const NodePtr& n, std::uint64_t epoch) {
  return n->plan_epoch == epoch ? n->plan_slot : -1;
}

/// An element-wise node that can run chunk by chunk with others: flat layout (every input
/// has the output's shape or one element), not running a GEMM producer's epilogue.
const ElementwiseNode* chunkable(const NodePtr& n);

/// A reduction that can end a group of `numel`-element chunks: it reduces every element
/// of a child with that many elements, each input having them all or one.
ChunkReduction* chunk_reduction(const NodePtr& n, std::int64_t numel);

/// Signature (see the file comment) of `nodes`, numbered with `epoch`; `outside[i]` is
/// true when something outside the step refers to node i.
std::vector<std::uint64_t> plan_signature(const std::vector<NodePtr>& nodes, std::uint64_t epoch,
                                          std::vector<std::uint8_t>& outside);

std::uint64_t fold_signature(const std::vector<std::uint64_t>& sig);

/// Groups `nodes` into steps (see the file comment). Several groups (one per element
/// count) may be open at once, so statements of different sizes interleaved in the
/// program (activations and weight gradients of a backward pass) still fuse by size. A
/// group's step is emitted when it closes: when a node outside it reads it, or at the end.
/// So every consumer comes after its producers: a non-member reading a group closes the
/// group first, and a member reading anything else reads a single step or a closed group
/// emitted earlier.
std::shared_ptr<Plan> build_plan(const std::vector<NodePtr>& nodes, std::uint64_t epoch,
                                 const std::vector<std::uint8_t>& outside);

}  // namespace detail

}  // namespace lazy::graph

#if LAZYTENSOR_HEADER_DEFINITIONS
namespace lazy::graph::detail {

LAZYTENSOR_INLINE std::uint64_t next_plan_epoch() {
  thread_local std::uint64_t epoch = 0;
  // Mix in the thread so that two planners (devices in different threads) never share one.
  return (++epoch << 8) ^ reinterpret_cast<std::uintptr_t>(&epoch);
}

LAZYTENSOR_INLINE std::uint64_t number_nodes(const std::vector<NodePtr>& nodes) {
  const std::uint64_t epoch = next_plan_epoch();
  for (std::size_t i = 0; i < nodes.size(); ++i) {
    nodes[i]->plan_slot = static_cast<std::int32_t>(i);
    nodes[i]->plan_epoch = epoch;
  }
  return epoch;
}

LAZYTENSOR_INLINE const ElementwiseNode* chunkable(const NodePtr& n) {
  if (n->kind() != NodeKind::Elementwise) return nullptr;
  const auto* e = static_cast<const ElementwiseNode*>(n.get());
  if (!e->layout().flat() || e->takes_producer() || n->numel() == 0) return nullptr;
  return e;
}

LAZYTENSOR_INLINE ChunkReduction* chunk_reduction(const NodePtr& n, std::int64_t numel) {
  if (n->kind() != NodeKind::Reduction || n->numel() != 1) return nullptr;
  auto* r = dynamic_cast<ChunkReduction*>(n.get());
  if (!r || !r->reduces_all()) return nullptr;
  bool reads_chunk = false;
  for (const auto& in : n->inputs()) {
    if (in->numel() != numel && in->numel() != 1) return nullptr;
    reads_chunk = reads_chunk || in->numel() == numel;
  }
  return reads_chunk ? r : nullptr;
}

LAZYTENSOR_INLINE std::vector<std::uint64_t> plan_signature(const std::vector<NodePtr>& nodes,
    std::uint64_t epoch,
    std::vector<std::uint8_t>& outside) {
  core::SmallVector<std::int32_t, 32> refs;  // a read of a few statements allocates nothing here
  refs.assign(nodes.size(), 0);
  for (const auto& n : nodes)
    for (const auto& in : n->inputs()) {
      const std::int32_t s = plan_slot_of(in, epoch);
      if (s >= 0) ++refs[static_cast<std::size_t>(s)];
    }
  std::vector<std::uint64_t> sig;
  sig.reserve(nodes.size() * 3);
  outside.assign(nodes.size(), 0);
  for (std::size_t i = 0; i < nodes.size(); ++i) {
    const auto& n = nodes[i];
    // References: the plan's own vector, the step's consumers, and everything else.
    outside[i] = n.use_count() > 1 + refs[i] ? 1 : 0;
    sig.push_back(n->hash());
    std::uint64_t wiring = outside[i];
    for (const auto& in : n->inputs()) wiring = hash_combine(wiring, static_cast<std::uint64_t>(plan_slot_of(in, epoch) + 1));
    sig.push_back(wiring);
  }
  return sig;
}

LAZYTENSOR_INLINE std::uint64_t fold_signature(const std::vector<std::uint64_t>& sig) {
  std::uint64_t h = sig.size();
  for (auto v : sig) h = hash_combine(h, v);
  return h;
}

LAZYTENSOR_INLINE std::shared_ptr<Plan> build_plan(const std::vector<NodePtr>& nodes,
    std::uint64_t epoch,
    const std::vector<std::uint8_t>& outside) {
  auto plan = std::make_shared<Plan>();
  plan->num_nodes = nodes.size();
  const std::size_t n = nodes.size();
  std::vector<std::int32_t> unit(n, -1);  // the step (group or single) each node runs in
  std::vector<std::int32_t> member_of(n, -1);  // a grouped node's index among its group's members
  std::int32_t next_unit = 0;
  struct Open {
    PlanStep st;
    std::int32_t unit;
    std::int64_t numel;
  };
  std::vector<Open> open;  // in creation order

  auto close_unit = [&](std::int32_t u) {
    for (std::size_t g = 0; g < open.size(); ++g) {
      if (open[g].unit != u) continue;
      if (open[g].st.members.size() > 1) open[g].st.kind = PlanStep::Kind::Group;
      plan->steps.push_back(std::move(open[g].st));
      open.erase(open.begin() + static_cast<std::ptrdiff_t>(g));
      return;
    }
  };
  auto open_with = [&](std::int64_t numel) -> Open* {
    for (auto& g : open)
      if (g.numel == numel) return &g;
    return nullptr;
  };
  auto is_open = [&](std::int32_t u) {
    return std::any_of(open.begin(), open.end(), [&](const Open& g) { return g.unit == u; });
  };
  // Closes every open group `node` reads, except `keep`.
  auto close_read = [&](const NodePtr& node, std::int32_t keep) {
    for (const auto& in : node->inputs()) {
      const std::int32_t s = plan_slot_of(in, epoch);
      if (s < 0) continue;
      const std::int32_t u = unit[static_cast<std::size_t>(s)];
      if (u != keep && is_open(u)) close_unit(u);
    }
  };
  auto add_member = [&](Open& g, std::size_t i) {
    std::vector<std::int32_t> src;
    for (const auto& in : nodes[i]->inputs()) {
      const std::int32_t s = plan_slot_of(in, epoch);
      std::int32_t m = -1;
      if (s >= 0 && unit[static_cast<std::size_t>(s)] == g.unit) m = member_of[static_cast<std::size_t>(s)];
      src.push_back(m);
    }
    member_of[i] = static_cast<std::int32_t>(g.st.members.size());
    g.st.members.push_back(static_cast<std::int32_t>(i));
    g.st.sources.push_back(std::move(src));
    unit[i] = g.unit;
  };

  for (std::size_t i = 0; i < n; ++i) {
    const NodePtr& node = nodes[i];
    if (chunkable(node)) {
      Open* g = open_with(node->numel());
      if (g && g->st.members.size() >= kMaxGroupMembers) {
        close_unit(g->unit);
        g = nullptr;
      }
      close_read(node, g ? g->unit : -1);
      g = open_with(node->numel());  // closing others moved the vector
      if (!g) {
        open.push_back(Open{PlanStep{}, next_unit++, node->numel()});
        g = &open.back();
      }
      add_member(*g, i);
      continue;
    }
    // A reduction of everything an open group computes ends that group.
    bool ended = false;
    for (const auto& in : node->inputs()) {
      const std::int32_t s = plan_slot_of(in, epoch);
      if (s < 0) continue;
      const std::int32_t u = unit[static_cast<std::size_t>(s)];
      Open* g = nullptr;
      for (auto& o : open)
        if (o.unit == u) g = &o;
      if (!g || !chunk_reduction(node, g->numel)) continue;
      close_read(node, u);
      for (auto& o : open)
        if (o.unit == u) g = &o;
      add_member(*g, i);
      close_unit(u);
      ended = true;
      break;
    }
    if (ended) continue;
    // Not fusible: the groups it reads run first; it runs ahead of the others (its inputs
    // are older, already scheduled).
    close_read(node, -1);
    PlanStep single;
    single.members = {static_cast<std::int32_t>(i)};
    unit[i] = next_unit++;
    plan->steps.push_back(std::move(single));
  }
  while (!open.empty()) close_unit(open.front().unit);

  for (const auto& node : nodes) {
    std::int64_t touched = node->numel();
    for (const auto& in : node->inputs()) touched = std::max(touched, in->numel());
    plan->work += static_cast<double>(touched) * std::max(1.0, node->cost_per_element());
  }

  // A member's value is written whole when anything outside its group needs it.
  std::vector<std::uint8_t> whole(outside.begin(), outside.end());
  for (std::size_t i = 0; i < n; ++i)
    for (const auto& in : nodes[i]->inputs()) {
      const std::int32_t s = plan_slot_of(in, epoch);
      if (s >= 0 && unit[static_cast<std::size_t>(s)] != unit[i]) whole[static_cast<std::size_t>(s)] = 1;
    }
  for (auto& st : plan->steps) {
    if (st.kind != PlanStep::Kind::Group) continue;
    for (auto m : st.members) st.whole.push_back(whole[static_cast<std::size_t>(m)]);
    ++plan->fused_groups;
    plan->fused_members += static_cast<std::int64_t>(st.members.size());
  }
  return plan;
}

}  // namespace lazy::graph::detail
#endif  // LAZYTENSOR_HEADER_DEFINITIONS
// ---- end lazytensor/graph/plan.hpp ----

namespace lazy::graph::detail {

/// The members of a fused group, seen in the step's node list through the plan's
/// positions (no copies of the node references: a group of 64 tiny statements would pay
/// 128 atomic reference-count updates for them).
class GroupMembers {
 public:
  GroupMembers(std::span<const NodePtr> nodes, const PlanStep& st) : nodes_(nodes), pos_(st.members) {}
  std::size_t size() const { return pos_.size(); }
  const NodePtr& operator[](std::size_t j) const { return nodes_[static_cast<std::size_t>(pos_[j])]; }

 private:
  std::span<const NodePtr> nodes_;
  const std::vector<std::int32_t>& pos_;
};

/// An input from outside a fused group that a whole member may take over (donation): how
/// many references the members hold, and the last member reading it.
struct DonorCandidate {
  const NodePtr* node;
  long holders;
  std::size_t last_reader;
};

/// The group's outside inputs, in member order (see group_output).
std::vector<DonorCandidate> donor_candidates(const PlanStep& st, const GroupMembers& members);

/// The whole output buffer of group member `j`: the buffer of an outside input of the
/// group it may overwrite (donation), else one from the pool. An input can be donated when
/// it has the member's dtype and size, only group members hold it, and no member after `j`
/// reads it: within a chunk, members run in order, so every read of that chunk of the
/// input happens before `j` writes it (a chain of in-place updates ends in its first
/// input's buffer).
std::shared_ptr<Buffer> group_output(ExecContext& ctx, const std::vector<DonorCandidate>& donors,
                                     const NodePtr& me, std::size_t j);

/// Bytes per element a group reads from outside buffers, each buffer counted once, when
/// they reach `least` bytes over its `n` elements; else 0.
template <class Input>
std::int64_t outside_bytes(const std::vector<Input>& in, std::int64_t n, std::int64_t least) {
  std::size_t upper = 0;  // counting a buffer read twice twice: enough to rule out most groups
  for (const Input& x : in)
    if (x.src < 0) upper += x.esz;
  if (n * static_cast<std::int64_t>(upper) < least) return 0;
  std::size_t bytes = 0;
  for (std::size_t i = 0; i < in.size(); ++i) {
    const Input& x = in[i];
    if (x.src >= 0 || x.esz == 0) continue;
    const bool seen =
        std::any_of(in.begin(), in.begin() + static_cast<std::ptrdiff_t>(i),
                    [&](const Input& y) { return y.src < 0 && y.esz != 0 && y.base == x.base; });
    if (!seen) bytes += x.esz;
  }
  const std::int64_t total = n * static_cast<std::int64_t>(bytes);
  return total < least ? 0 : total;
}

/// One run of a fused group. The bookkeeping is in flat arrays (no allocation per member):
/// a step of 100 tiny statements is two groups of a few allocations each. A reduction ending the group reduces each
/// chunk to a partial (one per chunk, so the result does not depend on the task split).
class GroupRun {
 public:
  GroupRun(ExecContext& ctx, const PlanStep& st, const GroupMembers& members);
  /// Runs every chunk (over the device's threads) and hands the members their outputs.
  void run();

 private:
  struct Member {
    const ElementwiseNode* ew;  // null for the reduction ending the group
    const ElementwiseKernel* kernel;
    const char* splat;
    bool contig;
    std::size_t esz, scratch_off, first_in, num_in;
  };
  struct Input {
    const std::byte* base;  // an outside input's buffer, or null (a member's output)
    std::size_t esz;        // bytes per element, 0 for a broadcast single element
    std::int32_t src;       // the producing member, or -1
  };

  void describe_members();
  void allocate_outputs();
  void choose_slices();
  void choose_streams();
  void run_task(std::int64_t t);
  void finish();

  ExecContext& ctx_;
  const PlanStep& st_;
  const GroupMembers& members_;
  std::size_t k_;
  std::int64_t n_;
  std::vector<Member> mem_;
  std::vector<Input> in_;
  ChunkReduction* reduction_ = nullptr;
  std::size_t per_task_ = 0;  // scratch bytes per task
  double cost_ = 0;
  std::vector<std::shared_ptr<Buffer>> out_;
  std::vector<std::byte*> out_ptr_;
  std::int64_t chunks_ = 0, tasks_ = 0, slice_ = 0;
  std::size_t partial_bytes_ = 0;
  std::shared_ptr<Buffer> partials_, scratch_;
  std::vector<std::uint8_t> stream_, copy_out_, slice_long_;
  bool any_stream_ = false;
};

/// Runs a fused group (see GroupRun).
inline void run_group(ExecContext& ctx, const PlanStep& st, const GroupMembers& members) {
  GroupRun(ctx, st, members).run();
}

}  // namespace lazy::graph::detail

#if LAZYTENSOR_HEADER_DEFINITIONS
namespace lazy::graph::detail {

LAZYTENSOR_INLINE std::vector<DonorCandidate> donor_candidates(const PlanStep& st, const GroupMembers& members) {
  std::vector<DonorCandidate> c;
  for (std::size_t m = 0; m < members.size(); ++m) {
    const auto& ins = members[m]->inputs();
    for (std::size_t q = 0; q < ins.size(); ++q) {
      if (st.sources[m][q] >= 0) continue;
      auto it = std::find_if(c.begin(), c.end(), [&](const DonorCandidate& d) { return *d.node == ins[q]; });
      if (it == c.end()) {
        c.push_back({&ins[q], 1, m});
      } else {
        ++it->holders;
        it->last_reader = m;
      }
    }
  }
  return c;
}

LAZYTENSOR_INLINE std::shared_ptr<Buffer> group_output(ExecContext& ctx, const std::vector<DonorCandidate>& donors,
                                                       const NodePtr& me, std::size_t j) {
  for (const auto& d : donors) {
    const NodePtr& x = *d.node;
    if (d.last_reader > j || x->dtype() != me->dtype() || x->numel() != me->numel()) continue;
    if (auto b = Node::take_buffer(x, d.holders)) {
      static auto& donated = core::counter("DonatedBuffers");
      donated.add();
      return b;
    }
  }
  return ctx.device.pool().acquire(padded_bytes(me->numel(), dtype_size(me->dtype())));
}

LAZYTENSOR_INLINE GroupRun::GroupRun(ExecContext& ctx, const PlanStep& st, const GroupMembers& members)
    : ctx_(ctx), st_(st), members_(members), k_(members.size()), n_(members[0]->numel()) {}

LAZYTENSOR_INLINE void GroupRun::run() {
  describe_members();
  allocate_outputs();
  choose_slices();
  choose_streams();
  ctx_.device.threads().parallel_for(tasks_, [this](std::int64_t t) { run_task(t); });
  finish();
}

// The members' kernels and where each reads its inputs; the scratch each non-whole member
// needs per task.
LAZYTENSOR_INLINE void GroupRun::describe_members() {
  mem_.resize(k_);
  in_.reserve(k_ * 2);
  for (std::size_t j = 0; j < k_; ++j) {
    Member& m = mem_[j];
    m.ew = nullptr;
    m.kernel = nullptr;
    m.splat = nullptr;
    m.contig = true;
    if (members_[j]->kind() == NodeKind::Elementwise) {
      m.ew = static_cast<const ElementwiseNode*>(members_[j].get());
      m.kernel = &m.ew->kernel();
      m.splat = m.ew->layout().splat.data();
      m.contig = !m.ew->layout().any_splat();
      cost_ += m.ew->kernel().cost();
    } else {
      reduction_ = dynamic_cast<ChunkReduction*>(members_[j].get());  // the last member (plan.hpp)
      cost_ += members_[j]->cost_per_element();
    }
    m.esz = dtype_size(members_[j]->dtype());
    m.scratch_off = 0;
    m.first_in = in_.size();
    const auto& ins = members_[j]->inputs();
    m.num_in = ins.size();
    for (std::size_t q = 0; q < ins.size(); ++q) {
      // Read every outside input's address before any output is allocated: a donated
      // input's buffer moves to the output (same memory).
      const std::int32_t src = st_.sources[j][q];
      in_.push_back({src < 0 ? static_cast<const std::byte*>(ins[q]->buffer()->data()) : nullptr,
                     ins[q]->numel() == 1 && n_ != 1 ? 0 : dtype_size(ins[q]->dtype()), src});
    }
    if (!st_.whole[j] && m.ew) {
      // A chunk, or the whole tensor when it is shorter.
      m.scratch_off = per_task_;
      per_task_ += padded_bytes(std::min(kFusionChunk, n_), m.esz);
    }
  }
}

// Whole outputs (members needed outside the group), donated or from the pool, and the
// reduction's partials.
LAZYTENSOR_INLINE void GroupRun::allocate_outputs() {
  out_.resize(k_);
  out_ptr_.assign(k_, nullptr);
  const auto donors = donor_candidates(st_, members_);
  for (std::size_t j = 0; j < k_; ++j) {
    if (!st_.whole[j] || !mem_[j].ew) continue;
    out_[j] = group_output(ctx_, donors, members_[j], j);
    out_ptr_[j] = static_cast<std::byte*>(out_[j]->data());
  }
  chunks_ = (n_ + kFusionChunk - 1) / kFusionChunk;
  tasks_ = std::max<std::int64_t>(1, std::min(chunks_, task_count(ctx_.device.threads(), n_, cost_)));
  partial_bytes_ = reduction_ ? reduction_->partial_bytes() : 0;
  if (reduction_) partials_ = ctx_.device.pool().acquire(padded_bytes(chunks_, partial_bytes_));
}

// Groups reading more than L2 holds run each chunk in slices, every member over a slice
// before the next: member by member over a whole chunk, only one member's inputs stream
// from memory at a time, and the loads missing the cache are too sparse in the
// instruction stream to keep enough of them in flight. Shorter slices for inputs from
// memory than for inputs from the last-level cache, where the kernel calls per slice
// cost more than the loads gain (measured, docs/architecture.md).
LAZYTENSOR_INLINE void GroupRun::choose_slices() {
  const std::int64_t reads = outside_bytes(in_, n_, kFusionSliceBytes);
  slice_ = reads == 0                    ? kFusionChunk
           : reads >= kFusionMemoryBytes ? kFusionMemorySlice
                                         : kFusionSlice;
  if (slice_ < kFusionChunk) {
    static auto& sliced = core::counter("SlicedGroups");
    sliced.add();
  }
}

// Whole outputs too large for the cache that no later member reads are streamed (as a
// single statement does): the cache keeps the chunk's inputs instead.
// A sliced group streams the ones a later member reads too: the member writes its slice
// to scratch, where the readers find it in cache, and the slice is then copied out with
// non-temporal stores. Stored through the cache instead, each output line would first be
// read from memory (two extra streams for t1, t2 in `t1 = a*b + c; t2 = relu(t1)*d;
// y = t2 - 0.5*a` with all three kept).
LAZYTENSOR_INLINE void GroupRun::choose_streams() {
  stream_.assign(k_, 0);
  copy_out_.assign(k_, 0);
  for (std::size_t j = 0; j < k_; ++j) {
    if (!out_ptr_[j] || !mem_[j].ew->can_stream() || !mem_[j].contig ||
        n_ * static_cast<std::int64_t>(mem_[j].esz) < expr::kStreamingStoreBytes)
      continue;
    bool read_later = false;
    for (std::size_t i = j + 1; i < k_; ++i)
      for (std::size_t q = 0; q < mem_[i].num_in; ++q)
        read_later = read_later || in_[mem_[i].first_in + q].src == static_cast<std::int32_t>(j);
    stream_[j] = read_later ? 0 : 1;
    copy_out_[j] = read_later && slice_ < kFusionChunk ? 1 : 0;
    any_stream_ = any_stream_ || stream_[j] || copy_out_[j];
    if (copy_out_[j]) {
      mem_[j].scratch_off = per_task_;
      per_task_ += padded_bytes(kFusionChunk, mem_[j].esz);
    }
  }
  if (per_task_) scratch_ = ctx_.device.pool().acquire(per_task_ * static_cast<std::size_t>(tasks_));
  // In a sliced group a member's scratch holds one slice (at its start), not a chunk: the
  // scratch of two members a chunk long fills L1 and, cycling through it, evicts the lines
  // the hardware prefetcher brought in for the outside inputs (hand-written loop nest of
  // the three statements at 2^24 floats: 12.5 ms with chunk-long scratch, 8.4 ms with
  // slice-long, 7.8 ms the single statement). The reduction ending a group reads its
  // inputs over the whole chunk, so the members it reads keep chunk-long scratch.
  slice_long_.assign(k_, 0);
  if (slice_ < kFusionChunk) {
    for (std::size_t j = 0; j < k_; ++j) slice_long_[j] = mem_[j].ew && (!out_ptr_[j] || copy_out_[j]) ? 1 : 0;
    if (reduction_)
      for (std::size_t q = 0; q < mem_[k_ - 1].num_in; ++q)
        if (const std::int32_t src = in_[mem_[k_ - 1].first_in + q].src; src >= 0)
          slice_long_[static_cast<std::size_t>(src)] = 0;
  }
}

// The chunks of task `t`, slice by slice through every member.
LAZYTENSOR_INLINE void GroupRun::run_task(std::int64_t t) {
  const std::size_t k = k_;
  const std::int64_t n = n_, slice = slice_;
  auto [c0, c1] = task_range(chunks_, tasks_, t);
  std::byte* mine =
      scratch_ ? static_cast<std::byte*>(scratch_->data()) + per_task_ * static_cast<std::size_t>(t) : nullptr;
  // Where each input (flat, in `in_` order) and each member's output is found: at
  // base + i * esz for element i of the group (outside buffers, whole outputs), of the
  // chunk (chunk-long scratch), or of the slice (slice-long scratch and broadcast
  // elements: esz 0, one place).
  struct Place {
    std::byte* base;
    std::size_t esz;
    bool in_chunk;
    std::byte* at_chunk(std::size_t b) const { return base + (in_chunk ? 0 : b * esz); }
  };
  auto output_place = [&](std::size_t p) -> Place {
    if (!mem_[p].ew) return {nullptr, 0, false};  // the reduction: no element-wise output
    if (out_ptr_[p] && !copy_out_[p]) return {out_ptr_[p], mem_[p].esz, false};
    return {mine + mem_[p].scratch_off, slice_long_[p] ? 0 : mem_[p].esz, true};
  };
  std::vector<Place> in_place(in_.size()), out_place(k);
  for (std::size_t i = 0; i < in_.size(); ++i)  // outside buffers are only read
    in_place[i] = in_[i].src < 0 ? Place{const_cast<std::byte*>(in_[i].base), in_[i].esz, false}
                                 : output_place(static_cast<std::size_t>(in_[i].src));
  for (std::size_t j = 0; j < k; ++j) out_place[j] = output_place(j);
  // The pointers for the first slice of the chunk starting at element `b`; kernels run
  // over [0, slice length).
  std::vector<const void*> ptrs(in_.size());
  std::vector<void*> outs(k);
  auto point = [&](std::size_t b) {
    for (std::size_t i = 0; i < in_.size(); ++i) ptrs[i] = in_place[i].at_chunk(b);
    for (std::size_t j = 0; j < k; ++j) outs[j] = out_place[j].at_chunk(b);
  };
  // From one slice to the next every pointer moves by the slice's bytes, slice-long
  // scratch and broadcast elements by none: a chunk's pointers are placed once and then
  // only advanced. The bookkeeping between kernel calls is what a sliced group costs over
  // a single statement, so the slice loop does no more than call and advance (with
  // scalar additions: see hide_from_vectorizer).
  std::vector<std::size_t> step(in_.size() + k);  // bytes per slice: the inputs, then the outputs
  for (std::size_t i = 0; i < in_.size(); ++i) step[i] = in_place[i].esz * static_cast<std::size_t>(slice);
  for (std::size_t j = 0; j < k; ++j) step[in_.size() + j] = out_place[j].esz * static_cast<std::size_t>(slice);
  struct Call {
    const ElementwiseKernel* kernel;
    const void* const* in;
    const char* splat;
    void* const* out;
    std::byte* copy_base;  // the whole output a slice in scratch is copied to, or null
    std::size_t esz;
    bool contig, stream;
  };
  std::vector<Call> calls;
  calls.reserve(k);
  for (std::size_t j = 0; j < k; ++j)
    if (mem_[j].ew)
      calls.push_back({mem_[j].kernel, ptrs.data() + mem_[j].first_in, mem_[j].splat, outs.data() + j,
                       copy_out_[j] ? out_ptr_[j] : nullptr, mem_[j].esz, mem_[j].contig, stream_[j] != 0});
  for (std::int64_t c = c0; c < c1; ++c) {
    const std::int64_t b = c * kFusionChunk, len = std::min(kFusionChunk, n - b);
    const auto ub = static_cast<std::size_t>(b);
    point(ub);
    for (std::int64_t s0 = 0;;) {
      const std::int64_t m = std::min(slice, len - s0);
      for (const Call& call : calls) {
        call.kernel->flat(call.in, call.splat, *call.out, 0, m, call.contig, call.stream);
        if (call.copy_base)
          expr::stream_copy(call.copy_base + (ub + static_cast<std::size_t>(s0)) * call.esz, *call.out,
                            static_cast<std::size_t>(m) * call.esz);
      }
      if ((s0 += slice) >= len) break;  // no pointer moves past the chunk's last slice
      for (std::size_t i = 0; i < ptrs.size(); ++i) {
        const std::byte* p = static_cast<const std::byte*>(ptrs[i]) + step[i];
        core::hide_from_vectorizer(p);
        ptrs[i] = p;
      }
      for (std::size_t j = 0; j < k; ++j) {
        std::byte* p = static_cast<std::byte*>(outs[j]) + step[ptrs.size() + j];
        core::hide_from_vectorizer(p);
        outs[j] = p;
      }
    }
    if (reduction_) {  // the last member, over the whole chunk: one partial, as unfused
      point(ub);       // the slices moved the pointers on
      reduction_->reduce_chunk(ptrs.data() + mem_[k - 1].first_in, len,
                               static_cast<std::byte*>(partials_->data()) +
                                   static_cast<std::size_t>(c) * partial_bytes_);
    }
  }
  if (any_stream_) expr::store_fence();
}

LAZYTENSOR_INLINE void GroupRun::finish() {
  for (std::size_t j = 0; j < k_; ++j) {
    if (mem_[j].ew)
      members_[j]->finish_with(std::move(out_[j]));
    else
      reduction_->finish_partials(ctx_, partials_->data(), chunks_);
  }
}

}  // namespace lazy::graph::detail
#endif  // LAZYTENSOR_HEADER_DEFINITIONS
// ---- end lazytensor/graph/fused_group.hpp ----

namespace lazy::graph {

namespace detail {

/// The nodes a traversal has met: searched in a short inline list first, in a hash set
/// once that fills. Reading one small statement (`sum(x).item()`) then allocates nothing
/// to remember it, while reading a whole training graph stays linear.
class SeenNodes {
 public:
  /// Adds `n`; false when it was already there.
  bool insert(const Node* n);

 private:
  static constexpr std::size_t kInline = 16;
  const Node* inline_[kInline] = {};
  std::size_t count_ = 0;
  std::unordered_set<const Node*> set_;
};

}  // namespace detail

/// Pending nodes reachable from `roots`, producers before consumers (iterative DFS, so a
/// long chain of statements cannot overflow the stack).
std::vector<NodePtr> topological_order(std::span<const NodePtr> roots);

/// Lets the step's element-wise nodes take over their GEMM producers (epilogue fusion).
/// Called on every step before planning and execution: it decides on this step's nodes.
void prepare(std::span<const NodePtr> nodes);

/// The plan for `nodes` (in creation order), from the device's cache or newly built.
/// `step`: planning a mark_step (reads and eager ops do not count toward the re-planning
/// warning). `done`: receives the clock reading that ended PlanTime, for a caller that
/// runs the plan at once and can start ExecuteTime from it.
std::shared_ptr<const Plan> plan_for(Device& dev, const std::vector<NodePtr>& nodes,
                                            bool step, core::MetricClock::Ticks* done = nullptr);

/// Puts the nodes of a step that did not run (or did not finish) back to pending and into
/// the trace, for a later step or read: nothing is lost when a step fails or is refused.
void return_to_trace(Device& device, std::span<const NodePtr> nodes);

/// Runs `plan` over `nodes` (positions as planned). The plan's reference to each node is
/// dropped as it runs, so donation sees the true holders. On an error, the nodes not run
/// go back to pending (and to the device's trace) and the exception propagates.
/// `started`: when ExecuteTime starts (default: now).
void run_plan(Device& device, const Plan& plan, std::span<NodePtr> nodes,
                     const core::MetricClock::Ticks* started = nullptr);

/// Plans and runs `nodes` on the calling thread (the caller has waited for the queued
/// plans: execute does).
void execute_now(Device& device, std::vector<NodePtr> nodes);

/// True when `node` is pending and every input of it is materialized: its plan would be
/// the node alone.
bool runs_alone(const NodePtr& node);

/// The plan of one node run alone: a single step at position 0.
const Plan& single_node_plan();

/// Materializes every pending node reachable from `roots` on `device`, now, on the
/// calling thread.
void execute(Device& device, std::span<const NodePtr> roots);

/// The nodes a step computes: every pending node of the trace that a live handle reaches,
/// in creation order. The rest (alive, but reachable only from expressions or dropped
/// values' consumers) stays traced for later steps.
std::vector<NodePtr> collect_step(Device& dev);

/// run_plan for a step nobody waits on: its error is stored on the device, to surface at
/// the next read or sync.
void run_plan_storing_error(Device& dev, const Plan& plan, std::vector<NodePtr>& nodes);

/// Runs a step: plans the collected nodes now (overlapping the previous step's
/// execution), hands the plan to the executor thread (or, with async off, runs it here),
/// then waits for the previous step. The plan is queued behind the running step before
/// that wait, so the executor goes from one step to the next without waiting for this
/// thread to wake (two thread wake-ups, 15-50 us each on a VM). Errors of an asynchronous
/// step are stored. A step cheaper than the hand-off (kInlineStepWork), or any step of a
/// device set to inline_steps, runs here once the queue is empty, its errors stored as if
/// it had run on the executor.
void run_step(Device& dev, std::vector<NodePtr> nodes);

}  // namespace lazy::graph

#if LAZYTENSOR_HEADER_DEFINITIONS
namespace lazy::graph::detail {

LAZYTENSOR_INLINE bool SeenNodes::insert(const Node* n) {
  if (set_.empty()) {
    for (std::size_t i = 0; i < count_; ++i) {
      if (inline_[i] == n) return false;
    }
    if (count_ < kInline) {
      inline_[count_++] = n;
      return true;
    }
    set_.insert(inline_, inline_ + count_);
  }
  return set_.insert(n).second;
}

}  // namespace lazy::graph::detail
namespace lazy::graph {

LAZYTENSOR_INLINE std::vector<NodePtr> topological_order(std::span<const NodePtr> roots) {
  std::vector<NodePtr> order;
  detail::SeenNodes seen;
  struct Frame {
    Node* node;
    std::size_t next;  // the next input to look at
  };
  core::SmallVector<Frame, 16> stack;
  for (const auto& r : roots) {
    if (!r || !r->pending() || !seen.insert(r.get())) continue;
    stack.push_back({r.get(), 0});
    while (!stack.empty()) {
      Frame& top = stack.back();
      const auto& ins = top.node->inputs();
      if (top.next < ins.size()) {
        const NodePtr& in = ins[top.next++];
        if (in->pending() && seen.insert(in.get())) stack.push_back({in.get(), 0});
        continue;
      }
      // All inputs ordered: find the owning shared_ptr (the root or a consumer's input).
      Node* done = top.node;
      stack.pop_back();
      NodePtr owner;
      if (stack.empty()) {
        owner = r;
      } else {
        for (const auto& in : stack.back().node->inputs()) {
          if (in.get() == done) {
            owner = in;
            break;
          }
        }
      }
      order.push_back(std::move(owner));
    }
  }
  return order;
}

LAZYTENSOR_INLINE void prepare(std::span<const NodePtr> nodes) {
  for (const auto& n : nodes) n->set_deferred(false);  // decisions of an earlier look (dumps) are redone
  for (const auto& n : nodes) n->fuse_producers();
}

LAZYTENSOR_INLINE std::shared_ptr<const Plan> plan_for(Device& dev,
    const std::vector<NodePtr>& nodes,
    bool step,
    core::MetricClock::Ticks* done) {
  static auto& cached = core::counter("CachedPlan");
  static auto& uncached = core::counter("UncachedPlan");
  static auto& plan_time = core::metric("PlanTime");
  const auto t0 = core::MetricClock::now();
  const std::uint64_t epoch = detail::number_nodes(nodes);
  std::vector<std::uint8_t> outside;
  auto sig = detail::plan_signature(nodes, epoch, outside);
  const std::uint64_t h = detail::fold_signature(sig);
  auto& cache = dev.plan_cache();
  auto& stats = dev.plan_stats();
  if (step) ++stats.steps;
  std::shared_ptr<const Plan> plan;
  if (auto hit = cache.find(h); hit && hit->signature == sig) {
    plan = std::move(hit);
    cached.add();
  } else {
    auto built = detail::build_plan(nodes, epoch, outside);
    built->hash = h;
    built->signature = sig;
    plan = built;
    cache.insert(h, plan);
    uncached.add();
    if (step && stats.steps > 10) ++stats.rebuilds_after_warmup;
    // PyTorch/XLA warns about graphs that keep changing; so do we, naming what changed.
    // Judged once at least 10 steps followed the 10th, so one new shape is no alarm.
    if (step && !stats.warned && stats.steps >= 20 && stats.rebuilds_after_warmup * 2 > stats.steps - 10) {
      stats.warned = true;
      std::size_t at = 0;
      const auto& prev = stats.last_signature;
      while (at < sig.size() && at < prev.size() && sig[at] == prev[at]) ++at;
      const std::size_t node = at / 2;
      std::string what = node < nodes.size() ? nodes[node]->op_name() + " " + nodes[node]->describe() + " of shape " +
                                                   nodes[node]->shape().str()
                                             : "the number of nodes";
      std::fprintf(stderr,
                   "lazytensor warning: %s rebuilt its execution plan on %lld of %lld steps after the 10th; the "
                   "graph changes between steps (first difference from the previous step at node %zu: %s; this "
                   "step has %zu nodes, the previous one %zu). Keep shapes and the sequence of ops constant across "
                   "steps.\n",
                   dev.str().c_str(), static_cast<long long>(stats.rebuilds_after_warmup),
                   static_cast<long long>(stats.steps - 10), node, what.c_str(), nodes.size(), prev.size() / 2);
    }
  }
  if (step) stats.last_signature = std::move(sig);
  const auto t1 = core::MetricClock::now();
  plan_time.record(core::MetricClock::to_ns(t0, t1));
  if (done) *done = t1;
  return plan;
}

LAZYTENSOR_INLINE void return_to_trace(Device& device, std::span<const NodePtr> nodes) {
  std::vector<std::weak_ptr<Node>> back;
  for (const auto& n : nodes) {
    if (!n || n->materialized()) continue;
    n->set_deferred(false);
    n->set_state(Node::State::Pending);
    back.push_back(n);
  }
  device.keep_traced(std::move(back));
}

LAZYTENSOR_INLINE void run_plan(Device& device,
    const Plan& plan,
    std::span<NodePtr> nodes,
    const core::MetricClock::Ticks* started) {
  static auto& execute_time = core::metric("ExecuteTime");
  static auto& kernels = core::counter("KernelsRun");
  static auto& fused = core::counter("FusedNodes");
  core::ScopedTimer timer(execute_time, started ? *started : core::MetricClock::now());
  ExecContext ctx{device};
  std::int64_t ran = 0;
  std::size_t step = 0;
  try {
    for (; step < plan.steps.size(); ++step) {
      const PlanStep& st = plan.steps[step];
      if (st.kind == PlanStep::Kind::Single) {
        NodePtr& n = nodes[static_cast<std::size_t>(st.members[0])];
        if (!n->materialized() && !n->deferred()) {
          n->run(ctx);
          ++ran;
        }
        n.reset();
        continue;
      }
      detail::run_group(ctx, st, detail::GroupMembers(nodes, st));
      for (auto m : st.members) nodes[static_cast<std::size_t>(m)].reset();
      ++ran;
      fused.add(static_cast<std::int64_t>(st.members.size()));
    }
  } catch (...) {
    kernels.add(ran);
    return_to_trace(device, nodes);
    throw;
  }
  kernels.add(ran);
}

LAZYTENSOR_INLINE void execute_now(Device& device, std::vector<NodePtr> nodes) {
  if (nodes.empty()) return;
  prepare(nodes);
  // One clock reading ends PlanTime and starts ExecuteTime.
  core::MetricClock::Ticks planned = 0;
  auto plan = plan_for(device, nodes, false, &planned);
  for (auto& n : nodes) n->set_state(Node::State::Queued);
  run_plan(device, *plan, nodes, &planned);
}

LAZYTENSOR_INLINE bool runs_alone(const NodePtr& node) {
  if (!node || !node->pending()) return false;
  for (const auto& in : node->inputs())
    if (!in->materialized()) return false;
  return true;
}

LAZYTENSOR_INLINE const Plan& single_node_plan() {
  static const Plan plan = [] {
    Plan p;
    p.steps.resize(1);
    p.steps[0].members = {0};
    p.num_nodes = 1;
    return p;
  }();
  return plan;
}

LAZYTENSOR_INLINE void execute(Device& device, std::span<const NodePtr> roots) {
  device.wait_idle();
  if (roots.size() == 1 && runs_alone(roots[0])) {
    // An eager op, or the read of a statement over materialized values: nothing to order,
    // plan or look up (so no PlanTime and no plan-cache counter), ~20% of the fixed cost
    // of such a read.
    NodePtr node = roots[0];
    prepare(std::span(&node, 1));
    node->set_state(Node::State::Queued);
    run_plan(device, single_node_plan(), std::span(&node, 1));
    return;
  }
  execute_now(device, topological_order(roots));
}

LAZYTENSOR_INLINE std::vector<NodePtr> collect_step(Device& dev) {
  auto trace = dev.take_trace();
  std::vector<NodePtr> alive;
  alive.reserve(trace.size());
  for (auto& w : trace)
    if (auto n = w.lock(); n && n->pending()) alive.push_back(std::move(n));
  if (alive.empty()) return {};
  const std::uint64_t epoch = detail::number_nodes(alive);
  std::vector<std::uint8_t> needed(alive.size(), 0);
  dev.for_each_pending_root([&](const NodePtr& r) {
    if (const std::int32_t s = detail::plan_slot_of(r, epoch); s >= 0) needed[static_cast<std::size_t>(s)] = 1;
  });
  // Consumers are newer than their inputs: one sweep from the newest marks everything needed.
  for (std::size_t i = alive.size(); i-- > 0;) {
    if (!needed[i]) continue;
    for (const auto& in : alive[i]->inputs())
      if (const std::int32_t s = detail::plan_slot_of(in, epoch); s >= 0) needed[static_cast<std::size_t>(s)] = 1;
  }
  std::vector<NodePtr> run;
  std::vector<std::weak_ptr<Node>> keep;
  for (std::size_t i = 0; i < alive.size(); ++i) {
    if (needed[i]) run.push_back(std::move(alive[i]));
    else keep.push_back(alive[i]);
  }
  dev.keep_traced(std::move(keep));
  return run;
}

LAZYTENSOR_INLINE void run_plan_storing_error(Device& dev, const Plan& plan, std::vector<NodePtr>& nodes) {
  try {
    run_plan(dev, plan, nodes);
  } catch (...) {
    dev.store_error(std::current_exception());
  }
}

LAZYTENSOR_INLINE void run_step(Device& dev, std::vector<NodePtr> nodes) {
  if (nodes.empty()) return;
  prepare(nodes);
  auto plan = plan_for(dev, nodes, true);
  const bool queue =
      dev.async() && (dev.queue_every_step() || (!dev.inline_steps() && plan->work >= kInlineStepWork));
  if (queue)
    dev.wait_below(2);
  else
    dev.wait_idle();
  // Read before the check below: a failure after it changes the count the job compares.
  const std::uint64_t failures = dev.failures();
  try {
    // A step ahead of this one failed while this one was planned: its nodes went back to
    // pending, and this step may read them. The error surfaces here (this mark_step is
    // the next sync); this step's nodes stay traced, never run on missing inputs.
    dev.rethrow_stored_error();
  } catch (...) {
    return_to_trace(dev, nodes);
    throw;
  }
  for (auto& n : nodes) n->set_state(Node::State::Queued);
  if (!dev.async()) {
    run_plan(dev, *plan, nodes);
    return;
  }
  if (!queue) {
    run_plan_storing_error(dev, *plan, nodes);
    return;
  }
  dev.enqueue([&dev, plan, failures, nodes = std::move(nodes)]() mutable {
    if (dev.failures() != failures) {
      // The step ahead failed after this one was queued (same reason as above): this one
      // does not run; its nodes wait in the trace for the next sync, which reports the
      // error.
      return_to_trace(dev, nodes);
      return;
    }
    run_plan_storing_error(dev, *plan, nodes);
  });
  dev.wait_below(2);  // the previous step is done (this one may still run)
}

}  // namespace lazy::graph
#endif  // LAZYTENSOR_HEADER_DEFINITIONS
// ---- end lazytensor/graph/executor.hpp ----

namespace lazy::graph {

/// The device shared by `inputs`; throws DeviceError when they differ. With no inputs,
/// the current device.
Device& common_device(const std::vector<NodePtr>& inputs, const char* op);

/// Rewrites a node that reads a sharded value (NodeKind::Sharded) into per-device pieces.
/// lazy::spmd installs it (use_spmd); without it no node can read a sharded value.
using PartitionHook = NodePtr (*)(NodePtr node);

/// The installed partitioner (null outside SPMD mode). Atomic: installed once, read by
/// every submit.
inline std::atomic<PartitionHook>& partition_hook() {
  static std::atomic<PartitionHook> hook{nullptr};
  return hook;
}

/// Whether mark_step steps every device of the process instead of the current one (SPMD
/// mode: one program thread drives all devices).
inline std::atomic<bool>& step_every_device() {
  static std::atomic<bool> on{false};
  return on;
}

/// Adds a node to its device's pending graph; in eager mode it runs at once. A node that
/// reads a sharded value goes to the partitioner instead, which returns the node that
/// stands for the result (callers use the returned node, never the one they passed).
NodePtr submit(NodePtr node);

/// submit without the partitioner: for the partitioner's own nodes.
NodePtr submit_unpartitioned(NodePtr node);

/// Hands the pending values of every device to its executor, as a mark_step of each
/// without its random-stream advance: before reading values that several devices compute
/// together (SPMD pieces), where a collective on one device waits for its peers.
void step_all_devices();

/// Materializes `node` (and what it needs). A value a step is computing is waited for;
/// a pending one is computed now. Returns true when this read had to compute it (an
/// implicit sync). Re-throws a stored execution error.
bool materialize(const NodePtr& node);

}  // namespace lazy::graph

#if LAZYTENSOR_HEADER_DEFINITIONS
namespace lazy::graph {

LAZYTENSOR_INLINE Device& common_device(const std::vector<NodePtr>& inputs, const char* op) {
  Device* d = inputs.empty() ? &current_device() : inputs.front()->device();
  for (const auto& in : inputs) {
    if (in->device() != d) {
      throw DeviceError(std::string(op) + ": expected all tensors on the same device, found " + d->str() +
                        " and " + in->device()->str());
    }
  }
  return *d;
}

LAZYTENSOR_INLINE NodePtr submit(NodePtr node) {
  if (PartitionHook hook = partition_hook().load(std::memory_order_acquire)) {
    for (const auto& in : node->inputs())
      if (in->kind() == NodeKind::Sharded) return hook(std::move(node));
  }
  return submit_unpartitioned(std::move(node));
}

LAZYTENSOR_INLINE NodePtr submit_unpartitioned(NodePtr node) {
  Device& dev = *node->device();
  if (dev.eager())
    execute(dev, std::span(&node, 1));
  else dev.trace(node);
  return node;
}

LAZYTENSOR_INLINE void step_all_devices() {
  auto& registry = DeviceRegistry::get();
  const int n = registry.count();
  for (int i = 0; i < n; ++i) run_step(registry.device(i), collect_step(registry.device(i)));
}

LAZYTENSOR_INLINE bool materialize(const NodePtr& node) {
  Device& dev = *node->device();
  if (!node->materialized() && !node->pending()) dev.wait_idle();
  dev.rethrow_stored_error();
  if (node->materialized()) return false;
  execute(dev, std::span(&node, 1));
  return true;
}

}  // namespace lazy::graph
#endif  // LAZYTENSOR_HEADER_DEFINITIONS
// ---- end lazytensor/graph/submit.hpp ----
// ---- begin lazytensor/tensor/tensor.hpp ----
// lazy::Tensor<T>: a cheap handle, like torch::Tensor. Copies share one tensor object that
// points at the graph node holding the current value; in-place ops rebind that node.

#include <cstdint>
#include <cstring>
#include <iomanip>
#include <memory>
#include <ostream>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

// ---- begin lazytensor/autograd/engine.hpp ----
// The backward pass: walks the GradFn graph from the roots in dependency order, summing
// the gradients that reach each function before applying it. Every gradient is a pending
// node, so backward runs no kernel: forward, backward and the optimizer update of a step
// materialize together at the next mark_step.

#include <algorithm>
#include <deque>
#include <memory>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

// ---- begin lazytensor/autograd/accumulate.hpp ----
// AccumulateGrad: the end of every gradient path into a leaf. It adds the incoming
// gradient into the leaf's `.grad()` (lazily: a pending add), as libtorch does.

#include <memory>
#include <string>
#include <vector>

// ---- begin lazytensor/autograd/function.hpp ----
// The autograd graph, as in libtorch: every value computed from tensors that require grad
// records a GradFn that maps the gradient of its output to the gradients of its inputs,
// and points (`next`) at the functions that receive those. Leaves end in AccumulateGrad,
// which adds into the leaf's `.grad()`. Gradients are graph nodes too, so a backward pass
// only builds pending work; it runs at the next mark_step with the forward and the update.
//
// This header only needs the graph layer: tensors, expressions and ops include it.

#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>


namespace lazy::autograd {

class GradFn;
/// Where a gradient goes: the function that receives it (nullptr: nowhere, no grad).
using GradFnPtr = std::shared_ptr<GradFn>;

/// A backward function: gradient of its output -> gradients of its inputs.
class GradFn {
 public:
  virtual ~GradFn() = default;

  /// Name as libtorch prints it ("MulBackward0", "MmBackward0", ...).
  virtual std::string name() const = 0;
  /// Gradients of the inputs (one per entry of `next`; nullptr where none flows), given
  /// the gradient of the output (same dtype and shape as the output).
  virtual std::vector<graph::NodePtr> apply(const graph::NodePtr& grad_output) = 0;
  /// Drops what forward saved for backward (after a backward without retain_graph).
  virtual void release_saved() { released_ = true; }
  /// True once release_saved() ran: a second backward through this function is an error.
  bool released() const { return released_; }

  /// Receivers of the input gradients, in input order.
  std::vector<GradFnPtr> next;
  /// Metadata of the output, to check and shape incoming gradients.
  DType dtype = DType::Float32;
  Shape shape;
  graph::Device* device = nullptr;
  /// Non-leaf tensors whose `.grad()` should be kept (retain_grad): filled by backward.
  std::vector<std::weak_ptr<graph::TensorImpl>> retained;

 protected:
  /// Raises the libtorch error for a second backward through a freed graph.
  void check_not_released() const;

 private:
  bool released_ = false;
};

/// Per-tensor autograd state (defined with the tensor object it belongs to).
using AutogradMeta = graph::AutogradState;

// ---- grad mode -------------------------------------------------------------------------

/// Whether operations record autograd history on this thread (torch.is_grad_enabled()).
inline bool& grad_mode() {
  thread_local bool enabled = true;
  return enabled;
}
/// True when autograd records history on this thread.
inline bool is_grad_enabled() { return grad_mode(); }
/// Turns history recording on or off for this thread (torch.set_grad_enabled).
inline void set_grad_enabled(bool on) { grad_mode() = on; }

/// Scope guard that sets grad mode and restores the previous mode on exit.
class AutoGradMode {
 public:
  explicit AutoGradMode(bool enabled) : prev_(grad_mode()) { grad_mode() = enabled; }
  ~AutoGradMode() { grad_mode() = prev_; }
  AutoGradMode(const AutoGradMode&) = delete;
  AutoGradMode& operator=(const AutoGradMode&) = delete;

 private:
  bool prev_;
};

}  // namespace lazy::autograd

namespace lazy {
/// Disables gradient recording in its scope (torch::NoGradGuard): optimizer updates,
/// evaluation loops.
class NoGradGuard : public autograd::AutoGradMode {
 public:
  NoGradGuard() : AutoGradMode(false) {}
};
}  // namespace lazy

#if LAZYTENSOR_HEADER_DEFINITIONS
namespace lazy::autograd {
LAZYTENSOR_INLINE void GradFn::check_not_released() const {
  if (released_) {
    throw Error("Trying to backward through the graph a second time (or directly access saved tensors after "
                "they have already been freed) in " + name() +
                ". Specify retain_graph=true if you need to backward through the graph a second time.");
  }
}
}  // namespace lazy::autograd
#endif  // LAZYTENSOR_HEADER_DEFINITIONS
// ---- end lazytensor/autograd/function.hpp ----
// ---- begin lazytensor/autograd/node_ops.hpp ----
// The few operations autograd performs on gradients (a GradFn receives and returns graph
// nodes): sum a broadcast gradient back to an input's shape, convert dtype, add two
// gradients, make a constant. All build pending nodes. Each exists typed (instantiated for
// the dtypes a program uses) and, where the dtype is a run-time value, behind a table that
// the typed code fills.

#include <algorithm>
#include <atomic>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

// ---- begin lazytensor/graph/reduction_node.hpp ----
// Reductions fused with their element-wise child: the child expression is evaluated inside
// the reduction loop, never written out. The child is viewed as [outer, R, inner] and
// reduced over R.
//
// Determinism: a span of R contiguous values is cut into fixed blocks of kReduceBlock
// elements, each reduced with 4 independent SIMD accumulators, and the block results are
// combined by a pairwise tree. Block boundaries depend only on the sizes, so results are
// bitwise identical whatever the number of threads.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <typeinfo>
#include <vector>

// ---- begin lazytensor/expr/reduce_ops.hpp ----
// Reduction functors: identity, combine (scalar or xsimd batch) and horizontal reduce.

#include <cstdint>
#include <limits>
#include <type_traits>

#include <xsimd/xsimd.hpp>


namespace lazy::ops::reduce {

namespace detail {
template <class V>
struct scalar_of {
  using type = V;
};
template <class T, class A>
struct scalar_of<xsimd::batch<T, A>> {
  using type = T;
};
template <class V>
using scalar_of_t = typename scalar_of<V>::type;

template <class S, class V, class F>
S horizontal(const V& v, F f) {
  if constexpr (std::is_arithmetic_v<V>) {
    return v;
  } else {
    alignas(64) S tmp[V::size];
    v.store_aligned(tmp);
    S r = tmp[0];
    for (std::size_t k = 1; k < V::size; ++k) r = f(r, tmp[k]);
    return r;
  }
}
}  // namespace detail

/// Sum; integers and bool accumulate and return int64, as torch.sum.
struct Sum {
  static constexpr const char* name = "sum";
  template <class T>
  using result = std::conditional_t<is_floating_v<T>, T, std::int64_t>;
  template <class V>
  static V identity() {
    return V(0);
  }
  template <class V>
  static V combine(const V& a, const V& b) {
    return a + b;
  }
  template <class S, class V>
  static S horizontal(const V& v) {
    if constexpr (std::is_arithmetic_v<V>) return v;
    else return xsimd::hadd(v);
  }
};

/// Product; integers and bool return int64, as torch.prod.
struct Prod {
  static constexpr const char* name = "prod";
  template <class T>
  using result = std::conditional_t<is_floating_v<T>, T, std::int64_t>;
  template <class V>
  static V identity() {
    return V(1);
  }
  template <class V>
  static V combine(const V& a, const V& b) {
    return a * b;
  }
  template <class S, class V>
  static S horizontal(const V& v) {
    return detail::horizontal<S>(v, [](S a, S b) { return a * b; });
  }
};

// NaN tests on batches use xsimd::isnan: xsimd 8's AVX/AVX-512 `!=` compares with
// _CMP_NEQ_OQ (ordered), so there `nan != nan` is false and `a != a` never finds a NaN.

/// Maximum, NaN-propagating (torch.amax).
struct Max {
  static constexpr const char* name = "max";
  template <class T>
  using result = T;
  template <class V>
  static V identity() {
    using S = detail::scalar_of_t<V>;
    if constexpr (std::numeric_limits<S>::has_infinity) return V(-std::numeric_limits<S>::infinity());
    else return V(std::numeric_limits<S>::lowest());
  }
  template <class V>
  static V combine(const V& a, const V& b) {
    using xsimd::select;
    if constexpr (std::is_arithmetic_v<V>) return (a > b || a != a) ? a : b;
    else return select((a > b) | xsimd::isnan(a), a, b);  // not a != a: see the note above
  }
  template <class S, class V>
  static S horizontal(const V& v) {
    return detail::horizontal<S>(v, [](S a, S b) { return combine(a, b); });
  }
};

/// Minimum, NaN-propagating (torch.amin).
struct Min {
  static constexpr const char* name = "min";
  template <class T>
  using result = T;
  template <class V>
  static V identity() {
    using S = detail::scalar_of_t<V>;
    if constexpr (std::numeric_limits<S>::has_infinity) return V(std::numeric_limits<S>::infinity());
    else return V(std::numeric_limits<S>::max());
  }
  template <class V>
  static V combine(const V& a, const V& b) {
    using xsimd::select;
    if constexpr (std::is_arithmetic_v<V>) return (a < b || a != a) ? a : b;
    else return select((a < b) | xsimd::isnan(a), a, b);
  }
  template <class S, class V>
  static S horizontal(const V& v) {
    return detail::horizontal<S>(v, [](S a, S b) { return combine(a, b); });
  }
};

/// Any non-zero (fed with 0/1 values): max with identity 0.
struct Any : Max {
  static constexpr const char* name = "any";
  template <class T>
  using result = bool;
  template <class V>
  static V identity() {
    return V(0);
  }
};

/// All non-zero (fed with 0/1 values): min with identity 1.
struct All : Min {
  static constexpr const char* name = "all";
  template <class T>
  using result = bool;
  template <class V>
  static V identity() {
    return V(1);
  }
};

}  // namespace lazy::ops::reduce
// ---- end lazytensor/expr/reduce_ops.hpp ----

namespace lazy::graph {

/// Leaf size of the pairwise reduction tree (also the chunk of fused groups, see
/// chunk_reduction.hpp).
inline constexpr std::int64_t kReduceBlock = 4096;

/// How a child of shape `in` is reduced: [outer, R, inner].
struct ReduceGeometry {
  std::int64_t outer = 1, extent = 1, inner = 1;
};

namespace detail {

/// A batch of the child's values at [i, i + W) with the lanes from `count` on replaced by
/// the reduction's identity (the tail of a span; the read stays inside the padding).
template <class R, class S, bool C, class Ev>
inline expr::batch_t<S> masked_packet(const Ev& ev, std::int64_t i, std::int64_t count) {
  using V = expr::batch_t<S>;
  alignas(64) S tmp[V::size];
  ev.template packet<C>(i).store_aligned(tmp);
  for (std::int64_t k = count; k < static_cast<std::int64_t>(V::size); ++k) tmp[k] = R::template identity<S>();
  return V::load_aligned(tmp);
}

template <class R, class S, bool C, class Ev>
LAZY_KERNEL_LOOP S reduce_span(const Ev& ev, std::int64_t b, std::int64_t len) {
  const std::int64_t e = b + len;
  std::int64_t i = b;
  if constexpr (Ev::simd) {
    using V = expr::batch_t<S>;
    constexpr std::int64_t W = V::size;
    V a0 = R::template identity<V>(), a1 = a0, a2 = a0, a3 = a0;
    for (; i + 4 * W <= e; i += 4 * W) {
      a0 = R::combine(a0, ev.template packet<C>(i));
      a1 = R::combine(a1, ev.template packet<C>(i + W));
      a2 = R::combine(a2, ev.template packet<C>(i + 2 * W));
      a3 = R::combine(a3, ev.template packet<C>(i + 3 * W));
    }
    // At most four more batches, the last one partial: one masked body serves them all.
    for (; i < e; i += W) a0 = R::combine(a0, masked_packet<R, S, C>(ev, i, std::min(W, e - i)));
    return R::template horizontal<S>(R::combine(R::combine(a0, a1), R::combine(a2, a3)));
  } else {
    S a[4] = {R::template identity<S>(), R::template identity<S>(), R::template identity<S>(),
              R::template identity<S>()};
    for (; i + 4 <= e; i += 4) {
      for (int k = 0; k < 4; ++k) a[k] = R::combine(a[k], ev.coeff(i + k));
    }
    for (; i < e; ++i) a[0] = R::combine(a[0], ev.coeff(i));
    return R::combine(R::combine(a[0], a[1]), R::combine(a[2], a[3]));
  }
}

/// Combines the `n` partial results at `v` pairwise, in a fixed shape (overwriting them).
template <class R, class S>
S pairwise(S* v, std::size_t n) {
  if (n == 0) return R::template identity<S>();
  while (n > 1) {
    std::size_t j = 0;
    for (std::size_t i = 0; i + 1 < n; i += 2) v[j++] = R::combine(v[i], v[i + 1]);
    if (n % 2) v[j++] = v[n - 1];
    n = j;
  }
  return v[0];
}

/// Per-block partial results: the blocks of a statement that fits in L2 need no heap.
template <class S>
using Partials = core::SmallVector<S, 64>;

/// Input pointers of a node's kernel (most kernels read a handful of inputs).
using InputPointers = core::SmallVector<const void*, 8>;

/// Per input, 1 when it is a single element broadcast over a child of `child_numel`
/// elements (the kernel then reads that element for every index).
core::SmallVector<char, 8> splat_flags(const std::vector<NodePtr>& inputs,
                                              std::int64_t child_numel);

template <class R, class S, bool C, class Ev>
S reduce_range(const Ev& ev, std::int64_t b, std::int64_t len) {
  if (len <= kReduceBlock) return reduce_span<R, S, C>(ev, b, len);
  Partials<S> partial;
  partial.resize(static_cast<std::size_t>((len + kReduceBlock - 1) / kReduceBlock));
  for (std::size_t j = 0; j < partial.size(); ++j) {
    const std::int64_t o = static_cast<std::int64_t>(j) * kReduceBlock;
    partial[j] = reduce_span<R, S, C>(ev, b + o, std::min(kReduceBlock, len - o));
  }
  return pairwise<R>(partial.data(), partial.size());
}

}  // namespace detail

/// What the SPMD partitioner needs of a reduction: the child it reduces (viewed as
/// [outer, extent, inner]) and the same reduction over a block of it.
class BlockReduction {
 public:
  virtual ~BlockReduction() = default;
  virtual const Shape& child_shape() const = 0;
  virtual ReduceGeometry geometry() const = 0;
  /// The reduction's name ("sum", "prod", "max", "min", "any", "all").
  virtual const char* reduce_name() const = 0;
  /// The same kernel and scale over `inputs` (blocks of this node's inputs, of `child`
  /// shape or single elements), producing `out` on `device`, not yet submitted.
  virtual NodePtr with_block(std::vector<NodePtr> inputs, Shape out, ReduceGeometry g, Shape child,
                             Device* device) const = 0;
};

/// Reduces kernel-form expression K (with lane S) by R into Tout, scaling by `scale`.
template <class K, class R, class S, Element Tout>
class ReductionNode final : public Node, public ChunkReduction, public BlockReduction {
 public:
  ReductionNode(K kernel, Shape out_shape, ReduceGeometry g, double scale, Device* device,
                std::vector<NodePtr> inputs, Shape child_shape)
      : Node(NodeKind::Reduction, dtype_of<Tout>(), out_shape, device, std::move(inputs)),
        kernel_(std::move(kernel)),
        g_(g),
        scale_(scale),
        child_shape_(child_shape),
        splat_(detail::splat_flags(this->inputs(), child_shape.numel())) {}

  std::string op_name() const override { return R::name; }
  std::string describe() const override {
    return std::string(R::name) + "(" + expr::kernel_text(kernel_) + ") over [" + std::to_string(g_.outer) +
           ", " + std::to_string(g_.extent) + ", " + std::to_string(g_.inner) + "]";
  }
  double cost_per_element() const override { return expr::kernel_cost<K>() + 1; }
  std::uint64_t structural_hash() const override {
    static const std::uint64_t kernel_hash = typeid(K).hash_code();  // hashes the type's name: once
    std::uint64_t h = hash_combine(Node::structural_hash(), kernel_hash);
    h = hash_combine(h, hash_shape(child_shape_));
    return hash_combine(h, static_cast<std::uint64_t>(g_.extent));
  }

  const Shape& child_shape() const override { return child_shape_; }
  ReduceGeometry geometry() const override { return g_; }
  const char* reduce_name() const override { return R::name; }
  NodePtr with_block(std::vector<NodePtr> inputs, Shape out, ReduceGeometry g, Shape child,
                     Device* device) const override {
    return std::make_shared<ReductionNode>(kernel_, out, g, scale_, device, std::move(inputs), child);
  }

  bool reduces_all() const override { return g_.outer == 1 && g_.inner == 1; }
  std::size_t partial_bytes() const override { return sizeof(S); }
  void reduce_chunk(const void* const* inputs, std::int64_t len, void* partial) const override {
    bool contig = true;
    for (char s : splat_) contig = contig && !s;
    const expr::Evaluator<S, K> ev(kernel_, inputs, splat_.data());
    *static_cast<S*>(partial) = contig ? detail::reduce_span<R, S, true>(ev, 0, len) : detail::reduce_span<R, S, false>(ev, 0, len);
  }
  void finish_partials(ExecContext& ctx, void* partials, std::int64_t count) override {
    auto buf = allocate_output(ctx, false);
    static_cast<Tout*>(buf->data())[0] = finish_value(
        detail::pairwise<R>(static_cast<S*>(partials), static_cast<std::size_t>(count)));
    set_buffer(std::move(buf));
    finish();
  }

 protected:
  void compute(ExecContext& ctx) override {
    const auto& ins = inputs();
    detail::InputPointers ptrs;
    ptrs.resize(ins.size());
    for (std::size_t i = 0; i < ins.size(); ++i) ptrs[i] = ins[i]->buffer()->data();
    auto buf = allocate_output(ctx, false);
    Tout* out = static_cast<Tout*>(buf->data());
    bool contig = true;
    for (char s : splat_) contig = contig && !s;
    if (contig) run<true>(ctx, ptrs, out);
    else run<false>(ctx, ptrs, out);
    set_buffer(std::move(buf));
  }

 private:
  Tout finish_value(S v) const {
    if (scale_ != 1.0) v = static_cast<S>(v * static_cast<S>(scale_));
    return expr::to_storage<Tout>(v);
  }

  template <bool C>
  void run(ExecContext& ctx, const detail::InputPointers& ptrs, Tout* out) {
    auto& pool = ctx.device.threads();
    const double cost = cost_per_element();
    const std::int64_t outer = g_.outer, R_ = g_.extent, inner = g_.inner;
    const std::int64_t total = outer * R_ * inner;
    auto eval = [&] { return expr::Evaluator<S, K>(kernel_, ptrs.data(), splat_.data()); };
    if (inner == 1 && outer == 1) {
      // One value: blocks in parallel, then the fixed pairwise tree.
      const std::int64_t blocks = (R_ + kReduceBlock - 1) / kReduceBlock;
      detail::Partials<S> partial;
      partial.resize(static_cast<std::size_t>(blocks));
      const std::int64_t tasks = std::min(blocks, task_count(pool, total, cost));
      pool.parallel_for(tasks, [&](std::int64_t t) {
        auto ev = eval();
        auto [b0, b1] = task_range(blocks, tasks, t);
        for (std::int64_t b = b0; b < b1; ++b) {
          const std::int64_t s = b * kReduceBlock;
          partial[b] = detail::reduce_span<R, S, C>(ev, s, std::min(kReduceBlock, R_ - s));
        }
      });
      out[0] = finish_value(detail::pairwise<R>(partial.data(), partial.size()));
    } else if (inner == 1) {
      const std::int64_t tasks = std::min(outer, task_count(pool, total, cost));
      pool.parallel_for(tasks, [&](std::int64_t t) {
        auto ev = eval();
        auto [o0, o1] = task_range(outer, tasks, t);
        for (std::int64_t o = o0; o < o1; ++o) out[o] = finish_value(detail::reduce_range<R, S, C>(ev, o * R_, R_));
      });
    } else {
      // Reduce across rows: vectorized along the inner dimension, R in order.
      constexpr std::int64_t kCols = 256;
      const std::int64_t col_chunks = (inner + kCols - 1) / kCols;
      const std::int64_t units = outer * col_chunks;
      const std::int64_t tasks = std::min(units, task_count(pool, total, cost));
      pool.parallel_for(tasks, [&](std::int64_t t) {
        auto ev = eval();
        auto [u0, u1] = task_range(units, tasks, t);
        for (std::int64_t u = u0; u < u1; ++u) {
          const std::int64_t o = u / col_chunks, c0 = (u % col_chunks) * kCols, c1 = std::min(inner, c0 + kCols);
          reduce_columns<C>(ev, out + o * inner, o * R_ * inner, c0, c1);
        }
      });
    }
  }

  template <bool C>
  LAZY_KERNEL_LOOP void reduce_columns(const expr::Evaluator<S, K>& ev, Tout* out, std::int64_t base, std::int64_t c0, std::int64_t c1) {
    const std::int64_t R_ = g_.extent, inner = g_.inner;
    if constexpr (expr::Evaluator<S, K>::simd) {
      // Whole batches of columns; the last may be partial (its extra lanes are computed
      // from padding and dropped).
      using V = expr::batch_t<S>;
      constexpr std::int64_t W = V::size;
      for (std::int64_t c = c0; c < c1; c += W) {
        V acc = R::template identity<V>();
        for (std::int64_t r = 0; r < R_; ++r) acc = R::combine(acc, ev.template packet<C>(base + r * inner + c));
        alignas(64) S tmp[W];
        acc.store_aligned(tmp);
        for (std::int64_t k = 0; k < std::min(W, c1 - c); ++k) out[c + k] = finish_value(tmp[k]);
      }
    } else {
      for (std::int64_t c = c0; c < c1; ++c) {
        S acc = R::template identity<S>();
        for (std::int64_t r = 0; r < R_; ++r) acc = R::combine(acc, ev.coeff(base + r * inner + c));
        out[c] = finish_value(acc);
      }
    }
  }

  K kernel_;
  ReduceGeometry g_;
  double scale_;
  Shape child_shape_;
  core::SmallVector<char, 8> splat_;
};

/// argmax / argmin (first occurrence; NaN counts as the extreme, as in torch).
template <class K, class S, bool IsMax>
class ArgReductionNode final : public Node {
 public:
  ArgReductionNode(K kernel, Shape out_shape, ReduceGeometry g, Device* device,
                   std::vector<NodePtr> inputs, Shape child_shape)
      : Node(NodeKind::Reduction, DType::Int64, out_shape, device, std::move(inputs)),
        kernel_(std::move(kernel)),
        g_(g),
        splat_(detail::splat_flags(this->inputs(), child_shape.numel())) {}
  std::string op_name() const override { return IsMax ? "argmax" : "argmin"; }
  std::string describe() const override { return op_name() + "(" + expr::kernel_text(kernel_) + ")"; }

 protected:
  void compute(ExecContext& ctx) override {
    const auto& ins = inputs();
    detail::InputPointers ptrs;
    ptrs.resize(ins.size());
    for (std::size_t i = 0; i < ins.size(); ++i) ptrs[i] = ins[i]->buffer()->data();
    auto buf = allocate_output(ctx, false);
    auto* out = static_cast<std::int64_t*>(buf->data());
    auto& pool = ctx.device.threads();
    const std::int64_t units = g_.outer * g_.inner;
    const std::int64_t tasks = std::min(units, task_count(pool, units * g_.extent, 2.0));
    pool.parallel_for(tasks, [&](std::int64_t t) {
      expr::Evaluator<S, K> ev(kernel_, ptrs.data(), splat_.data());
      auto [u0, u1] = task_range(units, tasks, t);
      for (std::int64_t u = u0; u < u1; ++u) {
        const std::int64_t o = u / g_.inner, c = u % g_.inner;
        const std::int64_t base = o * g_.extent * g_.inner + c;
        S best = ev.coeff(base);
        std::int64_t best_i = 0;
        for (std::int64_t r = 1; r < g_.extent && best == best; ++r) {
          const S v = ev.coeff(base + r * g_.inner);
          if ((IsMax ? v > best : v < best) || v != v) {
            best = v;
            best_i = r;
          }
        }
        out[u] = best_i;
      }
    });
    set_buffer(std::move(buf));
  }

 private:
  K kernel_;
  ReduceGeometry g_;
  core::SmallVector<char, 8> splat_;
};

}  // namespace lazy::graph

#if LAZYTENSOR_HEADER_DEFINITIONS
namespace lazy::graph::detail {

LAZYTENSOR_INLINE core::SmallVector<char, 8> splat_flags(const std::vector<NodePtr>& inputs,
    std::int64_t child_numel) {
  core::SmallVector<char, 8> flags;
  flags.resize(inputs.size());
  for (std::size_t i = 0; i < inputs.size(); ++i)
    flags[i] = inputs[i]->numel() == 1 && child_numel != 1 ? 1 : 0;
  return flags;
}

}  // namespace lazy::graph::detail
#endif  // LAZYTENSOR_HEADER_DEFINITIONS
// ---- end lazytensor/graph/reduction_node.hpp ----

namespace lazy::autograd {

namespace detail {
template <Element T, class Op, class... Ks>
graph::NodePtr elementwise(const Shape& shape, graph::Device* dev, std::vector<graph::NodePtr> inputs, Ks... ks) {
  using K = expr::KExpr<Op, Ks...>;
  return graph::submit(graph::elementwise_node<T>(K{{ks...}}, shape, dev, std::move(inputs)));
}
}  // namespace detail

// ---- typed operations: instantiated only for the dtypes a program differentiates ---------

/// `g` (dtype From) converted to To.
template <Element To, Element From>
graph::NodePtr cast_node_to(const graph::NodePtr& g) {
  if constexpr (std::is_same_v<To, From>) return g;
  else return detail::elementwise<To, ops::Cast<To>>(g->shape(), g->device(), {g}, expr::KLeaf<From>{0});
}

/// a + b for two gradients of dtype T and one shape.
template <Element T>
graph::NodePtr add_nodes_of(const graph::NodePtr& a, const graph::NodePtr& b) {
  return detail::elementwise<T, ops::Add>(a->shape(), a->device(), {a, b}, expr::KLeaf<T>{0}, expr::KLeaf<T>{1});
}

/// A pending tensor of dtype T and `shape` filled with `value`.
template <Element T>
graph::NodePtr full_node_of(const Shape& shape, graph::Device* dev, double value) {
  return detail::elementwise<T, ops::Identity>(shape, dev, {}, expr::Scalar<T>{static_cast<T>(value)});
}

/// Sums gradient `g` of dtype T (shape `from`) over the dimensions that were broadcast from
/// `to` (NumPy rules), giving a tensor of shape `to`. Each run of adjacent broadcast dims is
/// one deterministic reduction pass; the common cases (bias rows, per-channel columns) take
/// a single pass.
template <Element T>
graph::NodePtr sum_to_shape_of(const graph::NodePtr& g, const Shape& to) {
  const Shape& from = g->shape();
  if (from == to) return g;
  if (!broadcastable_to(to, from)) {
    throw ShapeError("autograd: gradient of shape " + from.str() + " cannot be summed to shape " + to.str());
  }
  const int r = from.rank(), off = r - to.rank();
  std::vector<char> reduced(static_cast<std::size_t>(r));
  for (int d = 0; d < r; ++d) reduced[d] = d < off || (to[d - off] == 1 && from[d] != 1);
  using S = compute_t<T>;
  graph::NodePtr cur = g;
  Shape cur_shape = from;  // keepdim shape of `cur`, rank r
  // Innermost run first: later passes read less data.
  for (int hi = r - 1; hi >= 0;) {
    if (!reduced[hi]) {
      --hi;
      continue;
    }
    int lo = hi;
    while (lo > 0 && reduced[lo - 1]) --lo;
    graph::ReduceGeometry geo;
    for (int d = 0; d < r; ++d) {
      (d < lo ? geo.outer : d > hi ? geo.inner : geo.extent) *= cur_shape[d];
    }
    Shape next = cur_shape;
    for (int d = lo; d <= hi; ++d) next[d] = 1;
    bool more = false;
    for (int d = 0; d < lo; ++d) more = more || reduced[d];
    const Shape out = more ? next : to;  // the last pass writes the target shape directly
    using K = expr::KLeaf<T>;
    cur = graph::submit(std::make_shared<graph::ReductionNode<K, ops::reduce::Sum, S, T>>(
        K{0}, out, geo, 1.0, cur->device(), std::vector<graph::NodePtr>{cur}, cur_shape));
    cur_shape = next;
    hi = lo - 1;
  }
  return cur;
}

// ---- run-time dtype: a table filled by the typed code that records backward functions -----
//
// A GradFn hands gradients around as graph nodes whose dtype is a run-time value. Dispatching
// on it with a switch would compile every dtype's kernels into every program; instead, code
// that knows T (a Tensor<T> that starts requiring grad, an op recording its backward, an
// element-wise backward and the dtypes of its leaves) registers T's operations here, so a
// float-only program holds float kernels only. A gradient of dtype T only exists after such
// code ran, so a lookup finds its entry.

namespace detail {
using AddFn = graph::NodePtr (*)(const graph::NodePtr&, const graph::NodePtr&);
using SumToFn = graph::NodePtr (*)(const graph::NodePtr&, const Shape&);
using CastFn = graph::NodePtr (*)(const graph::NodePtr&);
inline constexpr int kDTypes = 6;

struct GradOpsTable {
  std::atomic<AddFn> add[kDTypes] = {};
  std::atomic<SumToFn> sum_to[kDTypes] = {};
  std::atomic<CastFn> cast[kDTypes][kDTypes] = {};  // [from][to]
};
inline GradOpsTable& grad_ops_table() {
  static GradOpsTable table;
  return table;
}

[[noreturn]] void missing_grad_op(const char* what, DType d, DType to);
}  // namespace detail

/// Makes the gradient operations of dtype T available to code that sees T at run time only.
template <Element T>
void register_grad_dtype() {
  if constexpr (is_floating_v<T>) {
    static const bool once = [] {
      auto& t = detail::grad_ops_table();
      const int d = static_cast<int>(dtype_of<T>());
      t.add[d].store(&add_nodes_of<T>, std::memory_order_release);
      t.sum_to[d].store(&sum_to_shape_of<T>, std::memory_order_release);
      return true;
    }();
    (void)once;
  }
}

/// Makes the conversion of gradients from dtype From to To available at run time.
template <Element From, Element To>
void register_grad_cast() {
  if constexpr (is_floating_v<From> && is_floating_v<To> && !std::is_same_v<From, To>) {
    static const bool once = [] {
      detail::grad_ops_table()
          .cast[static_cast<int>(dtype_of<From>())][static_cast<int>(dtype_of<To>())]
          .store(&cast_node_to<To, From>, std::memory_order_release);
      return true;
    }();
    (void)once;
  }
}

/// `g` converted to dtype `to`.
graph::NodePtr cast_node(const graph::NodePtr& g, DType to);

/// a + b for two gradients of one shape (b converted to a's dtype).
graph::NodePtr add_nodes(const graph::NodePtr& a, const graph::NodePtr& b);

/// sum_to_shape_of for a gradient whose dtype is known at run time only.
graph::NodePtr sum_to_shape(const graph::NodePtr& g, const Shape& to);

#if LAZYTENSOR_HEADER_DEFINITIONS
namespace detail {
[[noreturn]] LAZYTENSOR_INLINE void missing_grad_op(const char* what, DType d, DType to) {
  throw DTypeError(std::string("autograd: no ") + what + " for gradients of dtype " + dtype_name(d) +
                   (d == to ? std::string() : " to " + dtype_name(to)) +
                   " was compiled into this program (only floating point tensors have gradients)");
}
}  // namespace detail

LAZYTENSOR_INLINE graph::NodePtr cast_node(const graph::NodePtr& g, DType to) {
  if (g->dtype() == to) return g;
  auto f = detail::grad_ops_table()
               .cast[static_cast<int>(g->dtype())][static_cast<int>(to)]
               .load(std::memory_order_acquire);
  if (!f) detail::missing_grad_op("conversion", g->dtype(), to);
  return f(g);
}

LAZYTENSOR_INLINE graph::NodePtr add_nodes(const graph::NodePtr& a, const graph::NodePtr& b) {
  auto f = detail::grad_ops_table().add[static_cast<int>(a->dtype())].load(std::memory_order_acquire);
  if (!f) detail::missing_grad_op("addition", a->dtype(), a->dtype());
  return f(a, cast_node(b, a->dtype()));
}

LAZYTENSOR_INLINE graph::NodePtr sum_to_shape(const graph::NodePtr& g, const Shape& to) {
  if (g->shape() == to) return g;
  auto f = detail::grad_ops_table().sum_to[static_cast<int>(g->dtype())].load(std::memory_order_acquire);
  if (!f) detail::missing_grad_op("broadcast reduction", g->dtype(), g->dtype());
  return f(g, to);
}
#endif  // LAZYTENSOR_HEADER_DEFINITIONS

}  // namespace lazy::autograd

// Per-dtype templates the compiled runtime instantiates once (core/config.hpp).
#define LAZYTENSOR_NODE_OPS_INSTANCES(P, T)                                                                     \
  P template lazy::graph::NodePtr lazy::autograd::add_nodes_of<T>(const lazy::graph::NodePtr&,                  \
                                                                  const lazy::graph::NodePtr&);                 \
  P template lazy::graph::NodePtr lazy::autograd::full_node_of<T>(const lazy::Shape&, lazy::graph::Device*, double); \
  P template lazy::graph::NodePtr lazy::autograd::sum_to_shape_of<T>(const lazy::graph::NodePtr&, const lazy::Shape&); \
  P template void lazy::autograd::register_grad_dtype<T>();                                                       \
  P template lazy::graph::NodePtr lazy::autograd::cast_node_to<T, float>(const lazy::graph::NodePtr&);            \
  P template lazy::graph::NodePtr lazy::autograd::cast_node_to<T, double>(const lazy::graph::NodePtr&);           \
  P template lazy::graph::NodePtr lazy::autograd::cast_node_to<T, lazy::bfloat16>(const lazy::graph::NodePtr&);   \
  P template void lazy::autograd::register_grad_cast<T, float>();                                                 \
  P template void lazy::autograd::register_grad_cast<T, double>();                                                \
  P template void lazy::autograd::register_grad_cast<T, lazy::bfloat16>();
#if LAZYTENSOR_EXPLICIT_INSTANTIATION
LAZYTENSOR_FOR_FLOATING(LAZYTENSOR_NODE_OPS_INSTANCES, extern)
#endif
// ---- end lazytensor/autograd/node_ops.hpp ----

namespace lazy::autograd {

/// Adds `grad` into the `.grad()` of `impl` (creating it on first use).
void accumulate_into(graph::TensorImpl& impl, graph::NodePtr grad);

/// The gradient sink of a leaf tensor.
class AccumulateGrad final : public GradFn {
 public:
  explicit AccumulateGrad(std::shared_ptr<graph::TensorImpl> leaf);
  std::string name() const override { return "AccumulateGrad"; }
  std::vector<graph::NodePtr> apply(const graph::NodePtr& grad) override {
    accumulate_into(*leaf_, grad);
    return {};
  }
  /// Nothing is saved: a leaf can receive gradients from any number of backward passes.
  void release_saved() override {}
  const std::shared_ptr<graph::TensorImpl>& leaf() const { return leaf_; }

 private:
  std::shared_ptr<graph::TensorImpl> leaf_;
};

/// Where gradients for the tensor object `impl` go when it is read now: its grad_fn, its
/// leaf accumulator (created on first use), or nowhere (nullptr) when it does not require
/// grad or grad mode is off.
GradFnPtr edge_of(const std::shared_ptr<graph::TensorImpl>& impl);

/// True when any of `edges` leads somewhere.
bool any_edge(const std::vector<GradFnPtr>& edges);

/// Makes `fn` (its `next` edges set) the producer of `impl`'s value when any edge is live;
/// returns whether it did. With no live edge nothing changes: an in-place update under
/// no_grad keeps the tensor's own state.
bool attach_grad_fn(graph::TensorImpl& impl, GradFnPtr fn);

#if LAZYTENSOR_HEADER_DEFINITIONS
LAZYTENSOR_INLINE void accumulate_into(graph::TensorImpl& impl, graph::NodePtr grad) {
  const graph::NodePtr& value = impl.node;
  if (!(grad->shape() == value->shape())) {
    throw ShapeError("autograd: gradient of shape " + grad->shape().str() + " for a tensor of shape " +
                     value->shape().str());
  }
  grad = cast_node(grad, value->dtype());
  auto& meta = impl.autograd_meta();
  if (!meta.grad) {
    meta.grad = std::make_shared<graph::TensorImpl>(std::move(grad));
    meta.grad->node->device()->register_handle(meta.grad);
  } else if (!meta.grad->node) {
    meta.grad->node = std::move(grad);
  } else {
    meta.grad->node = add_nodes(meta.grad->node, grad);
  }
}

LAZYTENSOR_INLINE AccumulateGrad::AccumulateGrad(std::shared_ptr<graph::TensorImpl> leaf) : leaf_(std::move(leaf)) {
  dtype = leaf_->node->dtype();
  shape = leaf_->node->shape();
  device = leaf_->node->device();
}

LAZYTENSOR_INLINE GradFnPtr edge_of(const std::shared_ptr<graph::TensorImpl>& impl) {
  if (!impl || !impl->requires_grad() || !is_grad_enabled()) return nullptr;
  auto& meta = *impl->autograd;
  if (meta.grad_fn) return meta.grad_fn;
  GradFnPtr acc = meta.accumulator.lock();
  if (!acc) {
    acc = std::make_shared<AccumulateGrad>(impl);
    meta.accumulator = acc;
  }
  return acc;
}

LAZYTENSOR_INLINE bool any_edge(const std::vector<GradFnPtr>& edges) {
  for (const auto& e : edges)
    if (e) return true;
  return false;
}

LAZYTENSOR_INLINE bool attach_grad_fn(graph::TensorImpl& impl, GradFnPtr fn) {
  if (!fn || !any_edge(fn->next)) return false;
  fn->dtype = impl.node->dtype();
  fn->shape = impl.node->shape();
  fn->device = impl.node->device();
  auto& meta = impl.autograd_meta();
  meta.requires_grad = true;
  meta.grad_fn = std::move(fn);
  return true;
}
#endif  // LAZYTENSOR_HEADER_DEFINITIONS

}  // namespace lazy::autograd
// ---- end lazytensor/autograd/accumulate.hpp ----

namespace lazy::autograd {

/// What a backward pass computes: with `capture` empty, gradients accumulate into leaves'
/// `.grad()`; otherwise the total gradient reaching each captured function is returned
/// instead, and no `.grad()` changes (torch.autograd.grad).
struct BackwardRequest {
  std::vector<std::pair<GradFnPtr, graph::NodePtr>> roots;  ///< (function, gradient of its output)
  bool retain_graph = false;
  std::vector<GradFnPtr> capture;
};

/// Runs a backward pass; returns one gradient per captured function (nullptr when none
/// reached it).
std::vector<graph::NodePtr> run_backward(const BackwardRequest& req);

#if LAZYTENSOR_HEADER_DEFINITIONS
LAZYTENSOR_INLINE std::vector<graph::NodePtr> run_backward(const BackwardRequest& req) {
  AutoGradMode no_grad(false);  // gradients of gradients are not recorded
  // Dependency counts over the graph reachable from the roots.
  std::unordered_map<GradFn*, int> deps;
  std::vector<GradFn*> stack;
  std::unordered_set<GradFn*> seen;
  for (const auto& [fn, g] : req.roots) {
    if (fn && seen.insert(fn.get()).second) stack.push_back(fn.get());
  }
  while (!stack.empty()) {
    GradFn* fn = stack.back();
    stack.pop_back();
    for (const auto& nx : fn->next) {
      if (!nx) continue;
      ++deps[nx.get()];
      if (seen.insert(nx.get()).second) stack.push_back(nx.get());
    }
  }
  std::unordered_map<GradFn*, std::size_t> captured;
  for (std::size_t i = 0; i < req.capture.size(); ++i) captured.emplace(req.capture[i].get(), i);
  std::vector<graph::NodePtr> out(req.capture.size());

  std::unordered_map<GradFn*, graph::NodePtr> pending;
  auto add_grad = [&](GradFn* fn, const graph::NodePtr& g) {
    if (!g) return;
    if (!(g->shape() == fn->shape)) {
      throw ShapeError("autograd: " + fn->name() + " expected a gradient of shape " + fn->shape.str() + ", got " +
                       g->shape().str());
    }
    auto& slot = pending[fn];
    slot = slot ? add_nodes(slot, g) : g;
  };
  std::deque<GradFn*> ready;
  for (const auto& [fn, g] : req.roots) {
    if (!fn) continue;
    add_grad(fn.get(), g);
  }
  for (const auto& [fn, g] : req.roots) {
    if (fn && deps[fn.get()] == 0 && std::find(ready.begin(), ready.end(), fn.get()) == ready.end())
      ready.push_back(fn.get());
  }
  while (!ready.empty()) {
    GradFn* fn = ready.front();
    ready.pop_front();
    graph::NodePtr g;
    if (auto it = pending.find(fn); it != pending.end()) {
      g = std::move(it->second);
      pending.erase(it);
    }
    std::vector<graph::NodePtr> grads;
    if (g) {
      for (const auto& w : fn->retained) {
        if (auto impl = w.lock()) accumulate_into(*impl, g);
      }
      if (auto c = captured.find(fn); c != captured.end()) out[c->second] = g;
      // torch.autograd.grad leaves every .grad() alone; other functions still pass the
      // gradient on, so an input upstream of another captured one gets its share.
      if (!(req.capture.size() && dynamic_cast<AccumulateGrad*>(fn))) grads = fn->apply(g);
    }
    if (!req.retain_graph) fn->release_saved();
    for (std::size_t i = 0; i < fn->next.size(); ++i) {
      GradFn* nx = fn->next[i].get();
      if (!nx) continue;
      if (i < grads.size()) add_grad(nx, grads[i]);
      if (--deps[nx] == 0) ready.push_back(nx);
    }
  }
  return out;
}
#endif  // LAZYTENSOR_HEADER_DEFINITIONS

}  // namespace lazy::autograd
// ---- end lazytensor/autograd/engine.hpp ----
// ---- begin lazytensor/tensor/make_elementwise.hpp ----
// Turning an expression into a pending graph node, with its backward function when a leaf
// requires grad: what `Tensor<T> t = expr;` and the in-place operators do.

#include <memory>
#include <vector>

// ---- begin lazytensor/autograd/elementwise_grad.hpp ----
// The backward function of a fused element-wise kernel: one gradient kernel per input that
// needs a gradient (expr/dual.hpp), summed back over broadcast dimensions and converted to
// the input's dtype.

#include <memory>
#include <string>
#include <utility>
#include <vector>


namespace lazy::autograd {

/// What every element-wise backward does, whatever its expression: for each input that
/// needs a gradient, a gradient kernel (made by the subclass), summed back over broadcast
/// dimensions and converted to the input's dtype.
class ElementwiseGradFnBase : public GradFn {
 public:
  explicit ElementwiseGradFnBase(std::vector<graph::NodePtr> inputs) : inputs_(std::move(inputs)) {}

  std::vector<graph::NodePtr> apply(const graph::NodePtr& grad) override;

  void release_saved() override;

 protected:
  /// A pending node computing grad * d(output)/d(input `slot`), in the output's shape.
  virtual graph::NodePtr gradient_kernel(int slot, const graph::NodePtr& grad) const = 0;
  const std::vector<graph::NodePtr>& inputs() const { return inputs_; }

 private:
  std::vector<graph::NodePtr> inputs_;
};

namespace detail {
/// Registers the conversions from gradient dtype S to the dtype of every leaf of kernel K.
template <class S, class K>
struct register_leaf_casts {
  static void run() {}
};
template <class S, Element T>
struct register_leaf_casts<S, expr::KLeaf<T>> {
  static void run() { register_grad_cast<S, T>(); }
};
template <class S, class Op, class... C>
struct register_leaf_casts<S, expr::KExpr<Op, C...>> {
  static void run() { (register_leaf_casts<S, C>::run(), ...); }
};
}  // namespace detail

/// Backward of `y = K(inputs...)` with output dtype Tout.
template <class K, Element Tout>
class ElementwiseGradFn final : public ElementwiseGradFnBase {
 public:
  ElementwiseGradFn(K kernel, std::vector<graph::NodePtr> inputs)
      : ElementwiseGradFnBase(std::move(inputs)), kernel_(std::move(kernel)) {
    // apply() sums gradients of the kernel's lane back to each input's shape and dtype.
    using S = typename expr::KGrad<K, Tout>::value_type;
    register_grad_dtype<Tout>();
    if constexpr (is_floating_v<S>) {
      register_grad_dtype<S>();
      detail::register_leaf_casts<S, K>::run();
    }
  }

  std::string name() const override {
    std::string n = op_label();
    if (!n.empty() && n[0] >= 'a' && n[0] <= 'z') n[0] = static_cast<char>(n[0] - 'a' + 'A');
    return n + "Backward0";
  }

 protected:
  graph::NodePtr gradient_kernel(int slot, const graph::NodePtr& grad) const override {
    using KG = expr::KGrad<K, Tout>;
    using S = typename KG::value_type;
    if constexpr (std::is_same_v<S, float> || std::is_same_v<S, double>) {
      std::vector<graph::NodePtr> ins = inputs();
      const int g_slot = static_cast<int>(ins.size());
      ins.push_back(cast_node(grad, dtype_of<Tout>()));
      return graph::submit(
          graph::elementwise_node<S>(KG{kernel_, expr::KLeaf<Tout>{g_slot}, slot}, shape, grad->device(), std::move(ins)));
    } else {
      throw DTypeError("autograd: no gradient through an expression computed in " + dtype_name(dtype_of<S>()));
    }
  }

 private:
  static const char* op_label() {
    if constexpr (requires { typename K::op_type; }) return K::op_type::name;
    else return "Identity";
  }

  K kernel_;
};

#if LAZYTENSOR_HEADER_DEFINITIONS
LAZYTENSOR_INLINE std::vector<graph::NodePtr> ElementwiseGradFnBase::apply(const graph::NodePtr& grad) {
  check_not_released();
  std::vector<graph::NodePtr> grads(next.size());
  for (std::size_t s = 0; s < next.size(); ++s) {
    if (!next[s]) continue;
    graph::NodePtr g = gradient_kernel(static_cast<int>(s), grad);
    g = sum_to_shape(g, inputs_[s]->shape());
    grads[s] = cast_node(g, inputs_[s]->dtype());
  }
  return grads;
}

LAZYTENSOR_INLINE void ElementwiseGradFnBase::release_saved() {
  inputs_.clear();
  GradFn::release_saved();
}
#endif  // LAZYTENSOR_HEADER_DEFINITIONS

}  // namespace lazy::autograd
// ---- end lazytensor/autograd/elementwise_grad.hpp ----

namespace lazy::detail {

/// A pending node evaluating expression `e` into a tensor of type Tout and shape `shape`
/// (the expression's own shape, or one it broadcasts to). With `grad_fn`, also returns
/// the backward function (its `next` edges set) when a leaf of `e` requires grad.
template <Element Tout, class E>
graph::NodePtr make_elementwise(const E& e, const Shape& shape, autograd::GradFnPtr* grad_fn = nullptr) {
  std::vector<graph::NodePtr> inputs;
  std::vector<autograd::GradFnPtr> edges;
  // History is recorded where the expression is evaluated, if grad mode is on there.
  if (grad_fn && !autograd::is_grad_enabled()) grad_fn = nullptr;
  inputs.reserve(expr::leaf_count_v<E>);
  if (grad_fn) edges.reserve(expr::leaf_count_v<E>);
  auto k = expr::to_kernel(e, inputs, grad_fn ? &edges : nullptr);
  graph::Device& dev = graph::common_device(inputs, E::op_type::name);
  if constexpr (is_floating_v<Tout>) {
    if (grad_fn && autograd::any_edge(edges)) {
      auto fn = std::make_shared<autograd::ElementwiseGradFn<decltype(k), Tout>>(k, inputs);
      fn->next = std::move(edges);
      *grad_fn = std::move(fn);
    }
  }
  return graph::submit(graph::elementwise_node<Tout>(std::move(k), shape, &dev, std::move(inputs)));
}

}  // namespace lazy::detail
// ---- end lazytensor/tensor/make_elementwise.hpp ----

namespace lazy {

namespace detail {
/// The Eigen view behind Tensor::eigen(), defined by <lazytensor/eigen.hpp>.
template <class T, class Unused>
struct EigenView {
  static_assert(sizeof(Unused*) == 0, "Tensor::eigen() needs #include <lazytensor/eigen.hpp>");
};
}  // namespace detail

/// A user-facing device handle: which engine device a tensor lives on.
class Device {
 public:
  Device() = default;
  explicit Device(int index) : index_(index) {}
  int index() const { return index_; }
  /// "CPU:0", as torch_xla names devices.
  std::string str() const { return "CPU:" + std::to_string(index_); }
  /// The engine behind this handle.
  graph::Device& engine() const { return graph::DeviceRegistry::get().device(index_); }
  friend bool operator==(const Device&, const Device&) = default;

 private:
  int index_ = 0;
};

inline std::ostream& operator<<(std::ostream& os, const Device& d) { return os << d.str(); }

/// This thread's current device (torch_xla.device()).
inline Device device() { return Device(graph::current_device_index()); }

namespace detail {
/// Raised when a Tensor<T> handle's object now holds another dtype (Module::to(dtype)).
[[noreturn]] void retyped_handle(DType handle, DType held);

/// A materialized node holding a copy of `n` host values.
template <Element T>
graph::NodePtr data_node(const T* src, const Shape& shape, const Device& dev) {
  graph::Device& d = dev.engine();
  auto buf = d.pool().acquire(padded_bytes(shape.numel(), sizeof(T)));
  if (shape.numel() > 0) std::memcpy(buf->data(), src, static_cast<std::size_t>(shape.numel()) * sizeof(T));
  return std::make_shared<graph::DataNode>(dtype_of<T>(), shape, &d, std::move(buf));
}
}  // namespace detail

/// A lazy tensor of element type T (float, double, int32_t, int64_t, bool, bfloat16).
template <Element T>
class Tensor {
 public:
  using value_type = T;

  /// An undefined tensor (defined() is false), like torch::Tensor().
  Tensor() = default;

  /// Wraps a graph node (internal: factories and ops build tensors this way).
  explicit Tensor(graph::NodePtr node) : impl_(std::make_shared<graph::TensorImpl>(std::move(node))) {
    impl_->node->device()->register_handle(impl_);
  }

  /// A handle on an existing tensor object (shares it, like copying a handle). Throws
  /// DTypeError when the object holds another element type.
  static Tensor from_impl(std::shared_ptr<graph::TensorImpl> impl) {
    Tensor t;
    if (impl && impl->node && impl->node->dtype() != dtype_of<T>()) {
      throw DTypeError("expected a tensor of dtype " + dtype_name(dtype_of<T>()) + ", found " +
                       dtype_name(impl->node->dtype()));
    }
    t.impl_ = std::move(impl);
    return t;
  }

  /// Captures an expression as a pending node; nothing is computed until a sync or read.
  /// Records its backward function when a leaf requires grad.
  template <class Op, class... C>
  Tensor(const Expr<Op, C...>& e) {  // NOLINT: implicit, as `Tensor<float> y = a + b;`
    autograd::GradFnPtr fn;
    *this = Tensor(detail::make_elementwise<T>(e, e.shape(), &fn));
    autograd::attach_grad_fn(*impl_, std::move(fn));
  }

  /// Rebinds this handle (not the shared tensor) to an expression's value, as `t = a + b`
  /// does in libtorch.
  template <class Op, class... C>
  Tensor& operator=(const Expr<Op, C...>& e) {
    return *this = Tensor(e);
  }

  /// True unless default-constructed.
  bool defined() const { return impl_ != nullptr; }
  /// Sizes of each dimension.
  const Shape& shape() const { return node()->shape(); }
  /// Same as shape(), libtorch's name.
  const Shape& sizes() const { return shape(); }
  /// Size of dimension d (negative counts from the back).
  std::int64_t size(int d) const { return shape().size(d); }
  /// Rank.
  int dim() const { return shape().rank(); }
  /// Number of elements.
  std::int64_t numel() const { return shape().numel(); }
  /// Element type tag.
  static constexpr DType dtype = dtype_of<T>();
  /// Device the value lives on.
  Device device() const { return Device(node()->device()->index()); }

  /// The single value of a one-element tensor. Materializes (an implicit sync).
  T item() const {
    if (numel() != 1) {
      throw ShapeError("item(): a Tensor with " + std::to_string(numel()) +
                       " elements cannot be converted to a scalar (expected 1 element)");
    }
    return data()[0];
  }

  /// A copy of the values, row-major. Materializes (an implicit sync).
  std::vector<T> to_vector() const {
    const T* p = data();
    return std::vector<T>(p, p + numel());
  }

  /// A row-major Eigen view of the values: rank 2 as is, rank 1 as a column, rank 0 as
  /// 1x1, higher ranks as (numel / last dim) x last dim. Valid while this handle keeps the
  /// value (until it is modified or destroyed). Materializes (an implicit sync).
  /// Needs <lazytensor/eigen.hpp> (the umbrella includes it), so that programs that never
  /// view a tensor through Eigen do not parse it.
  template <class Unused = void>
  auto eigen() const
    requires(!std::is_same_v<T, bfloat16>)
  {
    return detail::EigenView<T, Unused>::map(*this);
  }

  /// Pointer to the materialized values (row-major, padded). Materializes.
  const T* data() const {
    if (graph::materialize(node())) {
      static auto& implicit = core::counter("ImplicitSync");
      implicit.add();
    }
    static auto& transfers = core::counter("TransferFromDevice");
    transfers.add();
    return node()->template data<T>();
  }

  /// A copy on device `dev` (this handle when already there). The value is materialized on
  /// its own device first, then copied into a buffer of `dev`'s pool.
  Tensor to(const Device& dev) const {
    if (dev == device()) return *this;
    const T* p = data();
    return Tensor(detail::data_node<T>(p, shape(), dev));
  }

  /// The tensor as an expression operand (with its autograd edge when it requires grad).
  expr::Leaf<T> to_leaf() const { return {node(), autograd::edge_of(impl_)}; }

  // ---- autograd (libtorch names) ---------------------------------------------------

  /// Marks a leaf as requiring gradients (floating dtypes only, leaves only).
  Tensor& requires_grad_(bool on = true) {
    if constexpr (!is_floating_v<T>) {
      if (on) {
        throw DTypeError("requires_grad_: only tensors of floating point dtype can require gradients, got " +
                         dtype_name(dtype_of<T>()));
      }
    }
    if (!is_leaf()) {
      throw Error("requires_grad_: you can only change requires_grad flags of leaf variables (this tensor was "
                  "computed by " + impl_->autograd->grad_fn->name() + ")");
    }
    node();
    if (on) autograd::register_grad_dtype<T>();  // its gradients are added and converted at run time
    impl_->autograd_meta().requires_grad = on;
    return *this;
  }
  /// True when gradients flow into this tensor.
  bool requires_grad() const { return impl_ && impl_->requires_grad(); }
  /// True unless the value was computed by an operation recorded for autograd.
  bool is_leaf() const { return !impl_ || !impl_->autograd || !impl_->autograd->grad_fn; }
  /// The function that computed this value (nullptr for leaves).
  const autograd::GradFnPtr& grad_fn() const {
    static const autograd::GradFnPtr none;
    return impl_ && impl_->autograd ? impl_->autograd->grad_fn : none;
  }
  /// The accumulated gradient (undefined until a backward pass reached this tensor). The
  /// handle shares the gradient: `p.grad().zero_()` zeroes it.
  Tensor grad() const {
    if (!impl_ || !impl_->autograd || !impl_->autograd->grad || !impl_->autograd->grad->node) return Tensor();
    return from_impl(impl_->autograd->grad);
  }
  /// Replaces (or with an undefined tensor, clears) the accumulated gradient.
  void set_grad(const Tensor& g) {
    auto& meta = impl_->autograd_meta();
    if (!g.defined()) {
      meta.grad.reset();
      return;
    }
    if (!(g.shape() == shape())) {
      throw ShapeError("set_grad: assigned grad has shape " + g.shape().str() + ", expected " + shape().str());
    }
    meta.grad = g.impl_;
  }
  /// Keeps this non-leaf tensor's gradient in `.grad()` during backward.
  void retain_grad() {
    if (is_leaf()) return;  // leaves keep theirs anyway
    auto& meta = *impl_->autograd;
    if (!meta.retains_grad) {
      meta.retains_grad = true;
      meta.grad_fn->retained.push_back(impl_);
    }
  }
  /// A new tensor sharing this value, outside autograd (torch's detach()).
  Tensor detach() const { return Tensor(node()); }

  /// Backpropagates from this tensor: `gradient` defaults to 1 for a one-element tensor.
  /// Gradients accumulate into the leaves' `.grad()` as pending values; the graph is freed
  /// unless `retain_graph`.
  void backward(const Tensor& gradient = Tensor(), bool retain_graph = false) const {
    if (!requires_grad()) {
      throw Error("backward: element 0 of tensors does not require grad and does not have a grad_fn");
    }
    graph::NodePtr g;
    if (gradient.defined()) {
      if (!(gradient.shape() == shape())) {
        throw ShapeError("backward: gradient has shape " + gradient.shape().str() + ", expected " + shape().str());
      }
      g = gradient.node();
    } else {
      if (numel() != 1) {
        throw Error("backward: grad can be implicitly created only for scalar outputs (got shape " +
                    shape().str() + ")");
      }
      if constexpr (is_floating_v<T>) g = autograd::full_node_of<T>(shape(), node()->device(), 1.0);
      else throw DTypeError("backward: only floating point tensors have gradients, found " + dtype_name(dtype_of<T>()));
    }
    autograd::GradFnPtr root = [&] {
      autograd::AutoGradMode on(true);
      return autograd::edge_of(impl_);
    }();
    autograd::run_backward({{{root, g}}, retain_graph, {}});
  }
  /// The graph node holding the current value.
  const graph::NodePtr& node() const {
    if (!impl_) throw Error("use of an undefined tensor (default-constructed lazy::Tensor)");
    // A module converted with to(dtype) rebinds its parameters to another element type;
    // a handle typed for the old one must not read the new bytes as T.
    if (impl_->node && impl_->node->dtype() != dtype_of<T>()) [[unlikely]]
      detail::retyped_handle(dtype_of<T>(), impl_->node->dtype());
    return impl_->node;
  }
  /// The shared tensor object (every copy of this handle has the same one).
  const std::shared_ptr<graph::TensorImpl>& impl() const { return impl_; }

  // ---- in-place (functionalized: the shared object is rebound to a new node) ---------

  /// Replaces the value with `src` broadcast to this shape and converted to T.
  template <class X>
  Tensor& copy_(const X& src) {
    return assign_(expr::make<ops::Cast<T>>(src), "copy_");  // converts any dtype, like torch's copy_
  }
  template <class X>
  Tensor& add_(const X& x) {
    return assign_(*this + x, "add_");
  }
  template <class X>
  Tensor& sub_(const X& x) {
    return assign_(*this - x, "sub_");
  }
  template <class X>
  Tensor& mul_(const X& x) {
    return assign_(*this * x, "mul_");
  }
  template <class X>
  Tensor& div_(const X& x) {
    return assign_(*this / x, "div_");
  }
  /// Adds alpha * x, as torch's add_(other, alpha).
  template <class X, class A>
  Tensor& add_(const X& x, A alpha) {
    return assign_(*this + x * alpha, "add_");
  }
  template <class X>
  Tensor& operator+=(const X& x) {
    return add_(x);
  }
  template <class X>
  Tensor& operator-=(const X& x) {
    return sub_(x);
  }
  template <class X>
  Tensor& operator*=(const X& x) {
    return mul_(x);
  }
  template <class X>
  Tensor& operator/=(const X& x) {
    return div_(x);
  }
  /// Sets every element to v.
  template <expr::Number V>
  Tensor& fill_(V v) {
    node();  // an undefined tensor throws here
    check_inplace("fill_");
    if (impl_->autograd) impl_->autograd->grad_fn = nullptr;  // a constant: no history
    std::vector<graph::NodePtr> none;
    using E = Expr<ops::Identity, expr::Scalar<T>>;
    E e(expr::Scalar<T>{static_cast<T>(v)});
    impl_->node = graph::submit(
        graph::elementwise_node<T>(expr::to_kernel(e, none), shape(), node()->device(), std::vector<graph::NodePtr>{}));
    return *this;
  }
  /// Sets every element to zero.
  Tensor& zero_() { return fill_(0); }

 private:
  template <class E>
  Tensor& assign_(const E& e, const char* op) {
    using V = typename E::value_type;
    // PyTorch's can_cast: no floating result into an integral/bool tensor, nor a non-bool
    // result into a bool tensor.
    if constexpr ((is_floating_v<V> && !is_floating_v<T>) || (std::is_same_v<T, bool> && !std::is_same_v<V, bool>)) {
      throw DTypeError(std::string(op) + ": result type " + dtype_name(dtype_of<V>()) +
                       " can't be cast to the desired output type " + dtype_name(dtype_of<T>()));
    }
    if (!broadcastable_to(e.shape(), shape())) {
      throw ShapeError(std::string(op) + ": output with shape " + shape().str() +
                       " doesn't match the broadcast shape " + e.shape().str());
    }
    check_inplace(op);
    autograd::GradFnPtr fn;
    impl_->node = detail::make_elementwise<T>(e, shape(), &fn);
    autograd::attach_grad_fn(*impl_, std::move(fn));
    return *this;
  }

  // libtorch refuses in-place updates of leaves that require grad while recording: the
  // gradient would belong to neither value. Optimizers update them under NoGradGuard.
  void check_inplace(const char* op) const {
    if (autograd::is_grad_enabled() && requires_grad() && is_leaf()) {
      throw Error(std::string(op) + ": a leaf Variable that requires grad is being used in an in-place operation "
                  "(wrap the update in lazy::NoGradGuard)");
    }
  }

  std::shared_ptr<graph::TensorImpl> impl_;
};

namespace detail {
template <class T>
void print_value(std::ostream& os, T v) {
  if constexpr (std::is_same_v<T, bool>) os << (v ? "True" : "False");
  else if constexpr (is_floating_v<T>) os << static_cast<double>(static_cast<compute_t<T>>(v));  // double stays double
  else os << v;
}
template <class T>
void print_dims(std::ostream& os, const T* p, const Shape& s, int d, std::int64_t& pos) {
  if (d == s.rank()) {
    print_value(os, p[pos++]);
    return;
  }
  os << "[";
  for (std::int64_t i = 0; i < s[d]; ++i) {
    if (i) os << (d + 1 == s.rank() ? ", " : ",\n" + std::string(static_cast<std::size_t>(d) + 8, ' '));
    print_dims(os, p, s, d + 1, pos);
  }
  os << "]";
}
}  // namespace detail

/// Prints like PyTorch: tensor([[1, 2], [3, 4]], device='CPU:0', dtype=float32).
template <Element T>
std::ostream& operator<<(std::ostream& os, const Tensor<T>& t) {
  if (!t.defined()) return os << "[ Tensor (undefined) ]";
  std::int64_t pos = 0;
  const T* p = t.data();
  os << "tensor(";
  detail::print_dims(os, p, t.shape(), 0, pos);
  return os << ", device='" << t.device().str() << "', dtype=" << dtype_name(t.dtype) << ")";
}

/// Evaluates expression `e` into a pending tensor of type T and shape `shape` (e's shape,
/// or one it broadcasts to), recording its backward function when a leaf requires grad.
template <Element T, class E>
Tensor<T> evaluate_as(const E& e, const Shape& shape) {
  autograd::GradFnPtr fn;
  Tensor<T> t(detail::make_elementwise<T>(e, shape, &fn));
  autograd::attach_grad_fn(*t.impl(), std::move(fn));
  return t;
}

/// Evaluates an expression into a new tensor of its natural type.
template <class Op, class... C>
auto eval(const Expr<Op, C...>& e) {
  return Tensor<typename Expr<Op, C...>::value_type>(e);
}

#if LAZYTENSOR_HEADER_DEFINITIONS
LAZYTENSOR_INLINE void detail::retyped_handle(DType handle, DType held) {
  throw DTypeError("this Tensor<" + dtype_name(handle) + "> handle's tensor now holds " + dtype_name(held) +
                   " (its module was converted with to(dtype)); view it as AnyTensor(t).as<T>() of the new type");
}
#endif  // LAZYTENSOR_HEADER_DEFINITIONS

}  // namespace lazy
// ---- end lazytensor/tensor/tensor.hpp ----

namespace lazy {

/// A handle on a tensor of any dtype (shares the tensor object, like Tensor<T> does).
class AnyTensor {
 public:
  /// An undefined tensor.
  AnyTensor() = default;
  /// Wraps a typed handle; both share one tensor object.
  template <Element T>
  AnyTensor(const Tensor<T>& t) : impl_(t.impl()) {}  // NOLINT: implicit, like torch::Tensor

  /// True unless default-constructed.
  bool defined() const { return impl_ != nullptr; }
  /// Element type tag.
  DType dtype() const { return node()->dtype(); }
  /// Sizes of each dimension.
  const Shape& shape() const { return node()->shape(); }
  /// Number of elements.
  std::int64_t numel() const { return shape().numel(); }
  /// Device the value lives on.
  Device device() const { return Device(node()->device()->index()); }

  /// True when the tensor holds elements of type T.
  template <Element T>
  bool is() const {
    return defined() && dtype() == dtype_of<T>();
  }
  /// The typed handle; DTypeError when the dtype is not T.
  template <Element T>
  Tensor<T> as() const {
    if (!defined()) throw Error("use of an undefined tensor (default-constructed lazy::AnyTensor)");
    return Tensor<T>::from_impl(impl_);
  }

  /// The typed handle, implicitly (`Tensor<float> w = model->parameters()[0];`); DTypeError
  /// when the dtype is not T.
  template <Element T>
  operator Tensor<T>() const {  // NOLINT: implicit, as the typed view of torch::Tensor
    return as<T>();
  }

  /// True for bfloat16, float and double.
  bool is_floating_point() const { return is_floating(dtype()); }

  // ---- autograd, as Tensor<T> (libtorch names) -------------------------------------

  /// True when gradients flow into this tensor.
  bool requires_grad() const { return impl_ && impl_->requires_grad(); }
  /// Marks a leaf as requiring gradients (floating dtypes only: DTypeError otherwise). The
  /// typed operations that use the tensor make its dtype's gradient operations known, so
  /// this compiles none of them.
  AnyTensor& requires_grad_(bool on = true);
  /// The accumulated gradient, of this tensor's dtype (undefined before a backward pass).
  AnyTensor grad() const;
  /// Replaces (or with an undefined tensor, clears) the gradient; same dtype and shape.
  void set_grad(const AnyTensor& g);
  /// A new tensor sharing this value, outside autograd.
  AnyTensor detach() const;
  /// Backpropagates from this one-element tensor (Tensor<T>::backward()).
  void backward() const;
  /// Sets every element to zero, in place (every handle sees it): a zeroed buffer, so no
  /// kernel of any dtype is compiled for it. Gradients are zeroed this way.
  AnyTensor& zero_();
  /// A copy on device `dev` (this handle when already there).
  AnyTensor to(const Device& dev) const;
  /// The values converted to the floating `dtype` (a pending graph::ConvertNode; this
  /// handle when already of it), as Module::to(dtype) converts parameters. The result is
  /// detached from autograd (typed code converts differentiably, and with fusion, with
  /// cast<T>). DTypeError unless both dtypes are floating.
  AnyTensor to(DType dtype) const;

  /// Calls f(Tensor<T>) with the typed handle.
  template <class F>
  decltype(auto) visit(F&& f) const {
    switch (dtype()) {
      case DType::Bool: return f(as<bool>());
      case DType::Int32: return f(as<std::int32_t>());
      case DType::Int64: return f(as<std::int64_t>());
      case DType::BFloat16: return f(as<bfloat16>());
      case DType::Float32: return f(as<float>());
      case DType::Float64: break;
    }
    return f(as<double>());
  }

  /// Copies the values (row-major, dtype_size(dtype()) bytes each) to `dst`. Materializes
  /// (an implicit sync when pending).
  void copy_bytes_to(void* dst) const;

  /// The shared tensor object.
  const std::shared_ptr<graph::TensorImpl>& impl() const { return impl_; }

 private:
  const graph::NodePtr& node() const;
  std::shared_ptr<graph::TensorImpl> impl_;
};

/// A materialized tensor of run-time dtype `dtype` and `shape` holding a copy of `bytes`
/// (numel * dtype_size(dtype) bytes), on `dev`.
AnyTensor from_bytes(DType dtype, const Shape& shape, const void* bytes, Device dev = device());

#if LAZYTENSOR_HEADER_DEFINITIONS
LAZYTENSOR_INLINE void AnyTensor::copy_bytes_to(void* dst) const {
  visit([&](const auto& t) {
    if (t.numel() > 0) std::memcpy(dst, t.data(), static_cast<std::size_t>(t.numel()) * dtype_size(dtype()));
  });
}

LAZYTENSOR_INLINE AnyTensor AnyTensor::grad() const {
  AnyTensor g;  // shares the gradient object, as Tensor<T>::grad() does
  if (impl_ && impl_->autograd && impl_->autograd->grad && impl_->autograd->grad->node) g.impl_ = impl_->autograd->grad;
  return g;
}

LAZYTENSOR_INLINE void AnyTensor::set_grad(const AnyTensor& g) {
  // Tensor<T>::set_grad without the dtype (so no dtype's code is compiled for it).
  node();  // an undefined tensor throws here
  auto& meta = impl_->autograd_meta();
  if (!g.defined()) {
    meta.grad.reset();
    return;
  }
  if (g.dtype() != dtype()) {
    throw DTypeError("set_grad: assigned grad has dtype " + dtype_name(g.dtype()) + ", expected " + dtype_name(dtype()));
  }
  if (!(g.shape() == shape())) {
    throw ShapeError("set_grad: assigned grad has shape " + g.shape().str() + ", expected " + shape().str());
  }
  meta.grad = g.impl_;
}

LAZYTENSOR_INLINE AnyTensor AnyTensor::detach() const {
  AnyTensor d;  // a new tensor object on the same value, outside autograd
  d.impl_ = std::make_shared<graph::TensorImpl>(node());
  node()->device()->register_handle(d.impl_);
  return d;
}

LAZYTENSOR_INLINE AnyTensor& AnyTensor::requires_grad_(bool on) {
  if (on && !is_floating_point()) {
    throw DTypeError("requires_grad_: only tensors of floating point dtype can require gradients, got " +
                     dtype_name(dtype()));
  }
  if (impl_->autograd && impl_->autograd->grad_fn) {
    throw Error("requires_grad_: you can only change requires_grad flags of leaf variables (this tensor was computed by " +
                impl_->autograd->grad_fn->name() + ")");
  }
  impl_->autograd_meta().requires_grad = on;
  return *this;
}

LAZYTENSOR_INLINE AnyTensor AnyTensor::to(DType target) const {
  if (dtype() == target) return *this;
  // ConvertNode raises DTypeError unless both dtypes are floating.
  graph::NodePtr n = graph::submit(std::make_shared<graph::ConvertNode>(node(), target));
  switch (target) {
    case DType::BFloat16: return Tensor<bfloat16>(n);
    case DType::Float32: return Tensor<float>(n);
    default: return Tensor<double>(n);
  }
}

LAZYTENSOR_INLINE AnyTensor& AnyTensor::zero_() {
  graph::Device& d = device().engine();
  const std::size_t bytes = static_cast<std::size_t>(numel()) * dtype_size(dtype());
  auto buf = d.pool().acquire(padded_bytes(numel(), dtype_size(dtype())));
  if (bytes) std::memset(buf->data(), 0, bytes);
  graph::rebind(impl_, std::make_shared<graph::DataNode>(dtype(), shape(), &d, std::move(buf)));
  return *this;
}

LAZYTENSOR_INLINE void AnyTensor::backward() const {
  // Tensor<T>::backward() without the dtype: the seed is a one-element buffer holding 1.
  if (!requires_grad()) {
    throw Error("backward: element 0 of tensors does not require grad and does not have a grad_fn");
  }
  if (numel() != 1) {
    throw Error("backward: grad can be implicitly created only for scalar outputs (got shape " + shape().str() + ")");
  }
  graph::Device& d = device().engine();
  auto buf = d.pool().acquire(padded_bytes(1, dtype_size(dtype())));
  switch (dtype()) {
    case DType::BFloat16: *static_cast<bfloat16*>(buf->data()) = bfloat16(1.0f); break;
    case DType::Float32: *static_cast<float*>(buf->data()) = 1.0f; break;
    case DType::Float64: *static_cast<double*>(buf->data()) = 1.0; break;
    default: throw DTypeError("backward: only floating point tensors have gradients, found " + dtype_name(dtype()));
  }
  graph::NodePtr seed = std::make_shared<graph::DataNode>(dtype(), shape(), &d, std::move(buf));
  autograd::GradFnPtr root = [&] {
    autograd::AutoGradMode on(true);
    return autograd::edge_of(impl_);
  }();
  autograd::run_backward({{{root, seed}}, false, {}});
}

LAZYTENSOR_INLINE AnyTensor AnyTensor::to(const Device& dev) const {
  return visit([&](const auto& t) { return AnyTensor(t.to(dev)); });
}

LAZYTENSOR_INLINE const graph::NodePtr& AnyTensor::node() const {
  if (!impl_) throw Error("use of an undefined tensor (default-constructed lazy::AnyTensor)");
  return impl_->node;
}

LAZYTENSOR_INLINE AnyTensor from_bytes(DType dtype, const Shape& shape, const void* bytes,
                                       Device dev) {
  graph::Device& d = dev.engine();
  const std::size_t n = static_cast<std::size_t>(shape.numel()) * dtype_size(dtype);
  auto buf = d.pool().acquire(padded_bytes(shape.numel(), dtype_size(dtype)));
  if (n) std::memcpy(buf->data(), bytes, n);
  auto node = std::make_shared<graph::DataNode>(dtype, shape, &d, std::move(buf));
  switch (dtype) {
    case DType::Bool: return Tensor<bool>(node);
    case DType::Int32: return Tensor<std::int32_t>(node);
    case DType::Int64: return Tensor<std::int64_t>(node);
    case DType::BFloat16: return Tensor<bfloat16>(node);
    case DType::Float32: return Tensor<float>(node);
    case DType::Float64: break;
  }
  return Tensor<double>(node);
}
#endif  // LAZYTENSOR_HEADER_DEFINITIONS

}  // namespace lazy

// ---- end lazytensor/any_tensor.hpp ----
// ---- begin lazytensor/autograd/functional.hpp ----
// torch.autograd.grad: gradients of outputs with respect to chosen inputs, returned rather
// than accumulated into `.grad()`.

#include <string>
#include <vector>


namespace lazy::autograd {

/// Gradients of sum(outputs[i] * grad_outputs[i]) with respect to each of `inputs` (one-
/// element outputs may omit grad_outputs). No `.grad()` changes. An input the outputs do
/// not depend on is an Error unless `allow_unused` (then its gradient is undefined).
template <Element T>
std::vector<Tensor<T>> grad(const std::vector<Tensor<T>>& outputs, const std::vector<Tensor<T>>& inputs,
                            const std::vector<Tensor<T>>& grad_outputs = {}, bool retain_graph = false,
                            bool allow_unused = false) {
  if (!grad_outputs.empty() && grad_outputs.size() != outputs.size()) {
    throw Error("autograd::grad: expected " + std::to_string(outputs.size()) + " grad_outputs, got " +
                std::to_string(grad_outputs.size()));
  }
  BackwardRequest req;
  req.retain_graph = retain_graph;
  {
    AutoGradMode on(true);
    for (std::size_t i = 0; i < outputs.size(); ++i) {
      const Tensor<T>& o = outputs[i];
      if (!o.requires_grad()) {
        throw Error("autograd::grad: output " + std::to_string(i) + " does not require grad and has no grad_fn");
      }
      graph::NodePtr g;
      if (grad_outputs.empty()) {
        if (o.numel() != 1) {
          throw Error("autograd::grad: grad can be implicitly created only for scalar outputs (output " +
                      std::to_string(i) + " has shape " + o.shape().str() + ")");
        }
        g = full_node_of<T>(o.shape(), o.node()->device(), 1.0);
      } else {
        if (!(grad_outputs[i].shape() == o.shape())) {
          throw ShapeError("autograd::grad: grad_outputs[" + std::to_string(i) + "] has shape " +
                           grad_outputs[i].shape().str() + ", expected " + o.shape().str());
        }
        g = grad_outputs[i].node();
      }
      req.roots.emplace_back(edge_of(o.impl()), g);
    }
    for (std::size_t i = 0; i < inputs.size(); ++i) {
      if (!inputs[i].requires_grad()) {
        throw Error("autograd::grad: input " + std::to_string(i) + " does not require grad");
      }
      req.capture.push_back(edge_of(inputs[i].impl()));
    }
  }
  auto nodes = run_backward(req);
  std::vector<Tensor<T>> out;
  for (std::size_t i = 0; i < nodes.size(); ++i) {
    if (!nodes[i]) {
      if (!allow_unused) {
        throw Error("autograd::grad: input " + std::to_string(i) +
                    " appears to not have been used in the graph (set allow_unused to get an undefined gradient)");
      }
      out.emplace_back();
    } else {
      out.emplace_back(cast_node(nodes[i], dtype_of<T>()));
    }
  }
  return out;
}

}  // namespace lazy::autograd
// ---- end lazytensor/autograd/functional.hpp ----
// ---- begin lazytensor/autograd/record.hpp ----
// How an op records its explicit backward rule: a callable from the typed output gradient
// to the input gradients, wrapped as a GradFn and attached to the op's result when any
// operand needs a gradient. Rules capture detached tensors (values, no history), never the
// result's own handle, so no reference cycle forms.

#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>


namespace lazy::autograd {

/// A backward rule given as a callable.
class FunctionGradFn final : public GradFn {
 public:
  using Backward = std::function<std::vector<graph::NodePtr>(const graph::NodePtr&)>;
  FunctionGradFn(std::string name, Backward f) : name_(std::move(name)), f_(std::move(f)) {}
  std::string name() const override { return name_; }
  std::vector<graph::NodePtr> apply(const graph::NodePtr& grad) override;
  void release_saved() override;

 private:
  std::string name_;
  Backward f_;
};

/// Where the gradient of operand `x` goes: a tensor's own edge, or for an element-wise
/// expression a backward function over its leaves (the expression need not be computed
/// for that: e.g. sum(a * b) never writes a * b).
template <expr::ExprLike X>
GradFnPtr operand_edge(const X& x) {
  if constexpr (expr::is_expr_node<X>::value) {
    using V = typename X::value_type;
    if constexpr (!is_floating_v<V>) {
      return nullptr;
    } else {
      if (!is_grad_enabled() || !expr::any_leaf_grad(x)) return nullptr;
      // any_leaf_grad found an edge, so `edges` holds at least one.
      std::vector<graph::NodePtr> inputs;
      std::vector<GradFnPtr> edges;
      inputs.reserve(expr::leaf_count_v<X>);
      edges.reserve(expr::leaf_count_v<X>);
      auto k = expr::to_kernel(x, inputs, &edges);
      auto fn = std::make_shared<ElementwiseGradFn<decltype(k), V>>(k, inputs);
      fn->next = std::move(edges);
      fn->dtype = dtype_of<V>();
      fn->shape = x.shape();
      fn->device = fn->next.empty() ? nullptr : inputs.front()->device();
      return fn;
    }
  } else {
    return edge_of(x.impl());
  }
}

/// The value of operand `x` as a backward rule keeps it: a tensor detached (its value now,
/// unaffected by later in-place updates, without history), an expression as is (its
/// leaves already hold the values it was built from).
template <expr::ExprLike X>
auto saved(const X& x) {
  if constexpr (expr::is_expr_node<X>::value) return x;
  else return x.detach();
}

/// The node of a gradient tensor, or nullptr for an undefined one (no gradient).
template <Element T>
graph::NodePtr node_or_null(const Tensor<T>& t) {
  return t.defined() ? t.node() : nullptr;
}

/// Makes `backward` (Tensor<T> grad of out -> input gradient nodes, in `edges` order) the
/// grad_fn of `out` when any edge is live. The rule runs with grad mode off.
template <Element T, class F>
void record(Tensor<T>& out, const char* name, std::vector<GradFnPtr> edges, F backward) {
  if constexpr (!is_floating_v<T>) return;  // integer results carry no gradient
  if (!any_edge(edges)) return;
  register_grad_dtype<T>();
  auto fn = std::make_shared<FunctionGradFn>(name, [b = std::move(backward)](const graph::NodePtr& g) {
    AutoGradMode off(false);
    return b(Tensor<T>(cast_node(g, dtype_of<T>())));
  });
  fn->next = std::move(edges);
  attach_grad_fn(*out.impl(), std::move(fn));
}

/// True when grad mode is on and any of the tensors requires grad.
template <class... Ts>
bool any_requires_grad(const Ts&... ts) {
  return is_grad_enabled() && (false || ... || ts.requires_grad());
}

#if LAZYTENSOR_HEADER_DEFINITIONS
LAZYTENSOR_INLINE std::vector<graph::NodePtr> FunctionGradFn::apply(const graph::NodePtr& grad) {
  check_not_released();
  return f_(grad);
}

LAZYTENSOR_INLINE void FunctionGradFn::release_saved() {
  f_ = nullptr;
  GradFn::release_saved();
}
#endif  // LAZYTENSOR_HEADER_DEFINITIONS

}  // namespace lazy::autograd
// ---- end lazytensor/autograd/record.hpp ----
// ---- begin lazytensor/data.hpp ----
// lazy::data: datasets, transforms, samplers and the DataLoader, with libtorch's names
// (torch::data). Reading gzip'd IDX files (MNIST) needs zlib: link ZLIB::ZLIB.

// ---- begin lazytensor/data/data_loader.hpp ----
// DataLoader: batches of a dataset in sampler order, loaded on the calling thread or by
// worker threads ahead of use, as torch::data's make_data_loader.
//
//   auto loader = lazy::data::make_data_loader(dataset, {.batch_size = 64, .shuffle = true,
//   .num_workers = 2}); for (auto& batch : *loader) { ... batch.data, batch.target ... }
//
// Workers: worker w loads batches w, w + W, w + 2W, ... of the epoch, each at most
// W * prefetch batches ahead of the consumer; the consumer takes them strictly in order.
// An exception thrown while loading a batch is re-thrown to the consumer when it reaches
// that batch. Stopping (a new epoch, destruction) wakes every worker and joins it; a worker
// finishes the batch it is loading first.

#include <concepts>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <iterator>
#include <map>
#include <memory>
#include <mutex>
#include <numeric>
#include <optional>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

// ---- begin lazytensor/data/dataset.hpp ----
// What a dataset is (the Dataset concept), the optional batched fast path (get_batch), and
// dataset.map(transform) as in libtorch.
//
// A dataset is a value with `size()` and `get(index)` (const: a DataLoader with workers calls
// it from several threads at once, so it must be thread-safe) returning an Example. It may
// also provide `get_batch(indices)` returning a whole batch, built on the host into one
// buffer per field on the calling thread's current device (lazy::device()): the DataLoader
// uses it when present instead of stacking single examples.
//
// Datasets used with worker threads should return materialized tensors (built from host
// data, as the library's datasets do): stacking reads each example, and a pending one would
// be computed on the worker while the consumer may be running mark_step on the same device.

#include <concepts>
#include <cstddef>
#include <utility>
#include <vector>

// ---- begin lazytensor/data/example.hpp ----
// Example<Data, Target>: one sample (or one batch) of a dataset, as torch::data::Example.
// Also the host-side helpers that build a batch: a tensor filled in place in a buffer of the
// target device's pool (no staging copy), and the generic collation that stacks examples.

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>


namespace lazy::data {

/// A sample and its target (for a batch: data [B, ...] and targets [B, ...]).
template <class Data = Tensor<float>, class Target = Tensor<std::int64_t>>
struct Example {
  using DataType = Data;
  using TargetType = Target;
  Data data;
  Target target;
};

namespace detail {

template <class T>
inline constexpr bool is_tensor_v = false;
template <Element T>
inline constexpr bool is_tensor_v<Tensor<T>> = true;

/// A tensor under construction on the host: a buffer from `dev`'s pool that the caller
/// fills through data(), then finish() wraps it as a materialized tensor. Safe to use from
/// any thread (the pool and the device's handle registry are locked).
template <Element T>
class HostTensor {
 public:
  explicit HostTensor(const Shape& shape, Device dev = device())
      : shape_(shape),
        dev_(&dev.engine()),
        buf_(dev_->pool().acquire(padded_bytes(shape.numel(), sizeof(T)))) {}

  /// The elements, row-major.
  T* data() { return static_cast<T*>(buf_->data()); }
  /// The finished tensor (this object is spent).
  Tensor<T> finish() && {
    return Tensor<T>(
        std::make_shared<graph::DataNode>(dtype_of<T>(), shape_, dev_, std::move(buf_)));
  }

 private:
  Shape shape_;
  graph::Device* dev_;
  std::shared_ptr<Buffer> buf_;
};

/// (n, s0, s1, ...): the shape of a batch of n samples of shape s.
Shape batch_shape(std::size_t n, const Shape& s);

/// Stacks equally shaped tensors into [n, ...] on the current device, on the host.
template <Element T, class Get>
Tensor<T> stack_on_host(std::size_t n, Get&& get, const char* field) {
  const Tensor<T>& first = get(0);
  const Shape shape = first.shape();
  for (std::size_t i = 1; i < n; ++i) {
    if (!(get(i).shape() == shape)) {
      throw ShapeError(std::string("DataLoader: cannot stack the examples of a batch: ") + field +
                       " of example 0 has shape " + shape.str() + ", of example " +
                       std::to_string(i) + " " + get(i).shape().str());
    }
  }
  HostTensor<T> out(batch_shape(n, shape));
  const auto per = static_cast<std::size_t>(shape.numel());
  for (std::size_t i = 0; i < n; ++i) {
    if (per) std::memcpy(out.data() + i * per, get(i).data(), per * sizeof(T));
  }
  return std::move(out).finish();
}

/// Collates examples of tensors into one batch example (data and target each stacked
/// along a new first dimension): the generic path of the DataLoader, for datasets without
/// get_batch.
template <class Data, class Target>
Example<Data, Target> collate(const std::vector<Example<Data, Target>>& examples) {
  static_assert(is_tensor_v<Data> && is_tensor_v<Target>,
                "DataLoader: a dataset without get_batch() must return Example<Tensor<T>, "
                "Tensor<U>> from get(), "
                "so that examples can be stacked into a batch");
  using D = typename Data::value_type;
  using T = typename Target::value_type;
  const std::size_t n = examples.size();
  return {stack_on_host<D>(
              n, [&](std::size_t i) -> const Data& { return examples[i].data; }, "data"),
          stack_on_host<T>(
              n, [&](std::size_t i) -> const Target& { return examples[i].target; }, "target")};
}

#if LAZYTENSOR_HEADER_DEFINITIONS
LAZYTENSOR_INLINE Shape batch_shape(std::size_t n, const Shape& s) {
  if (s.rank() >= kMaxRank) {
    throw ShapeError("cannot batch samples of shape " + s.str() + ": a batch would have rank " +
                     std::to_string(s.rank() + 1) + ", the maximum is " + std::to_string(kMaxRank));
  }
  Shape out{static_cast<std::int64_t>(n)};
  for (const auto d : s) out.push_back(d);
  return out;
}
#endif  // LAZYTENSOR_HEADER_DEFINITIONS

}  // namespace detail
}  // namespace lazy::data
// ---- end lazytensor/data/example.hpp ----

namespace lazy::data {

/// size() and a const get(index).
template <class D>
concept Dataset = requires(const D& d, std::size_t i) {
  { d.size() } -> std::convertible_to<std::size_t>;
  d.get(i);
};

/// A Dataset that also builds whole batches: get_batch(const std::vector<std::size_t>&).
template <class D>
concept BatchDataset = Dataset<D> && requires(const D& d, const std::vector<std::size_t>& indices) {
  d.get_batch(indices);
};

/// The example type of a dataset.
template <Dataset D>
using example_t = decltype(std::declval<const D&>().get(std::size_t{}));

namespace detail {
template <class D>
struct batch_type_of {
  using type = example_t<D>;  // examples stacked into one of the same type
};
template <BatchDataset D>
struct batch_type_of<D> {
  using type =
      decltype(std::declval<const D&>().get_batch(std::declval<const std::vector<std::size_t>&>()));
};
}  // namespace detail

/// The batch type a DataLoader yields for a dataset.
template <Dataset D>
using batch_t = typename detail::batch_type_of<D>::type;

/// A dataset that builds its batches with `transform` folded in (e.g. MNIST converts bytes
/// to normalized floats in one pass): get_batch(indices, transform).
template <class D, class F>
concept FoldsTransform = requires(const D& d, const F& f, const std::vector<std::size_t>& indices) {
  d.get_batch(indices, f);
};

/// A transform that can also be applied to a whole batch of D: f.apply_batch(batch).
template <class D, class F>
concept BatchTransformFor = BatchDataset<D> &&
    requires(const D& d, const F& f, const std::vector<std::size_t>& indices) {
  f.apply_batch(d.get_batch(indices));
};

template <Dataset D, class F>
class MapDataset;

/// Base of the library's datasets: gives them map(transform), as libtorch's datasets have.
template <class Self>
class DatasetBase {
 public:
  /// A dataset yielding transform(example) for each example of this one (which is copied;
  /// the library's datasets share their storage, so copies are cheap).
  template <class F>
  MapDataset<Self, F> map(F transform) const& {
    return MapDataset<Self, F>(static_cast<const Self&>(*this), std::move(transform));
  }
  template <class F>
  MapDataset<Self, F> map(F transform) && {
    return MapDataset<Self, F>(std::move(static_cast<Self&>(*this)), std::move(transform));
  }
};

/// `dataset` with `transform` applied to each example (transform(Example) -> Example).
/// It has a get_batch when the transform can be folded into the dataset's own batching
/// (FoldsTransform) or applied to a batch (BatchTransformFor); otherwise the DataLoader
/// stacks transformed examples.
template <Dataset D, class F>
class MapDataset : public DatasetBase<MapDataset<D, F>> {
 public:
  MapDataset(D dataset, F transform)
      : dataset_(std::move(dataset)), transform_(std::move(transform)) {}

  /// Number of samples (that of the underlying dataset).
  std::size_t size() const { return dataset_.size(); }
  /// transform(dataset.get(index)).
  auto get(std::size_t index) const { return transform_(dataset_.get(index)); }
  /// The transformed batch: folded into the dataset's conversion when it offers that,
  /// else the transform applied to the dataset's batch.
  auto get_batch(const std::vector<std::size_t>& indices) const requires FoldsTransform<D, F> ||
      BatchTransformFor<D, F> {
    if constexpr (FoldsTransform<D, F>)
      return dataset_.get_batch(indices, transform_);
    else
      return transform_.apply_batch(dataset_.get_batch(indices));
  }

  /// The underlying dataset.
  const D& dataset() const { return dataset_; }
  /// The transform.
  const F& transform() const { return transform_; }

 private:
  D dataset_;
  F transform_;
};

}  // namespace lazy::data
// ---- end lazytensor/data/dataset.hpp ----
// ---- begin lazytensor/data/sampler.hpp ----
// Samplers: which dataset indices an epoch visits, in which order. A DataLoader takes one
// (by default sequential, or RandomSampler when shuffle is on) and forwards set_epoch to it.

#include <cstddef>
#include <cstdint>
#include <numeric>
#include <string>
#include <vector>

// ---- begin lazytensor/data/shuffle.hpp ----
// Deterministic shuffling: the same (seed, epoch) gives the same permutation on every
// replica, platform and standard library. Only std::mt19937_64 is used from <random> (its
// output sequence is fixed by the C++ standard); its distributions are not (their
// algorithms are implementation-defined), so bounded draws are our own.
//
//   generator seed  = splitmix64(splitmix64(seed) + epoch)
//   generator       = std::mt19937_64(generator seed)
//   permutation     = Fisher-Yates from the back: for i = n-1 down to 1, swap p[i] with
//                     p[j], j = uniform_below(i + 1)
//   uniform_below(b) = the first draw r with r >= (2^64 - b) mod b, reduced r mod b
//                     (rejection makes it exactly uniform)

#include <cstddef>
#include <cstdint>
#include <numeric>
#include <random>
#include <utility>
#include <vector>


namespace lazy::data {

namespace detail {

/// SplitMix64's output function: a bijective 64-bit mixer.
constexpr std::uint64_t splitmix64(std::uint64_t x) {
  std::uint64_t z = x + 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

/// A uniform integer in [0, bound), bound > 0, by rejection (no modulo bias).
std::uint64_t uniform_below(std::mt19937_64& gen, std::uint64_t bound);

}  // namespace detail

/// The generator seed used for (seed, epoch).
constexpr std::uint64_t shuffle_seed(std::uint64_t seed, std::uint64_t epoch) {
  return detail::splitmix64(detail::splitmix64(seed) + epoch);
}

/// A permutation of 0..n-1, a fixed function of (n, seed, epoch) (see the file comment).
std::vector<std::size_t> permutation(std::size_t n, std::uint64_t seed, std::uint64_t epoch);

#if LAZYTENSOR_HEADER_DEFINITIONS
namespace detail {

LAZYTENSOR_INLINE std::uint64_t uniform_below(std::mt19937_64& gen, std::uint64_t bound) {
  const std::uint64_t threshold = (0 - bound) % bound;  // (2^64 - bound) mod bound
  for (;;) {
    const std::uint64_t r = gen();
    if (r >= threshold) return r % bound;
  }
}

}  // namespace detail

LAZYTENSOR_INLINE std::vector<std::size_t> permutation(std::size_t n, std::uint64_t seed,
                                                       std::uint64_t epoch) {
  std::vector<std::size_t> p(n);
  std::iota(p.begin(), p.end(), std::size_t{0});
  std::mt19937_64 gen(shuffle_seed(seed, epoch));
  for (std::size_t i = n; i > 1; --i) {
    const auto j = static_cast<std::size_t>(detail::uniform_below(gen, i));
    std::swap(p[i - 1], p[j]);
  }
  return p;
}
#endif  // LAZYTENSOR_HEADER_DEFINITIONS

}  // namespace lazy::data
// ---- end lazytensor/data/shuffle.hpp ----

namespace lazy::data {

/// The order of the indices of one epoch over a dataset.
class Sampler {
 public:
  virtual ~Sampler() = default;
  /// The indices of the current epoch, for a dataset of `dataset_size` samples.
  virtual std::vector<std::size_t> indices(std::size_t dataset_size) const = 0;
  /// How many indices indices(dataset_size) returns.
  virtual std::size_t size(std::size_t dataset_size) const = 0;
  /// Selects the epoch (which shuffle a shuffling sampler uses).
  void set_epoch(std::uint64_t epoch) { epoch_ = epoch; }
  /// The selected epoch.
  std::uint64_t epoch() const { return epoch_; }

 private:
  std::uint64_t epoch_ = 0;
};

/// 0, 1, ..., n-1.
class SequentialSampler final : public Sampler {
 public:
  std::vector<std::size_t> indices(std::size_t n) const override;
  std::size_t size(std::size_t n) const override { return n; }
};

/// A permutation of 0..n-1 drawn from (seed, epoch) (data::permutation).
class RandomSampler final : public Sampler {
 public:
  explicit RandomSampler(std::uint64_t seed = 0) : seed_(seed) {}
  std::vector<std::size_t> indices(std::size_t n) const override {
    return permutation(n, seed_, epoch());
  }
  std::size_t size(std::size_t n) const override { return n; }
  std::uint64_t seed() const { return seed_; }

 private:
  std::uint64_t seed_;
};

/// The share of replica `rank` out of `num_replicas`, as torch.utils.data.DistributedSampler:
/// every replica draws the same permutation of 0..n-1 (from seed and epoch; the identity
/// when shuffle is off); without drop_last it is padded by repeating indices from its start
/// up to ceil(n / R) * R, with drop_last cut to floor(n / R) * R; replica r then takes
/// positions r, r + R, r + 2R, ... So each replica gets ceil(n / R) (floor with drop_last)
/// samples, and together the replicas cover the (padded) permutation exactly once.
class DistributedSampler final : public Sampler {
 public:
  /// IndexError when num_replicas is 0 or rank is not in [0, num_replicas).
  DistributedSampler(std::size_t num_replicas, std::size_t rank, bool shuffle = true,
                     std::uint64_t seed = 0, bool drop_last = false);

  std::size_t size(std::size_t n) const override {
    return drop_last_ ? n / num_replicas_ : (n + num_replicas_ - 1) / num_replicas_;
  }

  std::vector<std::size_t> indices(std::size_t n) const override;

  std::size_t num_replicas() const { return num_replicas_; }
  std::size_t rank() const { return rank_; }
  bool shuffle() const { return shuffle_; }
  std::uint64_t seed() const { return seed_; }
  bool drop_last() const { return drop_last_; }

 private:
  std::size_t num_replicas_, rank_;
  bool shuffle_;
  std::uint64_t seed_;
  bool drop_last_;
};

#if LAZYTENSOR_HEADER_DEFINITIONS
LAZYTENSOR_INLINE std::vector<std::size_t> SequentialSampler::indices(std::size_t n) const {
  std::vector<std::size_t> v(n);
  std::iota(v.begin(), v.end(), std::size_t{0});
  return v;
}

LAZYTENSOR_INLINE DistributedSampler::DistributedSampler(std::size_t num_replicas, std::size_t rank,
                                                         bool shuffle, std::uint64_t seed,
                                                         bool drop_last)
    : num_replicas_(num_replicas),
      rank_(rank),
      shuffle_(shuffle),
      seed_(seed),
      drop_last_(drop_last) {
  if (num_replicas == 0)
    throw IndexError("DistributedSampler: num_replicas must be at least 1, got 0");
  if (rank >= num_replicas) {
    throw IndexError("DistributedSampler: invalid rank " + std::to_string(rank) +
                     ", rank should be in the interval [0, " + std::to_string(num_replicas - 1) +
                     "]");
  }
}

LAZYTENSOR_INLINE std::vector<std::size_t> DistributedSampler::indices(std::size_t n) const {
  std::vector<std::size_t> all =
      shuffle_ ? permutation(n, seed_, epoch()) : SequentialSampler().indices(n);
  const std::size_t total = size(n) * num_replicas_;
  // Padding repeats the list from its start, cyclically when it must grow more than twice.
  for (std::size_t k = 0; all.size() < total; ++k) {
    const std::size_t repeat = all[k % n];
    all.push_back(repeat);
  }
  all.resize(total);
  std::vector<std::size_t> mine;
  mine.reserve(size(n));
  for (std::size_t i = rank_; i < total; i += num_replicas_) mine.push_back(all[i]);
  return mine;
}
#endif  // LAZYTENSOR_HEADER_DEFINITIONS

}  // namespace lazy::data
// ---- end lazytensor/data/sampler.hpp ----

namespace lazy::data {

/// Options of a DataLoader (libtorch's DataLoaderOptions / PyTorch's DataLoader arguments).
struct DataLoaderOptions {
  std::size_t batch_size = 1;
  /// Visit the samples in a random order (permutation(n, seed, epoch)); exclusive with a sampler.
  bool shuffle = false;
  /// Drop the last batch when it would be smaller than batch_size.
  bool drop_last = false;
  /// Seed of the shuffle.
  std::uint64_t seed = 0;
  /// Worker threads loading batches; 0 loads each batch on the consuming thread when asked.
  std::size_t num_workers = 0;
  /// Batches each worker loads ahead of the consumer (at least 1).
  std::size_t prefetch = 2;
  /// Device the batches are created on; default: the current device of the thread that
  /// creates the loader.
  std::optional<Device> device = std::nullopt;
};

namespace detail {

/// Sets this thread's current device for a scope.
class CurrentDeviceScope {
 public:
  explicit CurrentDeviceScope(int index)
      : saved_(std::exchange(graph::current_device_index(), index)) {}
  CurrentDeviceScope(const CurrentDeviceScope&) = delete;
  CurrentDeviceScope& operator=(const CurrentDeviceScope&) = delete;
  ~CurrentDeviceScope() { graph::current_device_index() = saved_; }

 private:
  int saved_;
};

/// Loads batches 0..n-1 through `load`, on worker threads or on demand, and hands them out
/// in order. One epoch; destroyed (and its workers joined) by the loader.
template <class Batch>
class BatchPipeline {
 public:
  using Load = std::function<Batch(std::size_t)>;

  BatchPipeline(std::size_t num_batches, std::size_t workers, std::size_t prefetch,
                int device_index, Load load)
      : n_(num_batches),
        workers_(workers),
        window_(workers * prefetch),
        device_(device_index),
        load_(std::move(load)) {
    threads_.reserve(workers_);
    try {
      for (std::size_t w = 0; w < workers_ && w < n_; ++w)
        threads_.emplace_back([this, w] { work(w); });
    } catch (...) {
      stop();
      throw;
    }
  }
  BatchPipeline(const BatchPipeline&) = delete;
  BatchPipeline& operator=(const BatchPipeline&) = delete;
  ~BatchPipeline() { stop(); }

  /// The next batch in order, or nothing at the end of the epoch. Re-throws the exception
  /// of a batch that failed to load (the epoch then ends).
  std::optional<Batch> next() {
    if (next_ >= n_) return std::nullopt;
    if (workers_ == 0) {
      CurrentDeviceScope scope(device_);
      const std::size_t b = next_;
      next_ = n_;  // an exception ends the epoch
      std::optional<Batch> batch(load_(b));
      next_ = b + 1;
      return batch;
    }
    Slot slot;
    {
      std::unique_lock lock(mu_);
      ready_cv_.wait(lock, [&] { return ready_.count(next_) != 0; });
      auto it = ready_.find(next_);
      slot = std::move(it->second);
      ready_.erase(it);
      ++next_;
    }
    space_cv_.notify_all();
    if (slot.error) {
      stop();
      next_ = n_;
      std::rethrow_exception(slot.error);
    }
    return std::move(slot.batch);
  }

  /// Stops the workers (each finishes the batch it is loading) and joins them.
  void stop() noexcept {
    {
      std::lock_guard lock(mu_);
      stopping_ = true;
    }
    space_cv_.notify_all();
    for (auto& t : threads_) t.join();
    threads_.clear();
  }

 private:
  struct Slot {
    std::optional<Batch> batch;
    std::exception_ptr error;
  };

  void work(std::size_t w) {
    graph::current_device_index() = device_;
    for (std::size_t b = w; b < n_; b += workers_) {
      {
        std::unique_lock lock(mu_);
        space_cv_.wait(lock, [&] { return stopping_ || b < next_ + window_; });
        if (stopping_) return;
      }
      Slot slot;
      try {
        slot.batch.emplace(load_(b));
      } catch (...) {
        slot.error = std::current_exception();
      }
      const bool failed = slot.error != nullptr;
      {
        std::lock_guard lock(mu_);
        if (stopping_) return;
        ready_.emplace(b, std::move(slot));
      }
      ready_cv_.notify_one();
      if (failed) return;  // the consumer stops at this batch; later ones are not wanted
    }
  }

  const std::size_t n_, workers_, window_;
  const int device_;
  const Load load_;
  std::size_t next_ = 0;  // guarded by mu_ when workers run
  std::mutex mu_;
  std::condition_variable ready_cv_, space_cv_;
  std::map<std::size_t, Slot> ready_;  // guarded by mu_
  bool stopping_ = false;              // guarded by mu_
  std::vector<std::thread> threads_;
};

}  // namespace detail

/// Batches of `D` in sampler order (see the file comment). Iterate with range-for; each
/// begin() starts an epoch (stopping one in progress). Not copyable or movable (workers
/// refer to it); make_data_loader returns it by unique_ptr, as libtorch does.
template <Dataset D>
class DataLoader {
 public:
  using dataset_type = D;
  using batch_type = batch_t<D>;

  /// Error for batch_size 0, prefetch 0, or shuffle together with a sampler.
  DataLoader(D dataset, DataLoaderOptions options = {}, std::shared_ptr<Sampler> sampler = nullptr)
      : dataset_(std::move(dataset)),
        options_(options),
        sampler_(std::move(sampler)),
        device_(options.device.value_or(lazy::device())) {
    if (options_.batch_size == 0) throw Error("DataLoader: batch_size must be at least 1, got 0");
    if (options_.prefetch == 0) throw Error("DataLoader: prefetch must be at least 1, got 0");
    if (options_.shuffle && sampler_) {
      throw Error(
          "DataLoader: shuffle = true is mutually exclusive with a sampler (shuffle with the "
          "sampler instead)");
    }
  }
  DataLoader(const DataLoader&) = delete;
  DataLoader& operator=(const DataLoader&) = delete;
  ~DataLoader() { pipeline_.reset(); }

  /// Input iterator over the batches of the running epoch.
  class iterator {
   public:
    using value_type = batch_type;
    using difference_type = std::ptrdiff_t;
    using reference = batch_type&;
    using pointer = batch_type*;
    using iterator_category = std::input_iterator_tag;

    iterator() = default;
    batch_type& operator*() const { return *loader_->current_; }
    batch_type* operator->() const { return &*loader_->current_; }
    iterator& operator++() {
      loader_->advance();
      return *this;
    }
    void operator++(int) { ++*this; }
    friend bool operator==(const iterator& it, std::default_sentinel_t) { return it.at_end(); }

   private:
    friend class DataLoader;
    explicit iterator(DataLoader* l) : loader_(l) {}
    bool at_end() const { return !loader_ || !loader_->current_; }
    DataLoader* loader_ = nullptr;
  };

  /// Starts an epoch (the one set by set_epoch, else the one after the previous begin())
  /// and returns an iterator at its first batch.
  iterator begin() {
    start_epoch();
    advance();
    return iterator(this);
  }
  std::default_sentinel_t end() const { return {}; }

  /// Batches per epoch.
  std::size_t size() const {
    const std::size_t n = sampler_ ? sampler_->size(dataset_.size()) : dataset_.size();
    return options_.drop_last ? n / options_.batch_size
                              : (n + options_.batch_size - 1) / options_.batch_size;
  }

  /// The epoch the next begin() uses (it determines the shuffle); each begin() then moves
  /// to the following epoch, so a loader reshuffles every epoch even without set_epoch.
  /// Also selects the sampler's epoch.
  void set_epoch(std::uint64_t epoch) { next_epoch_ = epoch; }

  const D& dataset() const { return dataset_; }
  const DataLoaderOptions& options() const { return options_; }
  /// The device batches are created on.
  Device device() const { return device_; }
  /// The sampler given at construction (nullptr when none).
  Sampler* sampler() const { return sampler_.get(); }

 private:
  void start_epoch() {
    pipeline_.reset();  // stop the epoch in progress before touching what its workers read
    current_.reset();
    const std::uint64_t epoch = next_epoch_++;
    const std::size_t n = dataset_.size();
    if (sampler_) {
      sampler_->set_epoch(epoch);
      order_ = sampler_->indices(n);
    } else if (options_.shuffle) {
      order_ = permutation(n, options_.seed, epoch);
    } else {
      order_.resize(n);
      std::iota(order_.begin(), order_.end(), std::size_t{0});
    }
    const std::size_t bs = options_.batch_size;
    const std::size_t batches =
        options_.drop_last ? order_.size() / bs : (order_.size() + bs - 1) / bs;
    pipeline_ = std::make_unique<detail::BatchPipeline<batch_type>>(
        batches, options_.num_workers, options_.prefetch, device_.index(),
        [this, bs](std::size_t b) {
          const auto first = order_.begin() + static_cast<std::ptrdiff_t>(b * bs);
          const auto last =
              order_.begin() + static_cast<std::ptrdiff_t>(std::min(order_.size(), (b + 1) * bs));
          return load(std::vector<std::size_t>(first, last));
        });
  }

  batch_type load(const std::vector<std::size_t>& indices) const {
    if constexpr (BatchDataset<D>) {
      return dataset_.get_batch(indices);
    } else {
      std::vector<example_t<D>> examples;
      examples.reserve(indices.size());
      for (const auto i : indices) examples.push_back(dataset_.get(i));
      return detail::collate(examples);
    }
  }

  void advance() {
    current_.reset();  // release the previous batch before loading the next
    if (pipeline_) current_ = pipeline_->next();
  }

  D dataset_;
  DataLoaderOptions options_;
  std::shared_ptr<Sampler> sampler_;
  Device device_;
  std::uint64_t next_epoch_ = 0;
  std::vector<std::size_t> order_;  // the running epoch's indices, read by the workers
  std::optional<batch_type> current_;
  std::unique_ptr<detail::BatchPipeline<batch_type>> pipeline_;  // last: stopped first
};

/// A loader over `dataset` (copied or moved in), as torch::data::make_data_loader.
template <class D>
requires Dataset<std::remove_cvref_t<D>> std::unique_ptr<DataLoader<std::remove_cvref_t<D>>>
make_data_loader(D&& dataset, DataLoaderOptions options = {}) {
  return std::make_unique<DataLoader<std::remove_cvref_t<D>>>(std::forward<D>(dataset), options);
}

/// A loader with the given batch size and default options.
template <class D>
requires Dataset<std::remove_cvref_t<D>> std::unique_ptr<DataLoader<std::remove_cvref_t<D>>>
make_data_loader(D&& dataset, std::size_t batch_size) {
  return make_data_loader(std::forward<D>(dataset), DataLoaderOptions{.batch_size = batch_size});
}

/// A loader visiting the indices of `sampler` (e.g. a DistributedSampler).
template <class D, std::derived_from<Sampler> S>
requires Dataset<std::remove_cvref_t<D>> std::unique_ptr<DataLoader<std::remove_cvref_t<D>>>
make_data_loader(D&& dataset, S sampler, DataLoaderOptions options = {}) {
  return std::make_unique<DataLoader<std::remove_cvref_t<D>>>(
      std::forward<D>(dataset), options, std::make_shared<S>(std::move(sampler)));
}

}  // namespace lazy::data
// ---- end lazytensor/data/data_loader.hpp ----
// ---- begin lazytensor/data/idx.hpp ----
// The IDX format of MNIST and Fashion-MNIST (http://yann.lecun.com/exdb/mnist/), raw or
// gzip-compressed (detected by the gzip magic bytes 1f 8b, not by the file name):
//
//   00 00 <type> <rank>   magic: two zero bytes, the element type, the number of dims
//   rank x uint32         the dimensions, big-endian
//   data                  row-major elements, exactly as many as the dims describe
//
// The reader is strict and hostile-input safe: every header field is checked, the data
// must fill the file exactly (short = truncated, longer = corrupt), and memory is sized from
// the data actually present, never from what a header claims.
//
// gzip needs zlib: it is used when <zlib.h> is found (link ZLIB::ZLIB, or -lz); define
// LAZYTENSOR_WITH_ZLIB=0 to do without (compressed files then raise IoError).

#include <algorithm>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <new>
#include <optional>
#include <string>
#include <vector>

// ---- begin lazytensor/io/file.hpp ----
// POSIX file access for the readers and writers of lazy::io and lazy::data: every system
// call is checked and turned into an IoError naming the file and the OS reason, partial
// reads/writes and EINTR are retried, and writes replace their target atomically.

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>
#include <system_error>
#include <utility>


namespace lazy::io::detail {

/// The OS description of `err` (thread-safe, unlike strerror).
inline std::string os_reason(int err) {
  return std::error_code(err, std::generic_category()).message();
}

/// An IoError "<what> '<path>': <reason of errno>".
IoError os_error(const std::string& what, const std::string& path, int err = errno);

/// The directory part of `path` ("." when it has none), for temp files and directory fsync.
std::string parent_dir(const std::string& path);

/// A file opened for reading, with its size taken once at open.
class ReadFile {
 public:
  /// Opens `path`; IoError when it cannot be opened or is not a regular file.
  explicit ReadFile(std::string path);
  ReadFile(const ReadFile&) = delete;
  ReadFile& operator=(const ReadFile&) = delete;
  ~ReadFile() { ::close(fd_); }

  const std::string& path() const { return path_; }
  /// Size in bytes when the file was opened.
  std::uint64_t size() const { return size_; }

  /// Reads up to `n` bytes at the current position; fewer only at end of file.
  std::size_t read(void* dst, std::size_t n);

  /// Reads up to `n` bytes at byte `offset` (the position is not moved); fewer only at end
  /// of file.
  std::size_t read_at(void* dst, std::size_t n, std::uint64_t offset);

 private:
  std::string path_;
  int fd_ = -1;
  std::uint64_t size_ = 0;
};

/// Writes a file atomically: the bytes go to a temporary file in the target's directory,
/// which commit() fsyncs and renames over the target, then fsyncs the directory (so the
/// rename itself survives a crash). Until commit() succeeds the target is untouched; a
/// writer destroyed without commit (an exception on the way) removes its temporary file.
class AtomicFileWriter {
 public:
  /// Creates the temporary file; IoError when the directory refuses it.
  explicit AtomicFileWriter(std::string path);
  AtomicFileWriter(const AtomicFileWriter&) = delete;
  AtomicFileWriter& operator=(const AtomicFileWriter&) = delete;
  ~AtomicFileWriter() { discard(); }

  /// Path of the temporary file (for tests and messages).
  const std::string& temp_path() const { return tmp_; }

  /// Appends `n` bytes; IoError (and the temporary file removed) on failure.
  void write(const void* src, std::size_t n);

  /// Makes the written bytes the content of the target path (fsync, rename, directory fsync).
  void commit();

 private:
  [[noreturn]] void fail(const std::string& what);
  void discard() noexcept;

  std::string path_;
  std::string tmp_;
  int fd_ = -1;
};

#if LAZYTENSOR_HEADER_DEFINITIONS
LAZYTENSOR_INLINE IoError os_error(const std::string& what, const std::string& path, int err) {
  return IoError(what + " '" + path + "': " + os_reason(err));
}

LAZYTENSOR_INLINE std::string parent_dir(const std::string& path) {
  const auto slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

LAZYTENSOR_INLINE ReadFile::ReadFile(std::string path) : path_(std::move(path)) {
  do fd_ = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC);
  while (fd_ < 0 && errno == EINTR);
  if (fd_ < 0) throw os_error("cannot open", path_);
  struct stat st {};
  if (::fstat(fd_, &st) != 0) {
    const int err = errno;
    ::close(fd_);
    throw os_error("cannot stat", path_, err);
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd_);
    throw IoError("cannot read '" + path_ + "': not a regular file");
  }
  size_ = static_cast<std::uint64_t>(st.st_size);
}

LAZYTENSOR_INLINE std::size_t ReadFile::read(void* dst, std::size_t n) {
  std::size_t done = 0;
  while (done < n) {
    const ::ssize_t r = ::read(fd_, static_cast<char*>(dst) + done, n - done);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) throw os_error("cannot read", path_);
    if (r == 0) break;
    done += static_cast<std::size_t>(r);
  }
  return done;
}

LAZYTENSOR_INLINE std::size_t ReadFile::read_at(void* dst, std::size_t n, std::uint64_t offset) {
  std::size_t done = 0;
  while (done < n) {
    const ::ssize_t r = ::pread(fd_, static_cast<char*>(dst) + done, n - done,
                                static_cast<::off_t>(offset + done));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) throw os_error("cannot read", path_);
    if (r == 0) break;
    done += static_cast<std::size_t>(r);
  }
  return done;
}

LAZYTENSOR_INLINE AtomicFileWriter::AtomicFileWriter(std::string path) : path_(std::move(path)) {
  const auto slash = path_.find_last_of('/');
  const std::string dir = slash == std::string::npos ? std::string() : path_.substr(0, slash + 1);
  const std::string base = slash == std::string::npos ? path_ : path_.substr(slash + 1);
  if (base.empty())
    throw IoError("cannot write '" + path_ + "': the path names a directory, not a file");
  // A hidden name unique to this process, call and moment; O_EXCL makes a clash an error
  // we retry rather than a file we clobber. 0666 lets the umask decide, as for any file.
  static std::atomic<std::uint64_t> counter{0};
  for (int attempt = 0;; ++attempt) {
    const auto stamp =
        static_cast<std::uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
    tmp_ = dir + "." + base + ".tmp." + std::to_string(::getpid()) + "." +
           std::to_string(counter.fetch_add(1)) + "." + std::to_string(stamp % 1000000007u);
    do fd_ = ::open(tmp_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
    while (fd_ < 0 && errno == EINTR);
    if (fd_ >= 0) break;
    if (errno != EEXIST || attempt == 16)
      throw os_error("cannot create a temporary file next to", path_);
  }
}

LAZYTENSOR_INLINE void AtomicFileWriter::write(const void* src, std::size_t n) {
  std::size_t done = 0;
  while (done < n) {
    const ::ssize_t r = ::write(fd_, static_cast<const char*>(src) + done, n - done);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) fail("cannot write");
    done += static_cast<std::size_t>(r);
  }
}

LAZYTENSOR_INLINE void AtomicFileWriter::commit() {
  if (::fsync(fd_) != 0) fail("cannot flush (fsync)");
  const int fd = std::exchange(fd_, -1);
  if (::close(fd) != 0) fail("cannot close");
  if (::rename(tmp_.c_str(), path_.c_str()) != 0) fail("cannot rename the temporary file over");
  tmp_.clear();  // it is the target now
  // The rename is durable only once the directory entry is on disk. The data is already
  // safe and the target replaced, so a directory that cannot be opened (some filesystems)
  // is not an error; a failing fsync is.
  const std::string dir = parent_dir(path_);
  const int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    const int rc = ::fsync(dfd);
    const int err = errno;
    ::close(dfd);
    if (rc != 0 && err != EINVAL && err != EROFS)
      throw os_error("cannot flush (fsync) the directory of", path_, err);
  }
}

LAZYTENSOR_INLINE void AtomicFileWriter::fail(const std::string& what) {
  const int err = errno;
  discard();
  throw os_error(what, path_, err);
}

LAZYTENSOR_INLINE void AtomicFileWriter::discard() noexcept {
  if (fd_ >= 0) ::close(std::exchange(fd_, -1));
  if (!tmp_.empty()) ::unlink(std::exchange(tmp_, std::string()).c_str());
}
#endif  // LAZYTENSOR_HEADER_DEFINITIONS

}  // namespace lazy::io::detail
// ---- end lazytensor/io/file.hpp ----

#ifndef LAZYTENSOR_WITH_ZLIB
#if __has_include(<zlib.h>)
#define LAZYTENSOR_WITH_ZLIB 1
#else
#define LAZYTENSOR_WITH_ZLIB 0
#endif
#endif
// Only the definitions use zlib: a TU that just declares them (LAZYTENSOR_COMPILED) needs no
// <zlib.h>.
#if LAZYTENSOR_WITH_ZLIB && LAZYTENSOR_HEADER_DEFINITIONS
#include <zlib.h>
#endif

namespace lazy::data {

/// The contents of an IDX file of unsigned bytes (element type 0x08).
struct IdxArray {
  std::vector<std::int64_t> dims;  ///< the dimensions, outermost first
  std::vector<std::uint8_t> data;  ///< the elements, row-major
  /// Number of elements.
  std::int64_t numel() const;
};

namespace detail {

/// The IDX name of an element type code, or nullptr for an unknown code.
const char* idx_type_name(unsigned code);

std::string hex_byte(unsigned b);

/// Bytes of an uncompressed file, read sequentially.
class RawSource {
 public:
  explicit RawSource(io::detail::ReadFile& f) : f_(f) {}
  std::size_t read(void* dst, std::size_t n) { return f_.read(dst, n); }

 private:
  io::detail::ReadFile& f_;
};

#if LAZYTENSOR_WITH_ZLIB && LAZYTENSOR_HEADER_DEFINITIONS
/// The decompressed bytes of a gzip file (one or more concatenated members, as gzip -c
/// writes them). Corrupt or truncated compressed data, and anything after the last member
/// that is not another member, raise FormatError.
class GzipSource {
 public:
  explicit GzipSource(io::detail::ReadFile& f);
  GzipSource(const GzipSource&) = delete;
  GzipSource& operator=(const GzipSource&) = delete;
  ~GzipSource() { inflateEnd(&zs_); }

  /// Up to n decompressed bytes; fewer only at the clean end of the stream.
  std::size_t read(void* dst, std::size_t n);

 private:
  void refill();
  [[noreturn]] void fail(const std::string& what);

  io::detail::ReadFile& f_;
  std::vector<Bytef> in_;
  z_stream zs_{};
  bool eof_ = false;
  bool member_done_ = false;
};
#endif

/// Parses an IDX stream. `file_size` is the exact size of an uncompressed file (checked
/// before allocating); for a compressed stream it is unknown. Either way the data buffer
/// grows with the bytes actually read (geometrically, so at most about twice what arrived),
/// never from the header's claim alone.
[[noreturn]] void idx_fail(const std::string& path, const std::string& what);

template <class Source>
IdxArray parse_idx(Source& src, const std::string& path, std::optional<std::uint64_t> file_size) {
  unsigned char head[4];
  const std::size_t got = src.read(head, 4);
  if (got < 4) {
    idx_fail(path, (got == 0 ? std::string("truncated: the file is empty")
                             : "truncated: the file ends after " + std::to_string(got) + " bytes") +
                       ", expected the 4-byte IDX magic 00 00 <type> <rank>");
  }
  if (head[0] != 0 || head[1] != 0) {
    idx_fail(path, "not an IDX file: the magic bytes are " + hex_byte(head[0]) + " " +
                       hex_byte(head[1]) + " " + hex_byte(head[2]) + " " + hex_byte(head[3]) +
                       ", expected 00 00 <type> <rank>");
  }
  if (head[2] != 0x08) {
    const char* name = idx_type_name(head[2]);
    idx_fail(path, name ? "element type 0x" + hex_byte(head[2]) + " (" + name +
                              ") is not supported, expected 0x08 (unsigned byte)"
                        : "unknown element type 0x" + hex_byte(head[2]) +
                              ", expected 0x08 (unsigned byte)");
  }
  const unsigned rank = head[3];
  if (rank == 0 || rank > static_cast<unsigned>(kMaxRank)) {
    idx_fail(path, "the header declares " + std::to_string(rank) + " dimensions, expected 1 to " +
                       std::to_string(kMaxRank));
  }
  unsigned char raw_dims[4 * kMaxRank];
  const std::size_t dim_bytes = 4 * static_cast<std::size_t>(rank);
  if (const std::size_t g = src.read(raw_dims, dim_bytes); g < dim_bytes) {
    idx_fail(path, "truncated: the file ends inside the header (" + std::to_string(4 + g) + " of " +
                       std::to_string(4 + dim_bytes) + " header bytes present)");
  }
  IdxArray a;
  std::uint64_t numel = 1;
  std::string dims_text;
  for (unsigned d = 0; d < rank; ++d) {
    const unsigned char* p = raw_dims + 4 * d;
    const std::uint64_t v = (std::uint64_t{p[0]} << 24) | (std::uint64_t{p[1]} << 16) |
                            (std::uint64_t{p[2]} << 8) | p[3];
    if (v == 0) idx_fail(path, "dimension " + std::to_string(d) + " is 0, expected > 0");
    dims_text += (d ? " x " : "") + std::to_string(v);
    // The bound of every shape (core/shape.hpp), which keeps later sums and the allocation
    // arithmetic far from overflow.
    if (__builtin_mul_overflow(numel, v, &numel) || numel > static_cast<std::uint64_t>(kMaxElements)) {
      idx_fail(path, "the dimensions describe more than 2^60 elements (corrupt header?)");
    }
    a.dims.push_back(static_cast<std::int64_t>(v));
  }
  const std::string promise = "the header (dims " + dims_text + " of unsigned bytes) promises " +
                              std::to_string(numel) + " data bytes";
  if (file_size) {
    const std::uint64_t expected = 4 + dim_bytes + numel;
    if (*file_size < expected) {
      idx_fail(path, "truncated: " + promise + ", the file holds " +
                         std::to_string(*file_size - 4 - dim_bytes));
    }
    if (*file_size > expected) {
      idx_fail(path, "corrupt: " + std::to_string(*file_size - expected) +
                         " extra bytes after the data (" + promise + ")");
    }
    // A size the machine cannot hold fails now (a sparse file can claim any size).
    lazy::detail::check_fits_in_memory(numel, path + ": the data (" + promise + ")");
    try {
      a.data.reserve(static_cast<std::size_t>(numel));  // the size is known: one allocation
    } catch (const std::bad_alloc&) {
      throw OutOfMemoryError(path + ": cannot allocate " + lazy::detail::byte_size_text(numel) + " for the data (" +
                             promise + ")");
    }
  }
  constexpr std::size_t kChunk = std::size_t{1} << 20;
  std::size_t have = 0;
  try {
    while (have < numel) {
      const std::size_t want = static_cast<std::size_t>(std::min<std::uint64_t>(kChunk, numel - have));
      a.data.resize(have + want);
      const std::size_t g = src.read(a.data.data() + have, want);
      have += g;
      if (g < want) {
        if (file_size) idx_fail(path, "the file shrank while being read");
        idx_fail(path, "truncated: " + promise + ", the decompressed data holds " + std::to_string(have));
      }
    }
  } catch (const std::bad_alloc&) {
    throw OutOfMemoryError(path + ": out of memory after reading " + lazy::detail::byte_size_text(have) +
                           " of the data (" + promise + ")");
  }
  std::uint64_t extra = 0;
  unsigned char sink[4096];
  for (std::size_t g; (g = src.read(sink, sizeof sink)) > 0;) extra += g;
  if (extra)
    idx_fail(path,
             "corrupt: " + std::to_string(extra) + " extra bytes after the data (" + promise + ")");
  return a;
}

}  // namespace detail

/// Reads an IDX file of unsigned bytes, raw or gzip-compressed. IoError when the file
/// cannot be opened or read; FormatError naming the file and what was expected vs found
/// for anything malformed (magic, element type, dimensions, size, compressed data).
IdxArray read_idx(const std::string& path);

#if LAZYTENSOR_HEADER_DEFINITIONS
LAZYTENSOR_INLINE std::int64_t IdxArray::numel() const {
  std::int64_t n = 1;
  for (const auto d : dims) n *= d;
  return n;
}

namespace detail {

LAZYTENSOR_INLINE const char* idx_type_name(unsigned code) {
  switch (code) {
    case 0x08:
      return "unsigned byte";
    case 0x09:
      return "signed byte";
    case 0x0B:
      return "int16";
    case 0x0C:
      return "int32";
    case 0x0D:
      return "float32";
    case 0x0E:
      return "float64";
    default:
      return nullptr;
  }
}

LAZYTENSOR_INLINE std::string hex_byte(unsigned b) {
  char s[8];
  std::snprintf(s, sizeof s, "%02x", b & 0xFFu);
  return s;
}

#if LAZYTENSOR_WITH_ZLIB
LAZYTENSOR_INLINE GzipSource::GzipSource(io::detail::ReadFile& f)
    // The input buffer is never larger than the file: a small file costs a small buffer.
    : f_(f), in_(static_cast<std::size_t>(std::min<std::uint64_t>(1 << 16, f.size() + 1))) {
  if (inflateInit2(&zs_, 16 + MAX_WBITS) != Z_OK)  // the only failure left: memory
    throw OutOfMemoryError("cannot allocate zlib's inflate state");
}

LAZYTENSOR_INLINE std::size_t GzipSource::read(void* dst, std::size_t n) {
  auto* out = static_cast<Bytef*>(dst);
  std::size_t done = 0;
  while (done < n) {
    if (zs_.avail_in == 0 && !eof_) refill();
    if (member_done_) {
      if (zs_.avail_in == 0) break;  // clean end of the last member
      if (zs_.next_in[0] != 0x1f)
        fail("data after the end of the gzip stream is not another gzip member");
      if (inflateReset(&zs_) != Z_OK) fail("cannot restart for the next gzip member");
      member_done_ = false;
    }
    if (zs_.avail_in == 0)
      fail("truncated gzip stream (the compressed data ends before its end-of-stream marker)");
    const auto room = static_cast<uInt>(std::min<std::size_t>(n - done, UINT_MAX));
    zs_.next_out = out + done;
    zs_.avail_out = room;
    const int rc = inflate(&zs_, Z_NO_FLUSH);
    done += room - zs_.avail_out;
    if (rc == Z_STREAM_END)
      member_done_ = true;
    else if (rc == Z_MEM_ERROR)
      throw OutOfMemoryError("zlib ran out of memory while inflating");
    else if (rc != Z_OK && rc != Z_BUF_ERROR)
      fail(std::string("corrupt gzip data (") + (zs_.msg ? zs_.msg : "inflate error") + ")");
  }
  return done;
}

LAZYTENSOR_INLINE void GzipSource::refill() {
  const std::size_t got = f_.read(in_.data(), in_.size());
  zs_.next_in = in_.data();
  zs_.avail_in = static_cast<uInt>(got);
  eof_ = got == 0;
}

LAZYTENSOR_INLINE void GzipSource::fail(const std::string& what) {
  throw FormatError(f_.path() + ": " + what);
}
#endif  // LAZYTENSOR_WITH_ZLIB

LAZYTENSOR_INLINE void idx_fail(const std::string& path, const std::string& what) {
  throw FormatError(path + ": " + what);
}

}  // namespace detail

LAZYTENSOR_INLINE IdxArray read_idx(const std::string& path) {
  io::detail::ReadFile file(path);
  unsigned char magic[2] = {0, 0};
  const bool gzip = file.read_at(magic, 2, 0) == 2 && magic[0] == 0x1f && magic[1] == 0x8b;
  if (gzip) {
#if LAZYTENSOR_WITH_ZLIB
    detail::GzipSource src(file);
    return detail::parse_idx(src, path, std::nullopt);
#else
    throw IoError(path +
                  ": the file is gzip-compressed, but lazytensor was compiled without zlib "
                  "(install zlib's headers and link ZLIB::ZLIB)");
#endif
  }
  detail::RawSource src(file);
  return detail::parse_idx(src, path, file.size());
}
#endif  // LAZYTENSOR_HEADER_DEFINITIONS

}  // namespace lazy::data
// ---- end lazytensor/data/idx.hpp ----
// ---- begin lazytensor/data/mnist.hpp ----
// The MNIST / Fashion-MNIST dataset (same files, same layout), as
// torch::data::datasets::MNIST. Debian's dataset-fashion-mnist package installs the files
// gzip'd in /usr/share/datasets/fashion-mnist.

#include <sys/stat.h>
#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

// ---- begin lazytensor/data/transforms.hpp ----
// Transforms applied to examples, as torch::data::transforms. Normalize runs on the host
// while the batch is built: datasets that convert raw bytes to floats (MNIST) fold it into
// that conversion, so normalizing costs nothing extra.

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>


namespace lazy::data::transforms {

/// (x - mean[c]) / stddev[c] on the data of each example, c being the channel: dimension 0
/// of an example, dimension 1 of a batch (a single mean/stddev applies to every element).
/// Computed in float, as libtorch's Normalize on a float tensor.
class Normalize {
 public:
  /// One mean and stddev for every channel.
  Normalize(double mean, double stddev);
  /// Per-channel means and standard deviations (equal, non-zero counts; stddev non-zero).
  Normalize(const std::vector<double>& mean, const std::vector<double>& stddev);

  /// Number of channels (1 when one mean applies to everything).
  std::size_t channels() const { return mean_.size(); }
  /// The normalized value of x in channel c.
  float operator()(float x, std::size_t c) const { return (x - mean_[c]) / stddev_[c]; }

  /// Checks that data with `channels` channels can be normalized; ShapeError otherwise.
  void check_channels(std::int64_t channels, const Shape& shape) const;

  /// x normalized, channels along `channel_dim` (a new tensor on x's device).
  Tensor<float> apply(const Tensor<float>& x, int channel_dim) const;

  /// Normalizes an example's data (channels along dimension 0).
  template <class Target>
  Example<Tensor<float>, Target> operator()(Example<Tensor<float>, Target> example) const {
    example.data = apply(example.data, 0);
    return example;
  }
  /// Normalizes a batch's data (channels along dimension 1).
  template <class Target>
  Example<Tensor<float>, Target> apply_batch(Example<Tensor<float>, Target> batch) const {
    batch.data = apply(batch.data, 1);
    return batch;
  }

  const std::vector<float>& mean() const { return mean_; }
  const std::vector<float>& stddev() const { return stddev_; }

 private:
  std::vector<float> mean_, stddev_;
};

#if LAZYTENSOR_HEADER_DEFINITIONS
LAZYTENSOR_INLINE Normalize::Normalize(double mean, double stddev)
    : Normalize(std::vector<double>{mean}, std::vector<double>{stddev}) {}

LAZYTENSOR_INLINE Normalize::Normalize(const std::vector<double>& mean,
                                       const std::vector<double>& stddev) {
  if (mean.empty() || mean.size() != stddev.size()) {
    throw ShapeError(
        "Normalize: expected as many means as standard deviations (at least one), got " +
        std::to_string(mean.size()) + " and " + std::to_string(stddev.size()));
  }
  for (std::size_t c = 0; c < mean.size(); ++c) {
    if (stddev[c] == 0)
      throw Error("Normalize: stddev of channel " + std::to_string(c) + " is 0");
    mean_.push_back(static_cast<float>(mean[c]));
    stddev_.push_back(static_cast<float>(stddev[c]));
  }
}

LAZYTENSOR_INLINE void Normalize::check_channels(std::int64_t channels, const Shape& shape) const {
  if (mean_.size() != 1 && static_cast<std::int64_t>(mean_.size()) != channels) {
    throw ShapeError("Normalize: " + std::to_string(mean_.size()) +
                     " channel means for data of shape " + shape.str() + ", which has " +
                     std::to_string(channels) + " channels");
  }
}

LAZYTENSOR_INLINE Tensor<float> Normalize::apply(const Tensor<float>& x, int channel_dim) const {
  const Shape& s = x.shape();
  const std::int64_t channels = channel_dim < s.rank() ? s[channel_dim] : 1;
  check_channels(channels, s);
  std::int64_t inner = 1;
  for (int d = channel_dim + 1; d < s.rank(); ++d) inner *= s[d];
  const float* src = x.data();
  detail::HostTensor<float> out(s, x.device());
  float* dst = out.data();
  const std::int64_t n = x.numel();
  for (std::int64_t i = 0; i < n; ++i) {
    const auto c =
        mean_.size() == 1 ? std::size_t{0} : static_cast<std::size_t>((i / inner) % channels);
    dst[i] = (*this)(src[i], c);
  }
  return std::move(out).finish();
}
#endif  // LAZYTENSOR_HEADER_DEFINITIONS

}  // namespace lazy::data::transforms
// ---- end lazytensor/data/transforms.hpp ----

namespace lazy::data {

/// MNIST-format images and labels from `root`: train-images-idx3-ubyte and
/// train-labels-idx1-ubyte (Mode::Train) or t10k-images-idx3-ubyte and
/// t10k-labels-idx1-ubyte (Mode::Test), each raw or with a .gz suffix. Images stay bytes on
/// the host (47 MB for the training set); each batch converts its images to float in [0, 1]
/// (with Normalize folded into the same table lookup when mapped), shape [B, 1, H, W], and
/// its labels to int64 [B]. Copies share the loaded data.
class MNIST : public DatasetBase<MNIST> {
 public:
  /// Which split to read.
  enum class Mode { Train, Test };

  /// Loads the split; IoError when a file is missing, FormatError when one is malformed or
  /// the two disagree (image count vs label count, labels outside 0..9).
  explicit MNIST(const std::string& root, Mode mode = Mode::Train);

  /// Number of images.
  std::size_t size() const { return storage_->labels.data.size(); }
  /// True for the training split.
  bool is_train() const { return mode_ == Mode::Train; }
  /// Image height and width.
  std::int64_t rows() const { return storage_->images.dims[1]; }
  std::int64_t cols() const { return storage_->images.dims[2]; }
  /// The raw images (size() x rows() x cols() bytes) and labels.
  const std::vector<std::uint8_t>& images() const { return storage_->images.data; }
  const std::vector<std::uint8_t>& labels() const { return storage_->labels.data; }

  /// Image `index` as float [1, H, W] in [0, 1] and its label as a 0-d int64 tensor.
  Example<> get(std::size_t index) const;
  /// Images `indices` as float [B, 1, H, W] in [0, 1] and labels as int64 [B].
  Example<> get_batch(const std::vector<std::size_t>& indices) const;
  /// get_batch with `normalize` folded into the byte-to-float conversion (one table lookup
  /// per pixel; the values equal normalizing the [0, 1] floats afterwards, bit for bit).
  Example<> get_batch(const std::vector<std::size_t>& indices,
                      const transforms::Normalize& normalize) const;

 private:
  struct Storage {
    IdxArray images, labels;
  };
  using Table = std::array<float, 256>;

  // As libtorch: the byte converted to float, then divided by 255.
  static float to_unit(int p) { return static_cast<float>(p) / 255.0f; }
  static const Table& identity_table();

  static std::string find(const std::string& base);

  Shape batch_image_shape(std::size_t n) const {
    return Shape{static_cast<std::int64_t>(n), 1, rows(), cols()};
  }

  void check(std::size_t index) const;

  Tensor<float> convert(const std::vector<std::size_t>& indices, const Table& table,
                        const Shape& shape) const;

  Tensor<std::int64_t> labels_of(const std::vector<std::size_t>& indices,
                                 const Shape& shape) const;

  std::shared_ptr<const Storage> storage_;
  Mode mode_;
};

namespace datasets {
/// libtorch's spelling: torch::data::datasets::MNIST.
using lazy::data::MNIST;
}  // namespace datasets

#if LAZYTENSOR_HEADER_DEFINITIONS
LAZYTENSOR_INLINE MNIST::MNIST(const std::string& root, Mode mode) : mode_(mode) {
  const std::string prefix = root + "/" + (mode == Mode::Train ? "train" : "t10k");
  auto s = std::make_shared<Storage>();
  const std::string images_path = find(prefix + "-images-idx3-ubyte");
  const std::string labels_path = find(prefix + "-labels-idx1-ubyte");
  s->images = read_idx(images_path);
  s->labels = read_idx(labels_path);
  if (s->images.dims.size() != 3) {
    throw FormatError(images_path + ": expected 3 dimensions (images x rows x columns), found " +
                      std::to_string(s->images.dims.size()));
  }
  if (s->labels.dims.size() != 1) {
    throw FormatError(labels_path + ": expected 1 dimension (labels), found " +
                      std::to_string(s->labels.dims.size()));
  }
  if (s->images.dims[0] != s->labels.dims[0]) {
    throw FormatError(images_path + " holds " + std::to_string(s->images.dims[0]) +
                      " images but " + labels_path + " holds " +
                      std::to_string(s->labels.dims[0]) + " labels");
  }
  for (std::size_t i = 0; i < s->labels.data.size(); ++i) {
    if (s->labels.data[i] > 9) {
      throw FormatError(labels_path + ": label " + std::to_string(i) + " is " +
                        std::to_string(s->labels.data[i]) + ", expected 0 to 9");
    }
  }
  storage_ = std::move(s);
}

LAZYTENSOR_INLINE Example<> MNIST::get(std::size_t index) const {
  const std::vector<std::size_t> one{index};
  return {convert(one, identity_table(), Shape{1, rows(), cols()}), labels_of(one, Shape{})};
}

LAZYTENSOR_INLINE Example<> MNIST::get_batch(const std::vector<std::size_t>& indices) const {
  return {convert(indices, identity_table(), batch_image_shape(indices.size())),
          labels_of(indices, Shape{static_cast<std::int64_t>(indices.size())})};
}

LAZYTENSOR_INLINE Example<> MNIST::get_batch(const std::vector<std::size_t>& indices,
                                             const transforms::Normalize& normalize) const {
  const Shape shape = batch_image_shape(indices.size());
  normalize.check_channels(1, shape);
  Table t;
  for (int p = 0; p < 256; ++p) t[static_cast<std::size_t>(p)] = normalize(to_unit(p), 0);
  return {convert(indices, t, shape),
          labels_of(indices, Shape{static_cast<std::int64_t>(indices.size())})};
}

LAZYTENSOR_INLINE const MNIST::Table& MNIST::identity_table() {
  static const Table t = [] {
    Table r;
    for (int p = 0; p < 256; ++p) r[static_cast<std::size_t>(p)] = to_unit(p);
    return r;
  }();
  return t;
}

LAZYTENSOR_INLINE std::string MNIST::find(const std::string& base) {
  struct stat st {};
  if (::stat(base.c_str(), &st) == 0) return base;
  if (::stat((base + ".gz").c_str(), &st) == 0) return base + ".gz";
  throw IoError("MNIST: neither '" + base + "' nor '" + base + ".gz' exists");
}

LAZYTENSOR_INLINE void MNIST::check(std::size_t index) const {
  if (index >= size()) {
    throw IndexError("MNIST: index " + std::to_string(index) +
                     " is out of range for a dataset of " + std::to_string(size()) + " images");
  }
}

LAZYTENSOR_INLINE Tensor<float> MNIST::convert(const std::vector<std::size_t>& indices,
                                               const Table& table, const Shape& shape) const {
  for (const auto i : indices) check(i);
  const auto per = static_cast<std::size_t>(rows() * cols());
  detail::HostTensor<float> out(shape);
  float* dst = out.data();
  const std::uint8_t* src = storage_->images.data.data();
  for (const auto i : indices) {
    const std::uint8_t* img = src + i * per;
    for (std::size_t k = 0; k < per; ++k) dst[k] = table[img[k]];
    dst += per;
  }
  return std::move(out).finish();
}

LAZYTENSOR_INLINE Tensor<std::int64_t> MNIST::labels_of(const std::vector<std::size_t>& indices,
                                                        const Shape& shape) const {
  detail::HostTensor<std::int64_t> out(shape);
  for (std::size_t b = 0; b < indices.size(); ++b)
    out.data()[b] = storage_->labels.data[indices[b]];
  return std::move(out).finish();
}
#endif  // LAZYTENSOR_HEADER_DEFINITIONS

}  // namespace lazy::data
// ---- end lazytensor/data/mnist.hpp ----
// ---- begin lazytensor/data/tensor_dataset.hpp ----
// TensorDataset: samples are the rows (first dimension) of a data tensor and a target
// tensor, as torch::data::datasets::TensorDataset.

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>


namespace lazy::data {

/// Rows of `data` paired with rows of `targets`. The values are materialized once, at
/// construction, and held as an immutable snapshot: later in-place updates of the tensors
/// passed in do not change the dataset, and workers read the snapshot without touching the
/// lazy graph. Copies share the snapshot.
template <Element D = float, Element T = std::int64_t>
class TensorDataset : public DatasetBase<TensorDataset<D, T>> {
 public:
  using example_type = Example<Tensor<D>, Tensor<T>>;

  /// ShapeError when either tensor is 0-d or their first dimensions differ.
  TensorDataset(const Tensor<D>& data, const Tensor<T>& targets)
      : data_(snapshot(data, "data")), targets_(snapshot(targets, "targets")) {
    if (data.size(0) != targets.size(0)) {
      throw ShapeError("TensorDataset: data has " + std::to_string(data.size(0)) +
                       " samples (shape " + data.shape().str() + ") but targets has " +
                       std::to_string(targets.size(0)) + " (shape " + targets.shape().str() + ")");
    }
    size_ = static_cast<std::size_t>(data.size(0));
  }

  /// Number of samples.
  std::size_t size() const { return size_; }

  /// Sample `index` (IndexError when out of range), on the current device.
  example_type get(std::size_t index) const {
    check(index);
    return {gather<D>(data_, &index, 1, data_.row_shape),
            gather<T>(targets_, &index, 1, targets_.row_shape)};
  }

  /// Rows `indices` gathered into one [B, ...] tensor per field, on the current device.
  example_type get_batch(const std::vector<std::size_t>& indices) const {
    for (const auto i : indices) check(i);
    const std::size_t n = indices.size();
    return {gather<D>(data_, indices.data(), n, detail::batch_shape(n, data_.row_shape)),
            gather<T>(targets_, indices.data(), n, detail::batch_shape(n, targets_.row_shape))};
  }

  /// get_batch with the data normalized during the gather (channels along dimension 1).
  example_type get_batch(
      const std::vector<std::size_t>& indices,
      const transforms::Normalize& normalize) const requires std::is_same_v<D, float> {
    for (const auto i : indices) check(i);
    const std::size_t n = indices.size();
    const Shape shape = detail::batch_shape(n, data_.row_shape);
    const std::int64_t channels = data_.row_shape.rank() > 0 ? data_.row_shape[0] : 1;
    normalize.check_channels(channels, shape);
    const auto per = static_cast<std::size_t>(data_.row_shape.numel());
    const std::size_t inner = channels > 0 ? per / static_cast<std::size_t>(channels) : 0;
    detail::HostTensor<float> out(shape);
    float* dst = out.data();
    for (std::size_t b = 0; b < n; ++b) {
      const float* src = static_cast<const float*>(data_.buffer->data()) + indices[b] * per;
      for (std::size_t k = 0; k < per; ++k) {
        const std::size_t c = normalize.channels() == 1 ? 0 : k / inner;
        dst[b * per + k] = normalize(src[k], c);
      }
    }
    return {std::move(out).finish(),
            gather<T>(targets_, indices.data(), n, detail::batch_shape(n, targets_.row_shape))};
  }

 private:
  struct Field {
    std::shared_ptr<Buffer> buffer;  // shared with the source node, so never donated or changed
    Shape row_shape;
  };

  template <Element U>
  static Field snapshot(const Tensor<U>& t, const char* what) {
    if (t.dim() == 0) {
      throw ShapeError(std::string("TensorDataset: ") + what +
                       " must have a first (sample) dimension, got a 0-d tensor");
    }
    t.data();  // materialize
    Shape row;
    for (int d = 1; d < t.dim(); ++d) row.push_back(t.size(d));
    return {t.node()->buffer(), row};
  }

  void check(std::size_t index) const {
    if (index >= size_) {
      throw IndexError("TensorDataset: index " + std::to_string(index) +
                       " is out of range for a dataset of " + std::to_string(size_) + " samples");
    }
  }

  template <Element U>
  static Tensor<U> gather(const Field& f, const std::size_t* indices, std::size_t n,
                          const Shape& shape) {
    const auto per = static_cast<std::size_t>(f.row_shape.numel());
    detail::HostTensor<U> out(shape);
    const auto* src = static_cast<const U*>(f.buffer->data());
    for (std::size_t b = 0; b < n; ++b) {
      if (per) std::memcpy(out.data() + b * per, src + indices[b] * per, per * sizeof(U));
    }
    return std::move(out).finish();
  }

  Field data_, targets_;
  std::size_t size_ = 0;
};

namespace datasets {
/// libtorch's spelling: torch::data::datasets::TensorDataset.
using lazy::data::TensorDataset;
}  // namespace datasets

}  // namespace lazy::data
// ---- end lazytensor/data/tensor_dataset.hpp ----
// ---- end lazytensor/data.hpp ----
// ---- begin lazytensor/debug/graph_dump.hpp ----
// The pending graph behind tensors, as text or Graphviz DOT (the analogue of
// torch_xla's get_stablehlo / graph dumps), with the fusion the planner would apply if
// mark_step ran now: cross-statement element-wise groups (chunk-interleaved; a member kept
// only in chunk scratch is marked) and GEMMs run in row blocks by their epilogue.

#include <algorithm>
#include <cstdint>
#include <sstream>
#include <string>
#include <unordered_map>
#include <vector>


namespace lazy::debug {

/// A tensor handle (anything with node()).
template <class T>
concept HasNode = requires(const T& t) { t.node(); };

namespace detail {
template <class... Ts>
std::vector<graph::NodePtr> roots_of(const Ts&... ts) {
  return {ts.node()...};
}

/// How the planner would run the pending nodes: the fused group of each node (-1: alone)
/// and whether its value would only live in chunk scratch.
struct Fusion {
  std::unordered_map<const graph::Node*, int> group;
  std::unordered_map<const graph::Node*, bool> scratch_only;
};

Fusion plan_fusion(const std::vector<graph::NodePtr>& order);

std::vector<graph::NodePtr> with_inputs(const std::vector<graph::NodePtr>& roots, Fusion* fusion);

std::string type_str(const graph::Node& n);
}  // namespace detail

/// The graph that computes `tensors`, one node per line in execution order:
/// `%3 = float32(4, 4) fused(add(%0, %1)) <- %1, %2`. Materialized inputs show as data.
/// Fusion shows at the end of a line: `{group 0}` for members of a chunk-interleaved group
/// (`{group 0, scratch}` when the value is never written whole), `{in row blocks of %5}`
/// for a GEMM that its epilogue %5 runs block by block.
std::string graph_text(const std::vector<graph::NodePtr>& roots);

/// The graph as text for tensors given directly: graph_text(y, z).
template <class... Ts>
std::string graph_text(const Ts&... tensors)
  requires(sizeof...(Ts) > 0 && (HasNode<Ts> && ...))
{
  return graph_text(detail::roots_of(tensors...));
}

/// The graph in Graphviz DOT; render with `dot -Tpng`. Fused groups are clusters
/// ("fused group N"); scratch-only members are dotted; a GEMM run in row blocks by its
/// epilogue is linked to it by a bold edge.
std::string graph_dot(const std::vector<graph::NodePtr>& roots);

/// DOT for tensors given directly.
template <class... Ts>
std::string graph_dot(const Ts&... tensors)
  requires(sizeof...(Ts) > 0 && (HasNode<Ts> && ...))
{
  return graph_dot(detail::roots_of(tensors...));
}

#if LAZYTENSOR_HEADER_DEFINITIONS
namespace detail {

LAZYTENSOR_INLINE Fusion plan_fusion(const std::vector<graph::NodePtr>& order) {
  Fusion f;
  if (order.empty()) return f;
  graph::prepare(order);  // decisions redone by the real step's planning
  const std::uint64_t epoch = graph::detail::number_nodes(order);
  std::vector<std::uint8_t> outside;
  graph::detail::plan_signature(order, epoch, outside);
  auto plan = graph::detail::build_plan(order, epoch, outside);
  int g = 0;
  for (const auto& st : plan->steps) {
    if (st.kind != graph::PlanStep::Kind::Group) continue;
    for (std::size_t j = 0; j < st.members.size(); ++j) {
      const graph::Node* n = order[static_cast<std::size_t>(st.members[j])].get();
      f.group[n] = g;
      f.scratch_only[n] = !st.whole[j];
    }
    ++g;
  }
  return f;
}

LAZYTENSOR_INLINE std::vector<graph::NodePtr> with_inputs(const std::vector<graph::NodePtr>& roots, Fusion* fusion) {
  // Steps in flight finish first: a dump looks at values, not at a graph being executed.
  for (const auto& r : roots)
    if (r) r->device()->wait_idle();
  // Pending nodes in execution order, plus the materialized values they read.
  std::vector<graph::NodePtr> order = graph::topological_order(roots);
  if (fusion) *fusion = plan_fusion(order);
  std::vector<graph::NodePtr> all;
  std::unordered_map<const graph::Node*, bool> seen;
  for (const auto& n : order)
    for (const auto& in : n->inputs())
      if (in->materialized() && !seen[in.get()]) {
        seen[in.get()] = true;
        all.push_back(in);
      }
  for (const auto& r : roots)
    if (r->materialized() && !seen[r.get()]) {
      seen[r.get()] = true;
      all.push_back(r);
    }
  all.insert(all.end(), order.begin(), order.end());
  return all;
}

LAZYTENSOR_INLINE std::string type_str(const graph::Node& n) { return dtype_name(n.dtype()) + n.shape().str(); }

}  // namespace detail

LAZYTENSOR_INLINE std::string graph_text(const std::vector<graph::NodePtr>& roots) {
  detail::Fusion fusion;
  auto nodes = detail::with_inputs(roots, &fusion);
  std::unordered_map<const graph::Node*, int> id;
  for (const auto& n : nodes) id.emplace(n.get(), static_cast<int>(id.size()));
  std::ostringstream os;
  for (const auto& n : nodes) {
    os << "%" << id[n.get()] << " = " << detail::type_str(*n) << " ";
    if (n->materialized()) {
      os << "data";
    } else {
      os << n->op_name() << "[" << n->describe() << "]";
      if (!n->inputs().empty()) {
        os << " <-";
        for (const auto& in : n->inputs()) os << " %" << id[in.get()];
      }
    }
    if (auto g = fusion.group.find(n.get()); g != fusion.group.end())
      os << "  {group " << g->second << (fusion.scratch_only[n.get()] ? ", scratch}" : "}");
    if (n->deferred())
      for (const auto& c : nodes)
        if (!c->materialized() && std::find(c->inputs().begin(), c->inputs().end(), n) != c->inputs().end())
          os << "  {in row blocks of %" << id[c.get()] << "}";
    for (const auto& r : roots)
      if (r == n) {
        os << "  (output)";
        break;
      }
    os << "\n";
  }
  return os.str();
}

LAZYTENSOR_INLINE std::string graph_dot(const std::vector<graph::NodePtr>& roots) {
  detail::Fusion fusion;
  auto nodes = detail::with_inputs(roots, &fusion);
  std::unordered_map<const graph::Node*, int> id;
  for (const auto& n : nodes) id.emplace(n.get(), static_cast<int>(id.size()));
  std::ostringstream os;
  os << "digraph lazytensor {\n  rankdir=TB;\n  node [shape=box, fontname=\"monospace\"];\n";
  for (const auto& n : nodes) {
    std::string label = n->materialized() ? "data" : n->op_name() + "\\n" + n->describe();
    std::string esc;
    for (char c : label) {
      if (c == '"') esc += "\\\"";
      else esc += c;
    }
    const bool out = std::find(roots.begin(), roots.end(), n) != roots.end();
    auto g = fusion.group.find(n.get());
    if (g != fusion.group.end()) os << "  subgraph cluster_" << g->second << " { label=\"fused group " << g->second << "\";";
    os << "  n" << id[n.get()] << " [label=\"%" << id[n.get()] << " " << esc << "\\n" << detail::type_str(*n) << "\""
       << (n->materialized() ? ", style=dashed" : "") << (g != fusion.group.end() && fusion.scratch_only[n.get()] ? ", style=dotted" : "")
       << (out ? ", peripheries=2" : "") << "];" << (g != fusion.group.end() ? " }" : "") << "\n";
  }
  for (const auto& n : nodes)
    if (!n->materialized())
      for (const auto& in : n->inputs())
        os << "  n" << id[in.get()] << " -> n" << id[n.get()] << (in->deferred() ? " [style=bold]" : "") << ";\n";
  os << "}\n";
  return os.str();
}
#endif  // LAZYTENSOR_HEADER_DEFINITIONS

}  // namespace lazy::debug
// ---- end lazytensor/debug/graph_dump.hpp ----
// ---- begin lazytensor/dist.hpp ----
// lazy::dist and lazy::runtime: replicas as threads (spawn), runtime queries, tensor
// collectives (all_reduce, all_gather, reduce_scatter, all_to_all, broadcast) and host-side
// ones (barrier, rendezvous, mesh_reduce, broadcast_object), as torch_xla's xmp.spawn,
// torch_xla.runtime and xla_model; optimizer_step and the device loaders (ParallelLoader,
// MpDeviceLoader) of data-parallel training.

// ---- begin lazytensor/dist/collectives.hpp ----
// Tensor collectives, as torch_xla's xla_model: all_reduce, all_gather, reduce_scatter,
// all_to_all, broadcast. Each call is lazy: it adds a pending node to the replica's graph
// (and takes the group's next sequence number, in program order); the exchange runs at
// mark_step or when a result is read, in program order among the replica's collectives.
// Inside spawn, inputs must live on the replica's own device. Outside spawn the world is
// one replica and every collective is local.

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

// ---- begin lazytensor/dist/collective_node.hpp ----
// Collectives in the graph. A tensor collective is two kinds of node:
//  - an ExchangeNode, which runs one round of its group's exchange and computes every
//    output of the collective (several for a coalesced all_reduce); its own value is an
//    empty token, so chaining exchanges in program order holds no data alive;
//  - one ResultNode per output, which takes its buffer from the exchange (no copy).
// An exchange that fails is nevertheless done (it never joins its group again with a
// sequence number the others have moved past): it keeps the error, and its result nodes
// re-throw it whenever they are read.

#include <array>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <string>
#include <utility>
#include <vector>

// ---- begin lazytensor/dist/context.hpp ----
// A replica thread's context (its world, ordinal, per-group sequence numbers, its last
// traced collective) and the capture of a collective call at trace time.
//
// Sequence numbers are assigned when a collective is traced, in program order, one counter
// per (replica, group). Tensor collectives run later (mark_step or a read), possibly on
// another thread, so everything they need is captured in a CollectiveCall. Each traced
// exchange takes the previous, still pending one as an extra input: a replica's collectives
// run in program order whatever order its graph is walked in, and the context keeps the
// last one registered with the device, so mark_step runs it even when no handle reaches
// its result (a collective skipped on one replica would leave the others waiting).

#include <algorithm>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

// ---- begin lazytensor/dist/group_comm.hpp ----
// The shared-memory exchange of one replica group (threads backend).
//
// A round (one collective, sequence number s of this group) goes:
//   1. publish: each member writes its signature and data pointers (or, for small
//      messages, a copy of its data) into its slot, then sets `arrived = s`;
//   2. start: once every member arrived, the round starts (an atomic `started = s`, so
//      that a member giving up on a timeout or an abort can withdraw only while nobody has
//      started; a round that started always completes);
//   3. check: every member compares every signature and throws CollectiveMismatch when
//      one differs, before touching any data;
//   4. work: each member reads the others' data (always in rank order) and writes outputs;
//   5. done: when members read each other's buffers (not copies), each sets `done = s` and
//      waits for all, so no buffer is freed or reused while another member reads it.
// Slots are double-buffered by the parity of s: a member can only reach round s + 2 after
// every member arrived at s + 1, i.e. finished reading round s, so copied (inline) data
// needs no step 5 and a small collective costs one synchronization.
//
// Waiting: spin, then yield, then sleep on the world's event (world.hpp, wait_budget).
// Only step 2 gives up (abort, a partner that exited, timeout); once a round started
// every member is inside it doing bounded memory work, so steps 4-5 never give up (giving
// up there could free memory a partner is still reading).

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

// ---- begin lazytensor/dist/signature.hpp ----
// Replica groups and collective signatures.
//
// Groups: a list of equal-size lists of replica ordinals that partitions the world (every
// replica exactly once), as torch_xla's `groups`; empty means one group of everyone. The
// order inside a group is the data order (all_gather concatenates in it, reductions combine
// in it).
//
// Signature: what a replica says it is doing at a given sequence number of its group. Every
// participant compares all of them before touching any data; a difference is a
// CollectiveMismatch on every participant.

#include <bit>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

// ---- begin lazytensor/dist/reduce_op.hpp ----
// Reduction operators of the collectives (xm.REDUCE_SUM, ...) and the element kernels that
// combine replica inputs.
//
// Semantics, per dtype:
//  - float, double: Sum, Mul, Min, Max; Min/Max propagate NaN (torch.minimum/maximum).
//  - bfloat16: as float, accumulated in float and rounded once at the end.
//  - int32, int64: Sum and Mul wrap around on overflow (two's complement, as torch);
//    And/Or are bitwise; Min, Max.
//  - bool: And/Or are logical; Sum acts as Or and Mul as And, as torch.distributed treats
//    bool tensors (the result stays bool); Min = And, Max = Or.
//  - `scale` multiplies the reduced value (in float for float/bfloat16, in double for
//    double); integral and bool tensors accept scale 1 only (DTypeError otherwise), since
//    the scaled value could not be stored in them.
// Inputs are always combined in rank order, ((x0 op x1) op x2) ..., element by element, so
// the result does not depend on timing and is the same on every replica.

#include <algorithm>
#include <cstdint>
#include <string>
#include <type_traits>


namespace lazy {

/// Reduction of an all_reduce / reduce_scatter (xm.REDUCE_SUM, REDUCE_MUL, ...).
enum class ReduceOp { Sum, Mul, And, Or, Min, Max };

/// Lower-case name ("sum", "mul", ...).
std::string reduce_op_name(ReduceOp op);

namespace dist::detail {

/// Throws DTypeError when `op` or `scale` does not apply to element type T (see the file
/// comment); `where` names the collective.
template <Element T>
void check_reduction(ReduceOp op, double scale, const char* where) {
  const std::string what = std::string(where) + "(" + reduce_op_name(op) + ") on a " +
                           dtype_name(dtype_of<T>()) + " tensor";
  if constexpr (is_floating_v<T>) {
    if (op == ReduceOp::And || op == ReduceOp::Or) {
      throw DTypeError(what + ": and/or need an integral or bool tensor (found a floating dtype)");
    }
  } else if (scale != 1.0) {
    throw DTypeError(what + ": scale must be 1 for integral and bool tensors, got " +
                     std::to_string(scale));
  }
}

/// Type in which values of T are combined.
template <Element T>
using accum_t = std::conditional_t<std::is_same_v<T, bool>, std::uint8_t, compute_t<T>>;

/// acc = acc op x for one element (the op is a template argument so the loops vectorize).
template <ReduceOp Op, class A>
inline A combine(A acc, A x) {
  if constexpr (std::is_same_v<A, std::uint8_t>) {  // bool stored as 0/1 bytes
    if constexpr (Op == ReduceOp::Sum || Op == ReduceOp::Or || Op == ReduceOp::Max)
      return acc | x;
    else
      return acc & x;
  } else if constexpr (std::is_integral_v<A>) {
    using U = std::make_unsigned_t<A>;  // wrap-around without undefined behaviour
    if constexpr (Op == ReduceOp::Sum)
      return static_cast<A>(static_cast<U>(acc) + static_cast<U>(x));
    else if constexpr (Op == ReduceOp::Mul)
      return static_cast<A>(static_cast<U>(acc) * static_cast<U>(x));
    else if constexpr (Op == ReduceOp::And)
      return acc & x;
    else if constexpr (Op == ReduceOp::Or)
      return acc | x;
    else if constexpr (Op == ReduceOp::Min)
      return std::min(acc, x);
    else
      return std::max(acc, x);
  } else {
    if constexpr (Op == ReduceOp::Sum)
      return acc + x;
    else if constexpr (Op == ReduceOp::Mul)
      return acc * x;
    // NaN wins: keep acc when it is NaN or smaller, else take x (NaN or not).
    else if constexpr (Op == ReduceOp::Min)
      return (acc < x || acc != acc) ? acc : x;
    else
      return (acc > x || acc != acc) ? acc : x;  // Max (And/Or rejected for floats)
  }
}

template <Element T>
inline accum_t<T> load_acc(const T* p, std::int64_t i) {
  if constexpr (std::is_same_v<T, bool>)
    return reinterpret_cast<const std::uint8_t*>(p)[i];
  else
    return static_cast<accum_t<T>>(p[i]);
}

/// out[i] = (in[0][i] op in[1][i] op ... op in[n-1][i]) * scale for i in [0, len), in rank
/// order. Blocks of 512 elements keep the accumulator in L1 while each input streams by.
/// With `Stream` (float/double, `out` batch-aligned), results bypass the cache: a large
/// output cannot stay there anyway, and it saves reading each line before writing it.
template <Element T, ReduceOp Op, bool Stream = false>
void reduce_span_op(T* out, const T* const* in, int n, std::int64_t len, double scale) {
  using A = accum_t<T>;
  constexpr std::int64_t kBlock = 512;
  alignas(64) A acc[kBlock];
  const A s = static_cast<A>(scale);  // only used by floating types (check_reduction)
  const bool scaled = scale != 1.0;
  for (std::int64_t b = 0; b < len; b += kBlock) {
    const std::int64_t m = std::min(kBlock, len - b);
    const T* first = in[0] + b;
    for (std::int64_t i = 0; i < m; ++i) acc[i] = load_acc(first, i);
    for (int j = 1; j < n; ++j) {
      const T* x = in[j] + b;
      for (std::int64_t i = 0; i < m; ++i) acc[i] = combine<Op>(acc[i], load_acc(x, i));
    }
    T* o = out + b;
    if constexpr (Stream) {
      using B = expr::batch_t<T>;
      constexpr std::int64_t W = B::size;
      std::int64_t i = 0;
      if (scaled) {
        for (; i + W <= m; i += W) expr::stream_store<T>(o + i, B::load_aligned(acc + i) * B(s));
      } else {
        for (; i + W <= m; i += W) expr::stream_store<T>(o + i, B::load_aligned(acc + i));
      }
      for (; i < m; ++i) o[i] = scaled ? acc[i] * s : acc[i];
    } else if constexpr (std::is_same_v<T, bool>) {
      auto* ob = reinterpret_cast<std::uint8_t*>(o);
      for (std::int64_t i = 0; i < m; ++i) ob[i] = acc[i];
    } else if constexpr (is_floating_v<T>) {
      if (scaled) {
        for (std::int64_t i = 0; i < m; ++i) o[i] = static_cast<T>(acc[i] * s);
      } else {
        for (std::int64_t i = 0; i < m; ++i) o[i] = static_cast<T>(acc[i]);
      }
    } else {
      for (std::int64_t i = 0; i < m; ++i) o[i] = acc[i];
    }
  }
}

template <Element T, ReduceOp Op>
void reduce_span_dispatch(T* out, const T* const* in, int n, std::int64_t len, double scale,
                          bool stream) {
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double>) {
    if (stream && reinterpret_cast<std::uintptr_t>(out) % sizeof(expr::batch_t<T>) == 0) {
      reduce_span_op<T, Op, true>(out, in, n, len, scale);
      expr::store_fence();
      return;
    }
  }
  reduce_span_op<T, Op>(out, in, n, len, scale);
}

/// Runtime-op entry of reduce_span_op; `stream` asks for non-temporal stores (honoured for
/// float and double outputs that are batch-aligned).
template <Element T>
void reduce_span(ReduceOp op, T* out, const T* const* in, int n, std::int64_t len, double scale,
                 bool stream = false) {
  if (len <= 0) return;
  switch (op) {
    case ReduceOp::Sum:
      return reduce_span_dispatch<T, ReduceOp::Sum>(out, in, n, len, scale, stream);
    case ReduceOp::Mul:
      return reduce_span_dispatch<T, ReduceOp::Mul>(out, in, n, len, scale, stream);
    case ReduceOp::Min:
      return reduce_span_dispatch<T, ReduceOp::Min>(out, in, n, len, scale, stream);
    case ReduceOp::Max:
      return reduce_span_dispatch<T, ReduceOp::Max>(out, in, n, len, scale, stream);
    case ReduceOp::And:
    case ReduceOp::Or:
      if constexpr (!is_floating_v<T>) {
        return op == ReduceOp::And ? reduce_span_op<T, ReduceOp::And>(out, in, n, len, scale)
                                   : reduce_span_op<T, ReduceOp::Or>(out, in, n, len, scale);
      }
      break;
  }
}

}  // namespace dist::detail
}  // namespace lazy

#if LAZYTENSOR_HEADER_DEFINITIONS
namespace lazy {
LAZYTENSOR_INLINE std::string reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum:
      return "sum";
    case ReduceOp::Mul:
      return "mul";
    case ReduceOp::And:
      return "and";
    case ReduceOp::Or:
      return "or";
    case ReduceOp::Min:
      return "min";
    case ReduceOp::Max:
      return "max";
  }
  return "?";
}
}  // namespace lazy
#endif  // LAZYTENSOR_HEADER_DEFINITIONS
// ---- end lazytensor/dist/reduce_op.hpp ----

namespace lazy::dist {

/// Replica groups, as torch_xla's `groups=[[0, 1], [2, 3]]`.
using Groups = std::vector<std::vector<int>>;

namespace detail {

/// "[0, 1, 2]".
std::string list_str(const std::vector<int>& v);

std::string groups_str(const Groups& g);

/// The group of `ordinal` in `groups` (validated: a partition of [0, world) into lists of
/// equal size). Throws CollectiveError naming the problem.
std::vector<int> resolve_group(const Groups& groups, int world, int ordinal, const char* op);

/// What a collective is.
enum class CollectiveKind : std::uint8_t {
  AllReduce,
  AllGather,
  ReduceScatter,
  AllToAll,
  Broadcast,
  Barrier,
  Rendezvous,
  MeshReduce,
  BroadcastObject
};

const char* kind_name(CollectiveKind k);

/// Everything replicas must agree on for one collective (data sizes of host-side payloads
/// excepted: those may differ).
struct Signature {
  CollectiveKind kind = CollectiveKind::Barrier;
  ReduceOp op = ReduceOp::Sum;         ///< reductions only
  DType dtype = DType::Float32;        ///< tensor collectives only
  int tensors = 0;                     ///< number of tensors (coalesced all_reduce: several)
  Shape shape;                         ///< the first tensor's shape
  std::uint64_t shapes_hash = 0;       ///< every tensor's shape
  std::int64_t params[3] = {0, 0, 0};  ///< dim, scatter/split/concat dims and counts, src
  double scale = 1.0;
  std::shared_ptr<const std::vector<int>> group;  ///< this replica's group, in data order
  std::string tag;                                ///< host collectives: name, tag or value type

  friend bool operator==(const Signature& a, const Signature& b) {
    return a.kind == b.kind && a.op == b.op && a.dtype == b.dtype && a.tensors == b.tensors &&
           a.shape == b.shape && a.shapes_hash == b.shapes_hash && a.params[0] == b.params[0] &&
           a.params[1] == b.params[1] && a.params[2] == b.params[2] &&
           std::bit_cast<std::uint64_t>(a.scale) == std::bit_cast<std::uint64_t>(b.scale) &&
           a.tag == b.tag && (a.group == b.group || (a.group && b.group && *a.group == *b.group));
  }

  /// "all_reduce(op=sum, dtype=float32, shape=(4,), scale=1, group=[0, 1])".
  std::string str() const;
};

/// Hash of a list of shapes (order-sensitive).
std::uint64_t shapes_hash(const std::vector<Shape>& shapes);

}  // namespace detail
}  // namespace lazy::dist

#if LAZYTENSOR_HEADER_DEFINITIONS
namespace lazy::dist::detail {
LAZYTENSOR_INLINE std::string list_str(const std::vector<int>& v) {
  std::string s = "[";
  for (std::size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s + "]";
}

LAZYTENSOR_INLINE std::string groups_str(const Groups& g) {
  std::string s = "[";
  for (std::size_t i = 0; i < g.size(); ++i) s += (i ? ", " : "") + list_str(g[i]);
  return s + "]";
}

LAZYTENSOR_INLINE std::vector<int> resolve_group(const Groups& groups, int world, int ordinal,
                                                 const char* op) {
  if (groups.empty()) {
    std::vector<int> all(static_cast<std::size_t>(world));
    for (int i = 0; i < world; ++i) all[static_cast<std::size_t>(i)] = i;
    return all;
  }
  const std::string where = std::string(op) + ": invalid groups " + groups_str(groups) +
                            " for a world of " + std::to_string(world) + " replica(s): ";
  std::vector<int> seen(static_cast<std::size_t>(world), 0);
  const std::size_t size = groups.front().size();
  const std::vector<int>* mine = nullptr;
  for (const auto& g : groups) {
    if (g.empty()) throw CollectiveError(where + "a group is empty");
    if (g.size() != size) {
      throw CollectiveError(where + "groups must have equal sizes, found " + std::to_string(size) +
                            " and " + std::to_string(g.size()));
    }
    for (int r : g) {
      if (r < 0 || r >= world) {
        throw CollectiveError(where + "replica " + std::to_string(r) + " is out of range [0, " +
                              std::to_string(world) + ")");
      }
      if (seen[static_cast<std::size_t>(r)]++) {
        throw CollectiveError(where + "replica " + std::to_string(r) + " appears more than once");
      }
      if (r == ordinal) mine = &g;
    }
  }
  for (int r = 0; r < world; ++r) {
    if (!seen[static_cast<std::size_t>(r)]) {
      throw CollectiveError(where + "replica " + std::to_string(r) +
                            " is in no group (groups must cover every replica)");
    }
  }
  return *mine;
}

LAZYTENSOR_INLINE const char* kind_name(CollectiveKind k) {
  switch (k) {
    case CollectiveKind::AllReduce:
      return "all_reduce";
    case CollectiveKind::AllGather:
      return "all_gather";
    case CollectiveKind::ReduceScatter:
      return "reduce_scatter";
    case CollectiveKind::AllToAll:
      return "all_to_all";
    case CollectiveKind::Broadcast:
      return "broadcast";
    case CollectiveKind::Barrier:
      return "barrier";
    case CollectiveKind::Rendezvous:
      return "rendezvous";
    case CollectiveKind::MeshReduce:
      return "mesh_reduce";
    case CollectiveKind::BroadcastObject:
      return "broadcast_object";
  }
  return "?";
}

LAZYTENSOR_INLINE std::string Signature::str() const {
  std::string s = std::string(kind_name(kind)) + "(";
  auto num = [](double v) {
    std::string t = std::to_string(v);
    t.erase(t.find_last_not_of('0') + 1);
    if (!t.empty() && t.back() == '.') t.pop_back();
    return t;
  };
  switch (kind) {
    case CollectiveKind::AllReduce:
    case CollectiveKind::ReduceScatter:
      s += "op=" + reduce_op_name(op) + ", ";
      break;
    default:
      break;
  }
  if (tensors > 0) {
    s += "dtype=" + dtype_name(dtype) + ", ";
    s += tensors == 1 ? "shape=" + shape.str()
                      : std::to_string(tensors) + " tensors, first shape=" + shape.str();
    s += ", ";
  }
  switch (kind) {
    case CollectiveKind::AllReduce:
      s += "scale=" + num(scale) + ", ";
      break;
    case CollectiveKind::AllGather:
      s += "dim=" + std::to_string(params[0]) + ", ";
      break;
    case CollectiveKind::ReduceScatter:
      s += "scale=" + num(scale) + ", scatter_dim=" + std::to_string(params[0]) +
           ", shard_count=" + std::to_string(params[1]) + ", ";
      break;
    case CollectiveKind::AllToAll:
      s += "split_dimension=" + std::to_string(params[0]) +
           ", concat_dimension=" + std::to_string(params[1]) +
           ", split_count=" + std::to_string(params[2]) + ", ";
      break;
    case CollectiveKind::Broadcast:
    case CollectiveKind::BroadcastObject:
      s += "src=" + std::to_string(params[0]) + ", ";
      break;
    default:
      break;
  }
  if (!tag.empty()) s += "'" + tag + "', ";
  s += "group=" + (group ? list_str(*group) : std::string("[]"));
  return s + ")";
}

LAZYTENSOR_INLINE std::uint64_t shapes_hash(const std::vector<Shape>& shapes) {
  std::uint64_t h = 1469598103934665603ull;
  auto mix = [&](std::uint64_t v) { h = (h ^ v) * 1099511628211ull; };
  for (const auto& s : shapes) {
    mix(static_cast<std::uint64_t>(s.rank()) + 0x100);
    for (auto d : s) mix(static_cast<std::uint64_t>(d));
  }
  return h;
}
}  // namespace lazy::dist::detail
#endif  // LAZYTENSOR_HEADER_DEFINITIONS
// ---- end lazytensor/dist/signature.hpp ----
// ---- begin lazytensor/dist/world.hpp ----
// The world of replicas: where this process's replicas sit among all of them, which ones
// are still running, the shared abort flag, the collective timeout, and the one event every
// blocked replica sleeps on (so an abort or an exit can wake them all).

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#if defined(__SSE2__)
#include <immintrin.h>
#endif


namespace lazy::dist {

namespace detail {

/// Default collective timeout: LAZYTENSOR_COLLECTIVE_TIMEOUT (seconds, may be fractional),
/// else 300 s. A malformed value is an error when a collective first needs it.
std::chrono::milliseconds env_collective_timeout();

/// The timeout in milliseconds; 0 means "not read from the environment yet".
inline std::atomic<std::int64_t>& timeout_ms() {
  static std::atomic<std::int64_t> ms{0};
  return ms;
}

inline void cpu_relax() {
#if defined(__SSE2__)
  _mm_pause();
#else
  std::this_thread::yield();
#endif
}

}  // namespace detail

/// How long a replica waits in a collective for the others before CollectiveTimeout.
std::chrono::milliseconds collective_timeout();

/// Sets the collective timeout for every replica of this process (default 300 s, or
/// LAZYTENSOR_COLLECTIVE_TIMEOUT seconds). Takes effect at the next wait.
void set_collective_timeout(std::chrono::milliseconds t);

namespace detail {

/// Where this process's replica threads sit in the world. The threads backend has one
/// process holding every replica; an MPI backend has several processes, each with
/// `process_replicas` threads: global ordinal = process_offset + local replica index.
struct WorldLayout {
  int world_size = 1;        ///< replicas in the world, every process
  int process_offset = 0;    ///< global ordinal of this process's first replica
  int process_replicas = 1;  ///< replica threads in this process
  int host_offset = 0;       ///< ordinal on this host of this process's first replica
  int host_replicas = 1;     ///< replicas on this host, every process on it
};

/// A sleep/wake point for blocked replicas. Waiters spin first (the caller does), then
/// sleep here; whoever changes state that a waiter may be waiting for calls notify().
/// Both sides update `sleepers_` with a read-modify-write: either the notifier's RMW comes
/// later in its order and sees the sleeper, or the sleeper's RMW reads from the notifier's
/// and so sees the state it published before; a wake-up cannot be lost. Sleeps are also
/// capped at 100 ms as a second line of defence.
class Event {
 public:
  /// Wakes the sleepers, if any (cheap when nobody sleeps).
  void notify();
  /// Sleeps until pred() holds or `deadline` passes; returns pred().
  template <class Pred>
  bool wait_until(Pred&& pred, std::chrono::steady_clock::time_point deadline) {
    std::unique_lock lock(mu_);
    sleepers_.fetch_add(1, std::memory_order_acq_rel);
    while (!pred()) {
      const auto now = std::chrono::steady_clock::now();
      if (now >= deadline) break;
      cv_.wait_until(lock, std::min(deadline, now + std::chrono::milliseconds(100)));
    }
    sleepers_.fetch_sub(1, std::memory_order_relaxed);
    return pred();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::atomic<int> sleepers_{0};
};

/// How a waiter waits before it sleeps on the world's event: it spins for `spin`, then
/// checks between yields of its core for `yield`.
struct WaitBudget {
  std::chrono::nanoseconds spin{0};
  std::chrono::nanoseconds yield{0};
};

/// The wait budget of a world of `replicas` replica threads. A collective's partners
/// usually arrive within a microsecond or two, and a futex round trip costs more than that:
/// spin first. A partner can also be late by a good part of a step; sleeping then costs the
/// wake-up latency, which on a virtual machine (an idle vCPU halts and the host must
/// schedule it again) reaches tens to hundreds of microseconds, and in a synchronous step
/// both replicas pay it at the round's final barrier. So, while replicas fit the hardware
/// threads, the waiter yields its core for up to 2 ms before sleeping: anything else
/// runnable (the replica's tracing thread) still runs, and the waiter notices the partner
/// at once. Measured with 2 replicas training the benchmark MLP on the 2-core VM: a median
/// of 8% more samples/s than spinning 20 us and sleeping (5 alternating runs, 1.5-19%). When
/// replicas outnumber the hardware threads, waiting would only steal time from the replica being
/// waited for (it may not be running at all), so the budget is a short spin and no yielding.
WaitBudget wait_budget(int replicas);

/// Waits within `budget` (spinning, then yielding) until pred() holds (true) or the budget
/// is spent (false).
template <class Pred>
bool spin_until(Pred&& pred, WaitBudget budget) {
  const auto start = std::chrono::steady_clock::now();
  for (int i = 1;; ++i) {
    if (pred()) return true;
    cpu_relax();
    if ((i & 31) == 0 && std::chrono::steady_clock::now() - start >= budget.spin) break;
  }
  if (budget.yield.count() > 0) {
    const auto until = std::chrono::steady_clock::now() + budget.yield;
    do {
      if (pred()) return true;
      std::this_thread::yield();
    } while (std::chrono::steady_clock::now() < until);
  }
  return pred();
}

/// Shared state of one world: replica lifecycle, abort flag and first failure, the event.
class WorldState {
 public:
  explicit WorldState(WorldLayout layout);

  const WorldLayout& layout() const { return layout_; }
  Event& event() { return event_; }
  /// How waiters wait before sleeping (see wait_budget).
  WaitBudget wait() const { return wait_; }

  /// True once any replica failed: every waiter must give up with ReplicaAborted.
  bool aborted() const { return aborted_.load(std::memory_order_acquire); }

  /// Records that replica `ordinal` failed with `e`; the first failure is kept (and
  /// re-thrown by spawn) and aborts the world. Returns true for the first failure.
  bool fail(int ordinal, std::exception_ptr e);
  /// The first failure (null when none).
  std::exception_ptr first_error() const;
  /// "replica 2 failed: <what>", for ReplicaAborted messages.
  std::string abort_reason() const;

  /// Marks replica `ordinal` as gone (its function returned or threw): collectives that
  /// wait for it fail at once instead of timing out.
  void mark_exited(int ordinal);
  bool exited(int ordinal) const {
    return exited_[static_cast<std::size_t>(ordinal)].load(std::memory_order_acquire);
  }

 private:
  WorldLayout layout_;
  std::vector<std::atomic<bool>> exited_;
  WaitBudget wait_;
  Event event_;
  std::atomic<bool> aborted_{false};
  mutable std::mutex mu_;
  std::exception_ptr error_;  // guarded by mu_
  int failed_ordinal_ = -1;   // guarded by mu_
  std::string failure_;       // guarded by mu_
};

}  // namespace detail
}  // namespace lazy::dist

#if LAZYTENSOR_HEADER_DEFINITIONS
namespace lazy::dist::detail {
LAZYTENSOR_INLINE std::chrono::milliseconds env_collective_timeout() {
  const char* env = std::getenv("LAZYTENSOR_COLLECTIVE_TIMEOUT");
  if (!env || !*env) return std::chrono::seconds(300);
  char* end = nullptr;
  const double s = std::strtod(env, &end);
  if (end == env || *end != '\0' || !(s > 0) || s > 1e9) {
    throw Error(std::string("LAZYTENSOR_COLLECTIVE_TIMEOUT='") + env +
                "' is not a number of seconds > 0 (expected e.g. 300 or 0.5)");
  }
  return std::chrono::milliseconds(
      std::max<std::int64_t>(1, static_cast<std::int64_t>(s * 1000.0)));
}
}  // namespace lazy::dist::detail

namespace lazy::dist {
LAZYTENSOR_INLINE std::chrono::milliseconds collective_timeout() {
  auto& ms = detail::timeout_ms();
  std::int64_t v = ms.load(std::memory_order_relaxed);
  if (v == 0) {
    v = detail::env_collective_timeout().count();
    std::int64_t expected = 0;
    if (!ms.compare_exchange_strong(expected, v)) v = expected;  // set_collective_timeout won
  }
  return std::chrono::milliseconds(v);
}

LAZYTENSOR_INLINE void set_collective_timeout(std::chrono::milliseconds t) {
  if (t.count() <= 0) {
    throw Error("set_collective_timeout: the timeout must be > 0 ms, got " +
                std::to_string(t.count()) + " ms");
  }
  detail::timeout_ms().store(t.count());
}
}  // namespace lazy::dist

namespace lazy::dist::detail {
LAZYTENSOR_INLINE void Event::notify() {
  if (sleepers_.fetch_add(0, std::memory_order_acq_rel) > 0) {
    std::lock_guard lock(mu_);
    cv_.notify_all();
  }
}

LAZYTENSOR_INLINE WaitBudget wait_budget(int replicas) {
  const int hw = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  if (replicas <= hw) return {std::chrono::microseconds(20), std::chrono::milliseconds(2)};
  return {std::chrono::microseconds(1), std::chrono::nanoseconds(0)};
}

LAZYTENSOR_INLINE WorldState::WorldState(WorldLayout layout)
    : layout_(layout),
      exited_(static_cast<std::size_t>(layout.world_size)),
      wait_(wait_budget(layout.process_replicas)) {}

LAZYTENSOR_INLINE bool WorldState::fail(int ordinal, std::exception_ptr e) {
  bool first = false;
  {
    std::lock_guard lock(mu_);
    if (!error_) {
      error_ = e;
      failed_ordinal_ = ordinal;
      failure_ = lazy::detail::exception_message(e);
      first = true;
    }
  }
  aborted_.store(true, std::memory_order_release);
  event_.notify();
  return first;
}

LAZYTENSOR_INLINE std::exception_ptr WorldState::first_error() const {
  std::lock_guard lock(mu_);
  return error_;
}

LAZYTENSOR_INLINE std::string WorldState::abort_reason() const {
  std::lock_guard lock(mu_);
  if (!error_) return "the world was aborted";
  if (failed_ordinal_ < 0) return "spawn failed: " + failure_;
  return "replica " + std::to_string(failed_ordinal_) + " failed: " + failure_;
}

LAZYTENSOR_INLINE void WorldState::mark_exited(int ordinal) {
  exited_[static_cast<std::size_t>(ordinal)].store(true, std::memory_order_release);
  event_.notify();
}
}  // namespace lazy::dist::detail
#endif  // LAZYTENSOR_HEADER_DEFINITIONS
// ---- end lazytensor/dist/world.hpp ----

namespace lazy::dist::detail {

/// Messages up to this many bytes per member are copied into the slot (one synchronization);
/// larger ones are read in place from the members' buffers (two synchronizations).
inline constexpr std::size_t kInlineBytes = std::size_t{16} << 10;

/// Rounds `n` up to a multiple of 64 (offsets inside a slot's staging area).
constexpr std::size_t align64(std::size_t n) { return (n + 63) / 64 * 64; }

/// What one member shares in one round.
struct Share {
  Signature sig;
  std::vector<const std::byte*> data;            ///< per tensor or payload: where its bytes are
  std::vector<std::size_t> bytes;                ///< payload sizes (host collectives)
  std::vector<std::shared_ptr<Buffer>> buffers;  ///< shared outputs, broadcast source
  std::vector<std::byte> staging;                ///< copies of small messages

  /// A staging area of at least `n` bytes (allocated once, then reused).
  std::byte* stage(std::size_t n);
};

/// One group's exchange: its members (sorted global ordinals), their slots, the round state.
class GroupComm {
 public:
  GroupComm(std::shared_ptr<WorldState> world, std::vector<int> members);

  int size() const { return static_cast<int>(members_.size()); }
  /// Members, sorted by ordinal (slot i belongs to members()[i]).
  const std::vector<int>& members() const { return members_; }
  /// Slot of replica `ordinal` (-1 when not a member).
  int slot_of(int ordinal) const { return slot_of_[static_cast<std::size_t>(ordinal)]; }
  WorldState& world() { return *world_; }

  /// Read access to every member's share of round s.
  class Round {
   public:
    Round(const GroupComm& c, std::uint64_t s) : c_(c), s_(s) {}
    const Share& operator[](int slot) const {
      return c_.slots_[static_cast<std::size_t>(slot)].round[s_ & 1];
    }

   private:
    const GroupComm& c_;
    std::uint64_t s_;
  };

  /// Runs round `s` for member `me`: publish(Share&) fills this member's share,
  /// work(const Round&) runs once every member published matching signatures. With
  /// `read_in_place`, members read each other's buffers, so the round ends with a barrier.
  template <class Publish, class Work>
  void exchange(int me, std::uint64_t s, const Signature& sig, Publish&& publish, Work&& work,
                bool read_in_place) {
    WorldState& w = *world_;
    if (w.aborted()) {
      throw ReplicaAborted(prefix(me, s, sig) + "aborted because " + w.abort_reason());
    }
    if (state_.load(std::memory_order_acquire) & kBroken) throw_broken(me, s, sig);
    // Read before publishing: once this member arrived it may only leave through withdraw().
    const std::chrono::milliseconds timeout = collective_timeout();
    Slot& slot = slots_[static_cast<std::size_t>(me)];
    Share& mine = slot.round[s & 1];
    mine.sig = sig;
    publish(mine);
    slot.arrived.store(s, std::memory_order_seq_cst);
    w.event().notify();
    await_start(me, s, sig, timeout);
    const Round round(*this, s);
    check_signatures(round, me, s);
    if (!read_in_place) {
      work(round);
      return;
    }
    try {
      work(round);
    } catch (...) {
      finish(me, s);
      throw;
    }
    finish(me, s);
  }

 private:
  static constexpr std::uint64_t kBroken = std::uint64_t{1} << 63;
  enum class Failure { Timeout, Exited, Aborted };

  struct alignas(64) Slot {
    std::atomic<std::uint64_t> arrived{0};  ///< last round this member published
    std::atomic<std::uint64_t> done{0};     ///< last round this member finished reading
    alignas(64) Share round[2];
  };

  std::string prefix(int me, std::uint64_t s, const Signature& sig) const;

  bool all_arrived(std::uint64_t s) const;
  /// A member that has not arrived at round s and whose replica has exited, else -1.
  int exited_partner(std::uint64_t s) const;
  std::string missing(std::uint64_t s) const;

  void await_start(int me, std::uint64_t s, const Signature& sig,
                   std::chrono::milliseconds timeout);

  void start(int me, std::uint64_t s, const Signature& sig);

  /// Gives up on round s unless it already started. Returns true when it had started (the
  /// caller must take part); otherwise marks the group broken and throws.
  bool withdraw(int me, std::uint64_t s, const Signature& sig, Failure why,
                const std::string& reason);

  [[noreturn]] void throw_broken(int me, std::uint64_t s, const Signature& sig);

  [[noreturn]] static void raise(Failure why, const std::string& msg);

  /// Throws CollectiveMismatch (on every member: they all see the same signatures) when
  /// the members' signatures differ, naming the replicas that diverged from the majority.
  void check_signatures(const Round& round, int me, std::uint64_t s) const;

  /// Step 5: this member is done reading; wait until every member is, then drop the
  /// references this member shared.
  void finish(int me, std::uint64_t s);

  std::shared_ptr<WorldState> world_;
  std::vector<int> members_;
  std::vector<int> slot_of_;
  std::unique_ptr<Slot[]> slots_;
  std::atomic<std::uint64_t> state_{0};  ///< last started round, | kBroken once unusable
  std::mutex broken_mu_;
  Failure broken_kind_ = Failure::Timeout;  // guarded by broken_mu_
  std::string broken_reason_;               // guarded by broken_mu_
};

}  // namespace lazy::dist::detail

#if LAZYTENSOR_HEADER_DEFINITIONS
namespace lazy::dist::detail {
LAZYTENSOR_INLINE std::byte* Share::stage(std::size_t n) {
  if (staging.size() < n) staging.resize(std::max(n, kInlineBytes));
  return staging.data();
}

LAZYTENSOR_INLINE GroupComm::GroupComm(std::shared_ptr<WorldState> world, std::vector<int> members)
    : world_(std::move(world)),
      members_(std::move(members)),
      slot_of_(static_cast<std::size_t>(world_->layout().world_size), -1),
      slots_(std::make_unique<Slot[]>(members_.size())) {
  for (std::size_t i = 0; i < members_.size(); ++i)
    slot_of_[static_cast<std::size_t>(members_[i])] = static_cast<int>(i);
}

LAZYTENSOR_INLINE std::string GroupComm::prefix(int me, std::uint64_t s,
                                                const Signature& sig) const {
  return "replica " + std::to_string(members_[static_cast<std::size_t>(me)]) + ": " + sig.str() +
         " (collective #" + std::to_string(s) + " of group " + list_str(members_) + "): ";
}

LAZYTENSOR_INLINE bool GroupComm::all_arrived(std::uint64_t s) const {
  for (std::size_t j = 0; j < members_.size(); ++j) {
    if (slots_[j].arrived.load(std::memory_order_acquire) < s) return false;
  }
  return true;
}

LAZYTENSOR_INLINE int GroupComm::exited_partner(std::uint64_t s) const {
  for (std::size_t j = 0; j < members_.size(); ++j) {
    if (slots_[j].arrived.load(std::memory_order_acquire) < s && world_->exited(members_[j]))
      return members_[j];
  }
  return -1;
}

LAZYTENSOR_INLINE std::string GroupComm::missing(std::uint64_t s) const {
  std::string m;
  for (std::size_t j = 0; j < members_.size(); ++j) {
    const std::uint64_t a = slots_[j].arrived.load(std::memory_order_acquire);
    if (a >= s) continue;
    if (!m.empty()) m += ", ";
    m += "replica " + std::to_string(members_[j]) +
         (a ? " (last joined collective #" + std::to_string(a) + ")" : " (joined none yet)");
  }
  return m;
}

LAZYTENSOR_INLINE void GroupComm::await_start(int me, std::uint64_t s, const Signature& sig,
                                              std::chrono::milliseconds timeout) {
  WorldState& w = *world_;
  if (!spin_until([&] { return all_arrived(s); }, w.wait())) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    for (;;) {
      if (all_arrived(s)) break;
      if (state_.load(std::memory_order_acquire) & kBroken) break;  // start() reports it
      const int gone = exited_partner(s);
      if (w.aborted()) {
        if (withdraw(me, s, sig, Failure::Aborted, "aborted because " + w.abort_reason())) break;
      } else if (gone >= 0) {
        if (withdraw(me, s, sig, Failure::Exited,
                     "replica " + std::to_string(gone) +
                         " exited (its function returned) without joining this collective")) {
          break;
        }
      } else if (std::chrono::steady_clock::now() >= deadline) {
        const double secs = static_cast<double>(timeout.count()) / 1000.0;
        std::string t = std::to_string(secs);
        t.erase(t.find_last_not_of('0') + 1);
        if (t.back() == '.') t.pop_back();
        if (withdraw(me, s, sig, Failure::Timeout,
                     "timed out after " + t + " s waiting for " + missing(s) +
                         " (set the limit with lazy::dist::set_collective_timeout or "
                         "LAZYTENSOR_COLLECTIVE_TIMEOUT seconds)")) {
          break;
        }
      }
      w.event().wait_until(
          [&] {
            return all_arrived(s) || (state_.load(std::memory_order_acquire) & kBroken) ||
                   w.aborted() || exited_partner(s) >= 0;
          },
          deadline);
    }
  }
  start(me, s, sig);
}

LAZYTENSOR_INLINE void GroupComm::start(int me, std::uint64_t s, const Signature& sig) {
  std::uint64_t expected = s - 1;
  if (state_.compare_exchange_strong(expected, s, std::memory_order_acq_rel)) return;
  if ((expected & ~kBroken) >= s) return;  // another member started it
  throw_broken(me, s, sig);
}

LAZYTENSOR_INLINE bool GroupComm::withdraw(int me, std::uint64_t s, const Signature& sig,
                                           Failure why, const std::string& reason) {
  std::unique_lock lock(broken_mu_);
  std::uint64_t expected = s - 1;
  if (state_.compare_exchange_strong(expected, (s - 1) | kBroken, std::memory_order_acq_rel)) {
    broken_kind_ = why;
    broken_reason_ =
        "replica " + std::to_string(members_[static_cast<std::size_t>(me)]) + " " + reason;
    lock.unlock();
    world_->event().notify();
    raise(why, prefix(me, s, sig) + reason);
  }
  if ((expected & ~kBroken) >= s) return true;
  lock.unlock();
  throw_broken(me, s, sig);
}

LAZYTENSOR_INLINE void GroupComm::throw_broken(int me, std::uint64_t s, const Signature& sig) {
  std::lock_guard lock(broken_mu_);
  const std::string msg =
      prefix(me, s, sig) + "the group can no longer be used: " + broken_reason_;
  raise(broken_kind_, msg);
}

LAZYTENSOR_INLINE void GroupComm::raise(Failure why, const std::string& msg) {
  switch (why) {
    case Failure::Timeout:
      throw CollectiveTimeout(msg);
    case Failure::Aborted:
      throw ReplicaAborted(msg);
    case Failure::Exited:
      break;
  }
  throw CollectiveError(msg);
}

LAZYTENSOR_INLINE void GroupComm::check_signatures(const Round& round, int me,
                                                   std::uint64_t s) const {
  const int n = size();
  bool same = true;
  for (int j = 1; j < n && same; ++j) same = round[j].sig == round[0].sig;
  if (same) return;
  // Classes of equal signatures; the largest (ties: the one holding the lowest ordinal)
  // is the reference, every other class diverged.
  std::vector<int> cls(static_cast<std::size_t>(n), -1);
  std::vector<std::vector<int>> classes;
  for (int j = 0; j < n; ++j) {
    if (cls[static_cast<std::size_t>(j)] >= 0) continue;
    cls[static_cast<std::size_t>(j)] = static_cast<int>(classes.size());
    classes.push_back({j});
    for (int k = j + 1; k < n; ++k) {
      if (cls[static_cast<std::size_t>(k)] < 0 && round[k].sig == round[j].sig) {
        cls[static_cast<std::size_t>(k)] = cls[static_cast<std::size_t>(j)];
        classes.back().push_back(k);
      }
    }
  }
  std::size_t ref = 0;
  for (std::size_t c = 1; c < classes.size(); ++c) {
    if (classes[c].size() > classes[ref].size()) ref = c;
  }
  auto who = [&](const std::vector<int>& slots) {
    std::string w = slots.size() == 1 ? "replica " : "replicas ";
    for (std::size_t i = 0; i < slots.size(); ++i) {
      w += (i ? ", " : "") + std::to_string(members_[static_cast<std::size_t>(slots[i])]);
    }
    return w;
  };
  std::string msg = "replica " + std::to_string(members_[static_cast<std::size_t>(me)]) +
                    ": collective mismatch at collective #" + std::to_string(s) + " of group " +
                    list_str(members_) + ": ";
  for (std::size_t c = 0; c < classes.size(); ++c) {
    if (c == ref) continue;
    msg += who(classes[c]) + " issued " + round[classes[c].front()].sig.str() + "; ";
  }
  msg += who(classes[ref]) + " issued " + round[classes[ref].front()].sig.str();
  throw CollectiveMismatch(msg);
}

LAZYTENSOR_INLINE void GroupComm::finish(int me, std::uint64_t s) {
  Slot& slot = slots_[static_cast<std::size_t>(me)];
  slot.done.store(s, std::memory_order_seq_cst);
  WorldState& w = *world_;
  w.event().notify();
  auto all_done = [&] {
    for (std::size_t j = 0; j < members_.size(); ++j) {
      if (slots_[j].done.load(std::memory_order_acquire) < s) return false;
    }
    return true;
  };
  bool ready = spin_until(all_done, w.wait());
  while (!ready) {
    ready = w.event().wait_until(all_done,
                                 std::chrono::steady_clock::now() + std::chrono::seconds(1));
  }
  slot.round[s & 1].buffers.clear();
}
}  // namespace lazy::dist::detail
#endif  // LAZYTENSOR_HEADER_DEFINITIONS
// ---- end lazytensor/dist/group_comm.hpp ----

namespace lazy::dist::detail {

/// A world of replicas (threads backend): its shared state and its groups' exchanges.
class World {
 public:
  explicit World(WorldLayout layout);
  WorldState& state() { return *state_; }

  /// The exchange of the group with these members (sorted), created on first use.
  std::shared_ptr<GroupComm> comm(const std::vector<int>& members);

 private:
  std::shared_ptr<WorldState> state_;
  std::mutex mu_;
  std::map<std::vector<int>, std::shared_ptr<GroupComm>> comms_;
};

/// State of one replica thread, reachable through current_context() while spawn runs it.
struct ReplicaContext {
  struct Channel {
    std::shared_ptr<GroupComm> comm;
    std::uint64_t next_seq = 1;
  };

  ReplicaContext(std::shared_ptr<World> w, int local_index)
      : world(std::move(w)),
        local(local_index),
        ordinal(world->state().layout().process_offset + local_index) {}

  std::shared_ptr<World> world;
  int local;    ///< replica index inside this process (= its device index)
  int ordinal;  ///< global ordinal
  std::map<std::vector<int>, Channel> channels;         ///< by sorted members
  std::shared_ptr<const std::vector<int>> world_group;  ///< [0, world) (cached)
  Channel* world_channel = nullptr;                     ///< its channel (cached)
  std::shared_ptr<graph::TensorImpl> last;  ///< last traced exchange, registered with the device

  Channel& channel(const std::vector<int>& sorted_members);
};

/// This thread's replica context (null outside spawn: a world of one).
inline ReplicaContext*& current_context() {
  thread_local ReplicaContext* ctx = nullptr;
  return ctx;
}

/// Everything an exchange needs when it runs, captured when it is traced.
struct CollectiveCall {
  std::shared_ptr<GroupComm> comm;  ///< null for a group of one (nothing to exchange)
  int slot = 0;                     ///< this replica's slot in comm
  int rank = 0;                     ///< this replica's position in its group (data order)
  std::vector<int> slot_of_rank;    ///< slot of each group position
  std::uint64_t seq = 0;            ///< sequence number in the group
  Signature sig;

  int size() const { return comm ? comm->size() : 1; }
};

/// Captures a collective whose group is `group` (ordinals in data order, containing this
/// replica): takes the group's next sequence number.
CollectiveCall capture(Signature sig, std::shared_ptr<const std::vector<int>> group);

/// World size and this thread's ordinal.
inline int world_size_now() {
  ReplicaContext* ctx = current_context();
  return ctx ? ctx->world->state().layout().world_size : 1;
}
inline int ordinal_now() {
  ReplicaContext* ctx = current_context();
  return ctx ? ctx->ordinal : 0;
}

/// The group of this replica for `groups`, validated (no sequence number taken yet).
std::shared_ptr<const std::vector<int>> group_of(const Groups& groups, const char* op);

/// Captures a host-side collective among `replicas` (empty: everyone), which must hold
/// this replica and no ordinal twice; they take part in ascending ordinal order.
CollectiveCall capture_among(Signature sig, std::vector<int> replicas, const char* op);

/// The replica's last traced exchange when it is still pending (the next one runs after it).
inline graph::NodePtr pending_predecessor() {
  ReplicaContext* ctx = current_context();
  if (!ctx || !ctx->last || !ctx->last->node || ctx->last->node->materialized()) return nullptr;
  return ctx->last->node;
}

/// Makes `exchange` the replica's last traced collective (see the file comment).
void remember(const graph::NodePtr& exchange);

/// Runs this replica's pending collectives (and what they need): host-side collectives and
/// a replica's exit do this first, so every replica executes its collectives in program
/// order.
inline void flush_pending() {
  if (graph::NodePtr n = pending_predecessor()) graph::materialize(n);
}

/// A replica's exit: runs its pending collectives, waits for its device's steps and
/// re-throws an error one of them stored, so that no failure (a collective mismatch seen by
/// a step that ran inline or on the executor) ends unseen with its replica.
void finish_replica();

}  // namespace lazy::dist::detail

#if LAZYTENSOR_HEADER_DEFINITIONS
namespace lazy::dist::detail {
LAZYTENSOR_INLINE World::World(WorldLayout layout) : state_(std::make_shared<WorldState>(layout)) {}

LAZYTENSOR_INLINE std::shared_ptr<GroupComm> World::comm(const std::vector<int>& members) {
  std::lock_guard lock(mu_);
  auto& c = comms_[members];
  if (!c) c = std::make_shared<GroupComm>(state_, members);
  return c;
}

LAZYTENSOR_INLINE ReplicaContext::Channel& ReplicaContext::channel(
    const std::vector<int>& sorted_members) {
  auto& ch = channels[sorted_members];
  if (!ch.comm) ch.comm = world->comm(sorted_members);
  return ch;
}

LAZYTENSOR_INLINE CollectiveCall capture(Signature sig,
                                         std::shared_ptr<const std::vector<int>> group) {
  ReplicaContext* ctx = current_context();
  const int me = ctx ? ctx->ordinal : 0;
  CollectiveCall call;
  const auto& g = *group;
  call.rank = static_cast<int>(std::find(g.begin(), g.end(), me) - g.begin());
  sig.group = std::move(group);
  call.sig = std::move(sig);
  if (g.size() == 1) return call;
  ReplicaContext::Channel* ch = nullptr;
  if (ctx->world_channel && ctx->world_group && (g.data() == ctx->world_group->data())) {
    ch = ctx->world_channel;
  } else {
    std::vector<int> sorted = g;
    std::sort(sorted.begin(), sorted.end());
    ch = &ctx->channel(sorted);
  }
  call.comm = ch->comm;
  call.seq = ch->next_seq++;
  call.slot = call.comm->slot_of(me);
  call.slot_of_rank.resize(g.size());
  for (std::size_t k = 0; k < g.size(); ++k) call.slot_of_rank[k] = call.comm->slot_of(g[k]);
  return call;
}

LAZYTENSOR_INLINE std::shared_ptr<const std::vector<int>> group_of(const Groups& groups,
                                                                   const char* op) {
  ReplicaContext* ctx = current_context();
  if (!groups.empty() || !ctx) {
    return std::make_shared<const std::vector<int>>(
        resolve_group(groups, world_size_now(), ordinal_now(), op));
  }
  if (!ctx->world_group) {
    const int n = world_size_now();
    auto all = std::make_shared<std::vector<int>>(static_cast<std::size_t>(n));
    for (int i = 0; i < n; ++i) (*all)[static_cast<std::size_t>(i)] = i;
    ctx->world_group = std::move(all);
    if (n > 1) ctx->world_channel = &ctx->channel(*ctx->world_group);
  }
  return ctx->world_group;
}

LAZYTENSOR_INLINE CollectiveCall capture_among(Signature sig, std::vector<int> replicas,
                                               const char* op) {
  if (replicas.empty()) return capture(std::move(sig), group_of({}, op));
  const int world = world_size_now(), me = ordinal_now();
  std::sort(replicas.begin(), replicas.end());
  const std::string where = std::string(op) + ": invalid replicas " + list_str(replicas) + ": ";
  for (std::size_t i = 0; i < replicas.size(); ++i) {
    if (replicas[i] < 0 || replicas[i] >= world) {
      throw CollectiveError(where + "replica " + std::to_string(replicas[i]) +
                            " is out of range [0, " + std::to_string(world) + ")");
    }
    if (i && replicas[i] == replicas[i - 1]) {
      throw CollectiveError(where + "replica " + std::to_string(replicas[i]) +
                            " appears more than once");
    }
  }
  if (!std::binary_search(replicas.begin(), replicas.end(), me)) {
    throw CollectiveError(where + "the calling replica " + std::to_string(me) +
                          " is not among them");
  }
  return capture(std::move(sig), std::make_shared<const std::vector<int>>(std::move(replicas)));
}

LAZYTENSOR_INLINE void remember(const graph::NodePtr& exchange) {
  ReplicaContext* ctx = current_context();
  if (!ctx) return;
  if (!ctx->last) {
    ctx->last = std::make_shared<graph::TensorImpl>(exchange);
    exchange->device()->register_handle(ctx->last);
  } else {
    ctx->last->node = exchange;
  }
}

LAZYTENSOR_INLINE void finish_replica() {
  flush_pending();
  graph::Device& dev = graph::current_device();
  dev.wait_idle();
  dev.rethrow_stored_error();
}
}  // namespace lazy::dist::detail
#endif  // LAZYTENSOR_HEADER_DEFINITIONS
// ---- end lazytensor/dist/context.hpp ----

namespace lazy::dist::detail {

/// The shared empty value of every exchange node.
const std::shared_ptr<Buffer>& token_buffer();

/// One round of a group exchange, computing every output of a collective (one per input).
class ExchangeNode : public graph::Node {
 public:
  /// `data` are the collective's inputs; `after` (may be null) is the replica's previous
  /// pending exchange, which must run first.
  ExchangeNode(CollectiveCall call, std::vector<graph::NodePtr> data, const graph::NodePtr& after,
               graph::Device* device);

  std::string op_name() const override { return kind_name(call_.sig.kind); }
  std::string describe() const override;
  double cost_per_element() const override { return 0; }

  /// Lets the exchange drop output `i` at once when its result node is gone.
  void watch(std::size_t i, const graph::NodePtr& result) { results_[i] = result; }
  /// Hands output `i` to its result node; re-throws the exchange's error if it failed.
  std::shared_ptr<Buffer> take(std::size_t i) {
    if (failure_) std::rethrow_exception(failure_);
    return std::move(outputs_[i]);
  }
  const CollectiveCall& call() const { return call_; }

 protected:
  void compute(graph::ExecContext& ctx) final;
  void finish() override;

  /// Runs the exchange; returns one buffer per output.
  virtual std::vector<std::shared_ptr<Buffer>> run(graph::ExecContext& ctx) = 0;

  std::size_t data_count() const { return data_count_; }
  const graph::NodePtr& data(std::size_t i) const { return inputs()[i]; }
  const std::byte* bytes(std::size_t i) const {
    return static_cast<const std::byte*>(inputs()[i]->buffer()->data());
  }

  static std::shared_ptr<Buffer> allocate(graph::ExecContext& ctx, std::int64_t numel,
                                          std::size_t elem) {
    return ctx.device.pool().acquire(padded_bytes(numel, elem));
  }

 private:
  static std::vector<graph::NodePtr> with_after(std::vector<graph::NodePtr> data,
                                                const graph::NodePtr& after);

  CollectiveCall call_;
  std::size_t data_count_;
  std::vector<std::shared_ptr<Buffer>> outputs_;
  std::vector<std::weak_ptr<graph::Node>> results_;
  std::exception_ptr failure_;
};

/// Output `index` of an exchange.
class ResultNode final : public graph::Node {
 public:
  ResultNode(const std::shared_ptr<ExchangeNode>& ex, std::size_t index, DType dtype, Shape shape);
  std::string op_name() const override {
    return kind_name(static_cast<const ExchangeNode&>(*inputs()[0]).call().sig.kind);
  }
  double cost_per_element() const override { return 0; }

 protected:
  void compute(graph::ExecContext&) override {
    set_buffer(static_cast<ExchangeNode&>(*inputs()[0]).take(index_));
  }

 private:
  std::size_t index_;
};

/// dtype and shape of one output.
struct OutputSpec {
  DType dtype;
  Shape shape;
};

/// The device a collective's nodes go to: inside spawn, the replica's own device (its
/// inputs must live there); outside, the inputs' common device.
graph::Device& collective_device(const std::vector<graph::NodePtr>& inputs, const char* op);

/// Submits an exchange and its result nodes (in this order, so eager mode works); returns
/// the result nodes.
std::vector<graph::NodePtr> submit_exchange(const std::shared_ptr<ExchangeNode>& ex,
                                            const std::vector<OutputSpec>& outs);

/// Up to 16 pointers without allocating (one per group member).
template <class T>
class PtrList {
 public:
  explicit PtrList(std::size_t n) : n_(n) {
    if (n > small_.size()) big_.resize(n);
  }
  T*& operator[](std::size_t i) { return n_ > small_.size() ? big_[i] : small_[i]; }
  T* const* data() const { return n_ > small_.size() ? big_.data() : small_.data(); }

 private:
  std::size_t n_;
  std::array<T*, 16> small_{};
  std::vector<T*> big_;
};

}  // namespace lazy::dist::detail

#if LAZYTENSOR_HEADER_DEFINITIONS
namespace lazy::dist::detail {
LAZYTENSOR_INLINE const std::shared_ptr<Buffer>& token_buffer() {
  static const std::shared_ptr<Buffer> tok = std::make_shared<Buffer>(
      ::operator new(kBufferAlign, std::align_val_t(kBufferAlign)), kBufferAlign, nullptr);
  return tok;
}

LAZYTENSOR_INLINE ExchangeNode::ExchangeNode(CollectiveCall call, std::vector<graph::NodePtr> data,
                                             const graph::NodePtr& after, graph::Device* device)
    : Node(graph::NodeKind::Collective, DType::Bool, Shape{0}, device,
           with_after(std::move(data), after)),
      call_(std::move(call)),
      data_count_(inputs().size() - (after ? 1 : 0)),
      outputs_(data_count_),
      results_(data_count_) {}

LAZYTENSOR_INLINE std::string ExchangeNode::describe() const {
  return call_.sig.str() + (call_.comm ? " #" + std::to_string(call_.seq) : std::string());
}

LAZYTENSOR_INLINE void ExchangeNode::compute(graph::ExecContext& ctx) {
  std::vector<std::shared_ptr<Buffer>> outs;
  try {
    outs = run(ctx);
  } catch (...) {
    // Done for good: the exchange never runs again (its group has moved on); the
    // error goes to whoever reads a result.
    failure_ = std::current_exception();
    set_buffer(token_buffer());
    finish();
    throw;
  }
  for (std::size_t i = 0; i < outs.size(); ++i) {
    if (results_[i].expired()) outs[i].reset();
  }
  outputs_ = std::move(outs);
  set_buffer(token_buffer());
}

LAZYTENSOR_INLINE void ExchangeNode::finish() {
  Node::finish();
  call_.comm.reset();
}

LAZYTENSOR_INLINE std::vector<graph::NodePtr> ExchangeNode::with_after(
    std::vector<graph::NodePtr> data, const graph::NodePtr& after) {
  if (after) data.push_back(after);
  return data;
}

LAZYTENSOR_INLINE ResultNode::ResultNode(const std::shared_ptr<ExchangeNode>& ex, std::size_t index,
                                         DType dtype, Shape shape)
    : Node(graph::NodeKind::Collective, dtype, shape, ex->device(), {ex}), index_(index) {}

LAZYTENSOR_INLINE graph::Device& collective_device(const std::vector<graph::NodePtr>& inputs,
                                                   const char* op) {
  if (!current_context()) return graph::common_device(inputs, op);
  graph::Device& dev = graph::current_device();
  for (const auto& in : inputs) {
    if (in->device() != &dev) {
      throw DeviceError(std::string(op) + ": replica " + std::to_string(ordinal_now()) +
                        " expected its tensors on its own device " + dev.str() + ", found one on " +
                        in->device()->str());
    }
  }
  return dev;
}

LAZYTENSOR_INLINE std::vector<graph::NodePtr> submit_exchange(
    const std::shared_ptr<ExchangeNode>& ex, const std::vector<OutputSpec>& outs) {
  std::vector<graph::NodePtr> results;
  results.reserve(outs.size());
  for (std::size_t i = 0; i < outs.size(); ++i) {
    auto r = std::make_shared<ResultNode>(ex, i, outs[i].dtype, outs[i].shape);
    ex->watch(i, r);
    results.push_back(std::move(r));
  }
  if (ex->call().comm) remember(ex);
  graph::submit(ex);
  for (auto& r : results) graph::submit(r);
  return results;
}
}  // namespace lazy::dist::detail
#endif  // LAZYTENSOR_HEADER_DEFINITIONS
// ---- end lazytensor/dist/collective_node.hpp ----
// ---- begin lazytensor/dist/exchanges.hpp ----
// The exchange kernels of the tensor collectives (threads backend).
//
// Small messages (<= kInlineBytes per member) are copied into the members' slots and every
// member computes its whole output from the copies: one synchronization. Larger ones are
// read in place:
//  - all_reduce: member i reduces slice i of the result, reading every member's input in
//    rank order, into one output buffer shared by the whole group (marked shared, so never
//    donated: no device overwrites what another may still read); nothing is gathered afterwards
//    and the result is bitwise identical everywhere by construction;
//  - all_gather: each member copies its input into its block of a shared output;
//  - reduce_scatter, all_to_all: each member reads its part of every input;
//  - broadcast: every member's output is the source's buffer (no copy at all; marked shared).

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <utility>
#include <vector>


namespace lazy::dist::detail {

/// Copies a `shape` block of `es`-byte elements between two strided layouts (strides in
/// elements), one memcpy per run of the longest suffix contiguous in both.
void copy_block(std::byte* dst, const std::array<std::int64_t, kMaxRank>& dstr,
                const std::byte* src, const std::array<std::int64_t, kMaxRank>& sstr,
                const Shape& shape, std::size_t es);

/// Publishes this member's inputs: copies into the slot when `copied`, else pointers.
void publish_inputs(Share& s, const std::vector<const std::byte*>& in,
                    const std::vector<std::size_t>& nbytes, bool copied);

/// all_reduce of one or several tensors of type T (coalesced: one round for all of them).
template <Element T>
class AllReduceExchange final : public ExchangeNode {
 public:
  AllReduceExchange(CollectiveCall call, std::vector<graph::NodePtr> data,
                    const graph::NodePtr& after, graph::Device* device, ReduceOp op, double scale)
      : ExchangeNode(std::move(call), std::move(data), after, device), op_(op), scale_(scale) {}

 protected:
  std::vector<std::shared_ptr<Buffer>> run(graph::ExecContext& ctx) override {
    const CollectiveCall& c = call();
    const std::size_t k = data_count();
    std::vector<std::shared_ptr<Buffer>> outs(k);
    if (c.size() == 1) {
      for (std::size_t i = 0; i < k; ++i) {
        if (scale_ == 1.0) {
          outs[i] = data(i)->buffer();  // x op nothing = x: share the immutable input
          continue;
        }
        outs[i] = allocate(ctx, data(i)->numel(), sizeof(T));
        const T* in = data(i)->template data<T>();
        reduce_span<T>(op_, static_cast<T*>(outs[i]->data()), &in, 1, data(i)->numel(), scale_);
      }
      return outs;
    }
    std::vector<std::int64_t> offs(k + 1, 0);  // tensors laid end to end
    std::vector<const std::byte*> in(k);
    std::vector<std::size_t> nbytes(k);
    std::size_t staged = 0;
    for (std::size_t i = 0; i < k; ++i) {
      offs[i + 1] = offs[i] + data(i)->numel();
      in[i] = bytes(i);
      nbytes[i] = static_cast<std::size_t>(data(i)->numel()) * sizeof(T);
      staged += align64(nbytes[i]);
    }
    const bool copied = staged <= kInlineBytes;
    const bool leader = c.slot == 0;
    if (copied || leader) {
      for (std::size_t i = 0; i < k; ++i) outs[i] = allocate(ctx, data(i)->numel(), sizeof(T));
    }
    c.comm->exchange(
        c.slot, c.seq, c.sig,
        [&](Share& s) {
          publish_inputs(s, in, nbytes, copied);
          if (!copied && leader) {
            for (auto& b : outs) b->mark_shared();
            s.buffers = outs;
          }
        },
        [&](const GroupComm::Round& r) {
          if (!copied && !leader) outs = r[0].buffers;
          reduce(ctx, r, outs, offs, copied);
        },
        !copied);
    return outs;
  }

 private:
  /// Reduces elements [b, e) of the end-to-end layout (all of it when `whole`, else this
  /// member's slice), split across the device's workers.
  void reduce(graph::ExecContext& ctx, const GroupComm::Round& r,
              const std::vector<std::shared_ptr<Buffer>>& outs,
              const std::vector<std::int64_t>& offs, bool whole) const {
    const CollectiveCall& c = call();
    const int n = c.size();
    const std::int64_t total = offs.back();
    // (no structured bindings: clang 14 cannot capture them in the lambda below)
    const std::pair<std::int64_t, std::int64_t> range =
        whole ? std::pair<std::int64_t, std::int64_t>{0, total}
              : graph::task_range(total, n, c.slot, 16);
    const std::int64_t b = range.first, e = range.second;
    if (b >= e) return;
    ThreadPool& pool = ctx.device.threads();
    const std::int64_t tasks = graph::task_count(pool, e - b, static_cast<double>(n));
    // When the inputs and the result together are this large, the result cannot stay in
    // cache for its readers anyway: write it around the cache (saves the read for
    // ownership of every output line).
    const bool stream = !whole && (n + 1) * total * static_cast<std::int64_t>(sizeof(T)) >=
                                      expr::kStreamingStoreBytes;
    pool.parallel_for(tasks, [&](std::int64_t t) {
      const auto [tb, te] = graph::task_range(e - b, tasks, t, 16);
      std::int64_t lo = b + tb;
      const std::int64_t hi = b + te;
      auto i = static_cast<std::size_t>(std::upper_bound(offs.begin(), offs.end(), lo) -
                                        offs.begin() - 1);
      PtrList<const T> p(static_cast<std::size_t>(n));
      while (lo < hi) {
        while (offs[i + 1] <= lo) ++i;  // skip empty tensors
        const std::int64_t end = std::min(hi, offs[i + 1]), local = lo - offs[i];
        for (int q = 0; q < n; ++q) {
          p[static_cast<std::size_t>(q)] =
              reinterpret_cast<const T*>(r[c.slot_of_rank[static_cast<std::size_t>(q)]].data[i]) +
              local;
        }
        reduce_span<T>(op_, static_cast<T*>(outs[i]->data()) + local, p.data(), n, end - lo, scale_,
                       stream);
        lo = end;
      }
    });
  }

  ReduceOp op_;
  double scale_;
};

/// all_gather along `dim`: output block q (along dim) is group member q's input.
class AllGatherExchange final : public ExchangeNode {
 public:
  AllGatherExchange(CollectiveCall call, graph::NodePtr in, const graph::NodePtr& after,
                    graph::Device* device, int dim);

 protected:
  std::vector<std::shared_ptr<Buffer>> run(graph::ExecContext& ctx) override;

 private:
  int dim_;
};

/// reduce_scatter: member q gets shard q (along `dim`) of the reduction of every input.
template <Element T>
class ReduceScatterExchange final : public ExchangeNode {
 public:
  ReduceScatterExchange(CollectiveCall call, graph::NodePtr in, const graph::NodePtr& after,
                        graph::Device* device, ReduceOp op, double scale, int dim)
      : ExchangeNode(std::move(call), {std::move(in)}, after, device),
        op_(op),
        scale_(scale),
        dim_(dim) {}

 protected:
  std::vector<std::shared_ptr<Buffer>> run(graph::ExecContext& ctx) override {
    const CollectiveCall& c = call();
    const int n = c.size();
    const std::int64_t numel = data(0)->numel();
    if (n == 1 && scale_ == 1.0) return {data(0)->buffer()};
    const Shape& s = data(0)->shape();
    std::int64_t outer = 1, inner = 1;
    for (int d = 0; d < s.rank(); ++d) {
      if (d < dim_) outer *= s[d];
      if (d > dim_) inner *= s[d];
    }
    const std::int64_t run_len = s[dim_] / n * inner, row = s[dim_] * inner;
    std::vector<std::shared_ptr<Buffer>> outs{allocate(ctx, numel / n, sizeof(T))};
    T* out = static_cast<T*>(outs[0]->data());
    auto reduce_from = [&](auto&& input_of) {
      PtrList<const T> p(static_cast<std::size_t>(n));
      for (std::int64_t o = 0; o < outer; ++o) {
        for (int q = 0; q < n; ++q)
          p[static_cast<std::size_t>(q)] = input_of(q) + o * row + c.rank * run_len;
        reduce_span<T>(op_, out + o * run_len, p.data(), n, run_len, scale_);
      }
    };
    if (n == 1) {
      reduce_from([&](int) { return data(0)->template data<T>(); });
      return outs;
    }
    const std::size_t nbytes = static_cast<std::size_t>(numel) * sizeof(T);
    const bool copied = align64(nbytes) <= kInlineBytes;
    c.comm->exchange(
        c.slot, c.seq, c.sig, [&](Share& sh) { publish_inputs(sh, {bytes(0)}, {nbytes}, copied); },
        [&](const GroupComm::Round& r) {
          reduce_from([&](int q) {
            return reinterpret_cast<const T*>(
                r[c.slot_of_rank[static_cast<std::size_t>(q)]].data[0]);
          });
        },
        !copied);
    return outs;
  }

 private:
  ReduceOp op_;
  double scale_;
  int dim_;
};

/// all_to_all: member r splits its input in n chunks along `split`; member q's output is
/// chunk q of every member, concatenated along `concat` in rank order.
class AllToAllExchange final : public ExchangeNode {
 public:
  AllToAllExchange(CollectiveCall call, graph::NodePtr in, const graph::NodePtr& after,
                   graph::Device* device, int split, int concat);

 protected:
  std::vector<std::shared_ptr<Buffer>> run(graph::ExecContext& ctx) override;

 private:
  int split_, concat_;
};

/// broadcast: every member's output is the source member's input buffer.
class BroadcastExchange final : public ExchangeNode {
 public:
  BroadcastExchange(CollectiveCall call, graph::NodePtr in, const graph::NodePtr& after,
                    graph::Device* device, int src_slot);

 protected:
  std::vector<std::shared_ptr<Buffer>> run(graph::ExecContext&) override;

 private:
  int src_slot_;
};

}  // namespace lazy::dist::detail

#if LAZYTENSOR_HEADER_DEFINITIONS
namespace lazy::dist::detail {
LAZYTENSOR_INLINE void copy_block(std::byte* dst, const std::array<std::int64_t, kMaxRank>& dstr,
                                  const std::byte* src,
                                  const std::array<std::int64_t, kMaxRank>& sstr,
                                  const Shape& shape, std::size_t es) {
  if (shape.numel() == 0) return;
  std::int64_t run = 1;
  int d0 = shape.rank();
  while (d0 > 0 && sstr[d0 - 1] == run && dstr[d0 - 1] == run) run *= shape[--d0];
  std::int64_t count = 1;
  for (int d = 0; d < d0; ++d) count *= shape[d];
  std::array<std::int64_t, kMaxRank> idx{};
  std::int64_t so = 0, dof = 0;
  const std::size_t run_bytes = static_cast<std::size_t>(run) * es;
  for (std::int64_t it = 0; it < count; ++it) {
    std::memcpy(dst + dof * static_cast<std::int64_t>(es), src + so * static_cast<std::int64_t>(es),
                run_bytes);
    for (int d = d0 - 1; d >= 0; --d) {
      so += sstr[d];
      dof += dstr[d];
      if (++idx[d] < shape[d]) break;
      so -= sstr[d] * shape[d];
      dof -= dstr[d] * shape[d];
      idx[d] = 0;
    }
  }
}

LAZYTENSOR_INLINE void publish_inputs(Share& s, const std::vector<const std::byte*>& in,
                                      const std::vector<std::size_t>& nbytes, bool copied) {
  s.data.resize(in.size());
  if (!copied) {
    for (std::size_t i = 0; i < in.size(); ++i) s.data[i] = in[i];
    return;
  }
  std::size_t total = 0;
  for (auto b : nbytes) total += align64(b);
  std::byte* st = s.stage(total);
  for (std::size_t i = 0; i < in.size(); ++i) {
    if (nbytes[i]) std::memcpy(st, in[i], nbytes[i]);
    s.data[i] = st;
    st += align64(nbytes[i]);
  }
}

LAZYTENSOR_INLINE AllGatherExchange::AllGatherExchange(CollectiveCall call, graph::NodePtr in,
                                                       const graph::NodePtr& after,
                                                       graph::Device* device, int dim)
    : ExchangeNode(std::move(call), {std::move(in)}, after, device), dim_(dim) {}

LAZYTENSOR_INLINE std::vector<std::shared_ptr<Buffer>> AllGatherExchange::run(
    graph::ExecContext& ctx) {
  const CollectiveCall& c = call();
  const std::int64_t numel = data(0)->numel();
  if (c.size() == 1) return {data(0)->buffer()};
  const Shape& s = data(0)->shape();
  const std::size_t es = dtype_size(data(0)->dtype());
  const int n = c.size();
  std::int64_t outer = 1, inner = 1;  // input as [outer, inner], output as [outer, n * inner]
  for (int d = 0; d < s.rank(); ++d) (d < dim_ ? outer : inner) *= s[d];
  const std::size_t nbytes = static_cast<std::size_t>(numel) * es;
  const bool copied = align64(nbytes) <= kInlineBytes;
  const bool leader = c.slot == 0;
  std::vector<std::shared_ptr<Buffer>> outs(1);
  if (copied || leader) outs[0] = allocate(ctx, numel * n, es);
  const std::byte* own = bytes(0);
  auto copy_rank = [&](std::byte* out, const std::byte* src, int q) {
    const auto row = static_cast<std::size_t>(inner) * es;
    for (std::int64_t o = 0; o < outer; ++o) {
      std::memcpy(out + (static_cast<std::size_t>(o) * static_cast<std::size_t>(n) +
                         static_cast<std::size_t>(q)) *
                            row,
                  src + static_cast<std::size_t>(o) * row, row);
    }
  };
  c.comm->exchange(
      c.slot, c.seq, c.sig,
      [&](Share& sh) {
        publish_inputs(sh, {own}, {nbytes}, copied);
        if (!copied && leader) {
          outs[0]->mark_shared();
          sh.buffers = outs;
        }
      },
      [&](const GroupComm::Round& r) {
        if (!copied && !leader) outs = r[0].buffers;
        auto* out = static_cast<std::byte*>(outs[0]->data());
        if (!copied) {
          copy_rank(out, own, c.rank);  // each member writes its own block of the shared output
          return;
        }
        for (int q = 0; q < n; ++q)
          copy_rank(out, r[c.slot_of_rank[static_cast<std::size_t>(q)]].data[0], q);
      },
      !copied);
  return outs;
}

LAZYTENSOR_INLINE AllToAllExchange::AllToAllExchange(CollectiveCall call, graph::NodePtr in,
                                                     const graph::NodePtr& after,
                                                     graph::Device* device, int split, int concat)
    : ExchangeNode(std::move(call), {std::move(in)}, after, device),
      split_(split),
      concat_(concat) {}

LAZYTENSOR_INLINE std::vector<std::shared_ptr<Buffer>> AllToAllExchange::run(
    graph::ExecContext& ctx) {
  const CollectiveCall& c = call();
  const int n = c.size();
  if (n == 1) return {data(0)->buffer()};
  const Shape& s = data(0)->shape();
  const std::size_t es = dtype_size(data(0)->dtype());
  Shape chunk = s;
  chunk[split_] = s[split_] / n;
  Shape out_shape = chunk;
  out_shape[concat_] = chunk[concat_] * n;
  const auto sstr = contiguous_strides(s), ostr = contiguous_strides(out_shape);
  std::vector<std::shared_ptr<Buffer>> outs{allocate(ctx, out_shape.numel(), es)};
  auto* out = static_cast<std::byte*>(outs[0]->data());
  const std::size_t nbytes = static_cast<std::size_t>(s.numel()) * es;
  const bool copied = align64(nbytes) <= kInlineBytes;
  const auto ses = static_cast<std::int64_t>(es);
  c.comm->exchange(
      c.slot, c.seq, c.sig, [&](Share& sh) { publish_inputs(sh, {bytes(0)}, {nbytes}, copied); },
      [&](const GroupComm::Round& r) {
        for (int q = 0; q < n; ++q) {
          const std::byte* src = r[c.slot_of_rank[static_cast<std::size_t>(q)]].data[0] +
                                 c.rank * chunk[split_] * sstr[split_] * ses;
          copy_block(out + q * chunk[concat_] * ostr[concat_] * ses, ostr, src, sstr, chunk, es);
        }
      },
      !copied);
  return outs;
}

LAZYTENSOR_INLINE BroadcastExchange::BroadcastExchange(CollectiveCall call, graph::NodePtr in,
                                                       const graph::NodePtr& after,
                                                       graph::Device* device, int src_slot)
    : ExchangeNode(std::move(call), {std::move(in)}, after, device), src_slot_(src_slot) {}

LAZYTENSOR_INLINE std::vector<std::shared_ptr<Buffer>> BroadcastExchange::run(graph::ExecContext&) {
  const CollectiveCall& c = call();
  if (c.size() == 1) return {data(0)->buffer()};
  std::vector<std::shared_ptr<Buffer>> outs(1);
  c.comm->exchange(
      c.slot, c.seq, c.sig,
      [&](Share& sh) {
        if (c.slot == src_slot_) {
          data(0)->buffer()->mark_shared();
          sh.buffers = {data(0)->buffer()};
        }
      },
      [&](const GroupComm::Round& r) { outs[0] = r[src_slot_].buffers[0]; },
      true);  // the source's share holds its buffer until everyone took it
  return outs;
}
}  // namespace lazy::dist::detail
#endif  // LAZYTENSOR_HEADER_DEFINITIONS
// ---- end lazytensor/dist/exchanges.hpp ----

namespace lazy::dist {

/// Options of all_reduce: `scale` multiplies the result (e.g. 1/world_size for a mean),
/// `groups` splits the world into groups reducing separately (empty: one group).
struct AllReduceOptions {
  double scale = 1.0;
  Groups groups = {};
};

namespace detail {

template <Element T>
Signature tensor_signature(CollectiveKind kind, const Tensor<T>& t) {
  Signature sig;
  sig.kind = kind;
  sig.dtype = dtype_of<T>();
  sig.tensors = 1;
  sig.shape = t.shape();
  sig.shapes_hash = shapes_hash({t.shape()});
  return sig;
}

/// Submits exchange `ex` (built by make(after)) and wraps its results as tensors.
template <Element T, class Make>
std::vector<Tensor<T>> trace(CollectiveCall call, Make&& make,
                             const std::vector<OutputSpec>& outs) {
  // Only exchanges that talk to other replicas are chained in program order.
  const graph::NodePtr after = call.comm ? pending_predecessor() : nullptr;
  std::shared_ptr<ExchangeNode> ex = make(std::move(call), after);
  std::vector<Tensor<T>> res;
  for (auto& node : submit_exchange(ex, outs)) res.emplace_back(std::move(node));
  return res;
}

}  // namespace detail

/// All-reduces several tensors in one exchange (coalesced; as xm.all_reduce on a list, but
/// returning new tensors: see all_reduce_ for the in-place form). Every replica of a group
/// gets the bitwise-identical element-wise reduction, combined in group order.
template <Element T>
std::vector<Tensor<T>> all_reduce(ReduceOp op, const std::vector<Tensor<T>>& tensors,
                                  const AllReduceOptions& opts = {}) {
  detail::check_reduction<T>(op, opts.scale, "all_reduce");
  if (tensors.empty()) return {};
  std::vector<graph::NodePtr> nodes;
  std::vector<Shape> shapes;
  std::vector<detail::OutputSpec> outs;
  for (const auto& t : tensors) {
    nodes.push_back(t.node());
    shapes.push_back(t.shape());
    outs.push_back({dtype_of<T>(), t.shape()});
  }
  graph::Device& dev = detail::collective_device(nodes, "all_reduce");
  detail::Signature sig =
      detail::tensor_signature(detail::CollectiveKind::AllReduce, tensors.front());
  sig.op = op;
  sig.tensors = static_cast<int>(tensors.size());
  sig.shapes_hash = detail::shapes_hash(shapes);
  sig.scale = opts.scale;
  auto call = detail::capture(std::move(sig), detail::group_of(opts.groups, "all_reduce"));
  return detail::trace<T>(
      std::move(call),
      [&](detail::CollectiveCall c, const graph::NodePtr& after) {
        return std::make_shared<detail::AllReduceExchange<T>>(std::move(c), std::move(nodes), after,
                                                              &dev, op, opts.scale);
      },
      outs);
}

/// All-reduces one tensor (xm.all_reduce(reduce_type, t, scale, groups)); returns a new
/// tensor. Example: `all_reduce(lazy::ReduceOp::Sum, g, {.scale = 1.0 / world_size()})`.
template <Element T>
Tensor<T> all_reduce(ReduceOp op, const Tensor<T>& t, const AllReduceOptions& opts = {}) {
  return all_reduce(op, std::vector<Tensor<T>>{t}, opts).front();
}

/// In-place all_reduce of a list (one exchange), as xm.all_reduce on a list: every tensor
/// object is rebound to its reduced value, so all handles sharing it see the result.
template <Element T>
void all_reduce_(ReduceOp op, std::vector<Tensor<T>>& tensors, const AllReduceOptions& opts = {}) {
  auto res = all_reduce(op, static_cast<const std::vector<Tensor<T>>&>(tensors), opts);
  for (std::size_t i = 0; i < tensors.size(); ++i) tensors[i].impl()->node = res[i].node();
}

/// In-place all_reduce of one tensor.
template <Element T>
void all_reduce_(ReduceOp op, Tensor<T>& t, const AllReduceOptions& opts = {}) {
  t.impl()->node = all_reduce(op, t, opts).node();
}

/// Concatenates every group member's tensor along `dim`, in group order
/// (xm.all_gather(t, dim, groups)). A 0-dim tensor gathers into shape (group size,).
template <Element T>
Tensor<T> all_gather(const Tensor<T>& t, std::int64_t dim = 0, const Groups& groups = {}) {
  const int d = normalize_dim(dim, t.dim(), "all_gather");
  graph::Device& dev = detail::collective_device({t.node()}, "all_gather");
  auto group = detail::group_of(groups, "all_gather");
  const auto n = static_cast<std::int64_t>(group->size());
  Shape out = t.dim() == 0 ? Shape{n} : t.shape();
  if (t.dim() > 0) {
    out[d] *= n;  // <= 2^60 * replicas: no overflow; the bound is checked next
    out.check_size();
  }
  detail::Signature sig = detail::tensor_signature(detail::CollectiveKind::AllGather, t);
  sig.params[0] = d;
  auto call = detail::capture(std::move(sig), std::move(group));
  return detail::trace<T>(std::move(call),
                          [&](detail::CollectiveCall c, const graph::NodePtr& after) {
                            return std::make_shared<detail::AllGatherExchange>(
                                std::move(c), t.node(), after, &dev, d);
                          },
                          {{dtype_of<T>(), out}})
      .front();
}

/// Reduces every group member's tensor and gives member q shard q along `scatter_dim`
/// (xm.reduce_scatter(op, t, scale, scatter_dim, shard_count, groups)). `shard_count` must
/// equal the group size and divide the size of `scatter_dim`.
template <Element T>
Tensor<T> reduce_scatter(ReduceOp op, const Tensor<T>& t, double scale, std::int64_t scatter_dim,
                         std::int64_t shard_count, const Groups& groups = {}) {
  detail::check_reduction<T>(op, scale, "reduce_scatter");
  if (t.dim() == 0)
    throw ShapeError("reduce_scatter: a 0-dim tensor cannot be scattered (expected rank >= 1)");
  const int d = normalize_dim(scatter_dim, t.dim(), "reduce_scatter");
  graph::Device& dev = detail::collective_device({t.node()}, "reduce_scatter");
  auto group = detail::group_of(groups, "reduce_scatter");
  const auto n = static_cast<std::int64_t>(group->size());
  if (shard_count != n) {
    throw CollectiveError("reduce_scatter: shard_count " + std::to_string(shard_count) +
                          " must equal the group size " + std::to_string(n) + " (group " +
                          detail::list_str(*group) + ")");
  }
  if (t.size(d) % n != 0) {
    throw ShapeError("reduce_scatter: size " + std::to_string(t.size(d)) + " of scatter_dim " +
                     std::to_string(d) + " of a tensor of shape " + t.shape().str() +
                     " is not divisible by shard_count " + std::to_string(n));
  }
  Shape out = t.shape();
  out[d] /= n;
  detail::Signature sig = detail::tensor_signature(detail::CollectiveKind::ReduceScatter, t);
  sig.op = op;
  sig.scale = scale;
  sig.params[0] = d;
  sig.params[1] = shard_count;
  auto call = detail::capture(std::move(sig), std::move(group));
  return detail::trace<T>(std::move(call),
                          [&](detail::CollectiveCall c, const graph::NodePtr& after) {
                            return std::make_shared<detail::ReduceScatterExchange<T>>(
                                std::move(c), t.node(), after, &dev, op, scale, d);
                          },
                          {{dtype_of<T>(), out}})
      .front();
}

/// Splits the tensor in `split_count` chunks along `split_dimension`, sends chunk q to
/// group member q, and concatenates the chunks received along `concat_dimension` in group
/// order (xm.all_to_all). `split_count` must equal the group size and divide the size of
/// `split_dimension`.
template <Element T>
Tensor<T> all_to_all(const Tensor<T>& t, std::int64_t split_dimension,
                     std::int64_t concat_dimension, std::int64_t split_count,
                     const Groups& groups = {}) {
  if (t.dim() == 0)
    throw ShapeError("all_to_all: a 0-dim tensor cannot be split (expected rank >= 1)");
  const int sd = normalize_dim(split_dimension, t.dim(), "all_to_all");
  const int cd = normalize_dim(concat_dimension, t.dim(), "all_to_all");
  graph::Device& dev = detail::collective_device({t.node()}, "all_to_all");
  auto group = detail::group_of(groups, "all_to_all");
  const auto n = static_cast<std::int64_t>(group->size());
  if (split_count != n) {
    throw CollectiveError("all_to_all: split_count " + std::to_string(split_count) +
                          " must equal the group size " + std::to_string(n) + " (group " +
                          detail::list_str(*group) + ")");
  }
  if (t.size(sd) % n != 0) {
    throw ShapeError("all_to_all: size " + std::to_string(t.size(sd)) + " of split_dimension " +
                     std::to_string(sd) + " of a tensor of shape " + t.shape().str() +
                     " is not divisible by split_count " + std::to_string(n));
  }
  Shape out = t.shape();
  out[sd] /= n;
  out[cd] *= n;
  out.check_size();
  detail::Signature sig = detail::tensor_signature(detail::CollectiveKind::AllToAll, t);
  sig.params[0] = sd;
  sig.params[1] = cd;
  sig.params[2] = split_count;
  auto call = detail::capture(std::move(sig), std::move(group));
  return detail::trace<T>(std::move(call),
                          [&](detail::CollectiveCall c, const graph::NodePtr& after) {
                            return std::make_shared<detail::AllToAllExchange>(
                                std::move(c), t.node(), after, &dev, sd, cd);
                          },
                          {{dtype_of<T>(), out}})
      .front();
}

/// Every group member gets replica `src`'s value of `t` (xm.collective_broadcast). All
/// members pass a tensor of the same shape and dtype; `src` is a global ordinal in the
/// caller's group. The result shares the source's buffer (no copy).
template <Element T>
Tensor<T> broadcast(const Tensor<T>& t, int src = 0, const Groups& groups = {}) {
  graph::Device& dev = detail::collective_device({t.node()}, "broadcast");
  auto group = detail::group_of(groups, "broadcast");
  int src_rank = -1;
  for (std::size_t q = 0; q < group->size(); ++q) {
    if ((*group)[q] == src) src_rank = static_cast<int>(q);
  }
  if (src_rank < 0) {
    throw CollectiveError("broadcast: src " + std::to_string(src) + " is not in the group " +
                          detail::list_str(*group) + " of replica " +
                          std::to_string(detail::ordinal_now()));
  }
  detail::Signature sig = detail::tensor_signature(detail::CollectiveKind::Broadcast, t);
  sig.params[0] = src;
  auto call = detail::capture(std::move(sig), std::move(group));
  const int src_slot = call.comm ? call.slot_of_rank[static_cast<std::size_t>(src_rank)] : 0;
  return detail::trace<T>(std::move(call),
                          [&](detail::CollectiveCall c, const graph::NodePtr& after) {
                            return std::make_shared<detail::BroadcastExchange>(
                                std::move(c), t.node(), after, &dev, src_slot);
                          },
                          {{dtype_of<T>(), t.shape()}})
      .front();
}

}  // namespace lazy::dist
// ---- end lazytensor/dist/collectives.hpp ----
// ---- begin lazytensor/dist/host_collectives.hpp ----
// Host-side collectives, as torch_xla's xm.rendezvous / xm.mesh_reduce: they run at once
// on the calling thread (nothing lazy). Each first runs the replica's pending tensor
// collectives, so a replica's collectives of both kinds execute in program order and share
// one sequence per group (a replica that skips one is a CollectiveMismatch, not a hang).
//
// Values travel as bytes: trivially copyable types, std::string, and std::vector of a
// trivially copyable type (the Codec below); the type is part of the signature.

#include <concepts>
#include <cstring>
#include <string>
#include <string_view>
#include <type_traits>
#include <typeinfo>
#include <utility>
#include <vector>


namespace lazy::dist {

namespace detail {

/// Bytes of values of type T (see the file comment for the supported types).
template <class T>
struct Codec {
  static_assert(
      std::is_trivially_copyable_v<T> && std::is_default_constructible_v<T>,
      "lazy::dist host collectives carry trivially copyable values, std::string or std::vector of "
      "trivially copyable values");
  static std::string encode(const T& v) {
    return std::string(reinterpret_cast<const char*>(&v), sizeof(T));
  }
  static T decode(std::string_view b, const std::string& where) {
    if (b.size() != sizeof(T)) {
      throw CollectiveError(where + ": expected " + std::to_string(sizeof(T)) +
                            " bytes, received " + std::to_string(b.size()));
    }
    T v;
    std::memcpy(&v, b.data(), sizeof(T));
    return v;
  }
};

template <>
struct Codec<std::string> {
  static std::string encode(const std::string& v) { return v; }
  static std::string decode(std::string_view b, const std::string&) { return std::string(b); }
};

template <class U>
struct Codec<std::vector<U>> {
  static_assert(std::is_trivially_copyable_v<U> && std::is_default_constructible_v<U>,
                "lazy::dist host collectives carry std::vector of trivially copyable values");
  static std::string encode(const std::vector<U>& v) {
    return std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(U));
  }
  static std::vector<U> decode(std::string_view b, const std::string& where) {
    if (b.size() % sizeof(U) != 0) {
      throw CollectiveError(where + ": received " + std::to_string(b.size()) +
                            " bytes, not a whole number of elements of " +
                            std::to_string(sizeof(U)) + " bytes");
    }
    std::vector<U> v(b.size() / sizeof(U));
    if (!b.empty()) std::memcpy(v.data(), b.data(), b.size());
    return v;
  }
};

template <class T>
std::string type_tag() {
  return std::string(typeid(T).name()) + "/" + std::to_string(sizeof(T));
}

/// Runs a host round: every member publishes `mine`; returns the payloads of the members
/// in ascending ordinal order (only the source's when `src_slot` >= 0).
std::vector<std::string> host_exchange(const CollectiveCall& c, std::string_view mine,
                                       int src_slot = -1);

Signature host_signature(CollectiveKind kind, std::string tag);

}  // namespace detail

/// Blocks until every replica reached a barrier with the same `name` (as xm.rendezvous(tag)
/// without payload). A different name on some replica is a CollectiveMismatch.
void barrier(const std::string& name = "");

/// Exchanges a payload with the other replicas (xm.rendezvous(tag, payload, replicas)):
/// returns every participant's payload in ascending ordinal order. `replicas` (default:
/// all) lists the participants; each of them must call it with the same tag.
std::vector<std::string> rendezvous(const std::string& tag, std::string_view payload = {},
                                    std::vector<int> replicas = {});

/// Gathers every replica's `data` and returns reduce_fn(values), values in ordinal order
/// (xm.mesh_reduce). Every replica gets the same list, so a deterministic reduce_fn gives
/// the same result everywhere. T: see the file comment.
template <class T, class F>
auto mesh_reduce(const std::string& tag, const T& data, F&& reduce_fn) {
  detail::flush_pending();
  auto call = detail::capture(detail::host_signature(detail::CollectiveKind::MeshReduce,
                                                     tag + " <" + detail::type_tag<T>() + ">"),
                              detail::group_of({}, "mesh_reduce"));
  const std::vector<std::string> raw = detail::host_exchange(call, detail::Codec<T>::encode(data));
  std::vector<T> values;
  values.reserve(raw.size());
  for (const auto& r : raw)
    values.push_back(detail::Codec<T>::decode(r, "mesh_reduce('" + tag + "')"));
  return std::forward<F>(reduce_fn)(values);
}

/// Returns replica `src`'s `obj` on every replica. T: see the file comment.
template <class T>
T broadcast_object(const T& obj, int src = 0) {
  detail::flush_pending();
  const int world = detail::world_size_now();
  if (src < 0 || src >= world) {
    throw CollectiveError("broadcast_object: src " + std::to_string(src) + " is out of range [0, " +
                          std::to_string(world) + ")");
  }
  detail::Signature sig =
      detail::host_signature(detail::CollectiveKind::BroadcastObject, detail::type_tag<T>());
  sig.params[0] = src;
  auto call = detail::capture(std::move(sig), detail::group_of({}, "broadcast_object"));
  if (!call.comm) return obj;
  const int src_slot = call.comm->slot_of(src);
  const bool is_src = call.slot == src_slot;
  const std::string mine = is_src ? detail::Codec<T>::encode(obj) : std::string();
  const std::vector<std::string> raw = detail::host_exchange(call, mine, src_slot);
  return detail::Codec<T>::decode(raw.front(), "broadcast_object");
}

}  // namespace lazy::dist

#if LAZYTENSOR_HEADER_DEFINITIONS
namespace lazy::dist::detail {
LAZYTENSOR_INLINE std::vector<std::string> host_exchange(const CollectiveCall& c,
                                                         std::string_view mine, int src_slot) {
  if (!c.comm) return {std::string(mine)};
  std::vector<std::string> out;
  c.comm->exchange(
      c.slot, c.seq, c.sig,
      [&](Share& s) {
        s.data.assign(1, reinterpret_cast<const std::byte*>(mine.data()));
        s.bytes.assign(1, mine.size());
      },
      [&](const GroupComm::Round& r) {
        auto payload = [&](int slot) {
          const Share& s = r[slot];
          return std::string(reinterpret_cast<const char*>(s.data[0]), s.bytes[0]);
        };
        if (src_slot >= 0) {
          out.push_back(payload(src_slot));
          return;
        }
        for (int j = 0; j < c.comm->size(); ++j)
          out.push_back(payload(j));  // slots: ascending ordinals
      },
      true);
  return out;
}

LAZYTENSOR_INLINE Signature host_signature(CollectiveKind kind, std::string tag) {
  Signature sig;
  sig.kind = kind;
  sig.tag = std::move(tag);
  return sig;
}
}  // namespace lazy::dist::detail

namespace lazy::dist {
LAZYTENSOR_INLINE void barrier(const std::string& name) {
  detail::flush_pending();
  auto call = detail::capture(detail::host_signature(detail::CollectiveKind::Barrier, name),
                              detail::group_of({}, "barrier"));
  if (!call.comm) return;
  call.comm->exchange(
      call.slot, call.seq, call.sig, [](detail::Share&) {}, [](const detail::GroupComm::Round&) {},
      false);
}

LAZYTENSOR_INLINE std::vector<std::string> rendezvous(const std::string& tag,
                                                      std::string_view payload,
                                                      std::vector<int> replicas) {
  detail::flush_pending();
  auto call = detail::capture_among(detail::host_signature(detail::CollectiveKind::Rendezvous, tag),
                                    std::move(replicas), "rendezvous");
  return detail::host_exchange(call, payload);
}
}  // namespace lazy::dist
#endif  // LAZYTENSOR_HEADER_DEFINITIONS
// ---- end lazytensor/dist/host_collectives.hpp ----
// ---- begin lazytensor/dist/optimizer_step.hpp ----
// optimizer_step: data-parallel training's gradient averaging, as torch_xla's
// xm.optimizer_step / xm.reduce_gradients.
//
// Gradients are all-reduced in coalesced buckets: consecutive gradients (in parameter
// order) share one exchange until the next one would push the bucket past
// gradient_bucket_bytes() (default 16 MiB; a larger gradient gets a bucket of its own).
// On the threads backend a bucket costs one round of its group whatever it holds (the
// tensors are read in place, nothing is concatenated), so fewer rounds are better; the cap
// bounds what a message-passing backend has to stage. Buckets change which round an
// element travels in, never its value: each element is reduced in group order, so the
// result does not depend on the bucket size.

#include <atomic>
#include <cstddef>
#include <string>
#include <unordered_set>
#include <vector>

// ---- begin lazytensor/tensor/device.hpp ----
// Devices and steps: mark_step/sync, eager mode, step closures, compile, RNG state.

#include <functional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>


namespace lazy {

/// Number of devices of this process (LAZYTENSOR_NUM_DEVICES, default 1).
int device_count();

/// Every device of this process.
std::vector<Device> devices();

/// Device `index` (DeviceError when out of range).
Device device(int index);

/// Makes `d` this thread's current device.
inline void set_device(const Device& d) { graph::current_device_index() = d.index(); }

/// Materializes every pending value that a live tensor handle on the current device (in
/// SPMD mode, lazy::spmd::use_spmd: on every device) can reach, then runs the step closures and advances the device's random stream. A node
/// that no handle reaches is never computed.
///
/// Asynchronous: the step is planned here and handed to the device's executor thread, and
/// mark_step returns while it runs, so the next step can be traced meanwhile. Reading a
/// value (item(), to_vector(), ...) or wait_device_ops() waits for it; the next mark_step
/// waits for the previous one; an error surfaces at the next read or sync.
/// (LAZYTENSOR_ASYNC=0 runs steps on the calling thread.)
void mark_step();

/// Alias of mark_step(), as torch_xla.sync().
inline void sync() { mark_step(); }

/// Waits for every step enqueued on the current device (xm.wait_device_ops), then
/// re-throws an error a step stored. In SPMD mode: on every device.
void wait_device_ops();

/// Sets how many threads the current device's kernels use (as torch::set_num_threads; the
/// default is LAZYTENSOR_NUM_THREADS, else the hardware threads). Waits for the steps in
/// flight first. Error when `n` < 1.
void set_num_threads(int n);

/// The number of threads the current device's kernels use (as torch::get_num_threads).
inline int get_num_threads() { return graph::current_device().threads().size(); }

/// Returns the memory the current device keeps for reuse (the buffers of dropped tensors)
/// to the system, as torch.cuda.empty_cache() does. Live tensors are untouched. The cache
/// is bounded anyway (per device: a quarter of the physical memory, or
/// LAZYTENSOR_POOL_CACHE_BYTES).
inline void empty_cache() { graph::current_device().pool().empty_cache(); }

/// Queues f to run at the end of the next mark_step on the current device, once that step
/// has executed (xm.add_step_closure).
inline void add_step_closure(std::function<void()> f) { graph::current_device().add_step_closure(std::move(f)); }

/// Eager mode: every node runs as soon as it is created (for debugging). Per device.
inline void eager_mode(bool on) { graph::current_device().eager() = on; }
/// Whether eager mode is on for the current device.
inline bool is_eager_mode() { return graph::current_device().eager(); }

/// Wraps f so that each call runs it and then syncs (materializes) everything it left
/// pending, as torch_xla.compile does for a step function.
template <class F>
auto compile(F f) {
  return [f = std::move(f)](auto&&... args) -> decltype(auto) {
    if constexpr (std::is_void_v<decltype(f(std::forward<decltype(args)>(args)...))>) {
      f(std::forward<decltype(args)>(args)...);
      mark_step();
    } else {
      auto result = f(std::forward<decltype(args)>(args)...);
      mark_step();
      return result;
    }
  };
}

/// Seeds the current device's random stream (torch.manual_seed / xm.set_rng_state).
void set_rng_state(std::uint64_t seed);
/// The current device's seed.
inline std::uint64_t get_rng_state() { return graph::current_device().rng().seed; }

}  // namespace lazy

#if LAZYTENSOR_HEADER_DEFINITIONS
namespace lazy {

LAZYTENSOR_INLINE int device_count() {
  static const int n = [] {
    const char* env = std::getenv("LAZYTENSOR_NUM_DEVICES");
    const int v = env ? std::atoi(env) : 1;
    return v > 0 ? v : 1;
  }();
  return n;
}

LAZYTENSOR_INLINE std::vector<Device> devices() {
  std::vector<Device> d;
  for (int i = 0; i < device_count(); ++i) d.emplace_back(i);
  return d;
}

LAZYTENSOR_INLINE Device device(int index) {
  if (index < 0 || index >= device_count()) {
    throw DeviceError("device index " + std::to_string(index) + " out of range: this process has " +
                      std::to_string(device_count()) + " device(s)");
  }
  return Device(index);
}

namespace detail {
/// One device's share of a step: its pending values, then a fresh random stream (as XLA's
/// seed advance after mark_step).
inline void step_device(graph::Device& dev) {
  graph::run_step(dev, graph::collect_step(dev));
  auto& rng = dev.rng();
  rng.seed = graph::hash_combine(rng.seed, 0x9e3779b97f4a7c15ull);
  rng.offset = 0;
}
}  // namespace detail

LAZYTENSOR_INLINE void mark_step() {
  static auto& steps = core::counter("MarkStep");
  graph::Device& dev = graph::current_device();
  steps.add();
  if (graph::step_every_device().load(std::memory_order_acquire)) {
    // SPMD: this thread drives every device. Each device's step is handed to its own
    // executor, so the shards of a statement compute in parallel.
    auto& registry = graph::DeviceRegistry::get();
    const int n = device_count();
    for (int i = 0; i < n; ++i) registry.device(i).rethrow_stored_error();
    for (int i = 0; i < n; ++i) detail::step_device(registry.device(i));
  } else {
    dev.rethrow_stored_error();
    detail::step_device(dev);
  }
  // Closures run once the step has executed (as torch_xla's synchronous step closures), so
  // they see its values; without closures mark_step returns at once.
  auto closures = dev.take_step_closures();
  if (!closures.empty()) dev.wait_idle();
  for (auto& f : closures) f();
}

LAZYTENSOR_INLINE void wait_device_ops() {
  if (graph::step_every_device().load(std::memory_order_acquire)) {
    auto& registry = graph::DeviceRegistry::get();
    for (int i = 0; i < device_count(); ++i) registry.device(i).wait_idle();
    for (int i = 0; i < device_count(); ++i) registry.device(i).rethrow_stored_error();
    return;
  }
  auto& dev = graph::current_device();
  dev.wait_idle();
  dev.rethrow_stored_error();
}

LAZYTENSOR_INLINE void set_num_threads(int n) {
  if (n < 1) throw Error("set_num_threads: expected at least 1 thread, got " + std::to_string(n));
  graph::current_device().set_num_threads(n);
}

LAZYTENSOR_INLINE void set_rng_state(std::uint64_t seed) {
  auto& rng = graph::current_device().rng();
  rng.seed = seed;
  rng.offset = 0;
}

}  // namespace lazy
#endif  // LAZYTENSOR_HEADER_DEFINITIONS
// ---- end lazytensor/tensor/device.hpp ----
// ---- begin lazytensor/optim/optimizer.hpp ----
// Optimizer base, as torch::optim::Optimizer: parameter groups with their own options,
// zero_grad, step, and state_dict / load_state_dict. Parameters may be bfloat16, float or
// double (a module converted with to(dtype)); each is updated, and its state kept, in its
// own dtype. An update is built from lazy
// expressions under NoGradGuard, so the whole training step (forward, backward, update)
// materializes at one mark_step; each state tensor is updated in place (buffer donation
// makes that free), and the learning rate is a scalar in the kernel, so changing it never
// changes the plan.

#include <charconv>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

// ---- begin lazytensor/core/arg.hpp ----
// LAZY_ARG: the option accessors of libtorch's TORCH_ARG, shared by the options structs of
// lazy::optim (SGDOptions, ...) and lazy::nn (Conv2dOptions, ...).

/// Declares an option with a fluent setter and a getter, as libtorch's TORCH_ARG:
/// `SGDOptions(0.1).momentum(0.9)`; `opts.momentum()`. Leaves the access at `private`.
#define LAZY_ARG(T, name)                   \
 public:                                    \
  auto& name(const T& v) {                  \
    name##_ = v;                            \
    return *this;                           \
  }                                         \
  const T& name() const { return name##_; } \
                                            \
 private:                                   \
  T name##_
// ---- end lazytensor/core/arg.hpp ----
// ---- begin lazytensor/ops/factories.hpp ----
// Tensor factories: constants (lazy), ranges and host data (materialized at once).

#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>


namespace lazy {

/// A tensor of `shape` filled with `value` (a lazy node: no memory is touched until used).
template <Element T, expr::Number V>
Tensor<T> full(const Shape& shape, V value, Device dev = device()) {
  using E = Expr<ops::Identity, expr::Scalar<T>>;
  E e(expr::Scalar<T>{static_cast<T>(value)});
  std::vector<graph::NodePtr> none;
  return Tensor<T>(graph::submit(
      graph::elementwise_node<T>(expr::to_kernel(e, none), shape, &dev.engine(), std::vector<graph::NodePtr>{})));
}

/// Zeros of `shape`.
template <Element T>
Tensor<T> zeros(const Shape& shape, Device dev = device()) {
  return full<T>(shape, 0, dev);
}
/// Ones of `shape`.
template <Element T>
Tensor<T> ones(const Shape& shape, Device dev = device()) {
  return full<T>(shape, 1, dev);
}
/// Zeros shaped like `t`.
template <Element T>
Tensor<T> zeros_like(const Tensor<T>& t) {
  return zeros<T>(t.shape(), t.device());
}
/// Ones shaped like `t`.
template <Element T>
Tensor<T> ones_like(const Tensor<T>& t) {
  return ones<T>(t.shape(), t.device());
}

/// Uninitialized memory of `shape` (materialized; contents unspecified).
template <Element T>
Tensor<T> empty(const Shape& shape, Device dev = device()) {
  graph::Device& d = dev.engine();
  return Tensor<T>(std::make_shared<graph::DataNode>(dtype_of<T>(), shape, &d,
                                                     d.pool().acquire(padded_bytes(shape.numel(), sizeof(T)))));
}

/// A tensor holding a copy of `data`, viewed as `shape` (ShapeError if the sizes differ).
template <Element T>
Tensor<T> from_vector(const std::vector<T>& data, const Shape& shape, Device dev = device()) {
  if (static_cast<std::int64_t>(data.size()) != shape.numel()) {
    throw ShapeError("from_vector: shape " + shape.str() + " needs " + std::to_string(shape.numel()) +
                     " elements, got " + std::to_string(data.size()));
  }
  if constexpr (std::is_same_v<T, bool>) {
    std::vector<char> tmp(data.begin(), data.end());  // std::vector<bool> is packed
    return Tensor<T>(detail::data_node<bool>(reinterpret_cast<const bool*>(tmp.data()), shape, dev));
  } else {
    return Tensor<T>(detail::data_node<T>(data.data(), shape, dev));
  }
}

/// A 1-D tensor holding a copy of `data`.
template <Element T>
Tensor<T> from_vector(const std::vector<T>& data) {
  return from_vector<T>(data, Shape{static_cast<std::int64_t>(data.size())}, device());
}

/// A 1-D tensor from a list: tensor<float>({1, 2, 3}).
template <Element T>
Tensor<T> tensor(std::initializer_list<T> values, Device dev = device()) {
  return from_vector<T>(std::vector<T>(values), Shape{static_cast<std::int64_t>(values.size())}, dev);
}
/// A 2-D tensor from nested lists: tensor<float>({{1, 2}, {3, 4}}); rows must agree.
template <Element T>
Tensor<T> tensor(std::initializer_list<std::initializer_list<T>> rows, Device dev = device()) {
  std::vector<T> flat;
  const std::int64_t cols = rows.size() ? static_cast<std::int64_t>(rows.begin()->size()) : 0;
  for (const auto& r : rows) {
    if (static_cast<std::int64_t>(r.size()) != cols) {
      throw ShapeError("tensor: expected every row to have " + std::to_string(cols) + " elements, found " +
                       std::to_string(r.size()));
    }
    flat.insert(flat.end(), r.begin(), r.end());
  }
  return from_vector<T>(flat, Shape{static_cast<std::int64_t>(rows.size()), cols}, dev);
}
/// A 0-d tensor holding `v`.
template <Element T>
Tensor<T> scalar_tensor(T v, Device dev = device()) {
  return Tensor<T>(detail::data_node<T>(&v, Shape{}, dev));
}

/// Values start, start + step, ... below end (torch.arange).
template <Element T>
Tensor<T> arange(double start, double end, double step = 1, Device dev = device()) {
  if (step == 0 || !std::isfinite(start) || !std::isfinite(end) || !std::isfinite(step)) {
    throw Error("arange: expected a finite, non-zero step and finite bounds");
  }
  if ((end - start) / step < 0) {
    throw Error("arange: upper bound and step sign are inconsistent (start " + std::to_string(start) +
                ", end " + std::to_string(end) + ", step " + std::to_string(step) + ")");
  }
  const auto n = static_cast<std::int64_t>(std::ceil((end - start) / step));
  std::vector<T> v(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) v[i] = static_cast<T>(start + static_cast<double>(i) * step);
  return from_vector<T>(v, Shape{static_cast<std::int64_t>(v.size())}, dev);
}
/// 0, 1, ..., end - 1.
template <Element T>
Tensor<T> arange(double end, Device dev = device()) {
  return arange<T>(0, end, 1, dev);
}

/// `steps` values evenly spaced from start to end inclusive (torch.linspace).
template <Element T>
Tensor<T> linspace(double start, double end, std::int64_t steps, Device dev = device()) {
  if (steps < 0) throw Error("linspace: number of steps must be non-negative, got " + std::to_string(steps));
  std::vector<T> v(static_cast<std::size_t>(steps));
  const double step = steps > 1 ? (end - start) / static_cast<double>(steps - 1) : 0;
  // Fill from both ends, as PyTorch does, so the last value is exactly `end`.
  for (std::int64_t i = 0; i < steps; ++i) {
    // A single step is `start`, as torch.linspace(a, b, 1) == [a].
    v[i] = static_cast<T>(steps == 1 || i < steps / 2 ? start + step * static_cast<double>(i)
                                                      : end - step * static_cast<double>(steps - 1 - i));
  }
  return from_vector<T>(v, Shape{static_cast<std::int64_t>(v.size())}, dev);
}

}  // namespace lazy
// ---- end lazytensor/ops/factories.hpp ----
// ---- begin lazytensor/state_dict.hpp ----
// StateDict: named tensors in insertion order, plus string metadata. What Module::state_dict,
// Optimizer::state_dict and lazy::io::save/load exchange (libtorch's OrderedDict of tensors;
// the metadata maps to safetensors' "__metadata__").

#include <map>
#include <string>
#include <utility>
#include <vector>


namespace lazy {

/// Ordered name -> tensor map with unique names, plus free-form string metadata.
class StateDict {
 public:
  using Item = std::pair<std::string, AnyTensor>;

  /// Adds `name`; Error when the name is already present.
  void insert(const std::string& name, AnyTensor t);
  /// Adds or replaces `name`.
  void insert_or_assign(const std::string& name, AnyTensor t);
  /// True when `name` is present.
  bool contains(const std::string& name) const { return index_.count(name) != 0; }
  /// The tensor stored under `name`, or nullptr.
  const AnyTensor* find(const std::string& name) const;
  /// The tensor stored under `name`; Error naming the key when it is missing.
  const AnyTensor& at(const std::string& name) const;
  /// Every (name, tensor) pair in insertion order.
  const std::vector<Item>& items() const { return items_; }
  std::vector<Item>::const_iterator begin() const { return items_.begin(); }
  std::vector<Item>::const_iterator end() const { return items_.end(); }
  std::size_t size() const { return items_.size(); }
  bool empty() const { return items_.empty(); }
  /// The keys in insertion order.
  std::vector<std::string> keys() const;

  /// Free-form string metadata (hyper-parameters, format versions, ...).
  std::map<std::string, std::string>& metadata() { return metadata_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

  /// The safetensors dtype to write a tensor as, by name, when it is not its own dtype's:
  /// io::load records here each tensor it widened (an F16 tensor loaded as float maps to
  /// "F16", a U8 one loaded as int32 to "U8"), so saving the dict writes the file's dtypes
  /// back. Set an entry to store a float tensor as "F16", or an int32 one as "U8", "I8",
  /// "I16" or "U16" (int64 as "U32"); save raises FormatError for values that do not fit.
  std::map<std::string, std::string>& stored_dtypes() { return stored_dtypes_; }
  const std::map<std::string, std::string>& stored_dtypes() const { return stored_dtypes_; }

 private:
  std::vector<Item> items_;
  std::map<std::string, std::size_t> index_;
  std::map<std::string, std::string> metadata_;
  std::map<std::string, std::string> stored_dtypes_;
};

#if LAZYTENSOR_HEADER_DEFINITIONS
LAZYTENSOR_INLINE void StateDict::insert(const std::string& name, AnyTensor t) {
  if (index_.count(name)) throw Error("StateDict: duplicate key '" + name + "'");
  index_.emplace(name, items_.size());
  items_.emplace_back(name, std::move(t));
}

LAZYTENSOR_INLINE void StateDict::insert_or_assign(const std::string& name, AnyTensor t) {
  if (auto it = index_.find(name); it != index_.end()) items_[it->second].second = std::move(t);
  else insert(name, std::move(t));
}

LAZYTENSOR_INLINE const AnyTensor* StateDict::find(const std::string& name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &items_[it->second].second;
}

LAZYTENSOR_INLINE const AnyTensor& StateDict::at(const std::string& name) const {
  if (const AnyTensor* t = find(name)) return *t;
  throw Error("StateDict: missing key '" + name + "'");
}

LAZYTENSOR_INLINE std::vector<std::string> StateDict::keys() const {
  std::vector<std::string> k;
  for (const auto& [n, t] : items_) k.push_back(n);
  return k;
}
#endif  // LAZYTENSOR_HEADER_DEFINITIONS

}  // namespace lazy
// ---- end lazytensor/state_dict.hpp ----

namespace lazy::optim {

namespace detail {
/// Option `name` of a saved group as a number (Error when missing or malformed).
double parse_option(const std::map<std::string, std::string>& opts, const std::string& name);
/// The shortest text that reads back as exactly `v`.
std::string format_option(double v);
}  // namespace detail

/// Per-parameter optimizer state: named tensors (of the parameter's dtype) plus a step count.
struct ParamState {
  std::map<std::string, AnyTensor> tensors;
  std::int64_t step = 0;
};

namespace detail {
/// Calls f(Tensor<T>) with the parameter's typed handle (T: bfloat16, float or double);
/// DTypeError for an integral or bool parameter.
template <class F>
decltype(auto) visit_floating(const AnyTensor& p, const char* who, F&& f) {
  switch (p.dtype()) {
    case DType::Float32: return f(p.as<float>());
    case DType::Float64: return f(p.as<double>());
    case DType::BFloat16: return f(p.as<bfloat16>());
    default: break;
  }
  throw DTypeError(std::string(who) + ": expected floating parameters (bfloat16, float32 or float64), got " +
                   dtype_name(p.dtype()));
}
}  // namespace detail

/// Base of every optimizer. `Options` is the optimizer's options type (with lr()).
class Optimizer {
 public:
  virtual ~Optimizer() = default;

  /// Applies one update to every parameter that has a gradient.
  virtual void step() = 0;

  /// Clears the gradients of every parameter: undefined (libtorch's default) or zero.
  void zero_grad(bool set_to_none = true);

  /// Number of parameter groups.
  virtual std::size_t num_param_groups() const = 0;
  /// The parameters of group `g`.
  virtual std::vector<AnyTensor>& params(std::size_t g) = 0;
  /// Learning rate of group `g` (what schedulers read and write).
  virtual double lr(std::size_t g = 0) const = 0;
  virtual void set_lr(double lr, std::size_t g) = 0;
  /// Sets the learning rate of every group.
  void set_lr(double lr);

  /// State tensors as "state.<i>.<name>" (i counts parameters across groups in order),
  /// step counts as "state.<i>.step", and every group's options in the metadata
  /// ("param_groups.<g>.<option>").
  StateDict state_dict() const;

  /// Restores state and options saved by state_dict() of the same kind of optimizer over
  /// parameters of the same shapes. Checks everything before changing anything.
  void load_state_dict(const StateDict& sd);

 protected:
  /// "SGD", "Adam", ...
  virtual std::string type_name() const = 0;
  virtual const std::vector<AnyTensor>& const_params(std::size_t g) const = 0;
  /// Options of group g as strings, and back (Error on a missing or malformed value).
  virtual std::map<std::string, std::string> options_of(std::size_t g) const = 0;
  virtual void set_options_of(std::size_t g, const std::map<std::string, std::string>& opts) = 0;

  /// State of parameter k of group g.
  ParamState& state(std::size_t g, std::size_t k);

 private:
  static std::pair<std::size_t, std::size_t> key(std::size_t g, std::size_t k) { return {g, k}; }
  static AnyTensor scalar_step(std::int64_t s);

  std::map<std::pair<std::size_t, std::size_t>, ParamState> state_;
};

/// The parameter groups of an optimizer with options type Options.
template <class Options>
class OptimizerWithOptions : public Optimizer {
 public:
  /// A group of parameters sharing options.
  struct ParamGroup {
    std::vector<AnyTensor> params;
    Options options;
  };

  OptimizerWithOptions(std::vector<ParamGroup> groups) : groups_(std::move(groups)) {
    for (auto& g : groups_) {
      for (auto& p : g.params) {
        if (!p.defined()) throw Error(type_name_of() + ": got an undefined parameter");
        if (!p.is_floating_point()) {
          throw DTypeError(type_name_of() + ": can only optimize floating parameters, got one of dtype " +
                           dtype_name(p.dtype()));
        }
        if (!p.requires_grad()) p.requires_grad_();
      }
    }
  }

  std::size_t num_param_groups() const override { return groups_.size(); }
  std::vector<AnyTensor>& params(std::size_t g) override { return groups_.at(g).params; }
  double lr(std::size_t g = 0) const override { return groups_.at(g).options.lr(); }
  void set_lr(double lr, std::size_t g) override { groups_.at(g).options.lr(lr); }
  using Optimizer::set_lr;
  /// The groups, with their options (libtorch's param_groups()).
  std::vector<ParamGroup>& param_groups() { return groups_; }
  /// Adds a group (libtorch's add_param_group).
  void add_param_group(ParamGroup g) { groups_.push_back(std::move(g)); }

 protected:
  const std::vector<AnyTensor>& const_params(std::size_t g) const override { return groups_.at(g).params; }
  std::map<std::string, std::string> options_of(std::size_t g) const override { return groups_.at(g).options.to_map(); }
  void set_options_of(std::size_t g, const std::map<std::string, std::string>& opts) override {
    groups_.at(g).options = Options::from_map(opts);
  }
  virtual std::string type_name_of() const { return "Optimizer"; }

  std::vector<ParamGroup> groups_;
};

#if LAZYTENSOR_HEADER_DEFINITIONS
namespace detail {

LAZYTENSOR_INLINE double parse_option(const std::map<std::string, std::string>& opts, const std::string& name) {
  auto it = opts.find(name);
  if (it == opts.end()) throw Error("Optimizer::load_state_dict: missing option '" + name + "'");
  double v = 0;
  const char* b = it->second.data();
  const char* e = b + it->second.size();
  auto [p, ec] = std::from_chars(b, e, v);
  if (ec != std::errc() || p != e) {
    throw Error("Optimizer::load_state_dict: option '" + name + "' is not a number: '" + it->second + "'");
  }
  return v;
}

LAZYTENSOR_INLINE std::string format_option(double v) {
  char buf[64];
  auto [p, ec] = std::to_chars(buf, buf + sizeof buf, v);
  return std::string(buf, p);
}

}  // namespace detail

LAZYTENSOR_INLINE void Optimizer::zero_grad(bool set_to_none) {
  for (std::size_t g = 0; g < num_param_groups(); ++g) {
    for (auto& p : params(g)) {
      if (set_to_none || !p.grad().defined()) {
        p.set_grad(AnyTensor());
      } else {
        NoGradGuard guard;
        p.grad().zero_();
      }
    }
  }
}

LAZYTENSOR_INLINE void Optimizer::set_lr(double lr) {
  for (std::size_t g = 0; g < num_param_groups(); ++g) set_lr(lr, g);
}

LAZYTENSOR_INLINE StateDict Optimizer::state_dict() const {
  StateDict sd;
  std::size_t i = 0;
  for (std::size_t g = 0; g < num_param_groups(); ++g) {
    for (std::size_t k = 0; k < const_params(g).size(); ++k, ++i) {
      auto it = state_.find(key(g, k));
      if (it == state_.end()) continue;
      for (const auto& [name, t] : it->second.tensors) sd.insert("state." + std::to_string(i) + "." + name, t.detach());
      sd.insert("state." + std::to_string(i) + ".step", scalar_step(it->second.step));
    }
    for (const auto& [name, v] : options_of(g)) sd.metadata()["param_groups." + std::to_string(g) + "." + name] = v;
  }
  sd.metadata()["optimizer"] = type_name();
  return sd;
}

LAZYTENSOR_INLINE void Optimizer::load_state_dict(const StateDict& sd) {
  if (auto it = sd.metadata().find("optimizer"); it == sd.metadata().end() || it->second != type_name()) {
    throw Error("Optimizer::load_state_dict: expected a state dict of a " + type_name() + " optimizer, found " +
                (it == sd.metadata().end() ? std::string("none") : it->second));
  }
  std::map<std::pair<std::size_t, std::size_t>, ParamState> loaded;
  std::size_t i = 0, total = 0;
  for (std::size_t g = 0; g < num_param_groups(); ++g) total += const_params(g).size();
  for (const auto& [name, t] : sd) {
    if (name.rfind("state.", 0) != 0) throw Error("Optimizer::load_state_dict: unexpected key '" + name + "'");
    const auto dot = name.find('.', 6);
    std::size_t idx = 0;
    auto [p, ec] = std::from_chars(name.data() + 6, name.data() + (dot == std::string::npos ? name.size() : dot), idx);
    if (ec != std::errc() || dot == std::string::npos || idx >= total) {
      throw Error("Optimizer::load_state_dict: key '" + name + "' does not name one of the " + std::to_string(total) +
                  " parameters");
    }
    (void)p;
  }
  for (std::size_t g = 0; g < num_param_groups(); ++g) {
    for (std::size_t k = 0; k < const_params(g).size(); ++k, ++i) {
      const std::string prefix = "state." + std::to_string(i) + ".";
      ParamState st;
      bool any = false;
      for (const auto& [name, t] : sd) {
        if (name.rfind(prefix, 0) != 0) continue;
        any = true;
        const std::string field = name.substr(prefix.size());
        if (field == "step") {
          st.step = t.as<std::int64_t>().item();
          continue;
        }
        const AnyTensor& param = const_params(g)[k];
        if (!(t.shape() == param.shape())) {
          throw ShapeError("Optimizer::load_state_dict: '" + name + "' has shape " + t.shape().str() +
                           ", the parameter has shape " + param.shape().str());
        }
        if (t.dtype() != param.dtype()) {
          throw DTypeError("Optimizer::load_state_dict: '" + name + "' has dtype " + dtype_name(t.dtype()) +
                           ", the parameter has dtype " + dtype_name(param.dtype()));
        }
        st.tensors[field] = t.to(param.device());
      }
      if (any) loaded[key(g, k)] = std::move(st);
    }
  }
  for (std::size_t g = 0; g < num_param_groups(); ++g) {
    std::map<std::string, std::string> opts;
    const std::string prefix = "param_groups." + std::to_string(g) + ".";
    for (const auto& [k, v] : sd.metadata())
      if (k.rfind(prefix, 0) == 0) opts[k.substr(prefix.size())] = v;
    set_options_of(g, opts);
  }
  state_ = std::move(loaded);
}

LAZYTENSOR_INLINE ParamState& Optimizer::state(std::size_t g, std::size_t k) { return state_[key(g, k)]; }

LAZYTENSOR_INLINE AnyTensor Optimizer::scalar_step(std::int64_t s) {
  std::vector<std::int64_t> v{s};
  return from_vector<std::int64_t>(v, Shape{});
}
#endif  // LAZYTENSOR_HEADER_DEFINITIONS

}  // namespace lazy::optim
// ---- end lazytensor/optim/optimizer.hpp ----

namespace lazy::dist {

namespace detail {
inline std::atomic<std::size_t>& bucket_bytes_setting() {
  static std::atomic<std::size_t> bytes{std::size_t{16} << 20};
  return bytes;
}
}  // namespace detail

/// The most gradient bytes optimizer_step puts in one all_reduce (default 16 MiB).
inline std::size_t gradient_bucket_bytes() {
  return detail::bucket_bytes_setting().load(std::memory_order_relaxed);
}

/// Sets the bucket size of optimizer_step for the whole process (every replica must use the
/// same buckets; set it before spawn). Error when `bytes` is 0.
void set_gradient_bucket_bytes(std::size_t bytes);

/// All-reduces the gradient of every parameter of `optimizer` that has one to the mean over
/// this replica's group (sum times 1 / group size), in place (each parameter's .grad() then
/// holds the mean), in coalesced buckets (see the file comment), as xm.reduce_gradients.
/// Nothing is exchanged in a group of one. Lazy: the exchanges run at the next mark_step.
/// (A template only so that programs that never call it compile no exchange of any dtype.)
template <class = void>
void reduce_gradients(optim::Optimizer& optimizer, const Groups& groups = {});

/// One data-parallel optimizer step, as xm.optimizer_step(optimizer, barrier, groups):
/// reduce_gradients (the mean of every gradient over this replica's group, in coalesced
/// buckets), then `optimizer.step()`.
///
/// **It does not run anything unless `barrier` is true.** Like everything else in a step,
/// the all-reduces and the update are traced lazily and execute at the next mark_step,
/// which the training loop usually gets from MpDeviceLoader (it calls mark_step as it hands
/// out batches). `barrier = true` calls lazy::mark_step() right after the update, which is
/// what a loop that does not iterate an MpDeviceLoader needs (PyTorch/XLA users were often
/// surprised that `barrier` means "sync the step", not "wait for the other replicas").
/// Every replica of a group must call it with the same parameters having gradients (in the
/// same order and shapes), or the exchange raises CollectiveMismatch.
template <class = void>
void optimizer_step(optim::Optimizer& optimizer, bool barrier = false, const Groups& groups = {});

}  // namespace lazy::dist

#if LAZYTENSOR_HEADER_DEFINITIONS
namespace lazy::dist {
LAZYTENSOR_INLINE void set_gradient_bucket_bytes(std::size_t bytes) {
  if (bytes == 0) throw Error("set_gradient_bucket_bytes: the bucket size must be > 0 bytes");
  detail::bucket_bytes_setting().store(bytes, std::memory_order_relaxed);
}
}  // namespace lazy::dist
#endif  // LAZYTENSOR_HEADER_DEFINITIONS

namespace lazy::dist {
// (Templates: outside the HEADER_DEFINITIONS block, instantiated once in lazytensor::compiled.)
template <class>
void reduce_gradients(optim::Optimizer& optimizer, const Groups& groups) {
  const auto group = detail::group_of(groups, "optimizer_step");
  if (group->size() == 1) return;
  const AllReduceOptions opts{.scale = 1.0 / static_cast<double>(group->size()), .groups = groups};
  const std::size_t cap = gradient_bucket_bytes();
  std::unordered_set<const graph::TensorImpl*> seen;  // a parameter listed twice is reduced once
  // One bucket per dtype (a module converted with to(dtype) has bfloat16 or double
  // gradients); every replica fills and flushes them in the same order.
  struct Buckets {
    std::vector<Tensor<float>> f32;
    std::vector<Tensor<double>> f64;
    std::vector<Tensor<bfloat16>> bf16;
    std::size_t bytes[3] = {0, 0, 0};
  } b;
  auto flush = [&](auto& bucket, std::size_t& bytes) {
    if (!bucket.empty()) all_reduce_(ReduceOp::Sum, bucket, opts);
    bucket.clear();
    bytes = 0;
  };
  auto add = [&](auto& bucket, std::size_t& bytes, auto grad) {
    const std::size_t nbytes = static_cast<std::size_t>(grad.numel()) * sizeof(typename decltype(grad)::value_type);
    if (!bucket.empty() && bytes + nbytes > cap) flush(bucket, bytes);
    bucket.push_back(std::move(grad));
    bytes += nbytes;
  };
  for (std::size_t g = 0; g < optimizer.num_param_groups(); ++g) {
    for (const auto& p : optimizer.params(g)) {
      const AnyTensor grad = p.grad();  // shares the gradient object: all_reduce_ rebinds it
      if (!grad.defined() || !seen.insert(p.impl().get()).second) continue;
      switch (grad.dtype()) {
        case DType::Float64: add(b.f64, b.bytes[1], grad.as<double>()); break;
        case DType::BFloat16: add(b.bf16, b.bytes[2], grad.as<bfloat16>()); break;
        default: add(b.f32, b.bytes[0], grad.as<float>()); break;
      }
    }
  }
  flush(b.f32, b.bytes[0]);
  flush(b.f64, b.bytes[1]);
  flush(b.bf16, b.bytes[2]);
}

template <class>
void optimizer_step(optim::Optimizer& optimizer, bool barrier, const Groups& groups) {
  reduce_gradients(optimizer, groups);
  optimizer.step();
  if (barrier) mark_step();
}
}  // namespace lazy::dist

#define LAZYTENSOR_DIST_OPTIMIZER_STEP_INSTANCES(P)                                                              \
  P template void lazy::dist::reduce_gradients<void>(lazy::optim::Optimizer&, const lazy::dist::Groups&);        \
  P template void lazy::dist::optimizer_step<void>(lazy::optim::Optimizer&, bool, const lazy::dist::Groups&);
#if LAZYTENSOR_EXPLICIT_INSTANTIATION
LAZYTENSOR_DIST_OPTIMIZER_STEP_INSTANCES(extern)
#endif
// ---- end lazytensor/dist/optimizer_step.hpp ----
// ---- begin lazytensor/dist/parallel_loader.hpp ----
// ParallelLoader, its per-device loaders and MpDeviceLoader, as torch_xla's
// torch_xla.distributed.parallel_loader.
//
//   // one replica per thread (inside dist::spawn), the canonical loop:
//   auto loader = lazy::data::make_data_loader(train, lazy::data::DistributedSampler(n, rank),
//                                              {.batch_size = 64});
//   lazy::dist::MpDeviceLoader device_loader(*loader, lazy::device());
//   for (auto& batch : device_loader) { ... lazy::dist::optimizer_step(opt); }  // mark_step
//                                                                              // per batch
//
// One pass of a ParallelLoader over D devices runs, in the background:
//  - a loader thread iterating the underlying loader (one epoch). It collects batches in
//    groups of D and routes batch i*D + d of the epoch to device d only as part of a complete
//    group (an incomplete last group is dropped, as torch_xla does); each device's host queue
//    holds at most `loader_prefetch_size` batches, and the loader thread waits for room in
//    every queue before routing a group;
//  - per device, `host_to_device_transfer_threads` threads copying host batches into
//    buffers of that device (at most `device_prefetch_size` batches copied or being copied
//    ahead of the consumer). A copy is a DataNode built from the source's bytes on the
//    target device: it never executes or touches any device's pending graph. A batch field
//    already materialized on the target device is handed over as is (buffers are immutable,
//    so sharing is a free copy): in the replica-per-thread loop the DataLoader already
//    builds its batches on the replica's device.
// The consumer of device d gets its batches strictly in order (several transfer threads
// finish out of order; a reorder buffer puts them back). An exception in the loader thread
// (e.g. a FormatError from the dataset) reaches every device's consumer once that device
// has received the batches routed before the failure; an exception copying a batch reaches
// its device's consumer at that batch. Either ends the device's pass.
//
// Batch fields must be materialized (as the library's datasets and the DataLoader's
// collation make them): computing a pending one would run graph nodes on a background
// thread while the device's owner may be tracing or running mark_step (lazy::Error).
// Supported batch types: Tensor<T>, AnyTensor, data::Example, std::vector, std::pair,
// std::tuple and std::optional of those; arithmetic values and strings pass unchanged.
//
// Consumers: a per-device loader is consumed by one thread; several can be consumed by
// one thread in turn (round robin) or by a thread each. Consuming one device's loader to
// the end while another device's is not read stalls once that device's queues are full,
// as in torch_xla (the loader thread waits for room in every queue).
//
// Stopping: destroying a ParallelLoader (or MpDeviceLoader::begin() starting the next
// epoch) wakes every background thread and joins it; a thread busy loading or copying a
// batch finishes that batch first. The underlying loader must outlive the ParallelLoader and
// must not be used by anyone else while a pass runs.

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <cstddef>
#include <exception>
#include <iterator>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>


namespace lazy::spmd {
class ShardingSpec;  // spmd/sharding.hpp (a layer above): loaders only pass it on
}  // namespace lazy::spmd

namespace lazy::dist {

/// Options of ParallelLoader and MpDeviceLoader (torch_xla's keyword arguments).
struct ParallelLoaderOptions {
  /// The batch dimension of the data (torch_xla's `batchdim`). Batches are handed out
  /// whole, never split, so it is only validated (>= 0).
  int batchdim = 0;
  /// A per-device loader calls mark_step on its device after every this many batches.
  std::size_t batches_per_execution = 1;
  /// Host batches queued per device ahead of the transfers.
  std::size_t loader_prefetch_size = 8;
  /// Batches per device copied (or being copied) ahead of the consumer.
  std::size_t device_prefetch_size = 4;
  /// Threads copying host batches into each device.
  std::size_t host_to_device_transfer_threads = 1;
  /// SPMD (lazy::spmd): every tensor of a batch is sharded so by the transfer thread, so
  /// batches arrive sharded (torch_xla's input_sharding). Needs spmd::use_spmd().
  std::shared_ptr<const spmd::ShardingSpec> input_sharding = nullptr;
};

namespace detail {
/// Shards a tensor object as a ShardingSpec says; installed by spmd::use_spmd (the spmd
/// layer sits above this one).
using InputShardingHook = void (*)(graph::TensorImpl& tensor, const spmd::ShardingSpec& spec);
inline std::atomic<InputShardingHook>& input_sharding_hook() {
  static std::atomic<InputShardingHook> hook{nullptr};
  return hook;
}
/// The sharding the calling transfer thread applies to the batch it copies (null: none).
inline const spmd::ShardingSpec*& current_input_sharding() {
  thread_local const spmd::ShardingSpec* spec = nullptr;
  return spec;
}
/// Applies the current input sharding to `t`, if any.
void shard_input(graph::TensorImpl& t);
}  // namespace detail

namespace detail {

/// The batch type a loader yields.
template <class Loader>
using loader_batch_t = std::remove_cvref_t<decltype(*std::declval<Loader&>().begin())>;

template <class X>
inline constexpr bool passes_unchanged_v =
    std::is_arithmetic_v<X> || std::is_enum_v<X> || std::is_same_v<X, std::string>;

// Copies of a batch on a device (see the file comment). Declared first: they call each
// other for nested batch types.
template <Element T>
Tensor<T> to_device(Tensor<T> t, graph::Device& dev);
AnyTensor to_device(const AnyTensor& t, graph::Device& dev);
template <class D, class T>
data::Example<D, T> to_device(data::Example<D, T> e, graph::Device& dev);
template <class X>
std::vector<X> to_device(std::vector<X> v, graph::Device& dev);
template <class A, class B>
std::pair<A, B> to_device(std::pair<A, B> p, graph::Device& dev);
template <class... X>
std::tuple<X...> to_device(std::tuple<X...> t, graph::Device& dev);
template <class X>
std::optional<X> to_device(std::optional<X> o, graph::Device& dev);
template <class X>
requires passes_unchanged_v<X> X to_device(X x, graph::Device&) { return x; }

template <Element T>
Tensor<T> to_device(Tensor<T> t, graph::Device& dev) {
  if (!t.defined()) return t;
  const graph::NodePtr& node = t.node();
  if (!node->materialized()) {
    throw Error("ParallelLoader: a batch holds a pending (not materialized) tensor of shape " +
                t.shape().str() + " on " + node->device()->str() +
                "; the loader copies batches on background threads and cannot run graph nodes "
                "there: the dataset must return materialized tensors (built from host data)");
  }
  Tensor<T> copy = node->device() == &dev ? t
                                           : Tensor<T>(lazy::detail::data_node<T>(node->template data<T>(), t.shape(),
                                                                                  Device(dev.index())));
  if (current_input_sharding()) shard_input(*copy.impl());
  return copy;
}
template <class D, class T>
data::Example<D, T> to_device(data::Example<D, T> e, graph::Device& dev) {
  return {to_device(std::move(e.data), dev), to_device(std::move(e.target), dev)};
}
template <class X>
std::vector<X> to_device(std::vector<X> v, graph::Device& dev) {
  for (auto& x : v) x = to_device(std::move(x), dev);
  return v;
}
template <class A, class B>
std::pair<A, B> to_device(std::pair<A, B> p, graph::Device& dev) {
  return {to_device(std::move(p.first), dev), to_device(std::move(p.second), dev)};
}
template <class... X>
std::tuple<X...> to_device(std::tuple<X...> t, graph::Device& dev) {
  return std::apply(
      [&](auto&&... x) { return std::tuple<X...>(to_device(std::move(x), dev)...); }, std::move(t));
}
template <class X>
std::optional<X> to_device(std::optional<X> o, graph::Device& dev) {
  if (o) o = to_device(std::move(*o), dev);
  return o;
}

/// One pass of a ParallelLoader: the loader thread, and per device a host queue, the
/// transfer threads and a reorder buffer of copied batches (see the file comment).
template <class Batch>
class LoaderPass {
 public:
  template <class Loader>
  LoaderPass(Loader& loader, const std::vector<Device>& devices, const ParallelLoaderOptions& o)
      : options_(o) {
    for (const auto& d : devices) {
      queues_.push_back(std::make_unique<Queue>());
      queues_.back()->device = &d.engine();
    }
    try {
      threads_.emplace_back([this, &loader] { load(loader); });
      for (std::size_t d = 0; d < queues_.size(); ++d) {
        for (std::size_t t = 0; t < o.host_to_device_transfer_threads; ++t)
          threads_.emplace_back([this, d] { transfer(*queues_[d]); });
      }
    } catch (...) {
      stop();
      throw;
    }
  }
  LoaderPass(const LoaderPass&) = delete;
  LoaderPass& operator=(const LoaderPass&) = delete;
  ~LoaderPass() { stop(); }

  /// Device d's next batch in order, or nothing at the end of its pass. Re-throws the error
  /// that ended the pass (once); afterwards the pass is over for this device.
  std::optional<Batch> next(std::size_t d) {
    Queue& q = *queues_[d];
    Slot slot;
    {
      std::unique_lock lock(mu_);
      if (q.finished) return std::nullopt;
      q.ready_cv.wait(lock, [&] {
        return stopping_ || q.ready.count(q.next) || (closed_ && q.next == q.routed);
      });
      auto it = q.ready.find(q.next);
      if (it == q.ready.end()) {  // closed, or every routed batch delivered and the loader done
        q.finished = true;
        if (loader_error_ && !stopping_) std::rethrow_exception(loader_error_);
        return std::nullopt;
      }
      slot = std::move(it->second);
      q.ready.erase(it);
      ++q.next;
      if (slot.error) q.finished = true;
    }
    q.work_cv.notify_all();  // room for one more copy
    if (slot.error) std::rethrow_exception(slot.error);
    return std::move(slot.batch);
  }

  /// Wakes every background thread and joins it (each finishes the batch it holds).
  void stop() noexcept {
    {
      std::lock_guard lock(mu_);
      stopping_ = true;
    }
    notify_all();
    for (auto& t : threads_) t.join();
    threads_.clear();
  }

 private:
  struct Slot {
    std::optional<Batch> batch;
    std::exception_ptr error;
  };
  struct Queue {
    graph::Device* device = nullptr;
    std::deque<std::pair<std::size_t, Batch>> host;  ///< (position on this device, batch)
    std::size_t routed = 0;                          ///< batches routed to this device
    std::size_t in_flight = 0;                       ///< being copied
    std::size_t next = 0;                            ///< the consumer's next position
    std::map<std::size_t, Slot> ready;               ///< copied, by position
    bool finished = false;                           ///< the consumer saw the end or an error
    std::condition_variable work_cv;                 ///< transfer threads wait here
    std::condition_variable ready_cv;                ///< the consumer waits here
  };

  void notify_all() {
    room_cv_.notify_all();
    for (auto& q : queues_) {
      q->work_cv.notify_all();
      q->ready_cv.notify_all();
    }
  }

  template <class Loader>
  void load(Loader& loader) {
    std::exception_ptr error;
    try {
      const std::size_t n = queues_.size();
      std::vector<Batch> group;
      group.reserve(n);
      for (auto&& batch : loader) {
        group.push_back(std::move(batch));
        if (group.size() < n) continue;
        {
          std::unique_lock lock(mu_);
          room_cv_.wait(lock, [&] {
            return stopping_ || std::all_of(queues_.begin(), queues_.end(), [&](const auto& q) {
                     return q->host.size() < options_.loader_prefetch_size;
                   });
          });
          if (stopping_) break;
          for (std::size_t d = 0; d < n; ++d) {
            Queue& q = *queues_[d];
            q.host.emplace_back(q.routed++, std::move(group[d]));
          }
        }
        for (auto& q : queues_) q->work_cv.notify_all();
        group.clear();
        {
          std::lock_guard lock(mu_);
          if (stopping_) break;
        }
      }
    } catch (...) {
      error = std::current_exception();
    }
    {
      std::lock_guard lock(mu_);
      closed_ = true;
      loader_error_ = error;
    }
    notify_all();
  }

  void transfer(Queue& q) {
    for (;;) {
      std::pair<std::size_t, Batch> item;
      {
        std::unique_lock lock(mu_);
        q.work_cv.wait(lock, [&] {
          return stopping_ || (q.host.empty() && closed_) ||
                 (!q.host.empty() && q.in_flight + q.ready.size() < options_.device_prefetch_size);
        });
        if (stopping_ || q.host.empty()) return;
        item = std::move(q.host.front());
        q.host.pop_front();
        ++q.in_flight;
      }
      room_cv_.notify_all();  // room in the host queue
      Slot slot;
      try {
        // With input_sharding, to_device also shards every tensor it copies.
        current_input_sharding() = options_.input_sharding.get();
        slot.batch.emplace(to_device(std::move(item.second), *q.device));
        current_input_sharding() = nullptr;
      } catch (...) {
        slot.error = std::current_exception();
      }
      item.second = Batch();  // release the host copy outside the lock
      {
        std::lock_guard lock(mu_);
        --q.in_flight;
        q.ready.emplace(item.first, std::move(slot));
      }
      q.ready_cv.notify_all();
    }
  }

  const ParallelLoaderOptions options_;
  std::vector<std::unique_ptr<Queue>> queues_;
  std::mutex mu_;
  std::condition_variable room_cv_;  ///< the loader thread waits for room in every host queue
  bool closed_ = false;              ///< the loader thread is done (guarded by mu_)
  std::exception_ptr loader_error_;  ///< why it stopped early (guarded by mu_)
  bool stopping_ = false;            ///< guarded by mu_
  std::vector<std::thread> threads_;
};

/// Rejects options torch_xla would reject (or that would stall the pipeline).
void check_options(const ParallelLoaderOptions& o, const char* who);

}  // namespace detail

template <class Loader>
class ParallelLoader;

/// The batches of one device of a ParallelLoader pass (torch_xla's PerDeviceLoader). An
/// input range: iterating it hands out the device's batches in order and calls mark_step on
/// the device after every `batches_per_execution` batches (when the consumer advances past
/// the last batch of a step) and once more at the end of the pass if batches were handed
/// out since the last one. So the loop body only traces a step; it runs when the next batch
/// is requested. begin() continues where the previous iteration stopped.
template <class Batch>
class PerDeviceLoader {
 public:
  using batch_type = Batch;

  /// Input iterator over the remaining batches.
  class iterator {
   public:
    using value_type = Batch;
    using difference_type = std::ptrdiff_t;
    using reference = Batch&;
    using pointer = Batch*;
    using iterator_category = std::input_iterator_tag;

    iterator() = default;
    Batch& operator*() const { return *owner_->current_; }
    Batch* operator->() const { return &*owner_->current_; }
    iterator& operator++() {
      owner_->advance();
      return *this;
    }
    void operator++(int) { ++*this; }
    friend bool operator==(const iterator& it, std::default_sentinel_t) { return it.at_end(); }

   private:
    friend class PerDeviceLoader;
    bool at_end() const { return !owner_ || !owner_->current_; }
    explicit iterator(PerDeviceLoader* o) : owner_(o) {}
    PerDeviceLoader* owner_ = nullptr;
  };

  PerDeviceLoader(const PerDeviceLoader&) = delete;
  PerDeviceLoader& operator=(const PerDeviceLoader&) = delete;

  /// An iterator at the current batch (the first call fetches the first one).
  iterator begin() {
    if (!started_) {
      started_ = true;
      advance();
    }
    return iterator(this);
  }
  std::default_sentinel_t end() const { return {}; }

  /// The device the batches are on.
  Device device() const { return device_; }

 private:
  template <class L>
  friend class ParallelLoader;

  PerDeviceLoader(detail::LoaderPass<Batch>* pass, std::size_t index, Device device,
                  std::size_t batches_per_execution)
      : pass_(pass), index_(index), device_(device), per_step_(batches_per_execution) {}

  void advance() {
    if (current_) {
      current_.reset();
      if (++since_step_ == per_step_) step();
    }
    current_ = pass_->next(index_);  // an error leaves current_ empty: the pass is over
    if (!current_ && since_step_ > 0) step();
  }

  /// mark_step on this loader's device (the consuming thread may serve several devices).
  void step() {
    since_step_ = 0;
    data::detail::CurrentDeviceScope scope(device_.index());
    mark_step();
  }

  detail::LoaderPass<Batch>* pass_;
  std::size_t index_;
  Device device_;
  std::size_t per_step_;
  std::size_t since_step_ = 0;  ///< batches handed out since the last mark_step
  bool started_ = false;
  std::optional<Batch> current_;
};

/// Feeds the batches of `loader` to several devices, as torch_xla's
/// ParallelLoader(loader, devices, ...): one pass (one epoch of `loader`) starts at
/// construction; batch i*D + d goes to devices[d] (see the file comment for the threads,
/// the queues and the error and stopping rules). Get each device's batches with
/// per_device_loader(device). For the next epoch, construct a new ParallelLoader (or use
/// MpDeviceLoader, which does that at every begin()). Not copyable or movable.
template <class Loader>
class ParallelLoader {
 public:
  using batch_type = detail::loader_batch_t<Loader>;

  /// torch_xla's positional form. Error for an empty or repeated device list or a zero
  /// size; `loader` must outlive this object.
  ParallelLoader(Loader& loader, std::vector<Device> devices, int batchdim = 0,
                 std::size_t batches_per_execution = 1, std::size_t loader_prefetch_size = 8,
                 std::size_t device_prefetch_size = 4,
                 std::size_t host_to_device_transfer_threads = 1)
      : ParallelLoader(loader, std::move(devices),
                       ParallelLoaderOptions{batchdim, batches_per_execution, loader_prefetch_size,
                                             device_prefetch_size,
                                             host_to_device_transfer_threads, nullptr}) {}

  /// The same with named options: `ParallelLoader(loader, devs, {.device_prefetch_size = 2})`.
  ParallelLoader(Loader& loader, std::vector<Device> devices, const ParallelLoaderOptions& options)
      : loader_(loader), devices_(std::move(devices)) {
    detail::check_options(options, "ParallelLoader");
    if (devices_.empty()) throw DeviceError("ParallelLoader: the list of devices is empty");
    for (std::size_t i = 0; i < devices_.size(); ++i) {
      for (std::size_t j = 0; j < i; ++j) {
        if (devices_[i] == devices_[j]) {
          throw DeviceError("ParallelLoader: device " + devices_[i].str() +
                            " appears more than once in the list of devices");
        }
      }
      devices_[i].engine();  // create it now, not on a background thread
    }
    pass_ = std::make_unique<detail::LoaderPass<batch_type>>(loader_, devices_, options);
    for (std::size_t i = 0; i < devices_.size(); ++i) {
      per_device_.push_back(std::unique_ptr<PerDeviceLoader<batch_type>>(new PerDeviceLoader<batch_type>(
          pass_.get(), i, devices_[i], options.batches_per_execution)));
    }
  }
  ParallelLoader(const ParallelLoader&) = delete;
  ParallelLoader& operator=(const ParallelLoader&) = delete;
  /// Stops and joins the background threads (see the file comment).
  ~ParallelLoader() { close(); }

  /// The batches of `device` (DeviceError when it is not one of this loader's devices).
  PerDeviceLoader<batch_type>& per_device_loader(const Device& device) {
    for (std::size_t i = 0; i < devices_.size(); ++i)
      if (devices_[i] == device) return *per_device_[i];
    std::string list;
    for (const auto& d : devices_) list += (list.empty() ? "" : ", ") + d.str();
    throw DeviceError("ParallelLoader::per_device_loader: " + device.str() +
                      " is not one of the loader's devices [" + list + "]");
  }

  /// Batches each device gets in a pass: the loader's batches / number of devices, rounded
  /// down (an incomplete last group is dropped).
  std::size_t per_device_batches() const
  requires requires(const Loader& l) { l.size(); }
  { return static_cast<std::size_t>(loader_.size()) / devices_.size(); }

  const std::vector<Device>& devices() const { return devices_; }

  /// Stops the pass now (joins its threads); per-device loaders then end (torch_xla's close).
  void close() {
    if (pass_) pass_->stop();
  }

 private:
  Loader& loader_;
  std::vector<Device> devices_;
  std::unique_ptr<detail::LoaderPass<batch_type>> pass_;
  std::vector<std::unique_ptr<PerDeviceLoader<batch_type>>> per_device_;
};

/// The loader of one device, as torch_xla's MpDeviceLoader(loader, device, ...): each
/// begin() starts a new pass (a ParallelLoader over {device}, stopping the previous one)
/// and iterates its per-device loader, which calls mark_step on `device` after every
/// `batches_per_execution` batches and at the end of the epoch. The canonical loop of a
/// replica (see the file comment): set_epoch on the loader, then range-for over this. The
/// underlying loader must outlive this object.
template <class Loader>
class MpDeviceLoader {
 public:
  using batch_type = detail::loader_batch_t<Loader>;
  using iterator = typename PerDeviceLoader<batch_type>::iterator;

  /// torch_xla's form: the options after `device` as in ParallelLoader.
  MpDeviceLoader(Loader& loader, Device device, int batchdim = 0,
                 std::size_t batches_per_execution = 1, std::size_t loader_prefetch_size = 8,
                 std::size_t device_prefetch_size = 4,
                 std::size_t host_to_device_transfer_threads = 1)
      : MpDeviceLoader(loader, device,
                       ParallelLoaderOptions{batchdim, batches_per_execution, loader_prefetch_size,
                                             device_prefetch_size,
                                             host_to_device_transfer_threads, nullptr}) {}
  /// The same with named options.
  MpDeviceLoader(Loader& loader, Device device, const ParallelLoaderOptions& options)
      : loader_(loader), device_(device), options_(options) {
    detail::check_options(options, "MpDeviceLoader");
  }
  MpDeviceLoader(const MpDeviceLoader&) = delete;
  MpDeviceLoader& operator=(const MpDeviceLoader&) = delete;

  /// Starts an epoch of the underlying loader (stopping a pass in progress first).
  iterator begin() {
    pass_.reset();
    pass_ = std::make_unique<ParallelLoader<Loader>>(loader_, std::vector<Device>{device_},
                                                     options_);
    return pass_->per_device_loader(device_).begin();
  }
  std::default_sentinel_t end() const { return {}; }

  /// Batches per epoch (the underlying loader's).
  std::size_t size() const
  requires requires(const Loader& l) { l.size(); }
  { return static_cast<std::size_t>(loader_.size()); }

  Device device() const { return device_; }

 private:
  Loader& loader_;
  Device device_;
  ParallelLoaderOptions options_;
  std::unique_ptr<ParallelLoader<Loader>> pass_;
};

}  // namespace lazy::dist

#if LAZYTENSOR_HEADER_DEFINITIONS
namespace lazy::dist::detail {
LAZYTENSOR_INLINE AnyTensor to_device(const AnyTensor& t, graph::Device& dev) {
  if (!t.defined()) return t;
  return t.visit([&](const auto& typed) { return AnyTensor(to_device(typed, dev)); });  // shards too
}

LAZYTENSOR_INLINE void shard_input(graph::TensorImpl& t) {
  InputShardingHook hook = input_sharding_hook().load(std::memory_order_acquire);
  if (!hook) throw Error("ParallelLoader: input_sharding needs SPMD mode; call lazy::spmd::use_spmd() first");
  hook(t, *current_input_sharding());
}

LAZYTENSOR_INLINE void check_options(const ParallelLoaderOptions& o, const char* who) {
  const std::string w(who);
  if (o.batchdim < 0) throw Error(w + ": batchdim must be >= 0, got " + std::to_string(o.batchdim));
  auto positive = [&](std::size_t v, const char* name) {
    if (v == 0) throw Error(w + ": " + name + " must be at least 1, got 0");
  };
  positive(o.batches_per_execution, "batches_per_execution");
  positive(o.loader_prefetch_size, "loader_prefetch_size");
  positive(o.device_prefetch_size, "device_prefetch_size");
  positive(o.host_to_device_transfer_threads, "host_to_device_transfer_threads");
}
}  // namespace lazy::dist::detail
#endif  // LAZYTENSOR_HEADER_DEFINITIONS
// ---- end lazytensor/dist/parallel_loader.hpp ----
// ---- begin lazytensor/dist/runtime.hpp ----
// Runtime queries, as torch_xla.runtime (xr.*). Inside spawn they describe the world of
// replicas; on any other thread, a world of one replica addressing the process's devices.
//
// Each replica plays the role of a torch_xla process: it has one device of its own, so
// local_process_count() and local_device_count() count the replicas on this host and
// addressable_device_count() is 1. The threads backend runs every replica in one process;
// an MPI backend places several processes (each with replica threads) in one world, and
// ordinals follow the world layout (global ordinal = process offset + local index).

#include <string>


namespace lazy::runtime {

namespace detail {
inline const dist::detail::WorldLayout* layout() {
  auto* ctx = dist::detail::current_context();
  return ctx ? &ctx->world->state().layout() : nullptr;
}
}  // namespace detail

/// Devices of every process taking part (xr.global_runtime_device_count()): what SPMD
/// meshes are laid over. Today one process, so lazy::device_count().
inline int global_runtime_device_count() { return device_count(); }

/// Number of replicas in the world (xr.world_size()); 1 outside spawn.
inline int world_size() {
  auto* l = detail::layout();
  return l ? l->world_size : 1;
}
/// This replica's ordinal in the world (xr.global_ordinal()); 0 outside spawn.
inline int global_ordinal() { return dist::detail::ordinal_now(); }
/// This replica's ordinal on its host (xr.local_ordinal()); 0 outside spawn.
inline int local_ordinal() {
  auto* ctx = dist::detail::current_context();
  return ctx ? ctx->world->state().layout().host_offset + ctx->local : 0;
}
/// Replicas ("processes" in torch_xla's terms) on this host (xr.local_process_count()).
inline int local_process_count() {
  auto* l = detail::layout();
  return l ? l->host_replicas : 1;
}
/// Devices on this host: one per replica inside spawn, else lazy::device_count().
inline int local_device_count() {
  auto* l = detail::layout();
  return l ? l->host_replicas : device_count();
}
/// Devices in the world: one per replica inside spawn, else lazy::device_count().
inline int global_device_count() {
  auto* l = detail::layout();
  return l ? l->world_size : device_count();
}
/// Devices this thread can use: its own inside spawn, else lazy::device_count().
inline int addressable_device_count() { return detail::layout() ? 1 : device_count(); }
/// Kind of device ("CPU"), as xr.device_type().
inline std::string device_type() { return "CPU"; }

}  // namespace lazy::runtime

namespace lazy::dist {

/// True on the master replica: local ordinal 0 (of its host) when `local`, else global
/// ordinal 0 (xm.is_master_ordinal).
inline bool is_master_ordinal(bool local = true) {
  return local ? runtime::local_ordinal() == 0 : runtime::global_ordinal() == 0;
}

}  // namespace lazy::dist
// ---- end lazytensor/dist/runtime.hpp ----
// ---- begin lazytensor/dist/spawn.hpp ----
// lazy::dist::spawn: one thread per replica, as xmp.spawn.
//
// Replica i runs fn(i) on a new thread bound to device i (its own pending graph, executor,
// random stream and buffer pool). Each replica device gets max(1, T / nprocs) worker
// threads, T = LAZYTENSOR_NUM_THREADS or the hardware threads, so the replicas together do
// not oversubscribe the machine; devices that existed before spawn get their sizes back
// when it returns (devices it created keep the replica size). When the replica threads
// fill every hardware thread, each replica runs its steps on its own thread instead of
// its device's executor (Device::inline_steps; errors still surface at the next read or
// sync), unless LAZYTENSOR_ASYNC is set.
//
// When fn returns, the replica first runs its pending collectives (a collective traced but
// never synced would otherwise leave its partners waiting), then counts as exited: a
// partner still waiting for it fails at once with a CollectiveError naming it. The first
// exception in any replica aborts the world: every replica blocked in a collective (or
// entering one later) gets ReplicaAborted, and spawn re-throws that first exception once
// every replica thread has finished. A replica busy in its own code notices the abort at
// its next collective, so spawn returns as soon as every replica reached one (or ended).

#include <algorithm>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>


namespace lazy::dist {

namespace detail {

inline std::mutex& spawn_mutex() {
  static std::mutex m;
  return m;
}

/// Worker threads of each replica's device.
inline int replica_threads(int nprocs) {
  return std::max(1, graph::default_device_threads() / nprocs);
}

/// Whether n replicas run their steps on their own threads (Device::inline_steps): when
/// their threads alone fill the machine's cores, unless LAZYTENSOR_ASYNC chose a mode.
/// With every core busy, a replica's executor thread could only take turns with the
/// replica's thread on a core, and every step would pay two cross-core wake-ups (measured
/// with 2 replicas on 2 cores: about 10% of the MLP step).
inline bool replica_steps_inline(int n) {
  return n >= static_cast<int>(std::max(1u, std::thread::hardware_concurrency())) &&
         !graph::Device::async_from_env();
}

/// Configures devices [0, n) for n replicas: their worker pools (replica_threads) and
/// step mode (replica_steps_inline). Devices that existed before get their pool sizes
/// back when this is destroyed, devices created for the replicas keep the replica size
/// (restoring them would only start idle workers nobody asked for); every device gets its
/// step mode back.
class ReplicaDevices {
 public:
  explicit ReplicaDevices(int n);
  ~ReplicaDevices();
  ReplicaDevices(const ReplicaDevices&) = delete;
  ReplicaDevices& operator=(const ReplicaDevices&) = delete;

 private:
  std::vector<int> old_;
  std::vector<std::uint8_t> old_inline_;
};

/// Body of a replica thread.
template <class Body>
void run_replica(const std::shared_ptr<World>& world, int local, Body& body) {
  graph::current_device_index() = local;
  ReplicaContext ctx(world, local);
  current_context() = &ctx;
  try {
    body(local);
    finish_replica();
  } catch (...) {
    world->state().fail(ctx.ordinal, std::current_exception());
  }
  ctx.last.reset();
  current_context() = nullptr;
  world->state().mark_exited(ctx.ordinal);
}

struct NoResult {};

}  // namespace detail

/// Runs fn(i) for i in [0, nprocs), each on its own replica thread and device, and returns
/// replica 0's result (nothing when fn returns void). Re-throws the first exception of any
/// replica (see the file comment). Not re-entrant: a second spawn while one runs, or spawn
/// inside a replica, throws lazy::Error.
template <class F>
auto spawn(F&& fn, int nprocs) {
  using R = std::decay_t<std::invoke_result_t<F&, int>>;
  if (nprocs < 1) throw Error("spawn: nprocs must be >= 1, got " + std::to_string(nprocs));
  if (auto* ctx = detail::current_context()) {
    throw Error("spawn: called inside replica " + std::to_string(ctx->ordinal) +
                "; nested spawn is not supported");
  }
  std::unique_lock guard(detail::spawn_mutex(), std::try_to_lock);
  if (!guard.owns_lock()) throw Error("spawn: another spawn is already running in this process");

  detail::WorldLayout layout;
  layout.world_size = layout.process_replicas = layout.host_replicas = nprocs;
  auto world = std::make_shared<detail::World>(layout);
  detail::ReplicaDevices devices(nprocs);
  std::conditional_t<std::is_void_v<R>, detail::NoResult, std::optional<R>> result;
  auto body = [&](int i) {
    if constexpr (std::is_void_v<R>) {
      fn(i);
    } else if (i == 0) {
      result.emplace(fn(i));
    } else {
      (void)fn(i);
    }
  };
  std::vector<std::thread> threads;
  threads.reserve(static_cast<std::size_t>(nprocs));
  try {
    for (int i = 0; i < nprocs; ++i)
      threads.emplace_back([&, i] { detail::run_replica(world, i, body); });
  } catch (...) {  // could not start a thread: stop the others
    world->state().fail(-1, std::current_exception());
    for (auto& t : threads) t.join();
    throw;
  }
  for (auto& t : threads) t.join();
  if (auto e = world->state().first_error()) std::rethrow_exception(e);
  if constexpr (!std::is_void_v<R>) return std::move(*result);
}

}  // namespace lazy::dist

#if LAZYTENSOR_HEADER_DEFINITIONS
namespace lazy::dist::detail {
LAZYTENSOR_INLINE ReplicaDevices::ReplicaDevices(int n) {
  const int per = replica_threads(n);
  const bool in_line = replica_steps_inline(n);
  const int existing = graph::DeviceRegistry::get().count();
  for (int i = 0; i < n; ++i) {
    graph::Device& dev = graph::DeviceRegistry::get().device(i);
    ThreadPool& pool = dev.threads();
    if (i < existing) old_.push_back(pool.size());
    if (pool.size() != per) pool.resize(per);
    old_inline_.push_back(dev.inline_steps());
    dev.inline_steps() = in_line;
  }
}

LAZYTENSOR_INLINE ReplicaDevices::~ReplicaDevices() {
  for (std::size_t i = 0; i < old_inline_.size(); ++i) {
    graph::Device& dev = graph::DeviceRegistry::get().device(static_cast<int>(i));
    dev.inline_steps() = old_inline_[i] != 0;
    if (i < old_.size() && dev.threads().size() != old_[i]) dev.threads().resize(old_[i]);
  }
}
}  // namespace lazy::dist::detail
#endif  // LAZYTENSOR_HEADER_DEFINITIONS
// ---- end lazytensor/dist/spawn.hpp ----
// ---- end lazytensor/dist.hpp ----
// ---- begin lazytensor/eigen.hpp ----
// lazytensor with Eigen: lazy::from_eigen(matrix) and tensor.eigen(), a row-major
// Eigen::Map of a tensor's values. Apart from <lazytensor/tensor.hpp> so that only programs
// that use Eigen parse it.

// ---- begin lazytensor/ops/eigen.hpp ----
// Eigen interop: a tensor from an Eigen matrix (from_eigen) and a tensor viewed as one
// (Tensor::eigen()). Kept apart from the factories so that only programs that use Eigen
// parse it.

#include <cstdint>
#include <type_traits>

#include <Eigen/Core>


namespace lazy {

namespace detail {
template <class T>
struct EigenView<T, void> {
  static auto map(const Tensor<T>& t) {
    using M = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
    const Shape& s = t.shape();
    const std::int64_t cols = s.rank() <= 1 ? 1 : s[s.rank() - 1];
    const std::int64_t rows = cols == 0 ? 0 : t.numel() / cols;
    return Eigen::Map<const M>(t.data(), static_cast<Eigen::Index>(rows), static_cast<Eigen::Index>(cols));
  }
};
}  // namespace detail

/// A 2-D tensor copied from an Eigen matrix or expression (any storage order).
template <class Derived>
auto from_eigen(const Eigen::DenseBase<Derived>& m, Device dev = device()) {
  using T = typename Derived::Scalar;
  const Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor> rm = m;
  return Tensor<T>(detail::data_node<T>(rm.data(), Shape{rm.rows(), rm.cols()}, dev));
}

}  // namespace lazy
// ---- end lazytensor/ops/eigen.hpp ----
// ---- begin lazytensor/tensor.hpp ----
// lazytensor's core module: what a program that computes with tensors includes.
//
//   Tensor<T> and Device, element-wise expressions (operators and functions), factories
//   (zeros/ones/full/from_vector/arange/..., randn/rand/randint/...), reductions, matmul and
//   linear, mark_step/sync and the other step controls, and the metrics report.
//
// Shape ops, softmax, convolution and pooling are in <lazytensor/ops/...>; the frontend
// modules (nn, optim, data, io, dist) have one header each; <lazytensor/lazytensor.hpp>
// includes everything, <lazytensor/fwd.hpp> only declares.

// ---- begin lazytensor/debug/metrics.hpp ----
// Counters and metrics, named like PyTorch/XLA's (torch_xla.debug.metrics).
//
// Steps run asynchronously; every function here first waits for the steps issued on the
// calling thread's device, so that what it reports includes everything issued so far
// (other devices are not waited for: a replica must not wait on another's collectives).

#include <cstdint>
#include <iomanip>
#include <optional>
#include <sstream>
#include <string>
#include <vector>


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
    if (c && n == name) v = c->value.load();
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
    if (c && c->value.load()) names.push_back(n);
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
    if (c && c->value.load()) os << "Counter: " << n << "\n  Value: " << c->value.load() << "\n";
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
// ---- end lazytensor/debug/metrics.hpp ----
// ---- begin lazytensor/ops/matmul.hpp ----
// matmul, linear, bmm, and the GEMM's derivative rule, over GemmNode (graph/matmul_node.hpp):
// the packed GEMM kernel (graph/gemm_kernel.hpp) for float and double products of at least a
// register tile, Eigen GEMM on maps of the buffers otherwise. Transposes are layouts (a
// pending transpose of the last two dims is read through, never copied), and a GEMM that
// feeds only an element-wise expression runs in row blocks with that expression applied to
// each block while it is in cache (see ElementwiseNode::fuse_producers).

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

// ---- begin lazytensor/core/autocast.hpp ----
// Mixed precision as torch.autocast: while an AutocastGuard is alive on a thread, the
// products of float tensors (matmul, linear, bmm, conv2d) run in bfloat16: their operands
// are rounded to bfloat16, the products accumulate in float, and the result is rounded to
// bfloat16 (and held in a float tensor, so the program's types do not change). Everything
// else keeps its inputs' dtype. Thread-local, as torch's: every replica thread sets its own.


namespace lazy {

namespace detail {
struct AutocastState {
  bool enabled = false;
  DType dtype = DType::BFloat16;
};
inline AutocastState& autocast_state() {
  thread_local AutocastState state;
  return state;
}
}  // namespace detail

/// True while an enabled AutocastGuard is alive on this thread.
inline bool is_autocast_enabled() { return detail::autocast_state().enabled; }
/// The dtype products run in under autocast (bfloat16).
inline DType get_autocast_dtype() { return detail::autocast_state().dtype; }

/// Turns autocast on (or, with `enabled` false, off) for this thread until destroyed;
/// guards nest. DTypeError for a dtype other than bfloat16 (the one lower precision CPUs
/// run products in).
class AutocastGuard {
 public:
  explicit AutocastGuard(bool enabled = true, DType dtype = DType::BFloat16) : saved_(detail::autocast_state()) {
    if (dtype != DType::BFloat16) {
      throw DTypeError("AutocastGuard: expected dtype bfloat16, got " + dtype_name(dtype));
    }
    detail::autocast_state() = {enabled, dtype};
  }
  ~AutocastGuard() { detail::autocast_state() = saved_; }
  AutocastGuard(const AutocastGuard&) = delete;
  AutocastGuard& operator=(const AutocastGuard&) = delete;

 private:
  detail::AutocastState saved_;
};

}  // namespace lazy
// ---- end lazytensor/core/autocast.hpp ----
// ---- begin lazytensor/graph/matmul_node.hpp ----
// GemmNode, the node behind matmul, linear and bmm: a batch of row-major products, on the
// packed kernel (graph/gemm_kernel.hpp) for float and double products of at least a register
// tile and on Eigen otherwise, produced in row blocks so that an element-wise consumer can
// run on each block while it is in cache (RowProducer, ElementwiseNode::fuse_producers).

#include <algorithm>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>

// ---- begin lazytensor/graph/eigen_gemm.hpp ----
// The products that do not run on the packed kernel (integer dtypes, products thinner than a
// register tile; the convolution's weight gradient), on Eigen's GEMM over maps of the buffers.
//
// A function template of its own, declared here and defined only where the runtime is
// defined: header-only, the headers define it; with the compiled runtime the library
// instantiates it for the four GEMM dtypes (core/config.hpp), so a user TU neither
// instantiates it nor parses Eigen.

#include <cstdint>


#if LAZYTENSOR_HEADER_DEFINITIONS
#include <Eigen/Core>
#endif

namespace lazy::graph::detail {

/// Rows [row, row + rows) of op(A) * op(B) into c (row-major, n columns, already offset to
/// the first row), with A stored m x k (k x m when `ta`) and B k x n (n x k when `tb`).
/// T: float, double, int32 or int64.
template <class T>
void eigen_gemm_rows(const T* a, const T* b, T* c, bool ta, bool tb, std::int64_t m, std::int64_t k,
                     std::int64_t n, std::int64_t row, std::int64_t rows);

#if LAZYTENSOR_HEADER_DEFINITIONS
template <class T>
void eigen_gemm_rows(const T* a, const T* b, T* c, bool ta, bool tb, std::int64_t m, std::int64_t k,
                     std::int64_t n, std::int64_t row, std::int64_t rows) {
  using Mat = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  using CMap = Eigen::Map<const Mat>;
  Eigen::Map<Mat> C(c, rows, n);
  if (k == 0) {
    C.setZero();
    return;
  }
  auto run = [&](const auto& A) {
    if (tb) C.noalias() = A * CMap(b, n, k).transpose();
    else C.noalias() = A * CMap(b, k, n);
  };
  if (ta) run(CMap(a, k, m).middleCols(row, rows).transpose());
  else run(CMap(a, m, k).middleRows(row, rows));
}
#endif  // LAZYTENSOR_HEADER_DEFINITIONS

/// D += G * C^T for row-major G [rows x inner], C [cols x inner] (both dense) and D
/// [rows x cols] with row stride `ldd` (a block of columns of a wider matrix). T: float or
/// double. The convolution's weight gradient, image by image.
template <class T>
void eigen_gemm_add_nt(const T* g, const T* c, T* d, std::int64_t rows, std::int64_t cols, std::int64_t inner,
                       std::int64_t ldd);

#if LAZYTENSOR_HEADER_DEFINITIONS
template <class T>
void eigen_gemm_add_nt(const T* g, const T* c, T* d, std::int64_t rows, std::int64_t cols, std::int64_t inner,
                       std::int64_t ldd) {
  using Mat = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  using Stride = Eigen::OuterStride<>;
  Eigen::Map<Mat, 0, Stride> D(d, rows, cols, Stride(ldd));
  Eigen::Map<const Mat> G(g, rows, inner);
  Eigen::Map<const Mat> C(c, cols, inner);
  D.noalias() += G * C.transpose();
}
#endif  // LAZYTENSOR_HEADER_DEFINITIONS

}  // namespace lazy::graph::detail

// Instantiated once in the compiled runtime (core/config.hpp).
#define LAZYTENSOR_EIGEN_GEMM_INSTANCES(P, T)                                                             \
  P template void lazy::graph::detail::eigen_gemm_rows<T>(const T*, const T*, T*, bool, bool, std::int64_t, \
                                                          std::int64_t, std::int64_t, std::int64_t, std::int64_t);
#define LAZYTENSOR_EIGEN_GEMM_ADD_NT_INSTANCES(P, T)                                                        \
  P template void lazy::graph::detail::eigen_gemm_add_nt<T>(const T*, const T*, T*, std::int64_t, std::int64_t, \
                                                            std::int64_t, std::int64_t);
#if LAZYTENSOR_EXPLICIT_INSTANTIATION
LAZYTENSOR_EIGEN_GEMM_ADD_NT_INSTANCES(extern, float)
LAZYTENSOR_EIGEN_GEMM_ADD_NT_INSTANCES(extern, double)
LAZYTENSOR_EIGEN_GEMM_INSTANCES(extern, float)
LAZYTENSOR_EIGEN_GEMM_INSTANCES(extern, double)
LAZYTENSOR_EIGEN_GEMM_INSTANCES(extern, std::int32_t)
LAZYTENSOR_EIGEN_GEMM_INSTANCES(extern, std::int64_t)
#endif
// ---- end lazytensor/graph/eigen_gemm.hpp ----
// ---- begin lazytensor/graph/gemm_kernel.hpp ----
// The packed GEMM for float and double: the right-hand side is packed once per product
// into panels two SIMD registers wide and shared by every row block and thread; each row
// block packs a few rows of the left-hand side at a time and runs a register-tiled
// micro-kernel over all panels. Eigen's GEMM (the other dtypes, thin products) re-packs
// the right-hand side on every call and, on the AVX-512 machine we measure, runs at 60-70%
// of this kernel's rate (docs/architecture.md, "GEMM").
//
// Determinism: every output element is one FMA chain over k in order, split at depth
// blocks fixed by k alone, so the bits depend on the shapes only (not on row blocks,
// threads or which tile an element falls in).

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <xsimd/xsimd.hpp>

// Full unrolling keeps the accumulator tile in registers at -O2 too.
#if defined(__clang__)
#define LAZYTENSOR_UNROLL _Pragma("unroll")
#elif defined(__GNUC__)
#define LAZYTENSOR_UNROLL _Pragma("GCC unroll 16")
#else
#define LAZYTENSOR_UNROLL
#endif

namespace lazy::detail {

/// Packed GEMM kernel for T = float or double (see the file comment).
template <class T>
struct PackedGemm {
  using batch = xsimd::batch<T>;
  static constexpr int kLanes = static_cast<int>(batch::size);
  /// Rows of the register tile: 8 x 2 accumulators need the 32 registers of AVX-512;
  /// 16-register instruction sets (SSE2, AVX2) take 6 x 2: twelve accumulators, two B
  /// registers and one broadcast (BLIS's Haswell/Zen shape), eight FMAs per three loads
  /// and broadcasts where 4 x 2 had eight per six.
  static constexpr int kTileRows = XSIMD_WITH_AVX512F ? 8 : 6;
  /// Columns of the register tile (and of a packed panel): two registers.
  static constexpr int kTileCols = 2 * kLanes;

  /// True when the shapes suit the kernel: narrower or shorter products waste most of a
  /// tile on padding and go to Eigen (a decision made from the shapes alone).
  static bool suits(std::int64_t rows, std::int64_t n) { return n >= kLanes && rows >= kTileRows; }

  /// Depth of one pass over k: short enough that a packed row panel stays in L1.
  static std::int64_t depth_block(std::int64_t k) { return k <= 1024 ? k : 512; }

  /// Panels of kTileCols columns covering n columns.
  static std::int64_t panels(std::int64_t n) { return (n + kTileCols - 1) / kTileCols; }

  /// Elements of op(B) packed (k x n, columns padded to whole panels).
  static std::int64_t packed_size(std::int64_t k, std::int64_t n) {
    return k * panels(n) * kTileCols;
  }

  /// Packs panels [p0, p1) of op(B) (k x n; stored k x n, or n x k when `transposed`) into
  /// `out` (packed_size elements, aligned): panel p holds columns [p*kTileCols, ...) as k
  /// rows of kTileCols contiguous values, zero past n.
  static void pack_b(const T* b, bool transposed, std::int64_t k, std::int64_t n, T* out,
                     std::int64_t p0, std::int64_t p1) {
    if (!transposed) {
      // Row by row of B across the range's panels, so each source row is read once, front
      // to back. Panel by panel, every 128-byte read jumps a whole row ahead, which the
      // prefetcher follows poorly (256 x 784 from memory: 75 us against 46 us).
      const std::int64_t full = std::min(p1, n / kTileCols);  // panels without padding
      for (std::int64_t kk = 0; kk < k; ++kk) {
        const T* src = b + kk * n;
        for (std::int64_t p = p0; p < full; ++p) {
          T* row = out + (p * k + kk) * kTileCols;
          batch::load_unaligned(src + p * kTileCols).store_aligned(row);
          batch::load_unaligned(src + p * kTileCols + kLanes).store_aligned(row + kLanes);
        }
        for (std::int64_t p = std::max(p0, full); p < p1; ++p) {
          const std::int64_t cols = std::min<std::int64_t>(kTileCols, n - p * kTileCols);
          T* row = out + (p * k + kk) * kTileCols;
          for (std::int64_t j = 0; j < kTileCols; ++j)
            row[j] = j < cols ? src[p * kTileCols + j] : T(0);
        }
      }
      return;
    }
    for (std::int64_t p = p0; p < p1; ++p) {
      const std::int64_t j0 = p * kTileCols, cols = std::min<std::int64_t>(kTileCols, n - j0);
      T* dst = out + p * k * kTileCols;
      // Stored [n, k]: 16 k-values of each column at a time, so each source line is read
      // once while the destination rows are still in cache (16 x 16 register transposes
      // where available).
      for (std::int64_t k0 = 0; k0 < k; k0 += 16) {
        const std::int64_t k1 = std::min<std::int64_t>(k, k0 + 16);
        if (transpose_16x16(b + j0 * k + k0, k, dst + k0 * kTileCols, cols, k1 - k0)) continue;
        for (std::int64_t j = 0; j < kTileCols; ++j) {
          if (j < cols) {
            const T* src = b + (j0 + j) * k;
            for (std::int64_t kk = k0; kk < k1; ++kk) dst[kk * kTileCols + j] = src[kk];
          } else {
            for (std::int64_t kk = k0; kk < k1; ++kk) dst[kk * kTileCols + j] = T(0);
          }
        }
      }
    }
  }

  /// Rows [r0, r0 + rows) of op(A) * op(B) into c (row-major, n columns, already offset
  /// to row r0). op(A) is m x k, stored m x k or, when `a_transposed`, k x m. `packed_b`
  /// comes from pack_b.
  static void multiply(const T* a, bool a_transposed, std::int64_t m, std::int64_t k,
                       std::int64_t n, const T* packed_b, T* c, std::int64_t r0,
                       std::int64_t rows) {
    const std::int64_t kc = depth_block(k), np = panels(n);
    const std::int64_t tiles = (rows + kTileRows - 1) / kTileRows;
    alignas(64) T tile[kTileRows * kTileCols] = {};
    thread_local std::vector<T, xsimd::aligned_allocator<T, 64>> packed_a;
    if (static_cast<std::int64_t>(packed_a.size()) < tiles * kTileRows * kc)
      packed_a.resize(tiles * kTileRows * kc);
    for (std::int64_t k0 = 0; k0 < k; k0 += kc) {
      const std::int64_t kb = std::min(kc, k - k0);
      const bool accumulate = k0 > 0;
      // All rows of the block packed first; then each panel of op(B) (k x 2 registers) is
      // loaded into L2 once and used by every tile of rows, instead of all of op(B) once
      // per tile.
      for (std::int64_t t = 0; t < tiles; ++t)
        pack_a(a, a_transposed, m, k, r0 + t * kTileRows,
               std::min<std::int64_t>(kTileRows, rows - t * kTileRows), k0, kb,
               packed_a.data() + t * kTileRows * kb);
      for (std::int64_t p = 0; p < np; ++p) {
        const std::int64_t j0 = p * kTileCols, tc = std::min<std::int64_t>(kTileCols, n - j0);
        const T* bp = packed_b + p * k * kTileCols + k0 * kTileCols;
        for (std::int64_t t = 0; t < tiles; ++t) {
          const std::int64_t i0 = t * kTileRows, tr = std::min<std::int64_t>(kTileRows, rows - i0);
          const T* ap = packed_a.data() + t * kTileRows * kb;
          T* cp = c + i0 * n + j0;
          if (tr == kTileRows && tc == kTileCols) {
            micro(ap, bp, kb, cp, n, accumulate);
            continue;
          }
          // An edge tile runs the same arithmetic on a full tile in registers' image.
          if (accumulate)
            for (std::int64_t i = 0; i < tr; ++i) std::copy_n(cp + i * n, tc, tile + i * kTileCols);
          micro(ap, bp, kb, tile, kTileCols, accumulate);
          for (std::int64_t i = 0; i < tr; ++i) std::copy_n(tile + i * kTileCols, tc, cp + i * n);
        }
      }
    }
  }

 private:
  // dst[kk * kTileCols + j] = src[j * ld + kk] for a whole panel (cols == kTileCols = 32)
  // and 16 k-values, with AVX-512 float registers; false (nothing written) otherwise.
  static bool transpose_16x16([[maybe_unused]] const T* src, [[maybe_unused]] std::int64_t ld,
                              [[maybe_unused]] T* dst, std::int64_t cols, std::int64_t depth) {
#if defined(__AVX512F__)
    if constexpr (std::is_same_v<T, float> && kTileCols == 32) {
      if (cols != kTileCols || depth != 16) return false;
      for (int half = 0; half < 2; ++half) {
        __m512 r[16], t[16];
        for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(src + (half * 16 + i) * ld);
        // Pairs of rows interleaved, then pairs of pairs: lane L of u[4i + q] then holds
        // column 4L + q of rows 4i .. 4i + 3.
        for (int i = 0; i < 8; ++i) {
          t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
          t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
        }
        auto pd = [](__m512 x) { return _mm512_castps_pd(x); };
        for (int i = 0; i < 4; ++i) {
          r[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(pd(t[4 * i]), pd(t[4 * i + 2])));
          r[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(pd(t[4 * i]), pd(t[4 * i + 2])));
          r[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(pd(t[4 * i + 1]), pd(t[4 * i + 3])));
          r[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(pd(t[4 * i + 1]), pd(t[4 * i + 3])));
        }
        // Gather lane L of the four row groups into output row 4L + q.
        for (int q = 0; q < 4; ++q) {
          const __m512 v0 = _mm512_shuffle_f32x4(r[q], r[4 + q], 0x88),
                       w0 = _mm512_shuffle_f32x4(r[q], r[4 + q], 0xDD);
          const __m512 v1 = _mm512_shuffle_f32x4(r[8 + q], r[12 + q], 0x88),
                       w1 = _mm512_shuffle_f32x4(r[8 + q], r[12 + q], 0xDD);
          _mm512_store_ps(dst + (0 + q) * kTileCols + half * 16,
                          _mm512_shuffle_f32x4(v0, v1, 0x88));
          _mm512_store_ps(dst + (8 + q) * kTileCols + half * 16,
                          _mm512_shuffle_f32x4(v0, v1, 0xDD));
          _mm512_store_ps(dst + (4 + q) * kTileCols + half * 16,
                          _mm512_shuffle_f32x4(w0, w1, 0x88));
          _mm512_store_ps(dst + (12 + q) * kTileCols + half * 16,
                          _mm512_shuffle_f32x4(w0, w1, 0xDD));
        }
      }
      return true;
    }
#endif
    (void)cols;
    (void)depth;
    return false;
  }

  // out[kk * 8 + i] = src[i * ld + kk] for 8 rows and the first multiple of 8 of `depth`
  // k-values, by 8 x 8 register transposes where float AVX registers exist (the tile of
  // AVX-512 has 8 rows). Returns how many k-values it packed (0: none).
  static std::int64_t transpose_rows_8([[maybe_unused]] const T* src,
                                       [[maybe_unused]] std::int64_t ld,
                                       [[maybe_unused]] std::int64_t depth,
                                       [[maybe_unused]] T* out) {
#if defined(__AVX512F__)
    if constexpr (std::is_same_v<T, float> && kTileRows == 8) {
      const std::int64_t whole = depth / 8 * 8;
      for (std::int64_t kk = 0; kk < whole; kk += 8) {
        __m256 r[8], t[8];
        for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(src + i * ld + kk);
        // Interleave pairs of rows, then pairs of pairs: r[c] then holds k-value c of rows
        // 0-3 in its low half and k-value c + 4 in its high half (rows 4-7 in r[c + 4]).
        for (int i = 0; i < 4; ++i) {
          t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
          t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
        }
        for (int h = 0; h < 2; ++h) {
          r[4 * h + 0] = _mm256_shuffle_ps(t[4 * h], t[4 * h + 2], 0x44);
          r[4 * h + 1] = _mm256_shuffle_ps(t[4 * h], t[4 * h + 2], 0xEE);
          r[4 * h + 2] = _mm256_shuffle_ps(t[4 * h + 1], t[4 * h + 3], 0x44);
          r[4 * h + 3] = _mm256_shuffle_ps(t[4 * h + 1], t[4 * h + 3], 0xEE);
        }
        for (int c = 0; c < 4; ++c) {
          _mm256_store_ps(out + (kk + c) * 8, _mm256_permute2f128_ps(r[c], r[4 + c], 0x20));
          _mm256_store_ps(out + (kk + c + 4) * 8, _mm256_permute2f128_ps(r[c], r[4 + c], 0x31));
        }
      }
      return whole;
    }
#endif
    return 0;
  }

  // Rows [row, row + tr) and depth [k0, k0 + kb) of op(A), k-major in tiles of kTileRows
  // (zero past tr).
  static void pack_a(const T* a, bool transposed, std::int64_t m, std::int64_t k, std::int64_t row,
                     std::int64_t tr, std::int64_t k0, std::int64_t kb, T* out) {
    if (transposed) {
      for (std::int64_t kk = 0; kk < kb; ++kk) {
        const T* src = a + (k0 + kk) * m + row;
        T* dst = out + kk * kTileRows;
        // A fixed-length copy: one vector move, not a library call (an element loop
        // compiles to kTileRows scalar moves, src and dst may alias as far as GCC knows).
        if (tr == kTileRows) {
          std::memcpy(dst, src, sizeof(T) * kTileRows);
        } else {
          for (int i = 0; i < kTileRows; ++i) dst[i] = i < tr ? src[i] : T(0);
        }
      }
      return;
    }
    std::int64_t done = 0;
    if (tr == kTileRows) done = transpose_rows_8(a + row * k + k0, k, kb, out);
    for (std::int64_t i = 0; i < kTileRows; ++i) {
      if (i < tr) {
        const T* src = a + (row + i) * k + k0;
        for (std::int64_t kk = done; kk < kb; ++kk) out[kk * kTileRows + i] = src[kk];
      } else {
        for (std::int64_t kk = 0; kk < kb; ++kk) out[kk * kTileRows + i] = T(0);
      }
    }
  }

  // One kTileRows x kTileCols tile: c (row stride ldc) = [c +] ap * bp over kb.
  static void micro(const T* __restrict ap, const T* __restrict bp, std::int64_t kb, T* c,
                    std::int64_t ldc, bool accumulate) {
    batch acc[kTileRows][2];
    LAZYTENSOR_UNROLL
    for (int i = 0; i < kTileRows; ++i) {
      if (accumulate) {
        acc[i][0] = batch::load_unaligned(c + i * ldc);
        acc[i][1] = batch::load_unaligned(c + i * ldc + kLanes);
      } else {
        acc[i][0] = batch(T(0));
        acc[i][1] = batch(T(0));
      }
    }
    for (std::int64_t kk = 0; kk < kb; ++kk) {
      const batch b0 = batch::load_aligned(bp + kk * kTileCols);
      const batch b1 = batch::load_aligned(bp + kk * kTileCols + kLanes);
      LAZYTENSOR_UNROLL
      for (int i = 0; i < kTileRows; ++i) {
        const batch av(ap[kk * kTileRows + i]);
        acc[i][0] = xsimd::fma(av, b0, acc[i][0]);
        acc[i][1] = xsimd::fma(av, b1, acc[i][1]);
      }
    }
    LAZYTENSOR_UNROLL
    for (int i = 0; i < kTileRows; ++i) {
      acc[i][0].store_unaligned(c + i * ldc);
      acc[i][1].store_unaligned(c + i * ldc + kLanes);
    }
  }
};

}  // namespace lazy::detail

#undef LAZYTENSOR_UNROLL
// ---- end lazytensor/graph/gemm_kernel.hpp ----

namespace lazy::graph {

/// An operand as a GEMM reads it.
struct GemmOperand {
  NodePtr node;
  bool transposed;  ///< the node holds [.., cols, rows] and is read transposed
};

/// What the SPMD partitioner needs of a product: its operands' layouts and sizes, and the
/// same product over blocks.
class BlockGemm {
 public:
  virtual ~BlockGemm() = default;
  virtual bool a_transposed() const = 0;
  virtual bool b_transposed() const = 0;
  virtual std::int64_t batch_a() const = 0;
  virtual std::int64_t batch_b() const = 0;
  virtual std::int64_t rows() const = 0;
  virtual std::int64_t depth() const = 0;
  virtual std::int64_t cols() const = 0;
  /// The product of [m, k] and [k, n] blocks, of shape `out` (m x n elements), on
  /// `device`, not submitted.
  virtual NodePtr with_operands(GemmOperand a, GemmOperand b, std::int64_t m, std::int64_t k, std::int64_t n,
                                Shape out, Device* device) const = 0;
};

/// C[b] = op(A[b]) * op(B[b]) for a batch of row-major matrices; op is identity or
/// transpose. A batch count of 1 on either side broadcasts.
template <Element T>
class GemmNode final : public Node, public RowProducer, public BlockGemm {
 public:
  using Operand = GemmOperand;

  GemmNode(Operand a, Operand b, std::int64_t batch_a, std::int64_t batch_b, std::int64_t m, std::int64_t k,
           std::int64_t n, Shape out_shape, Device* device)
      : Node(NodeKind::Gemm, dtype_of<T>(), out_shape, device, {a.node, b.node}), ta_(a.transposed),
        tb_(b.transposed), batch_a_(batch_a), batch_b_(batch_b), m_(m), k_(k), n_(n) {}

  bool a_transposed() const override { return ta_; }
  bool b_transposed() const override { return tb_; }
  std::int64_t batch_a() const override { return batch_a_; }
  std::int64_t batch_b() const override { return batch_b_; }
  std::int64_t rows() const override { return m_; }
  std::int64_t depth() const override { return k_; }
  std::int64_t cols() const override { return n_; }
  NodePtr with_operands(GemmOperand a, GemmOperand b, std::int64_t m, std::int64_t k, std::int64_t n, Shape out,
                        Device* device) const override {
    return std::make_shared<GemmNode>(std::move(a), std::move(b), 1, 1, m, k, n, out, device);
  }

  std::string op_name() const override { return "matmul"; }
  std::string describe() const override {
    return std::string("matmul(%0") + (ta_ ? "^T" : "") + ", %1" + (tb_ ? "^T" : "") + ") [" + std::to_string(m_) +
           "x" + std::to_string(k_) + "] x [" + std::to_string(k_) + "x" + std::to_string(n_) + "]";
  }
  double cost_per_element() const override { return 2.0 * static_cast<double>(k_); }
  std::uint64_t structural_hash() const override {
    return hash_combine(Node::structural_hash(), (ta_ ? 1u : 0u) | (tb_ ? 2u : 0u));
  }

  /// Rows per block. Eigen's blocking (and so the order of its k-sums) depends on the rows
  /// of a call, so blocks are fixed by the shapes alone; each Eigen call re-packs the
  /// right-hand side, so its blocks are as tall as the epilogue's cache allows (128 rows).
  /// The packed kernel's sums do not depend on the blocks and it packs the right-hand side
  /// once, so its blocks are shorter (64 rows: even splits of common batches over threads).
  /// A small product is one block.
  std::int64_t row_block() const override {
    const std::int64_t rows = m_ * std::max(batch_a_, batch_b_);
    if (rows * n_ * k_ <= (std::int64_t(1) << 16)) return std::max<std::int64_t>(rows, 1);
    return packed() ? 64 : 128;
  }

  /// Packs the right-hand side of every batch for the packed kernel (nothing for Eigen).
  void begin_rows(ExecContext& ctx) override {
    if (!packed()) return;
    if constexpr (kHasPackedKernel) {
      const std::int64_t size = Kernel::packed_size(k_, n_);
      const std::int64_t panels = Kernel::panels(n_), jobs = batch_b_ * panels;
      packed_b_ = ctx.device.pool().acquire(padded_bytes(batch_b_ * size, sizeof(T)));
      T* out = static_cast<T*>(packed_b_->data());
      const T* b = inputs()[1]->template data<T>();
      auto& pool = ctx.device.threads();
      const std::int64_t tasks = std::min(jobs, task_count(pool, batch_b_ * k_ * n_, 1.0));
      pool.parallel_for(tasks, [&](std::int64_t t) {
        auto [q0, q1] = task_range(jobs, tasks, t);
        // One call per batch the task's panels fall in (pack_b reads rows across them).
        for (std::int64_t q = q0; q < q1;) {
          const std::int64_t bi = q / panels, p = q % panels, count = std::min(q1 - q, panels - p);
          Kernel::pack_b(b + bi * k_ * n_, tb_, k_, n_, out + bi * size, p, p + count);
          q += count;
        }
      });
    }
  }
  void end_rows() override { packed_b_.reset(); }

  void produce_rows(void* out, std::int64_t r0, std::int64_t r1) override {
    T* c = static_cast<T*>(out);
    const T* a = inputs()[0]->template data<T>();
    const T* b = inputs()[1]->template data<T>();
    const std::int64_t block = row_block();
    const bool use_packed = packed();
    if (use_packed && !packed_b_)
      throw std::logic_error("matmul: rows produced outside begin_rows/end_rows");
    // Rows of the output run over (batch, m); a range may span several batches. Calls are
    // cut at block boundaries and batch ends only (see row_block).
    while (r0 < r1) {
      const std::int64_t bi = r0 / m_, row = r0 % m_;
      const std::int64_t rows = std::min({r1 - r0, m_ - row, (r0 / block + 1) * block - r0});
      const T* ab = a + (batch_a_ == 1 ? 0 : bi) * m_ * k_;
      if constexpr (kHasPackedKernel) {
        if (use_packed) {
          const T* pb = static_cast<const T*>(packed_b_->data()) +
                        (batch_b_ == 1 ? 0 : bi) * Kernel::packed_size(k_, n_);
          Kernel::multiply(ab, ta_, m_, k_, n_, pb, c + r0 * n_, row, rows);
          r0 += rows;
          continue;
        }
      }
      gemm_block(ab, b + (batch_b_ == 1 ? 0 : bi) * k_ * n_, c + r0 * n_, row, rows);
      r0 += rows;
    }
  }

 protected:
  void compute(ExecContext& ctx) override {
    auto buf = allocate_output(ctx, false);
    auto& pool = ctx.device.threads();
    const std::int64_t rows = m_ * std::max(batch_a_, batch_b_);
    if (n_ == 0 || rows == 0) {
      set_buffer(std::move(buf));
      return;
    }
    if (k_ == 0) {
      std::fill_n(static_cast<T*>(buf->data()), rows * n_, T(0));
      set_buffer(std::move(buf));
      return;
    }
    // Whole blocks per task (row_block): the same GEMM calls whatever the thread count.
    const std::int64_t block = row_block(), blocks = (rows + block - 1) / block;
    const std::int64_t tasks =
        std::max<std::int64_t>(1, std::min<std::int64_t>(task_count(pool, rows * n_, cost_per_element()), blocks));
    void* out = buf->data();
    {
      RowProducer::Session session(*this, ctx);
      pool.parallel_for(tasks, [&](std::int64_t t) {
        auto [b0, b1] = task_range(blocks, tasks, t);
        produce_rows(out, b0 * block, std::min(rows, b1 * block));
      });
    }
    set_buffer(std::move(buf));
  }

 private:
  static constexpr bool kHasPackedKernel = std::is_same_v<T, float> || std::is_same_v<T, double>;
  using Kernel = lazy::detail::PackedGemm<std::conditional_t<kHasPackedKernel, T, float>>;

  /// True when this product runs on the packed kernel (decided by dtype and shapes only).
  bool packed() const {
    if constexpr (kHasPackedKernel)
      return k_ > 0 && Kernel::suits(m_ * std::max(batch_a_, batch_b_), n_);
    else
      return false;
  }

  // Rows [row, row + rows) of op(A) * op(B) for one batch, into c (already offset).
  void gemm_block(const T* a, const T* b, T* c, std::int64_t row, std::int64_t rows) const {
    if constexpr (std::is_same_v<T, bool> || std::is_same_v<T, bfloat16>) {
      throw DTypeError("matmul: no product of " + dtype_name(dtype_of<T>()) + " values");  // ops/matmul.hpp refuses first
    } else {
      detail::eigen_gemm_rows(a, b, c, ta_, tb_, m_, k_, n_, row, rows);
    }
  }

  bool ta_, tb_;
  std::int64_t batch_a_, batch_b_, m_, k_, n_;
  std::shared_ptr<Buffer> packed_b_;  ///< op(B) packed, between begin_rows and end_rows
};

}  // namespace lazy::graph
// ---- end lazytensor/graph/matmul_node.hpp ----
// ---- begin lazytensor/graph/transpose_hint.hpp ----
// A node that is the transpose of its input's last two dimensions can say so, so that a
// GEMM reads the source with a transposed layout instead of waiting for the copy.


namespace lazy::graph {

/// Implemented by nodes whose value is `source()` with its last two dimensions swapped.
class TransposeOfLastTwo {
 public:
  virtual ~TransposeOfLastTwo() = default;
  virtual const NodePtr& transpose_source() const = 0;
};

}  // namespace lazy::graph
// ---- end lazytensor/graph/transpose_hint.hpp ----
// ---- begin lazytensor/ops/reduction.hpp ----
// Reductions: sum mean prod max min amax amin argmax argmin any all logsumexp norm.
// Each takes a tensor or an element-wise expression (fused into the reduction loop) and
// returns a pending tensor.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <vector>

// ---- begin lazytensor/ops/shape.hpp ----
// Shape ops, all lazy: views (reshape/view, flatten, squeeze, unsqueeze) share the input's
// buffer, so a view of a pending value is pending and nothing is copied; transpose/permute,
// narrow/slice, cat/stack, index_select, gather and one_hot build the copy nodes of
// graph/shape_nodes.hpp; expand is a broadcasting element-wise node. Each op records its
// backward (graph/shape_backward.hpp holds the scatter kernels those need).
//
// This header includes the four that hold them: ops/reshape.hpp (views, permutations,
// expand), ops/slice.hpp (slicing, cat/stack), ops/indexing.hpp (index_select, gather,
// one_hot), and ops/shape_helpers.hpp (what they share).

// ---- begin lazytensor/ops/indexing.hpp ----
// Indexing by tensors: index_select, gather and one_hot. The index may still be pending, so
// its values are checked by the kernels (graph/shape_nodes.hpp), which raise IndexError at
// the mark_step or read that runs them; the gradients are scatter-adds (graph/shape_backward.hpp).

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

// ---- begin lazytensor/graph/shape_backward.hpp ----
// Kernels that only backward passes need: the adjoints of slicing, index_select and gather
// (write or add a gradient into a zero tensor of the input's shape). Accumulation order is
// fixed (by index position), and work is split only where no two tasks touch the same
// output element, so results do not depend on the thread count.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>


namespace lazy::graph {

/// The gradient of a slice: zeros of the input's shape with `g` at the sliced positions.
template <Element T>
class SliceBackwardNode final : public Node {
 public:
  SliceBackwardNode(NodePtr g, Shape in_shape, int dim, std::int64_t start, std::int64_t step)
      : Node(NodeKind::Copy, dtype_of<T>(), in_shape, g->device(), {g}), dim_(dim), start_(start), step_(step) {}
  std::string op_name() const override { return "slice_backward"; }
  std::uint64_t structural_hash() const override {
    return hash_combine(hash_combine(hash_combine(Node::structural_hash(), static_cast<std::uint64_t>(dim_)),
                                     static_cast<std::uint64_t>(start_)),
                        static_cast<std::uint64_t>(step_));
  }

 protected:
  void compute(ExecContext& ctx) override {
    const T* g = inputs()[0]->template data<T>();
    const Shape& gs = inputs()[0]->shape();
    auto buf = allocate_output(ctx, false);
    T* out = static_cast<T*>(buf->data());
    const Shape& s = shape();
    std::int64_t outer = 1, inner = 1;
    for (int d = 0; d < dim_; ++d) outer *= s[d];
    for (int d = dim_ + 1; d < s.rank(); ++d) inner *= s[d];
    const std::int64_t dsize = s[dim_], len = gs[dim_];
    auto& pool = ctx.device.threads();
    const std::int64_t tasks = std::max<std::int64_t>(1, std::min(outer, task_count(pool, numel(), 1.0)));
    pool.parallel_for(tasks, [&](std::int64_t t) {
      auto [o0, o1] = task_range(outer, tasks, t);
      for (std::int64_t o = o0; o < o1; ++o) {
        T* row = out + o * dsize * inner;
        std::fill(row, row + dsize * inner, T(0));
        for (std::int64_t k = 0; k < len; ++k) {
          std::memcpy(row + (start_ + k * step_) * inner, g + (o * len + k) * inner,
                      static_cast<std::size_t>(inner) * sizeof(T));
        }
      }
    });
    set_buffer(std::move(buf));
  }

 private:
  int dim_;
  std::int64_t start_, step_;
};

/// index_add into zeros: out[.., index[k], ..] += g[.., k, ..] along `dim` (the gradient of
/// index_select; embeddings). Tasks split the (outer, inner) plane, each adding over k in
/// order.
template <Element T, IndexElement I>
class IndexAddNode final : public Node {
 public:
  IndexAddNode(NodePtr g, NodePtr index, Shape in_shape, int dim)
      : Node(NodeKind::Copy, dtype_of<T>(), in_shape, g->device(), {g, index}), dim_(dim) {}
  std::string op_name() const override { return "index_add"; }
  std::uint64_t structural_hash() const override {
    return hash_combine(Node::structural_hash(), static_cast<std::uint64_t>(dim_));
  }

 protected:
  void compute(ExecContext& ctx) override {
    const T* g = inputs()[0]->template data<T>();
    const I* idx = inputs()[1]->template data<I>();
    const std::int64_t K = inputs()[1]->numel();
    auto buf = allocate_output(ctx, false);
    T* out = static_cast<T*>(buf->data());
    const Shape& s = shape();
    std::int64_t outer = 1, inner = 1;
    for (int d = 0; d < dim_; ++d) outer *= s[d];
    for (int d = dim_ + 1; d < s.rank(); ++d) inner *= s[d];
    const std::int64_t dsize = s.rank() ? s[dim_] : 1;
    for (std::int64_t k = 0; k < K; ++k) {
      if (idx[k] < 0 || idx[k] >= dsize) {
        throw IndexError("index_add: index " + std::to_string(idx[k]) + " is out of range for dimension " +
                         std::to_string(dim_) + " with size " + std::to_string(dsize));
      }
    }
    using C = compute_t<T>;
    constexpr std::int64_t kCols = 256;
    const std::int64_t chunks = (inner + kCols - 1) / kCols, units = outer * chunks;
    auto& pool = ctx.device.threads();
    const std::int64_t tasks = std::max<std::int64_t>(1, std::min(units, task_count(pool, numel() + K * inner, 1.0)));
    pool.parallel_for(tasks, [&](std::int64_t t) {
      auto [u0, u1] = task_range(units, tasks, t);
      for (std::int64_t u = u0; u < u1; ++u) {
        const std::int64_t o = u / chunks, j0 = (u % chunks) * kCols, j1 = std::min(inner, j0 + kCols);
        T* base = out + o * dsize * inner;
        for (std::int64_t r = 0; r < dsize; ++r) std::fill(base + r * inner + j0, base + r * inner + j1, T(0));
        for (std::int64_t k = 0; k < K; ++k) {
          T* dst = base + static_cast<std::int64_t>(idx[k]) * inner;
          const T* src = g + (o * K + k) * inner;
          for (std::int64_t j = j0; j < j1; ++j) dst[j] = static_cast<T>(static_cast<C>(dst[j]) + static_cast<C>(src[j]));
        }
      }
    });
    set_buffer(std::move(buf));
  }

 private:
  int dim_;
};

/// scatter_add into zeros: out[.., index[p], ..] += g[p] along `dim` for every position p of
/// the index (the gradient of gather). Positions that differ outside `dim` never collide,
/// so tasks split the index's outermost other dimension.
template <Element T, IndexElement I>
class ScatterAddNode final : public Node {
 public:
  ScatterAddNode(NodePtr g, NodePtr index, Shape in_shape, int dim)
      : Node(NodeKind::Copy, dtype_of<T>(), in_shape, g->device(), {g, index}), dim_(dim) {}
  std::string op_name() const override { return "scatter_add"; }
  std::uint64_t structural_hash() const override {
    return hash_combine(Node::structural_hash(), static_cast<std::uint64_t>(dim_));
  }

 protected:
  void compute(ExecContext& ctx) override {
    const T* g = inputs()[0]->template data<T>();
    const I* idx = inputs()[1]->template data<I>();
    Shape xs = inputs()[1]->shape(), ts = shape();
    if (xs.rank() == 0) xs = Shape{1};
    if (ts.rank() == 0) ts = Shape{1};
    auto buf = allocate_output(ctx, false);
    T* out = static_cast<T*>(buf->data());
    std::fill(out, out + numel(), T(0));
    const int R = xs.rank();
    const std::int64_t n = xs.numel(), dsize = ts[dim_];
    const auto xst = contiguous_strides(xs), tst = contiguous_strides(ts);
    // Split over the outermost dim other than `dim` (all of it in one task when none).
    const int split = dim_ == 0 ? (R > 1 ? 1 : -1) : 0;
    const std::int64_t parts = split < 0 ? 1 : xs[split];
    auto& pool = ctx.device.threads();
    const std::int64_t tasks = std::max<std::int64_t>(1, std::min(parts, task_count(pool, n, 2.0)));
    using C = compute_t<T>;
    pool.parallel_for(tasks, [&](std::int64_t t) {
      auto [p0, p1] = task_range(parts, tasks, t);
      for (std::int64_t p = 0; p < n; ++p) {
        // Coordinates of p in the index; the target replaces coordinate `dim`.
        std::int64_t rem = p, at = 0, part = 0;
        for (int d = 0; d < R; ++d) {
          const std::int64_t c = rem / xst[d];
          rem %= xst[d];
          if (d == split) part = c;
          if (d != dim_) at += c * tst[d];
        }
        if (split >= 0 && (part < p0 || part >= p1)) continue;
        if (split < 0 && t != 0) continue;
        const auto k = static_cast<std::int64_t>(idx[p]);
        if (k < 0 || k >= dsize) {
          throw IndexError("scatter_add: index " + std::to_string(k) + " is out of bounds for dimension " +
                           std::to_string(dim_) + " with size " + std::to_string(dsize));
        }
        T& dst = out[at + k * tst[dim_]];
        dst = static_cast<T>(static_cast<C>(dst) + static_cast<C>(g[p]));
      }
    });
    set_buffer(std::move(buf));
  }

 private:
  int dim_;
};

}  // namespace lazy::graph
// ---- end lazytensor/graph/shape_backward.hpp ----
// ---- begin lazytensor/graph/shape_nodes.hpp ----
// The runtime nodes of the shape ops (ops/shape.hpp): views share their input's buffer;
// permutes, slices, cat, index_select, gather and one_hot copy bytes with one kernel per
// element size (1, 2, 4, 8 bytes), which serves every dtype and keeps the code small (the
// byte-copy helpers are in graph/byte_copy.hpp). Index values may live in tensors that are
// still pending, so they are checked inside the kernel, which throws lazy::IndexError out of
// the mark_step or read that ran it.

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

// ---- begin lazytensor/graph/byte_copy.hpp ----
// The byte-copy helpers of the copy nodes (graph/shape_nodes.hpp): one kernel per element
// size (1, 2, 4, 8 bytes) serves every dtype and keeps the code small. The element copy is a
// constant-size memcpy: one load and one store, valid whatever type wrote the buffer.

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>


namespace lazy::graph::detail {

/// Copies one element of N bytes (see the file comment for why memcpy).
template <std::size_t N>
inline void copy_elem(std::byte* dst, const std::byte* src) {
  std::memcpy(dst, src, N);
}

/// Calls f(std::integral_constant<std::size_t, N>{}) for an element size of N bytes, so a
/// kernel is instantiated once per size instead of once per dtype.
template <class F>
void with_elem_size(std::size_t bytes, F&& f) {
  switch (bytes) {
    case 1: f(std::integral_constant<std::size_t, 1>{}); break;
    case 2: f(std::integral_constant<std::size_t, 2>{}); break;
    case 4: f(std::integral_constant<std::size_t, 4>{}); break;
    default: f(std::integral_constant<std::size_t, 8>{}); break;
  }
}

/// A multi-index over `rank` dims (last fastest) that tracks two linear offsets, `a` and
/// `b`, with their own strides: typically an input offset and an output offset.
struct Odometer {
  int rank = 0;
  std::array<std::int64_t, kMaxRank> size{}, stride_a{}, stride_b{}, idx{};
  std::int64_t a = 0, b = 0;

  /// Positions the multi-index at linear position `lin` (row-major over `size`).
  void seek(std::int64_t lin);
  /// Advances by one position (carry from the last dim).
  void next();
};

/// Fills `segs` equal-length output segments of `len` elements each, segment s copied from
/// the contiguous input run starting at element `src_off(s)`. The split across threads is
/// over output elements, not segments, so one huge segment and a million tiny ones both
/// balance.
template <std::size_t N, class SrcOff>
void copy_segments(ThreadPool& pool, std::byte* dst, const std::byte* src, std::int64_t segs, std::int64_t len,
                   const SrcOff& src_off) {
  const std::int64_t n = segs * len;
  if (n == 0) return;
  const std::int64_t tasks = task_count(pool, n, 1.0);
  pool.parallel_for(tasks, [&](std::int64_t t) {
    auto [b, e] = task_range(n, tasks, t);
    if (len == 1) {  // gathers of single elements: no variable-size memcpy per element
      for (std::int64_t f = b; f < e; ++f) copy_elem<N>(dst + f * N, src + src_off(f) * N);
      return;
    }
    while (b < e) {
      const std::int64_t s = b / len, k = b % len, c = std::min(len - k, e - b);
      std::memcpy(dst + b * N, src + (src_off(s) + k) * N, static_cast<std::size_t>(c) * N);
      b += c;
    }
  });
}

inline const std::byte* bytes_of(const NodePtr& n) { return static_cast<const std::byte*>(n->buffer()->data()); }

}  // namespace lazy::graph::detail

#if LAZYTENSOR_HEADER_DEFINITIONS
namespace lazy::graph::detail {

LAZYTENSOR_INLINE void Odometer::seek(std::int64_t lin) {
  a = b = 0;
  for (int d = rank - 1; d >= 0; --d) {
    idx[d] = lin % size[d];
    lin /= size[d];
    a += idx[d] * stride_a[d];
    b += idx[d] * stride_b[d];
  }
}

LAZYTENSOR_INLINE void Odometer::next() {
  for (int d = rank - 1; d >= 0; --d) {
    ++idx[d];
    a += stride_a[d];
    b += stride_b[d];
    if (idx[d] < size[d]) return;
    a -= stride_a[d] * size[d];
    b -= stride_b[d] * size[d];
    idx[d] = 0;
  }
}

}  // namespace lazy::graph::detail
#endif  // LAZYTENSOR_HEADER_DEFINITIONS
// ---- end lazytensor/graph/byte_copy.hpp ----

namespace lazy::graph {

/// A view: same bytes, another shape. Its kernel only shares the input's buffer, so it
/// costs nothing and the donation rule (buffer use_count == 1) keeps shared data safe.
class ViewNode final : public Node {
 public:
  ViewNode(std::string op, NodePtr in, Shape shape);

  std::string op_name() const override { return op_; }
  std::string describe() const override { return op_ + "(%0) -> " + shape().str(); }
  double cost_per_element() const override { return 0; }

 protected:
  void compute(ExecContext&) override { set_buffer(inputs()[0]->buffer()); }

 private:
  std::string op_;
};

/// Output = input with its dimensions permuted (out dim i = input dim perm[i]).
/// The permutation is first simplified: size-1 dims are dropped and output dims that are
/// adjacent in the input too are merged. What remains always has one output dim `q` that
/// reads the input contiguously; when q is the last dim the kernel copies rows (memcpy),
/// otherwise it copies 32x32 tiles of the (q, last) plane, so both the reads and the writes
/// stay within a few cache lines (a batched, cache-blocked 2-D transpose).
class PermuteNode : public Node {
 public:
  /// Simplified iteration space of a permutation (see the class comment).
  struct Plan {
    int rank = 0;
    std::array<std::int64_t, kMaxRank> size{}, istride{}, ostride{};
    int q = -1;  ///< the output dim with input stride 1
    /// True when the permutation only moves size-1 dims: the bytes are already in order.
    bool keeps_order() const { return rank <= 1; }
  };

  static Shape permuted_shape(const Shape& in, const std::vector<int>& perm);

  static Plan make_plan(const Shape& in, const std::vector<int>& perm);

  PermuteNode(NodePtr in, std::vector<int> perm, std::string op);

  /// out dim i reads input dim perm()[i].
  const std::vector<int>& perm() const { return perm_; }
  /// True when the permutation swaps the last two dims and keeps the others: a matmul can
  /// then read the input with a transposed layout instead of waiting for this copy.
  bool swaps_last_two() const;

  std::string op_name() const override { return op_; }
  std::string describe() const override;
  std::uint64_t structural_hash() const override;

  /// Every output dimension splits, reading the input dimension it moves.
  std::optional<BlockRule> block_rule() const override;
  NodePtr with_inputs(std::vector<NodePtr> inputs, Shape shape, Device* device) const override;

 protected:
  void compute(ExecContext& ctx) override;

 private:
  static constexpr std::int64_t kTile = 32;

  template <std::size_t N>
  void run(ExecContext& ctx, std::byte* dst, const std::byte* src, std::int64_t n) const {
    using detail::Odometer;
    auto& pool = ctx.device.threads();
    const Plan& p = plan_;
    if (p.keeps_order()) {  // only reachable when a caller builds the node directly
      std::memcpy(dst, src, static_cast<std::size_t>(n) * N);
      return;
    }
    const int last = p.rank - 1;
    if (p.q == last) {
      // Rows: the innermost output dim is contiguous in the input.
      Odometer od;
      od.rank = last;
      for (int d = 0; d < last; ++d) {
        od.size[d] = p.size[d];
        od.stride_a[d] = p.istride[d];
        od.stride_b[d] = p.ostride[d];
      }
      const std::int64_t inner = p.size[last], rows = n / inner;
      const std::int64_t tasks = std::min(rows, task_count(pool, n, 1.0));
      pool.parallel_for(tasks, [&](std::int64_t t) {
        auto [r0, r1] = task_range(rows, tasks, t);
        Odometer o = od;
        o.seek(r0);
        for (std::int64_t r = r0; r < r1; ++r, o.next()) {
          std::memcpy(dst + o.b * N, src + o.a * N, static_cast<std::size_t>(inner) * N);
        }
      });
      return;
    }
    // Tiles of the (q, last) plane; every other dim is iterated by an odometer.
    const int q = p.q;
    Odometer od;
    for (int d = 0; d < p.rank; ++d) {
      if (d == q || d == last) continue;
      od.size[od.rank] = p.size[d];
      od.stride_a[od.rank] = p.istride[d];
      od.stride_b[od.rank] = p.ostride[d];
      ++od.rank;
    }
    const std::int64_t rows = p.size[q], cols = p.size[last];
    const std::int64_t ostq = p.ostride[q], isl = p.istride[last];
    const std::int64_t row_tiles = (rows + kTile - 1) / kTile;
    const std::int64_t units = n / (rows * cols) * row_tiles;
    const std::int64_t tasks = std::min(units, task_count(pool, n, 1.0));
    pool.parallel_for(tasks, [&](std::int64_t t) {
      auto [u0, u1] = task_range(units, tasks, t);
      Odometer o = od;
      alignas(64) std::byte tile[kTile * kTile * N];
      std::int64_t at = -1;
      for (std::int64_t u = u0; u < u1; ++u) {
        const std::int64_t outer = u / row_tiles;
        if (outer != at) {
          o.seek(outer);
          at = outer;
        }
        const std::int64_t i0 = u % row_tiles * kTile, in_ = std::min(rows - i0, kTile);
        for (std::int64_t j0 = 0; j0 < cols; j0 += kTile) {
          const std::int64_t jn = std::min(cols - j0, kTile);
          // Stage the tile: jn contiguous input runs into a 32x32 scratch, then write the
          // output rows from it. Reading the strided side straight from the source would
          // keep 32 lines alive that, for power-of-two strides, all map to one cache set.
          for (std::int64_t j = 0; j < jn; ++j) {
            std::memcpy(tile + j * kTile * N, src + (o.a + i0 + (j0 + j) * isl) * N, static_cast<std::size_t>(in_) * N);
          }
          for (std::int64_t i = 0; i < in_; ++i) {
            std::byte* out = dst + (o.b + (i0 + i) * ostq + j0) * N;
            for (std::int64_t j = 0; j < jn; ++j) detail::copy_elem<N>(out + j * N, tile + (j * kTile + i) * N);
          }
        }
      }
    });
  }

  std::vector<int> perm_;
  std::string op_;
  Plan plan_;
};

/// A permutation that swaps the last two dims (op_name "transpose"). It advertises its
/// source through TransposeOfLastTwo, so a GEMM consuming it while it is still pending reads
/// the source with a transposed layout and this copy never runs.
class TransposeNode final : public PermuteNode, public TransposeOfLastTwo {
 public:
  explicit TransposeNode(NodePtr in);

  /// The node whose last two dims this value swaps (null once this node has run: a
  /// computed node keeps no inputs).
  const NodePtr& transpose_source() const override { return inputs().empty() ? none_ : inputs()[0]; }
  NodePtr with_inputs(std::vector<NodePtr> inputs, Shape shape, Device* device) const override;

  /// The identity permutation with the last two entries swapped.
  static std::vector<int> last_two(int rank);

 private:
  NodePtr none_;
};

/// Copies a strided range of one dim: out[.., k, ..] = in[.., start + k * step, ..].
class SliceNode final : public Node {
 public:
  SliceNode(std::string op, NodePtr in, int dim, std::int64_t start, std::int64_t step, Shape out);

  std::string op_name() const override { return op_; }
  std::string describe() const override;
  // The offsets are part of the kernel's layout, not data: they belong in the hash.
  std::uint64_t structural_hash() const override;

 protected:
  void compute(ExecContext& ctx) override;

 private:
  std::string op_;
  int dim_;
  std::int64_t start_, step_;
};

/// Concatenation: the output, viewed as [outer, sum of widths], is row o = the inputs' rows o
/// side by side (input i viewed as [outer, widths[i]]). cat and stack differ only in how
/// they compute outer and the widths.
class CatNode final : public Node {
 public:
  CatNode(std::string op, DType dtype, std::vector<NodePtr> ins, Shape out, Device* dev, std::int64_t outer,
          std::vector<std::int64_t> widths);

  std::string op_name() const override { return op_; }
  std::uint64_t structural_hash() const override;

 protected:
  void compute(ExecContext& ctx) override;

 private:
  std::string op_;
  std::int64_t outer_;
  std::vector<std::int64_t> widths_;
};

/// out[.., k, ..] = in[.., index[k], ..] along `dim` (index 1-D, values checked here).
template <IndexElement I>
class IndexSelectNode final : public Node {
 public:
  IndexSelectNode(NodePtr in, NodePtr index, int dim, Shape out)
      : Node(NodeKind::Copy, in->dtype(), out, in->device(), {in, index}), dim_(dim) {}

  std::string op_name() const override { return "index_select"; }
  std::string describe() const override { return "index_select(%0, dim=" + std::to_string(dim_) + ", %1)"; }
  std::uint64_t structural_hash() const override {
    return hash_combine(Node::structural_hash(), static_cast<std::uint64_t>(dim_));
  }

 protected:
  void compute(ExecContext& ctx) override {
    const Shape& is = inputs()[0]->shape();
    const std::byte* src = detail::bytes_of(inputs()[0]);
    const I* idx = inputs()[1]->template data<I>();
    const std::int64_t K = inputs()[1]->numel();
    std::int64_t outer = 1, inner = 1;
    const std::int64_t dsize = is.rank() ? is[dim_] : 1;
    for (int d = 0; d < dim_; ++d) outer *= is[d];
    for (int d = dim_ + 1; d < is.rank(); ++d) inner *= is[d];
    // Check every index before writing anything: K values, cheap next to the copy.
    for (std::int64_t k = 0; k < K; ++k) {
      if (idx[k] < 0 || idx[k] >= dsize) {
        throw IndexError("index_select: index " + std::to_string(idx[k]) + " (position " + std::to_string(k) +
                         ") is out of range for dimension " + std::to_string(dim_) + " with size " +
                         std::to_string(dsize) + " (expected 0 <= index < " + std::to_string(dsize) + ")");
      }
    }
    auto buf = allocate_output(ctx, false);
    auto* dst = static_cast<std::byte*>(buf->data());
    detail::with_elem_size(dtype_size(dtype()), [&](auto nb) {
      constexpr std::size_t N = decltype(nb)::value;
      detail::copy_segments<N>(ctx.device.threads(), dst, src, outer * K, inner, [&](std::int64_t s) {
        return ((s / K) * dsize + static_cast<std::int64_t>(idx[s % K])) * inner;
      });
    });
    set_buffer(std::move(buf));
  }

 private:
  int dim_;
};

/// torch.gather: out[i][j][k] = in[index[i][j][k]][j][k] for dim 0 (likewise for others);
/// the output has the index's shape, index values are checked while they are read.
template <IndexElement I>
class GatherNode final : public Node {
 public:
  GatherNode(NodePtr in, NodePtr index, int dim)
      : Node(NodeKind::Copy, in->dtype(), index->shape(), in->device(), {in, index}), dim_(dim) {}

  std::string op_name() const override { return "gather"; }
  std::string describe() const override { return "gather(%0, dim=" + std::to_string(dim_) + ", %1)"; }

  /// Blocks along the other dimensions where input and index have the same size.
  std::optional<BlockRule> block_rule() const override {
    const Shape& in = inputs()[0]->shape();
    const int rank = shape().rank();
    BlockRule r{std::vector<bool>(static_cast<std::size_t>(rank), false),
                {std::vector<int>(static_cast<std::size_t>(rank), -1), std::vector<int>(static_cast<std::size_t>(rank), -1)}};
    for (int o = 0; o < rank; ++o) {
      if (o == dim_ || in[o] != shape()[o]) continue;
      r.splittable[static_cast<std::size_t>(o)] = true;
      r.input_dim[0][static_cast<std::size_t>(o)] = r.input_dim[1][static_cast<std::size_t>(o)] = o;
    }
    return r;
  }
  NodePtr with_inputs(std::vector<NodePtr> inputs, Shape, Device*) const override {
    return std::make_shared<GatherNode>(std::move(inputs[0]), std::move(inputs[1]), dim_);
  }
  double cost_per_element() const override { return 2; }
  std::uint64_t structural_hash() const override {
    return hash_combine(Node::structural_hash(), static_cast<std::uint64_t>(dim_));
  }

 protected:
  void compute(ExecContext& ctx) override {
    // A 0-d tensor is handled as a 1-D tensor of one element.
    Shape ts = inputs()[0]->shape(), xs = shape();
    if (ts.rank() == 0) ts = Shape{1};
    if (xs.rank() == 0) xs = Shape{1};
    const std::byte* src = detail::bytes_of(inputs()[0]);
    const I* idx = inputs()[1]->template data<I>();
    auto buf = allocate_output(ctx, false);
    auto* dst = static_cast<std::byte*>(buf->data());
    const int R = xs.rank(), dim = dim_;
    const std::int64_t n = numel(), last = xs[R - 1], dsize = ts[dim];
    if (n > 0) {
      const auto tst = contiguous_strides(ts), xst = contiguous_strides(xs);
      detail::Odometer od;  // a: input offset without `dim`; b: index offset
      od.rank = R - 1;
      for (int d = 0; d + 1 < R; ++d) {
        od.size[d] = xs[d];
        od.stride_a[d] = d == dim ? 0 : tst[d];
        od.stride_b[d] = xst[d];
      }
      const std::int64_t dstride = tst[dim], rows = n / last;
      auto& pool = ctx.device.threads();
      const std::int64_t tasks = std::min(rows, task_count(pool, n, 2.0));
      detail::with_elem_size(dtype_size(dtype()), [&](auto nb) {
        constexpr std::size_t N = decltype(nb)::value;
        pool.parallel_for(tasks, [&](std::int64_t t) {
          auto [r0, r1] = task_range(rows, tasks, t);
          detail::Odometer o = od;
          o.seek(r0);
          for (std::int64_t r = r0; r < r1; ++r, o.next()) {
            for (std::int64_t j = 0; j < last; ++j) {
              const auto k = static_cast<std::int64_t>(idx[o.b + j]);
              if (k < 0 || k >= dsize) {
                throw IndexError("gather: index " + std::to_string(k) + " is out of bounds for dimension " +
                                 std::to_string(dim_) + " with size " + std::to_string(dsize) +
                                 " (expected 0 <= index < " + std::to_string(dsize) + ")");
              }
              const std::int64_t at = dim == R - 1 ? o.a + k : o.a + j + k * dstride;
              detail::copy_elem<N>(dst + (o.b + j) * N, src + at * N);
            }
          }
        });
      });
    }
    set_buffer(std::move(buf));
  }

 private:
  int dim_;
};

/// torch.nn.functional.one_hot: out[..., c] = (index[...] == c), as int64.
template <IndexElement I>
class OneHotNode final : public Node {
 public:
  OneHotNode(NodePtr index, std::int64_t classes, Shape out)
      : Node(NodeKind::Copy, DType::Int64, out, index->device(), {index}), classes_(classes) {}

  std::string op_name() const override { return "one_hot"; }
  std::string describe() const override { return "one_hot(%0, num_classes=" + std::to_string(classes_) + ")"; }

  /// Blocks along the index's dimensions; the classes stay whole.
  std::optional<BlockRule> block_rule() const override {
    const int rank = shape().rank();
    BlockRule r{std::vector<bool>(static_cast<std::size_t>(rank), true), {std::vector<int>(static_cast<std::size_t>(rank), -1)}};
    r.splittable.back() = false;
    for (int o = 0; o + 1 < rank; ++o) r.input_dim[0][static_cast<std::size_t>(o)] = o;
    return r;
  }
  NodePtr with_inputs(std::vector<NodePtr> inputs, Shape shape, Device*) const override {
    return std::make_shared<OneHotNode>(std::move(inputs[0]), classes_, shape);
  }

 protected:
  void compute(ExecContext& ctx) override {
    const I* idx = inputs()[0]->template data<I>();
    const std::int64_t m = inputs()[0]->numel(), C = classes_;
    auto buf = allocate_output(ctx, false);
    auto* out = static_cast<std::int64_t*>(buf->data());
    auto& pool = ctx.device.threads();
    const std::int64_t tasks = std::max<std::int64_t>(1, std::min(m, task_count(pool, m * C, 1.0)));
    if (m > 0) {
      pool.parallel_for(tasks, [&](std::int64_t t) {
        auto [b, e] = task_range(m, tasks, t);
        if (C > 0) std::fill(out + b * C, out + e * C, std::int64_t{0});
        for (std::int64_t i = b; i < e; ++i) {
          const auto v = static_cast<std::int64_t>(idx[i]);
          if (v < 0) {
            throw IndexError("one_hot: class values must be non-negative, found " + std::to_string(v));
          }
          if (v >= C) {
            throw IndexError("one_hot: class values must be smaller than num_classes (" + std::to_string(C) +
                             "), found " + std::to_string(v));
          }
          out[i * C + v] = 1;
        }
      });
    }
    set_buffer(std::move(buf));
  }

 private:
  std::int64_t classes_;
};

}  // namespace lazy::graph

#if LAZYTENSOR_HEADER_DEFINITIONS
namespace lazy::graph {

LAZYTENSOR_INLINE ViewNode::ViewNode(std::string op, NodePtr in, Shape shape)
    : Node(NodeKind::View, in->dtype(), shape, in->device(), {in}), op_(std::move(op)) {}

LAZYTENSOR_INLINE Shape PermuteNode::permuted_shape(const Shape& in, const std::vector<int>& perm) {
  Shape out;
  for (int p : perm) out.push_back(in[p]);
  return out;
}

LAZYTENSOR_INLINE auto PermuteNode::make_plan(const Shape& in, const std::vector<int>& perm) -> Plan {
  Plan p;
  if (in.numel() <= 1) return p;
  const auto ics = contiguous_strides(in);
  std::vector<std::int64_t> sz, st;
  for (int d : perm) {
    if (in[d] == 1) continue;
    sz.push_back(in[d]);
    st.push_back(ics[d]);
  }
  // Merge output dim i into i + 1 while the input is contiguous across the pair.
  std::vector<std::int64_t> csz{sz.back()}, cst{st.back()};
  for (int i = static_cast<int>(sz.size()) - 2; i >= 0; --i) {
    if (st[i] == cst.front() * csz.front()) {
      csz.front() *= sz[i];
    } else {
      csz.insert(csz.begin(), sz[i]);
      cst.insert(cst.begin(), st[i]);
    }
  }
  p.rank = static_cast<int>(csz.size());
  std::int64_t acc = 1;
  for (int i = p.rank - 1; i >= 0; --i) {
    p.size[i] = csz[i];
    p.istride[i] = cst[i];
    p.ostride[i] = acc;
    acc *= csz[i];
    if (cst[i] == 1) p.q = i;
  }
  return p;
}

LAZYTENSOR_INLINE PermuteNode::PermuteNode(NodePtr in, std::vector<int> perm, std::string op)
    : Node(NodeKind::Copy, in->dtype(), permuted_shape(in->shape(), perm), in->device(), {in}),
      perm_(std::move(perm)), op_(std::move(op)), plan_(make_plan(in->shape(), perm_)) {}

LAZYTENSOR_INLINE bool PermuteNode::swaps_last_two() const {
  const int r = static_cast<int>(perm_.size());
  if (r < 2 || perm_[r - 2] != r - 1 || perm_[r - 1] != r - 2) return false;
  for (int i = 0; i + 2 < r; ++i)
    if (perm_[i] != i) return false;
  return true;
}

LAZYTENSOR_INLINE std::string PermuteNode::describe() const {
  std::string s = op_ + "(%0, dims=[";
  for (std::size_t i = 0; i < perm_.size(); ++i) s += (i ? ", " : "") + std::to_string(perm_[i]);
  return s + "])";
}

LAZYTENSOR_INLINE std::uint64_t PermuteNode::structural_hash() const {
  std::uint64_t h = Node::structural_hash();
  for (int p : perm_) h = hash_combine(h, static_cast<std::uint64_t>(p));
  return h;
}

LAZYTENSOR_INLINE void PermuteNode::compute(ExecContext& ctx) {
  const std::byte* src = detail::bytes_of(inputs()[0]);
  auto buf = allocate_output(ctx, false);  // reads elsewhere than it writes
  auto* dst = static_cast<std::byte*>(buf->data());
  const std::int64_t n = numel();
  if (n > 0) {
    detail::with_elem_size(dtype_size(dtype()), [&](auto nb) { run<decltype(nb)::value>(ctx, dst, src, n); });
  }
  set_buffer(std::move(buf));
}

LAZYTENSOR_INLINE TransposeNode::TransposeNode(NodePtr in) : PermuteNode(in, last_two(in->shape().rank()), "transpose") {}

LAZYTENSOR_INLINE std::optional<BlockRule> PermuteNode::block_rule() const {
  BlockRule r{std::vector<bool>(perm_.size(), true), {std::vector<int>(perm_.begin(), perm_.end())}};
  return r;
}

LAZYTENSOR_INLINE NodePtr PermuteNode::with_inputs(std::vector<NodePtr> inputs, Shape, Device* device) const {
  (void)device;  // the input's device: a piece and its permute live on the same device
  return std::make_shared<PermuteNode>(std::move(inputs[0]), perm_, op_);
}

LAZYTENSOR_INLINE NodePtr TransposeNode::with_inputs(std::vector<NodePtr> inputs, Shape, Device*) const {
  return std::make_shared<TransposeNode>(std::move(inputs[0]));
}

LAZYTENSOR_INLINE std::vector<int> TransposeNode::last_two(int rank) {
  std::vector<int> p(static_cast<std::size_t>(rank));
  for (int i = 0; i < rank; ++i) p[i] = i;
  if (rank >= 2) std::swap(p[rank - 2], p[rank - 1]);
  return p;
}

LAZYTENSOR_INLINE SliceNode::SliceNode(std::string op, NodePtr in, int dim, std::int64_t start, std::int64_t step, Shape out)
    : Node(NodeKind::Copy, in->dtype(), out, in->device(), {in}), op_(std::move(op)), dim_(dim), start_(start),
      step_(step) {}

LAZYTENSOR_INLINE std::string SliceNode::describe() const {
  return op_ + "(%0, dim=" + std::to_string(dim_) + ", start=" + std::to_string(start_) +
         ", step=" + std::to_string(step_) + ")";
}

LAZYTENSOR_INLINE std::uint64_t SliceNode::structural_hash() const {
  return hash_combine(hash_combine(hash_combine(Node::structural_hash(), static_cast<std::uint64_t>(dim_)),
                                   static_cast<std::uint64_t>(start_)),
                      static_cast<std::uint64_t>(step_));
}

LAZYTENSOR_INLINE void SliceNode::compute(ExecContext& ctx) {
  const Shape& is = inputs()[0]->shape();
  const std::byte* src = detail::bytes_of(inputs()[0]);
  auto buf = allocate_output(ctx, false);
  auto* dst = static_cast<std::byte*>(buf->data());
  std::int64_t outer = 1, inner = 1;
  for (int d = 0; d < dim_; ++d) outer *= is[d];
  for (int d = dim_ + 1; d < is.rank(); ++d) inner *= is[d];
  const std::int64_t dsize = is[dim_], len = shape()[dim_];
  const std::int64_t start = start_, step = step_;
  detail::with_elem_size(dtype_size(dtype()), [&](auto nb) {
    constexpr std::size_t N = decltype(nb)::value;
    if (step == 1) {  // one contiguous run per outer index
      detail::copy_segments<N>(ctx.device.threads(), dst, src, outer, len * inner,
                               [&](std::int64_t o) { return (o * dsize + start) * inner; });
    } else {
      detail::copy_segments<N>(ctx.device.threads(), dst, src, outer * len, inner, [&](std::int64_t s) {
        return ((s / len) * dsize + start + (s % len) * step) * inner;
      });
    }
  });
  set_buffer(std::move(buf));
}

LAZYTENSOR_INLINE CatNode::CatNode(std::string op,
  DType dtype,
  std::vector<NodePtr> ins,
  Shape out,
  Device* dev,
  std::int64_t outer,
  std::vector<std::int64_t> widths)
    : Node(NodeKind::Copy, dtype, out, dev, std::move(ins)), op_(std::move(op)), outer_(outer),
      widths_(std::move(widths)) {}

LAZYTENSOR_INLINE std::uint64_t CatNode::structural_hash() const {
  std::uint64_t h = hash_combine(Node::structural_hash(), static_cast<std::uint64_t>(outer_));
  for (auto w : widths_) h = hash_combine(h, static_cast<std::uint64_t>(w));
  return h;
}

LAZYTENSOR_INLINE void CatNode::compute(ExecContext& ctx) {
  const std::size_t k = inputs().size();
  std::vector<const std::byte*> srcs(k);
  for (std::size_t i = 0; i < k; ++i) srcs[i] = detail::bytes_of(inputs()[i]);
  auto buf = allocate_output(ctx, false);
  auto* dst = static_cast<std::byte*>(buf->data());
  std::vector<std::int64_t> pre(k + 1, 0);  // start of each input inside an output row
  for (std::size_t i = 0; i < k; ++i) pre[i + 1] = pre[i] + widths_[i];
  const std::int64_t W = pre[k], n = outer_ * W;
  auto& pool = ctx.device.threads();
  if (n > 0) {
    detail::with_elem_size(dtype_size(dtype()), [&](auto nb) {
      constexpr std::size_t N = decltype(nb)::value;
      const std::int64_t tasks = task_count(pool, n, 1.0);
      // Split the output evenly, whatever the sizes of the pieces.
      pool.parallel_for(tasks, [&](std::int64_t t) {
        auto [b, e] = task_range(n, tasks, t);
        while (b < e) {
          const std::int64_t o = b / W, w = b % W;
          const auto i = static_cast<std::size_t>(std::upper_bound(pre.begin() + 1, pre.end(), w) - pre.begin() - 1);
          const std::int64_t off = w - pre[i], c = std::min(widths_[i] - off, e - b);
          std::memcpy(dst + b * N, srcs[i] + (o * widths_[i] + off) * N, static_cast<std::size_t>(c) * N);
          b += c;
        }
      });
    });
  }
  set_buffer(std::move(buf));
}

}  // namespace lazy::graph
#endif  // LAZYTENSOR_HEADER_DEFINITIONS
// ---- end lazytensor/graph/shape_nodes.hpp ----
// ---- begin lazytensor/ops/shape_helpers.hpp ----
// The helpers the shape ops share (ops/reshape.hpp, slice.hpp, indexing.hpp, and conv and
// pool for as_tensor): an operand as a tensor, size lists, views and permuted copies with
// their backward, expand's broadcast, and the autograd records of slices and tensor lists.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>


namespace lazy::detail {

/// An operand as a tensor: a Tensor as is (the handle is copied), an expression evaluated
/// into a pending node.
template <expr::ExprLike X>
auto as_tensor(const X& x) {
  using T = expr::value_t<X>;
  if constexpr (std::is_same_v<X, Tensor<T>>) return x;
  else if constexpr (expr::is_expr_node<X>::value) return Tensor<T>(x);
  else return Tensor<T>(x.to_leaf().node);
}

std::string list_str(std::span<const std::int64_t> v);
inline std::string list_str(const Shape& s) { return list_str(std::span<const std::int64_t>(s.begin(), s.end())); }
inline std::span<const std::int64_t> span_of(const Shape& s) { return {s.begin(), static_cast<std::size_t>(s.rank())}; }

/// A view of t with `shape` (same numel), or t's own node when the shape does not change.
/// A view of a pending view is made a view of that view's source, so chains stay short.
template <Element T>
Tensor<T> view_of(const Tensor<T>& t, const Shape& shape, const char* op) {
  graph::NodePtr src = t.node();
  if (src->shape() == shape) return t;
  if (src->pending() && dynamic_cast<graph::ViewNode*>(src.get())) src = src->inputs()[0];
  Tensor<T> r(graph::submit(std::make_shared<graph::ViewNode>(op, std::move(src), shape)));
  autograd::record(r, "ViewBackward0", {autograd::edge_of(t.impl())}, [in = t.shape()](const Tensor<T>& g) {
    return std::vector<graph::NodePtr>{view_of(g, in, "view").node()};
  });
  return r;
}

/// Resolves a size list with at most one -1 against `numel` (torch's infer_size).
Shape infer_shape(std::span<const std::int64_t> sizes, std::int64_t numel, const char* op);

template <expr::ExprLike X>
auto reshape_impl(const X& x, std::span<const std::int64_t> sizes, const char* op) {
  auto t = as_tensor(x);
  return view_of(t, infer_shape(sizes, t.numel(), op), op);
}

/// A permuted copy, or a view when only size-1 dims move (the bytes are then in order).
template <Element T>
Tensor<T> permute_impl(const Tensor<T>& t, std::vector<int> perm, const char* op) {
  const graph::NodePtr& n = t.node();
  bool identity = true;
  for (std::size_t i = 0; i < perm.size(); ++i) identity = identity && perm[i] == static_cast<int>(i);
  if (identity) return t;
  if (graph::PermuteNode::make_plan(n->shape(), perm).keeps_order()) {
    return view_of(t, graph::PermuteNode::permuted_shape(n->shape(), perm), op);
  }
  std::vector<int> inverse(perm.size());
  for (std::size_t i = 0; i < perm.size(); ++i) inverse[static_cast<std::size_t>(perm[i])] = static_cast<int>(i);
  const bool swap_last_two = perm == graph::TransposeNode::last_two(static_cast<int>(perm.size()));
  graph::NodePtr source;  // transpose(transpose(s)) is s: no node, no copy
  if (swap_last_two && n->pending()) {
    if (auto* tr = dynamic_cast<graph::TransposeOfLastTwo*>(n.get()))
      source = tr->transpose_source();
  }
  Tensor<T> r =
      source ? Tensor<T>(source)
      : swap_last_two
          ? Tensor<T>(graph::submit(std::make_shared<graph::TransposeNode>(n)))
          : Tensor<T>(graph::submit(std::make_shared<graph::PermuteNode>(n, std::move(perm), op)));
  autograd::record(r, "PermuteBackward0", {autograd::edge_of(t.impl())}, [inverse](const Tensor<T>& g) {
    return std::vector<graph::NodePtr>{permute_impl(g, inverse, "permute").node()};
  });
  return r;
}

template <expr::ExprLike X>
auto expand_impl(const X& x, std::span<const std::int64_t> sizes) {
  using T = expr::value_t<X>;
  Tensor<T> t = as_tensor(x);
  const Shape& s = t.shape();
  const int r = s.rank();
  const auto k = static_cast<int>(sizes.size());
  if (k < r) {
    throw ShapeError("expand: the number of sizes provided (" + std::to_string(k) +
                     ") must be greater or equal to the number of dimensions in the tensor (" + std::to_string(r) +
                     "); target sizes " + list_str(sizes) + ", tensor sizes " + list_str(s));
  }
  if (k > kMaxRank) {
    throw ShapeError("expand: target sizes " + list_str(sizes) + " have rank " + std::to_string(k) +
                     ", expected at most " + std::to_string(kMaxRank));
  }
  Shape out;
  for (int i = 0; i < k; ++i) {
    const std::int64_t v = sizes[i];
    if (i < k - r) {
      if (v < 0) {
        throw ShapeError("expand: the expanded size of the tensor (" + std::to_string(v) +
                         ") isn't allowed in a leading, non-existing dimension " + std::to_string(i) +
                         "; target sizes " + list_str(sizes) + ", tensor sizes " + list_str(s));
      }
      out.push_back(v);
      continue;
    }
    const std::int64_t d = s[i - (k - r)];
    if (v == -1) {
      out.push_back(d);
    } else if (v < 0 || (v != d && d != 1)) {
      throw ShapeError("expand: the expanded size of the tensor (" + std::to_string(v) +
                       ") must match the existing size (" + std::to_string(d) + ") at non-singleton dimension " +
                       std::to_string(i) + "; target sizes " + list_str(sizes) + ", tensor sizes " + list_str(s));
    } else {
      out.push_back(v);
    }
  }
  if (out == s) return t;
  // The element-wise node broadcasts its leaves to `out`: a splat per expanded dim (and
  // its gradient sums back over them).
  return evaluate_as<T>(expr::make<ops::Identity>(t), out);
}

/// Records the backward of a slice of `t` (the gradient lands in zeros of t's shape).
template <Element T>
void record_slice(Tensor<T>& r, const Tensor<T>& t, int d, std::int64_t start, std::int64_t step) {
  if constexpr (is_floating_v<T>) {
    autograd::record(r, "SliceBackward0", {autograd::edge_of(t.impl())},
                     [in = t.shape(), d, start, step](const Tensor<T>& g) {
                       return std::vector<graph::NodePtr>{graph::submit(
                           std::make_shared<graph::SliceBackwardNode<T>>(g.node(), in, d, start, step))};
                     });
  }
}

/// Autograd edges of a list of tensors.
template <Element T>
std::vector<autograd::GradFnPtr> edges_of(const std::vector<Tensor<T>>& ts) {
  std::vector<autograd::GradFnPtr> e;
  e.reserve(ts.size());
  for (const auto& t : ts) e.push_back(autograd::edge_of(t.impl()));
  return e;
}

template <Element T>
std::vector<graph::NodePtr> nodes_of(const std::vector<Tensor<T>>& ts) {
  std::vector<graph::NodePtr> v;
  v.reserve(ts.size());
  for (const auto& t : ts) v.push_back(t.node());
  return v;
}

}  // namespace lazy::detail

#if LAZYTENSOR_HEADER_DEFINITIONS
namespace lazy::detail {

LAZYTENSOR_INLINE std::string list_str(std::span<const std::int64_t> v) {
  std::string s = "[";
  for (std::size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s + "]";
}

LAZYTENSOR_INLINE Shape infer_shape(std::span<const std::int64_t> sizes, std::int64_t numel, const char* op) {
  if (sizes.size() > static_cast<std::size_t>(kMaxRank)) {
    throw ShapeError(std::string(op) + ": shape " + list_str(sizes) + " has rank " + std::to_string(sizes.size()) +
                     ", expected at most " + std::to_string(kMaxRank));
  }
  int infer = -1;
  std::int64_t known = 1;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    if (sizes[i] == -1) {
      if (infer >= 0) throw ShapeError(std::string(op) + ": only one dimension can be inferred (-1), got " + list_str(sizes));
      infer = static_cast<int>(i);
    } else if (sizes[i] < 0) {
      throw ShapeError(std::string(op) + ": invalid shape dimension " + std::to_string(sizes[i]) + " in " +
                       list_str(sizes) + " (expected sizes >= 0, or -1 once)");
    } else if (__builtin_mul_overflow(known, sizes[i], &known)) {
      // Past int64, so past the shape bound too (a later zero does not bring it back).
      throw ShapeError(std::string(op) + ": the sizes " + list_str(sizes) +
                       " describe more elements than a shape may hold (2^60)");
    }
  }
  std::vector<std::int64_t> out(sizes.begin(), sizes.end());
  if (infer >= 0) {
    if (known == 0) {
      throw ShapeError(std::string(op) + ": cannot reshape a tensor of " + std::to_string(numel) + " elements into shape " +
                       list_str(sizes) + " because the unspecified dimension size -1 can be any value and is ambiguous");
    }
    if (numel % known != 0) {
      throw ShapeError(std::string(op) + ": shape " + list_str(sizes) + " is invalid for input of size " +
                       std::to_string(numel));
    }
    out[infer] = numel / known;
  } else if (known != numel) {
    throw ShapeError(std::string(op) + ": shape " + list_str(sizes) + " is invalid for input of size " +
                     std::to_string(numel) + " (expected " + std::to_string(known) + " elements)");
  }
  return Shape(out);
}

}  // namespace lazy::detail
#endif  // LAZYTENSOR_HEADER_DEFINITIONS

// Per-dtype templates the compiled runtime instantiates once (core/config.hpp).
#define LAZYTENSOR_SHAPE_HELPERS_INSTANCES(P, T)                                                         \
  P template lazy::Tensor<T> lazy::detail::view_of<T>(const lazy::Tensor<T>&, const lazy::Shape&, const char*); \
  P template lazy::Tensor<T> lazy::detail::permute_impl<T>(const lazy::Tensor<T>&, std::vector<int>, const char*);
#if LAZYTENSOR_EXPLICIT_INSTANTIATION
LAZYTENSOR_FOR_ELEMENT(LAZYTENSOR_SHAPE_HELPERS_INSTANCES, extern)
#endif
// ---- end lazytensor/ops/shape_helpers.hpp ----

namespace lazy {

// ---- indexing ---------------------------------------------------------------------------

/// The slices of x at positions `index` (1-D, int32 or int64) along `dim`
/// (torch.index_select). Index values outside [0, size) raise IndexError when the kernel
/// runs (at the next mark_step or read), since the index may still be pending here.
template <expr::ExprLike X, IndexElement I>
auto index_select(const X& x, std::int64_t dim, const Tensor<I>& index) {
  auto t = detail::as_tensor(x);
  using T = typename decltype(t)::value_type;
  const Shape& s = t.shape();
  if (index.dim() > 1) {
    throw ShapeError("index_select: index must be a 1-D tensor (or 0-D), got shape " + index.shape().str());
  }
  const int d = normalize_dim(dim, s.rank(), "index_select");
  Shape out = s;
  if (s.rank() == 0) {
    if (index.numel() != 1) {
      throw ShapeError("index_select: a 0-dim input takes an index of exactly one element, got shape " +
                       index.shape().str());
    }
  } else {
    out[d] = index.numel();
    out.check_size();
  }
  graph::common_device({t.node(), index.node()}, "index_select");
  Tensor<T> r(graph::submit(std::make_shared<graph::IndexSelectNode<I>>(t.node(), index.node(), d, out)));
  if constexpr (is_floating_v<T>) {
    autograd::record(r, "IndexSelectBackward0", {autograd::edge_of(t.impl())},
                     [in = s, d, idx = index.detach()](const Tensor<T>& g) {
                       return std::vector<graph::NodePtr>{
                           graph::submit(std::make_shared<graph::IndexAddNode<T, I>>(g.node(), idx.node(), in, d))};
                     });
  }
  return r;
}

/// torch.gather: out[i][j][k] = x[index[i][j][k]][j][k] for dim 0 (likewise for the other
/// dims). index has x's rank and index.size(d) <= x.size(d) for d != dim (ShapeError); the
/// result has index's shape. Out-of-range values raise IndexError when the kernel runs.
template <expr::ExprLike X, IndexElement I>
auto gather(const X& x, std::int64_t dim, const Tensor<I>& index) {
  auto t = detail::as_tensor(x);
  using T = typename decltype(t)::value_type;
  const Shape& s = t.shape();
  const Shape& is = index.shape();
  if (is.rank() != s.rank()) {
    throw ShapeError("gather: index tensor must have the same number of dimensions as the input: expected " +
                     std::to_string(s.rank()) + " (input shape " + s.str() + "), got " + std::to_string(is.rank()) +
                     " (index shape " + is.str() + ")");
  }
  const int d = normalize_dim(dim, s.rank(), "gather");
  for (int k = 0; k < s.rank(); ++k) {
    if (k != d && is[k] > s[k]) {
      throw ShapeError("gather: size of index (" + std::to_string(is[k]) + ") must not exceed the input's size (" +
                       std::to_string(s[k]) + ") in dimension " + std::to_string(k) + " (index shape " + is.str() +
                       ", input shape " + s.str() + ", gather dim " + std::to_string(d) + ")");
    }
  }
  graph::common_device({t.node(), index.node()}, "gather");
  Tensor<T> r(graph::submit(std::make_shared<graph::GatherNode<I>>(t.node(), index.node(), d)));
  if constexpr (is_floating_v<T>) {
    autograd::record(r, "GatherBackward0", {autograd::edge_of(t.impl())},
                     [in = s, d, idx = index.detach()](const Tensor<T>& g) {
                       return std::vector<graph::NodePtr>{
                           graph::submit(std::make_shared<graph::ScatterAddNode<T, I>>(g.node(), idx.node(), in, d))};
                     });
  }
  return r;
}

/// torch.nn.functional.one_hot: int64 tensor of shape index.shape + (num_classes,) with a 1
/// at each index value. num_classes = -1 means max(index) + 1, which needs the values now:
/// that form materializes `index` (an implicit sync of just what index needs). Values < 0
/// or >= num_classes raise IndexError (when the kernel runs, for an explicit num_classes).
template <IndexElement I>
Tensor<std::int64_t> one_hot(const Tensor<I>& index, std::int64_t num_classes = -1) {
  if (num_classes < -1) {
    throw ShapeError("one_hot: num_classes must be -1 (infer) or >= 0, got " + std::to_string(num_classes));
  }
  if (index.dim() >= kMaxRank) {
    throw ShapeError("one_hot: the result would have rank " + std::to_string(index.dim() + 1) +
                     ", expected at most " + std::to_string(kMaxRank) + " (index shape " + index.shape().str() + ")");
  }
  if (num_classes == -1) {
    if (index.numel() == 0) {
      throw ShapeError("one_hot: cannot infer the number of classes from an empty index tensor (shape " +
                       index.shape().str() + "); pass num_classes");
    }
    const I* p = index.data();
    const auto [lo, hi] = std::minmax_element(p, p + index.numel());
    if (*lo < 0) throw IndexError("one_hot: class values must be non-negative, found " + std::to_string(*lo));
    num_classes = static_cast<std::int64_t>(*hi) + 1;
  }
  Shape out = index.shape();
  out.push_back(num_classes);
  return Tensor<std::int64_t>(graph::submit(std::make_shared<graph::OneHotNode<I>>(index.node(), num_classes, out)));
}

}  // namespace lazy
// ---- end lazytensor/ops/indexing.hpp ----
// ---- begin lazytensor/ops/reshape.hpp ----
// The shape ops that keep the elements: views (reshape/view, flatten, squeeze, unsqueeze),
// which share the input's buffer, so a view of a pending value is pending and nothing is
// copied; permutations (permute, transpose), copies unless only size-1 dims move; and
// expand, a broadcasting element-wise node.

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>


namespace lazy {

// ---- views ------------------------------------------------------------------------------

/// A view of `x` with shape `sizes` (one entry may be -1: inferred). Shares x's buffer;
/// ShapeError if the element count differs. An expression is evaluated first.
template <expr::ExprLike X>
auto reshape(const X& x, std::initializer_list<std::int64_t> sizes) {
  return detail::reshape_impl(x, {sizes.begin(), sizes.size()}, "reshape");
}
/// reshape with the sizes in a vector.
template <expr::ExprLike X>
auto reshape(const X& x, const std::vector<std::int64_t>& sizes) {
  return detail::reshape_impl(x, sizes, "reshape");
}
/// reshape to a Shape.
template <expr::ExprLike X>
auto reshape(const X& x, const Shape& shape) {
  return detail::reshape_impl(x, detail::span_of(shape), "reshape");
}

/// Same as reshape (tensors are always contiguous here, so view never fails where reshape
/// would copy).
template <expr::ExprLike X>
auto view(const X& x, std::initializer_list<std::int64_t> sizes) {
  return detail::reshape_impl(x, {sizes.begin(), sizes.size()}, "view");
}
/// view with the sizes in a vector.
template <expr::ExprLike X>
auto view(const X& x, const std::vector<std::int64_t>& sizes) {
  return detail::reshape_impl(x, sizes, "view");
}
/// view as a Shape.
template <expr::ExprLike X>
auto view(const X& x, const Shape& shape) {
  return detail::reshape_impl(x, detail::span_of(shape), "view");
}

/// Merges dims start_dim..end_dim (inclusive, negative counts from the back) into one, as a
/// view. A 0-d tensor becomes 1-D with one element, as in torch.
template <expr::ExprLike X>
auto flatten(const X& x, std::int64_t start_dim = 0, std::int64_t end_dim = -1) {
  auto t = detail::as_tensor(x);
  const Shape& s = t.shape();
  const int a = normalize_dim(start_dim, s.rank(), "flatten"), b = normalize_dim(end_dim, s.rank(), "flatten");
  if (a > b) {
    throw ShapeError("flatten: start_dim (" + std::to_string(start_dim) + ", i.e. " + std::to_string(a) +
                     ") cannot come after end_dim (" + std::to_string(end_dim) + ", i.e. " + std::to_string(b) + ")");
  }
  if (s.rank() == 0) return detail::view_of(t, Shape{1}, "flatten");
  Shape out;
  std::int64_t merged = 1;
  for (int i = 0; i < s.rank(); ++i) {
    if (i < a || i > b) {
      out.push_back(s[i]);
    } else {
      merged *= s[i];
      if (i == b) out.push_back(merged);
    }
  }
  return detail::view_of(t, out, "flatten");
}

/// Removes every dim of size 1 (a view).
template <expr::ExprLike X>
auto squeeze(const X& x) {
  auto t = detail::as_tensor(x);
  Shape out;
  for (auto d : t.shape())
    if (d != 1) out.push_back(d);
  return detail::view_of(t, out, "squeeze");
}

/// Removes dim `dim` if its size is 1; otherwise returns x unchanged, as torch does.
template <expr::ExprLike X>
auto squeeze(const X& x, std::int64_t dim) {
  auto t = detail::as_tensor(x);
  const Shape& s = t.shape();
  const int d = normalize_dim(dim, s.rank(), "squeeze");
  if (s.rank() == 0 || s[d] != 1) return t;
  Shape out;
  for (int i = 0; i < s.rank(); ++i)
    if (i != d) out.push_back(s[i]);
  return detail::view_of(t, out, "squeeze");
}

/// Inserts a dim of size 1 at position `dim` (in [-rank-1, rank]), as a view.
template <expr::ExprLike X>
auto unsqueeze(const X& x, std::int64_t dim) {
  auto t = detail::as_tensor(x);
  const Shape& s = t.shape();
  if (s.rank() >= kMaxRank) {
    throw ShapeError("unsqueeze: the result would have rank " + std::to_string(s.rank() + 1) +
                     ", expected at most " + std::to_string(kMaxRank) + " (input shape " + s.str() + ")");
  }
  const int d = normalize_dim(dim, s.rank() + 1, "unsqueeze");
  Shape out;
  for (int i = 0; i < s.rank(); ++i) {
    if (i == d) out.push_back(1);
    out.push_back(s[i]);
  }
  if (d == s.rank()) out.push_back(1);
  return detail::view_of(t, out, "unsqueeze");
}

// ---- permutations -------------------------------------------------------------------------

/// Reorders the dims: out dim i is x's dim dims[i] (a permutation of 0..rank-1; negative
/// entries count from the back). A copy, unless only size-1 dims move (then a view).
template <expr::ExprLike X>
auto permute(const X& x, const std::vector<std::int64_t>& dims) {
  auto t = detail::as_tensor(x);
  const int r = t.dim();
  if (static_cast<int>(dims.size()) != r) {
    throw ShapeError("permute: number of dims don't match: the tensor has " + std::to_string(r) +
                     " dims (shape " + t.shape().str() + "), the permutation " +
                     detail::list_str(dims) + " has " + std::to_string(dims.size()));
  }
  std::vector<int> perm;
  std::vector<char> seen(static_cast<std::size_t>(r), 0);
  for (auto d : dims) {
    const int n = normalize_dim(d, r, "permute");
    if (seen[n]) {
      throw ShapeError("permute: repeated dim " + std::to_string(n) + " in the permutation " +
                       detail::list_str(dims) + " (expected each of 0.." + std::to_string(r - 1) +
                       " exactly once)");
    }
    seen[n] = 1;
    perm.push_back(n);
  }
  return detail::permute_impl(t, std::move(perm), "permute");
}
/// permute with a braced list: permute(x, {2, 0, 1}).
template <expr::ExprLike X>
auto permute(const X& x, std::initializer_list<std::int64_t> dims) {
  return permute(x, std::vector<std::int64_t>(dims));
}

/// Swaps dims d0 and d1 (a copy; for the last two dims a pending TransposeNode that a
/// matmul reads through without running it).
template <expr::ExprLike X>
auto transpose(const X& x, std::int64_t d0, std::int64_t d1) {
  auto t = detail::as_tensor(x);
  const int r = t.dim();
  const int a = normalize_dim(d0, r, "transpose"), b = normalize_dim(d1, r, "transpose");
  if (a == b || r == 0) return t;
  std::vector<int> perm(static_cast<std::size_t>(r));
  for (int i = 0; i < r; ++i) perm[i] = i;
  std::swap(perm[a], perm[b]);
  return detail::permute_impl(t, std::move(perm), "transpose");
}

/// torch's t(): the transpose of a 2-D tensor; 0-D and 1-D tensors are returned as is.
/// ShapeError for rank > 2.
template <expr::ExprLike X>
auto transpose(const X& x) {
  auto t = detail::as_tensor(x);
  if (t.dim() > 2) {
    throw ShapeError("transpose: t() expects a tensor with <= 2 dimensions, but got shape " + t.shape().str() +
                     " (" + std::to_string(t.dim()) + "-D)");
  }
  if (t.dim() < 2) return t;
  return transpose(t, 0, 1);
}

// ---- expand -------------------------------------------------------------------------------

/// Broadcasts x to `sizes` (torch.expand): new dims are prepended, a size-1 dim may grow,
/// -1 keeps a size. Materialized lazily by a broadcasting element-wise node.
template <expr::ExprLike X>
auto expand(const X& x, std::initializer_list<std::int64_t> sizes) {
  return detail::expand_impl(x, {sizes.begin(), sizes.size()});
}
/// expand with the sizes in a vector.
template <expr::ExprLike X>
auto expand(const X& x, const std::vector<std::int64_t>& sizes) {
  return detail::expand_impl(x, sizes);
}
/// expand to a Shape.
template <expr::ExprLike X>
auto expand(const X& x, const Shape& shape) {
  return detail::expand_impl(x, detail::span_of(shape));
}

}  // namespace lazy
// ---- end lazytensor/ops/reshape.hpp ----
// ---- begin lazytensor/ops/slice.hpp ----
// Slicing (slice, narrow) and joining (cat, stack): copy nodes of graph/shape_nodes.hpp, each
// recording its backward (a slice's gradient lands in zeros of the input's shape, a join's is
// narrowed back into the pieces).

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <memory>
#include <string>
#include <utility>
#include <vector>


namespace lazy {

// ---- slicing ------------------------------------------------------------------------------

/// Elements start, start + step, ... below end along `dim` (torch slicing x[start:end:step]):
/// negative start/end count from the back, both are clamped to [0, size]; step must be > 0.
/// A copy (buffers never start at an offset), except a full-range slice which is x itself.
template <expr::ExprLike X>
auto slice(const X& x, std::int64_t dim, std::int64_t start = 0,
           std::int64_t end = std::numeric_limits<std::int64_t>::max(), std::int64_t step = 1) {
  auto t = detail::as_tensor(x);
  using T = typename decltype(t)::value_type;
  const Shape& s = t.shape();
  if (s.rank() == 0) throw ShapeError("slice: cannot be applied to a 0-dim tensor (expected rank >= 1)");
  if (step <= 0) throw ShapeError("slice: step must be greater than zero, got " + std::to_string(step));
  const int d = normalize_dim(dim, s.rank(), "slice");
  const std::int64_t size = s[d];
  if (start < 0) start += size;
  if (end < 0) end += size;
  start = std::clamp<std::int64_t>(start, 0, size);
  end = std::clamp<std::int64_t>(end, start, size);
  const std::int64_t len = (end - start + step - 1) / step;
  if (start == 0 && len == size && (step == 1 || size <= 1)) return t;
  Shape out = s;
  out[d] = len;
  Tensor<T> r(graph::submit(std::make_shared<graph::SliceNode>("slice", t.node(), d, start, step, out)));
  detail::record_slice(r, t, d, start, step);
  return r;
}

/// `length` elements from `start` along `dim` (torch.narrow). start may be negative
/// (counting from the back); ShapeError if the range does not fit.
template <expr::ExprLike X>
auto narrow(const X& x, std::int64_t dim, std::int64_t start, std::int64_t length) {
  auto t = detail::as_tensor(x);
  using T = typename decltype(t)::value_type;
  const Shape& s = t.shape();
  if (s.rank() == 0) throw ShapeError("narrow: cannot be applied to a 0-dim tensor (expected rank >= 1)");
  const int d = normalize_dim(dim, s.rank(), "narrow");
  const std::int64_t size = s[d];
  if (start < -size || start > size) {
    throw ShapeError("narrow: start out of range (expected to be in range of [" + std::to_string(-size) + ", " +
                     std::to_string(size) + "], but got " + std::to_string(start) + ")");
  }
  if (start < 0) start += size;
  if (length < 0) throw ShapeError("narrow: length must be non-negative, got " + std::to_string(length));
  if (start > size - length) {
    throw ShapeError("narrow: start (" + std::to_string(start) + ") + length (" + std::to_string(length) +
                     ") exceeds dimension size (" + std::to_string(size) + ") of dimension " + std::to_string(d));
  }
  if (start == 0 && length == size) return t;
  Shape out = s;
  out[d] = length;
  Tensor<T> r(graph::submit(std::make_shared<graph::SliceNode>("narrow", t.node(), d, start, 1, out)));
  detail::record_slice(r, t, d, start, 1);
  return r;
}

// ---- cat / stack ----------------------------------------------------------------------------

/// Concatenates along `dim` (torch.cat). The tensors need the same rank and equal sizes
/// except in `dim` (ShapeError), and the same device (DeviceError). As in torch, 1-D empty
/// tensors (shape (0,)) are skipped whatever their rank.
template <Element T>
Tensor<T> cat(const std::vector<Tensor<T>>& tensors, std::int64_t dim = 0) {
  if (tensors.empty()) throw ShapeError("cat: expected a non-empty list of tensors, got an empty list");
  std::vector<Tensor<T>> ts;
  for (const auto& t : tensors)
    if (!(t.dim() == 1 && t.numel() == 0)) ts.push_back(t);
  if (ts.empty()) return tensors.front();
  const Shape& ref = ts.front().shape();
  const int r = ref.rank();
  if (r == 0) throw ShapeError("cat: zero-dimensional tensor (at position 0) cannot be concatenated (expected rank >= 1)");
  const int d = normalize_dim(dim, r, "cat");
  for (std::size_t i = 1; i < ts.size(); ++i) {
    const Shape& s = ts[i].shape();
    if (s.rank() != r) {
      throw ShapeError("cat: tensors must have the same number of dimensions: expected " + std::to_string(r) +
                       " (shape " + ref.str() + "), got " + std::to_string(s.rank()) + " (shape " + s.str() +
                       ") for tensor " + std::to_string(i));
    }
    for (int k = 0; k < r; ++k) {
      if (k != d && s[k] != ref[k]) {
        throw ShapeError("cat: sizes of tensors must match except in dimension " + std::to_string(d) +
                         ": expected size " + std::to_string(ref[k]) + " but got size " + std::to_string(s[k]) +
                         " in dimension " + std::to_string(k) + " for tensor " + std::to_string(i) + " (shapes " +
                         ref.str() + " and " + s.str() + ")");
      }
    }
  }
  auto nodes = detail::nodes_of(ts);
  graph::Device& dev = graph::common_device(nodes, "cat");
  if (ts.size() == 1) return ts.front();
  std::int64_t outer = 1, inner = 1, total = 0;
  for (int k = 0; k < d; ++k) outer *= ref[k];
  for (int k = d + 1; k < r; ++k) inner *= ref[k];
  std::vector<std::int64_t> widths;
  for (const auto& t : ts) {
    widths.push_back(t.shape()[d] * inner);
    if (__builtin_add_overflow(total, t.shape()[d], &total)) total = kMaxElements + 1;  // too_large below
  }
  Shape out = ref;
  out[d] = total;
  out.check_size();
  Tensor<T> result(graph::submit(
      std::make_shared<graph::CatNode>("cat", dtype_of<T>(), std::move(nodes), out, &dev, outer, std::move(widths))));
  std::vector<std::int64_t> sizes;
  for (const auto& t : ts) sizes.push_back(t.shape()[d]);
  autograd::record(result, "CatBackward0", detail::edges_of(ts), [sizes, d](const Tensor<T>& g) {
    std::vector<graph::NodePtr> gs;
    std::int64_t off = 0;
    for (auto len : sizes) {
      gs.push_back(narrow(g, d, off, len).node());
      off += len;
    }
    return gs;
  });
  return result;
}
/// cat with a braced list: cat({a, b}, 1).
template <Element T>
Tensor<T> cat(std::initializer_list<Tensor<T>> tensors, std::int64_t dim = 0) {
  return cat(std::vector<Tensor<T>>(tensors), dim);
}

/// Stacks equal-shaped tensors along a new dim `dim` (in [-rank-1, rank]) (torch.stack).
template <Element T>
Tensor<T> stack(const std::vector<Tensor<T>>& tensors, std::int64_t dim = 0) {
  if (tensors.empty()) throw ShapeError("stack: expected a non-empty list of tensors, got an empty list");
  const Shape& ref = tensors.front().shape();
  for (std::size_t i = 1; i < tensors.size(); ++i) {
    if (!(tensors[i].shape() == ref)) {
      throw ShapeError("stack: expected each tensor to be equal size, but got " + ref.str() + " at entry 0 and " +
                       tensors[i].shape().str() + " at entry " + std::to_string(i));
    }
  }
  if (ref.rank() >= kMaxRank) {
    throw ShapeError("stack: the result would have rank " + std::to_string(ref.rank() + 1) + ", expected at most " +
                     std::to_string(kMaxRank));
  }
  const int d = normalize_dim(dim, ref.rank() + 1, "stack");
  auto nodes = detail::nodes_of(tensors);
  graph::Device& dev = graph::common_device(nodes, "stack");
  if (tensors.size() == 1) return unsqueeze(tensors.front(), d);
  std::int64_t outer = 1, inner = 1;
  for (int k = 0; k < d; ++k) outer *= ref[k];
  for (int k = d; k < ref.rank(); ++k) inner *= ref[k];
  Shape out;
  for (int k = 0; k <= ref.rank(); ++k) {
    if (k == d) out.push_back(static_cast<std::int64_t>(tensors.size()));
    if (k < ref.rank()) out.push_back(ref[k]);
  }
  std::vector<std::int64_t> widths(tensors.size(), inner);
  Tensor<T> r(graph::submit(
      std::make_shared<graph::CatNode>("stack", dtype_of<T>(), std::move(nodes), out, &dev, outer, std::move(widths))));
  autograd::record(r, "StackBackward0", detail::edges_of(tensors),
                   [n = tensors.size(), d, ref](const Tensor<T>& g) {
                     std::vector<graph::NodePtr> gs;
                     for (std::size_t i = 0; i < n; ++i) {
                       gs.push_back(reshape(narrow(g, d, static_cast<std::int64_t>(i), 1), ref).node());
                     }
                     return gs;
                   });
  return r;
}
/// stack with a braced list: stack({a, b}, 0).
template <Element T>
Tensor<T> stack(std::initializer_list<Tensor<T>> tensors, std::int64_t dim = 0) {
  return stack(std::vector<Tensor<T>>(tensors), dim);
}

}  // namespace lazy
// ---- end lazytensor/ops/slice.hpp ----
// ---- end lazytensor/ops/shape.hpp ----

namespace lazy {

namespace detail {

/// Reduction dims (at most one per dim of a shape, so they stay inline).
using DimList = core::SmallVector<int, 8>;

/// Normalized, sorted, de-duplicated reduction dims; empty `dims` means all.
DimList reduce_dims(const Shape& s, const std::vector<std::int64_t>& dims, const char* op);

Shape reduced_shape(const Shape& s, const DimList& dims, bool keepdim);

/// [outer, R, inner] when the reduced dims of size > 1 are adjacent; false otherwise.
bool geometry(const Shape& s, const DimList& dims, graph::ReduceGeometry& g);

template <class E>
bool flat_child(const E& e, const std::vector<graph::NodePtr>& inputs) {
  for (const auto& in : inputs)
    if (!(in->shape() == e.shape()) && in->numel() != 1) return false;
  return true;
}

/// Builds the node for reducing the operand `x` (flat kernel form) with reducer R.
template <class R, class Tout, class X>
graph::NodePtr reduction_node(const X& x, const std::vector<std::int64_t>& dims, bool keepdim, double scale_kind,
                              const char* op) {
  const Shape& s = x.shape();
  auto rd = reduce_dims(s, dims, op);
  graph::ReduceGeometry g;
  if (!geometry(s, rd, g)) {
    // Reduced dims are not adjacent: move them to the back first (one copy), then reduce.
    using V = expr::value_t<X>;
    Tensor<V> t = [&] {
      if constexpr (expr::is_expr_node<X>::value) return Tensor<V>(x);
      else return x;
    }();
    std::vector<std::int64_t> perm;
    for (int i = 0; i < s.rank(); ++i)
      if (std::find(rd.begin(), rd.end(), i) == rd.end()) perm.push_back(i);
    for (int d : rd) perm.push_back(d);
    Tensor<V> p = permute(t, perm);
    std::vector<std::int64_t> back;
    for (std::size_t i = 0; i < rd.size(); ++i) back.push_back(s.rank() - static_cast<std::int64_t>(rd.size() + 0) + static_cast<std::int64_t>(i));
    auto node = reduction_node<R, Tout>(p, back, false, scale_kind, op);
    if (!keepdim) return node;
    return reshape(Tensor<Tout>(node), reduced_shape(s, rd, true)).node();
  }
  const Shape out = reduced_shape(s, rd, keepdim);
  const double scale = scale_kind == 0 ? 1.0 : (g.extent ? 1.0 / static_cast<double>(g.extent) : std::nan(""));
  std::vector<graph::NodePtr> inputs;
  inputs.reserve(expr::leaf_count_v<decltype(expr::operand(x))>);
  auto k = expr::to_kernel(expr::operand(x), inputs);
  using K = decltype(k);
  if constexpr (expr::is_expr_node<X>::value) {
    if (!flat_child(x, inputs)) {
      // A broadcast inside the child: materialize it once, then reduce the result.
      return reduction_node<R, Tout>(Tensor<typename X::value_type>(x), dims, keepdim, scale_kind, op);
    }
  }
  using S = expr::lane_combine<expr::kernel_lane_t<K>, expr::lane_of<Tout>>;
  graph::Device& dev = graph::common_device(inputs, op);
  return graph::submit(std::make_shared<graph::ReductionNode<K, R, S, Tout>>(std::move(k), out, g, scale, &dev,
                                                                            std::move(inputs), s));
}

template <class R, class X>
auto reduce(const X& x, const std::vector<std::int64_t>& dims, bool keepdim, const char* op) {
  using T = typename R::template result<expr::value_t<X>>;
  return Tensor<T>(reduction_node<R, T>(x, dims, keepdim, 0, op));
}

template <class X>
void require_nonempty(const X& x, const std::vector<std::int64_t>& dims, const char* op) {
  const Shape& s = x.shape();
  auto rd = reduce_dims(s, dims, op);
  for (int d : rd)
    if (s[d] == 0) {
      throw ShapeError(std::string(op) + ": expected a non-empty dimension to reduce, got size 0 in dim " +
                       std::to_string(d) + " of shape " + s.str());
    }
  if (s.numel() == 0 && rd.empty()) throw ShapeError(std::string(op) + ": cannot reduce a tensor with no elements");
}

/// The reduced shape with kept (size-1) dims, for broadcasting a gradient back.
template <class X>
Shape keep_shape(const X& x, const std::vector<std::int64_t>& dims, const char* op) {
  return reduced_shape(x.shape(), reduce_dims(x.shape(), dims, op), true);
}

/// sum / mean backward: the gradient, scaled, broadcast back over the reduced dims.
template <class T, class X>
void record_sum(Tensor<T>& r, const X& x, const std::vector<std::int64_t>& dims, bool mean) {
  using V = expr::value_t<X>;
  if constexpr (is_floating_v<T> && is_floating_v<V>) {
    if (!autograd::is_grad_enabled()) return;
    auto e = autograd::operand_edge(x);
    if (!e) return;
    const Shape in = x.shape(), keep = keep_shape(x, dims, "sum");
    const double scale = mean && keep.numel() ? static_cast<double>(keep.numel()) / static_cast<double>(in.numel()) : 1.0;
    autograd::record(r, mean ? "MeanBackward0" : "SumBackward0", {e}, [in, keep, scale](const Tensor<T>& g) {
      Tensor<T> gk = reshape(g, keep);
      return std::vector<graph::NodePtr>{
          (scale == 1.0 ? evaluate_as<V>(cast<V>(gk), in) : evaluate_as<V>(cast<V>(gk * scale), in)).node()};
    });
  }
}

/// amax / amin backward: the gradient goes to the extreme elements, split evenly among ties.
template <class T, class X>
void record_extreme(Tensor<T>& r, const X& x, const std::vector<std::int64_t>& dims, const char* name) {
  if constexpr (is_floating_v<T>) {
    if (!autograd::is_grad_enabled()) return;
    auto e = autograd::operand_edge(x);
    if (!e) return;
    const Shape in = x.shape(), keep = keep_shape(x, dims, name);
    autograd::record(r, name, {e}, [x = autograd::saved(x), in, keep, dims, y = r.detach()](const Tensor<T>& g) {
      Tensor<T> hit = cast<T>(x == reshape(y, keep));
      Tensor<T> count = sum(hit, dims, true);
      return std::vector<graph::NodePtr>{evaluate_as<T>(hit * (reshape(g, keep) / count), in).node()};
    });
  }
}

}  // namespace detail

using Dims = std::vector<std::int64_t>;

/// Sum over `dims` (all when empty); integers sum to int64.
template <expr::ExprLike X>
auto sum(const X& x, const Dims& dims = {}, bool keepdim = false) {
  auto r = detail::reduce<ops::reduce::Sum>(x, dims, keepdim, "sum");
  detail::record_sum(r, x, dims, false);
  return r;
}
/// Product over `dims`.
template <expr::ExprLike X>
auto prod(const X& x, const Dims& dims = {}, bool keepdim = false) {
  auto r = detail::reduce<ops::reduce::Prod>(x, dims, keepdim, "prod");
  using T = typename decltype(r)::value_type;
  if constexpr (is_floating_v<T>) {
    if (auto e = autograd::is_grad_enabled() ? autograd::operand_edge(x) : nullptr) {
      // d prod / d x_i = product of the others: prod / x_i without zeros; with one zero in
      // the slice only that element gets the product of the rest; with more, nothing.
      const Shape in = x.shape(), keep = detail::keep_shape(x, dims, "prod");
      autograd::record(r, "ProdBackward0", {e}, [x = autograd::saved(x), in, keep, dims](const Tensor<T>& g) {
        Tensor<T> v = cast<T>(x);
        Tensor<T> zeros = sum(cast<T>(v == 0), dims, true);
        Tensor<T> others = detail::reduce<ops::reduce::Prod>(where(v == 0, 1, v), dims, true, "prod");
        Tensor<T> gk = reshape(g, keep);
        return std::vector<graph::NodePtr>{
            evaluate_as<T>(gk * where(zeros == 0, others / v, where((zeros == 1) & (v == 0), others, 0)), in).node()};
      });
    }
  }
  return r;
}
/// Mean over `dims`; floating types only (DTypeError otherwise, as torch.mean).
template <expr::ExprLike X>
auto mean(const X& x, const Dims& dims = {}, bool keepdim = false) {
  using T = expr::value_t<X>;
  if constexpr (!is_floating_v<T>) {
    throw DTypeError("mean(): could not infer output dtype. Input dtype must be floating point, got " +
                     dtype_name(dtype_of<T>()));
    return Tensor<float>();
  } else {
    Tensor<T> r(detail::reduction_node<ops::reduce::Sum, T>(x, dims, keepdim, 1, "mean"));
    detail::record_sum(r, x, dims, true);
    return r;
  }
}
/// Largest value over `dims` (NaN-propagating).
template <expr::ExprLike X>
auto amax(const X& x, const Dims& dims = {}, bool keepdim = false) {
  detail::require_nonempty(x, dims, "amax");
  auto r = detail::reduce<ops::reduce::Max>(x, dims, keepdim, "amax");
  detail::record_extreme(r, x, dims, "AmaxBackward0");
  return r;
}
/// Smallest value over `dims` (NaN-propagating).
template <expr::ExprLike X>
auto amin(const X& x, const Dims& dims = {}, bool keepdim = false) {
  detail::require_nonempty(x, dims, "amin");
  auto r = detail::reduce<ops::reduce::Min>(x, dims, keepdim, "amin");
  detail::record_extreme(r, x, dims, "AminBackward0");
  return r;
}
/// Largest value: all elements, or along `dim` (values only; see argmax for indices).
template <expr::ExprLike X>
auto max(const X& x) {
  return amax(x);
}
template <expr::ExprLike X>
auto max(const X& x, std::int64_t dim, bool keepdim = false) {
  return amax(x, {dim}, keepdim);
}
/// Smallest value: all elements, or along `dim`.
template <expr::ExprLike X>
auto min(const X& x) {
  return amin(x);
}
template <expr::ExprLike X>
auto min(const X& x, std::int64_t dim, bool keepdim = false) {
  return amin(x, {dim}, keepdim);
}
/// True where any element over `dims` is non-zero.
template <expr::ExprLike X>
Tensor<bool> any(const X& x, const Dims& dims = {}, bool keepdim = false) {
  return Tensor<bool>(detail::reduction_node<ops::reduce::Any, bool>(x != 0, dims, keepdim, 0, "any"));
}
/// True where every element over `dims` is non-zero.
template <expr::ExprLike X>
Tensor<bool> all(const X& x, const Dims& dims = {}, bool keepdim = false) {
  return Tensor<bool>(detail::reduction_node<ops::reduce::All, bool>(x != 0, dims, keepdim, 0, "all"));
}

namespace detail {
template <bool IsMax, class X>
Tensor<std::int64_t> arg_reduce(const X& x, std::optional<std::int64_t> dim, bool keepdim, const char* op) {
  if (!dim) {
    // Over the flattened tensor.
    using V = expr::value_t<X>;
    Tensor<V> t = [&] {
      if constexpr (expr::is_expr_node<X>::value) return Tensor<V>(x);
      else return x;
    }();
    Tensor<V> flat = reshape(t, Shape{t.numel()});
    auto r = arg_reduce<IsMax>(flat, 0, false, op);
    if (!keepdim) return r;
    Shape ones;
    for (int i = 0; i < t.dim(); ++i) ones.push_back(1);
    return reshape(r, ones);
  }
  require_nonempty(x, {*dim}, op);
  const Shape& s = x.shape();
  auto rd = reduce_dims(s, {*dim}, op);
  graph::ReduceGeometry g;
  geometry(s, rd, g);  // a single dim is always adjacent to itself
  std::vector<graph::NodePtr> inputs;
  inputs.reserve(expr::leaf_count_v<decltype(expr::operand(x))>);
  auto k = expr::to_kernel(expr::operand(x), inputs);
  if constexpr (expr::is_expr_node<X>::value) {
    if (!flat_child(x, inputs)) return arg_reduce<IsMax>(Tensor<typename X::value_type>(x), dim, keepdim, op);
  }
  using K = decltype(k);
  graph::Device& dev = graph::common_device(inputs, op);
  return Tensor<std::int64_t>(graph::submit(std::make_shared<graph::ArgReductionNode<K, expr::kernel_lane_t<K>, IsMax>>(
      std::move(k), reduced_shape(s, rd, keepdim), g, &dev, std::move(inputs), s)));
}
}  // namespace detail

/// Index of the largest value (first occurrence), over all elements or along `dim`.
template <expr::ExprLike X>
Tensor<std::int64_t> argmax(const X& x, std::optional<std::int64_t> dim = std::nullopt, bool keepdim = false) {
  return detail::arg_reduce<true>(x, dim, keepdim, "argmax");
}
/// Index of the smallest value (first occurrence), over all elements or along `dim`.
template <expr::ExprLike X>
Tensor<std::int64_t> argmin(const X& x, std::optional<std::int64_t> dim = std::nullopt, bool keepdim = false) {
  return detail::arg_reduce<false>(x, dim, keepdim, "argmin");
}

/// log(sum(exp(x))) over `dims`, computed stably (the max is subtracted first).
template <expr::ExprLike X>
auto logsumexp(const X& x, const Dims& dims = {}, bool keepdim = false) {
  using T = to_floating_t<expr::value_t<X>>;
  Tensor<T> t = cast<T>(x);
  // amax has no identity: over an empty slice the result is log(0) = -inf, as in torch.
  bool empty = false;
  for (int d : detail::reduce_dims(t.shape(), dims, "logsumexp")) empty = empty || t.shape()[d] == 0;
  Tensor<T> m = empty ? sum(t, dims, true) : amax(t, dims, true);
  // An all -inf (or inf) slice would give inf - inf: shift by 0 there instead.
  // The shift only keeps exp in range; it is a constant for autograd (its terms cancel).
  Tensor<T> shift = where(abs(m) == std::numeric_limits<float>::infinity(), 0, m.detach());
  Tensor<T> s = sum(exp(t - shift), dims, true);
  Tensor<T> r = log(s) + shift;
  if (keepdim) return r;
  return reshape(r, detail::reduced_shape(t.shape(), detail::reduce_dims(t.shape(), dims, "logsumexp"), false));
}

/// p-norm over `dims` (p = 2 by default; p = inf is the max of |x|).
template <expr::ExprLike X>
auto norm(const X& x, double p = 2, const Dims& dims = {}, bool keepdim = false) {
  using T = to_floating_t<expr::value_t<X>>;
  // bfloat16 computes in float and rounds once (else the sum and 1/p round to bf16 first).
  using C = compute_t<T>;
  if (p == 2) return Tensor<T>(cast<T>(sqrt(sum(cast<C>(x) * cast<C>(x), dims, keepdim))));
  if (p == 1) return Tensor<T>(sum(abs(cast<T>(x)), dims, keepdim));
  if (std::isinf(p) && p > 0) return Tensor<T>(amax(abs(cast<T>(x)), dims, keepdim));
  if (p == 0) return Tensor<T>(cast<T>(sum(cast<T>(x) != 0, dims, keepdim)));
  return Tensor<T>(cast<T>(pow(sum(pow(abs(cast<C>(x)), p), dims, keepdim), 1.0 / p)));
}

}  // namespace lazy

#if LAZYTENSOR_HEADER_DEFINITIONS
namespace lazy::detail {

LAZYTENSOR_INLINE DimList reduce_dims(const Shape& s, const std::vector<std::int64_t>& dims, const char* op) {
  DimList d;
  if (dims.empty()) {
    for (int i = 0; i < s.rank(); ++i) d.push_back(i);
    return d;
  }
  for (auto x : dims) {
    const int n = normalize_dim(x, s.rank(), op);
    if (std::find(d.begin(), d.end(), n) != d.end()) {
      throw ShapeError(std::string(op) + ": dim " + std::to_string(n) + " appears multiple times in the list of dims");
    }
    d.push_back(n);
  }
  std::sort(d.begin(), d.end());
  if (s.rank() == 0) d.resize(0);
  return d;
}

LAZYTENSOR_INLINE Shape reduced_shape(const Shape& s, const DimList& dims, bool keepdim) {
  Shape out;
  for (int i = 0; i < s.rank(); ++i) {
    const bool r = std::find(dims.begin(), dims.end(), i) != dims.end();
    if (!r) out.push_back(s[i]);
    else if (keepdim) out.push_back(1);
  }
  return out;
}

LAZYTENSOR_INLINE bool geometry(const Shape& s, const DimList& dims, graph::ReduceGeometry& g) {
  int lo = -1, hi = -1;
  for (int d : dims)
    if (s[d] != 1) {
      if (lo < 0) lo = d;
      hi = d;
    }
  g = {};
  if (lo < 0) {  // nothing of size > 1 is reduced
    g.outer = s.numel();
    return true;
  }
  for (int i = lo; i <= hi; ++i) {
    const bool r = std::find(dims.begin(), dims.end(), i) != dims.end();
    if (!r && s[i] != 1) return false;
  }
  for (int i = 0; i < s.rank(); ++i) {
    if (i < lo) g.outer *= s[i];
    else if (i > hi) g.inner *= s[i];
    else g.extent *= s[i];
  }
  return true;
}

}  // namespace lazy::detail
#endif  // LAZYTENSOR_HEADER_DEFINITIONS

// Per-dtype templates the compiled runtime instantiates once (core/config.hpp): the
// reductions of a tensor (not of an expression) and their backward records.
#define LAZYTENSOR_REDUCTION_INSTANCES(P, T)                                                                  \
  P template lazy::graph::NodePtr lazy::detail::reduction_node<lazy::ops::reduce::Sum, T, lazy::Tensor<T>>(    \
      const lazy::Tensor<T>&, const std::vector<std::int64_t>&, bool, double, const char*);                   \
  P template lazy::graph::NodePtr lazy::detail::reduction_node<lazy::ops::reduce::Max, T, lazy::Tensor<T>>(    \
      const lazy::Tensor<T>&, const std::vector<std::int64_t>&, bool, double, const char*);                   \
  P template lazy::graph::NodePtr lazy::detail::reduction_node<lazy::ops::reduce::Min, T, lazy::Tensor<T>>(    \
      const lazy::Tensor<T>&, const std::vector<std::int64_t>&, bool, double, const char*);                   \
  P template void lazy::detail::record_sum<T, lazy::Tensor<T>>(lazy::Tensor<T>&, const lazy::Tensor<T>&,      \
                                                               const std::vector<std::int64_t>&, bool);       \
  P template void lazy::detail::record_extreme<T, lazy::Tensor<T>>(lazy::Tensor<T>&, const lazy::Tensor<T>&,  \
                                                                   const std::vector<std::int64_t>&, const char*);
#if LAZYTENSOR_EXPLICIT_INSTANTIATION
LAZYTENSOR_FOR_FLOATING(LAZYTENSOR_REDUCTION_INSTANCES, extern)
#endif
// ---- end lazytensor/ops/reduction.hpp ----

namespace lazy {

namespace detail {

/// The operand as a GEMM reads it: through a pending transpose when there is one.
template <Element T>
typename graph::GemmNode<T>::Operand gemm_operand(const Tensor<T>& t) {
  const auto& n = t.node();
  if (n->pending()) {
    // Only a 2-D source: batched GEMMs may stack batch rows, which a transposed read breaks.
    if (auto* tr = dynamic_cast<graph::TransposeOfLastTwo*>(n.get()); tr && tr->transpose_source()->shape().rank() == 2)
      return {tr->transpose_source(), true};
  }
  return {n, false};
}

template <Element T>
Tensor<T> gemm(const Tensor<T>& a, const Tensor<T>& b, std::int64_t batch_a, std::int64_t batch_b,
               std::int64_t m, std::int64_t k, std::int64_t n, const Shape& out);

/// Backward of C[b] = A[b] B[b] with A viewed as [batch_a, m, k], B as [batch_b, k, n] (a
/// batch of 1 broadcasts): dA = dC B^T, dB = A^T dC, summed over broadcast batches. When a
/// side is shared by every batch, the batches are stacked into one GEMM instead.
/// `b_transposed`: B is the transpose of a stored [n, k] matrix (linear's weight), so dB is
/// computed as dB^T = dC^T A in that matrix's layout; the transpose's own backward then
/// folds away (transpose of a transpose) instead of copying the gradient.
template <Element T>
void record_gemm(Tensor<T>& c, const Tensor<T>& a, const Tensor<T>& b, std::int64_t batch_a,
                 std::int64_t batch_b, std::int64_t m, std::int64_t k, std::int64_t n,
                 bool b_transposed) {
  auto ea = autograd::edge_of(a.impl()), eb = autograd::edge_of(b.impl());
  if (!ea && !eb) return;
  autograd::record(c, "MmBackward0", {ea, eb},
                   [a = a.detach(), b = b.detach(), batch_a, batch_b, m, k, n,
                    need_a = ea != nullptr, need_b = eb != nullptr,
                    b_transposed](const Tensor<T>& g) {
                     const std::int64_t B = std::max(batch_a, batch_b);
                     std::vector<graph::NodePtr> grads(2);
                     if (need_a) {
                       // dA[b] = dC[b] B[b]^T: [B*m, n] x [n, k] stacked when B is shared.
                       Tensor<T> da = batch_b == 1 ? gemm(g, transpose(reshape(b, Shape{k, n}), 0, 1), 1, 1, B * m, n, k, Shape{B, m, k})
                                                   : gemm(g, transpose(reshape(b, Shape{B, k, n}), 1, 2), B, B, m, n, k, Shape{B, m, k});
                       if (batch_a == 1 && B > 1) da = sum(da, {0});
                       grads[0] = reshape(da, a.shape()).node();
                     }
                     if (need_b) {
                       Tensor<T> db;
                       if (batch_b == 1 && b_transposed) {  // dB^T = dC^T A over the stacked rows
                         db = transpose(
                             gemm(transpose(reshape(g, Shape{B * m, n}), 0, 1),
                                  reshape(a, Shape{B * m, k}), 1, 1, n, B * m, k, Shape{n, k}),
                             0, 1);
                       } else if (batch_a == 1) {  // A shared: dB[b] = A^T dC[b]
                         db = gemm(transpose(reshape(a, Shape{m, k}), 0, 1), g, 1, B, k, m, n, Shape{B, k, n});
                       } else if (batch_b == 1) {  // B shared: one GEMM over the stacked batches
                         db = gemm(transpose(reshape(a, Shape{B * m, k}), 0, 1), reshape(g, Shape{B * m, n}), 1, 1, k,
                                   B * m, n, Shape{k, n});
                       } else {
                         db = gemm(transpose(reshape(a, Shape{B, m, k}), 1, 2), g, B, B, k, m, n, Shape{B, k, n});
                       }
                       if (batch_b == 1 && B > 1 && batch_a == 1) db = sum(db, {0});
                       grads[1] = reshape(db, b.shape()).node();
                     }
                     return grads;
                   });
}

template <Element T>
Tensor<T> gemm(const Tensor<T>& a, const Tensor<T>& b, std::int64_t batch_a, std::int64_t batch_b,
               std::int64_t m, std::int64_t k, std::int64_t n, const Shape& out) {
  auto oa = gemm_operand(a), ob = gemm_operand(b);
  graph::Device& dev = graph::common_device({oa.node, ob.node}, "matmul");
  Tensor<T> c(graph::submit(std::make_shared<graph::GemmNode<T>>(oa, ob, batch_a, batch_b, m, k, n, out, &dev)));
  if constexpr (is_floating_v<T>) {
    if (autograd::is_grad_enabled()) record_gemm(c, a, b, batch_a, batch_b, m, k, n, ob.transposed);
  }
  return c;
}

[[noreturn]] void matmul_mismatch(const Shape& a, const Shape& b, std::int64_t ka, std::int64_t kb);

/// x rounded to bfloat16 and held as float (autocast's operands and results); the gradient
/// is rounded the same way, as the backward of torch's casts rounds it.
Tensor<float> round_to_bf16(const Tensor<float>& x);

}  // namespace detail

/// Matrix product with torch.matmul's rules: 1-D x 1-D is a dot product, 2-D x 2-D a matrix
/// product, 1-D operands gain and lose a dimension, and leading (batch) dims broadcast.
/// bfloat16 operands multiply in float and the result is rounded once (as a bfloat16 GEMM
/// with float accumulation); under autocast (AutocastGuard) float operands do the same.
template <Element T>
Tensor<T> matmul(const Tensor<T>& a, const Tensor<T>& b) {
  if constexpr (std::is_same_v<T, bfloat16>) {
    return Tensor<bfloat16>(cast<bfloat16>(matmul(Tensor<float>(cast<float>(a)), Tensor<float>(cast<float>(b)))));
  } else if constexpr (!std::is_same_v<T, float> && !std::is_same_v<T, double> && !std::is_same_v<T, std::int32_t> &&
                       !std::is_same_v<T, std::int64_t>) {
    throw DTypeError("matmul: expected floating, int32 or int64 operands, got " + dtype_name(dtype_of<T>()));
  } else {
    if constexpr (std::is_same_v<T, float>) {
      if (is_autocast_enabled()) {
        AutocastGuard off(false);
        return detail::round_to_bf16(matmul(detail::round_to_bf16(a), detail::round_to_bf16(b)));
      }
    }
    const Shape& sa = a.shape();
    const Shape& sb = b.shape();
    if (sa.rank() == 0 || sb.rank() == 0) {
      throw ShapeError("matmul: both arguments need at least 1 dimension, got " + sa.str() + " and " + sb.str());
    }
    if (sa.rank() == 1 && sb.rank() == 1) {
      if (sa[0] != sb[0]) detail::matmul_mismatch(sa, sb, sa[0], sb[0]);
      return detail::gemm(reshape(a, Shape{1, sa[0]}), reshape(b, Shape{sb[0], 1}), 1, 1, 1, sa[0], 1, Shape{});
    }
    if (sb.rank() == 1) {  // [.., m, k] x [k]
      const std::int64_t k = sa[sa.rank() - 1];
      if (k != sb[0]) detail::matmul_mismatch(sa, sb, k, sb[0]);
      Shape out;
      for (int i = 0; i + 1 < sa.rank(); ++i) out.push_back(sa[i]);
      const std::int64_t m = k ? a.numel() / k : out.numel();
      return detail::gemm(reshape(a, Shape{m, k}), reshape(b, Shape{k, 1}), 1, 1, m, k, 1, out);
    }
    if (sa.rank() == 1) {  // [k] x [.., k, n]
      const std::int64_t k = sb[sb.rank() - 2], n = sb[sb.rank() - 1];
      if (k != sa[0]) detail::matmul_mismatch(sa, sb, sa[0], k);
      Shape out;
      for (int i = 0; i + 2 < sb.rank(); ++i) out.push_back(sb[i]);
      out.push_back(n);
      std::int64_t batch = 1;  // not numel / (k * n): k or n may be 0
      for (int i = 0; i + 2 < sb.rank(); ++i) batch *= sb[i];
      return detail::gemm(reshape(a, Shape{1, k}), b, 1, batch, 1, k, n, out);
    }
    const std::int64_t m = sa[sa.rank() - 2], k = sa[sa.rank() - 1];
    const std::int64_t kb = sb[sb.rank() - 2], n = sb[sb.rank() - 1];
    if (k != kb) detail::matmul_mismatch(sa, sb, k, kb);
    Shape ba, bb;
    for (int i = 0; i + 2 < sa.rank(); ++i) ba.push_back(sa[i]);
    for (int i = 0; i + 2 < sb.rank(); ++i) bb.push_back(sb[i]);
    const Shape batch = broadcast_shapes(ba, bb, "matmul");
    Shape out = batch;
    out.push_back(m);
    out.push_back(n);
    if (bb.numel() == 1 && sb.rank() == 2) {
      // [.., m, k] x [k, n]: one GEMM with all batch rows stacked (m' = batch * m).
      return detail::gemm(a, b, 1, 1, ba.numel() * m, k, n, out);
    }
    Shape fa = batch, fb = batch;
    fa.push_back(m);
    fa.push_back(k);
    fb.push_back(k);
    fb.push_back(n);
    Tensor<T> ea = (ba == batch) ? a : expand(a, fa);
    Tensor<T> eb = (bb == batch) ? b : expand(b, fb);
    return detail::gemm(ea, eb, batch.numel(), batch.numel(), m, k, n, out);
  }
}

/// Batched matrix product of [b, m, k] and [b, k, n] (no broadcasting, as torch.bmm).
template <Element T>
Tensor<T> bmm(const Tensor<T>& a, const Tensor<T>& b) {
  if (a.dim() != 3 || b.dim() != 3 || a.size(0) != b.size(0)) {
    throw ShapeError("bmm: expected 3-D tensors with equal batch sizes, got " + a.shape().str() + " and " +
                     b.shape().str());
  }
  return matmul(a, b);
}

/// x @ w^T (torch.nn.functional.linear without bias); w is [out_features, in_features].
template <Element T>
Tensor<T> linear(const Tensor<T>& x, const Tensor<T>& w) {
  if (w.dim() != 2 || x.dim() < 1 || x.size(-1) != w.size(1)) {
    throw ShapeError("linear: expected input [..., " + std::to_string(w.dim() == 2 ? w.size(1) : -1) +
                     "] and weight [out_features, in_features], got input " + x.shape().str() + " and weight " +
                     w.shape().str());
  }
  if constexpr (std::is_same_v<T, float>) {
    if (is_autocast_enabled()) {  // w rounded before the transpose, which the GEMM reads through
      AutocastGuard off(false);
      return detail::round_to_bf16(matmul(detail::round_to_bf16(x), transpose(detail::round_to_bf16(w), 0, 1)));
    }
  }
  return matmul(x, transpose(w, 0, 1));
}

/// x @ w^T + b. Returns an expression (as `a + b` does), so a following element-wise op
/// such as relu joins the bias in one epilogue that runs on the GEMM's row blocks.
/// (The return type is spelled out so that naming a call does not compile the GEMM: a
/// deduced type would instantiate this body wherever a call is merely written.)
template <Element T>
auto linear(const Tensor<T>& x, const Tensor<T>& w, const Tensor<T>& b)
    -> decltype(std::declval<const Tensor<T>&>() + std::declval<const Tensor<T>&>()) {
  if (b.dim() != 1 || b.size(0) != w.size(0)) {
    throw ShapeError("linear: expected bias of shape (" + std::to_string(w.size(0)) + ",), got " + b.shape().str());
  }
  return linear(x, w) + b;
}

}  // namespace lazy

#if LAZYTENSOR_HEADER_DEFINITIONS
namespace lazy::detail {
LAZYTENSOR_INLINE Tensor<float> round_to_bf16(const Tensor<float>& x) {
  Tensor<float> y(graph::submit(std::make_shared<graph::RoundToBFloat16Node>(x.node())));
  if (autograd::is_grad_enabled()) {
    if (auto edge = autograd::edge_of(x.impl())) {
      autograd::record(y, "RoundToBFloat16Backward", {edge}, [](const Tensor<float>& g) {
        return std::vector<graph::NodePtr>{graph::submit(std::make_shared<graph::RoundToBFloat16Node>(g.node()))};
      });
    }
  }
  return y;
}


LAZYTENSOR_INLINE void matmul_mismatch(const Shape& a, const Shape& b, std::int64_t ka, std::int64_t kb) {
  throw ShapeError("matmul: mat1 and mat2 shapes cannot be multiplied (" + a.str() + " and " + b.str() +
                   "): expected the contracted sizes to match, found " + std::to_string(ka) + " and " +
                   std::to_string(kb));
}

}  // namespace lazy::detail
#endif  // LAZYTENSOR_HEADER_DEFINITIONS
// ---- end lazytensor/ops/matmul.hpp ----
// ---- begin lazytensor/ops/random.hpp ----
// Random tensors from a counter-based generator (Philox4x32-10, Salmon et al., "Parallel
// Random Numbers: As Easy as 1, 2, 3", SC'11). A counter-based generator needs no state
// per thread: the value of element i is a pure function of (seed, counter(i)), so results
// are identical whatever the thread count and however the work is chunked.
//
// Streams: each call reserves a block of counters from its device's RngState at creation
// time (offset .. offset + blocks) and captures the seed; element i uses counter
// offset + i / P, where P is how many elements one 128-bit Philox output yields (4 for
// 32-bit draws, 2 for 64-bit draws): in the 4 * B words of a block of B consecutive
// counters, element j of the block reads word j (32-bit draws) or words 2j, 2j + 1. The
// values are computed lazily, at mark_step, by a RandomNode (graph/random_node.hpp, with
// Philox and the distributions), always a whole block at a time (block k holds the call's
// elements k * B * P ..), so a vectorized distribution gives every element the same bits
// whichever task computes it. set_rng_state / manual_seed restart the stream; mark_step
// advances the seed.

#include <cstdint>
#include <limits>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

// ---- begin lazytensor/graph/random_node.hpp ----
// RandomNode, the kernel of every random tensor: Philox4x32-10 (a counter-based generator,
// so element i's value is a pure function of the seed and i, whatever the thread count) and
// the distributions that turn its output words into elements (uniform, normal, integers,
// Bernoulli). ops/random.hpp describes the streams and reserves the counters.

#include <algorithm>
#include <array>
#include <cstdint>
#include <numbers>
#include <string>
#include <type_traits>
#include <vector>

#include <xsimd/xsimd.hpp>


namespace lazy {

namespace ops {

/// 128-bit Philox counter (four 32-bit words, word 0 least significant).
using PhiloxCounter = std::array<std::uint32_t, 4>;
/// 64-bit Philox key (two 32-bit words).
using PhiloxKey = std::array<std::uint32_t, 2>;

/// The Philox4x32-10 bijection of `counter` under `key`: ten rounds of two 32x32->64-bit
/// multiplies, with the key bumped by the Weyl constants between rounds. Matches the
/// Random123 known-answer vectors (e.g. counter 0, key 0 -> 6627e8d5 e169c58d bc57ac4c
/// 9b00dbd8).
constexpr PhiloxCounter philox4x32_10(PhiloxCounter ctr, PhiloxKey key) {
  constexpr std::uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u;  // round multipliers
  constexpr std::uint32_t kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;  // Weyl key increments
  for (int r = 0; r < 10; ++r) {
    if (r > 0) {
      key[0] += kW0;
      key[1] += kW1;
    }
    const std::uint64_t p0 = std::uint64_t{kM0} * ctr[0];
    const std::uint64_t p1 = std::uint64_t{kM1} * ctr[2];
    const auto hi0 = static_cast<std::uint32_t>(p0 >> 32), lo0 = static_cast<std::uint32_t>(p0);
    const auto hi1 = static_cast<std::uint32_t>(p1 >> 32), lo1 = static_cast<std::uint32_t>(p1);
    ctr = {hi1 ^ ctr[1] ^ key[0], lo1, hi0 ^ ctr[3] ^ key[1], lo0};
  }
  return ctr;
}

/// The key of a 64-bit seed: its low and high words.
constexpr PhiloxKey philox_key(std::uint64_t seed) {
  return {static_cast<std::uint32_t>(seed), static_cast<std::uint32_t>(seed >> 32)};
}

/// Philox output for 64-bit counter value `c` (the upper 64 counter bits are zero).
constexpr PhiloxCounter philox_block(std::uint64_t c, const PhiloxKey& key) {
  return philox4x32_10({static_cast<std::uint32_t>(c), static_cast<std::uint32_t>(c >> 32), 0u, 0u}, key);
}

}  // namespace ops

namespace graph {

namespace detail {

// A distribution turns the 4 * kRandomBlock words of one block of counters into
// P * kRandomBlock elements (P = per_counter). fill(words, j0, cnt, out, i) writes elements
// [j0, j0 + cnt) of the block to out[0..cnt); `i` is the global index of out[0] (for
// distributions that read an input element-wise). A distribution that vectorizes computes
// the whole block and keeps the part asked for, so no element's bits depend on where a task
// starts.

/// Counters per block.
inline constexpr int kRandomBlock = 16;

/// Uniform 24-bit float in [0, 1): exact, never 1.
inline float unit_float(std::uint32_t x) { return static_cast<float>(x >> 8) * 0x1p-24f; }
inline std::uint64_t word64(std::uint32_t hi, std::uint32_t lo) { return (std::uint64_t{hi} << 32) | lo; }
/// Uniform 53-bit double in [0, 1).
inline double unit_double(std::uint32_t hi, std::uint32_t lo) {
  return static_cast<double>(word64(hi, lo) >> 11) * 0x1p-53;
}

/// torch.rand: uniform in [0, 1).
template <Element T>
struct UniformDist {
  static constexpr const char* name = "rand";
  static constexpr int per_counter = std::is_same_v<T, double> ? 2 : 4;
  static constexpr double cost = 2;
  std::string params() const { return ""; }
  void bind(const std::vector<NodePtr>&) {}
  void fill(const std::uint32_t* w, int j0, int cnt, T* out, std::int64_t) const {
    for (int k = 0; k < cnt; ++k) {
      const int j = j0 + k;
      if constexpr (std::is_same_v<T, double>) {
        out[k] = unit_double(w[2 * j], w[2 * j + 1]);
      } else if constexpr (std::is_same_v<T, bfloat16>) {
        // 8 random bits: k / 256 is exact in bfloat16, whereas rounding a 24-bit float
        // could round up to 1.0 and break the [0, 1) contract.
        out[k] = bfloat16(static_cast<float>(w[j] >> 24) * 0x1p-8f);
      } else {
        out[k] = unit_float(w[j]);
      }
    }
  }
};

/// torch.randn: standard normal by Box-Muller on pairs of uniforms (u1, u2) -> (r cos t,
/// r sin t), r = sqrt(-2 log u1), t = 2 pi u2. u1 is in (0, 1], so log(0) cannot happen.
/// Vectorized with xsimd over a whole block; bfloat16 computes in float and rounds.
template <Element T>
struct NormalDist {
  static constexpr const char* name = "randn";
  static constexpr int per_counter = std::is_same_v<T, double> ? 2 : 4;
  static constexpr double cost = 6;
  std::string params() const { return ""; }
  void bind(const std::vector<NodePtr>&) {}
  void fill(const std::uint32_t* w, int j0, int cnt, T* out, std::int64_t) const {
    using S = std::conditional_t<std::is_same_v<T, double>, double, float>;
    using V = xsimd::batch<S>;
    constexpr int kPairs = kRandomBlock * per_counter / 2;
    static_assert(kPairs % V::size == 0, "a block is a whole number of SIMD batches");
    alignas(64) S u1[kPairs], u2[kPairs], z[2 * kPairs];
    for (int m = 0; m < kPairs; ++m) {
      if constexpr (std::is_same_v<S, double>) {
        u1[m] = static_cast<double>((word64(w[4 * m], w[4 * m + 1]) >> 11) + 1) * 0x1p-53;
        u2[m] = unit_double(w[4 * m + 2], w[4 * m + 3]);
      } else {
        u1[m] = static_cast<float>((w[2 * m] >> 8) + 1) * 0x1p-24f;
        u2[m] = unit_float(w[2 * m + 1]);
      }
    }
    for (int m = 0; m < kPairs; m += static_cast<int>(V::size)) {
      const V r = xsimd::sqrt(V(S(-2)) * xsimd::log(V::load_aligned(u1 + m)));
      const auto [sn, cs] = xsimd::sincos(V(S(2) * std::numbers::pi_v<S>) * V::load_aligned(u2 + m));
      alignas(64) S c[V::size], s[V::size];
      (r * cs).store_aligned(c);
      (r * sn).store_aligned(s);
      for (std::size_t l = 0; l < V::size; ++l) {
        z[2 * (m + static_cast<int>(l))] = c[l];
        z[2 * (m + static_cast<int>(l)) + 1] = s[l];
      }
    }
    for (int k = 0; k < cnt; ++k) out[k] = static_cast<T>(z[j0 + k]);
  }
};

/// torch.randint: integers in [low, high). A 64-bit draw modulo the range: the bias is at
/// most range / 2^64, far below anything a test can see.
template <Element T>
struct RandIntDist {
  static constexpr const char* name = "randint";
  static constexpr int per_counter = 2;
  static constexpr double cost = 3;
  std::int64_t low;
  std::uint64_t range;
  std::string params() const {
    return "low=" + std::to_string(low) + ", high=" + std::to_string(static_cast<std::int64_t>(static_cast<std::uint64_t>(low) + range));
  }
  void bind(const std::vector<NodePtr>&) {}
  void fill(const std::uint32_t* w, int j0, int cnt, T* out, std::int64_t) const {
    for (int k = 0; k < cnt; ++k) {
      const int j = j0 + k;
      // Unsigned arithmetic: low + v may pass through values outside int64 mid-way.
      const std::uint64_t v = static_cast<std::uint64_t>(low) + word64(w[2 * j], w[2 * j + 1]) % range;
      out[k] = static_cast<T>(static_cast<std::int64_t>(v));
    }
  }
};

/// torch.bernoulli with one probability: 1 with probability p, else 0.
template <Element T>
struct BernoulliDist {
  static constexpr const char* name = "bernoulli";
  static constexpr int per_counter = 4;
  static constexpr double cost = 2;
  double p;
  std::string params() const { return "p=" + std::to_string(p); }
  void bind(const std::vector<NodePtr>&) {}
  void fill(const std::uint32_t* w, int j0, int cnt, T* out, std::int64_t) const {
    // u = x / 2^32 in [0, 1): p = 0 never fires, p = 1 always does.
    for (int k = 0; k < cnt; ++k) out[k] = static_cast<T>(static_cast<double>(w[j0 + k]) * 0x1p-32 < p);
  }
};

/// torch.bernoulli(probs): element i is 1 with probability probs[i]. Probabilities outside
/// [0, 1] (or NaN) raise lazy::Error when the kernel runs.
template <Element T>
struct BernoulliTensorDist {
  static constexpr const char* name = "bernoulli";
  static constexpr int per_counter = 4;
  static constexpr double cost = 3;
  const T* probs = nullptr;
  std::string params() const { return "p=%0"; }
  void bind(const std::vector<NodePtr>& ins) { probs = ins[0]->template data<T>(); }
  void fill(const std::uint32_t* w, int j0, int cnt, T* out, std::int64_t i) const {
    for (int k = 0; k < cnt; ++k) {
      const double p = static_cast<double>(static_cast<compute_t<T>>(probs[i + k]));
      if (!(p >= 0.0 && p <= 1.0)) {
        throw Error("bernoulli: expected every probability in [0, 1], found " + std::to_string(p) + " at element " +
                    std::to_string(i + k));
      }
      out[k] = static_cast<T>(static_cast<double>(w[j0 + k]) * 0x1p-32 < p);
    }
  }
};

}  // namespace detail

/// A tensor of random values drawn from distribution D with counters offset.. of `seed`.
template <Element T, class D>
class RandomNode final : public Node {
 public:
  RandomNode(D dist, Shape shape, Device* device, std::uint64_t seed, std::uint64_t offset,
             std::vector<NodePtr> inputs = {})
      : Node(NodeKind::Random, dtype_of<T>(), shape, device, std::move(inputs)), dist_(dist), seed_(seed),
        offset_(offset) {}

  std::string op_name() const override { return D::name; }
  std::string describe() const override {
    const std::string p = dist_.params();
    return std::string(D::name) + "(" + p + (p.empty() ? "" : ", ") + "offset=" + std::to_string(offset_) + ")";
  }
  double cost_per_element() const override { return D::cost; }
  /// Shape, dtype and distribution only: a new seed or offset every step must not make the
  /// plan look new (the values are data, as a learning rate is).
  std::uint64_t structural_hash() const override { return Node::structural_hash(); }

  std::uint64_t seed() const { return seed_; }
  std::uint64_t offset() const { return offset_; }

 protected:
  void compute(ExecContext& ctx) override {
    D d = dist_;
    d.bind(inputs());  // input pointers first (house rule)
    // No donation: bernoulli(probs) may throw half-way, and must leave its input intact.
    auto buf = allocate_output(ctx, false);
    T* out = static_cast<T*>(buf->data());
    const std::int64_t n = numel();
    constexpr std::int64_t E = std::int64_t{detail::kRandomBlock} * D::per_counter;  // elements per block
    const auto key = ops::philox_key(seed_);
    auto& pool = ctx.device.threads();
    const std::int64_t tasks = task_count(pool, n, D::cost);
    pool.parallel_for(tasks, [&](std::int64_t t) {
      // Tasks start on block boundaries (no block computed twice), but the values depend
      // only on the element index either way.
      auto [b, e] = task_range(n, tasks, t, E);
      std::uint32_t words[4 * detail::kRandomBlock];
      for (std::int64_t i = b; i < e;) {
        const std::int64_t blk = i / E;
        const std::uint64_t c0 = offset_ + static_cast<std::uint64_t>(blk) * detail::kRandomBlock;
        for (int c = 0; c < detail::kRandomBlock; ++c) {
          const auto r = ops::philox_block(c0 + static_cast<std::uint64_t>(c), key);
          for (int k = 0; k < 4; ++k) words[4 * c + k] = r[k];
        }
        const int j0 = static_cast<int>(i - blk * E);
        const int cnt = static_cast<int>(std::min<std::int64_t>(E - j0, e - i));
        d.fill(words, j0, cnt, out + i, i);
        i += cnt;
      }
    });
    set_buffer(std::move(buf));
  }

 private:
  D dist_;
  std::uint64_t seed_, offset_;
};

}  // namespace graph

}  // namespace lazy
// ---- end lazytensor/graph/random_node.hpp ----

namespace lazy {

namespace detail {

/// Reserves the counters of `n` elements from the device stream and builds the node.
template <Element T, class D>
Tensor<T> make_random(D dist, const Shape& shape, const Device& dev, std::vector<graph::NodePtr> inputs = {}) {
  graph::Device& eng = dev.engine();
  auto& rng = eng.rng();
  const auto blocks = static_cast<std::uint64_t>((shape.numel() + D::per_counter - 1) / D::per_counter);
  const std::uint64_t offset = rng.offset;
  rng.offset += blocks;
  return Tensor<T>(graph::submit(
      std::make_shared<graph::RandomNode<T, D>>(dist, shape, &eng, rng.seed, offset, std::move(inputs))));
}

template <class T>
constexpr std::int64_t exact_integer_limit() {
  if constexpr (std::is_same_v<T, bfloat16>) return std::int64_t{1} << 8;
  else if constexpr (std::is_same_v<T, float>) return std::int64_t{1} << 24;
  else return std::int64_t{1} << 53;
}

}  // namespace detail

/// Seeds the current device's random stream; alias of set_rng_state (torch.manual_seed).
inline void manual_seed(std::uint64_t seed) { set_rng_state(seed); }

/// Uniform values in [0, 1) (torch.rand). T: float, double or bfloat16. Lazy: drawn when
/// the tensor is materialized, identical whatever the thread count.
template <Element T>
  requires is_floating_v<T>
Tensor<T> rand(const Shape& shape, Device dev = device()) {
  return detail::make_random<T>(graph::detail::UniformDist<T>{}, shape, dev);
}

/// Standard normal values (torch.randn). T: float, double or bfloat16.
template <Element T>
  requires is_floating_v<T>
Tensor<T> randn(const Shape& shape, Device dev = device()) {
  return detail::make_random<T>(graph::detail::NormalDist<T>{}, shape, dev);
}

/// rand with t's shape and device.
template <Element T>
  requires is_floating_v<T>
Tensor<T> rand_like(const Tensor<T>& t) {
  return rand<T>(t.shape(), t.device());
}
/// randn with t's shape and device.
template <Element T>
  requires is_floating_v<T>
Tensor<T> randn_like(const Tensor<T>& t) {
  return randn<T>(t.shape(), t.device());
}

/// Integers uniform in [low, high) (torch.randint), stored as T (int32, int64, float,
/// double or bfloat16; default int64). lazy::Error when low >= high or when a bound does
/// not fit T (exactly, for floating T).
template <Element T = std::int64_t>
  requires(!std::is_same_v<T, bool>)
Tensor<T> randint(std::int64_t low, std::int64_t high, const Shape& shape, Device dev = device()) {
  if (low >= high) {
    throw Error("randint: expected low < high, got low=" + std::to_string(low) + ", high=" + std::to_string(high));
  }
  if constexpr (is_integral_v<T>) {
    if (low < std::numeric_limits<T>::min() || high - 1 > std::numeric_limits<T>::max()) {
      throw Error("randint: range [" + std::to_string(low) + ", " + std::to_string(high) + ") does not fit " +
                  dtype_name(dtype_of<T>()));
    }
  } else {
    constexpr std::int64_t lim = detail::exact_integer_limit<T>();
    if (low < -lim || high > lim) {
      throw Error("randint: range [" + std::to_string(low) + ", " + std::to_string(high) + ") is not exactly " +
                  "representable in " + dtype_name(dtype_of<T>()) + " (expected bounds within +-" +
                  std::to_string(lim) + ")");
    }
  }
  const std::uint64_t range = static_cast<std::uint64_t>(high) - static_cast<std::uint64_t>(low);
  return detail::make_random<T>(graph::detail::RandIntDist<T>{low, range}, shape, dev);
}

/// Integers uniform in [0, high) (torch.randint(high, size)).
template <Element T = std::int64_t>
  requires(!std::is_same_v<T, bool>)
Tensor<T> randint(std::int64_t high, const Shape& shape, Device dev = device()) {
  return randint<T>(0, high, shape, dev);
}

/// 1 with probability p, else 0, for every element (torch.empty(shape).bernoulli_(p)).
/// T: any element type (bool gives true/false). lazy::Error unless 0 <= p <= 1.
template <Element T>
Tensor<T> bernoulli(double p, const Shape& shape, Device dev = device()) {
  if (!(p >= 0.0 && p <= 1.0)) {
    throw Error("bernoulli: expected 0 <= p <= 1, got p=" + std::to_string(p));
  }
  return detail::make_random<T>(graph::detail::BernoulliDist<T>{p}, shape, dev);
}

/// Element i is 1 with probability probs[i], else 0 (torch.bernoulli(probs)); the result
/// has probs' shape, dtype and device. probs: a floating tensor or expression; values
/// outside [0, 1] raise lazy::Error when the kernel runs (next mark_step or read).
template <expr::ExprLike X>
  requires is_floating_v<expr::value_t<X>>
auto bernoulli(const X& probs) {
  using T = expr::value_t<X>;
  Tensor<T> p = [&] {
    if constexpr (std::is_same_v<X, Tensor<T>>) return probs;
    else if constexpr (expr::is_expr_node<X>::value) return Tensor<T>(probs);
    else return Tensor<T>(probs.to_leaf().node);
  }();
  return detail::make_random<T>(graph::detail::BernoulliTensorDist<T>{}, p.shape(), p.device(),
                                            {p.node()});
}

}  // namespace lazy

// Per-dtype templates the compiled runtime instantiates once (core/config.hpp).
#define LAZYTENSOR_RANDOM_INSTANCES(P, T)                                                                   \
  P template lazy::Tensor<T> lazy::detail::make_random<T, lazy::graph::detail::UniformDist<T>>(              \
      lazy::graph::detail::UniformDist<T>, const lazy::Shape&, const lazy::Device&, std::vector<lazy::graph::NodePtr>); \
  P template lazy::Tensor<T> lazy::detail::make_random<T, lazy::graph::detail::NormalDist<T>>(               \
      lazy::graph::detail::NormalDist<T>, const lazy::Shape&, const lazy::Device&, std::vector<lazy::graph::NodePtr>);
#define LAZYTENSOR_RANDINT_INSTANCES(P, T)                                                                  \
  P template lazy::Tensor<T> lazy::detail::make_random<T, lazy::graph::detail::RandIntDist<T>>(              \
      lazy::graph::detail::RandIntDist<T>, const lazy::Shape&, const lazy::Device&, std::vector<lazy::graph::NodePtr>);
#if LAZYTENSOR_EXPLICIT_INSTANTIATION
LAZYTENSOR_FOR_FLOATING(LAZYTENSOR_RANDOM_INSTANCES, extern)
LAZYTENSOR_RANDINT_INSTANCES(extern, std::int32_t)
LAZYTENSOR_RANDINT_INSTANCES(extern, std::int64_t)
#endif
// ---- end lazytensor/ops/random.hpp ----
// ---- end lazytensor/tensor.hpp ----
// ---- end lazytensor/eigen.hpp ----
// ---- begin lazytensor/fwd.hpp ----
// Declarations of lazytensor's user-facing types, for a user's own headers: a header that
// only names `lazy::Tensor<float>` in a signature includes this (as nlohmann's json_fwd.hpp)
// and leaves the definitions, and their compile time, to the source files that use them.
// It costs <cstdint>, <string> and <ostream> (through the element types), nothing else.


namespace lazy {

class Shape;
class Device;
template <Element T>
class Tensor;
class AnyTensor;
class StateDict;
struct Size2;

enum class ReduceOp;

class AutocastGuard;

class Error;
class ShapeError;
class DTypeError;
class IndexError;
class DeviceError;
class ShardingError;
class CollectiveError;
class CollectiveMismatch;
class CollectiveTimeout;
class ReplicaAborted;
class FormatError;
class IoError;
class OutOfMemoryError;

namespace nn {
class Module;
template <class Impl>
class ModuleHolder;
}  // namespace nn

namespace optim {
class Optimizer;
}  // namespace optim

namespace spmd {
class Mesh;
class HybridMesh;
class ShardingSpec;
}  // namespace spmd

namespace train {
class Strategy;
class SingleDeviceStrategy;
template <class>
class BasicReplicaStrategy;
using ReplicaStrategy = BasicReplicaStrategy<void>;
class Precision;
class DoublePrecision;
class HalfPrecision;
class MixedPrecision;
class Accelerator;
class CPUAccelerator;
}  // namespace train

}  // namespace lazy
// ---- end lazytensor/fwd.hpp ----
// ---- begin lazytensor/io.hpp ----
// lazy::io: reading and writing tensors. safetensors files (readable by the Python
// `safetensors` package) through io::save_file and io::load, with atomic, streaming writes;
// io::save writes from replicas (only the master writes, as xm.save).

// ---- begin lazytensor/io/safetensors.hpp ----
// safetensors files (https://github.com/huggingface/safetensors), readable by the Python
// `safetensors` package:
//
//   [8 bytes]  N, the header length, unsigned little-endian
//   [N bytes]  a JSON object: "name": {"dtype": "F32", "shape": [2, 3], "data_offsets": [b, e]}
//              per tensor, plus an optional "__metadata__": {string: string}; padded with
//              spaces so that the data starts 8-byte aligned
//   [rest]     the tensors' bytes, little-endian, row-major; offsets are relative to the
//              start of this buffer, and the tensors tile it exactly (no gap, no overlap,
//              nothing after the last one)
//
// Writing streams one tensor at a time into a temporary file that replaces the target
// atomically; reading validates the whole header against the file size before allocating
// anything, then reads each tensor straight into a buffer of the target device.

#include <algorithm>
#include <bit>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <numeric>
#include <string>
#include <string_view>
#include <unordered_set>
#include <utility>
#include <vector>

// ---- begin lazytensor/io/json.hpp ----
// The little JSON that file headers need, written by us and strict: a cursor that reads
// objects, strings and non-negative integers exactly as RFC 8259 spells them (and nothing
// else: no comments, no trailing commas, no NaN, no leading zeros, valid UTF-8 only), and
// a writer for strings. Callers read the schema they expect with these primitives, so a
// hostile header never builds a document tree bigger than what the caller keeps.

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>


namespace lazy::io::detail {

/// Length of the valid UTF-8 sequence starting at s[i], or 0 when it is invalid (overlong
/// forms, surrogates and code points above U+10FFFF are invalid, as RFC 3629 says).
std::size_t utf8_sequence_length(std::string_view s, std::size_t i);

/// True when `s` is valid UTF-8.
bool valid_utf8(std::string_view s);

/// Appends `s` as a JSON string literal: quotes, backslashes and control characters are
/// escaped (the short forms where JSON has them), everything else is copied as is.
void append_json_string(std::string& out, std::string_view s);

/// A read position in a JSON text. Every method throws FormatError("<where>: <what> at
/// byte <pos>") on anything that is not exactly what was asked for.
class JsonCursor {
 public:
  JsonCursor(std::string_view text, std::string where) : s_(text), where_(std::move(where)) {}

  std::size_t pos() const { return i_; }
  bool at_end() const { return i_ >= s_.size(); }

  /// Skips JSON whitespace (space, tab, line feed, carriage return).
  void skip_ws();
  /// The next non-whitespace character (or '\0' at the end), without consuming it.
  char peek();
  /// Consumes `c` (after whitespace), else FormatError.
  void expect(char c);
  /// Consumes `c` when it comes next.
  bool accept(char c);

  /// Reads a string literal, decoding escapes (\uXXXX with surrogate pairs) to UTF-8.
  std::string string();

  /// Reads a non-negative integer literal that fits in 64 bits. Signs, fractions,
  /// exponents and leading zeros are rejected: sizes and offsets are whole numbers.
  std::uint64_t uint64();

  /// Throws FormatError naming the position.
  [[noreturn]] void fail(const std::string& what) const;

  /// A short quote of the text at the cursor, for messages.
  std::string found() const;

 private:
  static int hex_value(char c);
  std::uint32_t hex4();
  static void append_utf8(std::string& out, std::uint32_t cp);
  void escape(std::string& out);

  std::string_view s_;
  std::string where_;
  std::size_t i_ = 0;
};

#if LAZYTENSOR_HEADER_DEFINITIONS
LAZYTENSOR_INLINE std::size_t utf8_sequence_length(std::string_view s, std::size_t i) {
  const auto b = [&](std::size_t k) { return static_cast<unsigned char>(s[i + k]); };
  const unsigned char c = b(0);
  if (c < 0x80) return 1;
  std::size_t n;
  std::uint32_t cp;
  if (c >= 0xC2 && c <= 0xDF)
    n = 2, cp = c & 0x1Fu;
  else if (c >= 0xE0 && c <= 0xEF)
    n = 3, cp = c & 0x0Fu;
  else if (c >= 0xF0 && c <= 0xF4)
    n = 4, cp = c & 0x07u;
  else
    return 0;
  if (i + n > s.size()) return 0;
  for (std::size_t k = 1; k < n; ++k) {
    if ((b(k) & 0xC0u) != 0x80u) return 0;
    cp = (cp << 6) | (b(k) & 0x3Fu);
  }
  if ((n == 3 && cp < 0x800) || (n == 4 && cp < 0x10000) || cp > 0x10FFFF ||
      (cp >= 0xD800 && cp <= 0xDFFF))
    return 0;
  return n;
}

LAZYTENSOR_INLINE bool valid_utf8(std::string_view s) {
  for (std::size_t i = 0; i < s.size();) {
    const std::size_t n = utf8_sequence_length(s, i);
    if (n == 0) return false;
    i += n;
  }
  return true;
}

LAZYTENSOR_INLINE void append_json_string(std::string& out, std::string_view s) {
  static constexpr char hex[] = "0123456789abcdef";
  out += '"';
  for (const char ch : s) {
    const auto c = static_cast<unsigned char>(ch);
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\b':
        out += "\\b";
        break;
      case '\f':
        out += "\\f";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      default:
        if (c < 0x20) {
          out += "\\u00";
          out += hex[c >> 4];
          out += hex[c & 0xF];
        } else {
          out += ch;
        }
    }
  }
  out += '"';
}

LAZYTENSOR_INLINE void JsonCursor::skip_ws() {
  while (i_ < s_.size() && (s_[i_] == ' ' || s_[i_] == '\t' || s_[i_] == '\n' || s_[i_] == '\r'))
    ++i_;
}

LAZYTENSOR_INLINE char JsonCursor::peek() {
  skip_ws();
  return at_end() ? '\0' : s_[i_];
}

LAZYTENSOR_INLINE void JsonCursor::expect(char c) {
  if (peek() != c) fail(std::string("expected '") + c + "', found " + found());
  ++i_;
}

LAZYTENSOR_INLINE bool JsonCursor::accept(char c) {
  if (peek() != c) return false;
  ++i_;
  return true;
}

LAZYTENSOR_INLINE std::string JsonCursor::string() {
  if (peek() != '"') fail("expected a string, found " + found());
  ++i_;
  std::string out;
  for (;;) {
    if (at_end()) fail("unterminated string");
    const auto c = static_cast<unsigned char>(s_[i_]);
    if (c == '"') {
      ++i_;
      return out;
    }
    if (c < 0x20) fail("unescaped control character in a string");
    if (c == '\\') {
      escape(out);
      continue;
    }
    const std::size_t n = utf8_sequence_length(s_, i_);
    if (n == 0) fail("invalid UTF-8 in a string");
    out.append(s_.substr(i_, n));
    i_ += n;
  }
}

LAZYTENSOR_INLINE std::uint64_t JsonCursor::uint64() {
  peek();
  const std::size_t start = i_;
  if (at_end() || s_[i_] < '0' || s_[i_] > '9')
    fail("expected a non-negative integer, found " + found());
  if (s_[i_] == '0' && i_ + 1 < s_.size() && s_[i_ + 1] >= '0' && s_[i_ + 1] <= '9')
    fail("leading zero in a number");
  std::uint64_t v = 0;
  while (i_ < s_.size() && s_[i_] >= '0' && s_[i_] <= '9') {
    const auto d = static_cast<std::uint64_t>(s_[i_] - '0');
    if (v > (UINT64_MAX - d) / 10) {
      i_ = start;
      fail("integer does not fit in 64 bits");
    }
    v = v * 10 + d;
    ++i_;
  }
  if (i_ < s_.size() && (s_[i_] == '.' || s_[i_] == 'e' || s_[i_] == 'E'))
    fail("expected an integer, found a fraction or exponent");
  return v;
}

LAZYTENSOR_INLINE void JsonCursor::fail(const std::string& what) const {
  throw FormatError(where_ + ": " + what + " at byte " + std::to_string(i_) + " of the header");
}

LAZYTENSOR_INLINE std::string JsonCursor::found() const {
  if (at_end()) return "the end of the header";
  std::string q;
  for (std::size_t k = i_; k < s_.size() && k < i_ + 12; ++k) {
    const auto c = static_cast<unsigned char>(s_[k]);
    q += (c >= 0x20 && c < 0x7F) ? static_cast<char>(c) : '?';
  }
  return "'" + q + "'";
}

LAZYTENSOR_INLINE int JsonCursor::hex_value(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

LAZYTENSOR_INLINE std::uint32_t JsonCursor::hex4() {
  if (i_ + 4 > s_.size()) fail("truncated \\u escape");
  std::uint32_t v = 0;
  for (int k = 0; k < 4; ++k) {
    const int h = hex_value(s_[i_ + static_cast<std::size_t>(k)]);
    if (h < 0) fail("invalid hex digit in a \\u escape");
    v = v * 16 + static_cast<std::uint32_t>(h);
  }
  i_ += 4;
  return v;
}

LAZYTENSOR_INLINE void JsonCursor::append_utf8(std::string& out, std::uint32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

LAZYTENSOR_INLINE void JsonCursor::escape(std::string& out) {
  ++i_;  // the backslash
  if (at_end()) fail("truncated escape");
  const char e = s_[i_++];
  switch (e) {
    case '"':
      out += '"';
      return;
    case '\\':
      out += '\\';
      return;
    case '/':
      out += '/';
      return;
    case 'b':
      out += '\b';
      return;
    case 'f':
      out += '\f';
      return;
    case 'n':
      out += '\n';
      return;
    case 'r':
      out += '\r';
      return;
    case 't':
      out += '\t';
      return;
    case 'u':
      break;
    default:
      --i_;
      fail("invalid escape");
  }
  std::uint32_t cp = hex4();
  if (cp >= 0xDC00 && cp <= 0xDFFF) fail("unpaired low surrogate in a \\u escape");
  if (cp >= 0xD800 && cp <= 0xDBFF) {
    if (i_ + 2 > s_.size() || s_[i_] != '\\' || s_[i_ + 1] != 'u')
      fail("unpaired high surrogate in a \\u escape");
    i_ += 2;
    const std::uint32_t lo = hex4();
    if (lo < 0xDC00 || lo > 0xDFFF) fail("unpaired high surrogate in a \\u escape");
    cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
  }
  append_utf8(out, cp);
}
#endif  // LAZYTENSOR_HEADER_DEFINITIONS

}  // namespace lazy::io::detail
// ---- end lazytensor/io/json.hpp ----
// ---- begin lazytensor/io/stored_dtype.hpp ----
// The dtypes a safetensors file may hold, and the conversions between those lazytensor has
// no tensor type for and the one that holds each of them exactly: F16 is read into float,
// U8/I8/I16/U16 into int32, U32 into int64. A state dict remembers the stored dtype of such
// a tensor (StateDict::stored_dtypes) so that saving it writes the file's dtype back.
//
// Conversions run on chunks of raw bytes: the reader widens what it reads into the tensor's
// buffer, the writer narrows into a small staging buffer, so neither holds a second copy of
// a tensor.

#include <bit>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <string_view>


namespace lazy::io::detail {

/// One safetensors dtype: its name in the header, its element size, and the lazytensor dtype
/// that holds its values (the same dtype when `native`).
struct StoredDType {
  enum class Kind : std::uint8_t { Bool, U8, I8, I16, U16, F16, BF16, I32, U32, F32, F64, I64 };
  Kind kind;
  const char* name;
  std::size_t size;
  DType holds;
  bool native;
};

/// The stored dtype named `name` (as in a safetensors header), or nullptr when lazytensor
/// cannot load it; then `why` says why (unknown, or known without a dtype that holds it).
const StoredDType* find_stored_dtype(std::string_view name, std::string* why = nullptr);

/// The native stored dtype of `d` (F32 for float, ...).
const StoredDType& native_stored_dtype(DType d);

/// Elements converted per step when a tensor is read or written in another dtype: the
/// staging buffer holds at most this many, never a second copy of the tensor.
inline constexpr std::size_t kConvertChunk = std::size_t{1} << 16;

/// Half-precision (IEEE binary16) bits to float: exact, NaN payloads kept.
float half_to_float(std::uint16_t h);

/// float to half-precision bits, rounded to nearest even; overflow gives infinity, NaN
/// payloads are kept where they fit (half -> float -> half is the identity on every pattern).
std::uint16_t float_to_half(float f);

/// Widens `n` elements of stored dtype `s` at `src` into `s.holds` elements at `dst`.
void widen(const StoredDType& s, const void* src, void* dst, std::size_t n);

/// Narrows `n` elements of dtype `s.holds` at `src` into stored dtype `s` at `dst`. Integers
/// must fit (callers check first with `find_out_of_range`); floats round to nearest even.
void narrow(const StoredDType& s, const void* src, void* dst, std::size_t n);

/// The index of the first of `n` elements of `s.holds` at `src` that `s` cannot represent,
/// or `n` when all fit (floats always fit: they round). `value` receives its text.
std::size_t find_out_of_range(const StoredDType& s, const void* src, std::size_t n,
                              std::string* value);

#if LAZYTENSOR_HEADER_DEFINITIONS

namespace stored_dtype_table {
using K = StoredDType::Kind;
inline constexpr StoredDType kAll[] = {
    {K::Bool, "BOOL", 1, DType::Bool, true},      {K::U8, "U8", 1, DType::Int32, false},
    {K::I8, "I8", 1, DType::Int32, false},        {K::I16, "I16", 2, DType::Int32, false},
    {K::U16, "U16", 2, DType::Int32, false},      {K::F16, "F16", 2, DType::Float32, false},
    {K::BF16, "BF16", 2, DType::BFloat16, true},  {K::I32, "I32", 4, DType::Int32, true},
    {K::U32, "U32", 4, DType::Int64, false},      {K::F32, "F32", 4, DType::Float32, true},
    {K::F64, "F64", 8, DType::Float64, true},     {K::I64, "I64", 8, DType::Int64, true},
};
}  // namespace stored_dtype_table

LAZYTENSOR_INLINE const StoredDType* find_stored_dtype(std::string_view name, std::string* why) {
  for (const StoredDType& s : stored_dtype_table::kAll) {
    if (name == s.name) return &s;
  }
  if (why) {
    if (name == "U64") {
      *why = "unsupported dtype 'U64': lazytensor's widest integer is int64, which cannot hold "
             "every unsigned 64-bit value";
    } else if (name.substr(0, 2) == "F8" || name.substr(0, 2) == "F6" || name == "F4") {
      *why = "unsupported dtype '" + std::string(name) +
             "': lazytensor has no 8-bit or smaller floating-point dtype (convert the tensor "
             "to F16, BF16 or F32 before saving)";
    } else if (name == "C64") {
      *why = "unsupported dtype 'C64': lazytensor has no complex dtype";
    } else {
      std::string list;
      for (const StoredDType& s : stored_dtype_table::kAll) list += (list.empty() ? "" : ", ") + std::string(s.name);
      *why = "unknown dtype '" + std::string(name) + "' (expected one of " + list + ")";
    }
  }
  return nullptr;
}

LAZYTENSOR_INLINE const StoredDType& native_stored_dtype(DType d) {
  for (const StoredDType& s : stored_dtype_table::kAll) {
    if (s.native && s.holds == d) return s;
  }
  throw Error("no safetensors dtype for " + dtype_name(d));
}

LAZYTENSOR_INLINE float half_to_float(std::uint16_t h) {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  const std::uint32_t exp = (h >> 10) & 0x1Fu;
  std::uint32_t mant = h & 0x3FFu;
  std::uint32_t bits;
  if (exp == 0x1F) {
    bits = sign | 0x7F800000u | (mant << 13);  // infinity, or NaN with its payload
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (mant << 13);  // rebias 15 -> 127
  } else if (mant == 0) {
    bits = sign;
  } else {
    // Subnormal mant * 2^-24: normalise so the leading one becomes float's implicit bit.
    std::uint32_t e = 113;
    while (!(mant & 0x400u)) mant <<= 1, --e;
    bits = sign | (e << 23) | ((mant & 0x3FFu) << 13);
  }
  return std::bit_cast<float>(bits);
}

LAZYTENSOR_INLINE std::uint16_t float_to_half(float f) {
  std::uint32_t x = std::bit_cast<std::uint32_t>(f);
  const auto sign = static_cast<std::uint16_t>((x >> 16) & 0x8000u);
  x &= 0x7FFFFFFFu;
  if (x >= 0x7F800000u) {
    if (x == 0x7F800000u) return sign | 0x7C00u;
    const auto payload = static_cast<std::uint16_t>((x >> 13) & 0x3FFu);
    return sign | 0x7C00u | (payload ? payload : 0x200u);  // a NaN stays a NaN
  }
  if (x >= 0x477FF000u) return sign | 0x7C00u;  // >= 65520 rounds past 65504, the largest
  if (x >= 0x38800000u) {                        // normal in half: >= 2^-14
    std::uint32_t r = x - 0x38000000u;           // rebias 127 -> 15
    r += 0x0FFFu + ((r >> 13) & 1u);             // round to nearest even on the dropped 13 bits
    return sign | static_cast<std::uint16_t>(r >> 13);
  }
  if (x <= 0x33000000u) return sign;  // <= 2^-25: half the smallest subnormal ties to 0
  // Subnormal in half: the value in units of 2^-24, rounded to nearest even.
  const std::uint32_t exp = x >> 23;  // 102 .. 112 here
  const std::uint32_t m = (x & 0x7FFFFFu) | 0x800000u;
  const std::uint32_t shift = 126 - exp;  // value = m * 2^(exp - 150) = (m >> shift) * 2^-24
  std::uint32_t q = m >> shift;
  const std::uint32_t rem = m & ((1u << shift) - 1), halfway = 1u << (shift - 1);
  if (rem > halfway || (rem == halfway && (q & 1u))) ++q;
  return sign | static_cast<std::uint16_t>(q);
}

namespace stored_dtype_impl {
template <class From, class To>
void convert(const void* src, void* dst, std::size_t n) {
  const auto* s = static_cast<const unsigned char*>(src);
  auto* d = static_cast<unsigned char*>(dst);
  for (std::size_t i = 0; i < n; ++i) {
    From v;
    std::memcpy(&v, s + i * sizeof(From), sizeof(From));
    const To w = static_cast<To>(v);
    std::memcpy(d + i * sizeof(To), &w, sizeof(To));
  }
}

template <class Stored, class Held>
std::size_t first_out_of_range(const void* src, std::size_t n, std::string* value) {
  const auto* s = static_cast<const unsigned char*>(src);
  for (std::size_t i = 0; i < n; ++i) {
    Held v;
    std::memcpy(&v, s + i * sizeof(Held), sizeof(Held));
    if (v < static_cast<Held>(std::numeric_limits<Stored>::min()) ||
        v > static_cast<Held>(std::numeric_limits<Stored>::max())) {
      if (value) *value = std::to_string(v);
      return i;
    }
  }
  return n;
}
}  // namespace stored_dtype_impl

LAZYTENSOR_INLINE void widen(const StoredDType& s, const void* src, void* dst, std::size_t n) {
  using namespace stored_dtype_impl;
  using K = StoredDType::Kind;
  switch (s.kind) {
    case K::U8: return convert<std::uint8_t, std::int32_t>(src, dst, n);
    case K::I8: return convert<std::int8_t, std::int32_t>(src, dst, n);
    case K::I16: return convert<std::int16_t, std::int32_t>(src, dst, n);
    case K::U16: return convert<std::uint16_t, std::int32_t>(src, dst, n);
    case K::U32: return convert<std::uint32_t, std::int64_t>(src, dst, n);
    case K::F16: {
      const auto* p = static_cast<const unsigned char*>(src);
      auto* d = static_cast<float*>(dst);
      for (std::size_t i = 0; i < n; ++i) d[i] = half_to_float(static_cast<std::uint16_t>(p[2 * i] | (p[2 * i + 1] << 8)));
      return;
    }
    default: std::memcpy(dst, src, n * s.size); return;
  }
}

LAZYTENSOR_INLINE void narrow(const StoredDType& s, const void* src, void* dst, std::size_t n) {
  using namespace stored_dtype_impl;
  using K = StoredDType::Kind;
  switch (s.kind) {
    case K::U8: return convert<std::int32_t, std::uint8_t>(src, dst, n);
    case K::I8: return convert<std::int32_t, std::int8_t>(src, dst, n);
    case K::I16: return convert<std::int32_t, std::int16_t>(src, dst, n);
    case K::U16: return convert<std::int32_t, std::uint16_t>(src, dst, n);
    case K::U32: return convert<std::int64_t, std::uint32_t>(src, dst, n);
    case K::F16: {
      const auto* p = static_cast<const float*>(src);
      auto* d = static_cast<unsigned char*>(dst);
      for (std::size_t i = 0; i < n; ++i) {
        const std::uint16_t h = float_to_half(p[i]);
        d[2 * i] = static_cast<unsigned char>(h), d[2 * i + 1] = static_cast<unsigned char>(h >> 8);
      }
      return;
    }
    default: std::memcpy(dst, src, n * s.size); return;
  }
}

LAZYTENSOR_INLINE std::size_t find_out_of_range(const StoredDType& s, const void* src,
                                                std::size_t n, std::string* value) {
  using namespace stored_dtype_impl;
  using K = StoredDType::Kind;
  switch (s.kind) {
    case K::U8: return first_out_of_range<std::uint8_t, std::int32_t>(src, n, value);
    case K::I8: return first_out_of_range<std::int8_t, std::int32_t>(src, n, value);
    case K::I16: return first_out_of_range<std::int16_t, std::int32_t>(src, n, value);
    case K::U16: return first_out_of_range<std::uint16_t, std::int32_t>(src, n, value);
    case K::U32: return first_out_of_range<std::uint32_t, std::int64_t>(src, n, value);
    default: return n;
  }
}

#endif  // LAZYTENSOR_HEADER_DEFINITIONS

}  // namespace lazy::io::detail
// ---- end lazytensor/io/stored_dtype.hpp ----

namespace lazy::io {

namespace detail {

static_assert(
    std::endian::native == std::endian::little,
    "lazy::io writes tensor bytes as they are in memory; safetensors needs little-endian");

/// Largest header accepted (and written): the limit of the reference implementation.
inline constexpr std::uint64_t kMaxSafetensorsHeader = 100'000'000;

/// One tensor as the header describes it.
struct SafetensorsEntry {
  std::string name;
  const StoredDType* stored = nullptr;  ///< as in the file
  DType dtype = DType::Float32;  ///< the dtype that holds it in memory
  Shape shape;
  std::uint64_t begin = 0;  ///< data_offsets, relative to the data buffer
  std::uint64_t end = 0;
};

/// A parsed header: tensors in header order, and the metadata.
struct SafetensorsHeader {
  std::vector<SafetensorsEntry> tensors;
  std::map<std::string, std::string> metadata;
};

void parse_tensor_entry(JsonCursor& cur, SafetensorsEntry& e);

/// Parses a header strictly; FormatError("<path>: ...") on anything malformed.
SafetensorsHeader parse_safetensors_header(std::string_view text, const std::string& path);

/// Checks that the tensors tile a data buffer of `buffer_bytes` exactly: each tensor's
/// byte range matches its shape and dtype, ranges neither overlap nor leave gaps, and the
/// last one ends where the file ends. FormatError("<path>: ...") otherwise.
void check_safetensors_layout(const SafetensorsHeader& h, std::uint64_t buffer_bytes,
                              const std::string& path);

/// A typed handle on a materialized node of run-time dtype.
AnyTensor wrap_node(const graph::NodePtr& node);

/// The header text (padded to 8 bytes) for `sd`, whose tensors are stored as `stored` and
/// laid out in `order`.
std::string safetensors_header(const StateDict& sd, const std::vector<const StoredDType*>& stored,
                               const std::vector<std::size_t>& order);

/// Rejects what the format cannot store (before anything is written) and returns the dtype
/// each tensor is stored as: its own, or its entry in sd.stored_dtypes(), which must name a
/// tensor of the dict, a dtype that the tensor's dtype holds, and values that fit.
std::vector<const StoredDType*> check_saveable(const StateDict& sd, const std::string& path);

}  // namespace detail

/// Writes `sd` (tensors and metadata) to `path` as a safetensors file. Each tensor is
/// materialized and written in turn (the file is never assembled in memory), into a
/// temporary file in the same directory that is fsynced and renamed over `path`: a failure
/// leaves any previous file intact and no temporary file behind. Disk errors raise IoError;
/// an error computing a pending tensor propagates as is. Data are laid out by decreasing
/// element size (so each tensor is aligned to its element size, as the reference writer
/// does); the header lists tensors in the state dict's order.
void save_file(const StateDict& sd, const std::string& path);

/// Reads a safetensors file into a state dict (tensors in header order, materialized on
/// `dev`; the "__metadata__" entries in metadata()). IoError when the file cannot be read;
/// FormatError naming the file and the problem when it is not a valid safetensors file.
/// BOOL, I32, I64, BF16, F32 and F64 load as they are; F16 loads into float, U8, I8, I16 and
/// U16 into int32, U32 into int64 (all exact), each such tensor's file dtype recorded in
/// stored_dtypes() so that save_file writes it back; U64 and the 8-bit-or-smaller float
/// dtypes raise FormatError naming the dtype. Nothing is allocated for a tensor before the
/// whole header has been checked against the file's size.
StateDict load(const std::string& path, Device dev = device());

#if LAZYTENSOR_HEADER_DEFINITIONS
namespace detail {

LAZYTENSOR_INLINE void parse_tensor_entry(JsonCursor& cur, SafetensorsEntry& e) {
  const std::string ctx = "tensor '" + e.name + "': ";
  bool have_dtype = false, have_shape = false, have_offsets = false;
  cur.expect('{');
  if (!cur.accept('}')) {
    for (;;) {
      const std::string key = cur.string();
      cur.expect(':');
      if (key == "dtype") {
        if (have_dtype) cur.fail(ctx + "duplicate key 'dtype'");
        have_dtype = true;
        const std::string name = cur.string();
        std::string why;
        e.stored = find_stored_dtype(name, &why);
        if (!e.stored) cur.fail(ctx + why);
        e.dtype = e.stored->holds;
      } else if (key == "shape") {
        if (have_shape) cur.fail(ctx + "duplicate key 'shape'");
        have_shape = true;
        cur.expect('[');
        if (!cur.accept(']')) {
          for (;;) {
            if (e.shape.rank() == kMaxRank) {
              cur.fail(ctx + "shape has more than " + std::to_string(kMaxRank) +
                       " dimensions (the maximum rank)");
            }
            const std::uint64_t d = cur.uint64();
            if (d > static_cast<std::uint64_t>(INT64_MAX))
              cur.fail(ctx + "dimension " + std::to_string(d) + " is too large");
            try {
              e.shape.push_back(static_cast<std::int64_t>(d));
            } catch (const ShapeError& err) {
              cur.fail(ctx + err.what());
            }
            if (cur.accept(']')) break;
            cur.expect(',');
          }
        }
      } else if (key == "data_offsets") {
        if (have_offsets) cur.fail(ctx + "duplicate key 'data_offsets'");
        have_offsets = true;
        cur.expect('[');
        e.begin = cur.uint64();
        cur.expect(',');
        e.end = cur.uint64();
        if (cur.peek() != ']')
          cur.fail(ctx + "data_offsets must hold exactly two numbers [begin, end]");
        cur.expect(']');
      } else {
        cur.fail(ctx + "unexpected key '" + key + "' (expected dtype, shape and data_offsets)");
      }
      if (cur.accept('}')) break;
      cur.expect(',');
    }
  }
  if (!have_dtype) cur.fail(ctx + "missing 'dtype'");
  if (!have_shape) cur.fail(ctx + "missing 'shape'");
  if (!have_offsets) cur.fail(ctx + "missing 'data_offsets'");
}

LAZYTENSOR_INLINE SafetensorsHeader parse_safetensors_header(std::string_view text,
                                                             const std::string& path) {
  SafetensorsHeader h;
  JsonCursor cur(text, path);
  if (text.empty() || text.front() != '{')
    cur.fail("the header must be a JSON object starting with '{', found " + cur.found());
  std::unordered_set<std::string> keys;
  cur.expect('{');
  if (!cur.accept('}')) {
    for (;;) {
      std::string key = cur.string();
      cur.expect(':');
      if (!keys.insert(key).second) cur.fail("duplicate key '" + key + "'");
      if (key == "__metadata__") {
        cur.expect('{');
        if (!cur.accept('}')) {
          for (;;) {
            std::string k = cur.string();
            cur.expect(':');
            if (cur.peek() != '"')
              cur.fail("__metadata__ value of '" + k + "' must be a string, found " + cur.found());
            std::string v = cur.string();
            if (!h.metadata.emplace(k, std::move(v)).second)
              cur.fail("duplicate __metadata__ key '" + k + "'");
            if (cur.accept('}')) break;
            cur.expect(',');
          }
        }
      } else {
        SafetensorsEntry e;
        e.name = std::move(key);
        parse_tensor_entry(cur, e);
        h.tensors.push_back(std::move(e));
      }
      if (cur.accept('}')) break;
      cur.expect(',');
    }
  }
  cur.skip_ws();  // writers pad the header with spaces
  if (!cur.at_end()) cur.fail("unexpected data after the header's JSON object: " + cur.found());
  return h;
}

LAZYTENSOR_INLINE void check_safetensors_layout(const SafetensorsHeader& h,
                                                std::uint64_t buffer_bytes,
                                                const std::string& path) {
  const auto& ts = h.tensors;
  const auto fail = [&](const std::string& what) { throw FormatError(path + ": " + what); };
  for (const auto& e : ts) {
    if (e.end < e.begin) {
      fail("tensor '" + e.name + "': data_offsets [" + std::to_string(e.begin) + ", " +
           std::to_string(e.end) + "] end before they begin");
    }
    std::uint64_t numel = 1;
    for (const auto d : e.shape) {
      if (__builtin_mul_overflow(numel, static_cast<std::uint64_t>(d), &numel)) {
        fail("tensor '" + e.name + "': shape " + e.shape.str() +
             " has more elements than 64 bits can count");
      }
    }
    std::uint64_t nbytes = 0;
    if (__builtin_mul_overflow(numel, static_cast<std::uint64_t>(e.stored->size), &nbytes)) {
      fail("tensor '" + e.name + "': shape " + e.shape.str() +
           " has more bytes than 64 bits can count");
    }
    if (e.end - e.begin != nbytes) {
      fail("tensor '" + e.name + "': shape " + e.shape.str() + " of " +
           e.stored->name + " needs " + std::to_string(nbytes) +
           " bytes, but data_offsets [" + std::to_string(e.begin) + ", " + std::to_string(e.end) +
           "] hold " + std::to_string(e.end - e.begin));
    }
  }
  std::vector<std::size_t> order(ts.size());
  std::iota(order.begin(), order.end(), std::size_t{0});
  std::sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
    return std::pair(ts[a].begin, ts[a].end) < std::pair(ts[b].begin, ts[b].end);
  });
  std::uint64_t pos = 0;
  std::string prev = "the start of the data buffer";
  for (const std::size_t k : order) {
    const auto& e = ts[k];
    if (e.begin < pos) {
      fail("tensor '" + e.name + "' (data_offsets [" + std::to_string(e.begin) + ", " +
           std::to_string(e.end) + "]) overlaps " + prev + ", which ends at byte " +
           std::to_string(pos));
    }
    if (e.begin > pos) {
      fail("gap of " + std::to_string(e.begin - pos) + " bytes between " + prev +
           " (ends at byte " + std::to_string(pos) + ") and tensor '" + e.name +
           "' (starts at byte " + std::to_string(e.begin) +
           "): the offsets must cover the data buffer contiguously");
    }
    pos = e.end;
    prev = "tensor '" + e.name + "'";
  }
  if (pos > buffer_bytes) {
    fail("truncated: the header describes " + std::to_string(pos) +
         " bytes of tensor data, but only " + std::to_string(buffer_bytes) +
         " bytes follow the header");
  }
  if (pos < buffer_bytes) {
    fail(std::to_string(buffer_bytes - pos) +
         " bytes of trailing data after the last tensor (the header describes " +
         std::to_string(pos) + " bytes of tensor data, " + std::to_string(buffer_bytes) +
         " follow the header)");
  }
}

LAZYTENSOR_INLINE AnyTensor wrap_node(const graph::NodePtr& node) {
  switch (node->dtype()) {
    case DType::Bool:
      return Tensor<bool>(node);
    case DType::Int32:
      return Tensor<std::int32_t>(node);
    case DType::Int64:
      return Tensor<std::int64_t>(node);
    case DType::BFloat16:
      return Tensor<bfloat16>(node);
    case DType::Float32:
      return Tensor<float>(node);
    case DType::Float64:
      break;
  }
  return Tensor<double>(node);
}

LAZYTENSOR_INLINE std::string safetensors_header(const StateDict& sd,
                                                 const std::vector<const StoredDType*>& stored,
                                                 const std::vector<std::size_t>& order) {
  const auto& items = sd.items();
  const auto stored_bytes = [&](std::size_t k) {
    return static_cast<std::uint64_t>(items[k].second.numel()) * stored[k]->size;
  };
  std::vector<std::uint64_t> begin(items.size());
  std::uint64_t pos = 0;
  for (const std::size_t k : order) {
    begin[k] = pos;
    pos += stored_bytes(k);
  }
  std::string h = "{";
  if (!sd.metadata().empty()) {
    append_json_string(h, "__metadata__");
    h += ":{";
    bool first = true;
    for (const auto& [k, v] : sd.metadata()) {
      if (!first) h += ',';
      first = false;
      append_json_string(h, k);
      h += ':';
      append_json_string(h, v);
    }
    h += '}';
  }
  for (std::size_t k = 0; k < items.size(); ++k) {
    const AnyTensor& t = items[k].second;
    if (h.size() > 1) h += ',';
    append_json_string(h, items[k].first);
    h += ":{\"dtype\":\"";
    h += stored[k]->name;
    h += "\",\"shape\":[";
    for (int d = 0; d < t.shape().rank(); ++d) {
      if (d) h += ',';
      h += std::to_string(t.shape()[d]);
    }
    h += "],\"data_offsets\":[" + std::to_string(begin[k]) + "," +
         std::to_string(begin[k] + stored_bytes(k)) + "]}";
  }
  h += '}';
  h.append((8 - h.size() % 8) % 8, ' ');  // the data then starts 8-byte aligned
  return h;
}

LAZYTENSOR_INLINE std::vector<const StoredDType*> check_saveable(const StateDict& sd,
                                                                 const std::string& path) {
  const std::string cannot = "cannot save '" + path + "': ";
  for (const auto& [name, t] : sd) {
    if (!t.defined()) throw Error(cannot + "tensor '" + name + "' is undefined");
    if (name == "__metadata__")
      throw FormatError(cannot + "'__metadata__' is reserved by safetensors, not a tensor name");
    if (!valid_utf8(name))
      throw FormatError(cannot + "tensor name '" + name + "' is not valid UTF-8");
  }
  for (const auto& [k, v] : sd.metadata()) {
    if (!valid_utf8(k) || !valid_utf8(v))
      throw FormatError(cannot + "metadata entry '" + k + "' is not valid UTF-8");
  }
  for (const auto& [name, dtype_in_file] : sd.stored_dtypes()) {
    if (!sd.contains(name)) {
      throw FormatError(cannot + "stored_dtypes names '" + name +
                        "', which is not a tensor of the state dict");
    }
  }
  std::vector<const StoredDType*> stored;
  for (const auto& [name, t] : sd) {
    const auto it = sd.stored_dtypes().find(name);
    if (it == sd.stored_dtypes().end()) {
      stored.push_back(&native_stored_dtype(t.dtype()));
      continue;
    }
    std::string why;
    const StoredDType* s = find_stored_dtype(it->second, &why);
    if (!s) throw FormatError(cannot + "stored_dtypes['" + name + "']: " + why);
    if (s->holds != t.dtype()) {
      throw FormatError(cannot + "tensor '" + name + "' is " + dtype_name(t.dtype()) +
                        ", but stored_dtypes asks for " + s->name + ", which is held in " +
                        dtype_name(s->holds));
    }
    std::string value;
    const auto n = static_cast<std::size_t>(t.numel());
    std::size_t bad = n;
    if (!s->native && n != 0)
      t.visit([&](const auto& typed) { bad = find_out_of_range(*s, typed.data(), n, &value); });
    if (bad != n) {
      throw FormatError(cannot + "tensor '" + name + "': element " + std::to_string(bad) + " is " +
                        value + ", which " + s->name + " (its stored dtype) cannot hold");
    }
    stored.push_back(s);
  }
  return stored;
}

}  // namespace detail

LAZYTENSOR_INLINE void save_file(const StateDict& sd, const std::string& path) {
  const std::vector<const detail::StoredDType*> stored = detail::check_saveable(sd, path);
  const auto& items = sd.items();
  std::vector<std::size_t> order(items.size());
  std::iota(order.begin(), order.end(), std::size_t{0});
  std::stable_sort(order.begin(), order.end(),
                   [&](std::size_t a, std::size_t b) { return stored[a]->size > stored[b]->size; });
  const std::string header = detail::safetensors_header(sd, stored, order);
  if (header.size() > detail::kMaxSafetensorsHeader) {
    throw FormatError("cannot save '" + path + "': the header would take " +
                      std::to_string(header.size()) + " bytes, more than safetensors' limit of " +
                      std::to_string(detail::kMaxSafetensorsHeader));
  }
  detail::AtomicFileWriter out(path);
  unsigned char len[8];
  for (int i = 0; i < 8; ++i)
    len[i] = static_cast<unsigned char>(static_cast<std::uint64_t>(header.size()) >> (8 * i));
  out.write(len, sizeof len);
  out.write(header.data(), header.size());
  std::vector<unsigned char> staging;  // narrowed chunks of tensors stored in another dtype
  for (const std::size_t k : order) {
    const AnyTensor& t = items[k].second;
    const auto n = static_cast<std::size_t>(t.numel());
    if (n == 0) continue;
    const detail::StoredDType& s = *stored[k];
    t.visit([&](const auto& typed) {
      if (s.native) return out.write(typed.data(), n * s.size);
      constexpr std::size_t kChunk = detail::kConvertChunk;
      staging.resize(std::min(n, kChunk) * s.size);
      const auto* src = reinterpret_cast<const unsigned char*>(typed.data());
      for (std::size_t i = 0; i < n; i += kChunk) {
        const std::size_t m = std::min(kChunk, n - i);
        detail::narrow(s, src + i * dtype_size(t.dtype()), staging.data(), m);
        out.write(staging.data(), m * s.size);
      }
    });
  }
  out.commit();
}

LAZYTENSOR_INLINE StateDict load(const std::string& path, Device dev) {
  detail::ReadFile file(path);
  const std::uint64_t size = file.size();
  if (size < 8) {
    throw FormatError(path + ": file is " + std::to_string(size) +
                      " bytes long, too short for the 8-byte header length of a safetensors file");
  }
  unsigned char len[8];
  if (file.read_at(len, 8, 0) != 8)
    throw FormatError(path + ": file shrank while reading the header length");
  std::uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | len[i];
  if (n > detail::kMaxSafetensorsHeader) {
    throw FormatError(
        path + ": header length " + std::to_string(n) + " exceeds safetensors' limit of " +
        std::to_string(detail::kMaxSafetensorsHeader) + " bytes (corrupt length field?)");
  }
  if (n > size - 8) {
    throw FormatError(path + ": header length " + std::to_string(n) + " but only " +
                      std::to_string(size - 8) +
                      " bytes follow the length field (truncated file or wrong header length)");
  }
  std::string text(static_cast<std::size_t>(n), '\0');
  if (file.read_at(text.data(), text.size(), 8) != text.size())
    throw FormatError(path + ": file shrank while reading the header");
  const detail::SafetensorsHeader header = detail::parse_safetensors_header(text, path);
  const std::uint64_t data_start = 8 + n;
  detail::check_safetensors_layout(header, size - data_start, path);

  // The data is read whole into buffers: a file whose data the machine cannot hold (a sparse
  // file's apparent size, consistent with its header) fails at once, naming the size.
  std::uint64_t held_bytes = 0;  // wider than the file's data when dtypes are widened
  for (const auto& e : header.tensors)
    held_bytes += (e.end - e.begin) / e.stored->size * dtype_size(e.dtype);
  lazy::detail::check_fits_in_memory(held_bytes, path + ": the tensors' data");
  StateDict sd;
  graph::Device& engine = dev.engine();
  std::vector<unsigned char> staging;  // chunks of tensors stored in a dtype we widen
  for (const auto& e : header.tensors) {
    const std::size_t nbytes = static_cast<std::size_t>(e.end - e.begin);
    const std::size_t n = nbytes / e.stored->size;
    auto buf = engine.pool().acquire(padded_bytes(e.shape.numel(), dtype_size(e.dtype)));
    const auto shrank = [&] {
      return FormatError(path + ": file shrank while reading tensor '" + e.name + "'");
    };
    if (e.stored->native) {
      if (file.read_at(buf->data(), nbytes, data_start + e.begin) != nbytes) throw shrank();
    } else {
      constexpr std::size_t kChunk = detail::kConvertChunk;
      staging.resize(std::min(n, kChunk) * e.stored->size);
      auto* dst = static_cast<unsigned char*>(buf->data());
      for (std::size_t i = 0; i < n; i += kChunk) {
        const std::size_t m = std::min(kChunk, n - i), bytes = m * e.stored->size;
        if (file.read_at(staging.data(), bytes, data_start + e.begin + i * e.stored->size) != bytes)
          throw shrank();
        detail::widen(*e.stored, staging.data(), dst + i * dtype_size(e.dtype), m);
      }
      sd.stored_dtypes()[e.name] = e.stored->name;
    }
    if (e.dtype == DType::Bool) {
      // A byte other than 0/1 read as bool is undefined behaviour; such a file is corrupt.
      const auto* p = static_cast<const unsigned char*>(buf->data());
      for (std::size_t i = 0; i < nbytes; ++i) {
        if (p[i] > 1) {
          throw FormatError(path + ": tensor '" + e.name + "': BOOL element " + std::to_string(i) +
                            " is " + std::to_string(p[i]) + ", expected 0 or 1");
        }
      }
    }
    sd.insert(e.name, detail::wrap_node(std::make_shared<graph::DataNode>(e.dtype, e.shape, &engine,
                                                                          std::move(buf))));
  }
  sd.metadata() = header.metadata;
  return sd;
}
#endif  // LAZYTENSOR_HEADER_DEFINITIONS

}  // namespace lazy::io
// ---- end lazytensor/io/safetensors.hpp ----
// ---- begin lazytensor/io/save.hpp ----
// io::save: saving a state dict from a replicated program, as torch_xla's xm.save.
//
// Every replica calls it with its own state dict. Each one first materializes the pending
// tensors of its state dict (one execution per device: a sync, as xm.save's transfer to the
// CPU is), then the writer(s) write, then all replicas meet in a rendezvous: when save
// returns on any replica the file is complete (renamed into place and fsynced), so another
// replica may read it at once. A failure on one replica is reported on all of them, after the
// rendezvous (nobody is left waiting for a replica that failed): the failing replica
// re-throws its own error, the others throw IoError naming it.

#include <algorithm>
#include <exception>
#include <string>
#include <utility>
#include <vector>


namespace lazy::io {

namespace detail {

/// Runs every pending tensor of `sd`, one execution per device.
void materialize_all(const StateDict& sd);


}  // namespace detail

/// Saves `sd` to `path` as a safetensors file (see save_file), as xm.save(data, path,
/// master_only, global_master):
///  - `master_only` (default): only the master replica writes: the local master (local
///    ordinal 0, one per host) or, with `global_master`, global ordinal 0 only. Otherwise
///    every replica writes (give each its own path; replicas writing one path replace the
///    file atomically in turn, the last rename wins).
///  - Every replica materializes the pending tensors of `sd` first (a sync), then all
///    replicas rendezvous after the write: the file is complete when save returns on any of
///    them (see the file comment for failures). Every replica must call it (it is a
///    collective of the whole world).
/// Outside spawn it just writes.
void save(const StateDict& sd, const std::string& path, bool master_only = true,
          bool global_master = false);

#if LAZYTENSOR_HEADER_DEFINITIONS
namespace detail {

LAZYTENSOR_INLINE void materialize_all(const StateDict& sd) {
  std::vector<std::pair<graph::Device*, std::vector<graph::NodePtr>>> pending;
  for (const auto& [name, t] : sd) {
    if (!t.defined() || t.impl()->node->materialized()) continue;
    const graph::NodePtr& node = t.impl()->node;
    auto it = std::find_if(pending.begin(), pending.end(),
                           [&](const auto& p) { return p.first == node->device(); });
    if (it == pending.end()) it = pending.insert(pending.end(), {node->device(), {}});
    it->second.push_back(node);
  }
  for (auto& [dev, nodes] : pending) {
    dev->rethrow_stored_error();
    graph::execute(*dev, nodes);
  }
}

}  // namespace detail

LAZYTENSOR_INLINE void save(const StateDict& sd, const std::string& path, bool master_only,
                            bool global_master) {
  const bool writer = !master_only || dist::is_master_ordinal(!global_master);
  std::exception_ptr error;
  try {
    detail::materialize_all(sd);
    if (writer) save_file(sd, path);
  } catch (...) {
    error = std::current_exception();
  }
  if (runtime::world_size() == 1) {
    if (error) std::rethrow_exception(error);
    return;
  }
  // Every replica reaches the rendezvous, failed or not; each says how it went ("" = ok).
  const std::string mine = error ? "!" + lazy::detail::exception_message(error) : std::string();
  const std::vector<std::string> all = dist::rendezvous("lazy::io::save", mine);
  if (error) std::rethrow_exception(error);
  for (std::size_t q = 0; q < all.size(); ++q) {
    if (!all[q].empty()) {
      throw IoError("io::save('" + path + "'): replica " + std::to_string(q) +
                    " failed: " + all[q].substr(1));
    }
  }
}
#endif  // LAZYTENSOR_HEADER_DEFINITIONS

}  // namespace lazy::io
// ---- end lazytensor/io/save.hpp ----
// ---- end lazytensor/io.hpp ----
// ---- begin lazytensor/nn.hpp ----
// lazy::nn: modules, layers, initializers and losses (torch::nn).

// ---- begin lazytensor/nn/activation.hpp ----
// Parameter-free layers: activations, Flatten, Dropout.

#include <cstdint>
#include <string>

// ---- begin lazytensor/nn/functional.hpp ----
// torch.nn.functional: losses and the functional forms of layers, in bfloat16, float or
// double (the input's dtype). Each takes a tensor or a pending expression.

#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>

// ---- begin lazytensor/ops/softmax.hpp ----
// softmax and log_softmax (stable, along one dim) and their derivative rules; the fused row
// kernels are SoftmaxNode's (graph/softmax_node.hpp).

#include <cstdint>
#include <memory>
#include <type_traits>
#include <vector>

// ---- begin lazytensor/graph/softmax_node.hpp ----
// SoftmaxNode, the kernel of softmax and log_softmax: fused row kernels (one pass for the
// max, one for the sum of exponentials, one to write; the row stays in cache between
// passes), vectorized when the reduced dim is the last, strided otherwise.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>

#include <xsimd/xsimd.hpp>


namespace lazy::graph {

/// softmax (or log_softmax) of a [outer, R, inner] view over R.
template <class T, bool Log>
class SoftmaxNode final : public Node {
 public:
  SoftmaxNode(NodePtr in, int dim, std::int64_t outer, std::int64_t extent, std::int64_t inner)
      : Node(NodeKind::Reduction, dtype_of<T>(), in->shape(), in->device(), {in}), dim_(dim), outer_(outer),
        extent_(extent), inner_(inner) {}

  std::string op_name() const override { return Log ? "log_softmax" : "softmax"; }
  std::string describe() const override { return op_name() + "(%0, dim=" + std::to_string(dim_) + ")"; }

  /// Blocks along every dimension but the one normalized.
  std::optional<BlockRule> block_rule() const override {
    const int rank = shape().rank();
    BlockRule r{std::vector<bool>(static_cast<std::size_t>(rank), true), {std::vector<int>(static_cast<std::size_t>(rank))}};
    for (int o = 0; o < rank; ++o) r.input_dim[0][static_cast<std::size_t>(o)] = o;
    r.splittable[static_cast<std::size_t>(dim_)] = false;
    r.input_dim[0][static_cast<std::size_t>(dim_)] = -1;
    return r;
  }
  NodePtr with_inputs(std::vector<NodePtr> inputs, Shape shape, Device*) const override {
    std::int64_t outer = 1, inner = 1;
    for (int d = 0; d < dim_; ++d) outer *= shape[d];
    for (int d = dim_ + 1; d < shape.rank(); ++d) inner *= shape[d];
    return std::make_shared<SoftmaxNode>(std::move(inputs[0]), dim_, outer, extent_, inner);
  }
  double cost_per_element() const override { return 12; }

 protected:
  void compute(ExecContext& ctx) override {
    const T* x = inputs()[0]->template data<T>();
    auto buf = allocate_output(ctx, inner_ == 1);  // a row kernel may write where it read
    T* y = static_cast<T*>(buf->data());
    auto& pool = ctx.device.threads();
    const std::int64_t units = outer_ * inner_;
    const std::int64_t tasks = std::min(std::max<std::int64_t>(units, 1), task_count(pool, numel(), 12.0));
    pool.parallel_for(tasks, [&](std::int64_t t) {
      auto [u0, u1] = task_range(units, tasks, t);
      if (inner_ == 1) {
        for (std::int64_t o = u0; o < u1; ++o) row(x + o * extent_, y + o * extent_);
      } else {
        for (std::int64_t u = u0; u < u1; ++u) {
          const std::int64_t o = u / inner_, c = u % inner_;
          strided(x + o * extent_ * inner_ + c, y + o * extent_ * inner_ + c);
        }
      }
    });
    set_buffer(std::move(buf));
  }

 private:
  void row(const T* x, T* y) const {
    using V = xsimd::batch<T>;
    constexpr std::int64_t W = V::size;
    const std::int64_t n = extent_;
    std::int64_t i = 0;
    V vm(-std::numeric_limits<T>::infinity());
    for (; i + W <= n; i += W) vm = xsimd::max(vm, V::load_unaligned(x + i));
    alignas(64) T lanes[W];
    vm.store_aligned(lanes);
    T m = lanes[0];
    for (std::int64_t k = 1; k < W; ++k) m = std::max(m, lanes[k]);
    for (; i < n; ++i) m = std::max(m, x[i]);
    if (std::isinf(m)) m = m > 0 ? m : T(0);  // all -inf: avoid inf - inf
    V vs(T(0));
    const V vmax(m);
    for (i = 0; i + W <= n; i += W) {
      V e = xsimd::exp(V::load_unaligned(x + i) - vmax);
      if constexpr (!Log) e.store_unaligned(y + i);
      vs += e;
    }
    T s = xsimd::hadd(vs);
    for (; i < n; ++i) {
      const T e = std::exp(x[i] - m);
      if constexpr (!Log) y[i] = e;
      s += e;
    }
    if constexpr (Log) {
      // (x - max) - log(sum): folding max + log(sum) into one shift first would round it to
      // the precision of max (ulp(1e4) ~ 1e-3 in float).
      const T ls = std::log(s);
      const V vls(ls);
      for (i = 0; i + W <= n; i += W) ((V::load_unaligned(x + i) - vmax) - vls).store_unaligned(y + i);
      for (; i < n; ++i) y[i] = (x[i] - m) - ls;
    } else {
      const V inv(T(1) / s);
      for (i = 0; i + W <= n; i += W) (V::load_unaligned(y + i) * inv).store_unaligned(y + i);
      for (; i < n; ++i) y[i] *= T(1) / s;
    }
  }

  void strided(const T* x, T* y) const {
    T m = -std::numeric_limits<T>::infinity();
    for (std::int64_t r = 0; r < extent_; ++r) m = std::max(m, x[r * inner_]);
    if (std::isinf(m)) m = m > 0 ? m : T(0);
    T s = 0;
    for (std::int64_t r = 0; r < extent_; ++r) s += std::exp(x[r * inner_] - m);
    const T ls = std::log(s), inv = T(1) / s;  // see row(): never round max + log(sum)
    for (std::int64_t r = 0; r < extent_; ++r) {
      y[r * inner_] = Log ? (x[r * inner_] - m) - ls : std::exp(x[r * inner_] - m) * inv;
    }
  }

  int dim_;
  std::int64_t outer_, extent_, inner_;
};

}  // namespace lazy::graph
// ---- end lazytensor/graph/softmax_node.hpp ----

namespace lazy {

namespace detail {
template <bool Log, class X>
auto softmax_impl(const X& x, std::int64_t dim, const char* op) {
  using V = expr::value_t<X>;
  using T = std::conditional_t<std::is_same_v<V, double>, double, float>;
  Tensor<T> t = [&] {
    if constexpr (std::is_same_v<X, Tensor<T>>) return x;
    else return Tensor<T>(cast<T>(x));
  }();
  const Shape& s = t.shape();
  const int d = normalize_dim(dim, s.rank(), op);
  std::int64_t outer = 1, inner = 1;
  const std::int64_t extent = s.rank() ? s[d] : 1;
  for (int i = 0; i < s.rank(); ++i) {
    if (i < d) outer *= s[i];
    if (i > d) inner *= s[i];
  }
  Tensor<T> r(graph::submit(std::make_shared<graph::SoftmaxNode<T, Log>>(t.node(), d, outer, extent, inner)));
  // softmax: dx = y * (g - sum(g * y)); log_softmax: dx = g - exp(y) * sum(g), along dim.
  autograd::record(r, Log ? "LogSoftmaxBackward0" : "SoftmaxBackward0", {autograd::edge_of(t.impl())},
                   [y = r.detach(), d](const Tensor<T>& g) {
                     Tensor<T> dx = Log ? Tensor<T>(g - exp(y) * sum(g, {d}, true))
                                        : Tensor<T>(y * (g - sum(g * y, {d}, true)));
                     return std::vector<graph::NodePtr>{dx.node()};
                   });
  if constexpr (std::is_same_v<V, bfloat16>) return Tensor<bfloat16>(cast<bfloat16>(r));
  else return r;
}
}  // namespace detail

/// exp(x) / sum(exp(x)) along `dim`, computed stably.
template <expr::ExprLike X>
auto softmax(const X& x, std::int64_t dim) {
  return detail::softmax_impl<false>(x, dim, "softmax");
}

/// log(softmax(x)) along `dim`, computed stably as x - max - log(sum(exp(x - max))).
template <expr::ExprLike X>
auto log_softmax(const X& x, std::int64_t dim) {
  return detail::softmax_impl<true>(x, dim, "log_softmax");
}

}  // namespace lazy
// ---- end lazytensor/ops/softmax.hpp ----

namespace lazy::nn {

/// How a loss reduces over the batch (torch's reduction='mean' | 'sum' | 'none').
enum class Reduction { Mean, Sum, None };

namespace functional {

namespace detail {
template <Element T>
Tensor<T> reduce(const Tensor<T>& per_sample, Reduction r) {
  switch (r) {
    case Reduction::Mean: return mean(per_sample);
    case Reduction::Sum: return sum(per_sample);
    case Reduction::None: break;
  }
  return per_sample;
}

/// Tensor<T> in a non-deduced context: T comes from another argument, and expressions
/// still convert.
template <class T>
using Arg = std::type_identity_t<Tensor<T>>;

/// A pending expression evaluated into a tensor; a tensor as it is.
template <class X>
decltype(auto) as_tensor(const X& x) {
  if constexpr (expr::Pending<X>) return lazy::eval(x);
  else return (x);
}

template <Element T, IndexElement I>
void check_targets(const Tensor<T>& input, const Tensor<I>& target, const char* op) {
  if (input.dim() != 2) {
    throw ShapeError(std::string(op) + ": expected input of shape (N, C), got " + input.shape().str());
  }
  if (target.dim() != 1 || target.size(0) != input.size(0)) {
    throw ShapeError(std::string(op) + ": expected target of shape (" + std::to_string(input.size(0)) +
                     ",) for input " + input.shape().str() + ", got " + target.shape().str());
  }
}
}  // namespace detail

/// Options of cross_entropy.
struct CrossEntropyOptions {
  Reduction reduction = Reduction::Mean;
  /// Mix the one-hot targets with the uniform distribution (torch's label_smoothing).
  double label_smoothing = 0.0;
};

/// Cross entropy of logits `input` [N, C] against class indices `target` [N] (torch's
/// F.cross_entropy). Its backward is one fused kernel, (softmax(x) - smoothed one-hot) * g,
/// rather than the composition of log_softmax, gather and the reduction. Class indices
/// outside [0, C) raise IndexError when the loss is computed.
template <IndexElement I, FloatingElement F>
Tensor<F> cross_entropy(const Tensor<F>& input, const Tensor<I>& target, CrossEntropyOptions opt = {}) {
  detail::check_targets(input, target, "cross_entropy");
  if (opt.label_smoothing < 0 || opt.label_smoothing > 1) {
    throw Error("cross_entropy: label_smoothing must be in [0, 1], got " + std::to_string(opt.label_smoothing));
  }
  const std::int64_t n = input.size(0), c = input.size(1);
  const F eps = static_cast<F>(opt.label_smoothing);
  Tensor<F> logp;
  Tensor<F> per_sample;
  {
    NoGradGuard forward_only;  // the backward below is explicit
    logp = log_softmax(input, 1);
    Tensor<F> picked = reshape(gather(logp, 1, reshape(target, Shape{n, 1})), Shape{n});
    per_sample = eps == 0 ? Tensor<F>(-picked)
                          : Tensor<F>(-(1 - eps) * picked - (eps / static_cast<F>(c)) * sum(logp, {1}));
  }
  Tensor<F> loss = detail::reduce(per_sample, opt.reduction);
  autograd::record(loss, "CrossEntropyBackward0", {autograd::edge_of(input.impl())},
                   [logp = logp.detach(), target = target.detach(), n, c, eps, r = opt.reduction](const Tensor<F>& g) {
                     // d loss_i / d x_ij = softmax_ij - ((1 - eps) [j == t_i] + eps / C), times the
                     // incoming gradient (per sample for 'none', shared otherwise).
                     Tensor<F> gi = r == Reduction::None ? reshape(g, Shape{n, 1})
                                        : r == Reduction::Mean ? Tensor<F>(reshape(g, Shape{1, 1}) / static_cast<F>(n))
                                                               : reshape(g, Shape{1, 1});
                     Tensor<F> dx = (exp(logp) - (cast<F>(one_hot(target, c)) * (1 - eps) + eps / static_cast<F>(c))) * gi;
                     return std::vector<graph::NodePtr>{dx.node()};
                   });
  return loss;
}

/// cross_entropy of a pending expression.
template <expr::Pending E, IndexElement I>
auto cross_entropy(const E& input, const Tensor<I>& target, CrossEntropyOptions opt = {}) {
  return cross_entropy(lazy::eval(input), target, opt);
}

/// Negative log likelihood of log-probabilities `input` [N, C] at class indices `target`.
template <IndexElement I, FloatingElement F>
Tensor<F> nll_loss(const Tensor<F>& input, const Tensor<I>& target, Reduction r = Reduction::Mean) {
  detail::check_targets(input, target, "nll_loss");
  const std::int64_t n = input.size(0);
  Tensor<F> picked = reshape(gather(input, 1, reshape(target, Shape{n, 1})), Shape{n});
  return detail::reduce(Tensor<F>(-picked), r);
}
/// nll_loss of a pending expression.
template <expr::Pending E, IndexElement I>
auto nll_loss(const E& input, const Tensor<I>& target, Reduction r = Reduction::Mean) {
  return nll_loss(lazy::eval(input), target, r);
}

/// Mean squared error (torch's F.mse_loss).
template <FloatingElement F>
Tensor<F> mse_loss(const Tensor<F>& input, const detail::Arg<F>& target, Reduction r = Reduction::Mean) {
  if (!(input.shape() == target.shape())) {
    throw ShapeError("mse_loss: input " + input.shape().str() + " and target " + target.shape().str() +
                     " must have the same shape");
  }
  Tensor<F> d = (input - target) * (input - target);
  return detail::reduce(d, r);
}
/// mse_loss of a pending expression.
template <expr::Pending E, class Y>
auto mse_loss(const E& input, const Y& target, Reduction r = Reduction::Mean) {
  return mse_loss(lazy::eval(input), detail::as_tensor(target), r);
}

/// Binary cross entropy on logits, computed stably: max(x, 0) - x * y + log(1 + e^-|x|).
template <FloatingElement F>
Tensor<F> binary_cross_entropy_with_logits(const Tensor<F>& input, const detail::Arg<F>& target,
                                           Reduction r = Reduction::Mean) {
  if (!(input.shape() == target.shape())) {
    throw ShapeError("binary_cross_entropy_with_logits: input " + input.shape().str() + " and target " +
                     target.shape().str() + " must have the same shape");
  }
  Tensor<F> l = relu(input) - input * target + log1p(exp(-abs(input)));
  return detail::reduce(l, r);
}
/// binary_cross_entropy_with_logits of a pending expression.
template <expr::Pending E, class Y>
auto binary_cross_entropy_with_logits(const E& input, const Y& target, Reduction r = Reduction::Mean) {
  return binary_cross_entropy_with_logits(lazy::eval(input), detail::as_tensor(target), r);
}

/// Zeroes elements with probability p and scales the rest by 1 / (1 - p) in training.
template <FloatingElement F>
Tensor<F> dropout(const Tensor<F>& x, double p = 0.5, bool training = true) {
  if (p < 0 || p > 1) throw Error("dropout: probability has to be between 0 and 1, but got " + std::to_string(p));
  if (!training || p == 0) return x;
  if (p == 1) return Tensor<F>(x * 0.0f);
  return Tensor<F>(x * bernoulli<F>(1 - p, x.shape(), x.device()) * static_cast<compute_t<F>>(1 / (1 - p)));
}
/// dropout of a pending expression.
template <expr::Pending E>
auto dropout(const E& x, double p = 0.5, bool training = true) {
  return dropout(lazy::eval(x), p, training);
}

/// Normalizes over the trailing dims `normalized` (torch's F.layer_norm); weight and bias
/// (optional: undefined tensors) have the normalized shape.
template <FloatingElement F>
Tensor<F> layer_norm(const Tensor<F>& x, const Shape& normalized, const detail::Arg<F>& weight,
                     const detail::Arg<F>& bias, double eps = 1e-5) {
  const int k = normalized.rank(), r = x.dim();
  bool ok = k >= 1 && k <= r;
  for (int i = 0; ok && i < k; ++i) ok = x.shape()[r - k + i] == normalized[i];
  if (!ok) {
    throw ShapeError("layer_norm: normalized_shape " + normalized.str() + " does not match the trailing dims of input " +
                     x.shape().str());
  }
  std::vector<std::int64_t> dims;
  for (int i = r - k; i < r; ++i) dims.push_back(i);
  Tensor<F> mu = mean(x, dims, true);
  Tensor<F> xc = x - mu;
  Tensor<F> var = mean(xc * xc, dims, true);
  Tensor<F> y = xc * rsqrt(var + static_cast<F>(eps));
  if (weight.defined()) y = y * weight;
  if (bias.defined()) y = y + bias;
  return y;
}
/// layer_norm of a pending expression.
template <expr::Pending E>
auto layer_norm(const E& x, const Shape& normalized, const detail::Arg<typename E::value_type>& weight,
                const detail::Arg<typename E::value_type>& bias, double eps = 1e-5) {
  return layer_norm(lazy::eval(x), normalized, weight, bias, eps);
}

}  // namespace functional
}  // namespace lazy::nn

// Instantiated once in the compiled runtime (core/config.hpp): the losses and functional
// layers at every floating dtype, with either index dtype.
#define LAZYTENSOR_NN_FUNCTIONAL_INSTANCES(P, T)                                                                   \
  P template lazy::Tensor<T> lazy::nn::functional::detail::reduce<T>(const lazy::Tensor<T>&, lazy::nn::Reduction); \
  P template lazy::Tensor<T> lazy::nn::functional::cross_entropy<std::int32_t, T>(                                 \
      const lazy::Tensor<T>&, const lazy::Tensor<std::int32_t>&, lazy::nn::functional::CrossEntropyOptions);       \
  P template lazy::Tensor<T> lazy::nn::functional::cross_entropy<std::int64_t, T>(                                 \
      const lazy::Tensor<T>&, const lazy::Tensor<std::int64_t>&, lazy::nn::functional::CrossEntropyOptions);       \
  P template lazy::Tensor<T> lazy::nn::functional::nll_loss<std::int32_t, T>(                                      \
      const lazy::Tensor<T>&, const lazy::Tensor<std::int32_t>&, lazy::nn::Reduction);                             \
  P template lazy::Tensor<T> lazy::nn::functional::nll_loss<std::int64_t, T>(                                      \
      const lazy::Tensor<T>&, const lazy::Tensor<std::int64_t>&, lazy::nn::Reduction);                             \
  P template lazy::Tensor<T> lazy::nn::functional::mse_loss<T>(const lazy::Tensor<T>&,                             \
                                                                const lazy::nn::functional::detail::Arg<T>&,         \
                                                                lazy::nn::Reduction);                               \
  P template lazy::Tensor<T> lazy::nn::functional::binary_cross_entropy_with_logits<T>(                            \
      const lazy::Tensor<T>&, const lazy::nn::functional::detail::Arg<T>&, lazy::nn::Reduction);                   \
  P template lazy::Tensor<T> lazy::nn::functional::dropout<T>(const lazy::Tensor<T>&, double, bool);               \
  P template lazy::Tensor<T> lazy::nn::functional::layer_norm<T>(                                                  \
      const lazy::Tensor<T>&, const lazy::Shape&, const lazy::nn::functional::detail::Arg<T>&,                     \
      const lazy::nn::functional::detail::Arg<T>&, double);
#if LAZYTENSOR_EXPLICIT_INSTANTIATION
LAZYTENSOR_FOR_FLOATING(LAZYTENSOR_NN_FUNCTIONAL_INSTANCES, extern)
#endif
// ---- end lazytensor/nn/functional.hpp ----
// ---- begin lazytensor/nn/module.hpp ----
// nn::Module, as libtorch's torch::nn::Module: a tree of modules owning named parameters
// (floating tensors that require grad) and buffers (running statistics and the like), with
// state_dict / load_state_dict, train / eval, to(device), to(dtype) and zero_grad. Module
// handles (nn::Linear, ...) are shared pointers to the *Impl classes, like libtorch's
// ModuleHolder.
//
// Parameters and buffers are tensor handles shared with the owning module's members: an
// optimizer's in-place update, load_state_dict, to(device) or to(dtype) rebinds the shared
// tensor object, so every handle sees it. Layers are built in float (libtorch's default
// dtype) and their forward runs in the dtype of its input, so a module converted with
// to(DType::Float64) computes in double. After such a conversion a member typed for the old
// dtype (`Tensor<float> weight`) raises DTypeError when used; the module's own views
// (`param<double>(weight)`, parameters()) follow the conversion.

#include <algorithm>
#include <memory>
#include <ostream>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>


namespace lazy::nn {

/// Base of every layer and model.
class Module : public std::enable_shared_from_this<Module> {
 public:
  /// `name` is what printing shows ("Linear", "Net", ...).
  explicit Module(std::string name = "Module") : name_(std::move(name)) {}
  virtual ~Module() = default;
  Module(const Module&) = delete;
  Module& operator=(const Module&) = delete;

  /// The module's type name.
  const std::string& name() const { return name_; }

  /// Registers a parameter under `name` (marked requires_grad unless told otherwise) and
  /// returns a handle sharing it.
  template <Element T>
  Tensor<T> register_parameter(const std::string& name, Tensor<T> t, bool requires_grad = true) {
    add_parameter(name, t);
    if (requires_grad && !t.requires_grad()) t.requires_grad_();
    return t;
  }
  /// Registers a buffer (saved in state_dict, not a parameter) and returns a handle.
  AnyTensor register_buffer(const std::string& name, AnyTensor t);
  /// Registers a submodule; returns it.
  template <class M>
  std::shared_ptr<M> register_module(const std::string& name, std::shared_ptr<M> m) {
    static_assert(std::is_base_of_v<Module, M>, "register_module: not an nn::Module");
    check_name(name);
    if (!m) throw Error(name_ + ".register_module: submodule '" + name + "' is empty");
    children_.emplace_back(name, m);
    return m;
  }
  /// Registers a submodule given by its holder (nn::Linear, ...); returns the holder.
  template <class H>
    requires requires(const H& h) { h.ptr(); }
  H register_module(const std::string& name, H holder) {
    register_module(name, holder.ptr());
    return holder;
  }

  /// Every parameter of this module and (recursively) its submodules, in registration order,
  /// whatever their dtype (each converts to its typed handle: `Tensor<float> w = ps[0];`).
  std::vector<AnyTensor> parameters(bool recurse = true) const;
  /// Parameters with dotted names ("fc1.weight").
  std::vector<std::pair<std::string, AnyTensor>> named_parameters(bool recurse = true) const;
  /// Buffers with dotted names.
  std::vector<std::pair<std::string, AnyTensor>> named_buffers(bool recurse = true) const;
  /// Direct submodules with their names.
  const std::vector<std::pair<std::string, std::shared_ptr<Module>>>& named_children() const { return children_; }
  /// This module and every descendant, depth first.
  std::vector<std::shared_ptr<const Module>> modules() const;

  /// Parameters and buffers by dotted name.
  StateDict state_dict() const;

  /// Replaces parameters and buffers with the entries of `sd`. With `strict`, a missing or
  /// unexpected key is an Error; a shape or dtype mismatch is always an error. Nothing is
  /// changed when any check fails. The values are shared, not copied.
  void load_state_dict(const StateDict& sd, bool strict = true);

  /// Training mode (dropout active, batch norm uses batch statistics), recursively.
  virtual void train(bool on = true);
  /// Evaluation mode: train(false).
  void eval() { train(false); }
  /// True in training mode.
  bool is_training() const { return training_; }

  /// Moves every parameter and buffer to `dev` (their gradients are dropped).
  void to(const Device& dev);
  /// Converts every floating parameter and buffer to `dtype`, a floating dtype (integer
  /// buffers such as num_batches_tracked keep theirs; gradients are dropped), as libtorch's
  /// Module::to(dtype). DTypeError for an integral or bool dtype.
  void to(DType dtype);
  /// Both: to(dtype), then to(dev).
  void to(const Device& dev, DType dtype) {
    to(dtype);
    to(dev);
  }

  /// Clears the gradients: undefined (set_to_none, libtorch's default) or zero.
  void zero_grad(bool set_to_none = true);

  /// Prints the module tree as PyTorch does.
  virtual void pretty_print(std::ostream& os) const { os << name_; }

  /// The module tree as text.
  std::string str() const;

 private:
  void add_parameter(const std::string& name, AnyTensor t);
  void check_name(const std::string& n) const;
  void collect_params(const std::string& prefix, bool recurse,
                      std::vector<std::pair<std::string, AnyTensor>>& out) const;
  void collect_buffers(const std::string& prefix, bool recurse,
                       std::vector<std::pair<std::string, AnyTensor>>& out) const;
  // Module by module, parameters then buffers, as torch orders its state dicts.
  void collect_state(const std::string& prefix, StateDict& sd) const;
  void print_tree(std::ostream& os, int indent) const;
  static AnyTensor on_device(const AnyTensor& t, const Device& dev);
  static std::string join(const std::vector<std::string>& v);

  std::string name_;
  bool training_ = true;
  std::vector<std::pair<std::string, AnyTensor>> params_;
  std::vector<std::pair<std::string, AnyTensor>> buffers_;
  std::vector<std::pair<std::string, std::shared_ptr<Module>>> children_;
};

namespace detail {
/// A layer's parameter or buffer `p` as Tensor<T>, the dtype of the input the layer is
/// applied to (an undefined one stays undefined). DTypeError naming both dtypes when the
/// layer holds another, as libtorch's "expected scalar type Double but found Float".
template <Element T, Element U>
Tensor<T> param_as(const Tensor<U>& p, const Module& layer) {
  if (!p.defined()) return Tensor<T>();
  const DType held = p.impl()->node->dtype();
  if (held != dtype_of<T>()) {
    throw DTypeError(layer.name() + ": expected an input of the module's dtype " + dtype_name(held) + ", got " +
                     dtype_name(dtype_of<T>()) + " (convert one of them: module->to(dtype) or x.to(dtype))");
  }
  return Tensor<T>::from_impl(p.impl());
}
}  // namespace detail

/// A shared handle on a module implementation, as libtorch's ModuleHolder: `nn::Linear fc(4, 2);`
/// constructs a LinearImpl; `nn::Linear fc{nullptr};` is empty; `fc->weight`, `fc(x)`.
template <class Impl>
class ModuleHolder {
 public:
  using impl_type = Impl;
  /// An empty holder (assign a constructed one later).
  ModuleHolder(std::nullptr_t) {}  // NOLINT: as libtorch
  /// Wraps an existing implementation.
  ModuleHolder(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}  // NOLINT
  /// Constructs the implementation from `args`.
  template <class A0, class... Args>
    requires(!std::is_same_v<std::remove_cvref_t<A0>, ModuleHolder> &&
             !std::is_same_v<std::remove_cvref_t<A0>, std::nullptr_t> &&
             !std::is_same_v<std::remove_cvref_t<A0>, std::shared_ptr<Impl>>)
  explicit ModuleHolder(A0&& a0, Args&&... args)
      : impl_(std::make_shared<Impl>(std::forward<A0>(a0), std::forward<Args>(args)...)) {}
  /// Default-constructs the implementation (when it has a default constructor).
  ModuleHolder()
    requires std::is_default_constructible_v<Impl>
      : impl_(std::make_shared<Impl>()) {}

  Impl* operator->() const { return &get(); }
  Impl& operator*() const { return get(); }
  Impl& get() const {
    if (!impl_) throw Error("use of an empty module holder (constructed with nullptr)");
    return *impl_;
  }
  const std::shared_ptr<Impl>& ptr() const { return impl_; }
  bool is_empty() const { return impl_ == nullptr; }
  /// Calls forward.
  template <class... Args>
  decltype(auto) operator()(Args&&... args) const {
    return get().forward(std::forward<Args>(args)...);
  }

 private:
  std::shared_ptr<Impl> impl_;
};

#if LAZYTENSOR_HEADER_DEFINITIONS
LAZYTENSOR_INLINE void Module::add_parameter(const std::string& name, AnyTensor t) {
  check_name(name);
  if (!t.defined()) throw Error(name_ + ".register_parameter: parameter '" + name + "' is undefined");
  params_.emplace_back(name, t);
}

LAZYTENSOR_INLINE AnyTensor Module::register_buffer(const std::string& name, AnyTensor t) {
  check_name(name);
  buffers_.emplace_back(name, t);
  return t;
}

LAZYTENSOR_INLINE std::vector<AnyTensor> Module::parameters(bool recurse) const {
  std::vector<AnyTensor> out;
  for (auto& [n, p] : named_parameters(recurse)) out.push_back(p);
  return out;
}

LAZYTENSOR_INLINE std::vector<std::pair<std::string, AnyTensor>> Module::named_parameters(bool recurse) const {
  std::vector<std::pair<std::string, AnyTensor>> out;
  collect_params("", recurse, out);
  return out;
}

LAZYTENSOR_INLINE std::vector<std::pair<std::string, AnyTensor>> Module::named_buffers(bool recurse) const {
  std::vector<std::pair<std::string, AnyTensor>> out;
  collect_buffers("", recurse, out);
  return out;
}

LAZYTENSOR_INLINE std::vector<std::shared_ptr<const Module>> Module::modules() const {
  std::vector<std::shared_ptr<const Module>> out{shared_from_this()};
  for (auto& [n, c] : children_)
    for (auto& m : c->modules()) out.push_back(m);
  return out;
}

LAZYTENSOR_INLINE StateDict Module::state_dict() const {
  StateDict sd;
  collect_state("", sd);
  return sd;
}

LAZYTENSOR_INLINE void Module::load_state_dict(const StateDict& sd, bool strict) {
  std::vector<std::pair<std::shared_ptr<graph::TensorImpl>, AnyTensor>> plan;
  std::vector<std::string> missing;
  auto match = [&](const std::string& key, const std::shared_ptr<graph::TensorImpl>& impl) {
    const AnyTensor* src = sd.find(key);
    if (!src) {
      missing.push_back(key);
      return;
    }
    const auto& cur = impl->node;
    if (src->dtype() != cur->dtype()) {
      throw DTypeError("load_state_dict: '" + key + "' has dtype " + dtype_name(src->dtype()) +
                       " in the state dict, expected " + dtype_name(cur->dtype()));
    }
    if (!(src->shape() == cur->shape())) {
      throw ShapeError("load_state_dict: size mismatch for '" + key + "': copying a param with shape " +
                       src->shape().str() + " from the state dict, the shape in the current model is " +
                       cur->shape().str());
    }
    plan.emplace_back(impl, *src);
  };
  std::vector<std::string> own;
  for (auto& [n, p] : named_parameters()) {
    match(n, p.impl());
    own.push_back(n);
  }
  for (auto& [n, b] : named_buffers()) {
    match(n, b.impl());
    own.push_back(n);
  }
  if (strict) {
    std::vector<std::string> unexpected;
    for (const auto& k : sd.keys())
      if (std::find(own.begin(), own.end(), k) == own.end()) unexpected.push_back(k);
    if (!missing.empty() || !unexpected.empty()) {
      throw Error("load_state_dict: error(s) in loading state_dict for " + name_ + ": missing key(s): " +
                  join(missing) + "; unexpected key(s): " + join(unexpected));
    }
  }
  for (auto& [impl, src] : plan) {
    const Device here(impl->node->device()->index());
    graph::rebind(impl,
                  src.device() == here ? src.impl()->node : on_device(src, here).impl()->node);
  }
}

LAZYTENSOR_INLINE void Module::train(bool on) {
  training_ = on;
  for (auto& [n, c] : children_) c->train(on);
}

LAZYTENSOR_INLINE void Module::to(const Device& dev) {
  for (auto& [n, p] : named_parameters()) {
    if (p.device() == dev) continue;
    graph::rebind(p.impl(), p.detach().to(dev).impl()->node);
    p.set_grad(AnyTensor());
  }
  for (auto& [n, b] : named_buffers()) {
    if (b.device() == dev) continue;
    graph::rebind(b.impl(), on_device(b, dev).impl()->node);
  }
}

LAZYTENSOR_INLINE void Module::to(DType dtype) {
  if (!is_floating(dtype)) {
    throw DTypeError(name_ + ".to: expected a floating dtype (bfloat16, float32 or float64), got " + dtype_name(dtype));
  }
  for (auto& [n, p] : named_parameters()) {
    if (p.dtype() == dtype || !p.is_floating_point()) continue;
    p.set_grad(AnyTensor());
    // requires_grad stays set (it lives in the shared object); the typed ops that use the
    // parameter make the new dtype's gradient operations known when they record.
    graph::rebind(p.impl(), p.to(dtype).impl()->node);
  }
  for (auto& [n, b] : named_buffers()) {
    if (b.dtype() == dtype || !b.is_floating_point()) continue;
    graph::rebind(b.impl(), b.to(dtype).impl()->node);
  }
}

LAZYTENSOR_INLINE void Module::zero_grad(bool set_to_none) {
  for (auto& p : parameters()) {
    if (set_to_none || !p.grad().defined()) {
      p.set_grad(AnyTensor());
    } else {
      NoGradGuard guard;
      p.grad().zero_();
    }
  }
}

LAZYTENSOR_INLINE std::string Module::str() const {
  std::ostringstream os;
  print_tree(os, 0);
  return os.str();
}

LAZYTENSOR_INLINE void Module::check_name(const std::string& n) const {
  if (n.empty() || n.find('.') != std::string::npos) {
    throw Error(name_ + ": invalid name '" + n + "' (names must be non-empty and contain no '.')");
  }
  for (auto& [k, v] : params_)
    if (k == n) throw Error(name_ + ": '" + n + "' is already registered");
  for (auto& [k, v] : buffers_)
    if (k == n) throw Error(name_ + ": '" + n + "' is already registered");
  for (auto& [k, v] : children_)
    if (k == n) throw Error(name_ + ": '" + n + "' is already registered");
}

LAZYTENSOR_INLINE void Module::collect_params(const std::string& prefix, bool recurse,
                                              std::vector<std::pair<std::string, AnyTensor>>& out) const {
  for (auto& [n, p] : params_) out.emplace_back(prefix + n, p);
  if (recurse)
    for (auto& [n, c] : children_) c->collect_params(prefix + n + ".", true, out);
}

LAZYTENSOR_INLINE void Module::collect_buffers(const std::string& prefix, bool recurse,
                                               std::vector<std::pair<std::string, AnyTensor>>& out) const {
  for (auto& [n, b] : buffers_) out.emplace_back(prefix + n, b);
  if (recurse)
    for (auto& [n, c] : children_) c->collect_buffers(prefix + n + ".", true, out);
}

LAZYTENSOR_INLINE void Module::collect_state(const std::string& prefix, StateDict& sd) const {
  for (auto& [n, p] : params_) sd.insert(prefix + n, p.detach());
  for (auto& [n, b] : buffers_) sd.insert(prefix + n, b);
  for (auto& [n, c] : children_) c->collect_state(prefix + n + ".", sd);
}

LAZYTENSOR_INLINE void Module::print_tree(std::ostream& os, int indent) const {
  pretty_print(os);
  if (children_.empty()) return;
  os << "(\n";
  for (auto& [n, c] : children_) {
    os << std::string(static_cast<std::size_t>(indent + 2), ' ') << "(" << n << "): ";
    c->print_tree(os, indent + 2);
    os << "\n";
  }
  os << std::string(static_cast<std::size_t>(indent), ' ') << ")";
}

LAZYTENSOR_INLINE AnyTensor Module::on_device(const AnyTensor& t, const Device& dev) {
  return t.visit([&](const auto& typed) { return AnyTensor(typed.to(dev)); });
}

LAZYTENSOR_INLINE std::string Module::join(const std::vector<std::string>& v) {
  std::string s;
  for (const auto& x : v) s += (s.empty() ? "'" : ", '") + x + "'";
  return s.empty() ? "none" : s;
}
#endif  // LAZYTENSOR_HEADER_DEFINITIONS

}  // namespace lazy::nn

/// Declares `Name` as the holder of `NameImpl` (libtorch's TORCH_MODULE).
#define LAZY_MODULE(Name)                                          \
  class Name : public ::lazy::nn::ModuleHolder<Name##Impl> {       \
   public:                                                         \
    using ::lazy::nn::ModuleHolder<Name##Impl>::ModuleHolder;      \
  }
// ---- end lazytensor/nn/module.hpp ----

namespace lazy::nn {

#define LAZY_ACTIVATION(NAME, FN)                                                              \
  /** Element-wise FN as a layer. */                                                            \
  class NAME##Impl : public Module {                                                           \
   public:                                                                                     \
    NAME##Impl() : Module(#NAME) {}                                                            \
    template <FloatingElement T>                                                               \
    Tensor<T> forward(const Tensor<T>& x) const;                                               \
    /** The same on a pending expression. */                                                   \
    template <expr::Pending E>                                                                 \
    auto forward(const E& x) const {                                                           \
      return forward(lazy::eval(x));                                                           \
    }                                                                                          \
    void pretty_print(std::ostream& os) const override { os << #NAME "()"; }                   \
  };                                                                                           \
  template <FloatingElement T>                                                                 \
  Tensor<T> NAME##Impl::forward(const Tensor<T>& x) const {                                    \
    return Tensor<T>(lazy::FN(x));                                                             \
  }                                                                                            \
  LAZY_MODULE(NAME)

LAZY_ACTIVATION(ReLU, relu);
LAZY_ACTIVATION(GELU, gelu);
LAZY_ACTIVATION(Tanh, tanh);
LAZY_ACTIVATION(Sigmoid, sigmoid);
LAZY_ACTIVATION(SiLU, silu);
#undef LAZY_ACTIVATION

/// Flattens dims start_dim..end_dim (default: all but the batch dim).
class FlattenImpl : public Module {
 public:
  explicit FlattenImpl(std::int64_t start_dim = 1, std::int64_t end_dim = -1)
      : Module("Flatten"), start_(start_dim), end_(end_dim) {}
  template <FloatingElement T>
  Tensor<T> forward(const Tensor<T>& x) const;
  /// The same on a pending expression.
  template <expr::Pending E>
  auto forward(const E& x) const {
    return forward(lazy::eval(x));
  }
  void pretty_print(std::ostream& os) const override;

 private:
  std::int64_t start_, end_;
};
// (Outside the class, so not inline: see core/config.hpp.)
template <FloatingElement T>
Tensor<T> FlattenImpl::forward(const Tensor<T>& x) const {
  return flatten(x, start_, end_);
}
LAZY_MODULE(Flatten);

/// Zeroes inputs with probability p during training (scaling the rest by 1 / (1 - p));
/// the identity in eval mode.
class DropoutImpl : public Module {
 public:
  explicit DropoutImpl(double p = 0.5);
  template <FloatingElement T>
  Tensor<T> forward(const Tensor<T>& x) const;
  /// The same on a pending expression.
  template <expr::Pending E>
  auto forward(const E& x) const {
    return forward(lazy::eval(x));
  }
  void pretty_print(std::ostream& os) const override;

 private:
  double p_;
};
template <FloatingElement T>
Tensor<T> DropoutImpl::forward(const Tensor<T>& x) const {
  return functional::dropout(x, p_, is_training());
}
LAZY_MODULE(Dropout);

#if LAZYTENSOR_HEADER_DEFINITIONS
LAZYTENSOR_INLINE void FlattenImpl::pretty_print(std::ostream& os) const {
  os << "Flatten(start_dim=" << start_ << ", end_dim=" << end_ << ")";
}

LAZYTENSOR_INLINE DropoutImpl::DropoutImpl(double p) : Module("Dropout"), p_(p) {
  if (p < 0 || p > 1) throw Error("Dropout: probability has to be between 0 and 1, but got " + std::to_string(p));
}

LAZYTENSOR_INLINE void DropoutImpl::pretty_print(std::ostream& os) const { os << "Dropout(p=" << p_ << ")"; }
#endif  // LAZYTENSOR_HEADER_DEFINITIONS

}  // namespace lazy::nn

// Instantiated once in the compiled runtime (core/config.hpp).
#define LAZYTENSOR_NN_ACTIVATION_INSTANCES(P, T)                                                     \
  P template lazy::Tensor<T> lazy::nn::ReLUImpl::forward<T>(const lazy::Tensor<T>&) const;    \
  P template lazy::Tensor<T> lazy::nn::GELUImpl::forward<T>(const lazy::Tensor<T>&) const;    \
  P template lazy::Tensor<T> lazy::nn::TanhImpl::forward<T>(const lazy::Tensor<T>&) const;    \
  P template lazy::Tensor<T> lazy::nn::SigmoidImpl::forward<T>(const lazy::Tensor<T>&) const; \
  P template lazy::Tensor<T> lazy::nn::SiLUImpl::forward<T>(const lazy::Tensor<T>&) const;    \
  P template lazy::Tensor<T> lazy::nn::FlattenImpl::forward<T>(const lazy::Tensor<T>&) const; \
  P template lazy::Tensor<T> lazy::nn::DropoutImpl::forward<T>(const lazy::Tensor<T>&) const;
#if LAZYTENSOR_EXPLICIT_INSTANTIATION
LAZYTENSOR_FOR_FLOATING(LAZYTENSOR_NN_ACTIVATION_INSTANCES, extern)
#endif
// ---- end lazytensor/nn/activation.hpp ----
// ---- begin lazytensor/nn/conv.hpp ----
// nn::Conv2d, as torch::nn::Conv2d: a 2-D convolution layer over the functional
// lazy::conv2d (im2col + one GEMM, bias fused into the GEMM's row blocks), with PyTorch's
// initialization: kaiming_uniform(a = sqrt(5)) on the weight, i.e. U(-1/sqrt(fan_in),
// 1/sqrt(fan_in)) with fan_in = in_channels * kH * kW, and the same bound for the bias.
//
// Options are checked at construction (a layer that cannot run is never built); the input
// is checked by conv2d at forward. groups and padding modes other than zeros are not
// supported (conv2d has groups = 1 only), so Conv2dOptions does not offer them.

#include <cmath>
#include <cstdint>
#include <ostream>
#include <string>

// ---- begin lazytensor/nn/init.hpp ----
// Parameter initializers, as torch.nn.init: each fills a floating tensor in place (without
// recording history) from the current device's random stream.

#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>


namespace lazy::nn::init {

/// Which fan kaiming_* scales by.
enum class FanMode { FanIn, FanOut };
/// The nonlinearity a gain is computed for (torch.nn.init.calculate_gain).
enum class Nonlinearity { Linear, Sigmoid, Tanh, ReLU, LeakyReLU };

/// torch.nn.init.calculate_gain.
double calculate_gain(Nonlinearity nl, double param = 0.01);

/// (fan_in, fan_out) of a weight: dim 1 and dim 0 sizes times the receptive field (the
/// product of the remaining dims), as torch computes them.
std::pair<double, double> fans(const Shape& s);

/// Fills with U(a, b).
template <FloatingElement T>
Tensor<T>& uniform_(Tensor<T>& t, double a = 0, double b = 1) {
  NoGradGuard guard;
  // Drawn in float (the stream every dtype shares); double scales in double.
  if constexpr (std::is_same_v<T, double>)
    t.copy_(cast<double>(rand<float>(t.shape(), t.device())) * (b - a) + a);
  else
    t.copy_(rand<float>(t.shape(), t.device()) * static_cast<float>(b - a) + static_cast<float>(a));
  return t;
}
/// Fills with N(mean, std^2).
template <FloatingElement T>
Tensor<T>& normal_(Tensor<T>& t, double mean = 0, double std = 1) {
  NoGradGuard guard;
  if constexpr (std::is_same_v<T, double>)
    t.copy_(cast<double>(randn<float>(t.shape(), t.device())) * std + mean);
  else
    t.copy_(randn<float>(t.shape(), t.device()) * static_cast<float>(std) + static_cast<float>(mean));
  return t;
}
/// Fills with `value`.
template <FloatingElement T>
Tensor<T>& constant_(Tensor<T>& t, double value) {
  NoGradGuard guard;
  t.fill_(value);
  return t;
}
/// Fills with zeros.
template <FloatingElement T>
Tensor<T>& zeros_(Tensor<T>& t) { return constant_(t, 0); }
/// Fills with ones.
template <FloatingElement T>
Tensor<T>& ones_(Tensor<T>& t) { return constant_(t, 1); }

/// Glorot uniform: U(-a, a), a = gain * sqrt(6 / (fan_in + fan_out)).
template <FloatingElement T>
Tensor<T>& xavier_uniform_(Tensor<T>& t, double gain = 1) {
  auto [in, out] = fans(t.shape());
  const double a = gain * std::sqrt(6.0 / (in + out));
  return uniform_(t, -a, a);
}
/// Glorot normal: N(0, std^2), std = gain * sqrt(2 / (fan_in + fan_out)).
template <FloatingElement T>
Tensor<T>& xavier_normal_(Tensor<T>& t, double gain = 1) {
  auto [in, out] = fans(t.shape());
  return normal_(t, 0, gain * std::sqrt(2.0 / (in + out)));
}
/// He uniform: U(-b, b), b = gain(nl, a) * sqrt(3 / fan).
template <FloatingElement T>
Tensor<T>& kaiming_uniform_(Tensor<T>& t, double a = 0, FanMode mode = FanMode::FanIn,
                                       Nonlinearity nl = Nonlinearity::LeakyReLU) {
  auto [in, out] = fans(t.shape());
  const double fan = mode == FanMode::FanIn ? in : out;
  const double bound = calculate_gain(nl, a) * std::sqrt(3.0 / fan);
  return uniform_(t, -bound, bound);
}
/// He normal: N(0, std^2), std = gain(nl, a) / sqrt(fan).
template <FloatingElement T>
Tensor<T>& kaiming_normal_(Tensor<T>& t, double a = 0, FanMode mode = FanMode::FanIn,
                                      Nonlinearity nl = Nonlinearity::LeakyReLU) {
  auto [in, out] = fans(t.shape());
  const double fan = mode == FanMode::FanIn ? in : out;
  return normal_(t, 0, calculate_gain(nl, a) / std::sqrt(fan));
}

#if LAZYTENSOR_HEADER_DEFINITIONS
LAZYTENSOR_INLINE double calculate_gain(Nonlinearity nl, double param) {
  switch (nl) {
    case Nonlinearity::Linear:
    case Nonlinearity::Sigmoid: return 1.0;
    case Nonlinearity::Tanh: return 5.0 / 3.0;
    case Nonlinearity::ReLU: return std::sqrt(2.0);
    case Nonlinearity::LeakyReLU: return std::sqrt(2.0 / (1.0 + param * param));
  }
  return 1.0;
}

LAZYTENSOR_INLINE std::pair<double, double> fans(const Shape& s) {
  if (s.rank() < 2) {
    throw ShapeError("init: fan in and fan out can not be computed for a tensor with fewer than 2 dimensions (shape " +
                     s.str() + ")");
  }
  double field = 1;
  for (int i = 2; i < s.rank(); ++i) field *= static_cast<double>(s[i]);
  return {static_cast<double>(s[1]) * field, static_cast<double>(s[0]) * field};
}
#endif  // LAZYTENSOR_HEADER_DEFINITIONS

}  // namespace lazy::nn::init

// Instantiated once in the compiled runtime (core/config.hpp).
#define LAZYTENSOR_NN_INIT_INSTANCES(P)                                                                           \
  P template lazy::Tensor<float>& lazy::nn::init::uniform_<float>(lazy::Tensor<float>&, double, double);            \
  P template lazy::Tensor<float>& lazy::nn::init::normal_<float>(lazy::Tensor<float>&, double, double);             \
  P template lazy::Tensor<float>& lazy::nn::init::constant_<float>(lazy::Tensor<float>&, double);                   \
  P template lazy::Tensor<float>& lazy::nn::init::zeros_<float>(lazy::Tensor<float>&);                              \
  P template lazy::Tensor<float>& lazy::nn::init::ones_<float>(lazy::Tensor<float>&);                               \
  P template lazy::Tensor<float>& lazy::nn::init::xavier_uniform_<float>(lazy::Tensor<float>&, double);             \
  P template lazy::Tensor<float>& lazy::nn::init::xavier_normal_<float>(lazy::Tensor<float>&, double);              \
  P template lazy::Tensor<float>& lazy::nn::init::kaiming_uniform_<float>(                                          \
      lazy::Tensor<float>&, double, lazy::nn::init::FanMode, lazy::nn::init::Nonlinearity);                        \
  P template lazy::Tensor<float>& lazy::nn::init::kaiming_normal_<float>(                                           \
      lazy::Tensor<float>&, double, lazy::nn::init::FanMode, lazy::nn::init::Nonlinearity);
#if LAZYTENSOR_EXPLICIT_INSTANTIATION
LAZYTENSOR_NN_INIT_INSTANCES(extern)
#endif
// ---- end lazytensor/nn/init.hpp ----
// ---- begin lazytensor/ops/conv.hpp ----
// conv2d as im2col + one batched GEMM (torch::nn::functional::conv2d), and unfold/fold
// (torch::nn::functional::unfold/fold), the im2col/col2im ops themselves.
//
// conv2d(x, w, b) = reshape(W [O, C*kh*kw] x cols[n] + b[:, None], [N, O, OH, OW]) with
// cols = im2col(x) [N, C*kh*kw, OH*OW]: the weight is shared by every image (a GEMM with a
// batch-1 left operand) and the output [N, O, OH*OW] is already NCHW; the bias add runs on
// the GEMM's row blocks while they are in cache (epilogue fusion). A 1x1 kernel with stride
// 1 and no padding needs no im2col: the image is its own column matrix (a view).
//
// Backward: im2col's rule is col2im; the GEMM's rule computes the column gradient as
// W^T x G[n] (W read transposed) and the weight gradient with ConvWeightGradNode, which sums
// G[n] x cols[n]^T over the images without materializing a transpose (matmul's generic rule
// would copy cols transposed and sum N products: ~1.7x slower at 32x64x32x32, 3x3); the bias
// gradient comes from the element-wise rule (a sum over N and the positions).

#include <cstdint>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

// ---- begin lazytensor/graph/im2col.hpp ----
// The kernels behind conv2d: im2col, its adjoint col2im (Caffe's layout), and the weight
// gradient (ConvWeightGradNode, at the end).
//
// im2col turns an image x [N, C, H, W] into columns [N, C*kh*kw, OH*OW]: row (c, i, j) of
// image n holds, for every output position, the input value under kernel tap (i, j) of
// channel c (zero where the tap falls into padding). A convolution is then one GEMM per
// image with the weight viewed as [O, C*kh*kw], and its output is already in NCHW order.
//
// col2im adds columns back into an image (the gradient of im2col). Each task owns whole
// (n, c) planes and adds the taps of a plane in a fixed order (i, j, output row, output
// column), so no two tasks write the same element and the sums do not depend on the
// thread count.

#include <algorithm>
#include <cstdint>
#include <string>
#include <type_traits>

// ---- begin lazytensor/graph/window.hpp ----
// The geometry of a 2-D window sliding over [H, W] planes (Window2d), which the pooling and
// im2col kernels run over, and the (height, width) size pairs it is printed with (Size2,
// also the argument type of conv and pool: libtorch's ExpandingArray<2>). Argument checks
// that build a Window2d from user arguments are in ops/window.hpp.

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>


namespace lazy {

/// A (height, width) pair: `3` means {3, 3}, `{3, 2}` means height 3 and width 2, as
/// libtorch's ExpandingArray<2> (kernel sizes, strides, paddings, dilations).
struct Size2 {
  std::int64_t h = 0;
  std::int64_t w = 0;
  /// The same value for both dimensions.
  Size2(std::int64_t v) : h(v), w(v) {}  // NOLINT(google-explicit-constructor): `stride = 2`
  /// Height and width.
  Size2(std::int64_t height, std::int64_t width) : h(height), w(width) {}
  /// "(h, w)", for error messages.
  std::string str() const { return "(" + std::to_string(h) + ", " + std::to_string(w) + ")"; }
  friend bool operator==(const Size2&, const Size2&) = default;
};

namespace graph {

/// Where a 2-D window lands: output position (oy, ox) reads input rows
/// oy * sh - ph + i * dh (i < kh) and columns ox * sw - pw + j * dw (j < kw) of an h x w
/// plane; positions outside the plane are padding.
struct Window2d {
  std::int64_t kh = 1, kw = 1;  ///< kernel
  std::int64_t sh = 1, sw = 1;  ///< stride
  std::int64_t ph = 0, pw = 0;  ///< padding
  std::int64_t dh = 1, dw = 1;  ///< dilation
  std::int64_t h = 0, w = 0;    ///< input plane
  std::int64_t oh = 0, ow = 0;  ///< output plane

  /// Fills oh/ow (torch's floor formula, no ceil_mode); the caller validated that the
  /// dilated kernel fits the padded input.
  void set_output_size();
  /// Output columns [first, last) whose kernel column j reads inside the plane.
  std::pair<std::int64_t, std::int64_t> valid_columns(std::int64_t j) const {
    return valid_range(pw - j * dw, w, sw, ow);
  }
  /// Output rows [first, last) whose kernel row i reads inside the plane.
  std::pair<std::int64_t, std::int64_t> valid_rows(std::int64_t i) const {
    return valid_range(ph - i * dh, h, sh, oh);
  }
  /// Folds every field into a structural hash.
  std::uint64_t hash(std::uint64_t seed) const;
  /// "kernel=(3, 3), stride=(1, 1), padding=(1, 1), dilation=(1, 1)", for graph dumps.
  std::string str() const;

 private:
  // Outputs o in [0, count) with 0 <= o * stride - shift < size.
  static std::pair<std::int64_t, std::int64_t> valid_range(std::int64_t shift, std::int64_t size,
                                                           std::int64_t stride,
                                                           std::int64_t count);
};

}  // namespace graph

}  // namespace lazy

#if LAZYTENSOR_HEADER_DEFINITIONS
namespace lazy::graph {

LAZYTENSOR_INLINE void Window2d::set_output_size() {
  oh = (h + 2 * ph - dh * (kh - 1) - 1) / sh + 1;
  ow = (w + 2 * pw - dw * (kw - 1) - 1) / sw + 1;
}

LAZYTENSOR_INLINE std::uint64_t Window2d::hash(std::uint64_t seed) const {
  for (std::int64_t v : {kh, kw, sh, sw, ph, pw, dh, dw, h, w})
    seed = hash_combine(seed, static_cast<std::uint64_t>(v));
  return seed;
}

LAZYTENSOR_INLINE std::string Window2d::str() const {
  return "kernel=" + Size2(kh, kw).str() + ", stride=" + Size2(sh, sw).str() +
         ", padding=" + Size2(ph, pw).str() + ", dilation=" + Size2(dh, dw).str();
}

LAZYTENSOR_INLINE std::pair<std::int64_t, std::int64_t> Window2d::valid_range(std::int64_t shift,
  std::int64_t size,
  std::int64_t stride,
  std::int64_t count) {
  const std::int64_t first = shift <= 0 ? 0 : (shift + stride - 1) / stride;
  const std::int64_t top = size - 1 + shift;  // o * stride <= top
  const std::int64_t last = top < 0 ? 0 : std::min(count, top / stride + 1);
  return {std::min(first, last), last};
}

}  // namespace lazy::graph
#endif  // LAZYTENSOR_HEADER_DEFINITIONS
// ---- end lazytensor/graph/window.hpp ----

namespace lazy::graph {

namespace detail {

/// The kh*kw column rows of one channel plane `x` (h x w) into `rows` ([kh*kw, oh*ow]).
template <class T>
void im2col_plane(const T* x, T* rows, const Window2d& g) {
  const std::int64_t L = g.oh * g.ow;
  for (std::int64_t i = 0; i < g.kh; ++i) {
    const auto [y0, y1] = g.valid_rows(i);
    for (std::int64_t j = 0; j < g.kw; ++j) {
      T* row = rows + (i * g.kw + j) * L;
      const auto [x0, x1] = g.valid_columns(j);
      std::fill(row, row + y0 * g.ow, T(0));
      for (std::int64_t oy = y0; oy < y1; ++oy) {
        T* out = row + oy * g.ow;
        std::fill(out, out + x0, T(0));
        std::fill(out + x1, out + g.ow, T(0));
        if (x0 == x1) continue;  // (src below would point outside the plane)
        const T* src = x + (oy * g.sh - g.ph + i * g.dh) * g.w + (x0 * g.sw - g.pw + j * g.dw);
        if (g.sw == 1) {
          std::copy(src, src + (x1 - x0), out + x0);
        } else {
          for (std::int64_t ox = x0; ox < x1; ++ox) out[ox] = src[(ox - x0) * g.sw];
        }
      }
      std::fill(row + y1 * g.ow, row + L, T(0));
    }
  }
}

/// Adds the kh*kw column rows `rows` ([kh*kw, oh*ow]) of one channel into plane `x`
/// (h x w), which the caller zeroed.
template <class T>
void col2im_plane(const T* rows, T* x, const Window2d& g) {
  const std::int64_t L = g.oh * g.ow;
  for (std::int64_t i = 0; i < g.kh; ++i) {
    const auto [y0, y1] = g.valid_rows(i);
    for (std::int64_t j = 0; j < g.kw; ++j) {
      const T* row = rows + (i * g.kw + j) * L;
      const auto [x0, x1] = g.valid_columns(j);
      if (x0 == x1) continue;
      for (std::int64_t oy = y0; oy < y1; ++oy) {
        const T* in = row + oy * g.ow;
        T* dst = x + (oy * g.sh - g.ph + i * g.dh) * g.w + (x0 * g.sw - g.pw + j * g.dw);
        if (g.sw == 1) {
          for (std::int64_t ox = x0; ox < x1; ++ox) dst[ox - x0] += in[ox];
        } else {
          for (std::int64_t ox = x0; ox < x1; ++ox) dst[(ox - x0) * g.sw] += in[ox];
        }
      }
    }
  }
}

/// Tasks for `planes` independent planes of `per_plane` elements each costing `cost`.
inline std::int64_t plane_tasks(ThreadPool& pool, std::int64_t planes, std::int64_t per_plane,
                                double cost) {
  return std::max<std::int64_t>(1, std::min(planes, task_count(pool, planes * per_plane, cost)));
}

}  // namespace detail

/// Columns [N, C*kh*kw, OH*OW] of images [N, C, H, W] (see the header comment).
template <class T>
class Im2colNode final : public Node {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, double>,
                "im2col runs on float or double");

 public:
  Im2colNode(NodePtr x, const Window2d& g)
      : Node(NodeKind::Copy, dtype_of<T>(),
             Shape{x->shape()[0], x->shape()[1] * g.kh * g.kw, g.oh * g.ow}, x->device(), {x}),
        g_(g) {}
  std::string op_name() const override { return "im2col"; }
  std::string describe() const override { return "im2col(%0, " + g_.str() + ")"; }
  std::uint64_t structural_hash() const override { return g_.hash(Node::structural_hash()); }

 protected:
  void compute(ExecContext& ctx) override {
    const T* x = inputs()[0]->template data<T>();
    const std::int64_t planes = shape()[0] * inputs()[0]->shape()[1];
    auto buf = allocate_output(ctx, false);
    T* cols = static_cast<T*>(buf->data());
    const std::int64_t in_plane = g_.h * g_.w, out_plane = g_.kh * g_.kw * g_.oh * g_.ow;
    auto& pool = ctx.device.threads();
    const std::int64_t tasks = detail::plane_tasks(pool, planes, out_plane, 1.0);
    pool.parallel_for(tasks, [&](std::int64_t t) {
      auto [p0, p1] = task_range(planes, tasks, t);
      for (std::int64_t p = p0; p < p1; ++p)
        detail::im2col_plane(x + p * in_plane, cols + p * out_plane, g_);
    });
    set_buffer(std::move(buf));
  }

 private:
  Window2d g_;
};

/// Images [N, C, H, W] summed from columns [N, C*kh*kw, OH*OW] (the adjoint of im2col).
template <class T>
class Col2imNode final : public Node {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, double>,
                "col2im runs on float or double");

 public:
  Col2imNode(NodePtr cols, Shape image, const Window2d& g)
      : Node(NodeKind::Copy, dtype_of<T>(), image, cols->device(), {cols}), g_(g) {}
  std::string op_name() const override { return "col2im"; }
  std::string describe() const override { return "col2im(%0, " + g_.str() + ")"; }
  std::uint64_t structural_hash() const override { return g_.hash(Node::structural_hash()); }
  double cost_per_element() const override {
    return std::max(
        1.0, static_cast<double>(g_.kh * g_.kw * g_.oh * g_.ow) / static_cast<double>(g_.h * g_.w));
  }

 protected:
  void compute(ExecContext& ctx) override {
    const T* cols = inputs()[0]->template data<T>();
    const std::int64_t planes = shape()[0] * shape()[1];
    auto buf = allocate_output(ctx, false);
    T* x = static_cast<T*>(buf->data());
    const std::int64_t in_plane = g_.kh * g_.kw * g_.oh * g_.ow, out_plane = g_.h * g_.w;
    auto& pool = ctx.device.threads();
    const std::int64_t tasks =
        detail::plane_tasks(pool, planes, out_plane, cost_per_element());
    pool.parallel_for(tasks, [&](std::int64_t t) {
      auto [p0, p1] = task_range(planes, tasks, t);
      for (std::int64_t p = p0; p < p1; ++p) {
        T* plane = x + p * out_plane;
        std::fill(plane, plane + out_plane, T(0));
        detail::col2im_plane(cols + p * in_plane, plane, g_);
      }
    });
    set_buffer(std::move(buf));
  }

 private:
  Window2d g_;
};

/// The weight gradient of a convolution: dW [O, K] = sum over n of G[n] [O, L] x cols[n]^T,
/// with G [N, O, L] and cols [N, K, L]. The transposes are read through (Eigen layouts) and
/// the images are added in order. dW is computed in blocks of kBlock columns, each with its
/// own GEMM calls (which pack only that block's rows of cols); tasks take whole blocks. The
/// blocks depend on K only: Eigen's kernels sum in an order that depends on the shape of the
/// call, so splitting by thread count would change the bits.
template <class T>
class ConvWeightGradNode final : public Node {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, double>,
                "conv weight gradients run on float or double");

 public:
  static constexpr std::int64_t kBlock = 64;

  ConvWeightGradNode(NodePtr g, NodePtr cols)
      : Node(NodeKind::Gemm, dtype_of<T>(), Shape{g->shape()[1], cols->shape()[1]}, g->device(),
             {g, cols}) {}
  std::string op_name() const override { return "conv2d_weight_grad"; }
  double cost_per_element() const override {
    return 2.0 * static_cast<double>(inputs()[0]->shape()[0] * inputs()[0]->shape()[2]);
  }

 protected:
  void compute(ExecContext& ctx) override {
    const T* g = inputs()[0]->template data<T>();
    const T* cols = inputs()[1]->template data<T>();
    const std::int64_t N = inputs()[0]->shape()[0], O = shape()[0], K = shape()[1],
                       L = inputs()[0]->shape()[2];
    auto buf = allocate_output(ctx, false);
    T* out = static_cast<T*>(buf->data());
    const std::int64_t blocks = (K + kBlock - 1) / kBlock;
    auto& pool = ctx.device.threads();
    const std::int64_t tasks =
        std::max<std::int64_t>(1, std::min(blocks, task_count(pool, O * K, cost_per_element(), 1)));
    pool.parallel_for(tasks, [&](std::int64_t t) {
      auto [b0, b1] = task_range(blocks, tasks, t);
      for (std::int64_t blk = b0; blk < b1; ++blk) {
        const std::int64_t k0 = blk * kBlock, k1 = std::min(K, k0 + kBlock);
        for (std::int64_t o = 0; o < O; ++o) std::fill(out + o * K + k0, out + o * K + k1, T(0));
        for (std::int64_t n = 0; n < N; ++n) {
          detail::eigen_gemm_add_nt(g + n * O * L, cols + (n * K + k0) * L, out + k0, O, k1 - k0, L, K);
        }
      }
    });
    set_buffer(std::move(buf));
  }
};

}  // namespace lazy::graph
// ---- end lazytensor/graph/im2col.hpp ----
// ---- begin lazytensor/ops/window.hpp ----
// Argument checks shared by convolution and pooling: an NCHW input, positive strides and
// dilations, and the validated geometry (graph::Window2d) of a kernel over the input's
// planes. Window2d and the Size2 argument pairs are in graph/window.hpp.

#include <cstdint>
#include <string>


namespace lazy {

namespace detail {

/// "(a x b)", as torch prints plane sizes in conv/pool errors.
inline std::string plane_str(std::int64_t a, std::int64_t b) {
  return "(" + std::to_string(a) + " x " + std::to_string(b) + ")";
}

/// ShapeError unless x is [N, C, H, W] with C, H, W > 0 (N may be 0).
void check_nchw(const Shape& s, const char* op, const char* what);

/// ShapeError unless stride and dilation are positive and padding is not negative.
void check_window_args(const char* op, Size2 stride, Size2 padding, Size2 dilation);

/// The geometry of a kernel sliding over the planes of `image` ([N, C, H, W]), validated:
/// the dilated kernel must fit the padded input.
graph::Window2d window_over(const char* op, const Shape& image, Size2 kernel, Size2 stride,
                                   Size2 padding, Size2 dilation);

}  // namespace detail

}  // namespace lazy

#if LAZYTENSOR_HEADER_DEFINITIONS
namespace lazy::detail {

LAZYTENSOR_INLINE void check_nchw(const Shape& s, const char* op, const char* what) {
  if (s.rank() != 4) {
    throw ShapeError(std::string(op) + ": expected a 4-D " + what + " [N, C, H, W], got shape " +
                     s.str() + " (rank " + std::to_string(s.rank()) + ")");
  }
  if (s[1] == 0 || s[2] == 0 || s[3] == 0) {
    throw ShapeError(std::string(op) + ": expected non-zero channels, height and width in the " +
                     what + " [N, C, H, W], got shape " + s.str());
  }
}

LAZYTENSOR_INLINE void check_window_args(const char* op, Size2 stride, Size2 padding, Size2 dilation) {
  if (stride.h <= 0 || stride.w <= 0) {
    throw ShapeError(std::string(op) + ": expected a positive stride, got " + stride.str());
  }
  if (dilation.h <= 0 || dilation.w <= 0) {
    throw ShapeError(std::string(op) + ": expected a positive dilation, got " + dilation.str());
  }
  if (padding.h < 0 || padding.w < 0) {
    throw ShapeError(std::string(op) + ": expected a non-negative padding, got " + padding.str());
  }
}

LAZYTENSOR_INLINE graph::Window2d window_over(const char* op,
    const Shape& image,
    Size2 kernel,
    Size2 stride,
    Size2 padding,
    Size2 dilation) {
  if (kernel.h <= 0 || kernel.w <= 0) {
    throw ShapeError(std::string(op) + ": expected a positive kernel size, got " + kernel.str());
  }
  check_window_args(op, stride, padding, dilation);
  graph::Window2d g{kernel.h,   kernel.w,   stride.h, stride.w, padding.h, padding.w,
                    dilation.h, dilation.w, image[2], image[3], 0,         0};
  const std::int64_t eh = g.dh * (g.kh - 1) + 1, ew = g.dw * (g.kw - 1) + 1;
  if (g.h + 2 * g.ph < eh || g.w + 2 * g.pw < ew) {
    throw ShapeError(std::string(op) +
                     ": kernel size can't be greater than the padded input size: padded input " +
                     plane_str(g.h + 2 * g.ph, g.w + 2 * g.pw) + " (input " + image.str() +
                     ", padding " + padding.str() + "), dilated kernel " + plane_str(eh, ew) +
                     " (kernel " + kernel.str() + ", dilation " + dilation.str() + ")");
  }
  g.set_output_size();
  return g;
}

}  // namespace lazy::detail
#endif  // LAZYTENSOR_HEADER_DEFINITIONS
// ---- end lazytensor/ops/window.hpp ----

namespace lazy {

namespace detail {

/// Columns [N, C*kh*kw, OH*OW] of `x`, with col2im as backward.
template <class T>
Tensor<T> im2col(const Tensor<T>& x, const graph::Window2d& g) {
  Tensor<T> cols(graph::submit(std::make_shared<graph::Im2colNode<T>>(x.node(), g)));
  autograd::record(cols, "Im2ColBackward0", {autograd::edge_of(x.impl())},
                   [g, image = x.shape()](const Tensor<T>& gc) {
                     return std::vector<graph::NodePtr>{graph::submit(
                         std::make_shared<graph::Col2imNode<T>>(gc.node(), image, g))};
                   });
  return cols;
}

/// Images of shape `image` summed from columns, with im2col as backward.
template <class T>
Tensor<T> col2im(const Tensor<T>& cols, const Shape& image, const graph::Window2d& g) {
  Tensor<T> x(graph::submit(std::make_shared<graph::Col2imNode<T>>(cols.node(), image, g)));
  autograd::record(x, "Col2ImBackward0", {autograd::edge_of(cols.impl())},
                   [g](const Tensor<T>& gx) {
                     return std::vector<graph::NodePtr>{
                         graph::submit(std::make_shared<graph::Im2colNode<T>>(gx.node(), g))};
                   });
  return x;
}

/// Backward of y[n] = W x cols[n] (W [O, K], cols [N, K, L]): dW = sum_n G[n] cols[n]^T by
/// ConvWeightGradNode, dcols[n] = W^T G[n] by one GEMM reading W transposed.
template <class T>
void record_conv_gemm(Tensor<T>& y, const Tensor<T>& w, const Tensor<T>& cols) {
  auto ew = autograd::edge_of(w.impl()), ec = autograd::edge_of(cols.impl());
  autograd::record(
      y, "ConvolutionBackward0", {ew, ec},
      [w = w.detach(), cols = cols.detach(), need_w = ew != nullptr,
       need_c = ec != nullptr](const Tensor<T>& g) {
        const std::int64_t N = cols.size(0), K = cols.size(1), L = cols.size(2), O = w.size(0);
        std::vector<graph::NodePtr> grads(2);
        if (need_w) {
          grads[0] =
              graph::submit(std::make_shared<graph::ConvWeightGradNode<T>>(g.node(), cols.node()));
        }
        if (need_c) grads[1] = gemm(transpose(w, 0, 1), g, 1, N, K, O, L, Shape{N, K, L}).node();
        return grads;
      });
}

/// True for a window that reads every input element once, in order (1x1, stride 1, no
/// padding): the image [N, C, H, W] is then its own column matrix [N, C, H*W].
inline bool identity_window(const graph::Window2d& g) {
  return g.kh == 1 && g.kw == 1 && g.sh == 1 && g.sw == 1 && g.ph == 0 && g.pw == 0;
}

template <class T>
Tensor<T> conv2d_impl(const Tensor<T>& x, const Tensor<T>& weight, const Tensor<T>& bias,
                      Size2 stride, Size2 padding, Size2 dilation) {
  const Shape& xs = x.shape();
  const Shape& ws = weight.shape();
  check_nchw(xs, "conv2d", "input");
  if (ws.rank() != 4 || ws[0] == 0 || ws[1] == 0) {
    throw ShapeError("conv2d: expected a 4-D weight [out_channels, in_channels, kH, kW] with " +
                     std::string("non-zero channels, got shape ") + ws.str());
  }
  if (xs[1] != ws[1]) {
    throw ShapeError("conv2d: weight of shape " + ws.str() +
                     " expects input [N, C, H, W] with C = " + std::to_string(ws[1]) +
                     " channels, but got input of shape " + xs.str() + " with " +
                     std::to_string(xs[1]) + " channels");
  }
  if (bias.defined() && (bias.dim() != 1 || bias.size(0) != ws[0])) {
    throw ShapeError("conv2d: expected bias of shape (" + std::to_string(ws[0]) +
                     ",) for weight of shape " + ws.str() + ", got bias of shape " +
                     bias.shape().str());
  }
  const graph::Window2d g =
      window_over("conv2d", xs, Size2(ws[2], ws[3]), stride, padding, dilation);
  std::vector<graph::NodePtr> nodes{x.node(), weight.node()};
  if (bias.defined()) nodes.push_back(bias.node());
  graph::common_device(nodes, "conv2d");

  const std::int64_t N = xs[0], C = xs[1], O = ws[0], K = C * g.kh * g.kw, L = g.oh * g.ow;
  const Shape out{N, O, g.oh, g.ow};
  if (N == 0) {
    // No image: nothing to compute, and zero gradients (GemmNode needs a batch of >= 1).
    Tensor<T> y = zeros<T>(out, x.device());
    std::vector<autograd::GradFnPtr> edges{autograd::edge_of(x.impl()),
                                           autograd::edge_of(weight.impl())};
    std::vector<Shape> shapes{xs, ws};
    if (bias.defined()) {
      edges.push_back(autograd::edge_of(bias.impl()));
      shapes.push_back(bias.shape());
    }
    autograd::record(y, "ConvolutionBackward0", std::move(edges),
                     [shapes, dev = x.device()](const Tensor<T>&) {
                       std::vector<graph::NodePtr> grads;
                       for (const auto& s : shapes) grads.push_back(zeros<T>(s, dev).node());
                       return grads;
                     });
    return y;
  }
  Tensor<T> cols = identity_window(g) ? reshape(x, Shape{N, C, L}) : im2col(x, g);
  // A = weight [O, K] shared by every image (batch 1), B = cols[n] [K, L].
  Tensor<T> w2 = reshape(weight, Shape{O, K});
  Tensor<T> y = [&] {
    autograd::AutoGradMode off(false);  // recorded below, with the convolution's own rule
    return gemm(w2, cols, 1, N, O, K, L, Shape{N, O, L});
  }();
  record_conv_gemm(y, w2, cols);
  if (bias.defined()) y = y + reshape(bias, Shape{O, 1});
  return reshape(y, out);
}

}  // namespace detail

/// 2-D convolution (torch::nn::functional::conv2d with groups = 1): input [N, C, H, W],
/// weight [O, C, kH, kW], optional bias [O] (pass `{}` for none); returns
/// [N, O, OH, OW] with OH = (H + 2 * padding.h - dilation.h * (kH - 1) - 1) / stride.h + 1.
/// Padding is zeros. float and double; bfloat16 is computed in float and rounded once, as
/// are float operands under autocast (AutocastGuard).
/// ShapeError for ranks other than 4, a channel or bias size mismatch, a non-positive
/// stride or dilation, negative padding, or a dilated kernel larger than the padded input.
template <expr::ExprLike X>
Tensor<expr::value_t<X>> conv2d(const X& input, const Tensor<expr::value_t<X>>& weight,
                                const Tensor<expr::value_t<X>>& bias = {}, Size2 stride = 1,
                                Size2 padding = 0, Size2 dilation = 1) {
  using T = expr::value_t<X>;
  if constexpr (!is_floating_v<T>) {
    throw DTypeError("conv2d: expected a floating tensor (float, double or bfloat16), got " +
                     dtype_name(dtype_of<T>()));
  } else {
    Tensor<T> x = detail::as_tensor(input);
    if constexpr (std::is_same_v<T, bfloat16>) {
      Tensor<float> xf = cast<float>(x), wf = cast<float>(weight), bf;
      if (bias.defined()) bf = cast<float>(bias);
      return Tensor<bfloat16>(
          cast<bfloat16>(detail::conv2d_impl(xf, wf, bf, stride, padding, dilation)));
    } else {
      if constexpr (std::is_same_v<T, float>) {
        if (is_autocast_enabled()) {
          AutocastGuard off(false);
          Tensor<float> br;
          if (bias.defined()) br = detail::round_to_bf16(bias);
          return detail::round_to_bf16(detail::conv2d_impl(detail::round_to_bf16(x), detail::round_to_bf16(weight),
                                                           br, stride, padding, dilation));
        }
      }
      return detail::conv2d_impl(x, weight, bias, stride, padding, dilation);
    }
  }
}

/// Sliding local blocks of a batch of images (torch::nn::functional::unfold, i.e. im2col):
/// [N, C, H, W] -> [N, C * kH * kW, L], L = OH * OW output positions, zeros for padding.
/// float and double. ShapeError as conv2d.
template <Element T>
Tensor<T> unfold(const Tensor<T>& input, Size2 kernel_size, Size2 dilation = 1, Size2 padding = 0,
                 Size2 stride = 1) {
  if constexpr (!std::is_same_v<T, float> && !std::is_same_v<T, double>) {
    throw DTypeError("unfold: expected a float or double tensor, got " + dtype_name(dtype_of<T>()));
  } else {
    detail::check_nchw(input.shape(), "unfold", "input");
    const auto g =
        detail::window_over("unfold", input.shape(), kernel_size, stride, padding, dilation);
    return detail::im2col(input, g);
  }
}

/// Sums sliding local blocks into images (torch::nn::functional::fold, i.e. col2im, the
/// adjoint of unfold): [N, C * kH * kW, L] -> [N, C, output_size.h, output_size.w], where
/// L must be the number of block positions in the output. float and double.
template <Element T>
Tensor<T> fold(const Tensor<T>& input, Size2 output_size, Size2 kernel_size, Size2 dilation = 1,
               Size2 padding = 0, Size2 stride = 1) {
  if constexpr (!std::is_same_v<T, float> && !std::is_same_v<T, double>) {
    throw DTypeError("fold: expected a float or double tensor, got " + dtype_name(dtype_of<T>()));
  } else {
    const Shape& s = input.shape();
    if (s.rank() != 3)
      throw ShapeError("fold: expected a 3-D input [N, C * kH * kW, L], got shape " + s.str());
    if (kernel_size.h <= 0 || kernel_size.w <= 0) {
      throw ShapeError("fold: expected a positive kernel size, got " + kernel_size.str());
    }
    if (output_size.h <= 0 || output_size.w <= 0) {
      throw ShapeError("fold: expected a positive output size, got " + output_size.str());
    }
    const std::int64_t kk = kernel_size.h * kernel_size.w;
    if (s[1] == 0 || s[1] % kk != 0) {
      throw ShapeError("fold: expected size(1) of the input " + s.str() +
                       " to be a non-zero multiple of kH * kW = " + std::to_string(kk));
    }
    const Shape image{s[0], s[1] / kk, output_size.h, output_size.w};
    const auto g = detail::window_over("fold", image, kernel_size, stride, padding, dilation);
    if (s[2] != g.oh * g.ow) {
      throw ShapeError("fold: expected input.size(2) = " + std::to_string(g.oh * g.ow) +
                       " blocks (" + detail::plane_str(g.oh, g.ow) + " for output size " +
                       output_size.str() + ", kernel " + kernel_size.str() + ", dilation " +
                       dilation.str() + ", padding " + padding.str() + ", stride " + stride.str() +
                       "), got input of shape " + s.str());
    }
    return detail::col2im(input, image, g);
  }
}

}  // namespace lazy
// ---- end lazytensor/ops/conv.hpp ----

namespace lazy::nn {

/// Options of Conv2d (torch::nn::Conv2dOptions): `Conv2dOptions(1, 32, 3).padding(1)`.
struct Conv2dOptions {
  /// in_channels -> out_channels with a kernel_size window (`3` or `{3, 5}`).
  Conv2dOptions(std::int64_t in_channels, std::int64_t out_channels, Size2 kernel_size)
      : in_channels_(in_channels), out_channels_(out_channels), kernel_size_(kernel_size) {}
  LAZY_ARG(std::int64_t, in_channels);
  LAZY_ARG(std::int64_t, out_channels);
  LAZY_ARG(Size2, kernel_size);
  /// Step of the window.
  LAZY_ARG(Size2, stride) = 1;
  /// Zeros added on each side of the input.
  LAZY_ARG(Size2, padding) = 0;
  /// Spacing between kernel taps.
  LAZY_ARG(Size2, dilation) = 1;
  /// Whether the layer has a learned bias.
  LAZY_ARG(bool, bias) = true;
};

/// A 2-D convolution: [N, in, H, W] -> [N, out, OH, OW]; `weight` is [out, in, kH, kW],
/// `bias` [out] (undefined without bias).
class Conv2dImpl : public Module {
 public:
  /// Conv2d(in_channels, out_channels, kernel_size) with default options.
  template <class = void>
  Conv2dImpl(std::int64_t in_channels, std::int64_t out_channels, Size2 kernel_size);

  /// ShapeError for non-positive channels, kernel size, stride or dilation, or a negative
  /// padding.
  template <class = void>
  explicit Conv2dImpl(const Conv2dOptions& options_);

  /// x [N, in_channels, H, W] -> [N, out_channels, OH, OW]; ShapeError (from conv2d) for
  /// another rank or channel count, or an input smaller than the dilated kernel.
  template <FloatingElement T>
  Tensor<T> forward(const Tensor<T>& x) const;
  /// The same on a pending expression.
  template <expr::Pending E>
  auto forward(const E& x) const {
    return forward(lazy::eval(x));
  }

  /// PyTorch's repr: `Conv2d(1, 32, kernel_size=(3, 3), stride=(1, 1), padding=(1, 1))`
  /// (padding, dilation and bias shown only when not the default).
  void pretty_print(std::ostream& os) const override;

  /// The options the layer was built with.
  const Conv2dOptions options;
  /// [out_channels, in_channels, kH, kW].
  Tensor<float> weight;
  /// [out_channels], or undefined.
  Tensor<float> bias;
};
LAZY_MODULE(Conv2d);

// (Outside the class, so not inline: see core/config.hpp.)
template <class>
Conv2dImpl::Conv2dImpl(std::int64_t in_channels, std::int64_t out_channels, Size2 kernel_size)
    : Conv2dImpl(Conv2dOptions(in_channels, out_channels, kernel_size)) {}

template <class>
Conv2dImpl::Conv2dImpl(const Conv2dOptions& options_) : Module("Conv2d"), options(options_) {
  const auto& o = options;
  if (o.in_channels() <= 0 || o.out_channels() <= 0) {
    throw ShapeError("Conv2d: expected positive in_channels and out_channels, got " +
                     std::to_string(o.in_channels()) + " and " +
                     std::to_string(o.out_channels()));
  }
  if (o.kernel_size().h <= 0 || o.kernel_size().w <= 0) {
    throw ShapeError("Conv2d: expected a positive kernel_size, got " + o.kernel_size().str());
  }
  lazy::detail::check_window_args("Conv2d", o.stride(), o.padding(), o.dilation());

  weight = register_parameter("weight", empty<float>({o.out_channels(), o.in_channels(),
                                                      o.kernel_size().h, o.kernel_size().w}));
  init::kaiming_uniform_(weight, std::sqrt(5.0));
  if (o.bias()) {
    bias = register_parameter("bias", empty<float>({o.out_channels()}));
    const double fan_in =
        static_cast<double>(o.in_channels() * o.kernel_size().h * o.kernel_size().w);
    const double bound = 1.0 / std::sqrt(fan_in);
    init::uniform_(bias, -bound, bound);
  }
}

template <FloatingElement T>
Tensor<T> Conv2dImpl::forward(const Tensor<T>& x) const {
  return conv2d(x, detail::param_as<T>(weight, *this), detail::param_as<T>(bias, *this), options.stride(),
                options.padding(), options.dilation());
}

#if LAZYTENSOR_HEADER_DEFINITIONS
LAZYTENSOR_INLINE void Conv2dImpl::pretty_print(std::ostream& os) const {
  const auto& o = options;
  os << "Conv2d(" << o.in_channels() << ", " << o.out_channels()
     << ", kernel_size=" << o.kernel_size().str() << ", stride=" << o.stride().str();
  if (!(o.padding() == Size2(0))) os << ", padding=" << o.padding().str();
  if (!(o.dilation() == Size2(1))) os << ", dilation=" << o.dilation().str();
  if (!o.bias()) os << ", bias=False";
  os << ")";
}
#endif  // LAZYTENSOR_HEADER_DEFINITIONS

}  // namespace lazy::nn

// Instantiated once in the compiled runtime (core/config.hpp).
#define LAZYTENSOR_NN_CONV_INSTANCES(P)                                                     \
  P template lazy::nn::Conv2dImpl::Conv2dImpl(std::int64_t, std::int64_t, lazy::Size2);    \
  P template lazy::nn::Conv2dImpl::Conv2dImpl(const lazy::nn::Conv2dOptions&);
#define LAZYTENSOR_NN_CONV_FORWARD_INSTANCES(P, T) \
  P template lazy::Tensor<T> lazy::nn::Conv2dImpl::forward<T>(const lazy::Tensor<T>&) const;
#if LAZYTENSOR_EXPLICIT_INSTANTIATION
LAZYTENSOR_NN_CONV_INSTANCES(extern)
LAZYTENSOR_FOR_FLOATING(LAZYTENSOR_NN_CONV_FORWARD_INSTANCES, extern)
#endif
// ---- end lazytensor/nn/conv.hpp ----
// ---- begin lazytensor/nn/embedding.hpp ----
// nn::Embedding: a lookup table of num_embeddings vectors (initialized N(0, 1) as torch).

#include <cstdint>
#include <string>


namespace lazy::nn {

/// Maps integer indices to learned vectors.
class EmbeddingImpl : public Module {
 public:
  template <class = void>
  EmbeddingImpl(std::int64_t num_embeddings, std::int64_t embedding_dim);
  /// indices of any shape -> indices.shape + [embedding_dim]. Out-of-range indices raise
  /// IndexError when computed.
  template <FloatingElement T = float, IndexElement I>
  Tensor<T> forward(const Tensor<I>& indices) const;
  void pretty_print(std::ostream& os) const override;

  Tensor<float> weight;

 private:
  std::int64_t n_, d_;
};
LAZY_MODULE(Embedding);

// (Outside the class, so not inline: see core/config.hpp.)
template <class>
EmbeddingImpl::EmbeddingImpl(std::int64_t num_embeddings, std::int64_t embedding_dim)
    : Module("Embedding"), n_(num_embeddings), d_(embedding_dim) {
  if (num_embeddings <= 0 || embedding_dim <= 0) {
    throw ShapeError("Embedding: expected positive sizes, got " + std::to_string(num_embeddings) + " and " +
                     std::to_string(embedding_dim));
  }
  weight = register_parameter("weight", empty<float>({num_embeddings, embedding_dim}));
  init::normal_(weight);
}

template <FloatingElement T, IndexElement I>
Tensor<T> EmbeddingImpl::forward(const Tensor<I>& indices) const {
  Shape out = indices.shape();
  out.push_back(d_);
  return reshape(index_select(detail::param_as<T>(weight, *this), 0, reshape(indices, Shape{indices.numel()})), out);
}

#if LAZYTENSOR_HEADER_DEFINITIONS
LAZYTENSOR_INLINE void EmbeddingImpl::pretty_print(std::ostream& os) const {
  os << "Embedding(" << n_ << ", " << d_ << ")";
}
#endif  // LAZYTENSOR_HEADER_DEFINITIONS

}  // namespace lazy::nn

// Instantiated once in the compiled runtime (core/config.hpp).
#define LAZYTENSOR_NN_EMBEDDING_INSTANCES(P) \
  P template lazy::nn::EmbeddingImpl::EmbeddingImpl(std::int64_t, std::int64_t);
#define LAZYTENSOR_NN_EMBEDDING_FORWARD_INSTANCES(P, T)                                                           \
  P template lazy::Tensor<T> lazy::nn::EmbeddingImpl::forward<T, std::int32_t>(const lazy::Tensor<std::int32_t>&) \
      const;                                                                                                     \
  P template lazy::Tensor<T> lazy::nn::EmbeddingImpl::forward<T, std::int64_t>(const lazy::Tensor<std::int64_t>&) \
      const;
#if LAZYTENSOR_EXPLICIT_INSTANTIATION
LAZYTENSOR_NN_EMBEDDING_INSTANCES(extern)
LAZYTENSOR_FOR_FLOATING(LAZYTENSOR_NN_EMBEDDING_FORWARD_INSTANCES, extern)
#endif
// ---- end lazytensor/nn/embedding.hpp ----
// ---- begin lazytensor/nn/linear.hpp ----
// nn::Linear: y = x W^T + b, initialized as PyTorch does (kaiming uniform with a = sqrt(5),
// i.e. U(-1/sqrt(in), 1/sqrt(in)) for both weight and bias).

#include <cmath>
#include <cstdint>
#include <string>


namespace lazy::nn {

/// A fully connected layer.
class LinearImpl : public Module {
 public:
  /// in_features -> out_features, with a bias unless `bias` is false.
  template <class = void>
  LinearImpl(std::int64_t in_features, std::int64_t out_features, bool bias = true);

  /// x [..., in_features] -> [..., out_features], in x's dtype (the layer's, after
  /// to(dtype)); bias and a following element-wise op run on the GEMM's row blocks.
  template <FloatingElement T>
  Tensor<T> forward(const Tensor<T>& x) const;
  /// The same on a pending expression.
  template <expr::Pending E>
  auto forward(const E& x) const {
    return forward(lazy::eval(x));
  }

  void pretty_print(std::ostream& os) const override;

  Tensor<float> weight;
  Tensor<float> bias;

 private:
  std::int64_t in_, out_;
};
LAZY_MODULE(Linear);

// (Outside the class, so not inline: see core/config.hpp.)
template <class>
LinearImpl::LinearImpl(std::int64_t in_features, std::int64_t out_features, bool bias)
    : Module("Linear"), in_(in_features), out_(out_features) {
  if (in_features <= 0 || out_features <= 0) {
    throw ShapeError("Linear: expected positive in_features and out_features, got " + std::to_string(in_features) +
                     " and " + std::to_string(out_features));
  }
  weight = register_parameter("weight", empty<float>({out_features, in_features}));
  init::kaiming_uniform_(weight, std::sqrt(5.0));
  if (bias) {
    this->bias = register_parameter("bias", empty<float>({out_features}));
    const double bound = 1.0 / std::sqrt(static_cast<double>(in_features));
    init::uniform_(this->bias, -bound, bound);
  }
}

template <FloatingElement T>
Tensor<T> LinearImpl::forward(const Tensor<T>& x) const {
  const Tensor<T> w = detail::param_as<T>(weight, *this);
  if (bias.defined()) return linear(x, w, detail::param_as<T>(bias, *this));
  return linear(x, w);
}

#if LAZYTENSOR_HEADER_DEFINITIONS
LAZYTENSOR_INLINE void LinearImpl::pretty_print(std::ostream& os) const {
  os << "Linear(in_features=" << in_ << ", out_features=" << out_ << ", bias=" << (bias.defined() ? "True" : "False")
     << ")";
}
#endif  // LAZYTENSOR_HEADER_DEFINITIONS

}  // namespace lazy::nn

// Instantiated once in the compiled runtime (core/config.hpp).
#define LAZYTENSOR_NN_LINEAR_INSTANCES(P)                                          \
  P template lazy::nn::LinearImpl::LinearImpl(std::int64_t, std::int64_t, bool);
#define LAZYTENSOR_NN_LINEAR_FORWARD_INSTANCES(P, T) \
  P template lazy::Tensor<T> lazy::nn::LinearImpl::forward<T>(const lazy::Tensor<T>&) const;
#if LAZYTENSOR_EXPLICIT_INSTANTIATION
LAZYTENSOR_NN_LINEAR_INSTANCES(extern)
LAZYTENSOR_FOR_FLOATING(LAZYTENSOR_NN_LINEAR_FORWARD_INSTANCES, extern)
#endif
// ---- end lazytensor/nn/linear.hpp ----
// ---- begin lazytensor/nn/normalization.hpp ----
// LayerNorm and BatchNorm1d/2d, as torch.nn. Batch norm keeps running statistics as
// buffers (updated in training, used in eval), with torch's momentum convention and the
// unbiased batch variance in the running estimate.

#include <cstdint>
#include <string>
#include <vector>


namespace lazy::nn {

/// Normalizes over the trailing `normalized_shape` dims, with a learned affine map.
class LayerNormImpl : public Module {
 public:
  template <class = void>
  explicit LayerNormImpl(Shape normalized_shape, double eps = 1e-5, bool elementwise_affine = true);
  template <FloatingElement T>
  Tensor<T> forward(const Tensor<T>& x) const;
  /// The same on a pending expression.
  template <expr::Pending E>
  auto forward(const E& x) const {
    return forward(lazy::eval(x));
  }
  void pretty_print(std::ostream& os) const override;

  Tensor<float> weight, bias;

 private:
  Shape shape_;
  double eps_;
};
LAZY_MODULE(LayerNorm);

// (Outside the class, so not inline: see core/config.hpp.)
template <class>
LayerNormImpl::LayerNormImpl(Shape normalized_shape, double eps, bool elementwise_affine)
    : Module("LayerNorm"), shape_(normalized_shape), eps_(eps) {
  if (elementwise_affine) {
    weight = register_parameter("weight", ones<float>(normalized_shape));
    bias = register_parameter("bias", zeros<float>(normalized_shape));
  }
}

template <FloatingElement T>
Tensor<T> LayerNormImpl::forward(const Tensor<T>& x) const {
  return functional::layer_norm<T>(x, shape_, detail::param_as<T>(weight, *this), detail::param_as<T>(bias, *this),
                                   eps_);
}

/// Batch normalization over the channel dim 1 of [N, C] or [N, C, L] (Rank 1) or
/// [N, C, H, W] (Rank 2) inputs.
template <int Rank>
class BatchNormImpl : public Module {
 public:
  explicit BatchNormImpl(std::int64_t num_features, double eps = 1e-5, double momentum = 0.1, bool affine = true,
                         bool track_running_stats = true);

  /// (F is float: the input is a template-dependent type so that this body, which calls
  /// deduced-type reductions, is compiled only where a batch norm runs.)
  template <FloatingElement T>
  Tensor<T> forward(const Tensor<T>& x);
  /// The same on a pending expression.
  template <expr::Pending E>
  auto forward(const E& x) {
    return forward(lazy::eval(x));
  }

  void pretty_print(std::ostream& os) const override {
    os << name() << "(" << c_ << ", eps=" << eps_ << ", momentum=" << momentum_
       << ", affine=" << (weight.defined() ? "True" : "False") << ")";
  }

  Tensor<float> weight, bias;
  Tensor<float> running_mean, running_var;
  Tensor<std::int64_t> num_batches_tracked;

 private:
  std::int64_t c_;
  double eps_, momentum_;
};

// (Outside the class, so not inline: see core/config.hpp.)
template <int Rank>
BatchNormImpl<Rank>::BatchNormImpl(std::int64_t num_features, double eps, double momentum, bool affine,
                                   bool track_running_stats)
    : Module(Rank == 1 ? "BatchNorm1d" : "BatchNorm2d"), c_(num_features), eps_(eps), momentum_(momentum) {
  if (affine) {
    weight = register_parameter("weight", ones<float>({num_features}));
    bias = register_parameter("bias", zeros<float>({num_features}));
  }
  if (track_running_stats) {
    running_mean = zeros<float>({num_features});
    running_var = ones<float>({num_features});
    num_batches_tracked = zeros<std::int64_t>({});
    register_buffer("running_mean", running_mean);
    register_buffer("running_var", running_var);
    register_buffer("num_batches_tracked", num_batches_tracked);
  }
}

template <int Rank>
template <FloatingElement T>
Tensor<T> BatchNormImpl<Rank>::forward(const Tensor<T>& x) {
  using F = T;
  const int r = x.dim();
  const bool ok = Rank == 1 ? (r == 2 || r == 3) : r == 4;
  if (!ok || x.size(1) != c_) {
    throw ShapeError(name() + ": expected input of shape " +
                     (Rank == 1 ? "(N, " + std::to_string(c_) + ") or (N, " + std::to_string(c_) + ", L)"
                                : "(N, " + std::to_string(c_) + ", H, W)") +
                     ", got " + x.shape().str());
  }
  std::vector<std::int64_t> dims{0};
  for (int d = 2; d < r; ++d) dims.push_back(d);
  Shape stat;  // [1, C, 1, ...]
  for (int d = 0; d < r; ++d) stat.push_back(d == 1 ? c_ : 1);
  Tensor<F> y;
  if (is_training() || !running_mean.defined()) {
    const std::int64_t count = x.numel() / c_;
    if (is_training() && count <= 1) {
      throw Error(name() + ": expected more than 1 value per channel when training, got input " + x.shape().str());
    }
    Tensor<F> mu = mean(x, dims, true);
    Tensor<F> xc = x - mu;
    Tensor<F> var = mean(xc * xc, dims, true);
    y = xc * rsqrt(var + static_cast<compute_t<F>>(eps_));
    if (is_training() && running_mean.defined()) {
      NoGradGuard guard;
      Tensor<F> rm = detail::param_as<F>(running_mean, *this), rv = detail::param_as<F>(running_var, *this);
      const auto m = static_cast<compute_t<F>>(momentum_);
      const auto unbias = static_cast<compute_t<F>>(count) / static_cast<compute_t<F>>(count - 1);
      rm.copy_(rm * (1 - m) + reshape(mu, Shape{c_}) * m);
      rv.copy_(rv * (1 - m) + reshape(var, Shape{c_}) * (m * unbias));
      num_batches_tracked.add_(1);
    }
  } else {
    y = (x - reshape(detail::param_as<F>(running_mean, *this), stat)) *
        rsqrt(reshape(detail::param_as<F>(running_var, *this), stat) + static_cast<compute_t<F>>(eps_));
  }
  if (weight.defined()) {
    y = y * reshape(detail::param_as<F>(weight, *this), stat) + reshape(detail::param_as<F>(bias, *this), stat);
  }
  return y;
}

using BatchNorm1dImpl = BatchNormImpl<1>;
using BatchNorm2dImpl = BatchNormImpl<2>;
LAZY_MODULE(BatchNorm1d);
LAZY_MODULE(BatchNorm2d);

#if LAZYTENSOR_HEADER_DEFINITIONS
LAZYTENSOR_INLINE void LayerNormImpl::pretty_print(std::ostream& os) const {
  os << "LayerNorm(" << shape_.str() << ", eps=" << eps_ << ")";
}
#endif  // LAZYTENSOR_HEADER_DEFINITIONS

}  // namespace lazy::nn

// Instantiated once in the compiled runtime (core/config.hpp).
#define LAZYTENSOR_NN_NORMALIZATION_INSTANCES(P)                                \
  P template lazy::nn::LayerNormImpl::LayerNormImpl(lazy::Shape, double, bool); \
  P template class lazy::nn::BatchNormImpl<1>;                                  \
  P template class lazy::nn::BatchNormImpl<2>;
#define LAZYTENSOR_NN_NORMALIZATION_FORWARD_INSTANCES(P, T)                                             \
  P template lazy::Tensor<T> lazy::nn::LayerNormImpl::forward<T>(const lazy::Tensor<T>&) const;        \
  P template lazy::Tensor<T> lazy::nn::BatchNormImpl<1>::forward<T>(const lazy::Tensor<T>&);           \
  P template lazy::Tensor<T> lazy::nn::BatchNormImpl<2>::forward<T>(const lazy::Tensor<T>&);
#if LAZYTENSOR_EXPLICIT_INSTANTIATION
LAZYTENSOR_NN_NORMALIZATION_INSTANCES(extern)
LAZYTENSOR_FOR_FLOATING(LAZYTENSOR_NN_NORMALIZATION_FORWARD_INSTANCES, extern)
#endif
// ---- end lazytensor/nn/normalization.hpp ----
// ---- begin lazytensor/nn/pooling.hpp ----
// nn::MaxPool2d and nn::AvgPool2d, as torch::nn: parameter-free layers over the functional
// lazy::max_pool2d / lazy::avg_pool2d. As in PyTorch the stride defaults to the kernel
// size; the options set it when they are constructed, so `options.stride()` is always the
// stride in use. Options are checked at construction; dilation, ceil_mode and
// divisor_override are not supported (the functional ops do not have them).

#include <cstdint>
#include <ostream>
#include <string>

// ---- begin lazytensor/ops/pool.hpp ----
// max_pool2d and avg_pool2d (torch::nn::functional) and their derivative rules; the forward
// and backward kernels are in graph/pool_node.hpp.
//
// Every kernel works on whole (n, c) planes, one task owning a plane, one output row at a
// time, in a fixed order, so results never depend on the thread count. Forward kernels and
// the average pool's backward loop over the taps of the window in row-major order and, for
// each, over the row's windows (a branch-free, vectorizable inner loop). Max pooling keeps
// no index tensor: its backward recomputes each window's argmax from the saved input (the
// first maximum in row-major window order, as in torch; a NaN wins over numbers), whose
// value is the forward's maximum. Padding is -inf for max pooling (padded taps are
// skipped) and zeros for average pooling.

#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

// ---- begin lazytensor/graph/pool_node.hpp ----
// The kernels of max_pool2d and avg_pool2d, forward and backward (PoolNode and its two
// subclasses), with the per-row window loops they share. Every kernel works on whole (n, c)
// planes, one task owning a plane, one output row at a time, in a fixed order, so results
// never depend on the thread count (ops/pool.hpp describes the rules they follow).

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>


namespace lazy::graph {

namespace detail {

/// Calls f(base, x0, x1) for each tap (i, j) of the windows of output row oy, in row-major
/// tap order, skipping taps in the padding: output columns [x0, x1) read the input at
/// base + ox * sw (an offset into the plane).
template <class F>
void for_each_tap(const Window2d& g, std::int64_t oy, F&& f) {
  const std::int64_t ys = oy * g.sh - g.ph;
  for (std::int64_t i = 0; i < g.kh; ++i) {
    const std::int64_t y = ys + i;
    if (y < 0 || y >= g.h) continue;
    for (std::int64_t j = 0; j < g.kw; ++j) {
      const auto [x0, x1] = g.valid_columns(j);
      if (x0 < x1) f(y * g.w - g.pw + j, x0, x1);
    }
  }
}

/// The maximum of each window of output row oy (NaN if the window holds one). Padding is
/// never a candidate (it acts as -inf); padding <= kernel / 2 keeps every window
/// overlapping the plane.
template <class T>
void pool_max_row(const T* plane, const Window2d& g, std::int64_t oy, T* best) {
  std::fill(best, best + g.ow, -std::numeric_limits<T>::infinity());
  for_each_tap(g, oy, [&](std::int64_t base, std::int64_t x0, std::int64_t x1) {
    for (std::int64_t ox = x0; ox < x1; ++ox) {
      const T v = plane[base + ox * g.sw];
      best[ox] = (v > best[ox] || v != v) ? v : best[ox];  // a NaN stays: nothing is > NaN
    }
  });
}

/// Where each window of output row oy has its maximum (an offset into the plane): the first
/// maximum in row-major tap order, or the first NaN (torch's rule).
template <class T>
void pool_argmax_row(const T* plane, const Window2d& g, std::int64_t oy, std::int64_t* at) {
  const std::int64_t ys = oy * g.sh - g.ph;
  const std::int64_t y0 = std::max<std::int64_t>(ys, 0), y1 = std::min(ys + g.kh, g.h);
  for (std::int64_t ox = 0; ox < g.ow; ++ox) {
    const std::int64_t xs = ox * g.sw - g.pw;
    const std::int64_t x0 = std::max<std::int64_t>(xs, 0), x1 = std::min(xs + g.kw, g.w);
    std::int64_t best = y0 * g.w + x0;
    T m = plane[best];
    for (std::int64_t y = y0; y < y1; ++y) {
      for (std::int64_t x = x0; x < x1; ++x) {
        const std::int64_t k = y * g.w + x;
        const T v = plane[k];
        // Branch-free selects on locals (the winner is data-dependent, so branches would
        // mispredict).
        const bool take = (v > m) | ((v != v) & (m == m));
        m = take ? v : m;
        best = take ? k : best;
      }
    }
    at[ox] = best;
  }
}

/// torch's divisor of window (oy, ox): kh * kw clipped to the padded plane when padding
/// counts, else the number of taps inside the plane.
std::int64_t avg_divisor(const Window2d& g, std::int64_t oy, std::int64_t ox,
                         bool count_include_pad);

/// Runs planes(p0, p1) on the device's workers, each task owning whole planes.
template <class F>
void for_planes(ExecContext& ctx, std::int64_t planes, std::int64_t elements, double cost, F&& f) {
  auto& pool = ctx.device.threads();
  const std::int64_t tasks =
      std::max<std::int64_t>(1, std::min(planes, task_count(pool, elements, cost)));
  pool.parallel_for(tasks, [&](std::int64_t t) {
    auto [p0, p1] = task_range(planes, tasks, t);
    if (p0 < p1) f(p0, p1);
  });
}

}  // namespace detail

/// Base of the pooling kernels: the window geometry, the mode, and their hash.
class PoolNode : public Node {
 public:
  PoolNode(DType dtype, Shape shape, Device* device, std::vector<NodePtr> inputs, const Window2d& g,
           bool max, bool count_include_pad);
  std::uint64_t structural_hash() const override;
  std::string describe() const override;
  /// Work per element of the pooled output: one window.
  double window_cost() const { return static_cast<double>(g_.kh * g_.kw); }

 protected:
  Window2d g_;
  bool max_, count_include_pad_;
};

/// max_pool2d / avg_pool2d forward: [N, C, H, W] -> [N, C, OH, OW].
template <class T>
class Pool2dNode final : public PoolNode {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, double>,
                "pooling runs on float or double");

 public:
  Pool2dNode(NodePtr x, const Window2d& g, bool max, bool count_include_pad)
      : PoolNode(dtype_of<T>(), Shape{x->shape()[0], x->shape()[1], g.oh, g.ow}, x->device(), {x},
                 g, max, count_include_pad) {}
  std::string op_name() const override { return max_ ? "max_pool2d" : "avg_pool2d"; }
  double cost_per_element() const override { return window_cost(); }

 protected:
  void compute(ExecContext& ctx) override {
    const T* x = inputs()[0]->template data<T>();
    auto buf = allocate_output(ctx, false);
    T* y = static_cast<T*>(buf->data());
    const std::int64_t in_plane = g_.h * g_.w, out_plane = g_.oh * g_.ow;
    detail::for_planes(ctx, shape()[0] * shape()[1], numel(), cost_per_element(),
                       [&](std::int64_t p0, std::int64_t p1) {
                         for (std::int64_t p = p0; p < p1; ++p) {
                           for (std::int64_t oy = 0; oy < g_.oh; ++oy) {
                             T* row = y + p * out_plane + oy * g_.ow;
                             if (max_) {
                               detail::pool_max_row(x + p * in_plane, g_, oy, row);
                             } else {
                               average_row(x + p * in_plane, oy, row);
                             }
                           }
                         }
                       });
    set_buffer(std::move(buf));
  }

 private:
  // Window sums in row-major tap order, then the divisions.
  void average_row(const T* plane, std::int64_t oy, T* out) const {
    std::fill(out, out + g_.ow, T(0));
    detail::for_each_tap(g_, oy, [&](std::int64_t base, std::int64_t x0, std::int64_t x1) {
      for (std::int64_t ox = x0; ox < x1; ++ox) out[ox] += plane[base + ox * g_.sw];
    });
    for (std::int64_t ox = 0; ox < g_.ow; ++ox) {
      out[ox] /= static_cast<T>(detail::avg_divisor(g_, oy, ox, count_include_pad_));
    }
  }
};

/// Gradient of max_pool2d / avg_pool2d: [N, C, OH, OW] gradients -> [N, C, H, W]. Inputs:
/// the gradient, and for max pooling the forward's input (to find each window's argmax).
template <class T>
class Pool2dBackwardNode final : public PoolNode {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, double>,
                "pooling runs on float or double");

 public:
  Pool2dBackwardNode(NodePtr grad, NodePtr x, Shape image, const Window2d& g, bool max,
                     bool count_include_pad)
      : PoolNode(dtype_of<T>(), image, grad->device(),
                 x ? std::vector<NodePtr>{grad, x} : std::vector<NodePtr>{grad}, g, max,
                 count_include_pad) {}
  std::string op_name() const override {
    return max_ ? "max_pool2d_backward" : "avg_pool2d_backward";
  }
  double cost_per_element() const override {
    return std::max(
        1.0, window_cost() * static_cast<double>(g_.oh * g_.ow) / static_cast<double>(g_.h * g_.w));
  }

 protected:
  void compute(ExecContext& ctx) override {
    const T* gy = inputs()[0]->template data<T>();
    const T* x = max_ ? inputs()[1]->template data<T>() : nullptr;
    auto buf = allocate_output(ctx, false);
    T* dx = static_cast<T*>(buf->data());
    const std::int64_t in_plane = g_.h * g_.w, out_plane = g_.oh * g_.ow;
    // Each plane adds its output rows in order, each row's windows in tap order: a fixed
    // accumulation order per element.
    detail::for_planes(
        ctx, shape()[0] * shape()[1], numel(), cost_per_element(),
        [&](std::int64_t p0, std::int64_t p1) {
          std::vector<T> scratch(static_cast<std::size_t>(g_.ow));
          std::vector<std::int64_t> at(static_cast<std::size_t>(g_.ow));
          for (std::int64_t p = p0; p < p1; ++p) {
            T* d = dx + p * in_plane;
            std::fill(d, d + in_plane, T(0));
            for (std::int64_t oy = 0; oy < g_.oh; ++oy) {
              const T* g = gy + p * out_plane + oy * g_.ow;
              if (max_) {
                detail::pool_argmax_row(x + p * in_plane, g_, oy, at.data());
                for (std::int64_t ox = 0; ox < g_.ow; ++ox) d[at[ox]] += g[ox];
                continue;
              }
              T* share = scratch.data();
              for (std::int64_t ox = 0; ox < g_.ow; ++ox) {
                share[ox] = g[ox] / static_cast<T>(
                                        detail::avg_divisor(g_, oy, ox, count_include_pad_));
              }
              detail::for_each_tap(g_, oy,
                                   [&](std::int64_t base, std::int64_t x0, std::int64_t x1) {
                                     for (std::int64_t ox = x0; ox < x1; ++ox)
                                       d[base + ox * g_.sw] += share[ox];
                                   });
            }
          }
        });
    set_buffer(std::move(buf));
  }
};

}  // namespace lazy::graph

#if LAZYTENSOR_HEADER_DEFINITIONS
namespace lazy::graph::detail {

LAZYTENSOR_INLINE std::int64_t avg_divisor(const Window2d& g,
    std::int64_t oy,
    std::int64_t ox,
    bool count_include_pad) {
  const std::int64_t ys = oy * g.sh - g.ph, xs = ox * g.sw - g.pw;
  if (!count_include_pad) {
    return (std::min(ys + g.kh, g.h) - std::max<std::int64_t>(ys, 0)) *
           (std::min(xs + g.kw, g.w) - std::max<std::int64_t>(xs, 0));
  }
  return (std::min(ys + g.kh, g.h + g.ph) - ys) * (std::min(xs + g.kw, g.w + g.pw) - xs);
}

}  // namespace lazy::graph::detail
namespace lazy::graph {

LAZYTENSOR_INLINE PoolNode::PoolNode(DType dtype,
  Shape shape,
  Device* device,
  std::vector<NodePtr> inputs,
  const Window2d& g,
  bool max,
  bool count_include_pad)
    : Node(NodeKind::Reduction, dtype, shape, device, std::move(inputs)),
      g_(g),
      max_(max),
      count_include_pad_(count_include_pad) {}

LAZYTENSOR_INLINE std::uint64_t PoolNode::structural_hash() const {
  return hash_combine(g_.hash(Node::structural_hash()),
                      (max_ ? 1u : 0u) | (count_include_pad_ ? 2u : 0u));
}

LAZYTENSOR_INLINE std::string PoolNode::describe() const {
  return op_name() + "(%0, " + g_.str() +
         (max_                 ? ""
          : count_include_pad_ ? ", count_include_pad"
                               : "") +
         ")";
}

}  // namespace lazy::graph
#endif  // LAZYTENSOR_HEADER_DEFINITIONS
// ---- end lazytensor/graph/pool_node.hpp ----

namespace lazy {

namespace detail {

/// Validated geometry of a pooling window over x ([N, C, H, W]); stride defaults to the
/// kernel, and padding may be at most half the kernel (torch's rule, which also keeps
/// every window overlapping the input).
graph::Window2d pool_window(const char* op, const Shape& x, Size2 kernel,
                                   const std::optional<Size2>& stride, Size2 padding);

/// Runs the pool on float or double tensors; bfloat16 goes through float (exact for max,
/// one rounding for the average).
template <class T, class F>
Tensor<T> pool_dispatch(const Tensor<T>& x, const char* op, F&& run) {
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double>) {
    return run(x);
  } else if constexpr (std::is_same_v<T, bfloat16>) {
    return Tensor<bfloat16>(cast<bfloat16>(run(Tensor<float>(cast<float>(x)))));
  } else {
    throw DTypeError(std::string(op) +
                     ": expected a floating tensor (float, double or bfloat16), got " +
                     dtype_name(dtype_of<T>()));
  }
}

template <class T>
Tensor<T> pool2d(const Tensor<T>& x, const graph::Window2d& g, bool max, bool count_include_pad) {
  Tensor<T> y(
      graph::submit(std::make_shared<graph::Pool2dNode<T>>(x.node(), g, max, count_include_pad)));
  autograd::record(
      y, max ? "MaxPool2DWithIndicesBackward0" : "AvgPool2DBackward0",
      {autograd::edge_of(x.impl())},
      [x = max ? x.detach() : Tensor<T>(), image = x.shape(), g, max,
       count_include_pad](const Tensor<T>& gy) {
        return std::vector<graph::NodePtr>{
            graph::submit(std::make_shared<graph::Pool2dBackwardNode<T>>(
                gy.node(), max ? x.node() : nullptr, image, g, max, count_include_pad))};
      });
  return y;
}

}  // namespace detail

/// 2-D max pooling (torch::nn::functional::max_pool2d, no dilation or ceil_mode): input
/// [N, C, H, W] -> [N, C, OH, OW], OH = (H + 2 * padding.h - kernel.h) / stride.h + 1.
/// stride defaults to the kernel size; padding (at most half the kernel) acts as -inf.
/// Ties go to the first maximum in the window (row-major). float, double, bfloat16.
template <expr::ExprLike X>
Tensor<expr::value_t<X>> max_pool2d(const X& input, Size2 kernel_size,
                                    std::optional<Size2> stride = std::nullopt, Size2 padding = 0) {
  using T = expr::value_t<X>;
  Tensor<T> x = detail::as_tensor(input);
  const auto g = detail::pool_window("max_pool2d", x.shape(), kernel_size, stride, padding);
  return detail::pool_dispatch(x, "max_pool2d",
                               [&](const auto& t) { return detail::pool2d(t, g, true, false); });
}

/// 2-D average pooling (torch::nn::functional::avg_pool2d, no ceil_mode or
/// divisor_override): like max_pool2d, with zero padding; each window's sum is divided by
/// kernel.h * kernel.w when count_include_pad (the default), else by the number of taps
/// inside the input.
template <expr::ExprLike X>
Tensor<expr::value_t<X>> avg_pool2d(const X& input, Size2 kernel_size,
                                    std::optional<Size2> stride = std::nullopt, Size2 padding = 0,
                                    bool count_include_pad = true) {
  using T = expr::value_t<X>;
  Tensor<T> x = detail::as_tensor(input);
  const auto g = detail::pool_window("avg_pool2d", x.shape(), kernel_size, stride, padding);
  return detail::pool_dispatch(x, "avg_pool2d", [&](const auto& t) {
    return detail::pool2d(t, g, false, count_include_pad);
  });
}

}  // namespace lazy

#if LAZYTENSOR_HEADER_DEFINITIONS
namespace lazy::detail {

LAZYTENSOR_INLINE graph::Window2d pool_window(const char* op,
    const Shape& x,
    Size2 kernel,
    const std::optional<Size2>& stride,
    Size2 padding) {
  check_nchw(x, op, "input");
  if (kernel.h <= 0 || kernel.w <= 0) {
    throw ShapeError(std::string(op) + ": expected a positive kernel size, got " + kernel.str());
  }
  const Size2 s = stride.value_or(kernel);
  check_window_args(op, s, padding, 1);
  if (padding.h > kernel.h / 2 || padding.w > kernel.w / 2) {
    throw ShapeError(std::string(op) +
                     ": padding should be at most half of the kernel size, got padding " +
                     padding.str() + " for kernel " + kernel.str());
  }
  return window_over(op, x, kernel, s, padding, 1);
}

}  // namespace lazy::detail
#endif  // LAZYTENSOR_HEADER_DEFINITIONS
// ---- end lazytensor/ops/pool.hpp ----

namespace lazy::nn {

namespace detail {

/// ShapeError unless the kernel and stride are positive and 0 <= padding <= kernel / 2
/// (torch's rule: every window must overlap the input).
void check_pool_options(const char* layer, Size2 kernel, Size2 stride, Size2 padding);

/// A size as PyTorch prints a pooling argument: `2` when square, `(2, 3)` otherwise.
std::string pool_size_str(Size2 s);

}  // namespace detail

/// Options of MaxPool2d (torch::nn::MaxPool2dOptions): `MaxPool2dOptions(3).stride(2)`.
struct MaxPool2dOptions {
  /// A kernel_size window; the stride starts equal to it.
  MaxPool2dOptions(Size2 kernel_size)  // NOLINT: MaxPool2d(2) reads naturally
      : kernel_size_(kernel_size), stride_(kernel_size) {}
  LAZY_ARG(Size2, kernel_size);
  /// Step of the window (default: the kernel size).
  LAZY_ARG(Size2, stride);
  /// Implicit -inf padding on each side, at most half the kernel.
  LAZY_ARG(Size2, padding) = 0;
};

/// Options of AvgPool2d (torch::nn::AvgPool2dOptions): `AvgPool2dOptions(2).padding(1)`.
struct AvgPool2dOptions {
  /// A kernel_size window; the stride starts equal to it.
  AvgPool2dOptions(Size2 kernel_size)  // NOLINT: AvgPool2d(2) reads naturally
      : kernel_size_(kernel_size), stride_(kernel_size) {}
  LAZY_ARG(Size2, kernel_size);
  /// Step of the window (default: the kernel size).
  LAZY_ARG(Size2, stride);
  /// Zero padding on each side, at most half the kernel.
  LAZY_ARG(Size2, padding) = 0;
  /// Whether padded zeros count in the divisor (kH * kW) or only the taps inside the input.
  LAZY_ARG(bool, count_include_pad) = true;
};

/// 2-D max pooling: [N, C, H, W] -> [N, C, OH, OW].
class MaxPool2dImpl : public Module {
 public:
  /// MaxPool2d(kernel_size) with default options (stride = kernel_size, no padding).
  explicit MaxPool2dImpl(Size2 kernel_size) : MaxPool2dImpl(MaxPool2dOptions(kernel_size)) {}
  /// ShapeError for a non-positive kernel size or stride, or a padding outside
  /// [0, kernel / 2].
  explicit MaxPool2dImpl(const MaxPool2dOptions& options_);
  /// ShapeError (from max_pool2d) unless x is [N, C, H, W] with a plane no smaller than the
  /// kernel once padded.
  template <FloatingElement T>
  Tensor<T> forward(const Tensor<T>& x) const;
  /// The same on a pending expression.
  template <expr::Pending E>
  auto forward(const E& x) const {
    return forward(lazy::eval(x));
  }
  /// PyTorch's repr: `MaxPool2d(kernel_size=2, stride=2, padding=0, dilation=1,
  /// ceil_mode=False)`.
  void pretty_print(std::ostream& os) const override;

  /// The options the layer was built with.
  const MaxPool2dOptions options;
};
LAZY_MODULE(MaxPool2d);

/// 2-D average pooling: [N, C, H, W] -> [N, C, OH, OW].
class AvgPool2dImpl : public Module {
 public:
  /// AvgPool2d(kernel_size) with default options (stride = kernel_size, no padding).
  explicit AvgPool2dImpl(Size2 kernel_size) : AvgPool2dImpl(AvgPool2dOptions(kernel_size)) {}
  /// ShapeError for a non-positive kernel size or stride, or a padding outside
  /// [0, kernel / 2].
  explicit AvgPool2dImpl(const AvgPool2dOptions& options_);
  /// ShapeError (from avg_pool2d) unless x is [N, C, H, W] with a plane no smaller than the
  /// kernel once padded.
  template <FloatingElement T>
  Tensor<T> forward(const Tensor<T>& x) const;
  /// The same on a pending expression.
  template <expr::Pending E>
  auto forward(const E& x) const {
    return forward(lazy::eval(x));
  }
  /// PyTorch's repr: `AvgPool2d(kernel_size=2, stride=2, padding=0)` (plus
  /// `count_include_pad=False` when set).
  void pretty_print(std::ostream& os) const override;

  /// The options the layer was built with.
  const AvgPool2dOptions options;
};
LAZY_MODULE(AvgPool2d);

// (Outside the classes, so not inline: see core/config.hpp.)
template <FloatingElement T>
Tensor<T> MaxPool2dImpl::forward(const Tensor<T>& x) const {
  return max_pool2d(x, options.kernel_size(), options.stride(), options.padding());
}

template <FloatingElement T>
Tensor<T> AvgPool2dImpl::forward(const Tensor<T>& x) const {
  return avg_pool2d(x, options.kernel_size(), options.stride(), options.padding(),
                    options.count_include_pad());
}

#if LAZYTENSOR_HEADER_DEFINITIONS
namespace detail {

LAZYTENSOR_INLINE void check_pool_options(const char* layer, Size2 kernel, Size2 stride, Size2 padding) {
  if (kernel.h <= 0 || kernel.w <= 0) {
    throw ShapeError(std::string(layer) + ": expected a positive kernel_size, got " + kernel.str());
  }
  lazy::detail::check_window_args(layer, stride, padding, 1);
  if (padding.h > kernel.h / 2 || padding.w > kernel.w / 2) {
    throw ShapeError(std::string(layer) +
                     ": padding should be at most half of the kernel size, got padding " +
                     padding.str() + " for kernel_size " + kernel.str());
  }
}

LAZYTENSOR_INLINE std::string pool_size_str(Size2 s) { return s.h == s.w ? std::to_string(s.h) : s.str(); }

}  // namespace detail

LAZYTENSOR_INLINE MaxPool2dImpl::MaxPool2dImpl(const MaxPool2dOptions& options_)
    : Module("MaxPool2d"), options(options_) {
  detail::check_pool_options("MaxPool2d", options.kernel_size(), options.stride(),
                             options.padding());
}

LAZYTENSOR_INLINE void MaxPool2dImpl::pretty_print(std::ostream& os) const {
  os << "MaxPool2d(kernel_size=" << detail::pool_size_str(options.kernel_size())
     << ", stride=" << detail::pool_size_str(options.stride())
     << ", padding=" << detail::pool_size_str(options.padding())
     << ", dilation=1, ceil_mode=False)";
}

LAZYTENSOR_INLINE AvgPool2dImpl::AvgPool2dImpl(const AvgPool2dOptions& options_)
    : Module("AvgPool2d"), options(options_) {
  detail::check_pool_options("AvgPool2d", options.kernel_size(), options.stride(),
                             options.padding());
}

LAZYTENSOR_INLINE void AvgPool2dImpl::pretty_print(std::ostream& os) const {
  os << "AvgPool2d(kernel_size=" << detail::pool_size_str(options.kernel_size())
     << ", stride=" << detail::pool_size_str(options.stride())
     << ", padding=" << detail::pool_size_str(options.padding());
  if (!options.count_include_pad()) os << ", count_include_pad=False";
  os << ")";
}
#endif  // LAZYTENSOR_HEADER_DEFINITIONS

}  // namespace lazy::nn

// Instantiated once in the compiled runtime (core/config.hpp).
#define LAZYTENSOR_NN_POOLING_INSTANCES(P, T)                                                                   \
  P template lazy::Tensor<T> lazy::nn::MaxPool2dImpl::forward<T>(const lazy::Tensor<T>&) const; \
  P template lazy::Tensor<T> lazy::nn::AvgPool2dImpl::forward<T>(const lazy::Tensor<T>&) const;
#if LAZYTENSOR_EXPLICIT_INSTANTIATION
LAZYTENSOR_FOR_FLOATING(LAZYTENSOR_NN_POOLING_INSTANCES, extern)
#endif
// ---- end lazytensor/nn/pooling.hpp ----
// ---- begin lazytensor/nn/sequential.hpp ----
// nn::Sequential: modules applied in order, registered as "0", "1", ...

#include <functional>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>


namespace lazy::nn {

/// A chain of modules, each mapping a tensor to one of the same dtype.
class SequentialImpl : public Module {
 public:
  SequentialImpl() : Module("Sequential") {}
  /// Sequential(Linear(4, 8), ReLU(), Linear(8, 2)).
  template <class... Holders>
  explicit SequentialImpl(Holders... modules) : Module("Sequential") {
    (push_back(std::move(modules)), ...);
  }

  /// Appends a module (a holder such as nn::Linear) whose forward maps a tensor to one of
  /// the same dtype. A module with a float-only forward raises DTypeError when the chain
  /// runs in another dtype.
  template <class H>
  void push_back(H holder);

  /// Applies every module in order, in x's dtype.
  template <FloatingElement T>
  Tensor<T> forward(const Tensor<T>& x) const {
    Tensor<T> y = x;
    for (const auto& s : steps_) y = std::get<std::function<Tensor<T>(const Tensor<T>&)>>(s)(y);
    return y;
  }
  /// The same on a pending expression.
  template <expr::Pending E>
  auto forward(const E& x) const {
    return forward(lazy::eval(x));
  }
  /// Number of modules.
  std::size_t size() const { return steps_.size(); }

 private:
  template <class T>
  using Step = std::function<Tensor<T>(const Tensor<T>&)>;
  template <class T, class Impl>
  static Step<T> step_of(const std::shared_ptr<Impl>& impl) {
    if constexpr (requires(const Tensor<T>& x) { impl->forward(x); }) {
      return [impl](const Tensor<T>& x) { return Tensor<T>(impl->forward(x)); };
    } else {
      return [impl](const Tensor<T>&) -> Tensor<T> {
        throw DTypeError(impl->name() + " in Sequential has no forward for " + dtype_name(dtype_of<T>()) +
                         " tensors");
      };
    }
  }
  std::vector<std::tuple<Step<float>, Step<double>, Step<bfloat16>>> steps_;
};
LAZY_MODULE(Sequential);

// (Outside the class, so not inline: see core/config.hpp. The library's own layers are
// instantiated in the compiled runtime, LAZYTENSOR_NN_SEQUENTIAL_INSTANCES in nn.hpp.)
template <class H>
void SequentialImpl::push_back(H holder) {
  auto impl = holder.ptr();
  register_module(std::to_string(steps_.size()), impl);
  steps_.emplace_back(step_of<float>(impl), step_of<double>(impl), step_of<bfloat16>(impl));
}

}  // namespace lazy::nn
// ---- end lazytensor/nn/sequential.hpp ----
// ---- begin lazytensor/nn/utils/clip_grad.hpp ----
// Gradient clipping, as torch.nn.utils: clip_grad_norm_ scales every gradient by one factor
// so that their total norm is at most max_norm; clip_grad_value_ clamps each element.
// Both update the gradients in place (every handle on a gradient sees it) and stay lazy:
// the total norm is a pending 0-dim tensor, computed with the step at the next mark_step.
// Templates over the gradients' dtype, so that their bodies (reductions with deduced types)
// are compiled only in programs that clip; lazytensor::compiled instantiates float once.

#include <cmath>
#include <limits>
#include <string>
#include <vector>


namespace lazy::nn::utils {

/// Scales the gradients of `parameters` (those that have one) in place by
/// min(1, max_norm / (total_norm + 1e-6)), where total_norm is the `norm_type`-norm of all
/// gradients together (`norm_type` >= 1, or infinity for the largest magnitude). Returns
/// total_norm before clipping (0 when no parameter has a gradient). With
/// `error_if_nonfinite`, a NaN or infinite total norm raises lazy::Error (this reads the
/// norm, so it syncs).
template <Element T = float>
  requires is_floating_v<T>
Tensor<T> clip_grad_norm_(const std::vector<Tensor<T>>& parameters, double max_norm, double norm_type = 2.0,
                          bool error_if_nonfinite = false);
/// The same for one parameter.
template <Element T>
  requires is_floating_v<T>
Tensor<T> clip_grad_norm_(const Tensor<T>& parameter, double max_norm, double norm_type = 2.0,
                          bool error_if_nonfinite = false);

/// The same for parameters of a run-time dtype (Module::parameters()): the gradients must
/// share one dtype (DTypeError naming two that differ), in which the norm is returned.
template <class = void>
AnyTensor clip_grad_norm_(const std::vector<AnyTensor>& parameters, double max_norm, double norm_type = 2.0,
                          bool error_if_nonfinite = false);

/// Clamps every gradient element of `parameters` into [-clip_value, clip_value], in place
/// (`clip_value` >= 0).
template <Element T = float>
  requires is_floating_v<T>
void clip_grad_value_(const std::vector<Tensor<T>>& parameters, double clip_value);
/// The same for one parameter.
template <Element T>
  requires is_floating_v<T>
void clip_grad_value_(const Tensor<T>& parameter, double clip_value);
/// The same for parameters of a run-time dtype (Module::parameters()).
template <class = void>
void clip_grad_value_(const std::vector<AnyTensor>& parameters, double clip_value);

template <Element T>
  requires is_floating_v<T>
Tensor<T> clip_grad_norm_(const std::vector<Tensor<T>>& parameters, double max_norm, double norm_type,
                          bool error_if_nonfinite) {
  const bool inf = std::isinf(norm_type) && norm_type > 0;
  if (!(norm_type >= 1.0) && !inf) {
    throw Error("clip_grad_norm_: norm_type must be >= 1 or infinity, got " + std::to_string(norm_type));
  }
  if (!(max_norm >= 0.0)) throw Error("clip_grad_norm_: max_norm must be >= 0, got " + std::to_string(max_norm));
  NoGradGuard no_grad;
  std::vector<Tensor<T>> grads;
  for (const auto& p : parameters) {
    if (p.defined() && p.grad().defined()) grads.push_back(p.grad());
  }
  if (grads.empty()) return zeros<T>(Shape{});
  // One partial per gradient (sum of |g|^p, or max |g|), then one combination.
  Tensor<T> acc;
  for (const auto& g : grads) {
    Tensor<T> part;
    if (inf) part = amax(abs(g));
    else if (norm_type == 2.0) part = sum(g * g);
    else if (norm_type == 1.0) part = sum(abs(g));
    else part = sum(pow(abs(g), static_cast<T>(norm_type)));
    if (!acc.defined()) acc = part;
    else if (inf) acc = maximum(acc, part);
    else acc = acc + part;
  }
  Tensor<T> total;
  if (inf || norm_type == 1.0) total = acc;
  else if (norm_type == 2.0) total = sqrt(acc);
  else total = pow(acc, static_cast<T>(1.0 / norm_type));
  if (error_if_nonfinite) {
    const auto v = static_cast<double>(total.item());
    if (!std::isfinite(v)) {
      throw Error("clip_grad_norm_: the total norm of order " + std::to_string(norm_type) +
                  " of the gradients is non-finite (" + std::to_string(v) +
                  "), so it cannot be clipped; pass error_if_nonfinite = false to clip anyway");
    }
  }
  const Tensor<T> coef = minimum(static_cast<T>(max_norm) / (total + static_cast<T>(1e-6)), static_cast<T>(1));
  for (auto& g : grads) g.mul_(coef);
  return total;
}

template <Element T>
  requires is_floating_v<T>
Tensor<T> clip_grad_norm_(const Tensor<T>& parameter, double max_norm, double norm_type, bool error_if_nonfinite) {
  return clip_grad_norm_(std::vector<Tensor<T>>{parameter}, max_norm, norm_type, error_if_nonfinite);
}

template <Element T>
  requires is_floating_v<T>
void clip_grad_value_(const std::vector<Tensor<T>>& parameters, double clip_value) {
  if (!(clip_value >= 0.0)) {
    throw Error("clip_grad_value_: clip_value must be >= 0, got " + std::to_string(clip_value));
  }
  NoGradGuard no_grad;
  const auto c = static_cast<T>(clip_value);
  for (const auto& p : parameters) {
    if (!p.defined()) continue;
    Tensor<T> g = p.grad();
    if (g.defined()) g.copy_(clamp(g, -c, c));
  }
}

template <Element T>
  requires is_floating_v<T>
void clip_grad_value_(const Tensor<T>& parameter, double clip_value) {
  clip_grad_value_(std::vector<Tensor<T>>{parameter}, clip_value);
}

template <class>
AnyTensor clip_grad_norm_(const std::vector<AnyTensor>& parameters, double max_norm, double norm_type,
                          bool error_if_nonfinite) {
  const AnyTensor* first = nullptr;
  for (const auto& p : parameters) {
    if (!p.defined() || !p.grad().defined()) continue;
    if (!first) first = &p;
    else if (p.dtype() != first->dtype()) {
      throw DTypeError("clip_grad_norm_: gradients of dtypes " + dtype_name(first->dtype()) + " and " +
                       dtype_name(p.dtype()) + " in one call; clip each dtype's parameters separately");
    }
  }
  auto run = [&](auto tag) -> AnyTensor {
    using T = decltype(tag);
    std::vector<Tensor<T>> typed;
    for (const auto& p : parameters)
      if (p.defined() && p.dtype() == dtype_of<T>()) typed.push_back(p.template as<T>());
    return clip_grad_norm_<T>(typed, max_norm, norm_type, error_if_nonfinite);
  };
  switch (first ? first->dtype() : DType::Float32) {
    case DType::Float64: return run(double{});
    case DType::BFloat16: return run(bfloat16{});
    default: return run(float{});
  }
}

template <class>
void clip_grad_value_(const std::vector<AnyTensor>& parameters, double clip_value) {
  if (!(clip_value >= 0.0)) {
    throw Error("clip_grad_value_: clip_value must be >= 0, got " + std::to_string(clip_value));
  }
  for (const auto& p : parameters) {
    if (!p.defined()) continue;
    switch (p.dtype()) {
      case DType::Float64: clip_grad_value_(p.as<double>(), clip_value); break;
      case DType::BFloat16: clip_grad_value_(p.as<bfloat16>(), clip_value); break;
      case DType::Float32: clip_grad_value_(p.as<float>(), clip_value); break;
      default: break;  // integral tensors have no gradients
    }
  }
}

}  // namespace lazy::nn::utils

#define LAZYTENSOR_NN_CLIP_GRAD_INSTANCES(P)                                                                    \
  P template lazy::Tensor<float> lazy::nn::utils::clip_grad_norm_<float>(const std::vector<lazy::Tensor<float>>&, \
                                                                         double, double, bool);                \
  P template lazy::Tensor<float> lazy::nn::utils::clip_grad_norm_<float>(const lazy::Tensor<float>&, double,     \
                                                                         double, bool);                        \
  P template void lazy::nn::utils::clip_grad_value_<float>(const std::vector<lazy::Tensor<float>>&, double);   \
  P template void lazy::nn::utils::clip_grad_value_<float>(const lazy::Tensor<float>&, double);               \
  P template lazy::AnyTensor lazy::nn::utils::clip_grad_norm_<void>(const std::vector<lazy::AnyTensor>&, double, \
                                                                    double, bool);                            \
  P template void lazy::nn::utils::clip_grad_value_<void>(const std::vector<lazy::AnyTensor>&, double);
#if LAZYTENSOR_EXPLICIT_INSTANTIATION
LAZYTENSOR_NN_CLIP_GRAD_INSTANCES(extern)
#endif
// ---- end lazytensor/nn/utils/clip_grad.hpp ----

// Sequential::push_back of the library's own float -> float layers, instantiated once in the
// compiled runtime (core/config.hpp).
#define LAZYTENSOR_NN_SEQUENTIAL_INSTANCES(P)                                  \
  P template void lazy::nn::SequentialImpl::push_back(lazy::nn::Linear);      \
  P template void lazy::nn::SequentialImpl::push_back(lazy::nn::Conv2d);      \
  P template void lazy::nn::SequentialImpl::push_back(lazy::nn::MaxPool2d);   \
  P template void lazy::nn::SequentialImpl::push_back(lazy::nn::AvgPool2d);   \
  P template void lazy::nn::SequentialImpl::push_back(lazy::nn::ReLU);        \
  P template void lazy::nn::SequentialImpl::push_back(lazy::nn::GELU);        \
  P template void lazy::nn::SequentialImpl::push_back(lazy::nn::Tanh);        \
  P template void lazy::nn::SequentialImpl::push_back(lazy::nn::Sigmoid);     \
  P template void lazy::nn::SequentialImpl::push_back(lazy::nn::SiLU);        \
  P template void lazy::nn::SequentialImpl::push_back(lazy::nn::Flatten);     \
  P template void lazy::nn::SequentialImpl::push_back(lazy::nn::Dropout);     \
  P template void lazy::nn::SequentialImpl::push_back(lazy::nn::LayerNorm);   \
  P template void lazy::nn::SequentialImpl::push_back(lazy::nn::BatchNorm1d); \
  P template void lazy::nn::SequentialImpl::push_back(lazy::nn::BatchNorm2d); \
  P template void lazy::nn::SequentialImpl::push_back(lazy::nn::Sequential);
#if LAZYTENSOR_EXPLICIT_INSTANTIATION
LAZYTENSOR_NN_SEQUENTIAL_INSTANCES(extern)
#endif
// ---- end lazytensor/nn.hpp ----
// ---- begin lazytensor/optim.hpp ----
// lazy::optim: optimizers and learning-rate schedulers (torch::optim).

// ---- begin lazytensor/optim/adam.hpp ----
// Adam and AdamW, as torch.optim: bias-corrected first and second moment estimates, L2
// weight decay folded into the gradient (Adam) or decoupled (AdamW), optional AMSGrad.

#include <cmath>
#include <string>
#include <tuple>
#include <vector>


namespace lazy::optim {

/// Options of Adam and AdamW (libtorch's AdamOptions / AdamWOptions).
struct AdamOptions {
  using Betas = std::tuple<double, double>;
  AdamOptions(double lr = 1e-3) : lr_(lr) {}  // NOLINT
  LAZY_ARG(double, lr);
  LAZY_ARG(Betas, betas) = Betas(0.9, 0.999);
  LAZY_ARG(double, eps) = 1e-8;
  LAZY_ARG(double, weight_decay) = 0;
  LAZY_ARG(bool, amsgrad) = false;

 public:
  std::map<std::string, std::string> to_map() const;
  static AdamOptions from_map(const std::map<std::string, std::string>& m);
};
/// AdamW's options: Adam's, with weight_decay 1e-2 by default (as torch). The fluent
/// setters return AdamOptions&, which AdamW takes as well.
struct AdamWOptions : AdamOptions {
  AdamWOptions(double lr = 1e-3) : AdamOptions(lr) { weight_decay(1e-2); }  // NOLINT
};

/// The Adam update shared by Adam (L2 decay in the gradient) and AdamW (decoupled decay).
template <class Options, bool Decoupled>
class AdamBase : public OptimizerWithOptions<Options> {
  using Base = OptimizerWithOptions<Options>;

 public:
  using typename Base::ParamGroup;
  /// One group of parameters (AdamW's default options decay weights by 1e-2, as torch's).
  AdamBase(std::vector<AnyTensor> params, Options options = default_options())
      : AdamBase(std::vector<ParamGroup>{ParamGroup{std::move(params), options}}) {}
  /// Parameters of one dtype.
  template <FloatingElement T>
  AdamBase(const std::vector<Tensor<T>>& params, Options options = default_options())
      : AdamBase(std::vector<AnyTensor>(params.begin(), params.end()), options) {}
  AdamBase(std::vector<ParamGroup> groups) : Base(std::move(groups)) {
    for (const auto& g : this->groups_) validate(g.options);
  }

  void step() override;

 protected:
  std::string type_name() const override { return Decoupled ? "AdamW" : "Adam"; }
  std::string type_name_of() const override { return type_name(); }

 private:
  static Options default_options() {
    if constexpr (Decoupled) return AdamWOptions();
    else return Options();
  }
  void validate(const AdamOptions& o) const;
  template <FloatingElement T>
  void update(Tensor<T> p, ParamState& st, const AdamOptions& o);
};

// (Outside the class, so not inline: see core/config.hpp.)
template <class Options, bool Decoupled>
void AdamBase<Options, Decoupled>::step() {
  NoGradGuard guard;
  for (std::size_t gi = 0; gi < this->groups_.size(); ++gi) {
    const AdamOptions& o = this->groups_[gi].options;
    auto& ps = this->groups_[gi].params;
    for (std::size_t k = 0; k < ps.size(); ++k) {
      if (!ps[k].grad().defined()) continue;
      detail::visit_floating(ps[k], type_name().c_str(), [&](auto p) { update(p, this->state(gi, k), o); });
    }
  }
}

template <class Options, bool Decoupled>
template <FloatingElement T>
void AdamBase<Options, Decoupled>::update(Tensor<T> p, ParamState& st, const AdamOptions& o) {
  using C = compute_t<T>;  // scalars in the dtype's arithmetic: float for float and bfloat16
  const double lr = o.lr(), b1 = std::get<0>(o.betas()), b2 = std::get<1>(o.betas()), wd = o.weight_decay();
  const Tensor<T> grad = p.grad();
  const std::int64_t t = ++st.step;
  const Tensor<T> g = !Decoupled && wd != 0 ? Tensor<T>(grad + static_cast<C>(wd) * p) : grad;
  auto init = [&](const char* name) -> Tensor<T> {
    auto it = st.tensors.find(name);
    if (it == st.tensors.end()) it = st.tensors.emplace(name, zeros<T>(p.shape(), p.device())).first;
    return it->second.template as<T>();  // shares the state tensor: copy_ below updates it
  };
  Tensor<T> m = init("exp_avg");
  Tensor<T> v = init("exp_avg_sq");
  m.copy_(m * static_cast<C>(b1) + g * static_cast<C>(1 - b1));
  v.copy_(v * static_cast<C>(b2) + g * g * static_cast<C>(1 - b2));
  // p -= lr / bc1 * m / (sqrt(v) / sqrt(bc2) + eps), rearranged so that no scalar
  // drifts to exactly 1 as the bias corrections vanish:
  // lr sqrt(bc2) / bc1 * m / (sqrt(v) + eps sqrt(bc2)).
  const double bc1 = 1 - std::pow(b1, static_cast<double>(t));
  const double sbc2 = std::sqrt(1 - std::pow(b2, static_cast<double>(t)));
  const auto step_size = static_cast<C>(lr * sbc2 / bc1), eps = static_cast<C>(o.eps() * sbc2);
  Tensor<T> vmax = v;
  if (o.amsgrad()) {
    Tensor<T> mx = init("max_exp_avg_sq");
    mx.copy_(maximum(mx, v));
    vmax = mx;
  }
  if (Decoupled && wd != 0) {
    p.copy_(p * static_cast<C>(1 - lr * wd) - step_size * m / (sqrt(vmax) + eps));
  } else {
    p.sub_(step_size * m / (sqrt(vmax) + eps));
  }
}

template <class Options, bool Decoupled>
void AdamBase<Options, Decoupled>::validate(const AdamOptions& o) const {
  const double b1 = std::get<0>(o.betas()), b2 = std::get<1>(o.betas());
  const std::string n = type_name();
  if (o.lr() < 0) throw Error(n + ": invalid learning rate " + std::to_string(o.lr()));
  if (o.eps() < 0) throw Error(n + ": invalid epsilon value " + std::to_string(o.eps()));
  if (b1 < 0 || b1 >= 1) throw Error(n + ": invalid beta parameter at index 0: " + std::to_string(b1));
  if (b2 < 0 || b2 >= 1) throw Error(n + ": invalid beta parameter at index 1: " + std::to_string(b2));
  if (o.weight_decay() < 0) throw Error(n + ": invalid weight_decay value " + std::to_string(o.weight_decay()));
}

/// Adam (L2 weight decay added to the gradient), as torch.optim.Adam. A class template
/// under the name: its step is compiled only into programs that use it.
using Adam = AdamBase<AdamOptions, false>;

/// AdamW (decoupled weight decay: p *= 1 - lr * weight_decay with the step), as
/// torch.optim.AdamW.
using AdamW = AdamBase<AdamOptions, true>;

#if LAZYTENSOR_HEADER_DEFINITIONS
LAZYTENSOR_INLINE std::map<std::string, std::string> AdamOptions::to_map() const {
  return {{"lr", detail::format_option(lr_)},
          {"beta1", detail::format_option(std::get<0>(betas_))},
          {"beta2", detail::format_option(std::get<1>(betas_))},
          {"eps", detail::format_option(eps_)},
          {"weight_decay", detail::format_option(weight_decay_)},
          {"amsgrad", amsgrad_ ? "1" : "0"}};
}

LAZYTENSOR_INLINE AdamOptions AdamOptions::from_map(const std::map<std::string, std::string>& m) {
  AdamOptions o(detail::parse_option(m, "lr"));
  o.betas(Betas(detail::parse_option(m, "beta1"), detail::parse_option(m, "beta2")))
      .eps(detail::parse_option(m, "eps"))
      .weight_decay(detail::parse_option(m, "weight_decay"))
      .amsgrad(detail::parse_option(m, "amsgrad") != 0);
  return o;
}
#endif  // LAZYTENSOR_HEADER_DEFINITIONS

}  // namespace lazy::optim

// Instantiated once in the compiled runtime (core/config.hpp).
#define LAZYTENSOR_OPTIM_ADAM_INSTANCES(P)                                          \
  P template class lazy::optim::OptimizerWithOptions<lazy::optim::AdamOptions>; \
  P template class lazy::optim::AdamBase<lazy::optim::AdamOptions, false>;      \
  P template class lazy::optim::AdamBase<lazy::optim::AdamOptions, true>;
#if LAZYTENSOR_EXPLICIT_INSTANTIATION
LAZYTENSOR_OPTIM_ADAM_INSTANCES(extern)
#endif
// ---- end lazytensor/optim/adam.hpp ----
// ---- begin lazytensor/optim/lr_scheduler.hpp ----
// Learning-rate schedulers, as torch.optim.lr_scheduler: each step() sets every group's
// learning rate from its base rate and the step count (closed forms, so resuming at any
// step gives the same rate). The rate is a scalar of the update kernels: a new rate never
// changes the plan.

#include <cmath>
#include <cstdint>
#include <numbers>
#include <string>
#include <vector>


namespace lazy::optim {

/// Base of the schedulers: remembers the base rates and counts steps.
class LRScheduler {
 public:
  explicit LRScheduler(Optimizer& opt);
  virtual ~LRScheduler() = default;
  /// Advances one step (one epoch, usually) and sets the new rates.
  void step() {
    ++count_;
    apply();
  }
  /// The rates set last.
  std::vector<double> get_last_lr() const;
  /// Steps taken so far.
  std::int64_t last_epoch() const { return count_; }

 protected:
  virtual double rate(double base, std::int64_t step) const = 0;
  void apply();

 private:
  Optimizer& opt_;
  std::vector<double> base_;
  std::int64_t count_ = 0;
};

/// lr = base * gamma^(floor(step / step_size)).
class StepLR : public LRScheduler {
 public:
  StepLR(Optimizer& opt, std::int64_t step_size, double gamma = 0.1);

 protected:
  double rate(double base, std::int64_t s) const override;

 private:
  std::int64_t size_;
  double gamma_;
};

/// lr = eta_min + (base - eta_min) (1 + cos(pi step / T_max)) / 2.
class CosineAnnealingLR : public LRScheduler {
 public:
  CosineAnnealingLR(Optimizer& opt, std::int64_t T_max, double eta_min = 0);

 protected:
  double rate(double base, std::int64_t s) const override;

 private:
  std::int64_t T_;
  double min_;
};

/// lr = base * factor, factor going linearly from start_factor to end_factor over
/// total_iters steps and staying there.
class LinearLR : public LRScheduler {
 public:
  LinearLR(Optimizer& opt, double start_factor = 1.0 / 3, double end_factor = 1.0, std::int64_t total_iters = 5);

 protected:
  double rate(double base, std::int64_t s) const override;

 private:
  double start_, end_;
  std::int64_t total_;
};

#if LAZYTENSOR_HEADER_DEFINITIONS
LAZYTENSOR_INLINE LRScheduler::LRScheduler(Optimizer& opt) : opt_(opt) {
  for (std::size_t g = 0; g < opt.num_param_groups(); ++g) base_.push_back(opt.lr(g));
}

LAZYTENSOR_INLINE std::vector<double> LRScheduler::get_last_lr() const {
  std::vector<double> v;
  for (std::size_t g = 0; g < opt_.num_param_groups(); ++g) v.push_back(opt_.lr(g));
  return v;
}

LAZYTENSOR_INLINE void LRScheduler::apply() {
  for (std::size_t g = 0; g < base_.size(); ++g) opt_.set_lr(rate(base_[g], count_), g);
}

LAZYTENSOR_INLINE StepLR::StepLR(Optimizer& opt, std::int64_t step_size, double gamma)
    : LRScheduler(opt), size_(step_size), gamma_(gamma) {
  if (step_size <= 0) throw Error("StepLR: step_size must be positive, got " + std::to_string(step_size));
}

LAZYTENSOR_INLINE double StepLR::rate(double base, std::int64_t s) const {
  return base * std::pow(gamma_, static_cast<double>(s / size_));
}

LAZYTENSOR_INLINE CosineAnnealingLR::CosineAnnealingLR(Optimizer& opt, std::int64_t T_max, double eta_min)
    : LRScheduler(opt), T_(T_max), min_(eta_min) {
  if (T_max <= 0) throw Error("CosineAnnealingLR: T_max must be positive, got " + std::to_string(T_max));
}

LAZYTENSOR_INLINE double CosineAnnealingLR::rate(double base, std::int64_t s) const {
  return min_ + (base - min_) * (1 + std::cos(std::numbers::pi * static_cast<double>(s) / static_cast<double>(T_))) / 2;
}

LAZYTENSOR_INLINE LinearLR::LinearLR(Optimizer& opt, double start_factor, double end_factor, std::int64_t total_iters)
    : LRScheduler(opt), start_(start_factor), end_(end_factor), total_(total_iters) {
  if (start_factor <= 0 || start_factor > 1 || end_factor < 0 || end_factor > 1) {
    throw Error("LinearLR: expected 0 < start_factor <= 1 and 0 <= end_factor <= 1, got " +
                std::to_string(start_factor) + " and " + std::to_string(end_factor));
  }
  if (total_iters <= 0) throw Error("LinearLR: total_iters must be positive, got " + std::to_string(total_iters));
  // As torch, the first rate applies from construction on.
  for (std::size_t g = 0; g < opt.num_param_groups(); ++g) opt.set_lr(opt.lr(g) * start_factor, g);
}

LAZYTENSOR_INLINE double LinearLR::rate(double base, std::int64_t s) const {
  const double f = s >= total_ ? end_ : start_ + (end_ - start_) * static_cast<double>(s) / static_cast<double>(total_);
  return base * f;
}
#endif  // LAZYTENSOR_HEADER_DEFINITIONS

}  // namespace lazy::optim
// ---- end lazytensor/optim/lr_scheduler.hpp ----
// ---- begin lazytensor/optim/sgd.hpp ----
// SGD with momentum, dampening, Nesterov and weight decay, as torch.optim.SGD.

#include <string>
#include <type_traits>
#include <vector>


namespace lazy::optim {

/// Options of SGD (libtorch's SGDOptions).
struct SGDOptions {
  SGDOptions(double lr) : lr_(lr) {}  // NOLINT: SGD(params, 0.1) reads naturally
  LAZY_ARG(double, lr);
  LAZY_ARG(double, momentum) = 0;
  LAZY_ARG(double, dampening) = 0;
  LAZY_ARG(double, weight_decay) = 0;
  LAZY_ARG(bool, nesterov) = false;

 public:
  std::map<std::string, std::string> to_map() const;
  static SGDOptions from_map(const std::map<std::string, std::string>& m);
};

/// Stochastic gradient descent (`optim::SGD`). Per parameter: buf = momentum * buf +
/// (1 - dampening) * g (g itself at the first step), then p -= lr * (nesterov ? g + momentum
/// * buf : buf), with g = grad + weight_decay * p. A class template so that its step is
/// compiled only into programs that construct one. `SGD` (`Only` = void) updates parameters
/// of every floating dtype, which a module converted at run time (Module::to, a precision
/// plugin) may hold, so its step compiles the bfloat16 and double updates too;
/// `BasicSGD<float>` takes float parameters only (DTypeError for others) and compiles the
/// float update alone: a header-only float program's lighter choice.
template <class Only = void>
class BasicSGD : public OptimizerWithOptions<SGDOptions> {
 public:
  BasicSGD(std::vector<AnyTensor> params, SGDOptions options)
      : OptimizerWithOptions({ParamGroup{std::move(params), options}}) {
    validate();
  }
  /// Parameters of one dtype.
  template <FloatingElement T>
  BasicSGD(const std::vector<Tensor<T>>& params, SGDOptions options)
      : BasicSGD(std::vector<AnyTensor>(params.begin(), params.end()), options) {}
  BasicSGD(std::vector<ParamGroup> groups) : OptimizerWithOptions(std::move(groups)) { validate(); }

  void step() override;

 protected:
  std::string type_name() const override { return "SGD"; }
  std::string type_name_of() const override { return "SGD"; }

 private:
  void validate() const;
  template <FloatingElement T>
  void update(Tensor<T> p, ParamState& st, const SGDOptions& o);
};

// (Outside the class, so not inline: see core/config.hpp.)
template <class V>
void BasicSGD<V>::step() {
  NoGradGuard guard;
  for (std::size_t gi = 0; gi < groups_.size(); ++gi) {
    const SGDOptions& o = groups_[gi].options;
    auto& ps = groups_[gi].params;
    for (std::size_t k = 0; k < ps.size(); ++k) {
      if (!ps[k].grad().defined()) continue;
      if constexpr (std::is_void_v<V>) detail::visit_floating(ps[k], "SGD", [&](auto p) { update(p, state(gi, k), o); });
      else update(ps[k].template as<V>(), state(gi, k), o);
    }
  }
}

template <class V>
template <FloatingElement T>
void BasicSGD<V>::update(Tensor<T> p, ParamState& st, const SGDOptions& o) {
  using C = compute_t<T>;  // scalars in the dtype's arithmetic: float for float and bfloat16
  const auto lr = static_cast<C>(o.lr()), mom = static_cast<C>(o.momentum()), damp = static_cast<C>(o.dampening()),
             wd = static_cast<C>(o.weight_decay());
  const Tensor<T> grad = p.grad();
  const Tensor<T> g = wd != 0 ? Tensor<T>(grad + wd * p) : grad;
  if (mom == 0) {
    p.sub_(g * lr);
    return;
  }
  auto it = st.tensors.find("momentum_buffer");
  Tensor<T> buf;
  if (it == st.tensors.end()) {
    buf = Tensor<T>(g * C(1));
    st.tensors.emplace("momentum_buffer", buf);
  } else {
    buf = it->second.template as<T>();
    buf.copy_(buf * mom + g * (1 - damp));
  }
  if (o.nesterov()) p.sub_((g + buf * mom) * lr);
  else p.sub_(buf * lr);
  ++st.step;
}

template <class V>
void BasicSGD<V>::validate() const {
  for (const auto& g : groups_) {
    if constexpr (!std::is_void_v<V>) {
      for (const auto& p : g.params) {
        if (p.dtype() != dtype_of<V>()) {
          throw DTypeError("BasicSGD<" + dtype_name(dtype_of<V>()) + ">: got a parameter of dtype " +
                           dtype_name(p.dtype()) + " (optim::SGD takes every floating dtype)");
        }
      }
    }
    const auto& o = g.options;
    if (o.lr() < 0) throw Error("SGD: invalid learning rate " + std::to_string(o.lr()));
    if (o.momentum() < 0) throw Error("SGD: invalid momentum value " + std::to_string(o.momentum()));
    if (o.weight_decay() < 0) throw Error("SGD: invalid weight_decay value " + std::to_string(o.weight_decay()));
    if (o.nesterov() && (o.momentum() <= 0 || o.dampening() != 0)) {
      throw Error("SGD: Nesterov momentum requires a momentum and zero dampening");
    }
  }
}

/// Stochastic gradient descent, as torch.optim.SGD.
using SGD = BasicSGD<>;

#if LAZYTENSOR_HEADER_DEFINITIONS
LAZYTENSOR_INLINE std::map<std::string, std::string> SGDOptions::to_map() const {
  return {{"lr", detail::format_option(lr_)},
          {"momentum", detail::format_option(momentum_)},
          {"dampening", detail::format_option(dampening_)},
          {"weight_decay", detail::format_option(weight_decay_)},
          {"nesterov", nesterov_ ? "1" : "0"}};
}

LAZYTENSOR_INLINE SGDOptions SGDOptions::from_map(const std::map<std::string, std::string>& m) {
  SGDOptions o(detail::parse_option(m, "lr"));
  o.momentum(detail::parse_option(m, "momentum"))
      .dampening(detail::parse_option(m, "dampening"))
      .weight_decay(detail::parse_option(m, "weight_decay"))
      .nesterov(detail::parse_option(m, "nesterov") != 0);
  return o;
}
#endif  // LAZYTENSOR_HEADER_DEFINITIONS

}  // namespace lazy::optim

// Instantiated once in the compiled runtime (core/config.hpp).
#define LAZYTENSOR_OPTIM_SGD_INSTANCES(P)                                         \
  P template class lazy::optim::OptimizerWithOptions<lazy::optim::SGDOptions>; \
  P template class lazy::optim::BasicSGD<void>;                                 \
  P template class lazy::optim::BasicSGD<float>;
#if LAZYTENSOR_EXPLICIT_INSTANTIATION
LAZYTENSOR_OPTIM_SGD_INSTANCES(extern)
#endif
// ---- end lazytensor/optim/sgd.hpp ----
// ---- end lazytensor/optim.hpp ----
// ---- begin lazytensor/spmd.hpp ----
// lazy::spmd: sharding meshes, PyTorch/XLA's SPMD (torch_xla.distributed.spmd). One program
// thread drives every device: use_spmd(), a Mesh (or HybridMesh), mark_sharding with a
// partition spec, then ordinary tensor code; the partitioner runs each sharded statement
// as one node per device, and reading a sharded tensor gathers it.

// ---- begin lazytensor/spmd/mark_sharding.hpp ----
// Annotating tensors with a sharding (mark_sharding, clear_sharding) and looking at the
// result: local_shards, sharding_spec, visualize_tensor_sharding.

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

// ---- begin lazytensor/spmd/mode.hpp ----
// SPMD mode (torch_xla's xr.use_spmd()): one program thread drives every device; tensors
// annotated with a sharding live as pieces on the mesh's devices.

// ---- begin lazytensor/spmd/sharding.hpp ----
// Partition specs (how a tensor's dimensions map onto mesh axes) and the resolved sharding
// of one tensor: which block of it each device of the mesh holds.

#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>
#include <utility>
#include <variant>
#include <vector>

// ---- begin lazytensor/spmd/mesh.hpp ----
// Meshes: the logical arrangement of devices that shardings name (torch_xla's Mesh and
// HybridMesh), and the process's global mesh.

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>


namespace lazy::spmd {

/// The device ids of a mesh arranged in its shape (what torch_xla's get_logical_mesh
/// returns as a numpy array): `device_ids` row-major in `shape`.
struct LogicalMesh {
  std::vector<std::int64_t> shape;
  std::vector<int> device_ids;
  /// The id at mesh coordinates `coords` (one per axis).
  int at(const std::vector<std::int64_t>& coords) const;
};

/// A logical n-d array of devices (torch_xla.distributed.spmd.Mesh). `device_ids` are laid
/// out row-major in `mesh_shape`; axes may be named (`axis_names`, one per axis, distinct),
/// else each is named by its index ("0", "1", ...). A partition spec refers to the axes by
/// index or name. Error (lazy::Error, naming the values) when the shape's product is not
/// the number of ids, an id repeats or names no device of this process, or names repeat.
class Mesh {
 public:
  Mesh(std::vector<int> device_ids, std::vector<std::int64_t> mesh_shape, std::vector<std::string> axis_names = {});

  /// The axes in order, as (name, size).
  std::vector<std::pair<std::string, std::int64_t>> shape() const;
  /// The ids in mesh order (row-major over the axes).
  const std::vector<int>& device_ids() const { return ids_; }
  /// The size of each axis.
  const std::vector<std::int64_t>& mesh_shape() const { return shape_; }
  /// Each axis's name (the index as text for unnamed axes).
  const std::vector<std::string>& axis_names() const { return names_; }
  /// The ids arranged in the mesh's shape.
  LogicalMesh get_logical_mesh() const { return {shape_, ids_}; }
  /// Number of devices.
  int size() const { return static_cast<int>(ids_.size()); }
  /// Number of axes.
  int rank() const { return static_cast<int>(shape_.size()); }

  /// The coordinates of the device at mesh position `position` (row-major).
  std::vector<std::int64_t> coordinates(int position) const;
  /// The mesh position of device `device_id`, or -1.
  int position_of(int device_id) const;
  /// Text such as `Mesh(shape=("data": 2, "model": 2), devices=[0, 1, 2, 3])`.
  std::string str() const;

  friend bool operator==(const Mesh& a, const Mesh& b) {
    return a.ids_ == b.ids_ && a.shape_ == b.shape_ && a.names_ == b.names_;
  }

 private:
  std::vector<int> ids_;
  std::vector<std::int64_t> shape_;
  std::vector<std::string> names_;
};

/// A mesh for devices grouped in slices (torch_xla's HybridMesh): the mesh's axis i has
/// size `dcn_mesh_shape[i] * ici_mesh_shape[i]`, the DCN part outer. Device ids follow
/// the slices: slice s (the row-major index of the DCN coordinates) holds ids
/// [s * S, (s + 1) * S), S the product of `ici_mesh_shape`, laid out row-major over the
/// ICI coordinates. Every device of the process takes part; Error when the shapes'
/// ranks differ or their products do not make the device count.
class HybridMesh : public Mesh {
 public:
  HybridMesh(std::vector<std::int64_t> ici_mesh_shape, std::vector<std::int64_t> dcn_mesh_shape,
             std::vector<std::string> axis_names = {});
};

/// Sets the mesh that APIs taking no mesh use (torch_xla's set_global_mesh).
void set_global_mesh(const Mesh& mesh);
/// The global mesh, if one was set.
std::optional<Mesh> get_global_mesh();

namespace detail {
/// The device ids a HybridMesh lays out (see HybridMesh).
std::vector<int> hybrid_device_ids(const std::vector<std::int64_t>& ici, const std::vector<std::int64_t>& dcn);
/// The elementwise product of the two shapes.
std::vector<std::int64_t> hybrid_shape(const std::vector<std::int64_t>& ici, const std::vector<std::int64_t>& dcn);
/// "(6, 4)": a shape as JAX's messages print it.
std::string tuple_text(const std::vector<std::int64_t>& sizes);
}  // namespace detail

}  // namespace lazy::spmd

#if LAZYTENSOR_HEADER_DEFINITIONS
#include <algorithm>
#include <mutex>
#include <set>

namespace lazy::spmd {

LAZYTENSOR_INLINE int LogicalMesh::at(const std::vector<std::int64_t>& coords) const {
  if (coords.size() != shape.size())
    throw Error("LogicalMesh::at: expected " + std::to_string(shape.size()) + " coordinates, got " +
                std::to_string(coords.size()));
  std::int64_t p = 0;
  for (std::size_t i = 0; i < shape.size(); ++i) {
    if (coords[i] < 0 || coords[i] >= shape[i])
      throw Error("LogicalMesh::at: coordinate " + std::to_string(coords[i]) + " out of range for axis " +
                  std::to_string(i) + " of size " + std::to_string(shape[i]));
    p = p * shape[i] + coords[i];
  }
  return device_ids[static_cast<std::size_t>(p)];
}

LAZYTENSOR_INLINE std::string detail::tuple_text(const std::vector<std::int64_t>& sizes) {
  std::string s = "(";
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(sizes[i]);
  }
  if (sizes.size() == 1) s += ",";
  return s + ")";
}

LAZYTENSOR_INLINE Mesh::Mesh(std::vector<int> device_ids, std::vector<std::int64_t> mesh_shape,
                             std::vector<std::string> axis_names)
    : ids_(std::move(device_ids)), shape_(std::move(mesh_shape)), names_(std::move(axis_names)) {
  if (shape_.empty()) throw Error("Mesh: expected at least one mesh axis, got an empty mesh shape");
  std::int64_t product = 1;
  for (auto s : shape_) {
    if (s < 1) throw Error("Mesh: mesh shape " + detail::tuple_text(shape_) + " has a size below 1");
    product *= s;
  }
  if (product != static_cast<std::int64_t>(ids_.size()))
    throw Error("Mesh: mesh shape " + detail::tuple_text(shape_) + " holds " + std::to_string(product) +
                " devices, but " + std::to_string(ids_.size()) + " device ids were given");
  const int available = device_count();
  std::set<int> seen;
  for (int id : ids_) {
    if (id < 0 || id >= available)
      throw Error("Mesh: device id " + std::to_string(id) + " names no device of this process (it has " +
                  std::to_string(available) + ": ids 0.." + std::to_string(available - 1) +
                  "; LAZYTENSOR_NUM_DEVICES sets the count)");
    if (!seen.insert(id).second) throw Error("Mesh: device id " + std::to_string(id) + " appears twice");
  }
  if (names_.empty()) {
    for (std::size_t i = 0; i < shape_.size(); ++i) names_.push_back(std::to_string(i));
  } else if (names_.size() != shape_.size()) {
    throw Error("Mesh: " + std::to_string(names_.size()) + " axis names given for a mesh of " +
                std::to_string(shape_.size()) + " axes " + detail::tuple_text(shape_));
  }
  std::set<std::string> names;
  for (const auto& n : names_)
    if (!names.insert(n).second) throw Error("Mesh: axis name \"" + n + "\" appears twice");
}

LAZYTENSOR_INLINE std::vector<std::pair<std::string, std::int64_t>> Mesh::shape() const {
  std::vector<std::pair<std::string, std::int64_t>> r;
  for (std::size_t i = 0; i < shape_.size(); ++i) r.emplace_back(names_[i], shape_[i]);
  return r;
}

LAZYTENSOR_INLINE std::vector<std::int64_t> Mesh::coordinates(int position) const {
  std::vector<std::int64_t> c(shape_.size());
  std::int64_t p = position;
  for (std::size_t i = shape_.size(); i-- > 0;) {
    c[i] = p % shape_[i];
    p /= shape_[i];
  }
  return c;
}

LAZYTENSOR_INLINE int Mesh::position_of(int device_id) const {
  auto it = std::find(ids_.begin(), ids_.end(), device_id);
  return it == ids_.end() ? -1 : static_cast<int>(it - ids_.begin());
}

LAZYTENSOR_INLINE std::string Mesh::str() const {
  std::string s = "Mesh(shape=(";
  for (std::size_t i = 0; i < shape_.size(); ++i) {
    if (i) s += ", ";
    s += "\"" + names_[i] + "\": " + std::to_string(shape_[i]);
  }
  s += "), devices=[";
  for (std::size_t i = 0; i < ids_.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(ids_[i]);
  }
  return s + "])";
}

LAZYTENSOR_INLINE std::vector<std::int64_t> detail::hybrid_shape(const std::vector<std::int64_t>& ici,
                                                                  const std::vector<std::int64_t>& dcn) {
  if (ici.size() != dcn.size())
    throw Error("HybridMesh: ici_mesh_shape " + tuple_text(ici) + " and dcn_mesh_shape " + tuple_text(dcn) +
                " must have the same number of axes");
  std::vector<std::int64_t> s(ici.size());
  for (std::size_t i = 0; i < ici.size(); ++i) {
    if (ici[i] < 1 || dcn[i] < 1)
      throw Error("HybridMesh: sizes must be at least 1, got ici " + tuple_text(ici) + ", dcn " + tuple_text(dcn));
    s[i] = ici[i] * dcn[i];
  }
  return s;
}

LAZYTENSOR_INLINE std::vector<int> detail::hybrid_device_ids(const std::vector<std::int64_t>& ici,
                                                            const std::vector<std::int64_t>& dcn) {
  const auto shape = hybrid_shape(ici, dcn);
  std::int64_t total = 1, per_slice = 1;
  for (auto s : shape) total *= s;
  for (auto s : ici) per_slice *= s;
  if (total != device_count())
    throw Error("HybridMesh: ici " + tuple_text(ici) + " times dcn " + tuple_text(dcn) + " makes " +
                std::to_string(total) + " devices, but this process has " + std::to_string(device_count()));
  std::vector<int> ids(static_cast<std::size_t>(total));
  const std::size_t rank = shape.size();
  std::vector<std::int64_t> c(rank, 0);
  for (std::int64_t p = 0; p < total; ++p) {
    // Mesh coordinate c[i] = dcn coordinate * ici[i] + ici coordinate.
    std::int64_t slice = 0, within = 0;
    for (std::size_t i = 0; i < rank; ++i) {
      slice = slice * dcn[i] + c[i] / ici[i];
      within = within * ici[i] + c[i] % ici[i];
    }
    ids[static_cast<std::size_t>(p)] = static_cast<int>(slice * per_slice + within);
    for (std::size_t i = rank; i-- > 0;) {
      if (++c[i] < shape[i]) break;
      c[i] = 0;
    }
  }
  return ids;
}

LAZYTENSOR_INLINE HybridMesh::HybridMesh(std::vector<std::int64_t> ici_mesh_shape, std::vector<std::int64_t> dcn_mesh_shape,
                                         std::vector<std::string> axis_names)
    : Mesh(detail::hybrid_device_ids(ici_mesh_shape, dcn_mesh_shape), detail::hybrid_shape(ici_mesh_shape, dcn_mesh_shape),
           std::move(axis_names)) {}

namespace detail {
struct GlobalMesh {
  std::mutex mu;
  std::optional<Mesh> mesh;
};
inline GlobalMesh& global_mesh() {
  static GlobalMesh g;
  return g;
}
}  // namespace detail

LAZYTENSOR_INLINE void set_global_mesh(const Mesh& mesh) {
  auto& g = detail::global_mesh();
  std::lock_guard lock(g.mu);
  g.mesh = mesh;
}

LAZYTENSOR_INLINE std::optional<Mesh> get_global_mesh() {
  auto& g = detail::global_mesh();
  std::lock_guard lock(g.mu);
  return g.mesh;
}

}  // namespace lazy::spmd
#endif  // LAZYTENSOR_HEADER_DEFINITIONS
// ---- end lazytensor/spmd/mesh.hpp ----

namespace lazy::spmd {

/// One mesh axis in a partition spec: its index (`0`) or its name (`"data"`).
class AxisRef {
 public:
  AxisRef(int index) : ref_(index) {}
  AxisRef(const char* name) : ref_(std::string(name)) {}
  AxisRef(std::string name) : ref_(std::move(name)) {}
  const std::variant<int, std::string>& ref() const { return ref_; }

 private:
  std::variant<int, std::string> ref_;
};

/// One entry of a partition spec, for one tensor dimension: replicated (`std::nullopt`),
/// one mesh axis (`0`, `"data"`), or a braced list of axes (`{"x", "y"}`) that shards the
/// dimension over all of them, the first major.
class PartitionEntry {
 public:
  PartitionEntry(std::nullopt_t) {}
  PartitionEntry(int axis) : axes_{AxisRef(axis)} {}
  PartitionEntry(const char* axis) : axes_{AxisRef(axis)} {}
  PartitionEntry(std::string axis) : axes_{AxisRef(std::move(axis))} {}
  PartitionEntry(std::initializer_list<AxisRef> axes) : axes_(axes) {}
  /// The axes, major first (empty: replicated).
  const std::vector<AxisRef>& axes() const { return axes_; }

 private:
  std::vector<AxisRef> axes_;
};

/// A partition spec: one entry per tensor dimension (`{0, std::nullopt}`, `{"data"}`).
/// Shorter specs are padded with replicated entries; mesh axes it leaves out replicate.
using PartitionSpec = std::vector<PartitionEntry>;

/// The resolved sharding of a tensor of a given shape: for each dimension, the mesh axes
/// (indices, major first) that split it. Devices whose coordinates differ only along
/// unused axes hold the same block (replicas).
struct Sharding {
  Mesh mesh;
  std::vector<std::vector<int>> dims;

  /// Number of blocks along dimension `d` (the product of its axes' sizes).
  std::int64_t parts(int d) const;
  /// True when no dimension is split.
  bool replicated() const;
  /// The block index along dimension `d` of the device at mesh position `position`.
  std::int64_t part_of(int position, int d) const;
  /// The [begin, end) range of every dimension of `global` that mesh position `position`
  /// holds.
  std::vector<std::pair<std::int64_t, std::int64_t>> block(int position, const Shape& global) const;
  /// The shape of the block every device holds.
  Shape block_shape(const Shape& global) const;
  /// The sharding as torch_xla's _get_xla_sharding_spec prints it (XLA's HloSharding
  /// text): `{replicated}`, `{devices=[2,1]0,1}`, or with replication along unused axes
  /// `{devices=[2,1,2]0,1,2,3 last_tile_dim_replicate}`.
  std::string str() const;

  friend bool operator==(const Sharding&, const Sharding&) = default;
};

/// Resolves `spec` on `mesh` for a tensor of shape `shape`. ShardingError, naming the
/// offender, for: a spec longer than the rank, an unknown axis name or index, an axis used
/// twice, and a dimension not divisible by its axes' sizes (JAX's message:
/// `dimension 0 of shape (6, 4) must be divisible by 4 (mesh axis "x")`).
Sharding resolve_sharding(const Mesh& mesh, const PartitionSpec& spec, const Shape& shape);

/// A mesh and a partition spec, resolved against each tensor it is applied to (torch_xla's
/// ShardingSpec; `minibatch` marks specs for per-process batches of a global batch, which
/// in one process is the batch itself).
class ShardingSpec {
 public:
  ShardingSpec(Mesh mesh, PartitionSpec spec, bool minibatch = false)
      : mesh_(std::move(mesh)), spec_(std::move(spec)), minibatch_(minibatch) {}
  const Mesh& mesh() const { return mesh_; }
  const PartitionSpec& partition_spec() const { return spec_; }
  bool minibatch() const { return minibatch_; }
  /// The sharding of a tensor of `shape` (ShardingError as resolve_sharding).
  Sharding resolve(const Shape& shape) const { return resolve_sharding(mesh_, spec_, shape); }

 private:
  Mesh mesh_;
  PartitionSpec spec_;
  bool minibatch_;
};

}  // namespace lazy::spmd

#if LAZYTENSOR_HEADER_DEFINITIONS
namespace lazy::spmd {

LAZYTENSOR_INLINE std::int64_t Sharding::parts(int d) const {
  std::int64_t n = 1;
  for (int a : dims[static_cast<std::size_t>(d)]) n *= mesh.mesh_shape()[static_cast<std::size_t>(a)];
  return n;
}

LAZYTENSOR_INLINE bool Sharding::replicated() const {
  for (std::size_t d = 0; d < dims.size(); ++d)
    if (parts(static_cast<int>(d)) > 1) return false;
  return true;
}

LAZYTENSOR_INLINE std::int64_t Sharding::part_of(int position, int d) const {
  const auto c = mesh.coordinates(position);
  std::int64_t idx = 0;
  for (int a : dims[static_cast<std::size_t>(d)])
    idx = idx * mesh.mesh_shape()[static_cast<std::size_t>(a)] + c[static_cast<std::size_t>(a)];
  return idx;
}

LAZYTENSOR_INLINE std::vector<std::pair<std::int64_t, std::int64_t>> Sharding::block(int position,
                                                                                      const Shape& global) const {
  std::vector<std::pair<std::int64_t, std::int64_t>> r(static_cast<std::size_t>(global.rank()));
  for (int d = 0; d < global.rank(); ++d) {
    const std::int64_t n = parts(d), size = global[d] / n, i = part_of(position, d);
    r[static_cast<std::size_t>(d)] = {i * size, (i + 1) * size};
  }
  return r;
}

LAZYTENSOR_INLINE Shape Sharding::block_shape(const Shape& global) const {
  Shape s = global;
  for (int d = 0; d < global.rank(); ++d) s[d] = global[d] / parts(d);
  return s;
}

LAZYTENSOR_INLINE std::string Sharding::str() const {
  if (replicated()) return "{replicated}";
  const int rank = static_cast<int>(dims.size());
  // Tile dimensions: the parts of each tensor dimension, then the replicas (mesh axes no
  // dimension uses) as a last tile dimension when there are several.
  std::vector<bool> used(static_cast<std::size_t>(mesh.rank()), false);
  for (const auto& axes : dims)
    for (int a : axes) used[static_cast<std::size_t>(a)] = true;
  std::int64_t replicas = 1;
  for (int a = 0; a < mesh.rank(); ++a)
    if (!used[static_cast<std::size_t>(a)]) replicas *= mesh.mesh_shape()[static_cast<std::size_t>(a)];
  std::vector<std::int64_t> tile;
  for (int d = 0; d < rank; ++d) tile.push_back(parts(d));
  if (replicas > 1) tile.push_back(replicas);
  std::int64_t tiles = 1;
  for (auto t : tile) tiles *= t;
  std::vector<int> order(static_cast<std::size_t>(tiles), -1);
  for (int p = 0; p < mesh.size(); ++p) {
    const auto c = mesh.coordinates(p);
    std::int64_t idx = 0;
    for (int d = 0; d < rank; ++d) idx = idx * parts(d) + part_of(p, d);
    if (replicas > 1) {
      std::int64_t r = 0;
      for (int a = 0; a < mesh.rank(); ++a)
        if (!used[static_cast<std::size_t>(a)]) r = r * mesh.mesh_shape()[static_cast<std::size_t>(a)] + c[static_cast<std::size_t>(a)];
      idx = idx * replicas + r;
    }
    order[static_cast<std::size_t>(idx)] = mesh.device_ids()[static_cast<std::size_t>(p)];
  }
  std::string s = "{devices=[";
  for (std::size_t i = 0; i < tile.size(); ++i) {
    if (i) s += ",";
    s += std::to_string(tile[i]);
  }
  s += "]";
  for (std::size_t i = 0; i < order.size(); ++i) {
    if (i) s += ",";
    s += std::to_string(order[i]);
  }
  if (replicas > 1) s += " last_tile_dim_replicate";
  return s + "}";
}

LAZYTENSOR_INLINE Sharding resolve_sharding(const Mesh& mesh, const PartitionSpec& spec, const Shape& shape) {
  const int rank = shape.rank();
  if (static_cast<int>(spec.size()) > rank)
    throw ShardingError("partition spec has " + std::to_string(spec.size()) + " entries, but the tensor of shape " +
                        detail::tuple_text(shape.vec()) + " has rank " + std::to_string(rank));
  Sharding s{mesh, std::vector<std::vector<int>>(static_cast<std::size_t>(rank))};
  std::vector<bool> used(static_cast<std::size_t>(mesh.rank()), false);
  auto axis_text = [&](int a) { return "\"" + mesh.axis_names()[static_cast<std::size_t>(a)] + "\""; };
  for (std::size_t d = 0; d < spec.size(); ++d) {
    for (const auto& ref : spec[d].axes()) {
      int a = -1;
      if (const int* i = std::get_if<int>(&ref.ref())) {
        if (*i < 0 || *i >= mesh.rank())
          throw ShardingError("partition spec entry " + std::to_string(d) + ": mesh axis " + std::to_string(*i) +
                              " out of range for a mesh of " + std::to_string(mesh.rank()) + " axes");
        a = *i;
      } else {
        const auto& name = std::get<std::string>(ref.ref());
        for (int k = 0; k < mesh.rank(); ++k)
          if (mesh.axis_names()[static_cast<std::size_t>(k)] == name) a = k;
        if (a < 0) {
          std::string names;
          for (int k = 0; k < mesh.rank(); ++k) {
            if (k) names += ", ";
            names += axis_text(k);
          }
          throw ShardingError("partition spec entry " + std::to_string(d) + ": the mesh has no axis named \"" + name +
                              "\" (its axes: " + names + ")");
        }
      }
      if (used[static_cast<std::size_t>(a)])
        throw ShardingError("mesh axis " + axis_text(a) + " is used twice in the partition spec");
      used[static_cast<std::size_t>(a)] = true;
      s.dims[d].push_back(a);
    }
    const std::int64_t n = s.parts(static_cast<int>(d));
    if (shape[static_cast<int>(d)] % n != 0) {
      std::string axes;
      for (std::size_t k = 0; k < s.dims[d].size(); ++k) {
        if (k) axes += ", ";
        axes += axis_text(s.dims[d][k]);
      }
      throw ShardingError("dimension " + std::to_string(d) + " of shape " + detail::tuple_text(shape.vec()) +
                          " must be divisible by " + std::to_string(n) + " (mesh " +
                          (s.dims[d].size() == 1 ? "axis " : "axes ") + axes + ")");
    }
  }
  return s;
}

}  // namespace lazy::spmd
#endif  // LAZYTENSOR_HEADER_DEFINITIONS
// ---- end lazytensor/spmd/sharding.hpp ----
// ---- begin lazytensor/spmd/partitioner.hpp ----
// The SPMD partitioner: graph::submit hands it every node that reads a sharded value, and
// it returns the node standing for the result. Nodes with a block rule (element-wise,
// permutes, softmax, gather, one_hot, conversions) run block-wise, one node per mesh device
// on that device's graph; views keep their input's blocks when the elements stay in order;
// reductions and 2-D products run on blocks, and where the reduced or contracted dimension
// is split, the partial results are all-reduced among the devices that share the rest of
// the block. Operands sharded otherwise (or not at all) are split to the chosen blocks
// first. Other ops read the gathered value and run whole on the tensor's device (a
// synchronous gather, counted as SpmdGathers).

#include <functional>
#include <optional>

// ---- begin lazytensor/spmd/collective.hpp ----
// The collectives the partitioner inserts: an all-reduce among the devices of a group (the
// partial results of a product or reduction split along its contracted dimension). One
// node per member, each on its member's graph; when the member's executor runs it, it
// publishes its input, waits for the group, and combines every input in group order, so
// every member holds the same bits.

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <type_traits>
#include <vector>


namespace lazy::spmd {

/// How partial results combine.
enum class Combine { Sum, Prod, Max, Min };

namespace detail {

/// One round of an all-reduce: the group's inputs, published as members arrive.
class ReduceRound {
 public:
  ReduceRound(Combine op, std::vector<graph::Device*> members);
  /// Member `slot` publishes `in` and waits for every member; returns the combination of all
  /// inputs in slot order as a new buffer of `dev`. CollectiveError when a member's device
  /// fails before arriving (its step stopped), CollectiveTimeout after dist's timeout.
  std::shared_ptr<Buffer> run(int slot, std::shared_ptr<Buffer> in, DType dtype, std::int64_t numel, graph::Device& dev);
  Combine op() const { return op_; }
  int size() const { return static_cast<int>(members_.size()); }

 private:
  Combine op_;
  std::vector<graph::Device*> members_;
  std::vector<std::uint64_t> failures_;  // each member device's failure count when traced
  std::mutex mu_;
  std::condition_variable cv_;
  int arrived_ = 0, done_ = 0;
  std::atomic<int> arrived_fast_{0};  // arrived_, readable without the lock (spinning)
  std::atomic<int> done_fast_{0};     // members done reading, likewise
  std::vector<std::shared_ptr<Buffer>> inputs_;
};

/// Combines `n` arrays of `numel` elements of `dtype` into `out`, in order.
void combine(Combine op, DType dtype, const std::vector<const void*>& in, void* out, std::int64_t numel);

}  // namespace detail

/// A member's part of an all-reduce (NodeKind::Collective): its value is the group's
/// combination. Takes the device's previous SPMD collective as an extra input, so each
/// device meets its collectives in program order.
class AllReduceNode final : public graph::Node {
 public:
  AllReduceNode(graph::NodePtr in, std::shared_ptr<detail::ReduceRound> round, int slot, graph::NodePtr previous);
  std::string op_name() const override { return "spmd_all_reduce"; }
  std::string describe() const override;
  std::uint64_t structural_hash() const override;

 protected:
  void compute(graph::ExecContext& ctx) override;

 private:
  std::shared_ptr<detail::ReduceRound> round_;
  int slot_;
};

/// Submits an all-reduce over `pieces` (one per member, each on its own device, in the
/// group's combining order) and returns the members' results in the same order. Counted
/// as SpmdAllReduces and SpmdAllReduceBytes (each member's input).
std::vector<graph::NodePtr> all_reduce(const std::vector<graph::NodePtr>& pieces, Combine op);

}  // namespace lazy::spmd

#if LAZYTENSOR_HEADER_DEFINITIONS
#include <chrono>
#include <map>
#include <thread>


namespace lazy::spmd {
namespace detail {

LAZYTENSOR_INLINE ReduceRound::ReduceRound(Combine op, std::vector<graph::Device*> members)
    : op_(op), members_(std::move(members)), inputs_(members_.size()) {
  for (auto* d : members_) failures_.push_back(d->failures());
}

LAZYTENSOR_INLINE std::shared_ptr<Buffer> ReduceRound::run(int slot, std::shared_ptr<Buffer> in, DType dtype,
                                                           std::int64_t numel, graph::Device& dev) {
  const int n = size();
  std::unique_lock lock(mu_);
  inputs_[static_cast<std::size_t>(slot)] = std::move(in);
  if (++arrived_ == n) cv_.notify_all();
  arrived_fast_.store(arrived_, std::memory_order_release);
  if (arrived_ < n) {
    // Members of a step arrive close together: spin, then yield, before sleeping (a
    // sleeping waiter's wake-up costs tens of microseconds on a VM; dist waits alike).
    lock.unlock();
    const auto start = std::chrono::steady_clock::now();
    for (int spins = 0; arrived_fast_.load(std::memory_order_acquire) < n; ++spins) {
      if (spins < 2000) continue;
      if (std::chrono::steady_clock::now() - start > std::chrono::milliseconds(2)) break;
      std::this_thread::yield();
    }
    lock.lock();
  }
  const auto deadline = std::chrono::steady_clock::now() + dist::collective_timeout();
  while (arrived_ < n) {
    cv_.wait_for(lock, std::chrono::milliseconds(2));
    for (std::size_t m = 0; m < members_.size() && arrived_ < n; ++m) {
      if (!inputs_[m] && members_[m]->failures() != failures_[m])
        throw CollectiveError("SPMD all-reduce: " + members_[m]->str() +
                              " failed before reaching it (its step stopped; the error surfaces there)");
    }
    if (arrived_ < n && std::chrono::steady_clock::now() > deadline)
      throw CollectiveTimeout("SPMD all-reduce: waited longer than the collective timeout for " +
                              std::to_string(n - arrived_) + " of " + std::to_string(n) + " devices");
  }
  std::vector<const void*> ptrs;
  for (const auto& b : inputs_) ptrs.push_back(b->data());
  lock.unlock();
  auto out = dev.pool().acquire(padded_bytes(numel, dtype_size(dtype)));
  combine(op_, dtype, ptrs, out->data(), numel);
  // Every member lets go of its own input only once all have read it, on its own thread:
  // a buffer whose last reference another device dropped could be donated (overwritten)
  // here with nothing ordering that device's reads before the write.
  lock.lock();
  if (++done_ == n) cv_.notify_all();
  done_fast_.store(done_, std::memory_order_release);
  if (done_ < n) {
    lock.unlock();
    for (int spins = 0; done_fast_.load(std::memory_order_acquire) < n; ++spins) {
      if (spins >= 2000) std::this_thread::yield();
    }
    lock.lock();
  }
  inputs_[static_cast<std::size_t>(slot)].reset();
  return out;
}

template <class T, class Acc>
void combine_as(Combine op, const std::vector<const void*>& in, void* out, std::int64_t numel) {
  T* o = static_cast<T*>(out);
  for (std::int64_t i = 0; i < numel; ++i) {
    Acc acc = static_cast<Acc>(static_cast<const T*>(in[0])[i]);
    for (std::size_t k = 1; k < in.size(); ++k) {
      const Acc v = static_cast<Acc>(static_cast<const T*>(in[k])[i]);
      switch (op) {
        // Integers wrap (as dist's reductions): computed unsigned, where overflow is defined.
        case Combine::Sum:
          if constexpr (std::is_integral_v<Acc>)
            acc = static_cast<Acc>(static_cast<std::uint64_t>(acc) + static_cast<std::uint64_t>(v));
          else
            acc = static_cast<Acc>(acc + v);
          break;
        case Combine::Prod:
          if constexpr (std::is_integral_v<Acc>)
            acc = static_cast<Acc>(static_cast<std::uint64_t>(acc) * static_cast<std::uint64_t>(v));
          else
            acc = static_cast<Acc>(acc * v);
          break;
        // NaN propagates, as the reductions' max/min do.
        case Combine::Max: acc = (v > acc || v != v) && acc == acc ? v : acc; break;
        case Combine::Min: acc = (v < acc || v != v) && acc == acc ? v : acc; break;
      }
    }
    o[i] = static_cast<T>(acc);
  }
}

template <class T>
void sum_into(const std::vector<const void*>& in, void* out, std::int64_t numel) {
  // Member after member into the output: the inner loop vectorizes; the order of the
  // additions is the same as element by element in group order.
  T* o = static_cast<T*>(out);
  const T* a = static_cast<const T*>(in[0]);
  for (std::int64_t i = 0; i < numel; ++i) o[i] = a[i];
  for (std::size_t k = 1; k < in.size(); ++k) {
    const T* b = static_cast<const T*>(in[k]);
    for (std::int64_t i = 0; i < numel; ++i) o[i] += b[i];
  }
}

LAZYTENSOR_INLINE void combine(Combine op, DType dtype, const std::vector<const void*>& in, void* out, std::int64_t numel) {
  if (op == Combine::Sum && dtype == DType::Float32) return sum_into<float>(in, out, numel);
  if (op == Combine::Sum && dtype == DType::Float64) return sum_into<double>(in, out, numel);
  switch (dtype) {
    case DType::Float32: return combine_as<float, float>(op, in, out, numel);
    case DType::Float64: return combine_as<double, double>(op, in, out, numel);
    case DType::BFloat16: return combine_as<bfloat16, float>(op, in, out, numel);
    case DType::Int32: return combine_as<std::int32_t, std::int64_t>(op, in, out, numel);
    case DType::Int64: return combine_as<std::int64_t, std::int64_t>(op, in, out, numel);
    case DType::Bool: {
      // Sum and Max act as or, Prod and Min as and (torch.distributed's bool semantics).
      auto* o = static_cast<bool*>(out);
      const bool any = op == Combine::Sum || op == Combine::Max;
      for (std::int64_t i = 0; i < numel; ++i) {
        bool acc = static_cast<const bool*>(in[0])[i];
        for (std::size_t k = 1; k < in.size(); ++k) {
          const bool v = static_cast<const bool*>(in[k])[i];
          acc = any ? (acc || v) : (acc && v);
        }
        o[i] = acc;
      }
      return;
    }
  }
}

}  // namespace detail

LAZYTENSOR_INLINE AllReduceNode::AllReduceNode(graph::NodePtr in, std::shared_ptr<detail::ReduceRound> round, int slot,
                                               graph::NodePtr previous)
    : Node(graph::NodeKind::Collective, in->dtype(), in->shape(), in->device(),
           previous ? std::vector<graph::NodePtr>{in, previous} : std::vector<graph::NodePtr>{in}),
      round_(std::move(round)), slot_(slot) {}

LAZYTENSOR_INLINE std::string AllReduceNode::describe() const {
  static const char* names[] = {"sum", "prod", "max", "min"};
  return std::string("spmd_all_reduce(%0, ") + names[static_cast<int>(round_->op())] + ", group of " +
         std::to_string(round_->size()) + ")";
}

LAZYTENSOR_INLINE std::uint64_t AllReduceNode::structural_hash() const {
  return graph::hash_combine(graph::hash_combine(Node::structural_hash(), static_cast<std::uint64_t>(round_->op())),
                             static_cast<std::uint64_t>(round_->size() * 64 + slot_));
}

LAZYTENSOR_INLINE void AllReduceNode::compute(graph::ExecContext& ctx) {
  set_buffer(round_->run(slot_, inputs()[0]->buffer(), dtype(), numel(), ctx.device));
}

LAZYTENSOR_INLINE std::vector<graph::NodePtr> all_reduce(const std::vector<graph::NodePtr>& pieces, Combine op) {
  static auto& count = core::counter("SpmdAllReduces");
  static auto& bytes = core::counter("SpmdAllReduceBytes");
  // Each device's last collective, so that its collectives run in program order (traced
  // by the program thread only).
  static std::map<const graph::Device*, std::weak_ptr<graph::Node>> last;
  count.add();
  std::vector<graph::Device*> members;
  for (const auto& p : pieces) members.push_back(p->device());
  auto round = std::make_shared<detail::ReduceRound>(op, members);
  std::vector<graph::NodePtr> out;
  for (std::size_t i = 0; i < pieces.size(); ++i) {
    bytes.add(pieces[i]->numel() * static_cast<std::int64_t>(dtype_size(pieces[i]->dtype())));
    auto& prev = last[members[i]];
    graph::NodePtr before = prev.lock();
    if (before && !before->pending()) before.reset();
    auto node = graph::submit_unpartitioned(
        std::make_shared<AllReduceNode>(pieces[i], round, static_cast<int>(i), std::move(before)));
    prev = node;
    out.push_back(std::move(node));
  }
  return out;
}

}  // namespace lazy::spmd
#endif  // LAZYTENSOR_HEADER_DEFINITIONS
// ---- end lazytensor/spmd/collective.hpp ----
// ---- begin lazytensor/spmd/sharded_node.hpp ----
// The value of a sharded tensor: one piece per mesh device, each a node on its own device
// (computed by that device's steps), and the whole value, gathered only when read.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>


namespace lazy::spmd {

/// The whole value of a tensor sharded over a mesh (NodeKind::Sharded). It holds one piece
/// per mesh position (devices holding the same block hold equal pieces), each behind a
/// handle registered with its device, so every device's mark_step computes its piece. The
/// node itself is never traced or planned: graph::submit hands every node reading it to
/// the partitioner, and reading it (item(), to_vector(), a partitioner fallback) gathers
/// the blocks into one buffer on the tensor's device.
class ShardedNode final : public graph::Node {
 public:
  ShardedNode(Sharding sharding, std::vector<graph::NodePtr> pieces, DType dtype, Shape shape,
              graph::Device* device);

  const Sharding& sharding() const { return sharding_; }
  /// The piece at mesh position `position` (on device `mesh.device_ids()[position]`).
  const graph::NodePtr& shard(int position) const { return shards_[static_cast<std::size_t>(position)]->node; }
  int num_shards() const { return static_cast<int>(shards_.size()); }
  /// Hands every device its pending work when a piece is still pending: pieces may wait
  /// for each other in collectives, so none is waited for before all are handed out.
  void hand_out_pieces() const;

  std::string op_name() const override { return "sharded"; }
  std::string describe() const override { return sharding_.str(); }

 protected:
  /// The gather: each distinct block once, from the first position holding it.
  void compute(graph::ExecContext& ctx) override;

 private:
  Sharding sharding_;
  std::vector<std::shared_ptr<graph::TensorImpl>> shards_;
};

/// `n` as a sharded node, or null.
inline const ShardedNode* as_sharded(const graph::NodePtr& n) {
  return n && n->kind() == graph::NodeKind::Sharded ? static_cast<const ShardedNode*>(n.get()) : nullptr;
}

/// The engine device of a mesh device id.
inline graph::Device& mesh_device(int id) { return graph::DeviceRegistry::get().device(id); }

namespace detail {

/// A [begin, end) range per dimension.
using Ranges = std::vector<std::pair<std::int64_t, std::int64_t>>;

/// Copies a box of `box` elements per dimension between two row-major arrays of `esize`-byte
/// elements: from `src` (shape `src_shape`) starting at `src_at` to `dst` (shape
/// `dst_shape`) starting at `dst_at`, innermost runs by memcpy.
void copy_box(const std::byte* src, const Shape& src_shape, const std::vector<std::int64_t>& src_at, std::byte* dst,
              const Shape& dst_shape, const std::vector<std::int64_t>& dst_at, const std::vector<std::int64_t>& box,
              std::size_t esize);

/// The block `ranges` of materialized `value`, as data on `dev`, copied into `dev`'s pool.
/// The whole value on its own device shares the buffer (buffers are immutable; donation
/// needs a sole holder). Devices never share a buffer: when the other device's reference is
/// the last, this device could donate it while the other's reads are unordered with the
/// write (shared_ptr's use_count is a relaxed read).
graph::NodePtr block_of(const graph::NodePtr& value, const Ranges& ranges, graph::Device& dev);

/// Splits `value` (materialized here; a sharded value is gathered first) over `sharding`.
/// Counted as SpmdTransfers / SpmdTransferBytes (bytes copied to other devices).
graph::NodePtr shard_value(const graph::NodePtr& value, const Sharding& sharding);

}  // namespace detail
}  // namespace lazy::spmd

#if LAZYTENSOR_HEADER_DEFINITIONS
#include <cstring>


namespace lazy::spmd {

LAZYTENSOR_INLINE ShardedNode::ShardedNode(Sharding sharding, std::vector<graph::NodePtr> pieces, DType dtype, Shape shape,
                                           graph::Device* device)
    : Node(graph::NodeKind::Sharded, dtype, shape, device), sharding_(std::move(sharding)) {
  shards_.reserve(pieces.size());
  for (auto& p : pieces) {
    graph::Device* dev = p->device();
    auto impl = std::make_shared<graph::TensorImpl>(std::move(p));
    dev->register_handle(impl);
    shards_.push_back(std::move(impl));
  }
}

LAZYTENSOR_INLINE void ShardedNode::hand_out_pieces() const {
  for (const auto& s : shards_) {
    if (s->node->pending()) {
      graph::step_all_devices();
      return;
    }
  }
}

LAZYTENSOR_INLINE void ShardedNode::compute(graph::ExecContext& ctx) {
  static auto& gathers = core::counter("SpmdGathers");
  gathers.add();
  auto buf = allocate_output(ctx, false);
  const Shape global = shape();
  std::int64_t blocks = 1;
  for (int d = 0; d < global.rank(); ++d) blocks *= sharding_.parts(d);
  std::vector<bool> done(static_cast<std::size_t>(blocks), false);
  const std::size_t esize = dtype_size(dtype());
  hand_out_pieces();
  for (int p = 0; p < num_shards(); ++p) {
    std::int64_t b = 0;
    for (int d = 0; d < global.rank(); ++d) b = b * sharding_.parts(d) + sharding_.part_of(p, d);
    if (done[static_cast<std::size_t>(b)]) continue;
    done[static_cast<std::size_t>(b)] = true;
    const graph::NodePtr& piece = shard(p);
    graph::materialize(piece);
    const auto ranges = sharding_.block(p, global);
    std::vector<std::int64_t> at, box;
    for (const auto& [b0, b1] : ranges) {
      at.push_back(b0);
      box.push_back(b1 - b0);
    }
    detail::copy_box(static_cast<const std::byte*>(piece->buffer()->data()), piece->shape(),
                     std::vector<std::int64_t>(at.size(), 0), static_cast<std::byte*>(buf->data()), global, at, box,
                     esize);
  }
  set_buffer(std::move(buf));
}

LAZYTENSOR_INLINE void detail::copy_box(const std::byte* src, const Shape& src_shape, const std::vector<std::int64_t>& src_at,
                                        std::byte* dst, const Shape& dst_shape, const std::vector<std::int64_t>& dst_at,
                                        const std::vector<std::int64_t>& box, std::size_t esize) {
  const int rank = src_shape.rank();
  for (auto b : box)
    if (b == 0) return;
  if (rank == 0) {
    std::memcpy(dst, src, esize);
    return;
  }
  // Row-major strides in elements.
  std::vector<std::int64_t> ss(static_cast<std::size_t>(rank), 1), ds(static_cast<std::size_t>(rank), 1);
  for (int d = rank - 1; d-- > 0;) {
    ss[static_cast<std::size_t>(d)] = ss[static_cast<std::size_t>(d) + 1] * src_shape[d + 1];
    ds[static_cast<std::size_t>(d)] = ds[static_cast<std::size_t>(d) + 1] * dst_shape[d + 1];
  }
  const std::size_t run = static_cast<std::size_t>(box.back()) * esize;
  std::vector<std::int64_t> c(static_cast<std::size_t>(rank), 0);  // the last entry stays 0
  for (;;) {
    std::int64_t so = 0, d_o = 0;
    for (int d = 0; d < rank; ++d) {
      so += (src_at[static_cast<std::size_t>(d)] + c[static_cast<std::size_t>(d)]) * ss[static_cast<std::size_t>(d)];
      d_o += (dst_at[static_cast<std::size_t>(d)] + c[static_cast<std::size_t>(d)]) * ds[static_cast<std::size_t>(d)];
    }
    std::memcpy(dst + static_cast<std::size_t>(d_o) * esize, src + static_cast<std::size_t>(so) * esize, run);
    int d = rank - 2;
    for (; d >= 0; --d) {
      if (++c[static_cast<std::size_t>(d)] < box[static_cast<std::size_t>(d)]) break;
      c[static_cast<std::size_t>(d)] = 0;
    }
    if (d < 0) return;
  }
}

LAZYTENSOR_INLINE graph::NodePtr detail::block_of(const graph::NodePtr& value, const Ranges& ranges, graph::Device& dev) {
  const Shape& global = value->shape();
  bool whole = true;
  std::vector<std::int64_t> at, box;
  for (int d = 0; d < global.rank(); ++d) {
    const auto [b0, b1] = ranges[static_cast<std::size_t>(d)];
    whole = whole && b0 == 0 && b1 == global[d];
    at.push_back(b0);
    box.push_back(b1 - b0);
  }
  if (whole && value->device() == &dev)
    return std::make_shared<graph::DataNode>(value->dtype(), global, &dev, value->buffer());
  const Shape shape(box);
  const std::size_t esize = dtype_size(value->dtype());
  auto buf = dev.pool().acquire(padded_bytes(shape.numel(), esize));
  copy_box(static_cast<const std::byte*>(value->buffer()->data()), global, at, static_cast<std::byte*>(buf->data()),
           shape, std::vector<std::int64_t>(at.size(), 0), box, esize);
  static auto& bytes = core::counter("SpmdTransferBytes");
  bytes.add(static_cast<std::int64_t>(shape.numel() * static_cast<std::int64_t>(esize)));
  return std::make_shared<graph::DataNode>(value->dtype(), shape, &dev, std::move(buf));
}

LAZYTENSOR_INLINE graph::NodePtr detail::shard_value(const graph::NodePtr& value, const Sharding& sharding) {
  static auto& transfers = core::counter("SpmdTransfers");
  transfers.add();
  graph::materialize(value);
  std::vector<graph::NodePtr> pieces;
  for (int p = 0; p < sharding.mesh.size(); ++p)
    pieces.push_back(block_of(value, sharding.block(p, value->shape()),
                              mesh_device(sharding.mesh.device_ids()[static_cast<std::size_t>(p)])));
  return std::make_shared<ShardedNode>(sharding, std::move(pieces), value->dtype(), value->shape(), value->device());
}

}  // namespace lazy::spmd
#endif  // LAZYTENSOR_HEADER_DEFINITIONS
// ---- end lazytensor/spmd/sharded_node.hpp ----

namespace lazy::spmd::detail {

/// The partition hook (graph::PartitionHook).
graph::NodePtr partition(graph::NodePtr node);

/// A node with a block rule run block-wise, or null when no sharded operand can lead (each
/// is split along a dimension the rule cannot split).
graph::NodePtr partition_blockwise(const graph::Node& node, const graph::BlockRule& rule);

/// A reduction run on blocks (partial results all-reduced where a reduced dimension is
/// split), or null when its operands do not allow it.
graph::NodePtr partition_reduction(const graph::Node& node, const graph::BlockReduction& r);

/// A 2-D product run on blocks: rows of A and columns of B stay split; a split contracted
/// dimension gives partial products, all-reduced. Null for batched products.
graph::NodePtr partition_gemm(const graph::Node& node, const graph::BlockGemm& g);

/// Per mesh position, the pieces of `inputs` for blocks of `target` over a logical shape:
/// `logical_of[i][d]` is the logical dimension that cuts dimension d of input i (-1: whole).
/// An input already cut that way contributes its pieces; others are computed and split
/// (SpmdTransfers).
std::vector<std::vector<graph::NodePtr>> pieces_for(const std::vector<graph::NodePtr>& inputs,
                                                    const std::vector<std::vector<int>>& logical_of,
                                                    const Sharding& target, const Shape& logical);

/// A copy of small unsharded `value` on `dev` without computing it: materialized values
/// share their buffer, pending views and nodes with a block rule (a backward's seed
/// reshaped and scaled) are traced again on `dev` over copies of their inputs. Null when
/// something on the way has no such form or the value is large (then it is computed and
/// split, which waits for its device).
graph::NodePtr replicate_small(const graph::NodePtr& value, graph::Device& dev, int depth = 0);

/// All-reduces `shards` (one per mesh position) among the positions that differ only along
/// mesh axes `axes`, each group combining in the order of `rank_in_group(position)`.
void reduce_partials(std::vector<graph::NodePtr>& shards, const Mesh& mesh, const std::vector<int>& axes,
                     const std::function<std::int64_t(int)>& rank_in_group, Combine op);

/// A transpose of the last two dimensions, piece by piece; a piece that is itself a
/// pending transpose gives its source (as the unsharded op does), so a GEMM reads it
/// through. Null when the input is not sharded.
graph::NodePtr partition_transpose(const graph::TransposeNode& node);

/// A view of a sharded value run on each piece, or null when the view would mix blocks.
graph::NodePtr partition_view(const graph::ViewNode& node);

/// The [start, length) runs of row-major linear indices that block `ranges` of `shape`
/// covers, in order; false when there are more than `limit`.
bool block_runs(const Shape& shape, const Ranges& ranges, std::size_t limit,
                std::vector<std::pair<std::int64_t, std::int64_t>>& runs);

/// `node` run whole: every sharded input is gathered (materialized) first.
graph::NodePtr run_gathered(graph::NodePtr node);

}  // namespace lazy::spmd::detail

#if LAZYTENSOR_HEADER_DEFINITIONS
#include <algorithm>
#include <map>


namespace lazy::spmd::detail {

LAZYTENSOR_INLINE graph::NodePtr partition(graph::NodePtr node) {
  if (auto* tr = dynamic_cast<const graph::TransposeNode*>(node.get())) {
    if (auto r = partition_transpose(*tr)) return r;
  }
  if (auto* view = dynamic_cast<const graph::ViewNode*>(node.get())) {
    if (auto r = partition_view(*view)) return r;
  } else if (auto* red = dynamic_cast<const graph::BlockReduction*>(node.get())) {
    if (auto r = partition_reduction(*node, *red)) return r;
  } else if (auto* gemm = dynamic_cast<const graph::BlockGemm*>(node.get())) {
    if (auto r = partition_gemm(*node, *gemm)) return r;
  } else if (auto rule = node->block_rule()) {
    if (auto r = partition_blockwise(*node, *rule)) return r;
  }
  return run_gathered(std::move(node));
}

LAZYTENSOR_INLINE graph::NodePtr run_gathered(graph::NodePtr node) {
  for (const auto& in : node->inputs())
    if (in->kind() == graph::NodeKind::Sharded) graph::materialize(in);
  return graph::submit_unpartitioned(std::move(node));
}

LAZYTENSOR_INLINE graph::NodePtr partition_blockwise(const graph::Node& node, const graph::BlockRule& rule) {
  const Shape& out = node.shape();
  const int rank = out.rank();
  const auto& ins = node.inputs();
  // The output dimension that cuts input dimension d of input i the same way, or -1.
  auto cut_by = [&](std::size_t i, int d) {
    for (int o = 0; o < rank; ++o)
      if (rule.splittable[static_cast<std::size_t>(o)] && rule.input_dim[i][static_cast<std::size_t>(o)] == d) return o;
    return -1;
  };
  // The lead: the largest sharded operand whose split dimensions the rule can cut (moving
  // the others costs less). The result takes its blocks.
  const ShardedNode* lead = nullptr;
  std::optional<Sharding> lead_blocks;  // no placeholder mesh built on every call
  for (std::size_t i = 0; i < ins.size(); ++i) {
    const ShardedNode* s = as_sharded(ins[i]);
    if (!s || (lead && s->numel() <= lead->numel())) continue;
    Sharding t{s->sharding().mesh, std::vector<std::vector<int>>(static_cast<std::size_t>(rank))};
    bool ok = true;
    for (int d = 0; ok && d < s->shape().rank(); ++d) {
      const int o = cut_by(i, d);
      if (o >= 0) t.dims[static_cast<std::size_t>(o)] = s->sharding().dims[static_cast<std::size_t>(d)];
      else ok = s->sharding().parts(d) == 1;
    }
    if (!ok) continue;
    lead = s;
    lead_blocks = std::move(t);
  }
  if (!lead) return nullptr;
  Sharding target = std::move(*lead_blocks);
  const Mesh& mesh = target.mesh;
  const int n = mesh.size();
  std::vector<std::vector<int>> logical_of;
  for (std::size_t i = 0; i < ins.size(); ++i) {
    std::vector<int> map;
    for (int d = 0; d < ins[i]->shape().rank(); ++d) map.push_back(cut_by(i, d));
    logical_of.push_back(std::move(map));
  }
  auto pieces = pieces_for(ins, logical_of, target, out);
  const Shape block = target.block_shape(out);
  std::vector<graph::NodePtr> shards;
  shards.reserve(static_cast<std::size_t>(n));
  for (int p = 0; p < n; ++p) {
    graph::Device& dev = mesh_device(mesh.device_ids()[static_cast<std::size_t>(p)]);
    auto piece = node.with_inputs(std::move(pieces[static_cast<std::size_t>(p)]), block, &dev);
    if (!piece) return nullptr;
    shards.push_back(graph::submit_unpartitioned(std::move(piece)));
  }
  return std::make_shared<ShardedNode>(std::move(target), std::move(shards), node.dtype(), out, node.device());
}

LAZYTENSOR_INLINE std::vector<std::vector<graph::NodePtr>> pieces_for(const std::vector<graph::NodePtr>& ins,
                                                                         const std::vector<std::vector<int>>& logical_of,
                                                                         const Sharding& target, const Shape& logical) {
  const Mesh& mesh = target.mesh;
  const int n = mesh.size();
  std::vector<std::vector<graph::NodePtr>> pieces(static_cast<std::size_t>(n));
  for (std::size_t i = 0; i < ins.size(); ++i) {
    const auto& in = ins[i];
    const ShardedNode* s = as_sharded(in);
    bool local = s && s->sharding().mesh == mesh;
    for (int d = 0; local && d < in->shape().rank(); ++d) {
      const int l = logical_of[i][static_cast<std::size_t>(d)];
      local = l >= 0 ? s->sharding().dims[static_cast<std::size_t>(d)] == target.dims[static_cast<std::size_t>(l)]
                     : s->sharding().parts(d) == 1;
    }
    if (local) {
      for (int p = 0; p < n; ++p) pieces[static_cast<std::size_t>(p)].push_back(s->shard(p));
      continue;
    }
    if (!s && in->pending()) {
      // A small pending value every block reads whole: trace it again on each device.
      bool whole = true;
      for (int d = 0; whole && d < in->shape().rank(); ++d) {
        const int l = logical_of[i][static_cast<std::size_t>(d)];
        whole = l < 0 || target.parts(l) == 1;
      }
      std::vector<graph::NodePtr> copies;
      for (int p = 0; whole && p < n; ++p) {
        auto c = replicate_small(in, mesh_device(mesh.device_ids()[static_cast<std::size_t>(p)]));
        if (!c) break;
        copies.push_back(std::move(c));
      }
      if (static_cast<int>(copies.size()) == n) {
        for (int p = 0; p < n; ++p) pieces[static_cast<std::size_t>(p)].push_back(std::move(copies[static_cast<std::size_t>(p)]));
        continue;
      }
    }
    static auto& transfers = core::counter("SpmdTransfers");
    transfers.add();
    graph::materialize(in);
    for (int p = 0; p < n; ++p) {
      const auto block = target.block(p, logical);
      Ranges ranges;
      for (int d = 0; d < in->shape().rank(); ++d) {
        const int l = logical_of[i][static_cast<std::size_t>(d)];
        ranges.push_back(l >= 0 ? block[static_cast<std::size_t>(l)] : std::pair<std::int64_t, std::int64_t>{0, in->shape()[d]});
      }
      pieces[static_cast<std::size_t>(p)].push_back(
          block_of(in, ranges, mesh_device(mesh.device_ids()[static_cast<std::size_t>(p)])));
    }
  }
  return pieces;
}

LAZYTENSOR_INLINE graph::NodePtr replicate_small(const graph::NodePtr& value, graph::Device& dev, int depth) {
  constexpr std::int64_t kMaxElements = 4096;
  constexpr int kMaxDepth = 8;
  if (value->materialized()) {
    Ranges whole;
    for (auto d : value->shape()) whole.emplace_back(0, d);
    return block_of(value, whole, dev);
  }
  if (!value->pending() || depth > kMaxDepth || value->numel() > kMaxElements) return nullptr;
  std::vector<graph::NodePtr> inputs;
  for (const auto& in : value->inputs()) {
    if (in->kind() == graph::NodeKind::Sharded) return nullptr;
    auto c = replicate_small(in, dev, depth + 1);
    if (!c) return nullptr;
    inputs.push_back(std::move(c));
  }
  if (auto* view = dynamic_cast<const graph::ViewNode*>(value.get()))
    return graph::submit_unpartitioned(std::make_shared<graph::ViewNode>(view->op_name(), inputs[0], view->shape()));
  if (!value->block_rule()) return nullptr;
  auto copy = value->with_inputs(std::move(inputs), value->shape(), &dev);
  return copy ? graph::submit_unpartitioned(std::move(copy)) : nullptr;
}

LAZYTENSOR_INLINE void reduce_partials(std::vector<graph::NodePtr>& shards, const Mesh& mesh, const std::vector<int>& axes,
                                       const std::function<std::int64_t(int)>& rank_in_group, Combine op) {
  std::map<std::vector<std::int64_t>, std::vector<int>> groups;
  for (int p = 0; p < mesh.size(); ++p) {
    auto key = mesh.coordinates(p);
    for (int a : axes) key[static_cast<std::size_t>(a)] = 0;
    groups[key].push_back(p);
  }
  for (auto& [key, members] : groups) {
    std::sort(members.begin(), members.end(), [&](int x, int y) { return rank_in_group(x) < rank_in_group(y); });
    std::vector<graph::NodePtr> in;
    for (int p : members) in.push_back(shards[static_cast<std::size_t>(p)]);
    auto out = all_reduce(in, op);
    for (std::size_t i = 0; i < members.size(); ++i) shards[static_cast<std::size_t>(members[i])] = std::move(out[i]);
  }
}

// How partial results of a named reduction combine (false: they cannot).
inline bool combine_of(const char* name, Combine& op) {
  const std::string n = name;
  if (n == "sum") op = Combine::Sum;
  else if (n == "prod") op = Combine::Prod;
  else if (n == "max" || n == "any") op = Combine::Max;
  else if (n == "min" || n == "all") op = Combine::Min;
  else return false;
  return true;
}
// Mesh axes used by dimensions [d0, d1) of a sharding.
inline std::vector<int> axes_of(const Sharding& s, int d0, int d1) {
  std::vector<int> axes;
  for (int d = d0; d < d1; ++d)
    for (int a : s.dims[static_cast<std::size_t>(d)]) axes.push_back(a);
  return axes;
}

LAZYTENSOR_INLINE graph::NodePtr partition_reduction(const graph::Node& node, const graph::BlockReduction& r) {
  const Shape& child = r.child_shape();
  const graph::ReduceGeometry g = r.geometry();
  const int rank = child.rank();
  // The reduced dimensions [a, b) of the child: outer = prod(child[0, a)), extent = prod(child[a, b)).
  int a = 0, b = 0;
  std::int64_t prefix = 1;
  while (a < rank && prefix < g.outer) prefix *= child[a++];
  if (prefix != g.outer) return nullptr;
  b = a;
  std::int64_t extent = 1;
  while (b < rank && extent < g.extent) extent *= child[b++];
  if (extent != g.extent) return nullptr;
  Combine op;
  if (!combine_of(r.reduce_name(), op)) return nullptr;
  const auto& ins = node.inputs();
  // Inputs are of the child's shape or single elements (read whole).
  const ShardedNode* lead = nullptr;
  std::vector<std::vector<int>> logical_of;
  for (const auto& in : ins) {
    std::vector<int> map(static_cast<std::size_t>(in->shape().rank()), -1);
    if (in->shape() == child) {
      for (int d = 0; d < rank; ++d) map[static_cast<std::size_t>(d)] = d;
      if (const ShardedNode* s = as_sharded(in); s && (!lead || s->numel() > lead->numel())) lead = s;
    } else if (in->numel() != 1) {
      return nullptr;
    }
    logical_of.push_back(std::move(map));
  }
  if (!lead) return nullptr;
  Sharding target = lead->sharding();
  const Shape& out = node.shape();
  // Output dimension of each kept child dimension.
  std::vector<std::vector<int>> out_dims(static_cast<std::size_t>(out.rank()));
  if (out.rank() == rank) {  // keepdim
    for (int d = 0; d < rank; ++d)
      if (d < a || d >= b) out_dims[static_cast<std::size_t>(d)] = target.dims[static_cast<std::size_t>(d)];
  } else if (out.rank() == rank - (b - a)) {
    for (int d = 0; d < a; ++d) out_dims[static_cast<std::size_t>(d)] = target.dims[static_cast<std::size_t>(d)];
    for (int d = b; d < rank; ++d) out_dims[static_cast<std::size_t>(d - (b - a))] = target.dims[static_cast<std::size_t>(d)];
  } else {
    return nullptr;
  }
  auto pieces = pieces_for(ins, logical_of, target, child);
  const Shape child_block = target.block_shape(child);
  graph::ReduceGeometry local;
  local.outer = local.extent = local.inner = 1;
  for (int d = 0; d < rank; ++d) (d < a ? local.outer : d < b ? local.extent : local.inner) *= child_block[d];
  Sharding result{target.mesh, std::move(out_dims)};
  const Shape out_block = result.block_shape(out);
  const Mesh& mesh = target.mesh;
  std::vector<graph::NodePtr> shards;
  for (int p = 0; p < mesh.size(); ++p) {
    graph::Device& dev = mesh_device(mesh.device_ids()[static_cast<std::size_t>(p)]);
    shards.push_back(graph::submit_unpartitioned(
        r.with_block(std::move(pieces[static_cast<std::size_t>(p)]), out_block, local, child_block, &dev)));
  }
  const auto axes = axes_of(target, a, b);
  if (!axes.empty()) {
    // Partial results, combined in the order of their blocks along the reduced dimensions.
    reduce_partials(shards, mesh, axes, [&](int p) {
      std::int64_t idx = 0;
      for (int d = a; d < b; ++d) idx = idx * target.parts(d) + target.part_of(p, d);
      return idx;
    }, op);
  }
  return std::make_shared<ShardedNode>(std::move(result), std::move(shards), node.dtype(), out, node.device());
}

LAZYTENSOR_INLINE graph::NodePtr partition_gemm(const graph::Node& node, const graph::BlockGemm& gm) {
  const auto& ins = node.inputs();
  const Shape& out = node.shape();
  const std::int64_t m = gm.rows(), k = gm.depth(), n = gm.cols();
  // Single products of 2-D operands; the result may carry leading size-1 dimensions (the
  // backward's [1, m, k]).
  bool single = gm.batch_a() == 1 && gm.batch_b() == 1 && out.rank() >= 2 && out[out.rank() - 2] == m &&
                out[out.rank() - 1] == n && ins[0]->shape().rank() == 2 && ins[1]->shape().rank() == 2;
  for (int d = 0; single && d + 2 < out.rank(); ++d) single = out[d] == 1;
  if (!single) return nullptr;
  const bool ta = gm.a_transposed(), tb = gm.b_transposed();
  // Logical dimensions: 0 = m, 1 = k, 2 = n; each operand's stored dimensions map onto them.
  const std::vector<std::vector<int>> logical_of = {ta ? std::vector<int>{1, 0} : std::vector<int>{0, 1},
                                                    tb ? std::vector<int>{2, 1} : std::vector<int>{1, 2}};
  const Shape logical{m, k, n};
  // The blocks: the larger sharded operand's split dimensions first, then the other's where
  // they use mesh axes not taken yet.
  std::vector<std::size_t> order = {0, 1};
  if (ins[1]->numel() > ins[0]->numel()) std::swap(order[0], order[1]);
  const Mesh* mesh = nullptr;
  for (auto i : order)
    if (const ShardedNode* s = as_sharded(ins[i]); s && !mesh) mesh = &s->sharding().mesh;
  if (!mesh) return nullptr;
  Sharding target{*mesh, std::vector<std::vector<int>>(3)};
  std::vector<bool> used(static_cast<std::size_t>(mesh->rank()), false);
  for (auto i : order) {
    const ShardedNode* s = as_sharded(ins[i]);
    if (!s || !(s->sharding().mesh == *mesh)) continue;
    for (int d = 0; d < 2; ++d) {
      const auto& axes = s->sharding().dims[static_cast<std::size_t>(d)];
      auto& slot = target.dims[static_cast<std::size_t>(logical_of[i][static_cast<std::size_t>(d)])];
      bool free = slot.empty();
      for (int ax : axes) free = free && !used[static_cast<std::size_t>(ax)];
      if (!free) continue;
      slot = axes;
      for (int ax : axes) used[static_cast<std::size_t>(ax)] = true;
    }
  }
  auto pieces = pieces_for(ins, logical_of, target, logical);
  const Shape block = target.block_shape(logical);
  Sharding result{*mesh, std::vector<std::vector<int>>(static_cast<std::size_t>(out.rank()))};
  result.dims[static_cast<std::size_t>(out.rank() - 2)] = target.dims[0];
  result.dims[static_cast<std::size_t>(out.rank() - 1)] = target.dims[2];
  const Shape out_block = result.block_shape(out);
  // A pending transpose of a 2-D piece is read through, as matmul does unsharded.
  auto operand = [](graph::NodePtr p, bool transposed) {
    if (p->pending()) {
      if (auto* tr = dynamic_cast<graph::TransposeOfLastTwo*>(p.get()); tr && tr->transpose_source()->shape().rank() == 2)
        return graph::GemmOperand{tr->transpose_source(), !transposed};
    }
    return graph::GemmOperand{std::move(p), transposed};
  };
  std::vector<graph::NodePtr> shards;
  for (int p = 0; p < mesh->size(); ++p) {
    graph::Device& dev = mesh_device(mesh->device_ids()[static_cast<std::size_t>(p)]);
    auto& pc = pieces[static_cast<std::size_t>(p)];
    shards.push_back(graph::submit_unpartitioned(
        gm.with_operands(operand(pc[0], ta), operand(pc[1], tb), block[0], block[1], block[2], out_block, &dev)));
  }
  if (!target.dims[1].empty()) {
    // Partial products over k blocks, combined in k order.
    reduce_partials(shards, *mesh, target.dims[1], [&](int p) { return target.part_of(p, 1); }, Combine::Sum);
  }
  return std::make_shared<ShardedNode>(std::move(result), std::move(shards), node.dtype(), out, node.device());
}

LAZYTENSOR_INLINE graph::NodePtr partition_transpose(const graph::TransposeNode& node) {
  const ShardedNode* s = as_sharded(node.inputs()[0]);
  if (!s) return nullptr;
  const int rank = node.shape().rank();
  Sharding result = s->sharding();
  std::swap(result.dims[static_cast<std::size_t>(rank - 2)], result.dims[static_cast<std::size_t>(rank - 1)]);
  std::vector<graph::NodePtr> shards;
  for (int p = 0; p < s->num_shards(); ++p) {
    const graph::NodePtr& piece = s->shard(p);
    if (piece->pending()) {
      if (auto* tr = dynamic_cast<graph::TransposeOfLastTwo*>(piece.get())) {
        shards.push_back(tr->transpose_source());
        continue;
      }
    }
    shards.push_back(graph::submit_unpartitioned(std::make_shared<graph::TransposeNode>(piece)));
  }
  return std::make_shared<ShardedNode>(std::move(result), std::move(shards), node.dtype(), node.shape(), node.device());
}

LAZYTENSOR_INLINE bool block_runs(const Shape& shape, const Ranges& ranges, std::size_t limit,
                                  std::vector<std::pair<std::int64_t, std::int64_t>>& runs) {
  runs.clear();
  const int rank = shape.rank();
  if (rank == 0) {
    runs.emplace_back(0, 1);
    return true;
  }
  for (const auto& [b0, b1] : ranges)
    if (b1 <= b0) return true;
  // Innermost dimensions the block covers whole merge into one run with the first
  // partial dimension (from the inside).
  int inner = rank - 1;
  std::int64_t run = ranges[static_cast<std::size_t>(inner)].second - ranges[static_cast<std::size_t>(inner)].first;
  while (inner > 0 && ranges[static_cast<std::size_t>(inner)].first == 0 &&
         ranges[static_cast<std::size_t>(inner)].second == shape[inner]) {
    --inner;
    run *= ranges[static_cast<std::size_t>(inner)].second - ranges[static_cast<std::size_t>(inner)].first;
  }
  std::vector<std::int64_t> stride(static_cast<std::size_t>(rank), 1);
  for (int d = rank - 1; d-- > 0;) stride[static_cast<std::size_t>(d)] = stride[static_cast<std::size_t>(d) + 1] * shape[d + 1];
  std::vector<std::int64_t> c(static_cast<std::size_t>(inner));
  for (int d = 0; d < inner; ++d) c[static_cast<std::size_t>(d)] = ranges[static_cast<std::size_t>(d)].first;
  for (;;) {
    if (runs.size() == limit) return false;
    std::int64_t start = ranges[static_cast<std::size_t>(inner)].first * stride[static_cast<std::size_t>(inner)];
    for (int d = 0; d < inner; ++d) start += c[static_cast<std::size_t>(d)] * stride[static_cast<std::size_t>(d)];
    if (!runs.empty() && runs.back().first + runs.back().second == start) runs.back().second += run;
    else runs.emplace_back(start, run);
    int d = inner - 1;
    for (; d >= 0; --d) {
      if (++c[static_cast<std::size_t>(d)] < ranges[static_cast<std::size_t>(d)].second) break;
      c[static_cast<std::size_t>(d)] = ranges[static_cast<std::size_t>(d)].first;
    }
    if (d < 0) return true;
  }
}

LAZYTENSOR_INLINE graph::NodePtr partition_view(const graph::ViewNode& node) {
  const ShardedNode* s = as_sharded(node.inputs()[0]);
  if (!s) return nullptr;
  const Shape& in = s->shape();
  const Shape& out = node.shape();
  // Candidate: each split input dimension moves to the output dimension that starts at the
  // same linear offset; the element runs of every block must then agree.
  Sharding target{s->sharding().mesh, std::vector<std::vector<int>>(static_cast<std::size_t>(out.rank()))};
  for (int d = 0; d < in.rank(); ++d) {
    const std::int64_t parts = s->sharding().parts(d);
    if (parts == 1) continue;
    std::int64_t prefix_in = 1, prefix_out = 1;
    for (int k = 0; k < d; ++k) prefix_in *= in[k];
    int o = 0;
    while (o < out.rank() && (prefix_out < prefix_in || out[o] == 1)) prefix_out *= out[o++];
    if (o == out.rank() || prefix_out != prefix_in || out[o] % parts != 0) return nullptr;
    target.dims[static_cast<std::size_t>(o)] = s->sharding().dims[static_cast<std::size_t>(d)];
  }
  constexpr std::size_t kMaxRuns = 4096;
  std::vector<std::pair<std::int64_t, std::int64_t>> a, b;
  for (int p = 0; p < s->num_shards(); ++p) {
    if (!block_runs(in, s->sharding().block(p, in), kMaxRuns, a) || !block_runs(out, target.block(p, out), kMaxRuns, b) ||
        a != b)
      return nullptr;
  }
  const Shape block = target.block_shape(out);
  std::vector<graph::NodePtr> shards;
  for (int p = 0; p < s->num_shards(); ++p)
    shards.push_back(graph::submit_unpartitioned(std::make_shared<graph::ViewNode>(node.op_name(), s->shard(p), block)));
  return std::make_shared<ShardedNode>(std::move(target), std::move(shards), node.dtype(), out, node.device());
}

}  // namespace lazy::spmd::detail
#endif  // LAZYTENSOR_HEADER_DEFINITIONS
// ---- end lazytensor/spmd/partitioner.hpp ----

namespace lazy::spmd {

/// Turns SPMD mode on for the process, for good (call it before creating tensors, as in
/// torch_xla). From then on: graph::submit hands nodes reading sharded values to the
/// partitioner; lazy::mark_step() and wait_device_ops() step and wait for every device,
/// each step running on its device's executor (LAZYTENSOR_ASYNC=0 does not apply: a step
/// holding a collective waits there for its peers); and, with several devices, each
/// device's kernels use an equal share of the threads (as spawn gives replicas). Error
/// inside spawn (replicas and SPMD are two different programs).
void use_spmd();

/// Whether use_spmd() was called.
bool is_spmd();

namespace detail {
/// The loaders' input_sharding (dist::ParallelLoaderOptions): shards a batch's tensor.
void shard_loader_input(graph::TensorImpl& t, const ShardingSpec& spec);
}  // namespace detail

}  // namespace lazy::spmd

#if LAZYTENSOR_HEADER_DEFINITIONS
#include <algorithm>


namespace lazy::spmd {

LAZYTENSOR_INLINE void use_spmd() {
  if (dist::detail::current_context())
    throw Error("use_spmd: called inside spawn; SPMD mode drives every device from one program thread");
  if (is_spmd()) return;
  const int n = device_count();
  const int threads = std::max(1, graph::default_device_threads() / n);
  for (int i = 0; i < n; ++i) {
    graph::Device& dev = graph::DeviceRegistry::get().device(i);
    if (n > 1) dev.set_num_threads(threads);
    // Each device's steps run on its own executor, every one of them: a step holding a
    // collective waits there for its peers, never on the program thread.
    dev.async() = true;
    dev.queue_every_step() = true;
  }
  dist::detail::input_sharding_hook().store(&detail::shard_loader_input, std::memory_order_release);
  graph::partition_hook().store(&detail::partition, std::memory_order_release);
  graph::step_every_device().store(true, std::memory_order_release);
}

LAZYTENSOR_INLINE bool is_spmd() {
  return graph::partition_hook().load(std::memory_order_acquire) != nullptr;
}

}  // namespace lazy::spmd
#endif  // LAZYTENSOR_HEADER_DEFINITIONS
// ---- end lazytensor/spmd/mode.hpp ----

namespace lazy::spmd {

/// One device's piece of a tensor (torch_xla's XLAShard): its value (a tensor of the
/// block's shape on `device`), the device, and the block's [begin, end) range per
/// dimension.
template <Element T>
struct Shard {
  Tensor<T> data;
  Device device;
  std::vector<std::pair<std::int64_t, std::int64_t>> index;
};

namespace detail {
/// The tensor object's value split over `sharding` (resolved for its shape), rebinding it:
/// every handle sees the sharded value. Error outside SPMD mode.
void mark_node(graph::TensorImpl& impl, const Mesh& mesh, const PartitionSpec& spec);
/// The tensor object's value gathered into one node on its device.
void clear_node(graph::TensorImpl& impl);
/// For each mesh position (one entry for an unsharded value): node, device id, block.
struct Piece {
  graph::NodePtr node;
  int device;
  Ranges index;
};
std::vector<Piece> pieces_of(const graph::NodePtr& value);
std::string spec_text(const graph::NodePtr& value);
std::string visualize(const graph::NodePtr& value);
}  // namespace detail

/// Shards `t` over `mesh` as `spec` says (torch_xla's xs.mark_sharding), in place: the
/// tensor object is rebound, so every handle sees it, and `t` is returned. The current
/// value is computed and each device's block copied to it (a replicated block shares the
/// buffer). Error outside SPMD mode; ShardingError for a spec that does not fit (see
/// resolve_sharding). A sharded tensor is resharded.
template <Element T>
Tensor<T>& mark_sharding(Tensor<T>& t, const Mesh& mesh, const PartitionSpec& spec) {
  detail::mark_node(*t.impl(), mesh, spec);
  return t;
}

/// mark_sharding of a tensor of any dtype (a module's parameters()).
inline AnyTensor& mark_sharding(AnyTensor& t, const Mesh& mesh, const PartitionSpec& spec) {
  detail::mark_node(*t.impl(), mesh, spec);
  return t;
}

/// mark_sharding with a ShardingSpec's mesh and spec.
template <Element T>
Tensor<T>& mark_sharding(Tensor<T>& t, const ShardingSpec& spec) {
  return mark_sharding(t, spec.mesh(), spec.partition_spec());
}

/// Makes `t` whole again (torch_xla's clear_sharding): the value is gathered onto the
/// tensor's device, unsharded. A tensor that is not sharded is left as it is.
template <Element T>
Tensor<T>& clear_sharding(Tensor<T>& t) {
  detail::clear_node(*t.impl());
  return t;
}

/// The pieces of `t`, one per mesh device in mesh order (a tensor that is not sharded:
/// one piece, the whole tensor on its device). Each `data` is a new handle on the piece's
/// value: updating it leaves `t` alone. Reading a piece computes only that piece.
template <Element T>
std::vector<Shard<T>> local_shards(const Tensor<T>& t) {
  std::vector<Shard<T>> r;
  for (auto& p : detail::pieces_of(t.node())) r.push_back({Tensor<T>(std::move(p.node)), Device(p.device), std::move(p.index)});
  return r;
}

/// The sharding as XLA's text (torch_xla's _get_xla_sharding_spec): `{devices=[2,1]0,1}`,
/// `{replicated}`; an empty string for a tensor that is not sharded.
template <Element T>
std::string sharding_spec(const Tensor<T>& t) {
  return detail::spec_text(t.node());
}

/// A text table of which device holds which block of `t` (torch_xla's
/// visualize_tensor_sharding): a grid for 1-D and 2-D tensors, one line per block
/// otherwise.
template <Element T>
std::string visualize_tensor_sharding(const Tensor<T>& t) {
  return detail::visualize(t.node());
}

}  // namespace lazy::spmd

#if LAZYTENSOR_HEADER_DEFINITIONS
#include <algorithm>
#include <map>

namespace lazy::spmd::detail {

LAZYTENSOR_INLINE void mark_node(graph::TensorImpl& impl, const Mesh& mesh, const PartitionSpec& spec) {
  if (!is_spmd())
    throw Error("mark_sharding: SPMD mode is off; call lazy::spmd::use_spmd() before creating tensors");
  const Sharding sharding = resolve_sharding(mesh, spec, impl.node->shape());
  if (const ShardedNode* s = as_sharded(impl.node); s && s->sharding() == sharding) return;
  impl.node = shard_value(impl.node, sharding);
}

LAZYTENSOR_INLINE void shard_loader_input(graph::TensorImpl& t, const ShardingSpec& spec) {
  mark_node(t, spec.mesh(), spec.partition_spec());
}

LAZYTENSOR_INLINE void clear_node(graph::TensorImpl& impl) {
  if (!as_sharded(impl.node)) return;
  graph::materialize(impl.node);
  const graph::NodePtr& n = impl.node;
  impl.node = std::make_shared<graph::DataNode>(n->dtype(), n->shape(), n->device(), n->buffer());
}

LAZYTENSOR_INLINE std::vector<Piece> pieces_of(const graph::NodePtr& value) {
  std::vector<Piece> r;
  if (const ShardedNode* s = as_sharded(value)) {
    s->hand_out_pieces();  // a piece read alone must not wait for peers nobody runs
    const auto& ids = s->sharding().mesh.device_ids();
    for (int p = 0; p < s->num_shards(); ++p)
      r.push_back({s->shard(p), ids[static_cast<std::size_t>(p)], s->sharding().block(p, value->shape())});
    return r;
  }
  Ranges whole;
  for (auto d : value->shape()) whole.emplace_back(0, d);
  r.push_back({value, value->device()->index(), std::move(whole)});
  return r;
}

LAZYTENSOR_INLINE std::string spec_text(const graph::NodePtr& value) {
  const ShardedNode* s = as_sharded(value);
  return s ? s->sharding().str() : std::string();
}

LAZYTENSOR_INLINE std::string visualize(const graph::NodePtr& value) {
  const Shape& shape = value->shape();
  // Devices per block, blocks keyed by their ranges (replicas share a cell).
  std::map<Ranges, std::vector<int>> cells;
  for (auto& p : pieces_of(value)) cells[p.index].push_back(p.device);
  auto range_text = [](const Ranges& r) {
    std::string s = "[";
    for (std::size_t i = 0; i < r.size(); ++i) {
      if (i) s += ", ";
      s += std::to_string(r[i].first) + ":" + std::to_string(r[i].second);
    }
    return s + "]";
  };
  auto devices_text = [](const std::vector<int>& ids) {
    std::string s = "CPU ";
    for (std::size_t i = 0; i < ids.size(); ++i) {
      if (i) s += ",";
      s += std::to_string(ids[i]);
    }
    return s;
  };
  std::string out = "tensor of shape " + detail::tuple_text(shape.vec()) + ", " +
                    (as_sharded(value) ? as_sharded(value)->sharding().str() : std::string("not sharded")) + "\n";
  if (shape.rank() == 0 || shape.rank() > 2) {
    for (const auto& [r, ids] : cells) out += "  " + range_text(r) + " -> " + devices_text(ids) + "\n";
    return out;
  }
  // A grid: rows are blocks of dimension 0, columns blocks of dimension 1.
  std::vector<std::pair<std::int64_t, std::int64_t>> rows, cols;
  for (const auto& [r, ids] : cells) {
    if (std::find(rows.begin(), rows.end(), r[0]) == rows.end()) rows.push_back(r[0]);
    if (shape.rank() == 2 && std::find(cols.begin(), cols.end(), r[1]) == cols.end()) cols.push_back(r[1]);
  }
  if (shape.rank() == 1) {  // one row of cells along the only dimension
    cols = rows;
    rows = {{0, 1}};
  }
  std::sort(rows.begin(), rows.end());
  std::sort(cols.begin(), cols.end());
  std::vector<std::vector<std::string>> text(rows.size(), std::vector<std::string>(cols.size()));
  std::size_t width = 0;
  for (const auto& [r, ids] : cells) {
    const auto row = shape.rank() == 1 ? std::pair<std::int64_t, std::int64_t>{0, 1} : r[0];
    const auto col = shape.rank() == 1 ? r[0] : r[1];
    const auto i = static_cast<std::size_t>(std::find(rows.begin(), rows.end(), row) - rows.begin());
    const auto j = static_cast<std::size_t>(std::find(cols.begin(), cols.end(), col) - cols.begin());
    text[i][j] = devices_text(ids);
    width = std::max(width, text[i][j].size());
  }
  std::string line = "+";
  for (std::size_t j = 0; j < cols.size(); ++j) line += std::string(width + 2, '-') + "+";
  out += line + "\n";
  for (const auto& row : text) {
    out += "|";
    for (const auto& cell : row) out += " " + cell + std::string(width - cell.size(), ' ') + " |";
    out += "\n" + line + "\n";
  }
  return out;
}

}  // namespace lazy::spmd::detail
#endif  // LAZYTENSOR_HEADER_DEFINITIONS
// ---- end lazytensor/spmd/mark_sharding.hpp ----
// ---- end lazytensor/spmd.hpp ----
// ---- begin lazytensor/train.hpp ----
// lazy::train: Lightning's layer over lazytensor's devices and replicas. Strategies say
// where a model runs and how replicas talk (Strategy, SingleDeviceStrategy,
// ReplicaStrategy: the analogue of XLAStrategy / DDPSpawnStrategy on thread replicas;
// SpmdStrategy: one program thread over a sharded device mesh);
// precision plugins say in which dtype it computes ("32-true", "64-true", "bf16-mixed",
// "bf16-true"); the Accelerator joins both for each step. A training loop written against
// them runs unchanged on one device or on many, in any precision.

// ---- begin lazytensor/train/accelerator.hpp ----
// train::Accelerator, Lightning 1.3's Accelerator: the object a training loop calls for each
// step. It joins a Strategy (where the model runs, how replicas talk) and the strategy's
// Precision plugin (which dtype), and adds the 1.3 hooks that still mean something on
// lazytensor's devices. "cpu" is the one accelerator: lazytensor's devices are CPU
// executors.
//
// The step methods take the step as a callable (the LightningModule's training_step, or a
// lambda): it runs inside the precision plugin's forward context (autocast for bf16-mixed);
// validation, test and predict steps also run without recording gradients.

#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>

// ---- begin lazytensor/train/precision.hpp ----
// train::Precision, Lightning's precision plugins: in which dtype a model's parameters live
// and its products run.
//
//   "32-true"     float parameters and arithmetic (the default);
//   "64-true"     the module converted to double (Module::to), inputs converted to double;
//   "bf16-true"   the module converted to bfloat16, inputs converted to bfloat16;
//   "bf16-mixed"  float (master) parameters and loss; matmul, linear and conv2d in bfloat16
//                 with float accumulation inside forward_context() (AutocastGuard).
//
// LAZYTENSOR_USE_BF16=1 makes "bf16-true" the default, as XLA_USE_BF16 makes PyTorch/XLA
// store float tensors as bfloat16. The plugin is stateless: one object serves every replica.

#include <memory>
#include <optional>
#include <string>
#include <string_view>


namespace lazy::train {

/// What forward_context() returns: autocast on this thread while it lives (bf16-mixed), or
/// nothing.
class PrecisionContext {
 public:
  PrecisionContext() = default;
  explicit PrecisionContext(bool autocast) {
    if (autocast) guard_ = std::make_unique<AutocastGuard>(true, DType::BFloat16);
  }

 private:
  std::unique_ptr<AutocastGuard> guard_;
};

/// Lightning's Precision plugin, "32-true": float parameters and arithmetic. Subclasses
/// override what differs.
class Precision {
 public:
  virtual ~Precision() = default;

  /// Lightning's name of the setting ("32-true", "64-true", "bf16-mixed", "bf16-true").
  virtual std::string name() const { return "32-true"; }
  /// The dtype of the parameters after convert_module.
  virtual DType param_dtype() const { return DType::Float32; }
  /// The dtype floating inputs are converted to (convert_input), or nullopt to keep them.
  virtual std::optional<DType> input_dtype() const { return std::nullopt; }

  /// Converts `module`'s floating parameters and buffers to param_dtype() (the Strategy's
  /// setup calls it before moving the module to its device).
  void convert_module(nn::Module& module) const {
    if (param_dtype() != DType::Float32) module.to(param_dtype());
  }
  /// A floating input converted to input_dtype() (other tensors as they are).
  AnyTensor convert_input(const AnyTensor& x) const {
    const auto d = input_dtype();
    return d && x.defined() && x.is_floating_point() ? x.to(*d) : x;
  }
  /// A floating output converted back to float (Lightning's convert_output to the default
  /// dtype), so that losses and metrics are reported in float. Detached from autograd, as
  /// every AnyTensor::to(dtype): backpropagate from the typed loss.
  AnyTensor convert_output(const AnyTensor& y) const {
    return y.defined() && y.is_floating_point() ? y.to(DType::Float32) : y;
  }
  /// The forward pass's context: keep it alive while the model runs (autocast for
  /// bf16-mixed).
  virtual PrecisionContext forward_context() const { return PrecisionContext(); }
  /// Backpropagates `loss` into the parameters' gradients.
  virtual void backward(const AnyTensor& loss) const { loss.backward(); }
};

/// "64-true": the module in double.
class DoublePrecision : public Precision {
 public:
  std::string name() const override { return "64-true"; }
  DType param_dtype() const override { return DType::Float64; }
  std::optional<DType> input_dtype() const override { return DType::Float64; }
};

/// "bf16-true": the module in bfloat16 (products accumulate in float, element-wise ops
/// compute in float and round each result).
class HalfPrecision : public Precision {
 public:
  std::string name() const override { return "bf16-true"; }
  DType param_dtype() const override { return DType::BFloat16; }
  std::optional<DType> input_dtype() const override { return DType::BFloat16; }
};

/// "bf16-mixed": float parameters, products in bfloat16 inside forward_context().
class MixedPrecision : public Precision {
 public:
  std::string name() const override { return "bf16-mixed"; }
  PrecisionContext forward_context() const override { return PrecisionContext(true); }
};

/// The plugin for Lightning's `precision` argument: "32-true" (or "32"), "64-true" ("64"),
/// "bf16-mixed" ("bf16", as Lightning reads it), "bf16-true". Error naming the choices
/// otherwise (16-bit float is not a dtype lazytensor has).
std::shared_ptr<Precision> make_precision(std::string_view name);

/// The default plugin: "bf16-true" when LAZYTENSOR_USE_BF16 is on, "32-true" otherwise.
/// Error when the variable is not an on/off switch.
std::shared_ptr<Precision> default_precision();

#if LAZYTENSOR_HEADER_DEFINITIONS
LAZYTENSOR_INLINE std::shared_ptr<Precision> make_precision(std::string_view name) {
  if (name == "32-true" || name == "32") return std::make_shared<Precision>();
  if (name == "64-true" || name == "64") return std::make_shared<DoublePrecision>();
  if (name == "bf16-mixed" || name == "bf16") return std::make_shared<MixedPrecision>();
  if (name == "bf16-true") return std::make_shared<HalfPrecision>();
  throw Error("precision: expected \"32-true\", \"64-true\", \"bf16-mixed\" or \"bf16-true\" (or \"32\", \"64\", "
              "\"bf16\"), got \"" + std::string(name) + "\"" +
              (name.find("16") != std::string_view::npos ? " (float16 is not supported; use bfloat16)" : ""));
}

LAZYTENSOR_INLINE std::shared_ptr<Precision> default_precision() {
  return core::env_switch("LAZYTENSOR_USE_BF16").value_or(false) ? make_precision("bf16-true")
                                                                 : make_precision("32-true");
}
#endif  // LAZYTENSOR_HEADER_DEFINITIONS

}  // namespace lazy::train

// ---- end lazytensor/train/precision.hpp ----
// ---- begin lazytensor/train/strategy.hpp ----
// train::Strategy, Lightning's Strategy: where a model runs and how its replicas talk.
// The Trainer (and a hand-written loop) call these methods, never lazy::dist directly, so
// the same loop runs on one device or on replicas.
//
// A strategy object is shared by the replicas launch() starts: every replica calls its
// methods from its own thread, and whatever depends on the replica (rank, device) is read
// from the replica's runtime, never stored in the object. Methods that exchange data are
// collectives: every replica must call them in the same order (a replica that skips one is
// a CollectiveMismatch on the others, as in lazy::dist; never a hang).

#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cstdint>
#include <cerrno>
#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>


namespace lazy::train {

namespace detail {

/// A reduction named as Lightning names it ("mean"/"avg", "sum", "max", "min", "product";
/// any case): the dist op, and whether it is a mean.
struct ParsedReduceOp {
  ReduceOp op;
  bool mean;
};
ParsedReduceOp parse_reduce_op(std::string_view name);

template <class B>
struct is_tensor : std::false_type {};
template <Element T>
struct is_tensor<Tensor<T>> : std::true_type {};

/// Tensors moved to `dev` and passed to `place` (a strategy's place_input); containers
/// element by element; anything else unchanged.
template <class B, class Place>
B to_device(const B& b, const Device& dev, const Place& place) {
  if constexpr (is_tensor<B>::value) {
    if (!b.defined()) return b;
    AnyTensor moved(b.to(dev));
    place(moved);
    return moved.template as<typename B::value_type>();
  } else if constexpr (requires { std::tuple_size<B>::value; }) {
    return std::apply([&](const auto&... xs) { return B{to_device(xs, dev, place)...}; }, b);
  } else if constexpr (requires(B& out) { b.begin(); b.end(); out.push_back(*b.begin()); }) {
    B out;
    for (const auto& x : b) out.push_back(to_device(x, dev, place));
    return out;
  } else {
    return b;
  }
}

}  // namespace detail

/// Lightning's Strategy: the device, the launch of replicas, and the collectives a training
/// loop needs. Subclasses: SingleDeviceStrategy, ReplicaStrategy, SpmdStrategy.
class Strategy {
 public:
  virtual ~Strategy() = default;

  // ---- where and how many --------------------------------------------------------------

  /// The device this replica computes on.
  virtual Device root_device() const = 0;
  /// Replicas launch() starts (1 for a single device).
  virtual int num_processes() const = 0;
  /// Whether collectives span replicas (false: they return their input, as Lightning's
  /// SingleDeviceStrategy does; all_gather then adds no dimension).
  virtual bool is_distributed() const = 0;
  /// Replicas in the world (1 outside launch).
  int world_size() const { return runtime::world_size(); }
  /// This replica's rank in the world (0 outside launch).
  int global_rank() const { return runtime::global_ordinal(); }
  /// This replica's rank on its host.
  int local_rank() const { return runtime::local_ordinal(); }
  /// True on global rank 0, the replica that writes checkpoints and logs.
  bool is_global_zero() const { return global_rank() == 0; }

  // ---- set-up ----------------------------------------------------------------------------

  /// Prepares the replica's environment (called by launch() on every replica first).
  virtual void setup_environment() {}
  /// Prepares `model` for training on this replica: converts it to the precision plugin's
  /// dtype, moves it to root_device() (and, with replicas, makes every replica's parameters
  /// and buffers rank 0's).
  virtual void setup(nn::Module& model) {
    precision_plugin().convert_module(model);
    model_to_device(model);
  }
  /// The precision plugin (default_precision() unless set).
  Precision& precision_plugin() const { return *precision_; }
  /// Replaces the precision plugin (before setup; every replica shares it).
  void set_precision_plugin(std::shared_ptr<Precision> plugin) {
    if (!plugin) throw Error("Strategy::set_precision_plugin: the plugin is empty");
    precision_ = std::move(plugin);
  }
  /// Moves every parameter and buffer of `model` to root_device().
  virtual void model_to_device(nn::Module& model) { model.to(root_device()); }
  /// `batch` with its tensors on root_device(): a tensor, or a pair, tuple, array or vector
  /// of them (nested); anything else is returned as is.
  template <class Batch>
  Batch batch_to_device(const Batch& batch) const {
    return detail::to_device(batch, root_device(), [this](AnyTensor& t) { place_input(t); });
  }
  /// The loader wrapped for this replica's device (torch_xla's MpDeviceLoader: batches
  /// arrive on root_device(), and a mark_step runs as each is handed out), with
  /// loader_options(). `loader` must outlive the result.
  template <class Loader>
  dist::MpDeviceLoader<Loader> process_dataloader(Loader& loader) const {
    return dist::MpDeviceLoader<Loader>(loader, root_device(), loader_options());
  }
  /// The options process_dataloader gives its loader (defaults; SpmdStrategy adds the
  /// input sharding).
  virtual dist::ParallelLoaderOptions loader_options() const { return {}; }
  /// Lays out one input tensor already on root_device() (batch_to_device calls it for
  /// every tensor of a batch; SpmdStrategy shards it over the mesh). Default: nothing.
  virtual void place_input(AnyTensor& t) const { (void)t; }

  // ---- a training step -------------------------------------------------------------------

  /// Backpropagates `loss` (a one-element tensor) into the parameters' gradients, through
  /// the precision plugin.
  virtual void backward(const AnyTensor& loss, optim::Optimizer* optimizer = nullptr);
  /// Runs `closure` (forward and backward, returning the loss; may be empty), then the
  /// optimizer's step: with replicas, the gradients are first averaged over the world
  /// (dist::optimizer_step). Returns the closure's loss (undefined without a closure).
  virtual AnyTensor optimizer_step(optim::Optimizer& optimizer,
                                       const std::function<AnyTensor()>& closure = {});

  // ---- collectives -----------------------------------------------------------------------

  /// `t` reduced over the world by `op`: "mean" (or "avg"), "sum", "max", "min" or
  /// "product" (any case). Every replica gets the same value. A mean needs a floating dtype.
  template <Element T>
  Tensor<T> reduce(const Tensor<T>& t, std::string_view op = "mean") const;

  /// Every replica's `t` stacked along a new first dimension: shape (world_size, ...), in
  /// rank order (a single device returns `t` itself, as Lightning's). With `sync_grads` the
  /// result is differentiable: the gradient reaching `t` is the sum over replicas of the
  /// gradient of its slice (the backward pass then runs a collective on every replica).
  template <Element T>
  Tensor<T> all_gather(const Tensor<T>& t, bool sync_grads = false) const;

  /// Rank `src`'s `obj` on every replica: a string, a vector of trivially copyable values,
  /// or a trivially copyable struct.
  template <class O>
  O broadcast(O obj, int src = 0) const;

  /// Waits for every replica to reach a barrier of the same `name`; a replica at a barrier
  /// of another name makes every one raise CollectiveMismatch naming both.
  void barrier(std::string_view name = "") const;

  /// One decision for the whole world: true when every replica decided true (`all`), or
  /// when any did (`!all`). Use it for anything that stops or skips work on every replica.
  /// (A template only so that programs that never call it do not compile its exchange.)
  template <class = void>
  bool reduce_boolean_decision(bool decision, bool all = true) const;

  // ---- checkpoints -----------------------------------------------------------------------

  /// Writes `checkpoint` to `path` (a safetensors file) from global rank zero only, after
  /// every replica has computed its pending tensors; returns on every replica once the file
  /// is complete. Every replica must call it (never from a rank-0-only branch). The file is
  /// written to a temporary and renamed: a crash leaves the old file or the new one.
  virtual void save_checkpoint(const StateDict& checkpoint, const std::string& path);
  /// Removes the file at `path` (global rank zero does; a missing file is not an error).
  virtual void remove_checkpoint(const std::string& path);

  // ---- life cycle ------------------------------------------------------------------------

  /// Called on a replica whose launched function throws `e`, before launch() re-throws it
  /// (every replica that fails calls it, from its own thread).
  virtual void on_exception(const std::exception& e) { (void)e; }
  /// Releases what setup took (called by the Trainer at the end of a run).
  virtual void teardown() {}

  /// Runs `fn(*this)` on every replica (each on its own thread and device with replicas,
  /// on the calling thread otherwise) and returns global rank 0's result. When a replica
  /// throws, on_exception runs there, every other replica leaves its collectives with an
  /// error, and the first exception is re-thrown here (DDPSpawnStrategy's spawn).
  template <class F>
  auto launch(F fn);

 private:
  std::shared_ptr<Precision> precision_ = default_precision();
};

// ---- templates ----------------------------------------------------------------------------

template <Element T>
Tensor<T> Strategy::reduce(const Tensor<T>& t, std::string_view op) const {
  const detail::ParsedReduceOp r = detail::parse_reduce_op(op);
  if (r.mean && !is_floating_v<T>) {
    throw DTypeError("Strategy::reduce: op \"" + std::string(op) + "\" needs a floating tensor, found " +
                     dtype_name(dtype_of<T>()) + " (use \"sum\")");
  }
  if (!is_distributed()) return t;
  const double scale = r.mean ? 1.0 / world_size() : 1.0;
  return dist::all_reduce(r.op, t, {.scale = scale});
}

template <Element T>
Tensor<T> Strategy::all_gather(const Tensor<T>& t, bool sync_grads) const {
  if (!is_distributed()) return t;
  const Tensor<T> row = unsqueeze(t.detach(), 0);
  Tensor<T> gathered = dist::all_gather(row, 0);
  if constexpr (is_floating_v<T>) {
    if (sync_grads && autograd::any_requires_grad(t)) {
      const int n = world_size();
      const Shape shape = t.shape();
      autograd::record(gathered, "AllGatherBackward", {autograd::edge_of(t.impl())},
                       [n, shape](const Tensor<T>& g) -> std::vector<graph::NodePtr> {
                         // Each replica's slice of every replica's gradient, summed.
                         const Tensor<T> mine = dist::reduce_scatter(ReduceOp::Sum, g, 1.0, 0, n);
                         return {Tensor<T>(reshape(mine, shape)).node()};
                       });
    }
  }
  return gathered;
}

template <class O>
O Strategy::broadcast(O obj, int src) const {
  if (src < 0 || src >= world_size()) {
    throw Error("Strategy::broadcast: src must be a rank in [0, " + std::to_string(world_size()) + "), got " +
                std::to_string(src));
  }
  if (!is_distributed()) return obj;
  return dist::broadcast_object(obj, src);
}

template <class>
bool Strategy::reduce_boolean_decision(bool decision, bool all) const {
  if (!is_distributed()) return decision;
  const auto votes = dist::mesh_reduce(all ? "reduce_boolean_decision(all)" : "reduce_boolean_decision(any)",
                                       static_cast<std::uint8_t>(decision),
                                       [](const std::vector<std::uint8_t>& v) { return v; });
  return all ? std::all_of(votes.begin(), votes.end(), [](std::uint8_t v) { return v != 0; })
             : std::any_of(votes.begin(), votes.end(), [](std::uint8_t v) { return v != 0; });
}

template <class F>
auto Strategy::launch(F fn) {
  auto body = [this, &fn]() {
    try {
      setup_environment();
      return fn(*this);
    } catch (const std::exception& e) {
      on_exception(e);
      throw;
    }
  };
  if (is_distributed()) return dist::spawn([&](int) { return body(); }, num_processes());
  // One device: run here, with root_device() as this thread's device for the duration.
  struct Restore {
    Device prev = device();
    ~Restore() { set_device(prev); }
  } restore;
  set_device(root_device());
  return body();
}

#if LAZYTENSOR_HEADER_DEFINITIONS
namespace detail {

LAZYTENSOR_INLINE ParsedReduceOp parse_reduce_op(std::string_view name) {
  std::string s(name);
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  if (s == "mean" || s == "avg") return {ReduceOp::Sum, true};
  if (s == "sum") return {ReduceOp::Sum, false};
  if (s == "max") return {ReduceOp::Max, false};
  if (s == "min") return {ReduceOp::Min, false};
  if (s == "product") return {ReduceOp::Mul, false};
  throw Error("Strategy::reduce: unknown op \"" + std::string(name) +
              "\" (expected \"mean\", \"avg\", \"sum\", \"max\", \"min\" or \"product\")");
}

}  // namespace detail

LAZYTENSOR_INLINE void Strategy::backward(const AnyTensor& loss, optim::Optimizer* optimizer) {
  (void)optimizer;
  precision_plugin().backward(loss);
}

LAZYTENSOR_INLINE AnyTensor Strategy::optimizer_step(optim::Optimizer& optimizer,
                                                         const std::function<AnyTensor()>& closure) {
  AnyTensor loss = closure ? closure() : AnyTensor();
  optimizer.step();
  return loss;
}

LAZYTENSOR_INLINE void Strategy::barrier(std::string_view name) const {
  if (is_distributed()) dist::barrier(std::string(name));
}


LAZYTENSOR_INLINE void Strategy::save_checkpoint(const StateDict& checkpoint, const std::string& path) {
  // io::save is xm.save: every replica materializes, global rank 0 writes atomically, all
  // meet after the write, and a failure anywhere is raised everywhere.
  io::save(checkpoint, path, /*master_only=*/true, /*global_master=*/true);
}

LAZYTENSOR_INLINE void Strategy::remove_checkpoint(const std::string& path) {
  if (!is_global_zero()) return;
  if (::unlink(path.c_str()) != 0 && errno != ENOENT)
    throw io::detail::os_error("remove_checkpoint: cannot remove", path);
}

#endif  // LAZYTENSOR_HEADER_DEFINITIONS

}  // namespace lazy::train
// ---- end lazytensor/train/strategy.hpp ----

namespace lazy::train {

/// Lightning 1.3's Accelerator over a Strategy and its Precision plugin. The strategy must
/// outlive the accelerator; both are shared by the replicas the strategy launches.
class Accelerator {
 public:
  /// Over `strategy`; with `precision`, that plugin becomes the strategy's.
  explicit Accelerator(Strategy& strategy, std::shared_ptr<Precision> precision = nullptr) : strategy_(&strategy) {
    if (precision) strategy.set_precision_plugin(std::move(precision));
  }
  virtual ~Accelerator() = default;

  /// "cpu".
  virtual std::string name() const = 0;
  /// The strategy steps run through.
  Strategy& strategy() const { return *strategy_; }
  /// The strategy's precision plugin.
  Precision& precision_plugin() const { return strategy_->precision_plugin(); }

  /// Prepares `model` on this replica: the strategy's setup (precision conversion, device,
  /// rank 0's state on every replica).
  virtual void setup(nn::Module& model) { strategy_->setup(model); }

  /// Runs `step()` (forward and loss) in the precision plugin's forward context; returns
  /// what it returns.
  template <class F>
  decltype(auto) training_step(F&& step) {
    const PrecisionContext context = precision_plugin().forward_context();
    return std::forward<F>(step)();
  }
  /// Runs `step()` in the forward context without recording gradients.
  template <class F>
  decltype(auto) validation_step(F&& step) {
    return eval_step(std::forward<F>(step));
  }
  /// Runs `step()` in the forward context without recording gradients.
  template <class F>
  decltype(auto) test_step(F&& step) {
    return eval_step(std::forward<F>(step));
  }
  /// Runs `step()` in the forward context without recording gradients.
  template <class F>
  decltype(auto) predict_step(F&& step) {
    return eval_step(std::forward<F>(step));
  }

  /// Backpropagates `loss` (through the precision plugin and the strategy).
  virtual void backward(const AnyTensor& loss, optim::Optimizer* optimizer = nullptr) {
    strategy_->backward(loss, optimizer);
  }
  /// Runs `closure` (forward and backward), then the strategy's optimizer step (gradients
  /// averaged over the replicas first); returns the closure's loss.
  virtual AnyTensor optimizer_step(optim::Optimizer& optimizer, const std::function<AnyTensor()>& closure = {}) {
    return strategy_->optimizer_step(optimizer, closure);
  }
  /// Clears the optimizer's gradients.
  virtual void optimizer_zero_grad(optim::Optimizer& optimizer) { optimizer.zero_grad(); }
  /// Clips the gradients of every parameter of `optimizer`: by their total 2-norm
  /// (`algorithm` "norm", clip_grad_norm_) or element-wise (`"value"`, clip_grad_value_).
  /// A `clip_val` of 0 clips nothing, as Lightning's; a negative one or another algorithm
  /// is an Error. (A template only so that programs that never clip do not compile the
  /// norms.)
  template <class = void>
  void clip_gradients(optim::Optimizer& optimizer, double clip_val, std::string_view algorithm = "norm");

  /// Called when training starts (after setup).
  virtual void on_train_start() {}
  /// Called at the end of every training epoch.
  virtual void on_train_epoch_end() {}
  /// Called when training ends: computes whatever is still pending on this replica.
  virtual void on_train_end();
  /// Releases what setup took (the strategy's teardown).
  virtual void teardown() { strategy_->teardown(); }

 private:
  template <class F>
  decltype(auto) eval_step(F&& step) {
    NoGradGuard no_grad;
    const PrecisionContext context = precision_plugin().forward_context();
    return std::forward<F>(step)();
  }

  Strategy* strategy_;
};

/// The accelerator of lazytensor's devices (Lightning's CPUAccelerator).
class CPUAccelerator : public Accelerator {
 public:
  using Accelerator::Accelerator;
  std::string name() const override { return "cpu"; }
  /// Always true: every lazytensor device is a CPU executor.
  static bool is_available() { return true; }
  /// The devices lazytensor has (lazy::device_count(), LAZYTENSOR_NUM_DEVICES).
  static int auto_device_count();
};

/// The accelerator for Lightning's `accelerator` argument: "cpu" or "auto". Error for
/// "gpu", "cuda", "tpu", "mps" or anything else, naming the one choice.
std::unique_ptr<Accelerator> make_accelerator(std::string_view name, Strategy& strategy,
                                              std::shared_ptr<Precision> precision = nullptr);

// (Outside the class, so not inline: see core/config.hpp.)
template <class>
void Accelerator::clip_gradients(optim::Optimizer& optimizer, double clip_val, std::string_view algorithm) {
  if (algorithm != "norm" && algorithm != "value") {
    throw Error("clip_gradients: gradient_clip_algorithm must be \"norm\" or \"value\", got \"" +
                std::string(algorithm) + "\"");
  }
  if (!(clip_val >= 0)) throw Error("clip_gradients: clip_val must be >= 0, got " + std::to_string(clip_val));
  if (clip_val == 0) return;
  std::vector<AnyTensor> params;
  for (std::size_t g = 0; g < optimizer.num_param_groups(); ++g)
    for (const auto& p : optimizer.params(g)) params.push_back(p);
  if (algorithm == "norm") nn::utils::clip_grad_norm_(params, clip_val);
  else nn::utils::clip_grad_value_(params, clip_val);
}

#if LAZYTENSOR_HEADER_DEFINITIONS
LAZYTENSOR_INLINE void Accelerator::on_train_end() { mark_step(); }

LAZYTENSOR_INLINE int CPUAccelerator::auto_device_count() { return device_count(); }

LAZYTENSOR_INLINE std::unique_ptr<Accelerator> make_accelerator(std::string_view name, Strategy& strategy,
                                                                std::shared_ptr<Precision> precision) {
  if (name == "cpu" || name == "auto") return std::make_unique<CPUAccelerator>(strategy, std::move(precision));
  throw Error("accelerator: lazytensor's devices are CPU executors; expected \"cpu\" or \"auto\", got \"" +
              std::string(name) + "\"");
}
#endif  // LAZYTENSOR_HEADER_DEFINITIONS

}  // namespace lazy::train

#define LAZYTENSOR_TRAIN_ACCELERATOR_INSTANCES(P) \
  P template void lazy::train::Accelerator::clip_gradients<void>(lazy::optim::Optimizer&, double, std::string_view);
#if LAZYTENSOR_EXPLICIT_INSTANTIATION
LAZYTENSOR_TRAIN_ACCELERATOR_INSTANCES(extern)
#endif
// ---- end lazytensor/train/accelerator.hpp ----
// ---- begin lazytensor/train/replica.hpp ----
// train::ReplicaStrategy: data-parallel replicas as threads, each with its own device, the
// analogue of Lightning's XLAStrategy and DDPSpawnStrategy. launch() is dist::spawn; the
// loader of each replica is an MpDeviceLoader; the optimizer step averages the gradients
// over the world (dist::optimizer_step); setup() makes every replica start from rank 0's
// parameters and buffers (DDP's module-state broadcast).

#include <functional>


namespace lazy::train {

/// Data-parallel training on `devices` thread replicas (XLAStrategy / DDPSpawnStrategy).
/// A class template (the parameter is unused; use ReplicaStrategy) so that a program that
/// never constructs one compiles none of its exchanges.
template <class = void>
class BasicReplicaStrategy : public Strategy {
 public:
  /// `devices` replicas (>= 1), on devices 0 .. devices-1.
  explicit BasicReplicaStrategy(int devices);

  /// The replica's own device (inside launch(); the calling thread's outside).
  Device root_device() const override { return lazy::device(); }
  int num_processes() const override { return devices_; }
  bool is_distributed() const override { return true; }

  /// Converts `model` to the precision plugin's dtype, moves it to the replica's device,
  /// then sync_module_states.
  void setup(nn::Module& model) override;
  /// Replaces every parameter and buffer of `model` with rank 0's value (a collective).
  void sync_module_states(nn::Module& model) const;
  /// The closure, then dist::optimizer_step: gradients averaged over the world, then the
  /// optimizer's step (lazy: it runs at the next mark_step, which the loader issues).
  AnyTensor optimizer_step(optim::Optimizer& optimizer,
                               const std::function<AnyTensor()>& closure = {}) override;

 private:
  int devices_;
};

/// Data-parallel replicas as threads (see BasicReplicaStrategy).
using ReplicaStrategy = BasicReplicaStrategy<>;

// (Members outside the class, so not inline: see core/config.hpp.)
template <class V>
BasicReplicaStrategy<V>::BasicReplicaStrategy(int devices) : devices_(devices) {
  if (devices < 1) throw Error("ReplicaStrategy: devices must be >= 1, got " + std::to_string(devices));
}

template <class V>
void BasicReplicaStrategy<V>::setup(nn::Module& model) {
  precision_plugin().convert_module(model);
  model_to_device(model);
  sync_module_states(model);
}

template <class V>
void BasicReplicaStrategy<V>::sync_module_states(nn::Module& model) const {
  const StateDict mine = model.state_dict();
  StateDict rank0;
  for (const auto& [name, t] : mine) {
    t.visit([&, &name = name](const auto& typed) { rank0.insert(name, dist::broadcast(typed, 0)); });
  }
  model.load_state_dict(rank0);
}

template <class V>
AnyTensor BasicReplicaStrategy<V>::optimizer_step(optim::Optimizer& optimizer,
                                                      const std::function<AnyTensor()>& closure) {
  AnyTensor loss = closure ? closure() : AnyTensor();
  dist::optimizer_step(optimizer);
  return loss;
}

}  // namespace lazy::train

#define LAZYTENSOR_TRAIN_REPLICA_INSTANCES(P) \
  P template class lazy::train::BasicReplicaStrategy<void>; \
  P template bool lazy::train::Strategy::reduce_boolean_decision<void>(bool, bool) const;
#if LAZYTENSOR_EXPLICIT_INSTANTIATION
LAZYTENSOR_TRAIN_REPLICA_INSTANCES(extern)
#endif
// ---- end lazytensor/train/replica.hpp ----
// ---- begin lazytensor/train/single_device.hpp ----
// train::SingleDeviceStrategy, Lightning's: one replica on one device. Collectives return
// their input (a world of one), launch() runs on the calling thread with the strategy's
// device as the thread's device.

#include <string>


namespace lazy::train {

/// Training on one device (Lightning's SingleDeviceStrategy).
class SingleDeviceStrategy : public Strategy {
 public:
  /// On `device` (default: the calling thread's device).
  explicit SingleDeviceStrategy(Device device = lazy::device()) : device_(device) {}

  Device root_device() const override { return device_; }
  int num_processes() const override { return 1; }
  bool is_distributed() const override { return false; }

 private:
  Device device_;
};

}  // namespace lazy::train
// ---- end lazytensor/train/single_device.hpp ----
// ---- begin lazytensor/train/spmd_strategy.hpp ----
// train::SpmdStrategy: one program thread drives a mesh of devices (lazy::spmd, PyTorch/XLA's
// SPMD). Unlike ReplicaStrategy there is one replica: launch() runs on the calling thread,
// world_size() is 1 and the collectives return their input. The parallelism is in the
// tensors instead: setup() shards each parameter as the strategy's parameter sharding says
// (replicated by default: data parallel), process_dataloader and batch_to_device shard each
// input along its batch dimension over the mesh's first axis, and the partitioner turns
// every statement into one node per device, adding the all-reduces the gradients need.

#include <algorithm>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>


namespace lazy::train {

/// For one parameter (its name in the module, its value): the partition spec over the
/// strategy's mesh (an empty spec replicates it).
using ParameterSharding = std::function<spmd::PartitionSpec(const std::string& name, const AnyTensor& parameter)>;

/// A parameter sharding that splits each parameter's first dimension over `mesh`'s axis
/// `axis` (ZeRO-3 / FSDP style: every device holds 1/n of each weight), replicating the
/// parameters whose first dimension the axis does not divide (and scalars). ShardingError
/// when the mesh has no such axis.
ParameterSharding fully_sharded(const spmd::Mesh& mesh, const std::string& axis);

/// Training on a device mesh from one program thread (lazy::spmd). A class template (the
/// parameter is unused; use SpmdStrategy) so that a program that never constructs one
/// compiles none of it.
template <class = void>
class BasicSpmdStrategy : public Strategy {
 public:
  /// Over `mesh` (its first axis is the data axis inputs are split over). Each parameter
  /// is sharded as `parameter_sharding` says (empty: every parameter replicated, i.e. data
  /// parallel).
  /// `input_spec` overrides the inputs' partition spec (default: dimension 0 over the
  /// mesh's first axis, the rest replicated).
  explicit BasicSpmdStrategy(spmd::Mesh mesh, ParameterSharding parameter_sharding = {},
                             std::optional<spmd::PartitionSpec> input_spec = std::nullopt);

  /// The mesh.
  const spmd::Mesh& mesh() const { return mesh_; }
  /// The partition spec of every input tensor.
  const spmd::PartitionSpec& input_spec() const { return input_->partition_spec(); }

  /// The mesh's first device: the device a sharded tensor's whole value belongs to.
  Device root_device() const override { return Device(mesh_.device_ids().front()); }
  int num_processes() const override { return 1; }
  bool is_distributed() const override { return false; }

  /// Turns SPMD mode on (spmd::use_spmd; it then holds for the process).
  void setup_environment() override;
  /// Converts `model` to the precision plugin's dtype, moves it to root_device(), then
  /// shards (or replicates) each parameter as the parameter sharding says. ShardingError names the
  /// parameter whose spec does not fit.
  void setup(nn::Module& model) override;
  /// Inputs shard as input_spec() says, as the loader hands them out.
  dist::ParallelLoaderOptions loader_options() const override;
  /// Shards `t` as input_spec() says (a scalar, or a tensor the spec does not fit, is
  /// left whole: the partitioner replicates it where needed).
  void place_input(AnyTensor& t) const override;

 private:
  spmd::Mesh mesh_;
  ParameterSharding parameter_sharding_;
  std::shared_ptr<const spmd::ShardingSpec> input_;
};

/// Training on a device mesh from one program thread (see BasicSpmdStrategy).
using SpmdStrategy = BasicSpmdStrategy<>;

// (Members outside the class, so not inline: see core/config.hpp.)
template <class V>
BasicSpmdStrategy<V>::BasicSpmdStrategy(spmd::Mesh mesh, ParameterSharding parameter_sharding,
                                        std::optional<spmd::PartitionSpec> input_spec)
    : mesh_(std::move(mesh)), parameter_sharding_(std::move(parameter_sharding)) {
  if (!input_spec) input_spec = spmd::PartitionSpec{spmd::PartitionEntry(0)};
  input_ = std::make_shared<const spmd::ShardingSpec>(mesh_, std::move(*input_spec));
}

template <class V>
void BasicSpmdStrategy<V>::setup_environment() {
  spmd::use_spmd();
}

template <class V>
void BasicSpmdStrategy<V>::setup(nn::Module& model) {
  setup_environment();  // setup() may run outside launch()
  precision_plugin().convert_module(model);
  model_to_device(model);
  for (auto& [name, p] : model.named_parameters()) {
    // Replicated by default: every device gets its copy once, here, not at every step.
    spmd::PartitionSpec spec = parameter_sharding_ ? parameter_sharding_(name, p) : spmd::PartitionSpec{};
    try {
      spmd::mark_sharding(p, mesh_, spec);
    } catch (const ShardingError& e) {
      throw ShardingError("SpmdStrategy::setup: parameter \"" + name + "\": " + e.what());
    }
  }
}

template <class V>
dist::ParallelLoaderOptions BasicSpmdStrategy<V>::loader_options() const {
  dist::ParallelLoaderOptions o;
  o.input_sharding = input_;
  return o;
}

template <class V>
void BasicSpmdStrategy<V>::place_input(AnyTensor& t) const {
  if (t.shape().rank() == 0) return;
  const spmd::PartitionSpec& spec = input_->partition_spec();
  try {
    (void)spmd::resolve_sharding(mesh_, spec, t.shape());
  } catch (const ShardingError&) {
    return;  // e.g. a last batch the data axis does not divide: left whole
  }
  spmd::mark_sharding(t, mesh_, spec);
}

}  // namespace lazy::train

#if LAZYTENSOR_HEADER_DEFINITIONS
namespace lazy::train {

LAZYTENSOR_INLINE ParameterSharding fully_sharded(const spmd::Mesh& mesh, const std::string& axis) {
  const auto& names = mesh.axis_names();
  const auto it = std::find(names.begin(), names.end(), axis);
  if (it == names.end()) {
    std::string known;
    for (const auto& n : names) {
      if (!known.empty()) known += ", ";
      known += "\"" + n + "\"";
    }
    throw ShardingError("fully_sharded: the mesh has no axis \"" + axis + "\" (its axes: " + known + ")");
  }
  const std::int64_t size = mesh.mesh_shape()[static_cast<std::size_t>(it - names.begin())];
  return [axis, size](const std::string&, const AnyTensor& p) -> spmd::PartitionSpec {
    if (p.shape().rank() == 0 || p.shape()[0] % size != 0) return {};
    return {spmd::PartitionEntry(axis)};
  };
}

}  // namespace lazy::train
#endif  // LAZYTENSOR_HEADER_DEFINITIONS

#define LAZYTENSOR_TRAIN_SPMD_INSTANCES(P) P template class lazy::train::BasicSpmdStrategy<void>;
#if LAZYTENSOR_EXPLICIT_INSTANTIATION
LAZYTENSOR_TRAIN_SPMD_INSTANCES(extern)
#endif
// ---- end lazytensor/train/spmd_strategy.hpp ----
// ---- end lazytensor/train.hpp ----
// ---- end lazytensor/lazytensor.hpp ----
