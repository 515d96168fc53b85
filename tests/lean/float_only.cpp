// A program that computes in float only: forward, backward and an optimizer step. Its object
// file must hold no double or bfloat16 kernels (tests/lean/check_symbols.cmake): the runtime
// dispatches on dtypes, but it must not compile every dtype's kernels into every program.
// Nor backward code for an expression that reads no floating tensor.
// It includes the umbrella header, as most programs do: the modules it never calls must leave
// no vtable in its object (no symbol at all of train, io and data).
#include <iostream>

#include <lazytensor/lazytensor.hpp>

int main() {
  auto a = lazy::randn<float>({64, 64});
  lazy::Tensor<float> y = lazy::relu(a * 2 + 1);
  std::cout << lazy::sum(y).item() << "\n";

  lazy::nn::Linear fc(64, 10);
  // BasicSGD<float>: the float update only (optim::SGD also compiles bfloat16's and double's,
  // for modules converted at run time).
  lazy::optim::BasicSGD<float> opt(fc->parameters(), lazy::optim::SGDOptions(0.1).momentum(0.9));
  auto target = lazy::randint<std::int64_t>(0, 10, {64});
  // Float computed from integers only: no tensor here can require grad, so no backward
  // code may be compiled for it either (check_symbols.cmake).
  lazy::Tensor<float> half = lazy::cast<float>(target) * 0.5f;
  std::cout << lazy::sum(half).item() << "\n";
  auto loss = lazy::nn::functional::cross_entropy(fc(y), target);
  opt.zero_grad();
  loss.backward();
  opt.step();
  lazy::mark_step();
  std::cout << loss.item() << "\n";
}
