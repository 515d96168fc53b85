#pragma once
// Partition specs (how a tensor's dimensions map onto mesh axes) and the resolved sharding
// of one tensor: which block of it each device of the mesh holds.

#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include <lazytensor/core/shape.hpp>
#include <lazytensor/spmd/mesh.hpp>

namespace lazy::spmd {

/// One mesh axis in a partition spec: its index (`0`) or its name (`"data"`).
class AxisRef {
 public:
  AxisRef(int index) : ref_(index) {}
  AxisRef(const char* name) : ref_(std::string(name)) {}
  AxisRef(std::string name) : ref_(std::move(name)) {}
  const std::variant<int, std::string>& ref() const { return ref_; }

 private:
  std::variant<int, std::string> ref_;
};

/// One entry of a partition spec, for one tensor dimension: replicated (`std::nullopt`),
/// one mesh axis (`0`, `"data"`), or a braced list of axes (`{"x", "y"}`) that shards the
/// dimension over all of them, the first major.
class PartitionEntry {
 public:
  PartitionEntry(std::nullopt_t) {}
  PartitionEntry(int axis) : axes_{AxisRef(axis)} {}
  PartitionEntry(const char* axis) : axes_{AxisRef(axis)} {}
  PartitionEntry(std::string axis) : axes_{AxisRef(std::move(axis))} {}
  PartitionEntry(std::initializer_list<AxisRef> axes) : axes_(axes) {}
  /// The axes, major first (empty: replicated).
  const std::vector<AxisRef>& axes() const { return axes_; }

 private:
  std::vector<AxisRef> axes_;
};

/// A partition spec: one entry per tensor dimension (`{0, std::nullopt}`, `{"data"}`).
/// Shorter specs are padded with replicated entries; mesh axes it leaves out replicate.
using PartitionSpec = std::vector<PartitionEntry>;

/// The resolved sharding of a tensor of a given shape: for each dimension, the mesh axes
/// (indices, major first) that split it. Devices whose coordinates differ only along
/// unused axes hold the same block (replicas).
struct Sharding {
  Mesh mesh;
  std::vector<std::vector<int>> dims;

  /// Number of blocks along dimension `d` (the product of its axes' sizes).
  std::int64_t parts(int d) const;
  /// The axes that cut dimension `d`: its axes but those of size 1, which cut nothing (two
  /// dimensions with the same cuts are split into the same blocks).
  std::vector<int> cuts(int d) const;
  /// Number of distinct blocks (the product of every dimension's parts).
  std::int64_t blocks() const;
  /// True when no dimension is split.
  bool replicated() const;
  /// The block index along dimension `d` of the device at mesh position `position`.
  std::int64_t part_of(int position, int d) const;
  /// The [begin, end) range of every dimension of `global` that mesh position `position`
  /// holds.
  std::vector<std::pair<std::int64_t, std::int64_t>> block(int position, const Shape& global) const;
  /// The shape of the block every device holds.
  Shape block_shape(const Shape& global) const;
  /// ShapeError unless `global` has one dimension per entry of `dims`.
  void check_rank(const Shape& global, const char* who) const;
  /// The sharding as torch_xla's _get_xla_sharding_spec prints it (XLA's HloSharding
  /// text): `{replicated}`, `{devices=[2,1]0,1}`, or with replication along unused axes
  /// `{devices=[2,1,2]0,1,2,3 last_tile_dim_replicate}`.
  std::string str() const;

  friend bool operator==(const Sharding&, const Sharding&) = default;
};

/// Resolves `spec` on `mesh` for a tensor of shape `shape`. ShardingError, naming the
/// offender, for: a spec longer than the rank, an unknown axis name or index, an axis used
/// twice, and a dimension not divisible by its axes' sizes (JAX's message:
/// `dimension 0 of shape (6, 4) must be divisible by 4 (mesh axis "x")`).
Sharding resolve_sharding(const Mesh& mesh, const PartitionSpec& spec, const Shape& shape);

/// A mesh and a partition spec, resolved against each tensor it is applied to (torch_xla's
/// ShardingSpec; `minibatch` marks specs for per-process batches of a global batch, which
/// in one process is the batch itself).
class ShardingSpec {
 public:
  ShardingSpec(Mesh mesh, PartitionSpec spec, bool minibatch = false)
      : mesh_(std::move(mesh)), spec_(std::move(spec)), minibatch_(minibatch) {}
  const Mesh& mesh() const { return mesh_; }
  const PartitionSpec& partition_spec() const { return spec_; }
  bool minibatch() const { return minibatch_; }
  /// The sharding of a tensor of `shape` (ShardingError as resolve_sharding).
  Sharding resolve(const Shape& shape) const { return resolve_sharding(mesh_, spec_, shape); }

 private:
  Mesh mesh_;
  PartitionSpec spec_;
  bool minibatch_;
};

}  // namespace lazy::spmd

#if LAZYTENSOR_HEADER_DEFINITIONS
namespace lazy::spmd {

LAZYTENSOR_INLINE std::int64_t Sharding::parts(int d) const {
  std::int64_t n = 1;
  for (int a : dims[static_cast<std::size_t>(d)]) n *= mesh.mesh_shape()[static_cast<std::size_t>(a)];
  return n;
}

LAZYTENSOR_INLINE std::vector<int> Sharding::cuts(int d) const {
  std::vector<int> axes;
  for (int a : dims[static_cast<std::size_t>(d)])
    if (mesh.mesh_shape()[static_cast<std::size_t>(a)] > 1) axes.push_back(a);
  return axes;
}

LAZYTENSOR_INLINE std::int64_t Sharding::blocks() const {
  std::int64_t n = 1;
  for (std::size_t d = 0; d < dims.size(); ++d) n *= parts(static_cast<int>(d));
  return n;
}

LAZYTENSOR_INLINE bool Sharding::replicated() const {
  for (std::size_t d = 0; d < dims.size(); ++d)
    if (parts(static_cast<int>(d)) > 1) return false;
  return true;
}

LAZYTENSOR_INLINE std::int64_t Sharding::part_of(int position, int d) const {
  const auto c = mesh.coordinates(position);
  std::int64_t idx = 0;
  for (int a : dims[static_cast<std::size_t>(d)])
    idx = idx * mesh.mesh_shape()[static_cast<std::size_t>(a)] + c[static_cast<std::size_t>(a)];
  return idx;
}

LAZYTENSOR_INLINE std::vector<std::pair<std::int64_t, std::int64_t>> Sharding::block(int position,
                                                                                      const Shape& global) const {
  check_rank(global, "Sharding::block");
  std::vector<std::pair<std::int64_t, std::int64_t>> r(static_cast<std::size_t>(global.rank()));
  for (int d = 0; d < global.rank(); ++d) {
    const std::int64_t n = parts(d), size = global[d] / n, i = part_of(position, d);
    r[static_cast<std::size_t>(d)] = {i * size, (i + 1) * size};
  }
  return r;
}

LAZYTENSOR_INLINE void Sharding::check_rank(const Shape& global, const char* who) const {
  if (global.rank() != static_cast<int>(dims.size())) {
    throw ShapeError(std::string(who) + ": the sharding has " + std::to_string(dims.size()) +
                     " dimensions, the shape " + global.str() + " has " +
                     std::to_string(global.rank()));
  }
}

LAZYTENSOR_INLINE Shape Sharding::block_shape(const Shape& global) const {
  check_rank(global, "Sharding::block_shape");
  Shape s = global;
  for (int d = 0; d < global.rank(); ++d) s[d] = global[d] / parts(d);
  return s;
}

LAZYTENSOR_INLINE std::string Sharding::str() const {
  if (replicated()) return "{replicated}";
  const int rank = static_cast<int>(dims.size());
  // Tile dimensions: the parts of each tensor dimension, then the replicas (mesh axes no
  // dimension uses) as a last tile dimension when there are several.
  std::vector<bool> used(static_cast<std::size_t>(mesh.rank()), false);
  for (const auto& axes : dims)
    for (int a : axes) used[static_cast<std::size_t>(a)] = true;
  std::int64_t replicas = 1;
  for (int a = 0; a < mesh.rank(); ++a)
    if (!used[static_cast<std::size_t>(a)]) replicas *= mesh.mesh_shape()[static_cast<std::size_t>(a)];
  std::vector<std::int64_t> tile;
  for (int d = 0; d < rank; ++d) tile.push_back(parts(d));
  if (replicas > 1) tile.push_back(replicas);
  std::int64_t tiles = 1;
  for (auto t : tile) tiles *= t;
  std::vector<int> order(static_cast<std::size_t>(tiles), -1);
  for (int p = 0; p < mesh.size(); ++p) {
    const auto c = mesh.coordinates(p);
    std::int64_t idx = 0;
    for (int d = 0; d < rank; ++d) idx = idx * parts(d) + part_of(p, d);
    if (replicas > 1) {
      std::int64_t r = 0;
      for (int a = 0; a < mesh.rank(); ++a)
        if (!used[static_cast<std::size_t>(a)]) r = r * mesh.mesh_shape()[static_cast<std::size_t>(a)] + c[static_cast<std::size_t>(a)];
      idx = idx * replicas + r;
    }
    order[static_cast<std::size_t>(idx)] = mesh.device_ids()[static_cast<std::size_t>(p)];
  }
  std::string s = "{devices=[";
  for (std::size_t i = 0; i < tile.size(); ++i) {
    if (i) s += ",";
    s += std::to_string(tile[i]);
  }
  s += "]";
  for (std::size_t i = 0; i < order.size(); ++i) {
    if (i) s += ",";
    s += std::to_string(order[i]);
  }
  if (replicas > 1) s += " last_tile_dim_replicate";
  return s + "}";
}

LAZYTENSOR_INLINE Sharding resolve_sharding(const Mesh& mesh, const PartitionSpec& spec, const Shape& shape) {
  const int rank = shape.rank();
  if (static_cast<int>(spec.size()) > rank)
    throw ShardingError("partition spec has " + std::to_string(spec.size()) + " entries, but the tensor of shape " +
                        detail::tuple_text(shape.vec()) + " has rank " + std::to_string(rank));
  Sharding s{mesh, std::vector<std::vector<int>>(static_cast<std::size_t>(rank))};
  std::vector<bool> used(static_cast<std::size_t>(mesh.rank()), false);
  auto axis_text = [&](int a) { return "\"" + mesh.axis_names()[static_cast<std::size_t>(a)] + "\""; };
  for (std::size_t d = 0; d < spec.size(); ++d) {
    for (const auto& ref : spec[d].axes()) {
      int a = -1;
      if (const int* i = std::get_if<int>(&ref.ref())) {
        if (*i < 0 || *i >= mesh.rank())
          throw ShardingError("partition spec entry " + std::to_string(d) + ": mesh axis " + std::to_string(*i) +
                              " out of range for a mesh of " + std::to_string(mesh.rank()) + " axes");
        a = *i;
      } else {
        const auto& name = std::get<std::string>(ref.ref());
        for (int k = 0; k < mesh.rank(); ++k)
          if (mesh.axis_names()[static_cast<std::size_t>(k)] == name) a = k;
        if (a < 0) {
          std::string names;
          for (int k = 0; k < mesh.rank(); ++k) {
            if (k) names += ", ";
            names += axis_text(k);
          }
          throw ShardingError("partition spec entry " + std::to_string(d) + ": the mesh has no axis named \"" + name +
                              "\" (its axes: " + names + ")");
        }
      }
      if (used[static_cast<std::size_t>(a)])
        throw ShardingError("mesh axis " + axis_text(a) + " is used twice in the partition spec");
      used[static_cast<std::size_t>(a)] = true;
      s.dims[d].push_back(a);
    }
    const std::int64_t n = s.parts(static_cast<int>(d));
    if (shape[static_cast<int>(d)] % n != 0) {
      std::string axes;
      for (std::size_t k = 0; k < s.dims[d].size(); ++k) {
        if (k) axes += ", ";
        axes += axis_text(s.dims[d][k]);
      }
      throw ShardingError("dimension " + std::to_string(d) + " of shape " + detail::tuple_text(shape.vec()) +
                          " must be divisible by " + std::to_string(n) + " (mesh " +
                          (s.dims[d].size() == 1 ? "axis " : "axes ") + axes + ")");
    }
  }
  return s;
}

}  // namespace lazy::spmd
#endif  // LAZYTENSOR_HEADER_DEFINITIONS
