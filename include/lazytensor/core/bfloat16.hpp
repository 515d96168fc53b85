#pragma once
// bfloat16: the top 16 bits of an IEEE float. A storage type: arithmetic happens in float,
// conversion from float rounds to nearest even (NaN stays NaN).

#include <bit>
#include <cmath>
#include <cstdint>
#include <ostream>

namespace lazy {

/// 16-bit brain floating point value (storage type; computes in float).
struct bfloat16 {
  std::uint16_t bits = 0;

  constexpr bfloat16() = default;
  /// Converts from float with round-to-nearest-even.
  constexpr bfloat16(float f) : bits(round_bits(f)) {}  // NOLINT: implicit like torch
  constexpr bfloat16(double d) : bfloat16(static_cast<float>(d)) {}
  constexpr bfloat16(int i) : bfloat16(static_cast<float>(i)) {}
  constexpr bfloat16(long i) : bfloat16(static_cast<float>(i)) {}
  constexpr bfloat16(long long i) : bfloat16(static_cast<float>(i)) {}
  constexpr bfloat16(bool b) : bfloat16(b ? 1.0f : 0.0f) {}

  /// Exact widening conversion to float.
  constexpr operator float() const { return std::bit_cast<float>(std::uint32_t(bits) << 16); }

  /// Builds a value from its raw bit pattern.
  static constexpr bfloat16 from_bits(std::uint16_t b) {
    bfloat16 r;
    r.bits = b;
    return r;
  }

 private:
  static constexpr std::uint16_t round_bits(float f) {
    const std::uint32_t u = std::bit_cast<std::uint32_t>(f);
    if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x007fffffu) != 0) {
      return static_cast<std::uint16_t>((u >> 16) | 0x0040u);  // quiet NaN, keep sign
    }
    const std::uint32_t lsb = (u >> 16) & 1u;
    return static_cast<std::uint16_t>((u + 0x7fffu + lsb) >> 16);
  }
};

inline std::ostream& operator<<(std::ostream& os, bfloat16 v) { return os << float(v); }

}  // namespace lazy
