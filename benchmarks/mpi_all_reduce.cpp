// all_reduce across MPI processes (lazytensor::mpi) against a bare MPI_Allreduce of the same
// buffer, in the same run. Not a Google Benchmark program: every process of the job takes
// part in every measurement, so the loop is written out.
//
//   mpirun -np 2 mpi_all_reduce [--replicas N] [--mib M] [--reps R]
//   mpi_all_reduce --replicas 2          (no mpirun: the threads-only world, for comparison)
//
// Prints, on global rank zero, one line per measurement, medians of R repetitions:
//   lazy   all_reduce of M MiB float Sum over the world of P x N replicas: time, algbw, busbw
//          (nccl-tests' definitions: algbw = bytes / time, busbw = algbw * 2 (W - 1) / W)
//   mpi    MPI_Allreduce of the same bytes over the P processes (one per process)
//   and the same two for 4 bytes, as latencies.
// Measurements alternate (lazy, mpi, lazy, ...) so that drift hits both alike.

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "flag_args.hpp"

#include <lazytensor/dist.hpp>
#include <lazytensor/ops/factories.hpp>

#include <mpi.h>  // (after the library, which asks for MPI's C API only)

namespace {

using Clock = std::chrono::steady_clock;

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

struct Args {
  double replicas = 1, mib = 64, reps = 7;
};

Args parse(int argc, char** argv) {
  Args a;
  bench::parse_flags(argc, argv, {{"--replicas", &a.replicas}, {"--mib", &a.mib}, {"--reps", &a.reps}},
                     "mpi_all_reduce [--replicas N] [--mib M] [--reps R]");
  // (The self-check reads the last element: the bandwidth run needs at least one float.)
  if (a.replicas < 1 || a.reps < 1 || a.mib * (1 << 20) < sizeof(float)) {
    std::fprintf(stderr, "mpi_all_reduce: --replicas and --reps must be at least 1 and --mib at least 4 bytes' worth, got %g, %g, %g\n",
                 a.replicas, a.reps, a.mib);
    std::exit(2);
  }
  return a;
}

/// Seconds per all_reduce of `n` floats on the lazy world, one value per repetition (the
/// same on every replica: each repetition starts at a barrier).
std::vector<double> time_lazy(std::int64_t n, int iters, int reps, int replicas) {
  std::vector<double> secs;
  lazy::dist::spawn(
      [&](int) {
        auto x = lazy::full<float>(lazy::Shape{n}, 1.0f);
        lazy::mark_step();
        // Warm-up: pools, plans, the MPI connections.
        for (int i = 0; i < 2; ++i) (void)lazy::dist::all_reduce(lazy::ReduceOp::Sum, x).to_vector();
        for (int r = 0; r < reps; ++r) {
          lazy::dist::barrier("rep");
          const auto t0 = Clock::now();
          lazy::Tensor<float> y;
          for (int i = 0; i < iters; ++i) {
            y = lazy::dist::all_reduce(lazy::ReduceOp::Sum, x);
            lazy::mark_step();
          }
          lazy::wait_device_ops();
          const double s = std::chrono::duration<double>(Clock::now() - t0).count() / iters;
          if (lazy::runtime::global_ordinal() == 0) secs.push_back(s);
          const auto world = static_cast<float>(lazy::runtime::world_size());
          if (y.to_vector()[static_cast<std::size_t>(n - 1)] != world) {
            std::fprintf(stderr, "self-check failed: all_reduce gave %g, expected %g\n",
                         static_cast<double>(y.to_vector().back()), static_cast<double>(world));
            std::exit(1);
          }
        }
      },
      replicas);
  return secs;
}

/// The same with a bare MPI_Allreduce over the processes.
std::vector<double> time_mpi(std::int64_t n, int iters, int reps) {
  std::vector<float> in(static_cast<std::size_t>(n), 1.0f), out(in.size());
  std::vector<double> secs;
  for (int i = 0; i < 2; ++i)
    MPI_Allreduce(in.data(), out.data(), static_cast<int>(n), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
  for (int r = 0; r < reps; ++r) {
    MPI_Barrier(MPI_COMM_WORLD);
    const auto t0 = Clock::now();
    for (int i = 0; i < iters; ++i)
      MPI_Allreduce(in.data(), out.data(), static_cast<int>(n), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    secs.push_back(std::chrono::duration<double>(Clock::now() - t0).count() / iters);
  }
  return secs;
}

}  // namespace

int main(int argc, char** argv) {
  const Args args = parse(argc, argv);
  const int replicas = static_cast<int>(args.replicas), reps = static_cast<int>(args.reps);
  const double mib = args.mib;
  const int procs = lazy::runtime::process_count();  // initialises MPI under mpirun
  int ready = 0;
  MPI_Initialized(&ready);
  if (!ready) MPI_Init(&argc, &argv);  // without mpirun: a world of one process for the peer
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  const int world = procs * replicas;
  const auto n = static_cast<std::int64_t>(mib * (1 << 20) / sizeof(float));
  const double bytes = static_cast<double>(n) * sizeof(float);
  if (rank == 0) {
    std::printf("world: %d process(es) x %d replica(s) = %d; %.0f MiB float Sum; medians of %d\n",
                procs, replicas, world, mib, reps);
  }
  std::vector<double> big_lazy, big_mpi, small_lazy, small_mpi;
  for (int block = 0; block < 2; ++block) {  // alternate: drift hits both alike
    auto l = time_lazy(n, 5, reps, replicas);
    auto m = time_mpi(n, 5, reps);
    auto ls = time_lazy(1, 2000, reps, replicas);
    auto ms = time_mpi(1, 2000, reps);
    big_lazy.insert(big_lazy.end(), l.begin(), l.end());
    big_mpi.insert(big_mpi.end(), m.begin(), m.end());
    small_lazy.insert(small_lazy.end(), ls.begin(), ls.end());
    small_mpi.insert(small_mpi.end(), ms.begin(), ms.end());
  }
  if (rank == 0) {
    auto line = [&](const char* what, double t, int w) {
      const double algbw = bytes / t / 1e9;
      std::printf("%-44s %9.3f ms  algbw %6.2f GB/s  busbw %6.2f GB/s\n", what, t * 1e3, algbw,
                  w > 1 ? algbw * 2.0 * (w - 1) / w : 0.0);
    };
    const double tl = median(big_lazy), tm = median(big_mpi);
    line("lazy all_reduce (P x N world)", tl, world);
    line("MPI_Allreduce (P processes)", tm, procs);
    const double bl = bytes / tl * 2.0 * (world - 1) / world, bm = bytes / tm * 2.0 * (procs - 1) / procs;
    if (procs > 1) std::printf("busbw ratio lazy / MPI_Allreduce: %.2fx\n", bl / bm);
    const double sl = median(small_lazy), sm = median(small_mpi);
    std::printf("4-byte latency: lazy %.2f us, MPI_Allreduce %.2f us", sl * 1e6, sm * 1e6);
    if (procs > 1) std::printf(" (ratio %.2fx)", sl / sm);
    std::printf("\n");
  }
  MPI_Finalized(&ready);
  if (!ready && lazy::runtime::process_count() == 1) MPI_Finalize();
  return 0;
}
