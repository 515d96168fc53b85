// GEMM at the MLP step's shapes (784-256-128-10, batch 256), one thread, float and double:
//
//   BM_Gemm_Lazy<T>/s     lazy::matmul on device tensors + mark_step (what a program runs:
//                         graph, plan, packing, kernel)
//   BM_Gemm_Kernel<T>/s   the packed kernel alone (pack op(B), multiply), no graph
//   BM_Gemm_Blas<T>/s     sgemm_/dgemm_ of the BLAS libtorch loads (OpenBLAS with
//                         libopenblas0-pthread), 1 thread (LAZYTENSOR_HAVE_TORCH)
//   BM_Gemm_Eigen<T>/s    Eigen's GEMM on row-major maps, preallocated result
//   BM_Gemm_LazyBF16/s    float tensors under lazy::AutocastGuard: the bfloat16 GEMM
//                         (graph/gemm_kernel_bf16.hpp; native with AVX512-BF16, emulated
//                         at the float rate elsewhere)
//   BM_Gemm_LazyBF16Passes/s  the same arithmetic by passes over whole tensors (operands
//                         rounded, a float GEMM, the result rounded): the conversion the
//                         bfloat16 GEMM folds into its packing
//   BM_Gemm_KernelBF16/s  the bfloat16 kernel alone (pack with rounding, multiply)
//   BM_FmaPeak<T>         the core's FMA rate: independent FMA chains on the widest
//                         registers the build allows (the ceiling every GEMM row is read
//                         against)
//   BM_Bf16DotPeak        the same for vdpbf16ps (4 flops per float lane), where the build
//                         has AVX512-BF16: the native bfloat16 GEMM's ceiling, and what
//                         decides which path it takes (graph/gemm_kernel_bf16.hpp)
//
// s indexes kShapes (m x k x n, which operand is read transposed). The GFLOP counter is the
// rate of 2*m*k*n flops.

#include "bench_common.hpp"

#include <array>
#include <type_traits>

#include <Eigen/Core>
#include <xsimd/xsimd.hpp>

#ifdef LAZYTENSOR_HAVE_TORCH
#include <dlfcn.h>

#include "torch_threads.hpp"
#endif

namespace {

struct GemmShape {
  std::int64_t m, k, n;
  bool ta, tb;  // op(A) stored k x m / op(B) stored n x k
  const char* role;
};

// Forward layers read the weight [out, in] transposed; the backward's weight gradients read
// the activations transposed; the input gradients multiply plainly.
constexpr std::array<GemmShape, 6> kShapes{{
    {256, 784, 256, false, true, "fc1 forward: x @ w1^T"},
    {256, 256, 128, false, true, "fc2 forward: h1 @ w2^T"},
    {256, 128, 256, false, false, "fc2 input gradient: g2 @ w2"},
    {256, 256, 784, true, false, "fc1 weight gradient: g1^T @ x"},
    {784, 256, 256, true, false, "fc1 weight gradient, transposed: x^T @ g1"},
    {128, 256, 256, true, false, "fc2 weight gradient: g2^T @ h1"},
}};

const GemmShape& shape_of(const benchmark::State& state) { return kShapes.at(static_cast<std::size_t>(state.range(0))); }

void set_counters(benchmark::State& state, const GemmShape& s) {
  state.counters["GFLOP"] = benchmark::Counter(2.0 * static_cast<double>(s.m * s.k * s.n) / 1e9,
                                                 benchmark::Counter::kIsIterationInvariantRate);
  state.SetLabel(s.role);
}

template <class T>
std::vector<T> values(std::int64_t n, unsigned seed) {
  const auto f = bench::random_vector(n, seed);
  return std::vector<T>(f.begin(), f.end());
}

// The product by a plain triple loop in double (the self-check's reference).
// (with the operands rounded to bfloat16 first when `bf16`).
template <class T>
std::vector<double> reference(const GemmShape& s, const std::vector<T>& a, const std::vector<T>& b, bool bf16) {
  auto value = [bf16](T v) { return bf16 ? double(float(lazy::bfloat16(float(v)))) : double(v); };
  std::vector<double> c(static_cast<std::size_t>(s.m * s.n), 0.0);
  for (std::int64_t i = 0; i < s.m; ++i)
    for (std::int64_t q = 0; q < s.k; ++q) {
      const double x = value(s.ta ? a[q * s.m + i] : a[i * s.k + q]);
      for (std::int64_t j = 0; j < s.n; ++j) c[i * s.n + j] += x * value(s.tb ? b[j * s.k + q] : b[q * s.n + j]);
    }
  return c;
}

// Within float rounding of the reference, or within bfloat16 rounding of the result.
template <class T>
bool self_check(benchmark::State& state, const GemmShape& s, const std::vector<T>& a, const std::vector<T>& b,
                const T* c, const char* who, bool bf16 = false) {
  const auto want = reference(s, a, b, bf16);
  return bench::check(state, bench::max_rel_diff(c, want.data(), s.m * s.n) < (bf16 ? 1e-2 : 1e-3), who);
}

// How the lazy variants multiply: as T; under autocast (the bfloat16 GEMM); or as autocast
// did before the bfloat16 GEMM, by passes over whole tensors (operands rounded to bfloat16,
// a float GEMM, the result rounded).
enum class Mode { Plain, Bf16, Bf16Passes };

template <class T, Mode kMode = Mode::Plain>
void BM_Gemm_Lazy(benchmark::State& state) {
  const GemmShape& s = shape_of(state);
  constexpr bool kBf16 = kMode != Mode::Plain;
  lazy::AutocastGuard bf16(kMode == Mode::Bf16);
  bench::DeviceThreads guard(1);
  const auto av = values<T>(s.m * s.k, 1), bv = values<T>(s.k * s.n, 2);
  const auto a = lazy::from_vector<T>(av, s.ta ? lazy::Shape{s.k, s.m} : lazy::Shape{s.m, s.k});
  const auto b = lazy::from_vector<T>(bv, s.tb ? lazy::Shape{s.n, s.k} : lazy::Shape{s.k, s.n});
  auto product = [&]() -> lazy::Tensor<T> {
    if constexpr (kMode == Mode::Bf16Passes) {
      using lazy::detail::round_to_bf16;
      const lazy::Tensor<T> ra = round_to_bf16(a), rb = round_to_bf16(b);
      return round_to_bf16(lazy::matmul(s.ta ? lazy::transpose(ra, 0, 1) : ra, s.tb ? lazy::transpose(rb, 0, 1) : rb));
    } else {
      return lazy::matmul(s.ta ? lazy::transpose(a, 0, 1) : a, s.tb ? lazy::transpose(b, 0, 1) : b);
    }
  };
  {
    lazy::Tensor<T> c = product();
    lazy::mark_step();
    if (!self_check(state, s, av, bv, c.data(), "lazy matmul", kBf16)) return;
  }
  for (auto _ : state) {
    lazy::Tensor<T> c = product();
    lazy::mark_step();
    lazy::wait_device_ops();
    benchmark::DoNotOptimize(c.node().get());
    benchmark::ClobberMemory();
  }
  set_counters(state, s);
}

template <class T, class K = lazy::detail::PackedGemm<T>>
void BM_Gemm_Kernel(benchmark::State& state) {
  constexpr bool kBf16 = std::is_same_v<K, lazy::detail::Bf16Gemm>;
  const GemmShape& s = shape_of(state);
  const auto a = values<T>(s.m * s.k, 1), b = values<T>(s.k * s.n, 2);
  std::vector<unsigned char, xsimd::aligned_allocator<unsigned char, 64>> packed;
  if constexpr (kBf16) {
    packed.resize(static_cast<std::size_t>(K::packed_bytes(s.k, s.n)));
  } else {
    packed.resize(static_cast<std::size_t>(K::packed_size(s.k, s.n)) * sizeof(T));
  }
  std::vector<T> c(static_cast<std::size_t>(s.m * s.n));
  auto run = [&] {
    if constexpr (kBf16) {
      K::pack_b(b.data(), s.tb, s.k, s.n, packed.data(), 0, K::panels(s.n));
    } else {
      K::pack_b(b.data(), s.tb, s.k, s.n, reinterpret_cast<T*>(packed.data()), 0, K::panels(s.n));
    }
    K::multiply(a.data(), s.ta, s.m, s.k, s.n, reinterpret_cast<const T*>(packed.data()), c.data(), 0, s.m);
  };
  run();
  if (!self_check(state, s, a, b, c.data(), "packed kernel", kBf16)) return;
  for (auto _ : state) {
    run();
    benchmark::DoNotOptimize(c.data());
    benchmark::ClobberMemory();
  }
  set_counters(state, s);
}

template <class T>
void BM_Gemm_Eigen(benchmark::State& state) {
  using Mat = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  const GemmShape& s = shape_of(state);
  const auto av = values<T>(s.m * s.k, 1), bv = values<T>(s.k * s.n, 2);
  Eigen::Map<const Mat> A(av.data(), s.ta ? s.k : s.m, s.ta ? s.m : s.k);
  Eigen::Map<const Mat> B(bv.data(), s.tb ? s.n : s.k, s.tb ? s.k : s.n);
  Mat C(s.m, s.n);
  auto run = [&] {
    if (s.ta && s.tb) C.noalias() = A.transpose() * B.transpose();
    else if (s.ta) C.noalias() = A.transpose() * B;
    else if (s.tb) C.noalias() = A * B.transpose();
    else C.noalias() = A * B;
  };
  run();
  if (!self_check(state, s, av, bv, C.data(), "Eigen")) return;
  for (auto _ : state) {
    run();
    benchmark::DoNotOptimize(C.data());
    benchmark::ClobberMemory();
  }
  set_counters(state, s);
}

#ifdef LAZYTENSOR_HAVE_TORCH
// Fortran BLAS, column-major: a row-major C = op(A) op(B) is the column-major
// C^T = op(B)^T op(A)^T, so the operands swap and each keeps its own transpose flag.
template <class T>
using GemmFn = void (*)(const char*, const char*, const int*, const int*, const int*, const T*, const T*,
                        const int*, const T*, const int*, const T*, T*, const int*);

template <class T>
void BM_Gemm_Blas(benchmark::State& state) {
  const GemmShape& s = shape_of(state);
  bench::set_torch_threads(1, 1);
  (void)torch::ones({1});  // libtorch's BLAS loaded
  auto gemm = reinterpret_cast<GemmFn<T>>(dlsym(RTLD_DEFAULT, std::is_same_v<T, float> ? "sgemm_" : "dgemm_"));
  if (!bench::check(state, gemm != nullptr, "no BLAS gemm loaded")) return;
  state.SetLabel(bench::torch_blas_info());
  const auto a = values<T>(s.m * s.k, 1), b = values<T>(s.k * s.n, 2);
  std::vector<T> c(static_cast<std::size_t>(s.m * s.n));
  const int m = int(s.m), n = int(s.n), k = int(s.k);
  const int lda = s.ta ? m : k, ldb = s.tb ? k : n;
  const char tra = s.tb ? 'T' : 'N', trb = s.ta ? 'T' : 'N';
  const T one = 1, zero = 0;
  auto run = [&] { gemm(&tra, &trb, &n, &m, &k, &one, b.data(), &ldb, a.data(), &lda, &zero, c.data(), &n); };
  run();
  if (!self_check(state, s, a, b, c.data(), "BLAS")) return;
  for (auto _ : state) {
    run();
    benchmark::DoNotOptimize(c.data());
    benchmark::ClobberMemory();
  }
  set_counters(state, s);
}
#endif

// Independent FMA chains, enough of them to cover the FMA latency on two pipes (the
// counter is the core's peak flop rate for T at the build's widest registers).
template <class T>
void BM_FmaPeak(benchmark::State& state) {
  using batch = xsimd::batch<T>;
  constexpr int kChains = 12;
  constexpr std::int64_t kSteps = 1 << 16;
  batch acc[kChains];
  for (int i = 0; i < kChains; ++i) acc[i] = batch(T(i));
  const batch x(T(0.999999)), y(T(1e-7));
  for (auto _ : state) {
    for (std::int64_t s = 0; s < kSteps; ++s) {
      for (int i = 0; i < kChains; ++i) acc[i] = xsimd::fma(acc[i], x, y);
    }
    for (int i = 0; i < kChains; ++i) benchmark::DoNotOptimize(acc[i]);
  }
  state.counters["GFLOP"] = benchmark::Counter(2.0 * kChains * kSteps * batch::size / 1e9,
                                                 benchmark::Counter::kIsIterationInvariantRate);
  state.SetLabel(xsimd::default_arch::name());
}

#if defined(__AVX512BF16__)
void BM_Bf16DotPeak(benchmark::State& state) {
  constexpr int kChains = 24;  // vdpbf16ps's latency is twice the FMA's on some cores
  constexpr std::int64_t kSteps = 1 << 15;
  __m512 acc[kChains];
  for (int i = 0; i < kChains; ++i) acc[i] = _mm512_set1_ps(float(i));
  const __m512bh x = (__m512bh)_mm512_set1_epi32(0x3f803f7f);  // NOLINT: a vector bit cast
  for (auto _ : state) {
    for (std::int64_t s = 0; s < kSteps; ++s) {
      for (int i = 0; i < kChains; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], x, x);
    }
    for (int i = 0; i < kChains; ++i) benchmark::DoNotOptimize(acc[i]);
  }
  state.counters["GFLOP"] =
      benchmark::Counter(4.0 * kChains * kSteps * 16 / 1e9, benchmark::Counter::kIsIterationInvariantRate);
  state.SetLabel(lazy::detail::Bf16Gemm::native() ? "GEMM path: native" : "GEMM path: emulated");
}
#endif

void shapes(benchmark::internal::Benchmark* b) {
  for (std::size_t i = 0; i < kShapes.size(); ++i) b->Arg(static_cast<std::int64_t>(i));
  b->UseRealTime();
}

void BM_Gemm_LazyBF16(benchmark::State& state) { BM_Gemm_Lazy<float, Mode::Bf16>(state); }
void BM_Gemm_LazyBF16Passes(benchmark::State& state) { BM_Gemm_Lazy<float, Mode::Bf16Passes>(state); }
void BM_Gemm_KernelBF16(benchmark::State& state) { BM_Gemm_Kernel<float, lazy::detail::Bf16Gemm>(state); }

}  // namespace

BENCHMARK(BM_FmaPeak<float>)->UseRealTime();
BENCHMARK(BM_FmaPeak<double>)->UseRealTime();
#if defined(__AVX512BF16__)
BENCHMARK(BM_Bf16DotPeak)->UseRealTime();
#endif
BENCHMARK(BM_Gemm_Lazy<float>)->Apply(shapes);
BENCHMARK(BM_Gemm_Kernel<float>)->Apply(shapes);
BENCHMARK(BM_Gemm_Eigen<float>)->Apply(shapes);
#ifdef LAZYTENSOR_HAVE_TORCH
BENCHMARK(BM_Gemm_Blas<float>)->Apply(shapes);
#endif
BENCHMARK(BM_Gemm_LazyBF16)->Apply(shapes);
BENCHMARK(BM_Gemm_LazyBF16Passes)->Apply(shapes);
BENCHMARK(BM_Gemm_KernelBF16)->Apply(shapes);
BENCHMARK(BM_Gemm_Lazy<double>)->Apply(shapes);
BENCHMARK(BM_Gemm_Kernel<double>)->Apply(shapes);
BENCHMARK(BM_Gemm_Eigen<double>)->Apply(shapes);
#ifdef LAZYTENSOR_HAVE_TORCH
BENCHMARK(BM_Gemm_Blas<double>)->Apply(shapes);
#endif

BENCHMARK_MAIN();
