#pragma once
// Collectives in the graph. A tensor collective is two kinds of node:
//  - an ExchangeNode, which runs one round of its group's exchange and computes every
//    output of the collective (several for a coalesced all_reduce); its own value is an
//    empty token, so chaining exchanges in program order holds no data alive;
//  - one ResultNode per output, which takes its buffer from the exchange (no copy).
// An exchange that fails is nevertheless done (it never joins its group again with a
// sequence number the others have moved past): it keeps the error, and its result nodes
// re-throw it whenever they are read.

#include <array>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <lazytensor/core/block_cache.hpp>
#include <lazytensor/core/config.hpp>
#include <lazytensor/dist/context.hpp>
#include <lazytensor/graph/submit.hpp>

namespace lazy::dist::detail {

/// The shared empty value of every exchange node.
const std::shared_ptr<Buffer>& token_buffer();

/// One round of a group exchange, computing every output of a collective (one per input).
class ExchangeNode : public graph::Node {
 public:
  /// `data` are the collective's inputs; `after` (may be null) is the replica's previous
  /// pending exchange, which must run first.
  ExchangeNode(CollectiveCall call, graph::NodeList data, const graph::NodePtr& after,
               graph::Device* device);

  std::string op_name() const override { return kind_name(call_.sig.kind); }
  LAZYTENSOR_INLINE std::string describe() const override;
  /// The kind stands for op_name() (no string per traced collective).
  std::uint64_t structural_hash() const override {
    return graph::hash_combine(layout_hash(), 0x45786368616e6765ull + static_cast<std::uint64_t>(call_.sig.kind));
  }
  double cost_per_element() const override { return 0; }

  /// Lets the exchange drop output `i` at once when its result node is gone.
  void watch(std::size_t i, const graph::NodePtr& result) { results_[i] = result; }
  /// Hands output `i` to its result node; re-throws the exchange's error if it failed.
  std::shared_ptr<Buffer> take(std::size_t i) {
    if (failure_) std::rethrow_exception(failure_);
    return std::move(outputs_[i]);
  }
  const CollectiveCall& call() const { return call_; }
  /// The collective's inputs (the extra program-order input excluded).
  std::size_t data_count() const { return data_count_; }
  const graph::NodePtr& data(std::size_t i) const { return inputs()[i]; }

 protected:
  LAZYTENSOR_INLINE void compute(graph::ExecContext& ctx) final;
  LAZYTENSOR_INLINE void finish() override;

  /// Runs the exchange; returns one buffer per output.
  virtual std::vector<std::shared_ptr<Buffer>> run(graph::ExecContext& ctx) = 0;

  const std::byte* bytes(std::size_t i) const {
    return static_cast<const std::byte*>(inputs()[i]->buffer()->data());
  }

  static std::shared_ptr<Buffer> allocate(graph::ExecContext& ctx, std::int64_t numel,
                                          std::size_t elem) {
    return ctx.device.pool().acquire(padded_bytes(numel, elem));
  }

 private:
  static graph::NodeList with_after(graph::NodeList data,
                                                const graph::NodePtr& after);

  CollectiveCall call_;
  std::size_t data_count_;
  std::vector<std::shared_ptr<Buffer>> outputs_;
  std::vector<std::weak_ptr<graph::Node>> results_;
  std::exception_ptr failure_;
};

/// Output `index` of an exchange.
class ResultNode final : public graph::Node {
 public:
  ResultNode(const std::shared_ptr<ExchangeNode>& ex, std::size_t index, DType dtype, Shape shape);
  std::string op_name() const override {
    return kind_name(static_cast<const ExchangeNode&>(*inputs()[0]).call().sig.kind);
  }
  std::uint64_t structural_hash() const override {
    return graph::hash_combine(graph::hash_combine(layout_hash(), 0x526573756c744e6full), index_);
  }
  double cost_per_element() const override { return 0; }

 protected:
  void compute(graph::ExecContext&) override {
    set_buffer(static_cast<ExchangeNode&>(*inputs()[0]).take(index_));
  }

 private:
  std::size_t index_;
};

/// dtype and shape of one output.
struct OutputSpec {
  DType dtype;
  Shape shape;
};

/// The device a collective's nodes go to: inside spawn, the replica's own device (its
/// inputs must live there); outside, the inputs' common device.
graph::Device& collective_device(const graph::NodeList& inputs, const char* op);

/// Submits an exchange and its result nodes (in this order, so eager mode works); returns
/// the result nodes.
graph::NodeList submit_exchange(const std::shared_ptr<ExchangeNode>& ex,
                                            const std::vector<OutputSpec>& outs);

/// Up to 16 pointers without allocating (one per group member).
template <class T>
class PtrList {
 public:
  explicit PtrList(std::size_t n) : n_(n) {
    if (n > small_.size()) big_.resize(n);
  }
  T*& operator[](std::size_t i) { return n_ > small_.size() ? big_[i] : small_[i]; }
  T* const* data() const { return n_ > small_.size() ? big_.data() : small_.data(); }

 private:
  std::size_t n_;
  std::array<T*, 16> small_{};
  std::vector<T*> big_;
};

}  // namespace lazy::dist::detail

#if LAZYTENSOR_HEADER_DEFINITIONS
namespace lazy::dist::detail {
LAZYTENSOR_INLINE const std::shared_ptr<Buffer>& token_buffer() {
  static const std::shared_ptr<Buffer> tok = std::make_shared<Buffer>(
      ::operator new(kBufferAlign, std::align_val_t(kBufferAlign)), kBufferAlign, nullptr);
  return tok;
}

LAZYTENSOR_INLINE ExchangeNode::ExchangeNode(CollectiveCall call, graph::NodeList data,
                                             const graph::NodePtr& after, graph::Device* device)
    : Node(graph::NodeKind::Collective, DType::Bool, Shape{0}, device,
           with_after(std::move(data), after)),
      call_(std::move(call)),
      data_count_(inputs().size() - (after ? 1 : 0)),
      outputs_(data_count_),
      results_(data_count_) {}

LAZYTENSOR_INLINE std::string ExchangeNode::describe() const {
  return call_.sig.str() + (call_.comm ? " #" + std::to_string(call_.seq) : std::string());
}

LAZYTENSOR_INLINE void ExchangeNode::compute(graph::ExecContext& ctx) {
  std::vector<std::shared_ptr<Buffer>> outs;
  try {
    outs = run(ctx);
  } catch (...) {
    // Done for good: the exchange never runs again (its group has moved on); the
    // error goes to whoever reads a result.
    failure_ = std::current_exception();
    set_buffer(token_buffer());
    finish();
    throw;
  }
  for (std::size_t i = 0; i < outs.size(); ++i) {
    if (results_[i].expired()) outs[i].reset();
  }
  outputs_ = std::move(outs);
  set_buffer(token_buffer());
}

LAZYTENSOR_INLINE void ExchangeNode::finish() {
  Node::finish();
  call_.comm.reset();
}

LAZYTENSOR_INLINE graph::NodeList ExchangeNode::with_after(
    graph::NodeList data, const graph::NodePtr& after) {
  if (after) data.push_back(after);
  return data;
}

LAZYTENSOR_INLINE ResultNode::ResultNode(const std::shared_ptr<ExchangeNode>& ex, std::size_t index,
                                         DType dtype, Shape shape)
    : Node(graph::NodeKind::Collective, dtype, shape, ex->device(), {ex}), index_(index) {}

LAZYTENSOR_INLINE graph::Device& collective_device(const graph::NodeList& inputs,
                                                   const char* op) {
  if (!current_context()) return graph::common_device(inputs, op);
  graph::Device& dev = graph::current_device();
  for (const auto& in : inputs) {
    if (in->device() != &dev) {
      throw DeviceError(std::string(op) + ": replica " + std::to_string(ordinal_now()) +
                        " expected its tensors on its own device " + dev.str() + ", found one on " +
                        in->device()->str());
    }
  }
  return dev;
}

LAZYTENSOR_INLINE graph::NodeList submit_exchange(
    const std::shared_ptr<ExchangeNode>& ex, const std::vector<OutputSpec>& outs) {
  graph::NodeList results;
  results.reserve(outs.size());
  for (std::size_t i = 0; i < outs.size(); ++i) {
    auto r = core::make_cached<ResultNode>(ex, i, outs[i].dtype, outs[i].shape);
    ex->watch(i, r);
    results.push_back(std::move(r));
  }
  if (ex->call().comm) remember(ex);
  graph::submit(ex);
  for (auto& r : results) graph::submit(r);
  return results;
}
}  // namespace lazy::dist::detail
#endif  // LAZYTENSOR_HEADER_DEFINITIONS
