// The Trainer's learning-rate schedulers against Lightning's rules: every scheduler
// configure_optimizers returns is stepped at its own interval and frequency, a checkpoint
// keeps each scheduler's state and a resumed fit continues every rate, and a scheduler on
// an optimizer the module did not return is an error. Rates are worked out by hand.

#include <gtest/gtest.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <lazytensor/io.hpp>

#include "trainer_testing.hpp"

namespace {

using namespace trainer_testing;
namespace train = lazy::train;
namespace optim = lazy::optim;

/// SGD at 0.1 with two schedulers: halve every 2 optimizer steps ("step", frequency 2),
/// and divide by 10 every epoch (given in lr_schedulers); records the rate each batch
/// trains at.
class TwoSchedulers : public Classifier {
 public:
  train::OptimizerConfig configure_optimizers() override {
    auto opt = std::make_shared<optim::SGD>(parameters(), optim::SGDOptions(0.1));
    return {.optimizer = opt,
            .lr_scheduler = std::make_shared<optim::StepLR>(*opt, 1, 0.5),
            .interval = "step",
            .frequency = 2,
            .lr_schedulers = {{std::make_shared<optim::StepLR>(*opt, 1, 0.1), "epoch", 1}}};
  }
  void on_train_batch_start(std::int64_t) override { rates.push_back(trainer().optimizer().lr()); }
  std::vector<double> rates;
};

// 2 batches an epoch: step 2 halves (0.05), the epoch's end divides by 10 (0.005); step 4
// halves again (0.0025), the second epoch's end gives 0.00025.
const std::vector<double> kRates{0.1, 0.1, 0.005, 0.005};
constexpr double kFinalRate = 0.00025;

void expect_rates(const std::vector<double>& got, const std::vector<double>& want) {
  ASSERT_EQ(got.size(), want.size());
  for (std::size_t i = 0; i < want.size(); ++i)
    EXPECT_NEAR(got[i], want[i], 1e-15) << "batch " << i;
}

TEST(TrainerSchedulers, EverySchedulerStepsAtItsIntervalAndFrequency) {
  auto loader = lazy::data::make_data_loader(make_dataset(16), {.batch_size = 8});
  TwoSchedulers m;
  train::Trainer t(quiet({.max_epochs = 2}));
  t.fit(m, *loader);
  expect_rates(m.rates, kRates);
  EXPECT_NEAR(t.optimizer().lr(), kFinalRate, 1e-16);
  ASSERT_EQ(t.lr_scheduler_configs().size(), 2u);
  EXPECT_EQ(t.lr_scheduler_configs()[0].interval, "step");
  EXPECT_EQ(t.lr_scheduler_configs()[1].interval, "epoch");
  EXPECT_EQ(t.lr_scheduler_configs()[0].scheduler->last_epoch(), 2);
  EXPECT_EQ(t.lr_scheduler_configs()[1].scheduler->last_epoch(), 2);
  EXPECT_EQ(t.lr_scheduler(), t.lr_scheduler_configs()[0].scheduler.get());
}

TEST(TrainerSchedulers, AResumedFitContinuesEveryScheduler) {
  auto loader = lazy::data::make_data_loader(make_dataset(16), {.batch_size = 8});
  const std::string dir = temp_dir("two_schedulers");
  auto options = [&](std::int64_t epochs) {
    train::TrainerOptions o = quiet({.max_epochs = epochs});
    o.callbacks = {std::make_shared<train::ModelCheckpoint>(
        train::ModelCheckpointOptions{.dirpath = dir, .save_last = true})};
    return o;
  };
  TwoSchedulers first;
  train::Trainer(options(1)).fit(first, *loader);
  const lazy::StateDict ckpt = lazy::io::load(dir + "/last.safetensors");
  EXPECT_EQ(ckpt.metadata().at("lr_schedulers.0.last_epoch"), "1");
  EXPECT_EQ(ckpt.metadata().at("lr_schedulers.1.last_epoch"), "1");
  EXPECT_EQ(ckpt.metadata().at("optimizer.param_groups.0.initial_lr"), "0.1");
  TwoSchedulers second;
  train::Trainer t(options(2));
  t.fit(second, *loader, "last");
  expect_rates(second.rates, {kRates[2], kRates[3]});
  EXPECT_NEAR(t.optimizer().lr(), kFinalRate, 1e-16);
  EXPECT_EQ(t.lr_scheduler_configs()[0].scheduler->last_epoch(), 2);
  EXPECT_EQ(t.lr_scheduler_configs()[1].scheduler->last_epoch(), 2);
}

TEST(TrainerSchedulers, ASequentialLRStepsPerBatchInTheTrainer) {
  // LinearLR warm-up over 2 steps, then StepLR(1, 0.5) from the milestone (torch's
  // SequentialLR): rates 0.05, 0.075, 0.1 (the milestone restarts at the initial rate),
  // 0.05.
  struct Warmup : Classifier {
    train::OptimizerConfig configure_optimizers() override {
      auto opt = std::make_shared<optim::SGD>(parameters(), optim::SGDOptions(0.1));
      auto warm = std::make_shared<optim::LinearLR>(*opt, 0.5, 1.0, 2);
      auto decay = std::make_shared<optim::StepLR>(*opt, 1, 0.5);
      auto seq = std::make_shared<optim::SequentialLR>(
          *opt, std::vector<std::shared_ptr<optim::LRScheduler>>{warm, decay},
          std::vector<std::int64_t>{2});
      return {.optimizer = opt, .lr_scheduler = seq, .interval = "step"};
    }
    void on_train_batch_start(std::int64_t) override {
      rates.push_back(trainer().optimizer().lr());
    }
    std::vector<double> rates;
  };
  auto loader = lazy::data::make_data_loader(make_dataset(16), {.batch_size = 8});
  Warmup m;
  train::Trainer(quiet({.max_epochs = 2})).fit(m, *loader);
  expect_rates(m.rates, {0.05, 0.075, 0.1, 0.05});
}

TEST(TrainerSchedulers, SchedulersOfAnotherOptimizerOrBadSettingsAreErrors) {
  struct Misconfigured : Classifier {
    std::string what;
    train::OptimizerConfig configure_optimizers() override {
      auto opt = std::make_shared<optim::SGD>(parameters(), optim::SGDOptions(0.1));
      other = std::make_shared<optim::SGD>(parameters(), optim::SGDOptions(0.1));
      train::OptimizerConfig c{.optimizer = opt};
      if (what == "other") c.lr_schedulers = {{std::make_shared<optim::StepLR>(*other, 1, 0.5)}};
      if (what == "interval")
        c.lr_schedulers = {{std::make_shared<optim::StepLR>(*opt, 1, 0.5), "batch"}};
      if (what == "frequency")
        c.lr_schedulers = {{std::make_shared<optim::StepLR>(*opt, 1, 0.5), "step", 0}};
      if (what == "empty") c.lr_schedulers = {{nullptr}};
      return c;
    }
    std::shared_ptr<optim::SGD> other;
  };
  auto loader = lazy::data::make_data_loader(make_dataset(16), {.batch_size = 8});
  auto error = [&](const std::string& what) {
    Misconfigured m;
    m.what = what;
    try {
      train::Trainer(quiet({.max_epochs = 1})).fit(m, *loader);
    } catch (const lazy::Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(error("other").find("did not return"), std::string::npos) << error("other");
  EXPECT_NE(error("interval").find("\"batch\""), std::string::npos) << error("interval");
  EXPECT_NE(error("frequency").find("frequency must be >= 1, got 0"), std::string::npos)
      << error("frequency");
  EXPECT_NE(error("empty").find("scheduler 0"), std::string::npos) << error("empty");
}

/// Counts the calls of its state_dict().
struct CountingCallback : train::Callback {
  std::string state_key() const override { return "CountingCallback"; }
  std::map<std::string, std::string> state_dict() const override {
    ++calls;
    return {{"calls", std::to_string(calls)}};
  }
  mutable int calls = 0;
};

TEST(TrainerCheckpoint, DumpCheckpointAsksEachCallbackForItsStateOnce) {
  auto loader = lazy::data::make_data_loader(make_dataset(16), {.batch_size = 8});
  Classifier m;
  auto counter = std::make_shared<CountingCallback>();
  train::TrainerOptions o = quiet({.max_epochs = 1});
  o.callbacks = {counter};
  train::Trainer t(o);
  EXPECT_EQ(counter->calls, 1) << "the constructor's check of the state keys";
  t.fit(m, *loader);
  counter->calls = 0;
  const lazy::StateDict ckpt = t.dump_checkpoint();
  EXPECT_EQ(counter->calls, 1);
  // What was written is that one call's state.
  EXPECT_EQ(ckpt.metadata().at("callbacks.CountingCallback.calls"), "1");
}

}  // namespace
