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
class ReplicaStrategy : public Strategy {
 public:
  /// `devices` replicas (>= 1), on devices 0 .. devices-1.
  explicit ReplicaStrategy(int devices);

  /// The replica's own device (inside launch(); the calling thread's outside).
  Device root_device() const override { return lazy::device(); }
  int num_processes() const override { return devices_; }
  bool is_distributed() const override { return true; }

  /// Moves `model` to the replica's device, then sync_module_states.
  void setup(nn::Module& model) override;
  /// Replaces every parameter and buffer of `model` with rank 0's value (a collective).
  void sync_module_states(nn::Module& model) const;
  /// The closure, then dist::optimizer_step: gradients averaged over the world, then the
  /// optimizer's step (lazy: it runs at the next mark_step, which the loader issues).
  Tensor<float> optimizer_step(optim::Optimizer& optimizer,
                               const std::function<Tensor<float>()>& closure = {}) override;

 private:
  int devices_;
};

#if LAZYTENSOR_HEADER_DEFINITIONS
LAZYTENSOR_INLINE ReplicaStrategy::ReplicaStrategy(int devices) : devices_(devices) {
  if (devices < 1) throw Error("ReplicaStrategy: devices must be >= 1, got " + std::to_string(devices));
}

LAZYTENSOR_INLINE void ReplicaStrategy::setup(nn::Module& model) {
  model_to_device(model);
  sync_module_states(model);
}

LAZYTENSOR_INLINE void ReplicaStrategy::sync_module_states(nn::Module& model) const {
  const StateDict mine = model.state_dict();
  StateDict rank0;
  for (const auto& [name, t] : mine) {
    t.visit([&, &name = name](const auto& typed) { rank0.insert(name, dist::broadcast(typed, 0)); });
  }
  model.load_state_dict(rank0);
}

LAZYTENSOR_INLINE Tensor<float> ReplicaStrategy::optimizer_step(optim::Optimizer& optimizer,
                                                                const std::function<Tensor<float>()>& closure) {
  Tensor<float> loss = closure ? closure() : Tensor<float>();
  dist::optimizer_step(optimizer);
  return loss;
}
#endif  // LAZYTENSOR_HEADER_DEFINITIONS

}  // namespace lazy::train
