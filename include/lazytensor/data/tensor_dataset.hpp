#pragma once
// TensorDataset: samples are the rows (first dimension) of a data tensor and a target
// tensor, as torch::data::datasets::TensorDataset.

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <lazytensor/core/error.hpp>
#include <lazytensor/data/dataset.hpp>
#include <lazytensor/data/transforms.hpp>

namespace lazy::data {

/// Rows of `data` paired with rows of `targets`. The values are materialized once, at
/// construction, and held as an immutable snapshot: later in-place updates of the tensors
/// passed in do not change the dataset, and workers read the snapshot without touching the
/// lazy graph. Copies share the snapshot.
template <Element D = float, Element T = std::int64_t>
class TensorDataset : public DatasetBase<TensorDataset<D, T>> {
 public:
  using example_type = Example<Tensor<D>, Tensor<T>>;

  /// ShapeError when either tensor is 0-d or their first dimensions differ.
  TensorDataset(const Tensor<D>& data, const Tensor<T>& targets)
      : data_(snapshot(data, "data")), targets_(snapshot(targets, "targets")) {
    if (data.size(0) != targets.size(0)) {
      throw ShapeError("TensorDataset: data has " + std::to_string(data.size(0)) +
                       " samples (shape " + data.shape().str() + ") but targets has " +
                       std::to_string(targets.size(0)) + " (shape " + targets.shape().str() + ")");
    }
    size_ = static_cast<std::size_t>(data.size(0));
  }

  /// Number of samples.
  std::size_t size() const { return size_; }

  /// Sample `index` (IndexError when out of range), on the current device.
  example_type get(std::size_t index) const {
    check(index);
    return {gather<D>(data_, &index, 1, data_.row_shape),
            gather<T>(targets_, &index, 1, targets_.row_shape)};
  }

  /// Rows `indices` gathered into one [B, ...] tensor per field, on the current device.
  example_type get_batch(const std::vector<std::size_t>& indices) const {
    for (const auto i : indices) check(i);
    const std::size_t n = indices.size();
    return {gather<D>(data_, indices.data(), n, detail::batch_shape(n, data_.row_shape)),
            gather<T>(targets_, indices.data(), n, detail::batch_shape(n, targets_.row_shape))};
  }

  /// get_batch with the data normalized during the gather (channels along dimension 1).
  example_type get_batch(
      const std::vector<std::size_t>& indices,
      const transforms::Normalize& normalize) const requires std::is_same_v<D, float> {
    for (const auto i : indices) check(i);
    const std::size_t n = indices.size();
    const Shape shape = detail::batch_shape(n, data_.row_shape);
    const std::int64_t channels = data_.row_shape.rank() > 0 ? data_.row_shape[0] : 1;
    normalize.check_channels(channels, shape);
    const auto per = static_cast<std::size_t>(data_.row_shape.numel());
    const std::size_t inner = channels > 0 ? per / static_cast<std::size_t>(channels) : 0;
    detail::HostTensor<float> out(shape);
    float* dst = out.data();
    for (std::size_t b = 0; b < n; ++b) {
      const float* src = static_cast<const float*>(data_.buffer->data()) + indices[b] * per;
      for (std::size_t k = 0; k < per; ++k) {
        const std::size_t c = normalize.channels() == 1 ? 0 : k / inner;
        dst[b * per + k] = normalize(src[k], c);
      }
    }
    return {std::move(out).finish(),
            gather<T>(targets_, indices.data(), n, detail::batch_shape(n, targets_.row_shape))};
  }

 private:
  struct Field {
    std::shared_ptr<Buffer> buffer;  // shared with the source node, so never donated or changed
    Shape row_shape;
  };

  template <Element U>
  static Field snapshot(const Tensor<U>& t, const char* what) {
    if (t.dim() == 0) {
      throw ShapeError(std::string("TensorDataset: ") + what +
                       " must have a first (sample) dimension, got a 0-d tensor");
    }
    t.data();  // materialize
    Shape row;
    for (int d = 1; d < t.dim(); ++d) row.push_back(t.size(d));
    return {t.node()->buffer(), row};
  }

  void check(std::size_t index) const {
    if (index >= size_) {
      throw IndexError("TensorDataset: index " + std::to_string(index) +
                       " is out of range for a dataset of " + std::to_string(size_) + " samples");
    }
  }

  template <Element U>
  static Tensor<U> gather(const Field& f, const std::size_t* indices, std::size_t n,
                          const Shape& shape) {
    const auto per = static_cast<std::size_t>(f.row_shape.numel());
    detail::HostTensor<U> out(shape);
    const auto* src = static_cast<const U*>(f.buffer->data());
    for (std::size_t b = 0; b < n; ++b) {
      if (per) std::memcpy(out.data() + b * per, src + indices[b] * per, per * sizeof(U));
    }
    return std::move(out).finish();
  }

  Field data_, targets_;
  std::size_t size_ = 0;
};

namespace datasets {
/// libtorch's spelling: torch::data::datasets::TensorDataset.
using lazy::data::TensorDataset;
}  // namespace datasets

}  // namespace lazy::data
