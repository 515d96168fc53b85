// dist/parallel_loader.hpp: every batch exactly once, in order per device, in complete
// groups only (batch i*D + d to device d), as materialized tensors on that device; several
// devices in one thread (round robin) or a consumer thread each; one MpDeviceLoader per
// replica over a DistributedSampler; mark_step after every batches_per_execution batches;
// errors of the loader and of a copy reaching the consumers; stopping mid-epoch without
// hanging; bounded read-ahead. Also run under TSan.
#include "dist_testing.hpp"

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include <lazytensor/data.hpp>

namespace {

using dist_testing::Watchdog;
using lazy::Device;
using lazy::Shape;
using lazy::Tensor;
namespace data = lazy::data;
namespace dist = lazy::dist;
using Indices = std::vector<std::size_t>;

// Sample i: data {i, -i} (float), target i.
data::TensorDataset<> indexed_dataset(std::size_t n) {
  std::vector<float> x;
  std::vector<std::int64_t> y;
  for (std::size_t i = 0; i < n; ++i) {
    x.push_back(static_cast<float>(i));
    x.push_back(-static_cast<float>(i));
    y.push_back(static_cast<std::int64_t>(i));
  }
  return data::TensorDataset(lazy::from_vector<float>(x, Shape{static_cast<std::int64_t>(n), 2}),
                             lazy::from_vector<std::int64_t>(y, Shape{static_cast<std::int64_t>(n)}));
}

/// The sample indices of a batch, checking its fields: materialized on `dev`, data
/// matching the targets.
Indices indices_of(const data::Example<>& b, Device dev) {
  EXPECT_EQ(b.data.device(), dev);
  EXPECT_EQ(b.target.device(), dev);
  EXPECT_TRUE(b.data.node()->materialized());
  EXPECT_TRUE(b.target.node()->materialized());
  const auto t = b.target.to_vector();
  const auto d = b.data.to_vector();
  EXPECT_EQ(b.data.shape(), (Shape{static_cast<std::int64_t>(t.size()), 2}));
  Indices idx;
  for (std::size_t k = 0; k < t.size(); ++k) {
    EXPECT_EQ(d[2 * k], static_cast<float>(t[k]));
    EXPECT_EQ(d[2 * k + 1], -static_cast<float>(t[k]));
    idx.push_back(static_cast<std::size_t>(t[k]));
  }
  return idx;
}

/// Batch b of a sequential loader over n samples with batch size bs.
Indices batch_indices(std::size_t b, std::size_t bs, std::size_t n) {
  Indices v;
  for (std::size_t i = b * bs; i < std::min(n, (b + 1) * bs); ++i) v.push_back(i);
  return v;
}

/// What device d of D must receive: batches d, d + D, ... of the complete groups.
std::vector<Indices> expected_for(std::size_t d, std::size_t D, std::size_t n, std::size_t bs) {
  const std::size_t batches = (n + bs - 1) / bs, groups = batches / D;
  std::vector<Indices> want;
  for (std::size_t g = 0; g < groups; ++g) want.push_back(batch_indices(g * D + d, bs, n));
  return want;
}

std::vector<Device> first_devices(std::size_t n) {
  std::vector<Device> v;
  for (std::size_t i = 0; i < n; ++i) v.emplace_back(static_cast<int>(i));
  return v;
}

struct Config {
  std::size_t devices, samples, batch, workers;
  dist::ParallelLoaderOptions options;
};

const std::vector<Config> kConfigs = {
    {1, 10, 3, 0, {}},
    {2, 37, 3, 0, {}},
    {2, 37, 3, 2, {.loader_prefetch_size = 1, .device_prefetch_size = 1}},
    {3, 37, 2, 1, {.device_prefetch_size = 2, .host_to_device_transfer_threads = 3}},
    {2, 0, 3, 0, {}},
    {3, 5, 3, 0, {}},  // 2 batches: no complete group
    {2, 64, 1, 2, {.loader_prefetch_size = 2, .host_to_device_transfer_threads = 2}},
};

TEST(ParallelLoader, RoundRobinOverSeveralDevicesInOneThread) {
  Watchdog dog;
  for (const Config& c : kConfigs) {
    data::DataLoader loader(indexed_dataset(c.samples), {.batch_size = c.batch, .num_workers = c.workers});
    dist::ParallelLoader pl(loader, first_devices(c.devices), c.options);
    EXPECT_EQ(pl.per_device_batches(), (c.samples + c.batch - 1) / c.batch / c.devices);
    std::vector<dist::PerDeviceLoader<data::Example<>>::iterator> its;
    for (const auto& d : pl.devices()) its.push_back(pl.per_device_loader(d).begin());
    std::vector<std::vector<Indices>> got(c.devices);
    for (bool any = true; any;) {
      any = false;
      for (std::size_t d = 0; d < c.devices; ++d) {
        if (its[d] == std::default_sentinel) continue;
        got[d].push_back(indices_of(*its[d], Device(static_cast<int>(d))));
        ++its[d];
        any = true;
      }
    }
    for (std::size_t d = 0; d < c.devices; ++d) {
      EXPECT_EQ(got[d], expected_for(d, c.devices, c.samples, c.batch))
          << c.devices << " devices, " << c.samples << " samples, device " << d;
    }
  }
}

TEST(ParallelLoader, OneConsumerThreadPerDevice) {
  Watchdog dog;
  for (const Config& c : kConfigs) {
    data::DataLoader loader(indexed_dataset(c.samples), {.batch_size = c.batch, .num_workers = c.workers});
    dist::ParallelLoader pl(loader, first_devices(c.devices), c.options);
    std::vector<std::vector<Indices>> got(c.devices);
    std::vector<std::thread> consumers;
    for (std::size_t d = 0; d < c.devices; ++d) {
      consumers.emplace_back([&, d] {
        const Device dev(static_cast<int>(d));
        lazy::set_device(dev);
        for (auto& b : pl.per_device_loader(dev)) got[d].push_back(indices_of(b, dev));
      });
    }
    for (auto& t : consumers) t.join();
    for (std::size_t d = 0; d < c.devices; ++d)
      EXPECT_EQ(got[d], expected_for(d, c.devices, c.samples, c.batch)) << c.devices << " devices, device " << d;
  }
}

TEST(MpDeviceLoader, EpochsFollowTheLoaderAndItsSampler) {
  Watchdog dog;
  const std::size_t n = 29, bs = 4;
  data::DataLoader loader(indexed_dataset(n), {.batch_size = bs, .shuffle = true, .seed = 7});
  dist::MpDeviceLoader device_loader(loader, lazy::device());
  EXPECT_EQ(device_loader.size(), 8u);
  for (std::uint64_t epoch : {3, 5}) {
    loader.set_epoch(epoch);
    Indices got;
    for (auto& b : device_loader) {
      const Indices idx = indices_of(b, lazy::device());
      got.insert(got.end(), idx.begin(), idx.end());
    }
    EXPECT_EQ(got, data::permutation(n, 7, epoch)) << "epoch " << epoch;
  }
}

TEST(MpDeviceLoader, MarksAStepEveryBatchesPerExecutionBatches) {
  Watchdog dog;
  auto& steps = lazy::core::counter("MarkStep");
  const std::size_t n = 23, bs = 2, batches = 12;
  for (std::size_t per : {1, 2, 5, 12, 20}) {
    data::DataLoader loader(indexed_dataset(n), {.batch_size = bs});
    dist::MpDeviceLoader device_loader(loader, lazy::device(), 0, per);
    const auto s0 = steps.value();
    std::size_t k = 0;
    Tensor<float> total = lazy::zeros<float>({});
    for (auto& b : device_loader) {
      // batch k arrives after the steps of the batches before it: floor(k / per)
      EXPECT_EQ(steps.value() - s0, static_cast<std::int64_t>(k / per)) << "per " << per << " batch " << k;
      total = total + lazy::sum(b.data);  // traced; runs at the loader's mark_step
      ++k;
    }
    EXPECT_EQ(k, batches);
    EXPECT_EQ(steps.value() - s0, static_cast<std::int64_t>((batches + per - 1) / per)) << "per " << per;
    EXPECT_FALSE(total.node()->pending());  // the last step was handed to execution
    EXPECT_EQ(total.item(), 0.0f);          // every sample's data sums to i - i = 0
  }
}

TEST(MpDeviceLoader, OneLoaderPerReplicaOverADistributedSampler) {
  Watchdog dog;
  const std::size_t n = 45, bs = 4;
  const int world = 2;
  const auto ds = indexed_dataset(n);
  // got[epoch][replica]: the replica's indices; sums[epoch][replica]: all-reduced target
  // sums of each step.
  std::vector<std::vector<Indices>> got(2, std::vector<Indices>(world));
  std::vector<std::vector<std::vector<std::int64_t>>> sums(2, std::vector<std::vector<std::int64_t>>(world));
  dist::spawn(
      [&](int r) {
        auto loader = data::make_data_loader(ds, data::DistributedSampler(world, static_cast<std::size_t>(r), true, 9),
                                             {.batch_size = bs, .num_workers = 1});
        dist::MpDeviceLoader device_loader(*loader, lazy::device());
        for (std::size_t e = 0; e < 2; ++e) {
          loader->set_epoch(e);
          std::vector<Tensor<std::int64_t>> step_sums;
          for (auto& b : device_loader) {
            const Indices idx = indices_of(b, lazy::device());
            got[e][static_cast<std::size_t>(r)].insert(got[e][static_cast<std::size_t>(r)].end(), idx.begin(), idx.end());
            step_sums.push_back(dist::all_reduce(lazy::ReduceOp::Sum, Tensor<std::int64_t>(lazy::sum(b.target))));
          }
          for (const auto& s : step_sums) sums[e][static_cast<std::size_t>(r)].push_back(s.item());
        }
      },
      world);
  for (std::size_t e = 0; e < 2; ++e) {
    std::vector<Indices> want(world);
    for (int r = 0; r < world; ++r) {
      data::DistributedSampler ref(world, static_cast<std::size_t>(r), true, 9);
      ref.set_epoch(e);
      want[static_cast<std::size_t>(r)] = ref.indices(n);
      EXPECT_EQ(got[e][static_cast<std::size_t>(r)], want[static_cast<std::size_t>(r)]) << "epoch " << e << " replica " << r;
    }
    // step k's all_reduce adds batch k of both replicas
    std::vector<std::int64_t> want_sums;
    for (std::size_t k = 0; k * bs < want[0].size(); ++k) {
      std::int64_t s = 0;
      for (const auto& w : want)
        for (std::size_t i = k * bs; i < std::min(w.size(), (k + 1) * bs); ++i) s += static_cast<std::int64_t>(w[i]);
      want_sums.push_back(s);
    }
    for (int r = 0; r < world; ++r) EXPECT_EQ(sums[e][static_cast<std::size_t>(r)], want_sums) << "epoch " << e;
  }
}

// get_batch throws FormatError for a batch holding sample `bad`; counts the batches built.
struct FailingDataset {
  std::size_t n = 0, bad = SIZE_MAX;
  std::shared_ptr<std::atomic<int>> loads = std::make_shared<std::atomic<int>>(0);
  std::size_t size() const { return n; }
  data::Example<> get(std::size_t i) const { return get_batch({i}); }
  data::Example<> get_batch(const Indices& idx) const {
    loads->fetch_add(1);
    for (auto i : idx)
      if (i == bad) throw lazy::FormatError("sample " + std::to_string(i) + " is corrupt");
    std::vector<float> x;
    std::vector<std::int64_t> y;
    for (auto i : idx) {
      x.push_back(static_cast<float>(i));
      x.push_back(-static_cast<float>(i));
      y.push_back(static_cast<std::int64_t>(i));
    }
    const auto b = static_cast<std::int64_t>(idx.size());
    return {lazy::from_vector<float>(x, Shape{b, 2}), lazy::from_vector<std::int64_t>(y, Shape{b})};
  }
};

TEST(ParallelLoader, ALoaderErrorReachesEveryDeviceAfterItsCompleteGroups) {
  Watchdog dog;
  // 40 samples, batches of 5: batch 4 (samples 20..24) fails.
  struct Case {
    std::size_t devices;
    std::vector<std::vector<std::size_t>> batches;  // per device, before the error
  };
  for (std::size_t workers : {0, 2}) {
    for (const Case& c : {Case{1, {{0, 1, 2, 3}}}, Case{2, {{0, 2}, {1, 3}}},
                          Case{3, {{0}, {1}, {2}}}}) {  // 3: group (3, 4, 5) never completes
      data::DataLoader loader(FailingDataset{40, 22}, {.batch_size = 5, .num_workers = workers});
      dist::ParallelLoader pl(loader, first_devices(c.devices));
      std::vector<std::thread> consumers;
      std::vector<std::vector<Indices>> got(c.devices);
      std::vector<std::string> errors(c.devices);
      for (std::size_t d = 0; d < c.devices; ++d) {
        consumers.emplace_back([&, d] {
          const Device dev(static_cast<int>(d));
          auto& per = pl.per_device_loader(dev);
          errors[d] = dist_testing::message_of<lazy::FormatError>([&] {
            for (auto& b : per) got[d].push_back(indices_of(b, dev));
          });
          EXPECT_TRUE(per.begin() == std::default_sentinel);  // the pass is over
        });
      }
      for (auto& t : consumers) t.join();
      for (std::size_t d = 0; d < c.devices; ++d) {
        std::vector<Indices> want;
        for (auto b : c.batches[d]) want.push_back(batch_indices(b, 5, 40));
        EXPECT_EQ(got[d], want) << c.devices << " devices, device " << d << ", " << workers << " workers";
        EXPECT_NE(errors[d].find("sample 22 is corrupt"), std::string::npos) << errors[d];
      }
    }
  }
}

// Returns batches computed lazily on device 3 (never materialized): a ParallelLoader cannot
// copy them.
struct PendingDataset {
  std::size_t size() const { return 6; }
  data::Example<> get(std::size_t i) const { return get_batch({i}); }
  data::Example<> get_batch(const Indices& idx) const {
    const auto b = static_cast<std::int64_t>(idx.size());
    Tensor<float> x = lazy::zeros<float>({b, 2}, Device(3)) + 1.0f;
    return {x, lazy::zeros<std::int64_t>({b}, Device(3))};
  }
};

TEST(ParallelLoader, ACopyErrorReachesTheConsumerAtItsBatch) {
  Watchdog dog;
  data::DataLoader loader(PendingDataset{}, {.batch_size = 2, .device = Device(3)});
  dist::MpDeviceLoader device_loader(loader, lazy::device());
  const std::string msg = dist_testing::message_of<lazy::Error>([&] {
    for (auto& b : device_loader) (void)b;
  });
  EXPECT_NE(msg.find("pending (not materialized)"), std::string::npos) << msg;
}

TEST(ParallelLoader, StoppingMidEpochDoesNotHang) {
  Watchdog dog;
  FailingDataset ds{2000};
  for (std::size_t workers : {0, 2}) {
    {  // destroyed before anything was consumed, with every queue filling up
      data::DataLoader loader(ds, {.batch_size = 1, .num_workers = workers});
      dist::ParallelLoader pl(loader, first_devices(2), {.loader_prefetch_size = 1, .device_prefetch_size = 1});
    }
    {  // one device consumed a little, the other never: the loader waits for room
      data::DataLoader loader(ds, {.batch_size = 1, .num_workers = workers});
      dist::ParallelLoader pl(loader, first_devices(2), {.loader_prefetch_size = 2});
      auto it = pl.per_device_loader(Device(0)).begin();
      ++it;
      EXPECT_EQ((*it).target.to_vector(), (std::vector<std::int64_t>{2}));
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    {  // MpDeviceLoader: break out, start the next epoch at once, then destroy mid-epoch
      data::DataLoader loader(ds, {.batch_size = 3, .num_workers = workers});
      dist::MpDeviceLoader device_loader(loader, lazy::device(), {.host_to_device_transfer_threads = 2});
      for (auto& b : device_loader) {
        (void)b;
        break;
      }
      auto it = device_loader.begin();
      EXPECT_EQ((*it).target.to_vector(), (std::vector<std::int64_t>{0, 1, 2}));
      ++it;
    }
    {  // close() ends the per-device loaders
      data::DataLoader loader(ds, {.batch_size = 2, .num_workers = workers});
      dist::ParallelLoader pl(loader, first_devices(1));
      auto it = pl.per_device_loader(Device(0)).begin();
      pl.close();
      std::size_t more = 0;
      for (; it != std::default_sentinel; ++it) ++more;
      EXPECT_LE(more, 1u + 8 + 4);  // at most what was already copied or queued
    }
  }
  lazy::wait_device_ops();
}

TEST(ParallelLoader, ReadsAheadAtMostThePrefetchSizes) {
  Watchdog dog;
  FailingDataset counted{1000};
  data::DataLoader loader(counted, {.batch_size = 1});
  dist::ParallelLoader pl(loader, first_devices(1), {.loader_prefetch_size = 2, .device_prefetch_size = 1});
  auto it = pl.per_device_loader(Device(0)).begin();
  std::this_thread::sleep_for(std::chrono::milliseconds(50));  // let the threads run ahead
  // the consumer's batch, 1 copied, 2 queued, and 1 held by the loader thread waiting for room
  EXPECT_LE(counted.loads->load(), 1 + 1 + 2 + 1);
  (void)it;
}

TEST(ParallelLoader, ValidatesItsArguments) {
  data::DataLoader loader(indexed_dataset(4), {.batch_size = 2});
  EXPECT_THROW(dist::ParallelLoader(loader, {}), lazy::DeviceError);
  EXPECT_THROW(dist::ParallelLoader(loader, {Device(0), Device(1), Device(0)}), lazy::DeviceError);
  EXPECT_THROW(dist::ParallelLoader(loader, first_devices(1), {.device_prefetch_size = 0}), lazy::Error);
  EXPECT_THROW(dist::ParallelLoader(loader, first_devices(1), {.host_to_device_transfer_threads = 0}), lazy::Error);
  EXPECT_THROW(dist::MpDeviceLoader(loader, Device(0), -1), lazy::Error);
  EXPECT_THROW(dist::MpDeviceLoader(loader, Device(0), 0, 0), lazy::Error);
  dist::ParallelLoader pl(loader, first_devices(2));
  EXPECT_THROW(pl.per_device_loader(Device(2)), lazy::DeviceError);
}

}  // namespace
