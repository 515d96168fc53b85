#pragma once
// SGD with momentum, dampening, Nesterov and weight decay, as torch.optim.SGD.

#include <cmath>
#include <string>
#include <type_traits>
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
/// * buf : buf), with g = grad + weight_decay * p. A class template so that its step is
/// compiled only into programs that construct one. `SGD` (`Only` = void) updates parameters
/// of every floating dtype, which a module converted at run time (Module::to, a precision
/// plugin) may hold, so its step compiles the bfloat16 and double updates too;
/// `BasicSGD<float>` takes float parameters only (DTypeError for others) and compiles the
/// float update alone: a header-only float program's lighter choice.
template <class Only = void>
class BasicSGD : public OptimizerWithOptions<SGDOptions> {
 public:
  BasicSGD(std::vector<AnyTensor> params, SGDOptions options)
      : BasicSGD(std::vector<ParamGroup>{ParamGroup{std::move(params), options}}) {}
  /// Parameters of one dtype.
  template <FloatingElement T>
  BasicSGD(const std::vector<Tensor<T>>& params, SGDOptions options)
      : BasicSGD(std::vector<AnyTensor>(params.begin(), params.end()), options) {}
  BasicSGD(std::vector<ParamGroup> groups) : OptimizerWithOptions(checked_dtypes(std::move(groups))) { validate(); }

  void step() override;

 protected:
  std::string type_name() const override { return "SGD"; }
  std::string type_name_of() const override { return "SGD"; }

 private:
  void validate() const;
  void validate_options(const SGDOptions& o) const override;
  void validate_param(const AnyTensor& p) const override { check_dtype(p); }
  /// DTypeError for a parameter of another dtype than V (none for V = void).
  static void check_dtype(const AnyTensor& p);
  /// `groups`, once check_dtype passed for every parameter: before the base marks them as
  /// requiring gradients, so that a refused parameter is left as it was.
  static std::vector<ParamGroup> checked_dtypes(std::vector<ParamGroup> groups) {
    for (const auto& g : groups)
      for (const auto& p : g.params) check_dtype(p);
    return groups;
  }
  template <FloatingElement T>
  void update(Tensor<T> p, ParamState& st, const SGDOptions& o);
};

// (Outside the class, so not inline: see core/config.hpp.)
template <class V>
void BasicSGD<V>::step() {
  NoGradGuard guard;
  for (std::size_t gi = 0; gi < groups_.size(); ++gi) {
    const SGDOptions& o = groups_[gi].options;
    auto& ps = groups_[gi].params;
    for (std::size_t k = 0; k < ps.size(); ++k) {
      if (!ps[k].grad().defined()) continue;
      if constexpr (std::is_void_v<V>) detail::visit_floating(ps[k], "SGD", [&](auto p) { update(p, state(gi, k), o); });
      else update(ps[k].template as<V>(), state(gi, k), o);
    }
  }
}

template <class V>
template <FloatingElement T>
void BasicSGD<V>::update(Tensor<T> p, ParamState& st, const SGDOptions& o) {
  using C = compute_t<T>;  // scalars in the dtype's arithmetic: float for float and bfloat16
  const auto lr = static_cast<C>(o.lr()), mom = static_cast<C>(o.momentum()), damp = static_cast<C>(o.dampening()),
             wd = static_cast<C>(o.weight_decay());
  const Tensor<T> grad = p.grad();
  const Tensor<T> g = wd != 0 ? Tensor<T>(grad + wd * p) : grad;
  if (mom == 0) {
    p.sub_(g * lr);
    return;
  }
  auto it = st.tensors.find("momentum_buffer");
  Tensor<T> buf;
  if (it == st.tensors.end()) {
    buf = Tensor<T>(g * C(1));
    st.tensors.emplace("momentum_buffer", buf);
  } else {
    buf = it->second.template as<T>();
    buf.copy_(buf * mom + g * (1 - damp));
  }
  if (o.nesterov()) p.sub_((g + buf * mom) * lr);
  else p.sub_(buf * lr);
  ++st.step;
}

template <class V>
void BasicSGD<V>::validate() const {
  for (const auto& g : groups_) validate_options(g.options);
}

template <class V>
void BasicSGD<V>::check_dtype(const AnyTensor& p) {
  if constexpr (!std::is_void_v<V>) {
    if (p.defined() && p.dtype() != dtype_of<V>()) {
      throw DTypeError("BasicSGD<" + dtype_name(dtype_of<V>()) + ">: got a parameter of dtype " +
                       dtype_name(p.dtype()) + " (optim::SGD takes every floating dtype)");
    }
  }
}

template <class V>
void BasicSGD<V>::validate_options(const SGDOptions& o) const {
  // Written so that NaN fails every check.
  if (!(o.lr() >= 0)) throw Error("SGD: invalid learning rate " + std::to_string(o.lr()));
  if (!(o.momentum() >= 0))
    throw Error("SGD: invalid momentum value " + std::to_string(o.momentum()));
  if (!(o.weight_decay() >= 0))
    throw Error("SGD: invalid weight_decay value " + std::to_string(o.weight_decay()));
  if (!std::isfinite(o.dampening()))
    throw Error("SGD: invalid dampening value " + std::to_string(o.dampening()));
  if (o.nesterov() && (o.momentum() <= 0 || o.dampening() != 0)) {
    throw Error("SGD: Nesterov momentum requires a momentum and zero dampening");
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
  P template class lazy::optim::BasicSGD<void>;                                 \
  P template class lazy::optim::BasicSGD<float>;
#if LAZYTENSOR_EXPLICIT_INSTANTIATION
LAZYTENSOR_OPTIM_SGD_INSTANCES(extern)
#endif
