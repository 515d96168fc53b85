#pragma once
// Tensor collectives, as torch_xla's xla_model: all_reduce, all_gather, reduce_scatter,
// all_to_all, broadcast. Each call is lazy: it adds a pending node to the replica's graph
// (and takes the group's next sequence number, in program order); the exchange runs at
// mark_step or when a result is read, in program order among the replica's collectives.
// Inside spawn, inputs must live on the replica's own device. Outside spawn the world is
// one replica and every collective is local.

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <lazytensor/core/block_cache.hpp>
#include <lazytensor/dist/collective_node.hpp>
#include <lazytensor/dist/exchanges.hpp>
#include <lazytensor/dist/reduce_op.hpp>
#include <lazytensor/dist/signature.hpp>
#include <lazytensor/tensor/tensor.hpp>

namespace lazy::dist {

/// Options of all_reduce: `scale` multiplies the result (e.g. 1/world_size for a mean),
/// `groups` splits the world into groups reducing separately (empty: one group).
struct AllReduceOptions {
  double scale = 1.0;
  Groups groups = {};
};

namespace detail {

template <Element T>
Signature tensor_signature(CollectiveKind kind, const Tensor<T>& t) {
  Signature sig;
  sig.kind = kind;
  sig.dtype = dtype_of<T>();
  sig.tensors = 1;
  sig.shape = t.shape();
  ShapesHash h;
  h.add(t.shape());
  sig.shapes_hash = h.value();
  return sig;
}

/// Submits exchange `ex` (built by make(call, after)) and returns its result nodes.
template <class Make>
graph::NodeList trace_nodes(CollectiveCall call, Make&& make,
                                        const std::vector<OutputSpec>& outs) {
  // Only exchanges that talk to other replicas are chained in program order.
  const graph::NodePtr after = call.comm ? pending_predecessor() : nullptr;
  std::shared_ptr<ExchangeNode> ex = make(std::move(call), after);
  return submit_exchange(ex, outs);
}

/// trace_nodes, its results wrapped as tensors.
template <Element T, class Make>
std::vector<Tensor<T>> trace(CollectiveCall call, Make&& make,
                             const std::vector<OutputSpec>& outs) {
  std::vector<Tensor<T>> res;
  for (auto& node : trace_nodes(std::move(call), std::forward<Make>(make), outs))
    res.emplace_back(std::move(node));
  return res;
}

/// The result nodes of an all_reduce of `tensors` (one exchange; see below). A non-empty
/// `tag` joins the signature: replicas whose tags differ raise CollectiveMismatch.
template <Element T>
graph::NodeList all_reduce_nodes(ReduceOp op, std::span<const Tensor<T>> tensors,
                                             const AllReduceOptions& opts, std::string tag = {}) {
  check_reduction<T>(op, opts.scale, "all_reduce");
  if (tensors.empty()) return {};
  graph::NodeList nodes;
  nodes.reserve(tensors.size() + 1);  // (+1: the exchange's program-order input)
  std::vector<OutputSpec> outs;
  outs.reserve(tensors.size());
  ShapesHash shapes;
  for (const auto& t : tensors) {
    nodes.push_back(t.node());
    shapes.add(t.shape());
    outs.push_back({dtype_of<T>(), t.shape()});
  }
  graph::Device& dev = collective_device(nodes, "all_reduce");
  Signature sig = tensor_signature(CollectiveKind::AllReduce, tensors.front());
  sig.op = op;
  sig.tensors = static_cast<int>(tensors.size());
  sig.shapes_hash = shapes.value();
  sig.scale = opts.scale;
  sig.tag = std::move(tag);
  return trace_nodes(
      capture(std::move(sig), group_of(opts.groups, "all_reduce")),
      [&](CollectiveCall c, const graph::NodePtr& after) {
        return core::make_cached<AllReduceExchange<T>>(std::move(c), std::move(nodes), after, &dev,
                                                      op, opts.scale);
      },
      outs);
}

}  // namespace detail

/// All-reduces several tensors in one exchange (coalesced; as xm.all_reduce on a list, but
/// returning new tensors: see all_reduce_ for the in-place form). Every replica of a group
/// gets the bitwise-identical element-wise reduction, combined in group order.
template <Element T>
std::vector<Tensor<T>> all_reduce(ReduceOp op, const std::vector<Tensor<T>>& tensors,
                                  const AllReduceOptions& opts = {}) {
  std::vector<Tensor<T>> res;
  for (auto& node : detail::all_reduce_nodes<T>(op, tensors, opts)) res.emplace_back(std::move(node));
  return res;
}

/// All-reduces one tensor (xm.all_reduce(reduce_type, t, scale, groups)); returns a new
/// tensor. Example: `all_reduce(lazy::ReduceOp::Sum, g, {.scale = 1.0 / world_size()})`.
template <Element T>
Tensor<T> all_reduce(ReduceOp op, const Tensor<T>& t, const AllReduceOptions& opts = {}) {
  return Tensor<T>(std::move(detail::all_reduce_nodes<T>(op, std::span(&t, 1), opts).front()));
}

namespace detail {
/// all_reduce_ of a list with a tag in its signature (see all_reduce_nodes).
template <Element T>
void all_reduce_tagged_(ReduceOp op, std::vector<Tensor<T>>& tensors, const AllReduceOptions& opts,
                        std::string tag) {
  auto res = all_reduce_nodes<T>(op, tensors, opts, std::move(tag));
  for (std::size_t i = 0; i < tensors.size(); ++i) tensors[i].impl()->node = std::move(res[i]);
}
}  // namespace detail

/// In-place all_reduce of a list (one exchange), as xm.all_reduce on a list: every tensor
/// object is rebound to its reduced value, so all handles sharing it see the result.
template <Element T>
void all_reduce_(ReduceOp op, std::vector<Tensor<T>>& tensors, const AllReduceOptions& opts = {}) {
  detail::all_reduce_tagged_(op, tensors, opts, {});
}

/// In-place all_reduce of one tensor.
template <Element T>
void all_reduce_(ReduceOp op, Tensor<T>& t, const AllReduceOptions& opts = {}) {
  t.impl()->node = all_reduce(op, t, opts).node();
}

/// Concatenates every group member's tensor along `dim`, in group order
/// (xm.all_gather(t, dim, groups)). A 0-dim tensor gathers into shape (group size,).
template <Element T>
Tensor<T> all_gather(const Tensor<T>& t, std::int64_t dim = 0, const Groups& groups = {}) {
  const int d = normalize_dim(dim, t.dim(), "all_gather");
  graph::Device& dev = detail::collective_device({t.node()}, "all_gather");
  auto group = detail::group_of(groups, "all_gather");
  const auto n = static_cast<std::int64_t>(group->size());
  Shape out = t.dim() == 0 ? Shape{n} : t.shape();
  if (t.dim() > 0) {
    out[d] *= n;  // <= 2^60 * replicas: no overflow; the bound is checked next
    out.check_size();
  }
  detail::Signature sig = detail::tensor_signature(detail::CollectiveKind::AllGather, t);
  sig.params[0] = d;
  auto call = detail::capture(std::move(sig), std::move(group));
  return detail::trace<T>(std::move(call),
                          [&](detail::CollectiveCall c, const graph::NodePtr& after) {
                            return core::make_cached<detail::AllGatherExchange>(
                                std::move(c), t.node(), after, &dev, d);
                          },
                          {{dtype_of<T>(), out}})
      .front();
}

/// Reduces every group member's tensor and gives member q shard q along `scatter_dim`
/// (xm.reduce_scatter(op, t, scale, scatter_dim, shard_count, groups)). `shard_count` must
/// equal the group size and divide the size of `scatter_dim`.
template <Element T>
Tensor<T> reduce_scatter(ReduceOp op, const Tensor<T>& t, double scale, std::int64_t scatter_dim,
                         std::int64_t shard_count, const Groups& groups = {}) {
  detail::check_reduction<T>(op, scale, "reduce_scatter");
  if (t.dim() == 0)
    throw ShapeError("reduce_scatter: a 0-dim tensor cannot be scattered (expected rank >= 1)");
  const int d = normalize_dim(scatter_dim, t.dim(), "reduce_scatter");
  graph::Device& dev = detail::collective_device({t.node()}, "reduce_scatter");
  auto group = detail::group_of(groups, "reduce_scatter");
  const auto n = static_cast<std::int64_t>(group->size());
  if (shard_count != n) {
    throw CollectiveError("reduce_scatter: shard_count " + std::to_string(shard_count) +
                          " must equal the group size " + std::to_string(n) + " (group " +
                          detail::list_str(*group) + ")");
  }
  if (t.size(d) % n != 0) {
    throw ShapeError("reduce_scatter: size " + std::to_string(t.size(d)) + " of scatter_dim " +
                     std::to_string(d) + " of a tensor of shape " + t.shape().str() +
                     " is not divisible by shard_count " + std::to_string(n));
  }
  Shape out = t.shape();
  out[d] /= n;
  detail::Signature sig = detail::tensor_signature(detail::CollectiveKind::ReduceScatter, t);
  sig.op = op;
  sig.scale = scale;
  sig.params[0] = d;
  sig.params[1] = shard_count;
  auto call = detail::capture(std::move(sig), std::move(group));
  return detail::trace<T>(std::move(call),
                          [&](detail::CollectiveCall c, const graph::NodePtr& after) {
                            return core::make_cached<detail::ReduceScatterExchange<T>>(
                                std::move(c), t.node(), after, &dev, op, scale, d);
                          },
                          {{dtype_of<T>(), out}})
      .front();
}

/// Splits the tensor in `split_count` chunks along `split_dimension`, sends chunk q to
/// group member q, and concatenates the chunks received along `concat_dimension` in group
/// order (xm.all_to_all). `split_count` must equal the group size and divide the size of
/// `split_dimension`.
template <Element T>
Tensor<T> all_to_all(const Tensor<T>& t, std::int64_t split_dimension,
                     std::int64_t concat_dimension, std::int64_t split_count,
                     const Groups& groups = {}) {
  if (t.dim() == 0)
    throw ShapeError("all_to_all: a 0-dim tensor cannot be split (expected rank >= 1)");
  const int sd = normalize_dim(split_dimension, t.dim(), "all_to_all");
  const int cd = normalize_dim(concat_dimension, t.dim(), "all_to_all");
  graph::Device& dev = detail::collective_device({t.node()}, "all_to_all");
  auto group = detail::group_of(groups, "all_to_all");
  const auto n = static_cast<std::int64_t>(group->size());
  if (split_count != n) {
    throw CollectiveError("all_to_all: split_count " + std::to_string(split_count) +
                          " must equal the group size " + std::to_string(n) + " (group " +
                          detail::list_str(*group) + ")");
  }
  if (t.size(sd) % n != 0) {
    throw ShapeError("all_to_all: size " + std::to_string(t.size(sd)) + " of split_dimension " +
                     std::to_string(sd) + " of a tensor of shape " + t.shape().str() +
                     " is not divisible by split_count " + std::to_string(n));
  }
  Shape out = t.shape();
  out[sd] /= n;
  out[cd] *= n;
  out.check_size();
  detail::Signature sig = detail::tensor_signature(detail::CollectiveKind::AllToAll, t);
  sig.params[0] = sd;
  sig.params[1] = cd;
  sig.params[2] = split_count;
  auto call = detail::capture(std::move(sig), std::move(group));
  return detail::trace<T>(std::move(call),
                          [&](detail::CollectiveCall c, const graph::NodePtr& after) {
                            return core::make_cached<detail::AllToAllExchange>(
                                std::move(c), t.node(), after, &dev, sd, cd);
                          },
                          {{dtype_of<T>(), out}})
      .front();
}

/// Every group member gets replica `src`'s value of `t` (xm.collective_broadcast). All
/// members pass a tensor of the same shape and dtype; `src` is a global ordinal in the
/// caller's group. The result shares the source's buffer (no copy).
template <Element T>
Tensor<T> broadcast(const Tensor<T>& t, int src = 0, const Groups& groups = {}) {
  graph::Device& dev = detail::collective_device({t.node()}, "broadcast");
  auto group = detail::group_of(groups, "broadcast");
  int src_rank = -1;
  for (std::size_t q = 0; q < group->size(); ++q) {
    if ((*group)[q] == src) src_rank = static_cast<int>(q);
  }
  if (src_rank < 0) {
    throw CollectiveError("broadcast: src " + std::to_string(src) + " is not in the group " +
                          detail::list_str(*group) + " of replica " +
                          std::to_string(detail::ordinal_now()));
  }
  detail::Signature sig = detail::tensor_signature(detail::CollectiveKind::Broadcast, t);
  sig.params[0] = src;
  auto call = detail::capture(std::move(sig), std::move(group));
  const int src_slot = call.comm ? call.slot_at(src_rank) : 0;
  return detail::trace<T>(std::move(call),
                          [&](detail::CollectiveCall c, const graph::NodePtr& after) {
                            return core::make_cached<detail::BroadcastExchange>(
                                std::move(c), t.node(), after, &dev, src_slot);
                          },
                          {{dtype_of<T>(), t.shape()}})
      .front();
}

}  // namespace lazy::dist
