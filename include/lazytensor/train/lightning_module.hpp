#pragma once
// train::LightningModule, Lightning's: an nn::Module that also says how it trains. The
// Trainer calls training_step for every batch, validation_step / test_step /
// predict_step in its evaluation loops, configure_optimizers once per fit, and the hooks
// around epochs and batches; the steps report numbers with log().
//
// C++ needs the batch's type: a module derives from LightningModule<Batch>, where Batch is
// what its loader yields (data::Example<Tensor<float>, Tensor<std::int64_t>> for a
// TensorDataset or MNIST loader). The Trainer, callbacks and loggers see the non-template
// base, LightningModuleBase.

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <lazytensor/any_tensor.hpp>
#include <lazytensor/core/config.hpp>
#include <lazytensor/core/error.hpp>
#include <lazytensor/nn/module.hpp>
#include <lazytensor/optim/lr_scheduler.hpp>
#include <lazytensor/optim/optimizer.hpp>
#include <lazytensor/state_dict.hpp>
#include <lazytensor/train/metrics.hpp>

namespace lazy::train {

class Trainer;

/// One learning-rate scheduler and when the Trainer steps it: every `frequency` epochs
/// (`interval` "epoch") or optimizer steps ("step"), as Lightning's lr_scheduler config
/// dict.
struct SchedulerConfig {
  std::shared_ptr<optim::LRScheduler> scheduler;
  std::string interval = "epoch";
  std::int64_t frequency = 1;
};

/// What configure_optimizers returns: the optimizer, and optionally learning-rate
/// schedulers on it: `lr_scheduler` with `interval` and `frequency` (Lightning's
/// {"optimizer": ..., "lr_scheduler": {...}}), and any number more in `lr_schedulers`
/// (Lightning's `return [optimizer], [scheduler, ...]`). The Trainer steps each at its own
/// interval and frequency, in that order. (One optimizer: Lightning trains several only
/// with manual optimization, which lazytensor's Trainer does not have.)
struct OptimizerConfig {
  std::shared_ptr<optim::Optimizer> optimizer;
  std::shared_ptr<optim::LRScheduler> lr_scheduler = nullptr;
  std::string interval = "epoch";
  std::int64_t frequency = 1;
  std::vector<SchedulerConfig> lr_schedulers = {};
};

namespace detail {
/// Thrown by the default evaluation steps; the Trainer turns it into an Error naming the
/// loop that needs the step.
struct StepNotOverridden {
  const char* step;
};
}  // namespace detail

/// The part of a LightningModule that does not depend on the batch type: optimizers,
/// hooks, logging, and where the run stands.
class LightningModuleBase : public nn::Module {
 public:
  /// `name` is what printing shows.
  explicit LightningModuleBase(std::string name = "LightningModule") : nn::Module(std::move(name)) {}

  /// The optimizer (and scheduler) over this module's parameters. Called once per fit,
  /// after the strategy's setup, so the parameters are already on their device and dtype.
  virtual OptimizerConfig configure_optimizers() = 0;

  // ---- hooks (Lightning's names; each runs on every replica) ----------------------------

  virtual void on_fit_start() {}
  virtual void on_fit_end() {}
  virtual void on_train_start() {}
  virtual void on_train_end() {}
  virtual void on_train_epoch_start() {}
  virtual void on_train_epoch_end() {}
  virtual void on_train_batch_start(std::int64_t batch_idx) { (void)batch_idx; }
  virtual void on_train_batch_end(std::int64_t batch_idx) { (void)batch_idx; }
  virtual void on_validation_epoch_start() {}
  virtual void on_validation_epoch_end() {}
  virtual void on_test_epoch_start() {}
  virtual void on_test_epoch_end() {}
  /// Called before each optimizer step, after the gradients of its batches are complete.
  virtual void on_before_optimizer_step(optim::Optimizer& optimizer) { (void)optimizer; }
  /// Adds entries to a checkpoint being saved (tensors, or metadata strings).
  virtual void on_save_checkpoint(StateDict& checkpoint) { (void)checkpoint; }
  /// Reads back what on_save_checkpoint added.
  virtual void on_load_checkpoint(const StateDict& checkpoint) { (void)checkpoint; }

  // ---- logging ---------------------------------------------------------------------------

  /// Records a one-element floating tensor (Lightning's self.log). Inside training_step
  /// it is kept per step by default (`on_step`), in the evaluation steps averaged over the
  /// epoch (`on_epoch`); see LogOptions. The value stays on the device: nothing is read
  /// until a logger, the progress bar or a callback needs it. Error outside a Trainer's
  /// loop, for a non-floating tensor, or one of more than one element.
  void log(const std::string& name, const AnyTensor& value, const LogOptions& options = {}) {
    metrics().log(name, value, options);
  }
  /// log() of a host number.
  void log(const std::string& name, double value, const LogOptions& options = {}) {
    metrics().log(name, value, options);
  }
  /// log() of each entry.
  void log_dict(const std::map<std::string, AnyTensor>& values, const LogOptions& options = {}) {
    for (const auto& [name, v] : values) log(name, v, options);
  }

  // ---- where the run stands --------------------------------------------------------------

  /// The Trainer running this module (Error outside fit/validate/test/predict).
  Trainer& trainer() const {
    if (!trainer_) throw Error("LightningModule::trainer(): the module is not attached to a Trainer");
    return *trainer_;
  }
  /// The current epoch (0-based), as the Trainer's.
  std::int64_t current_epoch() const { return progress_ ? progress_->epoch : 0; }
  /// Optimizer steps taken so far, as the Trainer's.
  std::int64_t global_step() const { return progress_ ? progress_->global_step : 0; }

  /// Hyper-parameters (Lightning's save_hyperparameters): written by the logger to
  /// hparams.yaml and into every checkpoint's metadata.
  std::map<std::string, std::string> hparams;

 private:
  friend class Trainer;
  detail::MetricStore& metrics() const {
    if (!metrics_) throw Error("LightningModule::log: called outside a Trainer's loop");
    return *metrics_;
  }
  Trainer* trainer_ = nullptr;
  detail::MetricStore* metrics_ = nullptr;
  const detail::Progress* progress_ = nullptr;
};

/// A LightningModule over batches of type `Batch`.
template <class Batch>
class LightningModule : public LightningModuleBase {
 public:
  using batch_type = Batch;
  using LightningModuleBase::LightningModuleBase;

  /// The loss of one training batch (a one-element floating tensor); the Trainer runs its
  /// backward pass and the optimizer step.
  virtual AnyTensor training_step(const Batch& batch, std::int64_t batch_idx) = 0;
  /// One validation batch: log what to monitor. Needed when fit gets a validation loader
  /// or validate() runs.
  virtual void validation_step(const Batch& batch, std::int64_t batch_idx) {
    (void)batch, (void)batch_idx;
    throw detail::StepNotOverridden{"validation_step"};
  }
  /// One test batch (Trainer::test).
  virtual void test_step(const Batch& batch, std::int64_t batch_idx) {
    (void)batch, (void)batch_idx;
    throw detail::StepNotOverridden{"test_step"};
  }
  /// The prediction for one batch (Trainer::predict collects them).
  virtual AnyTensor predict_step(const Batch& batch, std::int64_t batch_idx) {
    (void)batch, (void)batch_idx;
    throw detail::StepNotOverridden{"predict_step"};
  }
};

}  // namespace lazy::train
