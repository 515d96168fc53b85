#pragma once
// Helpers shared by the lazy::dist tests: a watchdog that turns a hang into a failure, the
// known per-replica inputs the references are computed from, and bitwise comparison.

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include <gtest/gtest.h>

#include <lazytensor/dist.hpp>
#include <lazytensor/ops/factories.hpp>

namespace dist_testing {

/// Ends the process with a message when the test that created it runs longer than `limit`:
/// a hung collective must fail CI, not block it (a blocked thread cannot be cancelled).
class Watchdog {
 public:
  explicit Watchdog(std::chrono::seconds limit = std::chrono::seconds(120)) {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    name_ = info ? std::string(info->test_suite_name()) + "." + info->name() : "?";
    thread_ = std::thread([this, limit] {
      std::unique_lock lock(mu_);
      if (!cv_.wait_for(lock, limit, [this] { return done_; })) {
        std::fprintf(stderr, "watchdog: %s still running after %lld s: a collective hung\n",
                     name_.c_str(), static_cast<long long>(limit.count()));
        std::fflush(stderr);
        std::_Exit(3);
      }
    });
  }
  ~Watchdog() {
    {
      std::lock_guard lock(mu_);
      done_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;

 private:
  std::string name_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  std::thread thread_;
};

/// Sets the collective timeout for one test, then restores the default.
class TimeoutGuard {
 public:
  explicit TimeoutGuard(std::chrono::milliseconds t) { lazy::dist::set_collective_timeout(t); }
  ~TimeoutGuard() { lazy::dist::set_collective_timeout(std::chrono::seconds(300)); }
};

/// Small integers (so sums and products of up to 4 of them are exact in every dtype),
/// different for every replica, element and salt.
inline int pattern(int replica, std::int64_t i, int salt) {
  return static_cast<int>((replica * 7 + i * 3 + salt * 5) % 11) - 5;
}

/// Element i of replica `replica`'s input.
template <class T>
T value(int replica, std::int64_t i, int salt = 0) {
  const int v = pattern(replica, i, salt);
  if constexpr (std::is_same_v<T, bool>)
    return v > 0;
  else
    return static_cast<T>(v);
}

template <class T>
std::vector<T> input(int replica, std::int64_t n, int salt = 0) {
  std::vector<T> v;
  for (std::int64_t i = 0; i < n; ++i) v.push_back(value<T>(replica, i, salt));
  return v;
}

/// Same bytes (floating results must be bitwise identical across replicas).
template <class T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  if (a.size() != b.size()) return false;
  if constexpr (std::is_same_v<T, bool>)
    return a == b;
  else
    return a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

/// The reduce ops defined on T (and/or only on integers and bool).
template <class T>
std::vector<lazy::ReduceOp> ops_for() {
  if constexpr (lazy::is_floating_v<T>)
    return {lazy::ReduceOp::Sum, lazy::ReduceOp::Mul, lazy::ReduceOp::Min, lazy::ReduceOp::Max};
  else
    return {lazy::ReduceOp::Sum, lazy::ReduceOp::Mul, lazy::ReduceOp::And,
            lazy::ReduceOp::Or,  lazy::ReduceOp::Min, lazy::ReduceOp::Max};
}

/// Wide exact type of the reference.
template <class T>
using wide_t = std::conditional_t<std::is_same_v<T, bool>, bool,
                                  std::conditional_t<lazy::is_floating_v<T>, double, std::int64_t>>;

template <class W>
W ref_combine(lazy::ReduceOp op, W a, W b) {
  if constexpr (std::is_same_v<W, bool>) {
    // torch.distributed on bool tensors: sum is a logical or, product a logical and.
    switch (op) {
      case lazy::ReduceOp::Sum:
      case lazy::ReduceOp::Or:
      case lazy::ReduceOp::Max:
        return a || b;
      default:
        return a && b;
    }
  } else {
    switch (op) {
      case lazy::ReduceOp::Sum:
        return a + b;
      case lazy::ReduceOp::Mul:
        return a * b;
      case lazy::ReduceOp::Min:
        return std::min(a, b);
      case lazy::ReduceOp::Max:
        return std::max(a, b);
      case lazy::ReduceOp::And:
        if constexpr (std::is_integral_v<W>) return a & b;
        break;
      case lazy::ReduceOp::Or:
        if constexpr (std::is_integral_v<W>) return a | b;
        break;
    }
    ADD_FAILURE() << "and/or on a floating reference";
    return a;
  }
}

/// Reference reduction of element i over `members` (in wide exact arithmetic).
template <class T>
T reduce_ref(lazy::ReduceOp op, const std::vector<int>& members, std::int64_t i, int salt) {
  using W = wide_t<T>;
  W acc = static_cast<W>(value<T>(members[0], i, salt));
  for (std::size_t k = 1; k < members.size(); ++k)
    acc = ref_combine<W>(op, acc, static_cast<W>(value<T>(members[k], i, salt)));
  return static_cast<T>(acc);
}

/// The message of the exception thrown by f, or "" when it throws none or another type.
template <class E, class F>
std::string message_of(F&& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  } catch (...) {
  }
  return "";
}

}  // namespace dist_testing
