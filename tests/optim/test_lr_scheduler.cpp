// optim/lr_scheduler: schedulers chain as torch's do (each step multiplies the current rate
// by its factor, so two schedulers on one optimizer compose, and a rate set by hand between
// steps is kept), set_last_epoch resumes at the closed form from the initial rates, and
// non-finite arguments are refused. Expected rates are worked out by hand or by the
// reference below: torch's documented recursive formulas, written out in double.
#include <cmath>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
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

// ---- initial_lr in the optimizer's state dict (torch's param_groups[g]["initial_lr"]) ----

TEST(SchedulerResume, TheOptimizersStateDictCarriesTheInitialRate) {
  auto opt = sgd(0.1);
  optim::StepLR decay(opt, 2, 0.1);
  for (int e = 1; e <= 4; ++e) decay.step();  // 0.1 -> 0.01 (step 2) -> 0.001 (step 4)
  const lazy::StateDict saved = opt.state_dict();
  ASSERT_TRUE(saved.metadata().count("param_groups.0.initial_lr"));
  EXPECT_EQ(saved.metadata().at("param_groups.0.initial_lr"), "0.1");
  // torch's resume: optimizer.load_state_dict, then a scheduler built on it takes the
  // run's initial rate (0.1) as its base, not the loaded rate (0.001).
  auto resumed = sgd(0.5);
  resumed.load_state_dict(saved);
  ASSERT_TRUE(resumed.initial_lr(0).has_value());
  EXPECT_EQ(*resumed.initial_lr(0), 0.1);
  EXPECT_NEAR(resumed.lr(), 0.001, 1e-15);
  optim::StepLR again(resumed, 2, 0.1);
  again.set_last_epoch(4);
  EXPECT_NEAR(resumed.lr(), 0.001, 1e-15);
  again.step();  // step 5
  EXPECT_NEAR(resumed.lr(), 0.001, 1e-15);
  again.step();  // step 6: 0.1 * 0.1^3
  EXPECT_NEAR(resumed.lr(), 0.0001, 1e-16);
}

TEST(SchedulerResume, AnOptimizerWithoutSchedulerSavesNoInitialRate) {
  auto opt = sgd(0.3);
  EXPECT_FALSE(opt.state_dict().metadata().count("param_groups.0.initial_lr"));
  // A group saved without one keeps the initial rate it has.
  auto other = sgd(0.7);
  optim::StepLR s(other, 2, 0.5);
  other.load_state_dict(opt.state_dict());
  EXPECT_EQ(other.lr(), 0.3);
  EXPECT_EQ(*other.initial_lr(0), 0.7);
  // A malformed one is refused, and nothing changes.
  lazy::StateDict bad = opt.state_dict();
  bad.metadata()["param_groups.0.initial_lr"] = "fast";
  expect_error([&] { other.load_state_dict(bad); }, {"initial_lr", "fast"});
  EXPECT_EQ(*other.initial_lr(0), 0.7);
}

// ---- ChainedScheduler and SequentialLR (torch's semantics, rates worked out by hand) ------

// LinearLR(0.1 -> 1 over 3 steps) until step 3, then StepLR(2, 0.5) restarted at step 0:
// torch's SequentialLR rates at steps 0..7 with lr 0.1.
const std::vector<double> kSequentialRates{0.01, 0.04, 0.07, 0.1, 0.1, 0.05, 0.05, 0.025};

struct Sequential {
  optim::SGD opt = sgd(0.1);
  std::shared_ptr<optim::LinearLR> warm = std::make_shared<optim::LinearLR>(opt, 0.1, 1.0, 3);
  std::shared_ptr<optim::StepLR> decay = std::make_shared<optim::StepLR>(opt, 2, 0.5);
  optim::SequentialLR seq{opt, {warm, decay}, {3}};
};

TEST(SequentialLR, SwitchesAtTheMilestoneAndRestartsTheNextSchedulerAtStepZero) {
  Sequential s;
  for (std::size_t e = 0; e < kSequentialRates.size(); ++e) {
    if (e > 0) s.seq.step();
    EXPECT_NEAR(s.opt.lr(), kSequentialRates[e], 1e-15) << "step " << e;
    ASSERT_EQ(s.seq.get_last_lr().size(), 1u);
    EXPECT_NEAR(s.seq.get_last_lr()[0], kSequentialRates[e], 1e-15) << "step " << e;
    EXPECT_EQ(s.seq.last_epoch(), static_cast<int64_t>(e));
  }
  // The second scheduler counts from the milestone (torch's step(0) there).
  EXPECT_EQ(s.decay->last_epoch(), 4);
}

TEST(SequentialLR, SetLastEpochAndStateDictResumeTheRun) {
  for (std::size_t n = 0; n < kSequentialRates.size(); ++n) {
    Sequential s;
    s.seq.set_last_epoch(static_cast<int64_t>(n));
    EXPECT_NEAR(s.opt.lr(), kSequentialRates[n], 1e-15) << "set_last_epoch(" << n << ")";
  }
  // torch's resume: a fresh optimizer and schedulers, the optimizer's state dict, then the
  // scheduler's; stepping goes on as the uninterrupted run.
  Sequential run;
  for (int e = 1; e <= 4; ++e) run.seq.step();
  const lazy::StateDict opt_state = run.opt.state_dict();
  const std::map<std::string, std::string> state = run.seq.state_dict();
  EXPECT_EQ(state.at("last_epoch"), "4");
  EXPECT_EQ(state.at("_milestones.0"), "3");
  EXPECT_EQ(state.at("_schedulers.1.last_epoch"), "1");
  Sequential resumed;
  resumed.opt.load_state_dict(opt_state);
  resumed.seq.load_state_dict(state);
  EXPECT_EQ(resumed.seq.last_epoch(), 4);
  for (std::size_t e = 5; e < kSequentialRates.size(); ++e) {
    resumed.seq.step();
    EXPECT_NEAR(resumed.opt.lr(), kSequentialRates[e], 1e-15) << "step " << e;
  }
}

TEST(SequentialLR, BadArgumentsAreRefused) {
  auto opt = sgd(0.1);
  auto other = sgd(0.1);
  auto a = std::make_shared<optim::StepLR>(opt, 2, 0.5);
  auto b = std::make_shared<optim::StepLR>(opt, 3, 0.5);
  auto elsewhere = std::make_shared<optim::StepLR>(other, 3, 0.5);
  expect_error([&] { optim::SequentialLR(opt, {}, {}); },
               {"SequentialLR", "at least one scheduler"});
  expect_error(
      [&] {
        optim::SequentialLR(opt, {a, b}, {});
      },
      {"SequentialLR", "1 for 2 schedulers", "found 0"});
  expect_error([&] { optim::SequentialLR(opt, {a, b}, {2, 4}); }, {"SequentialLR", "found 2"});
  expect_error(
      [&] {
        optim::SequentialLR(opt, {a, elsewhere}, {2});
      },
      {"SequentialLR", "scheduler 1"});
  expect_error(
      [&] {
        optim::SequentialLR(opt, {a, nullptr}, {2});
      },
      {"SequentialLR", "scheduler 1", "empty"});
  expect_error(
      [&] {
        optim::SequentialLR(opt, {a, b, a}, {4, 2});
      },
      {"SequentialLR", "non-decreasing", "4", "2"});
  optim::SequentialLR ok(opt, {a, b}, {2});
  expect_error(
      [&] {
        ok.load_state_dict({{"last_epoch", "1"}});
      },
      {"SequentialLR", "2 schedulers", "found 0"});
  // A saved state holds the milestones too: out of order there is the constructor's error.
  optim::SequentialLR three(opt, {a, b, a}, {2, 4});
  auto saved = three.state_dict();
  saved["_milestones.0"] = "5";
  expect_error([&] { three.load_state_dict(saved); },
               {"SequentialLR::load_state_dict", "non-decreasing", "5 before 4"});
}

TEST(ChainedScheduler, StepsEverySchedulerSoTheirFactorsMultiply) {
  // LinearLR(0.5 -> 1 over 2 steps) and StepLR(1, 0.9) (an ExponentialLR(0.9)) on lr 1:
  // torch's ChainedScheduler gives 0.9^e * (0.5, 0.75, 1, 1, ...)[e].
  const std::vector<double> want{0.5, 0.675, 0.81, 0.729, 0.6561, 0.59049};
  auto opt = sgd(1.0);
  auto warm = std::make_shared<optim::LinearLR>(opt, 0.5, 1.0, 2);
  auto decay = std::make_shared<optim::StepLR>(opt, 1, 0.9);
  optim::ChainedScheduler chain({warm, decay});
  for (std::size_t e = 0; e < want.size(); ++e) {
    if (e > 0) chain.step();
    EXPECT_NEAR(opt.lr(), want[e], 1e-14) << "step " << e;
    EXPECT_NEAR(chain.get_last_lr().at(0), want[e], 1e-14) << "step " << e;
  }
  // Resumed by the scheduler's state dict (after the optimizer's), or by set_last_epoch.
  const lazy::StateDict opt_state = opt.state_dict();
  const auto state = chain.state_dict();
  EXPECT_EQ(state.at("_schedulers.0.last_epoch"), "5");
  auto opt2 = sgd(1.0);
  optim::ChainedScheduler chain2({std::make_shared<optim::LinearLR>(opt2, 0.5, 1.0, 2),
                                  std::make_shared<optim::StepLR>(opt2, 1, 0.9)},
                                 &opt2);
  opt2.load_state_dict(opt_state);
  chain2.load_state_dict(state);
  chain2.step();
  EXPECT_NEAR(opt2.lr(), 0.531441, 1e-14);
  for (std::size_t n = 0; n < want.size(); ++n) {
    chain2.set_last_epoch(static_cast<int64_t>(n));
    EXPECT_NEAR(opt2.lr(), want[n], 1e-14) << "set_last_epoch(" << n << ")";
  }
}

TEST(ChainedScheduler, BadArgumentsAreRefused) {
  auto opt = sgd(0.1);
  auto other = sgd(0.1);
  auto a = std::make_shared<optim::StepLR>(opt, 2, 0.5);
  auto b = std::make_shared<optim::StepLR>(other, 2, 0.5);
  expect_error([] { optim::ChainedScheduler(std::vector<std::shared_ptr<optim::LRScheduler>>{}); },
               {"ChainedScheduler", "at least one scheduler"});
  expect_error(
      [&] {
        optim::ChainedScheduler({a, b});
      },
      {"ChainedScheduler", "scheduler 1", "another optimizer"});
  expect_error([&] { optim::ChainedScheduler({a}, &other); }, {"ChainedScheduler", "scheduler 0"});
  optim::ChainedScheduler ok({a});
  expect_error(
      [&] {
        ok.load_state_dict({{"last_epoch", "x"}});
      },
      {"ChainedScheduler", "last_epoch", "x"});
}

}  // namespace
