// dist/collectives.hpp: every tensor collective against a reference computed here from
// each replica's known input (exact integer arithmetic in a wide type, so the reference
// does not depend on the order the library combines in), for world sizes 1-4 and groups of
// two within four; results bitwise identical on every replica of a group; program order,
// skipped reads, eager mode, the world of one outside spawn. Also run under TSan.
#include "dist_testing.hpp"
#include "testing/env_guard.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <future>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

namespace {

using dist_testing::input;
using dist_testing::ops_for;
using dist_testing::reduce_ref;
using dist_testing::same_bits;
using dist_testing::value;
using dist_testing::Watchdog;
using lazy::ReduceOp;
using lazy::Shape;
using lazy::Tensor;
using lazy::dist::Groups;
namespace dist = lazy::dist;

/// The members of `replica`'s group, in group order.
std::vector<int> group_of(const Groups& groups, int world, int replica) {
  if (groups.empty()) {
    std::vector<int> all;
    for (int i = 0; i < world; ++i) all.push_back(i);
    return all;
  }
  for (const auto& g : groups) {
    if (std::find(g.begin(), g.end(), replica) != g.end()) return g;
  }
  ADD_FAILURE() << "replica " << replica << " in no group";
  return {};
}


std::vector<std::int64_t> unravel(std::int64_t lin, const Shape& s) {
  std::vector<std::int64_t> idx(static_cast<std::size_t>(s.rank()));
  for (int d = s.rank() - 1; d >= 0; --d) {
    idx[static_cast<std::size_t>(d)] = lin % s[d];
    lin /= s[d];
  }
  return idx;
}
std::int64_t ravel(const std::vector<std::int64_t>& idx, const Shape& s) {
  std::int64_t lin = 0;
  for (int d = 0; d < s.rank(); ++d) lin = lin * s[d] + idx[static_cast<std::size_t>(d)];
  return lin;
}

const std::vector<Groups> kGroupsOfTwo = {{{0, 1}, {2, 3}}, {{0, 2}, {1, 3}}, {{3, 1}, {2, 0}}};

template <class T>
class CollectivesTyped : public ::testing::Test {};
using ElementTypes =
    ::testing::Types<float, double, std::int32_t, std::int64_t, lazy::bfloat16, bool>;
TYPED_TEST_SUITE(CollectivesTyped, ElementTypes);

template <class T>
void check_all_reduce(int world, const Groups& groups) {
  const std::vector<std::int64_t> sizes = {0, 1, 7, 129, 5000};  // 5000: read in place
  const auto ops = ops_for<T>();
  std::vector<std::vector<std::vector<T>>> got(static_cast<std::size_t>(world));
  dist::spawn(
      [&](int r) {
        std::vector<Tensor<T>> outs;
        for (std::size_t o = 0; o < ops.size(); ++o) {
          for (auto n : sizes) {
            auto x = lazy::from_vector<T>(input<T>(r, n, static_cast<int>(o)), Shape{n});
            outs.push_back(dist::all_reduce(ops[o], x, {.groups = groups}));
          }
        }
        lazy::mark_step();
        for (const auto& y : outs) got[static_cast<std::size_t>(r)].push_back(y.to_vector());
      },
      world);
  for (int r = 0; r < world; ++r) {
    const auto members = group_of(groups, world, r);
    std::size_t k = 0;
    for (std::size_t o = 0; o < ops.size(); ++o) {
      for (auto n : sizes) {
        std::vector<T> want;
        for (std::int64_t i = 0; i < n; ++i)
          want.push_back(reduce_ref<T>(ops[o], members, i, static_cast<int>(o)));
        EXPECT_TRUE(same_bits(got[static_cast<std::size_t>(r)][k], want))
            << "world " << world << ", groups " << lazy::dist::detail::groups_str(groups)
            << ", replica " << r << ", op " << lazy::reduce_op_name(ops[o]) << ", n " << n;
        ++k;
      }
    }
  }
}

TYPED_TEST(CollectivesTyped, AllReduceMatchesReferenceForEveryOpAndWorldSize) {
  Watchdog dog;
  for (int world = 1; world <= 4; ++world) check_all_reduce<TypeParam>(world, {});
}

TYPED_TEST(CollectivesTyped, AllReduceInGroupsOfTwo) {
  Watchdog dog;
  for (const auto& g : kGroupsOfTwo) check_all_reduce<TypeParam>(4, g);
}

template <class T>
void check_reduce_scatter(int world, const Groups& groups) {
  const int n = groups.empty() ? world : static_cast<int>(groups.front().size());
  const auto ops = ops_for<T>();
  // (shape, scatter_dim): 3 x (2n) along dim 1, (n) x 5000 along dim 0 (read in place).
  const std::vector<std::pair<Shape, int>> cases = {
      {Shape{3, 2 * n}, 1}, {Shape{n, 5000}, 0}, {Shape{2 * n}, -1}};
  std::vector<std::vector<std::vector<T>>> got(static_cast<std::size_t>(world));
  dist::spawn(
      [&](int r) {
        std::vector<Tensor<T>> outs;
        for (auto op : ops) {
          for (const auto& [shape, dim] : cases) {
            auto x = lazy::from_vector<T>(input<T>(r, shape.numel(), 1), shape);
            outs.push_back(dist::reduce_scatter(op, x, 1.0, dim, n, groups));
          }
        }
        lazy::mark_step();
        for (const auto& y : outs) got[static_cast<std::size_t>(r)].push_back(y.to_vector());
      },
      world);
  for (int r = 0; r < world; ++r) {
    const auto members = group_of(groups, world, r);
    const auto rank = std::find(members.begin(), members.end(), r) - members.begin();
    std::size_t k = 0;
    for (auto op : ops) {
      for (const auto& [shape, dim] : cases) {
        const int d = dim < 0 ? dim + shape.rank() : dim;
        Shape out = shape;
        out[d] /= n;
        std::vector<T> want;
        for (std::int64_t j = 0; j < out.numel(); ++j) {
          auto idx = unravel(j, out);
          idx[static_cast<std::size_t>(d)] += rank * out[d];
          want.push_back(reduce_ref<T>(op, members, ravel(idx, shape), 1));
        }
        EXPECT_TRUE(same_bits(got[static_cast<std::size_t>(r)][k], want))
            << "world " << world << ", replica " << r << ", op " << lazy::reduce_op_name(op)
            << ", shape " << shape.str() << ", dim " << dim;
        ++k;
      }
    }
  }
}

TYPED_TEST(CollectivesTyped, ReduceScatterMatchesReference) {
  Watchdog dog;
  for (int world = 1; world <= 4; ++world) check_reduce_scatter<TypeParam>(world, {});
  for (const auto& g : kGroupsOfTwo) check_reduce_scatter<TypeParam>(4, g);
}

// ---- data movement (the kernels work by element size) -------------------------------

template <class T>
void check_all_gather(int world, const Groups& groups) {
  const int n = groups.empty() ? world : static_cast<int>(groups.front().size());
  const std::vector<std::pair<Shape, int>> cases = {{Shape{2, 3}, 0},     {Shape{2, 3}, 1},
                                                    {Shape{2, 3, 4}, -2}, {Shape{}, 0},
                                                    {Shape{0, 3}, 1},     {Shape{5000}, 0}};
  std::vector<std::vector<std::vector<T>>> got(static_cast<std::size_t>(world));
  std::vector<std::vector<Shape>> shapes(static_cast<std::size_t>(world));
  dist::spawn(
      [&](int r) {
        std::vector<Tensor<T>> outs;
        for (const auto& [shape, dim] : cases) {
          auto x = lazy::from_vector<T>(input<T>(r, shape.numel(), 2), shape);
          outs.push_back(dist::all_gather(x, dim, groups));
        }
        lazy::mark_step();
        for (const auto& y : outs) {
          got[static_cast<std::size_t>(r)].push_back(y.to_vector());
          shapes[static_cast<std::size_t>(r)].push_back(y.shape());
        }
      },
      world);
  for (int r = 0; r < world; ++r) {
    const auto members = group_of(groups, world, r);
    for (std::size_t k = 0; k < cases.size(); ++k) {
      const auto& [shape, dim] = cases[k];
      const Shape in = shape.rank() == 0 ? Shape{1} : shape;
      const int d = dim < 0 ? dim + in.rank() : dim;
      Shape out = in;
      out[d] *= n;
      EXPECT_EQ(shapes[static_cast<std::size_t>(r)][k], out) << "case " << k;
      std::vector<T> want;
      for (std::int64_t j = 0; j < out.numel(); ++j) {
        auto idx = unravel(j, out);
        const auto q = idx[static_cast<std::size_t>(d)] / in[d];
        idx[static_cast<std::size_t>(d)] %= in[d];
        want.push_back(value<T>(members[static_cast<std::size_t>(q)], ravel(idx, in), 2));
      }
      EXPECT_TRUE(same_bits(got[static_cast<std::size_t>(r)][k], want))
          << "world " << world << ", replica " << r << ", shape " << shape.str() << ", dim " << dim;
    }
  }
}

template <class T>
void check_all_to_all(int world, const Groups& groups) {
  const int n = groups.empty() ? world : static_cast<int>(groups.front().size());
  struct Case {
    Shape shape;
    int split, concat;
  };
  const std::vector<Case> cases = {{Shape{2 * n, 3}, 0, 1},
                                   {Shape{3, 2 * n}, 1, 0},
                                   {Shape{2, 3 * n, 2}, 1, 1},
                                   {Shape{2, 2, n}, -1, 0},
                                   {Shape{n * 1000, 2}, 0, 0}};  // read in place
  std::vector<std::vector<std::vector<T>>> got(static_cast<std::size_t>(world));
  dist::spawn(
      [&](int r) {
        std::vector<Tensor<T>> outs;
        for (const auto& c : cases) {
          auto x = lazy::from_vector<T>(input<T>(r, c.shape.numel(), 3), c.shape);
          outs.push_back(dist::all_to_all(x, c.split, c.concat, n, groups));
        }
        lazy::mark_step();
        for (const auto& y : outs) got[static_cast<std::size_t>(r)].push_back(y.to_vector());
      },
      world);
  for (int r = 0; r < world; ++r) {
    const auto members = group_of(groups, world, r);
    const auto rank = std::find(members.begin(), members.end(), r) - members.begin();
    for (std::size_t k = 0; k < cases.size(); ++k) {
      const Case& c = cases[k];
      const int s = c.split < 0 ? c.split + c.shape.rank() : c.split;
      const int cc = c.concat < 0 ? c.concat + c.shape.rank() : c.concat;
      Shape chunk = c.shape;
      chunk[s] /= n;
      Shape out = chunk;
      out[cc] *= n;
      std::vector<T> want;
      for (std::int64_t j = 0; j < out.numel(); ++j) {
        auto idx = unravel(j, out);
        const auto q = idx[static_cast<std::size_t>(cc)] / chunk[cc];  // sender
        idx[static_cast<std::size_t>(cc)] %= chunk[cc];
        idx[static_cast<std::size_t>(s)] += rank * chunk[s];  // this replica's chunk of it
        want.push_back(value<T>(members[static_cast<std::size_t>(q)], ravel(idx, c.shape), 3));
      }
      EXPECT_TRUE(same_bits(got[static_cast<std::size_t>(r)][k], want))
          << "world " << world << ", replica " << r << ", case " << k;
    }
  }
}

template <class T>
void check_broadcast(int world, const Groups& groups) {
  std::vector<std::vector<std::vector<T>>> got(static_cast<std::size_t>(world));
  dist::spawn(
      [&](int r) {
        const auto members = group_of(groups, world, r);
        std::vector<Tensor<T>> outs;
        for (int src : {members.front(), members.back()}) {
          for (std::int64_t n : {1, 33, 5000}) {
            outs.push_back(
                dist::broadcast(lazy::from_vector<T>(input<T>(r, n, 4), Shape{n}), src, groups));
          }
        }
        lazy::mark_step();
        for (const auto& y : outs) got[static_cast<std::size_t>(r)].push_back(y.to_vector());
      },
      world);
  for (int r = 0; r < world; ++r) {
    const auto members = group_of(groups, world, r);
    std::size_t k = 0;
    for (int src : {members.front(), members.back()}) {
      for (std::int64_t n : {1, 33, 5000}) {
        EXPECT_TRUE(same_bits(got[static_cast<std::size_t>(r)][k++], input<T>(src, n, 4)))
            << "world " << world << ", replica " << r << ", src " << src << ", n " << n;
      }
    }
  }
}

template <class T>
void check_data_movement() {
  for (int world = 1; world <= 4; ++world) {
    check_all_gather<T>(world, {});
    check_all_to_all<T>(world, {});
    check_broadcast<T>(world, {});
  }
  for (const auto& g : kGroupsOfTwo) {
    check_all_gather<T>(4, g);
    check_all_to_all<T>(4, g);
    check_broadcast<T>(4, g);
  }
}

TYPED_TEST(CollectivesTyped, AllGatherAllToAllAndBroadcastMatchReference) {
  Watchdog dog;
  check_data_movement<TypeParam>();
}

// ---- floating-point specifics ----------------------------------------------------------

TEST(AllReduce, FloatSumIsInRankOrderAndBitwiseIdenticalEverywhere) {
  Watchdog dog;
  // Values whose sums round differently in different orders.
  auto val = [](int r, std::int64_t i) {
    return std::ldexp(1.0f + 0.1f * static_cast<float>(i % 13), r * 9 - 12) / 3.0f;
  };
  for (int world : {3, 4}) {
    for (std::int64_t n : {100, 10000}) {  // copied and read in place
      std::vector<std::vector<float>> got(static_cast<std::size_t>(world));
      dist::spawn(
          [&](int r) {
            std::vector<float> x;
            for (std::int64_t i = 0; i < n; ++i) x.push_back(val(r, i));
            auto y = dist::all_reduce(ReduceOp::Sum, lazy::from_vector<float>(x));
            got[static_cast<std::size_t>(r)] = y.to_vector();
          },
          world);
      std::vector<float> want;
      for (std::int64_t i = 0; i < n; ++i) {
        float acc = val(0, i);
        for (int r = 1; r < world; ++r) acc += val(r, i);
        want.push_back(acc);
      }
      for (int r = 0; r < world; ++r) {
        EXPECT_TRUE(same_bits(got[static_cast<std::size_t>(r)], want))
            << "world " << world << " n " << n << " replica " << r;
      }
    }
  }
}

TEST(AllReduce, Bfloat16AccumulatesInFloatAndRoundsOnce) {
  Watchdog dog;
  // 256 + 1 + 1: rounding after each step gives 256 (257 ties to even), once gives 258.
  auto got = dist::spawn(
      [](int r) {
        auto x =
            lazy::from_vector<lazy::bfloat16>({lazy::bfloat16(r == 0 ? 256.0f : 1.0f)}, Shape{1});
        return static_cast<float>(dist::all_reduce(ReduceOp::Sum, x).item());
      },
      3);
  EXPECT_EQ(got, 258.0f);
}

TEST(Collectives, OnAThreadThatIsNotAReplicaWhileSpawnRunsAreAnError) {
  // Such a thread has no replica context: its collective was a world of one and returned
  // the input unreduced.
  std::vector<float> got(2, 0.0f);
  dist::spawn(
      [&](int r) {
        if (r == 0) {
          auto side = std::async(std::launch::async, [] {
            return dist::all_reduce(ReduceOp::Sum, lazy::from_vector<float>({1.0f})).item();
          });
          EXPECT_THROW(side.get(), lazy::CollectiveError);
          auto host = std::async(std::launch::async, [] { dist::barrier("side"); });
          EXPECT_THROW(host.get(), lazy::CollectiveError);
        }
        got[static_cast<std::size_t>(r)] =
            dist::all_reduce(ReduceOp::Sum, lazy::from_vector<float>({1.0f})).item();
      },
      2);
  EXPECT_EQ(got, (std::vector<float>{2.0f, 2.0f}));
  // After spawn a thread of its own is a world of one again.
  EXPECT_EQ(
      std::async(
          std::launch::async,
          [] { return dist::all_reduce(ReduceOp::Sum, lazy::from_vector<float>({3.0f})).item(); })
          .get(),
      3.0f);
}

TEST(AllReduce, AnOpOutsideTheEnumIsRejected) {
  // (A value read from a configuration: no case of the reduction matched it, and the
  // result was whatever the pool's buffer held.)
  auto t = lazy::from_vector<float>({1.0f, 2.0f});
  EXPECT_THROW((void)dist::all_reduce(static_cast<ReduceOp>(9), t), lazy::Error);
  EXPECT_THROW((void)dist::all_reduce(static_cast<ReduceOp>(-1), t), lazy::Error);
}

TEST(AllReduce, ScaleMultipliesTheReducedValue) {
  Watchdog dog;
  std::vector<std::vector<double>> got(2);
  dist::spawn(
      [&](int r) {
        auto f = dist::all_reduce(ReduceOp::Sum, lazy::from_vector<float>({1.0f + r, 3.0f}),
                                  {.scale = 0.25});
        auto d = dist::all_reduce(ReduceOp::Sum, lazy::from_vector<double>({1.0 + r, 3.0}),
                                  {.scale = 1.0 / 3.0});
        auto b = dist::all_reduce(ReduceOp::Max,
                                  lazy::from_vector<lazy::bfloat16>({lazy::bfloat16(2.0f * r)}),
                                  {.scale = 0.5});
        auto& g = got[static_cast<std::size_t>(r)];
        for (float v : f.to_vector()) g.push_back(v);
        for (double v : d.to_vector()) g.push_back(v);
        g.push_back(static_cast<float>(b.item()));
      },
      2);
  const std::vector<double> want = {3.0 * 0.25, 6.0 * 0.25, 3.0 * (1.0 / 3.0), 6.0 * (1.0 / 3.0),
                                    2.0 * 0.5};
  EXPECT_EQ(got[0], want);
  EXPECT_EQ(got[1], want);
}

TEST(AllReduce, MinMaxPropagateNaN) {
  Watchdog dog;
  const float nan = std::numeric_limits<float>::quiet_NaN();
  auto got = dist::spawn(
      [&](int r) {
        auto x = lazy::from_vector<float>({r == 1 ? nan : 1.0f, 2.0f - r});
        return std::vector<std::vector<float>>{dist::all_reduce(ReduceOp::Min, x).to_vector(),
                                               dist::all_reduce(ReduceOp::Max, x).to_vector()};
      },
      3);
  EXPECT_TRUE(std::isnan(got[0][0]));
  EXPECT_TRUE(std::isnan(got[1][0]));
  EXPECT_EQ(got[0][1], 0.0f);
  EXPECT_EQ(got[1][1], 2.0f);
}

// ---- lists, in place, ordering, skipped reads, eager mode --------------------------------

TEST(AllReduce, CoalescedListAndInPlaceForms) {
  Watchdog dog;
  const std::vector<Shape> shapes = {Shape{3}, Shape{0}, Shape{2, 2},
                                     Shape{4100}};  // 4100 floats: in place
  for (int world : {2, 3}) {
    std::vector<std::vector<std::vector<float>>> got(static_cast<std::size_t>(world)), inplace(got);
    dist::spawn(
        [&](int r) {
          std::vector<Tensor<float>> xs;
          for (std::size_t k = 0; k < shapes.size(); ++k) {
            xs.push_back(lazy::from_vector<float>(
                input<float>(r, shapes[k].numel(), static_cast<int>(k)), shapes[k]));
          }
          auto ys = dist::all_reduce(ReduceOp::Sum, xs);
          auto alias = xs[2];  // shares the tensor object: sees the in-place result
          dist::all_reduce_(ReduceOp::Max, xs);
          for (auto& y : ys) got[static_cast<std::size_t>(r)].push_back(y.to_vector());
          for (auto& x : xs) inplace[static_cast<std::size_t>(r)].push_back(x.to_vector());
          EXPECT_TRUE(same_bits(alias.to_vector(), xs[2].to_vector()));
        },
        world);
    std::vector<int> all;
    for (int i = 0; i < world; ++i) all.push_back(i);
    for (int r = 0; r < world; ++r) {
      for (std::size_t k = 0; k < shapes.size(); ++k) {
        std::vector<float> sum, max;
        for (std::int64_t i = 0; i < shapes[k].numel(); ++i) {
          sum.push_back(reduce_ref<float>(ReduceOp::Sum, all, i, static_cast<int>(k)));
          max.push_back(reduce_ref<float>(ReduceOp::Max, all, i, static_cast<int>(k)));
        }
        EXPECT_TRUE(same_bits(got[static_cast<std::size_t>(r)][k], sum))
            << "replica " << r << " tensor " << k;
        EXPECT_TRUE(same_bits(inplace[static_cast<std::size_t>(r)][k], max))
            << "replica " << r << " tensor " << k;
      }
    }
  }
}

TEST(Collectives, RunInProgramOrderWhateverOrderResultsAreRead) {
  Watchdog dog;
  auto got = dist::spawn(
      [](int r) {
        auto acc = lazy::from_vector<float>({0.0f});
        auto a = dist::all_reduce(ReduceOp::Sum, lazy::from_vector<float>({1.0f + r}));
        auto b = dist::all_reduce(ReduceOp::Max, lazy::from_vector<float>({10.0f * r}));
        acc.add_(b);  // a handle older than both collectives now depends on the later one
        // Replica 0 reads b first, replica 1 reads a first: each replica still runs a
        // before b, so neither waits for the other forever.
        float va = 0, vb = 0;
        if (r == 0) {
          vb = acc.item();
          va = a.item();
        } else {
          va = a.item();
          vb = acc.item();
        }
        return std::vector<float>{va, vb};
      },
      2);
  EXPECT_EQ(got, (std::vector<float>{3.0f, 10.0f}));
}

TEST(Collectives, ResultsNobodyReadsStillTakePart) {
  Watchdog dog;
  std::vector<float> got(3);
  dist::spawn(
      [&](int r) {
        {
          // Replica 1 drops this result before any sync; it must still join the exchange.
          auto dropped = dist::all_reduce(ReduceOp::Sum, lazy::from_vector<float>({1.0f}));
          if (r != 1) got[static_cast<std::size_t>(r)] = dropped.item();
        }
        auto y = dist::all_gather(lazy::from_vector<float>({static_cast<float>(r)}));
        lazy::mark_step();
        if (r == 1) got[1] = y.to_vector()[2];
        // A collective traced and never synced: the replica runs it when its function returns.
        (void)dist::all_reduce(ReduceOp::Sum, lazy::from_vector<float>({2.0f}));
      },
      3);
  EXPECT_EQ(got, (std::vector<float>{3.0f, 2.0f, 3.0f}));
}

TEST(Collectives, EagerModeRunsEachCollectiveAtOnce) {
  Watchdog dog;
  auto got = dist::spawn(
      [](int r) {
        lazy::eager_mode(true);
        auto y = dist::all_reduce(ReduceOp::Sum, lazy::from_vector<std::int32_t>({r, 2 * r}));
        const bool ran = y.node()->materialized();
        lazy::eager_mode(false);
        return std::pair<bool, std::vector<std::int32_t>>{ran, y.to_vector()};
      },
      2);
  EXPECT_TRUE(got.first);
  EXPECT_EQ(got.second, (std::vector<std::int32_t>{1, 2}));
}

TEST(Collectives, ReplicaWorkersSplitLargeReductions) {
  Watchdog dog;
  // 4 threads for 2 replicas: each replica device gets 2 workers and splits its slice.
  const std::int64_t n = 1 << 18;
  std::vector<std::vector<std::int32_t>> got(2);
  std::vector<int> workers(2);
  {
    const lazy_tests::EnvGuard threads("LAZYTENSOR_NUM_THREADS", "4");
    dist::spawn(
        [&](int r) {
          workers[static_cast<std::size_t>(r)] = lazy::graph::current_device().threads().size();
          auto y = dist::all_reduce(ReduceOp::Sum,
                                    lazy::from_vector<std::int32_t>(input<std::int32_t>(r, n)));
          got[static_cast<std::size_t>(r)] = y.to_vector();
        },
        2);
  }
  EXPECT_EQ(workers, (std::vector<int>{2, 2}));
  for (std::int64_t i = 0; i < n; ++i) {
    const auto want = reduce_ref<std::int32_t>(ReduceOp::Sum, {0, 1}, i, 0);
    ASSERT_EQ(got[0][static_cast<std::size_t>(i)], want) << i;
    ASSERT_EQ(got[1][static_cast<std::size_t>(i)], want) << i;
  }
}

TEST(AllReduce, LargeResultsWrittenAroundTheCacheAreExact) {
  Watchdog dog;
  // Inputs and output together >= 32 MiB: the reduced slices use non-temporal stores.
  const std::int64_t n = (std::int64_t{3} << 20) + 5;  // not a multiple of any batch
  std::vector<std::vector<float>> got(2);
  dist::spawn(
      [&](int r) {
        auto y = dist::all_reduce(ReduceOp::Sum, lazy::from_vector<float>(input<float>(r, n)),
                                  {.scale = 0.5});
        got[static_cast<std::size_t>(r)] = y.to_vector();
      },
      2);
  for (std::int64_t i = 0; i < n; ++i) {
    const float want =
        0.5f * static_cast<float>(dist_testing::pattern(0, i, 0) + dist_testing::pattern(1, i, 0));
    ASSERT_EQ(got[0][static_cast<std::size_t>(i)], want) << i;
    ASSERT_EQ(got[1][static_cast<std::size_t>(i)], want) << i;
  }
}

// ---- outside spawn: a world of one -------------------------------------------------------

TEST(Collectives, OutsideSpawnTheWorldIsOneReplica) {
  Watchdog dog;
  auto x = lazy::from_vector<float>({1.0f, 2.0f, 3.0f, 4.0f}, Shape{2, 2});
  EXPECT_EQ(dist::all_reduce(ReduceOp::Sum, x).to_vector(), x.to_vector());
  EXPECT_EQ(dist::all_reduce(ReduceOp::Sum, x, {.scale = 0.5}).to_vector(),
            (std::vector<float>{0.5f, 1, 1.5f, 2}));
  EXPECT_EQ(dist::all_gather(x, 1).shape(), (Shape{2, 2}));
  EXPECT_EQ(dist::reduce_scatter(ReduceOp::Sum, x, 1.0, 0, 1).to_vector(), x.to_vector());
  EXPECT_EQ(dist::all_to_all(x, 0, 1, 1).to_vector(), x.to_vector());
  EXPECT_EQ(dist::broadcast(x, 0, {{0}}).to_vector(), x.to_vector());
  EXPECT_THROW(dist::all_reduce(ReduceOp::Sum, x, {.groups = {{0, 1}}}), lazy::CollectiveError);
  EXPECT_THROW(dist::broadcast(x, 1), lazy::CollectiveError);
}

}  // namespace
