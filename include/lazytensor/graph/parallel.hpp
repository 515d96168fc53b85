#pragma once
// When and how a kernel is split across a device's workers.

#include <algorithm>
#include <cstdint>

#include <lazytensor/core/thread_pool.hpp>
#include <lazytensor/core/tuning.hpp>

namespace lazy::graph {

/// Items a task gets at least, unless a caller asks for another minimum.
inline constexpr std::int64_t kMinTaskItems = 4096;

/// Number of tasks for `n` items of `cost` each: 1 below core::tuning().parallel_work, else
/// a few per thread (slack for a noisy, shared machine), never tasks smaller than `min_items`.
inline std::int64_t task_count(const ThreadPool& pool, std::int64_t n, double cost,
                               std::int64_t min_items = kMinTaskItems) {
  if (pool.size() <= 1 || cost * static_cast<double>(n) < core::tuning().parallel_work) return 1;
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
