#pragma once
// train::LearningRateMonitor, Lightning's: sends the optimizer's learning rate(s) to the
// logger, as "lr-<Optimizer>" ("lr-<Optimizer>/pg<i>" with several parameter groups), at
// the start of every epoch ("epoch") or at every logging step ("step"; default: as the
// schedulers' intervals say, at both when some step per epoch and others per step).

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>

#include <lazytensor/core/config.hpp>
#include <lazytensor/core/error.hpp>
#include <lazytensor/train/callback.hpp>
#include <lazytensor/train/trainer.hpp>

namespace lazy::train {

/// Lightning's LearningRateMonitor (see the file comment).
/// A class template (the parameter is unused; use LearningRateMonitor) so that a program that never
/// constructs one compiles none of it.
template <class = void>
class BasicLearningRateMonitor : public Callback {
 public:
  /// The usual name, which derived classes inherit (as they would a non-template base's).
  using LearningRateMonitor = BasicLearningRateMonitor;

  /// `logging_interval`: "epoch", "step", or nullopt (each interval some scheduler steps
  /// at, as Lightning's; "epoch" without a scheduler).
  explicit BasicLearningRateMonitor(std::optional<std::string> logging_interval = std::nullopt);

  std::shared_ptr<Callback> clone() const override { return std::make_shared<BasicLearningRateMonitor>(*this); }
  std::string state_key() const override { return "LearningRateMonitor"; }

  void on_fit_start(Trainer& trainer, LightningModuleBase& module) override;
  void on_train_epoch_start(Trainer& trainer, LightningModuleBase& module) override;
  void on_train_batch_end(Trainer& trainer, LightningModuleBase& module, std::int64_t batch_idx) override;

  /// The rates as logged: name -> rate.
  static std::map<std::string, double> rates(const optim::Optimizer& optimizer);

 private:
  /// Whether the rates are logged at `interval` ("epoch" or "step").
  bool logs_at(const Trainer& trainer, const std::string& interval) const;
  void log(Trainer& trainer);

  std::optional<std::string> interval_;
  std::int64_t last_step_ = -1;
};

/// Lightning's LearningRateMonitor (see BasicLearningRateMonitor).
using LearningRateMonitor = BasicLearningRateMonitor<>;

#if LAZYTENSOR_HEADER_DEFINITIONS

template <class V>
BasicLearningRateMonitor<V>::BasicLearningRateMonitor(std::optional<std::string> logging_interval)
    : interval_(std::move(logging_interval)) {
  if (interval_ && *interval_ != "epoch" && *interval_ != "step")
    throw Error("LearningRateMonitor: logging_interval must be \"epoch\" or \"step\", got \"" + *interval_ + "\"");
}

template <class V>
std::map<std::string, double> BasicLearningRateMonitor<V>::rates(const optim::Optimizer& optimizer) {
  std::map<std::string, double> out;
  const std::size_t groups = optimizer.num_param_groups();
  for (std::size_t g = 0; g < groups; ++g) {
    std::string key = "lr-" + optimizer.name();
    if (groups > 1) key += "/pg" + std::to_string(g + 1);
    out[key] = optimizer.lr(g);
  }
  return out;
}

template <class V>
bool BasicLearningRateMonitor<V>::logs_at(const Trainer& trainer,
                                          const std::string& interval) const {
  if (interval_) return *interval_ == interval;
  const auto& configs = trainer.lr_scheduler_configs();
  if (configs.empty()) return interval == "epoch";
  for (const auto& c : configs)
    if (c.interval == interval) return true;
  return false;
}

template <class V>
void BasicLearningRateMonitor<V>::on_fit_start(Trainer& trainer, LightningModuleBase&) {
  if (!trainer.logger())
    throw Error("LearningRateMonitor: the Trainer has no logger to send the learning rates to (logger = false)");
}

template <class V>
void BasicLearningRateMonitor<V>::log(Trainer& trainer) {
  if (!trainer.is_global_zero() || !trainer.logger()) return;
  trainer.logger()->log_metrics(rates(trainer.optimizer()), trainer.global_step());
}

template <class V>
void BasicLearningRateMonitor<V>::on_train_epoch_start(Trainer& trainer, LightningModuleBase&) {
  if (logs_at(trainer, "epoch")) log(trainer);
}

template <class V>
void BasicLearningRateMonitor<V>::on_train_batch_end(Trainer& trainer, LightningModuleBase&, std::int64_t) {
  if (!logs_at(trainer, "step") || trainer.global_step() == last_step_) return;
  if (trainer.global_step() % trainer.options().log_every_n_steps != 0) return;
  last_step_ = trainer.global_step();
  log(trainer);
}

#endif  // LAZYTENSOR_HEADER_DEFINITIONS

}  // namespace lazy::train

// Defined once by lazytensor::compiled (src/compiled.cpp).
#define LAZYTENSOR_TRAIN_LR_MONITOR_INSTANCES(P) P template class lazy::train::BasicLearningRateMonitor<void>;
#if LAZYTENSOR_EXPLICIT_INSTANTIATION
LAZYTENSOR_TRAIN_LR_MONITOR_INSTANCES(extern)
#endif
