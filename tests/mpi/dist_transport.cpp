// Linked with test_dist's objects (compiled without MPI) into test_dist_mpi_linked: a
// translation unit that includes the transport with LAZYTENSOR_WITH_MPI installs it when the
// program starts (dist/mpi_world.hpp), so the threads-only suite runs with MPI underneath.
// LAZYTENSOR_WITH_MPI only adds entities of its own (the transport, the variables that install
// it) and changes no definition that the objects without it also have.
#include <lazytensor/dist.hpp>

#include <atomic>

#include <gtest/gtest.h>

static_assert(LAZYTENSOR_WITH_MPI, "built with lazytensor::mpi");

// What the suite would not notice if the transport were missing: every spawn of a world of
// one process looks the same either way.
TEST(MpiLinked, TheMpiTransportIsInstalledBeforeTheTests) {
  EXPECT_EQ(lazy::dist::detail::process_transport().load(std::memory_order_acquire),
            &lazy::dist::detail::mpi_transport());
  EXPECT_EQ(lazy::dist::detail::process_place().count, 1);  // mpirun -np 1
}
