// A dense layer with ReLU: relu(x @ w^T + b), batch 256, 784 -> 256.
//
//   BM_Linear_Lazy/256          lazy::relu(lazy::linear(x, w, b)), 1 thread: GEMM with the
//                               bias + relu epilogue fused on its row blocks
//   BM_Linear_EigenSeq/256      Eigen: Y.noalias() = X * W^T, then a bias pass, then a relu
//                               pass (preallocated Y, row-major maps)
//   BM_Linear_Torch/256         libtorch relu(linear(x, w, b)), 1 thread (LAZYTENSOR_HAVE_TORCH)
//   BM_Linear_LazyUnfused/256   lazytensor with the GEMM result held by a handle, so the
//                               epilogue cannot be fused (shows what the fusion buys)
//   BM_Linear_LazyThreads/256/T lazytensor with T device threads
//
// items/s counts input rows (samples); the GFLOP counter (shown as GFLOP=x/s) is the rate of
// the GEMM's 2*M*K*N flops.

#include "bench_common.hpp"

#include <Eigen/Core>

#ifdef LAZYTENSOR_HAVE_TORCH
#include <torch/torch.h>

#include "torch_threads.hpp"
#endif

namespace {

constexpr std::int64_t kIn = 784, kOut = 256;

void set_counters(benchmark::State& state, std::int64_t batch) {
  state.SetItemsProcessed(static_cast<std::int64_t>(state.iterations()) * batch);
  state.counters["GFLOP"] = benchmark::Counter(2.0 * static_cast<double>(batch * kIn * kOut) / 1e9,
                                                 benchmark::Counter::kIsIterationInvariantRate);
}

struct Data {
  std::vector<float> x, w, b;
  explicit Data(std::int64_t batch)
      : x(bench::random_vector(batch * kIn, 1)), w(bench::random_vector(kOut * kIn, 2)),
        b(bench::random_vector(kOut, 3)) {}
};

using RowMat = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

RowMat eigen_reference(const Data& d, std::int64_t batch) {
  Eigen::Map<const RowMat> X(d.x.data(), batch, kIn), W(d.w.data(), kOut, kIn);
  Eigen::Map<const Eigen::RowVectorXf> B(d.b.data(), kOut);
  RowMat y = X * W.transpose();
  y.rowwise() += B;
  return y.cwiseMax(0.f);
}

void run_lazy(benchmark::State& state, std::int64_t batch, int threads, bool fused) {
  bench::DeviceThreads guard(threads);
  const Data data(batch);
  const auto x = lazy::from_vector<float>(data.x, lazy::Shape{batch, kIn});
  const auto w = lazy::from_vector<float>(data.w, lazy::Shape{kOut, kIn});
  const auto b = lazy::from_vector<float>(data.b, lazy::Shape{kOut});
  {
    lazy::Tensor<float> y = lazy::relu(lazy::linear(x, w, b));
    lazy::mark_step();
    const RowMat want = eigen_reference(data, batch);
    if (!bench::check(state, bench::max_rel_diff(y.data(), want.data(), batch * kOut) < 1e-4, "lazy linear value"))
      return;
  }
  if (fused) {
    for (auto _ : state) {
      lazy::Tensor<float> y = lazy::relu(lazy::linear(x, w, b));
      lazy::mark_step();
      lazy::wait_device_ops();
      benchmark::DoNotOptimize(y.node().get());
      benchmark::ClobberMemory();
    }
  } else {
    for (auto _ : state) {
      lazy::Tensor<float> h = lazy::linear(x, w);  // held: materialized on its own
      lazy::Tensor<float> y = lazy::relu(h + b);
      lazy::mark_step();
      lazy::wait_device_ops();
      benchmark::DoNotOptimize(y.node().get());
      benchmark::ClobberMemory();
    }
  }
  set_counters(state, batch);
}

void BM_Linear_Lazy(benchmark::State& state) { run_lazy(state, state.range(0), 1, true); }
void BM_Linear_LazyUnfused(benchmark::State& state) { run_lazy(state, state.range(0), 1, false); }
void BM_Linear_LazyThreads(benchmark::State& state) {
  run_lazy(state, state.range(0), static_cast<int>(state.range(1)), true);
}

void BM_Linear_EigenSeq(benchmark::State& state) {
  const std::int64_t batch = state.range(0);
  const Data data(batch);
  Eigen::Map<const RowMat> X(data.x.data(), batch, kIn), W(data.w.data(), kOut, kIn);
  Eigen::Map<const Eigen::RowVectorXf> B(data.b.data(), kOut);
  RowMat y = RowMat::Zero(batch, kOut);
  for (auto _ : state) {
    y.noalias() = X * W.transpose();  // GEMM
    y.rowwise() += B;                 // bias pass
    y = y.cwiseMax(0.f);              // relu pass
    benchmark::DoNotOptimize(y.data());
    benchmark::ClobberMemory();
  }
  set_counters(state, batch);
}

#ifdef LAZYTENSOR_HAVE_TORCH
void BM_Linear_Torch(benchmark::State& state) {
  const std::int64_t batch = state.range(0);
  bench::set_torch_threads(1, 1);  // and OpenBLAS's pool, which would use every core
  Data data(batch);
  const torch::Tensor x = torch::from_blob(data.x.data(), {batch, kIn}).clone();
  const torch::Tensor w = torch::from_blob(data.w.data(), {kOut, kIn}).clone();
  const torch::Tensor b = torch::from_blob(data.b.data(), {kOut}).clone();
  torch::NoGradGuard no_grad;
  for (auto _ : state) {
    torch::Tensor y = torch::relu(torch::nn::functional::linear(x, w, b));
    benchmark::DoNotOptimize(y.data_ptr());
    benchmark::ClobberMemory();
  }
  set_counters(state, batch);
}
#endif

}  // namespace

BENCHMARK(BM_Linear_Lazy)->Arg(256)->UseRealTime();
BENCHMARK(BM_Linear_EigenSeq)->Arg(256)->UseRealTime();
#ifdef LAZYTENSOR_HAVE_TORCH
BENCHMARK(BM_Linear_Torch)->Arg(256)->UseRealTime();
#endif
BENCHMARK(BM_Linear_LazyUnfused)->Arg(256)->UseRealTime();
BENCHMARK(BM_Linear_LazyThreads)->Args({256, 1})->Args({256, 2})->UseRealTime();

BENCHMARK_MAIN();
