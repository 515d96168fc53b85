// The packed GEMM (graph/gemm_kernel.hpp) compiled for one instruction-set level (the build
// compiles this file once per level the machine runs: x86-64, x86-64-v3, x86-64-v4; see
// tests/CMakeLists.txt). Its register tile depends on the level, so every remainder of a
// tile and of a depth block is checked against a long double triple loop, for both
// operand layouts and both element types.

#include <cmath>
#include <cpuid.h>
#include <cstdlib>
#include <cstdio>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <xsimd/xsimd.hpp>

#include <lazytensor/core/error.hpp>
#include <lazytensor/graph/gemm_kernel.hpp>
#include <lazytensor/graph/gemm_kernel_bf16.hpp>

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

// C = op(A) op(B) through the kernel (rows [0, split) and [split, m) in two calls when split
// is given), then every element against the triple loop.
template <class T>
void check(std::int64_t m, std::int64_t k, std::int64_t n, bool ta, bool tb, unsigned seed,
           std::int64_t split = 0) {
  using K = lazy::detail::PackedGemm<T>;
  const auto a = values<T>(m * k, seed), b = values<T>(k * n, seed + 1);
  Aligned<T> packed(static_cast<std::size_t>(K::packed_size(k, n)));
  K::pack_b(b.data(), tb, k, n, packed.data(), 0, K::panels(n));
  std::vector<T> c(static_cast<std::size_t>(m * n), T(-5));
  K::multiply(a.data(), ta, m, k, n, packed.data(), c.data(), 0, split);
  K::multiply(a.data(), ta, m, k, n, packed.data(), c.data() + split * n, split, m - split);
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
      for (const std::int64_t k : {1, 3, 17, 24, 129})
        for (int t = 0; t < 4; ++t) check<TypeParam>(m, k, n, t & 1, t & 2, seed += 2);
    }
  }
}

TYPED_TEST(GemmPerIsa, DepthsOfSeveralBlocks) {
  using K = lazy::detail::PackedGemm<TypeParam>;
  unsigned seed = 100;
  // Edge panels of every kind accumulate across the blocks: wider than one register, exactly
  // one (the one-register tile), and one column.
  for (const std::int64_t k : {127, 128, 129, 255, 256, 257, 513, 1025, 2100})
    for (const std::int64_t n : {2 * K::kTileCols + 3, 2 * K::kTileCols + K::kLanes, 2 * K::kTileCols + 1})
      for (int t = 0; t < 4; ++t) check<TypeParam>(K::kTileRows + 1, k, n, t & 1, t & 2, seed += 2);
}

TYPED_TEST(GemmPerIsa, RowsOfSeveralPackedBlocks) {
  // More rows than one packed block of A (block_rows): multiply runs them in chunks. The
  // second call starts inside a tile, so its chunks are offset from the first's.
  using K = lazy::detail::PackedGemm<TypeParam>;
  const std::int64_t k = 300, m = 1200, split = 137;
  ASSERT_GT(m - split, 2 * K::block_rows(k)) << "the rows must span several packed blocks";
  unsigned seed = 300;
  for (int t = 0; t < 4; ++t)
    check<TypeParam>(m, k, 2 * K::kTileCols + 3, t & 1, t & 2, seed += 2, split);
}

TEST(GemmPerIsaTile, FitsTheRegisterFile) {
  using K = lazy::detail::PackedGemm<float>;
  // Accumulators (rows x 2), two B registers and one broadcast.
  const int registers = XSIMD_WITH_AVX512F ? 32 : 16;
  EXPECT_LE(K::kTileRows * 2 + 3, registers);
  std::printf("instruction set %s: %d x %d float tile\n", xsimd::default_arch::name(), K::kTileRows, K::kTileCols);
}

}  // namespace

// --- The bfloat16 GEMM (graph/gemm_kernel_bf16.hpp) -----------------------------------------

namespace {

// bfloat16 rounding from its definition (nearest, ties to even, on the top 16 bits), for
// finite values.
float round_bf16(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
  float r;
  std::memcpy(&r, &u, 4);
  return r;
}

bool is_bf16(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  return (u & 0xffffu) == 0;
}

// C = op(A) op(B) through `K` (a bfloat16 GEMM): packs, multiplies rows in two calls.
template <class K>
std::vector<float> run_bf16(const std::vector<float>& a, const std::vector<float>& b, std::int64_t m, std::int64_t k,
                            std::int64_t n, bool ta, bool tb) {
  Aligned<unsigned char> packed(static_cast<std::size_t>(K::packed_bytes(k, n)));
  K::pack_b(b.data(), tb, k, n, packed.data(), 0, K::panels(n));
  std::vector<float> c(static_cast<std::size_t>(m * n), -5.0f);
  const std::int64_t split = m / 2;
  K::multiply(a.data(), ta, m, k, n, packed.data(), c.data(), 0, split);
  K::multiply(a.data(), ta, m, k, n, packed.data(), c.data() + split * n, split, m - split);
  return c;
}

// A bfloat16 GEMM (by default the path this process takes) against a double triple loop
// over the rounded operands: every result a bfloat16 value within one bfloat16 step of the
// rounded exact sum.
template <class K = lazy::detail::Bf16Gemm>
void check_bf16(std::int64_t m, std::int64_t k, std::int64_t n, bool ta, bool tb, unsigned seed) {
  const auto a = values<float>(m * k, seed), b = values<float>(k * n, seed + 1);
  const auto c = run_bf16<K>(a, b, m, k, n, ta, tb);
  for (std::int64_t i = 0; i < m; ++i) {
    for (std::int64_t j = 0; j < n; ++j) {
      double s = 0;
      for (std::int64_t q = 0; q < k; ++q)
        s += double(round_bf16(ta ? a[q * m + i] : a[i * k + q])) * double(round_bf16(tb ? b[j * k + q] : b[q * n + j]));
      const float got = c[i * n + j], want = round_bf16(float(s));
      ASSERT_TRUE(is_bf16(got)) << got;
      ASSERT_NEAR(got, want, std::abs(want) * 0x1p-7 + 1e-6f)
          << m << "x" << k << "x" << n << " ta=" << ta << " tb=" << tb << " at (" << i << ", " << j << ")";
    }
  }
}

template <class K = lazy::detail::Bf16Gemm>
void check_every_tile_remainder() {
  std::vector<std::int64_t> sizes;
  for (std::int64_t s = 1; s <= 17; ++s) sizes.push_back(s);
  for (std::int64_t s : {31, 33, 127, 129}) sizes.push_back(s);
  unsigned seed = 7;
  for (const std::int64_t m : sizes)
    for (const std::int64_t n : sizes)
      for (const std::int64_t k : {1, 2, 3, 17, 34, 129})
        for (int t = 0; t < 4; ++t) check_bf16<K>(m, k, n, t & 1, t & 2, seed += 2);
}

TEST(Bf16GemmPerIsa, EveryTileRemainder) {
  std::printf("bfloat16 GEMM: %s path\n", lazy::detail::Bf16Gemm::native() ? "native (vdpbf16ps)" : "emulated");
  check_every_tile_remainder();
}

// The path this process takes: LAZYTENSOR_NATIVE_BF16_GEMM when set (tests/CMakeLists.txt
// runs this program once more with each value), else the native one except on Intel cores
// (vendor read here with cpuid itself), and never the native one in a build without
// AVX512-BF16.
TEST(Bf16GemmPerIsa, PathFollowsTheSwitchOrTheCore) {
  const char* env = std::getenv("LAZYTENSOR_NATIVE_BF16_GEMM");
  const std::string set = env ? env : "";
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__)
  const bool on = set == "1" || set == "on" || set == "true", off = set == "0" || set == "off" || set == "false";
  if (on || off) {
    EXPECT_EQ(lazy::detail::Bf16Gemm::native(), on);
  } else if (!set.empty()) {
    try {
      (void)lazy::detail::Bf16Gemm::native();
      ADD_FAILURE() << "LAZYTENSOR_NATIVE_BF16_GEMM='" << set << "' was accepted";
    } catch (const lazy::Error& e) {
      EXPECT_NE(std::string(e.what()).find("LAZYTENSOR_NATIVE_BF16_GEMM='" + set + "'"), std::string::npos) << e.what();
    }
  } else {
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    ASSERT_TRUE(__get_cpuid(0, &eax, &ebx, &ecx, &edx));
    char vendor[13] = {};
    std::memcpy(vendor, &ebx, 4);
    std::memcpy(vendor + 4, &edx, 4);
    std::memcpy(vendor + 8, &ecx, 4);
    EXPECT_EQ(lazy::detail::Bf16Gemm::native(), std::string(vendor) != "GenuineIntel") << vendor;
  }
#else
  EXPECT_FALSE(lazy::detail::Bf16Gemm::native()) << "LAZYTENSOR_NATIVE_BF16_GEMM='" << set << "'";
#endif
}

TEST(Bf16GemmPerIsa, DepthsOfSeveralBlocks) {
  unsigned seed = 300;
  for (const std::int64_t k : {127, 128, 129, 255, 256, 257, 513, 1025, 2100})
    for (int t = 0; t < 4; ++t) check_bf16(9, k, 35, t & 1, t & 2, seed += 2);
}

TEST(Bf16GemmPerIsa, VectorRoundingMatchesTheScalarOne) {
  // Ties, carries into the exponent, infinities, NaNs, denormals and random bit patterns.
  std::vector<std::uint32_t> bits{0x3f808000u, 0x3f818000u, 0x3f80ffffu, 0x7f7fffffu, 0x7f800000u, 0xff800000u,
                                  0x7fc00000u, 0x7f800001u, 0xff800001u, 0x00000001u, 0x80008000u, 0x0000ffffu};
  std::mt19937 rng(11);
  for (int i = 0; i < 4096; ++i) bits.push_back(static_cast<std::uint32_t>(rng()));
  std::vector<float> x(bits.size()), y(bits.size());
  std::memcpy(x.data(), bits.data(), bits.size() * 4);
  lazy::detail::round_to_bf16(x.data(), y.data(), static_cast<std::int64_t>(x.size()));
  for (std::size_t i = 0; i < x.size(); ++i) {
    const std::uint16_t want = lazy::bfloat16(x[i]).bits;
    std::uint32_t got;
    std::memcpy(&got, &y[i], 4);
    ASSERT_EQ(got, std::uint32_t(want) << 16) << std::hex << bits[i];
  }
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__)
// The native path's layout and tiling with vdpbf16ps written out in AVX-512F (SoftBf16)
// agrees with the emulated path to the bit: same products, same order, same roundings.
TEST(Bf16GemmPerIsa, PairLayoutAgreesWithTheEmulationToTheBit) {
  using Pair = lazy::detail::PairBf16Gemm<lazy::detail::SoftBf16>;
  using Emulated = lazy::detail::EmulatedBf16Gemm;
  unsigned seed = 500;
  for (const std::int64_t m : {1, 7, 8, 9, 64, 70})
    for (const std::int64_t n : {1, 15, 16, 17, 32, 33, 100})
      for (const std::int64_t k : {1, 2, 3, 31, 32, 33, 1025})
        for (int t = 0; t < 4; ++t) {
          const auto a = values<float>(m * k, seed += 2), b = values<float>(k * n, seed + 1);
          const auto want = run_bf16<Emulated>(a, b, m, k, n, t & 1, t & 2);
          const auto got = run_bf16<Pair>(a, b, m, k, n, t & 1, t & 2);
          ASSERT_EQ(0, std::memcmp(got.data(), want.data(), got.size() * 4))
              << m << "x" << k << "x" << n << " t=" << t;
        }
}
#endif

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__)
// The native path whatever the core (the default takes it only where it is the faster).
TEST(Bf16GemmPerIsa, NativeEveryTileRemainder) { check_every_tile_remainder<lazy::detail::Bf16Gemm::Native>(); }

// vdpbf16ps itself against the emulation: the same sums (to one bfloat16 step, should a
// processor round its two products otherwise than Intel's definition).
TEST(Bf16GemmPerIsa, NativeAgreesWithTheEmulation) {
  using Native = lazy::detail::PairBf16Gemm<lazy::detail::NativeBf16>;
  using Emulated = lazy::detail::EmulatedBf16Gemm;
  unsigned seed = 900;
  int differing = 0, total = 0;
  for (const std::int64_t m : {8, 9, 64})
    for (const std::int64_t n : {16, 33, 100})
      for (const std::int64_t k : {1, 3, 32, 1025})
        for (int t = 0; t < 4; ++t) {
          const auto a = values<float>(m * k, seed += 2), b = values<float>(k * n, seed + 1);
          const auto want = run_bf16<Emulated>(a, b, m, k, n, t & 1, t & 2);
          const auto got = run_bf16<Native>(a, b, m, k, n, t & 1, t & 2);
          for (std::size_t i = 0; i < got.size(); ++i) {
            ASSERT_NEAR(got[i], want[i], std::abs(want[i]) * 0x1p-7 + 1e-6f) << m << "x" << k << "x" << n;
            differing += got[i] != want[i];
            ++total;
          }
        }
  std::printf("native vs emulated: %d of %d results differ (by one bfloat16 step at most)\n", differing, total);
}
#endif

}  // namespace
