#pragma once
// Running a fused element-wise group (a PlanStep with several members): every chunk of
// kFusionChunk elements goes through each member in order, so intermediates stay in cache.
// Members needed outside the group are written whole, the others only to a per-task
// scratch chunk; a reduction ending the group reduces each chunk to a partial.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include <lazytensor/core/config.hpp>
#include <lazytensor/core/counters.hpp>
#include <lazytensor/core/tuning.hpp>
#include <lazytensor/core/vectorizer_barrier.hpp>
#include <lazytensor/graph/parallel.hpp>
#include <lazytensor/graph/plan.hpp>

namespace lazy::graph::detail {

/// The members of a fused group, seen in the step's node list through the plan's
/// positions (no copies of the node references: a group of 64 tiny statements would pay
/// 128 atomic reference-count updates for them).
class GroupMembers {
 public:
  GroupMembers(std::span<const NodePtr> nodes, const PlanStep& st) : nodes_(nodes), pos_(st.members) {}
  std::size_t size() const { return pos_.size(); }
  const NodePtr& operator[](std::size_t j) const { return nodes_[static_cast<std::size_t>(pos_[j])]; }

 private:
  std::span<const NodePtr> nodes_;
  const std::vector<std::int32_t>& pos_;
};

/// An input from outside a fused group that a whole member may take over (donation): how
/// many references the members hold, and the last member reading it.
struct DonorCandidate {
  const NodePtr* node;
  long holders;
  std::size_t last_reader;
};

/// The group's outside inputs, in member order (see group_output).
std::vector<DonorCandidate> donor_candidates(const PlanStep& st, const GroupMembers& members);

/// The whole output buffer of group member `j`: the buffer of an outside input of the
/// group it may overwrite (donation), else one from the pool. An input can be donated when
/// it has the member's dtype and size, only group members hold it, and no member after `j`
/// reads it: within a chunk, members run in order, so every read of that chunk of the
/// input happens before `j` writes it (a chain of in-place updates ends in its first
/// input's buffer).
std::shared_ptr<Buffer> group_output(ExecContext& ctx, const std::vector<DonorCandidate>& donors,
                                     const NodePtr& me, std::size_t j);

/// Bytes per element a group reads from outside buffers, each buffer counted once, when
/// they reach `least` bytes over its `n` elements; else 0.
template <class Input>
std::int64_t outside_bytes(const std::vector<Input>& in, std::int64_t n, std::int64_t least) {
  std::size_t upper = 0;  // counting a buffer read twice twice: enough to rule out most groups
  for (const Input& x : in)
    if (x.src < 0) upper += x.esz;
  if (n * static_cast<std::int64_t>(upper) < least) return 0;
  std::size_t bytes = 0;
  for (std::size_t i = 0; i < in.size(); ++i) {
    const Input& x = in[i];
    if (x.src >= 0 || x.esz == 0) continue;
    const bool seen =
        std::any_of(in.begin(), in.begin() + static_cast<std::ptrdiff_t>(i),
                    [&](const Input& y) { return y.src < 0 && y.esz != 0 && y.base == x.base; });
    if (!seen) bytes += x.esz;
  }
  const std::int64_t total = n * static_cast<std::int64_t>(bytes);
  return total < least ? 0 : total;
}

/// One run of a fused group. The bookkeeping is in flat arrays (no allocation per member):
/// a step of 100 tiny statements is two groups of a few allocations each. A reduction ending the group reduces each
/// chunk to a partial (one per chunk, so the result does not depend on the task split).
class GroupRun {
 public:
  GroupRun(ExecContext& ctx, const PlanStep& st, const GroupMembers& members);
  /// Runs every chunk (over the device's threads) and hands the members their outputs.
  void run();

 private:
  struct Member {
    const ElementwiseNode* ew;  // null for the reduction ending the group
    const ElementwiseKernel* kernel;
    const char* splat;
    bool contig;
    std::size_t esz, scratch_off, first_in, num_in;
  };
  struct Input {
    const std::byte* base;  // an outside input's buffer, or null (a member's output)
    std::size_t esz;        // bytes per element, 0 for a broadcast single element
    std::int32_t src;       // the producing member, or -1
  };

  void describe_members();
  void allocate_outputs();
  void choose_slices();
  void choose_streams();
  void run_task(std::int64_t t);
  void finish();

  ExecContext& ctx_;
  const PlanStep& st_;
  const GroupMembers& members_;
  std::size_t k_;
  std::int64_t n_;
  std::vector<Member> mem_;
  std::vector<Input> in_;
  ChunkReduction* reduction_ = nullptr;
  std::size_t per_task_ = 0;  // scratch bytes per task
  double cost_ = 0;
  std::vector<std::shared_ptr<Buffer>> out_;
  std::vector<std::byte*> out_ptr_;
  std::int64_t chunks_ = 0, tasks_ = 0, slice_ = 0;
  std::size_t partial_bytes_ = 0;
  std::shared_ptr<Buffer> partials_, scratch_;
  std::vector<std::uint8_t> stream_, copy_out_, slice_long_;
  bool any_stream_ = false;
};

/// Runs a fused group (see GroupRun).
inline void run_group(ExecContext& ctx, const PlanStep& st, const GroupMembers& members) {
  GroupRun(ctx, st, members).run();
}

}  // namespace lazy::graph::detail

#if LAZYTENSOR_HEADER_DEFINITIONS
namespace lazy::graph::detail {

LAZYTENSOR_INLINE std::vector<DonorCandidate> donor_candidates(const PlanStep& st, const GroupMembers& members) {
  std::vector<DonorCandidate> c;
  for (std::size_t m = 0; m < members.size(); ++m) {
    const auto& ins = members[m]->inputs();
    for (std::size_t q = 0; q < ins.size(); ++q) {
      if (st.sources[m][q] >= 0) continue;
      auto it = std::find_if(c.begin(), c.end(), [&](const DonorCandidate& d) { return *d.node == ins[q]; });
      if (it == c.end()) {
        c.push_back({&ins[q], 1, m});
      } else {
        ++it->holders;
        it->last_reader = m;
      }
    }
  }
  return c;
}

LAZYTENSOR_INLINE std::shared_ptr<Buffer> group_output(ExecContext& ctx, const std::vector<DonorCandidate>& donors,
                                                       const NodePtr& me, std::size_t j) {
  for (const auto& d : donors) {
    const NodePtr& x = *d.node;
    if (d.last_reader > j || x->dtype() != me->dtype() || x->numel() != me->numel()) continue;
    if (auto b = Node::take_buffer(x, d.holders)) {
      static auto& donated = core::counter("DonatedBuffers");
      donated.add();
      return b;
    }
  }
  return output_buffer(ctx.device.pool(), padded_bytes(me->numel(), dtype_size(me->dtype())));
}

LAZYTENSOR_INLINE GroupRun::GroupRun(ExecContext& ctx, const PlanStep& st, const GroupMembers& members)
    : ctx_(ctx), st_(st), members_(members), k_(members.size()), n_(members[0]->numel()) {}

LAZYTENSOR_INLINE void GroupRun::run() {
  describe_members();
  allocate_outputs();
  choose_slices();
  choose_streams();
  ctx_.device.threads().parallel_for(tasks_, [this](std::int64_t t) { run_task(t); });
  finish();
}

// The members' kernels and where each reads its inputs; the scratch each non-whole member
// needs per task.
LAZYTENSOR_INLINE void GroupRun::describe_members() {
  mem_.resize(k_);
  in_.reserve(k_ * 2);
  for (std::size_t j = 0; j < k_; ++j) {
    Member& m = mem_[j];
    m.ew = nullptr;
    m.kernel = nullptr;
    m.splat = nullptr;
    m.contig = true;
    if (members_[j]->kind() == NodeKind::Elementwise) {
      m.ew = static_cast<const ElementwiseNode*>(members_[j].get());
      m.kernel = &m.ew->kernel();
      m.splat = m.ew->layout().splat.data();
      m.contig = !m.ew->layout().any_splat();
      cost_ += m.ew->kernel().cost();
    } else {
      reduction_ = dynamic_cast<ChunkReduction*>(members_[j].get());  // the last member (plan.hpp)
      cost_ += members_[j]->cost_per_element();
    }
    m.esz = dtype_size(members_[j]->dtype());
    m.scratch_off = 0;
    m.first_in = in_.size();
    const auto& ins = members_[j]->inputs();
    m.num_in = ins.size();
    for (std::size_t q = 0; q < ins.size(); ++q) {
      // Read every outside input's address before any output is allocated: a donated
      // input's buffer moves to the output (same memory).
      const std::int32_t src = st_.sources[j][q];
      in_.push_back({src < 0 ? static_cast<const std::byte*>(ins[q]->buffer()->data()) : nullptr,
                     ins[q]->numel() == 1 && n_ != 1 ? 0 : dtype_size(ins[q]->dtype()), src});
    }
    if (!st_.whole[j] && m.ew) {
      // A chunk, or the whole tensor when it is shorter.
      m.scratch_off = per_task_;
      per_task_ += padded_bytes(std::min(kFusionChunk, n_), m.esz);
    }
  }
}

// Whole outputs (members needed outside the group), donated or from the pool, and the
// reduction's partials.
LAZYTENSOR_INLINE void GroupRun::allocate_outputs() {
  out_.resize(k_);
  out_ptr_.assign(k_, nullptr);
  const auto donors = donor_candidates(st_, members_);
  for (std::size_t j = 0; j < k_; ++j) {
    if (!st_.whole[j] || !mem_[j].ew) continue;
    out_[j] = group_output(ctx_, donors, members_[j], j);
    out_ptr_[j] = static_cast<std::byte*>(out_[j]->data());
  }
  chunks_ = (n_ + kFusionChunk - 1) / kFusionChunk;
  tasks_ = std::max<std::int64_t>(1, std::min(chunks_, task_count(ctx_.device.threads(), n_, cost_)));
  partial_bytes_ = reduction_ ? reduction_->partial_bytes() : 0;
  if (reduction_) partials_ = ctx_.device.pool().acquire(padded_bytes(chunks_, partial_bytes_));
}

// Groups reading more than L2 holds run each chunk in slices, every member over a slice
// before the next: member by member over a whole chunk, only one member's inputs stream
// from memory at a time, and the loads missing the cache are too sparse in the
// instruction stream to keep enough of them in flight. Shorter slices for inputs from
// memory than for inputs from the last-level cache, where the kernel calls per slice
// cost more than the loads gain (measured, docs/architecture.md).
LAZYTENSOR_INLINE void GroupRun::choose_slices() {
  const core::Tuning& tune = core::tuning();
  const std::int64_t reads = outside_bytes(in_, n_, tune.fusion_slice_bytes);
  slice_ = reads == 0                            ? kFusionChunk
           : reads >= tune.streaming_store_bytes ? kFusionMemorySlice
                                                 : kFusionSlice;
  if (slice_ < kFusionChunk) {
    static auto& sliced = core::counter("SlicedGroups");
    sliced.add();
  }
}

// Whole outputs too large for the cache that no later member reads are streamed (as a
// single statement does): the cache keeps the chunk's inputs instead.
// A sliced group streams the ones a later member reads too: the member writes its slice
// to scratch, where the readers find it in cache, and the slice is then copied out with
// non-temporal stores. Stored through the cache instead, each output line would first be
// read from memory (two extra streams for t1, t2 in `t1 = a*b + c; t2 = relu(t1)*d;
// y = t2 - 0.5*a` with all three kept).
LAZYTENSOR_INLINE void GroupRun::choose_streams() {
  stream_.assign(k_, 0);
  copy_out_.assign(k_, 0);
  const std::int64_t streaming_bytes = core::tuning().streaming_store_bytes;
  for (std::size_t j = 0; j < k_; ++j) {
    if (!out_ptr_[j] || !mem_[j].ew->can_stream() || !mem_[j].contig ||
        n_ * static_cast<std::int64_t>(mem_[j].esz) < streaming_bytes)
      continue;
    bool read_later = false;
    for (std::size_t i = j + 1; i < k_; ++i)
      for (std::size_t q = 0; q < mem_[i].num_in; ++q)
        read_later = read_later || in_[mem_[i].first_in + q].src == static_cast<std::int32_t>(j);
    stream_[j] = read_later ? 0 : 1;
    copy_out_[j] = read_later && slice_ < kFusionChunk ? 1 : 0;
    any_stream_ = any_stream_ || stream_[j] || copy_out_[j];
    if (copy_out_[j]) {
      mem_[j].scratch_off = per_task_;
      per_task_ += padded_bytes(kFusionChunk, mem_[j].esz);
    }
  }
  if (per_task_) scratch_ = ctx_.device.pool().acquire(per_task_ * static_cast<std::size_t>(tasks_));
  // In a sliced group a member's scratch holds one slice (at its start), not a chunk: the
  // scratch of two members a chunk long fills L1 and, cycling through it, evicts the lines
  // the hardware prefetcher brought in for the outside inputs (hand-written loop nest of
  // the three statements at 2^24 floats: 12.5 ms with chunk-long scratch, 8.4 ms with
  // slice-long, 7.8 ms the single statement). The reduction ending a group reads its
  // inputs over the whole chunk, so the members it reads keep chunk-long scratch.
  slice_long_.assign(k_, 0);
  if (slice_ < kFusionChunk) {
    for (std::size_t j = 0; j < k_; ++j) slice_long_[j] = mem_[j].ew && (!out_ptr_[j] || copy_out_[j]) ? 1 : 0;
    if (reduction_)
      for (std::size_t q = 0; q < mem_[k_ - 1].num_in; ++q)
        if (const std::int32_t src = in_[mem_[k_ - 1].first_in + q].src; src >= 0)
          slice_long_[static_cast<std::size_t>(src)] = 0;
  }
}

// The chunks of task `t`, slice by slice through every member.
LAZYTENSOR_INLINE void GroupRun::run_task(std::int64_t t) {
  const std::size_t k = k_;
  const std::int64_t n = n_, slice = slice_;
  auto [c0, c1] = task_range(chunks_, tasks_, t);
  std::byte* mine =
      scratch_ ? static_cast<std::byte*>(scratch_->data()) + per_task_ * static_cast<std::size_t>(t) : nullptr;
  // Where each input (flat, in `in_` order) and each member's output is found: at
  // base + i * esz for element i of the group (outside buffers, whole outputs), of the
  // chunk (chunk-long scratch), or of the slice (slice-long scratch and broadcast
  // elements: esz 0, one place).
  struct Place {
    std::byte* base;
    std::size_t esz;
    bool in_chunk;
    std::byte* at_chunk(std::size_t b) const { return base + (in_chunk ? 0 : b * esz); }
  };
  auto output_place = [&](std::size_t p) -> Place {
    if (!mem_[p].ew) return {nullptr, 0, false};  // the reduction: no element-wise output
    if (out_ptr_[p] && !copy_out_[p]) return {out_ptr_[p], mem_[p].esz, false};
    return {mine + mem_[p].scratch_off, slice_long_[p] ? 0 : mem_[p].esz, true};
  };
  std::vector<Place> in_place(in_.size()), out_place(k);
  for (std::size_t i = 0; i < in_.size(); ++i)  // outside buffers are only read
    in_place[i] = in_[i].src < 0 ? Place{const_cast<std::byte*>(in_[i].base), in_[i].esz, false}
                                 : output_place(static_cast<std::size_t>(in_[i].src));
  for (std::size_t j = 0; j < k; ++j) out_place[j] = output_place(j);
  // The pointers for the first slice of the chunk starting at element `b`; kernels run
  // over [0, slice length).
  std::vector<const void*> ptrs(in_.size());
  std::vector<void*> outs(k);
  auto point = [&](std::size_t b) {
    for (std::size_t i = 0; i < in_.size(); ++i) ptrs[i] = in_place[i].at_chunk(b);
    for (std::size_t j = 0; j < k; ++j) outs[j] = out_place[j].at_chunk(b);
  };
  // From one slice to the next every pointer moves by the slice's bytes, slice-long
  // scratch and broadcast elements by none: a chunk's pointers are placed once and then
  // only advanced. The bookkeeping between kernel calls is what a sliced group costs over
  // a single statement, so the slice loop does no more than call and advance (with
  // scalar additions: see hide_from_vectorizer).
  std::vector<std::size_t> step(in_.size() + k);  // bytes per slice: the inputs, then the outputs
  for (std::size_t i = 0; i < in_.size(); ++i) step[i] = in_place[i].esz * static_cast<std::size_t>(slice);
  for (std::size_t j = 0; j < k; ++j) step[in_.size() + j] = out_place[j].esz * static_cast<std::size_t>(slice);
  struct Call {
    const ElementwiseKernel* kernel;
    const void* const* in;
    const char* splat;
    void* const* out;
    std::byte* copy_base;  // the whole output a slice in scratch is copied to, or null
    std::size_t esz;
    bool contig, stream;
  };
  std::vector<Call> calls;
  calls.reserve(k);
  for (std::size_t j = 0; j < k; ++j)
    if (mem_[j].ew)
      calls.push_back({mem_[j].kernel, ptrs.data() + mem_[j].first_in, mem_[j].splat, outs.data() + j,
                       copy_out_[j] ? out_ptr_[j] : nullptr, mem_[j].esz, mem_[j].contig, stream_[j] != 0});
  for (std::int64_t c = c0; c < c1; ++c) {
    const std::int64_t b = c * kFusionChunk, len = std::min(kFusionChunk, n - b);
    const auto ub = static_cast<std::size_t>(b);
    point(ub);
    for (std::int64_t s0 = 0;;) {
      const std::int64_t m = std::min(slice, len - s0);
      for (const Call& call : calls) {
        call.kernel->flat(call.in, call.splat, *call.out, 0, m, call.contig, call.stream);
        if (call.copy_base)
          expr::stream_copy(call.copy_base + (ub + static_cast<std::size_t>(s0)) * call.esz, *call.out,
                            static_cast<std::size_t>(m) * call.esz);
      }
      if ((s0 += slice) >= len) break;  // no pointer moves past the chunk's last slice
      for (std::size_t i = 0; i < ptrs.size(); ++i) {
        const std::byte* p = static_cast<const std::byte*>(ptrs[i]) + step[i];
        core::hide_from_vectorizer(p);
        ptrs[i] = p;
      }
      for (std::size_t j = 0; j < k; ++j) {
        std::byte* p = static_cast<std::byte*>(outs[j]) + step[ptrs.size() + j];
        core::hide_from_vectorizer(p);
        outs[j] = p;
      }
    }
    if (reduction_) {  // the last member, over the whole chunk: one partial, as unfused
      point(ub);       // the slices moved the pointers on
      reduction_->reduce_chunk(ptrs.data() + mem_[k - 1].first_in, len,
                               static_cast<std::byte*>(partials_->data()) +
                                   static_cast<std::size_t>(c) * partial_bytes_);
    }
  }
  if (any_stream_) expr::store_fence();
}

LAZYTENSOR_INLINE void GroupRun::finish() {
  for (std::size_t j = 0; j < k_; ++j) {
    if (mem_[j].ew)
      members_[j]->finish_with(std::move(out_[j]));
    else
      reduction_->finish_partials(ctx_, partials_->data(), chunks_);
  }
}

}  // namespace lazy::graph::detail
#endif  // LAZYTENSOR_HEADER_DEFINITIONS
