// Many activation rows (a prefill chunk, a large decode batch) against super-block tiles as a bf16
// GEMM on AMX tiles, where the CPU has AMX-BF16 and inference is not batch-invariant.
//
// The integer route (superblock_amx.h) is bound by its float steps per block of 32 (the scales of
// the int8 activations and of the weights' blocks). Here each work item dequantizes its weight
// tiles once into bf16, in the B-tile layout (per block of 32 inputs, 16 rows of 16 outputs x 2
// consecutive inputs), and tdpbf16ps accumulates in fp32 over the whole K in the tile registers:
// nothing per block but the tile instructions, and the dequantization is shared by all the rows.
// The activations are rounded to bf16 instead of int8 per 32 (relative error <= 2^-9 each, as the
// weights rounded to bf16 and as block_matmul's oneDNN route, which this mirrors for the super-block
// formats). Like that route, a row's result depends on how many rows came with it, so it is taken
// only outside deterministic inference (pagoda::batch_invariant).
#pragma once

#include "superblock_amx.h"

#if defined(PAGODA_AMX_INT8) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define PAGODA_AMX_BF16 1

namespace pagoda::superblock {

// bf16 values of one block of one tile (16 outputs x 32 inputs) in the B tile's layout: row r holds
// inputs 2r, 2r + 1 of each output.
constexpr int64_t BF16_BLOCK = 16 * 32;

// Word i of the product of cvtne2ps(second, first) (first's 16 values, then second's) that goes
// to word i of a B-tile row: output o's pair of inputs side by side, words 2o and 2o + 1.
alignas(64) inline constexpr uint16_t PAIR_WORDS[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                                       8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};

// One vector of codes (lane o: output o's 4 consecutive inputs, a byte each, as codes512 gives
// them) → the 2 B-tile rows of those inputs' pairs: w = scale * code - bias per output, rounded
// to bf16. Byte k of every lane is input k of every output, so the per-output scale and bias
// apply lane for lane.
inline void store_pairs(__m512i codes, __m512 scale, __m512 bias, uint16_t* rows) {
  const __m512i byte = _mm512_set1_epi32(0xFF);
  const auto weights = [&](__m512i c) { return _mm512_fmsub_ps(scale, _mm512_cvtepi32_ps(c), bias); };
  const __m512 w0 = weights(_mm512_and_si512(codes, byte));
  const __m512 w1 = weights(_mm512_and_si512(_mm512_srli_epi32(codes, 8), byte));
  const __m512 w2 = weights(_mm512_and_si512(_mm512_srli_epi32(codes, 16), byte));
  const __m512 w3 = weights(_mm512_srli_epi32(codes, 24));
  const __m512i pairs = _mm512_load_si512(PAIR_WORDS);
  _mm512_storeu_si512(rows, _mm512_permutexvar_epi16(pairs, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(w1, w0))));
  _mm512_storeu_si512(rows + 32,
                      _mm512_permutexvar_epi16(pairs, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(w3, w2))));
}

// A tile's weights for all K as bf16 B tiles, block after block (value = d * sc * (code - offset)
// - dmin * mn, as superblock_rows computes it, before the rounding).
template <int64_t T>
void dequantize_tile_bf16(const uint8_t* tile, int64_t ns, uint16_t* out) {
  constexpr int64_t BLOCKS = blocks_per_super(T), SB = scale_bytes(T), CB = block_code_bytes(T), REC = record_bytes(T);
  constexpr int H = T == Q6_K ? 2 : 1;
  constexpr float OFFSET = is_iq4(T) ? 128.f : static_cast<float>(code_offset(T));
  for (int64_t s = 0; s < ns; ++s) {
    const uint8_t* rec = tile + s * REC;
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec)));
    const __m512 dmin = has_mins(T) ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 32)))
                                    : _mm512_setzero_ps();
    for (int64_t sub = 0; sub < BLOCKS; ++sub, out += BF16_BLOCK) {
      __m512 scale[H], mins = _mm512_setzero_ps(), bias[H];
      block_scales<T>(rec, d, dmin, sub, scale, mins);
      for (int h = 0; h < H; ++h) bias[h] = _mm512_fmadd_ps(scale[h], _mm512_set1_ps(OFFSET), mins);
      const uint8_t* block = rec + SB + sub * CB;
      __m512i high[1];
      for (int v = 0; v < high_vectors(T); ++v) high[v] = _mm512_loadu_si512(block + 256 + 64 * v);
      for (int j = 0; j < 4; ++j) {
        __m512i lo, hi;
        codes512<T>(block, high, j, lo, hi);
        store_pairs(lo, scale[0], bias[0], out + 2 * j * 32);         // inputs 4j .. 4j + 3
        store_pairs(hi, scale[H - 1], bias[H - 1], out + (8 + 2 * j) * 32);  // 16 + 4j ..
      }
    }
  }
}

// `rows` (1..32) rows of bf16 activations (blocked: block b's rows at a + b * stride, 32 apart)
// against C tiles of dequantized weights w[c] (nb blocks each), outputs n0 ...
template <int CH, int C>
void gemm_bf16(const uint16_t* const* w, int64_t nb, const uint16_t* a, int64_t stride, int rows, float* y,
               int64_t ldy, int64_t N, int64_t n0) {
  // tiles 0..3 the sums C[chunk][tile] (fp32), 4..5 A[chunk] (rows x 32 bf16), 6..7 B[tile]
  configure_tiles(std::min(rows, 16), rows - std::min(rows, 16), 64, 16);
  _tile_zero(0);
  if constexpr (C == 2) _tile_zero(1);
  if constexpr (CH == 2) _tile_zero(2);
  if constexpr (CH == 2 && C == 2) _tile_zero(3);
  for (int64_t b = 0; b < nb; ++b) {
    _tile_loadd(4, a + b * stride, 64);
    if constexpr (CH == 2) _tile_loadd(5, a + b * stride + 16 * 32, 64);
    _tile_loadd(6, w[0] + b * BF16_BLOCK, 64);
    if constexpr (C == 2) _tile_loadd(7, w[1] + b * BF16_BLOCK, 64);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (C == 2) _tile_dpbf16ps(1, 4, 7);
    if constexpr (CH == 2) _tile_dpbf16ps(2, 5, 6);
    if constexpr (CH == 2 && C == 2) _tile_dpbf16ps(3, 5, 7);
  }
  alignas(64) float sums[4][256];
  _tile_stored(0, sums[0], 64);
  if constexpr (C == 2) _tile_stored(1, sums[1], 64);
  if constexpr (CH == 2) _tile_stored(2, sums[2], 64);
  if constexpr (CH == 2 && C == 2) _tile_stored(3, sums[3], 64);
  _tile_release();
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < C; ++c)
      store_outputs(_mm512_load_ps(sums[2 * (r / 16) + c] + 16 * (r % 16)), y + r * ldy, N, n0 + 16 * c);
}

// x [M, K] as bf16 block by block ([K / 32][M][32]: a block's rows one run for the tile loads).
inline at::Tensor blocked_bf16(const float* x, int64_t M, int64_t K) {
  at::Tensor out = at::empty({M * K}, at::kBFloat16);  // every element written below
  uint16_t* o = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  at::parallel_for(0, K / BLOCK, 16, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b)
      for (int64_t m = 0; m < M; ++m) {
        const float* src = x + m * K + b * BLOCK;
        const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + 16), _mm512_loadu_ps(src));
        _mm512_storeu_si512(o + (b * M + m) * BLOCK, reinterpret_cast<__m512i>(v));
      }
  });
  return out;
}

// Rows m0 .. m1 of the blocked activations against `count` tiles from `tiles` (outputs n0 ..):
// each pair of tiles dequantized once, then taken by 32 rows at a time.
template <int64_t T>
void bf16_rows_of_tiles(const uint8_t* tiles, int64_t tile_bytes, int64_t ns, int64_t count, const uint16_t* a,
                        int64_t M, int64_t m0, int64_t m1, float* y, int64_t ldy, int64_t N, int64_t n0) {
  const int64_t nb = ns * blocks_per_super(T);
  uint16_t* base = scratch<uint16_t>(2 * nb * BF16_BLOCK);
  const uint16_t* w[2] = {base, base + nb * BF16_BLOCK};
  by_tile_pairs(tiles, tile_bytes, count, m0, m1, n0,
                [&](int c, const uint8_t* tile) { dequantize_tile_bf16<T>(tile, ns, base + c * nb * BF16_BLOCK); },
                [&](auto ch, auto cols, const uint8_t*, int64_t m, int rows, int64_t n) {
                  constexpr int CH = decltype(ch)::value, C = decltype(cols)::value;
                  gemm_bf16<CH, C>(w, nb, a + m * BLOCK, M * BLOCK, rows, y + m * ldy, ldy, N, n);
                });
}

}  // namespace pagoda::superblock
#endif  // AMX-BF16
