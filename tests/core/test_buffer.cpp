// core/buffer.hpp: alignment, the padding rule, and pool recycling; plus the device pool
// reaching a steady state in a training-like loop.
#include <lazytensor/core/buffer.hpp>
#include <lazytensor/debug/metrics.hpp>
#include <lazytensor/tensor.hpp>
#include <lazytensor/ops/factories.hpp>

#include <gtest/gtest.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

namespace {

using lazy::BufferPool;

// Reference padding rule, from the documentation: the element count (at least 1) rounded up
// to a multiple of 16, times the element size, rounded up to whole 64-byte lines.
std::size_t ref_padded_bytes(std::int64_t numel, std::size_t elem) {
  std::int64_t n = numel < 1 ? 1 : numel;
  while (n % 16) ++n;
  n += 16;  // a spare batch: a whole batch loaded at the last element stays inside
  std::size_t bytes = static_cast<std::size_t>(n) * elem;
  while (bytes % 64) ++bytes;
  return bytes;
}

TEST(Buffer, PaddingRule) {
  // Whole 16-element batches plus one spare batch, in whole 64-byte lines.
  EXPECT_EQ(lazy::padded_bytes(0, 4), 128u);
  EXPECT_EQ(lazy::padded_bytes(1, 4), 128u);
  EXPECT_EQ(lazy::padded_bytes(16, 4), 128u);
  EXPECT_EQ(lazy::padded_bytes(17, 4), 192u);
  EXPECT_EQ(lazy::padded_bytes(1, 1), 64u);
  EXPECT_EQ(lazy::padded_bytes(65, 1), 128u);
  EXPECT_EQ(lazy::padded_bytes(16, 8), 256u);
  EXPECT_EQ(lazy::padded_bytes(100, 2), 256u);
  for (std::size_t elem : {1u, 2u, 4u, 8u}) {
    for (std::int64_t n = 0; n < 300; ++n) {
      const std::size_t got = lazy::padded_bytes(n, elem);
      ASSERT_EQ(got, ref_padded_bytes(n, elem)) << "numel " << n << " elem " << elem;
      // What kernels rely on: a whole 16-element batch loaded at any element fits, and
      // lines are whole.
      ASSERT_GE(got, static_cast<std::size_t>(std::max<std::int64_t>(n, 1) - 1 + 16) * elem);
      ASSERT_EQ(got % 64, 0u);
    }
  }
  static_assert(lazy::padded_bytes(3, 4) == 128);  // usable at compile time
  static_assert(lazy::kBufferAlign == 64 && lazy::kPadElements == 16);
}

TEST(Buffer, Alignment) {
  auto pool = std::make_shared<BufferPool>();
  std::vector<std::shared_ptr<lazy::Buffer>> keep;
  for (std::int64_t n : {0, 1, 3, 15, 16, 17, 63, 64, 65, 1000, 4097, 100003}) {
    for (std::size_t elem : {1u, 2u, 4u, 8u}) {
      auto b = pool->acquire(lazy::padded_bytes(n, elem));
      ASSERT_NE(b->data(), nullptr);
      EXPECT_EQ(reinterpret_cast<std::uintptr_t>(b->data()) % 64, 0u) << n << " x " << elem;
      EXPECT_EQ(b->bytes(), lazy::padded_bytes(n, elem));
      std::memset(b->data(), 0xab, b->bytes());  // the whole padded size is writable (ASan)
      keep.push_back(std::move(b));
    }
  }
  // Recycled blocks are aligned too.
  keep.clear();
  for (int i = 0; i < 10; ++i) {
    auto b = pool->acquire(lazy::padded_bytes(17, 4));
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(b->data()) % 64, 0u);
  }
}

// The flags the kernel shows for the mapping that holds `p` ("VmFlags: rd wr ... hg ..."):
// empty when no mapping holds it, "none" when the kernel shows no flags at all (some
// sandboxed kernels).
std::string vm_flags_of(const void* p) {
  std::ifstream smaps("/proc/self/smaps");
  const auto addr = reinterpret_cast<std::uintptr_t>(p);
  bool inside = false, any_flags = false;
  for (std::string line; std::getline(smaps, line);) {
    std::uintptr_t lo = 0, hi = 0;
    if (line.rfind("VmFlags:", 0) == 0) {
      any_flags = true;
      if (inside) return line;
    } else if (std::sscanf(line.c_str(), "%lx-%lx ", &lo, &hi) == 2) {
      inside = lo <= addr && addr < hi;
    }
  }
  return any_flags ? std::string() : std::string("none");
}

TEST(Buffer, LargeBuffersStartOnAHugePageAndAskForHugePages) {
  auto pool = std::make_shared<BufferPool>();
  const std::size_t small = lazy::kHugePageBytes - 64, big = 3 * lazy::kHugePageBytes + 4096;
  auto s = pool->acquire(small);
  auto b = pool->acquire(big);
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(b->data()) % lazy::kHugePageBytes, 0u);
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(s->data()) % 64, 0u);
  // Every byte is ours: a pattern survives a round trip through the pool (and ASan sees
  // the whole block written).
  std::memset(b->data(), 0x5a, big);
  void* const first = b->data();
  b.reset();
  auto again = pool->acquire(big);
  ASSERT_EQ(again->data(), first);
  const auto* bytes = static_cast<const unsigned char*>(again->data());
  std::size_t wrong = 0;
  for (std::size_t i = 0; i < big; ++i) wrong += bytes[i] != 0x5a;
  EXPECT_EQ(wrong, 0u);
#if defined(__linux__)
  // The advice shows as the "hg" flag of the mapping, whatever the system's THP mode; a
  // kernel without THP support has no /sys/kernel/mm/transparent_hugepage.
  if (!std::ifstream("/sys/kernel/mm/transparent_hugepage/enabled"))
    GTEST_SKIP() << "kernel without THP";
  const std::string flags = vm_flags_of(again->data());
  if (flags == "none") GTEST_SKIP() << "/proc/self/smaps shows no VmFlags";
  ASSERT_FALSE(flags.empty()) << "no mapping found in /proc/self/smaps";
  const char* env = std::getenv("LAZYTENSOR_HUGE_PAGES");
  if (env && env[0] == '0') {
    EXPECT_EQ(flags.find(" hg"), std::string::npos) << "LAZYTENSOR_HUGE_PAGES=0 but: " << flags;
  } else {
    EXPECT_NE(flags.find(" hg"), std::string::npos) << flags;
  }
#endif
}

TEST(Buffer, PoolReusesReleasedBlocksOfTheSameSize) {
  auto pool = std::make_shared<BufferPool>();
  const std::size_t bytes = lazy::padded_bytes(1000, 4);
  void* first;
  {
    auto b = pool->acquire(bytes);
    first = b->data();
    auto s = pool->stats();
    EXPECT_EQ(s.fresh_allocations, 1);
    EXPECT_EQ(s.fresh_bytes, static_cast<std::int64_t>(bytes));
    EXPECT_EQ(s.reuses, 0);
    EXPECT_EQ(s.cached_bytes, 0);
  }
  EXPECT_EQ(pool->stats().cached_bytes, static_cast<std::int64_t>(bytes));
  {
    auto b = pool->acquire(bytes);
    EXPECT_EQ(b->data(), first) << "the released block is served again";
    auto s = pool->stats();
    EXPECT_EQ(s.fresh_allocations, 1);
    EXPECT_EQ(s.reuses, 1);
    EXPECT_EQ(s.cached_bytes, 0);
    // A different size is not served from that list.
    auto c = pool->acquire(bytes + 64);
    EXPECT_NE(c->data(), first);
    EXPECT_EQ(pool->stats().fresh_allocations, 2);
  }
  EXPECT_EQ(pool->stats().cached_bytes, static_cast<std::int64_t>(2 * bytes + 64));
}

TEST(Buffer, FreshAllocationsStayFlatInSteadyState) {
  auto pool = std::make_shared<BufferPool>();
  const std::vector<std::size_t> sizes = {64, 128, 4096, 64, 1 << 20, 4096, 192};
  auto one_step = [&] {
    std::vector<std::shared_ptr<lazy::Buffer>> live;
    for (std::size_t s : sizes) live.push_back(pool->acquire(s));
    // Release half early, acquire again: same sizes come back from the free lists.
    live.erase(live.begin(), live.begin() + 3);
    for (std::size_t k = 0; k < 3; ++k) live.push_back(pool->acquire(sizes[k]));
  };
  one_step();
  const auto warm = pool->stats();
  EXPECT_EQ(warm.fresh_allocations, static_cast<std::int64_t>(sizes.size()));
  for (int i = 0; i < 100; ++i) one_step();
  const auto s = pool->stats();
  EXPECT_EQ(s.fresh_allocations, warm.fresh_allocations);
  EXPECT_EQ(s.fresh_bytes, warm.fresh_bytes);
  EXPECT_EQ(s.reuses, warm.reuses + 100 * static_cast<std::int64_t>(sizes.size() + 3));
}

TEST(Buffer, EmptyCacheReturnsBlocks) {
  auto pool = std::make_shared<BufferPool>();
  { auto a = pool->acquire(256), b = pool->acquire(512); }
  EXPECT_EQ(pool->stats().cached_bytes, 768);
  pool->empty_cache();
  EXPECT_EQ(pool->stats().cached_bytes, 0);
  auto c = pool->acquire(256);
  EXPECT_EQ(pool->stats().fresh_allocations, 3) << "nothing cached any more";
}

// A program whose shapes keep changing releases a new size every step: the cached bytes
// stay under the limit, the sizes used least recently go first, and a size in use keeps
// being served from its list. Checked against a model of the cache (per size: blocks and
// the time of last use).
TEST(Buffer, CachedBytesStayUnderTheLimitEvictingTheLeastRecentlyUsedSizes) {
  constexpr std::size_t kLimit = 64 * 1024;
  auto pool = std::make_shared<BufferPool>(kLimit);
  EXPECT_EQ(pool->cache_limit(), kLimit);
  std::map<std::size_t, std::pair<int, int>> model;  // size -> (cached blocks, last use)
  std::int64_t model_bytes = 0;
  int clock = 0;
  auto model_evict = [&] {
    while (model_bytes > static_cast<std::int64_t>(kLimit)) {
      auto victim = model.end();
      for (auto it = model.begin(); it != model.end(); ++it)
        if (it->second.first > 0 &&
            (victim == model.end() || it->second.second < victim->second.second))
          victim = it;
      while (victim->second.first > 0 && model_bytes > static_cast<std::int64_t>(kLimit)) {
        --victim->second.first;
        model_bytes -= static_cast<std::int64_t>(victim->first);
      }
      if (victim->second.first == 0) model.erase(victim);
    }
  };
  const std::size_t steady = 4096;  // acquired every step, as a training loop's parameters
  for (int step = 0; step < 200; ++step) {
    const std::size_t changing = 64 * static_cast<std::size_t>(1 + step);  // a new size each step
    for (std::size_t bytes : {steady, changing}) {
      const auto before = pool->stats();
      { auto b = pool->acquire(bytes); }
      const bool cached = model.count(bytes) && model[bytes].first > 0;
      EXPECT_EQ(pool->stats().reuses - before.reuses, cached ? 1 : 0)
          << "step " << step << " size " << bytes;
      if (cached) {
        --model[bytes].first;
        model_bytes -= static_cast<std::int64_t>(bytes);
      }
      auto& entry = model[bytes];
      ++entry.first;
      entry.second = ++clock;
      model_bytes += static_cast<std::int64_t>(bytes);
      model_evict();
      ASSERT_EQ(pool->stats().cached_bytes, model_bytes) << "step " << step;
      ASSERT_LE(pool->stats().cached_bytes, static_cast<std::int64_t>(kLimit));
    }
  }
  EXPECT_GT(pool->stats().reuses, 190) << "the steady size keeps being reused";
  // Lowering the limit returns the excess; a block larger than the limit is never cached.
  pool->set_cache_limit(8192);
  EXPECT_LE(pool->stats().cached_bytes, 8192);
  const auto cached = pool->stats().cached_bytes;
  const auto evicted = lazy::debug::counter_value("PoolEvictedBytes");
  { auto big = pool->acquire(16384); }
  EXPECT_EQ(pool->stats().cached_bytes, cached) << "freed at once, nothing evicted for it";
  EXPECT_EQ(lazy::debug::counter_value("PoolEvictedBytes"), evicted);
  pool->set_cache_limit(0);
  EXPECT_EQ(pool->stats().cached_bytes, 0);
}

TEST(Buffer, PublicEmptyCacheReturnsTheDevicesCachedBlocks) {
  auto& pool = lazy::graph::current_device().pool();
  {
    lazy::Tensor<float> t = lazy::full<float>({1000}, 1.0f) + 1.0f;
    lazy::mark_step();
    EXPECT_EQ(t.to_vector()[999], 2.0f);
  }
  lazy::wait_device_ops();
  EXPECT_GT(pool.stats().cached_bytes, 0);
  lazy::empty_cache();
  EXPECT_EQ(pool.stats().cached_bytes, 0);
}

TEST(Buffer, BufferKeepsItsPoolAlive) {
  std::shared_ptr<lazy::Buffer> b;
  {
    auto pool = std::make_shared<BufferPool>();
    b = pool->acquire(128);
  }
  std::memset(b->data(), 1, 128);
  b.reset();  // returns to the (now last-referenced) pool, which then frees it: no leak (ASan)
}

TEST(Buffer, ConcurrentAcquireRelease) {
  auto pool = std::make_shared<BufferPool>();
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 2000; ++i) {
        auto b = pool->acquire(64 * static_cast<std::size_t>(1 + (i + t) % 5));
        static_cast<unsigned char*>(b->data())[0] = static_cast<unsigned char>(i);
      }
    });
  }
  for (auto& th : threads) th.join();
  const auto s = pool->stats();
  EXPECT_EQ(s.fresh_allocations + s.reuses, 4 * 2000);
  EXPECT_LE(s.fresh_allocations, 4 * 5) << "at most one live block per thread and size";
}

TEST(Buffer, DevicePoolReachesSteadyStateInATrainingLoop) {
  // A parameter update per step: after warm-up the device allocates nothing new.
  auto w = lazy::from_vector<float>(std::vector<float>(4096, 1.0f), {64, 64});
  auto g = lazy::full<float>({64, 64}, 0.5f);
  auto b = lazy::full<float>({64}, 0.25f);
  lazy::mark_step();
  auto& pool = lazy::graph::current_device().pool();
  auto step = [&] {
    lazy::Tensor<float> grad = g * 2.0f + b;  // a temporary per step
    w -= 0.01f * grad;
    lazy::mark_step();
  };
  for (int i = 0; i < 3; ++i) step();
  const auto warm = pool.stats();
  for (int i = 0; i < 20; ++i) step();
  const auto s = pool.stats();
  EXPECT_EQ(s.fresh_allocations, warm.fresh_allocations);
  EXPECT_GT(s.reuses, warm.reuses);
  const auto v = w.to_vector();
  // 23 steps of w -= 0.01 * (0.5 * 2 + 0.25).
  float want = 1.0f;
  for (int i = 0; i < 23; ++i) want -= 0.01f * 1.25f;
  for (float x : v) ASSERT_NEAR(x, want, 1e-5f);
}


TEST(Buffer, SmallOutputsAreAlignedWritableAndOutsideThePool) {
  auto pool = std::make_shared<BufferPool>();
  std::vector<std::shared_ptr<lazy::Buffer>> live;
  for (std::size_t bytes = 64; bytes <= lazy::kSmallBufferBytes; bytes += 64) {
    for (int k = 0; k < 8; ++k) {  // several of each size, at whatever offsets malloc gives
      auto b = lazy::output_buffer(*pool, bytes);
      ASSERT_EQ(reinterpret_cast<std::uintptr_t>(b->data()) % lazy::kBufferAlign, 0u) << bytes;
      ASSERT_EQ(b->bytes(), bytes);
      // The whole padded size is ours (under ASan the storage around it is poisoned).
      std::memset(b->data(), 0x5a, bytes);
      live.push_back(std::move(b));
    }
  }
  for (const auto& b : live) {
    const auto* p = static_cast<const unsigned char*>(b->data());
    for (std::size_t i = 0; i < b->bytes(); ++i) ASSERT_EQ(p[i], 0x5a) << "blocks overlap";
  }
  live.clear();
  auto s = pool->stats();
  EXPECT_EQ(s.fresh_allocations + s.reuses, 0) << "small outputs never touch the pool";
  EXPECT_EQ(s.cached_bytes, 0);
  // The next padded size past the bound goes to the pool, and comes back from it.
  { auto b = lazy::output_buffer(*pool, lazy::kSmallBufferBytes + 64); }
  { auto b = lazy::output_buffer(*pool, lazy::kSmallBufferBytes + 64); }
  s = pool->stats();
  EXPECT_EQ(s.fresh_allocations, 1);
  EXPECT_EQ(s.reuses, 1);
  EXPECT_THROW(lazy::detail::small_buffer(lazy::kSmallBufferBytes + 64), lazy::Error);
}

TEST(Buffer, ScalarResultsOfAReadLoopLeaveThePoolAlone) {
  // sum(x).item() in a loop: each result (one float, 128 padded bytes) is a small buffer,
  // so the device pool sees no traffic; the values match a scalar loop.
  std::vector<float> v(300);
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = 0.25f * static_cast<float>(i % 7) - 0.5f;
  auto x = lazy::from_vector<float>(v);
  lazy::mark_step();
  lazy::wait_device_ops();
  auto& pool = lazy::graph::current_device().pool();
  const auto before = pool.stats();
  for (int k = 1; k <= 50; ++k) {
    const float got = lazy::sum(x * static_cast<float>(k)).item();
    double want = 0;
    for (float e : v) want += static_cast<double>(e) * k;
    ASSERT_NEAR(got, want, 1e-3 * k) << k;
  }
  const auto after = pool.stats();
  EXPECT_EQ(after.fresh_allocations, before.fresh_allocations);
  EXPECT_EQ(after.reuses, before.reuses);
}

}  // namespace
