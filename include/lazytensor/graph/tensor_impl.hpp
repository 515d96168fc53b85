#pragma once
// The object every copy of a Tensor handle shares. In-place ops rebind `node`, so all
// copies see the new value (functionalization, as in libtorch/XLA).

#include <cstddef>
#include <memory>
#include <mutex>
#include <vector>

#include <lazytensor/graph/node.hpp>
#include <lazytensor/core/config.hpp>

namespace lazy::autograd {
class GradFn;
}  // namespace lazy::autograd

namespace lazy::graph {

class HandleRegistry;
struct TensorImpl;

/// Per-tensor autograd state, allocated only for tensors that take part in autograd. Plain
/// data held by the tensor object; autograd/ (which calls it autograd::AutogradMeta) gives
/// it its meaning.
struct AutogradState {
  bool requires_grad = false;
  /// The function that produced this value (nullptr for leaves).
  std::shared_ptr<autograd::GradFn> grad_fn;
  /// A leaf's AccumulateGrad, shared by every expression that reads the leaf.
  std::weak_ptr<autograd::GradFn> accumulator;
  /// The accumulated gradient (leaves, or non-leaves with retain_grad()), as a tensor
  /// object of its own so that `p.grad()` handles can update it in place.
  std::shared_ptr<TensorImpl> grad;
  bool retains_grad = false;
};

/// Shared state behind a tensor handle.
struct TensorImpl {
  explicit TensorImpl(NodePtr n) : node(std::move(n)) {}
  ~TensorImpl();
  TensorImpl(const TensorImpl&) = delete;
  TensorImpl& operator=(const TensorImpl&) = delete;
  NodePtr node;
  /// Autograd state; null for tensors that never took part in autograd.
  std::unique_ptr<AutogradState> autograd;

  /// The autograd state, created on first use.
  AutogradState& autograd_meta();
  /// True when gradients flow into this tensor.
  bool requires_grad() const { return autograd && autograd->requires_grad; }

  /// The registry listing this handle (Device::register_handle), and its slot there.
  std::shared_ptr<HandleRegistry> registry;
  std::size_t registry_slot = 0;
};

/// The live handles of a device, so mark_step can find the pending values still wanted.
/// A handle adds itself when registered and removes itself when destroyed (O(1) each), so
/// a step looks at live handles only. Shared by the device and its handles: a handle that
/// outlives its device (a static tensor at exit) still finds the registry.
class HandleRegistry {
 public:
  void add(TensorImpl* impl);
  void remove(TensorImpl* impl);
  /// Calls f(impl) for every live handle; handles cannot be destroyed meanwhile.
  template <class F>
  void for_each(F&& f) {
    std::lock_guard lock(mu_);
    for (TensorImpl* impl : live_) f(*impl);
  }

 private:
  std::mutex mu_;
  std::vector<TensorImpl*> live_;
};

inline TensorImpl::~TensorImpl() {
  if (registry) registry->remove(this);
}

}  // namespace lazy::graph

#if LAZYTENSOR_HEADER_DEFINITIONS
namespace lazy::graph {

LAZYTENSOR_INLINE AutogradState& TensorImpl::autograd_meta() {
  if (!autograd) autograd = std::make_unique<AutogradState>();
  return *autograd;
}

LAZYTENSOR_INLINE void HandleRegistry::add(TensorImpl* impl) {
  std::lock_guard lock(mu_);
  impl->registry_slot = live_.size();
  live_.push_back(impl);
}

LAZYTENSOR_INLINE void HandleRegistry::remove(TensorImpl* impl) {
  std::lock_guard lock(mu_);
  TensorImpl* last = live_.back();
  live_[impl->registry_slot] = last;
  last->registry_slot = impl->registry_slot;
  live_.pop_back();
}

}  // namespace lazy::graph
#endif  // LAZYTENSOR_HEADER_DEFINITIONS
