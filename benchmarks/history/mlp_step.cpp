// One MLP training step (784-256-128-10, batch 256, cross entropy, SGD with momentum),
// timed as the median of batches of 20 steps. Written against the API every revision since
// the training issue shares, so scripts/mlp_step_vs_revision.sh can build it against an
// older checkout and compare like with like (not a Google Benchmark: the old headers have
// no thread-count API, LAZYTENSOR_NUM_THREADS sets it for both).

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <random>
#include <vector>

#include <lazytensor/lazytensor.hpp>
#include <lazytensor/nn.hpp>
#include <lazytensor/optim.hpp>

namespace {

std::vector<float> uniform(std::int64_t n, unsigned seed, float bound) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> dist(-bound, bound);
  std::vector<float> v(static_cast<std::size_t>(n));
  for (auto& x : v) x = dist(gen);
  return v;
}

}  // namespace

int main() {
  constexpr std::int64_t kBatch = 256, kIn = 784, kHidden1 = 256, kHidden2 = 128, kClasses = 10;
  constexpr int kSteps = 20, kBatches = 9, kRounds = 5;
  lazy::nn::Sequential model(lazy::nn::Linear(kIn, kHidden1), lazy::nn::ReLU(),
                             lazy::nn::Linear(kHidden1, kHidden2), lazy::nn::ReLU(),
                             lazy::nn::Linear(kHidden2, kClasses));
  lazy::optim::SGD opt(model->parameters(), lazy::optim::SGDOptions(0.01).momentum(0.9));
  const auto x = lazy::from_vector<float>(uniform(kBatch * kIn, 1, 1.f), lazy::Shape{kBatch, kIn});
  std::vector<std::int64_t> labels(kBatch);
  for (std::int64_t i = 0; i < kBatch; ++i) labels[static_cast<std::size_t>(i)] = i % kClasses;
  const auto y = lazy::from_vector<std::int64_t>(labels, lazy::Shape{kBatch});
  lazy::mark_step();
  auto step = [&] {
    opt.zero_grad();
    lazy::Tensor<float> loss = lazy::nn::functional::cross_entropy(model(x), y);
    loss.backward();
    opt.step();
    lazy::mark_step();
    return loss;
  };
  for (int i = 0; i < kSteps; ++i) step();  // warm-up: plans, pool, page faults
  lazy::wait_device_ops();
  std::vector<double> medians;
  for (int r = 0; r < kRounds; ++r) {
    std::vector<double> ms;
    for (int b = 0; b < kBatches; ++b) {
      const auto t0 = std::chrono::steady_clock::now();
      lazy::Tensor<float> loss;
      for (int i = 0; i < kSteps; ++i) loss = step();
      const float value = loss.item();  // waits for the last step
      ms.push_back(
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() /
          kSteps);
      if (!(value >= 0.f)) {
        std::fprintf(stderr, "mlp_step: loss %f is not a number >= 0\n", value);
        return 1;
      }
    }
    std::sort(ms.begin(), ms.end());
    medians.push_back(ms[kBatches / 2]);
  }
  std::sort(medians.begin(), medians.end());
  std::printf("%.4f\n", medians[kRounds / 2]);  // ms per step, median of the rounds' medians
  return 0;
}
