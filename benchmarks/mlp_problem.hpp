#pragma once
// The MLP training problem shared by bench_mlp_step and bench_replicas (not a benchmark
// itself): 784-256-128-10 with ReLU, mean cross entropy, SGD (lr 0.01, momentum 0.9), batches
// of 256, every implementation starting from the same weights.
//
// The batches are the first images of Fashion-MNIST's test split (pixels / 255) when the
// files are found ($LAZYTENSOR_FASHION_MNIST, else /usr/share/datasets/fashion-mnist), so the
// self-checks watch a loss that really falls; without them, random inputs and labels (the
// timings do not depend on the values: every kernel of the step is dense).

#include <array>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "bench_common.hpp"

#include <lazytensor/data/mnist.hpp>
#include <lazytensor/nn.hpp>
#include <lazytensor/optim.hpp>

namespace bench::mlp {

constexpr std::int64_t kBatch = 256;
constexpr std::array<std::int64_t, 4> kWidth = {784, 256, 128, 10};
constexpr float kLr = 0.01f, kMomentum = 0.9f;
/// Batches the problem holds (one per replica of bench_replicas).
constexpr int kMaxBatches = 2;

/// 2 * M * K * N summed over the GEMMs of one step: 3 forward (H = X W^T), 3 weight
/// gradients (dW = dH^T X) and the input gradients of layers 2 and 3 (dX = dH W; layer 1's
/// input needs none). 0.258 GFLOP.
constexpr std::int64_t gemm_flop() {
  std::int64_t f = 0;
  for (int l = 0; l < 3; ++l) {
    const std::int64_t mkn = kBatch * kWidth[l] * kWidth[l + 1];
    f += 2 * mkn;             // forward
    f += 2 * mkn;             // weight gradient
    if (l > 0) f += 2 * mkn;  // input gradient
  }
  return f;
}
constexpr std::int64_t kGemmFlop = gemm_flop();

/// Samples, labels and initial parameters (PyTorch's Linear init scale, U(+-1/sqrt(in))).
struct Problem {
  std::vector<float> x;         // [kMaxBatches * kBatch, 784]
  std::vector<std::int64_t> y;  // [kMaxBatches * kBatch]
  std::array<std::vector<float>, 3> w, b;
  std::string source;  // where x and y came from

  static const Problem& get() {
    static const Problem p;
    return p;
  }

  /// Batch `i`'s first input row and first label.
  const float* x_of(int i) const { return x.data() + i * kBatch * kWidth[0]; }
  const std::int64_t* y_of(int i) const { return y.data() + i * kBatch; }

 private:
  Problem() {
    const std::int64_t n = kMaxBatches * kBatch;
    const char* env = std::getenv("LAZYTENSOR_FASHION_MNIST");
    const std::string root = env ? env : "/usr/share/datasets/fashion-mnist";
    try {
      const lazy::data::MNIST ds(root, lazy::data::MNIST::Mode::Test);
      if (ds.rows() * ds.cols() != kWidth[0] || static_cast<std::int64_t>(ds.size()) < n)
        throw lazy::Error("unexpected image size or count");
      x.assign(ds.images().begin(), ds.images().begin() + n * kWidth[0]);
      for (auto& v : x) v /= 255.f;
      y.assign(ds.labels().begin(), ds.labels().begin() + n);
      source = "Fashion-MNIST test images 0.." + std::to_string(n - 1) + " from " + root;
    } catch (const lazy::Error& e) {
      x = random_vector(n * kWidth[0], 11);
      y.resize(static_cast<std::size_t>(n));
      std::mt19937 gen(12);
      std::uniform_int_distribution<std::int64_t> label(0, kWidth[3] - 1);
      for (auto& v : y) v = label(gen);
      source = std::string("random (Fashion-MNIST not read: ") + e.what() + ")";
    }
    for (int l = 0; l < 3; ++l) {
      const float bound = 1.f / std::sqrt(static_cast<float>(kWidth[l]));
      w[l] = random_vector(kWidth[l + 1] * kWidth[l], 20 + l);
      b[l] = random_vector(kWidth[l + 1], 30 + l);
      for (auto& v : w[l]) v *= bound;
      for (auto& v : b[l]) v *= bound;
    }
  }
};

/// The lazytensor model, optimizer and one batch on the current device.
struct LazyMlp {
  lazy::nn::Sequential model;
  lazy::optim::SGD opt;
  lazy::Tensor<float> x;
  lazy::Tensor<std::int64_t> y;

  /// Trains on samples [first, first + count) of the problem.
  LazyMlp(const Problem& p, std::int64_t first, std::int64_t count)
      : model(lazy::nn::Linear(kWidth[0], kWidth[1]), lazy::nn::ReLU(),
              lazy::nn::Linear(kWidth[1], kWidth[2]), lazy::nn::ReLU(),
              lazy::nn::Linear(kWidth[2], kWidth[3])),
        opt(model->parameters(), lazy::optim::SGDOptions(kLr).momentum(kMomentum)),
        x(lazy::from_vector<float>(std::vector<float>(p.x.begin() + first * kWidth[0],
                                                      p.x.begin() + (first + count) * kWidth[0]),
                                   lazy::Shape{count, kWidth[0]})),
        y(lazy::from_vector<std::int64_t>(
            std::vector<std::int64_t>(p.y.begin() + first, p.y.begin() + first + count),
            lazy::Shape{count})) {
    auto params = model->parameters();  // W1, b1, W2, b2, W3, b3
    lazy::NoGradGuard no_grad;
    for (int l = 0; l < 3; ++l) {
      params[2 * l].as<float>().copy_(lazy::from_vector<float>(p.w[l], lazy::Shape{kWidth[l + 1], kWidth[l]}));
      params[2 * l + 1].as<float>().copy_(lazy::from_vector<float>(p.b[l], lazy::Shape{kWidth[l + 1]}));
    }
    lazy::mark_step();
  }

  /// zero_grad, forward, loss, backward: the step up to the update (traced, not run). With
  /// `bf16_mixed`, the forward runs under autocast (precision "bf16-mixed").
  lazy::Tensor<float> forward_backward(bool bf16_mixed = false) {
    opt.zero_grad();
    lazy::Tensor<float> loss;
    {
      lazy::AutocastGuard autocast(bf16_mixed);
      loss = lazy::nn::functional::cross_entropy(model(x), y);
    }
    loss.backward();
    return loss;
  }

  /// Every parameter's values, in parameter order (materializes them).
  std::vector<float> flat_parameters() {
    std::vector<float> out;
    for (auto& p : model->parameters()) {
      const auto v = p.as<float>().to_vector();
      out.insert(out.end(), v.begin(), v.end());
    }
    return out;
  }
};

}  // namespace bench::mlp
