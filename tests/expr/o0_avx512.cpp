// Built, not run: the library's kernels compile unoptimized for AVX-512 (tests/CMakeLists.txt
// builds this file with -O0 -march=x86-64-v4 on any machine). GCC implements the AVX-512
// intrinsics as macros at -O0, which xsimd 8.1's AVX-512 kernels cannot pass a batch to;
// core/simd.hpp hides AVX-512 from xsimd there. Without that, a Debug build with
// -march=native on an AVX-512 CPU failed in the normal draws, the reductions and the GEMM.
// The function below reaches those kernels (and the others of the umbrella's modules) in
// each floating dtype.

#include <lazytensor/lazytensor.hpp>

namespace lazy_tests {

template <class T>
T touch_kernels() {
  auto a = lazy::randn<T>({8, 8});
  auto b = lazy::rand<T>({8, 8});
  lazy::Tensor<T> y = lazy::relu(a * 2 + 1) + lazy::exp(b) * lazy::sigmoid(a);
  auto z = lazy::softmax(lazy::matmul(y, b), 1);
  return lazy::sum(z).item() + lazy::sum(lazy::amax(y, {0})).item();
}

float touch_all() {
  return touch_kernels<float>() + static_cast<float>(touch_kernels<double>()) +
         static_cast<float>(touch_kernels<lazy::bfloat16>());
}

}  // namespace lazy_tests
