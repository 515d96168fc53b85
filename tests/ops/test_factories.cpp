// Tests of ops/factories.hpp: constants, ranges, host data, Eigen interop and printing.

#include <cmath>
#include <cstdint>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include <Eigen/Core>
#include <gtest/gtest.h>

#include <lazytensor/tensor.hpp>
#include <lazytensor/eigen.hpp>
#include <lazytensor/ops/factories.hpp>

namespace {

using lazy::Shape;
using lazy::Tensor;

template <class T>
class FactoryTyped : public ::testing::Test {};
using AllTypes = ::testing::Types<float, double, std::int32_t, std::int64_t, bool, lazy::bfloat16>;
TYPED_TEST_SUITE(FactoryTyped, AllTypes);

template <class T>
double as_double(T v) {
  if constexpr (std::is_same_v<T, lazy::bfloat16>) return static_cast<double>(static_cast<float>(v));
  else return static_cast<double>(v);
}

const std::vector<Shape>& test_shapes() {
  static const std::vector<Shape> s = {Shape{},      Shape{0},        Shape{1},      Shape{2},       Shape{7},
                                       Shape{127},   Shape{128},      Shape{129},    Shape{3, 0, 2}, Shape{2, 3},
                                       Shape{4, 5, 6}, Shape{1 << 18}, Shape{129, 33}};
  return s;
}

TYPED_TEST(FactoryTyped, ZerosOnesFull) {
  using T = TypeParam;
  for (const Shape& s : test_shapes()) {
    SCOPED_TRACE(s.str());
    Tensor<T> z = lazy::zeros<T>(s);
    Tensor<T> o = lazy::ones<T>(s);
    Tensor<T> f = lazy::full<T>(s, 1);  // 1 is representable in every dtype, incl. bool
    EXPECT_EQ(z.shape(), s);
    EXPECT_EQ(o.shape(), s);
    EXPECT_EQ(z.numel(), s.numel());
    EXPECT_EQ(Tensor<T>::dtype, lazy::dtype_of<T>());
    lazy::mark_step();
    auto vz = z.to_vector();
    auto vo = o.to_vector();
    auto vf = f.to_vector();
    ASSERT_EQ(static_cast<std::int64_t>(vz.size()), s.numel());
    ASSERT_EQ(static_cast<std::int64_t>(vo.size()), s.numel());
    for (std::size_t i = 0; i < vz.size(); ++i) {
      ASSERT_EQ(as_double(vz[i]), 0.0) << i;
      ASSERT_EQ(as_double(vo[i]), 1.0) << i;
      ASSERT_EQ(as_double(vf[i]), 1.0) << i;
    }
  }
}

TYPED_TEST(FactoryTyped, ZerosLikeOnesLike) {
  using T = TypeParam;
  Tensor<T> base = lazy::ones<T>({3, 5});
  Tensor<T> z = lazy::zeros_like(base);
  Tensor<T> o = lazy::ones_like(z);
  EXPECT_EQ(z.shape(), (Shape{3, 5}));
  EXPECT_EQ(o.shape(), (Shape{3, 5}));
  for (auto v : z.to_vector()) EXPECT_EQ(as_double(v), 0.0);
  for (auto v : o.to_vector()) EXPECT_EQ(as_double(v), 1.0);
}

TYPED_TEST(FactoryTyped, EmptyHasShapeOnly) {
  using T = TypeParam;
  for (const Shape& s : test_shapes()) {
    Tensor<T> e = lazy::empty<T>(s);
    EXPECT_EQ(e.shape(), s);
    EXPECT_EQ(e.numel(), s.numel());
    EXPECT_EQ(e.to_vector().size(), static_cast<std::size_t>(s.numel()));  // readable, contents unspecified
    // Printable too. For bool the bytes are read as bytes: UBSan reports a load of
    // uninitialized memory as a bool (a value other than 0 or 1) otherwise.
    std::ostringstream os;
    os << e;
    EXPECT_NE(os.str().find("tensor("), std::string::npos);
  }
}

TYPED_TEST(FactoryTyped, FromVectorRoundTrip) {
  using T = TypeParam;
  for (std::int64_t n : {0, 1, 2, 3, 5, 7, 127, 128, 129, 1000}) {
    std::vector<T> v(static_cast<std::size_t>(n));
    for (std::int64_t i = 0; i < n; ++i) {
      if constexpr (std::is_same_v<T, bool>) v[i] = (i * 7 % 3) == 1;
      else v[i] = static_cast<T>(static_cast<int>(i % 200) - 100);
    }
    Tensor<T> t = lazy::from_vector(v);
    EXPECT_EQ(t.shape(), (Shape{n}));
    auto back = t.to_vector();
    ASSERT_EQ(back.size(), v.size());
    for (std::int64_t i = 0; i < n; ++i) ASSERT_EQ(as_double(back[i]), as_double(v[i])) << i;
  }
  std::vector<T> six(6, T(1));
  Tensor<T> t23 = lazy::from_vector(six, Shape{2, 3});
  EXPECT_EQ(t23.shape(), (Shape{2, 3}));
  EXPECT_THROW(lazy::from_vector(six, Shape{2, 2}), lazy::ShapeError);
  EXPECT_THROW(lazy::from_vector(six, Shape{7}), lazy::ShapeError);
  EXPECT_THROW(lazy::from_vector(std::vector<T>{}, Shape{}), lazy::ShapeError);  // a 0-d tensor needs 1
  EXPECT_NO_THROW(lazy::from_vector(std::vector<T>{T(1)}, Shape{}));
}

TEST(Factories, FromVectorSizeMismatchMessage) {
  try {
    lazy::from_vector(std::vector<float>(5, 1.f), Shape{2, 3});
    FAIL() << "expected ShapeError";
  } catch (const lazy::ShapeError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("(2, 3)"), std::string::npos) << m;
    EXPECT_NE(m.find('5'), std::string::npos) << m;
  }
}

TEST(Factories, FromVectorBoolIsNotPacked) {
  std::vector<bool> v = {true, false, false, true, true, false, true, false, false, false, true};
  Tensor<bool> t = lazy::from_vector(v);
  auto back = t.to_vector();
  ASSERT_EQ(back.size(), v.size());
  for (std::size_t i = 0; i < v.size(); ++i) EXPECT_EQ(back[i], v[i]) << i;
  const bool* p = t.data();
  for (std::size_t i = 0; i < v.size(); ++i) {
    // Stored one byte per element, each 0 or 1.
    EXPECT_EQ(reinterpret_cast<const unsigned char*>(p)[i], v[i] ? 1 : 0) << i;
  }
}

TEST(Factories, FromVectorCopiesData) {
  std::vector<float> v = {1, 2, 3};
  Tensor<float> t = lazy::from_vector(v);
  v[0] = 100;
  EXPECT_EQ(t.to_vector()[0], 1.f);
}

TEST(Factories, ArangeFloat) {
  auto v = lazy::arange<float>(0, 5).to_vector();
  EXPECT_EQ(v, (std::vector<float>{0, 1, 2, 3, 4}));
  EXPECT_EQ(lazy::arange<float>(5).to_vector(), (std::vector<float>{0, 1, 2, 3, 4}));
  // Non-integer step: size is ceil((end - start) / step).
  auto h = lazy::arange<double>(1, 2.5, 0.5).to_vector();
  EXPECT_EQ(h, (std::vector<double>{1, 1.5, 2}));
  auto h2 = lazy::arange<double>(1, 2.6, 0.5).to_vector();
  EXPECT_EQ(h2, (std::vector<double>{1, 1.5, 2, 2.5}));
  // Negative step.
  auto d = lazy::arange<float>(5, 0, -1).to_vector();
  EXPECT_EQ(d, (std::vector<float>{5, 4, 3, 2, 1}));
  auto d2 = lazy::arange<double>(1, -1, -0.5).to_vector();
  EXPECT_EQ(d2, (std::vector<double>{1, 0.5, 0, -0.5}));
  // Empty ranges.
  EXPECT_EQ(lazy::arange<float>(3, 3).numel(), 0);
  EXPECT_EQ(lazy::arange<float>(0).numel(), 0);
  EXPECT_EQ(lazy::arange<float>(3, 3).shape(), (Shape{0}));
  // Large: above the threading threshold, every value exact.
  const std::int64_t n = 1 << 20;
  auto big = lazy::arange<double>(0, static_cast<double>(n)).to_vector();
  ASSERT_EQ(static_cast<std::int64_t>(big.size()), n);
  for (std::int64_t i = 0; i < n; ++i) ASSERT_EQ(big[i], static_cast<double>(i));
}

TEST(Factories, ArangeInt) {
  Tensor<std::int64_t> a = lazy::arange<std::int64_t>(-3, 4);
  EXPECT_EQ(a.to_vector(), (std::vector<std::int64_t>{-3, -2, -1, 0, 1, 2, 3}));
  Tensor<std::int32_t> b = lazy::arange<std::int32_t>(0, 10, 3);
  EXPECT_EQ(b.to_vector(), (std::vector<std::int32_t>{0, 3, 6, 9}));
  Tensor<std::int32_t> c = lazy::arange<std::int32_t>(10, 0, -4);
  EXPECT_EQ(c.to_vector(), (std::vector<std::int32_t>{10, 6, 2}));
  EXPECT_EQ(lazy::arange<std::int32_t>(7).to_vector(), (std::vector<std::int32_t>{0, 1, 2, 3, 4, 5, 6}));
}

TEST(Factories, ArangeErrors) {
  EXPECT_THROW(lazy::arange<float>(0, 5, -1), lazy::Error);   // sign inconsistent
  EXPECT_THROW(lazy::arange<float>(5, 0, 1), lazy::Error);    // sign inconsistent
  EXPECT_THROW(lazy::arange<std::int64_t>(0, -3), lazy::Error);
  EXPECT_THROW(lazy::arange<float>(0, 5, 0), lazy::Error);    // zero step
  EXPECT_THROW(lazy::arange<float>(0, std::numeric_limits<double>::infinity()), lazy::Error);
  EXPECT_THROW(lazy::arange<float>(std::nan(""), 5), lazy::Error);
  EXPECT_THROW(lazy::arange<float>(0, 5, std::nan("")), lazy::Error);
}

TEST(Factories, Linspace) {
  // Steps 0, 1, 2.
  EXPECT_EQ(lazy::linspace<float>(0, 10, 0).numel(), 0);
  EXPECT_EQ(lazy::linspace<float>(0, 10, 0).shape(), (Shape{0}));
  // torch.linspace(3, 10, steps=1) == tensor([3.]): a single step is the start.
  EXPECT_EQ(lazy::linspace<float>(3, 10, 1).to_vector(), (std::vector<float>{3}));
  EXPECT_EQ(lazy::linspace<double>(-1, 1, 1).to_vector(), (std::vector<double>{-1}));
  EXPECT_EQ(lazy::linspace<float>(3, 10, 2).to_vector(), (std::vector<float>{3, 10}));
  EXPECT_EQ(lazy::linspace<double>(0, 1, 5).to_vector(), (std::vector<double>{0, 0.25, 0.5, 0.75, 1}));
  EXPECT_EQ(lazy::linspace<float>(4, 0, 5).to_vector(), (std::vector<float>{4, 3, 2, 1, 0}));
  EXPECT_THROW(lazy::linspace<float>(0, 1, -1), lazy::Error);
  // Many steps: endpoints exact, values within rounding of the exact value, monotone.
  for (std::int64_t steps : {3, 7, 100, 101, 1000, 100001}) {
    SCOPED_TRACE(steps);
    const double a = 0.1, b = 0.7;
    auto v = lazy::linspace<double>(a, b, steps).to_vector();
    ASSERT_EQ(static_cast<std::int64_t>(v.size()), steps);
    EXPECT_EQ(v.front(), a);
    EXPECT_EQ(v.back(), b);
    for (std::int64_t i = 0; i < steps; ++i) {
      const long double exact = static_cast<long double>(a) +
                                (static_cast<long double>(b) - a) * i / static_cast<long double>(steps - 1);
      ASSERT_NEAR(v[i], static_cast<double>(exact), 4e-16) << i;
      if (i) {
        ASSERT_GT(v[i], v[i - 1]) << i;
      }
    }
    auto f = lazy::linspace<float>(-3, 2, steps).to_vector();
    EXPECT_EQ(f.front(), -3.f);
    EXPECT_EQ(f.back(), 2.f);
    for (std::int64_t i = 0; i < steps; ++i) {
      const double exact = -3.0 + 5.0 * static_cast<double>(i) / static_cast<double>(steps - 1);
      ASSERT_NEAR(f[i], exact, 1e-6) << i;
    }
  }
}

TEST(Factories, FromEigenRowMajorAndColumnMajor) {
  Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::ColMajor> cm(3, 4);
  Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor> rm(3, 4);
  for (int i = 0; i < 3; ++i)
    for (int j = 0; j < 4; ++j) cm(i, j) = rm(i, j) = static_cast<float>(10 * i + j);
  for (const auto& t : {lazy::from_eigen(cm), lazy::from_eigen(rm)}) {
    EXPECT_EQ(t.shape(), (Shape{3, 4}));
    auto v = t.to_vector();
    for (int i = 0; i < 3; ++i)
      for (int j = 0; j < 4; ++j) EXPECT_EQ(v[i * 4 + j], static_cast<float>(10 * i + j)) << i << "," << j;
  }
  // An expression (transpose of a col-major matrix), doubles, and a vector (a column).
  Eigen::MatrixXd d(2, 3);
  d << 1, 2, 3, 4, 5, 6;
  Tensor<double> dt = lazy::from_eigen(d.transpose());
  EXPECT_EQ(dt.shape(), (Shape{3, 2}));
  EXPECT_EQ(dt.to_vector(), (std::vector<double>{1, 4, 2, 5, 3, 6}));
  Eigen::VectorXi vi(3);
  vi << 7, 8, 9;
  Tensor<int> ti = lazy::from_eigen(vi);
  EXPECT_EQ(ti.shape(), (Shape{3, 1}));
  EXPECT_EQ(ti.to_vector(), (std::vector<int>{7, 8, 9}));
  Eigen::MatrixXf empty(0, 5);
  Tensor<float> te = lazy::from_eigen(empty);
  EXPECT_EQ(te.shape(), (Shape{0, 5}));
  EXPECT_EQ(te.numel(), 0);
}

TEST(Factories, EigenViewRoundTrip) {
  std::vector<double> v(5 * 7);
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = 0.5 * static_cast<double>(i) - 3;
  Tensor<double> t = lazy::from_vector(v, Shape{5, 7});
  auto m = t.eigen();
  ASSERT_EQ(m.rows(), 5);
  ASSERT_EQ(m.cols(), 7);
  for (int i = 0; i < 5; ++i)
    for (int j = 0; j < 7; ++j) EXPECT_EQ(m(i, j), v[i * 7 + j]);
  Tensor<double> back = lazy::from_eigen(m);
  EXPECT_EQ(back.shape(), t.shape());
  EXPECT_EQ(back.to_vector(), v);
  // Rank 1 is a column, rank 0 is 1x1, rank 3 is (numel / last) x last.
  auto c = lazy::from_vector(std::vector<float>{1, 2, 3}).eigen();
  EXPECT_EQ(c.rows(), 3);
  EXPECT_EQ(c.cols(), 1);
  EXPECT_EQ(c(2, 0), 3.f);
  auto s = lazy::scalar_tensor(4.5f).eigen();
  EXPECT_EQ(s.rows(), 1);
  EXPECT_EQ(s.cols(), 1);
  EXPECT_EQ(s(0, 0), 4.5f);
  std::vector<std::int32_t> v3(2 * 3 * 4);
  for (std::size_t i = 0; i < v3.size(); ++i) v3[i] = static_cast<std::int32_t>(i);
  auto m3 = lazy::from_vector(v3, Shape{2, 3, 4}).eigen();
  EXPECT_EQ(m3.rows(), 6);
  EXPECT_EQ(m3.cols(), 4);
  EXPECT_EQ(m3(5, 3), 23);
  // A pending tensor materializes for the view.
  Tensor<float> z = lazy::ones<float>({2, 2});
  auto mz = z.eigen();
  EXPECT_EQ(mz.sum(), 4.f);
}

TEST(Factories, InitializerLists) {
  Tensor<float> a = lazy::tensor<float>({1.5f, -2.f, 3.f});
  EXPECT_EQ(a.shape(), (Shape{3}));
  EXPECT_EQ(a.to_vector(), (std::vector<float>{1.5f, -2.f, 3.f}));
  Tensor<std::int64_t> b = lazy::tensor<std::int64_t>({{1, 2, 3}, {4, 5, 6}});
  EXPECT_EQ(b.shape(), (Shape{2, 3}));
  EXPECT_EQ(b.to_vector(), (std::vector<std::int64_t>{1, 2, 3, 4, 5, 6}));
  Tensor<double> c = lazy::tensor<double>({{1, 2}, {3, 4}, {5, 6}});
  EXPECT_EQ(c.shape(), (Shape{3, 2}));
  EXPECT_EQ(c.to_vector(), (std::vector<double>{1, 2, 3, 4, 5, 6}));
  EXPECT_THROW(lazy::tensor<float>({{1, 2}, {3}}), lazy::ShapeError);
  EXPECT_THROW(lazy::tensor<float>({{1, 2}, {3, 4, 5}}), lazy::ShapeError);
  EXPECT_THROW(lazy::tensor<std::int32_t>({{1, 2, 3}, {4, 5, 6}, {7, 8}}), lazy::ShapeError);
  Tensor<bool> d = lazy::tensor<bool>({true, false, true});
  EXPECT_EQ(d.to_vector(), (std::vector<bool>{true, false, true}));
}

TYPED_TEST(FactoryTyped, ScalarTensor) {
  using T = TypeParam;
  Tensor<T> s = lazy::scalar_tensor<T>(T(1));
  EXPECT_EQ(s.dim(), 0);
  EXPECT_EQ(s.shape(), Shape{});
  EXPECT_EQ(s.numel(), 1);
  EXPECT_EQ(as_double(s.item()), 1.0);
}

TEST(Factories, RangesTooLargeForATensorRaiseShapeError) {
  // (Converting a count past 2^63 to int64 was undefined behaviour.)
  EXPECT_THROW(lazy::arange<float>(0, 1e19), lazy::ShapeError);
  EXPECT_THROW(lazy::arange<float>(0, 1, 1e-300), lazy::ShapeError);
  EXPECT_THROW(lazy::linspace<float>(0, 1, std::int64_t{1} << 62), lazy::ShapeError);
}

TEST(Factories, FullRefusesValuesAnIntegerDtypeCannotHold) {
  // (A static_cast of such a value is undefined behaviour; torch raises.)
  EXPECT_THROW(lazy::full<std::int32_t>({2}, 1e10), lazy::DTypeError);
  EXPECT_THROW(lazy::full<std::int32_t>({2}, -3e9), lazy::DTypeError);
  EXPECT_THROW(lazy::full<std::int64_t>({2}, std::nan("")), lazy::DTypeError);
  EXPECT_THROW(lazy::full<std::int64_t>({2}, 1e19), lazy::DTypeError);
  EXPECT_THROW(lazy::full<std::int32_t>({2}, std::int64_t{1} << 40), lazy::DTypeError);
  EXPECT_THROW(lazy::full<std::int64_t>({2}, std::numeric_limits<double>::infinity()),
               lazy::DTypeError);
  // In range: truncated toward zero, as a cast; the limits themselves fit.
  EXPECT_EQ(lazy::full<std::int32_t>({1}, 3.7).item(), 3);
  EXPECT_EQ(lazy::full<std::int32_t>({1}, -2147483648.0).item(),
            std::numeric_limits<std::int32_t>::min());
  EXPECT_EQ(lazy::full<std::int32_t>({1}, 2147483647.9).item(),
            std::numeric_limits<std::int32_t>::max());
  EXPECT_EQ(lazy::full<std::int64_t>({1}, -9.2e18).item(), std::int64_t{-9200000000000000000});
  // Floating dtypes take infinities and NaN but no finite value past their range, as
  // torch's; bool takes any value.
  EXPECT_THROW(lazy::full<float>({1}, 1e300), lazy::DTypeError);
  EXPECT_THROW(lazy::full<lazy::bfloat16>({1}, -1e39), lazy::DTypeError);
  EXPECT_TRUE(std::isinf(lazy::full<float>({1}, std::numeric_limits<double>::infinity()).item()));
  EXPECT_TRUE(std::isnan(lazy::full<float>({1}, std::nan("")).item()));
  EXPECT_EQ(lazy::full<double>({1}, 1e300).item(), 1e300);
  EXPECT_TRUE(lazy::full<bool>({1}, 2.5).item());
  EXPECT_EQ(lazy::full<std::int32_t>({1}, 'a').item(), 97);  // a character is a number too
}

TEST(Factories, SizeOfAZeroDimTensorIsAShapeError) {
  const auto s = lazy::scalar_tensor(1.0f);
  EXPECT_THROW(s.size(0), lazy::ShapeError);
  EXPECT_THROW(s.size(-1), lazy::ShapeError);
  EXPECT_EQ(lazy::zeros<float>({4, 5}).size(-1), 5);
  EXPECT_THROW(lazy::zeros<float>({4, 5}).size(std::int64_t{1} << 32), lazy::ShapeError);
}

TEST(Factories, ScalarTensorValues) {
  EXPECT_EQ(lazy::scalar_tensor(-2.25).item(), -2.25);
  EXPECT_EQ(lazy::scalar_tensor<std::int64_t>(std::int64_t{1} << 40).item(), std::int64_t{1} << 40);
  EXPECT_EQ(float(lazy::scalar_tensor(lazy::bfloat16(0.5f)).item()), 0.5f);
  EXPECT_THROW(lazy::zeros<float>({2}).item(), lazy::ShapeError);
}

TEST(Factories, DeviceAndDtypeOfFactories) {
  Tensor<float> a = lazy::zeros<float>({2});
  EXPECT_EQ(a.device(), lazy::device());
  EXPECT_EQ(a.device().str(), "CPU:0");
  EXPECT_EQ(lazy::from_vector(std::vector<double>{1}).device(), lazy::device());
  EXPECT_EQ(Tensor<lazy::bfloat16>::dtype, lazy::DType::BFloat16);
  EXPECT_EQ(lazy::arange<std::int32_t>(3).dtype, lazy::DType::Int32);
}

template <class T>
std::string to_string(const Tensor<T>& t) {
  std::ostringstream os;
  os << t;
  return os.str();
}

TEST(Factories, PrintFormat) {
  const std::string f = to_string(lazy::tensor<float>({{1, 2}, {3, 4}}));
  EXPECT_NE(f.find("tensor("), std::string::npos) << f;
  for (const char* v : {"1", "2", "3", "4"}) EXPECT_NE(f.find(v), std::string::npos) << f;
  EXPECT_NE(f.find("device='CPU:0'"), std::string::npos) << f;
  EXPECT_NE(f.find("dtype=float32"), std::string::npos) << f;
  EXPECT_LT(f.find('1'), f.find('4'));  // row-major order

  const std::string d = to_string(lazy::tensor<double>({0.5, -2.25}));
  EXPECT_NE(d.find("0.5"), std::string::npos) << d;
  EXPECT_NE(d.find("-2.25"), std::string::npos) << d;
  EXPECT_NE(d.find("dtype=float64"), std::string::npos) << d;

  const std::string i = to_string(lazy::tensor<std::int64_t>({123456789012LL}));
  EXPECT_NE(i.find("123456789012"), std::string::npos) << i;
  EXPECT_NE(i.find("dtype=int64"), std::string::npos) << i;
  EXPECT_NE(to_string(lazy::tensor<std::int32_t>({-7})).find("dtype=int32"), std::string::npos);

  const std::string b = to_string(lazy::tensor<bool>({true, false}));
  EXPECT_NE(b.find("True"), std::string::npos) << b;
  EXPECT_NE(b.find("False"), std::string::npos) << b;
  EXPECT_NE(b.find("dtype=bool"), std::string::npos) << b;

  const std::string h = to_string(lazy::full<lazy::bfloat16>({2}, 1.5));
  EXPECT_NE(h.find("1.5"), std::string::npos) << h;
  EXPECT_NE(h.find("dtype=bfloat16"), std::string::npos) << h;

  const std::string s = to_string(lazy::scalar_tensor(42.0f));
  EXPECT_NE(s.find("42"), std::string::npos) << s;
  const std::string e = to_string(lazy::zeros<float>({0}));
  EXPECT_NE(e.find("dtype=float32"), std::string::npos) << e;
  EXPECT_NE(to_string(Tensor<float>()).find("undefined"), std::string::npos);
}

TEST(Factories, PrintDoubleKeepsDoubleRange) {
  // A double value outside float's range must not print as inf.
  const std::string d = to_string(lazy::tensor<double>({1e300, -1e-300}));
  EXPECT_EQ(d.find("inf"), std::string::npos) << d;
  EXPECT_NE(d.find("1e+300"), std::string::npos) << d;
  EXPECT_NE(d.find("-1e-300"), std::string::npos) << d;
}

TEST(Factories, FullIsLazyAndCounted) {
  Tensor<float> f = lazy::full<float>({4, 4}, 2.5);
  EXPECT_FALSE(f.node()->materialized());
  lazy::mark_step();
  lazy::wait_device_ops();  // the step runs asynchronously
  EXPECT_TRUE(f.node()->materialized());
  for (float v : f.to_vector()) EXPECT_EQ(v, 2.5f);
  Tensor<lazy::bfloat16> hb = lazy::full<lazy::bfloat16>({3}, 0.1);
  for (auto v : hb.to_vector()) EXPECT_EQ(v.bits, lazy::bfloat16(0.1f).bits);
}

}  // namespace
