#pragma once
// Device memory: 64-byte aligned buffers padded to whole SIMD batches, recycled by a
// per-device pool so that a steady training loop stops touching the allocator.
//
// Large buffers (2 MiB and up) start on a 2 MiB boundary and ask Linux for transparent huge
// pages. Why: a kernel streaming 2^24 floats from DRAM walks 16k 4-KiB pages per array, and
// the TLB misses (doubly expensive under a hypervisor) cost 25-40% of the bandwidth on the
// development machine (20 -> 26-29 GB/s for sum((a - b)^2)). Most distributions leave THP in
// "madvise" mode, so without the hint the kernel never uses them. LAZYTENSOR_HUGE_PAGES=0
// turns the hint off.

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <memory>
#include <mutex>
#include <new>
#include <unordered_map>
#include <utility>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#endif
#if defined(__unix__) || defined(__APPLE__)
#include <unistd.h>
#endif

#include <lazytensor/core/block_cache.hpp>
#if defined(LAZYTENSOR_DETAIL_ASAN) && LAZYTENSOR_HEADER_DEFINITIONS
#include <sanitizer/asan_interface.h>
#endif

#include <lazytensor/core/counters.hpp>
#include <lazytensor/core/error.hpp>
#include <lazytensor/core/env.hpp>
#include <lazytensor/core/config.hpp>

namespace lazy {

/// Alignment of every buffer (one cache line, one AVX-512 register).
inline constexpr std::size_t kBufferAlign = 64;
/// Element counts are padded to a multiple of this, so a kernel's SIMD main loop reads and
/// writes whole batches (16 floats = one AVX-512 register) without a scalar tail.
inline constexpr std::int64_t kPadElements = 16;

/// Bytes a buffer of `numel` elements of `elem_size` bytes occupies after padding: rounded up
/// to whole batches, plus one more batch, so that a full SIMD batch loaded at any element
/// of the tensor stays inside the allocation (a kernel's tail reads a whole batch and
/// stores only the lanes it owns).
constexpr std::size_t padded_bytes(std::int64_t numel, std::size_t elem_size) {
  const std::int64_t n = ((numel < 1 ? 1 : numel) + kPadElements - 1) / kPadElements * kPadElements + kPadElements;
  const std::size_t bytes = static_cast<std::size_t>(n) * elem_size;
  return (bytes + kBufferAlign - 1) / kBufferAlign * kBufferAlign;
}

/// Buffers of at least this many bytes are aligned to it and advised to use huge pages.
inline constexpr std::size_t kHugePageBytes = std::size_t{2} << 20;

namespace detail {

inline std::size_t buffer_alignment(std::size_t bytes) {
  return bytes >= kHugePageBytes ? kHugePageBytes : kBufferAlign;
}

bool huge_pages_wanted();

/// Memory for a buffer of `bytes` bytes (see the file comment for large ones). Throws
/// OutOfMemoryError naming the size when it cannot be had (never std::bad_alloc).
void* allocate_buffer_memory(std::size_t bytes);

/// The machine's physical memory in bytes (0 when unknown).
std::uint64_t physical_memory_bytes();

/// Throws OutOfMemoryError naming `what` and the size when `bytes` exceeds the machine's
/// physical memory: a request that can never be met fails at once, before a reader spends
/// time on data it could not hold (a sparse file's apparent size, a header's claim).
void check_fits_in_memory(std::uint64_t bytes, const std::string& what);

/// A size for a message: "512 bytes", "1.5 GiB (1610612736 bytes)".
std::string byte_size_text(std::uint64_t bytes);

inline void free_buffer_memory(void* p, std::size_t bytes) {
  ::operator delete(p, std::align_val_t(buffer_alignment(bytes)));
}

}  // namespace detail

class BufferPool;

/// A block of aligned memory. Returned to its pool when the last reference goes.
class Buffer {
 public:
  /// Tag of a buffer whose memory lives in the same allocation as the Buffer itself
  /// (detail::small_buffer): the destructor leaves it alone.
  struct InlineMemory {};

  Buffer(void* p, std::size_t bytes, std::shared_ptr<BufferPool> pool);
  Buffer(void* p, std::size_t bytes, InlineMemory) noexcept : data_(p), bytes_(bytes), owns_memory_(false) {}
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  ~Buffer();

  void* data() const { return data_; }
  std::size_t bytes() const { return bytes_; }

  /// Marks a buffer handed to other devices' executors (a collective's shared output, a
  /// broadcast source). Such a buffer is never donated: its readers on other devices are
  /// not ordered with a donating write (a reference count seen at 1 is a relaxed read).
  /// Set before the buffer is published, so every later reader sees it.
  void mark_shared() noexcept { shared_.store(true, std::memory_order_relaxed); }
  /// Whether mark_shared() was called.
  bool shared() const noexcept { return shared_.load(std::memory_order_relaxed); }

 private:
  void* data_;
  std::size_t bytes_;
  std::atomic<bool> shared_{false};
  bool owns_memory_ = true;
  std::shared_ptr<BufferPool> pool_;
};

/// Outputs of at most this many padded bytes (a scalar: 64 to 256 bytes by dtype; up to 48
/// floats) that kernels allocate through Node::allocate_output or as a fused group's
/// outputs bypass the pool (output_buffer). Why: for a small statement read at once
/// (`sum(x).item()`), the pool's two mutex round trips, size lookup and pool reference were
/// ~600 instructions and six locked operations of a ~4,000-instruction statement, where a
/// block from this thread's block cache (core/block_cache.hpp) costs a few loads and
/// stores. The pool exists for large buffers, whose system allocations fault in fresh
/// pages; these few hundred bytes never do.
inline constexpr std::size_t kSmallBufferBytes = 256;

namespace detail {
/// A buffer of `bytes` (<= kSmallBufferBytes, already padded) bytes allocated in one block
/// with its Buffer and control block, 64-byte aligned, outside any pool. Error for a larger
/// size; OutOfMemoryError when the block cannot be had.
std::shared_ptr<Buffer> small_buffer(std::size_t bytes);
}  // namespace detail


/// Pool statistics, for tests and metrics.
struct PoolStats {
  std::int64_t fresh_allocations = 0;  ///< blocks obtained from the system allocator
  std::int64_t fresh_bytes = 0;
  std::int64_t reuses = 0;  ///< blocks served from the free lists
  std::int64_t cached_bytes = 0;
};

/// Default bound of a pool's cached bytes: a quarter of the physical memory (4 GiB where
/// it cannot be read), or LAZYTENSOR_POOL_CACHE_BYTES (a whole number of bytes; 0 caches
/// nothing). A malformed value is an Error naming it.
std::size_t default_pool_cache_bytes();

/// Free lists keyed by exact padded size. Thread-safe.
///
/// A steady loop asks for the same sizes every step and finds them here. A program whose
/// shapes keep changing would leave a list behind for every size it ever used, so the
/// cached bytes are bounded (cache_limit()): past the bound, the lists of the sizes used
/// least recently go back to the system first.
class BufferPool : public std::enable_shared_from_this<BufferPool> {
 public:
  /// A pool caching at most `cache_limit` bytes of freed buffers.
  explicit BufferPool(std::size_t cache_limit = default_pool_cache_bytes());
  ~BufferPool();

  /// A buffer of at least `bytes` (already padded) bytes.
  std::shared_ptr<Buffer> acquire(std::size_t bytes);

  /// Takes back a buffer's memory: cached for reuse, or (past the cache limit) returned
  /// to the system along with the lists of the sizes used least recently.
  void release(void* p, std::size_t bytes);

  /// Returns every cached block to the system (what torch.cuda.empty_cache does).
  void empty_cache();

  /// Most bytes of freed buffers kept for reuse.
  std::size_t cache_limit() const;
  /// Changes the bound on cached bytes, returning what no longer fits to the system.
  void set_cache_limit(std::size_t bytes);

  PoolStats stats() const;

 private:
  struct SizeList {
    std::vector<void*> blocks;
    std::uint64_t used = 0;  // tick of the last acquire or release of this size
  };

  // Frees blocks until the cached bytes fit `limit`: whole lists of the least recently
  // used sizes first (the size just released is the most recent, so it goes last), and
  // drops the entries of sizes with no block left. Called with mu_ held: freeing under
  // the lock means a release (a destructor) never allocates. Eviction happens only while
  // shapes change, so the linear search for the oldest size costs a steady loop nothing.
  void evict_beyond(std::size_t limit);

  mutable std::mutex mu_;
  std::unordered_map<std::size_t, SizeList> free_;
  std::size_t limit_;
  std::uint64_t tick_ = 0;
  PoolStats stats_;
};

/// The buffer of a node's output of `bytes` (already padded) bytes: small_buffer for a small
/// one (kSmallBufferBytes), else from `pool`.
inline std::shared_ptr<Buffer> output_buffer(BufferPool& pool, std::size_t bytes) {
  return bytes <= kSmallBufferBytes ? detail::small_buffer(bytes) : pool.acquire(bytes);
}

}  // namespace lazy

#if LAZYTENSOR_HEADER_DEFINITIONS
namespace lazy::detail {

LAZYTENSOR_INLINE bool huge_pages_wanted() {
  static const bool wanted = core::env_switch("LAZYTENSOR_HUGE_PAGES").value_or(true);
  return wanted;
}

LAZYTENSOR_INLINE std::uint64_t physical_memory_bytes() {
#if defined(_SC_PHYS_PAGES) && defined(_SC_PAGESIZE)
  const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGESIZE);
  return pages > 0 && page > 0 ? static_cast<std::uint64_t>(pages) * static_cast<std::uint64_t>(page) : 0;
#else
  return 0;
#endif
}

LAZYTENSOR_INLINE std::string byte_size_text(std::uint64_t bytes) {
  const char* units[] = {"bytes", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  double v = static_cast<double>(bytes);
  int u = 0;
  while (v >= 1024 && u < 6) v /= 1024, ++u;
  char text[64];
  const auto exact = static_cast<unsigned long long>(bytes);
  if (u == 0) std::snprintf(text, sizeof text, "%llu bytes", exact);
  else std::snprintf(text, sizeof text, "%.1f %s (%llu bytes)", v, units[u], exact);
  return text;
}

LAZYTENSOR_INLINE void check_fits_in_memory(std::uint64_t bytes, const std::string& what) {
  const std::uint64_t have = physical_memory_bytes();
  if (have && bytes > have) {
    throw OutOfMemoryError(what + " needs " + byte_size_text(bytes) + ", more than this machine's memory (" +
                           byte_size_text(have) + ")");
  }
}

LAZYTENSOR_INLINE void* allocate_buffer_memory(std::size_t bytes) {
  void* p = nullptr;
  try {
    p = ::operator new(bytes, std::align_val_t(buffer_alignment(bytes)));
  } catch (const std::bad_alloc&) {
    throw OutOfMemoryError("cannot allocate a buffer of " + byte_size_text(bytes));
  }
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  // Only whole huge pages inside the block: the advice must not reach memory we do not own.
  // A refusal (THP disabled, old kernel) only loses the speed-up, so the result is ignored.
  const std::size_t whole = bytes / kHugePageBytes * kHugePageBytes;
  if (whole > 0 && huge_pages_wanted()) (void)::madvise(p, whole, MADV_HUGEPAGE);
#endif
  return p;
}

}  // namespace lazy::detail
namespace lazy {

LAZYTENSOR_INLINE Buffer::Buffer(void* p, std::size_t bytes, std::shared_ptr<BufferPool> pool)
    : data_(p), bytes_(bytes), pool_(std::move(pool)) {}

LAZYTENSOR_INLINE std::size_t default_pool_cache_bytes() {
  static const std::size_t bytes = [] {
    if (const auto v = core::env_integer("LAZYTENSOR_POOL_CACHE_BYTES", 0, "bytes", "1073741824"))
      return static_cast<std::size_t>(*v);
#if defined(__linux__)
    const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGESIZE);
    if (pages > 0 && page > 0)
      return static_cast<std::size_t>(pages) * static_cast<std::size_t>(page) / 4;
#endif
    return std::size_t{4} << 30;
  }();
  return bytes;
}

LAZYTENSOR_INLINE BufferPool::BufferPool(std::size_t cache_limit) : limit_(cache_limit) {}

LAZYTENSOR_INLINE BufferPool::~BufferPool() { empty_cache(); }

LAZYTENSOR_INLINE std::shared_ptr<Buffer> BufferPool::acquire(std::size_t bytes) {
  void* p = nullptr;
  {
    std::lock_guard lock(mu_);
    auto it = free_.find(bytes);
    if (it != free_.end() && !it->second.blocks.empty()) {
      p = it->second.blocks.back();
      it->second.blocks.pop_back();
      it->second.used = ++tick_;
      stats_.reuses++;
      stats_.cached_bytes -= static_cast<std::int64_t>(bytes);
    } else {
      stats_.fresh_allocations++;
      stats_.fresh_bytes += static_cast<std::int64_t>(bytes);
    }
  }
  if (!p) {
    p = detail::allocate_buffer_memory(bytes);
  }
  try {
    // The control block from this thread's block cache: a statement's output buffer is
    // made and dropped every statement, and malloc and free were ~150 instructions a pair.
    return core::make_cached<Buffer>(p, bytes, shared_from_this());
  } catch (const std::bad_alloc&) {
    detail::free_buffer_memory(p, bytes);
    throw OutOfMemoryError("cannot allocate a buffer's control block");
  }
}

LAZYTENSOR_INLINE void BufferPool::release(void* p, std::size_t bytes) {
  {
    std::lock_guard lock(mu_);
    if (bytes <= limit_) {
      SizeList& list = free_[bytes];
      list.blocks.push_back(p);
      list.used = ++tick_;
      stats_.cached_bytes += static_cast<std::int64_t>(bytes);
      evict_beyond(limit_);
      return;
    }
  }
  detail::free_buffer_memory(p, bytes);  // larger than the whole cache
}

LAZYTENSOR_INLINE void BufferPool::empty_cache() {
  std::unordered_map<std::size_t, SizeList> lists;
  {
    std::lock_guard lock(mu_);
    lists.swap(free_);
    stats_.cached_bytes = 0;
  }
  for (auto& [bytes, list] : lists)
    for (void* p : list.blocks) detail::free_buffer_memory(p, bytes);
}

LAZYTENSOR_INLINE std::size_t BufferPool::cache_limit() const {
  std::lock_guard lock(mu_);
  return limit_;
}

LAZYTENSOR_INLINE void BufferPool::set_cache_limit(std::size_t bytes) {
  std::lock_guard lock(mu_);
  limit_ = bytes;
  evict_beyond(limit_);
}

LAZYTENSOR_INLINE PoolStats BufferPool::stats() const {
  std::lock_guard lock(mu_);
  return stats_;
}

LAZYTENSOR_INLINE void BufferPool::evict_beyond(std::size_t limit) {
  static auto& evictions = core::counter("PoolEvictedBytes");
  while (stats_.cached_bytes > static_cast<std::int64_t>(limit)) {
    auto victim = free_.end();
    for (auto it = free_.begin(); it != free_.end();) {
      if (it->second.blocks.empty()) {
        it = free_.erase(it);
        continue;
      }
      if (victim == free_.end() || it->second.used < victim->second.used) victim = it;
      ++it;
    }
    if (victim == free_.end()) break;
    const std::size_t bytes = victim->first;
    std::vector<void*>& blocks = victim->second.blocks;
    while (!blocks.empty() && stats_.cached_bytes > static_cast<std::int64_t>(limit)) {
      detail::free_buffer_memory(blocks.back(), bytes);
      blocks.pop_back();
      stats_.cached_bytes -= static_cast<std::int64_t>(bytes);
      evictions.add(static_cast<std::int64_t>(bytes));
    }
    if (blocks.empty()) free_.erase(victim);
  }
}

LAZYTENSOR_INLINE Buffer::~Buffer() {
  if (pool_) {
    pool_->release(data_, bytes_);
  } else if (owns_memory_) {
    detail::free_buffer_memory(data_, bytes_);
  }
}

namespace detail {

/// small_buffer's allocation: the Buffer and its memory, which starts at the first 64-byte
/// boundary of `storage` (the block itself, from the block cache, is only as aligned as
/// ::operator new aligns; an over-aligned type would bypass the cache).
struct SmallBufferBlock {
  explicit SmallBufferBlock(std::size_t bytes) noexcept : buffer(aligned_storage(), bytes, Buffer::InlineMemory{}) {
#if defined(LAZYTENSOR_DETAIL_ASAN)
    // The storage around the buffer's bytes is poisoned, so that AddressSanitizer still
    // reports a kernel writing past a small output, as it does past a pooled one.
    auto* data = static_cast<unsigned char*>(buffer.data());
    ASAN_POISON_MEMORY_REGION(storage, static_cast<std::size_t>(data - storage));
    ASAN_POISON_MEMORY_REGION(data + bytes, sizeof storage - static_cast<std::size_t>(data - storage) - bytes);
#endif
  }
#if defined(LAZYTENSOR_DETAIL_ASAN)
  ~SmallBufferBlock() { ASAN_UNPOISON_MEMORY_REGION(storage, sizeof storage); }
#endif
  void* aligned_storage() noexcept {
    const auto at = reinterpret_cast<std::uintptr_t>(storage);
    return storage + ((kBufferAlign - at % kBufferAlign) % kBufferAlign);
  }

  Buffer buffer;
  unsigned char storage[kSmallBufferBytes + kBufferAlign];
};

LAZYTENSOR_INLINE std::shared_ptr<Buffer> small_buffer(std::size_t bytes) {
  if (bytes > kSmallBufferBytes) {
    throw Error("small_buffer: expected at most " + std::to_string(kSmallBufferBytes) + " bytes, found " +
                          std::to_string(bytes));
  }
  try {
    auto block = core::make_cached<SmallBufferBlock>(bytes);
    Buffer* buffer = &block->buffer;
    return std::shared_ptr<Buffer>(std::move(block), buffer);
  } catch (const std::bad_alloc&) {
    throw OutOfMemoryError("cannot allocate a small buffer of " + byte_size_text(bytes));
  }
}

}  // namespace detail

}  // namespace lazy
#endif  // LAZYTENSOR_HEADER_DEFINITIONS
