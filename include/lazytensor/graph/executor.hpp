#pragma once
// Running plans: a step's collection (what mark_step computes), plan lookup in the cache,
// the execution of single nodes and of fused element-wise groups (chunk-interleaved), the
// hand-off to the device's executor thread, and the synchronous path used by reads and
// eager mode. Errors inside a plan return its unrun nodes to the trace (they stay pending)
// and are stored on the device, to be re-thrown at the next read or sync.

#include <algorithm>
#include <cstddef>
#include <cstdio>
#include <span>
#include <unordered_set>
#include <utility>
#include <vector>

#include <lazytensor/core/counters.hpp>
#include <lazytensor/core/small_vector.hpp>
#include <lazytensor/core/vectorizer_barrier.hpp>
#include <lazytensor/graph/parallel.hpp>
#include <lazytensor/graph/plan.hpp>

namespace lazy::graph {

namespace detail {

/// The nodes a traversal has met: searched in a short inline list first, in a hash set
/// once that fills. Reading one small statement (`sum(x).item()`) then allocates nothing
/// to remember it, while reading a whole training graph stays linear.
class SeenNodes {
 public:
  /// Adds `n`; false when it was already there.
  bool insert(const Node* n) {
    if (set_.empty()) {
      for (std::size_t i = 0; i < count_; ++i) {
        if (inline_[i] == n) return false;
      }
      if (count_ < kInline) {
        inline_[count_++] = n;
        return true;
      }
      set_.insert(inline_, inline_ + count_);
    }
    return set_.insert(n).second;
  }

 private:
  static constexpr std::size_t kInline = 16;
  const Node* inline_[kInline] = {};
  std::size_t count_ = 0;
  std::unordered_set<const Node*> set_;
};

}  // namespace detail

/// Pending nodes reachable from `roots`, producers before consumers (iterative DFS, so a
/// long chain of statements cannot overflow the stack).
inline std::vector<NodePtr> topological_order(std::span<const NodePtr> roots) {
  std::vector<NodePtr> order;
  detail::SeenNodes seen;
  struct Frame {
    Node* node;
    std::size_t next;  // the next input to look at
  };
  core::SmallVector<Frame, 16> stack;
  for (const auto& r : roots) {
    if (!r || !r->pending() || !seen.insert(r.get())) continue;
    stack.push_back({r.get(), 0});
    while (!stack.empty()) {
      Frame& top = stack.back();
      const auto& ins = top.node->inputs();
      if (top.next < ins.size()) {
        const NodePtr& in = ins[top.next++];
        if (in->pending() && seen.insert(in.get())) stack.push_back({in.get(), 0});
        continue;
      }
      // All inputs ordered: find the owning shared_ptr (the root or a consumer's input).
      Node* done = top.node;
      stack.pop_back();
      NodePtr owner;
      if (stack.empty()) {
        owner = r;
      } else {
        for (const auto& in : stack.back().node->inputs()) {
          if (in.get() == done) {
            owner = in;
            break;
          }
        }
      }
      order.push_back(std::move(owner));
    }
  }
  return order;
}

namespace detail {

/// The members of a fused group, seen in the step's node list through the plan's
/// positions (no copies of the node references: a group of 100 tiny statements would pay
/// 200 atomic reference-count updates for them).
class GroupMembers {
 public:
  GroupMembers(std::span<const NodePtr> nodes, const PlanStep& st)
      : nodes_(nodes), pos_(st.members) {}
  std::size_t size() const { return pos_.size(); }
  const NodePtr& operator[](std::size_t j) const {
    return nodes_[static_cast<std::size_t>(pos_[j])];
  }

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
inline std::vector<DonorCandidate> donor_candidates(const PlanStep& st,
                                                    const GroupMembers& members) {
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

/// The whole output buffer of group member `j`: the buffer of an outside input of the
/// group it may overwrite (donation), else one from the pool. An input can be donated when
/// it has the member's dtype and size, only group members hold it, and no member after `j`
/// reads it: within a chunk, members run in order, so every read of that chunk of the
/// input happens before `j` writes it (a chain of in-place updates ends in its first
/// input's buffer).
inline std::shared_ptr<Buffer> group_output(ExecContext& ctx, const std::vector<DonorCandidate>& donors,
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
  return ctx.device.pool().acquire(padded_bytes(me->numel(), dtype_size(me->dtype())));
}

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

/// Runs a fused group: every chunk of kFusionChunk elements goes through each member in
/// order; members needed outside the group are written whole, the others only to a
/// per-task scratch chunk. A reduction ending the group reduces each chunk to a partial
/// (one per chunk, so the result does not depend on the task split). The bookkeeping is
/// in flat arrays (no allocation per member): a step of 100 tiny statements is one group.
inline void run_group(ExecContext& ctx, const PlanStep& st, const GroupMembers& members) {
  const std::size_t k = members.size();
  const std::int64_t n = members[0]->numel();
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
  std::vector<Member> mem(k);
  std::vector<Input> in;
  in.reserve(k * 2);
  ChunkReduction* reduction = nullptr;
  std::size_t per_task = 0;
  double cost = 0;
  for (std::size_t j = 0; j < k; ++j) {
    Member& m = mem[j];
    m.ew = nullptr;
    m.kernel = nullptr;
    m.splat = nullptr;
    m.contig = true;
    if (members[j]->kind() == NodeKind::Elementwise) {
      m.ew = static_cast<const ElementwiseNode*>(members[j].get());
      m.kernel = &m.ew->kernel();
      m.splat = m.ew->layout().splat.data();
      m.contig = !m.ew->layout().any_splat();
      cost += m.ew->kernel().cost();
    } else {
      reduction = dynamic_cast<ChunkReduction*>(members[j].get());  // the last member (plan.hpp)
      cost += members[j]->cost_per_element();
    }
    m.esz = dtype_size(members[j]->dtype());
    m.scratch_off = 0;
    m.first_in = in.size();
    const auto& ins = members[j]->inputs();
    m.num_in = ins.size();
    for (std::size_t q = 0; q < ins.size(); ++q) {
      // Read every outside input's address before any output is allocated: a donated
      // input's buffer moves to the output (same memory).
      const std::int32_t src = st.sources[j][q];
      in.push_back({src < 0 ? static_cast<const std::byte*>(ins[q]->buffer()->data()) : nullptr,
                    ins[q]->numel() == 1 && n != 1 ? 0 : dtype_size(ins[q]->dtype()), src});
    }
    if (!st.whole[j] && m.ew) {
      m.scratch_off = per_task;
      per_task += padded_bytes(kFusionChunk, m.esz);
    }
  }
  std::vector<std::shared_ptr<Buffer>> out(k);
  std::vector<std::byte*> out_ptr(k, nullptr);
  const auto donors = donor_candidates(st, members);
  for (std::size_t j = 0; j < k; ++j) {
    if (!st.whole[j] || !mem[j].ew) continue;
    out[j] = group_output(ctx, donors, members[j], j);
    out_ptr[j] = static_cast<std::byte*>(out[j]->data());
  }
  auto& pool = ctx.device.threads();
  const std::int64_t chunks = (n + kFusionChunk - 1) / kFusionChunk;
  const std::int64_t tasks = std::max<std::int64_t>(1, std::min(chunks, task_count(pool, n, cost)));
  const std::size_t partial_bytes = reduction ? reduction->partial_bytes() : 0;
  std::shared_ptr<Buffer> partials =
      reduction ? ctx.device.pool().acquire(padded_bytes(chunks, partial_bytes)) : nullptr;
  // Whole outputs too large for the cache that no later member reads are streamed (as a
  // single statement does): the cache keeps the chunk's inputs instead.
  // A sliced group (below) streams the ones a later member reads too: the member writes
  // its slice to scratch, where the readers find it in cache, and the slice is then
  // copied out with non-temporal stores. Stored through the cache instead, each output
  // line would first be read from memory (two extra streams for t1, t2 in
  // `t1 = a*b + c; t2 = relu(t1)*d; y = t2 - 0.5*a` with all three kept).
  // Groups reading more than L2 holds run each chunk in slices, every member over a slice
  // before the next: member by member over a whole chunk, only one member's inputs stream
  // from memory at a time, and the loads missing the cache are too sparse in the
  // instruction stream to keep enough of them in flight. Shorter slices for inputs from
  // memory than for inputs from the last-level cache, where the kernel calls per slice
  // cost more than the loads gain (measured, docs/architecture.md).
  const std::int64_t reads = outside_bytes(in, n, kFusionSliceBytes);
  const std::int64_t slice = reads == 0                    ? kFusionChunk
                             : reads >= kFusionMemoryBytes ? kFusionMemorySlice
                                                           : kFusionSlice;
  if (slice < kFusionChunk) {
    static auto& sliced = core::counter("SlicedGroups");
    sliced.add();
  }
  std::vector<std::uint8_t> stream(k, 0), copy_out(k, 0);
  bool any_stream = false;
  for (std::size_t j = 0; j < k; ++j) {
    if (!out_ptr[j] || !mem[j].ew->can_stream() || !mem[j].contig ||
        n * static_cast<std::int64_t>(mem[j].esz) < expr::kStreamingStoreBytes)
      continue;
    bool read_later = false;
    for (std::size_t i = j + 1; i < k; ++i)
      for (std::size_t q = 0; q < mem[i].num_in; ++q)
        read_later = read_later || in[mem[i].first_in + q].src == static_cast<std::int32_t>(j);
    stream[j] = read_later ? 0 : 1;
    copy_out[j] = read_later && slice < kFusionChunk ? 1 : 0;
    any_stream = any_stream || stream[j] || copy_out[j];
    if (copy_out[j]) {
      mem[j].scratch_off = per_task;
      per_task += padded_bytes(kFusionChunk, mem[j].esz);
    }
  }
  std::shared_ptr<Buffer> scratch =
      per_task ? ctx.device.pool().acquire(per_task * static_cast<std::size_t>(tasks)) : nullptr;
  // In a sliced group a member's scratch holds one slice (at its start), not a chunk: the
  // scratch of two members a chunk long fills L1 and, cycling through it, evicts the lines
  // the hardware prefetcher brought in for the outside inputs (hand-written loop nest of
  // the three statements at 2^24 floats: 12.5 ms with chunk-long scratch, 8.4 ms with
  // slice-long, 7.8 ms the single statement). The reduction ending a group reads its
  // inputs over the whole chunk, so the members it reads keep chunk-long scratch.
  std::vector<std::uint8_t> slice_long(k, 0);
  if (slice < kFusionChunk) {
    for (std::size_t j = 0; j < k; ++j)
      slice_long[j] = mem[j].ew && (!out_ptr[j] || copy_out[j]) ? 1 : 0;
    if (reduction)
      for (std::size_t q = 0; q < mem[k - 1].num_in; ++q)
        if (const std::int32_t src = in[mem[k - 1].first_in + q].src; src >= 0)
          slice_long[static_cast<std::size_t>(src)] = 0;
  }
  pool.parallel_for(tasks, [&](std::int64_t t) {
    auto [c0, c1] = task_range(chunks, tasks, t);
    std::byte* mine =
        scratch ? static_cast<std::byte*>(scratch->data()) + per_task * static_cast<std::size_t>(t)
                : nullptr;
    // Where each input (flat, in `in` order) and each member's output is found: at
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
      if (!mem[p].ew) return {nullptr, 0, false};  // the reduction: no element-wise output
      if (out_ptr[p] && !copy_out[p]) return {out_ptr[p], mem[p].esz, false};
      return {mine + mem[p].scratch_off, slice_long[p] ? 0 : mem[p].esz, true};
    };
    std::vector<Place> in_place(in.size()), out_place(k);
    for (std::size_t i = 0; i < in.size(); ++i)  // outside buffers are only read
      in_place[i] = in[i].src < 0 ? Place{const_cast<std::byte*>(in[i].base), in[i].esz, false}
                                  : output_place(static_cast<std::size_t>(in[i].src));
    for (std::size_t j = 0; j < k; ++j) out_place[j] = output_place(j);
    // The pointers for the first slice of the chunk starting at element `b`; kernels run
    // over [0, slice length).
    std::vector<const void*> ptrs(in.size());
    std::vector<void*> outs(k);
    auto point = [&](std::size_t b) {
      for (std::size_t i = 0; i < in.size(); ++i) ptrs[i] = in_place[i].at_chunk(b);
      for (std::size_t j = 0; j < k; ++j) outs[j] = out_place[j].at_chunk(b);
    };
    // From one slice to the next every pointer moves by the slice's bytes, slice-long
    // scratch and broadcast elements by none: a chunk's pointers are placed once and then
    // only advanced. The bookkeeping between kernel calls is what a sliced group costs over
    // a single statement, so the slice loop does no more than call and advance (with
    // scalar additions: see hide_from_vectorizer).
    std::vector<std::size_t> step(in.size() + k);  // bytes per slice: the inputs, then the outputs
    for (std::size_t i = 0; i < in.size(); ++i)
      step[i] = in_place[i].esz * static_cast<std::size_t>(slice);
    for (std::size_t j = 0; j < k; ++j)
      step[in.size() + j] = out_place[j].esz * static_cast<std::size_t>(slice);
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
      if (mem[j].ew)
        calls.push_back({mem[j].kernel, ptrs.data() + mem[j].first_in, mem[j].splat,
                         outs.data() + j, copy_out[j] ? out_ptr[j] : nullptr, mem[j].esz,
                         mem[j].contig, stream[j] != 0});
    for (std::int64_t c = c0; c < c1; ++c) {
      const std::int64_t b = c * kFusionChunk, len = std::min(kFusionChunk, n - b);
      const auto ub = static_cast<std::size_t>(b);
      point(ub);
      for (std::int64_t s0 = 0;;) {
        const std::int64_t m = std::min(slice, len - s0);
        for (const Call& call : calls) {
          call.kernel->flat(call.in, call.splat, *call.out, 0, m, call.contig, call.stream);
          if (call.copy_base)
            expr::stream_copy(call.copy_base + (ub + static_cast<std::size_t>(s0)) * call.esz,
                              *call.out, static_cast<std::size_t>(m) * call.esz);
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
      if (reduction) {  // the last member, over the whole chunk: one partial, as unfused
        point(ub);      // the slices moved the pointers on
        reduction->reduce_chunk(ptrs.data() + mem[k - 1].first_in, len,
                                static_cast<std::byte*>(partials->data()) +
                                    static_cast<std::size_t>(c) * partial_bytes);
      }
    }
    if (any_stream) expr::store_fence();
  });
  for (std::size_t j = 0; j < k; ++j) {
    if (mem[j].ew)
      members[j]->finish_with(std::move(out[j]));
    else
      reduction->finish_partials(ctx, partials->data(), chunks);
  }
}

}  // namespace detail

/// Lets the step's element-wise nodes take over their GEMM producers (epilogue fusion).
/// Called on every step before planning and execution: it decides on this step's nodes.
inline void prepare(std::span<const NodePtr> nodes) {
  for (const auto& n : nodes) n->set_deferred(false);  // decisions of an earlier look (dumps) are redone
  for (const auto& n : nodes) n->fuse_producers();
}

/// The plan for `nodes` (in creation order), from the device's cache or newly built.
/// `step`: planning a mark_step (reads and eager ops do not count toward the re-planning
/// warning). `done`: receives the clock reading that ended PlanTime, for a caller that
/// runs the plan at once and can start ExecuteTime from it.
inline std::shared_ptr<const Plan> plan_for(Device& dev, const std::vector<NodePtr>& nodes,
                                            bool step, core::MetricClock::Ticks* done = nullptr) {
  static auto& cached = core::counter("CachedPlan");
  static auto& uncached = core::counter("UncachedPlan");
  static auto& plan_time = core::metric("PlanTime");
  const auto t0 = core::MetricClock::now();
  const std::uint64_t epoch = planner::number(nodes);
  std::vector<std::uint8_t> outside;
  auto sig = planner::signature(nodes, epoch, outside);
  const std::uint64_t h = planner::fold(sig);
  auto& cache = dev.plan_cache();
  auto& stats = dev.plan_stats();
  if (step) ++stats.steps;
  std::shared_ptr<const Plan> plan;
  if (auto hit = cache.find(h); hit && hit->signature == sig) {
    plan = std::move(hit);
    cached.add();
  } else {
    auto built = planner::build(nodes, epoch, outside);
    built->hash = h;
    built->signature = sig;
    plan = built;
    cache.insert(h, plan);
    uncached.add();
    if (step && stats.steps > 10) ++stats.rebuilds_after_warmup;
    // PyTorch/XLA warns about graphs that keep changing; so do we, naming what changed.
    // Judged once at least 10 steps followed the 10th, so one new shape is no alarm.
    if (step && !stats.warned && stats.steps >= 20 && stats.rebuilds_after_warmup * 2 > stats.steps - 10) {
      stats.warned = true;
      std::size_t at = 0;
      const auto& prev = stats.last_signature;
      while (at < sig.size() && at < prev.size() && sig[at] == prev[at]) ++at;
      const std::size_t node = at / 2;
      std::string what = node < nodes.size() ? nodes[node]->op_name() + " " + nodes[node]->describe() + " of shape " +
                                                   nodes[node]->shape().str()
                                             : "the number of nodes";
      std::fprintf(stderr,
                   "lazytensor warning: %s rebuilt its execution plan on %lld of %lld steps after the 10th; the "
                   "graph changes between steps (first difference from the previous step at node %zu: %s; this "
                   "step has %zu nodes, the previous one %zu). Keep shapes and the sequence of ops constant across "
                   "steps.\n",
                   dev.str().c_str(), static_cast<long long>(stats.rebuilds_after_warmup),
                   static_cast<long long>(stats.steps - 10), node, what.c_str(), nodes.size(), prev.size() / 2);
    }
  }
  if (step) stats.last_signature = std::move(sig);
  const auto t1 = core::MetricClock::now();
  plan_time.record(core::MetricClock::to_ns(t0, t1));
  if (done) *done = t1;
  return plan;
}

/// Puts the nodes of a step that did not run (or did not finish) back to pending and into
/// the trace, for a later step or read: nothing is lost when a step fails or is refused.
inline void return_to_trace(Device& device, std::span<const NodePtr> nodes) {
  std::vector<std::weak_ptr<Node>> back;
  for (const auto& n : nodes) {
    if (!n || n->materialized()) continue;
    n->set_deferred(false);
    n->set_state(Node::State::Pending);
    back.push_back(n);
  }
  device.keep_traced(std::move(back));
}

/// Runs `plan` over `nodes` (positions as planned). The plan's reference to each node is
/// dropped as it runs, so donation sees the true holders. On an error, the nodes not run
/// go back to pending (and to the device's trace) and the exception propagates.
/// `started`: when ExecuteTime starts (default: now).
inline void run_plan(Device& device, const Plan& plan, std::span<NodePtr> nodes,
                     const core::MetricClock::Ticks* started = nullptr) {
  static auto& execute_time = core::metric("ExecuteTime");
  static auto& kernels = core::counter("KernelsRun");
  static auto& fused = core::counter("FusedNodes");
  core::ScopedTimer timer(execute_time, started ? *started : core::MetricClock::now());
  ExecContext ctx{device};
  std::int64_t ran = 0;
  std::size_t step = 0;
  try {
    for (; step < plan.steps.size(); ++step) {
      const PlanStep& st = plan.steps[step];
      if (st.kind == PlanStep::Kind::Single) {
        NodePtr& n = nodes[static_cast<std::size_t>(st.members[0])];
        if (!n->materialized() && !n->deferred()) {
          n->run(ctx);
          ++ran;
        }
        n.reset();
        continue;
      }
      detail::run_group(ctx, st, detail::GroupMembers(nodes, st));
      for (auto m : st.members) nodes[static_cast<std::size_t>(m)].reset();
      ++ran;
      fused.add(static_cast<std::int64_t>(st.members.size()));
    }
  } catch (...) {
    kernels.add(ran);
    return_to_trace(device, nodes);
    throw;
  }
  kernels.add(ran);
}

/// Plans and runs `nodes` on the calling thread (the caller has waited for the queued
/// plans: execute does).
inline void execute_now(Device& device, std::vector<NodePtr> nodes) {
  if (nodes.empty()) return;
  prepare(nodes);
  // One clock reading ends PlanTime and starts ExecuteTime.
  core::MetricClock::Ticks planned = 0;
  auto plan = plan_for(device, nodes, false, &planned);
  for (auto& n : nodes) n->set_state(Node::State::Queued);
  run_plan(device, *plan, nodes, &planned);
}

/// True when `node` is pending and every input of it is materialized: its plan would be
/// the node alone.
inline bool runs_alone(const NodePtr& node) {
  if (!node || !node->pending()) return false;
  for (const auto& in : node->inputs())
    if (!in->materialized()) return false;
  return true;
}

/// The plan of one node run alone: a single step at position 0.
inline const Plan& single_node_plan() {
  static const Plan plan = [] {
    Plan p;
    p.steps.resize(1);
    p.steps[0].members = {0};
    p.num_nodes = 1;
    return p;
  }();
  return plan;
}

/// Materializes every pending node reachable from `roots` on `device`, now, on the
/// calling thread.
inline void execute(Device& device, std::span<const NodePtr> roots) {
  device.wait_idle();
  if (roots.size() == 1 && runs_alone(roots[0])) {
    // An eager op, or the read of a statement over materialized values: nothing to order,
    // plan or look up (so no PlanTime and no plan-cache counter), ~20% of the fixed cost
    // of such a read.
    NodePtr node = roots[0];
    prepare(std::span(&node, 1));
    node->set_state(Node::State::Queued);
    run_plan(device, single_node_plan(), std::span(&node, 1));
    return;
  }
  execute_now(device, topological_order(roots));
}

/// The nodes a step computes: every pending node of the trace that a live handle reaches,
/// in creation order. The rest (alive, but reachable only from expressions or dropped
/// values' consumers) stays traced for later steps.
inline std::vector<NodePtr> collect_step(Device& dev) {
  auto trace = dev.take_trace();
  std::vector<NodePtr> alive;
  alive.reserve(trace.size());
  for (auto& w : trace)
    if (auto n = w.lock(); n && n->pending()) alive.push_back(std::move(n));
  if (alive.empty()) return {};
  const std::uint64_t epoch = planner::number(alive);
  std::vector<std::uint8_t> needed(alive.size(), 0);
  dev.for_each_pending_root([&](const NodePtr& r) {
    if (const std::int32_t s = planner::slot_of(r, epoch); s >= 0) needed[static_cast<std::size_t>(s)] = 1;
  });
  // Consumers are newer than their inputs: one sweep from the newest marks everything needed.
  for (std::size_t i = alive.size(); i-- > 0;) {
    if (!needed[i]) continue;
    for (const auto& in : alive[i]->inputs())
      if (const std::int32_t s = planner::slot_of(in, epoch); s >= 0) needed[static_cast<std::size_t>(s)] = 1;
  }
  std::vector<NodePtr> run;
  std::vector<std::weak_ptr<Node>> keep;
  for (std::size_t i = 0; i < alive.size(); ++i) {
    if (needed[i]) run.push_back(std::move(alive[i]));
    else keep.push_back(alive[i]);
  }
  dev.keep_traced(std::move(keep));
  return run;
}

/// run_plan for a step nobody waits on: its error is stored on the device, to surface at
/// the next read or sync.
inline void run_plan_storing_error(Device& dev, const Plan& plan, std::vector<NodePtr>& nodes) {
  try {
    run_plan(dev, plan, nodes);
  } catch (...) {
    dev.store_error(std::current_exception());
  }
}

/// Runs a step: plans the collected nodes now (overlapping the previous step's
/// execution), hands the plan to the executor thread (or, with async off, runs it here),
/// then waits for the previous step. The plan is queued behind the running step before
/// that wait, so the executor goes from one step to the next without waiting for this
/// thread to wake (two thread wake-ups, 15-50 us each on a VM). Errors of an asynchronous
/// step are stored. A step cheaper than the hand-off (kInlineStepWork), or any step of a
/// device set to inline_steps, runs here once the queue is empty, its errors stored as if
/// it had run on the executor.
inline void run_step(Device& dev, std::vector<NodePtr> nodes) {
  if (nodes.empty()) return;
  prepare(nodes);
  auto plan = plan_for(dev, nodes, true);
  const bool queue = dev.async() && !dev.inline_steps() && plan->work >= kInlineStepWork;
  if (queue)
    dev.wait_below(2);
  else
    dev.wait_idle();
  // Read before the check below: a failure after it changes the count the job compares.
  const std::uint64_t failures = dev.failures();
  try {
    // A step ahead of this one failed while this one was planned: its nodes went back to
    // pending, and this step may read them. The error surfaces here (this mark_step is
    // the next sync); this step's nodes stay traced, never run on missing inputs.
    dev.rethrow_stored_error();
  } catch (...) {
    return_to_trace(dev, nodes);
    throw;
  }
  for (auto& n : nodes) n->set_state(Node::State::Queued);
  if (!dev.async()) {
    run_plan(dev, *plan, nodes);
    return;
  }
  if (!queue) {
    run_plan_storing_error(dev, *plan, nodes);
    return;
  }
  dev.enqueue([&dev, plan, failures, nodes = std::move(nodes)]() mutable {
    if (dev.failures() != failures) {
      // The step ahead failed after this one was queued (same reason as above): this one
      // does not run; its nodes wait in the trace for the next sync, which reports the
      // error.
      return_to_trace(dev, nodes);
      return;
    }
    run_plan_storing_error(dev, *plan, nodes);
  });
  dev.wait_below(2);  // the previous step is done (this one may still run)
}

}  // namespace lazy::graph
