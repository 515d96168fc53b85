#pragma once
// AccumulateGrad: the end of every gradient path into a leaf. It adds the incoming
// gradient into the leaf's `.grad()` (lazily: a pending add), as libtorch does.

#include <memory>
#include <string>
#include <vector>

#include <lazytensor/autograd/function.hpp>
#include <lazytensor/autograd/node_ops.hpp>
#include <lazytensor/core/config.hpp>
#include <lazytensor/graph/tensor_impl.hpp>

namespace lazy::autograd {

/// Adds `grad` into the `.grad()` of `impl` (creating it on first use).
void accumulate_into(graph::TensorImpl& impl, graph::NodePtr grad);

/// The gradient sink of a leaf tensor.
class AccumulateGrad final : public GradFn {
 public:
  explicit AccumulateGrad(std::shared_ptr<graph::TensorImpl> leaf);
  std::string name() const override { return "AccumulateGrad"; }
  std::vector<graph::NodePtr> apply(const graph::NodePtr& grad) override {
    accumulate_into(*leaf_, grad);
    return {};
  }
  /// Nothing is saved: a leaf can receive gradients from any number of backward passes.
  void release_saved() override {}
  const std::shared_ptr<graph::TensorImpl>& leaf() const { return leaf_; }

 private:
  std::shared_ptr<graph::TensorImpl> leaf_;
};

/// Where gradients for the tensor object `impl` go when it is read now: its grad_fn, its
/// leaf accumulator (created on first use), or nowhere (nullptr) when it does not require
/// grad or grad mode is off.
GradFnPtr edge_of(const std::shared_ptr<graph::TensorImpl>& impl);

/// True when any of `edges` leads somewhere.
bool any_edge(const std::vector<GradFnPtr>& edges);

/// Makes `fn` (its `next` edges set) the producer of `impl`'s value when any edge is live;
/// returns whether it did. With no live edge nothing changes: an in-place update under
/// no_grad keeps the tensor's own state.
bool attach_grad_fn(graph::TensorImpl& impl, GradFnPtr fn);

#if LAZYTENSOR_HEADER_DEFINITIONS
LAZYTENSOR_INLINE void accumulate_into(graph::TensorImpl& impl, graph::NodePtr grad) {
  const graph::NodePtr& value = impl.node;
  if (!(grad->shape() == value->shape())) {
    throw ShapeError("autograd: gradient of shape " + grad->shape().str() + " for a tensor of shape " +
                     value->shape().str());
  }
  grad = cast_node(grad, value->dtype());
  auto& meta = impl.autograd_meta();
  if (!meta.grad) {
    meta.grad = std::make_shared<graph::TensorImpl>(std::move(grad));
  } else if (!meta.grad->node) {
    meta.grad->node = std::move(grad);
  } else {
    meta.grad->node = add_nodes(meta.grad->node, grad);
  }
}

LAZYTENSOR_INLINE AccumulateGrad::AccumulateGrad(std::shared_ptr<graph::TensorImpl> leaf) : leaf_(std::move(leaf)) {
  dtype = leaf_->node->dtype();
  shape = leaf_->node->shape();
  device = leaf_->node->device();
}

LAZYTENSOR_INLINE GradFnPtr edge_of(const std::shared_ptr<graph::TensorImpl>& impl) {
  if (!impl || !impl->requires_grad() || !is_grad_enabled()) return nullptr;
  auto& meta = *impl->autograd;
  if (meta.grad_fn) return meta.grad_fn;
  GradFnPtr acc = meta.accumulator.lock();
  if (!acc) {
    acc = std::make_shared<AccumulateGrad>(impl);
    meta.accumulator = acc;
  }
  return acc;
}

LAZYTENSOR_INLINE bool any_edge(const std::vector<GradFnPtr>& edges) {
  for (const auto& e : edges)
    if (e) return true;
  return false;
}

LAZYTENSOR_INLINE bool attach_grad_fn(graph::TensorImpl& impl, GradFnPtr fn) {
  if (!fn || !any_edge(fn->next)) return false;
  fn->dtype = impl.node->dtype();
  fn->shape = impl.node->shape();
  fn->device = impl.node->device();
  auto& meta = impl.autograd_meta();
  meta.requires_grad = true;
  meta.grad_fn = std::move(fn);
  return true;
}
#endif  // LAZYTENSOR_HEADER_DEFINITIONS

}  // namespace lazy::autograd
