#pragma once
// Example<Data, Target>: one sample (or one batch) of a dataset, as torch::data::Example.
// Also the host-side helpers that build a batch: a tensor filled in place in a buffer of the
// target device's pool (no staging copy), and the generic collation that stacks examples.

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <lazytensor/core/config.hpp>
#include <lazytensor/core/error.hpp>
#include <lazytensor/tensor/tensor.hpp>

namespace lazy::data {

/// A sample and its target (for a batch: data [B, ...] and targets [B, ...]).
template <class Data = Tensor<float>, class Target = Tensor<std::int64_t>>
struct Example {
  using DataType = Data;
  using TargetType = Target;
  Data data;
  Target target;
};

namespace detail {

template <class T>
inline constexpr bool is_tensor_v = false;
template <Element T>
inline constexpr bool is_tensor_v<Tensor<T>> = true;

/// A tensor under construction on the host: a buffer from `dev`'s pool that the caller
/// fills through data(), then finish() wraps it as a materialized tensor. Safe to use from
/// any thread (the pool is locked; handles count themselves on their node atomically).
template <Element T>
class HostTensor {
 public:
  explicit HostTensor(const Shape& shape, Device dev = device())
      : shape_(shape),
        dev_(&dev.engine()),
        buf_(dev_->pool().acquire(padded_bytes(shape.numel(), sizeof(T)))) {}

  /// The elements, row-major.
  T* data() { return static_cast<T*>(buf_->data()); }
  /// The finished tensor (this object is spent).
  Tensor<T> finish() && {
    return Tensor<T>(
        std::make_shared<graph::DataNode>(dtype_of<T>(), shape_, dev_, std::move(buf_)));
  }

 private:
  Shape shape_;
  graph::Device* dev_;
  std::shared_ptr<Buffer> buf_;
};

/// (n, s0, s1, ...): the shape of a batch of n samples of shape s.
Shape batch_shape(std::size_t n, const Shape& s);

/// Stacks equally shaped tensors into [n, ...] on the current device, on the host.
template <Element T, class Get>
Tensor<T> stack_on_host(std::size_t n, Get&& get, const char* field) {
  const Tensor<T>& first = get(0);
  const Shape shape = first.shape();
  for (std::size_t i = 1; i < n; ++i) {
    if (!(get(i).shape() == shape)) {
      throw ShapeError(std::string("DataLoader: cannot stack the examples of a batch: ") + field +
                       " of example 0 has shape " + shape.str() + ", of example " +
                       std::to_string(i) + " " + get(i).shape().str());
    }
  }
  HostTensor<T> out(batch_shape(n, shape));
  const auto per = static_cast<std::size_t>(shape.numel());
  for (std::size_t i = 0; i < n; ++i) {
    if (per) std::memcpy(out.data() + i * per, get(i).data(), per * sizeof(T));
  }
  return std::move(out).finish();
}

/// Collates examples of tensors into one batch example (data and target each stacked
/// along a new first dimension): the generic path of the DataLoader, for datasets without
/// get_batch.
template <class Data, class Target>
Example<Data, Target> collate(const std::vector<Example<Data, Target>>& examples) {
  static_assert(is_tensor_v<Data> && is_tensor_v<Target>,
                "DataLoader: a dataset without get_batch() must return Example<Tensor<T>, "
                "Tensor<U>> from get(), "
                "so that examples can be stacked into a batch");
  using D = typename Data::value_type;
  using T = typename Target::value_type;
  const std::size_t n = examples.size();
  return {stack_on_host<D>(
              n, [&](std::size_t i) -> const Data& { return examples[i].data; }, "data"),
          stack_on_host<T>(
              n, [&](std::size_t i) -> const Target& { return examples[i].target; }, "target")};
}

#if LAZYTENSOR_HEADER_DEFINITIONS
LAZYTENSOR_INLINE Shape batch_shape(std::size_t n, const Shape& s) {
  if (s.rank() >= kMaxRank) {
    throw ShapeError("cannot batch samples of shape " + s.str() + ": a batch would have rank " +
                     std::to_string(s.rank() + 1) + ", the maximum is " + std::to_string(kMaxRank));
  }
  Shape out{static_cast<std::int64_t>(n)};
  for (const auto d : s) out.push_back(d);
  return out;
}
#endif  // LAZYTENSOR_HEADER_DEFINITIONS

}  // namespace detail
}  // namespace lazy::data
