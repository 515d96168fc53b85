#pragma once
// Where the non-template runtime (device, executor, planner, pools, thread pool, collectives'
// transport, file and format readers) is defined.
//
// Header-only, the default: the headers define it `inline`, and every translation unit that
// uses a part compiles that part again. With LAZYTENSOR_COMPILED (defined for users by the
// CMake target lazytensor::compiled) the headers only declare it, and the library defines it
// once: a user TU then compiles just the templates it names (kernels of its dtypes and ops).
// Templates are always defined in the headers.
//
// A header writes its runtime definitions after its declarations, as
//   #if LAZYTENSOR_HEADER_DEFINITIONS
//   LAZYTENSOR_INLINE void ThreadPool::resize(int threads) { ... }
//   #endif
// so both modes read the same text. LAZYTENSOR_INLINE goes on those definitions only, never
// on a declaration.

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
