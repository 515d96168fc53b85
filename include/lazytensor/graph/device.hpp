#pragma once
// A device: the trace of pending nodes (each knows whether a handle holds it), a worker pool, a
// buffer pool, an executor thread running submitted plans in order, the plan cache, a
// random-number stream and the step closures. Devices live for the whole process.
//
// Threads: one thread traces a device (its replica thread, or the user's), creating
// pending nodes and calling mark_step; the device's executor thread runs the plans
// mark_step hands it, using the worker pool, unless a thread waiting for them runs them
// first (wait_below). The tracing thread never looks inside a queued node, and waits for
// the queue (wait_idle) before it runs anything itself.

#include <algorithm>
#include <array>
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

#include <lazytensor/core/buffer.hpp>
#include <lazytensor/core/counters.hpp>
#include <lazytensor/core/env.hpp>
#include <lazytensor/core/error.hpp>
#include <lazytensor/core/spin_lock.hpp>
#include <lazytensor/core/thread_pool.hpp>
#include <lazytensor/graph/plan_cache.hpp>
#include <lazytensor/graph/tensor_impl.hpp>
#include <lazytensor/core/config.hpp>

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
  /// "CPU:0", as torch_xla prints devices (the global id when an SPMD program spans
  /// processes).
  std::string str() const { return "CPU:" + std::to_string(global_id_ < 0 ? index_ : global_id_); }

  /// A device of another process that an SPMD program spans (lazy::spmd): this process
  /// traces its nodes, as every process traces the whole program, but never computes them;
  /// its steps drop them (drop_remote_trace). Set once, before anything is traced on it.
  void set_span_place(int global_id, int process, bool remote) {
    global_id_ = global_id;
    process_ = process;
    remote_ = remote;
  }
  bool remote() const { return remote_; }
  /// The process owning this device (0 unless an SPMD program spans processes).
  int process() const { return process_; }
  /// A remote device's step: its traced nodes become values that exist only in their own
  /// process (Ready without a buffer, inputs released), so nothing here keeps their graph.
  void drop_remote_trace();

  ThreadPool& threads() { return threads_; }
  /// Changes the number of threads kernels use, once the steps in flight have finished.
  void set_num_threads(int n);
  BufferPool& pool() { return *pool_; }

  // ---- the trace ----------------------------------------------------------------------

  /// Records a new pending node, in creation order.
  void trace(const NodePtr& n);
  /// Number of entries in the trace, dropped nodes not yet pruned included (for tests).
  std::size_t trace_size();
  /// Takes the trace into `into` (the caller puts back what it does not run, see
  /// keep_traced). The trace keeps `into`'s former storage, emptied: a caller that keeps
  /// its vector from step to step lets the next statements trace without allocating.
  void take_trace(std::vector<std::weak_ptr<Node>>& into);
  /// Returns nodes (in creation order) to the trace, which stays in creation order: the
  /// planner relies on producers coming before their consumers.
  void keep_traced(std::vector<std::weak_ptr<Node>> older);
  /// Drops the trace's entry of `n`, a node a read has just computed, if it is the newest.
  /// Dropped here, while the reader still holds the node, its weak reference ends without
  /// the node's last release paying for it (shared_ptr's slow path when a weak reference
  /// remains: two locked decrements, where a node nothing else observes is freed with
  /// none), and the next statement finds no dead entry to remove.
  void untrace_newest(const NodePtr& n);

  // ---- execution ----------------------------------------------------------------------

  /// Runs `job` after the jobs before it: on the executor thread, or on a thread that waits
  /// for it (wait_below) while no other job runs.
  void enqueue(std::function<void()> job);
  /// Blocks until every enqueued job has finished.
  void wait_idle() { wait_below(1); }
  /// Blocks until fewer than `n` enqueued jobs are unfinished (running or waiting). While
  /// no job runs, the caller runs the oldest queued job itself instead of waiting for the
  /// executor thread to wake up for it (and then for this thread to wake up again).
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
  // Ids of the newest and oldest live nodes of a list in trace order (0 and the maximum
  // when none is alive).
  static std::uint64_t newest_id(const std::vector<std::weak_ptr<Node>>& v);
  static std::uint64_t oldest_id(const std::vector<std::weak_ptr<Node>>& v);
  void prune_trace();
  // The next pruning comes when the trace has doubled from now.
  void rearm_pruning() { prune_at_ = std::max(kMinPruneAt, 2 * trace_.size()); }

  static bool default_async() { return core::env_switch("LAZYTENSOR_ASYNC").value_or(true); }

  int index_;
  int global_id_ = -1;
  int process_ = 0;
  bool remote_ = false;
  std::shared_ptr<BufferPool> pool_;
  ThreadPool threads_;
  // Guards the trace, node ids, closures and stored error: a spin lock (one locked instruction
  // where std::mutex paid two and two calls), taken per traced statement for a push; its O(trace)
  // holds (a step's merge, a pruning) are the tracing thread's own, met only by error paths.
  core::SpinLock mu_;
  std::vector<std::weak_ptr<Node>> trace_;
  std::uint64_t next_node_id_ = 0;  // Node::id of the next node traced here (under mu_)
  static constexpr std::size_t kMinPruneAt = 1024;
  std::size_t prune_at_ = kMinPruneAt;
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
  // Runs the oldest queued job on this thread; `lock` holds exec_mu_ before and after.
  void run_front(std::unique_lock<std::mutex>& lock);
  // Changed under exec_mu_ (the condition variables' predicate), read without it by
  // wait_below's and busy()'s fast path.
  std::atomic<std::int64_t> outstanding_{0};
  bool running_ = false;  // a job runs (on the executor or a waiting thread); under exec_mu_
  bool stop_ = false;
  std::thread executor_;
};

/// Threads a device uses by default: LAZYTENSOR_NUM_THREADS, else the hardware threads.
int default_device_threads();

/// All devices of this process. Created on first use; never destroyed before exit.
class DeviceRegistry {
 public:
  static DeviceRegistry& get();
  /// Device `index`, created on first use. Every traced factory, collective and mark_step
  /// asks for the current device: a device already created is found without a lock.
  Device& device(int index) {
    if (index >= 0 && index < kPublished) {
      Device* d = published_[static_cast<std::size_t>(index)].load(std::memory_order_acquire);
      if (d) return *d;
    }
    return create(index);
  }
  /// Number of devices created so far (at least 1).
  int count();

 private:
  static constexpr int kPublished = 64;
  Device& create(int index);

  std::mutex mu_;
  std::deque<std::unique_ptr<Device>> devices_;
  // Devices [0, kPublished) once created (devices are never destroyed before exit).
  std::array<std::atomic<Device*>, kPublished> published_{};
};

/// Index of this thread's current device (replicas bind their thread to their device).
int& current_device_index();

/// This thread's current device.
inline Device& current_device() { return DeviceRegistry::get().device(current_device_index()); }

/// Points an existing handle at `node` (a parameter moved or reloaded in place).
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
  if (n->id_ == 0) n->id_ = ++next_node_id_;
  trace_.push_back(n);
}

LAZYTENSOR_INLINE void Device::untrace_newest(const NodePtr& n) {
  std::lock_guard lock(mu_);
  if (!trace_.empty() && !trace_.back().owner_before(n) && !n.owner_before(trace_.back())) trace_.pop_back();
}

LAZYTENSOR_INLINE void Device::drop_remote_trace() {
  std::vector<std::weak_ptr<Node>> taken;
  take_trace(taken);
  for (auto& w : taken)
    if (auto n = w.lock(); n && n->pending()) n->finish_with(nullptr);
}

LAZYTENSOR_INLINE std::size_t Device::trace_size() {
  std::lock_guard lock(mu_);
  return trace_.size();
}

LAZYTENSOR_INLINE void Device::take_trace(std::vector<std::weak_ptr<Node>>& into) {
  into.clear();
  std::lock_guard lock(mu_);
  prune_at_ = kMinPruneAt;  // a large step must not leave a high threshold behind
  into.swap(trace_);
}

LAZYTENSOR_INLINE void Device::keep_traced(std::vector<std::weak_ptr<Node>> older) {
  if (older.empty()) return;
  std::lock_guard lock(mu_);
  // A node an eager device ran without tracing it comes back unnumbered: number it now.
  for (auto& w : older)
    if (auto n = w.lock(); n && n->id_ == 0) n->id_ = ++next_node_id_;
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
  // Waking a sleeping thread costs 15-50 us on a VM (more when its core is idle): a step
  // read right after mark_step would pay it twice, the executor's start and this thread's
  // return. So a waiter runs the next job itself when none is running; jobs still run one
  // at a time, in order (running_), and the executor runs whatever the waiters leave. A
  // waiter runs only jobs it would otherwise wait for, so this adds no wait to any thread.
  // The job runs with the waiter's thread state: inside a pool task (ThreadPool::in_worker)
  // its loops run serially, and its GEMM scratch is that thread's.
  std::unique_lock lock(exec_mu_);
  while (outstanding_.load(std::memory_order_relaxed) >= n) {
    if (!running_ && !jobs_.empty()) {
      run_front(lock);
    } else {
      idle_cv_.wait(lock);
    }
  }
}

LAZYTENSOR_INLINE void Device::run_front(std::unique_lock<std::mutex>& lock) {
  std::function<void()> job = std::move(jobs_.front());
  jobs_.pop_front();
  running_ = true;
  lock.unlock();
  try {
    job();
  } catch (...) {  // jobs store their own errors; this is for one they could not (memory)
    store_error(std::current_exception());
  }
  job = nullptr;  // the step's nodes go before the count says it is done
  lock.lock();
  running_ = false;
  outstanding_.fetch_sub(1, std::memory_order_release);
  idle_cv_.notify_all();
  if (!jobs_.empty() || stop_) exec_cv_.notify_all();  // the executor waits out running_
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
    std::unique_lock lock(exec_mu_);
    exec_cv_.wait(lock, [&] { return !running_ && (stop_ || !jobs_.empty()); });
    if (jobs_.empty()) return;  // stopping, nothing left
    run_front(lock);  // jobs catch their own errors (store_error)
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
  // Before the join: a dropped step gives back its collectives (executor.hpp's QueuedStep),
  // so the executor we join is not left waiting for a peer that waits for this device.
  dropped.clear();
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

LAZYTENSOR_INLINE Device& DeviceRegistry::create(int index) {
  if (index < 0) throw DeviceError("device index must be >= 0, got " + std::to_string(index));
  std::lock_guard lock(mu_);
  while (static_cast<int>(devices_.size()) <= index) {
    const int i = static_cast<int>(devices_.size());
    devices_.push_back(std::make_unique<Device>(i, default_device_threads()));
    if (i < kPublished)
      published_[static_cast<std::size_t>(i)].store(devices_.back().get(), std::memory_order_release);
  }
  return *devices_[static_cast<std::size_t>(index)];
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
  impl->node = std::move(node);
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
  return output_buffer(ctx.device.pool(), padded_bytes(numel(), dtype_size(dtype_)));
}

}  // namespace lazy::graph
#endif  // LAZYTENSOR_HEADER_DEFINITIONS
