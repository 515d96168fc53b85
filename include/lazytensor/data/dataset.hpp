#pragma once
// What a dataset is (the Dataset concept), the optional batched fast path (get_batch), and
// dataset.map(transform) as in libtorch.
//
// A dataset is a value with `size()` and `get(index)` (const: a DataLoader with workers calls
// it from several threads at once, so it must be thread-safe) returning an Example. It may
// also provide `get_batch(indices)` returning a whole batch, built on the host into one
// buffer per field on the calling thread's current device (lazy::device()): the DataLoader
// uses it when present instead of stacking single examples.
//
// Datasets used with worker threads should return materialized tensors (built from host
// data, as the library's datasets do): stacking reads each example, and a pending one would
// be computed on the worker while the consumer may be running mark_step on the same device.

#include <concepts>
#include <cstddef>
#include <utility>
#include <vector>

#include <lazytensor/data/example.hpp>

namespace lazy::data {

/// size() and a const get(index).
template <class D>
concept Dataset = requires(const D& d, std::size_t i) {
  { d.size() } -> std::convertible_to<std::size_t>;
  d.get(i);
};

/// A Dataset that also builds whole batches: get_batch(const std::vector<std::size_t>&).
template <class D>
concept BatchDataset = Dataset<D> && requires(const D& d, const std::vector<std::size_t>& indices) {
  d.get_batch(indices);
};

/// The example type of a dataset.
template <Dataset D>
using example_t = decltype(std::declval<const D&>().get(std::size_t{}));

namespace detail {
template <class D>
struct batch_type_of {
  using type = example_t<D>;  // examples stacked into one of the same type
};
template <BatchDataset D>
struct batch_type_of<D> {
  using type =
      decltype(std::declval<const D&>().get_batch(std::declval<const std::vector<std::size_t>&>()));
};
}  // namespace detail

/// The batch type a DataLoader yields for a dataset.
template <Dataset D>
using batch_t = typename detail::batch_type_of<D>::type;

/// A dataset that builds its batches with `transform` folded in (e.g. MNIST converts bytes
/// to normalized floats in one pass): get_batch(indices, transform).
template <class D, class F>
concept FoldsTransform = requires(const D& d, const F& f, const std::vector<std::size_t>& indices) {
  d.get_batch(indices, f);
};

/// A transform that can also be applied to a whole batch of D: f.apply_batch(batch).
template <class D, class F>
concept BatchTransformFor = BatchDataset<D> &&
    requires(const D& d, const F& f, const std::vector<std::size_t>& indices) {
  f.apply_batch(d.get_batch(indices));
};

template <Dataset D, class F>
class MapDataset;

/// Base of the library's datasets: gives them map(transform), as libtorch's datasets have.
template <class Self>
class DatasetBase {
 public:
  /// A dataset yielding transform(example) for each example of this one (which is copied;
  /// the library's datasets share their storage, so copies are cheap).
  template <class F>
  MapDataset<Self, F> map(F transform) const& {
    return MapDataset<Self, F>(static_cast<const Self&>(*this), std::move(transform));
  }
  template <class F>
  MapDataset<Self, F> map(F transform) && {
    return MapDataset<Self, F>(std::move(static_cast<Self&>(*this)), std::move(transform));
  }
};

/// `dataset` with `transform` applied to each example (transform(Example) -> Example).
/// It has a get_batch when the transform can be folded into the dataset's own batching
/// (FoldsTransform) or applied to a batch (BatchTransformFor); otherwise the DataLoader
/// stacks transformed examples.
template <Dataset D, class F>
class MapDataset : public DatasetBase<MapDataset<D, F>> {
 public:
  MapDataset(D dataset, F transform)
      : dataset_(std::move(dataset)), transform_(std::move(transform)) {}

  /// Number of samples (that of the underlying dataset).
  std::size_t size() const { return dataset_.size(); }
  /// transform(dataset.get(index)).
  auto get(std::size_t index) const { return transform_(dataset_.get(index)); }
  /// The transformed batch: folded into the dataset's conversion when it offers that,
  /// else the transform applied to the dataset's batch.
  auto get_batch(const std::vector<std::size_t>& indices) const requires FoldsTransform<D, F> ||
      BatchTransformFor<D, F> {
    if constexpr (FoldsTransform<D, F>)
      return dataset_.get_batch(indices, transform_);
    else
      return transform_.apply_batch(dataset_.get_batch(indices));
  }

  /// The underlying dataset.
  const D& dataset() const { return dataset_; }
  /// The transform.
  const F& transform() const { return transform_; }

 private:
  D dataset_;
  F transform_;
};

}  // namespace lazy::data
