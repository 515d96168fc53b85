#pragma once
// The dtypes a safetensors file may hold, and the conversions between those lazytensor has
// no tensor type for and the one that holds each of them exactly: F16 is read into float,
// U8/I8/I16/U16 into int32, U32 into int64. A state dict remembers the stored dtype of such
// a tensor (StateDict::stored_dtypes) so that saving it writes the file's dtype back.
//
// Conversions run on chunks of raw bytes: the reader widens what it reads into the tensor's
// buffer, the writer narrows into a small staging buffer, so neither holds a second copy of
// a tensor.

#include <bit>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <string_view>

#include <lazytensor/core/config.hpp>
#include <lazytensor/core/dtype.hpp>
#include <lazytensor/core/error.hpp>

namespace lazy::io::detail {

/// One safetensors dtype: its name in the header, its element size, and the lazytensor dtype
/// that holds its values (the same dtype when `native`).
struct StoredDType {
  enum class Kind : std::uint8_t { Bool, U8, I8, I16, U16, F16, BF16, I32, U32, F32, F64, I64 };
  Kind kind;
  const char* name;
  std::size_t size;
  DType holds;
  bool native;
};

/// The stored dtype named `name` (as in a safetensors header), or nullptr when lazytensor
/// cannot load it; then `why` says why (unknown, or known without a dtype that holds it).
const StoredDType* find_stored_dtype(std::string_view name, std::string* why = nullptr);

/// The native stored dtype of `d` (F32 for float, ...).
const StoredDType& native_stored_dtype(DType d);

/// Elements converted per step when a tensor is read or written in another dtype: the
/// staging buffer holds at most this many, never a second copy of the tensor.
inline constexpr std::size_t kConvertChunk = std::size_t{1} << 16;

/// Half-precision (IEEE binary16) bits to float: exact, NaN payloads kept.
float half_to_float(std::uint16_t h);

/// float to half-precision bits, rounded to nearest even; overflow gives infinity, NaN
/// payloads are kept where they fit (half -> float -> half is the identity on every pattern).
std::uint16_t float_to_half(float f);

/// Widens `n` elements of stored dtype `s` at `src` into `s.holds` elements at `dst`.
void widen(const StoredDType& s, const void* src, void* dst, std::size_t n);

/// Narrows `n` elements of dtype `s.holds` at `src` into stored dtype `s` at `dst`. Integers
/// must fit (callers check first with `find_out_of_range`); floats round to nearest even.
void narrow(const StoredDType& s, const void* src, void* dst, std::size_t n);

/// The index of the first of `n` elements of `s.holds` at `src` that `s` cannot represent,
/// or `n` when all fit (floats always fit: they round). `value` receives its text.
std::size_t find_out_of_range(const StoredDType& s, const void* src, std::size_t n,
                              std::string* value);

#if LAZYTENSOR_HEADER_DEFINITIONS

namespace stored_dtype_table {
using K = StoredDType::Kind;
inline constexpr StoredDType kAll[] = {
    {K::Bool, "BOOL", 1, DType::Bool, true},      {K::U8, "U8", 1, DType::Int32, false},
    {K::I8, "I8", 1, DType::Int32, false},        {K::I16, "I16", 2, DType::Int32, false},
    {K::U16, "U16", 2, DType::Int32, false},      {K::F16, "F16", 2, DType::Float32, false},
    {K::BF16, "BF16", 2, DType::BFloat16, true},  {K::I32, "I32", 4, DType::Int32, true},
    {K::U32, "U32", 4, DType::Int64, false},      {K::F32, "F32", 4, DType::Float32, true},
    {K::F64, "F64", 8, DType::Float64, true},     {K::I64, "I64", 8, DType::Int64, true},
};
}  // namespace stored_dtype_table

LAZYTENSOR_INLINE const StoredDType* find_stored_dtype(std::string_view name, std::string* why) {
  for (const StoredDType& s : stored_dtype_table::kAll) {
    if (name == s.name) return &s;
  }
  if (why) {
    if (name == "U64") {
      *why = "unsupported dtype 'U64': lazytensor's widest integer is int64, which cannot hold "
             "every unsigned 64-bit value";
    } else if (name.substr(0, 2) == "F8" || name.substr(0, 2) == "F6" || name == "F4") {
      *why = "unsupported dtype '" + std::string(name) +
             "': lazytensor has no 8-bit or smaller floating-point dtype (convert the tensor "
             "to F16, BF16 or F32 before saving)";
    } else if (name == "C64") {
      *why = "unsupported dtype 'C64': lazytensor has no complex dtype";
    } else {
      std::string list;
      for (const StoredDType& s : stored_dtype_table::kAll) list += (list.empty() ? "" : ", ") + std::string(s.name);
      *why = "unknown dtype '" + std::string(name) + "' (expected one of " + list + ")";
    }
  }
  return nullptr;
}

LAZYTENSOR_INLINE const StoredDType& native_stored_dtype(DType d) {
  for (const StoredDType& s : stored_dtype_table::kAll) {
    if (s.native && s.holds == d) return s;
  }
  throw Error("no safetensors dtype for " + dtype_name(d));
}

LAZYTENSOR_INLINE float half_to_float(std::uint16_t h) {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  const std::uint32_t exp = (h >> 10) & 0x1Fu;
  std::uint32_t mant = h & 0x3FFu;
  std::uint32_t bits;
  if (exp == 0x1F) {
    bits = sign | 0x7F800000u | (mant << 13);  // infinity, or NaN with its payload
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (mant << 13);  // rebias 15 -> 127
  } else if (mant == 0) {
    bits = sign;
  } else {
    // Subnormal mant * 2^-24: normalise so the leading one becomes float's implicit bit.
    std::uint32_t e = 113;
    while (!(mant & 0x400u)) mant <<= 1, --e;
    bits = sign | (e << 23) | ((mant & 0x3FFu) << 13);
  }
  return std::bit_cast<float>(bits);
}

LAZYTENSOR_INLINE std::uint16_t float_to_half(float f) {
  std::uint32_t x = std::bit_cast<std::uint32_t>(f);
  const auto sign = static_cast<std::uint16_t>((x >> 16) & 0x8000u);
  x &= 0x7FFFFFFFu;
  if (x >= 0x7F800000u) {
    if (x == 0x7F800000u) return sign | 0x7C00u;
    const auto payload = static_cast<std::uint16_t>((x >> 13) & 0x3FFu);
    return sign | 0x7C00u | (payload ? payload : 0x200u);  // a NaN stays a NaN
  }
  if (x >= 0x477FF000u) return sign | 0x7C00u;  // >= 65520 rounds past 65504, the largest
  if (x >= 0x38800000u) {                        // normal in half: >= 2^-14
    std::uint32_t r = x - 0x38000000u;           // rebias 127 -> 15
    r += 0x0FFFu + ((r >> 13) & 1u);             // round to nearest even on the dropped 13 bits
    return sign | static_cast<std::uint16_t>(r >> 13);
  }
  if (x <= 0x33000000u) return sign;  // <= 2^-25: half the smallest subnormal ties to 0
  // Subnormal in half: the value in units of 2^-24, rounded to nearest even.
  const std::uint32_t exp = x >> 23;  // 102 .. 112 here
  const std::uint32_t m = (x & 0x7FFFFFu) | 0x800000u;
  const std::uint32_t shift = 126 - exp;  // value = m * 2^(exp - 150) = (m >> shift) * 2^-24
  std::uint32_t q = m >> shift;
  const std::uint32_t rem = m & ((1u << shift) - 1), halfway = 1u << (shift - 1);
  if (rem > halfway || (rem == halfway && (q & 1u))) ++q;
  return sign | static_cast<std::uint16_t>(q);
}

namespace stored_dtype_impl {
template <class From, class To>
void convert(const void* src, void* dst, std::size_t n) {
  const auto* s = static_cast<const unsigned char*>(src);
  auto* d = static_cast<unsigned char*>(dst);
  for (std::size_t i = 0; i < n; ++i) {
    From v;
    std::memcpy(&v, s + i * sizeof(From), sizeof(From));
    const To w = static_cast<To>(v);
    std::memcpy(d + i * sizeof(To), &w, sizeof(To));
  }
}

template <class Stored, class Held>
std::size_t first_out_of_range(const void* src, std::size_t n, std::string* value) {
  const auto* s = static_cast<const unsigned char*>(src);
  for (std::size_t i = 0; i < n; ++i) {
    Held v;
    std::memcpy(&v, s + i * sizeof(Held), sizeof(Held));
    if (v < static_cast<Held>(std::numeric_limits<Stored>::min()) ||
        v > static_cast<Held>(std::numeric_limits<Stored>::max())) {
      if (value) *value = std::to_string(v);
      return i;
    }
  }
  return n;
}
}  // namespace stored_dtype_impl

LAZYTENSOR_INLINE void widen(const StoredDType& s, const void* src, void* dst, std::size_t n) {
  using namespace stored_dtype_impl;
  using K = StoredDType::Kind;
  switch (s.kind) {
    case K::U8: return convert<std::uint8_t, std::int32_t>(src, dst, n);
    case K::I8: return convert<std::int8_t, std::int32_t>(src, dst, n);
    case K::I16: return convert<std::int16_t, std::int32_t>(src, dst, n);
    case K::U16: return convert<std::uint16_t, std::int32_t>(src, dst, n);
    case K::U32: return convert<std::uint32_t, std::int64_t>(src, dst, n);
    case K::F16: {
      const auto* p = static_cast<const unsigned char*>(src);
      auto* d = static_cast<float*>(dst);
      for (std::size_t i = 0; i < n; ++i) d[i] = half_to_float(static_cast<std::uint16_t>(p[2 * i] | (p[2 * i + 1] << 8)));
      return;
    }
    default: std::memcpy(dst, src, n * s.size); return;
  }
}

LAZYTENSOR_INLINE void narrow(const StoredDType& s, const void* src, void* dst, std::size_t n) {
  using namespace stored_dtype_impl;
  using K = StoredDType::Kind;
  switch (s.kind) {
    case K::U8: return convert<std::int32_t, std::uint8_t>(src, dst, n);
    case K::I8: return convert<std::int32_t, std::int8_t>(src, dst, n);
    case K::I16: return convert<std::int32_t, std::int16_t>(src, dst, n);
    case K::U16: return convert<std::int32_t, std::uint16_t>(src, dst, n);
    case K::U32: return convert<std::int64_t, std::uint32_t>(src, dst, n);
    case K::F16: {
      const auto* p = static_cast<const float*>(src);
      auto* d = static_cast<unsigned char*>(dst);
      for (std::size_t i = 0; i < n; ++i) {
        const std::uint16_t h = float_to_half(p[i]);
        d[2 * i] = static_cast<unsigned char>(h), d[2 * i + 1] = static_cast<unsigned char>(h >> 8);
      }
      return;
    }
    default: std::memcpy(dst, src, n * s.size); return;
  }
}

LAZYTENSOR_INLINE std::size_t find_out_of_range(const StoredDType& s, const void* src,
                                                std::size_t n, std::string* value) {
  using namespace stored_dtype_impl;
  using K = StoredDType::Kind;
  switch (s.kind) {
    case K::U8: return first_out_of_range<std::uint8_t, std::int32_t>(src, n, value);
    case K::I8: return first_out_of_range<std::int8_t, std::int32_t>(src, n, value);
    case K::I16: return first_out_of_range<std::int16_t, std::int32_t>(src, n, value);
    case K::U16: return first_out_of_range<std::uint16_t, std::int32_t>(src, n, value);
    case K::U32: return first_out_of_range<std::uint32_t, std::int64_t>(src, n, value);
    default: return n;
  }
}

#endif  // LAZYTENSOR_HEADER_DEFINITIONS

}  // namespace lazy::io::detail
