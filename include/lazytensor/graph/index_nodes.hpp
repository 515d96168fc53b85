#pragma once
// The runtime nodes that copy by index: index_select, gather and one_hot (ops/indexing.hpp).
// Like the shape nodes they copy bytes with one kernel per element size. Index values may
// live in tensors that are still pending, so they are checked inside the kernel, which
// throws lazy::IndexError out of the mark_step or read that ran it.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <lazytensor/core/dtype.hpp>
#include <lazytensor/core/error.hpp>
#include <lazytensor/core/shape.hpp>
#include <lazytensor/graph/byte_copy.hpp>
#include <lazytensor/graph/device.hpp>
#include <lazytensor/graph/node.hpp>
#include <lazytensor/graph/parallel.hpp>

namespace lazy::graph {

/// out[.., k, ..] = in[.., index[k], ..] along `dim` (index 1-D, values checked here).
template <IndexElement I>
class IndexSelectNode final : public Node {
 public:
  IndexSelectNode(NodePtr in, NodePtr index, int dim, Shape out)
      : Node(NodeKind::Copy, in->dtype(), out, in->device(), {in, index}), dim_(dim) {}

  std::string op_name() const override { return "index_select"; }
  std::string describe() const override { return "index_select(%0, dim=" + std::to_string(dim_) + ", %1)"; }
  std::uint64_t structural_hash() const override {
    return hash_combine(Node::structural_hash(), static_cast<std::uint64_t>(dim_));
  }
  /// Blocks along every dimension but the indexed one; the index is read whole.
  std::optional<BlockRule> block_rule() const override {
    if (dim_ >= shape().rank()) return std::nullopt;  // a 0-d input: nothing to split
    return all_but_dim_rule(shape().rank(), dim_, 2);
  }
  NodePtr with_inputs(NodeList inputs, Shape shape, Device*) const override {
    return std::make_shared<IndexSelectNode>(std::move(inputs[0]), std::move(inputs[1]), dim_, std::move(shape));
  }

 protected:
  void compute(ExecContext& ctx) override {
    const Shape& is = inputs()[0]->shape();
    const std::byte* src = detail::bytes_of(inputs()[0]);
    const I* idx = inputs()[1]->template data<I>();
    const std::int64_t K = inputs()[1]->numel();
    std::int64_t outer = 1, inner = 1;
    const std::int64_t dsize = is.rank() ? is[dim_] : 1;
    for (int d = 0; d < dim_; ++d) outer *= is[d];
    for (int d = dim_ + 1; d < is.rank(); ++d) inner *= is[d];
    // Check every index before writing anything: K values, cheap next to the copy.
    for (std::int64_t k = 0; k < K; ++k) {
      if (idx[k] < 0 || idx[k] >= dsize) {
        throw IndexError("index_select: index " + std::to_string(idx[k]) + " (position " + std::to_string(k) +
                         ") is out of range for dimension " + std::to_string(dim_) + " with size " +
                         std::to_string(dsize) + " (expected 0 <= index < " + std::to_string(dsize) + ")");
      }
    }
    auto buf = allocate_output(ctx, false);
    auto* dst = static_cast<std::byte*>(buf->data());
    detail::with_elem_size(dtype_size(dtype()), [&](auto nb) {
      constexpr std::size_t N = decltype(nb)::value;
      detail::copy_segments<N>(ctx.device.threads(), dst, src, outer * K, inner, [&](std::int64_t s) {
        return ((s / K) * dsize + static_cast<std::int64_t>(idx[s % K])) * inner;
      });
    });
    set_buffer(std::move(buf));
  }

 private:
  int dim_;
};

/// torch.gather: out[i][j][k] = in[index[i][j][k]][j][k] for dim 0 (likewise for others);
/// the output has the index's shape, index values are checked while they are read.
template <IndexElement I>
class GatherNode final : public Node {
 public:
  GatherNode(NodePtr in, NodePtr index, int dim)
      : Node(NodeKind::Copy, in->dtype(), index->shape(), in->device(), {in, index}), dim_(dim) {}

  std::string op_name() const override { return "gather"; }
  std::string describe() const override { return "gather(%0, dim=" + std::to_string(dim_) + ", %1)"; }

  /// Blocks along the other dimensions where input and index have the same size.
  std::optional<BlockRule> block_rule() const override {
    return same_size_but_dim_rule(shape(), inputs()[0]->shape(), dim_);
  }
  NodePtr with_inputs(NodeList inputs, Shape, Device*) const override {
    return std::make_shared<GatherNode>(std::move(inputs[0]), std::move(inputs[1]), dim_);
  }
  double cost_per_element() const override { return 2; }
  std::uint64_t structural_hash() const override {
    return hash_combine(Node::structural_hash(), static_cast<std::uint64_t>(dim_));
  }

 protected:
  void compute(ExecContext& ctx) override {
    // A 0-d tensor is handled as a 1-D tensor of one element.
    Shape ts = inputs()[0]->shape(), xs = shape();
    if (ts.rank() == 0) ts = Shape{1};
    if (xs.rank() == 0) xs = Shape{1};
    const std::byte* src = detail::bytes_of(inputs()[0]);
    const I* idx = inputs()[1]->template data<I>();
    auto buf = allocate_output(ctx, false);
    auto* dst = static_cast<std::byte*>(buf->data());
    const int R = xs.rank(), dim = dim_;
    const std::int64_t n = numel(), last = xs[R - 1], dsize = ts[dim];
    if (n > 0) {
      const auto tst = contiguous_strides(ts), xst = contiguous_strides(xs);
      detail::Odometer od;  // a: input offset without `dim`; b: index offset
      od.rank = R - 1;
      for (int d = 0; d + 1 < R; ++d) {
        od.size[d] = xs[d];
        od.stride_a[d] = d == dim ? 0 : tst[d];
        od.stride_b[d] = xst[d];
      }
      const std::int64_t dstride = tst[dim], rows = n / last;
      auto& pool = ctx.device.threads();
      const std::int64_t tasks = std::min(rows, task_count(pool, n, 2.0));
      detail::with_elem_size(dtype_size(dtype()), [&](auto nb) {
        constexpr std::size_t N = decltype(nb)::value;
        pool.parallel_for(tasks, [&](std::int64_t t) {
          auto [r0, r1] = task_range(rows, tasks, t);
          detail::Odometer o = od;
          o.seek(r0);
          for (std::int64_t r = r0; r < r1; ++r, o.next()) {
            for (std::int64_t j = 0; j < last; ++j) {
              const auto k = static_cast<std::int64_t>(idx[o.b + j]);
              if (k < 0 || k >= dsize) {
                throw IndexError("gather: index " + std::to_string(k) + " is out of bounds for dimension " +
                                 std::to_string(dim_) + " with size " + std::to_string(dsize) +
                                 " (expected 0 <= index < " + std::to_string(dsize) + ")");
              }
              const std::int64_t at = dim == R - 1 ? o.a + k : o.a + j + k * dstride;
              detail::copy_elem<N>(dst + (o.b + j) * N, src + at * N);
            }
          }
        });
      });
    }
    set_buffer(std::move(buf));
  }

 private:
  int dim_;
};

/// torch.nn.functional.one_hot: out[..., c] = (index[...] == c), as int64.
template <IndexElement I>
class OneHotNode final : public Node {
 public:
  OneHotNode(NodePtr index, std::int64_t classes, Shape out)
      : Node(NodeKind::Copy, DType::Int64, out, index->device(), {index}), classes_(classes) {}

  std::string op_name() const override { return "one_hot"; }
  std::string describe() const override { return "one_hot(%0, num_classes=" + std::to_string(classes_) + ")"; }

  /// Blocks along the index's dimensions; the classes stay whole.
  std::optional<BlockRule> block_rule() const override {
    const int rank = shape().rank();
    BlockRule r{std::vector<bool>(static_cast<std::size_t>(rank), true), {std::vector<int>(static_cast<std::size_t>(rank), -1)}};
    r.splittable.back() = false;
    for (int o = 0; o + 1 < rank; ++o) r.input_dim[0][static_cast<std::size_t>(o)] = o;
    return r;
  }
  NodePtr with_inputs(NodeList inputs, Shape shape, Device*) const override {
    return std::make_shared<OneHotNode>(std::move(inputs[0]), classes_, shape);
  }

 protected:
  void compute(ExecContext& ctx) override {
    const I* idx = inputs()[0]->template data<I>();
    const std::int64_t m = inputs()[0]->numel(), C = classes_;
    auto buf = allocate_output(ctx, false);
    auto* out = static_cast<std::int64_t*>(buf->data());
    auto& pool = ctx.device.threads();
    const std::int64_t tasks = std::max<std::int64_t>(1, std::min(m, task_count(pool, m * C, 1.0)));
    if (m > 0) {
      pool.parallel_for(tasks, [&](std::int64_t t) {
        auto [b, e] = task_range(m, tasks, t);
        if (C > 0) std::fill(out + b * C, out + e * C, std::int64_t{0});
        for (std::int64_t i = b; i < e; ++i) {
          const auto v = static_cast<std::int64_t>(idx[i]);
          if (v < 0) {
            throw IndexError("one_hot: class values must be non-negative, found " + std::to_string(v));
          }
          if (v >= C) {
            throw IndexError("one_hot: class values must be smaller than num_classes (" + std::to_string(C) +
                             "), found " + std::to_string(v));
          }
          out[i * C + v] = 1;
        }
      });
    }
    set_buffer(std::move(buf));
  }

 private:
  std::int64_t classes_;
};

}  // namespace lazy::graph
