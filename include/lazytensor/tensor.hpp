#pragma once
// lazytensor's core module: what a program that computes with tensors includes.
//
//   Tensor<T> and Device, element-wise expressions (operators and functions), factories
//   (zeros/ones/full/from_vector/arange/..., randn/rand/randint/...), reductions, matmul and
//   linear, mark_step/sync and the other step controls, and the metrics report.
//
// Shape ops, softmax, convolution and pooling are in <lazytensor/ops/...>; the frontend
// modules (nn, optim, data, io, dist) have one header each; <lazytensor/lazytensor.hpp>
// includes everything, <lazytensor/fwd.hpp> only declares.

#include <lazytensor/debug/metrics.hpp>
#include <lazytensor/ops/factories.hpp>
#include <lazytensor/ops/matmul.hpp>
#include <lazytensor/ops/random.hpp>
#include <lazytensor/ops/reduction.hpp>
#include <lazytensor/tensor/device.hpp>
#include <lazytensor/tensor/tensor.hpp>
