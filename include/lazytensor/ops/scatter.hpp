#pragma once
// Writing by tensors of indices, torch's names and semantics: scatter (a tensor or a
// number), scatter_add, scatter_reduce ("sum", "prod", "mean", "amax", "amin", with
// include_self), index_add and index_fill. The kernels are graph/scatter_node.hpp's and
// graph/shape_backward.hpp's; the gradients are written in gather, where and the same
// kernels, as torch's derivative formulas are.
//
// Results are deterministic: positions are combined in index order, and with duplicate
// indices the last write wins (torch leaves that case unspecified).

#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include <lazytensor/graph/index_nodes.hpp>
#include <lazytensor/graph/scatter_node.hpp>
#include <lazytensor/ops/factories.hpp>
#include <lazytensor/ops/indexing.hpp>
#include <lazytensor/ops/reshape.hpp>
#include <lazytensor/ops/slice.hpp>

namespace lazy {

namespace detail {

/// The scatter kernel over tensors whose shapes were checked, without a gradient.
template <Element T, IndexElement I>
Tensor<T> scatter_kernel(const Tensor<T>& self, int dim, const Tensor<I>& index,
                         const Tensor<T>& src, graph::ScatterMode mode, bool include_self) {
  return Tensor<T>(graph::submit(std::make_shared<graph::ScatterNode<T, I>>(
      self.node(), index.node(), src.node(), dim, mode, include_self)));
}

/// Checks scatter's shapes (torch's rules) and returns the normalized dim: index has self's
/// rank, and at most src's size in every dimension and self's outside `dim`.
inline int check_scatter_shapes(const char* op, const Shape& self, std::int64_t dim,
                                const Shape& index, const Shape* src) {
  const int d = normalize_dim(dim, self.rank(), op);
  if (index.numel() == 0) return d;  // torch lets an empty index through whatever its shape
  if (index.rank() != self.rank()) {
    throw ShapeError(std::string(op) +
                     ": index must have the same number of dimensions as self: expected " +
                     std::to_string(self.rank()) + " (self shape " + self.str() + "), got " +
                     std::to_string(index.rank()) + " (index shape " + index.str() + ")");
  }
  if (src && src->rank() != index.rank()) {
    throw ShapeError(std::string(op) +
                     ": src must have the same number of dimensions as index: expected " +
                     std::to_string(index.rank()) + ", got " + std::to_string(src->rank()) +
                     " (src shape " + src->str() + ")");
  }
  for (int k = 0; k < index.rank(); ++k) {
    if (k != d && index[k] > self[k]) {
      throw ShapeError(std::string(op) + ": index's size " + std::to_string(index[k]) +
                       " in dimension " + std::to_string(k) + " exceeds self's " +
                       std::to_string(self[k]) +
                       " (expected index.size(d) <= self.size(d) for d != dim; index shape " +
                       index.str() + ", self shape " + self.str() + ")");
    }
    if (src && index[k] > (*src)[k]) {
      throw ShapeError(std::string(op) + ": index's size " + std::to_string(index[k]) +
                       " in dimension " + std::to_string(k) + " exceeds src's " +
                       std::to_string((*src)[k]) +
                       " (expected index.size(d) <= src.size(d); index shape " + index.str() +
                       ", src shape " + src->str() + ")");
    }
  }
  return d;
}

/// src cut to index's shape (its leading part in every dimension, as torch reads it), with
/// narrow's gradient padding the cut back.
template <Element T>
Tensor<T> src_for_index(Tensor<T> src, const Shape& index) {
  if (src.shape() == index || src.shape().rank() != index.rank()) return src;
  for (int k = 0; k < index.rank(); ++k) {
    if (src.shape()[k] != index[k]) src = narrow(src, k, 0, index[k]);
  }
  return src;
}

/// "sum", "prod", "mean", "amax" or "amin" as a ScatterMode (ShapeError otherwise, naming them).
inline graph::ScatterMode scatter_reduce_mode(std::string_view reduce, const char* op) {
  if (reduce == "sum") return graph::ScatterMode::sum;
  if (reduce == "prod") return graph::ScatterMode::prod;
  if (reduce == "mean") return graph::ScatterMode::mean;
  if (reduce == "amax") return graph::ScatterMode::amax;
  if (reduce == "amin") return graph::ScatterMode::amin;
  throw Error(std::string(op) +
              ": reduce must be one of \"sum\", \"prod\", \"mean\", \"amax\", \"amin\", got \"" +
              std::string(reduce) + "\"");
}

/// The gradients of a scatter (any mode) given the output gradient g, in the order
/// {self, src}; src is already cut to index's shape. `out` is the forward's value.
template <Element T, IndexElement I>
graph::NodeList scatter_backward(const Tensor<T>& g, int dim, const Tensor<I>& index,
                                             const Tensor<T>& self, const Tensor<T>& src,
                                             const Tensor<T>& out, graph::ScatterMode mode,
                                             bool include_self) {
  using graph::ScatterMode;
  auto gather_of = [&](const Tensor<T>& t) {
    return Tensor<T>(
        graph::submit(std::make_shared<graph::GatherNode<I>>(t.node(), index.node(), dim)));
  };
  const Tensor<T> zeros_src = zeros<T>(index.shape(), g.device());
  // Positions of self that some index reaches get 0, the rest g.
  auto untouched = [&](const Tensor<T>& t) {
    return scatter_kernel(t, dim, index, zeros_src, ScatterMode::assign, true);
  };
  // How many scattered values reach each position of self.
  auto reach_count = [&](const Tensor<T>& per_src) {
    return scatter_kernel(zeros<T>(self.shape(), g.device()), dim, index, per_src, ScatterMode::sum,
                          true);
  };
  switch (mode) {
    case ScatterMode::assign: {
      // With duplicate indices only the last write is in the result, so only it gets a
      // gradient (torch gives every duplicate one; the forward here is deterministic, so
      // the exact rule is known): scatter each position's number, gather it back, compare.
      const Shape& is = index.shape();
      const auto pos = reshape(arange<std::int64_t>(static_cast<double>(is.numel()), g.device()),
                               std::vector<std::int64_t>(is.begin(), is.end()));
      const Tensor<std::int64_t> last =
          scatter_kernel(full<std::int64_t>(self.shape(), -1, g.device()), dim, index, pos,
                         ScatterMode::assign, true);
      const Tensor<std::int64_t> kept(
          graph::submit(std::make_shared<graph::GatherNode<I>>(last.node(), index.node(), dim)));
      return {untouched(g).node(), Tensor<T>(where(kept == pos, gather_of(g), 0)).node()};
    }
    case ScatterMode::sum:
      return {(include_self ? g : untouched(g)).node(), gather_of(g).node()};
    case ScatterMode::mean: {
      const Tensor<T> n = reach_count(ones<T>(index.shape(), g.device()));
      if (include_self) {
        const Tensor<T> share = g / (n + 1);
        return {share.node(), gather_of(share).node()};
      }
      const Tensor<T> share = g / maximum(n, 1);
      return {Tensor<T>(where(n == 0, g, 0)).node(), gather_of(share).node()};
    }
    case ScatterMode::amax:
    case ScatterMode::amin: {
      // The gradient is shared evenly between every value equal to the result (torch's rule).
      const Tensor<T> src_hit = cast<T>(src == gather_of(out));
      if (include_self) {
        const Tensor<T> self_hit = cast<T>(self == out);
        const Tensor<T> share = g / (self_hit + reach_count(src_hit));
        return {Tensor<T>(share * self_hit).node(), Tensor<T>(gather_of(share) * src_hit).node()};
      }
      const Tensor<T> hits = reach_count(src_hit);
      const Tensor<T> reached = reach_count(ones<T>(index.shape(), g.device()));
      return {Tensor<T>(where(reached == 0, g, 0)).node(),
              Tensor<T>(gather_of(g / maximum(hits, 1)) * src_hit).node()};
    }
    case ScatterMode::prod: {
      // Products of the other factors without dividing by zero: a zero factor is replaced
      // by one and the product recomputed (self's zeros), or, for a src value that is the
      // only zero at its target, the product with it replaced by one.
      Tensor<T> grad_self;
      if (include_self) {
        const Tensor<T> masked_self = where(self == 0, 1, self);
        const Tensor<T> others =
            scatter_kernel(masked_self, dim, index, src, ScatterMode::prod, true);
        grad_self = g * where(self == 0, others, out / masked_self);
      } else {
        grad_self = untouched(g);
      }
      const Tensor<T> src_zero = cast<T>(src == 0);
      const Tensor<T> zeros_at = gather_of(reach_count(src_zero));
      const Tensor<T> single_zero = cast<T>(src_zero * (zeros_at == 1));
      const Tensor<T> masked_src = where(single_zero != 0, 1, src);
      const Tensor<T> without =
          scatter_kernel(self, dim, index, masked_src, ScatterMode::prod, include_self);
      const Tensor<T> grad_src = where(single_zero != 0, gather_of(g * without),
                                       gather_of(g * out) / where(src_zero != 0, 1, src));
      return {grad_self.node(), grad_src.node()};
    }
  }
  return {};
}

/// scatter / scatter_reduce over an operand and src tensor: checks, the kernel, the record.
template <Element T, IndexElement I>
Tensor<T> scatter_op(const char* op, const char* grad_name, const Tensor<T>& self, std::int64_t dim,
                     const Tensor<I>& index, const Tensor<T>& src_in, graph::ScatterMode mode,
                     bool include_self) {
  const int d = check_scatter_shapes(op, self.shape(), dim, index.shape(), &src_in.shape());
  graph::common_device({self.node(), index.node(), src_in.node()}, op);
  if (index.numel() == 0) return fresh_handle(self);
  const Tensor<T> src = src_for_index(src_in, index.shape());
  Tensor<T> r = scatter_kernel(self, d, index, src, mode, include_self);
  if constexpr (is_floating_v<T>) {
    autograd::record(r, grad_name, {autograd::edge_of(self.impl()), autograd::edge_of(src.impl())},
                     [d, mode, include_self, idx = index.detach(), s = self.detach(),
                      x = src.detach(), out = r.detach()](const Tensor<T>& g) {
                       return scatter_backward(g, d, idx, s, x, out, mode, include_self);
                     });
  }
  return r;
}

/// scatter_op over an operand and a src operand (tensors or expressions) of one dtype.
template <class X, IndexElement I, class S>
auto scatter_exprs(const char* op, const char* grad_name, const X& self, std::int64_t dim, const Tensor<I>& index,
                   const S& src, graph::ScatterMode mode, bool include_self) {
  auto t = as_tensor(self);
  auto s = as_tensor(src);
  using T = typename decltype(t)::value_type;
  static_assert(std::is_same_v<T, typename decltype(s)::value_type>,
                "scatter ops: src (index_add: source) must have self's dtype, as torch requires; cast one of them");
  return scatter_op<T, I>(op, grad_name, t, dim, index, s, mode, include_self);
}

}  // namespace detail

/// torch.scatter: a copy of `self` where, for every position p of `index`, the element at
/// p's coordinates with index[p] in place of coordinate `dim` is src[p]. index has self's
/// rank and at most src's size in every dimension and self's outside `dim` (ShapeError);
/// values outside [0, self.size(dim)) raise IndexError when the kernel runs. With duplicate
/// indices the last position in index order wins, and only it gets src's gradient.
template <expr::ExprLike X, IndexElement I, expr::ExprLike S>
auto scatter(const X& self, std::int64_t dim, const Tensor<I>& index, const S& src) {
  return detail::scatter_exprs("scatter", "ScatterBackward0", self, dim, index, src, graph::ScatterMode::assign, true);
}

/// torch.scatter with a number: `value` written at every position the index names.
template <expr::ExprLike X, IndexElement I, expr::Number V>
auto scatter(const X& self, std::int64_t dim, const Tensor<I>& index, V value) {
  auto t = detail::as_tensor(self);
  using T = typename decltype(t)::value_type;
  return detail::scatter_op<T, I>("scatter", "ScatterBackward1", t, dim, index,
                                  full<T>(index.shape(), value, t.device()), graph::ScatterMode::assign, true);
}

/// torch.scatter_add: a copy of `self` with src[p] added at every position the index names
/// (shapes as scatter's). Duplicates add up, in index order.
template <expr::ExprLike X, IndexElement I, expr::ExprLike S>
auto scatter_add(const X& self, std::int64_t dim, const Tensor<I>& index, const S& src) {
  return detail::scatter_exprs("scatter_add", "ScatterAddBackward0", self, dim, index, src, graph::ScatterMode::sum,
                               true);
}

/// torch.scatter_reduce: src's values combined into a copy of `self` at the positions the
/// index names, by `reduce`: "sum", "prod", "mean" (integers: floor division), "amax" or
/// "amin" (NaN wins). With include_self = false, self's value at a position some index
/// reaches is left out of the reduction. Integer sums and products wrap. The gradient of
/// amax/amin is shared evenly between the values equal to the result that took part (with
/// include_self = false torch 1.13 still counts self's in the divisor; here it does not).
template <expr::ExprLike X, IndexElement I, expr::ExprLike S>
auto scatter_reduce(const X& self, std::int64_t dim, const Tensor<I>& index, const S& src,
                    std::string_view reduce, bool include_self = true) {
  const graph::ScatterMode mode = detail::scatter_reduce_mode(reduce, "scatter_reduce");
  if (std::is_same_v<expr::value_t<X>, bool> && mode == graph::ScatterMode::mean) {
    throw DTypeError("scatter_reduce: reduce=\"mean\" needs a number dtype, got bool");
  }
  return detail::scatter_exprs("scatter_reduce", "ScatterReduceBackward0", self, dim, index, src, mode, include_self);
}

/// torch.index_add: a copy of `self` with alpha * source's slice k added to self's slice
/// index[k] along `dim` (index 1-D; source has self's shape but index.numel() in `dim`).
/// Duplicates add up one after the other in index order, elements no index names are left
/// as they are (-0 included); values outside [0, self.size(dim)) raise IndexError when the
/// kernel runs. Integer tensors take an integer alpha (DTypeError otherwise), as torch.
template <expr::ExprLike X, IndexElement I, expr::ExprLike S, expr::Number A = int>
auto index_add(const X& self, std::int64_t dim, const Tensor<I>& index, const S& source, A alpha = 1) {
  auto t = detail::as_tensor(self);
  auto s = detail::as_tensor(source);
  using T = typename decltype(t)::value_type;
  static_assert(std::is_same_v<T, typename decltype(s)::value_type>,
                "index_add: source must have self's dtype (as torch requires); cast one of them");
  const Shape& ss = t.shape();
  if (index.dim() > 1) {
    throw ShapeError("index_add: index must be a 1-D tensor (or 0-D), got shape " + index.shape().str());
  }
  const int d = normalize_dim(dim, ss.rank(), "index_add");
  Shape want = ss;
  if (ss.rank() > 0) want[d] = index.numel();
  if (ss.rank() == 0 && index.numel() != 1) {
    throw ShapeError("index_add: a 0-dim self takes an index of exactly one element, got shape " +
                     index.shape().str());
  }
  if (s.numel() != want.numel() || (s.shape() != want && ss.rank() > 0)) {
    throw ShapeError("index_add: source must have self's shape with index.numel() in dimension " + std::to_string(d) +
                     ": expected " + want.str() + ", got " + s.shape().str());
  }
  graph::common_device({t.node(), index.node(), s.node()}, "index_add");
  // scatter_add with the index spread over source's shape: one kernel that adds in index
  // order into a copy of self, and scatter's gradients (self: g; source: gather(g)).
  Tensor<I> spread;
  if (ss.rank() == 0) {
    spread = reshape(index, std::vector<std::int64_t>{});
  } else {
    std::vector<std::int64_t> lone(static_cast<std::size_t>(ss.rank()), 1);
    lone[static_cast<std::size_t>(d)] = index.numel();
    spread = Tensor<I>(expand(reshape(index, lone), want));
  }
  const Tensor<T> src = reshape(s, std::vector<std::int64_t>(want.begin(), want.end()));
  Tensor<T> scaled;
  if constexpr (is_integral_v<T> || std::is_same_v<T, bool>) {
    if (static_cast<double>(alpha) != std::trunc(static_cast<double>(alpha))) {
      throw DTypeError("index_add: an integer tensor takes an integer alpha, got " +
                       std::to_string(static_cast<double>(alpha)));
    }
    scaled = static_cast<double>(alpha) == 1 ? src : Tensor<T>(src * static_cast<std::int64_t>(alpha));
  } else {
    scaled = static_cast<double>(alpha) == 1 ? src : Tensor<T>(src * static_cast<double>(alpha));
  }
  return detail::scatter_op<T, I>("index_add", "IndexAddBackward0", t, d, spread, scaled, graph::ScatterMode::sum,
                                  true);
}

/// torch.index_fill: a copy of `self` with `value` (converted to self's dtype) in every
/// slice index[k] along `dim` (index 1-D; negative values count from the end, as in torch).
/// Its gradient passes to self everywhere but the filled slices.
template <expr::ExprLike X, IndexElement I, expr::Number V>
auto index_fill(const X& self, std::int64_t dim, const Tensor<I>& index, V value) {
  auto t = detail::as_tensor(self);
  using T = typename decltype(t)::value_type;
  const Shape& ss = t.shape();
  if (index.dim() > 1) {
    throw ShapeError("index_fill: index must be a 1-D tensor (or 0-D), got shape " + index.shape().str());
  }
  const int d = normalize_dim(dim, ss.rank(), "index_fill");
  graph::common_device({t.node(), index.node()}, "index_fill");
  const std::int64_t size = ss.rank() > 0 ? ss[d] : 1;
  const Tensor<I> wrapped(where(index < 0, index + size, index));
  // A slab of ones per index entry, added at its slice: the count of entries naming each.
  Shape slab = ss;
  if (ss.rank() > 0) slab[d] = index.numel();
  else slab = Shape{index.numel()};
  const Tensor<std::int32_t> hits(graph::submit(std::make_shared<graph::IndexAddNode<std::int32_t, I>>(
      ones<std::int32_t>(slab, t.device()).node(), wrapped.node(), ss, d, "index_fill")));
  // The value as self's dtype first: a float number would otherwise make the choice a
  // float expression and round integers above 2^24 on the way.
  if constexpr (std::is_same_v<T, bool>) {
    return Tensor<T>(where(hits > 0, static_cast<double>(value) != 0, t));
  } else if constexpr (is_integral_v<T>) {
    return Tensor<T>(where(hits > 0, static_cast<std::int64_t>(value), t));
  } else {
    return Tensor<T>(where(hits > 0, static_cast<double>(value), t));
  }
}

}  // namespace lazy
