// spmd: trains the Fashion-MNIST MLP (784-256-128-10) the way PyTorch/XLA's SPMD does: one
// program thread, a 2-D mesh ("data", "model") of devices, tensors annotated with
// mark_sharding, and otherwise ordinary single-device code. The partitioner runs each
// statement on every device and inserts the all-reduces.
//
//   spmd [--data D] [--model M] [--epochs N] [--batch-size B] [--lr LR] [--data-dir DIR]
//        [--save PATH]
//     --data D        devices along "data": the batch is split D ways (default: all / M)
//     --model M       devices along "model" (default 1): the first layer's weight is split
//                     by output rows, the second's by input columns (Megatron's pair: one
//                     all-reduce per forward), the last layer is replicated
//     --save PATH     after training, saves the weights as shard files (one per device,
//                     nothing gathered) with PATH their JSON index, then loads them back
//                     whole and checks them against the trained weights
//     D * M devices are used; LAZYTENSOR_NUM_DEVICES (default here: 2) sets how many exist.
//
// Prints the mesh and each weight's sharding (visualize_tensor_sharding), one
// `epoch N: ...` line per epoch, and `test_accuracy=0.XXXX` last.

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <string>

#include <lazytensor/lazytensor.hpp>

namespace nn = lazy::nn;
namespace spmd = lazy::spmd;
using lazy::Tensor;

namespace {

struct Args {
  int data = 0, model = 1, epochs = 1;
  std::size_t batch_size = 128;
  double lr = 0.05;
  std::string dir = "/usr/share/datasets/fashion-mnist";
  std::string save;
};

[[noreturn]] void usage(const char* argv0, const std::string& problem) {
  if (!problem.empty()) std::cerr << argv0 << ": " << problem << "\n";
  std::cerr << "usage: " << argv0
            << " [--data D] [--model M] [--epochs N] [--batch-size B] [--lr LR] [--data-dir DIR] [--save PATH]\n";
  std::exit(problem.empty() ? 0 : 2);
}

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    if (k == "-h" || k == "--help") usage(argv[0], "");
    if (i + 1 >= argc) usage(argv[0], "missing value for " + k);
    const std::string v = argv[++i];
    try {
      if (k == "--data") a.data = std::stoi(v);
      else if (k == "--model") a.model = std::stoi(v);
      else if (k == "--epochs") a.epochs = std::stoi(v);
      else if (k == "--batch-size") a.batch_size = std::stoul(v);
      else if (k == "--lr") a.lr = std::stod(v);
      else if (k == "--data-dir") a.dir = v;
      else if (k == "--save") a.save = v;
      else usage(argv[0], "unknown option " + k);
    } catch (const std::logic_error&) {
      usage(argv[0], "bad value '" + v + "' for " + k);
    }
  }
  return a;
}

}  // namespace

int main(int argc, char** argv) {
  setenv("LAZYTENSOR_NUM_DEVICES", "2", 0);  // before any device exists
  Args args = parse(argc, argv);
  spmd::use_spmd();
  const int devices = lazy::runtime::global_runtime_device_count();
  if (args.model < 1 || devices % args.model != 0)
    usage(argv[0], "--model must divide the " + std::to_string(devices) + " devices");
  if (args.data == 0) args.data = devices / args.model;
  if (args.data < 1 || args.data * args.model > devices || args.epochs < 1 || args.batch_size % args.data != 0)
    usage(argv[0], "need D * M <= " + std::to_string(devices) + " devices, epochs >= 1, and D dividing the batch size");
  std::vector<int> ids;
  for (int i = 0; i < args.data * args.model; ++i) ids.push_back(i);
  const spmd::Mesh mesh(ids, {args.data, args.model}, {"data", "model"});
  std::printf("%s\n", mesh.str().c_str());

  const lazy::data::transforms::Normalize norm(0.2860, 0.3530);
  std::optional<lazy::data::MNIST> train_set, test_set;
  try {
    train_set.emplace(args.dir, lazy::data::MNIST::Mode::Train);
    test_set.emplace(args.dir, lazy::data::MNIST::Mode::Test);
  } catch (const lazy::Error& e) {
    std::cerr << "Fashion-MNIST not found in " << args.dir << " (" << e.what()
              << "); install dataset-fashion-mnist or pass --data-dir\n";
    return 1;
  }
  const auto train = train_set->map(norm);
  const auto test = test_set->map(norm);

  lazy::manual_seed(1);
  nn::Linear fc1(784, 256), fc2(256, 128), fc3(128, 10);
  // Megatron's pair over "model", the head replicated; every weight replicated over "data".
  spmd::mark_sharding(fc1->weight, mesh, {"model", std::nullopt});
  spmd::mark_sharding(fc1->bias, mesh, {"model"});
  spmd::mark_sharding(fc2->weight, mesh, {std::nullopt, "model"});
  spmd::mark_sharding(fc2->bias, mesh, {});
  spmd::mark_sharding(fc3->weight, mesh, {});
  spmd::mark_sharding(fc3->bias, mesh, {});
  for (auto* w : {&fc1->weight, &fc2->weight, &fc3->weight})
    std::printf("%s", spmd::visualize_tensor_sharding(*w).c_str());
  auto forward = [&](const Tensor<float>& images) {
    Tensor<float> x = lazy::flatten(images, 1);
    return fc3(Tensor<float>(lazy::relu(fc2(Tensor<float>(lazy::relu(fc1(x)))))));
  };
  std::vector<lazy::AnyTensor> params;
  for (const auto& layer : {fc1, fc2, fc3})
    for (auto& p : layer->parameters()) params.push_back(p);
  lazy::optim::SGD opt(params, lazy::optim::SGDOptions(args.lr).momentum(0.9));

  auto train_loader = lazy::data::make_data_loader(train, lazy::data::RandomSampler(/*seed=*/1),
                                                   {.batch_size = args.batch_size, .drop_last = true, .num_workers = 1});
  // The device loader hands out batches already split over "data" (torch_xla's
  // input_sharding) and calls mark_step as the loop asks for the next one.
  lazy::dist::ParallelLoaderOptions loader_options;
  loader_options.input_sharding = std::make_shared<const spmd::ShardingSpec>(mesh, spmd::PartitionSpec{"data"});
  lazy::dist::MpDeviceLoader batches(*train_loader, lazy::device(0), loader_options);
  for (int epoch = 1; epoch <= args.epochs; ++epoch) {
    const auto t0 = std::chrono::steady_clock::now();
    std::size_t seen = 0;
    Tensor<float> loss;
    for (auto& batch : batches) {
      opt.zero_grad();
      loss = nn::functional::cross_entropy(forward(batch.data), batch.target);
      loss.backward();
      opt.step();
      seen += args.batch_size;
    }
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::printf("epoch %d: last loss %.4f, %.0f samples/s\n", epoch, loss.item(), static_cast<double>(seen) / secs);
    std::fflush(stdout);
  }

  // Test accuracy, with the test batches sharded the same way.
  auto test_loader = lazy::data::make_data_loader(test, lazy::data::SequentialSampler(), {.batch_size = 1000});
  std::int64_t correct = 0, total = 0;
  lazy::NoGradGuard no_grad;
  for (auto& batch : *test_loader) {
    Tensor<float> images = batch.data;
    Tensor<std::int64_t> labels = batch.target;
    if (images.size(0) % args.data == 0) {
      spmd::mark_sharding(images, mesh, {"data"});
      spmd::mark_sharding(labels, mesh, {"data"});
    }
    correct += lazy::sum(lazy::argmax(forward(images), 1) == labels).item();
    total += labels.numel();
  }
  if (!args.save.empty()) {
    lazy::StateDict sd;
    sd.insert("fc1.weight", fc1->weight);
    sd.insert("fc2.weight", fc2->weight);
    sd.insert("fc3.weight", fc3->weight);
    lazy::StateDict back;
    try {
      lazy::io::save(sd, args.save, {.shard_files = true});
      back = lazy::io::load(args.save);
    } catch (const lazy::Error& e) {
      std::fprintf(stderr, "%s: %s\n", argv[0], e.what());
      return 1;
    }
    for (const auto& [name, t] : sd) {
      const Tensor<float> saved = t, loaded = back.at(name);
      if (saved.to_vector() != loaded.to_vector()) {
        std::fprintf(stderr, "%s: reloaded %s differs from the trained one\n", argv[0], name.c_str());
        return 1;
      }
    }
    std::printf("saved the weights as shard files indexed by %s and reloaded them\n", args.save.c_str());
  }
  std::printf("test_accuracy=%.4f\n", static_cast<double>(correct) / static_cast<double>(total));
  return 0;
}
