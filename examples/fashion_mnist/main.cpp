// Trains a classifier on Fashion-MNIST, the way one would with libtorch: a model from
// lazy::nn, SGD with momentum, a DataLoader, cross entropy. Every training step (forward,
// backward, update) is captured lazily and runs as fused kernels at mark_step().
//
//   fashion_mnist [--model mlp|cnn] [--epochs N] [--batch-size N] [--lr X] [--weight-decay X]
//                 [--seed N] [--data DIR] [--save PATH]
//
// The last line printed is `test_accuracy=0.XXXX`.

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <string>
#include <unistd.h>

#include <lazytensor/data.hpp>
#include <lazytensor/io.hpp>
#include <lazytensor/lazytensor.hpp>
#include <lazytensor/nn.hpp>
#include <lazytensor/optim.hpp>

namespace nn = lazy::nn;
using lazy::Tensor;

namespace {

struct Args {
  std::string model = "mlp";
  int epochs = 5;
  std::size_t batch_size = 64;
  double lr = -1;  // per-model default
  double weight_decay = 5e-4;
  std::uint64_t seed = 1;
  std::string data = "/usr/share/datasets/fashion-mnist";
  std::string save;
};

[[noreturn]] void usage(const char* prog, const std::string& error) {
  if (!error.empty()) std::cerr << "error: " << error << "\n";
  std::cerr << "usage: " << prog
            << " [--model mlp|cnn] [--epochs N] [--batch-size N] [--lr X] [--weight-decay X] [--seed N] [--data DIR]"
               " [--save PATH]\n";
  std::exit(2);
}

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    if (k == "-h" || k == "--help") usage(argv[0], "");
    if (i + 1 >= argc) usage(argv[0], "missing value for " + k);
    const std::string v = argv[++i];
    try {
      if (k == "--model") a.model = v;
      else if (k == "--epochs") a.epochs = std::stoi(v);
      else if (k == "--batch-size") a.batch_size = std::stoul(v);
      else if (k == "--lr") a.lr = std::stod(v);
      else if (k == "--weight-decay") a.weight_decay = std::stod(v);
      else if (k == "--seed") a.seed = std::stoull(v);
      else if (k == "--data") a.data = v;
      else if (k == "--save") a.save = v;
      else usage(argv[0], "unknown option " + k);
    } catch (const std::logic_error&) {
      usage(argv[0], "bad value '" + v + "' for " + k);
    }
  }
  if (a.model != "mlp" && a.model != "cnn") usage(argv[0], "--model must be mlp or cnn, got " + a.model);
  if (a.epochs < 1 || a.batch_size < 1) usage(argv[0], "--epochs and --batch-size must be positive");
  if (a.lr < 0) a.lr = a.model == "mlp" ? 0.05 : 0.03;
  return a;
}

/// 784-256-128-10 perceptron.
nn::Sequential mlp() {
  return nn::Sequential(nn::Flatten(), nn::Linear(784, 256), nn::ReLU(), nn::Linear(256, 128), nn::ReLU(),
                        nn::Linear(128, 10));
}

/// Prints a one-line progress bar (redrawn in place on a terminal, every 20% otherwise).
class Progress {
 public:
  Progress(int epoch, std::size_t total) : epoch_(epoch), total_(total), tty_(isatty(fileno(stderr))) {}
  void update(std::size_t done, double loss, double samples_per_s) {
    const int width = 30, filled = static_cast<int>(width * done / std::max<std::size_t>(total_, 1));
    const bool milestone = done == total_ || (done * 5 / total_) != ((done - 1) * 5 / total_);
    if (!tty_ && !milestone) return;
    std::fprintf(stderr, "%sepoch %d [%s%s] %zu/%zu loss %.4f %.0f samples/s%s", tty_ ? "\r" : "", epoch_,
                 std::string(static_cast<std::size_t>(filled), '=').c_str(),
                 std::string(static_cast<std::size_t>(width - filled), ' ').c_str(), done, total_, loss, samples_per_s,
                 tty_ && done < total_ ? "" : "\n");
    std::fflush(stderr);
  }

 private:
  int epoch_;
  std::size_t total_;
  bool tty_;
};

}  // namespace

int main(int argc, char** argv) {
  const Args args = parse(argc, argv);
  namespace fs = std::filesystem;
  const bool have = fs::exists(args.data + "/train-images-idx3-ubyte.gz") || fs::exists(args.data + "/train-images-idx3-ubyte");
  if (!have) {
    std::cerr << "Fashion-MNIST not found in " << args.data
              << ".\nInstall it with `sudo apt-get install dataset-fashion-mnist` (files land in "
                 "/usr/share/datasets/fashion-mnist), or pass --data DIR.\n";
    return 1;
  }
  try {
    lazy::manual_seed(args.seed);
    // Fashion-MNIST's pixel mean and standard deviation.
    const lazy::data::transforms::Normalize norm(0.2860, 0.3530);
    auto train = lazy::data::MNIST(args.data, lazy::data::MNIST::Mode::Train).map(norm);
    auto test = lazy::data::MNIST(args.data, lazy::data::MNIST::Mode::Test).map(norm);
    auto train_loader = lazy::data::make_data_loader(
        train, {.batch_size = args.batch_size, .shuffle = true, .seed = args.seed, .num_workers = 1});
    auto test_loader = lazy::data::make_data_loader(test, {.batch_size = 1000, .num_workers = 1});

    nn::Sequential model = mlp();
    lazy::optim::SGD opt(model->parameters(), lazy::optim::SGDOptions(args.lr).momentum(0.9).nesterov(true).weight_decay(args.weight_decay));
    // Cosine decay over the whole run, stepped per batch: the rate is a kernel scalar, so
    // changing it every step costs nothing.
    lazy::optim::CosineAnnealingLR schedule(opt, static_cast<std::int64_t>(args.epochs * train_loader->size()));
    std::cout << model->str() << "\n";

    double accuracy = 0;
    for (int epoch = 1; epoch <= args.epochs; ++epoch) {
      model->train();
      Progress bar(epoch, train_loader->size());
      const auto t0 = std::chrono::steady_clock::now();
      std::size_t seen = 0, step = 0;
      double loss_sum = 0;
      for (auto& batch : *train_loader) {
        opt.zero_grad();
        Tensor<float> loss = nn::functional::cross_entropy(model(batch.data), batch.target);
        loss.backward();
        opt.step();
        schedule.step();
        lazy::mark_step();
        seen += static_cast<std::size_t>(batch.target.numel());
        ++step;
        if (step % 50 == 0 || step == train_loader->size()) {
          const double l = loss.item();  // computed at this step's mark_step: no extra sync
          loss_sum = l;
          const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
          bar.update(step, l, static_cast<double>(seen) / secs);
        }
      }
      model->eval();
      lazy::NoGradGuard no_grad;
      Tensor<std::int64_t> correct = lazy::zeros<std::int64_t>({});
      std::int64_t total = 0;
      for (auto& batch : *test_loader) {
        correct += lazy::sum(lazy::argmax(model(batch.data), 1) == batch.target);
        total += batch.target.numel();
        lazy::mark_step();
      }
      accuracy = static_cast<double>(correct.item()) / static_cast<double>(total);
      std::printf("epoch %d: loss %.4f, test accuracy %.4f\n", epoch, loss_sum, accuracy);
    }
    if (!args.save.empty()) {
      lazy::io::save_file(model->state_dict(), args.save);
      std::printf("saved the model to %s\n", args.save.c_str());
    }
    std::printf("test_accuracy=%.4f\n", accuracy);
  } catch (const lazy::Error& e) {
    std::cerr << "error: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
