#pragma once
// SPMD mode (torch_xla's xr.use_spmd()): one program thread drives every device; tensors
// annotated with a sharding live as pieces on the mesh's devices.

#include <lazytensor/core/config.hpp>
#include <lazytensor/dist/context.hpp>
#include <lazytensor/dist/parallel_loader.hpp>
#include <lazytensor/dist/spawn.hpp>
#include <lazytensor/spmd/partitioner.hpp>
#include <lazytensor/spmd/process_link.hpp>
#include <lazytensor/spmd/sharding.hpp>
#include <lazytensor/tensor/device.hpp>

namespace lazy::spmd {

/// Turns SPMD mode on for the process, for good (call it before creating tensors, as in
/// torch_xla). From then on: graph::submit hands nodes reading sharded values to the
/// partitioner; lazy::mark_step() and wait_device_ops() step and wait for every device,
/// each step running on its device's executor (LAZYTENSOR_ASYNC=0 does not apply: a step
/// holding a collective waits there for its peers); and, with several devices (of this
/// process, or of the processes sharing its host), each device's kernels use an equal
/// share of the threads (as spawn gives replicas). Error inside spawn (replicas and SPMD
/// are two different programs).
///
/// Under `mpirun -np P` with lazytensor::mpi linked, every process calls it (collective) and
/// the processes become one SPMD program over P x lazy::device_count() devices with global
/// ids (span.hpp; runtime::global_runtime_device_count()): each process runs the same
/// program, computes its own devices' pieces, and exchanges data with the others where a
/// collective or a read of a sharded value needs it. Error when the processes' device
/// counts differ or MPI lacks MPI_THREAD_MULTIPLE.
void use_spmd();

/// Whether use_spmd() was called.
bool is_spmd();

namespace detail {
/// The loaders' input_sharding (dist::ParallelLoaderOptions): shards a batch's tensor.
void shard_loader_input(graph::TensorImpl& t, const ShardingSpec& spec);
}  // namespace detail

}  // namespace lazy::spmd

#if LAZYTENSOR_HEADER_DEFINITIONS
#include <algorithm>


namespace lazy::spmd {

LAZYTENSOR_INLINE void use_spmd() {
  if (dist::detail::current_context())
    throw Error("use_spmd: called inside spawn; SPMD mode drives every device from one program thread");
  // Nor beside one (the replicas' mark_step would then step every device): held until SPMD
  // mode is on, so a spawn starting meanwhile sees it.
  std::unique_lock spawning(dist::detail::spawn_mutex(), std::try_to_lock);
  if (!spawning.owns_lock())
    throw Error(
        "use_spmd: a spawn is running; SPMD mode drives every device from one program thread");
  if (is_spmd()) return;
  if (auto join = detail::process_join_hook().load(std::memory_order_acquire)) join();
  const int n = device_count();
  // The devices of every process on this host share its cores.
  const int sharing = n * detail::process_span().host_processes;
  const int threads = std::max(1, graph::default_device_threads() / sharing);
  for (int i = 0; i < n; ++i) {
    graph::Device& dev = graph::DeviceRegistry::get().device(i);
    if (sharing > 1) dev.set_num_threads(threads);
    // Each device's steps run on its own executor, every one of them: a step holding a
    // collective waits there for its peers, never on the program thread.
    dev.async() = true;
    dev.queue_every_step() = true;
  }
  dist::detail::input_sharding_hook().store(&detail::shard_loader_input, std::memory_order_release);
  graph::partition_hook().store(&detail::partition, std::memory_order_release);
  graph::step_every_device().store(true, std::memory_order_release);
}

LAZYTENSOR_INLINE bool is_spmd() {
  return graph::partition_hook().load(std::memory_order_acquire) != nullptr;
}

}  // namespace lazy::spmd
#endif  // LAZYTENSOR_HEADER_DEFINITIONS
