// Tests of ops/matmul.hpp: matmul (torch.matmul rules), bmm, linear, the transposed-read
// path and the fused GEMM epilogue, against a naive long double triple loop.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include <lazytensor/debug/metrics.hpp>
#include <lazytensor/tensor.hpp>
#include <lazytensor/ops/factories.hpp>
#include <lazytensor/ops/matmul.hpp>
#include <lazytensor/ops/shape.hpp>

namespace {

using lazy::Shape;
using lazy::Tensor;

template <class T>
std::vector<T> matmul_values(std::int64_t n, unsigned seed) {
  std::mt19937_64 rng(seed);
  std::vector<T> v(static_cast<std::size_t>(n));
  if constexpr (std::is_floating_point_v<T>) {
    std::uniform_real_distribution<double> d(-1, 1);
    for (auto& x : v) x = static_cast<T>(d(rng));
  } else {
    std::uniform_int_distribution<int> d(-20, 20);
    for (auto& x : v) x = static_cast<T>(d(rng));
  }
  return v;
}

/// Reference result of torch.matmul, with the sum of |a||b| per output for the tolerance.
struct Ref {
  Shape shape;
  std::vector<long double> val, mag;
  std::int64_t k = 0;
};

/// Independent implementation of torch.matmul's shape rules and a naive triple loop.
template <class T>
Ref ref_matmul(const std::vector<T>& a, const Shape& sa, const std::vector<T>& b, const Shape& sb) {
  Ref r;
  const bool a1 = sa.rank() == 1, b1 = sb.rank() == 1;
  // Promote 1-D operands to matrices.
  std::vector<std::int64_t> da(sa.begin(), sa.end()), db(sb.begin(), sb.end());
  if (a1) da.insert(da.begin(), 1);
  if (b1) db.push_back(1);
  const std::int64_t m = da[da.size() - 2], k = da.back(), n = db.back();
  r.k = k;
  std::vector<std::int64_t> ba(da.begin(), da.end() - 2), bb(db.begin(), db.end() - 2);
  const std::size_t nb = std::max(ba.size(), bb.size());
  while (ba.size() < nb) ba.insert(ba.begin(), 1);
  while (bb.size() < nb) bb.insert(bb.begin(), 1);
  std::vector<std::int64_t> batch(nb);
  for (std::size_t i = 0; i < nb; ++i) batch[i] = ba[i] == 1 ? bb[i] : ba[i];
  std::int64_t nbatch = 1;
  for (auto x : batch) nbatch *= x;
  std::vector<std::int64_t> out(batch);
  if (!a1) out.push_back(m);
  if (!b1) out.push_back(n);
  r.shape = Shape(out);
  r.val.assign(static_cast<std::size_t>(nbatch * m * n), 0);
  r.mag.assign(r.val.size(), 0);
  for (std::int64_t bi = 0; bi < nbatch; ++bi) {
    // Batch index -> offsets of a and b (broadcast dims of size 1 stay at 0).
    std::int64_t rem = bi, oa = 0, ob = 0, sta = 1, stb = 1;
    for (std::size_t d = nb; d-- > 0;) {
      const std::int64_t idx = rem % batch[d];
      rem /= batch[d];
      oa += (ba[d] == 1 ? 0 : idx) * sta;
      ob += (bb[d] == 1 ? 0 : idx) * stb;
      sta *= ba[d];
      stb *= bb[d];
    }
    const T* pa = a.data() + oa * m * k;
    const T* pb = b.data() + ob * k * n;
    for (std::int64_t i = 0; i < m; ++i)
      for (std::int64_t j = 0; j < n; ++j) {
        long double s = 0, g = 0;
        for (std::int64_t p = 0; p < k; ++p) {
          const long double x = static_cast<long double>(pa[i * k + p]) * static_cast<long double>(pb[p * n + j]);
          s += x;
          g += std::fabs(x);
        }
        r.val[(bi * m + i) * n + j] = s;
        r.mag[(bi * m + i) * n + j] = g;
      }
  }
  return r;
}

template <class T>
void expect_matches(const std::vector<T>& got, const Ref& r, const std::string& what) {
  ASSERT_EQ(got.size(), r.val.size()) << what;
  for (std::size_t i = 0; i < got.size(); ++i) {
    if constexpr (std::is_floating_point_v<T>) {
      const double eps = std::numeric_limits<T>::epsilon();
      const double tol = (4 + 2 * std::sqrt(static_cast<double>(r.k))) * eps * static_cast<double>(r.mag[i]) +
                         std::numeric_limits<T>::min();
      ASSERT_NEAR(got[i], static_cast<double>(r.val[i]), tol) << what << " @" << i;
    } else {
      ASSERT_EQ(static_cast<long double>(got[i]), r.val[i]) << what << " @" << i;
    }
  }
}

template <class T>
void check_matmul(const Shape& sa, const Shape& sb, unsigned seed) {
  const std::string what = sa.str() + " @ " + sb.str();
  const auto va = matmul_values<T>(sa.numel(), seed);
  const auto vb = matmul_values<T>(sb.numel(), seed + 1000);
  const Ref r = ref_matmul(va, sa, vb, sb);
  Tensor<T> a = lazy::from_vector(va, sa), b = lazy::from_vector(vb, sb);
  Tensor<T> c = lazy::matmul(a, b);
  ASSERT_EQ(c.shape(), r.shape) << what;
  lazy::mark_step();
  expect_matches(c.to_vector(), r, what);
}

template <class T>
class MatmulTyped : public ::testing::Test {};
using GemmTypes = ::testing::Types<float, double, std::int32_t, std::int64_t>;
TYPED_TEST_SUITE(MatmulTyped, GemmTypes);

TYPED_TEST(MatmulTyped, VectorVector) {
  using T = TypeParam;
  for (std::int64_t k : {0, 1, 2, 3, 7, 8, 127, 128, 129, 4097}) {
    check_matmul<T>(Shape{k}, Shape{k}, static_cast<unsigned>(k));
  }
  // A dot product is 0-d.
  Tensor<T> d = lazy::matmul(lazy::tensor<T>({T(1), T(2), T(3)}), lazy::tensor<T>({T(4), T(5), T(6)}));
  EXPECT_EQ(d.dim(), 0);
  EXPECT_EQ(d.item(), T(32));
}

TYPED_TEST(MatmulTyped, MatrixVectorAndVectorMatrix) {
  using T = TypeParam;
  unsigned seed = 10;
  for (auto [m, k] : std::vector<std::pair<std::int64_t, std::int64_t>>{
           {1, 1}, {7, 13}, {13, 7}, {129, 127}, {0, 5}, {5, 0}, {1, 300}, {300, 1}}) {
    check_matmul<T>(Shape{m, k}, Shape{k}, seed++);
    check_matmul<T>(Shape{k}, Shape{k, m}, seed++);
  }
  // Batched operands with a 1-D side.
  check_matmul<T>(Shape{3, 5, 7}, Shape{7}, seed++);
  check_matmul<T>(Shape{7}, Shape{3, 7, 5}, seed++);
  check_matmul<T>(Shape{2, 3, 4, 6}, Shape{6}, seed++);
  check_matmul<T>(Shape{4}, Shape{2, 3, 4, 6}, seed++);
}

TYPED_TEST(MatmulTyped, EmptyContractionWithBatchedVectorSide) {
  using T = TypeParam;
  // [0] @ [3, 0, 4] -> [3, 4] of zeros; [3, 4, 0] @ [0] -> [3, 4] of zeros.
  check_matmul<T>(Shape{0}, Shape{3, 0, 4}, 1);
  check_matmul<T>(Shape{3, 4, 0}, Shape{0}, 2);
  check_matmul<T>(Shape{0}, Shape{2, 5, 0, 3}, 3);
  check_matmul<T>(Shape{0}, Shape{0, 3}, 4);
}

TYPED_TEST(MatmulTyped, MatrixMatrix) {
  using T = TypeParam;
  unsigned seed = 100;
  std::vector<std::array<std::int64_t, 3>> mkn = {{1, 1, 1},   {7, 13, 5},  {129, 127, 65}, {0, 3, 4}, {3, 0, 4},
                                                  {3, 4, 0},   {2, 3, 1},   {1, 5, 7},      {16, 16, 16},
                                                  {17, 33, 9}, {128, 1, 128}, {1, 128, 1}};
  if constexpr (std::is_same_v<T, float>) mkn.push_back({256, 784, 256});
  else mkn.push_back({96, 300, 80});
  for (auto [m, k, n] : mkn) check_matmul<T>(Shape{m, k}, Shape{k, n}, seed++);
}

TYPED_TEST(MatmulTyped, Batched) {
  using T = TypeParam;
  unsigned seed = 200;
  // 3-D x 3-D.
  check_matmul<T>(Shape{3, 7, 13}, Shape{3, 13, 5}, seed++);
  check_matmul<T>(Shape{1, 7, 13}, Shape{1, 13, 5}, seed++);
  check_matmul<T>(Shape{0, 7, 13}, Shape{0, 13, 5}, seed++);
  check_matmul<T>(Shape{5, 1, 1}, Shape{5, 1, 1}, seed++);
  check_matmul<T>(Shape{4, 33, 65}, Shape{4, 65, 17}, seed++);
  // 3-D x 2-D and 2-D x 3-D.
  check_matmul<T>(Shape{3, 7, 13}, Shape{13, 5}, seed++);
  check_matmul<T>(Shape{7, 13}, Shape{3, 13, 5}, seed++);
  check_matmul<T>(Shape{6, 129, 31}, Shape{31, 3}, seed++);
  // Broadcast batch dims.
  check_matmul<T>(Shape{2, 1, 4, 6}, Shape{3, 6, 5}, seed++);
  check_matmul<T>(Shape{1, 4, 6}, Shape{4, 6, 5}, seed++);
  check_matmul<T>(Shape{4, 1, 3, 2}, Shape{1, 5, 2, 7}, seed++);
  check_matmul<T>(Shape{2, 3, 1, 4, 6}, Shape{3, 5, 6, 2}, seed++);
  check_matmul<T>(Shape{3, 0, 4}, Shape{4, 2}, seed++);
  check_matmul<T>(Shape{3, 4, 0}, Shape{3, 0, 2}, seed++);
  // bmm is the 3-D x 3-D case.
  const auto va = matmul_values<T>(2 * 3 * 4, 1), vb = matmul_values<T>(2 * 4 * 5, 2);
  Tensor<T> c = lazy::bmm(lazy::from_vector(va, Shape{2, 3, 4}), lazy::from_vector(vb, Shape{2, 4, 5}));
  expect_matches(c.to_vector(), ref_matmul(va, Shape{2, 3, 4}, vb, Shape{2, 4, 5}), "bmm");
  EXPECT_THROW(lazy::bmm(lazy::zeros<T>({2, 3, 4}), lazy::zeros<T>({3, 4, 5})), lazy::ShapeError);
  EXPECT_THROW(lazy::bmm(lazy::zeros<T>({3, 4}), lazy::zeros<T>({4, 5})), lazy::ShapeError);
}

TEST(Matmul, LargeAboveThreadingThresholdAllThreadCounts) {
  auto& pool = lazy::graph::current_device().threads();
  const int saved = pool.size();
  const Shape sa{300, 200}, sb{200, 129};
  const auto va = matmul_values<float>(sa.numel(), 3), vb = matmul_values<float>(sb.numel(), 4);
  const Ref r = ref_matmul(va, sa, vb, sb);
  for (int threads : {1, 2, 4}) {
    lazy::set_num_threads(threads);
    Tensor<float> c = lazy::matmul(lazy::from_vector(va, sa), lazy::from_vector(vb, sb));
    expect_matches(c.to_vector(), r, "threads " + std::to_string(threads));
    // Batched, with a batch count that does not divide evenly among the tasks.
    const Shape ta{7, 61, 33}, tb{7, 33, 47};
    const auto xa = matmul_values<double>(ta.numel(), 5), xb = matmul_values<double>(tb.numel(), 6);
    Tensor<double> d = lazy::matmul(lazy::from_vector(xa, ta), lazy::from_vector(xb, tb));
    expect_matches(d.to_vector(), ref_matmul(xa, ta, xb, tb), "batched threads " + std::to_string(threads));
  }
  lazy::set_num_threads(saved);
}

TEST(Matmul, BitwiseIdenticalForAnyThreadCount) {
  // Odd row counts, a fused epilogue, a transposed operand and a batch: every variant must
  // give the same bits on 1, 2 and 3 threads (GEMM calls are cut by the shapes only).
  const Shape sx{301, 200}, sw{129, 200}, sb{129}, tb{3, 67, 40}, tc{3, 40, 33};
  const auto vx = matmul_values<float>(sx.numel(), 11), vw = matmul_values<float>(sw.numel(), 12);
  const auto vb = matmul_values<float>(sb.numel(), 13);
  const auto xa = matmul_values<float>(tb.numel(), 14), xb = matmul_values<float>(tc.numel(), 15);
  std::vector<std::vector<float>> first;
  for (int threads : {1, 2, 3}) {
    lazy::set_num_threads(threads);
    const auto x = lazy::from_vector(vx, sx), w = lazy::from_vector(vw, sw), b = lazy::from_vector(vb, sb);
    Tensor<float> plain = lazy::matmul(x, lazy::transpose(w, 0, 1));
    Tensor<float> fused = lazy::relu(lazy::linear(x, w, b));
    Tensor<float> batched = lazy::matmul(lazy::from_vector(xa, tb), lazy::from_vector(xb, tc)) * 2.0f;
    lazy::mark_step();
    const std::vector<std::vector<float>> got{plain.to_vector(), fused.to_vector(), batched.to_vector()};
    if (first.empty()) {
      first = got;
      // The first run also matches an independent reference.
      std::vector<float> wt(vw.size());
      for (std::int64_t i = 0; i < 129; ++i)
        for (std::int64_t j = 0; j < 200; ++j) wt[j * 129 + i] = vw[i * 200 + j];
      expect_matches(got[0], ref_matmul(vx, sx, wt, Shape{200, 129}), "plain");
      continue;
    }
    for (std::size_t v = 0; v < got.size(); ++v) {
      ASSERT_EQ(got[v].size(), first[v].size());
      EXPECT_EQ(std::memcmp(got[v].data(), first[v].data(), got[v].size() * sizeof(float)), 0)
          << "variant " << v << " differs on " << threads << " threads";
    }
  }
  lazy::set_num_threads(lazy::graph::default_device_threads());
}

template <class T>
std::vector<T> transposed(const std::vector<T>& v, std::int64_t rows, std::int64_t cols) {
  std::vector<T> t(v.size());
  for (std::int64_t i = 0; i < rows; ++i)
    for (std::int64_t j = 0; j < cols; ++j) t[j * rows + i] = v[i * cols + j];
  return t;
}

TYPED_TEST(MatmulTyped, TransposedOperands) {
  using T = TypeParam;
  // {40, 1100, 33}: a depth the packed float/double kernel splits into blocks.
  for (auto [m, k, n] : std::vector<std::array<std::int64_t, 3>>{
           {7, 13, 5}, {129, 127, 65}, {1, 1, 1}, {1, 9, 4}, {40, 1100, 33}}) {
    SCOPED_TRACE(std::to_string(m) + "x" + std::to_string(k) + "x" + std::to_string(n));
    const auto va = matmul_values<T>(m * k, 1), vb = matmul_values<T>(k * n, 2);
    const Ref r = ref_matmul(va, Shape{m, k}, vb, Shape{k, n});
    // Sources holding the transposes: at is [k, m], bt is [n, k].
    Tensor<T> at = lazy::from_vector(transposed(va, m, k), Shape{k, m});
    Tensor<T> bt = lazy::from_vector(transposed(vb, k, n), Shape{n, k});
    Tensor<T> a = lazy::from_vector(va, Shape{m, k}), b = lazy::from_vector(vb, Shape{k, n});
    // Pending transposes, read through by the GEMM.
    Tensor<T> c1 = lazy::matmul(a, lazy::transpose(bt, 0, 1));
    Tensor<T> c2 = lazy::matmul(lazy::transpose(at, 0, 1), b);
    Tensor<T> c3 = lazy::matmul(lazy::transpose(at, 0, 1), lazy::transpose(bt, 1, 0));
    Tensor<T> c4 = lazy::matmul(lazy::transpose(at, -1, -2), lazy::transpose(bt, 0, 1));
    lazy::mark_step();
    expect_matches(c1.to_vector(), r, "a @ bt^T");
    expect_matches(c2.to_vector(), r, "at^T @ b");
    expect_matches(c3.to_vector(), r, "at^T @ bt^T");
    expect_matches(c4.to_vector(), r, "at^T @ bt^T (negative dims)");
    // A transpose that was already materialized gives the same values.
    Tensor<T> btT = lazy::transpose(bt, 0, 1);
    lazy::mark_step();
    expect_matches(lazy::matmul(a, btT).to_vector(), r, "materialized transpose");
    // A transpose of a pending (computed) tensor.
    Tensor<T> bt2 = lazy::from_vector(transposed(vb, k, n), Shape{n, k}) * T(1);
    expect_matches(lazy::matmul(a, lazy::transpose(bt2, 0, 1)).to_vector(), r, "transpose of pending");
    // Transposed operands with a 1-D side.
    const auto v = matmul_values<T>(k, 3);
    expect_matches(lazy::matmul(lazy::transpose(at, 0, 1), lazy::from_vector(v)).to_vector(),
                   ref_matmul(va, Shape{m, k}, v, Shape{k}), "at^T @ v");
    expect_matches(lazy::matmul(lazy::from_vector(v), lazy::transpose(bt, 0, 1)).to_vector(),
                   ref_matmul(v, Shape{k}, vb, Shape{k, n}), "v @ bt^T");
  }
}

TYPED_TEST(MatmulTyped, TransposedOperandsBatched) {
  using T = TypeParam;
  const std::int64_t B = 3, m = 5, k = 7, n = 4;
  const auto va = matmul_values<T>(B * m * k, 1), vb = matmul_values<T>(B * k * n, 2);
  const Ref r = ref_matmul(va, Shape{B, m, k}, vb, Shape{B, k, n});
  std::vector<T> at(va.size()), bt(vb.size());
  for (std::int64_t b = 0; b < B; ++b) {
    auto ta = transposed(std::vector<T>(va.begin() + b * m * k, va.begin() + (b + 1) * m * k), m, k);
    auto tb = transposed(std::vector<T>(vb.begin() + b * k * n, vb.begin() + (b + 1) * k * n), k, n);
    std::copy(ta.begin(), ta.end(), at.begin() + b * m * k);
    std::copy(tb.begin(), tb.end(), bt.begin() + b * k * n);
  }
  Tensor<T> A = lazy::from_vector(va, Shape{B, m, k}), Bm = lazy::from_vector(vb, Shape{B, k, n});
  Tensor<T> At = lazy::from_vector(at, Shape{B, k, m}), Bt = lazy::from_vector(bt, Shape{B, n, k});
  expect_matches(lazy::matmul(lazy::transpose(At, 1, 2), Bm).to_vector(), r, "At^T @ B");
  expect_matches(lazy::matmul(A, lazy::transpose(Bt, -1, -2)).to_vector(), r, "A @ Bt^T");
  expect_matches(lazy::matmul(lazy::transpose(At, 1, 2), lazy::transpose(Bt, 1, 2)).to_vector(), r, "both");
  // [B, m, k] @ [k, n]^T with the 2-D side transposed.
  const auto w = matmul_values<T>(k * n, 9);
  Tensor<T> Wt = lazy::from_vector(transposed(w, k, n), Shape{n, k});
  expect_matches(lazy::matmul(A, lazy::transpose(Wt, 0, 1)).to_vector(), ref_matmul(va, Shape{B, m, k}, w, Shape{k, n}),
                 "A @ Wt^T");
  // [k, m]^T @ [B, k, n]: the 2-D transposed side broadcast over the batch.
  const auto u = matmul_values<T>(m * k, 11);
  Tensor<T> Ut = lazy::from_vector(transposed(u, m, k), Shape{k, m});
  expect_matches(lazy::matmul(lazy::transpose(Ut, 0, 1), Bm).to_vector(),
                 ref_matmul(u, Shape{m, k}, vb, Shape{B, k, n}), "Ut^T @ B");
}

TEST(Matmul, Aliasing) {
  const auto v = matmul_values<double>(6 * 6, 1);
  Tensor<double> a = lazy::from_vector(v, Shape{6, 6});
  expect_matches(lazy::matmul(a, a).to_vector(), ref_matmul(v, Shape{6, 6}, v, Shape{6, 6}), "a @ a");
  // x @ x^T reads the same node twice, once transposed.
  const auto x = matmul_values<double>(5 * 3, 2);
  Tensor<double> xt = lazy::from_vector(x, Shape{5, 3});
  expect_matches(lazy::matmul(xt, lazy::transpose(xt, 0, 1)).to_vector(),
                 ref_matmul(x, Shape{5, 3}, transposed(x, 5, 3), Shape{3, 5}), "x @ x^T");
  // The result replaces one of its operands (functionalized; the old value is still read).
  Tensor<double> b = lazy::from_vector(v, Shape{6, 6});
  b = lazy::matmul(b, b);
  expect_matches(b.to_vector(), ref_matmul(v, Shape{6, 6}, v, Shape{6, 6}), "b = b @ b");
  // An operand updated in place after the product was built: the product keeps the old value.
  Tensor<double> c = lazy::from_vector(v, Shape{6, 6});
  Tensor<double> p = lazy::matmul(c, c);
  Tensor<double> q = lazy::relu(lazy::matmul(c, c));
  c += 1.0;
  c.mul_(2.0);
  lazy::mark_step();
  const Ref r = ref_matmul(v, Shape{6, 6}, v, Shape{6, 6});
  expect_matches(p.to_vector(), r, "captured operand");
  auto vq = q.to_vector();
  for (std::size_t i = 0; i < vq.size(); ++i) {
    EXPECT_NEAR(vq[i], std::max(0.0, static_cast<double>(r.val[i])), 1e-14 * (1 + static_cast<double>(r.mag[i]))) << i;
  }
  auto vc = c.to_vector();
  for (std::size_t i = 0; i < vc.size(); ++i) EXPECT_EQ(vc[i], (v[i] + 1.0) * 2.0);
}

template <class T>
std::vector<long double> ref_linear(const std::vector<T>& x, std::int64_t rows, std::int64_t in, const std::vector<T>& w,
                                    std::int64_t out, const std::vector<T>* b, std::vector<long double>* mag) {
  std::vector<long double> y(static_cast<std::size_t>(rows * out));
  if (mag) mag->assign(y.size(), 0);
  for (std::int64_t i = 0; i < rows; ++i)
    for (std::int64_t o = 0; o < out; ++o) {
      long double s = b ? static_cast<long double>((*b)[o]) : 0, g = b ? std::fabs(static_cast<long double>((*b)[o])) : 0;
      for (std::int64_t p = 0; p < in; ++p) {
        const long double t = static_cast<long double>(x[i * in + p]) * static_cast<long double>(w[o * in + p]);
        s += t;
        g += std::fabs(t);
      }
      y[i * out + o] = s;
      if (mag) (*mag)[i * out + o] = g;
    }
  return y;
}

template <class T>
void expect_close(const std::vector<T>& got, const std::vector<long double>& ref, const std::vector<long double>& mag,
                  std::int64_t k, const std::string& what, bool relu = false) {
  ASSERT_EQ(got.size(), ref.size()) << what;
  const double eps = std::numeric_limits<T>::epsilon();
  for (std::size_t i = 0; i < got.size(); ++i) {
    const long double want = relu ? std::max<long double>(ref[i], 0) : ref[i];
    const double tol = (4 + 2 * std::sqrt(static_cast<double>(k))) * eps * static_cast<double>(mag[i]) + 1e-30;
    ASSERT_NEAR(got[i], static_cast<double>(want), tol) << what << " @" << i;
  }
}

TEST(Linear, WithAndWithoutBias) {
  for (auto [rows, in, out] : std::vector<std::array<std::int64_t, 3>>{{1, 1, 1}, {7, 13, 5}, {129, 127, 65}, {4, 0, 3}}) {
    SCOPED_TRACE(std::to_string(rows) + "x" + std::to_string(in) + "->" + std::to_string(out));
    const auto x = matmul_values<float>(rows * in, 1), w = matmul_values<float>(out * in, 2);
    const auto b = matmul_values<float>(out, 3);
    Tensor<float> X = lazy::from_vector(x, Shape{rows, in}), W = lazy::from_vector(w, Shape{out, in});
    Tensor<float> Bv = lazy::from_vector(b);
    std::vector<long double> mag0, mag1;
    const auto r0 = ref_linear<float>(x, rows, in, w, out, nullptr, &mag0);
    const auto r1 = ref_linear(x, rows, in, w, out, &b, &mag1);
    Tensor<float> y0 = lazy::linear(X, W);
    Tensor<float> y1 = lazy::linear(X, W, Bv);
    EXPECT_EQ(y0.shape(), (Shape{rows, out}));
    EXPECT_EQ(y1.shape(), (Shape{rows, out}));
    lazy::mark_step();
    expect_close(y0.to_vector(), r0, mag0, in, "linear(x, w)");
    expect_close(y1.to_vector(), r1, mag1, in, "linear(x, w, b)");
  }
  // 1-D and 3-D inputs.
  const auto w = matmul_values<double>(4 * 6, 5), b = matmul_values<double>(4, 6);
  const auto x1 = matmul_values<double>(6, 7), x3 = matmul_values<double>(2 * 3 * 6, 8);
  Tensor<double> W = lazy::from_vector(w, Shape{4, 6}), Bv = lazy::from_vector(b);
  std::vector<long double> mag;
  Tensor<double> y1 = lazy::linear(lazy::from_vector(x1), W, Bv);
  EXPECT_EQ(y1.shape(), (Shape{4}));
  auto r1 = ref_linear(x1, 1, 6, w, 4, &b, &mag);
  expect_close(y1.to_vector(), r1, mag, 6, "linear 1-D");
  Tensor<double> y3 = lazy::linear(lazy::from_vector(x3, Shape{2, 3, 6}), W, Bv);
  EXPECT_EQ(y3.shape(), (Shape{2, 3, 4}));
  auto r3 = ref_linear(x3, 6, 6, w, 4, &b, &mag);
  expect_close(y3.to_vector(), r3, mag, 6, "linear 3-D");
}

TEST(Linear, Errors) {
  Tensor<float> x = lazy::zeros<float>({3, 4}), w = lazy::zeros<float>({5, 4});
  EXPECT_THROW(lazy::linear(x, lazy::zeros<float>({5, 3})), lazy::ShapeError);
  EXPECT_THROW(lazy::linear(x, lazy::zeros<float>({4})), lazy::ShapeError);
  EXPECT_THROW(lazy::linear(x, lazy::zeros<float>({2, 5, 4})), lazy::ShapeError);
  EXPECT_THROW(lazy::linear(lazy::scalar_tensor(1.f), w), lazy::ShapeError);
  EXPECT_THROW(lazy::linear(x, w, lazy::zeros<float>({4})), lazy::ShapeError);
  EXPECT_THROW(lazy::linear(x, w, lazy::zeros<float>({1, 5})), lazy::ShapeError);
  EXPECT_NO_THROW(lazy::linear(x, w, lazy::zeros<float>({5})));
}

/// relu(linear(x, w, b)) through the fused epilogue, for several thread counts and shapes
/// whose row count is not a multiple of the epilogue's row block.
TEST(Linear, FusedReluEpilogueValues) {
  auto& pool = lazy::graph::current_device().threads();
  const int saved = pool.size();
  for (auto [rows, in, out] : std::vector<std::array<std::int64_t, 3>>{
           {1000, 64, 300}, {1, 64, 300}, {333, 17, 1}, {257, 3, 1001}, {1000, 1, 7}}) {
    SCOPED_TRACE(std::to_string(rows) + "x" + std::to_string(in) + "->" + std::to_string(out));
    const auto x = matmul_values<float>(rows * in, 21), w = matmul_values<float>(out * in, 22);
    const auto b = matmul_values<float>(out, 23);
    std::vector<long double> mag;
    const auto r = ref_linear(x, rows, in, w, out, &b, &mag);
    for (int threads : {1, 2, 4}) {
      SCOPED_TRACE(threads);
      lazy::set_num_threads(threads);
      Tensor<float> X = lazy::from_vector(x, Shape{rows, in}), W = lazy::from_vector(w, Shape{out, in});
      Tensor<float> Bv = lazy::from_vector(b);
      Tensor<float> y = lazy::relu(lazy::linear(X, W, Bv));
      lazy::mark_step();
      expect_close(y.to_vector(), r, mag, in, "relu(linear)", /*relu=*/true);
    }
  }
  lazy::set_num_threads(saved);
}

/// Outputs narrower than a SIMD batch, in rows enough for several tasks: each task's last
/// row ends inside the buffer the fused epilogue shares with the GEMM, where the next task
/// writes at the same time, so its tail must read nothing past the row. The values match
/// either way; the ThreadSanitizer build (label tsan) reported the reads past it as races.
TEST(Linear, FusedReluEpilogueNarrowOutputsOnSeveralTasks) {
  auto& pool = lazy::graph::current_device().threads();
  const int saved = pool.size();
  const std::int64_t rows = 4096, in = 64;
  for (std::int64_t out : {1, 3, 7, 10}) {
    SCOPED_TRACE(out);
    const auto x = matmul_values<float>(rows * in, 51), w = matmul_values<float>(out * in, 52);
    const auto b = matmul_values<float>(out, 53);
    std::vector<long double> mag;
    const auto r = ref_linear(x, rows, in, w, out, &b, &mag);
    for (int threads : {2, 3}) {
      SCOPED_TRACE(threads);
      lazy::set_num_threads(threads);
      Tensor<float> X = lazy::from_vector(x, Shape{rows, in}), W = lazy::from_vector(w, Shape{out, in});
      Tensor<float> y = lazy::relu(lazy::linear(X, W, lazy::from_vector(b)));
      lazy::mark_step();
      expect_close(y.to_vector(), r, mag, in, "relu(linear)", /*relu=*/true);
    }
  }
  lazy::set_num_threads(saved);
}

TEST(Linear, FusedEpilogueRunsOneKernel) {
  const std::int64_t rows = 1000, in = 64, out = 300;
  const auto x = matmul_values<float>(rows * in, 31), w = matmul_values<float>(out * in, 32);
  const auto b = matmul_values<float>(out, 33);
  std::vector<long double> mag;
  const auto r = ref_linear(x, rows, in, w, out, &b, &mag);
  Tensor<float> X = lazy::from_vector(x, Shape{rows, in}), W = lazy::from_vector(w, Shape{out, in});
  Tensor<float> Bv = lazy::from_vector(b);
  lazy::mark_step();

  // Fused: nothing but the epilogue holds the GEMM, so it runs inside the epilogue.
  auto k0 = lazy::debug::counter_value("KernelsRun");
  Tensor<float> y = lazy::relu(lazy::linear(X, W, Bv));
  lazy::mark_step();
  const auto fused = lazy::debug::counter_value("KernelsRun") - k0;
  expect_close(y.to_vector(), r, mag, in, "fused", true);

  // Unfused: a handle keeps the GEMM result, so it is its own kernel.
  k0 = lazy::debug::counter_value("KernelsRun");
  Tensor<float> mm = lazy::linear(X, W);
  Tensor<float> y2 = lazy::relu(mm + Bv);
  lazy::mark_step();
  const auto unfused = lazy::debug::counter_value("KernelsRun") - k0;
  expect_close(y2.to_vector(), r, mag, in, "unfused", true);
  std::vector<long double> mag0;
  expect_close(mm.to_vector(), ref_linear<float>(x, rows, in, w, out, nullptr, &mag0), mag0, in, "kept GEMM result");

  EXPECT_EQ(fused, 1);
  EXPECT_EQ(unfused, 2);
  EXPECT_EQ(unfused - fused, 1);
}

TEST(Matmul, FusedEpilogueFlatAndBatched) {
  // Flat epilogue (no broadcast leaf): relu(x @ w) and an affine map of it.
  const std::int64_t m = 997, k = 33, n = 129;
  const auto va = matmul_values<double>(m * k, 41), vb = matmul_values<double>(k * n, 42);
  const Ref r = ref_matmul(va, Shape{m, k}, vb, Shape{k, n});
  Tensor<double> A = lazy::from_vector(va, Shape{m, k}), B = lazy::from_vector(vb, Shape{k, n});
  Tensor<double> y = lazy::relu(lazy::matmul(A, B));
  Tensor<double> z = lazy::matmul(A, B) * 2.0 + 1.0;
  lazy::mark_step();
  auto vy = y.to_vector(), vz = z.to_vector();
  const double eps = std::numeric_limits<double>::epsilon();
  for (std::size_t i = 0; i < vy.size(); ++i) {
    const double tol = (4 + 2 * std::sqrt(double(k))) * eps * static_cast<double>(r.mag[i]) * 2 + 1e-300;
    ASSERT_NEAR(vy[i], std::max(0.0, static_cast<double>(r.val[i])), tol) << i;
    ASSERT_NEAR(vz[i], 2 * static_cast<double>(r.val[i]) + 1, 2 * tol + 4 * eps) << i;
  }
  // Batched GEMM feeding an epilogue: row blocks span batch boundaries.
  const Shape sa{5, 211, 19}, sb{5, 19, 150};
  const auto xa = matmul_values<float>(sa.numel(), 43), xb = matmul_values<float>(sb.numel(), 44);
  const auto bias = matmul_values<float>(150, 45);
  const Ref rb = ref_matmul(xa, sa, xb, sb);
  Tensor<float> yb = lazy::relu(lazy::matmul(lazy::from_vector(xa, sa), lazy::from_vector(xb, sb)) + lazy::from_vector(bias));
  // Stacked [B, m, k] @ [k, n] feeding an epilogue.
  const Shape sw{19, 150};
  const auto xw = matmul_values<float>(sw.numel(), 46);
  const Ref rs = ref_matmul(xa, sa, xw, sw);
  Tensor<float> ys = lazy::relu(lazy::matmul(lazy::from_vector(xa, sa), lazy::from_vector(xw, sw)));
  lazy::mark_step();
  auto vb2 = yb.to_vector(), vs = ys.to_vector();
  const double fe = std::numeric_limits<float>::epsilon();
  for (std::size_t i = 0; i < vb2.size(); ++i) {
    const double tol = (4 + 2 * std::sqrt(19.0)) * fe * (static_cast<double>(rb.mag[i]) + std::fabs(bias[i % 150])) + 1e-30;
    ASSERT_NEAR(vb2[i], std::max(0.0, static_cast<double>(rb.val[i]) + bias[i % 150]), tol) << i;
    const double tol2 = (4 + 2 * std::sqrt(19.0)) * fe * static_cast<double>(rs.mag[i]) + 1e-30;
    ASSERT_NEAR(vs[i], std::max(0.0, static_cast<double>(rs.val[i])), tol2) << i;
  }
}

// A product with a vector operand keeps a vector's shape ([m] or [B, m]) while the GEMM
// writes rows of one element: an in-place update taking the product over as its epilogue
// must not read that shape's last dim as the GEMM's rows (it produced row 0 only).
TEST(Matmul, MatrixVectorProductUpdatedInPlace) {
  for (const Shape sa : {Shape{4, 4}, Shape{2, 3, 4}}) {
    const std::int64_t k = sa[sa.rank() - 1], rows = sa.numel() / k;
    std::vector<double> va(static_cast<std::size_t>(sa.numel())), vb(static_cast<std::size_t>(k));
    for (std::size_t i = 0; i < va.size(); ++i) va[i] = static_cast<double>(i % 7) - 2;
    for (std::size_t i = 0; i < vb.size(); ++i) vb[i] = static_cast<double>(i) + 1;
    Tensor<double> y = lazy::matmul(lazy::from_vector(va, sa), lazy::from_vector(vb, Shape{k}));
    y += 1.5;
    y *= 2.0;
    const auto got = y.to_vector();
    ASSERT_EQ(got.size(), static_cast<std::size_t>(rows));
    for (std::int64_t r = 0; r < rows; ++r) {
      double dot = 0;  // small integers: exact in double
      for (std::int64_t j = 0; j < k; ++j) dot += va[static_cast<std::size_t>(r * k + j)] * vb[static_cast<std::size_t>(j)];
      EXPECT_EQ(got[static_cast<std::size_t>(r)], (dot + 1.5) * 2) << sa.str() << " row " << r;
    }
  }
}

// The gradient of a vector-times-stack product reaches the GEMMs of its backward as a
// [B, n] tensor read as B rows of 1 x n; when it is a pending transpose (the product was
// transposed before the loss), the transposed layout must not stand in for that read.
TEST(Matmul, VectorTimesStackGradientThroughATranspose) {
  const std::int64_t B = 2, K = 3, N = 4;
  std::vector<double> av(K), bv(B * K * N), g(N * B);
  for (std::size_t i = 0; i < av.size(); ++i) av[i] = static_cast<double>(i) + 1;
  for (std::size_t i = 0; i < bv.size(); ++i) bv[i] = static_cast<double>(i % 5) - 2;
  for (std::size_t i = 0; i < g.size(); ++i) g[i] = static_cast<double>(i) + 1;  // not uniform
  auto a = lazy::from_vector<double>(av, Shape{K}).requires_grad_();
  auto b = lazy::from_vector<double>(bv, Shape{B, K, N}).requires_grad_();
  Tensor<double> out = lazy::transpose(lazy::matmul(a, b), 0, 1);  // [N, B]
  out.backward(lazy::from_vector<double>(g, Shape{N, B}));
  const auto ga = a.grad().to_vector(), gb = b.grad().to_vector();
  // out[n, bb] = sum_k a[k] b[bb, k, n]: d/da[k] = sum g[n, bb] b[bb, k, n], d/db = a[k] g[n, bb].
  for (std::int64_t k = 0; k < K; ++k) {
    double want = 0;
    for (std::int64_t bb = 0; bb < B; ++bb)
      for (std::int64_t n = 0; n < N; ++n) want += bv[static_cast<std::size_t>((bb * K + k) * N + n)] * g[static_cast<std::size_t>(n * B + bb)];
    EXPECT_EQ(ga[static_cast<std::size_t>(k)], want) << "a.grad[" << k << "]";
  }
  for (std::int64_t bb = 0; bb < B; ++bb)
    for (std::int64_t k = 0; k < K; ++k)
      for (std::int64_t n = 0; n < N; ++n)
        EXPECT_EQ(gb[static_cast<std::size_t>((bb * K + k) * N + n)], av[static_cast<std::size_t>(k)] * g[static_cast<std::size_t>(n * B + bb)])
            << "b.grad[" << bb << ", " << k << ", " << n << "]";
}

TEST(Matmul, ShapeErrors) {
  Tensor<float> a = lazy::zeros<float>({2, 3}), b = lazy::zeros<float>({4, 5});
  try {
    lazy::matmul(a, b);
    FAIL() << "expected ShapeError";
  } catch (const lazy::ShapeError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("(2, 3)"), std::string::npos) << m;
    EXPECT_NE(m.find("(4, 5)"), std::string::npos) << m;
  }
  try {
    lazy::matmul(lazy::zeros<float>({3}), lazy::zeros<float>({4}));
    FAIL() << "expected ShapeError";
  } catch (const lazy::ShapeError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("(3,)"), std::string::npos) << m;
    EXPECT_NE(m.find("(4,)"), std::string::npos) << m;
  }
  EXPECT_THROW(lazy::matmul(lazy::zeros<float>({2, 3}), lazy::zeros<float>({4})), lazy::ShapeError);
  EXPECT_THROW(lazy::matmul(lazy::zeros<float>({4}), lazy::zeros<float>({3, 2})), lazy::ShapeError);
  EXPECT_THROW(lazy::matmul(lazy::zeros<float>({2, 2, 3}), lazy::zeros<float>({2, 4, 5})), lazy::ShapeError);
  // Batch dims that do not broadcast.
  EXPECT_THROW(lazy::matmul(lazy::zeros<float>({2, 3, 4}), lazy::zeros<float>({3, 4, 5})), lazy::ShapeError);
  // Rank-0 operands.
  EXPECT_THROW(lazy::matmul(lazy::scalar_tensor(1.f), lazy::zeros<float>({2})), lazy::ShapeError);
  EXPECT_THROW(lazy::matmul(lazy::zeros<float>({2, 2}), lazy::scalar_tensor(1.f)), lazy::ShapeError);
  EXPECT_THROW(lazy::matmul(lazy::scalar_tensor(1.0), lazy::scalar_tensor(2.0)), lazy::ShapeError);
}

// bfloat16 operands multiply in float (tests/ops/test_autocast.cpp checks the values); bool
// has no product.
TEST(Matmul, DTypeErrors) {
  EXPECT_THROW(lazy::matmul(lazy::ones<bool>({2, 2}), lazy::ones<bool>({2, 2})), lazy::DTypeError);
  EXPECT_THROW(lazy::matmul(lazy::ones<bool>({3}), lazy::ones<bool>({3})), lazy::DTypeError);
}

}  // namespace
