#pragma once
// Learning-rate schedulers, as torch.optim.lr_scheduler: each step() sets every group's
// learning rate from its base rate and the step count (closed forms, so resuming at any
// step gives the same rate). The rate is a scalar of the update kernels: a new rate never
// changes the plan.

#include <cmath>
#include <cstdint>
#include <numbers>
#include <string>
#include <vector>

#include <lazytensor/core/config.hpp>
#include <lazytensor/optim/optimizer.hpp>

namespace lazy::optim {

/// Base of the schedulers: remembers the base rates and counts steps.
class LRScheduler {
 public:
  explicit LRScheduler(Optimizer& opt);
  virtual ~LRScheduler() = default;
  /// Advances one step (one epoch, usually) and sets the new rates.
  void step() {
    ++count_;
    apply();
  }
  /// The rates set last.
  std::vector<double> get_last_lr() const;
  /// Steps taken so far.
  std::int64_t last_epoch() const { return count_; }
  /// Continues from `steps` steps taken (a resumed run): sets the rates of that step.
  void set_last_epoch(std::int64_t steps) {
    if (steps < 0) throw Error("LRScheduler::set_last_epoch: steps must be >= 0, got " + std::to_string(steps));
    count_ = steps;
    apply();
  }

 protected:
  virtual double rate(double base, std::int64_t step) const = 0;
  void apply();

 private:
  Optimizer& opt_;
  std::vector<double> base_;
  std::int64_t count_ = 0;
};

/// lr = base * gamma^(floor(step / step_size)).
class StepLR : public LRScheduler {
 public:
  StepLR(Optimizer& opt, std::int64_t step_size, double gamma = 0.1);

 protected:
  LAZYTENSOR_INLINE double rate(double base, std::int64_t s) const override;

 private:
  std::int64_t size_;
  double gamma_;
};

/// lr = eta_min + (base - eta_min) (1 + cos(pi step / T_max)) / 2.
class CosineAnnealingLR : public LRScheduler {
 public:
  CosineAnnealingLR(Optimizer& opt, std::int64_t T_max, double eta_min = 0);

 protected:
  LAZYTENSOR_INLINE double rate(double base, std::int64_t s) const override;

 private:
  std::int64_t T_;
  double min_;
};

/// lr = base * factor, factor going linearly from start_factor to end_factor over
/// total_iters steps and staying there.
class LinearLR : public LRScheduler {
 public:
  LinearLR(Optimizer& opt, double start_factor = 1.0 / 3, double end_factor = 1.0, std::int64_t total_iters = 5);

 protected:
  LAZYTENSOR_INLINE double rate(double base, std::int64_t s) const override;

 private:
  double start_, end_;
  std::int64_t total_;
};

#if LAZYTENSOR_HEADER_DEFINITIONS
LAZYTENSOR_INLINE LRScheduler::LRScheduler(Optimizer& opt) : opt_(opt) {
  for (std::size_t g = 0; g < opt.num_param_groups(); ++g) base_.push_back(opt.lr(g));
}

LAZYTENSOR_INLINE std::vector<double> LRScheduler::get_last_lr() const {
  std::vector<double> v;
  for (std::size_t g = 0; g < opt_.num_param_groups(); ++g) v.push_back(opt_.lr(g));
  return v;
}

LAZYTENSOR_INLINE void LRScheduler::apply() {
  for (std::size_t g = 0; g < base_.size(); ++g) opt_.set_lr(rate(base_[g], count_), g);
}

LAZYTENSOR_INLINE StepLR::StepLR(Optimizer& opt, std::int64_t step_size, double gamma)
    : LRScheduler(opt), size_(step_size), gamma_(gamma) {
  if (step_size <= 0) throw Error("StepLR: step_size must be positive, got " + std::to_string(step_size));
}

LAZYTENSOR_INLINE double StepLR::rate(double base, std::int64_t s) const {
  return base * std::pow(gamma_, static_cast<double>(s / size_));
}

LAZYTENSOR_INLINE CosineAnnealingLR::CosineAnnealingLR(Optimizer& opt, std::int64_t T_max, double eta_min)
    : LRScheduler(opt), T_(T_max), min_(eta_min) {
  if (T_max <= 0) throw Error("CosineAnnealingLR: T_max must be positive, got " + std::to_string(T_max));
}

LAZYTENSOR_INLINE double CosineAnnealingLR::rate(double base, std::int64_t s) const {
  return min_ + (base - min_) * (1 + std::cos(std::numbers::pi * static_cast<double>(s) / static_cast<double>(T_))) / 2;
}

LAZYTENSOR_INLINE LinearLR::LinearLR(Optimizer& opt, double start_factor, double end_factor, std::int64_t total_iters)
    : LRScheduler(opt), start_(start_factor), end_(end_factor), total_(total_iters) {
  if (start_factor <= 0 || start_factor > 1 || end_factor < 0 || end_factor > 1) {
    throw Error("LinearLR: expected 0 < start_factor <= 1 and 0 <= end_factor <= 1, got " +
                std::to_string(start_factor) + " and " + std::to_string(end_factor));
  }
  if (total_iters <= 0) throw Error("LinearLR: total_iters must be positive, got " + std::to_string(total_iters));
  // As torch, the first rate applies from construction on.
  for (std::size_t g = 0; g < opt.num_param_groups(); ++g) opt.set_lr(opt.lr(g) * start_factor, g);
}

LAZYTENSOR_INLINE double LinearLR::rate(double base, std::int64_t s) const {
  const double f = s >= total_ ? end_ : start_ + (end_ - start_) * static_cast<double>(s) / static_cast<double>(total_);
  return base * f;
}
#endif  // LAZYTENSOR_HEADER_DEFINITIONS

}  // namespace lazy::optim
