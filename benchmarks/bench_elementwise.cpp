// The 5-op element-wise chain y = relu(a*b + c) * d - 0.5*a over N floats.
//
//   BM_Chain_Lazy/N               lazytensor, 1 thread: graph build + mark_step per iteration
//   BM_Chain_EigenEagerFresh/N    eager Eigen, each op into a fresh temporary
//   BM_Chain_EigenEagerPrealloc/N eager Eigen, each op into a preallocated temporary
//   BM_Chain_EigenExpr/N          Eigen's single-statement expression into a preallocated y
//   BM_Chain_Xtensor/N            xtensor expression (when built with LAZYTENSOR_HAVE_XTENSOR)
//   BM_Chain_Torch/N              libtorch eager, 1 thread (when built with LAZYTENSOR_HAVE_TORCH)
//   BM_Chain_LazyThreads/N/T      lazytensor with T device threads (thread scaling)
//   BM_Chain_EigenExprThreads/N/T Eigen's expression split into T contiguous parts, one per
//                                 thread: the machine's ceiling for the thread scaling
//
// The same chain as three statements, t1 = a*b + c; t2 = relu(t1) * d; y = t2 - 0.5*a
// (cross-statement fusion):
//   BM_ThreeStmt_Lazy/N           t1, t2 dropped before mark_step (kept in scratch one slice long)
//   BM_ThreeStmt_LazyKept/N       t1, t2 alive across mark_step (written whole)
//   BM_ThreeStmt_LazyEager/N      the three statements with eager_mode(true): unfused
// Every lazy variant waits for its step (wait_device_ops) inside the timed loop.
//
// Bytes processed: 5 arrays (4 inputs + 1 output) x 4 bytes x N per iteration, the
// compulsory traffic of a fused kernel, for every variant (so GB/s compare directly).

#include "bench_common.hpp"

#include <barrier>
#include <thread>

#include <Eigen/Core>

#ifdef LAZYTENSOR_HAVE_XTENSOR
#include <xtensor/xadapt.hpp>
#include <xtensor/xmath.hpp>
#include <xtensor/xnoalias.hpp>
#include <xtensor/xtensor.hpp>
#endif
#ifdef LAZYTENSOR_HAVE_TORCH
#include <torch/torch.h>
#endif

namespace {

constexpr int kArrays = 5;

struct Inputs {
  std::vector<float> a, b, c, d;
  explicit Inputs(std::int64_t n)
      : a(bench::random_vector(n, 1)), b(bench::random_vector(n, 2)), c(bench::random_vector(n, 3)),
        d(bench::random_vector(n, 4)) {}
  float reference(std::int64_t i) const {
    const float t = a[i] * b[i] + c[i];
    return (t > 0.f ? t : 0.f) * d[i] - 0.5f * a[i];
  }
};

// The inputs copied into Eigen arrays (the Eigen peers own their data, as lazytensor does).
struct EigenInputs {
  Eigen::ArrayXf a, b, c, d;
  explicit EigenInputs(const Inputs& in)
      : a(array(in.a)), b(array(in.b)), c(array(in.c)), d(array(in.d)) {}
  static Eigen::ArrayXf array(const std::vector<float>& v) {
    return Eigen::Map<const Eigen::ArrayXf>(v.data(), static_cast<Eigen::Index>(v.size()));
  }
};

void set_bytes(benchmark::State& state, std::int64_t n) {
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) * kArrays * 4 * n);
  state.counters["N"] = static_cast<double>(n);
}

void run_lazy(benchmark::State& state, std::int64_t n, int threads) {
  bench::DeviceThreads guard(threads);
  const Inputs in(n);
  // Materialized inputs: data nodes holding a copy of the host values.
  const lazy::Shape shape{n};
  const auto a = lazy::from_vector<float>(in.a, shape), b = lazy::from_vector<float>(in.b, shape),
             c = lazy::from_vector<float>(in.c, shape), d = lazy::from_vector<float>(in.d, shape);
  {  // untimed self-check (also warms the buffer pool)
    lazy::Tensor<float> y = lazy::relu(a * b + c) * d - 0.5f * a;
    lazy::mark_step();
    const float* p = y.data();
    for (std::int64_t i = 0; i < n; i += std::max<std::int64_t>(1, n / 4096)) {
      if (!bench::check(state, std::abs(p[i] - in.reference(i)) <= 1e-5f * (1 + std::abs(in.reference(i))),
                        "lazy chain value at " + std::to_string(i)))
        return;
    }
  }
  for (auto _ : state) {
    lazy::Tensor<float> y = lazy::relu(a * b + c) * d - 0.5f * a;
    lazy::mark_step();
    lazy::wait_device_ops();
    benchmark::DoNotOptimize(y.node().get());
    benchmark::ClobberMemory();
  }
  set_bytes(state, n);
}

enum class Statements { Dropped, Kept, Eager };

// The chain as three statements (see the file comment).
void run_three(benchmark::State& state, Statements mode) {
  bench::DeviceThreads guard(1);
  const std::int64_t n = state.range(0);
  const Inputs in(n);
  const lazy::Shape shape{n};
  const auto a = lazy::from_vector<float>(in.a, shape), b = lazy::from_vector<float>(in.b, shape),
             c = lazy::from_vector<float>(in.c, shape), d = lazy::from_vector<float>(in.d, shape);
  lazy::eager_mode(mode == Statements::Eager);
  lazy::Tensor<float> k1, k2;
  auto step = [&] {
    lazy::Tensor<float> y;
    {
      lazy::Tensor<float> t1 = a * b + c;
      lazy::Tensor<float> t2 = lazy::relu(t1) * d;
      y = t2 - 0.5f * a;
      if (mode == Statements::Kept) {
        k1 = t1;
        k2 = t2;
      }
    }
    lazy::mark_step();
    lazy::wait_device_ops();
    return y;
  };
  {  // untimed self-check (also warms the buffer pool and the plan cache)
    const lazy::Tensor<float> y = step();
    const float* p = y.data();
    for (std::int64_t i = 0; i < n; i += std::max<std::int64_t>(1, n / 4096)) {
      if (!bench::check(state, std::abs(p[i] - in.reference(i)) <= 1e-5f * (1 + std::abs(in.reference(i))),
                        "three statements value at " + std::to_string(i))) {
        lazy::eager_mode(false);
        return;
      }
    }
  }
  for (auto _ : state) {
    lazy::Tensor<float> y = step();
    benchmark::DoNotOptimize(y.node().get());
    benchmark::ClobberMemory();
  }
  lazy::eager_mode(false);
  set_bytes(state, n);
}

void BM_ThreeStmt_Lazy(benchmark::State& state) { run_three(state, Statements::Dropped); }
void BM_ThreeStmt_LazyKept(benchmark::State& state) { run_three(state, Statements::Kept); }
void BM_ThreeStmt_LazyEager(benchmark::State& state) { run_three(state, Statements::Eager); }

void BM_Chain_Lazy(benchmark::State& state) { run_lazy(state, state.range(0), 1); }

void BM_Chain_LazyThreads(benchmark::State& state) {
  run_lazy(state, state.range(0), static_cast<int>(state.range(1)));
}

void BM_Chain_EigenEagerFresh(benchmark::State& state) {
  const std::int64_t n = state.range(0);
  const Inputs in(n);
  const EigenInputs e(in);
  const Eigen::ArrayXf &a = e.a, &b = e.b, &c = e.c, &d = e.d;
  for (auto _ : state) {
    // What an eager library does: every op allocates its result.
    Eigen::ArrayXf t1 = a * b;
    Eigen::ArrayXf t2 = t1 + c;
    Eigen::ArrayXf t3 = t2.max(0.f);
    Eigen::ArrayXf t4 = t3 * d;
    Eigen::ArrayXf t5 = 0.5f * a;
    Eigen::ArrayXf y = t4 - t5;
    benchmark::DoNotOptimize(y.data());
    benchmark::ClobberMemory();
  }
  set_bytes(state, n);
}

void BM_Chain_EigenEagerPrealloc(benchmark::State& state) {
  const std::int64_t n = state.range(0);
  const Inputs in(n);
  const EigenInputs e(in);
  const Eigen::ArrayXf &a = e.a, &b = e.b, &c = e.c, &d = e.d;
  // Same-size temporaries allocated (and first touched) once, outside the loop.
  Eigen::ArrayXf t1 = Eigen::ArrayXf::Zero(n), t2 = t1, t3 = t1, t4 = t1, t5 = t1, y = t1;
  for (auto _ : state) {
    t1 = a * b;
    t2 = t1 + c;
    t3 = t2.max(0.f);
    t4 = t3 * d;
    t5 = 0.5f * a;
    y = t4 - t5;
    benchmark::DoNotOptimize(y.data());
    benchmark::ClobberMemory();
  }
  set_bytes(state, n);
}

void BM_Chain_EigenExpr(benchmark::State& state) {
  const std::int64_t n = state.range(0);
  const Inputs in(n);
  const EigenInputs e(in);
  const Eigen::ArrayXf &a = e.a, &b = e.b, &c = e.c, &d = e.d;
  Eigen::ArrayXf y = Eigen::ArrayXf::Zero(n);
  for (auto _ : state) {
    y = ((a * b + c).max(0.f) * d - 0.5f * a);
    benchmark::DoNotOptimize(y.data());
    benchmark::ClobberMemory();
  }
  if (!bench::check(state, std::abs(y[n / 2] - in.reference(n / 2)) <= 1e-5f, "eigen expr value")) return;
  set_bytes(state, n);
}

// Eigen's expression over T contiguous parts, the calling thread and T-1 persistent
// workers meeting at a barrier before and after each part: what the memory system gives
// T threads running the chain, with no planner in between (the reference for the
// LazyThreads scaling row).
void BM_Chain_EigenExprThreads(benchmark::State& state) {
  const std::int64_t n = state.range(0);
  const int threads = static_cast<int>(state.range(1));
  const Inputs in(n);
  const EigenInputs e(in);
  const Eigen::ArrayXf &a = e.a, &b = e.b, &c = e.c, &d = e.d;
  Eigen::ArrayXf y = Eigen::ArrayXf::Zero(n);
  auto part = [&](int t) {
    const Eigen::Index lo = n * t / threads, len = n * (t + 1) / threads - lo;
    y.segment(lo, len) = (a.segment(lo, len) * b.segment(lo, len) + c.segment(lo, len)).max(0.f) *
                             d.segment(lo, len) -
                         0.5f * a.segment(lo, len);
  };
  std::barrier start(threads), done(threads);
  bool stop = false;  // written before `start`, read after it
  std::vector<std::jthread> workers;
  for (int t = 1; t < threads; ++t)
    workers.emplace_back([&, t] {
      for (;;) {
        start.arrive_and_wait();
        if (stop) return;
        part(t);
        done.arrive_and_wait();
      }
    });
  for (auto _ : state) {
    start.arrive_and_wait();
    part(0);
    done.arrive_and_wait();
    benchmark::DoNotOptimize(y.data());
    benchmark::ClobberMemory();
  }
  stop = true;
  start.arrive_and_wait();
  workers.clear();  // joins
  for (const std::int64_t i : {std::int64_t{0}, n / 2, n - 1})
    if (!bench::check(state,
                      std::abs(y[i] - in.reference(i)) <= 1e-5f * (1 + std::abs(in.reference(i))),
                      "eigen threads value at " + std::to_string(i)))
      return;
  set_bytes(state, n);
}

#ifdef LAZYTENSOR_HAVE_XTENSOR
void BM_Chain_Xtensor(benchmark::State& state) {
  const std::int64_t n = state.range(0);
  const Inputs in(n);
  const std::array<std::size_t, 1> sh{static_cast<std::size_t>(n)};
  const xt::xtensor<float, 1> a = xt::adapt(in.a, sh), b = xt::adapt(in.b, sh), c = xt::adapt(in.c, sh),
                              d = xt::adapt(in.d, sh);
  xt::xtensor<float, 1> y = xt::zeros<float>(sh);
  for (auto _ : state) {
    xt::noalias(y) = xt::maximum(a * b + c, 0.f) * d - 0.5f * a;
    benchmark::DoNotOptimize(y.data());
    benchmark::ClobberMemory();
  }
  set_bytes(state, n);
}
#endif

#ifdef LAZYTENSOR_HAVE_TORCH
void BM_Chain_Torch(benchmark::State& state) {
  const std::int64_t n = state.range(0);
  at::set_num_threads(1);
  const Inputs in(n);
  auto from = [&](const std::vector<float>& v) { return torch::from_blob(const_cast<float*>(v.data()), {n}).clone(); };
  const torch::Tensor a = from(in.a), b = from(in.b), c = from(in.c), d = from(in.d);
  for (auto _ : state) {
    torch::Tensor y = torch::relu(a * b + c) * d - 0.5 * a;
    benchmark::DoNotOptimize(y.data_ptr());
    benchmark::ClobberMemory();
  }
  set_bytes(state, n);
}
#endif

void sizes(benchmark::internal::Benchmark* b) {
  for (int p : {10, 16, 20, 24}) b->Arg(std::int64_t{1} << p);
  b->UseRealTime();
}

}  // namespace

BENCHMARK(BM_Chain_Lazy)->Apply(sizes);
BENCHMARK(BM_Chain_EigenEagerFresh)->Apply(sizes);
BENCHMARK(BM_Chain_EigenEagerPrealloc)->Apply(sizes);
BENCHMARK(BM_Chain_EigenExpr)->Apply(sizes);
#ifdef LAZYTENSOR_HAVE_XTENSOR
BENCHMARK(BM_Chain_Xtensor)->Apply(sizes);
#endif
#ifdef LAZYTENSOR_HAVE_TORCH
BENCHMARK(BM_Chain_Torch)->Apply(sizes);
#endif
BENCHMARK(BM_ThreeStmt_Lazy)->Arg(std::int64_t{1} << 20)->Arg(std::int64_t{1} << 24)->UseRealTime();
BENCHMARK(BM_ThreeStmt_LazyKept)->Arg(std::int64_t{1} << 20)->Arg(std::int64_t{1} << 24)->UseRealTime();
BENCHMARK(BM_ThreeStmt_LazyEager)->Arg(std::int64_t{1} << 20)->Arg(std::int64_t{1} << 24)->UseRealTime();
BENCHMARK(BM_Chain_LazyThreads)->Args({std::int64_t{1} << 24, 1})->Args({std::int64_t{1} << 24, 2})->UseRealTime();
BENCHMARK(BM_Chain_EigenExprThreads)
    ->Args({std::int64_t{1} << 24, 1})
    ->Args({std::int64_t{1} << 24, 2})
    ->UseRealTime();

BENCHMARK_MAIN();
