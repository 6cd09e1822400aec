// The GEMM on ggml's blocks (Q4_0, Q4_1, Q8_0) on a copy of the weight repacked once at load
// into tiles (layers/packed_weights.py), as llama.cpp repacks its Q4_0 for AVX-512 / AVX2.
//
// block_matmul's integer kernel (block_matmul.cpp) takes the blocks as they are: each dot product
// there multiplies one weight row's block by one activation block, and its 8 int32 lanes go
// through their own float accumulators (its documented order), so ~8 instructions follow each
// vpdpbusd and it runs at 6-13 % of the instruction's peak. Here lanes hold output columns: a tile
// of 16 weight rows (16 outputs) keeps, per block, the rows' codes side by side, 4 consecutive
// elements of a row per 32-bit lane. One vpdpbusd then advances 16 outputs by 4 products each
// against 4 activation bytes broadcast to every lane; a block's 32 products are 8 of them into
// one int32 sum per output, exact, and only then scaled in fp32:
//   out[m, n] = sum over blocks b, in order, of  fma(float(isum_b), dw_b * dx_b, .)
//               and, for Q4_1, then fma(mw_b, sx_b, .)
//   isum_b    = the block's integer dot product of the signed codes (Q4_0: nibble - 8) and q
// Each output's order depends on K only, never on the rows beside it (this route's row results
// do not depend on M), but it is not the integer kernel's order.
//
// The activations are quantized as for the integer kernel (ggml_blocks.h: int8 per block of 32,
// as llama.cpp's q8_0), so the products are the integer kernel's, summed in another order; where
// the bf16 route rounded them to 8 significant bits, this one keeps fp32.
//
// Instruction sets (block_gemm_tiles_isa() names the one built), every one giving the same bits
// (the integer sums are exact, the float steps the same):
//   avx512-vnni  vpdpbusd on 64-byte vectors: 2 tiles (32 outputs) x 4 activation rows a call;
//                the codes stored unsigned (Q8_0: + 128) and the offset taken back in int32
//   avx-vnni     vpdpbusd on 32-byte vectors, a tile as two halves of 8 outputs, 2 rows a call
//   avx2         maddubs + madd, a tile's two halves x 4 rows a pass; a Q4 block's sums kept in
//                int16 and widened once (Q8_0 through |w| and x * sign(w), as the integer kernel
//                does); from 8 rows, a tile's codes split (Q4) or signed (Q8_0) once per thread
//                for all its passes
//   scalar       plain C++
//
// Registered as torch.ops.pagoda.block_repack_tiles / block_gemm_tiles.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "ggml_blocks.h"
#include "huge_pages.h"
#include "prefetch.h"
#include "work_items.h"

namespace {

using namespace pagoda::ggml;

constexpr int64_t COLS = 16;  // weight rows (output columns) in a tile: one vector of 16 int32 lanes
constexpr int64_t ROW_BLOCK_BYTES = 192 * 1024;  // activation codes a thread runs its tiles against at once

// A tile holds, for each block in order, its 16 rows' codes (64-byte vectors):
//   Q8_0: 8 vectors, vector l holding elements 4l .. 4l+3 of each row (row c at bytes 4c .. 4c+3)
//   Q4:   4 vectors, vector j holding elements 4j .. 4j+3 in its low nibbles and 4(j+4) .. in its high
// then, for each block, the rows' d (16 fp16, as stored) and for Q4_1 their m (16 fp16): as many
// bytes as the blocks themselves, so one stream's decode reads no more than from the blocks.
inline int64_t codes_bytes(int64_t type) { return type == Q8_0 ? 8 * 64 : 4 * 64; }
inline int64_t scales_bytes(int64_t type) { return type == Q4_1 ? 64 : 32; }
inline int64_t record_bytes(int64_t type) { return scales_bytes(type) + codes_bytes(type); }

// The unsigned code of element k of a block, as the kernel multiplies it.
inline uint8_t stored_code(const uint8_t* blk, int64_t type, int64_t k) {
  if (type == Q8_0) return static_cast<uint8_t>(static_cast<int8_t>(blk[2 + k]) + 128);
  const uint8_t* q = blk + codes_offset(type);
  return k < QK / 2 ? (q[k] & 0x0F) : (q[k - QK / 2] >> 4);
}

// What brings the stored unsigned codes back to the signed ones: isum -= offset * sum(q).
inline int32_t code_offset(int64_t type) { return type == Q8_0 ? 128 : type == Q4_0 ? 8 : 0; }

// One output's block step: acc = fma(float(isum), dw * dx, acc), then for Q4_1 fma(mw, sx, .);
// the vector paths do exactly this per lane.
inline float block_step(float acc, int32_t isum, float dw, float dx, float mw, float sx, int64_t type) {
  acc = std::fma(static_cast<float>(isum), dw * dx, acc);
  return type == Q4_1 ? std::fma(mw, sx, acc) : acc;
}

void repack_tile(const uint8_t* w, int64_t type, int64_t N, int64_t nb, int64_t tile, uint8_t* out) {
  const int64_t row_bytes = nb * block_bytes(type);
  for (int64_t b = 0; b < nb; ++b) {
    uint8_t* codes = out + b * codes_bytes(type);
    uint8_t* scales = out + nb * codes_bytes(type) + b * scales_bytes(type);
    for (int64_t c = 0; c < COLS; ++c) {
      const int64_t n = tile * COLS + c;
      if (n >= N) continue;  // zero scales and codes: the padding columns add nothing
      const uint8_t* blk = w + n * row_bytes + b * block_bytes(type);
      std::memcpy(scales + 2 * c, blk, 2);                              // d
      if (type == Q4_1) std::memcpy(scales + 2 * (COLS + c), blk + 2, 2);  // m
      for (int64_t i = 0; i < 4; ++i) {
        if (type == Q8_0) {
          for (int64_t l = 0; l < 8; ++l) codes[l * 64 + c * 4 + i] = stored_code(blk, type, 4 * l + i);
        } else {
          for (int64_t j = 0; j < 4; ++j)
            codes[j * 64 + c * 4 + i] =
                stored_code(blk, type, 4 * j + i) | static_cast<uint8_t>(stored_code(blk, type, 4 * (j + 4) + i) << 4);
        }
      }
    }
  }
}

#ifdef PAGODA_AVX512_VNNI
inline __m512i broadcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// Asks L2 for what block b's step reads of each tile's two streams (codes, scales) PREFETCH_AHEAD
// bytes of codes on (prefetch.h); past a stream's end, in the same stream of the tile C on, which
// this thread reads next.
template <int C>
inline void prefetch_ahead(const uint8_t* tiles, int64_t tile_bytes, int64_t nb, int64_t cb, int64_t sb, int64_t b) {
  const int64_t codes = pagoda::stream_ahead(b * cb + pagoda::PREFETCH_AHEAD, nb * cb, C * tile_bytes);
  const int64_t scales =
      nb * cb + pagoda::stream_ahead(b * sb + pagoda::PREFETCH_AHEAD * sb / cb, nb * sb, C * tile_bytes);
  for (int c = 0; c < C; ++c) {
    pagoda::prefetch_l2(tiles + c * tile_bytes + codes, cb);
    pagoda::prefetch_l2(tiles + c * tile_bytes + scales, sb);
  }
}

// R activation rows against C tiles (16 C output columns): R * C int32 sums per block and as many
// float accumulators, enough independent chains to keep vpdpbusd busy.
template <int R, int C>
void tile_gemm(const uint8_t* tiles, int64_t type, int64_t nb, const int8_t* qx, const float* dx, const float* sx,
               const int32_t* qsum, int64_t K, float* y, int64_t N, int64_t n0) {
  const int64_t cb = codes_bytes(type), sb = scales_bytes(type), tile_bytes = nb * (cb + sb);
  const int32_t offset = code_offset(type);
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    prefetch_ahead<C>(tiles, tile_bytes, nb, cb, sb, b);
    const uint8_t* codes[C];
    for (int c = 0; c < C; ++c) codes[c] = tiles + c * tile_bytes + b * cb;
    __m512i isum[R][C];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) isum[r][c] = _mm512_setzero_si512();
    if (type == Q8_0) {
      for (int l = 0; l < 8; ++l) {
        __m512i w[C];
        for (int c = 0; c < C; ++c) w[c] = _mm512_loadu_si512(codes[c] + l * 64);
        for (int r = 0; r < R; ++r) {
          const __m512i x = broadcast4(qx + r * K + b * QK + 4 * l);
          for (int c = 0; c < C; ++c) isum[r][c] = _mm512_dpbusd_epi32(isum[r][c], w[c], x);
        }
      }
    } else {
      for (int j = 0; j < 4; ++j) {
        __m512i lo[C], hi[C];
        for (int c = 0; c < C; ++c) {
          const __m512i z = _mm512_loadu_si512(codes[c] + j * 64);
          lo[c] = _mm512_and_si512(z, low);
          hi[c] = _mm512_and_si512(_mm512_srli_epi16(z, 4), low);
        }
        for (int r = 0; r < R; ++r) {
          const __m512i xl = broadcast4(qx + r * K + b * QK + 4 * j);
          const __m512i xh = broadcast4(qx + r * K + b * QK + 4 * (j + 4));
          for (int c = 0; c < C; ++c) {
            isum[r][c] = _mm512_dpbusd_epi32(isum[r][c], lo[c], xl);
            isum[r][c] = _mm512_dpbusd_epi32(isum[r][c], hi[c], xh);
          }
        }
      }
    }
    const uint8_t* scales[C];
    __m512 dw[C];
    for (int c = 0; c < C; ++c) {
      scales[c] = tiles + c * tile_bytes + nb * cb + b * sb;
      dw[c] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales[c])));
    }
    for (int r = 0; r < R; ++r) {
      const __m512 dxr = _mm512_set1_ps(dx[r * nb + b]);
      const __m512i off = _mm512_set1_epi32(offset * qsum[r * nb + b]);
      for (int c = 0; c < C; ++c) {
        const __m512i s = type == Q4_1 ? isum[r][c] : _mm512_sub_epi32(isum[r][c], off);
        acc[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(dw[c], dxr), acc[r][c]);
      }
      if (type == Q4_1) {
        const __m512 sxr = _mm512_set1_ps(sx[r * nb + b]);
        for (int c = 0; c < C; ++c)
          acc[r][c] = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales[c] + 32))),
                                      sxr, acc[r][c]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      const int64_t n = n0 + c * COLS;
      if (n + COLS <= N) _mm512_storeu_ps(y + r * N + n, acc[r][c]);
      else if (n < N) _mm512_mask_storeu_ps(y + r * N + n, static_cast<__mmask16>((1u << (N - n)) - 1), acc[r][c]);
    }
}

#endif

#if defined(PAGODA_AVX2) && !defined(PAGODA_AVX512_VNNI)
inline __m256i broadcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// y[n .. n + 7] = the 8 lanes of v, those below N only (a tile's last outputs may be padding).
inline void store8(__m256 v, float* y, int64_t n, int64_t N) {
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, v);
  for (int c = 0; c < 8 && n + c < N; ++c) y[n + c] = lanes[c];
}

#if defined(PAGODA_AVX_VNNI)
// u8 x s8 products of 4 consecutive bytes, added to the int32 lanes of acc (exact).
inline __m256i dot4(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_avx_epi32(acc, u, s); }

// R activation rows against one tile (C == 1), as two halves of 8 outputs (32-byte vectors).
template <int R, int C>
void tile_gemm(const uint8_t* tile, int64_t type, int64_t nb, const int8_t* qx, const float* dx, const float* sx,
               const int32_t* qsum, int64_t K, float* y, int64_t N, int64_t n0) {
  static_assert(C == 1, "one tile a call here");
  const int64_t cb = codes_bytes(type), sb = scales_bytes(type);
  const __m256i low = _mm256_set1_epi8(0x0F);
  const int32_t offset = code_offset(type);
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* codes = tile + b * cb;
    __m256i isum[R][2];
    for (int r = 0; r < R; ++r) isum[r][0] = isum[r][1] = _mm256_setzero_si256();
    for (int h = 0; h < 2; ++h) {
      if (type == Q8_0) {
        for (int l = 0; l < 8; ++l) {
          const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + l * 64 + 32 * h));
          for (int r = 0; r < R; ++r) isum[r][h] = dot4(isum[r][h], w, broadcast4(qx + r * K + b * QK + 4 * l));
        }
      } else {
        for (int j = 0; j < 4; ++j) {
          const __m256i z = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + j * 64 + 32 * h));
          const __m256i lo = _mm256_and_si256(z, low), hi = _mm256_and_si256(_mm256_srli_epi16(z, 4), low);
          for (int r = 0; r < R; ++r) {
            isum[r][h] = dot4(isum[r][h], lo, broadcast4(qx + r * K + b * QK + 4 * j));
            isum[r][h] = dot4(isum[r][h], hi, broadcast4(qx + r * K + b * QK + 4 * (j + 4)));
          }
        }
      }
    }
    const uint8_t* scales = tile + nb * cb + b * sb;
    for (int h = 0; h < 2; ++h) {
      const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scales + 16 * h)));
      for (int r = 0; r < R; ++r) {
        const __m256i s = _mm256_sub_epi32(isum[r][h], _mm256_set1_epi32(offset * qsum[r * nb + b]));
        acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(dw, _mm256_set1_ps(dx[r * nb + b])), acc[r][h]);
        if (type == Q4_1) {
          const __m256 mw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scales + 32 + 16 * h)));
          acc[r][h] = _mm256_fmadd_ps(mw, _mm256_set1_ps(sx[r * nb + b]), acc[r][h]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < 2; ++h) store8(acc[r][h], y + r * N, n0 + 8 * h, N);
}

constexpr int TILE_ROWS = 2;
constexpr int TILE_GROUP = 1;
#else
// AVX2 without VNNI: maddubs gives int16 sums of two products, and madd (with ones) widens them to
// int32, the second multiply-port instruction for every 32 products. A Q4 block's sums fit int16
// whole (16 products of a code 0..15 and |x| <= 128: at most 30,720), so they are added in int16
// and widened once a block: 9 multiply-port instructions for 8 x 32 products instead of 16. Q8_0's
// pairs alone can reach 32,258 and are widened at once. One half of the tile (8 outputs) a pass, so
// 4 rows' sums and accumulators fit the 16 registers; the second pass reads the tile from L1.
inline __m256i q8_signed(__m256i stored) { return _mm256_xor_si256(stored, _mm256_set1_epi8(static_cast<char>(0x80))); }

// The int32 sums of the 4 products a lane of signed codes w (with magnitude |w|) and x give.
inline __m256i q8_products(__m256i w, __m256i magnitude, __m256i x) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(x, w)), _mm256_set1_epi16(1));
}

inline __m256i q8_pairs(__m256i stored, __m256i x) {
  const __m256i w = q8_signed(stored);
  return q8_products(w, _mm256_sign_epi8(w, w), x);
}

// One block's integer sums for R rows against a half tile's codes (8 outputs).
template <int R>
inline void q8_block_sums(const uint8_t* codes, const int8_t* x, int64_t K, __m256i* isum) {
  for (int r = 0; r < R; ++r) isum[r] = _mm256_setzero_si256();
#pragma GCC unroll 1
  for (int l = 0; l < 8; ++l) {
    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + l * 64));
    for (int r = 0; r < R; ++r) isum[r] = _mm256_add_epi32(isum[r], q8_pairs(w, broadcast4(x + r * K + 4 * l)));
  }
}

// The 32 bytes at p as their low and high nibbles (a Q4 tile stores codes k and k + 16 in one byte).
inline void split_nibbles(const uint8_t* p, __m256i& lo, __m256i& hi) {
  const __m256i low = _mm256_set1_epi8(0x0F);
  const __m256i z = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  lo = _mm256_and_si256(z, low);
  hi = _mm256_and_si256(_mm256_srli_epi16(z, 4), low);
}

// A block's float step for a row's 8 outputs: acc + float(isum) (dw dx), then for Q4_1 + mw sx.
// Every AVX2 tile path takes it, so they round alike.
template <int64_t TYPE>
inline __m256 block_step8(__m256 acc, __m256i isum, __m256 dw, float dx, __m256 mw, float sx) {
  acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(dw, _mm256_set1_ps(dx)), acc);
  if constexpr (TYPE == Q4_1) acc = _mm256_fmadd_ps(mw, _mm256_set1_ps(sx), acc);
  return acc;
}

// 8 fp16 scales of a half tile as floats
inline __m256 scales8(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

template <int R>
inline void q4_block_sums(const uint8_t* codes, const int8_t* x, int64_t K, __m256i* isum) {
  __m256i s16[R];
  for (int r = 0; r < R; ++r) s16[r] = _mm256_setzero_si256();
#pragma GCC unroll 1
  for (int j = 0; j < 4; ++j) {
    __m256i lo, hi;
    split_nibbles(codes + j * 64, lo, hi);
    for (int r = 0; r < R; ++r) {
      s16[r] = _mm256_add_epi16(s16[r], _mm256_maddubs_epi16(lo, broadcast4(x + r * K + 4 * j)));
      s16[r] = _mm256_add_epi16(s16[r], _mm256_maddubs_epi16(hi, broadcast4(x + r * K + 4 * (j + 4))));
    }
  }
  for (int r = 0; r < R; ++r) isum[r] = _mm256_madd_epi16(s16[r], _mm256_set1_epi16(1));
}

template <int R, int64_t TYPE>
void half_tile_gemm(const uint8_t* tile, int64_t nb, const int8_t* qx, const float* dx, const float* sx,
                    const int32_t* qsum, int64_t K, float* y, int64_t N, int64_t n0, int h) {
  const int64_t cb = codes_bytes(TYPE), sb = scales_bytes(TYPE);
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* codes = tile + b * cb + 32 * h;
    __m256i isum[R];
    if constexpr (TYPE == Q8_0) q8_block_sums<R>(codes, qx + b * QK, K, isum);  // |w| x sign(w) x: no offset
    else q4_block_sums<R>(codes, qx + b * QK, K, isum);
    if constexpr (TYPE == Q4_0)
      for (int r = 0; r < R; ++r)
        isum[r] = _mm256_sub_epi32(isum[r], _mm256_set1_epi32(code_offset(TYPE) * qsum[r * nb + b]));
    const uint8_t* scales = tile + nb * cb + b * sb;
    const __m256 dw = scales8(scales + 16 * h);
    const __m256 mw = TYPE == Q4_1 ? scales8(scales + 32 + 16 * h) : _mm256_setzero_ps();
    for (int r = 0; r < R; ++r) acc[r] = block_step8<TYPE>(acc[r], isum[r], dw, dx[r * nb + b], mw, sx[r * nb + b]);
  }
  for (int r = 0; r < R; ++r) store8(acc[r], y + r * N, n0 + 8 * h, N);
}

// A tile's codes prepared once for all the 4-row passes a thread makes against it (a prefill's
// hundreds of rows, a batched decode's 64), so each pass loads them instead of preparing them anew:
//   Q4:   split into bytes; per block and j, the low codes of both halves then the high ones (4 x 32
//         bytes): 24 of the ~196 vector instructions of a block's 4 rows
//   Q8_0: per block and l, both halves' magnitudes |w| then their signed codes w (4 x 32 bytes)
// The codes are the same numbers: the same bits.
constexpr int64_t SPLIT_MIN_ROWS = 8;  // two passes or more: the preparation pays for itself

constexpr int64_t split_block_bytes(int64_t type) { return type == Q8_0 ? 8 * 128 : 4 * 128; }

template <int64_t TYPE>
void split_tile_codes(const uint8_t* tile, int64_t nb, uint8_t* out) {
  constexpr int steps = TYPE == Q8_0 ? 8 : 4;
  for (int64_t b = 0; b < nb; ++b)
    for (int i = 0; i < steps; ++i) {
      const uint8_t* codes = tile + b * codes_bytes(TYPE) + i * 64;
      __m256i v[4];
      if constexpr (TYPE == Q8_0) {
        for (int h = 0; h < 2; ++h) {
          v[2 + h] = q8_signed(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + 32 * h)));
          v[h] = _mm256_sign_epi8(v[2 + h], v[2 + h]);
        }
      } else {
        split_nibbles(codes, v[0], v[2]);
        split_nibbles(codes + 32, v[1], v[3]);
      }
      __m256i* o = reinterpret_cast<__m256i*>(out + b * split_block_bytes(TYPE) + i * 128);
      for (int k = 0; k < 4; ++k) _mm256_storeu_si256(o + k, v[k]);
    }
}

// Holds v in a vector register here: GCC otherwise adds a block's products in another order (the
// same integer sum) that needs more registers than AVX2's 16, and keeps sums on the stack, where
// each add waits on the last one's store.
inline void in_register(__m256i& v) { asm("" : "+x"(v)); }

// A Q4 tile's codes 4j .. 4j + 3 (part 0, low nibbles) or 4(j + 4) .. (part 1, high nibbles) of
// block b, for the tile's half h: split from the tile's bytes, or loaded where SPLIT holds them.
template <bool SPLIT>
inline __m256i q4_codes(const uint8_t* codes, const uint8_t* split, int64_t b, int j, int part, int h) {
  if constexpr (SPLIT)
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(split + b * split_block_bytes(Q4_1) + j * 128 + 64 * part + 32 * h));
  const __m256i z = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + j * 64 + 32 * h));
  return _mm256_and_si256(part == 0 ? z : _mm256_srli_epi16(z, 4), _mm256_set1_epi8(0x0F));
}

// A Q8_0 tile's codes 4l .. 4l + 3 of block b for the tile's half h, signed, and their magnitudes.
template <bool SPLIT>
inline void q8_codes(const uint8_t* codes, const uint8_t* split, int64_t b, int l, int h, __m256i& w, __m256i& magnitude) {
  if constexpr (SPLIT) {
    const uint8_t* p = split + b * split_block_bytes(Q8_0) + l * 128 + 32 * h;
    magnitude = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64));
  } else {
    w = q8_signed(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + l * 64 + 32 * h)));
    magnitude = _mm256_sign_epi8(w, w);
  }
}

// A block's float steps for 4 rows x both halves of a tile, the accumulators in L1 (acc[r] holds
// row r's 16 outputs): per output the same steps in the same order as half_tile_gemm.
template <int64_t TYPE>
inline void tile_block_steps(float (*acc)[16], __m256i (*isum)[2], const uint8_t* scales, const float* dx,
                             const float* sx, const int32_t* qsum, int64_t nb, int64_t b) {
  constexpr int R = 4;
  for (int h = 0; h < 2; ++h) {
    const __m256 dw = scales8(scales + 16 * h);
    const __m256 mw = TYPE == Q4_1 ? scales8(scales + 32 + 16 * h) : _mm256_setzero_ps();
    for (int r = 0; r < R; ++r) {
      __m256i sum = isum[r][h];
      if constexpr (TYPE == Q4_0) sum = _mm256_sub_epi32(sum, _mm256_set1_epi32(code_offset(TYPE) * qsum[r * nb + b]));
      _mm256_store_ps(acc[r] + 8 * h, block_step8<TYPE>(_mm256_load_ps(acc[r] + 8 * h), sum, dw, dx[r * nb + b], mw,
                                                        sx[r * nb + b]));
    }
  }
}

// A tile's two halves at once for 4 rows: each activation broadcast serves both halves' codes, so
// a block takes half the broadcasts of one half a pass. Q4: 32 broadcasts for 64 maddubs; the 8
// int16 sums, 4 code vectors and 2 broadcasts fill the registers. Q8_0: 32 broadcasts for 64
// pairs; the 8 int32 sums, both halves' codes (signed and absolute) and a broadcast. Either way
// the float accumulators stay in L1 (a load and a store a block and half, on the load/store ports).
// Per output the same integer sum and the same float steps in the same order as half_tile_gemm:
// the same bits.
//
// SPLIT: the codes come from split_tile_codes' copy instead (loads for the instructions that
// prepare them).
template <int64_t TYPE, bool SPLIT = false>
void tile_gemm_4rows(const uint8_t* tile, int64_t nb, const int8_t* qx, const float* dx, const float* sx,
                     const int32_t* qsum, int64_t K, float* y, int64_t N, int64_t n0,
                     const uint8_t* split = nullptr) {
  constexpr int R = 4;
  const int64_t cb = codes_bytes(TYPE), sb = scales_bytes(TYPE);
  alignas(32) float acc[R][16] = {};
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* codes = tile + b * cb;
    const int8_t* x = qx + b * QK;
    __m256i isum[R][2];
    if constexpr (TYPE == Q8_0) {
      for (int r = 0; r < R; ++r) isum[r][0] = isum[r][1] = _mm256_setzero_si256();
#pragma GCC unroll 1
      for (int l = 0; l < 8; ++l)
        for (int h = 0; h < 2; ++h) {  // one half's codes live at a time, as for Q4 below
          __m256i w, magnitude;
          q8_codes<SPLIT>(codes, split, b, l, h, w, magnitude);
          for (int r = 0; r < R; ++r) {
            isum[r][h] = _mm256_add_epi32(isum[r][h], q8_products(w, magnitude, broadcast4(x + r * K + 4 * l)));
            in_register(isum[r][h]);
          }
        }
    } else {
      __m256i s16[R][2];
      for (int r = 0; r < R; ++r) s16[r][0] = s16[r][1] = _mm256_setzero_si256();
#pragma GCC unroll 1
      for (int j = 0; j < 4; ++j) {
        // the low codes against all 4 rows, then the high ones: 2 code vectors live at a time, so
        // the 8 sums, the codes, a broadcast and a product fit the 16 registers (with all 4 codes
        // live, GCC kept sums on the stack and every add waited on a store)
        for (int part = 0; part < 2; ++part) {
          const __m256i c0 = q4_codes<SPLIT>(codes, split, b, j, part, 0);
          const __m256i c1 = q4_codes<SPLIT>(codes, split, b, j, part, 1);
          for (int r = 0; r < R; ++r) {
            const __m256i xb = broadcast4(x + r * K + 4 * (j + 4 * part));
            s16[r][0] = _mm256_add_epi16(s16[r][0], _mm256_maddubs_epi16(c0, xb));
            s16[r][1] = _mm256_add_epi16(s16[r][1], _mm256_maddubs_epi16(c1, xb));
            in_register(s16[r][0]);
            in_register(s16[r][1]);
          }
        }
      }
      for (int r = 0; r < R; ++r)
        for (int h = 0; h < 2; ++h) isum[r][h] = _mm256_madd_epi16(s16[r][h], _mm256_set1_epi16(1));
    }
    tile_block_steps<TYPE>(acc, isum, tile + nb * cb + b * sb, dx, sx, qsum, nb, b);
  }
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < 2; ++h) store8(_mm256_load_ps(acc[r] + 8 * h), y + r * N, n0 + 8 * h, N);
}

// Rows m0 .. M - 1 in 4-row passes against one full tile whose codes are prepared once; returns
// the first row left (fewer than 4) for the usual passes.
template <int64_t TYPE>
int64_t split_tile_rows(const uint8_t* tile, int64_t nb, const QuantizedActivations& a, int64_t m0, int64_t M,
                        int64_t K, float* y, int64_t N, int64_t n0) {
  thread_local std::vector<uint8_t> split;
  split.resize(nb * split_block_bytes(TYPE));
  split_tile_codes<TYPE>(tile, nb, split.data());
  int64_t m = m0;
  for (; m + 4 <= M; m += 4)
    tile_gemm_4rows<TYPE, true>(tile, nb, a.q.data() + m * K, a.d.data() + m * nb, a.s.data() + m * nb,
                                a.sum.data() + m * nb, K, y + m * N, N, n0, split.data());
  return m;
}

int64_t split_tile_rows(const uint8_t* tile, int64_t type, int64_t nb, const QuantizedActivations& a, int64_t m0,
                        int64_t M, int64_t K, float* y, int64_t N, int64_t n0) {
  if (type == Q8_0) return split_tile_rows<Q8_0>(tile, nb, a, m0, M, K, y, N, n0);
  if (type == Q4_1) return split_tile_rows<Q4_1>(tile, nb, a, m0, M, K, y, N, n0);
  return split_tile_rows<Q4_0>(tile, nb, a, m0, M, K, y, N, n0);
}
#define PAGODA_SPLITS_TILES 1

template <int R, int64_t TYPE>
void both_halves(const uint8_t* tile, int64_t nb, const int8_t* qx, const float* dx, const float* sx,
                 const int32_t* qsum, int64_t K, float* y, int64_t N, int64_t n0) {
  if constexpr (R == 4) {
    if (n0 + 8 < N) return tile_gemm_4rows<TYPE>(tile, nb, qx, dx, sx, qsum, K, y, N, n0);
  }
  half_tile_gemm<R, TYPE>(tile, nb, qx, dx, sx, qsum, K, y, N, n0, 0);
  if (n0 + 8 < N) half_tile_gemm<R, TYPE>(tile, nb, qx, dx, sx, qsum, K, y, N, n0, 1);
}

// R activation rows against one tile (C == 1): its two halves in turn.
template <int R, int C>
void tile_gemm(const uint8_t* tile, int64_t type, int64_t nb, const int8_t* qx, const float* dx, const float* sx,
               const int32_t* qsum, int64_t K, float* y, int64_t N, int64_t n0) {
  static_assert(C == 1, "one tile a call here");
  if (type == Q8_0) both_halves<R, Q8_0>(tile, nb, qx, dx, sx, qsum, K, y, N, n0);
  else if (type == Q4_1) both_halves<R, Q4_1>(tile, nb, qx, dx, sx, qsum, K, y, N, n0);
  else both_halves<R, Q4_0>(tile, nb, qx, dx, sx, qsum, K, y, N, n0);
}

constexpr int TILE_ROWS = 4;
constexpr int TILE_GROUP = 1;
#endif  // PAGODA_AVX_VNNI
#endif  // PAGODA_AVX2

#if !defined(PAGODA_AVX2)
// Lane by lane (one tile a call, C == 1): the codes as the vector paths read them, the same float steps.
template <int R, int C>
void tile_gemm(const uint8_t* tile, int64_t type, int64_t nb, const int8_t* qx, const float* dx, const float* sx,
               const int32_t* qsum, int64_t K, float* y, int64_t N, int64_t n0) {
  static_assert(C == 1, "one tile a call here");
  const int64_t cb = codes_bytes(type), sb = scales_bytes(type);
  for (int r = 0; r < R; ++r)
    for (int64_t c = 0; c < COLS && n0 + c < N; ++c) {
      float acc = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* codes = tile + b * cb;
        const int8_t* x = qx + r * K + b * QK;
        int32_t isum = 0;
        for (int64_t k = 0; k < QK; ++k) {
          const int64_t group = k / 4, i = k % 4;
          const int32_t u = type == Q8_0 ? codes[group * 64 + c * 4 + i]
                                         : (codes[(group % 4) * 64 + c * 4 + i] >> (group < 4 ? 0 : 4)) & 0x0F;
          isum += u * x[k];
        }
        isum -= code_offset(type) * qsum[r * nb + b];
        const uint8_t* scales = tile + nb * cb + b * sb;
        acc = block_step(acc, isum, half_to_float(scales + 2 * c), dx[r * nb + b],
                         type == Q4_1 ? half_to_float(scales + 32 + 2 * c) : 0.f, sx[r * nb + b], type);
      }
      y[r * N + n0 + c] = acc;
    }
}

constexpr int TILE_ROWS = 4;
constexpr int TILE_GROUP = 1;
#endif

#if defined(PAGODA_AVX512_VNNI)
constexpr int TILE_ROWS = 4;   // activation rows a kernel call takes
constexpr int TILE_GROUP = 2;  // weight tiles a kernel call takes (32 output columns)
#endif

// Rows m0 .. M - 1 of the activations against C tiles from `tiles`, TILE_ROWS rows a call.
template <int C>
void rows_of_group(const uint8_t* tiles, int64_t type, int64_t nb, const QuantizedActivations& a, int64_t m0,
                   int64_t M, int64_t K, float* y, int64_t N, int64_t n0) {
#ifdef PAGODA_SPLITS_TILES
  if (C == 1 && M - m0 >= SPLIT_MIN_ROWS && n0 + 8 < N) m0 = split_tile_rows(tiles, type, nb, a, m0, M, K, y, N, n0);
#endif
  for (int64_t m = m0; m < M; m += TILE_ROWS) {
    const int8_t* qx = a.q.data() + m * K;
    const float *dx = a.d.data() + m * nb, *sx = a.s.data() + m * nb;
    const int32_t* qs = a.sum.data() + m * nb;
    float* ym = y + m * N;
    switch (std::min<int64_t>(TILE_ROWS, M - m)) {
      case 4: tile_gemm<4, C>(tiles, type, nb, qx, dx, sx, qs, K, ym, N, n0); break;
      case 3: tile_gemm<3, C>(tiles, type, nb, qx, dx, sx, qs, K, ym, N, n0); break;
      case 2: tile_gemm<2, C>(tiles, type, nb, qx, dx, sx, qs, K, ym, N, n0); break;
      default: tile_gemm<1, C>(tiles, type, nb, qx, dx, sx, qs, K, ym, N, n0);
    }
  }
}

}  // namespace

namespace pagoda {

// weight: ggml blocks [N, K / 32 * block bytes] -> the tiles, [ceil(N / 16), K / 32 * record bytes]
at::Tensor block_repack_tiles(const at::Tensor& weight, int64_t type, int64_t in_features) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kByte, "block_repack_tiles: weight must be uint8 [N, bytes]");
  TORCH_CHECK(in_features % QK == 0 && weight.size(1) == in_features / QK * block_bytes(type),
              "block_repack_tiles: rows of ", weight.size(1), " bytes do not hold ", in_features, " inputs");
  const int64_t N = weight.size(0), nb = in_features / QK, tiles = (N + COLS - 1) / COLS;
  const at::Tensor wc = weight.contiguous();
  at::Tensor out = huge_page_zeros(tiles * nb * record_bytes(type)).view({tiles, nb * record_bytes(type)});
  const uint8_t* w = wc.data_ptr<uint8_t>();
  uint8_t* o = out.data_ptr<uint8_t>();
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) repack_tile(w, type, N, nb, t, o + t * nb * record_bytes(type));
  });
  return out;
}

namespace {

void check_tiles(const at::Tensor& tiles, int64_t type, int64_t N, int64_t K) {
  TORCH_CHECK(K % QK == 0, "block_gemm_tiles: K (", K, ") must be a multiple of 32");
  TORCH_CHECK(tiles.dim() == 2 && tiles.scalar_type() == at::kByte && tiles.is_contiguous() &&
                  tiles.size(0) == (N + COLS - 1) / COLS && tiles.size(1) == K / QK * record_bytes(type),
              "block_gemm_tiles: the tiles do not hold a repacked [", N, ", ", K, "] weight of type ", type);
}

// The quantized activations a [M, K] times the tiled weight's transpose, into y [M, N].
void tiles_product(const QuantizedActivations& a, int64_t M, int64_t K, const at::Tensor& tiles, int64_t type,
                   float* y, int64_t N) {
  const int64_t nb = K / QK;
  const uint8_t* t = tiles.data_ptr<uint8_t>();
  const int64_t num_tiles = tiles.size(0), groups = (num_tiles + TILE_GROUP - 1) / TILE_GROUP;
  const int64_t tile_bytes = tiles.size(1);
  // A thread's tiles against a stretch of rows at a time, whose int8 codes stay in its L2 cache
  // while its tiles go by (a prefill's 2,048 rows of 576 are 1.2 MB: read again for every tile,
  // they came from L3). Which rows go together never changes a row's result.
  const int64_t row_block = std::max<int64_t>(TILE_ROWS, ROW_BLOCK_BYTES / K / TILE_ROWS * TILE_ROWS);
  pagoda::for_work_items(M, row_block, groups, [&](int64_t g, int64_t m0, int64_t m1) {
    const int64_t first = g * TILE_GROUP, count = std::min<int64_t>(TILE_GROUP, num_tiles - first);
    const uint8_t* group = t + first * tile_bytes;
    if (TILE_GROUP == 2 && count == 2) rows_of_group<TILE_GROUP>(group, type, nb, a, m0, m1, K, y, N, first * COLS);
    else rows_of_group<1>(group, type, nb, a, m0, m1, K, y, N, first * COLS);
  });
}

// The activations that `quantize` makes of float32 rows [M, *] (QuantizedActivations [M, K]) times
// the tiled weight's transpose: [M, N] float32. The entry points below differ in that step only.
template <typename Quantize>
at::Tensor tiles_gemm(const at::Tensor& rows, int64_t K, const at::Tensor& tiles, int64_t type, int64_t N,
                      const Quantize& quantize) {
  check_tiles(tiles, type, N, K);
  const int64_t M = rows.size(0);
  at::Tensor out = at::empty({M, N}, rows.options());
  if (M == 0 || N == 0) return out;
  const at::Tensor contiguous = rows.contiguous();
  tiles_product(quantize(contiguous.data_ptr<float>(), M, K), M, K, tiles, type, out.data_ptr<float>(), N);
  return out;
}

}  // namespace

// x [M, K] float32 times the tiled weight's transpose: [M, out_features] float32.
at::Tensor block_gemm_tiles(const at::Tensor& x, const at::Tensor& tiles, int64_t type, int64_t out_features) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "block_gemm_tiles: x must be float32 [M, K]");
  return tiles_gemm(x, x.size(1), tiles, type, out_features, quantize_rows);
}

// silu(gate) * up of gate_up [M, 2K] times the tiled weight's transpose (the MLP's down
// projection): block_gemm_tiles(silu_and_mul(gate_up), ...) bit for bit, with the activations
// quantized as silu_and_mul makes them (quantize_silu_mul_rows) instead of going through memory.
at::Tensor silu_mul_block_gemm_tiles(const at::Tensor& gate_up, const at::Tensor& tiles, int64_t type,
                                     int64_t out_features) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.scalar_type() == at::kFloat && gate_up.size(1) % 2 == 0,
              "silu_mul_block_gemm_tiles: gate_up must be float32 [M, 2K]");
  return tiles_gemm(gate_up, gate_up.size(1) / 2, tiles, type, out_features, quantize_silu_mul_rows);
}

}  // namespace pagoda

TORCH_LIBRARY_FRAGMENT(pagoda, m) {
  m.def("block_repack_tiles(Tensor weight, int block_type, int in_features) -> Tensor");
  m.def("block_gemm_tiles(Tensor x, Tensor tiles, int block_type, int out_features) -> Tensor");
  m.def("silu_mul_block_gemm_tiles(Tensor gate_up, Tensor tiles, int block_type, int out_features) -> Tensor");
  // Which instruction set this build's tile GEMM uses: avx512-vnni, avx-vnni, avx2, scalar.
  m.def("block_gemm_tiles_isa() -> str", []() { return std::string(isa_path()); });
}

TORCH_LIBRARY_IMPL(pagoda, CPU, m) {
  m.impl("block_repack_tiles", &pagoda::block_repack_tiles);
  m.impl("block_gemm_tiles", &pagoda::block_gemm_tiles);
  m.impl("silu_mul_block_gemm_tiles", &pagoda::silu_mul_block_gemm_tiles);
}
