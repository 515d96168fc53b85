// Reductions, products, views, transposes, softmax and losses on sharded tensors: each
// runs on blocks (partial results all-reduced where a reduced or contracted dimension is
// split) and equals the unsharded computation in double (<= 1e-12 relative; bitwise where
// no sum is split), forward and backward, on every 4-device mesh shape.

#include <gtest/gtest.h>

#include <cmath>

#include <lazytensor/lazytensor.hpp>

#include "testing/spmd.hpp"

namespace spmd = lazy::spmd;

namespace {

using lazy_tests::expect_close_rel;
using lazy_tests::random_tensor;

std::int64_t counter(const char* name) { return lazy_tests::counter_value(name); }

std::vector<spmd::Mesh> unnamed_meshes() {
  return {spmd::Mesh({0, 1, 2, 3}, {4}), spmd::Mesh({0, 1, 2, 3}, {2, 2}), spmd::Mesh({0, 1, 2, 3}, {1, 4}),
          spmd::Mesh({1, 3, 0, 2}, {4, 1})};
}

std::vector<spmd::PartitionSpec> specs_2d(const spmd::Mesh& m) {
  std::vector<spmd::PartitionSpec> r = {{0}, {std::nullopt, 0}, {}};
  if (m.rank() == 2) {
    r.push_back({0, 1});
    r.push_back({1, 0});
    r.push_back({{0, 1}});
    r.push_back({std::nullopt, {1, 0}});
  }
  return r;
}

std::string name(const spmd::Mesh& m, const lazy::Tensor<double>& t) { return m.str() + " " + spmd::sharding_spec(t); }

}  // namespace

TEST(SpmdReduction, EveryReductionOnEveryMeshAndSpec) {
  for (const auto& mesh : unnamed_meshes()) {
    for (const auto& spec : specs_2d(mesh)) {
      auto x = random_tensor({8, 12}, 21);
      auto ref = x.detach();
      spmd::mark_sharding(x, mesh, spec);
      const auto gathers = counter("SpmdGathers");
      lazy::Tensor<double> results[] = {lazy::sum(x), lazy::sum(x, {0}), lazy::sum(x, {1}), lazy::mean(x, {0}, true),
                                        lazy::amax(x, {1}), lazy::amin(x), lazy::prod(x * 0.5 + 1.0, {0})};
      lazy::Tensor<double> want[] = {lazy::sum(ref), lazy::sum(ref, {0}), lazy::sum(ref, {1}), lazy::mean(ref, {0}, true),
                                     lazy::amax(ref, {1}), lazy::amin(ref), lazy::prod(ref * 0.5 + 1.0, {0})};
      lazy::mark_step();
      lazy::wait_device_ops();
      EXPECT_EQ(counter("SpmdGathers"), gathers) << name(mesh, x);  // computed without gathering
      for (std::size_t i = 0; i < std::size(results); ++i)
        expect_close_rel(results[i].to_vector(), want[i].to_vector(), name(mesh, x) + " reduction " + std::to_string(i));
      // max/min never split a sum: bitwise.
      EXPECT_EQ(results[4].to_vector(), want[4].to_vector());
    }
  }
}

TEST(SpmdReduction, SplitReducedDimensionAllReducesOnce) {
  spmd::Mesh mesh({0, 1, 2, 3}, {2, 2}, {"x", "y"});
  auto x = random_tensor({8, 8}, 22);
  spmd::mark_sharding(x, mesh, {"x", "y"});
  const auto before = counter("SpmdAllReduces");
  auto rows = lazy::sum(x, {1});  // dimension 1 split over y: two groups (one per x) all-reduce
  EXPECT_EQ(counter("SpmdAllReduces"), before + 2);
  EXPECT_EQ(spmd::sharding_spec(rows), "{devices=[2,2]0,1,2,3 last_tile_dim_replicate}");
  auto cols = lazy::sum(x, {0});
  EXPECT_EQ(spmd::sharding_spec(cols), "{devices=[2,2]0,2,1,3 last_tile_dim_replicate}");
  // The collectives are in the devices' graphs.
  const auto text = lazy::debug::graph_text(lazy::graph::NodeList{spmd::as_sharded(rows.node())->shard(0)});
  EXPECT_NE(text.find("spmd_all_reduce"), std::string::npos) << text;
}

TEST(SpmdMatmul, EveryOperandShardingOnEveryMesh) {
  for (const auto& mesh : unnamed_meshes()) {
    for (const auto& sa : specs_2d(mesh)) {
      for (const auto& sb : specs_2d(mesh)) {
        auto a = random_tensor({8, 12}, 23), b = random_tensor({12, 16}, 24);
        const auto want = lazy::matmul(a, b).to_vector();
        spmd::mark_sharding(a, mesh, sa);
        spmd::mark_sharding(b, mesh, sb);
        auto c = lazy::matmul(a, b);
        expect_close_rel(c.to_vector(), want, name(mesh, a) + " x " + spmd::sharding_spec(b));
      }
    }
  }
}

TEST(SpmdMatmul, RowShardingStaysLocalAndColumnShardingGivesColumns) {
  spmd::Mesh mesh({0, 1, 2, 3}, {2, 2}, {"data", "model"});
  auto x = random_tensor({8, 12}, 25), w = random_tensor({16, 12}, 26), bias = random_tensor({16}, 27);
  const auto want = lazy::Tensor<double>(lazy::relu(lazy::linear(x, w, bias))).to_vector();
  spmd::mark_sharding(x, mesh, {"data"});
  spmd::mark_sharding(w, mesh, {"model"});  // [out, in]: output columns split over model
  spmd::mark_sharding(bias, mesh, {"model"});
  const auto reduces = counter("SpmdAllReduces"), transfers = counter("SpmdTransfers");
  lazy::Tensor<double> y = lazy::relu(lazy::linear(x, w, bias));
  EXPECT_EQ(counter("SpmdAllReduces"), reduces);
  EXPECT_EQ(counter("SpmdTransfers"), transfers);
  EXPECT_EQ(spmd::sharding_spec(y), "{devices=[2,2]0,1,2,3}");
  EXPECT_EQ(y.to_vector(), want);  // no sum split: bitwise
}

TEST(SpmdMatmul, MegatronColumnThenRowNeedsOneAllReduce) {
  spmd::Mesh mesh({0, 1, 2, 3}, {1, 4}, {"data", "model"});
  auto x = random_tensor({4, 8}, 28), w1 = random_tensor({16, 8}, 29), w2 = random_tensor({6, 16}, 30);
  const auto want = lazy::linear(lazy::Tensor<double>(lazy::relu(lazy::linear(x, w1))), w2).to_vector();
  spmd::mark_sharding(w1, mesh, {"model", std::nullopt});  // columns of the hidden layer
  spmd::mark_sharding(w2, mesh, {std::nullopt, "model"});  // rows of the second product
  spmd::mark_sharding(x, mesh, {});
  const auto reduces = counter("SpmdAllReduces"), transfers = counter("SpmdTransfers");
  auto y = lazy::linear(lazy::Tensor<double>(lazy::relu(lazy::linear(x, w1))), w2);
  EXPECT_EQ(counter("SpmdAllReduces"), reduces + 1);
  EXPECT_EQ(counter("SpmdTransfers"), transfers);
  expect_close_rel(y.to_vector(), want, "megatron");
}

TEST(SpmdShapeOps, ViewsTransposesAndPermutesKeepTheBlocks) {
  for (const auto& mesh : unnamed_meshes()) {
    for (const auto& spec : specs_2d(mesh)) {
      auto x = random_tensor({8, 12}, 31);
      auto ref = x.detach();
      spmd::mark_sharding(x, mesh, spec);
      lazy::Tensor<double> got[] = {lazy::reshape(x, {8, 3, 4}), lazy::reshape(x, {96}), lazy::transpose(x, 0, 1),
                                    lazy::permute(lazy::reshape(x, {2, 4, 12}), {2, 0, 1}),
                                    lazy::reshape(x, {2, 4, 12})};
      lazy::Tensor<double> want[] = {lazy::reshape(ref, {8, 3, 4}), lazy::reshape(ref, {96}), lazy::transpose(ref, 0, 1),
                                     lazy::permute(lazy::reshape(ref, {2, 4, 12}), {2, 0, 1}),
                                     lazy::reshape(ref, {2, 4, 12})};
      lazy::mark_step();
      for (std::size_t i = 0; i < std::size(got); ++i) EXPECT_EQ(got[i].to_vector(), want[i].to_vector()) << i;
      // Row blocks stay blocks through reshapes that keep dimension 0's offsets, and move
      // with the dimension a transpose moves.
      if (spec.size() == 1 && mesh.rank() == 1) {
        EXPECT_EQ(spmd::sharding_spec(got[0]), "{devices=[4,1,1]0,1,2,3}");
        EXPECT_EQ(spmd::sharding_spec(got[1]), "{devices=[4]0,1,2,3}");
        EXPECT_EQ(spmd::sharding_spec(got[2]), "{devices=[1,4]0,1,2,3}");
      }
    }
  }
}

TEST(SpmdShapeOps, SlicesIndexSelectsAndCatsKeepTheBlocksOfTheOtherDimensions) {
  const auto rows = lazy::from_vector<std::int64_t>({7, 0, 5, 5});
  const auto cols = lazy::from_vector<std::int64_t>({11, 0, 5, 5, 3, 7});
  for (const auto& mesh : unnamed_meshes()) {
    for (const auto& spec : specs_2d(mesh)) {
      auto x = random_tensor({8, 12}, 37);
      auto ref = x.detach().requires_grad_();
      spmd::mark_sharding(x, mesh, spec);
      x.requires_grad_();
      const std::string where = name(mesh, x);
      const auto gathers = counter("SpmdGathers");
      // Along dimension 1 (columns): blocks of dimension 0 stay.
      const lazy::Tensor<double> x2 = x * 2.0, ref2 = ref * 2.0;
      lazy::Tensor<double> by_cols[] = {lazy::slice(x, 1, 2, 11, 3), lazy::narrow(x, 1, 4, 6), lazy::index_select(x, 1, cols),
                                        lazy::cat({x, x2}, 1), lazy::stack({x2, x}, 1)};
      lazy::Tensor<double> want_cols[] = {lazy::slice(ref, 1, 2, 11, 3), lazy::narrow(ref, 1, 4, 6),
                                          lazy::index_select(ref, 1, cols), lazy::cat({ref, ref2}, 1),
                                          lazy::stack({ref2, ref}, 1)};
      const bool cols_whole = spmd::local_shards(x)[0].data.size(1) == 12;
      if (cols_whole) {
        EXPECT_EQ(counter("SpmdGathers"), gathers) << where << ": a copy along an unsplit dimension gathers nothing";
        for (std::size_t i = 0; i < 4; ++i) EXPECT_EQ(spmd::sharding_spec(by_cols[i]), spmd::sharding_spec(x)) << where;
        EXPECT_EQ(spmd::local_shards(by_cols[4])[0].data.size(0), spmd::local_shards(x)[0].data.size(0)) << where;
      }
      // Along dimension 0 (rows).
      lazy::Tensor<double> by_rows[] = {lazy::slice(x, 0, 1, 8, 2), lazy::index_select(x, 0, rows), lazy::cat({x, x2}, 0)};
      lazy::Tensor<double> want_rows[] = {lazy::slice(ref, 0, 1, 8, 2), lazy::index_select(ref, 0, rows),
                                          lazy::cat({ref, ref2}, 0)};
      lazy::mark_step();
      for (std::size_t i = 0; i < std::size(by_cols); ++i)
        EXPECT_EQ(by_cols[i].to_vector(), want_cols[i].to_vector()) << where << " column copy " << i;
      for (std::size_t i = 0; i < std::size(by_rows); ++i)
        EXPECT_EQ(by_rows[i].to_vector(), want_rows[i].to_vector()) << where << " row copy " << i;
      // Backward through every copy: the weights make each element's gradient distinct.
      auto w = random_tensor({8, 3}, 38), v = random_tensor({4, 12}, 39);
      auto loss = [&](const lazy::Tensor<double>* c, const lazy::Tensor<double>* r) {
        return lazy::Tensor<double>(lazy::sum(c[0] * w) + lazy::sum(c[1]) * 0.5 + lazy::sum(lazy::square(c[2])) +
                                    lazy::sum(lazy::square(c[3])) * 0.25 + lazy::sum(lazy::square(c[4])) * 0.125 +
                                    lazy::sum(r[0]) + lazy::sum(r[1] * v) + lazy::sum(lazy::square(r[2])));
      };
      loss(by_cols, by_rows).backward();
      loss(want_cols, want_rows).backward();
      lazy::mark_step();
      expect_close_rel(x.grad().to_vector(), ref.grad().to_vector(), where + " grad");
    }
  }
}

TEST(SpmdShapeOps, BackwardOfColumnCopiesKeepsTheRowBlocks) {
  // slice_backward, index_add and scatter_add (the adjoints of slice, index_select and
  // gather along the columns) run on the rows' blocks: no gather, the gradient keeps x's
  // sharding, and no sum is split (duplicates of an index add up within a row): bitwise.
  const auto cols = lazy::from_vector<std::int64_t>({11, 0, 5, 5, 3, 7});
  std::vector<std::int64_t> picks(8 * 3);
  for (std::size_t i = 0; i < picks.size(); ++i) picks[i] = static_cast<std::int64_t>((i * 5 + 3) % 12);
  const auto index = lazy::from_vector<std::int64_t>(picks, {8, 3});
  for (const auto& mesh : unnamed_meshes()) {
    std::vector<spmd::PartitionSpec> specs = {{0}};
    if (mesh.rank() == 2) specs.push_back({{0, 1}});
    for (const auto& spec : specs) {
      auto x = random_tensor({8, 12}, 40);
      auto ref = x.detach().requires_grad_();
      auto loss = [&](const lazy::Tensor<double>& t) {
        return lazy::Tensor<double>(lazy::sum(lazy::square(lazy::slice(t, 1, 2, 11, 3))) +
                                    lazy::sum(lazy::square(lazy::index_select(t, 1, cols))) * 0.5 +
                                    lazy::sum(lazy::square(lazy::gather(t, 1, index))) * 0.25);
      };
      loss(ref).backward();
      lazy::mark_step();
      spmd::mark_sharding(x, mesh, spec);
      auto idx = index.detach();
      spmd::mark_sharding(idx, mesh, spec);
      x.requires_grad_();
      const auto gathers = counter("SpmdGathers");
      auto l = lazy::Tensor<double>(lazy::sum(lazy::square(lazy::slice(x, 1, 2, 11, 3))) +
                                    lazy::sum(lazy::square(lazy::index_select(x, 1, cols))) * 0.5 +
                                    lazy::sum(lazy::square(lazy::gather(x, 1, idx))) * 0.25);
      l.backward();
      lazy::mark_step();
      const std::string where = name(mesh, x);
      EXPECT_EQ(counter("SpmdGathers"), gathers) << where;
      EXPECT_EQ(spmd::sharding_spec(x.grad()), spmd::sharding_spec(x)) << where;
      EXPECT_EQ(x.grad().to_vector(), ref.grad().to_vector()) << where;
    }
  }
}

TEST(SpmdLoss, CrossEntropyForwardAndBackwardOnShardedBatches) {
  for (const auto& mesh : unnamed_meshes()) {
    auto logits = random_tensor({8, 10}, 32);
    std::vector<std::int64_t> labels = {3, 1, 4, 1, 5, 9, 2, 6};
    auto target = lazy::from_vector<std::int64_t>(labels, {8});
    auto ref = logits.detach().requires_grad_();
    auto ref_loss = lazy::nn::functional::cross_entropy(ref, target);
    ref_loss.backward();
    spmd::mark_sharding(logits, mesh, {0});
    spmd::mark_sharding(target, mesh, {0});
    logits.requires_grad_();
    auto loss = lazy::nn::functional::cross_entropy(logits, target);
    loss.backward();
    lazy::mark_step();
    expect_close_rel(loss.to_vector(), ref_loss.to_vector(), mesh.str() + " loss");
    expect_close_rel(logits.grad().to_vector(), ref.grad().to_vector(), mesh.str() + " grad");
    EXPECT_EQ(spmd::sharding_spec(logits.grad()), spmd::sharding_spec(logits));
    auto sm = lazy::softmax(logits.detach(), 1);
    EXPECT_EQ(sm.to_vector(), lazy::softmax(ref.detach(), 1).to_vector());
  }
}

TEST(SpmdReduction, IntegerAndBoolReductionsCombineExactly) {
  spmd::Mesh mesh({0, 1, 2, 3}, {2, 2}, {"x", "y"});
  std::vector<std::int32_t> v(64);
  for (int i = 0; i < 64; ++i) v[static_cast<std::size_t>(i)] = (i * 37) % 101 - 50;
  auto t = lazy::from_vector<std::int32_t>(v, {8, 8});
  const auto want_sum = lazy::sum(t, {1}).to_vector();
  const auto want_max = lazy::amax(t, {0}).to_vector();
  spmd::mark_sharding(t, mesh, {"x", "y"});
  EXPECT_EQ(lazy::sum(t, {1}).to_vector(), want_sum);  // int64 partial sums, all-reduced
  EXPECT_EQ(lazy::amax(t, {0}).to_vector(), want_max);
}

TEST(SpmdMatmul, Bf16ProductWithASplitDepthRoundsTheSumOnce) {
  // Under autocast the product rounds its operands and its result to bfloat16; with k split
  // over the devices each partial stays unrounded and the all-reduced sum is rounded once,
  // so the result equals the unsharded rule (one bfloat16 step of a double reference over
  // the rounded operands) and holds bfloat16 values.
  const int m = 8, k = 12, n = 16;
  auto round = [](double v) { return static_cast<double>(static_cast<float>(lazy::bfloat16(static_cast<float>(v)))); };
  std::vector<float> av, bv;
  for (double v : random_tensor({m, k}, 31).to_vector()) av.push_back(static_cast<float>(v));
  for (double v : random_tensor({k, n}, 32).to_vector()) bv.push_back(static_cast<float>(v));
  for (const auto& mesh : unnamed_meshes()) {
    auto a = lazy::from_vector<float>(av, lazy::Shape{m, k}), b = lazy::from_vector<float>(bv, lazy::Shape{k, n});
    spmd::mark_sharding(a, mesh, {std::nullopt, 0});
    spmd::mark_sharding(b, mesh, {0});
    lazy::AutocastGuard bf16;
    const auto got = lazy::matmul(a, b).to_vector();
    for (int i = 0; i < m; ++i)
      for (int j = 0; j < n; ++j) {
        double s = 0;
        for (int q = 0; q < k; ++q) s += round(av[std::size_t(i * k + q)]) * round(bv[std::size_t(q * n + j)]);
        const float g = got[std::size_t(i * n + j)];
        EXPECT_EQ(static_cast<float>(lazy::bfloat16(g)), g) << mesh.str() << " (" << i << ", " << j << ") not bfloat16";
        EXPECT_NEAR(g, round(s), std::abs(round(s)) * 0x1p-7 + 1e-6) << mesh.str() << " (" << i << ", " << j << ")";
      }
  }
}
