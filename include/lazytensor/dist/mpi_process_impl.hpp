#pragma once
// Definitions of mpi_world.hpp's Mpi, included by mpi_world_impl.hpp before MpiWorld's:
// MPI's lifetime in this process and whether a launcher started it, the host's shared
// window, mpi_check (also used by mpi_link_impl.hpp) and the request helpers of the
// process world.

#include <lazytensor/core/error.hpp>

#if LAZYTENSOR_WITH_MPI
#include <sys/statvfs.h>
#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace lazy::dist::detail {

inline void mpi_check(int rc, const char* what) {
  if (rc == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, text, &len);
  throw CollectiveError(std::string(what) + " failed: " + std::string(text, len));
}

inline Mpi::Mpi() {
  int ready = 0;
  MPI_Initialized(&ready);
  if (!ready) {
    mpi_check(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided_),
              "MPI_Init_thread");
    owned_ = true;
  } else {
    MPI_Query_thread(&provided_);
  }
  MPI_Comm_rank(MPI_COMM_WORLD, &place_.index);
  MPI_Comm_size(MPI_COMM_WORLD, &place_.count);
}

inline Mpi::~Mpi() {
  int done = 0;
  MPI_Finalized(&done);
  if (done) return;
  if (window_.win != MPI_WIN_NULL) {  // collective over the host's processes, all exiting
    MPI_Win_unlock_all(window_.win);
    MPI_Win_free(&window_.win);
    MPI_Comm_free(&window_.comm);
  }
  if (owned_) MPI_Finalize();
}

inline const Mpi::HostWindow& Mpi::host_window(MPI_Comm data, int index, int count,
                                               const std::vector<int>& host_processes) {
  if (window_tried_) return window_;
  window_tried_ = true;
  mpi_check(MPI_Comm_split_type(data, MPI_COMM_TYPE_SHARED, index, MPI_INFO_NULL, &window_.comm),
            "MPI_Comm_split_type");
  // LAZYTENSOR_MPI_SHM_BYTES per process (default 256 MiB of address space; pages are
  // backed as they are used), at most a quarter of /dev/shm's free space shared out among
  // the host's processes; 0 turns the window off.
  std::size_t want = std::size_t{256} << 20;
  if (const char* env = std::getenv("LAZYTENSOR_MPI_SHM_BYTES")) want = std::strtoull(env, nullptr, 10);
  struct statvfs fs {};
  if (::statvfs("/dev/shm", &fs) == 0) {
    const auto free_bytes = static_cast<std::size_t>(fs.f_bavail) * fs.f_frsize;
    want = std::min(want, free_bytes / 4 / host_processes.size());
  }
  want = want < (std::size_t{1} << 20) ? 0 : want / 4096 * 4096;
  MPI_Info info;
  MPI_Info_create(&info);
  MPI_Info_set(info, "alloc_shared_noncontig", "true");
  void* base = nullptr;
  const int rc =
      MPI_Win_allocate_shared(static_cast<MPI_Aint>(want), 1, info, window_.comm, &base, &window_.win);
  MPI_Info_free(&info);
  if (rc != MPI_SUCCESS) {
    window_.win = MPI_WIN_NULL;
    return window_;
  }
  MPI_Win_lock_all(MPI_MODE_NOCHECK, window_.win);
  window_.segments.assign(static_cast<std::size_t>(count), nullptr);
  window_.on_host.assign(static_cast<std::size_t>(count), 0);
  for (std::size_t k = 0; k < host_processes.size(); ++k) {  // host ranks follow world ranks
    MPI_Aint size = 0;
    int unit = 0;
    void* b = nullptr;
    MPI_Win_shared_query(window_.win, static_cast<int>(k), &size, &unit, &b);
    const auto p = static_cast<std::size_t>(host_processes[k]);
    window_.on_host[p] = 1;
    if (size > 0) window_.segments[p] = static_cast<std::byte*>(b);
  }
  window_.bytes = want;
  return window_;
}

inline Mpi& Mpi::get() {
  static Mpi mpi;
  return mpi;
}

/// Whether this process was started by an MPI launcher (mpirun/mpiexec, srun) or the program
/// initialised MPI itself. A program linking lazytensor::mpi but started on its own then
/// stays a process of one and never initialises MPI (no singleton MPI job is started).
inline bool mpi_launched() {
  int ready = 0;
  MPI_Initialized(&ready);
  if (ready) return true;
  for (const char* v : {"OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK", "PMI_SIZE",
                        "MPI_LOCALNRANKS", "MV2_COMM_WORLD_SIZE"}) {
    if (std::getenv(v)) return true;
  }
  return false;
}

inline ProcessPlace MpiTransport::place() {
  static const bool launched = mpi_launched();
  return launched ? Mpi::get().place() : ProcessPlace{};
}

/// Keeps the memory of requests that could not be settled (a peer died) for the rest of the
/// program, since MPI may still write into it or read from it. (Called from the watchers and
/// from spawning threads of any world alive.)
inline void keep_forever(std::shared_ptr<void> memory) {
  static auto* mu = new std::mutex();
  static auto* kept = new std::vector<std::shared_ptr<void>>();
  std::lock_guard lock(*mu);
  kept->push_back(std::move(memory));
}

/// Tests `reqs` without throwing: true when all completed (or MPI reports an error for
/// them: a dead peer's requests are not waited for).
inline bool test_all_quietly(std::vector<MPI_Request>& reqs) {
  int flag = 0;
  const int rc =
      MPI_Testall(static_cast<int>(reqs.size()), reqs.data(), &flag, MPI_STATUSES_IGNORE);
  return rc != MPI_SUCCESS || flag;
}

/// Waits for `reqs` until `deadline`; false on timeout (the requests stay pending).
inline bool wait_all_until(std::vector<MPI_Request>& reqs,
                           std::chrono::steady_clock::time_point deadline) {
  for (int i = 0;; ++i) {
    int flag = 0;
    mpi_check(MPI_Testall(static_cast<int>(reqs.size()), reqs.data(), &flag, MPI_STATUSES_IGNORE),
              "MPI_Testall");
    if (flag) return true;
    if (std::chrono::steady_clock::now() >= deadline) return false;
    if (i > 1000) std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
}

}  // namespace lazy::dist::detail
#endif  // LAZYTENSOR_WITH_MPI
