#pragma once
// xsimd, as the library includes it: every kernel header includes this one, not xsimd.
//
// xsimd 8.1's AVX-512 kernels do not compile when GCC implements the AVX-512 intrinsics as
// macros, which it does when it is not optimizing (-O0, -fsyntax-only): the macros cast an
// xsimd batch to a vector type, which C++ rejects (select() on AVX-512BW, hadd() on
// AVX-512DQ, and the AVX-512CD registers are only declared with BW). A Debug build with
// -march=native on an AVX-512 CPU failed. Unoptimized GCC builds therefore hide AVX-512 from
// xsimd's configuration, so xsimd's best architecture there is AVX2 (FMA3): half the
// register width in a build that is not about speed. The library's own AVX-512 intrinsics
// (the bfloat16 GEMM) still see the compiler's flags. A program that includes xsimd itself
// before lazytensor gets xsimd's own choice.
#if defined(__GNUC__) && !defined(__clang__) && !defined(__OPTIMIZE__) && defined(__AVX512F__)
#pragma push_macro("__AVX512F__")
#pragma push_macro("__AVX512CD__")
#pragma push_macro("__AVX512DQ__")
#pragma push_macro("__AVX512BW__")
#undef __AVX512F__
#undef __AVX512CD__
#undef __AVX512DQ__
#undef __AVX512BW__
#include <xsimd/xsimd.hpp>
#pragma pop_macro("__AVX512BW__")
#pragma pop_macro("__AVX512DQ__")
#pragma pop_macro("__AVX512CD__")
#pragma pop_macro("__AVX512F__")
#else
#include <xsimd/xsimd.hpp>
#endif
