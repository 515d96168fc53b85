#pragma once
// Adam and AdamW, as torch.optim: bias-corrected first and second moment estimates, L2
// weight decay folded into the gradient (Adam) or decoupled (AdamW), optional AMSGrad.

#include <cmath>
#include <string>
#include <tuple>
#include <vector>

#include <lazytensor/core/config.hpp>
#include <lazytensor/optim/optimizer.hpp>

namespace lazy::optim {

/// Options of Adam and AdamW (libtorch's AdamOptions / AdamWOptions).
struct AdamOptions {
  using Betas = std::tuple<double, double>;
  AdamOptions(double lr = 1e-3) : lr_(lr) {}  // NOLINT
  LAZY_ARG(double, lr);
  LAZY_ARG(Betas, betas) = Betas(0.9, 0.999);
  LAZY_ARG(double, eps) = 1e-8;
  LAZY_ARG(double, weight_decay) = 0;
  LAZY_ARG(bool, amsgrad) = false;

 public:
  std::map<std::string, std::string> to_map() const;
  static AdamOptions from_map(const std::map<std::string, std::string>& m);
};
/// AdamW's options: Adam's, with weight_decay 1e-2 by default (as torch). The fluent
/// setters return AdamOptions&, which AdamW takes as well.
struct AdamWOptions : AdamOptions {
  AdamWOptions(double lr = 1e-3) : AdamOptions(lr) { weight_decay(1e-2); }  // NOLINT
};

/// The Adam update shared by Adam (L2 decay in the gradient) and AdamW (decoupled decay).
template <class Options, bool Decoupled>
class AdamBase : public OptimizerWithOptions<Options> {
  using Base = OptimizerWithOptions<Options>;

 public:
  using typename Base::ParamGroup;
  /// One group of parameters (AdamW's default options decay weights by 1e-2, as torch's).
  AdamBase(std::vector<AnyTensor> params, Options options = default_options())
      : AdamBase(std::vector<ParamGroup>{ParamGroup{std::move(params), options}}) {}
  /// Parameters of one dtype.
  template <FloatingElement T>
  AdamBase(const std::vector<Tensor<T>>& params, Options options = default_options())
      : AdamBase(std::vector<AnyTensor>(params.begin(), params.end()), options) {}
  AdamBase(std::vector<ParamGroup> groups) : Base(std::move(groups)) {
    for (const auto& g : this->groups_) validate_options(g.options);
  }

  void step() override;

 protected:
  std::string type_name() const override { return Decoupled ? "AdamW" : "Adam"; }
  std::string type_name_of() const override { return type_name(); }

 private:
  static Options default_options() {
    if constexpr (Decoupled) return AdamWOptions();
    else return Options();
  }
  void validate_options(const Options& o) const override;
  template <FloatingElement T>
  void update(Tensor<T> p, ParamState& st, const AdamOptions& o);
};

// (Outside the class, so not inline: see core/config.hpp.)
template <class Options, bool Decoupled>
void AdamBase<Options, Decoupled>::step() {
  NoGradGuard guard;
  for (std::size_t gi = 0; gi < this->groups_.size(); ++gi) {
    const AdamOptions& o = this->groups_[gi].options;
    auto& ps = this->groups_[gi].params;
    for (std::size_t k = 0; k < ps.size(); ++k) {
      if (!ps[k].grad().defined()) continue;
      detail::visit_floating(ps[k], type_name().c_str(), [&](auto p) { update(p, this->state(gi, k), o); });
    }
  }
}

template <class Options, bool Decoupled>
template <FloatingElement T>
void AdamBase<Options, Decoupled>::update(Tensor<T> p, ParamState& st, const AdamOptions& o) {
  using C = compute_t<T>;  // scalars in the dtype's arithmetic: float for float and bfloat16
  const double lr = o.lr(), b1 = std::get<0>(o.betas()), b2 = std::get<1>(o.betas()), wd = o.weight_decay();
  const Tensor<T> grad = p.grad();
  const std::int64_t t = ++st.step;
  const Tensor<T> g = !Decoupled && wd != 0 ? Tensor<T>(grad + static_cast<C>(wd) * p) : grad;
  auto init = [&](const char* name) -> Tensor<T> {
    auto it = st.tensors.find(name);
    if (it == st.tensors.end()) it = st.tensors.emplace(name, zeros<T>(p.shape(), p.device())).first;
    return it->second.template as<T>();  // shares the state tensor: copy_ below updates it
  };
  Tensor<T> m = init("exp_avg");
  Tensor<T> v = init("exp_avg_sq");
  m.copy_(m * static_cast<C>(b1) + g * static_cast<C>(1 - b1));
  v.copy_(v * static_cast<C>(b2) + g * g * static_cast<C>(1 - b2));
  // p -= lr / bc1 * m / (sqrt(v) / sqrt(bc2) + eps), rearranged so that no scalar
  // drifts to exactly 1 as the bias corrections vanish:
  // lr sqrt(bc2) / bc1 * m / (sqrt(v) + eps sqrt(bc2)).
  const double bc1 = 1 - std::pow(b1, static_cast<double>(t));
  const double sbc2 = std::sqrt(1 - std::pow(b2, static_cast<double>(t)));
  const auto step_size = static_cast<C>(lr * sbc2 / bc1), eps = static_cast<C>(o.eps() * sbc2);
  Tensor<T> vmax = v;
  if (o.amsgrad()) {
    Tensor<T> mx = init("max_exp_avg_sq");
    mx.copy_(maximum(mx, v));
    vmax = mx;
  }
  if (Decoupled && wd != 0) {
    p.copy_(p * static_cast<C>(1 - lr * wd) - step_size * m / (sqrt(vmax) + eps));
  } else {
    p.sub_(step_size * m / (sqrt(vmax) + eps));
  }
}

template <class Options, bool Decoupled>
void AdamBase<Options, Decoupled>::validate_options(const Options& o) const {
  // Written so that NaN fails every check.
  const double b1 = std::get<0>(o.betas()), b2 = std::get<1>(o.betas());
  const std::string n = type_name();
  if (!(o.lr() >= 0)) throw Error(n + ": invalid learning rate " + std::to_string(o.lr()));
  if (!(o.eps() >= 0)) throw Error(n + ": invalid epsilon value " + std::to_string(o.eps()));
  if (!(b1 >= 0 && b1 < 1))
    throw Error(n + ": invalid beta parameter at index 0: " + std::to_string(b1));
  if (!(b2 >= 0 && b2 < 1))
    throw Error(n + ": invalid beta parameter at index 1: " + std::to_string(b2));
  if (!(o.weight_decay() >= 0))
    throw Error(n + ": invalid weight_decay value " + std::to_string(o.weight_decay()));
}

/// Adam (L2 weight decay added to the gradient), as torch.optim.Adam. A class template
/// under the name: its step is compiled only into programs that use it.
using Adam = AdamBase<AdamOptions, false>;

/// AdamW (decoupled weight decay: p *= 1 - lr * weight_decay with the step), as
/// torch.optim.AdamW.
using AdamW = AdamBase<AdamOptions, true>;

#if LAZYTENSOR_HEADER_DEFINITIONS
LAZYTENSOR_INLINE std::map<std::string, std::string> AdamOptions::to_map() const {
  return {{"lr", detail::format_option(lr_)},
          {"beta1", detail::format_option(std::get<0>(betas_))},
          {"beta2", detail::format_option(std::get<1>(betas_))},
          {"eps", detail::format_option(eps_)},
          {"weight_decay", detail::format_option(weight_decay_)},
          {"amsgrad", amsgrad_ ? "1" : "0"}};
}

LAZYTENSOR_INLINE AdamOptions AdamOptions::from_map(const std::map<std::string, std::string>& m) {
  AdamOptions o(detail::parse_option(m, "lr"));
  o.betas(Betas(detail::parse_option(m, "beta1"), detail::parse_option(m, "beta2")))
      .eps(detail::parse_option(m, "eps"))
      .weight_decay(detail::parse_option(m, "weight_decay"))
      .amsgrad(detail::parse_option(m, "amsgrad") != 0);
  return o;
}
#endif  // LAZYTENSOR_HEADER_DEFINITIONS

}  // namespace lazy::optim

// Instantiated once in the compiled runtime (core/config.hpp).
#define LAZYTENSOR_OPTIM_ADAM_INSTANCES(P)                                          \
  P template class lazy::optim::OptimizerWithOptions<lazy::optim::AdamOptions>; \
  P template class lazy::optim::AdamBase<lazy::optim::AdamOptions, false>;      \
  P template class lazy::optim::AdamBase<lazy::optim::AdamOptions, true>;
#if LAZYTENSOR_EXPLICIT_INSTANTIATION
LAZYTENSOR_OPTIM_ADAM_INSTANCES(extern)
#endif
