// strategy: one training loop, written once against lazy::train::Strategy, run on one device
// or on data-parallel replicas, in any precision — Lightning's Strategy, Accelerator and
// precision plugins.
//
//   strategy [--devices N] [--precision P]
//     --devices N     N = 1: SingleDeviceStrategy; N > 1: ReplicaStrategy(N) (default 2)
//     --precision P   32-true (default), 64-true, bf16-mixed or bf16-true
//
// Fits a linear model y = x w + b to synthetic data. The loop only talks to the accelerator
// and its strategy: setup (the model in the plugin's dtype, rank 0's initial weights
// everywhere), training_step (the forward in the plugin's context), process_dataloader (each replica's shard,
// on its device), optimizer_step (gradients averaged over replicas), reduce (the epoch's
// mean loss), reduce_boolean_decision (an early stop every replica agrees on) and
// save_checkpoint (rank 0 writes, after everyone synced). Prints one line per epoch and,
// last, `weight_error=...` (the distance to the true weights).

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include <lazytensor/lazytensor.hpp>

namespace nn = lazy::nn;
namespace train = lazy::train;
using lazy::Shape;
using lazy::Tensor;

namespace {

constexpr int kFeatures = 8;
constexpr std::int64_t kSamples = 4096;

float true_weight(int j) { return 0.5f * static_cast<float>(j) - 1.5f; }

// x ~ U(-1, 1), y = x . w_true + 0.25 + small noise (the same on every replica: seeded).
lazy::data::TensorDataset<float, float> make_dataset() {
  lazy::manual_seed(1234);
  const Tensor<float> x = lazy::rand<float>(Shape{kSamples, kFeatures}) * 2.0f - 1.0f;
  std::vector<float> w;
  for (int j = 0; j < kFeatures; ++j) w.push_back(true_weight(j));
  const Tensor<float> noise = lazy::randn<float>(Shape{kSamples, 1}) * 0.01f;
  const Tensor<float> y = lazy::matmul(x, lazy::from_vector<float>(w, Shape{kFeatures, 1})) + 0.25f + noise;
  return lazy::data::TensorDataset<float, float>(x, y);
}

// The training loop: the same code for every strategy; T is the precision plugin's
// parameter dtype (float for 32-true and bf16-mixed).
template <class T>
double fit(train::Accelerator& acc, const lazy::data::TensorDataset<float, float>& dataset) {
  train::Strategy& s = acc.strategy();
  const train::Precision& precision = acc.precision_plugin();
  lazy::manual_seed(7 + static_cast<std::uint64_t>(s.global_rank()));  // replicas start apart...
  nn::Linear model(kFeatures, 1);
  acc.setup(*model.ptr());  // ...until setup gives every replica rank 0's weights (in T)
  lazy::optim::SGD optimizer(model->parameters(), lazy::optim::SGDOptions(0.1).momentum(0.9));
  auto loader = lazy::data::make_data_loader(
      dataset,
      lazy::data::DistributedSampler(static_cast<std::size_t>(s.world_size()),
                                     static_cast<std::size_t>(s.global_rank()), /*shuffle=*/true, 3),
      {.batch_size = 64});
  auto device_loader = s.process_dataloader(*loader);
  for (std::size_t epoch = 0; epoch < 20; ++epoch) {
    loader->set_epoch(epoch);
    Tensor<float> total = lazy::zeros<float>(Shape{});
    double batches = 0;
    for (auto& batch : device_loader) {
      acc.optimizer_zero_grad(optimizer);
      const lazy::AnyTensor loss = acc.optimizer_step(optimizer, [&] {
        const Tensor<T> x = precision.convert_input(batch.data), y = precision.convert_input(batch.target);
        const Tensor<T> l = acc.training_step([&] { return nn::functional::mse_loss(model->forward(x), y); });
        acc.backward(l, &optimizer);
        acc.clip_gradients(optimizer, 5.0, "norm");
        return l;
      });
      total = total + precision.convert_output(loss).as<float>().detach();
      batches += 1;
    }
    const float mean_loss = s.reduce(Tensor<float>(total / static_cast<float>(batches)), "mean").item();
    if (s.is_global_zero()) std::printf("epoch %zu: loss=%.6f\n", epoch + 1, mean_loss);
    // Every replica must take the same decision, or some would wait for the others forever.
    if (s.reduce_boolean_decision(mean_loss < 2e-4f)) break;
  }
  lazy::StateDict checkpoint = model->state_dict();
  checkpoint.metadata()["world_size"] = std::to_string(s.world_size());
  const std::string path = (std::filesystem::temp_directory_path() / "lazytensor_strategy_example.safetensors").string();
  s.save_checkpoint(checkpoint, path);  // every replica calls it; rank 0 writes
  const auto w = precision.convert_output(model->weight).as<float>().to_vector();
  double err = 0;
  for (int j = 0; j < kFeatures; ++j) err += std::pow(w[static_cast<std::size_t>(j)] - true_weight(j), 2);
  s.remove_checkpoint(path);
  return std::sqrt(err);
}

}  // namespace

int main(int argc, char** argv) {
  int devices = 2;
  std::string precision = "32-true";
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--devices" && i + 1 < argc) {
      devices = std::atoi(argv[++i]);
    } else if (a == "--precision" && i + 1 < argc) {
      precision = argv[++i];
    } else {
      std::fprintf(stderr, "usage: strategy [--devices N] [--precision 32-true|64-true|bf16-mixed|bf16-true]\n");
      return a == "--help" || a == "-h" ? 0 : 2;
    }
  }
  try {
    const auto dataset = make_dataset();
    std::unique_ptr<train::Strategy> strategy;
    if (devices == 1) strategy = std::make_unique<train::SingleDeviceStrategy>();
    else strategy = std::make_unique<train::ReplicaStrategy>(devices);
    train::CPUAccelerator acc(*strategy, train::make_precision(precision));
    const double err = strategy->launch([&](train::Strategy&) {
      switch (acc.precision_plugin().param_dtype()) {
        case lazy::DType::Float64: return fit<double>(acc, dataset);
        case lazy::DType::BFloat16: return fit<lazy::bfloat16>(acc, dataset);
        default: return fit<float>(acc, dataset);
      }
    });
    std::printf("precision=%s\n", acc.precision_plugin().name().c_str());
    std::printf("weight_error=%.6f\n", err);
    return err < 0.05 ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "strategy: %s\n", e.what());
    return 1;
  }
}
