#pragma once
// DataLoader: batches of a dataset in sampler order, loaded on the calling thread or by
// worker threads ahead of use, as torch::data's make_data_loader.
//
//   auto loader = lazy::data::make_data_loader(dataset, {.batch_size = 64, .shuffle = true,
//   .num_workers = 2}); for (auto& batch : *loader) { ... batch.data, batch.target ... }
//
// Workers: worker w loads batches w, w + W, w + 2W, ... of the epoch, each at most
// W * prefetch batches ahead of the consumer; the consumer takes them strictly in order.
// An exception thrown while loading a batch is re-thrown to the consumer when it reaches
// that batch. Stopping (a new epoch, destruction) wakes every worker and joins it; a worker
// finishes the batch it is loading first.

#include <concepts>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <iterator>
#include <map>
#include <memory>
#include <mutex>
#include <numeric>
#include <optional>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include <lazytensor/core/error.hpp>
#include <lazytensor/data/dataset.hpp>
#include <lazytensor/data/sampler.hpp>
#include <lazytensor/data/shuffle.hpp>

namespace lazy::data {

/// Options of a DataLoader (libtorch's DataLoaderOptions / PyTorch's DataLoader arguments).
struct DataLoaderOptions {
  std::size_t batch_size = 1;
  /// Visit the samples in a random order (permutation(n, seed, epoch)); exclusive with a sampler.
  bool shuffle = false;
  /// Drop the last batch when it would be smaller than batch_size.
  bool drop_last = false;
  /// Seed of the shuffle.
  std::uint64_t seed = 0;
  /// Worker threads loading batches; 0 loads each batch on the consuming thread when asked.
  std::size_t num_workers = 0;
  /// Batches each worker loads ahead of the consumer (at least 1).
  std::size_t prefetch = 2;
  /// Device the batches are created on; default: the current device of the thread that
  /// creates the loader.
  std::optional<Device> device = std::nullopt;
};

namespace detail {

/// Sets this thread's current device for a scope.
class CurrentDeviceScope {
 public:
  explicit CurrentDeviceScope(int index)
      : saved_(std::exchange(graph::current_device_index(), index)) {}
  CurrentDeviceScope(const CurrentDeviceScope&) = delete;
  CurrentDeviceScope& operator=(const CurrentDeviceScope&) = delete;
  ~CurrentDeviceScope() { graph::current_device_index() = saved_; }

 private:
  int saved_;
};

/// Loads batches 0..n-1 through `load`, on worker threads or on demand, and hands them out
/// in order. One epoch; destroyed (and its workers joined) by the loader.
template <class Batch>
class BatchPipeline {
 public:
  using Load = std::function<Batch(std::size_t)>;

  BatchPipeline(std::size_t num_batches, std::size_t workers, std::size_t prefetch,
                int device_index, Load load)
      : n_(num_batches),
        workers_(workers),
        window_(workers * prefetch),
        device_(device_index),
        load_(std::move(load)) {
    threads_.reserve(workers_);
    try {
      for (std::size_t w = 0; w < workers_ && w < n_; ++w)
        threads_.emplace_back([this, w] { work(w); });
    } catch (...) {
      stop();
      throw;
    }
  }
  BatchPipeline(const BatchPipeline&) = delete;
  BatchPipeline& operator=(const BatchPipeline&) = delete;
  ~BatchPipeline() { stop(); }

  /// The next batch in order, or nothing at the end of the epoch. Re-throws the exception
  /// of a batch that failed to load (the epoch then ends).
  std::optional<Batch> next() {
    if (next_ >= n_) return std::nullopt;
    if (workers_ == 0) {
      CurrentDeviceScope scope(device_);
      const std::size_t b = next_;
      next_ = n_;  // an exception ends the epoch
      std::optional<Batch> batch(load_(b));
      next_ = b + 1;
      return batch;
    }
    Slot slot;
    {
      std::unique_lock lock(mu_);
      ready_cv_.wait(lock, [&] { return ready_.count(next_) != 0; });
      auto it = ready_.find(next_);
      slot = std::move(it->second);
      ready_.erase(it);
      ++next_;
    }
    space_cv_.notify_all();
    if (slot.error) {
      stop();
      next_ = n_;
      std::rethrow_exception(slot.error);
    }
    return std::move(slot.batch);
  }

  /// Stops the workers (each finishes the batch it is loading) and joins them.
  void stop() noexcept {
    {
      std::lock_guard lock(mu_);
      stopping_ = true;
    }
    space_cv_.notify_all();
    for (auto& t : threads_) t.join();
    threads_.clear();
  }

 private:
  struct Slot {
    std::optional<Batch> batch;
    std::exception_ptr error;
  };

  void work(std::size_t w) {
    graph::current_device_index() = device_;
    for (std::size_t b = w; b < n_; b += workers_) {
      {
        std::unique_lock lock(mu_);
        space_cv_.wait(lock, [&] { return stopping_ || b < next_ + window_; });
        if (stopping_) return;
      }
      Slot slot;
      try {
        slot.batch.emplace(load_(b));
      } catch (...) {
        slot.error = std::current_exception();
      }
      const bool failed = slot.error != nullptr;
      {
        std::lock_guard lock(mu_);
        if (stopping_) return;
        ready_.emplace(b, std::move(slot));
      }
      ready_cv_.notify_one();
      if (failed) return;  // the consumer stops at this batch; later ones are not wanted
    }
  }

  const std::size_t n_, workers_, window_;
  const int device_;
  const Load load_;
  std::size_t next_ = 0;  // guarded by mu_ when workers run
  std::mutex mu_;
  std::condition_variable ready_cv_, space_cv_;
  std::map<std::size_t, Slot> ready_;  // guarded by mu_
  bool stopping_ = false;              // guarded by mu_
  std::vector<std::thread> threads_;
};

}  // namespace detail

/// Batches of `D` in sampler order (see the file comment). Iterate with range-for; each
/// begin() starts an epoch (stopping one in progress). Not copyable or movable (workers
/// refer to it); make_data_loader returns it by unique_ptr, as libtorch does.
template <Dataset D>
class DataLoader {
 public:
  using dataset_type = D;
  using batch_type = batch_t<D>;

  /// Error for batch_size 0, prefetch 0, or shuffle together with a sampler.
  DataLoader(D dataset, DataLoaderOptions options = {}, std::shared_ptr<Sampler> sampler = nullptr)
      : dataset_(std::move(dataset)),
        options_(options),
        sampler_(std::move(sampler)),
        device_(options.device.value_or(lazy::device())) {
    if (options_.batch_size == 0) throw Error("DataLoader: batch_size must be at least 1, got 0");
    if (options_.prefetch == 0) throw Error("DataLoader: prefetch must be at least 1, got 0");
    if (options_.shuffle && sampler_) {
      throw Error(
          "DataLoader: shuffle = true is mutually exclusive with a sampler (shuffle with the "
          "sampler instead)");
    }
  }
  DataLoader(const DataLoader&) = delete;
  DataLoader& operator=(const DataLoader&) = delete;
  ~DataLoader() { pipeline_.reset(); }

  /// Input iterator over the batches of the running epoch.
  class iterator {
   public:
    using value_type = batch_type;
    using difference_type = std::ptrdiff_t;
    using reference = batch_type&;
    using pointer = batch_type*;
    using iterator_category = std::input_iterator_tag;

    iterator() = default;
    batch_type& operator*() const { return *loader_->current_; }
    batch_type* operator->() const { return &*loader_->current_; }
    iterator& operator++() {
      loader_->advance();
      return *this;
    }
    void operator++(int) { ++*this; }
    friend bool operator==(const iterator& it, std::default_sentinel_t) { return it.at_end(); }

   private:
    friend class DataLoader;
    explicit iterator(DataLoader* l) : loader_(l) {}
    bool at_end() const { return !loader_ || !loader_->current_; }
    DataLoader* loader_ = nullptr;
  };

  /// Starts an epoch (the one set by set_epoch, else the one after the previous begin())
  /// and returns an iterator at its first batch.
  iterator begin() {
    start_epoch();
    advance();
    return iterator(this);
  }
  std::default_sentinel_t end() const { return {}; }

  /// Batches per epoch.
  std::size_t size() const {
    const std::size_t n = sampler_ ? sampler_->size(dataset_.size()) : dataset_.size();
    return batches_of(n);
  }

  /// The epoch the next begin() uses (it determines the shuffle); each begin() then moves
  /// to the following epoch, so a loader reshuffles every epoch even without set_epoch.
  /// Also selects the sampler's epoch.
  void set_epoch(std::uint64_t epoch) { next_epoch_ = epoch; }

  const D& dataset() const { return dataset_; }
  const DataLoaderOptions& options() const { return options_; }
  /// The device batches are created on.
  Device device() const { return device_; }
  /// The sampler given at construction (nullptr when none). Its epoch is the loader's:
  /// each begin() sets it, so select an epoch with DataLoader::set_epoch (a set_epoch on
  /// the sampler itself is overwritten, unlike torch's DistributedSampler).
  Sampler* sampler() const { return sampler_.get(); }

 private:
  /// Batches of `n` samples: without `n + batch_size - 1`, which wraps for a batch size
  /// near SIZE_MAX (a "whole dataset in one batch" setting) and gave none.
  std::size_t batches_of(std::size_t n) const {
    const std::size_t bs = options_.batch_size;
    return n / bs + (!options_.drop_last && n % bs != 0 ? 1 : 0);
  }

  void start_epoch() {
    pipeline_.reset();  // stop the epoch in progress before touching what its workers read
    current_.reset();
    const std::uint64_t epoch = next_epoch_++;
    const std::size_t n = dataset_.size();
    if (sampler_) {
      sampler_->set_epoch(epoch);
      order_ = sampler_->indices(n);
    } else if (options_.shuffle) {
      order_ = permutation(n, options_.seed, epoch);
    } else {
      order_.resize(n);
      std::iota(order_.begin(), order_.end(), std::size_t{0});
    }
    const std::size_t bs = options_.batch_size;
    const std::size_t batches = batches_of(order_.size());
    pipeline_ = std::make_unique<detail::BatchPipeline<batch_type>>(
        batches, options_.num_workers, options_.prefetch, device_.index(),
        [this, bs](std::size_t b) {
          const auto first = order_.begin() + static_cast<std::ptrdiff_t>(b * bs);
          // (b * bs < size, so the rest is measured from there: (b + 1) * bs may wrap.)
          const auto last =
              first + static_cast<std::ptrdiff_t>(std::min(order_.size() - b * bs, bs));
          return load(std::vector<std::size_t>(first, last));
        });
  }

  batch_type load(const std::vector<std::size_t>& indices) const {
    if constexpr (BatchDataset<D>) {
      return dataset_.get_batch(indices);
    } else {
      std::vector<example_t<D>> examples;
      examples.reserve(indices.size());
      for (const auto i : indices) examples.push_back(dataset_.get(i));
      return detail::collate(examples);
    }
  }

  void advance() {
    current_.reset();  // release the previous batch before loading the next
    if (pipeline_) current_ = pipeline_->next();
  }

  D dataset_;
  DataLoaderOptions options_;
  std::shared_ptr<Sampler> sampler_;
  Device device_;
  std::uint64_t next_epoch_ = 0;
  std::vector<std::size_t> order_;  // the running epoch's indices, read by the workers
  std::optional<batch_type> current_;
  std::unique_ptr<detail::BatchPipeline<batch_type>> pipeline_;  // last: stopped first
};

/// A loader over `dataset` (copied or moved in), as torch::data::make_data_loader.
template <class D>
requires Dataset<std::remove_cvref_t<D>> std::unique_ptr<DataLoader<std::remove_cvref_t<D>>>
make_data_loader(D&& dataset, DataLoaderOptions options = {}) {
  return std::make_unique<DataLoader<std::remove_cvref_t<D>>>(std::forward<D>(dataset), options);
}

/// A loader with the given batch size and default options.
template <class D>
requires Dataset<std::remove_cvref_t<D>> std::unique_ptr<DataLoader<std::remove_cvref_t<D>>>
make_data_loader(D&& dataset, std::size_t batch_size) {
  return make_data_loader(std::forward<D>(dataset), DataLoaderOptions{.batch_size = batch_size});
}

/// A loader visiting the indices of `sampler` (e.g. a DistributedSampler).
template <class D, std::derived_from<Sampler> S>
requires Dataset<std::remove_cvref_t<D>> std::unique_ptr<DataLoader<std::remove_cvref_t<D>>>
make_data_loader(D&& dataset, S sampler, DataLoaderOptions options = {}) {
  return std::make_unique<DataLoader<std::remove_cvref_t<D>>>(
      std::forward<D>(dataset), options, std::make_shared<S>(std::move(sampler)));
}

}  // namespace lazy::data
