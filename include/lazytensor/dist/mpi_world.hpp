#pragma once
// lazytensor::mpi's transport between processes (process_world.hpp's interfaces over MPI),
// included by process_world.hpp (empty without LAZYTENSOR_WITH_MPI). Header code compiled in
// the programs that link lazytensor::mpi, with or without lazytensor::compiled: a
// translation unit that includes it installs the transport when the program starts.
//
// Failure: a replica's exit is announced to every other process (with its exception when
// it failed) on a control communicator that a watcher thread per process reads, so a failure
// in one process aborts every other one's collectives at once, and a partner that exited
// without joining a round ends it with a CollectiveError. A world ends with one collective,
// once every replica of the process ended: each process's first failure, gathered by all
// (the closing exchange), so no process depends on having read every exit notice. A process
// that died or never arrives ends a round with CollectiveTimeout (collective_timeout());
// mpirun then ends the job. Every spawn works on its own duplicates of MPI_COMM_WORLD, kept
// until MPI_Finalize, so nothing a spawn left in flight can reach the next one.

#include <lazytensor/dist/process_world.hpp>

#if LAZYTENSOR_WITH_MPI
// The C API is all lazytensor uses: skip the deprecated C++ bindings (and their cost).
#ifndef OMPI_SKIP_MPICXX
#define OMPI_SKIP_MPICXX 1
#endif
#ifndef MPICH_SKIP_MPICXX
#define MPICH_SKIP_MPICXX 1
#endif
#include <mpi.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace lazy::dist::detail {

/// The MPI library, initialised on first use unless the program did (with
/// MPI_THREAD_MULTIPLE: replica threads of different groups talk MPI at the same time), and
/// finalised at exit if initialised here.
class Mpi {
 public:
  static Mpi& get();
  const ProcessPlace& place() const { return place_; }
  /// MPI_THREAD_MULTIPLE granted (a world of several processes needs it).
  bool multiple() const { return provided_ >= MPI_THREAD_MULTIPLE; }
  int provided() const { return provided_; }
  ~Mpi();

  /// The host's shared window (MPI_Win_allocate_shared, one segment per process on this
  /// host): opened by the first world of several processes, over that world's data
  /// communicator (every process is in its join then), and kept for the program, since
  /// freeing it is collective too (done at exit).
  struct HostWindow {
    MPI_Comm comm = MPI_COMM_NULL;
    MPI_Win win = MPI_WIN_NULL;
    std::vector<std::byte*> segments;  ///< by world process index (null: none)
    std::vector<char> on_host;         ///< by world process index
    std::size_t bytes = 0;             ///< this process's segment
  };
  /// The window, opening it on first call (collective over `data`'s processes).
  const HostWindow& host_window(MPI_Comm data, int index, int count, const std::vector<int>& host_processes);

 private:
  Mpi();
  bool owned_ = false;
  int provided_ = 0;
  ProcessPlace place_;
  bool window_tried_ = false;
  HostWindow window_;
};

/// Throws the error class for an MPI error code, naming the call.
void mpi_check(int rc, const char* what);

/// The processes of one spawn: their communicators, the exit notices, the watcher thread.
class MpiWorld final : public ProcessWorld, public std::enable_shared_from_this<MpiWorld> {
 public:
  /// Joins the other processes' spawn(fn, replicas) (collective over MPI_COMM_WORLD, gives
  /// up after the collective timeout) and checks that every process asked for as many
  /// replicas. Null when the program runs as one process.
  static std::shared_ptr<MpiWorld> join(int replicas);
  inline ~MpiWorld() override;
  MpiWorld(const MpiWorld&) = delete;
  MpiWorld& operator=(const MpiWorld&) = delete;

  int index() const { return place_.index; }
  int count() const { return place_.count; }
  int replicas() const { return replicas_; }
  inline WorldLayout layout() const override;
  MPI_Comm data_comm() const { return data_; }

  /// Starts the watcher thread, which applies other processes' exit notices to `w`.
  inline void watch(WorldState& w) override;
  inline void announce_exit(int ordinal, const std::exception_ptr& e) override;
  /// Also stops the watcher and settles abandoned transfers.
  inline void finish() override;
  inline std::unique_ptr<ProcessLink> link(const std::vector<int>& members, BrokenHandler on_broken) override;
  inline void ask_where(const std::vector<std::pair<int, std::uint64_t>>& who) override;
  inline std::int64_t told_where(int ordinal, std::uint64_t world_seq) const override;

  /// Requests a failed round left in flight, with what their buffers need to outlive them.
  void abandon(std::vector<MPI_Request> requests, std::vector<std::shared_ptr<void>> keep);

  /// A fresh tag for the large entries of one round (every destination, every piece): the
  /// receiver learns it from the package, so no other group's data can match them.
  int piece_tag();

  /// Packages are sent on a tag derived from their group (few tags: groups may share one).
  /// A leader that receives another group's package leaves it here for that group's leader.
  void post_package(std::uint64_t group, int source, std::shared_ptr<std::vector<std::byte>> p);
  std::shared_ptr<std::vector<std::byte>> take_package(std::uint64_t group, int source);
  /// Held by a leader of a group on package tag `tag` from its look into the mailbox until
  /// the package it probed is its own or posted: otherwise, with groups sharing a tag, a
  /// leader could probe past its round s package (taken off MPI's queue by another group's
  /// leader, not yet posted) and receive its round s + 1 package first. One mutex per tag
  /// modulo kProbeLocks: groups on other tags do not wait for each other.
  std::mutex& probe_mutex(int tag) {
    return probe_mu_[static_cast<std::size_t>(tag) % kProbeLocks];
  }

  /// Registers what a group is told when a peer process gave up one of its rounds; after
  /// forget_group returns the handler is not running and is never called again.
  void on_group_broken(std::uint64_t group, BrokenHandler h);
  void forget_group(std::uint64_t group);

  /// Shared memory with the processes on this host (an MPI-3 shared window, one segment per
  /// process): a leader copies large entries into its segment and names them in the
  /// package, and the other processes read them in place, instead of receiving a copy.
  /// Base of process `p`'s segment (null when it is on another host or there is none).
  std::byte* segment_of(int p) const {
    return window_ && static_cast<std::size_t>(p) < window_->segments.size()
               ? window_->segments[static_cast<std::size_t>(p)]
               : nullptr;
  }
  /// Whether process `p` runs on this host and shares the window.
  bool shares_window(int p) const {
    return window_ && static_cast<std::size_t>(p) < window_->on_host.size() &&
           window_->on_host[static_cast<std::size_t>(p)];
  }
  /// Reserves `bytes` of this process's segment; returns the offset, or -1 when it is full.
  std::int64_t reserve_segment(std::size_t bytes);
  /// Makes this process's writes to its segment visible to the others (before a package
  /// names them), or the others' to this process (after one arrived).
  void sync_segments();
  /// Tells the processes in `peers` that this process gave up a round of `group`.
  void announce_broken(std::uint64_t group, const std::vector<int>& peers, const std::string& reason,
                       GiveUp why);

 private:
  MpiWorld(int replicas, ProcessPlace place, MPI_Comm data, MPI_Comm ctl, MPI_Comm fin);
  void run_watcher();
  /// What a process tells the others when it finishes: its first failed replica (-1: none).
  struct Closing {
    std::int32_t ordinal = -1;
    std::int32_t error_class = 0;
    char what[1016] = {};
  };
  /// Applies the other processes' closing records (by process index) to the world: their
  /// failures (whose exit notices may not have been read) and every replica of theirs as
  /// exited.
  void apply_closing(const std::vector<Closing>& all);
  void apply_notice(const std::vector<char>& msg, int source);
  void apply_broken(const std::vector<char>& msg);
  void answer_where(const std::vector<char>& msg, int source);
  void apply_where(const std::vector<char>& msg);
  void send_control(std::shared_ptr<std::vector<std::byte>> msg, const std::vector<int>& to, int tag);
  void settle(bool final_pass);

  int replicas_;
  ProcessPlace place_;
  // data_: packages and pieces; ctl_: exit notices and the groups' control messages, read
  // by the watcher; fin_: one collective per world, the closing exchange (finish()).
  MPI_Comm data_, ctl_, fin_;
  WorldState* world_ = nullptr;
  std::thread watcher_;
  std::atomic<bool> stop_{false};
  Closing closing_;  // this process's record (guarded by mu_ until the watcher stops)
  std::mutex calling_mu_;  // held while a BrokenHandler runs (see forget_group)
  static constexpr std::size_t kProbeLocks = 64;
  std::array<std::mutex, kProbeLocks> probe_mu_;  // see probe_mutex()
  std::mutex mu_;          // guards the lists below
  struct Pending {
    std::vector<MPI_Request> requests;
    std::vector<std::shared_ptr<void>> keep;
  };
  std::vector<Pending> outbox_;     // exit notices in flight
  std::vector<Pending> abandoned_;  // failed rounds' transfers
  std::map<std::pair<std::uint64_t, int>, std::deque<std::shared_ptr<std::vector<std::byte>>>> mailbox_;
  std::map<std::uint64_t, BrokenHandler> groups_;
  std::atomic<std::uint32_t> piece_counter_{0};
  std::atomic<int> mail_{0};  // packages in the mailbox
  // By world ordinal: the last answer of its process to ask_where (WorldState::pack_join).
  std::unique_ptr<std::atomic<std::uint64_t>[]> told_;
  // The host's shared window (Mpi::HostWindow; null when this process is alone on its
  // host or the memory is not there). This world's reservations start at 0: the previous
  // world's areas are read by nobody once every process joined this one.
  const Mpi::HostWindow* window_ = nullptr;
  std::size_t segment_used_ = 0;  // guarded by mu_
};

/// One group's link to the other processes holding members (MPI messages, and the host's
/// shared window for large entries).
class MpiLink final : public ProcessLink {
 public:
  /// `members`: the group (sorted ordinals); `on_broken`: see ProcessWorld::link.
  MpiLink(std::shared_ptr<MpiWorld> pw, const std::vector<int>& members, ProcessWorld::BrokenHandler on_broken);
  inline ~MpiLink() override;
  MpiLink(const MpiLink&) = delete;
  MpiLink& operator=(const MpiLink&) = delete;

  inline void begin(std::uint64_t s, const std::vector<Share*>& local, const std::vector<int>& ordinals) override;
  inline bool progress(const std::vector<Share*>& slot_share, const std::vector<int>& slot_of_ordinal) override;
  inline std::string waiting_for() const override;
  inline bool delivered_by_owner(int ordinal) const override;
  /// Also hands what is in flight to the MpiWorld.
  inline void abandon(const std::string& reason, GiveUp why) override;

 private:
  /// Takes the peer's next package of this group (from the mailbox or MPI); null if none.
  /// A package received from MPI goes into `recycle`'s storage when nothing else holds it.
  std::shared_ptr<std::vector<std::byte>> next_package(int process,
                                                       std::shared_ptr<std::vector<std::byte>>& recycle);

  /// An entry of a received package (progress()'s scratch).
  struct Entry {
    Share* share;
    std::size_t index, size;
    bool direct;
  };

  struct Peer {
    int process = 0;
    std::vector<int> ordinals;  ///< its members of the group
    std::shared_ptr<std::vector<std::byte>> header[2], bulk[2];
    bool got_header = false;
    std::vector<MPI_Request> recvs;
  };
  std::shared_ptr<MpiWorld> pw_;
  std::uint64_t hash_ = 0;
  int tag_ = 1;
  std::uint64_t round_ = 0;
  std::vector<Peer> peers_;
  std::vector<MPI_Request> sends_;
  std::shared_ptr<std::vector<std::byte>> out_[2];
  std::vector<std::shared_ptr<void>> out_keep_;
  std::vector<std::pair<const std::byte*, std::size_t>> direct_, packed_;  // begin()'s lists
  std::vector<Entry> entries_;                                            // progress()'s
  std::int64_t region_[2] = {-1, -1};  // this group's area of the segment, by round parity
  std::size_t region_bytes_[2] = {0, 0};
  bool shared_peers_ = false;          // every peer process shares this host
};

/// process_world.hpp's ProcessTransport over MPI.
class MpiTransport final : public ProcessTransport {
 public:
  inline ProcessPlace place() override;
  std::shared_ptr<ProcessWorld> join(int replicas) override { return MpiWorld::join(replicas); }
};

inline MpiTransport& mpi_transport() {
  static MpiTransport t;
  return t;
}

/// Installs MPI's transport before main (every translation unit that includes this header
/// initialises it; the first one does the work).
inline const bool kMpiTransportInstalled =
    (process_transport().store(&mpi_transport(), std::memory_order_release), true);

}  // namespace lazy::dist::detail
#endif  // LAZYTENSOR_WITH_MPI

#include <lazytensor/dist/mpi_world_impl.hpp>

#include <lazytensor/dist/mpi_link_impl.hpp>  // (after MpiWorld's definitions, which it uses)
