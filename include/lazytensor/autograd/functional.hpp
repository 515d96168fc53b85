#pragma once
// torch.autograd.grad: gradients of outputs with respect to chosen inputs, returned rather
// than accumulated into `.grad()`.

#include <string>
#include <vector>

#include <lazytensor/tensor/tensor.hpp>

namespace lazy::autograd {

/// Gradients of sum(outputs[i] * grad_outputs[i]) with respect to each of `inputs` (one-
/// element outputs may omit grad_outputs). No `.grad()` changes. An input the outputs do
/// not depend on is an Error unless `allow_unused` (then its gradient is undefined), and so
/// are empty `inputs`. An input given twice gets its gradient in both places.
template <Element T>
std::vector<Tensor<T>> grad(const std::vector<Tensor<T>>& outputs, const std::vector<Tensor<T>>& inputs,
                            const std::vector<Tensor<T>>& grad_outputs = {}, bool retain_graph = false,
                            bool allow_unused = false) {
  // With nothing captured, run_backward would accumulate into every leaf's .grad() instead.
  if (inputs.empty()) throw Error("autograd::grad: grad requires non-empty inputs");
  if (!grad_outputs.empty() && grad_outputs.size() != outputs.size()) {
    throw Error("autograd::grad: expected " + std::to_string(outputs.size()) + " grad_outputs, got " +
                std::to_string(grad_outputs.size()));
  }
  BackwardRequest req;
  req.retain_graph = retain_graph;
  {
    AutoGradMode on(true);
    for (std::size_t i = 0; i < outputs.size(); ++i) {
      const Tensor<T>& o = outputs[i];
      if (!o.requires_grad()) {
        throw Error("autograd::grad: output " + std::to_string(i) + " does not require grad and has no grad_fn");
      }
      graph::NodePtr g;
      if (grad_outputs.empty()) {
        if (o.numel() != 1) {
          throw Error("autograd::grad: grad can be implicitly created only for scalar outputs (output " +
                      std::to_string(i) + " has shape " + o.shape().str() + ")");
        }
        g = full_node_of<T>(o.shape(), o.node()->device(), 1.0);
      } else {
        if (!(grad_outputs[i].shape() == o.shape())) {
          throw ShapeError("autograd::grad: grad_outputs[" + std::to_string(i) + "] has shape " +
                           grad_outputs[i].shape().str() + ", expected " + o.shape().str());
        }
        if (grad_outputs[i].device() != o.device()) {
          const std::string what = "autograd::grad: grad_outputs[" + std::to_string(i) + "]";
          lazy::detail::wrong_grad_device(what.c_str(), o.device(), grad_outputs[i].device());
        }
        g = grad_outputs[i].node();
      }
      req.roots.emplace_back(edge_of(o.impl()), g);
    }
    for (std::size_t i = 0; i < inputs.size(); ++i) {
      if (!inputs[i].requires_grad()) {
        throw Error("autograd::grad: input " + std::to_string(i) + " does not require grad");
      }
      req.capture.push_back(edge_of(inputs[i].impl()));
    }
  }
  auto nodes = run_backward(req);
  std::vector<Tensor<T>> out;
  for (std::size_t i = 0; i < nodes.size(); ++i) {
    if (!nodes[i]) {
      if (!allow_unused) {
        throw Error("autograd::grad: input " + std::to_string(i) +
                    " appears to not have been used in the graph (set allow_unused to get an undefined gradient)");
      }
      out.emplace_back();
    } else {
      out.emplace_back(cast_node(nodes[i], dtype_of<T>()));
    }
  }
  return out;
}

}  // namespace lazy::autograd
