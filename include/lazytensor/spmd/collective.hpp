#pragma once
// The collectives the partitioner inserts: an all-reduce among the devices of a group (the
// partial results of a product or reduction split along its contracted dimension). One
// node per member, each on its member's graph; when the member's executor runs it, it
// publishes its input, waits for the group, and the members combine the inputs together
// into one result they all share: each claims chunks of the elements until none is left,
// adding every input in group order, so the bits do not depend on who summed what (as
// dist's all-reduce shares its leader's output). The planner runs a step's consecutive
// all-reduces as one batch (graph::Rendezvous), one meeting for all of them.
//
// A group that holds devices of several processes (span.hpp) meets the same way: its
// first member on this process's devices, once the others here published, sends their
// inputs to the group's other processes and receives the other processes' members' inputs
// into their slots; then every process holds every input and folds them in group order,
// so each gets the bits one process would.

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <type_traits>
#include <vector>

#include <lazytensor/core/buffer.hpp>
#include <lazytensor/graph/device.hpp>
#include <lazytensor/graph/node.hpp>
#include <lazytensor/core/bfloat16.hpp>
#include <lazytensor/core/counters.hpp>
#include <lazytensor/dist/world.hpp>
#include <lazytensor/graph/submit.hpp>
#include <lazytensor/spmd/span.hpp>

namespace lazy::spmd {

/// How partial results combine.
enum class Combine { Sum, Prod, Max, Min };

namespace detail {

/// One round of an all-reduce: the group's inputs, published as members arrive. A member
/// publishes, combines, then releases (graph::Rendezvous's phases); between the phases it
/// may serve other rounds.
class ReduceRound {
 public:
  /// `seq`: the round's place among the program's all-reduces (the same in every process),
  /// which pairs the exchanges of a group that spans processes.
  ReduceRound(Combine op, const std::vector<graph::Device*>& members, std::uint64_t seq = 0);
  /// Member `slot` offers `in` to the group; never waits. A member counts once: when its
  /// step runs again after an error (its node went back to the trace), it offers the same
  /// value again, and the first offer stands (a peer may be reading it).
  void publish(int slot, std::shared_ptr<Buffer> in);
  /// Member `slot` waits for every member's input, then combines chunks of them (in slot
  /// order) into the group's result until no chunk is left, and returns that result: one
  /// buffer every member shares (marked shared, so never donated), taken from the pool of
  /// the member that sets the round up (`dev`). Complete only once release() returns.
  /// CollectiveError when a member that has not published gave up more attempts at the
  /// round than this one (abandon(): its step stopped before it): when the step runs
  /// again after such an error, both have given up once, and this member waits for the
  /// other as usual. CollectiveTimeout after dist's timeout. The chunk loop itself cannot fail or block
  /// (detail::combine is noexcept). In a group spanning processes the first member here
  /// runs the exchange (exchange_inputs) before anyone combines; when it fails, every
  /// member here gets a CollectiveError, now and on any later attempt (the processes'
  /// exchanges may no longer pair up: a failed exchange ends the round for good).
  std::shared_ptr<Buffer> combine(int slot, DType dtype, std::int64_t numel, graph::Device& dev);
  /// Member `slot` waits until no member is inside its chunk loop, then lets go of its
  /// input. Once this member's own loop has ended every chunk is claimed, so those members
  /// are the only readers of the inputs and writers of the result left: afterwards the
  /// result is complete, and no input is read again (a buffer whose last reference another
  /// device dropped could be donated, overwritten, there with nothing ordering this
  /// device's reads before the write).
  void release(int slot);
  /// Member `slot`'s node went back to the trace before the round finished for it (its
  /// step stopped): one more attempt given up (see combine).
  void abandon(int slot) noexcept;
  /// All three phases.
  std::shared_ptr<Buffer> run(int slot, std::shared_ptr<Buffer> in, DType dtype, std::int64_t numel, graph::Device& dev);
  Combine op() const { return op_; }
  int size() const { return static_cast<int>(names_.size()); }

 private:
  /// Member `slot` waits, `lock` held, until `count` reaches `target` (default: the group
  /// size): members of a step arrive close together, so it spins, then yields for up to
  /// 2 ms, then sleeps (a sleeping waiter's wake-up costs tens of microseconds on a VM; dist
  /// waits alike). Returns -1, the slot of
  /// a member whose `marks` entry is still 0 and that gave up more attempts than `slot`
  /// (abandon(); also the leader that gave up before the exchange), or -2 when the exchange
  /// with the other processes failed.
  int await(int slot, std::unique_lock<std::mutex>& lock, const int& count, const std::atomic<int>& fast,
             const std::vector<std::uint8_t>& marks, const char* what, int target = -1);
  /// Throws the CollectiveError of an await that returned `failed` (-2: the exchange with
  /// the other processes failed; a slot: that member gave up first); nothing for -1.
  void throw_if_failed(int failed) const;
  /// The exchange of a group spanning processes: run by the first member here once every
  /// member here published (`lock` held on entry and exit, released while messages fly).
  void exchange_inputs(int slot, DType dtype, std::int64_t numel, graph::Device& dev, std::unique_lock<std::mutex>& lock);

  Combine op_;
  // The members' device names, for messages (the devices themselves are not kept: one may
  // be gone by then, as a dropped step at process exit abandons its rounds while its device
  // is destroyed).
  std::vector<std::string> names_;
  // Per member, how many times its node went back to the trace before finishing the round
  // (under mu_). Counts, not a flag: a member's attempts are compared with the waiter's own,
  // so a failure stops the attempt it happened in and no later one. (A device's failure
  // count would not do: the waiter's own error raises its device's count, and a round
  // traced before a failure would read it as a new one on every later attempt.)
  std::vector<int> abandoned_;
  // A group spanning processes: each member's process, how many members are on this
  // process's devices (local_), the first of them (leader_, which runs the exchange), and
  // the exchange's state (under mu_).
  std::uint64_t seq_ = 0;
  std::vector<int> process_;
  int local_ = 0;
  int leader_ = -1;
  int released_ = 0;
  bool exchanged_ = false;
  std::string exchange_error_;
  std::mutex mu_;
  std::condition_variable cv_;
  int arrived_ = 0;
  std::atomic<int> arrived_fast_{0};  // arrived_, readable without the lock (spinning)
  std::vector<std::uint8_t> arrived_marks_;  // per member
  std::vector<std::shared_ptr<Buffer>> inputs_;
  // The shared result and its chunks, set up by the first member to combine (under mu_,
  // after every input arrived; read-only afterwards; out_ set last).
  std::shared_ptr<Buffer> out_;
  std::vector<const void*> in_ptrs_;
  std::int64_t chunk_ = 0, chunks_ = 0;
  std::atomic<std::int64_t> next_chunk_{0};  // the next chunk to claim
  // Members inside their chunk loop: changed under mu_ (the condition variable's
  // predicate), atomic so that release() can spin on it without the lock.
  std::atomic<int> combining_{0};
};

/// Elements per chunk of a shared combine: 32 KiB of the result (L1-sized pieces that two
/// members can split evenly even for a layer's bias, while a claim, one atomic add, stays
/// negligible against summing them).
constexpr std::int64_t combine_chunk_elements(std::size_t elem_size) {
  return std::max<std::int64_t>(1, static_cast<std::int64_t>((std::size_t{32} << 10) / elem_size));
}

/// Combines `n` arrays of `numel` elements of `dtype` into `out`, in order.
void combine(Combine op, DType dtype, const std::vector<const void*>& in, void* out, std::int64_t numel) noexcept;

}  // namespace detail

/// A member's part of an all-reduce (NodeKind::Collective): its value is the group's
/// combination. Takes the device's previous SPMD collective as an extra input, so each
/// device meets its collectives in program order.
class AllReduceNode final : public graph::Node, public graph::Rendezvous {
 public:
  AllReduceNode(graph::NodePtr in, std::shared_ptr<detail::ReduceRound> round, int slot, graph::NodePtr previous);
  std::string op_name() const override { return "spmd_all_reduce"; }
  LAZYTENSOR_INLINE std::string describe() const override;
  LAZYTENSOR_INLINE std::uint64_t structural_hash() const override;
  void publish() override { round_->publish(slot_, inputs()[0]->buffer()); }
  std::shared_ptr<Buffer> combine(graph::ExecContext& ctx) override {
    return round_->combine(slot_, dtype(), numel(), ctx.device);
  }
  void release() override { round_->release(slot_); }
  void abandon() noexcept override { round_->abandon(slot_); }
  std::size_t data_inputs() const override { return 1; }

 protected:
  LAZYTENSOR_INLINE void compute(graph::ExecContext& ctx) override;

 private:
  std::shared_ptr<detail::ReduceRound> round_;
  int slot_;
};

/// Submits an all-reduce over `pieces` (one per member, each on its own device, in the
/// group's combining order) and returns the members' results in the same order. Counted
/// as SpmdAllReduces and SpmdAllReduceBytes (each member's input).
graph::NodeList all_reduce(const graph::NodeList& pieces, Combine op);

}  // namespace lazy::spmd

#if LAZYTENSOR_HEADER_DEFINITIONS
#include <chrono>
#include <map>
#include <thread>


namespace lazy::spmd {
namespace detail {

LAZYTENSOR_INLINE ReduceRound::ReduceRound(Combine op, const std::vector<graph::Device*>& members, std::uint64_t seq)
    : op_(op),
      abandoned_(members.size(), 0),
      seq_(seq),
      arrived_marks_(members.size()),
      inputs_(members.size()) {
  for (std::size_t m = 0; m < members.size(); ++m) {
    names_.push_back(members[m]->str());
    process_.push_back(members[m]->process());
    if (members[m]->remote()) continue;
    if (leader_ < 0) leader_ = static_cast<int>(m);
    ++local_;
  }
}

LAZYTENSOR_INLINE int ReduceRound::await(int slot, std::unique_lock<std::mutex>& lock, const int& count,
                                          const std::atomic<int>& fast, const std::vector<std::uint8_t>& marks,
                                          const char* what, int target) {
  const int n = target < 0 ? size() : target;
  if (count < n) {
    lock.unlock();
    const auto start = std::chrono::steady_clock::now();
    for (int spins = 0; fast.load(std::memory_order_acquire) < n; ++spins) {
      if (spins < 2000) continue;
      if (std::chrono::steady_clock::now() - start > std::chrono::milliseconds(2)) break;
      std::this_thread::yield();
    }
    lock.lock();
  }
  // A member waiting for inputs another process sends gives the leader's exchange (which
  // has the timeout of its own) time to end first.
  const bool behind_exchange = local_ < size() && slot != leader_;
  const auto deadline = std::chrono::steady_clock::now() + dist::collective_timeout() * (behind_exchange ? 2 : 1);
  while (count < n) {
    cv_.wait_for(lock, std::chrono::milliseconds(2));
    if (!exchange_error_.empty()) return -2;
    for (std::size_t m = 0; m < names_.size() && count < n; ++m) {
      if (!marks[m] && abandoned_[m] > abandoned_[static_cast<std::size_t>(slot)]) return static_cast<int>(m);
    }
    // The leader gave up before bringing the other processes' inputs: nobody else will.
    if (behind_exchange && !exchanged_ && abandoned_[static_cast<std::size_t>(leader_)] > abandoned_[static_cast<std::size_t>(slot)])
      return leader_;
    if (count < n && std::chrono::steady_clock::now() > deadline)
      throw CollectiveTimeout(std::string("SPMD all-reduce: waited longer than the collective timeout for ") +
                              std::to_string(n - count) + " of " + std::to_string(n) + " devices to " + what);
  }
  return -1;
}

LAZYTENSOR_INLINE void ReduceRound::abandon(int slot) noexcept {
  {
    std::lock_guard lock(mu_);
    ++abandoned_[static_cast<std::size_t>(slot)];
  }
  cv_.notify_all();
}

LAZYTENSOR_INLINE void ReduceRound::publish(int slot, std::shared_ptr<Buffer> in) {
  const auto s = static_cast<std::size_t>(slot);
  std::lock_guard lock(mu_);
  if (arrived_marks_[s]) return;  // offered before this step was run again (same value)
  inputs_[s] = std::move(in);
  arrived_marks_[s] = 1;
  if (++arrived_ == size()) cv_.notify_all();
  arrived_fast_.store(arrived_, std::memory_order_release);
}

LAZYTENSOR_INLINE std::shared_ptr<Buffer> ReduceRound::combine(int slot, DType dtype, std::int64_t numel,
                                                               graph::Device& dev) {
  std::unique_lock lock(mu_);
  // (An attempt after a failed exchange fails too: its messages no longer pair up.)
  throw_if_failed(exchange_error_.empty() ? -1 : -2);
  if (local_ < size() && slot == leader_ && !exchanged_) exchange_inputs(slot, dtype, numel, dev, lock);
  throw_if_failed(await(slot, lock, arrived_, arrived_fast_, arrived_marks_, "arrive"));
  const std::size_t es = dtype_size(dtype);
  if (!out_) {
    // Everything that may throw first: a member that fails here leaves the set-up to the
    // next one.
    auto out = dev.pool().acquire(padded_bytes(numel, es));
    std::vector<const void*> ptrs;
    for (const auto& b : inputs_) ptrs.push_back(b->data());
    out->mark_shared();
    in_ptrs_ = std::move(ptrs);
    chunk_ = combine_chunk_elements(es);
    chunks_ = (numel + chunk_ - 1) / chunk_;
    out_ = std::move(out);
  }
  std::shared_ptr<Buffer> out = out_;
  std::vector<const void*> ptrs(in_ptrs_.size());  // (allocated before counting in: the loop never throws)
  combining_.fetch_add(1, std::memory_order_relaxed);
  lock.unlock();
  // Claim chunks until none is left: whoever is there sums them, so the members share the
  // work however late each wakes up.
  for (std::int64_t c = next_chunk_.fetch_add(1, std::memory_order_relaxed); c < chunks_;
       c = next_chunk_.fetch_add(1, std::memory_order_relaxed)) {
    const std::int64_t begin = c * chunk_, n = std::min(chunk_, numel - begin);
    const auto offset = static_cast<std::size_t>(begin) * es;
    for (std::size_t k = 0; k < ptrs.size(); ++k) ptrs[k] = static_cast<const std::byte*>(in_ptrs_[k]) + offset;
    detail::combine(op_, dtype, ptrs, static_cast<std::byte*>(out->data()) + offset, n);
  }
  lock.lock();
  if (combining_.fetch_sub(1, std::memory_order_release) == 1) cv_.notify_all();
  return out;
}

LAZYTENSOR_INLINE void ReduceRound::release(int slot) {
  // The members still in their chunk loop finish within a chunk or a few (bounded work
  // that never blocks): spin briefly, then sleep. The decision is taken under the lock,
  // which orders their writes of the result before this member's reads of it.
  for (int spins = 0; spins < 4000 && combining_.load(std::memory_order_acquire) > 0; ++spins) {
  }
  std::unique_lock lock(mu_);
  cv_.wait(lock, [&] { return combining_.load(std::memory_order_relaxed) == 0; });
  inputs_[static_cast<std::size_t>(slot)].reset();
  // The last member here also lets go of the inputs received from other processes.
  if (local_ < size() && ++released_ == local_)
    for (std::size_t m = 0; m < inputs_.size(); ++m)
      if (process_[m] != process_[static_cast<std::size_t>(slot)]) inputs_[m].reset();
}

LAZYTENSOR_INLINE void ReduceRound::throw_if_failed(int failed) const {
  if (failed == -2)
    throw CollectiveError("SPMD all-reduce: the exchange with the group's other processes failed: " + exchange_error_);
  if (failed >= 0)
    throw CollectiveError("SPMD all-reduce: " + names_[static_cast<std::size_t>(failed)] +
                          " stopped before reaching it (its step failed; the error surfaces there)");
}

LAZYTENSOR_INLINE void ReduceRound::exchange_inputs(int slot, DType dtype, std::int64_t numel, graph::Device& dev,
                                                    std::unique_lock<std::mutex>& lock) {
  throw_if_failed(await(slot, lock, arrived_, arrived_fast_, arrived_marks_, "arrive", local_));
  const int here = process_[static_cast<std::size_t>(slot)];
  std::vector<int> others = process_;  // the group's other processes, ascending
  std::sort(others.begin(), others.end());
  others.erase(std::unique(others.begin(), others.end()), others.end());
  others.erase(std::find(others.begin(), others.end(), here));
  const std::size_t es = dtype_size(dtype), bytes = static_cast<std::size_t>(numel) * es;
  // Each side lists its messages to a process in slot order, so they pair up in order.
  std::vector<Transfer> sends, receives;
  std::vector<std::shared_ptr<Buffer>> got(inputs_.size());
  for (std::size_t m = 0; m < inputs_.size(); ++m) {
    if (process_[m] == here) {
      for (int q : others) sends.push_back({q, inputs_[m]->data(), bytes, inputs_[m]});
    } else {
      got[m] = dev.pool().acquire(padded_bytes(numel, es));
      receives.push_back({process_[m], got[m]->data(), bytes, got[m]});
    }
  }
  // What the round is: op, dtype, size and its members (global device ids).
  std::uint64_t signature = graph::hash_combine(
      graph::hash_combine(static_cast<std::uint64_t>(op_), static_cast<std::uint64_t>(dtype)), static_cast<std::uint64_t>(numel));
  for (const auto& name : names_) signature = graph::hash_combine(signature, std::hash<std::string>{}(name));
  lock.unlock();
  try {
    exchange(Channel::Reduce, seq_, signature, sends, receives, "all-reduce of " + std::to_string(numel) + " elements");
  } catch (const std::exception& e) {
    lock.lock();
    exchange_error_ = e.what();
    cv_.notify_all();
    throw;
  }
  lock.lock();
  for (std::size_t m = 0; m < inputs_.size(); ++m) {
    if (!got[m]) continue;
    inputs_[m] = std::move(got[m]);
    arrived_marks_[m] = 1;
    ++arrived_;
  }
  arrived_fast_.store(arrived_, std::memory_order_release);
  exchanged_ = true;
  cv_.notify_all();
}

LAZYTENSOR_INLINE std::shared_ptr<Buffer> ReduceRound::run(int slot, std::shared_ptr<Buffer> in, DType dtype,
                                                           std::int64_t numel, graph::Device& dev) {
  publish(slot, std::move(in));
  auto out = combine(slot, dtype, numel, dev);
  release(slot);
  return out;
}

template <class T, class Acc>
void combine_as(Combine op, const std::vector<const void*>& in, void* out, std::int64_t numel) noexcept {
  T* o = static_cast<T*>(out);
  for (std::int64_t i = 0; i < numel; ++i) {
    Acc acc = static_cast<Acc>(static_cast<const T*>(in[0])[i]);
    for (std::size_t k = 1; k < in.size(); ++k) {
      const Acc v = static_cast<Acc>(static_cast<const T*>(in[k])[i]);
      switch (op) {
        // Integers wrap (as dist's reductions): computed unsigned, where overflow is defined.
        case Combine::Sum:
          if constexpr (std::is_integral_v<Acc>)
            acc = static_cast<Acc>(static_cast<std::uint64_t>(acc) + static_cast<std::uint64_t>(v));
          else
            acc = static_cast<Acc>(acc + v);
          break;
        case Combine::Prod:
          if constexpr (std::is_integral_v<Acc>)
            acc = static_cast<Acc>(static_cast<std::uint64_t>(acc) * static_cast<std::uint64_t>(v));
          else
            acc = static_cast<Acc>(acc * v);
          break;
        // NaN propagates, as the reductions' max/min do.
        case Combine::Max: acc = (v > acc || v != v) && acc == acc ? v : acc; break;
        case Combine::Min: acc = (v < acc || v != v) && acc == acc ? v : acc; break;
      }
    }
    o[i] = static_cast<T>(acc);
  }
}

template <class T>
void sum_into(const std::vector<const void*>& in, void* out, std::int64_t numel) noexcept {
  // Member after member into the output: the inner loop vectorizes; the order of the
  // additions is the same as element by element in group order.
  T* o = static_cast<T*>(out);
  const T* a = static_cast<const T*>(in[0]);
  for (std::int64_t i = 0; i < numel; ++i) o[i] = a[i];
  for (std::size_t k = 1; k < in.size(); ++k) {
    const T* b = static_cast<const T*>(in[k]);
    for (std::int64_t i = 0; i < numel; ++i) o[i] += b[i];
  }
}

LAZYTENSOR_INLINE void combine(Combine op, DType dtype, const std::vector<const void*>& in, void* out,
                               std::int64_t numel) noexcept {
  if (op == Combine::Sum && dtype == DType::Float32) return sum_into<float>(in, out, numel);
  if (op == Combine::Sum && dtype == DType::Float64) return sum_into<double>(in, out, numel);
  switch (dtype) {
    case DType::Float32: return combine_as<float, float>(op, in, out, numel);
    case DType::Float64: return combine_as<double, double>(op, in, out, numel);
    case DType::BFloat16: return combine_as<bfloat16, float>(op, in, out, numel);
    case DType::Int32: return combine_as<std::int32_t, std::int64_t>(op, in, out, numel);
    case DType::Int64: return combine_as<std::int64_t, std::int64_t>(op, in, out, numel);
    case DType::Bool: {
      // Sum and Max act as or, Prod and Min as and (torch.distributed's bool semantics).
      auto* o = static_cast<bool*>(out);
      const bool any = op == Combine::Sum || op == Combine::Max;
      for (std::int64_t i = 0; i < numel; ++i) {
        bool acc = static_cast<const bool*>(in[0])[i];
        for (std::size_t k = 1; k < in.size(); ++k) {
          const bool v = static_cast<const bool*>(in[k])[i];
          acc = any ? (acc || v) : (acc && v);
        }
        o[i] = acc;
      }
      return;
    }
  }
}

}  // namespace detail

LAZYTENSOR_INLINE AllReduceNode::AllReduceNode(graph::NodePtr in, std::shared_ptr<detail::ReduceRound> round, int slot,
                                               graph::NodePtr previous)
    : Node(graph::NodeKind::Collective, in->dtype(), in->shape(), in->device(),
           previous ? graph::NodeList{in, previous} : graph::NodeList{in}),
      round_(std::move(round)), slot_(slot) {}

LAZYTENSOR_INLINE std::string AllReduceNode::describe() const {
  static const char* names[] = {"sum", "prod", "max", "min"};
  return std::string("spmd_all_reduce(%0, ") + names[static_cast<int>(round_->op())] + ", group of " +
         std::to_string(round_->size()) + ")";
}

LAZYTENSOR_INLINE std::uint64_t AllReduceNode::structural_hash() const {
  return graph::hash_combine(graph::hash_combine(Node::structural_hash(), static_cast<std::uint64_t>(round_->op())),
                             static_cast<std::uint64_t>(round_->size() * 64 + slot_));
}

LAZYTENSOR_INLINE void AllReduceNode::compute(graph::ExecContext& ctx) {
  set_buffer(round_->run(slot_, inputs()[0]->buffer(), dtype(), numel(), ctx.device));
}

LAZYTENSOR_INLINE graph::NodeList all_reduce(const graph::NodeList& pieces, Combine op) {
  static auto& count = core::counter("SpmdAllReduces");
  static auto& bytes = core::counter("SpmdAllReduceBytes");
  // Each device's last collective, so that its collectives run in program order (traced
  // by the program thread only).
  static std::map<const graph::Device*, std::weak_ptr<graph::Node>> last;
  static std::uint64_t rounds = 0;  // every process of a span traces the same rounds
  if (static_cast<unsigned>(op) > static_cast<unsigned>(Combine::Min)) {
    throw Error("spmd all_reduce: invalid Combine " + std::to_string(static_cast<int>(op)) +
                " (expected Sum, Prod, Max or Min)");
  }
  // Every member combines numel() elements of every input: they must agree.
  for (std::size_t i = 0; i < pieces.size(); ++i) {
    if (!pieces[i]) throw Error("spmd all_reduce: piece " + std::to_string(i) + " is null");
    const graph::Node &p = *pieces[i], &first = *pieces[0];
    if (p.dtype() != first.dtype()) {
      throw DTypeError("spmd all_reduce: piece " + std::to_string(i) + " has dtype " +
                       dtype_name(p.dtype()) + ", piece 0 " + dtype_name(first.dtype()));
    }
    if (!(p.shape() == first.shape())) {
      throw ShapeError("spmd all_reduce: piece " + std::to_string(i) + " has shape " +
                       p.shape().str() + ", piece 0 " + first.shape().str());
    }
    for (std::size_t j = 0; j < i; ++j) {
      if (pieces[j]->device() == p.device()) {
        throw DeviceError("spmd all_reduce: pieces " + std::to_string(j) + " and " +
                          std::to_string(i) + " are both on " + p.device()->str() +
                          " (expected one piece per device)");
      }
    }
  }
  count.add();
  std::vector<graph::Device*> members;
  for (const auto& p : pieces) members.push_back(p->device());
  auto round = std::make_shared<detail::ReduceRound>(op, members, rounds++);
  graph::NodeList out;
  for (std::size_t i = 0; i < pieces.size(); ++i) {
    bytes.add(pieces[i]->numel() * static_cast<std::int64_t>(dtype_size(pieces[i]->dtype())));
    auto& prev = last[members[i]];
    graph::NodePtr before = prev.lock();
    if (before && !before->pending()) before.reset();
    auto node = graph::submit_unpartitioned(
        std::make_shared<AllReduceNode>(pieces[i], round, static_cast<int>(i), std::move(before)));
    prev = node;
    out.push_back(std::move(node));
  }
  return out;
}

}  // namespace lazy::spmd
#endif  // LAZYTENSOR_HEADER_DEFINITIONS
