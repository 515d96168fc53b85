// dist/optimizer_step.hpp: gradients averaged over the group in coalesced buckets, then the
// optimizer's step; replicas end with identical parameters equal to one device trained on
// the concatenated batch (a double-precision reference written from the loss's formula);
// bucket boundaries; groups; nothing runs before mark_step unless barrier is true. Also run
// under TSan.
#include "dist_testing.hpp"

#include <cmath>
#include <cstdint>
#include <latch>
#include <set>
#include <string>
#include <vector>

#include <lazytensor/nn.hpp>
#include <lazytensor/optim.hpp>

namespace {

using dist_testing::Watchdog;
using lazy::Shape;
using lazy::Tensor;
namespace dist = lazy::dist;
namespace nn = lazy::nn;

// Linear regression: pred = x W^T + b, loss = mean((pred - y)^2) over rows and outputs.
constexpr int kIn = 3, kOut = 2, kRows = 4, kSteps = 3;
constexpr double kLr = 0.1, kMomentum = 0.9;

double x_at(int replica, int row, int i) {
  return dist_testing::pattern(replica, row * kIn + i, 1) * 0.25;
}
double y_at(int replica, int row, int o) {
  return dist_testing::pattern(replica, row * kOut + o, 2) * 0.5;
}
double w0_at(int o, int i) { return 0.1 * (o + 1) - 0.05 * i; }
double b0_at(int o) { return 0.2 - 0.3 * o; }

/// Weights (row-major [kOut, kIn]) then biases.
using Params = std::vector<double>;

/// Gradient descent with momentum (buf = m buf + g, p -= lr buf; buf = g at the first step)
/// in double on the rows of every replica in `members` together, from the loss's formula:
/// dL/dW[o][i] = 2 / (N kOut) sum_rows (pred - y)[o] x[i], dL/db[o] = 2 / (N kOut) sum (pred - y)[o].
Params reference(const std::vector<int>& members, int steps) {
  Params p, buf(kOut * kIn + kOut, 0.0);
  for (int o = 0; o < kOut; ++o)
    for (int i = 0; i < kIn; ++i) p.push_back(w0_at(o, i));
  for (int o = 0; o < kOut; ++o) p.push_back(b0_at(o));
  const double scale = 2.0 / (static_cast<double>(members.size()) * kRows * kOut);
  for (int s = 0; s < steps; ++s) {
    Params g(p.size(), 0.0);
    for (int r : members) {
      for (int row = 0; row < kRows; ++row) {
        for (int o = 0; o < kOut; ++o) {
          double pred = p[static_cast<std::size_t>(kOut * kIn + o)];
          for (int i = 0; i < kIn; ++i) pred += p[static_cast<std::size_t>(o * kIn + i)] * x_at(r, row, i);
          const double e = (pred - y_at(r, row, o)) * scale;
          for (int i = 0; i < kIn; ++i) g[static_cast<std::size_t>(o * kIn + i)] += e * x_at(r, row, i);
          g[static_cast<std::size_t>(kOut * kIn + o)] += e;
        }
      }
    }
    for (std::size_t k = 0; k < p.size(); ++k) {
      buf[k] = s == 0 ? g[k] : kMomentum * buf[k] + g[k];
      p[k] -= kLr * buf[k];
    }
  }
  return p;
}

/// The model of every replica, initialized to w0/b0.
nn::Linear make_model() {
  nn::Linear fc(kIn, kOut);
  std::vector<float> w, b;
  for (int o = 0; o < kOut; ++o)
    for (int i = 0; i < kIn; ++i) w.push_back(static_cast<float>(w0_at(o, i)));
  for (int o = 0; o < kOut; ++o) b.push_back(static_cast<float>(b0_at(o)));
  lazy::NoGradGuard no_grad;
  fc->weight.copy_(lazy::from_vector<float>(w, Shape{kOut, kIn}));
  fc->bias.copy_(lazy::from_vector<float>(b, Shape{kOut}));
  return fc;
}

/// Replica r's batch.
std::pair<Tensor<float>, Tensor<float>> batch_of(int r) {
  std::vector<float> x, y;
  for (int row = 0; row < kRows; ++row) {
    for (int i = 0; i < kIn; ++i) x.push_back(static_cast<float>(x_at(r, row, i)));
    for (int o = 0; o < kOut; ++o) y.push_back(static_cast<float>(y_at(r, row, o)));
  }
  return {lazy::from_vector<float>(x, Shape{kRows, kIn}), lazy::from_vector<float>(y, Shape{kRows, kOut})};
}

/// Trains kSteps steps with optimizer_step on replica r; returns its parameters.
std::vector<float> train(int r, const dist::Groups& groups) {
  nn::Linear fc = make_model();
  lazy::optim::SGD opt(fc->parameters(), lazy::optim::SGDOptions(kLr).momentum(kMomentum));
  const auto [x, y] = batch_of(r);
  for (int s = 0; s < kSteps; ++s) {
    opt.zero_grad();
    nn::functional::mse_loss(fc(x), y).backward();
    dist::optimizer_step(opt, false, groups);
    lazy::mark_step();
  }
  std::vector<float> out = fc->weight.to_vector();
  for (float v : fc->bias.to_vector()) out.push_back(v);
  return out;
}

void expect_near_reference(const std::vector<float>& got, const Params& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (std::size_t k = 0; k < want.size(); ++k)
    EXPECT_NEAR(got[k], want[k], 1e-5 * std::max(1.0, std::abs(want[k]))) << what << " parameter " << k;
}

TEST(OptimizerStep, ReplicasMatchOneDeviceTrainedOnTheWholeBatch) {
  Watchdog dog;
  for (int world : {2, 3}) {
    std::vector<std::vector<float>> got(static_cast<std::size_t>(world));
    dist::spawn([&](int r) { got[static_cast<std::size_t>(r)] = train(r, {}); }, world);
    std::vector<int> all(static_cast<std::size_t>(world));
    for (int r = 0; r < world; ++r) all[static_cast<std::size_t>(r)] = r;
    expect_near_reference(got[0], reference(all, kSteps), "world " + std::to_string(world));
    for (int r = 1; r < world; ++r)
      EXPECT_TRUE(dist_testing::same_bits(got[static_cast<std::size_t>(r)], got[0])) << "replica " << r;
  }
}

TEST(OptimizerStep, AWorldOfOneIsPlainSgd) {
  // Outside spawn nothing is exchanged: the result is replica 0's own batch descent.
  expect_near_reference(train(0, {}), reference({0}, kSteps), "outside spawn");
}

TEST(OptimizerStep, AveragesWithinEachGroup) {
  Watchdog dog;
  std::vector<std::vector<float>> got(4);
  const dist::Groups groups = {{0, 2}, {3, 1}};
  dist::spawn([&](int r) { got[static_cast<std::size_t>(r)] = train(r, groups); }, 4);
  expect_near_reference(got[0], reference({0, 2}, kSteps), "group {0, 2}");
  expect_near_reference(got[1], reference({1, 3}, kSteps), "group {3, 1}");
  EXPECT_TRUE(dist_testing::same_bits(got[2], got[0]));
  EXPECT_TRUE(dist_testing::same_bits(got[3], got[1]));
}

// Parameters p_k of these sizes with loss sum_k sum(p_k * c_k): the gradient of p_k on
// replica r is its constant c_k (exact), so one SGD step gives p_k - lr * mean_r(c_k).
// Parameter 4 takes no part in the loss (no gradient: skipped).
const std::vector<std::int64_t> kSizes = {1, 7, 16, 3, 2, 40, 5, 2, 33, 9, 1};
constexpr std::size_t kUnused = 4;

float c_at(int replica, std::size_t k, std::int64_t i) {
  return static_cast<float>(dist_testing::pattern(replica, i, static_cast<int>(k)));
}
float p0_at(std::size_t k, std::int64_t i) { return static_cast<float>((static_cast<int>(k) + i) % 5); }

/// One step over the kSizes parameters; returns every parameter's values and the number
/// of distinct exchanges the gradients came from (counted in the graph before mark_step).
std::pair<std::vector<std::vector<float>>, std::size_t> bucket_step(int r) {
  std::vector<Tensor<float>> params;
  for (std::size_t k = 0; k < kSizes.size(); ++k) {
    std::vector<float> v;
    for (std::int64_t i = 0; i < kSizes[k]; ++i) v.push_back(p0_at(k, i));
    params.push_back(lazy::from_vector<float>(v, Shape{kSizes[k]}));
  }
  lazy::optim::SGD opt(params, lazy::optim::SGDOptions(0.5));
  Tensor<float> loss = lazy::zeros<float>({});
  for (std::size_t k = 0; k < kSizes.size(); ++k) {
    if (k == kUnused) continue;
    std::vector<float> c;
    for (std::int64_t i = 0; i < kSizes[k]; ++i) c.push_back(c_at(r, k, i));
    loss = loss + lazy::sum(params[k] * lazy::from_vector<float>(c, Shape{kSizes[k]}));
  }
  loss.backward();
  dist::optimizer_step(opt);
  std::set<const lazy::graph::Node*> exchanges;
  for (const auto& p : params) {
    if (!p.grad().defined()) continue;
    const auto& result = p.grad().node();  // a collective's result node, input 0 its exchange
    EXPECT_TRUE(result->pending());
    if (!result->inputs().empty()) exchanges.insert(result->inputs()[0].get());
  }
  lazy::mark_step();
  std::vector<std::vector<float>> values;
  for (const auto& p : params) values.push_back(p.to_vector());
  return {values, exchanges.size()};
}

TEST(OptimizerStep, GradientsTravelInBucketsOfAtMostTheBucketSize) {
  Watchdog dog;
  struct Case {
    std::size_t bucket_bytes, exchanges;
  };
  // 64 bytes = 16 floats; in parameter order, a new bucket starts when the next gradient
  // would not fit: {1, 7} {16} {3} (2 has no gradient) {40} {5, 2} {33} {9, 1}.
  // 200 bytes = 50 floats: {1, 7, 16, 3} {40, 5, 2} {33, 9, 1}. The default: one bucket.
  for (const Case c : {Case{64, 7}, Case{200, 3}, Case{dist::gradient_bucket_bytes(), 1}}) {
    const std::size_t saved = dist::gradient_bucket_bytes();
    dist::set_gradient_bucket_bytes(c.bucket_bytes);
    std::vector<std::pair<std::vector<std::vector<float>>, std::size_t>> got(2);
    dist::spawn([&](int r) { got[static_cast<std::size_t>(r)] = bucket_step(r); }, 2);
    dist::set_gradient_bucket_bytes(saved);
    for (int r = 0; r < 2; ++r) {
      const auto& [values, exchanges] = got[static_cast<std::size_t>(r)];
      EXPECT_EQ(exchanges, c.exchanges) << "bucket " << c.bucket_bytes << " replica " << r;
      for (std::size_t k = 0; k < kSizes.size(); ++k) {
        for (std::int64_t i = 0; i < kSizes[k]; ++i) {
          // small integers and halves: exact in float
          const float want = k == kUnused ? p0_at(k, i)
                                          : p0_at(k, i) - 0.5f * (c_at(0, k, i) + c_at(1, k, i)) / 2;
          EXPECT_EQ(values[k][static_cast<std::size_t>(i)], want)
              << "bucket " << c.bucket_bytes << " replica " << r << " parameter " << k << "[" << i << "]";
        }
      }
    }
  }
  EXPECT_THROW(dist::set_gradient_bucket_bytes(0), lazy::Error);
}

TEST(OptimizerStep, RunsNothingBeforeMarkStepUnlessBarrier) {
  Watchdog dog;
  auto& kernels = lazy::core::counter("KernelsRun");
  auto& steps = lazy::core::counter("MarkStep");
  // Replicas meet on latches (not collectives, which would run the pending graph) so that
  // neither executes anything while the other measures.
  std::latch traced(2), measured(2);
  std::vector<int> ok(2, 0);
  dist::spawn(
      [&](int r) {
        nn::Linear fc = make_model();
        lazy::optim::SGD opt(fc->parameters(), lazy::optim::SGDOptions(kLr).momentum(kMomentum));
        const auto [x, y] = batch_of(r);
        lazy::mark_step();
        lazy::wait_device_ops();  // nothing left running (mark_step may run asynchronously)
        nn::functional::mse_loss(fc(x), y).backward();
        traced.arrive_and_wait();
        const auto before = kernels.value();
        dist::optimizer_step(opt);  // barrier = false
        const auto after = kernels.value();
        measured.arrive_and_wait();
        EXPECT_EQ(after, before) << "replica " << r;
        // still being traced (not handed to any execution)
        EXPECT_TRUE(fc->weight.node()->pending());
        EXPECT_TRUE(fc->weight.grad().node()->pending());
        lazy::mark_step();
        EXPECT_FALSE(fc->weight.node()->pending());
        // barrier = true: the step was handed to execution when optimizer_step returns
        opt.zero_grad();
        nn::functional::mse_loss(fc(x), y).backward();
        dist::optimizer_step(opt, true);
        EXPECT_FALSE(fc->weight.node()->pending());
        EXPECT_FALSE(fc->bias.node()->pending());
        lazy::wait_device_ops();
        ok[static_cast<std::size_t>(r)] = 1;
      },
      2);
  EXPECT_EQ(ok, (std::vector<int>{1, 1}));
  // Outside spawn, counted exactly (no other thread runs anything).
  nn::Linear fc = make_model();
  lazy::optim::SGD opt(fc->parameters(), lazy::optim::SGDOptions(kLr));
  const auto [x, y] = batch_of(0);
  lazy::mark_step();
  lazy::wait_device_ops();
  nn::functional::mse_loss(fc(x), y).backward();
  const auto k0 = kernels.value(), s0 = steps.value();
  dist::optimizer_step(opt);
  EXPECT_EQ(kernels.value(), k0);
  EXPECT_EQ(steps.value(), s0);
  dist::optimizer_step(opt, true);
  EXPECT_EQ(steps.value(), s0 + 1);
  lazy::wait_device_ops();
  EXPECT_GT(kernels.value(), k0);
}

TEST(OptimizerStep, ReplicasWithDifferentGradientsAreAMismatchNotAHang) {
  Watchdog dog;
  // Replica 1's bias gets no gradient: its bucket holds one tensor less.
  EXPECT_THROW(dist::spawn(
                   [&](int r) {
                     nn::Linear fc = make_model();
                     lazy::optim::SGD opt(fc->parameters(), lazy::optim::SGDOptions(kLr));
                     const auto [x, y] = batch_of(r);
                     Tensor<float> pred = r == 1 ? lazy::matmul(x, lazy::transpose(fc->weight, 0, 1)) : fc(x);
                     nn::functional::mse_loss(pred, y).backward();
                     dist::optimizer_step(opt, true);
                   },
                   2),
               lazy::CollectiveMismatch);
}

TEST(OptimizerStep, GradientsOfDifferentParametersOfOneShapeAreAMismatch) {
  Watchdog dog;
  // Each replica has a gradient for one of two parameters of the same shape: the buckets
  // agree in count and shapes, and summing one's gradient into the other's would go
  // unnoticed unless the parameters themselves are compared.
  std::vector<std::string> caught(2);
  try {
    dist::spawn(
        [&](int r) {
          auto a = lazy::zeros<float>({4}).requires_grad_(),
               b = lazy::zeros<float>({4}).requires_grad_();
          lazy::optim::SGD opt({a, b}, lazy::optim::SGDOptions(kLr));
          lazy::sum((r == 0 ? a : b) * 2.0f).backward();
          try {
            dist::optimizer_step(opt, true);
            (void)a.to_vector();  // (the step's error surfaces at the next read)
          } catch (const lazy::CollectiveMismatch& e) {
            caught[static_cast<std::size_t>(r)] = e.what();
            throw;
          }
        },
        2);
    FAIL() << "expected a CollectiveMismatch";
  } catch (const lazy::CollectiveMismatch&) {
  }
  const std::string both = caught[0] + caught[1];
  EXPECT_NE(both.find("gradients of parameters 0"), std::string::npos) << both;
  EXPECT_NE(both.find("gradients of parameters 1"), std::string::npos) << both;
}

}  // namespace
