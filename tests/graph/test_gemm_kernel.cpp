// Tests of graph/gemm_kernel.hpp: the packed GEMM against a long double triple loop, for
// every transpose combination, tile edges and depths split into several blocks; its
// results must not depend on how the rows are split (the determinism matmul relies on).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <gtest/gtest.h>
#include <xsimd/xsimd.hpp>

#include <lazytensor/graph/gemm_kernel.hpp>

#include "testing/helpers.hpp"

namespace {

using lazy_tests::random_values;

template <class T>
using AlignedVec = std::vector<T, xsimd::aligned_allocator<T, 64>>;

struct GemmCase {
  std::int64_t m, k, n;
  bool ta, tb;
};

template <class T>
struct Problem {
  GemmCase c;
  std::vector<T> a, b;  // stored as the transposes say
  T at(std::int64_t i, std::int64_t p) const { return c.ta ? a[p * c.m + i] : a[i * c.k + p]; }
  T bt(std::int64_t p, std::int64_t j) const { return c.tb ? b[j * c.k + p] : b[p * c.n + j]; }

  explicit Problem(GemmCase cs, unsigned seed)
      : c(cs), a(random_values<T>(cs.m * cs.k, seed)), b(random_values<T>(cs.k * cs.n, seed + 1)) {}

  AlignedVec<T> packed() const {
    using K = lazy::detail::PackedGemm<T>;
    AlignedVec<T> p(static_cast<std::size_t>(K::packed_size(c.k, c.n)), T(-7));
    K::pack_b(b.data(), c.tb, c.k, c.n, p.data(), 0, K::panels(c.n));
    return p;
  }

  // Rows split at the given cut points (each piece one multiply call).
  std::vector<T> run(const std::vector<std::int64_t>& cuts) const {
    using K = lazy::detail::PackedGemm<T>;
    const auto pb = packed();
    std::vector<T> out(static_cast<std::size_t>(c.m * c.n), T(99));
    std::int64_t r0 = 0;
    auto piece = [&](std::int64_t r1) {
      if (r1 > r0)
        K::multiply(a.data(), c.ta, c.m, c.k, c.n, pb.data(), out.data() + r0 * c.n, r0, r1 - r0);
      r0 = std::max(r0, r1);
    };
    for (auto cut : cuts) piece(std::min(cut, c.m));
    piece(c.m);
    return out;
  }
};

template <class T>
class PackedGemmTyped : public ::testing::Test {};
using KernelTypes = ::testing::Types<float, double>;
TYPED_TEST_SUITE(PackedGemmTyped, KernelTypes);

TYPED_TEST(PackedGemmTyped, MatchesTripleLoopForEveryTransposeAndEdge) {
  using T = TypeParam;
  using K = lazy::detail::PackedGemm<T>;
  const std::int64_t tr = K::kTileRows, tc = K::kTileCols;
  // Exact tiles, one past and one short of them, a depth of one, and depths that take
  // several depth blocks on every instruction set.
  const std::vector<std::tuple<std::int64_t, std::int64_t, std::int64_t>> shapes = {
      {tr, 5, tc},        {tr + 1, 17, tc - 1},  {2 * tr - 1, 1, tc + 1},   {3 * tr, 64, 3 * tc},
      {tr + 3, 1025, tc}, {7, 1500, 2 * tc + 5}, {2 * tr, 2100, K::kLanes}, {1, 3, 1}};
  unsigned seed = 1;
  for (auto [m, k, n] : shapes)
    for (int t = 0; t < 4; ++t) {
      const Problem<T> p(GemmCase{m, k, n, (t & 1) != 0, (t & 2) != 0}, seed += 2);
      const auto got = p.run({});
      const std::string what = std::to_string(m) + "x" + std::to_string(k) + "x" +
                               std::to_string(n) + " ta=" + std::to_string(t & 1) +
                               " tb=" + std::to_string((t & 2) >> 1);
      for (std::int64_t i = 0; i < m; ++i)
        for (std::int64_t j = 0; j < n; ++j) {
          long double s = 0, mag = 0;
          for (std::int64_t q = 0; q < k; ++q) {
            const long double x =
                static_cast<long double>(p.at(i, q)) * static_cast<long double>(p.bt(q, j));
            s += x;
            mag += std::fabs(x);
          }
          const double tol =
              (4 + 2 * std::sqrt(double(k))) * std::numeric_limits<T>::epsilon() * double(mag);
          ASSERT_NEAR(got[i * n + j], double(s), tol) << what << " at (" << i << ", " << j << ")";
        }
    }
}

TYPED_TEST(PackedGemmTyped, RowSplitsGiveTheSameBits) {
  using T = TypeParam;
  using K = lazy::detail::PackedGemm<T>;
  for (const GemmCase c : {GemmCase{61, 300, 2 * K::kTileCols + 3, false, true},
                       GemmCase{45, 1300, K::kLanes + 1, true, false}}) {
    const Problem<T> p(c, 42);
    const auto whole = p.run({});
    // Cuts inside register tiles, at odd rows and at tile boundaries.
    for (const auto& cuts : std::vector<std::vector<std::int64_t>>{
             {1}, {5, 13}, {K::kTileRows, 3 * K::kTileRows + 1}}) {
      const auto split = p.run(cuts);
      ASSERT_EQ(std::memcmp(whole.data(), split.data(), whole.size() * sizeof(T)), 0)
          << "rows split at " << cuts.front() << " changed the bits";
    }
  }
}

TYPED_TEST(PackedGemmTyped, PackedPanelsArePaddedWithZeros) {
  using T = TypeParam;
  using K = lazy::detail::PackedGemm<T>;
  for (bool tb : {false, true}) {
    const Problem<T> p(GemmCase{1, 9, K::kTileCols + 3, false, tb}, 7);
    const auto pb = p.packed();
    // Panel 1 holds columns [kTileCols, kTileCols + 3) and zeros after them.
    const T* panel = pb.data() + 1 * p.c.k * K::kTileCols;
    for (std::int64_t q = 0; q < p.c.k; ++q)
      for (std::int64_t j = 0; j < K::kTileCols; ++j) {
        const T want = j < 3 ? p.bt(q, K::kTileCols + j) : T(0);
        ASSERT_EQ(panel[q * K::kTileCols + j], want) << "tb=" << tb << " k=" << q << " col " << j;
      }
  }
}

TYPED_TEST(PackedGemmTyped, PackingPanelRangesWritesOnlyThoseAndMatchesWholePacking) {
  using T = TypeParam;
  using K = lazy::detail::PackedGemm<T>;
  // Four panels, the last one partial; packed whole, and in ranges as the threads of
  // matmul do (a range leaves the other panels untouched).
  for (bool tb : {false, true}) {
    const Problem<T> p(GemmCase{1, 19, 3 * K::kTileCols + 3, false, tb}, 11);
    const auto whole = p.packed();
    const std::int64_t panel = p.c.k * K::kTileCols;
    AlignedVec<T> pieces(whole.size(), T(-7));
    for (auto [p0, p1] : {std::pair<std::int64_t, std::int64_t>{0, 1}, {1, 3}, {3, 4}}) {
      K::pack_b(p.b.data(), tb, p.c.k, p.c.n, pieces.data(), p0, p1);
      for (std::int64_t i = p1 * panel; i < static_cast<std::int64_t>(pieces.size()); ++i)
        ASSERT_EQ(pieces[static_cast<std::size_t>(i)], T(-7))
            << "tb=" << tb << " range " << p0 << ".." << p1;
    }
    ASSERT_EQ(std::memcmp(whole.data(), pieces.data(), whole.size() * sizeof(T)), 0) << "tb=" << tb;
  }
}

TEST(PackedGemm, ShapesDecideTheKernel) {
  using K = lazy::detail::PackedGemm<float>;
  EXPECT_TRUE(K::suits(K::kTileRows, K::kLanes));
  EXPECT_FALSE(K::suits(K::kTileRows - 1, 1024));  // too few rows for a tile
  EXPECT_FALSE(K::suits(1024, K::kLanes - 1));     // narrower than a register
}

TYPED_TEST(PackedGemmTyped, DepthBlocksKeepAPanelOfBAndATileOfRowsInL1AndSplitEvenly) {
  using T = TypeParam;
  using K = lazy::detail::PackedGemm<T>;
  const std::int64_t esize = std::int64_t(sizeof(T));
  // Values of k per pass: a packed panel of op(B) within 16 KiB, a packed row of A within
  // 4 KiB.
  const std::int64_t bound = std::min<std::int64_t>(16 * 1024 / (K::kTileCols * esize), 4096 / esize);
  EXPECT_LE(bound * K::kTileCols * esize, 16 * 1024);
  EXPECT_GE(bound, 128);  // the widest tile (AVX-512, 2 x 64 bytes) still gets 128
  for (const std::int64_t k : {1, 2, 99, 127, 128, 129, 255, 256, 257, 511, 512, 513, 784, 1024, 1025, 2100, 5000}) {
    const std::int64_t kc = K::depth_block(k), passes = (k + kc - 1) / kc;
    const std::int64_t fewest = (k + bound - 1) / bound;
    EXPECT_LE(kc, bound) << "k=" << k;
    EXPECT_EQ(passes, fewest) << "k=" << k;  // no more passes than the L1 bounds need
    EXPECT_LE(passes * kc - k, 2 * passes) << "k=" << k;  // even split: the last pass is not a sliver
    if (passes > 1) {
      EXPECT_EQ(kc % 2, 0) << "k=" << k;  // whole pairs for the bfloat16 kernel
    }
  }
}

}  // namespace
