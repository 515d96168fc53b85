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

// ---- begin lazytensor/core/error.hpp ----
// Error hierarchy. Every failure reachable from the public API is one of these, with a
// message that says what was expected, what was found, and where.

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

}  // namespace lazy
// ---- end lazytensor/core/error.hpp ----
// ---- begin lazytensor/debug/graph_dump.hpp ----
// The pending graph behind tensors, as text or Graphviz DOT (the analogue of
// torch_xla's get_stablehlo / graph dumps).

#include <algorithm>
#include <sstream>
#include <string>
#include <unordered_map>
#include <vector>

// ---- begin lazytensor/graph/executor.hpp ----
// The planner and executor: order the pending nodes reachable from a set of roots, let
// nodes fuse with their producers, and run each kernel once its inputs exist.

#include <chrono>
#include <unordered_set>
#include <utility>
#include <vector>

// ---- begin lazytensor/core/counters.hpp ----
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
    static Registry r;
    return r;
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
// ---- end lazytensor/core/counters.hpp ----
// ---- begin lazytensor/graph/device.hpp ----
// A device: a pending graph, the handles that can reach it, a worker pool, a buffer pool,
// a random-number stream and the step closures. Devices live for the whole process.

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

// ---- begin lazytensor/core/buffer.hpp ----
// Device memory: 64-byte aligned buffers padded to whole SIMD batches, recycled by a
// per-device pool so that a steady training loop stops touching the allocator.

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <new>
#include <unordered_map>
#include <vector>

namespace lazy {

/// Alignment of every buffer (one cache line, one AVX-512 register).
inline constexpr std::size_t kBufferAlign = 64;
/// Element counts are padded to a multiple of this, so a kernel's SIMD main loop reads and
/// writes whole batches (16 floats = one AVX-512 register) without a scalar tail.
inline constexpr std::int64_t kPadElements = 16;

/// Bytes a buffer of `numel` elements of `elem_size` bytes occupies after padding.
constexpr std::size_t padded_bytes(std::int64_t numel, std::size_t elem_size) {
  const std::int64_t n = ((numel < 1 ? 1 : numel) + kPadElements - 1) / kPadElements * kPadElements;
  const std::size_t bytes = static_cast<std::size_t>(n) * elem_size;
  return (bytes + kBufferAlign - 1) / kBufferAlign * kBufferAlign;
}

class BufferPool;

/// A block of aligned memory. Returned to its pool when the last reference goes.
class Buffer {
 public:
  Buffer(void* p, std::size_t bytes, std::shared_ptr<BufferPool> pool)
      : data_(p), bytes_(bytes), pool_(std::move(pool)) {}
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  ~Buffer();

  void* data() const { return data_; }
  std::size_t bytes() const { return bytes_; }

 private:
  void* data_;
  std::size_t bytes_;
  std::shared_ptr<BufferPool> pool_;
};

/// Pool statistics, for tests and metrics.
struct PoolStats {
  std::int64_t fresh_allocations = 0;  ///< blocks obtained from the system allocator
  std::int64_t fresh_bytes = 0;
  std::int64_t reuses = 0;  ///< blocks served from the free lists
  std::int64_t cached_bytes = 0;
};

/// Free lists keyed by exact padded size. Thread-safe.
class BufferPool : public std::enable_shared_from_this<BufferPool> {
 public:
  ~BufferPool() { empty_cache(); }

  /// A buffer of at least `bytes` (already padded) bytes.
  std::shared_ptr<Buffer> acquire(std::size_t bytes) {
    void* p = nullptr;
    {
      std::lock_guard lock(mu_);
      auto it = free_.find(bytes);
      if (it != free_.end() && !it->second.empty()) {
        p = it->second.back();
        it->second.pop_back();
        stats_.reuses++;
        stats_.cached_bytes -= static_cast<std::int64_t>(bytes);
      } else {
        stats_.fresh_allocations++;
        stats_.fresh_bytes += static_cast<std::int64_t>(bytes);
      }
    }
    if (!p) {
      p = ::operator new(bytes, std::align_val_t(kBufferAlign));
    }
    return std::make_shared<Buffer>(p, bytes, shared_from_this());
  }

  void release(void* p, std::size_t bytes) {
    std::lock_guard lock(mu_);
    free_[bytes].push_back(p);
    stats_.cached_bytes += static_cast<std::int64_t>(bytes);
  }

  /// Returns every cached block to the system.
  void empty_cache() {
    std::lock_guard lock(mu_);
    for (auto& [bytes, list] : free_) {
      for (void* p : list) ::operator delete(p, std::align_val_t(kBufferAlign));
    }
    free_.clear();
    stats_.cached_bytes = 0;
  }

  PoolStats stats() const {
    std::lock_guard lock(mu_);
    return stats_;
  }

 private:
  mutable std::mutex mu_;
  std::unordered_map<std::size_t, std::vector<void*>> free_;
  PoolStats stats_;
};

inline Buffer::~Buffer() {
  if (pool_) {
    pool_->release(data_, bytes_);
  } else {
    ::operator delete(data_, std::align_val_t(kBufferAlign));
  }
}

}  // namespace lazy
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
  explicit ThreadPool(int threads) { resize(threads); }
  ~ThreadPool() { stop(); }
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  /// Number of threads a parallel loop uses, the caller included.
  int size() const { return threads_; }

  /// Changes the thread count; must not be called while a loop runs.
  void resize(int threads) {
    stop();
    threads_ = std::max(1, threads);
    stopping_.store(false);
    // Workers start from the generation current now, not when they first run: a loop
    // submitted before a new worker got scheduled must not be skipped by it.
    const std::uint64_t start = generation_.load();
    for (int i = 1; i < threads_; ++i) workers_.emplace_back([this, start] { worker_loop(start); });
  }

  /// Runs fn(task) for task in [0, tasks); returns when all have run. The first exception
  /// thrown by a task is re-thrown here after the others finished.
  template <class F>
  void parallel_for(std::int64_t tasks, F&& fn) {
    if (tasks <= 0) return;
    if (tasks == 1 || threads_ == 1 || in_worker()) {
      for (std::int64_t t = 0; t < tasks; ++t) fn(t);
      return;
    }
    std::lock_guard submit(submit_mu_);
    bool wake = false;
    const TaskRef job{&fn, [](void* f, std::int64_t t) { (*static_cast<std::remove_reference_t<F>*>(f))(t); }};
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

 private:
  // A non-owning reference to the caller's loop body: no allocation per parallel loop.
  struct TaskRef {
    void* fn = nullptr;
    void (*call)(void*, std::int64_t) = nullptr;
  };

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

  void drain() {
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

  void worker_loop(std::uint64_t seen) {
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

  void stop() {
    {
      std::lock_guard lock(mu_);
      stopping_.store(true);
    }
    cv_.notify_all();
    for (auto& w : workers_) w.join();
    workers_.clear();
  }

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
// ---- end lazytensor/core/thread_pool.hpp ----
// ---- begin lazytensor/graph/tensor_impl.hpp ----
// The object every copy of a Tensor handle shares. In-place ops rebind `node`, so all
// copies see the new value (functionalization, as in libtorch/XLA).

#include <memory>
#include <mutex>

// ---- begin lazytensor/graph/node.hpp ----
// Runtime graph nodes. A node is a type-erased kernel plus its inputs; once computed it
// keeps only its buffer and drops its inputs, so the graph behind it can be freed.

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

// ---- begin lazytensor/core/dtype.hpp ----
// Element types and PyTorch's type promotion rules.

#include <cstddef>
#include <cstdint>
#include <string>
#include <tuple>
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
inline std::string dtype_name(DType d) {
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

template <class T>
inline constexpr bool is_floating_v =
    std::is_same_v<T, float> || std::is_same_v<T, double> || std::is_same_v<T, bfloat16>;
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

/// A tensor's dimensions. Value type, fixed capacity, no allocation.
class Shape {
 public:
  Shape() = default;
  /// Builds a shape from its sizes; throws ShapeError on negative sizes or rank > 8.
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

  /// Appends a dimension.
  void push_back(std::int64_t d) {
    if (rank_ == kMaxRank) throw ShapeError("rank exceeds the maximum of 8");
    dims_[rank_++] = d;
  }

  /// "(2, 3)" as PyTorch prints sizes; "()" for a scalar.
  std::string str() const {
    std::string s = "(";
    for (int i = 0; i < rank_; ++i) {
      if (i) s += ", ";
      s += std::to_string(dims_[i]);
    }
    if (rank_ == 1) s += ",";
    return s + ")";
  }

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
  }

  std::array<std::int64_t, kMaxRank> dims_{};
  int rank_ = 0;
};

/// Normalizes a possibly negative dimension index for a tensor of the given rank; `op` names
/// the caller in the error. A rank-0 tensor accepts -1 and 0 as PyTorch does.
inline int normalize_dim(std::int64_t dim, int rank, const char* op) {
  const int r = std::max(rank, 1);
  if (dim < -r || dim >= r) {
    throw ShapeError(std::string(op) + ": dimension out of range (expected to be in range of [" +
                     std::to_string(-r) + ", " + std::to_string(r - 1) + "], but got " +
                     std::to_string(dim) + ")");
  }
  return static_cast<int>(dim < 0 ? dim + r : dim);
}

inline std::int64_t Shape::size(int d) const { return dims_[normalize_dim(d, rank_, "size")]; }

/// Row-major strides of a shape, in elements.
inline std::array<std::int64_t, kMaxRank> contiguous_strides(const Shape& s) {
  std::array<std::int64_t, kMaxRank> st{};
  std::int64_t acc = 1;
  for (int i = s.rank() - 1; i >= 0; --i) {
    st[i] = acc;
    acc *= s[i];
  }
  return st;
}

/// NumPy broadcast of two shapes; throws ShapeError naming both shapes and the op.
inline Shape broadcast_shapes(const Shape& a, const Shape& b, const char* op) {
  if (a == b) return a;
  const int r = std::max(a.rank(), b.rank());
  Shape out;
  for (int i = 0; i < r; ++i) {
    const int ia = i - (r - a.rank()), ib = i - (r - b.rank());
    const std::int64_t da = ia >= 0 ? a[ia] : 1, db = ib >= 0 ? b[ib] : 1;
    if (da != db && da != 1 && db != 1) {
      throw ShapeError(std::string(op) + ": shapes " + a.str() + " and " + b.str() +
                       " are not broadcastable (dimension " + std::to_string(i) + ": " +
                       std::to_string(da) + " vs " + std::to_string(db) + ")");
    }
    out.push_back(da == 1 ? db : da);
  }
  return out;
}

/// True when `from` broadcasts to `to` (NumPy rules, `to` unchanged).
inline bool broadcastable_to(const Shape& from, const Shape& to) {
  if (from.rank() > to.rank()) return false;
  const int off = to.rank() - from.rank();
  for (int i = 0; i < from.rank(); ++i) {
    if (from[i] != 1 && from[i] != to[i + off]) return false;
  }
  return true;
}

}  // namespace lazy
// ---- end lazytensor/core/shape.hpp ----

namespace lazy::graph {

class Device;
class Node;
using NodePtr = std::shared_ptr<Node>;

/// What a node's kernel does, for the planner and for graph dumps.
enum class NodeKind { Data, Elementwise, Reduction, Gemm, View, Copy, Random, Host, Collective };

/// Execution context handed to a kernel.
struct ExecContext {
  Device& device;
};

/// A value in the pending graph of one device.
class Node {
 public:
  Node(NodeKind kind, DType dtype, Shape shape, Device* device, std::vector<NodePtr> inputs = {})
      : kind_(kind), dtype_(dtype), shape_(shape), device_(device), inputs_(std::move(inputs)),
        id_(next_id()) {}
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

  /// True once the value exists in a buffer.
  bool materialized() const { return buffer_ != nullptr; }
  const std::shared_ptr<Buffer>& buffer() const { return buffer_; }
  template <class T>
  const T* data() const {
    return static_cast<const T*>(buffer_->data());
  }

  /// Short op name ("add", "matmul", ...).
  virtual std::string op_name() const = 0;
  /// Longer description for graph dumps (the fused expression, reduction dims, ...).
  virtual std::string describe() const { return op_name(); }
  /// Hash of everything that determines the kernel's code and layout, but not its data.
  virtual std::uint64_t structural_hash() const;
  /// Estimated cost per output element (1 = one add), used to decide threading.
  virtual double cost_per_element() const { return 1.0; }

  /// Computes the value into a buffer. Called once, after every input is materialized.
  void run(ExecContext& ctx) {
    compute(ctx);
    finish();
  }

  /// Planner hook, called once per plan before execution, while the plan holds one extra
  /// reference to every node in it: a node may take over (defer) a producer's work, e.g. an
  /// element-wise epilogue running a GEMM in row blocks.
  virtual void fuse_producers() {}
  /// True when a consumer has taken over this node's computation for the current plan.
  bool deferred() const { return deferred_; }
  void set_deferred(bool d) { deferred_ = d; }

  /// Makes this node a materialized value holding `buf` (used by data nodes and views).
  void set_buffer(std::shared_ptr<Buffer> buf) { buffer_ = std::move(buf); }

  /// Steals the buffer of input `i` when nothing else can observe it (buffer donation):
  /// this node is the input's only holder, the input's buffer is not shared (views), and
  /// the input has this node's dtype and element count.
  std::shared_ptr<Buffer> try_donate(std::size_t i);

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
  static void release_chain(std::vector<NodePtr>& inputs) noexcept {
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

  static std::uint64_t next_id() {
    static std::atomic<std::uint64_t> n{0};
    return ++n;
  }

  NodeKind kind_;
  DType dtype_;
  Shape shape_;
  Device* device_;
  std::vector<NodePtr> inputs_;
  std::shared_ptr<Buffer> buffer_;
  std::uint64_t id_;
  bool deferred_ = false;
};

/// A value that already exists (factories, reads from host memory, computed results).
class DataNode final : public Node {
 public:
  DataNode(DType dtype, Shape shape, Device* device, std::shared_ptr<Buffer> buf)
      : Node(NodeKind::Data, dtype, shape, device) {
    set_buffer(std::move(buf));
  }
  std::string op_name() const override { return "data"; }

 protected:
  void compute(ExecContext&) override {}
};

/// Combines hashes (boost::hash_combine's mixing).
inline std::uint64_t hash_combine(std::uint64_t seed, std::uint64_t v) {
  return seed ^ (v + 0x9e3779b97f4a7c15ull + (seed << 6) + (seed >> 2));
}

inline std::uint64_t hash_shape(const Shape& s) {
  std::uint64_t h = static_cast<std::uint64_t>(s.rank());
  for (auto d : s) h = hash_combine(h, static_cast<std::uint64_t>(d));
  return h;
}

inline std::uint64_t Node::structural_hash() const {
  std::uint64_t h = hash_combine(static_cast<std::uint64_t>(kind_), static_cast<std::uint64_t>(dtype_));
  h = hash_combine(h, hash_shape(shape_));
  for (const auto& in : inputs_) {
    h = hash_combine(h, static_cast<std::uint64_t>(in->dtype()));
    h = hash_combine(h, hash_shape(in->shape()));
  }
  return hash_combine(h, std::hash<std::string>{}(op_name()));
}

inline std::shared_ptr<Buffer> Node::try_donate(std::size_t i) {
  NodePtr& in = inputs_[i];
  if (!in->materialized() || in->dtype() != dtype_ || in->numel() != numel()) return nullptr;
  long holders = 0;
  for (const auto& p : inputs_) holders += (p == in);
  if (in.use_count() != holders || in->buffer_.use_count() != 1) return nullptr;
  return std::move(in->buffer_);
}

}  // namespace lazy::graph
// ---- end lazytensor/graph/node.hpp ----

namespace lazy::graph {

/// Shared state behind a tensor handle.
struct TensorImpl {
  explicit TensorImpl(NodePtr n) : node(std::move(n)) {}
  NodePtr node;
  bool requires_grad = false;  // used by autograd
};

}  // namespace lazy::graph
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
  Device(int index, int threads)
      : index_(index), pool_(std::make_shared<BufferPool>()), threads_(threads) {}

  int index() const { return index_; }
  /// "CPU:0", as torch_xla prints devices.
  std::string str() const { return "CPU:" + std::to_string(index_); }

  ThreadPool& threads() { return threads_; }
  BufferPool& pool() { return *pool_; }

  /// Registers a handle, so mark_step can find the pending values that are still wanted.
  void register_handle(const std::shared_ptr<TensorImpl>& impl) {
    std::lock_guard lock(mu_);
    if (live_.size() >= compact_at_) {
      std::erase_if(live_, [](const auto& w) { return w.expired(); });
      compact_at_ = std::max<std::size_t>(1024, live_.size() * 2);
    }
    live_.push_back(impl);
  }

  /// The pending nodes that a live handle refers to.
  std::vector<NodePtr> pending_roots() {
    std::lock_guard lock(mu_);
    std::vector<NodePtr> roots;
    std::erase_if(live_, [&](const auto& w) {
      auto impl = w.lock();
      if (!impl) return true;
      if (impl->node && !impl->node->materialized()) roots.push_back(impl->node);
      return false;
    });
    compact_at_ = std::max<std::size_t>(1024, live_.size() * 2);
    return roots;
  }

  RngState& rng() { return rng_; }
  bool& eager() { return eager_; }

  void add_step_closure(std::function<void()> f) {
    std::lock_guard lock(mu_);
    closures_.push_back(std::move(f));
  }
  std::vector<std::function<void()>> take_step_closures() {
    std::lock_guard lock(mu_);
    return std::exchange(closures_, {});
  }

  /// Stores an execution error to be re-thrown at the next read or sync.
  void store_error(std::exception_ptr e) {
    std::lock_guard lock(mu_);
    if (!error_) error_ = e;
  }
  /// Re-throws (once) a stored execution error.
  void rethrow_stored_error() {
    std::exception_ptr e;
    {
      std::lock_guard lock(mu_);
      e = std::exchange(error_, nullptr);
    }
    if (e) std::rethrow_exception(e);
  }

 private:
  int index_;
  std::shared_ptr<BufferPool> pool_;
  ThreadPool threads_;
  std::mutex mu_;
  std::vector<std::weak_ptr<TensorImpl>> live_;
  std::size_t compact_at_ = 1024;
  RngState rng_;
  bool eager_ = false;
  std::vector<std::function<void()>> closures_;
  std::exception_ptr error_;
};

/// Threads a device uses by default: LAZYTENSOR_NUM_THREADS, else the hardware threads.
inline int default_device_threads() {
  if (const char* env = std::getenv("LAZYTENSOR_NUM_THREADS")) {
    const int n = std::atoi(env);
    if (n > 0) return n;
  }
  return std::max(1u, std::thread::hardware_concurrency());
}

/// All devices of this process. Created on first use; never destroyed before exit.
class DeviceRegistry {
 public:
  static DeviceRegistry& get() {
    static DeviceRegistry r;
    return r;
  }
  /// Device `index`, created on first use.
  Device& device(int index) {
    if (index < 0) throw DeviceError("device index must be >= 0, got " + std::to_string(index));
    std::lock_guard lock(mu_);
    while (static_cast<int>(devices_.size()) <= index) {
      devices_.push_back(std::make_unique<Device>(static_cast<int>(devices_.size()), default_device_threads()));
    }
    return *devices_[index];
  }
  /// Number of devices created so far (at least 1).
  int count() {
    device(0);
    std::lock_guard lock(mu_);
    return static_cast<int>(devices_.size());
  }

 private:
  std::mutex mu_;
  std::deque<std::unique_ptr<Device>> devices_;
};

/// Index of this thread's current device (replicas bind their thread to their device).
inline int& current_device_index() {
  thread_local int index = 0;
  return index;
}

/// This thread's current device.
inline Device& current_device() { return DeviceRegistry::get().device(current_device_index()); }

inline std::shared_ptr<Buffer> Node::allocate_output(ExecContext& ctx, bool allow_donation) {
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
// ---- end lazytensor/graph/device.hpp ----

namespace lazy::graph {

/// Pending nodes reachable from `roots`, producers before consumers (iterative DFS, so a
/// long chain of statements cannot overflow the stack).
inline std::vector<NodePtr> topological_order(const std::vector<NodePtr>& roots) {
  std::vector<NodePtr> order;
  std::unordered_set<const Node*> seen;
  std::vector<std::pair<Node*, std::size_t>> stack;
  std::vector<NodePtr> holders;  // keeps nodes alive while on the stack
  for (const auto& r : roots) {
    if (!r || r->materialized() || !seen.insert(r.get()).second) continue;
    stack.emplace_back(r.get(), 0);
    holders.push_back(r);
    while (!stack.empty()) {
      auto& [node, next] = stack.back();
      const auto& ins = node->inputs();
      if (next < ins.size()) {
        const NodePtr& in = ins[next++];
        if (!in->materialized() && seen.insert(in.get()).second) {
          stack.emplace_back(in.get(), 0);
        }
        continue;
      }
      // All inputs ordered: find the owning shared_ptr (the root or a consumer's input).
      Node* done = node;
      stack.pop_back();
      NodePtr owner;
      if (stack.empty()) {
        owner = r;
      } else {
        for (const auto& in : stack.back().first->inputs()) {
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

/// Materializes every pending node reachable from `roots` on `device`. Exceptions thrown
/// by a kernel propagate to the caller; the nodes not yet run stay pending.
inline void execute(Device& device, const std::vector<NodePtr>& roots) {
  static auto& execute_time = core::metric("ExecuteTime");
  static auto& kernels = core::counter("KernelsRun");
  std::vector<NodePtr> order = topological_order(roots);
  if (order.empty()) return;
  for (const auto& n : order) n->fuse_producers();
  std::vector<NodePtr> deferred;  // to undo the take-over if a kernel throws
  for (const auto& n : order)
    if (n->deferred()) deferred.push_back(n);
  core::ScopedTimer timer(execute_time);
  ExecContext ctx{device};
  std::int64_t ran = 0;
  try {
    for (auto& slot : order) {
      // Take the plan's reference, so a finished node is held only by its consumers and
      // handles (buffer donation counts on that).
      NodePtr n = std::move(slot);
      if (n->materialized() || n->deferred()) continue;
      n->run(ctx);
      ++ran;
    }
  } catch (...) {
    for (auto& n : deferred) n->set_deferred(false);
    kernels.add(ran);
    throw;
  }
  kernels.add(ran);
}

}  // namespace lazy::graph
// ---- end lazytensor/graph/executor.hpp ----
// ---- begin lazytensor/tensor.hpp ----
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

#include <Eigen/Core>

// ---- begin lazytensor/expr/expr.hpp ----
// Expression nodes. They are thin: an op type and its operands. Leaves hold the graph node
// of a tensor's value at the time the expression was built (so `auto e = a + 1; a += 5;`
// keeps meaning the old `a`), scalars hold their value, and the shape is broadcast once,
// at construction, where a mismatch is reported against the line that built it.

#include <concepts>
#include <cstdint>
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
#define LAZY_UNARY_OP(NAME, STR, COST, RESULT, BODY)             \
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
  };

#define LAZY_BINARY_OP(NAME, STR, COST, RESULT, BODY) \
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
  };

// Unary ops. Results of floating-only functions on integers are float, as in PyTorch.
LAZY_UNARY_OP(Neg, "neg", 1, (T), (return -a;))
LAZY_UNARY_OP(Identity, "identity", 0.5, (T), (return a;))
LAZY_UNARY_OP(Exp, "exp", 8, (to_floating_t<T>), (return exp(a);))
LAZY_UNARY_OP(Log, "log", 8, (to_floating_t<T>), (return log(a);))
LAZY_UNARY_OP(Log1p, "log1p", 10, (to_floating_t<T>), (return log1p(a);))
LAZY_UNARY_OP(Expm1, "expm1", 10, (to_floating_t<T>), (return expm1(a);))
LAZY_UNARY_OP(Sqrt, "sqrt", 4, (to_floating_t<T>), (return sqrt(a);))
// Full-precision 1/sqrt: xsimd::rsqrt is an approximation on x86.
LAZY_UNARY_OP(Rsqrt, "rsqrt", 5, (to_floating_t<T>), (return V(1) / sqrt(a);))
LAZY_UNARY_OP(Abs, "abs", 1, (T), (return abs(a);))
LAZY_UNARY_OP(Sign, "sign", 2, (T), (return from_bool<V>(a > V(0)) - from_bool<V>(a < V(0));))
LAZY_UNARY_OP(Sin, "sin", 10, (to_floating_t<T>), (return sin(a);))
LAZY_UNARY_OP(Cos, "cos", 10, (to_floating_t<T>), (return cos(a);))
LAZY_UNARY_OP(Tanh, "tanh", 10, (to_floating_t<T>), (return tanh(a);))
LAZY_UNARY_OP(Sigmoid, "sigmoid", 10, (to_floating_t<T>), (return V(1) / (V(1) + exp(-a));))
// relu keeps NaN (NaN < 0 is false), like torch.relu.
LAZY_UNARY_OP(Relu, "relu", 1, (T), (return select(a < V(0), V(0), a);))
// Exact (erf) GELU, torch's default approximate='none'.
LAZY_UNARY_OP(Gelu, "gelu", 12, (to_floating_t<T>), (return V(0.5) * a * (V(1) + erf(a * V(0.70710678118654752440)));))
LAZY_UNARY_OP(Silu, "silu", 10, (to_floating_t<T>), (return a / (V(1) + exp(-a));))
// softplus with torch's default threshold 20: linear above it.
LAZY_UNARY_OP(Softplus, "softplus", 12, (to_floating_t<T>), (return select(a > V(20), a, log1p(exp(a)));))
LAZY_UNARY_OP(LogicalNot, "logical_not", 1, (bool), (return from_bool<V>(a == V(0));))

// Binary ops.
LAZY_BINARY_OP(Add, "add", 1, (promoted<A, B>), (return a + b;))
LAZY_BINARY_OP(Sub, "sub", 1, (promoted<A, B>), (return a - b;))
LAZY_BINARY_OP(Mul, "mul", 1, (promoted<A, B>), (return a * b;))
LAZY_BINARY_OP(Div, "div", 2, (to_floating_t<promoted<A, B>>), (return a / b;))
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
  }))
// maximum/minimum propagate NaN from either side, like torch.maximum.
LAZY_BINARY_OP(Maximum, "maximum", 2, (promoted<A, B>), (return select((a > b) | is_nan(a), a, b);))
LAZY_BINARY_OP(Minimum, "minimum", 2, (promoted<A, B>), (return select((a < b) | is_nan(a), a, b);))
LAZY_BINARY_OP(Eq, "eq", 1, (bool), (return from_bool<V>(a == b);))
LAZY_BINARY_OP(Ne, "ne", 1, (bool), (return from_bool<V>(not_equal(a, b));))
LAZY_BINARY_OP(Lt, "lt", 1, (bool), (return from_bool<V>(a < b);))
LAZY_BINARY_OP(Le, "le", 1, (bool), (return from_bool<V>(a <= b);))
LAZY_BINARY_OP(Gt, "gt", 1, (bool), (return from_bool<V>(a > b);))
LAZY_BINARY_OP(Ge, "ge", 1, (bool), (return from_bool<V>(a >= b);))
LAZY_BINARY_OP(LogicalAnd, "logical_and", 1, (bool), (return from_bool<V>(not_equal(a, V(0)) & not_equal(b, V(0)));))
LAZY_BINARY_OP(LogicalOr, "logical_or", 1, (bool), (return from_bool<V>(not_equal(a, V(0)) | not_equal(b, V(0)));))

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
};

}  // namespace lazy::ops
// ---- end lazytensor/expr/functors.hpp ----

namespace lazy {

namespace expr {

/// A tensor operand: the graph node holding its value.
template <Element T>
struct Leaf {
  using value_type = T;
  graph::NodePtr node;
  const Shape& shape() const { return node->shape(); }
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

/// Anything usable as a tensor operand: an Expr, or a handle with `to_leaf()` (Tensor).
template <class X>
concept ExprLike = is_expr_node<std::remove_cvref_t<X>>::value || requires(const X& x) {
  { x.to_leaf() };
};

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

}  // namespace expr

// ---- operators ------------------------------------------------------------------------

#define LAZY_BINARY_OPERATOR(SYM, OP)                                   \
  template <class A, class B>                                          \
    requires expr::BinaryOperands<A, B>                                \
  auto operator SYM(const A& a, const B& b) {                          \
    return expr::make<ops::OP>(a, b);                                  \
  }
LAZY_BINARY_OPERATOR(+, Add)
LAZY_BINARY_OPERATOR(-, Sub)
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

/// Element-wise negation.
template <expr::ExprLike A>
auto operator-(const A& a) {
  return expr::make<ops::Neg>(a);
}
/// Element-wise logical not (a bool expression).
template <expr::ExprLike A>
auto operator!(const A& a) {
  return expr::make<ops::LogicalNot>(a);
}

#define LAZY_UNARY_FUNCTION(FN, OP, DOC)   \
  /** DOC */                               \
  template <expr::ExprLike A>              \
  auto FN(const A& a) {                    \
    return expr::make<ops::OP>(a);         \
  }
LAZY_UNARY_FUNCTION(exp, Exp, Element-wise e^x.)
LAZY_UNARY_FUNCTION(log, Log, Element-wise natural logarithm.)
LAZY_UNARY_FUNCTION(log1p, Log1p, Element-wise log(1 + x) accurate near 0.)
LAZY_UNARY_FUNCTION(expm1, Expm1, Element-wise e^x - 1 accurate near 0.)
LAZY_UNARY_FUNCTION(sqrt, Sqrt, Element-wise square root.)
LAZY_UNARY_FUNCTION(rsqrt, Rsqrt, Element-wise 1 / sqrt(x).)
LAZY_UNARY_FUNCTION(abs, Abs, Element-wise absolute value.)
LAZY_UNARY_FUNCTION(sign, Sign, Element-wise sign: -1 0 or 1.)
LAZY_UNARY_FUNCTION(sin, Sin, Element-wise sine.)
LAZY_UNARY_FUNCTION(cos, Cos, Element-wise cosine.)
LAZY_UNARY_FUNCTION(tanh, Tanh, Element-wise hyperbolic tangent.)
LAZY_UNARY_FUNCTION(sigmoid, Sigmoid, Element-wise logistic function 1 / (1 + e^-x).)
LAZY_UNARY_FUNCTION(relu, Relu, Element-wise max(x 0) keeping NaN.)
LAZY_UNARY_FUNCTION(gelu, Gelu, Element-wise exact GELU x * Phi(x).)
LAZY_UNARY_FUNCTION(silu, Silu, Element-wise x * sigmoid(x).)
LAZY_UNARY_FUNCTION(softplus, Softplus, Element-wise log(1 + e^x) (linear above 20).)
LAZY_UNARY_FUNCTION(logical_not, LogicalNot, Element-wise logical not.)
#undef LAZY_UNARY_FUNCTION

/// Element-wise a^b.
template <class A, class B>
  requires expr::BinaryOperands<A, B>
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
/// Clamps to [lo, hi]; NaN stays NaN.
template <expr::ExprLike X, class L, class H>
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
      return expr::scalar_for<weak_scalar_t<std::int64_t, std::common_type_t<A, B>>>(x);
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
// ---- begin lazytensor/graph/builders.hpp ----
// Turning expressions into pending graph nodes.

#include <memory>
#include <string>
#include <vector>

// ---- begin lazytensor/graph/elementwise_node.hpp ----
// The graph node of a fused element-wise kernel: one expression, one output, one pass.

#include <cstdint>
#include <string>
#include <typeinfo>
#include <vector>

// ---- begin lazytensor/expr/evaluator.hpp ----
// Evaluators: built per kernel run from a kernel-form expression and the input pointers.
// They carry what nodes do not: pointers, the splat flags, the lane type S, and the
// scalar (coeff) and SIMD (packet) access paths. Eigen's split, in short.

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

#include <cstdint>
#include <memory>
#include <string>
#include <tuple>
#include <vector>


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

/// Converts an expression to kernel form, appending its distinct leaf nodes to `inputs`.
template <Element T>
KLeaf<T> to_kernel(const Leaf<T>& l, std::vector<graph::NodePtr>& inputs) {
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    if (inputs[i] == l.node) return {static_cast<int>(i)};
  }
  inputs.push_back(l.node);
  return {static_cast<int>(inputs.size() - 1)};
}
template <Element T>
Scalar<T> to_kernel(const Scalar<T>& s, std::vector<graph::NodePtr>&) {
  return s;
}
template <class Op, class... C>
auto to_kernel(const Expr<Op, C...>& e, std::vector<graph::NodePtr>& inputs) {
  return std::apply(
      [&](const auto&... ch) {
        // Braced initialization evaluates left to right: slots follow operand order.
        return KExpr<Op, kernel_form_t<C>...>{std::tuple<kernel_form_t<C>...>{to_kernel(ch, inputs)...}};
      },
      e.children());
}

/// Sum of the op costs of a kernel-form expression, per output element.
template <class K>
constexpr double kernel_cost() {
  if constexpr (requires { typename K::op_type; }) {
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

/// Hash of the scalar operands' classes: 0, 1, -1 or "other". Other values do not enter
/// the plan's identity, so a new learning rate reuses the cached plan.
template <class K>
std::uint64_t scalar_classes(const K& k) {
  if constexpr (requires { typename K::op_type; }) {
    std::uint64_t h = 7;
    std::apply([&](const auto&... ch) { ((h = h * 31 + scalar_classes(ch)), ...); }, k.children);
    return h;
  } else if constexpr (is_scalar<K>::value) {
    const double v = static_cast<double>(static_cast<compute_t<typename K::value_type>>(k.value));
    return v == 0 ? 1 : v == 1 ? 2 : v == -1 ? 3 : 4;
  } else {
    return 5;
  }
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
  std::vector<std::array<std::int64_t, kMaxRank>> stride;  ///< per input slot
  std::vector<char> splat;                                  ///< innermost stride is 0

  bool flat() const { return ndim == 1; }
  std::int64_t inner() const { return size[ndim - 1]; }
  bool any_splat() const {
    for (char s : splat)
      if (s) return true;
    return false;
  }
};

/// Layout for writing `out` from inputs of the given shapes (each broadcastable to out).
inline Layout make_layout(const Shape& out, const std::vector<Shape>& inputs) {
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
  S value;
  Eval(const Scalar<T>& s, const void* const*, const char*) : value(static_cast<S>(static_cast<compute_t<T>>(s.value))) {}
  void seek(const std::int64_t*) {}
  S coeff(std::int64_t) const { return value; }
  template <bool Contig>
  batch_t<S> packet(std::int64_t) const {
    return batch_t<S>(value);
  }
};

template <class S, class Op, class... C>
struct Eval<S, KExpr<Op, C...>> {
  std::tuple<Eval<S, C>...> children;

  Eval(const KExpr<Op, C...>& k, const void* const* ptrs, const char* splats)
      : children(std::apply([&](const auto&... ch) { return std::tuple<Eval<S, C>...>{Eval<S, C>(ch, ptrs, splats)...}; },
                            k.children)) {}
  void seek(const std::int64_t* offsets) {
    std::apply([&](auto&... ch) { (ch.seek(offsets), ...); }, children);
  }
  S coeff(std::int64_t i) const {
    return std::apply([&](const auto&... ch) { return Op::apply(ch.coeff(i)...); }, children);
  }
  template <bool Contig>
  batch_t<S> packet(std::int64_t i) const {
    return std::apply([&](const auto&... ch) { return Op::apply(ch.template packet<Contig>(i)...); }, children);
  }
};

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

/// Evaluates `k` over the flat element range [b, e) of an output of `n` elements whose
/// inputs are all contiguous or single elements. A range ending at `n` finishes with one
/// whole batch that runs into the buffers' padding instead of a scalar tail. With
/// `Stream`, `out + b` must be batch-aligned and the caller fences after the kernel.
template <class S, class Tout, bool Contig, class K, bool Stream = false>
void eval_flat_range(const Eval<S, K>& ev_in, Tout* out, std::int64_t b, std::int64_t e, std::int64_t n) {
  // A local copy: stores through `out` may alias anything, which would otherwise force a
  // reload of every leaf pointer from *ev_in after each store.
  const Eval<S, K> ev = ev_in;
  std::int64_t i = b;
  if constexpr (simd_lane_v<S>) {
    constexpr std::int64_t W = batch_t<S>::size;
    if constexpr (Stream && std::is_same_v<S, Tout>) {
      for (; i + W <= e; i += W) stream_store<S>(out + i, ev.template packet<Contig>(i));
    }
    for (; i + W <= e; i += W) store_lane<Tout, S>(out + i, ev.template packet<Contig>(i));
    if (i < e && e == n) {
      store_lane<Tout, S>(out + i, ev.template packet<Contig>(i));
      return;
    }
  }
  for (; i < e; ++i) out[i] = to_storage<Tout>(ev.coeff(i));
}

/// Evaluates one row of `len` elements whose leaves were positioned with seek().
template <class S, class Tout, class K>
void eval_row(const Eval<S, K>& ev, Tout* out, std::int64_t len) {
  std::int64_t i = 0;
  if constexpr (simd_lane_v<S>) {
    constexpr std::int64_t W = batch_t<S>::size;
    for (; i + W <= len; i += W) store_lane<Tout, S>(out + i, ev.template packet<false>(i));
  }
  for (; i < len; ++i) out[i] = to_storage<Tout>(ev.coeff(i));
}

/// Evaluates rows [r0, r1) of a layout with several collapsed dimensions.
template <class S, class Tout, class K>
void eval_rows(Eval<S, K>& ev, const Layout& L, Tout* out, std::int64_t r0, std::int64_t r1) {
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
    eval_row<S, Tout>(ev, out + r * inner, inner);
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

/// A producer whose rows a consumer can compute block by block into its own buffer
/// (GEMM feeding an element-wise epilogue).
class RowProducer {
 public:
  virtual ~RowProducer() = default;
  /// Writes rows [r0, r1) of this node's value (viewed as rows x last dim) into `out`,
  /// a buffer laid out like this node's value. Runs on the calling thread only.
  virtual void produce_rows(void* out, std::int64_t r0, std::int64_t r1) = 0;
};

/// Evaluates kernel-form expression K into a tensor of type Tout.
template <class K, Element Tout>
class ElementwiseNode final : public Node {
 public:
  using S = expr::klane_t<K>;

  ElementwiseNode(K kernel, Shape shape, Device* device, std::vector<NodePtr> inputs)
      : Node(NodeKind::Elementwise, dtype_of<Tout>(), shape, device, std::move(inputs)),
        kernel_(std::move(kernel)) {
    std::vector<Shape> shapes;
    for (const auto& in : this->inputs()) shapes.push_back(in->shape());
    layout_ = expr::make_layout(shape, shapes);
  }

  std::string op_name() const override { return "fused"; }
  std::string describe() const override { return expr::kernel_text(kernel_); }
  double cost_per_element() const override { return expr::kernel_cost<K>(); }
  std::uint64_t structural_hash() const override {
    return hash_combine(hash_combine(Node::structural_hash(), typeid(K).hash_code()),
                        expr::scalar_classes(kernel_));
  }
  const expr::Layout& layout() const { return layout_; }

  void fuse_producers() override {
    // Take over a GEMM producer that nothing else reads: it then runs in row blocks, each
    // followed at once by this epilogue while the block is still in cache.
    const auto& ins = inputs();
    for (std::size_t i = 0; i < ins.size(); ++i) {
      if (ins[i]->kind() != NodeKind::Gemm) continue;
      auto* rp = dynamic_cast<RowProducer*>(ins[i].get());
      if (!rp || ins[i]->materialized() || ins[i]->dtype() != dtype() || !(ins[i]->shape() == shape()) ||
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

 protected:
  void compute(ExecContext& ctx) override {
    const auto& ins = inputs();
    std::vector<const void*> ptrs(ins.size());
    for (std::size_t i = 0; i < ins.size(); ++i) {
      ptrs[i] = static_cast<int>(i) == fused_slot_ ? nullptr : ins[i]->buffer()->data();
    }
    auto buf = allocate_output(ctx, fused_slot_ < 0);
    Tout* out = static_cast<Tout*>(buf->data());
    if (fused_slot_ >= 0) {
      ptrs[fused_slot_] = out;  // the epilogue reads the GEMM block in place
      run_with_producer(ctx, ptrs, out);
    } else {
      run(ctx, ptrs, out);
    }
    set_buffer(std::move(buf));
  }

  void finish() override {
    fused_slot_ = -1;
    Node::finish();
  }

 private:
  void run(ExecContext& ctx, const std::vector<const void*>& ptrs, Tout* out) const {
    const std::int64_t n = numel();
    if (n == 0) return;
    auto& pool = ctx.device.threads();
    const double cost = expr::kernel_cost<K>();
    if (layout_.flat()) {
      const std::int64_t tasks = task_count(pool, n, cost);
      const bool contig = !layout_.any_splat();
      const bool stream = n * static_cast<std::int64_t>(sizeof(Tout)) >= expr::kStreamingStoreBytes;
      pool.parallel_for(tasks, [&](std::int64_t t) {
        auto [b, e] = task_range(n, tasks, t, kPadElements);
        expr::Eval<S, K> ev(kernel_, ptrs.data(), layout_.splat.data());
        if (stream) {
          if (contig) expr::eval_flat_range<S, Tout, true, K, true>(ev, out, b, e, n);
          else expr::eval_flat_range<S, Tout, false, K, true>(ev, out, b, e, n);
          expr::store_fence();
        } else if (contig) {
          expr::eval_flat_range<S, Tout, true>(ev, out, b, e, n);
        } else {
          expr::eval_flat_range<S, Tout, false>(ev, out, b, e, n);
        }
      });
    } else {
      const std::int64_t rows = n / layout_.inner();
      const std::int64_t tasks = task_count(pool, n, cost);
      pool.parallel_for(std::min(tasks, rows), [&](std::int64_t t) {
        auto [r0, r1] = task_range(rows, std::min(tasks, rows), t);
        expr::Eval<S, K> ev(kernel_, ptrs.data(), layout_.splat.data());
        expr::eval_rows<S, Tout>(ev, layout_, out, r0, r1);
      });
    }
  }

  // Each thread runs the GEMM on its rows in as few calls as possible (every call re-packs
  // the right-hand matrix), in blocks of at most ~512 KiB of output so that the epilogue
  // rewrites them in place while they are still in L2.
  void run_with_producer(ExecContext& ctx, const std::vector<const void*>& ptrs, Tout* out) {
    auto* producer = dynamic_cast<RowProducer*>(inputs()[fused_slot_].get());
    const std::int64_t cols = shape()[shape().rank() - 1];
    const std::int64_t rows = cols ? numel() / cols : 0;
    if (rows == 0) return;
    auto& pool = ctx.device.threads();
    const std::int64_t threads = std::min<std::int64_t>(
        std::max(1, pool.size()), std::max<std::int64_t>(1, task_count(pool, numel(), producer_cost())));
    const std::int64_t row_bytes = cols * static_cast<std::int64_t>(sizeof(Tout));
    const std::int64_t by_cache = (rows * row_bytes + (512 << 10) - 1) / (512 << 10);
    const std::int64_t wanted = std::min(rows, std::max(threads, (by_cache + threads - 1) / threads * threads));
    const std::int64_t block = (rows + wanted - 1) / wanted;
    const std::int64_t blocks = (rows + block - 1) / block;
    const std::int64_t tasks = std::min(threads, blocks);
    pool.parallel_for(tasks, [&](std::int64_t t) {
      auto [b0, b1] = task_range(blocks, tasks, t);
      expr::Eval<S, K> ev(kernel_, ptrs.data(), layout_.splat.data());
      for (std::int64_t b = b0; b < b1; ++b) {
        const std::int64_t r0 = b * block, r1 = std::min(rows, r0 + block);
        producer->produce_rows(out, r0, r1);
        if (layout_.flat()) {
          if (layout_.any_splat()) expr::eval_flat_range<S, Tout, false>(ev, out, r0 * cols, r1 * cols, numel());
          else expr::eval_flat_range<S, Tout, true>(ev, out, r0 * cols, r1 * cols, numel());
        } else {
          expr::eval_rows<S, Tout>(ev, layout_, out, r0, r1);  // inner == cols (fuse_producers)
        }
      }
    });
    inputs()[fused_slot_]->set_deferred(false);
  }

  double producer_cost() const { return inputs()[fused_slot_]->cost_per_element(); }

  K kernel_;
  expr::Layout layout_;
  int fused_slot_ = -1;
};

}  // namespace lazy::graph
// ---- end lazytensor/graph/elementwise_node.hpp ----

namespace lazy::graph {

/// The device shared by `inputs`; throws DeviceError when they differ. With no inputs,
/// the current device.
inline Device& common_device(const std::vector<NodePtr>& inputs, const char* op) {
  Device* d = inputs.empty() ? &current_device() : inputs.front()->device();
  for (const auto& in : inputs) {
    if (in->device() != d) {
      throw DeviceError(std::string(op) + ": expected all tensors on the same device, found " + d->str() +
                        " and " + in->device()->str());
    }
  }
  return *d;
}

/// Adds a node to its device's pending graph; in eager mode it runs at once.
inline NodePtr submit(NodePtr node) {
  if (node->device()->eager()) execute(*node->device(), {node});
  return node;
}

/// A pending node evaluating expression `e` into a tensor of type Tout and shape `shape`
/// (the expression's own shape, or one it broadcasts to).
template <Element Tout, class E>
NodePtr make_elementwise(const E& e, const Shape& shape) {
  std::vector<NodePtr> inputs;
  auto k = expr::to_kernel(e, inputs);
  Device& dev = common_device(inputs, E::op_type::name);
  return submit(std::make_shared<ElementwiseNode<decltype(k), Tout>>(std::move(k), shape, &dev, std::move(inputs)));
}

template <Element Tout, class E>
NodePtr make_elementwise(const E& e) {
  return make_elementwise<Tout>(e, e.shape());
}

/// Materializes `node` (and what it needs). Returns true when it was pending.
inline bool materialize(const NodePtr& node) {
  Device& dev = *node->device();
  dev.rethrow_stored_error();
  if (node->materialized()) return false;
  execute(dev, {node});
  return true;
}

}  // namespace lazy::graph
// ---- end lazytensor/graph/builders.hpp ----

namespace lazy {

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

  /// Captures an expression as a pending node; nothing is computed until a sync or read.
  template <class Op, class... C>
  Tensor(const Expr<Op, C...>& e)  // NOLINT: implicit, as `Tensor<float> y = a + b;`
      : Tensor(graph::make_elementwise<T>(e)) {}

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
  auto eigen() const
    requires(!std::is_same_v<T, bfloat16>)
  {
    using M = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
    const Shape& s = shape();
    const std::int64_t cols = s.rank() == 0 ? 1 : s.rank() == 1 ? 1 : s[s.rank() - 1];
    const std::int64_t rows = cols == 0 ? 0 : numel() / cols;
    return Eigen::Map<const M>(data(), static_cast<Eigen::Index>(rows), static_cast<Eigen::Index>(cols));
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

  /// The tensor as an expression operand.
  expr::Leaf<T> to_leaf() const { return {node()}; }
  /// The graph node holding the current value.
  const graph::NodePtr& node() const {
    if (!impl_) throw Error("use of an undefined tensor (default-constructed lazy::Tensor)");
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
    std::vector<graph::NodePtr> none;
    using E = Expr<ops::Identity, expr::Scalar<T>>;
    E e(expr::Scalar<T>{static_cast<T>(v)});
    impl_->node = graph::submit(std::make_shared<graph::ElementwiseNode<expr::kernel_form_t<E>, T>>(
        expr::to_kernel(e, none), shape(), node()->device(), std::vector<graph::NodePtr>{}));
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
    impl_->node = graph::make_elementwise<T>(e, shape());
    return *this;
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

/// Evaluates an expression into a new tensor of its natural type.
template <class Op, class... C>
auto eval(const Expr<Op, C...>& e) {
  return Tensor<typename Expr<Op, C...>::value_type>(e);
}

}  // namespace lazy
// ---- end lazytensor/tensor.hpp ----

namespace lazy::debug {

/// A tensor handle (anything with node()).
template <class T>
concept HasNode = requires(const T& t) { t.node(); };

namespace detail {
template <class... Ts>
std::vector<graph::NodePtr> roots_of(const Ts&... ts) {
  return {ts.node()...};
}

inline std::vector<graph::NodePtr> with_inputs(const std::vector<graph::NodePtr>& roots) {
  // Pending nodes in execution order, plus the materialized values they read.
  std::vector<graph::NodePtr> order = graph::topological_order(roots);
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

inline std::string type_str(const graph::Node& n) { return dtype_name(n.dtype()) + n.shape().str(); }
}  // namespace detail

/// The graph that computes `tensors`, one node per line in execution order:
/// `%3 = float32(4, 4) fused(add(%0, %1)) <- %1, %2`. Materialized inputs show as data.
inline std::string graph_text(const std::vector<graph::NodePtr>& roots) {
  auto nodes = detail::with_inputs(roots);
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
    for (const auto& r : roots)
      if (r == n) {
        os << "  (output)";
        break;
      }
    os << "\n";
  }
  return os.str();
}

/// The graph as text for tensors given directly: graph_text(y, z).
template <class... Ts>
std::string graph_text(const Ts&... tensors)
  requires(sizeof...(Ts) > 0 && (HasNode<Ts> && ...))
{
  return graph_text(detail::roots_of(tensors...));
}

/// The graph in Graphviz DOT; render with `dot -Tpng`.
inline std::string graph_dot(const std::vector<graph::NodePtr>& roots) {
  auto nodes = detail::with_inputs(roots);
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
    os << "  n" << id[n.get()] << " [label=\"%" << id[n.get()] << " " << esc << "\\n" << detail::type_str(*n) << "\""
       << (n->materialized() ? ", style=dashed" : "") << (out ? ", peripheries=2" : "") << "];\n";
  }
  for (const auto& n : nodes)
    if (!n->materialized())
      for (const auto& in : n->inputs()) os << "  n" << id[in.get()] << " -> n" << id[n.get()] << ";\n";
  os << "}\n";
  return os.str();
}

/// DOT for tensors given directly.
template <class... Ts>
std::string graph_dot(const Ts&... tensors)
  requires(sizeof...(Ts) > 0 && (HasNode<Ts> && ...))
{
  return graph_dot(detail::roots_of(tensors...));
}

}  // namespace lazy::debug
// ---- end lazytensor/debug/graph_dump.hpp ----
// ---- begin lazytensor/debug/metrics.hpp ----
// Counters and metrics, named like PyTorch/XLA's (torch_xla.debug.metrics).

#include <cstdint>
#include <iomanip>
#include <optional>
#include <sstream>
#include <string>
#include <vector>


namespace lazy::debug {

/// Value of counter `name` (0 when it never fired), as met.counter_value.
inline std::int64_t counter_value(const std::string& name) {
  std::int64_t v = 0;
  core::Registry::get().for_each([&](const std::string& n, const core::Counter* c, const core::Metric*) {
    if (c && n == name) v = c->value.load();
  });
  return v;
}

/// Summary of metric `name` (count, total, min, max in ns), if it was ever recorded.
inline std::optional<core::MetricData> metric_data(const std::string& name) {
  std::optional<core::MetricData> r;
  core::Registry::get().for_each([&](const std::string& n, const core::Counter*, const core::Metric* m) {
    if (m && n == name && m->data().count) r = m->data();
  });
  return r;
}

/// Names of the counters that fired.
inline std::vector<std::string> counter_names() {
  std::vector<std::string> names;
  core::Registry::get().for_each([&](const std::string& n, const core::Counter* c, const core::Metric*) {
    if (c && c->value.load()) names.push_back(n);
  });
  return names;
}

/// Resets every counter and metric to zero.
inline void clear_metrics() { core::Registry::get().reset(); }

namespace detail {
inline std::string fmt_ns(double ns) {
  std::ostringstream os;
  os << std::fixed << std::setprecision(3);
  if (ns >= 1e9) os << ns / 1e9 << "s";
  else if (ns >= 1e6) os << ns / 1e6 << "ms";
  else if (ns >= 1e3) os << ns / 1e3 << "us";
  else os << ns << "ns";
  return os.str();
}
}  // namespace detail

/// Every metric and counter, plus the buffer pool of device 0, in PyTorch/XLA's format.
inline std::string metrics_report() {
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

/// One line: steps, syncs, kernels, time executing and bytes allocated.
inline std::string short_metrics_report() {
  std::ostringstream os;
  auto exec = metric_data("ExecuteTime");
  os << "MarkStep=" << counter_value("MarkStep") << " ImplicitSync=" << counter_value("ImplicitSync")
     << " KernelsRun=" << counter_value("KernelsRun")
     << " ExecuteTime=" << detail::fmt_ns(exec ? exec->total_ns : 0)
     << " BytesAllocated=" << graph::current_device().pool().stats().fresh_bytes;
  return os.str();
}

}  // namespace lazy::debug
// ---- end lazytensor/debug/metrics.hpp ----
// ---- begin lazytensor/device.hpp ----
// Devices and steps: mark_step/sync, eager mode, step closures, compile, RNG state.

#include <functional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>


namespace lazy {

/// Number of devices of this process (LAZYTENSOR_NUM_DEVICES, default 1).
inline int device_count() {
  static const int n = [] {
    const char* env = std::getenv("LAZYTENSOR_NUM_DEVICES");
    const int v = env ? std::atoi(env) : 1;
    return v > 0 ? v : 1;
  }();
  return n;
}

/// Every device of this process.
inline std::vector<Device> devices() {
  std::vector<Device> d;
  for (int i = 0; i < device_count(); ++i) d.emplace_back(i);
  return d;
}

/// Device `index` (DeviceError when out of range).
inline Device device(int index) {
  if (index < 0 || index >= device_count()) {
    throw DeviceError("device index " + std::to_string(index) + " out of range: this process has " +
                      std::to_string(device_count()) + " device(s)");
  }
  return Device(index);
}

/// Makes `d` this thread's current device.
inline void set_device(const Device& d) { graph::current_device_index() = d.index(); }

/// Materializes every pending value that a live tensor handle on the current device can
/// reach, then runs the step closures and advances the device's random stream. A node
/// that no handle reaches is never computed.
inline void mark_step() {
  static auto& steps = core::counter("MarkStep");
  graph::Device& dev = graph::current_device();
  steps.add();
  dev.rethrow_stored_error();
  graph::execute(dev, dev.pending_roots());
  // A new step draws fresh random numbers, as XLA's seed advance after mark_step.
  auto& rng = dev.rng();
  rng.seed = graph::hash_combine(rng.seed, 0x9e3779b97f4a7c15ull);
  rng.offset = 0;
  for (auto& f : dev.take_step_closures()) f();
}

/// Alias of mark_step(), as torch_xla.sync().
inline void sync() { mark_step(); }

/// Waits for every enqueued execution on the current device (execution is synchronous
/// today, so this only surfaces a stored error).
inline void wait_device_ops() { graph::current_device().rethrow_stored_error(); }

/// Queues f to run after the next mark_step on the current device (xm.add_step_closure).
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
inline void set_rng_state(std::uint64_t seed) {
  auto& rng = graph::current_device().rng();
  rng.seed = seed;
  rng.offset = 0;
}
/// The current device's seed.
inline std::uint64_t get_rng_state() { return graph::current_device().rng().seed; }

}  // namespace lazy
// ---- end lazytensor/device.hpp ----
// ---- begin lazytensor/ops/factories.hpp ----
// Tensor factories: constants (lazy), ranges and host data (materialized at once).

#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

#include <Eigen/Core>


namespace lazy {

/// A tensor of `shape` filled with `value` (a lazy node: no memory is touched until used).
template <Element T, expr::Number V>
Tensor<T> full(const Shape& shape, V value, Device dev = device()) {
  using E = Expr<ops::Identity, expr::Scalar<T>>;
  E e(expr::Scalar<T>{static_cast<T>(value)});
  std::vector<graph::NodePtr> none;
  return Tensor<T>(graph::submit(std::make_shared<graph::ElementwiseNode<expr::kernel_form_t<E>, T>>(
      expr::to_kernel(e, none), shape, &dev.engine(), std::vector<graph::NodePtr>{})));
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

/// A 2-D tensor copied from an Eigen matrix or expression (any storage order).
template <class Derived>
auto from_eigen(const Eigen::DenseBase<Derived>& m, Device dev = device()) {
  using T = typename Derived::Scalar;
  const Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor> rm = m;
  return Tensor<T>(detail::data_node<T>(rm.data(), Shape{rm.rows(), rm.cols()}, dev));
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
// ---- begin lazytensor/ops/matmul.hpp ----
// matmul, linear, bmm: Eigen GEMM on maps of the buffers. Transposes are layouts (a pending
// transpose of the last two dims is read through, never copied), and a GEMM that feeds
// only an element-wise expression runs in row blocks with that expression applied to each
// block while it is in cache (see ElementwiseNode::fuse_producers).

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include <Eigen/Core>

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
// ---- begin lazytensor/ops/shape.hpp ----
// Shape ops, all lazy.
//  - Views (reshape/view, flatten, squeeze, unsqueeze) are nodes whose kernel shares the
//    input's buffer: the data is never copied, and a view of a pending value is pending.
//  - Copies (transpose/permute, narrow/slice, cat/stack, index_select, gather) move bytes:
//    one kernel per element *size* (1, 2, 4, 8 bytes) serves every dtype, which keeps the
//    code small; the element copy is a constant-size memcpy, which compiles to one load and
//    one store and is valid whatever type wrote the buffer (no strict-aliasing games).
//  - expand is a broadcasting element-wise node (the element-wise layout already knows how
//    to splat a size-1 dim), and one_hot writes int64 rows.
// Index values (index_select, gather, one_hot) live in tensors that may still be pending, so
// they are checked where they are read: inside the kernel, which throws lazy::IndexError out
// of the mark_step or read that ran it.

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <memory>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>


namespace lazy {

/// Element types accepted for index tensors (index_select, gather, one_hot).
template <class I>
concept IndexElement = std::is_same_v<I, std::int32_t> || std::is_same_v<I, std::int64_t>;

namespace graph {

namespace copy_kernels {

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
  void seek(std::int64_t lin) {
    a = b = 0;
    for (int d = rank - 1; d >= 0; --d) {
      idx[d] = lin % size[d];
      lin /= size[d];
      a += idx[d] * stride_a[d];
      b += idx[d] * stride_b[d];
    }
  }
  /// Advances by one position (carry from the last dim).
  void next() {
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

}  // namespace copy_kernels

/// A view: same bytes, another shape. Its kernel only shares the input's buffer, so it
/// costs nothing and the donation rule (buffer use_count == 1) keeps shared data safe.
class ViewNode final : public Node {
 public:
  ViewNode(std::string op, NodePtr in, Shape shape)
      : Node(NodeKind::View, in->dtype(), shape, in->device(), {in}), op_(std::move(op)) {}

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

  static Shape permuted_shape(const Shape& in, const std::vector<int>& perm) {
    Shape out;
    for (int p : perm) out.push_back(in[p]);
    return out;
  }

  static Plan make_plan(const Shape& in, const std::vector<int>& perm) {
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

  PermuteNode(NodePtr in, std::vector<int> perm, std::string op)
      : Node(NodeKind::Copy, in->dtype(), permuted_shape(in->shape(), perm), in->device(), {in}),
        perm_(std::move(perm)), op_(std::move(op)), plan_(make_plan(in->shape(), perm_)) {}

  /// out dim i reads input dim perm()[i].
  const std::vector<int>& perm() const { return perm_; }
  /// True when the permutation swaps the last two dims and keeps the others: a matmul can
  /// then read the input with a transposed layout instead of waiting for this copy.
  bool swaps_last_two() const {
    const int r = static_cast<int>(perm_.size());
    if (r < 2 || perm_[r - 2] != r - 1 || perm_[r - 1] != r - 2) return false;
    for (int i = 0; i + 2 < r; ++i)
      if (perm_[i] != i) return false;
    return true;
  }

  std::string op_name() const override { return op_; }
  std::string describe() const override {
    std::string s = op_ + "(%0, dims=[";
    for (std::size_t i = 0; i < perm_.size(); ++i) s += (i ? ", " : "") + std::to_string(perm_[i]);
    return s + "])";
  }
  std::uint64_t structural_hash() const override {
    std::uint64_t h = Node::structural_hash();
    for (int p : perm_) h = hash_combine(h, static_cast<std::uint64_t>(p));
    return h;
  }

 protected:
  void compute(ExecContext& ctx) override {
    const std::byte* src = copy_kernels::bytes_of(inputs()[0]);
    auto buf = allocate_output(ctx, false);  // reads elsewhere than it writes
    auto* dst = static_cast<std::byte*>(buf->data());
    const std::int64_t n = numel();
    if (n > 0) {
      copy_kernels::with_elem_size(dtype_size(dtype()), [&](auto nb) { run<decltype(nb)::value>(ctx, dst, src, n); });
    }
    set_buffer(std::move(buf));
  }

 private:
  static constexpr std::int64_t kTile = 32;

  template <std::size_t N>
  void run(ExecContext& ctx, std::byte* dst, const std::byte* src, std::int64_t n) const {
    using copy_kernels::Odometer;
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
            for (std::int64_t j = 0; j < jn; ++j) copy_kernels::copy_elem<N>(out + j * N, tile + (j * kTile + i) * N);
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
  explicit TransposeNode(NodePtr in) : PermuteNode(in, last_two(in->shape().rank()), "transpose") {}

  /// The node whose last two dims this value swaps (null once this node has run: a
  /// computed node keeps no inputs).
  const NodePtr& transpose_source() const override { return inputs().empty() ? none_ : inputs()[0]; }

  /// The identity permutation with the last two entries swapped.
  static std::vector<int> last_two(int rank) {
    std::vector<int> p(static_cast<std::size_t>(rank));
    for (int i = 0; i < rank; ++i) p[i] = i;
    if (rank >= 2) std::swap(p[rank - 2], p[rank - 1]);
    return p;
  }

 private:
  NodePtr none_;
};

/// Copies a strided range of one dim: out[.., k, ..] = in[.., start + k * step, ..].
class SliceNode final : public Node {
 public:
  SliceNode(std::string op, NodePtr in, int dim, std::int64_t start, std::int64_t step, Shape out)
      : Node(NodeKind::Copy, in->dtype(), out, in->device(), {in}), op_(std::move(op)), dim_(dim), start_(start),
        step_(step) {}

  std::string op_name() const override { return op_; }
  std::string describe() const override {
    return op_ + "(%0, dim=" + std::to_string(dim_) + ", start=" + std::to_string(start_) +
           ", step=" + std::to_string(step_) + ")";
  }
  // The offsets are part of the kernel's layout, not data: they belong in the hash.
  std::uint64_t structural_hash() const override {
    return hash_combine(hash_combine(hash_combine(Node::structural_hash(), static_cast<std::uint64_t>(dim_)),
                                     static_cast<std::uint64_t>(start_)),
                        static_cast<std::uint64_t>(step_));
  }

 protected:
  void compute(ExecContext& ctx) override {
    const Shape& is = inputs()[0]->shape();
    const std::byte* src = copy_kernels::bytes_of(inputs()[0]);
    auto buf = allocate_output(ctx, false);
    auto* dst = static_cast<std::byte*>(buf->data());
    std::int64_t outer = 1, inner = 1;
    for (int d = 0; d < dim_; ++d) outer *= is[d];
    for (int d = dim_ + 1; d < is.rank(); ++d) inner *= is[d];
    const std::int64_t dsize = is[dim_], len = shape()[dim_];
    const std::int64_t start = start_, step = step_;
    copy_kernels::with_elem_size(dtype_size(dtype()), [&](auto nb) {
      constexpr std::size_t N = decltype(nb)::value;
      if (step == 1) {  // one contiguous run per outer index
        copy_kernels::copy_segments<N>(ctx.device.threads(), dst, src, outer, len * inner,
                                       [&](std::int64_t o) { return (o * dsize + start) * inner; });
      } else {
        copy_kernels::copy_segments<N>(ctx.device.threads(), dst, src, outer * len, inner, [&](std::int64_t s) {
          return ((s / len) * dsize + start + (s % len) * step) * inner;
        });
      }
    });
    set_buffer(std::move(buf));
  }

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
          std::vector<std::int64_t> widths)
      : Node(NodeKind::Copy, dtype, out, dev, std::move(ins)), op_(std::move(op)), outer_(outer),
        widths_(std::move(widths)) {}

  std::string op_name() const override { return op_; }
  std::uint64_t structural_hash() const override {
    std::uint64_t h = hash_combine(Node::structural_hash(), static_cast<std::uint64_t>(outer_));
    for (auto w : widths_) h = hash_combine(h, static_cast<std::uint64_t>(w));
    return h;
  }

 protected:
  void compute(ExecContext& ctx) override {
    const std::size_t k = inputs().size();
    std::vector<const std::byte*> srcs(k);
    for (std::size_t i = 0; i < k; ++i) srcs[i] = copy_kernels::bytes_of(inputs()[i]);
    auto buf = allocate_output(ctx, false);
    auto* dst = static_cast<std::byte*>(buf->data());
    std::vector<std::int64_t> pre(k + 1, 0);  // start of each input inside an output row
    for (std::size_t i = 0; i < k; ++i) pre[i + 1] = pre[i] + widths_[i];
    const std::int64_t W = pre[k], n = outer_ * W;
    auto& pool = ctx.device.threads();
    if (n > 0) {
      copy_kernels::with_elem_size(dtype_size(dtype()), [&](auto nb) {
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
    const std::byte* src = copy_kernels::bytes_of(inputs()[0]);
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
    copy_kernels::with_elem_size(dtype_size(dtype()), [&](auto nb) {
      constexpr std::size_t N = decltype(nb)::value;
      copy_kernels::copy_segments<N>(ctx.device.threads(), dst, src, outer * K, inner, [&](std::int64_t s) {
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
    const std::byte* src = copy_kernels::bytes_of(inputs()[0]);
    const I* idx = inputs()[1]->template data<I>();
    auto buf = allocate_output(ctx, false);
    auto* dst = static_cast<std::byte*>(buf->data());
    const int R = xs.rank(), dim = dim_;
    const std::int64_t n = numel(), last = xs[R - 1], dsize = ts[dim];
    if (n > 0) {
      const auto tst = contiguous_strides(ts), xst = contiguous_strides(xs);
      copy_kernels::Odometer od;  // a: input offset without `dim`; b: index offset
      od.rank = R - 1;
      for (int d = 0; d + 1 < R; ++d) {
        od.size[d] = xs[d];
        od.stride_a[d] = d == dim ? 0 : tst[d];
        od.stride_b[d] = xst[d];
      }
      const std::int64_t dstride = tst[dim], rows = n / last;
      auto& pool = ctx.device.threads();
      const std::int64_t tasks = std::min(rows, task_count(pool, n, 2.0));
      copy_kernels::with_elem_size(dtype_size(dtype()), [&](auto nb) {
        constexpr std::size_t N = decltype(nb)::value;
        pool.parallel_for(tasks, [&](std::int64_t t) {
          auto [r0, r1] = task_range(rows, tasks, t);
          copy_kernels::Odometer o = od;
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
              copy_kernels::copy_elem<N>(dst + (o.b + j) * N, src + at * N);
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

}  // namespace graph

namespace detail::shape_ops {

/// An operand as a tensor: a Tensor as is (the handle is copied), an expression evaluated
/// into a pending node.
template <expr::ExprLike X>
auto as_tensor(const X& x) {
  using T = expr::value_t<X>;
  if constexpr (std::is_same_v<X, Tensor<T>>) return x;
  else if constexpr (expr::is_expr_node<X>::value) return Tensor<T>(x);
  else return Tensor<T>(x.to_leaf().node);
}

inline std::string list_str(std::span<const std::int64_t> v) {
  std::string s = "[";
  for (std::size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s + "]";
}
inline std::string list_str(const Shape& s) { return list_str(std::span<const std::int64_t>(s.begin(), s.end())); }
inline std::span<const std::int64_t> span_of(const Shape& s) { return {s.begin(), static_cast<std::size_t>(s.rank())}; }

/// A view of t with `shape` (same numel), or t's own node when the shape does not change.
/// A view of a pending view is made a view of that view's source, so chains stay short.
template <Element T>
Tensor<T> view_of(const Tensor<T>& t, const Shape& shape, const char* op) {
  graph::NodePtr src = t.node();
  if (src->shape() == shape) return Tensor<T>(src);
  if (!src->materialized() && dynamic_cast<graph::ViewNode*>(src.get())) src = src->inputs()[0];
  return Tensor<T>(graph::submit(std::make_shared<graph::ViewNode>(op, std::move(src), shape)));
}

/// Resolves a size list with at most one -1 against `numel` (torch's infer_size).
inline Shape infer_shape(std::span<const std::int64_t> sizes, std::int64_t numel, const char* op) {
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
    } else {
      known *= sizes[i];
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
  if (identity) return Tensor<T>(n);
  if (graph::PermuteNode::make_plan(n->shape(), perm).keeps_order()) {
    return view_of(t, graph::PermuteNode::permuted_shape(n->shape(), perm), op);
  }
  if (perm == graph::TransposeNode::last_two(static_cast<int>(perm.size()))) {
    return Tensor<T>(graph::submit(std::make_shared<graph::TransposeNode>(n)));
  }
  return Tensor<T>(graph::submit(std::make_shared<graph::PermuteNode>(n, std::move(perm), op)));
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
  if (out == s) return Tensor<T>(t.node());
  // The element-wise node broadcasts its leaves to `out`: a splat per expanded dim.
  return Tensor<T>(graph::make_elementwise<T>(expr::make<ops::Identity>(t), out));
}

template <Element T>
std::vector<graph::NodePtr> nodes_of(const std::vector<Tensor<T>>& ts) {
  std::vector<graph::NodePtr> v;
  v.reserve(ts.size());
  for (const auto& t : ts) v.push_back(t.node());
  return v;
}

}  // namespace detail::shape_ops

// ---- views ------------------------------------------------------------------------------

/// A view of `x` with shape `sizes` (one entry may be -1: inferred). Shares x's buffer;
/// ShapeError if the element count differs. An expression is evaluated first.
template <expr::ExprLike X>
auto reshape(const X& x, std::initializer_list<std::int64_t> sizes) {
  return detail::shape_ops::reshape_impl(x, {sizes.begin(), sizes.size()}, "reshape");
}
/// reshape with the sizes in a vector.
template <expr::ExprLike X>
auto reshape(const X& x, const std::vector<std::int64_t>& sizes) {
  return detail::shape_ops::reshape_impl(x, sizes, "reshape");
}
/// reshape to a Shape.
template <expr::ExprLike X>
auto reshape(const X& x, const Shape& shape) {
  return detail::shape_ops::reshape_impl(x, detail::shape_ops::span_of(shape), "reshape");
}

/// Same as reshape (tensors are always contiguous here, so view never fails where reshape
/// would copy).
template <expr::ExprLike X>
auto view(const X& x, std::initializer_list<std::int64_t> sizes) {
  return detail::shape_ops::reshape_impl(x, {sizes.begin(), sizes.size()}, "view");
}
/// view with the sizes in a vector.
template <expr::ExprLike X>
auto view(const X& x, const std::vector<std::int64_t>& sizes) {
  return detail::shape_ops::reshape_impl(x, sizes, "view");
}
/// view as a Shape.
template <expr::ExprLike X>
auto view(const X& x, const Shape& shape) {
  return detail::shape_ops::reshape_impl(x, detail::shape_ops::span_of(shape), "view");
}

/// Merges dims start_dim..end_dim (inclusive, negative counts from the back) into one, as a
/// view. A 0-d tensor becomes 1-D with one element, as in torch.
template <expr::ExprLike X>
auto flatten(const X& x, std::int64_t start_dim = 0, std::int64_t end_dim = -1) {
  auto t = detail::shape_ops::as_tensor(x);
  const Shape& s = t.shape();
  const int a = normalize_dim(start_dim, s.rank(), "flatten"), b = normalize_dim(end_dim, s.rank(), "flatten");
  if (a > b) {
    throw ShapeError("flatten: start_dim (" + std::to_string(start_dim) + ", i.e. " + std::to_string(a) +
                     ") cannot come after end_dim (" + std::to_string(end_dim) + ", i.e. " + std::to_string(b) + ")");
  }
  if (s.rank() == 0) return detail::shape_ops::view_of(t, Shape{1}, "flatten");
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
  return detail::shape_ops::view_of(t, out, "flatten");
}

/// Removes every dim of size 1 (a view).
template <expr::ExprLike X>
auto squeeze(const X& x) {
  auto t = detail::shape_ops::as_tensor(x);
  Shape out;
  for (auto d : t.shape())
    if (d != 1) out.push_back(d);
  return detail::shape_ops::view_of(t, out, "squeeze");
}

/// Removes dim `dim` if its size is 1; otherwise returns x unchanged, as torch does.
template <expr::ExprLike X>
auto squeeze(const X& x, std::int64_t dim) {
  auto t = detail::shape_ops::as_tensor(x);
  const Shape& s = t.shape();
  const int d = normalize_dim(dim, s.rank(), "squeeze");
  if (s.rank() == 0 || s[d] != 1) return t;
  Shape out;
  for (int i = 0; i < s.rank(); ++i)
    if (i != d) out.push_back(s[i]);
  return detail::shape_ops::view_of(t, out, "squeeze");
}

/// Inserts a dim of size 1 at position `dim` (in [-rank-1, rank]), as a view.
template <expr::ExprLike X>
auto unsqueeze(const X& x, std::int64_t dim) {
  auto t = detail::shape_ops::as_tensor(x);
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
  return detail::shape_ops::view_of(t, out, "unsqueeze");
}

// ---- permutations -------------------------------------------------------------------------

/// Reorders the dims: out dim i is x's dim dims[i] (a permutation of 0..rank-1; negative
/// entries count from the back). A copy, unless only size-1 dims move (then a view).
template <expr::ExprLike X>
auto permute(const X& x, const std::vector<std::int64_t>& dims) {
  auto t = detail::shape_ops::as_tensor(x);
  const int r = t.dim();
  if (static_cast<int>(dims.size()) != r) {
    throw ShapeError("permute: number of dims don't match: the tensor has " + std::to_string(r) +
                     " dims (shape " + t.shape().str() + "), the permutation " +
                     detail::shape_ops::list_str(dims) + " has " + std::to_string(dims.size()));
  }
  std::vector<int> perm;
  std::vector<char> seen(static_cast<std::size_t>(r), 0);
  for (auto d : dims) {
    const int n = normalize_dim(d, r, "permute");
    if (seen[n]) {
      throw ShapeError("permute: repeated dim " + std::to_string(n) + " in the permutation " +
                       detail::shape_ops::list_str(dims) + " (expected each of 0.." + std::to_string(r - 1) +
                       " exactly once)");
    }
    seen[n] = 1;
    perm.push_back(n);
  }
  return detail::shape_ops::permute_impl(t, std::move(perm), "permute");
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
  auto t = detail::shape_ops::as_tensor(x);
  const int r = t.dim();
  const int a = normalize_dim(d0, r, "transpose"), b = normalize_dim(d1, r, "transpose");
  if (a == b || r == 0) return Tensor<typename decltype(t)::value_type>(t.node());
  std::vector<int> perm(static_cast<std::size_t>(r));
  for (int i = 0; i < r; ++i) perm[i] = i;
  std::swap(perm[a], perm[b]);
  return detail::shape_ops::permute_impl(t, std::move(perm), "transpose");
}

/// torch's t(): the transpose of a 2-D tensor; 0-D and 1-D tensors are returned as is.
/// ShapeError for rank > 2.
template <expr::ExprLike X>
auto transpose(const X& x) {
  auto t = detail::shape_ops::as_tensor(x);
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
  return detail::shape_ops::expand_impl(x, {sizes.begin(), sizes.size()});
}
/// expand with the sizes in a vector.
template <expr::ExprLike X>
auto expand(const X& x, const std::vector<std::int64_t>& sizes) {
  return detail::shape_ops::expand_impl(x, sizes);
}
/// expand to a Shape.
template <expr::ExprLike X>
auto expand(const X& x, const Shape& shape) {
  return detail::shape_ops::expand_impl(x, detail::shape_ops::span_of(shape));
}

// ---- slicing ------------------------------------------------------------------------------

/// Elements start, start + step, ... below end along `dim` (torch slicing x[start:end:step]):
/// negative start/end count from the back, both are clamped to [0, size]; step must be > 0.
/// A copy (buffers never start at an offset), except a full-range slice which is x itself.
template <expr::ExprLike X>
auto slice(const X& x, std::int64_t dim, std::int64_t start = 0,
           std::int64_t end = std::numeric_limits<std::int64_t>::max(), std::int64_t step = 1) {
  auto t = detail::shape_ops::as_tensor(x);
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
  if (start == 0 && len == size && (step == 1 || size <= 1)) return Tensor<T>(t.node());
  Shape out = s;
  out[d] = len;
  return Tensor<T>(graph::submit(std::make_shared<graph::SliceNode>("slice", t.node(), d, start, step, out)));
}

/// `length` elements from `start` along `dim` (torch.narrow). start may be negative
/// (counting from the back); ShapeError if the range does not fit.
template <expr::ExprLike X>
auto narrow(const X& x, std::int64_t dim, std::int64_t start, std::int64_t length) {
  auto t = detail::shape_ops::as_tensor(x);
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
  if (start == 0 && length == size) return Tensor<T>(t.node());
  Shape out = s;
  out[d] = length;
  return Tensor<T>(graph::submit(std::make_shared<graph::SliceNode>("narrow", t.node(), d, start, 1, out)));
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
  if (ts.empty()) return Tensor<T>(tensors.front().node());
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
  auto nodes = detail::shape_ops::nodes_of(ts);
  graph::Device& dev = graph::common_device(nodes, "cat");
  if (ts.size() == 1) return Tensor<T>(nodes.front());
  std::int64_t outer = 1, inner = 1, total = 0;
  for (int k = 0; k < d; ++k) outer *= ref[k];
  for (int k = d + 1; k < r; ++k) inner *= ref[k];
  std::vector<std::int64_t> widths;
  for (const auto& t : ts) {
    widths.push_back(t.shape()[d] * inner);
    total += t.shape()[d];
  }
  Shape out = ref;
  out[d] = total;
  return Tensor<T>(graph::submit(
      std::make_shared<graph::CatNode>("cat", dtype_of<T>(), std::move(nodes), out, &dev, outer, std::move(widths))));
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
  auto nodes = detail::shape_ops::nodes_of(tensors);
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
  return Tensor<T>(graph::submit(
      std::make_shared<graph::CatNode>("stack", dtype_of<T>(), std::move(nodes), out, &dev, outer, std::move(widths))));
}
/// stack with a braced list: stack({a, b}, 0).
template <Element T>
Tensor<T> stack(std::initializer_list<Tensor<T>> tensors, std::int64_t dim = 0) {
  return stack(std::vector<Tensor<T>>(tensors), dim);
}

// ---- indexing ---------------------------------------------------------------------------

/// The slices of x at positions `index` (1-D, int32 or int64) along `dim`
/// (torch.index_select). Index values outside [0, size) raise IndexError when the kernel
/// runs (at the next mark_step or read), since the index may still be pending here.
template <expr::ExprLike X, IndexElement I>
auto index_select(const X& x, std::int64_t dim, const Tensor<I>& index) {
  auto t = detail::shape_ops::as_tensor(x);
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
  }
  graph::common_device({t.node(), index.node()}, "index_select");
  return Tensor<T>(graph::submit(std::make_shared<graph::IndexSelectNode<I>>(t.node(), index.node(), d, out)));
}

/// torch.gather: out[i][j][k] = x[index[i][j][k]][j][k] for dim 0 (likewise for the other
/// dims). index has x's rank and index.size(d) <= x.size(d) for d != dim (ShapeError); the
/// result has index's shape. Out-of-range values raise IndexError when the kernel runs.
template <expr::ExprLike X, IndexElement I>
auto gather(const X& x, std::int64_t dim, const Tensor<I>& index) {
  auto t = detail::shape_ops::as_tensor(x);
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
  return Tensor<T>(graph::submit(std::make_shared<graph::GatherNode<I>>(t.node(), index.node(), d)));
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
// ---- end lazytensor/ops/shape.hpp ----

namespace lazy {

namespace graph {

/// C[b] = op(A[b]) * op(B[b]) for a batch of row-major matrices; op is identity or
/// transpose. A batch count of 1 on either side broadcasts.
template <Element T>
class GemmNode final : public Node, public RowProducer {
 public:
  struct Operand {
    NodePtr node;
    bool transposed;  ///< the node holds [.., cols, rows] and is read transposed
  };

  GemmNode(Operand a, Operand b, std::int64_t batch_a, std::int64_t batch_b, std::int64_t m, std::int64_t k,
           std::int64_t n, Shape out_shape, Device* device)
      : Node(NodeKind::Gemm, dtype_of<T>(), out_shape, device, {a.node, b.node}), ta_(a.transposed),
        tb_(b.transposed), batch_a_(batch_a), batch_b_(batch_b), m_(m), k_(k), n_(n) {}

  std::string op_name() const override { return "matmul"; }
  std::string describe() const override {
    return std::string("matmul(%0") + (ta_ ? "^T" : "") + ", %1" + (tb_ ? "^T" : "") + ") [" + std::to_string(m_) +
           "x" + std::to_string(k_) + "] x [" + std::to_string(k_) + "x" + std::to_string(n_) + "]";
  }
  double cost_per_element() const override { return 2.0 * static_cast<double>(k_); }
  std::uint64_t structural_hash() const override {
    return hash_combine(Node::structural_hash(), (ta_ ? 1u : 0u) | (tb_ ? 2u : 0u));
  }

  void produce_rows(void* out, std::int64_t r0, std::int64_t r1) override {
    T* c = static_cast<T*>(out);
    const T* a = inputs()[0]->template data<T>();
    const T* b = inputs()[1]->template data<T>();
    // Rows of the output run over (batch, m); a range may span several batches.
    while (r0 < r1) {
      const std::int64_t bi = r0 / m_, row = r0 % m_;
      const std::int64_t rows = std::min(r1 - r0, m_ - row);
      gemm_block(a + (batch_a_ == 1 ? 0 : bi) * m_ * k_, b + (batch_b_ == 1 ? 0 : bi) * k_ * n_,
                 c + r0 * n_, row, rows);
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
    const std::int64_t tasks = std::min<std::int64_t>(task_count(pool, rows * n_, cost_per_element()), (rows + 7) / 8);
    void* out = buf->data();
    pool.parallel_for(std::max<std::int64_t>(tasks, 1), [&](std::int64_t t) {
      auto [r0, r1] = task_range(rows, std::max<std::int64_t>(tasks, 1), t);
      produce_rows(out, r0, r1);
    });
    set_buffer(std::move(buf));
  }

 private:
  using Mat = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  using CMap = Eigen::Map<const Mat>;

  // Rows [row, row + rows) of op(A) * op(B) for one batch, into c (already offset).
  void gemm_block(const T* a, const T* b, T* c, std::int64_t row, std::int64_t rows) const {
    Eigen::Map<Mat> C(c, rows, n_);
    if (k_ == 0) {
      C.setZero();
      return;
    }
    auto run = [&](const auto& A) {
      if (tb_) C.noalias() = A * CMap(b, n_, k_).transpose();
      else C.noalias() = A * CMap(b, k_, n_);
    };
    if (ta_) run(CMap(a, k_, m_).middleCols(row, rows).transpose());
    else run(CMap(a, m_, k_).middleRows(row, rows));
  }

  bool ta_, tb_;
  std::int64_t batch_a_, batch_b_, m_, k_, n_;
};

}  // namespace graph

namespace detail {

/// The operand as a GEMM reads it: through a pending transpose when there is one.
template <Element T>
typename graph::GemmNode<T>::Operand gemm_operand(const Tensor<T>& t) {
  const auto& n = t.node();
  if (!n->materialized()) {
    // Only a 2-D source: batched GEMMs may stack batch rows, which a transposed read breaks.
    if (auto* tr = dynamic_cast<graph::TransposeOfLastTwo*>(n.get()); tr && tr->transpose_source()->shape().rank() == 2)
      return {tr->transpose_source(), true};
  }
  return {n, false};
}

template <Element T>
Tensor<T> gemm(const Tensor<T>& a, const Tensor<T>& b, std::int64_t batch_a, std::int64_t batch_b,
               std::int64_t m, std::int64_t k, std::int64_t n, const Shape& out) {
  auto oa = gemm_operand(a), ob = gemm_operand(b);
  graph::Device& dev = graph::common_device({oa.node, ob.node}, "matmul");
  return Tensor<T>(graph::submit(std::make_shared<graph::GemmNode<T>>(oa, ob, batch_a, batch_b, m, k, n, out, &dev)));
}

[[noreturn]] inline void matmul_mismatch(const Shape& a, const Shape& b, std::int64_t ka, std::int64_t kb) {
  throw ShapeError("matmul: mat1 and mat2 shapes cannot be multiplied (" + a.str() + " and " + b.str() +
                   "): expected the contracted sizes to match, found " + std::to_string(ka) + " and " +
                   std::to_string(kb));
}

}  // namespace detail

/// Matrix product with torch.matmul's rules: 1-D x 1-D is a dot product, 2-D x 2-D a matrix
/// product, 1-D operands gain and lose a dimension, and leading (batch) dims broadcast.
template <Element T>
Tensor<T> matmul(const Tensor<T>& a, const Tensor<T>& b) {
  if constexpr (!std::is_same_v<T, float> && !std::is_same_v<T, double> && !std::is_same_v<T, std::int32_t> &&
                !std::is_same_v<T, std::int64_t>) {
    throw DTypeError("matmul: expected float, double, int32 or int64 operands, got " + dtype_name(dtype_of<T>()));
  } else {
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
  return matmul(x, transpose(w, 0, 1));
}

/// x @ w^T + b. Returns an expression (as `a + b` does), so a following element-wise op
/// such as relu joins the bias in one epilogue that runs on the GEMM's row blocks.
template <Element T>
auto linear(const Tensor<T>& x, const Tensor<T>& w, const Tensor<T>& b) {
  if (b.dim() != 1 || b.size(0) != w.size(0)) {
    throw ShapeError("linear: expected bias of shape (" + std::to_string(w.size(0)) + ",), got " + b.shape().str());
  }
  return linear(x, w) + b;
}

}  // namespace lazy
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
// values are computed lazily, at mark_step, by a RandomNode, always a whole block at a time
// (block k holds the call's elements k * B * P ..), so a vectorized distribution gives
// every element the same bits whichever task computes it. set_rng_state / manual_seed restart the
// stream; mark_step advances the seed.

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
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

namespace random_dist {

// A distribution turns the 4 * kBlock words of one block of counters into P * kBlock
// elements (P = per_counter). fill(words, j0, cnt, out, i) writes elements [j0, j0 + cnt)
// of the block to out[0..cnt); `i` is the global index of out[0] (for distributions that
// read an input element-wise). A distribution that vectorizes computes the whole block
// and keeps the part asked for, so no element's bits depend on where a task starts.

/// Counters per block.
inline constexpr int kBlock = 16;

/// Uniform 24-bit float in [0, 1): exact, never 1.
inline float unit_float(std::uint32_t x) { return static_cast<float>(x >> 8) * 0x1p-24f; }
inline std::uint64_t word64(std::uint32_t hi, std::uint32_t lo) { return (std::uint64_t{hi} << 32) | lo; }
/// Uniform 53-bit double in [0, 1).
inline double unit_double(std::uint32_t hi, std::uint32_t lo) {
  return static_cast<double>(word64(hi, lo) >> 11) * 0x1p-53;
}

/// torch.rand: uniform in [0, 1).
template <Element T>
struct Uniform {
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
struct Normal {
  static constexpr const char* name = "randn";
  static constexpr int per_counter = std::is_same_v<T, double> ? 2 : 4;
  static constexpr double cost = 6;
  std::string params() const { return ""; }
  void bind(const std::vector<NodePtr>&) {}
  void fill(const std::uint32_t* w, int j0, int cnt, T* out, std::int64_t) const {
    using S = std::conditional_t<std::is_same_v<T, double>, double, float>;
    using V = xsimd::batch<S>;
    constexpr int kPairs = kBlock * per_counter / 2;
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
struct RandInt {
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
struct Bernoulli {
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
struct BernoulliTensor {
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

}  // namespace random_dist

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
    constexpr std::int64_t E = std::int64_t{random_dist::kBlock} * D::per_counter;  // elements per block
    const auto key = ops::philox_key(seed_);
    auto& pool = ctx.device.threads();
    const std::int64_t tasks = task_count(pool, n, D::cost);
    pool.parallel_for(tasks, [&](std::int64_t t) {
      // Tasks start on block boundaries (no block computed twice), but the values depend
      // only on the element index either way.
      auto [b, e] = task_range(n, tasks, t, E);
      std::uint32_t words[4 * random_dist::kBlock];
      for (std::int64_t i = b; i < e;) {
        const std::int64_t blk = i / E;
        const std::uint64_t c0 = offset_ + static_cast<std::uint64_t>(blk) * random_dist::kBlock;
        for (int c = 0; c < random_dist::kBlock; ++c) {
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

namespace detail::random_ops {

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

}  // namespace detail::random_ops

/// Seeds the current device's random stream; alias of set_rng_state (torch.manual_seed).
inline void manual_seed(std::uint64_t seed) { set_rng_state(seed); }

/// Uniform values in [0, 1) (torch.rand). T: float, double or bfloat16. Lazy: drawn when
/// the tensor is materialized, identical whatever the thread count.
template <Element T>
  requires is_floating_v<T>
Tensor<T> rand(const Shape& shape, Device dev = device()) {
  return detail::random_ops::make_random<T>(graph::random_dist::Uniform<T>{}, shape, dev);
}

/// Standard normal values (torch.randn). T: float, double or bfloat16.
template <Element T>
  requires is_floating_v<T>
Tensor<T> randn(const Shape& shape, Device dev = device()) {
  return detail::random_ops::make_random<T>(graph::random_dist::Normal<T>{}, shape, dev);
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
    constexpr std::int64_t lim = detail::random_ops::exact_integer_limit<T>();
    if (low < -lim || high > lim) {
      throw Error("randint: range [" + std::to_string(low) + ", " + std::to_string(high) + ") is not exactly " +
                  "representable in " + dtype_name(dtype_of<T>()) + " (expected bounds within +-" +
                  std::to_string(lim) + ")");
    }
  }
  const std::uint64_t range = static_cast<std::uint64_t>(high) - static_cast<std::uint64_t>(low);
  return detail::random_ops::make_random<T>(graph::random_dist::RandInt<T>{low, range}, shape, dev);
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
  return detail::random_ops::make_random<T>(graph::random_dist::Bernoulli<T>{p}, shape, dev);
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
  return detail::random_ops::make_random<T>(graph::random_dist::BernoulliTensor<T>{}, p.shape(), p.device(),
                                            {p.node()});
}

}  // namespace lazy
// ---- end lazytensor/ops/random.hpp ----
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

// ---- begin lazytensor/ops/reduce_ops.hpp ----
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
// ---- end lazytensor/ops/reduce_ops.hpp ----

namespace lazy::graph {

/// Leaf size of the pairwise reduction tree.
inline constexpr std::int64_t kReduceBlock = 4096;

/// How a child of shape `in` is reduced: [outer, R, inner].
struct ReduceGeometry {
  std::int64_t outer = 1, extent = 1, inner = 1;
};

namespace detail {

template <class R, class S, bool C, class K>
S reduce_span(const expr::Eval<S, K>& ev, std::int64_t b, std::int64_t len) {
  const std::int64_t e = b + len;
  std::int64_t i = b;
  if constexpr (expr::simd_lane_v<S>) {
    using V = expr::batch_t<S>;
    constexpr std::int64_t W = V::size;
    V a0 = R::template identity<V>(), a1 = a0, a2 = a0, a3 = a0;
    for (; i + 4 * W <= e; i += 4 * W) {
      a0 = R::combine(a0, ev.template packet<C>(i));
      a1 = R::combine(a1, ev.template packet<C>(i + W));
      a2 = R::combine(a2, ev.template packet<C>(i + 2 * W));
      a3 = R::combine(a3, ev.template packet<C>(i + 3 * W));
    }
    for (; i + W <= e; i += W) a0 = R::combine(a0, ev.template packet<C>(i));
    S r = R::template horizontal<S>(R::combine(R::combine(a0, a1), R::combine(a2, a3)));
    for (; i < e; ++i) r = R::combine(r, ev.coeff(i));
    return r;
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

/// Combines partial results pairwise, in a fixed shape.
template <class R, class S>
S pairwise(std::vector<S>& v) {
  if (v.empty()) return R::template identity<S>();
  while (v.size() > 1) {
    std::size_t j = 0;
    for (std::size_t i = 0; i + 1 < v.size(); i += 2) v[j++] = R::combine(v[i], v[i + 1]);
    if (v.size() % 2) v[j++] = v.back();
    v.resize(j);
  }
  return v[0];
}

template <class R, class S, bool C, class K>
S reduce_range(const expr::Eval<S, K>& ev, std::int64_t b, std::int64_t len) {
  if (len <= kReduceBlock) return reduce_span<R, S, C>(ev, b, len);
  std::vector<S> partial;
  partial.reserve(static_cast<std::size_t>((len + kReduceBlock - 1) / kReduceBlock));
  for (std::int64_t o = 0; o < len; o += kReduceBlock) {
    partial.push_back(reduce_span<R, S, C>(ev, b + o, std::min(kReduceBlock, len - o)));
  }
  return pairwise<R>(partial);
}

}  // namespace detail

/// Reduces kernel-form expression K (with lane S) by R into Tout, scaling by `scale`.
template <class K, class R, class S, Element Tout>
class ReductionNode final : public Node {
 public:
  ReductionNode(K kernel, Shape out_shape, ReduceGeometry g, double scale, Device* device,
                std::vector<NodePtr> inputs, Shape child_shape)
      : Node(NodeKind::Reduction, dtype_of<Tout>(), out_shape, device, std::move(inputs)),
        kernel_(std::move(kernel)), g_(g), scale_(scale), child_shape_(child_shape) {
    const std::int64_t n = child_shape.numel();
    for (const auto& in : this->inputs()) splat_.push_back(in->numel() == 1 && n != 1 ? 1 : 0);
  }

  std::string op_name() const override { return R::name; }
  std::string describe() const override {
    return std::string(R::name) + "(" + expr::kernel_text(kernel_) + ") over [" + std::to_string(g_.outer) +
           ", " + std::to_string(g_.extent) + ", " + std::to_string(g_.inner) + "]";
  }
  double cost_per_element() const override { return expr::kernel_cost<K>() + 1; }
  std::uint64_t structural_hash() const override {
    std::uint64_t h = hash_combine(Node::structural_hash(), typeid(K).hash_code());
    h = hash_combine(h, hash_shape(child_shape_));
    return hash_combine(h, static_cast<std::uint64_t>(g_.extent));
  }

 protected:
  void compute(ExecContext& ctx) override {
    const auto& ins = inputs();
    std::vector<const void*> ptrs(ins.size());
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
  void run(ExecContext& ctx, const std::vector<const void*>& ptrs, Tout* out) {
    auto& pool = ctx.device.threads();
    const double cost = cost_per_element();
    const std::int64_t outer = g_.outer, R_ = g_.extent, inner = g_.inner;
    const std::int64_t total = outer * R_ * inner;
    auto eval = [&] { return expr::Eval<S, K>(kernel_, ptrs.data(), splat_.data()); };
    if (inner == 1 && outer == 1) {
      // One value: blocks in parallel, then the fixed pairwise tree.
      const std::int64_t blocks = (R_ + kReduceBlock - 1) / kReduceBlock;
      std::vector<S> partial(static_cast<std::size_t>(blocks));
      const std::int64_t tasks = std::min(blocks, task_count(pool, total, cost));
      pool.parallel_for(tasks, [&](std::int64_t t) {
        auto ev = eval();
        auto [b0, b1] = task_range(blocks, tasks, t);
        for (std::int64_t b = b0; b < b1; ++b) {
          const std::int64_t s = b * kReduceBlock;
          partial[b] = detail::reduce_span<R, S, C>(ev, s, std::min(kReduceBlock, R_ - s));
        }
      });
      out[0] = finish_value(detail::pairwise<R>(partial));
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
  void reduce_columns(const expr::Eval<S, K>& ev, Tout* out, std::int64_t base, std::int64_t c0, std::int64_t c1) {
    const std::int64_t R_ = g_.extent, inner = g_.inner;
    std::int64_t c = c0;
    if constexpr (expr::simd_lane_v<S>) {
      using V = expr::batch_t<S>;
      constexpr std::int64_t W = V::size;
      for (; c + W <= c1; c += W) {
        V acc = R::template identity<V>();
        for (std::int64_t r = 0; r < R_; ++r) acc = R::combine(acc, ev.template packet<C>(base + r * inner + c));
        alignas(64) S tmp[W];
        acc.store_aligned(tmp);
        for (std::int64_t k = 0; k < W; ++k) out[c + k] = finish_value(tmp[k]);
      }
    }
    for (; c < c1; ++c) {
      S acc = R::template identity<S>();
      for (std::int64_t r = 0; r < R_; ++r) acc = R::combine(acc, ev.coeff(base + r * inner + c));
      out[c] = finish_value(acc);
    }
  }

  K kernel_;
  ReduceGeometry g_;
  double scale_;
  Shape child_shape_;
  std::vector<char> splat_;
};

/// argmax / argmin (first occurrence; NaN counts as the extreme, as in torch).
template <class K, class S, bool IsMax>
class ArgReductionNode final : public Node {
 public:
  ArgReductionNode(K kernel, Shape out_shape, ReduceGeometry g, Device* device, std::vector<NodePtr> inputs,
                   Shape child_shape)
      : Node(NodeKind::Reduction, DType::Int64, out_shape, device, std::move(inputs)), kernel_(std::move(kernel)),
        g_(g) {
    for (const auto& in : this->inputs()) splat_.push_back(in->numel() == 1 && child_shape.numel() != 1 ? 1 : 0);
  }
  std::string op_name() const override { return IsMax ? "argmax" : "argmin"; }
  std::string describe() const override { return op_name() + "(" + expr::kernel_text(kernel_) + ")"; }

 protected:
  void compute(ExecContext& ctx) override {
    const auto& ins = inputs();
    std::vector<const void*> ptrs(ins.size());
    for (std::size_t i = 0; i < ins.size(); ++i) ptrs[i] = ins[i]->buffer()->data();
    auto buf = allocate_output(ctx, false);
    auto* out = static_cast<std::int64_t*>(buf->data());
    auto& pool = ctx.device.threads();
    const std::int64_t units = g_.outer * g_.inner;
    const std::int64_t tasks = std::min(units, task_count(pool, units * g_.extent, 2.0));
    pool.parallel_for(tasks, [&](std::int64_t t) {
      expr::Eval<S, K> ev(kernel_, ptrs.data(), splat_.data());
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
  std::vector<char> splat_;
};

}  // namespace lazy::graph
// ---- end lazytensor/graph/reduction_node.hpp ----

namespace lazy {

namespace detail {

/// Normalized, sorted, de-duplicated reduction dims; empty `dims` means all.
inline std::vector<int> reduce_dims(const Shape& s, const std::vector<std::int64_t>& dims, const char* op) {
  std::vector<int> d;
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
  if (s.rank() == 0) d.clear();
  return d;
}

inline Shape reduced_shape(const Shape& s, const std::vector<int>& dims, bool keepdim) {
  Shape out;
  for (int i = 0; i < s.rank(); ++i) {
    const bool r = std::find(dims.begin(), dims.end(), i) != dims.end();
    if (!r) out.push_back(s[i]);
    else if (keepdim) out.push_back(1);
  }
  return out;
}

/// [outer, R, inner] when the reduced dims of size > 1 are adjacent; false otherwise.
inline bool geometry(const Shape& s, const std::vector<int>& dims, graph::ReduceGeometry& g) {
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
  auto k = expr::to_kernel(expr::operand(x), inputs);
  using K = decltype(k);
  if constexpr (expr::is_expr_node<X>::value) {
    if (!flat_child(x, inputs)) {
      // A broadcast inside the child: materialize it once, then reduce the result.
      return reduction_node<R, Tout>(Tensor<typename X::value_type>(x), dims, keepdim, scale_kind, op);
    }
  }
  using S = expr::lane_combine<expr::klane_t<K>, expr::lane_of<Tout>>;
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

}  // namespace detail

using Dims = std::vector<std::int64_t>;

/// Sum over `dims` (all when empty); integers sum to int64.
template <expr::ExprLike X>
auto sum(const X& x, const Dims& dims = {}, bool keepdim = false) {
  return detail::reduce<ops::reduce::Sum>(x, dims, keepdim, "sum");
}
/// Product over `dims`.
template <expr::ExprLike X>
auto prod(const X& x, const Dims& dims = {}, bool keepdim = false) {
  return detail::reduce<ops::reduce::Prod>(x, dims, keepdim, "prod");
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
    return Tensor<T>(detail::reduction_node<ops::reduce::Sum, T>(x, dims, keepdim, 1, "mean"));
  }
}
/// Largest value over `dims` (NaN-propagating).
template <expr::ExprLike X>
auto amax(const X& x, const Dims& dims = {}, bool keepdim = false) {
  detail::require_nonempty(x, dims, "amax");
  return detail::reduce<ops::reduce::Max>(x, dims, keepdim, "amax");
}
/// Smallest value over `dims` (NaN-propagating).
template <expr::ExprLike X>
auto amin(const X& x, const Dims& dims = {}, bool keepdim = false) {
  detail::require_nonempty(x, dims, "amin");
  return detail::reduce<ops::reduce::Min>(x, dims, keepdim, "amin");
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
  auto k = expr::to_kernel(expr::operand(x), inputs);
  if constexpr (expr::is_expr_node<X>::value) {
    if (!flat_child(x, inputs)) return arg_reduce<IsMax>(Tensor<typename X::value_type>(x), dim, keepdim, op);
  }
  using K = decltype(k);
  graph::Device& dev = graph::common_device(inputs, op);
  return Tensor<std::int64_t>(graph::submit(std::make_shared<graph::ArgReductionNode<K, expr::klane_t<K>, IsMax>>(
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
  Tensor<T> shift = where(abs(m) == std::numeric_limits<float>::infinity(), 0, m);
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
// ---- end lazytensor/ops/reduction.hpp ----
// ---- begin lazytensor/ops/softmax.hpp ----
// softmax and log_softmax as fused row kernels: one pass for the max, one for the sum of
// exponentials, one to write; the row stays in cache between passes.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>

#include <xsimd/xsimd.hpp>


namespace lazy {

namespace graph {

/// softmax (or log_softmax) of a [outer, R, inner] view over R.
template <class T, bool Log>
class SoftmaxNode final : public Node {
 public:
  SoftmaxNode(NodePtr in, int dim, std::int64_t outer, std::int64_t extent, std::int64_t inner)
      : Node(NodeKind::Reduction, dtype_of<T>(), in->shape(), in->device(), {in}), dim_(dim), outer_(outer),
        extent_(extent), inner_(inner) {}

  std::string op_name() const override { return Log ? "log_softmax" : "softmax"; }
  std::string describe() const override { return op_name() + "(%0, dim=" + std::to_string(dim_) + ")"; }
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

}  // namespace graph

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
// ---- end lazytensor/lazytensor.hpp ----
