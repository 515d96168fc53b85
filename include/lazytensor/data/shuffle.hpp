#pragma once
// Deterministic shuffling: the same (seed, epoch) gives the same permutation on every
// replica, platform and standard library. Only std::mt19937_64 is used from <random> (its
// output sequence is fixed by the C++ standard); its distributions are not (their
// algorithms are implementation-defined), so bounded draws are our own.
//
//   generator seed  = splitmix64(splitmix64(seed) + epoch)
//   generator       = std::mt19937_64(generator seed)
//   permutation     = Fisher-Yates from the back: for i = n-1 down to 1, swap p[i] with
//                     p[j], j = uniform_below(i + 1)
//   uniform_below(b) = the first draw r with r >= (2^64 - b) mod b, reduced r mod b
//                     (rejection makes it exactly uniform)

#include <cstddef>
#include <cstdint>
#include <vector>

#include <lazytensor/core/config.hpp>

#if LAZYTENSOR_HEADER_DEFINITIONS
// Only the definitions draw: with the compiled runtime a user TU does not parse <random>.
#include <numeric>
#include <random>
#include <utility>
#endif

namespace lazy::data {

namespace detail {

/// SplitMix64's output function: a bijective 64-bit mixer.
constexpr std::uint64_t splitmix64(std::uint64_t x) {
  std::uint64_t z = x + 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

}  // namespace detail

/// The generator seed used for (seed, epoch).
constexpr std::uint64_t shuffle_seed(std::uint64_t seed, std::uint64_t epoch) {
  return detail::splitmix64(detail::splitmix64(seed) + epoch);
}

/// A permutation of 0..n-1, a fixed function of (n, seed, epoch) (see the file comment).
std::vector<std::size_t> permutation(std::size_t n, std::uint64_t seed, std::uint64_t epoch);

#if LAZYTENSOR_HEADER_DEFINITIONS
namespace detail {

/// A uniform integer in [0, bound), bound > 0, by rejection (no modulo bias).
LAZYTENSOR_INLINE std::uint64_t uniform_below(std::mt19937_64& gen, std::uint64_t bound) {
  const std::uint64_t threshold = (0 - bound) % bound;  // (2^64 - bound) mod bound
  for (;;) {
    const std::uint64_t r = gen();
    if (r >= threshold) return r % bound;
  }
}

}  // namespace detail

LAZYTENSOR_INLINE std::vector<std::size_t> permutation(std::size_t n, std::uint64_t seed,
                                                       std::uint64_t epoch) {
  std::vector<std::size_t> p(n);
  std::iota(p.begin(), p.end(), std::size_t{0});
  std::mt19937_64 gen(shuffle_seed(seed, epoch));
  for (std::size_t i = n; i > 1; --i) {
    const auto j = static_cast<std::size_t>(detail::uniform_below(gen, i));
    std::swap(p[i - 1], p[j]);
  }
  return p;
}
#endif  // LAZYTENSOR_HEADER_DEFINITIONS

}  // namespace lazy::data
