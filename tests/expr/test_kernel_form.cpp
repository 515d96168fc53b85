// expr/kernel_form.hpp: the leaf count that sizes a node's input list, against the
// number of leaves to_kernel actually visits (repeats included) and the distinct inputs
// it keeps.
#include <cstddef>
#include <vector>

#include <gtest/gtest.h>

#include <lazytensor/lazytensor.hpp>

namespace {

using lazy::Tensor;

// Counts the leaves of an expression by walking it at run time (independent of the
// compile-time count under test).
template <class X>
std::size_t walk_leaves(const X& x) {
  if constexpr (lazy::expr::is_leaf<X>::value) {
    return 1;
  } else if constexpr (lazy::expr::is_expr_node<X>::value) {
    return std::apply([](const auto&... ch) { return (std::size_t{0} + ... + walk_leaves(ch)); },
                      x.children());
  } else {
    return 0;
  }
}

template <class E>
void check(const E& e, std::size_t distinct) {
  const auto x = lazy::expr::operand(e);
  using X = decltype(x);
  EXPECT_EQ(lazy::expr::leaf_count_v<X>, walk_leaves(x));
  std::vector<lazy::graph::NodePtr> inputs;
  (void)lazy::expr::to_kernel(x, inputs);
  EXPECT_EQ(inputs.size(), distinct);
  EXPECT_LE(inputs.size(), lazy::expr::leaf_count_v<X>);
}

TEST(KernelForm, LeafCountCountsEveryTensorLeafOnce) {
  const auto a = lazy::full<float>({8}, 1.f), b = lazy::full<float>({8}, 2.f),
             c = lazy::full<float>({8}, 3.f), d = lazy::full<float>({8}, 4.f);
  static_assert(lazy::expr::leaf_count_v<lazy::expr::Scalar<float>> == 0);
  check(a + 1.f, 1);
  check(2.f * a - 1.f, 1);
  check(a * b + a, 2);  // three leaves, two distinct inputs
  check(lazy::relu(a * b + c) * d - 0.5f * a, 4);
  check(lazy::where(a > b, c, lazy::cast<float>(d > 0.f)), 4);
}

}  // namespace
