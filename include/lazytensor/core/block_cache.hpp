#pragma once
// Per-thread caches of the small blocks every statement allocates and frees: its node, its
// tensor object, a small output buffer. A statement read at once (`sum(x).item()`) made
// four trips through the C library's allocator, ~150 instructions each even on glibc's
// per-thread cache path; a block taken from or given back to this cache is a few loads and
// stores. Blocks are plain ::operator new memory rounded up to a size class, so a block
// freed on another thread (an executor dropping a node it ran) simply joins that thread's
// cache. Each cache holds a bounded number of blocks per class and returns the rest; a
// thread's cache is returned when the thread exits. Under AddressSanitizer the cache is off,
// so that a use after free is still reported.

#include <cstddef>
#include <cstdint>
#include <new>

#include <lazytensor/core/config.hpp>

namespace lazy::core {

namespace detail {

/// Blocks are cached in classes of 64 bytes, up to 1 KiB; larger ones go to ::operator new.
inline constexpr std::size_t kBlockClassBytes = 64;
inline constexpr std::size_t kBlockClasses = 16;
/// Most blocks a thread keeps per class (272 KiB per thread if every class were full; a
/// statement loop keeps a handful).
inline constexpr std::uint32_t kBlocksPerClass = 32;

#if defined(__SANITIZE_ADDRESS__)
inline constexpr bool kBlockCacheOn = false;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
inline constexpr bool kBlockCacheOn = false;
#else
inline constexpr bool kBlockCacheOn = true;
#endif
#else
inline constexpr bool kBlockCacheOn = true;
#endif

/// The size class of a block of `bytes` (0 for 1..64), kBlockClasses when not cached.
constexpr std::size_t block_class(std::size_t bytes) noexcept {
  const std::size_t c = (bytes + kBlockClassBytes - 1) / kBlockClassBytes;
  return c == 0 ? 0 : (c <= kBlockClasses ? c - 1 : kBlockClasses);
}

/// One thread's free lists. Trivially constructible and destructible, so that the
/// thread_local holding it is zero-initialized and needs no guard, and stays readable
/// while other thread_locals' destructors run at thread exit (they may free nodes).
struct ThreadBlockLists {
  struct FreeBlock {
    FreeBlock* next;
  };
  FreeBlock* head[kBlockClasses];
  std::uint32_t count[kBlockClasses];
  bool flush_registered;  ///< the exit flush below is registered for this thread
  bool closed;            ///< the exit flush ran: nothing is kept any more

  /// A cached block of class `c`, or null.
  void* take(std::size_t c) noexcept {
    FreeBlock* b = head[c];
    if (!b) return nullptr;
    head[c] = b->next;
    --count[c];
    return b;
  }

  /// Returns every cached block to ::operator delete.
  void flush() noexcept {
    for (std::size_t c = 0; c < kBlockClasses; ++c) {
      while (FreeBlock* b = head[c]) {
        head[c] = b->next;
        ::operator delete(static_cast<void*>(b));
      }
      count[c] = 0;
    }
  }
};

inline ThreadBlockLists& this_thread_blocks() noexcept {
  thread_local ThreadBlockLists lists;
  return lists;
}

/// Flushes this thread's lists when the thread exits (registered on the first kept block).
struct ThreadBlockFlush {
  ~ThreadBlockFlush() {
    ThreadBlockLists& l = this_thread_blocks();
    l.flush();
    l.closed = true;
  }
};

inline void register_block_flush() {
  thread_local ThreadBlockFlush flush;
  (void)flush;
}

/// Keeps block `p` of class `c` in this thread's lists; false when the class is full or the
/// thread is exiting (the caller then frees it).
inline bool keep_block(void* p, std::size_t c) noexcept {
  ThreadBlockLists& l = this_thread_blocks();
  if (l.closed || l.count[c] >= kBlocksPerClass) return false;
  if (!l.flush_registered) {
    l.flush_registered = true;
    try {
      register_block_flush();
    } catch (...) {  // the registration could not allocate: keep nothing on this thread
      l.closed = true;
      return false;
    }
  }
  auto* b = static_cast<ThreadBlockLists::FreeBlock*>(p);
  b->next = l.head[c];
  l.head[c] = b;
  ++l.count[c];
  return true;
}

}  // namespace detail

/// A block of at least `bytes` bytes (aligned as ::operator new aligns), from this thread's
/// cache when it holds one of that class. std::bad_alloc as ::operator new.
inline void* allocate_block(std::size_t bytes) {
  const std::size_t c = detail::block_class(bytes);
  if (c == detail::kBlockClasses || !detail::kBlockCacheOn) return ::operator new(bytes);
  if (void* p = detail::this_thread_blocks().take(c)) return p;
  return ::operator new((c + 1) * detail::kBlockClassBytes);
}

/// Gives back a block from allocate_block(`bytes`), on any thread.
inline void free_block(void* p, std::size_t bytes) noexcept {
  const std::size_t c = detail::block_class(bytes);
  if (c == detail::kBlockClasses || !detail::kBlockCacheOn) {
    ::operator delete(p);
    return;
  }
  if (!detail::keep_block(p, c)) ::operator delete(p);
}

/// An allocator over allocate_block, for std::allocate_shared of the objects a statement
/// creates (the control block and the object share one cached block).
template <class T>
struct BlockAllocator {
  using value_type = T;
  static_assert(alignof(T) <= __STDCPP_DEFAULT_NEW_ALIGNMENT__, "blocks are aligned as ::operator new aligns");

  BlockAllocator() = default;
  template <class U>
  BlockAllocator(const BlockAllocator<U>&) noexcept {}  // NOLINT: rebinding, as std::allocator

  T* allocate(std::size_t n) { return static_cast<T*>(allocate_block(n * sizeof(T))); }
  void deallocate(T* p, std::size_t n) noexcept { free_block(p, n * sizeof(T)); }

  template <class U>
  bool operator==(const BlockAllocator<U>&) const noexcept {
    return true;
  }
};

}  // namespace lazy::core
