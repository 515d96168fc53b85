#pragma once
// train::Precision, Lightning's precision plugins: in which dtype a model's parameters live
// and its products run.
//
//   "32-true"     float parameters and arithmetic (the default);
//   "64-true"     the module converted to double (Module::to), inputs converted to double;
//   "bf16-true"   the module converted to bfloat16, inputs converted to bfloat16;
//   "bf16-mixed"  float (master) parameters and loss; matmul, linear and conv2d in bfloat16
//                 with float accumulation inside forward_context() (AutocastGuard).
//
// LAZYTENSOR_USE_BF16=1 makes "bf16-true" the default, as XLA_USE_BF16 makes PyTorch/XLA
// store float tensors as bfloat16. The plugin is stateless: one object serves every replica.

#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include <lazytensor/any_tensor.hpp>
#include <lazytensor/core/autocast.hpp>
#include <lazytensor/core/config.hpp>
#include <lazytensor/core/env.hpp>
#include <lazytensor/core/error.hpp>
#include <lazytensor/nn/module.hpp>
#include <lazytensor/optim/optimizer.hpp>

namespace lazy::train {

/// What forward_context() returns: autocast on this thread while it lives (bf16-mixed), or
/// nothing.
class PrecisionContext {
 public:
  PrecisionContext() = default;
  explicit PrecisionContext(bool autocast) {
    if (autocast) guard_ = std::make_unique<AutocastGuard>(true, DType::BFloat16);
  }

 private:
  std::unique_ptr<AutocastGuard> guard_;
};

/// Lightning's Precision plugin, "32-true": float parameters and arithmetic. Subclasses
/// override what differs.
class Precision {
 public:
  virtual ~Precision() = default;

  /// Lightning's name of the setting ("32-true", "64-true", "bf16-mixed", "bf16-true").
  virtual std::string name() const { return "32-true"; }
  /// The dtype of the parameters after convert_module.
  virtual DType param_dtype() const { return DType::Float32; }
  /// The dtype floating inputs are converted to (convert_input), or nullopt to keep them.
  virtual std::optional<DType> input_dtype() const { return std::nullopt; }

  /// Converts `module`'s floating parameters and buffers to param_dtype() (the Strategy's
  /// setup calls it before moving the module to its device).
  void convert_module(nn::Module& module) const {
    if (param_dtype() != DType::Float32) module.to(param_dtype());
  }
  /// A floating input converted to input_dtype() (other tensors as they are).
  AnyTensor convert_input(const AnyTensor& x) const {
    const auto d = input_dtype();
    return d && x.defined() && x.is_floating_point() ? x.to(*d) : x;
  }
  /// A floating output converted back to float (Lightning's convert_output to the default
  /// dtype), so that losses and metrics are reported in float. Detached from autograd, as
  /// every AnyTensor::to(dtype): backpropagate from the typed loss.
  AnyTensor convert_output(const AnyTensor& y) const {
    return y.defined() && y.is_floating_point() ? y.to(DType::Float32) : y;
  }
  /// The forward pass's context: keep it alive while the model runs (autocast for
  /// bf16-mixed).
  virtual PrecisionContext forward_context() const { return PrecisionContext(); }
  /// Backpropagates `loss` into the parameters' gradients.
  virtual void backward(const AnyTensor& loss) const { loss.backward(); }
};

/// "64-true": the module in double.
class DoublePrecision : public Precision {
 public:
  std::string name() const override { return "64-true"; }
  DType param_dtype() const override { return DType::Float64; }
  std::optional<DType> input_dtype() const override { return DType::Float64; }
};

/// "bf16-true": the module in bfloat16 (products accumulate in float, element-wise ops
/// compute in float and round each result).
class HalfPrecision : public Precision {
 public:
  std::string name() const override { return "bf16-true"; }
  DType param_dtype() const override { return DType::BFloat16; }
  std::optional<DType> input_dtype() const override { return DType::BFloat16; }
};

/// "bf16-mixed": float parameters, products in bfloat16 inside forward_context().
class MixedPrecision : public Precision {
 public:
  std::string name() const override { return "bf16-mixed"; }
  PrecisionContext forward_context() const override { return PrecisionContext(true); }
};

/// The plugin for Lightning's `precision` argument: "32-true" (or "32"), "64-true" ("64"),
/// "bf16-mixed" ("bf16", as Lightning reads it), "bf16-true". Error naming the choices
/// otherwise (16-bit float is not a dtype lazytensor has).
template <class = void>
std::shared_ptr<Precision> make_precision(std::string_view name);

/// The default plugin: "bf16-true" when LAZYTENSOR_USE_BF16 is on, "32-true" otherwise.
/// Error when the variable is not an on/off switch.
template <class = void>
std::shared_ptr<Precision> default_precision();

#if LAZYTENSOR_HEADER_DEFINITIONS
template <class>
std::shared_ptr<Precision> make_precision(std::string_view name) {
  if (name == "32-true" || name == "32") return std::make_shared<Precision>();
  if (name == "64-true" || name == "64") return std::make_shared<DoublePrecision>();
  if (name == "bf16-mixed" || name == "bf16") return std::make_shared<MixedPrecision>();
  if (name == "bf16-true") return std::make_shared<HalfPrecision>();
  throw Error("precision: expected \"32-true\", \"64-true\", \"bf16-mixed\" or \"bf16-true\" (or \"32\", \"64\", "
              "\"bf16\"), got \"" + std::string(name) + "\"" +
              (name.find("16") != std::string_view::npos ? " (float16 is not supported; use bfloat16)" : ""));
}

template <class>
std::shared_ptr<Precision> default_precision() {
  return core::env_switch("LAZYTENSOR_USE_BF16").value_or(false) ? make_precision("bf16-true")
                                                                 : make_precision("32-true");
}
#endif  // LAZYTENSOR_HEADER_DEFINITIONS

}  // namespace lazy::train

// Defined once by lazytensor::compiled (src/compiled.cpp).
#define LAZYTENSOR_TRAIN_PRECISION_INSTANCES(P)                                                      \
  P template std::shared_ptr<lazy::train::Precision> lazy::train::make_precision<void>(std::string_view); \
  P template std::shared_ptr<lazy::train::Precision> lazy::train::default_precision<void>();
#if LAZYTENSOR_EXPLICIT_INSTANTIATION
LAZYTENSOR_TRAIN_PRECISION_INSTANCES(extern)
#endif
