#pragma once
// lazy::train: Lightning's layer over lazytensor's devices and replicas. Strategies say
// where a model runs and how replicas talk (Strategy, SingleDeviceStrategy,
// ReplicaStrategy: the analogue of XLAStrategy / DDPSpawnStrategy on thread replicas;
// SpmdStrategy: one program thread over a sharded device mesh);
// precision plugins say in which dtype it computes ("32-true", "64-true", "bf16-mixed",
// "bf16-true"); the Accelerator joins both for each step. A training loop written against
// them runs unchanged on one device or on many, in any precision. On top, Lightning's
// Trainer runs a LightningModule's loops with callbacks (ModelCheckpoint, EarlyStopping,
// ProgressBar, LearningRateMonitor), a logger (CSVLogger) and resumable checkpoints.

#include <lazytensor/nn/utils/clip_grad.hpp>
#include <lazytensor/train/accelerator.hpp>
#include <lazytensor/train/callback.hpp>
#include <lazytensor/train/csv_logger.hpp>
#include <lazytensor/train/default_callbacks.hpp>
#include <lazytensor/train/early_stopping.hpp>
#include <lazytensor/train/lightning_module.hpp>
#include <lazytensor/train/logger.hpp>
#include <lazytensor/train/loops.hpp>
#include <lazytensor/train/lr_monitor.hpp>
#include <lazytensor/train/metrics.hpp>
#include <lazytensor/train/model_checkpoint.hpp>
#include <lazytensor/train/precision.hpp>
#include <lazytensor/train/progress_bar.hpp>
#include <lazytensor/train/replica.hpp>
#include <lazytensor/train/single_device.hpp>
#include <lazytensor/train/spmd_strategy.hpp>
#include <lazytensor/train/strategy.hpp>
#include <lazytensor/train/trainer.hpp>
