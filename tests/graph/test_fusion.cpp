// The planner and executor of graph/plan.hpp and graph/executor.hpp: cross-statement
// fusion (bitwise equal to running each statement alone), reductions ending fused groups,
// the plan cache, the allocation-free steady state and asynchronous steps.
#include <lazytensor/debug/metrics.hpp>
#include <lazytensor/tensor.hpp>
#include <lazytensor/nn.hpp>
#include <lazytensor/optim.hpp>
#include <lazytensor/ops/factories.hpp>
#include <lazytensor/ops/matmul.hpp>
#include <lazytensor/ops/random.hpp>
#include <lazytensor/ops/reduction.hpp>
#include <lazytensor/tensor.hpp>

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "testing/helpers.hpp"

namespace {

using lazy_tests::counter;
using lazy_tests::EagerGuard;

using lazy::Shape;
using lazy::Tensor;

// The sizes at which groups change strategy (core/tuning.hpp): 32 MiB outputs stream and
// 1 MiB of reads slice by default; the sanitizer builds lower both for this file
// (tests/CMakeLists.txt), and the tests below size their inputs from them.
std::int64_t streaming_bytes() { return lazy::core::tuning().streaming_store_bytes; }
std::int64_t slice_bytes() { return lazy::core::tuning().fusion_slice_bytes; }

template <class T>
bool bitwise_equal(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

class Fusion : public ::testing::Test {
 protected:
  void SetUp() override {
    lazy::mark_step();
    lazy::wait_device_ops();
  }
  void TearDown() override { lazy::set_num_threads(lazy::graph::default_device_threads()); }
};

struct Inputs {
  Tensor<float> a, b, c, d;
  explicit Inputs(std::int64_t n) {
    lazy::set_rng_state(1234);
    a = lazy::randn<float>({n});
    b = lazy::randn<float>({n});
    c = lazy::randn<float>({n});
    d = lazy::rand<float>({n});
    lazy::mark_step();
  }
};

// The three statements; keep = hold t1 and t2 past mark_step.
std::vector<float> three_statements(const Inputs& in, bool keep, std::vector<float>* t1_out = nullptr) {
  Tensor<float> y, k1;
  {
    Tensor<float> t1 = in.a * in.b + in.c;
    Tensor<float> t2 = lazy::relu(t1) * in.d;
    y = t2 - 0.5f * in.a;
    if (keep) k1 = t1;
  }
  lazy::mark_step();
  if (t1_out && keep) *t1_out = k1.to_vector();
  return y.to_vector();
}

TEST_F(Fusion, ThreeStatementsFusedEqualUnfusedBitwise) {
  // Not a multiple of the chunk: the last chunk is partial.
  const std::int64_t n = 3 * 4096 * 5 + 77;
  const Inputs in(n);
  std::vector<float> unfused, t1_unfused;
  {
    EagerGuard eager(true);
    unfused = three_statements(in, true, &t1_unfused);
  }
  const auto fused_before = counter("FusedNodes");
  const auto fused = three_statements(in, false);
  EXPECT_EQ(counter("FusedNodes") - fused_before, 3) << "t1, t2 and y ran as one group";
  EXPECT_TRUE(bitwise_equal(fused, unfused));
  std::vector<float> t1_kept;
  const auto kept = three_statements(in, true, &t1_kept);
  EXPECT_TRUE(bitwise_equal(kept, unfused));
  EXPECT_TRUE(bitwise_equal(t1_kept, t1_unfused)) << "a member something still holds is written whole";
  // And against a scalar loop.
  const auto a = in.a.to_vector(), b = in.b.to_vector(), c = in.c.to_vector(), d = in.d.to_vector();
  for (std::size_t i = 0; i < fused.size(); i += 97) {
    const float t1 = a[i] * b[i] + c[i];
    ASSERT_NEAR(fused[i], std::max(t1, 0.0f) * d[i] - 0.5f * a[i], 1e-5f) << i;
  }
}

// A chain of `statements` dependent statements y = y * 0.5 + x on a chunk and a half, run
// by one mark_step: returns the values and the kernel runs (a group counts as one run).
std::pair<std::vector<float>, std::int64_t> run_chain(const Tensor<float>& x, int statements) {
  const auto runs_before = counter("KernelsRun");
  const auto fused_before = counter("FusedNodes");
  Tensor<float> y = x;
  for (int i = 0; i < statements; ++i) y = y * 0.5f + x;
  lazy::mark_step();
  lazy::wait_device_ops();  // the counters are added when the step has run
  auto values = y.to_vector();
  // Groups of the limit, then the rest; a group of one runs as a single kernel, unfused.
  const int limit = static_cast<int>(lazy::graph::kMaxGroupMembers);
  const int rest = statements % limit;
  EXPECT_EQ(counter("FusedNodes") - fused_before, statements - rest + (rest > 1 ? rest : 0));
  return {std::move(values), counter("KernelsRun") - runs_before};
}

TEST_F(Fusion, LongChainsRunInGroupsOfAtMostTheMemberLimit) {
  const int limit = static_cast<int>(lazy::graph::kMaxGroupMembers);
  lazy::set_rng_state(99);
  Tensor<float> x = lazy::randn<float>({4096 + 2048 + 3});
  lazy::mark_step();
  const auto x0 = x.to_vector();
  for (const int statements : {limit, limit + 1, 200}) {
    const auto [values, runs] = run_chain(x, statements);
    EXPECT_EQ(runs, (statements + limit - 1) / limit) << statements << " statements";
    std::vector<float> ref = x0;  // a scalar loop: each statement rounds to float once
    for (int i = 0; i < statements; ++i)
      for (std::size_t j = 0; j < ref.size(); ++j) {
        const float half = ref[j] * 0.5f;
        ref[j] = half + x0[j];
      }
    EXPECT_TRUE(bitwise_equal(values, ref)) << statements << " statements";
  }
}

TEST_F(Fusion, LargeGroupsStreamTheirOutputsWithTheSameBits) {
  // Whole outputs of at least streaming_bytes() are written with non-temporal stores (y),
  // except those a later member reads (t1 when kept): same bits as unfused either way.
  const std::int64_t n = streaming_bytes() / 4 + 4096 + 13;
  const Inputs in(n);
  std::vector<float> unfused, t1_unfused;
  {
    EagerGuard eager(true);
    unfused = three_statements(in, true, &t1_unfused);
  }
  EXPECT_TRUE(bitwise_equal(three_statements(in, false), unfused));
  std::vector<float> t1_kept;
  EXPECT_TRUE(bitwise_equal(three_statements(in, true, &t1_kept), unfused));
  EXPECT_TRUE(bitwise_equal(t1_kept, t1_unfused));
  const auto a = in.a.to_vector(), b = in.b.to_vector(), c = in.c.to_vector(), d = in.d.to_vector();
  for (std::size_t i = 0; i < unfused.size(); i += 997) {
    const float t1 = a[i] * b[i] + c[i];
    ASSERT_NEAR(unfused[i], std::max(t1, 0.0f) * d[i] - 0.5f * a[i], 1e-5f) << i;
  }
}

// Runs groups of `n` elements reading over slice_bytes() (so they run their chunks in
// slices, fused_group.hpp) fused and unfused, and compares the bits. Covers a partial last slice and
// chunk, a broadcast one-element input, a member of another dtype reading a scratch
// member, a member still held (written whole) and a reduction ending the group, which
// reads a scratch member over whole chunks while the other scratch members hold a slice.
void check_sliced_groups(std::int64_t n) {
  const Inputs in(n);
  const Tensor<float> half = lazy::full<float>({1}, 0.5f);
  lazy::mark_step();
  auto run = [&](Tensor<float>* kept) {
    Tensor<float> y;
    Tensor<double> yd;
    Tensor<float> s;
    {
      Tensor<float> t1 = in.a * in.b + in.c;
      Tensor<float> t2 = lazy::relu(t1) * in.d;
      y = t2 - half * in.a;
      yd = lazy::cast<double>(t2) * 2.0 + 1.0;
      if (kept) *kept = t1;
    }
    lazy::mark_step();
    {  // a step of its own: a group ending in a reduction
      Tensor<float> u = in.a - in.b;
      s = lazy::sum(u * u * in.d);
    }
    lazy::mark_step();
    return std::make_tuple(y.to_vector(), yd.to_vector(), s.item());
  };
  Tensor<float> t1_eager, t1_fused;
  std::tuple<std::vector<float>, std::vector<double>, float> eager;
  {
    EagerGuard guard(true);
    eager = run(&t1_eager);
  }
  for (Tensor<float>* kept : {static_cast<Tensor<float>*>(nullptr), &t1_fused}) {
    const auto sliced_before = counter("SlicedGroups");
    const auto fused = run(kept);
    EXPECT_GE(counter("SlicedGroups") - sliced_before, 2) << "both steps' groups ran sliced";
    EXPECT_TRUE(bitwise_equal(std::get<0>(fused), std::get<0>(eager)));
    EXPECT_TRUE(bitwise_equal(std::get<1>(fused), std::get<1>(eager)));
    EXPECT_EQ(std::get<2>(fused), std::get<2>(eager));
  }
  EXPECT_TRUE(bitwise_equal(t1_fused.to_vector(), t1_eager.to_vector()));
  // Against scalar loops.
  const auto a = in.a.to_vector(), b = in.b.to_vector(), c = in.c.to_vector(), d = in.d.to_vector();
  const auto& [y, yd, s] = eager;
  double sum = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    const float t2 = std::max(a[i] * b[i] + c[i], 0.0f) * d[i];
    ASSERT_NEAR(y[i], t2 - 0.5f * a[i], 1e-5f) << i;
    ASSERT_NEAR(yd[i], double(t2) * 2.0 + 1.0, 1e-5) << i;
    const double u = double(a[i]) - b[i];
    sum += u * u * d[i];
  }
  EXPECT_NEAR(s, sum, 1e-4 * sum);
}

TEST_F(Fusion, GroupsLargerThanL2RunInSlicesWithTheSameBits) {
  // At least twice slice_bytes() of inputs (2 MiB by default), less than streaming_bytes():
  // 256-element slices.
  check_sliced_groups(slice_bytes() / 8 + 4096 * 2 + 37);
}

TEST_F(Fusion, GroupsReadingFromMemoryRunInShorterSlicesWithTheSameBits) {
  // streaming_bytes() of inputs (32 MiB by default): 128-element slices for the first step's
  // group (16 bytes of input per element); the reduction's group reads 12 and stays at 256.
  check_sliced_groups(streaming_bytes() / 16 + 4096 + 200 + 3);
}

TEST_F(Fusion, KeptMembersOfAGroupTooLargeForTheCacheAreStreamedOutWithTheSameBits) {
  // Outputs of streaming_bytes() and more are stored non-temporally; a kept member a later
  // member reads is computed into scratch and copied out per slice (fused_group.hpp). A
  // partial last chunk and a tail of 5 elements (not a whole batch) cover the copy's edges.
  const std::int64_t n = streaming_bytes() / 4 + 4096 + 256 + 5;
  const Inputs in(n);
  auto run = [&] {
    Tensor<float> t1 = in.a * in.b + in.c;
    Tensor<float> t2 = lazy::relu(t1) * in.d;
    Tensor<float> y = t2 - 0.5f * in.a;
    lazy::mark_step();
    return std::make_tuple(t1.to_vector(), t2.to_vector(), y.to_vector());
  };
  std::tuple<std::vector<float>, std::vector<float>, std::vector<float>> eager;
  {
    EagerGuard guard(true);
    eager = run();
  }
  // Fresh buffers for the fused run: recycled ones would still hold the eager values.
  lazy::wait_device_ops();
  lazy::empty_cache();
  const auto sliced_before = counter("SlicedGroups");
  const auto fused = run();
  EXPECT_EQ(counter("SlicedGroups") - sliced_before, 1);
  EXPECT_TRUE(bitwise_equal(std::get<0>(fused), std::get<0>(eager)));
  EXPECT_TRUE(bitwise_equal(std::get<1>(fused), std::get<1>(eager)));
  EXPECT_TRUE(bitwise_equal(std::get<2>(fused), std::get<2>(eager)));
  const auto a = in.a.to_vector(), b = in.b.to_vector(), c = in.c.to_vector(), d = in.d.to_vector();
  const auto& [t1, t2, y] = fused;
  for (std::size_t i = 0; i < a.size(); ++i) {
    const float r1 = a[i] * b[i] + c[i], r2 = std::max(r1, 0.0f) * d[i];
    ASSERT_NEAR(t1[i], r1, 1e-5f * (1 + std::abs(r1))) << i;
    ASSERT_NEAR(t2[i], r2, 1e-5f * (1 + std::abs(r2))) << i;
    ASSERT_NEAR(y[i], r2 - 0.5f * a[i], 1e-5f * (1 + std::abs(r2))) << i;
  }
}

TEST_F(Fusion, FusedResultsDoNotDependOnTheThreadCount) {
  const Inputs in((1 << 18) + 3);
  std::vector<std::vector<float>> ys;
  std::vector<float> sums;
  for (int threads : {1, 2, 3}) {
    lazy::set_num_threads(threads);
    ys.push_back(three_statements(in, false));
    Tensor<float> s;
    {
      Tensor<float> t = in.a * in.b - in.c;
      s = lazy::sum(t * t);
    }
    lazy::mark_step();
    sums.push_back(s.item());
  }
  for (std::size_t i = 1; i < ys.size(); ++i) {
    EXPECT_TRUE(bitwise_equal(ys[i], ys[0])) << i;
    EXPECT_TRUE(bitwise_equal(std::vector<float>{sums[i]}, std::vector<float>{sums[0]})) << sums[i] << " vs " << sums[0];
  }
}

TEST_F(Fusion, ReductionEndsAGroupBitwiseEqualToUnfused) {
  const std::int64_t n = 4096 * 9 + 1001;
  const Inputs in(n);
  auto run = [&](bool keep_t) {
    Tensor<float> s, m, mx, k;
    {
      Tensor<float> t = in.a - in.b;
      Tensor<float> u = t * in.d;
      s = lazy::sum(u * u);
      if (keep_t) k = u;
    }
    {
      Tensor<float> t = lazy::exp(in.c * 0.25f);
      m = lazy::mean(t + in.a);
    }
    {
      Tensor<float> t = in.a * in.c;
      mx = lazy::max(t);
    }
    lazy::mark_step();
    return std::vector<float>{s.item(), m.item(), mx.item()};
  };
  std::vector<float> unfused;
  {
    EagerGuard eager(true);
    unfused = run(false);
  }
  const auto groups_before = counter("FusedNodes");
  const auto fused = run(false);
  EXPECT_EQ(counter("FusedNodes") - groups_before, 3 + 2 + 2) << "each reduction joined its producers' group";
  EXPECT_TRUE(bitwise_equal(fused, unfused)) << fused[0] << " " << unfused[0];
  EXPECT_TRUE(bitwise_equal(run(true), unfused));
  // Against a double-precision loop.
  const auto a = in.a.to_vector(), b = in.b.to_vector(), c = in.c.to_vector(), d = in.d.to_vector();
  double s = 0, m = 0, mx = -1e30;
  for (std::size_t i = 0; i < a.size(); ++i) {
    const double u = (double(a[i]) - b[i]) * d[i];
    s += u * u;
    m += std::exp(double(c[i]) * 0.25) + a[i];
    mx = std::max(mx, double(a[i]) * c[i]);
  }
  EXPECT_NEAR(fused[0], s, 1e-4 * s);
  EXPECT_NEAR(fused[1], m / double(a.size()), 1e-4);
  EXPECT_NEAR(fused[2], mx, 1e-5);
}

TEST_F(Fusion, PlanCacheHitsOnRepeatedStepsAndMissesOnNewShapes) {
  auto step = [](std::int64_t n, float scale) {
    Tensor<float> x = lazy::full<float>({n}, 2.0f);
    Tensor<float> y = lazy::relu(x * scale) + 1.0f;
    Tensor<float> z = lazy::sum(y * y);
    lazy::mark_step();
    return z.item();
  };
  step(1000, 3.0f);
  const auto hit0 = counter("CachedPlan"), miss0 = counter("UncachedPlan");
  EXPECT_FLOAT_EQ(step(1000, 3.0f), 1000 * 49.0f);
  EXPECT_FLOAT_EQ(step(1000, 3.0f), 1000 * 49.0f);
  EXPECT_EQ(counter("CachedPlan") - hit0, 2);
  EXPECT_EQ(counter("UncachedPlan") - miss0, 0);
  // A new scalar value is data, not structure: same plan, new result.
  EXPECT_FLOAT_EQ(step(1000, 1.5f), 1000 * 16.0f);
  EXPECT_EQ(counter("UncachedPlan") - miss0, 0);
  // A new shape is a new plan.
  EXPECT_FLOAT_EQ(step(1001, 3.0f), 1001 * 49.0f);
  EXPECT_EQ(counter("UncachedPlan") - miss0, 1);
  EXPECT_FLOAT_EQ(step(1001, 3.0f), 1001 * 49.0f);
  EXPECT_EQ(counter("UncachedPlan") - miss0, 1);
  EXPECT_EQ(counter("CachedPlan") - hit0, 4);
}

TEST_F(Fusion, WarnsOnceWhenMostStepsNeedANewPlan) {
  // A loop whose shapes change every step: the plan cache cannot help, and the user is
  // told what changed (once per device).
  lazy::graph::current_device().plan_stats() = {};  // not judged on earlier tests' steps
  testing::internal::CaptureStderr();
  for (std::int64_t n = 1; n <= 60; ++n) {
    Tensor<float> y = lazy::full<float>({n}, 1.0f) * 2.0f;
    lazy::mark_step();
  }
  lazy::wait_device_ops();
  const std::string err = testing::internal::GetCapturedStderr();
  EXPECT_NE(err.find("rebuilt its execution plan"), std::string::npos) << err;
  EXPECT_NE(err.find("of shape ("), std::string::npos) << "names the node that changed: " << err;
  std::size_t warnings = 0;
  for (std::size_t p = err.find("lazytensor warning"); p != std::string::npos; p = err.find("lazytensor warning", p + 1))
    ++warnings;
  EXPECT_EQ(warnings, 1u) << err;
}

TEST_F(Fusion, SteadyTrainingLoopAllocatesNoFreshMemory) {
  // Linear regression by gradient descent, a step of a training loop: a GEMM, element-wise
  // statements, a reduction and in-place updates of the parameters.
  lazy::set_rng_state(7);
  const Tensor<float> x = lazy::randn<float>({64, 32});
  const Tensor<float> w_true = lazy::randn<float>({32, 8});
  const Tensor<float> target = lazy::matmul(x, w_true);
  Tensor<float> w = lazy::zeros<float>({32, 8});
  Tensor<float> loss;
  auto& pool = lazy::graph::current_device().pool();
  std::int64_t fresh_after_warmup = -1;
  float first = 0;
  for (int step = 0; step < 12; ++step) {
    {
      Tensor<float> err = lazy::matmul(x, w) - target;
      Tensor<float> grad = lazy::matmul(lazy::transpose(x, 0, 1), err) * (2.0f / 64);
      loss = lazy::mean(err * err);
      w -= 0.05f * grad;
    }
    lazy::mark_step();
    if (step == 0) first = loss.item();
    if (step == 2) {
      lazy::wait_device_ops();
      fresh_after_warmup = pool.stats().fresh_allocations;
    }
  }
  lazy::wait_device_ops();
  EXPECT_EQ(pool.stats().fresh_allocations, fresh_after_warmup) << "steps 4..12 reused pooled buffers only";
  EXPECT_LT(loss.item(), 0.5f * first) << "and the loop does learn";
}

TEST_F(Fusion, SteadyMlpTrainingStepAllocatesNoFreshMemory) {
  // A whole training step (forward, cross entropy, backward, SGD with momentum) of a small
  // MLP: from the third step on, every buffer comes from the pool or is donated.
  namespace nn = lazy::nn;
  lazy::set_rng_state(3);
  nn::Sequential model(nn::Linear(20, 32), nn::ReLU(), nn::Linear(32, 5));
  lazy::optim::SGD opt(model->parameters(), lazy::optim::SGDOptions(0.1).momentum(0.9));
  const Tensor<float> x = lazy::randn<float>({16, 20});
  const Tensor<std::int64_t> y = lazy::randint<std::int64_t>(0, 5, {16});
  auto& pool = lazy::graph::current_device().pool();
  std::int64_t fresh = -1;
  const auto donated0 = counter("DonatedBuffers");
  float first = 0, last = 0;
  for (int step = 0; step < 10; ++step) {
    opt.zero_grad();
    Tensor<float> loss = nn::functional::cross_entropy(model(x), y);
    loss.backward();
    opt.step();
    lazy::mark_step();
    if (step == 0) first = loss.item();
    if (step == 9) last = loss.item();
    if (step == 2) {
      lazy::wait_device_ops();
      fresh = pool.stats().fresh_allocations;
    }
  }
  lazy::wait_device_ops();
  EXPECT_EQ(pool.stats().fresh_allocations, fresh) << "steps 4..10 allocated no new tensor memory";
  EXPECT_GT(counter("DonatedBuffers"), donated0) << "parameters and momenta are updated in place";
  EXPECT_LT(last, first) << "and it trains";
}

// A node that blocks until released: shows that mark_step returns before the step ran.
class GateNode final : public lazy::graph::Node {
 public:
  GateNode(std::shared_ptr<std::atomic<bool>> open, bool fail)
      : Node(lazy::graph::NodeKind::Host, lazy::DType::Float32, Shape{4}, &lazy::graph::current_device()),
        open_(std::move(open)), fail_(fail) {}
  std::string op_name() const override { return "gate"; }
  // A long kernel as far as the planner knows: a step this cheap would run inline.
  double cost_per_element() const override { return 1e9; }

 protected:
  void compute(lazy::graph::ExecContext& ctx) override {
    const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    while (!open_->load() && std::chrono::steady_clock::now() < give_up) std::this_thread::yield();
    if (fail_) throw lazy::Error("gate kernel failed");
    auto buf = allocate_output(ctx, false);
    for (int i = 0; i < 4; ++i) static_cast<float*>(buf->data())[i] = 5.0f;
    set_buffer(std::move(buf));
  }

 private:
  std::shared_ptr<std::atomic<bool>> open_;
  bool fail_;
};

// Turns asynchronous steps on for a test (LAZYTENSOR_ASYNC=0 may have turned them off).
struct AsyncGuard {
  bool saved = lazy::graph::current_device().async();
  AsyncGuard() { lazy::graph::current_device().async() = true; }
  ~AsyncGuard() {
    lazy::wait_device_ops();
    lazy::graph::current_device().async() = saved;
  }
};

TEST_F(Fusion, MarkStepReturnsWhileTheStepRunsAndReadsWait) {
  AsyncGuard async;
  auto open = std::make_shared<std::atomic<bool>>(false);
  Tensor<float> g(lazy::graph::submit(std::make_shared<GateNode>(open, false)));
  Tensor<float> y = g * 2.0f;
  lazy::mark_step();  // would never return if it ran the gate itself
  EXPECT_FALSE(y.node()->materialized());
  // The host traces the next step meanwhile.
  Tensor<float> z = lazy::full<float>({4}, 1.0f) + 1.0f;
  open->store(true);
  EXPECT_EQ(y.to_vector(), std::vector<float>(4, 10.0f));  // the read waits for the step
  EXPECT_EQ(z.to_vector(), std::vector<float>(4, 2.0f));
}

TEST_F(Fusion, TinyStepsRunOnTheCallingThread) {
  AsyncGuard async;
  Tensor<float> y = lazy::full<float>({4}, 1.0f) + 1.0f;
  lazy::mark_step();
  // Cheaper than waking the executor: done when mark_step returns (a large step is not,
  // see MarkStepReturnsWhileTheStepRunsAndReadsWait).
  EXPECT_TRUE(y.node()->materialized());
  EXPECT_EQ(y.to_vector(), std::vector<float>(4, 2.0f));
}

TEST_F(Fusion, AsynchronousErrorsSurfaceAtTheNextRead) {
  AsyncGuard async;
  auto open = std::make_shared<std::atomic<bool>>(false);
  Tensor<float> bad(lazy::graph::submit(std::make_shared<GateNode>(open, true)));
  Tensor<float> y = bad + 1.0f;
  Tensor<float> other = lazy::full<float>({3}, 4.0f) * 2.0f;
  EXPECT_NO_THROW(lazy::mark_step()) << "the error happens on the executor, later";
  open->store(true);
  EXPECT_THROW((void)other.to_vector(), lazy::Error) << "the next read reports it";
  EXPECT_EQ(other.to_vector(), std::vector<float>(3, 8.0f)) << "reported once; the value is still computed";
  EXPECT_FALSE(y.node()->materialized()) << "the failed node stays pending";
  EXPECT_THROW((void)y.to_vector(), lazy::Error) << "and fails again when read: never lost";
  y = other;  // drop the failing graph
  bad = other;
  lazy::mark_step();
  EXPECT_NO_THROW(lazy::wait_device_ops());
}

}  // namespace
