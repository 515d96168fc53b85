// dist/host_collectives.hpp: barrier, rendezvous (payloads in ordinal order, subsets of
// replicas), mesh_reduce and broadcast_object, inside spawn and in the world of one
// outside it; host and tensor collectives sharing one program order. Also run under TSan.
#include "dist_testing.hpp"

#include <atomic>
#include <cstdint>
#include <numeric>
#include <string>
#include <vector>

namespace {

using dist_testing::Watchdog;
using lazy::ReduceOp;
namespace dist = lazy::dist;

TEST(HostCollectives, BarrierHoldsEveryoneUntilTheLastArrives) {
  Watchdog dog;
  for (int world : {2, 3, 4}) {
    std::atomic<int> before{0};
    std::vector<int> seen(static_cast<std::size_t>(world));
    dist::spawn(
        [&](int r) {
          before.fetch_add(1);
          dist::barrier("phase1");
          seen[static_cast<std::size_t>(r)] = before.load();  // every replica incremented already
          dist::barrier("phase2");
        },
        world);
    for (int v : seen) EXPECT_EQ(v, world);
  }
}

std::string payload_of(int r) {
  // Sizes 0, 3, 20000 (above the inline limit), ...: payloads may differ in size.
  if (r == 0) return "";
  if (r == 2) return std::string(20000, static_cast<char>('a' + r));
  return "p" + std::to_string(r) + std::string(static_cast<std::size_t>(r), '\0');
}

TEST(HostCollectives, RendezvousReturnsEveryPayloadInOrdinalOrder) {
  Watchdog dog;
  for (int world : {1, 2, 3, 4}) {
    std::vector<std::vector<std::string>> got(static_cast<std::size_t>(world));
    dist::spawn(
        [&](int r) { got[static_cast<std::size_t>(r)] = dist::rendezvous("tag", payload_of(r)); },
        world);
    std::vector<std::string> want;
    for (int r = 0; r < world; ++r) want.push_back(payload_of(r));
    for (const auto& g : got) EXPECT_EQ(g, want) << "world " << world;
  }
}

TEST(HostCollectives, RendezvousAmongASubsetOfReplicas) {
  Watchdog dog;
  std::vector<std::vector<std::string>> got(4);
  dist::spawn(
      [&](int r) {
        // {3, 1} take part (listed in any order) while 0 and 2 rendezvous on their own.
        if (r == 1 || r == 3)
          got[static_cast<std::size_t>(r)] = dist::rendezvous("odd", std::to_string(r), {3, 1});
        else
          got[static_cast<std::size_t>(r)] = dist::rendezvous("even", std::to_string(r), {0, 2});
      },
      4);
  EXPECT_EQ(got[0], (std::vector<std::string>{"0", "2"}));
  EXPECT_EQ(got[2], (std::vector<std::string>{"0", "2"}));
  EXPECT_EQ(got[1], (std::vector<std::string>{"1", "3"}));
  EXPECT_EQ(got[3], (std::vector<std::string>{"1", "3"}));
}

TEST(HostCollectives, SubsetRendezvousAndTheWholeWorldKeepLaterCollectivesPaired) {
  Watchdog dog;
  // A rendezvous of chosen replicas is not one every replica joins, so it does not count
  // toward later collectives' agreement; listing every replica is the same call as listing
  // none. Both must leave the next all_reduce paired (no CollectiveMismatch).
  std::vector<float> sums(4, 0.0f);
  dist::spawn(
      [&](int r) {
        (void)dist::rendezvous("pair", "", r < 2 ? std::vector<int>{0, 1} : std::vector<int>{2, 3});
        if (r == 0) {
          (void)dist::rendezvous("all", "");
        } else {
          (void)dist::rendezvous("all", "", {3, 2, 1, 0});
        }
        sums[static_cast<std::size_t>(r)] =
            dist::all_reduce(lazy::ReduceOp::Sum, lazy::from_vector<float>({float(r)})).item();
      },
      4);
  EXPECT_EQ(sums, (std::vector<float>{6.0f, 6.0f, 6.0f, 6.0f}));
}

TEST(HostCollectives, MeshReduceAppliesTheFunctionToEveryValue) {
  Watchdog dog;
  struct Stats {
    double loss;
    std::int64_t count;
  };
  std::vector<double> mean(3);
  std::vector<std::string> joined(3);
  std::vector<std::vector<std::int32_t>> concat(3);
  dist::spawn(
      [&](int r) {
        const auto i = static_cast<std::size_t>(r);
        mean[i] = dist::mesh_reduce("loss", Stats{1.5 * r, r + 1}, [](const std::vector<Stats>& v) {
          double s = 0;
          std::int64_t n = 0;
          for (const auto& x : v) {
            s += x.loss;
            n += x.count;
          }
          return s / static_cast<double>(n);
        });
        joined[i] =
            dist::mesh_reduce("names", std::string(1, static_cast<char>('x' + r)),
                              [](std::vector<std::string> v) { return v[0] + v[1] + v[2]; });
        concat[i] =
            dist::mesh_reduce("ids", std::vector<std::int32_t>(static_cast<std::size_t>(r), r),
                              [](const std::vector<std::vector<std::int32_t>>& v) {
                                std::vector<std::int32_t> all;
                                for (const auto& x : v) all.insert(all.end(), x.begin(), x.end());
                                return all;
                              });
      },
      3);
  for (int r = 0; r < 3; ++r) {
    const auto i = static_cast<std::size_t>(r);
    EXPECT_DOUBLE_EQ(mean[i], (0.0 + 1.5 + 3.0) / 6.0);
    EXPECT_EQ(joined[i], "xyz");
    EXPECT_EQ(concat[i], (std::vector<std::int32_t>{1, 2, 2}));
  }
}

TEST(HostCollectives, BroadcastObjectSendsTheSourceValue) {
  Watchdog dog;
  std::vector<std::int64_t> ints(4);
  std::vector<std::string> strings(4);
  std::vector<std::vector<float>> vecs(4);
  dist::spawn(
      [&](int r) {
        const auto i = static_cast<std::size_t>(r);
        ints[i] = dist::broadcast_object<std::int64_t>(100 + r, 2);
        strings[i] = dist::broadcast_object(std::string("from ") + std::to_string(r));
        vecs[i] =
            dist::broadcast_object(std::vector<float>(static_cast<std::size_t>(r), 0.5f * r), 3);
      },
      4);
  for (std::size_t i = 0; i < 4; ++i) {
    EXPECT_EQ(ints[i], 102);
    EXPECT_EQ(strings[i], "from 0");
    EXPECT_EQ(vecs[i], (std::vector<float>{1.5f, 1.5f, 1.5f}));
  }
}

TEST(HostCollectives, HostAndTensorCollectivesShareOneProgramOrder) {
  Watchdog dog;
  // The all_reduce is still pending when the barrier starts: the barrier runs it first on
  // every replica, so the barrier does not wait for a replica stuck in the all_reduce.
  auto got = dist::spawn(
      [](int r) {
        auto y = dist::all_reduce(ReduceOp::Sum, lazy::from_vector<float>({1.0f + r}));
        if (r == 1) (void)y.item();  // replica 1 runs it before the barrier, replica 0 in it
        dist::barrier("after");
        return y.item();
      },
      2);
  EXPECT_EQ(got, 3.0f);
}

TEST(HostCollectives, OutsideSpawnTheWorldIsOneReplica) {
  Watchdog dog;
  dist::barrier("alone");
  EXPECT_EQ(dist::rendezvous("t", "me"), (std::vector<std::string>{"me"}));
  EXPECT_EQ(
      dist::mesh_reduce("m", 7, [](const std::vector<int>& v) { return v.size() * 10 + v[0]; }),
      17u);
  EXPECT_EQ(dist::broadcast_object(std::string("x")), "x");
  EXPECT_THROW(dist::broadcast_object(1, 1), lazy::CollectiveError);
  EXPECT_THROW(dist::rendezvous("t", "", {0, 1}), lazy::CollectiveError);
}

}  // namespace
