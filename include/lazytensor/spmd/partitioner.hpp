#pragma once
// The SPMD partitioner: graph::submit hands it every node that reads a sharded value, and
// it returns the node standing for the result. Element-wise kernels run shard-wise, one
// node per mesh device on that device's graph; operands sharded otherwise (or not at all)
// are split to the result's sharding first. Other ops read the gathered value and run
// whole on the tensor's device (a synchronous gather, counted as SpmdGathers).

#include <lazytensor/graph/elementwise_node.hpp>
#include <lazytensor/spmd/sharded_node.hpp>

namespace lazy::spmd::detail {

/// The partition hook (graph::PartitionHook).
graph::NodePtr partition(graph::NodePtr node);

/// An element-wise node run shard-wise, or null when no sharded operand can lead (every
/// sharded operand is broadcast along a split dimension).
graph::NodePtr partition_elementwise(const graph::ElementwiseNode& node);

/// `node` run whole: every sharded input is gathered (materialized) first.
graph::NodePtr run_gathered(graph::NodePtr node);

}  // namespace lazy::spmd::detail

#if LAZYTENSOR_HEADER_DEFINITIONS
#include <lazytensor/graph/submit.hpp>

namespace lazy::spmd::detail {

LAZYTENSOR_INLINE graph::NodePtr partition(graph::NodePtr node) {
  if (node->kind() == graph::NodeKind::Elementwise) {
    if (auto* ew = dynamic_cast<const graph::ElementwiseNode*>(node.get()))
      if (auto r = partition_elementwise(*ew)) return r;
  }
  return run_gathered(std::move(node));
}

LAZYTENSOR_INLINE graph::NodePtr run_gathered(graph::NodePtr node) {
  for (const auto& in : node->inputs())
    if (in->kind() == graph::NodeKind::Sharded) graph::materialize(in);
  return graph::submit_unpartitioned(std::move(node));
}

LAZYTENSOR_INLINE graph::NodePtr partition_elementwise(const graph::ElementwiseNode& node) {
  const Shape& out = node.shape();
  const int rank = out.rank();
  const auto& ins = node.inputs();
  // The lead: the largest sharded operand that is not broadcast along a split dimension
  // (moving the others costs less).
  const ShardedNode* lead = nullptr;
  for (const auto& in : ins) {
    const ShardedNode* s = as_sharded(in);
    if (!s) continue;
    const int off = rank - in->shape().rank();
    bool ok = true;
    for (int j = 0; j < in->shape().rank(); ++j)
      ok = ok && (s->sharding().parts(j) == 1 || in->shape()[j] == out[j + off]);
    if (ok && (!lead || in->numel() > lead->numel())) lead = s;
  }
  if (!lead) return nullptr;
  Sharding target{lead->sharding().mesh, std::vector<std::vector<int>>(static_cast<std::size_t>(rank))};
  {
    const int off = rank - lead->shape().rank();
    for (int j = 0; j < lead->shape().rank(); ++j)
      if (lead->shape()[j] == out[j + off])
        target.dims[static_cast<std::size_t>(j + off)] = lead->sharding().dims[static_cast<std::size_t>(j)];
  }
  const Mesh& mesh = target.mesh;
  const int n = mesh.size();
  std::vector<std::vector<graph::NodePtr>> pieces(static_cast<std::size_t>(n));
  for (const auto& in : ins) {
    const int off = rank - in->shape().rank();
    const ShardedNode* s = as_sharded(in);
    bool local = s && s->sharding().mesh == mesh;
    for (int j = 0; local && j < in->shape().rank(); ++j) {
      const auto& want = target.dims[static_cast<std::size_t>(j + off)];
      local = in->shape()[j] == out[j + off] ? s->sharding().dims[static_cast<std::size_t>(j)] == want
                                              : s->sharding().parts(j) == 1;
    }
    if (local) {
      for (int p = 0; p < n; ++p) pieces[static_cast<std::size_t>(p)].push_back(s->shard(p));
      continue;
    }
    // Split this operand to the target's blocks (size-1 broadcast dimensions stay whole).
    static auto& transfers = core::counter("SpmdTransfers");
    transfers.add();
    graph::materialize(in);
    for (int p = 0; p < n; ++p) {
      const auto block = target.block(p, out);
      Ranges ranges;
      for (int j = 0; j < in->shape().rank(); ++j)
        ranges.push_back(in->shape()[j] == out[j + off] ? block[static_cast<std::size_t>(j + off)]
                                                         : std::pair<std::int64_t, std::int64_t>{0, in->shape()[j]});
      pieces[static_cast<std::size_t>(p)].push_back(
          block_of(in, ranges, mesh_device(mesh.device_ids()[static_cast<std::size_t>(p)])));
    }
  }
  const Shape block = target.block_shape(out);
  std::vector<graph::NodePtr> shards;
  shards.reserve(static_cast<std::size_t>(n));
  for (int p = 0; p < n; ++p) {
    graph::Device& dev = mesh_device(mesh.device_ids()[static_cast<std::size_t>(p)]);
    shards.push_back(graph::submit_unpartitioned(node.with_inputs(block, &dev, std::move(pieces[static_cast<std::size_t>(p)]))));
  }
  return std::make_shared<ShardedNode>(std::move(target), std::move(shards), node.dtype(), out, node.device());
}

}  // namespace lazy::spmd::detail
#endif  // LAZYTENSOR_HEADER_DEFINITIONS
