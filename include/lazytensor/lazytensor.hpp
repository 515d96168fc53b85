#pragma once
// lazytensor: lazy tensors with fused, SIMD-vectorized kernels. Umbrella header: include
// this, or one module header, and link lazytensor::lazytensor. The Eigen adapter (opt-in
// <lazytensor/eigen.hpp>) is left out: with lazytensor::compiled only programs that include
// it parse Eigen (header-only code does for its GEMMs; the single header carries it).

#include <lazytensor/any_tensor.hpp>
#include <lazytensor/autograd/functional.hpp>
#include <lazytensor/autograd/record.hpp>
#include <lazytensor/core/error.hpp>
#include <lazytensor/data.hpp>
#include <lazytensor/debug/graph_dump.hpp>
#include <lazytensor/dist.hpp>
#include <lazytensor/fwd.hpp>
#include <lazytensor/io.hpp>
#include <lazytensor/nn.hpp>
#include <lazytensor/ops/conv.hpp>
#include <lazytensor/ops/linalg.hpp>
#include <lazytensor/ops/pool.hpp>
#include <lazytensor/ops/rearrange.hpp>
#include <lazytensor/ops/scan.hpp>
#include <lazytensor/ops/scatter.hpp>
#include <lazytensor/ops/shape.hpp>
#include <lazytensor/ops/softmax.hpp>
#include <lazytensor/ops/sort.hpp>
#include <lazytensor/ops/split.hpp>
#include <lazytensor/ops/statistics.hpp>
#include <lazytensor/optim.hpp>
#include <lazytensor/spmd.hpp>
#include <lazytensor/state_dict.hpp>
#include <lazytensor/tensor.hpp>
#include <lazytensor/train.hpp>
