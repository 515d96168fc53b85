// Tests of train/strategy.hpp, train/single_device.hpp and train/replica.hpp: every Strategy
// method against its Lightning meaning, on one device and on 1, 2 and 4 replicas, with
// references computed here from each replica's known inputs; failures in every position.
// Also run under TSan.
#include "../dist/dist_testing.hpp"

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <lazytensor/data.hpp>
#include <lazytensor/io.hpp>
#include <lazytensor/nn.hpp>
#include <lazytensor/optim.hpp>
#include <lazytensor/train.hpp>

namespace {

using dist_testing::Watchdog;
using lazy::Shape;
using lazy::Tensor;
namespace train = lazy::train;

// Replica r's value at element i: small, distinct per replica and element.
float input_value(int r, int i) { return static_cast<float>((r * 5 + i * 3) % 7 - 3) + 0.5f * static_cast<float>(r); }

Tensor<float> rank_tensor(int r, int n = 6) {
  std::vector<float> v;
  for (int i = 0; i < n; ++i) v.push_back(input_value(r, i));
  return lazy::from_vector<float>(v, Shape{2, n / 2});
}

class ReplicaCounts : public ::testing::TestWithParam<int> {};
INSTANTIATE_TEST_SUITE_P(Strategy, ReplicaCounts, ::testing::Values(1, 2, 4));

TEST_P(ReplicaCounts, ReduceMatchesAScalarReference) {
  Watchdog dog;
  const int n = GetParam();
  train::ReplicaStrategy strategy(n);
  const auto results = strategy.launch([](train::Strategy& s) {
    const Tensor<float> x = rank_tensor(s.global_rank());
    std::vector<std::vector<float>> out;
    for (const char* op : {"mean", "avg", "sum", "max", "min", "product", "SUM"})
      out.push_back(s.reduce(x, op).to_vector());
    return out;
  });
  const char* names[] = {"mean", "avg", "sum", "max", "min", "product", "SUM"};
  for (int k = 0; k < 7; ++k) {
    for (int i = 0; i < 6; ++i) {
      double sum = 0, prod = 1, mx = -1e30, mn = 1e30;
      for (int r = 0; r < n; ++r) {
        const double v = input_value(r, i);
        sum += v, prod *= v, mx = std::max(mx, v), mn = std::min(mn, v);
      }
      const double want[] = {sum / n, sum / n, sum, mx, mn, prod, sum};
      EXPECT_NEAR(results[static_cast<std::size_t>(k)][static_cast<std::size_t>(i)], want[k], 1e-5)
          << names[k] << " element " << i;
    }
  }
}

TEST(Strategy, ReduceRejectsUnknownOpsAndIntegerMeans) {
  train::SingleDeviceStrategy s;
  const Tensor<float> x = lazy::ones<float>(Shape{2});
  EXPECT_THROW(s.reduce(x, "median"), lazy::Error);
  try {
    s.reduce(x, "median");
  } catch (const lazy::Error& e) {
    EXPECT_NE(std::string(e.what()).find("\"median\""), std::string::npos) << e.what();
  }
  EXPECT_THROW(s.reduce(lazy::ones<std::int32_t>(Shape{2}), "mean"), lazy::DTypeError);
  EXPECT_EQ(s.reduce(lazy::ones<std::int32_t>(Shape{2}), "sum").to_vector(), (std::vector<std::int32_t>{1, 1}));
}

TEST_P(ReplicaCounts, AllGatherStacksAlongANewFirstDimension) {
  Watchdog dog;
  const int n = GetParam();
  train::ReplicaStrategy strategy(n);
  const auto got = strategy.launch([](train::Strategy& s) {
    const Tensor<float> g = s.all_gather(rank_tensor(s.global_rank()));
    const Tensor<std::int64_t> scalar = s.all_gather(lazy::full<std::int64_t>(Shape{}, s.global_rank() * 10));
    return std::make_pair(std::make_pair(g.shape(), g.to_vector()), std::make_pair(scalar.shape(), scalar.to_vector()));
  });
  EXPECT_EQ(got.first.first, (Shape{n, 2, 3}));
  for (int r = 0; r < n; ++r)
    for (int i = 0; i < 6; ++i) EXPECT_EQ(got.first.second[static_cast<std::size_t>(r * 6 + i)], input_value(r, i));
  EXPECT_EQ(got.second.first, (Shape{n}));
  for (int r = 0; r < n; ++r) EXPECT_EQ(got.second.second[static_cast<std::size_t>(r)], r * 10);
}

TEST_P(ReplicaCounts, AllGatherWithSyncGradsSumsEveryReplicasGradient) {
  Watchdog dog;
  const int n = GetParam();
  train::ReplicaStrategy strategy(n);
  // Replica r's loss is sum_q sum_i w(r, q, i) * x_q[i], so d(total loss)/dx_q[i] = sum_r w(r, q, i).
  auto w = [](int r, int q, int i) { return static_cast<float>((r + 1) * (q + 2) + i); };
  const auto grads = strategy.launch([&](train::Strategy& s) {
    const int r = s.global_rank(), world = s.world_size();
    Tensor<float> x = rank_tensor(r);
    x.requires_grad_(true);
    const Tensor<float> all = s.all_gather(x, /*sync_grads=*/true);
    std::vector<float> wv;
    for (int q = 0; q < world; ++q)
      for (int i = 0; i < 6; ++i) wv.push_back(w(r, q, i));
    lazy::sum(all * lazy::from_vector<float>(wv, Shape{world, 2, 3})).backward();
    const Tensor<float> detached = s.all_gather(x);  // without sync_grads: no history
    EXPECT_FALSE(detached.requires_grad());
    return s.all_gather(x.grad()).to_vector();  // every replica's gradient, for the reference
  });
  for (int q = 0; q < n; ++q) {
    for (int i = 0; i < 6; ++i) {
      float want = 0;
      for (int r = 0; r < n; ++r) want += w(r, q, i);
      EXPECT_EQ(grads[static_cast<std::size_t>(q * 6 + i)], want) << "replica " << q << " element " << i;
    }
  }
}

struct Settings {
  int epochs;
  double lr;
  char tag[8];
};

TEST_P(ReplicaCounts, BroadcastCarriesStringsVectorsAndStructs) {
  Watchdog dog;
  const int n = GetParam();
  train::ReplicaStrategy strategy(n);
  std::atomic<int> agreeing{0};
  strategy.launch([&](train::Strategy& s) {
    const int r = s.global_rank(), src = s.world_size() - 1;
    const std::string text = s.broadcast("from " + std::to_string(r), src);
    const std::vector<int> v = s.broadcast(std::vector<int>(static_cast<std::size_t>(r + 1), r), src);
    const Settings st = s.broadcast(Settings{r, 0.5 * r, {'r', static_cast<char>('0' + r), 0}}, src);
    if (text == "from " + std::to_string(src) && v == std::vector<int>(static_cast<std::size_t>(src + 1), src) &&
        st.epochs == src && st.lr == 0.5 * src && st.tag[1] == '0' + src)
      ++agreeing;
    EXPECT_THROW(s.broadcast(1, s.world_size()), lazy::Error);
  });
  EXPECT_EQ(agreeing.load(), n);
}

TEST_P(ReplicaCounts, ReduceBooleanDecisionWithReplicasThatDisagree) {
  Watchdog dog;
  const int n = GetParam();
  train::ReplicaStrategy strategy(n);
  const auto d = strategy.launch([](train::Strategy& s) {
    const bool mine = s.global_rank() == 0;  // only rank 0 says yes
    return std::vector<bool>{s.reduce_boolean_decision(mine, true), s.reduce_boolean_decision(mine, false),
                             s.reduce_boolean_decision(true, true), s.reduce_boolean_decision(false, false)};
  });
  EXPECT_EQ(d[0], n == 1);
  EXPECT_TRUE(d[1]);
  EXPECT_TRUE(d[2]);
  EXPECT_FALSE(d[3]);
}

TEST(Strategy, BarrierNamesThatDifferRaise) {
  Watchdog dog;
  train::ReplicaStrategy strategy(2);
  strategy.launch([](train::Strategy& s) { s.barrier("same"); });
  try {
    strategy.launch([](train::Strategy& s) { s.barrier(s.global_rank() == 1 ? "epoch end" : "validation"); });
    ADD_FAILURE() << "expected CollectiveMismatch";
  } catch (const lazy::CollectiveMismatch& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("epoch end"), std::string::npos) << what;
    EXPECT_NE(what.find("validation"), std::string::npos) << what;
  }
}

// A strategy that counts on_exception calls.
class CountingStrategy : public train::ReplicaStrategy {
 public:
  using BasicReplicaStrategy::BasicReplicaStrategy;  // the base's constructor (ReplicaStrategy is an alias)
  void on_exception(const std::exception& e) override {
    ++calls;
    // The failing replica sees its own error; the others see the abort, which names it.
    if (dynamic_cast<const lazy::ReplicaAborted*>(&e) == nullptr) ++own;
    if (std::string(e.what()).find("boom") != std::string::npos) ++naming_the_cause;
  }
  std::atomic<int> calls{0}, own{0}, naming_the_cause{0};
};

TEST_P(ReplicaCounts, AFailingReplicaInEveryPositionEndsTheLaunch) {
  Watchdog dog;
  const int n = GetParam();
  for (int bad = 0; bad < n; ++bad) {
    SCOPED_TRACE("failing replica " + std::to_string(bad));
    CountingStrategy strategy(n);
    const auto start = std::chrono::steady_clock::now();
    try {
      strategy.launch([bad](train::Strategy& s) {
        s.barrier("before");
        if (s.global_rank() == bad) throw std::runtime_error("boom on " + std::to_string(bad));
        // The others go on into collectives the failed replica never reaches.
        for (int k = 0; k < 3; ++k) s.barrier("after");
        return s.reduce(lazy::ones<float>(Shape{3}), "sum").to_vector();
      });
      ADD_FAILURE() << "expected the replica's exception";
    } catch (const std::runtime_error& e) {
      EXPECT_EQ(std::string(e.what()), "boom on " + std::to_string(bad));
    }
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    EXPECT_LT(seconds, 10.0) << "the other replicas must leave their collectives promptly";
    EXPECT_EQ(strategy.own.load(), 1);
    EXPECT_EQ(strategy.calls.load(), n) << "every replica that fails (the others by abort) calls on_exception";
    EXPECT_EQ(strategy.naming_the_cause.load(), n);
  }
}

std::string temp_path(const std::string& name) {
  return (std::filesystem::temp_directory_path() /
          ("lazytensor_strategy_" + std::to_string(::getpid()) + "_" + name))
      .string();
}

TEST_P(ReplicaCounts, SaveCheckpointWritesRankZerosStateOnce) {
  Watchdog dog;
  const int n = GetParam();
  const std::string path = temp_path("ckpt_" + std::to_string(n) + ".safetensors");
  train::ReplicaStrategy strategy(n);
  strategy.launch([&](train::Strategy& s) {
    lazy::StateDict sd;
    sd.insert("w", Tensor<float>(rank_tensor(s.global_rank()) * 2.0f));  // pending: the save computes it
    sd.metadata()["rank"] = std::to_string(s.global_rank());
    s.save_checkpoint(sd, path);
    // Complete on every replica when save_checkpoint returns.
    EXPECT_TRUE(std::filesystem::exists(path));
    const auto back = lazy::io::load(path);
    EXPECT_EQ(back.metadata().at("rank"), "0");
    const auto w = back.at("w").as<float>().to_vector();
    for (int i = 0; i < 6; ++i) EXPECT_EQ(w[static_cast<std::size_t>(i)], 2.0f * input_value(0, i)) << i;
    s.barrier("read");
    s.remove_checkpoint(path);
    s.barrier("removed");
    EXPECT_FALSE(std::filesystem::exists(path));
  });
  train::SingleDeviceStrategy single;
  lazy::StateDict sd;
  sd.insert("w", rank_tensor(3));
  single.save_checkpoint(sd, path);
  const auto got = lazy::io::load(path).at("w").as<float>().to_vector();
  for (int i = 0; i < 6; ++i) EXPECT_EQ(got[static_cast<std::size_t>(i)], input_value(3, i));
  single.remove_checkpoint(path);
  EXPECT_FALSE(std::filesystem::exists(path));
  EXPECT_NO_THROW(single.remove_checkpoint(path)) << "a missing file is not an error";
}

TEST_P(ReplicaCounts, SetupMakesEveryReplicaStartFromRankZero) {
  Watchdog dog;
  const int n = GetParam();
  train::ReplicaStrategy strategy(n);
  const auto rows = strategy.launch([](train::Strategy& s) {
    lazy::manual_seed(100 + static_cast<std::uint64_t>(s.global_rank()));  // different on every replica
    lazy::nn::Linear fc(4, 3);
    const auto before = fc->weight.to_vector();
    s.setup(*fc.ptr());
    EXPECT_EQ(fc->weight.device(), s.root_device());
    const Tensor<float> all = s.all_gather(fc->weight);  // every replica's weight after setup
    return std::make_pair(before, all.to_vector());
  });
  for (int r = 0; r < n; ++r) {
    for (int i = 0; i < 12; ++i)
      EXPECT_EQ(rows.second[static_cast<std::size_t>(r * 12 + i)], rows.first[static_cast<std::size_t>(i)])
          << "replica " << r;
  }
}

TEST_P(ReplicaCounts, OptimizerStepAveragesGradientsOverTheWorld) {
  Watchdog dog;
  const int n = GetParam();
  const float lr = 0.25f;
  train::ReplicaStrategy strategy(n);
  const auto w_after = strategy.launch([&](train::Strategy& s) {
    Tensor<float> w = lazy::full<float>(Shape{6}, 1.0f);
    w.requires_grad_(true);
    lazy::optim::SGD opt({w}, lazy::optim::SGDOptions(lr));
    const Tensor<float> x = lazy::reshape(rank_tensor(s.global_rank()), Shape{6});
    const Tensor<float> loss = s.optimizer_step(opt, [&] {
      Tensor<float> l = lazy::sum(w * x);  // d loss / dw = x of this replica
      s.backward(l, &opt);
      return l;
    });
    EXPECT_TRUE(loss.defined());
    lazy::mark_step();
    return w.to_vector();
  });
  for (int i = 0; i < 6; ++i) {
    double mean = 0;
    for (int r = 0; r < n; ++r) mean += input_value(r, i);
    mean /= n;
    EXPECT_NEAR(w_after[static_cast<std::size_t>(i)], 1.0 - lr * mean, 1e-6) << i;
  }
}

TEST_P(ReplicaCounts, BatchToDeviceMovesEveryTensorOfTheBatch) {
  Watchdog dog;
  train::ReplicaStrategy strategy(GetParam());
  strategy.launch([](train::Strategy& s) {
    const lazy::Device here = s.root_device();
    const auto batch = std::make_pair(lazy::ones<float>(Shape{2}, lazy::Device(0)),
                                      lazy::zeros<std::int64_t>(Shape{2}, lazy::Device(0)));
    const auto moved = s.batch_to_device(batch);
    EXPECT_EQ(moved.first.device(), here);
    EXPECT_EQ(moved.second.device(), here);
    const std::vector<Tensor<float>> list{lazy::ones<float>(Shape{1}, lazy::Device(0))};
    EXPECT_EQ(s.batch_to_device(list)[0].device(), here);
    EXPECT_EQ(s.batch_to_device(7), 7);
  });
}

TEST_P(ReplicaCounts, ProcessDataloaderDeliversTheReplicasShardOnItsDevice) {
  Watchdog dog;
  const int n = GetParam();
  const std::size_t samples = 22, batch = 3;
  std::vector<float> x;
  for (std::size_t i = 0; i < samples; ++i) x.push_back(static_cast<float>(i));
  const lazy::data::TensorDataset<> ds(lazy::from_vector<float>(x, Shape{static_cast<std::int64_t>(samples), 1}),
                                       lazy::from_vector<std::int64_t>(std::vector<std::int64_t>(samples, 0),
                                                                       Shape{static_cast<std::int64_t>(samples)}));
  train::ReplicaStrategy strategy(n);
  const auto seen = strategy.launch([&](train::Strategy& s) {
    const auto r = static_cast<std::size_t>(s.global_rank());
    auto loader = lazy::data::make_data_loader(
        ds, lazy::data::DistributedSampler(static_cast<std::size_t>(s.world_size()), r, false), {.batch_size = batch});
    auto device_loader = s.process_dataloader(*loader);
    std::vector<float> mine;
    for (auto& b : device_loader) {
      EXPECT_EQ(b.data.device(), s.root_device());
      for (const float v : b.data.to_vector()) mine.push_back(v);
    }
    // Every replica's samples, rank by rank.
    std::vector<std::vector<float>> all = lazy::dist::mesh_reduce(
        "seen", mine, [](const std::vector<std::vector<float>>& v) { return v; });
    return all;
  });
  for (int r = 0; r < n; ++r) {
    lazy::data::DistributedSampler ref(static_cast<std::size_t>(n), static_cast<std::size_t>(r), false);
    std::vector<float> want;
    for (const auto i : ref.indices(samples)) want.push_back(static_cast<float>(i));
    EXPECT_EQ(seen[static_cast<std::size_t>(r)], want) << "replica " << r;
  }
}

/// A training split: the even samples, in reverse (a user's own sampler).
class EvenSamples final : public lazy::data::Sampler {
 public:
  std::vector<std::size_t> indices(std::size_t n) const override {
    std::vector<std::size_t> v;
    for (std::size_t i = (n - 1) / 2 * 2 + 2; i >= 2; i -= 2) v.push_back(i - 2);
    return v;
  }
  std::size_t size(std::size_t n) const override { return (n + 1) / 2; }
};

TEST_P(ReplicaCounts, TheTrainersShardsKeepTheLoadersSampler) {
  Watchdog dog;
  const int n = GetParam();
  const std::size_t samples = 21;
  std::vector<float> x;
  for (std::size_t i = 0; i < samples; ++i) x.push_back(static_cast<float>(i));
  const lazy::data::TensorDataset<> ds(
      lazy::from_vector<float>(x, Shape{static_cast<std::int64_t>(samples), 1}),
      lazy::from_vector<std::int64_t>(std::vector<std::int64_t>(samples, 0),
                                      Shape{static_cast<std::int64_t>(samples)}));
  // What each replica's share of `loader` holds (the Trainer's fit and evaluation loaders).
  auto shares = [&](auto& loader, bool training) {
    train::ReplicaStrategy strategy(n);
    return strategy.launch([&](train::Strategy& s) {
      train::detail::ReplicaLoader<std::remove_reference_t<decltype(loader)>> local(loader, s, true,
                                                                                    training);
      std::vector<float> mine;
      for (auto& b : local.get())
        for (const float v : b.data.to_vector()) mine.push_back(v);
      return lazy::dist::mesh_reduce("shares", mine,
                                     [](const std::vector<std::vector<float>>& v) { return v; });
    });
  };
  const auto nn = static_cast<std::size_t>(n);
  {  // A subset sampler: its samples only (before, the whole dataset), in its order.
    auto loader = lazy::data::make_data_loader(ds, EvenSamples(), {.batch_size = 2});
    const std::vector<std::size_t> order = EvenSamples().indices(samples);  // 11 samples
    for (bool training : {true, false}) {
      const auto seen = shares(*loader, training);
      for (std::size_t r = 0; r < nn; ++r) {
        std::vector<float> want;
        // Training pads to equal shares by repeating from the start; evaluation does not.
        const std::size_t total = training ? (order.size() + nn - 1) / nn * nn : order.size();
        for (std::size_t i = r; i < total; i += nn)
          want.push_back(static_cast<float>(order[i % order.size()]));
        EXPECT_EQ(seen[r], want) << "replica " << r << (training ? " training" : " evaluation");
      }
    }
  }
  {  // A RandomSampler's seed carries over (the loader's seed, 0, was taken before).
    auto loader =
        lazy::data::make_data_loader(ds, lazy::data::RandomSampler(42), {.batch_size = 2});
    const auto seen = shares(*loader, true);
    for (std::size_t r = 0; r < nn; ++r) {
      std::vector<float> want;
      for (const auto i : lazy::data::DistributedSampler(nn, r, true, 42).indices(samples))
        want.push_back(static_cast<float>(i));
      EXPECT_EQ(seen[r], want) << "replica " << r;
    }
  }
  {  // A DistributedSampler's shuffle, seed and drop_last carry over (its rank cannot).
    auto loader = lazy::data::make_data_loader(
        ds, lazy::data::DistributedSampler(1, 0, true, 7, true), {.batch_size = 2});
    const auto seen = shares(*loader, true);
    for (std::size_t r = 0; r < nn; ++r) {
      std::vector<float> want;
      for (const auto i : lazy::data::DistributedSampler(nn, r, true, 7, true).indices(samples))
        want.push_back(static_cast<float>(i));
      EXPECT_EQ(seen[r], want) << "replica " << r;
    }
  }
}

TEST(Strategy, SingleDeviceIsAWorldOfOne) {
  const int devices = lazy::device_count();
  const lazy::Device target(devices > 1 ? 1 : 0);
  train::SingleDeviceStrategy s(target);
  EXPECT_EQ(s.root_device(), target);
  EXPECT_FALSE(s.is_distributed());
  const lazy::Device before = lazy::device();
  const int result = s.launch([&](train::Strategy& st) {
    EXPECT_EQ(lazy::device(), target) << "launch runs with the strategy's device current";
    EXPECT_EQ(st.world_size(), 1);
    EXPECT_TRUE(st.is_global_zero());
    const Tensor<float> x = rank_tensor(0);
    EXPECT_EQ(st.reduce(x, "sum").to_vector(), x.to_vector());
    EXPECT_EQ(st.all_gather(x).shape(), x.shape()) << "as Lightning's: no new dimension";
    EXPECT_EQ(st.broadcast(std::string("x")), "x");
    EXPECT_TRUE(st.reduce_boolean_decision(true));
    EXPECT_FALSE(st.reduce_boolean_decision(false, false));
    st.barrier("anything");
    return 42;
  });
  EXPECT_EQ(result, 42);
  EXPECT_EQ(lazy::device(), before) << "the thread's device is restored";
  EXPECT_THROW(s.launch([](train::Strategy&) -> int { throw std::runtime_error("x"); }), std::runtime_error);
  EXPECT_EQ(lazy::device(), before);
}

TEST(Strategy, ReplicaCountMustBePositive) {
  EXPECT_THROW(train::ReplicaStrategy(0), lazy::Error);
  EXPECT_THROW(train::ReplicaStrategy(-2), lazy::Error);
}

}  // namespace
