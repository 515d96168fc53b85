#pragma once
// train::LearningRateMonitor, Lightning's: sends the optimizer's learning rate(s) to the
// logger, as "lr-<Optimizer>" ("lr-<Optimizer>/pg<i>" with several parameter groups), at
// the start of every epoch ("epoch") or at every logging step ("step"; default: both as
// the scheduler's interval says).

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
class LearningRateMonitor : public Callback {
 public:
  /// `logging_interval`: "epoch", "step", or nullopt (the scheduler's interval; "epoch"
  /// without a scheduler).
  explicit LearningRateMonitor(std::optional<std::string> logging_interval = std::nullopt);

  std::shared_ptr<Callback> clone() const override { return std::make_shared<LearningRateMonitor>(*this); }
  std::string state_key() const override { return "LearningRateMonitor"; }

  LAZYTENSOR_INLINE void on_fit_start(Trainer& trainer, LightningModuleBase& module) override;
  LAZYTENSOR_INLINE void on_train_epoch_start(Trainer& trainer, LightningModuleBase& module) override;
  LAZYTENSOR_INLINE void on_train_batch_end(Trainer& trainer, LightningModuleBase& module, std::int64_t batch_idx) override;

  /// The rates as logged: name -> rate.
  static std::map<std::string, double> rates(const optim::Optimizer& optimizer);

 private:
  std::string interval(const Trainer& trainer) const;
  void log(Trainer& trainer);

  std::optional<std::string> interval_;
  std::int64_t last_step_ = -1;
};

#if LAZYTENSOR_HEADER_DEFINITIONS

LAZYTENSOR_INLINE LearningRateMonitor::LearningRateMonitor(std::optional<std::string> logging_interval)
    : interval_(std::move(logging_interval)) {
  if (interval_ && *interval_ != "epoch" && *interval_ != "step")
    throw Error("LearningRateMonitor: logging_interval must be \"epoch\" or \"step\", got \"" + *interval_ + "\"");
}

LAZYTENSOR_INLINE std::map<std::string, double> LearningRateMonitor::rates(const optim::Optimizer& optimizer) {
  std::map<std::string, double> out;
  const std::size_t groups = optimizer.num_param_groups();
  for (std::size_t g = 0; g < groups; ++g) {
    std::string key = "lr-" + optimizer.name();
    if (groups > 1) key += "/pg" + std::to_string(g + 1);
    out[key] = optimizer.lr(g);
  }
  return out;
}

LAZYTENSOR_INLINE std::string LearningRateMonitor::interval(const Trainer& trainer) const {
  if (interval_) return *interval_;
  return trainer.lr_scheduler() ? trainer.lr_scheduler_interval() : std::string("epoch");
}

LAZYTENSOR_INLINE void LearningRateMonitor::on_fit_start(Trainer& trainer, LightningModuleBase&) {
  if (!trainer.logger())
    throw Error("LearningRateMonitor: the Trainer has no logger to send the learning rates to (logger = false)");
}

LAZYTENSOR_INLINE void LearningRateMonitor::log(Trainer& trainer) {
  if (!trainer.is_global_zero() || !trainer.logger()) return;
  trainer.logger()->log_metrics(rates(trainer.optimizer()), trainer.global_step());
}

LAZYTENSOR_INLINE void LearningRateMonitor::on_train_epoch_start(Trainer& trainer, LightningModuleBase&) {
  if (interval(trainer) == "epoch") log(trainer);
}

LAZYTENSOR_INLINE void LearningRateMonitor::on_train_batch_end(Trainer& trainer, LightningModuleBase&, std::int64_t) {
  if (interval(trainer) != "step" || trainer.global_step() == last_step_) return;
  if (trainer.global_step() % trainer.options().log_every_n_steps != 0) return;
  last_step_ = trainer.global_step();
  log(trainer);
}

#endif  // LAZYTENSOR_HEADER_DEFINITIONS

}  // namespace lazy::train
