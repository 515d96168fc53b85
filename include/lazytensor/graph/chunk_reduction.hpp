#pragma once
// The face a reduction shows to a fused element-wise group it ends: the group computes its
// child chunk by chunk and hands each chunk to the reduction, which keeps one partial
// result per chunk and combines them at the end.
//
// Only reductions of every element to one value take part: their blocks (kReduceBlock)
// are the group's chunks (kFusionChunk), both cut at the same multiples from element 0,
// so a fused reduction adds exactly the same numbers in the same order as an unfused one
// (bitwise-identical results, whatever the fusion or the thread count).

#include <cstddef>
#include <cstdint>

namespace lazy::graph {

struct ExecContext;

/// Leaf size of a reduction's pairwise tree, and so the chunk of fused groups (plan.hpp's
/// kFusionChunk is this value): one chunk is one block, reduced by one block's loop.
inline constexpr std::int64_t kReduceBlock = 4096;

/// Implemented by reduction nodes that can end a fused group (see the file comment).
class ChunkReduction {
 public:
  virtual ~ChunkReduction() = default;
  /// True when every element of the child is reduced to one value: only then can the
  /// node end a group.
  virtual bool reduces_all() const = 0;
  /// Bytes of one partial result.
  virtual std::size_t partial_bytes() const = 0;
  /// Reduces `len` (<= kReduceBlock: one chunk) elements whose inputs start at `inputs` (an input of
  /// one element broadcast to all: its only element) into `partial`.
  virtual void reduce_chunk(const void* const* inputs, std::int64_t len, void* partial) const = 0;
  /// Combines `count` partials (in chunk order) into the node's value and finishes it;
  /// the partials may be overwritten.
  virtual void finish_partials(ExecContext& ctx, void* partials, std::int64_t count) = 0;
};

}  // namespace lazy::graph
