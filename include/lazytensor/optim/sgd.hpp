#pragma once
// SGD with momentum, dampening, Nesterov and weight decay, as torch.optim.SGD.

#include <string>
#include <vector>

#include <lazytensor/core/config.hpp>
#include <lazytensor/optim/optimizer.hpp>

namespace lazy::optim {

/// Options of SGD (libtorch's SGDOptions).
struct SGDOptions {
  SGDOptions(double lr) : lr_(lr) {}  // NOLINT: SGD(params, 0.1) reads naturally
  LAZY_ARG(double, lr);
  LAZY_ARG(double, momentum) = 0;
  LAZY_ARG(double, dampening) = 0;
  LAZY_ARG(double, weight_decay) = 0;
  LAZY_ARG(bool, nesterov) = false;

 public:
  std::map<std::string, std::string> to_map() const;
  static SGDOptions from_map(const std::map<std::string, std::string>& m);
};

/// Stochastic gradient descent (`optim::SGD`). Per parameter: buf = momentum * buf +
/// (1 - dampening) * g (g itself at the first step), then p -= lr * (nesterov ? g + momentum
/// * buf : buf), with g = grad + weight_decay * p. A class template (the parameter is unused)
/// so that its step is compiled only into programs that construct one.
template <class = void>
class BasicSGD : public OptimizerWithOptions<SGDOptions> {
 public:
  BasicSGD(std::vector<Tensor<float>> params, SGDOptions options)
      : OptimizerWithOptions({ParamGroup{std::move(params), options}}) {
    validate();
  }
  BasicSGD(std::vector<ParamGroup> groups) : OptimizerWithOptions(std::move(groups)) { validate(); }

  void step() override;

 protected:
  std::string type_name() const override { return "SGD"; }
  std::string type_name_of() const override { return "SGD"; }

 private:
  void validate() const;
};

// (Outside the class, so not inline: see core/config.hpp.)
template <class V>
void BasicSGD<V>::step() {
  NoGradGuard guard;
  for (std::size_t gi = 0; gi < groups_.size(); ++gi) {
    const SGDOptions& o = groups_[gi].options;
    const auto lr = static_cast<float>(o.lr()), mom = static_cast<float>(o.momentum()),
               damp = static_cast<float>(o.dampening()), wd = static_cast<float>(o.weight_decay());
    auto& ps = groups_[gi].params;
    for (std::size_t k = 0; k < ps.size(); ++k) {
      Tensor<float>& p = ps[k];
      const Tensor<float> grad = p.grad();
      if (!grad.defined()) continue;
      const Tensor<float> g = wd != 0 ? Tensor<float>(grad + wd * p) : grad;
      if (mom == 0) {
        p.sub_(g * lr);
        continue;
      }
      ParamState& st = state(gi, k);
      auto it = st.tensors.find("momentum_buffer");
      if (it == st.tensors.end()) {
        it = st.tensors.emplace("momentum_buffer", Tensor<float>(g * 1.0f)).first;
      } else {
        it->second.copy_(it->second * mom + g * (1 - damp));
      }
      const Tensor<float>& buf = it->second;
      if (o.nesterov()) p.sub_((g + buf * mom) * lr);
      else p.sub_(buf * lr);
      ++st.step;
    }
  }
}

template <class V>
void BasicSGD<V>::validate() const {
  for (const auto& g : groups_) {
    const auto& o = g.options;
    if (o.lr() < 0) throw Error("SGD: invalid learning rate " + std::to_string(o.lr()));
    if (o.momentum() < 0) throw Error("SGD: invalid momentum value " + std::to_string(o.momentum()));
    if (o.weight_decay() < 0) throw Error("SGD: invalid weight_decay value " + std::to_string(o.weight_decay()));
    if (o.nesterov() && (o.momentum() <= 0 || o.dampening() != 0)) {
      throw Error("SGD: Nesterov momentum requires a momentum and zero dampening");
    }
  }
}

/// Stochastic gradient descent, as torch.optim.SGD.
using SGD = BasicSGD<>;

#if LAZYTENSOR_HEADER_DEFINITIONS
LAZYTENSOR_INLINE std::map<std::string, std::string> SGDOptions::to_map() const {
  return {{"lr", detail::format_option(lr_)},
          {"momentum", detail::format_option(momentum_)},
          {"dampening", detail::format_option(dampening_)},
          {"weight_decay", detail::format_option(weight_decay_)},
          {"nesterov", nesterov_ ? "1" : "0"}};
}

LAZYTENSOR_INLINE SGDOptions SGDOptions::from_map(const std::map<std::string, std::string>& m) {
  SGDOptions o(detail::parse_option(m, "lr"));
  o.momentum(detail::parse_option(m, "momentum"))
      .dampening(detail::parse_option(m, "dampening"))
      .weight_decay(detail::parse_option(m, "weight_decay"))
      .nesterov(detail::parse_option(m, "nesterov") != 0);
  return o;
}
#endif  // LAZYTENSOR_HEADER_DEFINITIONS

}  // namespace lazy::optim

// Instantiated once in the compiled runtime (core/config.hpp).
#define LAZYTENSOR_OPTIM_SGD_INSTANCES(P)                                         \
  P template class lazy::optim::OptimizerWithOptions<lazy::optim::SGDOptions>; \
  P template class lazy::optim::BasicSGD<void>;
#if LAZYTENSOR_EXPLICIT_INSTANTIATION
LAZYTENSOR_OPTIM_SGD_INSTANCES(extern)
#endif
