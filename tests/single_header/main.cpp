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
  // The Eigen adapter, which the umbrella leaves out, is part of the single header: a
  // column-major matrix in, its row-major view out, element by element against the input.
  Eigen::MatrixXf m(2, 3);
  m << 1, 2, 3, 4, 5, 6;
  const lazy::Tensor<float> t = lazy::from_eigen(m);
  const auto view = t.eigen();  // a map of t's buffer: t must outlive it
  bool same = view.rows() == 2 && view.cols() == 3;
  for (int r = 0; same && r < 2; ++r)
    for (int c = 0; c < 3; ++c) same = same && view(r, c) == m(r, c);
  std::printf("single header: from_eigen(m).eigen() %s m\n", same ? "==" : "!=");
  return std::abs(got - ref) <= 1e-6 * ref && same ? 0 : 1;
}
