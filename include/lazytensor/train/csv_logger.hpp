#pragma once
// train::CSVLogger, Lightning's: metrics to `<save_dir>/<name>/version_<N>/metrics.csv` (one
// row per log_metrics call, a column per key, "step" among them, empty cells for keys a row
// lacks) and hyper-parameters to hparams.yaml next to it. Rows are buffered and the whole
// file is rewritten atomically every flush_logs_every_n_steps rows and at save/finalize,
// so a killed run leaves a complete CSV of what was flushed.

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include <lazytensor/core/config.hpp>
#include <lazytensor/core/error.hpp>
#include <lazytensor/io/file.hpp>
#include <lazytensor/train/logger.hpp>

namespace lazy::train {

/// Metrics in a CSV file, hyper-parameters in a YAML file (Lightning's CSVLogger).
class CSVLogger : public Logger {
 public:
  /// Under `save_dir`/`name`; `version` (default: one more than the largest version_N
  /// there, 0 for the first) names the run's directory, which is created now (so two
  /// loggers made one after the other get different versions).
  explicit CSVLogger(std::string save_dir, std::string name = "lightning_logs",
                     std::optional<int> version = std::nullopt, std::int64_t flush_logs_every_n_steps = 100);

  std::string name() const override { return name_; }
  std::string version() const override { return std::to_string(version_); }
  std::string save_dir() const override { return save_dir_; }
  /// `save_dir/name/version_N`.
  std::string log_dir() const override { return log_dir_; }

  LAZYTENSOR_INLINE void log_metrics(const std::map<std::string, double>& metrics, std::int64_t step) override;
  LAZYTENSOR_INLINE void log_hyperparams(const std::map<std::string, std::string>& params) override;
  /// Rewrites metrics.csv (and hparams.yaml) with everything logged so far.
  LAZYTENSOR_INLINE void save() override;

  /// The rows logged so far (key -> value, "step" included).
  std::vector<std::map<std::string, double>> rows() const;

 private:
  std::string save_dir_, name_, log_dir_;
  int version_ = 0;
  std::int64_t flush_every_;
  mutable std::mutex mu_;
  std::vector<std::string> columns_;  // in order of first appearance
  std::vector<std::map<std::string, double>> rows_;
  std::map<std::string, std::string> hparams_;
  std::int64_t unflushed_ = 0;
};

#if LAZYTENSOR_HEADER_DEFINITIONS

LAZYTENSOR_INLINE CSVLogger::CSVLogger(std::string save_dir, std::string name, std::optional<int> version,
                                       std::int64_t flush_logs_every_n_steps)
    : save_dir_(std::move(save_dir)), name_(std::move(name)), flush_every_(flush_logs_every_n_steps) {
  if (flush_every_ < 1)
    throw Error("CSVLogger: flush_logs_every_n_steps must be >= 1, got " + std::to_string(flush_every_));
  const std::string root = save_dir_ + "/" + name_;
  if (version) {
    if (*version < 0) throw Error("CSVLogger: version must be >= 0, got " + std::to_string(*version));
    version_ = *version;
  } else {
    int next = 0;
    for (const auto& entry : io::detail::list_directory(root)) {
      if (entry.rfind("version_", 0) != 0) continue;
      int v = 0;
      const char* b = entry.data() + 8;
      const char* e = entry.data() + entry.size();
      auto [p, ec] = std::from_chars(b, e, v);
      if (ec == std::errc() && p == e && v >= next) next = v + 1;
    }
    version_ = next;
  }
  log_dir_ = root + "/version_" + std::to_string(version_);
  io::detail::make_directories(log_dir_);
}

LAZYTENSOR_INLINE void CSVLogger::log_metrics(const std::map<std::string, double>& metrics, std::int64_t step) {
  bool flush = false;
  {
    std::lock_guard lock(mu_);
    std::map<std::string, double> row = metrics;
    row["step"] = static_cast<double>(step);
    for (const auto& [k, v] : metrics) {
      (void)v;
      if (std::find(columns_.begin(), columns_.end(), k) == columns_.end()) columns_.push_back(k);
    }
    if (std::find(columns_.begin(), columns_.end(), "step") == columns_.end()) columns_.push_back("step");
    rows_.push_back(std::move(row));
    flush = ++unflushed_ >= flush_every_;
  }
  if (flush) save();
}

LAZYTENSOR_INLINE void CSVLogger::log_hyperparams(const std::map<std::string, std::string>& params) {
  {
    std::lock_guard lock(mu_);
    for (const auto& [k, v] : params) hparams_[k] = v;
  }
  save();
}

LAZYTENSOR_INLINE std::vector<std::map<std::string, double>> CSVLogger::rows() const {
  std::lock_guard lock(mu_);
  return rows_;
}

LAZYTENSOR_INLINE void CSVLogger::save() {
  std::lock_guard lock(mu_);
  io::detail::make_directories(log_dir_);
  std::string csv;
  for (std::size_t c = 0; c < columns_.size(); ++c) {
    if (c) csv += ',';
    csv += columns_[c];
  }
  csv += '\n';
  char buf[32];
  for (const auto& row : rows_) {
    for (std::size_t c = 0; c < columns_.size(); ++c) {
      if (c) csv += ',';
      const auto it = row.find(columns_[c]);
      if (it == row.end()) continue;
      // Shortest text that reads back as the same double; integral values (step, epoch)
      // in positional form, so that int("100000") reads them (the shortest is "1e+05").
      const double v = it->second;
      const bool integral = v == std::floor(v) && std::fabs(v) < 9007199254740992.0;
      const auto r = integral ? std::to_chars(buf, buf + sizeof buf, v, std::chars_format::fixed)
                              : std::to_chars(buf, buf + sizeof buf, v);
      csv.append(buf, r.ptr);
    }
    csv += '\n';
  }
  if (!columns_.empty()) {
    io::detail::AtomicFileWriter out(log_dir_ + "/metrics.csv");
    out.write(csv.data(), csv.size());
    out.commit();
  }
  std::string yaml;
  for (const auto& [k, v] : hparams_) {
    yaml += k + ": ";
    // Quoted (YAML double-quoted style) unless plainly safe.
    bool plain = !v.empty();
    for (const char ch : v) plain = plain && (std::isalnum(static_cast<unsigned char>(ch)) || ch == '.' || ch == '_' || ch == '-');
    if (plain) {
      yaml += v;
    } else {
      yaml += '"';
      for (const char ch : v) {
        if (ch == '"' || ch == '\\') yaml += '\\';
        if (ch == '\n') {
          yaml += "\\n";
          continue;
        }
        yaml += ch;
      }
      yaml += '"';
    }
    yaml += '\n';
  }
  io::detail::AtomicFileWriter out(log_dir_ + "/hparams.yaml");
  out.write(yaml.data(), yaml.size());
  out.commit();
  unflushed_ = 0;
}

#endif  // LAZYTENSOR_HEADER_DEFINITIONS

}  // namespace lazy::train
