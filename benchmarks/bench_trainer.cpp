// What the Trainer costs: one epoch of the MLP of mlp_problem.hpp (784-256-128-10, SGD with
// momentum, batches of 256, 16 batches of random data) driven by lazy::train::Trainer against
// the same epoch written by hand, as examples/fashion_mnist did before the Trainer.
//
//   BM_HandLoop/R     R = 1: DataLoader -> MpDeviceLoader, zero_grad, forward, loss,
//                     backward, opt.step() per batch (the loader marks the step).
//                     R = 2: the same per replica in dist::spawn over a DistributedSampler,
//                     with dist::optimizer_step.
//   BM_Trainer/R      Trainer::fit(max_epochs = 1) with strategy "single" (R = 1) or
//                     "replica" (R = 2); the module logs its loss (on_step, prog_bar) as a
//                     user's would; no logger, checkpoints or progress bar.
//
// The target: Trainer / HandLoop >= 0.97 in samples/s for the same R. Run with
// --benchmark_repetitions=5 --benchmark_enable_random_interleaving=true and compare medians.
//
// Self-check (once, untimed): one epoch through each path from the same weights gives the
// same parameters (1e-5), so both time the same work.

#include "mlp_problem.hpp"

#include <cmath>
#include <cstdio>
#include <memory>
#include <vector>

#include <lazytensor/data.hpp>
#include <lazytensor/dist.hpp>
#include <lazytensor/train.hpp>

namespace {

using namespace bench::mlp;
namespace train = lazy::train;

constexpr std::int64_t kBatches = 16;
using Dataset = lazy::data::TensorDataset<float, std::int64_t>;
using Batch = Dataset::example_type;

const Dataset& dataset() {
  static const Dataset ds = [] {
    const std::int64_t n = kBatches * kBatch;
    std::mt19937 gen(5);
    std::uniform_real_distribution<float> u(0.0f, 1.0f);
    std::vector<float> x(static_cast<std::size_t>(n * kWidth[0]));
    for (auto& v : x) v = u(gen);
    std::vector<std::int64_t> y(static_cast<std::size_t>(n));
    for (auto& v : y) v = static_cast<std::int64_t>(gen() % 10);
    return Dataset(lazy::from_vector<float>(x, {n, kWidth[0]}), lazy::from_vector<std::int64_t>(y, {n}));
  }();
  return ds;
}

/// The MLP as a LightningModule (usable as a plain module by the hand loop).
class Mlp : public train::LightningModule<Batch> {
 public:
  Mlp() {
    lazy::manual_seed(11);
    net = register_module("net", lazy::nn::Sequential(lazy::nn::Linear(kWidth[0], kWidth[1]), lazy::nn::ReLU(),
                                                      lazy::nn::Linear(kWidth[1], kWidth[2]), lazy::nn::ReLU(),
                                                      lazy::nn::Linear(kWidth[2], kWidth[3])));
  }
  lazy::Tensor<float> loss_of(const Batch& b) {
    return lazy::nn::functional::cross_entropy(lazy::Tensor<float>(net->forward(b.data)), b.target);
  }
  lazy::AnyTensor training_step(const Batch& b, std::int64_t) override {
    auto loss = loss_of(b);
    log("loss", loss, {.prog_bar = true});
    return loss;
  }
  train::OptimizerConfig configure_optimizers() override {
    return {std::make_shared<lazy::optim::SGD>(parameters(), lazy::optim::SGDOptions(kLr).momentum(kMomentum))};
  }
  lazy::nn::Sequential net{nullptr};
};

/// One hand-written epoch on this thread's device over `loader`.
template <class Loader>
void hand_epoch(Mlp& m, lazy::optim::SGD& opt, Loader& loader, bool replicated) {
  lazy::dist::MpDeviceLoader batches(loader, lazy::device());
  for (auto& b : batches) {
    opt.zero_grad();
    auto loss = m.loss_of(b);
    loss.backward();
    if (replicated) {
      lazy::dist::optimizer_step(opt);
    } else {
      opt.step();
    }
  }
  lazy::wait_device_ops();
}

std::vector<float> hand_run(int replicas) {
  auto body = [&] {
    Mlp m;
    lazy::optim::SGD opt(m.parameters(), lazy::optim::SGDOptions(kLr).momentum(kMomentum));
    if (replicas == 1) {
      auto loader = lazy::data::make_data_loader(dataset(), {.batch_size = static_cast<std::size_t>(kBatch)});
      hand_epoch(m, opt, *loader, false);
    } else {
      auto loader = lazy::data::make_data_loader(
          dataset(),
          lazy::data::DistributedSampler(static_cast<std::size_t>(replicas),
                                         static_cast<std::size_t>(lazy::runtime::global_ordinal()), false),
          {.batch_size = static_cast<std::size_t>(kBatch) / static_cast<std::size_t>(replicas)});
      hand_epoch(m, opt, *loader, true);
    }
    return m.parameters()[0].as<float>().to_vector();
  };
  if (replicas == 1) return body();
  return lazy::dist::spawn([&](int) { return body(); }, replicas);
}

std::vector<float> trainer_run(int replicas) {
  Mlp m;
  // The same global batch as the hand loop: each replica takes its share.
  auto loader = lazy::data::make_data_loader(
      dataset(), {.batch_size = static_cast<std::size_t>(kBatch) / static_cast<std::size_t>(replicas)});
  train::TrainerOptions o;
  o.strategy = std::string(replicas == 1 ? "single" : "replica");
  o.devices = replicas;
  o.max_epochs = 1;
  o.logger = false;
  o.enable_checkpointing = false;
  o.enable_progress_bar = false;
  train::Trainer(o).fit(m, *loader);
  lazy::wait_device_ops();
  return m.parameters()[0].as<float>().to_vector();
}

void self_check(int replicas) {
  static bool checked[3] = {};
  if (checked[replicas]) return;
  checked[replicas] = true;
  const auto a = hand_run(replicas), b = trainer_run(replicas);
  double worst = 0;
  for (std::size_t i = 0; i < a.size(); ++i) worst = std::max(worst, static_cast<double>(std::fabs(a[i] - b[i])));
  if (a.size() != b.size() || worst > 1e-5) {
    std::fprintf(stderr, "bench_trainer: self-check failed for %d replica(s): max difference %g\n", replicas, worst);
    std::exit(1);
  }
}

void report(benchmark::State& state) {
  state.counters["samples/s"] =
      benchmark::Counter(static_cast<double>(kBatches * kBatch), benchmark::Counter::kIsIterationInvariantRate);
}

void BM_HandLoop(benchmark::State& state) {
  const int r = static_cast<int>(state.range(0));
  self_check(r);
  for (auto _ : state) benchmark::DoNotOptimize(hand_run(r));
  report(state);
}

void BM_Trainer(benchmark::State& state) {
  const int r = static_cast<int>(state.range(0));
  self_check(r);
  for (auto _ : state) benchmark::DoNotOptimize(trainer_run(r));
  report(state);
}

BENCHMARK(BM_HandLoop)->Arg(1)->Arg(2)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_Trainer)->Arg(1)->Arg(2)->Unit(benchmark::kMillisecond)->UseRealTime();

}  // namespace

BENCHMARK_MAIN();
