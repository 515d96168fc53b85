#pragma once
// LAZY_ARG: the option accessors of libtorch's TORCH_ARG, shared by the options structs of
// lazy::optim (SGDOptions, ...) and lazy::nn (Conv2dOptions, ...).

/// Declares an option with a fluent setter and a getter, as libtorch's TORCH_ARG:
/// `SGDOptions(0.1).momentum(0.9)`; `opts.momentum()`. Leaves the access at `private`.
#define LAZY_ARG(T, name)                   \
 public:                                    \
  auto& name(const T& v) {                  \
    name##_ = v;                            \
    return *this;                           \
  }                                         \
  const T& name() const { return name##_; } \
                                            \
 private:                                   \
  T name##_
