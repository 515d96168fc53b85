#pragma once
// Fork-join worker pool: a kernel splits its work into tasks, the calling thread takes part,
// and the call returns when every task is done. Nested calls run inline.

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

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
    stopping_ = false;
    for (int i = 1; i < threads_; ++i) workers_.emplace_back([this] { worker_loop(); });
  }

  /// Runs fn(task) for task in [0, tasks); returns when all have run. The first exception
  /// thrown by a task is re-thrown here after the others finished.
  void parallel_for(std::int64_t tasks, const std::function<void(std::int64_t)>& fn) {
    if (tasks <= 0) return;
    if (tasks == 1 || threads_ == 1 || in_worker()) {
      for (std::int64_t t = 0; t < tasks; ++t) fn(t);
      return;
    }
    std::lock_guard submit(submit_mu_);
    {
      std::lock_guard lock(mu_);
      job_ = &fn;
      tasks_ = tasks;
      next_.store(0);
      pending_ = tasks;
      error_ = nullptr;
      ++generation_;
    }
    cv_.notify_all();
    in_worker() = true;
    drain();
    in_worker() = false;
    std::unique_lock lock(mu_);
    done_cv_.wait(lock, [&] { return pending_ == 0 && active_ == 0; });
    job_ = nullptr;
    if (error_) std::rethrow_exception(std::exchange(error_, nullptr));
  }

 private:
  static bool& in_worker() {
    thread_local bool flag = false;
    return flag;
  }

  void drain() {
    const std::function<void(std::int64_t)>* job;
    std::int64_t tasks;
    {
      std::lock_guard lock(mu_);
      if (!job_) return;
      job = job_;
      tasks = tasks_;
      ++active_;  // the submitter may not return while we hold its job
    }
    std::int64_t done = 0;
    for (std::int64_t t; (t = next_.fetch_add(1)) < tasks;) {
      try {
        (*job)(t);
      } catch (...) {
        std::lock_guard lock(mu_);
        if (!error_) error_ = std::current_exception();
      }
      ++done;
    }
    std::lock_guard lock(mu_);
    pending_ -= done;
    --active_;
    if (pending_ == 0 && active_ == 0) done_cv_.notify_all();
  }

  void worker_loop() {
    in_worker() = true;
    std::uint64_t seen = 0;
    for (;;) {
      {
        std::unique_lock lock(mu_);
        cv_.wait(lock, [&] { return stopping_ || (generation_ != seen && job_); });
        if (stopping_) return;
        seen = generation_;
      }
      drain();
    }
  }

  void stop() {
    {
      std::lock_guard lock(mu_);
      stopping_ = true;
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
  const std::function<void(std::int64_t)>* job_ = nullptr;
  std::int64_t tasks_ = 0;
  std::atomic<std::int64_t> next_{0};
  std::int64_t pending_ = 0;
  int active_ = 0;
  std::uint64_t generation_ = 0;
  std::exception_ptr error_;
  bool stopping_ = false;
};

}  // namespace lazy
