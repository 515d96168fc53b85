// nn in double and bfloat16 (layers built in float, converted with Module::to(DType)).
// - ModuleToDType: what to(dtype) converts (floating parameters and buffers, not the int64
//   num_batches_tracked), keeps (requires_grad) and drops (gradients); the DTypeErrors
//   (retyped member handles, integral dtypes, an input of another dtype); exact round trips.
// - NnDouble: every layer's forward in double against scalar loops written here from the
//   parameter values read back, and its gradients w.r.t. the input and every parameter
//   against central finite differences in double; every functional through gradcheck, and
//   the losses' values against host formulas; Sequential against the composition of its layers.
// - NnBFloat16: every layer and functional in bfloat16 against the same computation in float
//   on bf16-representable weights and inputs (outputs and gradients).
// - NnInitDTypes, NnPendingInputs: initializers in every floating dtype (bounds and moments);
//   layers and functionals applied to pending expressions keep the expression's dtype.
#include <algorithm>
#include <cmath>
#include <functional>
#include <string>
#include <type_traits>
#include <vector>

#include <gtest/gtest.h>

#include <lazytensor/lazytensor.hpp>
#include <lazytensor/nn.hpp>

#include "autograd/gradcheck.hpp"
#include "testing/helpers.hpp"

namespace nn_dtypes_test {

using lazy::AnyTensor;
using lazy::bfloat16;
using lazy::DType;
using lazy::Shape;
using lazy::Tensor;
using Vec = std::vector<double>;
using RefFn = std::function<Vec(const Vec&)>;
using gradcheck::input;
namespace nn = lazy::nn;
namespace F = lazy::nn::functional;

// ---- helpers ---------------------------------------------------------------------------

template <class T>
Vec host(const Tensor<T>& t) {
  Vec out;
  for (const T& v : t.to_vector()) out.push_back(lazy_tests::num(v));
  return out;
}
Vec host(const AnyTensor& t) {
  return t.visit([](const auto& typed) { return host(typed); });
}
template <class T>
std::vector<T> typed(const Vec& v) {
  return std::vector<T>(v.begin(), v.end());
}
Vec bf_round(Vec v) {
  for (double& x : v) x = static_cast<float>(bfloat16(static_cast<float>(x)));
  return v;
}
double max_abs(const Vec& v) {
  double m = 0;
  for (double x : v) m = std::max(m, std::abs(x));
  return m;
}

// A parameter or buffer of `m` by dotted name, as double.
Vec value_of(const nn::Module& m, const std::string& name) {
  const lazy::StateDict sd = m.state_dict();
  return host(sd.at(name));
}
// Replaces a parameter or buffer with `values`, in its current dtype and shape.
void set_value(nn::Module& m, const std::string& name, const Vec& values) {
  lazy::StateDict sd;
  sd.insert(name, m.state_dict().at(name).visit([&](const auto& t) -> AnyTensor {
    using T = typename std::decay_t<decltype(t)>::value_type;
    return lazy::from_vector<T>(typed<T>(values), t.shape());
  }));
  m.load_state_dict(sd, /*strict=*/false);
}
// Random floating parameters and buffers (running variances positive): no layer keeps its
// identity initialization.
void randomize(nn::Module& m, std::uint64_t seed) {
  for (const auto& [name, t] : m.state_dict()) {
    if (!t.is_floating_point()) continue;
    const bool var = name.find("running_var") != std::string::npos;
    set_value(m, name, gradcheck::values(t.numel(), seed++, var ? 0.5 : -1, var ? 1.5 : 1));
  }
}

// |got - want| <= rtol |want| + atol element-wise (NaN fails).
void expect_close(const Vec& got, const Vec& want, double rtol, double atol, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  int bad = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    if (!(std::abs(got[i] - want[i]) <= rtol * std::abs(want[i]) + atol) && ++bad <= 5) {
      ADD_FAILURE() << what << "[" << i << "]: got " << got[i] << ", want " << want[i];
    }
  }
  EXPECT_EQ(bad, 0) << what << ": elements out of tolerance";
}

// Checks a module converted to double: its forward against `ref` (which reads the parameters
// back), then the gradients of L = sum(w * fwd(x)) w.r.t. x and every parameter against
// central differences (parameters perturbed through load_state_dict(strict = false)).
template <class Fwd>
void check_double(const std::string& what, nn::Module& m, Fwd fwd, const gradcheck::Input& x,
                  const RefFn& ref, bool input_grad = true) {
  SCOPED_TRACE(what);
  auto run = [&](const Vec& xv) { return Tensor<double>(fwd(lazy::from_vector<double>(xv, x.shape))); };
  expect_close(host(run(x.data)), ref(x.data), 1e-11, 1e-12, "forward");

  m.zero_grad();
  auto leaf = lazy::from_vector<double>(x.data, x.shape).requires_grad_();
  Tensor<double> out = fwd(leaf);
  const Vec w = gradcheck::values(out.numel(), 99, 0.5, 1.5);
  out.backward(lazy::from_vector<double>(w, out.shape()));
  lazy::mark_step();
  auto loss = [&](const Vec& xv) {
    lazy::NoGradGuard no_grad;
    return gradcheck::weighted_sum(run(xv), w);
  };
  auto compare = [&](const Vec& analytic, const Vec& at, auto&& loss_at, const std::string& of) {
    ASSERT_EQ(analytic.size(), at.size()) << of;
    const double h = 1e-6;
    for (std::size_t j = 0; j < at.size(); ++j) {
      Vec v = at;
      v[j] = at[j] + h;
      const double up = loss_at(v);
      v[j] = at[j] - h;
      const double numeric = (up - loss_at(v)) / (2 * h);
      EXPECT_NEAR(analytic[j], numeric, 1e-6 * std::max(1.0, std::abs(numeric)))
          << "d/d " << of << "[" << j << "]";
    }
  };
  if (input_grad) {
    ASSERT_TRUE(leaf.grad().defined());
    compare(host(leaf.grad()), x.data, loss, "input");
  }
  for (const auto& np : m.named_parameters()) {
    const std::string& name = np.first;
    const AnyTensor& p = np.second;
    ASSERT_EQ(p.dtype(), DType::Float64) << name;
    ASSERT_TRUE(p.grad().defined()) << name << " got no gradient";
    ASSERT_EQ(p.grad().dtype(), DType::Float64) << name;
    const Vec orig = host(p);
    compare(host(p.grad()), orig, [&](const Vec& v) { set_value(m, name, v); return loss(x.data); }, name);
    set_value(m, name, orig);
  }
}

// A layer holder's forward, generic over the dtype, on the first input.
template <class H>
auto fwd_of(H h) {
  return [h](const auto& xs) { return h(xs[0]); };
}
template <class H>
void double_layer(const std::string& what, H h, const gradcheck::Input& x, const RefFn& ref) {
  h->to(DType::Float64);
  check_double(what, *h, [h](const Tensor<double>& t) { return h(t); }, x, ref);
}

// bfloat16 keeps 8 significant bits: each rounding is off by at most u = 2^-8 ~ 3.9e-3
// relative. Inputs and weights are exact here; an output goes through a few roundings
// (products, a sum, a normalization): 2e-2 ~ 5u relative. A sum that cancels is off relative
// to its largest terms, not to itself: the absolute part, 1e-2 ~ 2.5u of the tensor's largest
// magnitude. Gradients go through about twice as many roundings (4e-2 ~ 10u), and those of
// the normalizations subtract means of products (3e-2 ~ 8u of the largest). Measured: the
// worst element, batch norm's input gradient in training, uses half of its tolerance.
constexpr double kBfRtol = 2e-2, kBfAtol = 1e-2, kBfGradRtol = 4e-2, kBfGradAtol = 3e-2;

// Runs fn (generic over the dtype, on a vector of inputs) in float on bf16-representable
// inputs and, with a module, weights (rounded by a trip through bfloat16), then in bfloat16
// (the module converted with to(BFloat16)): outputs and gradients agree.
template <class Fn>
void check_bf16(const std::string& what, nn::Module* m, Fn fn, const std::vector<gradcheck::Input>& inputs) {
  SCOPED_TRACE(what);
  if (m) m->to(DType::BFloat16), m->to(DType::Float32);
  auto run = [&](auto tag) {
    using T = decltype(tag);
    std::vector<Tensor<T>> xs;
    for (const auto& in : inputs) {
      xs.push_back(lazy::from_vector<T>(typed<T>(bf_round(in.data)), in.shape).requires_grad_());
    }
    if (m) m->zero_grad();
    Tensor<T> y = fn(xs);
    const Vec w = bf_round(gradcheck::values(y.numel(), 99, 0.5, 1.5));
    y.backward(lazy::from_vector<T>(typed<T>(w), y.shape()));
    std::vector<Vec> out{host(y)};
    for (const auto& x : xs) out.push_back(x.grad().defined() ? host(x.grad()) : Vec{});
    for (const auto& p : m ? m->parameters() : std::vector<AnyTensor>{}) {
      EXPECT_EQ(p.grad().dtype(), lazy::dtype_of<T>());
      out.push_back(host(p.grad()));
    }
    return out;
  };
  const auto f = run(float{});
  if (m) m->to(DType::BFloat16);
  const auto b = run(bfloat16{});
  ASSERT_EQ(b.size(), f.size());
  expect_close(b[0], f[0], kBfRtol, kBfAtol * max_abs(f[0]), "forward");
  for (std::size_t i = 1; i < f.size(); ++i) {
    expect_close(b[i], f[i], kBfGradRtol, kBfGradAtol * max_abs(f[i]), "gradient " + std::to_string(i));
  }
}

// ---- scalar references -----------------------------------------------------------------

RefFn elementwise(double (*f)(double)) {
  return [f](const Vec& x) {
    Vec y;
    for (double v : x) y.push_back(f(v));
    return y;
  };
}

// Output size of a window op along one dim.
std::int64_t out_dim(std::int64_t in, std::int64_t k, std::int64_t s, std::int64_t p) {
  return (in + 2 * p - k) / s + 1;
}

// conv2d of x [N, C, H, W] with w [O, C, K, K] and b [O], square stride s and padding p.
Vec conv_ref(const Vec& x, const Shape& xs, const Vec& w, const Vec& b, std::int64_t O, std::int64_t K,
             std::int64_t s, std::int64_t p) {
  const std::int64_t C = xs[1], H = xs[2], W = xs[3], OH = out_dim(H, K, s, p), OW = out_dim(W, K, s, p);
  Vec y;
  for (std::int64_t n = 0; n < xs[0]; ++n)
    for (std::int64_t o = 0; o < O; ++o)
      for (std::int64_t oh = 0; oh < OH; ++oh)
        for (std::int64_t ow = 0; ow < OW; ++ow) {
          double acc = b[o];
          for (std::int64_t c = 0; c < C; ++c)
            for (std::int64_t i = 0; i < K; ++i)
              for (std::int64_t j = 0; j < K; ++j) {
                const std::int64_t ih = oh * s - p + i, iw = ow * s - p + j;
                if (ih >= 0 && ih < H && iw >= 0 && iw < W)
                  acc += x[((n * C + c) * H + ih) * W + iw] * w[((o * C + c) * K + i) * K + j];
              }
          y.push_back(acc);
        }
  return y;
}

// Max (padding: -inf) or average (divisor K * K, or the taps inside the input) pooling.
Vec pool_ref(const Vec& x, const Shape& xs, std::int64_t K, std::int64_t s, std::int64_t p, bool max,
             bool count_include_pad) {
  const std::int64_t H = xs[2], W = xs[3], OH = out_dim(H, K, s, p), OW = out_dim(W, K, s, p);
  Vec y;
  for (std::int64_t nc = 0; nc < xs[0] * xs[1]; ++nc)
    for (std::int64_t oh = 0; oh < OH; ++oh)
      for (std::int64_t ow = 0; ow < OW; ++ow) {
        double acc = max ? -INFINITY : 0;
        int inside = 0;
        for (std::int64_t i = 0; i < K; ++i)
          for (std::int64_t j = 0; j < K; ++j) {
            const std::int64_t ih = oh * s - p + i, iw = ow * s - p + j;
            if (ih < 0 || ih >= H || iw < 0 || iw >= W) continue;
            const double v = x[(nc * H + ih) * W + iw];
            acc = max ? std::max(acc, v) : acc + v;
            ++inside;
          }
        y.push_back(max ? acc : acc / (count_include_pad ? double(K * K) : inside));
      }
  return y;
}

// Normalizes groups of `m` consecutive elements (layer norm over the trailing dims).
Vec layer_norm_ref(const Vec& x, std::size_t m, const Vec& w, const Vec& b, double eps) {
  Vec y(x.size());
  for (std::size_t g = 0; g < x.size(); g += m) {
    double mu = 0, var = 0;
    for (std::size_t i = 0; i < m; ++i) mu += x[g + i] / m;
    for (std::size_t i = 0; i < m; ++i) var += (x[g + i] - mu) * (x[g + i] - mu) / m;
    for (std::size_t i = 0; i < m; ++i) y[g + i] = (x[g + i] - mu) / std::sqrt(var + eps) * w[i] + b[i];
  }
  return y;
}

// Batch norm of x [N, C, ...] per channel, with the batch statistics (biased variance) or,
// given rm and rv, the running ones. Appends the batch mean and unbiased variance to mu, var.
Vec batch_norm_ref(const Vec& x, const Shape& xs, const Vec& w, const Vec& b, const Vec* rm, const Vec* rv,
                   Vec* mus = nullptr, Vec* vars = nullptr) {
  const std::int64_t N = xs[0], C = xs[1], R = xs.numel() / (N * C), count = N * R;
  auto at = [&](std::int64_t n, std::int64_t c, std::int64_t r) { return (n * C + c) * R + r; };
  Vec y(x.size());
  for (std::int64_t c = 0; c < C; ++c) {
    double mu = 0, var = 0;
    for (std::int64_t n = 0; n < N; ++n)
      for (std::int64_t r = 0; r < R; ++r) mu += x[at(n, c, r)] / count;
    for (std::int64_t n = 0; n < N; ++n)
      for (std::int64_t r = 0; r < R; ++r) var += (x[at(n, c, r)] - mu) * (x[at(n, c, r)] - mu) / count;
    if (mus) mus->push_back(mu), vars->push_back(var * count / (count - 1));
    if (rm) mu = (*rm)[c], var = (*rv)[c];
    const double scale = w[c] / std::sqrt(var + 1e-5);
    for (std::int64_t n = 0; n < N; ++n)
      for (std::int64_t r = 0; r < R; ++r) y[at(n, c, r)] = (x[at(n, c, r)] - mu) * scale + b[c];
  }
  return y;
}

struct DTypeNet : nn::Module {
  DTypeNet() : Module("DTypeNet") {
    fc = register_module("fc", nn::Linear(4, 3));
    bn = register_module("bn", nn::BatchNorm1d(3));
  }
  template <class T>
  Tensor<T> forward(const Tensor<T>& x) { return bn(fc(x)); }
  nn::Linear fc{nullptr};
  nn::BatchNorm1d bn{nullptr};
};
DType expected_dtype(const std::string& name, DType floating) {
  return name == "bn.num_batches_tracked" ? DType::Int64 : floating;
}

struct FloatOnlyImpl : nn::Module {
  FloatOnlyImpl() : Module("FloatOnly") {}
  Tensor<float> forward(const Tensor<float>& x) const { return x; }
};
LAZY_MODULE(FloatOnly);

// ---- Module::to(DType) -----------------------------------------------------------------

TEST(ModuleToDType, ConvertsFloatingParamsAndBuffersKeepsInt64AndRequiresGradDropsGrads) {
  DTypeNet net;
  lazy::sum(net.forward(lazy::randn<float>({5, 4}))).backward();
  std::vector<Vec> before;
  for (const auto& p : net.parameters()) {
    ASSERT_TRUE(p.grad().defined());
    before.push_back(host(p));
  }
  net.to(DType::Float64);
  const auto params = net.named_parameters();
  ASSERT_EQ(params.size(), 4u);
  for (std::size_t i = 0; i < params.size(); ++i) {
    const auto& [name, p] = params[i];
    EXPECT_EQ(p.dtype(), DType::Float64) << name;
    EXPECT_TRUE(p.requires_grad()) << name;
    EXPECT_FALSE(p.grad().defined()) << name << ": the float gradient must be dropped";
    EXPECT_EQ(host(p), before[i]) << name << ": widening to double is exact";
  }
  for (const auto& [name, b] : net.named_buffers()) {
    EXPECT_EQ(b.dtype(), expected_dtype(name, DType::Float64)) << name;
  }
  for (const auto& [name, t] : net.state_dict()) {
    EXPECT_EQ(t.dtype(), expected_dtype(name, DType::Float64)) << name;
  }
  lazy::StateDict float_state;
  for (const auto& [name, t] : net.state_dict()) {
    float_state.insert(name, t.dtype() == DType::Float64 ? t.to(DType::Float32) : t);
  }
  EXPECT_THROW(net.load_state_dict(float_state), lazy::DTypeError);
  // Gradients flow in the new dtype.
  lazy::sum(net.forward(lazy::randn<double>({5, 4}))).backward();
  for (const auto& p : net.parameters()) EXPECT_EQ(p.grad().dtype(), DType::Float64);
}

TEST(ModuleToDType, OldTypedHandleRaisesAndAnyTensorViewFollows) {
  nn::Linear fc(3, 2);
  const auto w = host(fc->weight);
  fc->to(DType::Float64);
  EXPECT_THROW(fc->weight.to_vector(), lazy::DTypeError);
  EXPECT_EQ(host(AnyTensor(fc->weight).as<double>()), w);
  Tensor<double> viewed = fc->parameters()[0];  // the implicit typed view
  EXPECT_EQ(host(viewed), w);
  EXPECT_THROW((void)static_cast<Tensor<float>>(fc->parameters()[0]), lazy::DTypeError);
  EXPECT_THROW(AnyTensor(fc->weight).as<float>(), lazy::DTypeError);
}

TEST(ModuleToDType, IntegralDTypesAndMismatchedInputsRaise) {
  nn::Linear fc(3, 2);
  for (DType d : {DType::Int32, DType::Int64, DType::Bool}) {
    EXPECT_THROW(fc->to(d), lazy::DTypeError);
    EXPECT_EQ(fc->parameters()[0].dtype(), DType::Float32) << "a refused to() must change nothing";
  }
  fc->to(DType::Float64);
  try {
    fc(lazy::ones<float>({1, 3}));
    ADD_FAILURE() << "a float input into a double Linear must raise";
  } catch (const lazy::DTypeError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("float64"), std::string::npos) << msg;
    EXPECT_NE(msg.find("float32"), std::string::npos) << msg;
  }
  EXPECT_EQ(fc(lazy::ones<double>({1, 3})).shape(), (Shape{1, 2}));
}

TEST(ModuleToDType, Float64ThenFloat32RoundTripsExactly) {
  DTypeNet net;
  randomize(net, 1);
  std::vector<Vec> before;
  for (const auto& [name, t] : net.state_dict()) before.push_back(host(t));
  net.to(DType::Float64);
  net.to(lazy::Device(1), DType::Float32);
  EXPECT_EQ(net.fc->weight.device(), lazy::Device(1));
  net.to(lazy::Device(0));
  std::size_t i = 0;
  for (const auto& [name, t] : net.state_dict()) {
    EXPECT_EQ(t.dtype(), expected_dtype(name, DType::Float32)) << name;
    EXPECT_EQ(host(t), before[i++]) << name;
  }
  EXPECT_NO_THROW(net.fc->weight.to_vector()) << "the float handle is valid again";
}

// ---- every layer in double -------------------------------------------------------------

TEST(NnDouble, Linear) {
  nn::Linear fc(4, 3);
  randomize(*fc, 1);
  double_layer("Linear", fc, input({2, 4}, 2), [&](const Vec& x) {
    const Vec w = value_of(*fc, "weight"), b = value_of(*fc, "bias");
    Vec y;
    for (int n = 0; n < 2; ++n)
      for (int o = 0; o < 3; ++o) {
        double acc = b[o];
        for (int i = 0; i < 4; ++i) acc += x[n * 4 + i] * w[o * 4 + i];
        y.push_back(acc);
      }
    return y;
  });
}

TEST(NnDouble, Conv2d) {
  nn::Conv2d conv(nn::Conv2dOptions(2, 3, 3).stride(2).padding(1));
  randomize(*conv, 3);
  const auto x = input({2, 2, 5, 5}, 4);
  double_layer("Conv2d", conv, x, [&](const Vec& xv) {
    return conv_ref(xv, x.shape, value_of(*conv, "weight"), value_of(*conv, "bias"), 3, 3, 2, 1);
  });
}

TEST(NnDouble, LayerNorm) {
  nn::LayerNorm ln(Shape{3, 4});
  randomize(*ln, 5);
  double_layer("LayerNorm", ln, input({2, 3, 4}, 6, -2, 2), [&](const Vec& x) {
    return layer_norm_ref(x, 12, value_of(*ln, "weight"), value_of(*ln, "bias"), 1e-5);
  });
}

template <class BN>
void check_batch_norm(const std::string& what, BN bn, const Shape& shape) {
  randomize(*bn, 7);
  bn->to(DType::Float64);
  const auto x = input(shape, 8, -2, 2);
  // A training step updates the running statistics with torch's momentum 0.1 and the
  // unbiased batch variance.
  const Vec rm = value_of(*bn, "running_mean"), rv = value_of(*bn, "running_var");
  Vec mu, var, want_rm, want_rv;
  batch_norm_ref(x.data, shape, value_of(*bn, "weight"), value_of(*bn, "bias"), nullptr, nullptr, &mu, &var);
  for (std::size_t c = 0; c < mu.size(); ++c) {
    want_rm.push_back(0.9 * rm[c] + 0.1 * mu[c]);
    want_rv.push_back(0.9 * rv[c] + 0.1 * var[c]);
  }
  host(bn(lazy::from_vector<double>(x.data, shape)));
  expect_close(value_of(*bn, "running_mean"), want_rm, 1e-12, 1e-14, what + " running_mean");
  expect_close(value_of(*bn, "running_var"), want_rv, 1e-12, 1e-14, what + " running_var");
  EXPECT_EQ(bn->num_batches_tracked.item(), 1);

  for (bool training : {true, false}) {
    bn->train(training);
    auto ref = [&](const Vec& xv) {
      const Vec m = value_of(*bn, "running_mean"), v = value_of(*bn, "running_var");
      return batch_norm_ref(xv, shape, value_of(*bn, "weight"), value_of(*bn, "bias"), training ? nullptr : &m,
                            training ? nullptr : &v);
    };
    check_double(what + (training ? " train" : " eval"), *bn, [bn](const auto& t) { return bn(t); }, x, ref);
  }
}

TEST(NnDouble, BatchNorm1dTrainAndEval) {
  check_batch_norm("BatchNorm1d", nn::BatchNorm1d(3), Shape{4, 3, 2});
}
TEST(NnDouble, BatchNorm2dTrainAndEval) {
  check_batch_norm("BatchNorm2d", nn::BatchNorm2d(2), Shape{3, 2, 2, 2});
}

TEST(NnDouble, EmbeddingForwardAndWeightGradient) {
  nn::Embedding emb(5, 3);
  emb->to(DType::Float64);
  const std::vector<std::int64_t> ids{0, 4, 2, 2, 1, 4};  // repeated rows accumulate
  const auto idx = lazy::from_vector<std::int64_t>(ids, Shape{2, 3});
  EXPECT_EQ(emb->forward<double>(idx).shape(), (Shape{2, 3, 3}));
  auto fwd = [&](const Tensor<double>&) { return emb->forward<double>(idx); };  // no float input
  auto ref = [&](const Vec&) {
    const Vec w = value_of(*emb, "weight");
    Vec y;
    for (auto i : ids)
      for (int d = 0; d < 3; ++d) y.push_back(w[i * 3 + d]);
    return y;
  };
  check_double("Embedding", *emb, fwd, input({1}, 9), ref, /*input_grad=*/false);
  const auto idx32 = lazy::from_vector<std::int32_t>({0, 4, 2, 2, 1, 4}, Shape{2, 3});
  EXPECT_EQ(host(emb->forward<double>(idx32)), ref({}));
}

TEST(NnDouble, ActivationsFlattenAndDropout) {
  const auto x = input({3, 4}, 10, -2, 2);
  double_layer("ReLU", nn::ReLU(), x, elementwise([](double v) { return std::max(v, 0.0); }));
  double_layer("GELU", nn::GELU(), x, elementwise([](double v) { return v * (1 + std::erf(v / M_SQRT2)) / 2; }));
  double_layer("Tanh", nn::Tanh(), x, elementwise([](double v) { return std::tanh(v); }));
  double_layer("Sigmoid", nn::Sigmoid(), x, elementwise([](double v) { return 1 / (1 + std::exp(-v)); }));
  double_layer("SiLU", nn::SiLU(), x, elementwise([](double v) { return v / (1 + std::exp(-v)); }));
  const RefFn identity = [](const Vec& v) { return v; };
  nn::Flatten flat;
  double_layer("Flatten", flat, input({2, 3, 2}, 11), identity);
  EXPECT_EQ(flat(lazy::zeros<double>({2, 3, 2})).shape(), (Shape{2, 6}));
  nn::Dropout off(0.5);
  off->eval();
  double_layer("Dropout eval", off, x, identity);
  double_layer("Dropout p=0", nn::Dropout(0.0), x, identity);
}

TEST(NnDouble, Pooling) {
  const auto x = input({2, 2, 5, 5}, 12);
  double_layer("MaxPool2d", nn::MaxPool2d(nn::MaxPool2dOptions(3).stride(2).padding(1)), x,
               [&](const Vec& v) { return pool_ref(v, x.shape, 3, 2, 1, true, true); });
  double_layer("AvgPool2d", nn::AvgPool2d(nn::AvgPool2dOptions(3).stride(2).padding(1)), x,
               [&](const Vec& v) { return pool_ref(v, x.shape, 3, 2, 1, false, true); });
  double_layer("AvgPool2d exclude pad",
               nn::AvgPool2d(nn::AvgPool2dOptions(3).stride(2).padding(1).count_include_pad(false)), x,
               [&](const Vec& v) { return pool_ref(v, x.shape, 3, 2, 1, false, false); });
}

TEST(NnDouble, SequentialEqualsCompositionAndRejectsFloatOnlyModules) {
  nn::Linear l1(3, 4), l2(4, 2);
  nn::Tanh act;
  nn::Sequential seq(l1, act, l2);
  randomize(*seq, 13);
  seq->to(DType::Float64);
  const auto x = input({5, 3}, 14);
  auto composed = [&](const Vec& xv) { return l2(act(l1(lazy::from_vector<double>(xv, x.shape)))); };
  double_layer("Sequential", seq, x, [&](const Vec& xv) { return host(composed(xv)); });
  // The composition's gradients are the chain's (same output weights as check_double's).
  std::vector<Vec> chain;
  for (const auto& p : seq->parameters()) chain.push_back(host(p.grad()));
  seq->zero_grad();
  composed(x.data).backward(lazy::from_vector<double>(gradcheck::values(10, 99, 0.5, 1.5), Shape{5, 2}));
  for (std::size_t i = 0; i < chain.size(); ++i) {
    expect_close(host(seq->parameters()[i].grad()), chain[i], 1e-13, 1e-14, "gradient " + std::to_string(i));
  }

  nn::Sequential mixed(nn::Linear(3, 3), FloatOnly());
  EXPECT_NO_THROW(mixed(lazy::ones<float>({2, 3})).to_vector());
  mixed->to(DType::Float64);
  try {
    mixed(lazy::ones<double>({2, 3}));
    ADD_FAILURE() << "a float-only module in a double chain must raise";
  } catch (const lazy::DTypeError& e) {
    EXPECT_NE(std::string(e.what()).find("FloatOnly"), std::string::npos) << e.what();
  }
}

TEST(NnInitDTypes, InitializersFillEveryFloatingDType) {
  auto check = [](auto tag) {
    using T = decltype(tag);
    SCOPED_TRACE(lazy::dtype_name(lazy::dtype_of<T>()));
    auto t = lazy::empty<T>({64, 32});
    nn::init::kaiming_uniform_(t, std::sqrt(5.0));  // Linear's: U(-1/sqrt(fan_in), 1/sqrt(fan_in))
    const Vec u = host(t);
    EXPECT_LE(max_abs(u), 1 / std::sqrt(32.0) * (1 + 1e-2));  // bfloat16 may round up the bound
    EXPECT_GT(max_abs(u), 0.9 / std::sqrt(32.0));
    nn::init::normal_(t, 2.0, 0.5);
    double mean = 0, var = 0;
    for (double v : host(t)) mean += v / t.numel();
    for (double v : host(t)) var += (v - mean) * (v - mean) / t.numel();
    EXPECT_NEAR(mean, 2.0, 0.05);  // standard error 0.5 / sqrt(2048) = 0.011
    EXPECT_NEAR(std::sqrt(var), 0.5, 0.05);
    nn::init::constant_(t, 0.25);
    EXPECT_EQ(host(t), Vec(t.numel(), 0.25));
  };
  check(float{});
  check(double{});
  check(bfloat16{});
  // Every dtype draws from the same stream: double's values are float's, scaled in double.
  lazy::manual_seed(9);
  auto f = lazy::empty<float>({8, 4});
  nn::init::uniform_(f, -3, 2);
  lazy::manual_seed(9);
  auto d = lazy::empty<double>({8, 4});
  nn::init::uniform_(d, -3, 2);
  expect_close(host(d), host(f), 0, 1e-6, "uniform_ in double");
}

// Layers and functionals also take pending expressions (x * 1.0), in the expression's dtype.
TEST(NnPendingInputs, KeepTheirDTypeInLayersAndFunctionals) {
  auto check = [](auto tag) {
    using T = decltype(tag);
    SCOPED_TRACE(lazy::dtype_name(lazy::dtype_of<T>()));
    const double tol = std::is_same_v<T, double> ? 1e-12 : 1e-2;
    const auto x = lazy::from_vector<T>(typed<T>(bf_round(gradcheck::values(12, 3))), Shape{4, 3});
    nn::Sequential seq(nn::Linear(3, 5), nn::GELU(), nn::LayerNorm(Shape{5}), nn::Linear(5, 5));
    nn::BatchNorm1d bn(5);
    seq->to(lazy::dtype_of<T>());
    bn->to(lazy::dtype_of<T>());
    auto y = seq(x * 1.0);
    static_assert(std::is_same_v<decltype(y), Tensor<T>>);
    expect_close(host(y), host(seq(x)), tol, tol, "Sequential");
    static_assert(std::is_same_v<decltype(bn(y * 1.0)), Tensor<T>>);
    const auto t = lazy::from_vector<std::int64_t>({0, 4, 2, 1}, Shape{4});
    const auto w = lazy::ones<T>({5}), b = lazy::zeros<T>({5});
    const Tensor<T> p = lazy::sigmoid(y);
    auto same = [&](const auto& pending, const auto& tensor, const char* what) {
      static_assert(std::is_same_v<std::decay_t<decltype(pending)>, Tensor<T>>);
      expect_close(host(pending), host(tensor), tol, tol, what);
    };
    same(F::cross_entropy(y * 1.0, t, {nn::Reduction::Mean, 0.1}), F::cross_entropy(y, t, {nn::Reduction::Mean, 0.1}),
         "cross_entropy");
    same(F::nll_loss(y * 1.0, t), F::nll_loss(y, t), "nll_loss");
    same(F::mse_loss(y * 1.0, p * 1.0), F::mse_loss(y, p), "mse_loss");
    same(F::binary_cross_entropy_with_logits(y * 1.0, p * 1.0), F::binary_cross_entropy_with_logits(y, p), "bce");
    same(F::layer_norm(y * 1.0, Shape{5}, w, b), F::layer_norm(y, Shape{5}, w, b), "layer_norm");
    same(F::dropout(y * 1.0, 0.5, false), y, "dropout");
  };
  check(double{});
  check(bfloat16{});
}

// ---- every functional in double --------------------------------------------------------

const std::vector<std::int64_t> kTargets{1, 0, 4, 2};
Tensor<std::int64_t> targets() { return lazy::from_vector<std::int64_t>(kTargets, Shape{4}); }

// A functional over its floating inputs, callable in double, float and bfloat16.
struct FunctionalCase {
  template <class T>
  using Fn = std::function<Tensor<T>(const std::vector<Tensor<T>>&)>;
  std::string name;
  std::vector<gradcheck::Input> inputs;
  Fn<double> f64;
  Fn<float> f32;
  Fn<bfloat16> bf16;
  template <class T>
  Tensor<T> operator()(const std::vector<Tensor<T>>& xs) const {
    if constexpr (std::is_same_v<T, double>) return f64(xs);
    else if constexpr (std::is_same_v<T, float>) return f32(xs);
    else return bf16(xs);
  }
};
template <class Fn>
FunctionalCase fcase(std::string name, std::vector<gradcheck::Input> inputs, Fn fn) {
  return {std::move(name), std::move(inputs), fn, fn, fn};
}

std::vector<FunctionalCase> functional_cases() {
  using R = nn::Reduction;
  std::vector<FunctionalCase> cs;
  const auto logits = input({4, 5}, 20, -2, 2);
  const std::pair<R, double> ce[] = {{R::Mean, 0.0}, {R::Sum, 0.0}, {R::None, 0.0},
                                     {R::Mean, 0.1}, {R::Sum, 0.2}, {R::None, 0.1}};
  for (const auto& rc : ce) {
    const R r = rc.first;
    const double eps = rc.second;
    cs.push_back(fcase("cross_entropy r=" + std::to_string(int(r)) + " ls=" + std::to_string(eps), {logits},
                       [r, eps](const auto& xs) { return F::cross_entropy(xs[0], targets(), {r, eps}); }));
  }
  const auto a = input({3, 4}, 21), b = input({3, 4}, 22);
  const auto z = input({3, 4}, 23, -3, 3), y = input({3, 4}, 24, 0, 1);
  for (R r : {R::Mean, R::Sum, R::None}) {
    const std::string s = " r=" + std::to_string(int(r));
    cs.push_back(fcase("nll_loss" + s, {logits},
                       [r](const auto& xs) { return F::nll_loss(xs[0], targets(), r); }));
    cs.push_back(fcase("mse_loss" + s, {a, b}, [r](const auto& xs) { return F::mse_loss(xs[0], xs[1], r); }));
    cs.push_back(fcase("bce_with_logits" + s, {z, y},
                       [r](const auto& xs) { return F::binary_cross_entropy_with_logits(xs[0], xs[1], r); }));
  }
  cs.push_back(fcase("layer_norm", {input({2, 3, 4}, 25, -2, 2), input({4}, 26), input({4}, 27)},
                     [](const auto& xs) { return F::layer_norm(xs[0], Shape{4}, xs[1], xs[2]); }));
  cs.push_back(fcase("layer_norm 2 dims", {input({2, 3, 4}, 28, -2, 2), input({3, 4}, 29), input({3, 4}, 30)},
                     [](const auto& xs) { return F::layer_norm(xs[0], Shape{3, 4}, xs[1], xs[2], 1e-3); }));
  cs.push_back(fcase("dropout eval", {a}, [](const auto& xs) { return F::dropout(xs[0], 0.5, false); }));
  cs.push_back(fcase("dropout p=0", {a}, [](const auto& xs) { return F::dropout(xs[0], 0.0, true); }));
  return cs;
}

TEST(NnDouble, EveryFunctionalPassesGradcheck) {
  for (const auto& c : functional_cases()) gradcheck::check(c.name, c.f64, c.inputs, 1e-6, 1e-6);
}

TEST(NnDouble, LossValuesAgainstHostFormulas) {
  const auto L = input({4, 5}, 20, -2, 2);
  const auto x = lazy::from_vector<double>(L.data, L.shape);
  const double eps = 0.1;
  double ce = 0, nll = 0;
  for (int i = 0; i < 4; ++i) {
    double m = -INFINITY, s = 0;
    for (int j = 0; j < 5; ++j) m = std::max(m, L.data[i * 5 + j]);
    for (int j = 0; j < 5; ++j) s += std::exp(L.data[i * 5 + j] - m);
    for (int j = 0; j < 5; ++j) {
      ce -= ((j == kTargets[i] ? 1 - eps : 0) + eps / 5) * (L.data[i * 5 + j] - m - std::log(s)) / 4;
    }
    nll -= L.data[i * 5 + kTargets[i]];
  }
  EXPECT_NEAR(F::cross_entropy(x, targets(), {nn::Reduction::Mean, eps}).item(), ce, 1e-13);
  EXPECT_NEAR(F::nll_loss(x, targets(), nn::Reduction::Sum).item(), nll, 1e-13);
  const auto a = input({12}, 21), z = input({12}, 23, -3, 3), y = input({12}, 24, 0, 1);
  double mse = 0, bce = 0;
  for (int i = 0; i < 12; ++i) {
    mse += std::pow(a.data[i] - y.data[i], 2) / 12;
    const double p = 1 / (1 + std::exp(-z.data[i]));
    bce -= (y.data[i] * std::log(p) + (1 - y.data[i]) * std::log(1 - p)) / 12;
  }
  auto t = [](const gradcheck::Input& in) { return lazy::from_vector<double>(in.data, in.shape); };
  EXPECT_NEAR(F::mse_loss(t(a), t(y)).item(), mse, 1e-14);
  EXPECT_NEAR(F::binary_cross_entropy_with_logits(t(z), t(y)).item(), bce, 1e-14);
  const auto w = gradcheck::values(5, 1), b = gradcheck::values(5, 2);
  const Vec ln = host(F::layer_norm(x, Shape{5}, lazy::from_vector<double>(w, Shape{5}),
                                    lazy::from_vector<double>(b, Shape{5})));
  expect_close(ln, layer_norm_ref(L.data, 5, w, b, 1e-5), 1e-12, 1e-13, "layer_norm");
}

TEST(NnDouble, RandomDropoutScalesKeptElementsAndTheirGradient) {
  auto x = lazy::from_vector<double>(gradcheck::values(200, 3, 1, 2), Shape{200}).requires_grad_();
  Tensor<double> y = F::dropout(x, 0.25, true);
  lazy::sum(y).backward();
  const Vec xv = host(x), yv = host(y), gv = host(x.grad());
  int kept = 0;
  for (std::size_t i = 0; i < xv.size(); ++i) {
    const bool keep = yv[i] != 0;
    kept += keep;
    EXPECT_NEAR(yv[i], keep ? xv[i] / 0.75 : 0.0, 1e-13);
    EXPECT_NEAR(gv[i], keep ? 1 / 0.75 : 0.0, 1e-13);
  }
  EXPECT_GT(kept, 100);
  EXPECT_LT(kept, 200);
}

// ---- every layer and functional in bfloat16 against float ------------------------------

TEST(NnBFloat16, EveryLayerMatchesFloat) {
  auto layer = [](const std::string& what, auto h, const gradcheck::Input& x) {
    randomize(*h, 40);
    check_bf16(what, h.ptr().get(), fwd_of(h), {x});
  };
  const auto image = input({2, 2, 5, 5}, 42), x = input({3, 4}, 46, -2, 2);
  layer("Linear", nn::Linear(8, 5), input({3, 8}, 41));
  layer("Conv2d", nn::Conv2d(nn::Conv2dOptions(2, 3, 3).stride(2).padding(1)), image);
  layer("LayerNorm", nn::LayerNorm(Shape{6}), input({3, 6}, 43, -2, 2));
  for (bool training : {true, false}) {
    const std::string mode = training ? " train" : " eval";
    nn::BatchNorm1d bn1(3);
    nn::BatchNorm2d bn2(2);
    bn1->train(training);
    bn2->train(training);
    layer("BatchNorm1d" + mode, bn1, input({4, 3, 2}, 44, -2, 2));
    layer("BatchNorm2d" + mode, bn2, input({3, 2, 2, 2}, 45, -2, 2));
  }
  layer("ReLU", nn::ReLU(), x);
  layer("GELU", nn::GELU(), x);
  layer("Tanh", nn::Tanh(), x);
  layer("Sigmoid", nn::Sigmoid(), x);
  layer("SiLU", nn::SiLU(), x);
  layer("Flatten", nn::Flatten(), input({2, 3, 2}, 47));
  nn::Dropout off(0.5);
  off->eval();
  layer("Dropout eval", off, x);
  layer("Dropout p=0", nn::Dropout(0.0), x);
  layer("MaxPool2d", nn::MaxPool2d(nn::MaxPool2dOptions(3).stride(2).padding(1)), image);
  layer("AvgPool2d", nn::AvgPool2d(nn::AvgPool2dOptions(3).stride(2).padding(1)), image);
  layer("Sequential", nn::Sequential(nn::Linear(4, 6), nn::GELU(), nn::LayerNorm(Shape{6}), nn::Linear(6, 2)),
        x);

  nn::Embedding emb(5, 3);
  const auto idx = lazy::from_vector<std::int64_t>({0, 4, 2, 2, 1, 4}, Shape{2, 3});
  auto lookup = [&](const auto& xs) {
    using T = typename std::decay_t<decltype(xs)>::value_type::value_type;
    return emb->forward<T>(idx);
  };
  check_bf16("Embedding", emb.ptr().get(), lookup, {input({1}, 50)});
}

TEST(NnBFloat16, EveryFunctionalMatchesFloat) {
  for (const auto& c : functional_cases()) check_bf16(c.name, nullptr, c, c.inputs);
}

TEST(NnBFloat16, BuffersFollowAndOtherInputDTypesRaise) {
  nn::BatchNorm1d bn(3);
  bn->to(DType::BFloat16);
  for (const auto& [name, b] : bn->named_buffers()) {
    EXPECT_EQ(b.dtype(), name == "num_batches_tracked" ? DType::Int64 : DType::BFloat16) << name;
  }
  const Vec xv = bf_round(gradcheck::values(12, 1));
  EXPECT_EQ(host(bn(lazy::from_vector<bfloat16>(typed<bfloat16>(xv), Shape{4, 3}))).size(), 12u);
  EXPECT_EQ(bn->num_batches_tracked.item(), 1);
  EXPECT_THROW(bn(lazy::ones<float>({4, 3})), lazy::DTypeError);
  EXPECT_THROW(bn(lazy::ones<double>({4, 3})), lazy::DTypeError);
}

}  // namespace nn_dtypes_test
