// The child of tests/train/test_checkpoint_kill.cpp (not a GoogleTest program): trains
// trainer_testing::Classifier with a ModelCheckpoint that saves at every optimizer step into
// the directory it is given (epoch=E-step=S.safetensors, keeping only the latest one, so
// files keep being created and removed, plus last.safetensors), for an unbounded number of
// epochs. When the directory already holds last.safetensors it resumes from it (ckpt_path
// "last"), so each run continues where the previous, killed one stopped.
//
//   lazytensor_checkpoint_writer <dir> [--progress]
//
// Writes nothing on stdout. With --progress it reports on stderr, in milliseconds since the
// program started, when training starts ("start <global_step> <ms>") and every save that
// completed ("saved <global_step> <ms>"). Exit status 1 (with the error on stderr) when the
// run fails; the test kills it long before max_epochs ends.

#include <chrono>
#include <cstdio>
#include <cstring>
#include <exception>
#include <memory>
#include <string>

#include "trainer_testing.hpp"

namespace checkpoint_writer {

namespace train = lazy::train;
using Clock = std::chrono::steady_clock;

/// Milliseconds since `start`.
inline long long ms_since(Clock::time_point start) {
  return static_cast<long long>(std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start).count());
}

/// Reports the start of training and every save on stderr. Listed after the
/// ModelCheckpoint, so its on_train_batch_end runs once that save returned.
class Progress : public train::Callback {
 public:
  explicit Progress(Clock::time_point start) : start_(start) {}
  std::string state_key() const override { return "checkpoint_writer.Progress"; }
  void on_train_start(train::Trainer& trainer, train::LightningModuleBase&) override {
    std::fprintf(stderr, "start %lld %lld\n", static_cast<long long>(trainer.global_step()), ms_since(start_));
  }
  void on_train_batch_end(train::Trainer& trainer, train::LightningModuleBase&, std::int64_t) override {
    std::fprintf(stderr, "saved %lld %lld\n", static_cast<long long>(trainer.global_step()), ms_since(start_));
  }

 private:
  Clock::time_point start_;
};

}  // namespace checkpoint_writer

int main(int argc, char** argv) {
  namespace train = lazy::train;
  const auto start = checkpoint_writer::Clock::now();
  const bool progress = argc == 3 && std::strcmp(argv[2], "--progress") == 0;
  if (argc < 2 || argc > 3 || (argc == 3 && !progress) || argv[1][0] == '\0') {
    std::fprintf(stderr, "usage: %s <checkpoint directory> [--progress]\n", argc > 0 ? argv[0] : "checkpoint_writer");
    return 2;
  }
  const std::string dir = argv[1];
  try {
    auto loader = lazy::data::make_data_loader(trainer_testing::make_dataset(256), {.batch_size = 8});
    trainer_testing::Classifier module;
    train::TrainerOptions o;
    o.logger = false;
    o.enable_progress_bar = false;
    o.num_sanity_val_steps = 0;
    o.max_epochs = 100000;
    // Without a monitor save_top_k = 1 keeps the latest file: every save creates one file
    // and removes the previous one.
    o.callbacks = {std::make_shared<train::ModelCheckpoint>(train::ModelCheckpointOptions{
        .dirpath = dir, .save_last = true, .save_top_k = 1, .every_n_train_steps = 1})};
    if (progress) o.callbacks.push_back(std::make_shared<checkpoint_writer::Progress>(start));
    train::Trainer trainer(o);
    const bool resume = lazy::io::detail::path_exists(dir + "/" + train::ModelCheckpoint::kLastName +
                                                      train::ModelCheckpoint::kFileExtension);
    trainer.fit(module, *loader, resume ? std::string("last") : std::string());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "checkpoint_writer: %s\n", e.what());
    return 1;
  }
  return 0;
}
