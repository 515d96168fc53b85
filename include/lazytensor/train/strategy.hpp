#pragma once
// train::Strategy, Lightning's Strategy: where a model runs and how its replicas talk.
// The Trainer (and a hand-written loop) call these methods, never lazy::dist directly, so
// the same loop runs on one device or on replicas.
//
// A strategy object is shared by the replicas launch() starts: every replica calls its
// methods from its own thread, and whatever depends on the replica (rank, device) is read
// from the replica's runtime, never stored in the object. Methods that exchange data are
// collectives: every replica must call them in the same order (a replica that skips one is
// a CollectiveMismatch on the others, as in lazy::dist; never a hang).

#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cstdint>
#include <cerrno>
#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include <lazytensor/autograd/record.hpp>
#include <lazytensor/core/config.hpp>
#include <lazytensor/core/error.hpp>
#include <lazytensor/dist/collectives.hpp>
#include <lazytensor/dist/host_collectives.hpp>
#include <lazytensor/dist/parallel_loader.hpp>
#include <lazytensor/dist/runtime.hpp>
#include <lazytensor/dist/spawn.hpp>
#include <lazytensor/io/file.hpp>
#include <lazytensor/io/save.hpp>
#include <lazytensor/nn/module.hpp>
#include <lazytensor/ops/reshape.hpp>
#include <lazytensor/optim/optimizer.hpp>
#include <lazytensor/spmd/span.hpp>
#include <lazytensor/state_dict.hpp>
#include <lazytensor/tensor/device.hpp>
#include <lazytensor/train/precision.hpp>

namespace lazy::train {

namespace detail {

/// A reduction named as Lightning names it ("mean"/"avg", "sum", "max", "min", "product";
/// any case): the dist op, and whether it is a mean.
struct ParsedReduceOp {
  ReduceOp op;
  bool mean;
};
ParsedReduceOp parse_reduce_op(std::string_view name);

template <class B>
struct is_tensor : std::false_type {};
template <Element T>
struct is_tensor<Tensor<T>> : std::true_type {};

/// Tensors moved to `dev` and passed to `place` (a strategy's place_input); containers
/// element by element; anything else unchanged.
template <class B, class Place>
B to_device(const B& b, const Device& dev, const Place& place) {
  if constexpr (is_tensor<B>::value) {
    if (!b.defined()) return b;
    AnyTensor moved(b.to(dev));
    place(moved);
    return moved.template as<typename B::value_type>();
  } else if constexpr (requires { b.data; b.target; }) {  // data::Example
    return B{to_device(b.data, dev, place), to_device(b.target, dev, place)};
  } else if constexpr (requires { std::tuple_size<B>::value; }) {
    return std::apply([&](const auto&... xs) { return B{to_device(xs, dev, place)...}; }, b);
  } else if constexpr (requires(B& out) { b.begin(); b.end(); out.push_back(*b.begin()); }) {
    B out;
    for (const auto& x : b) out.push_back(to_device(x, dev, place));
    return out;
  } else {
    return b;
  }
}

}  // namespace detail

/// Lightning's Strategy: the device, the launch of replicas, and the collectives a training
/// loop needs. Subclasses: SingleDeviceStrategy, ReplicaStrategy, SpmdStrategy.
class Strategy {
 public:
  virtual ~Strategy() = default;

  // ---- where and how many --------------------------------------------------------------

  /// The device this replica computes on.
  virtual Device root_device() const = 0;
  /// Replicas launch() starts (1 for a single device).
  virtual int num_processes() const = 0;
  /// Whether collectives span replicas (false: they return their input, as Lightning's
  /// SingleDeviceStrategy does; all_gather then adds no dimension).
  virtual bool is_distributed() const = 0;
  /// Replicas in the world (1 outside launch).
  int world_size() const { return runtime::world_size(); }
  /// This replica's rank in the world (0 outside launch, and in every process of an SPMD
  /// program spanning processes: each runs the one replica, with the same seeds).
  int global_rank() const { return runtime::global_ordinal(); }
  /// This replica's rank on its host.
  int local_rank() const { return runtime::local_ordinal(); }
  /// True on global rank 0, the replica that writes checkpoints and logs (in an SPMD
  /// program spanning processes, rank 0 of process 0 only).
  bool is_global_zero() const { return global_rank() == 0 && spmd::detail::process_span().index == 0; }

  // ---- set-up ----------------------------------------------------------------------------

  /// Prepares the replica's environment (called by launch() on every replica first).
  virtual void setup_environment() {}
  /// Prepares `model` for training on this replica: converts it to the precision plugin's
  /// dtype, moves it to root_device() (and, with replicas, makes every replica's parameters
  /// and buffers rank 0's).
  virtual void setup(nn::Module& model) {
    precision_plugin().convert_module(model);
    model_to_device(model);
  }
  /// The precision plugin (default_precision() unless set).
  Precision& precision_plugin() const { return *precision_; }
  /// Replaces the precision plugin (before setup; every replica shares it).
  void set_precision_plugin(std::shared_ptr<Precision> plugin) {
    if (!plugin) throw Error("Strategy::set_precision_plugin: the plugin is empty");
    precision_ = std::move(plugin);
  }
  /// Moves every parameter and buffer of `model` to root_device().
  virtual void model_to_device(nn::Module& model) { model.to(root_device()); }
  /// `batch` with its tensors on root_device(): a tensor, or a pair, tuple, array or vector
  /// of them (nested); anything else is returned as is.
  template <class Batch>
  Batch batch_to_device(const Batch& batch) const {
    return detail::to_device(batch, root_device(), [this](AnyTensor& t) { place_input(t); });
  }
  /// The loader wrapped for this replica's device (torch_xla's MpDeviceLoader: batches
  /// arrive on root_device(), and a mark_step runs as each is handed out), with
  /// loader_options(). `loader` must outlive the result.
  template <class Loader>
  dist::MpDeviceLoader<Loader> process_dataloader(Loader& loader) const {
    return dist::MpDeviceLoader<Loader>(loader, root_device(), loader_options());
  }
  /// The options process_dataloader gives its loader (defaults; SpmdStrategy adds the
  /// input sharding).
  virtual dist::ParallelLoaderOptions loader_options() const { return {}; }
  /// Lays out one input tensor already on root_device() (batch_to_device calls it for
  /// every tensor of a batch; SpmdStrategy shards it over the mesh). Default: nothing.
  virtual void place_input(AnyTensor& t) const { (void)t; }

  // ---- a training step -------------------------------------------------------------------

  /// Backpropagates `loss` (a one-element tensor) into the parameters' gradients, through
  /// the precision plugin.
  LAZYTENSOR_INLINE virtual void backward(const AnyTensor& loss, optim::Optimizer* optimizer = nullptr);
  /// Runs `closure` (forward and backward, returning the loss; may be empty), then the
  /// optimizer's step: with replicas, the gradients are first averaged over the world
  /// (dist::optimizer_step). Returns the closure's loss (undefined without a closure).
  LAZYTENSOR_INLINE virtual AnyTensor optimizer_step(optim::Optimizer& optimizer,
                                                     const std::function<AnyTensor()>& closure = {});

  // ---- collectives -----------------------------------------------------------------------

  /// `t` reduced over the world by `op`: "mean" (or "avg"), "sum", "max", "min" or
  /// "product" (any case). Every replica gets the same value. A mean needs a floating dtype.
  template <Element T>
  Tensor<T> reduce(const Tensor<T>& t, std::string_view op = "mean") const;

  /// Every replica's `t` stacked along a new first dimension: shape (world_size, ...), in
  /// rank order (a single device returns `t` itself, as Lightning's). With `sync_grads` the
  /// result is differentiable: the gradient reaching `t` is the sum over replicas of the
  /// gradient of its slice (the backward pass then runs a collective on every replica).
  template <Element T>
  Tensor<T> all_gather(const Tensor<T>& t, bool sync_grads = false) const;

  /// Rank `src`'s `obj` on every replica: a string, a vector of trivially copyable values,
  /// or a trivially copyable struct.
  template <class O>
  O broadcast(O obj, int src = 0) const;

  /// Waits for every replica to reach a barrier of the same `name`; a replica at a barrier
  /// of another name makes every one raise CollectiveMismatch naming both.
  void barrier(std::string_view name = "") const;

  /// One decision for the whole world: true when every replica decided true (`all`), or
  /// when any did (`!all`). Use it for anything that stops or skips work on every replica.
  /// (A template only so that programs that never call it do not compile its exchange.)
  template <class = void>
  bool reduce_boolean_decision(bool decision, bool all = true) const;

  // ---- checkpoints -----------------------------------------------------------------------

  /// Writes `checkpoint` to `path` (a safetensors file) from global rank zero only, after
  /// every replica has computed its pending tensors; returns on every replica once the file
  /// is complete. Every replica must call it (never from a rank-0-only branch). The file is
  /// written to a temporary and renamed: a crash leaves the old file or the new one.
  LAZYTENSOR_INLINE virtual void save_checkpoint(const StateDict& checkpoint, const std::string& path);
  /// Removes the file at `path` (global rank zero does; a missing file is not an error).
  LAZYTENSOR_INLINE virtual void remove_checkpoint(const std::string& path);

  // ---- life cycle ------------------------------------------------------------------------

  /// Called on a replica whose launched function throws `e`, before launch() re-throws it
  /// (every replica that fails calls it, from its own thread).
  virtual void on_exception(const std::exception& e) { (void)e; }
  /// Releases what setup took (called by the Trainer at the end of a run).
  virtual void teardown() {}

  /// Runs `fn(*this)` on every replica (each on its own thread and device with replicas,
  /// on the calling thread otherwise) and returns global rank 0's result. When a replica
  /// throws, on_exception runs there, every other replica leaves its collectives with an
  /// error, and the first exception is re-thrown here (DDPSpawnStrategy's spawn).
  template <class F>
  auto launch(F fn);

 private:
  std::shared_ptr<Precision> precision_ = default_precision();
};

// ---- templates ----------------------------------------------------------------------------

template <Element T>
Tensor<T> Strategy::reduce(const Tensor<T>& t, std::string_view op) const {
  const detail::ParsedReduceOp r = detail::parse_reduce_op(op);
  if (r.mean && !is_floating_v<T>) {
    throw DTypeError("Strategy::reduce: op \"" + std::string(op) + "\" needs a floating tensor, found " +
                     dtype_name(dtype_of<T>()) + " (use \"sum\")");
  }
  if (!is_distributed()) return t;
  const double scale = r.mean ? 1.0 / world_size() : 1.0;
  return dist::all_reduce(r.op, t, {.scale = scale});
}

template <Element T>
Tensor<T> Strategy::all_gather(const Tensor<T>& t, bool sync_grads) const {
  if (!is_distributed()) return t;
  const Tensor<T> row = unsqueeze(t.detach(), 0);
  Tensor<T> gathered = dist::all_gather(row, 0);
  if constexpr (is_floating_v<T>) {
    if (sync_grads && autograd::any_requires_grad(t)) {
      const int n = world_size();
      const Shape shape = t.shape();
      autograd::record(gathered, "AllGatherBackward", {autograd::edge_of(t.impl())},
                       [n, shape](const Tensor<T>& g) -> graph::NodeList {
                         // Each replica's slice of every replica's gradient, summed.
                         const Tensor<T> mine = dist::reduce_scatter(ReduceOp::Sum, g, 1.0, 0, n);
                         return {Tensor<T>(reshape(mine, shape)).node()};
                       });
    }
  }
  return gathered;
}

template <class O>
O Strategy::broadcast(O obj, int src) const {
  if (src < 0 || src >= world_size()) {
    throw Error("Strategy::broadcast: src must be a rank in [0, " + std::to_string(world_size()) + "), got " +
                std::to_string(src));
  }
  if (!is_distributed()) return obj;
  return dist::broadcast_object(obj, src);
}

template <class>
bool Strategy::reduce_boolean_decision(bool decision, bool all) const {
  if (!is_distributed()) return decision;
  const auto votes = dist::mesh_reduce(all ? "reduce_boolean_decision(all)" : "reduce_boolean_decision(any)",
                                       static_cast<std::uint8_t>(decision),
                                       [](const std::vector<std::uint8_t>& v) { return v; });
  return all ? std::all_of(votes.begin(), votes.end(), [](std::uint8_t v) { return v != 0; })
             : std::any_of(votes.begin(), votes.end(), [](std::uint8_t v) { return v != 0; });
}

template <class F>
auto Strategy::launch(F fn) {
  auto body = [this, &fn]() {
    try {
      setup_environment();
      return fn(*this);
    } catch (const std::exception& e) {
      on_exception(e);
      throw;
    }
  };
  if (is_distributed()) return dist::spawn([&](int) { return body(); }, num_processes());
  // One device: run here, with root_device() as this thread's device for the duration.
  struct Restore {
    Device prev = device();
    ~Restore() { set_device(prev); }
  } restore;
  set_device(root_device());
  return body();
}

#if LAZYTENSOR_HEADER_DEFINITIONS
namespace detail {

LAZYTENSOR_INLINE ParsedReduceOp parse_reduce_op(std::string_view name) {
  std::string s(name);
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  if (s == "mean" || s == "avg") return {ReduceOp::Sum, true};
  if (s == "sum") return {ReduceOp::Sum, false};
  if (s == "max") return {ReduceOp::Max, false};
  if (s == "min") return {ReduceOp::Min, false};
  if (s == "product") return {ReduceOp::Mul, false};
  throw Error("Strategy::reduce: unknown op \"" + std::string(name) +
              "\" (expected \"mean\", \"avg\", \"sum\", \"max\", \"min\" or \"product\")");
}

}  // namespace detail

LAZYTENSOR_INLINE void Strategy::backward(const AnyTensor& loss, optim::Optimizer* optimizer) {
  (void)optimizer;
  precision_plugin().backward(loss);
}

LAZYTENSOR_INLINE AnyTensor Strategy::optimizer_step(optim::Optimizer& optimizer,
                                                         const std::function<AnyTensor()>& closure) {
  AnyTensor loss = closure ? closure() : AnyTensor();
  optimizer.step();
  return loss;
}

LAZYTENSOR_INLINE void Strategy::barrier(std::string_view name) const {
  if (is_distributed()) dist::barrier(std::string(name));
}


LAZYTENSOR_INLINE void Strategy::save_checkpoint(const StateDict& checkpoint, const std::string& path) {
  // io::save is xm.save: every replica materializes, global rank 0 writes atomically, all
  // meet after the write, and a failure anywhere is raised everywhere.
  io::save(checkpoint, path, /*master_only=*/true, /*global_master=*/true);
}

LAZYTENSOR_INLINE void Strategy::remove_checkpoint(const std::string& path) {
  if (!is_global_zero()) return;
  if (::unlink(path.c_str()) != 0 && errno != ENOENT)
    throw io::detail::os_error("remove_checkpoint: cannot remove", path);
}

#endif  // LAZYTENSOR_HEADER_DEFINITIONS

}  // namespace lazy::train
