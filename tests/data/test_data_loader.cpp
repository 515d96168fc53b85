// Tests of data/data_loader.hpp (also run under ThreadSanitizer): every index exactly once
// per epoch in the sampler's order whatever the worker count, deterministic shuffles,
// errors surfacing at their batch, and loaders stopped mid-epoch.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <limits>
#include <numeric>
#include <set>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include <lazytensor/data.hpp>
#include <lazytensor/tensor.hpp>
#include <lazytensor/ops/factories.hpp>

namespace {

using lazy::Shape;
using lazy::Tensor;
using lazy::data::DataLoaderOptions;
using Indices = std::vector<std::size_t>;

// Sample i: data {i, -i} (float), target i.
lazy::data::TensorDataset<> indexed_dataset(std::size_t n) {
  std::vector<float> x;
  std::vector<std::int64_t> y;
  for (std::size_t i = 0; i < n; ++i) {
    x.push_back(static_cast<float>(i));
    x.push_back(-static_cast<float>(i));
    y.push_back(static_cast<std::int64_t>(i));
  }
  return lazy::data::TensorDataset(
      lazy::from_vector<float>(x, Shape{static_cast<std::int64_t>(n), 2}),
      lazy::from_vector<std::int64_t>(y, Shape{static_cast<std::int64_t>(n)}));
}

// The indices of one epoch, batch by batch, checking each batch's data against its targets.
template <class Loader>
std::vector<Indices> run_epoch(Loader& loader) {
  std::vector<Indices> batches;
  for (auto& b : loader) {
    const auto t = b.target.to_vector();
    const auto d = b.data.to_vector();
    EXPECT_EQ(b.data.shape(), (Shape{static_cast<std::int64_t>(t.size()), 2}));
    Indices idx;
    for (std::size_t k = 0; k < t.size(); ++k) {
      EXPECT_EQ(d[2 * k], static_cast<float>(t[k]));
      EXPECT_EQ(d[2 * k + 1], -static_cast<float>(t[k]));
      idx.push_back(static_cast<std::size_t>(t[k]));
    }
    batches.push_back(idx);
  }
  return batches;
}

Indices flatten(const std::vector<Indices>& batches) {
  Indices all;
  for (const auto& b : batches) all.insert(all.end(), b.begin(), b.end());
  return all;
}

TEST(DataLoader, EveryIndexOncePerEpochInSamplerOrder) {
  for (std::size_t n : {0, 1, 7, 64, 101}) {
    const auto ds = indexed_dataset(n);
    for (std::size_t bs : {1, 3, 16, 200}) {
      for (bool shuffle : {false, true}) {
        for (bool drop_last : {false, true}) {
          for (std::size_t workers : {0, 1, 3}) {
            DataLoaderOptions o{.batch_size = bs,
                                .shuffle = shuffle,
                                .drop_last = drop_last,
                                .seed = 5,
                                .num_workers = workers,
                                .prefetch = 2};
            lazy::data::DataLoader loader(ds, o);
            loader.set_epoch(4);
            const auto batches = run_epoch(loader);
            const std::size_t full = n / bs, want_batches = drop_last ? full : (n + bs - 1) / bs;
            ASSERT_EQ(batches.size(), want_batches)
                << n << " " << bs << " " << shuffle << drop_last << workers;
            EXPECT_EQ(loader.size(), want_batches);
            for (std::size_t b = 0; b < batches.size(); ++b) {
              EXPECT_EQ(batches[b].size(), b < full ? bs : n % bs);
            }
            Indices order = shuffle ? lazy::data::permutation(n, 5, 4) : Indices(n);
            if (!shuffle) std::iota(order.begin(), order.end(), std::size_t{0});
            order.resize(drop_last ? full * bs : n);
            EXPECT_EQ(flatten(batches), order)
                << n << " " << bs << " " << shuffle << drop_last << workers;
          }
        }
      }
    }
  }
}

TEST(DataLoader, ShuffleIsAFunctionOfSeedAndEpoch) {
  const auto ds = indexed_dataset(50);
  auto a = lazy::data::make_data_loader(
      ds, {.batch_size = 8, .shuffle = true, .seed = 1, .num_workers = 2});
  auto b = lazy::data::make_data_loader(
      ds, {.batch_size = 8, .shuffle = true, .seed = 1, .num_workers = 0});
  const auto a0 = flatten(run_epoch(*a)), a1 = flatten(run_epoch(*a));  // epochs 0 and 1
  EXPECT_EQ(a0, lazy::data::permutation(50, 1, 0));
  EXPECT_EQ(a1, lazy::data::permutation(50, 1, 1));
  EXPECT_NE(a0, a1);
  b->set_epoch(1);
  EXPECT_EQ(flatten(run_epoch(*b)), a1);  // same seed + epoch, other worker count
  a->set_epoch(0);
  EXPECT_EQ(flatten(run_epoch(*a)), a0);
  auto c = lazy::data::make_data_loader(ds, {.batch_size = 8, .shuffle = true, .seed = 2});
  EXPECT_NE(flatten(run_epoch(*c)), a0);
}

TEST(DataLoader, BatchesLandOnTheChosenDevice) {
  const auto ds = indexed_dataset(10);
  for (std::size_t workers : {0, 2}) {
    auto explicit_dev = lazy::data::make_data_loader(
        ds, {.batch_size = 4, .num_workers = workers, .device = lazy::Device(1)});
    for (auto& b : *explicit_dev) {
      EXPECT_EQ(b.data.device(), lazy::Device(1));
      EXPECT_EQ(b.target.device(), lazy::Device(1));
    }
    lazy::set_device(lazy::Device(1));
    auto implicit_dev = lazy::data::make_data_loader(ds, {.batch_size = 4, .num_workers = workers});
    lazy::set_device(lazy::Device(0));
    EXPECT_EQ(implicit_dev->device(), lazy::Device(1));
    for (auto& b : *implicit_dev) EXPECT_EQ(b.data.device(), lazy::Device(1));
    EXPECT_EQ(lazy::device(), lazy::Device(0));  // loading on this thread restored its device
  }
}

// A dataset without get_batch: the loader stacks its examples. Sample i has data [3] and a
// 0-d target; sample `odd` (if any) has a different shape.
struct ExampleDataset {
  std::size_t n = 0;
  std::size_t odd = SIZE_MAX;
  std::size_t size() const { return n; }
  lazy::data::Example<Tensor<float>, Tensor<std::int64_t>> get(std::size_t i) const {
    const float v = static_cast<float>(i);
    const Shape s = i == odd ? Shape{4} : Shape{3};
    return {lazy::from_vector<float>(std::vector<float>(static_cast<std::size_t>(s.numel()), v), s),
            lazy::from_vector<std::int64_t>({static_cast<std::int64_t>(i)}, Shape{})};
  }
};

TEST(DataLoader, StacksExamplesOfDatasetsWithoutGetBatch) {
  static_assert(!lazy::data::BatchDataset<ExampleDataset>);
  for (std::size_t workers : {0, 2}) {
    auto loader = lazy::data::make_data_loader(
        ExampleDataset{11}, {.batch_size = 4, .shuffle = true, .num_workers = workers});
    Indices seen;
    for (auto& b : *loader) {
      const auto t = b.target.to_vector();
      ASSERT_EQ(b.data.shape(), (Shape{static_cast<std::int64_t>(t.size()), 3}));
      const auto d = b.data.to_vector();
      for (std::size_t k = 0; k < t.size(); ++k) {
        for (int j = 0; j < 3; ++j)
          EXPECT_EQ(d[3 * k + static_cast<std::size_t>(j)], static_cast<float>(t[k]));
        seen.push_back(static_cast<std::size_t>(t[k]));
      }
    }
    EXPECT_EQ(seen, lazy::data::permutation(11, 0, 0));
  }
  // examples of different shapes cannot be stacked: ShapeError at the batch holding them
  auto bad =
      lazy::data::make_data_loader(ExampleDataset{11, 6}, {.batch_size = 4, .num_workers = 2});
  std::size_t batches = 0;
  try {
    for (auto& b : *bad) {
      (void)b;
      ++batches;
    }
    ADD_FAILURE() << "expected a ShapeError";
  } catch (const lazy::ShapeError&) {
  }
  EXPECT_EQ(batches, 1u);  // batch 0 = samples 0..3; batch 1 holds sample 6
}

// get_batch throws FormatError for a batch holding sample `bad`; counts the batches built.
struct FailingDataset {
  std::size_t n = 0, bad = 0;
  std::shared_ptr<std::atomic<int>> loads = std::make_shared<std::atomic<int>>(0);
  std::size_t size() const { return n; }
  lazy::data::Example<> get(std::size_t i) const { return get_batch({i}); }
  lazy::data::Example<> get_batch(const Indices& idx) const {
    loads->fetch_add(1);
    for (auto i : idx)
      if (i == bad) throw lazy::FormatError("sample " + std::to_string(i) + " is corrupt");
    std::vector<float> x(idx.begin(), idx.end());
    std::vector<std::int64_t> y(idx.begin(), idx.end());
    const auto b = static_cast<std::int64_t>(idx.size());
    return {lazy::from_vector<float>(x, Shape{b}), lazy::from_vector<std::int64_t>(y, Shape{b})};
  }
};

TEST(DataLoader, WorkerExceptionSurfacesAtItsBatch) {
  for (std::size_t workers : {0, 1, 3}) {
    for (std::size_t prefetch : {1, 4}) {
      auto loader = lazy::data::make_data_loader(
          FailingDataset{40, 22}, {.batch_size = 5, .num_workers = workers, .prefetch = prefetch});
      Indices got;
      bool thrown = false;
      try {
        for (auto& b : *loader)
          for (auto t : b.target.to_vector()) got.push_back(static_cast<std::size_t>(t));
      } catch (const lazy::FormatError& e) {
        thrown = true;
        EXPECT_NE(std::string(e.what()).find("sample 22"), std::string::npos);
      }
      EXPECT_TRUE(thrown) << workers;
      Indices want(20);  // batches 0..3 (samples 0..19) come out; batch 4 (20..24) fails
      std::iota(want.begin(), want.end(), std::size_t{0});
      EXPECT_EQ(got, want) << workers << " " << prefetch;
      // the loader is reusable after the failure: a new epoch starts from scratch
      std::size_t again = 0;
      try {
        for (auto& b : *loader) again += static_cast<std::size_t>(b.target.numel());
      } catch (const lazy::FormatError&) {
      }
      EXPECT_EQ(again, 20u);
    }
  }
}

TEST(DataLoader, StoppingMidEpochDoesNotHangOrLeak) {
  FailingDataset ds{1000, SIZE_MAX};
  for (std::size_t workers : {1, 4}) {
    {
      auto loader = lazy::data::make_data_loader(
          ds, {.batch_size = 2, .num_workers = workers, .prefetch = 3});
      std::size_t n = 0;
      for (auto& b : *loader) {
        (void)b;
        if (++n == 3) break;
      }
    }  // destroyed with workers waiting for room
    {
      auto loader = lazy::data::make_data_loader(ds, {.batch_size = 2, .num_workers = workers});
      auto it = loader->begin();  // restart mid-epoch: the old workers are stopped first
      ++it;
      auto it2 = loader->begin();
      EXPECT_EQ((*it2).target.to_vector(), (std::vector<std::int64_t>{0, 1}));
    }
    {
      auto never = lazy::data::make_data_loader(ds, {.batch_size = 2, .num_workers = workers});
      (void)never;
    }
  }
  // Workers load at most workers * prefetch batches ahead of the consumer.
  FailingDataset counted{1000, SIZE_MAX};
  {
    auto loader =
        lazy::data::make_data_loader(counted, {.batch_size = 1, .num_workers = 2, .prefetch = 3});
    auto it = loader->begin();
    (void)it;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));  // let the workers run ahead
    EXPECT_LE(counted.loads->load(), 2 * 3 + 1);
  }
}

TEST(DataLoader, DistributedSamplerSplitsTheDatasetAcrossLoaders) {
  const auto ds = indexed_dataset(23);
  std::multiset<std::size_t> all;
  for (std::size_t rank = 0; rank < 4; ++rank) {
    auto loader = lazy::data::make_data_loader(ds, lazy::data::DistributedSampler(4, rank, true, 3),
                                               {.batch_size = 4, .num_workers = 1});
    loader->set_epoch(2);
    EXPECT_EQ(loader->size(), 2u);  // ceil(23 / 4) = 6 samples: batches of 4 and 2
    const auto got = flatten(run_epoch(*loader));
    lazy::data::DistributedSampler ref(4, rank, true, 3);
    ref.set_epoch(2);
    EXPECT_EQ(got, ref.indices(23));
    all.insert(got.begin(), got.end());
  }
  EXPECT_EQ(all.size(), 24u);  // 23 + one pad
  for (std::size_t i = 0; i < 23; ++i) EXPECT_GE(all.count(i), 1u);
}

TEST(DataLoader, NormalizeThroughMapWithWorkers) {
  const auto ds = indexed_dataset(9);
  auto loader = lazy::data::make_data_loader(ds.map(lazy::data::transforms::Normalize(2.0, 4.0)),
                                             {.batch_size = 4, .num_workers = 2});
  for (auto& b : *loader) {
    const auto t = b.target.to_vector();
    const auto d = b.data.to_vector();
    for (std::size_t k = 0; k < t.size(); ++k) {
      EXPECT_EQ(d[2 * k], (static_cast<float>(t[k]) - 2.0f) / 4.0f);
      EXPECT_EQ(d[2 * k + 1], (-static_cast<float>(t[k]) - 2.0f) / 4.0f);
    }
  }
}

TEST(DataLoader, ValidatesOptions) {
  const auto ds = indexed_dataset(4);
  EXPECT_THROW(lazy::data::make_data_loader(ds, {.batch_size = 0}), lazy::Error);
  EXPECT_THROW(lazy::data::make_data_loader(ds, {.batch_size = 1, .num_workers = 1, .prefetch = 0}),
               lazy::Error);
  EXPECT_THROW(lazy::data::make_data_loader(ds, lazy::data::RandomSampler(),
                                            {.batch_size = 1, .shuffle = true}),
               lazy::Error);
  auto loader = lazy::data::make_data_loader(ds, 3);
  EXPECT_EQ(loader->size(), 2u);
  // "The whole dataset in one batch": n + batch_size - 1 wrapped, and gave no batch.
  auto whole = lazy::data::make_data_loader(ds, std::numeric_limits<std::size_t>::max());
  EXPECT_EQ(whole->size(), 1u);
  std::size_t batches = 0;
  for (auto& b : *whole) {
    EXPECT_EQ(b.data.size(0), 4);
    ++batches;
  }
  EXPECT_EQ(batches, 1u);
  auto dropped = lazy::data::make_data_loader(ds, {.batch_size = 3, .drop_last = true});
  EXPECT_EQ(dropped->size(), 1u);
}

}  // namespace
