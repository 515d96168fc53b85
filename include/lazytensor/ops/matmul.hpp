#pragma once
// matmul, linear, bmm, and the GEMM's derivative rule, over GemmNode (graph/matmul_node.hpp):
// the packed GEMM kernel (graph/gemm_kernel.hpp) for float and double products of at least a
// register tile, Eigen GEMM on maps of the buffers otherwise. Transposes are layouts (a
// pending transpose of the last two dims is read through, never copied), and a GEMM that
// feeds only an element-wise expression runs in row blocks with that expression applied to
// each block while it is in cache (see ElementwiseNode::fuse_producers).

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <lazytensor/autograd/record.hpp>
#include <lazytensor/core/autocast.hpp>
#include <lazytensor/graph/convert_node.hpp>
#include <lazytensor/graph/matmul_node.hpp>
#include <lazytensor/graph/transpose_hint.hpp>
#include <lazytensor/ops/reduction.hpp>
#include <lazytensor/ops/shape.hpp>
#include <lazytensor/tensor/tensor.hpp>
#include <lazytensor/core/config.hpp>

namespace lazy {

namespace detail {

/// The operand as a GEMM reads it: through a pending transpose when there is one and the
/// GEMM reads the operand as one `rows` x `cols` matrix (`batch` 1). A batched read views
/// the same elements as [batch, rows, cols] (matmul of a vector and a stack of matrices
/// reads a [B, n] gradient as B rows of 1 x n), which the transposed layout does not give.
template <Element T>
typename graph::GemmNode<T>::Operand gemm_operand(const Tensor<T>& t, std::int64_t batch, std::int64_t rows,
                                                  std::int64_t cols) {
  const auto& n = t.node();
  if (n->pending() && batch == 1 && n->shape().rank() == 2 && n->shape()[0] == rows && n->shape()[1] == cols) {
    if (auto* tr = dynamic_cast<graph::TransposeOfLastTwo*>(n.get())) return {tr->transpose_source(), true};
  }
  return {n, false};
}

/// The product as a GemmNode; `bf16` (float only) runs it in bfloat16 with float
/// accumulation and a rounded result (autocast's products), and so does its backward.
template <Element T>
Tensor<T> gemm(const Tensor<T>& a, const Tensor<T>& b, std::int64_t batch_a, std::int64_t batch_b,
               std::int64_t m, std::int64_t k, std::int64_t n, const Shape& out, bool bf16 = false);

/// Backward of C[b] = A[b] B[b] with A viewed as [batch_a, m, k], B as [batch_b, k, n] (a
/// batch of 1 broadcasts): dA = dC B^T, dB = A^T dC, summed over broadcast batches. When a
/// side is shared by every batch, the batches are stacked into one GEMM instead.
/// `b_transposed`: B is the transpose of a stored [n, k] matrix (linear's weight), so dB is
/// computed as dB^T = dC^T A in that matrix's layout; the transpose's own backward then
/// folds away (transpose of a transpose) instead of copying the gradient.
/// `bf16`: the gradients' products are bfloat16 products too, which is the backward of
/// round(round(A) round(B)) (the rounding's backward rounds the gradient); where a side is
/// broadcast over batches, its gradient is the float sum of the batches' rounded products.
template <Element T>
void record_gemm(Tensor<T>& c, const Tensor<T>& a, const Tensor<T>& b, std::int64_t batch_a,
                 std::int64_t batch_b, std::int64_t m, std::int64_t k, std::int64_t n,
                 bool b_transposed, bool bf16) {
  auto ea = autograd::edge_of(a.impl()), eb = autograd::edge_of(b.impl());
  if (!ea && !eb) return;
  autograd::record(c, "MmBackward0", {ea, eb},
                   [a = a.detach(), b = b.detach(), batch_a, batch_b, m, k, n,
                    need_a = ea != nullptr, need_b = eb != nullptr,
                    b_transposed, bf16](const Tensor<T>& g) {
                     const std::int64_t B = std::max(batch_a, batch_b);
                     graph::NodeList grads(2);
                     if (need_a) {
                       // dA[b] = dC[b] B[b]^T: [B*m, n] x [n, k] stacked when B is shared.
                       Tensor<T> da = batch_b == 1 ? gemm(g, transpose(reshape(b, Shape{k, n}), 0, 1), 1, 1, B * m, n, k, Shape{B, m, k}, bf16)
                                                   : gemm(g, transpose(reshape(b, Shape{B, k, n}), 1, 2), B, B, m, n, k, Shape{B, m, k}, bf16);
                       if (batch_a == 1 && B > 1) da = sum(da, {0});
                       grads[0] = reshape(da, a.shape()).node();
                     }
                     if (need_b) {
                       Tensor<T> db;
                       if (batch_b == 1 && b_transposed) {  // dB^T = dC^T A over the stacked rows
                         db = transpose(
                             gemm(transpose(reshape(g, Shape{B * m, n}), 0, 1),
                                  reshape(a, Shape{B * m, k}), 1, 1, n, B * m, k, Shape{n, k}, bf16),
                             0, 1);
                       } else if (batch_a == 1) {  // A shared: dB[b] = A^T dC[b]
                         db = gemm(transpose(reshape(a, Shape{m, k}), 0, 1), g, 1, B, k, m, n, Shape{B, k, n}, bf16);
                       } else if (batch_b == 1) {  // B shared: one GEMM over the stacked batches
                         db = gemm(transpose(reshape(a, Shape{B * m, k}), 0, 1), reshape(g, Shape{B * m, n}), 1, 1, k,
                                   B * m, n, Shape{k, n}, bf16);
                       } else {
                         db = gemm(transpose(reshape(a, Shape{B, m, k}), 1, 2), g, B, B, k, m, n, Shape{B, k, n}, bf16);
                       }
                       if (batch_b == 1 && B > 1 && batch_a == 1) db = sum(db, {0});
                       grads[1] = reshape(db, b.shape()).node();
                     }
                     return grads;
                   });
}

template <Element T>
Tensor<T> gemm(const Tensor<T>& a, const Tensor<T>& b, std::int64_t batch_a, std::int64_t batch_b,
               std::int64_t m, std::int64_t k, std::int64_t n, const Shape& out, bool bf16) {
  auto oa = gemm_operand(a, batch_a, m, k), ob = gemm_operand(b, batch_b, k, n);
  graph::Device& dev = graph::common_device({oa.node, ob.node}, "matmul");
  Tensor<T> c(
      graph::submit(std::make_shared<graph::GemmNode<T>>(oa, ob, batch_a, batch_b, m, k, n, out, &dev, bf16)));
  if constexpr (is_floating_v<T>) {
    if (autograd::is_grad_enabled()) record_gemm(c, a, b, batch_a, batch_b, m, k, n, ob.transposed, bf16);
  }
  return c;
}

[[noreturn]] void matmul_mismatch(const Shape& a, const Shape& b, std::int64_t ka, std::int64_t kb);

/// x rounded to bfloat16 and held as float (autocast's operands and results); the gradient
/// is rounded the same way, as the backward of torch's casts rounds it.
Tensor<float> round_to_bf16(const Tensor<float>& x);

}  // namespace detail

/// Matrix product with torch.matmul's rules: 1-D x 1-D is a dot product, 2-D x 2-D a matrix
/// product, 1-D operands gain and lose a dimension, and leading (batch) dims broadcast.
/// bfloat16 operands multiply on the bfloat16 GEMM (float accumulation, the result rounded
/// once; graph/gemm_kernel_bf16.hpp); under autocast (AutocastGuard) float operands do the
/// same, rounded to bfloat16 as the GEMM packs them.
template <Element T>
Tensor<T> matmul(const Tensor<T>& a, const Tensor<T>& b) {
  if constexpr (std::is_same_v<T, bfloat16>) {
    AutocastGuard bf16;  // the float product in bfloat16 (exactly representable: the cast back is exact)
    return Tensor<bfloat16>(cast<bfloat16>(matmul(Tensor<float>(cast<float>(a)), Tensor<float>(cast<float>(b)))));
  } else if constexpr (!std::is_same_v<T, float> && !std::is_same_v<T, double> && !std::is_same_v<T, std::int32_t> &&
                       !std::is_same_v<T, std::int64_t>) {
    throw DTypeError("matmul: expected floating, int32 or int64 operands, got " + dtype_name(dtype_of<T>()));
  } else {
    bool bf16 = false;
    if constexpr (std::is_same_v<T, float>) bf16 = is_autocast_enabled();
    const Shape& sa = a.shape();
    const Shape& sb = b.shape();
    if (sa.rank() == 0 || sb.rank() == 0) {
      throw ShapeError("matmul: both arguments need at least 1 dimension, got " + sa.str() + " and " + sb.str());
    }
    if (sa.rank() == 1 && sb.rank() == 1) {
      if (sa[0] != sb[0]) detail::matmul_mismatch(sa, sb, sa[0], sb[0]);
      return detail::gemm(reshape(a, Shape{1, sa[0]}), reshape(b, Shape{sb[0], 1}), 1, 1, 1, sa[0], 1, Shape{}, bf16);
    }
    if (sb.rank() == 1) {  // [.., m, k] x [k]
      const std::int64_t k = sa[sa.rank() - 1];
      if (k != sb[0]) detail::matmul_mismatch(sa, sb, k, sb[0]);
      Shape out;
      for (int i = 0; i + 1 < sa.rank(); ++i) out.push_back(sa[i]);
      const std::int64_t m = k ? a.numel() / k : out.numel();
      return detail::gemm(reshape(a, Shape{m, k}), reshape(b, Shape{k, 1}), 1, 1, m, k, 1, out, bf16);
    }
    if (sa.rank() == 1) {  // [k] x [.., k, n]
      const std::int64_t k = sb[sb.rank() - 2], n = sb[sb.rank() - 1];
      if (k != sa[0]) detail::matmul_mismatch(sa, sb, sa[0], k);
      Shape out;
      for (int i = 0; i + 2 < sb.rank(); ++i) out.push_back(sb[i]);
      out.push_back(n);
      std::int64_t batch = 1;  // not numel / (k * n): k or n may be 0
      for (int i = 0; i + 2 < sb.rank(); ++i) batch *= sb[i];
      return detail::gemm(reshape(a, Shape{1, k}), b, 1, batch, 1, k, n, out, bf16);
    }
    const std::int64_t m = sa[sa.rank() - 2], k = sa[sa.rank() - 1];
    const std::int64_t kb = sb[sb.rank() - 2], n = sb[sb.rank() - 1];
    if (k != kb) detail::matmul_mismatch(sa, sb, k, kb);
    Shape ba, bb;
    for (int i = 0; i + 2 < sa.rank(); ++i) ba.push_back(sa[i]);
    for (int i = 0; i + 2 < sb.rank(); ++i) bb.push_back(sb[i]);
    const Shape batch = broadcast_shapes(ba, bb, "matmul");
    Shape out = batch;
    out.push_back(m);
    out.push_back(n);
    if (bb.numel() == 1 && sb.rank() == 2) {
      // [.., m, k] x [k, n]: one GEMM with all batch rows stacked (m' = batch * m).
      return detail::gemm(a, b, 1, 1, ba.numel() * m, k, n, out, bf16);
    }
    Shape fa = batch, fb = batch;
    fa.push_back(m);
    fa.push_back(k);
    fb.push_back(k);
    fb.push_back(n);
    Tensor<T> ea = (ba == batch) ? a : expand(a, fa);
    Tensor<T> eb = (bb == batch) ? b : expand(b, fb);
    return detail::gemm(ea, eb, batch.numel(), batch.numel(), m, k, n, out, bf16);
  }
}

/// Batched matrix product of [b, m, k] and [b, k, n] (no broadcasting, as torch.bmm).
template <Element T>
Tensor<T> bmm(const Tensor<T>& a, const Tensor<T>& b) {
  if (a.dim() != 3 || b.dim() != 3 || a.size(0) != b.size(0)) {
    throw ShapeError("bmm: expected 3-D tensors with equal batch sizes, got " + a.shape().str() + " and " +
                     b.shape().str());
  }
  return matmul(a, b);
}

/// x @ w^T (torch.nn.functional.linear without bias); w is [out_features, in_features].
template <Element T>
Tensor<T> linear(const Tensor<T>& x, const Tensor<T>& w) {
  if (w.dim() != 2 || x.dim() < 1 || x.size(-1) != w.size(1)) {
    throw ShapeError("linear: expected input [..., " + std::to_string(w.dim() == 2 ? w.size(1) : -1) +
                     "] and weight [out_features, in_features], got input " + x.shape().str() + " and weight " +
                     w.shape().str());
  }
  return matmul(x, transpose(w, 0, 1));  // autocast: a bfloat16 product there
}

/// x @ w^T + b. Returns an expression (as `a + b` does), so a following element-wise op
/// such as relu joins the bias in one epilogue that runs on the GEMM's row blocks.
/// (The return type is spelled out so that naming a call does not compile the GEMM: a
/// deduced type would instantiate this body wherever a call is merely written.)
template <Element T>
auto linear(const Tensor<T>& x, const Tensor<T>& w, const Tensor<T>& b)
    -> decltype(std::declval<const Tensor<T>&>() + std::declval<const Tensor<T>&>()) {
  if (b.dim() != 1 || b.size(0) != w.size(0)) {
    throw ShapeError("linear: expected bias of shape (" + std::to_string(w.size(0)) + ",), got " + b.shape().str());
  }
  return linear(x, w) + b;
}

}  // namespace lazy

#if LAZYTENSOR_HEADER_DEFINITIONS
namespace lazy::detail {
LAZYTENSOR_INLINE Tensor<float> round_to_bf16(const Tensor<float>& x) {
  Tensor<float> y(graph::submit(std::make_shared<graph::RoundToBFloat16Node>(x.node())));
  if (autograd::is_grad_enabled()) {
    if (auto edge = autograd::edge_of(x.impl())) {
      autograd::record(
          y, "RoundToBFloat16Backward", {edge},
          [](const Tensor<float>& g) {
            return graph::NodeList{
                graph::submit(std::make_shared<graph::RoundToBFloat16Node>(g.node()))};
          },
          autograd::Saves::nothing);
    }
  }
  return y;
}


LAZYTENSOR_INLINE void matmul_mismatch(const Shape& a, const Shape& b, std::int64_t ka, std::int64_t kb) {
  throw ShapeError("matmul: mat1 and mat2 shapes cannot be multiplied (" + a.str() + " and " + b.str() +
                   "): expected the contracted sizes to match, found " + std::to_string(ka) + " and " +
                   std::to_string(kb));
}

}  // namespace lazy::detail
#endif  // LAZYTENSOR_HEADER_DEFINITIONS

// The products are instantiated once by lazytensor::compiled (src/compiled.cpp) for the four
// GEMM dtypes: the GEMM node's virtual functions call the packed kernels, so a user TU that
// instantiated the node would compile every kernel (float, and the bfloat16 pair) again.
#define LAZYTENSOR_MATMUL_INSTANCES(P, T)                                                    \
  P template class lazy::graph::GemmNode<T>;                                                 \
  P template lazy::Tensor<T> lazy::matmul<T>(const lazy::Tensor<T>&, const lazy::Tensor<T>&); \
  P template lazy::Tensor<T> lazy::detail::gemm<T>(                                          \
      const lazy::Tensor<T>&, const lazy::Tensor<T>&, std::int64_t, std::int64_t, std::int64_t, \
      std::int64_t, std::int64_t, const lazy::Shape&, bool);
#if LAZYTENSOR_EXPLICIT_INSTANTIATION
LAZYTENSOR_MATMUL_INSTANCES(extern, float)
LAZYTENSOR_MATMUL_INSTANCES(extern, double)
LAZYTENSOR_MATMUL_INSTANCES(extern, std::int32_t)
LAZYTENSOR_MATMUL_INSTANCES(extern, std::int64_t)
#endif
