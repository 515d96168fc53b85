#pragma once
// AccumulateGrad: the end of every gradient path into a leaf. It adds the incoming
// gradient into the leaf's `.grad()` (lazily: a pending add), as libtorch does. Also the
// other backward functions that need no dtype's code: an in-place op's replaced history
// (ReplacedGradFn) and a copy between devices (ToCopyGradFn).

#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <lazytensor/autograd/function.hpp>
#include <lazytensor/autograd/node_ops.hpp>
#include <lazytensor/core/config.hpp>
#include <lazytensor/core/counters.hpp>
#include <lazytensor/graph/tensor_impl.hpp>

namespace lazy::autograd {

/// Adds `grad` into the `.grad()` of `impl` (creating it on first use).
void accumulate_into(graph::TensorImpl& impl, graph::NodePtr grad);

/// The gradient sink of a leaf tensor.
class AccumulateGrad final : public GradFn {
 public:
  explicit AccumulateGrad(std::shared_ptr<graph::TensorImpl> leaf);
  std::string name() const override { return "AccumulateGrad"; }
  graph::NodeList apply(const graph::NodePtr& grad) override {
    // A leaf switched to requires_grad_(false) after the graph was recorded keeps its
    // .grad() as it is, as libtorch's AccumulateGrad does.
    if (leaf_->requires_grad()) accumulate_into(*leaf_, grad);
    return {};
  }
  /// Nothing is saved: a leaf can receive gradients from any number of backward passes.
  void release_saved() override {}
  const std::shared_ptr<graph::TensorImpl>& leaf() const { return leaf_; }

 private:
  std::shared_ptr<graph::TensorImpl> leaf_;
};

namespace detail {
/// edge_of for a tensor that requires grad, with grad mode on.
GradFnPtr history_edge(const std::shared_ptr<graph::TensorImpl>& impl);
}  // namespace detail

/// Where gradients for the tensor object `impl` go when it is read now: its grad_fn, its
/// leaf accumulator (created on first use), or nowhere (nullptr) when it does not require
/// grad or grad mode is off. The test is inline: every tensor read into an expression
/// asks, and most of them need no history.
inline GradFnPtr edge_of(const std::shared_ptr<graph::TensorImpl>& impl) {
  if (!impl || !impl->requires_grad() || !is_grad_enabled()) return nullptr;
  return detail::history_edge(impl);
}

/// True when any of `edges` leads somewhere.
bool any_edge(const std::vector<GradFnPtr>& edges);

/// Makes `fn` (its `next` edges set) the producer of `impl`'s value when any edge is live;
/// returns whether it did. With no live edge nothing changes: an in-place update under
/// no_grad keeps the tensor's own state. A retain_grad() registration moves to `fn`, so
/// `.grad()` holds the gradient of the new value, as in libtorch.
bool attach_grad_fn(graph::TensorImpl& impl, GradFnPtr fn);

/// The grad_fn of a non-leaf whose value an in-place op replaced by one without history
/// (copy_ of a constant, fill_, zero_): the old value no longer reaches the output, so its
/// history receives zeros (libtorch's CopyBackwards, FillBackward0, ZeroBackward0).
class ReplacedGradFn final : public GradFn {
 public:
  explicit ReplacedGradFn(std::string name) : name_(std::move(name)) {}
  std::string name() const override { return name_; }
  LAZYTENSOR_INLINE graph::NodeList apply(const graph::NodePtr& grad) override;
  /// Nothing is saved.
  void release_saved() override {}

 private:
  std::string name_;
};

/// Records that an in-place op (`name`: "CopyBackwards", ...) replaced `impl`'s value by one
/// without history. With grad mode on, a non-leaf stays one: its grad_fn becomes a
/// ReplacedGradFn sending zeros to the old history (rather than no edge at all, so that the
/// leaves upstream get a zero .grad() as in libtorch, not an undefined one). A leaf, or grad
/// mode off, keeps its autograd state (libtorch leaves grad_fn alone under no_grad).
void replace_history(graph::TensorImpl& impl, const char* name);

/// The backward of a copy to another device (`Tensor::to(device)`, libtorch's
/// ToCopyBackward0): the gradient, on the copy's device, copied back to the source's device.
/// There is no lazy transfer between devices, so, like the forward copy, it materializes the
/// gradient first (an implicit sync of the copy's device during backward). Bytes are copied
/// as they are: no dtype's code is compiled for it.
class ToCopyGradFn final : public GradFn {
 public:
  /// `source`: the device of the tensor that was copied, where its gradient must live.
  explicit ToCopyGradFn(graph::Device* source) : source_(source) {}
  std::string name() const override { return "ToCopyBackward0"; }
  LAZYTENSOR_INLINE graph::NodeList apply(const graph::NodePtr& grad) override;
  /// Nothing is saved: a second backward through a copy is allowed, as in libtorch.
  void release_saved() override {}

 private:
  graph::Device* source_;
};

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

LAZYTENSOR_INLINE GradFnPtr detail::history_edge(const std::shared_ptr<graph::TensorImpl>& impl) {
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
  if (meta.retains_grad && meta.grad_fn) {
    // An in-place op on a tensor that retains its gradient: the old function would fill
    // .grad() with the gradient of the old value.
    auto& old = meta.grad_fn->retained;
    for (auto it = old.begin(); it != old.end(); ++it) {
      if (auto p = it->lock(); p.get() == &impl) {
        fn->retained.push_back(std::move(*it));
        old.erase(it);
        break;
      }
    }
  }
  meta.grad_fn = std::move(fn);
  return true;
}

LAZYTENSOR_INLINE graph::NodeList ReplacedGradFn::apply(const graph::NodePtr& grad) {
  // zeros_like(grad) in the old value's dtype, as a zeroed buffer: dtype-free, no kernel.
  const GradFn& prev = *next.at(0);
  graph::Device& d = *grad->device();
  const std::size_t elem = dtype_size(prev.dtype);
  auto buf = d.pool().acquire(padded_bytes(prev.shape.numel(), elem));
  if (prev.shape.numel() > 0)
    std::memset(buf->data(), 0, static_cast<std::size_t>(prev.shape.numel()) * elem);
  return {std::make_shared<graph::DataNode>(prev.dtype, prev.shape, &d, std::move(buf))};
}

LAZYTENSOR_INLINE graph::NodeList ToCopyGradFn::apply(const graph::NodePtr& grad) {
  // The gradient keeps its dtype: whatever receives it converts (AccumulateGrad, a rule, an
  // element-wise backward), so no dtype's conversion is compiled or looked up here.
  if (graph::materialize(grad)) {
    static auto& implicit = core::counter("ImplicitSync");
    implicit.add();
  }
  const std::size_t elem = dtype_size(grad->dtype());
  auto buf = source_->pool().acquire(padded_bytes(shape.numel(), elem));
  if (shape.numel() > 0)
    std::memcpy(buf->data(), grad->buffer()->data(),
                static_cast<std::size_t>(shape.numel()) * elem);
  return {std::make_shared<graph::DataNode>(grad->dtype(), shape, source_, std::move(buf))};
}

LAZYTENSOR_INLINE void replace_history(graph::TensorImpl& impl, const char* name) {
  if (!is_grad_enabled() || !impl.autograd || !impl.autograd->grad_fn) return;
  auto fn = std::make_shared<ReplacedGradFn>(name);
  fn->next = {impl.autograd->grad_fn};
  attach_grad_fn(impl, std::move(fn));
}
#endif  // LAZYTENSOR_HEADER_DEFINITIONS

}  // namespace lazy::autograd
