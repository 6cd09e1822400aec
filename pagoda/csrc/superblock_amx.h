// The super-block GEMM on AMX-INT8 tiles (Sapphire Rapids and later), for many activation rows
// under deterministic inference (outside it the bf16 route, superblock_amx_bf16.h, takes them).
//
// One tdpbsud multiplies 16 activation rows by 16 outputs over a block of 32 (Q6_K: a half of 16),
// where superblock_kernels.h's AVX-512 path spends 64 vpdpbusd. What is left are the float steps
// per block, superblock_kernels.h's own (finish_block): the same integer sums, the same float
// operations in the same order, so the same bits as every other path, and a row's result does not
// depend on which path its batch took. Those steps (4-5 vector instructions per 16 outputs, row and
// block of 32: the activations' scales are per 32) now bound the GEMM, so the tiles gain 1.06-1.2x
// over the AVX-512 path at 32-512 rows on the Sapphire Rapids measured, not the tile unit's 5-9x
// (benchmarks/README.md, "A Sapphire Rapids with AMX").
//
// Per block, a tile's codes are unpacked (codes512: the bytes vpdpbusd would multiply) into the
// layout a B tile takes, which is the tile's own: row j of the B tile holds, for each of the 16
// outputs, 4 consecutive inputs. The A tile is the activations' int8 codes, copied block by block
// (Rows::blocked; read in place, K bytes apart, 16 rows fell in one or two cache sets).
// Tiles: 0..3 the sums C[chunk][tile], 4..5 A[chunk], 6..7 B[tile]; a chunk is 16 activation
// rows, so a call covers up to 32 rows against up to 2 weight tiles (32 outputs).
#pragma once

#include <vector>

#include "superblock_kernels.h"

#if defined(PAGODA_AVX512_VNNI) && defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define PAGODA_AMX_INT8 1
#include <sys/syscall.h>
#include <unistd.h>

namespace pagoda::superblock {

// Linux gives a process the (8 KiB) AMX tile state only once it asks; where it refuses (an old
// kernel, a VM that hides it) the AVX-512 path runs.
inline bool amx_usable() {
  static const bool usable = [] {
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return usable;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// rows0 / rows1 activation rows in the two chunks (rows1 may be 0: its tiles stay unconfigured),
// `a_bytes` bytes of an A row (the inputs a product covers), `b_rows` rows of a B tile.
inline void configure_tiles(int rows0, int rows1, int a_bytes, int b_rows) {
  TileConfig cfg;
  const int rows[2] = {rows0, rows1};
  for (int t = 0; t < 2; ++t) {
    if (rows[t] == 0) continue;
    cfg.rows[2 * t] = cfg.rows[2 * t + 1] = cfg.rows[4 + t] = static_cast<uint8_t>(rows[t]);
    cfg.colsb[2 * t] = cfg.colsb[2 * t + 1] = 64;
    cfg.colsb[4 + t] = static_cast<uint16_t>(a_bytes);
  }
  cfg.rows[6] = cfg.rows[7] = static_cast<uint8_t>(b_rows);
  cfg.colsb[6] = cfg.colsb[7] = 64;
  _tile_loadconfig(&cfg);
}

// This thread's scratch of n elements, 64-byte aligned, reused from call to call.
template <typename E>
E* scratch(int64_t n) {
  thread_local std::vector<E> buffer;
  buffer.resize(n + 64 / sizeof(E));
  const uintptr_t address = reinterpret_cast<uintptr_t>(buffer.data());
  return buffer.data() + (64 - address % 64) % 64 / sizeof(E);
}

// For the `count` tiles from `tiles` (outputs n0 ..) two at a time (the last may be alone):
// prepare(c, tile) for each of the pair, then gemm(CH, C, tiles, m, rows, n) for rows m0 .. m1, 32
// (two chunks of 16) at a time, CH and C as std::integral_constant.
template <typename Prepare, typename Gemm>
void by_tile_pairs(const uint8_t* tiles, int64_t tile_bytes, int64_t count, int64_t m0, int64_t m1, int64_t n0,
                   const Prepare& prepare, const Gemm& gemm) {
  using One = std::integral_constant<int, 1>;
  using Two = std::integral_constant<int, 2>;
  for (int64_t t = 0; t < count; t += 2, tiles += 2 * tile_bytes, n0 += 2 * COLS) {
    const bool pair = count - t >= 2;
    prepare(0, tiles);
    if (pair) prepare(1, tiles + tile_bytes);
    for (int64_t m = m0; m < m1; m += 32) {
      const int rows = static_cast<int>(std::min<int64_t>(32, m1 - m));
      if (rows > 16 && pair) gemm(Two{}, Two{}, tiles, m, rows, n0);
      else if (rows > 16) gemm(Two{}, One{}, tiles, m, rows, n0);
      else if (pair) gemm(One{}, Two{}, tiles, m, rows, n0);
      else gemm(One{}, One{}, tiles, m, rows, n0);
    }
  }
}

// A tile's codes, unpacked into the B tile's layout, block after block (8 rows of 64 bytes each),
// before any is multiplied: a tile load of bytes the vector units have just stored waits for them
// (~65 cycles a block, measured on the Sapphire Rapids: 3x the product itself).
template <int64_t T>
void unpack_tile(const uint8_t* tile, int64_t ns, uint8_t* codes) {
  constexpr int64_t BLOCKS = blocks_per_super(T), SB = scale_bytes(T), CB = block_code_bytes(T), REC = record_bytes(T);
  for (int64_t b = 0; b < ns * BLOCKS; ++b, codes += 8 * 64) {
    const uint8_t* block = tile + b / BLOCKS * REC + SB + b % BLOCKS * CB;
    __m512i high[1];
    for (int v = 0; v < high_vectors(T); ++v) high[v] = _mm512_loadu_si512(block + 256 + 64 * v);
    for (int j = 0; j < 4; ++j) {
      __m512i lo, hi;
      codes512<T>(block, high, j, lo, hi);
      _mm512_store_si512(codes + 64 * j, lo);
      _mm512_store_si512(codes + 64 * (4 + j), hi);
    }
  }
}

// The integer sums of block b: chunks CH (16 rows each) x tiles C, from the activations' blocked
// codes and the tiles' unpacked ones, stored to sums[chunk][tile] (16 rows x 16 int32). GCC's tile
// intrinsics are macros that paste the tile number into the instruction's text, so the number
// cannot be a template or function argument: a macro takes the place of a helper.
#define PAGODA_TILE_SUMS(SUM, A, B, OUT) \
  do {                                   \
    _tile_zero(SUM);                     \
    _tile_dpbsud(SUM, A, B);             \
    _tile_stored(SUM, OUT, 64);          \
  } while (0)

template <int CH, int C>
inline void tile_products(const int8_t* a, const uint8_t* const* codes, int32_t (*sums)[2][256]) {
  _tile_loadd(4, a, BLOCK);
  if constexpr (CH == 2) _tile_loadd(5, a + 16 * BLOCK, BLOCK);
  _tile_loadd(6, codes[0], 64);
  if constexpr (C == 2) _tile_loadd(7, codes[1], 64);
  PAGODA_TILE_SUMS(0, 4, 6, sums[0][0]);
  if constexpr (C == 2) PAGODA_TILE_SUMS(1, 4, 7, sums[0][1]);
  if constexpr (CH == 2) PAGODA_TILE_SUMS(2, 5, 6, sums[1][0]);
  if constexpr (CH == 2 && C == 2) PAGODA_TILE_SUMS(3, 5, 7, sums[1][1]);
}
#undef PAGODA_TILE_SUMS

// `rows` (1..32) activation rows against C tiles whose codes unpack_tile wrote (codes[c]): what
// gemm_avx512<T, rows, C> computes. Block b + 1's integer sums are started before block b's float
// steps, so the tile unit and the vector units can work side by side.
template <int64_t T, int CH, int C>
void gemm_amx(const uint8_t* tiles, int64_t tile_bytes, const uint8_t* const* codes, int64_t ns, const Rows& x,
              int rows, float* y, int64_t ldy, int64_t N, int64_t n0) {
  constexpr int64_t BLOCKS = blocks_per_super(T), REC = record_bytes(T);
  constexpr int H = T == Q6_K ? 2 : 1, STEP = BLOCK / H;
  configure_tiles(std::min(rows, 16), rows - std::min(rows, 16), STEP, STEP / 4);
  alignas(64) int32_t sums[2][H][2][2][256];
  const auto start = [&](int64_t b) {
    for (int h = 0; h < H; ++h) {  // Q6_K: B rows 0..3 for elements 0..15, 4..7 for 16..31
      const uint8_t* part[2] = {codes[0] + b * 512 + 256 * h, codes[C - 1] + b * 512 + 256 * h};
      tile_products<CH, C>(x.blocked + b * x.block_stride + STEP * h, part, sums[b & 1][h]);
    }
  };
  __m512 acc[32][C];
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  const int64_t blocks = ns * BLOCKS;
  start(0);
  for (int64_t b = 0; b < blocks; ++b) {
    if (b + 1 < blocks) start(b + 1);
    __m512 scale[C][H], mins[C];
    for (int c = 0; c < C; ++c) {
      const uint8_t* rec = tiles + c * tile_bytes + b / BLOCKS * REC;
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec)));
      const __m512 dmin = has_mins(T) ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 32)))
                                      : _mm512_setzero_ps();
      block_scales<T>(rec, d, dmin, b % BLOCKS, scale[c], mins[c]);
    }
    for (int r = 0; r < rows; ++r)
      for (int c = 0; c < C; ++c) {
        __m512i isum[H];
        for (int h = 0; h < H; ++h) isum[h] = _mm512_load_si512(sums[b & 1][h][r / 16][c] + 16 * (r % 16));
        acc[r][c] = finish_block<T>(acc[r][c], isum, scale[c], mins[c], x, r, b);
      }
  }
  _tile_release();
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < C; ++c) store_outputs(acc[r][c], y + r * ldy, N, n0 + c * COLS);
}

// Activation rows m0 .. m1 of `all` against `count` tiles from `tiles` (outputs n0 ..): each pair
// of tiles unpacked once, then taken by 32 rows at a time.
template <int64_t T>
void amx_rows_of_tiles(const uint8_t* tiles, int64_t tile_bytes, int64_t ns, int64_t count, const Rows& all, int64_t m0,
                       int64_t m1, float* y, int64_t ldy, int64_t N, int64_t n0) {
  const int64_t bytes = ns * blocks_per_super(T) * 8 * 64;
  uint8_t* base = scratch<uint8_t>(2 * bytes);
  const uint8_t* codes[2] = {base, base + bytes};
  by_tile_pairs(tiles, tile_bytes, count, m0, m1, n0,
                [&](int c, const uint8_t* tile) { unpack_tile<T>(tile, ns, base + c * bytes); },
                [&](auto ch, auto cols, const uint8_t* pair, int64_t m, int rows, int64_t n) {
                  constexpr int CH = decltype(ch)::value, C = decltype(cols)::value;
                  gemm_amx<T, CH, C>(pair, tile_bytes, codes, ns, all.from(m), rows, y + m * ldy, ldy, N, n);
                });
}

}  // namespace pagoda::superblock
#endif  // AMX-INT8
