// Tests of data/tensor_dataset.hpp, data/transforms.hpp and dataset.map(): values against
// scalar loops over the source data.

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include <gtest/gtest.h>

#include <lazytensor/data.hpp>
#include <lazytensor/tensor.hpp>
#include <lazytensor/ops/factories.hpp>

namespace {

using lazy::Shape;
using lazy::Tensor;
using lazy::data::TensorDataset;
using lazy::data::transforms::Normalize;

// data[i, c, k] = 100 i + 10 c + k (3 samples of shape [2, 3]); targets [i, 2] = {i, -i}.
std::vector<float> source_data() {
  std::vector<float> v;
  for (int i = 0; i < 3; ++i)
    for (int c = 0; c < 2; ++c)
      for (int k = 0; k < 3; ++k) v.push_back(static_cast<float>(100 * i + 10 * c + k));
  return v;
}

TensorDataset<float, std::int32_t> make_dataset() {
  auto x = lazy::from_vector<float>(source_data(), Shape{3, 2, 3});
  auto y = lazy::from_vector<std::int32_t>({0, 0, 1, -1, 2, -2}, Shape{3, 2});
  return TensorDataset(x, y);
}

TEST(TensorDataset, GetReturnsRows) {
  const auto ds = make_dataset();
  ASSERT_EQ(ds.size(), 3u);
  const auto src = source_data();
  for (std::size_t i = 0; i < 3; ++i) {
    const auto e = ds.get(i);
    EXPECT_EQ(e.data.shape(), (Shape{2, 3}));
    EXPECT_EQ(e.target.shape(), (Shape{2}));
    EXPECT_EQ(e.data.to_vector(), std::vector<float>(src.begin() + 6 * i, src.begin() + 6 * i + 6));
    EXPECT_EQ(e.target.to_vector(),
              (std::vector<std::int32_t>{static_cast<int>(i), -static_cast<int>(i)}));
  }
  EXPECT_THROW(ds.get(3), lazy::IndexError);
}

TEST(TensorDataset, GetBatchGathersInIndexOrder) {
  const auto ds = make_dataset();
  const auto b = ds.get_batch({2, 0, 2});
  EXPECT_EQ(b.data.shape(), (Shape{3, 2, 3}));
  EXPECT_EQ(b.target.shape(), (Shape{3, 2}));
  const auto src = source_data();
  std::vector<float> want;
  for (std::size_t i : {2, 0, 2})
    want.insert(want.end(), src.begin() + 6 * i, src.begin() + 6 * i + 6);
  EXPECT_EQ(b.data.to_vector(), want);
  EXPECT_EQ(b.target.to_vector(), (std::vector<std::int32_t>{2, -2, 0, 0, 2, -2}));
  EXPECT_THROW(ds.get_batch({0, 7}), lazy::IndexError);
}

TEST(TensorDataset, OneDimensionalTargetsGiveScalarsAndVectors) {
  auto x = lazy::from_vector<float>({1, 2, 3, 4}, Shape{4});
  auto y = lazy::from_vector<std::int64_t>({7, 8, 9, 10}, Shape{4});
  TensorDataset ds(x, y);
  EXPECT_EQ(ds.get(1).target.shape(), Shape{});
  EXPECT_EQ(ds.get(1).target.item(), 8);
  EXPECT_EQ(ds.get(1).data.item(), 2.0f);
  const auto b = ds.get_batch({3, 1});
  EXPECT_EQ(b.data.shape(), Shape{2});
  EXPECT_EQ(b.target.to_vector(), (std::vector<std::int64_t>{10, 8}));
}

TEST(TensorDataset, ValidatesShapes) {
  auto x = lazy::from_vector<float>({1, 2, 3, 4, 5, 6}, Shape{3, 2});
  auto y = lazy::from_vector<std::int64_t>({0, 1}, Shape{2});
  EXPECT_THROW(TensorDataset(x, y), lazy::ShapeError);
  auto scalar = lazy::from_vector<std::int64_t>({0}, Shape{});
  EXPECT_THROW(TensorDataset(x, scalar), lazy::ShapeError);
}

TEST(TensorDataset, HoldsASnapshotOfPendingAndLaterModifiedTensors) {
  auto base = lazy::from_vector<float>({1, 2, 3, 4}, Shape{2, 2});
  Tensor<float> x = base * 2.0f;  // pending: the dataset materializes it
  auto y = lazy::from_vector<std::int64_t>({0, 1}, Shape{2});
  TensorDataset ds(x, y);
  x.add_(100.0f);  // rebinds x to a new value; the dataset keeps the old one
  lazy::mark_step();
  EXPECT_EQ(ds.get(1).data.to_vector(), (std::vector<float>{6, 8}));
  EXPECT_EQ(x.to_vector(), (std::vector<float>{102, 104, 106, 108}));
}

TEST(TensorDataset, BatchesGoToTheCurrentDevice) {
  const auto ds = make_dataset();
  lazy::set_device(lazy::Device(1));
  const auto b = ds.get_batch({0});
  lazy::set_device(lazy::Device(0));
  EXPECT_EQ(b.data.device(), lazy::Device(1));
  EXPECT_EQ(b.target.device(), lazy::Device(1));
}

// ---- Normalize --------------------------------------------------------------------------

TEST(Normalize, PerChannelOnExamplesAndBatches) {
  const Normalize n({1.0, -2.0}, {0.5, 4.0});
  const auto src = source_data();
  // example [2, 3]: channel = dim 0
  auto ex = lazy::data::Example<Tensor<float>, Tensor<std::int64_t>>{
      lazy::from_vector<float>(std::vector<float>(src.begin(), src.begin() + 6), Shape{2, 3}),
      lazy::from_vector<std::int64_t>({3}, Shape{})};
  const auto out = n(ex).data.to_vector();
  for (int c = 0; c < 2; ++c)
    for (int k = 0; k < 3; ++k) {
      const float x = src[static_cast<std::size_t>(3 * c + k)];
      const float want = c == 0 ? (x - 1.0f) / 0.5f : (x - -2.0f) / 4.0f;
      EXPECT_EQ(out[static_cast<std::size_t>(3 * c + k)], want);
    }
  // batch [3, 2, 3]: channel = dim 1
  const auto ds = make_dataset();
  const auto raw = ds.get_batch({0, 1, 2});
  lazy::data::Example<Tensor<float>, Tensor<std::int32_t>> batch{raw.data, raw.target};
  const auto nb = n.apply_batch(batch).data.to_vector();
  for (std::size_t i = 0; i < src.size(); ++i) {
    const std::size_t c = (i / 3) % 2;
    const float want = c == 0 ? (src[i] - 1.0f) / 0.5f : (src[i] + 2.0f) / 4.0f;
    EXPECT_EQ(nb[i], want) << i;
  }
}

TEST(Normalize, Validates) {
  EXPECT_THROW(Normalize({1.0, 2.0}, {1.0}), lazy::ShapeError);
  EXPECT_THROW(Normalize(std::vector<double>{}, std::vector<double>{}), lazy::ShapeError);
  EXPECT_THROW(Normalize(0.0, 0.0), lazy::Error);
  // Checked as the floats it divides by: 1e-50 is 0 as a float (inf outputs before).
  EXPECT_THROW(Normalize(0.0, 1e-50), lazy::Error);
  EXPECT_THROW(Normalize(std::nan(""), 1.0), lazy::Error);
  EXPECT_THROW(Normalize(0.0, std::numeric_limits<double>::infinity()), lazy::Error);
  EXPECT_THROW(Normalize({0.0, 1e300}, {1.0, 1.0}), lazy::Error);  // inf as a float
  const Normalize three({0, 0, 0}, {1, 1, 1});
  const auto ds = make_dataset();  // 2 channels
  EXPECT_THROW(ds.map(three).get_batch({0}), lazy::ShapeError);
  EXPECT_THROW(three.apply(ds.get(0).data, 0), lazy::ShapeError);
}

TEST(MapDataset, NormalizeFoldedIntoTheGatherEqualsNormalizingAfterwards) {
  const auto ds = make_dataset();
  const Normalize n({0.25, 3.0}, {0.75, 9.0});
  const auto mapped = ds.map(n);
  static_assert(lazy::data::FoldsTransform<TensorDataset<float, std::int32_t>, Normalize>);
  static_assert(lazy::data::BatchDataset<decltype(mapped)>);
  const std::vector<std::size_t> idx{1, 2, 0, 1};
  const auto folded = mapped.get_batch(idx);
  const auto raw = ds.get_batch(idx);
  const auto after = n.apply(raw.data, 1);
  EXPECT_EQ(folded.data.to_vector(), after.to_vector());  // bit for bit
  EXPECT_EQ(folded.target.to_vector(), raw.target.to_vector());
  // single examples go through operator()(Example) with the channel on dim 0
  EXPECT_EQ(mapped.get(2).data.to_vector(), n.apply(ds.get(2).data, 0).to_vector());
}

TEST(MapDataset, ArbitraryTransformsMapExamplesOnly) {
  const auto ds = make_dataset();
  auto doubled = ds.map([](lazy::data::Example<Tensor<float>, Tensor<std::int32_t>> e) {
    e.target = lazy::from_vector<std::int32_t>(
        {static_cast<std::int32_t>(e.target.to_vector()[0] * 2)}, Shape{});
    return e;
  });
  static_assert(!lazy::data::BatchDataset<decltype(doubled)>);  // the loader will stack examples
  EXPECT_EQ(doubled.size(), 3u);
  EXPECT_EQ(doubled.get(2).target.item(), 4);
  // map chains, and the chained Normalize is applied to the stacked batch
  auto chained = std::move(doubled).map(Normalize(1.0, 2.0));
  EXPECT_EQ(chained.get(0).data.to_vector()[1], (1.0f - 1.0f) / 2.0f);
}

}  // namespace
