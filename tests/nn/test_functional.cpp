// nn/functional.hpp: losses against host references computed in double, and their
// gradients against the closed forms (cross entropy: (softmax - smoothed one-hot) / N).
#include <cmath>

#include <gtest/gtest.h>

#include <lazytensor/lazytensor.hpp>
#include <lazytensor/nn.hpp>

namespace {

using lazy::Shape;
using lazy::Tensor;
namespace F = lazy::nn::functional;
using lazy::nn::Reduction;

struct Logits {
  std::vector<float> x;
  std::vector<std::int64_t> t;
  std::int64_t n, c;
};
Logits make(std::int64_t n, std::int64_t c) {
  Logits l{{}, {}, n, c};
  for (std::int64_t i = 0; i < n * c; ++i) l.x.push_back(static_cast<float>(std::sin(i * 1.7) * 3));
  for (std::int64_t i = 0; i < n; ++i) l.t.push_back((i * 7 + 3) % c);
  return l;
}

TEST(Losses, CrossEntropyValueAndGradient) {
  for (double eps : {0.0, 0.1}) {
    for (auto red : {Reduction::Mean, Reduction::Sum, Reduction::None}) {
      const auto L = make(6, 5);
      auto x = lazy::from_vector<float>(L.x, Shape{L.n, L.c}).requires_grad_();
      auto t = lazy::from_vector<std::int64_t>(L.t, Shape{L.n});
      Tensor<float> loss = F::cross_entropy(x, t, {red, eps});
      // Host reference in double.
      std::vector<double> per(L.n), grad(L.n * L.c);
      for (std::int64_t i = 0; i < L.n; ++i) {
        double m = -1e300, s = 0;
        for (std::int64_t j = 0; j < L.c; ++j) m = std::max(m, double(L.x[i * L.c + j]));
        for (std::int64_t j = 0; j < L.c; ++j) s += std::exp(L.x[i * L.c + j] - m);
        double li = 0;
        for (std::int64_t j = 0; j < L.c; ++j) {
          const double logp = L.x[i * L.c + j] - m - std::log(s);
          const double target = (j == L.t[i] ? 1 - eps : 0) + eps / L.c;
          li -= target * logp;
          grad[i * L.c + j] = std::exp(logp) - target;
        }
        per[i] = li;
      }
      const double scale = red == Reduction::Mean ? 1.0 / L.n : 1.0;
      if (red == Reduction::None) {
        const auto got = loss.to_vector();
        for (std::int64_t i = 0; i < L.n; ++i) EXPECT_NEAR(got[i], per[i], 1e-5);
        loss.backward(lazy::ones<float>({L.n}));
      } else {
        double total = 0;
        for (double v : per) total += v;
        EXPECT_NEAR(loss.item(), total * scale, 1e-5);
        loss.backward();
      }
      const auto g = x.grad().to_vector();
      for (std::int64_t k = 0; k < L.n * L.c; ++k) EXPECT_NEAR(g[k], grad[k] * scale, 1e-6) << k;
    }
  }
}

TEST(Losses, CrossEntropyErrors) {
  auto x = lazy::zeros<float>({3, 4});
  EXPECT_THROW(F::cross_entropy(x, lazy::zeros<std::int64_t>({2})), lazy::ShapeError);
  EXPECT_THROW(F::cross_entropy(lazy::zeros<float>({3}), lazy::zeros<std::int64_t>({3})), lazy::ShapeError);
  auto bad = lazy::from_vector<std::int64_t>({0, 4, 1}, Shape{3});
  Tensor<float> loss = F::cross_entropy(x, bad);
  EXPECT_THROW(loss.item(), lazy::IndexError);
}

TEST(Losses, NllMseBceAgainstClosedForms) {
  const auto L = make(4, 3);
  auto x = lazy::from_vector<float>(L.x, Shape{4, 3}).requires_grad_();
  auto t = lazy::from_vector<std::int64_t>(L.t, Shape{4});
  Tensor<float> nll = F::nll_loss(x, t);
  double ref = 0;
  for (int i = 0; i < 4; ++i) ref -= L.x[i * 3 + L.t[i]] / 4.0;
  EXPECT_NEAR(nll.item(), ref, 1e-6);
  nll.backward();
  const auto g = x.grad().to_vector();
  for (int i = 0; i < 4; ++i)
    for (int j = 0; j < 3; ++j) EXPECT_EQ(g[i * 3 + j], j == L.t[i] ? -0.25f : 0.0f);

  auto a = lazy::from_vector<float>({1, 2, 3, 4}, Shape{4}).requires_grad_();
  auto b = lazy::from_vector<float>({0, 2, 5, 1}, Shape{4});
  Tensor<float> mse = F::mse_loss(a, b);
  EXPECT_NEAR(mse.item(), (1 + 0 + 4 + 9) / 4.0, 1e-6);
  mse.backward();
  EXPECT_EQ(a.grad().to_vector(), (std::vector<float>{0.5f, 0.0f, -1.0f, 1.5f}));  // 2 (a - b) / 4
  EXPECT_NEAR(F::mse_loss(a, b, Reduction::Sum).item(), 14.0, 1e-5);

  auto z = lazy::from_vector<float>({-30, -1, 0.5, 40}, Shape{4}).requires_grad_();
  auto y = lazy::from_vector<float>({0, 1, 1, 0}, Shape{4});
  Tensor<float> bce = F::binary_cross_entropy_with_logits(z, y);
  const double zs[] = {-30, -1, 0.5, 40}, ys[] = {0, 1, 1, 0};
  double bref = 0;
  std::vector<double> bg(4);
  for (int i = 0; i < 4; ++i) {
    const double p = 1 / (1 + std::exp(-zs[i]));
    // -(y log p + (1 - y) log(1 - p)), written stably
    bref += (std::max(zs[i], 0.0) - zs[i] * ys[i] + std::log1p(std::exp(-std::abs(zs[i])))) / 4;
    bg[i] = (p - ys[i]) / 4;
  }
  EXPECT_NEAR(bce.item(), bref, 1e-5);  // finite even at |z| = 40
  bce.backward();
  const auto zg = z.grad().to_vector();
  for (int i = 0; i < 4; ++i) EXPECT_NEAR(zg[i], bg[i], 1e-6);
  EXPECT_THROW(F::mse_loss(a, lazy::zeros<float>({3})), lazy::ShapeError);
}

}  // namespace
