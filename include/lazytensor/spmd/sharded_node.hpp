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
#include <lazytensor/core/counters.hpp>
#include <lazytensor/graph/submit.hpp>

namespace lazy::spmd {

/// The whole value of a tensor sharded over a mesh (NodeKind::Sharded). It holds one piece
/// per mesh position (devices holding the same block hold equal pieces), each behind a
/// tensor object of its own (a handle on the piece), so every device's mark_step computes
/// its piece. The
/// node itself is never traced or planned: graph::submit hands every node reading it to
/// the partitioner, and reading it (item(), to_vector(), a partitioner fallback) gathers
/// the blocks into one buffer on the tensor's device.
class ShardedNode : public graph::Node {
 public:
  ShardedNode(Sharding sharding, std::vector<graph::NodePtr> pieces, DType dtype, Shape shape,
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
  void compute(graph::ExecContext& ctx) override;

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
  TransposedShardedNode(graph::NodePtr source, Sharding sharding, std::vector<graph::NodePtr> pieces, DType dtype,
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

/// The engine device of a mesh device id.
inline graph::Device& mesh_device(int id) { return graph::DeviceRegistry::get().device(id); }

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

LAZYTENSOR_INLINE ShardedNode::ShardedNode(Sharding sharding, std::vector<graph::NodePtr> pieces, DType dtype, Shape shape,
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
  auto buf = allocate_output(ctx, false);
  const Shape global = shape();
  std::vector<bool> done(static_cast<std::size_t>(sharding_.blocks()), false);
  const std::size_t esize = dtype_size(dtype());
  hand_out_pieces();
  for (int p = 0; p < num_shards(); ++p) {
    std::int64_t b = 0;
    for (int d = 0; d < global.rank(); ++d) b = b * sharding_.parts(d) + sharding_.part_of(p, d);
    if (done[static_cast<std::size_t>(b)]) continue;
    done[static_cast<std::size_t>(b)] = true;
    const graph::NodePtr& piece = shard(p);
    graph::materialize(piece);
    const auto ranges = sharding_.block(p, global);
    std::vector<std::int64_t> at, box;
    for (const auto& [b0, b1] : ranges) {
      at.push_back(b0);
      box.push_back(b1 - b0);
    }
    graph::detail::copy_box(static_cast<const std::byte*>(piece->buffer()->data()), piece->shape(),
                     std::vector<std::int64_t>(at.size(), 0), static_cast<std::byte*>(buf->data()), global, at, box,
                     esize);
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
  std::vector<graph::NodePtr> pieces;
  for (int p = 0; p < sharding.mesh.size(); ++p)
    pieces.push_back(block_of(value, sharding.block(p, value->shape()),
                              mesh_device(sharding.mesh.device_ids()[static_cast<std::size_t>(p)])));
  return std::make_shared<ShardedNode>(sharding, std::move(pieces), value->dtype(), value->shape(), value->device());
}

}  // namespace lazy::spmd
#endif  // LAZYTENSOR_HEADER_DEFINITIONS
