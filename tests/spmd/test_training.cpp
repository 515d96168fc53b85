// Training on sharded tensors: data-parallel (batch split, parameters replicated), FSDP-style
// (parameters split over the same axis) and Megatron tensor-parallel (first weight by
// output rows, second by input columns) give the losses and weights of the unsharded run
// (double, <= 1e-12 relative), and parameters keep their sharding through the optimizer.

#include <gtest/gtest.h>

#include <cmath>

#include <lazytensor/lazytensor.hpp>

#include "testing/spmd.hpp"

namespace spmd = lazy::spmd;
namespace nn = lazy::nn;

namespace {

enum class Mode { None, Data, Fsdp, Tensor };

struct TrainingRun {
  std::vector<double> losses;
  std::vector<std::vector<double>> weights;
  std::vector<std::string> specs;
};

TrainingRun train(Mode mode) {
  lazy::set_rng_state(7);
  nn::Linear fc1(8, 16), fc2(16, 4);
  fc1->to(lazy::DType::Float64);
  fc2->to(lazy::DType::Float64);
  const spmd::Mesh data({0, 1, 2, 3}, {4}, {"data"});
  const spmd::Mesh model({0, 1, 2, 3}, {1, 4}, {"data", "model"});
  auto params = fc1->parameters();
  for (auto& p : fc2->parameters()) params.push_back(p);
  // params: fc1.weight [16, 8], fc1.bias [16], fc2.weight [4, 16], fc2.bias [4].
  if (mode == Mode::Data) {
    for (auto& p : params) spmd::mark_sharding(p, data, {});
  } else if (mode == Mode::Fsdp) {
    for (auto& p : params) spmd::mark_sharding(p, data, {"data"});
  } else if (mode == Mode::Tensor) {
    spmd::mark_sharding(params[0], model, {"model", std::nullopt});
    spmd::mark_sharding(params[1], model, {"model"});
    spmd::mark_sharding(params[2], model, {std::nullopt, "model"});
    spmd::mark_sharding(params[3], model, {});
  }
  lazy::optim::SGD opt(params, lazy::optim::SGDOptions(0.1).momentum(0.9));
  TrainingRun r;
  for (int step = 0; step < 4; ++step) {
    auto x = lazy_tests::random_tensor({8, 8}, 100 + static_cast<unsigned>(step));
    std::vector<std::int64_t> labels(8);
    for (int i = 0; i < 8; ++i) labels[static_cast<std::size_t>(i)] = (i * 3 + step) % 4;
    auto y = lazy::from_vector<std::int64_t>(labels, {8});
    if (mode == Mode::Data || mode == Mode::Fsdp) {
      spmd::mark_sharding(x, data, {"data"});
      spmd::mark_sharding(y, data, {"data"});
    } else if (mode == Mode::Tensor) {
      spmd::mark_sharding(x, model, {});
      spmd::mark_sharding(y, model, {});
    }
    opt.zero_grad();
    auto loss = nn::functional::cross_entropy(fc2(lazy::Tensor<double>(lazy::relu(fc1(x)))), y);
    loss.backward();
    opt.step();
    lazy::mark_step();
    r.losses.push_back(loss.item());
  }
  for (auto& p : params) {
    r.weights.push_back(lazy::Tensor<double>(p).to_vector());
    r.specs.push_back(spmd::sharding_spec(lazy::Tensor<double>(p)));
  }
  return r;
}

}  // namespace

TEST(SpmdTraining, DataParallelMatchesUnsharded) {
  const TrainingRun ref = train(Mode::None);
  const TrainingRun got = train(Mode::Data);
  lazy_tests::expect_same_run(got, ref, "data parallel");
  for (const auto& s : got.specs) EXPECT_EQ(s, "{replicated}");
  // The losses must move: a run that never updated would also agree with itself.
  EXPECT_NE(ref.losses.front(), ref.losses.back());
}

TEST(SpmdTraining, FsdpMatchesUnshardedAndKeepsParametersSharded) {
  const TrainingRun ref = train(Mode::None);
  const TrainingRun got = train(Mode::Fsdp);
  lazy_tests::expect_same_run(got, ref, "fsdp");
  EXPECT_EQ(got.specs[0], "{devices=[4,1]0,1,2,3}");
  EXPECT_EQ(got.specs[1], "{devices=[4]0,1,2,3}");
}

TEST(SpmdTraining, TensorParallelMatchesUnsharded) {
  const TrainingRun ref = train(Mode::None);
  const TrainingRun got = train(Mode::Tensor);
  lazy_tests::expect_same_run(got, ref, "tensor parallel");
  EXPECT_EQ(got.specs[0], "{devices=[4,1]0,1,2,3}");
  EXPECT_EQ(got.specs[2], "{devices=[1,4]0,1,2,3}");
}
