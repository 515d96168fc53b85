// An SPMD program spanning processes: run as `mpirun -np 2 test_mpi
// --gtest_filter='MpiSpmd*'` with LAZYTENSOR_NUM_DEVICES=2, so the global mesh has 4
// devices, 2 per process. Sharded values whose blocks sit in the other process are read
// whole (bitwise the host data), products and reductions whose contracted dimension is
// split across the processes all-reduce through MPI and equal a double reference, training
// data-parallel, FSDP-style and tensor-parallel across the processes gives the unsharded
// run's losses and weights (within 1e-12) with the same bits in both processes, io::save
// gathers, writes once and returns with the file complete in both, the Trainer's "spmd"
// strategy trains over both processes' devices as one device would, with checkpoints, and a
// program that diverges between the processes ends in CollectiveMismatch or
// CollectiveTimeout, not a hang. (SPMD mode holds for the whole process, so these tests
// run in their own mpirun, apart from the replica world's.)
#include <gtest/gtest.h>
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include <unistd.h>

#include <cstdio>

#include <lazytensor/io.hpp>
#include <lazytensor/nn.hpp>
#include <lazytensor/optim.hpp>
#include <lazytensor/spmd.hpp>

#include "dist/dist_testing.hpp"
#include "testing/helpers.hpp"
#include "testing/spmd_training.hpp"
#include "train/trainer_testing.hpp"

// (Named, not anonymous: test_mpi compiles its files as one unity source.)
namespace mpi_spmd_testing {

namespace spmd = lazy::spmd;
namespace nn = lazy::nn;
using lazy::Tensor;

class MpiSpmd : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { spmd::use_spmd(); }
  static int rank() {
    int r = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &r);
    return r;
  }
};

Tensor<double> host_tensor(const lazy::Shape& shape, unsigned seed) {
  return lazy::from_vector<double>(lazy_tests::random_values<double>(shape.numel(), seed), shape);
}

std::int64_t counter(const char* name) { return lazy::core::counter(name).value(); }

// Whether every process holds the same bits in `v`.
bool same_in_every_process(const std::vector<double>& v) {
  int n = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  std::vector<double> all(v.size() * static_cast<std::size_t>(n));
  MPI_Allgather(v.data(), static_cast<int>(v.size()), MPI_DOUBLE, all.data(), static_cast<int>(v.size()), MPI_DOUBLE,
                MPI_COMM_WORLD);
  for (int q = 0; q < n; ++q)
    if (std::memcmp(all.data() + static_cast<std::size_t>(q) * v.size(), v.data(), v.size() * sizeof(double)) != 0)
      return false;
  return true;
}

void expect_close(const std::vector<double>& got, const std::vector<double>& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (std::size_t i = 0; i < got.size(); ++i)
    EXPECT_NEAR(got[i], want[i], 1e-12 * std::max(1.0, std::abs(want[i]))) << what << " at " << i;
}

// ici (1, 2) x dcn (2, 1): mesh rows are processes (global ids 2p, 2p + 1).
spmd::HybridMesh rows_are_processes() { return spmd::HybridMesh({1, 2}, {2, 1}, {"data", "model"}); }

TEST_F(MpiSpmd, GlobalDevicesAndHybridMesh) {
  ASSERT_EQ(lazy::device_count(), 2) << "run with LAZYTENSOR_NUM_DEVICES=2";
  EXPECT_EQ(lazy::runtime::global_runtime_device_count(), 4);
  EXPECT_EQ(lazy::runtime::process_count(), 2);
  const auto mesh = rows_are_processes();
  EXPECT_EQ(mesh.device_ids(), (std::vector<int>{0, 1, 2, 3}));
  // The DCN axis second: process q holds ids q and q + 2 (mesh columns).
  const spmd::HybridMesh cols({2, 1}, {1, 2});
  EXPECT_EQ(cols.device_ids(), (std::vector<int>{0, 2, 1, 3}));
  EXPECT_NE(dist_testing::message_of<lazy::Error>([] { spmd::Mesh({0, 1, 2, 4}, {4}); }).find("device id 4 names no device"),
            std::string::npos);
  // A slice is a process: the ICI axes must hold one process's devices.
  EXPECT_NE(dist_testing::message_of<lazy::Error>([] { spmd::HybridMesh({4}, {1}); }).find("each of the 2 processes has 2"),
            std::string::npos);

  // This process's shards only, on its own devices.
  auto x = host_tensor({4, 6}, 1);
  spmd::mark_sharding(x, mesh, {"data", "model"});
  const auto shards = spmd::local_shards(x);
  ASSERT_EQ(shards.size(), 2u);
  for (int i = 0; i < 2; ++i) {
    const auto& s = shards[static_cast<std::size_t>(i)];
    EXPECT_EQ(s.device.index(), i);
    EXPECT_EQ(s.index[0], (std::pair<std::int64_t, std::int64_t>{2 * rank(), 2 * rank() + 2}));
    EXPECT_EQ(s.index[1], (std::pair<std::int64_t, std::int64_t>{3 * i, 3 * i + 3}));
  }
  // Each shard holds its block of the host data.
  const auto data = lazy_tests::random_values<double>(24, 1);
  for (int i = 0; i < 2; ++i) {
    const auto v = shards[static_cast<std::size_t>(i)].data.to_vector();
    ASSERT_EQ(v.size(), 6u);
    for (int r = 0; r < 2; ++r)
      for (int c = 0; c < 3; ++c)
        EXPECT_EQ(v[static_cast<std::size_t>(r * 3 + c)], data[static_cast<std::size_t>((2 * rank() + r) * 6 + 3 * i + c)]);
  }
}

TEST_F(MpiSpmd, ValuesShardedAcrossProcessesReadWhole) {
  const auto mesh = rows_are_processes();
  const std::vector<spmd::PartitionSpec> specs = {{"data", "model"}, {"data"}, {std::nullopt, "data"}, {"model", "data"}, {}};
  for (const auto& spec : specs) {
    auto x = host_tensor({6, 4}, 2);
    const auto want = x.to_vector();
    spmd::mark_sharding(x, mesh, spec);
    const auto before = counter("SpmdGathers");
    const auto got = x.to_vector();
    EXPECT_EQ(counter("SpmdGathers"), before + 1) << spmd::sharding_spec(x);
    EXPECT_EQ(got, want) << spmd::sharding_spec(x);
    // And a value computed on the pieces (each process computes its own).
    Tensor<double> y = x * 2.0 + 1.0;
    const auto v = y.to_vector();
    for (std::size_t i = 0; i < v.size(); ++i) EXPECT_EQ(v[i], want[i] * 2.0 + 1.0) << spmd::sharding_spec(x);
  }
}

TEST_F(MpiSpmd, ContractionSplitAcrossProcessesAllReduces) {
  const auto mesh = rows_are_processes();
  auto x = host_tensor({4, 6}, 3), w = host_tensor({6, 5}, 4);
  const auto xv = x.to_vector(), wv = w.to_vector();
  // x's columns and w's rows split over the processes: partial products, summed across them.
  spmd::mark_sharding(x, mesh, {std::nullopt, "data"});
  spmd::mark_sharding(w, mesh, {"data"});
  const auto reduces = counter("SpmdAllReduces");
  Tensor<double> y = lazy::matmul(x, w);
  EXPECT_GT(counter("SpmdAllReduces"), reduces);
  Tensor<double> rows = lazy::sum(x, {1});
  Tensor<double> top = lazy::amax(x, {1});
  lazy::mark_step();
  std::vector<double> want(20, 0.0), want_rows(4, 0.0), want_top(4, -1e300);
  for (int i = 0; i < 4; ++i)
    for (int k = 0; k < 6; ++k) {
      const double a = xv[static_cast<std::size_t>(i * 6 + k)];
      want_rows[static_cast<std::size_t>(i)] += a;
      want_top[static_cast<std::size_t>(i)] = std::max(want_top[static_cast<std::size_t>(i)], a);
      for (int j = 0; j < 5; ++j) want[static_cast<std::size_t>(i * 5 + j)] += a * wv[static_cast<std::size_t>(k * 5 + j)];
    }
  const auto got = y.to_vector();
  expect_close(got, want, "matmul");
  expect_close(rows.to_vector(), want_rows, "sum");
  EXPECT_EQ(top.to_vector(), want_top);  // max splits no sum: exact
  EXPECT_TRUE(same_in_every_process(got));
  EXPECT_TRUE(same_in_every_process(rows.to_vector()));
}

using lazy_tests::SpmdMode;
using TrainingRun = lazy_tests::SpmdRun;

// Data and FSDP: one axis over the 4 devices of both processes. Tensor parallel: the model
// axis across the processes (ici (2, 1) x dcn (1, 2)), the batch split over "data".
TrainingRun train(SpmdMode mode) {
  const spmd::HybridMesh data({2}, {2}, {"data"});
  const spmd::HybridMesh model({2, 1}, {1, 2}, {"data", "model"});
  return lazy_tests::train_spmd_mlp(mode, data, model, {"data"}, 11, 200);
}

void expect_same_run(const TrainingRun& got, const TrainingRun& want, const char* what) {
  expect_close(got.losses, want.losses, std::string(what) + " losses");
  ASSERT_EQ(got.weights.size(), want.weights.size());
  for (std::size_t p = 0; p < got.weights.size(); ++p) {
    expect_close(got.weights[p], want.weights[p], std::string(what) + " parameter " + std::to_string(p));
    EXPECT_TRUE(same_in_every_process(got.weights[p])) << what << " parameter " << p;
  }
  EXPECT_TRUE(same_in_every_process(got.losses)) << what;
  EXPECT_NE(want.losses.front(), want.losses.back());  // the run must move
}

TEST_F(MpiSpmd, TrainingAcrossProcessesMatchesUnsharded) {
  const TrainingRun ref = train(SpmdMode::None);
  const auto reduces = counter("SpmdAllReduces");
  expect_same_run(train(SpmdMode::Data), ref, "data parallel");
  EXPECT_GT(counter("SpmdAllReduces"), reduces);
  expect_same_run(train(SpmdMode::Fsdp), ref, "fsdp");
  expect_same_run(train(SpmdMode::Tensor), ref, "tensor parallel");
}

TEST_F(MpiSpmd, SaveGathersWritesOnceAndIsCompleteEverywhere) {
  int pid = static_cast<int>(::getpid());
  MPI_Bcast(&pid, 1, MPI_INT, 0, MPI_COMM_WORLD);  // one path for the job
  const std::string path = ::testing::TempDir() + "mpi_spmd_" + std::to_string(pid) + ".safetensors";
  auto x = host_tensor({4, 6}, 7);
  const auto want = x.to_vector();
  spmd::mark_sharding(x, rows_are_processes(), {"data", "model"});
  lazy::StateDict sd;
  sd.insert("x", x);
  lazy::io::save(sd, path);
  // The file is complete when save returns in either process (only process 0 wrote it).
  const Tensor<double> back = lazy::io::load(path).at("x");
  EXPECT_EQ(back.to_vector(), want);
  EXPECT_THROW(lazy::io::save(sd, path, {.shard_files = true}), lazy::IoError);
  MPI_Barrier(MPI_COMM_WORLD);
  if (rank() == 0) std::remove(path.c_str());
}

TEST_F(MpiSpmd, TrainerSpmdStrategySpansTheProcesses) {
  using trainer_testing::Classifier;
  namespace train = lazy::train;
  char name[256] = {};  // one checkpoint directory for the job: process 0 names it
  if (rank() == 0) std::strncpy(name, trainer_testing::temp_dir("mpi_spmd_ckpt").c_str(), sizeof name - 1);
  MPI_Bcast(name, sizeof name, MPI_CHAR, 0, MPI_COMM_WORLD);
  const std::string dir = name;
  auto loader = lazy::data::make_data_loader(trainer_testing::make_dataset(64), {.batch_size = 16});
  Classifier spanned, single;
  train::TrainerOptions o = trainer_testing::quiet({.strategy = std::string("spmd"), .devices = 2, .max_epochs = 2});
  o.enable_checkpointing = true;
  o.callbacks = {std::make_shared<train::ModelCheckpoint>(
      train::ModelCheckpointOptions{.dirpath = dir, .filename = "{epoch}", .save_last = true, .save_top_k = -1})};
  train::Trainer t(o);
  t.fit(spanned, *loader);
  // One replica per process, with the same seeds; process 0 alone logs and writes.
  EXPECT_EQ(t.global_rank(), 0);
  EXPECT_EQ(t.is_global_zero(), rank() == 0);
  EXPECT_EQ(t.global_step(), 8) << "the mesh takes the whole batch of 16: 4 steps per epoch";
  train::Trainer ts(trainer_testing::quiet({.max_epochs = 2}));
  ts.fit(single, *loader);
  const auto a = trainer_testing::weights(spanned), b = trainer_testing::weights(single);
  ASSERT_EQ(a.size(), b.size());
  for (std::size_t p = 0; p < a.size(); ++p) {
    for (std::size_t i = 0; i < a[p].size(); ++i) EXPECT_NEAR(a[p][i], b[p][i], 2e-5) << "parameter " << p;
    EXPECT_TRUE(same_in_every_process(std::vector<double>(a[p].begin(), a[p].end()))) << "parameter " << p;
  }
  MPI_Barrier(MPI_COMM_WORLD);
  std::vector<std::string> files;
  for (const auto& n : lazy::io::detail::list_directory(dir)) files.push_back(n);
  std::sort(files.begin(), files.end());
  EXPECT_EQ(files, (std::vector<std::string>{"epoch=0.safetensors", "epoch=1.safetensors", "last.safetensors"}));
  EXPECT_NO_THROW((void)lazy::io::load(dir + "/last.safetensors"));

  // max_time: the processes decide together (each reads its own clock), so both stop after
  // the same step instead of one waiting in the next step's all-reduce.
  Classifier timed;
  train::Trainer tt(trainer_testing::quiet({.strategy = std::string("spmd"), .devices = 2,
                                            .max_time = std::chrono::duration<double>(rank() == 0 ? 0.0 : 3600.0)}));
  tt.fit(timed, *loader);
  EXPECT_EQ(tt.global_step(), 1) << "process 0's time is up at the first check: every process stops there";
}

TEST_F(MpiSpmd, DivergentProgramsEndInErrors) {
  const auto mesh = rows_are_processes();
  // The same tensor sharded two ways, one per process: the blocks are as large, the
  // gathers' signatures differ.
  auto x = host_tensor({4, 4}, 5);
  spmd::mark_sharding(x, mesh, rank() == 0 ? spmd::PartitionSpec{"data"} : spmd::PartitionSpec{std::nullopt, "data"});
  EXPECT_THROW(x.to_vector(), lazy::CollectiveMismatch);
  // Tensors of different sizes: each process is sent a block of another size than it
  // expects (a mismatch, not a truncated receive).
  auto w = host_tensor({4, rank() == 0 ? 4 : 6}, 8);
  spmd::mark_sharding(w, mesh, {"data"});
  const auto text = dist_testing::message_of<lazy::CollectiveMismatch>([&] { (void)w.to_vector(); });
  EXPECT_NE(text.find("sent a different collective"), std::string::npos) << text;

  // One process reads a value the other never does: a timeout, not a hang. (Last: the
  // processes' exchange sequences part here.)
  lazy::dist::set_collective_timeout(std::chrono::milliseconds(1500));
  auto z = host_tensor({4, 4}, 6);
  spmd::mark_sharding(z, mesh, {"data"});
  if (rank() == 0) {
    const auto start = std::chrono::steady_clock::now();
    EXPECT_THROW(z.to_vector(), lazy::CollectiveTimeout);
    EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

}  // namespace mpi_spmd_testing
