// The Trainer on thread replicas (strategy "replica"): two replicas with their shares of a
// loader equal one device with the whole batch; replicas that log different keys get an
// Error naming them (no hang); a stop decided by one replica stops all of them; the
// checkpoint files follow rank zero's choice; a replica that fails ends the fit with its
// error on every thread.

#include <gtest/gtest.h>

#include <chrono>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "trainer_testing.hpp"

namespace {

using namespace trainer_testing;
namespace train = lazy::train;
namespace nn = lazy::nn;

TEST(TrainerReplicas, TwoReplicasEqualOneDeviceWithTheWholeBatch) {
  auto ds = make_dataset(64);
  auto per_replica = lazy::data::make_data_loader(ds, {.batch_size = 8});
  auto whole = lazy::data::make_data_loader(ds, {.batch_size = 16});
  Classifier replicated, single;
  train::Trainer tr(quiet({.strategy = std::string("replica"), .devices = 2, .max_epochs = 2}));
  tr.fit(replicated, *per_replica);
  EXPECT_EQ(tr.global_step(), 8) << "each replica sees half of the 64 samples: 4 batches of 8 per epoch";
  train::Trainer ts(quiet({.max_epochs = 2}));
  ts.fit(single, *whole);
  EXPECT_EQ(ts.global_step(), 8);
  const auto a = weights(replicated), b = weights(single);
  for (std::size_t p = 0; p < a.size(); ++p)
    for (std::size_t i = 0; i < a[p].size(); ++i) EXPECT_NEAR(a[p][i], b[p][i], 2e-5) << "parameter " << p;
  // The epoch loss is the mean over the replicas' batches with sync_dist (train_loss
  // is logged without it: rank zero's own mean).
  EXPECT_TRUE(tr.callback_metrics().count("train_loss_epoch"));
}

/// Logs a key that depends on the replica.
class RankKeys : public Classifier {
 public:
  lazy::AnyTensor training_step(const Batch& b, std::int64_t i) override {
    auto loss = Classifier::training_step(b, i);
    log(trainer().global_rank() == 0 ? "acc" : "accuracy", loss, {.sync_dist = true});
    return loss;
  }
};

TEST(TrainerReplicas, DifferentLogKeysOnReplicasRaiseNamingThem) {
  auto loader = lazy::data::make_data_loader(make_dataset(32), {.batch_size = 8});
  RankKeys m;
  const auto start = std::chrono::steady_clock::now();
  try {
    train::Trainer(quiet({.strategy = std::string("replica"), .devices = 2, .max_epochs = 1, .log_every_n_steps = 1}))
        .fit(m, *loader);
    FAIL() << "different keys must raise";
  } catch (const lazy::Error& e) {
    const std::string w = e.what();
    EXPECT_NE(w.find("acc"), std::string::npos) << w;
    EXPECT_NE(w.find("accuracy"), std::string::npos) << w;
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(30));
}

/// Logs "score": 1.0 always on rank 0; on rank 1 it gets worse from epoch 1 on.
class DisagreeingScores : public Classifier {
 public:
  void validation_step(const Batch& b, std::int64_t i) override {
    Classifier::validation_step(b, i);
    const bool one = trainer().global_rank() == 1;
    log("score", one && current_epoch() >= 1 ? 2.0 + static_cast<double>(current_epoch()) : 1.0 - 0.1 * static_cast<double>(current_epoch()));
  }
};

TEST(TrainerReplicas, AStopDecidedOnOneReplicaStopsThemAll) {
  auto train_loader = lazy::data::make_data_loader(make_dataset(32), {.batch_size = 8});
  auto val_loader = lazy::data::make_data_loader(make_dataset(16, 5), {.batch_size = 8});
  DisagreeingScores m;
  auto es = std::make_shared<train::EarlyStopping>(train::EarlyStoppingOptions{.monitor = "score", .patience = 1});
  train::TrainerOptions o = quiet({.strategy = std::string("replica"), .devices = 2, .max_epochs = 6});
  o.callbacks = {es};
  train::Trainer t(o);
  t.fit(m, *train_loader, *val_loader);
  // Rank 1 sees no improvement at epoch 1 (patience 1): every replica stops after it.
  EXPECT_EQ(t.current_epoch(), 2);
  EXPECT_EQ(es->wait_count(), 0) << "rank zero's copy improved every epoch";
  EXPECT_EQ(es->stopped_epoch(), 1);
}

/// Asks the Trainer to stop at batch `At` of every epoch on rank `Rank` only (the other
/// replicas' modules are default-constructed, so the choice is in the type).
template <int Rank, int At>
class StopsOnOneRank : public Classifier {
 public:
  void on_train_batch_end(std::int64_t i) override {
    if (trainer().global_rank() == Rank && i == At) trainer().set_should_stop(true);
  }
};

template <int Rank>
void expect_stop_mid_epoch() {
  // 64 samples, 2 replicas, batches of 8: 4 steps per epoch.
  auto loader = lazy::data::make_data_loader(make_dataset(64), {.batch_size = 8});
  const auto start = std::chrono::steady_clock::now();
  {
    StopsOnOneRank<Rank, 1> m;
    train::Trainer t(quiet({.strategy = std::string("replica"), .devices = 2, .max_epochs = 3, .log_every_n_steps = 50}));
    t.fit(m, *loader);
    EXPECT_EQ(t.global_step(), 2) << "rank " << Rank << " asks after batch 1: every replica stops after step 2";
    EXPECT_EQ(m.record.train_steps, 2);
  }
  {  // Before min_epochs whole epochs are done the request waits for the epoch's end.
    StopsOnOneRank<Rank, 1> m;
    train::Trainer t(
        quiet({.strategy = std::string("replica"), .devices = 2, .max_epochs = 3, .min_epochs = 1, .log_every_n_steps = 50}));
    t.fit(m, *loader);
    EXPECT_EQ(t.global_step(), 4) << "rank " << Rank;
    EXPECT_EQ(t.current_epoch(), 1);
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(30));
}

TEST(TrainerReplicas, AShouldStopSetOnOneReplicaMidEpochStopsEveryReplicaAtTheNextStep) {
  expect_stop_mid_epoch<0>();
  expect_stop_mid_epoch<1>();
}

TEST(TrainerReplicas, CheckpointsFollowRankZerosChoice) {
  const std::string dir = temp_dir("replica_ckpt");
  auto train_loader = lazy::data::make_data_loader(make_dataset(32), {.batch_size = 8});
  auto val_loader = lazy::data::make_data_loader(make_dataset(16, 5), {.batch_size = 8});
  DisagreeingScores m;
  auto ck = std::make_shared<train::ModelCheckpoint>(
      train::ModelCheckpointOptions{.dirpath = dir, .filename = "{epoch}", .monitor = "score", .save_top_k = 1});
  train::TrainerOptions o = quiet({.strategy = std::string("replica"), .devices = 2, .max_epochs = 3});
  o.callbacks = {ck};
  train::Trainer(o).fit(m, *train_loader, *val_loader);
  // Rank 0's scores fall every epoch (1.0, 0.9, 0.8): its best (min) is the last epoch,
  // while rank 1 would have kept epoch 0.
  std::vector<std::string> files;
  for (const auto& n : lazy::io::detail::list_directory(dir)) files.push_back(n);
  EXPECT_EQ(files, (std::vector<std::string>{"epoch=2.safetensors"}));
  EXPECT_EQ(ck->best_model_path(), dir + "/epoch=2.safetensors");
}

/// Logs the test loss weighted by the batch's samples, synced over the replicas.
class WeightedTest : public Classifier {
 public:
  void test_step(const Batch& b, std::int64_t) override {
    log("test_loss", nn::functional::cross_entropy(forward(b.data), b.target),
        {.sync_dist = true, .batch_size = static_cast<double>(b.target.numel())});
  }
};

TEST(TrainerReplicas, EvaluationCountsEverySampleOnceWhenReplicasGetUnequalShares) {
  // 25 samples over 2 replicas: shares of 13 and 12, in batches of 4.
  auto data = make_dataset(25, 9);
  auto loader = lazy::data::make_data_loader(data, {.batch_size = 4});
  WeightedTest m;
  const auto got = train::Trainer(quiet({.strategy = std::string("replica"), .devices = 2})).test(m, *loader);
  auto whole = lazy::data::make_data_loader(data, {.batch_size = 25});
  double want = 0;
  for (auto& b : *whole) want = nn::functional::cross_entropy(m.forward(b.data), b.target).item();
  ASSERT_EQ(got.size(), 1u);
  EXPECT_NEAR(got[0].at("test_loss"), want, 1e-5);
}

/// Fails on rank 1 at its third batch.
class FailsOnRankOne : public Classifier {
 public:
  lazy::AnyTensor training_step(const Batch& b, std::int64_t i) override {
    if (trainer().global_rank() == 1 && i == 2) throw std::runtime_error("replica one failed at batch 2");
    return Classifier::training_step(b, i);
  }
};

TEST(TrainerReplicas, AFailingReplicaEndsTheFitWithItsError) {
  auto loader = lazy::data::make_data_loader(make_dataset(64), {.batch_size = 8});
  FailsOnRankOne m;
  const auto start = std::chrono::steady_clock::now();
  try {
    train::Trainer(quiet({.strategy = std::string("replica"), .devices = 2, .max_epochs = 2})).fit(m, *loader);
    FAIL() << "the failure must reach fit's caller";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("replica one failed at batch 2"), std::string::npos) << e.what();
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
}

}  // namespace
