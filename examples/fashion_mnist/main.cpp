// Trains a classifier on Fashion-MNIST the way one would with PyTorch Lightning on
// PyTorch/XLA: a LightningModule (a model from lazy::nn, cross entropy, SGD with Nesterov
// momentum, cosine decay) run by lazy::train's Trainer on one device, on data-parallel
// replicas or on an SPMD device mesh. Every training step (forward, backward, gradient
// all-reduce, update) is captured lazily and runs as fused kernels at the mark_step the
// Trainer's device loader issues for each batch.
//
//   fashion_mnist [--model mlp|cnn] [--epochs N] [--strategy single|replica|spmd]
//                 [--devices N] [--batch-size N] [--lr X] [--weight-decay X]
//                 [--precision 32|bf16-mixed] [--seed N] [--data DIR] [--save PATH]
//                 [--ckpt-dir DIR [--resume]] [--log-dir DIR]
//
//   --model       mlp: 784-256-128-10 perceptron (default); cnn: two 3x3 conv + max-pool
//                 blocks (32 and 64 channels) and two linear layers.
//   --epochs      epochs to train in all (default 5; a resumed run counts the ones done).
//   --strategy    replica (default): one thread and device per replica, each seeing 1/N of
//                 every epoch, gradients averaged at every step (Lightning's XLA/DDP
//                 strategy); spmd: one program thread over a mesh of N devices, each batch
//                 split along its first dimension (PyTorch/XLA's SPMD data parallelism);
//                 single: one device.
//   --devices     N replicas or mesh devices (default: the number of hardware threads; 1 with
//                 --strategy single). --replicas is an alias. Under `mpirun -np P` (when
//                 built where MPI is installed), N replicas (spmd: mesh devices) per
//                 process: P x N in all.
//   --batch-size  samples per step *per device* (default 64): a step trains on N times as
//                 many samples in all.
//   --lr          peak learning rate (default: 0.05 for the MLP, 0.03 for the CNN, times
//                 sqrt(N), N the replicas of every process, as the global batch is N times
//                 larger); cosine decay to 0 over the
//                 run, stepped every batch.
//   --precision   32 (float, default) or bf16-mixed: float weights, with the products of the
//                 forward pass (linear, conv) in bfloat16 under autocast.
//   --data        directory of the IDX files (default /usr/share/datasets/fashion-mnist, where
//                 Debian's dataset-fashion-mnist package installs them).
//   --save PATH   writes the trained model's state_dict as a safetensors file.
//   --ckpt-dir    saves a Trainer checkpoint there after every epoch (epoch=E-step=S and
//                 last.safetensors: model, optimizer, scheduler, progress, random state).
//   --resume      continues from DIR/last.safetensors (needs --ckpt-dir): finished epochs are
//                 not repeated. Pass the same --epochs as the interrupted run, as the cosine
//                 schedule spans all of them.
//   --log-dir     writes metrics.csv and hparams.yaml under DIR/lightning_logs/version_K
//                 (a CSVLogger; default: no logger, nothing written).
//
// Progress goes to stderr (the Trainer's ProgressBar, which counts epochs from 0 as
// Lightning's does); stdout gets the model, a settings line, one `epoch N: ...` line per
// finished epoch (N from 1, as this example always has) and, last, `test_accuracy=0.XXXX`.
// Only global rank zero prints.
//
// Why the pieces sit where they do: the Trainer owns the loop that examples used to spell
// out (spawn, DistributedSampler, MpDeviceLoader, optimizer_step, mesh_reduce of the
// figures), so this file only says what the model is, what a step computes and what gets
// reported. With replicas, rank zero runs `module` and every other replica a
// default-constructed FashionClassifier (its weights then replaced by rank zero's), so the
// module reads its settings from a process-wide Args rather than from constructor
// arguments.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include <lazytensor/data.hpp>
#include <lazytensor/io.hpp>
#include <lazytensor/lazytensor.hpp>
#include <lazytensor/nn.hpp>
#include <lazytensor/optim.hpp>
#include <lazytensor/train.hpp>

namespace nn = lazy::nn;
namespace train = lazy::train;
using lazy::Tensor;

namespace {

struct Args {
  std::string model = "mlp";
  int epochs = 5;
  std::string strategy = "replica";
  int devices = 0;  // parse(): hardware threads, or 1 with --strategy single
  std::size_t batch_size = 64;
  double lr = -1;  // parse(): per-model default, scaled by sqrt(devices)
  double weight_decay = 5e-4;
  std::string precision = "32-true";
  std::uint64_t seed = 1;
  std::string data = "/usr/share/datasets/fashion-mnist";
  std::string save;
  std::string ckpt_dir;
  bool resume = false;
  std::string log_dir;

  // Derived in main, read by the module.
  std::size_t loader_batch = 0;      // what one loader batch holds (spmd: every device's share)
};

/// The run's settings. Written once by main before the Trainer starts any replica, then only
/// read (so the replicas' threads may read it without locks).
Args& settings() {
  static Args args;
  return args;
}

constexpr const char* kUsage =
    "usage: %s [--model mlp|cnn] [--epochs N] [--strategy single|replica|spmd] [--devices N]\n"
    "          [--batch-size N] [--lr X] [--weight-decay X] [--precision 32|bf16-mixed] [--seed N]\n"
    "          [--data DIR] [--save PATH] [--ckpt-dir DIR [--resume]] [--log-dir DIR]\n";

constexpr const char* kHelp =
    "Trains an MLP or a CNN on Fashion-MNIST with lazy::train's Trainer.\n"
    "\n"
    "  --model mlp|cnn        784-256-128-10 perceptron (default) or a two-block CNN\n"
    "  --epochs N             epochs in all, a resumed run included (default 5)\n"
    "  --strategy S           replica (default): data-parallel thread replicas, one device each;\n"
    "                         spmd: one thread over a mesh of N devices, batches split over it;\n"
    "                         single: one device\n"
    "  --devices N            replicas or mesh devices (default: hardware threads; 1 with single)\n"
    "  --replicas N           alias of --devices\n"
    "  --batch-size N         samples per step per device (default 64)\n"
    "  --lr X                 peak learning rate (default 0.05 MLP / 0.03 CNN, times sqrt(N));\n"
    "                         cosine decay to 0 over the run, stepped every batch\n"
    "  --weight-decay X       SGD weight decay (default 5e-4)\n"
    "  --precision P          32 (default) or bf16-mixed\n"
    "  --seed N               initial weights and shuffle (default 1)\n"
    "  --data DIR             Fashion-MNIST IDX files (default /usr/share/datasets/fashion-mnist)\n"
    "  --save PATH            write the trained model's state_dict (safetensors)\n"
    "  --ckpt-dir DIR         save a checkpoint there every epoch, and DIR/last.safetensors\n"
    "  --resume               continue from DIR/last.safetensors (needs --ckpt-dir)\n"
    "  --log-dir DIR          CSV metrics and hparams under DIR/lightning_logs (default: none)\n"
    "  -h, --help             this text\n"
    "\n"
    "stdout: the model, a settings line, `epoch N: ...` per epoch, then test_accuracy=0.XXXX.\n"
    "stderr: progress.\n";

[[noreturn]] void usage(const char* prog, const std::string& error) {
  if (error.empty()) {
    std::printf(kUsage, prog);
    std::printf("\n%s", kHelp);
    std::exit(0);
  }
  std::fprintf(stderr, "error: %s\n", error.c_str());
  std::fprintf(stderr, kUsage, prog);
  std::exit(2);
}

/// All of `v` as a T (std::stoi and friends accept "3x" as 3 and "-1" as a huge unsigned).
template <class T>
T number(const std::string& v) {
  std::size_t used = 0;
  long double x = 0;
  if constexpr (std::is_floating_point_v<T>) {
    x = std::stold(v, &used);
  } else {
    x = static_cast<long double>(std::stoll(v, &used));
    if (x < static_cast<long double>(std::numeric_limits<T>::min()) ||
        x > static_cast<long double>(std::numeric_limits<T>::max()))
      throw std::out_of_range(v);
  }
  if (used != v.size()) throw std::invalid_argument(v);
  return static_cast<T>(x);
}

// Plain C++ only: main may still have to set LAZYTENSOR_NUM_DEVICES after this, before the
// library first reads it.
Args parse(int argc, char** argv) {
  Args a;
  std::optional<int> devices;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    if (k == "-h" || k == "--help") usage(argv[0], "");
    if (k == "--resume") {
      a.resume = true;
      continue;
    }
    if (i + 1 >= argc) usage(argv[0], "missing value for " + k);
    const std::string v = argv[++i];
    try {
      // clang-format off
      if (k == "--model") a.model = v;
      else if (k == "--epochs") a.epochs = number<int>(v);
      else if (k == "--strategy") a.strategy = v;
      else if (k == "--devices" || k == "--replicas") devices = number<int>(v);
      else if (k == "--batch-size") a.batch_size = number<std::size_t>(v);
      else if (k == "--lr") a.lr = number<double>(v);
      else if (k == "--weight-decay") a.weight_decay = number<double>(v);
      else if (k == "--precision") a.precision = v;
      else if (k == "--seed") a.seed = number<std::uint64_t>(v);
      else if (k == "--data") a.data = v;
      else if (k == "--save") a.save = v;
      else if (k == "--ckpt-dir") a.ckpt_dir = v;
      else if (k == "--log-dir") a.log_dir = v;
      else usage(argv[0], "unknown option " + k);
      // clang-format on
    } catch (const std::logic_error&) {
      usage(argv[0], "bad value '" + v + "' for " + k);
    }
  }
  if (a.model != "mlp" && a.model != "cnn") usage(argv[0], "--model must be mlp or cnn, got " + a.model);
  if (a.precision == "32" || a.precision == "bf16") a.precision = a.precision == "32" ? "32-true" : "bf16-mixed";
  if (a.precision != "32-true" && a.precision != "bf16-mixed")
    usage(argv[0], "--precision must be 32 or bf16-mixed, got " + a.precision);
  if (a.strategy != "single" && a.strategy != "replica" && a.strategy != "spmd")
    usage(argv[0], "--strategy must be single, replica or spmd, got " + a.strategy);
  if (a.epochs < 1 || a.batch_size < 1) usage(argv[0], "--epochs and --batch-size must be positive");
  if (a.resume && a.ckpt_dir.empty())
    usage(argv[0], "--resume continues from the last checkpoint in --ckpt-dir DIR: give --ckpt-dir");
  if (a.strategy == "single") {
    if (devices.value_or(1) != 1)
      usage(argv[0], "--strategy single runs on one device, got --devices " + std::to_string(*devices));
    a.devices = 1;
  } else {
    a.devices = devices.value_or(static_cast<int>(std::max(1u, std::thread::hardware_concurrency())));
  }
  if (a.devices < 1) usage(argv[0], "--devices must be positive");
  // With N devices a step sees N times the batch and an epoch has 1/N as many steps: a larger
  // rate keeps the progress per epoch. Square-root scaling: with 2 replicas the MLP ended 5
  // epochs at 0.891 (lr 0.071) against 0.887 with linear scaling (0.1) and 0.888 unscaled
  // (0.05).
  // Under mpirun every process spawns its N replicas (or gives the mesh its N devices): P x N
  // in all.
  const int processes = lazy::runtime::process_count();
  if (processes > 1 && a.strategy == "single")
    usage(argv[0], "--strategy single runs in one process; use --strategy replica or spmd under mpirun");
  if (a.lr < 0)
    a.lr = (a.model == "mlp" ? 0.05 : 0.03) * std::sqrt(static_cast<double>(a.devices * processes));
  return a;
}

/// 784-256-128-10 perceptron.
nn::Sequential mlp() {
  return nn::Sequential(nn::Flatten(), nn::Linear(784, 256), nn::ReLU(), nn::Linear(256, 128), nn::ReLU(),
                        nn::Linear(128, 10));
}

/// Two conv (3x3, padding 1) + ReLU + 2x2 max-pool blocks, 28x28x1 -> 14x14x32 -> 7x7x64,
/// then 3136-128-10.
nn::Sequential cnn() {
  return nn::Sequential(nn::Conv2d(nn::Conv2dOptions(1, 32, 3).padding(1)), nn::ReLU(), nn::MaxPool2d(2),
                        nn::Conv2d(nn::Conv2dOptions(32, 64, 3).padding(1)), nn::ReLU(), nn::MaxPool2d(2),
                        nn::Flatten(), nn::Linear(64 * 7 * 7, 128), nn::ReLU(), nn::Linear(128, 10));
}

/// What the MNIST loader yields: images [B, 1, 28, 28] and labels [B].
using Batch = lazy::data::Example<Tensor<float>, Tensor<std::int64_t>>;

/// The classifier and how it trains. Default-constructible, configured by settings(): the
/// Trainer builds one per extra replica.
class FashionClassifier final : public train::LightningModule<Batch> {
 public:
  FashionClassifier() : LightningModule("FashionClassifier") {
    net = register_module("net", settings().model == "mlp" ? mlp() : cnn());
  }

  /// The network alone (what --save writes, without the "net." prefix of this wrapper).
  const nn::Sequential& network() const { return net; }

  lazy::AnyTensor training_step(const Batch& batch, std::int64_t) override {
    Tensor<float> loss = nn::functional::cross_entropy(net(batch.data), batch.target);
    // on_epoch: the epoch line reports the epoch's mean loss, accumulated on the device (no
    // read per step); sync_dist: over every replica's batches, not rank zero's alone.
    log("train_loss", loss, {.prog_bar = true, .on_epoch = true, .sync_dist = true});
    return loss;
  }

  // The test set doubles as the validation set: the epoch line reports test accuracy, as
  // this example always has.
  void validation_step(const Batch& batch, std::int64_t) override { evaluate(batch, "val"); }
  void test_step(const Batch& batch, std::int64_t) override { evaluate(batch, "test"); }

  train::OptimizerConfig configure_optimizers() override {
    const Args& a = settings();
    auto opt = std::make_shared<lazy::optim::SGD>(
        parameters(), lazy::optim::SGDOptions(a.lr).momentum(0.9).nesterov(true).weight_decay(a.weight_decay));
    // Cosine decay over the whole run, stepped per batch: the rate is a kernel scalar, so
    // changing it every step costs nothing. The Trainer knows how many steps lie ahead.
    auto schedule = std::make_shared<lazy::optim::CosineAnnealingLR>(*opt, trainer().estimated_stepping_batches());
    return {.optimizer = opt, .lr_scheduler = schedule, .interval = "step"};
  }

 private:
  void evaluate(const Batch& batch, const std::string& stage) {
    const Tensor<float> logits = net(batch.data);
    const double n = static_cast<double>(batch.target.numel());
    const Tensor<double> accuracy = lazy::mean(lazy::cast<double>(lazy::argmax(logits, 1) == batch.target));
    // Weighted by the batch's size, the epoch mean is correct / seen exactly, even with a
    // short last batch; sync_dist averages the replicas' means, which equals the overall
    // fraction because DistributedSampler gives every replica as many images.
    log(stage + "_loss", nn::functional::cross_entropy(logits, batch.target), {.sync_dist = true, .batch_size = n});
    log(stage + "_acc", accuracy, {.sync_dist = true, .batch_size = n});
    // How many images that was, summed over the replicas (more than the test set's 10000
    // when the replicas do not divide it: DistributedSampler pads their shares with
    // repeats). For the epoch line only, so kept out of the logger.
    log(stage + "_images", n, {.sync_dist = true, .reduce_fx = "sum", .logger = false});
  }

  nn::Sequential net{nullptr};
};

/// Prints the stdout line of each finished epoch. Not cloned, so the Trainer calls it on
/// global rank zero only; it reads values the replicas already combined (sync_dist).
/// on_train_epoch_end rather than on_validation_end: it runs after the training epoch's
/// mean loss is in, and never during the sanity check.
class EpochReport final : public train::Callback {
 public:
  std::string state_key() const override { return "EpochReport"; }

  void on_train_epoch_end(train::Trainer& trainer, train::LightningModuleBase&) override {
    if (!trainer.is_global_zero()) return;
    const auto& m = trainer.callback_metrics();
    auto value = [&](const char* key) {
      const auto it = m.find(key);
      return it == m.end() ? std::nan("") : it->second;
    };
    std::printf("epoch %lld: loss %.4f, test accuracy %.4f (%.0f images)\n",
                static_cast<long long>(trainer.current_epoch() + 1), value("train_loss_epoch"), value("val_acc"),
                value("val_images"));
    std::fflush(stdout);
  }
};

/// The Trainer's "spmd" mesh takes devices 0..N-1 of lazy::device_count(), which reads
/// LAZYTENSOR_NUM_DEVICES once, at the library's first use: raise it before that.
void ensure_device_count(int devices) {
  const char* env = std::getenv("LAZYTENSOR_NUM_DEVICES");
  if (!env || std::atoi(env) < devices) setenv("LAZYTENSOR_NUM_DEVICES", std::to_string(devices).c_str(), 1);
}

std::string text(double x) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", x);
  return buf;
}

}  // namespace

int main(int argc, char** argv) {
  Args& args = settings();
  args = parse(argc, argv);
  if (args.strategy == "spmd") ensure_device_count(args.devices);  // before any lazytensor call

  namespace fs = std::filesystem;
  const bool have =
      fs::exists(args.data + "/train-images-idx3-ubyte.gz") || fs::exists(args.data + "/train-images-idx3-ubyte");
  if (!have) {
    std::cerr << "Fashion-MNIST not found in " << args.data
              << ".\nInstall it with `sudo apt-get install dataset-fashion-mnist` (files land in "
                 "/usr/share/datasets/fashion-mnist), or pass --data DIR.\n";
    return 1;
  }
  const std::string last_ckpt = args.ckpt_dir + "/last.safetensors";
  if (args.resume && !fs::exists(last_ckpt)) {
    std::cerr << "error: --resume: there is no checkpoint at " << last_ckpt
              << " (run with --ckpt-dir " << args.ckpt_dir << " and without --resume first)\n";
    return 1;
  }

  try {
    // Fashion-MNIST's pixel mean and standard deviation. The datasets are read once; the
    // Trainer gives each replica a loader over the same data (copies share it).
    const lazy::data::transforms::Normalize norm(0.2860, 0.3530);
    const auto train_set = lazy::data::MNIST(args.data, lazy::data::MNIST::Mode::Train).map(norm);
    const auto test_set = lazy::data::MNIST(args.data, lazy::data::MNIST::Mode::Test).map(norm);

    // --batch-size is per device. Replicas each load their own batches; under SPMD one
    // loader feeds the whole mesh, so its batch is every device's share together (every
    // process loads the same global batch and keeps its devices' blocks).
    const auto devices = static_cast<std::size_t>(args.devices);
    const auto mesh_devices = devices * static_cast<std::size_t>(lazy::runtime::process_count());
    args.loader_batch = args.strategy == "spmd" ? args.batch_size * mesh_devices : args.batch_size;

    // shuffle + seed: the Trainer turns this into each replica's DistributedSampler(shuffle,
    // seed), and reshuffles every epoch (set_epoch), so a resumed run sees the same order.
    auto train_loader = lazy::data::make_data_loader(
        train_set, {.batch_size = args.loader_batch, .shuffle = true, .seed = args.seed, .num_workers = 1});
    auto test_loader = lazy::data::make_data_loader(test_set, {.batch_size = 1000, .num_workers = 1});

    // Rank zero's initial weights; the other replicas are given them by the strategy.
    lazy::manual_seed(args.seed);
    FashionClassifier module;
    // Saved in every checkpoint (and hparams.yaml with --log-dir): what the run was.
    module.hparams = {{"model", args.model},
                      {"strategy", args.strategy},
                      {"devices", std::to_string(args.devices)},
                      {"batch_size", std::to_string(args.batch_size)},
                      {"lr", text(args.lr)},
                      {"weight_decay", text(args.weight_decay)},
                      {"precision", args.precision},
                      {"seed", std::to_string(args.seed)},
                      {"epochs", std::to_string(args.epochs)}};

    const int processes = lazy::runtime::process_count();
    if (lazy::runtime::process_index() == 0) {
      std::cout << module.network()->str() << "\n";
      const std::string where = processes == 1 ? "" : " x " + std::to_string(processes) + " processes";
      std::printf("strategy %s, %d device%s%s, %zu samples per step (%zu per device), lr %g, precision %s\n",
                  args.strategy.c_str(), args.devices, args.devices == 1 ? "" : "s", where.c_str(),
                  args.batch_size * devices * static_cast<std::size_t>(processes), args.batch_size, args.lr,
                  args.precision.c_str());
      std::fflush(stdout);
    }

    train::TrainerOptions options;
    options.strategy = args.strategy;
    options.devices = args.devices;
    options.precision = args.precision;
    options.max_epochs = args.epochs;
    // The epoch line needs no sanity pass over the test set, and it would cost a compile.
    options.num_sanity_val_steps = 0;
    // Nothing written unless asked: no default CSVLogger or ModelCheckpoint in the working
    // directory.
    if (args.log_dir.empty()) {
      options.logger = false;
    } else {
      options.logger = std::shared_ptr<train::Logger>(std::make_shared<train::CSVLogger>(args.log_dir));
    }
    options.enable_checkpointing = !args.ckpt_dir.empty();
    options.callbacks.push_back(std::make_shared<EpochReport>());
    if (!args.ckpt_dir.empty()) {
      // Every epoch, all kept (save_top_k -1: there is no monitored value to rank them by),
      // plus last.safetensors, which --resume continues from.
      options.callbacks.push_back(std::make_shared<train::ModelCheckpoint>(
          train::ModelCheckpointOptions{.dirpath = args.ckpt_dir, .save_last = true, .save_top_k = -1}));
      if (args.resume) std::fprintf(stderr, "resuming from %s\n", last_ckpt.c_str());
    }

    train::Trainer trainer(options);
    trainer.fit(module, *train_loader, *test_loader, args.resume ? "last" : "");
    const auto results = trainer.test(module, *test_loader);

    // Under mpirun with replicas only process 0 holds the trained `module` (global rank
    // zero's); the other processes' replicas trained copies of their own. An SPMD mesh spans
    // the processes, so every process saves (a collective: process 0 writes).
    const bool first = lazy::runtime::process_index() == 0;
    if (!args.save.empty() && (first || args.strategy == "spmd")) {
      lazy::io::save(module.network()->state_dict(), args.save);
      if (first) std::printf("saved the model to %s\n", args.save.c_str());
    }
    if (first) std::printf("test_accuracy=%.4f\n", results.at(0).at("test_acc"));
  } catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
