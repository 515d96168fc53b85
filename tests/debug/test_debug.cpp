// debug/metrics.hpp and debug/graph_dump.hpp: counters and metrics named like PyTorch/XLA's,
// the reports, and the text / Graphviz dumps of pending graphs.
#include <lazytensor/debug/graph_dump.hpp>
#include <lazytensor/debug/metrics.hpp>
#include <lazytensor/tensor.hpp>
#include <lazytensor/ops/factories.hpp>
#include <lazytensor/ops/random.hpp>
#include <lazytensor/ops/reduction.hpp>
#include <lazytensor/tensor.hpp>

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <regex>
#include <sstream>
#include <string>
#include <unistd.h>
#include <vector>

namespace {

// mark_step runs the step asynchronously; tests that look at counters or node states right
// after it wait for the step to finish.
void step() {
  lazy::mark_step();
  lazy::wait_device_ops();
}

using lazy::Shape;
using lazy::Tensor;
using lazy::debug::counter_value;

class Debug : public ::testing::Test {
 protected:
  void SetUp() override { step(); }
};

// "Counter: NAME\n  Value: V" in a report; -1 when absent.
std::int64_t report_value(const std::string& report, const std::string& name) {
  const std::regex re("Counter: " + name + "\\n  Value: (-?[0-9]+)\\n");
  std::smatch m;
  if (!std::regex_search(report, m, re)) return -1;
  return std::stoll(m[1]);
}

std::vector<std::string> lines_of(const std::string& s) {
  std::vector<std::string> out;
  std::istringstream is(s);
  for (std::string line; std::getline(is, line);) out.push_back(line);
  return out;
}

TEST_F(Debug, MarkStepCounter) {
  const auto m0 = counter_value("MarkStep");
  step();
  step();
  lazy::sync();
  EXPECT_EQ(counter_value("MarkStep"), m0 + 3);
}

TEST_F(Debug, ImplicitSyncAndTransferCounters) {
  auto a = lazy::full<float>({4}, 1.0f);
  Tensor<float> b = a * 3;
  Tensor<float> c = a + 1;
  const auto s0 = counter_value("ImplicitSync");
  const auto t0 = counter_value("TransferFromDevice");
  (void)b.to_vector();  // pending: an implicit sync
  EXPECT_EQ(counter_value("ImplicitSync"), s0 + 1);
  EXPECT_EQ(counter_value("TransferFromDevice"), t0 + 1);
  (void)b.to_vector();  // materialized: a transfer, not a sync
  EXPECT_EQ(counter_value("ImplicitSync"), s0 + 1);
  EXPECT_EQ(counter_value("TransferFromDevice"), t0 + 2);
  (void)c.to_vector();  // another pending tensor: another sync
  EXPECT_EQ(counter_value("ImplicitSync"), s0 + 2);
  step();  // nothing pending is left: no sync counted by the step itself
  EXPECT_EQ(counter_value("ImplicitSync"), s0 + 2);
}

TEST_F(Debug, KernelsRunAndExecuteTime) {
  const auto k0 = counter_value("KernelsRun");
  const auto f0 = counter_value("FusedNodes");
  const auto e0 = lazy::debug::metric_data("ExecuteTime");
  const std::int64_t samples0 = e0 ? e0->count : 0;
  // Element-wise statements fuse by size (cross-statement groups): a, b, c are one kernel
  // run, the two of size 7 another.
  auto a = lazy::full<float>({1000}, 1.0f);
  Tensor<double> other = lazy::full<double>({7}, 1.0) * 3;
  Tensor<float> b = lazy::exp(a) + 1;
  Tensor<float> c = b * b;
  step();
  EXPECT_EQ(counter_value("KernelsRun"), k0 + 2);
  EXPECT_EQ(counter_value("FusedNodes"), f0 + 5);
  const auto e1 = lazy::debug::metric_data("ExecuteTime");
  ASSERT_TRUE(e1.has_value());
  EXPECT_EQ(e1->count, samples0 + 1) << "one sample per execution";
  EXPECT_GT(e1->total_ns, e0 ? e0->total_ns : 0.0);
  EXPECT_LE(e1->min_ns, e1->max_ns);
  EXPECT_GE(e1->min_ns, 0.0);
  // A step with nothing to run executes nothing.
  step();
  EXPECT_EQ(counter_value("KernelsRun"), k0 + 2);
}

TEST_F(Debug, UnknownNamesAreZeroOrAbsent) {
  EXPECT_EQ(counter_value("NoSuchCounter_xyz"), 0);
  EXPECT_FALSE(lazy::debug::metric_data("NoSuchMetric_xyz").has_value());
}

TEST_F(Debug, MetricsReportContainsTheCounters) {
  Tensor<float> t = lazy::full<float>({8}, 2.0f) * 2;
  (void)t.to_vector();  // ImplicitSync
  step();
  const std::string r = lazy::debug::metrics_report();
  EXPECT_NE(r.find("Metric: ExecuteTime"), std::string::npos) << r;
  EXPECT_NE(r.find("TotalSamples:"), std::string::npos) << r;
  for (const char* name : {"MarkStep", "ImplicitSync", "KernelsRun", "TransferFromDevice"}) {
    EXPECT_EQ(report_value(r, name), counter_value(name)) << name << " in\n" << r;
  }
  EXPECT_GE(report_value(r, "FreshAllocations"), 1) << r;
  EXPECT_GE(report_value(r, "BytesAllocated"), 64) << r;
  const auto names = lazy::debug::counter_names();
  for (const char* name : {"MarkStep", "ImplicitSync", "KernelsRun"}) {
    EXPECT_NE(std::find(names.begin(), names.end(), name), names.end()) << name;
  }
  const std::string s = lazy::debug::short_metrics_report();
  EXPECT_NE(s.find("MarkStep=" + std::to_string(counter_value("MarkStep"))), std::string::npos) << s;
  EXPECT_NE(s.find("KernelsRun=" + std::to_string(counter_value("KernelsRun"))), std::string::npos) << s;
  EXPECT_NE(s.find("ExecuteTime="), std::string::npos) << s;
  EXPECT_EQ(s.find('\n'), std::string::npos) << "one line";
}

TEST_F(Debug, ClearMetricsResetsEverything) {
  step();
  Tensor<float> t = lazy::full<float>({2}, 1.0f) + 1;
  (void)t.to_vector();
  ASSERT_GT(counter_value("MarkStep"), 0);
  lazy::debug::clear_metrics();
  EXPECT_EQ(counter_value("MarkStep"), 0);
  EXPECT_EQ(counter_value("ImplicitSync"), 0);
  EXPECT_EQ(counter_value("KernelsRun"), 0);
  EXPECT_FALSE(lazy::debug::metric_data("ExecuteTime").has_value());
  EXPECT_EQ(report_value(lazy::debug::metrics_report(), "MarkStep"), -1) << "zero counters are not listed";
  step();  // counting resumes
  EXPECT_EQ(counter_value("MarkStep"), 1);
}

// ---- graph dumps ----------------------------------------------------------------------

TEST_F(Debug, GraphTextShowsOpsTypesAndOrder) {
  const auto a = lazy::from_vector<float>({1, 2, 3, 4, 5, 6}, Shape{2, 3});
  const auto b = lazy::from_vector<float>({6, 5, 4, 3, 2, 1}, Shape{2, 3});
  Tensor<float> y = lazy::exp(a) + b * 2;
  Tensor<double> z = lazy::cast<double>(y) * 0.5 - lazy::full<double>({3}, 1.0);
  const std::string text = lazy::debug::graph_text(z);
  const auto lines = lines_of(text);
  // a, b (data), full, y, z: five values.
  ASSERT_EQ(lines.size(), 5u) << text;
  for (const char* needle : {"exp", "add", "mul", "sub", "cast", "float32(2, 3)", "float64(2, 3)", "float64(3,)", "data",
                             "(output)", "0.5"}) {
    EXPECT_NE(text.find(needle), std::string::npos) << needle << " in\n" << text;
  }
  // Every line is "%k = ...", k counting up; inputs refer to earlier lines only.
  const std::regex line_re(R"(^%([0-9]+) = (bool|int32|int64|bfloat16|float32|float64)\([0-9, ]*\) (.*)$)");
  const std::regex ref_re(R"(%([0-9]+))");
  int outputs = 0;
  for (std::size_t k = 0; k < lines.size(); ++k) {
    std::smatch m;
    ASSERT_TRUE(std::regex_match(lines[k], m, line_re)) << lines[k];
    EXPECT_EQ(std::stoul(m[1]), k);
    const std::string rest = m[3];
    const auto arrow = rest.find(" <-");
    if (arrow != std::string::npos) {
      const std::string ins = rest.substr(arrow);
      for (auto it = std::sregex_iterator(ins.begin(), ins.end(), ref_re); it != std::sregex_iterator(); ++it) {
        EXPECT_LT(std::stoul((*it)[1]), k) << lines[k];
      }
    }
    if (rest.find("(output)") != std::string::npos) ++outputs;
  }
  EXPECT_EQ(outputs, 1);
  EXPECT_NE(lines.back().find("(output)"), std::string::npos) << "the output is computed last";
  // Dumping does not compute anything.
  EXPECT_FALSE(z.node()->materialized());
  // Several outputs.
  const std::string both = lazy::debug::graph_text(y, z);
  EXPECT_EQ(std::count(both.begin(), both.end(), '\n'), 5);
  std::size_t marks = 0;
  for (std::size_t p = both.find("(output)"); p != std::string::npos; p = both.find("(output)", p + 1)) ++marks;
  EXPECT_EQ(marks, 2u) << both;
  // After the step everything is data.
  step();
  const std::string after = lazy::debug::graph_text(z);
  EXPECT_EQ(lines_of(after).size(), 1u) << after;
  EXPECT_NE(after.find("float64(2, 3) data"), std::string::npos) << after;
}

TEST_F(Debug, GraphDotIsWellFormed) {
  const auto a = lazy::from_vector<float>({1, 2, 3}, Shape{3});
  Tensor<float> y = lazy::relu(a - 1) * lazy::sigmoid(a);
  Tensor<bool> z = y > 0.5;
  const std::string dot = lazy::debug::graph_dot(z);
  EXPECT_EQ(dot.rfind("digraph", 0), 0u) << dot;
  EXPECT_EQ(std::count(dot.begin(), dot.end(), '{'), std::count(dot.begin(), dot.end(), '}')) << dot;
  ASSERT_GE(dot.size(), 2u);
  EXPECT_EQ(dot.substr(dot.size() - 2), "}\n");
  // Quotes pair up (ignoring escaped ones).
  int quotes = 0;
  for (std::size_t i = 0; i < dot.size(); ++i)
    if (dot[i] == '"' && (i == 0 || dot[i - 1] != '\\')) ++quotes;
  EXPECT_EQ(quotes % 2, 0) << dot;
  for (const char* needle : {"relu", "sigmoid", "sub", "mul", "gt", "->", "float32(3,)", "bool(3,)"}) {
    EXPECT_NE(dot.find(needle), std::string::npos) << needle << " in\n" << dot;
  }
  // Edges: a -> y, y -> z (three nodes, two edges).
  std::size_t edges = 0;
  for (std::size_t p = dot.find("->"); p != std::string::npos; p = dot.find("->", p + 1)) ++edges;
  EXPECT_EQ(edges, 2u) << dot;

  // Graphviz accepts it, when installed.
  if (std::system("command -v dot >/dev/null 2>&1") == 0) {
    char path[] = "/tmp/lazytensor_test_dot_XXXXXX";
    const int fd = mkstemp(path);
    ASSERT_GE(fd, 0);
    close(fd);
    {
      std::ofstream f(path);
      f << dot;
    }
    const std::string cmd = std::string("dot -Tsvg ") + path + " -o /dev/null 2>/dev/null";
    EXPECT_EQ(std::system(cmd.c_str()), 0) << dot;
    std::remove(path);
  }
}

TEST_F(Debug, DumpsShowCrossStatementFusionGroups) {
  const auto a = lazy::rand<float>({3000});
  const auto b = lazy::rand<float>({3000});
  const auto c = lazy::rand<float>({3000});
  const auto d = lazy::rand<float>({3000});
  step();
  Tensor<float> y;
  {
    Tensor<float> t1 = a * b + c;
    Tensor<float> t2 = lazy::relu(t1) * d;
    y = t2 - 0.5f * a;
  }  // t1 and t2 dropped: the planner keeps them in chunk scratch
  const std::string text = lazy::debug::graph_text(y);
  const auto lines = lines_of(text);
  ASSERT_EQ(lines.size(), 7u) << text;  // a, b, c, d, t1, t2, y
  EXPECT_NE(lines[4].find("{group 0, scratch}"), std::string::npos) << text;
  EXPECT_NE(lines[5].find("{group 0, scratch}"), std::string::npos) << text;
  EXPECT_NE(lines[6].find("{group 0}"), std::string::npos) << text;
  EXPECT_EQ(lines[6].find("scratch"), std::string::npos) << "the output is written whole\n" << text;
  const std::string dot = lazy::debug::graph_dot(y);
  EXPECT_NE(dot.find("subgraph cluster_0"), std::string::npos) << dot;
  EXPECT_EQ(std::count(dot.begin(), dot.end(), '{'), std::count(dot.begin(), dot.end(), '}')) << dot;

  // A value someone still holds is written whole; a reduction of everything the group
  // computes ends it (its child then lives in scratch); what reads the reduction does not
  // join.
  Tensor<float> t1 = a * b + c;
  Tensor<float> w;
  {
    Tensor<float> z = lazy::exp(t1);
    w = lazy::sum(z, {0}, true) + 1.0f;
  }
  const std::string kept = lazy::debug::graph_text(w, t1);
  const auto kl = lines_of(kept);
  ASSERT_EQ(kl.size(), 7u) << kept;  // a, b, c, t1, z, sum, w
  EXPECT_NE(kl[3].find("{group 0}"), std::string::npos) << kept;
  EXPECT_NE(kl[4].find("{group 0, scratch}"), std::string::npos) << kept;
  EXPECT_NE(kl[5].find("{group 0}"), std::string::npos) << kept;
  EXPECT_EQ(kl[6].find("{group"), std::string::npos) << kept;
  // The dump computes nothing; the step computes the same values as unfused arithmetic.
  EXPECT_FALSE(y.node()->materialized());
  const auto got = y.to_vector();
  const auto av = a.to_vector(), bv = b.to_vector(), cv = c.to_vector(), dv = d.to_vector();
  for (std::size_t i = 0; i < got.size(); ++i) {
    const float t = std::max(av[i] * bv[i] + cv[i], 0.0f) * dv[i];
    ASSERT_NEAR(got[i], t - 0.5f * av[i], 1e-5f) << i;
  }
}

}  // namespace
