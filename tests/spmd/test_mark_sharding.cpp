// mark_sharding over every 4-device mesh shape and every spec form: each device's piece is
// the block a scalar loop cuts from the value, the pieces cover the tensor exactly once per
// replica group, and reading the tensor gathers it bitwise.

#include <gtest/gtest.h>

#include <lazytensor/io.hpp>
#include <lazytensor/spmd.hpp>

#include "testing/spmd.hpp"

namespace spmd = lazy::spmd;

namespace {

// Every spec form on a 2-D tensor of an (8, 8) shape, valid on each mesh above.
std::vector<spmd::PartitionSpec> specs(const spmd::Mesh& m) {
  std::vector<spmd::PartitionSpec> r = {{}, {0}, {std::nullopt, 0}, {"x"}, {std::nullopt, "x"}};
  if (m.rank() == 2) {
    r.push_back({0, 1});
    r.push_back({1, 0});
    r.push_back({"y", std::nullopt});
    r.push_back({{"x", "y"}});
    r.push_back({std::nullopt, {"y", "x"}});
  }
  return r;
}

}  // namespace

TEST(SpmdMarkSharding, PiecesAreTheBlocksAndCoverEachReplicaGroupOnce) {
  const auto values = lazy_tests::random_values<double>(64, 1);
  for (const auto& mesh : lazy_tests::named_meshes()) {
    for (const auto& spec : specs(mesh)) {
      auto t = lazy::from_vector<double>(values, {8, 8});
      spmd::mark_sharding(t, mesh, spec);
      const auto sharding = spmd::resolve_sharding(mesh, spec, lazy::Shape{8, 8});
      const auto shards = spmd::local_shards(t);
      ASSERT_EQ(shards.size(), 4u);
      // Coverage: every element is held by (4 / number of blocks) devices.
      std::int64_t blocks = sharding.parts(0) * sharding.parts(1);
      std::vector<int> hits(64, 0);
      for (std::size_t p = 0; p < shards.size(); ++p) {
        const auto& s = shards[p];
        EXPECT_EQ(s.device.index(), mesh.device_ids()[p]);
        EXPECT_EQ(s.data.device().index(), mesh.device_ids()[p]);
        const auto [r0, r1] = s.index[0];
        const auto [c0, c1] = s.index[1];
        ASSERT_EQ(s.data.shape(), (lazy::Shape{r1 - r0, c1 - c0}));
        const auto got = s.data.to_vector();
        for (auto r = r0; r < r1; ++r) {
          for (auto c = c0; c < c1; ++c) {
            ++hits[static_cast<std::size_t>(r * 8 + c)];
            EXPECT_EQ(got[static_cast<std::size_t>((r - r0) * (c1 - c0) + (c - c0))],
                      values[static_cast<std::size_t>(r * 8 + c)]);
          }
        }
      }
      for (int h : hits) EXPECT_EQ(h, 4 / blocks) << mesh.str() << " " << sharding.str();
      // Reading gathers the whole value, bitwise.
      EXPECT_EQ(t.to_vector(), values) << sharding.str();
      EXPECT_EQ(spmd::sharding_spec(t), sharding.str());
    }
  }
}

TEST(SpmdMarkSharding, AnnotatesTheTensorObjectAndClears) {
  spmd::Mesh mesh({0, 1, 2, 3}, {4}, {"data"});
  auto t = lazy::arange<float>(0, 16);
  auto alias = t;
  auto& same = spmd::mark_sharding(t, mesh, {"data"});
  EXPECT_EQ(&same, &t);
  EXPECT_EQ(spmd::sharding_spec(alias), "{devices=[4]0,1,2,3}");
  EXPECT_EQ(spmd::sharding_spec(lazy::arange<float>(0, 4)), "");
  spmd::clear_sharding(alias);
  EXPECT_EQ(spmd::sharding_spec(t), "");
  std::vector<float> expect(16);
  for (int i = 0; i < 16; ++i) expect[static_cast<std::size_t>(i)] = static_cast<float>(i);
  EXPECT_EQ(t.to_vector(), expect);
  EXPECT_EQ(t.device().index(), 0);
  // Updating a piece's handle leaves the sharded tensor alone.
  spmd::mark_sharding(t, mesh, {0});
  auto pieces = spmd::local_shards(t);
  pieces[0].data.add_(100.0f);
  EXPECT_EQ(t.to_vector(), expect);
}

TEST(SpmdMarkSharding, ErrorsOfTheAnnotation) {
  spmd::Mesh mesh({0, 1, 2, 3}, {4}, {"x"});
  auto t = lazy::zeros<float>({6, 4});
  try {
    spmd::mark_sharding(t, mesh, {"x"});
    FAIL() << "expected a ShardingError";
  } catch (const lazy::ShardingError& e) {
    EXPECT_STREQ(e.what(), "dimension 0 of shape (6, 4) must be divisible by 4 (mesh axis \"x\")");
  }
  // The failed annotation left the tensor as it was.
  EXPECT_EQ(spmd::sharding_spec(t), "");
  EXPECT_THROW(spmd::mark_sharding(t, mesh, {std::nullopt, std::nullopt, 0}), lazy::ShardingError);
  // An undefined tensor (it was dereferenced).
  lazy::Tensor<float> none;
  EXPECT_THROW(spmd::mark_sharding(none, mesh, {"x"}), lazy::Error);
  EXPECT_THROW(spmd::clear_sharding(none), lazy::Error);
  lazy::AnyTensor any_none;
  EXPECT_THROW(spmd::mark_sharding(any_none, mesh, {"x"}), lazy::Error);
}

TEST(SpmdMarkSharding, ReplicaWorldsAndSpmdModeExcludeEachOther) {
  // In SPMD mode one thread drives every device: replicas stepping every device from
  // several threads would race.
  int ran = 0;
  EXPECT_THROW(lazy::dist::spawn([&](int) { ++ran; }, 2), lazy::Error);
  EXPECT_EQ(ran, 0);
}

TEST(SpmdMarkSharding, VisualizeShowsWhoHoldsWhat) {
  spmd::Mesh mesh({0, 1, 2, 3}, {2, 2}, {"x", "y"});
  auto t = lazy::zeros<float>({4, 4});
  spmd::mark_sharding(t, mesh, {"x", "y"});
  EXPECT_EQ(spmd::visualize_tensor_sharding(t),
            "tensor of shape (4, 4), {devices=[2,2]0,1,2,3}\n"
            "+-------+-------+\n"
            "| CPU 0 | CPU 1 |\n"
            "+-------+-------+\n"
            "| CPU 2 | CPU 3 |\n"
            "+-------+-------+\n");
  auto v = lazy::zeros<float>({8});
  spmd::mark_sharding(v, mesh, {"y"});
  EXPECT_EQ(spmd::visualize_tensor_sharding(v),
            "tensor of shape (8,), {devices=[2,2]0,2,1,3 last_tile_dim_replicate}\n"
            "+---------+---------+\n"
            "| CPU 0,2 | CPU 1,3 |\n"
            "+---------+---------+\n");
  auto c = lazy::zeros<float>({2, 2, 2});
  spmd::mark_sharding(c, mesh, {std::nullopt, std::nullopt, "x"});
  const auto text = spmd::visualize_tensor_sharding(c);
  EXPECT_NE(text.find("[0:2, 0:2, 0:1] -> CPU 0,1"), std::string::npos) << text;
  EXPECT_NE(text.find("[0:2, 0:2, 1:2] -> CPU 2,3"), std::string::npos) << text;
}

TEST(SpmdMarkSharding, NeedsSpmdModeOnlyOnce) {
  EXPECT_TRUE(spmd::is_spmd());
  spmd::use_spmd();  // idempotent
  EXPECT_TRUE(spmd::is_spmd());
}

TEST(SpmdMarkSharding, LoadersDeliverBatchesAlreadySharded) {
  spmd::Mesh mesh({0, 1, 2, 3}, {4}, {"data"});
  const auto x = lazy_tests::random_values<float>(16 * 3, 5);
  std::vector<std::int64_t> y(16);
  for (int i = 0; i < 16; ++i) y[static_cast<std::size_t>(i)] = i;
  lazy::data::TensorDataset<float, std::int64_t> ds(lazy::from_vector<float>(x, {16, 3}),
                                                    lazy::from_vector<std::int64_t>(y, {16}));
  auto loader = lazy::data::make_data_loader(ds, {.batch_size = 8});
  lazy::dist::ParallelLoaderOptions options;
  options.input_sharding = std::make_shared<const spmd::ShardingSpec>(mesh, spmd::PartitionSpec{"data"});
  lazy::dist::MpDeviceLoader batches(*loader, lazy::device(0), options);
  std::size_t seen = 0;
  for (auto& batch : batches) {
    EXPECT_EQ(spmd::sharding_spec(batch.data), "{devices=[4,1]0,1,2,3}");
    EXPECT_EQ(spmd::sharding_spec(batch.target), "{devices=[4]0,1,2,3}");
    const auto rows = batch.data.to_vector();
    EXPECT_EQ(rows, std::vector<float>(x.begin() + static_cast<std::ptrdiff_t>(seen * 3),
                                       x.begin() + static_cast<std::ptrdiff_t>((seen + 8) * 3)));
    EXPECT_EQ(spmd::local_shards(batch.target)[1].data.to_vector(),
              (std::vector<std::int64_t>{static_cast<std::int64_t>(seen) + 2, static_cast<std::int64_t>(seen) + 3}));
    seen += 8;
  }
  EXPECT_EQ(seen, 16u);
}

// Whole (save_file) or as shard files plus an index (io::save with shard_files): either
// loads back whole and reshards.
TEST(SpmdMarkSharding, SavingWritesTheWholeTensorAndLoadingReshards) {
  spmd::Mesh mesh({0, 1, 2, 3}, {2, 2}, {"x", "y"});
  const auto values = lazy_tests::random_values<double>(32, 9);
  for (const bool shard_files : {false, true}) {
    auto t = lazy::from_vector<double>(values, {4, 8});
    spmd::mark_sharding(t, mesh, {"x", "y"});
    lazy::StateDict sd;
    sd.insert("w", t);
    const std::string path = ::testing::TempDir() + (shard_files ? "spmd_save.json" : "spmd_save.safetensors");
    if (shard_files) lazy::io::save(sd, path, {.shard_files = true});
    else lazy::io::save_file(sd, path);
    auto loaded = lazy::io::load(path);
    lazy::Tensor<double> w = loaded.at("w");
    EXPECT_EQ(w.shape(), (lazy::Shape{4, 8}));
    EXPECT_EQ(w.to_vector(), values);
    // Reloaded into another sharding.
    spmd::mark_sharding(w, mesh, {std::nullopt, {"y", "x"}});
    EXPECT_EQ(spmd::local_shards(w)[1].data.to_vector(),
              (std::vector<double>{values[4], values[5], values[12], values[13], values[20], values[21], values[28],
                                   values[29]}))
        << (shard_files ? "shard files" : "one file");
    if (shard_files)
      for (const auto& f : lazy::io::detail::read_shard_index(path).files) std::remove((::testing::TempDir() + f).c_str());
    std::remove(path.c_str());
  }
}
