#pragma once
// nn::Sequential: modules applied in order, registered as "0", "1", ...

#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <lazytensor/core/config.hpp>
#include <lazytensor/nn/module.hpp>

namespace lazy::nn {

/// A chain of float -> float modules.
class SequentialImpl : public Module {
 public:
  SequentialImpl() : Module("Sequential") {}
  /// Sequential(Linear(4, 8), ReLU(), Linear(8, 2)).
  template <class... Holders>
  explicit SequentialImpl(Holders... modules) : Module("Sequential") {
    (push_back(std::move(modules)), ...);
  }

  /// Appends a module (a holder such as nn::Linear) whose forward maps a float tensor to one.
  template <class H>
  void push_back(H holder);

  /// Applies every module in order.
  Tensor<float> forward(const Tensor<float>& x) const;
  /// Number of modules.
  std::size_t size() const { return steps_.size(); }

 private:
  std::vector<std::function<Tensor<float>(const Tensor<float>&)>> steps_;
};
LAZY_MODULE(Sequential);

// (Outside the class, so not inline: see core/config.hpp. The library's own layers are
// instantiated in the compiled runtime, LAZYTENSOR_NN_SEQUENTIAL_INSTANCES in nn.hpp.)
template <class H>
void SequentialImpl::push_back(H holder) {
  auto impl = holder.ptr();
  register_module(std::to_string(steps_.size()), impl);
  steps_.emplace_back([impl](const Tensor<float>& x) { return Tensor<float>(impl->forward(x)); });
}

#if LAZYTENSOR_HEADER_DEFINITIONS
LAZYTENSOR_INLINE Tensor<float> SequentialImpl::forward(const Tensor<float>& x) const {
  Tensor<float> y = x;
  for (const auto& f : steps_) y = f(y);
  return y;
}
#endif  // LAZYTENSOR_HEADER_DEFINITIONS

}  // namespace lazy::nn
