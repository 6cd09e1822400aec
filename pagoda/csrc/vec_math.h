// Vector math shared by the kernels: exp of 8 floats at a time where AVX2 + FMA are built in
// (PAGODA_AVX2). std::exp one value at a time does not vectorize, and was most of the time of
// the softmax in a batch-64 attention call and of silu_and_mul.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PAGODA_AVX2 1
#endif

namespace pagoda {

#ifdef PAGODA_AVX2
// exp of 8 floats (Cephes' expf: a degree-6 polynomial on the remainder after n * ln 2, then 2^n
// through the exponent bits; within 2 ulp; inputs clamped to [-87.3, 88.4]).
inline __m256 exp256(__m256 x) {
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f)), _mm256_set1_ps(-87.3365478515625f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 y = _mm256_set1_ps(1.9875691500E-4f);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507E-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073E-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894E-2f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459E-1f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201E-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

// The largest of 8 lanes, folded into m (a max is exact in any order).
inline float hmax256(__m256 v, float m) {
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, v);
  for (float lane : lanes) m = m > lane ? m : lane;
  return m;
}
#endif

// The largest of s[0..n) (-inf for none); a max is exact in any order, 8 lanes at a time where
// AVX2 is built in.
inline float max_of(const float* s, int64_t n) {
  float m = -std::numeric_limits<float>::infinity();
  int64_t j = 0;
#ifdef PAGODA_AVX2
  __m256 mv = _mm256_set1_ps(m);
  for (; j + 8 <= n; j += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(s + j));
  m = hmax256(mv, m);
#endif
  for (; j < n; ++j) m = std::max(m, s[j]);
  return m;
}

// s[j] = exp(s[j] - m) in place for j < n; returns their sum (8 lanes at a time, then the scalar
// tail, always in that order). With MASKED, a score of -inf (a key the row does not see) gives an
// exact 0: exp256 clamps its input and would give ~1e-38.
template <bool MASKED = false>
inline float exp_minus_and_sum(float* s, int64_t n, float m) {
  constexpr float ninf = -std::numeric_limits<float>::infinity();
  float sum = 0.f;
  int64_t j = 0;
#ifdef PAGODA_AVX2
  const __m256 mv = _mm256_set1_ps(m);
  __m256 acc = _mm256_setzero_ps();
  for (; j + 8 <= n; j += 8) {
    const __m256 x = _mm256_loadu_ps(s + j);
    __m256 e = exp256(_mm256_sub_ps(x, mv));
    if constexpr (MASKED) e = _mm256_andnot_ps(_mm256_cmp_ps(x, _mm256_set1_ps(ninf), _CMP_EQ_OQ), e);
    _mm256_storeu_ps(s + j, e);
    acc = _mm256_add_ps(acc, e);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, acc);
  for (float lane : lanes) sum += lane;
#endif
  for (; j < n; ++j) {
    s[j] = MASKED && s[j] == ninf ? 0.f : std::exp(s[j] - m);
    sum += s[j];
  }
  return sum;
}

// silu(g) * u = g / (1 + exp(-g)) * u over n elements; 8 lanes at a time where AVX2 is built in
// (each element's arithmetic depends only on its place in the row, never on the batch). Shared by
// silu_and_mul and the fused activation quantization of the down projection (ggml_blocks.h),
// so both give the same bits.
inline void silu_mul_row(const float* g, const float* u, float* y, int64_t n) {
  int64_t i = 0;
#ifdef PAGODA_AVX2
  const __m256 one = _mm256_set1_ps(1.f);
  for (; i + 8 <= n; i += 8) {
    const __m256 gv = _mm256_loadu_ps(g + i);
    const __m256 e = exp256(_mm256_sub_ps(_mm256_setzero_ps(), gv));
    _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(one, e)), _mm256_loadu_ps(u + i)));
  }
#endif
  for (; i < n; ++i) y[i] = (g[i] / (1.f + std::exp(-g[i]))) * u[i];
}

}  // namespace pagoda
