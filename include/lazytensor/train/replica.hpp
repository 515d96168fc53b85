#pragma once
// train::ReplicaStrategy: data-parallel replicas as threads, each with its own device, the
// analogue of Lightning's XLAStrategy and DDPSpawnStrategy. launch() is dist::spawn; the
// loader of each replica is an MpDeviceLoader; the optimizer step averages the gradients
// over the world (dist::optimizer_step); setup() makes every replica start from rank 0's
// parameters and buffers (DDP's module-state broadcast).

#include <functional>

#include <lazytensor/core/config.hpp>
#include <lazytensor/dist/optimizer_step.hpp>
#include <lazytensor/train/strategy.hpp>

namespace lazy::train {

/// Data-parallel training on `devices` thread replicas (XLAStrategy / DDPSpawnStrategy).
/// A class template (the parameter is unused; use ReplicaStrategy) so that a program that
/// never constructs one compiles none of its exchanges.
template <class = void>
class BasicReplicaStrategy : public Strategy {
 public:
  /// `devices` replicas (>= 1), on devices 0 .. devices-1.
  explicit BasicReplicaStrategy(int devices);

  /// The replica's own device (inside launch(); the calling thread's outside).
  Device root_device() const override { return lazy::device(); }
  int num_processes() const override { return devices_; }
  bool is_distributed() const override { return true; }

  /// Converts `model` to the precision plugin's dtype, moves it to the replica's device,
  /// then sync_module_states.
  void setup(nn::Module& model) override;
  /// Replaces every parameter and buffer of `model` with rank 0's value (a collective).
  void sync_module_states(nn::Module& model) const;
  /// The closure, then dist::optimizer_step: gradients averaged over the world, then the
  /// optimizer's step (lazy: it runs at the next mark_step, which the loader issues).
  AnyTensor optimizer_step(optim::Optimizer& optimizer,
                               const std::function<AnyTensor()>& closure = {}) override;

 private:
  int devices_;
};

/// Data-parallel replicas as threads (see BasicReplicaStrategy).
using ReplicaStrategy = BasicReplicaStrategy<>;

// (Members outside the class, so not inline: see core/config.hpp.)
template <class V>
BasicReplicaStrategy<V>::BasicReplicaStrategy(int devices) : devices_(devices) {
  if (devices < 1) throw Error("ReplicaStrategy: devices must be >= 1, got " + std::to_string(devices));
}

template <class V>
void BasicReplicaStrategy<V>::setup(nn::Module& model) {
  precision_plugin().convert_module(model);
  model_to_device(model);
  sync_module_states(model);
}

template <class V>
void BasicReplicaStrategy<V>::sync_module_states(nn::Module& model) const {
  const StateDict mine = model.state_dict();
  StateDict rank0;
  for (const auto& [name, t] : mine) {
    t.visit([&, &name = name](const auto& typed) { rank0.insert(name, dist::broadcast(typed, 0)); });
  }
  model.load_state_dict(rank0);
}

template <class V>
AnyTensor BasicReplicaStrategy<V>::optimizer_step(optim::Optimizer& optimizer,
                                                      const std::function<AnyTensor()>& closure) {
  AnyTensor loss = closure ? closure() : AnyTensor();
  dist::optimizer_step(optimizer);
  return loss;
}

}  // namespace lazy::train

#define LAZYTENSOR_TRAIN_REPLICA_INSTANCES(P) \
  P template class lazy::train::BasicReplicaStrategy<void>; \
  P template bool lazy::train::Strategy::reduce_boolean_decision<void>(bool, bool) const;
#if LAZYTENSOR_EXPLICIT_INSTANTIATION
LAZYTENSOR_TRAIN_REPLICA_INSTANCES(extern)
#endif
