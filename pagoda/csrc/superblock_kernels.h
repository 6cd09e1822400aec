// The GEMM on super-block tiles (superblock_formats.h): R activation rows against C tiles of 16
// weight rows. Per block of 32 an exact integer dot product of codes and int8 activations (as
// block_gemm_tiles.cpp, llama.cpp's q8_0 activations), then, per output, these float steps in
// this order, on every instruction set (so every path gives the same bits):
//   Q4_K, Q5_K  acc = fma(float(isum), (d * sc) * dx, acc);  acc = fma(-(dmin * mn), sx, acc)
//   Q4_1, Q5_1  the same with sc = mn = 1 and dmin = -m
//   Q6_K        per half of 16: acc = fma(float(isum_h), (d * sc_h) * dx, acc)
//   the others  acc = fma(float(isum), (d * sc) * dx, acc)        (sc = 1 but for IQ4_XS)
// isum is the dot product of the signed values (code - code_offset, IQ4 the table's value) with
// the int8 codes; dx, sx the activation block's scale and scale * sum of codes.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "ggml_blocks.h"
#include "prefetch.h"
#include "superblock_formats.h"

namespace pagoda::superblock {

// The activations as the kernels read them, for rows m .. of a QuantizedActivations.
struct Rows {
  const int8_t* q;     // [R, K]
  const float* dx;     // [R, nb]
  const float* sx;     // [R, nb]
  const int32_t* sum;  // [R, nb]: sum of a block's codes
  const int32_t* low;  // [R, nb]: sum of its first 16 codes (Q6_K's halves; null otherwise)
  int64_t K, nb;
  // The codes again block by block, [nb][M][32] from these rows on (superblock_amx.h's tiles read a
  // block's rows as one run; null where that path does not run) and the stride of its blocks.
  const int8_t* blocked = nullptr;
  int64_t block_stride = 0;

  Rows from(int64_t m) const {  // rows m .. of these
    return {q + m * K, dx + m * nb, sx + m * nb, sum + m * nb, low ? low + m * nb : nullptr, K, nb,
            blocked ? blocked + m * BLOCK : nullptr, block_stride};
  }
};

inline float fp16(const uint8_t* p) { return pagoda::ggml::half_to_float(p); }

// ---- scalar: lane by lane, the reference for the vector paths --------------------------------

template <int64_t T>
void gemm_scalar(const uint8_t* tile, int64_t ns, const Rows& x, int R, float* y, int64_t ldy, int64_t N, int64_t n0) {
  constexpr int64_t SUPER = super_elements(T), REC = record_bytes(T);
  for (int r = 0; r < R; ++r)
    for (int64_t c = 0; c < COLS && n0 + c < N; ++c) {
      float acc = 0.f;
      for (int64_t s = 0; s < ns; ++s) {
        const uint8_t* rec = tile + s * REC;
        const float d = fp16(rec + 2 * c), dmin = has_mins(T) ? fp16(rec + 32 + 2 * c) : 0.f;
        for (int64_t e0 = 0; e0 < SUPER; e0 += BLOCK) {
          const int64_t b = (s * SUPER + e0) / BLOCK;
          const int8_t* q = x.q + r * x.K + b * BLOCK;
          const float dx = x.dx[r * x.nb + b];
          for (int64_t h0 = 0; h0 < BLOCK; h0 += (T == Q6_K ? 16 : BLOCK)) {
            int32_t isum = 0;
            for (int64_t k = h0; k < h0 + (T == Q6_K ? 16 : BLOCK); ++k)
              isum += code_value(T, record_code(rec, T, c, e0 + k)) * q[k];
            const float dsc = d * static_cast<float>(record_scale(rec, T, c, e0 + h0));
            acc = std::fma(static_cast<float>(isum), dsc * dx, acc);
          }
          if (has_mins(T))
            acc = std::fma(-(dmin * static_cast<float>(record_min(rec, T, c, e0))), x.sx[r * x.nb + b], acc);
        }
      }
      y[r * ldy + n0 + c] = acc;
    }
}

#if defined(PAGODA_AVX512_VNNI)
inline __m512i broadcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// A bit-select: m's bits from a, the others from b.
inline __m512i select512(__m512i m, __m512i a, __m512i b) { return _mm512_ternarylogic_epi32(m, a, b, 0xCA); }

// Q6_K's fourth code of each group of 4 (superblock_formats.h): its bits 4-5, 2-3 and 0-1 are the
// top pairs of the three vectors at v.
inline __m512i q6_fourth512(const uint8_t* v) {
  const __m512i a = _mm512_loadu_si512(v), b = _mm512_loadu_si512(v + 64), c = _mm512_loadu_si512(v + 128);
#if defined(__GFNI__)
  // one affine map a byte moves each top pair in place with (row 7 - k of a matrix: output bit k's inputs)
  const __m512i ta = _mm512_gf2p8affine_epi64_epi8(a, _mm512_set1_epi64(0x0000000040800000LL), 0);
  const __m512i tb = _mm512_gf2p8affine_epi64_epi8(b, _mm512_set1_epi64(0x0000408000000000LL), 0);
  const __m512i tc = _mm512_gf2p8affine_epi64_epi8(c, _mm512_set1_epi64(0x4080000000000000LL), 0);
  return _mm512_ternarylogic_epi32(ta, tb, tc, 0xFE);  // ta | tb | tc
#else
  // the pairs side by side at bits 7-2 (16-bit shifts: what moves in from the next byte is masked off)
  __m512i w = select512(_mm512_set1_epi8(static_cast<char>(0xC0)), a, _mm512_srli_epi16(b, 2));
  w = select512(_mm512_set1_epi8(static_cast<char>(0xF0)), w, _mm512_srli_epi16(c, 4));
  return _mm512_and_si512(_mm512_srli_epi16(w, 2), _mm512_set1_epi8(0x3F));
#endif
}

// Vector j's low-nibble codes (elements 4j..) and high-nibble codes (16+4j..) of a block's vectors,
// unsigned as vpdpbusd multiplies them (IQ4: the table's values + 128).
// `high`: the block's 5th-bit vector (Q5_K), loaded once for its 4 j.
template <int64_t T>
inline void codes512(const uint8_t* codes, const __m512i* high, int j, __m512i& lo, __m512i& hi) {
  if constexpr (T == Q8_0) {  // whole bytes, + 128
    lo = _mm512_loadu_si512(codes + 64 * j);
    hi = _mm512_loadu_si512(codes + 256 + 64 * j);
    return;
  }
  if constexpr (T == Q6_K) {  // 6-bit codes
    if (j < 3) {
      const __m512i six = _mm512_set1_epi8(0x3F);
      lo = _mm512_and_si512(_mm512_loadu_si512(codes + 64 * j), six);
      hi = _mm512_and_si512(_mm512_loadu_si512(codes + 192 + 64 * j), six);
    } else {
      lo = q6_fourth512(codes);
      hi = q6_fourth512(codes + 192);
    }
    return;
  }
  const __m512i low = _mm512_set1_epi8(0x0F);
  const __m512i z = _mm512_loadu_si512(codes + 64 * j);
  lo = _mm512_and_si512(z, low);
  hi = _mm512_and_si512(_mm512_srli_epi16(z, 4), low);
  if constexpr (has_fifth_bit(T)) {
    const __m512i bits = high[0], five = _mm512_set1_epi8(0x10);
    lo = _mm512_or_si512(lo, _mm512_and_si512(_mm512_slli_epi16(bits, 4 - j), five));
    hi = _mm512_or_si512(hi, _mm512_and_si512(_mm512_srli_epi16(bits, j), five));
  } else if constexpr (is_iq4(T)) {
    alignas(16) uint8_t table[16];
    for (int i = 0; i < 16; ++i) table[i] = static_cast<uint8_t>(kIQ4Values[i] + 128);
    const __m512i values = _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(table)));
    lo = _mm512_shuffle_epi8(values, lo);
    hi = _mm512_shuffle_epi8(values, hi);
  }
}

inline __m512 bytes_to_ps(const uint8_t* p, bool is_signed) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm512_cvtepi32_ps(is_signed ? _mm512_cvtepi8_epi32(v) : _mm512_cvtepu8_epi32(v));
}

// A block's per-output scales (Q6_K: one per half of 16) and minimums, d and dmin applied.
template <int64_t T>
inline void block_scales(const uint8_t* rec, __m512 d, __m512 dmin, int64_t sub, __m512* scale, __m512& mins) {
  if constexpr (T == Q6_K) {
    scale[0] = _mm512_mul_ps(d, bytes_to_ps(rec + 32 + 16 * (2 * sub), true));
    scale[1] = _mm512_mul_ps(d, bytes_to_ps(rec + 32 + 16 * (2 * sub + 1), true));
  } else if constexpr (has_min_bytes(T)) {
    scale[0] = _mm512_mul_ps(d, bytes_to_ps(rec + 64 + 16 * sub, false));
    mins = _mm512_mul_ps(dmin, bytes_to_ps(rec + 192 + 16 * sub, false));
  } else if constexpr (T == IQ4_XS) {
    scale[0] = _mm512_mul_ps(d, bytes_to_ps(rec + 32 + 16 * sub, true));
  } else {
    scale[0] = _mm512_mul_ps(d, _mm512_set1_ps(1.f));
    if constexpr (has_mins(T)) mins = _mm512_mul_ps(dmin, _mm512_set1_ps(1.f));
  }
}

// The float steps of block b for activation row r against 16 outputs, from the integer sums of the
// unsigned codes (Q6_K: one a half), in the order the header gives: every path's bits.
template <int64_t T>
inline __m512 finish_block(__m512 acc, const __m512i* isum, const __m512* scale, __m512 mins, const Rows& x, int r,
                           int64_t b) {
  const __m512 dx = _mm512_set1_ps(x.dx[r * x.nb + b]);
  const int32_t total = x.sum[r * x.nb + b];
  if constexpr (T == Q6_K) {
    const int32_t low = x.low[r * x.nb + b];
    const __m512i a = _mm512_sub_epi32(isum[0], _mm512_set1_epi32(32 * low));
    const __m512i z = _mm512_sub_epi32(isum[1], _mm512_set1_epi32(32 * (total - low)));
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a), _mm512_mul_ps(scale[0], dx), acc);
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(z), _mm512_mul_ps(scale[1], dx), acc);
  } else {
    __m512i i = isum[0];
    if constexpr (is_iq4(T)) i = _mm512_sub_epi32(i, _mm512_set1_epi32(128 * total));
    if constexpr (code_offset(T) != 0) i = _mm512_sub_epi32(i, _mm512_set1_epi32(code_offset(T) * total));
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i), _mm512_mul_ps(scale[0], dx), acc);
    if constexpr (has_mins(T)) acc = _mm512_fnmadd_ps(mins, _mm512_set1_ps(x.sx[r * x.nb + b]), acc);
    return acc;
  }
}

// 16 outputs from column n on (the last tile's may run past N: those are not written).
inline void store_outputs(__m512 acc, float* y, int64_t N, int64_t n) {
  if (n + COLS <= N) _mm512_storeu_ps(y + n, acc);
  else if (n < N) _mm512_mask_storeu_ps(y + n, static_cast<__mmask16>((1u << (N - n)) - 1), acc);
}

// Asks L2 for the part of each tile's stream that block `sub` of super-block s reads, PREFETCH_AHEAD
// bytes on (prefetch.h); past a tile's end, in the same tile of the next group (C tiles on): the
// next tile is already being read.
template <int64_t T, int C>
inline void prefetch_ahead(const uint8_t* tiles, int64_t tile_bytes, int64_t s, int64_t sub) {
  constexpr int64_t SHARE = record_bytes(T) / blocks_per_super(T);
  const int64_t at = stream_ahead(s * record_bytes(T) + sub * SHARE + PREFETCH_AHEAD, tile_bytes, C * tile_bytes);
  for (int c = 0; c < C; ++c) prefetch_l2(tiles + c * tile_bytes + at, SHARE);
}

template <int64_t T, int R, int C>
void gemm_avx512(const uint8_t* tiles, int64_t tile_bytes, int64_t ns, const Rows& x, float* y, int64_t ldy,
                 int64_t N, int64_t n0) {
  constexpr int64_t BLOCKS = blocks_per_super(T), SB = scale_bytes(T), CB = block_code_bytes(T), REC = record_bytes(T);
  constexpr int H = T == Q6_K ? 2 : 1;  // integer sums per block (Q6_K: one per 16 elements)
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t s = 0; s < ns; ++s) {
    const uint8_t* rec[C];
    __m512 d[C], dmin[C];
    for (int c = 0; c < C; ++c) {
      rec[c] = tiles + c * tile_bytes + s * REC;
      d[c] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec[c])));
      if constexpr (has_mins(T)) dmin[c] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec[c] + 32)));
    }
    for (int64_t sub = 0; sub < BLOCKS; ++sub) {
      const int64_t b = s * BLOCKS + sub;
      prefetch_ahead<T, C>(tiles, tile_bytes, s, sub);
      __m512i isum[R][C][H];
      for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c)
          for (int h = 0; h < H; ++h) isum[r][c][h] = _mm512_setzero_si512();
      __m512i high[C][1];
      for (int c = 0; c < C; ++c)
        for (int v = 0; v < high_vectors(T); ++v) high[c][v] = _mm512_loadu_si512(rec[c] + SB + sub * CB + 256 + 64 * v);
#pragma GCC unroll 4  // (left to itself GCC kept Q6_K's loop, and copied its sums between registers)
      for (int j = 0; j < 4; ++j) {
        __m512i lo[C], hi[C];
        for (int c = 0; c < C; ++c) codes512<T>(rec[c] + SB + sub * CB, high[c], j, lo[c], hi[c]);
        for (int r = 0; r < R; ++r) {
          const int8_t* q = x.q + r * x.K + b * BLOCK;
          const __m512i xl = broadcast4(q + 4 * j), xh = broadcast4(q + 16 + 4 * j);
          for (int c = 0; c < C; ++c) {
            isum[r][c][0] = _mm512_dpbusd_epi32(isum[r][c][0], lo[c], xl);
            isum[r][c][H - 1] = _mm512_dpbusd_epi32(isum[r][c][H - 1], hi[c], xh);
          }
        }
      }
      __m512 scale[C][H], mins[C];
      for (int c = 0; c < C; ++c) block_scales<T>(rec[c], d[c], dmin[c], sub, scale[c], mins[c]);
      for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) acc[r][c] = finish_block<T>(acc[r][c], isum[r][c], scale[c], mins[c], x, r, b);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) store_outputs(acc[r][c], y + r * ldy, N, n0 + c * COLS);
}
#endif  // PAGODA_AVX512_VNNI

#if defined(PAGODA_AVX2) && !defined(PAGODA_AVX512_VNNI)
inline __m256i broadcast4_256(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// acc + the 4-product sums of signed values w (as bytes) and int8 x: AVX2 has no u8 x s8 dot of
// 4, so |w| x sign(x, w) through maddubs (pairs at most 2 * 127 * 127: no saturation), widened.
inline __m256i dot4_signed(__m256i acc, __m256i w, __m256i x) {
  const __m256i pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
  return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}

// Q6_K's codes j of a half (superblock_formats.h) for the 8 rows at v: the fourth (j = 3) from the
// top pairs of the three vectors.
inline __m256i q6_codes256(const uint8_t* v, int j) {
  const auto at = [v](int k) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + 64 * k)); };
  if (j < 3) return _mm256_and_si256(at(j), _mm256_set1_epi8(0x3F));
  const __m256i a = _mm256_and_si256(_mm256_srli_epi16(at(0), 2), _mm256_set1_epi8(0x30));
  const __m256i b = _mm256_and_si256(_mm256_srli_epi16(at(1), 4), _mm256_set1_epi8(0x0C));
  const __m256i c = _mm256_and_si256(_mm256_srli_epi16(at(2), 6), _mm256_set1_epi8(0x03));
  return _mm256_or_si256(_mm256_or_si256(a, b), c);
}

// Half h (rows 8h .. 8h+7) of vector j's codes as signed values (Q6_K: code - 32; IQ4: the table's).
template <int64_t T>
inline void codes256(const uint8_t* codes, int j, int h, __m256i& lo, __m256i& hi) {
  if constexpr (T == Q8_0) {  // whole bytes, + 128: back to the int8 codes
    const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
    lo = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + 64 * j + 32 * h)), flip);
    hi = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + 256 + 64 * j + 32 * h)), flip);
    return;
  }
  if constexpr (T == Q6_K) {  // 6-bit codes - 32
    const __m256i off = _mm256_set1_epi8(32);
    lo = _mm256_sub_epi8(q6_codes256(codes + 32 * h, j), off);
    hi = _mm256_sub_epi8(q6_codes256(codes + 192 + 32 * h, j), off);
    return;
  }
  const __m256i low = _mm256_set1_epi8(0x0F);
  const __m256i z = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + 64 * j + 32 * h));
  lo = _mm256_and_si256(z, low);
  hi = _mm256_and_si256(_mm256_srli_epi16(z, 4), low);
  if constexpr (has_fifth_bit(T)) {
    const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + 256 + 32 * h));
    const __m256i five = _mm256_set1_epi8(0x10);
    lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_slli_epi16(bits, 4 - j), five));
    hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_srli_epi16(bits, j), five));
  }
  if constexpr (T == Q4_0 || T == Q5_0) {  // signed values
    const __m256i off = _mm256_set1_epi8(static_cast<char>(code_offset(T)));
    lo = _mm256_sub_epi8(lo, off);
    hi = _mm256_sub_epi8(hi, off);
  } else if constexpr (is_iq4(T)) {
    const __m256i values = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kIQ4Values)));
    lo = _mm256_shuffle_epi8(values, lo);
    hi = _mm256_shuffle_epi8(values, hi);
  }
}

inline __m256 bytes_to_ps8(const uint8_t* p, bool is_signed) {
  const __m128i v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtepi32_ps(is_signed ? _mm256_cvtepi8_epi32(v) : _mm256_cvtepu8_epi32(v));
}

// R rows against half h of one tile (8 outputs). The signed products need no code offsets.
template <int64_t T, int R>
void gemm_avx2_half(const uint8_t* tile, int64_t ns, const Rows& x, float* y, int64_t ldy, int64_t N, int64_t n0,
                    int h) {
  constexpr int64_t BLOCKS = blocks_per_super(T), SB = scale_bytes(T), CB = block_code_bytes(T), REC = record_bytes(T);
  constexpr int H = T == Q6_K ? 2 : 1;
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t s = 0; s < ns; ++s) {
    const uint8_t* rec = tile + s * REC;
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + 16 * h)));
    const __m256 dmin = has_mins(T) ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + 32 + 16 * h)))
                                    : _mm256_setzero_ps();
    for (int64_t sub = 0; sub < BLOCKS; ++sub) {
      const int64_t b = s * BLOCKS + sub;
      __m256i isum[R][H];
      for (int r = 0; r < R; ++r)
        for (int k = 0; k < H; ++k) isum[r][k] = _mm256_setzero_si256();
      if constexpr (T == Q4_K || T == Q4_1) {
        // unsigned codes <= 15: maddubs takes them as they are, and a block's 8 pairs of products
        // sum to at most 8 * 2 * 15 * 127 = 30,480, so they stay in int16 and widen once
        __m256i s16[R];
        for (int r = 0; r < R; ++r) s16[r] = _mm256_setzero_si256();
        for (int j = 0; j < 4; ++j) {
          __m256i lo, hi;
          codes256<T>(rec + SB + sub * CB, j, h, lo, hi);
          for (int r = 0; r < R; ++r) {
            const int8_t* q = x.q + r * x.K + b * BLOCK;
            s16[r] = _mm256_add_epi16(s16[r], _mm256_maddubs_epi16(lo, broadcast4_256(q + 4 * j)));
            s16[r] = _mm256_add_epi16(s16[r], _mm256_maddubs_epi16(hi, broadcast4_256(q + 16 + 4 * j)));
          }
        }
        for (int r = 0; r < R; ++r) isum[r][0] = _mm256_madd_epi16(s16[r], _mm256_set1_epi16(1));
      } else {
        for (int j = 0; j < 4; ++j) {
          __m256i lo, hi;
          codes256<T>(rec + SB + sub * CB, j, h, lo, hi);
          for (int r = 0; r < R; ++r) {
            const int8_t* q = x.q + r * x.K + b * BLOCK;
            isum[r][0] = dot4_signed(isum[r][0], lo, broadcast4_256(q + 4 * j));
            isum[r][H - 1] = dot4_signed(isum[r][H - 1], hi, broadcast4_256(q + 16 + 4 * j));
          }
        }
      }
      __m256 scale[H], mins = _mm256_setzero_ps();
      if constexpr (T == Q6_K) {
        scale[0] = _mm256_mul_ps(d, bytes_to_ps8(rec + 32 + 16 * (2 * sub) + 8 * h, true));
        scale[H - 1] = _mm256_mul_ps(d, bytes_to_ps8(rec + 32 + 16 * (2 * sub + 1) + 8 * h, true));
      } else if constexpr (has_min_bytes(T)) {
        scale[0] = _mm256_mul_ps(d, bytes_to_ps8(rec + 64 + 16 * sub + 8 * h, false));
        mins = _mm256_mul_ps(dmin, bytes_to_ps8(rec + 192 + 16 * sub + 8 * h, false));
      } else if constexpr (T == IQ4_XS) {
        scale[0] = _mm256_mul_ps(d, bytes_to_ps8(rec + 32 + 16 * sub + 8 * h, true));
      } else {
        scale[0] = _mm256_mul_ps(d, _mm256_set1_ps(1.f));
        if constexpr (has_mins(T)) mins = _mm256_mul_ps(dmin, _mm256_set1_ps(1.f));
      }
      for (int r = 0; r < R; ++r) {
        const __m256 dx = _mm256_set1_ps(x.dx[r * x.nb + b]);
        for (int k = 0; k < H; ++k)
          acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r][k]), _mm256_mul_ps(scale[k], dx), acc[r]);
        if constexpr (has_mins(T)) acc[r] = _mm256_fnmadd_ps(mins, _mm256_set1_ps(x.sx[r * x.nb + b]), acc[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, acc[r]);
    for (int c = 0; c < 8 && n0 + 8 * h + c < N; ++c) y[r * ldy + n0 + 8 * h + c] = lanes[c];
  }
}
#endif  // PAGODA_AVX2 && !PAGODA_AVX512_VNNI

}  // namespace pagoda::superblock
