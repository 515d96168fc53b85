// nn/module.hpp and the layers: registration and naming, state_dict / load_state_dict
// (round trip, missing / unexpected / mis-shaped entries), train / eval, zero_grad, to(),
// printing; each layer's forward against a reference computed on the host.
#include <cmath>
#include <limits>
#include <numeric>

#include <gtest/gtest.h>

#include <lazytensor/lazytensor.hpp>
#include <lazytensor/nn.hpp>

namespace {

using lazy::Shape;
using lazy::Tensor;
namespace nn = lazy::nn;

struct Net : nn::Module {
  Net() : Module("Net") {
    fc1 = register_module("fc1", nn::Linear(4, 3));
    bn = register_module("bn", nn::BatchNorm1d(3));
    fc2 = register_module("fc2", nn::Linear(3, 2, /*bias=*/false));
  }
  Tensor<float> forward(const Tensor<float>& x) { return fc2(lazy::relu(bn(fc1(x)))); }
  nn::Linear fc1{nullptr}, fc2{nullptr};
  nn::BatchNorm1d bn{nullptr};
};

std::vector<float> host(const Tensor<float>& t) { return t.to_vector(); }

TEST(Module, NamesOrderAndStateDict) {
  Net net;
  std::vector<std::string> names;
  for (auto& [n, p] : net.named_parameters()) names.push_back(n);
  EXPECT_EQ(names, (std::vector<std::string>{"fc1.weight", "fc1.bias", "bn.weight", "bn.bias", "fc2.weight"}));
  EXPECT_EQ(net.parameters().size(), 5u);
  for (auto& p : net.parameters()) EXPECT_TRUE(p.requires_grad());
  // torch's order: module by module, parameters before buffers.
  EXPECT_EQ(net.state_dict().keys(),
            (std::vector<std::string>{"fc1.weight", "fc1.bias", "bn.weight", "bn.bias", "bn.running_mean",
                                      "bn.running_var", "bn.num_batches_tracked", "fc2.weight"}));
  EXPECT_NE(net.str().find("(fc1): Linear(in_features=4, out_features=3, bias=True)"), std::string::npos);
}

TEST(Module, LoadStateDictSharesValuesAndChecksEverything) {
  Net a, b;
  b.load_state_dict(a.state_dict());
  for (std::size_t i = 0; i < a.parameters().size(); ++i) {
    EXPECT_EQ(host(a.parameters()[i]), host(b.parameters()[i]));
  }
  // The module's own member handles see the loaded values (shared tensor objects).
  EXPECT_EQ(host(a.fc1->weight), host(b.fc1->weight));

  auto sd = a.state_dict();
  lazy::StateDict missing;
  for (auto& [k, v] : sd)
    if (k != "fc2.weight") missing.insert(k, v);
  EXPECT_THROW(b.load_state_dict(missing), lazy::Error);
  EXPECT_NO_THROW(b.load_state_dict(missing, /*strict=*/false));

  lazy::StateDict extra = sd;
  extra.insert("fc3.weight", lazy::zeros<float>({1}));
  EXPECT_THROW(b.load_state_dict(extra), lazy::Error);

  lazy::StateDict wrong_shape;
  for (auto& [k, v] : sd) wrong_shape.insert(k, k == "fc1.weight" ? lazy::AnyTensor(lazy::zeros<float>({3, 5})) : v);
  const auto before = host(b.fc1->weight);
  EXPECT_THROW(b.load_state_dict(wrong_shape), lazy::ShapeError);
  EXPECT_EQ(host(b.fc1->weight), before) << "a failed load must change nothing";

  lazy::StateDict wrong_dtype;
  for (auto& [k, v] : sd) wrong_dtype.insert(k, k == "fc1.bias" ? lazy::AnyTensor(lazy::zeros<double>({3})) : v);
  EXPECT_THROW(b.load_state_dict(wrong_dtype), lazy::DTypeError);
}

TEST(Module, TrainEvalZeroGradAndTo) {
  Net net;
  EXPECT_TRUE(net.is_training());
  net.eval();
  EXPECT_FALSE(net.bn->is_training());
  net.train();
  EXPECT_TRUE(net.fc1->is_training());

  auto x = lazy::randn<float>({5, 4});
  lazy::sum(net.forward(x)).backward();
  for (auto& p : net.parameters()) EXPECT_TRUE(p.grad().defined());
  net.zero_grad(/*set_to_none=*/false);
  for (auto& p : net.parameters()) {
    for (float v : host(p.grad())) EXPECT_EQ(v, 0.0f);
  }
  net.zero_grad();
  for (auto& p : net.parameters()) EXPECT_FALSE(p.grad().defined());

  const auto w = host(net.fc1->weight);
  net.to(lazy::Device(1));
  EXPECT_EQ(net.fc1->weight.device(), lazy::Device(1));
  EXPECT_EQ(net.bn->running_mean.device(), lazy::Device(1));
  EXPECT_EQ(host(net.fc1->weight), w);
  net.to(lazy::Device(0));
}

TEST(Module, MovedParametersAreStepRootsOnTheirNewDevice) {
  // After to(device), a parameter's later updates are pending on the new device and that
  // device's mark_step must materialize them (the handle is registered there now).
  nn::Linear fc(3, 2);
  const auto w = host(fc->weight);
  fc->to(lazy::Device(1));
  lazy::set_device(lazy::Device(1));
  {
    lazy::NoGradGuard no_grad;
    fc->weight.add_(1.0f);
  }
  ASSERT_TRUE(fc->weight.node()->pending());
  lazy::mark_step();
  lazy::wait_device_ops();
  EXPECT_FALSE(fc->weight.node()->pending())
      << "device 1's mark_step did not see the moved parameter";
  lazy::set_device(lazy::Device(0));
  const auto after = host(fc->weight);
  ASSERT_EQ(after.size(), w.size());
  for (std::size_t i = 0; i < w.size(); ++i) EXPECT_EQ(after[i], w[i] + 1.0f);
}

TEST(Module, RegistrationErrors) {
  nn::Module m("M");
  m.register_parameter("w", lazy::zeros<float>({2}));
  EXPECT_THROW(m.register_parameter("w", lazy::zeros<float>({2})), lazy::Error);
  EXPECT_THROW(m.register_parameter("a.b", lazy::zeros<float>({2})), lazy::Error);
  EXPECT_THROW(m.register_parameter("u", Tensor<float>()), lazy::Error);
  // An undefined buffer would be read by state_dict / load_state_dict.
  EXPECT_THROW(m.register_buffer("b", lazy::AnyTensor{}), lazy::Error);
  EXPECT_EQ(m.named_buffers().size(), 0u);
  nn::Linear empty{nullptr};
  EXPECT_THROW(empty(lazy::zeros<float>({1, 1})), lazy::Error);
  EXPECT_THROW(nn::Linear(0, 2), lazy::ShapeError);
  // (0 features would divide by zero in forward.)
  EXPECT_THROW(nn::BatchNorm1d(0), lazy::ShapeError);
  EXPECT_THROW(nn::BatchNorm2d(-3), lazy::ShapeError);
}

TEST(Module, SharedModuleParametersAreListedOnce) {
  // torch's named_parameters lists a parameter reached through two parents once, under
  // its first name; state_dict keeps both keys.
  auto block = nn::Linear(3, 3);
  nn::Sequential s(block, block);
  const auto named = s->named_parameters();
  ASSERT_EQ(named.size(), 2u);
  EXPECT_EQ(named[0].first, "0.weight");
  EXPECT_EQ(named[1].first, "0.bias");
  EXPECT_EQ(s->parameters().size(), 2u);
  EXPECT_EQ(s->state_dict().size(), 4u);
  // Its own state dict loads back, strictly (every key is one of its names).
  auto sd = s->state_dict();
  EXPECT_NO_THROW(s->load_state_dict(sd));
  EXPECT_EQ(block->weight.to_vector(), sd.at("1.weight").as<float>().to_vector());
}

TEST(Functional, LayerNormChecksWeightAndBiasShapes) {
  auto x = lazy::from_vector<float>({1, 2, 3, 4, 5, 6, 7, 9}, Shape{2, 4});
  // A weight of shape (1,) would broadcast: every element scaled alike, silently.
  EXPECT_THROW(
      nn::functional::layer_norm(x, Shape{4}, lazy::ones<float>({1}), lazy::zeros<float>({4})),
      lazy::ShapeError);
  EXPECT_THROW(
      nn::functional::layer_norm(x, Shape{4}, lazy::ones<float>({4}), lazy::zeros<float>({2, 4})),
      lazy::ShapeError);
  // The right shapes still give the normalized rows (mean 0, variance 1 before the affine).
  auto y = nn::functional::layer_norm(x, Shape{4}, lazy::ones<float>({4}) * 2.0f,
                                      lazy::zeros<float>({4}) + 1.0f)
               .to_vector();
  for (int r = 0; r < 2; ++r) {
    double m = 0, v = 0;
    for (int c = 0; c < 4; ++c) m += (y[static_cast<std::size_t>(r * 4 + c)] - 1.0) / 2.0;
    m /= 4;
    for (int c = 0; c < 4; ++c)
      v += std::pow((y[static_cast<std::size_t>(r * 4 + c)] - 1.0) / 2.0 - m, 2);
    EXPECT_NEAR(m, 0.0, 1e-5);
    EXPECT_NEAR(v / 4, 1.0, 1e-3);
  }
}

TEST(Functional, ProbabilitiesRejectNaN) {
  auto x = lazy::ones<float>({2, 3});
  auto t = lazy::from_vector<std::int64_t>({0, 2}, Shape{2});
  EXPECT_THROW(nn::functional::cross_entropy(x, t, {.label_smoothing = std::nan("")}), lazy::Error);
  EXPECT_THROW(nn::functional::dropout(x, std::nan(""), /*training=*/false), lazy::Error);
  EXPECT_THROW(nn::Dropout(std::nan("")), lazy::Error);
}

TEST(Layers, LinearMatchesReferenceAndInitBounds) {
  nn::Linear fc(6, 4);
  const auto w = host(fc->weight), b = host(fc->bias);
  const double bound = 1 / std::sqrt(6.0);
  for (float v : w) EXPECT_LE(std::abs(v), bound);
  for (float v : b) EXPECT_LE(std::abs(v), bound);
  auto x = lazy::randn<float>({3, 6});
  const auto xv = host(x), y = host(fc(x));
  for (int i = 0; i < 3; ++i)
    for (int o = 0; o < 4; ++o) {
      double ref = b[o];
      for (int k = 0; k < 6; ++k) ref += double(xv[i * 6 + k]) * w[o * 6 + k];
      EXPECT_NEAR(y[i * 4 + o], ref, 1e-5);
    }
}

TEST(Layers, BatchNormTrainingStatisticsAndEval) {
  nn::BatchNorm2d bn(2);
  auto x = lazy::randn<float>({4, 2, 3, 3}) * 2.0f + 1.0f;
  Tensor<float> xt = x;
  const auto xv = host(xt);
  const auto y = host(bn(xt));
  for (int c = 0; c < 2; ++c) {
    double s = 0, ss = 0;
    int n = 0;
    for (int i = 0; i < 4; ++i)
      for (int k = 0; k < 9; ++k) {
        const double v = xv[(i * 2 + c) * 9 + k];
        s += v;
        ss += v * v;
        ++n;
      }
    const double mu = s / n, var = ss / n - mu * mu;
    for (int i = 0; i < 4; ++i)
      for (int k = 0; k < 9; ++k) {
        const int at = (i * 2 + c) * 9 + k;
        EXPECT_NEAR(y[at], (xv[at] - mu) / std::sqrt(var + 1e-5), 1e-4);
      }
    // Running estimates: momentum 0.1, unbiased variance.
    EXPECT_NEAR(host(bn->running_mean)[c], 0.1 * mu, 1e-5);
    EXPECT_NEAR(host(bn->running_var)[c], 0.9 + 0.1 * var * n / (n - 1), 1e-4);
  }
  EXPECT_EQ(bn->num_batches_tracked.item(), 1);
  bn->eval();
  const auto rm = host(bn->running_mean), rv = host(bn->running_var);
  const auto ye = host(bn(xt));
  for (int i = 0; i < 4 * 2 * 9; ++i) {
    const int c = (i / 9) % 2;
    EXPECT_NEAR(ye[i], (xv[i] - rm[c]) / std::sqrt(rv[c] + 1e-5), 1e-4);
  }
  EXPECT_THROW(bn(lazy::zeros<float>({4, 3, 2, 2})), lazy::ShapeError);
}

TEST(Layers, LayerNormDropoutEmbeddingSequential) {
  nn::LayerNorm ln(Shape{5});
  auto x = lazy::randn<float>({3, 5});
  const auto xv = host(x), y = host(ln(x));
  for (int r = 0; r < 3; ++r) {
    double mu = 0, var = 0;
    for (int k = 0; k < 5; ++k) mu += xv[r * 5 + k] / 5.0;
    for (int k = 0; k < 5; ++k) var += (xv[r * 5 + k] - mu) * (xv[r * 5 + k] - mu) / 5.0;
    for (int k = 0; k < 5; ++k) EXPECT_NEAR(y[r * 5 + k], (xv[r * 5 + k] - mu) / std::sqrt(var + 1e-5), 1e-4);
  }

  nn::Dropout drop(0.25);
  auto ones = lazy::ones<float>({20000});
  const auto d = host(drop(ones));
  std::int64_t kept = 0;
  for (float v : d) {
    ASSERT_TRUE(v == 0.0f || std::abs(v - 1 / 0.75f) < 1e-6) << v;
    kept += v != 0;
  }
  EXPECT_NEAR(static_cast<double>(kept) / 20000, 0.75, 0.02);
  drop->eval();
  EXPECT_EQ(host(drop(ones)), host(ones));

  nn::Embedding emb(10, 3);
  auto idx = lazy::from_vector<std::int64_t>({7, 0, 7, 9}, Shape{2, 2});
  const auto e = host(emb(idx)), w = host(emb->weight);
  EXPECT_EQ(emb(idx).shape(), (Shape{2, 2, 3}));
  const std::int64_t ids[] = {7, 0, 7, 9};
  for (int i = 0; i < 4; ++i)
    for (int k = 0; k < 3; ++k) EXPECT_EQ(e[i * 3 + k], w[ids[i] * 3 + k]);

  nn::Sequential seq(nn::Linear(5, 4), nn::ReLU(), nn::Flatten(), nn::Linear(4, 2));
  EXPECT_EQ(seq->size(), 4u);
  EXPECT_EQ(seq(x).shape(), (Shape{3, 2}));
  EXPECT_EQ(seq->parameters().size(), 4u);
}

TEST(Init, DistributionsAndFans) {
  auto t = lazy::empty<float>({200, 100});
  nn::init::xavier_uniform_(t);
  const double a = std::sqrt(6.0 / 300);
  double s = 0;
  for (float v : host(t)) {
    ASSERT_LE(std::abs(v), a);
    s += v * v;
  }
  EXPECT_NEAR(s / 20000, a * a / 3, a * a / 3 * 0.05);  // variance of U(-a, a)
  nn::init::kaiming_normal_(t, 0, nn::init::FanMode::FanIn, nn::init::Nonlinearity::ReLU);
  s = 0;
  for (float v : host(t)) s += v * v;
  EXPECT_NEAR(s / 20000, 2.0 / 100, 2.0 / 100 * 0.05);
  auto vec = lazy::empty<float>({3});
  EXPECT_THROW(nn::init::xavier_uniform_(vec), lazy::ShapeError);
}

TEST(Init, InvalidBoundsAndStdAreErrors) {
  // libtorch: "uniform_ expects to return a [from, to) range, but found from=2 > to=1",
  // "uniform_ expects to-from <= ...max()" (infinite bounds), "normal expects std >= 0.0".
  const double nan = std::numeric_limits<double>::quiet_NaN(),
               inf = std::numeric_limits<double>::infinity();
  auto t = lazy::zeros<float>({4});
  EXPECT_THROW(nn::init::uniform_(t, 2, 1), lazy::Error);
  EXPECT_THROW(nn::init::uniform_(t, nan, 1), lazy::Error);
  EXPECT_THROW(nn::init::uniform_(t, 0, nan), lazy::Error);
  EXPECT_THROW(nn::init::uniform_(t, -inf, 0), lazy::Error);
  EXPECT_THROW(nn::init::uniform_(t, 0, inf), lazy::Error);
  EXPECT_THROW(nn::init::normal_(t, 0, -1), lazy::Error);
  EXPECT_THROW(nn::init::normal_(t, 0, nan), lazy::Error);
  EXPECT_EQ(host(t), (std::vector<float>{0, 0, 0, 0}));  // a refused call changes nothing
  nn::init::uniform_(t, 1.5, 1.5);  // an empty range [a, a) is allowed: every value is a
  EXPECT_EQ(host(t), (std::vector<float>{1.5, 1.5, 1.5, 1.5}));
  nn::init::normal_(t, -2, 0);
  EXPECT_EQ(host(t), (std::vector<float>{-2, -2, -2, -2}));
}

TEST(Module, RegisterParameterSetsRequiresGradOfALeaf) {
  // libtorch's register_parameter always sets requires_grad to its argument.
  nn::Module m("M");
  auto frozen = m.register_parameter("frozen", lazy::zeros<float>({2}).requires_grad_(),
                                     /*requires_grad=*/false);
  EXPECT_FALSE(frozen.requires_grad());
  EXPECT_FALSE(m.named_parameters()[0].second.requires_grad());
  auto trained = m.register_parameter("trained", lazy::zeros<float>({2}));
  EXPECT_TRUE(trained.requires_grad());
  auto plain = m.register_parameter("plain", lazy::zeros<float>({2}), /*requires_grad=*/false);
  EXPECT_FALSE(plain.requires_grad());
}

}  // namespace
