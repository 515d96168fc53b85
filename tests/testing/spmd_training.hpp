#pragma once
// The SPMD training run shared by tests/spmd (one process) and tests/mpi (a mesh spanning
// processes): an 8-16-4 MLP in double, four steps of SGD with momentum on fixed batches,
// sharded data-parallel, FSDP-style or tensor-parallel (or not at all, the reference).
// Turns nothing on: the caller's program is in SPMD mode already.

#include <cstdint>
#include <string>
#include <vector>

#include <lazytensor/lazytensor.hpp>

#include "testing/helpers.hpp"

namespace lazy_tests {

enum class SpmdMode { None, Data, Fsdp, Tensor };

/// What a run saw: the step losses, and each parameter's values and sharding at the end.
struct SpmdRun {
  std::vector<double> losses;
  std::vector<std::vector<double>> weights;
  std::vector<std::string> specs;
};

/// Appends each parameter's values and sharding to `r.weights` and `r.specs` (any run
/// struct with both).
template <class Run, class Params>
void record_parameters(const Params& params, Run& r) {
  for (auto& p : params) {
    r.weights.push_back(lazy::Tensor<double>(p).to_vector());
    r.specs.push_back(lazy::spmd::sharding_spec(lazy::Tensor<double>(p)));
  }
}

/// Trains the MLP (weights from `seed`, batches from `data_seed` on): Data replicates the
/// parameters and splits the batch over `data`'s axis "data"; Fsdp also splits each
/// parameter's first dimension over it; Tensor splits the first weight by output rows and
/// the second by input columns over `model`'s axis "model" (Megatron), the batch as
/// `tensor_input` says.
inline SpmdRun train_spmd_mlp(SpmdMode mode, const lazy::spmd::Mesh& data, const lazy::spmd::Mesh& model,
                              const lazy::spmd::PartitionSpec& tensor_input, std::uint64_t seed, unsigned data_seed) {
  namespace spmd = lazy::spmd;
  lazy::set_rng_state(seed);
  lazy::nn::Linear fc1(8, 16), fc2(16, 4);
  fc1->to(lazy::DType::Float64);
  fc2->to(lazy::DType::Float64);
  auto params = fc1->parameters();
  for (auto& p : fc2->parameters()) params.push_back(p);
  // params: fc1.weight [16, 8], fc1.bias [16], fc2.weight [4, 16], fc2.bias [4].
  if (mode == SpmdMode::Data) {
    for (auto& p : params) spmd::mark_sharding(p, data, {});
  } else if (mode == SpmdMode::Fsdp) {
    for (auto& p : params) spmd::mark_sharding(p, data, {"data"});
  } else if (mode == SpmdMode::Tensor) {
    spmd::mark_sharding(params[0], model, {"model", std::nullopt});
    spmd::mark_sharding(params[1], model, {"model"});
    spmd::mark_sharding(params[2], model, {std::nullopt, "model"});
    spmd::mark_sharding(params[3], model, {});
  }
  lazy::optim::SGD opt(params, lazy::optim::SGDOptions(0.1).momentum(0.9));
  SpmdRun r;
  for (int step = 0; step < 4; ++step) {
    auto x = lazy::from_vector<double>(random_values<double>(64, data_seed + static_cast<unsigned>(step)), {8, 8});
    std::vector<std::int64_t> labels(8);
    for (int i = 0; i < 8; ++i) labels[static_cast<std::size_t>(i)] = (i * 3 + step) % 4;
    auto y = lazy::from_vector<std::int64_t>(labels, {8});
    if (mode == SpmdMode::Data || mode == SpmdMode::Fsdp) {
      spmd::mark_sharding(x, data, {"data"});
      spmd::mark_sharding(y, data, {"data"});
    } else if (mode == SpmdMode::Tensor) {
      spmd::mark_sharding(x, model, tensor_input);
      spmd::mark_sharding(y, model, tensor_input);
    }
    opt.zero_grad();
    auto loss = lazy::nn::functional::cross_entropy(fc2(lazy::Tensor<double>(lazy::relu(fc1(x)))), y);
    loss.backward();
    opt.step();
    lazy::mark_step();
    r.losses.push_back(loss.item());
  }
  record_parameters(params, r);
  return r;
}

}  // namespace lazy_tests
