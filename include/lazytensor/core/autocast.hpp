#pragma once
// Mixed precision as torch.autocast: while an AutocastGuard is alive on a thread, the
// products of float tensors (matmul, linear, bmm, conv2d) run in bfloat16: their operands
// are rounded to bfloat16, the products accumulate in float, and the result is rounded to
// bfloat16 (and held in a float tensor, so the program's types do not change). Everything
// else keeps its inputs' dtype. Thread-local, as torch's: every replica thread sets its own.

#include <lazytensor/core/dtype.hpp>
#include <lazytensor/core/error.hpp>

namespace lazy {

namespace detail {
struct AutocastState {
  bool enabled = false;
  DType dtype = DType::BFloat16;
};
inline AutocastState& autocast_state() {
  thread_local AutocastState state;
  return state;
}
}  // namespace detail

/// True while an enabled AutocastGuard is alive on this thread.
inline bool is_autocast_enabled() { return detail::autocast_state().enabled; }
/// The dtype products run in under autocast (bfloat16).
inline DType get_autocast_dtype() { return detail::autocast_state().dtype; }

/// Turns autocast on (or, with `enabled` false, off) for this thread until destroyed;
/// guards nest. DTypeError for a dtype other than bfloat16 (the one lower precision CPUs
/// run products in).
class AutocastGuard {
 public:
  explicit AutocastGuard(bool enabled = true, DType dtype = DType::BFloat16) : saved_(detail::autocast_state()) {
    if (dtype != DType::BFloat16) {
      throw DTypeError("AutocastGuard: expected dtype bfloat16, got " + dtype_name(dtype));
    }
    detail::autocast_state() = {enabled, dtype};
  }
  ~AutocastGuard() { detail::autocast_state() = saved_; }
  AutocastGuard(const AutocastGuard&) = delete;
  AutocastGuard& operator=(const AutocastGuard&) = delete;

 private:
  detail::AutocastState saved_;
};

}  // namespace lazy
