#pragma once
// SortIndicesNode, the kernel of sort, argsort and topk (ops/sort.hpp). It computes only the
// int64 positions of the first k elements of every row along `dim` in sorted order; the
// values are then a gather at those positions (GatherNode), so one kernel per element type
// serves the three ops, and the values' gradient is gather's scatter-add.
//
// The order is total, hence deterministic and stable: ties go by position, and NaN (floating
// types) ranks above every number, as torch orders it (last ascending, first descending),
// NaNs keeping their positions' order among themselves. A row is copied once into a scratch
// array; NaNs are set aside on the way (they need no comparison), every other value becomes
// an unsigned integer with the same order (flipped for descending) next to its position, so
// that the sort compares integers only, with no NaN branch and no separate tie-break: for a
// key of 4 bytes or less, key and position share one uint64 and a plain std::sort of
// uint64s is the stable sort (std::stable_sort would also allocate a buffer per row). A
// top-k only selects (nth_element) and sorts the k, O(n + k log k) instead of O(n log n).

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include <lazytensor/core/dtype.hpp>
#include <lazytensor/core/shape.hpp>
#include <lazytensor/graph/device.hpp>
#include <lazytensor/graph/node.hpp>
#include <lazytensor/graph/parallel.hpp>

namespace lazy::graph {

namespace detail::sorts {

/// An unsigned image of a value with the same order: ordered_bits(a) < ordered_bits(b)
/// exactly when a < b, for every value but NaN (set aside before), -0 and +0 mapping alike
/// since they compare equal (the tie then goes by position, as torch's stable sort does).
/// Floats: flipping every bit of a negative and the sign bit of a positive turns the
/// sign-magnitude order into the unsigned one; signed integers: flipping the sign bit.
template <Element T>
auto ordered_bits(T v) {
  if constexpr (std::is_same_v<T, bool>) {
    return static_cast<std::uint32_t>(v);
  } else if constexpr (std::is_same_v<T, std::int32_t>) {
    return static_cast<std::uint32_t>(v) ^ 0x80000000u;
  } else if constexpr (std::is_same_v<T, std::int64_t>) {
    return static_cast<std::uint64_t>(v) ^ (std::uint64_t{1} << 63);
  } else if constexpr (std::is_same_v<T, double>) {
    const auto b = std::bit_cast<std::uint64_t>(v == 0 ? 0.0 : v);
    return (b >> 63) ? ~b : b | (std::uint64_t{1} << 63);
  } else {  // float, and bfloat16 through float (exact)
    const float f = static_cast<float>(v);
    const auto b = std::bit_cast<std::uint32_t>(f == 0 ? 0.0f : f);
    return (b >> 31) ? ~b : b | 0x80000000u;
  }
}

template <Element T>
bool is_nan(T v) {
  if constexpr (is_floating_v<T>) return std::isnan(static_cast<compute_t<T>>(v));
  else return false;
}

/// A key of up to 32 bits and a position below 2^32 in one uint64, key above: the integer
/// order is (key, position), the stable order, and entries are 8 bytes to move.
struct PackedEntry {
  std::uint64_t bits;
  static PackedEntry make(std::uint64_t key, std::int64_t pos) {
    return {(key << 32) | static_cast<std::uint64_t>(pos)};
  }
  std::int64_t pos() const { return static_cast<std::int64_t>(bits & 0xffffffffu); }
  bool operator<(const PackedEntry& o) const { return bits < o.bits; }
};

/// A 64-bit key (double, int64) or a row of 2^32 elements or more: key and position apart,
/// compared in that order.
struct WideEntry {
  std::uint64_t key;
  std::int64_t position;
  static WideEntry make(std::uint64_t k, std::int64_t pos) { return {k, pos}; }
  std::int64_t pos() const { return position; }
  bool operator<(const WideEntry& o) const { return key != o.key ? key < o.key : position < o.position; }
};

/// Puts the first m of the f entries at `e` in order (all f when m >= f). Selecting first
/// is what makes a small top-k cheaper than a full sort.
template <class E>
void order_prefix(E* e, std::int64_t f, std::int64_t m) {
  if (m <= 0 || f <= 1) return;
  if (m < f) {
    std::nth_element(e, e + m, e + f);
    std::sort(e, e + m);
  } else {
    std::sort(e, e + f);
  }
}

}  // namespace detail::sorts

/// The positions, along `dim`, of the first k elements of each row of the input in sorted
/// order (ascending, or descending), as int64; the output is the input's shape with `dim`
/// of size k. A 0-d input counts as one row of one element. k <= the size of `dim` is the
/// caller's check (ops/sort.hpp), as are `dim`'s range.
template <Element T>
class SortIndicesNode final : public Node {
 public:
  /// `op` names the public op in dumps ("sort", "argsort", "topk"); a string literal.
  SortIndicesNode(const NodePtr& in, int dim, std::int64_t k, bool descending, const char* op)
      : Node(NodeKind::Reduction, DType::Int64, selected_shape(in->shape(), dim, k), in->device(), {in}),
        dim_(dim), k_(k), descending_(descending), op_(op) {}

  /// The output shape: `s` with `dim` of size k (a 0-d shape stays 0-d).
  static Shape selected_shape(Shape s, int dim, std::int64_t k) {
    if (s.rank() > 0) s[dim] = k;
    return s;
  }

  std::string op_name() const override { return op_; }
  std::string describe() const override {
    return std::string(op_) + "(%0, dim=" + std::to_string(dim_) + ", k=" + std::to_string(k_) +
           ", descending=" + (descending_ ? "true" : "false") + ")";
  }
  std::uint64_t structural_hash() const override {
    std::uint64_t h = hash_combine(Node::structural_hash(), static_cast<std::uint64_t>(dim_));
    h = hash_combine(h, static_cast<std::uint64_t>(k_));
    return hash_combine(h, descending_ ? 1u : 0u);
  }
  /// Comparisons per output element: a full sort's log n, a top-k's selection spread over k.
  double cost_per_element() const override {
    const Shape& s = inputs().empty() ? shape() : inputs()[0]->shape();
    const double n = s.rank() ? static_cast<double>(s[dim_]) : 1.0, k = std::max(1.0, static_cast<double>(k_));
    return (n + k * std::log2(k + 1)) / k;
  }
  /// Blocks along every dimension but the sorted one (each row is sorted alone).
  std::optional<BlockRule> block_rule() const override {
    if (shape().rank() == 0) return std::nullopt;
    return all_but_dim_rule(shape().rank(), dim_, 1);
  }
  NodePtr with_inputs(NodeList inputs, Shape, Device*) const override {
    return std::make_shared<SortIndicesNode>(inputs[0], dim_, k_, descending_, op_);
  }

 protected:
  void compute(ExecContext& ctx) override {
    Shape s = inputs()[0]->shape();
    if (s.rank() == 0) s = Shape{1};
    std::int64_t outer = 1, inner = 1;
    for (int d = 0; d < dim_; ++d) outer *= s[d];
    for (int d = dim_ + 1; d < s.rank(); ++d) inner *= s[d];
    const std::int64_t n = s[dim_];
    auto buf = allocate_output(ctx, false);
    if (numel() > 0) {  // then n >= k >= 1 and every row has elements
      const T* x = inputs()[0]->template data<T>();
      auto* out = static_cast<std::int64_t*>(buf->data());
      if constexpr (sizeof(decltype(detail::sorts::ordered_bits(T{}))) <= 4) {
        if (n <= (std::int64_t{1} << 32)) run<detail::sorts::PackedEntry>(ctx, x, out, outer, n, inner);
        else run<detail::sorts::WideEntry>(ctx, x, out, outer, n, inner);
      } else {
        run<detail::sorts::WideEntry>(ctx, x, out, outer, n, inner);
      }
    }
    set_buffer(std::move(buf));
  }

 private:
  /// Rows strided in memory (dim not last) are read a block of up to this many adjacent
  /// rows at a time, so that each cache line read serves several rows (16 floats: a line)...
  static constexpr std::int64_t kMaxColumns = 16;
  /// ...as long as the block's scratch stays within this many entries (2-4 MB a task; with
  /// a quarter of that, a (10000, 1000) float top-k along dim 0 took 1.5x as long).
  static constexpr std::int64_t kScratchEntries = std::int64_t{1} << 18;

  template <class E>
  void run(ExecContext& ctx, const T* x, std::int64_t* out, std::int64_t outer, std::int64_t n,
           std::int64_t inner) const {
    using U = decltype(detail::sorts::ordered_bits(T{}));
    const std::int64_t k = k_;
    const bool descending = descending_;
    const std::int64_t width =
        inner == 1 ? 1 : std::clamp<std::int64_t>(kScratchEntries / n, 1, std::min(inner, kMaxColumns));
    const std::int64_t blocks = (inner + width - 1) / width, units = outer * blocks;
    auto& pool = ctx.device.threads();
    const double cost = 1.0 + std::log2(static_cast<double>(n) + 1.0);
    const std::int64_t tasks = std::max<std::int64_t>(1, std::min(units, task_count(pool, outer * n * inner, cost)));
    // The key of a number: its order, reversed for descending (a complement within the key's
    // width), so that ascending integer order is the requested one either way.
    auto entry = [descending](T v, std::int64_t j) {
      const U b = detail::sorts::ordered_bits(v);
      return E::make(static_cast<std::uint64_t>(descending ? static_cast<U>(~b) : b), j);
    };
    pool.parallel_for(tasks, [&](std::int64_t t) {
      auto [u0, u1] = task_range(units, tasks, t);
      if (u0 >= u1) return;
      // One scratch array per task, not per row: rows reuse it. Entries are written before
      // they are read, so no initialization.
      std::unique_ptr<E[]> scratch(new E[static_cast<std::size_t>(width * n)]);
      // Per row of the block: how many entries are numbers (from the front; the NaNs fill
      // the row from the back, so in reverse position order, which the write undoes).
      std::array<std::int64_t, kMaxColumns> finite{}, back{};
      for (std::int64_t u = u0; u < u1; ++u) {
        const std::int64_t o = u / blocks, c0 = (u % blocks) * width, w = std::min(width, inner - c0);
        const T* base = x + o * n * inner + c0;
        if (inner == 1) {  // a contiguous row: read it straight
          E* row = scratch.get();
          std::int64_t f = 0, nb = n;
          for (std::int64_t j = 0; j < n; ++j) {
            if (detail::sorts::is_nan(base[j])) row[--nb] = E::make(0, j);
            else row[f++] = entry(base[j], j);
          }
          finite[0] = f;
        } else {
          for (std::int64_t b = 0; b < w; ++b) finite[b] = 0, back[b] = n;
          for (std::int64_t j = 0; j < n; ++j) {
            const T* src = base + j * inner;
            for (std::int64_t b = 0; b < w; ++b) {
              E* row = scratch.get() + b * n;
              if (detail::sorts::is_nan(src[b])) row[--back[b]] = E::make(0, j);
              else row[finite[b]++] = entry(src[b], j);
            }
          }
        }
        for (std::int64_t b = 0; b < w; ++b) {
          const std::int64_t f = finite[b], nans = n - f;
          // The numbers ranked among the first k: before the NaNs ascending, after them
          // descending.
          const std::int64_t m = descending ? std::clamp<std::int64_t>(k - nans, 0, f) : std::min(k, f);
          detail::sorts::order_prefix(scratch.get() + b * n, f, m);
        }
        // Rank r of row b; the NaN of rank i among the NaNs is at n - 1 - i.
        std::int64_t* dst = out + o * k * inner + c0;
        for (std::int64_t r = 0; r < k; ++r) {
          for (std::int64_t b = 0; b < w; ++b) {
            const E* row = scratch.get() + b * n;
            const std::int64_t f = finite[b], nans = n - f;
            const std::int64_t at = descending ? (r < nans ? n - 1 - r : r - nans) : (r < f ? r : n - 1 - (r - f));
            dst[r * inner + b] = row[at].pos();
          }
        }
      }
    });
  }

  int dim_;
  std::int64_t k_;
  bool descending_;
  const char* op_;
};

}  // namespace lazy::graph
