#pragma once
// The processes of a replica world. Every process of `mpirun -np P` calls spawn(fn, n);
// together they form one world of P x n replicas, ordinal = process index * n + local index.
//
// Hierarchical: replicas inside a process meet through shared memory (group_comm.hpp) as
// in the threads backend, and one thread per process and group (the group's lowest local
// member, its "leader") talks to the other processes through its group's ProcessLink. In a
// round that spans processes the leader waits for its local members, sends their shares
// (signature and data) to the other processes of the group, receives theirs into the
// group's slots of the remote members, and only then lets the round start. Every process
// then holds every member's data, so the exchange kernels and the signature check run
// unchanged, and the result is the same fold in group order as in one process: bitwise the
// threads world's.
//
// The transport is an interface (ProcessTransport, ProcessWorld, ProcessLink) that the
// runtime calls, so the runtime is the same code with and without MPI, header-only or
// compiled once in lazytensor::compiled (which is built without MPI). lazytensor::mpi's
// transport (mpi_world.hpp) is header code compiled in the programs that link it: a
// translation unit that includes this header with LAZYTENSOR_WITH_MPI installs it when the
// program starts. Without a transport the program is one process.

#include <atomic>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <lazytensor/core/config.hpp>
#include <lazytensor/dist/share.hpp>
#include <lazytensor/dist/world.hpp>

#ifndef LAZYTENSOR_WITH_MPI
#define LAZYTENSOR_WITH_MPI 0
#endif

namespace lazy::dist::detail {

/// Where this process sits among the processes (0 of 1 without MPI).
struct ProcessPlace {
  int index = 0;       ///< rank among the processes (MPI_COMM_WORLD's)
  int count = 1;       ///< processes
  int host_index = 0;  ///< rank among the processes on this host
  int host_count = 1;  ///< processes on this host
};

/// Why a group gave up a round, as its other processes are told (they raise the same error
/// class: CollectiveTimeout, CollectiveError, ReplicaAborted, CollectiveMismatch).
enum class GiveUp : std::uint8_t { Timeout, Exited, Aborted, Mismatch };

/// One group's link to the other processes holding some of its members: sends this
/// process's shares of a round, receives theirs. Used by the group's leader only.
class ProcessLink {
 public:
  virtual ~ProcessLink() = default;
  /// Starts round s: sends the shares of the local slots (their members' ordinals) to every
  /// peer process.
  virtual void begin(std::uint64_t s, const std::vector<Share*>& local, const std::vector<int>& ordinals) = 0;
  /// Makes progress; true once every peer's package arrived into `slot_share` (indexed by
  /// slot; `slot_of_ordinal` maps ordinals to slots) and every send completed.
  virtual bool progress(const std::vector<Share*>& slot_share, const std::vector<int>& slot_of_ordinal) = 0;
  /// The peers not heard from yet in this round ("process 1 (replicas 2, 3)").
  virtual std::string waiting_for() const = 0;
  /// Whether the process holding `ordinal` has delivered this round's package.
  virtual bool delivered_by_owner(int ordinal) const = 0;
  /// Gives up on the round: cancels receives, keeps what is in flight alive, and tells the
  /// peer processes (with `reason` when not empty) that the group is broken.
  virtual void abandon(const std::string& reason, GiveUp why) = 0;
};

/// The processes of one spawn, as the runtime sees them.
class ProcessWorld {
 public:
  virtual ~ProcessWorld() = default;
  /// The world layout: P x n replicas, this process's offset, the replicas of its host.
  virtual WorldLayout layout() const = 0;
  /// Starts watching the other processes: their exit notices are applied to `w`.
  virtual void watch(WorldState& w) = 0;
  /// Tells every other process that local replica `ordinal` exited (failed with `e` when
  /// not null).
  virtual void announce_exit(int ordinal, const std::exception_ptr& e) = 0;
  /// After every local replica exited: waits (at most the collective timeout) for the
  /// other processes' notices, then stops watching.
  virtual void finish() = 0;
  /// What a group that spans processes is told (from another thread) when a peer process
  /// gave up one of its rounds: it must fail its later rounds.
  using BrokenHandler = std::function<void(const std::string& reason, GiveUp why)>;
  /// The link of group `members` (sorted ordinals, some in other processes). `on_broken`
  /// may be called until the link's destructor returns, never after it.
  virtual std::unique_ptr<ProcessLink> link(const std::vector<int>& members, BrokenHandler on_broken) = 0;
  /// Asks the processes holding the replicas `who` names (ordinal, collective count) in
  /// which group each joined that collective (WorldState::joined_group). A leader waiting
  /// for a remote member asks this: a member that joined the same count in another group
  /// will never come. The answers arrive later, through told_where.
  virtual void ask_where(const std::vector<std::pair<int, std::uint64_t>>& who) = 0;
  /// The answer about replica `ordinal`'s collective #`world_seq`: its group's tag, or -1
  /// when none arrived (yet) or that replica had not joined it when asked.
  virtual std::int64_t told_where(int ordinal, std::uint64_t world_seq) const = 0;
};

/// A way to reach other processes (lazytensor::mpi installs MPI's).
class ProcessTransport {
 public:
  /// This process's place among the processes of the job.
  virtual ProcessPlace place() = 0;
  /// Joins the other processes' spawn(fn, replicas); null when the program runs as one
  /// process.
  virtual std::shared_ptr<ProcessWorld> join(int replicas) = 0;

 protected:
  ~ProcessTransport() = default;
};

/// The installed transport (null: the program is one process).
std::atomic<ProcessTransport*>& process_transport();

/// This process's place. With MPI, when an MPI launcher started the process (or the program
/// initialised MPI), initialises MPI on first use; otherwise a process of one.
ProcessPlace process_place();

/// Joins the other processes' spawn(fn, replicas) through the transport (collective over
/// the job's processes, gives up after the collective timeout) and checks that every
/// process asked for as many replicas. Null when the program runs as one process.
std::shared_ptr<ProcessWorld> join_process_world(int replicas);

}  // namespace lazy::dist::detail

#if LAZYTENSOR_HEADER_DEFINITIONS
namespace lazy::dist::detail {

LAZYTENSOR_INLINE std::atomic<ProcessTransport*>& process_transport() {
  static std::atomic<ProcessTransport*> transport{nullptr};
  return transport;
}

LAZYTENSOR_INLINE ProcessPlace process_place() {
  ProcessTransport* t = process_transport().load(std::memory_order_acquire);
  return t ? t->place() : ProcessPlace{};
}

LAZYTENSOR_INLINE std::shared_ptr<ProcessWorld> join_process_world(int replicas) {
  ProcessTransport* t = process_transport().load(std::memory_order_acquire);
  return t ? t->join(replicas) : nullptr;
}

}  // namespace lazy::dist::detail
#endif  // LAZYTENSOR_HEADER_DEFINITIONS

// lazytensor::mpi's transport, in the programs that link it (empty without
// LAZYTENSOR_WITH_MPI).
#include <lazytensor/dist/mpi_world.hpp>
