// core/vectorizer_barrier.hpp: the barrier leaves every value as it was, in a loop of the
// shape it is used in (pointers advanced by per-element steps), against the same loop
// without it.
#include <cstddef>
#include <cstdint>
#include <vector>

#include <gtest/gtest.h>

#include <lazytensor/core/vectorizer_barrier.hpp>

namespace {

using lazy::core::hide_from_vectorizer;

TEST(VectorizerBarrier, KeepsIntegersAndPointers) {
  std::int64_t i = -1234567890123;
  hide_from_vectorizer(i);
  EXPECT_EQ(i, -1234567890123);
  unsigned char c = 200;
  hide_from_vectorizer(c);
  EXPECT_EQ(c, 200);
  int x = 0;
  int* p = &x;
  hide_from_vectorizer(p);
  EXPECT_EQ(p, &x);
}

TEST(VectorizerBarrier, PointerAdvanceLoopMatchesThePlainLoop) {
  std::vector<std::byte> buf(1 << 16);
  for (std::size_t count : {1u, 3u, 7u, 10u, 17u}) {
    std::vector<const std::byte*> hidden(count), plain(count);
    std::vector<std::size_t> step(count);
    for (std::size_t i = 0; i < count; ++i) {
      hidden[i] = plain[i] = buf.data() + 64 * i;
      step[i] = i % 3 == 0 ? 0 : 4 * i;  // some pointers stay (slice-long scratch)
    }
    for (int round = 0; round < 50; ++round) {
      for (std::size_t i = 0; i < count; ++i) {
        const std::byte* q = hidden[i] + step[i];
        hide_from_vectorizer(q);
        hidden[i] = q;
      }
      for (std::size_t i = 0; i < count; ++i) plain[i] += step[i];
    }
    EXPECT_EQ(hidden, plain) << count << " pointers";
  }
}

}  // namespace
