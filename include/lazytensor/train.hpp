#pragma once
// lazy::train: Lightning's layer over lazytensor's devices and replicas. Strategies say
// where a model runs and how replicas talk (Strategy, SingleDeviceStrategy,
// ReplicaStrategy: the analogue of XLAStrategy / DDPSpawnStrategy on thread replicas;
// SpmdStrategy: one program thread over a sharded device mesh);
// precision plugins say in which dtype it computes ("32-true", "64-true", "bf16-mixed",
// "bf16-true"); the Accelerator joins both for each step. A training loop written against
// them runs unchanged on one device or on many, in any precision.

#include <lazytensor/nn/utils/clip_grad.hpp>
#include <lazytensor/train/accelerator.hpp>
#include <lazytensor/train/precision.hpp>
#include <lazytensor/train/replica.hpp>
#include <lazytensor/train/single_device.hpp>
#include <lazytensor/train/spmd_strategy.hpp>
#include <lazytensor/train/strategy.hpp>
