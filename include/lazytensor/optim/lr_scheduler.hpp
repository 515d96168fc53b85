#pragma once
// Learning-rate schedulers, as torch.optim.lr_scheduler. They chain as torch's do: step()
// multiplies each group's current rate by the step's factor (torch's get_lr), so schedulers
// built on one optimizer compose, and a rate set by hand between steps is kept.
// set_last_epoch (a resumed run) sets the closed form of that step instead (torch's
// _get_closed_form_lr), from each group's initial rate: recorded on the optimizer by the
// first scheduler built on it (torch's param_group["initial_lr"]), read by later ones.
// The rate is a scalar of the update kernels: a new rate never changes the plan.

#include <cmath>
#include <cstdint>
#include <numbers>
#include <string>
#include <vector>

#include <lazytensor/core/config.hpp>
#include <lazytensor/optim/optimizer.hpp>

namespace lazy::optim {

/// Base of the schedulers: counts steps and keeps each group's initial (base) rate.
/// A group added to the optimizer after construction joins at the next step or
/// set_last_epoch: its rate then becomes its initial rate (unless another scheduler
/// recorded one), and it gets that step's factor like every group (as torch's chainable
/// step, which acts on every group the optimizer has).
class LRScheduler {
 public:
  explicit LRScheduler(Optimizer& opt) : opt_(opt) {}
  virtual ~LRScheduler() = default;
  /// Advances one step (one epoch, usually): multiplies every group's current rate by this
  /// step's factor.
  void step();
  /// The rates this scheduler set at its last step (or construction), as torch's get_last_lr;
  /// the optimizer's may differ since (another scheduler, or set_lr).
  std::vector<double> get_last_lr() const { return last_; }
  /// Steps taken so far.
  std::int64_t last_epoch() const { return count_; }
  /// Continues from `steps` steps taken (a resumed run): sets the closed-form rates of that
  /// step from the initial rates, whatever the current ones.
  void set_last_epoch(std::int64_t steps);

 protected:
  /// The rate after step `s` of a group at rate `lr` with initial rate `base` (torch's
  /// chainable get_lr; s == 0 is the rate set at construction).
  virtual double chained(double lr, double base, std::int64_t s) const = 0;
  /// The rate at step `s` of a group with initial rate `base` (torch's _get_closed_form_lr).
  virtual double closed_form(double base, std::int64_t s) const = 0;
  /// Records the initial rates and sets the rates of step 0: the last line of a derived
  /// constructor, after its checks, so a refused scheduler leaves the optimizer alone.
  void start();

 private:
  /// Initial rates of the groups not seen yet (torch's setdefault of "initial_lr").
  void adopt_groups();
  void record_last();

  Optimizer& opt_;
  std::vector<double> base_;
  std::vector<double> last_;
  std::int64_t count_ = 0;
};

/// Every step_size steps, lr *= gamma (closed form: base * gamma^(floor(step / step_size))).
class StepLR : public LRScheduler {
 public:
  StepLR(Optimizer& opt, std::int64_t step_size, double gamma = 0.1);

 protected:
  LAZYTENSOR_INLINE double chained(double lr, double base, std::int64_t s) const override;
  LAZYTENSOR_INLINE double closed_form(double base, std::int64_t s) const override;

 private:
  std::int64_t size_;
  double gamma_;
};

/// Cosine annealing, closed form eta_min + (base - eta_min) (1 + cos(pi step / T_max)) / 2;
/// a step scales the rate's distance to eta_min by the ratio of consecutive (1 + cos) terms.
class CosineAnnealingLR : public LRScheduler {
 public:
  CosineAnnealingLR(Optimizer& opt, std::int64_t T_max, double eta_min = 0);

 protected:
  LAZYTENSOR_INLINE double chained(double lr, double base, std::int64_t s) const override;
  LAZYTENSOR_INLINE double closed_form(double base, std::int64_t s) const override;

 private:
  std::int64_t T_;
  double min_;
};

/// lr = base * factor, factor going linearly from start_factor to end_factor over
/// total_iters steps and staying there; construction multiplies the rate by start_factor,
/// each step by the ratio of consecutive factors.
class LinearLR : public LRScheduler {
 public:
  LinearLR(Optimizer& opt, double start_factor = 1.0 / 3, double end_factor = 1.0, std::int64_t total_iters = 5);

 protected:
  LAZYTENSOR_INLINE double chained(double lr, double base, std::int64_t s) const override;
  LAZYTENSOR_INLINE double closed_form(double base, std::int64_t s) const override;

 private:
  double start_, end_;
  std::int64_t total_;
};

#if LAZYTENSOR_HEADER_DEFINITIONS
LAZYTENSOR_INLINE void LRScheduler::step() {
  ++count_;
  adopt_groups();
  for (std::size_t g = 0; g < base_.size(); ++g)
    opt_.set_lr(chained(opt_.lr(g), base_[g], count_), g);
  record_last();
}

LAZYTENSOR_INLINE void LRScheduler::set_last_epoch(std::int64_t steps) {
  if (steps < 0)
    throw Error("LRScheduler::set_last_epoch: steps must be >= 0, got " + std::to_string(steps));
  count_ = steps;
  adopt_groups();
  for (std::size_t g = 0; g < base_.size(); ++g) opt_.set_lr(closed_form(base_[g], count_), g);
  record_last();
}

LAZYTENSOR_INLINE void LRScheduler::start() {
  adopt_groups();
  for (std::size_t g = 0; g < base_.size(); ++g) opt_.set_lr(chained(opt_.lr(g), base_[g], 0), g);
  record_last();
}

LAZYTENSOR_INLINE void LRScheduler::adopt_groups() {
  for (std::size_t g = base_.size(); g < opt_.num_param_groups(); ++g) {
    if (!opt_.initial_lr(g)) opt_.set_initial_lr(opt_.lr(g), g);
    base_.push_back(*opt_.initial_lr(g));
  }
}

LAZYTENSOR_INLINE void LRScheduler::record_last() {
  last_.clear();
  for (std::size_t g = 0; g < base_.size(); ++g) last_.push_back(opt_.lr(g));
}

LAZYTENSOR_INLINE StepLR::StepLR(Optimizer& opt, std::int64_t step_size, double gamma)
    : LRScheduler(opt), size_(step_size), gamma_(gamma) {
  if (step_size <= 0) throw Error("StepLR: step_size must be positive, got " + std::to_string(step_size));
  if (!std::isfinite(gamma))
    throw Error("StepLR: gamma must be finite, got " + detail::format_option(gamma));
  start();
}

LAZYTENSOR_INLINE double StepLR::chained(double lr, double, std::int64_t s) const {
  return s == 0 || s % size_ != 0 ? lr : lr * gamma_;
}

LAZYTENSOR_INLINE double StepLR::closed_form(double base, std::int64_t s) const {
  return base * std::pow(gamma_, static_cast<double>(s / size_));
}

LAZYTENSOR_INLINE CosineAnnealingLR::CosineAnnealingLR(Optimizer& opt, std::int64_t T_max, double eta_min)
    : LRScheduler(opt), T_(T_max), min_(eta_min) {
  if (T_max <= 0) throw Error("CosineAnnealingLR: T_max must be positive, got " + std::to_string(T_max));
  if (!std::isfinite(eta_min)) {
    throw Error("CosineAnnealingLR: eta_min must be finite, got " + detail::format_option(eta_min));
  }
  start();
}

LAZYTENSOR_INLINE double CosineAnnealingLR::chained(double lr, double base, std::int64_t s) const {
  const double T = static_cast<double>(T_);
  if (s == 0) return lr;
  // Just past a minimum (step T_max + 1, 3 T_max + 1, ...) the ratio below divides by zero:
  // torch adds the rise of the first step from the minimum instead.
  if ((s - 1 - T_) % (2 * T_) == 0)
    return lr + (base - min_) * (1 - std::cos(std::numbers::pi / T)) / 2;
  const double now = 1 + std::cos(std::numbers::pi * static_cast<double>(s) / T);
  const double before = 1 + std::cos(std::numbers::pi * static_cast<double>(s - 1) / T);
  return now / before * (lr - min_) + min_;
}

LAZYTENSOR_INLINE double CosineAnnealingLR::closed_form(double base, std::int64_t s) const {
  return min_ + (base - min_) * (1 + std::cos(std::numbers::pi * static_cast<double>(s) / static_cast<double>(T_))) / 2;
}

LAZYTENSOR_INLINE LinearLR::LinearLR(Optimizer& opt, double start_factor, double end_factor, std::int64_t total_iters)
    : LRScheduler(opt), start_(start_factor), end_(end_factor), total_(total_iters) {
  // Written so that NaN, for which every comparison is false, fails them too.
  if (!(start_factor > 0 && start_factor <= 1)) {
    throw Error("LinearLR: start_factor must be in (0, 1], got " +
                detail::format_option(start_factor));
  }
  if (!(end_factor >= 0 && end_factor <= 1)) {
    throw Error("LinearLR: end_factor must be in [0, 1], got " + detail::format_option(end_factor));
  }
  if (total_iters <= 0) throw Error("LinearLR: total_iters must be positive, got " + std::to_string(total_iters));
  // As torch, the first rate (lr * start_factor) applies from construction on.
  start();
}

LAZYTENSOR_INLINE double LinearLR::chained(double lr, double, std::int64_t s) const {
  if (s == 0) return lr * start_;
  if (s > total_) return lr;
  // factor(s) / factor(s - 1), with factor(s) = start + (end - start) s / total_iters.
  const double d = end_ - start_;
  return lr * (1 + d / (static_cast<double>(total_) * start_ + static_cast<double>(s - 1) * d));
}

LAZYTENSOR_INLINE double LinearLR::closed_form(double base, std::int64_t s) const {
  const double f = s >= total_ ? end_ : start_ + (end_ - start_) * static_cast<double>(s) / static_cast<double>(total_);
  return base * f;
}
#endif  // LAZYTENSOR_HEADER_DEFINITIONS

}  // namespace lazy::optim
