// The packed GEMM (graph/gemm_kernel.hpp) compiled for one instruction-set level (the build
// compiles this file once per level the machine runs: x86-64, x86-64-v3, x86-64-v4; see
// tests/CMakeLists.txt). Its register tile depends on the level, so every remainder of a
// tile and of a depth block is checked against a long double triple loop, for both
// operand layouts and both element types.

#include <cmath>
#include <cstdio>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <xsimd/xsimd.hpp>

#include <lazytensor/graph/gemm_kernel.hpp>

namespace {

template <class T>
using Aligned = std::vector<T, xsimd::aligned_allocator<T, 64>>;

template <class T>
std::vector<T> values(std::int64_t n, unsigned seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<double> u(-1.0, 1.0);
  std::vector<T> v(static_cast<std::size_t>(n));
  for (auto& x : v) x = static_cast<T>(u(rng));
  return v;
}

// C = op(A) op(B) through the kernel, then every element against the triple loop.
template <class T>
void check(std::int64_t m, std::int64_t k, std::int64_t n, bool ta, bool tb, unsigned seed) {
  using K = lazy::detail::PackedGemm<T>;
  const auto a = values<T>(m * k, seed), b = values<T>(k * n, seed + 1);
  Aligned<T> packed(static_cast<std::size_t>(K::packed_size(k, n)));
  K::pack_b(b.data(), tb, k, n, packed.data(), 0, K::panels(n));
  std::vector<T> c(static_cast<std::size_t>(m * n), T(-5));
  K::multiply(a.data(), ta, m, k, n, packed.data(), c.data(), 0, m);
  for (std::int64_t i = 0; i < m; ++i) {
    for (std::int64_t j = 0; j < n; ++j) {
      long double s = 0, mag = 0;
      for (std::int64_t q = 0; q < k; ++q) {
        const long double x = static_cast<long double>(ta ? a[q * m + i] : a[i * k + q]) *
                              static_cast<long double>(tb ? b[j * k + q] : b[q * n + j]);
        s += x;
        mag += std::fabs(x);
      }
      const double tol = (4 + 2 * std::sqrt(double(k))) * std::numeric_limits<T>::epsilon() * double(mag);
      ASSERT_NEAR(c[i * n + j], double(s), tol) << m << "x" << k << "x" << n << " ta=" << ta << " tb=" << tb
                                                 << " at (" << i << ", " << j << ")";
    }
  }
}

template <class T>
class GemmPerIsa : public ::testing::Test {};
using Types = ::testing::Types<float, double>;
TYPED_TEST_SUITE(GemmPerIsa, Types);

TYPED_TEST(GemmPerIsa, EveryTileRemainder) {
  // Shapes matmul would send to Eigen (fewer rows than a tile, narrower than a register)
  // included: the kernel is exact for every shape.
  std::vector<std::int64_t> sizes;
  for (std::int64_t s = 1; s <= 17; ++s) sizes.push_back(s);
  for (std::int64_t s : {127, 128, 129}) sizes.push_back(s);
  unsigned seed = 1;
  for (const std::int64_t m : sizes) {
    for (const std::int64_t n : sizes) {
      for (const std::int64_t k : {1, 3, 17, 129})
        for (int t = 0; t < 4; ++t) check<TypeParam>(m, k, n, t & 1, t & 2, seed += 2);
    }
  }
}

TYPED_TEST(GemmPerIsa, DepthsOfSeveralBlocks) {
  using K = lazy::detail::PackedGemm<TypeParam>;
  unsigned seed = 100;
  for (const std::int64_t k : {1023, 1024, 1025, 2100})
    for (int t = 0; t < 4; ++t) check<TypeParam>(K::kTileRows + 1, k, 2 * K::kTileCols + 3, t & 1, t & 2, seed += 2);
}

TEST(GemmPerIsaTile, FitsTheRegisterFile) {
  using K = lazy::detail::PackedGemm<float>;
  // Accumulators (rows x 2), two B registers and one broadcast.
  const int registers = XSIMD_WITH_AVX512F ? 32 : 16;
  EXPECT_LE(K::kTileRows * 2 + 3, registers);
  std::printf("instruction set %s: %d x %d float tile\n", xsimd::default_arch::name(), K::kTileRows, K::kTileCols);
}

}  // namespace
