#pragma once
// The backward function of a fused element-wise kernel: one gradient kernel per input that
// needs a gradient (expr/dual.hpp), summed back over broadcast dimensions and converted to
// the input's dtype.

#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <lazytensor/autograd/node_ops.hpp>
#include <lazytensor/core/config.hpp>
#include <lazytensor/expr/dual.hpp>

namespace lazy::autograd {

/// What every element-wise backward does, whatever its expression: for each input that
/// needs a gradient, a gradient kernel (made by the subclass), summed back over broadcast
/// dimensions and converted to the input's dtype.
class ElementwiseGradFnBase : public GradFn {
 public:
  /// `constant`: the expression's derivatives are constants (expr::constant_tangent), so
  /// its gradient kernels need no input value.
  /// Both defined with the runtime: in place, every ElementwiseGradFn<K> inlined the input
  /// list's copy and releases, ~2 KB per expression with a gradient.
  LAZYTENSOR_INLINE ElementwiseGradFnBase(const graph::NodeList& inputs, bool constant);
  LAZYTENSOR_INLINE ~ElementwiseGradFnBase() override;

  LAZYTENSOR_INLINE graph::NodeList apply(const graph::NodePtr& grad) override;

  /// Drops the inputs. With constant derivatives nothing was saved, as in libtorch
  /// (AddBackward0), and the function can run again: each input then reads a one-element
  /// zero of its dtype (the gradient kernel still reads a value per slot; none changes
  /// its result).
  LAZYTENSOR_INLINE void release_saved() override;

 protected:
  /// A pending node computing grad * d(output)/d(input `slot`), in the output's shape.
  virtual graph::NodePtr gradient_kernel(int slot, const graph::NodePtr& grad) const = 0;
  const graph::NodeList& inputs() const { return inputs_; }
  /// The inputs of a gradient kernel: the forward inputs, then `grad` converted to `dtype`
  /// (the kernel's last slot). Not a template, like the constructor.
  LAZYTENSOR_INLINE graph::NodeList gradient_inputs(const graph::NodePtr& grad, DType dtype) const;

 private:
  /// What a released function with constant derivatives keeps of an input.
  struct InputMeta {
    Shape shape;
    DType dtype;
    graph::Device* device;
  };
  graph::NodeList inputs_;
  /// Filled by release_saved when constant_; inputs_ then holds the placeholders (made on
  /// the next apply: a second backward is rare, a release happens every step).
  std::vector<InputMeta> released_inputs_;
  bool constant_;
};

/// Owns `fn` (made with `new`) through the base class, with `next` as its next functions.
/// Not a template: std::shared_ptr's adopting constructor (its control block, and the
/// cleanup that deletes `fn` when that allocation throws) is compiled once, not per expression.
LAZYTENSOR_INLINE GradFnPtr adopt_grad_fn(GradFn* fn, std::vector<GradFnPtr>&& next);

/// libtorch's name of the backward function of op `op`: "mul" -> "MulBackward0". (The
/// runtime's: its string building was ~180 B of every expression's backward function.)
LAZYTENSOR_INLINE std::string backward_name(const char* op);

namespace detail {
/// Registers the conversions from gradient dtype S to the dtype of every leaf of kernel K.
template <class S, class K>
struct register_leaf_casts {
  static void run() {}
};
template <class S, Element T>
struct register_leaf_casts<S, expr::KLeaf<T>> {
  static void run() { register_grad_cast<S, T>(); }
};
template <class S, class Op, class... C>
struct register_leaf_casts<S, expr::KExpr<Op, C...>> {
  static void run() { (register_leaf_casts<S, C>::run(), ...); }
};
}  // namespace detail

/// Backward of `y = K(inputs...)` with output dtype Tout.
template <class K, Element Tout>
class ElementwiseGradFn final : public ElementwiseGradFnBase {
 public:
  ElementwiseGradFn(K kernel, const graph::NodeList& inputs)
      : ElementwiseGradFnBase(inputs, expr::constant_tangent_v<K>),
        kernel_(std::move(kernel)) {
    // apply() sums gradients of the kernel's lane back to each input's shape and dtype.
    using S = typename expr::KGrad<K, Tout>::value_type;
    register_grad_dtype<Tout>();
    if constexpr (is_floating_v<S>) {
      register_grad_dtype<S>();
      detail::register_leaf_casts<S, K>::run();
    }
  }

  std::string name() const override { return backward_name(op_label()); }

 protected:
  graph::NodePtr gradient_kernel(int slot, const graph::NodePtr& grad) const override {
    using KG = expr::KGrad<K, Tout>;
    using S = typename KG::value_type;
    if constexpr (std::is_same_v<S, float> || std::is_same_v<S, double>) {
      // g * 1 (a bias added, the left side of a difference): the incoming gradient itself.
      // A kernel writing that copy read every forward input too, which kept a linear
      // layer's product alive for the backward and out of its epilogue's row blocks. Only
      // when the gradient is already in the kernel's lane: a bfloat16 one is widened (and
      // summed over broadcast dims) in float by the kernel.
      if constexpr (std::is_same_v<S, Tout>) {
        if (expr::unit_tangent(kernel_, slot)) return cast_node(grad, dtype_of<Tout>());
      }
      graph::NodeList ins = gradient_inputs(grad, dtype_of<Tout>());
      const int g_slot = static_cast<int>(ins.size()) - 1;
      return graph::submit(
          graph::elementwise_node<S>(KG{kernel_, expr::KLeaf<Tout>{g_slot}, slot}, shape, grad->device(), std::move(ins)));
    } else {
      throw DTypeError("autograd: no gradient through an expression computed in " + dtype_name(dtype_of<S>()));
    }
  }

 private:
  static const char* op_label() {
    if constexpr (requires { typename K::op_type; }) return K::op_type::name;
    else return "Identity";
  }

  K kernel_;
};

#if LAZYTENSOR_HEADER_DEFINITIONS
LAZYTENSOR_INLINE GradFnPtr adopt_grad_fn(GradFn* fn, std::vector<GradFnPtr>&& next) {
  GradFnPtr owned(fn);
  owned->next = std::move(next);
  return owned;
}

LAZYTENSOR_INLINE std::string backward_name(const char* op) {
  std::string n = op;
  if (!n.empty() && n[0] >= 'a' && n[0] <= 'z') n[0] = static_cast<char>(n[0] - 'a' + 'A');
  return n + "Backward0";
}

LAZYTENSOR_INLINE ElementwiseGradFnBase::ElementwiseGradFnBase(const graph::NodeList& inputs,
                                                                bool constant)
    : inputs_(inputs), constant_(constant) {}

LAZYTENSOR_INLINE ElementwiseGradFnBase::~ElementwiseGradFnBase() = default;

LAZYTENSOR_INLINE graph::NodeList ElementwiseGradFnBase::gradient_inputs(const graph::NodePtr& grad,
                                                                                    DType dtype) const {
  graph::NodeList ins;
  ins.reserve(inputs_.size() + 1);
  ins.insert(ins.end(), inputs_.begin(), inputs_.end());
  ins.push_back(cast_node(grad, dtype));
  return ins;
}

LAZYTENSOR_INLINE graph::NodeList ElementwiseGradFnBase::apply(const graph::NodePtr& grad) {
  check_not_released();
  if (!released_inputs_.empty() && inputs_.empty()) {
    // Built aside and assigned whole: an allocation failing halfway leaves none behind.
    graph::NodeList zeros;
    zeros.reserve(released_inputs_.size());
    for (const InputMeta& m : released_inputs_) {
      const std::size_t elem = dtype_size(m.dtype);
      auto buf = m.device->pool().acquire(padded_bytes(1, elem));
      std::memset(buf->data(), 0, elem);
      zeros.push_back(
          std::make_shared<graph::DataNode>(m.dtype, Shape{}, m.device, std::move(buf)));
    }
    inputs_ = std::move(zeros);
  }
  graph::NodeList grads(next.size());
  for (std::size_t s = 0; s < next.size(); ++s) {
    if (!next[s]) continue;
    graph::NodePtr g = gradient_kernel(static_cast<int>(s), grad);
    g = sum_to_shape(g, released_inputs_.empty() ? inputs_[s]->shape() : released_inputs_[s].shape);
    grads[s] = cast_node(g, inputs_[s]->dtype());
  }
  return grads;
}

LAZYTENSOR_INLINE void ElementwiseGradFnBase::release_saved() {
  if (constant_ && released_inputs_.empty()) {
    released_inputs_.reserve(inputs_.size());
    for (const auto& in : inputs_)
      released_inputs_.push_back({in->shape(), in->dtype(), in->device()});
  }
  inputs_.clear();
  if (!constant_) GradFn::release_saved();
}
#endif  // LAZYTENSOR_HEADER_DEFINITIONS

}  // namespace lazy::autograd
