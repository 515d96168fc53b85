#pragma once
// Shape ops, all lazy.
//  - Views (reshape/view, flatten, squeeze, unsqueeze) are nodes whose kernel shares the
//    input's buffer: the data is never copied, and a view of a pending value is pending.
//  - Copies (transpose/permute, narrow/slice, cat/stack, index_select, gather) move bytes:
//    one kernel per element *size* (1, 2, 4, 8 bytes) serves every dtype, which keeps the
//    code small; the element copy is a constant-size memcpy, which compiles to one load and
//    one store and is valid whatever type wrote the buffer (no strict-aliasing games).
//  - expand is a broadcasting element-wise node (the element-wise layout already knows how
//    to splat a size-1 dim), and one_hot writes int64 rows.
// Index values (index_select, gather, one_hot) live in tensors that may still be pending, so
// they are checked where they are read: inside the kernel, which throws lazy::IndexError out
// of the mark_step or read that ran it.

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <memory>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <lazytensor/autograd/record.hpp>
#include <lazytensor/graph/builders.hpp>
#include <lazytensor/graph/parallel.hpp>
#include <lazytensor/graph/transpose_hint.hpp>
#include <lazytensor/ops/shape_backward.hpp>
#include <lazytensor/tensor/tensor.hpp>

namespace lazy {


namespace graph {

namespace copy_kernels {

/// Copies one element of N bytes (see the file comment for why memcpy).
template <std::size_t N>
inline void copy_elem(std::byte* dst, const std::byte* src) {
  std::memcpy(dst, src, N);
}

/// Calls f(std::integral_constant<std::size_t, N>{}) for an element size of N bytes, so a
/// kernel is instantiated once per size instead of once per dtype.
template <class F>
void with_elem_size(std::size_t bytes, F&& f) {
  switch (bytes) {
    case 1: f(std::integral_constant<std::size_t, 1>{}); break;
    case 2: f(std::integral_constant<std::size_t, 2>{}); break;
    case 4: f(std::integral_constant<std::size_t, 4>{}); break;
    default: f(std::integral_constant<std::size_t, 8>{}); break;
  }
}

/// A multi-index over `rank` dims (last fastest) that tracks two linear offsets, `a` and
/// `b`, with their own strides: typically an input offset and an output offset.
struct Odometer {
  int rank = 0;
  std::array<std::int64_t, kMaxRank> size{}, stride_a{}, stride_b{}, idx{};
  std::int64_t a = 0, b = 0;

  /// Positions the multi-index at linear position `lin` (row-major over `size`).
  void seek(std::int64_t lin) {
    a = b = 0;
    for (int d = rank - 1; d >= 0; --d) {
      idx[d] = lin % size[d];
      lin /= size[d];
      a += idx[d] * stride_a[d];
      b += idx[d] * stride_b[d];
    }
  }
  /// Advances by one position (carry from the last dim).
  void next() {
    for (int d = rank - 1; d >= 0; --d) {
      ++idx[d];
      a += stride_a[d];
      b += stride_b[d];
      if (idx[d] < size[d]) return;
      a -= stride_a[d] * size[d];
      b -= stride_b[d] * size[d];
      idx[d] = 0;
    }
  }
};

/// Fills `segs` equal-length output segments of `len` elements each, segment s copied from
/// the contiguous input run starting at element `src_off(s)`. The split across threads is
/// over output elements, not segments, so one huge segment and a million tiny ones both
/// balance.
template <std::size_t N, class SrcOff>
void copy_segments(ThreadPool& pool, std::byte* dst, const std::byte* src, std::int64_t segs, std::int64_t len,
                   const SrcOff& src_off) {
  const std::int64_t n = segs * len;
  if (n == 0) return;
  const std::int64_t tasks = task_count(pool, n, 1.0);
  pool.parallel_for(tasks, [&](std::int64_t t) {
    auto [b, e] = task_range(n, tasks, t);
    if (len == 1) {  // gathers of single elements: no variable-size memcpy per element
      for (std::int64_t f = b; f < e; ++f) copy_elem<N>(dst + f * N, src + src_off(f) * N);
      return;
    }
    while (b < e) {
      const std::int64_t s = b / len, k = b % len, c = std::min(len - k, e - b);
      std::memcpy(dst + b * N, src + (src_off(s) + k) * N, static_cast<std::size_t>(c) * N);
      b += c;
    }
  });
}

inline const std::byte* bytes_of(const NodePtr& n) { return static_cast<const std::byte*>(n->buffer()->data()); }

}  // namespace copy_kernels

/// A view: same bytes, another shape. Its kernel only shares the input's buffer, so it
/// costs nothing and the donation rule (buffer use_count == 1) keeps shared data safe.
class ViewNode final : public Node {
 public:
  ViewNode(std::string op, NodePtr in, Shape shape)
      : Node(NodeKind::View, in->dtype(), shape, in->device(), {in}), op_(std::move(op)) {}

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

  static Shape permuted_shape(const Shape& in, const std::vector<int>& perm) {
    Shape out;
    for (int p : perm) out.push_back(in[p]);
    return out;
  }

  static Plan make_plan(const Shape& in, const std::vector<int>& perm) {
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

  PermuteNode(NodePtr in, std::vector<int> perm, std::string op)
      : Node(NodeKind::Copy, in->dtype(), permuted_shape(in->shape(), perm), in->device(), {in}),
        perm_(std::move(perm)), op_(std::move(op)), plan_(make_plan(in->shape(), perm_)) {}

  /// out dim i reads input dim perm()[i].
  const std::vector<int>& perm() const { return perm_; }
  /// True when the permutation swaps the last two dims and keeps the others: a matmul can
  /// then read the input with a transposed layout instead of waiting for this copy.
  bool swaps_last_two() const {
    const int r = static_cast<int>(perm_.size());
    if (r < 2 || perm_[r - 2] != r - 1 || perm_[r - 1] != r - 2) return false;
    for (int i = 0; i + 2 < r; ++i)
      if (perm_[i] != i) return false;
    return true;
  }

  std::string op_name() const override { return op_; }
  std::string describe() const override {
    std::string s = op_ + "(%0, dims=[";
    for (std::size_t i = 0; i < perm_.size(); ++i) s += (i ? ", " : "") + std::to_string(perm_[i]);
    return s + "])";
  }
  std::uint64_t structural_hash() const override {
    std::uint64_t h = Node::structural_hash();
    for (int p : perm_) h = hash_combine(h, static_cast<std::uint64_t>(p));
    return h;
  }

 protected:
  void compute(ExecContext& ctx) override {
    const std::byte* src = copy_kernels::bytes_of(inputs()[0]);
    auto buf = allocate_output(ctx, false);  // reads elsewhere than it writes
    auto* dst = static_cast<std::byte*>(buf->data());
    const std::int64_t n = numel();
    if (n > 0) {
      copy_kernels::with_elem_size(dtype_size(dtype()), [&](auto nb) { run<decltype(nb)::value>(ctx, dst, src, n); });
    }
    set_buffer(std::move(buf));
  }

 private:
  static constexpr std::int64_t kTile = 32;

  template <std::size_t N>
  void run(ExecContext& ctx, std::byte* dst, const std::byte* src, std::int64_t n) const {
    using copy_kernels::Odometer;
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
            for (std::int64_t j = 0; j < jn; ++j) copy_kernels::copy_elem<N>(out + j * N, tile + (j * kTile + i) * N);
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
  explicit TransposeNode(NodePtr in) : PermuteNode(in, last_two(in->shape().rank()), "transpose") {}

  /// The node whose last two dims this value swaps (null once this node has run: a
  /// computed node keeps no inputs).
  const NodePtr& transpose_source() const override { return inputs().empty() ? none_ : inputs()[0]; }

  /// The identity permutation with the last two entries swapped.
  static std::vector<int> last_two(int rank) {
    std::vector<int> p(static_cast<std::size_t>(rank));
    for (int i = 0; i < rank; ++i) p[i] = i;
    if (rank >= 2) std::swap(p[rank - 2], p[rank - 1]);
    return p;
  }

 private:
  NodePtr none_;
};

/// Copies a strided range of one dim: out[.., k, ..] = in[.., start + k * step, ..].
class SliceNode final : public Node {
 public:
  SliceNode(std::string op, NodePtr in, int dim, std::int64_t start, std::int64_t step, Shape out)
      : Node(NodeKind::Copy, in->dtype(), out, in->device(), {in}), op_(std::move(op)), dim_(dim), start_(start),
        step_(step) {}

  std::string op_name() const override { return op_; }
  std::string describe() const override {
    return op_ + "(%0, dim=" + std::to_string(dim_) + ", start=" + std::to_string(start_) +
           ", step=" + std::to_string(step_) + ")";
  }
  // The offsets are part of the kernel's layout, not data: they belong in the hash.
  std::uint64_t structural_hash() const override {
    return hash_combine(hash_combine(hash_combine(Node::structural_hash(), static_cast<std::uint64_t>(dim_)),
                                     static_cast<std::uint64_t>(start_)),
                        static_cast<std::uint64_t>(step_));
  }

 protected:
  void compute(ExecContext& ctx) override {
    const Shape& is = inputs()[0]->shape();
    const std::byte* src = copy_kernels::bytes_of(inputs()[0]);
    auto buf = allocate_output(ctx, false);
    auto* dst = static_cast<std::byte*>(buf->data());
    std::int64_t outer = 1, inner = 1;
    for (int d = 0; d < dim_; ++d) outer *= is[d];
    for (int d = dim_ + 1; d < is.rank(); ++d) inner *= is[d];
    const std::int64_t dsize = is[dim_], len = shape()[dim_];
    const std::int64_t start = start_, step = step_;
    copy_kernels::with_elem_size(dtype_size(dtype()), [&](auto nb) {
      constexpr std::size_t N = decltype(nb)::value;
      if (step == 1) {  // one contiguous run per outer index
        copy_kernels::copy_segments<N>(ctx.device.threads(), dst, src, outer, len * inner,
                                       [&](std::int64_t o) { return (o * dsize + start) * inner; });
      } else {
        copy_kernels::copy_segments<N>(ctx.device.threads(), dst, src, outer * len, inner, [&](std::int64_t s) {
          return ((s / len) * dsize + start + (s % len) * step) * inner;
        });
      }
    });
    set_buffer(std::move(buf));
  }

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
  CatNode(std::string op, DType dtype, std::vector<NodePtr> ins, Shape out, Device* dev, std::int64_t outer,
          std::vector<std::int64_t> widths)
      : Node(NodeKind::Copy, dtype, out, dev, std::move(ins)), op_(std::move(op)), outer_(outer),
        widths_(std::move(widths)) {}

  std::string op_name() const override { return op_; }
  std::uint64_t structural_hash() const override {
    std::uint64_t h = hash_combine(Node::structural_hash(), static_cast<std::uint64_t>(outer_));
    for (auto w : widths_) h = hash_combine(h, static_cast<std::uint64_t>(w));
    return h;
  }

 protected:
  void compute(ExecContext& ctx) override {
    const std::size_t k = inputs().size();
    std::vector<const std::byte*> srcs(k);
    for (std::size_t i = 0; i < k; ++i) srcs[i] = copy_kernels::bytes_of(inputs()[i]);
    auto buf = allocate_output(ctx, false);
    auto* dst = static_cast<std::byte*>(buf->data());
    std::vector<std::int64_t> pre(k + 1, 0);  // start of each input inside an output row
    for (std::size_t i = 0; i < k; ++i) pre[i + 1] = pre[i] + widths_[i];
    const std::int64_t W = pre[k], n = outer_ * W;
    auto& pool = ctx.device.threads();
    if (n > 0) {
      copy_kernels::with_elem_size(dtype_size(dtype()), [&](auto nb) {
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

 private:
  std::string op_;
  std::int64_t outer_;
  std::vector<std::int64_t> widths_;
};

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

 protected:
  void compute(ExecContext& ctx) override {
    const Shape& is = inputs()[0]->shape();
    const std::byte* src = copy_kernels::bytes_of(inputs()[0]);
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
    copy_kernels::with_elem_size(dtype_size(dtype()), [&](auto nb) {
      constexpr std::size_t N = decltype(nb)::value;
      copy_kernels::copy_segments<N>(ctx.device.threads(), dst, src, outer * K, inner, [&](std::int64_t s) {
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
    const std::byte* src = copy_kernels::bytes_of(inputs()[0]);
    const I* idx = inputs()[1]->template data<I>();
    auto buf = allocate_output(ctx, false);
    auto* dst = static_cast<std::byte*>(buf->data());
    const int R = xs.rank(), dim = dim_;
    const std::int64_t n = numel(), last = xs[R - 1], dsize = ts[dim];
    if (n > 0) {
      const auto tst = contiguous_strides(ts), xst = contiguous_strides(xs);
      copy_kernels::Odometer od;  // a: input offset without `dim`; b: index offset
      od.rank = R - 1;
      for (int d = 0; d + 1 < R; ++d) {
        od.size[d] = xs[d];
        od.stride_a[d] = d == dim ? 0 : tst[d];
        od.stride_b[d] = xst[d];
      }
      const std::int64_t dstride = tst[dim], rows = n / last;
      auto& pool = ctx.device.threads();
      const std::int64_t tasks = std::min(rows, task_count(pool, n, 2.0));
      copy_kernels::with_elem_size(dtype_size(dtype()), [&](auto nb) {
        constexpr std::size_t N = decltype(nb)::value;
        pool.parallel_for(tasks, [&](std::int64_t t) {
          auto [r0, r1] = task_range(rows, tasks, t);
          copy_kernels::Odometer o = od;
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
              copy_kernels::copy_elem<N>(dst + (o.b + j) * N, src + at * N);
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

}  // namespace graph

namespace detail::shape_ops {

/// An operand as a tensor: a Tensor as is (the handle is copied), an expression evaluated
/// into a pending node.
template <expr::ExprLike X>
auto as_tensor(const X& x) {
  using T = expr::value_t<X>;
  if constexpr (std::is_same_v<X, Tensor<T>>) return x;
  else if constexpr (expr::is_expr_node<X>::value) return Tensor<T>(x);
  else return Tensor<T>(x.to_leaf().node);
}

inline std::string list_str(std::span<const std::int64_t> v) {
  std::string s = "[";
  for (std::size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s + "]";
}
inline std::string list_str(const Shape& s) { return list_str(std::span<const std::int64_t>(s.begin(), s.end())); }
inline std::span<const std::int64_t> span_of(const Shape& s) { return {s.begin(), static_cast<std::size_t>(s.rank())}; }

/// A view of t with `shape` (same numel), or t's own node when the shape does not change.
/// A view of a pending view is made a view of that view's source, so chains stay short.
template <Element T>
Tensor<T> view_of(const Tensor<T>& t, const Shape& shape, const char* op) {
  graph::NodePtr src = t.node();
  if (src->shape() == shape) return t;
  if (src->pending() && dynamic_cast<graph::ViewNode*>(src.get())) src = src->inputs()[0];
  Tensor<T> r(graph::submit(std::make_shared<graph::ViewNode>(op, std::move(src), shape)));
  autograd::record(r, "ViewBackward0", {autograd::edge_of(t.impl())}, [in = t.shape()](const Tensor<T>& g) {
    return std::vector<graph::NodePtr>{view_of(g, in, "view").node()};
  });
  return r;
}

/// Resolves a size list with at most one -1 against `numel` (torch's infer_size).
inline Shape infer_shape(std::span<const std::int64_t> sizes, std::int64_t numel, const char* op) {
  if (sizes.size() > static_cast<std::size_t>(kMaxRank)) {
    throw ShapeError(std::string(op) + ": shape " + list_str(sizes) + " has rank " + std::to_string(sizes.size()) +
                     ", expected at most " + std::to_string(kMaxRank));
  }
  int infer = -1;
  std::int64_t known = 1;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    if (sizes[i] == -1) {
      if (infer >= 0) throw ShapeError(std::string(op) + ": only one dimension can be inferred (-1), got " + list_str(sizes));
      infer = static_cast<int>(i);
    } else if (sizes[i] < 0) {
      throw ShapeError(std::string(op) + ": invalid shape dimension " + std::to_string(sizes[i]) + " in " +
                       list_str(sizes) + " (expected sizes >= 0, or -1 once)");
    } else {
      known *= sizes[i];
    }
  }
  std::vector<std::int64_t> out(sizes.begin(), sizes.end());
  if (infer >= 0) {
    if (known == 0) {
      throw ShapeError(std::string(op) + ": cannot reshape a tensor of " + std::to_string(numel) + " elements into shape " +
                       list_str(sizes) + " because the unspecified dimension size -1 can be any value and is ambiguous");
    }
    if (numel % known != 0) {
      throw ShapeError(std::string(op) + ": shape " + list_str(sizes) + " is invalid for input of size " +
                       std::to_string(numel));
    }
    out[infer] = numel / known;
  } else if (known != numel) {
    throw ShapeError(std::string(op) + ": shape " + list_str(sizes) + " is invalid for input of size " +
                     std::to_string(numel) + " (expected " + std::to_string(known) + " elements)");
  }
  return Shape(out);
}

template <expr::ExprLike X>
auto reshape_impl(const X& x, std::span<const std::int64_t> sizes, const char* op) {
  auto t = as_tensor(x);
  return view_of(t, infer_shape(sizes, t.numel(), op), op);
}

/// A permuted copy, or a view when only size-1 dims move (the bytes are then in order).
template <Element T>
Tensor<T> permute_impl(const Tensor<T>& t, std::vector<int> perm, const char* op) {
  const graph::NodePtr& n = t.node();
  bool identity = true;
  for (std::size_t i = 0; i < perm.size(); ++i) identity = identity && perm[i] == static_cast<int>(i);
  if (identity) return t;
  if (graph::PermuteNode::make_plan(n->shape(), perm).keeps_order()) {
    return view_of(t, graph::PermuteNode::permuted_shape(n->shape(), perm), op);
  }
  std::vector<int> inverse(perm.size());
  for (std::size_t i = 0; i < perm.size(); ++i) inverse[static_cast<std::size_t>(perm[i])] = static_cast<int>(i);
  const bool swap_last_two = perm == graph::TransposeNode::last_two(static_cast<int>(perm.size()));
  graph::NodePtr source;  // transpose(transpose(s)) is s: no node, no copy
  if (swap_last_two && n->pending()) {
    if (auto* tr = dynamic_cast<graph::TransposeOfLastTwo*>(n.get()))
      source = tr->transpose_source();
  }
  Tensor<T> r =
      source ? Tensor<T>(source)
      : swap_last_two
          ? Tensor<T>(graph::submit(std::make_shared<graph::TransposeNode>(n)))
          : Tensor<T>(graph::submit(std::make_shared<graph::PermuteNode>(n, std::move(perm), op)));
  autograd::record(r, "PermuteBackward0", {autograd::edge_of(t.impl())}, [inverse](const Tensor<T>& g) {
    return std::vector<graph::NodePtr>{permute_impl(g, inverse, "permute").node()};
  });
  return r;
}

template <expr::ExprLike X>
auto expand_impl(const X& x, std::span<const std::int64_t> sizes) {
  using T = expr::value_t<X>;
  Tensor<T> t = as_tensor(x);
  const Shape& s = t.shape();
  const int r = s.rank();
  const auto k = static_cast<int>(sizes.size());
  if (k < r) {
    throw ShapeError("expand: the number of sizes provided (" + std::to_string(k) +
                     ") must be greater or equal to the number of dimensions in the tensor (" + std::to_string(r) +
                     "); target sizes " + list_str(sizes) + ", tensor sizes " + list_str(s));
  }
  if (k > kMaxRank) {
    throw ShapeError("expand: target sizes " + list_str(sizes) + " have rank " + std::to_string(k) +
                     ", expected at most " + std::to_string(kMaxRank));
  }
  Shape out;
  for (int i = 0; i < k; ++i) {
    const std::int64_t v = sizes[i];
    if (i < k - r) {
      if (v < 0) {
        throw ShapeError("expand: the expanded size of the tensor (" + std::to_string(v) +
                         ") isn't allowed in a leading, non-existing dimension " + std::to_string(i) +
                         "; target sizes " + list_str(sizes) + ", tensor sizes " + list_str(s));
      }
      out.push_back(v);
      continue;
    }
    const std::int64_t d = s[i - (k - r)];
    if (v == -1) {
      out.push_back(d);
    } else if (v < 0 || (v != d && d != 1)) {
      throw ShapeError("expand: the expanded size of the tensor (" + std::to_string(v) +
                       ") must match the existing size (" + std::to_string(d) + ") at non-singleton dimension " +
                       std::to_string(i) + "; target sizes " + list_str(sizes) + ", tensor sizes " + list_str(s));
    } else {
      out.push_back(v);
    }
  }
  if (out == s) return t;
  // The element-wise node broadcasts its leaves to `out`: a splat per expanded dim (and
  // its gradient sums back over them).
  return evaluate_as<T>(expr::make<ops::Identity>(t), out);
}

/// Records the backward of a slice of `t` (the gradient lands in zeros of t's shape).
template <Element T>
void record_slice(Tensor<T>& r, const Tensor<T>& t, int d, std::int64_t start, std::int64_t step) {
  if constexpr (is_floating_v<T>) {
    autograd::record(r, "SliceBackward0", {autograd::edge_of(t.impl())},
                     [in = t.shape(), d, start, step](const Tensor<T>& g) {
                       return std::vector<graph::NodePtr>{graph::submit(
                           std::make_shared<graph::SliceBackwardNode<T>>(g.node(), in, d, start, step))};
                     });
  }
}

/// Autograd edges of a list of tensors.
template <Element T>
std::vector<autograd::GradFnPtr> edges_of(const std::vector<Tensor<T>>& ts) {
  std::vector<autograd::GradFnPtr> e;
  e.reserve(ts.size());
  for (const auto& t : ts) e.push_back(autograd::edge_of(t.impl()));
  return e;
}

template <Element T>
std::vector<graph::NodePtr> nodes_of(const std::vector<Tensor<T>>& ts) {
  std::vector<graph::NodePtr> v;
  v.reserve(ts.size());
  for (const auto& t : ts) v.push_back(t.node());
  return v;
}

}  // namespace detail::shape_ops

// ---- views ------------------------------------------------------------------------------

/// A view of `x` with shape `sizes` (one entry may be -1: inferred). Shares x's buffer;
/// ShapeError if the element count differs. An expression is evaluated first.
template <expr::ExprLike X>
auto reshape(const X& x, std::initializer_list<std::int64_t> sizes) {
  return detail::shape_ops::reshape_impl(x, {sizes.begin(), sizes.size()}, "reshape");
}
/// reshape with the sizes in a vector.
template <expr::ExprLike X>
auto reshape(const X& x, const std::vector<std::int64_t>& sizes) {
  return detail::shape_ops::reshape_impl(x, sizes, "reshape");
}
/// reshape to a Shape.
template <expr::ExprLike X>
auto reshape(const X& x, const Shape& shape) {
  return detail::shape_ops::reshape_impl(x, detail::shape_ops::span_of(shape), "reshape");
}

/// Same as reshape (tensors are always contiguous here, so view never fails where reshape
/// would copy).
template <expr::ExprLike X>
auto view(const X& x, std::initializer_list<std::int64_t> sizes) {
  return detail::shape_ops::reshape_impl(x, {sizes.begin(), sizes.size()}, "view");
}
/// view with the sizes in a vector.
template <expr::ExprLike X>
auto view(const X& x, const std::vector<std::int64_t>& sizes) {
  return detail::shape_ops::reshape_impl(x, sizes, "view");
}
/// view as a Shape.
template <expr::ExprLike X>
auto view(const X& x, const Shape& shape) {
  return detail::shape_ops::reshape_impl(x, detail::shape_ops::span_of(shape), "view");
}

/// Merges dims start_dim..end_dim (inclusive, negative counts from the back) into one, as a
/// view. A 0-d tensor becomes 1-D with one element, as in torch.
template <expr::ExprLike X>
auto flatten(const X& x, std::int64_t start_dim = 0, std::int64_t end_dim = -1) {
  auto t = detail::shape_ops::as_tensor(x);
  const Shape& s = t.shape();
  const int a = normalize_dim(start_dim, s.rank(), "flatten"), b = normalize_dim(end_dim, s.rank(), "flatten");
  if (a > b) {
    throw ShapeError("flatten: start_dim (" + std::to_string(start_dim) + ", i.e. " + std::to_string(a) +
                     ") cannot come after end_dim (" + std::to_string(end_dim) + ", i.e. " + std::to_string(b) + ")");
  }
  if (s.rank() == 0) return detail::shape_ops::view_of(t, Shape{1}, "flatten");
  Shape out;
  std::int64_t merged = 1;
  for (int i = 0; i < s.rank(); ++i) {
    if (i < a || i > b) {
      out.push_back(s[i]);
    } else {
      merged *= s[i];
      if (i == b) out.push_back(merged);
    }
  }
  return detail::shape_ops::view_of(t, out, "flatten");
}

/// Removes every dim of size 1 (a view).
template <expr::ExprLike X>
auto squeeze(const X& x) {
  auto t = detail::shape_ops::as_tensor(x);
  Shape out;
  for (auto d : t.shape())
    if (d != 1) out.push_back(d);
  return detail::shape_ops::view_of(t, out, "squeeze");
}

/// Removes dim `dim` if its size is 1; otherwise returns x unchanged, as torch does.
template <expr::ExprLike X>
auto squeeze(const X& x, std::int64_t dim) {
  auto t = detail::shape_ops::as_tensor(x);
  const Shape& s = t.shape();
  const int d = normalize_dim(dim, s.rank(), "squeeze");
  if (s.rank() == 0 || s[d] != 1) return t;
  Shape out;
  for (int i = 0; i < s.rank(); ++i)
    if (i != d) out.push_back(s[i]);
  return detail::shape_ops::view_of(t, out, "squeeze");
}

/// Inserts a dim of size 1 at position `dim` (in [-rank-1, rank]), as a view.
template <expr::ExprLike X>
auto unsqueeze(const X& x, std::int64_t dim) {
  auto t = detail::shape_ops::as_tensor(x);
  const Shape& s = t.shape();
  if (s.rank() >= kMaxRank) {
    throw ShapeError("unsqueeze: the result would have rank " + std::to_string(s.rank() + 1) +
                     ", expected at most " + std::to_string(kMaxRank) + " (input shape " + s.str() + ")");
  }
  const int d = normalize_dim(dim, s.rank() + 1, "unsqueeze");
  Shape out;
  for (int i = 0; i < s.rank(); ++i) {
    if (i == d) out.push_back(1);
    out.push_back(s[i]);
  }
  if (d == s.rank()) out.push_back(1);
  return detail::shape_ops::view_of(t, out, "unsqueeze");
}

// ---- permutations -------------------------------------------------------------------------

/// Reorders the dims: out dim i is x's dim dims[i] (a permutation of 0..rank-1; negative
/// entries count from the back). A copy, unless only size-1 dims move (then a view).
template <expr::ExprLike X>
auto permute(const X& x, const std::vector<std::int64_t>& dims) {
  auto t = detail::shape_ops::as_tensor(x);
  const int r = t.dim();
  if (static_cast<int>(dims.size()) != r) {
    throw ShapeError("permute: number of dims don't match: the tensor has " + std::to_string(r) +
                     " dims (shape " + t.shape().str() + "), the permutation " +
                     detail::shape_ops::list_str(dims) + " has " + std::to_string(dims.size()));
  }
  std::vector<int> perm;
  std::vector<char> seen(static_cast<std::size_t>(r), 0);
  for (auto d : dims) {
    const int n = normalize_dim(d, r, "permute");
    if (seen[n]) {
      throw ShapeError("permute: repeated dim " + std::to_string(n) + " in the permutation " +
                       detail::shape_ops::list_str(dims) + " (expected each of 0.." + std::to_string(r - 1) +
                       " exactly once)");
    }
    seen[n] = 1;
    perm.push_back(n);
  }
  return detail::shape_ops::permute_impl(t, std::move(perm), "permute");
}
/// permute with a braced list: permute(x, {2, 0, 1}).
template <expr::ExprLike X>
auto permute(const X& x, std::initializer_list<std::int64_t> dims) {
  return permute(x, std::vector<std::int64_t>(dims));
}

/// Swaps dims d0 and d1 (a copy; for the last two dims a pending TransposeNode that a
/// matmul reads through without running it).
template <expr::ExprLike X>
auto transpose(const X& x, std::int64_t d0, std::int64_t d1) {
  auto t = detail::shape_ops::as_tensor(x);
  const int r = t.dim();
  const int a = normalize_dim(d0, r, "transpose"), b = normalize_dim(d1, r, "transpose");
  if (a == b || r == 0) return t;
  std::vector<int> perm(static_cast<std::size_t>(r));
  for (int i = 0; i < r; ++i) perm[i] = i;
  std::swap(perm[a], perm[b]);
  return detail::shape_ops::permute_impl(t, std::move(perm), "transpose");
}

/// torch's t(): the transpose of a 2-D tensor; 0-D and 1-D tensors are returned as is.
/// ShapeError for rank > 2.
template <expr::ExprLike X>
auto transpose(const X& x) {
  auto t = detail::shape_ops::as_tensor(x);
  if (t.dim() > 2) {
    throw ShapeError("transpose: t() expects a tensor with <= 2 dimensions, but got shape " + t.shape().str() +
                     " (" + std::to_string(t.dim()) + "-D)");
  }
  if (t.dim() < 2) return t;
  return transpose(t, 0, 1);
}

// ---- expand -------------------------------------------------------------------------------

/// Broadcasts x to `sizes` (torch.expand): new dims are prepended, a size-1 dim may grow,
/// -1 keeps a size. Materialized lazily by a broadcasting element-wise node.
template <expr::ExprLike X>
auto expand(const X& x, std::initializer_list<std::int64_t> sizes) {
  return detail::shape_ops::expand_impl(x, {sizes.begin(), sizes.size()});
}
/// expand with the sizes in a vector.
template <expr::ExprLike X>
auto expand(const X& x, const std::vector<std::int64_t>& sizes) {
  return detail::shape_ops::expand_impl(x, sizes);
}
/// expand to a Shape.
template <expr::ExprLike X>
auto expand(const X& x, const Shape& shape) {
  return detail::shape_ops::expand_impl(x, detail::shape_ops::span_of(shape));
}

// ---- slicing ------------------------------------------------------------------------------

/// Elements start, start + step, ... below end along `dim` (torch slicing x[start:end:step]):
/// negative start/end count from the back, both are clamped to [0, size]; step must be > 0.
/// A copy (buffers never start at an offset), except a full-range slice which is x itself.
template <expr::ExprLike X>
auto slice(const X& x, std::int64_t dim, std::int64_t start = 0,
           std::int64_t end = std::numeric_limits<std::int64_t>::max(), std::int64_t step = 1) {
  auto t = detail::shape_ops::as_tensor(x);
  using T = typename decltype(t)::value_type;
  const Shape& s = t.shape();
  if (s.rank() == 0) throw ShapeError("slice: cannot be applied to a 0-dim tensor (expected rank >= 1)");
  if (step <= 0) throw ShapeError("slice: step must be greater than zero, got " + std::to_string(step));
  const int d = normalize_dim(dim, s.rank(), "slice");
  const std::int64_t size = s[d];
  if (start < 0) start += size;
  if (end < 0) end += size;
  start = std::clamp<std::int64_t>(start, 0, size);
  end = std::clamp<std::int64_t>(end, start, size);
  const std::int64_t len = (end - start + step - 1) / step;
  if (start == 0 && len == size && (step == 1 || size <= 1)) return t;
  Shape out = s;
  out[d] = len;
  Tensor<T> r(graph::submit(std::make_shared<graph::SliceNode>("slice", t.node(), d, start, step, out)));
  detail::shape_ops::record_slice(r, t, d, start, step);
  return r;
}

/// `length` elements from `start` along `dim` (torch.narrow). start may be negative
/// (counting from the back); ShapeError if the range does not fit.
template <expr::ExprLike X>
auto narrow(const X& x, std::int64_t dim, std::int64_t start, std::int64_t length) {
  auto t = detail::shape_ops::as_tensor(x);
  using T = typename decltype(t)::value_type;
  const Shape& s = t.shape();
  if (s.rank() == 0) throw ShapeError("narrow: cannot be applied to a 0-dim tensor (expected rank >= 1)");
  const int d = normalize_dim(dim, s.rank(), "narrow");
  const std::int64_t size = s[d];
  if (start < -size || start > size) {
    throw ShapeError("narrow: start out of range (expected to be in range of [" + std::to_string(-size) + ", " +
                     std::to_string(size) + "], but got " + std::to_string(start) + ")");
  }
  if (start < 0) start += size;
  if (length < 0) throw ShapeError("narrow: length must be non-negative, got " + std::to_string(length));
  if (start > size - length) {
    throw ShapeError("narrow: start (" + std::to_string(start) + ") + length (" + std::to_string(length) +
                     ") exceeds dimension size (" + std::to_string(size) + ") of dimension " + std::to_string(d));
  }
  if (start == 0 && length == size) return t;
  Shape out = s;
  out[d] = length;
  Tensor<T> r(graph::submit(std::make_shared<graph::SliceNode>("narrow", t.node(), d, start, 1, out)));
  detail::shape_ops::record_slice(r, t, d, start, 1);
  return r;
}

// ---- cat / stack ----------------------------------------------------------------------------

/// Concatenates along `dim` (torch.cat). The tensors need the same rank and equal sizes
/// except in `dim` (ShapeError), and the same device (DeviceError). As in torch, 1-D empty
/// tensors (shape (0,)) are skipped whatever their rank.
template <Element T>
Tensor<T> cat(const std::vector<Tensor<T>>& tensors, std::int64_t dim = 0) {
  if (tensors.empty()) throw ShapeError("cat: expected a non-empty list of tensors, got an empty list");
  std::vector<Tensor<T>> ts;
  for (const auto& t : tensors)
    if (!(t.dim() == 1 && t.numel() == 0)) ts.push_back(t);
  if (ts.empty()) return tensors.front();
  const Shape& ref = ts.front().shape();
  const int r = ref.rank();
  if (r == 0) throw ShapeError("cat: zero-dimensional tensor (at position 0) cannot be concatenated (expected rank >= 1)");
  const int d = normalize_dim(dim, r, "cat");
  for (std::size_t i = 1; i < ts.size(); ++i) {
    const Shape& s = ts[i].shape();
    if (s.rank() != r) {
      throw ShapeError("cat: tensors must have the same number of dimensions: expected " + std::to_string(r) +
                       " (shape " + ref.str() + "), got " + std::to_string(s.rank()) + " (shape " + s.str() +
                       ") for tensor " + std::to_string(i));
    }
    for (int k = 0; k < r; ++k) {
      if (k != d && s[k] != ref[k]) {
        throw ShapeError("cat: sizes of tensors must match except in dimension " + std::to_string(d) +
                         ": expected size " + std::to_string(ref[k]) + " but got size " + std::to_string(s[k]) +
                         " in dimension " + std::to_string(k) + " for tensor " + std::to_string(i) + " (shapes " +
                         ref.str() + " and " + s.str() + ")");
      }
    }
  }
  auto nodes = detail::shape_ops::nodes_of(ts);
  graph::Device& dev = graph::common_device(nodes, "cat");
  if (ts.size() == 1) return ts.front();
  std::int64_t outer = 1, inner = 1, total = 0;
  for (int k = 0; k < d; ++k) outer *= ref[k];
  for (int k = d + 1; k < r; ++k) inner *= ref[k];
  std::vector<std::int64_t> widths;
  for (const auto& t : ts) {
    widths.push_back(t.shape()[d] * inner);
    total += t.shape()[d];
  }
  Shape out = ref;
  out[d] = total;
  Tensor<T> result(graph::submit(
      std::make_shared<graph::CatNode>("cat", dtype_of<T>(), std::move(nodes), out, &dev, outer, std::move(widths))));
  std::vector<std::int64_t> sizes;
  for (const auto& t : ts) sizes.push_back(t.shape()[d]);
  autograd::record(result, "CatBackward0", detail::shape_ops::edges_of(ts), [sizes, d](const Tensor<T>& g) {
    std::vector<graph::NodePtr> gs;
    std::int64_t off = 0;
    for (auto len : sizes) {
      gs.push_back(narrow(g, d, off, len).node());
      off += len;
    }
    return gs;
  });
  return result;
}
/// cat with a braced list: cat({a, b}, 1).
template <Element T>
Tensor<T> cat(std::initializer_list<Tensor<T>> tensors, std::int64_t dim = 0) {
  return cat(std::vector<Tensor<T>>(tensors), dim);
}

/// Stacks equal-shaped tensors along a new dim `dim` (in [-rank-1, rank]) (torch.stack).
template <Element T>
Tensor<T> stack(const std::vector<Tensor<T>>& tensors, std::int64_t dim = 0) {
  if (tensors.empty()) throw ShapeError("stack: expected a non-empty list of tensors, got an empty list");
  const Shape& ref = tensors.front().shape();
  for (std::size_t i = 1; i < tensors.size(); ++i) {
    if (!(tensors[i].shape() == ref)) {
      throw ShapeError("stack: expected each tensor to be equal size, but got " + ref.str() + " at entry 0 and " +
                       tensors[i].shape().str() + " at entry " + std::to_string(i));
    }
  }
  if (ref.rank() >= kMaxRank) {
    throw ShapeError("stack: the result would have rank " + std::to_string(ref.rank() + 1) + ", expected at most " +
                     std::to_string(kMaxRank));
  }
  const int d = normalize_dim(dim, ref.rank() + 1, "stack");
  auto nodes = detail::shape_ops::nodes_of(tensors);
  graph::Device& dev = graph::common_device(nodes, "stack");
  if (tensors.size() == 1) return unsqueeze(tensors.front(), d);
  std::int64_t outer = 1, inner = 1;
  for (int k = 0; k < d; ++k) outer *= ref[k];
  for (int k = d; k < ref.rank(); ++k) inner *= ref[k];
  Shape out;
  for (int k = 0; k <= ref.rank(); ++k) {
    if (k == d) out.push_back(static_cast<std::int64_t>(tensors.size()));
    if (k < ref.rank()) out.push_back(ref[k]);
  }
  std::vector<std::int64_t> widths(tensors.size(), inner);
  Tensor<T> r(graph::submit(
      std::make_shared<graph::CatNode>("stack", dtype_of<T>(), std::move(nodes), out, &dev, outer, std::move(widths))));
  autograd::record(r, "StackBackward0", detail::shape_ops::edges_of(tensors),
                   [n = tensors.size(), d, ref](const Tensor<T>& g) {
                     std::vector<graph::NodePtr> gs;
                     for (std::size_t i = 0; i < n; ++i) {
                       gs.push_back(reshape(narrow(g, d, static_cast<std::int64_t>(i), 1), ref).node());
                     }
                     return gs;
                   });
  return r;
}
/// stack with a braced list: stack({a, b}, 0).
template <Element T>
Tensor<T> stack(std::initializer_list<Tensor<T>> tensors, std::int64_t dim = 0) {
  return stack(std::vector<Tensor<T>>(tensors), dim);
}

// ---- indexing ---------------------------------------------------------------------------

/// The slices of x at positions `index` (1-D, int32 or int64) along `dim`
/// (torch.index_select). Index values outside [0, size) raise IndexError when the kernel
/// runs (at the next mark_step or read), since the index may still be pending here.
template <expr::ExprLike X, IndexElement I>
auto index_select(const X& x, std::int64_t dim, const Tensor<I>& index) {
  auto t = detail::shape_ops::as_tensor(x);
  using T = typename decltype(t)::value_type;
  const Shape& s = t.shape();
  if (index.dim() > 1) {
    throw ShapeError("index_select: index must be a 1-D tensor (or 0-D), got shape " + index.shape().str());
  }
  const int d = normalize_dim(dim, s.rank(), "index_select");
  Shape out = s;
  if (s.rank() == 0) {
    if (index.numel() != 1) {
      throw ShapeError("index_select: a 0-dim input takes an index of exactly one element, got shape " +
                       index.shape().str());
    }
  } else {
    out[d] = index.numel();
  }
  graph::common_device({t.node(), index.node()}, "index_select");
  Tensor<T> r(graph::submit(std::make_shared<graph::IndexSelectNode<I>>(t.node(), index.node(), d, out)));
  if constexpr (is_floating_v<T>) {
    autograd::record(r, "IndexSelectBackward0", {autograd::edge_of(t.impl())},
                     [in = s, d, idx = index.detach()](const Tensor<T>& g) {
                       return std::vector<graph::NodePtr>{
                           graph::submit(std::make_shared<graph::IndexAddNode<T, I>>(g.node(), idx.node(), in, d))};
                     });
  }
  return r;
}

/// torch.gather: out[i][j][k] = x[index[i][j][k]][j][k] for dim 0 (likewise for the other
/// dims). index has x's rank and index.size(d) <= x.size(d) for d != dim (ShapeError); the
/// result has index's shape. Out-of-range values raise IndexError when the kernel runs.
template <expr::ExprLike X, IndexElement I>
auto gather(const X& x, std::int64_t dim, const Tensor<I>& index) {
  auto t = detail::shape_ops::as_tensor(x);
  using T = typename decltype(t)::value_type;
  const Shape& s = t.shape();
  const Shape& is = index.shape();
  if (is.rank() != s.rank()) {
    throw ShapeError("gather: index tensor must have the same number of dimensions as the input: expected " +
                     std::to_string(s.rank()) + " (input shape " + s.str() + "), got " + std::to_string(is.rank()) +
                     " (index shape " + is.str() + ")");
  }
  const int d = normalize_dim(dim, s.rank(), "gather");
  for (int k = 0; k < s.rank(); ++k) {
    if (k != d && is[k] > s[k]) {
      throw ShapeError("gather: size of index (" + std::to_string(is[k]) + ") must not exceed the input's size (" +
                       std::to_string(s[k]) + ") in dimension " + std::to_string(k) + " (index shape " + is.str() +
                       ", input shape " + s.str() + ", gather dim " + std::to_string(d) + ")");
    }
  }
  graph::common_device({t.node(), index.node()}, "gather");
  Tensor<T> r(graph::submit(std::make_shared<graph::GatherNode<I>>(t.node(), index.node(), d)));
  if constexpr (is_floating_v<T>) {
    autograd::record(r, "GatherBackward0", {autograd::edge_of(t.impl())},
                     [in = s, d, idx = index.detach()](const Tensor<T>& g) {
                       return std::vector<graph::NodePtr>{
                           graph::submit(std::make_shared<graph::ScatterAddNode<T, I>>(g.node(), idx.node(), in, d))};
                     });
  }
  return r;
}

/// torch.nn.functional.one_hot: int64 tensor of shape index.shape + (num_classes,) with a 1
/// at each index value. num_classes = -1 means max(index) + 1, which needs the values now:
/// that form materializes `index` (an implicit sync of just what index needs). Values < 0
/// or >= num_classes raise IndexError (when the kernel runs, for an explicit num_classes).
template <IndexElement I>
Tensor<std::int64_t> one_hot(const Tensor<I>& index, std::int64_t num_classes = -1) {
  if (num_classes < -1) {
    throw ShapeError("one_hot: num_classes must be -1 (infer) or >= 0, got " + std::to_string(num_classes));
  }
  if (index.dim() >= kMaxRank) {
    throw ShapeError("one_hot: the result would have rank " + std::to_string(index.dim() + 1) +
                     ", expected at most " + std::to_string(kMaxRank) + " (index shape " + index.shape().str() + ")");
  }
  if (num_classes == -1) {
    if (index.numel() == 0) {
      throw ShapeError("one_hot: cannot infer the number of classes from an empty index tensor (shape " +
                       index.shape().str() + "); pass num_classes");
    }
    const I* p = index.data();
    const auto [lo, hi] = std::minmax_element(p, p + index.numel());
    if (*lo < 0) throw IndexError("one_hot: class values must be non-negative, found " + std::to_string(*lo));
    num_classes = static_cast<std::int64_t>(*hi) + 1;
  }
  Shape out = index.shape();
  out.push_back(num_classes);
  return Tensor<std::int64_t>(graph::submit(std::make_shared<graph::OneHotNode<I>>(index.node(), num_classes, out)));
}

}  // namespace lazy
