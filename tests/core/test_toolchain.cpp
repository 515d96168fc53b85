// The build's compiler flags (CMakeLists.txt, lazytensor_dev_flags), not a header: GCC 12.2's
// basic-block vectorizer, targeting AVX-512 at -O2, stored std::vector<std::int64_t>{1, 1, 1, 0}
// as four ones (one broadcast of the first value), and test data written as such lists came
// out wrong in some translation units and not in others. The build turns that vectorizer off
// for GCC 12; this fails if the data of a list literal is miscompiled again (it can only on
// an AVX-512 target: scripts/test.sh builds with -march=native, LAZYTENSOR_NATIVE).
#include <cstdint>
#include <vector>

#include <gtest/gtest.h>

#include <lazytensor/ops/factories.hpp>
#include <lazytensor/ops/reduction.hpp>
#include <lazytensor/tensor.hpp>

namespace {

// Out of line, so the values are read from memory, not folded from the literal.
[[gnu::noinline]] std::int64_t weighted_total(const std::vector<std::int64_t>& v) {
  std::int64_t t = 0;
  for (std::size_t i = 0; i < v.size(); ++i) t += v[i] * static_cast<std::int64_t>(i + 1);
  return t;
}

TEST(Toolchain, ListLiteralsKeepEveryValue) {
  const std::vector<std::int64_t> v{1, 1, 1, 0};
  EXPECT_EQ(weighted_total(v), 1 + 2 + 3);
  const std::vector<std::int64_t> w{7, 7, 7, 7, 7, 7, 7, -1};
  EXPECT_EQ(weighted_total(w), 7 * (1 + 2 + 3 + 4 + 5 + 6 + 7) - 8);
  // As the tests write their data: through from_vector.
  const auto t = lazy::from_vector<std::int64_t>({1, 1, 1, 0});
  EXPECT_EQ(lazy::sum(t * lazy::from_vector<std::int64_t>({1, 2, 3, 4})).item(), 1 + 2 + 3);
}

}  // namespace
