#pragma once
// What LightningModule::log records, and how the Trainer reads it (Lightning's logger
// connector and result collection).
//
// A logged value stays a tensor on the replica's device: the step's last value, and for
// epoch-level keys a running weighted sum, both updated lazily inside the step's graph. So
// logging costs no synchronization; values are read only at the points where something
// needs numbers: every log_every_n_steps steps (the logger), at the end of a loop's epoch
// (callbacks, logger), and by the progress bar on rank zero (its local values). The reads
// at fixed points are collectives when the strategy is distributed: the replicas first
// compare the keys they logged (different keys raise an Error naming them, on every
// replica), then reduce the sync_dist values in key order.

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <lazytensor/any_tensor.hpp>
#include <lazytensor/core/config.hpp>
#include <lazytensor/core/error.hpp>
#include <lazytensor/dist/host_collectives.hpp>
#include <lazytensor/ops/factories.hpp>
#include <lazytensor/ops/reshape.hpp>
#include <lazytensor/tensor/tensor.hpp>
#include <lazytensor/train/strategy.hpp>

namespace lazy::train {

/// The arguments of Lightning's self.log.
struct LogOptions {
  /// Also shown by the progress bar.
  bool prog_bar = false;
  /// Record the value of every step (default: true in training_step, false in the
  /// evaluation steps).
  std::optional<bool> on_step = std::nullopt;
  /// Aggregate over the epoch with reduce_fx (default: false in training_step, true in the
  /// evaluation steps).
  std::optional<bool> on_epoch = std::nullopt;
  /// Reduce the value over the replicas (with reduce_fx) when it is read; an epoch mean
  /// is then weighted over all replicas' values (a replica with more samples counts more).
  bool sync_dist = false;
  /// How the epoch aggregate (and sync_dist) combines values: "mean" (weighted by
  /// batch_size), "sum", "max" or "min".
  std::string reduce_fx = "mean";
  /// Send the value to the logger (false: only progress bar and callbacks see it).
  bool logger = true;
  /// Weight of this value in the epoch mean (default 1).
  std::optional<double> batch_size = std::nullopt;
  /// Logged by rank zero only: left out of the replicas' key comparison.
  bool rank_zero_only = false;
};

namespace detail {

/// Where a run stands (what LightningModule::current_epoch / global_step read).
struct Progress {
  std::int64_t epoch = 0;
  std::int64_t global_step = 0;
};

/// The loop whose steps are logging.
enum class Loop { Train, Validate, Test, Sanity, Predict };

/// The values read at one point: for the logger, the progress bar, and callbacks.
struct MetricValues {
  std::map<std::string, double> logged;
  std::map<std::string, double> progress_bar;
  std::map<std::string, double> callback;
};

/// The values logged in the current loop, kept lazily (see the file comment).
class MetricStore {
 public:
  explicit MetricStore(const Strategy& strategy) : strategy_(&strategy) {}

  /// Starts an epoch of `loop`: forgets what that loop's previous epoch logged (a
  /// validation inside a training epoch keeps the training values apart).
  void start_epoch(Loop loop);
  /// Makes `loop` the one logging (after a nested loop ends), keeping its values.
  void set_loop(Loop loop) { loop_ = loop; }
  /// The loop logging now.
  Loop loop() const { return loop_; }
  /// Whether the module's on_train_epoch_end is running: a value logged there is an epoch
  /// value by default (on_step false, on_epoch true), as in Lightning.
  void set_epoch_end_hook(bool on) { epoch_end_hook_ = on; }

  /// Records `value` under `name` (see LightningModule::log).
  void log(const std::string& name, const AnyTensor& value, const LogOptions& options);
  /// Records a host number.
  void log(const std::string& name, double value, const LogOptions& options);

  /// The step-level values (on_step keys, their last values). With `sync` this is a
  /// collective: every replica must call it at the same point (see the file comment);
  /// without, it reads this replica's values (the progress bar).
  MetricValues read_step(bool sync);
  /// Ends the loop's epoch: the epoch aggregates and the last step values synced and read
  /// (the step values go to callbacks only), a collective when distributed. The sanity
  /// loop's values are not kept.
  MetricValues end_epoch();

  /// Everything read so far that callbacks may monitor (epoch values under their names,
  /// step values under theirs), Lightning's trainer.callback_metrics.
  const std::map<std::string, double>& callback_metrics() const { return callback_; }
  /// What the progress bar shows last.
  const std::map<std::string, double>& progress_bar_metrics() const { return progress_bar_; }
  /// What the logger got last.
  const std::map<std::string, double>& logged_metrics() const { return logged_; }
  /// Replaces the callback metrics (a resumed run restores what callbacks monitored).
  void set_callback_metrics(std::map<std::string, double> m) { callback_ = std::move(m); }

 private:
  struct Entry {
    LogOptions options;
    bool on_step = false, on_epoch = false;
    Tensor<double> last;  // the step's value
    Tensor<double> acc;   // the epoch's running sum (times weights), max or min
    double weight = 0;    // sum of the weights (mean)
    bool stepped = false; // logged since the last step read
  };
  void check_keys(const char* where) const;
  Tensor<double> synced(const Entry& e, const Tensor<double>& v) const;

  const Strategy* strategy_;
  Loop loop_ = Loop::Train;
  bool epoch_end_hook_ = false;
  std::map<std::string, Entry>& entries() { return entries_[static_cast<int>(loop_)]; }
  const std::map<std::string, Entry>& entries() const { return entries_[static_cast<int>(loop_)]; }
  std::map<std::string, Entry> entries_[5];  // per Loop
  std::map<std::string, double> callback_, progress_bar_, logged_;
};

}  // namespace detail
}  // namespace lazy::train

#if LAZYTENSOR_HEADER_DEFINITIONS
namespace lazy::train::detail {

LAZYTENSOR_INLINE void MetricStore::start_epoch(Loop loop) {
  loop_ = loop;
  entries().clear();
}

LAZYTENSOR_INLINE void MetricStore::log(const std::string& name, double value, const LogOptions& options) {
  log(name, AnyTensor(scalar_tensor<double>(value)), options);
}

LAZYTENSOR_INLINE void MetricStore::log(const std::string& name, const AnyTensor& value, const LogOptions& options) {
  if (name.empty()) throw Error("LightningModule::log: the name is empty");
  if (!value.defined()) throw Error("LightningModule::log: \"" + name + "\" is an undefined tensor");
  if (!value.is_floating_point()) {
    throw DTypeError("LightningModule::log: \"" + name + "\" must be a floating tensor, found " +
                     dtype_name(value.dtype()));
  }
  if (value.numel() != 1) {
    throw ShapeError("LightningModule::log: \"" + name + "\" must hold one element, found shape " +
                     value.shape().str());
  }
  const std::string& fx = options.reduce_fx;
  if (fx != "mean" && fx != "sum" && fx != "max" && fx != "min") {
    throw Error("LightningModule::log: reduce_fx of \"" + name + "\" must be \"mean\", \"sum\", \"max\" or \"min\", got \"" +
                fx + "\"");
  }
  if (options.batch_size && !(*options.batch_size > 0)) {
    throw Error("LightningModule::log: batch_size of \"" + name + "\" must be > 0, got " +
                std::to_string(*options.batch_size));
  }
  // A training step's value is a step value by default, any other an epoch value.
  const bool in_step = loop_ == Loop::Train && !epoch_end_hook_;
  const bool on_step = options.on_step.value_or(in_step);
  const bool on_epoch = options.on_epoch.value_or(!in_step);
  if (!on_step && !on_epoch) {
    throw Error("LightningModule::log: \"" + name + "\" has on_step and on_epoch both false: it would go nowhere");
  }
  // The value leaves autograd and becomes one double on the device.
  const Tensor<double> v = reshape(value.to(DType::Float64).as<double>().detach(), Shape{});
  auto [it, fresh] = entries().try_emplace(name);
  Entry& e = it->second;
  if (!fresh && (e.options.reduce_fx != fx || e.on_step != on_step || e.on_epoch != on_epoch ||
                 e.options.sync_dist != options.sync_dist)) {
    throw Error("LightningModule::log: \"" + name +
                "\" was logged with other options earlier in this epoch (reduce_fx, on_step, on_epoch and "
                "sync_dist must stay the same)");
  }
  e.options = options;
  e.on_step = on_step;
  e.on_epoch = on_epoch;
  e.last = v;
  e.stepped = true;
  if (!on_epoch) return;
  const double w = options.batch_size.value_or(1.0);
  if (fresh) {
    e.acc = fx == "mean" ? Tensor<double>(v * w) : v;
  } else if (fx == "mean") {
    e.acc = e.acc + v * w;
  } else if (fx == "sum") {
    e.acc = e.acc + v;
  } else if (fx == "max") {
    e.acc = maximum(e.acc, v);
  } else {
    e.acc = minimum(e.acc, v);
  }
  e.weight += w;
}

LAZYTENSOR_INLINE void MetricStore::check_keys(const char* where) const {
  if (!strategy_->is_distributed()) return;
  std::string keys;
  for (const auto& [name, e] : entries()) {
    if (e.options.rank_zero_only) continue;
    if (!keys.empty()) keys += ", ";
    keys += name;
  }
  const auto all = dist::mesh_reduce(std::string("LightningModule::log keys (") + where + ")", keys,
                                     [](const std::vector<std::string>& v) { return v; });
  bool same = true;
  for (const auto& k : all) same = same && k == all.front();
  if (same) return;
  std::string msg = "LightningModule::log: the replicas logged different keys (" + std::string(where) +
                    "; every replica must log the same ones, or mark a key rank_zero_only):";
  for (std::size_t r = 0; r < all.size(); ++r) msg += " rank " + std::to_string(r) + ": [" + all[r] + "];";
  msg.pop_back();
  throw Error(msg);
}

LAZYTENSOR_INLINE Tensor<double> MetricStore::synced(const Entry& e, const Tensor<double>& v) const {
  if (!e.options.sync_dist || !strategy_->is_distributed()) return v;
  return strategy_->reduce(v, e.options.reduce_fx);
}

LAZYTENSOR_INLINE MetricValues MetricStore::read_step(bool sync) {
  if (sync) check_keys("at a step");
  MetricValues out;
  std::vector<std::pair<const std::string*, Tensor<double>>> values;
  for (auto& [name, e] : entries()) {
    // The logger gets what was logged since its last read; a local read shows every value.
    if (!e.on_step || (sync && !e.stepped)) continue;
    values.emplace_back(&name, sync ? synced(e, e.last) : e.last);
  }
  for (auto& [name, t] : values) {
    const Entry& e = entries().at(*name);
    const double x = t.item();
    const std::string key = e.on_epoch ? *name + "_step" : *name;
    if (e.options.logger) out.logged[key] = x;
    if (e.options.prog_bar) out.progress_bar[key] = x;
    out.callback[key] = x;
    if (!e.on_epoch) out.callback[*name] = x;
  }
  if (sync) {
    for (auto& [name, e] : entries()) e.stepped = false;
    if (loop_ != Loop::Sanity) {
      for (const auto& [k, x] : out.logged) logged_[k] = x;
      for (const auto& [k, x] : out.callback) callback_[k] = x;
    }
  }
  if (loop_ != Loop::Sanity)
    for (const auto& [k, x] : out.progress_bar) progress_bar_[k] = x;
  return out;
}

LAZYTENSOR_INLINE MetricValues MetricStore::end_epoch() {
  check_keys("at the end of an epoch");
  MetricValues out;
  for (auto& [name, e] : entries()) {
    if (e.on_step) {
      // The last step value, for callbacks (the logger got its own at the read points).
      const double x = synced(e, e.last).item();
      out.callback[e.on_epoch ? name + "_step" : name] = x;
    }
    if (!e.on_epoch) continue;
    double x = 0;
    if (e.options.reduce_fx != "mean") {
      x = synced(e, e.acc).item();
    } else if (e.options.sync_dist && strategy_->is_distributed()) {
      // The weighted mean over every replica's values: sums of values and of weights, so
      // replicas with different numbers of samples count by their samples.
      const Tensor<double> num = strategy_->reduce(e.acc, "sum");
      const Tensor<double> den = strategy_->reduce(scalar_tensor<double>(e.weight), "sum");
      x = num.item() / den.item();
    } else {
      x = e.acc.item() / e.weight;
    }
    const std::string key = e.on_step ? name + "_epoch" : name;
    if (e.options.logger) out.logged[key] = x;
    if (e.options.prog_bar) out.progress_bar[key] = x;
    out.callback[key] = x;
    out.callback[name] = x;
  }
  if (loop_ != Loop::Sanity) {
    for (const auto& [k, x] : out.logged) logged_[k] = x;
    for (const auto& [k, x] : out.callback) callback_[k] = x;
    for (const auto& [k, x] : out.progress_bar) progress_bar_[k] = x;
  }
  entries().clear();
  return out;
}

}  // namespace lazy::train::detail
#endif  // LAZYTENSOR_HEADER_DEFINITIONS
