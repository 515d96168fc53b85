#pragma once
// Finite-difference gradient checks for the autograd tests.
//
// The analytic gradient of L = sum(f(inputs) * W) (W fixed pseudo-random weights, so every
// output element matters with its own weight) comes from lazytensor's backward pass; the
// reference is the central difference (L(x + h e_j) - L(x - h e_j)) / 2h, with L evaluated
// on the host from f's forward values only. Both in double.

#include <cmath>
#include <cstdint>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include <lazytensor/lazytensor.hpp>

namespace gradcheck {

using lazy::Shape;
using lazy::Tensor;
using Fn = std::function<Tensor<double>(const std::vector<Tensor<double>>&)>;

/// Deterministic values in [lo, hi) (a small LCG, independent of the library's RNG).
inline std::vector<double> values(std::int64_t n, std::uint64_t seed, double lo = -1, double hi = 1) {
  std::vector<double> v(static_cast<std::size_t>(n));
  std::uint64_t s = seed * 6364136223846793005ull + 1442695040888963407ull;
  for (auto& x : v) {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    x = lo + (hi - lo) * static_cast<double>(s >> 11) / 9007199254740992.0;
  }
  return v;
}

/// An input: its shape and values.
struct Input {
  Shape shape;
  std::vector<double> data;
};
inline Input input(Shape s, std::uint64_t seed, double lo = -1, double hi = 1) {
  return {s, values(s.numel(), seed, lo, hi)};
}

inline double weighted_sum(const Tensor<double>& out, const std::vector<double>& w) {
  const auto v = out.to_vector();
  double acc = 0;
  for (std::size_t i = 0; i < v.size(); ++i) acc += v[i] * w[i];
  return acc;
}

/// Expects every analytic gradient of f to match central differences.
inline void check(const std::string& what, const Fn& f, const std::vector<Input>& inputs, double tol = 1e-6,
                  double h = 1e-6) {
  SCOPED_TRACE(what);
  std::vector<Tensor<double>> leaves;
  for (const auto& in : inputs) leaves.push_back(lazy::from_vector<double>(in.data, in.shape).requires_grad_());
  Tensor<double> out = f(leaves);
  ASSERT_TRUE(out.requires_grad()) << what << ": output does not require grad";
  const auto w = values(out.numel(), 99, 0.5, 1.5);
  Tensor<double> wt = lazy::from_vector<double>(w, out.shape());
  out.backward(wt);
  lazy::mark_step();
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    Tensor<double> g = leaves[i].grad();
    ASSERT_TRUE(g.defined()) << what << ": input " << i << " got no gradient";
    ASSERT_EQ(g.shape(), inputs[i].shape) << what << ": input " << i;
    const auto analytic = g.to_vector();
    for (std::size_t j = 0; j < inputs[i].data.size(); ++j) {
      auto eval = [&](double delta) {
        std::vector<Tensor<double>> xs;
        for (std::size_t k = 0; k < inputs.size(); ++k) {
          auto d = inputs[k].data;
          if (k == i) d[j] += delta;
          xs.push_back(lazy::from_vector<double>(d, inputs[k].shape));
        }
        return weighted_sum(f(xs), w);
      };
      const double numeric = (eval(h) - eval(-h)) / (2 * h);
      EXPECT_NEAR(analytic[j], numeric, tol * std::max(1.0, std::abs(numeric)))
          << what << ": d/d input" << i << "[" << j << "]";
    }
  }
}

}  // namespace gradcheck
