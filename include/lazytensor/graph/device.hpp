#pragma once
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

#include <lazytensor/core/buffer.hpp>
#include <lazytensor/core/counters.hpp>
#include <lazytensor/core/error.hpp>
#include <lazytensor/core/thread_pool.hpp>
#include <lazytensor/graph/tensor_impl.hpp>

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
