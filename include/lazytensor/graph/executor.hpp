#pragma once
// Running plans: a step's collection (what mark_step computes), plan lookup in the cache,
// the execution of single nodes and of fused element-wise groups (fused_group.hpp), the
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

#include <lazytensor/core/config.hpp>
#include <lazytensor/core/counters.hpp>
#include <lazytensor/core/small_vector.hpp>
#include <lazytensor/graph/fused_group.hpp>
#include <lazytensor/graph/plan.hpp>

namespace lazy::graph {

namespace detail {

/// The nodes a traversal has met: searched in a short inline list first, in a hash set
/// once that fills. Reading one small statement (`sum(x).item()`) then allocates nothing
/// to remember it, while reading a whole training graph stays linear.
class SeenNodes {
 public:
  /// Adds `n`; false when it was already there.
  bool insert(const Node* n);

 private:
  static constexpr std::size_t kInline = 16;
  const Node* inline_[kInline] = {};
  std::size_t count_ = 0;
  std::unordered_set<const Node*> set_;
};

/// The nodes of a step queued on a device's executor. A step dropped unrun (the device
/// stopping at process exit) gives back its collectives (Rendezvous::abandon), so a peer
/// device waiting in one ends with an error instead of waiting out the collective timeout.
struct QueuedStep {
  explicit QueuedStep(NodeList n) : nodes(std::move(n)) {}
  QueuedStep(const QueuedStep&) = delete;
  QueuedStep& operator=(const QueuedStep&) = delete;
  ~QueuedStep();
  NodeList nodes;
  bool taken = false;  ///< the executor ran (or refused) the step: nothing to give back
};

/// Runs a batch of collectives (PlanStep::Kind::Batch) phase by phase: every member
/// publishes, then each combines, then each releases (see graph::Rendezvous). Returns how
/// many ran; a member a read already computed is skipped. Counted as CollectiveBatches.
std::int64_t run_batch(ExecContext& ctx, const PlanStep& st, std::span<NodePtr> nodes);

}  // namespace detail

/// Pending nodes reachable from `roots`, producers before consumers (iterative DFS, so a
/// long chain of statements cannot overflow the stack).
NodeList topological_order(std::span<const NodePtr> roots);

/// Lets the step's element-wise nodes take over their GEMM producers (epilogue fusion).
/// Called on every step before planning and execution: it decides on this step's nodes.
void prepare(std::span<const NodePtr> nodes);

/// The plan for `nodes` (in creation order), from the device's cache or newly built.
/// `step`: planning a mark_step (reads and eager ops do not count toward the re-planning
/// warning). `done`: receives the clock reading that ended PlanTime, for a caller that
/// runs the plan at once and can start ExecuteTime from it.
std::shared_ptr<const Plan> plan_for(Device& dev, const NodeList& nodes,
                                            bool step, core::MetricClock::Ticks* done = nullptr);

/// Puts the nodes of a step that did not run (or did not finish) back to pending and into
/// the trace, for a later step or read: nothing is lost when a step fails or is refused.
void return_to_trace(Device& device, std::span<const NodePtr> nodes);

/// Runs `plan` over `nodes` (positions as planned). The plan's reference to each node is
/// dropped as it runs, so donation sees the true holders. On an error, the nodes not run
/// go back to pending (and to the device's trace) and the exception propagates.
/// `started`: when ExecuteTime starts (default: now).
void run_plan(Device& device, const Plan& plan, std::span<NodePtr> nodes,
                     const core::MetricClock::Ticks* started = nullptr);

/// Plans and runs `nodes` on the calling thread (the caller has waited for the queued
/// plans: execute does).
void execute_now(Device& device, NodeList nodes);

/// True when `node` is pending and every input of it is materialized: its plan would be
/// the node alone.
bool runs_alone(const NodePtr& node);

/// Runs `node` (pending, every input materialized: runs_alone) on the calling thread, as
/// run_plan runs a plan of that node alone, without the plan: no copy of the reference
/// (two locked instructions), no step loop. On an error the node goes back to the trace
/// and the exception propagates.
void run_alone(Device& device, const NodePtr& node);

/// Materializes every pending node reachable from `roots` on `device`, now, on the
/// calling thread.
void execute(Device& device, std::span<const NodePtr> roots);

/// The nodes a step computes: every pending node of the trace that a live handle reaches,
/// in creation order. The rest (alive, but reachable only from expressions or dropped
/// values' consumers) stays traced for later steps.
NodeList collect_step(Device& dev);

/// Entries of the per-thread scratch that collect_step and plan_for keep between steps
/// (larger ones, left by an unusually large step, are freed).
inline constexpr std::size_t kKeptTraceCapacity = std::size_t{1} << 14;

/// run_plan for a step nobody waits on: its error is stored on the device, to surface at
/// the next read or sync.
void run_plan_storing_error(Device& dev, const Plan& plan, NodeList& nodes);

/// Runs a step: plans the collected nodes now (overlapping the previous step's
/// execution), hands the plan to the executor thread (or, with async off, runs it here),
/// then waits for the previous step. The plan is queued behind the running step before
/// that wait, so the executor goes from one step to the next without waiting for this
/// thread to wake (two thread wake-ups, 15-50 us each on a VM). Errors of an asynchronous
/// step are stored. A step cheaper than the hand-off (kInlineStepWork), or any step of a
/// device set to inline_steps, runs here once the queue is empty, its errors stored as if
/// it had run on the executor. `wait_previous` false: returns once the step is queued,
/// and the caller waits for the previous step (`dev.wait_below(2)`) itself; a thread
/// driving several devices (SPMD) queues every device's step first, so no executor idles
/// while this thread waits for another device.
void run_step(Device& dev, NodeList nodes, bool wait_previous = true);

}  // namespace lazy::graph

#if LAZYTENSOR_HEADER_DEFINITIONS
namespace lazy::graph::detail {

LAZYTENSOR_INLINE std::int64_t run_batch(ExecContext& ctx, const PlanStep& st, std::span<NodePtr> nodes) {
  static auto& batches = core::counter("CollectiveBatches");
  batches.add();
  std::vector<std::pair<Node*, Rendezvous*>> run;
  for (auto m : st.members) {
    const NodePtr& n = nodes[static_cast<std::size_t>(m)];
    if (!n->materialized()) run.emplace_back(n.get(), rendezvous(n));
  }
  for (auto& [n, rv] : run) rv->publish();
  std::vector<std::shared_ptr<Buffer>> out;
  out.reserve(run.size());
  for (auto& [n, rv] : run) out.push_back(rv->combine(ctx));
  for (std::size_t i = 0; i < run.size(); ++i) {
    run[i].second->release();
    run[i].first->finish_with(std::move(out[i]));
  }
  for (auto m : st.members) nodes[static_cast<std::size_t>(m)].reset();
  return static_cast<std::int64_t>(run.size());
}

LAZYTENSOR_INLINE QueuedStep::~QueuedStep() {
  if (taken) return;
  for (const auto& n : nodes)
    if (n && !n->materialized())
      if (Rendezvous* rv = rendezvous(n)) rv->abandon();
}

LAZYTENSOR_INLINE bool SeenNodes::insert(const Node* n) {
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

}  // namespace lazy::graph::detail
namespace lazy::graph {

LAZYTENSOR_INLINE NodeList topological_order(std::span<const NodePtr> roots) {
  NodeList order;
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

LAZYTENSOR_INLINE void prepare(std::span<const NodePtr> nodes) {
  for (const auto& n : nodes) n->set_deferred(false);  // decisions of an earlier look (dumps) are redone
  for (const auto& n : nodes) n->fuse_producers();
}

LAZYTENSOR_INLINE std::shared_ptr<const Plan> plan_for(Device& dev,
    const NodeList& nodes,
    bool step,
    core::MetricClock::Ticks* done) {
  static auto& cached = core::counter("CachedPlan");
  static auto& uncached = core::counter("UncachedPlan");
  static auto& plan_time = core::metric("PlanTime");
  const auto t0 = core::MetricClock::now();
  const std::uint64_t epoch = detail::number_nodes(nodes);
  // This thread's scratch, kept from step to step (a cached plan then allocates nothing).
  thread_local std::vector<std::uint8_t> outside;
  thread_local std::vector<std::uint64_t> sig;
  detail::plan_signature(nodes, epoch, outside, sig);
  const std::uint64_t h = detail::fold_signature(sig);
  auto& cache = dev.plan_cache();
  auto& stats = dev.plan_stats();
  if (step) ++stats.steps;
  std::shared_ptr<const Plan> plan;
  if (auto hit = cache.find(h); hit && hit->signature == sig) {
    plan = std::move(hit);
    cached.add();
  } else {
    auto built = detail::build_plan(nodes, epoch, outside);
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
  if (step) stats.last_signature.swap(sig);  // (the old one's storage is reused next time)
  if (sig.capacity() > 2 * kKeptTraceCapacity) sig = {};
  if (outside.capacity() > kKeptTraceCapacity) outside = {};
  const auto t1 = core::MetricClock::now();
  plan_time.record(core::MetricClock::to_ns(t0, t1));
  if (done) *done = t1;
  return plan;
}

LAZYTENSOR_INLINE void return_to_trace(Device& device, std::span<const NodePtr> nodes) {
  std::vector<std::weak_ptr<Node>> back;
  for (const auto& n : nodes) {
    if (!n || n->materialized()) continue;
    if (Rendezvous* rv = detail::rendezvous(n)) rv->abandon();
    n->set_deferred(false);
    n->set_state(Node::State::Pending);
    back.push_back(n);
  }
  device.keep_traced(std::move(back));
}

LAZYTENSOR_INLINE void run_plan(Device& device,
    const Plan& plan,
    std::span<NodePtr> nodes,
    const core::MetricClock::Ticks* started) {
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
        // A deferred GEMM runs inside its epilogue's step: kept here until then, so that a
        // failure in between returns it to the trace with the rest (not left queued).
        if (n->deferred()) continue;
        if (!n->materialized()) {
          n->run(ctx);
          ++ran;
        }
        n.reset();
        continue;
      }
      if (st.kind == PlanStep::Kind::Batch) {
        ran += detail::run_batch(ctx, st, nodes);
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

LAZYTENSOR_INLINE void execute_now(Device& device, NodeList nodes) {
  if (nodes.empty()) return;
  prepare(nodes);
  // One clock reading ends PlanTime and starts ExecuteTime.
  core::MetricClock::Ticks planned = 0;
  auto plan = plan_for(device, nodes, false, &planned);
  for (auto& n : nodes) n->set_state(Node::State::Queued);
  run_plan(device, *plan, nodes, &planned);
}

LAZYTENSOR_INLINE bool runs_alone(const NodePtr& node) {
  if (!node || !node->pending()) return false;
  for (const auto& in : node->inputs())
    if (!in->materialized()) return false;
  return true;
}

LAZYTENSOR_INLINE void run_alone(Device& device, const NodePtr& node) {
  static auto& execute_time = core::metric("ExecuteTime");
  static auto& kernels = core::counter("KernelsRun");
  core::ScopedTimer timer(execute_time);
  ExecContext ctx{device};
  try {
    if (!node->materialized() && !node->deferred()) {
      node->run(ctx);
      kernels.add(1);
    }
  } catch (...) {
    return_to_trace(device, std::span(&node, 1));
    throw;
  }
}

LAZYTENSOR_INLINE void execute(Device& device, std::span<const NodePtr> roots) {
  device.wait_idle();
  if (roots.size() == 1 && runs_alone(roots[0])) {
    // An eager op, or the read of a statement over materialized values: nothing to order,
    // plan or look up (so no PlanTime and no plan-cache counter), ~20% of the fixed cost
    // of such a read.
    prepare(roots);
    roots[0]->set_state(Node::State::Queued);
    run_alone(device, roots[0]);
    // Computed, so no step needs its entry (a step runs pending nodes only); the newest is
    // the usual case: a statement read as soon as it is built.
    if (roots[0]->materialized()) device.untrace_newest(roots[0]);
    return;
  }
  execute_now(device, topological_order(roots));
}

LAZYTENSOR_INLINE NodeList collect_step(Device& dev) {
  // This thread's scratch, kept from step to step: a step of a few statements allocates
  // only the vector it returns. (Its weak references are dropped before returning: they
  // would keep the nodes' memory.)
  thread_local std::vector<std::weak_ptr<Node>> trace;
  thread_local std::vector<std::uint8_t> needed;
  dev.take_trace(trace);
  NodeList alive;
  alive.reserve(trace.size());
  for (auto& w : trace)
    if (auto n = w.lock(); n && n->pending()) alive.push_back(std::move(n));
  trace.clear();
  if (trace.capacity() > kKeptTraceCapacity) trace = {};
  if (alive.empty()) return {};
  const std::uint64_t epoch = detail::number_nodes(alive);
  needed.assign(alive.size(), 0);
  for (std::size_t i = 0; i < alive.size(); ++i) needed[i] = alive[i]->has_handles();
  // Consumers are newer than their inputs: one sweep from the newest marks everything needed.
  for (std::size_t i = alive.size(); i-- > 0;) {
    if (!needed[i]) continue;
    for (const auto& in : alive[i]->inputs())
      if (const std::int32_t s = detail::plan_slot_of(in, epoch); s >= 0) needed[static_cast<std::size_t>(s)] = 1;
  }
  // The needed nodes move to the front (in order); the rest go back to the trace.
  std::vector<std::weak_ptr<Node>> keep;
  std::size_t run = 0;
  for (std::size_t i = 0; i < alive.size(); ++i) {
    if (needed[i]) {
      if (run != i) alive[run] = std::move(alive[i]);
      ++run;
    } else {
      keep.push_back(alive[i]);
    }
  }
  alive.resize(run);
  if (needed.capacity() > kKeptTraceCapacity) needed = {};
  dev.keep_traced(std::move(keep));
  return alive;
}

LAZYTENSOR_INLINE void run_plan_storing_error(Device& dev, const Plan& plan, NodeList& nodes) {
  try {
    run_plan(dev, plan, nodes);
  } catch (...) {
    dev.store_error(std::current_exception());
  }
}

LAZYTENSOR_INLINE void run_step(Device& dev, NodeList nodes, bool wait_previous) {
  if (nodes.empty()) return;
  // Every way out before the hand-off gives the nodes back to the trace (collect_step took
  // them): a step that cannot be planned or queued is not lost, and its collectives are
  // abandoned for this attempt, as a failed step's are.
  std::shared_ptr<const Plan> plan;
  try {
    prepare(nodes);
    plan = plan_for(dev, nodes, true);
  } catch (...) {
    return_to_trace(dev, nodes);
    throw;
  }
  const bool queue =
      dev.async() && (dev.queue_every_step() || (!dev.inline_steps() && plan->work >= kInlineStepWork));
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
  std::shared_ptr<detail::QueuedStep> step;
  try {
    step = std::make_shared<detail::QueuedStep>(std::move(nodes));
    dev.enqueue([&dev, plan, failures, step] {
      step->taken = true;
      if (dev.failures() != failures) {
        // The step ahead failed after this one was queued (same reason as above): this one
        // does not run; its nodes wait in the trace for the next sync, which reports the
        // error.
        return_to_trace(dev, step->nodes);
        return;
      }
      run_plan_storing_error(dev, *plan, step->nodes);
    });
  } catch (...) {  // not queued (no executor thread, no memory)
    if (step) step->taken = true;
    return_to_trace(dev, step ? step->nodes : nodes);
    throw;
  }
  if (wait_previous) dev.wait_below(2);  // the previous step is done (this one may still run)
}

}  // namespace lazy::graph
#endif  // LAZYTENSOR_HEADER_DEFINITIONS
