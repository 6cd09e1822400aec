// Register-only loops that measure one instruction's peak throughput on this CPU (used by
// matmul_kernels.py, built with `cc -O3 -march=native -shared`). Each loop keeps ACC independent
// accumulators so the instruction's latency is hidden, touches no memory, and returns a checksum
// so the compiler cannot drop it; it returns -1 where the build lacks its instruction set. One
// call is one thread: the benchmark calls them from Python threads (ctypes releases the GIL), so
// that no second OpenMP runtime spins beside torch's.
#include <immintrin.h>
#include <stdint.h>

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

// AVX2's int8 dot product: maddubs (u8 x s8 pairs -> s16), madd with ones (-> s32), add:
// three instructions for 32 products, 64 OP. The empty asm makes each b look new, so the
// compiler cannot hoist the (otherwise loop-invariant) maddubs/madd out of the loop.
double avx2_maddubs256(long iters) {
#ifdef __AVX2__
  long total = 0;
  {
    enum { N = 6 };  // 6 accumulators + 6 operands + 2 constants fit AVX2's 16 registers
    __m256i acc[N], b[N];
    const __m256i a = _mm256_set1_epi8(1), ones = _mm256_set1_epi16(1);
    for (int i = 0; i < N; ++i) acc[i] = _mm256_set1_epi32(i), b[i] = _mm256_set1_epi8((char)-i);
    for (long it = 0; it < iters * 2; ++it)  // 2 x 6 = the other loops' 12 per iteration
#pragma GCC unroll 16
      for (int i = 0; i < N; ++i) {
        __asm__ volatile("" : "+x"(b[i]));
        acc[i] = _mm256_add_epi32(acc[i], _mm256_madd_epi16(_mm256_maddubs_epi16(a, b[i]), ones));
      }
    __m256i s = acc[0];
    for (int i = 1; i < N; ++i) s = _mm256_add_epi32(s, acc[i]);
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
