#pragma once
// Definitions of mpi_world.hpp's MpiWorld (included at its end): lazytensor::mpi's process
// world, its control messages and the watcher thread.

#include <lazytensor/core/error.hpp>
#include <lazytensor/dist/mpi_package.hpp>
#include <lazytensor/dist/mpi_process_impl.hpp>

#if LAZYTENSOR_WITH_MPI
#include <algorithm>
#include <array>
#include <cstring>
#include <utility>

namespace lazy::dist::detail {

inline std::shared_ptr<MpiWorld> MpiWorld::join(int replicas) {
  if (mpi_transport().place().count == 1) return nullptr;
  Mpi& mpi = Mpi::get();
  const ProcessPlace place = mpi.place();
  if (!mpi.multiple()) {
    throw Error("spawn: MPI was initialised with thread level " + std::to_string(mpi.provided()) +
                "; a world of several processes needs MPI_THREAD_MULTIPLE (initialise MPI "
                "with MPI_Init_thread(..., MPI_THREAD_MULTIPLE, ...) or let lazytensor do it)");
  }
  const auto timeout = collective_timeout();
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  // The handles live on the heap: a join that times out leaves MPI writing into them.
  auto comms = std::make_shared<std::array<MPI_Comm, 3>>();
  std::vector<MPI_Request> reqs(3);
  for (std::size_t c = 0; c < 3; ++c)
    mpi_check(MPI_Comm_idup(MPI_COMM_WORLD, &(*comms)[c], &reqs[c]), "MPI_Comm_idup");
  if (!wait_all_until(reqs, deadline)) {
    keep_forever(comms);
    throw CollectiveTimeout("spawn: process " + std::to_string(place.index) + " waited " +
                            std::to_string(timeout.count() / 1000) +
                            " s for the other processes to call spawn (every process of the "
                            "MPI job must call it, in the same order)");
  }
  MPI_Comm data = (*comms)[0], ctl = (*comms)[1], fin = (*comms)[2];
  for (MPI_Comm c : *comms) MPI_Comm_set_errhandler(c, MPI_ERRORS_RETURN);
  // Every process's replica count and host (a hash of its processor name), in one
  // non-blocking collective: nothing after it can block on a process that gave up.
  char host[MPI_MAX_PROCESSOR_NAME] = {};
  int host_len = 0;
  MPI_Get_processor_name(host, &host_len);
  std::uint32_t host_hash = 2166136261u;
  for (int i = 0; i < host_len; ++i)
    host_hash = (host_hash ^ static_cast<unsigned char>(host[i])) * 16777619u;
  auto counts = std::make_shared<std::vector<int>>(2 * (static_cast<std::size_t>(place.count) + 1));
  (*counts)[0] = replicas;
  (*counts)[1] = static_cast<int>(host_hash & 0x7fffffff);
  std::vector<MPI_Request> gather(1);
  mpi_check(MPI_Iallgather(counts->data(), 2, MPI_INT, counts->data() + 2, 2, MPI_INT, data,
                           &gather[0]),
            "MPI_Iallgather");
  if (!wait_all_until(gather, deadline)) {
    keep_forever(counts);
    throw CollectiveTimeout("spawn: timed out exchanging replica counts between processes");
  }
  auto pw = std::shared_ptr<MpiWorld>(new MpiWorld(replicas, place, data, ctl, fin));
  for (int p = 0; p < place.count; ++p) {
    const int theirs = (*counts)[2 * static_cast<std::size_t>(p) + 2];
    if (theirs != replicas) {
      throw Error("spawn: every process must spawn the same number of replicas; process " +
                  std::to_string(place.index) + " asked for " + std::to_string(replicas) +
                  ", process " + std::to_string(p) + " for " + std::to_string(theirs));
    }
  }
  // Processes on this host: those with the same host hash, numbered by rank.
  pw->place_.host_index = 0;
  pw->place_.host_count = 0;
  std::vector<int> on_host;
  for (int p = 0; p < place.count; ++p) {
    if ((*counts)[2 * static_cast<std::size_t>(p) + 3] != (*counts)[1]) continue;
    ++pw->place_.host_count;
    if (p < place.index) ++pw->place_.host_index;
    on_host.push_back(p);
  }
  if (on_host.size() > 1) {
    const auto& w = mpi.host_window(data, place.index, place.count, on_host);
    if (w.win != MPI_WIN_NULL) pw->window_ = &w;
  }
  return pw;
}

inline std::int64_t MpiWorld::reserve_segment(std::size_t bytes) {
  std::lock_guard lock(mu_);
  if (!segment_of(place_.index) || segment_used_ + bytes > window_->bytes) return -1;
  const auto at = static_cast<std::int64_t>(segment_used_);
  segment_used_ += align64(bytes);
  return at;
}

inline void MpiWorld::sync_segments() {
  if (window_) MPI_Win_sync(window_->win);
}

inline MpiWorld::MpiWorld(int replicas, ProcessPlace place, MPI_Comm data, MPI_Comm ctl, MPI_Comm fin)
    : replicas_(replicas),
      place_(place),
      data_(data),
      ctl_(ctl),
      fin_(fin),
      told_(std::make_unique<std::atomic<std::uint64_t>[]>(static_cast<std::size_t>(place.count) *
                                                           static_cast<std::size_t>(replicas))) {}

inline MpiWorld::~MpiWorld() {
  if (watcher_.joinable()) {
    stop_.store(true);
    watcher_.join();
  }
  // A world kept alive past main (a tensor holding a collective's node) may end after MPI
  // did: nothing is left to free then.
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized) return;
  settle(true);
  // The communicators are not freed: Open MPI gives a freed communicator's context id to the
  // next one created, and a message still on its way to the freed one (an answer to a
  // where-question, a package of an abandoned round) is then delivered to the next world's
  // communicator, where it takes the sequence number of a message of that world, which is
  // then never matched. They stay allocated until MPI_Finalize: three per spawn.
}

inline WorldLayout MpiWorld::layout() const {
  WorldLayout l;
  l.world_size = place_.count * replicas_;
  l.process_offset = place_.index * replicas_;
  l.process_replicas = replicas_;
  l.host_offset = place_.host_index * replicas_;
  l.host_replicas = place_.host_count * replicas_;
  return l;
}

inline void MpiWorld::watch(WorldState& w) {
  world_ = &w;
  watcher_ = std::thread([this] { run_watcher(); });
}

/// Error classes an exit notice carries, so the other processes re-throw the same class.
enum class ErrorClass : std::uint8_t { None, Error, Collective, Mismatch, Timeout, Aborted, Other };

inline std::pair<ErrorClass, std::string> classify(const std::exception_ptr& e) {
  if (!e) return {ErrorClass::None, {}};
  try {
    std::rethrow_exception(e);
  } catch (const CollectiveMismatch& x) {
    return {ErrorClass::Mismatch, x.what()};
  } catch (const CollectiveTimeout& x) {
    return {ErrorClass::Timeout, x.what()};
  } catch (const ReplicaAborted& x) {
    return {ErrorClass::Aborted, x.what()};
  } catch (const CollectiveError& x) {
    return {ErrorClass::Collective, x.what()};
  } catch (const Error& x) {
    return {ErrorClass::Error, x.what()};
  } catch (const std::exception& x) {
    return {ErrorClass::Other, x.what()};
  } catch (...) {
    return {ErrorClass::Other, "unknown exception"};
  }
}

inline std::exception_ptr rebuild(ErrorClass c, const std::string& msg) {
  switch (c) {
    case ErrorClass::Mismatch:
      return std::make_exception_ptr(CollectiveMismatch(msg));
    case ErrorClass::Timeout:
      return std::make_exception_ptr(CollectiveTimeout(msg));
    case ErrorClass::Aborted:
      return std::make_exception_ptr(ReplicaAborted(msg));
    case ErrorClass::Collective:
      return std::make_exception_ptr(CollectiveError(msg));
    default:
      return std::make_exception_ptr(Error(msg));
  }
}

inline void MpiWorld::send_control(std::shared_ptr<std::vector<std::byte>> msg,
                                   const std::vector<int>& to, int tag) {
  Pending p;
  for (int q : to) {
    MPI_Request r = MPI_REQUEST_NULL;
    if (MPI_Isend(msg->data(), static_cast<int>(msg->size()), MPI_BYTE, q, tag, ctl_, &r) ==
        MPI_SUCCESS)
      p.requests.push_back(r);
  }
  p.keep.push_back(std::move(msg));
  std::lock_guard lock(mu_);
  outbox_.push_back(std::move(p));
}

inline void MpiWorld::announce_exit(int ordinal, const std::exception_ptr& e) {
  std::exception_ptr cause = e;
  // A replica stopped because another failed carries that failure, so every process
  // re-throws the root cause rather than the ReplicaAborted it led to.
  if (e && world_) {
    if (auto first = world_->first_error(); first && classify(e).first == ErrorClass::Aborted)
      cause = first;
  }
  auto [cls, what] = classify(cause);
  if (cls == ErrorClass::Error || cls == ErrorClass::Other) {
    if (cause == e)
      what += " (replica " + std::to_string(ordinal) + ", process " + std::to_string(place_.index) + ")";
  }
  auto msg = std::make_shared<std::vector<std::byte>>();
  PackWriter w{*msg};
  w.put(static_cast<std::int32_t>(ordinal));
  w.put(static_cast<std::uint8_t>(cls));
  w.put_bytes(what.data(), what.size());
  w.finish();
  std::vector<int> others;
  for (int q = 0; q < place_.count; ++q)
    if (q != place_.index) others.push_back(q);
  send_control(std::move(msg), others, kExitTag);
  if (cls != ErrorClass::None) {
    std::lock_guard lock(mu_);
    if (closing_.ordinal < 0) {
      closing_.ordinal = ordinal;
      closing_.error_class = static_cast<std::int32_t>(cls);
      std::memcpy(closing_.what, what.data(), std::min(what.size(), sizeof closing_.what - 1));
    }
  }
}

inline void MpiWorld::announce_broken(std::uint64_t group, const std::vector<int>& peers,
                                      const std::string& reason, GiveUp why) {
  auto msg = std::make_shared<std::vector<std::byte>>();
  PackWriter w{*msg};
  w.put(group);
  w.put(static_cast<std::uint8_t>(why));
  w.put_bytes(reason.data(), reason.size());
  w.finish();
  send_control(std::move(msg), peers, kBrokenTag);
}

inline void MpiWorld::apply_broken(const std::vector<char>& msg) {
  PackReader r{reinterpret_cast<const std::byte*>(msg.data()),
               reinterpret_cast<const std::byte*>(msg.data() + msg.size()), -1};
  const auto group = r.get<std::uint64_t>();
  const auto code = r.get<std::uint8_t>();
  const GiveUp why = code <= static_cast<std::uint8_t>(GiveUp::Mismatch) ? static_cast<GiveUp>(code) : GiveUp::Exited;
  const std::string reason(reinterpret_cast<const char*>(r.p), static_cast<std::size_t>(r.end - r.p));
  // Held through the call: forget_group returns only once no call is in progress.
  std::lock_guard calling(calling_mu_);
  BrokenHandler h;
  {
    std::lock_guard lock(mu_);
    if (auto it = groups_.find(group); it != groups_.end()) h = it->second;
  }
  if (h) h(reason, why);
}

inline void MpiWorld::ask_where(const std::vector<std::pair<int, std::uint64_t>>& who) {
  // One question per process holding some of them: (ordinal, count) pairs.
  const int world = place_.count * replicas_;
  for (int q = 0; q < place_.count; ++q) {
    if (q == place_.index) continue;
    auto msg = std::make_shared<std::vector<std::byte>>();
    PackWriter w{*msg};
    bool any = false;
    for (const auto& [ordinal, seq] : who) {
      if (ordinal < 0 || ordinal >= world || ordinal / replicas_ != q) continue;
      w.put(static_cast<std::int32_t>(ordinal));
      w.put(static_cast<std::uint64_t>(seq));
      any = true;
    }
    if (!any) continue;
    w.finish();
    send_control(std::move(msg), {q}, kWhereAskTag);
  }
}

inline std::int64_t MpiWorld::told_where(int ordinal, std::uint64_t world_seq) const {
  if (ordinal < 0 || ordinal >= place_.count * replicas_) return -1;
  return WorldState::group_of_join(told_[static_cast<std::size_t>(ordinal)].load(std::memory_order_acquire),
                                   world_seq);
}

inline void MpiWorld::answer_where(const std::vector<char>& msg, int source) {
  PackReader r{reinterpret_cast<const std::byte*>(msg.data()),
               reinterpret_cast<const std::byte*>(msg.data() + msg.size()), source};
  auto out = std::make_shared<std::vector<std::byte>>();
  PackWriter w{*out};
  bool any = false;
  while (r.end - r.p >= static_cast<std::ptrdiff_t>(sizeof(std::int32_t) + sizeof(std::uint64_t))) {
    const int ordinal = r.get<std::int32_t>();
    const auto seq = r.get<std::uint64_t>();
    if (ordinal < place_.index * replicas_ || ordinal >= (place_.index + 1) * replicas_) continue;
    const std::int64_t g = world_->joined_group(ordinal, seq);
    if (g < 0) continue;  // not joined yet (or too long ago): nothing to tell
    w.put(static_cast<std::int32_t>(ordinal));
    w.put(WorldState::pack_join(seq, static_cast<std::uint32_t>(g)));
    any = true;
  }
  if (!any) return;
  w.finish();
  send_control(std::move(out), {source}, kWhereTellTag);
}

inline void MpiWorld::apply_where(const std::vector<char>& msg) {
  PackReader r{reinterpret_cast<const std::byte*>(msg.data()),
               reinterpret_cast<const std::byte*>(msg.data() + msg.size()), -1};
  while (r.end - r.p >= static_cast<std::ptrdiff_t>(sizeof(std::int32_t) + sizeof(std::uint64_t))) {
    const int ordinal = r.get<std::int32_t>();
    const auto record = r.get<std::uint64_t>();
    if (ordinal < 0 || ordinal >= place_.count * replicas_) continue;
    told_[static_cast<std::size_t>(ordinal)].store(record, std::memory_order_release);
  }
  if (world_) world_->event().notify();
}

inline void MpiWorld::on_group_broken(std::uint64_t group, BrokenHandler h) {
  std::lock_guard lock(mu_);
  groups_[group] = std::move(h);
}

inline void MpiWorld::forget_group(std::uint64_t group) {
  {
    std::lock_guard lock(mu_);
    groups_.erase(group);
  }
  std::lock_guard wait_for_call(calling_mu_);  // a handler still running may use its group
}

inline int MpiWorld::piece_tag() {
  return kPieceTagBase + static_cast<int>(piece_counter_.fetch_add(1) % kPieceTags);
}

inline void MpiWorld::post_package(std::uint64_t group, int source,
                                   std::shared_ptr<std::vector<std::byte>> p) {
  std::lock_guard lock(mu_);
  mailbox_[{group, source}].push_back(std::move(p));
  mail_.fetch_add(1, std::memory_order_release);
}

inline std::shared_ptr<std::vector<std::byte>> MpiWorld::take_package(std::uint64_t group,
                                                                      int source) {
  if (mail_.load(std::memory_order_acquire) == 0) return nullptr;  // the common case: no lock
  std::lock_guard lock(mu_);
  auto it = mailbox_.find({group, source});
  if (it == mailbox_.end() || it->second.empty()) return nullptr;
  auto p = std::move(it->second.front());
  it->second.pop_front();
  mail_.fetch_sub(1, std::memory_order_relaxed);
  return p;
}

inline void MpiWorld::apply_notice(const std::vector<char>& msg, int source) {
  PackReader r{reinterpret_cast<const std::byte*>(msg.data()),
               reinterpret_cast<const std::byte*>(msg.data() + msg.size()), source};
  const int ordinal = r.get<std::int32_t>();
  const auto cls = static_cast<ErrorClass>(r.get<std::uint8_t>());
  const std::string what(reinterpret_cast<const char*>(r.p), static_cast<std::size_t>(r.end - r.p));
  if (ordinal < 0 || ordinal >= place_.count * replicas_) return;
  if (cls != ErrorClass::None) world_->fail(ordinal, rebuild(cls, what));
  world_->mark_exited(ordinal);
}

inline void MpiWorld::run_watcher() {
  std::chrono::steady_clock::time_point stopped{};
  std::vector<char> buf;
  // The closing exchange: every process's record, gathered once its replicas all ended.
  // It, not a count of exit notices, ends the world, so an unread notice cannot hold it:
  // when communicators were freed after each spawn, one notice in a few hundred worlds
  // never arrived (a stale message took its sequence number; see ~MpiWorld), and a watcher
  // that waited for it hung until the collective timeout. The exchange runs on a
  // communicator of its own, one collective per world, from this thread alone.
  auto records = std::make_shared<std::vector<Closing>>(static_cast<std::size_t>(place_.count));
  MPI_Request exchange = MPI_REQUEST_NULL;  // the closing exchange, while it is in flight
  for (;;) {
    for (;;) {
      int flag = 0;
      MPI_Message m;
      MPI_Status st;
      if (MPI_Improbe(MPI_ANY_SOURCE, MPI_ANY_TAG, ctl_, &flag, &m, &st) != MPI_SUCCESS || !flag)
        break;
      int count = 0;
      MPI_Get_count(&st, MPI_BYTE, &count);
      buf.resize(static_cast<std::size_t>(std::max(count, 0)));
      MPI_Mrecv(buf.data(), count, MPI_BYTE, &m, MPI_STATUS_IGNORE);
      try {
        if (st.MPI_TAG == kBrokenTag) {
          apply_broken(buf);
        } else if (st.MPI_TAG == kWhereAskTag) {
          answer_where(buf, st.MPI_SOURCE);
        } else if (st.MPI_TAG == kWhereTellTag) {
          apply_where(buf);
        } else {
          apply_notice(buf, st.MPI_SOURCE);
        }
      } catch (const Error&) {  // malformed: ignore it rather than end the watcher
      }
    }
    settle(false);
    if (stop_.load()) {
      const auto now = std::chrono::steady_clock::now();
      if (stopped == std::chrono::steady_clock::time_point{}) {
        stopped = now;
        {
          std::lock_guard lock(mu_);  // (every local replica has announced its exit)
          (*records)[static_cast<std::size_t>(place_.index)] = closing_;
        }
        constexpr int kBytes = static_cast<int>(sizeof(Closing));
        if (MPI_Iallgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, records->data(), kBytes, MPI_BYTE, fin_,
                           &exchange) != MPI_SUCCESS)
          exchange = MPI_REQUEST_NULL;
      }
      bool sent;
      {
        std::lock_guard lock(mu_);
        sent = outbox_.empty();
      }
      if (exchange != MPI_REQUEST_NULL) {
        int closed = 0;
        if (MPI_Test(&exchange, &closed, MPI_STATUS_IGNORE) != MPI_SUCCESS) {
          keep_forever(records);  // (an error: the records may be half written, MPI may write on)
          exchange = MPI_REQUEST_NULL;
        } else if (closed) {  // (MPI_Test set the request to MPI_REQUEST_NULL)
          apply_closing(*records);
        }
      }
      if (exchange == MPI_REQUEST_NULL && sent) break;
      // A process that died never closes: give up after the collective timeout.
      if (now - stopped > collective_timeout()) {
        if (exchange != MPI_REQUEST_NULL) keep_forever(records);  // MPI may still write into it
        break;
      }
    }
    // A notice is acted on within a millisecond; waking more often only takes the cores the
    // replicas are computing on.
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

inline void MpiWorld::apply_closing(const std::vector<Closing>& all) {
  for (int p = 0; p < place_.count; ++p) {
    if (p == place_.index) continue;
    const Closing& c = all[static_cast<std::size_t>(p)];
    if (c.ordinal >= p * replicas_ && c.ordinal < (p + 1) * replicas_ &&
        c.error_class != static_cast<std::int32_t>(ErrorClass::None)) {
      const std::string what(c.what, std::find(c.what, c.what + sizeof c.what, '\0'));
      world_->fail(c.ordinal, rebuild(static_cast<ErrorClass>(c.error_class), what));
    }
    for (int r = p * replicas_; r < (p + 1) * replicas_; ++r) world_->mark_exited(r);
  }
}

inline void MpiWorld::finish() {
  stop_.store(true);
  if (watcher_.joinable()) watcher_.join();
  settle(true);
}

inline void MpiWorld::abandon(std::vector<MPI_Request> requests,
                              std::vector<std::shared_ptr<void>> keep) {
  std::lock_guard lock(mu_);
  abandoned_.push_back({std::move(requests), std::move(keep)});
}

inline void MpiWorld::settle(bool final_pass) {
  std::lock_guard lock(mu_);
  for (auto* list : {&outbox_, &abandoned_}) {
    for (auto it = list->begin(); it != list->end();) {
      bool flag = test_all_quietly(it->requests);
      if (!flag && final_pass) {
        // A peer that is gone never completes these: cancel, wait a little, and otherwise
        // keep their memory for the rest of the program. (Never throws: this runs in
        // destructors and after failures.)
        for (auto& r : it->requests) {
          if (r != MPI_REQUEST_NULL) MPI_Cancel(&r);
        }
        const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(500);
        while (!(flag = test_all_quietly(it->requests)) && std::chrono::steady_clock::now() < until)
          std::this_thread::sleep_for(std::chrono::microseconds(100));
        if (!flag) {
          for (auto& r : it->requests) {
            if (r != MPI_REQUEST_NULL) MPI_Request_free(&r);
          }
          for (auto& k : it->keep) keep_forever(std::move(k));
          flag = true;
        }
      }
      it = flag ? list->erase(it) : it + 1;
    }
  }
}

inline std::unique_ptr<ProcessLink> MpiWorld::link(const std::vector<int>& members,
                                                   BrokenHandler on_broken) {
  return std::make_unique<MpiLink>(shared_from_this(), members, std::move(on_broken));
}

}  // namespace lazy::dist::detail
#endif  // LAZYTENSOR_WITH_MPI
