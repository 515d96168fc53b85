#pragma once
// SpinLock: a lock for short critical sections that are almost never contended (a device's
// trace, taken once per traced statement). Taking it is one atomic exchange and giving it
// back a release store, where std::mutex pays a locked instruction each way and a call into
// the C library; a waiter spins briefly, then yields its core (the holder may have been
// preempted, and on a 2-core machine it may be waiting for this very core).

#include <atomic>
#include <thread>

namespace lazy::core {

/// Tells the core this thread is spin-waiting (x86's pause, ARM's yield): the sibling
/// hyperthread gets the pipeline and the wait does not flood the memory order machinery.
/// Elsewhere it gives up the time slice.
inline void cpu_relax() noexcept {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  __asm__ __volatile__("yield");
#else
  std::this_thread::yield();
#endif
}

/// BasicLockable (std::lock_guard, std::unique_lock, std::scoped_lock work with it); not
/// recursive.
class SpinLock {
 public:
  void lock() noexcept {
    while (flag_.exchange(true, std::memory_order_acquire)) wait_until_free();
  }
  bool try_lock() noexcept {
    return !flag_.load(std::memory_order_relaxed) && !flag_.exchange(true, std::memory_order_acquire);
  }
  void unlock() noexcept { flag_.store(false, std::memory_order_release); }

 private:
  // Reads (no writes) until the lock looks free, so waiters do not bounce its cache line.
  void wait_until_free() const noexcept {
    for (int spins = 0; flag_.load(std::memory_order_relaxed);) {
      if (spins < 64) {
        ++spins;
        cpu_relax();
      } else {
        std::this_thread::yield();
      }
    }
  }

  std::atomic<bool> flag_{false};
};

}  // namespace lazy::core
