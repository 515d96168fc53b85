// quickstart: a ten-minute tour of lazytensor.
//
//   tensors are lazy -> statements only record a graph -> mark_step() runs it as fused kernels
//
// Build and run: scripts/demo.sh   (or: cmake --build build --target quickstart)

#include <iostream>
#include <vector>

#include <lazytensor/eigen.hpp>  // opt-in: h.eigen() below
#include <lazytensor/lazytensor.hpp>

namespace {

void section(const char* title) { std::cout << "\n== " << title << " ==\n"; }

/// Kernels executed so far (a lazytensor debug counter, like torch_xla's metrics).
std::int64_t kernels_run() { return lazy::debug::counter_value("KernelsRun"); }

}  // namespace

int main() {
  std::cout << "lazytensor quickstart on device " << lazy::device() << "\n";

  // ---------------------------------------------------------------------------------------
  section("1. tensors and factories");
  // Host data is copied in at once; constant factories such as full/zeros/ones are lazy
  // nodes themselves (no memory is touched until a step needs them).
  lazy::Tensor<float> a = lazy::tensor<float>({{1, -2, 3}, {-4, 5, -6}});  // shape (2, 3)
  lazy::Tensor<float> b = lazy::full<float>({2, 3}, 0.5);
  lazy::Tensor<float> c = lazy::arange<float>(3);  // [0, 1, 2], broadcasts along rows
  std::cout << "a: shape " << a.shape().str() << ", dtype " << lazy::dtype_name(a.dtype) << "\n";

  // ---------------------------------------------------------------------------------------
  section("2. a fused expression: nothing runs yet");
  // Each statement returns an expression template; assigning it to a Tensor records ONE
  // pending graph node that will run the whole right-hand side as a single SIMD loop.
  const std::int64_t before = kernels_run();
  lazy::Tensor<float> y = lazy::relu(a * b + c) * 2.0f - 0.25f * a;  // 6 ops, 1 kernel
  lazy::Tensor<float> z = y * y + 1.0f;                              // a second statement
  std::cout << "kernels run since the statements: " << kernels_run() - before
            << "  (the graph is only recorded)\n";

  // The pending graph, as torch_xla's graph dumps show it: one fused node per statement.
  std::cout << "pending graph of z:\n" << lazy::debug::graph_text(z);

  // ---------------------------------------------------------------------------------------
  section("3. mark_step(): materialize everything pending");
  lazy::mark_step();  // same as lazy::sync() / torch_xla.sync()
  std::cout << "kernels run after mark_step: " << kernels_run() - before << "\n";
  std::cout << "y = " << y << "\n";
  std::cout << "z = " << z << "\n";

  // ---------------------------------------------------------------------------------------
  section("4. reductions fuse their element-wise input");
  // sum((y - a)^2) reads y and a once; (y - a)^2 is never written to memory.
  lazy::Tensor<float> sq = lazy::sum((y - a) * (y - a));
  lazy::Tensor<float> row_means = lazy::mean(a, {1});  // per-row mean, shape (2)
  // Reading a value (item, to_vector, printing) materializes just what it needs; the
  // metrics count it as an implicit sync.
  std::cout << "sum((y - a)^2) = " << sq.item() << "\n";
  std::cout << "row means      = " << row_means << "\n";

  // ---------------------------------------------------------------------------------------
  section("5. a dense layer: relu(x @ w^T + bias)");
  // linear() returns an expression, so the bias add and relu join one epilogue that runs
  // on each row block of the GEMM while it is still in cache.
  lazy::Tensor<float> x = lazy::tensor<float>({{1, 2, 3, 4}, {-1, 0, 1, 0}});        // [batch=2, in=4]
  lazy::Tensor<float> w = lazy::tensor<float>({{0.5f, 0, 0, 0}, {0, -1, 0, 0}, {1, 1, 1, 1}});  // [out=3, in=4]
  lazy::Tensor<float> bias = lazy::tensor<float>({0.f, 1.f, -5.f});
  lazy::Tensor<float> h = lazy::relu(lazy::linear(x, w, bias));  // [2, 3]
  lazy::Tensor<float> logits = lazy::matmul(h, lazy::ones<float>({3, 2}));  // plain matmul
  std::cout << "graph of logits before the step:\n" << lazy::debug::graph_text(logits);
  lazy::mark_step();

  // ---------------------------------------------------------------------------------------
  section("6. reading values back");
  std::vector<float> hv = h.to_vector();  // row-major copy
  std::cout << "h (to_vector):";
  for (float v : hv) std::cout << " " << v;
  std::cout << "\nh[0][2] via an Eigen view: " << h.eigen()(0, 2) << "\n";
  std::cout << "logits = " << logits << "\n";

  // ---------------------------------------------------------------------------------------
  section("7. metrics");
  // Counters and timings named like torch_xla's (MarkStep, ExecuteTime, ImplicitSync, ...).
  std::cout << lazy::debug::short_metrics_report() << "\n\n";
  std::cout << lazy::debug::metrics_report();
  return 0;
}
