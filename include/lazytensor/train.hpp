#pragma once
// lazy::train: Lightning's layer over lazytensor's devices and replicas. Strategies say
// where a model runs and how replicas talk (Strategy, SingleDeviceStrategy,
// ReplicaStrategy: the analogue of XLAStrategy / DDPSpawnStrategy on thread replicas); a
// training loop written against them runs unchanged on one device or on many.

#include <lazytensor/nn/utils/clip_grad.hpp>
#include <lazytensor/train/replica.hpp>
#include <lazytensor/train/single_device.hpp>
#include <lazytensor/train/strategy.hpp>
