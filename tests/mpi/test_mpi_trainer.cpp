// The Trainer's ReplicaStrategy over MPI processes (mpirun -np 2, 2 replicas each): the
// world of 4 replicas trains what one device trains on the whole batch, and the checkpoint
// files follow global rank zero's decisions only (ranks in the other process would choose
// differently), written once.

#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "train/trainer_testing.hpp"

#include <mpi.h>  // (after the library, which asks for MPI's C API only)

namespace {

using namespace trainer_testing;
namespace train = lazy::train;

TEST(MpiTrainer, FourReplicasInTwoProcessesEqualOneDeviceWithTheWholeBatch) {
  ASSERT_EQ(lazy::runtime::process_count(), 2) << "run under mpirun -np 2";
  auto ds = make_dataset(64);
  auto per_replica = lazy::data::make_data_loader(ds, {.batch_size = 4});
  auto whole = lazy::data::make_data_loader(ds, {.batch_size = 16});
  Classifier replicated, single;
  train::Trainer tr(quiet({.strategy = std::string("replica"), .devices = 2, .max_epochs = 2}));
  tr.fit(replicated, *per_replica);
  EXPECT_EQ(tr.global_step(), 8) << "each replica sees a quarter of the 64 samples: 4 batches of 4 per epoch";
  train::Trainer ts(quiet({.max_epochs = 2}));
  ts.fit(single, *whole);
  // Every process's `replicated` was trained (by its first replica), as in Lightning's DDP.
  const auto a = weights(replicated), b = weights(single);
  for (std::size_t p = 0; p < a.size(); ++p)
    for (std::size_t i = 0; i < a[p].size(); ++i)
      EXPECT_NEAR(a[p][i], b[p][i], 2e-5) << "process " << lazy::runtime::process_index() << " parameter " << p;
}

/// "score" falls every epoch on global rank zero; on every other rank it rises from epoch 1.
class DisagreeingScores : public Classifier {
 public:
  void validation_step(const Batch& b, std::int64_t i) override {
    Classifier::validation_step(b, i);
    const bool zero = trainer().global_rank() == 0;
    log("score", !zero && current_epoch() >= 1 ? 2.0 + static_cast<double>(current_epoch())
                                               : 1.0 - 0.1 * static_cast<double>(current_epoch()));
  }
};

TEST(MpiTrainer, CheckpointsAreGlobalRankZerosChoiceWrittenOnce) {
  // One directory for both processes: process 0 names it.
  char name[256] = {};
  if (lazy::runtime::process_index() == 0) {
    const std::string d = temp_dir("mpi_ckpt");
    std::strncpy(name, d.c_str(), sizeof name - 1);
  }
  MPI_Bcast(name, sizeof name, MPI_CHAR, 0, MPI_COMM_WORLD);
  const std::string dir = name;
  auto train_loader = lazy::data::make_data_loader(make_dataset(32), {.batch_size = 4});
  auto val_loader = lazy::data::make_data_loader(make_dataset(16, 5), {.batch_size = 4});
  DisagreeingScores m;
  auto ck = std::make_shared<train::ModelCheckpoint>(
      train::ModelCheckpointOptions{.dirpath = dir, .filename = "{epoch}", .monitor = "score", .save_top_k = 1});
  train::TrainerOptions o = quiet({.strategy = std::string("replica"), .devices = 2, .max_epochs = 3});
  o.callbacks = {ck};
  train::Trainer(o).fit(m, *train_loader, *val_loader);
  MPI_Barrier(MPI_COMM_WORLD);
  // Rank zero's best (min) score is the last epoch; the other ranks would have kept epoch 0.
  std::vector<std::string> files;
  for (const auto& n : lazy::io::detail::list_directory(dir)) files.push_back(n);
  EXPECT_EQ(files, (std::vector<std::string>{"epoch=2.safetensors"})) << "process " << lazy::runtime::process_index();
  EXPECT_NO_THROW((void)lazy::io::load(dir + "/epoch=2.safetensors"));
}

}  // namespace
