// optim/lr_scheduler: schedulers chain as torch's do (each step multiplies the current rate
// by its factor, so two schedulers on one optimizer compose, and a rate set by hand between
// steps is kept), set_last_epoch resumes at the closed form from the initial rates, and
// non-finite arguments are refused. Expected rates are worked out by hand or by the
// reference below: torch's documented recursive formulas, written out in double.
#include <cmath>
#include <cstdint>
#include <functional>
#include <numbers>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include <lazytensor/lazytensor.hpp>
#include <lazytensor/optim.hpp>

namespace {

namespace optim = lazy::optim;
using std::int64_t;

// torch.optim.lr_scheduler's get_lr (the chainable form): the rate after step e from the
// group's current rate lr (and its initial rate base, which CosineAnnealingLR needs).
double ref_step(double lr, int64_t e, int64_t step_size, double gamma) {
  return (e == 0 || e % step_size != 0) ? lr : lr * gamma;
}

double ref_cosine(double lr, double base, int64_t e, int64_t T, double eta_min) {
  const double pi = std::numbers::pi;
  if (e == 0) return lr;
  if ((e - 1 - T) % (2 * T) == 0) return lr + (base - eta_min) * (1 - std::cos(pi / T)) / 2;
  return (1 + std::cos(pi * e / T)) / (1 + std::cos(pi * (e - 1) / T)) * (lr - eta_min) + eta_min;
}

double ref_linear(double lr, int64_t e, double start, double end, int64_t total) {
  if (e == 0) return lr * start;
  if (e > total) return lr;
  return lr * (1.0 + (end - start) / (total * start + (e - 1) * (end - start)));
}

// One-group SGD over a throwaway parameter.
optim::SGD sgd(double lr) { return optim::SGD({lazy::AnyTensor(lazy::zeros<float>({1}))}, optim::SGDOptions(lr)); }

// f() throws lazy::Error whose message holds every one of `parts`.
void expect_error(const std::function<void()>& f, const std::vector<std::string>& parts) {
  try {
    f();
    ADD_FAILURE() << "no error";
  } catch (const lazy::Error& e) {
    for (const auto& s : parts) EXPECT_NE(std::string(e.what()).find(s), std::string::npos) << e.what();
  }
}

TEST(SchedulerChaining, WarmupThenStepDecayComposeAsTorch) {
  // The review's repro: LinearLR warm-up then StepLR on one optimizer, stepped in turn.
  auto opt = sgd(0.1);
  optim::LinearLR warm(opt, 0.1, 1.0, 5);
  optim::StepLR decay(opt, 10, 0.5);
  EXPECT_NEAR(opt.lr(), 0.01, 1e-15);
  // By hand: 0.01 * (1 + 0.9 / (0.5 + 0.9 (t-1))) = 0.028, 0.046, 0.064, 0.082, 0.1; then
  // constant until the decay halves it at t = 10 and t = 20.
  const std::vector<double> hand{0.028, 0.046, 0.064, 0.082, 0.1, 0.1, 0.1, 0.1, 0.1, 0.05};
  for (int64_t t = 1; t <= 25; ++t) {
    warm.step();
    decay.step();
    const double want = t <= 10 ? hand[static_cast<std::size_t>(t - 1)] : t < 20 ? 0.05 : 0.025;
    EXPECT_NEAR(opt.lr(), want, 1e-12) << "t=" << t;
  }
  // get_last_lr is what each scheduler set at its last step (torch's _last_lr).
  EXPECT_NEAR(decay.get_last_lr().at(0), 0.025, 1e-12);
  EXPECT_EQ(warm.last_epoch(), 25);
}

TEST(SchedulerChaining, GetLastLrIsTheSchedulersOwnLastRate) {
  auto opt = sgd(0.1);
  optim::LinearLR warm(opt, 0.1, 1.0, 5);
  optim::StepLR decay(opt, 10, 0.5);
  for (int t = 1; t <= 10; ++t) {
    warm.step();
    decay.step();
  }
  EXPECT_NEAR(warm.get_last_lr().at(0), 0.1, 1e-12);    // before the decay's step 10
  EXPECT_NEAR(decay.get_last_lr().at(0), 0.05, 1e-12);  // after it
}

TEST(SchedulerChaining, CosineAndStepOnTwoGroupsFollowTheRecursiveForms) {
  const double lr0 = 0.2, lr1 = 0.05;
  optim::SGD opt(std::vector<optim::SGD::ParamGroup>{
      {{lazy::AnyTensor(lazy::zeros<float>({1}))}, optim::SGDOptions(lr0)},
      {{lazy::AnyTensor(lazy::zeros<float>({1}))}, optim::SGDOptions(lr1)}});
  const int64_t T = 6;
  const double eta_min = 0.001;
  optim::CosineAnnealingLR cos(opt, T, eta_min);
  optim::StepLR decay(opt, 4, 0.7);
  std::vector<double> lr{lr0, lr1};
  const std::vector<double> base{lr0, lr1};
  // Past T_max (into the rising half and the next period) for the recursion's special case.
  for (int64_t e = 1; e <= 3 * T + 1; ++e) {
    cos.step();
    decay.step();
    for (std::size_t g = 0; g < 2; ++g) {
      lr[g] = ref_step(ref_cosine(lr[g], base[g], e, T, eta_min), e, 4, 0.7);
      EXPECT_NEAR(opt.lr(g), lr[g], 1e-12) << "e=" << e << " g=" << g;
    }
  }
}

TEST(SchedulerChaining, WarmupThenCosineFollowTheRecursiveForms) {
  // The cosine is built after the warm-up scaled the rate: its base is still the initial 0.3.
  auto opt = sgd(0.3);
  optim::LinearLR warm(opt, 0.25, 1.0, 4);
  optim::CosineAnnealingLR cos(opt, 10, 0.002);
  double lr = 0.3 * 0.25;
  EXPECT_NEAR(opt.lr(), lr, 1e-15);
  for (int64_t e = 1; e <= 25; ++e) {
    warm.step();
    cos.step();
    lr = ref_cosine(ref_linear(lr, e, 0.25, 1.0, 4), 0.3, e, 10, 0.002);
    EXPECT_NEAR(opt.lr(), lr, 1e-12) << e;
  }
}

TEST(SchedulerChaining, ARateSetByHandBetweenStepsIsKept) {
  auto a = sgd(1.0);
  optim::StepLR step(a, 3, 0.5);
  step.step();
  step.step();
  a.set_lr(0.4);
  step.step();  // step 3: 0.4 * 0.5
  EXPECT_DOUBLE_EQ(a.lr(), 0.2);
  step.step();
  EXPECT_DOUBLE_EQ(a.lr(), 0.2);

  auto b = sgd(0.3);
  optim::LinearLR lin(b, 0.5, 1.0, 4);
  lin.step();  // 0.15 * (1 + 0.5 / 2) = 0.1875
  EXPECT_NEAR(b.lr(), 0.1875, 1e-15);
  b.set_lr(0.1);
  lin.step();  // 0.1 * (1 + 0.5 / 2.5) = 0.12
  EXPECT_NEAR(b.lr(), 0.12, 1e-15);

  auto c = sgd(0.2);
  const int64_t T = 5;
  optim::CosineAnnealingLR cos(c, T, 0.01);
  double lr = 0.2;
  for (int64_t e = 1; e <= 8; ++e) {
    if (e == 3) c.set_lr(lr = 0.5);
    cos.step();
    lr = ref_cosine(lr, 0.2, e, T, 0.01);
    EXPECT_NEAR(c.lr(), lr, 1e-12) << e;
  }
}

TEST(SchedulerChaining, LaterSchedulersTakeTheirBaseFromTheInitialRate) {
  // The warm-up scaled the rate to 0.01 before the decay was built; the decay's closed form
  // (what set_last_epoch resumes at) starts from the initial 0.1, as torch's initial_lr.
  auto opt = sgd(0.1);
  optim::LinearLR warm(opt, 0.1, 1.0, 5);
  optim::StepLR decay(opt, 10, 0.5);
  decay.set_last_epoch(10);
  EXPECT_NEAR(opt.lr(), 0.05, 1e-15);
  decay.set_last_epoch(25);
  EXPECT_NEAR(opt.lr(), 0.025, 1e-15);
  warm.set_last_epoch(2);  // 0.1 * (0.1 + 0.9 * 2 / 5)
  EXPECT_NEAR(opt.lr(), 0.046, 1e-15);
}

TEST(SchedulerResume, SetLastEpochIsTheClosedFormAndSteppingContinuesIt) {
  const double pi = std::numbers::pi;
  for (int64_t n : {0, 1, 3, 7, 10, 13, 21}) {
    auto a = sgd(0.8);
    optim::StepLR step(a, 3, 0.5);
    step.set_last_epoch(n);
    EXPECT_EQ(step.last_epoch(), n);
    for (int64_t e = n; e <= n + 7; ++e) {
      if (e > n) step.step();
      EXPECT_NEAR(a.lr(), 0.8 * std::pow(0.5, static_cast<double>(e / 3)), 1e-12) << n << " " << e;
    }
    auto b = sgd(0.2);
    optim::CosineAnnealingLR cos(b, 10, 0.01);
    cos.set_last_epoch(n);
    for (int64_t e = n; e <= n + 25; ++e) {
      if (e > n) cos.step();
      EXPECT_NEAR(b.lr(), 0.01 + 0.19 * (1 + std::cos(pi * e / 10)) / 2, 1e-12) << n << " " << e;
    }
    auto c = sgd(0.3);
    optim::LinearLR lin(c, 0.5, 1.0, 4);
    // After a load_state_dict the rate is the saved one; set_last_epoch overrides it anyway.
    c.set_lr(0.123);
    lin.set_last_epoch(n);
    for (int64_t e = n; e <= n + 6; ++e) {
      if (e > n) lin.step();
      EXPECT_NEAR(c.lr(), 0.3 * (e >= 4 ? 1.0 : 0.5 + 0.5 * e / 4.0), 1e-12) << n << " " << e;
    }
  }
}

TEST(SchedulerResume, TheTrainersRestoreOrderContinuesTheRun) {
  // As Trainer::restore_checkpoint: a fresh optimizer and scheduler (configure_optimizers),
  // then the saved optimizer state, then set_last_epoch; the rates go on as the run's would.
  const double pi = std::numbers::pi;
  auto orig = sgd(0.2);
  optim::CosineAnnealingLR cos(orig, 8, 0.01);
  for (int e = 1; e <= 5; ++e) cos.step();
  const lazy::StateDict saved = orig.state_dict();
  auto resumed = sgd(0.2);
  optim::CosineAnnealingLR again(resumed, 8, 0.01);
  resumed.load_state_dict(saved);
  again.set_last_epoch(cos.last_epoch());
  for (int64_t e = 5; e <= 20; ++e) {
    if (e > 5) {
      cos.step();
      again.step();
    }
    const double want = 0.01 + 0.19 * (1 + std::cos(pi * e / 8)) / 2;
    EXPECT_NEAR(orig.lr(), want, 1e-12) << e;
    EXPECT_NEAR(resumed.lr(), want, 1e-12) << e;
  }
}

TEST(SchedulerGroups, AGroupAddedLaterIsScheduledFromItsOwnRate) {
  auto opt = sgd(1.0);
  optim::StepLR step(opt, 2, 0.5);
  step.step();
  opt.add_param_group({{lazy::AnyTensor(lazy::zeros<float>({1}))}, optim::SGDOptions(0.4)});
  step.step();  // step 2 decays every group, as torch's chainable StepLR
  EXPECT_DOUBLE_EQ(opt.lr(0), 0.5);
  EXPECT_DOUBLE_EQ(opt.lr(1), 0.2);
  EXPECT_EQ(step.get_last_lr().size(), 2u);
  step.step();
  EXPECT_DOUBLE_EQ(opt.lr(1), 0.2);
  // Its initial rate is the one it had when the scheduler first met it.
  step.set_last_epoch(4);
  EXPECT_DOUBLE_EQ(opt.lr(0), 0.25);
  EXPECT_DOUBLE_EQ(opt.lr(1), 0.1);
}

TEST(SchedulerArguments, NonFiniteValuesAreRefused) {
  const double nan = std::nan(""), inf = HUGE_VAL;
  auto opt = sgd(0.1);
  expect_error([&] { optim::StepLR(opt, 2, nan); }, {"StepLR", "gamma", "nan"});
  expect_error([&] { optim::StepLR(opt, 2, inf); }, {"StepLR", "gamma", "inf"});
  expect_error([&] { optim::StepLR(opt, 2, -inf); }, {"StepLR", "gamma", "-inf"});
  expect_error([&] { optim::CosineAnnealingLR(opt, 5, nan); }, {"CosineAnnealingLR", "eta_min", "nan"});
  expect_error([&] { optim::CosineAnnealingLR(opt, 5, inf); }, {"CosineAnnealingLR", "eta_min", "inf"});
  expect_error([&] { optim::LinearLR(opt, nan, 1.0, 5); }, {"LinearLR", "start_factor", "nan"});
  expect_error([&] { optim::LinearLR(opt, 0.5, nan, 5); }, {"LinearLR", "end_factor", "nan"});
  expect_error([&] { optim::LinearLR(opt, inf, 1.0, 5); }, {"LinearLR", "start_factor", "inf"});
  expect_error([&] { optim::LinearLR(opt, 0.0, 1.0, 5); }, {"LinearLR", "start_factor", "0"});
  expect_error([&] { optim::LinearLR(opt, 0.5, 1.5, 5); }, {"LinearLR", "end_factor", "1.5"});
  // A refused scheduler leaves the rate alone.
  EXPECT_EQ(opt.lr(), 0.1);
  // Finite values still pass.
  optim::StepLR ok(opt, 2, 0.5);
  optim::CosineAnnealingLR ok2(opt, 5, 0.0);
  optim::LinearLR ok3(opt, 1.0, 0.0, 5);
  EXPECT_EQ(opt.lr(), 0.1);
}

}  // namespace
