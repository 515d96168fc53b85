// autograd/: backward-pass semantics as in libtorch: accumulation, retain_graph, no_grad,
// in-place rules, detach, retain_grad, torch.autograd.grad, error cases, and laziness (a
// whole training step's backward runs no kernel until mark_step).
#include <gtest/gtest.h>

#include <lazytensor/lazytensor.hpp>

namespace {

using lazy::Shape;
using lazy::Tensor;

Tensor<double> leaf(std::vector<double> v) {
  const auto n = static_cast<std::int64_t>(v.size());
  return lazy::from_vector<double>(std::move(v), Shape{n}).requires_grad_();
}

TEST(AutogradEngine, GradientsAccumulateUntilZeroed) {
  auto x = leaf({1, 2, 3});
  for (int i = 0; i < 3; ++i) lazy::sum(x * x).backward();
  EXPECT_EQ(x.grad().to_vector(), (std::vector<double>{6, 12, 18}));  // 3 * 2x
  x.grad().zero_();  // the handle shares the gradient
  lazy::sum(x * 5).backward();
  EXPECT_EQ(x.grad().to_vector(), (std::vector<double>{5, 5, 5}));
  x.set_grad(Tensor<double>());  // zero_grad(set_to_none = true)
  EXPECT_FALSE(x.grad().defined());
  lazy::sum(x).backward();
  EXPECT_EQ(x.grad().to_vector(), (std::vector<double>{1, 1, 1}));
}

TEST(AutogradEngine, GraphIsFreedUnlessRetained) {
  auto x = leaf({2, 3});
  Tensor<double> y = lazy::exp(x);
  Tensor<double> s = lazy::sum(y * y);
  s.backward(Tensor<double>(), /*retain_graph=*/true);
  s.backward();  // the graph was retained once
  const auto g = x.grad().to_vector();
  EXPECT_NEAR(g[0], 2 * 2 * std::exp(4.0), 1e-9);  // twice d/dx e^(2x)
  EXPECT_THROW(s.backward(), lazy::Error);          // freed now
}

TEST(AutogradEngine, NoGradAndDetachRecordNothing) {
  auto x = leaf({1, 2});
  {
    lazy::NoGradGuard guard;
    Tensor<double> y = x * 2;
    EXPECT_FALSE(y.requires_grad());
    EXPECT_FALSE(lazy::autograd::is_grad_enabled());
  }
  EXPECT_TRUE(lazy::autograd::is_grad_enabled());
  Tensor<double> d = x.detach() * 3;
  EXPECT_FALSE(d.requires_grad());
  Tensor<double> y = x * 2;
  EXPECT_TRUE(y.requires_grad());
  EXPECT_FALSE(y.is_leaf());
  EXPECT_EQ(y.grad_fn()->name(), "MulBackward0");
}

TEST(AutogradEngine, InPlaceRules) {
  auto x = leaf({1, 2});
  // An in-place update of a leaf that requires grad is refused while recording...
  EXPECT_THROW(x.add_(1.0), lazy::Error);
  EXPECT_THROW(x.zero_(), lazy::Error);
  {
    lazy::NoGradGuard guard;  // ...and allowed under no_grad (optimizers)
    x.sub_(0.5);
  }
  EXPECT_EQ(x.to_vector(), (std::vector<double>{0.5, 1.5}));
  EXPECT_TRUE(x.requires_grad());
  EXPECT_TRUE(x.is_leaf());
  // A non-leaf's in-place update extends its history: y = 2x; y += x^2 -> dy/dx = 2 + 2x.
  Tensor<double> y = x * 2;
  y += x * x;
  lazy::sum(y).backward();
  EXPECT_EQ(x.grad().to_vector(), (std::vector<double>{3, 5}));
  // copy_ from a tensor that requires grad makes the destination require grad.
  auto dst = lazy::zeros<double>({2});
  dst.copy_(x * 3);
  EXPECT_TRUE(dst.requires_grad());
}

TEST(AutogradEngine, RetainGradKeepsIntermediateGradients) {
  auto x = leaf({1, 2});
  Tensor<double> h = x * x;
  h.retain_grad();
  Tensor<double> y = h * 3;
  lazy::sum(y).backward();
  EXPECT_EQ(h.grad().to_vector(), (std::vector<double>{3, 3}));
  EXPECT_EQ(x.grad().to_vector(), (std::vector<double>{6, 12}));
}

TEST(AutogradEngine, FunctionalGradDoesNotTouchDotGrad) {
  auto x = leaf({1, 2, 3});
  auto w = leaf({4, 5, 6});
  Tensor<double> h = x * w;
  Tensor<double> s = lazy::sum(h * h);
  auto g = lazy::autograd::grad<double>({s}, {x, h}, {}, /*retain_graph=*/true);
  EXPECT_EQ(g[0].to_vector(), (std::vector<double>{2 * 4 * 4 * 1, 2 * 5 * 5 * 2, 2 * 6 * 6 * 3}));
  EXPECT_EQ(g[1].to_vector(), (std::vector<double>{8, 20, 36}));
  EXPECT_FALSE(x.grad().defined());
  EXPECT_FALSE(w.grad().defined());
  auto unused = leaf({1});
  EXPECT_THROW(lazy::autograd::grad<double>({s}, {unused}, {}, true), lazy::Error);
  auto none = lazy::autograd::grad<double>({s}, {unused}, {}, true, /*allow_unused=*/true);
  EXPECT_FALSE(none[0].defined());
}

TEST(AutogradEngine, BadCallsRaiseClearErrors) {
  auto i = lazy::from_vector<std::int32_t>({1}, Shape{1});
  EXPECT_THROW(i.requires_grad_(), lazy::DTypeError);
  auto x = leaf({1, 2});
  Tensor<double> y = x * 2;
  EXPECT_THROW(y.requires_grad_(), lazy::Error);          // not a leaf
  EXPECT_THROW(y.backward(), lazy::Error);                // not a scalar, no gradient given
  EXPECT_THROW(y.backward(lazy::ones<double>({3})), lazy::ShapeError);
  auto c = lazy::from_vector<double>({1.0}, Shape{1});
  EXPECT_THROW(c.backward(), lazy::Error);                // does not require grad
}

TEST(AutogradEngine, BackwardIsLazyAndRunsWithTheStep) {
  lazy::mark_step();
  auto w = lazy::randn<float>({16, 8}).requires_grad_();
  auto b = lazy::zeros<float>({16}).requires_grad_();
  auto x = lazy::randn<float>({4, 8});
  lazy::mark_step();
  const auto kernels = lazy::debug::counter_value("KernelsRun");
  const auto syncs = lazy::debug::counter_value("ImplicitSync");
  Tensor<float> h = lazy::relu(lazy::linear(x, w, b));
  Tensor<float> loss = lazy::mean(h * h);
  loss.backward();
  {
    lazy::NoGradGuard guard;
    w.sub_(w.grad() * 0.1f);
    b.sub_(b.grad() * 0.1f);
  }
  EXPECT_EQ(lazy::debug::counter_value("KernelsRun"), kernels) << "backward or update ran a kernel before mark_step";
  EXPECT_EQ(lazy::debug::counter_value("ImplicitSync"), syncs);
  lazy::mark_step();
  EXPECT_GT(lazy::debug::counter_value("KernelsRun"), kernels);
  EXPECT_EQ(lazy::debug::counter_value("ImplicitSync"), syncs);
  EXPECT_TRUE(w.grad().node()->materialized());
  EXPECT_TRUE(w.node()->materialized());
}

TEST(AutogradEngine, LinearWeightGradientIsOneGemmInTheWeightsLayout) {
  // dW = dY^T X computed directly as [out, in], not as (X^T dY)^T through a transpose copy.
  const std::vector<double> xv{1, -2, 3, 0.5, 4, -1},
      wv{0.1, 0.2, 0.3, -1, 2, 0.5, 3, -0.25, 1, 2, -3, 0.75};
  const std::vector<double> gv{1, 2, -1, 0.5, -2, 3, 0.25, 1};
  auto x = lazy::from_vector<double>(xv, Shape{2, 3});
  auto w = lazy::from_vector<double>(wv, Shape{4, 3}).requires_grad_();
  Tensor<double> y = lazy::linear(x, w);
  y.backward(lazy::from_vector<double>(gv, Shape{2, 4}));
  EXPECT_EQ(w.grad().node()->kind(), lazy::graph::NodeKind::Gemm) << w.grad().node()->op_name();
  std::vector<double> want(12, 0.0);
  for (int o = 0; o < 4; ++o)
    for (int i = 0; i < 3; ++i)
      for (int b = 0; b < 2; ++b) want[o * 3 + i] += gv[b * 4 + o] * xv[b * 3 + i];
  const auto got = w.grad().to_vector();
  ASSERT_EQ(got.size(), want.size());
  for (std::size_t j = 0; j < want.size(); ++j) EXPECT_NEAR(got[j], want[j], 1e-12) << j;
}

}  // namespace
