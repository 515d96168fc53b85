// expr/layout.hpp: RowCursor, the odometer every expression's row loop (eval_rows) shares.
// Its offsets at each row, started at any row and advanced with next(), are checked
// against NumPy's broadcasting rule applied to the uncollapsed shapes: unravel the row's
// first output element, then index each input with its own contiguous strides.
#include <cstddef>
#include <cstdint>
#include <vector>

#include <gtest/gtest.h>

#include <lazytensor/lazytensor.hpp>

namespace {

using lazy::Shape;

// Element offset in input `in` of the output element at flat index `flat` of `out`.
std::int64_t broadcast_offset_reference(const Shape& out, const Shape& in, std::int64_t flat) {
  std::vector<std::int64_t> idx(static_cast<std::size_t>(out.rank()));
  for (int d = out.rank() - 1; d >= 0; --d) {
    idx[static_cast<std::size_t>(d)] = flat % out[d];
    flat /= out[d];
  }
  std::int64_t offset = 0, stride = 1;
  for (int d = in.rank() - 1; d >= 0; --d) {
    const int od = d + out.rank() - in.rank();
    if (in[d] != 1) offset += idx[static_cast<std::size_t>(od)] * stride;
    stride *= in[d];
  }
  return offset;
}

void check_row_cursor(const Shape& out, const std::vector<Shape>& inputs) {
  std::vector<const Shape*> ptrs;
  for (const auto& s : inputs) ptrs.push_back(&s);
  const lazy::expr::Layout L = lazy::expr::make_layout(out, ptrs);
  ASSERT_GT(L.ndim, 1) << out.str() << ": the layout collapsed to one dimension, no rows to walk";
  const std::int64_t inner = L.inner();
  ASSERT_EQ(out.numel() % inner, 0);
  const std::int64_t rows = out.numel() / inner;
  for (std::int64_t r0 = 0; r0 < rows; ++r0) {
    lazy::expr::RowCursor cursor(L, r0);
    for (std::int64_t r = r0; r < rows; ++r, cursor.next()) {
      for (std::size_t k = 0; k < inputs.size(); ++k) {
        ASSERT_EQ(cursor.offsets()[k], broadcast_offset_reference(out, inputs[k], r * inner))
            << "out " << out.str() << ", input " << k << " " << inputs[k].str() << ", start row "
            << r0 << ", row " << r;
      }
    }
    // One step past the last row wraps to row 0 (what eval_rows' last step leaves).
    for (std::size_t k = 0; k < inputs.size(); ++k)
      ASSERT_EQ(cursor.offsets()[k], 0) << out.str() << ", input " << k << ", from row " << r0;
  }
}

TEST(RowCursor, OffsetsFollowBroadcastingFromEveryStartRow) {
  check_row_cursor(Shape{4, 5, 6}, {Shape{4, 5, 6}, Shape{5, 1}, Shape{6}});
  check_row_cursor(Shape{3, 1, 4, 7}, {Shape{3, 1, 4, 7}, Shape{1, 1, 4, 1}, Shape{1}});
  check_row_cursor(Shape{2, 3, 4, 5}, {Shape{2, 1, 4, 1}, Shape{3, 1, 5}, Shape{2, 3, 4, 5}});
  check_row_cursor(Shape{5, 2, 3}, {Shape{5, 1, 1}, Shape{1, 2, 3}});
}

TEST(RowCursor, MoreInputsThanTheInlineCapacity) {
  // Nine inputs: the cursor's offsets leave their inline storage of eight.
  check_row_cursor(Shape{3, 4, 5}, {Shape{3, 4, 5}, Shape{4, 1}, Shape{5}, Shape{3, 1, 1},
                                    Shape{1, 4, 5}, Shape{3, 1, 5}, Shape{1}, Shape{4, 5},
                                    Shape{3, 4, 1}});
}

}  // namespace
