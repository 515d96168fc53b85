#pragma once
// The MNIST / Fashion-MNIST dataset (same files, same layout), as
// torch::data::datasets::MNIST. Debian's dataset-fashion-mnist package installs the files
// gzip'd in /usr/share/datasets/fashion-mnist.

#include <sys/stat.h>
#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <lazytensor/core/config.hpp>
#include <lazytensor/core/error.hpp>
#include <lazytensor/data/dataset.hpp>
#include <lazytensor/data/idx.hpp>
#include <lazytensor/data/transforms.hpp>

namespace lazy::data {

/// MNIST-format images and labels from `root`: train-images-idx3-ubyte and
/// train-labels-idx1-ubyte (Mode::Train) or t10k-images-idx3-ubyte and
/// t10k-labels-idx1-ubyte (Mode::Test), each raw or with a .gz suffix. Images stay bytes on
/// the host (47 MB for the training set); each batch converts its images to float in [0, 1]
/// (with Normalize folded into the same table lookup when mapped), shape [B, 1, H, W], and
/// its labels to int64 [B]. Copies share the loaded data.
class MNIST : public DatasetBase<MNIST> {
 public:
  /// Which split to read.
  enum class Mode { Train, Test };

  /// Loads the split; IoError when a file is missing, FormatError when one is malformed or
  /// the two disagree (image count vs label count, labels outside 0..9).
  explicit MNIST(const std::string& root, Mode mode = Mode::Train);

  /// Number of images.
  std::size_t size() const { return storage_->labels.data.size(); }
  /// True for the training split.
  bool is_train() const { return mode_ == Mode::Train; }
  /// Image height and width.
  std::int64_t rows() const { return storage_->images.dims[1]; }
  std::int64_t cols() const { return storage_->images.dims[2]; }
  /// The raw images (size() x rows() x cols() bytes) and labels.
  const std::vector<std::uint8_t>& images() const { return storage_->images.data; }
  const std::vector<std::uint8_t>& labels() const { return storage_->labels.data; }

  /// Image `index` as float [1, H, W] in [0, 1] and its label as a 0-d int64 tensor.
  Example<> get(std::size_t index) const;
  /// Images `indices` as float [B, 1, H, W] in [0, 1] and labels as int64 [B].
  Example<> get_batch(const std::vector<std::size_t>& indices) const;
  /// get_batch with `normalize` folded into the byte-to-float conversion (one table lookup
  /// per pixel; the values equal normalizing the [0, 1] floats afterwards, bit for bit).
  Example<> get_batch(const std::vector<std::size_t>& indices,
                      const transforms::Normalize& normalize) const;

 private:
  struct Storage {
    IdxArray images, labels;
  };
  using Table = std::array<float, 256>;

  // As libtorch: the byte converted to float, then divided by 255.
  static float to_unit(int p) { return static_cast<float>(p) / 255.0f; }
  static const Table& identity_table();

  static std::string find(const std::string& base);

  Shape batch_image_shape(std::size_t n) const {
    return Shape{static_cast<std::int64_t>(n), 1, rows(), cols()};
  }

  void check(std::size_t index) const;

  Tensor<float> convert(const std::vector<std::size_t>& indices, const Table& table,
                        const Shape& shape) const;

  Tensor<std::int64_t> labels_of(const std::vector<std::size_t>& indices,
                                 const Shape& shape) const;

  std::shared_ptr<const Storage> storage_;
  Mode mode_;
};

namespace datasets {
/// libtorch's spelling: torch::data::datasets::MNIST.
using lazy::data::MNIST;
}  // namespace datasets

#if LAZYTENSOR_HEADER_DEFINITIONS
LAZYTENSOR_INLINE MNIST::MNIST(const std::string& root, Mode mode) : mode_(mode) {
  const std::string prefix = root + "/" + (mode == Mode::Train ? "train" : "t10k");
  auto s = std::make_shared<Storage>();
  const std::string images_path = find(prefix + "-images-idx3-ubyte");
  const std::string labels_path = find(prefix + "-labels-idx1-ubyte");
  s->images = read_idx(images_path);
  s->labels = read_idx(labels_path);
  if (s->images.dims.size() != 3) {
    throw FormatError(images_path + ": expected 3 dimensions (images x rows x columns), found " +
                      std::to_string(s->images.dims.size()));
  }
  if (s->labels.dims.size() != 1) {
    throw FormatError(labels_path + ": expected 1 dimension (labels), found " +
                      std::to_string(s->labels.dims.size()));
  }
  if (s->images.dims[0] != s->labels.dims[0]) {
    throw FormatError(images_path + " holds " + std::to_string(s->images.dims[0]) +
                      " images but " + labels_path + " holds " +
                      std::to_string(s->labels.dims[0]) + " labels");
  }
  for (std::size_t i = 0; i < s->labels.data.size(); ++i) {
    if (s->labels.data[i] > 9) {
      throw FormatError(labels_path + ": label " + std::to_string(i) + " is " +
                        std::to_string(s->labels.data[i]) + ", expected 0 to 9");
    }
  }
  storage_ = std::move(s);
}

LAZYTENSOR_INLINE Example<> MNIST::get(std::size_t index) const {
  const std::vector<std::size_t> one{index};
  return {convert(one, identity_table(), Shape{1, rows(), cols()}), labels_of(one, Shape{})};
}

LAZYTENSOR_INLINE Example<> MNIST::get_batch(const std::vector<std::size_t>& indices) const {
  return {convert(indices, identity_table(), batch_image_shape(indices.size())),
          labels_of(indices, Shape{static_cast<std::int64_t>(indices.size())})};
}

LAZYTENSOR_INLINE Example<> MNIST::get_batch(const std::vector<std::size_t>& indices,
                                             const transforms::Normalize& normalize) const {
  const Shape shape = batch_image_shape(indices.size());
  normalize.check_channels(1, shape);
  Table t;
  for (int p = 0; p < 256; ++p) t[static_cast<std::size_t>(p)] = normalize(to_unit(p), 0);
  return {convert(indices, t, shape),
          labels_of(indices, Shape{static_cast<std::int64_t>(indices.size())})};
}

LAZYTENSOR_INLINE const MNIST::Table& MNIST::identity_table() {
  static const Table t = [] {
    Table r;
    for (int p = 0; p < 256; ++p) r[static_cast<std::size_t>(p)] = to_unit(p);
    return r;
  }();
  return t;
}

LAZYTENSOR_INLINE std::string MNIST::find(const std::string& base) {
  struct stat st {};
  if (::stat(base.c_str(), &st) == 0) return base;
  if (::stat((base + ".gz").c_str(), &st) == 0) return base + ".gz";
  throw IoError("MNIST: neither '" + base + "' nor '" + base + ".gz' exists");
}

LAZYTENSOR_INLINE void MNIST::check(std::size_t index) const {
  if (index >= size()) {
    throw IndexError("MNIST: index " + std::to_string(index) +
                     " is out of range for a dataset of " + std::to_string(size()) + " images");
  }
}

LAZYTENSOR_INLINE Tensor<float> MNIST::convert(const std::vector<std::size_t>& indices,
                                               const Table& table, const Shape& shape) const {
  for (const auto i : indices) check(i);
  const auto per = static_cast<std::size_t>(rows() * cols());
  detail::HostTensor<float> out(shape);
  float* dst = out.data();
  const std::uint8_t* src = storage_->images.data.data();
  for (const auto i : indices) {
    const std::uint8_t* img = src + i * per;
    for (std::size_t k = 0; k < per; ++k) dst[k] = table[img[k]];
    dst += per;
  }
  return std::move(out).finish();
}

LAZYTENSOR_INLINE Tensor<std::int64_t> MNIST::labels_of(const std::vector<std::size_t>& indices,
                                                        const Shape& shape) const {
  detail::HostTensor<std::int64_t> out(shape);
  for (std::size_t b = 0; b < indices.size(); ++b)
    out.data()[b] = storage_->labels.data[indices[b]];
  return std::move(out).finish();
}
#endif  // LAZYTENSOR_HEADER_DEFINITIONS

}  // namespace lazy::data
