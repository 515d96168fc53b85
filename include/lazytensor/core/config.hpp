#pragma once
// Where the non-template runtime (device, executor, planner, pools, thread pool, collectives'
// transport, file and format readers) is defined.
//
// Header-only, the default: the headers define it `inline`, and every translation unit that
// uses a part compiles that part again. With LAZYTENSOR_COMPILED (defined for users by the
// CMake target lazytensor::compiled) the headers only declare it, and the library defines it
// once: a user TU then compiles just the templates it names (kernels of its dtypes and ops).
// Templates are defined in the headers too, but for runtime code made a template only so that
// it is instantiated on use (`template <class = void>`): that sits in the runtime blocks below
// and src/compiled.cpp instantiates it.
//
// A header writes its runtime definitions after its declarations, as
//   #if LAZYTENSOR_HEADER_DEFINITIONS
//   LAZYTENSOR_INLINE void ThreadPool::resize(int threads) { ... }
//   #endif
// so both modes read the same text. LAZYTENSOR_INLINE goes on those definitions, and on the
// in-class declaration of each virtual function so defined (in a non-template class), so that no
// header-only class has an inline key function (every TU would emit its vtable:
// docs/architecture.md).

#if defined(LAZYTENSOR_BUILDING_RUNTIME)
// src/compiled.cpp: the one TU that defines the runtime, with external linkage.
#define LAZYTENSOR_HEADER_DEFINITIONS 1
#define LAZYTENSOR_INLINE
#elif defined(LAZYTENSOR_COMPILED)
#define LAZYTENSOR_HEADER_DEFINITIONS 0
#define LAZYTENSOR_INLINE
#else
#define LAZYTENSOR_HEADER_DEFINITIONS 1
#define LAZYTENSOR_INLINE inline
#endif

// The templates that depend on a dtype only (not on an expression): the typed autograd
// helpers, a tensor's sum, views and permutes, random draws. Header-only, every TU that uses
// one instantiates it again. With the compiled runtime the library instantiates them once:
// each header keeps a list macro, LAZYTENSOR_<NAME>_INSTANCES(P, T), that names its per-dtype
// templates with prefix P. The header expands it with P = extern (user TUs, and the library
// before its definitions), src/compiled.cpp (core, graph, ops, and templates defined in a
// runtime block) or src/compiled_frontend.cpp and src/compiled_nn_wide.cpp (nn, optim, train)
// with P empty at its end, after every header: one list, so the declarations and the
// definitions cannot disagree.
//
// The frontend (nn, optim) lists the templates whose arguments the library fixes: the
// `template <class = void>` functions and layers (at void), the losses and layers over a
// dtype (at the floating dtypes), the optimizers (class templates at their one argument).
// Their member templates are defined outside the class: one defined in the class is
// inline, and GCC, optimizing, instantiates an inline function in every TU that calls it
// (to inline it) even when an `extern template` declares it.
#if defined(LAZYTENSOR_BUILDING_RUNTIME) || defined(LAZYTENSOR_COMPILED)
#define LAZYTENSOR_EXPLICIT_INSTANTIATION 1
#else
#define LAZYTENSOR_EXPLICIT_INSTANTIATION 0
#endif

// X(P, T) for each floating dtype (the dtypes that have gradients) ...
#define LAZYTENSOR_FOR_FLOATING(X, P) X(P, float) X(P, double) X(P, lazy::bfloat16)
// ... and for every element type.
#define LAZYTENSOR_FOR_ELEMENT(X, P) \
  X(P, bool) X(P, std::int32_t) X(P, std::int64_t) LAZYTENSOR_FOR_FLOATING(X, P)

// The instruction set the kernels are compiled for (xsimd and the GEMM kernel choose theirs
// from the compiler's flags), coarsely: what a mismatch would change.
#if defined(__AVX512F__)
#define LAZYTENSOR_ISA avx512
#elif defined(__AVX2__) && defined(__FMA__)
#define LAZYTENSOR_ISA avx2_fma
#elif defined(__AVX__)
#define LAZYTENSOR_ISA avx
#else
#define LAZYTENSOR_ISA sse
#endif
#define LAZYTENSOR_ISA_SYMBOL_(isa) lazytensor_compiled_for_##isa
#define LAZYTENSOR_ISA_SYMBOL(isa) LAZYTENSOR_ISA_SYMBOL_(isa)

// lazytensor::compiled holds kernels too (its per-dtype templates: nn layers, reductions,
// random draws, GEMM), compiled for the instruction set of the build that made it. A program
// built for another one would run those at the library's (slower, or unsupported by the CPU)
// while its own run at its own: the library defines a symbol named after its instruction set
// and every user TU refers to the one named after its own, so a mismatch is a link error
// naming both sides ("undefined reference to lazytensor_compiled_for_avx2_fma"). Build the
// package with the flags of the programs that use it (or use it header-only).
#if LAZYTENSOR_EXPLICIT_INSTANTIATION
extern "C" const char LAZYTENSOR_ISA_SYMBOL(LAZYTENSOR_ISA);
#endif
#if defined(LAZYTENSOR_COMPILED) && !defined(LAZYTENSOR_BUILDING_RUNTIME) && (defined(__GNUC__) || defined(__clang__))
namespace lazy::detail {
[[gnu::used]] inline const char* const compiled_isa_check = &LAZYTENSOR_ISA_SYMBOL(LAZYTENSOR_ISA);
}  // namespace lazy::detail
#endif
