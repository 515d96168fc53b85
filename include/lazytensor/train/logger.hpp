#pragma once
// train::Logger, Lightning's: where the Trainer sends logged metrics and hyper-parameters.
// The Trainer calls a logger from global rank zero only (Lightning's rank_zero_only), so
// one object serves every replica.

#include <cstdint>
#include <map>
#include <optional>
#include <string>

namespace lazy::train {

/// Base of the Trainer's loggers.
class Logger {
 public:
  virtual ~Logger() = default;

  /// The experiment's name ("lightning_logs").
  virtual std::string name() const = 0;
  /// The run's version ("version_3" is written as its number, 3).
  virtual std::string version() const = 0;
  /// The directory this run writes to (empty when the logger writes no files).
  virtual std::string log_dir() const { return {}; }
  /// The parent of the experiments' directories (the Trainer puts checkpoints in
  /// `log_dir()/checkpoints` when no dirpath is given).
  virtual std::string save_dir() const { return {}; }

  /// One row of metrics at optimizer step `step`.
  virtual void log_metrics(const std::map<std::string, double>& metrics, std::int64_t step) = 0;
  /// The run's hyper-parameters.
  virtual void log_hyperparams(const std::map<std::string, std::string>& params) = 0;
  /// Writes what is buffered.
  virtual void save() {}
  /// The run ended: "success", "failed" or "interrupted".
  virtual void finalize(const std::string& status) {
    (void)status;
    save();
  }
};

}  // namespace lazy::train
