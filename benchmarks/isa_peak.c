// Register-only loops that measure one instruction's peak throughput on this CPU (used by
// matmul_kernels.py, built with `cc -O3 -march=native -shared`). Each loop keeps ACC independent
// accumulators so the instruction's latency is hidden, touches no memory, and returns a checksum
// so the compiler cannot drop it; it returns -1 where the build lacks its instruction set. One
// call is one thread: the benchmark calls them from Python threads (ctypes releases the GIL), so
// that no second OpenMP runtime spins beside torch's.
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ACC 12

static long reduce_epi32_512(__m512i* acc) {
  __m512i s = acc[0];
  for (int i = 1; i < ACC; ++i) s = _mm512_add_epi32(s, acc[i]);
  return _mm512_reduce_add_epi32(s);
}

// fp32 FMA, 16 lanes: 32 FLOP per instruction.
double fma512(long iters) {
#ifdef __AVX512F__
  double total = 0;
  {
    __m512 acc[ACC];
    const __m512 a = _mm512_set1_ps(1.0000001f), b = _mm512_set1_ps(0.9999999f);
    for (int i = 0; i < ACC; ++i) acc[i] = _mm512_set1_ps((float)i);
    for (long it = 0; it < iters; ++it)
#pragma GCC unroll 16
      for (int i = 0; i < ACC; ++i) acc[i] = _mm512_fmadd_ps(acc[i], a, b);
    for (int i = 1; i < ACC; ++i) acc[0] = _mm512_add_ps(acc[0], acc[i]);
    total += _mm512_reduce_add_ps(acc[0]);
  }
  return total;
#else
  (void)iters;
  return -1;
#endif
}

// fp32 FMA, 8 lanes: 16 FLOP per instruction (AVX2 + FMA, the float peak of CPUs without AVX-512).
double fma256(long iters) {
#if defined(__AVX2__) && defined(__FMA__)
  double total = 0;
  {
    __m256 acc[ACC];
    const __m256 a = _mm256_set1_ps(1.0000001f), b = _mm256_set1_ps(0.9999999f);
    for (int i = 0; i < ACC; ++i) acc[i] = _mm256_set1_ps((float)i);
    for (long it = 0; it < iters; ++it)
#pragma GCC unroll 16
      for (int i = 0; i < ACC; ++i) acc[i] = _mm256_fmadd_ps(acc[i], a, b);
    for (int i = 1; i < ACC; ++i) acc[0] = _mm256_add_ps(acc[0], acc[i]);
    float out[8];
    _mm256_storeu_ps(out, acc[0]);
    for (int i = 0; i < 8; ++i) total += out[i];
  }
  return total;
#else
  (void)iters;
  return -1;
#endif
}

// u8 x s8 -> s32 dot products of 4, 64 lanes: 128 OP per instruction (vpdpbusd zmm).
double vnni512(long iters) {
#if defined(__AVX512VNNI__) && defined(__AVX512F__)
  long total = 0;
  {
    __m512i acc[ACC];
    const __m512i a = _mm512_set1_epi8(1), b = _mm512_set1_epi8(-1);
    for (int i = 0; i < ACC; ++i) acc[i] = _mm512_set1_epi32(i);
    for (long it = 0; it < iters; ++it)
#pragma GCC unroll 16
      for (int i = 0; i < ACC; ++i) acc[i] = _mm512_dpbusd_epi32(acc[i], a, b);
    total += reduce_epi32_512(acc);
  }
  return (double)total;
#else
  (void)iters;
  return -1;
#endif
}

// The same with AVX-VNNI, 32 lanes: 64 OP per instruction (vpdpbusd ymm, VEX encoded).
double avx_vnni256(long iters) {
#ifdef __AVXVNNI__
  long total = 0;
  {
    __m256i acc[ACC];
    const __m256i a = _mm256_set1_epi8(1), b = _mm256_set1_epi8(-1);
    for (int i = 0; i < ACC; ++i) acc[i] = _mm256_set1_epi32(i);
    for (long it = 0; it < iters; ++it)
#pragma GCC unroll 16
      for (int i = 0; i < ACC; ++i) acc[i] = _mm256_dpbusd_avx_epi32(acc[i], a, b);
    __m256i s = acc[0];
    for (int i = 1; i < ACC; ++i) s = _mm256_add_epi32(s, acc[i]);
    int out[8];
    _mm256_storeu_si256((__m256i*)out, s);
    for (int i = 0; i < 8; ++i) total += out[i];
  }
  return (double)total;
#else
  (void)iters;
  return -1;
#endif
}

// AVX2's int8 dot product without VNNI. STEP is one accumulator's update from operand B; the
// empty asm makes each B look new (4 accumulators, 2 operands: more would not fit the 16 registers), so the compiler cannot hoist the (otherwise loop-invariant)
// products out of the loop. Named variables, not arrays: GCC keeps an array that an asm touches
// on the stack, and the loop would then time store-to-load forwarding, not the instructions.
#define AVX2_LOOP(STEP, INIT, FINISH)                                                     \
  __m256i a0 = INIT(0), a1 = INIT(1), a2 = INIT(2), a3 = INIT(3);                              \
  const __m256i x1 = _mm256_set1_epi8(1), x2 = _mm256_set1_epi8(2); /* two, or CSE halves it */ \
  __m256i b0 = _mm256_set1_epi8(-1), b1 = _mm256_set1_epi8(-2);                                \
  for (long it = 0; it < iters * 3; ++it) { /* 3 x 4 = the other loops' 12 per iteration */   \
    __asm__ volatile("" : "+x"(b0), "+x"(b1));                                                \
    a0 = STEP(a0, x1, b0); a1 = STEP(a1, x1, b1); a2 = STEP(a2, x2, b0); a3 = STEP(a3, x2, b1);  \
  }                                                                                            \
  __m256i s = _mm256_add_epi32(_mm256_add_epi32(FINISH(a0), FINISH(a1)),                      \
                               _mm256_add_epi32(FINISH(a2), FINISH(a3)));                     \
  int out[8];                                                                                  \
  _mm256_storeu_si256((__m256i*)out, s);                                                       \
  long total = 0;                                                                              \
  for (int i = 0; i < 8; ++i) total += out[i];                                                 \
  return (double)total;

#ifdef __AVX2__
static inline __m256i ones16(void) { return _mm256_set1_epi16(1); }
// maddubs (u8 x s8 pairs -> s16), madd with ones (-> s32), add: three instructions, 64 OP.
static inline __m256i step_widened(__m256i acc, __m256i x, __m256i b) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(x, b), ones16()));
}
// The mix the AVX2 tile kernel runs (csrc/block_gemm_tiles.cpp): maddubs into int16 sums, the
// widening madd left to once a block. Two instructions for 32 products, 64 OP.
static inline __m256i step_int16(__m256i acc, __m256i x, __m256i b) {
  return _mm256_add_epi16(acc, _mm256_maddubs_epi16(x, b));
}
static inline __m256i init32(int i) { return _mm256_set1_epi32(i); }
static inline __m256i init16(int i) { return _mm256_set1_epi16((short)i); }
static inline __m256i same(__m256i v) { return v; }
static inline __m256i widen(__m256i v) { return _mm256_madd_epi16(v, ones16()); }
#endif

double avx2_maddubs256(long iters) {
#ifdef __AVX2__
  AVX2_LOOP(step_widened, init32, same)
#else
  (void)iters;
  return -1;
#endif
}

double avx2_maddubs_i16_256(long iters) {
#ifdef __AVX2__
  AVX2_LOOP(step_int16, init16, widen)
#else
  (void)iters;
  return -1;
#endif
}

// bf16 tile products on AMX, 4 independent 16 x 16 fp32 sums of 16 x 32 by 32 x 16: 16,384 FLOP
// per tdpbf16ps. The tiles are loaded once; -1 without AMX-BF16 or where the kernel refuses the
// tile state (arch_prctl ARCH_REQ_XCOMP_PERM).
double amx_bf16(long iters) {
#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
  if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) != 0) return -1;
  struct __attribute__((packed)) {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
  } cfg;
  memset(&cfg, 0, sizeof cfg);
  cfg.palette = 1;
  for (int t = 0; t < 8; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  _tile_loadconfig(&cfg);
  static uint16_t ones[16 * 32] __attribute__((aligned(64)));
  for (int i = 0; i < 16 * 32; ++i) ones[i] = 0x3f80;  // bf16 1.0
  _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
  _tile_loadd(4, ones, 64); _tile_loadd(5, ones, 64); _tile_loadd(6, ones, 64); _tile_loadd(7, ones, 64);
  for (long it = 0; it < iters; ++it) {
    _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
  }
  float out[256] __attribute__((aligned(64)));
  _tile_stored(0, out, 64);
  _tile_release();
  return out[0];
#else
  (void)iters;
  return -1;
#endif
}
