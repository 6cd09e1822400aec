// A long prefill chunk's attention, flash-style, reading its sequence's keys and values from the
// paged cache in place (the chunk's own K/V are written there first).
//
// Why: a prefill chunk longer than --short-chunk-tokens used to run torch's SDPA, after gathering
// a cached prefix into contiguous tensors. SDPA reached ~50-60 % of two AVX2 cores' FMA peak
// (45-115 GFLOP/s at 512-8,192 tokens), and the paged decode kernel, which scores one query row
// at a time, is slower still at that length. Here the rows of one kv head's GQA group and a tile
// of positions (ROWS_TARGET rows) meet KEY_TILE keys at a time as two small GEMMs held in the L1
// and L2 caches -- scores S = Q K^T and sums O += P V -- with a register-blocked micro-kernel
// (6 rows x 16 columns, 12 accumulators) and an online softmax between them (a running maximum
// and sum per row; the sums are rescaled when the maximum grows).
//
// A row's arithmetic depends only on its own position: key tiles start at multiples of KEY_TILE,
// a tile's masked keys add exact zeros, and a row is never split between threads. So a token's
// result is the same whatever chunk, tile or thread computed it. It is not bit-equal to the paged
// decode kernel (other sums), which is why deterministic inference runs every row there.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <vector>

#include "kv_rows.h"
#include "ops.h"

namespace {

using pagoda::BlockReader;
using pagoda::Rows;

// The first position a row at position p sees.
inline int64_t first_visible(int64_t p, int64_t window) { return pagoda::window_start(p + 1, window); }

constexpr int64_t KEY_TILE = 64;     // keys a step: scores are [rows][KEY_TILE]
constexpr int64_t ROWS_TARGET = 96;  // query rows an item (positions x the GQA group): 16 panels of 6
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

// C[m][0..16) (+)= sum_k A[m * lda + k] * B[k * ldb + 0..16) for M (<= 6) rows.
template <int M>
inline void panel16(const float* A, int64_t lda, const float* B, int64_t ldb, int64_t K, float* C, int64_t ldc,
                    bool accumulate) {
#ifdef PAGODA_AVX2
  // Fully unrolled so that the 2 * M accumulators stay in registers (a loop over an array of
  // them made GCC store every one to the stack after each multiply-add).
  __m256 c0[M], c1[M];
#pragma GCC unroll 6
  for (int m = 0; m < M; ++m) {
    c0[m] = accumulate ? _mm256_loadu_ps(C + m * ldc) : _mm256_setzero_ps();
    c1[m] = accumulate ? _mm256_loadu_ps(C + m * ldc + 8) : _mm256_setzero_ps();
  }
  for (int64_t k = 0; k < K; ++k) {
    const __m256 b0 = _mm256_loadu_ps(B + k * ldb), b1 = _mm256_loadu_ps(B + k * ldb + 8);
#pragma GCC unroll 6
    for (int m = 0; m < M; ++m) {
      const __m256 a = _mm256_broadcast_ss(A + m * lda + k);
      c0[m] = _mm256_fmadd_ps(a, b0, c0[m]);
      c1[m] = _mm256_fmadd_ps(a, b1, c1[m]);
    }
  }
#pragma GCC unroll 6
  for (int m = 0; m < M; ++m) {
    _mm256_storeu_ps(C + m * ldc, c0[m]);
    _mm256_storeu_ps(C + m * ldc + 8, c1[m]);
  }
#else
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < 16; ++j) {
      float s = accumulate ? C[m * ldc + j] : 0.f;
      for (int64_t k = 0; k < K; ++k) s += A[m * lda + k] * B[k * ldb + j];
      C[m * ldc + j] = s;
    }
#endif
}

// C[R][N] (+)= A[R][K] . B[K][N], N a multiple of 16: a 16-column panel of B stays in the L1
// cache while every row of A passes it.
inline void gemm(const float* A, int64_t lda, const float* B, int64_t ldb, int64_t K, float* C, int64_t ldc,
                 int64_t R, int64_t N, bool accumulate) {
  for (int64_t j = 0; j < N; j += 16) {
    int64_t r = 0;
    for (; r + 6 <= R; r += 6) panel16<6>(A + r * lda, lda, B + j, ldb, K, C + r * ldc + j, ldc, accumulate);
    const float* a = A + r * lda;
    float* c = C + r * ldc + j;
    switch (R - r) {
      case 5: panel16<5>(a, lda, B + j, ldb, K, c, ldc, accumulate); break;
      case 4: panel16<4>(a, lda, B + j, ldb, K, c, ldc, accumulate); break;
      case 3: panel16<3>(a, lda, B + j, ldb, K, c, ldc, accumulate); break;
      case 2: panel16<2>(a, lda, B + j, ldb, K, c, ldc, accumulate); break;
      case 1: panel16<1>(a, lda, B + j, ldb, K, c, ldc, accumulate); break;
      default: break;
    }
  }
}

// o[0..n) *= a
inline void scale_row(float* o, int64_t n, float a) {
  int64_t d = 0;
#ifdef PAGODA_AVX2
  const __m256 va = _mm256_set1_ps(a);
  for (; d + 8 <= n; d += 8) _mm256_storeu_ps(o + d, _mm256_mul_ps(_mm256_loadu_ps(o + d), va));
#endif
  for (; d < n; ++d) o[d] *= a;
}

struct Shape {
  int64_t Lq, Hq, Hkv, G, D, Dp, BS, start, window;
  float scale;
  const int64_t* table;
};

// One work item: kv head h's GQA group for chunk positions [i0, i1). Row r = (i - i0) * G + g.
struct Item {
  int64_t h, i0, i1;
};

// A thread's tiles, reused across its items. Kt's rows past D and V's columns past D stay zero.
struct Tiles {
  std::vector<float> q, kt, v, s, o, m, l;
  Tiles(int64_t rows, int64_t Dp)
      : q(rows * Dp, 0.f), kt(Dp * KEY_TILE, 0.f), v(KEY_TILE * Dp, 0.f), s(rows * KEY_TILE), o(rows * Dp),
        m(rows), l(rows) {}
};

template <typename scalar_t, typename cache_t>
void attend_item(const Shape& sh, const Item& it, const scalar_t* q, const BlockReader<cache_t>& keys,
                 const BlockReader<cache_t>& values, scalar_t* out, Tiles& t) {
  const int64_t G = sh.G, D = sh.D, Dp = sh.Dp, BS = sh.BS;
  const int64_t R = (it.i1 - it.i0) * G;
  for (int64_t i = it.i0; i < it.i1; ++i)
    for (int64_t g = 0; g < G; ++g) {
      const scalar_t* src = q + (i * sh.Hq + it.h * G + g) * D;
      float* dst = t.q.data() + ((i - it.i0) * G + g) * Dp;
      for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<float>(src[d]) * sh.scale;
    }
  std::fill(t.m.begin(), t.m.begin() + R, NEG_INF);
  std::fill(t.l.begin(), t.l.begin() + R, 0.f);
  std::fill(t.o.begin(), t.o.begin() + R * Dp, 0.f);

  const int64_t p0 = sh.start + it.i0, p1 = sh.start + it.i1 - 1;  // the item's first and last positions
  const int64_t lo = first_visible(p0, sh.window) / KEY_TILE * KEY_TILE;
  for (int64_t k0 = lo; k0 <= p1; k0 += KEY_TILE) {
    const int64_t n = std::min(KEY_TILE, p1 + 1 - k0), cols = (n + 15) / 16 * 16;
    // the next tile's blocks asked for while this one is computed (an item reads its sequence's
    // keys again, from the L3 cache or memory, which the widening loads would otherwise wait for)
    const int64_t next_end = std::min(k0 + 2 * KEY_TILE, p1 + 1);
    for (int64_t pos = k0 + KEY_TILE; pos < next_end; pos += BS - pos % BS)
      for (const BlockReader<cache_t>* reader : {&keys, &values})
        reader->prefetch(sh.table[pos / BS], it.h, std::min(BS, next_end - (pos - pos % BS)));
    // keys transposed into kt[d][j], values widened into v[j][d], a block's stretch at a time
    for (int64_t j = 0; j < n;) {
      const int64_t pos = k0 + j, len = std::min(BS - pos % BS, n - j);
      const int64_t block = sh.table[pos / BS];
      pagoda::transpose(keys.rows(block, it.h, pos % BS), len, D, t.kt.data() + j, KEY_TILE);
      const Rows<cache_t> vr = values.rows(block, it.h, pos % BS);
      for (int64_t a = 0; a < len; ++a) {
        float* dst = t.v.data() + (j + a) * Dp;
        int64_t d = 0;
#ifdef PAGODA_AVX2
        for (; d + 8 <= D; d += 8) _mm256_storeu_ps(dst + d, vr.load8(a, d));
#endif
        for (; d < D; ++d) dst[d] = vr.at(a, d);
      }
      j += len;
    }
    gemm(t.q.data(), Dp, t.kt.data(), KEY_TILE, D, t.s.data(), KEY_TILE, R, cols, false);
    // mask what a row does not see: keys after it, before its window, past the tile's n
    const bool masked = k0 + cols - 1 > p0 || (sh.window > 0 && k0 < first_visible(p1, sh.window));
    for (int64_t r = 0; r < R; ++r) {
      float* s = t.s.data() + r * KEY_TILE;
      if (masked) {
        const int64_t p = sh.start + it.i0 + r / G;
        const int64_t from = std::clamp<int64_t>(first_visible(p, sh.window) - k0, 0, cols);
        const int64_t to = std::clamp<int64_t>(p + 1 - k0, 0, cols);  // also <= n: p <= p1
        std::fill(s, s + from, NEG_INF);
        std::fill(s + std::max(from, to), s + cols, NEG_INF);
      }
      const float m_new = std::max(t.m[r], pagoda::max_of(s, cols));
      if (m_new == NEG_INF) {  // nothing visible yet: adds nothing
        std::fill(s, s + cols, 0.f);
        continue;
      }
      const float alpha = std::exp(t.m[r] - m_new);  // 0 before the first visible key
      t.l[r] = t.l[r] * alpha + pagoda::exp_minus_and_sum<true>(s, cols, m_new);
      if (alpha != 1.f) scale_row(t.o.data() + r * Dp, Dp, alpha);
      t.m[r] = m_new;
    }
    gemm(t.s.data(), KEY_TILE, t.v.data(), Dp, n, t.o.data(), Dp, R, Dp, true);
  }
  for (int64_t i = it.i0; i < it.i1; ++i)
    for (int64_t g = 0; g < G; ++g) {
      const int64_t r = (i - it.i0) * G + g;
      const float inv = 1.f / t.l[r];
      scalar_t* dst = out + (i * sh.Hq + it.h * G + g) * D;
      for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<scalar_t>(t.o[r * Dp + d] * inv);
    }
}

template <typename scalar_t, typename cache_t>
void prefill_attention_impl(const Shape& sh, const scalar_t* q, const cache_t* k_cache, const cache_t* v_cache,
                            const float* k_scales, const float* v_scales, scalar_t* out) {
  const int64_t span = std::max<int64_t>(1, ROWS_TARGET / sh.G);  // positions an item
  std::vector<Item> items;
  // the last positions see the most keys: they go first, and threads pull the rest in turn
  for (int64_t i1 = sh.Lq; i1 > 0; i1 -= span)
    for (int64_t h = 0; h < sh.Hkv; ++h) items.push_back({h, std::max<int64_t>(0, i1 - span), i1});
  std::atomic<int64_t> next{0};
  const int64_t num_items = items.size();
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), num_items));
  const BlockReader<cache_t> keys{k_cache, k_scales, sh.Hkv, sh.BS, sh.D}, values{v_cache, v_scales, sh.Hkv, sh.BS, sh.D};
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    Tiles tiles(span * sh.G, sh.Dp);
    for (int64_t i = next++; i < num_items; i = next++) attend_item(sh, items[i], q, keys, values, out, tiles);
  });
}

}  // namespace

namespace pagoda {

// q: [Lq, Hq, D], the chunk's queries at positions start .. start + Lq - 1 of one sequence whose
// keys and values (these positions' included) are in k_cache / v_cache [num_blocks, Hkv, BS, D]
// through block_table [>= ceil((start + Lq) / BS)] int64. Causal; window > 0: a row sees its last
// `window` positions. Cache dtypes as paged_decode_attention's (int8 / fp8 with their scales).
// Returns [Lq, Hq, D] in the queries' type.
at::Tensor paged_prefill_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                   const at::Tensor& block_table, int64_t start, double scale, int64_t window,
                                   const std::optional<at::Tensor>& k_scales,
                                   const std::optional<at::Tensor>& v_scales) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.dim() == 4, "paged_prefill_attention: bad ranks");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "the KV cache must be contiguous");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "k and v caches differ in dtype");
  TORCH_CHECK(block_table.scalar_type() == at::kLong && block_table.dim() == 1, "block_table: 1-d int64");
  auto qc = q.contiguous();
  auto table = block_table.contiguous();
  const int64_t Lq = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t Hkv = k_cache.size(1), BS = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D && Hq % Hkv == 0, "head shapes do not match");
  TORCH_CHECK(start >= 0 && window >= 0, "paged_prefill_attention: bad start or window");
  TORCH_CHECK(table.numel() * BS >= start + Lq, "paged_prefill_attention: the block table is too short");
  const Shape sh{Lq, Hq, Hkv, Hq / Hkv, D, (D + 15) / 16 * 16, BS, start, window, static_cast<float>(scale),
                 table.data_ptr<int64_t>()};
  auto out = at::empty_like(qc);
  if (Lq == 0) return out;
  if (pagoda::is_scaled_code(k_cache.scalar_type())) {
    pagoda::check_kv_scales(k_scales, v_scales, k_cache, D);
    pagoda::dispatch_scaled_code(k_cache.scalar_type(), "paged_prefill_attention", [&](auto code) {
      using code_t = decltype(code);
      PAGODA_DISPATCH_MODEL_FLOATS(q.scalar_type(),
                                      "paged_prefill_attention", [&] {
        prefill_attention_impl<scalar_t, code_t>(sh, qc.data_ptr<scalar_t>(), k_cache.data_ptr<code_t>(),
                                                 v_cache.data_ptr<code_t>(), k_scales->data_ptr<float>(),
                                                 v_scales->data_ptr<float>(), out.data_ptr<scalar_t>());
      });
    });
    return out;
  }
  PAGODA_DISPATCH_MODEL_FLOATS(q.scalar_type(),
                                  "paged_prefill_attention", [&] {
    using q_t = scalar_t;
    PAGODA_DISPATCH_MODEL_FLOATS(k_cache.scalar_type(),
                                    "paged_prefill_attention_cache", [&] {
      prefill_attention_impl<q_t, scalar_t>(sh, qc.data_ptr<q_t>(), k_cache.data_ptr<scalar_t>(),
                                            v_cache.data_ptr<scalar_t>(), nullptr, nullptr, out.data_ptr<q_t>());
    });
  });
  return out;
}

}  // namespace pagoda

TORCH_LIBRARY_FRAGMENT(pagoda, m) {
  m.def("paged_prefill_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, int start, "
        "float scale, int window=0, Tensor? k_scales=None, Tensor? v_scales=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagoda, CPU, m) { m.impl("paged_prefill_attention", &pagoda::paged_prefill_attention); }
