// Paged attention for decode tokens (one query per sequence) on the CPU.
//
// Reads each sequence's K/V straight from the block pool through its block table: no gather
// copy, no padding to the longest sequence. One work item per (sequence, kv head) pair handles
// the whole GQA group of query heads that share that kv head. Softmax in fp32.
// Registered as torch.ops.pagoda.paged_decode_attention (no pybind11: it compiles faster).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "ops.h"

#include <cmath>
#include <limits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PAGODA_AVX2 1
#endif

namespace {

#ifdef PAGODA_AVX2
// exp of 8 floats (Cephes' expf: a degree-6 polynomial on the remainder after n * ln 2, then 2^n
// through the exponent bits; within 2 ulp). std::exp one value at a time was most of a batch-64
// attention call: 3 query heads x ~160 positions per (sequence, kv head).
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
#endif

// p[t] = exp(s[t] - max) / sum, in place.
inline void softmax(float* s, int64_t L) {
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t t = 0; t < L; ++t) m = std::max(m, s[t]);
  float sum = 0.f;
  int64_t t = 0;
#ifdef PAGODA_AVX2
  const __m256 mv = _mm256_set1_ps(m);
  __m256 acc = _mm256_setzero_ps();
  for (; t + 8 <= L; t += 8) {
    const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(s + t), mv));
    _mm256_storeu_ps(s + t, e);
    acc = _mm256_add_ps(acc, e);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, acc);
  for (float lane : lanes) sum += lane;
#endif
  for (; t < L; ++t) {
    s[t] = std::exp(s[t] - m);
    sum += s[t];
  }
  const float inv = 1.f / sum;
  for (int64_t i = 0; i < L; ++i) s[i] *= inv;
}

// Load one row of D values as fp32 (a copy only when the cache is not fp32).
template <typename scalar_t>
inline const float* row_as_float(const scalar_t* src, float* buf, int64_t D) {
  for (int64_t d = 0; d < D; ++d) buf[d] = static_cast<float>(src[d]);
  return buf;
}
template <>
inline const float* row_as_float<float>(const float* src, float*, int64_t) { return src; }

template <typename scalar_t>
void decode_attention_impl(const scalar_t* __restrict__ q, const scalar_t* __restrict__ k_cache,
                           const scalar_t* __restrict__ v_cache, const int64_t* __restrict__ tables,
                           const int64_t* __restrict__ lens, scalar_t* __restrict__ out,
                           int64_t B, int64_t Hq, int64_t Hkv, int64_t D, int64_t BS,
                           int64_t max_blocks, float scale) {
  const int64_t G = Hq / Hkv;
  // Cache layout [num_blocks, Hkv, BS, D]: one head's tokens of a block are contiguous rows.
  const int64_t head_stride = BS * D;
  const int64_t block_stride = Hkv * head_stride;
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * D), acc(G * D), buf(D), scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / Hkv, h = item % Hkv;
      const int64_t L = lens[b];
      const int64_t* table = tables + b * max_blocks;
      scores.resize(G * L);
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d)
          qf[g * D + d] = static_cast<float>(q[(b * Hq + h * G + g) * D + d]) * scale;
      float* sc = scores.data();
      // scores[g][t] = q_g . k_t
      for (int64_t t0 = 0; t0 < L; t0 += BS) {
        const scalar_t* kb = k_cache + table[t0 / BS] * block_stride + h * head_stride;
        const int64_t n = std::min(BS, L - t0);
        for (int64_t i = 0; i < n; ++i) {
          const float* k = row_as_float(kb + i * D, buf.data(), D);
          for (int64_t g = 0; g < G; ++g) {
            const float* qg = qf.data() + g * D;
            float s = 0.f;
#pragma omp simd reduction(+ : s)
            for (int64_t d = 0; d < D; ++d) s += qg[d] * k[d];
            sc[g * L + t0 + i] = s;
          }
        }
      }
      for (int64_t g = 0; g < G; ++g) softmax(sc + g * L, L);
      // acc[g] = sum_t p[g][t] * v_t
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t0 = 0; t0 < L; t0 += BS) {
        const scalar_t* vb = v_cache + table[t0 / BS] * block_stride + h * head_stride;
        const int64_t n = std::min(BS, L - t0);
        for (int64_t i = 0; i < n; ++i) {
          const float* v = row_as_float(vb + i * D, buf.data(), D);
          for (int64_t g = 0; g < G; ++g) {
            const float p = sc[g * L + t0 + i];
            float* ag = acc.data() + g * D;
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) ag[d] += p * v[d];
          }
        }
      }
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d)
          out[(b * Hq + h * G + g) * D + d] = static_cast<scalar_t>(acc[g * D + d]);
    }
  });
}

}  // namespace

namespace pagoda {

// q: [B, Hq, D]; k_cache, v_cache: [num_blocks, Hkv, block_size, D]; block_tables: [B, max_blocks]
// int64; seq_lens: [B] int64 (tokens to attend, the query's own included). Returns [B, Hq, D].
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.dim() == 4, "bad ranks");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "the KV cache must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong, "int64 tables");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type(), "q and cache dtypes differ");
  auto qc = q.contiguous();
  auto tables = block_tables.contiguous();
  auto lens = seq_lens.contiguous();
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t Hkv = k_cache.size(1), BS = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D && Hq % Hkv == 0, "head shapes do not match");
  auto out = at::empty_like(qc);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::ScalarType::BFloat16, at::ScalarType::Half, q.scalar_type(), "paged_decode_attention", [&] {
    decode_attention_impl<scalar_t>(qc.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
                                    tables.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), out.data_ptr<scalar_t>(),
                                    B, Hq, Hkv, D, BS, tables.size(1), static_cast<float>(scale));
  });
  return out;
}

}  // namespace pagoda

TORCH_LIBRARY(pagoda, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq_lens, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagoda, CPU, m) {
  m.impl("paged_decode_attention", &pagoda::paged_decode_attention);
}
