#pragma once
// AnyTensor: a tensor whose element type is known at run time only. State dicts, file
// formats and optimizer state hold tensors of several dtypes side by side; AnyTensor
// carries them and converts back to Tensor<T> with a checked as<T>().

#include <cstring>
#include <memory>
#include <string>

#include <lazytensor/core/config.hpp>
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

#if LAZYTENSOR_HEADER_DEFINITIONS
LAZYTENSOR_INLINE void AnyTensor::copy_bytes_to(void* dst) const {
  visit([&](const auto& t) {
    if (t.numel() > 0) std::memcpy(dst, t.data(), static_cast<std::size_t>(t.numel()) * dtype_size(dtype()));
  });
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
  auto node = std::make_shared<graph::DataNode>(dtype, shape, &d, std::move(buf));
  switch (dtype) {
    case DType::Bool: return Tensor<bool>(node);
    case DType::Int32: return Tensor<std::int32_t>(node);
    case DType::Int64: return Tensor<std::int64_t>(node);
    case DType::BFloat16: return Tensor<bfloat16>(node);
    case DType::Float32: return Tensor<float>(node);
    case DType::Float64: break;
  }
  return Tensor<double>(node);
}
#endif  // LAZYTENSOR_HEADER_DEFINITIONS

}  // namespace lazy
