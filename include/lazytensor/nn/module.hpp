#pragma once
// nn::Module, as libtorch's torch::nn::Module: a tree of modules owning named parameters
// (floating tensors that require grad) and buffers (running statistics and the like), with
// state_dict / load_state_dict, train / eval, to(device), to(dtype) and zero_grad. Module
// handles (nn::Linear, ...) are shared pointers to the *Impl classes, like libtorch's
// ModuleHolder.
//
// Parameters and buffers are tensor handles shared with the owning module's members: an
// optimizer's in-place update, load_state_dict, to(device) or to(dtype) rebinds the shared
// tensor object, so every handle sees it. Layers are built in float (libtorch's default
// dtype) and their forward runs in the dtype of its input, so a module converted with
// to(DType::Float64) computes in double. After such a conversion a member typed for the old
// dtype (`Tensor<float> weight`) raises DTypeError when used; the module's own views
// (`param<double>(weight)`, parameters()) follow the conversion.

#include <algorithm>
#include <memory>
#include <ostream>
#include <sstream>
#include <string>
#include <type_traits>
#include <unordered_set>
#include <utility>
#include <vector>

#include <lazytensor/core/config.hpp>
#include <lazytensor/state_dict.hpp>
#include <lazytensor/ops/factories.hpp>
#include <lazytensor/tensor/tensor.hpp>

namespace lazy::nn {

/// Base of every layer and model.
class Module : public std::enable_shared_from_this<Module> {
 public:
  /// `name` is what printing shows ("Linear", "Net", ...).
  explicit Module(std::string name = "Module") : name_(std::move(name)) {}
  virtual ~Module() = default;
  Module(const Module&) = delete;
  Module& operator=(const Module&) = delete;

  /// The module's type name.
  const std::string& name() const { return name_; }

  /// Registers a parameter under `name` and returns a handle sharing it. A leaf's
  /// requires_grad is set to `requires_grad` either way, as libtorch (a tensor that already
  /// requires grad registered with false is frozen); a computed tensor keeps its history.
  template <Element T>
  Tensor<T> register_parameter(const std::string& name, Tensor<T> t, bool requires_grad = true) {
    add_parameter(name, t);
    if (t.is_leaf() && t.requires_grad() != requires_grad) t.requires_grad_(requires_grad);
    return t;
  }
  /// Registers a buffer (saved in state_dict, not a parameter) and returns a handle.
  AnyTensor register_buffer(const std::string& name, AnyTensor t);
  /// Registers a submodule; returns it.
  template <class M>
  std::shared_ptr<M> register_module(const std::string& name, std::shared_ptr<M> m) {
    static_assert(std::is_base_of_v<Module, M>, "register_module: not an nn::Module");
    check_name(name);
    if (!m) throw Error(name_ + ".register_module: submodule '" + name + "' is empty");
    children_.emplace_back(name, m);
    return m;
  }
  /// Registers a submodule given by its holder (nn::Linear, ...); returns the holder.
  template <class H>
    requires requires(const H& h) { h.ptr(); }
  H register_module(const std::string& name, H holder) {
    register_module(name, holder.ptr());
    return holder;
  }

  /// Every parameter of this module and (recursively) its submodules, in registration order,
  /// whatever their dtype (each converts to its typed handle: `Tensor<float> w = ps[0];`).
  std::vector<AnyTensor> parameters(bool recurse = true) const;
  /// Parameters with dotted names ("fc1.weight").
  std::vector<std::pair<std::string, AnyTensor>> named_parameters(bool recurse = true) const;
  /// Buffers with dotted names.
  std::vector<std::pair<std::string, AnyTensor>> named_buffers(bool recurse = true) const;
  /// Direct submodules with their names.
  const std::vector<std::pair<std::string, std::shared_ptr<Module>>>& named_children() const { return children_; }
  /// This module and every descendant, depth first.
  std::vector<std::shared_ptr<const Module>> modules() const;

  /// Parameters and buffers by dotted name.
  StateDict state_dict() const;

  /// Replaces parameters and buffers with the entries of `sd`. With `strict`, a missing or
  /// unexpected key is an Error; a shape or dtype mismatch is always an error. Nothing is
  /// changed when any check fails. The values are shared, not copied.
  void load_state_dict(const StateDict& sd, bool strict = true);

  /// Training mode (dropout active, batch norm uses batch statistics), recursively.
  LAZYTENSOR_INLINE virtual void train(bool on = true);
  /// Evaluation mode: train(false).
  void eval() { train(false); }
  /// True in training mode.
  bool is_training() const { return training_; }

  /// Moves every parameter and buffer to `dev` (their gradients are dropped).
  void to(const Device& dev);
  /// Converts every floating parameter and buffer to `dtype`, a floating dtype (integer
  /// buffers such as num_batches_tracked keep theirs; gradients are dropped), as libtorch's
  /// Module::to(dtype). DTypeError for an integral or bool dtype.
  void to(DType dtype);
  /// Both: to(dtype), then to(dev).
  void to(const Device& dev, DType dtype) {
    to(dtype);
    to(dev);
  }

  /// Clears the gradients: undefined (set_to_none, libtorch's default) or zero.
  void zero_grad(bool set_to_none = true);

  /// Prints the module tree as PyTorch does.
  virtual void pretty_print(std::ostream& os) const { os << name_; }

  /// The module tree as text.
  std::string str() const;

 private:
  void add_parameter(const std::string& name, AnyTensor t);
  void check_name(const std::string& n) const;
  void collect_params(const std::string& prefix, bool recurse,
                      std::vector<std::pair<std::string, AnyTensor>>& out) const;
  void collect_buffers(const std::string& prefix, bool recurse,
                       std::vector<std::pair<std::string, AnyTensor>>& out) const;
  // Module by module, parameters then buffers, as torch orders its state dicts.
  void collect_state(const std::string& prefix, StateDict& sd) const;
  void print_tree(std::ostream& os, int indent) const;
  static AnyTensor on_device(const AnyTensor& t, const Device& dev);
  static std::string join(const std::vector<std::string>& v);

  std::string name_;
  bool training_ = true;
  std::vector<std::pair<std::string, AnyTensor>> params_;
  std::vector<std::pair<std::string, AnyTensor>> buffers_;
  std::vector<std::pair<std::string, std::shared_ptr<Module>>> children_;
};

namespace detail {
/// A layer's parameter or buffer `p` as Tensor<T>, the dtype of the input the layer is
/// applied to (an undefined one stays undefined). DTypeError naming both dtypes when the
/// layer holds another, as libtorch's "expected scalar type Double but found Float".
template <Element T, Element U>
Tensor<T> param_as(const Tensor<U>& p, const Module& layer) {
  if (!p.defined()) return Tensor<T>();
  const DType held = p.impl()->node->dtype();
  if (held != dtype_of<T>()) {
    throw DTypeError(layer.name() + ": expected an input of the module's dtype " + dtype_name(held) + ", got " +
                     dtype_name(dtype_of<T>()) + " (convert one of them: module->to(dtype) or x.to(dtype))");
  }
  return Tensor<T>::from_impl(p.impl());
}
}  // namespace detail

/// A shared handle on a module implementation, as libtorch's ModuleHolder: `nn::Linear fc(4, 2);`
/// constructs a LinearImpl; `nn::Linear fc{nullptr};` is empty; `fc->weight`, `fc(x)`.
template <class Impl>
class ModuleHolder {
 public:
  using impl_type = Impl;
  /// An empty holder (assign a constructed one later).
  ModuleHolder(std::nullptr_t) {}  // NOLINT: as libtorch
  /// Wraps an existing implementation.
  ModuleHolder(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}  // NOLINT
  /// Constructs the implementation from `args`.
  template <class A0, class... Args>
    requires(!std::is_same_v<std::remove_cvref_t<A0>, ModuleHolder> &&
             !std::is_same_v<std::remove_cvref_t<A0>, std::nullptr_t> &&
             !std::is_same_v<std::remove_cvref_t<A0>, std::shared_ptr<Impl>>)
  explicit ModuleHolder(A0&& a0, Args&&... args)
      : impl_(std::make_shared<Impl>(std::forward<A0>(a0), std::forward<Args>(args)...)) {}
  /// Default-constructs the implementation (when it has a default constructor).
  ModuleHolder()
    requires std::is_default_constructible_v<Impl>
      : impl_(std::make_shared<Impl>()) {}

  Impl* operator->() const { return &get(); }
  Impl& operator*() const { return get(); }
  Impl& get() const {
    if (!impl_) throw Error("use of an empty module holder (constructed with nullptr)");
    return *impl_;
  }
  const std::shared_ptr<Impl>& ptr() const { return impl_; }
  bool is_empty() const { return impl_ == nullptr; }
  /// Calls forward.
  template <class... Args>
  decltype(auto) operator()(Args&&... args) const {
    return get().forward(std::forward<Args>(args)...);
  }

 private:
  std::shared_ptr<Impl> impl_;
};

#if LAZYTENSOR_HEADER_DEFINITIONS
LAZYTENSOR_INLINE void Module::add_parameter(const std::string& name, AnyTensor t) {
  check_name(name);
  if (!t.defined()) throw Error(name_ + ".register_parameter: parameter '" + name + "' is undefined");
  params_.emplace_back(name, t);
}

LAZYTENSOR_INLINE AnyTensor Module::register_buffer(const std::string& name, AnyTensor t) {
  check_name(name);
  // (state_dict and load_state_dict read every buffer's value.)
  if (!t.defined()) throw Error(name_ + ".register_buffer: buffer '" + name + "' is undefined");
  buffers_.emplace_back(name, t);
  return t;
}

LAZYTENSOR_INLINE std::vector<AnyTensor> Module::parameters(bool recurse) const {
  std::vector<AnyTensor> out;
  for (auto& [n, p] : named_parameters(recurse)) out.push_back(p);
  return out;
}

LAZYTENSOR_INLINE std::vector<std::pair<std::string, AnyTensor>> Module::named_parameters(bool recurse) const {
  std::vector<std::pair<std::string, AnyTensor>> out;
  collect_params("", recurse, out);
  // A parameter reached twice (a module shared by two parents) is listed once, under its
  // first name, as torch's named_parameters does: an optimizer given both would update it
  // twice per step.
  std::unordered_set<const graph::TensorImpl*> seen;
  seen.reserve(out.size());
  std::size_t kept = 0;
  for (std::size_t i = 0; i < out.size(); ++i) {
    if (!seen.insert(out[i].second.impl().get()).second) continue;
    if (kept != i) out[kept] = std::move(out[i]);  // (a self-move would empty the name)
    ++kept;
  }
  out.resize(kept);
  return out;
}

LAZYTENSOR_INLINE std::vector<std::pair<std::string, AnyTensor>> Module::named_buffers(bool recurse) const {
  std::vector<std::pair<std::string, AnyTensor>> out;
  collect_buffers("", recurse, out);
  return out;
}

LAZYTENSOR_INLINE std::vector<std::shared_ptr<const Module>> Module::modules() const {
  std::vector<std::shared_ptr<const Module>> out{shared_from_this()};
  for (auto& [n, c] : children_)
    for (auto& m : c->modules()) out.push_back(m);
  return out;
}

LAZYTENSOR_INLINE StateDict Module::state_dict() const {
  StateDict sd;
  collect_state("", sd);
  return sd;
}

LAZYTENSOR_INLINE void Module::load_state_dict(const StateDict& sd, bool strict) {
  std::vector<std::pair<std::shared_ptr<graph::TensorImpl>, AnyTensor>> plan;
  std::vector<std::string> missing;
  auto match = [&](const std::string& key, const std::shared_ptr<graph::TensorImpl>& impl) {
    const AnyTensor* src = sd.find(key);
    if (!src) {
      missing.push_back(key);
      return;
    }
    const auto& cur = impl->node;
    if (src->dtype() != cur->dtype()) {
      throw DTypeError("load_state_dict: '" + key + "' has dtype " + dtype_name(src->dtype()) +
                       " in the state dict, expected " + dtype_name(cur->dtype()));
    }
    if (!(src->shape() == cur->shape())) {
      throw ShapeError("load_state_dict: size mismatch for '" + key + "': copying a param with shape " +
                       src->shape().str() + " from the state dict, the shape in the current model is " +
                       cur->shape().str());
    }
    plan.emplace_back(impl, *src);
  };
  std::vector<std::string> own;
  // Every name, a shared parameter's too: state_dict() writes each.
  std::vector<std::pair<std::string, AnyTensor>> params;
  collect_params("", true, params);
  for (auto& [n, p] : params) {
    match(n, p.impl());
    own.push_back(n);
  }
  for (auto& [n, b] : named_buffers()) {
    match(n, b.impl());
    own.push_back(n);
  }
  if (strict) {
    std::vector<std::string> unexpected;
    for (const auto& k : sd.keys())
      if (std::find(own.begin(), own.end(), k) == own.end()) unexpected.push_back(k);
    if (!missing.empty() || !unexpected.empty()) {
      throw Error("load_state_dict: error(s) in loading state_dict for " + name_ + ": missing key(s): " +
                  join(missing) + "; unexpected key(s): " + join(unexpected));
    }
  }
  for (auto& [impl, src] : plan) {
    const Device here(impl->node->device()->index());
    graph::rebind(impl,
                  src.device() == here ? src.impl()->node : on_device(src, here).impl()->node);
  }
}

LAZYTENSOR_INLINE void Module::train(bool on) {
  training_ = on;
  for (auto& [n, c] : children_) c->train(on);
}

LAZYTENSOR_INLINE void Module::to(const Device& dev) {
  for (auto& [n, p] : named_parameters()) {
    if (p.device() == dev) continue;
    graph::rebind(p.impl(), p.detach().to(dev).impl()->node);
    p.set_grad(AnyTensor());
  }
  for (auto& [n, b] : named_buffers()) {
    if (b.device() == dev) continue;
    graph::rebind(b.impl(), on_device(b, dev).impl()->node);
  }
}

LAZYTENSOR_INLINE void Module::to(DType dtype) {
  if (!is_floating(dtype)) {
    throw DTypeError(name_ + ".to: expected a floating dtype (bfloat16, float32 or float64), got " + dtype_name(dtype));
  }
  for (auto& [n, p] : named_parameters()) {
    if (p.dtype() == dtype || !p.is_floating_point()) continue;
    p.set_grad(AnyTensor());
    // requires_grad stays set (it lives in the shared object); the typed ops that use the
    // parameter make the new dtype's gradient operations known when they record.
    graph::rebind(p.impl(), p.to(dtype).impl()->node);
  }
  for (auto& [n, b] : named_buffers()) {
    if (b.dtype() == dtype || !b.is_floating_point()) continue;
    graph::rebind(b.impl(), b.to(dtype).impl()->node);
  }
}

LAZYTENSOR_INLINE void Module::zero_grad(bool set_to_none) {
  for (auto& p : parameters()) {
    if (set_to_none || !p.grad().defined()) {
      p.set_grad(AnyTensor());
    } else {
      NoGradGuard guard;
      p.grad().zero_();
    }
  }
}

LAZYTENSOR_INLINE std::string Module::str() const {
  std::ostringstream os;
  print_tree(os, 0);
  return os.str();
}

LAZYTENSOR_INLINE void Module::check_name(const std::string& n) const {
  if (n.empty() || n.find('.') != std::string::npos) {
    throw Error(name_ + ": invalid name '" + n + "' (names must be non-empty and contain no '.')");
  }
  for (auto& [k, v] : params_)
    if (k == n) throw Error(name_ + ": '" + n + "' is already registered");
  for (auto& [k, v] : buffers_)
    if (k == n) throw Error(name_ + ": '" + n + "' is already registered");
  for (auto& [k, v] : children_)
    if (k == n) throw Error(name_ + ": '" + n + "' is already registered");
}

LAZYTENSOR_INLINE void Module::collect_params(const std::string& prefix, bool recurse,
                                              std::vector<std::pair<std::string, AnyTensor>>& out) const {
  for (auto& [n, p] : params_) out.emplace_back(prefix + n, p);
  if (recurse)
    for (auto& [n, c] : children_) c->collect_params(prefix + n + ".", true, out);
}

LAZYTENSOR_INLINE void Module::collect_buffers(const std::string& prefix, bool recurse,
                                               std::vector<std::pair<std::string, AnyTensor>>& out) const {
  for (auto& [n, b] : buffers_) out.emplace_back(prefix + n, b);
  if (recurse)
    for (auto& [n, c] : children_) c->collect_buffers(prefix + n + ".", true, out);
}

LAZYTENSOR_INLINE void Module::collect_state(const std::string& prefix, StateDict& sd) const {
  for (auto& [n, p] : params_) sd.insert(prefix + n, p.detach());
  for (auto& [n, b] : buffers_) sd.insert(prefix + n, b);
  for (auto& [n, c] : children_) c->collect_state(prefix + n + ".", sd);
}

LAZYTENSOR_INLINE void Module::print_tree(std::ostream& os, int indent) const {
  pretty_print(os);
  if (children_.empty()) return;
  os << "(\n";
  for (auto& [n, c] : children_) {
    os << std::string(static_cast<std::size_t>(indent + 2), ' ') << "(" << n << "): ";
    c->print_tree(os, indent + 2);
    os << "\n";
  }
  os << std::string(static_cast<std::size_t>(indent), ' ') << ")";
}

LAZYTENSOR_INLINE AnyTensor Module::on_device(const AnyTensor& t, const Device& dev) {
  return t.visit([&](const auto& typed) { return AnyTensor(typed.to(dev)); });
}

LAZYTENSOR_INLINE std::string Module::join(const std::vector<std::string>& v) {
  std::string s;
  for (const auto& x : v) s += (s.empty() ? "'" : ", '") + x + "'";
  return s.empty() ? "none" : s;
}
#endif  // LAZYTENSOR_HEADER_DEFINITIONS

}  // namespace lazy::nn

/// Declares `Name` as the holder of `NameImpl` (libtorch's TORCH_MODULE).
#define LAZY_MODULE(Name)                                          \
  class Name : public ::lazy::nn::ModuleHolder<Name##Impl> {       \
   public:                                                         \
    using ::lazy::nn::ModuleHolder<Name##Impl>::ModuleHolder;      \
  }
