// Ordering, cumulative and scatter ops against libtorch, one thread each, float:
//
//   BM_Sort_{Lazy,Torch}/R/N          sort of R rows of N along the last dim (values + indices)
//   BM_Topk_{Lazy,Torch}/R/N          topk(10) of R rows of N along the last dim
//   BM_Cumsum_{Lazy,Torch}/N/D        cumsum of an N x N matrix along dim D
//   BM_ScatterAdd_{Lazy,Torch}/N      scatter_add of N x 64 values into 1024 x 64 rows (dim 0)
//
// Each lazy iteration builds the statement and runs it (mark_step); each libtorch one runs
// the eager op. Inputs are made once, outside the timed loop.

#include "bench_common.hpp"

#include <lazytensor/ops/scan.hpp>
#include <lazytensor/ops/scatter.hpp>
#include <lazytensor/ops/sort.hpp>

#ifdef LAZYTENSOR_HAVE_TORCH
#include <torch/torch.h>
#endif

namespace {

std::vector<std::int64_t> row_indices(std::int64_t n, std::int64_t rows) {
  std::vector<std::int64_t> v(static_cast<std::size_t>(n));
  std::uint64_t s = 88172645463325252ull;
  for (auto& x : v) {
    s ^= s << 13, s ^= s >> 7, s ^= s << 17;
    x = static_cast<std::int64_t>(s % static_cast<std::uint64_t>(rows));
  }
  return v;
}

void BM_Sort_Lazy(benchmark::State& state) {
  bench::DeviceThreads guard(1);
  const std::int64_t r = state.range(0), n = state.range(1);
  const auto x = lazy::from_vector<float>(bench::random_vector(r * n, 1), lazy::Shape{r, n});
  for (auto _ : state) {
    auto [v, i] = lazy::sort(x, -1);
    lazy::mark_step();
    benchmark::DoNotOptimize(v.data());
  }
  state.SetItemsProcessed(state.iterations() * r * n);
}

void BM_Topk_Lazy(benchmark::State& state) {
  bench::DeviceThreads guard(1);
  const std::int64_t r = state.range(0), n = state.range(1);
  const auto x = lazy::from_vector<float>(bench::random_vector(r * n, 2), lazy::Shape{r, n});
  for (auto _ : state) {
    auto [v, i] = lazy::topk(x, 10, -1);
    lazy::mark_step();
    benchmark::DoNotOptimize(v.data());
  }
  state.SetItemsProcessed(state.iterations() * r * n);
}

void BM_Cumsum_Lazy(benchmark::State& state) {
  bench::DeviceThreads guard(1);
  const std::int64_t n = state.range(0), d = state.range(1);
  const auto x = lazy::from_vector<float>(bench::random_vector(n * n, 3), lazy::Shape{n, n});
  for (auto _ : state) {
    lazy::Tensor<float> c = lazy::cumsum(x, d);
    lazy::mark_step();
    benchmark::DoNotOptimize(c.data());
  }
  state.SetItemsProcessed(state.iterations() * n * n);
}

void BM_ScatterAdd_Lazy(benchmark::State& state) {
  bench::DeviceThreads guard(1);
  const std::int64_t n = state.range(0), cols = 64, rows = 1024;
  const auto self = lazy::zeros<float>(lazy::Shape{rows, cols});
  const auto src = lazy::from_vector<float>(bench::random_vector(n * cols, 4), lazy::Shape{n, cols});
  std::vector<std::int64_t> idx;
  for (std::int64_t r : row_indices(n, rows)) idx.insert(idx.end(), cols, r);
  const auto index = lazy::from_vector<std::int64_t>(idx, lazy::Shape{n, cols});
  for (auto _ : state) {
    lazy::Tensor<float> s = lazy::scatter_add(self, 0, index, src);
    lazy::mark_step();
    benchmark::DoNotOptimize(s.data());
  }
  state.SetItemsProcessed(state.iterations() * n * cols);
}

#ifdef LAZYTENSOR_HAVE_TORCH
torch::Tensor torch_matrix(std::int64_t r, std::int64_t n, unsigned seed) {
  auto v = bench::random_vector(r * n, seed);
  return torch::from_blob(v.data(), {r, n}).clone();
}

void BM_Sort_Torch(benchmark::State& state) {
  at::set_num_threads(1);
  const std::int64_t r = state.range(0), n = state.range(1);
  const auto x = torch_matrix(r, n, 1);
  for (auto _ : state) {
    auto [v, i] = torch::sort(x, -1);
    benchmark::DoNotOptimize(v.data_ptr());
  }
  state.SetItemsProcessed(state.iterations() * r * n);
}

void BM_Topk_Torch(benchmark::State& state) {
  at::set_num_threads(1);
  const std::int64_t r = state.range(0), n = state.range(1);
  const auto x = torch_matrix(r, n, 2);
  for (auto _ : state) {
    auto [v, i] = torch::topk(x, 10, -1);
    benchmark::DoNotOptimize(v.data_ptr());
  }
  state.SetItemsProcessed(state.iterations() * r * n);
}

void BM_Cumsum_Torch(benchmark::State& state) {
  at::set_num_threads(1);
  const std::int64_t n = state.range(0), d = state.range(1);
  const auto x = torch_matrix(n, n, 3);
  for (auto _ : state) {
    auto c = torch::cumsum(x, d);
    benchmark::DoNotOptimize(c.data_ptr());
  }
  state.SetItemsProcessed(state.iterations() * n * n);
}

void BM_ScatterAdd_Torch(benchmark::State& state) {
  at::set_num_threads(1);
  const std::int64_t n = state.range(0), cols = 64, rows = 1024;
  const auto self = torch::zeros({rows, cols});
  const auto src = torch_matrix(n, cols, 4);
  std::vector<std::int64_t> idx;
  for (std::int64_t r : row_indices(n, rows)) idx.insert(idx.end(), cols, r);
  const auto index = torch::from_blob(idx.data(), {n, cols}, torch::kLong).clone();
  for (auto _ : state) {
    auto s = self.scatter_add(0, index, src);
    benchmark::DoNotOptimize(s.data_ptr());
  }
  state.SetItemsProcessed(state.iterations() * n * cols);
}
#endif

void rows_args(benchmark::internal::Benchmark* b) {
  b->Args({1000, 1000})->Args({10, 100000})->UseRealTime();
}
void cumsum_args(benchmark::internal::Benchmark* b) {
  b->Args({1024, 0})->Args({1024, 1})->UseRealTime();
}

}  // namespace

BENCHMARK(BM_Sort_Lazy)->Apply(rows_args);
BENCHMARK(BM_Topk_Lazy)->Apply(rows_args);
BENCHMARK(BM_Cumsum_Lazy)->Apply(cumsum_args);
BENCHMARK(BM_ScatterAdd_Lazy)->Arg(4096)->Arg(65536)->UseRealTime();
#ifdef LAZYTENSOR_HAVE_TORCH
BENCHMARK(BM_Sort_Torch)->Apply(rows_args);
BENCHMARK(BM_Topk_Torch)->Apply(rows_args);
BENCHMARK(BM_Cumsum_Torch)->Apply(cumsum_args);
BENCHMARK(BM_ScatterAdd_Torch)->Arg(4096)->Arg(65536)->UseRealTime();
#endif

BENCHMARK_MAIN();
