#pragma once

#include <lazytensor/core/config.hpp>
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

#include <lazytensor/core/spin_lock.hpp>

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
  for (int spin = 0; spin < kSpin && !finished(); ++spin) core::cpu_relax();
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
      core::cpu_relax();
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
