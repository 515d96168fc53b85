#pragma once
// Per-thread caches of the small blocks every statement allocates and frees: its node, its
// tensor object, its element-wise kernel, a small output buffer. glibc's malloc and free
// cost ~150 instructions a pair even on its per-thread path; a block taken from or given
// back to this cache is a few loads and stores. Blocks are plain ::operator new memory of a
// whole size class, so a block freed on another thread (an executor dropping a node it ran)
// simply joins that thread's cache. Each cache keeps a bounded number of blocks per class
// and frees the rest; a thread's cache is freed when the thread exits. Under a memory
// checker (AddressSanitizer, HWASan, MemorySanitizer) or with LAZYTENSOR_NO_BLOCK_CACHE
// defined nothing is kept, so that a use after free is still reported.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <new>
#include <utility>

#include <lazytensor/core/config.hpp>

namespace lazy::core {

namespace detail {

/// Blocks come in classes of 64 bytes, up to 1 KiB; larger ones go to ::operator new as is.
inline constexpr std::size_t kBlockClassBytes = 64;
inline constexpr std::size_t kBlockClasses = 16;
/// Most blocks a thread keeps per class (272 KiB per thread if every class were full; a
/// statement loop keeps a handful).
inline constexpr std::uint32_t kBlocksPerClass = 32;

// LAZYTENSOR_DETAIL_ASAN: AddressSanitizer is on (GCC says so by a macro, clang by
// __has_feature, which GCC 12 lacks: hence the nesting).
#if defined(__SANITIZE_ADDRESS__)
#define LAZYTENSOR_DETAIL_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define LAZYTENSOR_DETAIL_ASAN 1
#endif
#endif

#if defined(LAZYTENSOR_NO_BLOCK_CACHE) || defined(LAZYTENSOR_DETAIL_ASAN) || defined(__SANITIZE_HWADDRESS__)
inline constexpr bool kBlockCacheOn = false;
#elif defined(__has_feature)
#if __has_feature(hwaddress_sanitizer) || __has_feature(memory_sanitizer)
inline constexpr bool kBlockCacheOn = false;
#else
inline constexpr bool kBlockCacheOn = true;
#endif
#else
inline constexpr bool kBlockCacheOn = true;
#endif

/// The size class of a block of `bytes` (0 for 0..64), kBlockClasses when not cached.
constexpr std::size_t block_class(std::size_t bytes) noexcept {
  if (bytes > kBlockClasses * kBlockClassBytes) return kBlockClasses;
  return bytes == 0 ? 0 : (bytes - 1) / kBlockClassBytes;
}

/// How many blocks of class `c` this thread's cache holds (for tests).
std::uint32_t cached_blocks(std::size_t c) noexcept;

}  // namespace detail

/// A block of at least `bytes` bytes (aligned as ::operator new aligns), from this thread's
/// cache when it holds one of that class. std::bad_alloc as ::operator new.
void* allocate_block(std::size_t bytes);

/// Gives back a block from allocate_block(`bytes`), on any thread (null: nothing).
void free_block(void* p, std::size_t bytes) noexcept;

/// An allocator over allocate_block, for std::allocate_shared of the objects a statement
/// creates (the control block and the object share one cached block).
template <class T>
struct BlockAllocator {
  using value_type = T;

  BlockAllocator() = default;
  template <class U>
  BlockAllocator(const BlockAllocator<U>&) noexcept {}  // NOLINT: rebinding, as std::allocator

  T* allocate(std::size_t n) {
    static_assert(alignof(T) <= __STDCPP_DEFAULT_NEW_ALIGNMENT__, "blocks are aligned as ::operator new aligns");
    if (n > static_cast<std::size_t>(-1) / sizeof(T)) throw std::bad_array_new_length();
    return static_cast<T*>(allocate_block(n * sizeof(T)));
  }
  void deallocate(T* p, std::size_t n) noexcept { free_block(p, n * sizeof(T)); }

  template <class U>
  bool operator==(const BlockAllocator<U>&) const noexcept {
    return true;
  }
};

/// std::make_shared from this thread's block cache: the object and its control block in
/// one cached block.
template <class T, class... Args>
std::shared_ptr<T> make_cached(Args&&... args) {
  return std::allocate_shared<T>(BlockAllocator<T>{}, std::forward<Args>(args)...);
}

}  // namespace lazy::core

#if LAZYTENSOR_HEADER_DEFINITIONS
namespace lazy::core::detail {

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

  /// Frees every cached block.
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

LAZYTENSOR_INLINE ThreadBlockLists& this_thread_blocks() noexcept {
  thread_local ThreadBlockLists lists;
  return lists;
}

/// Flushes this thread's lists when the thread exits; registered with the first kept
/// block (registering a thread_local's destructor does not throw: the C++ runtime's
/// __cxa_thread_atexit is noexcept). A block first kept on the main thread after its
/// thread_locals were destroyed (during static destruction) stays until the process ends.
struct ThreadBlockFlush {
  ~ThreadBlockFlush() {
    ThreadBlockLists& l = this_thread_blocks();
    l.flush();
    l.closed = true;
  }
};

LAZYTENSOR_INLINE void register_block_flush() noexcept {
  thread_local ThreadBlockFlush flush;
  (void)flush;
}

/// Keeps block `p` of class `c` in this thread's lists; false when the class is full or the
/// thread is exiting (the caller then frees it).
LAZYTENSOR_INLINE bool keep_block(void* p, std::size_t c) noexcept {
  ThreadBlockLists& l = this_thread_blocks();
  if (l.closed || l.count[c] >= kBlocksPerClass) return false;
  if (!l.flush_registered) {
    l.flush_registered = true;
    register_block_flush();
  }
  auto* b = static_cast<ThreadBlockLists::FreeBlock*>(p);
  b->next = l.head[c];
  l.head[c] = b;
  ++l.count[c];
  return true;
}

LAZYTENSOR_INLINE std::uint32_t cached_blocks(std::size_t c) noexcept {
  return c < kBlockClasses ? this_thread_blocks().count[c] : 0;
}

}  // namespace lazy::core::detail

namespace lazy::core {

// A cached class's block always has the class's whole size, cache on or off: a block
// allocated where the cache is off (a sanitized translation unit) may be freed where it is
// on (the compiled runtime, built without) and be handed out again as a whole class.
LAZYTENSOR_INLINE void* allocate_block(std::size_t bytes) {
  const std::size_t c = detail::block_class(bytes);
  if (c == detail::kBlockClasses) return ::operator new(bytes);
  if constexpr (detail::kBlockCacheOn)
    if (void* p = detail::this_thread_blocks().take(c)) return p;
  return ::operator new((c + 1) * detail::kBlockClassBytes);
}

LAZYTENSOR_INLINE void free_block(void* p, std::size_t bytes) noexcept {
  if (!p) return;
  const std::size_t c = detail::block_class(bytes);
  if constexpr (detail::kBlockCacheOn)
    if (c < detail::kBlockClasses && detail::keep_block(p, c)) return;
  ::operator delete(p);
}

}  // namespace lazy::core
#endif  // LAZYTENSOR_HEADER_DEFINITIONS
