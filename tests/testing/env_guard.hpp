#pragma once
// Sets an environment variable for one scope and restores its previous value (or its
// absence) when the scope ends, a failed assertion's early return included.

#include <cstdlib>
#include <optional>
#include <string>

namespace lazy_tests {

/// `name` = `value` until the guard goes out of scope.
class EnvGuard {
 public:
  EnvGuard(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) saved_ = old;
    ::setenv(name, value, 1);
  }
  ~EnvGuard() {
    if (saved_)
      ::setenv(name_.c_str(), saved_->c_str(), 1);
    else
      ::unsetenv(name_.c_str());
  }
  EnvGuard(const EnvGuard&) = delete;
  EnvGuard& operator=(const EnvGuard&) = delete;

 private:
  std::string name_;
  std::optional<std::string> saved_;
};

}  // namespace lazy_tests
