// core/block_cache.hpp: size classes, per-thread reuse with a bound, blocks freed on other
// threads, and allocate_shared through BlockAllocator. Also run under ThreadSanitizer.
#include <lazytensor/core/block_cache.hpp>

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <set>
#include <thread>
#include <vector>

namespace {

namespace bc = lazy::core::detail;

// Reference for the size classes, from the documentation: 64-byte classes up to 1 KiB.
std::size_t ref_class(std::size_t bytes) {
  if (bytes > 1024) return 16;
  std::size_t c = 0;
  while ((c + 1) * 64 < bytes) ++c;
  return c;
}

TEST(BlockCache, SizeClasses) {
  for (std::size_t b = 0; b <= 1100; ++b) ASSERT_EQ(bc::block_class(b), ref_class(b)) << b;
  EXPECT_EQ(bc::block_class(std::size_t{1} << 40), bc::kBlockClasses);
  EXPECT_EQ(bc::block_class(static_cast<std::size_t>(-1)), bc::kBlockClasses);  // no wrap-around
}

TEST(BlockCache, AFreedBlockServesTheNextRequestOfItsClassOnThisThread) {
  void* a = lazy::core::allocate_block(100);
  std::memset(a, 1, 100);
  lazy::core::free_block(a, 100);
  void* b = lazy::core::allocate_block(120);  // same 128-byte class
  std::memset(b, 2, 120);
  if (bc::kBlockCacheOn) {
    EXPECT_EQ(a, b);
  }
  void* c = lazy::core::allocate_block(200);  // another class: never this block
  EXPECT_NE(b, c);
  lazy::core::free_block(b, 120);
  lazy::core::free_block(c, 200);
}

TEST(BlockCache, KeepsAtMostItsBoundPerClass) {
  constexpr int kMany = 3 * static_cast<int>(bc::kBlocksPerClass);
  std::vector<void*> blocks;
  for (int i = 0; i < kMany; ++i) blocks.push_back(lazy::core::allocate_block(300));
  const std::set<void*> first(blocks.begin(), blocks.end());
  ASSERT_EQ(first.size(), blocks.size()) << "a block handed out twice";
  for (void* p : blocks) lazy::core::free_block(p, 300);
  const std::uint32_t kept = bc::cached_blocks(bc::block_class(300));
  if (bc::kBlockCacheOn) {
    EXPECT_EQ(kept, bc::kBlocksPerClass);
  } else {
    EXPECT_EQ(kept, 0u);
  }
  // The kept blocks come back first; every block handed out is distinct and writable.
  std::vector<void*> again;
  for (int i = 0; i < kMany; ++i) {
    again.push_back(lazy::core::allocate_block(300));
    std::memset(again.back(), 0x33, 300);
  }
  EXPECT_EQ(std::set<void*>(again.begin(), again.end()).size(), again.size());
  int reused = 0;
  for (void* p : again) reused += first.count(p) ? 1 : 0;
  if (bc::kBlockCacheOn) {
    EXPECT_GE(reused, static_cast<int>(bc::kBlocksPerClass));
  }
  for (void* p : again) lazy::core::free_block(p, 300);
}

TEST(BlockCache, LargeBlocksAndNullAreNotCached) {
  std::vector<std::uint32_t> before;
  for (std::size_t c = 0; c < bc::kBlockClasses; ++c) before.push_back(bc::cached_blocks(c));
  const std::size_t big = 64 * bc::kBlockClasses + 1;
  void* p = lazy::core::allocate_block(big);
  std::memset(p, 7, big);
  lazy::core::free_block(p, big);
  lazy::core::free_block(nullptr, 64);
  for (std::size_t c = 0; c < bc::kBlockClasses; ++c) ASSERT_EQ(bc::cached_blocks(c), before[c]) << c;
  EXPECT_THROW((void)lazy::core::BlockAllocator<double>{}.allocate(static_cast<std::size_t>(-1) / 4),
               std::bad_array_new_length);
}

TEST(BlockCache, BlocksFreedOnAnotherThreadJoinThatThreadsCache) {
  // A producer allocates and fills blocks; a consumer checks and frees them (a node made
  // by the tracing thread and dropped by an executor), then allocates its own from them.
  constexpr int kBlocks = 16;
  std::vector<unsigned char*> handed(kBlocks);
  for (int i = 0; i < kBlocks; ++i) {
    handed[i] = static_cast<unsigned char*>(lazy::core::allocate_block(256));
    std::memset(handed[i], i + 1, 256);
  }
  std::set<void*> from_producer(handed.begin(), handed.end());
  int reused = 0;
  std::thread consumer([&] {
    for (int i = 0; i < kBlocks; ++i) {
      for (int k = 0; k < 256; ++k) ASSERT_EQ(handed[i][k], i + 1);
      lazy::core::free_block(handed[i], 256);
    }
    std::vector<void*> mine;
    for (int i = 0; i < kBlocks; ++i) {
      mine.push_back(lazy::core::allocate_block(256));
      std::memset(mine.back(), 0x44, 256);
      reused += from_producer.count(mine.back()) ? 1 : 0;
    }
    for (void* p : mine) lazy::core::free_block(p, 256);
  });  // its cache is returned when it exits
  consumer.join();
  if (bc::kBlockCacheOn) {
    EXPECT_EQ(reused, kBlocks);
  }
}

TEST(BlockCache, ThreadsNeverShareABlock) {
  // Four threads allocate, stamp and verify blocks of mixed sizes; each frees half of them
  // and passes the other half to the next thread in the ring, which frees them into its own
  // cache. A block handed to two owners at once shows up as a wrong stamp.
  constexpr int kThreads = 4, kRounds = 3000;
  struct Block {
    unsigned char* p;
    std::size_t bytes;
    unsigned char stamp;
  };
  auto intact = [](const Block& b) {
    for (std::size_t k = 0; k < b.bytes; ++k)
      if (b.p[k] != b.stamp) return false;
    return true;
  };
  std::atomic<int> bad{0};
  std::vector<std::vector<Block>> passed(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::vector<Block> mine;
      for (int i = 0; i < kRounds; ++i) {
        const std::size_t bytes = 16 + static_cast<std::size_t>((i * 37 + t * 11) % 700);
        const auto stamp = static_cast<unsigned char>(t * 61 + i);
        auto* p = static_cast<unsigned char*>(lazy::core::allocate_block(bytes));
        std::memset(p, stamp, bytes);
        mine.push_back({p, bytes, stamp});
        if (mine.size() < 8) continue;
        for (const auto& b : mine)
          if (!intact(b)) bad.fetch_add(1);
        for (std::size_t k = 0; k < mine.size(); ++k) {
          if (k % 2) passed[static_cast<std::size_t>(t)].push_back(mine[k]);
          else lazy::core::free_block(mine[k].p, mine[k].bytes);
        }
        mine.clear();
      }
      for (const auto& b : mine) lazy::core::free_block(b.p, b.bytes);
    });
  }
  for (auto& th : threads) th.join();
  std::vector<std::thread> freers;
  for (int t = 0; t < kThreads; ++t) {
    freers.emplace_back([&, t] {
      for (const auto& b : passed[static_cast<std::size_t>((t + 1) % kThreads)]) {
        if (!intact(b)) bad.fetch_add(1);
        lazy::core::free_block(b.p, b.bytes);
      }
    });
  }
  for (auto& th : freers) th.join();
  EXPECT_EQ(bad.load(), 0);
}

struct Counted {
  static inline std::atomic<int> live{0};
  explicit Counted(int v) : value(v) { live.fetch_add(1); }
  ~Counted() { live.fetch_sub(1); }
  int value;
  char pad[200];
};

TEST(BlockCache, AllocateSharedThroughTheBlockAllocator) {
  // Control block and object share one block of the class of their joint size.
  const std::size_t c = bc::block_class(sizeof(Counted) + 16);
  std::vector<std::shared_ptr<Counted>> objects;
  for (int i = 0; i < 100; ++i)
    objects.push_back(std::allocate_shared<Counted>(lazy::core::BlockAllocator<Counted>{}, i));
  EXPECT_EQ(Counted::live.load(), 100);
  for (int i = 0; i < 100; ++i) ASSERT_EQ(objects[static_cast<std::size_t>(i)]->value, i);
  // The last references go on another thread.
  std::thread other([moved = std::move(objects)]() mutable { moved.clear(); });
  other.join();
  EXPECT_EQ(Counted::live.load(), 0);
  // A weak reference keeps the block after the object is destroyed; its release frees it
  // into this thread's cache.
  std::weak_ptr<Counted> w;
  {
    auto s = std::allocate_shared<Counted>(lazy::core::BlockAllocator<Counted>{}, 5);
    w = s;
  }
  EXPECT_EQ(Counted::live.load(), 0);
  const std::uint32_t before = bc::cached_blocks(c);
  w.reset();
  if (bc::kBlockCacheOn) {
    EXPECT_EQ(bc::cached_blocks(c), std::min(before + 1, bc::kBlocksPerClass));
  }
}

}  // namespace
