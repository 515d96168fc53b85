#pragma once
// Reductions: sum mean prod max min amax amin argmax argmin any all logsumexp norm.
// Each takes a tensor or an element-wise expression (fused into the reduction loop) and
// returns a pending tensor.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <lazytensor/autograd/record.hpp>
#include <lazytensor/core/config.hpp>
#include <lazytensor/core/small_vector.hpp>
#include <lazytensor/graph/reduction_node.hpp>
#include <lazytensor/ops/factories.hpp>
#include <lazytensor/ops/shape.hpp>
#include <lazytensor/tensor/tensor.hpp>

namespace lazy {

namespace detail {

/// Reduction dims (at most one per dim of a shape, so they stay inline).
using DimList = core::SmallVector<int, 8>;

/// Normalized, sorted, de-duplicated reduction dims; empty `dims` means all.
DimList reduce_dims(const Shape& s, const std::vector<std::int64_t>& dims, const char* op);

Shape reduced_shape(const Shape& s, const DimList& dims, bool keepdim);

/// [outer, R, inner] when the reduced dims of size > 1 are adjacent; false otherwise.
bool geometry(const Shape& s, const DimList& dims, graph::ReduceGeometry& g);

/// Whether every tensor operand of expression `x` has the shape `s` of the whole or a
/// single element (so the reduction reads them all with one index).
template <class X>
bool flat_operand(const X& x, const Shape& s) {
  if constexpr (expr::is_leaf<X>::value) {
    return x.shape() == s || x.node->numel() == 1;
  } else if constexpr (expr::is_expr_node<X>::value) {
    return expr::detail::unpack(x.children(), [&](const auto&... ch) { return (flat_operand(ch, s) && ...); });
  } else {
    return true;
  }
}

/// `consume`: `x` is the caller's temporary expression (not const, whatever the parameter
/// says), whose tensor references move into the node instead of being copied.
template <class R, class Tout, class X>
graph::NodePtr reduction_node(const X& x, const std::vector<std::int64_t>& dims, bool keepdim, double scale_kind,
                              const char* op, bool consume = false);

/// Expression `x` written out as a tensor of its value type, for the reductions that need
/// their operand in memory (dims that are not adjacent, a broadcast inside the operand, an
/// arg-reduction over all elements). Without history (a reduction records its backward from
/// `x` itself; arg-reductions have none) and with the lean kernel (graph::CompiledKernel):
/// as `Tensor(x)`, these rare paths compiled a whole statement into every reduction of an
/// expression.
template <class X>
Tensor<expr::value_t<X>> written_operand(const X& x) {
  using V = expr::value_t<X>;
  graph::NodeList inputs;
  inputs.reserve(expr::leaf_count_v<X>);
  auto k = expr::to_kernel(x, inputs);
  graph::Device& dev = graph::common_device(inputs, X::op_type::name);
  using K = decltype(k);
  auto node = graph::elementwise_node<V, K, true>(std::move(k), x.shape(), &dev, std::move(inputs));
  return Tensor<V>(graph::submit(std::move(node)));
}

/// Reduces `t` over dims `rd` that are not adjacent: moves them to the back first (one
/// copy), then reduces. Per dtype, not per operand expression.
template <class R, class Tout, class V>
graph::NodePtr reduction_node_permuted(const Tensor<V>& t, const DimList& rd, bool keepdim, double scale_kind,
                                       const char* op) {
  const Shape& s = t.shape();
  std::vector<std::int64_t> perm;
  for (int i = 0; i < s.rank(); ++i)
    if (std::find(rd.begin(), rd.end(), i) == rd.end()) perm.push_back(i);
  for (int d : rd) perm.push_back(d);
  Tensor<V> p = permute(t, perm);
  std::vector<std::int64_t> back;
  for (std::size_t i = 0; i < rd.size(); ++i)
    back.push_back(s.rank() - static_cast<std::int64_t>(rd.size()) + static_cast<std::int64_t>(i));
  auto node = reduction_node<R, Tout>(p, back, false, scale_kind, op);
  if (!keepdim) return node;
  return reshape(Tensor<Tout>(node), reduced_shape(s, rd, true)).node();
}

/// Builds the node for reducing the operand `x` (flat kernel form) with reducer R.
template <class R, class Tout, class X>
graph::NodePtr reduction_node(const X& x, const std::vector<std::int64_t>& dims, bool keepdim, double scale_kind,
                              const char* op, bool consume) {
  const Shape& s = x.shape();
  auto rd = reduce_dims(s, dims, op);
  graph::ReduceGeometry g;
  if (!geometry(s, rd, g)) {
    if constexpr (expr::is_expr_node<X>::value)
      return reduction_node_permuted<R, Tout>(written_operand(x), rd, keepdim, scale_kind, op);
    else return reduction_node_permuted<R, Tout>(x, rd, keepdim, scale_kind, op);
  }
  const Shape out = reduced_shape(s, rd, keepdim);
  const double scale = scale_kind == 0 ? 1.0 : (g.extent ? 1.0 / static_cast<double>(g.extent) : std::nan(""));
  if constexpr (expr::is_expr_node<X>::value) {
    if (!flat_operand(x, s)) {
      // A broadcast inside the child: materialize it once, then reduce the result.
      return reduction_node<R, Tout>(written_operand(x), dims, keepdim, scale_kind, op);
    }
  }
  graph::NodeList inputs;
  inputs.reserve(expr::leaf_count_v<decltype(expr::operand(x))>);
  auto k = expr::operand_to_kernel(x, inputs, consume);
  using K = decltype(k);
  using S = expr::lane_combine<expr::kernel_lane_t<K>, expr::lane_of<Tout>>;
  graph::Device& dev = graph::common_device(inputs, op);
  return graph::submit(graph::reduction_node<R, S, Tout>(std::move(k), out, g, scale, &dev, std::move(inputs), s));
}

template <class R, class X>
auto reduce(const X& x, const std::vector<std::int64_t>& dims, bool keepdim, const char* op,
            bool consume = false) {
  using T = typename R::template result<expr::value_t<X>>;
  return Tensor<T>(reduction_node<R, T>(x, dims, keepdim, 0, op, consume));
}

template <class X>
void require_nonempty(const X& x, const std::vector<std::int64_t>& dims, const char* op) {
  const Shape& s = x.shape();
  auto rd = reduce_dims(s, dims, op);
  for (int d : rd)
    if (s[d] == 0) {
      throw ShapeError(std::string(op) + ": expected a non-empty dimension to reduce, got size 0 in dim " +
                       std::to_string(d) + " of shape " + s.str());
    }
  if (s.numel() == 0 && rd.empty()) throw ShapeError(std::string(op) + ": cannot reduce a tensor with no elements");
}

/// The reduced shape with kept (size-1) dims, for broadcasting a gradient back.
template <class X>
Shape keep_shape(const X& x, const std::vector<std::int64_t>& dims, const char* op) {
  return reduced_shape(x.shape(), reduce_dims(x.shape(), dims, op), true);
}

/// Records sum / mean's backward (of an operand of dtype V, input shape `in`, kept shape
/// `keep`) on `r`. Apart from record_sum so that its code is compiled once per pair of
/// dtypes, not once per operand expression.
template <class T, class V>
void record_sum_backward(Tensor<T>& r, std::shared_ptr<autograd::GradFn> e, const Shape& in, const Shape& keep,
                         bool mean) {
  const double scale = mean && keep.numel() ? static_cast<double>(keep.numel()) / static_cast<double>(in.numel()) : 1.0;
  autograd::record(
      r, mean ? "MeanBackward0" : "SumBackward0", {std::move(e)},
      [in, keep, scale](const Tensor<T>& g) {
        Tensor<T> gk = reshape(g, keep);
        return graph::NodeList{(scale == 1.0 ? evaluate_as<V>(cast<V>(gk), in)
                                                         : evaluate_as<V>(cast<V>(gk * scale), in))
                                               .node()};
      },
      autograd::Saves::nothing);
}

/// The autograd edge sum / mean record for operand `x` (null when none): taken before the
/// reduction consumes a temporary operand, as it needs the operand's leaves.
template <class X>
autograd::GradFnPtr sum_edge(const X& x) {
  if constexpr (is_floating_v<expr::value_t<X>>) {
    if (autograd::is_grad_enabled()) return autograd::operand_edge(x);
  }
  return nullptr;
}

/// sum / mean backward: the gradient, scaled, broadcast back over the reduced dims (of
/// operand `x`, read for its shape only).
template <class T, class X>
void record_sum(Tensor<T>& r, autograd::GradFnPtr e, const X& x, const std::vector<std::int64_t>& dims,
                bool mean) {
  using V = expr::value_t<X>;
  if constexpr (is_floating_v<T> && is_floating_v<V>) {
    if (e) record_sum_backward<T, V>(r, std::move(e), x.shape(), keep_shape(x, dims, "sum"), mean);
  }
}

/// Whether `x` (as a forwarding reference's type X) is a temporary, non-const expression
/// that a reduction may consume.
template <class X>
inline constexpr bool consumable_v =
    expr::Pending<X> && !std::is_lvalue_reference_v<X> && !std::is_const_v<std::remove_reference_t<X>>;

/// amax / amin backward: the gradient goes to the extreme elements, split evenly among ties.
template <class T, class X>
void record_extreme(Tensor<T>& r, const X& x, const std::vector<std::int64_t>& dims, const char* name) {
  if constexpr (is_floating_v<T>) {
    if (!autograd::is_grad_enabled()) return;
    auto e = autograd::operand_edge(x);
    if (!e) return;
    const Shape in = x.shape(), keep = keep_shape(x, dims, name);
    autograd::record(r, name, {e}, [x = autograd::saved(x), in, keep, dims, y = r.detach()](const Tensor<T>& g) {
      Tensor<T> hit = cast<T>(x == reshape(y, keep));
      Tensor<T> count = sum(hit, dims, true);
      return graph::NodeList{evaluate_as<T>(hit * (reshape(g, keep) / count), in).node()};
    });
  }
}

template <bool IsMax, class X>
Tensor<std::int64_t> arg_reduce(const X& x, std::optional<std::int64_t> dim, bool keepdim,
                                const char* op);

/// max / min along one dim (torch's max(x, dim), which also reports where): the gradient
/// goes to the one element at the reported index (the first extreme, as argmax finds it),
/// not split among ties as amax's.
template <bool IsMax, class T, class X>
void record_extreme_at(Tensor<T>& r, const X& x, std::int64_t dim, const char* name) {
  if constexpr (is_floating_v<T>) {
    if (!autograd::is_grad_enabled()) return;
    auto e = autograd::operand_edge(x);
    if (!e) return;
    const Shape in = x.shape(), keep = keep_shape(x, {dim}, name);
    if (in.rank() == 0) {  // one element: all of the gradient
      autograd::record(
          r, name, {e},
          [in](const Tensor<T>& g) { return graph::NodeList{reshape(g, in).node()}; },
          autograd::Saves::nothing);
      return;
    }
    const int d = normalize_dim(dim, in.rank(), name);
    autograd::record(r, name, {e}, [x = autograd::saved(x), in, keep, d](const Tensor<T>& g) {
      Shape line;
      for (int i = 0; i < in.rank(); ++i) line.push_back(i == d ? in[i] : 1);
      const Tensor<std::int64_t> pos =
          reshape(arange<std::int64_t>(0, static_cast<double>(in[d])), line);
      const Tensor<std::int64_t> at = arg_reduce<IsMax>(x, d, true, IsMax ? "max" : "min");
      return graph::NodeList{
          evaluate_as<T>(cast<T>(pos == at) * reshape(g, keep), in).node()};
    });
  }
}

}  // namespace detail

/// Dimensions to reduce over, taken as torch's IntArrayRef takes them: a braced list
/// (`{0, 2}`), a vector, or a single dimension (`sum(x, 1)`); empty (the default) means
/// every dimension.
struct Dims : std::vector<std::int64_t> {
  Dims() = default;
  Dims(std::initializer_list<std::int64_t> dims) : std::vector<std::int64_t>(dims) {}
  Dims(std::vector<std::int64_t> dims) : std::vector<std::int64_t>(std::move(dims)) {}  // NOLINT
  /// One dimension, implicitly, as `torch::sum(x, 1)` takes it.
  Dims(std::int64_t dim) : std::vector<std::int64_t>{dim} {}  // NOLINT
};

/// Sum over `dims` (all when empty); integers sum to int64.
template <expr::ExprLike X>
auto sum(X&& x, const Dims& dims = {}, bool keepdim = false) {
  using XX = std::remove_cvref_t<X>;
  auto e = detail::sum_edge<XX>(x);
  auto r = detail::reduce<ops::reduce::Sum, XX>(x, dims, keepdim, "sum", detail::consumable_v<X>);
  detail::record_sum<typename decltype(r)::value_type, XX>(r, std::move(e), x, dims, false);
  return r;
}
/// Product over `dims`.
template <expr::ExprLike X>
auto prod(const X& x, const Dims& dims = {}, bool keepdim = false) {
  auto r = detail::reduce<ops::reduce::Prod>(x, dims, keepdim, "prod");
  using T = typename decltype(r)::value_type;
  if constexpr (is_floating_v<T>) {
    if (auto e = autograd::is_grad_enabled() ? autograd::operand_edge(x) : nullptr) {
      // d prod / d x_i = product of the others: prod / x_i without zeros; with one zero in
      // the slice only that element gets the product of the rest; with more, nothing.
      const Shape in = x.shape(), keep = detail::keep_shape(x, dims, "prod");
      autograd::record(r, "ProdBackward0", {e}, [x = autograd::saved(x), in, keep, dims](const Tensor<T>& g) {
        Tensor<T> v = cast<T>(x);
        Tensor<T> zeros = sum(cast<T>(v == 0), dims, true);
        Tensor<T> others = detail::reduce<ops::reduce::Prod>(where(v == 0, 1, v), dims, true, "prod");
        Tensor<T> gk = reshape(g, keep);
        return graph::NodeList{
            evaluate_as<T>(gk * where(zeros == 0, others / v, where((zeros == 1) & (v == 0), others, 0)), in).node()};
      });
    }
  }
  return r;
}
/// Mean over `dims`; floating types only (DTypeError otherwise, as torch.mean).
template <expr::ExprLike X>
auto mean(X&& x, const Dims& dims = {}, bool keepdim = false) {
  using XX = std::remove_cvref_t<X>;
  using T = expr::value_t<XX>;
  if constexpr (!is_floating_v<T>) {
    throw DTypeError("mean(): could not infer output dtype. Input dtype must be floating point, got " +
                     dtype_name(dtype_of<T>()));
    return Tensor<float>();
  } else {
    auto e = detail::sum_edge<XX>(x);
    Tensor<T> r(detail::reduction_node<ops::reduce::Sum, T, XX>(x, dims, keepdim, 1, "mean",
                                                                  detail::consumable_v<X>));
    detail::record_sum<T, XX>(r, std::move(e), x, dims, true);
    return r;
  }
}
/// Largest value over `dims` (NaN-propagating).
template <expr::ExprLike X>
auto amax(const X& x, const Dims& dims = {}, bool keepdim = false) {
  detail::require_nonempty(x, dims, "amax");
  auto r = detail::reduce<ops::reduce::Max>(x, dims, keepdim, "amax");
  detail::record_extreme(r, x, dims, "AmaxBackward0");
  return r;
}
/// Smallest value over `dims` (NaN-propagating).
template <expr::ExprLike X>
auto amin(const X& x, const Dims& dims = {}, bool keepdim = false) {
  detail::require_nonempty(x, dims, "amin");
  auto r = detail::reduce<ops::reduce::Min>(x, dims, keepdim, "amin");
  detail::record_extreme(r, x, dims, "AminBackward0");
  return r;
}
/// Largest value: all elements, or along `dim` (values only; see argmax for indices).
/// Over all elements the gradient is split among ties (as amax); along `dim` it goes to
/// the first maximum, the element argmax reports (as torch's max(x, dim)).
template <expr::ExprLike X>
auto max(const X& x) {
  return amax(x);
}
template <expr::ExprLike X>
auto max(const X& x, std::int64_t dim, bool keepdim = false) {
  detail::require_nonempty(x, {dim}, "max");
  auto r = detail::reduce<ops::reduce::Max>(x, {dim}, keepdim, "max");
  detail::record_extreme_at<true>(r, x, dim, "MaxBackward0");
  return r;
}
/// Smallest value: all elements, or along `dim` (gradients as max's).
template <expr::ExprLike X>
auto min(const X& x) {
  return amin(x);
}
template <expr::ExprLike X>
auto min(const X& x, std::int64_t dim, bool keepdim = false) {
  detail::require_nonempty(x, {dim}, "min");
  auto r = detail::reduce<ops::reduce::Min>(x, {dim}, keepdim, "min");
  detail::record_extreme_at<false>(r, x, dim, "MinBackward0");
  return r;
}
/// True where any element over `dims` is non-zero.
template <expr::ExprLike X>
Tensor<bool> any(const X& x, const Dims& dims = {}, bool keepdim = false) {
  return Tensor<bool>(detail::reduction_node<ops::reduce::Any, bool>(x != 0, dims, keepdim, 0, "any"));
}
/// True where every element over `dims` is non-zero.
template <expr::ExprLike X>
Tensor<bool> all(const X& x, const Dims& dims = {}, bool keepdim = false) {
  return Tensor<bool>(detail::reduction_node<ops::reduce::All, bool>(x != 0, dims, keepdim, 0, "all"));
}

namespace detail {
template <bool IsMax, class X>
Tensor<std::int64_t> arg_reduce(const X& x, std::optional<std::int64_t> dim, bool keepdim, const char* op) {
  if (!dim) {
    // Over the flattened tensor.
    using V = expr::value_t<X>;
    Tensor<V> t = [&] {
      if constexpr (expr::is_expr_node<X>::value) return written_operand(x);
      else return x;
    }();
    Tensor<V> flat = reshape(t, Shape{t.numel()});
    auto r = arg_reduce<IsMax>(flat, 0, false, op);
    if (!keepdim) return r;
    Shape ones;
    for (int i = 0; i < t.dim(); ++i) ones.push_back(1);
    return reshape(r, ones);
  }
  require_nonempty(x, {*dim}, op);
  const Shape& s = x.shape();
  auto rd = reduce_dims(s, {*dim}, op);
  graph::ReduceGeometry g;
  geometry(s, rd, g);  // a single dim is always adjacent to itself
  if constexpr (expr::is_expr_node<X>::value) {
    if (!flat_operand(x, s)) return arg_reduce<IsMax>(written_operand(x), dim, keepdim, op);
  }
  graph::NodeList inputs;
  inputs.reserve(expr::leaf_count_v<decltype(expr::operand(x))>);
  auto k = expr::operand_to_kernel(x, inputs);
  using K = decltype(k);
  graph::Device& dev = graph::common_device(inputs, op);
  return Tensor<std::int64_t>(graph::submit(std::make_shared<graph::ArgReductionNode<K, expr::kernel_lane_t<K>, IsMax>>(
      std::move(k), reduced_shape(s, rd, keepdim), g, &dev, std::move(inputs), s)));
}
}  // namespace detail

/// Index of the largest value (first occurrence), over all elements or along `dim`.
template <expr::ExprLike X>
Tensor<std::int64_t> argmax(const X& x, std::optional<std::int64_t> dim = std::nullopt, bool keepdim = false) {
  return detail::arg_reduce<true>(x, dim, keepdim, "argmax");
}
/// Index of the smallest value (first occurrence), over all elements or along `dim`.
template <expr::ExprLike X>
Tensor<std::int64_t> argmin(const X& x, std::optional<std::int64_t> dim = std::nullopt, bool keepdim = false) {
  return detail::arg_reduce<false>(x, dim, keepdim, "argmin");
}

/// log(sum(exp(x))) over `dims`, computed stably (the max is subtracted first).
template <expr::ExprLike X>
auto logsumexp(const X& x, const Dims& dims = {}, bool keepdim = false) {
  using T = to_floating_t<expr::value_t<X>>;
  Tensor<T> t = cast<T>(x);
  // amax has no identity: over an empty slice the result is log(0) = -inf, as in torch.
  bool empty = false;
  for (int d : detail::reduce_dims(t.shape(), dims, "logsumexp")) empty = empty || t.shape()[d] == 0;
  Tensor<T> m = empty ? sum(t, dims, true) : amax(t, dims, true);
  // An all -inf (or inf) slice would give inf - inf: shift by 0 there instead.
  // The shift only keeps exp in range; it is a constant for autograd (its terms cancel).
  Tensor<T> shift = where(abs(m) == std::numeric_limits<float>::infinity(), 0, m.detach());
  Tensor<T> s = sum(exp(t - shift), dims, true);
  Tensor<T> r = log(s) + shift;
  if (keepdim) return r;
  return reshape(r, detail::reduced_shape(t.shape(), detail::reduce_dims(t.shape(), dims, "logsumexp"), false));
}

/// p-norm over `dims` (p = 2 by default; p = inf is the max of |x|, p = -inf the min).
/// For p > 0 a norm of zero has a zero gradient, as torch's norm_backward gives.
template <expr::ExprLike X>
auto norm(const X& x, double p = 2, const Dims& dims = {}, bool keepdim = false) {
  using T = to_floating_t<expr::value_t<X>>;
  // bfloat16 computes in float and rounds once (else the sum and 1/p round to bf16 first).
  using C = compute_t<T>;
  if (p == 1) return Tensor<T>(sum(abs(cast<T>(x)), dims, keepdim));
  if (std::isinf(p))
    return Tensor<T>(p > 0 ? amax(abs(cast<T>(x)), dims, keepdim)
                           : amin(abs(cast<T>(x)), dims, keepdim));
  if (p == 0) return Tensor<T>(cast<T>(sum(cast<T>(x) != 0, dims, keepdim)));
  if (p < 0) {  // (a zero sum's root is +inf here: nothing to mask)
    return Tensor<T>(cast<T>(pow(sum(pow(abs(cast<C>(x)), p), dims, keepdim), 1.0 / p)));
  }
  // For p > 0, s^(1/p) has an infinite derivative at s = 0 (0 * inf = NaN in the chain
  // rule): where the sum is zero the root is taken of 1 instead and the result multiplied
  // by 0, so that no gradient flows there (torch's norm_backward). For p < 1, |x|^p has one
  // at each zero element too, masked the same way.
  const auto ax = abs(cast<C>(x));
  Tensor<C> s;
  if (p == 2)
    s = sum(cast<C>(x) * cast<C>(x), dims, keepdim);
  else if (p < 1)
    s = sum(pow(where(ax == 0, C(1), ax), p) * cast<C>(ax != 0), dims, keepdim);
  else
    s = sum(pow(ax, p), dims, keepdim);
  const Tensor<C> safe = where(s == 0, C(1), s);
  if (p == 2) return Tensor<T>(cast<T>(sqrt(safe) * cast<C>(s != 0)));
  return Tensor<T>(cast<T>(pow(safe, 1.0 / p) * cast<C>(s != 0)));
}

}  // namespace lazy

#if LAZYTENSOR_HEADER_DEFINITIONS
namespace lazy::detail {

LAZYTENSOR_INLINE DimList reduce_dims(const Shape& s, const std::vector<std::int64_t>& dims, const char* op) {
  DimList d;
  if (dims.empty()) {
    for (int i = 0; i < s.rank(); ++i) d.push_back(i);
    return d;
  }
  for (auto x : dims) {
    const int n = normalize_dim(x, s.rank(), op);
    if (std::find(d.begin(), d.end(), n) != d.end()) {
      throw ShapeError(std::string(op) + ": dim " + std::to_string(n) + " appears multiple times in the list of dims");
    }
    d.push_back(n);
  }
  std::sort(d.begin(), d.end());
  if (s.rank() == 0) d.resize(0);
  return d;
}

LAZYTENSOR_INLINE Shape reduced_shape(const Shape& s, const DimList& dims, bool keepdim) {
  Shape out;
  for (int i = 0; i < s.rank(); ++i) {
    const bool r = std::find(dims.begin(), dims.end(), i) != dims.end();
    if (!r) out.push_back(s[i]);
    else if (keepdim) out.push_back(1);
  }
  return out;
}

LAZYTENSOR_INLINE bool geometry(const Shape& s, const DimList& dims, graph::ReduceGeometry& g) {
  int lo = -1, hi = -1;
  for (int d : dims)
    if (s[d] != 1) {
      if (lo < 0) lo = d;
      hi = d;
    }
  g = {};
  if (lo < 0) {  // nothing of size > 1 is reduced
    g.outer = s.numel();
    return true;
  }
  for (int i = lo; i <= hi; ++i) {
    const bool r = std::find(dims.begin(), dims.end(), i) != dims.end();
    if (!r && s[i] != 1) return false;
  }
  for (int i = 0; i < s.rank(); ++i) {
    if (i < lo) g.outer *= s[i];
    else if (i > hi) g.inner *= s[i];
    else g.extent *= s[i];
  }
  return true;
}

}  // namespace lazy::detail
#endif  // LAZYTENSOR_HEADER_DEFINITIONS

// Per-dtype templates the compiled runtime instantiates once (core/config.hpp): the
// reductions of a tensor (not of an expression) and their backward records.
#define LAZYTENSOR_REDUCTION_INSTANCES(P, T)                                                                  \
  P template lazy::graph::NodePtr lazy::detail::reduction_node<lazy::ops::reduce::Sum, T, lazy::Tensor<T>>(    \
      const lazy::Tensor<T>&, const std::vector<std::int64_t>&, bool, double, const char*, bool);             \
  P template lazy::graph::NodePtr lazy::detail::reduction_node<lazy::ops::reduce::Max, T, lazy::Tensor<T>>(    \
      const lazy::Tensor<T>&, const std::vector<std::int64_t>&, bool, double, const char*, bool);             \
  P template lazy::graph::NodePtr lazy::detail::reduction_node<lazy::ops::reduce::Min, T, lazy::Tensor<T>>(    \
      const lazy::Tensor<T>&, const std::vector<std::int64_t>&, bool, double, const char*, bool);             \
  P template void lazy::detail::record_sum<T, lazy::Tensor<T>>(lazy::Tensor<T>&, lazy::autograd::GradFnPtr,   \
      const lazy::Tensor<T>&, const std::vector<std::int64_t>&, bool);                                        \
  P template void lazy::detail::record_extreme<T, lazy::Tensor<T>>(lazy::Tensor<T>&, const lazy::Tensor<T>&,  \
                                                                   const std::vector<std::int64_t>&, const char*);
#if LAZYTENSOR_EXPLICIT_INSTANTIATION
LAZYTENSOR_FOR_FLOATING(LAZYTENSOR_REDUCTION_INSTANCES, extern)
#endif
