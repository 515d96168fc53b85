// Fixed costs of the lazy machinery, measured on tiny (16-element) tensors where the
// arithmetic is negligible.
//
//   BM_MarkStep_Chain100/16         100 chained statements `t = t * 0.999f + b;` (each makes
//                                   a pending Tensor), then mark_step and wait_device_ops:
//                                   time per step, tracing to results
//   BM_MarkStep_Chain100StepOnly/16 the same, timing only the mark_step call (graph already
//                                   built; the plan is cached after the first step, and the
//                                   step runs on the device's executor thread meanwhile)
//   BM_MarkStep_Chain100Sync/16     the same, timing mark_step + wait_device_ops
//   BM_MarkStep_Chain100Eigen/16    peer: the same 100 statements as eager Eigen on a
//                                   preallocated 16-float array (the arithmetic alone)
//   BM_MarkStep_Empty               mark_step with nothing pending

#include <chrono>

#include "bench_common.hpp"

#include <Eigen/Core>

namespace {

constexpr int kStatements = 100;

void BM_MarkStep_Chain100(benchmark::State& state) {
  bench::DeviceThreads guard(1);
  const std::int64_t n = state.range(0);
  const auto a = lazy::from_vector<float>(bench::random_vector(n, 1));
  const auto b = lazy::from_vector<float>(bench::random_vector(n, 2));
  for (auto _ : state) {
    lazy::Tensor<float> t = a;
    for (int i = 0; i < kStatements; ++i) t = t * 0.999f + b;
    lazy::mark_step();
    lazy::wait_device_ops();
    benchmark::DoNotOptimize(t.node().get());
  }
  state.counters["nodes"] = kStatements;
}

void BM_MarkStep_Chain100StepOnly(benchmark::State& state) {
  bench::DeviceThreads guard(1);
  const std::int64_t n = state.range(0);
  const auto a = lazy::from_vector<float>(bench::random_vector(n, 1));
  const auto b = lazy::from_vector<float>(bench::random_vector(n, 2));
  for (auto _ : state) {
    lazy::Tensor<float> t = a;
    for (int i = 0; i < kStatements; ++i) t = t * 0.999f + b;
    const auto t0 = std::chrono::steady_clock::now();
    lazy::mark_step();
    const auto t1 = std::chrono::steady_clock::now();
    state.SetIterationTime(std::chrono::duration<double>(t1 - t0).count());
    lazy::wait_device_ops();  // untimed: the next step starts from an idle device
    benchmark::DoNotOptimize(t.node().get());
  }
}

void BM_MarkStep_Chain100Sync(benchmark::State& state) {
  bench::DeviceThreads guard(1);
  const std::int64_t n = state.range(0);
  const auto a = lazy::from_vector<float>(bench::random_vector(n, 1));
  const auto b = lazy::from_vector<float>(bench::random_vector(n, 2));
  for (auto _ : state) {
    lazy::Tensor<float> t = a;
    for (int i = 0; i < kStatements; ++i) t = t * 0.999f + b;
    const auto t0 = std::chrono::steady_clock::now();
    lazy::mark_step();
    lazy::wait_device_ops();
    const auto t1 = std::chrono::steady_clock::now();
    state.SetIterationTime(std::chrono::duration<double>(t1 - t0).count());
    benchmark::DoNotOptimize(t.node().get());
  }
}

void BM_MarkStep_Chain100Eigen(benchmark::State& state) {
  const std::int64_t n = state.range(0);
  const auto va = bench::random_vector(n, 1), vb = bench::random_vector(n, 2);
  const Eigen::ArrayXf a = Eigen::Map<const Eigen::ArrayXf>(va.data(), n),
                       b = Eigen::Map<const Eigen::ArrayXf>(vb.data(), n);
  Eigen::ArrayXf t(n);
  for (auto _ : state) {
    t = a;
    for (int i = 0; i < kStatements; ++i) {
      t = t * 0.999f + b;
      benchmark::ClobberMemory();  // keep the statements separate, as in the lazy variant
    }
    benchmark::DoNotOptimize(t.data());
  }
}

void BM_MarkStep_Empty(benchmark::State& state) {
  bench::DeviceThreads guard(1);
  lazy::mark_step();
  for (auto _ : state) lazy::mark_step();
}

}  // namespace

BENCHMARK(BM_MarkStep_Chain100)->Arg(16)->UseRealTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_MarkStep_Chain100StepOnly)->Arg(16)->UseManualTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_MarkStep_Chain100Sync)->Arg(16)->UseManualTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_MarkStep_Chain100Eigen)->Arg(16)->UseRealTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_MarkStep_Empty)->UseRealTime()->Unit(benchmark::kMicrosecond);

BENCHMARK_MAIN();
