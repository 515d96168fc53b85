#pragma once
// Definitions of mpi_world.hpp's MpiLink (included at its end): one group's rounds between
// processes, packages as MPI messages and large entries through the host's shared window.

#include <lazytensor/core/error.hpp>
#include <lazytensor/dist/mpi_package.hpp>

#if LAZYTENSOR_WITH_MPI
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <utility>

namespace lazy::dist::detail {

inline MpiLink::MpiLink(std::shared_ptr<MpiWorld> pw, const std::vector<int>& members,
                        ProcessWorld::BrokenHandler on_broken)
    : pw_(std::move(pw)) {
  const int n = pw_->replicas();
  std::uint64_t h = 1469598103934665603ULL;  // FNV-1a of the members
  for (int m : members) {
    h = (h ^ static_cast<std::uint64_t>(m)) * 1099511628211ULL;
    const int p = m / n;
    if (p == pw_->index()) continue;
    if (peers_.empty() || peers_.back().process != p) peers_.push_back(Peer{p, {}, {}, {}, {}, {}});
    peers_.back().ordinals.push_back(m);
  }
  hash_ = h;
  shared_peers_ = pw_->segment_of(pw_->index()) != nullptr;
  for (const auto& peer : peers_) shared_peers_ = shared_peers_ && pw_->shares_window(peer.process);
  // Groups that hash to the same tag share it: a package carries its group's hash and a
  // leader that receives another group's leaves it in the mailbox (MpiWorld), and large
  // entries travel on fresh tags named in the package, so no data can reach the wrong group.
  // LAZYTENSOR_MPI_PACKAGE_TAGS (1 to 16383, read when a group forms) narrows the tags so
  // that tests can make groups share one.
  int tags = kPieceTagBase - 1;
  if (const char* env = std::getenv("LAZYTENSOR_MPI_PACKAGE_TAGS"))
    tags = std::clamp(std::atoi(env), 1, kPieceTagBase - 1);
  tag_ = 1 + static_cast<int>(h % static_cast<std::uint64_t>(tags));
  pw_->on_group_broken(hash_, std::move(on_broken));
}

inline MpiLink::~MpiLink() { pw_->forget_group(hash_); }

inline void MpiLink::begin(std::uint64_t s, const std::vector<Share*>& local,
                           const std::vector<int>& ordinals) {
  round_ = s;
  auto& out = out_[s & 1];
  if (!out) out = std::make_shared<std::vector<std::byte>>();
  out->clear();
  PackWriter w{*out};
  w.put(kPackageMagic);
  w.put(hash_);
  w.put(s);
  const std::size_t tag_at = w.size();
  w.put(static_cast<std::int32_t>(0));  // the pieces' tag, below
  w.put(static_cast<std::uint32_t>(local.size()));
  auto& direct = direct_;
  auto& packed = packed_;
  direct.clear();
  packed.clear();
  out_keep_.clear();
  // Large entries go to this process's shared segment when every peer process shares the
  // host's window: one copy here, and the peers read them in place. The group keeps one
  // area per round parity: a peer reads round s's before it sends its round s + 1 package,
  // which this process receives before it writes round s + 2's.
  auto entry_size = [](const Share& sh, std::size_t j) {
    return j < sh.bytes.size() ? sh.bytes[j] : 0;
  };
  std::size_t big = 0;
  for (const Share* sh : local)
    for (std::size_t j = 0; j < sh->data.size(); ++j)
      if (entry_size(*sh, j) >= kDirectBytes) big += align64(entry_size(*sh, j));
  std::byte* segment = nullptr;
  std::size_t seg_at = 0;
  if (shared_peers_ && big > 0) {
    auto& area = region_[s & 1];
    auto& capacity = region_bytes_[s & 1];
    if (capacity < big) {
      if (const std::int64_t at = pw_->reserve_segment(big); at >= 0) {
        area = at;
        capacity = big;
      }
    }
    if (capacity >= big) {
      segment = pw_->segment_of(pw_->index());
      seg_at = static_cast<std::size_t>(area);
    }
  }
  for (std::size_t i = 0; i < local.size(); ++i) {
    const Share& sh = *local[i];
    w.put(static_cast<std::int32_t>(ordinals[i]));
    put_signature(w, sh.sig);
    w.put(static_cast<std::uint32_t>(sh.data.size()));
    for (std::size_t j = 0; j < sh.data.size(); ++j) {
      const std::size_t size = entry_size(sh, j);
      w.put(static_cast<std::uint64_t>(size));
      if (size >= kDirectBytes && segment) {  // 2: in this process's shared segment
        std::memcpy(segment + seg_at, sh.data[j], size);
        w.put(static_cast<std::uint8_t>(2));
        w.put(static_cast<std::uint64_t>(seg_at));
        seg_at += align64(size);
        continue;
      }
      const bool dir = size >= kDirectBytes && !sh.keep.empty();  // 1: a message of its own
      w.put(static_cast<std::uint8_t>(dir));                      // 0: in the package
      (dir ? direct : packed).emplace_back(sh.data[j], size);
    }
    if (!segment)
      for (const auto& k : sh.keep) out_keep_.push_back(k);
  }
  if (segment) pw_->sync_segments();
  w.pad64();
  for (const auto& [p, size] : packed) {
    w.put_bytes(p, size);
    w.pad64();
  }
  w.finish();
  if (out->size() > static_cast<std::size_t>(std::numeric_limits<int>::max())) {
    throw CollectiveError("a collective's host payloads exceed 2 GiB in one round");
  }
  const std::int32_t pieces = direct.empty() ? 0 : pw_->piece_tag();
  std::memcpy(out->data() + tag_at, &pieces, sizeof pieces);
  MPI_Comm comm = pw_->data_comm();
  sends_.clear();
  for (auto& peer : peers_) {
    MPI_Request r = MPI_REQUEST_NULL;
    mpi_check(MPI_Isend(out->data(), static_cast<int>(out->size()), MPI_BYTE, peer.process, tag_,
                        comm, &r),
              "MPI_Isend");
    sends_.push_back(r);
    for (const auto& [p, size] : direct) {
      for (std::size_t at = 0; at < size; at += kMaxPiece) {
        const auto piece = static_cast<int>(std::min(kMaxPiece, size - at));
        mpi_check(MPI_Isend(p + at, piece, MPI_BYTE, peer.process, pieces, comm, &r), "MPI_Isend");
        sends_.push_back(r);
      }
    }
    peer.got_header = false;
    peer.recvs.clear();
  }
}

inline bool MpiLink::progress(const std::vector<Share*>& slot_share,
                              const std::vector<int>& slot_of_ordinal) {
  MPI_Comm comm = pw_->data_comm();
  bool done = true;
  for (auto& peer : peers_) {
    if (!peer.got_header) {
      auto& hb = peer.header[round_ & 1];  // (round s - 2's package: read by now)
      auto pkg = next_package(peer.process, hb);
      if (!pkg) {
        done = false;
        continue;
      }
      hb = std::move(pkg);
      peer.got_header = true;
      PackReader r{hb->data(), hb->data() + hb->size(), peer.process};
      r.p += 2 * sizeof(std::uint64_t);  // magic and group: checked by next_package
      const auto seq = r.get<std::uint64_t>();
      if (seq != round_) {
        throw CollectiveError("process " + std::to_string(peer.process) + " sent collective #" +
                              std::to_string(seq) + " of this group where #" +
                              std::to_string(round_) + " was expected");
      }
      const int pieces = r.get<std::int32_t>();
      const auto nshares = r.get<std::uint32_t>();
      bool shared = false;
      std::vector<Entry>& entries = entries_;
      entries.clear();
      for (std::uint32_t i = 0; i < nshares; ++i) {
        const int ordinal = r.get<std::int32_t>();
        if (ordinal < 0 || static_cast<std::size_t>(ordinal) >= slot_of_ordinal.size() ||
            slot_of_ordinal[static_cast<std::size_t>(ordinal)] < 0 ||
            std::find(peer.ordinals.begin(), peer.ordinals.end(), ordinal) == peer.ordinals.end()) {
          throw CollectiveError("process " + std::to_string(peer.process) +
                                " sent a share of replica " + std::to_string(ordinal) +
                                ", which is not its member of this group");
        }
        Share& sh = *slot_share[static_cast<std::size_t>(
            slot_of_ordinal[static_cast<std::size_t>(ordinal)])];
        read_signature(r, sh.sig);
        const auto nd = r.get<std::uint32_t>();
        sh.data.assign(nd, nullptr);
        sh.bytes.assign(nd, 0);
        sh.buffers.clear();
        sh.keep.clear();
        for (std::uint32_t j = 0; j < nd; ++j) {
          const auto size = static_cast<std::size_t>(r.get<std::uint64_t>());
          const auto mode = r.get<std::uint8_t>();
          sh.bytes[j] = size;
          if (mode == 2) {  // read in place from the peer's shared segment
            const auto at = static_cast<std::size_t>(r.get<std::uint64_t>());
            std::byte* seg = pw_->segment_of(peer.process);
            if (!seg) {
              throw CollectiveError("process " + std::to_string(peer.process) +
                                    " named its shared segment, which this process cannot see");
            }
            sh.data[j] = seg + at;
            shared = true;
            continue;
          }
          entries.push_back({&sh, j, size, mode != 0});
        }
      }
      if (shared) pw_->sync_segments();  // the peer's copies, made before it sent this
      std::size_t at = align64(static_cast<std::size_t>(r.p - hb->data())), bulk = 0;
      for (auto& e : entries) {
        if (e.direct) {
          bulk += align64(e.size);
          continue;
        }
        if (hb->size() < at + e.size) r.need(std::numeric_limits<std::size_t>::max());
        e.share->data[e.index] = hb->data() + at;
        at += align64(e.size);
      }
      auto& bb = peer.bulk[round_ & 1];
      if (!bb) bb = std::make_shared<std::vector<std::byte>>();
      if (bb->size() < bulk) bb->resize(bulk);
      std::size_t off = 0;
      for (auto& e : entries) {
        if (!e.direct) continue;
        std::byte* dst = bb->data() + off;
        e.share->data[e.index] = dst;
        for (std::size_t b = 0; b < e.size; b += kMaxPiece) {
          MPI_Request req = MPI_REQUEST_NULL;
          const auto piece = static_cast<int>(std::min(kMaxPiece, e.size - b));
          mpi_check(MPI_Irecv(dst + b, piece, MPI_BYTE, peer.process, pieces, comm, &req),
                    "MPI_Irecv");
          peer.recvs.push_back(req);
        }
        off += align64(e.size);
      }
    }
    if (!peer.recvs.empty()) {
      int flag = 0;
      mpi_check(MPI_Testall(static_cast<int>(peer.recvs.size()), peer.recvs.data(), &flag,
                            MPI_STATUSES_IGNORE),
                "MPI_Testall");
      if (!flag) {
        done = false;
      } else {
        peer.recvs.clear();
      }
    }
  }
  if (!sends_.empty()) {
    int flag = 0;
    mpi_check(
        MPI_Testall(static_cast<int>(sends_.size()), sends_.data(), &flag, MPI_STATUSES_IGNORE),
        "MPI_Testall");
    if (!flag) {
      done = false;
    } else {
      sends_.clear();
      out_keep_.clear();
    }
  }
  return done;
}

inline std::shared_ptr<std::vector<std::byte>> MpiLink::next_package(
    int process, std::shared_ptr<std::vector<std::byte>>& recycle) {
  // One leader per tag at a time looks into the mailbox and then MPI's queue
  // (MpiWorld::probe_mutex): a package of this group that another leader received is then
  // always in the mailbox before this leader can probe the next one. Contended only by
  // groups whose tags share a lock (the same tag, or tags 64 apart). The lock is held
  // through MPI_Mrecv on purpose: another group's package must be in the mailbox before
  // the next probe. A tensor collective's package is short: its entries of kDirectBytes
  // and more travel through the shared window or as messages of their own. Host-side
  // payloads (broadcast_object, rendezvous) travel in the package, whatever their size.
  std::lock_guard probing(pw_->probe_mutex(tag_));
  if (auto p = pw_->take_package(hash_, process)) return p;
  for (;;) {
    int flag = 0;
    MPI_Message m;
    MPI_Status st;
    mpi_check(MPI_Improbe(process, tag_, pw_->data_comm(), &flag, &m, &st), "MPI_Improbe");
    if (!flag) return nullptr;
    int count = 0;
    MPI_Get_count(&st, MPI_BYTE, &count);
    std::shared_ptr<std::vector<std::byte>> buf;
    // (Not a much larger one: one big round must not pin its size for the link's life.)
    if (recycle && recycle.use_count() == 1 &&
        recycle->capacity() <= std::max<std::size_t>(2 * static_cast<std::size_t>(count), 1 << 20))
      buf = std::move(recycle);
    else
      buf = std::make_shared<std::vector<std::byte>>();
    buf->resize(static_cast<std::size_t>(std::max(count, 0)));
    mpi_check(MPI_Mrecv(buf->data(), count, MPI_BYTE, &m, MPI_STATUS_IGNORE), "MPI_Mrecv");
    PackReader r{buf->data(), buf->data() + buf->size(), process};
    if (r.get<std::uint64_t>() != kPackageMagic) {
      throw CollectiveError("malformed collective package from process " + std::to_string(process));
    }
    const auto group = r.get<std::uint64_t>();
    if (group == hash_) return buf;
    pw_->post_package(group, process, std::move(buf));  // another group's: same tag
  }
}

inline std::string MpiLink::waiting_for() const {
  std::string w;
  for (const auto& peer : peers_) {
    if (peer.got_header && peer.recvs.empty()) continue;
    if (!w.empty()) w += ", ";
    w += "process " + std::to_string(peer.process) + " (replica" +
         (peer.ordinals.size() > 1 ? "s " : " ") + list_str(peer.ordinals).substr(1);
    w.back() = ')';
  }
  return w.empty() ? "the other processes' sends to complete" : w;
}

inline bool MpiLink::delivered_by_owner(int ordinal) const {
  for (const auto& peer : peers_) {
    if (std::find(peer.ordinals.begin(), peer.ordinals.end(), ordinal) != peer.ordinals.end())
      return peer.got_header;
  }
  return true;
}

inline void MpiLink::abandon(const std::string& reason, GiveUp why) {
  std::vector<MPI_Request> reqs;
  std::vector<std::shared_ptr<void>> keep;
  for (auto& peer : peers_) {
    for (auto& r : peer.recvs) {
      if (r != MPI_REQUEST_NULL) MPI_Cancel(&r);
      reqs.push_back(r);
    }
    peer.recvs.clear();
    for (auto& b : peer.header) keep.push_back(b);
    for (auto& b : peer.bulk) keep.push_back(b);
  }
  for (auto r : sends_) reqs.push_back(r);
  sends_.clear();
  for (auto& b : out_) keep.push_back(b);
  for (auto& k : out_keep_) keep.push_back(std::move(k));
  out_keep_.clear();
  pw_->abandon(std::move(reqs), std::move(keep));
  std::vector<int> to;
  for (const auto& peer : peers_) to.push_back(peer.process);
  if (!reason.empty()) pw_->announce_broken(hash_, to, reason, why);
}

}  // namespace lazy::dist::detail
#endif  // LAZYTENSOR_WITH_MPI
