#pragma once
// The transport of an SPMD program spanning processes (span.hpp) over MPI: use_spmd, under
// `mpirun -np P` with lazytensor::mpi linked, joins the P processes (join_processes, which
// this header installs as span.hpp's process_join_hook) and installs mpi_exchange as its
// exchange. Header code compiled in the programs that link lazytensor::mpi (with or
// without lazytensor::compiled). Without LAZYTENSOR_WITH_MPI this header declares nothing,
// and SPMD stays inside one process.
//
// An exchange sends a header (the exchange's sequence number, size and signature) for each
// payload, checks the headers it receives, then receives the payloads (non-blocking, on one
// duplicate of MPI_COMM_WORLD per channel, tagged by the sequence number), polling until
// all are done or the collective timeout passes. Device executors exchange at the same time, so MPI runs
// with MPI_THREAD_MULTIPLE, as dist's process world does.

#include <lazytensor/dist/process_world.hpp>
#include <lazytensor/spmd/span.hpp>

#if LAZYTENSOR_WITH_MPI
#include <algorithm>
#include <array>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

namespace lazy::spmd::detail {

/// The communicators of the processes' SPMD program, one per channel.
struct MpiSpan {
  std::array<MPI_Comm, 3> comms{MPI_COMM_NULL, MPI_COMM_NULL, MPI_COMM_NULL};
  int tag_limit = 32767;  ///< MPI_TAG_UB
};

inline MpiSpan& mpi_span() {
  static MpiSpan s;
  return s;
}

/// Polls the first `n` of `reqs` until they completed (true) or `deadline` passed (false):
/// yielding for the first 2 ms (the peer's messages of a step come within microseconds;
/// a sleep would add its granularity to every exchange), then sleeping between polls.
inline bool wait_requests(std::vector<MPI_Request>& reqs, std::size_t n, std::chrono::steady_clock::time_point deadline) {
  const auto start = std::chrono::steady_clock::now();
  for (;;) {
    int flag = 0;
    dist::detail::mpi_check(MPI_Testall(static_cast<int>(n), reqs.data(), &flag, MPI_STATUSES_IGNORE), "MPI_Testall");
    if (flag) return true;
    const auto now = std::chrono::steady_clock::now();
    if (now >= deadline) return false;
    if (now - start < std::chrono::milliseconds(2)) std::this_thread::yield();
    else std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

/// span.hpp's exchange over MPI, in two phases: every header, then every payload, so a
/// payload is received only once its header said it has the expected size (a larger one
/// would otherwise fail as a truncated receive, not as the mismatch it is). Messages
/// between two processes on one tag arrive in the order they were sent, so each process
/// posts all its headers before any payload.
inline void mpi_exchange(Channel channel, std::uint64_t seq, std::uint64_t signature, const std::vector<Transfer>& sends,
                         const std::vector<Transfer>& receives, const std::string& what) {
  // (count and index: the sender's transfers to this receiver, and this one's place among
  // them, so that a peer sending more or fewer is caught before any payload is received.)
  struct Header {
    std::uint64_t seq, bytes, signature, count, index;
  };
  const MpiSpan& span = mpi_span();
  const MPI_Comm comm = span.comms[static_cast<std::size_t>(channel)];
  const int tag = static_cast<int>(seq % static_cast<std::uint64_t>(span.tag_limit));
  // Headers live on the heap: an exchange given up leaves MPI holding them.
  auto headers = std::make_shared<std::vector<Header>>(sends.size() + receives.size());
  std::vector<MPI_Request> reqs;
  constexpr std::size_t kPart = std::size_t{1} << 30;  // MPI counts are ints: 1 GiB messages
  auto post = [&](bool send, void* data, std::size_t bytes, int peer) {
    std::size_t at = 0;
    do {
      const int n = static_cast<int>(std::min(kPart, bytes - at));
      void* p = static_cast<std::byte*>(data) + at;
      reqs.emplace_back();
      dist::detail::mpi_check(send ? MPI_Isend(p, n, MPI_BYTE, peer, tag, comm, &reqs.back())
                                   : MPI_Irecv(p, n, MPI_BYTE, peer, tag, comm, &reqs.back()),
                              send ? "MPI_Isend" : "MPI_Irecv");
      at += static_cast<std::size_t>(n);
    } while (at < bytes);
  };
  const auto timeout = dist::collective_timeout();
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  auto timed_out = [&] {
    std::string from;
    for (const auto& t : receives)
      if (from.find("process " + std::to_string(t.process)) == std::string::npos)
        from += (from.empty() ? "process " : ", process ") + std::to_string(t.process);
    return CollectiveTimeout("SPMD " + what + ": waited longer than the collective timeout (" +
                             std::to_string(timeout.count()) + " ms) for " + (from.empty() ? "the other processes" : from) +
                             " (every process must run the same program: read sharded values and step together)");
  };
  try {
    for (std::size_t i = 0; i < receives.size(); ++i)
      post(false, &(*headers)[sends.size() + i], sizeof(Header), receives[i].process);
    auto place_among = [](const std::vector<Transfer>& ts, std::size_t i, std::uint64_t& count, std::uint64_t& index) {
      count = index = 0;
      for (std::size_t k = 0; k < ts.size(); ++k) {
        if (ts[k].process != ts[i].process) continue;
        if (k < i) ++index;
        ++count;
      }
    };
    for (std::size_t i = 0; i < sends.size(); ++i) {
      std::uint64_t count = 0, index = 0;
      place_among(sends, i, count, index);
      (*headers)[i] = {seq, sends[i].bytes, signature, count, index};
      post(true, &(*headers)[i], sizeof(Header), sends[i].process);
    }
    for (const auto& t : sends) post(true, t.data, t.bytes, t.process);
    if (!wait_requests(reqs, receives.size(), deadline)) throw timed_out();
    for (std::size_t i = 0; i < receives.size(); ++i) {
      const Header& h = (*headers)[sends.size() + i];
      std::uint64_t count = 0, index = 0;
      place_among(receives, i, count, index);
      if (h.count != count || h.index != index)
        throw CollectiveMismatch("SPMD " + what + ": process " + std::to_string(receives[i].process) + " sent " +
                                 std::to_string(h.count) + " messages in exchange " + std::to_string(h.seq) +
                                 ", expected " + std::to_string(count) + " in exchange " + std::to_string(seq) +
                                 ": the processes diverged from one program");
      if (h.seq != seq || h.bytes != receives[i].bytes || h.signature != signature)
        throw CollectiveMismatch("SPMD " + what + ": process " + std::to_string(receives[i].process) +
                                 " sent a different collective (" + std::to_string(h.bytes) + " bytes in exchange " +
                                 std::to_string(h.seq) + ", expected " + std::to_string(receives[i].bytes) +
                                 " bytes in exchange " + std::to_string(seq) +
                                 (h.signature != signature ? ", and another op, dtype or sharding" : "") +
                                 "): the processes diverged from one program");
    }
    for (const auto& t : receives) post(false, t.data, t.bytes, t.process);
    if (!wait_requests(reqs, reqs.size(), deadline)) throw timed_out();
  } catch (...) {
    // Requests may still be in flight: their memory stays for the rest of the program.
    dist::detail::keep_forever(headers);
    for (const auto& t : sends) dist::detail::keep_forever(std::const_pointer_cast<void>(t.keep));
    for (const auto& t : receives) dist::detail::keep_forever(std::const_pointer_cast<void>(t.keep));
    throw;
  }
}

/// Joins the processes of the MPI job into one SPMD program, when there are several:
/// collective over MPI_COMM_WORLD (every process calls use_spmd). Error when MPI lacks
/// MPI_THREAD_MULTIPLE or the processes' device counts differ.
inline void join_processes() {
  using dist::detail::mpi_check;
  if (dist::detail::process_place().count == 1) return;
  auto& mpi = dist::detail::Mpi::get();
  const auto place = mpi.place();
  if (!mpi.multiple())
    throw Error("use_spmd: MPI was initialised with thread level " + std::to_string(mpi.provided()) +
                "; an SPMD program spanning processes needs MPI_THREAD_MULTIPLE (initialise MPI with "
                "MPI_Init_thread(..., MPI_THREAD_MULTIPLE, ...) or let lazytensor do it)");
  MpiSpan& span = mpi_span();
  for (auto& c : span.comms) {
    mpi_check(MPI_Comm_dup(MPI_COMM_WORLD, &c), "MPI_Comm_dup");
    MPI_Comm_set_errhandler(c, MPI_ERRORS_RETURN);
  }
  int* ub = nullptr;
  int found = 0;
  MPI_Comm_get_attr(MPI_COMM_WORLD, MPI_TAG_UB, &ub, &found);
  if (found && ub) span.tag_limit = *ub;
  const int local = device_count();
  std::vector<int> counts(static_cast<std::size_t>(place.count));
  mpi_check(MPI_Allgather(&local, 1, MPI_INT, counts.data(), 1, MPI_INT, span.comms[0]), "MPI_Allgather");
  for (int q = 0; q < place.count; ++q)
    if (counts[static_cast<std::size_t>(q)] != local)
      throw Error("use_spmd: process " + std::to_string(q) + " has " + std::to_string(counts[static_cast<std::size_t>(q)]) +
                  " devices and process " + std::to_string(place.index) + " has " + std::to_string(local) +
                  "; an SPMD program spanning processes needs the same LAZYTENSOR_NUM_DEVICES in each");
  MPI_Comm host = MPI_COMM_NULL;
  int host_processes = 1;
  mpi_check(MPI_Comm_split_type(span.comms[0], MPI_COMM_TYPE_SHARED, place.index, MPI_INFO_NULL, &host),
            "MPI_Comm_split_type");
  MPI_Comm_size(host, &host_processes);
  MPI_Comm_free(&host);
  exchange_hook().store(&mpi_exchange, std::memory_order_release);
  set_process_span({place.index, place.count, local, host_processes});
}

/// Installs join_processes as use_spmd's join before main (see process_join_hook).
inline const bool kMpiSpanInstalled =
    (process_join_hook().store(&join_processes, std::memory_order_release), true);

}  // namespace lazy::spmd::detail
#endif  // LAZYTENSOR_WITH_MPI
