// Convolutions, pooling, batched products and argmax on batch-sharded tensors (a
// data-parallel CNN): each runs on its devices' blocks without gathering, the convolution's
// weight gradient as partial sums over the images, all-reduced; results equal the
// unsharded computation in double (bitwise where no sum is split, else <= 1e-12
// relative), forward and backward, on every 4-device mesh shape.

#include <gtest/gtest.h>

#include <cmath>

#include <lazytensor/lazytensor.hpp>

#include "testing/spmd.hpp"

namespace spmd = lazy::spmd;

namespace {

using lazy_tests::counter_value;
using lazy_tests::expect_close_rel;
using lazy_tests::random_tensor;

// Batch specs of a mesh: the batch over each axis, and over both of a 2-D mesh.
std::vector<spmd::PartitionSpec> batch_specs(const spmd::Mesh& m) {
  if (m.rank() == 1) return {{"x"}};
  return {{"x"}, {"y"}, {{"x", "y"}}};
}

// A small CNN's loss: conv (padded), relu, max pool, conv (1x1), avg pool, sum of squares.
lazy::Tensor<double> cnn_loss(const lazy::Tensor<double>& x, const lazy::Tensor<double>& w1,
                              const lazy::Tensor<double>& b1, const lazy::Tensor<double>& w2) {
  lazy::Tensor<double> h = lazy::relu(lazy::conv2d(x, w1, b1, 1, 1));
  h = lazy::max_pool2d(h, 2);
  h = lazy::conv2d(h, w2);
  h = lazy::avg_pool2d(h, 2);
  return lazy::sum(h * h);
}

}  // namespace

TEST(SpmdConv, DataParallelConvolutionsAndPoolingRunOnBlocksForwardAndBackward) {
  for (const auto& mesh : lazy_tests::named_meshes()) {
    for (const auto& spec : batch_specs(mesh)) {
      auto x = random_tensor({8, 3, 8, 8}, 41);
      auto w1 = random_tensor({5, 3, 3, 3}, 42), b1 = random_tensor({5}, 43), w2 = random_tensor({4, 5, 1, 1}, 44);
      // The reference: unsharded, on fresh leaves.
      auto rx = x.detach().requires_grad_(), rw1 = w1.detach().requires_grad_();
      auto rb1 = b1.detach().requires_grad_(), rw2 = w2.detach().requires_grad_();
      auto ref = cnn_loss(rx, rw1, rb1, rw2);
      ref.backward();
      lazy::mark_step();

      spmd::mark_sharding(x, mesh, spec);
      for (auto* p : {&w1, &b1, &w2}) spmd::mark_sharding(*p, mesh, {});
      for (auto* p : {&x, &w1, &b1, &w2}) p->requires_grad_();
      const auto gathers = counter_value("SpmdGathers"), transfers = counter_value("SpmdTransfers");
      auto loss = cnn_loss(x, w1, b1, w2);
      loss.backward();
      lazy::mark_step();
      const std::string where = mesh.str() + " " + spmd::sharding_spec(x);
      EXPECT_EQ(counter_value("SpmdGathers"), gathers) << where << ": nothing is gathered";
      // At most one transfer: the backward's seed (ones of the loss's input shape, traced
      // unsharded) split for the first sharded product; the convolutions and pools move
      // nothing.
      EXPECT_LE(counter_value("SpmdTransfers"), transfers + 1) << where;
      expect_close_rel(loss.to_vector(), ref.to_vector(), where + " loss");
      // Image by image, nothing is summed across blocks: the input's gradient is bitwise.
      EXPECT_EQ(x.grad().to_vector(), rx.grad().to_vector()) << where;
      EXPECT_EQ(spmd::sharding_spec(x.grad()), spmd::sharding_spec(x)) << where;
      expect_close_rel(w1.grad().to_vector(), rw1.grad().to_vector(), where + " conv1 weight grad");
      expect_close_rel(b1.grad().to_vector(), rb1.grad().to_vector(), where + " conv1 bias grad");
      expect_close_rel(w2.grad().to_vector(), rw2.grad().to_vector(), where + " conv2 weight grad");
    }
  }
}

TEST(SpmdConv, PoolingKeepsImagesAndChannelsSplitAndConvolutionKeepsImagesSplit) {
  spmd::Mesh mesh({0, 1, 2, 3}, {2, 2}, {"data", "model"});
  auto x = random_tensor({4, 2, 7, 7}, 45), w = random_tensor({3, 2, 3, 3}, 46), b = random_tensor({3}, 47);
  lazy::Tensor<double> want = lazy::max_pool2d(lazy::conv2d(x, w, b, 2, 1), 2, 1);
  lazy::Tensor<double> want_avg = lazy::avg_pool2d(x, 3, 2, 1);
  auto images = x.detach();
  spmd::mark_sharding(x, mesh, {"data", "model"});  // images over data, channels over model
  spmd::mark_sharding(images, mesh, {"data"});
  spmd::mark_sharding(w, mesh, {});
  spmd::mark_sharding(b, mesh, {});
  const auto gathers = counter_value("SpmdGathers");
  lazy::Tensor<double> avg = lazy::avg_pool2d(x, 3, 2, 1);  // plane by plane: both splits stay
  EXPECT_EQ(spmd::sharding_spec(avg), spmd::sharding_spec(x));
  lazy::Tensor<double> y = lazy::max_pool2d(lazy::conv2d(images, w, b, 2, 1), 2, 1);
  EXPECT_EQ(spmd::sharding_spec(y), spmd::sharding_spec(images));
  EXPECT_EQ(counter_value("SpmdGathers"), gathers);
  EXPECT_EQ(avg.to_vector(), want_avg.to_vector());
  EXPECT_EQ(y.to_vector(), want.to_vector());  // image by image: bitwise
}

TEST(SpmdBmm, BatchedProductsSplitAlongTheBatchAndTheirRowsAndColumns) {
  for (const auto& mesh : lazy_tests::named_meshes()) {
    auto a = random_tensor({8, 6, 5}, 48), b = random_tensor({8, 5, 4}, 49), w = random_tensor({5, 4}, 50);
    const auto want = lazy::matmul(a, b).to_vector();
    const auto want_w = lazy::matmul(a, w).to_vector();
    auto ra = a.detach().requires_grad_(), rb = b.detach().requires_grad_();
    auto rc = lazy::matmul(ra, rb);
    lazy::sum(rc * rc).backward();
    spmd::mark_sharding(a, mesh, {"x"});
    spmd::mark_sharding(b, mesh, {"x"});
    spmd::mark_sharding(w, mesh, {});
    a.requires_grad_();
    b.requires_grad_();
    const auto gathers = counter_value("SpmdGathers"), reduces = counter_value("SpmdAllReduces");
    auto c = lazy::matmul(a, b);
    auto cw = lazy::matmul(a, w);  // a shared right operand: the batch folds into its rows
    EXPECT_EQ(counter_value("SpmdAllReduces"), reduces) << mesh.str() << ": a batch split sums nothing";
    lazy::sum(c * c).backward();
    lazy::mark_step();
    EXPECT_EQ(counter_value("SpmdGathers"), gathers) << mesh.str();
    EXPECT_EQ(spmd::sharding_spec(c), spmd::sharding_spec(a)) << mesh.str();
    EXPECT_EQ(spmd::sharding_spec(cw), spmd::sharding_spec(a)) << mesh.str();
    EXPECT_EQ(c.to_vector(), want) << mesh.str();
    EXPECT_EQ(cw.to_vector(), want_w) << mesh.str();
    expect_close_rel(a.grad().to_vector(), ra.grad().to_vector(), mesh.str() + " grad a");
    expect_close_rel(b.grad().to_vector(), rb.grad().to_vector(), mesh.str() + " grad b");
    EXPECT_EQ(spmd::sharding_spec(a.grad()), spmd::sharding_spec(a)) << mesh.str();
  }
  // A transposed batch times a shared matrix: the batch folds into the rows of one product,
  // so the transposed pieces are copied, not read through as one matrix.
  for (const auto& mesh : lazy_tests::named_meshes()) {
    auto h = random_tensor({8, 5, 6}, 56), w = random_tensor({5, 4}, 57);
    const auto want = lazy::matmul(lazy::transpose(h, 1, 2), w).to_vector();
    spmd::mark_sharding(h, mesh, {"x"});
    spmd::mark_sharding(w, mesh, {});
    auto y = lazy::matmul(lazy::transpose(h, 1, 2), w);
    EXPECT_EQ(spmd::sharding_spec(y), spmd::sharding_spec(h)) << mesh.str();
    EXPECT_EQ(y.to_vector(), want) << mesh.str() << ": folded product of a transposed batch";
  }
  // Rows of each matrix over one axis, the batch over the other; and a split depth.
  spmd::Mesh mesh({0, 1, 2, 3}, {2, 2}, {"x", "y"});
  auto a = random_tensor({4, 6, 8}, 51), b = random_tensor({4, 8, 6}, 52);
  const auto want = lazy::matmul(a, b).to_vector();
  spmd::mark_sharding(a, mesh, {"x", "y"});
  spmd::mark_sharding(b, mesh, {"x"});
  auto rows = lazy::matmul(a, b);
  EXPECT_EQ(spmd::sharding_spec(rows), spmd::sharding_spec(a));
  expect_close_rel(rows.to_vector(), want, "batch and rows split");  // Eigen's small products: sums per call shape
  auto a2 = random_tensor({4, 6, 8}, 53), b2 = random_tensor({4, 8, 6}, 54);
  const auto want2 = lazy::matmul(a2, b2).to_vector();
  spmd::mark_sharding(a2, mesh, {"x", std::nullopt, "y"});
  spmd::mark_sharding(b2, mesh, {"x", "y"});
  const auto reduces = counter_value("SpmdAllReduces");
  auto depth = lazy::matmul(a2, b2);
  EXPECT_EQ(counter_value("SpmdAllReduces"), reduces + 2) << "one all-reduce per batch block";
  expect_close_rel(depth.to_vector(), want2, "split depth");
}

TEST(SpmdArgmax, ArgmaxOverASplitDimensionGathersAndStaysRight) {
  spmd::Mesh mesh({0, 1, 2, 3}, {2, 2}, {"x", "y"});
  auto logits = random_tensor({8, 10}, 58);
  const auto want = lazy::argmax(logits, 1).to_vector();
  const auto want_rows = lazy::argmax(logits, 0).to_vector();
  spmd::mark_sharding(logits, mesh, {"x", "y"});  // the reduced dimension split: blocks do not combine
  EXPECT_EQ(lazy::argmax(logits, 1).to_vector(), want);
  EXPECT_EQ(lazy::argmax(logits, 0).to_vector(), want_rows);
  auto one = random_tensor({8, 10}, 59);
  const auto want_one = lazy::argmax(one, 1).to_vector();
  spmd::Mesh thin({0, 1, 2, 3}, {4, 1}, {"x", "y"});
  spmd::mark_sharding(one, thin, {"x", "y"});  // over an axis of size 1: whole rows after all
  const auto gathers = counter_value("SpmdGathers");
  auto idx = lazy::argmax(one, 1);
  EXPECT_EQ(counter_value("SpmdGathers"), gathers);
  EXPECT_EQ(idx.to_vector(), want_one);
}

TEST(SpmdArgmax, ArgmaxOverAnUnsplitDimensionStaysOnTheBlocks) {
  for (const auto& mesh : lazy_tests::named_meshes()) {
    auto logits = random_tensor({8, 10}, 55);
    const auto want = lazy::argmax(logits, 1).to_vector();
    const auto want_min = lazy::argmin(logits * 2.0, 1, true).to_vector();
    spmd::mark_sharding(logits, mesh, {"x"});
    const auto gathers = counter_value("SpmdGathers");
    auto idx = lazy::argmax(logits, 1);
    auto idx_min = lazy::argmin(logits * 2.0, 1, true);
    EXPECT_EQ(counter_value("SpmdGathers"), gathers) << mesh.str();
    EXPECT_EQ(idx.to_vector(), want) << mesh.str();
    EXPECT_EQ(idx_min.to_vector(), want_min) << mesh.str();
    EXPECT_EQ(spmd::sharding_spec(idx), spmd::sharding_spec(lazy::amax(logits.detach(), {1}))) << mesh.str();
  }
}
