#pragma once
// A vector of trivially copyable values that keeps up to N of them inline: per-node data
// with a handful of entries (a kernel's per-input strides) then costs no allocation, which
// matters when a step traces and frees hundreds of small nodes.

#include <algorithm>
#include <cstddef>
#include <memory>
#include <type_traits>

namespace lazy::core {

/// Fixed-capacity-inline vector (see the file comment). Only what its users need: resize,
/// assign, indexing, data, iteration, and stack use (push_back, back, pop_back).
template <class T, std::size_t N>
class SmallVector {
  static_assert(std::is_trivially_copyable_v<T>, "SmallVector holds trivially copyable values");

 public:
  SmallVector() = default;
  SmallVector(const SmallVector& o) { copy_from(o); }
  SmallVector& operator=(const SmallVector& o) {
    if (this != &o) copy_from(o);
    return *this;
  }
  SmallVector(SmallVector&& o) noexcept { move_from(o); }
  SmallVector& operator=(SmallVector&& o) noexcept {
    if (this != &o) move_from(o);
    return *this;
  }
  ~SmallVector() = default;

  /// Sets the size to n; new elements are value-initialized, kept ones keep their values.
  void resize(std::size_t n) {
    reserve(n);
    T* d = data();  // (once: data() tests for the heap)
    for (std::size_t i = size_; i < n; ++i) d[i] = T{};
    size_ = n;
  }
  /// Resizes to n leaving new elements unset, for a caller that writes every one of them
  /// before reading (a kernel's input pointers, its partial results).
  void resize_for_overwrite(std::size_t n) {
    reserve(n);
    size_ = n;
  }
  /// n copies of v.
  void assign(std::size_t n, const T& v) {
    reserve(n);
    std::fill_n(data(), n, v);
    size_ = n;
  }

  /// Appends v (growing the storage geometrically once past the inline capacity).
  void push_back(const T& v) {
    const T copy = v;  // v may be an element of this vector, which growing frees
    if (size_ == capacity()) reserve(std::max<std::size_t>(4, 2 * capacity()));
    data()[size_++] = copy;
  }
  /// The last element (the vector must not be empty).
  T& back() { return data()[size_ - 1]; }
  /// Removes the last element (the vector must not be empty).
  void pop_back() { --size_; }

  std::size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  T* data() { return heap_ ? heap_.get() : inline_; }
  const T* data() const { return heap_ ? heap_.get() : inline_; }
  T& operator[](std::size_t i) { return data()[i]; }
  const T& operator[](std::size_t i) const { return data()[i]; }
  T* begin() { return data(); }
  T* end() { return data() + size_; }
  const T* begin() const { return data(); }
  const T* end() const { return data() + size_; }

 private:
  void reserve(std::size_t n) {
    if (n <= capacity()) return;
    auto bigger = std::make_unique<T[]>(n);
    std::copy_n(data(), size_, bigger.get());
    heap_ = std::move(bigger);
    heap_capacity_ = n;
  }
  std::size_t capacity() const { return heap_ ? heap_capacity_ : N; }
  void copy_from(const SmallVector& o) {
    size_ = 0;
    reserve(o.size_);
    std::copy_n(o.data(), o.size_, data());
    size_ = o.size_;
  }
  void move_from(SmallVector& o) {
    if (o.heap_) {
      heap_ = std::move(o.heap_);
      heap_capacity_ = o.heap_capacity_;
    } else {
      heap_.reset();
      std::copy_n(o.inline_, o.size_, inline_);
    }
    size_ = o.size_;
    o.size_ = 0;
  }

  // Left uninitialized: only the first size_ elements are ever read, and resize, assign and
  // push_back write those. Zeroing all N cost a memset per construction (1 KiB for a
  // reduction's partials, ~6% of a small statement's time).
  T inline_[N];
  std::unique_ptr<T[]> heap_;
  std::size_t heap_capacity_ = 0;
  std::size_t size_ = 0;
};

}  // namespace lazy::core
