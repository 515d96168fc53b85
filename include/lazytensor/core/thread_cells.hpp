#pragma once
// Per-thread cells for the counters and metrics (core/counters.hpp). Every step and every
// read of a small statement records a few counts and timings; a shared atomic add is a
// locked instruction (~20 cycles, and a full barrier on x86) on each, which made the
// metrics alone ~10% of a small statement's time. A cell is written only by its own
// thread, with a relaxed load and store (plain moves); readers, which are rare (a metrics
// report, a test), sum the cells of every live thread under a mutex, and a thread that
// exits folds its cells into their owners first.

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <new>
#include <vector>

#include <lazytensor/core/config.hpp>

namespace lazy::core::detail {

/// One thread's cells, in chunks allocated as the slots in use grow. Only the owning
/// thread writes; other threads read under ThreadCellHub's mutex.
class ThreadCells {
 public:
  static constexpr std::size_t kChunkCells = 256, kMaxChunks = 64;
  static constexpr std::size_t kMaxCells = kChunkCells * kMaxChunks;

  ThreadCells() = default;
  ThreadCells(const ThreadCells&) = delete;
  ThreadCells& operator=(const ThreadCells&) = delete;
  ~ThreadCells() {
    for (auto& c : chunks_) delete[] c.load(std::memory_order_relaxed);
  }

  /// The owner's cell `slot` (allocating its chunk on first use), or null when that
  /// allocation fails: recording runs in destructors (ScopedTimer), so it must not throw;
  /// the caller then records into the owner's shared state.
  std::atomic<std::int64_t>* cell(std::size_t slot) {
    auto* chunk = chunks_[slot / kChunkCells].load(std::memory_order_relaxed);
    if (!chunk) [[unlikely]] {
      chunk = new (std::nothrow) std::atomic<std::int64_t>[kChunkCells]();
      if (!chunk) return nullptr;
      chunks_[slot / kChunkCells].store(chunk, std::memory_order_release);
    }
    return &chunk[slot % kChunkCells];
  }
  /// A reader's view of cell `slot`: null when the thread never wrote that chunk.
  const std::atomic<std::int64_t>* peek(std::size_t slot) const {
    auto* chunk = chunks_[slot / kChunkCells].load(std::memory_order_acquire);
    return chunk ? &chunk[slot % kChunkCells] : nullptr;
  }

 private:
  std::atomic<std::atomic<std::int64_t>*> chunks_[kMaxChunks]{};
};

/// What owns a run of cells (a Counter, a Metric): told to fold a thread's cells into its
/// shared state when that thread exits.
class CellOwner {
 public:
  virtual void fold(const ThreadCells& cells) = 0;

 protected:
  ~CellOwner() = default;
};

/// Hands out slots, tracks the live threads' cells and the slots' owners. Never destroyed:
/// threads may record while static objects are destroyed at exit.
class ThreadCellHub {
 public:
  static constexpr std::size_t kNoSlot = static_cast<std::size_t>(-1);

  static ThreadCellHub& get();

  /// `n` consecutive slots for `owner`, or kNoSlot when all are taken (the owner then
  /// records into its shared state under mutex()). Slots are not reused: a new owner
  /// must find its cells zero in every thread.
  std::size_t reserve(std::size_t n, CellOwner* owner);
  /// The owner at `slot` is going away: exiting threads stop folding into it.
  void release(std::size_t slot);

  /// This thread's cells; null once the thread has exited (its thread-locals destroyed) or
  /// when they cannot be allocated. (tls_cells is an inline variable: one per program as
  /// long as the compiled runtime is linked statically or exports it.)
  static ThreadCells* mine() {
    ThreadCells* c = tls_cells;
    if (!c) [[unlikely]] c = attach();
    return c;
  }

  /// This thread's cell `slot`, or null when the owner records into its shared state
  /// instead (no slot, no cells for this thread).
  static std::atomic<std::int64_t>* my_cell(std::size_t slot) {
    ThreadCells* t = slot == kNoSlot ? nullptr : mine();
    return t ? t->cell(slot) : nullptr;
  }

  /// Calls f(const ThreadCells&) for every live thread; with mutex() held by the caller.
  template <class F>
  void for_each_thread(F&& f) const {
    for (const ThreadCells* t : threads_) f(*t);
  }
  std::mutex& mutex() { return mu_; }

 private:
  struct Exit {
    ~Exit();
  };
  static ThreadCells* attach();

  static inline thread_local ThreadCells* tls_cells = nullptr;
  static inline thread_local bool tls_exited = false;

  std::mutex mu_;
  std::vector<ThreadCells*> threads_;
  std::vector<CellOwner*> owners_;  // by slot: an owner's first slot, null elsewhere
  std::size_t next_ = 0;
};

}  // namespace lazy::core::detail

#if LAZYTENSOR_HEADER_DEFINITIONS
namespace lazy::core::detail {

LAZYTENSOR_INLINE ThreadCellHub& ThreadCellHub::get() {
  static ThreadCellHub* hub = new ThreadCellHub;
  return *hub;
}

LAZYTENSOR_INLINE std::size_t ThreadCellHub::reserve(std::size_t n, CellOwner* owner) {
  std::lock_guard lock(mu_);
  // An owner's cells stay in one chunk: it finds them all from one chunk pointer.
  if (n > ThreadCells::kChunkCells) return kNoSlot;
  if (next_ % ThreadCells::kChunkCells + n > ThreadCells::kChunkCells)
    next_ += ThreadCells::kChunkCells - next_ % ThreadCells::kChunkCells;
  if (next_ + n > ThreadCells::kMaxCells) return kNoSlot;
  const std::size_t slot = next_;
  next_ += n;
  owners_.resize(next_, nullptr);
  owners_[slot] = owner;
  return slot;
}

LAZYTENSOR_INLINE void ThreadCellHub::release(std::size_t slot) {
  if (slot == kNoSlot) return;
  std::lock_guard lock(mu_);
  owners_[slot] = nullptr;
}

LAZYTENSOR_INLINE ThreadCells* ThreadCellHub::attach() {
  if (tls_exited) return nullptr;
  static thread_local Exit on_exit;  // constructed here, destroyed when the thread exits
  (void)on_exit;
  auto* cells = new (std::nothrow) ThreadCells;
  if (!cells) return nullptr;  // (recording must not throw; the next record tries again)
  ThreadCellHub& hub = get();
  try {
    std::lock_guard lock(hub.mu_);
    hub.threads_.push_back(cells);
  } catch (...) {
    delete cells;
    return nullptr;
  }
  tls_cells = cells;
  return cells;
}

LAZYTENSOR_INLINE ThreadCellHub::Exit::~Exit() {
  ThreadCells* cells = tls_cells;
  tls_cells = nullptr;
  tls_exited = true;
  if (!cells) return;
  ThreadCellHub& hub = get();
  {
    std::lock_guard lock(hub.mu_);
    std::erase(hub.threads_, cells);
    for (CellOwner* o : hub.owners_)
      if (o) o->fold(*cells);
  }
  delete cells;
}

}  // namespace lazy::core::detail
#endif  // LAZYTENSOR_HEADER_DEFINITIONS
