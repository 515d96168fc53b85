#pragma once
// Optimizer base, as torch::optim::Optimizer: parameter groups with their own options,
// zero_grad, step, and state_dict / load_state_dict. Parameters may be bfloat16, float or
// double (a module converted with to(dtype)); each is updated, and its state kept, in its
// own dtype. An update is built from lazy
// expressions under NoGradGuard, so the whole training step (forward, backward, update)
// materializes at one mark_step; each state tensor is updated in place (buffer donation
// makes that free), and the learning rate is a scalar in the kernel, so changing it never
// changes the plan.

#include <charconv>
#include <cmath>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <lazytensor/any_tensor.hpp>
#include <lazytensor/core/arg.hpp>
#include <lazytensor/core/config.hpp>
#include <lazytensor/ops/factories.hpp>
#include <lazytensor/state_dict.hpp>
#include <lazytensor/tensor/tensor.hpp>

namespace lazy::optim {

namespace detail {
/// Option `name` of a saved group as a number (Error when missing or malformed).
double parse_option(const std::map<std::string, std::string>& opts, const std::string& name);
/// The shortest text that reads back as exactly `v`.
std::string format_option(double v);
/// A saved step count (Error unless it is a non-negative integer of one element).
std::int64_t saved_step(const std::string& key, const AnyTensor& t);
std::int64_t check_step(const std::string& key, std::int64_t s);
}  // namespace detail

/// Per-parameter optimizer state: named tensors (of the parameter's dtype) plus a step count.
struct ParamState {
  std::map<std::string, AnyTensor> tensors;
  std::int64_t step = 0;
};

namespace detail {
/// Calls f(Tensor<T>) with the parameter's typed handle (T: bfloat16, float or double);
/// DTypeError for an integral or bool parameter.
template <class F>
decltype(auto) visit_floating(const AnyTensor& p, const char* who, F&& f) {
  switch (p.dtype()) {
    case DType::Float32: return f(p.as<float>());
    case DType::Float64: return f(p.as<double>());
    case DType::BFloat16: return f(p.as<bfloat16>());
    default: break;
  }
  throw DTypeError(std::string(who) + ": expected floating parameters (bfloat16, float32 or float64), got " +
                   dtype_name(p.dtype()));
}
}  // namespace detail

/// Base of every optimizer. `Options` is the optimizer's options type (with lr()).
class Optimizer {
 public:
  virtual ~Optimizer() = default;

  /// Applies one update to every parameter that has a gradient.
  virtual void step() = 0;

  /// Clears the gradients of every parameter: undefined (libtorch's default) or zero.
  void zero_grad(bool set_to_none = true);

  /// Number of parameter groups.
  virtual std::size_t num_param_groups() const = 0;
  /// The parameters of group `g`.
  virtual std::vector<AnyTensor>& params(std::size_t g) = 0;
  /// Learning rate of group `g` (what schedulers read and write).
  virtual double lr(std::size_t g = 0) const = 0;
  virtual void set_lr(double lr, std::size_t g) = 0;
  /// Sets the learning rate of every group.
  void set_lr(double lr);
  /// Group g's rate before any scheduling (torch's param_group["initial_lr"]), once an LR
  /// scheduler recorded it: the first one built on the optimizer does, later ones read it.
  /// Saved by state_dict() and restored by load_state_dict() as torch's, so a scheduler
  /// built after loading takes the run's initial rate as its base, not the loaded rate.
  std::optional<double> initial_lr(std::size_t g) const {
    const auto it = initial_lr_.find(g);
    return it == initial_lr_.end() ? std::nullopt : std::optional<double>(it->second);
  }
  /// Records group g's initial rate (what LR schedulers do).
  void set_initial_lr(double lr, std::size_t g) { initial_lr_[g] = lr; }
  /// The optimizer's kind: "SGD", "Adam", ... (what LearningRateMonitor names it by).
  std::string name() const { return type_name(); }

  /// State tensors as "state.<i>.<name>" (i counts parameters across groups in order),
  /// step counts as "state.<i>.step", and every group's options in the metadata
  /// ("param_groups.<g>.<option>", with "param_groups.<g>.initial_lr" once a scheduler
  /// recorded it).
  StateDict state_dict() const;

  /// Restores state and options saved by state_dict() of the same kind of optimizer over
  /// parameters of the same shapes, and each group's initial_lr where one was saved (a
  /// group saved without one keeps its own). Checks everything before changing anything.
  void load_state_dict(const StateDict& sd);

 protected:
  /// "SGD", "Adam", ...
  virtual std::string type_name() const = 0;
  virtual const std::vector<AnyTensor>& const_params(std::size_t g) const = 0;
  /// Options of group g as strings, and back (Error on a missing or malformed value).
  virtual std::map<std::string, std::string> options_of(std::size_t g) const = 0;
  virtual void set_options_of(std::size_t g, const std::map<std::string, std::string>& opts) = 0;
  /// Parses and checks options saved for group g without setting them (Error when
  /// missing, malformed or invalid): load_state_dict checks every group before it sets any.
  virtual void check_options_of(std::size_t g,
                                const std::map<std::string, std::string>& opts) const = 0;

  /// State of parameter k of group g.
  ParamState& state(std::size_t g, std::size_t k);

 private:
  static std::pair<std::size_t, std::size_t> key(std::size_t g, std::size_t k) { return {g, k}; }
  static AnyTensor scalar_step(std::int64_t s);

  std::map<std::pair<std::size_t, std::size_t>, ParamState> state_;
  std::map<std::size_t, double> initial_lr_;
};

/// The parameter groups of an optimizer with options type Options.
template <class Options>
class OptimizerWithOptions : public Optimizer {
 public:
  /// A group of parameters sharing options.
  struct ParamGroup {
    std::vector<AnyTensor> params;
    Options options;
  };

  OptimizerWithOptions(std::vector<ParamGroup> groups) : groups_(std::move(groups)) {
    for (std::size_t g = 0; g < groups_.size(); ++g) check_params(g);
    for (auto& g : groups_)
      for (auto& p : g.params)
        if (!p.requires_grad()) p.requires_grad_();
  }

  std::size_t num_param_groups() const override { return groups_.size(); }
  std::vector<AnyTensor>& params(std::size_t g) override { return groups_.at(g).params; }
  double lr(std::size_t g = 0) const override { return groups_.at(g).options.lr(); }
  void set_lr(double lr, std::size_t g) override { groups_.at(g).options.lr(lr); }
  using Optimizer::set_lr;
  /// The groups, with their options (libtorch's param_groups()).
  std::vector<ParamGroup>& param_groups() { return groups_; }
  /// Adds a group (libtorch's add_param_group), checked as the constructor checks its groups.
  void add_param_group(ParamGroup g) {
    validate_options(g.options);
    groups_.push_back(std::move(g));
    try {
      check_params(groups_.size() - 1);
    } catch (...) {
      groups_.pop_back();
      throw;
    }
    for (auto& p : groups_.back().params)
      if (!p.requires_grad()) p.requires_grad_();
  }

 protected:
  const std::vector<AnyTensor>& const_params(std::size_t g) const override { return groups_.at(g).params; }
  std::map<std::string, std::string> options_of(std::size_t g) const override { return groups_.at(g).options.to_map(); }
  void set_options_of(std::size_t g, const std::map<std::string, std::string>& opts) override {
    groups_.at(g).options = Options::from_map(opts);
  }
  void check_options_of(std::size_t,
                        const std::map<std::string, std::string>& opts) const override {
    validate_options(Options::from_map(opts));
  }
  /// The optimizer's rules for one group's options (Error naming the invalid one).
  virtual void validate_options(const Options&) const {}
  /// The optimizer's own rule for one parameter beyond being floating (BasicSGD<float>
  /// takes float parameters only); checked by add_param_group too.
  virtual void validate_param(const AnyTensor&) const {}
  virtual std::string type_name_of() const { return "Optimizer"; }

  /// Group g's parameters are defined and floating, and none is in an earlier group or
  /// twice in this one (it would be updated twice per step).
  void check_params(std::size_t g) const {
    for (std::size_t k = 0; k < groups_[g].params.size(); ++k) {
      const AnyTensor& p = groups_[g].params[k];
      if (!p.defined()) throw Error(type_name_of() + ": got an undefined parameter");
      if (!p.is_floating_point()) {
        throw DTypeError(type_name_of() +
                         ": can only optimize floating parameters, got one of dtype " +
                         dtype_name(p.dtype()));
      }
      validate_param(p);
      for (std::size_t h = 0; h <= g; ++h) {
        const auto& other = groups_[h].params;
        for (std::size_t j = 0; j < (h == g ? k : other.size()); ++j) {
          if (other[j].impl() == p.impl()) {
            throw Error(type_name_of() + ": parameter " + std::to_string(k) + " of group " +
                        std::to_string(g) + " appears more than once (also parameter " +
                        std::to_string(j) + " of group " + std::to_string(h) + ")");
          }
        }
      }
    }
  }

  std::vector<ParamGroup> groups_;
};

#if LAZYTENSOR_HEADER_DEFINITIONS
namespace detail {

LAZYTENSOR_INLINE double parse_option(const std::map<std::string, std::string>& opts, const std::string& name) {
  auto it = opts.find(name);
  if (it == opts.end()) throw Error("Optimizer::load_state_dict: missing option '" + name + "'");
  double v = 0;
  const char* b = it->second.data();
  const char* e = b + it->second.size();
  auto [p, ec] = std::from_chars(b, e, v);
  if (ec != std::errc() || p != e) {
    throw Error("Optimizer::load_state_dict: option '" + name + "' is not a number: '" + it->second + "'");
  }
  return v;
}

LAZYTENSOR_INLINE std::int64_t saved_step(const std::string& key, const AnyTensor& t) {
  // int64 as state_dict() writes it; a floating count as PyTorch's optimizers save theirs.
  if (t.numel() != 1) {
    throw ShapeError("Optimizer::load_state_dict: '" + key + "' (a step count) has shape " +
                     t.shape().str() + ", expected one element");
  }
  double v = 0;
  switch (t.dtype()) {
    case DType::Int64:
      return check_step(key, t.as<std::int64_t>().item());
    case DType::Int32:
      return check_step(key, t.as<std::int32_t>().item());
    case DType::Float32:
      v = t.as<float>().item();
      break;
    case DType::Float64:
      v = t.as<double>().item();
      break;
    default:
      throw DTypeError("Optimizer::load_state_dict: '" + key + "' (a step count) has dtype " +
                       dtype_name(t.dtype()) + ", expected int64, int32, float32 or float64");
  }
  if (!(v >= 0 && v < 9.0e18 && v == std::floor(v))) {
    throw Error("Optimizer::load_state_dict: '" + key +
                "' is not a step count: " + std::to_string(v));
  }
  return static_cast<std::int64_t>(v);
}

LAZYTENSOR_INLINE std::int64_t check_step(const std::string& key, std::int64_t s) {
  if (s < 0)
    throw Error("Optimizer::load_state_dict: '" + key +
                "' is a negative step count: " + std::to_string(s));
  return s;
}

LAZYTENSOR_INLINE std::string format_option(double v) {
  char buf[64];
  auto [p, ec] = std::to_chars(buf, buf + sizeof buf, v);
  return std::string(buf, p);
}

}  // namespace detail

LAZYTENSOR_INLINE void Optimizer::zero_grad(bool set_to_none) {
  for (std::size_t g = 0; g < num_param_groups(); ++g) {
    for (auto& p : params(g)) {
      if (set_to_none || !p.grad().defined()) {
        p.set_grad(AnyTensor());
      } else {
        NoGradGuard guard;
        p.grad().zero_();
      }
    }
  }
}

LAZYTENSOR_INLINE void Optimizer::set_lr(double lr) {
  for (std::size_t g = 0; g < num_param_groups(); ++g) set_lr(lr, g);
}

LAZYTENSOR_INLINE StateDict Optimizer::state_dict() const {
  StateDict sd;
  std::size_t i = 0;
  for (std::size_t g = 0; g < num_param_groups(); ++g) {
    for (std::size_t k = 0; k < const_params(g).size(); ++k, ++i) {
      auto it = state_.find(key(g, k));
      if (it == state_.end()) continue;
      for (const auto& [name, t] : it->second.tensors) sd.insert("state." + std::to_string(i) + "." + name, t.detach());
      sd.insert("state." + std::to_string(i) + ".step", scalar_step(it->second.step));
    }
    for (const auto& [name, v] : options_of(g)) sd.metadata()["param_groups." + std::to_string(g) + "." + name] = v;
    if (const auto init = initial_lr(g))
      sd.metadata()["param_groups." + std::to_string(g) + ".initial_lr"] =
          detail::format_option(*init);
  }
  sd.metadata()["optimizer"] = type_name();
  return sd;
}

LAZYTENSOR_INLINE void Optimizer::load_state_dict(const StateDict& sd) {
  if (auto it = sd.metadata().find("optimizer"); it == sd.metadata().end() || it->second != type_name()) {
    throw Error("Optimizer::load_state_dict: expected a state dict of a " + type_name() + " optimizer, found " +
                (it == sd.metadata().end() ? std::string("none") : it->second));
  }
  // Every group's options, checked before anything changes.
  std::vector<std::map<std::string, std::string>> group_options(num_param_groups());
  // initial_lr belongs to the schedulers, not to the optimizer's options.
  std::vector<std::optional<double>> initial(num_param_groups());
  for (std::size_t g = 0; g < num_param_groups(); ++g) {
    const std::string prefix = "param_groups." + std::to_string(g) + ".";
    for (const auto& [k, v] : sd.metadata())
      if (k.rfind(prefix, 0) == 0) group_options[g][k.substr(prefix.size())] = v;
    try {
      if (group_options[g].count("initial_lr")) {
        initial[g] = detail::parse_option(group_options[g], "initial_lr");
        group_options[g].erase("initial_lr");
      }
      check_options_of(g, group_options[g]);
    } catch (const Error& e) {
      throw Error("Optimizer::load_state_dict: group " + std::to_string(g) + ": " + e.what());
    }
  }
  std::map<std::pair<std::size_t, std::size_t>, ParamState> loaded;
  std::size_t i = 0, total = 0;
  for (std::size_t g = 0; g < num_param_groups(); ++g) total += const_params(g).size();
  for (const auto& [name, t] : sd) {
    if (name.rfind("state.", 0) != 0) throw Error("Optimizer::load_state_dict: unexpected key '" + name + "'");
    const auto dot = name.find('.', 6);
    std::size_t idx = 0;
    auto [p, ec] = std::from_chars(name.data() + 6, name.data() + (dot == std::string::npos ? name.size() : dot), idx);
    if (ec != std::errc() || dot == std::string::npos || idx >= total) {
      throw Error("Optimizer::load_state_dict: key '" + name + "' does not name one of the " + std::to_string(total) +
                  " parameters");
    }
    (void)p;
  }
  for (std::size_t g = 0; g < num_param_groups(); ++g) {
    for (std::size_t k = 0; k < const_params(g).size(); ++k, ++i) {
      const std::string prefix = "state." + std::to_string(i) + ".";
      ParamState st;
      bool any = false;
      for (const auto& [name, t] : sd) {
        if (name.rfind(prefix, 0) != 0) continue;
        any = true;
        const std::string field = name.substr(prefix.size());
        if (field == "step") {
          st.step = detail::saved_step(name, t);
          continue;
        }
        const AnyTensor& param = const_params(g)[k];
        if (!(t.shape() == param.shape())) {
          throw ShapeError("Optimizer::load_state_dict: '" + name + "' has shape " + t.shape().str() +
                           ", the parameter has shape " + param.shape().str());
        }
        if (t.dtype() != param.dtype()) {
          throw DTypeError("Optimizer::load_state_dict: '" + name + "' has dtype " + dtype_name(t.dtype()) +
                           ", the parameter has dtype " + dtype_name(param.dtype()));
        }
        // A handle of its own: the update rebinds it in place, which must not reach the
        // caller's state dict (or another optimizer loaded from it).
        st.tensors[field] = t.to(param.device()).detach();
      }
      if (any) loaded[key(g, k)] = std::move(st);
    }
  }
  for (std::size_t g = 0; g < num_param_groups(); ++g) {
    set_options_of(g, group_options[g]);
    if (initial[g]) initial_lr_[g] = *initial[g];
  }
  state_ = std::move(loaded);
}

LAZYTENSOR_INLINE ParamState& Optimizer::state(std::size_t g, std::size_t k) { return state_[key(g, k)]; }

LAZYTENSOR_INLINE AnyTensor Optimizer::scalar_step(std::int64_t s) {
  std::vector<std::int64_t> v{s};
  return from_vector<std::int64_t>(v, Shape{});
}
#endif  // LAZYTENSOR_HEADER_DEFINITIONS

}  // namespace lazy::optim
