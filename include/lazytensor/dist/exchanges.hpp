#pragma once
// The exchange kernels of the tensor collectives (threads backend).
//
// Small messages (<= kInlineBytes per member) are copied into the members' slots and every
// member computes its whole output from the copies: one synchronization. Larger ones are
// read in place:
//  - all_reduce: member i reduces slice i of the result, reading every member's input in
//    rank order, into one output buffer shared by the whole group (marked shared, so never
//    donated: no device overwrites what another may still read); nothing is gathered afterwards
//    and the result is bitwise identical everywhere by construction;
//  - all_gather: each member copies its input into its block of a shared output;
//  - reduce_scatter, all_to_all: each member reads its part of every input;
//  - broadcast: every member's output is the source's buffer (no copy at all; marked shared).

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <span>
#include <utility>
#include <vector>

#include <lazytensor/core/config.hpp>
#include <lazytensor/core/small_vector.hpp>
#include <lazytensor/core/tuning.hpp>
#include <lazytensor/dist/collective_node.hpp>
#include <lazytensor/dist/reduce_op.hpp>
#include <lazytensor/graph/parallel.hpp>

namespace lazy::dist::detail {

/// Copies a `shape` block of `es`-byte elements between two strided layouts (strides in
/// elements), one memcpy per run of the longest suffix contiguous in both.
void copy_block(std::byte* dst, const std::array<std::int64_t, kMaxRank>& dstr,
                const std::byte* src, const std::array<std::int64_t, kMaxRank>& sstr,
                const Shape& shape, std::size_t es);

/// Publishes this member's inputs: copies into the slot when `copied`, else pointers (and,
/// when the group spans processes, the buffers holding them, so they can be sent from there).
void publish_inputs(Share& s, std::span<const std::byte* const> in,
                    std::span<const std::size_t> nbytes, bool copied, const CollectiveCall& c,
                    const ExchangeNode& node);

/// publish_inputs of one input.
inline void publish_input(Share& s, const std::byte* in, std::size_t nbytes, bool copied,
                          const CollectiveCall& c, const ExchangeNode& node) {
  publish_inputs(s, std::span(&in, 1), std::span(&nbytes, 1), copied, c, node);
}

/// all_reduce of one or several tensors of type T (coalesced: one round for all of them).
template <Element T>
class AllReduceExchange final : public ExchangeNode {
 public:
  AllReduceExchange(CollectiveCall call, graph::NodeList data,
                    const graph::NodePtr& after, graph::Device* device, ReduceOp op, double scale)
      : ExchangeNode(std::move(call), std::move(data), after, device), op_(op), scale_(scale) {}

 protected:
  std::vector<std::shared_ptr<Buffer>> run(graph::ExecContext& ctx) override {
    const CollectiveCall& c = call();
    const std::size_t k = data_count();
    std::vector<std::shared_ptr<Buffer>> outs(k);
    if (c.size() == 1) {
      for (std::size_t i = 0; i < k; ++i) {
        if (scale_ == 1.0) {
          outs[i] = data(i)->buffer();  // x op nothing = x: share the immutable input
          continue;
        }
        outs[i] = allocate(ctx, data(i)->numel(), sizeof(T));
        const T* in = data(i)->template data<T>();
        reduce_span<T>(op_, static_cast<T*>(outs[i]->data()), &in, 1, data(i)->numel(), scale_);
      }
      return outs;
    }
    // (Inline storage: a round of a few tensors allocates none of these.)
    core::SmallVector<std::int64_t, 9> offs;  // tensors laid end to end
    core::SmallVector<const std::byte*, 8> in;
    core::SmallVector<std::size_t, 8> nbytes;
    offs.assign(k + 1, 0);
    in.resize(k);
    nbytes.resize(k);
    std::size_t staged = 0;
    for (std::size_t i = 0; i < k; ++i) {
      offs[i + 1] = offs[i] + data(i)->numel();
      in[i] = bytes(i);
      nbytes[i] = static_cast<std::size_t>(data(i)->numel()) * sizeof(T);
      staged += align64(nbytes[i]);
    }
    const bool copied = staged <= kInlineBytes;
    const bool leader = c.slot == c.comm->leader();
    if (copied || leader) {
      for (std::size_t i = 0; i < k; ++i) outs[i] = allocate(ctx, data(i)->numel(), sizeof(T));
    }
    c.comm->exchange(
        c.slot, c.seq, c.sig,
        [&](Share& s) {
          publish_inputs(s, std::span<const std::byte* const>(in.data(), k),
                         std::span<const std::size_t>(nbytes.data(), k), copied, c, *this);
          if (!copied && leader) {
            for (auto& b : outs) b->mark_shared();
            s.buffers = outs;
          }
        },
        [&](const GroupComm::Round& r) {
          if (!copied && !leader) outs = r[c.comm->leader()].buffers;
          reduce(ctx, r, outs, std::span<const std::int64_t>(offs.data(), k + 1), copied);
        },
        !copied);
    return outs;
  }

 private:
  /// Reduces elements [b, e) of the end-to-end layout (all of it when `whole`, else this
  /// member's slice of the local members' share of the work), split across the device's
  /// workers.
  void reduce(graph::ExecContext& ctx, const GroupComm::Round& r,
              const std::vector<std::shared_ptr<Buffer>>& outs,
              std::span<const std::int64_t> offs, bool whole) const {
    const CollectiveCall& c = call();
    const int n = c.size();
    const std::int64_t total = offs.back();
    // (no structured bindings: clang 14 cannot capture them in the lambda below)
    const std::pair<std::int64_t, std::int64_t> range =
        whole ? std::pair<std::int64_t, std::int64_t>{0, total}
              : graph::task_range(total, c.comm->local_count(),
                                  c.comm->local_index(c.slot), 16);
    const std::int64_t b = range.first, e = range.second;
    if (b >= e) return;
    ThreadPool& pool = ctx.device.threads();
    const std::int64_t tasks = graph::task_count(pool, e - b, static_cast<double>(n));
    // When the inputs and the result together are this large, the result cannot stay in
    // cache for its readers anyway: write it around the cache (saves the read for
    // ownership of every output line).
    const bool stream = !whole && (n + 1) * total * static_cast<std::int64_t>(sizeof(T)) >=
                                      core::tuning().streaming_store_bytes;
    pool.parallel_for(tasks, [&](std::int64_t t) {
      const auto [tb, te] = graph::task_range(e - b, tasks, t, 16);
      std::int64_t lo = b + tb;
      const std::int64_t hi = b + te;
      auto i = static_cast<std::size_t>(std::upper_bound(offs.begin(), offs.end(), lo) -
                                        offs.begin() - 1);
      PtrList<const T> p(static_cast<std::size_t>(n));
      while (lo < hi) {
        while (offs[i + 1] <= lo) ++i;  // skip empty tensors
        const std::int64_t end = std::min(hi, offs[i + 1]), local = lo - offs[i];
        for (int q = 0; q < n; ++q) {
          p[static_cast<std::size_t>(q)] =
              reinterpret_cast<const T*>(r[c.slot_at(q)].data[i]) +
              local;
        }
        reduce_span<T>(op_, static_cast<T*>(outs[i]->data()) + local, p.data(), n, end - lo, scale_,
                       stream);
        lo = end;
      }
    });
  }

  ReduceOp op_;
  double scale_;
};

/// all_gather along `dim`: output block q (along dim) is group member q's input.
class AllGatherExchange final : public ExchangeNode {
 public:
  AllGatherExchange(CollectiveCall call, graph::NodePtr in, const graph::NodePtr& after,
                    graph::Device* device, int dim);

 protected:
  LAZYTENSOR_INLINE std::vector<std::shared_ptr<Buffer>> run(graph::ExecContext& ctx) override;

 private:
  int dim_;
};

/// reduce_scatter: member q gets shard q (along `dim`) of the reduction of every input.
template <Element T>
class ReduceScatterExchange final : public ExchangeNode {
 public:
  ReduceScatterExchange(CollectiveCall call, graph::NodePtr in, const graph::NodePtr& after,
                        graph::Device* device, ReduceOp op, double scale, int dim)
      : ExchangeNode(std::move(call), {std::move(in)}, after, device),
        op_(op),
        scale_(scale),
        dim_(dim) {}

 protected:
  std::vector<std::shared_ptr<Buffer>> run(graph::ExecContext& ctx) override {
    const CollectiveCall& c = call();
    const int n = c.size();
    const std::int64_t numel = data(0)->numel();
    if (n == 1 && scale_ == 1.0) return {data(0)->buffer()};
    const Shape& s = data(0)->shape();
    std::int64_t outer = 1, inner = 1;
    for (int d = 0; d < s.rank(); ++d) {
      if (d < dim_) outer *= s[d];
      if (d > dim_) inner *= s[d];
    }
    const std::int64_t run_len = s[dim_] / n * inner, row = s[dim_] * inner;
    std::vector<std::shared_ptr<Buffer>> outs{allocate(ctx, numel / n, sizeof(T))};
    T* out = static_cast<T*>(outs[0]->data());
    auto reduce_from = [&](auto&& input_of) {
      PtrList<const T> p(static_cast<std::size_t>(n));
      for (std::int64_t o = 0; o < outer; ++o) {
        for (int q = 0; q < n; ++q)
          p[static_cast<std::size_t>(q)] = input_of(q) + o * row + c.rank * run_len;
        reduce_span<T>(op_, out + o * run_len, p.data(), n, run_len, scale_);
      }
    };
    if (n == 1) {
      reduce_from([&](int) { return data(0)->template data<T>(); });
      return outs;
    }
    const std::size_t nbytes = static_cast<std::size_t>(numel) * sizeof(T);
    const bool copied = align64(nbytes) <= kInlineBytes;
    c.comm->exchange(
        c.slot, c.seq, c.sig,
        [&](Share& sh) { publish_input(sh, bytes(0), nbytes, copied, c, *this); },
        [&](const GroupComm::Round& r) {
          reduce_from([&](int q) {
            return reinterpret_cast<const T*>(
                r[c.slot_at(q)].data[0]);
          });
        },
        !copied);
    return outs;
  }

 private:
  ReduceOp op_;
  double scale_;
  int dim_;
};

/// all_to_all: member r splits its input in n chunks along `split`; member q's output is
/// chunk q of every member, concatenated along `concat` in rank order.
class AllToAllExchange final : public ExchangeNode {
 public:
  AllToAllExchange(CollectiveCall call, graph::NodePtr in, const graph::NodePtr& after,
                   graph::Device* device, int split, int concat);

 protected:
  LAZYTENSOR_INLINE std::vector<std::shared_ptr<Buffer>> run(graph::ExecContext& ctx) override;

 private:
  int split_, concat_;
};

/// broadcast: every member's output is the source member's input buffer.
class BroadcastExchange final : public ExchangeNode {
 public:
  BroadcastExchange(CollectiveCall call, graph::NodePtr in, const graph::NodePtr& after,
                    graph::Device* device, int src_slot);

 protected:
  LAZYTENSOR_INLINE std::vector<std::shared_ptr<Buffer>> run(graph::ExecContext&) override;

 private:
  int src_slot_;
};

}  // namespace lazy::dist::detail

#if LAZYTENSOR_HEADER_DEFINITIONS
namespace lazy::dist::detail {
LAZYTENSOR_INLINE void copy_block(std::byte* dst, const std::array<std::int64_t, kMaxRank>& dstr,
                                  const std::byte* src,
                                  const std::array<std::int64_t, kMaxRank>& sstr,
                                  const Shape& shape, std::size_t es) {
  if (shape.numel() == 0) return;
  std::int64_t run = 1;
  int d0 = shape.rank();
  while (d0 > 0 && sstr[d0 - 1] == run && dstr[d0 - 1] == run) run *= shape[--d0];
  std::int64_t count = 1;
  for (int d = 0; d < d0; ++d) count *= shape[d];
  std::array<std::int64_t, kMaxRank> idx{};
  std::int64_t so = 0, dof = 0;
  const std::size_t run_bytes = static_cast<std::size_t>(run) * es;
  for (std::int64_t it = 0; it < count; ++it) {
    std::memcpy(dst + dof * static_cast<std::int64_t>(es), src + so * static_cast<std::int64_t>(es),
                run_bytes);
    for (int d = d0 - 1; d >= 0; --d) {
      so += sstr[d];
      dof += dstr[d];
      if (++idx[d] < shape[d]) break;
      so -= sstr[d] * shape[d];
      dof -= dstr[d] * shape[d];
      idx[d] = 0;
    }
  }
}

LAZYTENSOR_INLINE void publish_inputs(Share& s, std::span<const std::byte* const> in,
                                      std::span<const std::size_t> nbytes, bool copied,
                                      const CollectiveCall& c, const ExchangeNode& node) {
  s.data.resize(in.size());
  s.bytes.assign(nbytes.begin(), nbytes.end());
  if (!copied) {
    for (std::size_t i = 0; i < in.size(); ++i) s.data[i] = in[i];
    if (c.comm->spans_processes()) {
      for (std::size_t i = 0; i < node.data_count(); ++i) s.keep.push_back(node.data(i)->buffer());
    }
    return;
  }
  std::size_t total = 0;
  for (auto b : nbytes) total += align64(b);
  std::byte* st = s.stage(total);
  for (std::size_t i = 0; i < in.size(); ++i) {
    if (nbytes[i]) std::memcpy(st, in[i], nbytes[i]);
    s.data[i] = st;
    st += align64(nbytes[i]);
  }
}

LAZYTENSOR_INLINE AllGatherExchange::AllGatherExchange(CollectiveCall call, graph::NodePtr in,
                                                       const graph::NodePtr& after,
                                                       graph::Device* device, int dim)
    : ExchangeNode(std::move(call), {std::move(in)}, after, device), dim_(dim) {}

LAZYTENSOR_INLINE std::vector<std::shared_ptr<Buffer>> AllGatherExchange::run(
    graph::ExecContext& ctx) {
  const CollectiveCall& c = call();
  const std::int64_t numel = data(0)->numel();
  if (c.size() == 1) return {data(0)->buffer()};
  const Shape& s = data(0)->shape();
  const std::size_t es = dtype_size(data(0)->dtype());
  const int n = c.size();
  std::int64_t outer = 1, inner = 1;  // input as [outer, inner], output as [outer, n * inner]
  for (int d = 0; d < s.rank(); ++d) (d < dim_ ? outer : inner) *= s[d];
  const std::size_t nbytes = static_cast<std::size_t>(numel) * es;
  const bool copied = align64(nbytes) <= kInlineBytes;
  const bool leader = c.slot == c.comm->leader();
  std::vector<std::shared_ptr<Buffer>> outs(1);
  if (copied || leader) outs[0] = allocate(ctx, numel * n, es);
  const std::byte* own = bytes(0);
  auto copy_rank = [&](std::byte* out, const std::byte* src, int q) {
    const auto row = static_cast<std::size_t>(inner) * es;
    for (std::int64_t o = 0; o < outer; ++o) {
      std::memcpy(out + (static_cast<std::size_t>(o) * static_cast<std::size_t>(n) +
                         static_cast<std::size_t>(q)) *
                            row,
                  src + static_cast<std::size_t>(o) * row, row);
    }
  };
  c.comm->exchange(
      c.slot, c.seq, c.sig,
      [&](Share& sh) {
        publish_input(sh, own, nbytes, copied, c, *this);
        if (!copied && leader) {
          outs[0]->mark_shared();
          sh.buffers = outs;
        }
      },
      [&](const GroupComm::Round& r) {
        if (!copied && !leader) outs = r[c.comm->leader()].buffers;
        auto* out = static_cast<std::byte*>(outs[0]->data());
        if (!copied) {
          copy_rank(out, own, c.rank);  // each member writes its own block of the shared output
          // ... and the local members share the blocks of members in other processes.
          const int locals = c.comm->local_count(), mine = c.comm->local_index(c.slot);
          for (int q = 0, k = 0; q < n; ++q) {
            const int slot = c.slot_at(q);
            if (c.comm->local_index(slot) >= 0) continue;
            if (k++ % locals == mine) copy_rank(out, r[slot].data[0], q);
          }
          return;
        }
        for (int q = 0; q < n; ++q)
          copy_rank(out, r[c.slot_at(q)].data[0], q);
      },
      !copied);
  return outs;
}

LAZYTENSOR_INLINE AllToAllExchange::AllToAllExchange(CollectiveCall call, graph::NodePtr in,
                                                     const graph::NodePtr& after,
                                                     graph::Device* device, int split, int concat)
    : ExchangeNode(std::move(call), {std::move(in)}, after, device),
      split_(split),
      concat_(concat) {}

LAZYTENSOR_INLINE std::vector<std::shared_ptr<Buffer>> AllToAllExchange::run(
    graph::ExecContext& ctx) {
  const CollectiveCall& c = call();
  const int n = c.size();
  if (n == 1) return {data(0)->buffer()};
  const Shape& s = data(0)->shape();
  const std::size_t es = dtype_size(data(0)->dtype());
  Shape chunk = s;
  chunk[split_] = s[split_] / n;
  Shape out_shape = chunk;
  out_shape[concat_] = chunk[concat_] * n;
  const auto sstr = contiguous_strides(s), ostr = contiguous_strides(out_shape);
  std::vector<std::shared_ptr<Buffer>> outs{allocate(ctx, out_shape.numel(), es)};
  auto* out = static_cast<std::byte*>(outs[0]->data());
  const std::size_t nbytes = static_cast<std::size_t>(s.numel()) * es;
  const bool copied = align64(nbytes) <= kInlineBytes;
  const auto ses = static_cast<std::int64_t>(es);
  c.comm->exchange(
      c.slot, c.seq, c.sig,
      [&](Share& sh) { publish_input(sh, bytes(0), nbytes, copied, c, *this); },
      [&](const GroupComm::Round& r) {
        for (int q = 0; q < n; ++q) {
          const std::byte* src = r[c.slot_at(q)].data[0] +
                                 c.rank * chunk[split_] * sstr[split_] * ses;
          copy_block(out + q * chunk[concat_] * ostr[concat_] * ses, ostr, src, sstr, chunk, es);
        }
      },
      !copied);
  return outs;
}

LAZYTENSOR_INLINE BroadcastExchange::BroadcastExchange(CollectiveCall call, graph::NodePtr in,
                                                       const graph::NodePtr& after,
                                                       graph::Device* device, int src_slot)
    : ExchangeNode(std::move(call), {std::move(in)}, after, device), src_slot_(src_slot) {}

LAZYTENSOR_INLINE std::vector<std::shared_ptr<Buffer>> BroadcastExchange::run(
    graph::ExecContext& ctx) {
  const CollectiveCall& c = call();
  if (c.size() == 1) return {data(0)->buffer()};
  std::vector<std::shared_ptr<Buffer>> outs(1);
  const std::size_t es = dtype_size(data(0)->dtype());
  const std::size_t nbytes = static_cast<std::size_t>(data(0)->numel()) * es;
  c.comm->exchange(
      c.slot, c.seq, c.sig,
      [&](Share& sh) {
        if (c.slot != src_slot_) return;
        data(0)->buffer()->mark_shared();
        sh.buffers = {data(0)->buffer()};
        if (c.comm->spans_processes()) {  // other processes get the bytes
          sh.data = {bytes(0)};
          sh.bytes = {nbytes};
          sh.keep = {data(0)->buffer()};
        }
      },
      [&](const GroupComm::Round& r) {
        const Share& src = r[src_slot_];
        if (!src.buffers.empty()) {
          outs[0] = src.buffers[0];
          return;
        }
        outs[0] = allocate(ctx, data(0)->numel(), es);  // the source is in another process
        if (nbytes) std::memcpy(outs[0]->data(), src.data[0], nbytes);
      },
      true);  // the source's share holds its buffer until everyone took it
  return outs;
}
}  // namespace lazy::dist::detail
#endif  // LAZYTENSOR_HEADER_DEFINITIONS
