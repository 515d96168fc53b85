#pragma once
// train::TrainerOptions, Lightning's Trainer arguments, and BatchCount, the integer-or-
// fraction of its limit_*_batches and val_check_interval. Apart from the Trainer so that
// the loops and callbacks that read options name them without the Trainer's internals.

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include <lazytensor/core/config.hpp>
#include <lazytensor/core/error.hpp>
#include <lazytensor/train/callback.hpp>
#include <lazytensor/train/logger.hpp>
#include <lazytensor/train/state_text.hpp>
#include <lazytensor/train/strategy.hpp>

namespace lazy::train {

/// A number of batches (an integer) or a fraction of the loader's batches (a double in
/// [0, 1]), as Lightning's limit_*_batches and val_check_interval.
class BatchCount {
 public:
  /// `n` batches (>= 0).
  BatchCount(int n) : BatchCount(static_cast<std::int64_t>(n)) {}  // NOLINT: implicit, as Lightning's int
  /// `n` batches (>= 0).
  BatchCount(std::int64_t n) : count_(n) {  // NOLINT
    if (n < 0) throw Error("Trainer: a batch count must be >= 0, got " + std::to_string(n));
  }
  /// A fraction of the loader's batches, in [0, 1].
  BatchCount(double fraction) : fraction_(fraction) {  // NOLINT: implicit, as Lightning's float
    if (!(fraction >= 0.0 && fraction <= 1.0))
      throw Error("Trainer: a fraction of batches must be in [0, 1], got " + std::to_string(fraction));
  }
  /// How many of `total` batches (a fraction rounds down, as int(total * f)).
  std::int64_t of(std::int64_t total) const {
    if (count_) return std::min(*count_, total);
    return static_cast<std::int64_t>(static_cast<double>(total) * fraction_);
  }
  /// Whether this is a fraction.
  bool is_fraction() const { return !count_.has_value(); }
  /// How many of `total` batches of the `prefix` loader ("train", "val", ...) this limit
  /// keeps, as of(). When `total` is -1 (a loader that cannot say): an integer limit, 0 for
  /// 0.0, -1 (all) for 1.0, and an Error for another fraction. A fraction that keeps no
  /// batch of a non-empty loader is an Error, as in Lightning: it is surely a mistake (an
  /// integer 0, or 0.0, asks for none on purpose).
  std::int64_t batches_of(std::int64_t total, const std::string& prefix) const;

 private:
  std::optional<std::int64_t> count_;
  double fraction_ = 1.0;
};

/// Lightning's Trainer arguments, in the order of its signature (so designated initializers
/// read as a Lightning call: `Trainer({.devices = 2, .max_epochs = 3})`).
struct TrainerOptions {
  /// "cpu" or "auto" (lazytensor's devices are CPU executors).
  std::string accelerator = "auto";
  /// "auto" (replicas when devices > 1), "single" / "single_device", "replica" (also
  /// "ddp", "ddp_spawn", "xla": thread replicas), "spmd" (one program over a 1-D "data"
  /// mesh of the devices; under mpirun, of every process's devices), or a Strategy object.
  std::variant<std::string, std::shared_ptr<Strategy>> strategy = std::string("auto");
  /// How many devices (replicas, or mesh devices with "spmd"); nullopt: all of them for
  /// "replica" / "spmd", one otherwise.
  std::optional<int> devices = std::nullopt;
  /// "32-true" (also "32"), "64-true" ("64"), "bf16-mixed", "bf16-true" ("bf16"); empty:
  /// the strategy's plugin (default_precision(), which LAZYTENSOR_USE_BF16 changes).
  std::string precision = "";
  /// true: a CSVLogger under default_root_dir; false: none; or a Logger.
  std::variant<bool, std::shared_ptr<Logger>> logger = true;
  /// Added to the defaults (a ModelCheckpoint and a progress bar, unless disabled or
  /// given here).
  std::vector<std::shared_ptr<Callback>> callbacks = {};
  /// true: one training and one validation batch, no checkpoints or logger; a number n:
  /// n batches of each.
  std::variant<bool, std::int64_t> fast_dev_run = false;
  /// Epochs to train (default: 1000 when neither max_steps nor max_time is given, else
  /// unbounded).
  std::optional<std::int64_t> max_epochs = std::nullopt;
  /// Epochs trained even when a callback asks to stop earlier.
  std::int64_t min_epochs = 0;
  /// Optimizer steps to take at most (-1: no limit).
  std::int64_t max_steps = -1;
  /// Wall time after which training stops (checked after every batch on one replica;
  /// with replicas after every optimizer step, where they vote and stop together).
  std::optional<std::chrono::duration<double>> max_time = std::nullopt;
  BatchCount limit_train_batches = 1.0;
  BatchCount limit_val_batches = 1.0;
  BatchCount limit_test_batches = 1.0;
  BatchCount limit_predict_batches = 1.0;
  /// Validate every this many training batches (an integer), or this fraction of an
  /// epoch (a double; 1.0 = at its end).
  BatchCount val_check_interval = 1.0;
  /// Validate every this many epochs.
  std::int64_t check_val_every_n_epoch = 1;
  /// Validation batches run before training to catch errors early (-1: all).
  std::int64_t num_sanity_val_steps = 2;
  /// The logger gets the step values every this many optimizer steps.
  std::int64_t log_every_n_steps = 50;
  /// Add a ModelCheckpoint (saving the last epoch) when the callbacks have none.
  bool enable_checkpointing = true;
  /// Add a progress bar (on global rank zero) when the callbacks have none.
  bool enable_progress_bar = true;
  /// Sum the gradients of this many batches before each optimizer step (each loss scaled
  /// by 1/k, so k batches of n equal one batch of k*n).
  std::int64_t accumulate_grad_batches = 1;
  /// Clip the gradients before each optimizer step (0 or nullopt: no clipping).
  std::optional<double> gradient_clip_val = std::nullopt;
  /// "norm" (total 2-norm) or "value" (element-wise).
  std::string gradient_clip_algorithm = "norm";
  /// Reseed every replica's random stream at the start of each epoch from the run's seed,
  /// the epoch and the rank, so a resumed run repeats the uninterrupted one bitwise.
  bool deterministic = false;
  /// With replicas, give each replica its share of a data::DataLoader's samples (a
  /// DistributedSampler over the loader's dataset, shuffled when the loader shuffles).
  bool use_distributed_sampler = true;
  /// Where the default logger and checkpoints go.
  std::string default_root_dir = ".";
};

#if LAZYTENSOR_HEADER_DEFINITIONS

LAZYTENSOR_INLINE std::int64_t BatchCount::batches_of(std::int64_t total,
                                                      const std::string& prefix) const {
  if (total < 0) {
    // A loader that cannot say its length (Lightning's iterable datasets): an integer limit
    // is the count (the loop also ends when the loader does), 1.0 means all, 0.0 none;
    // another fraction of an unknown length cannot be taken.
    if (count_) return *count_;
    if (fraction_ == 0.0) return 0;
    if (fraction_ == 1.0) return -1;
    throw Error("Trainer: limit_" + prefix + "_batches = " + detail::short_double(fraction_) +
                " is a fraction of a loader that does not know its length; expected 1.0, 0.0 or "
                "an integer number of batches");
  }
  const std::int64_t n = of(total);
  if (n == 0 && total > 0 && is_fraction() && fraction_ > 0) {
    const std::string f = detail::short_double(fraction_);
    throw Error("Trainer: you requested to check " + f + " of the " + prefix + " dataloader but " +
                f + " * " + std::to_string(total) + " < 1 batch; expected limit_" + prefix +
                "_batches of at least " + detail::short_double(1.0 / static_cast<double>(total)) +
                " (or 0 to skip it)");
  }
  return n;
}

#endif  // LAZYTENSOR_HEADER_DEFINITIONS

}  // namespace lazy::train
