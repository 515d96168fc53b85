// core/tuning.hpp: the runtime's strategy thresholds and their environment overrides. The
// thresholds are read once per process, so CTest runs this file three times
// (tests/CMakeLists.txt): with no variable set, with every variable set to a valid number,
// and with a malformed one; each run checks what its environment asks for.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <optional>
#include <string>

#include <lazytensor/core/thread_pool.hpp>
#include <lazytensor/core/tuning.hpp>
#include <lazytensor/graph/parallel.hpp>

namespace {

// The variable's value when it holds a whole number >= 1 (parsed here without the library),
// nullopt when unset; when it holds anything else, `malformed` takes its name (the first
// such: the library reads the variables in the order the tests below ask for them).
std::optional<long long> valid_value(const char* name, std::string& malformed) {
  const char* env = std::getenv(name);
  if (!env || !*env) return std::nullopt;
  const std::string s = env;
  const bool digits = s.find_first_not_of("0123456789") == std::string::npos;
  if (!digits || s.size() > 18 || std::stoll(s) < 1) {
    if (malformed.empty()) malformed = name;
    return std::nullopt;
  }
  return std::stoll(s);
}

TEST(Tuning, TakesEachThresholdFromTheEnvironmentOrItsDefault) {
  std::string malformed;
  const auto work = valid_value("LAZYTENSOR_PARALLEL_WORK", malformed);
  const auto streaming = valid_value("LAZYTENSOR_STREAMING_STORE_BYTES", malformed);
  const auto slice = valid_value("LAZYTENSOR_FUSION_SLICE_BYTES", malformed);
  if (!malformed.empty()) {
    try {
      (void)lazy::core::tuning();
      ADD_FAILURE() << "a malformed threshold was accepted";
    } catch (const lazy::Error& e) {
      EXPECT_NE(std::string(e.what()).find(malformed + "='"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("not a number"), std::string::npos) << e.what();
    }
    // Still an error on the next read: nothing half-initialised is kept.
    EXPECT_THROW((void)lazy::core::tuning(), lazy::Error);
    return;
  }
  const lazy::core::Tuning& t = lazy::core::tuning();
  // The documented defaults: 2^18 units of work, 32 MiB, 1 MiB.
  EXPECT_EQ(t.parallel_work, static_cast<double>(work.value_or(262144)));
  EXPECT_EQ(t.streaming_store_bytes, streaming.value_or(33554432));
  EXPECT_EQ(t.fusion_slice_bytes, slice.value_or(1048576));
}

TEST(Tuning, TaskCountSplitsFromTheParallelWorkThreshold) {
  std::string malformed;
  const auto work = valid_value("LAZYTENSOR_PARALLEL_WORK", malformed);
  (void)valid_value("LAZYTENSOR_STREAMING_STORE_BYTES", malformed);
  (void)valid_value("LAZYTENSOR_FUSION_SLICE_BYTES", malformed);
  if (!malformed.empty()) {  // (any of them: the thresholds are read together)
    EXPECT_THROW((void)lazy::core::tuning(), lazy::Error);
    return;
  }
  const std::int64_t threshold = work.value_or(262144);
  lazy::ThreadPool pool(2);
  // Below the threshold: one task whatever the pool. At it (and items enough for several
  // tasks of the minimum size): split.
  EXPECT_EQ(lazy::graph::task_count(pool, threshold - 1, 1.0, 1), 1);
  EXPECT_GT(lazy::graph::task_count(pool, threshold, 1.0, 1), 1);
  EXPECT_EQ(lazy::graph::task_count(pool, (threshold + 1) / 2 - 1, 2.0, 1), 1);
  EXPECT_GT(lazy::graph::task_count(pool, (threshold + 1) / 2, 2.0, 1), 1);
}

}  // namespace
