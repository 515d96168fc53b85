// autograd/: every derivative rule against central finite differences in double
// (gradcheck.hpp): the compile-time rules of every element-wise op (with broadcasting,
// repeated and detached leaves), and the explicit rules of reductions, matmul, shape and
// index ops and the softmax family.
#include "gradcheck.hpp"

namespace {

using gradcheck::check;
using gradcheck::input;
using lazy::Shape;
using lazy::Tensor;
using V = std::vector<Tensor<double>>;

// ---- element-wise: compile-time derivatives ----------------------------------------------

TEST(GradElementwise, UnaryOps) {
  const auto x = input(Shape{2, 3}, 1);
  const auto pos = input(Shape{2, 3}, 2, 0.2, 3);
  check("neg", [](const V& v) { return Tensor<double>(-v[0]); }, {x});
  check("exp", [](const V& v) { return Tensor<double>(lazy::exp(v[0])); }, {x});
  check("log", [](const V& v) { return Tensor<double>(lazy::log(v[0])); }, {pos});
  check("log1p", [](const V& v) { return Tensor<double>(lazy::log1p(v[0])); }, {pos});
  check("expm1", [](const V& v) { return Tensor<double>(lazy::expm1(v[0])); }, {x});
  check("sqrt", [](const V& v) { return Tensor<double>(lazy::sqrt(v[0])); }, {pos});
  check("rsqrt", [](const V& v) { return Tensor<double>(lazy::rsqrt(v[0])); }, {pos});
  check("square", [](const V& v) { return Tensor<double>(lazy::square(v[0])); }, {x});
  check("abs", [](const V& v) { return Tensor<double>(lazy::abs(v[0])); }, {x});
  check("sin", [](const V& v) { return Tensor<double>(lazy::sin(v[0])); }, {x});
  check("cos", [](const V& v) { return Tensor<double>(lazy::cos(v[0])); }, {x});
  check("tanh", [](const V& v) { return Tensor<double>(lazy::tanh(v[0])); }, {x});
  check("sigmoid", [](const V& v) { return Tensor<double>(lazy::sigmoid(v[0])); }, {x});
  check("relu", [](const V& v) { return Tensor<double>(lazy::relu(v[0])); }, {x});
  check("gelu", [](const V& v) { return Tensor<double>(lazy::gelu(v[0])); }, {input(Shape{2, 3}, 3, -3, 3)});
  check("silu", [](const V& v) { return Tensor<double>(lazy::silu(v[0])); }, {input(Shape{2, 3}, 4, -3, 3)});
  check("softplus", [](const V& v) { return Tensor<double>(lazy::softplus(v[0])); }, {input(Shape{2, 3}, 5, -3, 3)});
  check("reciprocal", [](const V& v) { return Tensor<double>(lazy::reciprocal(v[0])); }, {pos});
  check("log2", [](const V& v) { return Tensor<double>(lazy::log2(v[0])); }, {pos});
  check("log10", [](const V& v) { return Tensor<double>(lazy::log10(v[0])); }, {pos});
  check("erf", [](const V& v) { return Tensor<double>(lazy::erf(v[0])); }, {input(Shape{2, 3}, 7, -2, 2)});
  const auto unit = input(Shape{2, 3}, 9, -0.9, 0.9), above1 = input(Shape{2, 3}, 10, 1.1, 3);
  check("tan", [](const V& v) { return Tensor<double>(lazy::tan(v[0])); }, {input(Shape{2, 3}, 9, -1.4, 1.4)});
  check("asin", [](const V& v) { return Tensor<double>(lazy::asin(v[0])); }, {unit});
  check("acos", [](const V& v) { return Tensor<double>(lazy::acos(v[0])); }, {unit});
  check("atan", [](const V& v) { return Tensor<double>(lazy::atan(v[0])); }, {x});
  check("sinh", [](const V& v) { return Tensor<double>(lazy::sinh(v[0])); }, {x});
  check("cosh", [](const V& v) { return Tensor<double>(lazy::cosh(v[0])); }, {x});
  check("asinh", [](const V& v) { return Tensor<double>(lazy::asinh(v[0])); }, {x});
  check("acosh", [](const V& v) { return Tensor<double>(lazy::acosh(v[0])); }, {above1});
  check("atanh", [](const V& v) { return Tensor<double>(lazy::atanh(v[0])); }, {unit});
  // Finite values pass their gradient; a NaN or an infinity's is zero (torch's).
  check("nan_to_num", [](const V& v) { return Tensor<double>(lazy::nan_to_num(v[0] * 2.0, 0.0, 1.0)); }, {x});
  // Rounding is flat between its steps (inputs away from them): zero gradients.
  const auto off_steps = input(Shape{2, 3}, 8, 0.1, 0.4);
  check("floor", [](const V& v) { return Tensor<double>(lazy::floor(v[0] + 2.0)); }, {off_steps});
  check("ceil", [](const V& v) { return Tensor<double>(lazy::ceil(v[0] - 3.0)); }, {off_steps});
  check("round", [](const V& v) { return Tensor<double>(lazy::round(v[0] + 1.0)); }, {off_steps});
  check("trunc", [](const V& v) { return Tensor<double>(lazy::trunc(v[0] - 1.0)); }, {off_steps});
  // Above softplus's threshold (20) it is the identity.
  check("softplus linear", [](const V& v) { return Tensor<double>(lazy::softplus(v[0])); }, {input(Shape{3}, 6, 21, 25)});
}

TEST(GradElementwise, BinaryOps) {
  const auto a = input(Shape{2, 3}, 11), b = input(Shape{2, 3}, 12);
  const auto pa = input(Shape{2, 3}, 13, 0.5, 2), pb = input(Shape{2, 3}, 14, -2, 2);
  check("add", [](const V& v) { return Tensor<double>(v[0] + v[1]); }, {a, b});
  check("sub", [](const V& v) { return Tensor<double>(v[0] - v[1]); }, {a, b});
  check("mul", [](const V& v) { return Tensor<double>(v[0] * v[1]); }, {a, b});
  check("div", [](const V& v) { return Tensor<double>(v[0] / v[1]); }, {a, pa});
  check("pow", [](const V& v) { return Tensor<double>(lazy::pow(v[0], v[1])); }, {pa, pb});
  check("pow scalar exponent", [](const V& v) { return Tensor<double>(lazy::pow(v[0], 3)); }, {a});
  // Away from the steps of the quotient (a / b in (1.29, 1.87): floor and trunc are 1).
  const auto num = input(Shape{2, 3}, 19, 2.2, 2.8), den = input(Shape{2, 3}, 20, 1.5, 1.7);
  check("remainder", [](const V& v) { return Tensor<double>(lazy::remainder(v[0], v[1])); }, {num, den});
  check("fmod", [](const V& v) { return Tensor<double>(lazy::fmod(v[0], v[1])); }, {num, den});
  check("floor_divide", [](const V& v) { return Tensor<double>(lazy::floor_divide(v[0], v[1])); }, {num, den});
  check("atan2", [](const V& v) { return Tensor<double>(lazy::atan2(v[0], v[1])); }, {a, b});
  check("hypot", [](const V& v) { return Tensor<double>(lazy::hypot(v[0], v[1])); }, {a, b});
  // Weights on both sides of 0.5 (the two forms torch.lerp switches between).
  check("lerp", [](const V& v) { return Tensor<double>(lazy::lerp(v[0], v[1], v[2])); },
        {a, b, input(Shape{2, 3}, 17, -0.5, 1.5)});
  check("lerp scalar weight", [](const V& v) { return Tensor<double>(lazy::lerp(v[0], v[1], 0.75)); }, {a, b});
  check("maximum", [](const V& v) { return Tensor<double>(lazy::maximum(v[0], v[1])); }, {a, b});
  check("minimum", [](const V& v) { return Tensor<double>(lazy::minimum(v[0], v[1])); }, {a, b});
  check("clamp", [](const V& v) { return Tensor<double>(lazy::clamp(v[0], -0.5, 0.5)); }, {a});
  // Tensor bounds: x inside, below and above; then lo > hi, where hi is the result.
  const auto lo = input(Shape{2, 3}, 15, -0.6, 0), hi = input(Shape{2, 3}, 16, 0, 0.6);
  check("clamp tensor bounds",
        [](const V& v) { return Tensor<double>(lazy::clamp(v[0], v[1], v[2])); }, {a, lo, hi});
  const auto lo_above = input(Shape{2, 3}, 17, 0.2, 0.6),
             hi_below = input(Shape{2, 3}, 18, -0.6, -0.2);
  check("clamp lo > hi", [](const V& v) { return Tensor<double>(lazy::clamp(v[0], v[1], v[2])); },
        {a, lo_above, hi_below});
  check("where", [](const V& v) { return Tensor<double>(lazy::where(v[0] > v[1], v[0] * 2, lazy::exp(v[1]))); },
        {a, b});
  check("scalar ops", [](const V& v) { return Tensor<double>(2.5 - v[0] / 3 + 1.5 * v[0]); }, {a});
}

TEST(GradElementwise, ChainsRepeatedAndDetachedLeaves) {
  const auto x = input(Shape{5}, 21), y = input(Shape{5}, 22, 0.5, 1.5);
  check("x*x", [](const V& v) { return Tensor<double>(v[0] * v[0]); }, {x});
  check("chain", [](const V& v) { return Tensor<double>(lazy::tanh(v[0] * v[1] + lazy::sin(v[0])) / v[1]); }, {x, y});
  // Two statements: the gradient flows through the first tensor into the second's leaves.
  check("two statements", [](const V& v) {
    Tensor<double> t = lazy::sigmoid(v[0]) * v[1];
    return Tensor<double>(t * t - v[0]);
  }, {x, y});
  check("cast through float", [](const V& v) { return Tensor<double>(lazy::cast<double>(lazy::cast<float>(v[0])) * 2); },
        {x}, 1e-3, 1e-3);
}

TEST(GradElementwise, DetachedOperandIsAConstant) {
  // x * x.detach() + x: the detached copy is a constant c = x's value, so the gradient is
  // c + 1, not 2x + 1 (a finite difference cannot tell the two apart, hence no gradcheck).
  auto x = lazy::from_vector<double>({0.5, -2.0, 3.0}, Shape{3}).requires_grad_();
  Tensor<double> y = x * x.detach() + x;
  y.backward(lazy::ones<double>({3}));
  EXPECT_EQ(x.grad().to_vector(), (std::vector<double>{1.5, -1.0, 4.0}));
}

TEST(GradElementwise, BroadcastLeavesSumBack) {
  const auto m = input(Shape{3, 4}, 31), row = input(Shape{4}, 32), col = input(Shape{3, 1}, 33),
             one = input(Shape{1}, 34), mid = input(Shape{2, 1, 4}, 35), cube = input(Shape{2, 3, 4}, 36);
  check("bias row", [](const V& v) { return Tensor<double>(lazy::relu(v[0] + v[1])); }, {m, row});
  check("column", [](const V& v) { return Tensor<double>(v[0] * v[1]); }, {m, col});
  check("single element", [](const V& v) { return Tensor<double>(v[0] * v[1]); }, {m, one});
  check("outer product", [](const V& v) { return Tensor<double>(v[0] * v[1]); }, {col, row});
  check("middle dim", [](const V& v) { return Tensor<double>(v[0] * v[1]); }, {cube, mid});
  check("non-adjacent dims", [](const V& v) { return Tensor<double>(v[0] + lazy::exp(v[1])); },
        {cube, input(Shape{1, 3, 1}, 37)});
}

// ---- reductions -------------------------------------------------------------------------

TEST(GradReduction, SumMeanOverAllAndDims) {
  const auto x = input(Shape{2, 3, 4}, 41);
  check("sum", [](const V& v) { return lazy::sum(v[0]); }, {x});
  check("sum dim 1", [](const V& v) { return lazy::sum(v[0], {1}); }, {x});
  check("sum dims 0,2 keepdim", [](const V& v) { return lazy::sum(v[0], {0, 2}, true); }, {x});
  check("mean", [](const V& v) { return lazy::mean(v[0]); }, {x});
  check("mean dim -1", [](const V& v) { return lazy::mean(v[0], {-1}); }, {x});
  // The child expression is never written; its gradient still reaches both leaves.
  check("sum of expression", [](const V& v) { return lazy::sum(v[0] * v[1], {1}); }, {x, input(Shape{2, 3, 4}, 42)});
  check("mean of broadcast expression", [](const V& v) { return lazy::mean(lazy::exp(v[0] + v[1]), {0}); },
        {x, input(Shape{4}, 43)});
}

TEST(GradReduction, ExtremesProductsAndComposites) {
  const auto x = input(Shape{3, 4}, 51);
  check("amax", [](const V& v) { return lazy::amax(v[0], {1}); }, {x});
  check("amin all", [](const V& v) { return lazy::amin(v[0]); }, {x});
  check("max of expression", [](const V& v) { return lazy::amax(v[0] * 2 - 1, {0}, true); }, {x});
  check("prod", [](const V& v) { return lazy::prod(v[0], {1}); }, {x});
  check("prod all", [](const V& v) { return lazy::prod(v[0]); }, {input(Shape{5}, 52, 0.5, 1.5)});
  // One zero in a slice: only that element has a gradient (the product of the others).
  check("prod one zero", [](const V& v) { return lazy::prod(v[0], {1}); }, {{Shape{2, 3}, {1.5, 0.0, -2.0, 0.7, 1.1, 0.9}}});
  check("prod two zeros", [](const V& v) { return lazy::prod(v[0]); }, {{Shape{4}, {0.0, 2.0, 0.0, 3.0}}});
  check("logsumexp", [](const V& v) { return lazy::logsumexp(v[0], {1}); }, {x});
  check("norm 2", [](const V& v) { return lazy::norm(v[0]); }, {x});
  check("norm 1 dim", [](const V& v) { return lazy::norm(v[0], 1, {0}); }, {x});
  check("norm 3", [](const V& v) { return lazy::norm(v[0], 3, {1}); }, {x});
  check("norm inf", [](const V& v) { return lazy::norm(v[0], INFINITY, {1}); }, {x});
}

TEST(GradReduction, TiesShareTheGradient) {
  // amax with a tie: torch splits the gradient evenly between the tied elements.
  auto x = lazy::from_vector<double>({1.0, 3.0, 3.0, 2.0}, Shape{4}).requires_grad_();
  lazy::amax(x).backward();
  EXPECT_EQ(x.grad().to_vector(), (std::vector<double>{0, 0.5, 0.5, 0}));
}

// ---- matmul -----------------------------------------------------------------------------

TEST(GradMatmul, EveryShapeRule) {
  check("2d x 2d", [](const V& v) { return lazy::matmul(v[0], v[1]); }, {input(Shape{3, 4}, 61), input(Shape{4, 2}, 62)});
  check("dot", [](const V& v) { return lazy::matmul(v[0], v[1]); }, {input(Shape{4}, 63), input(Shape{4}, 64)});
  check("1d x 2d", [](const V& v) { return lazy::matmul(v[0], v[1]); }, {input(Shape{4}, 65), input(Shape{4, 3}, 66)});
  check("2d x 1d", [](const V& v) { return lazy::matmul(v[0], v[1]); }, {input(Shape{3, 4}, 67), input(Shape{4}, 68)});
  check("batched", [](const V& v) { return lazy::matmul(v[0], v[1]); },
        {input(Shape{2, 3, 4}, 69), input(Shape{2, 4, 2}, 70)});
  check("3d x 2d", [](const V& v) { return lazy::matmul(v[0], v[1]); },
        {input(Shape{2, 3, 4}, 71), input(Shape{4, 2}, 72)});
  check("broadcast batch", [](const V& v) { return lazy::matmul(v[0], v[1]); },
        {input(Shape{1, 3, 4}, 73), input(Shape{2, 4, 2}, 74)});
  check("broadcast batch right", [](const V& v) { return lazy::matmul(v[0], v[1]); },
        {input(Shape{2, 3, 4}, 75), input(Shape{1, 4, 2}, 76)});
  check("1d x batched", [](const V& v) { return lazy::matmul(v[0], v[1]); },
        {input(Shape{4}, 77), input(Shape{2, 4, 3}, 78)});
  check("transposed operands", [](const V& v) { return lazy::matmul(lazy::transpose(v[0], 0, 1), lazy::transpose(v[1], 0, 1)); },
        {input(Shape{4, 3}, 79), input(Shape{2, 4}, 80)});
  check("linear + relu", [](const V& v) { return Tensor<double>(lazy::relu(lazy::linear(v[0], v[1], v[2]))); },
        {input(Shape{5, 4}, 81), input(Shape{3, 4}, 82), input(Shape{3}, 83)});
  check("linear 3d input", [](const V& v) { return Tensor<double>(lazy::linear(v[0], v[1], v[2])); },
        {input(Shape{2, 5, 4}, 84), input(Shape{3, 4}, 85), input(Shape{3}, 86)});
}

// ---- shape and index ops ----------------------------------------------------------------

TEST(GradShape, ViewsPermutesAndExpand) {
  const auto x = input(Shape{2, 3, 4}, 91);
  check("reshape", [](const V& v) { return lazy::reshape(v[0] * 2, {4, 6}); }, {x});
  check("view of view", [](const V& v) { return lazy::view(lazy::flatten(v[0], 1), {6, 4}); }, {x});
  check("squeeze/unsqueeze", [](const V& v) { return lazy::squeeze(lazy::unsqueeze(v[0], 1) * 3, 1); }, {x});
  check("permute", [](const V& v) { return lazy::permute(v[0], {2, 0, 1}); }, {x});
  check("transpose last two", [](const V& v) { return lazy::transpose(v[0], 1, 2); }, {x});
  check("transpose outer", [](const V& v) { return lazy::transpose(v[0], 0, 2); }, {x});
  check("expand", [](const V& v) { return lazy::expand(v[0], {2, 3, 4}); }, {input(Shape{3, 1}, 92)});
}

TEST(GradShape, SlicesCatStack) {
  const auto x = input(Shape{4, 5}, 101), y = input(Shape{4, 2}, 102), z = input(Shape{4, 5}, 103);
  check("slice step 2", [](const V& v) { return lazy::slice(v[0], 1, 1, 5, 2); }, {x});
  check("narrow rows", [](const V& v) { return lazy::narrow(v[0], 0, 1, 2); }, {x});
  check("slice of slice", [](const V& v) { return lazy::slice(lazy::narrow(v[0], 1, 1, 4), 0, 0, 4, 3); }, {x});
  check("cat dim 1", [](const V& v) { return lazy::cat({v[0], Tensor<double>(v[1] * 2)}, 1); }, {x, y});
  check("cat dim 0", [](const V& v) { return lazy::cat({v[0], v[1]}, 0); }, {x, z});
  check("stack dim 1", [](const V& v) { return lazy::stack({v[0], v[1]}, 1); }, {x, z});
}

TEST(GradShape, IndexSelectAndGatherAccumulateRepeats) {
  const auto x = input(Shape{5, 3}, 111);
  const auto rows = lazy::from_vector<std::int64_t>({4, 0, 4, 2, 4}, Shape{5});
  check("index_select dim 0 with repeats", [&](const V& v) { return lazy::index_select(v[0], 0, rows); }, {x});
  const auto cols = lazy::from_vector<std::int32_t>({2, 2, 0}, Shape{3});
  check("index_select dim 1", [&](const V& v) { return lazy::index_select(v[0], 1, cols); }, {x});
  const auto gi = lazy::from_vector<std::int64_t>({0, 2, 2, 1, 1, 1, 0, 0}, Shape{4, 2});
  check("gather dim 1", [&](const V& v) { return lazy::gather(v[0], 1, gi); }, {input(Shape{4, 3}, 112)});
  const auto g0 = lazy::from_vector<std::int64_t>({3, 0, 3, 1, 1, 2}, Shape{2, 3});
  check("gather dim 0", [&](const V& v) { return lazy::gather(v[0], 0, g0); }, {input(Shape{4, 3}, 113)});
}

// ---- softmax family ---------------------------------------------------------------------

TEST(GradSoftmax, SoftmaxAndLogSoftmaxAlongEachDim) {
  const auto x = input(Shape{3, 4}, 121, -2, 2);
  check("softmax dim 1", [](const V& v) { return lazy::softmax(v[0], 1); }, {x});
  check("softmax dim 0", [](const V& v) { return lazy::softmax(v[0], 0); }, {x});
  check("log_softmax dim 1", [](const V& v) { return lazy::log_softmax(v[0], 1); }, {x});
  check("log_softmax of expression", [](const V& v) { return lazy::log_softmax(v[0] * v[1], 0); },
        {x, input(Shape{3, 4}, 122)});
}

}  // namespace
