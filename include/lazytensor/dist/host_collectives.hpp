#pragma once
// Host-side collectives, as torch_xla's xm.rendezvous / xm.mesh_reduce: they run at once
// on the calling thread (nothing lazy). Each first runs the replica's pending tensor
// collectives, so a replica's collectives of both kinds execute in program order and share
// one sequence per group (a replica that skips one is a CollectiveMismatch, not a hang).
//
// Values travel as bytes: trivially copyable types, std::string, and std::vector of a
// trivially copyable type (the Codec below); the type is part of the signature.

#include <concepts>
#include <cstring>
#include <string>
#include <string_view>
#include <type_traits>
#include <typeinfo>
#include <utility>
#include <vector>

#include <lazytensor/core/config.hpp>
#include <lazytensor/dist/context.hpp>

namespace lazy::dist {

namespace detail {

/// Bytes of values of type T (see the file comment for the supported types).
template <class T>
struct Codec {
  static_assert(
      std::is_trivially_copyable_v<T> && std::is_default_constructible_v<T>,
      "lazy::dist host collectives carry trivially copyable values, std::string or std::vector of "
      "trivially copyable values");
  static std::string encode(const T& v) {
    return std::string(reinterpret_cast<const char*>(&v), sizeof(T));
  }
  static T decode(std::string_view b, const std::string& where) {
    if (b.size() != sizeof(T)) {
      throw CollectiveError(where + ": expected " + std::to_string(sizeof(T)) +
                            " bytes, received " + std::to_string(b.size()));
    }
    T v;
    std::memcpy(&v, b.data(), sizeof(T));
    return v;
  }
};

template <>
struct Codec<std::string> {
  static std::string encode(const std::string& v) { return v; }
  static std::string decode(std::string_view b, const std::string&) { return std::string(b); }
};

template <class U>
struct Codec<std::vector<U>> {
  static_assert(std::is_trivially_copyable_v<U> && std::is_default_constructible_v<U>,
                "lazy::dist host collectives carry std::vector of trivially copyable values");
  static std::string encode(const std::vector<U>& v) {
    return std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(U));
  }
  static std::vector<U> decode(std::string_view b, const std::string& where) {
    if (b.size() % sizeof(U) != 0) {
      throw CollectiveError(where + ": received " + std::to_string(b.size()) +
                            " bytes, not a whole number of elements of " +
                            std::to_string(sizeof(U)) + " bytes");
    }
    std::vector<U> v(b.size() / sizeof(U));
    if (!b.empty()) std::memcpy(v.data(), b.data(), b.size());
    return v;
  }
};

template <class T>
std::string type_tag() {
  // Appended piece by piece: GCC 12 reports a false -Warray-bounds in `string + "/"`.
  std::string tag = typeid(T).name();
  tag += '/';
  tag += std::to_string(sizeof(T));
  return tag;
}

/// Runs a host round: every member publishes `mine`; returns the payloads of the members
/// in ascending ordinal order (only the source's when `src_slot` >= 0).
std::vector<std::string> host_exchange(const CollectiveCall& c, std::string_view mine,
                                       int src_slot = -1);

Signature host_signature(CollectiveKind kind, std::string tag);

}  // namespace detail

/// Blocks until every replica reached a barrier with the same `name` (as xm.rendezvous(tag)
/// without payload). A different name on some replica is a CollectiveMismatch.
void barrier(const std::string& name = "");

/// Exchanges a payload with the other replicas (xm.rendezvous(tag, payload, replicas)):
/// returns every participant's payload in ascending ordinal order. `replicas` (default:
/// all) lists the participants; each of them must call it with the same tag.
std::vector<std::string> rendezvous(const std::string& tag, std::string_view payload = {},
                                    std::vector<int> replicas = {});

/// Gathers every replica's `data` and returns reduce_fn(values), values in ordinal order
/// (xm.mesh_reduce). Every replica gets the same list, so a deterministic reduce_fn gives
/// the same result everywhere. T: see the file comment.
template <class T, class F>
auto mesh_reduce(const std::string& tag, const T& data, F&& reduce_fn) {
  detail::flush_pending();
  auto call = detail::capture(detail::host_signature(detail::CollectiveKind::MeshReduce,
                                                     tag + " <" + detail::type_tag<T>() + ">"),
                              detail::group_of({}, "mesh_reduce"));
  const std::vector<std::string> raw = detail::host_exchange(call, detail::Codec<T>::encode(data));
  std::vector<T> values;
  values.reserve(raw.size());
  for (const auto& r : raw)
    values.push_back(detail::Codec<T>::decode(r, "mesh_reduce('" + tag + "')"));
  return std::forward<F>(reduce_fn)(values);
}

/// Returns replica `src`'s `obj` on every replica. T: see the file comment.
template <class T>
T broadcast_object(const T& obj, int src = 0) {
  detail::flush_pending();
  const int world = detail::world_size_now();
  if (src < 0 || src >= world) {
    throw CollectiveError("broadcast_object: src " + std::to_string(src) + " is out of range [0, " +
                          std::to_string(world) + ")");
  }
  detail::Signature sig =
      detail::host_signature(detail::CollectiveKind::BroadcastObject, detail::type_tag<T>());
  sig.params[0] = src;
  auto call = detail::capture(std::move(sig), detail::group_of({}, "broadcast_object"));
  if (!call.comm) return obj;
  const int src_slot = call.comm->slot_of(src);
  const bool is_src = call.slot == src_slot;
  const std::string mine = is_src ? detail::Codec<T>::encode(obj) : std::string();
  const std::vector<std::string> raw = detail::host_exchange(call, mine, src_slot);
  return detail::Codec<T>::decode(raw.front(), "broadcast_object");
}

}  // namespace lazy::dist

#if LAZYTENSOR_HEADER_DEFINITIONS
namespace lazy::dist::detail {
LAZYTENSOR_INLINE std::vector<std::string> host_exchange(const CollectiveCall& c,
                                                         std::string_view mine, int src_slot) {
  if (!c.comm) return {std::string(mine)};
  std::vector<std::string> out;
  c.comm->exchange(
      c.slot, c.seq, c.sig,
      [&](Share& s) {
        s.data.assign(1, reinterpret_cast<const std::byte*>(mine.data()));
        s.bytes.assign(1, mine.size());
      },
      [&](const GroupComm::Round& r) {
        auto payload = [&](int slot) {
          const Share& s = r[slot];
          return std::string(reinterpret_cast<const char*>(s.data[0]), s.bytes[0]);
        };
        if (src_slot >= 0) {
          out.push_back(payload(src_slot));
          return;
        }
        for (int j = 0; j < c.comm->size(); ++j)
          out.push_back(payload(j));  // slots: ascending ordinals
      },
      true);
  return out;
}

LAZYTENSOR_INLINE Signature host_signature(CollectiveKind kind, std::string tag) {
  Signature sig;
  sig.kind = kind;
  sig.tag = std::move(tag);
  return sig;
}
}  // namespace lazy::dist::detail

namespace lazy::dist {
LAZYTENSOR_INLINE void barrier(const std::string& name) {
  detail::flush_pending();
  auto call = detail::capture(detail::host_signature(detail::CollectiveKind::Barrier, name),
                              detail::group_of({}, "barrier"));
  if (!call.comm) return;
  call.comm->exchange(
      call.slot, call.seq, call.sig, [](detail::Share&) {}, [](const detail::GroupComm::Round&) {},
      false);
}

LAZYTENSOR_INLINE std::vector<std::string> rendezvous(const std::string& tag,
                                                      std::string_view payload,
                                                      std::vector<int> replicas) {
  detail::flush_pending();
  auto call = detail::capture_among(detail::host_signature(detail::CollectiveKind::Rendezvous, tag),
                                    std::move(replicas), "rendezvous");
  return detail::host_exchange(call, payload);
}
}  // namespace lazy::dist
#endif  // LAZYTENSOR_HEADER_DEFINITIONS
