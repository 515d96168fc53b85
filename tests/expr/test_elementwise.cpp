// expr/: every element-wise op against a scalar reference written in
// elementwise_testing.hpp (std:: functions in double, exact int64 arithmetic), for every
// dtype where the op is meaningful, at sizes 0, 1, 2..7, 127, 128, 129 and one above the
// threading threshold; clamp, where, cast, NaN propagation, IEEE special cases of pow,
// aliasing, long fused chains and the streaming-store path.
// Scalar operands: test_elementwise_scalars.cpp; broadcasting: test_elementwise_broadcast.cpp.
#include "elementwise_testing.hpp"

#include <gtest/gtest.h>

namespace {

using namespace lazytest;  // NOLINT

// ---- typed tests over every dtype -----------------------------------------------------

template <class T>
class Elementwise : public ::testing::Test {};
TYPED_TEST_SUITE(Elementwise, AllTypes);

// An op without meaning for a dtype (PyTorch rejects it) must not compile for it.
#define UNARY_TEST(OP)                                                                            \
  TEST(ElementwiseOps, OP) {                                                                      \
    for_each_dtype([]<class T>() {                                                                \
      if constexpr (OP::template supports<T>) {                                                   \
        run_unary<OP, T>();                                                                       \
      } else {                                                                                    \
        EXPECT_FALSE(OP::template callable<Tensor<T>>) << lazy::dtype_name(lazy::dtype_of<T>()) \
                                                       << " rejected at compile time";            \
      }                                                                                           \
    });                                                                                           \
  }
#define BINARY_TEST(OP)                                                                               \
  TEST(ElementwiseOps, OP) {                                                                          \
    for_each_dtype([]<class T>() {                                                                    \
      if constexpr (OP::template supports<T>) {                                                       \
        run_binary_tensors<OP, T>(kAllSizes);                                                                                     \
      } else {                                                                                        \
        EXPECT_FALSE((OP::template callable<Tensor<T>, Tensor<T>>)) << lazy::dtype_name(lazy::dtype_of<T>()) \
                                                                    << " rejected at compile time";   \
      }                                                                                               \
    });                                                                                               \
  }

UNARY_TEST(Neg)
UNARY_TEST(Not)
UNARY_TEST(Exp)
UNARY_TEST(Log)
UNARY_TEST(Log1p)
UNARY_TEST(Expm1)
UNARY_TEST(Sqrt)
UNARY_TEST(Rsqrt)
UNARY_TEST(Square)
UNARY_TEST(Abs)
UNARY_TEST(Sign)
UNARY_TEST(Sin)
UNARY_TEST(Cos)
UNARY_TEST(Tanh)
UNARY_TEST(Sigmoid)
UNARY_TEST(Relu)
UNARY_TEST(Gelu)
UNARY_TEST(Silu)
UNARY_TEST(Softplus)
UNARY_TEST(Reciprocal)
UNARY_TEST(Log2)
UNARY_TEST(Log10)
UNARY_TEST(Erf)
UNARY_TEST(Tan)
UNARY_TEST(Asin)
UNARY_TEST(Acos)
UNARY_TEST(Atan)
UNARY_TEST(Sinh)
UNARY_TEST(Cosh)
UNARY_TEST(Asinh)
UNARY_TEST(Acosh)
UNARY_TEST(Atanh)
UNARY_TEST(Floor)
UNARY_TEST(Ceil)
UNARY_TEST(Round)
UNARY_TEST(Trunc)
BINARY_TEST(Add)
BINARY_TEST(Sub)
BINARY_TEST(Mul)
BINARY_TEST(Div)
BINARY_TEST(Pow)
BINARY_TEST(Remainder)
BINARY_TEST(Fmod)
BINARY_TEST(FloorDivide)
BINARY_TEST(Atan2)
BINARY_TEST(Hypot)
BINARY_TEST(LogicalXor)
BINARY_TEST(Maximum)
BINARY_TEST(Minimum)
BINARY_TEST(Eq)
BINARY_TEST(Ne)
BINARY_TEST(Lt)
BINARY_TEST(Le)
BINARY_TEST(Gt)
BINARY_TEST(Ge)
BINARY_TEST(And)
BINARY_TEST(Or)
BINARY_TEST(LogicalAnd)
BINARY_TEST(LogicalOr)


TYPED_TEST(Elementwise, Clamp) {
  using T = TypeParam;
  if constexpr (is_bool_v<T>) {
    // PyTorch rejects clamp on bool; we do at compile time.
    constexpr bool clamps = requires(const Tensor<T>& x) { lazy::clamp(x, 0, 1); };
    EXPECT_FALSE(clamps);
  } else {
    // Scalar bounds (weak, they keep T) and tensor bounds.
    const double lo = is_fp_v<T> ? -2.5 : -300, hi = is_fp_v<T> ? 4.0 : 500;
    const auto sizes = sizes_for(4);
    for (std::int64_t n : sizes) {
      const auto v = gen<T>(n, kMulDom, static_cast<std::uint64_t>(n) + 11);
      const auto x = make<T>(v, Shape{n});
      auto out = [&] {
        if constexpr (is_fp_v<T>) return lazy::eval(lazy::clamp(x, lo, hi));
        else return lazy::eval(lazy::clamp(x, static_cast<int>(lo), static_cast<int>(hi)));
      }();
      static_assert(std::is_same_v<decltype(out), Tensor<T>>);
      const auto got = out.to_vector();
      Checker c("clamp<" + lazy::dtype_name(lazy::dtype_of<T>()) + "> n=" + std::to_string(n));
      for (std::int64_t i = 0; i < n; ++i) {
        const double xv = as_double(v[i]);
        const double r = xv < lo ? lo : (xv > hi ? hi : xv);
        c.check<T>(i, got[i], to_result<T>(r), r, kExact, [&] { return show(v[i]); });
      }
    }
    // Tensor bounds, element-wise.
    const std::int64_t n = 300;
    const auto v = gen<T>(n, kMulDom, 1), l = gen<T>(n, kMulDom, 2), h = gen<T>(n, kMulDom, 3);
    Tensor<T> out = lazy::clamp(make<T>(v, {n}), make<T>(l, {n}), make<T>(h, {n}));
    const auto got = out.to_vector();
    Checker c("clamp(tensor bounds)");
    for (std::int64_t i = 0; i < n; ++i) {
      // torch.clamp: min(max(x, lo), hi), so hi wins when lo > hi.
      const double r = std::min(std::max(as_double(v[i]), as_double(l[i])), as_double(h[i]));
      c.check<T>(i, got[i], to_result<T>(r), r, kExact, [&] { return show(v[i]) + " " + show(l[i]) + " " + show(h[i]); });
    }
  }
}

TYPED_TEST(Elementwise, Where) {
  using T = TypeParam;
  for (std::int64_t n : sizes_for(2)) {
    const auto vc = gen<bool>(n, {}, static_cast<std::uint64_t>(n) + 21);
    const auto va = gen<T>(n, kWide, static_cast<std::uint64_t>(n) + 22);
    const auto vb = gen<T>(n, kWide, static_cast<std::uint64_t>(n) + 23);
    auto out = lazy::eval(lazy::where(make<bool>(vc, {n}), make<T>(va, {n}), make<T>(vb, {n})));
    static_assert(std::is_same_v<decltype(out), Tensor<T>>);
    const auto got = out.to_vector();
    Checker c("where<" + lazy::dtype_name(lazy::dtype_of<T>()) + "> n=" + std::to_string(n));
    for (std::int64_t i = 0; i < n; ++i) {
      const T want = vc[i] ? va[i] : vb[i];
      c.check<T>(i, got[i], want, as_double(want), kExact, [&] { return show<bool>(vc[i]); });
    }
  }
  // A non-bool condition selects where it is non-zero; scalar branches take T (weak).
  const std::int64_t n = 133;
  const auto cond = gen<T>(n, kCoarse, 5);
  const auto va = gen<T>(n, kMulDom, 6);
  const auto one = natural_scalar<T>(kMulDom, 7);
  using W = lazy::weak_scalar_t<T, decltype(one)>;
  Tensor<T> out = lazy::where(make<T>(cond, {n}), make<T>(va, {n}), one);
  const auto got = out.to_vector();
  Checker c("where(non-bool cond)");
  for (std::int64_t i = 0; i < n; ++i) {
    const double r = as_double(cond[i]) != 0 ? as_double(va[i]) : as_double(scalar_as<W>(one));
    c.check<T>(i, got[i], to_result<T>(r), r, kExact, [&] { return show(cond[i]); });
  }
}

// cast<U> from every dtype to every dtype.
template <class T, class U>
void run_cast() {
  using RL = RefLane<T, U>;
  const Domain d{-300.7, 300.7, -100000, 100000, -(0x1p40), 0x1p40};
  for (std::int64_t n : sizes_for(1)) {
    if (n > 1000 && !(std::is_same_v<T, float> || std::is_same_v<T, i32>)) continue;  // keep it quick
    auto v = gen<T>(n, d, static_cast<std::uint64_t>(n) + 31);
    if constexpr (is_fp_v<T>) {
      // Values that truncate differently from floor/round.
      const double special[] = {-2.5, -1.5, -0.5, -0.0, 0.5, 1.5, 2.999, -2.999, 0.0};
      for (std::size_t k = 0; k < std::size(special) && k < v.size(); ++k) v[k] = to_result<T>(special[k]);
    }
    auto out = lazy::eval(lazy::cast<U>(make<T>(v, {n})));
    static_assert(std::is_same_v<decltype(out), Tensor<U>>);
    const auto got = out.to_vector();
    Checker c("cast<" + lazy::dtype_name(lazy::dtype_of<U>()) + ">(" + lazy::dtype_name(lazy::dtype_of<T>()) +
              ") n=" + std::to_string(n));
    for (std::int64_t i = 0; i < n; ++i) {
      const auto r = RL::in(v[i]);
      c.check<U>(i, got[i], to_result<U>(r), static_cast<double>(r), kExact, [&] { return show(v[i]); });
    }
  }
}
template <class T, class... Us>
void run_casts_from() {
  (run_cast<T, Us>(), ...);
}
TYPED_TEST(Elementwise, Cast) { run_casts_from<TypeParam, float, double, i32, i64, bool, bf16>(); }

// ---- NaN propagation ------------------------------------------------------------------

template <class T>
void run_nan_propagation() {
  // NaNs at the front, in SIMD batches, and in the scalar tail, on either side.
  const std::int64_t n = 37;
  std::vector<T> a(static_cast<std::size_t>(n)), b(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) {
    a[i] = to_result<T>(static_cast<double>(i % 5) - 2.0);
    b[i] = to_result<T>(1.0 - static_cast<double>(i % 3));
  }
  for (std::int64_t i : {0, 5, 17, 33, 36}) a[i] = to_result<T>(kNaN);
  for (std::int64_t i : {1, 5, 18, 34}) b[i] = to_result<T>(kNaN);
  const auto ta = make<T>(a, {n}), tb = make<T>(b, {n});
  Tensor<T> mx = lazy::maximum(ta, tb), mn = lazy::minimum(ta, tb), r = lazy::relu(ta), cl = lazy::clamp(ta, -1, 1);
  Tensor<T> mxs = lazy::maximum(ta, 0.0), mns = lazy::minimum(0.0, ta);
  Tensor<T> mx_nan_scalar = lazy::maximum(tb, kNaN);
  const auto gmx = mx.to_vector(), gmn = mn.to_vector(), gr = r.to_vector(), gcl = cl.to_vector();
  const auto gmxs = mxs.to_vector(), gmns = mns.to_vector(), gns = mx_nan_scalar.to_vector();
  for (std::int64_t i = 0; i < n; ++i) {
    const double x = as_double(a[i]), y = as_double(b[i]);
    const bool any = std::isnan(x) || std::isnan(y);
    if (any) {
      EXPECT_TRUE(std::isnan(as_double(gmx[i]))) << "maximum at " << i;
      EXPECT_TRUE(std::isnan(as_double(gmn[i]))) << "minimum at " << i;
    } else {
      EXPECT_EQ(as_double(gmx[i]), std::max(x, y)) << i;
      EXPECT_EQ(as_double(gmn[i]), std::min(x, y)) << i;
    }
    if (std::isnan(x)) {
      EXPECT_TRUE(std::isnan(as_double(gr[i]))) << "relu at " << i;
      EXPECT_TRUE(std::isnan(as_double(gcl[i]))) << "clamp at " << i;
      EXPECT_TRUE(std::isnan(as_double(gmxs[i]))) << "maximum(x, 0) at " << i;
      EXPECT_TRUE(std::isnan(as_double(gmns[i]))) << "minimum(0, x) at " << i;
    } else {
      EXPECT_EQ(as_double(gr[i]), std::max(x, 0.0)) << i;
      EXPECT_EQ(as_double(gcl[i]), std::clamp(x, -1.0, 1.0)) << i;
      EXPECT_EQ(as_double(gmxs[i]), std::max(x, 0.0)) << i;
      EXPECT_EQ(as_double(gmns[i]), std::min(x, 0.0)) << i;
    }
    EXPECT_TRUE(std::isnan(as_double(gns[i]))) << "maximum(x, NaN) at " << i;
  }
  // The same through a broadcast (row) layout, whose rows end in a scalar tail.
  Tensor<T> rows = lazy::maximum(make<T>(a, {1, n}), lazy::zeros<T>({3, 1}));
  const auto gro = rows.to_vector();
  for (int r3 = 0; r3 < 3; ++r3)
    for (std::int64_t i = 0; i < n; ++i) {
      const double x = as_double(a[i]);
      if (std::isnan(x)) EXPECT_TRUE(std::isnan(as_double(gro[r3 * n + i]))) << i;
      else EXPECT_EQ(as_double(gro[r3 * n + i]), std::max(x, 0.0)) << i;
    }
}

TEST(NaN, MaximumMinimumReluClampPropagate) {
  run_nan_propagation<float>();
  run_nan_propagation<double>();
  run_nan_propagation<bf16>();
}

TEST(NaN, ComparisonsWithNaN) {
  const auto a = lazy::from_vector<float>({NAN, 1.0f, NAN}, Shape{3});
  const auto b = lazy::from_vector<float>({NAN, NAN, 2.0f}, Shape{3});
  EXPECT_EQ(Tensor<bool>(a == b).to_vector(), (std::vector<bool>{false, false, false}));
  EXPECT_EQ(Tensor<bool>(a != b).to_vector(), (std::vector<bool>{true, true, true}));
  EXPECT_EQ(Tensor<bool>(a < b).to_vector(), (std::vector<bool>{false, false, false}));
  EXPECT_EQ(Tensor<bool>(a >= b).to_vector(), (std::vector<bool>{false, false, false}));
  EXPECT_EQ(Tensor<bool>(!a).to_vector(), (std::vector<bool>{false, false, false}));  // NaN is non-zero
  EXPECT_EQ(Tensor<bool>(lazy::cast<bool>(a)).to_vector(), (std::vector<bool>{true, true, true}));
}

// ---- pow special cases ----------------------------------------------------------------

template <class T>
void run_pow_special_cases() {
  // IEEE / std::pow / torch.pow: 0^0 = 1, 0^-y = inf (-0^-odd = -inf), x^0 = 1 for any x,
  // 1^y = 1 for any y, negative bases with integral exponents keep their sign.
  const double inf = kInf;
  const std::vector<std::pair<double, double>> cases = {
      {0, 0},     {0, -1},    {-0.0, -1}, {0, -2},   {-0.0, -2}, {0, 2},    {0, 0.5},  {0, -0.5},
      {2, 0},     {kNaN, 0},  {inf, 0},   {-inf, 0}, {1, kNaN},  {1, inf},  {1, -inf}, {-2, 3},
      {-2, 2},    {-2, -1},   {-2, 0.5},  {2, -3},   {3, 4},     {0.5, 10}, {kNaN, 1}, {2, kNaN},
      {0, kNaN},  {inf, 2},   {inf, -2},  {-1, 3},   {4, 0.5},   {10, -2},  {0, 3},    {-0.0, 3},
  };
  // Repeated so that each case lands in the SIMD main loop and in the scalar tail.
  std::vector<T> a, b;
  std::vector<double> want;
  for (int rep = 0; rep < 3; ++rep)
    for (const auto& [x, y] : cases) {
      a.push_back(to_result<T>(x));
      b.push_back(to_result<T>(y));
      want.push_back(std::pow(as_double(a.back()), as_double(b.back())));
    }
  const auto n = static_cast<std::int64_t>(a.size()) - 3;  // odd length: a scalar tail
  Tensor<T> r = lazy::pow(make<T>(std::vector<T>(a.begin(), a.begin() + n), Shape{n}),
                          make<T>(std::vector<T>(b.begin(), b.begin() + n), Shape{n}));
  const auto got = r.to_vector();
  Checker c(std::string("pow special cases <") + lazy::dtype_name(lazy::dtype_of<T>()) + ">");
  for (std::int64_t i = 0; i < n; ++i) {
    c.check<T>(i, got[i], to_result<T>(want[i]), want[i], transcendental_tol<T>(),
               [&] { return show(a[i]) + " ^ " + show(b[i]); });
    if (want[i] == 0 && !std::isnan(as_double(got[i]))) {
      EXPECT_EQ(std::signbit(want[i]), std::signbit(as_double(got[i]))) << show(a[i]) << " ^ " << show(b[i]);
    }
  }
}

TEST(Pow, IeeeSpecialCases) {
  run_pow_special_cases<float>();
  run_pow_special_cases<double>();
  run_pow_special_cases<bf16>();
}

// ---- aliasing -------------------------------------------------------------------------

TEST(Aliasing, SelfReferencingStatements) {
  const std::vector<float> v{1, -2, 3.5f, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17};
  const auto n = static_cast<std::int64_t>(v.size());
  auto times = [&](float k) {
    std::vector<float> r;
    for (float x : v) r.push_back(x * k);
    return r;
  };
  {
    auto a = lazy::from_vector<float>(v, Shape{n});
    a = a + a;
    EXPECT_EQ(a.to_vector(), times(2));
  }
  {
    auto a = lazy::from_vector<float>(v, Shape{n});
    a += a;
    EXPECT_EQ(a.to_vector(), times(2));
    lazy::mark_step();
    a += a;  // now with a materialized (donatable) input
    EXPECT_EQ(a.to_vector(), times(4));
  }
  {
    auto a = lazy::from_vector<float>(v, Shape{n});
    lazy::mark_step();
    a.mul_(a);
    a.sub_(a * 0.5f);  // a = a^2 / 2
    std::vector<float> want;
    for (float x : v) want.push_back(x * x - x * x * 0.5f);
    EXPECT_EQ(a.to_vector(), want);
  }
  {
    auto a = lazy::from_vector<float>(v, Shape{n});
    a = a * a + a - a / 2;  // the same leaf several times in one kernel
    std::vector<float> want;
    for (float x : v) want.push_back(x * x + x - x / 2);
    EXPECT_EQ(a.to_vector(), want);
  }
}

TEST(Aliasing, CopiesShareInPlaceUpdates) {
  auto a = lazy::from_vector<i32>({1, 2, 3}, Shape{3});
  auto b = a;  // shares the tensor object
  a += 1;
  EXPECT_EQ(b.to_vector(), (std::vector<i32>{2, 3, 4}));
  b.mul_(10);
  EXPECT_EQ(a.to_vector(), (std::vector<i32>{20, 30, 40}));
  // Rebinding one handle to a new expression does not affect the other (libtorch).
  a = a + 1;
  EXPECT_EQ(a.to_vector(), (std::vector<i32>{21, 31, 41}));
  EXPECT_EQ(b.to_vector(), (std::vector<i32>{20, 30, 40}));
}

TEST(Aliasing, ExpressionsCaptureValuesWhenBuilt) {
  auto a = lazy::from_vector<float>({1, 2, 3}, Shape{3});
  auto e = a + 1;
  a += 5;
  Tensor<float> r = e;  // old a + 1
  EXPECT_EQ(r.to_vector(), (std::vector<float>{2, 3, 4}));
  EXPECT_EQ(a.to_vector(), (std::vector<float>{6, 7, 8}));
  // Also when a was already materialized (its buffer could have been donated) and after a
  // mark_step between building and using the expression.
  lazy::mark_step();
  auto e2 = a * 2;
  a.fill_(0);
  lazy::mark_step();
  Tensor<float> r2 = e2;
  EXPECT_EQ(r2.to_vector(), (std::vector<float>{12, 14, 16}));
  EXPECT_EQ(a.to_vector(), (std::vector<float>{0, 0, 0}));
}

TEST(Aliasing, InPlaceWithBroadcastOperand) {
  auto m = lazy::from_vector<float>({1, 2, 3, 4, 5, 6}, Shape{2, 3});
  auto row = lazy::from_vector<float>({10, 20, 30}, Shape{3});
  auto col = lazy::from_vector<float>({100, 200}, Shape{2, 1});
  lazy::mark_step();
  m += row;
  m += col;
  m *= lazy::scalar_tensor<float>(2.0f);
  EXPECT_EQ(m.to_vector(), (std::vector<float>{222, 244, 266, 428, 450, 472}));
  // A tensor updated in place with an expression of itself broadcast the other way.
  auto c = lazy::from_vector<float>({1, 2}, Shape{2, 1});
  auto full = lazy::zeros<float>({2, 2});
  full += c + c;  // (2, 1) -> (2, 2)
  EXPECT_EQ(full.to_vector(), (std::vector<float>{2, 2, 4, 4}));
}

// ---- chains ---------------------------------------------------------------------------

TEST(Chains, FloatChainOfManyOps) {
  for (std::int64_t n : {1, 7, 129, 100003}) {
    const auto va = gen<float>(n, {-3, 3}, 1), vb = gen<float>(n, {-3, 3}, 2), vc = gen<float>(n, {-3, 3}, 3);
    const auto a = make<float>(va, {n}), b = make<float>(vb, {n}), c = make<float>(vc, {n});
    Tensor<float> y = lazy::relu(a * b + c) - lazy::sigmoid(a) / (1 + lazy::exp(-c)) * 0.5 + lazy::tanh(b) * a;
    const auto got = y.to_vector();
    Checker chk("float chain n=" + std::to_string(n));
    for (std::int64_t i = 0; i < n; ++i) {
      const double x = va[i], u = vb[i], w = vc[i];
      const double r = std::max(x * u + w, 0.0) - 1 / (1 + std::exp(-x)) / (1 + std::exp(-w)) * 0.5 + std::tanh(u) * x;
      chk.check<float>(i, got[i], static_cast<float>(r), r, {2e-5, 2e-5, 0}, [&] { return show(va[i]); });
    }
  }
}

TEST(Chains, Bf16ChainRoundsOnce) {
  // Computed in float and rounded once on store: within one bf16 ulp of the exact value
  // rounded (rounding after every op would drift further).
  const std::int64_t n = 4099;
  const auto va = gen<bf16>(n, {-2, 2}, 4), vb = gen<bf16>(n, {-2, 2}, 5);
  const auto a = make<bf16>(va, {n}), b = make<bf16>(vb, {n});
  Tensor<bf16> y = (a * b + a) * (b - 0.5) + a * a * a - b / 3;
  const auto got = y.to_vector();
  Checker chk("bf16 chain");
  for (std::int64_t i = 0; i < n; ++i) {
    const double x = float(va[i]), u = float(vb[i]);
    const double r = (x * u + x) * (u - 0.5) + x * x * x - u / 3;
    chk.check<bf16>(i, got[i], round_bf16(static_cast<float>(r)), r, {0, 1e-5, 1},
                    [&] { return show(va[i]) + ", " + show(vb[i]); });
  }
}

TEST(Chains, IntegerChainIsExact) {
  for (std::int64_t n : {3, 129, 300001}) {
    const auto va = gen<i32>(n, {-10, 10, -1000, 1000}, 6), vb = gen<i32>(n, {-10, 10, -1000, 1000}, 7),
               vc = gen<i32>(n, {-10, 10, -1000, 1000}, 8);
    const auto a = make<i32>(va, {n}), b = make<i32>(vb, {n}), c = make<i32>(vc, {n});
    Tensor<i32> y = lazy::maximum(a * 2 - b, c) + lazy::abs(a - c) * lazy::sign(b) - lazy::relu(-a) + (a > b) * 3;
    static_assert(std::is_same_v<decltype((a > b) * 3)::value_type, i64>);
    const auto got = y.to_vector();
    Checker chk("int chain n=" + std::to_string(n));
    for (std::int64_t i = 0; i < n; ++i) {
      const i64 x = va[i], u = vb[i], w = vc[i];
      const i64 r = std::max(x * 2 - u, w) + std::abs(x - w) * ((u > 0) - (u < 0)) - std::max<i64>(-x, 0) + (x > u) * 3;
      chk.check<i32>(i, got[i], static_cast<i32>(r), static_cast<double>(r), kExact, [&] { return show(va[i]); });
    }
  }
}

TEST(Chains, BoolLogicChain) {
  const std::int64_t n = 1000;
  const auto va = gen<bool>(n, {}, 9), vb = gen<bool>(n, {}, 10), vc = gen<bool>(n, {}, 11);
  const auto a = make<bool>(va, {n}), b = make<bool>(vb, {n}), c = make<bool>(vc, {n});
  Tensor<bool> y = (((a & b) | !c) != (a == c)) | (b & !a & c);
  const auto got = y.to_vector();
  for (std::int64_t i = 0; i < n; ++i) {
    const bool x = va[i], u = vb[i], w = vc[i];
    const bool r = (((x && u) || !w) != (x == w)) || (u && !x && w);
    ASSERT_EQ(got[i], r) << i;
  }
}

TEST(Chains, MultiStatementChainWithMixedTypes) {
  // Several statements, each a pending node feeding the next; dtypes change along the way.
  const std::int64_t n = 3001;
  const auto vi = gen<i32>(n, {-10, 10, -50, 50}, 12);
  const auto vf = gen<float>(n, {-2, 2}, 13);
  const auto i = make<i32>(vi, {n});
  const auto f = make<float>(vf, {n});
  Tensor<float> s1 = lazy::cast<float>(i) * f;                  // float
  Tensor<double> s2 = s1 + lazy::from_vector<double>(std::vector<double>(n, 0.25), Shape{n});  // double
  Tensor<bool> s3 = s2 > 0;                                    // bool
  Tensor<i64> s4 = s3 + 1;                                     // int64 (weak scalar)
  Tensor<float> s5 = lazy::where(s3, lazy::sqrt(lazy::abs(s1)), -1.0f) * lazy::cast<float>(s4);
  lazy::mark_step();
  const auto g = s5.to_vector();
  const auto g4 = s4.to_vector();
  Checker chk("multi-statement chain");
  for (std::int64_t k = 0; k < n; ++k) {
    const float p = static_cast<float>(vi[k]) * vf[k];
    const double q = static_cast<double>(p) + 0.25;
    const bool pos = q > 0;
    ASSERT_EQ(g4[k], pos ? 2 : 1) << k;
    const double r = pos ? std::sqrt(std::abs(static_cast<double>(p))) * 2 : -1.0;
    chk.check<float>(k, g[k], static_cast<float>(r), r, rounding_tol<float>(), [&] { return show(vi[k]); });
  }
}

TEST(Chains, CastInsideFusedExpression) {
  const std::int64_t n = 1031;
  const auto vf = gen<float>(n, {-50, 50}, 14);
  const auto f = make<float>(vf, {n});
  // Truncation toward zero happens inside the kernel, before the + 1.
  Tensor<i32> t = lazy::cast<i32>(f * 2.5f) + 1;
  const auto g = t.to_vector();
  for (std::int64_t k = 0; k < n; ++k) ASSERT_EQ(g[k], static_cast<i32>(vf[k] * 2.5f) + 1) << vf[k];
  // A bool cast inside arithmetic is 0/1.
  Tensor<float> u = lazy::cast<bool>(f) * 3.0f + lazy::cast<float>(f > 0);
  const auto gu = u.to_vector();
  for (std::int64_t k = 0; k < n; ++k) ASSERT_EQ(gu[k], (vf[k] != 0 ? 3.0f : 0.0f) + (vf[k] > 0 ? 1.0f : 0.0f));
}

TEST(Chains, NarrowingCastRoundsInsideWiderExpression) {
  // cast<U> has static_cast semantics (docs/architecture.md) — like x.to(bf16).to(float) in
  // PyTorch, a narrowing cast must round even when the surrounding kernel computes wider.
  const std::vector<float> v{1.0f + 0x1p-8f + 0x1p-12f, 3.14159265f, -2.7182818f, 1e-3f, 65537.0f};
  const auto x = lazy::from_vector<float>(v, Shape{5});
  Tensor<float> y = lazy::cast<float>(lazy::cast<bf16>(x));
  const auto gy = y.to_vector();
  for (std::size_t k = 0; k < v.size(); ++k) EXPECT_EQ(gy[k], float(round_bf16(v[k]))) << v[k];
  const std::vector<double> dv{1.0 + 0x1p-30, 0.1, -1e10 / 3};
  const auto d = lazy::from_vector<double>(dv, Shape{3});
  Tensor<double> dd = lazy::cast<double>(lazy::cast<float>(d)) * 1.0;
  const auto gd = dd.to_vector();
  for (std::size_t k = 0; k < dv.size(); ++k) EXPECT_EQ(gd[k], static_cast<double>(static_cast<float>(dv[k]))) << dv[k];
}

// ---- integers inside kernels with a floating lane --------------------------------------
// PyTorch computes each op in its own result type: in where(x > 0, i, j) the integer
// operands never pass through float, and in (a + b) * 0.5 the int64 sum is exact before it
// is converted. A kernel lane must therefore hold every integer value of its int32/int64
// operands exactly; float (24-bit significand) does not.

TEST(LaneSemantics, WhereWithFloatConditionKeepsIntegersExact) {
  const auto x = lazy::from_vector<float>({1.0f, -1.0f, 2.0f}, Shape{3});
  const auto i = lazy::from_vector<i32>({16777217, 5, -2147483647}, Shape{3});
  Tensor<i32> wi = lazy::where(x > 0, i, i - 1);
  EXPECT_EQ(wi.to_vector(), (std::vector<i32>{16777217, 4, -2147483647}));
  const i64 big = (i64(1) << 40) + 1;
  const auto a = lazy::from_vector<i64>({big, 3, -big}, Shape{3});
  const auto b = lazy::from_vector<i64>({7, -big, 9}, Shape{3});
  Tensor<i64> wl = lazy::where(x > 0.5, a, b);
  EXPECT_EQ(wl.to_vector(), (std::vector<i64>{big, -big, -big}));
}

TEST(LaneSemantics, IntegerSubexpressionsAreExactBeforeConversion) {
  const i64 big = i64(1) << 40;
  const auto a = lazy::from_vector<i64>({big + 1, 16777217}, Shape{2});
  const auto b = lazy::from_vector<i64>({-big, 0}, Shape{2});
  Tensor<float> half = (a + b) * 0.5;  // torch: int64 sum, then float
  EXPECT_EQ(half.to_vector(), (std::vector<float>{0.5f, static_cast<float>(16777217) * 0.5f}));
  const auto f = lazy::from_vector<float>({1.0f, 2.0f}, Shape{2});
  Tensor<i64> c = lazy::cast<i64>(f) + a;  // torch: int64 + int64
  EXPECT_EQ(c.to_vector(), (std::vector<i64>{big + 2, 16777219}));
}

// ---- large outputs ---------------------------------------------------------------------

// PyTorch's documented values: the sign rules of remainder (divisor's) and fmod
// (dividend's), floor division toward minus infinity, and the edges.
TEST(Modulo, SignsAndEdgesMatchPyTorch) {
  auto i64 = [](std::vector<std::int64_t> v) { return lazy::from_vector(v); };
  const auto a = i64({-3, 3, -3, 3, 7, -7, 0});
  const auto b = i64({5, -5, -5, 5, 2, 2, 3});
  EXPECT_EQ(Tensor<std::int64_t>(a % b).to_vector(), (std::vector<std::int64_t>{2, -2, -3, 3, 1, 1, 0}));
  EXPECT_EQ(Tensor<std::int64_t>(lazy::fmod(a, b)).to_vector(), (std::vector<std::int64_t>{-3, 3, -3, 3, 1, -1, 0}));
  EXPECT_EQ(Tensor<std::int64_t>(lazy::floor_divide(a, b)).to_vector(),
            (std::vector<std::int64_t>{-1, -1, 0, 0, 3, -4, 0}));
  // INT64_MIN by -1: the quotient wraps (as in PyTorch), the remainders are 0.
  const auto lo = i64({std::numeric_limits<std::int64_t>::min()});
  const auto m1 = i64({-1});
  EXPECT_EQ(Tensor<std::int64_t>(lazy::floor_divide(lo, m1)).item(), std::numeric_limits<std::int64_t>::min());
  EXPECT_EQ(Tensor<std::int64_t>(lazy::remainder(lo, m1)).item(), 0);
  EXPECT_EQ(Tensor<std::int64_t>(lazy::fmod(lo, m1)).item(), 0);
  // Floating: the same signs; a zero divisor gives NaN (remainder, fmod) or +-inf.
  const auto fa = lazy::from_vector<float>({-3.5f, 3.5f, -7.0f, 1.0f, -1.0f});
  const auto fb = lazy::from_vector<float>({2.0f, -2.0f, 2.0f, 0.0f, 0.0f});
  const auto r = Tensor<float>(fa % fb).to_vector();
  EXPECT_EQ(r[0], 0.5f);
  EXPECT_EQ(r[1], -0.5f);
  EXPECT_EQ(r[2], 1.0f);
  EXPECT_TRUE(std::isnan(r[3]));
  const auto f = Tensor<float>(lazy::fmod(fa, fb)).to_vector();
  EXPECT_EQ(f[0], -1.5f);
  EXPECT_EQ(f[1], 1.5f);
  EXPECT_TRUE(std::isnan(f[4]));
  const auto q = Tensor<float>(lazy::floor_divide(fa, fb)).to_vector();
  EXPECT_EQ(q[0], -2.0f);
  EXPECT_EQ(q[1], -2.0f);
  EXPECT_EQ(q[2], -4.0f);
  EXPECT_EQ(q[3], std::numeric_limits<float>::infinity());
  EXPECT_EQ(q[4], -std::numeric_limits<float>::infinity());
  // A large quotient: a - floor(a / b) * b in float would be off by up to b.
  const auto big = lazy::from_vector<float>({16777215.0f});
  const auto tenth = lazy::from_vector<float>({0.1f});
  EXPECT_EQ(Tensor<float>(lazy::fmod(big, tenth)).item(), std::fmod(16777215.0f, 0.1f));
  // Numbers take the tensor's type (weak scalars): int % 3 stays int.
  EXPECT_EQ(Tensor<std::int64_t>(a % 3).to_vector(), (std::vector<std::int64_t>{0, 0, 0, 0, 1, 2, 0}));
}

// An integer divisor of 0 gives XLA's values (x % 0 == x, x // 0 == -1) instead of
// stopping a kernel half way: a statement that overwrites its only input in place, a
// fused chain and a gradient kernel (which also evaluates lanes past the end, in padding)
// all run through it, and a read of the result works twice.
TEST(Modulo, IntegerDivisionByZeroGivesXlaValues) {
  const auto z = lazy::from_vector<std::int32_t>({1, 0, 3, 0});
  Tensor<std::int32_t> a = lazy::from_vector<std::int32_t>({7, 8, -9, -10});
  EXPECT_EQ(Tensor<std::int32_t>(a % z).to_vector(), (std::vector<std::int32_t>{0, 8, 0, -10}));
  EXPECT_EQ(Tensor<std::int32_t>(lazy::fmod(a, z)).to_vector(), (std::vector<std::int32_t>{0, 8, 0, -10}));
  EXPECT_EQ(Tensor<std::int32_t>(lazy::floor_divide(a, z)).to_vector(), (std::vector<std::int32_t>{7, -1, -3, -1}));
  a = a % z;  // a's old buffer has no other holder: the kernel may write over it
  a = (a + 1) % z;
  EXPECT_EQ(a.to_vector(), (std::vector<std::int32_t>{0, 9, 1, -9}));
  EXPECT_EQ(a.to_vector(), (std::vector<std::int32_t>{0, 9, 1, -9}));
  // A gradient through an integer modulo by zero: d/dx sum(x * (i % j)) = i % j.
  Tensor<float> x = lazy::from_vector<float>({1, 2, 3});
  x.requires_grad_(true);
  const auto i = lazy::from_vector<std::int64_t>({7, 8, 9}), j = lazy::from_vector<std::int64_t>({2, 0, 4});
  Tensor<float> loss = lazy::sum(x * lazy::cast<float>(i % j));
  loss.backward();
  EXPECT_EQ(x.grad().to_vector(), (std::vector<float>{1, 8, 1}));
}

// torch.round rounds halves to even.
TEST(Rounding, HalvesGoToEven) {
  const auto r = Tensor<float>(lazy::round(lazy::from_vector<float>({0.5f, 1.5f, 2.5f, -0.5f, -2.5f, 3.5f}))).to_vector();
  EXPECT_EQ(r, (std::vector<float>{0, 2, 2, -0.0f, -2, 4}));
  EXPECT_TRUE(std::signbit(r[3]));
}

TEST(Classification, NaNsAndInfinitiesInEveryFloatingDtypeAndLongRows) {
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  // 37 values: whole SIMD batches and a tail, the specials at both.
  std::vector<float> v(37, 1.5f);
  v[0] = nan, v[3] = inf, v[8] = -inf, v[33] = nan, v[35] = -inf, v[36] = -0.0f;
  auto check = [&](auto tag) {
    using T = decltype(tag);
    std::vector<T> tv(v.begin(), v.end());
    const auto x = lazy::from_vector<T>(tv);
    const auto isn = Tensor<bool>(lazy::isnan(x)).to_vector(), isi = Tensor<bool>(lazy::isinf(x)).to_vector(),
               isf = Tensor<bool>(lazy::isfinite(x)).to_vector();
    for (std::size_t i = 0; i < v.size(); ++i) {
      EXPECT_EQ(isn[i], std::isnan(v[i])) << i;
      EXPECT_EQ(isi[i], std::isinf(v[i])) << i;
      EXPECT_EQ(isf[i], std::isfinite(v[i])) << i;
    }
    const auto r = Tensor<T>(lazy::nan_to_num(x, 7.0)).to_vector();
    const double largest = std::is_same_v<T, lazy::bfloat16> ? 3.3895313892515355e38
                                                             : static_cast<double>(std::numeric_limits<T>::max());
    for (std::size_t i = 0; i < v.size(); ++i) {
      const double want = std::isnan(v[i]) ? 7.0 : v[i] == inf ? largest : v[i] == -inf ? -largest : v[i];
      EXPECT_EQ(static_cast<double>(r[i]), want) << i;
    }
    const auto s = Tensor<T>(lazy::nan_to_num(x, 0.0, 1.0, -2.0)).to_vector();
    EXPECT_EQ(static_cast<double>(s[3]), 1.0);
    EXPECT_EQ(static_cast<double>(s[8]), -2.0);
  };
  check(float{});
  check(double{});
  check(lazy::bfloat16{});
  // Integers are always finite.
  const auto i = lazy::from_vector<std::int32_t>({0, -5, 7});
  EXPECT_EQ(Tensor<bool>(lazy::isfinite(i)).to_vector(), (std::vector<bool>{true, true, true}));
  EXPECT_EQ(Tensor<bool>(lazy::isnan(i) | lazy::isinf(i)).to_vector(), (std::vector<bool>{false, false, false}));
}

TEST(Atan2Hypot, SignedZerosInfinitiesAndExtremesMatchC) {
  // Every pair of specials, laid out so each SIMD lane and the scalar tail see them.
  const double inf = std::numeric_limits<double>::infinity(), nan = std::numeric_limits<double>::quiet_NaN();
  const std::vector<double> specials = {0.0, -0.0, 1.0, -1.0, inf, -inf, nan, 1e-300, 1e300, -3e-310, 5.0};
  std::vector<double> va, vb;
  for (double a : specials) {
    for (double b : specials) va.push_back(a), vb.push_back(b);
  }
  const auto a = lazy::from_vector<double>(va), b = lazy::from_vector<double>(vb);
  const auto t = Tensor<double>(lazy::atan2(a, b)).to_vector(), h = Tensor<double>(lazy::hypot(a, b)).to_vector();
  for (std::size_t i = 0; i < va.size(); ++i) {
    const double wt = std::atan2(va[i], vb[i]), wh = std::hypot(va[i], vb[i]);
    if (std::isnan(wt)) {
      EXPECT_TRUE(std::isnan(t[i])) << "atan2(" << va[i] << ", " << vb[i] << ")";
    } else {
      EXPECT_NEAR(t[i], wt, 1e-15 * std::abs(wt)) << "atan2(" << va[i] << ", " << vb[i] << ")";
      EXPECT_EQ(std::signbit(t[i]), std::signbit(wt)) << "atan2(" << va[i] << ", " << vb[i] << ")";
    }
    if (std::isnan(wh)) {
      EXPECT_TRUE(std::isnan(h[i])) << "hypot(" << va[i] << ", " << vb[i] << ")";
    } else if (std::isinf(wh)) {
      EXPECT_EQ(h[i], wh) << "hypot(" << va[i] << ", " << vb[i] << ")";
    } else {
      EXPECT_NEAR(h[i], wh, 1e-15 * wh) << "hypot(" << va[i] << ", " << vb[i] << ")";
    }
  }
  // float: the squares of 2e38 overflow and those of 1e-30 underflow.
  const auto f = Tensor<float>(lazy::hypot(lazy::from_vector<float>({2e38f, 1e-30f, 3.0f}),
                                           lazy::from_vector<float>({2e38f, 1e-30f, 4.0f})))
                     .to_vector();
  EXPECT_NEAR(f[0], 2e38 * std::sqrt(2.0), 1e32);
  EXPECT_NEAR(f[1], 1e-30 * std::sqrt(2.0), 1e-36);
  EXPECT_NEAR(f[2], 5.0f, 1e-6);
}

TEST(Lerp, BothFormsAndTheEndsExact) {
  // torch.lerp: weight < 0.5 from a's side, else from b's; the weight broadcasts.
  const auto a = lazy::from_vector<float>({1.0f, -3.0f, 0.1f, 1e8f}), b = lazy::from_vector<float>({5.0f, 2.0f, 0.7f, 1.0f});
  const auto w = lazy::from_vector<float>({0.25f, 0.75f, 1.0f, 0.0f});
  const auto r = Tensor<float>(lazy::lerp(a, b, w)).to_vector();
  EXPECT_EQ(r[0], 1.0f + 0.25f * 4.0f);
  EXPECT_EQ(r[1], 2.0f - 5.0f * 0.25f);
  EXPECT_EQ(r[2], 0.7f);  // weight 1 is b exactly (a + 1 * (b - a) would round)
  EXPECT_EQ(r[3], 1e8f);
  const auto s = Tensor<float>(lazy::lerp(a, b, 0.5)).to_vector();
  for (std::size_t i = 0; i < 4; ++i) {
    const float av = std::vector<float>{1.0f, -3.0f, 0.1f, 1e8f}[i], bv = std::vector<float>{5.0f, 2.0f, 0.7f, 1.0f}[i];
    EXPECT_EQ(s[i], bv - (bv - av) * 0.5f) << i;
  }
}

TEST(LargeOutputs, StreamingStorePathIsCorrect) {
  // Outputs of >= streaming_store_bytes (32 MiB unless the environment lowers it, as the
  // sanitizer builds do) take a different store path.
  const std::int64_t n = lazy::core::tuning().streaming_store_bytes / 4 + 37;
  std::vector<float> va(static_cast<std::size_t>(n)), vb(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) {
    va[i] = static_cast<float>(i % 1000) * 0.5f;
    vb[i] = static_cast<float>(i % 7);
  }
  const auto a = lazy::from_vector<float>(va, Shape{n}), b = lazy::from_vector<float>(vb, Shape{n});
  Tensor<float> y = a * 2 + b;
  Tensor<float> z = a * b + lazy::from_vector<float>({1.0f}, Shape{1});  // splat operand
  const auto gy = y.to_vector();
  const auto gz = z.to_vector();
  std::int64_t bad = 0;
  for (std::int64_t i = 0; i < n; ++i) {
    if (gy[i] != va[i] * 2 + vb[i]) ++bad;
    if (gz[i] != va[i] * vb[i] + 1.0f) ++bad;
  }
  EXPECT_EQ(bad, 0);
}


}  // namespace
