#pragma once
// The index of a state dict saved in shards (io::save with SaveOptions::shard_files): a
// JSON file naming the shard files beside it (ordinary safetensors files, one per device)
// and, for every tensor, its dtype, shape, sharding and the block each file holds, e.g.
//
//   {"format": "lazytensor.sharded_state_dict", "version": 1,
//    "files": ["model.shard-0-of-2.safetensors", "model.shard-1-of-2.safetensors"],
//    "metadata": {"epoch": "3"},
//    "tensors": [{"name": "w", "dtype": "float32", "shape": [8, 4],
//                 "sharding": "{devices=[2,1]0,1}",
//                 "blocks": [{"file": 0, "index": [[0, 4], [0, 4]]},
//                            {"file": 1, "index": [[4, 8], [0, 4]]}]}]}
//
// A shard file holds each tensor's block under the tensor's name, so any safetensors reader
// can read one. Shard file names carry a token of the save that wrote them, so a save that
// dies half-way never leaves the previous index naming a mix of two saves' files. io::load
// recognizes an index by its first 8 bytes and assembles whole tensors, reading one shard
// file at a time; mark_sharding then puts them in any sharding.

#include <cstddef>
#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <lazytensor/core/config.hpp>
#include <lazytensor/graph/byte_copy.hpp>
#include <lazytensor/io/file.hpp>
#include <lazytensor/io/json.hpp>
#include <lazytensor/any_tensor.hpp>
#include <lazytensor/state_dict.hpp>

namespace lazy::io::detail {

/// The value of "format" in an index.
inline constexpr std::string_view kShardIndexFormat = "lazytensor.sharded_state_dict";

/// One block of a tensor: the shard file holding it (a position in ShardIndex::files) and
/// the [begin, end) range of each dimension.
struct ShardBlock {
  std::size_t file = 0;
  std::vector<std::pair<std::int64_t, std::int64_t>> index;
};

/// A tensor of the index.
struct ShardedEntry {
  std::string name;
  std::string dtype;  ///< dtype_name()
  std::vector<std::int64_t> shape;
  std::string sharding;  ///< XLA's text, for people reading the file ("" when whole)
  std::vector<ShardBlock> blocks;
};

struct ShardIndex {
  std::vector<std::string> files;  ///< names relative to the index's directory
  std::map<std::string, std::string> metadata;
  std::vector<ShardedEntry> tensors;
};

/// The name of shard file `k` of `n` of the save `token` beside the index at `path` (its
/// directory left out): the index's name without a ".json" suffix, then
/// ".<token>.shard-<k>-of-<n>.safetensors".
std::string shard_file_name(const std::string& path, const std::string& token, std::size_t k, std::size_t n);

/// The index as JSON text.
std::string shard_index_json(const ShardIndex& index);

/// Parses an index (FormatError naming `path` on anything else) and checks that every
/// tensor's blocks lie inside its shape, name a listed file, and cover it exactly once.
ShardIndex parse_shard_index(std::string_view text, const std::string& path);

/// Reads and parses the index at `path` (parse_shard_index).
ShardIndex read_shard_index(const std::string& path);

/// Reads the index at `path` and assembles each tensor on `dev` from its blocks, reading
/// the shard files one at a time with `load_file` (io::load of a single safetensors file).
StateDict load_shard_index(const std::string& path, Device dev, StateDict (*load_file)(const std::string&, Device));

}  // namespace lazy::io::detail

#if LAZYTENSOR_HEADER_DEFINITIONS
namespace lazy::io::detail {

LAZYTENSOR_INLINE std::string shard_file_name(const std::string& path, const std::string& token, std::size_t k,
                                              std::size_t n) {
  std::string base = path.substr(path.find_last_of('/') == std::string::npos ? 0 : path.find_last_of('/') + 1);
  if (base.size() > 5 && base.compare(base.size() - 5, 5, ".json") == 0) base.resize(base.size() - 5);
  return base + "." + token + ".shard-" + std::to_string(k) + "-of-" + std::to_string(n) + ".safetensors";
}

LAZYTENSOR_INLINE std::string shard_index_json(const ShardIndex& index) {
  std::string out = "{\"format\": ";
  append_json_string(out, kShardIndexFormat);
  out += ", \"version\": 1,\n \"files\": [";
  for (std::size_t k = 0; k < index.files.size(); ++k) {
    if (k) out += ", ";
    append_json_string(out, index.files[k]);
  }
  out += "],\n \"metadata\": {";
  bool first = true;
  for (const auto& [key, value] : index.metadata) {
    if (!first) out += ", ";
    first = false;
    append_json_string(out, key);
    out += ": ";
    append_json_string(out, value);
  }
  out += "},\n \"tensors\": [";
  for (std::size_t t = 0; t < index.tensors.size(); ++t) {
    const ShardedEntry& e = index.tensors[t];
    out += t ? ",\n  {\"name\": " : "\n  {\"name\": ";
    append_json_string(out, e.name);
    out += ", \"dtype\": ";
    append_json_string(out, e.dtype);
    out += ", \"shape\": [";
    for (std::size_t d = 0; d < e.shape.size(); ++d) out += (d ? ", " : "") + std::to_string(e.shape[d]);
    out += "], \"sharding\": ";
    append_json_string(out, e.sharding);
    out += ", \"blocks\": [";
    for (std::size_t b = 0; b < e.blocks.size(); ++b) {
      out += (b ? ", " : "") + std::string("{\"file\": ") + std::to_string(e.blocks[b].file) + ", \"index\": [";
      for (std::size_t d = 0; d < e.blocks[b].index.size(); ++d) {
        const auto& [lo, hi] = e.blocks[b].index[d];
        out += (d ? ", [" : "[") + std::to_string(lo) + ", " + std::to_string(hi) + "]";
      }
      out += "]}";
    }
    out += "]}";
  }
  out += "]}\n";
  return out;
}

namespace shard_index {

// Calls `f(key)` for each key of the object at `cur`, positioned on its value.
template <class F>
void each_key(JsonCursor& cur, F&& f) {
  cur.expect('{');
  if (cur.accept('}')) return;
  do {
    const std::string key = cur.string();
    cur.expect(':');
    f(key);
  } while (cur.accept(','));
  cur.expect('}');
}

// Calls `f()` for each element of the array at `cur`, positioned on it.
template <class F>
void each_element(JsonCursor& cur, F&& f) {
  cur.expect('[');
  if (cur.accept(']')) return;
  do f();
  while (cur.accept(','));
  cur.expect(']');
}

inline DType dtype_named(const std::string& name, const std::string& who) {
  for (DType d : {DType::Bool, DType::Int32, DType::Int64, DType::BFloat16, DType::Float32, DType::Float64})
    if (dtype_name(d) == name) return d;
  throw FormatError(who + ": unknown dtype \"" + name + "\"");
}

inline std::int64_t dimension(JsonCursor& cur, const std::string& path, const std::string& what) {
  const std::uint64_t v = cur.uint64();
  if (v > (std::uint64_t{1} << 60)) throw FormatError(path + ": " + what + " " + std::to_string(v) + " is too large");
  return static_cast<std::int64_t>(v);
}

}  // namespace shard_index

LAZYTENSOR_INLINE ShardIndex parse_shard_index(std::string_view text, const std::string& path) {
  using namespace shard_index;
  ShardIndex index;
  JsonCursor cur(text, path);
  bool format = false;
  each_key(cur, [&](const std::string& key) {
    if (key == "format") {
      const std::string f = cur.string();
      if (f != kShardIndexFormat)
        throw FormatError(path + ": \"format\" is \"" + f + "\", expected \"" + std::string(kShardIndexFormat) + "\"");
      format = true;
    } else if (key == "version") {
      if (const auto v = cur.uint64(); v != 1)
        throw FormatError(path + ": index version " + std::to_string(v) + ", this library reads version 1");
    } else if (key == "files") {
      each_element(cur, [&] { index.files.push_back(cur.string()); });
    } else if (key == "metadata") {
      each_key(cur, [&](const std::string& k) { index.metadata[k] = cur.string(); });
    } else if (key == "tensors") {
      each_element(cur, [&] {
        ShardedEntry e;
        each_key(cur, [&](const std::string& k) {
          if (k == "name") e.name = cur.string();
          else if (k == "dtype") e.dtype = cur.string();
          else if (k == "sharding") e.sharding = cur.string();
          else if (k == "shape") each_element(cur, [&] { e.shape.push_back(dimension(cur, path, "dimension")); });
          else if (k == "blocks") {
            each_element(cur, [&] {
              ShardBlock b;
              each_key(cur, [&](const std::string& bk) {
                if (bk == "file") b.file = static_cast<std::size_t>(cur.uint64());
                else if (bk == "index") {
                  each_element(cur, [&] {
                    cur.expect('[');
                    const std::int64_t lo = dimension(cur, path, "block start");
                    cur.expect(',');
                    const std::int64_t hi = dimension(cur, path, "block end");
                    cur.expect(']');
                    b.index.emplace_back(lo, hi);
                  });
                } else throw FormatError(path + ": unknown key \"" + bk + "\" in a block of tensor '" + e.name + "'");
              });
              e.blocks.push_back(std::move(b));
            });
          } else throw FormatError(path + ": unknown key \"" + k + "\" in tensor '" + e.name + "'");
        });
        index.tensors.push_back(std::move(e));
      });
    } else {
      throw FormatError(path + ": unknown key \"" + key + "\" in a shard index");
    }
  });
  if (!format) throw FormatError(path + ": not a shard index (no \"format\" key)");
  for (const std::string& f : index.files) {
    if (f.empty() || f.find('/') != std::string::npos || f == "." || f == "..")
      throw FormatError(path + ": shard file \"" + f + "\" is not a file name beside the index");
  }
  std::set<std::string> names;
  for (const ShardedEntry& e : index.tensors) {
    const std::string who = path + ": tensor '" + e.name + "'";
    if (!names.insert(e.name).second) throw FormatError(who + " is listed twice");
    if (e.shape.size() > static_cast<std::size_t>(kMaxRank))
      throw FormatError(who + " has rank " + std::to_string(e.shape.size()) + ", more than " + std::to_string(kMaxRank));
    Shape shape;
    try {
      shape = Shape(e.shape);
    } catch (const Error& err) {
      throw FormatError(who + ": " + err.what());
    }
    shard_index::dtype_named(e.dtype, who);
    std::int64_t covered = 0;
    for (std::size_t b = 0; b < e.blocks.size(); ++b) {
      const ShardBlock& blk = e.blocks[b];
      if (blk.file >= index.files.size())
        throw FormatError(who + ": block " + std::to_string(b) + " names file " + std::to_string(blk.file) + " of " +
                          std::to_string(index.files.size()));
      if (blk.index.size() != e.shape.size())
        throw FormatError(who + ": block " + std::to_string(b) + " has " + std::to_string(blk.index.size()) +
                          " ranges for a tensor of rank " + std::to_string(e.shape.size()));
      std::int64_t volume = 1;
      for (std::size_t d = 0; d < e.shape.size(); ++d) {
        const auto [lo, hi] = blk.index[d];
        if (lo > hi || hi > e.shape[d])
          throw FormatError(who + ": block " + std::to_string(b) + " range [" + std::to_string(lo) + ", " +
                            std::to_string(hi) + ") of dimension " + std::to_string(d) + " is outside [0, " +
                            std::to_string(e.shape[d]) + ")");
        volume *= hi - lo;
      }
      for (std::size_t o = 0; o < b; ++o) {  // blocks may not overlap (a handful per tensor)
        if (e.blocks[o].file == blk.file)  // a file holds one block of a tensor (under its name)
          throw FormatError(who + ": blocks " + std::to_string(o) + " and " + std::to_string(b) + " both name file " +
                            std::to_string(blk.file));
        bool overlap = volume > 0;
        for (std::size_t d = 0; d < e.shape.size() && overlap; ++d)
          overlap = blk.index[d].first < e.blocks[o].index[d].second && e.blocks[o].index[d].first < blk.index[d].second;
        if (overlap)
          throw FormatError(who + ": blocks " + std::to_string(o) + " and " + std::to_string(b) + " overlap");
      }
      covered += volume;
    }
    if (covered != shape.numel())
      throw FormatError(who + ": its blocks hold " + std::to_string(covered) + " of its " +
                        std::to_string(shape.numel()) + " elements");
  }
  return index;
}

LAZYTENSOR_INLINE ShardIndex read_shard_index(const std::string& path) {
  ReadFile file(path);
  std::string text(static_cast<std::size_t>(file.size()), '\0');
  if (file.read_at(text.data(), text.size(), 0) != text.size())
    throw FormatError(path + ": file shrank while reading the shard index");
  return parse_shard_index(text, path);
}

LAZYTENSOR_INLINE StateDict load_shard_index(const std::string& path, Device dev,
                                             StateDict (*load_file)(const std::string&, Device)) {
  const ShardIndex index = read_shard_index(path);
  graph::Device& engine = dev.engine();
  // Whole buffers first, then one shard file at a time copies its blocks in.
  std::vector<std::shared_ptr<Buffer>> whole;
  std::vector<DType> dtypes;
  std::map<std::string, std::string> stored;
  std::uint64_t bytes = 0;
  for (const ShardedEntry& e : index.tensors)
    bytes += static_cast<std::uint64_t>(Shape(e.shape).numel()) *
             dtype_size(shard_index::dtype_named(e.dtype, path + ": tensor '" + e.name + "'"));
  lazy::detail::check_fits_in_memory(bytes, path + ": the tensors' data");
  for (const ShardedEntry& e : index.tensors) {
    const DType dt = shard_index::dtype_named(e.dtype, path + ": tensor '" + e.name + "'");
    dtypes.push_back(dt);
    whole.push_back(engine.pool().acquire(padded_bytes(Shape(e.shape).numel(), dtype_size(dt))));
  }
  const std::string dir = parent_dir(path) + "/";
  for (std::size_t k = 0; k < index.files.size(); ++k) {
    const std::string file = dir + index.files[k];
    const StateDict part = load_file(file, dev);
    for (std::size_t t = 0; t < index.tensors.size(); ++t) {
      const ShardedEntry& e = index.tensors[t];
      for (const ShardBlock& b : e.blocks) {
        if (b.file != k) continue;
        const AnyTensor* piece = part.find(e.name);
        if (!piece) throw FormatError(file + ": no tensor '" + e.name + "', which " + path + " says it holds");
        std::vector<std::int64_t> box, at;
        for (const auto& [lo, hi] : b.index) box.push_back(hi - lo), at.push_back(lo);
        if (piece->dtype() != dtypes[t] || piece->shape() != Shape(box)) {
          throw FormatError(file + ": tensor '" + e.name + "' is " + dtype_name(piece->dtype()) + " " +
                            piece->shape().str() + ", " + path + " says " + e.dtype + " " + Shape(box).str());
        }
        if (auto s = part.stored_dtypes().find(e.name); s != part.stored_dtypes().end()) stored[e.name] = s->second;
        const graph::NodePtr& node = piece->impl()->node;
        graph::detail::copy_box(static_cast<const std::byte*>(node->buffer()->data()), piece->shape(),
                                std::vector<std::int64_t>(box.size(), 0), static_cast<std::byte*>(whole[t]->data()),
                                Shape(e.shape), at, box, dtype_size(dtypes[t]));
      }
    }
  }
  StateDict sd;
  for (std::size_t t = 0; t < index.tensors.size(); ++t) {
    const ShardedEntry& e = index.tensors[t];
    sd.insert(e.name, lazy::detail::any_of_node(
                          std::make_shared<graph::DataNode>(dtypes[t], Shape(e.shape), &engine, std::move(whole[t]))));
  }
  sd.metadata() = index.metadata;
  sd.stored_dtypes() = std::move(stored);
  return sd;
}

}  // namespace lazy::io::detail
#endif  // LAZYTENSOR_HEADER_DEFINITIONS
