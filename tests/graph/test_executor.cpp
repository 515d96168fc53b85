// graph/executor.hpp and the step machinery of device.hpp / tensor.hpp: laziness, what
// mark_step and reads materialize, functionalized in-place ops and buffer donation, eager
// mode, compile, step closures, determinism across thread counts, long chains and error
// paths. Also run under ThreadSanitizer.
#include <lazytensor/debug/metrics.hpp>
#include <lazytensor/tensor.hpp>
#include <lazytensor/ops/factories.hpp>
#include <lazytensor/tensor.hpp>

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "testing/helpers.hpp"

namespace {

using lazy_tests::counter;
using lazy_tests::EagerGuard;

using lazy::Shape;
using lazy::Tensor;

// mark_step runs the step asynchronously; tests that look at counters or node states right
// after it wait for the step to finish.
void step() {
  lazy::mark_step();
  lazy::wait_device_ops();
}

// A test-only kernel that counts how often it runs, then fills its output with `value`
// (or throws). It lets a test see exactly which nodes were computed.
class ProbeNode final : public lazy::graph::Node {
 public:
  ProbeNode(std::shared_ptr<std::atomic<int>> runs, float value, Shape shape,
            std::shared_ptr<std::atomic<bool>> fail = nullptr, std::chrono::milliseconds delay = {})
      : Node(lazy::graph::NodeKind::Host, lazy::DType::Float32, shape,
             &lazy::graph::current_device()),
        runs_(std::move(runs)),
        value_(value),
        fail_(std::move(fail)),
        delay_(delay) {}
  std::string op_name() const override { return "probe"; }

 protected:
  void compute(lazy::graph::ExecContext& ctx) override {
    runs_->fetch_add(1);
    std::this_thread::sleep_for(delay_);
    if (fail_ && fail_->load()) throw lazy::Error("probe kernel failed");
    auto buf = allocate_output(ctx, false);
    float* p = static_cast<float*>(buf->data());
    for (std::int64_t i = 0; i < numel(); ++i) p[i] = value_;
    set_buffer(std::move(buf));
  }

 private:
  std::shared_ptr<std::atomic<int>> runs_;
  float value_;
  std::shared_ptr<std::atomic<bool>> fail_;  // fails while set
  std::chrono::milliseconds delay_;
};

struct Probe {
  std::shared_ptr<std::atomic<int>> runs = std::make_shared<std::atomic<int>>(0);
  // Nodes made with fail = true throw while this is set.
  std::shared_ptr<std::atomic<bool>> failing = std::make_shared<std::atomic<bool>>(true);
  Tensor<float> make(float value, Shape shape = Shape{4}, bool fail = false,
                     std::chrono::milliseconds delay = {}) const {
    return Tensor<float>(lazy::graph::submit(
        std::make_shared<ProbeNode>(runs, value, shape, fail ? failing : nullptr, delay)));
  }
  int count() const { return runs->load(); }
};

bool pending(const auto& t) { return !t.node()->materialized(); }

struct ThreadsGuard {
  ~ThreadsGuard() { lazy::set_num_threads(lazy::graph::default_device_threads()); }
};

// Start every test from a clean step: nothing pending from a previous test.
class Executor : public ::testing::Test {
 protected:
  void SetUp() override { step(); }
};

// ---- laziness -------------------------------------------------------------------------

TEST_F(Executor, NothingRunsBeforeMarkStep) {
  const auto k0 = counter("KernelsRun");
  auto a = lazy::full<float>({3, 5}, 2.0f);
  Tensor<float> b = a + 1;
  Tensor<float> c = lazy::exp(b) * 2;
  b += c;
  EXPECT_EQ(counter("KernelsRun"), k0);
  EXPECT_TRUE(pending(a));
  EXPECT_TRUE(pending(b));
  EXPECT_TRUE(pending(c));
  const auto m0 = counter("MarkStep");
  step();
  EXPECT_EQ(counter("MarkStep"), m0 + 1);
  EXPECT_GT(counter("KernelsRun"), k0);
  EXPECT_FALSE(pending(a));
  EXPECT_FALSE(pending(b));
  EXPECT_FALSE(pending(c));
  const auto s0 = counter("ImplicitSync");
  const float want_c = static_cast<float>(std::exp(3.0) * 2);
  for (float v : c.to_vector()) EXPECT_NEAR(v, want_c, 1e-5 * want_c);
  for (float v : b.to_vector()) EXPECT_NEAR(v, 3 + want_c, 1e-5 * want_c);
  EXPECT_EQ(counter("ImplicitSync"), s0) << "reading materialized tensors is not a sync";
}

TEST_F(Executor, UnreachableNodesAreNeverComputed) {
  Probe dead, live, expr_only;
  {
    Tensor<float> gone = dead.make(1.0f) + 1;  // the handle dies before the step
    Tensor<float> also_gone = gone * 3;
  }
  Tensor<float> kept = live.make(2.0f) * 2;
  auto e = expr_only.make(5.0f) + 1;  // an expression is not a handle: not a root
  const auto k0 = counter("KernelsRun");
  step();
  EXPECT_EQ(dead.count(), 0);
  EXPECT_EQ(live.count(), 1);
  EXPECT_EQ(expr_only.count(), 0);
  EXPECT_EQ(counter("KernelsRun"), k0 + 2) << "the probe and the multiply, nothing else";
  EXPECT_EQ(kept.to_vector(), std::vector<float>(4, 4.0f));
  // The expression still works when it is finally used.
  Tensor<float> late = e;
  EXPECT_EQ(late.to_vector(), std::vector<float>(4, 6.0f));
  EXPECT_EQ(expr_only.count(), 1);
}

TEST_F(Executor, AStepRunsWhatHandlesReachAndKeepsTheRestInOrder) {
  // Needed and unneeded nodes interleaved in the trace: the step runs the needed ones; the
  // others stay traced, producers before consumers, and compute correctly in a later step.
  Probe e1_probe, live1_probe, e2_probe, live2_probe;
  auto e1 = e1_probe.make(1.0f) + 1;  // expressions: not handles
  Tensor<float> l1 = live1_probe.make(2.0f) * 2;
  auto e2 = e2_probe.make(3.0f) + 1;
  Tensor<float> l2 = live2_probe.make(4.0f) * 2 + l1;
  step();
  EXPECT_EQ(e1_probe.count(), 0);
  EXPECT_EQ(e2_probe.count(), 0);
  EXPECT_EQ(live1_probe.count(), 1);
  EXPECT_EQ(live2_probe.count(), 1);
  EXPECT_FALSE(pending(l2));
  EXPECT_EQ(l2.to_vector(), std::vector<float>(4, 12.0f));
  Tensor<float> t2 = e2;
  Tensor<float> t1 = e1;
  Tensor<float> both = t2 * t1;
  step();
  EXPECT_FALSE(pending(both));
  EXPECT_EQ(both.to_vector(), std::vector<float>(4, 8.0f));
  EXPECT_EQ(e1_probe.count(), 1);
  EXPECT_EQ(e2_probe.count(), 1);
  EXPECT_EQ(lazy::graph::current_device().trace_size(), 0u);
}

TEST_F(Executor, ReadMaterializesOnlyWhatItNeeds) {
  Probe p1, p2, shared;
  Tensor<float> y1 = p1.make(1.0f) + 1;
  Tensor<float> y2 = p2.make(2.0f) + 1;
  auto s = shared.make(3.0f);
  Tensor<float> y3 = s * 2;
  Tensor<float> y4 = s + 1;
  const auto sync0 = counter("ImplicitSync");
  EXPECT_EQ(y1.to_vector(), std::vector<float>(4, 2.0f));
  EXPECT_EQ(counter("ImplicitSync"), sync0 + 1);
  EXPECT_EQ(p1.count(), 1);
  EXPECT_EQ(p2.count(), 0);
  EXPECT_TRUE(pending(y2));
  EXPECT_TRUE(pending(y3));
  // Reading again: already there, no sync.
  EXPECT_EQ(y1.to_vector(), std::vector<float>(4, 2.0f));
  EXPECT_EQ(counter("ImplicitSync"), sync0 + 1);
  // A producer shared by two tensors runs once, for the first reader.
  EXPECT_EQ(y3.to_vector(), std::vector<float>(4, 6.0f));
  EXPECT_EQ(counter("ImplicitSync"), sync0 + 2);
  EXPECT_EQ(y4.to_vector(), std::vector<float>(4, 4.0f));
  EXPECT_EQ(counter("ImplicitSync"), sync0 + 3);
  EXPECT_EQ(shared.count(), 1);
  // item() counts as a read too.
  Tensor<float> one = p2.make(7.0f, Shape{1}) * 2;
  EXPECT_EQ(one.item(), 14.0f);
  EXPECT_EQ(counter("ImplicitSync"), sync0 + 4);
  EXPECT_TRUE(pending(y2)) << "untouched by other reads";
  step();
  EXPECT_EQ(y2.to_vector(), std::vector<float>(4, 3.0f));
  EXPECT_EQ(counter("ImplicitSync"), sync0 + 4) << "materialized by mark_step, not by the read";
  EXPECT_EQ(p2.count(), 2);
}

// A loop that only reads (item()) and never calls mark_step must not accumulate the
// trace entries of the values it dropped: each one pins its node's memory.
// A read of one statement whose inputs are all materialized runs it without planning: no
// plan is built or looked up. Its value, KernelsRun and ExecuteTime are as for any run;
// a statement over a pending value still goes through the planner.
TEST_F(Executor, ReadOfOneNodeOverMaterializedInputsSkipsPlanning) {
  Tensor<float> a = lazy::full<float>({1000}, 2.0f), b = lazy::full<float>({1000}, 0.5f);
  step();
  const auto plans = [] { return counter("CachedPlan") + counter("UncachedPlan"); };
  const auto executions = [] {
    const auto d = lazy::debug::metric_data("ExecuteTime");
    return d ? d->count : 0;
  };
  const auto p0 = plans(), k0 = counter("KernelsRun"), e0 = executions();
  Tensor<float> s = lazy::sum(lazy::square(a - b));
  EXPECT_FLOAT_EQ(s.item(), 1000 * 2.25f);
  EXPECT_EQ(plans(), p0);
  EXPECT_EQ(counter("KernelsRun"), k0 + 1);
  EXPECT_EQ(executions(), e0 + 1);

  Tensor<float> c = a * 3.0f;
  Tensor<float> t = lazy::sum(c - b);
  EXPECT_FLOAT_EQ(t.item(), 1000 * 5.5f);
  EXPECT_EQ(plans(), p0 + 1);
  EXPECT_TRUE(c.node()->materialized()) << "the read computed the pending input too";
}

// A statement read as soon as it is built leaves the trace with the read (a step would
// skip it anyway); a node read while newer ones are traced keeps its entry until the next
// step, which does not run it again.
TEST_F(Executor, ReadOfTheNewestNodeTakesItOutOfTheTrace) {
  auto& dev = lazy::graph::current_device();
  const Tensor<float> a = lazy::full<float>({64}, 2.0f);
  step();
  ASSERT_EQ(dev.trace_size(), 0u);
  Tensor<float> s = lazy::sum(a * 3.0f);
  EXPECT_EQ(dev.trace_size(), 1u);
  EXPECT_FLOAT_EQ(s.item(), 384.0f);
  EXPECT_EQ(dev.trace_size(), 0u);

  Probe older_probe, newer_probe;
  Tensor<float> older = older_probe.make(1.0f) + 1;
  Tensor<float> newer = newer_probe.make(5.0f) + 1;
  const auto traced = dev.trace_size();
  EXPECT_EQ(older.to_vector(), std::vector<float>(4, 2.0f));
  EXPECT_EQ(dev.trace_size(), traced) << "not the newest: its entry stays";
  step();
  EXPECT_EQ(newer.to_vector(), std::vector<float>(4, 6.0f));
  EXPECT_EQ(older_probe.count(), 1);
  EXPECT_EQ(newer_probe.count(), 1);
  EXPECT_EQ(dev.trace_size(), 0u);
}

// The same read path on failure: the node stays pending and traced, fails again when read
// again, and mark_step still runs it (and reports the error).
TEST_F(Executor, FailedReadOfOneNodeLeavesItPending) {
  Probe bad;
  Tensor<float> x = bad.make(1.0f, Shape{4}, /*fail=*/true);
  EXPECT_THROW((void)x.to_vector(), lazy::Error);
  EXPECT_TRUE(x.node()->pending());
  EXPECT_THROW((void)x.to_vector(), lazy::Error);
  EXPECT_EQ(bad.count(), 2);
  EXPECT_THROW(
      {
        step();
        lazy::wait_device_ops();
      },
      lazy::Error);
  EXPECT_EQ(bad.count(), 3);
  EXPECT_TRUE(x.node()->pending());
}

TEST_F(Executor, ReadingWithoutMarkStepKeepsTheTraceBounded) {
  auto& dev = lazy::graph::current_device();
  step();
  const Tensor<float> a = lazy::full<float>({64}, 1.5f), b = lazy::full<float>({64}, 0.5f);
  step();
  {  // a long step first: its trace must not leave a high pruning threshold behind
    Tensor<float> t = a;
    for (int i = 0; i < 20000; ++i) t = t + 1.0f;
    step();
  }
  const Tensor<float> kept = a * 3;  // a pending value still wanted stays traced throughout
  constexpr int kReads = 20000;
  double total = 0;
  for (int i = 0; i < kReads; ++i) {
    Tensor<float> s = lazy::sum((a - b) * float(i % 3));
    total += s.item();
  }
  EXPECT_DOUBLE_EQ(total, 64.0 * (kReads / 3 * 3 + (kReads % 3 == 2 ? 1 : 0)));
  // Each read-and-dropped sum left a dead entry at the back, which the next statement
  // reused: only `kept` and the last sum remain (pruning alone would allow ~1000).
  EXPECT_LE(dev.trace_size(), 2u);
  EXPECT_TRUE(pending(kept));
  {  // a dead entry behind a live one is left for pruning: the live one keeps its place
    std::optional<Tensor<float>> dropped(a + 1.0f);
    const Tensor<float> live = a + 2.0f;
    dropped.reset();
    const Tensor<float> later = a + 3.0f;
    step();
    EXPECT_EQ(live.to_vector(), std::vector<float>(64, 3.5f));
    EXPECT_EQ(later.to_vector(), std::vector<float>(64, 4.5f));
    EXPECT_FALSE(pending(kept));
  }
  step();
  EXPECT_EQ(kept.to_vector(), std::vector<float>(64, 4.5f));
  EXPECT_EQ(dev.trace_size(), 0u);
}

// A read orders the pending nodes it needs by a traversal that remembers the nodes it met
// in a short inline list, then in a hash set: both sizes must list every node once,
// producers first. Checked against a recursive traversal with std::set, on a lattice
// where each statement reads the two before it (every node is reached many times).
TEST_F(Executor, ReadOrderListsEachPendingNodeOnceProducersFirst) {
  for (int len : {3, 15, 16, 17, 60}) {
    SCOPED_TRACE("statements: " + std::to_string(len));
    const Tensor<float> x0 = lazy::full<float>({8}, 1.0f), x1 = lazy::full<float>({8}, 2.0f);
    step();
    std::vector<Tensor<float>> t{x0, x1};
    std::vector<float> ref{1.0f, 2.0f};
    for (int i = 2; i < len + 2; ++i) {
      t.push_back(t[i - 1] * 0.5f + t[i - 2]);
      ref.push_back(ref[i - 1] * 0.5f + ref[i - 2]);
    }
    const lazy::graph::NodeList roots{t.back().node(), t[t.size() / 2].node(),
                                                  x0.node()};

    std::set<const lazy::graph::Node*> want;
    std::function<void(const lazy::graph::NodePtr&)> visit = [&](const lazy::graph::NodePtr& n) {
      if (!n->pending() || !want.insert(n.get()).second) return;
      for (const auto& in : n->inputs()) visit(in);
    };
    for (const auto& r : roots) visit(r);

    const auto order = lazy::graph::topological_order(roots);
    ASSERT_EQ(order.size(), want.size());
    EXPECT_EQ(want.size(), static_cast<std::size_t>(len))
        << "one node per statement, the inputs materialized";
    std::set<const lazy::graph::Node*> before;
    for (const auto& n : order) {
      EXPECT_TRUE(want.count(n.get())) << "a node the roots do not need";
      for (const auto& in : n->inputs()) {
        if (in->pending()) {
          EXPECT_TRUE(before.count(in.get())) << "a consumer listed before its producer";
        }
      }
      EXPECT_TRUE(before.insert(n.get()).second) << "a node listed twice";
    }
    // Relative bound: the kernel may contract a*0.5 + b into one FMA, the reference does not.
    for (float v : t.back().to_vector()) EXPECT_NEAR(v, ref.back(), 1e-5 * std::abs(ref.back()));
  }
}

TEST_F(Executor, MarkStepMaterializesEveryLivePendingTensor) {
  Probe p;
  std::vector<Tensor<float>> ts;
  for (int i = 0; i < 20; ++i) ts.push_back(p.make(static_cast<float>(i)) * 2 + 1);
  auto chained = ts[3];
  chained += ts[4];        // in-place on a copy: ts[3] sees it too
  Tensor<double> other = lazy::full<double>({2, 2}, 0.5) * 4;
  const auto k0 = counter("KernelsRun");
  step();
  for (const auto& t : ts) EXPECT_FALSE(pending(t));
  EXPECT_FALSE(pending(other));
  EXPECT_EQ(p.count(), 20);
  const auto after = counter("KernelsRun");
  // 20 probes, then the element-wise work (41 statements of one size: fused groups).
  EXPECT_GE(after - k0, 20 + 1);
  // Nothing left: another step runs no kernel.
  step();
  EXPECT_EQ(counter("KernelsRun"), after);
  const auto sync0 = counter("ImplicitSync");
  for (int i = 0; i < 20; ++i) {
    const float want = i == 3 ? (3 * 2 + 1) + (4 * 2 + 1) : static_cast<float>(i * 2 + 1);
    EXPECT_EQ(ts[i].to_vector(), std::vector<float>(4, want)) << i;
  }
  EXPECT_EQ(other.to_vector(), std::vector<double>(4, 2.0));
  EXPECT_EQ(counter("ImplicitSync"), sync0);
}

TEST_F(Executor, SyncIsMarkStepAndAdvancesRng) {
  const auto seed0 = lazy::get_rng_state();
  const auto m0 = counter("MarkStep");
  Tensor<float> t = lazy::full<float>({2}, 1.0f) + 1;
  lazy::sync();
  lazy::wait_device_ops();
  EXPECT_EQ(counter("MarkStep"), m0 + 1);
  EXPECT_FALSE(pending(t));
  EXPECT_NE(lazy::get_rng_state(), seed0);
  lazy::wait_device_ops();  // nothing stored: returns
}

// ---- in-place ops ---------------------------------------------------------------------

TEST_F(Executor, InPlaceOpsAreFunctionalized) {
  const std::vector<float> init{1, -2, 3, 8};
  const auto x = lazy::from_vector<float>({2, 4, -1, 0.5f}, Shape{4});
  struct Case {
    const char* name;
    std::function<void(Tensor<float>&)> op;
    std::function<float(float, float)> ref;  // (old value, x)
  };
  const std::vector<Case> cases = {
      {"add_", [&](Tensor<float>& t) { t.add_(x); }, [](float v, float w) { return v + w; }},
      {"add_ alpha", [&](Tensor<float>& t) { t.add_(x, 0.5f); }, [](float v, float w) { return v + w * 0.5f; }},
      {"sub_", [&](Tensor<float>& t) { t.sub_(x); }, [](float v, float w) { return v - w; }},
      {"mul_", [&](Tensor<float>& t) { t.mul_(x); }, [](float v, float w) { return v * w; }},
      {"div_", [&](Tensor<float>& t) { t.div_(x); }, [](float v, float w) { return v / w; }},
      {"copy_", [&](Tensor<float>& t) { t.copy_(x); }, [](float, float w) { return w; }},
      {"zero_", [&](Tensor<float>& t) { t.zero_(); }, [](float, float) { return 0.0f; }},
      {"fill_", [&](Tensor<float>& t) { t.fill_(2.5); }, [](float, float) { return 2.5f; }},
      {"+=", [&](Tensor<float>& t) { t += x; }, [](float v, float w) { return v + w; }},
      {"-=", [&](Tensor<float>& t) { t -= x; }, [](float v, float w) { return v - w; }},
      {"*=", [&](Tensor<float>& t) { t *= x; }, [](float v, float w) { return v * w; }},
      {"/=", [&](Tensor<float>& t) { t /= x; }, [](float v, float w) { return v / w; }},
      {"+= scalar", [&](Tensor<float>& t) { t += 3; }, [](float v, float) { return v + 3; }},
      {"*= expr", [&](Tensor<float>& t) { t *= x * 2 - 1; }, [](float v, float w) { return v * (w * 2 - 1); }},
  };
  const auto xv = x.to_vector();
  for (const auto& c : cases) {
    for (bool materialized : {false, true}) {
      Tensor<float> t = lazy::from_vector<float>(init, Shape{4}) * 1;  // pending
      if (materialized) step();
      Tensor<float> copy = t;  // shares the tensor object
      const auto old_node = t.node();
      const auto k0 = counter("KernelsRun");
      c.op(t);
      EXPECT_EQ(counter("KernelsRun"), k0) << c.name << ": in-place ops are lazy too";
      EXPECT_NE(t.node(), old_node) << c.name << ": rebound to a new node";
      EXPECT_EQ(copy.node(), t.node()) << c.name << ": every copy of the handle sees it";
      EXPECT_EQ(t.shape(), Shape{4});
      std::vector<float> want;
      for (int i = 0; i < 4; ++i) want.push_back(c.ref(init[i], xv[i]));
      EXPECT_EQ(copy.to_vector(), want) << c.name << (materialized ? " (materialized)" : " (pending)");
      EXPECT_EQ(t.to_vector(), want) << c.name;
    }
  }
}

TEST_F(Executor, InPlaceOnOtherDtypes) {
  auto i = lazy::from_vector<std::int32_t>({1, 2, 3}, Shape{3});
  i += lazy::from_vector<std::int64_t>({10, 20, 30}, Shape{3});  // int64 result into int32: allowed
  i *= 2;
  EXPECT_EQ(i.to_vector(), (std::vector<std::int32_t>{22, 44, 66}));
  auto h = lazy::from_vector<lazy::bfloat16>({lazy::bfloat16(1.0f), lazy::bfloat16(2.0f)}, Shape{2});
  h += lazy::from_vector<float>({0.5f, 0.25f}, Shape{2});  // float result into bf16: allowed
  EXPECT_EQ(float(h.to_vector()[0]), 1.5f);
  EXPECT_EQ(float(h.to_vector()[1]), 2.25f);
  // copy_ converts, like torch's copy_: float into int truncates toward zero.
  auto j = lazy::zeros<std::int32_t>({4});
  j.copy_(lazy::from_vector<float>({1.9f, -1.9f, 0.5f, 7.0f}, Shape{4}));
  EXPECT_EQ(j.to_vector(), (std::vector<std::int32_t>{1, -1, 0, 7}));
  auto b = lazy::zeros<bool>({3});
  b.copy_(lazy::from_vector<float>({0.0f, -2.0f, 0.1f}, Shape{3}));
  EXPECT_EQ(b.to_vector(), (std::vector<bool>{false, true, true}));
  // copy_ broadcasts its source.
  auto m = lazy::zeros<double>({2, 3});
  m.copy_(lazy::from_vector<double>({1, 2, 3}, Shape{3}));
  EXPECT_EQ(m.to_vector(), (std::vector<double>{1, 2, 3, 1, 2, 3}));
}

TEST_F(Executor, WrongDtypeInPlaceThrowsDTypeError) {
  auto i = lazy::from_vector<std::int32_t>({1, 2, 3}, Shape{3});
  const auto f = lazy::from_vector<float>({0.5f, 1.5f, 2.5f}, Shape{3});
  const auto node = i.node();
  EXPECT_THROW(i += f, lazy::DTypeError);
  EXPECT_THROW(i.add_(f), lazy::DTypeError);
  EXPECT_THROW(i *= 0.5, lazy::DTypeError);  // weak float scalar: float result
  EXPECT_THROW(i /= 2, lazy::DTypeError);    // true division: float result
  EXPECT_THROW(i.div_(i), lazy::DTypeError);
  EXPECT_THROW(i.sub_(lazy::exp(i)), lazy::DTypeError);
  try {
    i.mul_(f);
    ADD_FAILURE() << "no exception";
  } catch (const lazy::DTypeError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("float32"), std::string::npos) << m;
    EXPECT_NE(m.find("int32"), std::string::npos) << m;
    EXPECT_NE(m.find("mul_"), std::string::npos) << m;
  }
  EXPECT_EQ(i.node(), node) << "a rejected in-place op leaves the tensor untouched";
  EXPECT_EQ(i.to_vector(), (std::vector<std::int32_t>{1, 2, 3}));
  // Integer or float results into bool (torch: "result type Long can't be cast to Bool").
  auto b = lazy::from_vector<bool>({true, false}, Shape{2});
  EXPECT_THROW(b += 1, lazy::DTypeError);
  EXPECT_THROW(b *= 2.0, lazy::DTypeError);
  EXPECT_NO_THROW(b.mul_(b));  // bool result: fine
  EXPECT_EQ(b.to_vector(), (std::vector<bool>{true, false}));
  // DTypeError is a lazy::Error.
  EXPECT_THROW(i += f, lazy::Error);
}

TEST_F(Executor, ShapeMismatchInPlaceThrowsShapeError) {
  auto a = lazy::from_vector<float>({1, 2, 3}, Shape{3});
  const auto node = a.node();
  EXPECT_THROW(a += lazy::zeros<float>({4}), lazy::ShapeError);    // not broadcastable at all
  EXPECT_THROW(a += lazy::zeros<float>({2, 3}), lazy::ShapeError); // would grow the output
  EXPECT_THROW(a.copy_(lazy::zeros<float>({2, 3})), lazy::ShapeError);
  EXPECT_THROW(a.mul_(lazy::zeros<float>({3, 1})), lazy::ShapeError);
  try {
    a.sub_(lazy::zeros<float>({2, 3}));
    ADD_FAILURE() << "no exception";
  } catch (const lazy::ShapeError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("(3,)"), std::string::npos) << m;
    EXPECT_NE(m.find("(2, 3)"), std::string::npos) << m;
    EXPECT_NE(m.find("sub_"), std::string::npos) << m;
  }
  EXPECT_EQ(a.node(), node);
  // Broadcasting into the output's shape is fine.
  auto m = lazy::zeros<float>({2, 3});
  m += a;
  m += lazy::scalar_tensor<float>(1.0f);
  EXPECT_EQ(m.to_vector(), (std::vector<float>{2, 3, 4, 2, 3, 4}));
}

// ---- buffer donation ------------------------------------------------------------------

const void* data_ptr(const Tensor<float>& t) { return t.node()->buffer()->data(); }

TEST_F(Executor, InPlaceUpdateDonatesTheOnlyReference) {
  auto w = lazy::from_vector<float>({1, 2, 3, 4}, Shape{4});
  const auto g = lazy::from_vector<float>({10, 20, 30, 40}, Shape{4});
  const void* p = data_ptr(w);
  const auto d0 = counter("DonatedBuffers");
  w -= 0.5f * g;
  step();
  EXPECT_EQ(counter("DonatedBuffers"), d0 + 1);
  EXPECT_EQ(data_ptr(w), p) << "updated in place";
  EXPECT_EQ(w.to_vector(), (std::vector<float>{-4, -8, -12, -16}));
  EXPECT_EQ(g.to_vector(), (std::vector<float>{10, 20, 30, 40}));
  // Copies of the handle share the tensor object, so they do not keep the old value.
  auto alias = w;
  w += 1;
  step();
  EXPECT_EQ(counter("DonatedBuffers"), d0 + 2);
  EXPECT_EQ(data_ptr(w), p);
  EXPECT_EQ(alias.to_vector(), (std::vector<float>{-3, -7, -11, -15}));
}

TEST_F(Executor, NoDonationWhileAnotherHandleHoldsTheOldValue) {
  auto w = lazy::from_vector<float>({1, 2, 3, 4}, Shape{4});
  const void* p = data_ptr(w);
  Tensor<float> old(w.node());  // another tensor object on the same value
  const auto d0 = counter("DonatedBuffers");
  w += 1;
  step();
  EXPECT_EQ(counter("DonatedBuffers"), d0);
  EXPECT_NE(data_ptr(w), p);
  EXPECT_EQ(w.to_vector(), (std::vector<float>{2, 3, 4, 5}));
  EXPECT_EQ(old.to_vector(), (std::vector<float>{1, 2, 3, 4}));
}

TEST_F(Executor, NoDonationWhileALiveExpressionHoldsTheOldValue) {
  auto w = lazy::from_vector<float>({1, 2, 3, 4}, Shape{4});
  const void* p = data_ptr(w);
  auto e = w * 2;  // captures the old value
  const auto d0 = counter("DonatedBuffers");
  w.mul_(10);
  step();
  EXPECT_EQ(counter("DonatedBuffers"), d0);
  EXPECT_NE(data_ptr(w), p);
  EXPECT_EQ(w.to_vector(), (std::vector<float>{10, 20, 30, 40}));
  Tensor<float> r = e;
  EXPECT_EQ(r.to_vector(), (std::vector<float>{2, 4, 6, 8}));
}

TEST_F(Executor, PendingConsumerOfTheOldValueStaysCorrect) {
  // A pending consumer of the old value and the in-place update run in the same step:
  // whichever runs first, the consumer sees the old value and the update the new one.
  for (bool use_copy : {false, true}) {
    auto w = lazy::from_vector<float>({1, 2, 3, 4}, Shape{4});
    Tensor<float> before = w * 3;
    if (use_copy) w.copy_(lazy::zeros<float>({4}));
    else w.add_(100);
    Tensor<float> after = w * 3;
    step();
    EXPECT_EQ(before.to_vector(), (std::vector<float>{3, 6, 9, 12}));
    EXPECT_EQ(after.to_vector(), use_copy ? std::vector<float>(4, 0.0f) : (std::vector<float>{303, 306, 309, 312}));
  }
}

TEST_F(Executor, ChainOfPendingInPlaceUpdatesDonates) {
  auto w = lazy::from_vector<float>(std::vector<float>(1000, 1.0f), Shape{1000});
  const void* p = data_ptr(w);
  const auto d0 = counter("DonatedBuffers");
  for (int i = 0; i < 5; ++i) w += 1;
  step();
  EXPECT_GE(counter("DonatedBuffers"), d0 + 1);
  EXPECT_EQ(data_ptr(w), p) << "the first update donates, later ones reuse its output";
  EXPECT_EQ(w.to_vector(), std::vector<float>(1000, 6.0f));
}

// ---- eager mode, compile, step closures ------------------------------------------------

TEST_F(Executor, EagerModeRunsEachNodeAtOnce) {
  {
    EagerGuard eager(true);
    EXPECT_TRUE(lazy::is_eager_mode());
    auto k = counter("KernelsRun");
    auto a = lazy::full<float>({8}, 3.0f);
    EXPECT_FALSE(pending(a));
    EXPECT_EQ(counter("KernelsRun"), k + 1);
    Tensor<float> b = a * a + 1;
    EXPECT_FALSE(pending(b));
    EXPECT_EQ(counter("KernelsRun"), k + 2);
    b -= a;
    EXPECT_FALSE(pending(b));
    EXPECT_EQ(counter("KernelsRun"), k + 3);
    const auto sync0 = counter("ImplicitSync");
    EXPECT_EQ(b.to_vector(), std::vector<float>(8, 7.0f));
    EXPECT_EQ(counter("ImplicitSync"), sync0);
    EXPECT_THROW((void)(a + lazy::zeros<float>({3})), lazy::ShapeError);
  }
  EXPECT_FALSE(lazy::is_eager_mode());
  Tensor<float> c = lazy::full<float>({8}, 1.0f) + 1;
  EXPECT_TRUE(pending(c)) << "lazy again";
}

TEST_F(Executor, CompileSyncsAfterEachCall) {
  auto w = lazy::from_vector<float>({1, 2, 3}, Shape{3});
  const auto g = lazy::from_vector<float>({1, 1, 1}, Shape{3});
  auto step = lazy::compile([&](float lr) {
    w -= lr * g;
    Tensor<float> loss = w * w;
    return loss;
  });
  const auto m0 = counter("MarkStep");
  auto loss = step(0.5f);
  EXPECT_EQ(counter("MarkStep"), m0 + 1);
  EXPECT_FALSE(pending(w));
  EXPECT_FALSE(pending(loss));
  EXPECT_EQ(loss.to_vector(), (std::vector<float>{0.25f, 2.25f, 6.25f}));
  int calls = 0;
  auto void_step = lazy::compile([&] {
    ++calls;
    w += 1;
  });
  void_step();
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(counter("MarkStep"), m0 + 2);
  EXPECT_FALSE(pending(w));
  EXPECT_EQ(w.to_vector(), (std::vector<float>{1.5f, 2.5f, 3.5f}));
}

TEST_F(Executor, StepClosuresRunAfterMarkStep) {
  Tensor<float> t = lazy::full<float>({3}, 2.0f) * 2;
  std::vector<int> order;
  bool was_materialized = false;
  std::vector<float> seen;
  std::int64_t syncs_inside = -1;
  lazy::add_step_closure([&] {
    order.push_back(1);
    was_materialized = !pending(t);
    const auto s = counter("ImplicitSync");
    seen = t.to_vector();
    syncs_inside = counter("ImplicitSync") - s;
  });
  lazy::add_step_closure([&] { order.push_back(2); });
  EXPECT_TRUE(order.empty()) << "queued, not run";
  step();
  EXPECT_EQ(order, (std::vector<int>{1, 2}));
  EXPECT_TRUE(was_materialized);
  EXPECT_EQ(seen, std::vector<float>(3, 4.0f));
  EXPECT_EQ(syncs_inside, 0);
  step();
  EXPECT_EQ(order, (std::vector<int>{1, 2})) << "closures run once";
}

// ---- determinism across thread counts -------------------------------------------------

template <class T>
std::vector<T> compute_for_threads(int threads, const std::vector<float>& xs, const std::vector<float>& row) {
  lazy::set_num_threads(threads);
  EXPECT_EQ(lazy::get_num_threads(), threads);
  const auto n = static_cast<std::int64_t>(xs.size());
  const std::int64_t cols = static_cast<std::int64_t>(row.size());
  Tensor<T> x = lazy::cast<T>(lazy::from_vector<float>(xs, Shape{n / cols, cols}));
  Tensor<T> r = lazy::cast<T>(lazy::from_vector<float>(row, Shape{cols}));
  Tensor<T> y = lazy::tanh(x * 1.7 + r) * lazy::exp(-x * x) + lazy::sigmoid(x - r) / (1 + lazy::abs(r));
  Tensor<T> z = lazy::sqrt(lazy::abs(y)) + lazy::log1p(lazy::abs(x));  // flat layout
  z += y;
  step();
  return z.to_vector();
}

template <class T>
void expect_bitwise_equal(const std::vector<T>& a, const std::vector<T>& b, int threads) {
  ASSERT_EQ(a.size(), b.size());
  EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(T)), 0) << "threads=" << threads;
}

TEST_F(Executor, ResultsAreBitwiseIdenticalForAnyThreadCount) {
  ThreadsGuard restore;
  const std::int64_t cols = 1003, rows = 101;  // ~101k elements: the costly kernels split across threads
  std::vector<float> xs(static_cast<std::size_t>(rows * cols)), row(static_cast<std::size_t>(cols));
  for (std::size_t i = 0; i < xs.size(); ++i) xs[i] = static_cast<float>(std::sin(static_cast<double>(i) * 0.37) * 3);
  for (std::size_t i = 0; i < row.size(); ++i) row[i] = static_cast<float>(std::cos(static_cast<double>(i)) * 0.5);
  const auto f1 = compute_for_threads<float>(1, xs, row);
  const auto d1 = compute_for_threads<double>(1, xs, row);
  for (int threads : {2, 4}) {
    expect_bitwise_equal(f1, compute_for_threads<float>(threads, xs, row), threads);
    expect_bitwise_equal(d1, compute_for_threads<double>(threads, xs, row), threads);
  }
  // Sanity: the value is what the formula says (so equal-but-wrong can't pass).
  const double x0 = xs[5], r0 = row[5];
  const double y0 = std::tanh(x0 * 1.7 + r0) * std::exp(-x0 * x0) + 1 / (1 + std::exp(-(x0 - r0))) / (1 + std::abs(r0));
  EXPECT_NEAR(d1[5], std::sqrt(std::abs(y0)) + std::log1p(std::abs(x0)) + y0, 1e-12);
}

// ---- long chains ----------------------------------------------------------------------

TEST_F(Executor, LongChainOfStatementsDoesNotOverflowTheStack) {
  constexpr int kSteps = 100000;
  {
    Tensor<float> a = lazy::full<float>({4}, 0.0f);
    for (int i = 0; i < kSteps; ++i) a = a + 1;  // 100000 pending nodes in one chain
    step();
    EXPECT_EQ(a.to_vector(), std::vector<float>(4, static_cast<float>(kSteps)));
  }
  {
    Tensor<float> a = lazy::full<float>({4}, 0.0f);
    for (int i = 0; i < kSteps; ++i) a += 2;
    EXPECT_EQ(a.to_vector(), std::vector<float>(4, 2.0f * kSteps)) << "materialized by a read";
  }
}

TEST_F(Executor, DroppingALongPendingChainDoesNotOverflowTheStack) {
  constexpr int kSteps = 100000;
  Probe p;
  {
    Tensor<float> a = p.make(1.0f);
    for (int i = 0; i < kSteps; ++i) a = a * 1.5f;
  }  // never computed; the whole chain is freed here
  step();
  EXPECT_EQ(p.count(), 0);
}

// ---- errors ---------------------------------------------------------------------------

TEST_F(Executor, UndefinedTensorUseThrows) {
  Tensor<float> u;
  EXPECT_FALSE(u.defined());
  EXPECT_THROW((void)u.shape(), lazy::Error);
  EXPECT_THROW((void)u.numel(), lazy::Error);
  EXPECT_THROW((void)u.item(), lazy::Error);
  EXPECT_THROW((void)u.to_vector(), lazy::Error);
  EXPECT_THROW((void)(u + 1), lazy::Error);
  EXPECT_THROW(u += 1, lazy::Error);
  EXPECT_THROW(u.zero_(), lazy::Error);
  EXPECT_THROW(u.copy_(lazy::zeros<float>({2})), lazy::Error);
  auto d = lazy::zeros<float>({2});
  EXPECT_THROW(d += u, lazy::Error);
  EXPECT_THROW((void)lazy::where(d > 0, u, d), lazy::Error);
  std::ostringstream os;
  os << u;  // printing an undefined tensor is fine, as in libtorch
  EXPECT_NE(os.str().find("undefined"), std::string::npos);
  step();  // and the device is unaffected
}

TEST_F(Executor, ItemNeedsExactlyOneElement) {
  EXPECT_THROW((void)lazy::zeros<float>({2}).item(), lazy::ShapeError);
  EXPECT_THROW((void)lazy::zeros<float>({0}).item(), lazy::ShapeError);
  EXPECT_THROW((void)lazy::zeros<std::int64_t>({2, 3}).item(), lazy::ShapeError);
  EXPECT_EQ(lazy::full<float>({1, 1, 1}, 4.5f).item(), 4.5f);
  EXPECT_EQ(lazy::scalar_tensor<std::int32_t>(-7).item(), -7);
}

TEST_F(Executor, FromVectorSizeMismatchThrows) {
  EXPECT_THROW(lazy::from_vector<float>({1, 2, 3}, Shape{2, 2}), lazy::ShapeError);
  EXPECT_THROW(lazy::from_vector<float>({}, Shape{1}), lazy::ShapeError);
  EXPECT_THROW(lazy::from_vector<bool>({true}, Shape{0}), lazy::ShapeError);
  try {
    lazy::from_vector<double>({1, 2, 3, 4, 5}, Shape{2, 3});
    ADD_FAILURE() << "no exception";
  } catch (const lazy::ShapeError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("(2, 3)"), std::string::npos) << m;
    EXPECT_NE(m.find('5'), std::string::npos) << m;
  }
  EXPECT_NO_THROW(lazy::from_vector<float>({}, Shape{0, 4}));
}

TEST_F(Executor, KernelErrorPropagatesAndLeavesTheGraphUsable) {
  Probe bad, good;
  Tensor<float> y = bad.make(1.0f, Shape{4}, /*fail=*/true) + 1;
  // The step runs asynchronously: its error surfaces at the next sync (or at mark_step
  // itself when steps run synchronously).
  EXPECT_THROW(
      {
        step();
        lazy::wait_device_ops();
      },
      lazy::Error);
  EXPECT_TRUE(pending(y)) << "a failed node stays pending";
  EXPECT_THROW((void)y.to_vector(), lazy::Error) << "and fails again when read: never lost";
  y = lazy::full<float>({4}, 2.0f);  // drop the failing graph
  Tensor<float> z = good.make(3.0f) * y;
  step();
  EXPECT_EQ(z.to_vector(), std::vector<float>(4, 6.0f));
}

// A GEMM fused into its element-wise consumer is skipped at its own plan step and computed
// inside the consumer's. A step failing between the two must return it to the trace with
// the rest: before, it stayed queued without a buffer, and the next step read that.
TEST_F(Executor, AFailureBetweenAGemmAndItsEpilogueLosesNeither) {
  Probe bad;
  const auto a = lazy::from_vector<float>({1, 2, 3, 4, 5, 6}, Shape{2, 3});
  const auto w = lazy::from_vector<float>({1, -1, 2, 0, 1, 1}, Shape{3, 2});
  Tensor<float> y, z;
  {
    Tensor<float> g = lazy::matmul(a, w);  // created first: planned first
    y = bad.make(1.0f, Shape{4}, /*fail=*/true) + 1.0f;
    z = Tensor<float>(lazy::relu(g - 5.0f));  // g's only reader once g goes
  }
  EXPECT_THROW(step(), lazy::Error);
  EXPECT_TRUE(pending(z));
  y = lazy::full<float>({4}, 2.0f);  // drop the failing graph
  step();
  // a @ w = [[1*1+2*2+3*1, -1+0+3], [4+10+6, -4+0+6]] = [[8, 2], [20, 2]]; minus 5, relu.
  EXPECT_EQ(z.to_vector(), (std::vector<float>{3, 0, 15, 0}));
}

// A step that fails on the executor while the next steps are planned and queued behind
// it: they read its values, so they must not run on the missing inputs (they crashed
// before). The step queued behind the failing one is skipped; the error is reported once
// (by the next mark_step, or on slow machines by the one that finds it stored before
// queueing and refuses its own step), everything stays pending, a read fails again
// cleanly, and once the failure heals a step computes it all.
TEST_F(Executor, StepsBehindAFailingStepDoNotRun) {
  auto& dev = lazy::graph::current_device();
  struct AsyncGuard {
    lazy::graph::Device& d;
    bool async = d.async(), inline_steps = d.inline_steps();
    ~AsyncGuard() {
      d.async() = async;
      d.inline_steps() = inline_steps;
    }
  } guard{dev};
  dev.async() = true;
  dev.inline_steps() = false;
  Probe bad;
  // 2^16 elements: enough work to run on the executor, not inline.
  const Shape shape{1 << 16};
  Tensor<float> y = bad.make(1.0f, shape, /*fail=*/true, std::chrono::milliseconds(100)) + 1.0f;
  int errors = 0;
  auto count_error = [&](auto&& f) {
    try {
      f();
    } catch (const lazy::Error&) {
      ++errors;
    }
  };
  count_error([] { lazy::mark_step(); });  // the failing step
  Tensor<float> z = y * 2.0f;
  count_error([] { lazy::mark_step(); });  // queued behind it; returns when it failed
  Tensor<float> w = z + 1.0f;
  count_error([] { lazy::mark_step(); });  // reports the failure
  count_error([] { lazy::wait_device_ops(); });
  EXPECT_EQ(errors, 1) << "reported once";
  EXPECT_EQ(bad.count(), 1);
  EXPECT_TRUE(pending(y));
  EXPECT_TRUE(pending(z));
  EXPECT_TRUE(pending(w));
  EXPECT_THROW((void)w.to_vector(), lazy::Error);
  EXPECT_EQ(bad.count(), 2);
  bad.failing->store(false);
  step();
  EXPECT_EQ(bad.count(), 3);
  EXPECT_EQ(w.to_vector(), std::vector<float>(std::size_t{1} << 16, 5.0f));
  EXPECT_EQ(z.to_vector(), std::vector<float>(std::size_t{1} << 16, 4.0f));
  EXPECT_EQ(y.to_vector(), std::vector<float>(std::size_t{1} << 16, 2.0f));
}

// Reads check for a stored error, and for a step in flight, without a lock when there is
// none: an error stored by a step on the executor must still reach the first read after
// that step finished, even of a tensor that needs no computing, and only that read.
TEST_F(Executor, ErrorOfAFinishedAsyncStepReachesTheNextReadOnce) {
  auto& dev = lazy::graph::current_device();
  struct AsyncGuard {
    lazy::graph::Device& d;
    bool async = d.async(), inline_steps = d.inline_steps();
    ~AsyncGuard() {
      d.async() = async;
      d.inline_steps() = inline_steps;
    }
  } guard{dev};
  dev.async() = true;
  dev.inline_steps() = false;
  auto ready = lazy::full<float>({1}, 3.0f);
  (void)ready.item();  // materialized: reading it computes nothing
  Probe bad;
  Tensor<float> y =
      bad.make(1.0f, Shape{1 << 16}, /*fail=*/true, std::chrono::milliseconds(50)) + 1.0f;
  lazy::mark_step();  // queued on the executor; fails there after 50 ms
  while (dev.busy()) std::this_thread::yield();
  EXPECT_EQ(bad.count(), 1);
  EXPECT_THROW((void)ready.item(), lazy::Error) << "the stored error surfaces at this read";
  EXPECT_EQ(ready.item(), 3.0f) << "once";
  EXPECT_TRUE(pending(y));
  bad.failing->store(false);
  step();
  EXPECT_EQ(y.to_vector(), std::vector<float>(std::size_t{1} << 16, 2.0f));
}

TEST_F(Executor, TensorsOnDifferentDevicesDoNotMix) {
  auto a = lazy::zeros<float>({3});
  auto b = lazy::zeros<float>({3}, lazy::Device(1));
  EXPECT_THROW((void)Tensor<float>(a + b), lazy::DeviceError);
  EXPECT_EQ(b.device().index(), 1);
}

TEST_F(Executor, ConcurrentDevicesInThreads) {
  // Two threads, each with its own device (as replicas have), stepping concurrently.
  std::atomic<int> failures{0};
  auto worker = [&](int dev) {
    lazy::graph::current_device_index() = dev;
    auto w = lazy::full<float>({100000}, 1.0f);  // big enough for sin() to use the device's workers
    for (int s = 0; s < 20; ++s) {
      Tensor<float> g = lazy::sin(w) * 0.0f + 1;
      w -= 0.5f * g;
      step();
    }
    const auto v = w.to_vector();
    for (float x : v)
      if (x != 1.0f - 10.0f) failures.fetch_add(1);
    lazy::graph::current_device_index() = 0;
  };
  std::thread t1(worker, 1), t2(worker, 2);
  worker(0);
  t1.join();
  t2.join();
  EXPECT_EQ(failures.load(), 0);
}

// The executor's queue (Device::enqueue / wait_below): whichever thread runs a job, the jobs
// run in the order they were queued and never two at once.
TEST(DeviceJobs, RunInOrderOneAtATimeWhicheverThreadRunsThem) {
  lazy::graph::Device dev(7, 1);
  constexpr int kJobs = 600;
  std::mutex m;
  std::vector<int> order;
  std::set<std::thread::id> runners;
  std::atomic<int> running{0}, most{0};
  std::atomic<bool> done{false};
  std::vector<std::thread> waiters;
  for (int t = 0; t < 3; ++t)
    waiters.emplace_back([&, t] {
      while (!done.load()) {
        dev.wait_below(1 + t % 2);
        std::this_thread::yield();
      }
    });
  for (int i = 0; i < kJobs; ++i) {
    dev.enqueue([&, i] {
      const int now = running.fetch_add(1) + 1;
      int seen = most.load();
      while (now > seen && !most.compare_exchange_weak(seen, now)) {
      }
      {
        std::lock_guard lock(m);
        order.push_back(i);
        runners.insert(std::this_thread::get_id());
      }
      std::this_thread::yield();
      running.fetch_sub(1);
    });
    if (i % 7 == 0) std::this_thread::yield();
  }
  dev.wait_idle();
  done = true;
  for (auto& w : waiters) w.join();
  ASSERT_EQ(order.size(), std::size_t(kJobs));
  for (int i = 0; i < kJobs; ++i) ASSERT_EQ(order[i], i) << "job " << i << " ran out of order";
  EXPECT_EQ(most.load(), 1) << "two jobs ran at once";
  EXPECT_FALSE(dev.busy());
  std::printf("jobs ran on %zu threads\n", runners.size());
}

// A read right after a step does not wait for the executor thread to wake up: while no job
// runs, the waiting thread runs the queued one itself (the executor, woken by the enqueue,
// finds nothing left). Over many rounds the reading thread must have run some of them.
TEST(DeviceJobs, AWaiterRunsTheQueuedJobWhenNoneRuns) {
  lazy::graph::Device dev(8, 1);
  const auto me = std::this_thread::get_id();
  int here = 0, rounds = 0;
  // Rounds until one ran here, for up to 5 s (a scheduler may let the woken executor win
  // many rounds in a row when the two threads share a core).
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (here == 0 && (rounds < 200 || std::chrono::steady_clock::now() < deadline)) {
    std::thread::id ran;
    dev.enqueue([&] { ran = std::this_thread::get_id(); });
    dev.wait_idle();  // orders the job's write before this read, whoever ran it
    here += ran == me;
    ++rounds;
  }
  EXPECT_GT(here, 0) << "all " << rounds << " jobs waited for the executor thread";
  std::printf("%d of %d jobs ran on the waiting thread\n", here, rounds);
}

// What the waiters leave, the executor runs: a job queued behind one a waiter runs finishes
// with nobody waiting for it.
TEST(DeviceJobs, TheExecutorRunsWhatNoWaiterTakes) {
  lazy::graph::Device dev(9, 1);
  for (int r = 0; r < 50; ++r) {
    std::atomic<bool> second{false};
    dev.enqueue([] {});
    dev.enqueue([&] { second = true; });
    dev.wait_below(2);  // may run the first job here, never the second
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (dev.busy() && std::chrono::steady_clock::now() < deadline) std::this_thread::yield();
    ASSERT_FALSE(dev.busy()) << "round " << r << ": a queued job was left unrun for 10 s";
    EXPECT_TRUE(second.load());
  }
}

}  // namespace

// DeviceRegistry::device finds created devices without a lock: threads that create and look
// up devices at once all get the one object per index, and a bad index is still refused.
TEST(DeviceRegistry, ConcurrentLookupsAgreeOnEachDevice) {
  auto& registry = lazy::graph::DeviceRegistry::get();
  constexpr int kThreads = 4, kDevices = 6;
  std::vector<std::vector<lazy::graph::Device*>> seen(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int round = 0; round < 200; ++round)
        for (int i = 0; i < kDevices; ++i) {
          const int idx = (i + t) % kDevices;  // threads create devices in different orders
          lazy::graph::Device* d = &registry.device(idx);
          // Read through the pointer: a device published before it was constructed shows
          // as a wrong index (and as a race under ThreadSanitizer).
          if (d->index() != idx) d = nullptr;
          if (round == 0) seen[t].resize(kDevices);
          if (round == 0) seen[t][idx] = d;
          else if (seen[t][idx] != d) seen[t][idx] = nullptr;  // a different object: caught below
        }
    });
  }
  for (auto& th : threads) th.join();
  for (int i = 0; i < kDevices; ++i) {
    lazy::graph::Device* d = &registry.device(i);
    EXPECT_EQ(d->index(), i);
    for (int t = 0; t < kThreads; ++t) EXPECT_EQ(seen[t][i], d) << "thread " << t << ", device " << i;
  }
  EXPECT_GE(registry.count(), kDevices);
  EXPECT_THROW(registry.device(-1), lazy::DeviceError);
}
