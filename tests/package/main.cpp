// Minimal consumer: proves the installed / add_subdirectory'd package is usable.
#include <lazytensor/lazytensor.hpp>

int main() {
  lazy::Tensor<float> a = lazy::ones<float>({4});
  lazy::Tensor<float> b = a + a;
  lazy::mark_step();
  return b.to_vector()[0] == 2.0f ? 0 : 1;
}
