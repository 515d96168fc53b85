#pragma once
// AnyTensor: a tensor whose element type is known at run time only. State dicts, file
// formats and optimizer state hold tensors of several dtypes side by side; AnyTensor
// carries them and converts back to Tensor<T> with a checked as<T>().

#include <cstring>
#include <memory>
#include <string>

#include <lazytensor/core/config.hpp>
#include <lazytensor/graph/convert_node.hpp>
#include <lazytensor/graph/submit.hpp>
#include <lazytensor/tensor/tensor.hpp>

namespace lazy {

/// A handle on a tensor of any dtype (shares the tensor object, like Tensor<T> does).
class AnyTensor {
 public:
  /// An undefined tensor.
  AnyTensor() = default;
  /// Wraps a typed handle; both share one tensor object.
  template <Element T>
  AnyTensor(const Tensor<T>& t) : impl_(t.impl()) {}  // NOLINT: implicit, like torch::Tensor

  /// True unless default-constructed.
  bool defined() const { return impl_ != nullptr; }
  /// Element type tag.
  DType dtype() const { return node()->dtype(); }
  /// Sizes of each dimension.
  const Shape& shape() const { return node()->shape(); }
  /// Number of elements.
  std::int64_t numel() const { return shape().numel(); }
  /// Device the value lives on.
  Device device() const { return Device(node()->device()->index()); }

  /// True when the tensor holds elements of type T.
  template <Element T>
  bool is() const {
    return defined() && dtype() == dtype_of<T>();
  }
  /// The typed handle; DTypeError when the dtype is not T.
  template <Element T>
  Tensor<T> as() const {
    if (!defined()) throw Error("use of an undefined tensor (default-constructed lazy::AnyTensor)");
    return Tensor<T>::from_impl(impl_);
  }

  /// The typed handle, implicitly (`Tensor<float> w = model->parameters()[0];`); DTypeError
  /// when the dtype is not T.
  template <Element T>
  operator Tensor<T>() const {  // NOLINT: implicit, as the typed view of torch::Tensor
    return as<T>();
  }

  /// True for bfloat16, float and double.
  bool is_floating_point() const { return is_floating(dtype()); }

  // ---- autograd, as Tensor<T> (libtorch names) -------------------------------------

  /// True when gradients flow into this tensor.
  bool requires_grad() const { return impl_ && impl_->requires_grad(); }
  /// Marks a leaf as requiring gradients (floating dtypes only: DTypeError otherwise). The
  /// typed operations that use the tensor make its dtype's gradient operations known, so
  /// this compiles none of them.
  AnyTensor& requires_grad_(bool on = true);
  /// The accumulated gradient, of this tensor's dtype (undefined before a backward pass).
  AnyTensor grad() const;
  /// Replaces (or with an undefined tensor, clears) the gradient; same dtype, shape and device.
  void set_grad(const AnyTensor& g);
  /// A new tensor sharing this value, outside autograd.
  AnyTensor detach() const;
  /// Backpropagates from this one-element tensor (Tensor<T>::backward()).
  void backward() const;
  /// Sets every element to zero, in place (every handle sees it): a zeroed buffer, so no
  /// kernel of any dtype is compiled for it. Gradients are zeroed this way. Error on a leaf
  /// that requires grad while grad mode is on, as Tensor<T>::zero_.
  AnyTensor& zero_();
  /// A copy on device `dev` (this handle when already there).
  AnyTensor to(const Device& dev) const;
  /// The values converted to the floating `dtype` (a pending graph::ConvertNode; this
  /// handle when already of it), as Module::to(dtype) converts parameters. The result is
  /// detached from autograd (typed code converts differentiably, and with fusion, with
  /// cast<T>). DTypeError unless both dtypes are floating.
  AnyTensor to(DType dtype) const;

  /// Calls f(Tensor<T>) with the typed handle.
  template <class F>
  decltype(auto) visit(F&& f) const {
    switch (dtype()) {
      case DType::Bool: return f(as<bool>());
      case DType::Int32: return f(as<std::int32_t>());
      case DType::Int64: return f(as<std::int64_t>());
      case DType::BFloat16: return f(as<bfloat16>());
      case DType::Float32: return f(as<float>());
      case DType::Float64: break;
    }
    return f(as<double>());
  }

  /// Copies the values (row-major, dtype_size(dtype()) bytes each) to `dst`. Materializes
  /// (an implicit sync when pending).
  void copy_bytes_to(void* dst) const;

  /// The shared tensor object.
  const std::shared_ptr<graph::TensorImpl>& impl() const { return impl_; }

 private:
  const graph::NodePtr& node() const;
  std::shared_ptr<graph::TensorImpl> impl_;
};

/// A materialized tensor of run-time dtype `dtype` and `shape` holding a copy of `bytes`
/// (numel * dtype_size(dtype) bytes), on `dev`.
AnyTensor from_bytes(DType dtype, const Shape& shape, const void* bytes, Device dev = device());

namespace detail {
/// A tensor object holding `node`, typed by the node's dtype.
AnyTensor any_of_node(graph::NodePtr node);
}  // namespace detail

#if LAZYTENSOR_HEADER_DEFINITIONS
LAZYTENSOR_INLINE void AnyTensor::copy_bytes_to(void* dst) const {
  visit([&](const auto& t) {
    if (t.numel() > 0) std::memcpy(dst, t.data(), static_cast<std::size_t>(t.numel()) * dtype_size(dtype()));
  });
}

LAZYTENSOR_INLINE AnyTensor AnyTensor::grad() const {
  AnyTensor g;  // shares the gradient object, as Tensor<T>::grad() does
  if (impl_ && impl_->autograd && impl_->autograd->grad && impl_->autograd->grad->node) g.impl_ = impl_->autograd->grad;
  return g;
}

LAZYTENSOR_INLINE void AnyTensor::set_grad(const AnyTensor& g) {
  // Tensor<T>::set_grad without the dtype (so no dtype's code is compiled for it).
  node();  // an undefined tensor throws here
  auto& meta = impl_->autograd_meta();
  if (!g.defined()) {
    meta.grad.reset();
    return;
  }
  if (g.dtype() != dtype()) {
    throw DTypeError("set_grad: assigned grad has dtype " + dtype_name(g.dtype()) + ", expected " + dtype_name(dtype()));
  }
  if (!(g.shape() == shape())) {
    throw ShapeError("set_grad: assigned grad has shape " + g.shape().str() + ", expected " + shape().str());
  }
  if (g.device() != device())
    detail::wrong_grad_device("set_grad: assigned grad", device(), g.device());
  meta.grad = g.impl_;
}

LAZYTENSOR_INLINE AnyTensor AnyTensor::detach() const {
  AnyTensor d;  // a new tensor object on the same value, outside autograd
  d.impl_ = std::make_shared<graph::TensorImpl>(node());
  return d;
}

LAZYTENSOR_INLINE AnyTensor& AnyTensor::requires_grad_(bool on) {
  node();  // an undefined tensor throws here
  if (on && !is_floating_point()) {
    throw DTypeError("requires_grad_: only tensors of floating point dtype can require gradients, got " +
                     dtype_name(dtype()));
  }
  if (impl_->autograd && impl_->autograd->grad_fn) {
    throw Error("requires_grad_: you can only change requires_grad flags of leaf variables (this tensor was computed by " +
                impl_->autograd->grad_fn->name() + ")");
  }
  impl_->autograd_meta().requires_grad = on;
  return *this;
}

LAZYTENSOR_INLINE AnyTensor AnyTensor::to(DType target) const {
  if (dtype() == target) return *this;
  // ConvertNode raises DTypeError unless both dtypes are floating.
  graph::NodePtr n = graph::submit(std::make_shared<graph::ConvertNode>(node(), target));
  switch (target) {
    case DType::BFloat16: return Tensor<bfloat16>(n);
    case DType::Float32: return Tensor<float>(n);
    default: return Tensor<double>(n);
  }
}

LAZYTENSOR_INLINE AnyTensor& AnyTensor::zero_() {
  graph::Device& d = device().engine();  // an undefined tensor throws here
  detail::check_inplace(*impl_, "zero_");
  const std::size_t bytes = static_cast<std::size_t>(numel()) * dtype_size(dtype());
  auto buf = d.pool().acquire(padded_bytes(numel(), dtype_size(dtype())));
  if (bytes) std::memset(buf->data(), 0, bytes);
  graph::rebind(impl_, std::make_shared<graph::DataNode>(dtype(), shape(), &d, std::move(buf)));
  autograd::replace_history(*impl_,
                            "ZeroBackward0");  // as Tensor<T>::zero_: the old history gets zeros
  return *this;
}

LAZYTENSOR_INLINE void AnyTensor::backward() const {
  // Tensor<T>::backward() without the dtype: the seed is a one-element buffer holding 1.
  if (!requires_grad()) {
    throw Error("backward: element 0 of tensors does not require grad and does not have a grad_fn");
  }
  if (numel() != 1) {
    throw Error("backward: grad can be implicitly created only for scalar outputs (got shape " + shape().str() + ")");
  }
  graph::Device& d = device().engine();
  auto buf = d.pool().acquire(padded_bytes(1, dtype_size(dtype())));
  switch (dtype()) {
    case DType::BFloat16: *static_cast<bfloat16*>(buf->data()) = bfloat16(1.0f); break;
    case DType::Float32: *static_cast<float*>(buf->data()) = 1.0f; break;
    case DType::Float64: *static_cast<double*>(buf->data()) = 1.0; break;
    default: throw DTypeError("backward: only floating point tensors have gradients, found " + dtype_name(dtype()));
  }
  graph::NodePtr seed = std::make_shared<graph::DataNode>(dtype(), shape(), &d, std::move(buf));
  autograd::GradFnPtr root = [&] {
    autograd::AutoGradMode on(true);
    return autograd::edge_of(impl_);
  }();
  autograd::run_backward({{{root, seed}}, false, {}});
}

LAZYTENSOR_INLINE AnyTensor AnyTensor::to(const Device& dev) const {
  return visit([&](const auto& t) { return AnyTensor(t.to(dev)); });
}

LAZYTENSOR_INLINE const graph::NodePtr& AnyTensor::node() const {
  if (!impl_) throw Error("use of an undefined tensor (default-constructed lazy::AnyTensor)");
  return impl_->node;
}

LAZYTENSOR_INLINE AnyTensor from_bytes(DType dtype, const Shape& shape, const void* bytes,
                                       Device dev) {
  graph::Device& d = dev.engine();
  const std::size_t n = static_cast<std::size_t>(shape.numel()) * dtype_size(dtype);
  auto buf = d.pool().acquire(padded_bytes(shape.numel(), dtype_size(dtype)));
  if (n) std::memcpy(buf->data(), bytes, n);
  return detail::any_of_node(std::make_shared<graph::DataNode>(dtype, shape, &d, std::move(buf)));
}

LAZYTENSOR_INLINE AnyTensor detail::any_of_node(graph::NodePtr node) {
  switch (node->dtype()) {
    case DType::Bool: return Tensor<bool>(std::move(node));
    case DType::Int32: return Tensor<std::int32_t>(std::move(node));
    case DType::Int64: return Tensor<std::int64_t>(std::move(node));
    case DType::BFloat16: return Tensor<bfloat16>(std::move(node));
    case DType::Float32: return Tensor<float>(std::move(node));
    case DType::Float64: break;
  }
  return Tensor<double>(std::move(node));
}
#endif  // LAZYTENSOR_HEADER_DEFINITIONS

}  // namespace lazy

