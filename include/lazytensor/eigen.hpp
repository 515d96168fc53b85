#pragma once
// lazytensor with Eigen: lazy::from_eigen(matrix) and tensor.eigen(), a row-major
// Eigen::Map of a tensor's values. Apart from <lazytensor/tensor.hpp> so that only programs
// that use Eigen parse it.

#include <lazytensor/ops/eigen.hpp>
#include <lazytensor/tensor.hpp>
