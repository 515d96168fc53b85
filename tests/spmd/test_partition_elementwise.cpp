// Element-wise statements on sharded tensors run shard-wise (one node per device, no
// gather) and equal the unsharded computation bitwise; operands sharded otherwise are
// split to the lead's sharding; ops without a rule read the gathered value.

#include <gtest/gtest.h>

#include <lazytensor/spmd.hpp>

#include "testing/spmd.hpp"

namespace spmd = lazy::spmd;

namespace {

using lazy_tests::random_tensor;
std::int64_t count(const char* name) { return lazy_tests::counter_value(name); }

}  // namespace

TEST(SpmdElementwise, ShardWiseOnEveryMeshAndSpecEqualsUnsharded) {
  const std::vector<spmd::Mesh> meshes = {spmd::Mesh({0, 1, 2, 3}, {4}), spmd::Mesh({0, 1, 2, 3}, {2, 2}),
                                          spmd::Mesh({0, 1, 2, 3}, {1, 4}), spmd::Mesh({2, 0, 3, 1}, {4, 1})};
  for (const auto& mesh : meshes) {
    std::vector<spmd::PartitionSpec> forms = {{0}, {std::nullopt, 0}, {}};
    if (mesh.rank() == 2) {
      forms.push_back({0, 1});
      forms.push_back({{1, 0}});
      forms.push_back({std::nullopt, {0, 1}});
    }
    for (const auto& spec : forms) {
      auto a = random_tensor({8, 12}, 1), b = random_tensor({8, 12}, 2), bias = random_tensor({12}, 3);
      // Reference: the same statement, unsharded.
      lazy::Tensor<double> ref = lazy::exp(a) * b - bias / 3.0;
      const auto expect = ref.to_vector();
      spmd::mark_sharding(a, mesh, spec);
      spmd::mark_sharding(b, mesh, spec);
      const auto gathers = count("SpmdGathers");
      const auto transfers = count("SpmdTransfers");
      lazy::Tensor<double> y = lazy::exp(a) * b - bias / 3.0;  // bias: replicated, unmarked
      EXPECT_EQ(spmd::sharding_spec(y), spmd::sharding_spec(a));
      lazy::mark_step();
      EXPECT_EQ(count("SpmdGathers"), gathers);      // nothing gathered to compute
      EXPECT_EQ(count("SpmdTransfers"), transfers + 1);  // the unmarked bias, split once
      EXPECT_EQ(y.to_vector(), expect) << mesh.str();
    }
  }
}

TEST(SpmdElementwise, BroadcastOperandsMarkedReplicatedStayLocal) {
  spmd::Mesh mesh({0, 1, 2, 3}, {2, 2}, {"data", "model"});
  auto x = random_tensor({8, 6}, 4), w = random_tensor({6}, 5), col = random_tensor({8, 1}, 6);
  lazy::Tensor<double> ref = x * w + col;
  spmd::mark_sharding(x, mesh, {"data", std::nullopt});
  spmd::mark_sharding(w, mesh, {});
  spmd::mark_sharding(col, mesh, {"data", std::nullopt});
  const auto transfers = count("SpmdTransfers");
  lazy::Tensor<double> y = x * w + col;
  EXPECT_EQ(count("SpmdTransfers"), transfers);
  EXPECT_EQ(y.to_vector(), ref.to_vector());
  // Each device computed its own block: piece p holds rows of its data coordinate.
  auto pieces = spmd::local_shards(y);
  EXPECT_EQ(pieces[2].index[0], (std::pair<std::int64_t, std::int64_t>{4, 8}));
  EXPECT_EQ(pieces[2].data.shape(), (lazy::Shape{4, 6}));
}

TEST(SpmdElementwise, DifferentShardingsAreResplitToTheLargerOperand) {
  spmd::Mesh mesh({0, 1, 2, 3}, {4}, {"x"});
  auto a = random_tensor({8, 8}, 7), b = random_tensor({8, 8}, 8), small = random_tensor({8}, 9);
  lazy::Tensor<double> ref = a + b * small;
  spmd::mark_sharding(a, mesh, {"x"});
  spmd::mark_sharding(b, mesh, {std::nullopt, "x"});
  spmd::mark_sharding(small, mesh, {"x"});  // sharded along the output's dimension 1
  lazy::Tensor<double> y = a + b * small;
  EXPECT_EQ(y.to_vector(), ref.to_vector());
}

TEST(SpmdElementwise, InPlaceUpdatesAndAutogradStaySharded) {
  spmd::Mesh mesh({0, 1, 2, 3}, {4}, {"x"});
  auto w = random_tensor({8, 4}, 10);
  auto ref_w = w.detach();
  spmd::mark_sharding(w, mesh, {"x"});
  w.requires_grad_();
  auto ref_leaf = ref_w.detach().requires_grad_();
  // Element-wise forward and backward: d/dw sum(w^2 * 3) = 6 w (sum has no rule yet: it
  // reads the gathered value).
  lazy::sum(lazy::square(w) * 3.0).backward();
  lazy::sum(lazy::square(ref_leaf) * 3.0).backward();
  const auto g = w.grad().to_vector(), rg = ref_leaf.grad().to_vector();
  ASSERT_EQ(g.size(), rg.size());
  for (std::size_t i = 0; i < g.size(); ++i) EXPECT_DOUBLE_EQ(g[i], rg[i]);
  // An optimizer-like in-place update under no_grad keeps the sharding.
  {
    lazy::NoGradGuard ng;
    w.sub_(w.grad() * 0.5);
    ref_w.sub_(ref_leaf.grad() * 0.5);
  }
  EXPECT_EQ(spmd::sharding_spec(w), "{devices=[4,1]0,1,2,3}");
  EXPECT_EQ(w.to_vector(), ref_w.to_vector());
}

TEST(SpmdElementwise, OpsWithoutARuleReadTheGatheredValue) {
  spmd::Mesh mesh({0, 1, 2, 3}, {2, 2});
  auto a = random_tensor({4, 6}, 11);
  const auto ref = lazy::argmax(a, 1).to_vector();
  spmd::mark_sharding(a, mesh, {0, 1});
  const auto gathers = count("SpmdGathers");
  auto c = lazy::argmax(a, 1);  // no rule: runs whole on the gathered value
  EXPECT_EQ(count("SpmdGathers"), gathers + 1);
  EXPECT_EQ(c.to_vector(), ref);
  EXPECT_EQ(spmd::sharding_spec(c), "");
}

TEST(SpmdElementwise, MarkStepStepsEveryDevice) {
  spmd::Mesh mesh({0, 1, 2, 3}, {4});
  auto a = random_tensor({16}, 13);
  spmd::mark_sharding(a, mesh, {0});
  lazy::Tensor<double> y = a * 2.0;
  lazy::mark_step();
  lazy::wait_device_ops();
  for (const auto& s : spmd::local_shards(y)) EXPECT_TRUE(s.data.node()->materialized());
}
