#pragma once
// The products that do not run on the packed kernel (integer dtypes, products thinner than a
// register tile; the convolution's weight gradient), on Eigen's GEMM over maps of the buffers.
//
// A function template of its own, declared here and defined only where the runtime is
// defined: header-only, the headers define it; with the compiled runtime the library
// instantiates it for the four GEMM dtypes (core/config.hpp), so a user TU neither
// instantiates it nor parses Eigen.

#include <cstdint>

#include <lazytensor/core/bfloat16.hpp>
#include <lazytensor/core/config.hpp>

#if LAZYTENSOR_HEADER_DEFINITIONS
#include <Eigen/Core>
#endif

namespace lazy::graph::detail {

/// Rows [row, row + rows) of op(A) * op(B) into c (row-major, n columns, already offset to
/// the first row), with A stored m x k (k x m when `ta`) and B k x n (n x k when `tb`).
/// T: float, double, int32 or int64.
template <class T>
void eigen_gemm_rows(const T* a, const T* b, T* c, bool ta, bool tb, std::int64_t m, std::int64_t k,
                     std::int64_t n, std::int64_t row, std::int64_t rows);

#if LAZYTENSOR_HEADER_DEFINITIONS
template <class T>
void eigen_gemm_rows(const T* a, const T* b, T* c, bool ta, bool tb, std::int64_t m, std::int64_t k,
                     std::int64_t n, std::int64_t row, std::int64_t rows) {
  using Mat = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  using CMap = Eigen::Map<const Mat>;
  Eigen::Map<Mat> C(c, rows, n);
  if (k == 0) {
    C.setZero();
    return;
  }
  auto run = [&](const auto& A) {
    if (tb) C.noalias() = A * CMap(b, n, k).transpose();
    else C.noalias() = A * CMap(b, k, n);
  };
  if (ta) run(CMap(a, k, m).middleCols(row, rows).transpose());
  else run(CMap(a, m, k).middleRows(row, rows));
}
#endif  // LAZYTENSOR_HEADER_DEFINITIONS

/// D += G * C^T for row-major G [rows x inner], C [cols x inner] (both dense) and D
/// [rows x cols] with row stride `ldd` (a block of columns of a wider matrix). T: float or
/// double. The convolution's weight gradient, image by image.
template <class T>
void eigen_gemm_add_nt(const T* g, const T* c, T* d, std::int64_t rows, std::int64_t cols, std::int64_t inner,
                       std::int64_t ldd);

#if LAZYTENSOR_HEADER_DEFINITIONS
template <class T>
void eigen_gemm_add_nt(const T* g, const T* c, T* d, std::int64_t rows, std::int64_t cols, std::int64_t inner,
                       std::int64_t ldd) {
  using Mat = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  using Stride = Eigen::OuterStride<>;
  Eigen::Map<Mat, 0, Stride> D(d, rows, cols, Stride(ldd));
  Eigen::Map<const Mat> G(g, rows, inner);
  Eigen::Map<const Mat> C(c, cols, inner);
  D.noalias() += G * C.transpose();
}
#endif  // LAZYTENSOR_HEADER_DEFINITIONS

}  // namespace lazy::graph::detail

// Instantiated once in the compiled runtime (core/config.hpp).
#define LAZYTENSOR_EIGEN_GEMM_INSTANCES(P, T)                                                             \
  P template void lazy::graph::detail::eigen_gemm_rows<T>(const T*, const T*, T*, bool, bool, std::int64_t, \
                                                          std::int64_t, std::int64_t, std::int64_t, std::int64_t);
#define LAZYTENSOR_EIGEN_GEMM_ADD_NT_INSTANCES(P, T)                                                        \
  P template void lazy::graph::detail::eigen_gemm_add_nt<T>(const T*, const T*, T*, std::int64_t, std::int64_t, \
                                                            std::int64_t, std::int64_t);
#if LAZYTENSOR_EXPLICIT_INSTANTIATION
LAZYTENSOR_EIGEN_GEMM_ADD_NT_INSTANCES(extern, float)
LAZYTENSOR_EIGEN_GEMM_ADD_NT_INSTANCES(extern, double)
LAZYTENSOR_EIGEN_GEMM_INSTANCES(extern, float)
LAZYTENSOR_EIGEN_GEMM_INSTANCES(extern, double)
LAZYTENSOR_EIGEN_GEMM_INSTANCES(extern, std::int32_t)
LAZYTENSOR_EIGEN_GEMM_INSTANCES(extern, std::int64_t)
#endif
