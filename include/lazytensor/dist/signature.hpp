#pragma once
// Replica groups and collective signatures.
//
// Groups: a list of equal-size lists of replica ordinals that partitions the world (every
// replica exactly once), as torch_xla's `groups`; empty means one group of everyone. The
// order inside a group is the data order (all_gather concatenates in it, reductions combine
// in it).
//
// Signature: what a replica says it is doing at a given sequence number of its group. Every
// participant compares all of them before touching any data; a difference is a
// CollectiveMismatch on every participant. It also carries the replica's own count of its
// collectives (as torch_xla's, every replica takes part in every collective over a groups
// partition): replicas that passed different partitions, or that skipped a collective of a
// group they are not in together, would otherwise meet a later round of the wrong call, or
// wait for a partner that went elsewhere until the timeout.

#include <bit>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <lazytensor/core/config.hpp>
#include <lazytensor/core/dtype.hpp>
#include <lazytensor/core/error.hpp>
#include <lazytensor/core/shape.hpp>
#include <lazytensor/dist/reduce_op.hpp>

namespace lazy::dist {

/// Replica groups, as torch_xla's `groups=[[0, 1], [2, 3]]`.
using Groups = std::vector<std::vector<int>>;

namespace detail {

/// "[0, 1, 2]".
std::string list_str(const std::vector<int>& v);

std::string groups_str(const Groups& g);

/// The group of `ordinal` in `groups` (validated: a partition of [0, world) into lists of
/// equal size). Throws CollectiveError naming the problem.
std::vector<int> resolve_group(const Groups& groups, int world, int ordinal, const char* op);

/// What a collective is.
enum class CollectiveKind : std::uint8_t {
  AllReduce,
  AllGather,
  ReduceScatter,
  AllToAll,
  Broadcast,
  Barrier,
  Rendezvous,
  MeshReduce,
  BroadcastObject
};

const char* kind_name(CollectiveKind k);

/// Everything replicas must agree on for one collective (data sizes of host-side payloads
/// excepted: those may differ).
struct Signature {
  CollectiveKind kind = CollectiveKind::Barrier;
  ReduceOp op = ReduceOp::Sum;         ///< reductions only
  DType dtype = DType::Float32;        ///< tensor collectives only
  int tensors = 0;                     ///< number of tensors (coalesced all_reduce: several)
  Shape shape;                         ///< the first tensor's shape
  std::uint64_t shapes_hash = 0;       ///< every tensor's shape
  std::int64_t params[3] = {0, 0, 0};  ///< dim, scatter/split/concat dims and counts, src
  double scale = 1.0;
  std::shared_ptr<const std::vector<int>> group;  ///< this replica's group, in data order
  std::string tag;                                ///< host collectives: name, tag or value type
  /// This replica's count of its collectives over a groups partition, this one included
  /// (1, 2, ...); 0 for a rendezvous among chosen replicas, which the others do not join.
  std::uint64_t world_seq = 0;

  friend bool operator==(const Signature& a, const Signature& b) {
    return a.kind == b.kind && a.op == b.op && a.dtype == b.dtype && a.tensors == b.tensors &&
           a.shape == b.shape && a.shapes_hash == b.shapes_hash && a.params[0] == b.params[0] &&
           a.params[1] == b.params[1] && a.params[2] == b.params[2] &&
           std::bit_cast<std::uint64_t>(a.scale) == std::bit_cast<std::uint64_t>(b.scale) &&
           a.tag == b.tag && a.world_seq == b.world_seq &&
           (a.group == b.group || (a.group && b.group && *a.group == *b.group));
  }

  /// "all_reduce(op=sum, dtype=float32, shape=(4,), scale=1, group=[0, 1], the replica's
  /// collective #3)".
  std::string str() const;
};

/// Hash of a list of shapes (order-sensitive), built one shape at a time.
class ShapesHash {
 public:
  void add(const Shape& s) {
    mix(static_cast<std::uint64_t>(s.rank()) + 0x100);
    for (auto d : s) mix(static_cast<std::uint64_t>(d));
  }
  std::uint64_t value() const { return h_; }

 private:
  void mix(std::uint64_t v) { h_ = (h_ ^ v) * 1099511628211ull; }
  std::uint64_t h_ = 1469598103934665603ull;
};

}  // namespace detail
}  // namespace lazy::dist

#if LAZYTENSOR_HEADER_DEFINITIONS
namespace lazy::dist::detail {
LAZYTENSOR_INLINE std::string list_str(const std::vector<int>& v) {
  std::string s = "[";
  for (std::size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s + "]";
}

LAZYTENSOR_INLINE std::string groups_str(const Groups& g) {
  std::string s = "[";
  for (std::size_t i = 0; i < g.size(); ++i) s += (i ? ", " : "") + list_str(g[i]);
  return s + "]";
}

LAZYTENSOR_INLINE std::vector<int> resolve_group(const Groups& groups, int world, int ordinal,
                                                 const char* op) {
  if (groups.empty()) {
    std::vector<int> all(static_cast<std::size_t>(world));
    for (int i = 0; i < world; ++i) all[static_cast<std::size_t>(i)] = i;
    return all;
  }
  const std::string where = std::string(op) + ": invalid groups " + groups_str(groups) +
                            " for a world of " + std::to_string(world) + " replica(s): ";
  std::vector<int> seen(static_cast<std::size_t>(world), 0);
  const std::size_t size = groups.front().size();
  const std::vector<int>* mine = nullptr;
  for (const auto& g : groups) {
    if (g.empty()) throw CollectiveError(where + "a group is empty");
    if (g.size() != size) {
      throw CollectiveError(where + "groups must have equal sizes, found " + std::to_string(size) +
                            " and " + std::to_string(g.size()));
    }
    for (int r : g) {
      if (r < 0 || r >= world) {
        throw CollectiveError(where + "replica " + std::to_string(r) + " is out of range [0, " +
                              std::to_string(world) + ")");
      }
      if (seen[static_cast<std::size_t>(r)]++) {
        throw CollectiveError(where + "replica " + std::to_string(r) + " appears more than once");
      }
      if (r == ordinal) mine = &g;
    }
  }
  for (int r = 0; r < world; ++r) {
    if (!seen[static_cast<std::size_t>(r)]) {
      throw CollectiveError(where + "replica " + std::to_string(r) +
                            " is in no group (groups must cover every replica)");
    }
  }
  return *mine;
}

LAZYTENSOR_INLINE const char* kind_name(CollectiveKind k) {
  switch (k) {
    case CollectiveKind::AllReduce:
      return "all_reduce";
    case CollectiveKind::AllGather:
      return "all_gather";
    case CollectiveKind::ReduceScatter:
      return "reduce_scatter";
    case CollectiveKind::AllToAll:
      return "all_to_all";
    case CollectiveKind::Broadcast:
      return "broadcast";
    case CollectiveKind::Barrier:
      return "barrier";
    case CollectiveKind::Rendezvous:
      return "rendezvous";
    case CollectiveKind::MeshReduce:
      return "mesh_reduce";
    case CollectiveKind::BroadcastObject:
      return "broadcast_object";
  }
  return "?";
}

LAZYTENSOR_INLINE std::string Signature::str() const {
  std::string s = std::string(kind_name(kind)) + "(";
  auto num = [](double v) {
    std::string t = std::to_string(v);
    t.erase(t.find_last_not_of('0') + 1);
    if (!t.empty() && t.back() == '.') t.pop_back();
    return t;
  };
  switch (kind) {
    case CollectiveKind::AllReduce:
    case CollectiveKind::ReduceScatter:
      s += "op=" + reduce_op_name(op) + ", ";
      break;
    default:
      break;
  }
  if (tensors > 0) {
    s += "dtype=" + dtype_name(dtype) + ", ";
    s += tensors == 1 ? "shape=" + shape.str()
                      : std::to_string(tensors) + " tensors, first shape=" + shape.str();
    s += ", ";
  }
  switch (kind) {
    case CollectiveKind::AllReduce:
      s += "scale=" + num(scale) + ", ";
      break;
    case CollectiveKind::AllGather:
      s += "dim=" + std::to_string(params[0]) + ", ";
      break;
    case CollectiveKind::ReduceScatter:
      s += "scale=" + num(scale) + ", scatter_dim=" + std::to_string(params[0]) +
           ", shard_count=" + std::to_string(params[1]) + ", ";
      break;
    case CollectiveKind::AllToAll:
      s += "split_dimension=" + std::to_string(params[0]) +
           ", concat_dimension=" + std::to_string(params[1]) +
           ", split_count=" + std::to_string(params[2]) + ", ";
      break;
    case CollectiveKind::Broadcast:
    case CollectiveKind::BroadcastObject:
      s += "src=" + std::to_string(params[0]) + ", ";
      break;
    default:
      break;
  }
  if (!tag.empty()) s += "'" + tag + "', ";
  s += "group=" + (group ? list_str(*group) : std::string("[]"));
  if (world_seq) s += ", the replica's collective #" + std::to_string(world_seq);
  return s + ")";
}

}  // namespace lazy::dist::detail
#endif  // LAZYTENSOR_HEADER_DEFINITIONS
