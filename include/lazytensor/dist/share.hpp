#pragma once
// What one member of a replica group shares in one round of its exchange: its signature and
// where its data is. Inside a process the members read each other's shares directly; across
// processes (MPI) a process's shares travel as one package and are rebuilt on the other
// side, so the exchange kernels read a remote member exactly as a local one.

#include <algorithm>
#include <cstddef>
#include <memory>
#include <vector>

#include <lazytensor/core/buffer.hpp>
#include <lazytensor/core/config.hpp>
#include <lazytensor/dist/signature.hpp>

namespace lazy::dist::detail {

/// Messages up to this many bytes per member are copied into the slot (one synchronization);
/// larger ones are read in place from the members' buffers (two synchronizations).
inline constexpr std::size_t kInlineBytes = std::size_t{16} << 10;

/// Rounds `n` up to a multiple of 64 (offsets inside a slot's staging area).
constexpr std::size_t align64(std::size_t n) { return (n + 63) / 64 * 64; }

/// What one member shares in one round.
struct Share {
  Signature sig;
  std::vector<const std::byte*> data;            ///< per tensor or payload: where its bytes are
  std::vector<std::size_t> bytes;                ///< size of each data entry
  std::vector<std::shared_ptr<Buffer>> buffers;  ///< shared outputs, broadcast source
  /// Buffers that hold `data` (tensor inputs): another process may be sent them straight
  /// from there; entries without one are copied into the package first.
  std::vector<std::shared_ptr<Buffer>> keep;
  std::vector<std::byte> staging;  ///< copies of small messages; a remote member's data

  /// A staging area of at least `n` bytes (allocated once, then reused).
  std::byte* stage(std::size_t n);
};

}  // namespace lazy::dist::detail

#if LAZYTENSOR_HEADER_DEFINITIONS
namespace lazy::dist::detail {
LAZYTENSOR_INLINE std::byte* Share::stage(std::size_t n) {
  if (staging.size() < n) staging.resize(std::max(n, kInlineBytes));
  return staging.data();
}
}  // namespace lazy::dist::detail
#endif  // LAZYTENSOR_HEADER_DEFINITIONS
