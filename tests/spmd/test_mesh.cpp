// Meshes, partition specs and their resolution: layouts, every error with its message, and
// the sharding text (XLA's HloSharding form, derived here by hand for each case).

#include <gtest/gtest.h>

#include <lazytensor/spmd.hpp>

namespace spmd = lazy::spmd;

namespace {

// The message of the error `f` throws, or "" when it throws none of type E.
template <class E, class F>
std::string message_of(F&& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST(SpmdMesh, ShapeNamesAndLogicalLayout) {
  ASSERT_EQ(lazy::runtime::global_runtime_device_count(), 4);
  spmd::Mesh m({3, 1, 0, 2}, {2, 2}, {"data", "model"});
  const auto shape = m.shape();
  ASSERT_EQ(shape.size(), 2u);
  EXPECT_EQ(shape[0].first, "data");
  EXPECT_EQ(shape[0].second, 2);
  EXPECT_EQ(shape[1].first, "model");
  EXPECT_EQ(m.size(), 4);
  const auto logical = m.get_logical_mesh();
  EXPECT_EQ(logical.at({0, 0}), 3);
  EXPECT_EQ(logical.at({0, 1}), 1);
  EXPECT_EQ(logical.at({1, 0}), 0);
  EXPECT_EQ(logical.at({1, 1}), 2);
  EXPECT_EQ(m.position_of(0), 2);
  EXPECT_EQ(m.str(), "Mesh(shape=(\"data\": 2, \"model\": 2), devices=[3, 1, 0, 2])");
  // Unnamed axes are named by their index.
  spmd::Mesh u({0, 1, 2, 3}, {4});
  EXPECT_EQ(u.shape()[0].first, "0");
}

TEST(SpmdMesh, InvalidMeshesNameTheProblem) {
  EXPECT_NE(message_of<lazy::Error>([] { spmd::Mesh({0, 1, 2}, {2, 2}); }).find("holds 4 devices, but 3 device ids"),
            std::string::npos);
  EXPECT_NE(message_of<lazy::Error>([] { spmd::Mesh({0, 1, 1, 2}, {4}); }).find("device id 1 appears twice"),
            std::string::npos);
  EXPECT_NE(message_of<lazy::Error>([] { spmd::Mesh({0, 1, 2, 7}, {4}); }).find("device id 7 names no device"),
            std::string::npos);
  EXPECT_NE(message_of<lazy::Error>([] { spmd::Mesh({0, 1, 2, 3}, {2, 2}, {"x", "x"}); })
                .find("axis name \"x\" appears twice"),
            std::string::npos);
  EXPECT_NE(message_of<lazy::Error>([] { spmd::Mesh({0, 1, 2, 3}, {2, 2}, {"x"}); }).find("1 axis names given"),
            std::string::npos);
  // A shape whose product overflows (it wrapped to 0, matching an empty id list).
  EXPECT_NE(message_of<lazy::Error>([] {
              spmd::Mesh({}, {std::int64_t{1} << 32, std::int64_t{1} << 32});
            }).find("more devices than there can be"),
            std::string::npos);
  EXPECT_THROW(spmd::HybridMesh({1 << 20, 1}, {1 << 20, 1}), lazy::Error);
}

TEST(SpmdMesh, GeometryHelpersCheckTheirRanges) {
  spmd::Mesh m({0, 1, 2, 3}, {2, 2});
  EXPECT_EQ(m.coordinates(3), (std::vector<std::int64_t>{1, 1}));
  EXPECT_THROW(m.coordinates(7), lazy::IndexError);  // (wrapped to (1, 1))
  EXPECT_THROW(m.coordinates(-1), lazy::IndexError);
  spmd::LogicalMesh bad{{2, 2}, {0, 1}};  // fewer ids than positions
  EXPECT_EQ(bad.at({0, 1}), 1);
  EXPECT_THROW(bad.at({1, 1}), lazy::Error);
  const auto s = spmd::resolve_sharding(m, {0, 1}, lazy::Shape{4, 6});
  EXPECT_EQ(s.block_shape(lazy::Shape{4, 6}), (lazy::Shape{2, 3}));
  EXPECT_THROW(s.block(0, lazy::Shape{4, 6, 8}), lazy::ShapeError);
  EXPECT_THROW(s.block_shape(lazy::Shape{4}), lazy::ShapeError);
}

TEST(SpmdMesh, HybridMeshPutsTheDcnPartOuter) {
  // ici (2, 1) inside dcn (1, 2): slice s holds ids 2s, 2s + 1 along axis 0; the slices
  // follow each other along axis 1.
  spmd::HybridMesh h({2, 1}, {1, 2}, {"a", "b"});
  EXPECT_EQ(h.mesh_shape(), (std::vector<std::int64_t>{2, 2}));
  EXPECT_EQ(h.device_ids(), (std::vector<int>{0, 2, 1, 3}));
  // ici (1, 2), dcn (2, 1): slices stacked along axis 0, ids row-major inside each.
  spmd::HybridMesh v({1, 2}, {2, 1});
  EXPECT_EQ(v.device_ids(), (std::vector<int>{0, 1, 2, 3}));
  // A flat dcn of 4 slices of one device each.
  spmd::HybridMesh f({1}, {4});
  EXPECT_EQ(f.device_ids(), (std::vector<int>{0, 1, 2, 3}));
  EXPECT_NE(message_of<lazy::Error>([] { spmd::HybridMesh({2}, {1}); }).find("makes 2 devices"), std::string::npos);
  EXPECT_NE(message_of<lazy::Error>([] { spmd::HybridMesh({2, 2}, {1}); }).find("same number of axes"),
            std::string::npos);
}

TEST(SpmdMesh, GlobalMesh) {
  spmd::Mesh m({0, 1, 2, 3}, {4}, {"data"});
  spmd::set_global_mesh(m);
  ASSERT_TRUE(spmd::get_global_mesh().has_value());
  EXPECT_TRUE(*spmd::get_global_mesh() == m);
}

TEST(SpmdSpec, ErrorsNameTheOffender) {
  spmd::Mesh m({0, 1, 2, 3}, {4, 1}, {"x", "y"});
  EXPECT_EQ(message_of<lazy::ShardingError>([&] { spmd::resolve_sharding(m, {"x"}, lazy::Shape{6, 4}); }),
            "dimension 0 of shape (6, 4) must be divisible by 4 (mesh axis \"x\")");
  EXPECT_EQ(message_of<lazy::ShardingError>([&] { spmd::resolve_sharding(m, {std::nullopt, {"y", "x"}}, lazy::Shape{8, 6}); }),
            "dimension 1 of shape (8, 6) must be divisible by 4 (mesh axes \"y\", \"x\")");
  EXPECT_NE(message_of<lazy::ShardingError>([&] { spmd::resolve_sharding(m, {"z"}, lazy::Shape{8}); })
                .find("no axis named \"z\" (its axes: \"x\", \"y\")"),
            std::string::npos);
  EXPECT_NE(message_of<lazy::ShardingError>([&] { spmd::resolve_sharding(m, {2}, lazy::Shape{8}); })
                .find("mesh axis 2 out of range for a mesh of 2 axes"),
            std::string::npos);
  EXPECT_NE(message_of<lazy::ShardingError>([&] { spmd::resolve_sharding(m, {0, "x"}, lazy::Shape{8, 8}); })
                .find("mesh axis \"x\" is used twice"),
            std::string::npos);
  EXPECT_NE(message_of<lazy::ShardingError>([&] { spmd::resolve_sharding(m, {0, 1, std::nullopt}, lazy::Shape{8, 8}); })
                .find("3 entries, but the tensor of shape (8, 8) has rank 2"),
            std::string::npos);
}

TEST(SpmdSpec, ResolutionAndText) {
  spmd::Mesh m({0, 1, 2, 3}, {2, 2}, {"x", "y"});
  // Padding: a shorter spec replicates the remaining dimensions.
  auto s = spmd::resolve_sharding(m, {"x"}, lazy::Shape{4, 6});
  EXPECT_EQ(s.dims, (std::vector<std::vector<int>>{{0}, {}}));
  EXPECT_EQ(s.parts(0), 2);
  // Tile [2, 1] plus 2 replicas along y: tile index (row, replica) lists devices 0,1,2,3.
  EXPECT_EQ(s.str(), "{devices=[2,1,2]0,1,2,3 last_tile_dim_replicate}");
  // Both axes on dimension 1, y major: position (x, y) holds part y * 2 + x.
  auto t = spmd::resolve_sharding(m, {std::nullopt, {"y", "x"}}, lazy::Shape{2, 8});
  EXPECT_EQ(t.str(), "{devices=[1,4]0,2,1,3}");
  EXPECT_EQ(t.block(1, lazy::Shape{2, 8})[1], (std::pair<std::int64_t, std::int64_t>{4, 6}));
  EXPECT_EQ(spmd::resolve_sharding(m, {}, lazy::Shape{3}).str(), "{replicated}");
  EXPECT_EQ(spmd::resolve_sharding(m, {1, 0}, lazy::Shape{2, 2}).str(), "{devices=[2,2]0,2,1,3}");
  // A ShardingSpec resolves per tensor.
  spmd::ShardingSpec spec(m, {"x", "y"});
  EXPECT_EQ(spec.resolve(lazy::Shape{4, 4}).str(), "{devices=[2,2]0,1,2,3}");
}
