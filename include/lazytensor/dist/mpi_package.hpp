#pragma once
// The byte packages lazytensor::mpi's processes exchange (a round's signature and data
// entries, an exit or broken-group notice) and the MPI tags they travel on. Used by
// mpi_world_impl.hpp and mpi_link_impl.hpp; plain C++, no MPI call.

#include <lazytensor/core/error.hpp>
#include <lazytensor/dist/share.hpp>
#include <lazytensor/dist/signature.hpp>

#if LAZYTENSOR_WITH_MPI
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace lazy::dist::detail {

/// Tags on the control communicator: a replica's exit, a group a peer gave up, a question
/// where replicas joined a collective and its answer (ProcessWorld::ask_where).
inline constexpr int kExitTag = 1;
inline constexpr int kBrokenTag = 2;
inline constexpr int kWhereAskTag = 3;
inline constexpr int kWhereTellTag = 4;
/// Tags on the data communicator: packages on [1, kPieceTagBase) by group hash, large
/// entries on fresh tags from [kPieceTagBase, 32767] (MPI guarantees tags up to 32767).
inline constexpr int kPieceTagBase = 16384;
inline constexpr int kPieceTags = 32768 - kPieceTagBase;
/// Data entries at least this large, held by a buffer, are sent from where they are
/// (no copy into the package).
inline constexpr std::size_t kDirectBytes = std::size_t{64} << 10;
/// Largest piece of one MPI message (counts are ints).
inline constexpr std::size_t kMaxPiece = std::size_t{1} << 30;
inline constexpr std::uint64_t kPackageMagic = 0x314950544c5a414cULL;  // "LAZLTPI1"

/// Appends plain values to a byte package. The vector grows ahead of the writes (a package
/// is written every round: doubling while it is small, then by what a write needs plus
/// 4 KiB, so a large payload is not zero-filled twice); finish() trims it to what was
/// written, and must be called before the package is used.
struct PackWriter {
  std::vector<std::byte>& out;
  std::size_t at = out.size();

  template <class V>
  void put(const V& v) {
    put_bytes(&v, sizeof(V));
  }
  void put_bytes(const void* p, std::size_t n) {
    if (out.size() - at < n) grow(at + n);
    if (n) std::memcpy(out.data() + at, p, n);
    at += n;
  }
  void pad64() {
    const std::size_t to = align64(at);
    if (out.size() < to) grow(to);
    std::memset(out.data() + at, 0, to - at);
    at = to;
  }
  /// Bytes written so far.
  std::size_t size() const { return at; }
  void finish() { out.resize(at); }

 private:
  void grow(std::size_t need) {
    const std::size_t slack = std::min<std::size_t>(out.size(), 4096);
    out.resize(std::max({need, out.size() + slack, std::size_t{256}}));
  }
};

/// Reads them back, bounds-checked: a malformed package is a CollectiveError naming its
/// sender.
struct PackReader {
  const std::byte* p;
  const std::byte* end;
  int from;
  void need(std::size_t n) const {
    if (static_cast<std::size_t>(end - p) < n) {
      throw CollectiveError("malformed collective package from process " + std::to_string(from) +
                            " (truncated)");
    }
  }
  template <class V>
  V get() {
    need(sizeof(V));
    V v;
    std::memcpy(&v, p, sizeof(V));
    p += sizeof(V);
    return v;
  }
};

inline void put_signature(PackWriter& w, const Signature& s) {
  w.put(static_cast<std::uint8_t>(s.kind));
  w.put(static_cast<std::uint8_t>(s.op));
  w.put(static_cast<std::uint8_t>(s.dtype));
  w.put(static_cast<std::int32_t>(s.tensors));
  w.put(static_cast<std::int32_t>(s.shape.rank()));
  for (int d = 0; d < s.shape.rank(); ++d) w.put(s.shape[d]);
  w.put(s.shapes_hash);
  for (auto p : s.params) w.put(p);
  w.put(s.scale);
  const std::uint32_t g = s.group ? static_cast<std::uint32_t>(s.group->size()) : 0;
  w.put(g);
  for (std::uint32_t i = 0; i < g; ++i) w.put(static_cast<std::int32_t>((*s.group)[i]));
  w.put(static_cast<std::uint64_t>(s.tag.size()));
  w.put_bytes(s.tag.data(), s.tag.size());
  w.put(s.world_seq);
}

/// Reads a signature into `s`, keeping its group list when the package names the same
/// members (it does round after round: no allocation then).
inline void read_signature(PackReader& r, Signature& s) {
  s.kind = static_cast<CollectiveKind>(r.get<std::uint8_t>());
  s.op = static_cast<ReduceOp>(r.get<std::uint8_t>());
  s.dtype = static_cast<DType>(r.get<std::uint8_t>());
  s.tensors = r.get<std::int32_t>();
  const auto rank = r.get<std::int32_t>();
  if (rank < 0 || rank > kMaxRank) r.need(std::numeric_limits<std::size_t>::max());
  s.shape = Shape{};
  for (int d = 0; d < rank; ++d) s.shape.push_back(r.get<std::int64_t>());
  s.shapes_hash = r.get<std::uint64_t>();
  for (auto& p : s.params) p = r.get<std::int64_t>();
  s.scale = r.get<double>();
  const auto g = r.get<std::uint32_t>();
  r.need(std::size_t{g} * 4);
  bool same = g > 0 && s.group && s.group->size() == g;
  for (std::uint32_t i = 0; i < g && same; ++i) {
    std::int32_t m;
    std::memcpy(&m, r.p + std::size_t{i} * 4, sizeof m);
    same = (*s.group)[i] == m;
  }
  if (same) {
    r.p += std::size_t{g} * 4;
  } else if (g == 0) {
    s.group.reset();
  } else {
    auto group = std::make_shared<std::vector<int>>(g);
    for (std::uint32_t i = 0; i < g; ++i) (*group)[i] = r.get<std::int32_t>();
    s.group = std::move(group);
  }
  const auto n = r.get<std::uint64_t>();
  r.need(n);
  s.tag.assign(reinterpret_cast<const char*>(r.p), n);
  r.p += n;
  s.world_seq = r.get<std::uint64_t>();
}

}  // namespace lazy::dist::detail
#endif  // LAZYTENSOR_WITH_MPI
