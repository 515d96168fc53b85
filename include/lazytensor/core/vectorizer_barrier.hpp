#pragma once
// Keeping the auto-vectorizer out of short bookkeeping loops.

#include <type_traits>

namespace lazy::core {

/// Makes `value` opaque to the optimizer at this point, so the loop computing it stays
/// scalar. For loops over a handful of elements run between kernel calls (the pointers a
/// sliced group advances per slice): vectorized at -O3 (GCC) or -O2 (clang), such a loop
/// becomes vector adds with a scalar remainder and costs more than the few additions it
/// replaces (6% of the three-statement chain at 2^24 floats, measured with GCC 12 -O3).
/// Pointers and integers only (the value passes through a general-purpose register). No
/// effect on compilers without GNU inline assembly.
template <class T>
requires std::is_pointer_v<T> || std::is_integral_v<T>
inline void hide_from_vectorizer([[maybe_unused]] T& value) {
#if defined(__GNUC__)
  asm("" : "+r"(value));
#endif
}

}  // namespace lazy::core
