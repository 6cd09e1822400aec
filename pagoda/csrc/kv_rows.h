// One kv head's keys or values of one cache block, widened to float as they are loaded (Rows),
// found and prefetched through the pool (BlockReader), and a block of keys transposed into a
// float tile (transpose); where a sliding window starts (window_start). Shared by the paged
// decode kernel (paged_attention.cpp) and the flash-style prefill kernel (prefill_attention.cpp).
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "kv_codes.h"
#include "vec_math.h"

namespace pagoda {

// One kv head's rows (keys or values) of one block, read in the cache's own type and widened to
// float as they are loaded: bf16 is the high half of a float (a shift), fp16 widens with F16C, an
// int8 or fp8 row's codes are widened and multiplied by its token's scale (kv_codes.h, as
// write_kv_cache encoded them). Exact but for that one multiplication, so the arithmetic is the
// same as over a float cache holding the same values; widening in registers spares a narrow cache
// a pass through a float buffer.
template <typename cache_t>
struct Rows {
  const cache_t* p;      // row t at p + t * D
  const float* scales;   // a scaled cache's (int8, fp8), one per row; else nullptr
  int64_t D;

  float at(int64_t t, int64_t d) const {
    if constexpr (pagoda::is_scaled_code_v<cache_t>) return static_cast<float>(p[t * D + d]) * scales[t];
    else return static_cast<float>(p[t * D + d]);
  }
#ifdef PAGODA_AVX2
  __m256 load8(int64_t t, int64_t d) const {
    const cache_t* src = p + t * D + d;
    if constexpr (std::is_same_v<cache_t, float>) {
      return _mm256_loadu_ps(src);
    } else if constexpr (pagoda::is_scaled_code_v<cache_t>) {
      return pagoda::widen8(src, scales[t]);
    } else if constexpr (std::is_same_v<cache_t, c10::BFloat16>) {
      const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
      return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
    } else if constexpr (std::is_same_v<cache_t, c10::Half>) {
      return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
    } else {  // another type (a double model's cache): one element at a time
      alignas(32) float lanes[8];
      for (int i = 0; i < 8; ++i) lanes[i] = at(t, d + i);
      return _mm256_load_ps(lanes);
    }
  }
#endif
#if defined(__AVX512F__)
  __m512 load16(int64_t t, int64_t d) const {
    const cache_t* src = p + t * D + d;
    if constexpr (std::is_same_v<cache_t, float>) {
      return _mm512_loadu_ps(src);
    } else if constexpr (pagoda::is_scaled_code_v<cache_t>) {
      return pagoda::widen16(src, scales[t]);
    } else if constexpr (std::is_same_v<cache_t, c10::BFloat16>) {
      const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
      return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
    } else if constexpr (std::is_same_v<cache_t, c10::Half>) {
      return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
    } else {
      alignas(64) float lanes[16];
      for (int i = 0; i < 16; ++i) lanes[i] = at(t, d + i);
      return _mm512_load_ps(lanes);
    }
  }
#endif
};

#ifdef PAGODA_AVX2
// dst[c * ldd + r] = row j0 + r, column d0 + c of `rows`, for an 8 x 8 block
template <typename cache_t>
inline void transpose8x8(const Rows<cache_t>& rows, int64_t j0, int64_t d0, float* dst, int64_t ldd) {
  __m256 r[8], t[8];
  for (int i = 0; i < 8; ++i) r[i] = rows.load8(j0 + i, d0);
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

// kt[d * ldk + j] = k[j][d] as float, for keys j < n
template <typename cache_t>
inline void transpose(const Rows<cache_t>& k, int64_t n, int64_t D, float* kt, int64_t ldk) {
  int64_t j0 = 0;
#ifdef PAGODA_AVX2
  if (D % 8 == 0)
    for (; j0 + 8 <= n; j0 += 8)
      for (int64_t d = 0; d < D; d += 8) transpose8x8(k, j0, d, kt + d * ldk + j0, ldk);
#endif
  for (int64_t j = j0; j < n; ++j)
    for (int64_t d = 0; d < D; ++d) kt[d * ldk + j] = k.at(j, d);
}

// The first position row length `len` sees (0 without a window).
inline int64_t window_start(int64_t len, int64_t window) { return window > 0 ? std::max<int64_t>(0, len - window) : 0; }

// Blocks of keys or values asked for ahead of their use.
constexpr int64_t PREFETCH_AHEAD = 2;

// One kv head's keys or values of one block of the pool.
template <typename cache_t>
struct BlockReader {
  const cache_t* cache;
  const float* scales;  // a scaled cache's (int8, fp8), else nullptr
  int64_t Hkv, BS, D;

  // Its rows from the block's row `from` on.
  Rows<cache_t> rows(int64_t block, int64_t h, int64_t from = 0) const {
    const int64_t first = (block * Hkv + h) * BS + from;
    return {cache + first * D, scales != nullptr ? scales + first : nullptr, D};
  }

  // Ask for a block's rows ahead of use: blocks lie anywhere in the pool, and the hardware
  // prefetcher does not cross into the next one, so each would otherwise start with a DRAM wait.
  void prefetch(int64_t block, int64_t h, int64_t n) const {
#ifdef PAGODA_AVX2
    const char* src = reinterpret_cast<const char*>(cache + (block * Hkv + h) * BS * D);
    const int64_t bytes = n * D * static_cast<int64_t>(sizeof(cache_t));
    for (int64_t at = 0; at < bytes; at += 64) _mm_prefetch(src + at, _MM_HINT_T0);
    if (scales != nullptr) _mm_prefetch(reinterpret_cast<const char*>(scales + (block * Hkv + h) * BS), _MM_HINT_T0);
#else
    (void)block, (void)h, (void)n;
#endif
  }

  // Before the block at position t0 of a chain ending at Lmax: the block PREFETCH_AHEAD blocks on
  // (and, at the chain's first, the ones before that too), for kv head h.
  void prefetch_ahead(const int64_t* table, int64_t h, int64_t t0, int64_t Lmax, bool first) const {
    for (int64_t a = first ? 0 : PREFETCH_AHEAD; a <= PREFETCH_AHEAD; ++a) {
      const int64_t at = t0 + a * BS;
      if (at < Lmax) prefetch(table[at / BS], h, std::min(BS, Lmax - at));
    }
  }
};

}  // namespace pagoda
