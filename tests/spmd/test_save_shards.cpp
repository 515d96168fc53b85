// io::save with SaveOptions::shard_files over every 4-device mesh shape and spec form: one
// safetensors file per device holding exactly the distinct blocks (each once, from the first
// device holding it), an index naming them, nothing gathered; io::load of the index gives
// the whole tensors bitwise (reloading into another sharding: test_mark_sharding.cpp).

#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <map>
#include <set>
#include <string>
#include <vector>

#include <lazytensor/io.hpp>
#include <lazytensor/spmd.hpp>

#include "testing/spmd.hpp"

namespace spmd = lazy::spmd;

namespace {

std::vector<spmd::PartitionSpec> save_specs(const spmd::Mesh& m) {
  std::vector<spmd::PartitionSpec> r = {{}, {0}, {std::nullopt, 0}};
  if (m.rank() == 2) {
    r.push_back({0, 1});
    r.push_back({1, 0});
    r.push_back({{"x", "y"}});
    r.push_back({std::nullopt, {"y", "x"}});
  }
  return r;
}

std::string sharding_text(const spmd::Mesh& mesh, const spmd::PartitionSpec& spec) {
  auto t = lazy::from_vector<float>(std::vector<float>(64), {8, 8});
  spmd::mark_sharding(t, mesh, spec);
  return spmd::sharding_spec(t);
}

}  // namespace

TEST(SpmdSaveShards, EachDistinctBlockIsWrittenOnceAndLoadsBackWhole) {
  const auto values = lazy_tests::random_values<double>(64, 3);
  const auto ints = lazy_tests::random_values<double>(8, 4);
  int case_no = 0;
  for (const auto& mesh : lazy_tests::named_meshes()) {
    for (const auto& spec : save_specs(mesh)) {
      const std::string where = sharding_text(mesh, spec);
      auto w = lazy::from_vector<double>(values, {8, 8});
      spmd::mark_sharding(w, mesh, spec);
      // A pending sharded value (the blocks are computed for the save, never gathered).
      lazy::Tensor<double> w2 = w * 2.0;
      std::vector<std::int64_t> iv;
      for (double v : ints) iv.push_back(static_cast<std::int64_t>(v * 1000));
      auto b = lazy::from_vector<std::int64_t>(iv);  // not sharded: whole, on its device
      lazy::StateDict sd;
      sd.insert("w", w);
      sd.insert("w2", w2);
      sd.insert("b", b);
      sd.metadata()["epoch"] = "7";
      const std::string path = ::testing::TempDir() + "shards_" + std::to_string(case_no++) + ".json";
      const auto gathers = lazy_tests::counter_value("SpmdGathers");
      lazy::io::save(sd, path, {.shard_files = true});
      EXPECT_EQ(lazy_tests::counter_value("SpmdGathers"), gathers) << where << ": a shard-files save gathers nothing";

      // The files: read each as an ordinary safetensors file; its "w" is one block of the
      // scalar-cut value, and the blocks over all files cover (8, 8) exactly once.
      std::size_t covered = 0;
      std::set<std::vector<double>> blocks;
      const std::string dir = ::testing::TempDir();
      std::vector<std::string> files;
      for (const auto& f : lazy::io::detail::read_shard_index(path).files) files.push_back(dir + f);
      for (const auto& f : files) {
        auto part = lazy::io::load(f);
        if (const auto* piece = part.find("w")) {
          const lazy::Tensor<double> pw = *piece;
          const auto v = pw.to_vector();
          EXPECT_TRUE(blocks.insert(v).second) << where << ": a block written twice";
          covered += v.size();
        }
      }
      EXPECT_EQ(covered, 64u) << where;
      EXPECT_FALSE(files.empty()) << where;

      auto loaded = lazy::io::load(path);
      std::remove(path.c_str());
      for (const auto& f : files) std::remove(f.c_str());
      ASSERT_EQ(loaded.keys(), (std::vector<std::string>{"w", "w2", "b"})) << where;
      const lazy::Tensor<double> lw = loaded.at("w"), lw2 = loaded.at("w2");
      const lazy::Tensor<std::int64_t> lb = loaded.at("b");
      EXPECT_EQ(lw.to_vector(), values) << where;
      std::vector<double> twice;
      for (double v : values) twice.push_back(v * 2.0);
      EXPECT_EQ(lw2.to_vector(), twice) << where;
      EXPECT_EQ(lb.to_vector(), iv) << where;
      EXPECT_EQ(loaded.metadata().at("epoch"), "7");
    }
  }
}

TEST(SpmdSaveShards, ASecondSaveReplacesTheFirstsFiles) {
  spmd::Mesh mesh({0, 1, 2, 3}, {4}, {"x"});
  auto t = lazy_tests::random_tensor({8, 4}, 12);
  spmd::mark_sharding(t, mesh, {"x"});
  lazy::StateDict sd;
  sd.insert("w", t);
  const std::string path = ::testing::TempDir() + "resave.json";
  auto files_of = [&] { return lazy::io::detail::read_shard_index(path).files; };
  auto exists = [](const std::string& f) {
    std::ifstream in(::testing::TempDir() + f);
    return in.good();
  };
  lazy::io::save(sd, path, {.shard_files = true});
  const auto first = files_of();
  ASSERT_EQ(first.size(), 4u);
  lazy::io::save(sd, path, {.shard_files = true});
  const auto second = files_of();
  ASSERT_EQ(second.size(), 4u);
  for (std::size_t k = 0; k < 4; ++k) {
    EXPECT_NE(first[k], second[k]) << "a new save writes new names";
    EXPECT_FALSE(exists(first[k])) << first[k] << ": the replaced save's file is removed";
    EXPECT_TRUE(exists(second[k])) << second[k];
  }
  const lazy::Tensor<double> back = lazy::io::load(path).at("w");
  EXPECT_EQ(back.to_vector(), t.to_vector());
  for (const auto& f : second) std::remove((::testing::TempDir() + f).c_str());
  std::remove(path.c_str());
}
