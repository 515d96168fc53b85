// Training on sharded tensors: data-parallel (batch split, parameters replicated), FSDP-style
// (parameters split over the same axis) and Megatron tensor-parallel (first weight by
// output rows, second by input columns) give the losses and weights of the unsharded run
// (double, <= 1e-12 relative), and parameters keep their sharding through the optimizer.

#include <gtest/gtest.h>

#include <cmath>

#include <lazytensor/lazytensor.hpp>

#include "testing/spmd.hpp"
#include "testing/spmd_training.hpp"

namespace spmd = lazy::spmd;

namespace {

using lazy_tests::SpmdMode;
using TrainingRun = lazy_tests::SpmdRun;

TrainingRun train(SpmdMode mode) {
  const spmd::Mesh data({0, 1, 2, 3}, {4}, {"data"});
  const spmd::Mesh model({0, 1, 2, 3}, {1, 4}, {"data", "model"});
  return lazy_tests::train_spmd_mlp(mode, data, model, {}, 7, 100);
}

}  // namespace

TEST(SpmdTraining, DataParallelMatchesUnsharded) {
  const TrainingRun ref = train(SpmdMode::None);
  const TrainingRun got = train(SpmdMode::Data);
  lazy_tests::expect_same_run(got, ref, "data parallel");
  for (const auto& s : got.specs) EXPECT_EQ(s, "{replicated}");
  // The losses must move: a run that never updated would also agree with itself.
  EXPECT_NE(ref.losses.front(), ref.losses.back());
}

TEST(SpmdTraining, FsdpMatchesUnshardedAndKeepsParametersSharded) {
  const TrainingRun ref = train(SpmdMode::None);
  const TrainingRun got = train(SpmdMode::Fsdp);
  lazy_tests::expect_same_run(got, ref, "fsdp");
  EXPECT_EQ(got.specs[0], "{devices=[4,1]0,1,2,3}");
  EXPECT_EQ(got.specs[1], "{devices=[4]0,1,2,3}");
}

TEST(SpmdTraining, TensorParallelMatchesUnsharded) {
  const TrainingRun ref = train(SpmdMode::None);
  const TrainingRun got = train(SpmdMode::Tensor);
  lazy_tests::expect_same_run(got, ref, "tensor parallel");
  EXPECT_EQ(got.specs[0], "{devices=[4,1]0,1,2,3}");
  EXPECT_EQ(got.specs[2], "{devices=[1,4]0,1,2,3}");
}
