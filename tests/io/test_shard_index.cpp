// io/shard_index.hpp: a shard index written by hand over ordinary safetensors files loads
// as the whole tensors (against the values the files were cut from), the index text parses
// back to what was written, and every malformed index or shard file is a FormatError naming
// the file and the problem.

#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include <lazytensor/io.hpp>
#include <lazytensor/tensor.hpp>

namespace {

namespace io = lazy::io;
using io::detail::ShardBlock;
using io::detail::ShardedEntry;
using io::detail::ShardIndex;

std::string temp(const std::string& name) { return ::testing::TempDir() + name; }

void write_text(const std::string& path, const std::string& text) { std::ofstream(path, std::ios::binary) << text; }

// A (4, 3) float tensor cut by rows into two shard files, and its index.
struct Fixture {
  std::vector<float> values;
  ShardIndex index;
  std::string path = temp("hand.json");

  Fixture() {
    for (int i = 0; i < 12; ++i) values.push_back(0.5f * static_cast<float>(i) - 2.0f);
    lazy::StateDict top, bottom;
    top.insert("w", lazy::from_vector<float>(std::vector<float>(values.begin(), values.begin() + 6), {2, 3}));
    bottom.insert("w", lazy::from_vector<float>(std::vector<float>(values.begin() + 6, values.end()), {2, 3}));
    index.files = {"hand.a.safetensors", "hand.b.safetensors"};
    io::save_file(top, temp(index.files[0]));
    io::save_file(bottom, temp(index.files[1]));
    // Listed bottom block first: the order of blocks is free.
    index.tensors.push_back(ShardedEntry{"w", "float32", {4, 3}, "{devices=[2,1]0,1}",
                                         {ShardBlock{1, {{2, 4}, {0, 3}}}, ShardBlock{0, {{0, 2}, {0, 3}}}}});
    index.metadata["step"] = "12";
  }
  ~Fixture() {
    for (const auto& f : index.files) std::remove(temp(f).c_str());
    std::remove(path.c_str());
  }
  void write() const { write_text(path, io::detail::shard_index_json(index)); }
};

std::string load_error(const std::string& path) {
  try {
    io::load(path);
  } catch (const lazy::FormatError& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(ShardIndex, AHandWrittenIndexLoadsAsTheWholeTensor) {
  Fixture f;
  f.write();
  auto sd = io::load(f.path);
  const lazy::Tensor<float> w = sd.at("w");
  EXPECT_EQ(w.shape(), (lazy::Shape{4, 3}));
  EXPECT_EQ(w.to_vector(), f.values);
  EXPECT_EQ(sd.metadata().at("step"), "12");
}

TEST(ShardIndex, TheTextParsesBackToTheIndex) {
  Fixture f;
  f.index.metadata["quote\"d"] = "line\nbreak";
  const std::string text = io::detail::shard_index_json(f.index);
  const ShardIndex back = io::detail::parse_shard_index(text, "x");
  EXPECT_EQ(back.files, f.index.files);
  EXPECT_EQ(back.metadata, f.index.metadata);
  ASSERT_EQ(back.tensors.size(), 1u);
  EXPECT_EQ(back.tensors[0].name, "w");
  EXPECT_EQ(back.tensors[0].dtype, "float32");
  EXPECT_EQ(back.tensors[0].shape, (std::vector<std::int64_t>{4, 3}));
  EXPECT_EQ(back.tensors[0].sharding, "{devices=[2,1]0,1}");
  ASSERT_EQ(back.tensors[0].blocks.size(), 2u);
  EXPECT_EQ(back.tensors[0].blocks[0].file, 1u);
  EXPECT_EQ(back.tensors[0].blocks[0].index, (std::vector<std::pair<std::int64_t, std::int64_t>>{{2, 4}, {0, 3}}));
}

TEST(ShardIndex, ShardFileNamesDropAJsonSuffixAndTheDirectory) {
  EXPECT_EQ(io::detail::shard_file_name("ckpt/model.json", "7f", 1, 4), "model.7f.shard-1-of-4.safetensors");
  EXPECT_EQ(io::detail::shard_file_name("model", "7f", 0, 1), "model.7f.shard-0-of-1.safetensors");
}

TEST(ShardIndex, MalformedIndexesNameTheProblem) {
  struct Case {
    const char* what;
    void (*change)(ShardIndex&);
    const char* expected;
  };
  const Case cases[] = {
      {"overlap", [](ShardIndex& i) { i.tensors[0].blocks[0].index[0] = {1, 3}; }, "overlap"},
      {"gap", [](ShardIndex& i) { i.tensors[0].blocks[0].index[0] = {3, 4}; }, "hold 9 of its 12 elements"},
      {"outside", [](ShardIndex& i) { i.tensors[0].blocks[0].index[1] = {0, 4}; }, "outside [0, 3)"},
      {"file", [](ShardIndex& i) { i.tensors[0].blocks[0].file = 5; }, "names file 5 of 2"},
      {"rank", [](ShardIndex& i) { i.tensors[0].blocks[0].index.pop_back(); }, "has 1 ranges for a tensor of rank 2"},
      {"dtype", [](ShardIndex& i) { i.tensors[0].dtype = "float16"; }, "unknown dtype \"float16\""},
      {"mismatch", [](ShardIndex& i) { i.tensors[0].dtype = "float64"; }, "says float64"},
      {"missing", [](ShardIndex& i) { i.tensors[0].name = "v"; }, "no tensor 'v'"},
      {"same file", [](ShardIndex& i) { i.tensors[0].blocks[0].file = 0; }, "both name file 0"},
      {"path", [](ShardIndex& i) { i.files[1] = "../hand.b.safetensors"; }, "is not a file name beside the index"},
      {"twice", [](ShardIndex& i) { i.tensors.push_back(i.tensors[0]); }, "listed twice"},
  };
  for (const auto& c : cases) {
    Fixture f;
    c.change(f.index);
    f.write();
    const std::string e = load_error(f.path);
    EXPECT_NE(e.find(c.expected), std::string::npos) << c.what << ": " << e;
    EXPECT_NE(e.find("hand"), std::string::npos) << c.what << ": the message names the file: " << e;
  }
  Fixture f;
  write_text(f.path, R"({"format": "lazytensor.sharded_state_dict", "version": 2})");
  EXPECT_NE(load_error(f.path).find("index version 2"), std::string::npos);
  write_text(f.path, R"({"format": "lazytensor.sharded_state_dict", "colour": 1})");
  EXPECT_NE(load_error(f.path).find("unknown key \"colour\""), std::string::npos);
  write_text(f.path, R"({"format": "lazytensor.sharded_state_dict", "files": ["a.safetensors"], )");
  EXPECT_NE(load_error(f.path).find("hand.json"), std::string::npos);
}

}  // namespace
