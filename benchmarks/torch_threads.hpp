#pragma once
// Thread control for the libtorch peers (included only with LAZYTENSOR_HAVE_TORCH).
//
// libtorch calls BLAS (sgemm_) for float GEMMs; Debian's libtorch links the libblas.so.3
// alternative, OpenBLAS when libopenblas0-pthread is installed. at::set_num_threads does not
// reach OpenBLAS's own pool (left alone, it runs a GEMM on every core), so it is set
// through OpenBLAS's API when that is what got loaded.

#include <dlfcn.h>

#include <sstream>
#include <string>

#include <torch/torch.h>

namespace bench {

using OpenblasSetThreads = void (*)(int);
using OpenblasGetThreads = int (*)();
using OpenblasString = char* (*)();

/// Sets libtorch's intra-op threads and OpenBLAS's threads (when sgemm_ is OpenBLAS's).
inline void set_torch_threads(int intra_op, int blas) {
  torch::set_num_threads(intra_op);
  if (auto f =
          reinterpret_cast<OpenblasSetThreads>(dlsym(RTLD_DEFAULT, "openblas_set_num_threads")))
    f(blas);
}

/// OpenBLAS's thread count, -1 when sgemm_ is not OpenBLAS's.
inline int blas_threads() {
  auto f = reinterpret_cast<OpenblasGetThreads>(dlsym(RTLD_DEFAULT, "openblas_get_num_threads"));
  return f ? f() : -1;
}

/// Which library provides sgemm_, and OpenBLAS's own description when it is OpenBLAS.
inline std::string torch_blas_info() {
  std::ostringstream os;
  void* sgemm = dlsym(RTLD_DEFAULT, "sgemm_");
  Dl_info info{};
  os << "sgemm_ from "
     << (sgemm && dladdr(sgemm, &info) && info.dli_fname ? info.dli_fname : "(not found)");
  if (auto cfg = reinterpret_cast<OpenblasString>(dlsym(RTLD_DEFAULT, "openblas_get_config")))
    os << "; " << cfg();
  if (auto core = reinterpret_cast<OpenblasString>(dlsym(RTLD_DEFAULT, "openblas_get_corename")))
    os << "; core " << core();
  return os.str();
}

}  // namespace bench
