#pragma once
// Kernels that only backward passes need: the adjoints of slicing, index_select and gather
// (write or add a gradient into a zero tensor of the input's shape). Accumulation order is
// fixed (by index position), and work is split only where no two tasks touch the same
// output element, so results do not depend on the thread count.

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <lazytensor/graph/device.hpp>
#include <lazytensor/graph/parallel.hpp>

namespace lazy::graph {

/// The gradient of a slice: zeros of the input's shape with `g` at the sliced positions.
template <Element T>
class SliceBackwardNode final : public Node {
 public:
  SliceBackwardNode(NodePtr g, Shape in_shape, int dim, std::int64_t start, std::int64_t step)
      : Node(NodeKind::Copy, dtype_of<T>(), in_shape, g->device(), {g}), dim_(dim), start_(start), step_(step) {}
  std::string op_name() const override { return "slice_backward"; }
  std::uint64_t structural_hash() const override {
    return hash_combine(hash_combine(hash_combine(Node::structural_hash(), static_cast<std::uint64_t>(dim_)),
                                     static_cast<std::uint64_t>(start_)),
                        static_cast<std::uint64_t>(step_));
  }
  /// Blocks along every dimension but the sliced one (lazy::spmd), as the slice's.
  std::optional<BlockRule> block_rule() const override {
    if (dim_ >= shape().rank()) return std::nullopt;
    return all_but_dim_rule(shape().rank(), dim_, 1);
  }
  NodePtr with_inputs(NodeList inputs, Shape shape, Device*) const override {
    return std::make_shared<SliceBackwardNode>(std::move(inputs[0]), std::move(shape), dim_, start_, step_);
  }

 protected:
  void compute(ExecContext& ctx) override {
    const T* g = inputs()[0]->template data<T>();
    const Shape& gs = inputs()[0]->shape();
    auto buf = allocate_output(ctx, false);
    T* out = static_cast<T*>(buf->data());
    const Shape& s = shape();
    std::int64_t outer = 1, inner = 1;
    for (int d = 0; d < dim_; ++d) outer *= s[d];
    for (int d = dim_ + 1; d < s.rank(); ++d) inner *= s[d];
    const std::int64_t dsize = s[dim_], len = gs[dim_];
    auto& pool = ctx.device.threads();
    const std::int64_t tasks = std::max<std::int64_t>(1, std::min(outer, task_count(pool, numel(), 1.0)));
    pool.parallel_for(tasks, [&](std::int64_t t) {
      auto [o0, o1] = task_range(outer, tasks, t);
      for (std::int64_t o = o0; o < o1; ++o) {
        T* row = out + o * dsize * inner;
        std::fill(row, row + dsize * inner, T(0));
        for (std::int64_t k = 0; k < len; ++k) {
          std::memcpy(row + (start_ + k * step_) * inner, g + (o * len + k) * inner,
                      static_cast<std::size_t>(inner) * sizeof(T));
        }
      }
    });
    set_buffer(std::move(buf));
  }

 private:
  int dim_;
  std::int64_t start_, step_;
};

/// index_add into zeros: out[.., index[k], ..] += g[.., k, ..] along `dim` (the gradient of
/// index_select; embeddings). Tasks split the (outer, inner) plane, each adding over k in
/// order.
template <Element T, IndexElement I>
class IndexAddNode final : public Node {
 public:
  /// `op` names the public op in an IndexError ("index_add" for index_select's backward).
  IndexAddNode(NodePtr g, NodePtr index, Shape in_shape, int dim, const char* op = "index_add")
      : Node(NodeKind::Copy, dtype_of<T>(), in_shape, g->device(), {g, index}), dim_(dim), op_(op) {}
  std::string op_name() const override { return "index_add"; }
  std::uint64_t structural_hash() const override {
    return hash_combine(Node::structural_hash(), static_cast<std::uint64_t>(dim_));
  }
  /// Blocks along every dimension but the indexed one; the index is read whole.
  std::optional<BlockRule> block_rule() const override {
    if (dim_ >= shape().rank()) return std::nullopt;
    return all_but_dim_rule(shape().rank(), dim_, 2);
  }
  NodePtr with_inputs(NodeList inputs, Shape shape, Device*) const override {
    return std::make_shared<IndexAddNode>(std::move(inputs[0]), std::move(inputs[1]), std::move(shape), dim_, op_);
  }

 protected:
  void compute(ExecContext& ctx) override {
    const T* g = inputs()[0]->template data<T>();
    const I* idx = inputs()[1]->template data<I>();
    const std::int64_t K = inputs()[1]->numel();
    auto buf = allocate_output(ctx, false);
    T* out = static_cast<T*>(buf->data());
    const Shape& s = shape();
    std::int64_t outer = 1, inner = 1;
    for (int d = 0; d < dim_; ++d) outer *= s[d];
    for (int d = dim_ + 1; d < s.rank(); ++d) inner *= s[d];
    const std::int64_t dsize = s.rank() ? s[dim_] : 1;
    for (std::int64_t k = 0; k < K; ++k) {
      if (idx[k] < 0 || idx[k] >= dsize) {
        throw IndexError(std::string(op_) + ": index " + std::to_string(idx[k]) + " is out of range for dimension " +
                         std::to_string(dim_) + " with size " + std::to_string(dsize) + " (expected 0 <= index < " +
                         std::to_string(dsize) + ")");
      }
    }
    using C = compute_t<T>;
    constexpr std::int64_t kCols = 256;
    const std::int64_t chunks = (inner + kCols - 1) / kCols, units = outer * chunks;
    auto& pool = ctx.device.threads();
    const std::int64_t tasks = std::max<std::int64_t>(1, std::min(units, task_count(pool, numel() + K * inner, 1.0)));
    pool.parallel_for(tasks, [&](std::int64_t t) {
      auto [u0, u1] = task_range(units, tasks, t);
      for (std::int64_t u = u0; u < u1; ++u) {
        const std::int64_t o = u / chunks, j0 = (u % chunks) * kCols, j1 = std::min(inner, j0 + kCols);
        T* base = out + o * dsize * inner;
        for (std::int64_t r = 0; r < dsize; ++r) std::fill(base + r * inner + j0, base + r * inner + j1, T(0));
        for (std::int64_t k = 0; k < K; ++k) {
          T* dst = base + static_cast<std::int64_t>(idx[k]) * inner;
          const T* src = g + (o * K + k) * inner;
          for (std::int64_t j = j0; j < j1; ++j) dst[j] = static_cast<T>(static_cast<C>(dst[j]) + static_cast<C>(src[j]));
        }
      }
    });
    set_buffer(std::move(buf));
  }

 private:
  int dim_;
  const char* op_;
};

namespace detail {

/// Calls f(p, s, t) for the flat positions p in [p0, p1) of an index of shape `xs`, in
/// order: s is p's offset in a source of strides `sst`, t its offset in a target of
/// strides `tst` without coordinate `dim` (which the index's value supplies). Offsets move
/// with an odometer: one division per dimension per call, not per position.
template <class F>
void walk_index_range(const Shape& xs, int dim, const std::array<std::int64_t, kMaxRank>& sst,
                      const std::array<std::int64_t, kMaxRank>& tst, std::int64_t p0, std::int64_t p1, F&& f) {
  if (p0 >= p1) return;
  const int R = xs.rank();
  const auto xst = contiguous_strides(xs);
  std::int64_t c[kMaxRank] = {}, rem = p0, s = 0, t = 0;
  for (int d = 0; d < R; ++d) {
    c[d] = rem / xst[d];
    rem %= xst[d];
    s += c[d] * sst[d];
    if (d != dim) t += c[d] * tst[d];
  }
  for (std::int64_t p = p0; p < p1; ++p) {
    f(p, s, t);
    for (int d = R - 1; d >= 0; --d) {  // the odometer's carry
      if (++c[d] < xs[d]) {
        s += sst[d];
        if (d != dim) t += tst[d];
        break;
      }
      s -= (xs[d] - 1) * sst[d];
      if (d != dim) t -= (xs[d] - 1) * tst[d];
      c[d] = 0;
    }
  }
}

/// How many groups walk_index_part may split an index of shape `xs` (rank >= 1, no empty
/// dimension) into: the size of dimension 0, or of 1 when `dim` is 0 (1 for a 1-D index).
inline std::int64_t index_parts(const Shape& xs, int dim) {
  if (dim != 0) return xs[0];
  return xs.rank() > 1 ? xs[1] : 1;
}

/// Group `q` of `parts` (at most index_parts) of an index's positions, walked in order by
/// walk_index_range: a range of coordinates along the dimension index_parts counts. Two
/// groups never write the same target, since their positions differ outside `dim`.
template <class F>
void walk_index_part(const Shape& xs, int dim, const std::array<std::int64_t, kMaxRank>& sst,
                     const std::array<std::int64_t, kMaxRank>& tst, std::int64_t parts, std::int64_t q, F&& f) {
  const int split = dim != 0 ? 0 : (xs.rank() > 1 ? 1 : -1);
  if (split < 0) {
    if (q == 0) walk_index_range(xs, dim, sst, tst, 0, xs.numel(), f);
    return;
  }
  const auto [c0, c1] = task_range(xs[split], parts, q);
  std::int64_t inner = 1;  // positions per coordinate of `split`
  for (int d = split + 1; d < xs.rank(); ++d) inner *= xs[d];
  if (split == 0) {
    walk_index_range(xs, dim, sst, tst, c0 * inner, c1 * inner, f);
  } else {
    const std::int64_t row = xs[1] * inner;
    for (std::int64_t r = 0; r < xs[0]; ++r) {
      walk_index_range(xs, dim, sst, tst, r * row + c0 * inner, r * row + c1 * inner, f);
    }
  }
}

}  // namespace detail

/// scatter_add into zeros: out[.., index[p], ..] += g[p] along `dim` for every position p of
/// the index (the gradient of gather). Positions that differ outside `dim` never collide,
/// so tasks split the index's dimension 0 (1 when `dim` is 0), each walking its positions
/// in order.
template <Element T, IndexElement I>
class ScatterAddNode final : public Node {
 public:
  ScatterAddNode(NodePtr g, NodePtr index, Shape in_shape, int dim)
      : Node(NodeKind::Copy, dtype_of<T>(), in_shape, g->device(), {g, index}), dim_(dim) {}
  std::string op_name() const override { return "scatter_add"; }
  std::uint64_t structural_hash() const override {
    return hash_combine(Node::structural_hash(), static_cast<std::uint64_t>(dim_));
  }
  /// Blocks along the dimensions other than `dim` where the index spans the whole output
  /// (the gradient and the index cut alike), as gather's.
  std::optional<BlockRule> block_rule() const override {
    return same_size_but_dim_rule(shape(), inputs()[1]->shape(), dim_);
  }
  NodePtr with_inputs(NodeList inputs, Shape shape, Device*) const override {
    return std::make_shared<ScatterAddNode>(std::move(inputs[0]), std::move(inputs[1]), std::move(shape), dim_);
  }

 protected:
  void compute(ExecContext& ctx) override {
    const T* g = inputs()[0]->template data<T>();
    const I* idx = inputs()[1]->template data<I>();
    Shape xs = inputs()[1]->shape(), ts = shape();
    if (xs.rank() == 0) xs = Shape{1};
    if (ts.rank() == 0) ts = Shape{1};
    auto buf = allocate_output(ctx, false);
    T* out = static_cast<T*>(buf->data());
    std::fill(out, out + numel(), T(0));
    const std::int64_t n = xs.numel(), dsize = ts[dim_];
    if (n > 0) {
      const auto xst = contiguous_strides(xs), tst = contiguous_strides(ts);
      auto& pool = ctx.device.threads();
      const std::int64_t parts = detail::index_parts(xs, dim_);
      const std::int64_t tasks = std::max<std::int64_t>(1, std::min(parts, task_count(pool, n, 2.0)));
      using C = compute_t<T>;
      pool.parallel_for(tasks, [&](std::int64_t t) {
        detail::walk_index_part(xs, dim_, xst, tst, tasks, t, [&](std::int64_t p, std::int64_t, std::int64_t at) {
          const auto k = static_cast<std::int64_t>(idx[p]);
          if (k < 0 || k >= dsize) {
            throw IndexError("scatter_add: index " + std::to_string(k) + " is out of bounds for dimension " +
                             std::to_string(dim_) + " with size " + std::to_string(dsize) + " (expected 0 <= index < " +
                             std::to_string(dsize) + ")");
          }
          T& dst = out[at + k * tst[dim_]];
          dst = static_cast<T>(static_cast<C>(dst) + static_cast<C>(g[p]));
        });
      });
    }
    set_buffer(std::move(buf));
  }

 private:
  int dim_;
};

}  // namespace lazy::graph
