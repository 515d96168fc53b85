#pragma once
// Runtime graph nodes. A node is a type-erased kernel plus its inputs; once computed it
// keeps only its buffer and drops its inputs, so the graph behind it can be freed.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <lazytensor/core/block_cache.hpp>
#include <lazytensor/core/buffer.hpp>
#include <lazytensor/core/dtype.hpp>
#include <lazytensor/core/shape.hpp>
#include <lazytensor/core/small_vector.hpp>
#include <lazytensor/core/config.hpp>

namespace lazy::graph {

class Device;
class Node;
using NodePtr = std::shared_ptr<Node>;
/// A list of nodes (as expr/expr_node.hpp declares it for the layer below).
using NodeList = std::vector<NodePtr, core::BlockAllocator<NodePtr>>;

namespace detail {
/// Input pointers of a node's kernel, inline for a handful (no allocation per run).
using InputPointers = core::SmallVector<const void*, 8>;
}  // namespace detail

/// What a node's kernel does, for the planner and for graph dumps.
/// `Sharded`: the whole value of a tensor sharded over a mesh (lazy::spmd), whose pieces are
/// nodes on the mesh's devices; it is never traced or planned, only read (which gathers).
enum class NodeKind { Data, Elementwise, Reduction, Gemm, View, Copy, Random, Host, Collective, Sharded };

/// Execution context handed to a kernel.
struct ExecContext {
  Device& device;
};

/// How a node computes block by block (read by the SPMD partitioner, lazy::spmd): for each
/// output dimension, whether a block along it can be computed alone (`splittable`), and for
/// each input the dimension of that input that has the output dimension's size and is cut
/// into the same blocks (`input_dim[input][output dim]`, -1: every block reads that input
/// whole along it, e.g. a broadcast). An input dimension no splittable output dimension
/// names must be whole in every block.
struct BlockRule {
  std::vector<bool> splittable;
  std::vector<std::vector<int>> input_dim;
};

/// The block rule of a copy along dimension `dim` of its first input (a slice, an
/// index_select): the output's other dimensions are the input's and may be split; `dim`
/// is read whole, and so are the other inputs (`inputs` in all).
inline BlockRule all_but_dim_rule(int rank, int dim, std::size_t inputs) {
  BlockRule r{std::vector<bool>(static_cast<std::size_t>(rank), true),
              std::vector<std::vector<int>>(inputs, std::vector<int>(static_cast<std::size_t>(rank), -1))};
  for (int o = 0; o < rank; ++o) r.input_dim[0][static_cast<std::size_t>(o)] = o;
  r.splittable[static_cast<std::size_t>(dim)] = false;
  r.input_dim[0][static_cast<std::size_t>(dim)] = -1;
  return r;
}

/// The block rule of gather and of its adjoint scatter_add (two inputs, cut alike): every
/// dimension but `dim` where `other` (the gathered input, the scattered index) has the
/// output's size splits; the rest are whole.
inline BlockRule same_size_but_dim_rule(const Shape& out, const Shape& other, int dim) {
  const int rank = out.rank();
  BlockRule r{std::vector<bool>(static_cast<std::size_t>(rank), false),
              {std::vector<int>(static_cast<std::size_t>(rank), -1), std::vector<int>(static_cast<std::size_t>(rank), -1)}};
  for (int o = 0; o < rank && other.rank() == rank; ++o) {
    if (o == dim || other[o] != out[o]) continue;
    r.splittable[static_cast<std::size_t>(o)] = true;
    r.input_dim[0][static_cast<std::size_t>(o)] = r.input_dim[1][static_cast<std::size_t>(o)] = o;
  }
  return r;
}

/// The block rule of an op that computes each index of its leading `lead` dimensions alone
/// from the same index of every input's leading dimensions (the images and channels of a
/// convolution's im2col or of pooling): those are splittable, the rest whole.
inline BlockRule leading_dims_rule(int rank, int lead, std::size_t inputs) {
  BlockRule r{std::vector<bool>(static_cast<std::size_t>(rank), false),
              std::vector<std::vector<int>>(inputs, std::vector<int>(static_cast<std::size_t>(rank), -1))};
  for (int o = 0; o < lead && o < rank; ++o) {
    r.splittable[static_cast<std::size_t>(o)] = true;
    for (auto& map : r.input_dim) map[static_cast<std::size_t>(o)] = o;
  }
  return r;
}

/// A value in the pending graph of one device.
class Node {
 public:
  Node(NodeKind kind, DType dtype, Shape shape, Device* device, NodeList inputs = {});
  /// (The runtime's: every node class's destructor, one per expression type, calls it
  /// rather than inlining the release of the inputs and the members.)
  virtual ~Node();
  Node(const Node&) = delete;
  Node& operator=(const Node&) = delete;

  NodeKind kind() const { return kind_; }
  DType dtype() const { return dtype_; }
  const Shape& shape() const { return shape_; }
  std::int64_t numel() const { return shape_.numel(); }
  Device* device() const { return device_; }
  /// Order on its device: numbered when first traced there (0 until then), under the
  /// device's trace lock. A per-device count, not a process-wide atomic: that was a
  /// locked instruction per node.
  std::uint64_t id() const { return id_; }
  const NodeList& inputs() const { return inputs_; }

  /// Whether a tensor object holds this node as its value (graph::HandleNode counts
  /// them): mark_step computes the pending nodes that one does, and what they read.
  bool has_handles() const { return handles_.load(std::memory_order_acquire) > 0; }
  void add_handle() noexcept { handles_.fetch_add(1, std::memory_order_relaxed); }
  void drop_handle() noexcept { handles_.fetch_sub(1, std::memory_order_release); }

  /// Lifecycle: Pending (being traced; only the tracing thread touches it), Queued (handed
  /// to an execution plan: the tracing thread may hold it as an input but must not look
  /// inside), Ready (the buffer is set and immutable). Set with release, read with acquire,
  /// so a Ready node's buffer is visible to whoever sees the state.
  enum class State : std::uint8_t { Pending, Queued, Ready };
  State state() const { return state_.load(std::memory_order_acquire); }
  void set_state(State s) { state_.store(s, std::memory_order_release); }
  /// True while the node is still being traced: its inputs and kernel may be inspected.
  bool pending() const { return state() == State::Pending; }
  /// True once the value exists in a buffer.
  bool materialized() const { return state() == State::Ready; }
  const std::shared_ptr<Buffer>& buffer() const { return buffer_; }
  template <class T>
  const T* data() const {
    return static_cast<const T*>(buffer_->data());
  }

  /// Short op name ("add", "matmul", ...).
  virtual std::string op_name() const = 0;
  /// Longer description for graph dumps (the fused expression, reduction dims, ...).
  virtual std::string describe() const { return op_name(); }
  /// Hash of everything that determines the kernel's code and layout, but not its data
  /// (cached: a node's structure never changes).
  std::uint64_t hash() const;
  /// Computes the structural hash (override to add kernel parameters).
  LAZYTENSOR_INLINE virtual std::uint64_t structural_hash() const;
  /// The part of structural_hash every node shares: kind, dtype, shape, and the inputs'
  /// dtypes and shapes (an override that names its op without building op_name()'s string
  /// starts from it).
  std::uint64_t layout_hash() const;
  /// Estimated cost per output element (1 = one add), used to decide threading.
  virtual double cost_per_element() const { return 1.0; }

  /// The node's block rule, or nullopt when it has none (the partitioner then gathers).
  virtual std::optional<BlockRule> block_rule() const { return std::nullopt; }
  /// The same kernel over `inputs` (blocks of this node's inputs as its block rule cuts
  /// them), producing `shape` on `device`, not yet submitted. Null without a block rule.
  virtual std::shared_ptr<Node> with_inputs(NodeList inputs, Shape shape,
                                            Device* device) const {
    (void)inputs, (void)shape, (void)device;
    return nullptr;
  }

  /// Computes the value into a buffer. Called once, after every input is materialized.
  void run(ExecContext& ctx);

  /// Ends a run from outside: the value is `buf` (or, without one, it lived only in a fused
  /// group's scratch and nothing can read it), and the inputs are released.
  void finish_with(std::shared_ptr<Buffer> buf);

  /// Planner hook, called once per plan before execution, while the plan holds one extra
  /// reference to every node in it: a node may take over (defer) a producer's work, e.g. an
  /// element-wise epilogue running a GEMM in row blocks.
  virtual void fuse_producers() {}
  /// True when a consumer has taken over this node's computation for the current plan.
  bool deferred() const { return deferred_; }
  void set_deferred(bool d) { deferred_ = d; }

  /// Makes this node a materialized value holding `buf` (used by data nodes and views).
  void set_buffer(std::shared_ptr<Buffer> buf);

  /// The planner's scratch: this node's position in the plan being built (valid while
  /// `plan_epoch` matches the planner's epoch). Touched by the planning thread only.
  std::int32_t plan_slot = -1;
  std::uint64_t plan_epoch = 0;

  /// Steals the buffer of input `i` when nothing else can observe it (buffer donation):
  /// this node is the input's only holder, the input's buffer is not shared (views), and
  /// the input has this node's dtype and element count.
  std::shared_ptr<Buffer> try_donate(std::size_t i);

  /// Donation to a fused group: takes the buffer of materialized `n` when exactly
  /// `holders` references to it exist (all held by the group's members, which read it at
  /// the positions they write) and no view shares the buffer. Else null.
  static std::shared_ptr<Buffer> take_buffer(const NodePtr& n, long holders);

 protected:
  virtual void compute(ExecContext& ctx) = 0;
  /// Drops the kernel's inputs and state after it ran.
  virtual void finish() { inputs_.clear(); }
  /// Allocates this node's output from the device pool, or takes a donated input buffer.
  std::shared_ptr<Buffer> allocate_output(ExecContext& ctx, bool allow_donation = true);

  NodeList& mutable_inputs() { return inputs_; }

 private:
  /// Drops input references without recursion: a long pending chain (`a = a + 1` repeated
  /// 10^5 times, never computed) would otherwise be freed by nested destructor calls and
  /// overflow the stack. The outermost call drains a worklist; nested ones append to it.
  static void release_chain(NodeList& inputs) noexcept;

  friend class Device;  // numbers the node when it traces it

  NodeKind kind_;
  DType dtype_;
  Shape shape_;
  Device* device_;
  NodeList inputs_;
  std::shared_ptr<Buffer> buffer_;
  std::uint64_t id_ = 0;
  std::atomic<State> state_{State::Pending};
  std::atomic<std::int32_t> handles_{0};
  bool deferred_ = false;
  mutable bool hash_valid_ = false;
  mutable std::uint64_t hash_ = 0;
};

/// A collective node (NodeKind::Collective) whose run meets its peers on other devices in
/// three phases. The planner batches a step's collectives that nothing between them reads
/// (PlanStep::Kind::Batch): every member publishes, then each combines, then each
/// releases, so a device waits for its slowest peer once per batch rather than once per
/// collective. Each phase waits only on the same or an earlier phase of the same or an
/// earlier collective, and every device meets its collectives in program order, so
/// devices that batch differently (a read runs part of a step) still meet.
class Rendezvous {
 public:
  /// Offers this member's input to its peers; never waits.
  virtual void publish() = 0;
  /// Waits for every peer's input and returns the buffer that will hold the combination
  /// (the members may share it, marked shared); complete only once release() returns, so
  /// nothing reads it before (run_batch finishes the node after the release).
  virtual std::shared_ptr<Buffer> combine(ExecContext& ctx) = 0;
  /// Waits until no peer reads this member's input any more and the combination is
  /// complete, then lets go of the input.
  virtual void release() = 0;
  /// How many of the inputs, from the first, are values it reads; the rest only order it
  /// (the device's previous collective, program order).
  virtual std::size_t data_inputs() const = 0;
  /// This member's step stopped before the collective finished here (a failure ahead of
  /// it): the node goes back to the trace (return_to_trace). Peers waiting for an input it
  /// never published then fail with CollectiveError instead of waiting out the timeout;
  /// when the step runs again, they wait for it as usual.
  virtual void abandon() noexcept = 0;

 protected:
  ~Rendezvous() = default;
};

/// A value that already exists (factories, reads from host memory, computed results).
class DataNode final : public Node {
 public:
  DataNode(DType dtype, Shape shape, Device* device, std::shared_ptr<Buffer> buf);
  std::string op_name() const override { return "data"; }

 protected:
  void compute(ExecContext&) override {}
};

/// The block rule of an op whose output dimension o reads dimension o - (rank - input rank)
/// of each input (dimensions aligned right, NumPy broadcasting), a size-1 input dimension
/// being read whole: element-wise kernels, conversions.
BlockRule aligned_block_rule(const Shape& out, const NodeList& inputs);

/// Combines hashes (boost::hash_combine's mixing).
inline std::uint64_t hash_combine(std::uint64_t seed, std::uint64_t v) {
  return seed ^ (v + 0x9e3779b97f4a7c15ull + (seed << 6) + (seed >> 2));
}

std::uint64_t hash_shape(const Shape& s);

}  // namespace lazy::graph

#if LAZYTENSOR_HEADER_DEFINITIONS
namespace lazy::graph {

LAZYTENSOR_INLINE Node::Node(NodeKind kind, DType dtype, Shape shape, Device* device, NodeList inputs)
    : kind_(kind), dtype_(dtype), shape_(shape), device_(device), inputs_(std::move(inputs)) {}

LAZYTENSOR_INLINE Node::~Node() { release_chain(inputs_); }

LAZYTENSOR_INLINE std::uint64_t Node::hash() const {
  if (!hash_valid_) {
    hash_ = structural_hash();
    hash_valid_ = true;
  }
  return hash_;
}

LAZYTENSOR_INLINE void Node::run(ExecContext& ctx) {
  compute(ctx);
  finish();
}

LAZYTENSOR_INLINE void Node::finish_with(std::shared_ptr<Buffer> buf) {
  if (buf) set_buffer(std::move(buf));
  else set_state(State::Ready);
  finish();
}

LAZYTENSOR_INLINE void Node::set_buffer(std::shared_ptr<Buffer> buf) {
  buffer_ = std::move(buf);
  set_state(State::Ready);
}

LAZYTENSOR_INLINE std::shared_ptr<Buffer> Node::take_buffer(const NodePtr& n, long holders) {
  if (!n->materialized() || !n->buffer_ || n.use_count() != holders || n->buffer_.use_count() != 1 ||
      n->buffer_->shared())
    return nullptr;
  return std::move(n->buffer_);
}

LAZYTENSOR_INLINE void Node::release_chain(NodeList& inputs) noexcept {
  thread_local NodeList* worklist = nullptr;
  if (worklist) {
    for (auto& p : inputs) worklist->push_back(std::move(p));
    inputs.clear();
    return;
  }
  NodeList work = std::move(inputs);
  inputs.clear();
  worklist = &work;
  while (!work.empty()) {
    NodePtr n = std::move(work.back());
    work.pop_back();
    n.reset();  // a node destroyed here appends its own inputs to `work`
  }
  worklist = nullptr;
}

LAZYTENSOR_INLINE DataNode::DataNode(DType dtype, Shape shape, Device* device, std::shared_ptr<Buffer> buf)
    : Node(NodeKind::Data, dtype, shape, device) {
  set_buffer(std::move(buf));
}

LAZYTENSOR_INLINE BlockRule aligned_block_rule(const Shape& out, const NodeList& inputs) {
  const int rank = out.rank();
  BlockRule r{std::vector<bool>(static_cast<std::size_t>(rank), true), {}};
  for (const auto& in : inputs) {
    const int off = rank - in->shape().rank();
    std::vector<int> map(static_cast<std::size_t>(rank), -1);
    for (int o = std::max(off, 0); o < rank; ++o)
      if (in->shape()[o - off] == out[o]) map[static_cast<std::size_t>(o)] = o - off;
    r.input_dim.push_back(std::move(map));
  }
  return r;
}

LAZYTENSOR_INLINE std::uint64_t hash_shape(const Shape& s) {
  std::uint64_t h = static_cast<std::uint64_t>(s.rank());
  for (auto d : s) h = hash_combine(h, static_cast<std::uint64_t>(d));
  return h;
}

LAZYTENSOR_INLINE std::uint64_t Node::layout_hash() const {
  std::uint64_t h = hash_combine(static_cast<std::uint64_t>(kind_), static_cast<std::uint64_t>(dtype_));
  h = hash_combine(h, hash_shape(shape_));
  for (const auto& in : inputs_) {
    h = hash_combine(h, static_cast<std::uint64_t>(in->dtype()));
    h = hash_combine(h, hash_shape(in->shape()));
  }
  return h;
}

LAZYTENSOR_INLINE std::uint64_t Node::structural_hash() const {
  return hash_combine(layout_hash(), std::hash<std::string>{}(op_name()));
}

LAZYTENSOR_INLINE std::shared_ptr<Buffer> Node::try_donate(std::size_t i) {
  const NodePtr& in = inputs_[i];
  if (in->dtype() != dtype_ || in->numel() != numel()) return nullptr;
  long holders = 0;
  for (const auto& p : inputs_) holders += (p == in);
  return take_buffer(in, holders);
}

}  // namespace lazy::graph
#endif  // LAZYTENSOR_HEADER_DEFINITIONS
