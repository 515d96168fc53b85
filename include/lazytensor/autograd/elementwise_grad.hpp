#pragma once
// The backward function of a fused element-wise kernel: one gradient kernel per input that
// needs a gradient (expr/dual.hpp), summed back over broadcast dimensions and converted to
// the input's dtype.

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
  explicit ElementwiseGradFnBase(std::vector<graph::NodePtr> inputs) : inputs_(std::move(inputs)) {}

  LAZYTENSOR_INLINE std::vector<graph::NodePtr> apply(const graph::NodePtr& grad) override;

  LAZYTENSOR_INLINE void release_saved() override;

 protected:
  /// A pending node computing grad * d(output)/d(input `slot`), in the output's shape.
  virtual graph::NodePtr gradient_kernel(int slot, const graph::NodePtr& grad) const = 0;
  const std::vector<graph::NodePtr>& inputs() const { return inputs_; }

 private:
  std::vector<graph::NodePtr> inputs_;
};

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
  ElementwiseGradFn(K kernel, std::vector<graph::NodePtr> inputs)
      : ElementwiseGradFnBase(std::move(inputs)), kernel_(std::move(kernel)) {
    // apply() sums gradients of the kernel's lane back to each input's shape and dtype.
    using S = typename expr::KGrad<K, Tout>::value_type;
    register_grad_dtype<Tout>();
    if constexpr (is_floating_v<S>) {
      register_grad_dtype<S>();
      detail::register_leaf_casts<S, K>::run();
    }
  }

  std::string name() const override {
    std::string n = op_label();
    if (!n.empty() && n[0] >= 'a' && n[0] <= 'z') n[0] = static_cast<char>(n[0] - 'a' + 'A');
    return n + "Backward0";
  }

 protected:
  graph::NodePtr gradient_kernel(int slot, const graph::NodePtr& grad) const override {
    using KG = expr::KGrad<K, Tout>;
    using S = typename KG::value_type;
    if constexpr (std::is_same_v<S, float> || std::is_same_v<S, double>) {
      std::vector<graph::NodePtr> ins = inputs();
      const int g_slot = static_cast<int>(ins.size());
      ins.push_back(cast_node(grad, dtype_of<Tout>()));
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
LAZYTENSOR_INLINE std::vector<graph::NodePtr> ElementwiseGradFnBase::apply(const graph::NodePtr& grad) {
  check_not_released();
  std::vector<graph::NodePtr> grads(next.size());
  for (std::size_t s = 0; s < next.size(); ++s) {
    if (!next[s]) continue;
    graph::NodePtr g = gradient_kernel(static_cast<int>(s), grad);
    g = sum_to_shape(g, inputs_[s]->shape());
    grads[s] = cast_node(g, inputs_[s]->dtype());
  }
  return grads;
}

LAZYTENSOR_INLINE void ElementwiseGradFnBase::release_saved() {
  inputs_.clear();
  GradFn::release_saved();
}
#endif  // LAZYTENSOR_HEADER_DEFINITIONS

}  // namespace lazy::autograd
