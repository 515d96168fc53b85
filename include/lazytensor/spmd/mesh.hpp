#pragma once
// Meshes: the logical arrangement of devices that shardings name (torch_xla's Mesh and
// HybridMesh), and the process's global mesh.

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <lazytensor/core/config.hpp>
#include <lazytensor/core/error.hpp>
#include <lazytensor/spmd/span.hpp>
#include <lazytensor/tensor/device.hpp>

namespace lazy::spmd {

/// The device ids of a mesh arranged in its shape (what torch_xla's get_logical_mesh
/// returns as a numpy array): `device_ids` row-major in `shape`.
struct LogicalMesh {
  std::vector<std::int64_t> shape;
  std::vector<int> device_ids;
  /// The id at mesh coordinates `coords` (one per axis).
  int at(const std::vector<std::int64_t>& coords) const;
};

/// A logical n-d array of devices (torch_xla.distributed.spmd.Mesh). `device_ids` are laid
/// out row-major in `mesh_shape`; axes may be named (`axis_names`, one per axis, distinct),
/// else each is named by its index ("0", "1", ...). A partition spec refers to the axes by
/// index or name. Error (lazy::Error, naming the values) when the shape's product is not
/// the number of ids, an id repeats or names no device, or names repeat. When the program
/// spans processes (span.hpp) the ids are global: those of every process's devices.
class Mesh {
 public:
  Mesh(std::vector<int> device_ids, std::vector<std::int64_t> mesh_shape, std::vector<std::string> axis_names = {});

  /// The axes in order, as (name, size).
  std::vector<std::pair<std::string, std::int64_t>> shape() const;
  /// The ids in mesh order (row-major over the axes).
  const std::vector<int>& device_ids() const { return ids_; }
  /// The size of each axis.
  const std::vector<std::int64_t>& mesh_shape() const { return shape_; }
  /// Each axis's name (the index as text for unnamed axes).
  const std::vector<std::string>& axis_names() const { return names_; }
  /// The ids arranged in the mesh's shape.
  LogicalMesh get_logical_mesh() const { return {shape_, ids_}; }
  /// Number of devices.
  int size() const { return static_cast<int>(ids_.size()); }
  /// Number of axes.
  int rank() const { return static_cast<int>(shape_.size()); }

  /// The coordinates of the device at mesh position `position` (row-major).
  std::vector<std::int64_t> coordinates(int position) const;
  /// The mesh position of device `device_id`, or -1.
  int position_of(int device_id) const;
  /// Text such as `Mesh(shape=("data": 2, "model": 2), devices=[0, 1, 2, 3])`.
  std::string str() const;

  friend bool operator==(const Mesh& a, const Mesh& b) {
    return a.ids_ == b.ids_ && a.shape_ == b.shape_ && a.names_ == b.names_;
  }

 private:
  std::vector<int> ids_;
  std::vector<std::int64_t> shape_;
  std::vector<std::string> names_;
};

/// A mesh for devices grouped in slices (torch_xla's HybridMesh): the mesh's axis i has
/// size `dcn_mesh_shape[i] * ici_mesh_shape[i]`, the DCN part outer. Device ids follow
/// the slices: slice s (the row-major index of the DCN coordinates) holds ids
/// [s * S, (s + 1) * S), S the product of `ici_mesh_shape`, laid out row-major over the
/// ICI coordinates. Every device takes part; Error when the shapes' ranks differ or their
/// products do not make the device count. When the program spans processes, a slice is one
/// process: the DCN axes run across processes, the ICI axes inside one (Error unless the
/// ICI product is the devices per process).
class HybridMesh : public Mesh {
 public:
  HybridMesh(std::vector<std::int64_t> ici_mesh_shape, std::vector<std::int64_t> dcn_mesh_shape,
             std::vector<std::string> axis_names = {});
};

/// Sets the mesh that APIs taking no mesh use (torch_xla's set_global_mesh).
void set_global_mesh(const Mesh& mesh);
/// The global mesh, if one was set.
std::optional<Mesh> get_global_mesh();

namespace detail {
/// The device ids a HybridMesh lays out (see HybridMesh).
std::vector<int> hybrid_device_ids(const std::vector<std::int64_t>& ici, const std::vector<std::int64_t>& dcn);
/// The elementwise product of the two shapes.
std::vector<std::int64_t> hybrid_shape(const std::vector<std::int64_t>& ici, const std::vector<std::int64_t>& dcn);
/// "(6, 4)": a shape as JAX's messages print it.
std::string tuple_text(const std::vector<std::int64_t>& sizes);
}  // namespace detail

}  // namespace lazy::spmd

#if LAZYTENSOR_HEADER_DEFINITIONS
#include <algorithm>
#include <limits>
#include <mutex>
#include <set>

namespace lazy::spmd {

LAZYTENSOR_INLINE int LogicalMesh::at(const std::vector<std::int64_t>& coords) const {
  if (coords.size() != shape.size())
    throw Error("LogicalMesh::at: expected " + std::to_string(shape.size()) + " coordinates, got " +
                std::to_string(coords.size()));
  std::int64_t p = 0;
  for (std::size_t i = 0; i < shape.size(); ++i) {
    if (coords[i] < 0 || coords[i] >= shape[i])
      throw Error("LogicalMesh::at: coordinate " + std::to_string(coords[i]) + " out of range for axis " +
                  std::to_string(i) + " of size " + std::to_string(shape[i]));
    p = p * shape[i] + coords[i];
  }
  if (static_cast<std::size_t>(p) >= device_ids.size()) {
    throw Error("LogicalMesh::at: position " + std::to_string(p) + " of shape " +
                detail::tuple_text(shape) + " but only " + std::to_string(device_ids.size()) +
                " device ids");
  }
  return device_ids[static_cast<std::size_t>(p)];
}

LAZYTENSOR_INLINE std::string detail::tuple_text(const std::vector<std::int64_t>& sizes) {
  std::string s = "(";
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(sizes[i]);
  }
  if (sizes.size() == 1) s += ",";
  return s + ")";
}

LAZYTENSOR_INLINE Mesh::Mesh(std::vector<int> device_ids, std::vector<std::int64_t> mesh_shape,
                             std::vector<std::string> axis_names)
    : ids_(std::move(device_ids)), shape_(std::move(mesh_shape)), names_(std::move(axis_names)) {
  if (shape_.empty()) throw Error("Mesh: expected at least one mesh axis, got an empty mesh shape");
  std::int64_t product = 1;
  for (auto s : shape_) {
    if (s < 1) throw Error("Mesh: mesh shape " + detail::tuple_text(shape_) + " has a size below 1");
    // (No more devices than an int names: checked before the product can overflow.)
    if (s > std::numeric_limits<int>::max() / product) {
      throw Error("Mesh: mesh shape " + detail::tuple_text(shape_) +
                  " holds more devices than there can be (" + std::to_string(ids_.size()) +
                  " device ids were given)");
    }
    product *= s;
  }
  if (product != static_cast<std::int64_t>(ids_.size()))
    throw Error("Mesh: mesh shape " + detail::tuple_text(shape_) + " holds " + std::to_string(product) +
                " devices, but " + std::to_string(ids_.size()) + " device ids were given");
  const int available = detail::span_device_count();
  const bool spans = dist::detail::process_place().count > 1;
  std::set<int> seen;
  for (int id : ids_) {
    if (id < 0 || id >= available)
      throw Error("Mesh: device id " + std::to_string(id) + " names no device (" +
                  (spans ? "the processes have " : "this process has ") + std::to_string(available) + ": ids 0.." +
                  std::to_string(available - 1) + "; LAZYTENSOR_NUM_DEVICES sets the count per process)");
    if (!seen.insert(id).second) throw Error("Mesh: device id " + std::to_string(id) + " appears twice");
  }
  if (names_.empty()) {
    for (std::size_t i = 0; i < shape_.size(); ++i) names_.push_back(std::to_string(i));
  } else if (names_.size() != shape_.size()) {
    throw Error("Mesh: " + std::to_string(names_.size()) + " axis names given for a mesh of " +
                std::to_string(shape_.size()) + " axes " + detail::tuple_text(shape_));
  }
  std::set<std::string> names;
  for (const auto& n : names_)
    if (!names.insert(n).second) throw Error("Mesh: axis name \"" + n + "\" appears twice");
}

LAZYTENSOR_INLINE std::vector<std::pair<std::string, std::int64_t>> Mesh::shape() const {
  std::vector<std::pair<std::string, std::int64_t>> r;
  for (std::size_t i = 0; i < shape_.size(); ++i) r.emplace_back(names_[i], shape_[i]);
  return r;
}

LAZYTENSOR_INLINE std::vector<std::int64_t> Mesh::coordinates(int position) const {
  if (position < 0 || static_cast<std::size_t>(position) >= ids_.size()) {
    throw IndexError("Mesh::coordinates: position " + std::to_string(position) +
                     " out of range for a mesh of " + std::to_string(ids_.size()) + " devices");
  }
  std::vector<std::int64_t> c(shape_.size());
  std::int64_t p = position;
  for (std::size_t i = shape_.size(); i-- > 0;) {
    c[i] = p % shape_[i];
    p /= shape_[i];
  }
  return c;
}

LAZYTENSOR_INLINE int Mesh::position_of(int device_id) const {
  auto it = std::find(ids_.begin(), ids_.end(), device_id);
  return it == ids_.end() ? -1 : static_cast<int>(it - ids_.begin());
}

LAZYTENSOR_INLINE std::string Mesh::str() const {
  std::string s = "Mesh(shape=(";
  for (std::size_t i = 0; i < shape_.size(); ++i) {
    if (i) s += ", ";
    s += "\"" + names_[i] + "\": " + std::to_string(shape_[i]);
  }
  s += "), devices=[";
  for (std::size_t i = 0; i < ids_.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(ids_[i]);
  }
  return s + "])";
}

LAZYTENSOR_INLINE std::vector<std::int64_t> detail::hybrid_shape(const std::vector<std::int64_t>& ici,
                                                                  const std::vector<std::int64_t>& dcn) {
  if (ici.size() != dcn.size())
    throw Error("HybridMesh: ici_mesh_shape " + tuple_text(ici) + " and dcn_mesh_shape " + tuple_text(dcn) +
                " must have the same number of axes");
  std::vector<std::int64_t> s(ici.size());
  for (std::size_t i = 0; i < ici.size(); ++i) {
    if (ici[i] < 1 || dcn[i] < 1)
      throw Error("HybridMesh: sizes must be at least 1, got ici " + tuple_text(ici) + ", dcn " + tuple_text(dcn));
    if (ici[i] > std::numeric_limits<int>::max() / dcn[i])
      throw Error("HybridMesh: ici " + tuple_text(ici) + " times dcn " + tuple_text(dcn) +
                  " overflows");
    s[i] = ici[i] * dcn[i];
  }
  return s;
}

LAZYTENSOR_INLINE std::vector<int> detail::hybrid_device_ids(const std::vector<std::int64_t>& ici,
                                                            const std::vector<std::int64_t>& dcn) {
  const auto shape = hybrid_shape(ici, dcn);
  std::int64_t total = 1, per_slice = 1;
  for (auto s : shape) total *= s;
  for (auto s : ici) per_slice *= s;
  const int processes = dist::detail::process_place().count;
  if (total != span_device_count())
    throw Error("HybridMesh: ici " + tuple_text(ici) + " times dcn " + tuple_text(dcn) + " makes " +
                std::to_string(total) + " devices, but " +
                (processes > 1 ? "the processes have " : "this process has ") + std::to_string(span_device_count()));
  if (processes > 1 && per_slice != device_count())
    throw Error("HybridMesh: the ICI axes " + tuple_text(ici) + " hold " + std::to_string(per_slice) +
                " devices, but each of the " + std::to_string(processes) + " processes has " +
                std::to_string(device_count()) + " (a slice is one process: its devices on the ICI axes, the "
                "processes on the DCN axes)");
  std::vector<int> ids(static_cast<std::size_t>(total));
  const std::size_t rank = shape.size();
  std::vector<std::int64_t> c(rank, 0);
  for (std::int64_t p = 0; p < total; ++p) {
    // Mesh coordinate c[i] = dcn coordinate * ici[i] + ici coordinate.
    std::int64_t slice = 0, within = 0;
    for (std::size_t i = 0; i < rank; ++i) {
      slice = slice * dcn[i] + c[i] / ici[i];
      within = within * ici[i] + c[i] % ici[i];
    }
    ids[static_cast<std::size_t>(p)] = static_cast<int>(slice * per_slice + within);
    for (std::size_t i = rank; i-- > 0;) {
      if (++c[i] < shape[i]) break;
      c[i] = 0;
    }
  }
  return ids;
}

LAZYTENSOR_INLINE HybridMesh::HybridMesh(std::vector<std::int64_t> ici_mesh_shape, std::vector<std::int64_t> dcn_mesh_shape,
                                         std::vector<std::string> axis_names)
    : Mesh(detail::hybrid_device_ids(ici_mesh_shape, dcn_mesh_shape), detail::hybrid_shape(ici_mesh_shape, dcn_mesh_shape),
           std::move(axis_names)) {}

namespace detail {
struct GlobalMesh {
  std::mutex mu;
  std::optional<Mesh> mesh;
};
inline GlobalMesh& global_mesh() {
  static GlobalMesh g;
  return g;
}
}  // namespace detail

LAZYTENSOR_INLINE void set_global_mesh(const Mesh& mesh) {
  auto& g = detail::global_mesh();
  std::lock_guard lock(g.mu);
  g.mesh = mesh;
}

LAZYTENSOR_INLINE std::optional<Mesh> get_global_mesh() {
  auto& g = detail::global_mesh();
  std::lock_guard lock(g.mu);
  return g.mesh;
}

}  // namespace lazy::spmd
#endif  // LAZYTENSOR_HEADER_DEFINITIONS
