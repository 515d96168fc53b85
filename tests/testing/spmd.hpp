#pragma once
// Shared by the SPMD tests (tests/spmd): SPMD mode holds for the whole process, so it is
// turned on once, at start-up, by including this header.

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include <lazytensor/spmd.hpp>

#include "testing/helpers.hpp"

namespace lazy_tests {

inline const bool spmd_mode_on = (lazy::spmd::use_spmd(), true);

/// The current value of a counter of the metrics report.
inline std::int64_t counter_value(const char* name) { return lazy::core::counter(name).value(); }

/// Meshes of the four devices in every shape the SPMD issue names, with axes "x" (and "y");
/// the last in reverse device order.
inline std::vector<lazy::spmd::Mesh> named_meshes() {
  using lazy::spmd::Mesh;
  return {Mesh({0, 1, 2, 3}, {4}, {"x"}), Mesh({0, 1, 2, 3}, {2, 2}, {"x", "y"}), Mesh({0, 1, 2, 3}, {1, 4}, {"x", "y"}),
          Mesh({3, 2, 1, 0}, {4, 1}, {"x", "y"})};
}

/// A double tensor of `shape` with values uniform in [-1, 1) from `seed`.
inline lazy::Tensor<double> random_tensor(const lazy::Shape& shape, unsigned seed) {
  return lazy::from_vector<double>(random_values<double>(shape.numel(), seed), shape);
}

/// Expects `got` to equal `want` within 1e-12, relative above 1 and absolute below (a
/// sharded computation whose sums are split against the unsharded one, in double).
inline void expect_close_rel(const std::vector<double>& got, const std::vector<double>& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (std::size_t i = 0; i < got.size(); ++i)
    EXPECT_NEAR(got[i], want[i], 1e-12 * std::max(1.0, std::abs(want[i]))) << what << " at " << i;
}

/// Expects two training runs (any struct with `losses` and per-parameter `weights`) to agree
/// within 1e-12, relative (weights: relative above 1, absolute below).
template <class Run>
void expect_same_run(const Run& got, const Run& want, const char* what) {
  ASSERT_EQ(got.losses.size(), want.losses.size());
  for (std::size_t i = 0; i < got.losses.size(); ++i)
    EXPECT_NEAR(got.losses[i], want.losses[i], 1e-12 * std::abs(want.losses[i])) << what << " step " << i;
  ASSERT_EQ(got.weights.size(), want.weights.size());
  for (std::size_t p = 0; p < got.weights.size(); ++p)
    for (std::size_t i = 0; i < got.weights[p].size(); ++i)
      EXPECT_NEAR(got.weights[p][i], want.weights[p][i], 1e-12 * std::max(1.0, std::abs(want.weights[p][i])))
          << what << " parameter " << p << " element " << i;
}

}  // namespace lazy_tests
