#pragma once
// Annotating tensors with a sharding (mark_sharding, clear_sharding) and looking at the
// result: local_shards, sharding_spec, visualize_tensor_sharding.

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <lazytensor/any_tensor.hpp>
#include <lazytensor/spmd/mode.hpp>
#include <lazytensor/spmd/sharded_node.hpp>
#include <lazytensor/tensor/tensor.hpp>

namespace lazy::spmd {

/// One device's piece of a tensor (torch_xla's XLAShard): its value (a tensor of the
/// block's shape on `device`), the device, and the block's [begin, end) range per
/// dimension.
template <Element T>
struct Shard {
  Tensor<T> data;
  Device device;
  std::vector<std::pair<std::int64_t, std::int64_t>> index;
};

namespace detail {
/// The tensor object's value split over `sharding` (resolved for its shape), rebinding it:
/// every handle sees the sharded value. Error outside SPMD mode.
void mark_node(graph::TensorImpl& impl, const Mesh& mesh, const PartitionSpec& spec);
/// The tensor object's value gathered into one node on its device.
void clear_node(graph::TensorImpl& impl);
/// For each mesh position (one entry for an unsharded value): node, device id, block.
struct Piece {
  graph::NodePtr node;
  int device;
  Ranges index;
};
std::vector<Piece> pieces_of(const graph::NodePtr& value);
std::string spec_text(const graph::NodePtr& value);
std::string visualize(const graph::NodePtr& value);
}  // namespace detail

/// Shards `t` over `mesh` as `spec` says (torch_xla's xs.mark_sharding), in place: the
/// tensor object is rebound, so every handle sees it, and `t` is returned. The current
/// value is computed and each device's block copied to it (a replicated block shares the
/// buffer). Error outside SPMD mode; ShardingError for a spec that does not fit (see
/// resolve_sharding). A sharded tensor is resharded.
template <Element T>
Tensor<T>& mark_sharding(Tensor<T>& t, const Mesh& mesh, const PartitionSpec& spec) {
  if (!t.defined()) throw Error("mark_sharding: expected a defined tensor, got an undefined one");
  detail::mark_node(*t.impl(), mesh, spec);
  return t;
}

/// mark_sharding of a tensor of any dtype (a module's parameters()).
inline AnyTensor& mark_sharding(AnyTensor& t, const Mesh& mesh, const PartitionSpec& spec) {
  if (!t.defined()) throw Error("mark_sharding: expected a defined tensor, got an undefined one");
  detail::mark_node(*t.impl(), mesh, spec);
  return t;
}

/// mark_sharding with a ShardingSpec's mesh and spec.
template <Element T>
Tensor<T>& mark_sharding(Tensor<T>& t, const ShardingSpec& spec) {
  return mark_sharding(t, spec.mesh(), spec.partition_spec());
}

/// Makes `t` whole again (torch_xla's clear_sharding): the value is gathered onto the
/// tensor's device, unsharded. A tensor that is not sharded is left as it is.
template <Element T>
Tensor<T>& clear_sharding(Tensor<T>& t) {
  if (!t.defined()) throw Error("clear_sharding: expected a defined tensor, got an undefined one");
  detail::clear_node(*t.impl());
  return t;
}

/// The pieces of `t` on this process's devices, one per mesh device in mesh order (a
/// tensor that is not sharded: one piece, the whole tensor on its device). Each `data` is a
/// new handle on the piece's value: updating it leaves `t` alone. Reading a piece computes
/// only that piece. When the program spans processes, the other processes' pieces are
/// left out (torch_xla's addressable shards), and `device` is this process's device (its
/// index counts this process's devices; the mesh names it by its global id).
template <Element T>
std::vector<Shard<T>> local_shards(const Tensor<T>& t) {
  std::vector<Shard<T>> r;
  for (auto& p : detail::pieces_of(t.node())) {
    if (p.node->device()->remote()) continue;
    const int index = p.node->device()->index();
    r.push_back({Tensor<T>(std::move(p.node)), Device(index), std::move(p.index)});
  }
  return r;
}

/// The sharding as XLA's text (torch_xla's _get_xla_sharding_spec): `{devices=[2,1]0,1}`,
/// `{replicated}`; an empty string for a tensor that is not sharded.
template <Element T>
std::string sharding_spec(const Tensor<T>& t) {
  return detail::spec_text(t.node());
}

/// A text table of which device holds which block of `t` (torch_xla's
/// visualize_tensor_sharding): a grid for 1-D and 2-D tensors, one line per block
/// otherwise.
template <Element T>
std::string visualize_tensor_sharding(const Tensor<T>& t) {
  return detail::visualize(t.node());
}

}  // namespace lazy::spmd

#if LAZYTENSOR_HEADER_DEFINITIONS
#include <algorithm>
#include <map>

namespace lazy::spmd::detail {

LAZYTENSOR_INLINE void mark_node(graph::TensorImpl& impl, const Mesh& mesh, const PartitionSpec& spec) {
  if (!is_spmd())
    throw Error("mark_sharding: SPMD mode is off; call lazy::spmd::use_spmd() before creating tensors");
  const Sharding sharding = resolve_sharding(mesh, spec, impl.node->shape());
  if (const ShardedNode* s = as_sharded(impl.node); s && s->sharding() == sharding) return;
  impl.node = shard_value(impl.node, sharding);
}

LAZYTENSOR_INLINE void shard_loader_input(graph::TensorImpl& t, const ShardingSpec& spec) {
  mark_node(t, spec.mesh(), spec.partition_spec());
}

LAZYTENSOR_INLINE void clear_node(graph::TensorImpl& impl) {
  if (!as_sharded(impl.node)) return;
  graph::materialize(impl.node);
  const graph::NodePtr& n = impl.node;
  impl.node = std::make_shared<graph::DataNode>(n->dtype(), n->shape(), n->device(), n->buffer());
}

LAZYTENSOR_INLINE std::vector<Piece> pieces_of(const graph::NodePtr& value) {
  std::vector<Piece> r;
  if (const ShardedNode* s = as_sharded(value)) {
    s->hand_out_pieces();  // a piece read alone must not wait for peers nobody runs
    const auto& ids = s->sharding().mesh.device_ids();
    for (int p = 0; p < s->num_shards(); ++p)
      r.push_back({s->shard(p), ids[static_cast<std::size_t>(p)], s->sharding().block(p, value->shape())});
    return r;
  }
  Ranges whole;
  for (auto d : value->shape()) whole.emplace_back(0, d);
  r.push_back({value, value->device()->index(), std::move(whole)});
  return r;
}

LAZYTENSOR_INLINE std::string spec_text(const graph::NodePtr& value) {
  const ShardedNode* s = as_sharded(value);
  return s ? s->sharding().str() : std::string();
}

LAZYTENSOR_INLINE std::string visualize(const graph::NodePtr& value) {
  const Shape& shape = value->shape();
  // Devices per block, blocks keyed by their ranges (replicas share a cell).
  std::map<Ranges, std::vector<int>> cells;
  for (auto& p : pieces_of(value)) cells[p.index].push_back(p.device);
  auto range_text = [](const Ranges& r) {
    std::string s = "[";
    for (std::size_t i = 0; i < r.size(); ++i) {
      if (i) s += ", ";
      s += std::to_string(r[i].first) + ":" + std::to_string(r[i].second);
    }
    return s + "]";
  };
  auto devices_text = [](const std::vector<int>& ids) {
    std::string s = "CPU ";
    for (std::size_t i = 0; i < ids.size(); ++i) {
      if (i) s += ",";
      s += std::to_string(ids[i]);
    }
    return s;
  };
  std::string out = "tensor of shape " + detail::tuple_text(shape.vec()) + ", " +
                    (as_sharded(value) ? as_sharded(value)->sharding().str() : std::string("not sharded")) + "\n";
  if (shape.rank() == 0 || shape.rank() > 2) {
    for (const auto& [r, ids] : cells) out += "  " + range_text(r) + " -> " + devices_text(ids) + "\n";
    return out;
  }
  // A grid: rows are blocks of dimension 0, columns blocks of dimension 1.
  std::vector<std::pair<std::int64_t, std::int64_t>> rows, cols;
  for (const auto& [r, ids] : cells) {
    if (std::find(rows.begin(), rows.end(), r[0]) == rows.end()) rows.push_back(r[0]);
    if (shape.rank() == 2 && std::find(cols.begin(), cols.end(), r[1]) == cols.end()) cols.push_back(r[1]);
  }
  if (shape.rank() == 1) {  // one row of cells along the only dimension
    cols = rows;
    rows = {{0, 1}};
  }
  std::sort(rows.begin(), rows.end());
  std::sort(cols.begin(), cols.end());
  std::vector<std::vector<std::string>> text(rows.size(), std::vector<std::string>(cols.size()));
  std::size_t width = 0;
  for (const auto& [r, ids] : cells) {
    const auto row = shape.rank() == 1 ? std::pair<std::int64_t, std::int64_t>{0, 1} : r[0];
    const auto col = shape.rank() == 1 ? r[0] : r[1];
    const auto i = static_cast<std::size_t>(std::find(rows.begin(), rows.end(), row) - rows.begin());
    const auto j = static_cast<std::size_t>(std::find(cols.begin(), cols.end(), col) - cols.begin());
    text[i][j] = devices_text(ids);
    width = std::max(width, text[i][j].size());
  }
  std::string line = "+";
  for (std::size_t j = 0; j < cols.size(); ++j) line += std::string(width + 2, '-') + "+";
  out += line + "\n";
  for (const auto& row : text) {
    out += "|";
    for (const auto& cell : row) out += " " + cell + std::string(width - cell.size(), ' ') + " |";
    out += "\n" + line + "\n";
  }
  return out;
}

}  // namespace lazy::spmd::detail
#endif  // LAZYTENSOR_HEADER_DEFINITIONS
