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
#include <atomic>
#include <chrono>
#include <cstdio>
#include <exception>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include <lazytensor/core/config.hpp>
#include <lazytensor/dist/host_collectives.hpp>
#include <lazytensor/dist/runtime.hpp>
#include <lazytensor/graph/executor.hpp>
#include <lazytensor/io/safetensors.hpp>
#include <lazytensor/io/shard_index.hpp>
#include <lazytensor/spmd/sharded_node.hpp>

namespace lazy::io {

namespace detail {

/// Runs every pending tensor of `sd`, one execution per device.
void materialize_all(const StateDict& sd);

/// Calls f(t, name, piece, device id, block) for each block a shard-files save writes (t:
/// the tensor's position in `sd`): every
/// distinct block of a sharded tensor once, from the first mesh position holding it (its
/// replicas write nothing), and a whole tensor from its device. Hands out pending pieces.
template <class F>
void for_each_block(const StateDict& sd, F&& f);

/// Writes `sd` as shard files plus the index at `path` (SaveOptions::shard_files).
void save_shards(const StateDict& sd, const std::string& path);

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
///  - An SPMD program spanning processes (lazy::spmd under mpirun) plays the world: every
///    process gathers and calls it, one per host writes (process 0 with `global_master`),
///    and all meet after the write. IoError for `shard_files` there.
/// Outside spawn it just writes.
void save(const StateDict& sd, const std::string& path, bool master_only = true,
          bool global_master = false);

/// How io::save writes: xm.save's two choices, and the shard files of lazy::spmd.
struct SaveOptions {
  /// Only the master replica writes (see save above).
  bool master_only = true;
  /// With master_only: global ordinal 0 only, not one writer per host.
  bool global_master = false;
  /// Sharded tensors (lazy::spmd) as one safetensors file per device holding that device's
  /// blocks (each distinct block once), with `path` the JSON index naming them
  /// (shard_index.hpp), instead of whole tensors in one file: nothing is gathered. The
  /// shard files (named with a token of this save) are written first, the index last, each
  /// atomically, and then the files of the save it replaced are removed: an index always
  /// names complete files of one save. io::load reads the index as whole tensors.
  bool shard_files = false;
};

/// save with options: `io::save(sd, "ckpt/model.json", {.shard_files = true})`.
void save(const StateDict& sd, const std::string& path, const SaveOptions& options);

#if LAZYTENSOR_HEADER_DEFINITIONS
namespace detail {

LAZYTENSOR_INLINE void materialize_all(const StateDict& sd) {
  std::vector<std::pair<graph::Device*, graph::NodeList>> pending;
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

template <class F>
void for_each_block(const StateDict& sd, F&& f) {
  std::size_t position = 0;
  for (const auto& [name, t] : sd) {
    const std::size_t at = position++;
    if (!t.defined()) throw Error("io::save: tensor '" + name + "' is undefined");
    const graph::NodePtr& node = t.impl()->node;
    const spmd::ShardedNode* s = spmd::as_sharded(node);
    if (!s) {
      std::vector<std::pair<std::int64_t, std::int64_t>> whole;
      for (auto d : node->shape()) whole.emplace_back(0, d);
      f(at, name, node, node->device()->index(), whole);
      continue;
    }
    s->hand_out_pieces();
    std::set<std::vector<std::pair<std::int64_t, std::int64_t>>> seen;
    for (int p = 0; p < s->num_shards(); ++p) {
      auto block = s->sharding().block(p, node->shape());
      if (seen.insert(block).second)
        f(at, name, s->shard(p), s->sharding().mesh.device_ids()[static_cast<std::size_t>(p)], block);
    }
  }
}

LAZYTENSOR_INLINE void save_shards(const StateDict& sd, const std::string& path) {
  // The files of the save this one replaces, removed once the new index is in place.
  std::vector<std::string> previous;
  try {
    previous = read_shard_index(path).files;
  } catch (const Error&) {  // no index there yet, or not one: nothing to replace
  }
  // This save's token: its shard files never take the names of the previous save's.
  static std::atomic<std::uint64_t> saves{0};
  char token[40];
  std::snprintf(token, sizeof token, "%llx%02llx",
                static_cast<unsigned long long>(std::chrono::system_clock::now().time_since_epoch().count()),
                static_cast<unsigned long long>(saves.fetch_add(1) & 0xff));
  std::map<int, StateDict> files;  // by device id
  ShardIndex index;
  for (const auto& [name, t] : sd) {
    if (!t.defined()) throw Error("io::save: tensor '" + name + "' is undefined");
    ShardedEntry e{name, dtype_name(t.dtype()), {t.shape().begin(), t.shape().end()}, {}, {}};
    if (const spmd::ShardedNode* s = spmd::as_sharded(t.impl()->node)) e.sharding = s->sharding().str();
    index.tensors.push_back(std::move(e));
  }
  for_each_block(sd, [&](std::size_t tensor, const std::string& name, const graph::NodePtr& piece, int device,
                         const auto& block) {
    StateDict& file = files[device];
    file.insert(name, lazy::detail::any_of_node(piece));
    if (auto it = sd.stored_dtypes().find(name); it != sd.stored_dtypes().end()) file.stored_dtypes()[name] = it->second;
    // `file` holds the device id until the files are numbered below.
    index.tensors[tensor].blocks.push_back(ShardBlock{static_cast<std::size_t>(device), block});
  });
  const std::string dir = parent_dir(path) + "/";
  std::map<int, std::size_t> position;
  for (const auto& [device, file] : files) {
    const std::size_t k = position.size();
    position[device] = k;
    index.files.push_back(shard_file_name(path, token, k, files.size()));
    save_file(file, dir + index.files.back());
  }
  for (auto& e : index.tensors)
    for (auto& b : e.blocks) b.file = position.at(static_cast<int>(b.file));
  index.metadata = sd.metadata();
  const std::string text = shard_index_json(index);
  AtomicFileWriter out(path);
  out.write(text.data(), text.size());
  out.commit();
  for (const std::string& f : previous)
    if (std::find(index.files.begin(), index.files.end(), f) == index.files.end()) std::remove((dir + f).c_str());
}

}  // namespace detail

LAZYTENSOR_INLINE void save(const StateDict& sd, const std::string& path, bool master_only,
                            bool global_master) {
  save(sd, path, SaveOptions{.master_only = master_only, .global_master = global_master});
}

LAZYTENSOR_INLINE void save(const StateDict& sd, const std::string& path, const SaveOptions& options) {
  bool writer = !options.master_only || dist::is_master_ordinal(!options.global_master);
  // An SPMD program spanning processes (spmd/span.hpp): every process gathers (collective),
  // one per host writes (process 0 only with global_master), and all meet afterwards.
  const auto& span = spmd::detail::process_span();
  if (span.count > 1) {
    if (options.shard_files)
      throw IoError("io::save('" + path + "'): shard_files is not supported when an SPMD program spans " +
                    std::to_string(span.count) + " processes (each holds only its own pieces); save whole values");
    if (options.master_only) {
      const auto place = dist::detail::process_place();
      writer = options.global_master ? place.index == 0 : place.host_index == 0;
    }
  }
  std::exception_ptr error;
  try {
    if (!options.shard_files) {
      detail::materialize_all(sd);
      if (writer) save_file(sd, path);
    } else if (writer) {
      detail::save_shards(sd, path);
    } else {  // the same sync as a writer's, without the gathers
      detail::for_each_block(sd, [](std::size_t, const std::string&, const graph::NodePtr& piece, int, const auto&) {
        graph::materialize(piece);
      });
    }
  } catch (...) {
    error = std::current_exception();
  }
  if (span.count > 1) {
    const auto ok = spmd::detail::span_rendezvous(!error, "io::save('" + path + "')");
    if (error) std::rethrow_exception(error);
    for (std::size_t q = 0; q < ok.size(); ++q)
      if (!ok[q]) throw IoError("io::save('" + path + "'): process " + std::to_string(q) + " failed to save");
    return;
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
