#pragma once
// ParallelLoader, its per-device loaders and MpDeviceLoader, as torch_xla's
// torch_xla.distributed.parallel_loader.
//
//   // one replica per thread (inside dist::spawn), the canonical loop:
//   auto loader = lazy::data::make_data_loader(train, lazy::data::DistributedSampler(n, rank),
//                                              {.batch_size = 64});
//   lazy::dist::MpDeviceLoader device_loader(*loader, lazy::device());
//   for (auto& batch : device_loader) { ... lazy::dist::optimizer_step(opt); }  // mark_step
//                                                                              // per batch
//
// The background pass behind each ParallelLoader is detail::LoaderPass (dist/loader_pass.hpp):
// batches reach device d in order, as complete groups of D; see that file for the threads,
// the queues and which batch types are copied.
//
// Consumers: a per-device loader is consumed by one thread; several can be consumed by
// one thread in turn (round robin) or by a thread each. Consuming one device's loader to
// the end while another device's is not read stalls once that device's queues are full,
// as in torch_xla (the loader thread waits for room in every queue).
//
// Stopping: destroying a ParallelLoader (or MpDeviceLoader::begin() starting the next
// epoch) wakes every background thread and joins it; a thread busy loading or copying a
// batch finishes that batch first. The underlying loader must outlive the ParallelLoader and
// must not be used by anyone else while a pass runs.

#include <cstddef>
#include <iterator>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <lazytensor/core/error.hpp>
#include <lazytensor/data/data_loader.hpp>
#include <lazytensor/dist/loader_pass.hpp>
#include <lazytensor/tensor/device.hpp>

namespace lazy::dist {

template <class Loader>
class ParallelLoader;

/// The batches of one device of a ParallelLoader pass (torch_xla's PerDeviceLoader). An
/// input range: iterating it hands out the device's batches in order and calls mark_step on
/// the device after every `batches_per_execution` batches (when the consumer advances past
/// the last batch of a step) and once more at the end of the pass if batches were handed
/// out since the last one. So the loop body only traces a step; it runs when the next batch
/// is requested. begin() continues where the previous iteration stopped.
template <class Batch>
class PerDeviceLoader {
 public:
  using batch_type = Batch;

  /// Input iterator over the remaining batches.
  class iterator {
   public:
    using value_type = Batch;
    using difference_type = std::ptrdiff_t;
    using reference = Batch&;
    using pointer = Batch*;
    using iterator_category = std::input_iterator_tag;

    iterator() = default;
    Batch& operator*() const { return *owner_->current_; }
    Batch* operator->() const { return &*owner_->current_; }
    iterator& operator++() {
      owner_->advance();
      return *this;
    }
    void operator++(int) { ++*this; }
    friend bool operator==(const iterator& it, std::default_sentinel_t) { return it.at_end(); }

   private:
    friend class PerDeviceLoader;
    bool at_end() const { return !owner_ || !owner_->current_; }
    explicit iterator(PerDeviceLoader* o) : owner_(o) {}
    PerDeviceLoader* owner_ = nullptr;
  };

  PerDeviceLoader(const PerDeviceLoader&) = delete;
  PerDeviceLoader& operator=(const PerDeviceLoader&) = delete;

  /// An iterator at the current batch (the first call fetches the first one).
  iterator begin() {
    if (!started_) {
      started_ = true;
      advance();
    }
    return iterator(this);
  }
  std::default_sentinel_t end() const { return {}; }

  /// The device the batches are on.
  Device device() const { return device_; }

 private:
  template <class L>
  friend class ParallelLoader;

  PerDeviceLoader(detail::LoaderPass<Batch>* pass, std::size_t index, Device device,
                  std::size_t batches_per_execution)
      : pass_(pass), index_(index), device_(device), per_step_(batches_per_execution) {}

  void advance() {
    if (current_) {
      current_.reset();
      if (++since_step_ == per_step_) step();
    }
    current_ = pass_->next(index_);  // an error leaves current_ empty: the pass is over
    if (!current_ && since_step_ > 0) step();
  }

  /// mark_step on this loader's device (the consuming thread may serve several devices).
  void step() {
    since_step_ = 0;
    data::detail::CurrentDeviceScope scope(device_.index());
    mark_step();
  }

  detail::LoaderPass<Batch>* pass_;
  std::size_t index_;
  Device device_;
  std::size_t per_step_;
  std::size_t since_step_ = 0;  ///< batches handed out since the last mark_step
  bool started_ = false;
  std::optional<Batch> current_;
};

/// Feeds the batches of `loader` to several devices, as torch_xla's
/// ParallelLoader(loader, devices, ...): one pass (one epoch of `loader`) starts at
/// construction; batch i*D + d goes to devices[d] (see the file comment for the threads,
/// the queues and the error and stopping rules). Get each device's batches with
/// per_device_loader(device). For the next epoch, construct a new ParallelLoader (or use
/// MpDeviceLoader, which does that at every begin()). Not copyable or movable.
template <class Loader>
class ParallelLoader {
 public:
  using batch_type = detail::loader_batch_t<Loader>;

  /// torch_xla's positional form. Error for an empty or repeated device list or a zero
  /// size; `loader` must outlive this object.
  ParallelLoader(Loader& loader, std::vector<Device> devices, int batchdim = 0,
                 std::size_t batches_per_execution = 1, std::size_t loader_prefetch_size = 8,
                 std::size_t device_prefetch_size = 4,
                 std::size_t host_to_device_transfer_threads = 1)
      : ParallelLoader(loader, std::move(devices),
                       ParallelLoaderOptions{batchdim, batches_per_execution, loader_prefetch_size,
                                             device_prefetch_size,
                                             host_to_device_transfer_threads, nullptr}) {}

  /// The same with named options: `ParallelLoader(loader, devs, {.device_prefetch_size = 2})`.
  ParallelLoader(Loader& loader, std::vector<Device> devices, const ParallelLoaderOptions& options)
      : loader_(loader), devices_(std::move(devices)) {
    detail::check_options(options, "ParallelLoader");
    if (devices_.empty()) throw DeviceError("ParallelLoader: the list of devices is empty");
    for (std::size_t i = 0; i < devices_.size(); ++i) {
      for (std::size_t j = 0; j < i; ++j) {
        if (devices_[i] == devices_[j]) {
          throw DeviceError("ParallelLoader: device " + devices_[i].str() +
                            " appears more than once in the list of devices");
        }
      }
      devices_[i].engine();  // create it now, not on a background thread
    }
    pass_ = std::make_unique<detail::LoaderPass<batch_type>>(loader_, devices_, options);
    for (std::size_t i = 0; i < devices_.size(); ++i) {
      per_device_.push_back(std::unique_ptr<PerDeviceLoader<batch_type>>(new PerDeviceLoader<batch_type>(
          pass_.get(), i, devices_[i], options.batches_per_execution)));
    }
  }
  ParallelLoader(const ParallelLoader&) = delete;
  ParallelLoader& operator=(const ParallelLoader&) = delete;
  /// Stops and joins the background threads (see the file comment).
  ~ParallelLoader() { close(); }

  /// The batches of `device` (DeviceError when it is not one of this loader's devices).
  PerDeviceLoader<batch_type>& per_device_loader(const Device& device) {
    for (std::size_t i = 0; i < devices_.size(); ++i)
      if (devices_[i] == device) return *per_device_[i];
    std::string list;
    for (const auto& d : devices_) list += (list.empty() ? "" : ", ") + d.str();
    throw DeviceError("ParallelLoader::per_device_loader: " + device.str() +
                      " is not one of the loader's devices [" + list + "]");
  }

  /// Batches each device gets in a pass: the loader's batches / number of devices, rounded
  /// down (an incomplete last group is dropped).
  std::size_t per_device_batches() const
  requires requires(const Loader& l) { l.size(); }
  { return static_cast<std::size_t>(loader_.size()) / devices_.size(); }

  const std::vector<Device>& devices() const { return devices_; }

  /// Stops the pass now (joins its threads); per-device loaders then end (torch_xla's close).
  void close() {
    if (pass_) pass_->stop();
  }

 private:
  Loader& loader_;
  std::vector<Device> devices_;
  std::unique_ptr<detail::LoaderPass<batch_type>> pass_;
  std::vector<std::unique_ptr<PerDeviceLoader<batch_type>>> per_device_;
};

/// The loader of one device, as torch_xla's MpDeviceLoader(loader, device, ...): each
/// begin() starts a new pass (a ParallelLoader over {device}, stopping the previous one)
/// and iterates its per-device loader, which calls mark_step on `device` after every
/// `batches_per_execution` batches and at the end of the epoch. The canonical loop of a
/// replica (see the file comment): set_epoch on the loader, then range-for over this. The
/// underlying loader must outlive this object.
template <class Loader>
class MpDeviceLoader {
 public:
  using batch_type = detail::loader_batch_t<Loader>;
  using iterator = typename PerDeviceLoader<batch_type>::iterator;

  /// torch_xla's form: the options after `device` as in ParallelLoader.
  MpDeviceLoader(Loader& loader, Device device, int batchdim = 0,
                 std::size_t batches_per_execution = 1, std::size_t loader_prefetch_size = 8,
                 std::size_t device_prefetch_size = 4,
                 std::size_t host_to_device_transfer_threads = 1)
      : MpDeviceLoader(loader, device,
                       ParallelLoaderOptions{batchdim, batches_per_execution, loader_prefetch_size,
                                             device_prefetch_size,
                                             host_to_device_transfer_threads, nullptr}) {}
  /// The same with named options.
  MpDeviceLoader(Loader& loader, Device device, const ParallelLoaderOptions& options)
      : loader_(loader), device_(device), options_(options) {
    detail::check_options(options, "MpDeviceLoader");
  }
  MpDeviceLoader(const MpDeviceLoader&) = delete;
  MpDeviceLoader& operator=(const MpDeviceLoader&) = delete;

  /// Starts an epoch of the underlying loader (stopping a pass in progress first).
  iterator begin() {
    pass_.reset();
    pass_ = std::make_unique<ParallelLoader<Loader>>(loader_, std::vector<Device>{device_},
                                                     options_);
    return pass_->per_device_loader(device_).begin();
  }
  std::default_sentinel_t end() const { return {}; }

  /// Batches per epoch (the underlying loader's).
  std::size_t size() const
  requires requires(const Loader& l) { l.size(); }
  { return static_cast<std::size_t>(loader_.size()); }

  Device device() const { return device_; }

 private:
  Loader& loader_;
  Device device_;
  ParallelLoaderOptions options_;
  std::unique_ptr<ParallelLoader<Loader>> pass_;
};

}  // namespace lazy::dist
