// autograd/: backward-pass semantics as in libtorch: accumulation, retain_graph, no_grad,
// in-place rules, detach, retain_grad, torch.autograd.grad, error cases, and laziness (a
// whole training step's backward runs no kernel until mark_step).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <string>

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

TEST(AutogradEngine, UnitDerivativesPassTheIncomingGradient) {
  // a + b (either side) and a - b (its left side) pass the gradient through as it is, summed
  // over broadcast dims; a leaf met more than once, the right side of a difference and a
  // conversion still go through their gradient kernels. References written out by hand.
  const std::vector<double> gv{1, -2, 3, 0.5, 0.25, -4};
  const std::vector<double> col{gv[0] + gv[3], gv[1] + gv[4], gv[2] + gv[5]};  // g summed over rows
  auto fresh = [] {
    return std::pair{lazy::from_vector<double>({1, 2, 3, 4, 5, 6}, Shape{2, 3}).requires_grad_(),
                     lazy::from_vector<double>({10, 20, 30}, Shape{3}).requires_grad_()};
  };
  auto g = [&] { return lazy::from_vector<double>(gv, Shape{2, 3}); };
  auto times = [](std::vector<double> v, double s) {
    for (auto& x : v) x *= s;
    return v;
  };
  {
    auto [a, b] = fresh();
    Tensor<double> y = a + b;
    y.backward(g());
    EXPECT_EQ(a.grad().to_vector(), gv);
    EXPECT_EQ(b.grad().to_vector(), col);
  }
  {
    auto [a, b] = fresh();
    Tensor<double> y = a - b;
    y.backward(g());
    EXPECT_EQ(a.grad().to_vector(), gv);
    EXPECT_EQ(b.grad().to_vector(), times(col, -1));
  }
  {
    auto [a, b] = fresh();
    Tensor<double> y = (a + b) + (a - b) + a + a;  // one kernel: a four times, b twice
    y.backward(g());
    EXPECT_EQ(a.grad().to_vector(), times(gv, 4));
    EXPECT_EQ(b.grad().to_vector(), times(col, 0));
  }
  {
    auto [a, b] = fresh();
    Tensor<float> y = lazy::cast<float>(a) + 1.0f;  // through a conversion: a kernel still
    y.backward(lazy::cast<float>(g()));
    EXPECT_EQ(a.grad().to_vector(), gv);
    EXPECT_FALSE(b.grad().defined());
  }
}

TEST(AutogradEngine, LinearProductRunsInItsBiasAddsRowBlocks) {
  // The bias's backward reads only the incoming gradient, so nothing but the bias add reads
  // the product, which then runs inside the add's row blocks instead of being written whole.
  auto x = lazy::randn<float>({256, 64});
  auto w = lazy::randn<float>({64, 64}).requires_grad_();
  auto b = lazy::randn<float>({64}).requires_grad_();
  Tensor<float> y = lazy::linear(x, w, b);
  lazy::sum(lazy::relu(y)).backward();
  const std::string text = lazy::debug::graph_text(y, w.grad(), b.grad());
  std::string product;  // the forward product's line
  for (std::size_t at = 0, end; at < text.size(); at = end + 1) {
    end = std::min(text.find('\n', at), text.size());
    const std::string line = text.substr(at, end - at);
    if (line.find("x [64x64]") != std::string::npos && line.find("^T)") != std::string::npos) product = line;
  }
  EXPECT_NE(product.find("{in row blocks of"), std::string::npos) << text;
  lazy::mark_step();
}

// ---- clamp: the gradient of torch's clamp_backward -----------------------------------------

TEST(AutogradClamp, FullGradientAtTheBounds) {
  // libtorch: x.grad = 1 where lo <= x <= hi (bounds included), else 0.
  auto x = leaf({0, 0.5, 1, -1, 2});
  lazy::sum(lazy::clamp(x, 0.0, 1.0)).backward();
  EXPECT_EQ(x.grad().to_vector(), (std::vector<double>{1, 1, 1, 0, 0}));
  // float, long enough for the SIMD loop and its tail; ties at both bounds throughout.
  std::vector<float> v, want;
  for (int i = 0; i < 37; ++i) {
    v.push_back(static_cast<float>(i % 5) * 0.5f - 0.5f);  // -0.5, 0, 0.5, 1, 1.5
    want.push_back(v.back() >= 0 && v.back() <= 1 ? 1.0f : 0.0f);
  }
  auto xf = lazy::from_vector<float>(v, Shape{37}).requires_grad_();
  lazy::sum(lazy::clamp(xf, 0, 1)).backward();
  EXPECT_EQ(xf.grad().to_vector(), want);
}

TEST(AutogradClamp, TensorBoundsAndNaN) {
  // clamp_backward_min_max: x where lo <= x <= hi; lo where x < lo < hi; hi where x > hi or
  // hi < lo (the last element: lo = 2 > hi = 1, the result is hi).
  auto x = leaf({0, 0.5, 1, -1, 2, 0.5});
  auto lo = leaf({0, 0, 0, 0, 0, 2});
  auto hi = leaf({1, 1, 1, 1, 1, 1});
  Tensor<double> y = lazy::clamp(x, lo, hi);
  EXPECT_EQ(y.to_vector(), (std::vector<double>{0, 0.5, 1, 0, 1, 1}));
  lazy::sum(y).backward();
  EXPECT_EQ(x.grad().to_vector(), (std::vector<double>{1, 1, 1, 0, 0, 0}));
  EXPECT_EQ(lo.grad().to_vector(), (std::vector<double>{0, 0, 0, 1, 0, 0}));
  EXPECT_EQ(hi.grad().to_vector(), (std::vector<double>{0, 0, 0, 0, 1, 1}));
  // clamp(NaN) is NaN, and its gradient 0 (NaN compares false with both bounds).
  auto n = leaf({std::numeric_limits<double>::quiet_NaN(), 0.25});
  Tensor<double> c = lazy::clamp(n, 0.0, 1.0);
  EXPECT_TRUE(std::isnan(c.to_vector()[0]));
  EXPECT_EQ(c.to_vector()[1], 0.25);
  lazy::sum(c * 1.0).backward();
  EXPECT_EQ(n.grad().to_vector(), (std::vector<double>{0, 1}));
}

// ---- in-place updates of non-leaves ----------------------------------------------------

TEST(AutogradInPlace, CopyOfAConstantSendsZerosToTheOldHistory) {
  // libtorch: y = 2x; y.copy_(zeros) -> CopyBackwards; sum(y).backward() gives x.grad = 0.
  auto x = leaf({1, 1, 1});
  Tensor<double> y = x * 2;
  y.copy_(lazy::zeros<double>({3}));
  EXPECT_TRUE(y.requires_grad());
  EXPECT_FALSE(y.is_leaf());
  ASSERT_NE(y.grad_fn(), nullptr);
  EXPECT_EQ(y.grad_fn()->name(), "CopyBackwards");
  lazy::sum(y).backward();
  EXPECT_EQ(x.grad().to_vector(), (std::vector<double>{0, 0, 0}));
  // The same through AnyTensor::zero_.
  auto x2 = leaf({1, 2});
  Tensor<double> y2 = x2 * x2;
  lazy::AnyTensor(y2).zero_();
  EXPECT_FALSE(y2.is_leaf());
  ASSERT_NE(y2.grad_fn(), nullptr);
  EXPECT_EQ(y2.grad_fn()->name(), "ZeroBackward0");
  lazy::sum(y2 + x2).backward();
  EXPECT_EQ(x2.grad().to_vector(), (std::vector<double>{1, 1}));
}

TEST(AutogradInPlace, FillAndZeroKeepANonLeafANonLeaf) {
  auto x = leaf({1, 2, 3});
  Tensor<double> y = x * 2;
  y.fill_(5.0);
  EXPECT_FALSE(y.is_leaf());
  EXPECT_TRUE(y.requires_grad());
  ASSERT_NE(y.grad_fn(), nullptr);
  EXPECT_EQ(y.grad_fn()->name(), "FillBackward0");
  EXPECT_NO_THROW(y.add_(1.0));  // not a leaf: in-place ops are allowed
  lazy::sum(y * x).backward();   // d/dx sum(6 * x) = 6; the old 2x gets zeros
  EXPECT_EQ(x.grad().to_vector(), (std::vector<double>{6, 6, 6}));
  EXPECT_FALSE(y.grad().defined());  // a non-leaf's gradient is not kept
  Tensor<double> z = x * 3;
  z.zero_();
  ASSERT_NE(z.grad_fn(), nullptr);
  EXPECT_EQ(z.grad_fn()->name(), "ZeroBackward0");
  EXPECT_EQ(z.to_vector(), (std::vector<double>{0, 0, 0}));
  // Under no_grad libtorch leaves grad_fn alone.
  Tensor<double> w = x * 4;
  const auto fn = w.grad_fn();
  {
    lazy::NoGradGuard guard;
    w.fill_(1.0);
    w.zero_();
  }
  EXPECT_EQ(w.grad_fn(), fn);
  EXPECT_FALSE(w.is_leaf());
}

TEST(AutogradInPlace, RetainGradFollowsInPlaceUpdates) {
  // libtorch: h = 2x; h.retain_grad(); h.mul_(3); sum(h).backward() -> h.grad = 1 (the
  // gradient of the new value), x.grad = 6.
  auto x = leaf({1, 2});
  Tensor<double> h = x * 2;
  h.retain_grad();
  h.mul_(3);
  lazy::sum(h).backward();
  EXPECT_EQ(h.grad().to_vector(), (std::vector<double>{1, 1}));
  EXPECT_EQ(x.grad().to_vector(), (std::vector<double>{6, 6}));
  // Through a value without history too: d/dh sum(h * h) with h = 1 is 2.
  Tensor<double> k = x * 2;
  k.retain_grad();
  k.fill_(1.0);
  lazy::sum(k * k).backward();
  EXPECT_EQ(k.grad().to_vector(), (std::vector<double>{2, 2}));
}

// ---- misuse: clear errors, as libtorch ----------------------------------------------------

TEST(AutogradErrors, UndefinedTensors) {
  Tensor<double> u;
  EXPECT_THROW(u.set_grad(lazy::ones<double>({1})), lazy::Error);
  EXPECT_THROW(u.set_grad(Tensor<double>()), lazy::Error);
  EXPECT_THROW(u.retain_grad(), lazy::Error);
  lazy::AnyTensor a;
  EXPECT_THROW(a.requires_grad_(false), lazy::Error);
  EXPECT_THROW(a.requires_grad_(true), lazy::Error);
}

TEST(AutogradErrors, RetainGradNeedsRequiresGrad) {
  // libtorch: "can't retain_grad on Tensor that has requires_grad=False".
  auto c = lazy::ones<double>({2});
  EXPECT_THROW(c.retain_grad(), lazy::Error);
  Tensor<double> d = c * 2;
  EXPECT_THROW(d.retain_grad(), lazy::Error);
  auto x = leaf({1});
  EXPECT_NO_THROW(x.retain_grad());  // a leaf that requires grad: nothing to do
}

TEST(AutogradErrors, LeafSwitchedOffAfterRecordingGetsNoGradient) {
  // libtorch's AccumulateGrad returns early when the leaf no longer requires grad.
  auto x = leaf({1, 2});
  auto w = leaf({3, 4});
  Tensor<double> y = x * w;
  x.requires_grad_(false);
  lazy::sum(y).backward();
  EXPECT_FALSE(x.grad().defined());
  EXPECT_EQ(w.grad().to_vector(), (std::vector<double>{1, 2}));
}

TEST(AutogradFunctional, EmptyInputsAreAnError) {
  // libtorch: "grad requires non-empty inputs"; and no .grad() is written.
  auto x = leaf({1, 2});
  Tensor<double> s = lazy::sum(x * x);
  EXPECT_THROW(lazy::autograd::grad<double>({s}, {}), lazy::Error);
  EXPECT_FALSE(x.grad().defined());
}

TEST(AutogradFunctional, RepeatedInputsGetTheirGradientInEverySlot) {
  auto x = leaf({1, 2, 3});
  Tensor<double> h = x * x;
  Tensor<double> s = lazy::sum(h * 3);
  Tensor<double> same = x;  // a second handle on one tensor
  auto g = lazy::autograd::grad<double>({s}, {x, same, h, x, h}, {}, /*retain_graph=*/true);
  ASSERT_EQ(g.size(), 5u);
  for (int i : {0, 1, 3}) EXPECT_EQ(g[i].to_vector(), (std::vector<double>{6, 12, 18})) << i;  // 6x
  for (int i : {2, 4}) EXPECT_EQ(g[i].to_vector(), (std::vector<double>{3, 3, 3})) << i;
  auto unused = leaf({1});
  auto u = lazy::autograd::grad<double>({s}, {unused, unused}, {}, true, /*allow_unused=*/true);
  EXPECT_FALSE(u[0].defined());
  EXPECT_FALSE(u[1].defined());
  EXPECT_FALSE(x.grad().defined());
}

// ---- to(device): differentiable, as libtorch's ToCopyBackward0 -----------------------

TEST(AutogradToDevice, GradientFlowsBackToTheSourceDevice) {
  auto x = leaf({1, 2, 3});
  const lazy::Device other(x.device().index() == 0 ? 1 : 0);
  Tensor<double> y = x.to(other);
  EXPECT_EQ(y.device(), other);
  EXPECT_TRUE(y.requires_grad());
  EXPECT_FALSE(y.is_leaf());
  ASSERT_TRUE(y.grad_fn());
  EXPECT_EQ(y.grad_fn()->name(), "ToCopyBackward0");
  // d/dx sum(y * y * w) = 2 x w, computed on `other` and copied back to x's device.
  auto w = lazy::from_vector<double>({4, 5, 6}, Shape{3}, other);
  lazy::sum(y * y * w).backward();
  EXPECT_EQ(x.grad().device(), x.device());
  EXPECT_EQ(x.grad().to_vector(), (std::vector<double>{8, 20, 36}));
  // There and back again: the gradient passes both copies (and accumulates).
  Tensor<double> z = x.to(other).to(x.device());
  EXPECT_EQ(z.device(), x.device());
  lazy::sum(z * 3).backward();
  EXPECT_EQ(x.grad().to_vector(), (std::vector<double>{11, 23, 39}));
  // A copy saves nothing: a second backward through it is allowed.
  Tensor<double> s = lazy::sum(x.to(other));
  s.backward();
  s.backward();
  EXPECT_EQ(x.grad().to_vector(), (std::vector<double>{13, 25, 41}));
}

TEST(AutogradToDevice, NoHistoryWithoutGradOrOnTheSameDevice) {
  auto x = leaf({1, 2});
  const lazy::Device other(x.device().index() == 0 ? 1 : 0);
  Tensor<double> same = x.to(x.device());
  EXPECT_EQ(same.impl(), x.impl());  // this handle, as libtorch returns self
  {
    lazy::NoGradGuard guard;
    EXPECT_FALSE(x.to(other).requires_grad());
  }
  EXPECT_FALSE(x.detach().to(other).requires_grad());
  auto i = lazy::from_vector<std::int32_t>({1, 2}, Shape{2});
  EXPECT_FALSE(i.to(other).requires_grad());
  // AnyTensor::to(device) copies through the typed handle: differentiable too.
  lazy::AnyTensor moved = lazy::AnyTensor(x).to(other);
  EXPECT_TRUE(moved.requires_grad());
  lazy::sum(moved.as<double>() * 2).backward();
  EXPECT_EQ(x.grad().device(), x.device());
  EXPECT_EQ(x.grad().to_vector(), (std::vector<double>{2, 2}));
}

// ---- gradients must live on the tensor's device -------------------------------------

std::string message_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const lazy::DeviceError& e) {
    return e.what();
  }
  return "(no DeviceError)";
}

TEST(AutogradGradDevice, BackwardAndSetGradRefuseAnotherDevice) {
  auto x = leaf({1, 2});
  const lazy::Device here = x.device(), other(here.index() == 0 ? 1 : 0);
  Tensor<double> y = x * 2;
  auto g_other = lazy::ones<double>({2}, other);
  const std::string expected = "expected device " + here.str() + " but got " + other.str();
  const std::string m = message_of([&] { y.backward(g_other); });
  EXPECT_NE(m.find("backward"), std::string::npos) << m;
  EXPECT_NE(m.find(expected), std::string::npos) << m;
  EXPECT_FALSE(x.grad().defined());  // refused before anything ran
  y.backward(lazy::from_vector<double>({1, 3}, Shape{2}, here));
  EXPECT_EQ(x.grad().to_vector(), (std::vector<double>{2, 6}));

  const std::string s = message_of([&] { x.set_grad(lazy::zeros<double>({2}, other)); });
  EXPECT_NE(s.find("set_grad"), std::string::npos) << s;
  EXPECT_NE(s.find(expected), std::string::npos) << s;
  EXPECT_EQ(x.grad().to_vector(), (std::vector<double>{2, 6}));  // unchanged

  lazy::AnyTensor ax(x);
  const std::string a =
      message_of([&] { ax.set_grad(lazy::AnyTensor(lazy::zeros<double>({2}, other))); });
  EXPECT_NE(a.find(expected), std::string::npos) << a;
  EXPECT_THROW(ax.set_grad(lazy::AnyTensor(lazy::zeros<float>({2}))), lazy::DTypeError);
  EXPECT_THROW(ax.set_grad(lazy::AnyTensor(lazy::zeros<double>({3}))), lazy::ShapeError);
  EXPECT_THROW(x.set_grad(lazy::zeros<double>({3})), lazy::ShapeError);
  x.set_grad(lazy::zeros<double>({2}, here));
  EXPECT_EQ(x.grad().to_vector(), (std::vector<double>{0, 0}));

  // torch.autograd.grad: "invalid gradient at index 0 - expected device ...".
  Tensor<double> z = x * 2;
  const std::string f =
      message_of([&] { (void)lazy::autograd::grad<double>({z}, {x}, {g_other}); });
  EXPECT_NE(f.find("grad_outputs[0]"), std::string::npos) << f;
  EXPECT_NE(f.find(expected), std::string::npos) << f;
  const auto g =
      lazy::autograd::grad<double>({z}, {x}, {lazy::from_vector<double>({1, 3}, Shape{2}, here)});
  EXPECT_EQ(g[0].device(), here);
  EXPECT_EQ(g[0].to_vector(), (std::vector<double>{2, 6}));
}

// ---- integer and bool values carry no gradient ---------------------------------------

TEST(AutogradIntegerCasts, ResultsThroughIntegerValuesDoNotRequireGrad) {
  auto x = leaf({-1.5, 0.5, 2.5});
  Tensor<std::int32_t> i = lazy::cast<std::int32_t>(x);
  EXPECT_FALSE(i.requires_grad());
  Tensor<double> from_int = lazy::cast<double>(i);
  EXPECT_FALSE(from_int.requires_grad());
  // The same conversions fused into one kernel (x.to(kInt).to(kDouble) in libtorch).
  Tensor<double> fused = lazy::cast<double>(lazy::cast<std::int32_t>(x));
  EXPECT_FALSE(fused.requires_grad());
  EXPECT_TRUE(fused.is_leaf());
  Tensor<double> mask = lazy::cast<double>(x > 0.0);  // (x > 0).double()
  EXPECT_FALSE(mask.requires_grad());
  Tensor<double> from_bool = lazy::cast<double>(lazy::cast<bool>(x)) * 2.0;
  EXPECT_FALSE(from_bool.requires_grad());
  // A reduction of such an expression records nothing either.
  EXPECT_FALSE(lazy::sum(lazy::cast<double>(x > 0.0)).requires_grad());
  EXPECT_FALSE(lazy::sum(lazy::cast<float>(lazy::cast<std::int64_t>(x))).requires_grad());
  // A floating path beside the integer one keeps its gradient: d/dx sum(x * (x > 0)) = (x > 0).
  Tensor<double> relu = x * lazy::cast<double>(x > 0.0);
  EXPECT_TRUE(relu.requires_grad());
  lazy::sum(relu).backward();
  EXPECT_EQ(x.grad().to_vector(), (std::vector<double>{0, 1, 1}));
  // ...as does a conversion to another floating dtype.
  Tensor<float> xf = lazy::cast<float>(x);
  EXPECT_TRUE(xf.requires_grad());
  x.set_grad(Tensor<double>());
  lazy::sum(lazy::cast<float>(x) * lazy::cast<float>(x < 0.0) * 3.0f).backward();
  EXPECT_EQ(x.grad().to_vector(), (std::vector<double>{3, 0, 0}));
}

// ---- a second backward through functions that saved nothing --------------------------

TEST(AutogradSecondBackward, FunctionsThatSavedNothingRunAgain) {
  auto a = leaf({1, 2});
  auto b = leaf({3, 4});
  Tensor<double> y = lazy::sum(a + b);  // AddBackward0 and SumBackward0 save no tensor
  y.backward();
  y.backward();
  EXPECT_EQ(a.grad().to_vector(), (std::vector<double>{2, 2}));
  EXPECT_EQ(b.grad().to_vector(), (std::vector<double>{2, 2}));

  // Broadcast, scalars, a cast, views and cat, none saving a tensor. q = (2 * 1.5 (m + v) - v)
  // / 0.5 over (3, 2): dq/dm = 6 per element, summed over the 2 columns m broadcasts to;
  // dq/dv = (3 - 1) / 0.5 = 4, summed over the 3 rows.
  auto m = lazy::from_vector<double>({1, 2, 3}, Shape{3, 1}).requires_grad_();
  auto v = leaf({5, 6});
  Tensor<double> h = (m + v) * 1.5;
  Tensor<float> t =
      lazy::transpose(lazy::reshape(lazy::cast<float>(h * 2.0 - v) / 0.5f, {3, 2}), 0, 1);
  Tensor<float> s = lazy::mean(lazy::cat({t, t}, 0)) * 6.0f;  // 2 sum(t) / 12 * 6 = sum(t)
  s.backward();
  EXPECT_EQ(m.grad().to_vector(), (std::vector<double>{12, 12, 12}));
  EXPECT_EQ(v.grad().to_vector(), (std::vector<double>{12, 12}));
  s.backward();
  EXPECT_EQ(m.grad().to_vector(), (std::vector<double>{24, 24, 24}));
  EXPECT_EQ(v.grad().to_vector(), (std::vector<double>{24, 24}));
  lazy::mark_step();
  s.backward();  // and after the step computed the first two
  EXPECT_EQ(m.grad().to_vector(), (std::vector<double>{36, 36, 36}));
}

TEST(AutogradSecondBackward, FreedSavedTensorsStillRaise) {
  auto a = leaf({1, 2});
  auto b = leaf({3, 4});
  Tensor<double> p = a * b;               // MulBackward0 saves a and b
  Tensor<double> y = lazy::sum(p + 1.0);  // the add and the sum save nothing
  y.backward();
  try {
    y.backward();
    ADD_FAILURE() << "expected an error";
  } catch (const lazy::Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("Trying to backward through the graph a second time"), std::string::npos) << m;
    EXPECT_NE(m.find("MulBackward0"), std::string::npos) << m;
  }
  EXPECT_EQ(a.grad().to_vector(), (std::vector<double>{3, 4}));
  // So does a fused expression whose derivative reads its input (exp), and an explicit rule
  // that saved tensors (amax keeps its input and result).
  auto x = leaf({0.5});
  Tensor<double> e = lazy::sum(lazy::exp(x));
  e.backward();
  EXPECT_THROW(e.backward(), lazy::Error);
  Tensor<double> mx = lazy::amax(x * 2, {0});
  mx.backward();
  EXPECT_THROW(mx.backward(), lazy::Error);
}

// ---- AnyTensor's in-place zero_ follows the typed rule ---------------------------------

TEST(AutogradInPlace, AnyTensorZeroRefusesALeafThatRequiresGrad) {
  auto x = leaf({1, 2});
  std::string typed, any;
  try {
    x.zero_();
  } catch (const lazy::Error& e) {
    typed = e.what();
  }
  lazy::AnyTensor ax(x);
  try {
    ax.zero_();
  } catch (const lazy::Error& e) {
    any = e.what();
  }
  EXPECT_NE(any.find("a leaf Variable that requires grad is being used in an in-place operation"),
            std::string::npos)
      << any;
  EXPECT_EQ(any, typed);
  EXPECT_EQ(x.to_vector(), (std::vector<double>{1, 2}));  // unchanged
  {
    lazy::NoGradGuard guard;  // allowed under no_grad, as the typed zero_
    ax.zero_();
  }
  EXPECT_EQ(x.to_vector(), (std::vector<double>{0, 0}));
  EXPECT_TRUE(x.is_leaf());
  // A non-leaf may be zeroed: its history then receives zeros (ZeroBackward0).
  auto w = leaf({3, 4});
  Tensor<double> y = w * 2;
  lazy::AnyTensor(y).zero_();
  ASSERT_TRUE(y.grad_fn());
  EXPECT_EQ(y.grad_fn()->name(), "ZeroBackward0");
  lazy::sum(y).backward();
  EXPECT_EQ(w.grad().to_vector(), (std::vector<double>{0, 0}));
}

// ---- fill_: values the dtype cannot hold ------------------------------------------------

TEST(TensorFill, ValuesOutOfRangeAreErrors) {
  // libtorch: "value cannot be converted to type int32_t without overflow".
  const double nan = std::numeric_limits<double>::quiet_NaN(),
               inf = std::numeric_limits<double>::infinity();
  auto i = lazy::zeros<std::int32_t>({2});
  EXPECT_THROW(i.fill_(3e9), lazy::Error);
  EXPECT_THROW(i.fill_(-3e9), lazy::Error);
  EXPECT_THROW(i.fill_(nan), lazy::Error);
  EXPECT_THROW(i.fill_(inf), lazy::Error);
  EXPECT_THROW(i.fill_(std::int64_t{1} << 40), lazy::Error);
  EXPECT_EQ(i.to_vector(), (std::vector<std::int32_t>{0, 0}));  // unchanged
  i.fill_(2147483647.9);                                        // truncates toward zero into range
  EXPECT_EQ(i.to_vector(), (std::vector<std::int32_t>{2147483647, 2147483647}));
  i.fill_(-2147483648.0);
  EXPECT_EQ(i.to_vector(), (std::vector<std::int32_t>{-2147483647 - 1, -2147483647 - 1}));
  i.fill_(-7.9);
  EXPECT_EQ(i.to_vector(), (std::vector<std::int32_t>{-7, -7}));
  auto l = lazy::zeros<std::int64_t>({1});
  EXPECT_THROW(l.fill_(9.3e18), lazy::Error);
  EXPECT_THROW(l.fill_(9.223372036854775808e18), lazy::Error);  // 2^63
  l.fill_(-9.223372036854775808e18);                            // -2^63 fits
  EXPECT_EQ(l.to_vector()[0], std::numeric_limits<std::int64_t>::min());
  auto f = lazy::zeros<float>({1});
  EXPECT_THROW(f.fill_(1e300), lazy::Error);
  f.fill_(inf);  // infinities and NaN convert to a floating type
  EXPECT_EQ(f.to_vector()[0], std::numeric_limits<float>::infinity());
  f.fill_(nan);
  EXPECT_TRUE(std::isnan(f.to_vector()[0]));
  auto b = lazy::zeros<bool>({1});
  b.fill_(2.5);  // any value converts to bool
  EXPECT_TRUE(b.to_vector()[0]);
}

}  // namespace
