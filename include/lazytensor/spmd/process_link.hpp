#pragma once
// The transport of an SPMD program spanning processes (span.hpp) over MPI: use_spmd, under
// `mpirun -np P` with lazytensor::mpi linked, joins the P processes (join_processes) and
// installs mpi_exchange as span.hpp's exchange. Without LAZYTENSOR_WITH_MPI this header
// declares nothing, and SPMD stays inside one process.
//
// An exchange posts every message at once (non-blocking; a header with the exchange's
// sequence number, size and signature before each payload, on one duplicate of
// MPI_COMM_WORLD per channel, tagged by the sequence number), then polls until all are done
// or the collective timeout passes. Device executors exchange at the same time, so MPI runs
// with MPI_THREAD_MULTIPLE, as dist's process world does.

#include <lazytensor/dist/process_world.hpp>
#include <lazytensor/spmd/span.hpp>

#if LAZYTENSOR_WITH_MPI
#include <algorithm>
#include <array>
#include <chrono>
#include <climits>
#include <string>
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

/// span.hpp's exchange over MPI.
inline void mpi_exchange(Channel channel, std::uint64_t seq, std::uint64_t signature, const std::vector<Transfer>& sends,
                         const std::vector<Transfer>& receives, const std::string& what) {
  using dist::detail::mpi_check;
  struct Header {
    std::uint64_t seq, bytes, signature;
  };
  const MpiSpan& span = mpi_span();
  const MPI_Comm comm = span.comms[static_cast<std::size_t>(channel)];
  const int tag = static_cast<int>(seq % static_cast<std::uint64_t>(span.tag_limit));
  // Headers live on the heap: a timed-out exchange leaves MPI holding them.
  auto headers = std::make_shared<std::vector<Header>>(sends.size() + receives.size());
  std::vector<MPI_Request> reqs;
  constexpr std::size_t kPart = std::size_t{1} << 30;  // MPI counts are ints: 1 GiB messages
  auto post = [&](bool send, const Transfer& t, Header* h) {
    auto* op = send ? +[](void* b, int n, int peer, int tg, MPI_Comm c, MPI_Request* r) {
      return MPI_Isend(b, n, MPI_BYTE, peer, tg, c, r);
    }
                    : +[](void* b, int n, int peer, int tg, MPI_Comm c, MPI_Request* r) {
                        return MPI_Irecv(b, n, MPI_BYTE, peer, tg, c, r);
                      };
    reqs.emplace_back();
    mpi_check(op(h, static_cast<int>(sizeof(Header)), t.process, tag, comm, &reqs.back()), send ? "MPI_Isend" : "MPI_Irecv");
    for (std::size_t at = 0; at < t.bytes; at += kPart) {
      reqs.emplace_back();
      mpi_check(op(static_cast<std::byte*>(t.data) + at, static_cast<int>(std::min(kPart, t.bytes - at)), t.process, tag,
                   comm, &reqs.back()),
                send ? "MPI_Isend" : "MPI_Irecv");
    }
  };
  for (std::size_t i = 0; i < receives.size(); ++i) post(false, receives[i], &(*headers)[sends.size() + i]);
  for (std::size_t i = 0; i < sends.size(); ++i) {
    (*headers)[i] = {seq, sends[i].bytes, signature};
    post(true, sends[i], &(*headers)[i]);
  }
  const auto timeout = dist::collective_timeout();
  if (!dist::detail::wait_all_until(reqs, std::chrono::steady_clock::now() + timeout)) {
    auto& keep = dist::detail::leaked_keep();
    keep.push_back(headers);
    for (const auto& t : sends) keep.push_back(std::const_pointer_cast<void>(t.keep));
    for (const auto& t : receives) keep.push_back(std::const_pointer_cast<void>(t.keep));
    std::string from;
    for (const auto& t : receives)
      if (from.find("process " + std::to_string(t.process)) == std::string::npos)
        from += (from.empty() ? "process " : ", process ") + std::to_string(t.process);
    throw CollectiveTimeout("SPMD " + what + ": waited longer than the collective timeout (" +
                            std::to_string(timeout.count()) + " ms) for " + (from.empty() ? "the other processes" : from) +
                            " (every process must run the same program: read sharded values and step together)");
  }
  for (std::size_t i = 0; i < receives.size(); ++i) {
    const Header& h = (*headers)[sends.size() + i];
    if (h.seq != seq || h.bytes != receives[i].bytes || h.signature != signature)
      throw CollectiveMismatch("SPMD " + what + ": process " + std::to_string(receives[i].process) +
                               " sent a different collective (" + std::to_string(h.bytes) + " bytes, exchange " +
                               std::to_string(h.seq) + ", expected " + std::to_string(receives[i].bytes) +
                               " bytes, exchange " + std::to_string(seq) +
                               (h.signature != signature ? ", another op, dtype or sharding" : "") +
                               "): the processes diverged from one program");
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

}  // namespace lazy::spmd::detail
#endif  // LAZYTENSOR_WITH_MPI
