// io/save.hpp (xm.save) from replicas: only the master writes, every replica materializes
// its tensors, and the file is complete when save returns on any replica; master_only =
// false; a failed write reported on every replica; outside spawn it just writes. Also run
// under TSan.
#include "dist_testing.hpp"

#include <filesystem>
#include <string>
#include <unistd.h>
#include <vector>

#include <lazytensor/io.hpp>

namespace {

using dist_testing::Watchdog;
using lazy::Shape;
using lazy::Tensor;
namespace dist = lazy::dist;
namespace fs = std::filesystem;

/// A fresh empty directory for one test, removed afterwards.
class TempDir {
 public:
  TempDir() {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    path_ = fs::temp_directory_path() /
            ("lazytensor_save_" + std::to_string(::getpid()) + "_" + info->name());
    fs::remove_all(path_);
    fs::create_directories(path_);
  }
  ~TempDir() { fs::remove_all(path_); }
  std::string file(const std::string& name) const { return (path_ / name).string(); }
  std::size_t entries() const {
    return static_cast<std::size_t>(std::distance(fs::directory_iterator(path_), fs::directory_iterator()));
  }

 private:
  fs::path path_;
};

/// Replica r's values of "w" (so the file tells which replica wrote it).
std::vector<float> w_of(int r) {
  std::vector<float> v;
  for (int i = 0; i < 1000; ++i) v.push_back(static_cast<float>(r * 10000 + i));
  return v;
}

/// Replica r's state dict; "w" still pending (a traced computation).
lazy::StateDict state_of(int r, Tensor<float>& w) {
  std::vector<float> half = w_of(r);
  for (auto& x : half) x *= 0.5f;
  w = lazy::from_vector<float>(half, Shape{10, 100}) * 2.0f;
  lazy::StateDict sd;
  sd.insert("w", w);
  sd.insert("step", lazy::from_vector<std::int64_t>({static_cast<std::int64_t>(r + 7)}, Shape{}));
  sd.metadata()["replica"] = std::to_string(r);
  return sd;
}

/// Checks that `path` holds replica `writer`'s state dict.
void expect_written_by(const std::string& path, int writer, const std::string& who) {
  const lazy::StateDict sd = lazy::io::load(path);
  ASSERT_EQ(sd.size(), 2u) << who;
  EXPECT_EQ(sd.metadata().at("replica"), std::to_string(writer)) << who;
  EXPECT_EQ(sd.at("w").as<float>().to_vector(), w_of(writer)) << who;
  EXPECT_EQ(sd.at("step").as<std::int64_t>().item(), writer + 7) << who;
}

TEST(Save, OnlyTheMasterWritesAndTheFileIsCompleteOnReturn) {
  Watchdog dog;
  for (bool global_master : {false, true}) {
    TempDir dir;
    const std::string path = dir.file("model.safetensors");
    dist::spawn(
        [&](int r) {
          Tensor<float> w;
          const lazy::StateDict sd = state_of(r, w);
          EXPECT_TRUE(w.node()->pending());
          lazy::io::save(sd, path, true, global_master);
          EXPECT_TRUE(w.node()->materialized()) << "replica " << r;  // every replica syncs
          // any replica may read the file as soon as save returns
          expect_written_by(path, 0, "replica " + std::to_string(r));
        },
        3);
    EXPECT_EQ(dir.entries(), 1u);  // no temporary file left behind
  }
}

TEST(Save, EveryReplicaWritesWhenNotMasterOnly) {
  Watchdog dog;
  TempDir dir;
  dist::spawn(
      [&](int r) {
        Tensor<float> w;
        lazy::io::save(state_of(r, w), dir.file("r" + std::to_string(r)), false);
        // replica 1's file is complete when replica 0 returns, and the other way round
        expect_written_by(dir.file("r" + std::to_string(1 - r)), 1 - r, "replica " + std::to_string(r));
      },
      2);
  EXPECT_EQ(dir.entries(), 2u);
}

TEST(Save, AFailedWriteIsReportedOnEveryReplica) {
  Watchdog dog;
  TempDir dir;
  const std::string path = dir.file("missing_dir/model.safetensors");
  std::vector<std::string> errors(2);
  dist::spawn(
      [&](int r) {
        Tensor<float> w;
        errors[static_cast<std::size_t>(r)] =
            dist_testing::message_of<lazy::IoError>([&] { lazy::io::save(state_of(r, w), path); });
        // the world is still usable: nobody was left behind in a collective
        dist::barrier("after save");
      },
      2);
  EXPECT_NE(errors[0].find("missing_dir"), std::string::npos) << errors[0];  // the writer's own error
  EXPECT_NE(errors[1].find("replica 0 failed"), std::string::npos) << errors[1];
  EXPECT_EQ(dir.entries(), 0u);
}

TEST(Save, OutsideSpawnItJustWrites) {
  TempDir dir;
  Tensor<float> w;
  lazy::io::save(state_of(0, w), dir.file("m"));
  expect_written_by(dir.file("m"), 0, "outside spawn");
  lazy::io::save(state_of(0, w), dir.file("n"), false, true);
  expect_written_by(dir.file("n"), 0, "outside spawn, not master only");
}

}  // namespace
