// One MLP training step (mlp_problem.hpp: 784-256-128-10 with ReLU, batch 256, forward + mean
// cross entropy + backward + SGD with momentum 0.9), every variant on T threads:
//
//   BM_MlpStep_Lazy/T        lazy::nn::Sequential + optim::SGD: zero_grad, forward, backward,
//                            step, mark_step; T device threads (the executor counts as one)
//   BM_MlpStep_LazyBF16Mixed/T  the same under precision "bf16-mixed" (autocast: the
//                            forward's products in bfloat16, float accumulation)
//   BM_MlpStep_Torch/T       the same model and optimizer in libtorch (LAZYTENSOR_HAVE_TORCH):
//                            T intra-op threads, T OpenBLAS threads, 1 inter-op thread
//   BM_MlpStep_TorchBlasOnly/T  libtorch with 1 intra-op thread and T OpenBLAS threads. With
//                            Debian's libtorch (OpenMP intra-op) and libopenblas0-pthread,
//                            libgomp's workers spin after each element-wise op and take the
//                            cores OpenBLAS's own worker needs: Torch/2 is then several times
//                            slower than Torch/1 (unless OMP_WAIT_POLICY=passive, which must be
//                            set before the program starts). This variant is libtorch's best
//                            T-thread configuration without touching the environment.
//   BM_MlpStep_EigenEager/T  a hand-written eager Eigen step: one noalias GEMM per product
//                            into preallocated matrices, loops for bias/relu/softmax and the
//                            momentum update; T OpenMP threads (Eigen's GEMM and the loops)
//   BM_MlpStep_GemmBound/T   the step's 8 GEMMs alone (Eigen, T threads, same shapes and
//                            operands): time / step time is the fraction of the GEMM bound
//
// Counters: samples (samples/s) and GFLOP (the step's GEMM FLOP per second of step).
// Before the first benchmark, every variant trains kCheckSteps steps on 1 thread from the
// same weights and must follow EigenEager's loss curve (else every benchmark stops with an
// error): the check that the variants compute the same step.

#include "mlp_problem.hpp"

#include <chrono>
#include <cstdio>
#include <sstream>
#include <thread>

#include <sys/resource.h>

#include <Eigen/Core>

#ifdef LAZYTENSOR_HAVE_TORCH
#include <torch/torch.h>

#include "torch_threads.hpp"
#endif

namespace {

using namespace bench::mlp;

constexpr int kCheckSteps = 20;
/// Largest relative difference from EigenEager's loss at any checked step. Float rounding
/// (summation order) gives < 1e-6; the loss moves by ~5e-3 per step by the end of the 20
/// steps (2.307 -> 2.166 on Fashion-MNIST), so a wrong gradient or update shows.
constexpr double kLossTolerance = 2e-5;

/// Untimed steps before the timed loop: first-touch of buffers, thread pools started.
constexpr int kWarmupSteps = 3;

using RowMat = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using RowVec = Eigen::Matrix<float, 1, Eigen::Dynamic>;

/// Lets the threads of the previous benchmark go idle before a different one starts:
/// OpenBLAS's workers (libtorch's GEMMs) spin ~0.1 s after a call, and on 2 cores a
/// spinning thread takes a core away from whatever runs next.
void settle(const char* benchmark) {
  static const char* last = nullptr;
  if (last && last != benchmark) std::this_thread::sleep_for(std::chrono::milliseconds(200));
  last = benchmark;
}

/// Runs `f(r)` for r in [0, rows), split over `threads` OpenMP threads when there are several.
template <class F>
void for_rows(Eigen::Index rows, int threads, F f) {
#ifdef _OPENMP
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
#endif
  for (Eigen::Index r = 0; r < rows; ++r) f(r);
  (void)threads;
}

/// Sets Eigen's GEMM thread count for the lifetime of the guard.
class EigenThreads {
 public:
  explicit EigenThreads(int n) : old_(Eigen::nbThreads()) { Eigen::setNbThreads(n); }
  ~EigenThreads() { Eigen::setNbThreads(old_); }
  EigenThreads(const EigenThreads&) = delete;
  EigenThreads& operator=(const EigenThreads&) = delete;

 private:
  int old_;
};

/// The eager Eigen step on batch 0: row-major matrices, every buffer allocated once.
class EigenMlp {
 public:
  EigenMlp(const Problem& p, int threads)
      : threads_(threads), x_(p.x_of(0), kBatch, kWidth[0]), y_(p.y_of(0)) {
    for (int l = 0; l < 3; ++l) {
      w_[l] = Eigen::Map<const RowMat>(p.w[l].data(), kWidth[l + 1], kWidth[l]);
      b_[l] = Eigen::Map<const RowVec>(p.b[l].data(), kWidth[l + 1]);
      vw_[l] = RowMat::Zero(kWidth[l + 1], kWidth[l]);  // 0.9 * 0 + g == g: torch's first step
      vb_[l] = RowVec::Zero(kWidth[l + 1]);
      gw_[l].resize(kWidth[l + 1], kWidth[l]);
      gb_[l].resize(kWidth[l + 1]);
      h_[l].resize(kBatch, kWidth[l + 1]);
      dh_[l].resize(kBatch, kWidth[l + 1]);
    }
  }

  /// One training step; returns the loss of its forward pass.
  float step() {
    // Forward: h_l = relu(h_{l-1} W_l^T + b_l); the logits h_2 without relu.
    for (int l = 0; l < 3; ++l) {
      h_[l].noalias() = input(l) * w_[l].transpose();
      RowMat& h = h_[l];
      const RowVec& b = b_[l];
      if (l < 2)
        for_rows(kBatch, threads_,
                 [&](Eigen::Index r) { h.row(r) = (h.row(r) + b).cwiseMax(0.f); });
      else
        h.rowwise() += b;
    }
    // Mean softmax cross entropy: loss_i = logsumexp(z_i) - z_i[y_i],
    // dz = (softmax(z) - onehot(y)) / B.
    const RowMat& z = h_[2];
    RowMat& dz = dh_[2];
    double loss = 0;
    for (Eigen::Index r = 0; r < kBatch; ++r) {
      const float m = z.row(r).maxCoeff();
      dz.row(r) = (z.row(r).array() - m).exp();
      const float s = dz.row(r).sum();
      loss += std::log(s) + m - z(r, y_[r]);
      dz.row(r) *= 1.f / (s * static_cast<float>(kBatch));
      dz(r, y_[r]) -= 1.f / static_cast<float>(kBatch);
    }
    // Backward: weight and bias gradients of every layer, input gradients through the
    // relu masks of layers 2 and 3.
    for (int l = 2; l >= 0; --l) {
      gw_[l].noalias() = dh_[l].transpose() * input(l);
      gb_[l].noalias() = dh_[l].colwise().sum();
      if (l > 0) {
        RowMat& dh = dh_[l - 1];
        const RowMat& h = h_[l - 1];
        dh.noalias() = dh_[l] * w_[l];
        for_rows(kBatch, threads_, [&](Eigen::Index r) {
          dh.row(r) = (h.row(r).array() > 0.f).select(dh.row(r), 0.f);
        });
      }
    }
    // SGD with momentum: v = 0.9 v + g; p -= lr v.
    for (int l = 0; l < 3; ++l) {
      RowMat &w = w_[l], &v = vw_[l];
      const RowMat& g = gw_[l];
      for_rows(w.rows(), threads_, [&](Eigen::Index r) {
        v.row(r) = kMomentum * v.row(r) + g.row(r);
        w.row(r) -= kLr * v.row(r);
      });
      vb_[l] = kMomentum * vb_[l] + gb_[l];
      b_[l] -= kLr * vb_[l];
    }
    return static_cast<float>(loss / kBatch);
  }

  /// The GEMMs of step() alone (same operands, shapes and outputs): the GEMM bound.
  void gemms_only() {
    for (int l = 0; l < 3; ++l) h_[l].noalias() = input(l) * w_[l].transpose();
    for (int l = 2; l >= 0; --l) {
      gw_[l].noalias() = dh_[l].transpose() * input(l);
      if (l > 0) dh_[l - 1].noalias() = dh_[l] * w_[l];
    }
  }

  const float* logits() const { return h_[2].data(); }

 private:
  // The input of layer l: the batch or the previous activation.
  Eigen::Ref<const RowMat> input(int l) const {
    if (l == 0) return x_;
    return h_[l - 1];
  }

  int threads_;
  Eigen::Map<const RowMat> x_;
  const std::int64_t* y_;
  std::array<RowMat, 3> w_, vw_, gw_, h_, dh_;
  std::array<RowVec, 3> b_, vb_, gb_;
};

void set_counters(benchmark::State& state) {
  const double iters = static_cast<double>(state.iterations());
  state.counters["samples"] =
      benchmark::Counter(iters * static_cast<double>(kBatch), benchmark::Counter::kIsRate);
  state.counters["GFLOP"] =
      benchmark::Counter(iters * static_cast<double>(kGemmFlop) / 1e9, benchmark::Counter::kIsRate);
}

// ---- lazytensor ------------------------------------------------------------------------------

struct LazyStep {
  LazyMlp m{Problem::get(), 0, kBatch};
  bool bf16_mixed = false;

  /// One step, materialized by its mark_step (which may return before the step ran: the
  /// device's executor thread runs it while the next one is traced).
  lazy::Tensor<float> step() {
    lazy::Tensor<float> loss = m.forward_backward(bf16_mixed);
    m.opt.step();
    lazy::mark_step();
    return loss;
  }
};

std::vector<double> lazy_losses() {
  bench::DeviceThreads threads(1);
  EigenThreads eigen(1);
  LazyStep m;
  std::vector<double> out;
  for (int i = 0; i < kCheckSteps; ++i) out.push_back(m.step().item());
  return out;
}

// ---- libtorch --------------------------------------------------------------------------------

#ifdef LAZYTENSOR_HAVE_TORCH
struct TorchMlp {
  torch::nn::Sequential model;
  torch::optim::SGD opt;
  torch::Tensor x, y;

  explicit TorchMlp(const Problem& p)
      : model(torch::nn::Linear(kWidth[0], kWidth[1]), torch::nn::ReLU(),
              torch::nn::Linear(kWidth[1], kWidth[2]), torch::nn::ReLU(),
              torch::nn::Linear(kWidth[2], kWidth[3])),
        opt(model->parameters(), torch::optim::SGDOptions(kLr).momentum(kMomentum)),
        x(torch::from_blob(const_cast<float*>(p.x_of(0)), {kBatch, kWidth[0]}).clone()),
        y(torch::from_blob(const_cast<std::int64_t*>(p.y_of(0)), {kBatch}, torch::kInt64).clone()) {
    auto params = model->parameters();  // W1, b1, W2, b2, W3, b3
    torch::NoGradGuard no_grad;
    for (int l = 0; l < 3; ++l) {
      params[2 * l].copy_(
          torch::from_blob(const_cast<float*>(p.w[l].data()), {kWidth[l + 1], kWidth[l]}));
      params[2 * l + 1].copy_(torch::from_blob(const_cast<float*>(p.b[l].data()), {kWidth[l + 1]}));
    }
  }

  torch::Tensor step() {
    model->zero_grad(/*set_to_none=*/true);  // as lazytensor's default (and PyTorch 2's)
    torch::Tensor loss = torch::nn::functional::cross_entropy(model->forward(x), y);
    loss.backward();
    opt.step();
    return loss;
  }
};

std::vector<double> torch_losses() {
  bench::set_torch_threads(1, 1);
  TorchMlp m(Problem::get());
  std::vector<double> out;
  for (int i = 0; i < kCheckSteps; ++i) out.push_back(m.step().item<double>());
  return out;
}
#endif

std::vector<double> eigen_losses() {
  EigenThreads guard(1);
  EigenMlp m(Problem::get(), 1);
  std::vector<double> out;
  for (int i = 0; i < kCheckSteps; ++i) out.push_back(m.step());
  return out;
}

// ---- self-check ------------------------------------------------------------------------------

/// Every variant's losses over kCheckSteps steps, compared to EigenEager's: "" when they agree
/// to kLossTolerance (relative) at every step and the loss fell, else what is wrong. Computed
/// once; the curves go to stderr.
const std::string& self_check() {
  static const std::string verdict = [] {
    std::vector<std::pair<std::string, std::vector<double>>> runs = {{"EigenEager", eigen_losses()},
                                                                     {"Lazy", lazy_losses()}};
#ifdef LAZYTENSOR_HAVE_TORCH
    runs.emplace_back("Torch", torch_losses());
#endif
    const auto& ref = runs[0].second;
    std::ostringstream report, failure;
    report.precision(7);
    failure.precision(8);
    for (const auto& [name, losses] : runs) {
      report << "  " << name << ":";
      for (std::size_t i = 0; i < losses.size(); ++i) {
        report << " " << losses[i];
        const double rel = std::abs(losses[i] - ref[i]) / std::abs(ref[i]);
        if (!(rel <= kLossTolerance)) {
          failure << name << "'s loss at step " << i + 1 << " is " << losses[i] << ", EigenEager's "
                  << ref[i] << " (relative difference " << rel << "); ";
          break;
        }
      }
      report << "\n";
    }
    // The comparison only means something if training moves the loss by much more than
    // the tolerance.
    if (!(ref.front() - ref.back() > 100 * kLossTolerance * ref.front()))
      failure << "the loss did not fall over " << kCheckSteps << " steps (" << ref.front() << " -> "
              << ref.back() << ")";
    std::fprintf(stderr, "mlp step self-check on %s, losses of the first %d steps:\n%s",
                 Problem::get().source.c_str(), kCheckSteps, report.str().c_str());
    return failure.str();
  }();
  return verdict;
}

bool passes_self_check(benchmark::State& state) {
  return bench::check(state, self_check().empty(), self_check());
}

// ---- benchmarks ------------------------------------------------------------------------------

void run_lazy(benchmark::State& state, bool bf16_mixed) {
  if (!passes_self_check(state)) return;
  const int threads = static_cast<int>(state.range(0));
  bench::DeviceThreads device_threads(threads);
  EigenThreads eigen(1);  // lazytensor splits its GEMMs over its own workers
  LazyStep m;
  m.bf16_mixed = bf16_mixed;
  for (int i = 0; i < kWarmupSteps; ++i) m.step();
  lazy::wait_device_ops();
  // Steady state: no new pages (minor faults) and no fresh pool allocations per step.
  auto minor_faults = [] {
    rusage u{};
    getrusage(RUSAGE_SELF, &u);
    return static_cast<double>(u.ru_minflt);
  };
  auto& pool = lazy::graph::current_device().pool();
  const double faults0 = minor_faults();
  const auto fresh0 = pool.stats().fresh_allocations;
  benchmark::IterationCount i = 0;
  for (auto _ : state) {
    lazy::Tensor<float> loss = m.step();
    benchmark::DoNotOptimize(loss.node().get());
    if (++i == state.max_iterations) lazy::wait_device_ops();  // the last step inside the time
  }
  const double steps = static_cast<double>(std::max<benchmark::IterationCount>(1, state.iterations()));
  state.counters["minflt_per_step"] = (minor_faults() - faults0) / steps;
  state.counters["fresh_allocs_per_step"] = static_cast<double>(pool.stats().fresh_allocations - fresh0) / steps;
  set_counters(state);
}

void BM_MlpStep_Lazy(benchmark::State& state) {
  settle(__func__);
  run_lazy(state, false);
}

/// The same step under precision "bf16-mixed" (autocast: the forward's products in bfloat16
/// with float accumulation), against BM_MlpStep_Lazy.
void BM_MlpStep_LazyBF16Mixed(benchmark::State& state) {
  settle(__func__);
  run_lazy(state, true);
}

#ifdef LAZYTENSOR_HAVE_TORCH
/// libtorch's step with `intra_op` intra-op threads and `threads` OpenBLAS threads.
void run_torch(benchmark::State& state, int intra_op, int threads) {
  if (!passes_self_check(state)) return;
  bench::set_torch_threads(intra_op, threads);
  if (!bench::check(state, torch::get_num_threads() == intra_op,
                    "libtorch did not take the thread count"))
    return;
  const int blas = bench::blas_threads();
  if (!bench::check(state, blas == -1 || blas == threads, "OpenBLAS did not take the thread count"))
    return;
  TorchMlp m(Problem::get());
  for (int i = 0; i < kWarmupSteps; ++i) m.step();
  for (auto _ : state) {
    torch::Tensor loss = m.step();
    benchmark::DoNotOptimize(loss.data_ptr());
  }
  set_counters(state);
  state.counters["blas_threads"] = blas;
}

void BM_MlpStep_Torch(benchmark::State& state) {
  settle(__func__);
  const int threads = static_cast<int>(state.range(0));
  run_torch(state, threads, threads);
}

void BM_MlpStep_TorchBlasOnly(benchmark::State& state) {
  settle(__func__);
  run_torch(state, 1, static_cast<int>(state.range(0)));
}
#endif

void BM_MlpStep_EigenEager(benchmark::State& state) {
  if (!passes_self_check(state)) return;
  settle(__func__);
  const int threads = static_cast<int>(state.range(0));
  EigenThreads eigen(threads);
  if (!bench::check(state, Eigen::nbThreads() == threads,
                    "Eigen cannot use that many threads (built without OpenMP)"))
    return;
  EigenMlp m(Problem::get(), threads);
  for (int i = 0; i < kWarmupSteps; ++i) m.step();
  for (auto _ : state) {
    benchmark::DoNotOptimize(m.step());
    benchmark::ClobberMemory();
  }
  set_counters(state);
}

void BM_MlpStep_GemmBound(benchmark::State& state) {
  if (!passes_self_check(state)) return;
  settle(__func__);
  const int threads = static_cast<int>(state.range(0));
  EigenThreads eigen(threads);
  if (!bench::check(state, Eigen::nbThreads() == threads,
                    "Eigen cannot use that many threads (built without OpenMP)"))
    return;
  EigenMlp m(Problem::get(), threads);
  m.step();  // activations and gradients of a real step
  for (int i = 0; i < kWarmupSteps; ++i) m.gemms_only();
  for (auto _ : state) {
    m.gemms_only();
    benchmark::DoNotOptimize(m.logits());
    benchmark::ClobberMemory();
  }
  set_counters(state);
}

}  // namespace

BENCHMARK(BM_MlpStep_Lazy)->Arg(1)->Arg(2)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_MlpStep_LazyBF16Mixed)->Arg(1)->Arg(2)->UseRealTime()->Unit(benchmark::kMillisecond);
#ifdef LAZYTENSOR_HAVE_TORCH
BENCHMARK(BM_MlpStep_Torch)->Arg(1)->Arg(2)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_MlpStep_TorchBlasOnly)->Arg(2)->UseRealTime()->Unit(benchmark::kMillisecond);
#endif
BENCHMARK(BM_MlpStep_EigenEager)->Arg(1)->Arg(2)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_MlpStep_GemmBound)->Arg(1)->Arg(2)->UseRealTime()->Unit(benchmark::kMillisecond);

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::AddCustomContext("mlp_step_data", Problem::get().source);
  benchmark::AddCustomContext("mlp_step_gemm_flop",
                              std::to_string(kGemmFlop) +
                                  " per step (3 forward, 3 weight-gradient and 2 input-gradient "
                                  "GEMMs)");
#ifdef LAZYTENSOR_HAVE_TORCH
  // The inter-op pool can be sized once, before any parallel work; a plain training step
  // does not use it, and 1 keeps libtorch from holding more threads than T.
  try {
    at::set_num_interop_threads(1);
  } catch (const std::exception&) {
  }
  benchmark::AddCustomContext("torch_blas", bench::torch_blas_info());
  benchmark::AddCustomContext("torch_interop_threads",
                              std::to_string(at::get_num_interop_threads()));
#endif
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
