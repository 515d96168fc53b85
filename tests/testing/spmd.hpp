#pragma once
// Shared by the SPMD tests (tests/spmd): SPMD mode holds for the whole process, so it is
// turned on once, at start-up, by including this header.

#include <cstdint>

#include <lazytensor/spmd.hpp>

#include "testing/helpers.hpp"

namespace lazy_tests {

inline const bool spmd_mode_on = (lazy::spmd::use_spmd(), true);

/// The current value of a counter of the metrics report.
inline std::int64_t counter_value(const char* name) { return lazy::core::counter(name).value.load(); }

/// A double tensor of `shape` with values uniform in [-1, 1) from `seed`.
inline lazy::Tensor<double> random_tensor(const lazy::Shape& shape, unsigned seed) {
  return lazy::from_vector<double>(random_values<double>(shape.numel(), seed), shape);
}

}  // namespace lazy_tests
