#pragma once
// The small linear-algebra vocabulary of torch around matmul: mm, mv, dot, outer, addmm,
// diagonal, diag and trace. Composites of matmul, reshape, permute, slice and scatter, so
// their gradients are those ops' backward and nothing here is a node or a kernel. Each
// checks the ranks torch's function requires (matmul alone would broadcast them).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include <lazytensor/ops/factories.hpp>
#include <lazytensor/ops/matmul.hpp>
#include <lazytensor/ops/reduction.hpp>
#include <lazytensor/ops/reshape.hpp>
#include <lazytensor/ops/scatter.hpp>
#include <lazytensor/ops/slice.hpp>
#include <lazytensor/tensor/tensor.hpp>

namespace lazy {

namespace detail {

/// ShapeError unless `t` has rank `rank` (naming the op and the argument).
template <Element T>
void require_rank(const Tensor<T>& t, int rank, const char* op, const char* arg) {
  if (t.dim() != rank) {
    throw ShapeError(std::string(op) + ": expected " + arg + " to be " + std::to_string(rank) +
                     "-D, got shape " + t.shape().str());
  }
}

}  // namespace detail

/// Matrix product of two 2-D tensors (torch.mm: no broadcasting, no 1-D promotion).
template <Element T>
Tensor<T> mm(const Tensor<T>& a, const Tensor<T>& b) {
  detail::require_rank(a, 2, "mm", "self");
  detail::require_rank(b, 2, "mm", "mat2");
  return matmul(a, b);
}

/// Matrix-vector product of a 2-D and a 1-D tensor (torch.mv).
template <Element T>
Tensor<T> mv(const Tensor<T>& a, const Tensor<T>& v) {
  detail::require_rank(a, 2, "mv", "self");
  detail::require_rank(v, 1, "mv", "vec");
  return matmul(a, v);
}

/// Inner product of two 1-D tensors of equal length, a 0-D result (torch.dot).
template <Element T>
Tensor<T> dot(const Tensor<T>& a, const Tensor<T>& b) {
  detail::require_rank(a, 1, "dot", "self");
  detail::require_rank(b, 1, "dot", "other");
  if (a.numel() != b.numel()) {
    throw ShapeError("dot: expected 1-D tensors of the same size, got " + a.shape().str() + " and " + b.shape().str());
  }
  return matmul(a, b);
}

/// Outer product of two 1-D tensors: [n] x [m] -> [n, m] (torch.outer). An element-wise
/// product of broadcast views, not a GEMM of depth one.
template <Element T>
Tensor<T> outer(const Tensor<T>& a, const Tensor<T>& b) {
  detail::require_rank(a, 1, "outer", "self");
  detail::require_rank(b, 1, "outer", "vec2");
  return Tensor<T>(reshape(a, {a.numel(), std::int64_t{1}}) * reshape(b, {std::int64_t{1}, b.numel()}));
}

/// beta * input + alpha * (m1 @ m2) (torch.addmm); input broadcasts to the product's shape.
/// As in torch, beta == 0 ignores input's values (NaN and inf in it do not propagate).
template <Element T>
Tensor<T> addmm(const Tensor<T>& input, const Tensor<T>& m1, const Tensor<T>& m2, double beta = 1,
                double alpha = 1) {
  Tensor<T> p = mm(m1, m2);
  const Shape want = broadcast_shapes(input.shape(), p.shape(), "addmm");
  if (want != p.shape()) {
    throw ShapeError("addmm: input of shape " + input.shape().str() + " does not broadcast to the product's shape " +
                     p.shape().str());
  }
  if constexpr (is_integral_v<T>) {
    // Integer products stay integers: beta and alpha must be whole (torch's rule), and are
    // applied as integers (a double factor would round values above 2^53, a float above 2^24).
    if (beta != std::trunc(beta) || alpha != std::trunc(alpha)) {
      throw DTypeError("addmm: integer tensors take integer beta and alpha, got " + std::to_string(beta) + " and " +
                       std::to_string(alpha));
    }
    const auto b = static_cast<std::int64_t>(beta), a = static_cast<std::int64_t>(alpha);
    if (b == 0) return a == 1 ? p : Tensor<T>(p * a);
    return Tensor<T>(input * b + p * a);
  } else {
    if (beta == 0) return alpha == 1 ? p : Tensor<T>(p * alpha);
    return Tensor<T>(input * beta + p * alpha);
  }
}

/// The diagonal of dims dim1 and dim2 (torch.diagonal): those dims are removed and the
/// diagonal appended as the last one; offset > 0 is above the main diagonal, < 0 below.
/// A copy (views here are values).
template <Element T>
Tensor<T> diagonal(const Tensor<T>& x, std::int64_t offset = 0, std::int64_t dim1 = 0, std::int64_t dim2 = 1) {
  const Shape& s = x.shape();
  if (s.rank() < 2) throw ShapeError("diagonal: expected a tensor of at least 2 dimensions, got shape " + s.str());
  const int d1 = normalize_dim(dim1, s.rank(), "diagonal"), d2 = normalize_dim(dim2, s.rank(), "diagonal");
  if (d1 == d2) {
    throw ShapeError("diagonal: dim1 and dim2 must be different dimensions, both are " + std::to_string(d1));
  }
  std::vector<std::int64_t> perm, lead;
  for (int d = 0; d < s.rank(); ++d) {
    if (d != d1 && d != d2) perm.push_back(d), lead.push_back(s[d]);
  }
  perm.push_back(d1);
  perm.push_back(d2);
  const std::int64_t n = s[d1], m = s[d2];
  // Length of the diagonal, and where it starts in the flattened [n * m] plane.
  const std::int64_t len = std::max<std::int64_t>(0, offset >= 0 ? std::min(n, m - offset) : std::min(n + offset, m));
  const std::int64_t start = len == 0 ? 0 : (offset >= 0 ? offset : -offset * m);
  std::vector<std::int64_t> flat = lead;
  flat.push_back(n * m);
  Tensor<T> plane = reshape(permute(x, perm), flat);
  return slice(plane, -1, start, start + (len == 0 ? 0 : (len - 1) * (m + 1) + 1), m + 1);
}

/// Sum of the main diagonal of a 2-D tensor (torch.trace), a 0-D result of sum's dtype
/// (int64 for integers and bool).
template <Element T>
auto trace(const Tensor<T>& x) {
  detail::require_rank(x, 2, "trace", "self");
  return sum(diagonal(x));
}

/// torch.diag: of a 1-D tensor, the square matrix with it on diagonal `k` (zeros elsewhere);
/// of a 2-D tensor, its diagonal `k` as a 1-D tensor.
template <Element T>
Tensor<T> diag(const Tensor<T>& x, std::int64_t k = 0) {
  if (x.dim() == 2) return diagonal(x, k, 0, 1);
  if (x.dim() != 1) throw ShapeError("diag: expected a 1-D or 2-D tensor, got shape " + x.shape().str());
  const std::int64_t n = x.numel(), size = n + (k < 0 ? -k : k);
  // Flat positions of the diagonal in the [size * size] result: row i + max(-k, 0), column
  // i + max(k, 0).
  const std::int64_t first = (k < 0 ? -k * size : k);
  const Tensor<std::int64_t> at(arange<std::int64_t>(0, static_cast<double>(n), 1, x.device()) * (size + 1) + first);
  Tensor<T> flat = scatter(zeros<T>(Shape{size * size}, x.device()), 0, at, x);
  return reshape(flat, {size, size});
}

}  // namespace lazy
