#pragma once
// RandomNode, the kernel of every random tensor: Philox4x32-10 (a counter-based generator,
// so element i's value is a pure function of the seed and i, whatever the thread count) and
// the distributions that turn its output words into elements (uniform, normal, integers,
// Bernoulli). ops/random.hpp describes the streams and reserves the counters.

#include <algorithm>
#include <array>
#include <cstdint>
#include <numbers>
#include <string>
#include <type_traits>
#include <vector>

#include <lazytensor/core/simd.hpp>

#include <lazytensor/core/bfloat16.hpp>
#include <lazytensor/core/dtype.hpp>
#include <lazytensor/core/error.hpp>
#include <lazytensor/graph/device.hpp>
#include <lazytensor/graph/parallel.hpp>

namespace lazy {

namespace ops {

/// 128-bit Philox counter (four 32-bit words, word 0 least significant).
using PhiloxCounter = std::array<std::uint32_t, 4>;
/// 64-bit Philox key (two 32-bit words).
using PhiloxKey = std::array<std::uint32_t, 2>;

/// The Philox4x32-10 bijection of `counter` under `key`: ten rounds of two 32x32->64-bit
/// multiplies, with the key bumped by the Weyl constants between rounds. Matches the
/// Random123 known-answer vectors (e.g. counter 0, key 0 -> 6627e8d5 e169c58d bc57ac4c
/// 9b00dbd8).
constexpr PhiloxCounter philox4x32_10(PhiloxCounter ctr, PhiloxKey key) {
  constexpr std::uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u;  // round multipliers
  constexpr std::uint32_t kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;  // Weyl key increments
  for (int r = 0; r < 10; ++r) {
    if (r > 0) {
      key[0] += kW0;
      key[1] += kW1;
    }
    const std::uint64_t p0 = std::uint64_t{kM0} * ctr[0];
    const std::uint64_t p1 = std::uint64_t{kM1} * ctr[2];
    const auto hi0 = static_cast<std::uint32_t>(p0 >> 32), lo0 = static_cast<std::uint32_t>(p0);
    const auto hi1 = static_cast<std::uint32_t>(p1 >> 32), lo1 = static_cast<std::uint32_t>(p1);
    ctr = {hi1 ^ ctr[1] ^ key[0], lo1, hi0 ^ ctr[3] ^ key[1], lo0};
  }
  return ctr;
}

/// The key of a 64-bit seed: its low and high words.
constexpr PhiloxKey philox_key(std::uint64_t seed) {
  return {static_cast<std::uint32_t>(seed), static_cast<std::uint32_t>(seed >> 32)};
}

/// Philox output for 64-bit counter value `c` (the upper 64 counter bits are zero).
constexpr PhiloxCounter philox_block(std::uint64_t c, const PhiloxKey& key) {
  return philox4x32_10({static_cast<std::uint32_t>(c), static_cast<std::uint32_t>(c >> 32), 0u, 0u}, key);
}

}  // namespace ops

namespace graph {

namespace detail {

// A distribution turns the 4 * kRandomBlock words of one block of counters into
// P * kRandomBlock elements (P = per_counter). fill(words, j0, cnt, out, i) writes elements
// [j0, j0 + cnt) of the block to out[0..cnt); `i` is the global index of out[0] (for
// distributions that read an input element-wise). A distribution that vectorizes computes
// the whole block and keeps the part asked for, so no element's bits depend on where a task
// starts.

/// Counters per block.
inline constexpr int kRandomBlock = 16;

/// Uniform 24-bit float in [0, 1): exact, never 1.
inline float unit_float(std::uint32_t x) { return static_cast<float>(x >> 8) * 0x1p-24f; }
inline std::uint64_t word64(std::uint32_t hi, std::uint32_t lo) { return (std::uint64_t{hi} << 32) | lo; }
/// Uniform 53-bit double in [0, 1).
inline double unit_double(std::uint32_t hi, std::uint32_t lo) {
  return static_cast<double>(word64(hi, lo) >> 11) * 0x1p-53;
}

/// torch.rand: uniform in [0, 1).
template <Element T>
struct UniformDist {
  static constexpr const char* name = "rand";
  static constexpr int per_counter = std::is_same_v<T, double> ? 2 : 4;
  static constexpr double cost = 2;
  std::string params() const { return ""; }
  void bind(const NodeList&) {}
  void fill(const std::uint32_t* w, int j0, int cnt, T* out, std::int64_t) const {
    for (int k = 0; k < cnt; ++k) {
      const int j = j0 + k;
      if constexpr (std::is_same_v<T, double>) {
        out[k] = unit_double(w[2 * j], w[2 * j + 1]);
      } else if constexpr (std::is_same_v<T, bfloat16>) {
        // 8 random bits: k / 256 is exact in bfloat16, whereas rounding a 24-bit float
        // could round up to 1.0 and break the [0, 1) contract.
        out[k] = bfloat16(static_cast<float>(w[j] >> 24) * 0x1p-8f);
      } else {
        out[k] = unit_float(w[j]);
      }
    }
  }
};

/// torch.randn: standard normal by Box-Muller on pairs of uniforms (u1, u2) -> (r cos t,
/// r sin t), r = sqrt(-2 log u1), t = 2 pi u2. u1 is in (0, 1], so log(0) cannot happen.
/// Vectorized with xsimd over a whole block; bfloat16 computes in float and rounds.
template <Element T>
struct NormalDist {
  static constexpr const char* name = "randn";
  static constexpr int per_counter = std::is_same_v<T, double> ? 2 : 4;
  static constexpr double cost = 6;
  std::string params() const { return ""; }
  void bind(const NodeList&) {}
  void fill(const std::uint32_t* w, int j0, int cnt, T* out, std::int64_t) const {
    using S = std::conditional_t<std::is_same_v<T, double>, double, float>;
    using V = xsimd::batch<S>;
    constexpr int kPairs = kRandomBlock * per_counter / 2;
    static_assert(kPairs % V::size == 0, "a block is a whole number of SIMD batches");
    alignas(64) S u1[kPairs], u2[kPairs], z[2 * kPairs];
    for (int m = 0; m < kPairs; ++m) {
      if constexpr (std::is_same_v<S, double>) {
        u1[m] = static_cast<double>((word64(w[4 * m], w[4 * m + 1]) >> 11) + 1) * 0x1p-53;
        u2[m] = unit_double(w[4 * m + 2], w[4 * m + 3]);
      } else {
        u1[m] = static_cast<float>((w[2 * m] >> 8) + 1) * 0x1p-24f;
        u2[m] = unit_float(w[2 * m + 1]);
      }
    }
    for (int m = 0; m < kPairs; m += static_cast<int>(V::size)) {
      const V r = xsimd::sqrt(V(S(-2)) * xsimd::log(V::load_aligned(u1 + m)));
      const auto [sn, cs] = xsimd::sincos(V(S(2) * std::numbers::pi_v<S>) * V::load_aligned(u2 + m));
      alignas(64) S c[V::size], s[V::size];
      (r * cs).store_aligned(c);
      (r * sn).store_aligned(s);
      for (std::size_t l = 0; l < V::size; ++l) {
        z[2 * (m + static_cast<int>(l))] = c[l];
        z[2 * (m + static_cast<int>(l)) + 1] = s[l];
      }
    }
    for (int k = 0; k < cnt; ++k) out[k] = static_cast<T>(z[j0 + k]);
  }
};

/// torch.randint: integers in [low, high). A 64-bit draw modulo the range: the bias is at
/// most range / 2^64, far below anything a test can see.
template <Element T>
struct RandIntDist {
  static constexpr const char* name = "randint";
  static constexpr int per_counter = 2;
  static constexpr double cost = 3;
  std::int64_t low;
  std::uint64_t range;
  std::string params() const {
    return "low=" + std::to_string(low) + ", high=" + std::to_string(static_cast<std::int64_t>(static_cast<std::uint64_t>(low) + range));
  }
  void bind(const NodeList&) {}
  void fill(const std::uint32_t* w, int j0, int cnt, T* out, std::int64_t) const {
    for (int k = 0; k < cnt; ++k) {
      const int j = j0 + k;
      // Unsigned arithmetic: low + v may pass through values outside int64 mid-way.
      const std::uint64_t v = static_cast<std::uint64_t>(low) + word64(w[2 * j], w[2 * j + 1]) % range;
      out[k] = static_cast<T>(static_cast<std::int64_t>(v));
    }
  }
};

/// torch.bernoulli with one probability: 1 with probability p, else 0.
template <Element T>
struct BernoulliDist {
  static constexpr const char* name = "bernoulli";
  static constexpr int per_counter = 4;
  static constexpr double cost = 2;
  double p;
  std::string params() const { return "p=" + std::to_string(p); }
  void bind(const NodeList&) {}
  void fill(const std::uint32_t* w, int j0, int cnt, T* out, std::int64_t) const {
    // u = x / 2^32 in [0, 1): p = 0 never fires, p = 1 always does.
    for (int k = 0; k < cnt; ++k) out[k] = static_cast<T>(static_cast<double>(w[j0 + k]) * 0x1p-32 < p);
  }
};

/// torch.bernoulli(probs): element i is 1 with probability probs[i]. Probabilities outside
/// [0, 1] (or NaN) raise lazy::Error when the kernel runs.
template <Element T>
struct BernoulliTensorDist {
  static constexpr const char* name = "bernoulli";
  static constexpr int per_counter = 4;
  static constexpr double cost = 3;
  const T* probs = nullptr;
  std::string params() const { return "p=%0"; }
  void bind(const NodeList& ins) { probs = ins[0]->template data<T>(); }
  void fill(const std::uint32_t* w, int j0, int cnt, T* out, std::int64_t i) const {
    for (int k = 0; k < cnt; ++k) {
      const double p = static_cast<double>(static_cast<compute_t<T>>(probs[i + k]));
      if (!(p >= 0.0 && p <= 1.0)) {
        throw Error("bernoulli: expected every probability in [0, 1], found " + std::to_string(p) + " at element " +
                    std::to_string(i + k));
      }
      out[k] = static_cast<T>(static_cast<double>(w[j0 + k]) * 0x1p-32 < p);
    }
  }
};

}  // namespace detail

/// A tensor of random values drawn from distribution D with counters offset.. of `seed`.
template <Element T, class D>
class RandomNode final : public Node {
 public:
  RandomNode(D dist, Shape shape, Device* device, std::uint64_t seed, std::uint64_t offset,
             NodeList inputs = {})
      : Node(NodeKind::Random, dtype_of<T>(), shape, device, std::move(inputs)), dist_(dist), seed_(seed),
        offset_(offset) {}

  std::string op_name() const override { return D::name; }
  std::string describe() const override {
    const std::string p = dist_.params();
    return std::string(D::name) + "(" + p + (p.empty() ? "" : ", ") + "offset=" + std::to_string(offset_) + ")";
  }
  double cost_per_element() const override { return D::cost; }
  /// Shape, dtype and distribution only: a new seed or offset every step must not make the
  /// plan look new (the values are data, as a learning rate is).
  std::uint64_t structural_hash() const override { return Node::structural_hash(); }

  std::uint64_t seed() const { return seed_; }
  std::uint64_t offset() const { return offset_; }

 protected:
  void compute(ExecContext& ctx) override {
    D d = dist_;
    d.bind(inputs());  // input pointers first (house rule)
    // No donation: bernoulli(probs) may throw half-way, and must leave its input intact.
    auto buf = allocate_output(ctx, false);
    T* out = static_cast<T*>(buf->data());
    const std::int64_t n = numel();
    constexpr std::int64_t E = std::int64_t{detail::kRandomBlock} * D::per_counter;  // elements per block
    const auto key = ops::philox_key(seed_);
    auto& pool = ctx.device.threads();
    const std::int64_t tasks = task_count(pool, n, D::cost);
    pool.parallel_for(tasks, [&](std::int64_t t) {
      // Tasks start on block boundaries (no block computed twice), but the values depend
      // only on the element index either way.
      auto [b, e] = task_range(n, tasks, t, E);
      std::uint32_t words[4 * detail::kRandomBlock];
      for (std::int64_t i = b; i < e;) {
        const std::int64_t blk = i / E;
        const std::uint64_t c0 = offset_ + static_cast<std::uint64_t>(blk) * detail::kRandomBlock;
        for (int c = 0; c < detail::kRandomBlock; ++c) {
          const auto r = ops::philox_block(c0 + static_cast<std::uint64_t>(c), key);
          for (int k = 0; k < 4; ++k) words[4 * c + k] = r[k];
        }
        const int j0 = static_cast<int>(i - blk * E);
        const int cnt = static_cast<int>(std::min<std::int64_t>(E - j0, e - i));
        d.fill(words, j0, cnt, out + i, i);
        i += cnt;
      }
    });
    set_buffer(std::move(buf));
  }

 private:
  D dist_;
  std::uint64_t seed_, offset_;
};

}  // namespace graph

}  // namespace lazy
