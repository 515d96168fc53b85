#pragma once
// train::Trainer, Lightning's: it runs a LightningModule's training, validation, test and
// prediction loops on a strategy, with callbacks, a logger and checkpoints. This header
// holds the Trainer object and its options; train/loops.hpp holds the loops (fit, validate,
// test, predict), and train/default_callbacks.hpp what the Trainer adds on its own (a
// ModelCheckpoint, a progress bar, a CSVLogger). Include <lazytensor/train.hpp>.
//
// One Trainer serves every replica the strategy launches: whatever belongs to a replica (its
// module, optimizer, callbacks' copies, logged values, progress) lives in a per-replica run
// that the accessors find from the calling thread's rank, as Strategy does. After a fit the
// accessors show global rank zero's run.

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <variant>
#include <vector>

#include <lazytensor/core/config.hpp>
#include <lazytensor/core/error.hpp>
#include <lazytensor/dist/runtime.hpp>
#include <lazytensor/state_dict.hpp>
#include <lazytensor/io/safetensors.hpp>
#include <lazytensor/spmd/mesh.hpp>
#include <lazytensor/train/accelerator.hpp>
#include <lazytensor/train/callback.hpp>
#include <lazytensor/train/lightning_module.hpp>
#include <lazytensor/train/logger.hpp>
#include <lazytensor/train/metrics.hpp>
#include <lazytensor/train/precision.hpp>
#include <lazytensor/train/replica.hpp>
#include <lazytensor/train/single_device.hpp>
#include <lazytensor/train/spmd_strategy.hpp>
#include <lazytensor/train/state_text.hpp>
#include <lazytensor/train/strategy.hpp>
#include <lazytensor/train/trainer_options.hpp>

namespace lazy::train {

namespace detail {

/// What the Trainer keeps for one replica.
struct ReplicaRun {
  explicit ReplicaRun(const Strategy& s) : metrics(s) {}
  LightningModuleBase* module = nullptr;
  Progress progress;
  MetricStore metrics;
  std::vector<std::shared_ptr<Callback>> callbacks;  // this replica's copies
  std::vector<bool> shared_callback;                 // no copy: hooks on rank zero only
  OptimizerConfig optim;
  std::vector<SchedulerConfig> schedulers;  // optim's, in stepping order
  bool should_stop = false;
  Loop stage = Loop::Train;
  bool running = false;                 // inside a loop
  std::int64_t num_training_batches = 0;
  std::int64_t num_val_batches = 0;
  bool fitting = false;                 // the run is a fit (not validate/test/predict)
  std::int64_t epoch_batches_done = 0;  // training batches finished in the current epoch
  bool epoch_finished = false;          // its batches and scheduler step are done
  std::int64_t resume_batches = 0;      // batches to skip in the first resumed epoch
  std::int64_t samples = 0;             // training samples seen in this fit
  std::int64_t estimated_stepping_batches = -1;
  std::uint64_t seed = 0;               // the run's seed (deterministic reseeding)
  std::chrono::steady_clock::time_point started;
};

/// The default callbacks and logger (defined in train/default_callbacks.hpp; these and
/// make_strategy are templates, their parameter unused, for the Trainer's constructor).
template <class = void>
void add_default_callbacks(std::vector<std::shared_ptr<Callback>>& callbacks, const TrainerOptions& options,
                           bool checkpointing, bool progress_bar);
template <class = void>
std::shared_ptr<Logger> make_default_logger(const TrainerOptions& options);
/// The strategy an option names.
template <class = void>
std::shared_ptr<Strategy> make_strategy(const TrainerOptions& options);
/// The checkpoint ckpt_path "last" resumes (Lightning's `_find_last_checkpoints` of every
/// ModelCheckpoint among `callbacks`, then the newest by modification time): of the files
/// "last*.safetensors" in their directories (`default_dir` for one whose directory is not
/// resolved yet), the most recently modified; empty when there is none (defined in
/// train/model_checkpoint.hpp).
std::string last_checkpoint_path(const std::vector<std::shared_ptr<Callback>>& callbacks,
                                 const std::string& default_dir);
/// Checks that no two stateful callbacks share a state_key; `states` holds each callback's
/// state_dict(), in order.
void check_state_keys(const std::vector<std::shared_ptr<Callback>>& callbacks,
                      const std::vector<std::map<std::string, std::string>>& states);

}  // namespace detail

/// Lightning's Trainer (see the file comment; the loops are in train/loops.hpp).
class Trainer {
 public:
  /// Checks the options and builds the strategy, precision plugin, logger and callbacks.
  /// (A template, its parameter unused, so that a program that never constructs a
  /// Trainer compiles none of what it builds.)
  template <class = void>
  explicit Trainer(TrainerOptions options = {});

  // ---- the loops (train/loops.hpp) -------------------------------------------------------

  /// Trains `module` on `train` (validating on `val` when given). `ckpt_path` resumes from
  /// a checkpoint file, or "last" (the most recently modified last*.safetensors in a
  /// ModelCheckpoint's directory, as Lightning's).
  /// With replicas, global rank zero trains `module` and every other replica a
  /// default-constructed module of the same type (its parameters made rank zero's by the
  /// strategy), each on its share of the loader's samples.
  template <class M, class TrainLoader, class ValLoader>
    requires(!std::is_convertible_v<ValLoader&, std::string>)  // fit(m, train, "last") is a ckpt_path
  void fit(M& module, TrainLoader& train, ValLoader& val, const std::string& ckpt_path = "");
  /// fit without validation.
  template <class M, class TrainLoader>
  void fit(M& module, TrainLoader& train, const std::string& ckpt_path = "");
  /// One validation epoch; returns the epoch's values (Lightning's list of one dict).
  template <class M, class Loader>
  std::vector<std::map<std::string, double>> validate(M& module, Loader& val, const std::string& ckpt_path = "");
  /// One test epoch; returns its values.
  template <class M, class Loader>
  std::vector<std::map<std::string, double>> test(M& module, Loader& data, const std::string& ckpt_path = "");
  /// predict_step over every batch; global rank zero's predictions in order.
  template <class M, class Loader>
  std::vector<AnyTensor> predict(M& module, Loader& data, const std::string& ckpt_path = "");

  // ---- state (of the calling replica; of global rank zero outside the loops) -----------

  const TrainerOptions& options() const { return options_; }
  /// The strategy (shared by the replicas).
  Strategy& strategy() const { return *strategy_; }
  /// The logger, or nullptr.
  const std::shared_ptr<Logger>& logger() const { return logger_; }
  /// This replica's callbacks (defaults included).
  const std::vector<std::shared_ptr<Callback>>& callbacks() const { return run().callbacks; }
  /// The module being run.
  LightningModuleBase& lightning_module() const;
  /// The current epoch (0-based).
  std::int64_t current_epoch() const { return run().progress.epoch; }
  /// Optimizer steps taken.
  std::int64_t global_step() const { return run().progress.global_step; }
  /// The epoch limit in force.
  std::int64_t max_epochs() const { return max_epochs_; }
  std::int64_t min_epochs() const { return options_.min_epochs; }
  std::int64_t max_steps() const { return options_.max_steps; }
  /// Training batches of the current epoch (after limits).
  std::int64_t num_training_batches() const { return run().num_training_batches; }
  /// Validation batches of the current validation epoch (after limits).
  std::int64_t num_val_batches() const { return run().num_val_batches; }
  /// Training samples seen in this fit on this replica (the first dimension of a batch's
  /// first tensor, summed).
  std::int64_t samples_seen() const { return run().samples; }
  /// The optimizer steps the fit will take (Lightning's estimated_stepping_batches: the
  /// epochs' batches after limits and accumulation, capped by max_steps; -1 when a loader
  /// cannot say its length and no max_steps bounds it). Known from configure_optimizers on.
  std::int64_t estimated_stepping_batches() const { return run().estimated_stepping_batches; }
  /// Seconds since this fit started.
  double elapsed_seconds() const;
  /// Whether a stop was requested. Training ends after the current batch (with replicas:
  /// after the next optimizer step, where any replica's request stops every one), or at
  /// the end of the min_epochs-th epoch when fewer are done. Set by callbacks
  /// (EarlyStopping) or the module, on any replica.
  bool should_stop() const { return run().should_stop; }
  void set_should_stop(bool stop) { run().should_stop = stop; }
  /// Whether a fit is running (Lightning's trainer.state.fn == "fit"): ModelCheckpoint and
  /// EarlyStopping act only then, not in a validate() or test() of their own.
  bool fitting() const { return run().running && run().fitting; }
  bool sanity_checking() const { return run().running && run().stage == detail::Loop::Sanity; }
  bool training() const { return run().running && run().stage == detail::Loop::Train; }
  bool validating() const { return run().running && run().stage == detail::Loop::Validate; }
  bool testing() const { return run().running && run().stage == detail::Loop::Test; }
  bool predicting() const { return run().running && run().stage == detail::Loop::Predict; }
  /// Values callbacks can monitor (epoch values by name, step values by name or name_step).
  const std::map<std::string, double>& callback_metrics() const { return run().metrics.callback_metrics(); }
  /// What the logger got last.
  const std::map<std::string, double>& logged_metrics() const { return run().metrics.logged_metrics(); }
  /// What the progress bar shows.
  const std::map<std::string, double>& progress_bar_metrics() const { return run().metrics.progress_bar_metrics(); }
  /// Step-level values of this replica as they are now (no synchronization; the
  /// progress bar reads them on global rank zero).
  std::map<std::string, double> read_local_step_metrics() { return run().metrics.read_step(false).progress_bar; }
  /// The optimizer configure_optimizers returned.
  optim::Optimizer& optimizer() const;
  /// The first of its learning-rate schedulers, or nullptr.
  optim::LRScheduler* lr_scheduler() const {
    return run().schedulers.empty() ? nullptr : run().schedulers.front().scheduler.get();
  }
  /// When the first scheduler steps: "epoch" or "step".
  const std::string& lr_scheduler_interval() const {
    return run().schedulers.empty() ? run().optim.interval : run().schedulers.front().interval;
  }
  /// Every scheduler configure_optimizers returned, with its interval and frequency, in
  /// the order the Trainer steps them (Lightning's lr_scheduler_configs).
  const std::vector<SchedulerConfig>& lr_scheduler_configs() const { return run().schedulers; }
  bool is_global_zero() const { return strategy_->is_global_zero(); }
  int world_size() const { return strategy_->world_size(); }
  int global_rank() const { return strategy_->global_rank(); }
  /// default_root_dir.
  const std::string& default_root_dir() const { return options_.default_root_dir; }
  /// The logger's directory, or default_root_dir without a logger that writes files.
  std::string log_dir() const;
  /// Whether fast_dev_run is on.
  bool fast_dev_run() const { return fast_dev_run_ > 0; }

  // ---- checkpoints -----------------------------------------------------------------------

  /// Saves the run to `path` (a collective: every replica calls it): the module's state
  /// dict ("state_dict.*"), the optimizer's ("optimizer.*"), and in the metadata the
  /// epoch and step to resume at, each scheduler's state, every callback's state, the
  /// hyper-parameters, the monitored values and the random state. Written by global rank
  /// zero through a temporary file, fsync and rename.
  void save_checkpoint(const std::string& path);
  /// The checkpoint of the current run as a StateDict (what save_checkpoint writes).
  StateDict dump_checkpoint();
  /// Restores a checkpoint into the current run (module, optimizer, scheduler, progress,
  /// callbacks, values). Called by the loops for ckpt_path.
  void restore_checkpoint(const StateDict& checkpoint, bool restore_training_state);

 private:
  template <class M, class TrainLoader, class ValLoader>
  void fit_impl(M& module, TrainLoader& train, ValLoader* val, const std::string& ckpt_path);
  template <class M, class Loader, class Run>
  auto launch_replicas(M& module, Run run_fn);
  template <class M, class Loader>
  std::vector<std::map<std::string, double>> evaluate(M& module, Loader& data, const std::string& ckpt_path,
                                                      detail::Loop loop);
  template <class M, class Loader>
  std::map<std::string, double> eval_epoch(M& module, Loader& data, detail::Loop loop, std::int64_t limit);
  template <class F>
  void each_callback(F f);
  std::string resolve_ckpt_path(const std::string& ckpt_path) const;
  void begin_replica(LightningModuleBase& module);
  void log_to_logger(const std::map<std::string, double>& values);
  void call_on_exception(const std::exception& e);
  bool time_is_up() const;

  detail::ReplicaRun& run() const;

  TrainerOptions options_;
  std::shared_ptr<Strategy> strategy_;
  std::shared_ptr<Logger> logger_;
  std::vector<std::shared_ptr<Callback>> callbacks_;
  std::int64_t max_epochs_ = 1000;
  std::int64_t fast_dev_run_ = 0;
  mutable std::vector<std::unique_ptr<detail::ReplicaRun>> runs_;
};

template <class F>
void Trainer::each_callback(F f) {
  detail::ReplicaRun& r = run();
  for (std::size_t i = 0; i < r.callbacks.size(); ++i) {
    if (r.shared_callback[i] && !is_global_zero()) continue;
    f(*r.callbacks[i]);
  }
}

#if LAZYTENSOR_HEADER_DEFINITIONS
namespace detail {

/// A checkpoint keeps each stateful callback's state under its state_key: two with one key
/// would write over each other's entries and restore a mix (Lightning raises too). A
/// callback counts as stateful when it has state to save now (ModelCheckpoint and
/// EarlyStopping always do).
LAZYTENSOR_INLINE void check_state_keys(
    const std::vector<std::shared_ptr<Callback>>& callbacks,
    const std::vector<std::map<std::string, std::string>>& states) {
  std::map<std::string, std::size_t> stateful;
  for (std::size_t i = 0; i < callbacks.size(); ++i) {
    if (states[i].empty()) continue;
    const std::string key = callbacks[i]->state_key();
    if (!stateful.emplace(key, i).second)
      throw Error("Trainer: found more than one stateful callback with the same state key \"" +
                  key + "\" (callbacks " + std::to_string(stateful.at(key)) + " and " +
                  std::to_string(i) +
                  "); expected every stateful callback's state_key to be unique (give them "
                  "different settings, such as monitor or mode)");
  }
}

template <class>
std::shared_ptr<Strategy> make_strategy(const TrainerOptions& o) {
  if (const auto* given = std::get_if<std::shared_ptr<Strategy>>(&o.strategy)) {
    if (!*given) throw Error("Trainer: the strategy object is empty");
    return *given;
  }
  std::string name = std::get<std::string>(o.strategy);
  if (o.devices && *o.devices < 1) throw Error("Trainer: devices must be >= 1, got " + std::to_string(*o.devices));
  if (name == "auto") name = o.devices.value_or(1) > 1 ? "replica" : "single";
  if (name == "single" || name == "single_device") {
    if (o.devices.value_or(1) != 1)
      throw Error("Trainer: strategy \"" + name + "\" runs on one device, got devices = " + std::to_string(*o.devices));
    return std::make_shared<SingleDeviceStrategy>(lazy::device());
  }
  const int n = o.devices.value_or(device_count());
  if (name == "replica" || name == "ddp" || name == "ddp_spawn" || name == "xla") return std::make_shared<ReplicaStrategy>(n);
  if (name == "spmd") {
    // Under mpirun the mesh spans the processes (devices per process, as Lightning's
    // `devices` with num_nodes): each must give it all its devices.
    const int processes = runtime::process_count();
    if (processes > 1 && n != device_count())
      throw Error("Trainer: strategy \"spmd\" across " + std::to_string(processes) +
                  " processes takes every device of each (devices = " + std::to_string(device_count()) +
                  ", LAZYTENSOR_NUM_DEVICES), got devices = " + std::to_string(n));
    const int total = n * processes;
    std::vector<int> ids(static_cast<std::size_t>(total));
    for (int i = 0; i < total; ++i) ids[static_cast<std::size_t>(i)] = i;
    return std::make_shared<SpmdStrategy>(spmd::Mesh(ids, {total}, {"data"}));
  }
  throw Error("Trainer: unknown strategy \"" + name +
              "\" (expected \"auto\", \"single\", \"single_device\", \"replica\", \"ddp\", \"ddp_spawn\", \"xla\" or \"spmd\")");
}

}  // namespace detail

template <class>
Trainer::Trainer(TrainerOptions options) : options_(std::move(options)) {
  TrainerOptions& o = options_;
  auto at_least = [](std::int64_t v, std::int64_t lo, const char* name) {
    if (v < lo) throw Error(std::string("Trainer: ") + name + " must be >= " + std::to_string(lo) + ", got " + std::to_string(v));
  };
  if (const auto* on = std::get_if<bool>(&o.fast_dev_run)) {
    fast_dev_run_ = *on ? 1 : 0;
  } else {
    fast_dev_run_ = std::get<std::int64_t>(o.fast_dev_run);
    at_least(fast_dev_run_, 0, "fast_dev_run");
  }
  at_least(o.min_epochs, 0, "min_epochs");
  at_least(o.max_steps, -1, "max_steps");
  at_least(o.check_val_every_n_epoch, 1, "check_val_every_n_epoch");
  at_least(o.num_sanity_val_steps, -1, "num_sanity_val_steps");
  at_least(o.log_every_n_steps, 1, "log_every_n_steps");
  at_least(o.accumulate_grad_batches, 1, "accumulate_grad_batches");
  if (o.max_epochs) {
    at_least(*o.max_epochs, -1, "max_epochs");
    max_epochs_ = *o.max_epochs;
  } else {
    max_epochs_ = (o.max_steps == -1 && !o.max_time) ? 1000 : -1;
  }
  if (o.max_time && !(o.max_time->count() >= 0))
    throw Error("Trainer: max_time must be >= 0 seconds, got " + std::to_string(o.max_time->count()));
  if (o.gradient_clip_val && !(*o.gradient_clip_val >= 0))
    throw Error("Trainer: gradient_clip_val must be >= 0, got " +
                std::to_string(*o.gradient_clip_val));
  // An integer val_check_interval counts batches between validations: 0 would validate
  // never (Lightning divides by it). The fraction 0.0 means every batch, as in Lightning.
  if (!o.val_check_interval.is_fraction() && o.val_check_interval.of(1) == 0)
    throw Error(
        "Trainer: val_check_interval as a number of batches must be >= 1, got 0 (to "
        "validate every batch use 1; to skip validation set limit_val_batches = 0)");
  if (o.gradient_clip_algorithm != "norm" && o.gradient_clip_algorithm != "value")
    throw Error("Trainer: gradient_clip_algorithm must be \"norm\" or \"value\", got \"" + o.gradient_clip_algorithm + "\"");
  if (fast_dev_run_ > 0) {
    // Lightning's fast_dev_run: n batches of each loop, one epoch, nothing written.
    max_epochs_ = 1;
    o.limit_train_batches = fast_dev_run_;
    o.limit_val_batches = fast_dev_run_;
    o.limit_test_batches = fast_dev_run_;
    o.limit_predict_batches = fast_dev_run_;
    o.val_check_interval = 1.0;
    o.num_sanity_val_steps = 0;
    o.max_steps = fast_dev_run_;
  }
  strategy_ = detail::make_strategy(o);
  (void)make_accelerator(o.accelerator, *strategy_);  // checks the name
  if (!o.precision.empty()) strategy_->set_precision_plugin(make_precision(o.precision));
  if (const auto* l = std::get_if<std::shared_ptr<Logger>>(&o.logger)) {
    logger_ = *l;
  } else if (std::get<bool>(o.logger) && fast_dev_run_ == 0) {
    logger_ = detail::make_default_logger(o);
  }
  callbacks_ = o.callbacks;
  for (const auto& c : callbacks_)
    if (!c) throw Error("Trainer: a callback is empty");
  detail::add_default_callbacks(callbacks_, o, o.enable_checkpointing && fast_dev_run_ == 0,
                                o.enable_progress_bar);
  // Early, as Lightning does; dump_checkpoint checks again, for a callback whose state
  // appears later.
  std::vector<std::map<std::string, std::string>> states;
  for (const auto& c : callbacks_) states.push_back(c->state_dict());
  detail::check_state_keys(callbacks_, states);
  runs_.push_back(std::make_unique<detail::ReplicaRun>(*strategy_));
  runs_.back()->callbacks = callbacks_;
  runs_.back()->shared_callback.assign(callbacks_.size(), false);
}

LAZYTENSOR_INLINE detail::ReplicaRun& Trainer::run() const {
  // One run per replica of this process (under MPI the other processes hold the others').
  const auto* ctx = dist::detail::current_context();
  const auto r = static_cast<std::size_t>(ctx ? ctx->local : 0);
  if (r >= runs_.size()) throw Error("Trainer: no run for rank " + std::to_string(strategy_->global_rank()));
  return *runs_[r];
}

LAZYTENSOR_INLINE LightningModuleBase& Trainer::lightning_module() const {
  if (!run().module) throw Error("Trainer::lightning_module: no module is attached (outside fit/validate/test/predict)");
  return *run().module;
}

LAZYTENSOR_INLINE optim::Optimizer& Trainer::optimizer() const {
  if (!run().optim.optimizer) throw Error("Trainer::optimizer: no optimizer (configure_optimizers runs in fit)");
  return *run().optim.optimizer;
}

LAZYTENSOR_INLINE double Trainer::elapsed_seconds() const {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - run().started).count();
}

LAZYTENSOR_INLINE bool Trainer::time_is_up() const {
  if (!options_.max_time) return false;
  const bool up = elapsed_seconds() >= options_.max_time->count();
  // An SPMD program spanning processes: each reads its own clock, and all stop at the
  // step where the first one's time is up (every process asks at the same points).
  if (spmd::detail::process_span().count > 1) {
    const auto votes = spmd::detail::span_rendezvous(up, "Trainer: max_time");
    return std::find(votes.begin(), votes.end(), true) != votes.end();
  }
  return up;
}

LAZYTENSOR_INLINE std::string Trainer::log_dir() const {
  if (logger_ && !logger_->log_dir().empty()) return logger_->log_dir();
  return options_.default_root_dir;
}

LAZYTENSOR_INLINE void Trainer::log_to_logger(const std::map<std::string, double>& values) {
  if (!logger_ || values.empty() || !is_global_zero()) return;
  std::map<std::string, double> row = values;
  row["epoch"] = static_cast<double>(current_epoch());
  logger_->log_metrics(row, global_step());
}

LAZYTENSOR_INLINE void Trainer::begin_replica(LightningModuleBase& module) {
  detail::ReplicaRun& r = run();
  r.module = &module;
  module.trainer_ = this;
  module.metrics_ = &r.metrics;
  module.progress_ = &r.progress;
}

LAZYTENSOR_INLINE void Trainer::call_on_exception(const std::exception& e) {
  detail::ReplicaRun& r = run();
  if (!r.module) return;
  each_callback([&](Callback& c) {
    try {
      c.on_exception(*this, *r.module, e);
    } catch (...) {
      // The first error is the one reported.
    }
  });
  if (logger_ && is_global_zero()) {
    try {
      logger_->finalize("failed");
    } catch (...) {
    }
  }
}

LAZYTENSOR_INLINE std::string Trainer::resolve_ckpt_path(const std::string& ckpt_path) const {
  if (ckpt_path != "last") return ckpt_path;
  // (Lightning warns and starts afresh; a resume asked for and impossible is an error here.)
  const std::string last =
      detail::last_checkpoint_path(run().callbacks, log_dir() + "/checkpoints");
  if (last.empty())
    throw Error(
        "Trainer: ckpt_path \"last\": expected a last*.safetensors checkpoint in the directory of "
        "a "
        "ModelCheckpoint (one with save_last writes it), found none");
  return last;
}

LAZYTENSOR_INLINE StateDict Trainer::dump_checkpoint() {
  detail::ReplicaRun& r = run();
  LightningModuleBase& m = lightning_module();
  StateDict sd;
  for (const auto& [name, t] : m.state_dict()) sd.insert("state_dict." + name, t);
  auto& meta = sd.metadata();
  meta["lazytensor.checkpoint"] = "trainer 1";
  if (r.optim.optimizer) {
    const StateDict osd = r.optim.optimizer->state_dict();
    for (const auto& [name, t] : osd) sd.insert("optimizer." + name, t);
    for (const auto& [k, v] : osd.metadata()) meta["optimizer." + k] = v;
  }
  for (std::size_t i = 0; i < r.schedulers.size(); ++i)
    for (const auto& [k, v] : r.schedulers[i].scheduler->state_dict())
      meta["lr_schedulers." + std::to_string(i) + "." + k] = v;
  // Where a resumed run starts: after a finished epoch, the next one.
  const bool epoch_done = r.epoch_finished;
  meta["epoch"] = std::to_string(r.progress.epoch + (epoch_done ? 1 : 0));
  meta["batch"] = std::to_string(epoch_done ? 0 : r.epoch_batches_done);
  meta["global_step"] = std::to_string(r.progress.global_step);
  meta["seed"] = std::to_string(r.seed);
  const std::uint64_t rng = get_rng_state();
  if (strategy_->is_distributed()) {
    const auto all = dist::mesh_reduce("Trainer checkpoint rng_state", rng,
                                       [](const std::vector<std::uint64_t>& v) { return v; });
    for (std::size_t i = 0; i < all.size(); ++i) meta["rng_state." + std::to_string(i)] = std::to_string(all[i]);
  } else {
    meta["rng_state.0"] = std::to_string(rng);
  }
  // Each callback's state is taken once: the check and the checkpoint see the same state,
  // and a callback whose state_dict() costs (or changes) is asked once per save.
  std::vector<std::map<std::string, std::string>> states;
  for (const auto& c : r.callbacks) states.push_back(c->state_dict());
  detail::check_state_keys(r.callbacks, states);
  for (std::size_t i = 0; i < r.callbacks.size(); ++i) {
    const std::string key = "callbacks." + r.callbacks[i]->state_key() + ".";
    for (const auto& [k, v] : states[i]) meta[key + k] = v;
  }
  for (const auto& [k, v] : m.hparams) meta["hparams." + k] = v;
  for (const auto& [k, v] : r.metrics.callback_metrics()) meta["callback_metrics." + k] = detail::double_text(v);
  m.on_save_checkpoint(sd);
  return sd;
}

LAZYTENSOR_INLINE void Trainer::save_checkpoint(const std::string& path) {
  strategy_->save_checkpoint(dump_checkpoint(), path);
}

LAZYTENSOR_INLINE void Trainer::restore_checkpoint(const StateDict& ckpt, bool training_state) {
  detail::ReplicaRun& r = run();
  LightningModuleBase& m = lightning_module();
  const auto& meta = ckpt.metadata();
  if (!meta.count("lazytensor.checkpoint"))
    throw Error("Trainer: the file is not a Trainer checkpoint (no \"lazytensor.checkpoint\" metadata)");
  auto strip = [&](const std::string& prefix, bool with_metadata) {
    StateDict out;
    for (const auto& [name, t] : ckpt)
      if (name.rfind(prefix, 0) == 0) out.insert(name.substr(prefix.size()), t);
    if (with_metadata)
      for (const auto& [k, v] : meta)
        if (k.rfind(prefix, 0) == 0) out.metadata()[k.substr(prefix.size())] = v;
    return out;
  };
  auto number = [&](const std::string& key) {
    const auto it = meta.find(key);
    if (it == meta.end()) throw Error("Trainer: the checkpoint has no \"" + key + "\" entry");
    return detail::parse_int(it->second, "Trainer: checkpoint entry \"" + key + "\"");
  };
  m.load_state_dict(strip("state_dict.", false));
  if (training_state) {
    if (r.optim.optimizer) r.optim.optimizer->load_state_dict(strip("optimizer.", true));
    // Each scheduler's own state; the rates came back with the optimizer's (torch's order).
    // A checkpoint of before keeps one scheduler's step, "lr_scheduler.last_epoch".
    std::size_t saved = 0;
    for (const auto& [k, v] : meta)
      if (k.rfind("lr_schedulers.", 0) == 0)
        saved = std::max<std::size_t>(saved,
                                      detail::parse_int(k.substr(14, k.find('.', 14) - 14),
                                                        "Trainer: checkpoint entry \"" + k + "\"") +
                                          1);
    const bool old_format = saved == 0 && meta.count("lr_scheduler.last_epoch");
    if ((old_format ? 1 : saved) != r.schedulers.size())
      throw Error("Trainer: the checkpoint holds the states of " +
                  std::to_string(old_format ? 1 : saved) + " learning-rate schedulers, expected " +
                  std::to_string(r.schedulers.size()) + " (what configure_optimizers returned)");
    for (std::size_t i = 0; i < r.schedulers.size(); ++i) {
      if (old_format) {
        r.schedulers[i].scheduler->set_last_epoch(number("lr_scheduler.last_epoch"));
        continue;
      }
      const std::string prefix = "lr_schedulers." + std::to_string(i) + ".";
      std::map<std::string, std::string> state;
      for (const auto& [k, v] : meta)
        if (k.rfind(prefix, 0) == 0) state[k.substr(prefix.size())] = v;
      r.schedulers[i].scheduler->load_state_dict(state);
    }
    r.progress.epoch = number("epoch");
    r.resume_batches = number("batch");
    r.progress.global_step = number("global_step");
    if (!meta.count("seed")) throw Error("Trainer: the checkpoint has no \"seed\" entry");
    r.seed = detail::parse_uint64(meta.at("seed"), "Trainer: checkpoint entry \"seed\"");
    for (auto& cb : r.callbacks) {
      const std::string prefix = "callbacks." + cb->state_key() + ".";
      std::map<std::string, std::string> state;
      for (const auto& [k, v] : meta)
        if (k.rfind(prefix, 0) == 0) state[k.substr(prefix.size())] = v;
      cb->load_state_dict(state);
    }
    std::map<std::string, double> monitored;
    for (const auto& [k, v] : meta)
      if (k.rfind("callback_metrics.", 0) == 0) monitored[k.substr(17)] = detail::parse_double(v, "Trainer: checkpoint entry \"" + k + "\"");
    r.metrics.set_callback_metrics(std::move(monitored));
  }
  m.on_load_checkpoint(ckpt);
}

#endif  // LAZYTENSOR_HEADER_DEFINITIONS

}  // namespace lazy::train
