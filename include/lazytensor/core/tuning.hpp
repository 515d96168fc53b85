#pragma once
// The sizes at which the runtime changes strategy (threads, non-temporal stores, sliced
// groups), and their environment overrides.
//
// The defaults fit today's x86 cores (0.5-2 MiB of L2 per core, 16-32 MiB of shared L3). A
// machine with other caches can move them, as glibc's x86_non_temporal_threshold tunable
// moves memcpy's; and the tests reach every strategy with small inputs by lowering them
// (tests/CMakeLists.txt: the sanitizer builds), instead of filling hundreds of MiB.

#include <cstdint>

#include <lazytensor/core/config.hpp>
#include <lazytensor/core/env.hpp>

namespace lazy::core {

/// The runtime's strategy thresholds. Each is read from its environment variable once per
/// process, when the first kernel asks.
struct Tuning {
  /// Work (cost units x elements) below which a kernel runs on the calling thread: waking
  /// workers and joining them costs a few microseconds, what ~2^18 simple SIMD element
  /// operations take (workers spin between kernels; see ThreadPool).
  /// `LAZYTENSOR_PARALLEL_WORK`.
  double parallel_work = 1 << 18;
  /// Outputs at least this large are written with non-temporal stores: they cannot stay in
  /// the last-level cache anyway, and streaming skips reading each output line before
  /// overwriting it. Fused groups reading this much take their shortest slices (their inputs
  /// come from memory). `LAZYTENSOR_STREAMING_STORE_BYTES`.
  std::int64_t streaming_store_bytes = std::int64_t(32) << 20;
  /// Bytes read from outside a fused group from which it runs its chunks in slices: what L2
  /// holds. `LAZYTENSOR_FUSION_SLICE_BYTES`.
  std::int64_t fusion_slice_bytes = std::int64_t(1) << 20;
};

/// The process's thresholds: the defaults above, each replaced by its environment variable
/// when that is set. Throws lazy::Error naming the variable when one is not a whole number
/// >= 1.
const Tuning& tuning();

}  // namespace lazy::core

#if LAZYTENSOR_HEADER_DEFINITIONS
namespace lazy::core {

LAZYTENSOR_INLINE const Tuning& tuning() {
  static const Tuning t = [] {
    Tuning r;
    if (auto v = env_integer("LAZYTENSOR_PARALLEL_WORK", 1, "cost units x elements", "262144"))
      r.parallel_work = static_cast<double>(*v);
    if (auto v = env_integer("LAZYTENSOR_STREAMING_STORE_BYTES", 1, "bytes", "33554432"))
      r.streaming_store_bytes = *v;
    if (auto v = env_integer("LAZYTENSOR_FUSION_SLICE_BYTES", 1, "bytes", "1048576")) r.fusion_slice_bytes = *v;
    return r;
  }();
  return t;
}

}  // namespace lazy::core
#endif  // LAZYTENSOR_HEADER_DEFINITIONS
