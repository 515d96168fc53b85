#pragma once
// Devices and steps: mark_step/sync, eager mode, step closures, compile, RNG state.

#include <functional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include <lazytensor/core/counters.hpp>
#include <lazytensor/graph/executor.hpp>
#include <lazytensor/tensor/tensor.hpp>
#include <lazytensor/core/config.hpp>

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
/// seed advance after mark_step). `wait_previous`: as graph::run_step's.
inline void step_device(graph::Device& dev, bool wait_previous = true) {
  graph::run_step(dev, graph::collect_step(dev), wait_previous);
  graph::advance_random_stream(dev);
}
}  // namespace detail

LAZYTENSOR_INLINE void mark_step() {
  static auto& steps = core::counter("MarkStep");
  graph::Device& dev = graph::current_device();
  steps.add();
  if (graph::step_every_device().load(std::memory_order_acquire)) {
    // SPMD: this thread drives every device. Each device's step is handed to its own
    // executor, so the shards of a statement compute in parallel; every device gets its
    // step before this thread waits for any previous one (an executor that finished first
    // would otherwise idle until the others did).
    // The devices step_all_devices steps (every device of the process).
    auto& registry = graph::DeviceRegistry::get();
    for (int i = 0, n = registry.count(); i < n; ++i) registry.device(i).rethrow_stored_error();
    graph::step_all_devices(/*advance_rng=*/true);
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
