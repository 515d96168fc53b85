// Data-parallel MLP training (784-256-128-10, batches of 256 per replica, SGD with momentum,
// gradients averaged by optimizer_step) on P MPI processes x N replicas, against the same
// world built of threads. Not a Google Benchmark program: every process takes part in
// every measurement. Run both shapes and compare (scripts do, see benchmarks/results.md):
//
//   mpirun -np 2 mpi_data_parallel --replicas 1      2 processes x 1 replica
//   mpi_data_parallel --replicas 2                   1 process x 2 replicas (threads)
//
// With --spmd 1 the same training runs as one SPMD program (lazy::spmd) over a 1-D "data"
// mesh of every process's N devices (LAZYTENSOR_NUM_DEVICES=N), parameters replicated and
// the global batch (256 per device) sharded, so the gradient all-reduces cross the
// processes:
//
//   mpirun -np 2 mpi_data_parallel --spmd 1 --replicas 1    2 processes x 1 device
//   mpi_data_parallel --spmd 1 --replicas 2                 1 process x 2 devices
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
#include <lazytensor/spmd.hpp>

#include <mpi.h>  // (after the library, which asks for MPI's C API only)

namespace {

using Clock = std::chrono::steady_clock;

struct Args {
  double replicas = 2, steps = 40, reps = 7, spmd = 0;
};

Args parse(int argc, char** argv) {
  Args a;
  bench::parse_flags(argc, argv,
                     {{"--replicas", &a.replicas}, {"--steps", &a.steps}, {"--reps", &a.reps}, {"--spmd", &a.spmd}},
                     "mpi_data_parallel [--replicas N] [--steps S] [--reps R] [--spmd 0|1]");
  return a;
}

/// Global samples/s of SPMD data-parallel training over every process's `devices`
/// devices, one value per repetition (on process 0; empty elsewhere).
std::vector<double> spmd_rates(int devices, int steps, int reps) {
  using namespace bench::mlp;
  if (lazy::device_count() != devices) {
    std::fprintf(stderr, "mpi_data_parallel --spmd 1 --replicas %d: run with LAZYTENSOR_NUM_DEVICES=%d (got %d)\n",
                 devices, devices, lazy::device_count());
    std::exit(2);
  }
  lazy::spmd::use_spmd();
  const int world = lazy::runtime::global_runtime_device_count();
  if (world > kMaxBatches) {
    std::fprintf(stderr, "mpi_data_parallel --spmd 1: the problem holds %d batches, the mesh has %d devices\n",
                 kMaxBatches, world);
    std::exit(2);
  }
  std::vector<int> ids(static_cast<std::size_t>(world));
  for (int i = 0; i < world; ++i) ids[static_cast<std::size_t>(i)] = i;
  const lazy::spmd::Mesh mesh(ids, {world}, {"data"});
  LazyMlp m(Problem::get(), 0, world * kBatch);
  for (auto& p : m.model->parameters()) lazy::spmd::mark_sharding(p, mesh, {});
  lazy::spmd::mark_sharding(m.x, mesh, {"data"});
  lazy::spmd::mark_sharding(m.y, mesh, {"data"});
  auto step = [&] {
    lazy::Tensor<float> loss = m.forward_backward();
    m.opt.step();
    lazy::mark_step();
    return loss;
  };
  for (int i = 0; i < 5; ++i) step();
  lazy::wait_device_ops();
  std::vector<double> rates;
  for (int rep = 0; rep < reps; ++rep) {
    if (lazy::runtime::process_count() > 1) MPI_Barrier(MPI_COMM_WORLD);  // (MPI is up only under mpirun)
    const auto t0 = Clock::now();
    for (int i = 0; i < steps; ++i) step();
    lazy::wait_device_ops();
    const double secs = std::chrono::duration<double>(Clock::now() - t0).count();
    if (lazy::runtime::process_index() == 0) rates.push_back(static_cast<double>(world) * kBatch * steps / secs);
  }
  return rates;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace bench::mlp;
  const Args args = parse(argc, argv);
  const int replicas = static_cast<int>(args.replicas), steps = static_cast<int>(args.steps),
            reps = static_cast<int>(args.reps);
  if (args.spmd != 0) {
    auto rates = spmd_rates(replicas, steps, reps);
    if (!rates.empty()) {
      std::sort(rates.begin(), rates.end());
      std::printf("SPMD data-parallel MLP: %d process(es) x %d device(s): %.0f samples/s (median of %d)\n",
                  lazy::runtime::process_count(), replicas, rates[rates.size() / 2], reps);
    }
    return 0;
  }
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
