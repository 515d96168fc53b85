// Data-parallel training throughput: the MLP step of mlp_problem.hpp (784-256-128-10,
// SGD with momentum) on R replicas of lazy::dist::spawn, each with 1 device thread and its
// own batch of 256, gradients averaged by lazy::dist::optimizer_step.
//
//   BM_Replicas_Lazy/R   global throughput: samples = R * 256 per step (samples/s); each
//                        replica runs zero_grad, forward, backward, optimizer_step(opt,
//                        barrier = true) per step (one all_reduce bucket of 0.9 MiB, then
//                        the update, then mark_step)
//
//   BM_Replicas_Strategy/R   the same step through lazy::train::ReplicaStrategy: its
//                        optimizer_step(opt, closure) (closure = forward_backward) then
//                        mark_step. Strategy/Lazy is what the strategy layer costs (target:
//                        within 3%).
//
//   BM_Replicas_Independent/R   reference: the same R replicas each training alone
//                        (opt.step(), no exchange): what the machine gives R independent
//                        single-thread trainings, i.e. the ceiling of the data-parallel run
//                        (lazy/Independent is its efficiency)
//
// R = 1 is the single-replica baseline: one device thread, no exchange (a group of one
// reduces nothing). The scaling target is R = 2 / R = 1 >= 1.8 on 2 cores.
//
// Replica 0 drives the benchmark loop; the others run the same number of steps
// (State::max_iterations). The last timed step waits for the device, so the time covers
// every step run, not only traced.
//
// Self-check (once, untimed): 2 replicas train kCheckSteps steps on batches 0 and 1; their
// parameters must be bitwise equal to each other and match a single device trained on both
// batches at once (the mean over 512 samples is the mean of the two replicas' means).

#include "mlp_problem.hpp"

#include <array>
#include <cstdio>
#include <sstream>

#include <lazytensor/dist.hpp>
#include <lazytensor/train.hpp>

namespace {

using namespace bench::mlp;

constexpr int kCheckSteps = 10;
/// Largest difference (absolute below 1, relative above) between the replicas' parameters
/// and the single-device run's. Float rounding gives ~1e-8; the parameters move by ~1e-2.
constexpr double kParamTolerance = 1e-6;
constexpr int kWarmupSteps = 3;

/// One data-parallel step on this replica; returns the loss handle.
lazy::Tensor<float> replica_step(LazyMlp& m) {
  lazy::Tensor<float> loss = m.forward_backward();
  lazy::dist::optimizer_step(m.opt, /*barrier=*/true);
  return loss;
}

/// The same step through the strategy layer (stateless: one object serves every replica).
lazy::Tensor<float> strategy_step(LazyMlp& m) {
  static lazy::train::ReplicaStrategy strategy(2);
  lazy::Tensor<float> loss = strategy.optimizer_step(m.opt, [&] { return m.forward_backward(); });
  lazy::mark_step();
  return loss;
}

/// "" when 2 replicas train like one device on both batches, else what differs.
const std::string& self_check() {
  static const std::string verdict = [] {
    std::array<std::vector<float>, 2> replica;
    lazy::dist::spawn(
        [&](int r) {
          bench::DeviceThreads one(1);
          LazyMlp m(Problem::get(), r * kBatch, kBatch);
          for (int i = 0; i < kCheckSteps; ++i) replica_step(m);
          replica[static_cast<std::size_t>(r)] = m.flat_parameters();
        },
        2);
    std::vector<float> single, init;
    {
      bench::DeviceThreads one(1);
      LazyMlp m(Problem::get(), 0, 2 * kBatch);
      init = m.flat_parameters();
      for (int i = 0; i < kCheckSteps; ++i) {
        m.forward_backward();
        m.opt.step();
        lazy::mark_step();
      }
      single = m.flat_parameters();
    }
    const auto n = static_cast<std::int64_t>(single.size());
    const double moved = bench::max_rel_diff(single.data(), init.data(), n);
    const double diff = bench::max_rel_diff(replica[0].data(), single.data(), n);
    std::ostringstream failure;
    if (replica[0] != replica[1]) failure << "the 2 replicas' parameters differ; ";
    if (!(diff <= kParamTolerance))
      failure << "replica parameters differ from the single-device run's by " << diff << "; ";
    if (!(moved > 1000 * kParamTolerance))
      failure << "training hardly moved the parameters (" << moved << ")";
    std::fprintf(stderr,
                 "replicas self-check on %s: after %d steps the parameters moved by %.3g, the "
                 "2 replicas differ from one device on both batches by %.3g\n",
                 Problem::get().source.c_str(), kCheckSteps, moved, diff);
    return failure.str();
  }();
  return verdict;
}

/// One step of a replica training on its own: the update without the gradient exchange.
lazy::Tensor<float> independent_step(LazyMlp& m) {
  lazy::Tensor<float> loss = m.forward_backward();
  m.opt.step();
  lazy::mark_step();
  return loss;
}

/// R replicas running `step` (replica_step or independent_step), replica 0 timing.
template <class Step>
void run_replicas(benchmark::State& state, Step step) {
  if (!bench::check(state, self_check().empty(), self_check())) return;
  const int replicas = static_cast<int>(state.range(0));
  lazy::dist::spawn(
      [&](int r) {
        bench::DeviceThreads one(1);
        LazyMlp m(Problem::get(), (r % kMaxBatches) * kBatch, kBatch);
        for (int i = 0; i < kWarmupSteps; ++i) step(m);
        lazy::wait_device_ops();
        if (r == 0) {
          benchmark::IterationCount i = 0;
          for (auto _ : state) {
            lazy::Tensor<float> loss = step(m);
            benchmark::DoNotOptimize(loss.node().get());
            if (++i == state.max_iterations) lazy::wait_device_ops();
          }
        } else {
          for (benchmark::IterationCount i = 0; i < state.max_iterations; ++i) step(m);
          lazy::wait_device_ops();
        }
      },
      replicas);
  state.counters["samples"] = benchmark::Counter(
      static_cast<double>(state.iterations()) * replicas * kBatch, benchmark::Counter::kIsRate);
}

void BM_Replicas_Lazy(benchmark::State& state) { run_replicas(state, replica_step); }
void BM_Replicas_Strategy(benchmark::State& state) { run_replicas(state, strategy_step); }
void BM_Replicas_Independent(benchmark::State& state) { run_replicas(state, independent_step); }

}  // namespace

BENCHMARK(BM_Replicas_Lazy)->Arg(1)->Arg(2)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_Replicas_Strategy)->Arg(1)->Arg(2)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_Replicas_Independent)->Arg(1)->Arg(2)->UseRealTime()->Unit(benchmark::kMillisecond);

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::AddCustomContext("replicas_data", Problem::get().source);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
