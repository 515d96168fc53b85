#pragma once
// Runtime queries, as torch_xla.runtime (xr.*). Inside spawn they describe the world of
// replicas; on any other thread, a world of one replica addressing the process's devices.
//
// Each replica plays the role of a torch_xla process: it has one device of its own, so
// local_process_count() and local_device_count() count the replicas on this host and
// addressable_device_count() is 1. The threads backend runs every replica in one process;
// under MPI (lazytensor::mpi) several processes, each with replica threads, form one world,
// and ordinals follow the world layout: global ordinal = process_index() * replicas per
// process + local index. process_index() and process_count() are the operating-system
// processes (MPI ranks), as torch_xla.runtime's.

#include <string>

#include <lazytensor/tensor/device.hpp>
#include <lazytensor/dist/context.hpp>

namespace lazy::runtime {

namespace detail {
inline const dist::detail::WorldLayout* layout() {
  auto* ctx = dist::detail::current_context();
  return ctx ? &ctx->world->state().layout() : nullptr;
}
}  // namespace detail

/// Index of this operating-system process among those of the job (xr.process_index()):
/// its MPI rank under lazytensor::mpi, else 0.
inline int process_index() {
  auto* l = detail::layout();
  if (l) return l->process_offset / l->process_replicas;
  return dist::detail::process_place().index;
}
/// Number of operating-system processes in the job (xr.process_count()): the MPI world's
/// size under lazytensor::mpi, else 1.
inline int process_count() {
  auto* l = detail::layout();
  if (l) return l->world_size / l->process_replicas;
  return dist::detail::process_place().count;
}

/// Devices of every process taking part (xr.global_runtime_device_count()): what SPMD
/// meshes are laid over, lazy::device_count() per process (each process of an MPI job
/// has the same count; use_spmd checks it).
inline int global_runtime_device_count() { return dist::detail::process_place().count * device_count(); }

/// Number of replicas in the world (xr.world_size()); 1 outside spawn.
inline int world_size() {
  auto* l = detail::layout();
  return l ? l->world_size : 1;
}
/// This replica's ordinal in the world (xr.global_ordinal()); 0 outside spawn.
inline int global_ordinal() { return dist::detail::ordinal_now(); }
/// This replica's ordinal on its host (xr.local_ordinal()); 0 outside spawn.
inline int local_ordinal() {
  auto* ctx = dist::detail::current_context();
  return ctx ? ctx->world->state().layout().host_offset + ctx->local : 0;
}
/// Replicas ("processes" in torch_xla's terms) on this host (xr.local_process_count()).
inline int local_process_count() {
  auto* l = detail::layout();
  return l ? l->host_replicas : 1;
}
/// Devices on this host: one per replica inside spawn, else lazy::device_count().
inline int local_device_count() {
  auto* l = detail::layout();
  return l ? l->host_replicas : device_count();
}
/// Devices in the world: one per replica inside spawn, else lazy::device_count().
inline int global_device_count() {
  auto* l = detail::layout();
  return l ? l->world_size : device_count();
}
/// Devices this thread can use: its own inside spawn, else lazy::device_count().
inline int addressable_device_count() { return detail::layout() ? 1 : device_count(); }
/// Kind of device ("CPU"), as xr.device_type().
inline std::string device_type() { return "CPU"; }

}  // namespace lazy::runtime

namespace lazy::dist {

/// True on the master replica: local ordinal 0 (of its host) when `local`, else global
/// ordinal 0 (xm.is_master_ordinal).
inline bool is_master_ordinal(bool local = true) {
  return local ? runtime::local_ordinal() == 0 : runtime::global_ordinal() == 0;
}

}  // namespace lazy::dist
