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
#include <lazytensor/tensor.hpp>

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
