// ggml's blocks of 32 (Q4_0, Q4_1, Q8_0) and activations quantized to int8 blocks as llama.cpp
// does: shared by block_matmul.cpp (the integer kernel on the blocks as they are) and
// block_gemm_tiles.cpp (the GEMM on a copy repacked into tiles of 16 rows).
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "vec_math.h"

#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif
#if defined(__AVX2__) && defined(__FMA__)
#define PAGODA_AVX2 1
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define PAGODA_AVX512_VNNI 1
#elif defined(__AVXVNNI__)
#define PAGODA_AVX_VNNI 1
#endif
#endif

namespace pagoda::ggml {

// The instruction set the build's integer paths use: avx512-vnni, avx-vnni, avx2 or scalar.
inline const char* isa_path() {
#if defined(PAGODA_AVX512_VNNI)
  return "avx512-vnni";
#elif defined(PAGODA_AVX_VNNI)
  return "avx-vnni";
#elif defined(PAGODA_AVX2)
  return "avx2";
#else
  return "scalar";
#endif
}

constexpr int64_t QK = 32;                      // elements per block
enum BlockType : int64_t { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8 };  // GGMLQuantizationType values


inline int64_t block_bytes(int64_t type) {
  switch (type) {
    case Q4_0: return 18;  // fp16 d, 16 bytes of nibbles
    case Q4_1: return 20;  // fp16 d, fp16 m, 16 bytes of nibbles
    case Q8_0: return 34;  // fp16 d, 32 int8
  }
  TORCH_CHECK(false, "block_matmul: unsupported block type ", type, " (Q4_0=2, Q4_1=3, Q8_0=8)");
}

inline float half_to_float(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
#ifdef __F16C__
  return _cvtsh_ss(bits);
#else
  return c10::detail::fp16_ieee_to_fp32_value(bits);
#endif
}

// The Q4 blocks' offset term for one block: mw = -8 dw (Q4_0) or the stored m (Q4_1).
inline float block_min(const uint8_t* blk, int64_t type, float dw) {
  return type == Q4_0 ? -8.f * dw : half_to_float(blk + 2);
}

inline int64_t codes_offset(int64_t type) { return type == Q4_1 ? 4 : 2; }  // after d (and Q4_1's m)

// A pointer to values of T that someone else owns (indexed as the std::vector it replaced).
template <typename T>
struct Span {
  T* ptr = nullptr;
  T* data() const { return ptr; }
  T& operator[](int64_t i) const { return ptr[i]; }
};

// Memory that one thread's quantized activations reuse from call to call. Each projection used
// to allocate and zero a fresh copy (at a prefill's 2,048 rows, 1.2-3 MB written by the calling
// thread alone while the OpenMP workers waited, and its pages faulted in again wherever malloc had
// handed them back): ~1.5 % of a prefill's samples. It grows to the largest call and is never
// cleared (every byte a call reads, that call writes first).
struct ActivationScratch {
  std::unique_ptr<uint8_t[]> bytes;
  size_t size = 0;
  bool in_use = false;  // a second set alive on this thread (none today) gets its own memory
};

inline ActivationScratch& thread_scratch() {
  thread_local ActivationScratch scratch;
  return scratch;
}

// Activations as int8 blocks: q [M, K], d, s and sum [M, K / 32], in this thread's scratch.
class QuantizedActivations {
 public:
  Span<int8_t> q;
  Span<float> d, s;
  Span<int32_t> sum;  // sum(q) per block (the tile GEMM takes its codes' offset back with it)

  QuantizedActivations(int64_t M, int64_t K) {
    const size_t codes = static_cast<size_t>(M * K), blocks = static_cast<size_t>(M * (K / QK));
    const size_t bytes = codes + blocks * (2 * sizeof(float) + sizeof(int32_t)) + ALIGN;
    uint8_t* base;
    ActivationScratch& scratch = thread_scratch();
    if (!scratch.in_use) {
      if (scratch.size < bytes) {  // default-initialized: not zeroed
        scratch.bytes.reset();  // the old block goes first: never both at once
        scratch.bytes.reset(new uint8_t[bytes]);
        scratch.size = bytes;
      }
      scratch.in_use = leased_ = true;
      base = scratch.bytes.get();
    } else {
      own_.reset(new uint8_t[bytes]);
      base = own_.get();
    }
    base += (ALIGN - reinterpret_cast<uintptr_t>(base) % ALIGN) % ALIGN;
    q.ptr = reinterpret_cast<int8_t*>(base);
    d.ptr = reinterpret_cast<float*>(base + codes);  // codes: a multiple of 32 bytes
    s.ptr = d.ptr + blocks;
    sum.ptr = reinterpret_cast<int32_t*>(s.ptr + blocks);
  }
  QuantizedActivations(QuantizedActivations&& other) noexcept
      : q(other.q), d(other.d), s(other.s), sum(other.sum), own_(std::move(other.own_)), leased_(other.leased_) {
    other.leased_ = false;
  }
  QuantizedActivations(const QuantizedActivations&) = delete;
  QuantizedActivations& operator=(const QuantizedActivations&) = delete;
  QuantizedActivations& operator=(QuantizedActivations&&) = delete;
  ~QuantizedActivations() {
    if (leased_) thread_scratch().in_use = false;
  }

 private:
  static constexpr size_t ALIGN = 64;
  std::unique_ptr<uint8_t[]> own_;
  bool leased_ = false;
};

// One block of 32: d = amax / 127, q = x * (1 / d) rounded half to even, s = d * sum(q); returns
// sum(q). Every path below computes exactly these values.
#if defined(PAGODA_AVX512_VNNI)
inline int32_t quantize_block(const float* src, int8_t* q, float* d_out, float* s_out) {
  const __m512 v0 = _mm512_loadu_ps(src), v1 = _mm512_loadu_ps(src + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
  const float d = amax / 127.f;
  const __m512 inv = _mm512_set1_ps(d > 0.f ? 1.f / d : 0.f);
  constexpr int round = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  const __m512i i0 = _mm512_cvt_roundps_epi32(_mm512_mul_ps(v0, inv), round);
  const __m512i i1 = _mm512_cvt_roundps_epi32(_mm512_mul_ps(v1, inv), round);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtsepi32_epi8(i0));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtsepi32_epi8(i1));
  const int32_t sum = _mm512_reduce_add_epi32(_mm512_add_epi32(i0, i1));
  *d_out = d;
  *s_out = d * static_cast<float>(sum);
  return sum;
}
#elif defined(PAGODA_AVX2)
inline int32_t quantize_block(const float* src, int8_t* q, float* d_out, float* s_out) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 v[4];
  __m256 amax = _mm256_setzero_ps();
  for (int k = 0; k < 4; ++k) {
    v[k] = _mm256_loadu_ps(src + 8 * k);
    amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[k]));
  }
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  const float d = _mm_cvtss_f32(m4) / 127.f;
  const __m256 inv = _mm256_set1_ps(d > 0.f ? 1.f / d : 0.f);
  __m256i i32[4];
  for (int k = 0; k < 4; ++k)
    i32[k] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[k], inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  const __m256i sum32 = _mm256_add_epi32(_mm256_add_epi32(i32[0], i32[1]), _mm256_add_epi32(i32[2], i32[3]));
  __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(i32[0], i32[1]), _mm256_packs_epi32(i32[2], i32[3]));
  packed = _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));  // undo the lane interleave
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), packed);
  __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum32), _mm256_extracti128_si256(sum32, 1));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
  const int32_t sum = _mm_cvtsi128_si32(s4);
  *d_out = d;
  *s_out = d * static_cast<float>(sum);
  return sum;
}
#else
inline int32_t quantize_block(const float* src, int8_t* q, float* d_out, float* s_out) {
  float amax = 0.f;
  for (int64_t j = 0; j < QK; ++j) amax = std::max(amax, std::fabs(src[j]));
  const float d = amax / 127.f;
  const float inv = d > 0.f ? 1.f / d : 0.f;
  int32_t sum = 0;
  for (int64_t j = 0; j < QK; ++j) {
    q[j] = static_cast<int8_t>(std::nearbyint(src[j] * inv));
    sum += q[j];
  }
  *d_out = d;
  *s_out = d * static_cast<float>(sum);
  return sum;
}
#endif

inline QuantizedActivations quantize_rows(const float* x, int64_t M, int64_t K) {
  const int64_t nb = K / QK;
  QuantizedActivations a(M, K);
  at::parallel_for(0, M * nb, 256, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)  // rows are contiguous, so block i of the flat array
      a.sum[i] = quantize_block(x + i * QK, a.q.data() + i * QK, &a.d[i], &a.s[i]);
  });
  return a;
}

// silu(gate) * up of gate_up [M, 2I], quantized as quantize_rows quantizes it: the down
// projection's activations, without writing silu_and_mul's float rows ([2,048, 1,536] is 12.6 MB
// at a prefill's rows, beyond the caches) and reading them back. A block's floats are
// silu_mul_row's for its 32 elements, which are those of the whole row's call, so the codes are
// the same bits as quantize_rows(silu_and_mul(gate_up)).
inline QuantizedActivations quantize_silu_mul_rows(const float* gate_up, int64_t M, int64_t I) {
  const int64_t nb = I / QK;
  QuantizedActivations a(M, I);
  at::parallel_for(0, M * nb, 64, [&](int64_t begin, int64_t end) {
    alignas(64) float y[QK];
    for (int64_t i = begin; i < end; ++i) {
      const float* g = gate_up + i / nb * 2 * I + i % nb * QK;
      silu_mul_row(g, g + I, y, QK);
      a.sum[i] = quantize_block(y, a.q.data() + i * QK, &a.d[i], &a.s[i]);
    }
  });
  return a;
}

}  // namespace pagoda::ggml
