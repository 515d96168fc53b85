// Tests of data/shuffle.hpp and data/sampler.hpp: the permutation is checked against an
// independent implementation of the documented algorithm; DistributedSampler against
// PyTorch's algorithm re-written here with list operations.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <map>
#include <numeric>
#include <random>
#include <set>
#include <vector>

#include <gtest/gtest.h>

#include <lazytensor/data/sampler.hpp>
#include <lazytensor/data/shuffle.hpp>

namespace {

using lazy::data::DistributedSampler;
using Indices = std::vector<std::size_t>;

// ---- reference permutation, from the algorithm as documented in shuffle.hpp -------------

std::uint64_t ref_mix(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

Indices ref_permutation(std::size_t n, std::uint64_t seed, std::uint64_t epoch) {
  std::mt19937_64 gen(ref_mix(ref_mix(seed) + epoch));
  Indices p;
  for (std::size_t i = 0; i < n; ++i) p.push_back(i);
  if (n < 2) return p;
  for (std::size_t i = n - 1; i >= 1; --i) {
    const std::uint64_t bound = i + 1;
    // smallest multiple-of-bound-aligned range: reject draws below 2^64 mod bound
    const std::uint64_t reject_below = (~std::uint64_t{0} - bound + 1) % bound;
    std::uint64_t r;
    do r = gen();
    while (r < reject_below);
    std::swap(p[i], p[r % bound]);
  }
  return p;
}

TEST(Shuffle, StandardGeneratorConforms) {
  // The C++ standard fixes this value ([rand.predef]): the permutation relies on it.
  std::mt19937_64 g;
  g.discard(9999);
  EXPECT_EQ(g(), 9981545732273789042ull);
}

TEST(Shuffle, MatchesDocumentedAlgorithm) {
  for (std::size_t n : {0, 1, 2, 3, 7, 100, 1000}) {
    for (std::uint64_t seed : {0ull, 1ull, 42ull, 0xFFFFFFFFFFFFFFFFull}) {
      for (std::uint64_t epoch : {0ull, 1ull, 7ull}) {
        EXPECT_EQ(lazy::data::permutation(n, seed, epoch), ref_permutation(n, seed, epoch))
            << "n=" << n << " seed=" << seed << " epoch=" << epoch;
      }
    }
  }
}

TEST(Shuffle, IsAPermutationAndDependsOnSeedAndEpoch) {
  const auto p = lazy::data::permutation(500, 3, 0);
  Indices sorted = p;
  std::sort(sorted.begin(), sorted.end());
  Indices iota(500);
  std::iota(iota.begin(), iota.end(), std::size_t{0});
  EXPECT_EQ(sorted, iota);
  EXPECT_NE(p, iota);
  EXPECT_EQ(p, lazy::data::permutation(500, 3, 0));
  EXPECT_NE(p, lazy::data::permutation(500, 3, 1));
  EXPECT_NE(p, lazy::data::permutation(500, 4, 0));
  // seed + epoch is not what matters (PyTorch's seed + epoch would collide here)
  EXPECT_NE(lazy::data::permutation(500, 1, 0), lazy::data::permutation(500, 0, 1));
}

TEST(Shuffle, UniformEnoughOverManyEpochs) {
  // Each value lands in each position about equally often (chi-square on a 5x5 table).
  const std::size_t n = 5, trials = 20000;
  std::vector<std::vector<int>> count(n, std::vector<int>(n, 0));
  for (std::size_t e = 0; e < trials; ++e) {
    const auto p = lazy::data::permutation(n, 11, e);
    for (std::size_t pos = 0; pos < n; ++pos) count[pos][p[pos]]++;
  }
  double chi2 = 0;
  const double expect = static_cast<double>(trials) / n;
  for (const auto& row : count)
    for (int c : row) chi2 += (c - expect) * (c - expect) / expect;
  // 16 degrees of freedom (rows and columns are constrained); p = 0.0001 at ~42.3
  EXPECT_LT(chi2, 42.3);
}

// ---- DistributedSampler against PyTorch's algorithm ----------------------------------

Indices torch_distributed(std::size_t n, std::size_t replicas, std::size_t rank, bool shuffle,
                          std::uint64_t seed, std::uint64_t epoch, bool drop_last) {
  Indices indices;
  if (shuffle)
    indices = ref_permutation(n, seed, epoch);
  else
    for (std::size_t i = 0; i < n; ++i) indices.push_back(i);
  std::size_t num_samples;
  if (drop_last && n % replicas != 0) {
    // math.ceil((len - R) / R) in floating point, as torch computes it
    const double v =
        (static_cast<double>(n) - static_cast<double>(replicas)) / static_cast<double>(replicas);
    num_samples = static_cast<std::size_t>(std::max(0.0, std::ceil(v)));
  } else {
    num_samples =
        static_cast<std::size_t>(std::ceil(static_cast<double>(n) / static_cast<double>(replicas)));
  }
  const std::size_t total = num_samples * replicas;
  if (!drop_last) {
    const std::size_t padding = total - indices.size();
    if (padding <= indices.size()) {
      Indices head(indices.begin(), indices.begin() + static_cast<std::ptrdiff_t>(padding));
      indices.insert(indices.end(), head.begin(), head.end());
    } else if (padding > 0) {
      const std::size_t times = (padding + indices.size() - 1) / indices.size();
      Indices rep;
      for (std::size_t t = 0; t < times; ++t) rep.insert(rep.end(), indices.begin(), indices.end());
      indices.insert(indices.end(), rep.begin(),
                     rep.begin() + static_cast<std::ptrdiff_t>(padding));
    }
  } else {
    indices.resize(total);
  }
  Indices mine;
  for (std::size_t i = rank; i < total; i += replicas) mine.push_back(indices[i]);
  return mine;
}

TEST(DistributedSampler, MatchesPyTorchAlgorithm) {
  for (std::size_t n = 0; n <= 23; ++n) {
    for (std::size_t r = 1; r <= 6; ++r) {
      for (bool shuffle : {false, true}) {
        for (bool drop_last : {false, true}) {
          for (std::uint64_t epoch : {0ull, 3ull}) {
            for (std::size_t rank = 0; rank < r; ++rank) {
              DistributedSampler s(r, rank, shuffle, 17, drop_last);
              s.set_epoch(epoch);
              const Indices want = torch_distributed(n, r, rank, shuffle, 17, epoch, drop_last);
              EXPECT_EQ(s.indices(n), want)
                  << "n=" << n << " R=" << r << " rank=" << rank << " shuffle=" << shuffle
                  << " drop_last=" << drop_last << " epoch=" << epoch;
              EXPECT_EQ(s.size(n), want.size());
            }
          }
        }
      }
    }
  }
}

TEST(DistributedSampler, ReplicasPartitionThePaddedPermutation) {
  const std::size_t n = 10,
                    r = 4;  // 10 = 2*4 + 2: ceil 3 per replica, 2 pads; floor 2 with drop_last
  for (bool drop_last : {false, true}) {
    std::vector<Indices> parts;
    for (std::size_t rank = 0; rank < r; ++rank) {
      DistributedSampler s(r, rank, true, 5, drop_last);
      s.set_epoch(2);
      parts.push_back(s.indices(n));
      EXPECT_EQ(parts.back().size(), drop_last ? 2u : 3u);
    }
    // Interleaving the replicas by stride rebuilds the (padded / cut) permutation.
    const Indices perm = lazy::data::permutation(n, 5, 2);
    Indices rebuilt;
    for (std::size_t pos = 0; pos < parts[0].size(); ++pos)
      for (std::size_t rank = 0; rank < r; ++rank) rebuilt.push_back(parts[rank][pos]);
    Indices expect(perm.begin(),
                   perm.begin() + static_cast<std::ptrdiff_t>(std::min(n, rebuilt.size())));
    if (!drop_last) {
      expect.push_back(perm[0]);
      expect.push_back(perm[1]);
    }
    EXPECT_EQ(rebuilt, expect);
    std::map<std::size_t, int> seen;
    for (const auto& p : parts)
      for (auto i : p) seen[i]++;
    if (drop_last) {
      for (const auto& [i, c] : seen) EXPECT_EQ(c, 1) << i;
      EXPECT_EQ(seen.size(), 8u);
    } else {
      EXPECT_EQ(seen.size(), n);  // every sample, two of them twice
      EXPECT_EQ(seen[perm[0]], 2);
      EXPECT_EQ(seen[perm[1]], 2);
    }
  }
}

TEST(DistributedSampler, PaddingRepeatsCyclicallyForTinyDatasets) {
  // 2 samples over 5 replicas: padded to 5 by repeating [0, 1] cyclically: 0 1 0 1 0.
  for (std::size_t rank = 0; rank < 5; ++rank) {
    DistributedSampler s(5, rank, false);
    EXPECT_EQ(s.indices(2), Indices{rank % 2});
    DistributedSampler d(5, rank, false, 0, true);
    EXPECT_TRUE(d.indices(2).empty());
  }
}

TEST(DistributedSampler, EpochChangesTheShuffleIdenticallyOnEveryReplica) {
  DistributedSampler a(2, 0, true, 9), b(2, 1, true, 9);
  const Indices a0 = a.indices(50), b0 = b.indices(50);
  a.set_epoch(1);
  b.set_epoch(1);
  const Indices a1 = a.indices(50), b1 = b.indices(50);
  EXPECT_NE(a0, a1);
  for (const auto& [x, y] : {std::pair{a0, b0}, std::pair{a1, b1}}) {
    std::set<std::size_t> all(x.begin(), x.end());
    all.insert(y.begin(), y.end());
    EXPECT_EQ(all.size(), 50u);  // disjoint halves covering everything
  }
  DistributedSampler c(2, 0, false);
  c.set_epoch(5);
  Indices even;
  for (std::size_t i = 0; i < 50; i += 2) even.push_back(i);
  EXPECT_EQ(c.indices(50), even);  // no shuffle: the epoch does not matter
}

TEST(DistributedSampler, ValidatesArguments) {
  EXPECT_THROW(DistributedSampler(0, 0), lazy::IndexError);
  EXPECT_THROW(DistributedSampler(4, 4), lazy::IndexError);
  EXPECT_THROW(DistributedSampler(4, 100), lazy::IndexError);
  EXPECT_NO_THROW(DistributedSampler(4, 3));
}

TEST(Samplers, SequentialAndRandom) {
  lazy::data::SequentialSampler seq;
  EXPECT_EQ(seq.indices(4), (Indices{0, 1, 2, 3}));
  lazy::data::RandomSampler rnd(8);
  rnd.set_epoch(3);
  EXPECT_EQ(rnd.indices(40), ref_permutation(40, 8, 3));
  EXPECT_EQ(rnd.size(40), 40u);
}

}  // namespace
