#pragma once
// The processes an SPMD program spans (torch_xla's multi-host SPMD; here processes under
// `mpirun`, linked with lazytensor::mpi). Every process runs the same program over one
// global mesh, whose device ids are global: process q owns ids [q * L, (q + 1) * L), L =
// lazy::device_count() (the same in every process). Each process holds an engine device for
// every id: its own at registry indices 0..L-1, so the default device and everything counted
// by device_count() stay local, and the others' as remote devices (graph::Device::remote),
// whose nodes it traces like its own (so every process builds the same graph, and the same
// collectives in the same order) but never computes.
//
// Data crosses processes in two places only, both through exchange(): an all-reduce whose
// group holds devices of several processes, and the gather of a sharded value whose blocks
// some process holds no piece of. Both are collective: every process meets them in program
// order, as it does when it runs the same program.

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <lazytensor/core/config.hpp>
#include <lazytensor/core/error.hpp>
#include <lazytensor/dist/process_world.hpp>
#include <lazytensor/graph/device.hpp>
#include <lazytensor/tensor/device.hpp>

namespace lazy::spmd::detail {

/// This process's place among the processes of the SPMD program.
struct ProcessSpan {
  int index = 0;          ///< this process
  int count = 1;          ///< processes
  int local_devices = 1;  ///< devices per process
  int host_processes = 1; ///< processes on this host (they share its cores)
};

/// The span (one process unless use_spmd joined several).
const ProcessSpan& process_span();

/// Records the span and creates the engine devices of every global id, the other
/// processes' ones marked remote. Called once, by use_spmd, before anything is traced.
void set_process_span(const ProcessSpan& span);

/// Devices of every process: the ids a mesh may name. Known before use_spmd joins the
/// processes (a mesh may be built first, as a strategy's is): the MPI job's process count
/// times lazy::device_count().
int span_device_count();

/// The process owning global device id `id`.
inline int span_process_of(int id) {
  const auto& s = process_span();
  return s.count == 1 ? 0 : id / s.local_devices;
}

/// The engine device of global device id `id` (registry index `id - index * L` modulo the
/// device count: this process's devices first).
graph::Device& span_device(int id);

/// One message of an exchange: `bytes` at `data` to or from process `process`; `keep`
/// holds the memory alive should the exchange be given up with the message in flight.
struct Transfer {
  int process = 0;
  void* data = nullptr;
  std::size_t bytes = 0;
  std::shared_ptr<const void> keep;
};

/// Which collective an exchange serves (each has its own sequence of exchanges).
enum class Channel : int { Reduce = 0, Gather = 1, Host = 2 };

/// Sends and receives the transfers, matched with the other processes' exchange of the same
/// channel and `seq`: the messages between two processes pair up in the order each side lists
/// them. Each carries `signature` (what the exchange is: op, dtype, size); a message whose
/// signature or size differs raises CollectiveMismatch, and a peer that sends nothing within
/// the collective timeout CollectiveTimeout (`what` names the collective in both).
using ExchangeFn = void (*)(Channel channel, std::uint64_t seq, std::uint64_t signature,
                            const std::vector<Transfer>& sends, const std::vector<Transfer>& receives,
                            const std::string& what);

/// The installed transport (lazytensor::mpi's, installed by use_spmd), or null.
inline std::atomic<ExchangeFn>& exchange_hook() {
  static std::atomic<ExchangeFn> hook{nullptr};
  return hook;
}

/// What use_spmd calls to join the processes of the job into one SPMD program (installs
/// exchange_hook's transport and the span): lazytensor::mpi's join (process_link.hpp),
/// installed before main by the programs that link it; null: SPMD stays in this process.
inline std::atomic<void (*)()>& process_join_hook() {
  static std::atomic<void (*)()> hook{nullptr};
  return hook;
}

/// exchange_hook()'s exchange; Error when none is installed.
void exchange(Channel channel, std::uint64_t seq, std::uint64_t signature, const std::vector<Transfer>& sends,
              const std::vector<Transfer>& receives, const std::string& what);

/// Every process's `ok` (one process: just this one's), once all processes reached this
/// call (a barrier of the host, as dist::rendezvous inside spawn), in process order.
std::vector<bool> span_rendezvous(bool ok, const std::string& what);

}  // namespace lazy::spmd::detail

#if LAZYTENSOR_HEADER_DEFINITIONS
namespace lazy::spmd::detail {

inline ProcessSpan& mutable_process_span() {
  static ProcessSpan span;
  return span;
}

LAZYTENSOR_INLINE const ProcessSpan& process_span() { return mutable_process_span(); }

LAZYTENSOR_INLINE void set_process_span(const ProcessSpan& span) {
  if (span.count < 1 || span.index < 0 || span.index >= span.count || span.local_devices < 1)
    throw Error("SPMD: invalid process span (process " + std::to_string(span.index) + " of " +
                std::to_string(span.count) + ", " + std::to_string(span.local_devices) + " devices each)");
  mutable_process_span() = span;
  for (int id = 0; id < span.count * span.local_devices; ++id) {
    graph::Device& dev = span_device(id);
    const int owner = span_process_of(id);
    dev.set_span_place(id, owner, owner != span.index);
    if (owner != span.index) dev.set_num_threads(1);  // traced only: no workers
  }
}

LAZYTENSOR_INLINE int span_device_count() { return dist::detail::process_place().count * device_count(); }

LAZYTENSOR_INLINE graph::Device& span_device(int id) {
  const auto& s = process_span();
  if (s.count == 1) return graph::DeviceRegistry::get().device(id);
  const int total = s.count * s.local_devices;
  return graph::DeviceRegistry::get().device(((id - s.index * s.local_devices) % total + total) % total);
}

LAZYTENSOR_INLINE void exchange(Channel channel, std::uint64_t seq, std::uint64_t signature,
                                const std::vector<Transfer>& sends, const std::vector<Transfer>& receives,
                                const std::string& what) {
  ExchangeFn fn = exchange_hook().load(std::memory_order_acquire);
  if (!fn) throw Error("SPMD " + what + ": the program spans processes but no transport is installed");
  fn(channel, seq, signature, sends, receives, what);
}

LAZYTENSOR_INLINE std::vector<bool> span_rendezvous(bool ok, const std::string& what) {
  const auto& span = process_span();
  std::vector<bool> all(static_cast<std::size_t>(span.count), ok);
  if (span.count == 1) return all;
  static std::atomic<std::uint64_t> seq{0};
  auto flags = std::make_shared<std::vector<unsigned char>>(static_cast<std::size_t>(span.count) + 1, 0);
  (*flags)[0] = ok ? 1 : 0;
  std::vector<Transfer> sends, receives;
  for (int q = 0; q < span.count; ++q) {
    if (q == span.index) continue;
    sends.push_back({q, flags->data(), 1, flags});
    receives.push_back({q, flags->data() + 1 + q, 1, flags});
  }
  exchange(Channel::Host, seq.fetch_add(1, std::memory_order_relaxed), 0x5eed, sends, receives, what);
  for (int q = 0; q < span.count; ++q)
    if (q != span.index) all[static_cast<std::size_t>(q)] = (*flags)[static_cast<std::size_t>(q) + 1] != 0;
  return all;
}

}  // namespace lazy::spmd::detail
#endif  // LAZYTENSOR_HEADER_DEFINITIONS
