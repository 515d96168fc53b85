#pragma once
// lazy::Tensor<T>: a cheap handle, like torch::Tensor. Copies share one tensor object that
// points at the graph node holding the current value; in-place ops rebind that node.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <ostream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <lazytensor/autograd/engine.hpp>
#include <lazytensor/core/block_cache.hpp>
#include <lazytensor/core/counters.hpp>
#include <lazytensor/expr/expr.hpp>
#include <lazytensor/tensor/make_elementwise.hpp>

namespace lazy {

namespace detail {
/// The Eigen view behind Tensor::eigen(), defined by <lazytensor/eigen.hpp>.
template <class T, class Unused>
struct EigenView {
  static_assert(sizeof(Unused*) == 0, "Tensor::eigen() needs #include <lazytensor/eigen.hpp>");
};
}  // namespace detail

/// A user-facing device handle: which engine device a tensor lives on.
class Device {
 public:
  Device() = default;
  explicit Device(int index) : index_(index) {}
  int index() const { return index_; }
  /// "CPU:0", as torch_xla names devices.
  std::string str() const { return "CPU:" + std::to_string(index_); }
  /// The engine behind this handle.
  graph::Device& engine() const { return graph::DeviceRegistry::get().device(index_); }
  friend bool operator==(const Device&, const Device&) = default;

 private:
  int index_ = 0;
};

inline std::ostream& operator<<(std::ostream& os, const Device& d) { return os << d.str(); }

/// This thread's current device (torch_xla.device()).
inline Device device() { return Device(graph::current_device_index()); }

namespace detail {
/// Raised when a Tensor<T> handle's object now holds another dtype (Module::to(dtype)).
[[noreturn]] void retyped_handle(DType handle, DType held);

/// Raises the DeviceError of a gradient (`what`: "backward: gradient", ...) on device
/// `found` for a tensor on `expected`, worded as libtorch's.
[[noreturn]] void wrong_grad_device(const char* what, const Device& expected, const Device& found);

/// Refuses in-place op `op` on `impl` when it is a leaf that requires grad and grad mode is
/// on, as libtorch: the gradient would belong to neither value. Optimizers update such
/// leaves under NoGradGuard. (Tensor<T> and AnyTensor share it.)
void check_inplace(const graph::TensorImpl& impl, const char* op);

/// A materialized node holding a copy of `n` host values.
template <Element T>
graph::NodePtr data_node(const T* src, const Shape& shape, const Device& dev) {
  graph::Device& d = dev.engine();
  auto buf = d.pool().acquire(padded_bytes(shape.numel(), sizeof(T)));
  if (shape.numel() > 0) std::memcpy(buf->data(), src, static_cast<std::size_t>(shape.numel()) * sizeof(T));
  return std::make_shared<graph::DataNode>(dtype_of<T>(), shape, &d, std::move(buf));
}
}  // namespace detail

namespace detail {
/// `v` converted to T, or a DTypeError naming `op` when T cannot hold it, as libtorch's checked
/// scalar conversion ("value cannot be converted to type int32_t without overflow"): NaN or
/// a value out of range for an integer T (after truncation toward zero), a finite value
/// beyond a floating T's range (infinities and NaN convert). A plain static_cast of those
/// is undefined behaviour. Any value converts to bool (non-zero is true).
template <Element T, expr::Number V>
T checked_scalar(V v, const char* op) {
  using W =
      std::conditional_t<std::is_same_v<V, bfloat16>, float, V>;  // bfloat16 compares as float
  const W w = static_cast<W>(v);
  bool ok = true;
  if constexpr (std::is_same_v<T, bool> || std::is_same_v<W, bool>) {
    ok = true;
  } else if constexpr (!is_floating_v<T>) {
    if constexpr (std::is_floating_point_v<W>) {
      // -min is 2^(bits-1), exact in double: the truncated value must lie in [min, -min).
      const double t = std::trunc(static_cast<double>(w)),
                   lo = static_cast<double>(std::numeric_limits<T>::min());
      ok = t >= lo && t < -lo;
    } else {
      // (std::in_range takes no character types: widened first.)
      if constexpr (std::is_unsigned_v<W>)
        ok = std::in_range<T>(static_cast<unsigned long long>(w));
      else
        ok = std::in_range<T>(static_cast<long long>(w));
    }
  } else if constexpr (std::is_floating_point_v<W> && !std::is_same_v<T, double>) {
    const double d = static_cast<double>(w),
                 mx = static_cast<double>(std::numeric_limits<float>::max());
    ok = !std::isfinite(d) || (d >= -mx && d <= mx);
  }
  if (!ok) {
    throw DTypeError(std::string(op) + ": value " + std::to_string(static_cast<double>(w)) +
                     " cannot be converted to type " + dtype_name(dtype_of<T>()) +
                     " without overflow");
  }
  if constexpr (std::is_same_v<T, bfloat16>)
    return bfloat16(static_cast<float>(w));
  else
    return static_cast<T>(w);
}

/// Element `i` of a tensor's buffer as a host value. A bool is read through its byte (any
/// nonzero byte is true): the memory of `empty<bool>` is uninitialized, and loading a byte
/// other than 0 or 1 as a bool is undefined behaviour.
template <Element T>
T read_value(const T* p, std::int64_t i) {
  if constexpr (std::is_same_v<T, bool>) {
    return reinterpret_cast<const unsigned char*>(p)[i] != 0;
  } else {
    return p[i];
  }
}
}  // namespace detail

/// A lazy tensor of element type T (float, double, int32_t, int64_t, bool, bfloat16).
template <Element T>
class Tensor {
 public:
  using value_type = T;

  /// An undefined tensor (defined() is false), like torch::Tensor().
  Tensor() = default;

  /// Wraps a graph node (internal: factories and ops build tensors this way).
  explicit Tensor(graph::NodePtr node) : impl_(core::make_cached<graph::TensorImpl>(std::move(node))) {}

  /// A handle on an existing tensor object (shares it, like copying a handle). Throws
  /// DTypeError when the object holds another element type.
  static Tensor from_impl(std::shared_ptr<graph::TensorImpl> impl) {
    Tensor t;
    if (impl && impl->node && impl->node->dtype() != dtype_of<T>()) {
      throw DTypeError("expected a tensor of dtype " + dtype_name(dtype_of<T>()) + ", found " +
                       dtype_name(impl->node->dtype()));
    }
    t.impl_ = std::move(impl);
    return t;
  }

  /// Captures an expression as a pending node; nothing is computed until a sync or read.
  /// Records its backward function when a leaf requires grad.
  template <class Op, class... C>
  Tensor(const Expr<Op, C...>& e) {  // NOLINT: implicit, as `Tensor<float> y = e;`
    autograd::GradFnPtr fn;
    *this = Tensor(detail::make_elementwise<T>(e, nullptr, &fn));
    autograd::attach_grad_fn(*impl_, std::move(fn));
  }
  /// A statement's temporary expression (`Tensor<float> y = a + b;`) is consumed: its
  /// tensor references move into the node.
  template <class Op, class... C>
  Tensor(Expr<Op, C...>&& e) {  // NOLINT: implicit, as `Tensor<float> y = a + b;`
    autograd::GradFnPtr fn;
    *this = Tensor(detail::make_elementwise<T>(std::move(e), nullptr, &fn));
    autograd::attach_grad_fn(*impl_, std::move(fn));
  }

  /// Rebinds this handle (not the shared tensor) to an expression's value, as `t = a + b`
  /// does in libtorch.
  template <class Op, class... C>
  Tensor& operator=(const Expr<Op, C...>& e) {
    return *this = Tensor(e);
  }
  template <class Op, class... C>
  Tensor& operator=(Expr<Op, C...>&& e) {
    return *this = Tensor(std::move(e));
  }

  /// True unless default-constructed.
  bool defined() const { return impl_ != nullptr; }
  /// Sizes of each dimension.
  const Shape& shape() const { return node()->shape(); }
  /// Same as shape(), libtorch's name.
  const Shape& sizes() const { return shape(); }
  /// Size of dimension d (negative counts from the back).
  std::int64_t size(std::int64_t d) const { return shape().size(d); }
  /// Rank.
  int dim() const { return shape().rank(); }
  /// Number of elements.
  std::int64_t numel() const { return shape().numel(); }
  /// Element type tag.
  static constexpr DType dtype = dtype_of<T>();
  /// Device the value lives on.
  Device device() const { return Device(node()->device()->index()); }

  /// The single value of a one-element tensor. Materializes (an implicit sync).
  T item() const {
    if (numel() != 1) {
      throw ShapeError("item(): a Tensor with " + std::to_string(numel()) +
                       " elements cannot be converted to a scalar (expected 1 element)");
    }
    return detail::read_value(data(), 0);
  }

  /// A copy of the values, row-major. Materializes (an implicit sync).
  std::vector<T> to_vector() const {
    const T* p = data();
    if constexpr (std::is_same_v<T, bool>) {
      std::vector<bool> out(static_cast<std::size_t>(numel()));
      for (std::int64_t i = 0; i < numel(); ++i) out[static_cast<std::size_t>(i)] = detail::read_value(p, i);
      return out;
    } else {
      return std::vector<T>(p, p + numel());
    }
  }

  /// A row-major Eigen view of the values: rank 2 as is, rank 1 as a column, rank 0 as
  /// 1x1, higher ranks as (numel / last dim) x last dim. Valid while this handle keeps the
  /// value (until it is modified or destroyed). Materializes (an implicit sync).
  /// Needs <lazytensor/eigen.hpp> (opt-in, not in the umbrella), so that programs that never
  /// view a tensor through Eigen do not parse its interop.
  template <class Unused = void>
  auto eigen() const
    requires(!std::is_same_v<T, bfloat16>)
  {
    return detail::EigenView<T, Unused>::map(*this);
  }

  /// Pointer to the materialized values (row-major, padded). Materializes.
  const T* data() const {
    if (graph::materialize(node())) {
      static auto& implicit = core::counter("ImplicitSync");
      implicit.add();
    }
    static auto& transfers = core::counter("TransferFromDevice");
    transfers.add();
    return node()->template data<T>();
  }

  /// A copy on device `dev` (this handle when already there). The value is materialized on
  /// its own device first, then copied into a buffer of `dev`'s pool. Differentiable, as in
  /// libtorch: when this tensor requires grad, the copy's grad_fn is ToCopyBackward0, which
  /// copies the gradient back to this tensor's device.
  Tensor to(const Device& dev) const {
    if (dev == device()) return *this;
    const T* p = data();
    Tensor out(detail::data_node<T>(p, shape(), dev));
    if constexpr (is_floating_v<T>) {
      // A dtype-free backward of the autograd node level: this layer needs no explicit rule
      // (autograd/record.hpp sits above it), and AnyTensor::to, which calls this for every
      // dtype, compiles no gradient kernel.
      if (autograd::GradFnPtr e = autograd::edge_of(impl_)) {
        auto fn = std::make_shared<autograd::ToCopyGradFn>(node()->device());
        fn->next = {std::move(e)};
        autograd::attach_grad_fn(*out.impl_, std::move(fn));
      }
    }
    return out;
  }

  /// The tensor as an expression operand (with its autograd edge when it requires grad).
  expr::Leaf<T> to_leaf() const { return {node(), autograd::edge_of(impl_)}; }

  // ---- autograd (libtorch names) ---------------------------------------------------

  /// Marks a leaf as requiring gradients (floating dtypes only, leaves only).
  Tensor& requires_grad_(bool on = true) {
    if constexpr (!is_floating_v<T>) {
      if (on) {
        throw DTypeError("requires_grad_: only tensors of floating point dtype can require gradients, got " +
                         dtype_name(dtype_of<T>()));
      }
    }
    if (!is_leaf()) {
      throw Error("requires_grad_: you can only change requires_grad flags of leaf variables (this tensor was "
                  "computed by " + impl_->autograd->grad_fn->name() + ")");
    }
    node();
    if (on) autograd::register_grad_dtype<T>();  // its gradients are added and converted at run time
    impl_->autograd_meta().requires_grad = on;
    return *this;
  }
  /// True when gradients flow into this tensor.
  bool requires_grad() const { return impl_ && impl_->requires_grad(); }
  /// True unless the value was computed by an operation recorded for autograd.
  bool is_leaf() const { return !impl_ || !impl_->autograd || !impl_->autograd->grad_fn; }
  /// The function that computed this value (nullptr for leaves).
  const autograd::GradFnPtr& grad_fn() const {
    static const autograd::GradFnPtr none;
    return impl_ && impl_->autograd ? impl_->autograd->grad_fn : none;
  }
  /// The accumulated gradient (undefined until a backward pass reached this tensor). The
  /// handle shares the gradient: `p.grad().zero_()` zeroes it.
  Tensor grad() const {
    if (!impl_ || !impl_->autograd || !impl_->autograd->grad || !impl_->autograd->grad->node) return Tensor();
    return from_impl(impl_->autograd->grad);
  }
  /// Replaces (or with an undefined tensor, clears) the accumulated gradient, which must have
  /// this tensor's shape and device.
  void set_grad(const Tensor& g) {
    node();  // an undefined tensor throws here
    auto& meta = impl_->autograd_meta();
    if (!g.defined()) {
      meta.grad.reset();
      return;
    }
    if (!(g.shape() == shape())) {
      throw ShapeError("set_grad: assigned grad has shape " + g.shape().str() + ", expected " + shape().str());
    }
    if (g.device() != device())
      detail::wrong_grad_device("set_grad: assigned grad", device(), g.device());
    meta.grad = g.impl_;
  }
  /// Keeps this non-leaf tensor's gradient in `.grad()` during backward. Error when the
  /// tensor does not require grad (there would never be a gradient to keep), as libtorch.
  void retain_grad() {
    node();  // an undefined tensor throws here
    if (!requires_grad())
      throw Error("retain_grad: can't retain_grad on Tensor that has requires_grad=False");
    if (is_leaf()) return;  // leaves keep theirs anyway
    auto& meta = *impl_->autograd;
    if (!meta.retains_grad) {
      meta.retains_grad = true;
      meta.grad_fn->retained.push_back(impl_);
    }
  }
  /// A new tensor sharing this value, outside autograd (torch's detach()).
  Tensor detach() const { return Tensor(node()); }

  /// Backpropagates from this tensor: `gradient` (of this tensor's shape and device)
  /// defaults to 1 for a one-element tensor.
  /// Gradients accumulate into the leaves' `.grad()` as pending values; the graph is freed
  /// unless `retain_graph`.
  void backward(const Tensor& gradient = Tensor(), bool retain_graph = false) const {
    if (!requires_grad()) {
      throw Error("backward: element 0 of tensors does not require grad and does not have a grad_fn");
    }
    graph::NodePtr g;
    if (gradient.defined()) {
      if (!(gradient.shape() == shape())) {
        throw ShapeError("backward: gradient has shape " + gradient.shape().str() + ", expected " + shape().str());
      }
      if (gradient.device() != device())
        detail::wrong_grad_device("backward: gradient", device(), gradient.device());
      g = gradient.node();
    } else {
      if (numel() != 1) {
        throw Error("backward: grad can be implicitly created only for scalar outputs (got shape " +
                    shape().str() + ")");
      }
      if constexpr (is_floating_v<T>) g = autograd::full_node_of<T>(shape(), node()->device(), 1.0);
      else throw DTypeError("backward: only floating point tensors have gradients, found " + dtype_name(dtype_of<T>()));
    }
    autograd::GradFnPtr root = [&] {
      autograd::AutoGradMode on(true);
      return autograd::edge_of(impl_);
    }();
    autograd::run_backward({{{root, g}}, retain_graph, {}});
  }
  /// The graph node holding the current value.
  const graph::NodePtr& node() const {
    if (!impl_) throw Error("use of an undefined tensor (default-constructed lazy::Tensor)");
    // A module converted with to(dtype) rebinds its parameters to another element type;
    // a handle typed for the old one must not read the new bytes as T.
    if (impl_->node && impl_->node->dtype() != dtype_of<T>()) [[unlikely]]
      detail::retyped_handle(dtype_of<T>(), impl_->node->dtype());
    return impl_->node;
  }
  /// The shared tensor object (every copy of this handle has the same one).
  const std::shared_ptr<graph::TensorImpl>& impl() const { return impl_; }

  // ---- in-place (functionalized: the shared object is rebound to a new node) ---------

  /// Replaces the value with `src` broadcast to this shape and converted to T.
  template <class X>
  Tensor& copy_(const X& src) {
    return assign_(expr::make<ops::Cast<T>>(src), "copy_");  // converts any dtype, like torch's copy_
  }
  template <class X>
  Tensor& add_(const X& x) {
    return assign_(*this + x, "add_");
  }
  template <class X>
  Tensor& sub_(const X& x) {
    return assign_(*this - x, "sub_");
  }
  template <class X>
  Tensor& mul_(const X& x) {
    return assign_(*this * x, "mul_");
  }
  template <class X>
  Tensor& div_(const X& x) {
    return assign_(*this / x, "div_");
  }
  /// Adds alpha * x, as torch's add_(other, alpha).
  template <class X, class A>
  Tensor& add_(const X& x, A alpha) {
    return assign_(*this + x * alpha, "add_");
  }
  template <class X>
  Tensor& operator+=(const X& x) {
    return add_(x);
  }
  template <class X>
  Tensor& operator-=(const X& x) {
    return sub_(x);
  }
  template <class X>
  Tensor& operator*=(const X& x) {
    return mul_(x);
  }
  template <class X>
  Tensor& operator/=(const X& x) {
    return div_(x);
  }
  /// Sets every element to v. Error when T cannot hold v (NaN or out of range for an
  /// integer T, a finite value beyond a floating T's range), as libtorch.
  template <expr::Number V>
  Tensor& fill_(V v) {
    return fill_value_(v, "fill_", "FillBackward0");
  }
  /// Sets every element to zero.
  Tensor& zero_() { return fill_value_(0, "zero_", "ZeroBackward0"); }

 private:
  template <class E>
  Tensor& assign_(const E& e, const char* op) {
    using V = typename E::value_type;
    // PyTorch's can_cast: no floating result into an integral/bool tensor, nor a non-bool
    // result into a bool tensor.
    if constexpr ((is_floating_v<V> && !is_floating_v<T>) || (std::is_same_v<T, bool> && !std::is_same_v<V, bool>)) {
      throw DTypeError(std::string(op) + ": result type " + dtype_name(dtype_of<V>()) +
                       " can't be cast to the desired output type " + dtype_name(dtype_of<T>()));
    }
    if (!broadcastable_to(e.shape(), shape())) {
      throw ShapeError(std::string(op) + ": output with shape " + shape().str() +
                       " doesn't match the broadcast shape " + e.shape().str());
    }
    check_inplace(op);
    autograd::GradFnPtr fn;
    impl_->node = detail::make_elementwise<T>(e, &shape(), &fn);
    // No history in the new value: only copy_ gets here with grad mode on (the other ops read
    // this tensor), from tensors that need no grad; the old history then receives zeros.
    if (!autograd::attach_grad_fn(*impl_, std::move(fn)))
      autograd::replace_history(*impl_, "CopyBackwards");
    return *this;
  }

  template <expr::Number V>
  Tensor& fill_value_(V v, const char* op, const char* backward_name) {
    node();  // an undefined tensor throws here
    check_inplace(op);
    const T value = detail::checked_scalar<T>(v, op);
    graph::NodeList none;
    using E = Expr<ops::Identity, expr::Scalar<T>>;
    E e(expr::Scalar<T>{value});
    impl_->node = graph::submit(graph::elementwise_node<T>(
        expr::to_kernel(e, none), shape(), node()->device(), graph::NodeList{}));
    autograd::replace_history(*impl_, backward_name);  // a constant: the old history gets zeros
    return *this;
  }

  // libtorch refuses in-place updates of leaves that require grad while recording: the
  // gradient would belong to neither value. Optimizers update them under NoGradGuard.
  void check_inplace(const char* op) const {
    if (impl_) detail::check_inplace(*impl_, op);
  }

  std::shared_ptr<graph::TensorImpl> impl_;
};

namespace detail {
template <class T>
void print_value(std::ostream& os, T v) {
  if constexpr (std::is_same_v<T, bool>) os << (v ? "True" : "False");
  else if constexpr (is_floating_v<T>) os << static_cast<double>(static_cast<compute_t<T>>(v));  // double stays double
  else os << v;
}
template <class T>
void print_dims(std::ostream& os, const T* p, const Shape& s, int d, std::int64_t& pos) {
  if (d == s.rank()) {
    print_value(os, read_value(p, pos++));
    return;
  }
  os << "[";
  for (std::int64_t i = 0; i < s[d]; ++i) {
    if (i) os << (d + 1 == s.rank() ? ", " : ",\n" + std::string(static_cast<std::size_t>(d) + 8, ' '));
    print_dims(os, p, s, d + 1, pos);
  }
  os << "]";
}
}  // namespace detail

/// Prints like PyTorch: tensor([[1, 2], [3, 4]], device='CPU:0', dtype=float32).
template <Element T>
std::ostream& operator<<(std::ostream& os, const Tensor<T>& t) {
  if (!t.defined()) return os << "[ Tensor (undefined) ]";
  std::int64_t pos = 0;
  const T* p = t.data();
  os << "tensor(";
  detail::print_dims(os, p, t.shape(), 0, pos);
  return os << ", device='" << t.device().str() << "', dtype=" << dtype_name(t.dtype) << ")";
}

/// Evaluates expression `e` into a pending tensor of type T and shape `shape` (e's shape,
/// or one it broadcasts to), recording its backward function when a leaf requires grad.
template <Element T, class E>
Tensor<T> evaluate_as(const E& e, const Shape& shape) {
  autograd::GradFnPtr fn;
  Tensor<T> t(detail::make_elementwise<T>(e, &shape, &fn));
  autograd::attach_grad_fn(*t.impl(), std::move(fn));
  return t;
}

/// Evaluates an expression into a new tensor of its natural type.
template <class Op, class... C>
auto eval(const Expr<Op, C...>& e) {
  return Tensor<typename Expr<Op, C...>::value_type>(e);
}

#if LAZYTENSOR_HEADER_DEFINITIONS
LAZYTENSOR_INLINE void detail::retyped_handle(DType handle, DType held) {
  throw DTypeError("this Tensor<" + dtype_name(handle) + "> handle's tensor now holds " + dtype_name(held) +
                   " (its module was converted with to(dtype)); view it as AnyTensor(t).as<T>() of the new type");
}

LAZYTENSOR_INLINE void detail::wrong_grad_device(const char* what, const Device& expected,
                                                 const Device& found) {
  throw DeviceError(std::string(what) + " is on the wrong device: expected device " +
                    expected.str() + " but got " + found.str());
}

LAZYTENSOR_INLINE void detail::check_inplace(const graph::TensorImpl& impl, const char* op) {
  const bool leaf = !impl.autograd || !impl.autograd->grad_fn;
  if (autograd::is_grad_enabled() && impl.requires_grad() && leaf) {
    throw Error(std::string(op) +
                ": a leaf Variable that requires grad is being used in an in-place operation "
                "(wrap the update in lazy::NoGradGuard)");
  }
}
#endif  // LAZYTENSOR_HEADER_DEFINITIONS

}  // namespace lazy
