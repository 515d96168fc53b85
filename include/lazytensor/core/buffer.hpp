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
#include <cstdlib>
#include <memory>
#include <mutex>
#include <new>
#include <unordered_map>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#endif

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

inline bool huge_pages_wanted() {
  static const bool wanted = [] {
    const char* env = std::getenv("LAZYTENSOR_HUGE_PAGES");
    return !(env && env[0] == '0');
  }();
  return wanted;
}

/// Memory for a buffer of `bytes` bytes (see the file comment for large ones).
inline void* allocate_buffer_memory(std::size_t bytes) {
  void* p = ::operator new(bytes, std::align_val_t(buffer_alignment(bytes)));
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  // Only whole huge pages inside the block: the advice must not reach memory we do not own.
  // A refusal (THP disabled, old kernel) only loses the speed-up, so the result is ignored.
  const std::size_t whole = bytes / kHugePageBytes * kHugePageBytes;
  if (whole > 0 && huge_pages_wanted()) (void)::madvise(p, whole, MADV_HUGEPAGE);
#endif
  return p;
}

inline void free_buffer_memory(void* p, std::size_t bytes) {
  ::operator delete(p, std::align_val_t(buffer_alignment(bytes)));
}

}  // namespace detail

class BufferPool;

/// A block of aligned memory. Returned to its pool when the last reference goes.
class Buffer {
 public:
  Buffer(void* p, std::size_t bytes, std::shared_ptr<BufferPool> pool)
      : data_(p), bytes_(bytes), pool_(std::move(pool)) {}
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  ~Buffer();

  void* data() const { return data_; }
  std::size_t bytes() const { return bytes_; }

 private:
  void* data_;
  std::size_t bytes_;
  std::shared_ptr<BufferPool> pool_;
};

/// Pool statistics, for tests and metrics.
struct PoolStats {
  std::int64_t fresh_allocations = 0;  ///< blocks obtained from the system allocator
  std::int64_t fresh_bytes = 0;
  std::int64_t reuses = 0;  ///< blocks served from the free lists
  std::int64_t cached_bytes = 0;
};

/// Free lists keyed by exact padded size. Thread-safe.
class BufferPool : public std::enable_shared_from_this<BufferPool> {
 public:
  ~BufferPool() { empty_cache(); }

  /// A buffer of at least `bytes` (already padded) bytes.
  std::shared_ptr<Buffer> acquire(std::size_t bytes) {
    void* p = nullptr;
    {
      std::lock_guard lock(mu_);
      auto it = free_.find(bytes);
      if (it != free_.end() && !it->second.empty()) {
        p = it->second.back();
        it->second.pop_back();
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
    return std::make_shared<Buffer>(p, bytes, shared_from_this());
  }

  void release(void* p, std::size_t bytes) {
    std::lock_guard lock(mu_);
    free_[bytes].push_back(p);
    stats_.cached_bytes += static_cast<std::int64_t>(bytes);
  }

  /// Returns every cached block to the system.
  void empty_cache() {
    std::lock_guard lock(mu_);
    for (auto& [bytes, list] : free_) {
      for (void* p : list) detail::free_buffer_memory(p, bytes);
    }
    free_.clear();
    stats_.cached_bytes = 0;
  }

  PoolStats stats() const {
    std::lock_guard lock(mu_);
    return stats_;
  }

 private:
  mutable std::mutex mu_;
  std::unordered_map<std::size_t, std::vector<void*>> free_;
  PoolStats stats_;
};

inline Buffer::~Buffer() {
  if (pool_) {
    pool_->release(data_, bytes_);
  } else {
    detail::free_buffer_memory(data_, bytes_);
  }
}

}  // namespace lazy
