#pragma once
// The operands of the SPMD partitioner's partition_* rules (spmd/partitioner.hpp): which
// sharded operand sets the blocks, each mesh position's pieces of every input (its own
// blocks, narrowed ones, small values traced again on each device, or split copies), the
// all-reduce of partial results among the positions that share a block, and the fallback
// that gathers everything and runs a node whole.

#include <functional>

#include <lazytensor/graph/shape_nodes.hpp>
#include <lazytensor/graph/submit.hpp>
#include <lazytensor/spmd/collective.hpp>
#include <lazytensor/spmd/sharded_node.hpp>

namespace lazy::spmd::detail {

/// Whether sharded operand `s` rather than `lead` (may be null) sets a result's blocks: the
/// larger one (moving the others costs less), and of two as large the one cut into more
/// blocks (a replicated operand is narrowed to any split on its devices, while a split one
/// would have to be gathered to become replicated, and the work would be repeated).
bool leads(const ShardedNode* s, const ShardedNode* lead);

/// Per mesh position, the pieces of `inputs` for blocks of `target` over a logical shape:
/// `logical_of[i][d]` is the logical dimension that cuts dimension d of input i (-1: whole).
/// An input already cut that way contributes its pieces; others are computed and split
/// (SpmdTransfers).
std::vector<graph::NodeList> pieces_for(const graph::NodeList& inputs,
                                                    const std::vector<std::vector<int>>& logical_of,
                                                    const Sharding& target, const Shape& logical);

/// A copy of small unsharded `value` on `dev` without computing it: materialized values
/// share their buffer, pending views and nodes with a block rule (a backward's seed
/// reshaped and scaled) are traced again on `dev` over copies of their inputs. Null when
/// something on the way has no such form or the value is large (then it is computed and
/// split, which waits for its device).
graph::NodePtr replicate_small(const graph::NodePtr& value, graph::Device& dev, int depth = 0);

/// All-reduces `shards` (one per mesh position) among the positions that differ only along
/// mesh axes `axes`, each group combining in the order of `rank_in_group(position)`.
void reduce_partials(graph::NodeList& shards, const Mesh& mesh, const std::vector<int>& axes,
                     const std::function<std::int64_t(int)>& rank_in_group, Combine op);

/// `node` run whole: every sharded input is gathered (materialized) first.
graph::NodePtr run_gathered(graph::NodePtr node);

}  // namespace lazy::spmd::detail

#if LAZYTENSOR_HEADER_DEFINITIONS
#include <algorithm>
#include <map>

namespace lazy::spmd::detail {

LAZYTENSOR_INLINE bool leads(const ShardedNode* s, const ShardedNode* lead) {
  if (!lead) return true;
  if (s->numel() != lead->numel()) return s->numel() > lead->numel();
  return s->sharding().blocks() > lead->sharding().blocks();
}

LAZYTENSOR_INLINE graph::NodePtr run_gathered(graph::NodePtr node) {
  for (const auto& in : node->inputs())
    if (in->kind() == graph::NodeKind::Sharded) graph::materialize(in);
  return graph::submit_unpartitioned(std::move(node));
}

LAZYTENSOR_INLINE std::vector<graph::NodeList> pieces_for(const graph::NodeList& ins,
                                                                         const std::vector<std::vector<int>>& logical_of,
                                                                         const Sharding& target, const Shape& logical) {
  const Mesh& mesh = target.mesh;
  const int n = mesh.size();
  std::vector<graph::NodeList> pieces(static_cast<std::size_t>(n));
  for (std::size_t i = 0; i < ins.size(); ++i) {
    const auto& in = ins[i];
    const ShardedNode* s = as_sharded(in);
    bool local = s && s->sharding().mesh == mesh;
    for (int d = 0; local && d < in->shape().rank(); ++d) {
      const int l = logical_of[i][static_cast<std::size_t>(d)];
      local = l >= 0 ? s->sharding().cuts(d) == target.cuts(l) : s->sharding().parts(d) == 1;
    }
    if (local) {
      for (int p = 0; p < n; ++p) pieces[static_cast<std::size_t>(p)].push_back(s->shard(p));
      continue;
    }
    if (s && s->sharding().mesh == mesh) {
      // Each position's piece may hold its target block (a replicated value, or a coarser
      // split): the block is then narrowed out of it on that device, moving no data.
      graph::NodeList cut;
      for (int p = 0; p < n; ++p) {
        const auto want = target.block(p, logical);
        const auto have = s->sharding().block(p, in->shape());
        graph::NodePtr piece = s->shard(p);
        for (int d = 0; piece && d < in->shape().rank(); ++d) {
          const int l = logical_of[i][static_cast<std::size_t>(d)];
          const auto [w0, w1] = l >= 0 ? want[static_cast<std::size_t>(l)] : std::pair<std::int64_t, std::int64_t>{0, in->shape()[d]};
          const auto [h0, h1] = have[static_cast<std::size_t>(d)];
          if (w0 < h0 || w1 > h1) piece = nullptr;
          else if (w0 != h0 || w1 != h1) {
            Shape narrowed = piece->shape();
            narrowed[d] = w1 - w0;
            piece = graph::submit_unpartitioned(
                std::make_shared<graph::SliceNode>("narrow", piece, d, w0 - h0, 1, std::move(narrowed)));
          }
        }
        if (!piece) break;
        cut.push_back(std::move(piece));
      }
      if (static_cast<int>(cut.size()) == n) {
        for (int p = 0; p < n; ++p) pieces[static_cast<std::size_t>(p)].push_back(std::move(cut[static_cast<std::size_t>(p)]));
        continue;
      }
    }
    if (!s && in->pending()) {
      // A small pending value every block reads whole: trace it again on each device.
      bool whole = true;
      for (int d = 0; whole && d < in->shape().rank(); ++d) {
        const int l = logical_of[i][static_cast<std::size_t>(d)];
        whole = l < 0 || target.parts(l) == 1;
      }
      graph::NodeList copies;
      for (int p = 0; whole && p < n; ++p) {
        auto c = replicate_small(in, mesh_device(mesh.device_ids()[static_cast<std::size_t>(p)]));
        if (!c) break;
        copies.push_back(std::move(c));
      }
      if (static_cast<int>(copies.size()) == n) {
        for (int p = 0; p < n; ++p) pieces[static_cast<std::size_t>(p)].push_back(std::move(copies[static_cast<std::size_t>(p)]));
        continue;
      }
    }
    static auto& transfers = core::counter("SpmdTransfers");
    transfers.add();
    graph::materialize(in);
    for (int p = 0; p < n; ++p) {
      const auto block = target.block(p, logical);
      Ranges ranges;
      for (int d = 0; d < in->shape().rank(); ++d) {
        const int l = logical_of[i][static_cast<std::size_t>(d)];
        ranges.push_back(l >= 0 ? block[static_cast<std::size_t>(l)] : std::pair<std::int64_t, std::int64_t>{0, in->shape()[d]});
      }
      pieces[static_cast<std::size_t>(p)].push_back(
          block_of(in, ranges, mesh_device(mesh.device_ids()[static_cast<std::size_t>(p)])));
    }
  }
  return pieces;
}

LAZYTENSOR_INLINE graph::NodePtr replicate_small(const graph::NodePtr& value, graph::Device& dev, int depth) {
  constexpr std::int64_t kMaxElements = 4096;
  constexpr int kMaxDepth = 8;
  if (value->materialized()) {
    Ranges whole;
    for (auto d : value->shape()) whole.emplace_back(0, d);
    return block_of(value, whole, dev);
  }
  if (!value->pending() || depth > kMaxDepth || value->numel() > kMaxElements) return nullptr;
  graph::NodeList inputs;
  for (const auto& in : value->inputs()) {
    if (in->kind() == graph::NodeKind::Sharded) return nullptr;
    auto c = replicate_small(in, dev, depth + 1);
    if (!c) return nullptr;
    inputs.push_back(std::move(c));
  }
  if (auto* view = dynamic_cast<const graph::ViewNode*>(value.get()))
    return graph::submit_unpartitioned(std::make_shared<graph::ViewNode>(view->op_name(), inputs[0], view->shape()));
  if (!value->block_rule()) return nullptr;
  auto copy = value->with_inputs(std::move(inputs), value->shape(), &dev);
  return copy ? graph::submit_unpartitioned(std::move(copy)) : nullptr;
}

LAZYTENSOR_INLINE void reduce_partials(graph::NodeList& shards, const Mesh& mesh, const std::vector<int>& axes,
                                       const std::function<std::int64_t(int)>& rank_in_group, Combine op) {
  std::map<std::vector<std::int64_t>, std::vector<int>> groups;
  for (int p = 0; p < mesh.size(); ++p) {
    auto key = mesh.coordinates(p);
    for (int a : axes) key[static_cast<std::size_t>(a)] = 0;
    groups[key].push_back(p);
  }
  for (auto& [key, members] : groups) {
    std::sort(members.begin(), members.end(), [&](int x, int y) { return rank_in_group(x) < rank_in_group(y); });
    graph::NodeList in;
    for (int p : members) in.push_back(shards[static_cast<std::size_t>(p)]);
    auto out = all_reduce(in, op);
    for (std::size_t i = 0; i < members.size(); ++i) shards[static_cast<std::size_t>(members[i])] = std::move(out[i]);
  }
}

}  // namespace lazy::spmd::detail
#endif  // LAZYTENSOR_HEADER_DEFINITIONS
