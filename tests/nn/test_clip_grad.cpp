// Tests of nn/utils/clip_grad.hpp: the total norm of every order and the clipped gradients
// against a double-precision loop written here; clip_grad_value_ against std::clamp.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include <gtest/gtest.h>

#include <lazytensor/nn.hpp>
#include <lazytensor/ops/factories.hpp>

namespace {

using lazy::Shape;
using lazy::Tensor;

// Two parameters with known gradients (and one without).
struct ClipCase {
  std::vector<Tensor<float>> params;
  std::vector<std::vector<float>> grads = {{3.0f, -4.0f, 0.5f}, {-1.5f, 2.0f, 0.25f, -6.0f}};
  ClipCase() {
    for (const auto& g : grads) {
      Tensor<float> p = lazy::zeros<float>(Shape{static_cast<std::int64_t>(g.size())});
      p.requires_grad_(true);
      p.set_grad(lazy::from_vector<float>(g, Shape{static_cast<std::int64_t>(g.size())}));
      params.push_back(p);
    }
    Tensor<float> no_grad = lazy::zeros<float>(Shape{2});
    no_grad.requires_grad_(true);
    params.push_back(no_grad);
  }
  double norm(double p) const {
    double acc = 0;
    for (const auto& g : grads)
      for (const float v : g) acc = std::isinf(p) ? std::max(acc, std::fabs(double(v))) : acc + std::pow(std::fabs(double(v)), p);
    return std::isinf(p) ? acc : std::pow(acc, 1.0 / p);
  }
};

TEST(ClipGradNorm, EveryOrderAgainstAReference) {
  for (const double p : {1.0, 2.0, 3.0, std::numeric_limits<double>::infinity()}) {
    for (const double max_norm : {0.5, 2.0, 1e6}) {
      SCOPED_TRACE("norm_type " + std::to_string(p) + ", max_norm " + std::to_string(max_norm));
      ClipCase c;
      const Tensor<float> total = lazy::nn::utils::clip_grad_norm_(c.params, max_norm, p);
      const double want = c.norm(p);
      EXPECT_NEAR(total.item(), want, 1e-5 * want);
      const double coef = std::min(1.0, max_norm / (want + 1e-6));
      for (std::size_t k = 0; k < c.grads.size(); ++k) {
        const auto got = c.params[k].grad().to_vector();
        for (std::size_t i = 0; i < got.size(); ++i)
          EXPECT_NEAR(got[i], c.grads[k][i] * coef, 1e-6 + 1e-6 * std::fabs(c.grads[k][i])) << k << "," << i;
      }
      EXPECT_FALSE(c.params[2].grad().defined()) << "a parameter without a gradient keeps none";
    }
  }
}

TEST(ClipGradNorm, ClippedGradientsHaveTheMaximumNorm) {
  ClipCase c;
  lazy::nn::utils::clip_grad_norm_(c.params, 1.0);
  double acc = 0;
  for (std::size_t k = 0; k < 2; ++k)
    for (const float v : c.params[k].grad().to_vector()) acc += double(v) * v;
  EXPECT_NEAR(std::sqrt(acc), 1.0, 1e-5);
}

TEST(ClipGradNorm, NonFiniteNormsAndBadArguments) {
  ClipCase c;
  c.params[0].set_grad(lazy::from_vector<float>({1.0f, std::numeric_limits<float>::quiet_NaN(), 0.0f}, Shape{3}));
  EXPECT_THROW(lazy::nn::utils::clip_grad_norm_(c.params, 1.0, 2.0, /*error_if_nonfinite=*/true), lazy::Error);
  EXPECT_TRUE(std::isnan(lazy::nn::utils::clip_grad_norm_(c.params, 1.0).item())) << "without the check: NaN, as torch";
  EXPECT_THROW(lazy::nn::utils::clip_grad_norm_(c.params, 1.0, 0.5), lazy::Error);
  EXPECT_THROW(lazy::nn::utils::clip_grad_norm_(c.params, -1.0), lazy::Error);
  const Tensor<float> none = lazy::zeros<float>(Shape{2});
  EXPECT_EQ(lazy::nn::utils::clip_grad_norm_(none, 1.0).item(), 0.0f) << "no gradient: norm 0";
}

TEST(ClipGradValue, ClampsEveryElement) {
  ClipCase c;
  lazy::nn::utils::clip_grad_value_(c.params, 1.75);
  for (std::size_t k = 0; k < 2; ++k) {
    const auto got = c.params[k].grad().to_vector();
    for (std::size_t i = 0; i < got.size(); ++i) EXPECT_EQ(got[i], std::clamp(c.grads[k][i], -1.75f, 1.75f));
  }
  EXPECT_THROW(lazy::nn::utils::clip_grad_value_(c.params, -1.0), lazy::Error);
}

TEST(ClipGradNorm, AGradientSharedByTwoHandlesSeesTheClip) {
  ClipCase c;
  Tensor<float> handle = c.params[0].grad();
  lazy::nn::utils::clip_grad_norm_(c.params[0], 1.0);
  const auto via_param = c.params[0].grad().to_vector();
  EXPECT_EQ(handle.to_vector(), via_param);
  double acc = 0;
  for (const float v : via_param) acc += double(v) * v;
  EXPECT_NEAR(std::sqrt(acc), 1.0, 1e-5);
}

}  // namespace
