// Compiled by scripts/test.sh --all against single_include/ only: proves the generated
// single header is self-contained and computes the right thing.
#include <lazytensor/lazytensor.hpp>

#include <cmath>
#include <cstdio>

int main() {
  auto a = lazy::arange<float>(1000);
  lazy::Tensor<float> y = lazy::relu(a * 2.0f - 10.0f);
  auto s = lazy::sum(y);
  lazy::mark_step();
  double ref = 0;
  for (int i = 0; i < 1000; ++i) ref += std::max(0.0, 2.0 * i - 10.0);
  const double got = s.item();
  std::printf("single header: sum = %.1f (expected %.1f)\n", got, ref);
  return std::abs(got - ref) <= 1e-6 * ref ? 0 : 1;
}
