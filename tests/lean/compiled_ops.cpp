// Products, convolution, pooling and softmax from a program built against lazytensor::compiled.
// Its object file must hold none of their per-dtype machinery (GEMM node and kernels, im2col,
// pooling and softmax nodes, their derivative rules: tests/lean/check_compiled_symbols.cmake):
// the compiled runtime instantiates those once. Run, it checks every result, gradients
// included, against scalar loops, so the runtime's instances are the ones tested.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include <lazytensor/tensor.hpp>
#include <lazytensor/ops/conv.hpp>
#include <lazytensor/ops/pool.hpp>
#include <lazytensor/ops/softmax.hpp>

namespace {

int failures = 0;

void expect_near(const std::vector<float>& got, const std::vector<double>& want, const char* what) {
  if (got.size() != want.size()) {
    std::printf("%s: %zu values, expected %zu\n", what, got.size(), want.size());
    ++failures;
    return;
  }
  for (std::size_t i = 0; i < got.size(); ++i) {
    if (std::abs(got[i] - want[i]) > 1e-4 * (1 + std::abs(want[i]))) {
      std::printf("%s[%zu] = %.7g, expected %.7g\n", what, i, static_cast<double>(got[i]), want[i]);
      ++failures;
      return;
    }
  }
}

std::vector<float> values(std::size_t n, unsigned seed) {
  std::vector<float> v(n);
  for (auto& x : v) {
    seed = seed * 1103515245u + 12345u;
    x = static_cast<float>((seed >> 8) % 2001) / 1000.0f - 1.0f;
  }
  return v;
}

}  // namespace

int main() {
  // matmul of [M, K] and [K, N] (big enough for the packed kernel), and the gradient of
  // sum(A B) with respect to A: row i of dA is the row sums of B.
  const int M = 20, K = 33, N = 24;
  const auto av = values(M * K, 1), bv = values(K * N, 2);
  auto a = lazy::from_vector<float>(av, {M, K});
  auto b = lazy::from_vector<float>(bv, {K, N});
  a.requires_grad_();
  auto c = lazy::matmul(a, b);
  lazy::sum(c).backward();
  std::vector<double> c_ref(M * N), da_ref(M * K);
  for (int i = 0; i < M; ++i)
    for (int j = 0; j < N; ++j)
      for (int k = 0; k < K; ++k) c_ref[i * N + j] += double(av[i * K + k]) * bv[k * N + j];
  for (int i = 0; i < M; ++i)
    for (int k = 0; k < K; ++k)
      for (int j = 0; j < N; ++j) da_ref[i * K + k] += bv[k * N + j];
  expect_near(c.to_vector(), c_ref, "matmul");
  expect_near(a.grad().to_vector(), da_ref, "matmul gradient");

  // conv2d, 3x3, padding 1, two images of 3 channels, 4 output channels, with bias.
  const int B = 2, C = 3, H = 6, W = 5, O = 4;
  const auto xv = values(B * C * H * W, 3), wv = values(O * C * 9, 4), biasv = values(O, 5);
  auto x = lazy::from_vector<float>(xv, {B, C, H, W});
  auto w = lazy::from_vector<float>(wv, {O, C, 3, 3});
  auto bias = lazy::from_vector<float>(biasv, {O});
  auto y = lazy::conv2d(x, w, bias, 1, 1);
  std::vector<double> y_ref(B * O * H * W);
  for (int n = 0; n < B; ++n)
    for (int o = 0; o < O; ++o)
      for (int r = 0; r < H; ++r)
        for (int s = 0; s < W; ++s) {
          double acc = biasv[o];
          for (int ch = 0; ch < C; ++ch)
            for (int p = 0; p < 3; ++p)
              for (int q = 0; q < 3; ++q) {
                const int rr = r + p - 1, ss = s + q - 1;
                if (rr < 0 || rr >= H || ss < 0 || ss >= W) continue;
                acc += double(wv[((o * C + ch) * 3 + p) * 3 + q]) *
                       xv[((n * C + ch) * H + rr) * W + ss];
              }
          y_ref[((n * O + o) * H + r) * W + s] = acc;
        }
  expect_near(y.to_vector(), y_ref, "conv2d");

  // max and average pooling, 2x2 windows of stride 2 over the 6x5 images (the last column
  // left out, as torch's floor rule does).
  auto mx = lazy::max_pool2d(x, 2);
  auto av2 = lazy::avg_pool2d(x, 2);
  std::vector<double> mx_ref, av_ref;
  for (int n = 0; n < B; ++n)
    for (int ch = 0; ch < C; ++ch)
      for (int r = 0; r + 1 < H; r += 2)
        for (int s = 0; s + 1 < W; s += 2) {
          double m = -1e30, sum = 0;
          for (int p = 0; p < 2; ++p)
            for (int q = 0; q < 2; ++q) {
              const double v = xv[((n * C + ch) * H + r + p) * W + s + q];
              m = std::max(m, v);
              sum += v;
            }
          mx_ref.push_back(m);
          av_ref.push_back(sum / 4);
        }
  expect_near(mx.to_vector(), mx_ref, "max_pool2d");
  expect_near(av2.to_vector(), av_ref, "avg_pool2d");

  // softmax and log_softmax along the last dim of a [4, 7] tensor, and the gradient of
  // sum(softmax(z) * t) (dz = y * (t - sum(y * t))).
  const int R = 4, D = 7;
  const auto zv = values(R * D, 6), tv = values(R * D, 7);
  auto z = lazy::from_vector<float>(zv, {R, D});
  z.requires_grad_();
  auto t = lazy::from_vector<float>(tv, {R, D});
  auto sm = lazy::softmax(z, 1);
  auto lsm = lazy::log_softmax(z, 1);
  lazy::sum(sm * t).backward();
  std::vector<double> sm_ref(R * D), lsm_ref(R * D), dz_ref(R * D);
  for (int i = 0; i < R; ++i) {
    double mxv = -1e30, sum = 0, dot = 0;
    for (int j = 0; j < D; ++j) mxv = std::max(mxv, double(zv[i * D + j]));
    for (int j = 0; j < D; ++j) sum += std::exp(zv[i * D + j] - mxv);
    for (int j = 0; j < D; ++j) {
      sm_ref[i * D + j] = std::exp(zv[i * D + j] - mxv) / sum;
      lsm_ref[i * D + j] = zv[i * D + j] - mxv - std::log(sum);
      dot += sm_ref[i * D + j] * tv[i * D + j];
    }
    for (int j = 0; j < D; ++j) dz_ref[i * D + j] = sm_ref[i * D + j] * (tv[i * D + j] - dot);
  }
  expect_near(sm.to_vector(), sm_ref, "softmax");
  expect_near(lsm.to_vector(), lsm_ref, "log_softmax");
  expect_near(z.grad().to_vector(), dz_ref, "softmax gradient");

  if (failures) return EXIT_FAILURE;
  std::printf("compiled ops: matmul, conv2d, pooling and softmax match their scalar references\n");
  return EXIT_SUCCESS;
}
