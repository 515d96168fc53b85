#pragma once
// The planner: which pending nodes a step runs, in what order, grouped how, and the plan
// cache that lets a repeated step skip all of that.
//
// A step's nodes are taken in creation order (a valid topological order: inputs exist
// before their consumers). Its structural signature lists, per node, the node's own hash
// (op, kernel type, dtypes, shapes), where each input comes from (a node of this step, by
// position, or outside it) and whether anything outside the step still refers to the
// node (then its value must be written whole). Equal signatures get the same plan.
//
// Fusion across statements: element-wise nodes with flat layouts and the same number of
// elements (not necessarily adjacent in the program) form a group that runs chunk by chunk (each chunk through every member in
// order), so intermediates stay in cache; a member that nothing outside the group needs
// is computed into a chunk-sized scratch and never written whole. A reduction of every
// element of a child the group computes ends the group: it reduces each chunk as the chunk
// is made (see chunk_reduction.hpp).
//
// Collectives sink: a step's collectives (graph::Rendezvous nodes) wait in an open batch
// until a node reads one of them, and then run together (PlanStep::Kind::Batch). The
// gradient all-reduces of a data-parallel backward pass, which only the optimizer reads,
// become one meeting of the devices instead of one per gradient.

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include <lazytensor/core/small_vector.hpp>
#include <lazytensor/graph/chunk_reduction.hpp>
#include <lazytensor/graph/device.hpp>
#include <lazytensor/graph/elementwise_node.hpp>
#include <lazytensor/core/config.hpp>

namespace lazy::graph {

/// One unit of execution: a single node, a fused element-wise group, or a batch of
/// collectives (Rendezvous nodes) run phase by phase.
struct PlanStep {
  enum class Kind : std::uint8_t { Single, Group, Batch };
  Kind kind = Kind::Single;
  /// Plan positions of the members, in execution order.
  std::vector<std::int32_t> members;
  /// Per member: its value is written to a whole buffer (else only to chunk scratch).
  std::vector<std::uint8_t> whole;
  /// Per member, per input: the producing member's index in this group, or -1.
  std::vector<std::vector<std::int32_t>> sources;
};

/// What a step runs, reusable for every step with the same signature.
struct Plan {
  std::uint64_t hash = 0;
  std::vector<std::uint64_t> signature;
  std::vector<PlanStep> steps;
  std::size_t num_nodes = 0;
  std::int64_t fused_groups = 0, fused_members = 0;
  /// Estimated work (element operations: elements touched times cost per element).
  double work = 0;
};

/// Steps with less estimated work than this run on the thread calling mark_step: waking
/// the executor thread costs more (15-50 us measured on a VM, where a wake-up is an
/// inter-processor interrupt) than running them. About 10 us of work.
inline constexpr double kInlineStepWork = 1 << 14;

/// Elements a fused group processes per chunk: a reduction block (chunk_reduction.hpp),
/// 16 KiB of floats.
inline constexpr std::int64_t kFusionChunk = kReduceBlock;

/// Element-wise members a fused group holds at most (a reduction ending a full group is
/// one more, with no scratch); the next statement starts a new group. Each
/// member a later one reads in the group keeps a chunk of scratch per task (16 KiB of
/// floats): 64 of them already fill a core's L2, so a longer group gains no locality and
/// would hold scratch in proportion to its length (a chain of 100000 statements asked for
/// 1.6 GB).
inline constexpr std::size_t kMaxGroupMembers = 64;

/// Elements of the slices a group reading at least core::tuning().fusion_slice_bytes (what L2
/// holds) runs its chunks in (each member over one slice, then the next slice: see
/// run_group).
inline constexpr std::int64_t kFusionSlice = 256;
/// Elements of the slices of a group reading at least core::tuning().streaming_store_bytes:
/// its inputs come from memory, not the last-level cache (the size from which outputs are
/// stored non-temporally, for the same reason), and shorter slices keep more of the
/// streams' loads in flight.
inline constexpr std::int64_t kFusionMemorySlice = 128;

namespace detail {

std::uint64_t next_plan_epoch();

/// Numbers the nodes (plan_slot) for this planning pass.
std::uint64_t number_nodes(const NodeList& nodes);

inline std::int32_t plan_slot_of(const NodePtr& n, std::uint64_t epoch) {
  return n->plan_epoch == epoch ? n->plan_slot : -1;
}

/// An element-wise node that can run chunk by chunk with others: flat layout (every input
/// has the output's shape or one element), not running a GEMM producer's epilogue.
const ElementwiseNode* chunkable(const NodePtr& n);

/// A reduction that can end a group of `numel`-element chunks: it reduces every element
/// of a child with that many elements, each input having them all or one.
ChunkReduction* chunk_reduction(const NodePtr& n, std::int64_t numel);

/// A collective that runs in phases (Rendezvous), else null.
inline Rendezvous* rendezvous(const NodePtr& n) {
  return n->kind() == NodeKind::Collective ? dynamic_cast<Rendezvous*>(n.get()) : nullptr;
}

/// Writes into `sig` the signature (see the file comment) of `nodes`, numbered with
/// `epoch`, and into `outside` whether something outside the step refers to each node.
void plan_signature(const NodeList& nodes, std::uint64_t epoch,
                    std::vector<std::uint8_t>& outside, std::vector<std::uint64_t>& sig);

std::uint64_t fold_signature(const std::vector<std::uint64_t>& sig);

/// Groups `nodes` into steps (see the file comment). Several groups (one per element
/// count) may be open at once, so statements of different sizes interleaved in the
/// program (activations and weight gradients of a backward pass) still fuse by size. A
/// group's step is emitted when it closes: when a node outside it reads it, or at the end.
/// So every consumer comes after its producers: a non-member reading a group closes the
/// group first, and a member reading anything else reads a single step or a closed group
/// emitted earlier.
std::shared_ptr<Plan> build_plan(const NodeList& nodes, std::uint64_t epoch,
                                 const std::vector<std::uint8_t>& outside);

}  // namespace detail

}  // namespace lazy::graph

#if LAZYTENSOR_HEADER_DEFINITIONS
namespace lazy::graph::detail {

LAZYTENSOR_INLINE std::uint64_t next_plan_epoch() {
  thread_local std::uint64_t epoch = 0;
  // Mix in the thread so that two planners (devices in different threads) never share one.
  return (++epoch << 8) ^ reinterpret_cast<std::uintptr_t>(&epoch);
}

LAZYTENSOR_INLINE std::uint64_t number_nodes(const NodeList& nodes) {
  const std::uint64_t epoch = next_plan_epoch();
  for (std::size_t i = 0; i < nodes.size(); ++i) {
    nodes[i]->plan_slot = static_cast<std::int32_t>(i);
    nodes[i]->plan_epoch = epoch;
  }
  return epoch;
}

LAZYTENSOR_INLINE const ElementwiseNode* chunkable(const NodePtr& n) {
  if (n->kind() != NodeKind::Elementwise) return nullptr;
  const auto* e = static_cast<const ElementwiseNode*>(n.get());
  if (!e->layout().flat() || e->takes_producer() || n->numel() == 0) return nullptr;
  return e;
}

LAZYTENSOR_INLINE ChunkReduction* chunk_reduction(const NodePtr& n, std::int64_t numel) {
  if (n->kind() != NodeKind::Reduction || n->numel() != 1) return nullptr;
  auto* r = dynamic_cast<ChunkReduction*>(n.get());
  if (!r || !r->reduces_all()) return nullptr;
  bool reads_chunk = false;
  for (const auto& in : n->inputs()) {
    if (in->numel() != numel && in->numel() != 1) return nullptr;
    reads_chunk = reads_chunk || in->numel() == numel;
  }
  return reads_chunk ? r : nullptr;
}

LAZYTENSOR_INLINE void plan_signature(const NodeList& nodes,
    std::uint64_t epoch,
    std::vector<std::uint8_t>& outside,
    std::vector<std::uint64_t>& sig) {
  core::SmallVector<std::int32_t, 32> refs;  // a read of a few statements allocates nothing here
  refs.assign(nodes.size(), 0);
  for (const auto& n : nodes)
    for (const auto& in : n->inputs()) {
      const std::int32_t s = plan_slot_of(in, epoch);
      if (s >= 0) ++refs[static_cast<std::size_t>(s)];
    }
  sig.clear();
  sig.reserve(nodes.size() * 2);
  outside.assign(nodes.size(), 0);
  for (std::size_t i = 0; i < nodes.size(); ++i) {
    const auto& n = nodes[i];
    // References: the plan's own vector, the step's consumers, and everything else.
    outside[i] = n.use_count() > 1 + refs[i] ? 1 : 0;
    sig.push_back(n->hash());
    std::uint64_t wiring = outside[i];
    for (const auto& in : n->inputs()) wiring = hash_combine(wiring, static_cast<std::uint64_t>(plan_slot_of(in, epoch) + 1));
    sig.push_back(wiring);
  }
}

LAZYTENSOR_INLINE std::uint64_t fold_signature(const std::vector<std::uint64_t>& sig) {
  std::uint64_t h = sig.size();
  for (auto v : sig) h = hash_combine(h, v);
  return h;
}

LAZYTENSOR_INLINE std::shared_ptr<Plan> build_plan(const NodeList& nodes,
    std::uint64_t epoch,
    const std::vector<std::uint8_t>& outside) {
  auto plan = std::make_shared<Plan>();
  plan->num_nodes = nodes.size();
  const std::size_t n = nodes.size();
  std::vector<std::int32_t> unit(n, -1);  // the step (group or single) each node runs in
  std::vector<std::int32_t> member_of(n, -1);  // a grouped node's index among its group's members
  std::int32_t next_unit = 0;
  struct Open {
    PlanStep st;
    std::int32_t unit;
    std::int64_t numel;
  };
  std::vector<Open> open;  // in creation order
  constexpr std::int64_t kBatchKey = -1;  // the open batch of collectives, among the groups

  auto close_unit = [&](std::int32_t u) {
    for (std::size_t g = 0; g < open.size(); ++g) {
      if (open[g].unit != u) continue;
      if (open[g].st.members.size() == 1) open[g].st.kind = PlanStep::Kind::Single;
      else if (open[g].st.kind == PlanStep::Kind::Single) open[g].st.kind = PlanStep::Kind::Group;
      plan->steps.push_back(std::move(open[g].st));
      open.erase(open.begin() + static_cast<std::ptrdiff_t>(g));
      return;
    }
  };
  auto open_with = [&](std::int64_t numel) -> Open* {
    for (auto& g : open)
      if (g.numel == numel) return &g;
    return nullptr;
  };
  auto is_open = [&](std::int32_t u) {
    return std::any_of(open.begin(), open.end(), [&](const Open& g) { return g.unit == u; });
  };
  // Closes every open group `node` reads, except `keep`.
  auto close_read = [&](const NodePtr& node, std::int32_t keep) {
    for (const auto& in : node->inputs()) {
      const std::int32_t s = plan_slot_of(in, epoch);
      if (s < 0) continue;
      const std::int32_t u = unit[static_cast<std::size_t>(s)];
      if (u != keep && is_open(u)) close_unit(u);
    }
  };
  auto add_member = [&](Open& g, std::size_t i) {
    std::vector<std::int32_t> src;
    for (const auto& in : nodes[i]->inputs()) {
      const std::int32_t s = plan_slot_of(in, epoch);
      std::int32_t m = -1;
      if (s >= 0 && unit[static_cast<std::size_t>(s)] == g.unit) m = member_of[static_cast<std::size_t>(s)];
      src.push_back(m);
    }
    member_of[i] = static_cast<std::int32_t>(g.st.members.size());
    g.st.members.push_back(static_cast<std::int32_t>(i));
    g.st.sources.push_back(std::move(src));
    unit[i] = g.unit;
  };

  for (std::size_t i = 0; i < n; ++i) {
    const NodePtr& node = nodes[i];
    if (const Rendezvous* rv = rendezvous(node)) {
      Open* b = open_with(kBatchKey);
      bool reads_batch = false;  // a collective of a batch member's value: the batch runs first
      for (std::size_t d = 0; b && d < rv->data_inputs(); ++d) {
        const std::int32_t s = plan_slot_of(node->inputs()[d], epoch);
        reads_batch = reads_batch || (s >= 0 && unit[static_cast<std::size_t>(s)] == b->unit);
      }
      close_read(node, b && !reads_batch ? b->unit : -1);
      b = open_with(kBatchKey);
      if (!b) {
        PlanStep batch;
        batch.kind = PlanStep::Kind::Batch;
        open.push_back(Open{std::move(batch), next_unit++, kBatchKey});
        b = &open.back();
      }
      add_member(*b, i);
      continue;
    }
    if (chunkable(node)) {
      Open* g = open_with(node->numel());
      if (g && g->st.members.size() >= kMaxGroupMembers) {
        close_unit(g->unit);
        g = nullptr;
      }
      close_read(node, g ? g->unit : -1);
      g = open_with(node->numel());  // closing others moved the vector
      if (!g) {
        open.push_back(Open{PlanStep{}, next_unit++, node->numel()});
        g = &open.back();
      }
      add_member(*g, i);
      continue;
    }
    // A reduction of everything an open group computes ends that group.
    bool ended = false;
    for (const auto& in : node->inputs()) {
      const std::int32_t s = plan_slot_of(in, epoch);
      if (s < 0) continue;
      const std::int32_t u = unit[static_cast<std::size_t>(s)];
      Open* g = nullptr;
      for (auto& o : open)
        if (o.unit == u) g = &o;
      if (!g || g->numel == kBatchKey || !chunk_reduction(node, g->numel)) continue;
      close_read(node, u);
      for (auto& o : open)
        if (o.unit == u) g = &o;
      add_member(*g, i);
      close_unit(u);
      ended = true;
      break;
    }
    if (ended) continue;
    // Not fusible: the groups it reads run first; it runs ahead of the others (its inputs
    // are older, already scheduled).
    close_read(node, -1);
    PlanStep single;
    single.members = {static_cast<std::int32_t>(i)};
    unit[i] = next_unit++;
    plan->steps.push_back(std::move(single));
  }
  while (!open.empty()) close_unit(open.front().unit);

  for (const auto& node : nodes) {
    std::int64_t touched = node->numel();
    for (const auto& in : node->inputs()) touched = std::max(touched, in->numel());
    plan->work += static_cast<double>(touched) * std::max(1.0, node->cost_per_element());
  }

  // A member's value is written whole when anything outside its group needs it.
  std::vector<std::uint8_t> whole(outside.begin(), outside.end());
  for (std::size_t i = 0; i < n; ++i)
    for (const auto& in : nodes[i]->inputs()) {
      const std::int32_t s = plan_slot_of(in, epoch);
      if (s >= 0 && unit[static_cast<std::size_t>(s)] != unit[i]) whole[static_cast<std::size_t>(s)] = 1;
    }
  for (auto& st : plan->steps) {
    if (st.kind != PlanStep::Kind::Group) continue;
    for (auto m : st.members) st.whole.push_back(whole[static_cast<std::size_t>(m)]);
    ++plan->fused_groups;
    plan->fused_members += static_cast<std::int64_t>(st.members.size());
  }
  return plan;
}

}  // namespace lazy::graph::detail
#endif  // LAZYTENSOR_HEADER_DEFINITIONS
