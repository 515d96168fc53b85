#pragma once
// lazy::spmd: sharding meshes, PyTorch/XLA's SPMD (torch_xla.distributed.spmd). One program
// thread drives every device: use_spmd(), a Mesh (or HybridMesh), mark_sharding with a
// partition spec, then ordinary tensor code; the partitioner runs each sharded statement
// as one node per device, and reading a sharded tensor gathers it.

#include <lazytensor/spmd/mark_sharding.hpp>
#include <lazytensor/spmd/mesh.hpp>
#include <lazytensor/spmd/mode.hpp>
#include <lazytensor/spmd/sharding.hpp>
#include <lazytensor/dist/runtime.hpp>
