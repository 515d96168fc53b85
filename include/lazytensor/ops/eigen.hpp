#pragma once
// Eigen interop: a tensor from an Eigen matrix (from_eigen) and a tensor viewed as one
// (Tensor::eigen()). Kept apart from the factories so that only programs that use Eigen
// parse it.

#include <cstdint>
#include <type_traits>

#include <Eigen/Core>

#include <lazytensor/ops/factories.hpp>
#include <lazytensor/tensor/tensor.hpp>

namespace lazy {

namespace detail {
template <class T>
struct EigenView<T, void> {
  static auto map(const Tensor<T>& t) {
    using M = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
    const Shape& s = t.shape();
    const std::int64_t cols = s.rank() <= 1 ? 1 : s[s.rank() - 1];
    const std::int64_t rows = cols == 0 ? 0 : t.numel() / cols;
    return Eigen::Map<const M>(t.data(), static_cast<Eigen::Index>(rows), static_cast<Eigen::Index>(cols));
  }
};
}  // namespace detail

/// A 2-D tensor copied from an Eigen matrix or expression (any storage order).
template <class Derived>
auto from_eigen(const Eigen::DenseBase<Derived>& m, Device dev = device()) {
  using T = typename Derived::Scalar;
  const Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor> rm = m;
  return Tensor<T>(detail::data_node<T>(rm.data(), Shape{rm.rows(), rm.cols()}, dev));
}

}  // namespace lazy
