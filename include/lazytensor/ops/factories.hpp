#pragma once
// Tensor factories: constants (lazy), ranges and host data (materialized at once).

#include <cmath>
#include <cstdint>
#include <exception>
#include <initializer_list>
#include <string>
#include <vector>

#include <lazytensor/tensor/tensor.hpp>

namespace lazy {

namespace detail {
/// `n` host values for a range factory; OutOfMemoryError when they cannot be had.
template <Element T>
std::vector<T> host_values(std::int64_t n, const char* who) {
  try {
    return std::vector<T>(static_cast<std::size_t>(n));
  } catch (const std::exception&) {  // bad_alloc, or length_error past max_size()
    throw OutOfMemoryError(std::string(who) + ": cannot hold " + std::to_string(n) + " values of " +
                           std::to_string(sizeof(T)) + " bytes");
  }
}
}  // namespace detail

/// A tensor of `shape` filled with `value` (a lazy node: no memory is touched until used).
template <Element T, expr::Number V>
Tensor<T> full(const Shape& shape, V value, Device dev = device()) {
  using E = Expr<ops::Identity, expr::Scalar<T>>;
  E e(expr::Scalar<T>{detail::checked_scalar<T>(value, "full")});
  graph::NodeList none;
  return Tensor<T>(graph::submit(
      graph::elementwise_node<T>(expr::to_kernel(e, none), shape, &dev.engine(), graph::NodeList{})));
}

/// Zeros of `shape`.
template <Element T>
Tensor<T> zeros(const Shape& shape, Device dev = device()) {
  return full<T>(shape, 0, dev);
}
/// Ones of `shape`.
template <Element T>
Tensor<T> ones(const Shape& shape, Device dev = device()) {
  return full<T>(shape, 1, dev);
}
/// Zeros shaped like `t`.
template <Element T>
Tensor<T> zeros_like(const Tensor<T>& t) {
  return zeros<T>(t.shape(), t.device());
}
/// Ones shaped like `t`.
template <Element T>
Tensor<T> ones_like(const Tensor<T>& t) {
  return ones<T>(t.shape(), t.device());
}

/// Uninitialized memory of `shape` (materialized; contents unspecified).
template <Element T>
Tensor<T> empty(const Shape& shape, Device dev = device()) {
  graph::Device& d = dev.engine();
  return Tensor<T>(std::make_shared<graph::DataNode>(dtype_of<T>(), shape, &d,
                                                     d.pool().acquire(padded_bytes(shape.numel(), sizeof(T)))));
}

/// A tensor holding a copy of `data`, viewed as `shape` (ShapeError if the sizes differ).
template <Element T>
Tensor<T> from_vector(const std::vector<T>& data, const Shape& shape, Device dev = device()) {
  if (static_cast<std::int64_t>(data.size()) != shape.numel()) {
    throw ShapeError("from_vector: shape " + shape.str() + " needs " + std::to_string(shape.numel()) +
                     " elements, got " + std::to_string(data.size()));
  }
  if constexpr (std::is_same_v<T, bool>) {
    std::vector<char> tmp(data.begin(), data.end());  // std::vector<bool> is packed
    return Tensor<T>(detail::data_node<bool>(reinterpret_cast<const bool*>(tmp.data()), shape, dev));
  } else {
    return Tensor<T>(detail::data_node<T>(data.data(), shape, dev));
  }
}

/// A 1-D tensor holding a copy of `data`.
template <Element T>
Tensor<T> from_vector(const std::vector<T>& data) {
  return from_vector<T>(data, Shape{static_cast<std::int64_t>(data.size())}, device());
}

/// A 1-D tensor from a list: tensor<float>({1, 2, 3}).
template <Element T>
Tensor<T> tensor(std::initializer_list<T> values, Device dev = device()) {
  return from_vector<T>(std::vector<T>(values), Shape{static_cast<std::int64_t>(values.size())}, dev);
}
/// A 2-D tensor from nested lists: tensor<float>({{1, 2}, {3, 4}}); rows must agree.
template <Element T>
Tensor<T> tensor(std::initializer_list<std::initializer_list<T>> rows, Device dev = device()) {
  std::vector<T> flat;
  const std::int64_t cols = rows.size() ? static_cast<std::int64_t>(rows.begin()->size()) : 0;
  for (const auto& r : rows) {
    if (static_cast<std::int64_t>(r.size()) != cols) {
      throw ShapeError("tensor: expected every row to have " + std::to_string(cols) + " elements, found " +
                       std::to_string(r.size()));
    }
    flat.insert(flat.end(), r.begin(), r.end());
  }
  return from_vector<T>(flat, Shape{static_cast<std::int64_t>(rows.size()), cols}, dev);
}
/// A 0-d tensor holding `v`.
template <Element T>
Tensor<T> scalar_tensor(T v, Device dev = device()) {
  return Tensor<T>(detail::data_node<T>(&v, Shape{}, dev));
}

/// Values start, start + step, ... below end (torch.arange).
template <Element T>
Tensor<T> arange(double start, double end, double step = 1, Device dev = device()) {
  if (step == 0 || !std::isfinite(start) || !std::isfinite(end) || !std::isfinite(step)) {
    throw Error("arange: expected a finite, non-zero step and finite bounds");
  }
  if ((end - start) / step < 0) {
    throw Error("arange: upper bound and step sign are inconsistent (start " + std::to_string(start) +
                ", end " + std::to_string(end) + ", step " + std::to_string(step) + ")");
  }
  const double count = std::ceil((end - start) / step);
  if (!(count <= static_cast<double>(kMaxElements))) {  // (converting a larger one is undefined)
    throw ShapeError("arange: " + std::to_string(count) + " elements (start " +
                     std::to_string(start) + ", end " + std::to_string(end) + ", step " +
                     std::to_string(step) + ") is more than a tensor holds (" +
                     std::to_string(kMaxElements) + ")");
  }
  const auto n = static_cast<std::int64_t>(count);
  std::vector<T> v = detail::host_values<T>(n, "arange");
  for (std::int64_t i = 0; i < n; ++i) v[i] = static_cast<T>(start + static_cast<double>(i) * step);
  return from_vector<T>(v, Shape{static_cast<std::int64_t>(v.size())}, dev);
}
/// 0, 1, ..., end - 1.
template <Element T>
Tensor<T> arange(double end, Device dev = device()) {
  return arange<T>(0, end, 1, dev);
}

/// `steps` values evenly spaced from start to end inclusive (torch.linspace).
template <Element T>
Tensor<T> linspace(double start, double end, std::int64_t steps, Device dev = device()) {
  if (steps < 0) throw Error("linspace: number of steps must be non-negative, got " + std::to_string(steps));
  if (steps > kMaxElements) {
    throw ShapeError("linspace: " + std::to_string(steps) + " steps is more than a tensor holds (" +
                     std::to_string(kMaxElements) + ")");
  }
  std::vector<T> v = detail::host_values<T>(steps, "linspace");
  const double step = steps > 1 ? (end - start) / static_cast<double>(steps - 1) : 0;
  // Fill from both ends, as PyTorch does, so the last value is exactly `end`.
  for (std::int64_t i = 0; i < steps; ++i) {
    // A single step is `start`, as torch.linspace(a, b, 1) == [a].
    v[i] = static_cast<T>(steps == 1 || i < steps / 2 ? start + step * static_cast<double>(i)
                                                      : end - step * static_cast<double>(steps - 1 - i));
  }
  return from_vector<T>(v, Shape{static_cast<std::int64_t>(v.size())}, dev);
}

}  // namespace lazy
