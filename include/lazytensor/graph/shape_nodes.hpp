#pragma once
// The runtime nodes of the shape ops (ops/shape.hpp): views share their input's buffer;
// permutes, slices and cat copy bytes with one kernel per element size (1, 2, 4, 8 bytes),
// which serves every dtype and keeps the code small (the byte-copy helpers are in
// graph/byte_copy.hpp). The nodes that copy by index (index_select, gather, one_hot) are in
// graph/index_nodes.hpp.

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <lazytensor/core/error.hpp>
#include <lazytensor/graph/byte_copy.hpp>
#include <lazytensor/graph/device.hpp>
#include <lazytensor/graph/node.hpp>
#include <lazytensor/graph/parallel.hpp>
#include <lazytensor/graph/transpose_hint.hpp>
#include <lazytensor/core/config.hpp>

namespace lazy::graph {

/// A view: same bytes, another shape. Its kernel only shares the input's buffer, so it
/// costs nothing and the donation rule (buffer use_count == 1) keeps shared data safe.
class ViewNode final : public Node {
 public:
  ViewNode(std::string op, NodePtr in, Shape shape);

  std::string op_name() const override { return op_; }
  std::string describe() const override { return op_ + "(%0) -> " + shape().str(); }
  double cost_per_element() const override { return 0; }

 protected:
  void compute(ExecContext&) override { set_buffer(inputs()[0]->buffer()); }

 private:
  std::string op_;
};

/// Output = input with its dimensions permuted (out dim i = input dim perm[i]).
/// The permutation is first simplified: size-1 dims are dropped and output dims that are
/// adjacent in the input too are merged. What remains always has one output dim `q` that
/// reads the input contiguously; when q is the last dim the kernel copies rows (memcpy),
/// otherwise it copies 32x32 tiles of the (q, last) plane, so both the reads and the writes
/// stay within a few cache lines (a batched, cache-blocked 2-D transpose).
class PermuteNode : public Node {
 public:
  /// Simplified iteration space of a permutation (see the class comment).
  struct Plan {
    int rank = 0;
    std::array<std::int64_t, kMaxRank> size{}, istride{}, ostride{};
    int q = -1;  ///< the output dim with input stride 1
    /// True when the permutation only moves size-1 dims: the bytes are already in order.
    bool keeps_order() const { return rank <= 1; }
  };

  static Shape permuted_shape(const Shape& in, const std::vector<int>& perm);

  static Plan make_plan(const Shape& in, const std::vector<int>& perm);

  PermuteNode(NodePtr in, std::vector<int> perm, std::string op);

  /// out dim i reads input dim perm()[i].
  const std::vector<int>& perm() const { return perm_; }
  /// True when the permutation swaps the last two dims and keeps the others: a matmul can
  /// then read the input with a transposed layout instead of waiting for this copy.
  bool swaps_last_two() const;

  std::string op_name() const override { return op_; }
  LAZYTENSOR_INLINE std::string describe() const override;
  LAZYTENSOR_INLINE std::uint64_t structural_hash() const override;

  /// Every output dimension splits, reading the input dimension it moves.
  LAZYTENSOR_INLINE std::optional<BlockRule> block_rule() const override;
  LAZYTENSOR_INLINE NodePtr with_inputs(NodeList inputs, Shape shape, Device* device) const override;

 protected:
  LAZYTENSOR_INLINE void compute(ExecContext& ctx) override;

 private:
  static constexpr std::int64_t kTile = 32;

  template <std::size_t N>
  void run(ExecContext& ctx, std::byte* dst, const std::byte* src, std::int64_t n) const {
    using detail::Odometer;
    auto& pool = ctx.device.threads();
    const Plan& p = plan_;
    if (p.keeps_order()) {  // only reachable when a caller builds the node directly
      std::memcpy(dst, src, static_cast<std::size_t>(n) * N);
      return;
    }
    const int last = p.rank - 1;
    if (p.q == last) {
      // Rows: the innermost output dim is contiguous in the input.
      Odometer od;
      od.rank = last;
      for (int d = 0; d < last; ++d) {
        od.size[d] = p.size[d];
        od.stride_a[d] = p.istride[d];
        od.stride_b[d] = p.ostride[d];
      }
      const std::int64_t inner = p.size[last], rows = n / inner;
      const std::int64_t tasks = std::min(rows, task_count(pool, n, 1.0));
      pool.parallel_for(tasks, [&](std::int64_t t) {
        auto [r0, r1] = task_range(rows, tasks, t);
        Odometer o = od;
        o.seek(r0);
        for (std::int64_t r = r0; r < r1; ++r, o.next()) {
          std::memcpy(dst + o.b * N, src + o.a * N, static_cast<std::size_t>(inner) * N);
        }
      });
      return;
    }
    // Tiles of the (q, last) plane; every other dim is iterated by an odometer.
    const int q = p.q;
    Odometer od;
    for (int d = 0; d < p.rank; ++d) {
      if (d == q || d == last) continue;
      od.size[od.rank] = p.size[d];
      od.stride_a[od.rank] = p.istride[d];
      od.stride_b[od.rank] = p.ostride[d];
      ++od.rank;
    }
    const std::int64_t rows = p.size[q], cols = p.size[last];
    const std::int64_t ostq = p.ostride[q], isl = p.istride[last];
    const std::int64_t row_tiles = (rows + kTile - 1) / kTile;
    const std::int64_t units = n / (rows * cols) * row_tiles;
    const std::int64_t tasks = std::min(units, task_count(pool, n, 1.0));
    pool.parallel_for(tasks, [&](std::int64_t t) {
      auto [u0, u1] = task_range(units, tasks, t);
      Odometer o = od;
      alignas(64) std::byte tile[kTile * kTile * N];
      std::int64_t at = -1;
      for (std::int64_t u = u0; u < u1; ++u) {
        const std::int64_t outer = u / row_tiles;
        if (outer != at) {
          o.seek(outer);
          at = outer;
        }
        const std::int64_t i0 = u % row_tiles * kTile, in_ = std::min(rows - i0, kTile);
        for (std::int64_t j0 = 0; j0 < cols; j0 += kTile) {
          const std::int64_t jn = std::min(cols - j0, kTile);
          // Stage the tile: jn contiguous input runs into a 32x32 scratch, then write the
          // output rows from it. Reading the strided side straight from the source would
          // keep 32 lines alive that, for power-of-two strides, all map to one cache set.
          for (std::int64_t j = 0; j < jn; ++j) {
            std::memcpy(tile + j * kTile * N, src + (o.a + i0 + (j0 + j) * isl) * N, static_cast<std::size_t>(in_) * N);
          }
          for (std::int64_t i = 0; i < in_; ++i) {
            std::byte* out = dst + (o.b + (i0 + i) * ostq + j0) * N;
            for (std::int64_t j = 0; j < jn; ++j) detail::copy_elem<N>(out + j * N, tile + (j * kTile + i) * N);
          }
        }
      }
    });
  }

  std::vector<int> perm_;
  std::string op_;
  Plan plan_;
};

/// A permutation that swaps the last two dims (op_name "transpose"). It advertises its
/// source through TransposeOfLastTwo, so a GEMM consuming it while it is still pending reads
/// the source with a transposed layout and this copy never runs.
class TransposeNode final : public PermuteNode, public TransposeOfLastTwo {
 public:
  explicit TransposeNode(NodePtr in);

  /// The node whose last two dims this value swaps (null once this node has run: a
  /// computed node keeps no inputs).
  const NodePtr& transpose_source() const override { return inputs().empty() ? none_ : inputs()[0]; }
  LAZYTENSOR_INLINE NodePtr with_inputs(NodeList inputs, Shape shape, Device* device) const override;

  /// The identity permutation with the last two entries swapped.
  static std::vector<int> last_two(int rank);

 private:
  NodePtr none_;
};

/// Copies a strided range of one dim: out[.., k, ..] = in[.., start + k * step, ..].
class SliceNode final : public Node {
 public:
  SliceNode(std::string op, NodePtr in, int dim, std::int64_t start, std::int64_t step, Shape out);

  std::string op_name() const override { return op_; }
  LAZYTENSOR_INLINE std::string describe() const override;
  // The offsets are part of the kernel's layout, not data: they belong in the hash.
  LAZYTENSOR_INLINE std::uint64_t structural_hash() const override;
  /// Blocks along every dimension but the sliced one (lazy::spmd keeps such a sharding).
  std::optional<BlockRule> block_rule() const override {
    if (dim_ >= shape().rank()) return std::nullopt;
    return all_but_dim_rule(shape().rank(), dim_, 1);
  }
  NodePtr with_inputs(NodeList inputs, Shape shape, Device*) const override {
    return std::make_shared<SliceNode>(op_, std::move(inputs[0]), dim_, start_, step_, std::move(shape));
  }

 protected:
  LAZYTENSOR_INLINE void compute(ExecContext& ctx) override;

 private:
  std::string op_;
  int dim_;
  std::int64_t start_, step_;
};

/// Concatenation: the output, viewed as [outer, sum of widths], is row o = the inputs' rows o
/// side by side (input i viewed as [outer, widths[i]]). cat and stack differ only in how
/// they compute outer and the widths.
class CatNode final : public Node {
 public:
  CatNode(std::string op, DType dtype, NodeList ins, Shape out, Device* dev, std::int64_t outer,
          std::vector<std::int64_t> widths);

  std::string op_name() const override { return op_; }
  LAZYTENSOR_INLINE std::uint64_t structural_hash() const override;
  /// Blocks along the dimensions before the joined one (whole rows of every input).
  LAZYTENSOR_INLINE std::optional<BlockRule> block_rule() const override;
  LAZYTENSOR_INLINE NodePtr with_inputs(NodeList inputs, Shape shape, Device* device) const override;

 protected:
  LAZYTENSOR_INLINE void compute(ExecContext& ctx) override;

 private:
  // The output dimensions whose product is outer_ (the first ones; size-1 dimensions after
  // them are left whole).
  int row_dims() const;

  std::string op_;
  std::int64_t outer_;
  std::vector<std::int64_t> widths_;
};

}  // namespace lazy::graph

#if LAZYTENSOR_HEADER_DEFINITIONS
namespace lazy::graph {

LAZYTENSOR_INLINE ViewNode::ViewNode(std::string op, NodePtr in, Shape shape)
    : Node(NodeKind::View, in->dtype(), shape, in->device(), {in}), op_(std::move(op)) {}

LAZYTENSOR_INLINE Shape PermuteNode::permuted_shape(const Shape& in, const std::vector<int>& perm) {
  Shape out;
  for (int p : perm) out.push_back(in[p]);
  return out;
}

LAZYTENSOR_INLINE auto PermuteNode::make_plan(const Shape& in, const std::vector<int>& perm) -> Plan {
  Plan p;
  if (in.numel() <= 1) return p;
  const auto ics = contiguous_strides(in);
  std::vector<std::int64_t> sz, st;
  for (int d : perm) {
    if (in[d] == 1) continue;
    sz.push_back(in[d]);
    st.push_back(ics[d]);
  }
  // Merge output dim i into i + 1 while the input is contiguous across the pair.
  std::vector<std::int64_t> csz{sz.back()}, cst{st.back()};
  for (int i = static_cast<int>(sz.size()) - 2; i >= 0; --i) {
    if (st[i] == cst.front() * csz.front()) {
      csz.front() *= sz[i];
    } else {
      csz.insert(csz.begin(), sz[i]);
      cst.insert(cst.begin(), st[i]);
    }
  }
  p.rank = static_cast<int>(csz.size());
  std::int64_t acc = 1;
  for (int i = p.rank - 1; i >= 0; --i) {
    p.size[i] = csz[i];
    p.istride[i] = cst[i];
    p.ostride[i] = acc;
    acc *= csz[i];
    if (cst[i] == 1) p.q = i;
  }
  return p;
}

LAZYTENSOR_INLINE PermuteNode::PermuteNode(NodePtr in, std::vector<int> perm, std::string op)
    : Node(NodeKind::Copy, in->dtype(), permuted_shape(in->shape(), perm), in->device(), {in}),
      perm_(std::move(perm)), op_(std::move(op)), plan_(make_plan(in->shape(), perm_)) {}

LAZYTENSOR_INLINE bool PermuteNode::swaps_last_two() const {
  const int r = static_cast<int>(perm_.size());
  if (r < 2 || perm_[r - 2] != r - 1 || perm_[r - 1] != r - 2) return false;
  for (int i = 0; i + 2 < r; ++i)
    if (perm_[i] != i) return false;
  return true;
}

LAZYTENSOR_INLINE std::string PermuteNode::describe() const {
  std::string s = op_ + "(%0, dims=[";
  for (std::size_t i = 0; i < perm_.size(); ++i) s += (i ? ", " : "") + std::to_string(perm_[i]);
  return s + "])";
}

LAZYTENSOR_INLINE std::uint64_t PermuteNode::structural_hash() const {
  std::uint64_t h = Node::structural_hash();
  for (int p : perm_) h = hash_combine(h, static_cast<std::uint64_t>(p));
  return h;
}

LAZYTENSOR_INLINE void PermuteNode::compute(ExecContext& ctx) {
  const std::byte* src = detail::bytes_of(inputs()[0]);
  auto buf = allocate_output(ctx, false);  // reads elsewhere than it writes
  auto* dst = static_cast<std::byte*>(buf->data());
  const std::int64_t n = numel();
  if (n > 0) {
    detail::with_elem_size(dtype_size(dtype()), [&](auto nb) { run<decltype(nb)::value>(ctx, dst, src, n); });
  }
  set_buffer(std::move(buf));
}

LAZYTENSOR_INLINE TransposeNode::TransposeNode(NodePtr in) : PermuteNode(in, last_two(in->shape().rank()), "transpose") {}

LAZYTENSOR_INLINE std::optional<BlockRule> PermuteNode::block_rule() const {
  BlockRule r{std::vector<bool>(perm_.size(), true), {std::vector<int>(perm_.begin(), perm_.end())}};
  return r;
}

LAZYTENSOR_INLINE NodePtr PermuteNode::with_inputs(NodeList inputs, Shape, Device* device) const {
  (void)device;  // the input's device: a piece and its permute live on the same device
  return std::make_shared<PermuteNode>(std::move(inputs[0]), perm_, op_);
}

LAZYTENSOR_INLINE NodePtr TransposeNode::with_inputs(NodeList inputs, Shape, Device*) const {
  return std::make_shared<TransposeNode>(std::move(inputs[0]));
}

LAZYTENSOR_INLINE std::vector<int> TransposeNode::last_two(int rank) {
  std::vector<int> p(static_cast<std::size_t>(rank));
  for (int i = 0; i < rank; ++i) p[i] = i;
  if (rank >= 2) std::swap(p[rank - 2], p[rank - 1]);
  return p;
}

LAZYTENSOR_INLINE SliceNode::SliceNode(std::string op, NodePtr in, int dim, std::int64_t start, std::int64_t step, Shape out)
    : Node(NodeKind::Copy, in->dtype(), out, in->device(), {in}), op_(std::move(op)), dim_(dim), start_(start),
      step_(step) {}

LAZYTENSOR_INLINE std::string SliceNode::describe() const {
  return op_ + "(%0, dim=" + std::to_string(dim_) + ", start=" + std::to_string(start_) +
         ", step=" + std::to_string(step_) + ")";
}

LAZYTENSOR_INLINE std::uint64_t SliceNode::structural_hash() const {
  return hash_combine(hash_combine(hash_combine(Node::structural_hash(), static_cast<std::uint64_t>(dim_)),
                                   static_cast<std::uint64_t>(start_)),
                      static_cast<std::uint64_t>(step_));
}

LAZYTENSOR_INLINE void SliceNode::compute(ExecContext& ctx) {
  const Shape& is = inputs()[0]->shape();
  const std::byte* src = detail::bytes_of(inputs()[0]);
  auto buf = allocate_output(ctx, false);
  auto* dst = static_cast<std::byte*>(buf->data());
  std::int64_t outer = 1, inner = 1;
  for (int d = 0; d < dim_; ++d) outer *= is[d];
  for (int d = dim_ + 1; d < is.rank(); ++d) inner *= is[d];
  const std::int64_t dsize = is[dim_], len = shape()[dim_];
  const std::int64_t start = start_, step = step_;
  detail::with_elem_size(dtype_size(dtype()), [&](auto nb) {
    constexpr std::size_t N = decltype(nb)::value;
    if (step == 1) {  // one contiguous run per outer index
      detail::copy_segments<N>(ctx.device.threads(), dst, src, outer, len * inner,
                               [&](std::int64_t o) { return (o * dsize + start) * inner; });
    } else {
      detail::copy_segments<N>(ctx.device.threads(), dst, src, outer * len, inner, [&](std::int64_t s) {
        return ((s / len) * dsize + start + (s % len) * step) * inner;
      });
    }
  });
  set_buffer(std::move(buf));
}

LAZYTENSOR_INLINE CatNode::CatNode(std::string op,
  DType dtype,
  NodeList ins,
  Shape out,
  Device* dev,
  std::int64_t outer,
  std::vector<std::int64_t> widths)
    : Node(NodeKind::Copy, dtype, out, dev, std::move(ins)), op_(std::move(op)), outer_(outer),
      widths_(std::move(widths)) {}

LAZYTENSOR_INLINE std::uint64_t CatNode::structural_hash() const {
  std::uint64_t h = hash_combine(Node::structural_hash(), static_cast<std::uint64_t>(outer_));
  for (auto w : widths_) h = hash_combine(h, static_cast<std::uint64_t>(w));
  return h;
}

LAZYTENSOR_INLINE int CatNode::row_dims() const {
  int k = 0;
  for (std::int64_t prefix = 1; prefix != outer_ && k < shape().rank(); ++k) prefix *= shape()[k];
  return k;
}

LAZYTENSOR_INLINE std::optional<BlockRule> CatNode::block_rule() const {
  const int rank = shape().rank(), k = row_dims();
  BlockRule r{std::vector<bool>(static_cast<std::size_t>(rank), false),
              std::vector<std::vector<int>>(inputs().size(), std::vector<int>(static_cast<std::size_t>(rank), -1))};
  for (int o = 0; o < k; ++o) {
    r.splittable[static_cast<std::size_t>(o)] = true;
    for (auto& map : r.input_dim) map[static_cast<std::size_t>(o)] = o;  // cat and stack alike
  }
  return r;
}

LAZYTENSOR_INLINE NodePtr CatNode::with_inputs(NodeList inputs, Shape shape, Device* device) const {
  std::int64_t outer = 1;
  for (int o = 0; o < row_dims(); ++o) outer *= shape[o];
  return std::make_shared<CatNode>(op_, dtype(), std::move(inputs), std::move(shape), device, outer, widths_);
}

LAZYTENSOR_INLINE void CatNode::compute(ExecContext& ctx) {
  const std::size_t k = inputs().size();
  std::vector<const std::byte*> srcs(k);
  for (std::size_t i = 0; i < k; ++i) srcs[i] = detail::bytes_of(inputs()[i]);
  auto buf = allocate_output(ctx, false);
  auto* dst = static_cast<std::byte*>(buf->data());
  std::vector<std::int64_t> pre(k + 1, 0);  // start of each input inside an output row
  for (std::size_t i = 0; i < k; ++i) pre[i + 1] = pre[i] + widths_[i];
  const std::int64_t W = pre[k], n = outer_ * W;
  auto& pool = ctx.device.threads();
  if (n > 0) {
    detail::with_elem_size(dtype_size(dtype()), [&](auto nb) {
      constexpr std::size_t N = decltype(nb)::value;
      const std::int64_t tasks = task_count(pool, n, 1.0);
      // Split the output evenly, whatever the sizes of the pieces.
      pool.parallel_for(tasks, [&](std::int64_t t) {
        auto [b, e] = task_range(n, tasks, t);
        while (b < e) {
          const std::int64_t o = b / W, w = b % W;
          const auto i = static_cast<std::size_t>(std::upper_bound(pre.begin() + 1, pre.end(), w) - pre.begin() - 1);
          const std::int64_t off = w - pre[i], c = std::min(widths_[i] - off, e - b);
          std::memcpy(dst + b * N, srcs[i] + (o * widths_[i] + off) * N, static_cast<std::size_t>(c) * N);
          b += c;
        }
      });
    });
  }
  set_buffer(std::move(buf));
}

}  // namespace lazy::graph
#endif  // LAZYTENSOR_HEADER_DEFINITIONS
