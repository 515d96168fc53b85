// optim/: SGD (momentum, dampening, Nesterov, weight decay), Adam, AdamW (with AMSGrad)
// against scalar reference loops in double over several steps; state_dict round trips
// that continue bit for bit; schedulers against their closed forms; a small training run.
#include <cmath>
#include <functional>

#include <gtest/gtest.h>

#include <lazytensor/lazytensor.hpp>
#include <lazytensor/nn.hpp>
#include <lazytensor/optim.hpp>

namespace {

using lazy::Shape;
using lazy::Tensor;
namespace optim = lazy::optim;

// The test problem: loss = sum(c * p^2 + p) with fixed c, so grad = 2 c p + 1.
const std::vector<float> kInit{0.5f, -1.0f, 2.0f, 0.25f}, kC{1.0f, 0.5f, 2.0f, 3.0f};

void loss_backward(const Tensor<float>& p) {
  auto c = lazy::from_vector<float>(kC, Shape{4});
  lazy::sum(c * p * p + p).backward();
}

// Runs `steps` updates of `opt` and returns the parameter values after each.
std::vector<std::vector<float>> run(optim::Optimizer& opt, Tensor<float>& p, int steps) {
  std::vector<std::vector<float>> out;
  for (int s = 0; s < steps; ++s) {
    opt.zero_grad();
    loss_backward(p);
    opt.step();
    lazy::mark_step();
    out.push_back(p.to_vector());
  }
  return out;
}

struct SgdRef {
  double lr, mom, damp, wd;
  bool nesterov;
  std::vector<double> p, buf;
  bool first = true;
  void step() {
    for (std::size_t i = 0; i < p.size(); ++i) {
      double g = 2 * kC[i] * p[i] + 1 + wd * p[i];
      if (mom != 0) {
        buf[i] = first ? g : mom * buf[i] + (1 - damp) * g;
        g = nesterov ? g + mom * buf[i] : buf[i];
      }
      p[i] -= lr * g;
    }
    first = false;
  }
};

TEST(Optimizers, SgdVariantsMatchReference) {
  struct Case {
    double lr, mom, damp, wd;
    bool nesterov;
  };
  for (const Case& k : {Case{0.1, 0, 0, 0, false}, Case{0.05, 0.9, 0, 0, false}, Case{0.05, 0.9, 0.3, 0.01, false},
                        Case{0.05, 0.8, 0, 0.1, true}}) {
    auto p = lazy::from_vector<float>(kInit, Shape{4}).requires_grad_();
    optim::SGD opt({p}, optim::SGDOptions(k.lr).momentum(k.mom).dampening(k.damp).weight_decay(k.wd).nesterov(k.nesterov));
    SgdRef ref{k.lr, k.mom, k.damp, k.wd, k.nesterov, {kInit.begin(), kInit.end()}, std::vector<double>(4)};
    const auto got = run(opt, p, 5);
    for (int s = 0; s < 5; ++s) {
      ref.step();
      for (int i = 0; i < 4; ++i) EXPECT_NEAR(got[s][i], ref.p[i], 1e-5) << "step " << s << " lr " << k.lr;
    }
  }
  auto p = lazy::zeros<float>({2}).requires_grad_();
  EXPECT_THROW(optim::SGD({p}, optim::SGDOptions(-1)), lazy::Error);
  EXPECT_THROW(optim::SGD({p}, optim::SGDOptions(0.1).nesterov(true)), lazy::Error);
}

struct AdamRef {
  double lr, b1, b2, eps, wd;
  bool decoupled, amsgrad;
  std::vector<double> p, m = std::vector<double>(4), v = std::vector<double>(4), vmax = std::vector<double>(4);
  int t = 0;
  void step() {
    ++t;
    for (std::size_t i = 0; i < p.size(); ++i) {
      double g = 2 * kC[i] * p[i] + 1;
      if (decoupled) p[i] *= 1 - lr * wd;
      else g += wd * p[i];
      m[i] = b1 * m[i] + (1 - b1) * g;
      v[i] = b2 * v[i] + (1 - b2) * g * g;
      vmax[i] = std::max(vmax[i], v[i]);
      const double vh = (amsgrad ? vmax[i] : v[i]) / (1 - std::pow(b2, t));
      p[i] -= lr * (m[i] / (1 - std::pow(b1, t))) / (std::sqrt(vh) + eps);
    }
  }
};

TEST(Optimizers, AdamAndAdamWMatchReference) {
  for (bool decoupled : {false, true}) {
    for (bool ams : {false, true}) {
      auto p = lazy::from_vector<float>(kInit, Shape{4}).requires_grad_();
      std::unique_ptr<optim::Optimizer> opt;
      if (decoupled) opt = std::make_unique<optim::AdamW>(std::vector{p}, optim::AdamWOptions(0.05).weight_decay(0.1).amsgrad(ams));
      else opt = std::make_unique<optim::Adam>(std::vector{p}, optim::AdamOptions(0.05).weight_decay(0.01).amsgrad(ams));
      AdamRef ref{0.05, 0.9, 0.999, 1e-8, decoupled ? 0.1 : 0.01, decoupled, ams, {kInit.begin(), kInit.end()}};
      const auto got = run(*opt, p, 8);
      for (int s = 0; s < 8; ++s) {
        ref.step();
        for (int i = 0; i < 4; ++i) EXPECT_NEAR(got[s][i], ref.p[i], 2e-5) << "step " << s;
      }
    }
  }
}

TEST(Optimizers, StateDictRoundTripContinuesExactly) {
  for (int kind = 0; kind < 2; ++kind) {
    auto make = [&](Tensor<float>& p) -> std::unique_ptr<optim::Optimizer> {
      if (kind == 0) return std::make_unique<optim::SGD>(std::vector{p}, optim::SGDOptions(0.05).momentum(0.9));
      return std::make_unique<optim::Adam>(std::vector{p}, optim::AdamOptions(0.03));
    };
    auto p1 = lazy::from_vector<float>(kInit, Shape{4}).requires_grad_();
    auto o1 = make(p1);
    run(*o1, p1, 3);
    const auto sd = o1->state_dict();
    // A fresh optimizer over a copy of the parameter, loaded from the state dict.
    auto p2 = lazy::from_vector<float>(p1.to_vector(), Shape{4}).requires_grad_();
    auto o2 = make(p2);
    o2->load_state_dict(sd);
    const auto a = run(*o1, p1, 3), b = run(*o2, p2, 3);
    EXPECT_EQ(a, b) << "kind " << kind;  // bitwise
  }
  auto p = lazy::zeros<float>({4}).requires_grad_();
  optim::SGD sgd({p}, optim::SGDOptions(0.1).momentum(0.5));
  optim::Adam adam({p}, optim::AdamOptions(0.1));
  EXPECT_THROW(adam.load_state_dict(sgd.state_dict()), lazy::Error);
  auto q = lazy::zeros<float>({5}).requires_grad_();
  optim::SGD other({q}, optim::SGDOptions(0.1).momentum(0.5));
  lazy::sum(q * q).backward();
  other.step();
  EXPECT_THROW(sgd.load_state_dict(other.state_dict()), lazy::ShapeError);
}

TEST(Optimizers, LoadedStateIsNotSharedWithTheStateDict) {
  // Loading twice from one state dict must restore the same moments: the updates between
  // must not reach the dict's tensors (a rollback), nor another optimizer loaded from it.
  auto p = lazy::from_vector<float>(kInit, Shape{4}).requires_grad_();
  optim::Adam a({p}, optim::AdamOptions(0.03));
  run(a, p, 2);
  const auto ck = a.state_dict();
  const auto saved = ck.at("state.0.exp_avg").as<float>().to_vector();
  const auto p_saved = p.to_vector();
  auto q = lazy::from_vector<float>(p_saved, Shape{4}).requires_grad_();
  optim::Adam b({q}, optim::AdamOptions(0.03));
  b.load_state_dict(ck);
  run(b, q, 3);
  EXPECT_EQ(ck.at("state.0.exp_avg").as<float>().to_vector(), saved);
  // b again from the dict, and a copy from it too: both continue alike from step 2.
  auto r = lazy::from_vector<float>(p_saved, Shape{4}).requires_grad_();
  optim::Adam c({r}, optim::AdamOptions(0.03));
  c.load_state_dict(ck);
  auto q2 = lazy::from_vector<float>(p_saved, Shape{4}).requires_grad_();
  b.params(0) = {q2};
  b.load_state_dict(ck);
  EXPECT_EQ(run(b, q2, 2), run(c, r, 2));
}

TEST(Optimizers, LoadStateDictChecksEverythingFirst) {
  auto p = lazy::from_vector<float>(kInit, Shape{4}).requires_grad_();
  auto w = lazy::zeros<float>({2}).requires_grad_();
  optim::Adam a({optim::Adam::ParamGroup{{p}, optim::AdamOptions(0.03)},
                 optim::Adam::ParamGroup{{w}, optim::AdamOptions(0.5)}});
  run(a, p, 1);
  const auto good = a.state_dict();
  // beta1 = 1 would divide by a zero bias correction: NaN parameters.
  auto bad = good;
  bad.metadata()["param_groups.1.beta1"] = "1";
  EXPECT_THROW(a.load_state_dict(bad), lazy::Error);
  bad = good;
  bad.metadata()["param_groups.0.lr"] = "nan";
  EXPECT_THROW(a.load_state_dict(bad), lazy::Error);
  // Nothing changed by the failed loads: group 0 keeps its rate.
  EXPECT_DOUBLE_EQ(a.lr(0), 0.03);
  EXPECT_DOUBLE_EQ(a.lr(1), 0.5);
  // A negative step count; a step saved as a float (PyTorch's form) loads.
  bad = good;
  bad.insert_or_assign("state.0.step", lazy::AnyTensor(lazy::full<std::int64_t>(Shape{}, -1)));
  EXPECT_THROW(a.load_state_dict(bad), lazy::Error);
  auto as_float = good;
  as_float.insert_or_assign("state.0.step", lazy::AnyTensor(lazy::full<float>(Shape{}, 1.0f)));
  EXPECT_NO_THROW(a.load_state_dict(as_float));
  as_float.insert_or_assign("state.0.step", lazy::AnyTensor(lazy::full<float>(Shape{}, 1.5f)));
  EXPECT_THROW(a.load_state_dict(as_float), lazy::Error);
}

TEST(Optimizers, RejectNaNOptionsAndRepeatedParameters) {
  auto p = lazy::zeros<float>({4}).requires_grad_();
  EXPECT_THROW(optim::Adam({p}, optim::AdamOptions(std::nan(""))), lazy::Error);
  EXPECT_THROW(optim::Adam({p}, optim::AdamOptions(0.1).betas({std::nan(""), 0.9})), lazy::Error);
  EXPECT_THROW(optim::SGD({p}, optim::SGDOptions(0.1).momentum(std::nan(""))), lazy::Error);
  // The same tensor twice (or in two groups) would be updated twice per step.
  EXPECT_THROW(optim::SGD({p, p}, optim::SGDOptions(0.1)), lazy::Error);
  auto q = lazy::zeros<float>({4});
  optim::SGD sgd({p}, optim::SGDOptions(0.1));
  EXPECT_THROW(sgd.add_param_group({{p}, optim::SGDOptions(0.1)}), lazy::Error);
  EXPECT_EQ(sgd.num_param_groups(), 1u);
  optim::Adam adam({p}, optim::AdamOptions(0.1));
  EXPECT_THROW(adam.add_param_group({{q}, optim::AdamOptions(0.1).betas({1.0, 0.999})}),
               lazy::Error);
  // A valid group is added, its parameters made to require gradients (as the constructor's).
  adam.add_param_group({{q}, optim::AdamOptions(0.1)});
  EXPECT_EQ(adam.num_param_groups(), 2u);
  EXPECT_TRUE(q.requires_grad());
  // BasicSGD<float> compiles the float update only: a double parameter is refused by the
  // constructor and by add_param_group alike, leaving the groups as they were.
  auto d = lazy::zeros<double>({4});
  EXPECT_THROW(optim::BasicSGD<float>({lazy::AnyTensor(d)}, optim::SGDOptions(0.1)), lazy::DTypeError);
  optim::BasicSGD<float> float_sgd({p}, optim::SGDOptions(0.1));
  EXPECT_THROW(float_sgd.add_param_group({{lazy::AnyTensor(d)}, optim::SGDOptions(0.1)}), lazy::DTypeError);
  EXPECT_EQ(float_sgd.num_param_groups(), 1u);
  EXPECT_FALSE(d.requires_grad());
  float_sgd.add_param_group({{lazy::AnyTensor(lazy::zeros<float>({4}))}, optim::SGDOptions(0.1)});
  EXPECT_EQ(float_sgd.num_param_groups(), 2u);
}

TEST(Schedulers, ClosedForms) {
  auto p = lazy::zeros<float>({1}).requires_grad_();
  optim::SGD a({p}, optim::SGDOptions(1.0));
  optim::StepLR step(a, 3, 0.5);
  for (int e = 1; e <= 7; ++e) {
    step.step();
    EXPECT_DOUBLE_EQ(a.lr(), std::pow(0.5, e / 3));
  }
  optim::SGD b({p}, optim::SGDOptions(0.2));
  optim::CosineAnnealingLR cos(b, 10, 0.01);
  for (int e = 1; e <= 10; ++e) {
    cos.step();
    EXPECT_NEAR(b.lr(), 0.01 + 0.19 * (1 + std::cos(M_PI * e / 10)) / 2, 1e-12);
  }
  optim::SGD c({p}, optim::SGDOptions(0.3));
  optim::LinearLR lin(c, 0.5, 1.0, 4);
  EXPECT_NEAR(c.lr(), 0.15, 1e-12);
  for (int e = 1; e <= 6; ++e) {
    lin.step();
    EXPECT_NEAR(c.lr(), 0.3 * (e >= 4 ? 1.0 : 0.5 + 0.5 * e / 4), 1e-12);
  }
}

TEST(Training, SyntheticClassificationLossDrops) {
  lazy::manual_seed(7);
  // Two Gaussian blobs per class in 2-D, 3 classes; an MLP must separate them.
  std::vector<float> xs;
  std::vector<std::int64_t> ys;
  for (int i = 0; i < 96; ++i) {
    const int c = i % 3;
    xs.push_back(static_cast<float>(std::cos(2.1 * c) * 2 + std::sin(i * 12.9898) * 0.3));
    xs.push_back(static_cast<float>(std::sin(2.1 * c) * 2 + std::cos(i * 78.233) * 0.3));
    ys.push_back(c);
  }
  auto x = lazy::from_vector<float>(xs, Shape{96, 2});
  auto y = lazy::from_vector<std::int64_t>(ys, Shape{96});
  lazy::nn::Sequential net(lazy::nn::Linear(2, 16), lazy::nn::ReLU(), lazy::nn::Linear(16, 3));
  optim::SGD opt(net->parameters(), optim::SGDOptions(0.1).momentum(0.9));
  float first = 0, last = 0;
  for (int s = 0; s < 60; ++s) {
    opt.zero_grad();
    Tensor<float> loss = lazy::nn::functional::cross_entropy(net(x), y);
    loss.backward();
    opt.step();
    lazy::mark_step();
    (s == 0 ? first : last) = loss.item();
  }
  EXPECT_GT(first, 0.9f);
  EXPECT_LT(last, 0.05f);
}

}  // namespace
