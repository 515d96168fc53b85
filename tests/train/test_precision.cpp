// Tests of train/precision.hpp and train/accelerator.hpp: each precision plugin's names,
// conversions and forward context; LAZYTENSOR_USE_BF16; training through an Accelerator in
// every precision against gradient descent computed here in double (on one device, and in
// double on 2 replicas that each see half the batch); gradient clipping by norm and by value
// against a reference; the accelerator's argument errors. The replica test runs under TSan.
#include "../dist/dist_testing.hpp"
#include "testing/helpers.hpp"

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include <lazytensor/nn.hpp>
#include <lazytensor/optim.hpp>
#include <lazytensor/train.hpp>

namespace {

using dist_testing::Watchdog;
using lazy::AnyTensor;
using lazy::DType;
using lazy::Shape;
using lazy::Tensor;
namespace train = lazy::train;
namespace nn = lazy::nn;

TEST(Precision, LightningNamesAndAliases) {
  struct Case {
    const char* name;
    const char* canonical;
    DType params;
  };
  for (const Case& c : {Case{"32-true", "32-true", DType::Float32}, Case{"32", "32-true", DType::Float32},
                        Case{"64-true", "64-true", DType::Float64}, Case{"64", "64-true", DType::Float64},
                        Case{"bf16-mixed", "bf16-mixed", DType::Float32}, Case{"bf16", "bf16-mixed", DType::Float32},
                        Case{"bf16-true", "bf16-true", DType::BFloat16}}) {
    const auto p = train::make_precision(c.name);
    EXPECT_EQ(p->name(), c.canonical) << c.name;
    EXPECT_EQ(p->param_dtype(), c.params) << c.name;
  }
  try {
    train::make_precision("16-mixed");
    ADD_FAILURE() << "16-mixed accepted";
  } catch (const lazy::Error& e) {
    EXPECT_NE(std::string(e.what()).find("float16"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("\"16-mixed\""), std::string::npos) << e.what();
  }
  EXPECT_THROW(train::make_precision("fp32"), lazy::Error);
}

TEST(Precision, LazytensorUseBf16ChoosesTheDefault) {
  ::unsetenv("LAZYTENSOR_USE_BF16");
  EXPECT_EQ(train::default_precision()->name(), "32-true");
  ::setenv("LAZYTENSOR_USE_BF16", "1", 1);
  EXPECT_EQ(train::default_precision()->name(), "bf16-true");
  EXPECT_EQ(train::SingleDeviceStrategy().precision_plugin().name(), "bf16-true");
  ::setenv("LAZYTENSOR_USE_BF16", "0", 1);
  EXPECT_EQ(train::default_precision()->name(), "32-true");
  ::setenv("LAZYTENSOR_USE_BF16", "maybe", 1);
  EXPECT_THROW(train::default_precision(), lazy::Error);
  ::unsetenv("LAZYTENSOR_USE_BF16");
}

TEST(Precision, ConvertModuleInputAndOutput) {
  const Tensor<float> x = lazy::from_vector<float>({0.1f, 0.2f, 0.3f}, Shape{1, 3});
  const Tensor<std::int64_t> idx = lazy::from_vector<std::int64_t>({1, 2}, Shape{2});
  for (const char* name : {"32-true", "64-true", "bf16-mixed", "bf16-true"}) {
    SCOPED_TRACE(name);
    const auto p = train::make_precision(name);
    nn::Linear fc(3, 2);
    nn::BatchNorm1d bn(2);
    p->convert_module(*fc);
    p->convert_module(*bn);
    for (const auto& w : fc->parameters()) EXPECT_EQ(w.dtype(), p->param_dtype());
    for (const auto& [n, b] : bn->named_buffers())
      EXPECT_EQ(b.dtype(), n == "num_batches_tracked" ? DType::Int64 : p->param_dtype()) << n;
    const AnyTensor in = p->convert_input(x);
    EXPECT_EQ(in.dtype(), p->input_dtype().value_or(DType::Float32));
    EXPECT_EQ(p->convert_input(idx).dtype(), DType::Int64);  // indices are not converted
    EXPECT_EQ(p->convert_output(in).dtype(), DType::Float32);
    EXPECT_NEAR(p->convert_output(in).as<float>().to_vector()[1], 0.2, 1e-3);
  }
}

TEST(Precision, MixedRunsProductsInBFloat16OnlyInsideItsForwardContext) {
  const auto p = train::make_precision("bf16-mixed");
  nn::Linear fc(16, 8);
  const Tensor<float> x = lazy::rand<float>(Shape{4, 16});
  std::vector<float> inside;
  {
    const train::PrecisionContext context = p->forward_context();
    EXPECT_TRUE(lazy::is_autocast_enabled());
    inside = lazy::linear(x, Tensor<float>(fc->weight)).to_vector();
  }
  EXPECT_FALSE(lazy::is_autocast_enabled());
  for (float v : inside) EXPECT_TRUE(lazy_tests::representable_in_bf16(v)) << v;
  const auto outside = lazy::linear(x, Tensor<float>(fc->weight)).to_vector();
  int unrounded = 0;
  for (float v : outside) unrounded += !lazy_tests::representable_in_bf16(v);
  EXPECT_GT(unrounded, 16);
  {
    const train::PrecisionContext context = train::make_precision("32-true")->forward_context();
    EXPECT_FALSE(lazy::is_autocast_enabled());
  }
}

// ---- training in every precision against gradient descent in double -----------------------

constexpr int kRows = 8, kFeatures = 4, kSteps = 25;
constexpr double kLr = 0.1;

// The data as floats (what every precision starts from), read as doubles. Exact eighths, no
// libm: a sin() the compiler folds at compile time in one place and calls at run time in the
// other can round differently (seen at -O3 -march=native on an AVX-512 Xeon), and the model
// and the reference must read the same numbers.
double x_value(int i, int j) { return static_cast<float>(((i * 7 + j * 3) % 11 - 5) / 8.0); }
double y_value(int i) {
  double y = 0.3;
  for (int j = 0; j < kFeatures; ++j) y += (0.5 - 0.25 * j) * x_value(i, j);
  return static_cast<float>(y);
}
std::vector<float> initial_weight() { return {0.1f, -0.2f, 0.05f, 0.3f}; }
constexpr float kInitialBias = -0.1f;

// Full-batch gradient descent on mean squared error over rows [0, kRows), in double.
std::vector<double> reference_parameters() {
  const std::vector<float> w0 = initial_weight();
  std::vector<double> w(w0.begin(), w0.end());
  double b = kInitialBias;
  for (int s = 0; s < kSteps; ++s) {
    std::vector<double> gw(kFeatures, 0.0);
    double gb = 0;
    for (int i = 0; i < kRows; ++i) {
      double pred = b;
      for (int j = 0; j < kFeatures; ++j) pred += w[static_cast<std::size_t>(j)] * x_value(i, j);
      const double d = 2 * (pred - y_value(i)) / kRows;
      for (int j = 0; j < kFeatures; ++j) gw[static_cast<std::size_t>(j)] += d * x_value(i, j);
      gb += d;
    }
    for (int j = 0; j < kFeatures; ++j) w[static_cast<std::size_t>(j)] -= kLr * gw[static_cast<std::size_t>(j)];
    b -= kLr * gb;
  }
  w.push_back(b);
  return w;
}

// Rows [begin, end) as float tensors.
std::pair<Tensor<float>, Tensor<float>> batch(int begin, int end) {
  std::vector<float> x, y;
  for (int i = begin; i < end; ++i) {
    for (int j = 0; j < kFeatures; ++j) x.push_back(static_cast<float>(x_value(i, j)));
    y.push_back(static_cast<float>(y_value(i)));
  }
  return {lazy::from_vector<float>(x, Shape{end - begin, kFeatures}), lazy::from_vector<float>(y, Shape{end - begin, 1})};
}

// One replica's training run in the plugin's dtype T: the model is converted by the
// strategy's setup, the batch by the plugin, the loss computed in T.
template <class T>
std::vector<double> train_in(train::Accelerator& acc, int begin, int end) {
  nn::Linear model(kFeatures, 1);
  {
    lazy::NoGradGuard no_grad;
    model->weight.copy_(lazy::from_vector<float>(initial_weight(), Shape{1, kFeatures}));
    model->bias.fill_(kInitialBias);
  }
  acc.setup(*model);
  lazy::optim::SGD opt(model->parameters(), kLr);
  const auto [xf, yf] = batch(begin, end);
  const Tensor<T> x = acc.precision_plugin().convert_input(xf).to(acc.strategy().root_device());
  const Tensor<T> y = acc.precision_plugin().convert_input(yf).to(acc.strategy().root_device());
  for (int s = 0; s < kSteps; ++s) {
    acc.optimizer_zero_grad(opt);
    acc.optimizer_step(opt, [&]() -> AnyTensor {
      const Tensor<T> loss = acc.training_step([&] { return nn::functional::mse_loss(model(x), y); });
      acc.backward(loss, &opt);
      return loss;
    });
    lazy::mark_step();
  }
  acc.on_train_end();
  std::vector<double> out;
  for (const auto& p : model->parameters())
    for (const auto v : AnyTensor(p).to(DType::Float64).as<double>().to_vector()) out.push_back(v);
  return out;
}

// Trains with the strategy's own precision plugin (set before launch: the strategy object
// is shared by the replica threads, so they must not replace its plugin).
std::vector<double> train_with_plugin(train::Strategy& strategy, int begin, int end) {
  train::CPUAccelerator acc(strategy);
  switch (acc.precision_plugin().param_dtype()) {
    case DType::Float64: return train_in<double>(acc, begin, end);
    case DType::BFloat16: return train_in<lazy::bfloat16>(acc, begin, end);
    default: return train_in<float>(acc, begin, end);
  }
}

std::vector<double> train_with(train::Strategy& strategy, const std::string& precision, int begin, int end) {
  train::CPUAccelerator acc(strategy, train::make_precision(precision));
  switch (acc.precision_plugin().param_dtype()) {
    case DType::Float64: return train_in<double>(acc, begin, end);
    case DType::BFloat16: return train_in<lazy::bfloat16>(acc, begin, end);
    default: return train_in<float>(acc, begin, end);
  }
}

TEST(Precision, EveryPluginTrainsToTheDoubleReference) {
  const auto want = reference_parameters();
  // Tolerances: double agrees to rounding; float to float rounding over 25 steps; bf16-mixed
  // rounds every product's operands and result to 8 bits; bf16-true also keeps the
  // parameters (and their small updates) in 8 bits.
  struct Case {
    const char* name;
    double tol;
  };
  for (const Case& c : {Case{"64-true", 1e-12}, Case{"32-true", 1e-5}, Case{"bf16-mixed", 3e-2}, Case{"bf16-true", 1e-1}}) {
    SCOPED_TRACE(c.name);
    train::SingleDeviceStrategy strategy;
    const auto got = train_with(strategy, c.name, 0, kRows);
    ASSERT_EQ(got.size(), want.size());
    for (std::size_t i = 0; i < want.size(); ++i) EXPECT_NEAR(got[i], want[i], c.tol) << i;
  }
}

TEST(Precision, DoubleOnTwoReplicasEqualsTheFullBatch) {
  Watchdog dog;
  const auto want = reference_parameters();
  train::ReplicaStrategy strategy(2);
  strategy.set_precision_plugin(train::make_precision("64-true"));
  const auto got = strategy.launch([](train::Strategy& s) {
    const int half = kRows / 2, r = s.global_rank();
    const auto mine = train_with_plugin(s, r * half, (r + 1) * half);
    // Every replica ends with the same parameters.
    const Tensor<double> t = lazy::from_vector<double>(mine, Shape{static_cast<std::int64_t>(mine.size())});
    const auto all = s.all_gather(t).to_vector();
    for (std::size_t i = 0; i < mine.size(); ++i) EXPECT_EQ(all[i], all[i + mine.size()]) << i;
    return mine;
  });
  ASSERT_EQ(got.size(), want.size());
  for (std::size_t i = 0; i < want.size(); ++i) EXPECT_NEAR(got[i], want[i], 1e-12) << i;
}

// ---- the accelerator -------------------------------------------------------------------

TEST(Accelerator, ClipsByNormAndByValueAgainstAReference) {
  train::SingleDeviceStrategy strategy;
  train::CPUAccelerator acc(strategy);
  Tensor<float> a = lazy::zeros<float>(Shape{3}), b = lazy::zeros<float>(Shape{2});
  lazy::optim::SGD opt(std::vector<Tensor<float>>{a, b}, 0.1);
  const std::vector<float> ga = {3, -4, 1}, gb = {2, -2};
  auto set = [&] {
    a.set_grad(lazy::from_vector<float>(ga, Shape{3}));
    b.set_grad(lazy::from_vector<float>(gb, Shape{2}));
  };
  set();
  acc.clip_gradients(opt, 2.0, "norm");
  const double norm = std::sqrt(9.0 + 16 + 1 + 4 + 4), scale = 2.0 / (norm + 1e-6);
  for (int i = 0; i < 3; ++i) EXPECT_NEAR(a.grad().to_vector()[i], ga[i] * scale, 1e-6);
  for (int i = 0; i < 2; ++i) EXPECT_NEAR(b.grad().to_vector()[i], gb[i] * scale, 1e-6);
  set();
  acc.clip_gradients(opt, 2.5, "value");
  EXPECT_EQ(a.grad().to_vector(), (std::vector<float>{2.5f, -2.5f, 1}));
  EXPECT_EQ(b.grad().to_vector(), (std::vector<float>{2, -2}));
  set();
  acc.clip_gradients(opt, 0.0, "norm");  // 0: no clipping, as Lightning's
  EXPECT_EQ(a.grad().to_vector(), ga);
  EXPECT_THROW(acc.clip_gradients(opt, 1.0, "l2"), lazy::Error);
  EXPECT_THROW(acc.clip_gradients(opt, -1.0, "norm"), lazy::Error);
}

TEST(Accelerator, StepsRunInTheForwardContextAndEvaluationWithoutGradients) {
  train::SingleDeviceStrategy strategy;
  train::CPUAccelerator acc(strategy, train::make_precision("bf16-mixed"));
  EXPECT_EQ(strategy.precision_plugin().name(), "bf16-mixed");  // the accelerator set it
  Tensor<float> w = lazy::ones<float>(Shape{2});
  w.requires_grad_();
  EXPECT_TRUE(acc.training_step([&] {
    EXPECT_TRUE(lazy::autograd::is_grad_enabled());
    return lazy::is_autocast_enabled();
  }));
  for (int k = 0; k < 3; ++k) {
    auto step = [&] {
      EXPECT_TRUE(lazy::is_autocast_enabled());
      return Tensor<float>(w * 2.0f);
    };
    const Tensor<float> y = k == 0 ? acc.validation_step(step) : k == 1 ? acc.test_step(step) : acc.predict_step(step);
    EXPECT_FALSE(y.requires_grad()) << k;
  }
  EXPECT_FALSE(lazy::is_autocast_enabled());
  EXPECT_TRUE(lazy::autograd::is_grad_enabled());
}

TEST(Accelerator, CpuIsTheOneAccelerator) {
  train::SingleDeviceStrategy strategy;
  EXPECT_EQ(train::make_accelerator("cpu", strategy)->name(), "cpu");
  EXPECT_EQ(train::make_accelerator("auto", strategy)->name(), "cpu");
  for (const char* other : {"gpu", "cuda", "tpu", "mps", ""}) {
    try {
      train::make_accelerator(other, strategy);
      ADD_FAILURE() << other << " accepted";
    } catch (const lazy::Error& e) {
      EXPECT_NE(std::string(e.what()).find("\"cpu\""), std::string::npos) << e.what();
    }
  }
  EXPECT_TRUE(train::CPUAccelerator::is_available());
  EXPECT_EQ(train::CPUAccelerator::auto_device_count(), lazy::device_count());
  EXPECT_THROW(strategy.set_precision_plugin(nullptr), lazy::Error);
}

}  // namespace
