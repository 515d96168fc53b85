#pragma once
// lazy::dist and lazy::runtime: replicas as threads (spawn), runtime queries, tensor
// collectives (all_reduce, all_gather, reduce_scatter, all_to_all, broadcast) and host-side
// ones (barrier, rendezvous, mesh_reduce, broadcast_object), as torch_xla's xmp.spawn,
// torch_xla.runtime and xla_model; optimizer_step and the device loaders (ParallelLoader,
// MpDeviceLoader) of data-parallel training.

#include <lazytensor/dist/collectives.hpp>
#include <lazytensor/dist/host_collectives.hpp>
#include <lazytensor/dist/optimizer_step.hpp>
#include <lazytensor/dist/parallel_loader.hpp>
#include <lazytensor/dist/reduce_op.hpp>
#include <lazytensor/dist/runtime.hpp>
#include <lazytensor/dist/spawn.hpp>
#include <lazytensor/dist/world.hpp>
