#pragma once
// Reading settings from the environment (LAZYTENSOR_*): a malformed value is an error
// naming the variable, never silently replaced by a default.

#include <cstdlib>
#include <optional>
#include <string>

#include <lazytensor/core/error.hpp>
#include <lazytensor/core/config.hpp>

namespace lazy::core {

/// The whole number in environment variable `name`, or nullopt when it is unset or empty.
/// Throws Error naming the variable, `what` it counts and an `example` when the value is
/// not a whole number >= `min`.
std::optional<long long> env_integer(const char* name, long long min, const char* what,
                                            const char* example);

/// The on/off switch in environment variable `name`: true for 1/on/true, false for
/// 0/off/false, nullopt when unset or empty. Throws Error naming the variable otherwise.
std::optional<bool> env_switch(const char* name);

}  // namespace lazy::core

#if LAZYTENSOR_HEADER_DEFINITIONS
namespace lazy::core {

LAZYTENSOR_INLINE std::optional<long long> env_integer(const char* name,
    long long min,
    const char* what,
    const char* example) {
  const char* env = std::getenv(name);
  if (!env || !*env) return std::nullopt;
  char* end = nullptr;
  const long long v = std::strtoll(env, &end, 10);
  if (end == env || *end != '\0' || v < min) {
    throw Error(std::string(name) + "='" + env + "' is not a number of " + what +
                " >= " + std::to_string(min) + " (expected e.g. " + example + ")");
  }
  return v;
}

LAZYTENSOR_INLINE std::optional<bool> env_switch(const char* name) {
  const char* env = std::getenv(name);
  if (!env || !*env) return std::nullopt;
  const std::string v = env;
  if (v == "1" || v == "on" || v == "true") return true;
  if (v == "0" || v == "off" || v == "false") return false;
  throw Error(std::string(name) + "='" + v +
              "' is not an on/off switch (expected 1, on, true, 0, off or false)");
}

}  // namespace lazy::core
#endif  // LAZYTENSOR_HEADER_DEFINITIONS
