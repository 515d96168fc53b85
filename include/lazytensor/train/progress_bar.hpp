#pragma once
// train::ProgressBar (Lightning's TQDMProgressBar): on global rank zero, a line per training
// epoch with the batch count, the prog_bar values, samples per second and the time left.
// On a terminal it is redrawn in place every refresh_rate batches; elsewhere (a log file,
// CI) a plain line is printed every refresh_rate batches and at the end of the epoch.
// Reading the values synchronizes with the device, which is why refresh_rate defaults to
// more than one batch: a lazy step runs while the next one is being traced.

#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <map>
#include <memory>
#include <string>

#include <lazytensor/core/config.hpp>
#include <lazytensor/core/error.hpp>
#include <lazytensor/train/callback.hpp>
#include <lazytensor/train/trainer.hpp>

namespace lazy::train {

/// The Trainer's progress bar (see the file comment).
/// A class template (the parameter is unused; use ProgressBar) so that a program that never
/// constructs one compiles none of it.
template <class = void>
class BasicProgressBar : public Callback {
 public:
  /// The usual name, which derived classes inherit (as they would a non-template base's).
  using ProgressBar = BasicProgressBar;

  /// Refreshed every `refresh_rate` batches (0 disables it), written to `out` (stderr by
  /// default, so that stdout stays the program's).
  explicit BasicProgressBar(std::int64_t refresh_rate = 20, std::FILE* out = stderr);

  std::shared_ptr<Callback> clone() const override { return std::make_shared<BasicProgressBar>(*this); }
  std::string state_key() const override { return "ProgressBar"; }

  void on_train_epoch_start(Trainer& trainer, LightningModuleBase& module) override;
  void on_train_batch_end(Trainer& trainer, LightningModuleBase& module, std::int64_t batch_idx) override;
  void on_train_epoch_end(Trainer& trainer, LightningModuleBase& module) override;
  void on_validation_end(Trainer& trainer, LightningModuleBase& module) override;

  /// Whether the bar is redrawn in place (the stream is a terminal).
  bool interactive() const { return interactive_; }
  /// The text of the current line (without the redraw controls).
  const std::string& last_line() const { return line_; }

 private:
  void draw(Trainer& trainer, std::int64_t done, bool final);

  std::int64_t refresh_rate_;
  std::FILE* out_;
  bool interactive_;
  std::string line_;
  std::chrono::steady_clock::time_point epoch_start_, last_batch_end_;
  std::int64_t epoch_samples_start_ = 0;
  std::int64_t done_ = 0;
};

/// Lightning's progress bar (see BasicProgressBar).
using ProgressBar = BasicProgressBar<>;

#if LAZYTENSOR_HEADER_DEFINITIONS

template <class V>
BasicProgressBar<V>::BasicProgressBar(std::int64_t refresh_rate, std::FILE* out)
    : refresh_rate_(refresh_rate), out_(out), interactive_(out && ::isatty(::fileno(out)) == 1) {
  if (refresh_rate < 0) throw Error("ProgressBar: refresh_rate must be >= 0, got " + std::to_string(refresh_rate));
  if (!out) throw Error("ProgressBar: the output stream is null");
}

template <class V>
void BasicProgressBar<V>::on_train_epoch_start(Trainer& trainer, LightningModuleBase&) {
  epoch_start_ = last_batch_end_ = std::chrono::steady_clock::now();
  epoch_samples_start_ = trainer.samples_seen();
  done_ = 0;
}

template <class V>
void BasicProgressBar<V>::draw(Trainer& trainer, std::int64_t done, bool final) {
  // The epoch's last line is timed at its last batch (validation excluded).
  const auto until = final ? last_batch_end_ : std::chrono::steady_clock::now();
  const double secs = std::chrono::duration<double>(until - epoch_start_).count();
  const std::int64_t total = trainer.num_training_batches();
  std::string s = "Epoch " + std::to_string(trainer.current_epoch()) + ": " + std::to_string(done);
  if (total >= 0) s += "/" + std::to_string(total);
  const auto& shown = final ? trainer.progress_bar_metrics() : trainer.read_local_step_metrics();
  for (const auto& [k, v] : shown) {
    char buf[64];
    std::snprintf(buf, sizeof buf, " %s=%.4g", k.c_str(), v);
    s += buf;
  }
  if (secs > 0) {
    char buf[96];
    // Every replica sees its share: the world's rate is the world size times this one's.
    const double rate = static_cast<double>(trainer.samples_seen() - epoch_samples_start_) *
                        static_cast<double>(trainer.world_size()) / secs;
    std::snprintf(buf, sizeof buf, " [%.0f samples/s", rate);
    s += buf;
    if (!final && total > done && done > 0) {
      const auto left = static_cast<long long>(secs / static_cast<double>(done) * static_cast<double>(total - done));
      std::snprintf(buf, sizeof buf, ", ETA %lld:%02lld", left / 60, left % 60);
      s += buf;
    } else {
      std::snprintf(buf, sizeof buf, ", %.1fs", secs);
      s += buf;
    }
    s += "]";
  }
  line_ = s;
  if (interactive_) {
    std::fprintf(out_, "\r%s\033[K%s", s.c_str(), final ? "\n" : "");
  } else {
    std::fprintf(out_, "%s\n", s.c_str());
  }
  std::fflush(out_);
}

template <class V>
void BasicProgressBar<V>::on_train_batch_end(Trainer& trainer, LightningModuleBase&, std::int64_t batch_idx) {
  done_ = batch_idx + 1;
  last_batch_end_ = std::chrono::steady_clock::now();
  if (refresh_rate_ == 0 || !trainer.is_global_zero()) return;
  if (done_ % refresh_rate_ == 0 && done_ != trainer.num_training_batches()) draw(trainer, done_, false);
}

template <class V>
void BasicProgressBar<V>::on_train_epoch_end(Trainer& trainer, LightningModuleBase&) {
  if (refresh_rate_ == 0 || !trainer.is_global_zero()) return;
  draw(trainer, done_, true);
}

template <class V>
void BasicProgressBar<V>::on_validation_end(Trainer& trainer, LightningModuleBase&) {
  if (refresh_rate_ == 0 || !trainer.is_global_zero() || trainer.sanity_checking() || !interactive_) return;
  std::fprintf(out_, "\r%s (validated)\033[K", line_.c_str());
  std::fflush(out_);
}

#endif  // LAZYTENSOR_HEADER_DEFINITIONS

}  // namespace lazy::train

// Defined once by lazytensor::compiled (src/compiled.cpp).
#define LAZYTENSOR_TRAIN_PROGRESS_BAR_INSTANCES(P) P template class lazy::train::BasicProgressBar<void>;
#if LAZYTENSOR_EXPLICIT_INSTANTIATION
LAZYTENSOR_TRAIN_PROGRESS_BAR_INSTANCES(extern)
#endif
