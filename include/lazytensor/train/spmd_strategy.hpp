#pragma once
// train::SpmdStrategy: one program thread drives a mesh of devices (lazy::spmd, PyTorch/XLA's
// SPMD). Unlike ReplicaStrategy there is one replica: launch() runs on the calling thread,
// world_size() is 1 and the collectives return their input. The parallelism is in the
// tensors instead: setup() shards each parameter as the strategy's parameter sharding says
// (replicated by default: data parallel), process_dataloader and batch_to_device shard each
// input along its batch dimension over the mesh's first axis, and the partitioner turns
// every statement into one node per device, adding the all-reduces the gradients need.

#include <algorithm>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include <lazytensor/core/config.hpp>
#include <lazytensor/spmd/mark_sharding.hpp>
#include <lazytensor/spmd/mesh.hpp>
#include <lazytensor/spmd/mode.hpp>
#include <lazytensor/spmd/sharding.hpp>
#include <lazytensor/train/strategy.hpp>

namespace lazy::train {

/// For one parameter (its name in the module, its value): the partition spec over the
/// strategy's mesh (an empty spec replicates it).
using ParameterSharding = std::function<spmd::PartitionSpec(const std::string& name, const AnyTensor& parameter)>;

/// A parameter sharding that splits each parameter's first dimension over `mesh`'s axis
/// `axis` (ZeRO-3 / FSDP style: every device holds 1/n of each weight), replicating the
/// parameters whose first dimension the axis does not divide (and scalars). ShardingError
/// when the mesh has no such axis.
ParameterSharding fully_sharded(const spmd::Mesh& mesh, const std::string& axis);

/// Training on a device mesh from one program thread (lazy::spmd). A class template (the
/// parameter is unused; use SpmdStrategy) so that a program that never constructs one
/// compiles none of it.
template <class = void>
class BasicSpmdStrategy : public Strategy {
 public:
  /// Over `mesh` (its first axis is the data axis inputs are split over). Each parameter
  /// is sharded as `parameter_sharding` says (empty: every parameter replicated, i.e. data
  /// parallel).
  /// `input_spec` overrides the inputs' partition spec (default: dimension 0 over the
  /// mesh's first axis, the rest replicated).
  explicit BasicSpmdStrategy(spmd::Mesh mesh, ParameterSharding parameter_sharding = {},
                             std::optional<spmd::PartitionSpec> input_spec = std::nullopt);

  /// The mesh.
  const spmd::Mesh& mesh() const { return mesh_; }
  /// The partition spec of every input tensor.
  const spmd::PartitionSpec& input_spec() const { return input_->partition_spec(); }

  /// The mesh's first device: the device a sharded tensor's whole value belongs to.
  Device root_device() const override { return Device(mesh_.device_ids().front()); }
  int num_processes() const override { return 1; }
  bool is_distributed() const override { return false; }

  /// Turns SPMD mode on (spmd::use_spmd; it then holds for the process).
  void setup_environment() override;
  /// Converts `model` to the precision plugin's dtype, moves it to root_device(), then
  /// shards (or replicates) each parameter as the parameter sharding says. ShardingError names the
  /// parameter whose spec does not fit.
  void setup(nn::Module& model) override;
  /// Inputs shard as input_spec() says, as the loader hands them out.
  dist::ParallelLoaderOptions loader_options() const override;
  /// Shards `t` as input_spec() says (a scalar, or a tensor the spec does not fit, is
  /// left whole: the partitioner replicates it where needed).
  void place_input(AnyTensor& t) const override;

 private:
  spmd::Mesh mesh_;
  ParameterSharding parameter_sharding_;
  std::shared_ptr<const spmd::ShardingSpec> input_;
};

/// Training on a device mesh from one program thread (see BasicSpmdStrategy).
using SpmdStrategy = BasicSpmdStrategy<>;

// (Members outside the class, so not inline: see core/config.hpp.)
template <class V>
BasicSpmdStrategy<V>::BasicSpmdStrategy(spmd::Mesh mesh, ParameterSharding parameter_sharding,
                                        std::optional<spmd::PartitionSpec> input_spec)
    : mesh_(std::move(mesh)), parameter_sharding_(std::move(parameter_sharding)) {
  if (!input_spec) input_spec = spmd::PartitionSpec{spmd::PartitionEntry(0)};
  input_ = std::make_shared<const spmd::ShardingSpec>(mesh_, std::move(*input_spec));
}

template <class V>
void BasicSpmdStrategy<V>::setup_environment() {
  spmd::use_spmd();
}

template <class V>
void BasicSpmdStrategy<V>::setup(nn::Module& model) {
  setup_environment();  // setup() may run outside launch()
  precision_plugin().convert_module(model);
  model_to_device(model);
  for (auto& [name, p] : model.named_parameters()) {
    // Replicated by default: every device gets its copy once, here, not at every step.
    spmd::PartitionSpec spec = parameter_sharding_ ? parameter_sharding_(name, p) : spmd::PartitionSpec{};
    try {
      spmd::mark_sharding(p, mesh_, spec);
    } catch (const ShardingError& e) {
      throw ShardingError("SpmdStrategy::setup: parameter \"" + name + "\": " + e.what());
    }
  }
}

template <class V>
dist::ParallelLoaderOptions BasicSpmdStrategy<V>::loader_options() const {
  dist::ParallelLoaderOptions o;
  o.input_sharding = input_;
  return o;
}

template <class V>
void BasicSpmdStrategy<V>::place_input(AnyTensor& t) const {
  if (t.shape().rank() == 0) return;
  const spmd::PartitionSpec& spec = input_->partition_spec();
  try {
    (void)spmd::resolve_sharding(mesh_, spec, t.shape());
  } catch (const ShardingError&) {
    return;  // e.g. a last batch the data axis does not divide: left whole
  }
  spmd::mark_sharding(t, mesh_, spec);
}

}  // namespace lazy::train

#if LAZYTENSOR_HEADER_DEFINITIONS
namespace lazy::train {

LAZYTENSOR_INLINE ParameterSharding fully_sharded(const spmd::Mesh& mesh, const std::string& axis) {
  const auto& names = mesh.axis_names();
  const auto it = std::find(names.begin(), names.end(), axis);
  if (it == names.end()) {
    std::string known;
    for (const auto& n : names) {
      if (!known.empty()) known += ", ";
      known += "\"" + n + "\"";
    }
    throw ShardingError("fully_sharded: the mesh has no axis \"" + axis + "\" (its axes: " + known + ")");
  }
  const std::int64_t size = mesh.mesh_shape()[static_cast<std::size_t>(it - names.begin())];
  return [axis, size](const std::string&, const AnyTensor& p) -> spmd::PartitionSpec {
    if (p.shape().rank() == 0 || p.shape()[0] % size != 0) return {};
    return {spmd::PartitionEntry(axis)};
  };
}

}  // namespace lazy::train
#endif  // LAZYTENSOR_HEADER_DEFINITIONS

#define LAZYTENSOR_TRAIN_SPMD_INSTANCES(P) P template class lazy::train::BasicSpmdStrategy<void>;
#if LAZYTENSOR_EXPLICIT_INSTANTIATION
LAZYTENSOR_TRAIN_SPMD_INSTANCES(extern)
#endif
