#pragma once
// The Trainer's loops: fit (sanity check, training epochs with validation, checkpoints and
// stops), validate, test and predict, in Lightning's order of hooks. Every replica runs the
// same loop on its own module, optimizer, callbacks' copies and share of the data; every
// decision that changes what replicas do next (stop, validate, save) is taken at the same
// point on all of them from values they agree on.

#include <chrono>
#include <cstdint>
#include <exception>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <typeinfo>
#include <utility>
#include <vector>

#include <lazytensor/core/config.hpp>
#include <lazytensor/core/error.hpp>
#include <lazytensor/io/safetensors.hpp>
#include <lazytensor/train/accelerator.hpp>
#include <lazytensor/train/replica_loader.hpp>
#include <lazytensor/train/trainer.hpp>

namespace lazy::train {
namespace detail {

/// Batches in an epoch of `loader` (-1 when it cannot say).
template <class L>
std::int64_t loader_batches(L& loader) {
  if constexpr (requires { loader.size(); }) {
    return static_cast<std::int64_t>(loader.size());
  } else {
    return -1;
  }
}

/// The number of samples in `batch`: the first dimension of its first tensor (1 for a
/// scalar or a batch without tensors).
template <class B>
std::int64_t batch_size_of(const B& b) {
  if constexpr (is_tensor<B>::value) {
    return b.defined() && b.dim() > 0 ? b.shape()[0] : 1;
  } else if constexpr (requires { b.data; b.target; }) {
    return batch_size_of(b.data);
  } else if constexpr (requires { std::get<0>(b); }) {
    return batch_size_of(std::get<0>(b));
  } else if constexpr (requires { b.empty(); b.front(); }) {
    return b.empty() ? 1 : batch_size_of(b.front());
  } else {
    return 1;
  }
}

/// `loss` (a one-element floating tensor from training_step) checked and scaled by `f`.
/// A template only so that it compiles where a loop calls it (and, with the compiled
/// runtime, only in the library): its switch over the dtypes holds an element-wise kernel
/// of every floating dtype, which a program that includes train.hpp must not pay for.
template <class = void>
AnyTensor checked_loss(const AnyTensor& loss, double f);

/// Seed of epoch `epoch` on rank `rank` from the run's seed (splitmix64 of the three).
inline std::uint64_t epoch_seed(std::uint64_t seed, std::int64_t epoch, int rank) {
  std::uint64_t z = seed ^ (static_cast<std::uint64_t>(epoch) * 0x9E3779B97F4A7C15ull) ^
                    (static_cast<std::uint64_t>(rank) << 48);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

/// Runs a user step, turning a missing override into an Error naming it.
template <class F>
decltype(auto) user_step(F&& f) {
  try {
    return std::forward<F>(f)();
  } catch (const StepNotOverridden& missing) {
    throw Error(std::string("Trainer: the LightningModule does not override ") + missing.step +
                " (needed by this loop)");
  }
}

}  // namespace detail

template <class M, class Loader, class Run>
auto Trainer::launch_replicas(M& module, Run run_fn) {
  static_assert(std::is_base_of_v<LightningModuleBase, M>, "Trainer: the module must derive from LightningModule<Batch>");
  const int n = strategy_->num_processes();
  // A new run continues where the last one stopped (test() after fit() logs at fit's step).
  std::vector<std::pair<detail::Progress, std::map<std::string, double>>> kept;
  for (const auto& r : runs_) kept.emplace_back(r->progress, r->metrics.callback_metrics());
  runs_.clear();
  for (int i = 0; i < n; ++i) {
    runs_.push_back(std::make_unique<detail::ReplicaRun>(*strategy_));
    if (static_cast<std::size_t>(i) < kept.size()) {
      runs_.back()->progress = kept[static_cast<std::size_t>(i)].first;
      runs_.back()->metrics.set_callback_metrics(kept[static_cast<std::size_t>(i)].second);
    }
    // Copies made here, before any replica runs a hook that changes the originals. The
    // first replica of each process keeps them (under MPI each process has its own, as
    // each Lightning process has).
    for (const auto& cb : callbacks_) {
      std::shared_ptr<Callback> copy = i == 0 ? nullptr : cb->clone();
      runs_.back()->callbacks.push_back(copy ? copy : cb);
      runs_.back()->shared_callback.push_back(i != 0 && !copy);
    }
  }
  return strategy_->launch([&](Strategy& s) {
    detail::ReplicaRun& r = run();
    // The first replica of each process trains the caller's module (under MPI every
    // process's caller ends with a trained module, as with Lightning's DDP); the others
    // train copies of their own. The strategy's setup gives them all rank zero's weights.
    const auto* ctx = dist::detail::current_context();
    const bool first_here = !ctx || ctx->local == 0;
    std::shared_ptr<M> own;
    M* m = &module;
    if (!first_here) {
      if constexpr (std::is_default_constructible_v<M>) {
        own = std::make_shared<M>();
        own->hparams = module.hparams;
        m = own.get();
      } else {
        throw Error(std::string("Trainer: with replicas every replica trains its own module, so the module type (") +
                    typeid(M).name() + ") must be default-constructible");
      }
    }
    begin_replica(*m);
    r.running = true;
    struct Detach {
      M* m;
      detail::ReplicaRun* r;
      ~Detach() {
        m->metrics_ = nullptr;
        r->running = false;
      }
    } detach{m, &r};
    try {
      return run_fn(s, *m, r);
    } catch (const std::exception& e) {
      call_on_exception(e);
      throw;
    }
  });
}

template <class M, class Loader>
std::map<std::string, double> Trainer::eval_epoch(M& m, Loader& data, detail::Loop loop, std::int64_t limit) {
  detail::ReplicaRun& r = run();
  const detail::Loop outer = r.stage;
  r.stage = loop;
  r.metrics.start_epoch(loop);
  auto acc = make_accelerator(options_.accelerator, *strategy_);
  const bool validating = loop == detail::Loop::Validate || loop == detail::Loop::Sanity;
  if (validating) {
    r.num_val_batches = limit;
    each_callback([&](Callback& c) { c.on_validation_epoch_start(*this, m); });
    m.on_validation_epoch_start();
  } else {
    m.on_test_epoch_start();
  }
  m.eval();
  std::int64_t idx = 0;
  if (limit != 0) {
    for (auto& batch : data) {
      if (limit >= 0 && idx >= limit) break;
      if (validating) {
        acc->validation_step([&] { detail::user_step([&] { m.validation_step(batch, idx); }); });
        each_callback([&](Callback& c) { c.on_validation_batch_end(*this, m, idx); });
      } else {
        acc->test_step([&] { detail::user_step([&] { m.test_step(batch, idx); }); });
      }
      ++idx;
    }
  }
  if (validating) {
    m.on_validation_epoch_end();
  } else {
    m.on_test_epoch_end();
  }
  const detail::MetricValues values = r.metrics.end_epoch();
  if (loop != detail::Loop::Sanity) log_to_logger(values.logged);
  if (validating) {
    each_callback([&](Callback& c) { c.on_validation_epoch_end(*this, m); });
  } else {
    each_callback([&](Callback& c) { c.on_test_epoch_end(*this, m); });
  }
  m.train();
  r.stage = outer;
  r.metrics.set_loop(outer);
  return values.callback;
}

template <class M, class TrainLoader, class ValLoader>
  requires(!std::is_convertible_v<ValLoader&, std::string>)
void Trainer::fit(M& module, TrainLoader& train, ValLoader& val, const std::string& ckpt_path) {
  fit_impl(module, train, &val, ckpt_path);
}

template <class M, class TrainLoader>
void Trainer::fit(M& module, TrainLoader& train, const std::string& ckpt_path) {
  fit_impl(module, train, static_cast<TrainLoader*>(nullptr), ckpt_path);
}

template <class M, class TrainLoader, class ValLoader>
void Trainer::fit_impl(M& module, TrainLoader& train, ValLoader* val, const std::string& ckpt_path) {
  const TrainerOptions& o = options_;
  launch_replicas<M, TrainLoader>(module, [&](Strategy& s, M& m, detail::ReplicaRun& r) {
    r.fitting = true;
    auto acc = make_accelerator(o.accelerator, s);
    acc->setup(m);
    // The loaders come first, so configure_optimizers can size a schedule by
    // trainer().estimated_stepping_batches().
    detail::ReplicaLoader<TrainLoader> train_local(train, s, o.use_distributed_sampler);
    auto train_batches = s.process_dataloader(train_local.get());
    std::optional<detail::ReplicaLoader<ValLoader>> val_local;
    std::unique_ptr<dist::MpDeviceLoader<ValLoader>> val_device;
    if (val) {
      val_local.emplace(*val, s, o.use_distributed_sampler, false);
      val_device = std::make_unique<dist::MpDeviceLoader<ValLoader>>(val_local->get(), s.root_device(), s.loader_options());
    }
    // Training batches of an epoch after the limit (-1: the loader cannot say). None at all
    // (an empty loader, or limit_train_batches = 0) skips training, as in Lightning: no
    // epoch would ever end by steps, so a fit bounded by max_steps alone would never end.
    const std::int64_t epoch_batches =
        o.limit_train_batches.batches_of(detail::loader_batches(train_batches), "train");
    const bool no_training = epoch_batches == 0;
    // (Only when this fit validates: with no validation loader, or limit_val_batches = 0,
    // the interval means nothing.)
    const bool validates = val && o.limit_val_batches.of(std::int64_t{1} << 40) != 0;
    if (validates && !o.val_check_interval.is_fraction() && epoch_batches > 0) {
      const std::int64_t every = o.val_check_interval.of(std::numeric_limits<std::int64_t>::max());
      if (every > epoch_batches)
        throw Error("Trainer: val_check_interval (" + std::to_string(every) +
                    " batches) must be <= the number of training batches (" +
                    std::to_string(epoch_batches) +
                    "); to skip validation set limit_val_batches = 0");
    }
    {
      const std::int64_t per_epoch =
          epoch_batches < 0
              ? -1
              : (epoch_batches + o.accumulate_grad_batches - 1) / o.accumulate_grad_batches;
      std::int64_t est = (per_epoch < 0 || max_epochs_ < 0) ? -1 : per_epoch * max_epochs_;
      if (o.max_steps >= 0) est = est < 0 ? o.max_steps : std::min(est, o.max_steps);
      r.estimated_stepping_batches = est;
    }
    r.optim = m.configure_optimizers();
    if (!r.optim.optimizer) throw Error("Trainer: configure_optimizers returned no optimizer");
    optim::Optimizer& opt = *r.optim.optimizer;
    r.schedulers.clear();
    if (r.optim.lr_scheduler) {
      r.schedulers.push_back({r.optim.lr_scheduler, r.optim.interval, r.optim.frequency});
    } else if (r.optim.interval != "epoch" && r.optim.interval != "step") {
      throw Error("Trainer: the scheduler's interval must be \"epoch\" or \"step\", got \"" +
                  r.optim.interval + "\"");
    }
    for (const SchedulerConfig& c : r.optim.lr_schedulers) r.schedulers.push_back(c);
    for (std::size_t i = 0; i < r.schedulers.size(); ++i) {
      const SchedulerConfig& c = r.schedulers[i];
      const std::string which = "Trainer: learning-rate scheduler " + std::to_string(i);
      if (!c.scheduler) throw Error(which + " of configure_optimizers is empty");
      if (c.interval != "epoch" && c.interval != "step")
        throw Error(which + ": the interval must be \"epoch\" or \"step\", got \"" + c.interval +
                    "\"");
      if (c.frequency < 1)
        throw Error(which + ": the frequency must be >= 1, got " + std::to_string(c.frequency));
      // (Lightning's _validate_optimizers_attached: its step would change rates no step uses.)
      if (&c.scheduler->optimizer() != &opt)
        throw Error(
            which +
            " sets the rates of an optimizer configure_optimizers did not return (expected its " +
            opt.name() + ", found another " + c.scheduler->optimizer().name() + ")");
    }
    // Each scheduler whose interval is `interval` and whose frequency divides `count`.
    const auto step_schedulers = [&](const char* interval, std::int64_t count) {
      for (const SchedulerConfig& c : r.schedulers)
        if (c.interval == interval && count % c.frequency == 0) c.scheduler->step();
    };

    r.seed = get_rng_state();
    std::optional<std::uint64_t> rng_after_restore;
    if (!ckpt_path.empty()) {
      const StateDict ckpt = io::load(resolve_ckpt_path(ckpt_path), s.root_device());
      restore_checkpoint(ckpt, true);
      const auto it = ckpt.metadata().find("rng_state." + std::to_string(s.global_rank()));
      if (it != ckpt.metadata().end())
        rng_after_restore = detail::parse_uint64(it->second, "Trainer: checkpoint rng_state");
    }
    r.started = std::chrono::steady_clock::now();
    if (logger_ && is_global_zero() && !m.hparams.empty()) logger_->log_hyperparams(m.hparams);

    each_callback([&](Callback& c) { c.on_fit_start(*this, m); });
    m.on_fit_start();

    const std::int64_t val_total = val ? detail::loader_batches(*val_device) : 0;
    const std::int64_t val_limit = val ? o.limit_val_batches.batches_of(val_total, "val") : 0;
    // Known from here, as in Lightning (callbacks ask whether this fit validates at all).
    r.num_val_batches = val_limit;
    auto validate_now = [&] {
      each_callback([&](Callback& c) { c.on_validation_start(*this, m); });
      eval_epoch(m, *val_device, detail::Loop::Validate, val_limit);
      each_callback([&](Callback& c) { c.on_validation_end(*this, m); });
    };
    if (val && o.num_sanity_val_steps != 0 && val_limit != 0) {
      const std::int64_t steps = o.num_sanity_val_steps < 0 ? val_limit
                                 : val_limit < 0            ? o.num_sanity_val_steps
                                                            : std::min(o.num_sanity_val_steps, val_limit);
      each_callback([&](Callback& c) { c.on_sanity_check_start(*this, m); });
      eval_epoch(m, *val_device, detail::Loop::Sanity, steps);
      each_callback([&](Callback& c) { c.on_sanity_check_end(*this, m); });
      r.num_val_batches = val_limit;
    }

    m.train();
    r.stage = detail::Loop::Train;
    if (!no_training) {  // Lightning's fit loop skips its hooks too when there is nothing to train
      each_callback([&](Callback& c) { c.on_train_start(*this, m); });
      m.on_train_start();
      acc->on_train_start();
    }
    if (rng_after_restore && !o.deterministic) set_rng_state(*rng_after_restore);

    const std::int64_t k = o.accumulate_grad_batches;
    const double clip = o.gradient_clip_val.value_or(0.0);
    bool stop = no_training;
    while (!stop) {
      const std::int64_t epoch = r.progress.epoch;
      if (max_epochs_ >= 0 && epoch >= max_epochs_) break;
      if (o.max_steps >= 0 && r.progress.global_step >= o.max_steps) break;
      train_local.get().set_epoch(static_cast<std::uint64_t>(epoch));
      if (o.deterministic) set_rng_state(detail::epoch_seed(r.seed, epoch, s.global_rank()));
      r.num_training_batches =
          o.limit_train_batches.batches_of(detail::loader_batches(train_batches), "train");
      if (r.num_training_batches == 0)
        break;  // (a loader that shrank; an empty one never gets here)
      r.epoch_batches_done = 0;
      r.epoch_finished = false;
      r.metrics.start_epoch(detail::Loop::Train);
      each_callback([&](Callback& c) { c.on_train_epoch_start(*this, m); });
      m.on_train_epoch_start();
      const bool val_this_epoch = val && val_limit != 0 && (epoch + 1) % o.check_val_every_n_epoch == 0;
      std::int64_t val_every = 0;  // batches between validations inside the epoch
      if (val_this_epoch) {
        if (!o.val_check_interval.is_fraction()) {
          val_every = o.val_check_interval.of(std::numeric_limits<std::int64_t>::max());
        } else if (r.num_training_batches > 0) {
          val_every = std::max<std::int64_t>(1, o.val_check_interval.of(r.num_training_batches));
        }
      }
      std::int64_t idx = 0;
      bool finished = false;
      bool stopped_early = false;  // a break before the loader's end or the limit
      bool accumulated = false;    // gradients since the last optimizer step
      const auto optimizer_step_now = [&] {
        m.on_before_optimizer_step(opt);
        if (clip > 0) acc->clip_gradients(opt, clip, o.gradient_clip_algorithm);
        acc->optimizer_step(opt);
        acc->optimizer_zero_grad(opt);
        accumulated = false;
        ++r.progress.global_step;
        step_schedulers("step", r.progress.global_step);
      };
      for (auto& batch : train_batches) {
        if (r.num_training_batches >= 0 && idx >= r.num_training_batches) break;
        if (idx < r.resume_batches) {
          ++idx;
          continue;
        }
        each_callback([&](Callback& c) { c.on_train_batch_start(*this, m, idx); });
        m.on_train_batch_start(idx);
        const AnyTensor loss =
            detail::checked_loss(acc->training_step([&] { return m.training_step(batch, idx); }), 1.0 / static_cast<double>(k));
        r.samples += detail::batch_size_of(batch);
        acc->backward(loss, &opt);
        accumulated = true;
        const bool last = r.num_training_batches >= 0 && idx + 1 == r.num_training_batches;
        const bool step_now = (idx + 1) % k == 0 || last;
        if (step_now) optimizer_step_now();
        r.epoch_batches_done = idx + 1;
        const bool read_point = step_now && r.progress.global_step % o.log_every_n_steps == 0;
        if (read_point) log_to_logger(r.metrics.read_step(true).logged);
        each_callback([&](Callback& c) { c.on_train_batch_end(*this, m, idx); });
        m.on_train_batch_end(idx);
        ++idx;
        if (val_every > 0 && idx % val_every == 0 && !last) {
          validate_now();
          m.train();
        }
        if (o.max_steps >= 0 && r.progress.global_step >= o.max_steps) {
          stop = true;
          stopped_early = !last;
          break;
        }
        // A stop (max_time, or should_stop set by the module or a callback) ends the epoch
        // after this batch. Alone, every batch; with replicas, at every optimizer step,
        // where they vote (any one's wish stops all): a stop seen by one replica only would
        // leave the others waiting in the next step's collectives. The vote is a host
        // collective, so it runs the step's pending work first (what the loader's
        // mark_step would run next): replicas then meet where the gradient all-reduce
        // made them meet anyway; 1.6 us per vote between two thread replicas.
        // should_stop cuts an epoch short only once min_epochs whole epochs are done, as
        // in Lightning (before that it takes effect at the end of the min_epochs-th).
        const bool wants_stop = time_is_up() || (r.should_stop && epoch >= o.min_epochs);
        if (!s.is_distributed() ? wants_stop : step_now && s.reduce_boolean_decision(wants_stop, false)) {
          stop = true;
          stopped_early = !last;
          break;
        }
      }
      // The epoch is whole when it reached its limit, or the loader ended first (a loader
      // that cannot say its length, under an integer limit larger than what it holds).
      finished = !stopped_early || idx >= r.num_training_batches;
      // A loader that ended before its last batch was known (no length, or fewer batches
      // than it said) leaves a partial accumulation: stepped now, as Lightning's look-ahead
      // steps at the loader's last batch, so that it does not leak into the next epoch.
      if (finished && accumulated) optimizer_step_now();
      // A loader that cannot say its length and gave no batch: the next epochs would give
      // none either, and with max_steps alone the fit would never end (Lightning stops:
      // "no training batches").
      if (finished && idx == 0) stop = true;
      r.resume_batches = 0;
      if (finished) {
        if (r.num_training_batches < 0 || idx < r.num_training_batches)
          r.num_training_batches = idx;
        r.epoch_batches_done = std::max<std::int64_t>(idx, r.num_training_batches);
        step_schedulers("epoch", epoch + 1);
        r.epoch_finished = true;  // a checkpoint from here on resumes at the next epoch
        if (val_this_epoch) {
          validate_now();
          m.train();
        }
      }
      r.stage = detail::Loop::Train;
      r.metrics.set_loop(detail::Loop::Train);
      // Lightning's order: the other callbacks' on_train_epoch_end, the module's, then the
      // monitoring callbacks' (ModelCheckpoint, EarlyStopping), so that they can monitor a
      // value the module logs in its hook; the logger gets the epoch's values last.
      detail::MetricValues epoch_values = r.metrics.end_epoch();
      each_callback([&](Callback& c) {
        if (!c.monitors()) c.on_train_epoch_end(*this, m);
      });
      r.metrics.set_epoch_end_hook(true);
      m.on_train_epoch_end();
      r.metrics.set_epoch_end_hook(false);
      for (const auto& [key, x] : r.metrics.end_epoch().logged) epoch_values.logged[key] = x;
      each_callback([&](Callback& c) {
        if (c.monitors()) c.on_train_epoch_end(*this, m);
      });
      log_to_logger(epoch_values.logged);
      acc->on_train_epoch_end();
      if (s.is_distributed()) {
        r.should_stop = s.reduce_boolean_decision(r.should_stop, false);
        if (o.max_time && s.reduce_boolean_decision(time_is_up(), false)) stop = true;
      } else if (time_is_up()) {
        stop = true;
      }
      ++r.progress.epoch;
      r.epoch_batches_done = 0;
      r.epoch_finished = false;
      if (r.should_stop && r.progress.epoch >= o.min_epochs) stop = true;
    }
    if (!no_training) {
      each_callback([&](Callback& c) { c.on_train_end(*this, m); });
      m.on_train_end();
      acc->on_train_end();
    }
    each_callback([&](Callback& c) { c.on_fit_end(*this, m); });
    m.on_fit_end();
    if (logger_ && is_global_zero()) logger_->finalize("success");
    return 0;
  });
}

template <class M, class Loader>
std::vector<std::map<std::string, double>> Trainer::evaluate(M& module, Loader& data, const std::string& ckpt_path,
                                                             detail::Loop loop) {
  const bool validating = loop == detail::Loop::Validate;
  const BatchCount& limit = validating ? options_.limit_val_batches : options_.limit_test_batches;
  return launch_replicas<M, Loader>(module, [&](Strategy& s, M& m, detail::ReplicaRun& r) {
    make_accelerator(options_.accelerator, s)->setup(m);
    if (!ckpt_path.empty()) restore_checkpoint(io::load(resolve_ckpt_path(ckpt_path), s.root_device()), false);
    detail::ReplicaLoader<Loader> local(data, s, options_.use_distributed_sampler, false);
    auto batches = s.process_dataloader(local.get());
    const std::int64_t total = detail::loader_batches(batches);
    r.stage = loop;
    each_callback([&](Callback& c) {
      validating ? c.on_validation_start(*this, m) : c.on_test_start(*this, m);
    });
    auto values =
        eval_epoch(m, batches, loop, limit.batches_of(total, validating ? "val" : "test"));
    each_callback(
        [&](Callback& c) { validating ? c.on_validation_end(*this, m) : c.on_test_end(*this, m); });
    if (logger_ && is_global_zero()) logger_->save();
    return std::vector<std::map<std::string, double>>{values};
  });
}

template <class M, class Loader>
std::vector<std::map<std::string, double>> Trainer::validate(M& module, Loader& val, const std::string& ckpt_path) {
  return evaluate(module, val, ckpt_path, detail::Loop::Validate);
}

template <class M, class Loader>
std::vector<std::map<std::string, double>> Trainer::test(M& module, Loader& data, const std::string& ckpt_path) {
  return evaluate(module, data, ckpt_path, detail::Loop::Test);
}

template <class M, class Loader>
std::vector<AnyTensor> Trainer::predict(M& module, Loader& data, const std::string& ckpt_path) {
  return launch_replicas<M, Loader>(module, [&](Strategy& s, M& m, detail::ReplicaRun& r) {
    auto acc = make_accelerator(options_.accelerator, s);
    acc->setup(m);
    if (!ckpt_path.empty()) restore_checkpoint(io::load(resolve_ckpt_path(ckpt_path), s.root_device()), false);
    detail::ReplicaLoader<Loader> local(data, s, options_.use_distributed_sampler);
    auto batches = s.process_dataloader(local.get());
    const std::int64_t total = detail::loader_batches(batches);
    const std::int64_t limit = options_.limit_predict_batches.batches_of(total, "predict");
    r.stage = detail::Loop::Predict;
    r.metrics.start_epoch(detail::Loop::Predict);
    each_callback([&](Callback& c) { c.on_predict_start(*this, m); });
    m.eval();
    std::vector<AnyTensor> out;
    std::int64_t idx = 0;
    for (auto& batch : batches) {
      if (limit >= 0 && idx >= limit) break;
      out.push_back(acc->predict_step([&] { return detail::user_step([&] { return m.predict_step(batch, idx); }); }));
      ++idx;
    }
    lazy::mark_step();
    each_callback([&](Callback& c) { c.on_predict_end(*this, m); });
    m.train();
    return out;
  });
}

}  // namespace lazy::train

#if LAZYTENSOR_HEADER_DEFINITIONS
namespace lazy::train::detail {
template <class>
AnyTensor checked_loss(const AnyTensor& loss, double f) {
  if (!loss.defined()) throw Error("Trainer: training_step returned an undefined tensor (return the loss)");
  if (!loss.is_floating_point())
    throw DTypeError("Trainer: training_step must return a floating loss, found " + dtype_name(loss.dtype()));
  if (loss.numel() != 1)
    throw ShapeError("Trainer: training_step must return a one-element loss, found shape " + loss.shape().str());
  if (f == 1.0) return loss;
  switch (loss.dtype()) {
    case DType::BFloat16: return Tensor<bfloat16>(loss.as<bfloat16>() * bfloat16(static_cast<float>(f)));
    case DType::Float32: return Tensor<float>(loss.as<float>() * static_cast<float>(f));
    default: return Tensor<double>(loss.as<double>() * f);
  }
}
}  // namespace lazy::train::detail
#endif  // LAZYTENSOR_HEADER_DEFINITIONS

// Defined once by lazytensor::compiled (src/compiled.cpp).
#define LAZYTENSOR_TRAIN_LOOPS_INSTANCES(P) \
  P template lazy::AnyTensor lazy::train::detail::checked_loss<void>(const lazy::AnyTensor&, double);
#if LAZYTENSOR_EXPLICIT_INSTANTIATION
LAZYTENSOR_TRAIN_LOOPS_INSTANCES(extern)
#endif
