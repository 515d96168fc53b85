// Element-wise gradient kernels built at -O3 (the suite builds at -Og; users often use -O3):
// the derivatives of sigmoid, tanh, exp, SiLU and GELU in double and float, at every length
// 1..40 (whole SIMD batches and every tail), against their closed forms evaluated in long
// double. GCC 12 at -O3 with AVX-512 once computed the double sigmoid gradient with lanes
// 1-7 of the first batch set to 0 (evaluator.hpp, LAZY_KERNEL_LOOP).

#include <cmath>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include <lazytensor/lazytensor.hpp>

namespace {

using Ld = long double;

Ld sig(Ld x) { return 1 / (1 + std::exp(-x)); }

// Each function and its derivative's closed form.
template <class T>
struct Case {
  const char* name;
  std::function<lazy::Tensor<T>(const lazy::Tensor<T>&)> f;
  std::function<Ld(Ld)> df;
};

template <class T>
std::vector<Case<T>> cases() {
  using X = const lazy::Tensor<T>&;
  return {
      {"sigmoid", [](X x) { return lazy::Tensor<T>(lazy::sigmoid(x)); }, [](Ld x) { return sig(x) * (1 - sig(x)); }},
      {"tanh", [](X x) { return lazy::Tensor<T>(lazy::tanh(x)); }, [](Ld x) { return 1 - std::tanh(x) * std::tanh(x); }},
      {"exp", [](X x) { return lazy::Tensor<T>(lazy::exp(x)); }, [](Ld x) { return std::exp(x); }},
      {"silu", [](X x) { return lazy::Tensor<T>(lazy::silu(x)); }, [](Ld x) { return sig(x) * (1 + x * (1 - sig(x))); }},
      {"gelu", [](X x) { return lazy::Tensor<T>(lazy::gelu(x)); },
       [](Ld x) {
         return 0.5L * (1 + std::erf(x / std::sqrt(2.0L))) +
                x * std::exp(-x * x / 2) / std::sqrt(2 * 3.14159265358979323846L);
       }},
  };
}

template <class T>
void check(double tol) {
  for (const auto& c : cases<T>()) {
    for (int n = 1; n <= 40; ++n) {
      std::vector<T> v(static_cast<std::size_t>(n));
      for (int i = 0; i < n; ++i) v[static_cast<std::size_t>(i)] = static_cast<T>(-2.5 + 5.0 * i / 40 + 0.01 * (i % 3));
      auto x = lazy::from_vector<T>(v).requires_grad_();
      lazy::Tensor<T> y = c.f(x);
      y.backward(lazy::ones<T>({n}));
      const auto g = x.grad().to_vector();
      for (int i = 0; i < n; ++i) {
        const double want = static_cast<double>(c.df(static_cast<Ld>(v[static_cast<std::size_t>(i)])));
        EXPECT_NEAR(static_cast<double>(g[static_cast<std::size_t>(i)]), want, tol * (1 + std::fabs(want)))
            << c.name << " n=" << n << " at " << i;
      }
    }
  }
}

}  // namespace

TEST(O3Kernels, DoubleGradientsMatchTheirClosedForms) { check<double>(1e-12); }

TEST(O3Kernels, FloatGradientsMatchTheirClosedForms) { check<float>(2e-6); }

// Integer reductions run reduce_span's scalar loop, which GCC 12 at -O3 vectorized into wrong
// int32 sums and products at lengths 8k..8k+3 (graph/reduction_node.hpp): every length 1..40,
// against a plain loop over the same values (products of values in [-2, 2], exact in int64).
TEST(O3Kernels, Int32SumsAndProductsAtEveryLength) {
  for (int n = 1; n <= 40; ++n) {
    std::vector<std::int32_t> v(static_cast<std::size_t>(n));
    for (int i = 0; i < n; ++i) v[static_cast<std::size_t>(i)] = (i * 7 + n) % 5 - 2;
    std::int64_t sum = 0, prod = 1;
    for (auto x : v) {
      sum += x;
      prod *= x == 0 ? 1 : x;
    }
    const auto t = lazy::from_vector<std::int32_t>(v);
    EXPECT_EQ(lazy::sum(t).item(), sum) << "n=" << n;
    EXPECT_EQ(lazy::prod(lazy::where(t == 0, 1, t)).item(), prod) << "n=" << n;
  }
}
