#pragma once
// The SPMD partitioner: graph::submit hands it every node that reads a sharded value, and
// it returns the node standing for the result. Nodes with a block rule (element-wise,
// permutes, softmax, gather, one_hot, conversions, im2col/col2im, pooling) run block-wise,
// one node per mesh device on that device's graph; views keep their input's blocks when
// the elements stay in order; reductions, products (batched too) and sums over a batch (a
// convolution's weight gradient) run on blocks, and where the reduced, contracted or summed
// dimension is split, the partial results are all-reduced among the devices that share the
// rest of the block. Operands sharded otherwise (or not at all) are split to the chosen
// blocks first. Other ops read the gathered value and run whole on the tensor's device (a
// synchronous gather, counted as SpmdGathers).

#include <optional>

#include <lazytensor/graph/convert_node.hpp>
#include <lazytensor/graph/elementwise_node.hpp>
#include <lazytensor/graph/im2col.hpp>
#include <lazytensor/graph/matmul_node.hpp>
#include <lazytensor/graph/reduction_node.hpp>
#include <lazytensor/graph/transpose_hint.hpp>
#include <lazytensor/graph/shape_nodes.hpp>
#include <lazytensor/spmd/operand_pieces.hpp>
#include <lazytensor/spmd/sharded_node.hpp>
#include <lazytensor/graph/submit.hpp>

namespace lazy::spmd::detail {

/// The partition hook (graph::PartitionHook).
graph::NodePtr partition(graph::NodePtr node);

/// A node with a block rule run block-wise, or null when no sharded operand can lead (each
/// is split along a dimension the rule cannot split).
graph::NodePtr partition_blockwise(const graph::Node& node, const graph::BlockRule& rule);

/// A reduction run on blocks (partial results all-reduced where a reduced dimension is
/// split), or null when its operands do not allow it.
graph::NodePtr partition_reduction(const graph::Node& node, const graph::BlockReduction& r);

/// A product run on blocks: the batch, rows of A and columns of B stay split; a split
/// contracted dimension gives partial products, all-reduced.
graph::NodePtr partition_gemm(const graph::Node& node, const graph::BlockGemm& g);

/// A sum over a batch (graph::BlockBatchSum) run on the blocks of the batch, whose sums are
/// all-reduced; null unless an input is split along its batch only.
graph::NodePtr partition_batch_sum(const graph::Node& node, const graph::BlockBatchSum& bs);

/// A transpose of the last two dimensions, piece by piece; a piece that is itself a
/// pending transpose gives its source (as the unsharded op does), so a GEMM reads it
/// through. Null when the input is not sharded.
graph::NodePtr partition_transpose(const graph::TransposeNode& node);

/// A view of a sharded value run on each piece, or null when the view would mix blocks.
graph::NodePtr partition_view(const graph::ViewNode& node);

/// The [start, length) runs of row-major linear indices that block `ranges` of `shape`
/// covers, in order; false when there are more than `limit`.
bool block_runs(const Shape& shape, const Ranges& ranges, std::size_t limit,
                std::vector<std::pair<std::int64_t, std::int64_t>>& runs);

}  // namespace lazy::spmd::detail

#if LAZYTENSOR_HEADER_DEFINITIONS
#include <algorithm>

namespace lazy::spmd::detail {

LAZYTENSOR_INLINE graph::NodePtr partition(graph::NodePtr node) {
  if (auto* tr = dynamic_cast<const graph::TransposeNode*>(node.get())) {
    if (auto r = partition_transpose(*tr)) return r;
  }
  if (auto* view = dynamic_cast<const graph::ViewNode*>(node.get())) {
    if (auto r = partition_view(*view)) return r;
  } else if (auto* red = dynamic_cast<const graph::BlockReduction*>(node.get())) {
    if (auto r = partition_reduction(*node, *red)) return r;
  } else if (auto* gemm = dynamic_cast<const graph::BlockGemm*>(node.get())) {
    if (auto r = partition_gemm(*node, *gemm)) return r;
  } else if (auto* bsum = dynamic_cast<const graph::BlockBatchSum*>(node.get())) {
    if (auto r = partition_batch_sum(*node, *bsum)) return r;
  } else if (auto rule = node->block_rule()) {
    if (auto r = partition_blockwise(*node, *rule)) return r;
  }
  return run_gathered(std::move(node));
}

LAZYTENSOR_INLINE graph::NodePtr partition_blockwise(const graph::Node& node, const graph::BlockRule& rule) {
  const Shape& out = node.shape();
  const int rank = out.rank();
  const auto& ins = node.inputs();
  // The output dimension that cuts input dimension d of input i the same way, or -1.
  auto cut_by = [&](std::size_t i, int d) {
    for (int o = 0; o < rank; ++o)
      if (rule.splittable[static_cast<std::size_t>(o)] && rule.input_dim[i][static_cast<std::size_t>(o)] == d) return o;
    return -1;
  };
  // The lead: the largest sharded operand whose split dimensions the rule can cut (moving
  // the others costs less). The result takes its blocks.
  const ShardedNode* lead = nullptr;
  std::optional<Sharding> lead_blocks;  // no placeholder mesh built on every call
  for (std::size_t i = 0; i < ins.size(); ++i) {
    const ShardedNode* s = as_sharded(ins[i]);
    if (!s || !leads(s, lead)) continue;
    Sharding t{s->sharding().mesh, std::vector<std::vector<int>>(static_cast<std::size_t>(rank))};
    bool ok = true;
    for (int d = 0; ok && d < s->shape().rank(); ++d) {
      const int o = cut_by(i, d);
      if (o >= 0) t.dims[static_cast<std::size_t>(o)] = s->sharding().dims[static_cast<std::size_t>(d)];
      else ok = s->sharding().parts(d) == 1;
    }
    if (!ok) continue;
    lead = s;
    lead_blocks = std::move(t);
  }
  if (!lead) return nullptr;
  Sharding target = std::move(*lead_blocks);
  const Mesh& mesh = target.mesh;
  const int n = mesh.size();
  std::vector<std::vector<int>> logical_of;
  for (std::size_t i = 0; i < ins.size(); ++i) {
    std::vector<int> map;
    for (int d = 0; d < ins[i]->shape().rank(); ++d) map.push_back(cut_by(i, d));
    logical_of.push_back(std::move(map));
  }
  auto pieces = pieces_for(ins, logical_of, target, out);
  const Shape block = target.block_shape(out);
  graph::NodeList shards;
  shards.reserve(static_cast<std::size_t>(n));
  for (int p = 0; p < n; ++p) {
    graph::Device& dev = mesh_device(mesh.device_ids()[static_cast<std::size_t>(p)]);
    auto piece = node.with_inputs(std::move(pieces[static_cast<std::size_t>(p)]), block, &dev);
    if (!piece) return nullptr;
    shards.push_back(graph::submit_unpartitioned(std::move(piece)));
  }
  return std::make_shared<ShardedNode>(std::move(target), std::move(shards), node.dtype(), out, node.device());
}

// How partial results of a named reduction combine (false: they cannot).
inline bool combine_of(const char* name, Combine& op) {
  const std::string n = name;
  if (n == "sum") op = Combine::Sum;
  else if (n == "prod") op = Combine::Prod;
  else if (n == "max" || n == "any") op = Combine::Max;
  else if (n == "min" || n == "all") op = Combine::Min;
  else return false;
  return true;
}
// Mesh axes used by dimensions [d0, d1) of a sharding.
inline std::vector<int> axes_of(const Sharding& s, int d0, int d1) {
  std::vector<int> axes;
  for (int d = d0; d < d1; ++d)
    for (int a : s.dims[static_cast<std::size_t>(d)]) axes.push_back(a);
  return axes;
}

LAZYTENSOR_INLINE graph::NodePtr partition_reduction(const graph::Node& node, const graph::BlockReduction& r) {
  const Shape& child = r.child_shape();
  const graph::ReduceGeometry g = r.geometry();
  const int rank = child.rank();
  // The reduced dimensions [a, b) of the child: outer = prod(child[0, a)), extent = prod(child[a, b)).
  int a = 0, b = 0;
  std::int64_t prefix = 1;
  while (a < rank && prefix < g.outer) prefix *= child[a++];
  if (prefix != g.outer) return nullptr;
  b = a;
  std::int64_t extent = 1;
  while (b < rank && extent < g.extent) extent *= child[b++];
  if (extent != g.extent) return nullptr;
  Combine op = Combine::Sum;
  const bool combines = combine_of(r.reduce_name(), op);  // argmax/argmin: blocks of whole rows only
  const auto& ins = node.inputs();
  // Inputs are of the child's shape or single elements (read whole).
  const ShardedNode* lead = nullptr;
  std::vector<std::vector<int>> logical_of;
  for (const auto& in : ins) {
    std::vector<int> map(static_cast<std::size_t>(in->shape().rank()), -1);
    if (in->shape() == child) {
      for (int d = 0; d < rank; ++d) map[static_cast<std::size_t>(d)] = d;
      if (const ShardedNode* s = as_sharded(in); s && leads(s, lead)) lead = s;
    } else if (in->numel() != 1) {
      return nullptr;
    }
    logical_of.push_back(std::move(map));
  }
  if (!lead) return nullptr;
  Sharding target = lead->sharding();
  const Shape& out = node.shape();
  // Output dimension of each kept child dimension.
  std::vector<std::vector<int>> out_dims(static_cast<std::size_t>(out.rank()));
  if (out.rank() == rank) {  // keepdim
    for (int d = 0; d < rank; ++d)
      if (d < a || d >= b) out_dims[static_cast<std::size_t>(d)] = target.dims[static_cast<std::size_t>(d)];
  } else if (out.rank() == rank - (b - a)) {
    for (int d = 0; d < a; ++d) out_dims[static_cast<std::size_t>(d)] = target.dims[static_cast<std::size_t>(d)];
    for (int d = b; d < rank; ++d) out_dims[static_cast<std::size_t>(d - (b - a))] = target.dims[static_cast<std::size_t>(d)];
  } else {
    return nullptr;
  }
  for (int d = a; !combines && d < b; ++d)
    if (target.parts(d) > 1) return nullptr;  // blocks of whole rows only
  auto pieces = pieces_for(ins, logical_of, target, child);
  const Shape child_block = target.block_shape(child);
  graph::ReduceGeometry local;
  local.outer = local.extent = local.inner = 1;
  for (int d = 0; d < rank; ++d) (d < a ? local.outer : d < b ? local.extent : local.inner) *= child_block[d];
  Sharding result{target.mesh, std::move(out_dims)};
  const Shape out_block = result.block_shape(out);
  const Mesh& mesh = target.mesh;
  graph::NodeList shards;
  for (int p = 0; p < mesh.size(); ++p) {
    graph::Device& dev = mesh_device(mesh.device_ids()[static_cast<std::size_t>(p)]);
    shards.push_back(graph::submit_unpartitioned(
        r.with_block(std::move(pieces[static_cast<std::size_t>(p)]), out_block, local, child_block, &dev)));
  }
  const auto axes = axes_of(target, a, b);
  if (!axes.empty()) {
    // Partial results, combined in the order of their blocks along the reduced dimensions.
    reduce_partials(shards, mesh, axes, [&](int p) {
      std::int64_t idx = 0;
      for (int d = a; d < b; ++d) idx = idx * target.parts(d) + target.part_of(p, d);
      return idx;
    }, op);
  }
  return std::make_shared<ShardedNode>(std::move(result), std::move(shards), node.dtype(), out, node.device());
}

LAZYTENSOR_INLINE graph::NodePtr partition_gemm(const graph::Node& node, const graph::BlockGemm& gm) {
  const auto& ins = node.inputs();
  const Shape& out = node.shape();
  const std::int64_t m = gm.rows(), k = gm.depth(), n = gm.cols();
  const std::int64_t ba = gm.batch_a(), bb = gm.batch_b(), batch = std::max(ba, bb);
  // Operands are matrices or batches of them ([b, ., .], b = 1 broadcasting); the result is
  // [batch, m, n], or [m, n] with leading size-1 dimensions (the backward's [1, m, k]).
  const bool ta = gm.a_transposed(), tb = gm.b_transposed();
  const int rank = out.rank();
  // A 3-D left operand of a single product has its batch folded into the rows (x [b, r, k]
  // times W [k, n]): its dimension 0 then acts as the batch, with r rows each.
  const Shape& sa = ins[0]->shape();
  const bool folded = batch == 1 && !ta && sa.rank() == 3 && sa[0] * sa[1] == m && ins[1]->shape().rank() == 2 &&
                      rank == 3 && out[0] == sa[0] && out[1] == sa[1];
  if (!folded) {
    auto operand_ok = [](const graph::NodePtr& in, std::int64_t b) {
      const int r = in->shape().rank();
      return r == 2 ? b == 1 : r == 3 && in->shape()[0] == b;
    };
    bool fits = operand_ok(ins[0], ba) && operand_ok(ins[1], bb) && rank >= 2 && out[rank - 2] == m &&
                out[rank - 1] == n;
    if (batch > 1) fits = fits && rank == 3 && out[0] == batch;
    else for (int d = 0; fits && d + 2 < rank; ++d) fits = out[d] == 1;
    if (!fits) return nullptr;
  }
  // Logical dimensions: 0 = batch, 1 = m (rows per batch when folded), 2 = k, 3 = n; each
  // operand's stored dimensions map onto them (a broadcast batch of 1 onto none: every
  // block reads it whole).
  auto dims_of = [](const graph::NodePtr& in, std::int64_t b, std::vector<int> matrix) {
    if (in->shape().rank() == 3) matrix.insert(matrix.begin(), b > 1 ? 0 : -1);
    return matrix;
  };
  const std::vector<std::vector<int>> logical_of = {
      folded ? std::vector<int>{0, 1, 2} : dims_of(ins[0], ba, ta ? std::vector<int>{2, 1} : std::vector<int>{1, 2}),
      dims_of(ins[1], bb, tb ? std::vector<int>{3, 2} : std::vector<int>{2, 3})};
  const Shape logical = folded ? Shape{sa[0], sa[1], k, n} : Shape{batch, m, k, n};
  // The blocks: the larger sharded operand's split dimensions first, then the other's where
  // they use mesh axes not taken yet.
  std::vector<std::size_t> order = {0, 1};
  if (ins[1]->numel() > ins[0]->numel()) std::swap(order[0], order[1]);
  const Mesh* mesh = nullptr;
  for (auto i : order)
    if (const ShardedNode* s = as_sharded(ins[i]); s && !mesh) mesh = &s->sharding().mesh;
  if (!mesh) return nullptr;
  Sharding target{*mesh, std::vector<std::vector<int>>(4)};
  std::vector<bool> used(static_cast<std::size_t>(mesh->rank()), false);
  for (auto i : order) {
    const ShardedNode* s = as_sharded(ins[i]);
    if (!s || !(s->sharding().mesh == *mesh)) continue;
    for (int d = 0; d < s->shape().rank(); ++d) {
      const int l = logical_of[i][static_cast<std::size_t>(d)];
      const auto& axes = s->sharding().dims[static_cast<std::size_t>(d)];
      if (l < 0) continue;
      auto& slot = target.dims[static_cast<std::size_t>(l)];
      bool free = slot.empty();
      for (int ax : axes) free = free && !used[static_cast<std::size_t>(ax)];
      if (!free) continue;
      slot = axes;
      for (int ax : axes) used[static_cast<std::size_t>(ax)] = true;
    }
  }
  auto pieces = pieces_for(ins, logical_of, target, logical);
  const Shape block = target.block_shape(logical);
  Sharding result{*mesh, std::vector<std::vector<int>>(static_cast<std::size_t>(rank))};
  if (batch > 1 || folded) result.dims[0] = target.dims[0];
  result.dims[static_cast<std::size_t>(rank - 2)] = target.dims[1];
  result.dims[static_cast<std::size_t>(rank - 1)] = target.dims[3];
  const Shape out_block = result.block_shape(out);
  // A pending transpose of a 2-D piece is read through, as matmul does unsharded (not of a
  // batch: a batched GEMM may stack its batches' rows, which a transposed read breaks).
  auto operand = [](graph::NodePtr p, bool transposed) {
    if (p->pending()) {
      if (auto* tr = dynamic_cast<graph::TransposeOfLastTwo*>(p.get()); tr && tr->transpose_source()->shape().rank() == 2)
        return graph::GemmOperand{tr->transpose_source(), !transposed};
    }
    return graph::GemmOperand{std::move(p), transposed};
  };
  graph::NodeList shards;
  const bool split_k = !target.dims[2].empty();
  const std::int64_t block_ba = ba > 1 ? block[0] : 1, block_bb = bb > 1 ? block[0] : 1;
  for (int p = 0; p < mesh->size(); ++p) {
    graph::Device& dev = mesh_device(mesh->device_ids()[static_cast<std::size_t>(p)]);
    auto& pc = pieces[static_cast<std::size_t>(p)];
    const std::int64_t rows = folded ? block[0] * block[1] : block[1];
    shards.push_back(graph::submit_unpartitioned(gm.with_operands(operand(pc[0], ta), operand(pc[1], tb), rows,
                                                                  block[2], block[3], out_block, &dev, split_k,
                                                                  block_ba, block_bb)));
  }
  if (split_k) {
    // Partial products over k blocks, combined in k order; a bfloat16 product's sum is
    // rounded once, as unsharded.
    reduce_partials(shards, *mesh, target.dims[2], [&](int p) { return target.part_of(p, 2); }, Combine::Sum);
    if (gm.bf16())
      for (auto& s : shards) s = graph::submit_unpartitioned(std::make_shared<graph::RoundToBFloat16Node>(s));
  }
  return std::make_shared<ShardedNode>(std::move(result), std::move(shards), node.dtype(), out, node.device());
}

LAZYTENSOR_INLINE graph::NodePtr partition_batch_sum(const graph::Node& node, const graph::BlockBatchSum& bs) {
  const auto& ins = node.inputs();
  // The lead: the largest sharded input split along its batch only.
  const ShardedNode* lead = nullptr;
  for (const auto& in : ins) {
    const ShardedNode* s = as_sharded(in);
    if (!s) continue;
    bool batch_only = true;
    for (int d = 1; d < s->shape().rank(); ++d) batch_only = batch_only && s->sharding().parts(d) == 1;
    if (batch_only && leads(s, lead)) lead = s;
  }
  if (!lead) return nullptr;
  const Mesh& mesh = lead->sharding().mesh;
  // One logical dimension, the batch; every other dimension is read whole.
  const Sharding target{mesh, {lead->sharding().dims[0]}};
  std::vector<std::vector<int>> logical_of;
  for (const auto& in : ins) {
    std::vector<int> map(static_cast<std::size_t>(in->shape().rank()), -1);
    map[0] = 0;
    logical_of.push_back(std::move(map));
  }
  auto pieces = pieces_for(ins, logical_of, target, Shape{ins[0]->shape()[0]});
  graph::NodeList shards;
  for (int p = 0; p < mesh.size(); ++p) {
    graph::Device& dev = mesh_device(mesh.device_ids()[static_cast<std::size_t>(p)]);
    shards.push_back(graph::submit_unpartitioned(bs.with_batch(std::move(pieces[static_cast<std::size_t>(p)]), &dev)));
  }
  // Each block's sum over its items; the blocks' sums added in batch order.
  if (!target.dims[0].empty())
    reduce_partials(shards, mesh, target.dims[0], [&](int p) { return target.part_of(p, 0); }, Combine::Sum);
  Sharding result{mesh, std::vector<std::vector<int>>(static_cast<std::size_t>(node.shape().rank()))};
  return std::make_shared<ShardedNode>(std::move(result), std::move(shards), node.dtype(), node.shape(), node.device());
}

LAZYTENSOR_INLINE graph::NodePtr partition_transpose(const graph::TransposeNode& node) {
  const ShardedNode* s = as_sharded(node.inputs()[0]);
  if (!s) return nullptr;
  const int rank = node.shape().rank();
  Sharding result = s->sharding();
  std::swap(result.dims[static_cast<std::size_t>(rank - 2)], result.dims[static_cast<std::size_t>(rank - 1)]);
  graph::NodeList shards;
  for (int p = 0; p < s->num_shards(); ++p) {
    const graph::NodePtr& piece = s->shard(p);
    if (piece->pending()) {
      if (auto* tr = dynamic_cast<graph::TransposeOfLastTwo*>(piece.get())) {
        shards.push_back(tr->transpose_source());
        continue;
      }
    }
    shards.push_back(graph::submit_unpartitioned(std::make_shared<graph::TransposeNode>(piece)));
  }
  return std::make_shared<TransposedShardedNode>(node.inputs()[0], std::move(result), std::move(shards), node.dtype(),
                                                 node.shape(), node.device());
}

LAZYTENSOR_INLINE bool block_runs(const Shape& shape, const Ranges& ranges, std::size_t limit,
                                  std::vector<std::pair<std::int64_t, std::int64_t>>& runs) {
  runs.clear();
  const int rank = shape.rank();
  if (rank == 0) {
    runs.emplace_back(0, 1);
    return true;
  }
  for (const auto& [b0, b1] : ranges)
    if (b1 <= b0) return true;
  // Innermost dimensions the block covers whole merge into one run with the first
  // partial dimension (from the inside).
  int inner = rank - 1;
  std::int64_t run = ranges[static_cast<std::size_t>(inner)].second - ranges[static_cast<std::size_t>(inner)].first;
  while (inner > 0 && ranges[static_cast<std::size_t>(inner)].first == 0 &&
         ranges[static_cast<std::size_t>(inner)].second == shape[inner]) {
    --inner;
    run *= ranges[static_cast<std::size_t>(inner)].second - ranges[static_cast<std::size_t>(inner)].first;
  }
  std::vector<std::int64_t> stride(static_cast<std::size_t>(rank), 1);
  for (int d = rank - 1; d-- > 0;) stride[static_cast<std::size_t>(d)] = stride[static_cast<std::size_t>(d) + 1] * shape[d + 1];
  std::vector<std::int64_t> c(static_cast<std::size_t>(inner));
  for (int d = 0; d < inner; ++d) c[static_cast<std::size_t>(d)] = ranges[static_cast<std::size_t>(d)].first;
  for (;;) {
    if (runs.size() == limit) return false;
    std::int64_t start = ranges[static_cast<std::size_t>(inner)].first * stride[static_cast<std::size_t>(inner)];
    for (int d = 0; d < inner; ++d) start += c[static_cast<std::size_t>(d)] * stride[static_cast<std::size_t>(d)];
    if (!runs.empty() && runs.back().first + runs.back().second == start) runs.back().second += run;
    else runs.emplace_back(start, run);
    int d = inner - 1;
    for (; d >= 0; --d) {
      if (++c[static_cast<std::size_t>(d)] < ranges[static_cast<std::size_t>(d)].second) break;
      c[static_cast<std::size_t>(d)] = ranges[static_cast<std::size_t>(d)].first;
    }
    if (d < 0) return true;
  }
}

LAZYTENSOR_INLINE graph::NodePtr partition_view(const graph::ViewNode& node) {
  const ShardedNode* s = as_sharded(node.inputs()[0]);
  if (!s) return nullptr;
  const Shape& in = s->shape();
  const Shape& out = node.shape();
  // Candidate: each split input dimension moves to the output dimension that starts at the
  // same linear offset; the element runs of every block must then agree.
  Sharding target{s->sharding().mesh, std::vector<std::vector<int>>(static_cast<std::size_t>(out.rank()))};
  for (int d = 0; d < in.rank(); ++d) {
    const std::int64_t parts = s->sharding().parts(d);
    if (parts == 1) continue;
    std::int64_t prefix_in = 1, prefix_out = 1;
    for (int k = 0; k < d; ++k) prefix_in *= in[k];
    int o = 0;
    while (o < out.rank() && (prefix_out < prefix_in || out[o] == 1)) prefix_out *= out[o++];
    if (o == out.rank() || prefix_out != prefix_in || out[o] % parts != 0) return nullptr;
    target.dims[static_cast<std::size_t>(o)] = s->sharding().dims[static_cast<std::size_t>(d)];
  }
  constexpr std::size_t kMaxRuns = 4096;
  std::vector<std::pair<std::int64_t, std::int64_t>> a, b;
  for (int p = 0; p < s->num_shards(); ++p) {
    if (!block_runs(in, s->sharding().block(p, in), kMaxRuns, a) || !block_runs(out, target.block(p, out), kMaxRuns, b) ||
        a != b)
      return nullptr;
  }
  const Shape block = target.block_shape(out);
  graph::NodeList shards;
  for (int p = 0; p < s->num_shards(); ++p)
    shards.push_back(graph::submit_unpartitioned(std::make_shared<graph::ViewNode>(node.op_name(), s->shard(p), block)));
  return std::make_shared<ShardedNode>(std::move(target), std::move(shards), node.dtype(), out, node.device());
}

}  // namespace lazy::spmd::detail
#endif  // LAZYTENSOR_HEADER_DEFINITIONS
