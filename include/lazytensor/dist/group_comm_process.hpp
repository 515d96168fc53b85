#pragma once
// Definitions of group_comm.hpp's cross-process leg (included at its end): a leader's wait for
// its local members, the exchange of their shares with the other processes, and the marking
// of the remote members as arrived (see group_comm.hpp's file comment).

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <lazytensor/core/config.hpp>

#if LAZYTENSOR_HEADER_DEFINITIONS
namespace lazy::dist::detail {

LAZYTENSOR_INLINE void GroupComm::cross_process(int me, std::uint64_t s, const Signature& sig,
                                                std::chrono::milliseconds timeout) {
  WorldState& w = *world_;
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  const std::size_t n = members_.size();
  auto locals_arrived = [&] {
    for (std::size_t j = 0; j < n; ++j) {
      if (local_index_[j] >= 0 && slots_[j].arrived.load(std::memory_order_acquire) < s)
        return false;
    }
    return true;
  };
  // Giving up throws (withdraw(): nobody can start before the leader), and first tells the
  // group's other processes, which must not wait for this one's later rounds.
  auto give_up = [&](Failure why, const std::string& reason) {
    link_->abandon("replica " + std::to_string(members_[static_cast<std::size_t>(me)]) + " " + reason, why);
    withdraw(me, s, sig, why, reason);
  };
  // The group broke meanwhile (a local member or a peer process gave up): peers must hear
  // of a local reason.
  auto broken_out = [&] {
    std::string reason;
    Failure why = Failure::Exited;
    {
      std::lock_guard lock(broken_mu_);
      if (!broken_by_peer_) reason = broken_reason_;
      why = broken_kind_;
    }
    link_->abandon(reason, why);
    throw_broken(me, s, sig);
  };
  // 1. This process's members.
  if (!spin_until(locals_arrived, w.wait())) {
    while (!locals_arrived()) {
      if (state_.load(std::memory_order_acquire) & kBroken) broken_out();
      const int gone = exited_partner(s);
      const int elsewhere = diverged_partner(s, sig.world_seq);
      if (w.aborted()) {
        give_up(Failure::Aborted, "aborted because " + w.abort_reason());
      } else if (elsewhere >= 0) {
        give_up(Failure::Mismatch, diverged(elsewhere, sig.world_seq));
      } else if (gone >= 0) {
        give_up(Failure::Exited,
                "replica " + std::to_string(gone) +
                    " exited (its function returned) without joining this collective");
      } else if (std::chrono::steady_clock::now() >= deadline) {
        give_up(Failure::Timeout, timed_out(timeout, missing(s)));
      }
      w.event().wait_until(
          [&] {
            return locals_arrived() || (state_.load(std::memory_order_acquire) & kBroken) ||
                   w.aborted() || exited_partner(s) >= 0 || diverged_partner(s, sig.world_seq) >= 0;
          },
          deadline);
    }
  }
  // 2. Their shares out, the other processes' in.
  std::vector<Share*>& by_slot = round_shares_;  // (kept: no allocation per round)
  std::vector<Share*>& local = local_shares_;
  std::vector<int>& ordinals = local_ordinals_;
  by_slot.resize(n);
  local.clear();
  ordinals.clear();
  for (std::size_t j = 0; j < n; ++j) {
    by_slot[j] = &slots_[j].round[s & 1];
    if (local_index_[j] < 0) continue;
    local.push_back(by_slot[j]);
    ordinals.push_back(members_[j]);
  }
  try {
    link_->begin(s, local, ordinals);
  } catch (const std::exception& e) {
    give_up(Failure::Exited, e.what());
  }
  const auto polite = std::chrono::steady_clock::now() + w.wait().spin + w.wait().yield;
  // A remote partner seen exited before its package arrived: its package may still be on
  // the way (exit notices travel on another communicator), so wait a moment before failing.
  std::chrono::steady_clock::time_point gone_since{};
  for (int i = 0;; ++i) {
    bool done = false;
    try {
      done = link_->progress(by_slot, slot_of_);
    } catch (const std::exception& e) {
      give_up(Failure::Exited, e.what());
    }
    if (done) break;
    if ((i & 15) != 15) continue;
    const auto now = std::chrono::steady_clock::now();
    if (state_.load(std::memory_order_acquire) & kBroken) broken_out();
    if (w.aborted()) give_up(Failure::Aborted, "aborted because " + w.abort_reason());
    int gone = -1;
    for (std::size_t j = 0; j < n && gone < 0; ++j) {
      if (local_index_[j] < 0 && w.exited(members_[j]) && !link_->delivered_by_owner(members_[j]))
        gone = members_[j];
    }
    // (Asked only once the wait is long: most rounds end within the polite spin.)
    if (const int elsewhere = now > polite ? diverged_remote(sig.world_seq, now) : -1; elsewhere >= 0)
      give_up(Failure::Mismatch, "replica " + std::to_string(elsewhere) + " joined its collective #" +
                                     std::to_string(sig.world_seq) +
                                     " in another group instead of this one: the replicas passed "
                                     "different groups partitions, or issued different collectives");
    if (gone < 0) {
      gone_since = {};
    } else if (gone_since == std::chrono::steady_clock::time_point{}) {
      gone_since = now;
    } else if (now - gone_since > std::chrono::milliseconds(250)) {
      give_up(Failure::Exited, "replica " + std::to_string(gone) +
                                   " exited (its function returned) without joining this "
                                   "collective");
    }
    if (now >= deadline) give_up(Failure::Timeout, timed_out(timeout, link_->waiting_for()));
    if (now > polite) std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
  // 3. The remote members' shares are in their slots: they count as arrived (and, having
  //    nothing of theirs to read in place, as done).
  for (std::size_t j = 0; j < n; ++j) {
    if (local_index_[j] >= 0) continue;
    slots_[j].done.store(s, std::memory_order_release);
    slots_[j].arrived.store(s, std::memory_order_seq_cst);
  }
  w.event().notify();
}

}  // namespace lazy::dist::detail
#endif  // LAZYTENSOR_HEADER_DEFINITIONS
