#pragma once
// The kernels of the cumulative ops (ops/scan.hpp): ScanNode (cumsum, cumprod, and cumsum's
// gradient as the same scan run backwards), CumExtremeNode (cummax / cummin, values or
// indices) and CumprodBackwardNode (cumprod's gradient without a division, so zeros in the
// input are exact).
//
// Every kernel sees its tensor as [outer, extent, inner] around the scanned dim. With
// inner == 1 a task scans whole contiguous rows. Otherwise a unit is one outer index and a
// chunk of inner columns: the scan walks the dim one row of the chunk at a time
// (out[o, j, c] from out[o, j - 1, c] and x[o, j, c]), so reads and writes stay contiguous
// and the column loop vectorizes, with the running values in a per-task array as wide as
// the chunk. Units are independent and each column is scanned in a fixed order, so results
// do not depend on the thread count or on the chunk width.

#include <algorithm>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include <lazytensor/core/dtype.hpp>
#include <lazytensor/core/shape.hpp>
#include <lazytensor/graph/device.hpp>
#include <lazytensor/graph/node.hpp>
#include <lazytensor/graph/parallel.hpp>

namespace lazy::graph {

/// Which running combination a ScanNode computes.
enum class ScanOp { Sum, Prod };

namespace detail::scans {

/// Width bounds of a strided unit's chunk of columns. Each step along the dim reads and
/// writes one chunk row and the next row is a whole inner stride away, usually on another
/// page, where the hardware prefetcher starts over: narrow chunks made a float cumsum over
/// dim 0 of 4096 x 4096 3.7x slower than 4096-column ones (256 columns: 37 ms, 1024: 18,
/// 4096: 10, a copy 7; one thread, -O3, AVX2). The upper bound keeps the running values
/// (at most 16 bytes per column, cummax's value and index: 64 KiB) and a chunk row of
/// input and output within L2.
inline constexpr std::int64_t kMinCols = 1024, kMaxCols = 4096;

/// What a scan accumulates in. Integers wrap in uint64 (two's complement without signed
/// overflow, whose behaviour C++ leaves undefined); floating follows torch's CPU kernels
/// (at::acc_type): bfloat16 in float, float and double in double, each output rounded once.
template <Element Out>
using acc_t = std::conditional_t<is_floating_v<Out>, std::conditional_t<std::is_same_v<Out, bfloat16>, float, double>,
                                 std::uint64_t>;

/// The tensor as [outer, extent, inner] around `dim` (a 0-d tensor is one element).
struct Geometry {
  std::int64_t outer = 1, extent = 1, inner = 1;
};

inline Geometry geometry(const Shape& s, int dim) {
  Geometry g;
  if (s.rank() == 0) return g;
  g.extent = s[dim];
  for (int d = 0; d < s.rank(); ++d) {
    if (d < dim) g.outer *= s[d];
    if (d > dim) g.inner *= s[d];
  }
  return g;
}

/// Every input has the output's shape and is cut like it; the scanned dim is whole.
inline std::optional<BlockRule> block_rule(const Shape& s, int dim, std::size_t inputs) {
  if (s.rank() == 0) return std::nullopt;  // nothing to split
  BlockRule r = all_but_dim_rule(s.rank(), dim, inputs);
  for (std::size_t i = 1; i < inputs; ++i) r.input_dim[i] = r.input_dim[0];
  return r;
}

/// Runs the units of `g` on the pool: row(o) for each outer row when inner == 1, else
/// cols(scratch, o, c0, c1) for each chunk of inner columns, `scratch` being what
/// make_scratch(width) returned for the task (the running values of a chunk, reused by
/// the task's units). `cost`: per element, for task_count.
template <class MakeScratch, class Row, class Cols>
void for_each_unit(ThreadPool& pool, const Geometry& g, double cost, MakeScratch&& make_scratch, Row&& row,
                   Cols&& cols) {
  const std::int64_t n = g.outer * g.extent * g.inner;
  if (n == 0) return;
  const std::int64_t want = task_count(pool, n, cost);
  if (g.inner == 1) {
    const std::int64_t tasks = std::min(g.outer, want);
    pool.parallel_for(tasks, [&](std::int64_t t) {
      auto [o0, o1] = task_range(g.outer, tasks, t);
      for (std::int64_t o = o0; o < o1; ++o) row(o);
    });
    return;
  }
  // Chunks as wide as the wanted task count allows: the outer indices make units first, and
  // only when there are fewer of them than tasks is inner cut, into kMinCols at least.
  const std::int64_t pieces = (want + g.outer - 1) / g.outer;
  std::int64_t width = ((g.inner + pieces - 1) / pieces + 63) / 64 * 64;
  width = std::min(g.inner, std::clamp(width, kMinCols, kMaxCols));
  const std::int64_t chunks = (g.inner + width - 1) / width, units = g.outer * chunks;
  const std::int64_t tasks = std::min(units, want);
  pool.parallel_for(tasks, [&](std::int64_t t) {
    auto [u0, u1] = task_range(units, tasks, t);
    auto scratch = make_scratch(width);
    for (std::int64_t u = u0; u < u1; ++u) {
      const std::int64_t o = u / chunks, c0 = (u % chunks) * width;
      cols(scratch, o, c0, std::min(g.inner, c0 + width));
    }
  });
}

/// A task's running values: `width` of each of Ts (make_unique<T[]>: no vector<bool>).
template <class... Ts>
auto scratch_arrays(std::int64_t width) {
  return std::tuple<std::unique_ptr<Ts[]>...>{std::make_unique<Ts[]>(static_cast<std::size_t>(width))...};
}

}  // namespace detail::scans

/// The running sum or product of `In` values along `dim`, written as `Out` (forward or,
/// with `reverse`, from the last element back: cumsum's gradient is the reversed cumsum of
/// the output gradient). In is Out, or an integral/bool type widened to an integral Out.
template <Element In, Element Out, ScanOp Op>
class ScanNode final : public Node {
  static_assert(std::is_same_v<In, Out> || (is_integral_v<Out> && !is_floating_v<In>),
                "ScanNode: a floating scan reads its own type; only integers and bool widen");

 public:
  ScanNode(NodePtr in, int dim, bool reverse)
      : Node(NodeKind::Reduction, dtype_of<Out>(), in->shape(), in->device(), {in}), dim_(dim), reverse_(reverse) {}

  std::string op_name() const override {
    return std::string(Op == ScanOp::Sum ? "cumsum" : "cumprod") + (reverse_ ? "_reverse" : "");
  }
  std::string describe() const override { return op_name() + "(%0, dim=" + std::to_string(dim_) + ")"; }
  std::uint64_t structural_hash() const override {
    return hash_combine(hash_combine(Node::structural_hash(), static_cast<std::uint64_t>(dim_)), reverse_ ? 1u : 0u);
  }
  std::optional<BlockRule> block_rule() const override { return detail::scans::block_rule(shape(), dim_, 1); }
  NodePtr with_inputs(NodeList inputs, Shape, Device*) const override {
    return std::make_shared<ScanNode>(std::move(inputs[0]), dim_, reverse_);
  }
  double cost_per_element() const override { return Op == ScanOp::Prod && is_integral_v<Out> ? 3 : 1.5; }

 protected:
  void compute(ExecContext& ctx) override {
    const In* x = inputs()[0]->template data<In>();
    // Each element is read before its output is written, at the same position: an input
    // buffer nothing else holds can take the result in place.
    auto buf = allocate_output(ctx, true);
    Out* y = static_cast<Out*>(buf->data());
    const auto g = detail::scans::geometry(shape(), dim_);
    const std::int64_t n = g.extent, inner = g.inner;
    const bool rev = reverse_;
    detail::scans::for_each_unit(
        ctx.device.threads(), g, cost_per_element(), detail::scans::scratch_arrays<A>,
        [&](std::int64_t o) {
          const In* xr = x + o * n;
          Out* yr = y + o * n;
          A acc = identity();
          if (!rev) {
            for (std::int64_t i = 0; i < n; ++i) yr[i] = store(acc = combine(acc, load(xr[i])));
          } else {
            for (std::int64_t i = n - 1; i >= 0; --i) yr[i] = store(acc = combine(acc, load(xr[i])));
          }
        },
        [&](auto& scratch, std::int64_t o, std::int64_t c0, std::int64_t c1) {
          A* acc = std::get<0>(scratch).get();
          const std::int64_t w = c1 - c0;
          std::fill(acc, acc + w, identity());
          for (std::int64_t k = 0; k < n; ++k) {
            const std::int64_t j = rev ? n - 1 - k : k;
            const In* xr = x + (o * n + j) * inner + c0;
            Out* yr = y + (o * n + j) * inner + c0;
            for (std::int64_t c = 0; c < w; ++c) yr[c] = store(acc[c] = combine(acc[c], load(xr[c])));
          }
        });
    set_buffer(std::move(buf));
  }

 private:
  using A = detail::scans::acc_t<Out>;
  static A identity() { return Op == ScanOp::Sum ? A(0) : A(1); }
  static A combine(A acc, A v) {
    if constexpr (Op == ScanOp::Sum) return acc + v;
    else return acc * v;
  }
  static A load(In v) {
    // Through int64 so that a negative int32 sign-extends before it becomes unsigned.
    if constexpr (std::is_same_v<A, std::uint64_t>) return static_cast<std::uint64_t>(static_cast<std::int64_t>(v));
    else return static_cast<A>(v);
  }
  static Out store(A a) {
    // uint64 -> int64 -> int32 are modular conversions since C++20: the two's complement wrap.
    if constexpr (std::is_same_v<A, std::uint64_t>) return static_cast<Out>(static_cast<std::int64_t>(a));
    else if constexpr (std::is_same_v<Out, bfloat16>) return bfloat16(a);  // float -> bf16: one rounding
    else return static_cast<Out>(a);
  }

  int dim_;
  bool reverse_;
};

/// cummax (IsMax) or cummin along `dim`, as torch computes it: the running extreme and the
/// position it came from, where an element equal to the extreme takes over (ties report the
/// later index) and a NaN always takes over (so the value stays NaN from the first NaN on,
/// and the index is the latest NaN's). `Indices`: this node's output is the int64 index
/// tensor; else the values (dtype T). The two are separate nodes scanning the same input
/// with the same rule, so they always agree.
template <Element T, bool IsMax, bool Indices>
class CumExtremeNode final : public Node {
 public:
  CumExtremeNode(NodePtr in, int dim)
      : Node(NodeKind::Reduction, Indices ? DType::Int64 : dtype_of<T>(), in->shape(), in->device(), {in}),
        dim_(dim) {}

  std::string op_name() const override {
    return std::string(IsMax ? "cummax" : "cummin") + (Indices ? "_indices" : "_values");
  }
  std::string describe() const override { return op_name() + "(%0, dim=" + std::to_string(dim_) + ")"; }
  std::uint64_t structural_hash() const override {
    return hash_combine(Node::structural_hash(), static_cast<std::uint64_t>(dim_));
  }
  std::optional<BlockRule> block_rule() const override { return detail::scans::block_rule(shape(), dim_, 1); }
  NodePtr with_inputs(NodeList inputs, Shape, Device*) const override {
    return std::make_shared<CumExtremeNode>(std::move(inputs[0]), dim_);
  }
  double cost_per_element() const override { return 2; }

 protected:
  void compute(ExecContext& ctx) override {
    using R = std::conditional_t<Indices, std::int64_t, T>;
    const T* x = inputs()[0]->template data<T>();
    // Read-before-write at each position, the running extreme kept in locals: safe in place.
    auto buf = allocate_output(ctx, true);
    R* y = static_cast<R*>(buf->data());
    const auto g = detail::scans::geometry(shape(), dim_);
    const std::int64_t n = g.extent, inner = g.inner;
    detail::scans::for_each_unit(
        ctx.device.threads(), g, cost_per_element(), detail::scans::scratch_arrays<T, std::int64_t>,
        [&](std::int64_t o) {
          const T* xr = x + o * n;
          R* yr = y + o * n;
          T best = xr[0];
          std::int64_t at = 0;
          for (std::int64_t i = 0; i < n; ++i) {
            const T v = xr[i];
            if (takes_over(v, best)) best = v, at = i;
            if constexpr (Indices) yr[i] = at;
            else yr[i] = best;
          }
        },
        [&](auto& scratch, std::int64_t o, std::int64_t c0, std::int64_t c1) {
          T* best = std::get<0>(scratch).get();
          std::int64_t* at = std::get<1>(scratch).get();
          const std::int64_t w = c1 - c0;
          std::copy(x + o * n * inner + c0, x + o * n * inner + c1, best);
          std::fill(at, at + w, std::int64_t{0});
          for (std::int64_t j = 0; j < n; ++j) {
            const T* xr = x + (o * n + j) * inner + c0;
            R* yr = y + (o * n + j) * inner + c0;
            for (std::int64_t c = 0; c < w; ++c) {
              const T v = xr[c];
              const bool take = takes_over(v, best[c]);  // selects, not branches: the loop vectorizes
              best[c] = take ? v : best[c];
              at[c] = take ? j : at[c];
              if constexpr (Indices) yr[c] = at[c];
              else yr[c] = best[c];
            }
          }
        });
    set_buffer(std::move(buf));
  }

 private:
  /// torch's rule: isnan(v) || (!isnan(best) && v >= best) for max (<= for min).
  static bool takes_over(T v, T best) {
    using C = compute_t<T>;
    const C a = static_cast<C>(v), b = static_cast<C>(best);
    const bool better = IsMax ? a >= b : a <= b;
    if constexpr (is_floating_v<T>) return (a != a) | ((b == b) & better);
    else return better;
  }

  int dim_;
};

/// The gradient of cumprod along `dim` from the input x and the output gradient g, exact
/// when x holds zeros (no division by x). Per row, with P(i-1) the product of x before i
/// (1 for i = 0) and S(i) = g(i) + x(i+1) S(i+1) (S(n-1) = g(n-1)): dx(i) = P(i-1) S(i).
/// That is sum over k >= i of g(k) times the product of x(m) for m <= k, m != i, written
/// as one backward scan (S, kept in the output buffer, rounded to T once) and one forward
/// scan (P), both accumulating in the forward scan's type.
template <FloatingElement T>
class CumprodBackwardNode final : public Node {
 public:
  CumprodBackwardNode(NodePtr x, NodePtr g, int dim)
      : Node(NodeKind::Reduction, dtype_of<T>(), x->shape(), x->device(), {x, g}), dim_(dim) {}

  std::string op_name() const override { return "cumprod_backward"; }
  std::string describe() const override { return "cumprod_backward(%0, %1, dim=" + std::to_string(dim_) + ")"; }
  std::uint64_t structural_hash() const override {
    return hash_combine(Node::structural_hash(), static_cast<std::uint64_t>(dim_));
  }
  std::optional<BlockRule> block_rule() const override { return detail::scans::block_rule(shape(), dim_, 2); }
  NodePtr with_inputs(NodeList inputs, Shape, Device*) const override {
    return std::make_shared<CumprodBackwardNode>(std::move(inputs[0]), std::move(inputs[1]), dim_);
  }
  double cost_per_element() const override { return 4; }

 protected:
  void compute(ExecContext& ctx) override {
    using A = detail::scans::acc_t<T>;
    const T* x = inputs()[0]->template data<T>();
    const T* gr = inputs()[1]->template data<T>();
    // No donation: the backward pass writes S(i) where a donated x would still be read as
    // x(i) by the pass's next step and by the forward pass.
    auto buf = allocate_output(ctx, false);
    T* y = static_cast<T*>(buf->data());
    const auto g = detail::scans::geometry(shape(), dim_);
    const std::int64_t n = g.extent, inner = g.inner;
    detail::scans::for_each_unit(
        ctx.device.threads(), g, cost_per_element(), detail::scans::scratch_arrays<A>,
        [&](std::int64_t o) {
          const T* xr = x + o * n;
          const T* grow = gr + o * n;
          T* yr = y + o * n;
          A s = static_cast<A>(grow[n - 1]);
          yr[n - 1] = static_cast<T>(s);
          for (std::int64_t i = n - 2; i >= 0; --i) {
            s = static_cast<A>(grow[i]) + static_cast<A>(xr[i + 1]) * s;
            yr[i] = static_cast<T>(s);
          }
          A p = 1;
          for (std::int64_t i = 0; i < n; ++i) {
            yr[i] = static_cast<T>(p * static_cast<A>(yr[i]));
            p *= static_cast<A>(xr[i]);
          }
        },
        [&](auto& scratch, std::int64_t o, std::int64_t c0, std::int64_t c1) {
          A* acc = std::get<0>(scratch).get();
          const std::int64_t w = c1 - c0;
          auto at = [&](std::int64_t j) { return (o * n + j) * inner + c0; };
          for (std::int64_t c = 0; c < w; ++c) {
            acc[c] = static_cast<A>(gr[at(n - 1) + c]);
            y[at(n - 1) + c] = static_cast<T>(acc[c]);
          }
          for (std::int64_t j = n - 2; j >= 0; --j) {
            const T* xr = x + at(j + 1);
            const T* grow = gr + at(j);
            T* yr = y + at(j);
            for (std::int64_t c = 0; c < w; ++c) {
              acc[c] = static_cast<A>(grow[c]) + static_cast<A>(xr[c]) * acc[c];
              yr[c] = static_cast<T>(acc[c]);
            }
          }
          std::fill(acc, acc + w, A(1));
          for (std::int64_t j = 0; j < n; ++j) {
            const T* xr = x + at(j);
            T* yr = y + at(j);
            for (std::int64_t c = 0; c < w; ++c) {
              yr[c] = static_cast<T>(acc[c] * static_cast<A>(yr[c]));
              acc[c] *= static_cast<A>(xr[c]);
            }
          }
        });
    set_buffer(std::move(buf));
  }

 private:
  int dim_;
};

}  // namespace lazy::graph
