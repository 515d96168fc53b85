#pragma once
// optimizer_step: data-parallel training's gradient averaging, as torch_xla's
// xm.optimizer_step / xm.reduce_gradients.
//
// Gradients are all-reduced in coalesced buckets: consecutive gradients (in parameter
// order) share one exchange until the next one would push the bucket past
// gradient_bucket_bytes() (default 16 MiB; a larger gradient gets a bucket of its own).
// On the threads backend a bucket costs one round of its group whatever it holds (the
// tensors are read in place, nothing is concatenated), so fewer rounds are better; the cap
// bounds what a message-passing backend has to stage. Buckets change which round an
// element travels in, never its value: each element is reduced in group order, so the
// result does not depend on the bucket size.

#include <atomic>
#include <cstddef>
#include <string>
#include <unordered_set>
#include <vector>

#include <lazytensor/core/config.hpp>
#include <lazytensor/tensor/device.hpp>
#include <lazytensor/dist/collectives.hpp>
#include <lazytensor/optim/optimizer.hpp>

namespace lazy::dist {

namespace detail {
inline std::atomic<std::size_t>& bucket_bytes_setting() {
  static std::atomic<std::size_t> bytes{std::size_t{16} << 20};
  return bytes;
}
}  // namespace detail

/// The most gradient bytes optimizer_step puts in one all_reduce (default 16 MiB).
inline std::size_t gradient_bucket_bytes() {
  return detail::bucket_bytes_setting().load(std::memory_order_relaxed);
}

/// Sets the bucket size of optimizer_step for the whole process (every replica must use the
/// same buckets; set it before spawn). Error when `bytes` is 0.
void set_gradient_bucket_bytes(std::size_t bytes);

namespace detail {
/// Ascending indices as "0-3, 5, 7-8".
std::string ranges(const std::vector<std::size_t>& v);
}  // namespace detail

/// All-reduces the gradient of every parameter of `optimizer` that has one to the mean over
/// this replica's group (sum times 1 / group size), in place (each parameter's .grad() then
/// holds the mean), in coalesced buckets (see the file comment), as xm.reduce_gradients.
/// Nothing is exchanged in a group of one. Lazy: the exchanges run at the next mark_step.
/// (A template only so that programs that never call it compile no exchange of any dtype.)
template <class = void>
void reduce_gradients(optim::Optimizer& optimizer, const Groups& groups = {});

/// One data-parallel optimizer step, as xm.optimizer_step(optimizer, barrier, groups):
/// reduce_gradients (the mean of every gradient over this replica's group, in coalesced
/// buckets), then `optimizer.step()`.
///
/// **It does not run anything unless `barrier` is true.** Like everything else in a step,
/// the all-reduces and the update are traced lazily and execute at the next mark_step,
/// which the training loop usually gets from MpDeviceLoader (it calls mark_step as it hands
/// out batches). `barrier = true` calls lazy::mark_step() right after the update, which is
/// what a loop that does not iterate an MpDeviceLoader needs (PyTorch/XLA users were often
/// surprised that `barrier` means "sync the step", not "wait for the other replicas").
/// Every replica of a group must call it with the same parameters having gradients (in the
/// same order and shapes), or the exchange raises CollectiveMismatch.
template <class = void>
void optimizer_step(optim::Optimizer& optimizer, bool barrier = false, const Groups& groups = {});

}  // namespace lazy::dist

#if LAZYTENSOR_HEADER_DEFINITIONS
namespace lazy::dist {
LAZYTENSOR_INLINE std::string detail::ranges(const std::vector<std::size_t>& v) {
  std::string s;
  for (std::size_t i = 0; i < v.size();) {
    std::size_t j = i;
    while (j + 1 < v.size() && v[j + 1] == v[j] + 1) ++j;
    if (!s.empty()) s += ", ";
    s += std::to_string(v[i]);
    if (j > i) {
      s += '-';
      s += std::to_string(v[j]);
    }
    i = j + 1;
  }
  return s;
}

LAZYTENSOR_INLINE void set_gradient_bucket_bytes(std::size_t bytes) {
  if (bytes == 0) throw Error("set_gradient_bucket_bytes: the bucket size must be > 0 bytes");
  detail::bucket_bytes_setting().store(bytes, std::memory_order_relaxed);
}
}  // namespace lazy::dist
#endif  // LAZYTENSOR_HEADER_DEFINITIONS

namespace lazy::dist {
// (Templates: outside the HEADER_DEFINITIONS block, instantiated once in lazytensor::compiled.)
template <class>
void reduce_gradients(optim::Optimizer& optimizer, const Groups& groups) {
  const auto group = detail::group_of(groups, "optimizer_step");
  if (group->size() == 1) return;
  const AllReduceOptions opts{.scale = 1.0 / static_cast<double>(group->size()), .groups = groups};
  const std::size_t cap = gradient_bucket_bytes();
  std::unordered_set<const graph::TensorImpl*> seen;  // a parameter listed twice is reduced once
  // One bucket per dtype (a module converted with to(dtype) has bfloat16 or double
  // gradients); every replica fills and flushes them in the same order.
  struct Buckets {
    std::vector<Tensor<float>> f32;
    std::vector<Tensor<double>> f64;
    std::vector<Tensor<bfloat16>> bf16;
    std::size_t bytes[3] = {0, 0, 0};
    std::vector<std::size_t> params[3];  // which parameters' gradients (their optimizer index)
  } b;
  // The parameters' indices join the bucket's signature: replicas that have gradients for
  // different parameters (a branch taken on one only) would otherwise sum one parameter's
  // gradient into another's of the same shape without a word.
  auto flush = [&](auto& bucket, int k) {
    if (!bucket.empty())
      detail::all_reduce_tagged_(ReduceOp::Sum, bucket, opts,
                                 "gradients of parameters " + detail::ranges(b.params[k]));
    bucket.clear();
    b.bytes[k] = 0;
    b.params[k].clear();
  };
  auto add = [&](auto& bucket, int k, auto grad, std::size_t index) {
    const std::size_t nbytes = static_cast<std::size_t>(grad.numel()) * sizeof(typename decltype(grad)::value_type);
    if (!bucket.empty() && b.bytes[k] + nbytes > cap) flush(bucket, k);
    bucket.push_back(std::move(grad));
    b.bytes[k] += nbytes;
    b.params[k].push_back(index);
  };
  std::size_t index = 0;
  for (std::size_t g = 0; g < optimizer.num_param_groups(); ++g) {
    for (const auto& p : optimizer.params(g)) {
      const std::size_t i = index++;
      const AnyTensor grad = p.grad();  // shares the gradient object: all_reduce_ rebinds it
      if (!grad.defined() || !seen.insert(p.impl().get()).second) continue;
      switch (grad.dtype()) {
        case DType::Float64:
          add(b.f64, 1, grad.as<double>(), i);
          break;
        case DType::BFloat16:
          add(b.bf16, 2, grad.as<bfloat16>(), i);
          break;
        default:
          add(b.f32, 0, grad.as<float>(), i);
          break;
      }
    }
  }
  flush(b.f32, 0);
  flush(b.f64, 1);
  flush(b.bf16, 2);
}

template <class>
void optimizer_step(optim::Optimizer& optimizer, bool barrier, const Groups& groups) {
  reduce_gradients(optimizer, groups);
  optimizer.step();
  if (barrier) mark_step();
}
}  // namespace lazy::dist

#define LAZYTENSOR_DIST_OPTIMIZER_STEP_INSTANCES(P)                                                              \
  P template void lazy::dist::reduce_gradients<void>(lazy::optim::Optimizer&, const lazy::dist::Groups&);        \
  P template void lazy::dist::optimizer_step<void>(lazy::optim::Optimizer&, bool, const lazy::dist::Groups&);
#if LAZYTENSOR_EXPLICIT_INSTANTIATION
LAZYTENSOR_DIST_OPTIMIZER_STEP_INSTANCES(extern)
#endif
