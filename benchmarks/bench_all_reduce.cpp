// all_reduce between replica threads (lazy::dist), against the machine's memcpy.
//
//   BM_AllReduce_Lazy/<bytes>     float Sum over 2 replicas; each iteration traces the
//                                 all_reduce and runs it with mark_step on both replicas.
//                                 Counters (GB/s), as nccl-tests defines them:
//                                   algbw = bytes / time
//                                   busbw = algbw * 2 (n - 1) / n   (= algbw for n = 2)
//   BM_AllReduce_Memcpy/<bytes>   peer: one memcpy of the same size on one thread, measured
//                                 in the same run (the machine's copy bandwidth)
//   BM_AllReduceLatency_Lazy      the 4-byte all_reduce, as a latency
//   BM_AllReduceLatency_LazySync  the same with the replicas' devices running steps on the
//                                 calling thread (as LAZYTENSOR_ASYNC=0): the cost of handing
//                                 each step to the device's executor thread
//   BM_AllReduceLatency_Barrier   peer: a host barrier (the bare cost of one synchronization)
//
// The replicas are spawned once per benchmark run and loop inside: replica 0 drives the
// benchmark loop, replica 1 runs the same number of iterations (State::max_iterations).

#include <cstring>
#include <vector>

#include "bench_common.hpp"

#include <lazytensor/dist.hpp>

namespace {

constexpr int kReplicas = 2;

/// Runs `step` max_iterations times on every replica, timing on replica 0. `step` gets the
/// replica's input; returns false from the self-check to stop with an error. `async`: whether
/// mark_step hands steps to the device's executor thread (the default) or runs them itself.
template <class Check, class Step>
void run_replicated(benchmark::State& state, std::int64_t n, Check check, Step step,
                    bool async = true) {
  lazy::dist::spawn(
      [&](int r) {
        auto& dev = lazy::graph::current_device();
        const bool was_async = dev.async();
        dev.async() = async;
        struct Restore {
          lazy::graph::Device& dev;
          bool async;
          ~Restore() { dev.async() = async; }
        } restore{dev, was_async};
        auto x = lazy::from_vector<float>(bench::random_vector(n, static_cast<unsigned>(r + 1)));
        lazy::mark_step();
        // Every replica must agree to run the loop, or the other one would wait for it.
        const bool ok =
            lazy::dist::mesh_reduce("self-check", check(x), [](const std::vector<bool>& v) {
              for (bool b : v)
                if (!b) return false;
              return true;
            });
        if (r == 0) {
          if (!bench::check(state, ok, "all_reduce result differs from x0 + x1")) return;
          benchmark::IterationCount i = 0;
          for (auto _ : state) {
            step(x);
            // mark_step may return before its step ran: the last one is waited for inside
            // the time.
            if (++i == state.max_iterations) lazy::wait_device_ops();
          }
        } else if (ok) {
          for (benchmark::IterationCount i = 0; i < state.max_iterations; ++i) step(x);
          lazy::wait_device_ops();
        }
      },
      kReplicas);
}

/// Untimed self-check: the all_reduce of the replicas' inputs is x0 + x1 (one float add).
bool sum_is_right(const lazy::Tensor<float>& x) {
  const auto y = lazy::dist::all_reduce(lazy::ReduceOp::Sum, x).to_vector();
  const auto n = static_cast<std::int64_t>(y.size());
  const auto x0 = bench::random_vector(n, 1), x1 = bench::random_vector(n, 2);
  for (std::size_t i = 0; i < y.size(); ++i) {
    if (y[i] != x0[i] + x1[i]) return false;
  }
  return true;
}

void all_reduce_step(const lazy::Tensor<float>& x) {
  auto y = lazy::dist::all_reduce(lazy::ReduceOp::Sum, x);
  lazy::mark_step();
  benchmark::DoNotOptimize(y.node().get());
}

void BM_AllReduce_Lazy(benchmark::State& state) {
  const std::int64_t bytes = state.range(0);
  run_replicated(state, bytes / 4, sum_is_right, all_reduce_step);
  state.SetBytesProcessed(state.iterations() * bytes);
  const double per_second =
      static_cast<double>(bytes) * static_cast<double>(state.iterations()) / 1e9;
  state.counters["algbw_GBps"] = benchmark::Counter(per_second, benchmark::Counter::kIsRate);
  state.counters["busbw_GBps"] = benchmark::Counter(per_second * 2.0 * (kReplicas - 1) / kReplicas,
                                                    benchmark::Counter::kIsRate);
}

void BM_AllReduce_Memcpy(benchmark::State& state) {
  const std::int64_t bytes = state.range(0);
  const auto src = bench::random_vector(bytes / 4, 1);
  std::vector<float> dst(src.size());
  for (auto _ : state) {
    std::memcpy(dst.data(), src.data(), static_cast<std::size_t>(bytes));
    benchmark::DoNotOptimize(dst.data());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(state.iterations() * bytes);
  state.counters["algbw_GBps"] =
      benchmark::Counter(static_cast<double>(bytes) * static_cast<double>(state.iterations()) / 1e9,
                         benchmark::Counter::kIsRate);
}

void BM_AllReduceLatency_Lazy(benchmark::State& state) {
  run_replicated(state, 1, sum_is_right, all_reduce_step);
}

void BM_AllReduceLatency_LazySync(benchmark::State& state) {
  run_replicated(state, 1, sum_is_right, all_reduce_step, /*async=*/false);
}

void BM_AllReduceLatency_Barrier(benchmark::State& state) {
  run_replicated(
      state, 1, [](const lazy::Tensor<float>&) { return true; },
      [](const lazy::Tensor<float>&) { lazy::dist::barrier("bench"); });
}

}  // namespace

BENCHMARK(BM_AllReduce_Lazy)
    ->RangeMultiplier(4)
    ->Range(4, 64 << 20)
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_AllReduce_Memcpy)
    ->RangeMultiplier(4)
    ->Range(4, 64 << 20)
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_AllReduceLatency_Lazy)->UseRealTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_AllReduceLatency_LazySync)->UseRealTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_AllReduceLatency_Barrier)->UseRealTime()->Unit(benchmark::kMicrosecond);

BENCHMARK_MAIN();
