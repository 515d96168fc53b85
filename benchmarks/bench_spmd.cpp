// SPMD against spawn: the MLP step of mlp_problem.hpp (784-256-128-10, SGD with momentum)
// trained data-parallel on 2 devices, two ways, in one process:
//
//   BM_Spmd_Spawn/2      the spawn path (bench_replicas' BM_Replicas_Lazy/2): 2 replica
//                        threads, each with its own device, batch of 256 and
//                        dist::optimizer_step. samples = 2 * 256 per step.
//   BM_Spmd_Data/2       one program thread, lazy::spmd: a global batch of 512 sharded over a
//                        ("data") mesh of the 2 devices, parameters replicated; forward,
//                        backward, opt.step(), mark_step. The partitioner runs each statement
//                        on both devices and all-reduces the weight gradients. samples = 512
//                        per step. Target: >= 0.9x BM_Spmd_Spawn/2's samples/s.
//   BM_Spmd_Fsdp/2       the same with every parameter sharded by rows over the mesh: the
//                        partitioner moves the other blocks where a product needs them.
//   BM_Spmd_TensorParallel/2   first layer's weight by output rows, second by input columns
//                        (Megatron), batch replicated.
//   BM_Spmd_Single/1     reference: the unsharded step on one device with both threads.
//
// SPMD mode holds for the process once on, so the spawn peer is registered (and runs)
// first. Self-check (once, untimed): the SPMD run's parameters after 10 steps match one
// device trained on the same 512 samples.

#include "mlp_problem.hpp"

#include <cstdio>
#include <cstdlib>
#include <sstream>

#include <lazytensor/dist.hpp>
#include <lazytensor/spmd.hpp>

namespace {

using namespace bench::mlp;

constexpr int kWarmupSteps = 3;
constexpr int kCheckSteps = 10;
constexpr double kParamTolerance = 1e-5;

enum class Layout { Data, Fsdp, TensorParallel };

/// The model on 512 samples, sharded as `layout` says over devices 0 and 1.
struct SpmdMlp {
  LazyMlp m{Problem::get(), 0, 2 * kBatch};
  explicit SpmdMlp(Layout layout) {
    lazy::spmd::use_spmd();
    const lazy::spmd::Mesh mesh({0, 1}, {2}, {"data"});
    auto params = m.model->parameters();  // W1, b1, W2, b2, W3, b3
    for (std::size_t i = 0; i < params.size(); ++i) {
      lazy::spmd::PartitionSpec spec;
      if (layout == Layout::Fsdp) spec = {"data"};
      if (layout == Layout::TensorParallel && i <= 1) spec = {"data"};         // W1 rows, b1
      if (layout == Layout::TensorParallel && i == 2) spec = {std::nullopt, "data"};  // W2 columns
      lazy::spmd::mark_sharding(params[i], mesh, spec);
    }
    lazy::spmd::mark_sharding(m.x, mesh, layout == Layout::TensorParallel ? lazy::spmd::PartitionSpec{} : lazy::spmd::PartitionSpec{"data"});
    lazy::spmd::mark_sharding(m.y, mesh, layout == Layout::TensorParallel ? lazy::spmd::PartitionSpec{} : lazy::spmd::PartitionSpec{"data"});
  }
  lazy::Tensor<float> step() {
    lazy::Tensor<float> loss = m.forward_backward();
    m.opt.step();
    lazy::mark_step();
    return loss;
  }
};

/// "" when the SPMD run trains like one device on the 512 samples, else what differs.
const std::string& self_check() {
  static const std::string verdict = [] {
    std::vector<float> single, init;
    {
      LazyMlp m(Problem::get(), 0, 2 * kBatch);
      init = m.flat_parameters();
      for (int i = 0; i < kCheckSteps; ++i) {
        m.forward_backward();
        m.opt.step();
        lazy::mark_step();
      }
      single = m.flat_parameters();
    }
    SpmdMlp s(Layout::Data);
    for (int i = 0; i < kCheckSteps; ++i) s.step();
    const std::vector<float> spmd = s.m.flat_parameters();
    const auto n = static_cast<std::int64_t>(single.size());
    const double moved = bench::max_rel_diff(single.data(), init.data(), n);
    const double diff = bench::max_rel_diff(spmd.data(), single.data(), n);
    std::fprintf(stderr, "spmd self-check: after %d steps the parameters moved by %.3g; SPMD differs from one device by %.3g\n",
                 kCheckSteps, moved, diff);
    std::ostringstream failure;
    if (!(diff <= kParamTolerance)) failure << "SPMD parameters differ from the single-device run's by " << diff;
    if (!(moved > 100 * kParamTolerance)) failure << "training hardly moved the parameters (" << moved << ")";
    return failure.str();
  }();
  return verdict;
}

void BM_Spmd_Spawn(benchmark::State& state) {
  if (!bench::check(state, !lazy::spmd::is_spmd(), "run the spawn peer before SPMD mode is on (filter order)")) return;
  const int replicas = static_cast<int>(state.range(0));
  lazy::dist::spawn(
      [&](int r) {
        bench::DeviceThreads one(1);
        LazyMlp m(Problem::get(), (r % kMaxBatches) * kBatch, kBatch);
        auto step = [&] {
          lazy::Tensor<float> loss = m.forward_backward();
          lazy::dist::optimizer_step(m.opt, /*barrier=*/true);
          return loss;
        };
        for (int i = 0; i < kWarmupSteps; ++i) step();
        lazy::wait_device_ops();
        if (r == 0) {
          benchmark::IterationCount i = 0;
          for (auto _ : state) {
            lazy::Tensor<float> loss = step();
            benchmark::DoNotOptimize(loss.node().get());
            if (++i == state.max_iterations) lazy::wait_device_ops();
          }
        } else {
          for (benchmark::IterationCount i = 0; i < state.max_iterations; ++i) step();
          lazy::wait_device_ops();
        }
      },
      replicas);
  state.counters["samples"] =
      benchmark::Counter(static_cast<double>(state.iterations()) * replicas * kBatch, benchmark::Counter::kIsRate);
}

void BM_Spmd_Single(benchmark::State& state) {
  if (!bench::check(state, !lazy::spmd::is_spmd(), "run before SPMD mode is on (filter order)")) return;
  LazyMlp m(Problem::get(), 0, 2 * kBatch);
  auto step = [&] {
    lazy::Tensor<float> loss = m.forward_backward();
    m.opt.step();
    lazy::mark_step();
    return loss;
  };
  for (int i = 0; i < kWarmupSteps; ++i) step();
  lazy::wait_device_ops();
  benchmark::IterationCount i = 0;
  for (auto _ : state) {
    lazy::Tensor<float> loss = step();
    benchmark::DoNotOptimize(loss.node().get());
    if (++i == state.max_iterations) lazy::wait_device_ops();
  }
  state.counters["samples"] =
      benchmark::Counter(static_cast<double>(state.iterations()) * 2 * kBatch, benchmark::Counter::kIsRate);
}

void run_spmd(benchmark::State& state, Layout layout) {
  if (!bench::check(state, self_check().empty(), self_check())) return;
  SpmdMlp s(layout);
  for (int i = 0; i < kWarmupSteps; ++i) s.step();
  lazy::wait_device_ops();
  benchmark::IterationCount i = 0;
  for (auto _ : state) {
    lazy::Tensor<float> loss = s.step();
    benchmark::DoNotOptimize(loss.node().get());
    if (++i == state.max_iterations) lazy::wait_device_ops();
  }
  state.counters["samples"] =
      benchmark::Counter(static_cast<double>(state.iterations()) * 2 * kBatch, benchmark::Counter::kIsRate);
}

void BM_Spmd_Data(benchmark::State& state) { run_spmd(state, Layout::Data); }
void BM_Spmd_Fsdp(benchmark::State& state) { run_spmd(state, Layout::Fsdp); }
void BM_Spmd_TensorParallel(benchmark::State& state) { run_spmd(state, Layout::TensorParallel); }

}  // namespace

BENCHMARK(BM_Spmd_Spawn)->Arg(2)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_Spmd_Single)->Arg(1)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_Spmd_Data)->Arg(2)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_Spmd_Fsdp)->Arg(2)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_Spmd_TensorParallel)->Arg(2)->UseRealTime()->Unit(benchmark::kMillisecond);

int main(int argc, char** argv) {
  // The mesh spans devices 0 and 1 (read once, before any device exists).
  setenv("LAZYTENSOR_NUM_DEVICES", "2", 0);
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::AddCustomContext("spmd_data", Problem::get().source);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
