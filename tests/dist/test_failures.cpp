// Failure paths of lazy::dist: mismatched collectives (shapes, ops, dtypes, a skipped
// collective, barrier names), a partner that never arrives (timeout), a replica that fails
// (abort) or returns early (exit), invalid groups and arguments. Each ends with the right
// error class on every replica and nothing hangs (every test has a watchdog, and the
// default 300 s timeout is left in place wherever a failure must be prompt without it).
// Also run under TSan.
#include "dist_testing.hpp"

#include <chrono>
#include <exception>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <typeinfo>
#include <vector>

namespace {

using dist_testing::TimeoutGuard;
using dist_testing::Watchdog;
using lazy::ReduceOp;
using lazy::Shape;
namespace dist = lazy::dist;

/// What each replica caught: "" (nothing), or the class name and message.
struct Caught {
  std::string cls, msg;
};

/// Runs f(r) on `world` replicas; each replica catches lazy::Error and records it.
std::vector<Caught> run_catching(int world, const std::function<void(int)>& f) {
  std::vector<Caught> caught(static_cast<std::size_t>(world));
  dist::spawn(
      [&](int r) {
        auto& c = caught[static_cast<std::size_t>(r)];
        try {
          f(r);
        } catch (const lazy::CollectiveMismatch& e) {
          c = {"CollectiveMismatch", e.what()};
        } catch (const lazy::CollectiveTimeout& e) {
          c = {"CollectiveTimeout", e.what()};
        } catch (const lazy::ReplicaAborted& e) {
          c = {"ReplicaAborted", e.what()};
        } catch (const lazy::CollectiveError& e) {
          c = {"CollectiveError", e.what()};
        } catch (const lazy::Error& e) {
          c = {typeid(e).name(), e.what()};
        }
      },
      world);
  return caught;
}

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

TEST(Mismatch, DifferentShapesFailOnEveryReplicaNamingTheOddOne) {
  Watchdog dog;
  for (std::int64_t big : {1, 5000}) {  // copied and read-in-place paths
    auto caught = run_catching(3, [&](int r) {
      auto x = lazy::from_vector<float>(
          std::vector<float>(static_cast<std::size_t>(big + (r == 2)), 1.0f));
      (void)dist::all_reduce(ReduceOp::Sum, x).to_vector();
    });
    for (const auto& c : caught) {
      EXPECT_EQ(c.cls, "CollectiveMismatch") << c.msg;
      EXPECT_TRUE(contains(c.msg, "replica 2 issued all_reduce(op=sum, dtype=float32, shape=(" +
                                      std::to_string(big + 1) + ",)"))
          << c.msg;
      EXPECT_TRUE(contains(c.msg, "replicas 0, 1 issued all_reduce(op=sum, dtype=float32, shape=(" +
                                      std::to_string(big) + ",)"))
          << c.msg;
    }
  }
}

TEST(Mismatch, DifferentOpsOrDtypesFailOnEveryReplica) {
  Watchdog dog;
  auto ops = run_catching(2, [](int r) {
    (void)dist::all_reduce(r == 0 ? ReduceOp::Sum : ReduceOp::Max, lazy::from_vector<float>({1.0f}))
        .item();
  });
  for (const auto& c : ops) {
    EXPECT_EQ(c.cls, "CollectiveMismatch") << c.msg;
    EXPECT_TRUE(contains(c.msg, "op=sum") && contains(c.msg, "op=max")) << c.msg;
  }
  auto dtypes = run_catching(2, [](int r) {
    if (r == 0)
      (void)dist::all_gather(lazy::from_vector<float>({1.0f})).to_vector();
    else
      (void)dist::all_gather(lazy::from_vector<double>({1.0})).to_vector();
  });
  for (const auto& c : dtypes) {
    EXPECT_EQ(c.cls, "CollectiveMismatch") << c.msg;
    EXPECT_TRUE(contains(c.msg, "float32") && contains(c.msg, "float64")) << c.msg;
  }
}

TEST(Mismatch, ASkippedCollectiveMeetsTheNextOne) {
  Watchdog dog;
  auto caught = run_catching(2, [](int r) {
    if (r == 0) (void)dist::all_reduce(ReduceOp::Sum, lazy::from_vector<float>({1.0f})).item();
    dist::barrier("end");
  });
  for (const auto& c : caught) {
    EXPECT_EQ(c.cls, "CollectiveMismatch") << c.msg;
    EXPECT_TRUE(contains(c.msg, "replica 1 issued barrier('end'")) << c.msg;
    EXPECT_TRUE(contains(c.msg, "replica 0 issued all_reduce(")) << c.msg;
  }
}

TEST(Mismatch, BarrierNamesMustAgree) {
  Watchdog dog;
  auto caught = run_catching(4, [](int r) { dist::barrier(r == 3 ? "late" : "step"); });
  for (const auto& c : caught) {
    EXPECT_EQ(c.cls, "CollectiveMismatch") << c.msg;
    EXPECT_TRUE(contains(c.msg, "replica 3 issued barrier('late'")) << c.msg;
  }
}

TEST(Mismatch, UncaughtMismatchIsRethrownBySpawn) {
  Watchdog dog;
  EXPECT_THROW(
      dist::spawn(
          [](int r) {
            (void)dist::all_reduce(ReduceOp::Sum, lazy::zeros<float>(Shape{r + 1})).to_vector();
          },
          2),
      lazy::CollectiveMismatch);
}

TEST(Timeout, AMissingPartnerTimesOutOnTheWaitersAndTheLateOne) {
  Watchdog dog;
  TimeoutGuard timeout(std::chrono::milliseconds(200));
  auto caught = run_catching(3, [](int r) {
    if (r == 2)
      std::this_thread::sleep_for(
          std::chrono::milliseconds(600));  // arrives after the others gave up
    (void)dist::all_reduce(ReduceOp::Sum, lazy::from_vector<float>({1.0f})).item();
  });
  for (int r = 0; r < 3; ++r) {
    const auto& c = caught[static_cast<std::size_t>(r)];
    EXPECT_EQ(c.cls, "CollectiveTimeout") << "replica " << r << ": " << c.msg;
    EXPECT_TRUE(contains(c.msg, "replica 2")) << c.msg;
  }
  EXPECT_TRUE(
      contains(caught[0].msg + caught[1].msg, "timed out after 0.2 s waiting for replica 2"))
      << caught[0].msg << "\n"
      << caught[1].msg;
}

TEST(Timeout, EnvironmentVariableSetsTheDefault) {
  // The environment is read until set_collective_timeout is called; check the parser.
  ::setenv("LAZYTENSOR_COLLECTIVE_TIMEOUT", "2.5", 1);
  EXPECT_EQ(dist::detail::env_collective_timeout(), std::chrono::milliseconds(2500));
  ::setenv("LAZYTENSOR_COLLECTIVE_TIMEOUT", "soon", 1);
  EXPECT_THROW(dist::detail::env_collective_timeout(), lazy::Error);
  ::setenv("LAZYTENSOR_COLLECTIVE_TIMEOUT", "-1", 1);
  EXPECT_THROW(dist::detail::env_collective_timeout(), lazy::Error);
  ::unsetenv("LAZYTENSOR_COLLECTIVE_TIMEOUT");
  EXPECT_EQ(dist::detail::env_collective_timeout(), std::chrono::seconds(300));
  EXPECT_THROW(dist::set_collective_timeout(std::chrono::milliseconds(0)), lazy::Error);
}

TEST(Timeout, TheLongestTimeoutMeansNever) {
  // milliseconds::max() put the deadline past the clock's range (it wrapped into the past):
  // a partner a few milliseconds late timed out at once.
  Watchdog dog;
  struct Restore {  // (the other tests' timeouts, whatever happens below)
    std::chrono::milliseconds old = dist::collective_timeout();
    ~Restore() { dist::set_collective_timeout(old); }
  } restore;
  dist::set_collective_timeout(std::chrono::milliseconds::max());
  EXPECT_EQ(dist::collective_timeout(), std::chrono::seconds(1'000'000'000));
  std::vector<float> got(2, 0.0f);
  dist::spawn(
      [&](int r) {
        if (r == 1) std::this_thread::sleep_for(std::chrono::milliseconds(30));
        got[static_cast<std::size_t>(r)] =
            dist::all_reduce(ReduceOp::Sum, lazy::from_vector<float>({1.0f})).item();
      },
      2);
  EXPECT_EQ(got, (std::vector<float>{2.0f, 2.0f}));
}

TEST(Abort, AFailingReplicaWakesEveryWaiterAndSpawnRethrowsItsError) {
  Watchdog dog;  // the default 300 s timeout stays: the abort must wake them, not a timeout
  std::vector<std::string> caught(4);
  try {
    dist::spawn(
        [&](int r) {
          if (r == 1) {
            std::this_thread::sleep_for(
                std::chrono::milliseconds(50));  // let the others block first
            throw std::runtime_error("replica one broke");
          }
          try {
            (void)dist::all_reduce(ReduceOp::Sum, lazy::from_vector<float>({1.0f})).item();
          } catch (const lazy::ReplicaAborted& e) {
            caught[static_cast<std::size_t>(r)] = e.what();
            throw;  // an uncaught ReplicaAborted must not replace the original error
          }
        },
        4);
    ADD_FAILURE() << "spawn did not throw";
  } catch (const std::runtime_error& e) {
    EXPECT_STREQ(e.what(), "replica one broke");
    EXPECT_EQ(dynamic_cast<const lazy::Error*>(&e), nullptr)
        << "re-threw a lazy::Error, not the original";
  }
  for (int r : {0, 2, 3}) {
    EXPECT_TRUE(
        contains(caught[static_cast<std::size_t>(r)], "replica 1 failed: replica one broke"))
        << "replica " << r << ": " << caught[static_cast<std::size_t>(r)];
  }
}

TEST(Abort, ReplicasEnteringACollectiveAfterTheFailureAbortToo) {
  Watchdog dog;
  std::vector<std::string> caught(3);
  EXPECT_THROW(dist::spawn(
                   [&](int r) {
                     if (r == 0) throw lazy::ShapeError("bad input on replica 0");
                     std::this_thread::sleep_for(std::chrono::milliseconds(100));
                     try {
                       dist::barrier("b");
                     } catch (const lazy::ReplicaAborted& e) {
                       caught[static_cast<std::size_t>(r)] = e.what();
                     }
                   },
                   3),
               lazy::ShapeError);
  EXPECT_TRUE(contains(caught[1], "replica 0 failed")) << caught[1];
  EXPECT_TRUE(contains(caught[2], "replica 0 failed")) << caught[2];
}

TEST(Exit, AReplicaThatReturnedFailsItsWaitersAtOnce) {
  Watchdog dog;  // default timeout: the exit must be noticed, not waited out
  auto caught = run_catching(3, [](int r) {
    if (r == 2) return;  // leaves without joining
    (void)dist::all_reduce(ReduceOp::Sum, lazy::from_vector<float>({1.0f})).item();
  });
  EXPECT_EQ(caught[2].cls, "");
  for (int r : {0, 1}) {
    EXPECT_EQ(caught[static_cast<std::size_t>(r)].cls, "CollectiveError")
        << caught[static_cast<std::size_t>(r)].msg;
    EXPECT_TRUE(contains(caught[static_cast<std::size_t>(r)].msg, "replica 2 exited"))
        << caught[static_cast<std::size_t>(r)].msg;
  }
}

TEST(Groups, InvalidGroupsAreRejectedWhenTraced) {
  Watchdog dog;
  const std::vector<std::pair<dist::Groups, std::string>> bad = {
      {{{0, 1}, {2}, {3}}, "equal sizes"},
      {{{0, 1}, {1, 2}}, "appears more than once"},
      {{{0, 1}, {2, 4}}, "out of range"},
      {{{0, 1}}, "replica 2 is in no group"},
      {{{}, {}}, "empty"},
  };
  auto caught = run_catching(4, [&](int r) {
    for (const auto& item : bad) {
      const dist::Groups& groups = item.first;
      const std::string& why = item.second;
      const std::string msg = dist_testing::message_of<lazy::CollectiveError>([&] {
        (void)dist::all_reduce(ReduceOp::Sum, lazy::from_vector<float>({1.0f}), {.groups = groups});
      });
      EXPECT_TRUE(contains(msg, why))
          << "replica " << r << ", groups " << dist::detail::groups_str(groups) << ": " << msg;
    }
    // Nothing was exchanged: the replicas still agree on the next collective.
    EXPECT_EQ(dist::all_reduce(ReduceOp::Sum, lazy::from_vector<float>({1.0f})).item(), 4.0f);
  });
  for (const auto& c : caught) EXPECT_EQ(c.cls, "") << c.msg;
}

TEST(Groups, ASkippedGroupCollectiveDoesNotPairWithTheNextCall) {
  Watchdog dog;
  // Replica 1 takes the first all_reduce alone ([[0], [1]]); replica 0 takes it with 1. Both
  // then all-reduce together. Counted per group only, replica 1's second call met replica 0's
  // first and both returned 1 + 20 without a word.
  std::vector<float> got(2, -1.0f);
  auto caught = run_catching(2, [&](int r) {
    const dist::Groups first = r == 0 ? dist::Groups{{0, 1}} : dist::Groups{{0}, {1}};
    got[static_cast<std::size_t>(r)] =
        dist::all_reduce(ReduceOp::Sum, lazy::from_vector<float>({1.0f}), {.groups = first}).item();
    got[static_cast<std::size_t>(r)] =
        dist::all_reduce(ReduceOp::Sum, lazy::from_vector<float>({20.0f}), {.groups = {{0, 1}}})
            .item();
  });
  for (std::size_t r = 0; r < 2; ++r) {
    EXPECT_EQ(caught[r].cls, "CollectiveMismatch")
        << "replica " << r << " got " << got[r] << ": " << caught[r].msg;
    EXPECT_TRUE(contains(caught[r].msg, "replica 1 issued all_reduce(") &&
                contains(caught[r].msg, "the replica's collective #2") &&
                contains(caught[r].msg, "replica 0 issued all_reduce(") &&
                contains(caught[r].msg, "the replica's collective #1"))
        << caught[r].msg;
  }
  EXPECT_EQ(got[1], 1.0f) << "replica 1's group of one returns its own value";
}

TEST(Groups, DifferentPartitionsFailPromptlyInsteadOfTimingOut) {
  Watchdog dog;
  // Replicas 0 and 1 pair as [[0, 1], [2, 3]] says; replicas 2 and 3 wait for them in
  // [[0, 2], [1, 3]]. Before, 2 and 3 waited for the whole timeout.
  TimeoutGuard guard(std::chrono::seconds(60));
  const auto start = std::chrono::steady_clock::now();
  auto caught = run_catching(4, [&](int r) {
    const dist::Groups groups = r < 2 ? dist::Groups{{0, 1}, {2, 3}} : dist::Groups{{0, 2}, {1, 3}};
    (void)dist::all_reduce(ReduceOp::Sum, lazy::from_vector<float>({1.0f}), {.groups = groups})
        .item();
    dist::barrier("after");
  });
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_LT(seconds, 30.0) << "a replica waited for a partner that went to another group";
  for (int r = 2; r < 4; ++r) {
    const auto& c = caught[static_cast<std::size_t>(r)];
    EXPECT_EQ(c.cls, "CollectiveMismatch") << "replica " << r << ": " << c.msg;
    EXPECT_TRUE(contains(c.msg, "replica " + std::to_string(r - 2) + " joined its collective #") &&
                contains(c.msg, "in another group instead of this one"))
        << c.msg;
  }
  // 0 and 1 then wait at the barrier for replicas that caught their error and returned.
  for (int r = 0; r < 2; ++r) {
    const auto& c = caught[static_cast<std::size_t>(r)];
    EXPECT_EQ(c.cls, "CollectiveError") << "replica " << r << ": " << c.msg;
    EXPECT_TRUE(contains(c.msg, "exited")) << c.msg;
  }
}

TEST(Arguments, BadCountsDimensionsAndDevicesAreRejected) {
  Watchdog dog;
  auto caught = run_catching(2, [&](int r) {
    auto x = lazy::from_vector<float>({1, 2, 3}, Shape{3});
    EXPECT_THROW(dist::reduce_scatter(ReduceOp::Sum, x, 1.0, 0, 3),
                 lazy::CollectiveError);  // 3 != group size
    EXPECT_THROW(dist::reduce_scatter(ReduceOp::Sum, x, 1.0, 0, 2),
                 lazy::ShapeError);  // 3 % 2 != 0
    EXPECT_THROW(dist::all_to_all(x, 0, 0, 2), lazy::ShapeError);
    EXPECT_THROW(dist::all_gather(x, 1), lazy::ShapeError);
    EXPECT_THROW(dist::broadcast(x, 5), lazy::CollectiveError);
    EXPECT_THROW(dist::all_reduce(ReduceOp::And, x), lazy::DTypeError);
    EXPECT_THROW(
        dist::all_reduce(ReduceOp::Sum, lazy::from_vector<std::int32_t>({1}), {.scale = 0.5}),
        lazy::DTypeError);
    // A tensor on another replica's device.
    auto other = lazy::from_vector<float>({1.0f}, Shape{1}, lazy::Device(1 - r));
    EXPECT_THROW(dist::all_reduce(ReduceOp::Sum, other), lazy::DeviceError);
    EXPECT_EQ(dist::all_reduce(ReduceOp::Sum, x).to_vector(), (std::vector<float>{2, 4, 6}));
  });
  for (const auto& c : caught) EXPECT_EQ(c.cls, "") << c.msg;
}

TEST(SpawnFailures, RejectsBadNprocsAndNesting) {
  Watchdog dog;
  EXPECT_THROW(dist::spawn([](int) {}, 0), lazy::Error);
  std::string nested;
  dist::spawn(
      [&](int) {
        nested = dist_testing::message_of<lazy::Error>([] { dist::spawn([](int) {}, 1); });
      },
      1);
  EXPECT_TRUE(contains(nested, "nested spawn")) << nested;
}

TEST(SpawnFailures, AGroupThatFailedStaysUnusable) {
  Watchdog dog;
  TimeoutGuard timeout(std::chrono::milliseconds(100));
  auto caught = run_catching(2, [](int r) {
    if (r == 0) {
      EXPECT_THROW((void)dist::all_reduce(ReduceOp::Sum, lazy::from_vector<float>({1.0f})).item(),
                   lazy::CollectiveTimeout);
      dist::barrier("again");  // the group gave up: fails at once instead of mis-pairing
    } else {
      std::this_thread::sleep_for(std::chrono::milliseconds(400));
    }
  });
  EXPECT_EQ(caught[0].cls, "CollectiveTimeout") << caught[0].msg;
  EXPECT_TRUE(contains(caught[0].msg, "can no longer be used")) << caught[0].msg;
  EXPECT_EQ(caught[1].cls, "");
}

}  // namespace
