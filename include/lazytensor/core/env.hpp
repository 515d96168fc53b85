#pragma once
// Reading settings from the environment (LAZYTENSOR_*): a malformed value is an error
// naming the variable, never silently replaced by a default.

#include <cstdlib>
#include <optional>
#include <string>

#include <lazytensor/core/error.hpp>

namespace lazy::core {

/// The whole number in environment variable `name`, or nullopt when it is unset or empty.
/// Throws Error naming the variable, `what` it counts and an `example` when the value is
/// not a whole number >= `min`.
inline std::optional<long long> env_integer(const char* name, long long min, const char* what,
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

}  // namespace lazy::core
