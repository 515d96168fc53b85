// Tests of nn/conv.hpp and nn/pooling.hpp: Conv2d, MaxPool2d and AvgPool2d against the
// functional ops (same weights, bitwise) and against direct nested loops written here (the
// definitions of cross-correlation, pooling and their gradients, in double); parameter
// names, shapes, state_dict round trips (in memory and through a safetensors file),
// PyTorch's initialization bounds, option checks and printing.

#include <unistd.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include <gtest/gtest.h>

#include <lazytensor/io.hpp>
#include <lazytensor/lazytensor.hpp>
#include <lazytensor/nn.hpp>

#include "testing/helpers.hpp"

namespace {

using lazy_tests::random_values;

using lazy::Shape;
using lazy::Size2;
using lazy::Tensor;
namespace nn = lazy::nn;

Tensor<float> random_tensor(Shape s, unsigned seed) {
  return lazy::from_vector<float>(random_values<float>(s.numel(), seed), s);
}

/// Geometry of one convolution or pooling window over [N, C, H, W].
struct Geometry {
  std::int64_t n, c, h, w, kh, kw;
  Size2 stride = 1, padding = 0, dilation = 1;
  std::int64_t oh() const { return (h + 2 * padding.h - dilation.h * (kh - 1) - 1) / stride.h + 1; }
  std::int64_t ow() const { return (w + 2 * padding.w - dilation.w * (kw - 1) - 1) / stride.w + 1; }
  /// Input row/column read by output (oy, ox) at tap (i, j); -1 when in the padding.
  std::int64_t row(std::int64_t oy, std::int64_t i) const {
    const std::int64_t y = oy * stride.h - padding.h + i * dilation.h;
    return y >= 0 && y < h ? y : -1;
  }
  std::int64_t col(std::int64_t ox, std::int64_t j) const {
    const std::int64_t x = ox * stride.w - padding.w + j * dilation.w;
    return x >= 0 && x < w ? x : -1;
  }
  std::size_t in_at(std::int64_t n_, std::int64_t c_, std::int64_t y, std::int64_t x) const {
    return static_cast<std::size_t>(((n_ * c + c_) * h + y) * w + x);
  }
};

/// Cross-correlation by its definition: y[n,o,oy,ox] = b[o] + sum_{c,i,j} w[o,c,i,j] x[...].
std::vector<double> reference_conv(const Geometry& g, std::int64_t out, const std::vector<float>& x,
                                   const std::vector<float>& w, const std::vector<float>& b) {
  const std::int64_t OH = g.oh(), OW = g.ow();
  std::vector<double> y(static_cast<std::size_t>(g.n * out * OH * OW));
  std::size_t at = 0;
  for (std::int64_t n = 0; n < g.n; ++n)
    for (std::int64_t o = 0; o < out; ++o)
      for (std::int64_t oy = 0; oy < OH; ++oy)
        for (std::int64_t ox = 0; ox < OW; ++ox, ++at) {
          double acc = b.empty() ? 0.0 : b[static_cast<std::size_t>(o)];
          for (std::int64_t c = 0; c < g.c; ++c)
            for (std::int64_t i = 0; i < g.kh; ++i)
              for (std::int64_t j = 0; j < g.kw; ++j) {
                const std::int64_t yy = g.row(oy, i), xx = g.col(ox, j);
                if (yy < 0 || xx < 0) continue;
                acc += double(w[static_cast<std::size_t>(((o * g.c + c) * g.kh + i) * g.kw + j)]) *
                       x[g.in_at(n, c, yy, xx)];
              }
          y[at] = acc;
        }
  return y;
}

/// Gradients of L = sum(conv(x) * gy) by the chain rule applied to the definition above.
struct ConvGrads {
  std::vector<double> dx, dw, db;
};
ConvGrads reference_conv_grads(const Geometry& g, std::int64_t out, const std::vector<float>& x,
                               const std::vector<float>& w, const std::vector<float>& gy) {
  ConvGrads r{std::vector<double>(x.size()), std::vector<double>(w.size()),
              std::vector<double>(static_cast<std::size_t>(out))};
  const std::int64_t OH = g.oh(), OW = g.ow();
  std::size_t at = 0;
  for (std::int64_t n = 0; n < g.n; ++n)
    for (std::int64_t o = 0; o < out; ++o)
      for (std::int64_t oy = 0; oy < OH; ++oy)
        for (std::int64_t ox = 0; ox < OW; ++ox, ++at) {
          const double gv = gy[at];
          r.db[static_cast<std::size_t>(o)] += gv;
          for (std::int64_t c = 0; c < g.c; ++c)
            for (std::int64_t i = 0; i < g.kh; ++i)
              for (std::int64_t j = 0; j < g.kw; ++j) {
                const std::int64_t yy = g.row(oy, i), xx = g.col(ox, j);
                if (yy < 0 || xx < 0) continue;
                const auto wi = static_cast<std::size_t>(((o * g.c + c) * g.kh + i) * g.kw + j);
                r.dw[wi] += gv * x[g.in_at(n, c, yy, xx)];
                r.dx[g.in_at(n, c, yy, xx)] += gv * w[wi];
              }
        }
  return r;
}

void expect_near_all(const std::vector<float>& got, const std::vector<double>& want, double tol,
                     const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (std::size_t i = 0; i < got.size(); ++i) {
    ASSERT_NEAR(got[i], want[i], tol * (1 + std::abs(want[i]))) << what << " at " << i;
  }
}

/// Expects `f` to throw E with every one of `parts` in its message.
template <class E, class F>
void expect_error(F&& f, const std::vector<std::string>& parts) {
  try {
    f();
    ADD_FAILURE() << "no exception; expected one mentioning '" << parts.front() << "'";
  } catch (const E& e) {
    const std::string msg = e.what();
    for (const auto& p : parts)
      EXPECT_NE(msg.find(p), std::string::npos) << "'" << p << "' not in: " << msg;
  }
}

TEST(Conv2d, ForwardMatchesFunctionalAndDefinition) {
  const Geometry g{2, 3, 7, 8, 3, 2, {2, 1}, {1, 0}, {1, 2}};
  nn::Conv2d conv(nn::Conv2dOptions(3, 4, {3, 2}).stride({2, 1}).padding({1, 0}).dilation({1, 2}));
  EXPECT_EQ(conv->weight.shape(), (Shape{4, 3, 3, 2}));
  EXPECT_EQ(conv->bias.shape(), (Shape{4}));
  Tensor<float> x = random_tensor({2, 3, 7, 8}, 1);
  Tensor<float> y = conv(x);
  EXPECT_EQ(y.shape(), (Shape{2, 4, g.oh(), g.ow()}));
  Tensor<float> yf = lazy::conv2d(x, conv->weight, conv->bias, {2, 1}, {1, 0}, {1, 2});
  EXPECT_EQ(y.to_vector(), yf.to_vector());
  expect_near_all(
      y.to_vector(),
      reference_conv(g, 4, x.to_vector(), conv->weight.to_vector(), conv->bias.to_vector()), 1e-5,
      "conv2d forward");

  nn::Conv2d plain(nn::Conv2dOptions(3, 2, 1).bias(false));
  EXPECT_FALSE(plain->bias.defined());
  EXPECT_EQ(plain->parameters().size(), 1u);
  const Geometry g1{2, 3, 7, 8, 1, 1};
  expect_near_all(plain(x).to_vector(),
                  reference_conv(g1, 2, x.to_vector(), plain->weight.to_vector(), {}), 1e-5,
                  "1x1 conv without bias");
}

TEST(Conv2d, GradientsMatchTheDefinition) {
  const Geometry g{2, 2, 6, 5, 3, 3, 2, 1, 1};
  nn::Conv2d conv(nn::Conv2dOptions(2, 3, 3).stride(2).padding(1));
  const std::vector<float> xv = random_values<float>(2 * 2 * 6 * 5, 2);
  Tensor<float> x = lazy::from_vector<float>(xv, {2, 2, 6, 5}).requires_grad_();
  Tensor<float> y = conv(x);
  const std::vector<float> gy = random_values<float>(y.numel(), 3);
  lazy::sum(y * lazy::from_vector<float>(gy, y.shape())).backward();
  lazy::mark_step();
  ASSERT_TRUE(conv->weight.grad().defined());
  ASSERT_TRUE(conv->bias.grad().defined());
  ASSERT_TRUE(x.grad().defined());
  const ConvGrads ref = reference_conv_grads(g, 3, xv, conv->weight.to_vector(), gy);
  expect_near_all(conv->weight.grad().to_vector(), ref.dw, 1e-5, "d weight");
  expect_near_all(conv->bias.grad().to_vector(), ref.db, 1e-5, "d bias");
  expect_near_all(x.grad().to_vector(), ref.dx, 1e-5, "d input");
}

TEST(Conv2d, InitializationBoundsArePyTorchs) {
  lazy::manual_seed(7);
  // fan_in = in * kH * kW: 3 * 3 * 2 = 18 and 16 * 5 * 5 = 400.
  for (auto [in, k, fan] : {std::tuple{3, Size2{3, 2}, 18.0}, std::tuple{16, Size2{5}, 400.0}}) {
    nn::Conv2d conv(in, 64, k);
    const double bound = 1 / std::sqrt(fan);
    for (const auto& [name, values] : {std::pair{std::string("weight"), conv->weight.to_vector()},
                                       std::pair{std::string("bias"), conv->bias.to_vector()}}) {
      SCOPED_TRACE(name + ", fan_in " + std::to_string(fan));
      double peak = 0, mean = 0, var = 0;
      for (float v : values) {
        peak = std::max(peak, double(std::abs(v)));
        mean += v / double(values.size());
      }
      for (float v : values) var += (v - mean) * (v - mean) / double(values.size());
      EXPECT_LE(peak, bound);
      // U(-b, b): the largest of 64 |draws| is below 0.75 b with probability 0.75^64 ~ 1e-8,
      // the largest of 1152 below 0.95 b with probability ~ 1e-26.
      EXPECT_GT(peak, (values.size() > 64 ? 0.95 : 0.75) * bound);
      if (values.size() > 64) {
        EXPECT_NEAR(mean, 0, 0.1 * bound);
        EXPECT_NEAR(var, bound * bound / 3, 0.15 * bound * bound / 3);
      }
    }
  }
}

TEST(Conv2d, NamesShapesAndStateDictRoundTrip) {
  auto make = [] {
    return nn::Sequential(nn::Conv2d(nn::Conv2dOptions(1, 4, 3).padding(1)), nn::ReLU(),
                          nn::MaxPool2d(2), nn::Conv2d(nn::Conv2dOptions(4, 2, 3).bias(false)),
                          nn::AvgPool2d(2), nn::Flatten(), nn::Linear(2, 3));
  };
  lazy::manual_seed(1);
  nn::Sequential a = make();
  lazy::manual_seed(2);
  nn::Sequential b = make();

  std::vector<std::string> names;
  std::vector<Shape> shapes;
  for (auto& [n, p] : a->named_parameters()) {
    names.push_back(n);
    shapes.push_back(p.shape());
    EXPECT_TRUE(p.requires_grad()) << n;
  }
  EXPECT_EQ(names,
            (std::vector<std::string>{"0.weight", "0.bias", "3.weight", "6.weight", "6.bias"}));
  EXPECT_EQ(shapes, (std::vector<Shape>{{4, 1, 3, 3}, {4}, {2, 4, 3, 3}, {3, 2}, {3}}));
  EXPECT_EQ(a->state_dict().keys(), names);  // pooling layers hold no state

  Tensor<float> x = random_tensor({2, 1, 8, 8}, 4);  // 8 -> pool 4 -> conv 2 -> pool 1
  ASSERT_NE(a(x).to_vector(), b(x).to_vector()) << "differently seeded models must differ";

  // Through a safetensors file, into a model with other values.
  const auto path = std::filesystem::temp_directory_path() /
                    ("lazytensor_test_conv_" + std::to_string(::getpid()) + ".safetensors");
  lazy::io::save_file(a->state_dict(), path.string());
  b->load_state_dict(lazy::io::load(path.string()));
  std::filesystem::remove(path);
  EXPECT_EQ(a(x).to_vector(), b(x).to_vector());
  auto* conv = dynamic_cast<nn::Conv2dImpl*>(b->named_children()[0].second.get());
  ASSERT_NE(conv, nullptr);
  EXPECT_EQ(conv->weight.to_vector(), a->state_dict().at("0.weight").as<float>().to_vector());

  // In memory, into a single layer; a mis-shaped weight is refused and changes nothing.
  nn::Conv2d c1(nn::Conv2dOptions(1, 4, 3).padding(1)), c2(nn::Conv2dOptions(1, 4, 3).padding(1));
  c2->load_state_dict(c1->state_dict());
  EXPECT_EQ(c1->weight.to_vector(), c2->weight.to_vector());
  EXPECT_EQ(c1->bias.to_vector(), c2->bias.to_vector());
  nn::Conv2d other(1, 4, 5);
  const auto before = other->weight.to_vector();
  EXPECT_THROW(other->load_state_dict(c1->state_dict()), lazy::ShapeError);
  EXPECT_EQ(other->weight.to_vector(), before);
}

TEST(Conv2d, BadOptionsAndInputsRaise) {
  expect_error<lazy::ShapeError>([] { nn::Conv2d(0, 4, 3); }, {"Conv2d", "in_channels", "0"});
  expect_error<lazy::ShapeError>([] { nn::Conv2d(2, -1, 3); }, {"Conv2d", "out_channels", "-1"});
  expect_error<lazy::ShapeError>(
      [] {
        nn::Conv2d(2, 4, Size2{3, 0});
      },
      {"Conv2d", "kernel_size", "(3, 0)"});
  expect_error<lazy::ShapeError>(
      [] {
        nn::Conv2d(nn::Conv2dOptions(2, 4, 3).stride({1, 0}));
      },
      {"Conv2d", "stride", "(1, 0)"});
  expect_error<lazy::ShapeError>([] { nn::Conv2d(nn::Conv2dOptions(2, 4, 3).padding(-1)); },
                                 {"Conv2d", "padding", "(-1, -1)"});
  expect_error<lazy::ShapeError>([] { nn::Conv2d(nn::Conv2dOptions(2, 4, 3).dilation(0)); },
                                 {"Conv2d", "dilation", "(0, 0)"});
  nn::Conv2d conv(2, 4, 3);
  expect_error<lazy::ShapeError>(
      [&] {
        conv(lazy::zeros<float>({1, 3, 5, 5}));
      },
      {"conv2d", "channels", "(1, 3, 5, 5)"});
  expect_error<lazy::ShapeError>([&] { conv(lazy::zeros<float>({2, 5, 5})); }, {"conv2d", "4-D"});
  expect_error<lazy::ShapeError>(
      [&] {
        conv(lazy::zeros<float>({1, 2, 2, 5}));
      },
      {"conv2d", "kernel size"});

  expect_error<lazy::ShapeError>([] { nn::MaxPool2d(0); }, {"MaxPool2d", "kernel_size", "(0, 0)"});
  expect_error<lazy::ShapeError>(
      [] {
        nn::MaxPool2d(nn::MaxPool2dOptions(2).stride({0, 1}));
      },
      {"MaxPool2d", "stride", "(0, 1)"});
  expect_error<lazy::ShapeError>([] { nn::MaxPool2d(nn::MaxPool2dOptions(3).padding(2)); },
                                 {"MaxPool2d", "half of the kernel", "(2, 2)"});
  expect_error<lazy::ShapeError>([] { nn::AvgPool2d(nn::AvgPool2dOptions(2).padding(-1)); },
                                 {"AvgPool2d", "padding", "(-1, -1)"});
  expect_error<lazy::ShapeError>([] { nn::AvgPool2d(Size2{2, -2}); }, {"AvgPool2d", "kernel_size"});
  nn::MaxPool2d pool(3);
  expect_error<lazy::ShapeError>([&] { pool(lazy::zeros<float>({1, 1, 2, 4})); }, {"max_pool2d"});
}

/// Max and average pooling by their definitions (PyTorch's rules: padding is -inf for max
/// and counts in the average's divisor when count_include_pad), and the input gradient of
/// sum(pool(x) * gy).
struct PoolRef {
  std::vector<double> y, dx;
};
PoolRef reference_pool(const Geometry& g, bool max, bool count_include_pad,
                       const std::vector<float>& x, const std::vector<float>& gy) {
  PoolRef r{{}, std::vector<double>(x.size())};
  std::size_t at = 0;
  for (std::int64_t n = 0; n < g.n; ++n)
    for (std::int64_t c = 0; c < g.c; ++c)
      for (std::int64_t oy = 0; oy < g.oh(); ++oy)
        for (std::int64_t ox = 0; ox < g.ow(); ++ox, ++at) {
          double best = -INFINITY, sum = 0;
          std::size_t arg = 0;
          std::int64_t inside = 0, padded = 0;
          for (std::int64_t i = 0; i < g.kh; ++i)
            for (std::int64_t j = 0; j < g.kw; ++j) {
              const std::int64_t yy = oy * g.stride.h - g.padding.h + i,
                                 xx = ox * g.stride.w - g.padding.w + j;
              // torch's divisor counts the window clipped to the padded plane.
              if (yy < g.h + g.padding.h && xx < g.w + g.padding.w) ++padded;
              if (g.row(oy, i) < 0 || g.col(ox, j) < 0) continue;
              const std::size_t k = g.in_at(n, c, yy, xx);
              ++inside;
              sum += x[k];
              if (x[k] > best) best = x[k], arg = k;
            }
          if (max) {
            r.y.push_back(best);
            r.dx[arg] += gy[at];
          } else {
            const double div = double(count_include_pad ? padded : inside);
            r.y.push_back(sum / div);
            for (std::int64_t i = 0; i < g.kh; ++i)
              for (std::int64_t j = 0; j < g.kw; ++j) {
                const std::int64_t yy = g.row(oy, i), xx = g.col(ox, j);
                if (yy >= 0 && xx >= 0) r.dx[g.in_at(n, c, yy, xx)] += gy[at] / div;
              }
          }
        }
  return r;
}

TEST(Pooling, ModulesMatchFunctionalAndDefinition) {
  const std::vector<float> xv = random_values<float>(2 * 3 * 7 * 6, 5);  // distinct values: one argmax
  struct Case {
    bool max;
    Geometry g;
    bool count_include_pad = true;
  };
  const Case cases[] = {
      {true, {2, 3, 7, 6, 2, 2, 2, 0}},  // stride defaults to the kernel
      {true, {2, 3, 7, 6, 3, 2, {2, 1}, {1, 1}}},
      {false, {2, 3, 7, 6, 3, 3, 3, 0}},
      {false, {2, 3, 7, 6, 3, 2, {1, 2}, {1, 0}}},
      {false, {2, 3, 7, 6, 3, 3, 2, 1}, false},
  };
  for (const auto& k : cases) {
    const Geometry& g = k.g;
    SCOPED_TRACE(std::string(k.max ? "max" : "avg") + " kernel " + Size2(g.kh, g.kw).str() +
                 " stride " + g.stride.str() + " padding " + g.padding.str());
    Tensor<float> x = lazy::from_vector<float>(xv, {2, 3, 7, 6}).requires_grad_();
    Tensor<float> y, yf;
    const bool default_stride = g.stride == Size2(g.kh, g.kw) && g.padding == Size2(0);
    if (k.max) {
      nn::MaxPool2d pool =
          default_stride
              ? nn::MaxPool2d(Size2{g.kh, g.kw})
              : nn::MaxPool2d(
                    nn::MaxPool2dOptions({g.kh, g.kw}).stride(g.stride).padding(g.padding));
      EXPECT_EQ(pool->options.stride(), g.stride);
      EXPECT_TRUE(pool->parameters().empty());
      y = pool(x);
      yf = lazy::max_pool2d(x.detach(), {g.kh, g.kw}, g.stride, g.padding);
    } else {
      nn::AvgPool2d pool = default_stride
                               ? nn::AvgPool2d(Size2{g.kh, g.kw})
                               : nn::AvgPool2d(nn::AvgPool2dOptions({g.kh, g.kw})
                                                   .stride(g.stride)
                                                   .padding(g.padding)
                                                   .count_include_pad(k.count_include_pad));
      EXPECT_EQ(pool->options.stride(), g.stride);
      y = pool(x);
      yf = lazy::avg_pool2d(x.detach(), {g.kh, g.kw}, g.stride, g.padding, k.count_include_pad);
    }
    ASSERT_EQ(y.shape(), (Shape{2, 3, g.oh(), g.ow()}));
    EXPECT_EQ(y.to_vector(), yf.to_vector());
    const std::vector<float> gy = random_values<float>(y.numel(), 6);
    const PoolRef ref = reference_pool(g, k.max, k.count_include_pad, xv, gy);
    expect_near_all(y.to_vector(), ref.y, 1e-6, "forward");
    lazy::sum(y * lazy::from_vector<float>(gy, y.shape())).backward();
    expect_near_all(x.grad().to_vector(), ref.dx, 1e-6, "d input");
  }
}

TEST(ConvPooling, PrettyPrintIsPyTorchs) {
  EXPECT_EQ(nn::Conv2d(1, 32, 3)->str(), "Conv2d(1, 32, kernel_size=(3, 3), stride=(1, 1))");
  EXPECT_EQ(
      nn::Conv2d(nn::Conv2dOptions(3, 8, {3, 5}).stride(2).padding({1, 2}).dilation(3).bias(false))
          ->str(),
      "Conv2d(3, 8, kernel_size=(3, 5), stride=(2, 2), padding=(1, 2), dilation=(3, 3), "
      "bias=False)");
  EXPECT_EQ(nn::MaxPool2d(2)->str(),
            "MaxPool2d(kernel_size=2, stride=2, padding=0, dilation=1, ceil_mode=False)");
  EXPECT_EQ(nn::MaxPool2d(nn::MaxPool2dOptions({3, 2}).stride(1).padding({1, 0}))->str(),
            "MaxPool2d(kernel_size=(3, 2), stride=1, padding=(1, 0), dilation=1, ceil_mode=False)");
  EXPECT_EQ(nn::AvgPool2d(2)->str(), "AvgPool2d(kernel_size=2, stride=2, padding=0)");
  EXPECT_EQ(nn::AvgPool2d(nn::AvgPool2dOptions(3).padding(1).count_include_pad(false))->str(),
            "AvgPool2d(kernel_size=3, stride=3, padding=1, count_include_pad=False)");
  nn::Sequential net(nn::Conv2d(nn::Conv2dOptions(1, 4, 3).padding(1)), nn::MaxPool2d(2));
  EXPECT_EQ(net->str(),
            "Sequential(\n"
            "  (0): Conv2d(1, 4, kernel_size=(3, 3), stride=(1, 1), padding=(1, 1))\n"
            "  (1): MaxPool2d(kernel_size=2, stride=2, padding=0, dilation=1, ceil_mode=False)\n"
            ")");
}

}  // namespace
