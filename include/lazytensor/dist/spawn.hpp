#pragma once
// lazy::dist::spawn: one thread per replica, as xmp.spawn.
//
// Replica i runs fn(i) on a new thread bound to device i (its own pending graph, executor,
// random stream and buffer pool). Each replica device gets max(1, T / nprocs) worker
// threads, T = LAZYTENSOR_NUM_THREADS or the hardware threads, so the replicas together do
// not oversubscribe the machine; devices that existed before spawn get their sizes back
// when it returns (devices it created keep the replica size). When the replica threads
// fill every hardware thread, each replica runs its steps on its own thread instead of
// its device's executor (Device::inline_steps; errors still surface at the next read or
// sync), unless LAZYTENSOR_ASYNC is set.
//
// When fn returns, the replica first runs its pending collectives (a collective traced but
// never synced would otherwise leave its partners waiting), then counts as exited: a
// partner still waiting for it fails at once with a CollectiveError naming it. The first
// exception in any replica aborts the world: every replica blocked in a collective (or
// entering one later) gets ReplicaAborted, and spawn re-throws that first exception once
// every replica thread has finished. A replica busy in its own code notices the abort at
// its next collective, so spawn returns as soon as every replica reached one (or ended).
//
// Under MPI (lazytensor::mpi, `mpirun -np P`), every process calls spawn(fn, n) and they
// form one world of P x n replicas (process_world.hpp): replica i of process p has ordinal
// p * n + i and still runs on local device i. Worker threads are shared out among the
// replicas of the whole host, a failure anywhere aborts every process's replicas, and each
// process's spawn re-throws the first failure it learned of.

#include <algorithm>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include <lazytensor/core/config.hpp>
#include <lazytensor/dist/context.hpp>
#include <lazytensor/graph/device.hpp>

namespace lazy::dist {

namespace detail {

inline std::mutex& spawn_mutex() {
  static std::mutex m;
  return m;
}

/// Worker threads of each replica's device, for `nprocs` replicas on the host.
inline int replica_threads(int nprocs) {
  return std::max(1, graph::default_device_threads() / nprocs);
}

/// Whether n replicas run their steps on their own threads (Device::inline_steps): when
/// their threads alone fill the machine's cores, unless LAZYTENSOR_ASYNC chose a mode.
/// With every core busy, a replica's executor thread could only take turns with the
/// replica's thread on a core, and every step would pay two cross-core wake-ups (measured
/// with 2 replicas on 2 cores: about 10% of the MLP step).
inline bool replica_steps_inline(int n) {
  return n >= static_cast<int>(std::max(1u, std::thread::hardware_concurrency())) &&
         !graph::Device::async_from_env();
}

/// Configures devices [0, n) for n replicas: their worker pools (replica_threads) and
/// step mode (replica_steps_inline). Devices that existed before get their pool sizes
/// back when this is destroyed, devices created for the replicas keep the replica size
/// (restoring them would only start idle workers nobody asked for); every device gets its
/// step mode back.
class ReplicaDevices {
 public:
  /// `n` replica devices here, `host` replicas on the host (every process on it).
  ReplicaDevices(int n, int host);
  ~ReplicaDevices();
  ReplicaDevices(const ReplicaDevices&) = delete;
  ReplicaDevices& operator=(const ReplicaDevices&) = delete;

 private:
  std::vector<int> old_;
  std::vector<std::uint8_t> old_inline_;
};

/// Body of a replica thread.
template <class Body>
void run_replica(const std::shared_ptr<World>& world, int local, Body& body) {
  graph::current_device_index() = local;
  ReplicaContext ctx(world, local);
  current_context() = &ctx;
  std::exception_ptr error;
  try {
    body(local);
    finish_replica();
  } catch (...) {
    error = std::current_exception();
    world->state().fail(ctx.ordinal, error);
  }
  ctx.last.reset();
  current_context() = nullptr;
  world->state().mark_exited(ctx.ordinal);
  if (auto& procs = world->state().processes()) procs->announce_exit(ctx.ordinal, error);
}

struct NoResult {};

}  // namespace detail

/// Runs fn(i) for i in [0, nprocs), each on its own replica thread and device, and returns
/// replica 0's result (nothing when fn returns void). Re-throws the first exception of any
/// replica (see the file comment). Not re-entrant: a second spawn while one runs, or spawn
/// inside a replica, throws lazy::Error.
template <class F>
auto spawn(F&& fn, int nprocs) {
  using R = std::decay_t<std::invoke_result_t<F&, int>>;
  if (nprocs < 1) throw Error("spawn: nprocs must be >= 1, got " + std::to_string(nprocs));
  if (auto* ctx = detail::current_context()) {
    throw Error("spawn: called inside replica " + std::to_string(ctx->ordinal) +
                "; nested spawn is not supported");
  }
  std::unique_lock guard(detail::spawn_mutex(), std::try_to_lock);
  if (!guard.owns_lock()) throw Error("spawn: another spawn is already running in this process");
  // (Under the lock: use_spmd holds it while it turns SPMD mode on.)
  if (graph::step_every_device().load(std::memory_order_acquire)) {
    // (Each replica's mark_step would step every device, from several threads.)
    throw Error(
        "spawn: SPMD mode is on (use_spmd): one program thread drives every device there, "
        "so replicas of their own cannot run");
  }
  detail::spawn_running().store(true, std::memory_order_release);
  struct NotRunning {
    ~NotRunning() { detail::spawn_running().store(false, std::memory_order_release); }
  } not_running;

  auto processes = detail::join_process_world(nprocs);  // null: this process is the world
  detail::WorldLayout layout;
  layout.world_size = layout.process_replicas = layout.host_replicas = nprocs;
  if (processes) layout = processes->layout();
  auto world = std::make_shared<detail::World>(layout);
  world->state().set_processes(processes);
  detail::ReplicaDevices devices(nprocs, layout.host_replicas);
  if (processes) processes->watch(world->state());
  // The watcher reads the world: it stops before the world goes, whatever happens below.
  struct StopWatching {
    detail::ProcessWorld* p;
    ~StopWatching() {
      if (p) p->finish();
    }
  } stop_watching{processes.get()};
  std::conditional_t<std::is_void_v<R>, detail::NoResult, std::optional<R>> result;
  auto body = [&](int i) {
    if constexpr (std::is_void_v<R>) {
      fn(i);
    } else if (i == 0) {
      result.emplace(fn(i));
    } else {
      (void)fn(i);
    }
  };
  std::vector<std::thread> threads;
  try {
    threads.reserve(static_cast<std::size_t>(nprocs));
    for (int i = 0; i < nprocs; ++i)
      threads.emplace_back([&, i] { detail::run_replica(world, i, body); });
  } catch (...) {  // could not start a thread: stop the others
    world->state().fail(-1, std::current_exception());
    // The other processes count this process's replicas: the ones never started exit now.
    if (processes) {
      for (int i = static_cast<int>(threads.size()); i < nprocs; ++i)
        processes->announce_exit(layout.process_offset + i, std::current_exception());
    }
    for (auto& t : threads) t.join();
    throw;
  }
  for (auto& t : threads) t.join();
  if (processes) processes->finish();
  if (auto e = world->state().first_error()) std::rethrow_exception(e);
  if constexpr (!std::is_void_v<R>) return std::move(*result);
}

}  // namespace lazy::dist

#if LAZYTENSOR_HEADER_DEFINITIONS
namespace lazy::dist::detail {
LAZYTENSOR_INLINE ReplicaDevices::ReplicaDevices(int n, int host) {
  const int per = replica_threads(host);
  const bool in_line = replica_steps_inline(host);
  const int existing = graph::DeviceRegistry::get().count();
  for (int i = 0; i < n; ++i) {
    graph::Device& dev = graph::DeviceRegistry::get().device(i);
    ThreadPool& pool = dev.threads();
    if (i < existing) old_.push_back(pool.size());
    if (pool.size() != per) pool.resize(per);
    old_inline_.push_back(dev.inline_steps());
    dev.inline_steps() = in_line;
  }
}

LAZYTENSOR_INLINE ReplicaDevices::~ReplicaDevices() {
  for (std::size_t i = 0; i < old_inline_.size(); ++i) {
    graph::Device& dev = graph::DeviceRegistry::get().device(static_cast<int>(i));
    dev.inline_steps() = old_inline_[i] != 0;
    if (i < old_.size() && dev.threads().size() != old_[i]) dev.threads().resize(old_[i]);
  }
}
}  // namespace lazy::dist::detail
#endif  // LAZYTENSOR_HEADER_DEFINITIONS
