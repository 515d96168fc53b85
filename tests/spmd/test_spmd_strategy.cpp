// lazy::train::SpmdStrategy (include/lazytensor/train/spmd_strategy.hpp). Its tests live with the
// SPMD tests because SPMD mode, once on, holds for the whole process (the train tests spawn
// replicas, which SPMD mode forbids). A strategy-driven loop, data parallel and fully
// sharded, gives the losses and weights of the same loop on one device (double, <= 1e-12
// relative); inputs arrive sharded over the data axis; the Strategy methods keep their
// one-replica meaning.

#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include <lazytensor/lazytensor.hpp>

#include "testing/spmd.hpp"
#include "testing/spmd_training.hpp"

namespace spmd = lazy::spmd;
namespace nn = lazy::nn;


namespace {

struct StrategyRun {
  std::vector<double> losses;
  std::vector<std::vector<double>> weights;
  std::vector<std::string> specs;
};

// Four SGD steps of a two-layer MLP in double, written only against the Strategy API.
StrategyRun run_with(lazy::train::Strategy& strategy) {
  return strategy.launch([](lazy::train::Strategy& s) {
    lazy::set_rng_state(11);
    nn::Sequential model(nn::Linear(8, 16), nn::ReLU(), nn::Linear(16, 4));
    s.setup(*model);
    auto params = model->parameters();
    lazy::optim::SGD opt(params, lazy::optim::SGDOptions(0.1).momentum(0.9));
    StrategyRun r;
    for (int step = 0; step < 4; ++step) {
      std::vector<std::int64_t> labels(8);
      for (int i = 0; i < 8; ++i) labels[static_cast<std::size_t>(i)] = (i * 3 + step) % 4;
      auto batch = s.batch_to_device(std::pair{lazy_tests::random_tensor({8, 8}, 200 + static_cast<unsigned>(step)),
                                               lazy::from_vector<std::int64_t>(labels, {8})});
      opt.zero_grad();
      auto loss = nn::functional::cross_entropy(lazy::Tensor<double>(model->forward(batch.first)), batch.second);
      s.backward(loss);
      s.optimizer_step(opt);
      lazy::mark_step();
      r.losses.push_back(loss.item());
    }
    lazy_tests::record_parameters(params, r);
    return r;
  });
}

StrategyRun single_device_reference() {
  lazy::train::SingleDeviceStrategy single(lazy::Device(0));
  single.set_precision_plugin(lazy::train::make_precision("64-true"));
  return run_with(single);
}

}  // namespace

TEST(SpmdStrategy, DataParallelMatchesOneDevice) {
  const StrategyRun want = single_device_reference();
  lazy::train::SpmdStrategy strategy(spmd::Mesh({0, 1, 2, 3}, {4}, {"data"}));
  strategy.set_precision_plugin(lazy::train::make_precision("64-true"));
  const StrategyRun got = run_with(strategy);
  lazy_tests::expect_same_run(got, want, "data parallel");
  for (const auto& s : got.specs) EXPECT_EQ(s, "{replicated}");
  EXPECT_NE(want.losses.front(), want.losses.back()) << "the reference must train";
}

TEST(SpmdStrategy, FullyShardedSplitsEveryDivisibleParameterAndMatchesOneDevice) {
  const StrategyRun want = single_device_reference();
  const spmd::Mesh mesh({0, 1, 2, 3}, {2, 2}, {"data", "fsdp"});
  lazy::train::SpmdStrategy strategy(mesh, lazy::train::fully_sharded(mesh, "fsdp"));
  strategy.set_precision_plugin(lazy::train::make_precision("64-true"));
  const StrategyRun got = run_with(strategy);
  lazy_tests::expect_same_run(got, want, "fully sharded");
  // fc1.weight [16, 8], fc1.bias [16], fc2.weight [4, 16], fc2.bias [4]: dimension 0 over
  // "fsdp" (2 devices), replicated over "data".
  ASSERT_EQ(got.specs.size(), 4u);
  EXPECT_EQ(got.specs[0], "{devices=[2,1,2]0,2,1,3 last_tile_dim_replicate}");
  EXPECT_EQ(got.specs[1], "{devices=[2,2]0,2,1,3 last_tile_dim_replicate}");
}

TEST(SpmdStrategy, FullyShardedReplicatesWhatTheAxisDoesNotDivide) {
  const spmd::Mesh mesh({0, 1, 2, 3}, {4}, {"fsdp"});
  const auto rule = lazy::train::fully_sharded(mesh, "fsdp");
  EXPECT_EQ(rule("w", lazy::zeros<double>({8, 3})).size(), 1u);
  EXPECT_TRUE(rule("w", lazy::zeros<double>({6, 4})).empty());
  EXPECT_TRUE(rule("s", lazy::zeros<double>({})).empty());
  try {
    (void)lazy::train::fully_sharded(mesh, "model");
    FAIL() << "an unknown axis must raise";
  } catch (const lazy::ShardingError& e) {
    EXPECT_NE(std::string(e.what()).find("\"model\""), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("\"fsdp\""), std::string::npos) << e.what();
  }
}

TEST(SpmdStrategy, AParameterSpecThatDoesNotFitNamesTheParameter) {
  const spmd::Mesh mesh({0, 1, 2, 3}, {4}, {"data"});
  // Every parameter split along dimension 0 over 4 devices: fc2.weight [3, 16] does not fit.
  lazy::train::SpmdStrategy strategy(mesh, [](const std::string&, const lazy::AnyTensor&) {
    return spmd::PartitionSpec{"data"};
  });
  nn::Sequential model(nn::Linear(16, 8), nn::Linear(8, 3));
  try {
    strategy.setup(*model);
    FAIL() << "a spec that does not fit must raise";
  } catch (const lazy::ShardingError& e) {
    EXPECT_NE(std::string(e.what()).find("\"1.weight\""), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("divisible by 4"), std::string::npos) << e.what();
  }
}

TEST(SpmdStrategy, InputsArriveShardedOverTheDataAxis) {
  const spmd::Mesh mesh({0, 1, 2, 3}, {2, 2}, {"data", "model"});
  lazy::train::SpmdStrategy strategy(mesh);
  std::vector<float> x(48);
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(i);
  std::vector<std::int64_t> y(16);
  for (std::size_t i = 0; i < y.size(); ++i) y[i] = static_cast<std::int64_t>(i);
  lazy::data::TensorDataset<float, std::int64_t> ds(lazy::from_vector<float>(x, {16, 3}),
                                                    lazy::from_vector<std::int64_t>(y, {16}));
  auto loader = lazy::data::make_data_loader(ds, {.batch_size = 8});
  auto batches = strategy.process_dataloader(*loader);
  std::size_t seen = 0;
  for (auto& batch : batches) {
    EXPECT_EQ(spmd::sharding_spec(batch.data), "{devices=[2,1,2]0,1,2,3 last_tile_dim_replicate}");
    EXPECT_EQ(batch.data.to_vector(), std::vector<float>(x.begin() + static_cast<std::ptrdiff_t>(seen * 3),
                                                         x.begin() + static_cast<std::ptrdiff_t>((seen + 8) * 3)));
    // Devices 2 and 3 (data coordinate 1) hold rows 4..7 of the batch.
    EXPECT_EQ(spmd::local_shards(batch.target)[2].data.to_vector(),
              (std::vector<std::int64_t>{static_cast<std::int64_t>(seen) + 4, static_cast<std::int64_t>(seen) + 5,
                                         static_cast<std::int64_t>(seen) + 6, static_cast<std::int64_t>(seen) + 7}));
    seen += 8;
  }
  EXPECT_EQ(seen, 16u);

  // batch_to_device shards what the data axis divides and leaves the rest whole.
  auto moved = strategy.batch_to_device(std::vector<lazy::Tensor<float>>{lazy::zeros<float>({4, 2}),
                                                                        lazy::zeros<float>({3, 2}),
                                                                        lazy::zeros<float>({})});
  EXPECT_EQ(spmd::sharding_spec(moved[0]), "{devices=[2,1,2]0,1,2,3 last_tile_dim_replicate}");
  EXPECT_EQ(spmd::sharding_spec(moved[1]), "");
  EXPECT_EQ(spmd::sharding_spec(moved[2]), "");
}

TEST(SpmdStrategy, StrategyMethodsKeepTheirOneReplicaMeaning) {
  lazy::train::SpmdStrategy strategy(spmd::Mesh({2, 3, 0, 1}, {4}, {"data"}));
  EXPECT_EQ(strategy.root_device(), lazy::Device(2));
  EXPECT_FALSE(strategy.is_distributed());
  EXPECT_EQ(strategy.num_processes(), 1);
  const auto seen = strategy.launch([](lazy::train::Strategy& s) {
    const auto t = lazy::from_vector<double>({1.0, 2.0}, {2});
    EXPECT_EQ(s.reduce(t, "sum").to_vector(), (std::vector<double>{1.0, 2.0}));
    EXPECT_EQ(s.all_gather(t).shape(), lazy::Shape({2}));
    EXPECT_EQ(s.broadcast(std::string("only")), "only");
    EXPECT_TRUE(s.reduce_boolean_decision(true));
    s.barrier("anywhere");
    return std::pair{s.world_size(), lazy::device()};
  });
  EXPECT_EQ(seen.first, 1);
  EXPECT_EQ(seen.second, lazy::Device(2)) << "launch runs on the root device";
}

TEST(SpmdStrategy, ACheckpointOfAShardedModelHoldsTheWholeParameters) {
  const spmd::Mesh mesh({0, 1, 2, 3}, {4}, {"fsdp"});
  lazy::train::SpmdStrategy strategy(mesh, lazy::train::fully_sharded(mesh, "fsdp"));
  strategy.set_precision_plugin(lazy::train::make_precision("64-true"));
  lazy::set_rng_state(5);
  nn::Linear sharded(8, 4);
  lazy::set_rng_state(5);
  nn::Linear plain(8, 4);
  plain->to(lazy::DType::Float64);
  strategy.setup(*sharded);
  ASSERT_EQ(spmd::sharding_spec(sharded->parameters()[0].as<double>()), "{devices=[4,1]0,1,2,3}");
  const std::string path = ::testing::TempDir() + "spmd_strategy.safetensors";
  strategy.save_checkpoint(sharded->state_dict(), path);
  const lazy::StateDict loaded = lazy::io::load(path);
  for (const auto& [name, t] : plain->state_dict()) {
    EXPECT_EQ(loaded.at(name).as<double>().to_vector(), t.as<double>().to_vector()) << name;
  }
  strategy.remove_checkpoint(path);
}
