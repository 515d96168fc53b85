#pragma once
// train::ModelCheckpoint, Lightning's: saves the run (Trainer::save_checkpoint) every
// every_n_epochs epochs or every_n_train_steps optimizer steps, keeps the save_top_k best by
// a monitored value (or the latest ones without a monitor), and with save_last also writes
// last.safetensors each time. Files are named from the `filename` template
// ("{epoch}-{step}" gives "epoch=3-step=1200.safetensors"; "{val_loss:.2f}" a monitored
// value). A name an earlier run's file holds gets -v1, -v2, ... (last.safetensors too:
// last-v1.safetensors), unless enable_version_counter is off. Every replica calls the
// hooks; global rank zero's choice of file is broadcast, so the replicas agree even on
// values they did not sync, and only rank zero writes.

#include <sys/stat.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <lazytensor/core/config.hpp>
#include <lazytensor/core/error.hpp>
#include <lazytensor/io/file.hpp>
#include <lazytensor/train/callback.hpp>
#include <lazytensor/train/trainer.hpp>

namespace lazy::train {

/// ModelCheckpoint's arguments, in Lightning's order.
struct ModelCheckpointOptions {
  /// Directory of the files (default: `trainer.log_dir()/checkpoints`).
  std::string dirpath = "";
  /// File name template without extension (default "{epoch}-{step}").
  std::string filename = "";
  /// The callback metric to rank checkpoints by (none: the latest ones are kept).
  std::optional<std::string> monitor = std::nullopt;
  /// Print each save on global rank zero.
  bool verbose = false;
  /// Also write `last.safetensors` at every save (what ckpt_path "last" resumes).
  bool save_last = false;
  /// How many files to keep: k best (by monitor; without one, only 1 is valid: the
  /// latest), -1 all, 0 none (only last).
  std::int64_t save_top_k = 1;
  /// "min" or "max": which monitored values are better.
  std::string mode = "min";
  /// "{epoch}" gives "epoch=3" (true) or "3" (false).
  bool auto_insert_metric_name = true;
  /// Save every this many optimizer steps (0: off).
  std::int64_t every_n_train_steps = 0;
  /// Save every this many epochs (default 1 unless every_n_train_steps is set; 0: off).
  std::optional<std::int64_t> every_n_epochs = std::nullopt;
  /// Save at the end of the training epoch (true) or after validation (false); default:
  /// after validation in epochs that validate.
  std::optional<bool> save_on_train_epoch_end = std::nullopt;
  /// A new file whose name an existing file holds gets "-v1", "-v2", ... (true), or
  /// replaces it (false); for last.safetensors, when the file there is not this run's last.
  bool enable_version_counter = true;
};

/// Lightning's ModelCheckpoint (see the file comment).
/// A class template (the parameter is unused; use ModelCheckpoint) so that a program that never
/// constructs one compiles none of it.
template <class = void>
class BasicModelCheckpoint : public Callback {
 public:
  /// The usual name, which derived classes inherit (as they would a non-template base's).
  using ModelCheckpoint = BasicModelCheckpoint;

  /// ".safetensors".
  static constexpr const char* kFileExtension = ".safetensors";
  /// "last".
  static constexpr const char* kLastName = "last";

  /// Checks the options (Error for an invalid mode, save_top_k, intervals, or save_top_k
  /// other than -1, 0, 1 without a monitor).
  explicit BasicModelCheckpoint(ModelCheckpointOptions options = {});

  std::shared_ptr<Callback> clone() const override { return std::make_shared<BasicModelCheckpoint>(*this); }
  std::string state_key() const override;
  bool monitors() const override { return true; }
  std::map<std::string, std::string> state_dict() const override;
  void load_state_dict(const std::map<std::string, std::string>& state) override;

  void on_fit_start(Trainer& trainer, LightningModuleBase& module) override;
  void on_train_epoch_start(Trainer& trainer, LightningModuleBase& module) override;
  void on_train_batch_end(Trainer& trainer, LightningModuleBase& module, std::int64_t batch_idx) override;
  void on_validation_end(Trainer& trainer, LightningModuleBase& module) override;
  void on_train_epoch_end(Trainer& trainer, LightningModuleBase& module) override;

  const ModelCheckpointOptions& options() const { return options_; }
  /// The directory files go to (resolved at fit start).
  const std::string& dirpath() const { return dirpath_; }
  /// The best file so far ("" before the first save).
  const std::string& best_model_path() const { return best_model_path_; }
  /// Its monitored value (nullopt without a monitor or before a save).
  std::optional<double> best_model_score() const { return best_model_score_; }
  /// The kept files and their monitored values.
  const std::map<std::string, double>& best_k_models() const { return best_k_; }
  /// The last file written as "last" ("" before): last.safetensors, or last-v<n> when an
  /// earlier run's last.safetensors was there (Lightning's versioning).
  const std::string& last_model_path() const { return last_model_path_; }
  /// The file name the template gives for `metrics` (with epoch and step), without the
  /// directory; `version` > 0 appends "-v<version>" (Lightning's name for a file whose name
  /// is taken). A field "{name:spec}" formats the value by `spec`,
  /// [+|-| ][#][0][width][.precision] then d (an integer: the value must be one), f, e or g,
  /// as Python's format() would; another spec is an Error naming it. A field naming a value
  /// not among `metrics` reads 0, as Lightning's.
  std::string format_checkpoint_name(const std::map<std::string, double>& metrics,
                                     int version = 0) const;

  /// Saves now if nothing was saved at this step (what the hooks call).
  void save_checkpoint(Trainer& trainer);

 private:
  bool better(double a, double b) const { return options_.mode == "min" ? a < b : a > b; }
  std::string worst_kept() const;
  /// The path for a new file: the template's name, with -v1, -v2, ... while a file of that
  /// name exists, unless it is `replacing` (the file this save takes the place of).
  std::string new_file_path(const std::map<std::string, double>& metrics,
                            const std::string& replacing) const;
  /// The path of this save's "last": last.safetensors, or while a file of that name exists
  /// that is not this run's last_model_path, last-v1, last-v2, ... (Lightning's
  /// _save_last_checkpoint).
  std::string last_file_path() const;
  /// Whether this training epoch's end saves by default (save_on_train_epoch_end unset).
  bool saves_at_epoch_end(const Trainer& trainer) const;
  /// `value` of the template field `name` formatted by `spec` (see format_checkpoint_name).
  static std::string format_value(double value, const std::string& spec, const std::string& name,
                                  const std::string& tpl);

  ModelCheckpointOptions options_;
  std::int64_t every_n_epochs_ = 1;
  std::string dirpath_;
  std::string best_model_path_, last_model_path_;
  std::optional<double> best_model_score_;
  std::map<std::string, double> best_k_;
  std::int64_t last_saved_step_ = -1;
  bool validated_this_epoch_ = false;
  bool validation_ran_ = false;  ///< in this fit (a missing monitor is then an error)
  bool warned_missing_ = false;
};

/// Lightning's ModelCheckpoint (see BasicModelCheckpoint).
using ModelCheckpoint = BasicModelCheckpoint<>;

#if LAZYTENSOR_HEADER_DEFINITIONS

template <class V>
BasicModelCheckpoint<V>::BasicModelCheckpoint(ModelCheckpointOptions options) : options_(std::move(options)) {
  const auto& o = options_;
  if (o.mode != "min" && o.mode != "max")
    throw Error("ModelCheckpoint: mode must be \"min\" or \"max\", got \"" + o.mode + "\"");
  if (o.save_top_k < -1) throw Error("ModelCheckpoint: save_top_k must be >= -1, got " + std::to_string(o.save_top_k));
  if (!o.monitor && o.save_top_k > 1) {
    throw Error("ModelCheckpoint: save_top_k = " + std::to_string(o.save_top_k) +
                " needs a monitor to rank the files by (without one use 1, -1 or 0)");
  }
  if (o.every_n_train_steps < 0)
    throw Error("ModelCheckpoint: every_n_train_steps must be >= 0, got " + std::to_string(o.every_n_train_steps));
  every_n_epochs_ = o.every_n_epochs.value_or(o.every_n_train_steps > 0 ? 0 : 1);
  if (every_n_epochs_ < 0) throw Error("ModelCheckpoint: every_n_epochs must be >= 0, got " + std::to_string(every_n_epochs_));
  dirpath_ = o.dirpath;
}

template <class V>
std::string BasicModelCheckpoint<V>::state_key() const {
  return "ModelCheckpoint{monitor=" + options_.monitor.value_or("") + ",mode=" + options_.mode +
         ",every_n_train_steps=" + std::to_string(options_.every_n_train_steps) +
         ",every_n_epochs=" + std::to_string(every_n_epochs_) + "}";
}

template <class V>
std::map<std::string, std::string> BasicModelCheckpoint<V>::state_dict() const {
  std::map<std::string, std::string> s;
  s["dirpath"] = dirpath_;
  s["best_model_path"] = best_model_path_;
  s["last_model_path"] = last_model_path_;
  if (best_model_score_) s["best_model_score"] = detail::double_text(*best_model_score_);
  int i = 0;
  for (const auto& [path, score] : best_k_) {
    s["best_k." + std::to_string(i) + ".path"] = path;
    s["best_k." + std::to_string(i) + ".score"] = detail::double_text(score);
    ++i;
  }
  s["last_saved_step"] = std::to_string(last_saved_step_);
  return s;
}

template <class V>
void BasicModelCheckpoint<V>::load_state_dict(const std::map<std::string, std::string>& s) {
  const auto get = [&](const std::string& k) {
    const auto it = s.find(k);
    return it == s.end() ? std::string() : it->second;
  };
  // Lightning's rule: the ranking carries over only into the same directory.
  if (get("dirpath") != dirpath_ && !dirpath_.empty()) return;
  if (dirpath_.empty()) dirpath_ = get("dirpath");
  best_model_path_ = get("best_model_path");
  last_model_path_ = get("last_model_path");
  best_model_score_.reset();
  if (!get("best_model_score").empty()) best_model_score_ = detail::parse_double(get("best_model_score"), "ModelCheckpoint state");
  best_k_.clear();
  for (int i = 0; s.count("best_k." + std::to_string(i) + ".path"); ++i) {
    best_k_[get("best_k." + std::to_string(i) + ".path")] =
        detail::parse_double(get("best_k." + std::to_string(i) + ".score"), "ModelCheckpoint state");
  }
  if (!get("last_saved_step").empty()) last_saved_step_ = detail::parse_int(get("last_saved_step"), "ModelCheckpoint state");
}

template <class V>
void BasicModelCheckpoint<V>::on_fit_start(Trainer& trainer, LightningModuleBase&) {
  validation_ran_ = false;
  if (dirpath_.empty()) dirpath_ = trainer.log_dir() + "/checkpoints";
  if (trainer.is_global_zero()) io::detail::make_directories(dirpath_);
}

template <class V>
void BasicModelCheckpoint<V>::on_train_epoch_start(Trainer&, LightningModuleBase&) {
  validated_this_epoch_ = false;
}

template <class V>
void BasicModelCheckpoint<V>::on_train_batch_end(Trainer& trainer, LightningModuleBase&,
                                                 std::int64_t) {
  if (!trainer.fitting()) return;
  const std::int64_t n = options_.every_n_train_steps;
  if (n > 0 && trainer.global_step() > 0 && trainer.global_step() % n == 0) save_checkpoint(trainer);
}

template <class V>
void BasicModelCheckpoint<V>::on_validation_end(Trainer& trainer, LightningModuleBase&) {
  // Only a fit saves (Lightning's rule): a validate() of its own has no epoch to save, and
  // the directory is resolved at fit start.
  if (!trainer.fitting() || trainer.sanity_checking()) return;
  validated_this_epoch_ = true;
  validation_ran_ = true;
  if (options_.save_on_train_epoch_end.value_or(false)) return;
  if (every_n_epochs_ > 0 && (trainer.current_epoch() + 1) % every_n_epochs_ == 0) save_checkpoint(trainer);
}

template <class V>
bool BasicModelCheckpoint<V>::saves_at_epoch_end(const Trainer& trainer) const {
  if (validated_this_epoch_) return false;  // saved after the validation
  // With check_val_every_n_epoch > 1 an epoch without validation waits for the next one (as
  // Lightning's): a monitored validation value would be missing, or last validation's.
  return trainer.num_val_batches() == 0 || trainer.options().check_val_every_n_epoch == 1;
}

template <class V>
void BasicModelCheckpoint<V>::on_train_epoch_end(Trainer& trainer, LightningModuleBase&) {
  if (!trainer.fitting()) return;
  if (!options_.save_on_train_epoch_end.value_or(saves_at_epoch_end(trainer))) return;
  if (every_n_epochs_ > 0 && (trainer.current_epoch() + 1) % every_n_epochs_ == 0)
    save_checkpoint(trainer);
}

template <class V>
std::string BasicModelCheckpoint<V>::format_checkpoint_name(
    const std::map<std::string, double>& metrics, int version) const {
  const std::string& tpl = options_.filename.empty() ? std::string("{epoch}-{step}") : options_.filename;
  std::string out;
  for (std::size_t i = 0; i < tpl.size();) {
    if (tpl[i] != '{') {
      out += tpl[i++];
      continue;
    }
    const auto close = tpl.find('}', i);
    if (close == std::string::npos) throw Error("ModelCheckpoint: unclosed '{' in filename \"" + tpl + "\"");
    const std::string field = tpl.substr(i + 1, close - i - 1);
    const auto colon = field.find(':');
    const std::string name = field.substr(0, colon);
    // (A value not logged yet, e.g. a validation metric in a save before the first
    // validation, reads 0, as in Lightning.)
    const auto it = metrics.find(name);
    const double v = it == metrics.end() ? 0.0 : it->second;
    std::string value;
    if (colon != std::string::npos && colon + 1 < field.size()) {
      value = format_value(v, field.substr(colon + 1), name, tpl);
    } else if (v == std::floor(v) &&
               std::fabs(v) < 9.2e18) {  // (inf or 1e30 would not fit an int64)
      value = std::to_string(static_cast<std::int64_t>(v));
    } else {
      value = detail::double_text(v);
    }
    if (options_.auto_insert_metric_name) out += name + "=";
    out += value;
    i = close + 1;
  }
  if (version > 0) out += "-v" + std::to_string(version);
  return out;
}

template <class V>
std::string BasicModelCheckpoint<V>::new_file_path(const std::map<std::string, double>& metrics,
                                                   const std::string& replacing) const {
  for (int version = 0;; ++version) {
    const std::string path =
        dirpath_ + "/" + format_checkpoint_name(metrics, version) + kFileExtension;
    if (path == replacing || !options_.enable_version_counter || !io::detail::path_exists(path))
      return path;
  }
}

template <class V>
std::string BasicModelCheckpoint<V>::last_file_path() const {
  std::string path = dirpath_ + "/" + kLastName + kFileExtension;
  if (!options_.enable_version_counter) return path;
  for (int version = 1; path != last_model_path_ && io::detail::path_exists(path); ++version)
    path = dirpath_ + "/" + kLastName + "-v" + std::to_string(version) + kFileExtension;
  return path;
}

template <class V>
std::string BasicModelCheckpoint<V>::format_value(double value, const std::string& spec,
                                                  const std::string& name, const std::string& tpl) {
  const auto bad = [&](const std::string& why) {
    return Error("ModelCheckpoint: filename \"" + tpl + "\": the format spec \"" + spec +
                 "\" of \"" + name + "\" " + why);
  };
  // Python's grammar restricted to what printf means the same way: sign, '#', '0', width,
  // precision, type. (printf's '-' is left-justify, Python's the default sign: dropped.)
  std::size_t i = 0;
  std::string fmt = "%";
  if (i < spec.size() && (spec[i] == '+' || spec[i] == ' ' || spec[i] == '-')) {
    if (spec[i] != '-') fmt += spec[i];
    ++i;
  }
  if (i < spec.size() && spec[i] == '#') fmt += spec[i++];
  if (i < spec.size() && spec[i] == '0') fmt += spec[i++];
  const auto digits = [&](const char* what) {
    const std::size_t from = i;
    while (i < spec.size() && spec[i] >= '0' && spec[i] <= '9') ++i;
    // Two digits are plenty for a file name, and keep the text within bounds.
    if (i - from > 2) throw bad(std::string("has a ") + what + " of more than two digits");
    fmt += spec.substr(from, i - from);
    return i > from;
  };
  digits("width");
  bool precision = false;
  if (i < spec.size() && spec[i] == '.') {
    fmt += spec[i++];
    if (!digits("precision")) throw bad("has a '.' without a precision");
    precision = true;
  }
  if (i + 1 != spec.size() || std::string("dfeg").find(spec[i]) == std::string::npos)
    throw bad(
        "is not supported (expected [+|-| ][#][0][width][.precision] followed by one of "
        "d, f, e, g)");
  const char type = spec[i];
  // (Sized by a first call: "{x:.2f}" of 1e200 is over 200 characters.)
  const auto print = [](const std::string& f, auto v) {
    std::string out(static_cast<std::size_t>(std::snprintf(nullptr, 0, f.c_str(), v)), '\0');
    std::snprintf(out.data(), out.size() + 1, f.c_str(), v);
    return out;
  };
  if (type == 'd') {
    if (precision) throw bad("has a precision, which an integer (d) does not take");
    // Python formats only integers with d.
    if (!(value == std::floor(value)) || !(std::fabs(value) < 9.2e18))
      throw bad("asks for an integer (d), found " + detail::double_text(value));
    // '#' changes nothing for Python's d, and printf's d does not take it.
    const auto hash = fmt.find('#');
    if (hash != std::string::npos) fmt.erase(hash, 1);
    return print(fmt + "lld", static_cast<long long>(value));
  }
  return print(fmt + type, value);
}

template <class V>
std::string BasicModelCheckpoint<V>::worst_kept() const {
  std::string worst;
  for (const auto& [path, score] : best_k_)
    if (worst.empty() || better(best_k_.at(worst), score)) worst = path;
  return worst;
}

template <class V>
void BasicModelCheckpoint<V>::save_checkpoint(Trainer& trainer) {
  if (trainer.fast_dev_run() || trainer.sanity_checking()) return;
  if (trainer.global_step() == last_saved_step_) return;
  last_saved_step_ = trainer.global_step();
  std::map<std::string, double> metrics = trainer.callback_metrics();
  metrics["epoch"] = static_cast<double>(trainer.current_epoch());
  metrics["step"] = static_cast<double>(trainer.global_step());
  // Decide on this replica, then take rank zero's decision everywhere.
  std::string save_path, remove_path;
  double score = 0;
  bool ranks = options_.save_top_k != 0;  // whether this save writes a top-k file at all
  if (options_.monitor && ranks) {
    const auto it = metrics.find(*options_.monitor);
    if (it != metrics.end()) {
      score = it->second;
      // Lightning ranks a NaN as the worst value there is.
      if (std::isnan(score))
        score = options_.mode == "min" ? std::numeric_limits<double>::infinity()
                                       : -std::numeric_limits<double>::infinity();
    } else {
      // Lightning's rule: once validation has run the key is surely misspelt (an Error);
      // before (a save every n steps ahead of the first validation, or none at all) the
      // top-k file is skipped with a warning, and "last" is still written.
      std::string known;
      for (const auto& [key, v] : metrics) known += (known.empty() ? "" : ", ") + key;
      const std::string what = "ModelCheckpoint: the monitored value \"" + *options_.monitor +
                               "\" was not logged (callback metrics: " + known + ")";
      if (validation_ran_) throw Error(what);
      if (!warned_missing_ && trainer.is_global_zero())
        std::fprintf(stderr, "Warning: %s; no top-k checkpoint until it is\n", what.c_str());
      warned_missing_ = true;
      ranks = false;
    }
  }
  const std::int64_t k = options_.save_top_k;
  if (ranks) {
    const auto kept = static_cast<std::int64_t>(best_k_.size());
    if (!options_.monitor) {
      // Lightning's _save_none_monitor_checkpoint: the previous file may be written over
      // (one name for every save), and with save_top_k = 1 it is removed otherwise.
      save_path = new_file_path(metrics, best_model_path_);
      if (k == 1 && !best_model_path_.empty() && best_model_path_ != save_path)
        remove_path = best_model_path_;
    } else if (k == -1 || kept < k) {
      save_path = new_file_path(metrics, "");
    } else if (better(score, best_k_.at(worst_kept()))) {
      remove_path = worst_kept();
      save_path = new_file_path(metrics, remove_path);
    }
  }
  // (Decided here with the rest: a replica that looked after rank zero wrote its first
  // last.safetensors would take it for an earlier run's and pick last-v1.)
  std::string last = options_.save_last ? last_file_path() : std::string();
  struct Decision {
    char save[512];
    char remove[512];
    char last[512];
    double score;
  } d{};
  if (save_path.size() >= sizeof d.save || remove_path.size() >= sizeof d.remove ||
      last.size() >= sizeof d.last)
    throw Error("ModelCheckpoint: a checkpoint path is longer than 511 bytes: " +
                (last.size() >= sizeof d.last ? last : save_path));
  std::snprintf(d.save, sizeof d.save, "%s", save_path.c_str());
  std::snprintf(d.remove, sizeof d.remove, "%s", remove_path.c_str());
  std::snprintf(d.last, sizeof d.last, "%s", last.c_str());
  d.score = score;
  d = trainer.strategy().broadcast(d, 0);
  save_path = d.save;
  remove_path = d.remove;
  last = d.last;
  score = d.score;
  if (!save_path.empty()) {
    // (Evicted first: the new file may take the evicted one's name.)
    if (!remove_path.empty()) best_k_.erase(remove_path);
    if (k == -1 || options_.monitor) best_k_[save_path] = score;
    if (!options_.monitor) {
      best_model_path_ = save_path;
    } else {
      std::string best;
      for (const auto& [path, s] : best_k_)
        if (best.empty() || better(s, best_k_.at(best))) best = path;
      best_model_path_ = best;
      best_model_score_ = best_k_.at(best);
    }
  }
  if (options_.save_last) last_model_path_ = last;
  // The state above is what these files hold (best paths included), as Lightning's.
  if (!save_path.empty()) {
    // A metric named "val/loss" in the template makes a subdirectory (Lightning's checkpoint
    // IO creates the parent too).
    if (trainer.is_global_zero())
      io::detail::make_directories(save_path.substr(0, save_path.rfind('/')));
    trainer.save_checkpoint(save_path);
    if (options_.verbose && trainer.is_global_zero())
      std::fprintf(stderr, "Epoch %lld, global step %lld: saved %s\n", static_cast<long long>(trainer.current_epoch()),
                   static_cast<long long>(trainer.global_step()), save_path.c_str());
  }
  if (options_.save_last) trainer.save_checkpoint(last);
  if (!remove_path.empty() && remove_path != save_path) trainer.strategy().remove_checkpoint(remove_path);
}

namespace detail {
LAZYTENSOR_INLINE std::string last_checkpoint_path(
    const std::vector<std::shared_ptr<Callback>>& callbacks, const std::string& default_dir) {
  const std::string ext = ModelCheckpoint::kFileExtension;
  std::string newest;
  std::pair<long long, long long> newest_time{0, 0};
  for (const auto& c : callbacks) {
    const auto* mc = dynamic_cast<const ModelCheckpoint*>(c.get());
    if (!mc) continue;
    const std::string dir = mc->dirpath().empty() ? default_dir : mc->dirpath();
    for (const auto& name : io::detail::list_directory(dir)) {
      // Lightning's pattern: a name that starts with "last" (last, last-v1, ...), of the
      // checkpoints' extension.
      if (name.rfind(ModelCheckpoint::kLastName, 0) != 0 || name.size() < ext.size() ||
          name.compare(name.size() - ext.size(), ext.size(), ext) != 0)
        continue;
      const std::string path = dir + "/" + name;
      struct stat st {};
      if (::stat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) continue;
#ifdef __APPLE__
      const std::pair<long long, long long> t{st.st_mtimespec.tv_sec, st.st_mtimespec.tv_nsec};
#else
      const std::pair<long long, long long> t{st.st_mtim.tv_sec, st.st_mtim.tv_nsec};
#endif
      // Equal times (file systems with coarse stamps, copies that keep them): the higher
      // last-v<n> is the later save (last itself counts as 0), then the later name, so the
      // choice does not depend on the listing's order.
      const auto version = [](const std::string& p) {
        const std::string prefix = std::string("/") + ModelCheckpoint::kLastName + "-v";
        const std::size_t v = p.rfind(prefix);
        return v == std::string::npos || p.find('/', v + 1) != std::string::npos
                   ? 0L
                   : std::strtol(p.c_str() + v + prefix.size(), nullptr, 10);
      };
      if (newest.empty() || t > newest_time ||
          (t == newest_time &&
           std::make_pair(version(path), path) > std::make_pair(version(newest), newest))) {
        newest = path;
        newest_time = t;
      }
    }
  }
  return newest;
}
}  // namespace detail

#endif  // LAZYTENSOR_HEADER_DEFINITIONS

}  // namespace lazy::train

// Defined once by lazytensor::compiled (src/compiled.cpp).
#define LAZYTENSOR_TRAIN_MODEL_CHECKPOINT_INSTANCES(P) P template class lazy::train::BasicModelCheckpoint<void>;
#if LAZYTENSOR_EXPLICIT_INSTANTIATION
LAZYTENSOR_TRAIN_MODEL_CHECKPOINT_INSTANCES(extern)
#endif
