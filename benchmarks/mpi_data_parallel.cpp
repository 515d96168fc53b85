// Data-parallel MLP training (784-256-128-10, batches of 256 per replica, SGD with momentum,
// gradients averaged by optimizer_step) on P MPI processes x N replicas, against the same
// world built of threads. Not a Google Benchmark program: every process takes part in
// every measurement. Run both shapes and compare (scripts do, see benchmarks/results.md):
//
//   mpirun -np 2 mpi_data_parallel --replicas 1      2 processes x 1 replica
//   mpi_data_parallel --replicas 2                   1 process x 2 replicas (threads)
//
// Prints, on global rank zero, the global samples/s: the median of R repetitions of S steps
// (after warm-up steps), each repetition starting at a barrier and ending when every step
// ran on this replica.

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "flag_args.hpp"
#include "mlp_problem.hpp"

#include <lazytensor/dist.hpp>

namespace {

using Clock = std::chrono::steady_clock;

struct Args {
  double replicas = 2, steps = 40, reps = 7;
};

Args parse(int argc, char** argv) {
  Args a;
  bench::parse_flags(argc, argv, {{"--replicas", &a.replicas}, {"--steps", &a.steps}, {"--reps", &a.reps}},
                     "mpi_data_parallel [--replicas N] [--steps S] [--reps R]");
  return a;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace bench::mlp;
  const Args args = parse(argc, argv);
  const int replicas = static_cast<int>(args.replicas), steps = static_cast<int>(args.steps),
            reps = static_cast<int>(args.reps);
  std::vector<double> rates;
  lazy::dist::spawn(
      [&](int) {
        const int r = lazy::runtime::global_ordinal(), world = lazy::runtime::world_size();
        bench::DeviceThreads one(1);
        LazyMlp m(Problem::get(), (r % kMaxBatches) * kBatch, kBatch);
        auto step = [&] {
          lazy::Tensor<float> loss = m.forward_backward();
          lazy::dist::optimizer_step(m.opt, /*barrier=*/true);
          return loss;
        };
        for (int i = 0; i < 5; ++i) step();
        lazy::wait_device_ops();
        for (int rep = 0; rep < reps; ++rep) {
          lazy::dist::barrier("rep");
          const auto t0 = Clock::now();
          for (int i = 0; i < steps; ++i) step();
          lazy::wait_device_ops();
          const double secs = std::chrono::duration<double>(Clock::now() - t0).count();
          if (r == 0) rates.push_back(static_cast<double>(world) * kBatch * steps / secs);
        }
      },
      replicas);
  if (!rates.empty()) {
    std::sort(rates.begin(), rates.end());
    std::printf("data-parallel MLP: %d process(es) x %d replica(s): %.0f samples/s (median of %d)\n",
                lazy::runtime::process_count(), replicas, rates[rates.size() / 2], reps);
  }
  return 0;
}
