#pragma once
// The text form of the numbers a checkpoint's state holds (callbacks' scores and counters,
// the Trainer's random state): doubles that read back bit for bit, and parsers that name
// what they were reading when the text is not a number.

#include <charconv>
#include <cstdint>
#include <cstdio>
#include <string>
#include <system_error>

#include <lazytensor/core/config.hpp>
#include <lazytensor/core/error.hpp>

namespace lazy::train::detail {

/// Text of a double that reads back as the same double.
std::string double_text(double x);
/// The double `text` holds (Error naming `what` otherwise).
double parse_double(const std::string& text, const std::string& what);
/// The integer `text` holds (Error naming `what` otherwise).
std::int64_t parse_int(const std::string& text, const std::string& what);
/// The unsigned 64-bit integer `text` holds (Error naming `what` otherwise).
std::uint64_t parse_uint64(const std::string& text, const std::string& what);

#if LAZYTENSOR_HEADER_DEFINITIONS

LAZYTENSOR_INLINE std::string double_text(double x) {
  char buf[32];
  const auto r = std::to_chars(buf, buf + sizeof buf, x);
  return std::string(buf, r.ptr);
}

LAZYTENSOR_INLINE double parse_double(const std::string& text, const std::string& what) {
  double v = 0;
  const auto r = std::from_chars(text.data(), text.data() + text.size(), v);
  if (r.ec != std::errc() || r.ptr != text.data() + text.size())
    throw Error(what + ": expected a number, found \"" + text + "\"");
  return v;
}

/// The integer of type T that `text` holds.
template <class T>
T parse_integer(const std::string& text, const std::string& what) {
  T v = 0;
  const auto r = std::from_chars(text.data(), text.data() + text.size(), v);
  if (r.ec != std::errc() || r.ptr != text.data() + text.size())
    throw Error(what + ": expected an integer, found \"" + text + "\"");
  return v;
}

LAZYTENSOR_INLINE std::int64_t parse_int(const std::string& text, const std::string& what) {
  return parse_integer<std::int64_t>(text, what);
}

LAZYTENSOR_INLINE std::uint64_t parse_uint64(const std::string& text, const std::string& what) {
  return parse_integer<std::uint64_t>(text, what);
}

/// Shortest text of `x` ("0.01", not "0.010000").
inline std::string short_double(double x) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", x);
  return buf;
}

#endif  // LAZYTENSOR_HEADER_DEFINITIONS

}  // namespace lazy::train::detail
