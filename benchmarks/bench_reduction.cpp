// Fused map-reduce: sum((a - b)^2) over N floats, read back as a host float.
//
//   BM_Reduce_Lazy/N          lazy::sum(lazy::square(a-b)).item(), 1 thread (build + run + read)
//   BM_Reduce_Eigen/N         ((a-b).square()).sum()
//   BM_Reduce_Torch/N         torch::square(a-b).sum(), 1 thread (LAZYTENSOR_HAVE_TORCH)
//
// Every variant squares with its library's square (one evaluation of a - b per element).
//   BM_Reduce_LazyThreads/N/T lazytensor with T device threads
//
// Bytes processed: 2 arrays x 4 bytes x N per iteration.

#include "bench_common.hpp"

#include <Eigen/Core>

#ifdef LAZYTENSOR_HAVE_TORCH
#include <torch/torch.h>
#endif

namespace {

void set_bytes(benchmark::State& state, std::int64_t n) {
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) * 2 * 4 * n);
}

double reference(const std::vector<float>& a, const std::vector<float>& b) {
  double s = 0;
  for (std::size_t i = 0; i < a.size(); ++i) s += double(a[i] - b[i]) * double(a[i] - b[i]);
  return s;
}

void run_lazy(benchmark::State& state, std::int64_t n, int threads) {
  bench::DeviceThreads guard(threads);
  const auto va = bench::random_vector(n, 1), vb = bench::random_vector(n, 2);
  const auto a = lazy::from_vector<float>(va), b = lazy::from_vector<float>(vb);
  {
    const double want = reference(va, vb);
    const float got = lazy::sum(lazy::square(a - b)).item();
    if (!bench::check(state, std::abs(got - want) <= 1e-4 * want, "lazy sum value")) return;
  }
  for (auto _ : state) {
    lazy::Tensor<float> s = lazy::sum(lazy::square(a - b));
    float v = s.item();
    benchmark::DoNotOptimize(v);
  }
  set_bytes(state, n);
}

void BM_Reduce_Lazy(benchmark::State& state) { run_lazy(state, state.range(0), 1); }
void BM_Reduce_LazyThreads(benchmark::State& state) {
  run_lazy(state, state.range(0), static_cast<int>(state.range(1)));
}

void BM_Reduce_Eigen(benchmark::State& state) {
  const std::int64_t n = state.range(0);
  const auto va = bench::random_vector(n, 1), vb = bench::random_vector(n, 2);
  const Eigen::ArrayXf a = Eigen::Map<const Eigen::ArrayXf>(va.data(), n),
                       b = Eigen::Map<const Eigen::ArrayXf>(vb.data(), n);
  for (auto _ : state) {
    float v = ((a - b).square()).sum();
    benchmark::DoNotOptimize(v);
  }
  set_bytes(state, n);
}

#ifdef LAZYTENSOR_HAVE_TORCH
void BM_Reduce_Torch(benchmark::State& state) {
  const std::int64_t n = state.range(0);
  at::set_num_threads(1);
  auto va = bench::random_vector(n, 1), vb = bench::random_vector(n, 2);
  const torch::Tensor a = torch::from_blob(va.data(), {n}).clone(), b = torch::from_blob(vb.data(), {n}).clone();
  for (auto _ : state) {
    float v = torch::square(a - b).sum().item<float>();
    benchmark::DoNotOptimize(v);
  }
  set_bytes(state, n);
}
#endif

void sizes(benchmark::internal::Benchmark* b) {
  for (int p : {10, 16, 20, 24}) b->Arg(std::int64_t{1} << p);
  b->UseRealTime();
}

}  // namespace

BENCHMARK(BM_Reduce_Lazy)->Apply(sizes);
BENCHMARK(BM_Reduce_Eigen)->Apply(sizes);
#ifdef LAZYTENSOR_HAVE_TORCH
BENCHMARK(BM_Reduce_Torch)->Apply(sizes);
#endif
BENCHMARK(BM_Reduce_LazyThreads)->Args({std::int64_t{1} << 24, 1})->Args({std::int64_t{1} << 24, 2})->UseRealTime();

BENCHMARK_MAIN();
