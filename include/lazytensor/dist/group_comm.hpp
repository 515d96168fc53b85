#pragma once
// The shared-memory exchange of one replica group (threads backend).
//
// A round (one collective, sequence number s of this group) goes:
//   1. publish: each member writes its signature and data pointers (or, for small
//      messages, a copy of its data) into its slot, then sets `arrived = s`;
//   2. start: once every member arrived, the round starts (an atomic `started = s`, so
//      that a member giving up on a timeout or an abort can withdraw only while nobody has
//      started; a round that started always completes);
//   3. check: every member compares every signature and throws CollectiveMismatch when
//      one differs, before touching any data;
//   4. work: each member reads the others' data (always in rank order) and writes outputs;
//   5. done: when members read each other's buffers (not copies), each sets `done = s` and
//      waits for all, so no buffer is freed or reused while another member reads it.
// Slots are double-buffered by the parity of s: a member can only reach round s + 2 after
// every member arrived at s + 1, i.e. finished reading round s, so copied (inline) data
// needs no step 5 and a small collective costs one synchronization.
//
// Across processes (MPI, process_world.hpp) the slots of members in other processes are
// filled by this process's leader (its lowest member of the group): it waits for its local
// members to arrive, sends their shares to the other processes, receives theirs, and only
// then marks the remote members arrived, so the round starts with every share in place.
// In-place work is then split among the local members only (local_count, local_index).
//
// Waiting: spin, then yield, then sleep on the world's event (world.hpp, wait_budget).
// Only step 2 gives up (abort, a partner that exited, a partner that joined the same count
// of its collectives in another group, timeout; a leader waiting for another process asks
// it where its members went: ProcessWorld::ask_where); once a round started
// every member is inside it doing bounded memory work, so steps 4-5 never give up (giving
// up there could free memory a partner is still reading).

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <lazytensor/core/config.hpp>
#include <lazytensor/core/error.hpp>
#include <lazytensor/dist/process_world.hpp>
#include <lazytensor/dist/share.hpp>
#include <lazytensor/dist/signature.hpp>
#include <lazytensor/dist/world.hpp>

namespace lazy::dist::detail {

/// "timed out after 2.5 s waiting for <whom> (set the limit with ...)".
std::string timed_out(std::chrono::milliseconds timeout, const std::string& whom);

/// One group's exchange: its members (sorted global ordinals), their slots, the round state.
class GroupComm {
 public:
  GroupComm(std::shared_ptr<WorldState> world, std::vector<int> members);
  ~GroupComm();
  GroupComm(const GroupComm&) = delete;
  GroupComm& operator=(const GroupComm&) = delete;

  int size() const { return static_cast<int>(members_.size()); }
  /// Members, sorted by ordinal (slot i belongs to members()[i]).
  const std::vector<int>& members() const { return members_; }
  /// Slot of replica `ordinal` (-1 when not a member).
  int slot_of(int ordinal) const { return slot_of_[static_cast<std::size_t>(ordinal)]; }
  WorldState& world() { return *world_; }
  /// Whether the group has members in other processes.
  bool spans_processes() const { return local_count_ < size(); }
  /// Members in this process, and the slot of the lowest one (it leads in-place rounds).
  int local_count() const { return local_count_; }
  int leader() const { return leader_; }
  /// Position of `slot` among the local members (-1 for a remote member).
  int local_index(int slot) const { return local_index_[static_cast<std::size_t>(slot)]; }

  /// Read access to every member's share of round s.
  class Round {
   public:
    Round(const GroupComm& c, std::uint64_t s) : c_(c), s_(s) {}
    const Share& operator[](int slot) const {
      return c_.slots_[static_cast<std::size_t>(slot)].round[s_ & 1];
    }

   private:
    const GroupComm& c_;
    std::uint64_t s_;
  };

  /// Runs round `s` for member `me`: publish(Share&) fills this member's share,
  /// work(const Round&) runs once every member published matching signatures. With
  /// `read_in_place`, members read each other's buffers, so the round ends with a barrier.
  template <class Publish, class Work>
  void exchange(int me, std::uint64_t s, const Signature& sig, Publish&& publish, Work&& work,
                bool read_in_place) {
    WorldState& w = *world_;
    if (w.aborted()) {
      throw ReplicaAborted(prefix(me, s, sig) + "aborted because " + w.abort_reason());
    }
    if (state_.load(std::memory_order_acquire) & kBroken) throw_broken(me, s, sig);
    // Read before publishing: once this member arrived it may only leave through withdraw().
    const std::chrono::milliseconds timeout = collective_timeout();
    Slot& slot = slots_[static_cast<std::size_t>(me)];
    Share& mine = slot.round[s & 1];
    mine.sig = sig;
    mine.data.clear();
    mine.bytes.clear();
    mine.buffers.clear();
    mine.keep.clear();
    publish(mine);
    slot.arrived.store(s, std::memory_order_seq_cst);
    if (sig.world_seq) w.note_joined(members_[static_cast<std::size_t>(me)], sig.world_seq, tag_);
    w.event().notify();
    if (spans_processes() && me == leader_) cross_process(me, s, sig, timeout);
    await_start(me, s, sig, timeout);
    const Round round(*this, s);
    check_signatures(round, me, s);
    if (!read_in_place) {
      work(round);
      return;
    }
    try {
      work(round);
    } catch (...) {
      finish(me, s);
      throw;
    }
    finish(me, s);
  }

 private:
  static constexpr std::uint64_t kBroken = std::uint64_t{1} << 63;
  using Failure = GiveUp;

  struct alignas(64) Slot {
    std::atomic<std::uint64_t> arrived{0};  ///< last round this member published
    std::atomic<std::uint64_t> done{0};     ///< last round this member finished reading
    alignas(64) Share round[2];
  };

  std::string prefix(int me, std::uint64_t s, const Signature& sig) const;

  bool all_arrived(std::uint64_t s) const;
  /// A member that has not arrived at round s and whose replica has exited, else -1.
  int exited_partner(std::uint64_t s) const;
  std::string missing(std::uint64_t s) const;
  /// A member of this process that has not arrived at round s but has joined its
  /// collective #world_seq (or a later one) elsewhere, else -1: it will never come.
  int diverged_partner(std::uint64_t s, std::uint64_t world_seq) const;
  /// The reason given when `partner` diverged (see diverged_partner).
  std::string diverged(int partner, std::uint64_t world_seq) const;
  /// A member of another process that has not delivered round s and whose process answered
  /// that it joined its collective #world_seq in another group, else -1 (asks its process
  /// at most every few milliseconds: ProcessWorld::ask_where). Groups are told apart by a
  /// 24-bit hash of their members: two that hash alike only hide a mismatch (it then ends at
  /// the timeout), never make one up.
  int diverged_remote(std::uint64_t world_seq, std::chrono::steady_clock::time_point now);

  void await_start(int me, std::uint64_t s, const Signature& sig,
                   std::chrono::milliseconds timeout);

  void start(int me, std::uint64_t s, const Signature& sig);

  /// The leader's part of a round that spans processes (see the file comment).
  void cross_process(int me, std::uint64_t s, const Signature& sig,
                     std::chrono::milliseconds timeout);

  /// Gives up on round s unless it already started. Returns true when it had started (the
  /// caller must take part); otherwise marks the group broken and throws.
  bool withdraw(int me, std::uint64_t s, const Signature& sig, Failure why,
                const std::string& reason);

  [[noreturn]] void throw_broken(int me, std::uint64_t s, const Signature& sig);

  /// Another process gave up a round of this group: later rounds fail (a round that
  /// already started here completes).
  void break_from_peer(const std::string& reason, Failure why);

  [[noreturn]] static void raise(Failure why, const std::string& msg);

  /// Throws CollectiveMismatch (on every member: they all see the same signatures) when
  /// the members' signatures differ, naming the replicas that diverged from the majority.
  void check_signatures(const Round& round, int me, std::uint64_t s) const;

  /// Step 5: this member is done reading; wait until every member is, then drop the
  /// references this member shared.
  void finish(int me, std::uint64_t s);

  std::shared_ptr<WorldState> world_;
  std::vector<int> members_;
  std::vector<int> slot_of_;
  std::unique_ptr<Slot[]> slots_;
  std::vector<int> local_index_;
  int local_count_ = 0;
  int leader_ = 0;
  std::uint32_t tag_ = 0;  ///< the members' hash, as a join record holds it (WorldState::note_joined)
  std::unique_ptr<ProcessLink> link_;  // with members in other processes
  std::chrono::steady_clock::time_point asked_where_{};  // the leader's last ask_where
  // The leader's lists for cross_process (one leader, one round at a time).
  std::vector<Share*> round_shares_, local_shares_;
  std::vector<int> local_ordinals_;
  std::atomic<std::uint64_t> state_{0};  ///< last started round, | kBroken once unusable
  std::mutex broken_mu_;
  Failure broken_kind_ = Failure::Timeout;  // guarded by broken_mu_
  std::string broken_reason_;               // guarded by broken_mu_
  bool broken_by_peer_ = false;             // guarded by broken_mu_: another process said so
};

}  // namespace lazy::dist::detail

#if LAZYTENSOR_HEADER_DEFINITIONS
namespace lazy::dist::detail {
LAZYTENSOR_INLINE GroupComm::GroupComm(std::shared_ptr<WorldState> world, std::vector<int> members)
    : world_(std::move(world)),
      members_(std::move(members)),
      slot_of_(static_cast<std::size_t>(world_->layout().world_size), -1),
      slots_(std::make_unique<Slot[]>(members_.size())),
      local_index_(members_.size(), -1) {
  const WorldLayout& l = world_->layout();
  for (std::size_t i = 0; i < members_.size(); ++i) {
    const int m = members_[i];
    slot_of_[static_cast<std::size_t>(m)] = static_cast<int>(i);
    if (m >= l.process_offset && m < l.process_offset + l.process_replicas) {
      if (local_count_ == 0) leader_ = static_cast<int>(i);
      local_index_[i] = local_count_++;
    }
  }
  std::uint32_t h = 2166136261u;  // FNV-1a over the ordinals: the same in every process
  for (int m : members_) h = (h ^ static_cast<std::uint32_t>(m)) * 16777619u;
  tag_ = h & ((std::uint32_t{1} << WorldState::kJoinTagBits) - 1);
  if (spans_processes()) {
    link_ = world_->processes()->link(members_, [this](const std::string& reason, Failure why) {
      break_from_peer(reason, why);
    });
  }
}

LAZYTENSOR_INLINE GroupComm::~GroupComm() {
  link_.reset();  // first: it stops calling break_from_peer
}

LAZYTENSOR_INLINE void GroupComm::break_from_peer(const std::string& reason, Failure why) {
  {
    std::lock_guard lock(broken_mu_);
    if (!(state_.load(std::memory_order_acquire) & kBroken)) {
      broken_kind_ = why;
      broken_reason_ = reason;
      broken_by_peer_ = true;
    }
    state_.fetch_or(kBroken, std::memory_order_acq_rel);
  }
  world_->event().notify();
}

LAZYTENSOR_INLINE std::string GroupComm::prefix(int me, std::uint64_t s,
                                                const Signature& sig) const {
  return "replica " + std::to_string(members_[static_cast<std::size_t>(me)]) + ": " + sig.str() +
         " (collective #" + std::to_string(s) + " of group " + list_str(members_) + "): ";
}

LAZYTENSOR_INLINE bool GroupComm::all_arrived(std::uint64_t s) const {
  for (std::size_t j = 0; j < members_.size(); ++j) {
    if (slots_[j].arrived.load(std::memory_order_acquire) < s) return false;
  }
  return true;
}

LAZYTENSOR_INLINE int GroupComm::exited_partner(std::uint64_t s) const {
  for (std::size_t j = 0; j < members_.size(); ++j) {
    if (local_index_[j] < 0) continue;  // remote members: the leader's concern
    if (slots_[j].arrived.load(std::memory_order_acquire) < s && world_->exited(members_[j]))
      return members_[j];
  }
  return -1;
}

LAZYTENSOR_INLINE int GroupComm::diverged_partner(std::uint64_t s, std::uint64_t world_seq) const {
  if (world_seq == 0) return -1;  // a rendezvous among chosen replicas: not counted
  for (std::size_t j = 0; j < members_.size(); ++j) {
    if (local_index_[j] < 0) continue;  // remote members: their process checks them
    // The count first: it is stored after the arrival flag, so reading it makes a later
    // arrival read current.
    if (world_->joined(members_[j]) >= world_seq &&
        slots_[j].arrived.load(std::memory_order_acquire) < s)
      return members_[j];
  }
  return -1;
}

LAZYTENSOR_INLINE std::string GroupComm::diverged(int partner, std::uint64_t world_seq) const {
  return "replica " + std::to_string(partner) + " joined its collective #" +
         std::to_string(world_->joined(partner)) + " in another group instead of this one (its #" +
         std::to_string(world_seq) +
         " here): the replicas passed different groups partitions, or issued different "
         "collectives";
}

LAZYTENSOR_INLINE int GroupComm::diverged_remote(std::uint64_t world_seq,
                                                 std::chrono::steady_clock::time_point now) {
  if (world_seq == 0) return -1;  // a rendezvous among chosen replicas: not counted
  ProcessWorld& pw = *world_->processes();
  std::vector<std::pair<int, std::uint64_t>> ask;
  for (std::size_t j = 0; j < members_.size(); ++j) {
    const int m = members_[j];
    if (local_index_[j] >= 0 || link_->delivered_by_owner(m)) continue;
    const std::int64_t g = pw.told_where(m, world_seq);
    if (g >= 0 && static_cast<std::uint32_t>(g) != tag_) return m;
    if (g < 0) ask.emplace_back(m, world_seq);
  }
  // Asking costs the peer's watcher a message: a few times per wait is enough to fail
  // within milliseconds rather than at the timeout.
  if (!ask.empty() && now - asked_where_ >= std::chrono::milliseconds(5)) {
    asked_where_ = now;
    pw.ask_where(ask);
  }
  return -1;
}

LAZYTENSOR_INLINE std::string GroupComm::missing(std::uint64_t s) const {
  std::string m;
  for (std::size_t j = 0; j < members_.size(); ++j) {
    const std::uint64_t a = slots_[j].arrived.load(std::memory_order_acquire);
    if (a >= s) continue;
    if (!m.empty()) m += ", ";
    m += "replica " + std::to_string(members_[j]) +
         (a ? " (last joined collective #" + std::to_string(a) + ")" : " (joined none yet)");
  }
  return m;
}

LAZYTENSOR_INLINE void GroupComm::await_start(int me, std::uint64_t s, const Signature& sig,
                                              std::chrono::milliseconds timeout) {
  WorldState& w = *world_;
  if (!spin_until([&] { return all_arrived(s); }, w.wait())) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    for (;;) {
      if (all_arrived(s)) break;
      if (state_.load(std::memory_order_acquire) & kBroken) break;  // start() reports it
      const int gone = exited_partner(s);
      const int elsewhere = diverged_partner(s, sig.world_seq);
      if (w.aborted()) {
        if (withdraw(me, s, sig, Failure::Aborted, "aborted because " + w.abort_reason())) break;
      } else if (elsewhere >= 0) {
        if (withdraw(me, s, sig, Failure::Mismatch, diverged(elsewhere, sig.world_seq))) break;
      } else if (gone >= 0) {
        if (withdraw(me, s, sig, Failure::Exited,
                     "replica " + std::to_string(gone) +
                         " exited (its function returned) without joining this collective")) {
          break;
        }
      } else if (std::chrono::steady_clock::now() >= deadline) {
        if (withdraw(me, s, sig, Failure::Timeout, timed_out(timeout, missing(s)))) {
          break;
        }
      }
      w.event().wait_until(
          [&] {
            return all_arrived(s) || (state_.load(std::memory_order_acquire) & kBroken) ||
                   w.aborted() || exited_partner(s) >= 0 || diverged_partner(s, sig.world_seq) >= 0;
          },
          deadline);
    }
  }
  start(me, s, sig);
}

LAZYTENSOR_INLINE std::string timed_out(std::chrono::milliseconds timeout,
                                        const std::string& whom) {
  std::string t = std::to_string(static_cast<double>(timeout.count()) / 1000.0);
  t.erase(t.find_last_not_of('0') + 1);
  if (t.back() == '.') t.pop_back();
  return "timed out after " + t + " s waiting for " + whom +
         " (set the limit with lazy::dist::set_collective_timeout or "
         "LAZYTENSOR_COLLECTIVE_TIMEOUT seconds)";
}

LAZYTENSOR_INLINE void GroupComm::start(int me, std::uint64_t s, const Signature& sig) {
  std::uint64_t expected = s - 1;
  if (state_.compare_exchange_strong(expected, s, std::memory_order_acq_rel)) return;
  if ((expected & ~kBroken) >= s) return;  // another member started it
  throw_broken(me, s, sig);
}

LAZYTENSOR_INLINE bool GroupComm::withdraw(int me, std::uint64_t s, const Signature& sig,
                                           Failure why, const std::string& reason) {
  std::unique_lock lock(broken_mu_);
  std::uint64_t expected = s - 1;
  if (state_.compare_exchange_strong(expected, (s - 1) | kBroken, std::memory_order_acq_rel)) {
    broken_kind_ = why;
    broken_reason_ =
        "replica " + std::to_string(members_[static_cast<std::size_t>(me)]) + " " + reason;
    lock.unlock();
    world_->event().notify();
    raise(why, prefix(me, s, sig) + reason);
  }
  if ((expected & ~kBroken) >= s) return true;
  lock.unlock();
  throw_broken(me, s, sig);
}

LAZYTENSOR_INLINE void GroupComm::throw_broken(int me, std::uint64_t s, const Signature& sig) {
  std::lock_guard lock(broken_mu_);
  const std::string msg = prefix(me, s, sig) + "the group can no longer be used: " + broken_reason_;
  raise(broken_kind_, msg);
}

LAZYTENSOR_INLINE void GroupComm::raise(Failure why, const std::string& msg) {
  switch (why) {
    case Failure::Timeout:
      throw CollectiveTimeout(msg);
    case Failure::Aborted:
      throw ReplicaAborted(msg);
    case Failure::Mismatch:
      throw CollectiveMismatch(msg);
    case Failure::Exited:
      break;
  }
  throw CollectiveError(msg);
}

LAZYTENSOR_INLINE void GroupComm::check_signatures(const Round& round, int me,
                                                   std::uint64_t s) const {
  const int n = size();
  bool same = true;
  for (int j = 1; j < n && same; ++j) same = round[j].sig == round[0].sig;
  if (same) return;
  // Classes of equal signatures; the largest (ties: the one holding the lowest ordinal)
  // is the reference, every other class diverged.
  std::vector<int> cls(static_cast<std::size_t>(n), -1);
  std::vector<std::vector<int>> classes;
  for (int j = 0; j < n; ++j) {
    if (cls[static_cast<std::size_t>(j)] >= 0) continue;
    cls[static_cast<std::size_t>(j)] = static_cast<int>(classes.size());
    classes.push_back({j});
    for (int k = j + 1; k < n; ++k) {
      if (cls[static_cast<std::size_t>(k)] < 0 && round[k].sig == round[j].sig) {
        cls[static_cast<std::size_t>(k)] = cls[static_cast<std::size_t>(j)];
        classes.back().push_back(k);
      }
    }
  }
  std::size_t ref = 0;
  for (std::size_t c = 1; c < classes.size(); ++c) {
    if (classes[c].size() > classes[ref].size()) ref = c;
  }
  auto who = [&](const std::vector<int>& slots) {
    std::string w = slots.size() == 1 ? "replica " : "replicas ";
    for (std::size_t i = 0; i < slots.size(); ++i) {
      w += (i ? ", " : "") + std::to_string(members_[static_cast<std::size_t>(slots[i])]);
    }
    return w;
  };
  std::string msg = "replica " + std::to_string(members_[static_cast<std::size_t>(me)]) +
                    ": collective mismatch at collective #" + std::to_string(s) + " of group " +
                    list_str(members_) + ": ";
  for (std::size_t c = 0; c < classes.size(); ++c) {
    if (c == ref) continue;
    msg += who(classes[c]) + " issued " + round[classes[c].front()].sig.str() + "; ";
  }
  msg += who(classes[ref]) + " issued " + round[classes[ref].front()].sig.str();
  throw CollectiveMismatch(msg);
}

LAZYTENSOR_INLINE void GroupComm::finish(int me, std::uint64_t s) {
  Slot& slot = slots_[static_cast<std::size_t>(me)];
  slot.done.store(s, std::memory_order_seq_cst);
  WorldState& w = *world_;
  w.event().notify();
  auto all_done = [&] {
    for (std::size_t j = 0; j < members_.size(); ++j) {
      if (slots_[j].done.load(std::memory_order_acquire) < s) return false;
    }
    return true;
  };
  bool ready = spin_until(all_done, w.wait());
  while (!ready) {
    ready =
        w.event().wait_until(all_done, std::chrono::steady_clock::now() + std::chrono::seconds(1));
  }
  slot.round[s & 1].buffers.clear();
  slot.round[s & 1].keep.clear();
}
}  // namespace lazy::dist::detail
#endif  // LAZYTENSOR_HEADER_DEFINITIONS

#include <lazytensor/dist/group_comm_process.hpp>  // GroupComm::cross_process
