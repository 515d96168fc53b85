#pragma once
// safetensors files (https://github.com/huggingface/safetensors), readable by the Python
// `safetensors` package:
//
//   [8 bytes]  N, the header length, unsigned little-endian
//   [N bytes]  a JSON object: "name": {"dtype": "F32", "shape": [2, 3], "data_offsets": [b, e]}
//              per tensor, plus an optional "__metadata__": {string: string}; padded with
//              spaces so that the data starts 8-byte aligned
//   [rest]     the tensors' bytes, little-endian, row-major; offsets are relative to the
//              start of this buffer, and the tensors tile it exactly (no gap, no overlap,
//              nothing after the last one)
//
// Writing streams one tensor at a time into a temporary file that replaces the target
// atomically; reading validates the whole header against the file size before allocating
// anything, then reads each tensor straight into a buffer of the target device.

#include <algorithm>
#include <bit>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <numeric>
#include <string>
#include <string_view>
#include <unordered_set>
#include <utility>
#include <vector>

#include <lazytensor/any_tensor.hpp>
#include <lazytensor/core/buffer.hpp>
#include <lazytensor/core/config.hpp>
#include <lazytensor/core/error.hpp>
#include <lazytensor/io/file.hpp>
#include <lazytensor/io/json.hpp>
#include <lazytensor/state_dict.hpp>

namespace lazy::io {

namespace detail {

static_assert(
    std::endian::native == std::endian::little,
    "lazy::io writes tensor bytes as they are in memory; safetensors needs little-endian");

/// Largest header accepted (and written): the limit of the reference implementation.
inline constexpr std::uint64_t kMaxSafetensorsHeader = 100'000'000;

/// safetensors' name of a dtype.
const char* safetensors_dtype_name(DType d);

/// One tensor as the header describes it.
struct SafetensorsEntry {
  std::string name;
  DType dtype = DType::Float32;
  Shape shape;
  std::uint64_t begin = 0;  ///< data_offsets, relative to the data buffer
  std::uint64_t end = 0;
};

/// A parsed header: tensors in header order, and the metadata.
struct SafetensorsHeader {
  std::vector<SafetensorsEntry> tensors;
  std::map<std::string, std::string> metadata;
};

void parse_tensor_entry(JsonCursor& cur, SafetensorsEntry& e);

/// Parses a header strictly; FormatError("<path>: ...") on anything malformed.
SafetensorsHeader parse_safetensors_header(std::string_view text, const std::string& path);

/// Checks that the tensors tile a data buffer of `buffer_bytes` exactly: each tensor's
/// byte range matches its shape and dtype, ranges neither overlap nor leave gaps, and the
/// last one ends where the file ends. FormatError("<path>: ...") otherwise.
void check_safetensors_layout(const SafetensorsHeader& h, std::uint64_t buffer_bytes,
                              const std::string& path);

/// A typed handle on a materialized node of run-time dtype.
AnyTensor wrap_node(const graph::NodePtr& node);

/// The header text (padded to 8 bytes) for `sd`, whose tensors are laid out in `order`.
std::string safetensors_header(const StateDict& sd, const std::vector<std::size_t>& order);

/// Rejects what the format cannot store (before anything is written).
void check_saveable(const StateDict& sd, const std::string& path);

}  // namespace detail

/// Writes `sd` (tensors and metadata) to `path` as a safetensors file. Each tensor is
/// materialized and written in turn (the file is never assembled in memory), into a
/// temporary file in the same directory that is fsynced and renamed over `path`: a failure
/// leaves any previous file intact and no temporary file behind. Disk errors raise IoError;
/// an error computing a pending tensor propagates as is. Data are laid out by decreasing
/// element size (so each tensor is aligned to its element size, as the reference writer
/// does); the header lists tensors in the state dict's order.
void save_file(const StateDict& sd, const std::string& path);

/// Reads a safetensors file into a state dict (tensors in header order, materialized on
/// `dev`; the "__metadata__" entries in metadata()). IoError when the file cannot be read;
/// FormatError naming the file and the problem when it is not a valid safetensors file of
/// dtypes lazytensor holds (BOOL, I32, I64, BF16, F32, F64). Nothing is allocated for a
/// tensor before the whole header has been checked against the file's size.
StateDict load(const std::string& path, Device dev = device());

#if LAZYTENSOR_HEADER_DEFINITIONS
namespace detail {

LAZYTENSOR_INLINE const char* safetensors_dtype_name(DType d) {
  switch (d) {
    case DType::Bool:
      return "BOOL";
    case DType::Int32:
      return "I32";
    case DType::Int64:
      return "I64";
    case DType::BFloat16:
      return "BF16";
    case DType::Float32:
      return "F32";
    case DType::Float64:
      return "F64";
  }
  return "?";
}

LAZYTENSOR_INLINE void parse_tensor_entry(JsonCursor& cur, SafetensorsEntry& e) {
  const std::string ctx = "tensor '" + e.name + "': ";
  bool have_dtype = false, have_shape = false, have_offsets = false;
  cur.expect('{');
  if (!cur.accept('}')) {
    for (;;) {
      const std::string key = cur.string();
      cur.expect(':');
      if (key == "dtype") {
        if (have_dtype) cur.fail(ctx + "duplicate key 'dtype'");
        have_dtype = true;
        const std::string name = cur.string();
        bool known = false;
        for (DType d : {DType::Bool, DType::Int32, DType::Int64, DType::BFloat16, DType::Float32,
                        DType::Float64}) {
          if (name == safetensors_dtype_name(d)) e.dtype = d, known = true;
        }
        if (!known) {
          cur.fail(ctx + "unsupported dtype '" + name +
                   "' (expected one of BOOL, I32, I64, BF16, F32, F64)");
        }
      } else if (key == "shape") {
        if (have_shape) cur.fail(ctx + "duplicate key 'shape'");
        have_shape = true;
        cur.expect('[');
        if (!cur.accept(']')) {
          for (;;) {
            if (e.shape.rank() == kMaxRank) {
              cur.fail(ctx + "shape has more than " + std::to_string(kMaxRank) +
                       " dimensions (the maximum rank)");
            }
            const std::uint64_t d = cur.uint64();
            if (d > static_cast<std::uint64_t>(INT64_MAX))
              cur.fail(ctx + "dimension " + std::to_string(d) + " is too large");
            try {
              e.shape.push_back(static_cast<std::int64_t>(d));
            } catch (const ShapeError& err) {
              cur.fail(ctx + err.what());
            }
            if (cur.accept(']')) break;
            cur.expect(',');
          }
        }
      } else if (key == "data_offsets") {
        if (have_offsets) cur.fail(ctx + "duplicate key 'data_offsets'");
        have_offsets = true;
        cur.expect('[');
        e.begin = cur.uint64();
        cur.expect(',');
        e.end = cur.uint64();
        if (cur.peek() != ']')
          cur.fail(ctx + "data_offsets must hold exactly two numbers [begin, end]");
        cur.expect(']');
      } else {
        cur.fail(ctx + "unexpected key '" + key + "' (expected dtype, shape and data_offsets)");
      }
      if (cur.accept('}')) break;
      cur.expect(',');
    }
  }
  if (!have_dtype) cur.fail(ctx + "missing 'dtype'");
  if (!have_shape) cur.fail(ctx + "missing 'shape'");
  if (!have_offsets) cur.fail(ctx + "missing 'data_offsets'");
}

LAZYTENSOR_INLINE SafetensorsHeader parse_safetensors_header(std::string_view text,
                                                             const std::string& path) {
  SafetensorsHeader h;
  JsonCursor cur(text, path);
  if (text.empty() || text.front() != '{')
    cur.fail("the header must be a JSON object starting with '{', found " + cur.found());
  std::unordered_set<std::string> keys;
  cur.expect('{');
  if (!cur.accept('}')) {
    for (;;) {
      std::string key = cur.string();
      cur.expect(':');
      if (!keys.insert(key).second) cur.fail("duplicate key '" + key + "'");
      if (key == "__metadata__") {
        cur.expect('{');
        if (!cur.accept('}')) {
          for (;;) {
            std::string k = cur.string();
            cur.expect(':');
            if (cur.peek() != '"')
              cur.fail("__metadata__ value of '" + k + "' must be a string, found " + cur.found());
            std::string v = cur.string();
            if (!h.metadata.emplace(k, std::move(v)).second)
              cur.fail("duplicate __metadata__ key '" + k + "'");
            if (cur.accept('}')) break;
            cur.expect(',');
          }
        }
      } else {
        SafetensorsEntry e;
        e.name = std::move(key);
        parse_tensor_entry(cur, e);
        h.tensors.push_back(std::move(e));
      }
      if (cur.accept('}')) break;
      cur.expect(',');
    }
  }
  cur.skip_ws();  // writers pad the header with spaces
  if (!cur.at_end()) cur.fail("unexpected data after the header's JSON object: " + cur.found());
  return h;
}

LAZYTENSOR_INLINE void check_safetensors_layout(const SafetensorsHeader& h,
                                                std::uint64_t buffer_bytes,
                                                const std::string& path) {
  const auto& ts = h.tensors;
  const auto fail = [&](const std::string& what) { throw FormatError(path + ": " + what); };
  for (const auto& e : ts) {
    if (e.end < e.begin) {
      fail("tensor '" + e.name + "': data_offsets [" + std::to_string(e.begin) + ", " +
           std::to_string(e.end) + "] end before they begin");
    }
    std::uint64_t numel = 1;
    for (const auto d : e.shape) {
      if (__builtin_mul_overflow(numel, static_cast<std::uint64_t>(d), &numel)) {
        fail("tensor '" + e.name + "': shape " + e.shape.str() +
             " has more elements than 64 bits can count");
      }
    }
    std::uint64_t nbytes = 0;
    if (__builtin_mul_overflow(numel, static_cast<std::uint64_t>(dtype_size(e.dtype)), &nbytes)) {
      fail("tensor '" + e.name + "': shape " + e.shape.str() +
           " has more bytes than 64 bits can count");
    }
    if (e.end - e.begin != nbytes) {
      fail("tensor '" + e.name + "': shape " + e.shape.str() + " of " +
           safetensors_dtype_name(e.dtype) + " needs " + std::to_string(nbytes) +
           " bytes, but data_offsets [" + std::to_string(e.begin) + ", " + std::to_string(e.end) +
           "] hold " + std::to_string(e.end - e.begin));
    }
  }
  std::vector<std::size_t> order(ts.size());
  std::iota(order.begin(), order.end(), std::size_t{0});
  std::sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
    return std::pair(ts[a].begin, ts[a].end) < std::pair(ts[b].begin, ts[b].end);
  });
  std::uint64_t pos = 0;
  std::string prev = "the start of the data buffer";
  for (const std::size_t k : order) {
    const auto& e = ts[k];
    if (e.begin < pos) {
      fail("tensor '" + e.name + "' (data_offsets [" + std::to_string(e.begin) + ", " +
           std::to_string(e.end) + "]) overlaps " + prev + ", which ends at byte " +
           std::to_string(pos));
    }
    if (e.begin > pos) {
      fail("gap of " + std::to_string(e.begin - pos) + " bytes between " + prev +
           " (ends at byte " + std::to_string(pos) + ") and tensor '" + e.name +
           "' (starts at byte " + std::to_string(e.begin) +
           "): the offsets must cover the data buffer contiguously");
    }
    pos = e.end;
    prev = "tensor '" + e.name + "'";
  }
  if (pos > buffer_bytes) {
    fail("truncated: the header describes " + std::to_string(pos) +
         " bytes of tensor data, but only " + std::to_string(buffer_bytes) +
         " bytes follow the header");
  }
  if (pos < buffer_bytes) {
    fail(std::to_string(buffer_bytes - pos) +
         " bytes of trailing data after the last tensor (the header describes " +
         std::to_string(pos) + " bytes of tensor data, " + std::to_string(buffer_bytes) +
         " follow the header)");
  }
}

LAZYTENSOR_INLINE AnyTensor wrap_node(const graph::NodePtr& node) {
  switch (node->dtype()) {
    case DType::Bool:
      return Tensor<bool>(node);
    case DType::Int32:
      return Tensor<std::int32_t>(node);
    case DType::Int64:
      return Tensor<std::int64_t>(node);
    case DType::BFloat16:
      return Tensor<bfloat16>(node);
    case DType::Float32:
      return Tensor<float>(node);
    case DType::Float64:
      break;
  }
  return Tensor<double>(node);
}

LAZYTENSOR_INLINE std::string safetensors_header(const StateDict& sd,
                                                 const std::vector<std::size_t>& order) {
  const auto& items = sd.items();
  std::vector<std::uint64_t> begin(items.size());
  std::uint64_t pos = 0;
  for (const std::size_t k : order) {
    begin[k] = pos;
    pos +=
        static_cast<std::uint64_t>(items[k].second.numel()) * dtype_size(items[k].second.dtype());
  }
  std::string h = "{";
  if (!sd.metadata().empty()) {
    append_json_string(h, "__metadata__");
    h += ":{";
    bool first = true;
    for (const auto& [k, v] : sd.metadata()) {
      if (!first) h += ',';
      first = false;
      append_json_string(h, k);
      h += ':';
      append_json_string(h, v);
    }
    h += '}';
  }
  for (std::size_t k = 0; k < items.size(); ++k) {
    const AnyTensor& t = items[k].second;
    if (h.size() > 1) h += ',';
    append_json_string(h, items[k].first);
    h += ":{\"dtype\":\"";
    h += safetensors_dtype_name(t.dtype());
    h += "\",\"shape\":[";
    for (int d = 0; d < t.shape().rank(); ++d) {
      if (d) h += ',';
      h += std::to_string(t.shape()[d]);
    }
    const std::uint64_t nbytes = static_cast<std::uint64_t>(t.numel()) * dtype_size(t.dtype());
    h += "],\"data_offsets\":[" + std::to_string(begin[k]) + "," +
         std::to_string(begin[k] + nbytes) + "]}";
  }
  h += '}';
  h.append((8 - h.size() % 8) % 8, ' ');  // the data then starts 8-byte aligned
  return h;
}

LAZYTENSOR_INLINE void check_saveable(const StateDict& sd, const std::string& path) {
  for (const auto& [name, t] : sd) {
    if (!t.defined()) throw Error("cannot save '" + path + "': tensor '" + name + "' is undefined");
    if (name == "__metadata__") {
      throw FormatError("cannot save '" + path +
                        "': '__metadata__' is reserved by safetensors, not a tensor name");
    }
    if (!valid_utf8(name))
      throw FormatError("cannot save '" + path + "': tensor name '" + name +
                        "' is not valid UTF-8");
  }
  for (const auto& [k, v] : sd.metadata()) {
    if (!valid_utf8(k) || !valid_utf8(v)) {
      throw FormatError("cannot save '" + path + "': metadata entry '" + k +
                        "' is not valid UTF-8");
    }
  }
}

}  // namespace detail

LAZYTENSOR_INLINE void save_file(const StateDict& sd, const std::string& path) {
  detail::check_saveable(sd, path);
  const auto& items = sd.items();
  std::vector<std::size_t> order(items.size());
  std::iota(order.begin(), order.end(), std::size_t{0});
  std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
    return dtype_size(items[a].second.dtype()) > dtype_size(items[b].second.dtype());
  });
  const std::string header = detail::safetensors_header(sd, order);
  if (header.size() > detail::kMaxSafetensorsHeader) {
    throw FormatError("cannot save '" + path + "': the header would take " +
                      std::to_string(header.size()) + " bytes, more than safetensors' limit of " +
                      std::to_string(detail::kMaxSafetensorsHeader));
  }
  detail::AtomicFileWriter out(path);
  unsigned char len[8];
  for (int i = 0; i < 8; ++i)
    len[i] = static_cast<unsigned char>(static_cast<std::uint64_t>(header.size()) >> (8 * i));
  out.write(len, sizeof len);
  out.write(header.data(), header.size());
  for (const std::size_t k : order) {
    const AnyTensor& t = items[k].second;
    const auto nbytes = static_cast<std::size_t>(t.numel()) * dtype_size(t.dtype());
    if (nbytes == 0) continue;
    t.visit([&](const auto& typed) { out.write(typed.data(), nbytes); });
  }
  out.commit();
}

LAZYTENSOR_INLINE StateDict load(const std::string& path, Device dev) {
  detail::ReadFile file(path);
  const std::uint64_t size = file.size();
  if (size < 8) {
    throw FormatError(path + ": file is " + std::to_string(size) +
                      " bytes long, too short for the 8-byte header length of a safetensors file");
  }
  unsigned char len[8];
  if (file.read_at(len, 8, 0) != 8)
    throw FormatError(path + ": file shrank while reading the header length");
  std::uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | len[i];
  if (n > detail::kMaxSafetensorsHeader) {
    throw FormatError(
        path + ": header length " + std::to_string(n) + " exceeds safetensors' limit of " +
        std::to_string(detail::kMaxSafetensorsHeader) + " bytes (corrupt length field?)");
  }
  if (n > size - 8) {
    throw FormatError(path + ": header length " + std::to_string(n) + " but only " +
                      std::to_string(size - 8) +
                      " bytes follow the length field (truncated file or wrong header length)");
  }
  std::string text(static_cast<std::size_t>(n), '\0');
  if (file.read_at(text.data(), text.size(), 8) != text.size())
    throw FormatError(path + ": file shrank while reading the header");
  const detail::SafetensorsHeader header = detail::parse_safetensors_header(text, path);
  const std::uint64_t data_start = 8 + n;
  detail::check_safetensors_layout(header, size - data_start, path);

  // The data is read whole into buffers: a file whose data the machine cannot hold (a sparse
  // file's apparent size, consistent with its header) fails at once, naming the size.
  lazy::detail::check_fits_in_memory(size - data_start, path + ": the tensors' data");
  StateDict sd;
  graph::Device& engine = dev.engine();
  for (const auto& e : header.tensors) {
    const std::size_t nbytes = static_cast<std::size_t>(e.end - e.begin);
    auto buf = engine.pool().acquire(padded_bytes(e.shape.numel(), dtype_size(e.dtype)));
    if (file.read_at(buf->data(), nbytes, data_start + e.begin) != nbytes) {
      throw FormatError(path + ": file shrank while reading tensor '" + e.name + "'");
    }
    if (e.dtype == DType::Bool) {
      // A byte other than 0/1 read as bool is undefined behaviour; such a file is corrupt.
      const auto* p = static_cast<const unsigned char*>(buf->data());
      for (std::size_t i = 0; i < nbytes; ++i) {
        if (p[i] > 1) {
          throw FormatError(path + ": tensor '" + e.name + "': BOOL element " + std::to_string(i) +
                            " is " + std::to_string(p[i]) + ", expected 0 or 1");
        }
      }
    }
    sd.insert(e.name, detail::wrap_node(std::make_shared<graph::DataNode>(e.dtype, e.shape, &engine,
                                                                          std::move(buf))));
  }
  sd.metadata() = header.metadata;
  return sd;
}
#endif  // LAZYTENSOR_HEADER_DEFINITIONS

}  // namespace lazy::io
