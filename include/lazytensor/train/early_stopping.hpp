#pragma once
// train::EarlyStopping, Lightning's: stops training when a monitored value stops improving
// for `patience` checks (by more than min_delta), reaches stopping_threshold, passes
// divergence_threshold, or (check_finite) is NaN or infinite. A check runs after each
// validation, or at the end of each training epoch when there is none (with
// check_val_every_n_epoch > 1, only after validations); only during a fit. The replicas
// agree on the stop (it holds when any of them decided it), so they all leave together.

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <string>

#include <lazytensor/core/config.hpp>
#include <lazytensor/core/error.hpp>
#include <lazytensor/train/callback.hpp>
#include <lazytensor/train/trainer.hpp>

namespace lazy::train {

/// EarlyStopping's arguments, in Lightning's order.
struct EarlyStoppingOptions {
  /// The callback metric to watch.
  std::string monitor = "";
  /// An improvement must beat the best value by more than this.
  double min_delta = 0.0;
  /// Checks without improvement before stopping.
  std::int64_t patience = 3;
  /// Print why training stops (global rank zero).
  bool verbose = false;
  /// "min" or "max": which values are better.
  std::string mode = "min";
  /// Error when the monitored value was not logged (false: skip the check).
  bool strict = true;
  /// Stop on a NaN or infinite value.
  bool check_finite = true;
  /// Stop once the value is better than this (strictly, as Lightning compares: in "min"
  /// mode a value equal to the threshold does not stop).
  std::optional<double> stopping_threshold = std::nullopt;
  /// Stop once the value is worse than this.
  std::optional<double> divergence_threshold = std::nullopt;
  /// Check at the end of the training epoch (true) or after validation (false); default:
  /// after validation in epochs that validate.
  std::optional<bool> check_on_train_epoch_end = std::nullopt;
};

/// Lightning's EarlyStopping (see the file comment).
/// A class template (the parameter is unused; use EarlyStopping) so that a program that never
/// constructs one compiles none of it.
template <class = void>
class BasicEarlyStopping : public Callback {
 public:
  /// The usual name, which derived classes inherit (as they would a non-template base's).
  using EarlyStopping = BasicEarlyStopping;

  /// Error for an empty monitor, an invalid mode, or a negative patience or min_delta.
  explicit BasicEarlyStopping(EarlyStoppingOptions options);

  std::shared_ptr<Callback> clone() const override { return std::make_shared<BasicEarlyStopping>(*this); }
  bool monitors() const override { return true; }
  std::string state_key() const override { return "EarlyStopping{monitor=" + options_.monitor + ",mode=" + options_.mode + "}"; }
  std::map<std::string, std::string> state_dict() const override;
  void load_state_dict(const std::map<std::string, std::string>& state) override;

  void on_train_epoch_start(Trainer& trainer, LightningModuleBase& module) override;
  void on_validation_end(Trainer& trainer, LightningModuleBase& module) override;
  void on_train_epoch_end(Trainer& trainer, LightningModuleBase& module) override;

  const EarlyStoppingOptions& options() const { return options_; }
  /// Checks in a row without improvement.
  std::int64_t wait_count() const { return wait_count_; }
  /// The best value so far (+inf / -inf before the first check).
  double best_score() const { return best_score_; }
  /// The epoch training stopped in (0 when it did not).
  std::int64_t stopped_epoch() const { return stopped_epoch_; }
  /// Why it stopped ("" when it did not).
  const std::string& stopping_reason() const { return reason_; }

  /// Evaluates `current` against the criteria: (stop, reason). Updates best and wait.
  std::pair<bool, std::string> evaluate(double current);

 private:
  void check(Trainer& trainer);
  bool better(double a, double b) const { return options_.mode == "min" ? a < b : a > b; }

  EarlyStoppingOptions options_;
  std::int64_t wait_count_ = 0;
  std::int64_t stopped_epoch_ = 0;
  double best_score_;
  std::string reason_;
  bool validated_this_epoch_ = false;
};

/// Lightning's EarlyStopping (see BasicEarlyStopping).
using EarlyStopping = BasicEarlyStopping<>;

#if LAZYTENSOR_HEADER_DEFINITIONS

template <class V>
BasicEarlyStopping<V>::BasicEarlyStopping(EarlyStoppingOptions options) : options_(std::move(options)) {
  if (options_.monitor.empty()) throw Error("EarlyStopping: monitor names no metric");
  if (options_.mode != "min" && options_.mode != "max")
    throw Error("EarlyStopping: mode must be \"min\" or \"max\", got \"" + options_.mode + "\"");
  if (options_.patience < 0) throw Error("EarlyStopping: patience must be >= 0, got " + std::to_string(options_.patience));
  if (!(options_.min_delta >= 0)) throw Error("EarlyStopping: min_delta must be >= 0, got " + std::to_string(options_.min_delta));
  best_score_ = options_.mode == "min" ? std::numeric_limits<double>::infinity() : -std::numeric_limits<double>::infinity();
}

template <class V>
std::map<std::string, std::string> BasicEarlyStopping<V>::state_dict() const {
  return {{"wait_count", std::to_string(wait_count_)},
          {"stopped_epoch", std::to_string(stopped_epoch_)},
          {"best_score", detail::double_text(best_score_)},
          {"patience", std::to_string(options_.patience)}};
}

template <class V>
void BasicEarlyStopping<V>::load_state_dict(const std::map<std::string, std::string>& s) {
  if (s.empty()) return;
  const auto get = [&](const char* k) {
    const auto it = s.find(k);
    if (it == s.end()) throw Error(std::string("EarlyStopping::load_state_dict: missing \"") + k + "\"");
    return it->second;
  };
  wait_count_ = detail::parse_int(get("wait_count"), "EarlyStopping state");
  stopped_epoch_ = detail::parse_int(get("stopped_epoch"), "EarlyStopping state");
  best_score_ = detail::parse_double(get("best_score"), "EarlyStopping state");
}

template <class V>
std::pair<bool, std::string> BasicEarlyStopping<V>::evaluate(double current) {
  const auto& o = options_;
  const auto text = [](double v) { return detail::double_text(v); };
  if (o.check_finite && !std::isfinite(current)) {
    return {true, "Monitored metric " + o.monitor + " = " + text(current) + " is not finite. Previous best value was " +
                      text(best_score_) + ". Signaling Trainer to stop."};
  }
  if (o.stopping_threshold && better(current, *o.stopping_threshold)) {
    return {true, "Stopping threshold reached: " + o.monitor + " = " + text(current) +
                      (o.mode == "min" ? " < " : " > ") + text(*o.stopping_threshold) +
                      ". Signaling Trainer to stop."};
  }
  if (o.divergence_threshold && better(*o.divergence_threshold, current)) {
    return {true, "Divergence threshold reached: " + o.monitor + " = " + text(current) + " is worse than " +
                      text(*o.divergence_threshold) + ". Signaling Trainer to stop."};
  }
  const double shifted = o.mode == "min" ? current + o.min_delta : current - o.min_delta;
  if (better(shifted, best_score_)) {
    best_score_ = current;
    wait_count_ = 0;
    return {false, ""};
  }
  ++wait_count_;
  if (wait_count_ >= o.patience) {
    return {true, "Monitored metric " + o.monitor + " did not improve in the last " + std::to_string(wait_count_) +
                      " records. Best score: " + text(best_score_) + ". Signaling Trainer to stop."};
  }
  return {false, ""};
}

template <class V>
void BasicEarlyStopping<V>::check(Trainer& trainer) {
  // Only a fit stops early (Lightning's rule): a validate() of its own leaves the state alone.
  if (!trainer.fitting() || trainer.sanity_checking() || trainer.fast_dev_run()) return;
  const auto& metrics = trainer.callback_metrics();
  const auto it = metrics.find(options_.monitor);
  bool stop = false;
  std::string why;
  if (it == metrics.end()) {
    if (options_.strict) {
      std::string known;
      for (const auto& [k, v] : metrics) known += (known.empty() ? "" : ", ") + k;
      throw Error("EarlyStopping: the monitored value \"" + options_.monitor + "\" was not logged (callback metrics: " +
                  known + ")");
    }
  } else {
    std::tie(stop, why) = evaluate(it->second);
  }
  // A stop decided on any replica stops every one of them.
  const bool any = trainer.strategy().reduce_boolean_decision(stop, false);
  if (any) {
    trainer.set_should_stop(true);
    stopped_epoch_ = trainer.current_epoch();
    reason_ = why.empty() ? std::string("another replica signaled a stop") : why;
    if (options_.verbose && trainer.is_global_zero()) std::fprintf(stderr, "EarlyStopping: %s\n", reason_.c_str());
  }
}

template <class V>
void BasicEarlyStopping<V>::on_train_epoch_start(Trainer&, LightningModuleBase&) { validated_this_epoch_ = false; }

template <class V>
void BasicEarlyStopping<V>::on_validation_end(Trainer& trainer, LightningModuleBase&) {
  if (!trainer.fitting() || trainer.sanity_checking()) return;
  validated_this_epoch_ = true;
  if (!options_.check_on_train_epoch_end.value_or(false)) check(trainer);
}

template <class V>
void BasicEarlyStopping<V>::on_train_epoch_end(Trainer& trainer, LightningModuleBase&) {
  // By default an epoch that did not validate checks here only when the fit validates every
  // epoch or never: with check_val_every_n_epoch > 1 it waits for the next validation (as
  // Lightning's), so a monitored validation value is neither missing nor last validation's.
  const bool by_default =
      !validated_this_epoch_ &&
      (trainer.num_val_batches() == 0 || trainer.options().check_val_every_n_epoch == 1);
  if (options_.check_on_train_epoch_end.value_or(by_default)) check(trainer);
}

#endif  // LAZYTENSOR_HEADER_DEFINITIONS

}  // namespace lazy::train

// Defined once by lazytensor::compiled (src/compiled.cpp).
#define LAZYTENSOR_TRAIN_EARLY_STOPPING_INSTANCES(P) P template class lazy::train::BasicEarlyStopping<void>;
#if LAZYTENSOR_EXPLICIT_INSTANTIATION
LAZYTENSOR_TRAIN_EARLY_STOPPING_INSTANCES(extern)
#endif
