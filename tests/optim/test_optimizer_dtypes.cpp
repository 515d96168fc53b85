// optim on double and bfloat16 parameters, and gradient clipping of AnyTensor parameters.
// - OptimDouble: SGD (plain, momentum, dampening, Nesterov, weight decay), Adam and AdamW
//   (with and without AMSGrad) on double parameters against scalar reference loops in
//   double written here from torch's update formulas, to 1e-12 relative.
// - OptimBFloat16: the same updates on bfloat16 parameters against the same references, to
//   a tolerance derived from bfloat16's precision.
// - OptimDTypeState: state tensors in each parameter's own dtype (float and double in one
//   optimizer), load_state_dict's dtype check, double state round trips.
// - OptimDTypeModel: a double model (Module::to(Float64)) trained with mse_loss by
//   optimizers built from model->parameters().
// - ClipGradAnyTensor: clip_grad_norm_ / clip_grad_value_ on std::vector<AnyTensor> against
//   host references; DTypeError for float and double gradients in one norm.
#include <algorithm>
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include <lazytensor/lazytensor.hpp>
#include <lazytensor/nn.hpp>
#include <lazytensor/optim.hpp>

#include "testing/helpers.hpp"

namespace optim_dtypes_test {

using lazy::AnyTensor;
using lazy::bfloat16;
using lazy::DType;
using lazy::Shape;
using lazy::Tensor;
using Vec = std::vector<double>;
namespace nn = lazy::nn;
namespace optim = lazy::optim;

// ---- the test problem ------------------------------------------------------------------

// Two parameters, [4] and [2, 3], and loss = sum(c * p^2 + p): grad = 2 c p + 1 element-wise.
const Vec kInit{0.5, -1.0, 2.0, 0.25, 1.5, -0.75, 0.125, -2.0, 1.0, 0.375};
const Vec kC{1.0, 0.5, 2.0, 3.0, 0.25, 1.5, 0.75, 0.5, 2.5, 1.25};
const Shape kShapes[2] = {Shape{4}, Shape{2, 3}};

double bf_round(double v) { return static_cast<float>(bfloat16(static_cast<float>(v))); }
Vec bf_round(Vec v) {
  for (double& x : v) x = bf_round(x);
  return v;
}

// A tensor of run-time dtype `d` holding `v`.
AnyTensor make(DType d, const Vec& v, const Shape& s) {
  switch (d) {
    case DType::Float64: return lazy::from_vector<double>(v, s);
    case DType::BFloat16: return lazy::from_vector<bfloat16>(std::vector<bfloat16>(v.begin(), v.end()), s);
    default: return lazy::from_vector<float>(std::vector<float>(v.begin(), v.end()), s);
  }
}
Vec host(const AnyTensor& t) {
  return t.visit([](const auto& typed) {
    Vec out;
    for (const auto& v : typed.to_vector()) out.push_back(lazy_tests::num(v));
    return out;
  });
}
Vec slice(const Vec& v, std::size_t k) {
  const std::size_t b = k == 0 ? 0 : 4;
  return Vec(v.begin() + b, v.begin() + b + kShapes[k].numel());
}

// The two parameters, of dtypes d0 and d1, starting at `init`.
std::vector<AnyTensor> make_params(DType d0, DType d1, const Vec& init = kInit) {
  return {make(d0, slice(init, 0), kShapes[0]).requires_grad_(),
          make(d1, slice(init, 1), kShapes[1]).requires_grad_()};
}
// Both parameters' values, concatenated.
Vec values(const std::vector<AnyTensor>& ps) {
  Vec out;
  for (const auto& p : ps)
    for (double v : host(p)) out.push_back(v);
  return out;
}
void loss_backward(const std::vector<AnyTensor>& ps, const Vec& c) {
  for (std::size_t k = 0; k < ps.size(); ++k) {
    ps[k].visit([&](const auto& p) {
      using T = typename std::decay_t<decltype(p)>::value_type;
      if constexpr (lazy::is_floating_v<T>) {
        const Tensor<T> ck = make(p.dtype, slice(c, k), p.shape()).template as<T>();
        lazy::sum(ck * p * p + p).backward();
      }
    });
  }
}
// Runs `steps` updates; the parameter values after each.
std::vector<Vec> run(optim::Optimizer& opt, const std::vector<AnyTensor>& ps, int steps, const Vec& c = kC) {
  std::vector<Vec> out;
  for (int s = 0; s < steps; ++s) {
    opt.zero_grad();
    loss_backward(ps, c);
    opt.step();
    lazy::mark_step();
    out.push_back(values(ps));
  }
  return out;
}

// ---- references (torch.optim's update formulas, in double) -----------------------------

struct SgdRef {
  double lr, mom = 0, damp = 0, wd = 0;
  bool nesterov = false;
  Vec p = kInit, c = kC, buf = Vec(kInit.size());
  bool first = true;
  void step() {
    for (std::size_t i = 0; i < p.size(); ++i) {
      double g = 2 * c[i] * p[i] + 1 + wd * p[i];
      if (mom != 0) {
        buf[i] = first ? g : mom * buf[i] + (1 - damp) * g;
        g = nesterov ? g + mom * buf[i] : buf[i];
      }
      p[i] -= lr * g;
    }
    first = false;
  }
};

struct AdamRef {
  double lr, wd;
  bool decoupled, amsgrad;
  double b1 = 0.8, b2 = 0.6, eps = 1e-8;  // a short second-moment memory: v decreases, AMSGrad matters
  Vec p = kInit, c = kC, m = Vec(kInit.size()), v = Vec(kInit.size()), vmax = Vec(kInit.size());
  int t = 0;
  void step() {
    ++t;
    for (std::size_t i = 0; i < p.size(); ++i) {
      double g = 2 * c[i] * p[i] + 1;
      if (decoupled) p[i] *= 1 - lr * wd;
      else g += wd * p[i];
      m[i] = b1 * m[i] + (1 - b1) * g;
      v[i] = b2 * v[i] + (1 - b2) * g * g;
      vmax[i] = std::max(vmax[i], v[i]);
      const double vhat = (amsgrad ? vmax[i] : v[i]) / (1 - std::pow(b2, t));
      p[i] -= lr * (m[i] / (1 - std::pow(b1, t))) / (std::sqrt(vhat) + eps);
    }
  }
};

// Element-wise |got - want| <= tol(want, step).
template <class Tol>
void expect_trajectory(const std::vector<Vec>& got, const std::vector<Vec>& want, Tol tol,
                       const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (std::size_t s = 0; s < got.size(); ++s) {
    ASSERT_EQ(got[s].size(), want[s].size()) << what;
    for (std::size_t i = 0; i < got[s].size(); ++i) {
      EXPECT_NEAR(got[s][i], want[s][i], tol(want[s][i], s))
          << what << ", step " << s + 1 << ", element " << i;
    }
  }
}
auto rel_double = [](double want, std::size_t) { return 1e-12 * std::max(1.0, std::abs(want)); };

struct SgdCase {
  double lr, mom, damp, wd;
  bool nesterov;
};
const SgdCase kSgdCases[] = {{0.1, 0, 0, 0, false},     {0.1, 0, 0, 0.2, false},   {0.05, 0.9, 0, 0, false},
                             {0.05, 0.9, 0.3, 0.01, false}, {0.05, 0.8, 0, 0.1, true}};
std::string sgd_name(const SgdCase& k) {
  return "SGD lr " + std::to_string(k.lr) + " momentum " + std::to_string(k.mom) + " dampening " +
         std::to_string(k.damp) + " wd " + std::to_string(k.wd) + (k.nesterov ? " nesterov" : "");
}
optim::SGDOptions sgd_options(const SgdCase& k) {
  return optim::SGDOptions(k.lr).momentum(k.mom).dampening(k.damp).weight_decay(k.wd).nesterov(k.nesterov);
}
optim::AdamOptions adam_options(bool decoupled, bool ams) {
  optim::AdamOptions o(0.05);
  o.betas({0.8, 0.6}).weight_decay(decoupled ? 0.1 : 0.01).amsgrad(ams);
  return o;
}
std::unique_ptr<optim::Optimizer> make_adam(std::vector<AnyTensor> ps, bool decoupled, bool ams) {
  if (decoupled) return std::make_unique<optim::AdamW>(ps, adam_options(decoupled, ams));
  return std::make_unique<optim::Adam>(ps, adam_options(decoupled, ams));
}
AdamRef adam_ref(bool decoupled, bool ams) { return {0.05, decoupled ? 0.1 : 0.01, decoupled, ams}; }

// ---- double ----------------------------------------------------------------------------

TEST(OptimDouble, SgdVariantsMatchTheReference) {
  for (const SgdCase& k : kSgdCases) {
    auto ps = make_params(DType::Float64, DType::Float64);
    optim::SGD opt(ps, sgd_options(k));
    SgdRef ref{k.lr, k.mom, k.damp, k.wd, k.nesterov};
    std::vector<Vec> want;
    for (int s = 0; s < 6; ++s) ref.step(), want.push_back(ref.p);
    expect_trajectory(run(opt, ps, 6), want, rel_double, sgd_name(k));
    for (const auto& p : ps) EXPECT_EQ(p.dtype(), DType::Float64);
  }
}

TEST(OptimDouble, AdamAndAdamWWithAndWithoutAmsgradMatchTheReference) {
  for (bool decoupled : {false, true}) {
    for (bool ams : {false, true}) {
      auto ps = make_params(DType::Float64, DType::Float64);
      // Built from typed handles here (the AnyTensor constructor is used everywhere else).
      std::vector<Tensor<double>> typed{ps[0].as<double>(), ps[1].as<double>()};
      std::unique_ptr<optim::Optimizer> opt;
      if (decoupled) opt = std::make_unique<optim::AdamW>(typed, adam_options(decoupled, ams));
      else opt = std::make_unique<optim::Adam>(typed, adam_options(decoupled, ams));
      AdamRef ref = adam_ref(decoupled, ams);
      std::vector<Vec> want;
      for (int s = 0; s < 8; ++s) ref.step(), want.push_back(ref.p);
      expect_trajectory(run(*opt, ps, 8), want, rel_double,
                        std::string(decoupled ? "AdamW" : "Adam") + (ams ? " amsgrad" : ""));
    }
  }
}

// ---- bfloat16 --------------------------------------------------------------------------

// bfloat16 rounds to 8 significant bits (unit roundoff u = 2^-8). A step rounds the new
// parameter (off by at most u |p|) and the gradient, the state and the update, which enter
// p scaled by lr (together about another u max(1, |p|) here). The problem does not amplify
// earlier errors (lr * 2c <= 0.5 < 1), so after s steps the parameter is within about
// s * 2u * max(1, |p|) of the exact trajectory (measured: at most 0.5 of that). The reference
// starts from the same bf16-rounded values.
auto bf16_tol = [](double want, std::size_t s) {
  return (s + 1) * 2 * std::ldexp(1.0, -8) * std::max(1.0, std::abs(want));
};

TEST(OptimBFloat16, SgdAdamAndAdamWTrackTheReference) {
  const Vec init = bf_round(kInit), c = bf_round(kC);
  const int steps = 5;
  for (const SgdCase& k : kSgdCases) {
    auto ps = make_params(DType::BFloat16, DType::BFloat16, init);
    optim::SGD opt(ps, sgd_options(k));
    SgdRef ref{k.lr, k.mom, k.damp, k.wd, k.nesterov, init, c};
    std::vector<Vec> want;
    for (int s = 0; s < steps; ++s) ref.step(), want.push_back(ref.p);
    expect_trajectory(run(opt, ps, steps, c), want, bf16_tol, "bf16 " + sgd_name(k));
    for (const auto& p : ps) EXPECT_EQ(p.dtype(), DType::BFloat16);
  }
  for (bool decoupled : {false, true}) {
    for (bool ams : {false, true}) {
      auto ps = make_params(DType::BFloat16, DType::BFloat16, init);
      auto opt = make_adam(ps, decoupled, ams);
      AdamRef ref = adam_ref(decoupled, ams);
      ref.p = init, ref.c = c;
      std::vector<Vec> want;
      for (int s = 0; s < steps; ++s) ref.step(), want.push_back(ref.p);
      expect_trajectory(run(*opt, ps, steps, c), want, bf16_tol,
                        std::string("bf16 ") + (decoupled ? "AdamW" : "Adam") + (ams ? " amsgrad" : ""));
    }
  }
}

// ---- state -----------------------------------------------------------------------------

TEST(OptimDTypeState, StateTensorsHaveTheirParametersDType) {
  const std::pair<DType, DType> mixes[] = {{DType::Float32, DType::Float64},
                                           {DType::Float64, DType::BFloat16},
                                           {DType::BFloat16, DType::Float64}};
  for (const auto& [d0, d1] : mixes) {
    const std::string what = lazy::dtype_name(d0) + " + " + lazy::dtype_name(d1);
    auto ps = make_params(d0, d1);
    optim::SGD sgd(ps, optim::SGDOptions(0.05).momentum(0.9));
    run(sgd, ps, 2);
    const auto s1 = sgd.state_dict();
    EXPECT_EQ(s1.at("state.0.momentum_buffer").dtype(), d0) << what;
    EXPECT_EQ(s1.at("state.1.momentum_buffer").dtype(), d1) << what;
    EXPECT_EQ(s1.at("state.1.step").dtype(), DType::Int64) << what;

    auto qs = make_params(d0, d1);
    auto adam = make_adam(qs, /*decoupled=*/false, /*ams=*/true);
    const auto got = run(*adam, qs, 3);
    const auto s2 = adam->state_dict();
    for (const char* name : {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"}) {
      EXPECT_EQ(s2.at(std::string("state.0.") + name).dtype(), d0) << what << " " << name;
      EXPECT_EQ(s2.at(std::string("state.1.") + name).dtype(), d1) << what << " " << name;
    }
    EXPECT_EQ(s2.at("state.0.step").as<std::int64_t>().item(), 3);
    EXPECT_EQ(qs[0].dtype(), d0);
    EXPECT_EQ(qs[1].dtype(), d1);
    // Each parameter follows the reference to its own dtype's precision: the double one
    // as in OptimDouble (its updates never mix with the other parameter's dtype).
    AdamRef ref = adam_ref(false, true);
    std::vector<Vec> want;
    for (int s = 0; s < 3; ++s) ref.step(), want.push_back(ref.p);
    for (std::size_t i = 0; i < kInit.size(); ++i) {
      const DType d = i < 4 ? d0 : d1;
      const double scale = std::max(1.0, std::abs(want[2][i]));
      const double tol = d == DType::Float64   ? 1e-12 * scale
                         : d == DType::Float32 ? 1e-6 * scale
                                               : bf16_tol(want[2][i], 2);
      EXPECT_NEAR(got[2][i], want[2][i], tol) << what << " element " << i;
    }
  }
}

TEST(OptimDTypeState, LoadStateDictChecksTheDTypeAndDoubleStateRoundTrips) {
  for (int kind = 0; kind < 2; ++kind) {
    auto make_opt = [&](const std::vector<AnyTensor>& ps) -> std::unique_ptr<optim::Optimizer> {
      if (kind == 0) return std::make_unique<optim::SGD>(ps, optim::SGDOptions(0.05).momentum(0.9));
      return make_adam(ps, /*decoupled=*/false, /*ams=*/true);
    };
    auto ps = make_params(DType::Float64, DType::Float64);
    auto opt = make_opt(ps);
    run(*opt, ps, 3);
    const auto sd = opt->state_dict();

    auto fs = make_params(DType::Float32, DType::Float32);
    auto float_opt = make_opt(fs);
    run(*float_opt, fs, 1);
    EXPECT_THROW(opt->load_state_dict(float_opt->state_dict()), lazy::DTypeError) << "kind " << kind;

    // The failed load changed nothing: the optimizer continues as its copy loaded from sd.
    auto qs = make_params(DType::Float64, DType::Float64, values(ps));
    auto copy = make_opt(qs);
    copy->load_state_dict(sd);
    EXPECT_EQ(run(*opt, ps, 3), run(*copy, qs, 3)) << "kind " << kind;  // bitwise
    // And both still follow the reference over all six steps.
    std::vector<Vec> want;
    if (kind == 0) {
      SgdRef ref{0.05, 0.9};
      for (int s = 0; s < 6; ++s) ref.step();
      want.push_back(ref.p);
    } else {
      AdamRef ref = adam_ref(false, true);
      for (int s = 0; s < 6; ++s) ref.step();
      want.push_back(ref.p);
    }
    expect_trajectory({values(ps)}, want, rel_double, "kind " + std::to_string(kind));
  }
}

// ---- a double model --------------------------------------------------------------------

TEST(OptimDTypeModel, DoubleModelTrainsWithMseLoss) {
  const auto xs = lazy_tests::random_values<double>(32 * 3, 5);
  Vec ys;
  for (int i = 0; i < 32; ++i) ys.push_back(std::sin(2 * xs[i * 3]) + 0.5 * xs[i * 3 + 1] * xs[i * 3 + 2]);
  const auto x = lazy::from_vector<double>(xs, Shape{32, 3});
  const auto y = lazy::from_vector<double>(ys, Shape{32, 1});
  for (int kind = 0; kind < 3; ++kind) {
    lazy::manual_seed(11);
    nn::Linear first_layer(3, 16);
    nn::Sequential model(first_layer, nn::Tanh(), nn::Linear(16, 1));
    model->to(DType::Float64);
    const Vec w0 = host(AnyTensor(first_layer->weight));
    std::unique_ptr<optim::Optimizer> opt;
    const auto params = model->parameters();
    if (kind == 0) opt = std::make_unique<optim::SGD>(params, optim::SGDOptions(0.1).momentum(0.9));
    else if (kind == 1) opt = std::make_unique<optim::Adam>(params, optim::AdamOptions(0.02));
    else opt = std::make_unique<optim::AdamW>(params, optim::AdamWOptions(0.02));
    double first = 0, last = 0;
    for (int s = 0; s < 80; ++s) {
      opt->zero_grad();
      Tensor<double> loss = nn::functional::mse_loss(model(x), y);
      loss.backward();
      opt->step();
      lazy::mark_step();
      (s == 0 ? first : last) = loss.item();
    }
    EXPECT_LT(last, 0.2 * first) << "kind " << kind << ": loss " << first << " -> " << last;
    for (const auto& p : model->parameters()) EXPECT_EQ(p.dtype(), DType::Float64);
    for (const auto& [name, t] : opt->state_dict()) {
      if (name.size() < 5 || name.substr(name.size() - 5) != ".step") {
        EXPECT_EQ(t.dtype(), DType::Float64) << name;
      }
    }
    EXPECT_NE(host(AnyTensor(first_layer->weight)), w0) << "the optimizer updates the module's parameters";
  }
}

// ---- gradient clipping -----------------------------------------------------------------

// Gradients g_i = (-1)^i c_i, set on parameters of dtypes d0 and d1.
std::vector<AnyTensor> params_with_grads(DType d0, DType d1) {
  auto ps = make_params(d0, d1);
  for (std::size_t k = 0; k < 2; ++k) {
    Vec g = slice(kC, k);
    for (std::size_t i = 0; i < g.size(); ++i) g[i] *= i % 2 ? -1 : 1;
    ps[k].set_grad(make(ps[k].dtype(), g, kShapes[k]));
  }
  return ps;
}
Vec grads(const std::vector<AnyTensor>& ps) {
  Vec out;
  for (const auto& p : ps)
    for (double v : host(p.grad())) out.push_back(v);
  return out;
}

TEST(ClipGradAnyTensor, NormMatchesTheReferenceInTheGradientsDType) {
  for (DType d : {DType::Float64, DType::BFloat16}) {
    // double: to rounding; bfloat16: the sum of |g|^p and its root each round (u = 2^-8).
    const double rtol = d == DType::Float64 ? 1e-12 : 2e-2;
    for (double norm_type : {2.0, 1.0, 3.0, double(INFINITY)}) {
      for (double max_norm : {0.5, 100.0}) {
        const std::string what =
            lazy::dtype_name(d) + " norm " + std::to_string(norm_type) + " max " + std::to_string(max_norm);
        auto ps = params_with_grads(d, d);
        const Vec g = grads(ps);
        double total = 0;
        for (double v : g) {
          total = std::isinf(norm_type) ? std::max(total, std::abs(v)) : total + std::pow(std::abs(v), norm_type);
        }
        if (!std::isinf(norm_type)) total = std::pow(total, 1 / norm_type);
        const AnyTensor got = nn::utils::clip_grad_norm_(ps, max_norm, norm_type);
        ASSERT_EQ(got.dtype(), d) << what;
        EXPECT_NEAR(host(got)[0], total, rtol * total) << what;
        const double coef = std::min(1.0, max_norm / (total + 1e-6));
        const Vec clipped = grads(ps);
        for (std::size_t i = 0; i < g.size(); ++i) {
          EXPECT_NEAR(clipped[i], g[i] * coef, rtol * std::abs(g[i])) << what << " " << i;
        }
        for (const auto& p : ps) EXPECT_EQ(p.grad().dtype(), d);
      }
    }
  }
}

TEST(ClipGradAnyTensor, ValueClampsEachDTypeAndMixedDTypesInOneNormRaise) {
  auto ps = params_with_grads(DType::Float32, DType::Float64);
  const Vec g = grads(ps);
  nn::utils::clip_grad_value_(ps, 0.8);
  const Vec clipped = grads(ps);
  for (std::size_t i = 0; i < g.size(); ++i) EXPECT_NEAR(clipped[i], std::clamp(g[i], -0.8, 0.8), 1e-7) << i;
  EXPECT_EQ(ps[0].grad().dtype(), DType::Float32);
  EXPECT_EQ(ps[1].grad().dtype(), DType::Float64);

  auto mixed = params_with_grads(DType::Float32, DType::Float64);
  const Vec before = grads(mixed);
  try {
    nn::utils::clip_grad_norm_(mixed, 0.1);
    ADD_FAILURE() << "float and double gradients in one clip_grad_norm_ must raise";
  } catch (const lazy::DTypeError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("float32"), std::string::npos) << msg;
    EXPECT_NE(msg.find("float64"), std::string::npos) << msg;
  }
  EXPECT_EQ(grads(mixed), before) << "a refused clip must change nothing";

  // A float parameter without a gradient does not count: the double ones are clipped.
  auto some = params_with_grads(DType::Float32, DType::Float64);
  some[0].set_grad(AnyTensor());
  const Vec g1 = host(some[1].grad());
  double total = 0;
  for (double v : g1) total += v * v;
  total = std::sqrt(total);
  const AnyTensor norm = nn::utils::clip_grad_norm_(some, 1.0);
  EXPECT_EQ(norm.dtype(), DType::Float64);
  EXPECT_NEAR(host(norm)[0], total, 1e-12 * total);
  const Vec c1 = host(some[1].grad());
  for (std::size_t i = 0; i < g1.size(); ++i) EXPECT_NEAR(c1[i], g1[i] / (total + 1e-6), 1e-12) << i;
}

}  // namespace optim_dtypes_test
