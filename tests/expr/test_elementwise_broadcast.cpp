// expr/: NumPy broadcasting for every binary op and dtype (scalar tensors, row bias, column,
// outer, 3-D middle/inner, 0-size dims, and shapes big enough to split across threads), and
// the ShapeError an incompatible pair raises where the expression is built.
#include "elementwise_testing.hpp"

#include <gtest/gtest.h>

namespace {

using namespace lazytest;  // NOLINT

template <class T>
class ElementwiseBroadcast : public ::testing::Test {};
TYPED_TEST_SUITE(ElementwiseBroadcast, AllTypes);

const std::vector<std::pair<Shape, Shape>>& small_broadcast_cases() {
  static const std::vector<std::pair<Shape, Shape>> cases = {
      {Shape{}, Shape{5, 7}},            // scalar tensor
      {Shape{5, 7}, Shape{}},            //
      {Shape{3, 37}, Shape{37}},         // row bias
      {Shape{37}, Shape{3, 37}},         //
      {Shape{9, 1}, Shape{9, 33}},       // column
      {Shape{9, 33}, Shape{9, 1}},       //
      {Shape{1, 19}, Shape{21, 1}},      // outer
      {Shape{3, 1, 17}, Shape{3, 5, 17}},  // 3-D, middle broadcast
      {Shape{4, 6, 1}, Shape{4, 6, 9}},  // 3-D, inner broadcast
      {Shape{2, 1, 3, 1}, Shape{1, 4, 1, 5}},
      {Shape{1, 1, 7}, Shape{7}},        // rank grows, values contiguous
      {Shape{0, 3}, Shape{3}},           // 0-size dims
      {Shape{4, 0}, Shape{4, 1}},
      {Shape{0}, Shape{}},
      {Shape{2, 0, 3}, Shape{2, 1, 3}},
      {Shape{1}, Shape{1}},
  };
  return cases;
}

template <class T, class... Ops>
void run_small_broadcasts() {
  // Not a structured binding: Clang 14 cannot capture one in a lambda.
  for (const auto& shapes : small_broadcast_cases()) {
    const Shape& a = shapes.first;
    const Shape& b = shapes.second;
    (
        [&] {
          if constexpr (Ops::template supports<T>) run_broadcast<Ops, T>(a, b);
        }(),
        ...);
  }
}

TYPED_TEST(ElementwiseBroadcast, BroadcastEveryBinaryOp) {
  run_small_broadcasts<TypeParam, Add, Sub, Mul, Div, Pow, Maximum, Minimum, Eq, Ne, Lt, Le, Gt, Ge, And, Or>();
}

TYPED_TEST(ElementwiseBroadcast, BroadcastAboveThreadingThreshold) {
  using T = TypeParam;
  // Row, column and outer broadcasts big enough to be split across threads.
  run_broadcast<Add, T>(Shape{2048, 131}, Shape{131});
  run_broadcast<Mul, T>(Shape{131, 2048}, Shape{131, 1});
  run_broadcast<Maximum, T>(Shape{1, 611}, Shape{509, 1});
  run_broadcast<Lt, T>(Shape{64, 1, 67}, Shape{64, 71, 67});
}

TYPED_TEST(ElementwiseBroadcast, BroadcastUnaryOfBroadcastExpression) {
  // A unary op over a broadcast expression, and a three-operand where with broadcasts.
  using T = TypeParam;
  const auto vr = gen<T>(37, kMulDom, 1), vc = gen<T>(9, kMulDom, 2);
  const auto row = make<T>(vr, {37});
  const auto col = make<T>(vc, {9, 1});
  const auto cond = gen<bool>(9 * 37, {}, 3);
  using R = typename decltype(row + col)::value_type;
  Tensor<R> out = lazy::where(make<bool>(cond, {9, 37}), row + col, row);
  ASSERT_EQ(out.shape(), (Shape{9, 37}));
  const auto got = out.to_vector();
  for (int i = 0; i < 9; ++i)
    for (int j = 0; j < 37; ++j) {
      using RL = RefLane<T, R>;
      const auto s = RL::in(vr[j]) + RL::in(vc[i]);
      const R want = cond[i * 37 + j] ? to_result<R>(s) : to_result<R>(RL::in(vr[j]));
      EXPECT_TRUE(close<R>(got[i * 37 + j], want, static_cast<double>(want), kExact)) << i << "," << j;
    }
}

TYPED_TEST(ElementwiseBroadcast, SingleElementInputsOnRowsAndFlatPaths) {
  // Kernels read a single element for every index through a batch of its copies: on the
  // rows path a column [R, 1], read twice in one kernel (one input slot), is copied anew
  // for each row; on the flat path a one-element tensor, also read twice. Row lengths
  // around the SIMD batch width (one column collapses to the flat path).
  using T = TypeParam;
  auto vs = gen<T>(1, kCoarse, 5);
  if constexpr (is_bool_v<T>) vs[0] = false;  // (true would hide the column: x || true)
  const auto s = make<T>(vs, {1});
  for (std::int64_t cols : {1, 7, 15, 16, 17, 33}) {
    const std::int64_t rows = 6;
    const auto vc = gen<T>(rows, kCoarse, 6 + static_cast<std::uint64_t>(cols));
    const auto va = gen<T>(rows * cols, kCoarse, 7 + static_cast<std::uint64_t>(cols));
    const auto col = make<T>(vc, {rows, 1});
    const auto a = make<T>(va, {rows, cols});
    using R = typename decltype(lazy::maximum(col, a) * col + s)::value_type;
    using RL = RefLane<T, R>;
    Tensor<R> by_rows = lazy::maximum(col, a) * col + s;
    Tensor<R> by_flat = lazy::maximum(a, s) * s + a;
    ASSERT_EQ(by_rows.shape(), (Shape{rows, cols}));
    ASSERT_EQ(by_flat.shape(), (Shape{rows, cols}));
    const auto gr = by_rows.to_vector(), gf = by_flat.to_vector();
    const auto z = RL::in(vs[0]);
    for (std::int64_t r = 0; r < rows; ++r) {
      for (std::int64_t c = 0; c < cols; ++c) {
        const std::int64_t i = r * cols + c;
        const auto x = RL::in(vc[static_cast<std::size_t>(r)]),
                   y = RL::in(va[static_cast<std::size_t>(i)]);
        const R want_rows = to_result<R>((x < y ? y : x) * x + z);
        const R want_flat = to_result<R>((y < z ? z : y) * z + y);
        EXPECT_TRUE(close<R>(gr[static_cast<std::size_t>(i)], want_rows,
                             static_cast<double>(want_rows), kExact))
            << "rows path, cols " << cols << " at " << r << "," << c;
        EXPECT_TRUE(close<R>(gf[static_cast<std::size_t>(i)], want_flat,
                             static_cast<double>(want_flat), kExact))
            << "flat path, cols " << cols << " at " << r << "," << c;
      }
    }
  }
}

// ---- shape errors ---------------------------------------------------------------------

template <class Op>
void expect_shape_error() {
  const auto a = lazy::zeros<float>({3, 4});
  const auto b = lazy::zeros<float>({5});
  try {
    auto e = Op::apply(a, b);  // must throw here, where the expression is built
    (void)e;
    ADD_FAILURE() << Op::name << ": no exception for (3, 4) and (5,)";
  } catch (const lazy::ShapeError& err) {
    const std::string m = err.what();
    EXPECT_NE(m.find(Op::name), std::string::npos) << m;
    EXPECT_NE(m.find("(3, 4)"), std::string::npos) << m;
    EXPECT_NE(m.find("(5,)"), std::string::npos) << m;
  }
}

TEST(ShapeErrors, IncompatibleShapesNameBothShapesAndOp) {
  expect_shape_error<Add>();
  expect_shape_error<Sub>();
  expect_shape_error<Mul>();
  expect_shape_error<Div>();
  expect_shape_error<Pow>();
  expect_shape_error<Maximum>();
  expect_shape_error<Minimum>();
  expect_shape_error<Eq>();
  expect_shape_error<Ne>();
  expect_shape_error<Lt>();
  expect_shape_error<Le>();
  expect_shape_error<Gt>();
  expect_shape_error<Ge>();
  expect_shape_error<And>();
  expect_shape_error<Or>();
}

TEST(ShapeErrors, NestedAndTernary) {
  const auto a = lazy::zeros<float>({2, 3});
  const auto b = lazy::zeros<float>({2, 3});
  const auto c = lazy::zeros<float>({4, 1, 7});
  // The failing op is the outer one; the inner expression has shape (2, 3).
  EXPECT_THROW((void)(lazy::exp(a + b) * c), lazy::ShapeError);
  try {
    (void)lazy::where(lazy::zeros<bool>({2, 3}), a, lazy::zeros<float>({2, 4}));
    ADD_FAILURE() << "no exception";
  } catch (const lazy::ShapeError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("where"), std::string::npos) << m;
    EXPECT_NE(m.find("(2, 3)"), std::string::npos) << m;
    EXPECT_NE(m.find("(2, 4)"), std::string::npos) << m;
  }
  // A ShapeError leaves no pending work behind: the operands are still usable.
  Tensor<float> ok = a + b + 1;
  EXPECT_EQ(ok.to_vector(), std::vector<float>(6, 1.0f));
}


}  // namespace
