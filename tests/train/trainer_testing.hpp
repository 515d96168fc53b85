#pragma once
// Shared by the Trainer tests (tests/train/test_trainer*.cpp): a small classification
// problem, an MLP LightningModule over it that records what the Trainer makes it do, and a
// hand-written loop as the reference.

#include <unistd.h>

#include <gtest/gtest.h>

#include <atomic>
#include <cstdint>
#include <filesystem>
#include <string>
#include <utility>
#include <vector>

#include <lazytensor/data.hpp>
#include <lazytensor/nn.hpp>
#include <lazytensor/optim.hpp>
#include <lazytensor/train.hpp>

#include "testing/helpers.hpp"

namespace trainer_testing {

using Dataset = lazy::data::TensorDataset<float, std::int64_t>;
using Batch = Dataset::example_type;

/// A new empty directory in the process's scratch directory (removed at exit), named after `tag`.
inline std::string temp_dir(const std::string& tag) {
  static std::atomic<int> counter{0};
  return lazy_tests::scratch_subdir(tag + "_" + std::to_string(counter++));  // new: one per call
}

/// `n` samples of 6 features in 3 classes (a fixed random problem).
inline Dataset make_dataset(std::int64_t n = 64, unsigned seed = 3) {
  const auto x = lazy_tests::random_values<float>(static_cast<std::size_t>(n * 6), seed);
  std::vector<std::int64_t> y(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) {
    const float s = x[static_cast<std::size_t>(i * 6)] + x[static_cast<std::size_t>(i * 6 + 1)];
    y[static_cast<std::size_t>(i)] = s < -0.3f ? 0 : (s < 0.3f ? 1 : 2);
  }
  return Dataset(lazy::from_vector<float>(x, {n, 6}), lazy::from_vector<std::int64_t>(y, {n}));
}

/// What the module saw.
struct Record {
  std::vector<double> losses;  // every training_step's loss, read after the fit
  std::vector<lazy::Tensor<float>> loss_tensors;
  std::int64_t train_steps = 0, val_steps = 0, test_steps = 0;
  std::vector<std::string> hooks;
};

/// A two-layer MLP classifier; logs "train_loss" (step and epoch) and "val_loss".
class Classifier : public lazy::train::LightningModule<Batch> {
 public:
  explicit Classifier(double lr = 0.1, unsigned seed = 7) : lr_(lr) {
    lazy::set_rng_state(seed);
    fc1 = register_module("fc1", lazy::nn::Linear(6, 16));
    fc2 = register_module("fc2", lazy::nn::Linear(16, 3));
  }

  lazy::Tensor<float> forward(const lazy::Tensor<float>& x) { return fc2(lazy::Tensor<float>(lazy::relu(fc1(x)))); }

  lazy::AnyTensor training_step(const Batch& b, std::int64_t) override {
    ++record.train_steps;
    auto loss = lazy::nn::functional::cross_entropy(forward(b.data), b.target);
    record.loss_tensors.push_back(loss.detach());
    log("train_loss", loss, {.prog_bar = true, .on_step = true, .on_epoch = true});
    return loss;
  }
  void validation_step(const Batch& b, std::int64_t) override {
    ++record.val_steps;
    log("val_loss", lazy::nn::functional::cross_entropy(forward(b.data), b.target));
  }
  void test_step(const Batch& b, std::int64_t) override {
    ++record.test_steps;
    log("test_loss", lazy::nn::functional::cross_entropy(forward(b.data), b.target));
  }
  lazy::AnyTensor predict_step(const Batch& b, std::int64_t) override { return lazy::argmax(forward(b.data), 1); }
  lazy::train::OptimizerConfig configure_optimizers() override {
    return {std::make_shared<lazy::optim::SGD>(parameters(), lazy::optim::SGDOptions(lr_).momentum(0.9))};
  }
  void on_train_epoch_start() override { record.hooks.push_back("epoch_start"); }
  void on_train_epoch_end() override { record.hooks.push_back("epoch_end"); }

  /// The recorded step losses as numbers.
  std::vector<double> losses() const {
    std::vector<double> r;
    for (const auto& t : record.loss_tensors) r.push_back(t.item());
    return r;
  }

  lazy::nn::Linear fc1{nullptr}, fc2{nullptr};
  Record record;

 private:
  double lr_;
};

/// Options for a quiet single-device run: no logger, checkpoints or progress bar.
inline lazy::train::TrainerOptions quiet(lazy::train::TrainerOptions o = {}) {
  o.logger = false;
  o.enable_checkpointing = false;
  o.enable_progress_bar = false;
  o.num_sanity_val_steps = 0;
  return o;
}

/// Every parameter's values, in order.
inline std::vector<std::vector<float>> weights(const lazy::nn::Module& m) {
  std::vector<std::vector<float>> r;
  for (const auto& p : m.parameters()) r.push_back(p.as<float>().to_vector());
  return r;
}

}  // namespace trainer_testing
