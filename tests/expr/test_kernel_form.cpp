// expr/kernel_form.hpp: the leaf count that sizes a node's input list, against the
// number of leaves to_kernel actually visits (repeats included) and the distinct inputs
// it keeps. Also how many references to a tensor's node an expression holds (expr_node.hpp's
// operand forwarding, operand_to_kernel).
#include <algorithm>
#include <cstddef>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include <lazytensor/lazytensor.hpp>

namespace {

using lazy::Tensor;

// Counts the leaves of an expression by walking it at run time (independent of the
// compile-time count under test).
template <class X>
std::size_t walk_leaves(const X& x) {
  if constexpr (lazy::expr::is_leaf<X>::value) {
    return 1;
  } else if constexpr (lazy::expr::is_expr_node<X>::value) {
    return std::apply([](const auto&... ch) { return (std::size_t{0} + ... + walk_leaves(ch)); },
                      x.children());
  } else {
    return 0;
  }
}

template <class E>
void check(const E& e, std::size_t distinct) {
  const auto x = lazy::expr::operand(e);
  using X = decltype(x);
  EXPECT_EQ(lazy::expr::leaf_count_v<X>, walk_leaves(x));
  lazy::graph::NodeList inputs;
  (void)lazy::expr::to_kernel(x, inputs);
  EXPECT_EQ(inputs.size(), distinct);
  EXPECT_LE(inputs.size(), lazy::expr::leaf_count_v<X>);
}

TEST(KernelForm, LeafCountCountsEveryTensorLeafOnce) {
  const auto a = lazy::full<float>({8}, 1.f), b = lazy::full<float>({8}, 2.f),
             c = lazy::full<float>({8}, 3.f), d = lazy::full<float>({8}, 4.f);
  static_assert(lazy::expr::leaf_count_v<lazy::expr::Scalar<float>> == 0);
  check(a + 1.f, 1);
  check(2.f * a - 1.f, 1);
  check(a * b + a, 2);  // three leaves, two distinct inputs
  check(lazy::relu(a * b + c) * d - 0.5f * a, 4);
  check(lazy::where(a > b, c, lazy::cast<float>(d > 0.f)), 4);
}

// Operands are forwarded (a temporary sub-expression moves into the one above it, a named
// one is copied): an expression holds one reference per tensor leaf, a named expression
// stays usable after being used, a moved one gives its references over, and the values
// are right (against a scalar loop). (The copies that moving saves are transient; their
// cost is measured in benchmarks/bench_reduction.)
TEST(KernelForm, ExpressionsHoldOneReferencePerLeafWhetherOperandsMoveOrCopy) {
  const auto a = lazy::from_vector<float>({1.f, -2.f, 3.f}), w = lazy::from_vector<float>({2.f, 2.f, -1.f}),
             b = lazy::from_vector<float>({0.5f, 0.5f, 0.5f});
  const long base = a.node().use_count(), base_w = w.node().use_count();
  auto e = lazy::relu(lazy::square(a * w + b) - a);
  EXPECT_EQ(a.node().use_count(), base + 2) << "two leaves of a, whatever the depth";
  EXPECT_EQ(w.node().use_count(), base_w + 1);
  auto f = e * 2.f;  // e is named: copied, e keeps its references
  EXPECT_EQ(a.node().use_count(), base + 4);
  auto g = lazy::where(a > b, std::move(f), 0.f);  // a moved operand transfers its references
  EXPECT_EQ(a.node().use_count(), base + 5) << "where's condition adds one";
  auto h = std::move(e) * 2.f;  // moved: h takes e's references (a copy would add two)
  EXPECT_EQ(a.node().use_count(), base + 5);
  EXPECT_EQ(w.node().use_count(), base_w + 2) << "f's copy (now g's) and h";
  const Tensor<float> y = g;
  const auto yv = y.to_vector(), av = a.to_vector(), wv = w.to_vector(), bv = b.to_vector();
  for (std::size_t i = 0; i < yv.size(); ++i) {
    const float t = av[i] * wv[i] + bv[i];
    const float want = av[i] > bv[i] ? 2.f * std::max(t * t - av[i], 0.f) : 0.f;
    EXPECT_FLOAT_EQ(yv[i], want) << i;
  }
  // A reduction of a temporary expression and of a tensor (operand_to_kernel's two paths).
  const Tensor<float> s = lazy::sum(lazy::square(a - b));
  EXPECT_FLOAT_EQ(s.item(), (1.f - .5f) * (1.f - .5f) + (-2.f - .5f) * (-2.f - .5f) + (3.f - .5f) * (3.f - .5f));
  EXPECT_FLOAT_EQ(lazy::sum(a).item(), 2.f);
  const Tensor<float> hv = h;
  EXPECT_FLOAT_EQ(hv.to_vector()[0], 2.f * std::max((1.f * 2.f + .5f) * (1.f * 2.f + .5f) - 1.f, 0.f));
  EXPECT_EQ(a.node().use_count(), base + 5) << "the reductions keep no reference once computed";
}

// Counts the leaves of `x` whose node reference is gone (moved out).
template <class X>
std::size_t moved_leaves(const X& x) {
  if constexpr (lazy::expr::is_leaf<X>::value) {
    return x.node == nullptr ? 1 : 0;
  } else if constexpr (lazy::expr::is_expr_node<X>::value) {
    return std::apply([](const auto&... ch) { return (std::size_t{0} + ... + moved_leaves(ch)); },
                      x.children());
  } else {
    return 0;
  }
}

// A consumed expression (a statement's temporary) gives its references to the node instead
// of copying them: to_kernel of an rvalue moves each distinct leaf's reference into the
// inputs (a repeated leaf keeps its own, which dies with the expression); a named one is
// never consumed, by a statement or a reduction, and a const one is copied even when moved.
TEST(KernelForm, ConsumedExpressionsMoveTheirReferencesNamedOnesKeepThem) {
  const auto a = lazy::from_vector<float>({1.f, -2.f, 3.f}), b = lazy::from_vector<float>({0.5f, 4.f, -1.f});
  const long base_a = a.node().use_count(), base_b = b.node().use_count();
  {
    auto e = a * b + a;
    ASSERT_EQ(a.node().use_count(), base_a + 2);
    lazy::graph::NodeList inputs;
    (void)lazy::expr::to_kernel(std::move(e), inputs);
    ASSERT_EQ(inputs.size(), 2u);
    EXPECT_EQ(moved_leaves(std::as_const(e)), 2u) << "a's first leaf and b's moved; a's repeat stays";
    EXPECT_EQ(a.node().use_count(), base_a + 2) << "the input and the repeated leaf";
    EXPECT_EQ(b.node().use_count(), base_b + 1) << "the input only";
  }
  EXPECT_EQ(a.node().use_count(), base_a);
  EXPECT_EQ(b.node().use_count(), base_b);

  const auto av = a.to_vector(), bv = b.to_vector();
  {
    // A statement: the node holds one reference per distinct input until it is computed.
    const Tensor<float> y = a * b + a;
    EXPECT_EQ(a.node().use_count(), base_a + 1);
    const auto yv = y.to_vector();
    for (std::size_t i = 0; i < yv.size(); ++i) EXPECT_FLOAT_EQ(yv[i], av[i] * bv[i] + av[i]) << i;
    EXPECT_EQ(a.node().use_count(), base_a) << "a computed node releases its inputs";
  }
  float want = 0.f;
  for (std::size_t i = 0; i < av.size(); ++i) want += (av[i] - bv[i]) * (av[i] - bv[i]);
  {
    auto d = lazy::square(a - b);  // named: each reduction copies, d stays whole
    EXPECT_FLOAT_EQ(lazy::sum(d).item(), want);
    EXPECT_FLOAT_EQ(lazy::mean(d).item(), want / 3.f);
    EXPECT_EQ(moved_leaves(d), 0u);
    EXPECT_FLOAT_EQ(lazy::sum(std::move(d)).item(), want) << "consumed";
    EXPECT_EQ(moved_leaves(d), 2u);
    const auto c = lazy::square(a - b);
    EXPECT_FLOAT_EQ(lazy::mean(std::move(c)).item(), want / 3.f);
    EXPECT_EQ(moved_leaves(c), 0u) << "a const expression is copied, never consumed";
  }
  EXPECT_EQ(a.node().use_count(), base_a);
}

// Consuming a temporary keeps its history: the edges move with the references. Gradients of
// a sum and a mean of temporaries, and of a statement, against the analytic ones computed
// by a scalar loop.
TEST(KernelForm, ConsumedExpressionsKeepTheirGradients) {
  const std::vector<double> pv = {0.5, -1.5, 2.0, 3.25}, tv = {1.0, 1.0, -2.0, 0.5};
  auto p = lazy::from_vector<double>(pv).requires_grad_();
  const auto t = lazy::from_vector<double>(tv);
  lazy::sum(lazy::square(p - t)).backward();
  auto g = p.grad().to_vector();
  for (std::size_t i = 0; i < pv.size(); ++i) EXPECT_DOUBLE_EQ(g[i], 2 * (pv[i] - tv[i])) << i;
  p.grad().zero_();
  lazy::mean(lazy::square(p - t) * 3.0).backward();
  g = p.grad().to_vector();
  for (std::size_t i = 0; i < pv.size(); ++i) EXPECT_DOUBLE_EQ(g[i], 6 * (pv[i] - tv[i]) / 4) << i;
  p.grad().zero_();
  Tensor<double> y = p * p + t;
  lazy::sum(y).backward();
  g = p.grad().to_vector();
  for (std::size_t i = 0; i < pv.size(); ++i) EXPECT_DOUBLE_EQ(g[i], 2 * pv[i]) << i;
}

// expr/kernel_form.hpp's text of a kernel, the form graph dumps show: "op(child, ...)", inputs
// as "inK" (K the input's slot, a repeated tensor keeping its first slot), scalars without
// trailing zeros; a gradient kernel (expr/dual.hpp) as "d/dinK(forward) * gradient".
TEST(KernelForm, TextNamesOpsSlotsAndScalars) {
  using lazy::expr::KExpr;
  using lazy::expr::KLeaf;
  using lazy::expr::Scalar;
  const auto a = lazy::from_vector<float>({1, 2}, lazy::Shape{2});
  const auto b = lazy::from_vector<float>({3, 4}, lazy::Shape{2});
  lazy::graph::NodeList inputs;
  const auto k = lazy::expr::to_kernel(lazy::expr::operand(a * b + a), inputs);
  EXPECT_EQ(lazy::expr::kernel_text(k), "add(mul(in0, in1), in0)");
  inputs.clear();
  const auto s = lazy::expr::to_kernel(lazy::expr::operand(lazy::exp(a) * 0.5f - 2.0f), inputs);
  EXPECT_EQ(lazy::expr::kernel_text(s), "sub(mul(exp(in0), 0.5), 2)");

  // Built by hand: slots as given, a three-digit slot, a negative fraction.
  using Fwd = KExpr<lazy::ops::Mul, KLeaf<float>, KLeaf<float>>;
  const Fwd mul{{KLeaf<float>{0}, KLeaf<float>{1}}};
  const lazy::expr::KGrad<Fwd, float> grad{mul, KLeaf<float>{2}, 1};
  EXPECT_EQ(lazy::expr::kernel_text(grad), "d/din1(mul(in0, in1)) * in2");
  const KExpr<lazy::ops::Add, KLeaf<double>, Scalar<double>> wide{{KLeaf<double>{123}, Scalar<double>{-0.25}}};
  EXPECT_EQ(lazy::expr::kernel_text(wide), "add(in123, -0.25)");
}

}  // namespace
