#pragma once
// The world of replicas: where this process's replicas sit among all of them, which ones
// are still running, the shared abort flag, the collective timeout, and the one event every
// blocked replica sleeps on (so an abort or an exit can wake them all).

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <lazytensor/core/config.hpp>
#include <lazytensor/core/error.hpp>
#include <lazytensor/core/spin_lock.hpp>

namespace lazy::dist {

namespace detail {

class ProcessWorld;  // process_world.hpp: the other processes of an MPI world

/// Default collective timeout: LAZYTENSOR_COLLECTIVE_TIMEOUT (seconds, may be fractional),
/// else 300 s. A malformed value is an error when a collective first needs it.
std::chrono::milliseconds env_collective_timeout();

/// The timeout in milliseconds; 0 means "not read from the environment yet".
inline std::atomic<std::int64_t>& timeout_ms() {
  static std::atomic<std::int64_t> ms{0};
  return ms;
}

using core::cpu_relax;

}  // namespace detail

/// How long a replica waits in a collective for the others before CollectiveTimeout.
std::chrono::milliseconds collective_timeout();

/// Sets the collective timeout for every replica of this process (default 300 s, or
/// LAZYTENSOR_COLLECTIVE_TIMEOUT seconds). Takes effect at the next wait. A timeout above
/// 1e9 s (milliseconds::max() for "never", say) waits 1e9 s, about 31 years: a deadline
/// further away would overflow the clock.
void set_collective_timeout(std::chrono::milliseconds t);

namespace detail {

/// Where this process's replica threads sit in the world. The threads backend has one
/// process holding every replica; an MPI backend has several processes, each with
/// `process_replicas` threads: global ordinal = process_offset + local replica index.
struct WorldLayout {
  int world_size = 1;        ///< replicas in the world, every process
  int process_offset = 0;    ///< global ordinal of this process's first replica
  int process_replicas = 1;  ///< replica threads in this process
  int host_offset = 0;       ///< ordinal on this host of this process's first replica
  int host_replicas = 1;     ///< replicas on this host, every process on it
};

/// A sleep/wake point for blocked replicas. Waiters spin first (the caller does), then
/// sleep here; whoever changes state that a waiter may be waiting for calls notify().
/// Both sides update `sleepers_` with a read-modify-write: either the notifier's RMW comes
/// later in its order and sees the sleeper, or the sleeper's RMW reads from the notifier's
/// and so sees the state it published before; a wake-up cannot be lost. Sleeps are also
/// capped at 100 ms as a second line of defence.
class Event {
 public:
  /// Wakes the sleepers, if any (cheap when nobody sleeps).
  void notify();
  /// Sleeps until pred() holds or `deadline` passes; returns pred().
  template <class Pred>
  bool wait_until(Pred&& pred, std::chrono::steady_clock::time_point deadline) {
    std::unique_lock lock(mu_);
    sleepers_.fetch_add(1, std::memory_order_acq_rel);
    while (!pred()) {
      const auto now = std::chrono::steady_clock::now();
      if (now >= deadline) break;
      cv_.wait_until(lock, std::min(deadline, now + std::chrono::milliseconds(100)));
    }
    sleepers_.fetch_sub(1, std::memory_order_relaxed);
    return pred();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::atomic<int> sleepers_{0};
};

/// How a waiter waits before it sleeps on the world's event: it spins for `spin`, then
/// checks between yields of its core for `yield`.
struct WaitBudget {
  std::chrono::nanoseconds spin{0};
  std::chrono::nanoseconds yield{0};
};

/// The wait budget of a world of `replicas` replica threads. A collective's partners
/// usually arrive within a microsecond or two, and a futex round trip costs more than that:
/// spin first. A partner can also be late by a good part of a step; sleeping then costs the
/// wake-up latency, which on a virtual machine (an idle vCPU halts and the host must
/// schedule it again) reaches tens to hundreds of microseconds, and in a synchronous step
/// both replicas pay it at the round's final barrier. So, while replicas fit the hardware
/// threads, the waiter yields its core for up to 2 ms before sleeping: anything else
/// runnable (the replica's tracing thread) still runs, and the waiter notices the partner
/// at once. Measured with 2 replicas training the benchmark MLP on the 2-core VM: a median
/// of 8% more samples/s than spinning 20 us and sleeping (5 alternating runs, 1.5-19%). When
/// replicas outnumber the hardware threads, waiting would only steal time from the replica being
/// waited for (it may not be running at all), so the budget is a short spin and no yielding.
WaitBudget wait_budget(int replicas);

/// Waits within `budget` (spinning, then yielding) until pred() holds (true) or the budget
/// is spent (false).
template <class Pred>
bool spin_until(Pred&& pred, WaitBudget budget) {
  const auto start = std::chrono::steady_clock::now();
  for (int i = 1;; ++i) {
    if (pred()) return true;
    cpu_relax();
    if ((i & 31) == 0 && std::chrono::steady_clock::now() - start >= budget.spin) break;
  }
  if (budget.yield.count() > 0) {
    const auto until = std::chrono::steady_clock::now() + budget.yield;
    do {
      if (pred()) return true;
      std::this_thread::yield();
    } while (std::chrono::steady_clock::now() < until);
  }
  return pred();
}

/// Shared state of one world: replica lifecycle, abort flag and first failure, the event.
class WorldState {
 public:
  explicit WorldState(WorldLayout layout);

  const WorldLayout& layout() const { return layout_; }
  Event& event() { return event_; }
  /// The other processes of an MPI world (null when the world is this process alone).
  const std::shared_ptr<ProcessWorld>& processes() const { return processes_; }
  void set_processes(std::shared_ptr<ProcessWorld> p) { processes_ = std::move(p); }
  /// How waiters wait before sleeping (see wait_budget).
  WaitBudget wait() const { return wait_; }

  /// True once any replica failed: every waiter must give up with ReplicaAborted.
  bool aborted() const { return aborted_.load(std::memory_order_acquire); }

  /// Records that replica `ordinal` failed with `e`; the first failure is kept (and
  /// re-thrown by spawn) and aborts the world. Returns true for the first failure.
  bool fail(int ordinal, std::exception_ptr e);
  /// The first failure (null when none).
  std::exception_ptr first_error() const;
  /// "replica 2 failed: <what>", for ReplicaAborted messages.
  std::string abort_reason() const;

  /// Marks replica `ordinal` as gone (its function returned or threw): collectives that
  /// wait for it fail at once instead of timing out.
  void mark_exited(int ordinal);
  bool exited(int ordinal) const {
    return exited_[static_cast<std::size_t>(ordinal)].load(std::memory_order_acquire);
  }

  /// Records that replica `ordinal` (of this process) published its share of its
  /// collective #`world_seq` (Signature::world_seq) in the group tagged `group`
  /// (GroupComm::tag). A partner that still waits for it in a collective with a count no
  /// higher knows it went elsewhere. Stored after the share's arrival flag: whoever reads
  /// the count sees that flag too.
  void note_joined(int ordinal, std::uint64_t world_seq, std::uint32_t group) {
    Joined& j = joined_[static_cast<std::size_t>(ordinal - layout_.process_offset)];
    j.recent[world_seq % kRecentJoins].store(pack_join(world_seq, group), std::memory_order_relaxed);
    j.n.store(world_seq, std::memory_order_release);
  }
  /// The last count noted for replica `ordinal` of this process (0: none yet).
  std::uint64_t joined(int ordinal) const {
    return joined_[static_cast<std::size_t>(ordinal - layout_.process_offset)].n.load(
        std::memory_order_acquire);
  }
  /// The tag of the group in which replica `ordinal` of this process joined its collective
  /// #`world_seq`, or -1 when it has not joined it yet or joined it too long ago to say
  /// (another process asks this of a partner it waits for: see ProcessWorld::ask_where).
  std::int64_t joined_group(int ordinal, std::uint64_t world_seq) const {
    const Joined& j = joined_[static_cast<std::size_t>(ordinal - layout_.process_offset)];
    return group_of_join(j.recent[world_seq % kRecentJoins].load(std::memory_order_acquire), world_seq);
  }

  /// A join record: collective count and group tag in one word, so a reader never sees one
  /// collective's count with another's group. Group tags keep their low kJoinTagBits bits.
  static constexpr int kJoinTagBits = 24;
  static std::uint64_t pack_join(std::uint64_t world_seq, std::uint32_t group) {
    return ((world_seq & kJoinSeqMask) << kJoinTagBits) | (group & kJoinTagMask);
  }
  /// The group tag of record `e` when it is of collective #`world_seq`, else -1.
  static std::int64_t group_of_join(std::uint64_t e, std::uint64_t world_seq) {
    return world_seq != 0 && (e >> kJoinTagBits) == (world_seq & kJoinSeqMask)
               ? static_cast<std::int64_t>(e & kJoinTagMask)
               : -1;
  }

 private:
  static constexpr std::size_t kRecentJoins = 16;
  static constexpr std::uint64_t kJoinSeqMask = (std::uint64_t{1} << (64 - kJoinTagBits)) - 1;
  static constexpr std::uint32_t kJoinTagMask = (std::uint32_t{1} << kJoinTagBits) - 1;
  struct alignas(64) Joined {  // lines of its own: every replica writes its own per collective
    std::atomic<std::uint64_t> n{0};
    std::atomic<std::uint64_t> recent[kRecentJoins] = {};  ///< by count modulo kRecentJoins
  };

  WorldLayout layout_;
  std::shared_ptr<ProcessWorld> processes_;
  std::vector<std::atomic<bool>> exited_;
  std::unique_ptr<Joined[]> joined_;
  WaitBudget wait_;
  Event event_;
  std::atomic<bool> aborted_{false};
  mutable std::mutex mu_;
  std::exception_ptr error_;  // guarded by mu_
  int failed_ordinal_ = -1;   // guarded by mu_
  std::string failure_;       // guarded by mu_
};

}  // namespace detail
}  // namespace lazy::dist

#if LAZYTENSOR_HEADER_DEFINITIONS
namespace lazy::dist::detail {
LAZYTENSOR_INLINE std::chrono::milliseconds env_collective_timeout() {
  const char* env = std::getenv("LAZYTENSOR_COLLECTIVE_TIMEOUT");
  if (!env || !*env) return std::chrono::seconds(300);
  char* end = nullptr;
  const double s = std::strtod(env, &end);
  if (end == env || *end != '\0' || !(s > 0) || s > 1e9) {
    throw Error(std::string("LAZYTENSOR_COLLECTIVE_TIMEOUT='") + env +
                "' is not a number of seconds > 0 (expected e.g. 300 or 0.5)");
  }
  return std::chrono::milliseconds(
      std::max<std::int64_t>(1, static_cast<std::int64_t>(s * 1000.0)));
}
}  // namespace lazy::dist::detail

namespace lazy::dist {
LAZYTENSOR_INLINE std::chrono::milliseconds collective_timeout() {
  auto& ms = detail::timeout_ms();
  std::int64_t v = ms.load(std::memory_order_relaxed);
  if (v == 0) {
    v = detail::env_collective_timeout().count();
    std::int64_t expected = 0;
    if (!ms.compare_exchange_strong(expected, v)) v = expected;  // set_collective_timeout won
  }
  return std::chrono::milliseconds(v);
}

LAZYTENSOR_INLINE void set_collective_timeout(std::chrono::milliseconds t) {
  if (t.count() <= 0) {
    throw Error("set_collective_timeout: the timeout must be > 0 ms, got " +
                std::to_string(t.count()) + " ms");
  }
  constexpr std::int64_t longest =
      std::int64_t{1'000'000'000} * 1000;  // 1e9 s, as the variable allows
  detail::timeout_ms().store(std::min(t.count(), longest));
}
}  // namespace lazy::dist

namespace lazy::dist::detail {
LAZYTENSOR_INLINE void Event::notify() {
  if (sleepers_.fetch_add(0, std::memory_order_acq_rel) > 0) {
    std::lock_guard lock(mu_);
    cv_.notify_all();
  }
}

LAZYTENSOR_INLINE WaitBudget wait_budget(int replicas) {
  const int hw = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  if (replicas <= hw) return {std::chrono::microseconds(20), std::chrono::milliseconds(2)};
  return {std::chrono::microseconds(1), std::chrono::nanoseconds(0)};
}

LAZYTENSOR_INLINE WorldState::WorldState(WorldLayout layout)
    : layout_(layout),
      exited_(static_cast<std::size_t>(layout.world_size)),
      joined_(std::make_unique<Joined[]>(static_cast<std::size_t>(layout.process_replicas))),
      wait_(wait_budget(layout.host_replicas)) {}

LAZYTENSOR_INLINE bool WorldState::fail(int ordinal, std::exception_ptr e) {
  bool first = false;
  {
    std::lock_guard lock(mu_);
    if (!error_) {
      error_ = e;
      failed_ordinal_ = ordinal;
      failure_ = lazy::detail::exception_message(e);
      first = true;
    }
  }
  aborted_.store(true, std::memory_order_release);
  event_.notify();
  return first;
}

LAZYTENSOR_INLINE std::exception_ptr WorldState::first_error() const {
  std::lock_guard lock(mu_);
  return error_;
}

LAZYTENSOR_INLINE std::string WorldState::abort_reason() const {
  std::lock_guard lock(mu_);
  if (!error_) return "the world was aborted";
  if (failed_ordinal_ < 0) return "spawn failed: " + failure_;
  return "replica " + std::to_string(failed_ordinal_) + " failed: " + failure_;
}

LAZYTENSOR_INLINE void WorldState::mark_exited(int ordinal) {
  exited_[static_cast<std::size_t>(ordinal)].store(true, std::memory_order_release);
  event_.notify();
}
}  // namespace lazy::dist::detail
#endif  // LAZYTENSOR_HEADER_DEFINITIONS
