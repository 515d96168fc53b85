// Compiled by scripts/test.sh --all with mpicxx -DLAZYTENSOR_WITH_MPI=1 against
// single_include/ only (header-only), and by the installed package's consumer against
// lazytensor::compiled + lazytensor::mpi; both run under mpirun -np 2, where the MPI
// transport forms one world of the processes' replicas.
#include <lazytensor/lazytensor.hpp>

#include <cstdio>

int main() {
  const int procs = lazy::runtime::process_count();
  int failures = 0;
  lazy::dist::spawn(
      [&](int) {
        const int r = lazy::runtime::global_ordinal(), world = lazy::runtime::world_size();
        auto x = lazy::full<float>(lazy::Shape{3}, static_cast<float>(r + 1));
        const float got = lazy::dist::all_reduce(lazy::ReduceOp::Sum, x).to_vector()[2];
        const float want = static_cast<float>(world * (world + 1) / 2);
        if (got != want || world != procs * 2) ++failures;
        if (r == 0) std::printf("single header over MPI: %d processes, sum = %g (expected %g)\n", procs, got, want);
      },
      2);
  return failures == 0 && procs == 2 ? 0 : 1;
}
