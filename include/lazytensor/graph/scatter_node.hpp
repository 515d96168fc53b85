#pragma once
// torch.scatter and scatter_reduce in one kernel: a copy of `self` into which every
// position p of `index` writes or combines src[p] at the same coordinates, with
// index[p] in place of coordinate `dim`. Positions are visited in index order, so the
// result is deterministic (duplicates: the last write wins; sums add in index order) and
// does not depend on the thread count: tasks split the index's dimension 0 (1 when `dim`
// is 0), and positions with different coordinates there never collide.

#include <algorithm>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <lazytensor/expr/reduce_ops.hpp>
#include <lazytensor/graph/device.hpp>
#include <lazytensor/graph/parallel.hpp>
#include <lazytensor/graph/shape_backward.hpp>

namespace lazy::graph {

/// How scattered values meet the ones already there (scatter_reduce's `reduce`; `assign`
/// is plain scatter).
enum class ScatterMode { assign, sum, prod, mean, amax, amin };

/// The name torch gives the mode ("sum", "prod", "mean", "amax", "amin"; "assign").
inline const char* scatter_mode_name(ScatterMode m) {
  switch (m) {
    case ScatterMode::assign:
      return "assign";
    case ScatterMode::sum:
      return "sum";
    case ScatterMode::prod:
      return "prod";
    case ScatterMode::mean:
      return "mean";
    case ScatterMode::amax:
      return "amax";
    case ScatterMode::amin:
      return "amin";
  }
  return "?";
}

/// Inputs: self (the output's shape), index (IndexElement, self's rank, each size at most
/// self's outside `dim`), src (at least index's size in every dimension; read at index's
/// coordinates). `include_self = false` makes a target's first scattered value replace
/// self's instead of combining with it (scatter_reduce's include_self).
template <Element T, IndexElement I>
class ScatterNode final : public Node {
 public:
  ScatterNode(NodePtr self, NodePtr index, NodePtr src, int dim, ScatterMode mode,
              bool include_self)
      : Node(NodeKind::Copy, self->dtype(), self->shape(), self->device(), {self, index, src}),
        dim_(dim),
        mode_(mode),
        include_self_(include_self) {}

  std::string op_name() const override {
    return mode_ == ScatterMode::assign ? "scatter" : "scatter_reduce";
  }
  std::string describe() const override {
    return op_name() + "(%0, dim=" + std::to_string(dim_) +
           ", %1, %2, reduce=" + scatter_mode_name(mode_) +
           (include_self_ ? ")" : ", include_self=false)");
  }
  std::uint64_t structural_hash() const override {
    std::uint64_t h = hash_combine(Node::structural_hash(), static_cast<std::uint64_t>(dim_));
    h = hash_combine(h, static_cast<std::uint64_t>(mode_));
    return hash_combine(h, include_self_ ? 1u : 0u);
  }
  /// Blocks along the dimensions other than `dim` where index and src span the whole
  /// output: there the three inputs cut alike.
  std::optional<BlockRule> block_rule() const override {
    const Shape& out = shape();
    const Shape& is = inputs()[1]->shape();
    const Shape& ss = inputs()[2]->shape();
    const int rank = out.rank();
    BlockRule r{
        std::vector<bool>(static_cast<std::size_t>(rank), false),
        std::vector<std::vector<int>>(3, std::vector<int>(static_cast<std::size_t>(rank), -1))};
    for (int o = 0; o < rank; ++o) {
      if (o == dim_ || is.rank() != rank || is[o] != out[o] || ss[o] != out[o]) continue;
      const auto u = static_cast<std::size_t>(o);
      r.splittable[u] = true;
      r.input_dim[0][u] = r.input_dim[1][u] = r.input_dim[2][u] = o;
    }
    return r;
  }
  NodePtr with_inputs(NodeList inputs, Shape, Device*) const override {
    return std::make_shared<ScatterNode>(std::move(inputs[0]), std::move(inputs[1]),
                                         std::move(inputs[2]), dim_, mode_, include_self_);
  }
  double cost_per_element() const override { return 2; }

 protected:
  void compute(ExecContext& ctx) override {
    const NodePtr& self = inputs()[0];
    check_index();  // before self's buffer may be taken: a failure leaves it intact
    // Self's buffer only when neither src nor the index is self's node too (scatter(x, d,
    // i, x)): both are read while the output is written.
    std::shared_ptr<Buffer> buf;
    if (inputs()[1] != self && inputs()[2] != self) buf = try_donate(0);
    if (!buf) {
      buf = allocate_output(ctx, false);
      std::copy_n(self->template data<T>(), numel(), static_cast<T*>(buf->data()));
    }
    T* out = static_cast<T*>(buf->data());
    const I* idx = inputs()[1]->template data<I>();
    const T* src = inputs()[2]->template data<T>();
    Shape xs = inputs()[1]->shape(), ts = shape(), ss = inputs()[2]->shape();
    if (xs.rank() == 0) xs = Shape{1};
    if (ts.rank() == 0) ts = Shape{1};
    if (ss.rank() == 0) ss = Shape{1};
    const std::int64_t n = xs.numel();
    if (n == 0) {
      set_buffer(std::move(buf));
      return;
    }
    const auto tst = contiguous_strides(ts), sst = contiguous_strides(ss);
    // Targets reached so far (include_self = false, mean's counts): one per output element.
    const bool counting =
        mode_ == ScatterMode::mean || (!include_self_ && mode_ != ScatterMode::assign);
    std::vector<std::int64_t> count(counting ? static_cast<std::size_t>(numel()) : 0, 0);
    // Tasks take whole slices of the index's dimension 0 (1 when `dim` is 0): positions in
    // different slices never share a target.
    auto& pool = ctx.device.threads();
    const std::int64_t parts = detail::index_parts(xs, dim_);
    const std::int64_t tasks = std::max<std::int64_t>(1, std::min(parts, task_count(pool, n, 2.0)));
    pool.parallel_for(tasks, [&](std::int64_t t) {
      detail::walk_index_part(
          xs, dim_, sst, tst, tasks, t,
          [&](std::int64_t p, std::int64_t s_off, std::int64_t t_off) {
            const std::int64_t at = t_off + static_cast<std::int64_t>(idx[p]) * tst[dim_];
            combine(out[at], src[s_off], counting ? &count[static_cast<std::size_t>(at)] : nullptr);
          });
    });
    if (mode_ == ScatterMode::mean) finish_mean(out, count);
    set_buffer(std::move(buf));
  }

 private:
  using C = compute_t<T>;

  // Index values outside [0, size of dim) raise IndexError.
  void check_index() const {
    const NodePtr& index = inputs()[1];
    const I* idx = index->template data<I>();
    const std::int64_t dsize = shape().rank() == 0 ? 1 : shape()[dim_];
    for (std::int64_t p = 0; p < index->numel(); ++p) {
      const auto k = static_cast<std::int64_t>(idx[p]);
      if (k < 0 || k >= dsize) {
        throw IndexError(op_name() + ": index " + std::to_string(k) +
                         " is out of bounds for dimension " + std::to_string(dim_) + " with size " +
                         std::to_string(dsize) + " (expected 0 <= index < " +
                         std::to_string(dsize) + ")");
      }
    }
  }

  // One scattered value meets its target. `seen` counts the values the target got so far
  // (null when neither mean nor include_self = false needs it).
  void combine(T& dst, T v, std::int64_t* seen) const {
    if (mode_ == ScatterMode::assign) {
      dst = v;
      return;
    }
    if (seen && (*seen)++ == 0 && !include_self_) {
      // The first value replaces self's; a sum starts from 0 as torch's does (-0 + 0 = +0).
      dst = mode_ == ScatterMode::sum || mode_ == ScatterMode::mean ? static_cast<T>(wrap_add(C(0), static_cast<C>(v)))
                                                                    : v;
      return;
    }
    const C a = static_cast<C>(dst), b = static_cast<C>(v);
    switch (mode_) {
      case ScatterMode::sum:
      case ScatterMode::mean:
        dst = static_cast<T>(wrap_add(a, b));
        break;
      case ScatterMode::prod:
        dst = static_cast<T>(wrap_mul(a, b));
        break;
      case ScatterMode::amax:
        dst = static_cast<T>(is_nan(a) || a > b ? a : (is_nan(b) || b > a ? b : a));
        break;
      case ScatterMode::amin:
        dst = static_cast<T>(is_nan(a) || a < b ? a : (is_nan(b) || b < a ? b : a));
        break;
      case ScatterMode::assign:
        break;
    }
  }

  // mean: the sum over (count + self) values, self counted unless include_self = false.
  // Integers divide with floor, as torch's scatter_reduce does.
  void finish_mean(T* out, const std::vector<std::int64_t>& count) const {
    for (std::size_t i = 0; i < count.size(); ++i) {
      const std::int64_t m = count[i] + (include_self_ ? 1 : 0);
      if (count[i] == 0 || m <= 1) continue;
      if constexpr (std::is_integral_v<C>) {  // (bool never gets here: scatter_reduce refuses its mean)
        const auto s = static_cast<std::int64_t>(out[i]);
        const std::int64_t q = s / m;
        out[i] = static_cast<T>(q * m != s && (s < 0) != (m < 0) ? q - 1 : q);
      } else {
        out[i] = static_cast<T>(static_cast<C>(out[i]) / static_cast<C>(m));
      }
    }
  }

  static bool is_nan(C v) { return v != v; }  // false for integers
  // Integer sums and products wrap (two's complement) and bool ones are or / and, as the
  // reductions' are.
  static C wrap_add(C a, C b) { return ops::reduce::detail::wrapping_add(a, b); }
  static C wrap_mul(C a, C b) { return ops::reduce::detail::wrapping_mul(a, b); }

  int dim_;
  ScatterMode mode_;
  bool include_self_;
};

}  // namespace lazy::graph
