#pragma once
// The cumulative ops cumsum, cumprod, cummax and cummin (torch's), and their derivative
// rules. The kernels are graph/scan_node.hpp's; cummax's gradient is gather's adjoint
// (graph/shape_backward.hpp's ScatterAddNode).

#include <cstdint>
#include <memory>
#include <tuple>
#include <type_traits>
#include <vector>

#include <lazytensor/autograd/record.hpp>
#include <lazytensor/graph/scan_node.hpp>
#include <lazytensor/graph/shape_backward.hpp>
#include <lazytensor/graph/submit.hpp>
#include <lazytensor/ops/indexing.hpp>
#include <lazytensor/ops/shape_helpers.hpp>
#include <lazytensor/tensor/tensor.hpp>

namespace lazy {

namespace detail {

/// The default of cumsum's and cumprod's dtype parameter: torch's result type, below.
struct scan_natural {};

/// The element type cumsum and cumprod return: `D` when given, else as torch, which sums
/// and multiplies integers and bool in int64 (so that a running total of small integers
/// does not overflow their type) and keeps a floating type.
template <class D, Element V>
using scan_result_t =
    std::conditional_t<std::is_same_v<D, scan_natural>, std::conditional_t<is_floating_v<V>, V, std::int64_t>, D>;

/// A dtype parameter cumsum and cumprod accept: any element type but bool (a running sum
/// has no bool value; torch's kernels reject it too).
template <class D>
concept ScanDType = std::is_same_v<D, scan_natural> || (Element<D> && !std::is_same_v<D, bool>);

/// cumsum / cumprod of x along dim, cast to D first when D is given (as torch's dtype=).
template <graph::ScanOp Op, class D, expr::ExprLike X>
auto scan_impl(const X& x, std::int64_t dim, const char* op) {
  using V = expr::value_t<X>;
  using R = scan_result_t<D, V>;
  // A given dtype converts the input first (torch: "the input tensor is casted to dtype
  // before the operation"), through cast's own rules and derivative.
  auto t = [&] {
    if constexpr (std::is_same_v<D, scan_natural> || std::is_same_v<D, V>) return as_tensor(x);
    else return Tensor<D>(cast<D>(x));
  }();
  using In = typename decltype(t)::value_type;
  const int d = normalize_dim(dim, t.dim(), op);
  Tensor<R> r(graph::submit(std::make_shared<graph::ScanNode<In, R, Op>>(t.node(), d, false)));
  if constexpr (is_floating_v<R>) {
    static_assert(std::is_same_v<In, R>);
    if constexpr (Op == graph::ScanOp::Sum) {
      // Each x(i) adds to every out(k), k >= i: dx(i) = sum of g(k) for k >= i, the same
      // scan run from the end (no flips: no copies).
      autograd::record(
          r, "CumsumBackward0", {autograd::edge_of(t.impl())},
          [d](const Tensor<R>& g) {
            return graph::NodeList{
                graph::submit(std::make_shared<graph::ScanNode<R, R, graph::ScanOp::Sum>>(g.node(), d, true))};
          },
          autograd::Saves::nothing);
    } else {
      // Dividing out by x(i) would give 0/0 at zeros: CumprodBackwardNode multiplies only.
      autograd::record(r, "CumprodBackward0", {autograd::edge_of(t.impl())},
                       [d, xs = t.detach()](const Tensor<R>& g) {
                         return graph::NodeList{graph::submit(
                             std::make_shared<graph::CumprodBackwardNode<R>>(xs.node(), g.node(), d))};
                       });
    }
  }
  return r;
}

/// cummax (IsMax) / cummin: values and indices as two nodes over the same input.
template <bool IsMax, expr::ExprLike X>
auto cum_extreme(const X& x, std::int64_t dim, const char* op) {
  auto t = as_tensor(x);
  using T = typename decltype(t)::value_type;
  const Shape& s = t.shape();
  const int d = normalize_dim(dim, s.rank(), op);
  Tensor<std::int64_t> idx(graph::submit(std::make_shared<graph::CumExtremeNode<T, IsMax, true>>(t.node(), d)));
  Tensor<T> values(graph::submit(std::make_shared<graph::CumExtremeNode<T, IsMax, false>>(t.node(), d)));
  // values = gather(x, dim, indices): its adjoint scatters g back to where each running
  // extreme came from, adding where one element stays the extreme for several steps.
  record_gathered(values, IsMax ? "CummaxBackward0" : "CumminBackward0", t, d, idx);
  return std::tuple<Tensor<T>, Tensor<std::int64_t>>{std::move(values), std::move(idx)};
}

}  // namespace detail

/// torch.cumsum: out(i) = x(0) + ... + x(i) along `dim` (-rank <= dim < rank; a 0-d tensor
/// takes 0 or -1, and its value is the result). Integers and bool give int64, as in torch, so that
/// counting along a dim needs no cast; int64 sums wrap around (two's complement) rather
/// than being undefined. bfloat16 sums in float and float in double, as torch's CPU
/// kernels, each output rounded once: a long bfloat16 sum is then not stuck at the first
/// total whose ulp exceeds the summands. `cumsum<D>(x, dim)` converts x to D first and
/// returns D (torch's dtype argument), e.g. an exact double running sum of float data.
template <class D = detail::scan_natural, expr::ExprLike X>
  requires detail::ScanDType<D>
auto cumsum(const X& x, std::int64_t dim) {
  return detail::scan_impl<graph::ScanOp::Sum, D>(x, dim, "cumsum");
}

/// torch.cumprod: out(i) = x(0) * ... * x(i) along `dim`, with cumsum's dtype rules
/// (int64 for integers and bool, wrapping on overflow; `cumprod<D>` to choose). The
/// gradient is exact when x holds zeros, one or several: it multiplies the products before
/// and after each position instead of dividing the output by x (which gives 0/0 there).
template <class D = detail::scan_natural, expr::ExprLike X>
  requires detail::ScanDType<D>
auto cumprod(const X& x, std::int64_t dim) {
  return detail::scan_impl<graph::ScanOp::Prod, D>(x, dim, "cumprod");
}

/// torch.cummax: (values, indices) with values(i) = max(x(0..i)) along `dim` and indices(i)
/// where that value is, in x's dtype and int64. torch's rule, which argmax does not follow:
/// an element equal to the running max replaces it, so ties report the LATER index
/// (cummax([1, 1]) has indices [0, 1]); a NaN replaces anything, and nothing but a later
/// NaN replaces a NaN, so from the first NaN on the value is NaN and the index is that of
/// the latest NaN so far. The gradient flows to x at the reported indices.
template <expr::ExprLike X>
auto cummax(const X& x, std::int64_t dim) {
  return detail::cum_extreme<true>(x, dim, "cummax");
}

/// torch.cummin: cummax with the running minimum (same tie rule: an equal element takes
/// over, so the later index is reported; same NaN rule).
template <expr::ExprLike X>
auto cummin(const X& x, std::int64_t dim) {
  return detail::cum_extreme<false>(x, dim, "cummin");
}

}  // namespace lazy
