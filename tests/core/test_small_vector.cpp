// core/small_vector.hpp: inline storage up to N, heap beyond, value semantics, stack use, against
// std::vector doing the same operations.
#include <array>
#include <cstdint>
#include <vector>

#include <gtest/gtest.h>

#include <lazytensor/core/small_vector.hpp>

namespace {

using lazy::core::SmallVector;

template <class T, std::size_t N>
std::vector<T> as_vector(const SmallVector<T, N>& v) {
  return std::vector<T>(v.begin(), v.end());
}

TEST(SmallVector, GrowsPastTheInlineCapacityKeepingValues) {
  SmallVector<int, 2> v;
  std::vector<int> ref;
  EXPECT_TRUE(v.empty());
  for (std::size_t n = 1; n <= 9; ++n) {
    v.resize(n);
    ref.resize(n);
    v[n - 1] = static_cast<int>(10 * n);
    ref[n - 1] = static_cast<int>(10 * n);
    ASSERT_EQ(as_vector(v), ref) << "size " << n;
  }
  v.resize(3);  // shrinking keeps the first values
  ref.resize(3);
  EXPECT_EQ(as_vector(v), ref);
  v.resize(5);  // and growing again value-initializes the new ones
  ref.resize(5);
  EXPECT_EQ(as_vector(v), ref);
}

TEST(SmallVector, AssignFillsInlineAndOnTheHeap) {
  SmallVector<char, 4> v;
  v.assign(3, 'x');
  EXPECT_EQ(as_vector(v), std::vector<char>(3, 'x'));
  v.assign(7, 'y');
  EXPECT_EQ(as_vector(v), std::vector<char>(7, 'y'));
  v.assign(2, 'z');
  EXPECT_EQ(as_vector(v), std::vector<char>(2, 'z'));
}

TEST(SmallVector, CopiesAndMovesAreIndependentValues) {
  for (std::size_t n : {std::size_t{2}, std::size_t{6}}) {  // inline, then heap
    SmallVector<std::array<std::int64_t, 3>, 4> a;
    a.resize(n);
    for (std::size_t i = 0; i < n; ++i) a[i] = {static_cast<std::int64_t>(i), 1, 2};
    auto b = a;  // copy
    b[0][0] = 99;
    EXPECT_EQ(a[0][0], 0) << n;
    EXPECT_EQ(b.size(), n);
    auto c = std::move(b);
    EXPECT_EQ(c[0][0], 99) << n;
    EXPECT_EQ(c.size(), n);
    EXPECT_EQ(b.size(), 0u);  // NOLINT(bugprone-use-after-move): moved-from is empty
    SmallVector<std::array<std::int64_t, 3>, 4> d;
    d = a;
    d = std::move(c);
    EXPECT_EQ(d[0][0], 99);
    EXPECT_EQ(d[n - 1][0], static_cast<std::int64_t>(n - 1));
    auto& same = d;
    d = same;  // self-assignment keeps the values
    EXPECT_EQ(d[n - 1][0], static_cast<std::int64_t>(n - 1));
  }
}

TEST(SmallVector, PushBackAndPopBackWorkAsAStackPastTheInlineCapacity) {
  SmallVector<std::int64_t, 3> v;
  std::vector<std::int64_t> ref;
  // Push 40 (inline, then several heap growths), pop 25, push 10 more: a DFS stack's use.
  for (std::int64_t i = 0; i < 40; ++i) {
    v.push_back(i * i);
    ref.push_back(i * i);
    ASSERT_EQ(v.back(), ref.back()) << i;
  }
  for (int i = 0; i < 25; ++i) {
    v.pop_back();
    ref.pop_back();
  }
  v.back() += 1;  // back() refers to the element itself
  ref.back() += 1;
  for (std::int64_t i = 0; i < 10; ++i) {
    v.push_back(-i);
    ref.push_back(-i);
  }
  EXPECT_EQ(as_vector(v), ref);
  // Pushing one of its own elements while it grows (heap to a larger heap, as ASan checks).
  while (v.size() < 64) {
    v.push_back(v[0]);
    ref.push_back(ref[0]);
  }
  EXPECT_EQ(as_vector(v), ref);
  SmallVector<std::int64_t, 2> w;  // and from inline storage to the heap
  w.push_back(7);
  w.push_back(8);
  w.push_back(w.back());
  EXPECT_EQ(as_vector(w), (std::vector<std::int64_t>{7, 8, 8}));
  while (!v.empty()) v.pop_back();
  EXPECT_EQ(v.size(), 0u);
}

}  // namespace
