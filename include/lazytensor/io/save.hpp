#pragma once
// io::save: saving a state dict from a replicated program, as torch_xla's xm.save.
//
// Every replica calls it with its own state dict. Each one first materializes the pending
// tensors of its state dict (one execution per device: a sync, as xm.save's transfer to the
// CPU is), then the writer(s) write, then all replicas meet in a rendezvous: when save
// returns on any replica the file is complete (renamed into place and fsynced), so another
// replica may read it at once. A failure on one replica is reported on all of them, after the
// rendezvous (nobody is left waiting for a replica that failed): the failing replica
// re-throws its own error, the others throw IoError naming it.

#include <algorithm>
#include <exception>
#include <string>
#include <utility>
#include <vector>

#include <lazytensor/core/config.hpp>
#include <lazytensor/dist/host_collectives.hpp>
#include <lazytensor/dist/runtime.hpp>
#include <lazytensor/graph/executor.hpp>
#include <lazytensor/io/safetensors.hpp>

namespace lazy::io {

namespace detail {

/// Runs every pending tensor of `sd`, one execution per device.
void materialize_all(const StateDict& sd);


}  // namespace detail

/// Saves `sd` to `path` as a safetensors file (see save_file), as xm.save(data, path,
/// master_only, global_master):
///  - `master_only` (default): only the master replica writes: the local master (local
///    ordinal 0, one per host) or, with `global_master`, global ordinal 0 only. Otherwise
///    every replica writes (give each its own path; replicas writing one path replace the
///    file atomically in turn, the last rename wins).
///  - Every replica materializes the pending tensors of `sd` first (a sync), then all
///    replicas rendezvous after the write: the file is complete when save returns on any of
///    them (see the file comment for failures). Every replica must call it (it is a
///    collective of the whole world).
/// Outside spawn it just writes.
void save(const StateDict& sd, const std::string& path, bool master_only = true,
          bool global_master = false);

#if LAZYTENSOR_HEADER_DEFINITIONS
namespace detail {

LAZYTENSOR_INLINE void materialize_all(const StateDict& sd) {
  std::vector<std::pair<graph::Device*, std::vector<graph::NodePtr>>> pending;
  for (const auto& [name, t] : sd) {
    if (!t.defined() || t.impl()->node->materialized()) continue;
    const graph::NodePtr& node = t.impl()->node;
    auto it = std::find_if(pending.begin(), pending.end(),
                           [&](const auto& p) { return p.first == node->device(); });
    if (it == pending.end()) it = pending.insert(pending.end(), {node->device(), {}});
    it->second.push_back(node);
  }
  for (auto& [dev, nodes] : pending) {
    dev->rethrow_stored_error();
    graph::execute(*dev, nodes);
  }
}

}  // namespace detail

LAZYTENSOR_INLINE void save(const StateDict& sd, const std::string& path, bool master_only,
                            bool global_master) {
  const bool writer = !master_only || dist::is_master_ordinal(!global_master);
  std::exception_ptr error;
  try {
    detail::materialize_all(sd);
    if (writer) save_file(sd, path);
  } catch (...) {
    error = std::current_exception();
  }
  if (runtime::world_size() == 1) {
    if (error) std::rethrow_exception(error);
    return;
  }
  // Every replica reaches the rendezvous, failed or not; each says how it went ("" = ok).
  const std::string mine = error ? "!" + lazy::detail::exception_message(error) : std::string();
  const std::vector<std::string> all = dist::rendezvous("lazy::io::save", mine);
  if (error) std::rethrow_exception(error);
  for (std::size_t q = 0; q < all.size(); ++q) {
    if (!all[q].empty()) {
      throw IoError("io::save('" + path + "'): replica " + std::to_string(q) +
                    " failed: " + all[q].substr(1));
    }
  }
}
#endif  // LAZYTENSOR_HEADER_DEFINITIONS

}  // namespace lazy::io
