// train::Trainer's loop on one device against a hand-written loop and Lightning's meaning
// of its arguments: the same updates as the hand loop, gradient accumulation equal to a
// larger batch, batch limits, max_steps, validation cadence, sanity steps, fast_dev_run,
// logged values (step, epoch mean) and the errors of bad arguments.

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "trainer_testing.hpp"

namespace {

using namespace trainer_testing;
namespace train = lazy::train;
namespace nn = lazy::nn;

// The message of the lazy::Error that f() throws, or "no error".
template <class F>
std::string message(F&& f) {
  try {
    f();
  } catch (const lazy::Error& e) {
    return std::string(e.what());
  }
  return std::string("no error");
}

TEST(Trainer, FitTakesTheSameStepsAsAHandWrittenLoop) {
  auto ds = make_dataset(64);
  auto loader = lazy::data::make_data_loader(ds, {.batch_size = 8});
  Classifier module;
  train::Trainer trainer(quiet({.max_epochs = 2}));
  trainer.fit(module, *loader);
  EXPECT_EQ(trainer.global_step(), 16);
  EXPECT_EQ(trainer.current_epoch(), 2);
  EXPECT_EQ(module.record.train_steps, 16);

  // The reference: the same model, data and optimizer in a plain loop.
  Classifier ref;
  lazy::optim::SGD opt(ref.parameters(), lazy::optim::SGDOptions(0.1).momentum(0.9));
  std::vector<double> ref_losses;
  for (int epoch = 0; epoch < 2; ++epoch) {
    loader->set_epoch(static_cast<std::uint64_t>(epoch));
    for (auto& b : *loader) {
      opt.zero_grad();
      auto loss = nn::functional::cross_entropy(ref.forward(b.data), b.target);
      loss.backward();
      opt.step();
      lazy::mark_step();
      ref_losses.push_back(loss.item());
    }
  }
  const auto got = module.losses();
  ASSERT_EQ(got.size(), ref_losses.size());
  for (std::size_t i = 0; i < got.size(); ++i) EXPECT_NEAR(got[i], ref_losses[i], 1e-6) << "step " << i;
  const auto w = weights(module), wr = weights(ref);
  for (std::size_t p = 0; p < w.size(); ++p)
    for (std::size_t i = 0; i < w[p].size(); ++i) EXPECT_NEAR(w[p][i], wr[p][i], 1e-5) << "parameter " << p;
  EXPECT_NE(ref_losses.front(), ref_losses.back());
}

TEST(Trainer, AccumulatingKBatchesEqualsOneBatchKTimesLarger) {
  auto ds = make_dataset(64);
  auto small = lazy::data::make_data_loader(ds, {.batch_size = 4});
  auto large = lazy::data::make_data_loader(ds, {.batch_size = 16});
  Classifier a, b;
  train::Trainer(quiet({.max_epochs = 1, .accumulate_grad_batches = 4})).fit(a, *small);
  train::Trainer tb(quiet({.max_epochs = 1}));
  tb.fit(b, *large);
  EXPECT_EQ(tb.global_step(), 4);
  const auto wa = weights(a), wb = weights(b);
  for (std::size_t p = 0; p < wa.size(); ++p)
    for (std::size_t i = 0; i < wa[p].size(); ++i) EXPECT_NEAR(wa[p][i], wb[p][i], 2e-5) << "parameter " << p;
}

TEST(Trainer, BatchLimitsAndMaxSteps) {
  auto ds = make_dataset(64);
  auto loader = lazy::data::make_data_loader(ds, {.batch_size = 8});  // 8 batches
  {
    Classifier m;
    train::Trainer t(quiet({.max_epochs = 2, .limit_train_batches = 3}));
    t.fit(m, *loader);
    EXPECT_EQ(t.global_step(), 6);
    EXPECT_EQ(t.estimated_stepping_batches(), 6);
  }
  {
    Classifier m;
    train::Trainer t(quiet({.max_epochs = 1, .limit_train_batches = 0.5}));
    t.fit(m, *loader);
    EXPECT_EQ(t.global_step(), 4);
  }
  {
    Classifier m;
    train::Trainer t(quiet({.max_steps = 11}));
    t.fit(m, *loader);
    EXPECT_EQ(t.estimated_stepping_batches(), 11);
    EXPECT_EQ(t.global_step(), 11);
    EXPECT_EQ(m.record.train_steps, 11);
    EXPECT_EQ(t.current_epoch(), 2) << "stopped inside the second epoch, which still ends";
  }
}

/// A loader that cannot say its length (Lightning's iterable datasets): a DataLoader's
/// batches without its size().
template <class L>
struct Unsized {
  L* inner;
  auto begin() { return inner->begin(); }
  auto end() { return inner->end(); }
  void set_epoch(std::uint64_t epoch) { inner->set_epoch(epoch); }
};
template <class L>
Unsized<L> unsized(L& loader) {
  return {&loader};
}

TEST(Trainer, BatchLimitsOfALoaderWithoutALength) {
  auto train_data = lazy::data::make_data_loader(make_dataset(64), {.batch_size = 8});  // 8 batches
  auto val_data =
      lazy::data::make_data_loader(make_dataset(24, 5), {.batch_size = 8});  // 3 batches
  auto train_loader = unsized(*train_data);
  auto val_loader = unsized(*val_data);
  {  // An integer limit counts batches, as with a loader that knows its length.
    Classifier m;
    train::Trainer t(quiet({.max_epochs = 2, .limit_train_batches = 3, .limit_val_batches = 2}));
    t.fit(m, train_loader, val_loader);
    EXPECT_EQ(t.global_step(), 6);
    EXPECT_EQ(m.record.train_steps, 6);
    EXPECT_EQ(m.record.val_steps, 2 * 2);
  }
  {  // A limit past the loader's end: the epoch ends with the loader, whole (it validates).
    Classifier m;
    train::Trainer t(quiet({.max_epochs = 2, .limit_train_batches = 20}));
    t.fit(m, train_loader, val_loader);
    EXPECT_EQ(t.global_step(), 16);
    EXPECT_EQ(m.record.val_steps, 2 * 3);
    EXPECT_EQ(t.current_epoch(), 2);
  }
  {  // All (1.0) and none (0.0) are the fractions an unknown length allows.
    Classifier m;
    train::Trainer t(
        quiet({.max_epochs = 1, .limit_train_batches = 1.0, .limit_val_batches = 0.0}));
    t.fit(m, train_loader, val_loader);
    EXPECT_EQ(m.record.train_steps, 8);
    EXPECT_EQ(m.record.val_steps, 0);
  }
  {  // 8 batches accumulated 3 at a time: steps after batches 3 and 6, and the partial
     // accumulation at the loader's end (which the loop cannot see coming) still steps.
    Classifier m;
    train::Trainer t(quiet({.max_epochs = 2, .accumulate_grad_batches = 3}));
    t.fit(m, train_loader);
    EXPECT_EQ(t.global_step(), 2 * 3);
    EXPECT_EQ(m.record.train_steps, 2 * 8);
  }
  {  // Half of an unknown length cannot be taken.
    Classifier m;
    try {
      train::Trainer(quiet({.max_epochs = 1, .limit_train_batches = 0.5})).fit(m, train_loader);
      ADD_FAILURE() << "half of a loader without a length accepted";
    } catch (const lazy::Error& e) {
      EXPECT_NE(std::string(e.what()).find("limit_train_batches = 0.5"), std::string::npos)
          << e.what();
    }
    EXPECT_EQ(m.record.train_steps, 0);
  }
}

TEST(Trainer, ValidationCadenceAndSanitySteps) {
  auto ds = make_dataset(64);
  auto train_loader = lazy::data::make_data_loader(ds, {.batch_size = 8});  // 8 batches
  auto val_loader = lazy::data::make_data_loader(make_dataset(24, 5), {.batch_size = 8});  // 3 batches
  {
    Classifier m;
    train::TrainerOptions o = quiet({.max_epochs = 3});
    o.num_sanity_val_steps = 2;
    train::Trainer t(o);
    t.fit(m, *train_loader, *val_loader);
    EXPECT_EQ(m.record.val_steps, 2 + 3 * 3) << "two sanity steps, then every epoch's 3 batches";
    EXPECT_TRUE(t.callback_metrics().count("val_loss"));
  }
  {
    Classifier m;
    train::TrainerOptions o = quiet({.max_epochs = 2, .val_check_interval = 2});
    train::Trainer t(o);
    t.fit(m, *train_loader, *val_loader);
    EXPECT_EQ(m.record.val_steps, 2 * 4 * 3) << "after batches 2, 4, 6 and at the end of each epoch";
  }
  {
    Classifier m;
    train::Trainer t(quiet({.max_epochs = 4, .check_val_every_n_epoch = 2}));
    t.fit(m, *train_loader, *val_loader);
    EXPECT_EQ(m.record.val_steps, 2 * 3);
  }
  {
    Classifier m;
    train::Trainer t(quiet({.max_epochs = 1, .limit_val_batches = 1}));
    t.fit(m, *train_loader, *val_loader);
    EXPECT_EQ(m.record.val_steps, 1);
  }
}

TEST(Trainer, NoTrainingBatchesEndTheFitAndAFractionOfNoBatchIsAnError) {
  auto fifty = lazy::data::make_data_loader(make_dataset(50), {.batch_size = 1});  // 50 batches
  auto val_loader =
      lazy::data::make_data_loader(make_dataset(24, 5), {.batch_size = 8});  // 3 batches
  {  // 0.01 * 50 = 0.5 batches: Lightning's "0.01 * 50 < 1".
    Classifier m;
    const std::string msg = message([&] {
      train::Trainer(quiet({.max_steps = 1000, .limit_train_batches = 0.01})).fit(m, *fifty);
    });
    EXPECT_NE(msg.find("0.01 * 50 < 1"), std::string::npos) << msg;
    EXPECT_NE(msg.find("limit_train_batches"), std::string::npos) << msg;
    EXPECT_EQ(m.record.train_steps, 0);
  }
  {
    Classifier m;
    const std::string msg = message([&] {
      train::Trainer(quiet({.max_epochs = 1, .limit_val_batches = 0.2}))
          .fit(m, *fifty, *val_loader);
    });
    EXPECT_NE(msg.find("0.2 * 3 < 1"), std::string::npos) << msg;
    EXPECT_NE(msg.find("limit_val_batches"), std::string::npos) << msg;
  }
  {  // Asking for no batch on purpose (an integer 0) trains nothing and returns. max_time
     // only bounds the test: an epoch that cannot end by steps would spin until then.
    Classifier m;
    train::Trainer t(
        quiet({.max_steps = 1000, .max_time = std::chrono::seconds(20), .limit_train_batches = 0}));
    const auto start = std::chrono::steady_clock::now();
    t.fit(m, *fifty);
    EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
    EXPECT_EQ(t.global_step(), 0);
    EXPECT_EQ(t.current_epoch(), 0);
    EXPECT_EQ(m.record.train_steps, 0);
    EXPECT_TRUE(m.record.hooks.empty()) << "no training epoch started";
  }
  {  // A fraction that keeps at least one batch is fine: 0.02 * 50 = 1.
    Classifier m;
    train::Trainer t(quiet({.max_epochs = 2, .limit_train_batches = 0.02}));
    t.fit(m, *fifty);
    EXPECT_EQ(t.global_step(), 2);
  }
}

TEST(Trainer, ValCheckIntervalInBatchesMustBeWithinTheEpoch) {
  auto train_loader =
      lazy::data::make_data_loader(make_dataset(64), {.batch_size = 8});  // 8 batches
  auto val_loader =
      lazy::data::make_data_loader(make_dataset(24, 5), {.batch_size = 8});  // 3 batches
  try {
    train::Trainer(quiet({.val_check_interval = 0}));
    ADD_FAILURE() << "val_check_interval = 0 batches accepted";
  } catch (const lazy::Error& e) {
    EXPECT_NE(std::string(e.what()).find("val_check_interval"), std::string::npos) << e.what();
  }
  {
    Classifier m;
    train::Trainer t(quiet({.max_epochs = 1, .val_check_interval = 9}));
    try {
      t.fit(m, *train_loader, *val_loader);
      ADD_FAILURE() << "validating every 9 batches of an 8-batch epoch accepted";
    } catch (const lazy::Error& e) {
      EXPECT_NE(std::string(e.what()).find("(9 batches)"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("(8)"), std::string::npos) << e.what();
    }
    EXPECT_EQ(m.record.train_steps, 0) << "raised before training";
  }
  {  // Every 8 batches of 8: once an epoch.
    Classifier m;
    train::Trainer t(quiet({.max_epochs = 2, .val_check_interval = 8}));
    t.fit(m, *train_loader, *val_loader);
    EXPECT_EQ(m.record.val_steps, 2 * 3);
  }
}

TEST(Trainer, StatefulCallbacksWithOneStateKeyAreRejected) {
  auto message = [](const std::vector<std::shared_ptr<train::Callback>>& callbacks) {
    train::TrainerOptions o = quiet();
    o.callbacks = callbacks;
    try {
      train::Trainer t(o);
    } catch (const lazy::Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  auto stopper = [](const std::string& mode) {
    return std::make_shared<train::EarlyStopping>(
        train::EarlyStoppingOptions{.monitor = "val_loss", .mode = mode});
  };
  const std::string es_key = "EarlyStopping{monitor=val_loss,mode=min}";
  EXPECT_EQ(stopper("min")->state_key(), es_key);
  EXPECT_NE(message({stopper("min"), stopper("min")}).find("\"" + es_key + "\""),
            std::string::npos);
  EXPECT_EQ(message({stopper("min"), stopper("max")}), "no error");
  // Two checkpoints into different directories but with the same key: their states would mix.
  auto checkpoint = [](const std::string& dir) {
    return std::make_shared<train::ModelCheckpoint>(
        train::ModelCheckpointOptions{.dirpath = dir, .monitor = "val_loss"});
  };
  const std::string ck_key = checkpoint("a")->state_key();
  EXPECT_NE(message({checkpoint("a"), checkpoint("b")}).find("\"" + ck_key + "\""),
            std::string::npos);
  // Callbacks without state may share a key (the base's "Callback").
  EXPECT_EQ(message({std::make_shared<train::Callback>(), std::make_shared<train::Callback>()}),
            "no error");
  // Callbacks whose state appears only once the fit runs pass the constructor's check; the
  // checkpoint refuses them rather than writing one state over the other.
  struct LateState : train::Callback {
    std::string value;
    explicit LateState(std::string v) : value(std::move(v)) {}
    std::map<std::string, std::string> state_dict() const override {
      if (!started) return {};
      return {{"value", value}};
    }
    void on_fit_start(train::Trainer&, train::LightningModuleBase&) override { started = true; }
    bool started = false;
  };
  const std::string dir = temp_dir("late_state");
  auto loader = lazy::data::make_data_loader(make_dataset(16), {.batch_size = 8});
  Classifier m;
  train::TrainerOptions o = quiet({.max_epochs = 1});
  o.callbacks = {std::make_shared<LateState>("a"), std::make_shared<LateState>("b")};
  train::Trainer t(o);
  t.fit(m, *loader);
  const std::string path = dir + "/late.ckpt";
  try {
    t.save_checkpoint(path);
    ADD_FAILURE() << "two stateful callbacks under one key were saved";
  } catch (const lazy::Error& e) {
    EXPECT_NE(std::string(e.what()).find("\"Callback\""), std::string::npos) << e.what();
  }
  EXPECT_FALSE(std::filesystem::exists(path));
}

TEST(Trainer, FastDevRunRunsOneBatchOfEachAndWritesNothing) {
  const std::string dir = temp_dir("fast_dev_run");
  auto loader = lazy::data::make_data_loader(make_dataset(64), {.batch_size = 8});
  Classifier m;
  train::TrainerOptions o;
  o.fast_dev_run = true;
  o.enable_progress_bar = false;
  o.default_root_dir = dir;
  train::Trainer t(o);
  t.fit(m, *loader, *loader);
  EXPECT_EQ(m.record.train_steps, 1);
  EXPECT_EQ(m.record.val_steps, 1);
  EXPECT_EQ(t.logger(), nullptr);
  EXPECT_TRUE(lazy::io::detail::list_directory(dir).empty());
}

TEST(Trainer, EpochValuesAreTheMeanOfTheStepValues) {
  auto loader = lazy::data::make_data_loader(make_dataset(64), {.batch_size = 8});
  Classifier m;
  train::Trainer t(quiet({.max_epochs = 1}));
  t.fit(m, *loader);
  const auto losses = m.losses();
  double mean = 0;
  for (double l : losses) mean += l / static_cast<double>(losses.size());
  const auto& cm = t.callback_metrics();
  ASSERT_TRUE(cm.count("train_loss_epoch"));
  EXPECT_NEAR(cm.at("train_loss_epoch"), mean, 1e-6);
  EXPECT_NEAR(cm.at("train_loss"), mean, 1e-6) << "the bare name is the epoch value once the epoch ends";
  ASSERT_TRUE(cm.count("train_loss_step"));
  EXPECT_NEAR(cm.at("train_loss_step"), losses.back(), 1e-6);
  EXPECT_NEAR(t.progress_bar_metrics().at("train_loss_epoch"), mean, 1e-6);
}

TEST(Trainer, TestValidateAndPredictRunTheirSteps) {
  auto loader = lazy::data::make_data_loader(make_dataset(24, 5), {.batch_size = 8});
  Classifier m;
  train::Trainer t(quiet());
  const auto v = t.validate(m, *loader);
  ASSERT_EQ(v.size(), 1u);
  EXPECT_TRUE(v[0].count("val_loss"));
  const auto r = t.test(m, *loader);
  EXPECT_EQ(m.record.test_steps, 3);
  // test_loss is the mean of the batch losses (equal batches): the loss of the whole set.
  auto all = make_dataset(24, 5);
  auto whole = lazy::data::make_data_loader(all, {.batch_size = 24});
  double ref = 0;
  for (auto& b : *whole) ref = nn::functional::cross_entropy(m.forward(b.data), b.target).item();
  EXPECT_NEAR(r[0].at("test_loss"), ref, 1e-5);
  const auto preds = t.predict(m, *loader);
  ASSERT_EQ(preds.size(), 3u);
  EXPECT_EQ(preds[0].shape(), lazy::Shape({8}));
}

TEST(Trainer, GradientClippingMatchesClippingByHand) {
  auto loader = lazy::data::make_data_loader(make_dataset(64), {.batch_size = 8});
  for (const std::string algorithm : {"norm", "value"}) {
    Classifier module;
    train::TrainerOptions o = quiet({.max_epochs = 1, .gradient_clip_val = 0.05});
    o.gradient_clip_algorithm = algorithm;
    train::Trainer(o).fit(module, *loader);

    Classifier ref;
    lazy::optim::SGD opt(ref.parameters(), lazy::optim::SGDOptions(0.1).momentum(0.9));
    for (auto& b : *loader) {
      opt.zero_grad();
      nn::functional::cross_entropy(ref.forward(b.data), b.target).backward();
      if (algorithm == "norm") {
        nn::utils::clip_grad_norm_(ref.parameters(), 0.05);
      } else {
        nn::utils::clip_grad_value_(ref.parameters(), 0.05);
      }
      opt.step();
      lazy::mark_step();
    }
    Classifier unclipped;
    train::Trainer(quiet({.max_epochs = 1})).fit(unclipped, *loader);
    const auto w = weights(module), wr = weights(ref), wu = weights(unclipped);
    double moved = 0;
    for (std::size_t p = 0; p < w.size(); ++p) {
      for (std::size_t i = 0; i < w[p].size(); ++i) {
        EXPECT_NEAR(w[p][i], wr[p][i], 1e-5) << algorithm << " parameter " << p;
        moved = std::max(moved, static_cast<double>(std::fabs(w[p][i] - wu[p][i])));
      }
    }
    EXPECT_GT(moved, 1e-4) << algorithm << ": clipping at 0.05 must change the run";
  }
}

TEST(Trainer, MaxTimeStopsTraining) {
  auto loader = lazy::data::make_data_loader(make_dataset(64), {.batch_size = 8});
  {  // Already up after the first batch.
    Classifier m;
    train::Trainer t(quiet({.max_epochs = 3, .max_time = std::chrono::duration<double>(0)}));
    t.fit(m, *loader);
    EXPECT_EQ(t.global_step(), 1);
  }
  {  // With replicas it is voted on after every optimizer step, whatever the log cadence.
    Classifier m;
    train::Trainer t(quiet({.strategy = std::string("replica"), .devices = 2, .max_epochs = 3,
                            .max_time = std::chrono::duration<double>(0), .log_every_n_steps = 50}));
    t.fit(m, *loader);
    EXPECT_EQ(t.global_step(), 1);
  }
  {  // Accumulating 2 batches: the first step (after 2 batches) is the first stop.
    Classifier m;
    train::Trainer t(quiet({.strategy = std::string("replica"), .devices = 2, .max_epochs = 3,
                            .max_time = std::chrono::duration<double>(0), .accumulate_grad_batches = 2}));
    t.fit(m, *loader);
    EXPECT_EQ(t.global_step(), 1);
    EXPECT_EQ(m.record.train_steps, 2);
  }
  {  // An hour is never up here.
    Classifier m;
    train::Trainer t(quiet({.max_epochs = 2, .max_time = std::chrono::hours(1)}));
    t.fit(m, *loader);
    EXPECT_EQ(t.global_step(), 16);
  }
}

TEST(Trainer, PrecisionOptionSetsTheStrategysPlugin) {
  auto loader = lazy::data::make_data_loader(make_dataset(64), {.batch_size = 8});
  Classifier mixed, full;
  train::Trainer tm(quiet({.precision = "bf16-mixed", .max_epochs = 1}));
  tm.fit(mixed, *loader);
  EXPECT_EQ(tm.strategy().precision_plugin().name(), "bf16-mixed");
  train::Trainer(quiet({.precision = "32", .max_epochs = 1})).fit(full, *loader);
  const auto a = mixed.losses(), b = full.losses();
  ASSERT_EQ(a.size(), b.size());
  double diff = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    EXPECT_NEAR(a[i], b[i], 0.05) << "bfloat16 products stay close to float";
    diff = std::max(diff, std::fabs(a[i] - b[i]));
  }
  EXPECT_GT(diff, 0.0) << "the products really ran in bfloat16";
}

TEST(Trainer, BadArgumentsAreErrorsNamingThem) {
  EXPECT_NE(message([] { train::Trainer({.strategy = std::string("tpu_spawn")}); }).find("tpu_spawn"), std::string::npos);
  EXPECT_NE(message([] { train::Trainer({.max_steps = -2}); }).find("max_steps"), std::string::npos);
  EXPECT_NE(message([] { train::Trainer({.accumulate_grad_batches = 0}); }).find("accumulate_grad_batches"),
            std::string::npos);
  EXPECT_NE(message([] { train::Trainer({.gradient_clip_algorithm = "l1"}); }).find("\"l1\""), std::string::npos);
  EXPECT_NE(message([] { train::Trainer({.limit_train_batches = 1.5}); }).find("[0, 1]"), std::string::npos);
  EXPECT_NE(message([] { train::Trainer({.accelerator = "gpu"}); }).find("gpu"), std::string::npos);
  // A module without a validation_step given a validation loader.
  struct NoVal : train::LightningModule<Batch> {
    NoVal() { w = register_parameter("w", lazy::zeros<float>({6, 3})); }
    lazy::AnyTensor training_step(const Batch& b, std::int64_t) override {
      return nn::functional::cross_entropy(lazy::Tensor<float>(lazy::matmul(b.data, w)), b.target);
    }
    train::OptimizerConfig configure_optimizers() override {
      return {std::make_shared<lazy::optim::SGD>(parameters(), lazy::optim::SGDOptions(0.1))};
    }
    lazy::Tensor<float> w;
  };
  auto loader = lazy::data::make_data_loader(make_dataset(16), {.batch_size = 8});
  NoVal nv;
  EXPECT_NE(message([&] { train::Trainer(quiet({.max_epochs = 1})).fit(nv, *loader, *loader); }).find("validation_step"),
            std::string::npos);
  EXPECT_NE(message([&] { nv.log("x", 1.0); }).find("outside"), std::string::npos);
}

}  // namespace
