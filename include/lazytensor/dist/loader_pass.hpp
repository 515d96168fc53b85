#pragma once
// One pass of a ParallelLoader (dist/parallel_loader.hpp) and what it copies: the loader
// thread, the transfer threads, their queues and the reorder buffer, and the copy of a batch
// into a device. Internal (namespace detail) but for ParallelLoaderOptions.
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

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <deque>
#include <exception>
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

#include <lazytensor/any_tensor.hpp>
#include <lazytensor/core/config.hpp>
#include <lazytensor/core/error.hpp>
#include <lazytensor/data/example.hpp>
#include <lazytensor/tensor/device.hpp>

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
