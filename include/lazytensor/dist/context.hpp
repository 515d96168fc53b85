#pragma once
// A replica thread's context (its world, ordinal, per-group sequence numbers, its last
// traced collective) and the capture of a collective call at trace time.
//
// Sequence numbers are assigned when a collective is traced, in program order, one counter
// per (replica, group). Tensor collectives run later (mark_step or a read), possibly on
// another thread, so everything they need is captured in a CollectiveCall. Each traced
// exchange takes the previous, still pending one as an extra input: a replica's collectives
// run in program order whatever order its graph is walked in, and the context keeps the
// last one registered with the device, so mark_step runs it even when no handle reaches
// its result (a collective skipped on one replica would leave the others waiting).

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include <lazytensor/core/config.hpp>
#include <lazytensor/dist/group_comm.hpp>
#include <lazytensor/dist/signature.hpp>
#include <lazytensor/dist/world.hpp>
#include <lazytensor/graph/submit.hpp>
#include <lazytensor/graph/tensor_impl.hpp>

namespace lazy::dist::detail {

/// A world of replicas (threads backend): its shared state and its groups' exchanges.
class World {
 public:
  explicit World(WorldLayout layout);
  WorldState& state() { return *state_; }

  /// The exchange of the group with these members (sorted), created on first use.
  std::shared_ptr<GroupComm> comm(const std::vector<int>& members);

 private:
  std::shared_ptr<WorldState> state_;
  std::mutex mu_;
  std::map<std::vector<int>, std::shared_ptr<GroupComm>> comms_;
};

/// State of one replica thread, reachable through current_context() while spawn runs it.
struct ReplicaContext {
  struct Channel {
    std::shared_ptr<GroupComm> comm;
    std::uint64_t next_seq = 1;
  };

  ReplicaContext(std::shared_ptr<World> w, int local_index)
      : world(std::move(w)),
        local(local_index),
        ordinal(world->state().layout().process_offset + local_index) {}

  std::shared_ptr<World> world;
  int local;    ///< replica index inside this process (= its device index)
  int ordinal;  ///< global ordinal
  std::map<std::vector<int>, Channel> channels;         ///< by sorted members
  std::shared_ptr<const std::vector<int>> world_group;  ///< [0, world) (cached)
  Channel* world_channel = nullptr;                     ///< its channel (cached)
  std::shared_ptr<graph::TensorImpl> last;  ///< last traced exchange, registered with the device
  std::uint64_t world_seq = 0;              ///< collectives over a groups partition traced so far

  Channel& channel(const std::vector<int>& sorted_members);
};

/// This thread's replica context (null outside spawn: a world of one).
inline ReplicaContext*& current_context() {
  thread_local ReplicaContext* ctx = nullptr;
  return ctx;
}

/// Whether a spawn runs in this process (set by spawn for its whole run).
inline std::atomic<bool>& spawn_running() {
  static std::atomic<bool> running{false};
  return running;
}

/// CollectiveError when this thread is not a replica while a spawn runs: a collective there
/// would be a world of one and return its input unreduced, without a word.
inline void check_collective_thread(const char* op) {
  if (!current_context() && spawn_running().load(std::memory_order_acquire)) {
    throw CollectiveError(std::string(op) +
                          ": called on a thread that is not a replica while spawn runs (a "
                          "collective runs on the replica threads spawn started)");
  }
}

/// Everything an exchange needs when it runs, captured when it is traced.
struct CollectiveCall {
  std::shared_ptr<GroupComm> comm;  ///< null for a group of one (nothing to exchange)
  int slot = 0;                     ///< this replica's slot in comm
  int rank = 0;                     ///< this replica's position in its group (data order)
  std::vector<int> slot_of_rank;    ///< slot of each group position; empty: the position itself
  std::uint64_t seq = 0;            ///< sequence number in the group
  Signature sig;

  int size() const { return comm ? comm->size() : 1; }
  /// Slot of group position `q` (a group in ascending order, the world's among them, needs
  /// no table: captured without allocating).
  int slot_at(int q) const {
    return slot_of_rank.empty() ? q : slot_of_rank[static_cast<std::size_t>(q)];
  }
};

/// Captures a collective whose group is `group` (ordinals in data order, containing this
/// replica): takes the group's next sequence number, and unless `among_chosen` (a
/// rendezvous of chosen replicas, which the others skip) the replica's next count of its
/// collectives over a partition (Signature::world_seq).
CollectiveCall capture(Signature sig, std::shared_ptr<const std::vector<int>> group,
                       bool among_chosen = false);

/// World size and this thread's ordinal.
inline int world_size_now() {
  ReplicaContext* ctx = current_context();
  return ctx ? ctx->world->state().layout().world_size : 1;
}
inline int ordinal_now() {
  ReplicaContext* ctx = current_context();
  return ctx ? ctx->ordinal : 0;
}

/// The group of this replica for `groups`, validated (no sequence number taken yet).
std::shared_ptr<const std::vector<int>> group_of(const Groups& groups, const char* op);

/// Captures a host-side collective among `replicas` (empty: everyone), which must hold
/// this replica and no ordinal twice; they take part in ascending ordinal order.
CollectiveCall capture_among(Signature sig, std::vector<int> replicas, const char* op);

/// The replica's last traced exchange when it is still pending (the next one runs after it).
inline graph::NodePtr pending_predecessor() {
  ReplicaContext* ctx = current_context();
  if (!ctx || !ctx->last || !ctx->last->node || ctx->last->node->materialized()) return nullptr;
  return ctx->last->node;
}

/// Makes `exchange` the replica's last traced collective (see the file comment).
void remember(const graph::NodePtr& exchange);

/// Runs this replica's pending collectives (and what they need): host-side collectives and
/// a replica's exit do this first, so every replica executes its collectives in program
/// order.
inline void flush_pending() {
  if (graph::NodePtr n = pending_predecessor()) graph::materialize(n);
}

/// A replica's exit: runs its pending collectives, waits for its device's steps and
/// re-throws an error one of them stored, so that no failure (a collective mismatch seen by
/// a step that ran inline or on the executor) ends unseen with its replica.
void finish_replica();

}  // namespace lazy::dist::detail

#if LAZYTENSOR_HEADER_DEFINITIONS
namespace lazy::dist::detail {
LAZYTENSOR_INLINE World::World(WorldLayout layout) : state_(std::make_shared<WorldState>(layout)) {}

LAZYTENSOR_INLINE std::shared_ptr<GroupComm> World::comm(const std::vector<int>& members) {
  std::lock_guard lock(mu_);
  auto& c = comms_[members];
  if (!c) c = std::make_shared<GroupComm>(state_, members);
  return c;
}

LAZYTENSOR_INLINE ReplicaContext::Channel& ReplicaContext::channel(
    const std::vector<int>& sorted_members) {
  auto& ch = channels[sorted_members];
  if (!ch.comm) {
    // This replica's own control block for the shared exchange: every traced collective
    // copies the pointer, and those counts then stay off the cache lines the group's
    // other replicas write (the holder's alignment gives the block a line of its own).
    struct alignas(64) Holder {
      std::shared_ptr<GroupComm> comm;
    };
    auto own = std::make_shared<Holder>(Holder{world->comm(sorted_members)});
    ch.comm = std::shared_ptr<GroupComm>(own, own->comm.get());
  }
  return ch;
}

LAZYTENSOR_INLINE CollectiveCall capture(Signature sig,
                                         std::shared_ptr<const std::vector<int>> group,
                                         bool among_chosen) {
  ReplicaContext* ctx = current_context();
  const int me = ctx ? ctx->ordinal : 0;
  // Counted before a group of one returns: its members' partners count it too.
  if (ctx && !among_chosen) sig.world_seq = ++ctx->world_seq;
  CollectiveCall call;
  const auto& g = *group;
  call.rank = static_cast<int>(std::find(g.begin(), g.end(), me) - g.begin());
  sig.group = std::move(group);
  call.sig = std::move(sig);
  if (g.size() == 1) return call;
  ReplicaContext::Channel* ch = nullptr;
  if (ctx->world_channel && ctx->world_group && (g.data() == ctx->world_group->data())) {
    ch = ctx->world_channel;
  } else {
    std::vector<int> sorted = g;
    std::sort(sorted.begin(), sorted.end());
    ch = &ctx->channel(sorted);
  }
  call.comm = ch->comm;
  call.seq = ch->next_seq++;
  call.slot = call.comm->slot_of(me);
  bool in_order = true;
  for (std::size_t k = 0; k < g.size() && in_order; ++k)
    in_order = call.comm->slot_of(g[k]) == static_cast<int>(k);
  if (!in_order) {
    call.slot_of_rank.resize(g.size());
    for (std::size_t k = 0; k < g.size(); ++k) call.slot_of_rank[k] = call.comm->slot_of(g[k]);
  }
  return call;
}

LAZYTENSOR_INLINE std::shared_ptr<const std::vector<int>> group_of(const Groups& groups,
                                                                   const char* op) {
  ReplicaContext* ctx = current_context();
  check_collective_thread(op);
  if (!groups.empty() || !ctx) {
    return std::make_shared<const std::vector<int>>(
        resolve_group(groups, world_size_now(), ordinal_now(), op));
  }
  if (!ctx->world_group) {
    const int n = world_size_now();
    auto all = std::make_shared<std::vector<int>>(static_cast<std::size_t>(n));
    for (int i = 0; i < n; ++i) (*all)[static_cast<std::size_t>(i)] = i;
    ctx->world_group = std::move(all);
    if (n > 1) ctx->world_channel = &ctx->channel(*ctx->world_group);
  }
  return ctx->world_group;
}

LAZYTENSOR_INLINE CollectiveCall capture_among(Signature sig, std::vector<int> replicas,
                                               const char* op) {
  if (replicas.empty()) return capture(std::move(sig), group_of({}, op));
  check_collective_thread(op);
  const int world = world_size_now(), me = ordinal_now();
  std::sort(replicas.begin(), replicas.end());
  const std::string where = std::string(op) + ": invalid replicas " + list_str(replicas) + ": ";
  for (std::size_t i = 0; i < replicas.size(); ++i) {
    if (replicas[i] < 0 || replicas[i] >= world) {
      throw CollectiveError(where + "replica " + std::to_string(replicas[i]) +
                            " is out of range [0, " + std::to_string(world) + ")");
    }
    if (i && replicas[i] == replicas[i - 1]) {
      throw CollectiveError(where + "replica " + std::to_string(replicas[i]) +
                            " appears more than once");
    }
  }
  if (!std::binary_search(replicas.begin(), replicas.end(), me)) {
    throw CollectiveError(where + "the calling replica " + std::to_string(me) +
                          " is not among them");
  }
  // Every replica chosen is the same call as the empty list: counted alike.
  const bool everyone = static_cast<int>(replicas.size()) == world;
  return capture(std::move(sig), std::make_shared<const std::vector<int>>(std::move(replicas)),
                 /*among_chosen=*/!everyone);
}

LAZYTENSOR_INLINE void remember(const graph::NodePtr& exchange) {
  ReplicaContext* ctx = current_context();
  if (!ctx) return;
  if (!ctx->last) {
    ctx->last = std::make_shared<graph::TensorImpl>(exchange);
  } else {
    ctx->last->node = exchange;
  }
}

LAZYTENSOR_INLINE void finish_replica() {
  flush_pending();
  graph::Device& dev = graph::current_device();
  dev.wait_idle();
  dev.rethrow_stored_error();
}
}  // namespace lazy::dist::detail
#endif  // LAZYTENSOR_HEADER_DEFINITIONS
