#pragma once
// The value of a sharded tensor: one piece per mesh device, each a node on its own device
// (computed by that device's steps), and the whole value, gathered only when read.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <lazytensor/core/buffer.hpp>
#include <lazytensor/graph/byte_copy.hpp>
#include <lazytensor/graph/device.hpp>
#include <lazytensor/graph/node.hpp>
#include <lazytensor/graph/tensor_impl.hpp>
#include <lazytensor/graph/transpose_hint.hpp>
#include <lazytensor/spmd/sharding.hpp>
#include <lazytensor/spmd/span.hpp>
#include <lazytensor/core/counters.hpp>
#include <lazytensor/graph/submit.hpp>

namespace lazy::spmd {

/// The whole value of a tensor sharded over a mesh (NodeKind::Sharded). It holds one piece
/// per mesh position (devices holding the same block hold equal pieces), each behind a
/// tensor object of its own (a handle on the piece), so every device's mark_step computes
/// its piece. The node itself is never traced or planned: graph::submit hands every node
/// reading it to the partitioner, and reading it (item(), to_vector(), a partitioner
/// fallback) gathers the blocks into one buffer on the tensor's device. When the program
/// spans processes (span.hpp), the pieces of other processes' devices are never computed
/// here: a block no device of this process holds comes from the first process holding it,
/// so such a read is collective (every process reads the value, as the same program does).
class ShardedNode : public graph::Node {
 public:
  ShardedNode(Sharding sharding, graph::NodeList pieces, DType dtype, Shape shape,
              graph::Device* device);

  const Sharding& sharding() const { return sharding_; }
  /// The piece at mesh position `position` (on device `mesh.device_ids()[position]`).
  const graph::NodePtr& shard(int position) const { return shards_[static_cast<std::size_t>(position)]->node; }
  int num_shards() const { return static_cast<int>(shards_.size()); }
  /// Hands every device its pending work when a piece is still pending: pieces may wait
  /// for each other in collectives, so none is waited for before all are handed out.
  void hand_out_pieces() const;

  std::string op_name() const override { return "sharded"; }
  std::string describe() const override { return sharding_.str(); }

 protected:
  /// The gather: each distinct block once, from the first position holding it.
  LAZYTENSOR_INLINE void compute(graph::ExecContext& ctx) override;

 private:
  Sharding sharding_;
  std::vector<std::shared_ptr<graph::TensorImpl>> shards_;
};

/// A sharded value that is another's with the last two dimensions swapped (the
/// partitioner's transpose): a GEMM reads the source through it, as through a pending
/// TransposeNode, so a product with `W^T` and its backward copy no transpose (the
/// gradient comes out in W's layout).
class TransposedShardedNode final : public ShardedNode, public graph::TransposeOfLastTwo {
 public:
  TransposedShardedNode(graph::NodePtr source, Sharding sharding, graph::NodeList pieces, DType dtype,
                        Shape shape, graph::Device* device)
      : ShardedNode(std::move(sharding), std::move(pieces), dtype, std::move(shape), device), source_(std::move(source)) {}
  const graph::NodePtr& transpose_source() const override { return source_; }

 private:
  graph::NodePtr source_;
};

/// `n` as a sharded node, or null.
inline const ShardedNode* as_sharded(const graph::NodePtr& n) {
  return n && n->kind() == graph::NodeKind::Sharded ? static_cast<const ShardedNode*>(n.get()) : nullptr;
}

/// The engine device of a mesh device id (global when the program spans processes).
inline graph::Device& mesh_device(int id) { return detail::span_device(id); }

namespace detail {

/// A [begin, end) range per dimension.
using Ranges = std::vector<std::pair<std::int64_t, std::int64_t>>;

/// The block `ranges` of materialized `value`, as data on `dev`, copied into `dev`'s pool.
/// The whole value on its own device shares the buffer (buffers are immutable; donation
/// needs a sole holder). Blocks are never shared with another device (only a buffer marked
/// shared is, such as an all-reduce's result): when the other device's reference is the
/// last, this device could donate it while the other's reads are unordered with the write
/// (shared_ptr's use_count is a relaxed read).
graph::NodePtr block_of(const graph::NodePtr& value, const Ranges& ranges, graph::Device& dev);

/// Splits `value` (materialized here; a sharded value is gathered first) over `sharding`.
/// Counted as SpmdTransfers / SpmdTransferBytes (bytes copied to other devices).
graph::NodePtr shard_value(const graph::NodePtr& value, const Sharding& sharding);

}  // namespace detail
}  // namespace lazy::spmd

#if LAZYTENSOR_HEADER_DEFINITIONS
#include <cstring>


namespace lazy::spmd {

LAZYTENSOR_INLINE ShardedNode::ShardedNode(Sharding sharding, graph::NodeList pieces, DType dtype, Shape shape,
                                           graph::Device* device)
    : Node(graph::NodeKind::Sharded, dtype, shape, device), sharding_(std::move(sharding)) {
  shards_.reserve(pieces.size());
  for (auto& p : pieces) shards_.push_back(std::make_shared<graph::TensorImpl>(std::move(p)));
}

LAZYTENSOR_INLINE void ShardedNode::hand_out_pieces() const {
  for (const auto& s : shards_) {
    if (s->node->pending()) {
      graph::step_all_devices();
      return;
    }
  }
}

LAZYTENSOR_INLINE void ShardedNode::compute(graph::ExecContext& ctx) {
  static auto& gathers = core::counter("SpmdGathers");
  gathers.add();
  const Shape global = shape();
  const std::size_t esize = dtype_size(dtype());
  // Per block: the first position holding it (its owner sends it to processes holding
  // none), the first one on this process's devices, and which processes hold it.
  const auto& span = detail::process_span();
  const auto blocks = static_cast<std::size_t>(sharding_.blocks());
  std::vector<int> first(blocks, -1), first_here(blocks, -1);
  std::vector<std::vector<char>> held(blocks, std::vector<char>(static_cast<std::size_t>(span.count), 0));
  for (int p = 0; p < num_shards(); ++p) {
    std::int64_t b = 0;
    for (int d = 0; d < global.rank(); ++d) b = b * sharding_.parts(d) + sharding_.part_of(p, d);
    const auto bi = static_cast<std::size_t>(b);
    const graph::Device& dev = *shard(p)->device();
    if (first[bi] < 0) first[bi] = p;
    if (!dev.remote() && first_here[bi] < 0) first_here[bi] = p;
    held[bi][static_cast<std::size_t>(dev.process())] = 1;
  }
  // Whether some process lacks a block: the same answer in every process, so each counts
  // the same cross-process gathers (counted before anything here can throw).
  bool crosses = false;
  for (std::size_t b = 0; b < blocks; ++b)
    for (int q = 0; q < span.count; ++q) crosses = crosses || !held[b][static_cast<std::size_t>(q)];
  static std::atomic<std::uint64_t> exchanges{0};
  const std::uint64_t seq = crosses ? exchanges.fetch_add(1, std::memory_order_relaxed) : 0;
  auto buf = allocate_output(ctx, false);
  hand_out_pieces();
  auto place = [&](const void* data, int position) {
    const auto ranges = sharding_.block(position, global);
    std::vector<std::int64_t> at, box;
    for (const auto& [b0, b1] : ranges) {
      at.push_back(b0);
      box.push_back(b1 - b0);
    }
    graph::detail::copy_box(static_cast<const std::byte*>(data), shard(position)->shape(), std::vector<std::int64_t>(at.size(), 0),
                            static_cast<std::byte*>(buf->data()), global, at, box, esize);
  };
  std::vector<detail::Transfer> sends, receives;
  std::vector<std::pair<std::shared_ptr<Buffer>, int>> received;
  for (std::size_t b = 0; b < blocks; ++b) {
    if (first_here[b] >= 0) {
      const graph::NodePtr& piece = shard(first_here[b]);
      graph::materialize(piece);
      place(piece->buffer()->data(), first_here[b]);
      if (first_here[b] != first[b]) continue;
      for (int q = 0; q < span.count; ++q)
        if (!held[b][static_cast<std::size_t>(q)])
          sends.push_back({q, piece->buffer()->data(), static_cast<std::size_t>(piece->numel()) * esize, piece->buffer()});
    } else {
      const graph::NodePtr& piece = shard(first[b]);
      auto in = ctx.device.pool().acquire(padded_bytes(piece->numel(), esize));
      receives.push_back({piece->device()->process(), in->data(), static_cast<std::size_t>(piece->numel()) * esize, in});
      received.emplace_back(std::move(in), first[b]);
    }
  }
  if (!sends.empty() || !receives.empty()) {
    const std::uint64_t signature = graph::hash_combine(
        graph::hash_combine(static_cast<std::uint64_t>(dtype()), static_cast<std::uint64_t>(global.numel())),
        std::hash<std::string>{}(sharding_.str()));
    detail::exchange(detail::Channel::Gather, seq, signature, sends, receives,
                     "gather of a " + global.str() + " value sharded " + sharding_.str());
    for (const auto& [in, position] : received) place(in->data(), position);
  }
  set_buffer(std::move(buf));
}

LAZYTENSOR_INLINE graph::NodePtr detail::block_of(const graph::NodePtr& value, const Ranges& ranges, graph::Device& dev) {
  const Shape& global = value->shape();
  bool whole = true;
  std::vector<std::int64_t> at, box;
  for (int d = 0; d < global.rank(); ++d) {
    const auto [b0, b1] = ranges[static_cast<std::size_t>(d)];
    whole = whole && b0 == 0 && b1 == global[d];
    at.push_back(b0);
    box.push_back(b1 - b0);
  }
  if (whole && value->device() == &dev)
    return std::make_shared<graph::DataNode>(value->dtype(), global, &dev, value->buffer());
  const Shape shape(box);
  // Another process's device: that process copies its own block (it holds the same value).
  if (dev.remote()) return std::make_shared<graph::DataNode>(value->dtype(), shape, &dev, nullptr);
  const std::size_t esize = dtype_size(value->dtype());
  auto buf = dev.pool().acquire(padded_bytes(shape.numel(), esize));
  graph::detail::copy_box(static_cast<const std::byte*>(value->buffer()->data()), global, at, static_cast<std::byte*>(buf->data()),
           shape, std::vector<std::int64_t>(at.size(), 0), box, esize);
  static auto& bytes = core::counter("SpmdTransferBytes");
  bytes.add(static_cast<std::int64_t>(shape.numel() * static_cast<std::int64_t>(esize)));
  return std::make_shared<graph::DataNode>(value->dtype(), shape, &dev, std::move(buf));
}

LAZYTENSOR_INLINE graph::NodePtr detail::shard_value(const graph::NodePtr& value, const Sharding& sharding) {
  static auto& transfers = core::counter("SpmdTransfers");
  transfers.add();
  graph::materialize(value);
  graph::NodeList pieces;
  for (int p = 0; p < sharding.mesh.size(); ++p)
    pieces.push_back(block_of(value, sharding.block(p, value->shape()),
                              mesh_device(sharding.mesh.device_ids()[static_cast<std::size_t>(p)])));
  return std::make_shared<ShardedNode>(sharding, std::move(pieces), value->dtype(), value->shape(), value->device());
}

}  // namespace lazy::spmd
#endif  // LAZYTENSOR_HEADER_DEFINITIONS
