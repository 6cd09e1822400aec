// fp32 x [M, K] @ W.T for up to 32 rows (a decode step of a few sequences).
//
// A decode step streams every weight from memory. MKL's sgemm did that well at M = 1 but took
// twice as long at M = 2..8 (SmolLM2's decode step went from 75 to 158 ms); this streams each
// weight row once against up to 4 activation rows at a time: 30 layers of gate/up + down took
// 26 ms at M = 1 (MKL 43), 27 at M = 4 (MKL 81), 52 at M = 16 (MKL 73); from ~64 rows MKL wins. Used for both the Python layers and decode_layers, so the
// two compute the same sums (pagoda::linear picks it; everything else goes to at::linear).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "ops.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PAGODA_AVX2 1
#endif

namespace {

constexpr int64_t SMALL_M_MAX = 32;

template <int T>
void dot_row(const float* w, const float* x, int64_t K, float* out, int64_t out_stride) {
  float sums[T];
  int64_t k = 0;
#ifdef PAGODA_AVX2
  __m256 acc[T];
  for (int t = 0; t < T; ++t) acc[t] = _mm256_setzero_ps();
  for (; k + 8 <= K; k += 8) {
    const __m256 wv = _mm256_loadu_ps(w + k);
    for (int t = 0; t < T; ++t) acc[t] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + t * K + k), acc[t]);
  }
  for (int t = 0; t < T; ++t) {
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, acc[t]);
    sums[t] = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
  }
#else
  for (int t = 0; t < T; ++t) sums[t] = 0.f;
#endif
  for (; k < K; ++k)
    for (int t = 0; t < T; ++t) sums[t] += w[k] * x[t * K + k];
  for (int t = 0; t < T; ++t) out[t * out_stride] = sums[t];
}

at::Tensor small_m_matmul(const at::Tensor& x, const at::Tensor& w) {
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  at::Tensor out = at::empty({M, N}, x.options());
  const float* xs = x.data_ptr<float>();
  const float* ws = w.data_ptr<float>();
  float* y = out.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      for (int64_t m = 0; m < M; m += 4) {
        const float* xm = xs + m * K;
        float* o = y + m * N + n;
        switch (std::min<int64_t>(4, M - m)) {
          case 4: dot_row<4>(ws + n * K, xm, K, o, N); break;
          case 3: dot_row<3>(ws + n * K, xm, K, o, N); break;
          case 2: dot_row<2>(ws + n * K, xm, K, o, N); break;
          default: dot_row<1>(ws + n * K, xm, K, o, N);
        }
      }
    }
  });
  return out;
}

}  // namespace

namespace pagoda {

at::Tensor linear(const at::Tensor& x, const at::Tensor& weight) {
  const bool small = x.dim() == 2 && x.size(0) >= 1 && x.size(0) <= SMALL_M_MAX && x.scalar_type() == at::kFloat &&
                     weight.scalar_type() == at::kFloat && x.is_contiguous() && weight.is_contiguous() &&
                     x.device().is_cpu() && weight.dim() == 2 && weight.size(1) == x.size(1);
  return small ? small_m_matmul(x, weight) : at::linear(x, weight);
}

}  // namespace pagoda

TORCH_LIBRARY_FRAGMENT(pagoda, m) { m.def("linear(Tensor x, Tensor weight) -> Tensor"); }

TORCH_LIBRARY_IMPL(pagoda, CPU, m) { m.impl("linear", &pagoda::linear); }
