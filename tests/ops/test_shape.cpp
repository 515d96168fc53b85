// Shape ops (include/lazytensor/ops/shape.hpp, split.hpp, rearrange.hpp) against scalar
// references, for every dtype.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <limits>
#include <numeric>
#include <type_traits>
#include <utility>
#include <vector>

#include <lazytensor/debug/metrics.hpp>
#include <lazytensor/core/counters.hpp>
#include <lazytensor/tensor.hpp>
#include <lazytensor/ops/factories.hpp>
#include <lazytensor/ops/rearrange.hpp>
#include <lazytensor/ops/shape.hpp>
#include <lazytensor/ops/split.hpp>

#include "../autograd/gradcheck.hpp"
#include "testing/helpers.hpp"

namespace {

using lazy_tests::num;
using lazy_tests::ThreadsGuard;
using lazy_tests::kernels_run;
using lazy_tests::kSizes;

using lazy::Shape;
using lazy::Tensor;

// Distinct-enough values per dtype, exactly representable (bfloat16: small integers).
template <class T>
T val(std::int64_t i) {
  if constexpr (std::is_same_v<T, bool>) return (i * 7 + 3) % 5 < 2;
  else if constexpr (std::is_same_v<T, lazy::bfloat16>) return lazy::bfloat16(static_cast<float>(i % 251 - 125));
  else return static_cast<T>(i % 1000003);
}

template <class T>
std::vector<T> host(const Shape& s, std::int64_t seed = 0) {
  std::vector<T> v(static_cast<std::size_t>(s.numel()));
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = val<T>(static_cast<std::int64_t>(i) + seed);
  return v;
}

template <class T>
Tensor<T> make(const Shape& s, std::int64_t seed = 0) {
  return lazy::from_vector<T>(host<T>(s, seed), s);
}

// Compares values and shape; reports the first mismatch only.
template <class T>
void expect_values(const Tensor<T>& t, const Shape& shape, const std::vector<T>& want) {
  ASSERT_EQ(t.shape(), shape) << "got " << t.shape().str() << ", want " << shape.str();
  const std::vector<T> got = t.to_vector();
  ASSERT_EQ(got.size(), want.size());
  for (std::size_t i = 0; i < want.size(); ++i) {
    if (num<T>(got[i]) != num<T>(want[i])) {
      ADD_FAILURE() << "element " << i << " of shape " << shape.str() << ": got " << num<T>(got[i]) << ", want "
                    << num<T>(want[i]);
      return;
    }
  }
}

std::vector<std::int64_t> strides_of(const Shape& s) {
  std::vector<std::int64_t> st(static_cast<std::size_t>(s.rank()), 1);
  for (int d = s.rank() - 2; d >= 0; --d) st[d] = st[d + 1] * s[d + 1];
  return st;
}
std::vector<std::int64_t> coords(std::int64_t f, const Shape& s) {
  std::vector<std::int64_t> c(static_cast<std::size_t>(s.rank()));
  for (int d = s.rank() - 1; d >= 0; --d) {
    c[d] = f % s[d];
    f /= s[d];
  }
  return c;
}

// Reference permute: out[c] = in[c'] with c'[perm[k]] = c[k].
template <class T>
std::vector<T> ref_permute(const std::vector<T>& in, const Shape& s, const std::vector<int>& perm, Shape& out) {
  out = Shape{};
  for (int p : perm) out.push_back(s[p]);
  const auto ist = strides_of(s);
  std::vector<T> r(in.size());
  for (std::int64_t f = 0; f < out.numel(); ++f) {
    const auto c = coords(f, out);
    std::int64_t off = 0;
    for (std::size_t k = 0; k < perm.size(); ++k) off += c[k] * ist[perm[k]];
    r[f] = in[off];
  }
  return r;
}

template <class T>
class ShapeOps : public ::testing::Test {};
using AllTypes = ::testing::Types<float, double, std::int32_t, std::int64_t, bool, lazy::bfloat16>;
TYPED_TEST_SUITE(ShapeOps, AllTypes);

// ---- views ---------------------------------------------------------------------------

TYPED_TEST(ShapeOps, ReshapeViewFlattenSqueezeUnsqueezeKeepOrder) {
  using T = TypeParam;
  for (auto n : {std::int64_t{0}, std::int64_t{1}, std::int64_t{6}, std::int64_t{128}}) {
    auto a = make<T>(Shape{n, 1, 2});
    const auto want = host<T>(Shape{n, 1, 2});
    expect_values(lazy::reshape(a, {2, -1}), Shape{2, n}, want);
    expect_values(lazy::view(a, std::vector<std::int64_t>{n * 2}), Shape{n * 2}, want);
    expect_values(lazy::reshape(a, Shape{1, n, 2}), Shape{1, n, 2}, want);
    expect_values(lazy::flatten(a), Shape{n * 2}, want);
    expect_values(lazy::flatten(a, 1), Shape{n, 2}, want);
    expect_values(lazy::flatten(a, 0, 1), Shape{n, 2}, want);
    expect_values(lazy::squeeze(a), n == 1 ? Shape{2} : Shape{n, 2}, want);
    expect_values(lazy::squeeze(a, 1), Shape{n, 2}, want);
    expect_values(lazy::squeeze(a, -1), Shape{n, 1, 2}, want);  // size 2: unchanged
    expect_values(lazy::unsqueeze(a, 0), Shape{1, n, 1, 2}, want);
    expect_values(lazy::unsqueeze(a, -1), Shape{n, 1, 2, 1}, want);
    expect_values(lazy::unsqueeze(a, 2), Shape{n, 1, 1, 2}, want);
  }
  auto s = lazy::from_vector<T>({val<T>(3)}, Shape{});
  expect_values(lazy::flatten(s), Shape{1}, {val<T>(3)});
  expect_values(lazy::unsqueeze(s, 0), Shape{1}, {val<T>(3)});
  expect_values(lazy::squeeze(s, 0), Shape{}, {val<T>(3)});
  expect_values(lazy::reshape(lazy::reshape(s, {1, 1}), Shape{}), Shape{}, {val<T>(3)});
}

TYPED_TEST(ShapeOps, ViewsShareTheInputBuffer) {
  using T = TypeParam;
  auto a = make<T>(Shape{4, 6});
  Tensor<T> x = a;  // keep a handle alive on the source
  auto r = lazy::reshape(a, {3, 8});
  auto f = lazy::flatten(r);
  auto u = lazy::unsqueeze(f, 0);
  lazy::mark_step();
  EXPECT_EQ(r.node()->kind(), lazy::graph::NodeKind::View);
  EXPECT_EQ(r.data(), a.data());
  EXPECT_EQ(f.data(), a.data());
  EXPECT_EQ(u.data(), a.data());
  EXPECT_EQ(u.node()->buffer(), a.node()->buffer());
}

TEST(ShapeViews, ViewOfPendingNodeIsPendingAndShares) {
  auto a = lazy::from_vector<float>({1, 2, 3, 4, 5, 6}, Shape{2, 3});
  const auto before = kernels_run();
  Tensor<float> b = a * 2.0f;
  auto v = lazy::reshape(b, {3, 2});
  auto w = lazy::reshape(v, {6});  // a view of a pending view reads the source directly
  EXPECT_EQ(kernels_run(), before);
  EXPECT_FALSE(v.node()->materialized());
  EXPECT_FALSE(w.node()->materialized());
  EXPECT_EQ(w.node()->inputs().at(0), b.node());
  lazy::mark_step();
  EXPECT_GT(kernels_run(), before);
  EXPECT_EQ(v.data(), b.data());
  EXPECT_EQ(w.data(), b.data());
  expect_values(w, Shape{6}, {2, 4, 6, 8, 10, 12});
}

TEST(ShapeViews, AcceptExpressions) {
  auto a = lazy::from_vector<float>({1, 2, 3, 4, 5, 6}, Shape{2, 3});
  expect_values(lazy::reshape(a + 1.0f, {3, 2}), Shape{3, 2}, std::vector<float>{2, 3, 4, 5, 6, 7});
  expect_values(lazy::transpose(a * 2.0f, 0, 1), Shape{3, 2}, std::vector<float>{2, 8, 4, 10, 6, 12});
  expect_values(lazy::slice(a - 1.0f, 1, 1), Shape{2, 2}, std::vector<float>{1, 2, 4, 5});
}

TEST(ShapeViews, BadInputsRaiseShapeError) {
  auto a = make<float>(Shape{2, 3});
  EXPECT_THROW(lazy::reshape(a, {4, 2}), lazy::ShapeError);
  EXPECT_THROW(lazy::reshape(a, {-1, -1}), lazy::ShapeError);
  EXPECT_THROW(lazy::reshape(a, {-2, -3}), lazy::ShapeError);
  EXPECT_THROW(lazy::reshape(a, {4, -1}), lazy::ShapeError);
  EXPECT_THROW(lazy::reshape(make<float>(Shape{0}), {0, -1}), lazy::ShapeError);
  EXPECT_THROW(lazy::view(a, {7}), lazy::ShapeError);
  EXPECT_THROW(lazy::flatten(a, 1, 0), lazy::ShapeError);
  EXPECT_THROW(lazy::flatten(a, 2), lazy::ShapeError);
  EXPECT_THROW(lazy::squeeze(a, 2), lazy::ShapeError);
  EXPECT_THROW(lazy::unsqueeze(a, 3), lazy::ShapeError);
  EXPECT_THROW(lazy::unsqueeze(a, -4), lazy::ShapeError);
  EXPECT_THROW(lazy::unsqueeze(make<float>(Shape{1, 1, 1, 1, 1, 1, 1, 1}), 0), lazy::ShapeError);
  try {
    lazy::reshape(a, {4, 2});
    FAIL();
  } catch (const lazy::ShapeError& e) {
    EXPECT_NE(std::string(e.what()).find("reshape"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("6"), std::string::npos) << e.what();
  }
}

// ---- transpose / permute ------------------------------------------------------------------

TYPED_TEST(ShapeOps, Transpose2DAllSizes) {
  using T = TypeParam;
  for (auto r : kSizes) {
    for (auto c : kSizes) {
      const Shape s{r, c};
      const auto in = host<T>(s);
      std::vector<T> want(in.size());
      for (std::int64_t i = 0; i < r; ++i)
        for (std::int64_t j = 0; j < c; ++j) want[j * r + i] = in[i * c + j];
      auto a = lazy::from_vector<T>(in, s);
      expect_values(lazy::transpose(a, 0, 1), Shape{c, r}, want);
      expect_values(lazy::transpose(a, -1, -2), Shape{c, r}, want);
      expect_values(lazy::transpose(a), Shape{c, r}, want);
      expect_values(lazy::permute(a, {1, 0}), Shape{c, r}, want);
    }
  }
}

TYPED_TEST(ShapeOps, TransposeAndPermuteAboveThreadingThreshold) {
  using T = TypeParam;
  ThreadsGuard threads(4);
  const Shape s{300, 1000};
  const auto in = host<T>(s);
  Shape out;
  expect_values(lazy::transpose(lazy::from_vector<T>(in, s), 0, 1), Shape{1000, 300}, ref_permute(in, s, {1, 0}, out));
  const Shape s3{60, 70, 80};
  const auto in3 = host<T>(s3);
  for (std::vector<int> p : {std::vector<int>{2, 0, 1}, {0, 2, 1}, {1, 0, 2}, {2, 1, 0}}) {
    auto want = ref_permute(in3, s3, p, out);
    expect_values(lazy::permute(lazy::from_vector<T>(in3, s3), std::vector<std::int64_t>(p.begin(), p.end())), out,
                  want);
  }
}

TYPED_TEST(ShapeOps, PermuteEveryPermutationRank3And4) {
  using T = TypeParam;
  for (const Shape& s : {Shape{3, 4, 5}, Shape{1, 5, 7}, Shape{129, 2, 3}, Shape{0, 3, 2}, Shape{2, 1, 33}}) {
    std::vector<int> p{0, 1, 2};
    const auto in = host<T>(s);
    do {
      Shape out;
      auto want = ref_permute(in, s, p, out);
      expect_values(lazy::permute(lazy::from_vector<T>(in, s), std::vector<std::int64_t>(p.begin(), p.end())), out,
                    want);
    } while (std::next_permutation(p.begin(), p.end()));
  }
  const Shape s4{2, 3, 4, 5};
  const auto in4 = host<T>(s4);
  std::vector<int> p{0, 1, 2, 3};
  do {
    Shape out;
    auto want = ref_permute(in4, s4, p, out);
    expect_values(lazy::permute(lazy::from_vector<T>(in4, s4), std::vector<std::int64_t>(p.begin(), p.end())), out,
                  want);
  } while (std::next_permutation(p.begin(), p.end()));
}

TYPED_TEST(ShapeOps, BatchedTransposeOfLastTwoDims) {
  using T = TypeParam;
  for (const Shape& s : {Shape{3, 129, 127}, Shape{2, 1, 7}, Shape{4, 33, 1}, Shape{2, 2, 0, 5}}) {
    const auto in = host<T>(s);
    std::vector<int> p(static_cast<std::size_t>(s.rank()));
    std::iota(p.begin(), p.end(), 0);
    std::swap(p[p.size() - 1], p[p.size() - 2]);
    Shape out;
    auto want = ref_permute(in, s, p, out);
    expect_values(lazy::transpose(lazy::from_vector<T>(in, s), -1, -2), out, want);
  }
}

TEST(ShapePermute, TransposeNodeIsRecognizableByMatmul) {
  auto w = make<float>(Shape{4, 3});
  Tensor<float> x = w + 1.0f;  // pending source
  auto t = lazy::transpose(x, 0, 1);
  auto* node = dynamic_cast<lazy::graph::TransposeNode*>(t.node().get());
  ASSERT_NE(node, nullptr);
  EXPECT_TRUE(node->swaps_last_two());
  EXPECT_EQ(node->op_name(), "transpose");
  EXPECT_EQ(node->kind(), lazy::graph::NodeKind::Copy);
  auto* hint = dynamic_cast<lazy::graph::TransposeOfLastTwo*>(t.node().get());
  ASSERT_NE(hint, nullptr);
  EXPECT_EQ(hint->transpose_source(), x.node());
  // A general permutation is not a transpose of the last two dims.
  auto p = lazy::permute(make<float>(Shape{2, 3, 4}), {2, 0, 1});
  EXPECT_EQ(dynamic_cast<lazy::graph::TransposeOfLastTwo*>(p.node().get()), nullptr);
  EXPECT_EQ(p.node()->op_name(), "permute");
  auto* pn = dynamic_cast<lazy::graph::PermuteNode*>(p.node().get());
  ASSERT_NE(pn, nullptr);
  EXPECT_FALSE(pn->swaps_last_two());
  lazy::mark_step();
  lazy::wait_device_ops();
  EXPECT_EQ(hint->transpose_source(), nullptr);  // a computed node keeps no inputs
}

TEST(ShapePermute, TransposeOfAPendingTransposeIsItsSource) {
  const Shape s{2, 3, 4};
  const auto in = host<float>(s, 3);
  Tensor<float> x = lazy::from_vector<float>(in, s) * 2.0f;  // pending source
  auto t = lazy::transpose(x, -1, -2);
  auto back = lazy::transpose(t, 1, 2);
  EXPECT_EQ(back.node(), x.node()) << "no node for transpose(transpose(x))";
  std::vector<float> want(in.size());
  for (std::size_t i = 0; i < in.size(); ++i) want[i] = in[i] * 2.0f;
  EXPECT_EQ(back.to_vector(), want);
  // Once the transpose is computed, transposing it again copies (the source may be gone).
  auto t2 = lazy::transpose(x, -1, -2);
  lazy::mark_step();
  lazy::wait_device_ops();
  auto again = lazy::transpose(t2, -1, -2);
  EXPECT_NE(again.node(), x.node());
  EXPECT_EQ(again.to_vector(), want);
}

TEST(ShapePermute, MovingOnlySizeOneDimsIsAView) {
  auto a = make<float>(Shape{1, 5});
  auto t = lazy::transpose(a, 0, 1);
  EXPECT_EQ(t.node()->kind(), lazy::graph::NodeKind::View);
  expect_values(t, Shape{5, 1}, host<float>(Shape{5}));
  auto b = make<float>(Shape{3, 1, 4});
  auto p = lazy::permute(b, {1, 0, 2});
  EXPECT_EQ(p.node()->kind(), lazy::graph::NodeKind::View);
  expect_values(p, Shape{1, 3, 4}, host<float>(Shape{12}));
  EXPECT_EQ(lazy::transpose(b, 1, 1).node(), b.node());
}

TEST(ShapePermute, StructuralHashDependsOnThePermutation) {
  auto a = make<float>(Shape{3, 3, 3});
  auto p1 = lazy::permute(a, {1, 2, 0});
  auto p2 = lazy::permute(a, {2, 0, 1});
  auto p3 = lazy::permute(make<float>(Shape{3, 3, 3}, 5), {1, 2, 0});
  EXPECT_NE(p1.node()->structural_hash(), p2.node()->structural_hash());
  EXPECT_EQ(p1.node()->structural_hash(), p3.node()->structural_hash());
}

TEST(ShapePermute, BadInputsRaiseShapeError) {
  auto a = make<float>(Shape{2, 3, 4});
  EXPECT_THROW(lazy::permute(a, {0, 1}), lazy::ShapeError);
  EXPECT_THROW(lazy::permute(a, {0, 1, 1}), lazy::ShapeError);
  EXPECT_THROW(lazy::permute(a, {0, 1, 3}), lazy::ShapeError);
  EXPECT_THROW(lazy::transpose(a, 0, 3), lazy::ShapeError);
  EXPECT_THROW(lazy::transpose(a), lazy::ShapeError);
}

// ---- expand -------------------------------------------------------------------------------

TYPED_TEST(ShapeOps, ExpandBroadcastsLikeTorch) {
  using T = TypeParam;
  for (auto n : kSizes) {
    auto col = make<T>(Shape{n, 1});
    const auto in = host<T>(Shape{n, 1});
    std::vector<T> want;
    for (int b = 0; b < 2; ++b)
      for (std::int64_t i = 0; i < n; ++i)
        for (int j = 0; j < 3; ++j) want.push_back(in[i]);
    expect_values(lazy::expand(col, {2, -1, 3}), Shape{2, n, 3}, want);
    auto row = make<T>(Shape{n});
    const auto rin = host<T>(Shape{n});
    std::vector<T> rwant;
    for (int i = 0; i < 4; ++i) rwant.insert(rwant.end(), rin.begin(), rin.end());
    expect_values(lazy::expand(row, Shape{4, n}), Shape{4, n}, rwant);
  }
  auto s = lazy::from_vector<T>({val<T>(1)}, Shape{});
  expect_values(lazy::expand(s, std::vector<std::int64_t>{2, 2}), Shape{2, 2}, std::vector<T>(4, val<T>(1)));
  auto same = make<T>(Shape{2, 3});
  EXPECT_EQ(lazy::expand(same, {-1, 3}).node(), same.node());
}

TEST(ShapeExpand, BadInputsRaiseShapeError) {
  auto a = make<float>(Shape{2, 3});
  EXPECT_THROW(lazy::expand(a, {3}), lazy::ShapeError);
  EXPECT_THROW(lazy::expand(a, {2, 4}), lazy::ShapeError);
  EXPECT_THROW(lazy::expand(a, {-1, 2, 3}), lazy::ShapeError);
  EXPECT_THROW(lazy::expand(a, {2, -2}), lazy::ShapeError);
}

// ---- slice / narrow -------------------------------------------------------------------------

template <class T>
std::vector<T> ref_slice(const std::vector<T>& in, std::int64_t rows, std::int64_t cols, int dim, std::int64_t start,
                         std::int64_t len, std::int64_t step) {
  std::vector<T> r;
  if (dim == 0) {
    for (std::int64_t k = 0; k < len; ++k)
      for (std::int64_t j = 0; j < cols; ++j) r.push_back(in[(start + k * step) * cols + j]);
  } else {
    for (std::int64_t i = 0; i < rows; ++i)
      for (std::int64_t k = 0; k < len; ++k) r.push_back(in[i * cols + start + k * step]);
  }
  return r;
}

TYPED_TEST(ShapeOps, SliceAndNarrowAllSizes) {
  using T = TypeParam;
  for (auto n : kSizes) {
    for (int dim = 0; dim < 2; ++dim) {
      const Shape s = dim == 0 ? Shape{n, 3} : Shape{3, n};
      const auto in = host<T>(s);
      auto a = lazy::from_vector<T>(in, s);
      struct Case {
        std::int64_t start, end, step;
      };
      for (Case c : {Case{0, n, 1}, Case{1, n, 1}, Case{0, n / 2, 1}, Case{1, n - 1, 2}, Case{-3, 1000, 1},
                     Case{0, -1, 3}, Case{-1000, 2, 1}, Case{5, 2, 1}, Case{2, n, 64}}) {
        std::int64_t st = c.start < 0 ? c.start + n : c.start, en = c.end < 0 ? c.end + n : c.end;
        st = std::clamp<std::int64_t>(st, 0, n);
        en = std::clamp<std::int64_t>(en, st, n);
        const std::int64_t len = (en - st + c.step - 1) / c.step;
        Shape out = s;
        out[dim] = len;
        expect_values(lazy::slice(a, dim, c.start, c.end, c.step), out,
                      ref_slice(in, s[0], s[1], dim, st, len, c.step));
      }
      for (std::int64_t start : {std::int64_t{0}, n / 2, n}) {
        const std::int64_t len = n - start;
        Shape out = s;
        out[dim] = len;
        expect_values(lazy::narrow(a, dim, start, len), out, ref_slice(in, s[0], s[1], dim, start, len, 1));
        if (len > 0) {
          out[dim] = len - 1;
          expect_values(lazy::narrow(a, dim - 2, start - n, len - 1), out,
                        ref_slice(in, s[0], s[1], dim, start, len - 1, 1));
        }
      }
    }
  }
}

TYPED_TEST(ShapeOps, SliceAboveThreadingThreshold) {
  using T = TypeParam;
  ThreadsGuard threads(4);
  const Shape s{300, 1000};
  const auto in = host<T>(s);
  auto a = lazy::from_vector<T>(in, s);
  expect_values(lazy::slice(a, 1, 3, 997, 2), Shape{300, 497}, ref_slice(in, 300, 1000, 1, 3, 497, 2));
  expect_values(lazy::slice(a, 0, 10, 290), Shape{280, 1000}, ref_slice(in, 300, 1000, 0, 10, 280, 1));
  expect_values(lazy::slice(a, 1, 1, 1000, 3), Shape{300, 333}, ref_slice(in, 300, 1000, 1, 1, 333, 3));
}

TEST(ShapeSlice, BadInputsRaiseShapeError) {
  auto a = make<float>(Shape{4, 5});
  EXPECT_THROW(lazy::slice(a, 0, 0, 4, 0), lazy::ShapeError);
  EXPECT_THROW(lazy::slice(a, 0, 0, 4, -1), lazy::ShapeError);
  EXPECT_THROW(lazy::slice(a, 2, 0, 4), lazy::ShapeError);
  EXPECT_THROW(lazy::slice(make<float>(Shape{}), 0, 0, 1), lazy::ShapeError);
  EXPECT_THROW(lazy::narrow(a, 0, 2, 3), lazy::ShapeError);
  EXPECT_THROW(lazy::narrow(a, 0, 5, 0), lazy::ShapeError);
  EXPECT_THROW(lazy::narrow(a, 0, -5, 1), lazy::ShapeError);
  EXPECT_THROW(lazy::narrow(a, 1, 0, -1), lazy::ShapeError);
  EXPECT_THROW(lazy::narrow(make<float>(Shape{}), 0, 0, 1), lazy::ShapeError);
  EXPECT_NO_THROW(lazy::narrow(a, 0, 4, 0));
  EXPECT_NO_THROW(lazy::narrow(a, 0, -4, 4));
  // A step near INT64_MAX takes the first element (as torch's x[0::huge]), no overflow.
  constexpr auto big = std::numeric_limits<std::int64_t>::max();
  for (std::int64_t step : {big, big - 1, std::int64_t{4}}) {
    auto s = lazy::slice(a, 0, 0, big, step);
    ASSERT_EQ(s.shape(), (Shape{1, 5})) << step;
    EXPECT_EQ(s.to_vector(), lazy::slice(a, 0, 0, 1).to_vector()) << step;
  }
  EXPECT_EQ(lazy::slice(a, 0, 1, big, big).shape(), (Shape{1, 5}));
  EXPECT_EQ(lazy::slice(a, 0, 3, 3, big).shape(), (Shape{0, 5}));
}

// ---- cat / stack --------------------------------------------------------------------------

// Reference cat of [outer, w_i] row blocks.
template <class T>
std::vector<T> ref_cat(const std::vector<std::vector<T>>& ins, std::int64_t outer, const std::vector<std::int64_t>& w) {
  std::vector<T> r;
  for (std::int64_t o = 0; o < outer; ++o)
    for (std::size_t i = 0; i < ins.size(); ++i)
      for (std::int64_t k = 0; k < w[i]; ++k) r.push_back(ins[i][o * w[i] + k]);
  return r;
}

// cat adds sizes: tensors that are each valid (zero-sized here, so nothing is allocated) can
// add up to a shape past the element limit, which is a ShapeError, not an overflow.
TEST(ShapeOpsLimits, CatPastTheElementLimitIsAShapeError) {
  const std::int64_t big = std::int64_t{1} << 59;
  std::vector<lazy::Tensor<float>> parts(3, lazy::zeros<float>({0, big}));
  EXPECT_EQ(lazy::cat({parts[0], parts[1]}, 1).shape(), lazy::Shape({0, 2 * big}));  // 2^60: at the limit
  EXPECT_THROW(lazy::cat(parts, 1), lazy::ShapeError);
}

TYPED_TEST(ShapeOps, CatEveryDimAllSizes) {
  using T = TypeParam;
  for (auto n : kSizes) {
    for (int dim = 0; dim < 3; ++dim) {
      std::vector<Shape> shapes;
      for (std::int64_t k : {n, std::int64_t{2}, std::int64_t{0}, std::int64_t{1}}) {
        Shape s{2, 3, 4};
        s[dim] = k;
        shapes.push_back(s);
      }
      std::vector<Tensor<T>> ts;
      std::vector<std::vector<T>> hs;
      std::vector<std::int64_t> widths;
      std::int64_t outer = 1, total = 0;
      for (int k = 0; k < dim; ++k) outer *= shapes[0][k];
      for (std::size_t i = 0; i < shapes.size(); ++i) {
        hs.push_back(host<T>(shapes[i], static_cast<std::int64_t>(i) * 1000));
        ts.push_back(lazy::from_vector<T>(hs.back(), shapes[i]));
        widths.push_back(outer ? shapes[i].numel() / outer : 0);
        total += shapes[i][dim];
      }
      Shape out{2, 3, 4};
      out[dim] = total;
      expect_values(lazy::cat(ts, dim), out, ref_cat(hs, outer, widths));
      expect_values(lazy::cat(ts, dim - 3), out, ref_cat(hs, outer, widths));
    }
  }
}

TYPED_TEST(ShapeOps, StackEveryDim) {
  using T = TypeParam;
  for (auto n : {std::int64_t{0}, std::int64_t{1}, std::int64_t{5}, std::int64_t{129}}) {
    const Shape s{n, 3};
    std::vector<std::vector<T>> hs;
    std::vector<Tensor<T>> ts;
    for (int i = 0; i < 3; ++i) {
      hs.push_back(host<T>(s, i * 500));
      ts.push_back(lazy::from_vector<T>(hs.back(), s));
    }
    for (int dim = 0; dim <= 2; ++dim) {
      std::int64_t outer = 1;
      for (int k = 0; k < dim; ++k) outer *= s[k];
      const std::int64_t w = outer ? s.numel() / outer : 0;
      Shape out;
      for (int k = 0; k <= 2; ++k) {
        if (k == dim) out.push_back(3);
        if (k < 2) out.push_back(s[k]);
      }
      expect_values(lazy::stack(ts, dim), out, ref_cat(hs, outer, {w, w, w}));
      expect_values(lazy::stack(ts, dim - 3), out, ref_cat(hs, outer, {w, w, w}));
    }
  }
  auto single = make<T>(Shape{2, 2});
  expect_values(lazy::stack({single}, 1), Shape{2, 1, 2}, host<T>(Shape{4}));
}

TYPED_TEST(ShapeOps, CatAboveThreadingThreshold) {
  using T = TypeParam;
  ThreadsGuard threads(4);
  const Shape a{300, 400}, b{300, 600};
  auto ha = host<T>(a), hb = host<T>(b, 77);
  expect_values(lazy::cat({lazy::from_vector<T>(ha, a), lazy::from_vector<T>(hb, b)}, 1), Shape{300, 1000},
                ref_cat<T>({ha, hb}, 300, {400, 600}));
  expect_values(lazy::cat({lazy::from_vector<T>(hb, b), lazy::from_vector<T>(hb, b)}, 0), Shape{600, 600},
                ref_cat<T>({hb, hb}, 1, {180000, 180000}));
}

TEST(ShapeCat, LegacyEmptyTensorsAreSkippedAndDuplicatesWork) {
  auto a = make<float>(Shape{2, 3});
  auto e = make<float>(Shape{0});
  expect_values(lazy::cat({e, a, e}, 1), Shape{2, 3}, host<float>(Shape{6}));
  auto h = host<float>(Shape{6});
  expect_values(lazy::cat({a, a}, 0), Shape{4, 3}, ref_cat<float>({h, h}, 1, {6, 6}));
}

TEST(ShapeNoOps, AreNewTensorsThatKeepTheirHistory) {
  // Views are values here: an in-place op on a shape op's result never writes through to
  // its input. The ops that change nothing returned the input's own tensor object, so an
  // in-place op on their result changed the input (and cat's result is always new in torch).
  const std::vector<float> ones(6, 1.0f), twos(6, 2.0f);
  using Op = std::function<Tensor<float>(const Tensor<float>&)>;
  const std::vector<std::pair<const char*, Op>> ops = {
      {"reshape",
       [](const Tensor<float>& t) {
         return lazy::reshape(t, {2, 3});
       }},
      {"view",
       [](const Tensor<float>& t) {
         return lazy::view(t, {2, 3});
       }},
      {"slice", [](const Tensor<float>& t) { return lazy::slice(t, 1, 0, 3); }},
      {"narrow", [](const Tensor<float>& t) { return lazy::narrow(t, 0, 0, 2); }},
      {"permute",
       [](const Tensor<float>& t) {
         return lazy::permute(t, {0, 1});
       }},
      {"transpose", [](const Tensor<float>& t) { return lazy::transpose(t, 1, 1); }},
      {"squeeze", [](const Tensor<float>& t) { return lazy::squeeze(t, 0); }},
      {"expand",
       [](const Tensor<float>& t) {
         return lazy::expand(t, {2, 3});
       }},
      {"cat", [](const Tensor<float>& t) { return lazy::cat({t}); }},
      {"cat with an empty piece",
       [](const Tensor<float>& t) {
         return lazy::cat({lazy::zeros<float>({0}), t});
       }},
  };
  for (const auto& [name, op] : ops) {
    SCOPED_TRACE(name);
    auto a = lazy::ones<float>({2, 3});
    auto r = op(a);
    r.add_(1.0f);
    EXPECT_EQ(a.to_vector(), ones);
    EXPECT_EQ(r.to_vector(), twos);
    // Gradients still reach the input's leaf, and the result is not a leaf.
    auto x = lazy::ones<float>({2, 3}).requires_grad_();
    auto y = op(x);
    EXPECT_FALSE(y.is_leaf());
    lazy::sum(y * 3.0f).backward();
    EXPECT_EQ(x.grad().to_vector(), std::vector<float>(6, 3.0f));
  }
  // The result has a backward node of its own: its retained gradient is its own share.
  auto x = lazy::ones<float>({2, 3}).requires_grad_();
  auto r = lazy::reshape(x, {2, 3});
  r.retain_grad();
  lazy::sum(r * 3.0f + x * 5.0f).backward();
  EXPECT_EQ(r.grad().to_vector(), std::vector<float>(6, 3.0f));
  EXPECT_EQ(x.grad().to_vector(), std::vector<float>(6, 8.0f));
  // t() of a 1-D tensor.
  auto v = lazy::ones<float>({3});
  auto tv = lazy::transpose(v);
  tv.mul_(5.0f);
  EXPECT_EQ(v.to_vector(), std::vector<float>(3, 1.0f));
}

TEST(ShapeCat, BadInputsRaise) {
  auto a = make<float>(Shape{2, 3});
  EXPECT_THROW(lazy::cat(std::vector<Tensor<float>>{}, 0), lazy::ShapeError);
  EXPECT_THROW(lazy::cat({a, make<float>(Shape{2, 3, 1})}, 0), lazy::ShapeError);
  EXPECT_THROW(lazy::cat({a, make<float>(Shape{2, 4})}, 0), lazy::ShapeError);
  EXPECT_THROW(lazy::cat({a, a}, 2), lazy::ShapeError);
  EXPECT_THROW(lazy::cat({make<float>(Shape{}), make<float>(Shape{})}, 0), lazy::ShapeError);
  EXPECT_THROW(lazy::stack(std::vector<Tensor<float>>{}, 0), lazy::ShapeError);
  EXPECT_THROW(lazy::stack({a, make<float>(Shape{3, 2})}, 0), lazy::ShapeError);
  EXPECT_THROW(lazy::stack({a, a}, 3), lazy::ShapeError);
  auto other = lazy::zeros<float>(Shape{2, 3}, lazy::Device(1));
  EXPECT_THROW(lazy::cat({a, other}, 0), lazy::DeviceError);
  EXPECT_THROW(lazy::stack({a, other}, 0), lazy::DeviceError);
  try {
    lazy::cat({a, make<float>(Shape{2, 4})}, 0);
  } catch (const lazy::ShapeError& e) {
    EXPECT_NE(std::string(e.what()).find("cat"), std::string::npos) << e.what();
  }
}

// ---- index_select / gather / one_hot ----------------------------------------------------

template <class T, class I>
void check_index_select() {
  for (auto n : kSizes) {
    const Shape s{3, std::max<std::int64_t>(n, 1), 2};
    const auto in = host<T>(s);
    auto a = lazy::from_vector<T>(in, s);
    for (int dim = 0; dim < 3; ++dim) {
      std::vector<I> idx;
      for (std::int64_t k = 0; k < n; ++k) idx.push_back(static_cast<I>((k * 5 + 1) % s[dim]));
      Shape out = s;
      out[dim] = n;
      std::vector<T> want(static_cast<std::size_t>(out.numel()));
      for (std::int64_t f = 0; f < out.numel(); ++f) {
        auto c = coords(f, out);
        c[dim] = idx[c[dim]];
        want[f] = in[(c[0] * s[1] + c[1]) * s[2] + c[2]];
      }
      expect_values(lazy::index_select(a, dim, lazy::from_vector<I>(idx)), out, want);
    }
  }
}

TYPED_TEST(ShapeOps, IndexSelectInt64AndInt32) {
  check_index_select<TypeParam, std::int64_t>();
  check_index_select<TypeParam, std::int32_t>();
  auto s = lazy::from_vector<TypeParam>({val<TypeParam>(4)}, Shape{});
  expect_values(lazy::index_select(s, 0, lazy::from_vector<std::int64_t>({0})), Shape{}, {val<TypeParam>(4)});
}

template <class T, class I>
void check_gather(const Shape& s, const Shape& is, int dim) {
  const auto in = host<T>(s);
  std::vector<I> idx(static_cast<std::size_t>(is.numel()));
  for (std::size_t k = 0; k < idx.size(); ++k) idx[k] = static_cast<I>((k * 7 + 3) % static_cast<std::size_t>(s[dim]));
  std::vector<T> want(idx.size());
  const auto st = strides_of(s);
  for (std::int64_t f = 0; f < is.numel(); ++f) {
    auto c = coords(f, is);
    c[dim] = idx[f];
    std::int64_t off = 0;
    for (int d = 0; d < s.rank(); ++d) off += c[d] * st[d];
    want[f] = in[off];
  }
  expect_values(lazy::gather(lazy::from_vector<T>(in, s), dim, lazy::from_vector<I>(idx, is)), is, want);
}

TYPED_TEST(ShapeOps, GatherEveryDim) {
  using T = TypeParam;
  for (auto n : kSizes) {
    for (int dim = 0; dim < 3; ++dim) {
      check_gather<T, std::int64_t>(Shape{3, 4, 5}, [&] {
        Shape is{2, 4, 3};
        is[dim] = n;
        return is;
      }(), dim);
      check_gather<T, std::int32_t>(Shape{2, std::max<std::int64_t>(n, 1), 3}, Shape{2, std::max<std::int64_t>(n, 1), 3},
                                    dim);
    }
  }
  check_gather<T, std::int64_t>(Shape{7}, Shape{129}, 0);
  auto s = lazy::from_vector<T>({val<T>(9)}, Shape{});
  expect_values(lazy::gather(s, 0, lazy::from_vector<std::int64_t>({0}, Shape{})), Shape{}, {val<T>(9)});
}

TYPED_TEST(ShapeOps, GatherAndIndexSelectAboveThreadingThreshold) {
  using T = TypeParam;
  ThreadsGuard threads(4);
  check_gather<T, std::int64_t>(Shape{300, 1000}, Shape{300, 1000}, 1);
  check_gather<T, std::int64_t>(Shape{300, 1000}, Shape{250, 1000}, 0);
  const Shape s{300, 1000};
  const auto in = host<T>(s);
  std::vector<std::int64_t> idx;
  for (int k = 0; k < 500; ++k) idx.push_back((k * 13) % 1000);
  std::vector<T> want;
  for (int i = 0; i < 300; ++i)
    for (auto k : idx) want.push_back(in[i * 1000 + k]);
  expect_values(lazy::index_select(lazy::from_vector<T>(in, s), 1, lazy::from_vector<std::int64_t>(idx)), Shape{300, 500},
                want);
}

TEST(ShapeIndex, OutOfRangeIndicesRaiseIndexErrorWhenRun) {
  auto a = make<float>(Shape{3, 4});
  {
    auto bad = lazy::index_select(a, 0, lazy::from_vector<std::int64_t>({0, 3}));  // lazy: no throw yet
    EXPECT_THROW(bad.to_vector(), lazy::IndexError);
  }
  {
    auto bad = lazy::index_select(a, 1, lazy::from_vector<std::int32_t>({-1}));
    EXPECT_THROW(
        {
          lazy::mark_step();
          lazy::wait_device_ops();  // an error of an asynchronous step surfaces here
        },
        lazy::IndexError);
  }
  {
    auto bad = lazy::gather(a, 1, lazy::from_vector<std::int64_t>({0, 1, 4}, Shape{1, 3}));
    EXPECT_THROW(
        {
          lazy::mark_step();
          lazy::wait_device_ops();  // an error of an asynchronous step surfaces here
        },
        lazy::IndexError);
  }
  {
    auto bad = lazy::gather(a, 0, lazy::from_vector<std::int32_t>({-1}, Shape{1, 1}));
    EXPECT_THROW(bad.to_vector(), lazy::IndexError);
  }
  {
    auto bad = lazy::one_hot(lazy::from_vector<std::int64_t>({0, 5}), 3);
    EXPECT_THROW(bad.to_vector(), lazy::IndexError);
  }
  {
    auto bad = lazy::one_hot(lazy::from_vector<std::int64_t>({0, -1}), 3);
    EXPECT_THROW(
        {
          lazy::mark_step();
          lazy::wait_device_ops();  // an error of an asynchronous step surfaces here
        },
        lazy::IndexError);
  }
  EXPECT_THROW(lazy::one_hot(lazy::from_vector<std::int64_t>({0, -1})), lazy::IndexError);  // inferred: eager check
  // (The largest class + 1 overflowed int64.)
  EXPECT_THROW(
      lazy::one_hot(lazy::from_vector<std::int64_t>({std::numeric_limits<std::int64_t>::max()})),
      lazy::ShapeError);
  lazy::mark_step();  // nothing bad is left pending
  try {
    auto bad = lazy::gather(a, 1, lazy::from_vector<std::int64_t>({7}, Shape{1, 1}));
    bad.to_vector();
    FAIL();
  } catch (const lazy::IndexError& e) {
    EXPECT_NE(std::string(e.what()).find("gather"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("7"), std::string::npos) << e.what();
  }
}

TEST(ShapeIndex, BadShapesRaiseShapeError) {
  auto a = make<float>(Shape{3, 4});
  EXPECT_THROW(lazy::index_select(a, 0, lazy::from_vector<std::int64_t>({0, 1}, Shape{1, 2})), lazy::ShapeError);
  EXPECT_THROW(lazy::index_select(a, 2, lazy::from_vector<std::int64_t>({0})), lazy::ShapeError);
  EXPECT_THROW(lazy::gather(a, 0, lazy::from_vector<std::int64_t>({0})), lazy::ShapeError);
  EXPECT_THROW(lazy::gather(a, 0, lazy::from_vector<std::int64_t>({0, 0, 0, 0, 0}, Shape{1, 5})), lazy::ShapeError);
  EXPECT_THROW(lazy::gather(a, -3, lazy::from_vector<std::int64_t>({0}, Shape{1, 1})), lazy::ShapeError);
  EXPECT_THROW(lazy::one_hot(lazy::from_vector<std::int64_t>({0}), -2), lazy::ShapeError);
  EXPECT_THROW(lazy::one_hot(lazy::from_vector<std::int64_t>({}, Shape{0})), lazy::ShapeError);
}

template <class I>
void check_one_hot(const std::vector<I>& idx, const Shape& is, std::int64_t classes, std::int64_t want_classes) {
  std::vector<std::int64_t> want;
  for (auto v : idx)
    for (std::int64_t c = 0; c < want_classes; ++c) want.push_back(v == c ? 1 : 0);
  Shape out = is;
  out.push_back(want_classes);
  expect_values(lazy::one_hot(lazy::from_vector<I>(idx, is), classes), out, want);
}

TEST(ShapeIndex, OneHot) {
  for (auto n : kSizes) {
    std::vector<std::int64_t> idx;
    for (std::int64_t k = 0; k < n; ++k) idx.push_back((k * 3) % 5);
    check_one_hot<std::int64_t>(idx, Shape{n}, 5, 5);
    check_one_hot<std::int64_t>(idx, Shape{n}, 7, 7);
    if (n > 3) check_one_hot<std::int64_t>(idx, Shape{n}, -1, 5);
    std::vector<std::int32_t> idx32(idx.begin(), idx.end());
    check_one_hot<std::int32_t>(idx32, Shape{1, n}, 6, 6);
  }
  check_one_hot<std::int64_t>({2}, Shape{}, -1, 3);
  check_one_hot<std::int64_t>({}, Shape{0}, 0, 0);
  ThreadsGuard threads(4);
  std::vector<std::int64_t> big;
  for (int k = 0; k < 30000; ++k) big.push_back(k % 10);
  check_one_hot<std::int64_t>(big, Shape{300, 100}, 10, 10);
}

// ---- split / chunk / unbind, flip / roll / repeat, tril / triu / masked_fill ----------------
// (ops/split.hpp, ops/rearrange.hpp) against scalar loops over row-major coordinates.

namespace rearrange_ref {

std::int64_t flat_of(const std::vector<std::int64_t>& c, const Shape& s) {
  std::int64_t f = 0;
  for (int d = 0; d < s.rank(); ++d) f = f * s[d] + c[d];
  return f;
}

// The elements [start, start + len) of `in` along d.
template <class T>
std::vector<T> narrowed(const std::vector<T>& in, const Shape& s, int d, std::int64_t start, std::int64_t len) {
  Shape out = s;
  out[d] = len;
  std::vector<T> r;
  for (std::int64_t f = 0; f < out.numel(); ++f) {
    auto c = coords(f, out);
    c[d] += start;
    r.push_back(in[flat_of(c, s)]);
  }
  return r;
}

// Expects `got` to be the pieces of `in` (shape s) along d with the given sizes; `drop`
// for unbind's pieces, which lose dim d.
template <class T>
void expect_pieces(const std::vector<Tensor<T>>& got, const std::vector<T>& in, const Shape& s, int d,
                   const std::vector<std::int64_t>& sizes, bool drop = false) {
  ASSERT_EQ(got.size(), sizes.size()) << "pieces of shape " << s.str() << " along " << d;
  std::int64_t off = 0;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    SCOPED_TRACE("piece " + std::to_string(i));
    Shape want = s;
    want[d] = sizes[i];
    if (drop) {
      Shape w;
      for (int k = 0; k < s.rank(); ++k)
        if (k != d) w.push_back(s[k]);
      want = w;
    }
    expect_values(got[i], want, narrowed(in, s, d, off, sizes[i]));
    off += sizes[i];
  }
}

// torch's piece sizes: `size` each, the last one the rest; an empty dim gives one empty piece.
std::vector<std::int64_t> equal_sizes(std::int64_t n, std::int64_t size) {
  std::vector<std::int64_t> r;
  for (std::int64_t off = 0; off < n; off += size) r.push_back(std::min(size, n - off));
  if (r.empty()) r.push_back(0);
  return r;
}

// out[c] = in[c'] with c'[d] = size - 1 - c[d] for each d in dims.
template <class T>
std::vector<T> flipped(const std::vector<T>& in, const Shape& s, const std::vector<int>& dims) {
  std::vector<T> r(in.size());
  for (std::int64_t f = 0; f < s.numel(); ++f) {
    auto c = coords(f, s);
    for (int d : dims) c[d] = s[d] - 1 - c[d];
    r[f] = in[flat_of(c, s)];
  }
  return r;
}

// out[c] = in[c'] with c'[d] = (c[d] - shift) mod size, one dim after the other.
template <class T>
std::vector<T> rolled(std::vector<T> in, const Shape& s, const std::vector<std::int64_t>& shifts,
                      const std::vector<int>& dims) {
  for (std::size_t k = 0; k < dims.size(); ++k) {
    std::vector<T> r(in.size());
    const int d = dims[k];
    for (std::int64_t f = 0; f < s.numel(); ++f) {
      auto c = coords(f, s);
      c[d] = (((c[d] - shifts[k]) % s[d]) + s[d]) % s[d];
      r[f] = in[flat_of(c, s)];
    }
    in = r;
  }
  return in;
}

// torch.Tensor.repeat: out[c] = in[c mod padded shape].
template <class T>
std::vector<T> repeated(const std::vector<T>& in, const Shape& s, const std::vector<std::int64_t>& reps, Shape& out) {
  const int k = static_cast<int>(reps.size());
  Shape padded;
  out = Shape{};
  for (int i = 0; i < k; ++i) {
    padded.push_back(i < k - s.rank() ? 1 : s[i - (k - s.rank())]);
    out.push_back(padded[i] * reps[i]);
  }
  std::vector<T> r;
  for (std::int64_t f = 0; f < out.numel(); ++f) {
    auto c = coords(f, out);
    for (int i = 0; i < k; ++i) c[i] %= padded[i];
    r.push_back(in[flat_of(c, padded)]);
  }
  return r;
}

// tril (lower) / triu of the last two dims.
template <class T>
std::vector<T> triangle(const std::vector<T>& in, const Shape& s, std::int64_t diag, bool lower) {
  std::vector<T> r(in.size());
  for (std::int64_t f = 0; f < s.numel(); ++f) {
    const auto c = coords(f, s);
    const long double j_minus_i = static_cast<long double>(c[s.rank() - 1]) - static_cast<long double>(c[s.rank() - 2]);
    const bool keep = lower ? j_minus_i <= static_cast<long double>(diag) : j_minus_i >= static_cast<long double>(diag);
    r[f] = keep ? in[f] : T(0);
  }
  return r;
}

// The element of `in` (shape s) that broadcasts to coords c of shape out.
template <class T>
T broadcast_at(const std::vector<T>& in, const Shape& s, const std::vector<std::int64_t>& c, const Shape& out) {
  std::vector<std::int64_t> ci(static_cast<std::size_t>(s.rank()));
  for (int d = 0; d < s.rank(); ++d) ci[d] = s[d] == 1 ? 0 : c[d + out.rank() - s.rank()];
  return in[flat_of(ci, s)];
}

template <class T>
T fill_value() {
  if constexpr (std::is_same_v<T, bool>) return true;
  else if constexpr (std::is_same_v<T, lazy::bfloat16>) return lazy::bfloat16(-300.0f);
  else return static_cast<T>(-300);
}

}  // namespace rearrange_ref

TYPED_TEST(ShapeOps, SplitChunkUnbindMatchNarrowedReferences) {
  using T = TypeParam;
  using namespace rearrange_ref;
  for (const Shape& s : {Shape{7, 3}, Shape{2, 0, 5}, Shape{4, 5, 6}, Shape{1}, Shape{129, 2}}) {
    const auto in = host<T>(s);
    auto a = lazy::from_vector<T>(in, s);
    for (int dim = -s.rank(); dim < s.rank(); ++dim) {
      const int d = dim < 0 ? dim + s.rank() : dim;
      const std::int64_t n = s[d];
      SCOPED_TRACE("shape " + s.str() + " dim " + std::to_string(dim));
      for (std::int64_t size : {std::int64_t{1}, std::int64_t{2}, std::int64_t{3}, n, n + 2}) {
        if (size == 0) continue;
        expect_pieces(lazy::split(a, size, dim), in, s, d, equal_sizes(n, size));
      }
      if (n == 0) expect_pieces(lazy::split(a, 0, dim), in, s, d, {0});
      expect_pieces(lazy::split(a, std::vector<std::int64_t>{n / 2, 0, n - n / 2}, dim), in, s, d, {n / 2, 0, n - n / 2});
      expect_pieces(lazy::split(a, {n}, dim), in, s, d, {n});  // a one-element list is a list of sizes
      for (std::int64_t chunks : {1, 2, 3, 4, 7, 200}) {
        // torch.chunk: pieces of ceil(n / chunks), so possibly fewer than `chunks`.
        const std::int64_t size = (n + chunks - 1) / chunks;
        expect_pieces(lazy::chunk(a, chunks, dim), in, s, d,
                      n == 0 ? std::vector<std::int64_t>(static_cast<std::size_t>(chunks), 0) : equal_sizes(n, size));
      }
      expect_pieces(lazy::unbind(a, dim), in, s, d, std::vector<std::int64_t>(static_cast<std::size_t>(n), 1), true);
    }
  }
  // torch's documented counts: chunk(arange(6), 4) gives 3 pieces of 2, chunk(arange(10), 4) 3, 3, 3, 1.
  EXPECT_EQ(lazy::chunk(make<T>(Shape{6}), 4).size(), 3u);
  EXPECT_EQ(lazy::chunk(make<T>(Shape{10}), 4).back().shape(), Shape{1});
  // A transposed (pending, non-contiguous-source) input and an expression input.
  const Shape s{5, 4};
  const auto in = host<T>(s);
  Shape ts;
  const auto tin = ref_permute(in, s, {1, 0}, ts);
  auto at = lazy::transpose(lazy::from_vector<T>(in, s), 0, 1);
  expect_pieces(lazy::split(at, 2, -1), tin, ts, 1, {2, 2, 1});
  expect_pieces(lazy::chunk(at, 3, 0), tin, ts, 0, {2, 2});
  expect_pieces(lazy::unbind(at, 1), tin, ts, 1, {1, 1, 1, 1, 1}, true);
  if constexpr (!std::is_same_v<T, bool>) {
    auto pieces = lazy::split(lazy::from_vector<T>(in, s) * T(1), {1, 4}, 0);
    expect_pieces(pieces, in, s, 0, {1, 4});
  }
}

TYPED_TEST(ShapeOps, FlipAndRollMatchReferences) {
  using T = TypeParam;
  using namespace rearrange_ref;
  for (const Shape& s : {Shape{5}, Shape{3, 4}, Shape{2, 3, 4}, Shape{0, 3}, Shape{129, 3}, Shape{3, 1, 2}}) {
    const auto in = host<T>(s);
    auto a = lazy::from_vector<T>(in, s);
    SCOPED_TRACE("shape " + s.str());
    const int r = s.rank();
    // Every subset of dims, each named negative when its bit says so.
    for (int mask = 0; mask < (1 << r); ++mask) {
      std::vector<int> dims;
      std::vector<std::int64_t> named;
      for (int d = 0; d < r; ++d)
        if (mask & (1 << d)) {
          dims.push_back(d);
          named.push_back(d % 2 ? d - r : d);
        }
      expect_values(lazy::flip(a, named), s, flipped(in, s, dims));
    }
    for (std::int64_t shift : {0, 1, -1, 2, 7, -9, 1000003}) {
      for (int d = 0; d < r; ++d) {
        expect_values(lazy::roll(a, shift, d - r), s, rolled(in, s, {shift}, {d}));
      }
      // Without dims: the flattened tensor rolls, and the shape stays.
      expect_values(lazy::roll(a, shift), s, rolled(in, Shape{s.numel()}, {shift}, {0}));
    }
    if (r >= 2) {
      expect_values(lazy::roll(a, {2, -1}, {0, -1}), s, rolled(in, s, {2, -1}, {0, r - 1}));
      expect_values(lazy::roll(a, {1, 2}, {1, 1}), s, rolled(in, s, {1, 2}, {1, 1}));  // a dim may repeat
    }
  }
  // 0-dim: flip over dim 0 (or none) and roll without dims are the value itself.
  auto s0 = lazy::from_vector<T>({val<T>(4)}, Shape{});
  expect_values(lazy::flip(s0, 0), Shape{}, {val<T>(4)});
  expect_values(lazy::flip(s0, lazy::Dims{}), Shape{}, {val<T>(4)});
  expect_values(lazy::roll(s0, 3), Shape{}, {val<T>(4)});
  // Transposed input.
  const Shape s{4, 6};
  const auto in = host<T>(s);
  Shape ts;
  const auto tin = ref_permute(in, s, {1, 0}, ts);
  auto at = lazy::transpose(lazy::from_vector<T>(in, s), 0, 1);
  expect_values(lazy::flip(at, {-1, 0}), ts, flipped(tin, ts, {1, 0}));
  expect_values(lazy::roll(at, {-2, 5}, {0, 1}), ts, rolled(tin, ts, {-2, 5}, {0, 1}));
  expect_values(lazy::roll(at, 7), ts, rolled(tin, Shape{24}, {7}, {0}));
}

TYPED_TEST(ShapeOps, RepeatMatchesReference) {
  using T = TypeParam;
  using namespace rearrange_ref;
  struct Case {
    Shape s;
    std::vector<std::int64_t> reps;
  };
  for (const Case& c : {Case{Shape{3}, {2}}, Case{Shape{3}, {4, 2}}, Case{Shape{2, 3}, {2, 1}}, Case{Shape{2, 3}, {1, 3}},
                        Case{Shape{2, 3}, {2, 1, 3}}, Case{Shape{2, 1, 3}, {1, 4, 1}}, Case{Shape{2, 3}, {0, 2}},
                        Case{Shape{2, 3}, {2, 0, 1}}, Case{Shape{0, 3}, {2, 2}}, Case{Shape{2, 3}, {1, 1}},
                        Case{Shape{}, {3, 2}}, Case{Shape{}, {}}, Case{Shape{129, 2}, {2, 3}},
                        // Past kMaxRank in one view (8 repeated dims of size 2): one dim at a time.
                        Case{Shape{2, 2, 2, 2, 2, 2, 2, 2}, {2, 1, 2, 3, 1, 2, 1, 2}},
                        Case{Shape{2, 3, 1}, {1, 2, 2, 2, 2, 2, 2, 2}}}) {
    SCOPED_TRACE("shape " + c.s.str() + " repeats " + lazy::detail::list_str(c.reps));
    const auto in = host<T>(c.s);
    Shape out;
    const auto want = repeated(in, c.s, c.reps, out);
    expect_values(lazy::repeat(lazy::from_vector<T>(in, c.s), c.reps), out, want);
  }
  // Transposed input.
  const Shape s{3, 5};
  const auto in = host<T>(s);
  Shape ts, out;
  const auto tin = ref_permute(in, s, {1, 0}, ts);
  const auto want = repeated(tin, ts, {2, 2, 3}, out);
  expect_values(lazy::repeat(lazy::transpose(lazy::from_vector<T>(in, s), 0, 1), {2, 2, 3}), out, want);
}

TYPED_TEST(ShapeOps, TrilTriuMaskedFillMatchReferences) {
  using T = TypeParam;
  using namespace rearrange_ref;
  constexpr auto lo = std::numeric_limits<std::int64_t>::min(), hi = std::numeric_limits<std::int64_t>::max();
  for (const Shape& s : {Shape{3, 4}, Shape{2, 4, 3}, Shape{5, 1}, Shape{0, 3}, Shape{129, 7}, Shape{2, 1, 3, 3}}) {
    const auto in = host<T>(s);
    auto a = lazy::from_vector<T>(in, s);
    for (std::int64_t diag : {std::int64_t{0}, std::int64_t{1}, std::int64_t{-1}, std::int64_t{2}, std::int64_t{-3},
                              std::int64_t{6}, std::int64_t{-200}, lo, hi}) {
      SCOPED_TRACE("shape " + s.str() + " diagonal " + std::to_string(diag));
      expect_values(lazy::tril(a, diag), s, triangle(in, s, diag, true));
      expect_values(lazy::triu(a, diag), s, triangle(in, s, diag, false));
    }
    expect_values(lazy::tril(a), s, triangle(in, s, 0, true));
    expect_values(lazy::triu(a), s, triangle(in, s, 0, false));
  }
  // Transposed input.
  const Shape s{3, 5};
  const auto in = host<T>(s);
  Shape ts;
  const auto tin = ref_permute(in, s, {1, 0}, ts);
  auto at = lazy::transpose(lazy::from_vector<T>(in, s), 0, 1);
  expect_values(lazy::tril(at, -1), ts, triangle(tin, ts, -1, true));
  expect_values(lazy::triu(at, 1), ts, triangle(tin, ts, 1, false));

  // masked_fill: the mask broadcasts against x, and the result has their broadcast shape.
  struct Case {
    Shape x, mask, out;
  };
  const T v = fill_value<T>();
  for (const Case& c : {Case{Shape{3, 4}, Shape{3, 4}, Shape{3, 4}}, Case{Shape{3, 4}, Shape{4}, Shape{3, 4}},
                        Case{Shape{3, 4}, Shape{3, 1}, Shape{3, 4}}, Case{Shape{4}, Shape{2, 4}, Shape{2, 4}},
                        Case{Shape{2, 1, 3}, Shape{4, 1}, Shape{2, 4, 3}}, Case{Shape{129, 3}, Shape{}, Shape{129, 3}},
                        Case{Shape{0, 3}, Shape{3}, Shape{0, 3}}}) {
    SCOPED_TRACE("x " + c.x.str() + " mask " + c.mask.str());
    const auto xin = host<T>(c.x);
    std::vector<bool> m;
    for (std::int64_t i = 0; i < c.mask.numel(); ++i) m.push_back((i * 5 + 1) % 3 == 0);
    std::vector<T> want;
    for (std::int64_t f = 0; f < c.out.numel(); ++f) {
      const auto co = coords(f, c.out);
      want.push_back(broadcast_at(m, c.mask, co, c.out) ? v : broadcast_at(xin, c.x, co, c.out));
    }
    auto x = lazy::from_vector<T>(xin, c.x);
    auto mask = lazy::from_vector<bool>(m, c.mask);
    expect_values(lazy::masked_fill(x, mask, v), c.out, want);
    expect_values(lazy::masked_fill(x, mask, lazy::scalar_tensor<T>(v)), c.out, want);
  }
  // Transposed input and a mask that is an expression's value.
  std::vector<T> want = tin;
  for (std::int64_t f = 0; f < ts.numel(); ++f)
    if (f % ts[1] == 1) want[f] = v;
  auto col = lazy::from_vector<std::int64_t>({0, 1, 2}, Shape{3});
  expect_values(lazy::masked_fill(at, Tensor<bool>(col == std::int64_t{1}), v), ts, want);
}

TEST(ShapeSplitRearrange, BadInputsRaise) {
  auto a = make<float>(Shape{4, 5});
  auto s0 = make<float>(Shape{});
  // split / chunk / unbind
  EXPECT_THROW(lazy::split(a, -1), lazy::ShapeError);
  EXPECT_THROW(lazy::split(a, 0), lazy::ShapeError);
  EXPECT_THROW(lazy::split(a, 2, 2), lazy::ShapeError);
  EXPECT_THROW(lazy::split(a, 2, -3), lazy::ShapeError);
  EXPECT_THROW(lazy::split(s0, 1), lazy::ShapeError);
  EXPECT_THROW(lazy::split(a, {1, 2}), lazy::ShapeError);
  EXPECT_THROW(lazy::split(a, {5, -1}), lazy::ShapeError);
  EXPECT_THROW(lazy::split(a, std::vector<std::int64_t>{}), lazy::ShapeError);
  EXPECT_THROW(lazy::split(a, {2}), lazy::ShapeError);  // a list of one size (2 != 4), not split_size 2
  EXPECT_THROW(lazy::split(a, {std::numeric_limits<std::int64_t>::max(), 2, 3}, 0), lazy::ShapeError);
  EXPECT_THROW(lazy::chunk(a, 0), lazy::ShapeError);
  EXPECT_THROW(lazy::chunk(a, -2), lazy::ShapeError);
  EXPECT_THROW(lazy::chunk(s0, 1), lazy::ShapeError);
  EXPECT_THROW(lazy::chunk(a, 2, 5), lazy::ShapeError);
  EXPECT_THROW(lazy::unbind(s0), lazy::ShapeError);
  EXPECT_THROW(lazy::unbind(a, -3), lazy::ShapeError);
  // flip / roll / repeat
  EXPECT_THROW(lazy::flip(a, {0, 0}), lazy::ShapeError);
  EXPECT_THROW(lazy::flip(a, {1, -1}), lazy::ShapeError);
  EXPECT_THROW(lazy::flip(a, 2), lazy::ShapeError);
  EXPECT_THROW(lazy::roll(a, lazy::Dims{}), lazy::ShapeError);
  EXPECT_THROW(lazy::roll(a, {1, 2}), lazy::ShapeError);
  EXPECT_THROW(lazy::roll(a, {1, 2}, {0}), lazy::ShapeError);
  EXPECT_THROW(lazy::roll(a, 1, 2), lazy::ShapeError);
  EXPECT_THROW(lazy::roll(s0, 1, 0), lazy::ShapeError);
  EXPECT_THROW(lazy::repeat(a, {2}), lazy::ShapeError);
  EXPECT_THROW(lazy::repeat(a, {2, -1}), lazy::ShapeError);
  EXPECT_THROW(lazy::repeat(a, {1, 1, 1, 1, 1, 1, 1, 1, 1}), lazy::ShapeError);
  EXPECT_THROW(lazy::repeat(a, {std::int64_t{1} << 40, std::int64_t{1} << 40}), lazy::ShapeError);
  // tril / triu / masked_fill
  EXPECT_THROW(lazy::tril(make<float>(Shape{5})), lazy::ShapeError);
  EXPECT_THROW(lazy::triu(s0, 1), lazy::ShapeError);
  EXPECT_THROW(lazy::masked_fill(a, lazy::ones<bool>({4}), 1.0f), lazy::ShapeError);
  EXPECT_THROW(lazy::masked_fill(a, lazy::ones<bool>({5}), make<float>(Shape{1})), lazy::ShapeError);
  EXPECT_THROW(lazy::masked_fill(make<std::int32_t>(Shape{3}), lazy::ones<bool>({3}), 1e20), lazy::DTypeError);
  // The messages name what was expected and what was found.
  const auto message = [](auto f) {
    try {
      f();
    } catch (const lazy::Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  const std::string m1 = message([&] { lazy::split(a, {1, 2}, 1); });
  EXPECT_NE(m1.find("5"), std::string::npos) << m1;
  EXPECT_NE(m1.find("[1, 2]"), std::string::npos) << m1;
  const std::string m2 = message([&] { lazy::repeat(a, {2}); });
  EXPECT_NE(m2.find("(4, 5)"), std::string::npos) << m2;
  const std::string m3 = message([&] { lazy::tril(make<float>(Shape{5})); });
  EXPECT_NE(m3.find("at least 2"), std::string::npos) << m3;
  const std::string m4 = message([&] { lazy::masked_fill(a, lazy::ones<bool>({4}), 1.0f); });
  EXPECT_NE(m4.find("(4,)"), std::string::npos) << m4;
  EXPECT_NE(m4.find("(4, 5)"), std::string::npos) << m4;
}

TEST(ShapeSplitRearrange, NoOpsAreNewTensorsThatKeepTheirHistory) {
  // As the other shape ops: a result that changes nothing is still a tensor of its own.
  using Op = std::function<Tensor<float>(const Tensor<float>&)>;
  const std::vector<std::pair<const char*, Op>> ops = {
      {"split", [](const Tensor<float>& t) { return lazy::split(t, 5, 1)[0]; }},
      {"chunk", [](const Tensor<float>& t) { return lazy::chunk(t, 1, 0)[0]; }},
      {"flip", [](const Tensor<float>& t) { return lazy::flip(t, lazy::Dims{}); }},
      {"roll", [](const Tensor<float>& t) { return lazy::roll(t, 6); }},
      {"repeat", [](const Tensor<float>& t) { return lazy::repeat(t, {1, 1}); }},
      {"tril", [](const Tensor<float>& t) { return lazy::tril(t, 3); }},
  };
  for (const auto& [name, op] : ops) {
    SCOPED_TRACE(name);
    auto a = lazy::ones<float>({2, 3});
    auto r = op(a);
    r.add_(1.0f);
    EXPECT_EQ(a.to_vector(), std::vector<float>(6, 1.0f));
    auto x = lazy::ones<float>({2, 3}).requires_grad_();
    auto y = op(x);
    EXPECT_FALSE(y.is_leaf());
    lazy::sum(y * 3.0f).backward();
    EXPECT_EQ(x.grad().to_vector(), std::vector<float>(6, 3.0f));
  }
}

TEST(ShapeSplitRearrange, GradientsMatchFiniteDifferences) {
  using gradcheck::input;
  using V = std::vector<Tensor<double>>;
  using T = Tensor<double>;
  gradcheck::check("split, pieces reordered and scaled",
                   [](const V& v) {
                     auto p = lazy::split(v[0], 2, -1);
                     return lazy::cat({p[2], T(p[0] * 3.0), p[1]}, 1);
                   },
                   {input(Shape{3, 5}, 1)});
  gradcheck::check("split with sizes of a transposed input, one piece unused",
                   [](const V& v) {
                     auto p = lazy::split(lazy::transpose(v[0], 0, 1), {1, 2, 1}, 0);
                     return lazy::cat({p[2], p[0]}, 0);
                   },
                   {input(Shape{3, 4}, 2)});
  gradcheck::check("chunk and unbind",
                   [](const V& v) {
                     auto c = lazy::chunk(v[0], 3, 0);
                     auto u = lazy::unbind(v[0], -1);
                     return lazy::cat({T(lazy::reshape(c[1], {-1}) * 2.0), u[2], u[0]}, 0);
                   },
                   {input(Shape{5, 4}, 3)});
  gradcheck::check("flip", [](const V& v) { return lazy::flip(v[0], {0, -1}); }, {input(Shape{3, 4, 2}, 4)});
  gradcheck::check("flip of a transposed input",
                   [](const V& v) { return lazy::flip(lazy::transpose(v[0], 0, 1), 1); }, {input(Shape{3, 5}, 5)});
  gradcheck::check("roll", [](const V& v) { return lazy::roll(v[0], {1, -2}, {0, 1}); }, {input(Shape{3, 5}, 6)});
  gradcheck::check("roll flattened", [](const V& v) { return lazy::roll(v[0], 4); }, {input(Shape{3, 5}, 7)});
  gradcheck::check("repeat", [](const V& v) { return lazy::repeat(v[0], {2, 1, 3}); }, {input(Shape{2, 3}, 8)});
  gradcheck::check("repeat of a transposed input",
                   [](const V& v) { return lazy::repeat(lazy::transpose(v[0], 0, 1), {3, 2}); }, {input(Shape{2, 3}, 9)});
  gradcheck::check("tril", [](const V& v) { return lazy::tril(v[0], -1); }, {input(Shape{2, 4, 3}, 10)});
  gradcheck::check("triu", [](const V& v) { return lazy::triu(v[0], 1); }, {input(Shape{4, 3}, 11)});
  gradcheck::check("masked_fill",
                   [](const V& v) {
                     auto mask = lazy::from_vector<bool>({true, false, false, true}, Shape{4});
                     return lazy::masked_fill(v[0], mask, 2.5);
                   },
                   {input(Shape{3, 4}, 12)});
  gradcheck::check("masked_fill, broadcast up, tensor value",
                   [](const V& v) {
                     auto mask = lazy::from_vector<bool>({true, false, false, true, true, false}, Shape{2, 3});
                     return lazy::masked_fill(v[0], mask, v[1]);
                   },
                   {input(Shape{3}, 13), input(Shape{}, 14)});
}

// ---- laziness ---------------------------------------------------------------------------

TEST(ShapeLaziness, NothingRunsBeforeMarkStep) {
  auto a = make<float>(Shape{4, 6});
  auto idx = lazy::from_vector<std::int64_t>({0, 2});
  const auto before = kernels_run();
  std::vector<Tensor<float>> outs = {
      lazy::reshape(a, {6, 4}),
      lazy::transpose(a, 0, 1),
      lazy::permute(lazy::reshape(a, {2, 3, 4}), {2, 0, 1}),
      lazy::expand(lazy::reshape(a, {1, 4, 6}), {3, 4, 6}),
      lazy::slice(a, 1, 1, 5, 2),
      lazy::narrow(a, 0, 1, 2),
      lazy::cat({a, a}, 1),
      lazy::stack({a, a}, 2),
      lazy::index_select(a, 1, idx),
      lazy::gather(a, 0, lazy::from_vector<std::int64_t>({1, 0, 3}, Shape{1, 3})),
  };
  auto oh = lazy::one_hot(idx, 3);
  EXPECT_EQ(kernels_run(), before);
  for (const auto& t : outs) EXPECT_FALSE(t.node()->materialized()) << t.node()->op_name();
  EXPECT_FALSE(oh.node()->materialized());
  lazy::mark_step();
  EXPECT_GE(kernels_run(), before + static_cast<std::int64_t>(outs.size()) + 1);
  for (const auto& t : outs) EXPECT_TRUE(t.node()->materialized()) << t.node()->op_name();
  expect_values(oh, Shape{2, 3}, std::vector<std::int64_t>{1, 0, 0, 0, 0, 1});
}

TEST(ShapeLaziness, EagerModeRunsAtOnce) {
  lazy::eager_mode(true);
  auto a = make<float>(Shape{2, 3});
  auto t = lazy::transpose(a, 0, 1);
  EXPECT_TRUE(t.node()->materialized());
  lazy::eager_mode(false);
  expect_values(t, Shape{3, 2}, std::vector<float>{0, 3, 1, 4, 2, 5});
}

}  // namespace
