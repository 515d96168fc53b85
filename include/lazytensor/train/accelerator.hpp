#pragma once
// train::Accelerator, Lightning 1.3's Accelerator: the object a training loop calls for each
// step. It joins a Strategy (where the model runs, how replicas talk) and the strategy's
// Precision plugin (which dtype), and adds the 1.3 hooks that still mean something on
// lazytensor's devices. "cpu" is the one accelerator: lazytensor's devices are CPU
// executors.
//
// The step methods take the step as a callable (the LightningModule's training_step, or a
// lambda): it runs inside the precision plugin's forward context (autocast for bf16-mixed);
// validation, test and predict steps also run without recording gradients.

#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>

#include <lazytensor/any_tensor.hpp>
#include <lazytensor/autograd/engine.hpp>
#include <lazytensor/core/config.hpp>
#include <lazytensor/core/error.hpp>
#include <lazytensor/nn/module.hpp>
#include <lazytensor/nn/utils/clip_grad.hpp>
#include <lazytensor/optim/optimizer.hpp>
#include <lazytensor/train/precision.hpp>
#include <lazytensor/train/strategy.hpp>

namespace lazy::train {

/// Lightning 1.3's Accelerator over a Strategy and its Precision plugin. The strategy must
/// outlive the accelerator; both are shared by the replicas the strategy launches.
class Accelerator {
 public:
  /// Over `strategy`; with `precision`, that plugin becomes the strategy's.
  explicit Accelerator(Strategy& strategy, std::shared_ptr<Precision> precision = nullptr) : strategy_(&strategy) {
    if (precision) strategy.set_precision_plugin(std::move(precision));
  }
  virtual ~Accelerator() = default;

  /// "cpu".
  virtual std::string name() const = 0;
  /// The strategy steps run through.
  Strategy& strategy() const { return *strategy_; }
  /// The strategy's precision plugin.
  Precision& precision_plugin() const { return strategy_->precision_plugin(); }

  /// Prepares `model` on this replica: the strategy's setup (precision conversion, device,
  /// rank 0's state on every replica).
  virtual void setup(nn::Module& model) { strategy_->setup(model); }

  /// Runs `step()` (forward and loss) in the precision plugin's forward context; returns
  /// what it returns.
  template <class F>
  decltype(auto) training_step(F&& step) {
    const PrecisionContext context = precision_plugin().forward_context();
    return std::forward<F>(step)();
  }
  /// Runs `step()` in the forward context without recording gradients.
  template <class F>
  decltype(auto) validation_step(F&& step) {
    return eval_step(std::forward<F>(step));
  }
  /// Runs `step()` in the forward context without recording gradients.
  template <class F>
  decltype(auto) test_step(F&& step) {
    return eval_step(std::forward<F>(step));
  }
  /// Runs `step()` in the forward context without recording gradients.
  template <class F>
  decltype(auto) predict_step(F&& step) {
    return eval_step(std::forward<F>(step));
  }

  /// Backpropagates `loss` (through the precision plugin and the strategy).
  virtual void backward(const AnyTensor& loss, optim::Optimizer* optimizer = nullptr) {
    strategy_->backward(loss, optimizer);
  }
  /// Runs `closure` (forward and backward), then the strategy's optimizer step (gradients
  /// averaged over the replicas first); returns the closure's loss.
  virtual AnyTensor optimizer_step(optim::Optimizer& optimizer, const std::function<AnyTensor()>& closure = {}) {
    return strategy_->optimizer_step(optimizer, closure);
  }
  /// Clears the optimizer's gradients.
  virtual void optimizer_zero_grad(optim::Optimizer& optimizer) { optimizer.zero_grad(); }
  /// Clips the gradients of every parameter of `optimizer`: by their total 2-norm
  /// (`algorithm` "norm", clip_grad_norm_) or element-wise (`"value"`, clip_grad_value_).
  /// A `clip_val` of 0 clips nothing, as Lightning's; a negative one or another algorithm
  /// is an Error. (A template only so that programs that never clip do not compile the
  /// norms.)
  template <class = void>
  void clip_gradients(optim::Optimizer& optimizer, double clip_val, std::string_view algorithm = "norm");

  /// Called when training starts (after setup).
  virtual void on_train_start() {}
  /// Called at the end of every training epoch.
  virtual void on_train_epoch_end() {}
  /// Called when training ends: computes whatever is still pending on this replica.
  LAZYTENSOR_INLINE virtual void on_train_end();
  /// Releases what setup took (the strategy's teardown).
  virtual void teardown() { strategy_->teardown(); }

 private:
  template <class F>
  decltype(auto) eval_step(F&& step) {
    NoGradGuard no_grad;
    const PrecisionContext context = precision_plugin().forward_context();
    return std::forward<F>(step)();
  }

  Strategy* strategy_;
};

/// The accelerator of lazytensor's devices (Lightning's CPUAccelerator).
class CPUAccelerator : public Accelerator {
 public:
  using Accelerator::Accelerator;
  std::string name() const override { return "cpu"; }
  /// Always true: every lazytensor device is a CPU executor.
  static bool is_available() { return true; }
  /// The devices lazytensor has (lazy::device_count(), LAZYTENSOR_NUM_DEVICES).
  static int auto_device_count();
};

/// The accelerator for Lightning's `accelerator` argument: "cpu" or "auto". Error for
/// "gpu", "cuda", "tpu", "mps" or anything else, naming the one choice.
std::unique_ptr<Accelerator> make_accelerator(std::string_view name, Strategy& strategy,
                                              std::shared_ptr<Precision> precision = nullptr);

// (Outside the class, so not inline: see core/config.hpp.)
template <class>
void Accelerator::clip_gradients(optim::Optimizer& optimizer, double clip_val, std::string_view algorithm) {
  if (algorithm != "norm" && algorithm != "value") {
    throw Error("clip_gradients: gradient_clip_algorithm must be \"norm\" or \"value\", got \"" +
                std::string(algorithm) + "\"");
  }
  if (!(clip_val >= 0)) throw Error("clip_gradients: clip_val must be >= 0, got " + std::to_string(clip_val));
  if (clip_val == 0) return;
  std::vector<AnyTensor> params;
  for (std::size_t g = 0; g < optimizer.num_param_groups(); ++g)
    for (const auto& p : optimizer.params(g)) params.push_back(p);
  if (algorithm == "norm") nn::utils::clip_grad_norm_(params, clip_val);
  else nn::utils::clip_grad_value_(params, clip_val);
}

#if LAZYTENSOR_HEADER_DEFINITIONS
LAZYTENSOR_INLINE void Accelerator::on_train_end() { mark_step(); }

LAZYTENSOR_INLINE int CPUAccelerator::auto_device_count() { return device_count(); }

LAZYTENSOR_INLINE std::unique_ptr<Accelerator> make_accelerator(std::string_view name, Strategy& strategy,
                                                                std::shared_ptr<Precision> precision) {
  if (name == "cpu" || name == "auto") return std::make_unique<CPUAccelerator>(strategy, std::move(precision));
  throw Error("accelerator: lazytensor's devices are CPU executors; expected \"cpu\" or \"auto\", got \"" +
              std::string(name) + "\"");
}
#endif  // LAZYTENSOR_HEADER_DEFINITIONS

}  // namespace lazy::train

#define LAZYTENSOR_TRAIN_ACCELERATOR_INSTANCES(P) \
  P template void lazy::train::Accelerator::clip_gradients<void>(lazy::optim::Optimizer&, double, std::string_view);
#if LAZYTENSOR_EXPLICIT_INSTANTIATION
LAZYTENSOR_TRAIN_ACCELERATOR_INSTANCES(extern)
#endif
