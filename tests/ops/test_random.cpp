// Random tensors (include/lazytensor/ops/random.hpp, graph/random_node.hpp): Philox known
// answers, the counter layout, determinism across thread counts, laziness and distribution
// statistics.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>
#include <type_traits>
#include <vector>

#include <lazytensor/debug/metrics.hpp>
#include <lazytensor/core/counters.hpp>
#include <lazytensor/tensor.hpp>
#include <lazytensor/ops/factories.hpp>
#include <lazytensor/ops/random.hpp>

#include "testing/helpers.hpp"

namespace {

using lazy_tests::num;
using lazy_tests::ThreadsGuard;
using lazy_tests::kernels_run;
using lazy_tests::kSizes;

using lazy::Shape;
using lazy::Tensor;

template <class T>
std::vector<double> values(const Tensor<T>& t) {
  std::vector<double> r;
  for (auto v : t.to_vector()) r.push_back(num<T>(v));
  return r;
}

template <class T>
bool bitwise_equal(const Tensor<T>& a, const Tensor<T>& b) {
  if (!(a.shape() == b.shape())) return false;
  return std::memcmp(a.data(), b.data(), static_cast<std::size_t>(a.numel()) * sizeof(T)) == 0;
}

struct Moments {
  double mean = 0, var = 0, min = 0, max = 0;
};
Moments moments(const std::vector<double>& v) {
  Moments m{0, 0, v.empty() ? 0 : v[0], v.empty() ? 0 : v[0]};
  for (double x : v) {
    m.mean += x;
    m.min = std::min(m.min, x);
    m.max = std::max(m.max, x);
  }
  m.mean /= static_cast<double>(v.size());
  for (double x : v) m.var += (x - m.mean) * (x - m.mean);
  m.var /= static_cast<double>(v.size() - 1);
  return m;
}

// ---- Philox ---------------------------------------------------------------------------

TEST(Philox, KnownAnswersFromRandom123) {
  using lazy::ops::philox4x32_10;
  const auto z = philox4x32_10({0u, 0u, 0u, 0u}, {0u, 0u});
  EXPECT_EQ(z, (lazy::ops::PhiloxCounter{0x6627e8d5u, 0xe169c58du, 0xbc57ac4cu, 0x9b00dbd8u}));
  const auto f = philox4x32_10({0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu}, {0xffffffffu, 0xffffffffu});
  EXPECT_EQ(f, (lazy::ops::PhiloxCounter{0x408f276du, 0x41c83b0eu, 0xa20bc7c6u, 0x6d5451fdu}));
  // The third published vector (digits of pi).
  const auto p = philox4x32_10({0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u}, {0xa4093822u, 0x299f31d0u});
  EXPECT_EQ(p, (lazy::ops::PhiloxCounter{0xd16cfe09u, 0x94fdccebu, 0x5001e420u, 0x24126ea1u}));
  static_assert(lazy::ops::philox4x32_10({0u, 0u, 0u, 0u}, {0u, 0u})[0] == 0x6627e8d5u, "usable at compile time");
}

// Element i of a call uses counter offset + i / 4 (32-bit draws) of the captured seed.
TEST(RandomStream, ElementsFollowTheCounterLayout) {
  for (auto n : kSizes) {
    lazy::manual_seed(1234);
    auto a = lazy::rand<float>(Shape{n});
    auto b = lazy::rand<float>(Shape{3});  // starts after a's counters
    const auto key = lazy::ops::philox_key(1234);
    const auto got = a.to_vector();
    ASSERT_EQ(static_cast<std::int64_t>(got.size()), n);
    for (std::int64_t i = 0; i < n; ++i) {
      const auto r = lazy::ops::philox_block(static_cast<std::uint64_t>(i / 4), key);
      EXPECT_EQ(got[i], static_cast<float>(r[i % 4] >> 8) * 0x1p-24f) << "n " << n << " i " << i;
    }
    const auto gb = b.to_vector();
    const std::uint64_t off = static_cast<std::uint64_t>((n + 3) / 4);
    for (int i = 0; i < 3; ++i) {
      EXPECT_EQ(gb[i], static_cast<float>(lazy::ops::philox_block(off, key)[i] >> 8) * 0x1p-24f) << "n " << n;
    }
  }
}

TEST(RandomStream, DeterministicAcrossThreadCounts) {
  auto draw = [](int threads) {
    ThreadsGuard g(threads);
    lazy::manual_seed(42);
    std::vector<Tensor<float>> f{lazy::rand<float>(Shape{300, 1001}), lazy::randn<float>(Shape{300001})};
    std::vector<Tensor<double>> d{lazy::rand<double>(Shape{150001}), lazy::randn<double>(Shape{3, 100001})};
    auto i = lazy::randint<std::int64_t>(-5, 1000, Shape{200003});
    auto bf = lazy::randn<lazy::bfloat16>(Shape{200001});
    auto be = lazy::bernoulli<bool>(0.25, Shape{200001});
    lazy::mark_step();
    return std::make_tuple(f, d, i, bf, be);
  };
  auto [f1, d1, i1, bf1, be1] = draw(1);
  for (int threads : {2, 3, 4}) {
    auto [f2, d2, i2, bf2, be2] = draw(threads);
    for (std::size_t k = 0; k < f1.size(); ++k) EXPECT_TRUE(bitwise_equal(f1[k], f2[k])) << threads;
    for (std::size_t k = 0; k < d1.size(); ++k) EXPECT_TRUE(bitwise_equal(d1[k], d2[k])) << threads;
    EXPECT_TRUE(bitwise_equal(i1, i2)) << threads;
    EXPECT_TRUE(bitwise_equal(bf1, bf2)) << threads;
    EXPECT_TRUE(bitwise_equal(be1, be2)) << threads;
  }
}

TEST(RandomStream, IndependentDrawsDifferAndSeedsReproduce) {
  lazy::manual_seed(7);
  auto a = lazy::rand<float>(Shape{1000});
  auto b = lazy::rand<float>(Shape{1000});
  lazy::mark_step();  // advances the seed
  auto c = lazy::rand<float>(Shape{1000});
  EXPECT_FALSE(bitwise_equal(a, b));
  EXPECT_FALSE(bitwise_equal(a, c));
  EXPECT_FALSE(bitwise_equal(b, c));
  lazy::set_rng_state(7);
  auto a2 = lazy::rand<float>(Shape{1000});
  EXPECT_TRUE(bitwise_equal(a, a2));
  lazy::manual_seed(8);
  EXPECT_FALSE(bitwise_equal(a, lazy::rand<float>(Shape{1000})));
}

TEST(RandomStream, LazyUntilMarkStep) {
  lazy::manual_seed(3);
  const auto before = kernels_run();
  auto a = lazy::rand<float>(Shape{64});
  auto b = lazy::randn<double>(Shape{64});
  auto c = lazy::randint<std::int32_t>(0, 10, Shape{64});
  auto d = lazy::bernoulli<float>(0.5, Shape{64});
  auto e = lazy::bernoulli(lazy::full<float>(Shape{64}, 0.5));
  EXPECT_EQ(kernels_run(), before);
  EXPECT_EQ(a.node()->kind(), lazy::graph::NodeKind::Random);
  EXPECT_EQ(a.node()->op_name(), "rand");
  for (const auto& n : {a.node(), b.node(), c.node(), d.node(), e.node()}) EXPECT_FALSE(n->materialized());
  lazy::mark_step();
  EXPECT_GE(kernels_run(), before + 5);
  for (const auto& n : {a.node(), b.node(), c.node(), d.node(), e.node()}) EXPECT_TRUE(n->materialized());
}

TEST(RandomStream, StructuralHashIgnoresSeedAndOffset) {
  lazy::manual_seed(1);
  auto a = lazy::randn<float>(Shape{8, 8});
  auto b = lazy::randn<float>(Shape{8, 8});  // other offset
  lazy::manual_seed(99);
  auto c = lazy::randn<float>(Shape{8, 8});  // other seed
  EXPECT_EQ(a.node()->structural_hash(), b.node()->structural_hash());
  EXPECT_EQ(a.node()->structural_hash(), c.node()->structural_hash());
  EXPECT_NE(a.node()->structural_hash(), lazy::rand<float>(Shape{8, 8}).node()->structural_hash());
  EXPECT_NE(a.node()->structural_hash(), lazy::randn<float>(Shape{8, 9}).node()->structural_hash());
}

// ---- distributions ------------------------------------------------------------------

template <class T>
class FloatingRandom : public ::testing::Test {};
using FloatingTypes = ::testing::Types<float, double, lazy::bfloat16>;
TYPED_TEST_SUITE(FloatingRandom, FloatingTypes);

TYPED_TEST(FloatingRandom, UniformStatistics) {
  using T = TypeParam;
  lazy::manual_seed(11);
  for (auto n : kSizes) {
    auto v = values(lazy::rand<T>(Shape{n}));
    ASSERT_EQ(static_cast<std::int64_t>(v.size()), n);
    for (double x : v) EXPECT_TRUE(x >= 0.0 && x < 1.0) << x;
  }
  auto m = moments(values(lazy::rand<T>(Shape{1000, 1000})));
  EXPECT_NEAR(m.mean, 0.5, 0.005);
  EXPECT_NEAR(m.var, 1.0 / 12.0, 0.002);
  EXPECT_GE(m.min, 0.0);
  EXPECT_LT(m.max, 1.0);
}

TYPED_TEST(FloatingRandom, NormalStatistics) {
  using T = TypeParam;
  lazy::manual_seed(12);
  for (auto n : kSizes) {
    auto v = values(lazy::randn<T>(Shape{n}));
    ASSERT_EQ(static_cast<std::int64_t>(v.size()), n);
    for (double x : v) EXPECT_TRUE(std::isfinite(x));
  }
  auto v = values(lazy::randn<T>(Shape{1000000}));
  auto m = moments(v);
  EXPECT_NEAR(m.mean, 0.0, 0.005);
  EXPECT_NEAR(m.var, 1.0, 0.01);
  std::int64_t within1 = 0;
  for (double x : v) within1 += std::abs(x) < 1.0;
  EXPECT_NEAR(static_cast<double>(within1) / 1e6, 0.6827, 0.005);  // shape, not just moments
  EXPECT_TRUE(std::isfinite(m.min) && std::isfinite(m.max));
}

TEST(Random, LikeVariantsKeepShapeAndDevice) {
  auto t = lazy::zeros<double>(Shape{3, 5});
  EXPECT_EQ(lazy::rand_like(t).shape(), t.shape());
  EXPECT_EQ(lazy::randn_like(t).device(), t.device());
}

template <class T>
class RandIntTypes : public ::testing::Test {};
using RandIntT = ::testing::Types<std::int32_t, std::int64_t, float, double, lazy::bfloat16>;
TYPED_TEST_SUITE(RandIntTypes, RandIntT);

TYPED_TEST(RandIntTypes, RangeAndUniformity) {
  using T = TypeParam;
  lazy::manual_seed(13);
  for (auto n : kSizes) {
    auto v = values(lazy::randint<T>(-2, 3, Shape{n}));
    ASSERT_EQ(static_cast<std::int64_t>(v.size()), n);
    for (double x : v) EXPECT_TRUE(x >= -2 && x < 3 && x == std::floor(x)) << x;
  }
  auto v = values(lazy::randint<T>(-3, 7, Shape{100000}));
  std::vector<std::int64_t> count(10, 0);
  for (double x : v) {
    ASSERT_TRUE(x >= -3 && x < 7 && x == std::floor(x)) << x;
    count[static_cast<std::size_t>(x + 3)]++;
  }
  for (auto c : count) EXPECT_NEAR(static_cast<double>(c), 10000.0, 500.0);  // ~5 sigma
  auto one = values(lazy::randint<T>(5, 6, Shape{100}));
  for (double x : one) EXPECT_EQ(x, 5.0);
  auto hi = values(lazy::randint<T>(4, Shape{1000}));  // [0, high)
  for (double x : hi) EXPECT_TRUE(x >= 0 && x < 4);
}

TEST(Random, RandIntWideRangesAndBadBounds) {
  lazy::manual_seed(14);
  const std::int64_t lo = std::numeric_limits<std::int64_t>::min(), hi = std::numeric_limits<std::int64_t>::max();
  auto v = lazy::randint<std::int64_t>(lo, hi, Shape{1000}).to_vector();
  std::int64_t negative = 0;
  for (auto x : v) {
    EXPECT_LT(x, hi);
    negative += x < 0;
  }
  EXPECT_NEAR(static_cast<double>(negative), 500.0, 100.0);
  EXPECT_THROW(lazy::randint<std::int64_t>(3, 3, Shape{2}), lazy::Error);
  EXPECT_THROW(lazy::randint<std::int64_t>(4, 3, Shape{2}), lazy::Error);
  EXPECT_THROW(lazy::randint<std::int32_t>(0, std::int64_t{1} << 40, Shape{2}), lazy::Error);
  EXPECT_THROW(lazy::randint<lazy::bfloat16>(0, 1000, Shape{2}), lazy::Error);
  EXPECT_NO_THROW(lazy::randint<std::int32_t>(std::numeric_limits<std::int32_t>::min(),
                                              std::int64_t{std::numeric_limits<std::int32_t>::max()} + 1, Shape{2}));
}

template <class T>
class BernoulliTypes : public ::testing::Test {};
using BernoulliT = ::testing::Types<float, double, std::int32_t, std::int64_t, bool, lazy::bfloat16>;
TYPED_TEST_SUITE(BernoulliTypes, BernoulliT);

TYPED_TEST(BernoulliTypes, FrequencyAndEdges) {
  using T = TypeParam;
  lazy::manual_seed(15);
  for (auto n : kSizes) {
    for (double x : values(lazy::bernoulli<T>(0.0, Shape{n}))) EXPECT_EQ(x, 0.0);
    for (double x : values(lazy::bernoulli<T>(1.0, Shape{n}))) EXPECT_EQ(x, 1.0);
  }
  auto m = moments(values(lazy::bernoulli<T>(0.3, Shape{1000000})));
  EXPECT_NEAR(m.mean, 0.3, 0.005);
  EXPECT_THROW(lazy::bernoulli<T>(-0.1, Shape{2}), lazy::Error);
  EXPECT_THROW(lazy::bernoulli<T>(1.5, Shape{2}), lazy::Error);
  EXPECT_THROW(lazy::bernoulli<T>(std::nan(""), Shape{2}), lazy::Error);
}

TYPED_TEST(FloatingRandom, BernoulliOfProbabilities) {
  using T = TypeParam;
  lazy::manual_seed(16);
  for (auto n : kSizes) {
    std::vector<T> p(static_cast<std::size_t>(2 * n));
    for (std::int64_t i = 0; i < n; ++i) {
      p[2 * i] = T(0.0f);
      p[2 * i + 1] = T(1.0f);
    }
    auto b = values(lazy::bernoulli(lazy::from_vector<T>(p, Shape{n, 2})));
    for (std::int64_t i = 0; i < n; ++i) {
      EXPECT_EQ(b[2 * i], 0.0);
      EXPECT_EQ(b[2 * i + 1], 1.0);
    }
  }
  ThreadsGuard g(4);
  auto probs = lazy::full<T>(Shape{1000, 500}, 0.75);
  auto out = lazy::bernoulli(probs * 1.0f);  // an expression works too
  static_assert(std::is_same_v<decltype(out), Tensor<T>>);
  EXPECT_NEAR(moments(values(out)).mean, 0.75, 0.005);
}

TEST(Random, BernoulliOfBadProbabilitiesRaisesWhenRun) {
  auto p = lazy::from_vector<float>({0.5f, 1.5f, 0.2f});
  {
    auto b = lazy::bernoulli(p);  // lazy: the values are not known yet
    EXPECT_THROW(b.to_vector(), lazy::Error);
  }
  {
    auto b = lazy::bernoulli(lazy::from_vector<double>({-0.5}));
    EXPECT_THROW(
        {
          lazy::mark_step();
          lazy::wait_device_ops();  // an error of an asynchronous step surfaces here
        },
        lazy::Error);
  }
  lazy::mark_step();  // nothing bad left pending
  EXPECT_EQ(p.to_vector()[1], 1.5f);  // the input survived
}

}  // namespace
