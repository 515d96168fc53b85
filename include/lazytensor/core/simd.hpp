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

// GCC's <immintrin.h> declares the intrinsics of every x86 extension whatever the target
// flags (~39k lines, ~1 s to parse alone on a Zen 3), and xsimd includes it for AVX and up.
// So under GCC (11 and later, whose layout this follows) the library includes only the
// parts that xsimd and its own kernels use for the target's flags, with immintrin.h's
// include guard defined so that xsimd's include of it is skipped, and then undefines the
// guard: a later `#include <immintrin.h>` (the user's, Eigen's) reads the whole header
// again, the parts included here skipping themselves by their own guards. A TU that
// included <immintrin.h> first keeps it whole. Code that used intrinsics without including
// <immintrin.h> itself must now include it. In the compiled-mode umbrella program this
// saved 0.2-0.5 s of 7-9 s and a sixth of the peak memory; header-only TUs read the whole
// header through Eigen anyway. LAZYTENSOR_FULL_IMMINTRIN turns this off. (The includes are
// in immintrin.h's order: later parts use earlier parts' types.)
// clang-format off
#if defined(__GNUC__) && __GNUC__ >= 11 && !defined(__clang__) && \
    !defined(__INTEL_COMPILER) && !defined(__NVCOMPILER) && defined(__AVX__) && \
    !defined(_IMMINTRIN_H_INCLUDED) && !defined(LAZYTENSOR_FULL_IMMINTRIN) && \
    __has_include(<x86gprintrin.h>) && __has_include(<avx512bf16vlintrin.h>)
#define _IMMINTRIN_H_INCLUDED
#define LAZYTENSOR_DETAIL_PARTIAL_IMMINTRIN
#include <x86gprintrin.h>
#include <mmintrin.h>
#include <xmmintrin.h>
#include <emmintrin.h>
#include <pmmintrin.h>
#include <tmmintrin.h>
#include <smmintrin.h>
#include <avxintrin.h>
#include <avx2intrin.h>
#include <fmaintrin.h>
#include <f16cintrin.h>
#if defined(__AVX512F__)
#include <avx512fintrin.h>
#include <avx512cdintrin.h>
#include <avx512vlintrin.h>
#include <avx512bwintrin.h>
#include <avx512dqintrin.h>
#include <avx512vlbwintrin.h>
#include <avx512vldqintrin.h>
#endif
#if defined(__AVX512ER__)  // (xsimd's AVX-512F rsqrt on Knights Landing)
#include <avx512erintrin.h>
#endif
#if defined(__AVX512VBMI__)  // (xsimd's byte swizzle on AVX-512BW)
#include <avx512vbmiintrin.h>
#include <avx512vbmivlintrin.h>
#endif
#if defined(__AVX512BF16__)
#include <avx512bf16vlintrin.h>
#include <avx512bf16intrin.h>
#endif
#endif
// clang-format on

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

#if defined(LAZYTENSOR_DETAIL_PARTIAL_IMMINTRIN)
#undef _IMMINTRIN_H_INCLUDED
#undef LAZYTENSOR_DETAIL_PARTIAL_IMMINTRIN
#endif
