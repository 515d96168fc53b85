#pragma once
// nn::Sequential: modules applied in order, registered as "0", "1", ...

#include <functional>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <lazytensor/core/config.hpp>
#include <lazytensor/nn/module.hpp>

namespace lazy::nn {

/// A chain of modules, each mapping a tensor to one of the same dtype.
class SequentialImpl : public Module {
 public:
  SequentialImpl() : Module("Sequential") {}
  /// Sequential(Linear(4, 8), ReLU(), Linear(8, 2)).
  template <class... Holders>
  explicit SequentialImpl(Holders... modules) : Module("Sequential") {
    (push_back(std::move(modules)), ...);
  }

  /// Appends a module (a holder such as nn::Linear) whose forward maps a tensor to one of
  /// the same dtype. A module with a float-only forward raises DTypeError when the chain
  /// runs in another dtype.
  template <class H>
  void push_back(H holder);

  /// Applies every module in order, in x's dtype.
  template <FloatingElement T>
  Tensor<T> forward(const Tensor<T>& x) const {
    Tensor<T> y = x;
    for (const auto& s : steps_) y = std::get<std::function<Tensor<T>(const Tensor<T>&)>>(s)(y);
    return y;
  }
  /// The same on a pending expression.
  template <expr::Pending E>
  auto forward(const E& x) const {
    return forward(lazy::eval(x));
  }
  /// Number of modules.
  std::size_t size() const { return steps_.size(); }

 private:
  template <class T>
  using Step = std::function<Tensor<T>(const Tensor<T>&)>;
  template <class T, class Impl>
  static Step<T> step_of(const std::shared_ptr<Impl>& impl) {
    if constexpr (requires(const Tensor<T>& x) { impl->forward(x); }) {
      return [impl](const Tensor<T>& x) { return Tensor<T>(impl->forward(x)); };
    } else {
      return [impl](const Tensor<T>&) -> Tensor<T> {
        throw DTypeError(impl->name() + " in Sequential has no forward for " + dtype_name(dtype_of<T>()) +
                         " tensors");
      };
    }
  }
  std::vector<std::tuple<Step<float>, Step<double>, Step<bfloat16>>> steps_;
};
LAZY_MODULE(Sequential);

// (Outside the class, so not inline: see core/config.hpp. The library's own layers are
// instantiated in the compiled runtime, LAZYTENSOR_NN_SEQUENTIAL_INSTANCES in nn.hpp.)
template <class H>
void SequentialImpl::push_back(H holder) {
  auto impl = holder.ptr();
  register_module(std::to_string(steps_.size()), impl);
  steps_.emplace_back(step_of<float>(impl), step_of<double>(impl), step_of<bfloat16>(impl));
}

}  // namespace lazy::nn
