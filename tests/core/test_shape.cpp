// core/shape.hpp: Shape construction and limits, NumPy broadcasting, normalize_dim.
#include <lazytensor/core/shape.hpp>

#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

namespace {

using lazy::Shape;
using lazy::ShapeError;

// Independent broadcast reference: right-align, each pair equal or one of them 1.
bool ref_broadcast(const std::vector<std::int64_t>& a, const std::vector<std::int64_t>& b,
                   std::vector<std::int64_t>& out) {
  const std::size_t r = std::max(a.size(), b.size());
  out.assign(r, 0);
  for (std::size_t k = 0; k < r; ++k) {  // k counts from the back
    const std::int64_t da = k < a.size() ? a[a.size() - 1 - k] : 1;
    const std::int64_t db = k < b.size() ? b[b.size() - 1 - k] : 1;
    if (da == db) out[r - 1 - k] = da;
    else if (da == 1) out[r - 1 - k] = db;
    else if (db == 1) out[r - 1 - k] = da;
    else return false;
  }
  return true;
}

TEST(Shape, BasicsAndPrinting) {
  Shape s0;
  EXPECT_EQ(s0.rank(), 0);
  EXPECT_EQ(s0.numel(), 1);
  EXPECT_EQ(s0.str(), "()");
  Shape s1{5};
  EXPECT_EQ(s1.rank(), 1);
  EXPECT_EQ(s1.str(), "(5,)");
  Shape s3{2, 3, 4};
  EXPECT_EQ(s3.numel(), 24);
  EXPECT_EQ(s3.str(), "(2, 3, 4)");
  EXPECT_EQ(s3.size(-1), 4);
  EXPECT_EQ(s3.size(0), 2);
  EXPECT_EQ(s3.size(-3), 2);
  EXPECT_EQ(s3.vec(), (std::vector<std::int64_t>{2, 3, 4}));
  EXPECT_EQ((Shape{3, 0, 2}).numel(), 0);
  EXPECT_TRUE((Shape{2, 3}) == (Shape{2, 3}));
  EXPECT_FALSE((Shape{2, 3}) == (Shape{3, 2}));
  EXPECT_FALSE((Shape{2, 3}) == (Shape{2, 3, 1}));
  EXPECT_FALSE(Shape{} == (Shape{1}));
  const std::vector<std::int64_t> v{7, 1, 9};
  EXPECT_EQ(Shape(v).str(), "(7, 1, 9)");
  EXPECT_EQ(Shape(std::span<const std::int64_t>(v)).numel(), 63);
}

TEST(Shape, ContiguousStrides) {
  const auto st = lazy::contiguous_strides(Shape{2, 3, 4});
  EXPECT_EQ(st[0], 12);
  EXPECT_EQ(st[1], 4);
  EXPECT_EQ(st[2], 1);
  const auto st1 = lazy::contiguous_strides(Shape{5});
  EXPECT_EQ(st1[0], 1);
}

TEST(Shape, RankAboveEightRejected) {
  EXPECT_NO_THROW((Shape{1, 2, 1, 2, 1, 2, 1, 2}));
  EXPECT_THROW((Shape{1, 2, 1, 2, 1, 2, 1, 2, 1}), ShapeError);
  EXPECT_THROW(Shape(std::vector<std::int64_t>(9, 1)), ShapeError);
  EXPECT_THROW(Shape(std::vector<std::int64_t>(100, 1)), ShapeError);
  Shape s{1, 1, 1, 1, 1, 1, 1};
  EXPECT_NO_THROW(s.push_back(3));
  EXPECT_EQ(s.rank(), 8);
  EXPECT_THROW(s.push_back(3), ShapeError);
  EXPECT_EQ(s.rank(), 8);
  try {
    Shape(std::vector<std::int64_t>(9, 2));
    FAIL() << "no exception";
  } catch (const ShapeError& e) {
    EXPECT_NE(std::string(e.what()).find('8'), std::string::npos) << e.what();
  }
}

TEST(Shape, NegativeDimensionsRejected) {
  EXPECT_THROW((Shape{2, -1}), ShapeError);
  EXPECT_THROW((Shape{-3}), ShapeError);
  EXPECT_THROW(Shape(std::vector<std::int64_t>{4, 5, -2}), ShapeError);
  EXPECT_NO_THROW((Shape{0, 0}));
  try {
    Shape{2, -7};
    FAIL() << "no exception";
  } catch (const ShapeError& e) {
    EXPECT_NE(std::string(e.what()).find("-7"), std::string::npos) << e.what();
  }
}

// Every shape keeps the product of its non-zero sizes at or below 2^60 (kMaxElements), so no
// element count, stride or byte size computed from it can overflow int64.
TEST(Shape, ElementCountLimit) {
  constexpr std::int64_t k60 = std::int64_t{1} << 60;
  EXPECT_EQ(lazy::kMaxElements, k60);
  EXPECT_EQ(Shape({k60}).numel(), k60);                              // at the limit
  EXPECT_EQ(Shape({std::int64_t{1} << 30, std::int64_t{1} << 30}).numel(), k60);
  EXPECT_EQ(Shape({k60, 0}).numel(), 0);                             // zero-sized at the limit
  EXPECT_EQ(Shape({0, k60, 1}).numel(), 0);
  // One past it, however the sizes are arranged, and products that overflow int64 itself.
  const std::vector<std::vector<std::int64_t>> too_large = {
      {k60 + 1},
      {k60, 2},
      {2, k60},
      {std::int64_t{1} << 62, 2, 0},  // the zero comes after the overflow
      {0, INT64_MAX, INT64_MAX},      // ... or before it
      {std::int64_t{1} << 31, std::int64_t{1} << 31, 0, 2},
      {3, 5, 7, 11, 13, 17, 19, 23 * std::int64_t{1} << 45},
  };
  for (const auto& dims : too_large) {
    try {
      Shape s(dims);
      ADD_FAILURE() << "accepted " << s.str();
    } catch (const ShapeError& e) {
      EXPECT_NE(std::string(e.what()).find("2^60"), std::string::npos) << e.what();
    }
  }
  // push_back checks as the constructors do.
  Shape grown{std::int64_t{1} << 40, 0};
  EXPECT_THROW(grown.push_back(std::int64_t{1} << 21), ShapeError);
  Shape neg{2};
  EXPECT_THROW(neg.push_back(-1), ShapeError);
  // A broadcast of two valid shapes can exceed it.
  EXPECT_THROW(lazy::broadcast_shapes(Shape({std::int64_t{1} << 40, 1}), Shape({1, std::int64_t{1} << 40}), "add"),
               ShapeError);
  EXPECT_EQ(lazy::broadcast_shapes(Shape({std::int64_t{1} << 30, 1}), Shape({1, std::int64_t{1} << 30}), "add"),
            Shape({std::int64_t{1} << 30, std::int64_t{1} << 30}));
}

TEST(Shape, NormalizeDimRanges) {
  for (int rank = 1; rank <= 8; ++rank) {
    for (int d = -rank; d < rank; ++d) {
      EXPECT_EQ(lazy::normalize_dim(d, rank, "op"), d < 0 ? d + rank : d) << "rank " << rank << " dim " << d;
    }
    EXPECT_THROW(lazy::normalize_dim(rank, rank, "op"), ShapeError);
    EXPECT_THROW(lazy::normalize_dim(-rank - 1, rank, "op"), ShapeError);
  }
  // Rank 0 accepts -1 and 0, as PyTorch does.
  EXPECT_EQ(lazy::normalize_dim(0, 0, "op"), 0);
  EXPECT_EQ(lazy::normalize_dim(-1, 0, "op"), 0);
  EXPECT_THROW(lazy::normalize_dim(1, 0, "op"), ShapeError);
  EXPECT_THROW(lazy::normalize_dim(-2, 0, "op"), ShapeError);
  // Large values must not wrap around through the int conversion.
  EXPECT_THROW(lazy::normalize_dim(std::int64_t(1) << 32, 2, "op"), ShapeError);
  EXPECT_THROW(lazy::normalize_dim(-(std::int64_t(1) << 32), 2, "op"), ShapeError);
  // The message names the op, the valid range and the value.
  try {
    lazy::normalize_dim(5, 3, "my_softmax");
    FAIL() << "no exception";
  } catch (const ShapeError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("my_softmax"), std::string::npos) << m;
    EXPECT_NE(m.find("[-3, 2]"), std::string::npos) << m;
    EXPECT_NE(m.find('5'), std::string::npos) << m;
  }
  EXPECT_THROW((Shape{2, 3}).size(2), ShapeError);
  EXPECT_THROW((Shape{2, 3}).size(-3), ShapeError);
}

TEST(Shape, BroadcastRules) {
  struct Case {
    std::vector<std::int64_t> a, b;
  };
  const std::vector<Case> cases = {
      {{}, {}},
      {{}, {3}},
      {{3}, {}},
      {{2, 3}, {2, 3}},
      {{2, 3}, {3}},
      {{2, 3}, {1, 3}},
      {{2, 3}, {2, 1}},
      {{2, 1}, {1, 3}},
      {{4, 1, 5}, {4, 3, 5}},
      {{4, 1, 5}, {3, 1}},
      {{1}, {7}},
      {{0}, {1}},
      {{0}, {0}},
      {{3, 1}, {1, 0}},
      {{2, 0, 4}, {4}},
      {{1, 1, 1, 1, 1, 1, 1, 6}, {5, 1}},
      {{8, 1, 6, 1}, {7, 1, 5}},
      {{2, 3}, {4}},
      {{2, 3}, {3, 2}},
      {{0}, {2}},
      {{4, 3, 5}, {2, 5}},
      {{3}, {4}},
  };
  for (const auto& c : cases) {
    std::vector<std::int64_t> want;
    const bool ok = ref_broadcast(c.a, c.b, want);
    const Shape a(c.a), b(c.b);
    if (ok) {
      EXPECT_EQ(lazy::broadcast_shapes(a, b, "add"), Shape(want)) << a.str() << " vs " << b.str();
      EXPECT_EQ(lazy::broadcast_shapes(b, a, "add"), Shape(want)) << b.str() << " vs " << a.str();
      EXPECT_TRUE(lazy::broadcastable_to(a, Shape(want)));
      EXPECT_TRUE(lazy::broadcastable_to(b, Shape(want)));
    } else {
      EXPECT_THROW(lazy::broadcast_shapes(a, b, "add"), ShapeError) << a.str() << " vs " << b.str();
      EXPECT_THROW(lazy::broadcast_shapes(b, a, "add"), ShapeError) << b.str() << " vs " << a.str();
    }
  }
}

TEST(Shape, BroadcastErrorNamesBothShapesAndOp) {
  try {
    lazy::broadcast_shapes(Shape{2, 3}, Shape{4}, "maximum");
    FAIL() << "no exception";
  } catch (const ShapeError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("maximum"), std::string::npos) << m;
    EXPECT_NE(m.find("(2, 3)"), std::string::npos) << m;
    EXPECT_NE(m.find("(4,)"), std::string::npos) << m;
  }
  try {
    lazy::broadcast_shapes(Shape{5, 1, 7}, Shape{6, 8}, "where");
    FAIL() << "no exception";
  } catch (const ShapeError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("where"), std::string::npos) << m;
    EXPECT_NE(m.find("(5, 1, 7)"), std::string::npos) << m;
    EXPECT_NE(m.find("(6, 8)"), std::string::npos) << m;
  }
  // ShapeError is a lazy::Error.
  EXPECT_THROW(lazy::broadcast_shapes(Shape{2}, Shape{3}, "sub"), lazy::Error);
}

TEST(Shape, BroadcastableTo) {
  EXPECT_TRUE(lazy::broadcastable_to(Shape{}, Shape{2, 3}));
  EXPECT_TRUE(lazy::broadcastable_to(Shape{3}, Shape{2, 3}));
  EXPECT_TRUE(lazy::broadcastable_to(Shape{2, 1}, Shape{2, 3}));
  EXPECT_TRUE(lazy::broadcastable_to(Shape{2, 3}, Shape{2, 3}));
  EXPECT_FALSE(lazy::broadcastable_to(Shape{2, 3}, Shape{3}));  // would need to shrink
  EXPECT_FALSE(lazy::broadcastable_to(Shape{1, 3}, Shape{3}));  // rank may not shrink
  EXPECT_FALSE(lazy::broadcastable_to(Shape{2, 3}, Shape{2, 1}));
  EXPECT_FALSE(lazy::broadcastable_to(Shape{4}, Shape{2, 3}));
  EXPECT_TRUE(lazy::broadcastable_to(Shape{1}, Shape{0}));
  EXPECT_FALSE(lazy::broadcastable_to(Shape{2}, Shape{0}));
}

}  // namespace
