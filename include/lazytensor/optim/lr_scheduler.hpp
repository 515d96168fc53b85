#pragma once
// Learning-rate schedulers, as torch.optim.lr_scheduler. They chain as torch's do: step()
// multiplies each group's current rate by the step's factor (torch's get_lr), so schedulers
// built on one optimizer compose, and a rate set by hand between steps is kept.
// set_last_epoch (a resumed run) sets the closed form of that step instead (torch's
// _get_closed_form_lr), from each group's initial rate: recorded on the optimizer by the
// first scheduler built on it (torch's param_group["initial_lr"]), read by later ones.
// The rate is a scalar of the update kernels: a new rate never changes the plan.
// ChainedScheduler and SequentialLR compose schedulers built on one optimizer, as torch's.
// state_dict / load_state_dict save and restore a scheduler's own state (its step, initial
// and last rates), never the optimizer's rates: those come back with the optimizer's
// state dict, as in torch.

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <map>
#include <memory>
#include <numbers>
#include <string>
#include <system_error>
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
  LAZYTENSOR_INLINE virtual void step();
  /// The rates this scheduler set at its last step (or construction), as torch's get_last_lr;
  /// the optimizer's may differ since (another scheduler, or set_lr).
  std::vector<double> get_last_lr() const { return last_; }
  /// Steps taken so far.
  std::int64_t last_epoch() const { return count_; }
  /// Continues from `steps` steps taken: sets the closed-form rates of that step from the
  /// initial rates, whatever the current ones.
  LAZYTENSOR_INLINE virtual void set_last_epoch(std::int64_t steps);
  /// The optimizer this scheduler sets the rates of.
  Optimizer& optimizer() const { return opt_; }
  /// The scheduler's state as text (torch's state_dict without the optimizer):
  /// "last_epoch", and per group "base_lrs.<g>" and "last_lr.<g>".
  LAZYTENSOR_INLINE virtual std::map<std::string, std::string> state_dict() const;
  /// Restores what state_dict() saved (Error naming a missing or malformed entry). The
  /// optimizer's rates are left alone: a resumed run restores them with the optimizer's
  /// state dict, so that schedulers chained on one optimizer all continue (torch's order).
  LAZYTENSOR_INLINE virtual void load_state_dict(const std::map<std::string, std::string>& state);

 protected:
  /// The rate after step `s` of a group at rate `lr` with initial rate `base` (torch's
  /// chainable get_lr; s == 0 is the rate set at construction).
  virtual double chained(double lr, double base, std::int64_t s) const = 0;
  /// The rate at step `s` of a group with initial rate `base` (torch's _get_closed_form_lr).
  virtual double closed_form(double base, std::int64_t s) const = 0;
  /// Records the initial rates and sets the rates of step 0: the last line of a derived
  /// constructor, after its checks, so a refused scheduler leaves the optimizer alone.
  void start() { LRScheduler::initial_step(); }
  /// Step 0 again from the current rates (torch's _initial_step): what construction does,
  /// and what SequentialLR asks of its first scheduler.
  LAZYTENSOR_INLINE virtual void initial_step();
  /// Sets every group's rate back to its initial rate (or keeps it, for a group no
  /// scheduler has met): where a composite replays its schedulers from.
  void reset_to_initial_rates();
  /// The optimizer's current rates, as last rates.
  void record_current_rates();

  std::vector<double> last_;
  std::int64_t count_ = 0;

 private:
  friend class ChainedScheduler;
  friend class SequentialLR;
  /// Initial rates of the groups not seen yet (torch's setdefault of "initial_lr").
  void adopt_groups();
  void record_last();

  Optimizer& opt_;
  std::vector<double> base_;
};

namespace detail {
/// The optimizer of the schedulers a composite takes (`given`, or the first scheduler's):
/// Error when there is none, one is empty, or one sets another optimizer's rates.
Optimizer& composite_optimizer(const std::vector<std::shared_ptr<LRScheduler>>& schedulers,
                               Optimizer* given, const std::string& who);
/// Entry `key` of a scheduler's saved state as an integer / a number (Error naming `who`).
std::int64_t scheduler_int(const std::map<std::string, std::string>& state, const std::string& key,
                           const std::string& who);
double scheduler_number(const std::map<std::string, std::string>& state, const std::string& key,
                        const std::string& who);
/// The entries of `state` under "<prefix><i>." for each i, prefix removed; Error unless
/// there are exactly `n` of them (i = 0 .. n-1).
std::vector<std::map<std::string, std::string>> nested_states(
    const std::map<std::string, std::string>& state, const std::string& prefix, std::size_t n,
    const std::string& who);
/// Error unless `milestones` never decrease (SequentialLR looks its interval up by
/// bisection, as torch does, which needs them in order).
void check_milestone_order(const std::vector<std::int64_t>& milestones, const std::string& who);
}  // namespace detail

/// torch's ChainedScheduler(schedulers, optimizer): step() steps every scheduler in turn,
/// so their factors multiply. The schedulers must all set one optimizer's rates.
class ChainedScheduler : public LRScheduler {
 public:
  /// Chains `schedulers` (at least one, all on one optimizer: `optimizer` when given);
  /// their constructions already set the rates of step 0, so this changes no rate.
  explicit ChainedScheduler(std::vector<std::shared_ptr<LRScheduler>> schedulers,
                            Optimizer* optimizer = nullptr);
  /// Steps every scheduler in order.
  LAZYTENSOR_INLINE void step() override;
  /// The rates after `steps` steps of the chain: each scheduler restarted from the initial
  /// rates in order, then stepped `steps` times (a replay, so it is exactly the run's).
  LAZYTENSOR_INLINE void set_last_epoch(std::int64_t steps) override;
  /// "last_epoch", "last_lr.<g>" and each scheduler's state under "_schedulers.<i>.".
  LAZYTENSOR_INLINE std::map<std::string, std::string> state_dict() const override;
  LAZYTENSOR_INLINE void load_state_dict(const std::map<std::string, std::string>& state) override;
  /// The chained schedulers.
  const std::vector<std::shared_ptr<LRScheduler>>& schedulers() const { return schedulers_; }

 protected:
  // (step and set_last_epoch are the schedulers': these are never called.)
  double chained(double lr, double, std::int64_t) const override { return lr; }
  double closed_form(double base, std::int64_t) const override { return base; }
  LAZYTENSOR_INLINE void initial_step() override;

 private:
  std::vector<std::shared_ptr<LRScheduler>> schedulers_;
};

/// torch's SequentialLR(optimizer, schedulers, milestones): schedulers[0] sets the rates
/// until step milestones[0], schedulers[1] until milestones[1], and so on. Construction
/// puts the rates back to the initial rates and runs only the first scheduler's step 0;
/// at a milestone the next scheduler starts at its step 0 in closed form (torch's
/// step(0)), so it starts from the initial rates, not where the previous one left them.
class SequentialLR : public LRScheduler {
 public:
  /// `schedulers` (at least one, all on `optimizer`) and `milestones` (one fewer,
  /// non-decreasing); Error naming what was expected and found otherwise.
  SequentialLR(Optimizer& optimizer, std::vector<std::shared_ptr<LRScheduler>> schedulers,
               std::vector<std::int64_t> milestones);
  /// One step of the scheduler whose interval holds the new step count.
  LAZYTENSOR_INLINE void step() override;
  /// The rates after `steps` steps (a replay from construction, exactly the run's).
  LAZYTENSOR_INLINE void set_last_epoch(std::int64_t steps) override;
  /// "last_epoch", "last_lr.<g>", "_milestones.<j>" and each scheduler's state under
  /// "_schedulers.<i>.".
  LAZYTENSOR_INLINE std::map<std::string, std::string> state_dict() const override;
  LAZYTENSOR_INLINE void load_state_dict(const std::map<std::string, std::string>& state) override;
  const std::vector<std::shared_ptr<LRScheduler>>& schedulers() const { return schedulers_; }
  const std::vector<std::int64_t>& milestones() const { return milestones_; }

 protected:
  double chained(double lr, double, std::int64_t) const override { return lr; }
  double closed_form(double base, std::int64_t) const override { return base; }
  LAZYTENSOR_INLINE void initial_step() override;

 private:
  std::vector<std::shared_ptr<LRScheduler>> schedulers_;
  std::vector<std::int64_t> milestones_;
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

LAZYTENSOR_INLINE void LRScheduler::initial_step() {
  count_ = 0;
  adopt_groups();
  for (std::size_t g = 0; g < base_.size(); ++g) opt_.set_lr(chained(opt_.lr(g), base_[g], 0), g);
  record_last();
}

LAZYTENSOR_INLINE std::map<std::string, std::string> LRScheduler::state_dict() const {
  std::map<std::string, std::string> s;
  s["last_epoch"] = std::to_string(count_);
  for (std::size_t g = 0; g < base_.size(); ++g)
    s["base_lrs." + std::to_string(g)] = detail::format_option(base_[g]);
  for (std::size_t g = 0; g < last_.size(); ++g)
    s["last_lr." + std::to_string(g)] = detail::format_option(last_[g]);
  return s;
}

LAZYTENSOR_INLINE void LRScheduler::load_state_dict(
    const std::map<std::string, std::string>& state) {
  const std::string who = "LRScheduler::load_state_dict";
  const std::int64_t count = detail::scheduler_int(state, "last_epoch", who);
  std::vector<double> base, last;
  for (std::size_t g = 0; state.count("base_lrs." + std::to_string(g)); ++g)
    base.push_back(detail::scheduler_number(state, "base_lrs." + std::to_string(g), who));
  for (std::size_t g = 0; state.count("last_lr." + std::to_string(g)); ++g)
    last.push_back(detail::scheduler_number(state, "last_lr." + std::to_string(g), who));
  if (base.size() > opt_.num_param_groups())
    throw Error(who + ": expected initial rates of at most " +
                std::to_string(opt_.num_param_groups()) +
                " parameter groups (the optimizer's), found " + std::to_string(base.size()));
  count_ = count;
  base_ = std::move(base);
  last_ = std::move(last);
}

LAZYTENSOR_INLINE void LRScheduler::reset_to_initial_rates() {
  for (std::size_t g = 0; g < opt_.num_param_groups(); ++g)
    if (const auto init = opt_.initial_lr(g)) opt_.set_lr(*init, g);
}

LAZYTENSOR_INLINE void LRScheduler::record_current_rates() {
  last_.clear();
  for (std::size_t g = 0; g < opt_.num_param_groups(); ++g) last_.push_back(opt_.lr(g));
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

namespace detail {
LAZYTENSOR_INLINE Optimizer& composite_optimizer(
    const std::vector<std::shared_ptr<LRScheduler>>& schedulers, Optimizer* given,
    const std::string& who) {
  if (schedulers.empty()) throw Error(who + ": expected at least one scheduler, got none");
  for (std::size_t i = 0; i < schedulers.size(); ++i)
    if (!schedulers[i]) throw Error(who + ": scheduler " + std::to_string(i) + " is empty");
  Optimizer& opt = given ? *given : schedulers[0]->optimizer();
  for (std::size_t i = 0; i < schedulers.size(); ++i) {
    if (&schedulers[i]->optimizer() != &opt)
      throw Error(
          who + ": expected every scheduler to set the rates of " +
          (given ? std::string("the given optimizer") : std::string("scheduler 0's optimizer")) +
          " (a " + opt.name() + "), found scheduler " + std::to_string(i) +
          " on another optimizer (a " + schedulers[i]->optimizer().name() + ")");
  }
  return opt;
}

LAZYTENSOR_INLINE std::int64_t scheduler_int(const std::map<std::string, std::string>& state,
                                             const std::string& key, const std::string& who) {
  const auto it = state.find(key);
  if (it == state.end()) throw Error(who + ": expected an entry \"" + key + "\", found none");
  std::int64_t v = 0;
  const auto r = std::from_chars(it->second.data(), it->second.data() + it->second.size(), v);
  if (r.ec != std::errc() || r.ptr != it->second.data() + it->second.size())
    throw Error(who + ": expected an integer in \"" + key + "\", found \"" + it->second + "\"");
  return v;
}

LAZYTENSOR_INLINE double scheduler_number(const std::map<std::string, std::string>& state,
                                          const std::string& key, const std::string& who) {
  const auto it = state.find(key);
  if (it == state.end()) throw Error(who + ": expected an entry \"" + key + "\", found none");
  double v = 0;
  const auto r = std::from_chars(it->second.data(), it->second.data() + it->second.size(), v);
  if (r.ec != std::errc() || r.ptr != it->second.data() + it->second.size())
    throw Error(who + ": expected a number in \"" + key + "\", found \"" + it->second + "\"");
  return v;
}

LAZYTENSOR_INLINE std::vector<std::map<std::string, std::string>> nested_states(
    const std::map<std::string, std::string>& state, const std::string& prefix, std::size_t n,
    const std::string& who) {
  std::vector<std::map<std::string, std::string>> out(n);
  std::size_t found = 0;
  for (const auto& [k, v] : state) {
    if (k.rfind(prefix, 0) != 0) continue;
    const auto dot = k.find('.', prefix.size());
    std::size_t i = 0;
    const auto r = std::from_chars(k.data() + prefix.size(),
                                   k.data() + (dot == std::string::npos ? k.size() : dot), i);
    if (r.ec != std::errc() || dot == std::string::npos || r.ptr != k.data() + dot)
      throw Error(who + ": expected \"" + prefix + "<index>.<name>\", found \"" + k + "\"");
    found = std::max(found, i + 1);
    if (i < n) out[i][k.substr(dot + 1)] = v;
  }
  if (found != n)
    throw Error(who + ": expected the states of " + std::to_string(n) + " schedulers, found " +
                std::to_string(found));
  return out;
}

LAZYTENSOR_INLINE void check_milestone_order(const std::vector<std::int64_t>& milestones,
                                             const std::string& who) {
  for (std::size_t j = 1; j < milestones.size(); ++j)
    if (milestones[j] < milestones[j - 1])
      throw Error(who + ": expected non-decreasing milestones, found " + std::to_string(milestones[j - 1]) +
                  " before " + std::to_string(milestones[j]));
}
}  // namespace detail

LAZYTENSOR_INLINE ChainedScheduler::ChainedScheduler(
    std::vector<std::shared_ptr<LRScheduler>> schedulers, Optimizer* optimizer)
    : LRScheduler(detail::composite_optimizer(schedulers, optimizer, "ChainedScheduler")),
      schedulers_(std::move(schedulers)) {
  record_current_rates();
}

LAZYTENSOR_INLINE void ChainedScheduler::step() {
  ++count_;
  for (const auto& s : schedulers_) s->step();
  record_current_rates();
}

LAZYTENSOR_INLINE void ChainedScheduler::set_last_epoch(std::int64_t steps) {
  if (steps < 0)
    throw Error("ChainedScheduler::set_last_epoch: steps must be >= 0, got " +
                std::to_string(steps));
  reset_to_initial_rates();
  initial_step();
  for (std::int64_t i = 0; i < steps; ++i) step();
}

LAZYTENSOR_INLINE void ChainedScheduler::initial_step() {
  count_ = 0;
  for (const auto& s : schedulers_) s->initial_step();
  record_current_rates();
}

LAZYTENSOR_INLINE std::map<std::string, std::string> ChainedScheduler::state_dict() const {
  std::map<std::string, std::string> s;
  s["last_epoch"] = std::to_string(count_);
  for (std::size_t g = 0; g < last_.size(); ++g)
    s["last_lr." + std::to_string(g)] = detail::format_option(last_[g]);
  for (std::size_t i = 0; i < schedulers_.size(); ++i)
    for (const auto& [k, v] : schedulers_[i]->state_dict())
      s["_schedulers." + std::to_string(i) + "." + k] = v;
  return s;
}

LAZYTENSOR_INLINE void ChainedScheduler::load_state_dict(
    const std::map<std::string, std::string>& state) {
  const std::string who = "ChainedScheduler::load_state_dict";
  const std::int64_t count = detail::scheduler_int(state, "last_epoch", who);
  const auto nested = detail::nested_states(state, "_schedulers.", schedulers_.size(), who);
  std::vector<double> last;
  for (std::size_t g = 0; state.count("last_lr." + std::to_string(g)); ++g)
    last.push_back(detail::scheduler_number(state, "last_lr." + std::to_string(g), who));
  for (std::size_t i = 0; i < schedulers_.size(); ++i) schedulers_[i]->load_state_dict(nested[i]);
  count_ = count;
  last_ = std::move(last);
}

LAZYTENSOR_INLINE SequentialLR::SequentialLR(Optimizer& optimizer,
                                             std::vector<std::shared_ptr<LRScheduler>> schedulers,
                                             std::vector<std::int64_t> milestones)
    : LRScheduler(detail::composite_optimizer(schedulers, &optimizer, "SequentialLR")),
      schedulers_(std::move(schedulers)),
      milestones_(std::move(milestones)) {
  if (milestones_.size() + 1 != schedulers_.size())
    throw Error("SequentialLR: expected one milestone fewer than schedulers (" +
                std::to_string(schedulers_.size() - 1) + " for " +
                std::to_string(schedulers_.size()) + " schedulers), found " +
                std::to_string(milestones_.size()));
  detail::check_milestone_order(milestones_, "SequentialLR");
  initial_step();
}

LAZYTENSOR_INLINE void SequentialLR::initial_step() {
  // torch's construction: the rates back to the initial ones, the steps the schedulers'
  // constructions took undone, then step 0 of the first scheduler only.
  reset_to_initial_rates();
  count_ = 0;
  for (const auto& s : schedulers_) s->count_ = -1;
  schedulers_[0]->initial_step();
  last_ = schedulers_[0]->get_last_lr();
}

LAZYTENSOR_INLINE void SequentialLR::step() {
  ++count_;
  const auto idx = static_cast<std::size_t>(
      std::upper_bound(milestones_.begin(), milestones_.end(), count_) - milestones_.begin());
  LRScheduler& s = *schedulers_[idx];
  if (idx > 0 && milestones_[idx - 1] == count_) {
    s.set_last_epoch(0);
  } else {
    s.step();
  }
  last_ = s.get_last_lr();
}

LAZYTENSOR_INLINE void SequentialLR::set_last_epoch(std::int64_t steps) {
  if (steps < 0)
    throw Error("SequentialLR::set_last_epoch: steps must be >= 0, got " + std::to_string(steps));
  initial_step();
  for (std::int64_t i = 0; i < steps; ++i) step();
}

LAZYTENSOR_INLINE std::map<std::string, std::string> SequentialLR::state_dict() const {
  std::map<std::string, std::string> s;
  s["last_epoch"] = std::to_string(count_);
  for (std::size_t g = 0; g < last_.size(); ++g)
    s["last_lr." + std::to_string(g)] = detail::format_option(last_[g]);
  for (std::size_t j = 0; j < milestones_.size(); ++j)
    s["_milestones." + std::to_string(j)] = std::to_string(milestones_[j]);
  for (std::size_t i = 0; i < schedulers_.size(); ++i)
    for (const auto& [k, v] : schedulers_[i]->state_dict())
      s["_schedulers." + std::to_string(i) + "." + k] = v;
  return s;
}

LAZYTENSOR_INLINE void SequentialLR::load_state_dict(
    const std::map<std::string, std::string>& state) {
  const std::string who = "SequentialLR::load_state_dict";
  const std::int64_t count = detail::scheduler_int(state, "last_epoch", who);
  const auto nested = detail::nested_states(state, "_schedulers.", schedulers_.size(), who);
  std::vector<std::int64_t> milestones;
  for (std::size_t j = 0; state.count("_milestones." + std::to_string(j)); ++j)
    milestones.push_back(detail::scheduler_int(state, "_milestones." + std::to_string(j), who));
  if (milestones.size() != milestones_.size())
    throw Error(who + ": expected " + std::to_string(milestones_.size()) + " milestones, found " +
                std::to_string(milestones.size()));
  detail::check_milestone_order(milestones, who);
  std::vector<double> last;
  for (std::size_t g = 0; state.count("last_lr." + std::to_string(g)); ++g)
    last.push_back(detail::scheduler_number(state, "last_lr." + std::to_string(g), who));
  for (std::size_t i = 0; i < schedulers_.size(); ++i) schedulers_[i]->load_state_dict(nested[i]);
  count_ = count;
  milestones_ = std::move(milestones);
  last_ = std::move(last);
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
