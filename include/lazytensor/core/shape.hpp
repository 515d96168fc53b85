#pragma once
// Shapes (rank 0..8, row-major) and NumPy broadcasting.

#include <algorithm>
#include <array>
#include <cstdint>
#include <initializer_list>
#include <span>
#include <string>
#include <vector>

#include <lazytensor/core/error.hpp>
#include <lazytensor/core/config.hpp>

namespace lazy {

/// Maximum tensor rank.
inline constexpr int kMaxRank = 8;

/// The largest product of a shape's non-zero sizes (2^60). Every shape keeps its non-zero
/// sizes' product at or below it, so an element count and any stride fit in int64, and any
/// byte size (elements up to 8 bytes, padded) in std::size_t, however they are multiplied,
/// even for a zero-sized shape whose other sizes are huge.
inline constexpr std::int64_t kMaxElements = std::int64_t{1} << 60;

/// A tensor's dimensions. Value type, fixed capacity, no allocation.
class Shape {
 public:
  Shape() = default;
  /// Builds a shape from its sizes; throws ShapeError on negative sizes, rank > 8, or sizes
  /// whose non-zero product exceeds kMaxElements.
  Shape(std::initializer_list<std::int64_t> dims) { assign(dims.begin(), dims.end()); }
  explicit Shape(std::span<const std::int64_t> dims) { assign(dims.begin(), dims.end()); }
  explicit Shape(const std::vector<std::int64_t>& dims) { assign(dims.begin(), dims.end()); }

  int rank() const { return rank_; }
  std::int64_t operator[](int i) const { return dims_[i]; }
  std::int64_t& operator[](int i) { return dims_[i]; }
  const std::int64_t* begin() const { return dims_.data(); }
  const std::int64_t* end() const { return dims_.data() + rank_; }

  /// Number of elements (1 for rank 0).
  std::int64_t numel() const {
    std::int64_t n = 1;
    for (int i = 0; i < rank_; ++i) n *= dims_[i];
    return n;
  }

  /// Size of dimension d, negative d counting from the back.
  std::int64_t size(std::int64_t d) const;

  std::vector<std::int64_t> vec() const { return {begin(), end()}; }

  /// Appends a dimension (checked as the constructors check).
  void push_back(std::int64_t d) {
    if (rank_ == kMaxRank) throw ShapeError("rank exceeds the maximum of 8");
    if (d < 0) throw ShapeError("negative dimension " + std::to_string(d) + " in shape");
    Shape grown = *this;  // checked before this shape changes: a refused size leaves it intact
    grown.dims_[grown.rank_++] = d;
    grown.check_size();
    *this = grown;
  }

  /// Throws ShapeError when the product of the non-zero sizes exceeds kMaxElements. The
  /// constructors and push_back call it; code that grows a size through operator[] (cat,
  /// index_select) calls it after.
  void check_size() const {
    std::int64_t p = 1;
    for (int i = 0; i < rank_; ++i) {
      if (dims_[i] == 0) continue;
      if (__builtin_mul_overflow(p, dims_[i], &p) || p > kMaxElements) too_large();
    }
  }

  /// "(2, 3)" as PyTorch prints sizes; "()" for a scalar.
  std::string str() const;

  friend bool operator==(const Shape& a, const Shape& b) {
    // A loop, not std::equal: GCC turns that into a call to memcmp, ~30 instructions for
    // the one to four dims of a typical shape, compared several times per statement.
    if (a.rank_ != b.rank_) return false;
    for (int i = 0; i < a.rank_; ++i)
      if (a.dims_[i] != b.dims_[i]) return false;
    return true;
  }

 private:
  template <class It>
  void assign(It first, It last) {
    const auto n = std::distance(first, last);
    if (n > kMaxRank) {
      throw ShapeError("rank " + std::to_string(n) + " exceeds the maximum of 8");
    }
    rank_ = static_cast<int>(n);
    int i = 0;
    for (; first != last; ++first, ++i) {
      if (*first < 0) throw ShapeError("negative dimension " + std::to_string(*first) + " in shape");
      dims_[i] = *first;
    }
    check_size();
  }

  [[noreturn]] void too_large() const;

  std::array<std::int64_t, kMaxRank> dims_{};
  int rank_ = 0;
};

/// Normalizes a possibly negative dimension index for a tensor of the given rank; `op` names
/// the caller in the error. A rank-0 tensor accepts -1 and 0 as PyTorch does.
int normalize_dim(std::int64_t dim, int rank, const char* op);

inline std::int64_t Shape::size(std::int64_t d) const {
  // (normalize_dim lets 0 and -1 name a rank-0 tensor's dimension, as reductions take them;
  // a size has none to give, as torch says.)
  if (rank_ == 0)
    throw ShapeError("size: dimension specified as " + std::to_string(d) +
                     " but tensor has no dimensions");
  return dims_[normalize_dim(d, rank_, "size")];
}

/// Row-major strides of a shape, in elements.
std::array<std::int64_t, kMaxRank> contiguous_strides(const Shape& s);

/// NumPy broadcast of two shapes; throws ShapeError naming both shapes and the op.
Shape broadcast_shapes(const Shape& a, const Shape& b, const char* op);

/// True when `from` broadcasts to `to` (NumPy rules, `to` unchanged).
bool broadcastable_to(const Shape& from, const Shape& to);

}  // namespace lazy

#if LAZYTENSOR_HEADER_DEFINITIONS
namespace lazy {

LAZYTENSOR_INLINE void Shape::too_large() const {
  throw ShapeError("shape " + str() + " has too many elements (the product of its non-zero sizes exceeds 2^60)");
}

LAZYTENSOR_INLINE std::string Shape::str() const {
  std::string s = "(";
  for (int i = 0; i < rank_; ++i) {
    if (i) s += ", ";
    s += std::to_string(dims_[i]);
  }
  if (rank_ == 1) s += ",";
  return s + ")";
}

LAZYTENSOR_INLINE int normalize_dim(std::int64_t dim, int rank, const char* op) {
  const int r = std::max(rank, 1);
  if (dim < -r || dim >= r) {
    throw ShapeError(std::string(op) + ": dimension out of range (expected to be in range of [" +
                     std::to_string(-r) + ", " + std::to_string(r - 1) + "], but got " +
                     std::to_string(dim) + ")");
  }
  return static_cast<int>(dim < 0 ? dim + r : dim);
}

LAZYTENSOR_INLINE std::array<std::int64_t, kMaxRank> contiguous_strides(const Shape& s) {
  std::array<std::int64_t, kMaxRank> st{};
  std::int64_t acc = 1;
  for (int i = s.rank() - 1; i >= 0; --i) {
    st[i] = acc;
    acc *= s[i];
  }
  return st;
}

LAZYTENSOR_INLINE Shape broadcast_shapes(const Shape& a, const Shape& b, const char* op) {
  if (a == b) return a;
  const int r = std::max(a.rank(), b.rank());
  std::array<std::int64_t, kMaxRank> out{};
  for (int i = 0; i < r; ++i) {
    const int ia = i - (r - a.rank()), ib = i - (r - b.rank());
    const std::int64_t da = ia >= 0 ? a[ia] : 1, db = ib >= 0 ? b[ib] : 1;
    if (da != db && da != 1 && db != 1) {
      throw ShapeError(std::string(op) + ": shapes " + a.str() + " and " + b.str() +
                       " are not broadcastable (dimension " + std::to_string(i) + ": " +
                       std::to_string(da) + " vs " + std::to_string(db) + ")");
    }
    out[i] = da == 1 ? db : da;
  }
  return Shape(std::span<const std::int64_t>(out.data(), static_cast<std::size_t>(r)));  // checks the size once
}

LAZYTENSOR_INLINE bool broadcastable_to(const Shape& from, const Shape& to) {
  if (from.rank() > to.rank()) return false;
  const int off = to.rank() - from.rank();
  for (int i = 0; i < from.rank(); ++i) {
    if (from[i] != 1 && from[i] != to[i + off]) return false;
  }
  return true;
}

}  // namespace lazy
#endif  // LAZYTENSOR_HEADER_DEFINITIONS
