// Paged attention on the CPU for rows that each attend over a prefix of their sequence: decode
// tokens, and (the runner's "decode-like" layout) every token of a prefill chunk, row j of a
// chunk starting at position s seeing s + j + 1 positions, its K/V already in the cache.
// With a sliding window W > 0 (Gemma 3's local layers, Mistral), a row of length L sees only its
// last min(L, W) positions: blocks wholly before the window are never read, and the softmax and
// the weighted sum run over the window alone.
//
// Reads each sequence's K/V straight from the block pool through its block table: no gather
// copy, no padding to the longest sequence. One work item per (tile of up to 8 consecutive rows
// of one sequence, kv head) handles the whole GQA group of query heads that share that kv head.
// Softmax in fp32. A row's result does not depend on the batch (see TILE below).
// Registered as torch.ops.pagoda.paged_decode_attention (no pybind11: it compiles faster).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "ops.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <type_traits>
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
  int64_t t = 0;
#ifdef PAGODA_AVX2
  {  // the max is exact in any order: 8 lanes at a time
    __m256 mv = _mm256_set1_ps(m);
    for (; t + 8 <= L; t += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(s + t));
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, mv);
    for (float lane : lanes) m = std::max(m, lane);
  }
#endif
  for (; t < L; ++t) m = std::max(m, s[t]);
  float sum = 0.f;
  t = 0;
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

// Rows of the batch that belong to one sequence's chunk (consecutive rows with the same block
// table, each seeing one position more than the one before) are attended together, TILE rows at a
// time, so that each block of keys and values is read once for the whole tile. Tiling changes
// only which sums are computed together, never how one is: for a query row,
//   score[t] = q . k_t   a multiply-add chain over d = 0..D-1 (lanes hold keys, not d),
//   softmax  over its own L scores (the order depends on L only),
//   out[d]   = sum_t p[t] * v_t[d]   a multiply-add chain over t = 0..L-1 (lanes hold d),
// so a token's attention output is the same whether it is a decode, one row of a prefill chunk,
// or the tail of a prompt after a prefix-cache hit, and whatever else is in the batch.
constexpr int64_t TILE = 16;

struct Item {
  int64_t row, rows, h;  // rows row .. row + rows - 1 of the batch, kv head h
  int64_t cost;          // positions its rows read (for ordering the queue)
};

// The first position row length `len` sees (0 without a window).
inline int64_t window_start(int64_t len, int64_t window) { return window > 0 ? std::max<int64_t>(0, len - window) : 0; }

#ifdef PAGODA_AVX2
// scores for NQ query vectors against the 8 keys of kt (kt[d * ldk + lane]), each a fma chain over d.
template <int NQ>
inline void score8(const float* q, int64_t D, const float* kt, int64_t ldk, float* out, int64_t ldo) {
  __m256 acc[NQ];
  for (int i = 0; i < NQ; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; ++d) {
    const __m256 kv = _mm256_loadu_ps(kt + d * ldk);
    for (int i = 0; i < NQ; ++i) acc[i] = _mm256_fmadd_ps(_mm256_set1_ps(q[i * D + d]), kv, acc[i]);
  }
  for (int i = 0; i < NQ; ++i) _mm256_storeu_ps(out + i * ldo, acc[i]);
}
#endif

#ifdef __FMA__
inline float madd(float a, float b, float c) { return std::fma(a, b, c); }  // as the vector FMAs round
#else
inline float madd(float a, float b, float c) { return a * b + c; }  // no vector path here either
#endif

#if defined(__AVX512F__)
template <int NQ>
inline void score16(const float* q, int64_t D, const float* kt, int64_t ldk, float* out, int64_t ldo) {
  __m512 acc[NQ];
  for (int i = 0; i < NQ; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; ++d) {
    const __m512 kv = _mm512_loadu_ps(kt + d * ldk);
    for (int i = 0; i < NQ; ++i) acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(q[i * D + d]), kv, acc[i]);
  }
  for (int i = 0; i < NQ; ++i) _mm512_storeu_ps(out + i * ldo, acc[i]);
}
#endif

// scores of NQ query vectors against the LANES keys of kt: the 16- or the 8-lane kernel.
template <int LANES, int NQ>
inline void score_tile(const float* q, int64_t D, const float* kt, int64_t ldk, float* out, int64_t ldo) {
#if defined(__AVX512F__)
  if constexpr (LANES == 16) score16<NQ>(q, D, kt, ldk, out, ldo);
#endif
#ifdef PAGODA_AVX2
  if constexpr (LANES == 8) score8<NQ>(q, D, kt, ldk, out, ldo);
#endif
}

// scores of q[0..nq) against the keys j.. of kt, LANES keys at a time (8 queries a kernel call,
// then the remaining 1-7); returns the first key left over (fewer than LANES remain).
template <int LANES>
inline int64_t score_columns(const float* q, int64_t nq, int64_t D, const float* kt, int64_t ldk, int64_t j,
                             int64_t n, float* out, int64_t ldo) {
  for (; j + LANES <= n; j += LANES) {
    int64_t i = 0;
    for (; i + 8 <= nq; i += 8) score_tile<LANES, 8>(q + i * D, D, kt + j, ldk, out + i * ldo + j, ldo);
    const float* qi = q + i * D;
    float* oi = out + i * ldo + j;
    switch (nq - i) {
      case 7: score_tile<LANES, 7>(qi, D, kt + j, ldk, oi, ldo); break;
      case 6: score_tile<LANES, 6>(qi, D, kt + j, ldk, oi, ldo); break;
      case 5: score_tile<LANES, 5>(qi, D, kt + j, ldk, oi, ldo); break;
      case 4: score_tile<LANES, 4>(qi, D, kt + j, ldk, oi, ldo); break;
      case 3: score_tile<LANES, 3>(qi, D, kt + j, ldk, oi, ldo); break;
      case 2: score_tile<LANES, 2>(qi, D, kt + j, ldk, oi, ldo); break;
      case 1: score_tile<LANES, 1>(qi, D, kt + j, ldk, oi, ldo); break;
      default: break;
    }
  }
  return j;
}

// scores of query vectors q[0..nq) (rows of D) against n keys kt (transposed: kt[d * ldk + j])
inline void scores_block(const float* q, int64_t nq, int64_t D, const float* kt, int64_t ldk, int64_t n,
                         float* out, int64_t ldo) {
  int64_t j = 0;
#if defined(__AVX512F__)
  j = score_columns<16>(q, nq, D, kt, ldk, j, n, out, ldo);
#endif
#ifdef PAGODA_AVX2
  j = score_columns<8>(q, nq, D, kt, ldk, j, n, out, ldo);
#endif
  for (; j < n; ++j)
    for (int64_t i = 0; i < nq; ++i) {
      float s = 0.f;
      for (int64_t d = 0; d < D; ++d) s = madd(q[i * D + d], kt[d * ldk + j], s);
      out[i * ldo + j] = s;
    }
}

// acc_i[0..D) += p_i[t] * v[t][0..D) for t = 0..n-1 in order (a fma per element), for NV query
// vectors i (acc_i = acc + i * D, p_i = p + i * ldp) that share the values: each value vector is
// loaded once for all of them, and their independent chains keep the FMA units busy.
template <int NV>
inline void accumulate_block(float* acc, const float* p, int64_t ldp, const float* v, int64_t n, int64_t D) {
  int64_t d = 0;
#if defined(__AVX512F__)
  for (; d + 64 <= D; d += 64) {
    __m512 a[NV][4];
    for (int i = 0; i < NV; ++i)
      for (int c = 0; c < 4; ++c) a[i][c] = _mm512_loadu_ps(acc + i * D + d + 16 * c);
    for (int64_t t = 0; t < n; ++t) {
      const float* vt = v + t * D + d;
      const __m512 v0 = _mm512_loadu_ps(vt), v1 = _mm512_loadu_ps(vt + 16);
      const __m512 v2 = _mm512_loadu_ps(vt + 32), v3 = _mm512_loadu_ps(vt + 48);
      for (int i = 0; i < NV; ++i) {
        const __m512 pv = _mm512_set1_ps(p[i * ldp + t]);
        a[i][0] = _mm512_fmadd_ps(pv, v0, a[i][0]);
        a[i][1] = _mm512_fmadd_ps(pv, v1, a[i][1]);
        a[i][2] = _mm512_fmadd_ps(pv, v2, a[i][2]);
        a[i][3] = _mm512_fmadd_ps(pv, v3, a[i][3]);
      }
    }
    for (int i = 0; i < NV; ++i)
      for (int c = 0; c < 4; ++c) _mm512_storeu_ps(acc + i * D + d + 16 * c, a[i][c]);
  }
#endif
#ifdef PAGODA_AVX2
  for (; d + 16 <= D; d += 16) {
    __m256 a[NV][2];
    for (int i = 0; i < NV; ++i)
      for (int c = 0; c < 2; ++c) a[i][c] = _mm256_loadu_ps(acc + i * D + d + 8 * c);
    for (int64_t t = 0; t < n; ++t) {
      const __m256 v0 = _mm256_loadu_ps(v + t * D + d), v1 = _mm256_loadu_ps(v + t * D + d + 8);
      for (int i = 0; i < NV; ++i) {
        const __m256 pv = _mm256_set1_ps(p[i * ldp + t]);
        a[i][0] = _mm256_fmadd_ps(pv, v0, a[i][0]);
        a[i][1] = _mm256_fmadd_ps(pv, v1, a[i][1]);
      }
    }
    for (int i = 0; i < NV; ++i)
      for (int c = 0; c < 2; ++c) _mm256_storeu_ps(acc + i * D + d + 8 * c, a[i][c]);
  }
  for (; d + 8 <= D; d += 8)
    for (int i = 0; i < NV; ++i) {
      __m256 a = _mm256_loadu_ps(acc + i * D + d);
      for (int64_t t = 0; t < n; ++t) a = _mm256_fmadd_ps(_mm256_set1_ps(p[i * ldp + t]), _mm256_loadu_ps(v + t * D + d), a);
      _mm256_storeu_ps(acc + i * D + d, a);
    }
#endif
  for (; d < D; ++d)
    for (int i = 0; i < NV; ++i) {
      float a = acc[i * D + d];
      for (int64_t t = 0; t < n; ++t) a = madd(p[i * ldp + t], v[t * D + d], a);
      acc[i * D + d] = a;
    }
}

// accumulate_block for any number of vectors, up to 4 at a time
inline void accumulate_vectors(int64_t nv, float* acc, const float* p, int64_t ldp, const float* v, int64_t n, int64_t D) {
  for (; nv >= 4; nv -= 4, acc += 4 * D, p += 4 * ldp) accumulate_block<4>(acc, p, ldp, v, n, D);
  switch (nv) {
    case 3: accumulate_block<3>(acc, p, ldp, v, n, D); break;
    case 2: accumulate_block<2>(acc, p, ldp, v, n, D); break;
    case 1: accumulate_block<1>(acc, p, ldp, v, n, D); break;
    default: break;
  }
}

#ifdef PAGODA_AVX2
// dst[c * ldd + r] = src[r * lds + c] for an 8 x 8 block
inline void transpose8x8(const float* src, int64_t lds, float* dst, int64_t ldd) {
  __m256 r[8], t[8];
  for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(src + i * lds);
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    r[i] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int i = 0; i < 4; ++i) {
    _mm256_storeu_ps(dst + i * ldd, _mm256_permute2f128_ps(r[i], r[i + 4], 0x20));
    _mm256_storeu_ps(dst + (i + 4) * ldd, _mm256_permute2f128_ps(r[i], r[i + 4], 0x31));
  }
}
#endif

// kt[d * ldk + j] = k[j][d] as float, for keys j < n (copies: no arithmetic)
template <typename scalar_t>
inline void transpose(const scalar_t* k, int64_t n, int64_t D, float* kt, int64_t ldk) {
  int64_t j0 = 0;
#ifdef PAGODA_AVX2
  if constexpr (std::is_same_v<scalar_t, float>) {
    if (D % 8 == 0)
      for (; j0 + 8 <= n; j0 += 8)
        for (int64_t d = 0; d < D; d += 8) transpose8x8(k + j0 * D + d, D, kt + d * ldk + j0, ldk);
  }
#endif
  for (int64_t j = j0; j < n; ++j)
    for (int64_t d = 0; d < D; ++d) kt[d * ldk + j] = static_cast<float>(k[j * D + d]);
}

// dst[i] = src[i] as float, for a block of a bf16 / fp16 cache (--kv-cache-dtype): bf16 is the
// high half of a float (a shift), fp16 widens with F16C; exact either way.
template <typename cache_t>
inline void widen(const cache_t* src, float* dst, int64_t n) {
  int64_t i = 0;
#ifdef PAGODA_AVX2
  if constexpr (std::is_same_v<cache_t, c10::BFloat16>) {
    for (; i + 8 <= n; i += 8) {
      const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i)));
      _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
    }
  }
#ifdef __F16C__
  if constexpr (std::is_same_v<cache_t, c10::Half>) {
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
  }
#endif
#endif
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// dst[j * D + d] = src[j * D + d] * scales[j]: a block of an int8 cache, one scale per token
// (of this head), as write_kv_cache quantized it.
inline void widen_scaled(const int8_t* src, const float* scales, float* dst, int64_t n, int64_t D) {
  for (int64_t j = 0; j < n; ++j) {
    const int8_t* row = src + j * D;
    float* out = dst + j * D;
    int64_t d = 0;
#ifdef PAGODA_AVX2
    const __m256 s = _mm256_set1_ps(scales[j]);
    for (; d + 8 <= D; d += 8) {
      const __m256i w = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + d)));
      _mm256_storeu_ps(out + d, _mm256_mul_ps(_mm256_cvtepi32_ps(w), s));
    }
#endif
    for (; d < D; ++d) out[d] = static_cast<float>(row[d]) * scales[j];
  }
}

// Rows of the batch → work items: runs of rows of one sequence cut into tiles, times kv heads,
// longest first (a queue that threads pull from, so a long prompt's last tiles do not end up on
// one thread).
std::vector<Item> plan(const int64_t* tables, const int64_t* lens, int64_t B, int64_t max_blocks, int64_t Hkv,
                       int64_t window) {
  std::vector<Item> items;
  for (int64_t b = 0; b < B;) {
    int64_t e = b + 1;
    while (e < B && e - b < TILE && lens[e] == lens[e - 1] + 1 &&
           std::equal(tables + e * max_blocks, tables + (e + 1) * max_blocks, tables + b * max_blocks))
      ++e;
    const int64_t cost = lens[e - 1] - window_start(lens[b], window);
    for (int64_t h = 0; h < Hkv; ++h) items.push_back({b, e - b, h, cost});
    b = e;
  }
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });
  return items;
}

// scalar_t: the queries' and the output's type; cache_t: the KV cache's (--kv-cache-dtype), which
// may be narrower: keys and values are widened to float as they are read, so the arithmetic is the
// same as over a float cache holding the same (rounded) values.
// An int8 cache (cache_t int8_t) comes with k_scales / v_scales [num_blocks, Hkv, BS]: one float
// per token and head, by which its values are multiplied as they are widened.
template <typename scalar_t, typename cache_t>
void decode_attention_impl(const scalar_t* __restrict__ q, const cache_t* __restrict__ k_cache,
                           const cache_t* __restrict__ v_cache, const int64_t* __restrict__ tables,
                           const int64_t* __restrict__ lens, scalar_t* __restrict__ out,
                           int64_t B, int64_t Hq, int64_t Hkv, int64_t D, int64_t BS,
                           int64_t max_blocks, float scale, int64_t window,
                           const float* k_scales = nullptr, const float* v_scales = nullptr) {
  const int64_t G = Hq / Hkv;
  // Cache layout [num_blocks, Hkv, BS, D]: one head's tokens of a block are contiguous rows.
  const int64_t head_stride = BS * D;
  const int64_t block_stride = Hkv * head_stride;
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(lens[b] >= 1 && lens[b] <= max_blocks * BS, "paged_decode_attention: bad seq_len ", lens[b]);
  const std::vector<Item> items = plan(tables, lens, B, max_blocks, Hkv, window);
  std::atomic<int64_t> next{0};
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), items.size()));
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    const int64_t NQ = TILE * G;
    std::vector<float> qf(NQ * D), acc(NQ * D), kt(D * BS), vf(BS * D), scores;
    for (int64_t it = next++; it < static_cast<int64_t>(items.size()); it = next++) {
      const Item& item = items[it];
      const int64_t h = item.h, nq = item.rows * G, Lmax = lens[item.row + item.rows - 1];
      // Positions before `base` (whole blocks before the first row's window) are never read;
      // a row of scores holds positions base .. Lmax - 1, padded to whole blocks.
      const int64_t base = window_start(lens[item.row], window) / BS * BS;
      const int64_t ld = (Lmax - base + BS - 1) / BS * BS;
      const int64_t* table = tables + item.row * max_blocks;
      scores.resize(nq * ld);
      float* sc = scores.data();
      for (int64_t r = 0; r < item.rows; ++r)
        for (int64_t g = 0; g < G; ++g)
          for (int64_t d = 0; d < D; ++d)
            qf[(r * G + g) * D + d] = static_cast<float>(q[((item.row + r) * Hq + h * G + g) * D + d]) * scale;
      // scores: a block of keys transposed once, against every query of the tile that sees it
      for (int64_t t0 = base; t0 < Lmax; t0 += BS) {
        const cache_t* kb = k_cache + table[t0 / BS] * block_stride + h * head_stride;
        const int64_t n = std::min(BS, Lmax - t0);
        if constexpr (std::is_same_v<cache_t, float>) {
          transpose(kb, n, D, kt.data(), BS);
        } else {  // widened first, so the float transpose's vector path serves
          if constexpr (std::is_same_v<cache_t, int8_t>)
            widen_scaled(kb, k_scales + (table[t0 / BS] * Hkv + h) * BS, vf.data(), n, D);
          else
            widen(kb, vf.data(), n * D);
          transpose(vf.data(), n, D, kt.data(), BS);
        }
        int64_t r0 = 0;  // rows before r0 end before this block
        while (lens[item.row + r0] <= t0) ++r0;
        scores_block(qf.data() + r0 * G * D, nq - r0 * G, D, kt.data(), BS, n, sc + r0 * G * ld + (t0 - base), ld);
      }
      // softmax over each row's own window; the positions of its tile before that weigh exactly 0
      for (int64_t r = 0; r < item.rows; ++r) {
        const int64_t len = lens[item.row + r], first = window_start(len, window) - base;
        for (int64_t g = 0; g < G; ++g) {
          float* row_scores = sc + (r * G + g) * ld;
          std::fill(row_scores, row_scores + first, 0.f);
          softmax(row_scores + first, len - base - first);
        }
      }
      // out: each query's values, a block at a time
      std::fill(acc.begin(), acc.begin() + nq * D, 0.f);
      for (int64_t t0 = base; t0 < Lmax; t0 += BS) {
        const cache_t* vb = v_cache + table[t0 / BS] * block_stride + h * head_stride;
        const int64_t n = std::min(BS, Lmax - t0);
        const float* v = vf.data();
        if constexpr (std::is_same_v<cache_t, float>) {
          v = vb;
        } else if constexpr (std::is_same_v<cache_t, int8_t>) {
          widen_scaled(vb, v_scales + (table[t0 / BS] * Hkv + h) * BS, vf.data(), n, D);
        } else {
          widen(vb, vf.data(), n * D);
        }
        // rows that see all n keys of this block together, then the one or two that see fewer
        int64_t r = 0;
        while (r < item.rows && lens[item.row + r] - t0 <= 0) ++r;
        int64_t full = r;
        while (full < item.rows && lens[item.row + full] - t0 < n) ++full;
        for (; r < full; ++r)
          accumulate_vectors(G, acc.data() + r * G * D, sc + r * G * ld + (t0 - base), ld, v, lens[item.row + r] - t0, D);
        if (full < item.rows)
          accumulate_vectors((item.rows - full) * G, acc.data() + full * G * D, sc + full * G * ld + (t0 - base), ld, v,
                             n, D);
      }
      for (int64_t r = 0; r < item.rows; ++r)
        for (int64_t g = 0; g < G; ++g)
          for (int64_t d = 0; d < D; ++d)
            out[((item.row + r) * Hq + h * G + g) * D + d] = static_cast<scalar_t>(acc[(r * G + g) * D + d]);
    }
  });
}

}  // namespace

namespace pagoda {

// q: [B, Hq, D]; k_cache, v_cache: [num_blocks, Hkv, block_size, D]; block_tables: [B, max_blocks]
// int64; seq_lens: [B] int64 (tokens to attend, the query's own included); window: a sliding
// window (each row sees its last `window` positions), 0 for none. The cache may be float32,
// bfloat16 or float16 whatever the queries' type. Returns [B, Hq, D] in the queries' type.
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                                  int64_t window, const std::optional<at::Tensor>& k_scales,
                                  const std::optional<at::Tensor>& v_scales) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.dim() == 4, "bad ranks");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "the KV cache must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong, "int64 tables");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "k and v caches differ in dtype");
  auto qc = q.contiguous();
  auto tables = block_tables.contiguous();
  auto lens = seq_lens.contiguous();
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t Hkv = k_cache.size(1), BS = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D && Hq % Hkv == 0, "head shapes do not match");
  TORCH_CHECK(window >= 0, "paged_decode_attention: bad window ", window);
  auto out = at::empty_like(qc);
  if (k_cache.scalar_type() == at::kChar) {
    TORCH_CHECK(k_scales && v_scales && k_scales->scalar_type() == at::kFloat && v_scales->scalar_type() == at::kFloat &&
                    k_scales->is_contiguous() && v_scales->is_contiguous() && k_scales->numel() == k_cache.numel() / D,
                "an int8 KV cache needs its float scales [num_blocks, kv_heads, block_size]");
    AT_DISPATCH_FLOATING_TYPES_AND2(at::ScalarType::BFloat16, at::ScalarType::Half, q.scalar_type(), "paged_decode_attention", [&] {
      decode_attention_impl<scalar_t, int8_t>(qc.data_ptr<scalar_t>(), k_cache.data_ptr<int8_t>(), v_cache.data_ptr<int8_t>(),
                                              tables.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), out.data_ptr<scalar_t>(),
                                              B, Hq, Hkv, D, BS, tables.size(1), static_cast<float>(scale), window,
                                              k_scales->data_ptr<float>(), v_scales->data_ptr<float>());
    });
    return out;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::ScalarType::BFloat16, at::ScalarType::Half, q.scalar_type(), "paged_decode_attention", [&] {
    using q_t = scalar_t;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::ScalarType::BFloat16, at::ScalarType::Half, k_cache.scalar_type(),
                                    "paged_decode_attention_cache", [&] {
      decode_attention_impl<q_t, scalar_t>(qc.data_ptr<q_t>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
                                           tables.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), out.data_ptr<q_t>(),
                                           B, Hq, Hkv, D, BS, tables.size(1), static_cast<float>(scale), window);
    });
  });
  return out;
}

}  // namespace pagoda

TORCH_LIBRARY(pagoda, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq_lens, float scale, int window=0, Tensor? k_scales=None, Tensor? v_scales=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagoda, CPU, m) {
  m.impl("paged_decode_attention", &pagoda::paged_decode_attention);
}
