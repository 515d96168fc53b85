// The Trainer's callbacks and logger against Lightning's meaning, each compared with a
// reference computed here from the same values: CSVLogger's rows and files, ModelCheckpoint's
// top-k / last / monitor modes, EarlyStopping's patience and thresholds, the learning-rate
// monitor, the progress bar, and resuming from a checkpoint (epoch end and mid-epoch) giving
// the uninterrupted run's losses bitwise.

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include <lazytensor/io.hpp>

#include "trainer_testing.hpp"

namespace {

using namespace trainer_testing;
namespace train = lazy::train;
namespace nn = lazy::nn;

/// A Classifier whose validation logs a scripted "score" per epoch.
class Scripted : public Classifier {
 public:
  explicit Scripted(std::vector<double> scores) : scores_(std::move(scores)) {}
  void validation_step(const Batch& b, std::int64_t i) override {
    Classifier::validation_step(b, i);
    const auto e = static_cast<std::size_t>(current_epoch());
    log("score", e < scores_.size() ? scores_[e] : scores_.back());
  }

 private:
  std::vector<double> scores_;
};

/// A logger keeping its rows in memory.
class RecordingLogger : public train::Logger {
 public:
  std::string name() const override { return "recording"; }
  std::string version() const override { return "0"; }
  void log_metrics(const std::map<std::string, double>& m, std::int64_t step) override { rows.push_back({step, m}); }
  void log_hyperparams(const std::map<std::string, std::string>& p) override { hparams = p; }
  std::vector<std::pair<std::int64_t, std::map<std::string, double>>> rows;
  std::map<std::string, std::string> hparams;
};

std::vector<std::string> checkpoint_files(const std::string& dir) {
  std::vector<std::string> r;
  for (const auto& n : lazy::io::detail::list_directory(dir))
    if (n.size() > 12 && n.substr(n.size() - 12) == ".safetensors") r.push_back(n);
  std::sort(r.begin(), r.end());
  return r;
}

std::vector<std::vector<std::string>> read_csv(const std::string& path) {
  std::ifstream in(path);
  std::vector<std::vector<std::string>> rows;
  std::string line;
  while (std::getline(in, line)) {
    std::vector<std::string> cells;
    std::stringstream ss(line);
    std::string cell;
    while (std::getline(ss, cell, ',')) cells.push_back(cell);
    if (!line.empty() && line.back() == ',') cells.emplace_back();
    rows.push_back(cells);
  }
  return rows;
}

TEST(TrainerLogging, CsvLoggerWritesOneRowPerLoggingStepAndEpoch) {
  const std::string dir = temp_dir("csv");
  auto loader = lazy::data::make_data_loader(make_dataset(64), {.batch_size = 8});  // 8 steps per epoch
  Classifier m;
  m.hparams["lr"] = "0.1";
  m.hparams["note"] = "two words";
  auto logger = std::make_shared<train::CSVLogger>(dir);
  train::TrainerOptions o = quiet({.max_epochs = 2, .log_every_n_steps = 3});
  o.logger = logger;
  train::Trainer t(o);
  t.fit(m, *loader);
  EXPECT_EQ(logger->log_dir(), dir + "/lightning_logs/version_0");
  EXPECT_EQ(train::CSVLogger(dir).version(), "1") << "the next logger takes the next version";

  const auto losses = m.losses();
  const auto csv = read_csv(logger->log_dir() + "/metrics.csv");
  ASSERT_GE(csv.size(), 2u);
  const auto& header = csv[0];
  auto col = [&](const std::string& name) {
    const auto it = std::find(header.begin(), header.end(), name);
    EXPECT_NE(it, header.end()) << name;
    return static_cast<std::size_t>(it - header.begin());
  };
  const std::size_t step = col("step"), step_loss = col("train_loss_step"), epoch_loss = col("train_loss_epoch"),
                    epoch = col("epoch");
  // Steps 3, 6, 9, 12, 15 (step values) and the two epoch ends (steps 8 and 16).
  std::vector<std::int64_t> step_rows, epoch_rows;
  for (std::size_t r = 1; r < csv.size(); ++r) {
    const auto& row = csv[r];
    ASSERT_EQ(row.size(), header.size()) << "row " << r;
    const auto s = std::stoll(row[step]);
    if (!row[step_loss].empty()) {
      step_rows.push_back(s);
      EXPECT_DOUBLE_EQ(std::stod(row[step_loss]), losses[static_cast<std::size_t>(s - 1)]) << "step " << s;
      EXPECT_EQ(std::stoll(row[epoch]), (s - 1) / 8);
    }
    if (!row[epoch_loss].empty()) {
      epoch_rows.push_back(s);
      const auto e = static_cast<std::size_t>(s / 8 - 1);
      double mean = 0;
      for (std::size_t i = e * 8; i < e * 8 + 8; ++i) mean += losses[i] / 8;
      EXPECT_NEAR(std::stod(row[epoch_loss]), mean, 1e-6);
    }
  }
  EXPECT_EQ(step_rows, (std::vector<std::int64_t>{3, 6, 9, 12, 15}));
  EXPECT_EQ(epoch_rows, (std::vector<std::int64_t>{8, 16}));
  std::ifstream yaml(logger->log_dir() + "/hparams.yaml");
  std::stringstream text;
  text << yaml.rdbuf();
  EXPECT_EQ(text.str(), "lr: 0.1\nnote: \"two words\"\n");
}

TEST(TrainerLogging, CsvLoggerWritesIntegralValuesAsIntegers) {
  // The shortest form of 100000 is "1e+05", which Python's int() does not read.
  const std::string dir = temp_dir("csv_integers");
  train::CSVLogger logger(dir);
  logger.log_metrics({{"loss", 0.25}, {"epoch", 3}}, 100000);
  logger.log_metrics({{"loss", -2.0}, {"big", 1e20}}, 2000000);
  logger.save();
  const auto csv = read_csv(logger.log_dir() + "/metrics.csv");
  ASSERT_EQ(csv.size(), 3u);
  const auto& header = csv[0];
  auto cell = [&](std::size_t row, const std::string& name) {
    const auto it = std::find(header.begin(), header.end(), name);
    EXPECT_NE(it, header.end()) << name;
    return csv[row][static_cast<std::size_t>(it - header.begin())];
  };
  EXPECT_EQ(cell(1, "step"), "100000");
  EXPECT_EQ(cell(1, "epoch"), "3");
  EXPECT_EQ(cell(1, "loss"), "0.25");
  EXPECT_EQ(cell(2, "step"), "2000000");
  EXPECT_EQ(cell(2, "loss"), "-2");
  EXPECT_EQ(cell(2, "big"), "1e+20");  // past 2^53: the shortest form
}

TEST(TrainerLogging, LoggingBadValuesIsAnError) {
  struct BadLog : Classifier {
    lazy::AnyTensor training_step(const Batch& b, std::int64_t i) override {
      auto loss = Classifier::training_step(b, i);
      log("vector", lazy::zeros<float>({2}));
      return loss;
    }
  };
  auto loader = lazy::data::make_data_loader(make_dataset(16), {.batch_size = 8});
  BadLog m;
  try {
    train::Trainer(quiet({.max_epochs = 1})).fit(m, *loader);
    FAIL() << "logging a two-element tensor must raise";
  } catch (const lazy::ShapeError& e) {
    EXPECT_NE(std::string(e.what()).find("\"vector\""), std::string::npos) << e.what();
  }
}

TEST(ModelCheckpoint, KeepsTheTopKByTheMonitorAndTheLast) {
  const std::vector<double> scores{0.5, 0.3, 0.8, 0.1, 0.4};
  auto train_loader = lazy::data::make_data_loader(make_dataset(32), {.batch_size = 8});  // 4 steps per epoch
  auto val_loader = lazy::data::make_data_loader(make_dataset(8, 5), {.batch_size = 8});
  for (const std::string mode : {"min", "max"}) {
    const std::string dir = temp_dir("topk");
    Scripted m(scores);
    auto ck = std::make_shared<train::ModelCheckpoint>(train::ModelCheckpointOptions{
        .dirpath = dir, .filename = "{epoch}-{score:.2f}", .monitor = "score", .save_last = true, .save_top_k = 2,
        .mode = mode});
    train::TrainerOptions o = quiet({.max_epochs = 5});
    o.callbacks = {ck};
    train::Trainer(o).fit(m, *train_loader, *val_loader);
    // Reference: the two best epochs by the scripted scores.
    std::vector<std::size_t> order{0, 1, 2, 3, 4};
    std::sort(order.begin(), order.end(), [&](auto a, auto b) {
      return mode == "min" ? scores[a] < scores[b] : scores[a] > scores[b];
    });
    std::vector<std::string> want{"last.safetensors"};
    for (std::size_t i = 0; i < 2; ++i) {
      char name[64];
      std::snprintf(name, sizeof name, "epoch=%zu-score=%.2f.safetensors", order[i], scores[order[i]]);
      want.emplace_back(name);
    }
    std::sort(want.begin(), want.end());
    EXPECT_EQ(checkpoint_files(dir), want) << mode;
    char best[64];
    std::snprintf(best, sizeof best, "/epoch=%zu-score=%.2f.safetensors", order[0], scores[order[0]]);
    EXPECT_EQ(ck->best_model_path(), dir + best) << mode;
    ASSERT_TRUE(ck->best_model_score().has_value());
    EXPECT_DOUBLE_EQ(*ck->best_model_score(), scores[order[0]]);
    // Each kept file is a complete checkpoint whose model is that epoch's.
    const lazy::StateDict last = lazy::io::load(dir + "/last.safetensors");
    EXPECT_EQ(last.metadata().at("epoch"), "5");
    EXPECT_EQ(last.metadata().at("global_step"), "20");
    const auto w = weights(m);
    EXPECT_EQ(last.at("state_dict.fc1.weight").as<float>().to_vector(), w[0]);
  }
}

TEST(ModelCheckpoint, ANewBestMayTakeTheEvictedFilesName) {
  // save_top_k = 1 into one fixed name: each improvement replaces the file it evicts. The
  // ranking lost the new entry (erased as the evicted one) and the fit threw out_of_range.
  const std::string dir = temp_dir("same_name");
  auto train_loader = lazy::data::make_data_loader(make_dataset(16), {.batch_size = 8});
  auto val_loader = lazy::data::make_data_loader(make_dataset(8, 5), {.batch_size = 8});
  Scripted m({0.9, 0.5, 0.7, 0.2});
  auto ck = std::make_shared<train::ModelCheckpoint>(
      train::ModelCheckpointOptions{.dirpath = dir, .filename = "best", .monitor = "score"});
  train::TrainerOptions o = quiet({.max_epochs = 4});
  o.callbacks = {ck};
  train::Trainer(o).fit(m, *train_loader, *val_loader);
  EXPECT_EQ(checkpoint_files(dir), (std::vector<std::string>{"best.safetensors"}));
  EXPECT_EQ(ck->best_model_path(), dir + "/best.safetensors");
  ASSERT_TRUE(ck->best_model_score().has_value());
  EXPECT_DOUBLE_EQ(*ck->best_model_score(), 0.2);
  EXPECT_EQ(ck->best_k_models().size(), 1u);
  EXPECT_EQ(lazy::io::load(dir + "/best.safetensors").metadata().at("epoch"),
            "4");  // the last improvement's
}

TEST(ModelCheckpoint, ATakenNameGetsAVersionAndNaNRanksWorst) {
  auto train_loader = lazy::data::make_data_loader(make_dataset(16), {.batch_size = 8});
  auto val_loader = lazy::data::make_data_loader(make_dataset(8, 5), {.batch_size = 8});
  {  // Every file kept under one name: -v1, -v2 (Lightning's), none written over.
    const std::string dir = temp_dir("versions");
    Scripted m({0.3});
    train::TrainerOptions o = quiet({.max_epochs = 3});
    o.callbacks = {std::make_shared<train::ModelCheckpoint>(train::ModelCheckpointOptions{
        .dirpath = dir, .filename = "run", .monitor = "score", .save_top_k = -1})};
    train::Trainer(o).fit(m, *train_loader, *val_loader);
    EXPECT_EQ(
        checkpoint_files(dir),
        (std::vector<std::string>{"run-v1.safetensors", "run-v2.safetensors", "run.safetensors"}));
  }
  {  // NaN ranks as +inf in "min" mode: kept while there is room, evicted first.
    const std::string dir = temp_dir("nan");
    Scripted m({std::nan(""), 0.5, 0.7});
    auto ck = std::make_shared<train::ModelCheckpoint>(train::ModelCheckpointOptions{
        .dirpath = dir, .filename = "{epoch}", .monitor = "score", .save_top_k = 2});
    train::TrainerOptions o = quiet({.max_epochs = 3});
    o.callbacks = {ck};
    train::Trainer(o).fit(m, *train_loader, *val_loader);
    EXPECT_EQ(checkpoint_files(dir),
              (std::vector<std::string>{"epoch=1.safetensors", "epoch=2.safetensors"}));
    EXPECT_EQ(ck->best_model_path(), dir + "/epoch=1.safetensors");
  }
  // Values an int64 cannot hold print as text (the cast was undefined behaviour); a field
  // not among the metrics reads 0, as Lightning's.
  const train::ModelCheckpoint names({.filename = "{epoch}-{val_loss}-{missing}"});
  EXPECT_EQ(names.format_checkpoint_name(
                {{"epoch", 3}, {"val_loss", std::numeric_limits<double>::infinity()}}),
            "epoch=3-val_loss=inf-missing=0");
  EXPECT_EQ(names.format_checkpoint_name({{"epoch", 3}, {"val_loss", 1e30}}, 2),
            "epoch=3-val_loss=1e+30-missing=0-v2");
}

TEST(ModelCheckpoint, AnEarlierRunsLastGetsAVersionAndLastResumesTheNewest) {
  auto loader = lazy::data::make_data_loader(make_dataset(16), {.batch_size = 8});
  const std::string dir = temp_dir("last_versions");
  struct Run {
    std::shared_ptr<train::ModelCheckpoint> ck;
    std::int64_t steps = 0, global_step = 0;
  };
  auto run = [&](std::int64_t epochs, const std::string& ckpt, bool versions = true) {
    Classifier m;
    Run r{std::make_shared<train::ModelCheckpoint>(train::ModelCheckpointOptions{
        .dirpath = dir, .save_last = true, .enable_version_counter = versions})};
    train::TrainerOptions o = quiet({.max_epochs = epochs});
    o.callbacks = {r.ck};
    train::Trainer t(o);
    t.fit(m, *loader, ckpt);
    r.steps = m.record.train_steps;
    r.global_step = t.global_step();
    return r;
  };
  // Lightning's _save_last_checkpoint: a last.safetensors that is not this run's own is
  // kept, and this run writes last-v1 (then last-v2 ...).
  EXPECT_EQ(run(1, "").ck->last_model_path(), dir + "/last.safetensors");     // 2 steps
  EXPECT_EQ(run(2, "").ck->last_model_path(), dir + "/last-v1.safetensors");  // 4 steps
  EXPECT_EQ(checkpoint_files(dir),
            (std::vector<std::string>{"epoch=0-step=2.safetensors", "epoch=1-step=4.safetensors",
                                      "last-v1.safetensors", "last.safetensors"}));
  EXPECT_EQ(lazy::io::load(dir + "/last.safetensors").metadata().at("global_step"), "2");
  EXPECT_EQ(lazy::io::load(dir + "/last-v1.safetensors").metadata().at("global_step"), "4");
  // ckpt_path "last": the newest last*.safetensors by modification time.
  namespace fs = std::filesystem;
  const auto now = fs::file_time_type::clock::now();
  fs::last_write_time(dir + "/last.safetensors", now - std::chrono::hours(2));
  fs::last_write_time(dir + "/last-v1.safetensors", now - std::chrono::hours(1));
  {
    const Run r = run(3, "last");  // from last-v1 (epoch 2 of 3 left)
    EXPECT_EQ(r.steps, 2);
    EXPECT_EQ(r.global_step, 6);
    // Its state names last-v1 as its last: written over, no new version.
    EXPECT_EQ(r.ck->last_model_path(), dir + "/last-v1.safetensors");
    EXPECT_FALSE(fs::exists(dir + "/last-v2.safetensors"));
  }
  // Equal times (coarse file-system stamps): the higher version is the later save.
  fs::last_write_time(dir + "/last.safetensors", now - std::chrono::minutes(30));
  fs::last_write_time(dir + "/last-v1.safetensors", now - std::chrono::minutes(30));
  EXPECT_EQ(run(3, "last").steps, 0);  // from last-v1, which finished epoch 3 of 3
  fs::last_write_time(dir + "/last.safetensors", now + std::chrono::hours(1));
  {
    const Run r = run(3, "last");  // from last.safetensors (epochs 1 and 2 left)
    EXPECT_EQ(r.steps, 4);
    EXPECT_EQ(r.global_step, 6);
    EXPECT_EQ(r.ck->last_model_path(), dir + "/last.safetensors");
  }
  // Without the version counter a new run writes over the earlier run's last.
  EXPECT_EQ(run(1, "", false).ck->last_model_path(), dir + "/last.safetensors");
  EXPECT_FALSE(fs::exists(dir + "/last-v2.safetensors"));
  EXPECT_EQ(lazy::io::load(dir + "/last.safetensors").metadata().at("global_step"), "2");
}

TEST(ModelCheckpoint, AMonitorNotLoggedYetSkipsTopKUntilValidationRuns) {
  // Saves every 2 steps from the start, before the first validation logs "score": Lightning
  // warns and writes "last" only; after a validation a missing key is an error.
  const std::string dir = temp_dir("not_yet");
  auto train_loader = lazy::data::make_data_loader(make_dataset(32), {.batch_size = 8});  // 4 steps
  auto val_loader = lazy::data::make_data_loader(make_dataset(8, 5), {.batch_size = 8});
  Scripted m({0.4, 0.6});
  auto ck = std::make_shared<train::ModelCheckpoint>(
      train::ModelCheckpointOptions{.dirpath = dir,
                                    .filename = "{epoch}-{step}",
                                    .monitor = "score",
                                    .save_last = true,
                                    .every_n_train_steps = 2});
  train::TrainerOptions o = quiet({.max_epochs = 2});
  o.callbacks = {ck};
  train::Trainer(o).fit(m, *train_loader, *val_loader);
  // Steps 2 and 4 come before the first validation (at the end of epoch 0); step 6 and 8
  // rank by epoch 0's 0.4 (kept) and, at step 8, still 0.4 (not better).
  EXPECT_EQ(checkpoint_files(dir),
            (std::vector<std::string>{"epoch=1-step=6.safetensors", "last.safetensors"}));
  EXPECT_EQ(lazy::io::load(dir + "/last.safetensors").metadata().at("global_step"), "8");
  // A metric name with a '/' makes a subdirectory, as Lightning's checkpoint IO does.
  const std::string dir2 = temp_dir("slash");
  struct Slashed : Classifier {
    void validation_step(const Batch& b, std::int64_t i) override {
      Classifier::validation_step(b, i);
      log("val/score", 0.25);
    }
  } s;
  train::TrainerOptions o2 = quiet({.max_epochs = 1});
  o2.callbacks = {std::make_shared<train::ModelCheckpoint>(train::ModelCheckpointOptions{
      .dirpath = dir2, .filename = "{val/score:.2f}", .monitor = "val/score"})};
  train::Trainer(o2).fit(s, *train_loader, *val_loader);
  EXPECT_EQ(checkpoint_files(dir2 + "/val"), (std::vector<std::string>{"score=0.25.safetensors"}));
}

TEST(ModelCheckpoint, WithoutAMonitorKeepsTheLatestEveryNSteps) {
  const std::string dir = temp_dir("steps");
  auto loader = lazy::data::make_data_loader(make_dataset(32), {.batch_size = 8});
  Classifier m;
  train::TrainerOptions o = quiet({.max_epochs = 2});
  o.callbacks = {std::make_shared<train::ModelCheckpoint>(
      train::ModelCheckpointOptions{.dirpath = dir, .every_n_train_steps = 3})};
  train::Trainer(o).fit(m, *loader);
  EXPECT_EQ(checkpoint_files(dir), (std::vector<std::string>{"epoch=1-step=6.safetensors"}));
  {  // Keeping every file under a name that repeats within an epoch: each save writes over
     // the last one of that name (Lightning's), not a -vN copy.
    const std::string all = temp_dir("steps_all");
    Classifier m2;
    train::TrainerOptions o2 = quiet({.max_epochs = 2});
    o2.callbacks = {std::make_shared<train::ModelCheckpoint>(train::ModelCheckpointOptions{
        .dirpath = all, .filename = "{epoch}", .save_top_k = -1, .every_n_train_steps = 2})};
    train::Trainer(o2).fit(m2, *loader);
    EXPECT_EQ(checkpoint_files(all),
              (std::vector<std::string>{"epoch=0.safetensors", "epoch=1.safetensors"}));
  }
  EXPECT_THROW(train::ModelCheckpoint({.save_top_k = 3}), lazy::Error) << "top 3 of what, without a monitor";
  EXPECT_THROW(train::ModelCheckpoint({.mode = "best"}), lazy::Error);
}

/// A user's checkpoint callback that names its base as the base's own name (inherited
/// constructor, base hook called explicitly), as with any non-template base class.
struct CountingCheckpoint : train::ModelCheckpoint {
  using ModelCheckpoint::ModelCheckpoint;
  std::shared_ptr<train::Callback> clone() const override { return std::make_shared<CountingCheckpoint>(*this); }
  void on_train_epoch_end(train::Trainer& trainer, train::LightningModuleBase& module) override {
    ++epoch_ends;
    ModelCheckpoint::on_train_epoch_end(trainer, module);
  }
  int epoch_ends = 0;
};

TEST(ModelCheckpoint, ASubclassNamesItsBaseAndKeepsItsBehaviour) {
  const std::string dir = temp_dir("subclass");
  auto loader = lazy::data::make_data_loader(make_dataset(32), {.batch_size = 8});
  Classifier m;
  auto ck = std::make_shared<CountingCheckpoint>(train::ModelCheckpointOptions{.dirpath = dir});
  train::TrainerOptions o = quiet({.max_epochs = 2});
  o.callbacks = {ck};
  train::Trainer(o).fit(m, *loader);
  EXPECT_EQ(ck->epoch_ends, 2);
  // The base's own saving ran: the last epoch's file (4 steps an epoch), as a plain one writes.
  EXPECT_EQ(checkpoint_files(dir), (std::vector<std::string>{"epoch=1-step=8.safetensors"}));
}

/// The epoch at which EarlyStopping(min, patience, min_delta) stops over `scores`
/// (training runs epochs 0..stop), computed directly.
std::size_t reference_stop(const std::vector<double>& scores, std::int64_t patience, double min_delta) {
  double best = std::numeric_limits<double>::infinity();
  std::int64_t wait = 0;
  for (std::size_t e = 0; e < scores.size(); ++e) {
    if (scores[e] < best - min_delta) {
      best = scores[e];
      wait = 0;
    } else if (++wait >= patience) {
      return e;
    }
  }
  return scores.size() - 1;
}

TEST(EarlyStopping, StopsAfterPatienceChecksWithoutImprovement) {
  const std::vector<double> scores{1.0, 0.9, 0.95, 0.899, 0.91, 0.92, 0.5, 0.4};
  auto train_loader = lazy::data::make_data_loader(make_dataset(16), {.batch_size = 8});
  auto val_loader = lazy::data::make_data_loader(make_dataset(8, 5), {.batch_size = 8});
  for (const double delta : {0.0, 0.01}) {
    Scripted m(scores);
    auto es = std::make_shared<train::EarlyStopping>(
        train::EarlyStoppingOptions{.monitor = "score", .min_delta = delta, .patience = 2});
    train::TrainerOptions o = quiet({.max_epochs = 8});
    o.callbacks = {es};
    train::Trainer t(o);
    t.fit(m, *train_loader, *val_loader);
    const std::size_t stop = reference_stop(scores, 2, delta);
    EXPECT_EQ(t.current_epoch(), static_cast<std::int64_t>(stop) + 1) << "min_delta " << delta;
    EXPECT_EQ(es->stopped_epoch(), static_cast<std::int64_t>(stop));
  }
  {  // min_epochs holds training past the stop.
    Scripted m(scores);
    train::TrainerOptions o = quiet({.max_epochs = 8, .min_epochs = 6});
    o.callbacks = {std::make_shared<train::EarlyStopping>(train::EarlyStoppingOptions{.monitor = "score", .patience = 1})};
    train::Trainer t(o);
    t.fit(m, *train_loader, *val_loader);
    EXPECT_EQ(t.current_epoch(), 6);
  }
}

TEST(EarlyStopping, ThresholdsAndNonFiniteValuesStop) {
  auto train_loader = lazy::data::make_data_loader(make_dataset(16), {.batch_size = 8});
  auto val_loader = lazy::data::make_data_loader(make_dataset(8, 5), {.batch_size = 8});
  auto stop_epoch = [&](std::vector<double> scores, train::EarlyStoppingOptions es) {
    Scripted m(std::move(scores));
    es.monitor = "score";
    train::TrainerOptions o = quiet({.max_epochs = 6});
    o.callbacks = {std::make_shared<train::EarlyStopping>(es)};
    train::Trainer t(o);
    t.fit(m, *train_loader, *val_loader);
    return t.current_epoch() - 1;
  };
  // Both thresholds compare strictly, as Lightning's monitor_op (torch.lt / torch.gt) does:
  // reaching the value exactly does not stop.
  EXPECT_EQ(stop_epoch({0.9, 0.7, 0.5, 0.3, 0.1}, {.patience = 10, .stopping_threshold = 0.5}), 3);
  EXPECT_EQ(stop_epoch({0.9, 0.7, 0.49, 0.3, 0.1}, {.patience = 10, .stopping_threshold = 0.5}), 2);
  EXPECT_EQ(stop_epoch({0.1, 0.3, 0.5, 0.7, 0.9},
                       {.patience = 10, .mode = "max", .stopping_threshold = 0.5}),
            3);
  EXPECT_EQ(stop_epoch({0.9, 0.7, 2.0, 3.0, 0.1}, {.patience = 10, .divergence_threshold = 2.0}),
            3);
  EXPECT_EQ(stop_epoch({0.9, 0.7, 3.0, 0.3, 0.1}, {.patience = 10, .divergence_threshold = 2.0}), 2);
  EXPECT_EQ(stop_epoch({0.9, std::nan(""), 0.5}, {.patience = 10}), 1);
  EXPECT_EQ(stop_epoch({0.9, std::nan(""), 0.5}, {.patience = 10, .check_finite = false}), 5);
  try {
    stop_epoch({0.9}, {.monitor = "missing"});
  } catch (const lazy::Error& e) {
    ADD_FAILURE() << "monitor is set by stop_epoch; unexpected: " << e.what();
  }
  Classifier plain;
  train::TrainerOptions o = quiet({.max_epochs = 1});
  o.callbacks = {std::make_shared<train::EarlyStopping>(train::EarlyStoppingOptions{.monitor = "val_acc"})};
  try {
    train::Trainer(o).fit(plain, *train_loader, *val_loader);
    FAIL() << "a monitor that was never logged must raise";
  } catch (const lazy::Error& e) {
    EXPECT_NE(std::string(e.what()).find("\"val_acc\""), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("val_loss"), std::string::npos) << "names what was logged: " << e.what();
  }
}

TEST(ModelCheckpoint, FilenameFormatSpecsFormatAsPythonWould) {
  const std::map<std::string, double> metrics{{"epoch", 3}, {"step", 12}, {"val_loss", 0.12345}};
  auto name = [&](const std::string& tpl, bool insert = true) {
    return train::ModelCheckpoint({.filename = tpl, .auto_insert_metric_name = insert})
        .format_checkpoint_name(metrics);
  };
  // The expectations are what Python's str.format gives for the same fields.
  EXPECT_EQ(name("{epoch:02d}-{val_loss:.2f}"), "epoch=03-val_loss=0.12");
  EXPECT_EQ(name("{step:+05d}_{val_loss:.3e}_{val_loss:8.4f}", false), "+0012_1.235e-01_  0.1235");
  EXPECT_EQ(name("{val_loss:g}|{epoch:-3d}|{epoch:#d}|{val_loss: .1f}", false),
            "0.12345|  3|3| 0.1");
  EXPECT_EQ(name("{val_loss:}"), "val_loss=0.12345") << "an empty spec is no spec";
  // Anything else names the spec instead of reaching printf (where %s or %n would crash).
  for (const std::string spec : {"s", "%n", ".2d", ".f", ">10.2f", "123f", "2.123f", "d ", "x"}) {
    try {
      const std::string got = name("{val_loss:" + spec + "}");
      ADD_FAILURE() << "spec \"" << spec << "\" gave \"" << got << "\"";
    } catch (const lazy::Error& e) {
      EXPECT_NE(std::string(e.what()).find("spec \"" + spec + "\""), std::string::npos) << e.what();
    }
  }
  // d takes integers only, as in Python (0.12345 has no integer text).
  try {
    name("{val_loss:02d}");
    ADD_FAILURE() << "0.12345 formatted as an integer";
  } catch (const lazy::Error& e) {
    EXPECT_NE(std::string(e.what()).find("integer"), std::string::npos) << e.what();
  }
}

TEST(ModelCheckpoint, ValidateAloneSavesNothingAndLeavesEarlyStoppingAlone) {
  auto val_loader = lazy::data::make_data_loader(make_dataset(16, 5), {.batch_size = 8});
  const std::string dir = temp_dir("validate_only");
  auto ck = std::make_shared<train::ModelCheckpoint>(
      train::ModelCheckpointOptions{.dirpath = dir, .monitor = "val_loss", .save_last = true});
  auto es = std::make_shared<train::EarlyStopping>(
      train::EarlyStoppingOptions{.monitor = "val_loss", .patience = 0});
  // Strict, on a value validate() never logs: a check would raise.
  auto strict = std::make_shared<train::EarlyStopping>(
      train::EarlyStoppingOptions{.monitor = "never_logged"});
  train::TrainerOptions o = quiet();
  o.callbacks = {ck, es, strict};
  train::Trainer t(o);
  Classifier m;
  const auto results = t.validate(m, *val_loader);
  ASSERT_EQ(results.size(), 1u);
  EXPECT_TRUE(results[0].count("val_loss")) << "the validation itself ran";
  EXPECT_TRUE(checkpoint_files(dir).empty());
  EXPECT_EQ(ck->best_model_path(), "");
  EXPECT_EQ(ck->last_model_path(), "");
  EXPECT_EQ(es->wait_count(), 0);
  EXPECT_EQ(es->best_score(), std::numeric_limits<double>::infinity())
      << "no check: the best is still the initial";
  EXPECT_FALSE(t.should_stop());

  // The default ModelCheckpoint of a plain Trainer: its directory is resolved only by a fit.
  const std::string root = temp_dir("validate_default");
  train::TrainerOptions d;
  d.logger = false;
  d.enable_progress_bar = false;
  d.default_root_dir = root;
  train::Trainer plain(d);
  plain.validate(m, *val_loader);
  const train::ModelCheckpoint* default_ck = nullptr;
  for (const auto& c : plain.callbacks())
    if (const auto* p = dynamic_cast<const train::ModelCheckpoint*>(c.get())) default_ck = p;
  ASSERT_NE(default_ck, nullptr);
  EXPECT_EQ(default_ck->best_model_path(), "");
  EXPECT_TRUE(lazy::io::detail::list_directory(root).empty());
}

TEST(ModelCheckpoint, WithValidationEverySecondEpochSavesAfterValidationsOnly) {
  const std::vector<double> scores{0.5, 0.4, 0.3, 0.2};
  auto train_loader = lazy::data::make_data_loader(make_dataset(16), {.batch_size = 8});
  auto val_loader = lazy::data::make_data_loader(make_dataset(8, 5), {.batch_size = 8});
  const std::string dir = temp_dir("every_second");
  Scripted m(scores);
  train::TrainerOptions o = quiet({.max_epochs = 4, .check_val_every_n_epoch = 2});
  o.callbacks = {std::make_shared<train::ModelCheckpoint>(train::ModelCheckpointOptions{
      .dirpath = dir, .filename = "{epoch}-{score:.2f}", .monitor = "score", .save_top_k = -1})};
  train::Trainer(o).fit(m, *train_loader, *val_loader);
  // Epochs 1 and 3 validate (epoch + 1 divisible by 2), with their own scores.
  EXPECT_EQ(checkpoint_files(dir), (std::vector<std::string>{"epoch=1-score=0.40.safetensors",
                                                             "epoch=3-score=0.20.safetensors"}));
}

TEST(EarlyStopping, WithValidationEverySecondEpochChecksAfterValidationsOnly) {
  // Only the odd epochs validate; the even epochs' scores are never seen.
  const std::vector<double> scores{1.0, 0.4, 1.0, 0.45, 1.0, 0.3, 1.0, 0.2};
  const std::vector<double> validated{0.4, 0.45, 0.3, 0.2};
  auto train_loader = lazy::data::make_data_loader(make_dataset(16), {.batch_size = 8});
  auto val_loader = lazy::data::make_data_loader(make_dataset(8, 5), {.batch_size = 8});
  for (const bool strict : {true, false}) {
    Scripted m(scores);
    auto es = std::make_shared<train::EarlyStopping>(
        train::EarlyStoppingOptions{.monitor = "score", .patience = 1, .strict = strict});
    train::TrainerOptions o = quiet({.max_epochs = 8, .check_val_every_n_epoch = 2});
    o.callbacks = {es};
    train::Trainer t(o);
    t.fit(m, *train_loader, *val_loader);
    const auto stop = static_cast<std::int64_t>(2 * reference_stop(validated, 1, 0.0) + 1);
    EXPECT_EQ(es->stopped_epoch(), stop) << "strict " << strict;
    EXPECT_EQ(t.current_epoch(), stop + 1) << "strict " << strict;
  }
}

/// A Classifier that logs a scripted "epoch_score" in its on_train_epoch_end hook.
class EpochEndScore : public Classifier {
 public:
  explicit EpochEndScore(std::vector<double> scores) : scores_(std::move(scores)) {}
  void on_train_epoch_end() override {
    Classifier::on_train_epoch_end();
    log("epoch_score", scores_.at(static_cast<std::size_t>(current_epoch())));
  }

 private:
  std::vector<double> scores_;
};

TEST(EarlyStopping, MonitorsAValueTheModuleLogsInItsEpochEndHook) {
  const std::vector<double> scores{1.0, 0.5, 0.7, 0.2, 0.1};
  auto loader = lazy::data::make_data_loader(make_dataset(16), {.batch_size = 8});
  const std::string dir = temp_dir("epoch_end_hook");
  EpochEndScore m(scores);
  auto es = std::make_shared<train::EarlyStopping>(
      train::EarlyStoppingOptions{.monitor = "epoch_score", .patience = 1});
  auto ck = std::make_shared<train::ModelCheckpoint>(train::ModelCheckpointOptions{
      .dirpath = dir, .filename = "{epoch}-{epoch_score:.1f}", .monitor = "epoch_score"});
  auto logger = std::make_shared<RecordingLogger>();
  train::TrainerOptions o = quiet({.max_epochs = 5});
  o.callbacks = {es, ck};
  o.logger = logger;
  train::Trainer t(o);
  t.fit(m, *loader);
  const std::size_t stop = reference_stop(scores, 1, 0.0);
  EXPECT_EQ(t.current_epoch(), static_cast<std::int64_t>(stop) + 1);
  // The best of the epochs run, by its own value.
  std::size_t best = 0;
  for (std::size_t e = 1; e <= stop; ++e)
    if (scores[e] < scores[best]) best = e;
  char file[64];
  std::snprintf(file, sizeof file, "epoch=%zu-epoch_score=%.1f.safetensors", best, scores[best]);
  EXPECT_EQ(checkpoint_files(dir), std::vector<std::string>{file});
  // The logger got each epoch's value in that epoch's row.
  std::vector<double> logged;
  for (const auto& [step, row] : logger->rows)
    if (row.count("epoch_score")) logged.push_back(row.at("epoch_score"));
  EXPECT_EQ(logged, std::vector<double>(scores.begin(),
                                        scores.begin() + static_cast<std::ptrdiff_t>(stop) + 1));
}

TEST(LearningRateMonitor, LogsTheSchedulersRates) {
  struct Scheduled : Classifier {
    train::OptimizerConfig configure_optimizers() override {
      auto opt = std::make_shared<lazy::optim::SGD>(parameters(), lazy::optim::SGDOptions(0.1));
      return {opt, std::make_shared<lazy::optim::StepLR>(*opt, 2, 0.5)};
    }
  };
  auto loader = lazy::data::make_data_loader(make_dataset(16), {.batch_size = 8});
  Scheduled m;
  auto logger = std::make_shared<RecordingLogger>();
  train::TrainerOptions o = quiet({.max_epochs = 5});
  o.logger = logger;
  o.callbacks = {std::make_shared<train::LearningRateMonitor>()};
  train::Trainer(o).fit(m, *loader);
  std::vector<double> rates;
  for (const auto& [step, row] : logger->rows)
    if (row.count("lr-SGD")) rates.push_back(row.at("lr-SGD"));
  ASSERT_EQ(rates.size(), 5u);
  for (std::size_t e = 0; e < 5; ++e) EXPECT_DOUBLE_EQ(rates[e], 0.1 * std::pow(0.5, static_cast<double>(e / 2))) << e;
}

TEST(ProgressBar, PrintsTheEpochsProgressAndValues) {
  std::FILE* f = std::tmpfile();
  ASSERT_NE(f, nullptr);
  auto loader = lazy::data::make_data_loader(make_dataset(64), {.batch_size = 8});
  Classifier m;
  train::TrainerOptions o = quiet({.max_epochs = 1});
  o.callbacks = {std::make_shared<train::ProgressBar>(3, f)};
  train::Trainer(o).fit(m, *loader);
  std::rewind(f);
  std::string text;
  char buf[512];
  while (std::fgets(buf, sizeof buf, f)) text += buf;
  std::fclose(f);
  EXPECT_NE(text.find("Epoch 0: 3/8"), std::string::npos) << text;
  EXPECT_NE(text.find("Epoch 0: 6/8"), std::string::npos) << text;
  EXPECT_NE(text.find("Epoch 0: 8/8 train_loss_epoch="), std::string::npos) << text;
  EXPECT_NE(text.find("samples/s"), std::string::npos) << text;
  EXPECT_EQ(text.find('\r'), std::string::npos) << "not a terminal: plain lines";
}

/// Losses of a deterministic run of `epochs` epochs over a shuffled loader.
std::vector<double> run_losses(std::int64_t epochs, const std::string& dir, const std::string& ckpt,
                               std::int64_t every_n_steps, std::int64_t max_steps = -1) {
  auto loader = lazy::data::make_data_loader(make_dataset(64), {.batch_size = 8, .shuffle = true, .seed = 4});
  Classifier m(0.1, ckpt.empty() ? 7 : 99);  // a resumed run starts from other weights
  train::TrainerOptions o = quiet({.max_epochs = epochs, .max_steps = max_steps, .deterministic = true});
  if (!dir.empty()) {
    o.callbacks = {std::make_shared<train::ModelCheckpoint>(train::ModelCheckpointOptions{
        .dirpath = dir, .save_last = true, .every_n_train_steps = every_n_steps})};
  }
  train::Trainer t(o);
  t.fit(m, *loader, ckpt);
  return m.losses();
}

TEST(TrainerResume, ContinuesBitwiseFromAnEpochEndAndFromInsideAnEpoch) {
  const std::vector<double> full = run_losses(4, "", "", 0);
  ASSERT_EQ(full.size(), 32u);
  {  // Interrupted after epoch 2 (of 4), resumed from last.
    const std::string dir = temp_dir("resume_epoch");
    const auto first = run_losses(2, dir, "", 0);
    const auto rest = run_losses(4, dir, "last", 0);
    ASSERT_EQ(first.size(), 16u);
    ASSERT_EQ(rest.size(), 16u);
    for (std::size_t i = 0; i < 16; ++i) {
      EXPECT_EQ(first[i], full[i]) << "step " << i;
      EXPECT_EQ(rest[i], full[16 + i]) << "step " << 16 + i;
    }
  }
  {  // Interrupted at step 11 (inside epoch 1); the last checkpoint is from step 9.
    const std::string dir = temp_dir("resume_step");
    const auto first = run_losses(4, dir, "", 3, 11);
    ASSERT_EQ(first.size(), 11u);
    const auto rest = run_losses(4, dir, "last", 3);
    ASSERT_EQ(rest.size(), 32u - 9u);
    for (std::size_t i = 0; i < rest.size(); ++i) EXPECT_EQ(rest[i], full[9 + i]) << "step " << 9 + i;
  }
}

}  // namespace
