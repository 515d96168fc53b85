#pragma once
// ConvertNode: a tensor converted between floating dtypes (bfloat16, float, double) by a
// run-time choice of dtypes. AnyTensor::to(dtype), and through it Module::to(dtype) and the
// precision plugins, convert tensors whose dtype a program only knows at run time; one small
// node class for the six conversions keeps every translation unit that merely includes them
// free of per-dtype kernels (typed code converts with cast<T>, which fuses). Values round as
// static_cast does (to nearest even; double to bfloat16 through float, as cast<bfloat16>).

#include <cstdint>
#include <string>
#include <type_traits>

#include <lazytensor/core/bfloat16.hpp>
#include <lazytensor/core/config.hpp>
#include <lazytensor/core/error.hpp>
#include <lazytensor/graph/device.hpp>
#include <lazytensor/graph/node.hpp>
#include <lazytensor/graph/parallel.hpp>

namespace lazy::graph {

/// `in` converted to the floating dtype `to` (the input's dtype must be floating too).
class ConvertNode final : public Node {
 public:
  ConvertNode(NodePtr in, DType to);

  std::string op_name() const override { return "convert"; }
  std::string describe() const override { return "convert(%0) -> " + dtype_name(dtype()); }
  std::optional<BlockRule> block_rule() const override { return aligned_block_rule(shape(), inputs()); }
  NodePtr with_inputs(NodeList inputs, Shape, Device*) const override {
    return std::make_shared<ConvertNode>(std::move(inputs[0]), dtype());
  }

 protected:
  LAZYTENSOR_INLINE void compute(ExecContext& ctx) override;
};

/// `in` (float) with every element rounded to the nearest bfloat16 value, still float: the
/// operands and results of products under autocast (AutocastGuard). A node of its own, so a
/// float program that never autocasts holds no bfloat16 kernel.
class RoundToBFloat16Node final : public Node {
 public:
  explicit RoundToBFloat16Node(NodePtr in);

  std::string op_name() const override { return "round_bf16"; }
  std::optional<BlockRule> block_rule() const override { return aligned_block_rule(shape(), inputs()); }
  NodePtr with_inputs(NodeList inputs, Shape, Device*) const override {
    return std::make_shared<RoundToBFloat16Node>(std::move(inputs[0]));
  }

 protected:
  LAZYTENSOR_INLINE void compute(ExecContext& ctx) override;
};

#if LAZYTENSOR_HEADER_DEFINITIONS
namespace detail {
// Elements [b, e) of src (dtype `from`) into dst (dtype `to`), both floating. Plain loops in
// one function: no per-dtype template to compile into every program that includes this.
inline void convert_elements(DType from, DType to, const void* src, void* dst, std::int64_t b, std::int64_t e) {
  auto load = [&](std::int64_t i) -> double {
    switch (from) {
      case DType::BFloat16: return static_cast<float>(static_cast<const bfloat16*>(src)[i]);
      case DType::Float32: return static_cast<const float*>(src)[i];
      default: return static_cast<const double*>(src)[i];
    }
  };
  switch (to) {
    case DType::BFloat16:  // through float, as cast<bfloat16> rounds a double
      for (std::int64_t i = b; i < e; ++i) static_cast<bfloat16*>(dst)[i] = bfloat16(static_cast<float>(load(i)));
      break;
    case DType::Float32:
      for (std::int64_t i = b; i < e; ++i) static_cast<float*>(dst)[i] = static_cast<float>(load(i));
      break;
    default:
      for (std::int64_t i = b; i < e; ++i) static_cast<double*>(dst)[i] = load(i);
      break;
  }
}
}  // namespace detail

LAZYTENSOR_INLINE ConvertNode::ConvertNode(NodePtr in, DType to)
    : Node(NodeKind::Copy, to, in->shape(), in->device(), {in}) {
  if (!is_floating(in->dtype()) || !is_floating(to)) {
    throw DTypeError("convert: converts between floating dtypes (bfloat16, float32, float64), got " +
                     dtype_name(in->dtype()) + " to " + dtype_name(to));
  }
}

LAZYTENSOR_INLINE void ConvertNode::compute(ExecContext& ctx) {
  const NodePtr& in = inputs()[0];
  auto buf = allocate_output(ctx, false);
  const void* src = in->buffer()->data();
  void* dst = buf->data();
  const DType from = in->dtype(), to = dtype();
  const std::int64_t n = numel();
  auto& pool = ctx.device.threads();
  const std::int64_t tasks = task_count(pool, n, 1.0);
  pool.parallel_for(tasks, [&](std::int64_t t) {
    auto [b, e] = task_range(n, tasks, t);
    detail::convert_elements(from, to, src, dst, b, e);
  });
  set_buffer(std::move(buf));
}
LAZYTENSOR_INLINE RoundToBFloat16Node::RoundToBFloat16Node(NodePtr in)
    : Node(NodeKind::Copy, DType::Float32, in->shape(), in->device(), {in}) {
  if (in->dtype() != DType::Float32) {
    throw DTypeError("round_bf16: expected a float32 tensor, got " + dtype_name(in->dtype()));
  }
}

LAZYTENSOR_INLINE void RoundToBFloat16Node::compute(ExecContext& ctx) {
  const float* src = inputs()[0]->data<float>();
  auto buf = allocate_output(ctx, true);  // in place when the input is not needed elsewhere
  float* dst = static_cast<float*>(buf->data());
  const std::int64_t n = numel();
  auto& pool = ctx.device.threads();
  const std::int64_t tasks = task_count(pool, n, 1.0);
  pool.parallel_for(tasks, [&](std::int64_t t) {
    auto [b, e] = task_range(n, tasks, t);
    for (std::int64_t i = b; i < e; ++i) dst[i] = static_cast<float>(bfloat16(src[i]));
  });
  set_buffer(std::move(buf));
}
#endif  // LAZYTENSOR_HEADER_DEFINITIONS

}  // namespace lazy::graph
