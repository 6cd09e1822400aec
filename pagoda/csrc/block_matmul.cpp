// Matmul against weights kept in ggml's blocks of 32 (Q4_0, Q4_1, Q8_0): below GEMM_MIN_ROWS
// rows (and at every M under batch invariance) an integer kernel on the blocks as they are.
//
// As llama.cpp does, each activation row is quantized to int8 per block of 32 (scale dx, and
// sx = dx * sum(qx)), and each block's dot product runs in integers, scaled in fp32:
//   Q4_1:  sum_b  dw * dx * (qw . qx)  +  mw * sx      (qw in 0..15, w = dw * qw + mw)
//   Q4_0:  the same with mw = -8 dw                     (w = dw * (qw - 8))
//   Q8_0:  sum_b  dw * dx * (qw . qx)                   (qw in -127..127)
// At batch 1 a decode step streams the weights once, so their bytes (4.5-8.5 bits per weight
// instead of 32) are what sets its speed. From GEMM_MIN_ROWS rows the work is compute-bound and a
// library GEMM on a dequantized copy is faster (see there).
//
// Instruction sets, chosen at compile time from the build's -march (block_matmul_isa() names
// the one built; layers/cpu_kernels.py builds per ISA level):
//   avx512-vnni  vpdpbusd on 64-byte vectors: two weight rows' blocks side by side, against one
//                activation block broadcast to both halves
//   avx-vnni     vpdpbusd on 32-byte vectors (VEX; Alder Lake and later without AVX-512)
//   avx2         maddubs (u8 x s8 pairs -> s16; cannot saturate here: |q| <= 128, |x| <= 127)
//                then madd with ones (-> s32)
//   scalar       plain C++
// Every one of these paths gives the same bits. The integer part is exact; the float part is one
// fixed order per output (m, n), which each path reproduces:
//   - a block's 32 products become 8 int32 lanes, lane l = elements 4l .. 4l+3;
//   - 8 float accumulators, acc[l] = fma(dw * dx, float(lane l), acc[l]), block after block;
//   - the lanes summed as (l + l+4), then (l + l+2), then (0 + 1);
//   - plus, for Q4_0 / Q4_1, the sum over blocks of mw * sx, in block order, added last.
// Registered as torch.ops.pagoda.block_matmul (no pybind11: it compiles faster).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "ops.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "ggml_blocks.h"

namespace {

using namespace pagoda::ggml;

#ifdef PAGODA_AVX2
// The 8 lanes in the documented order: (l + l+4), (l + l+2), (0 + 1).
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// u8 x s8 dot products of 4: int32 lane l = sum of bytes 4l .. 4l+3's products (exact).
inline __m256i dot8(__m256i u, __m256i s) {
#if defined(PAGODA_AVX512_VNNI)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#elif defined(PAGODA_AVX_VNNI)
  return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

// One weight row against T activation rows (T <= 4): each weight block is unpacked once per tile.
template <int T>
void dot_row(const uint8_t* w, int64_t type, int64_t nb, const int8_t* qx, const float* dx, const float* sx,
             int64_t K, float* out, int64_t out_stride) {
  const int64_t bb = block_bytes(type);
  const __m256i low = _mm256_set1_epi8(0x0F);
  __m256 acc[T];
  float min_acc[T];
  for (int t = 0; t < T; ++t) acc[t] = _mm256_setzero_ps(), min_acc[t] = 0.f;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w + b * bb;
    _mm_prefetch(reinterpret_cast<const char*>(blk + 1024), _MM_HINT_T0);  // rows are contiguous: stream ahead
    const float dw = half_to_float(blk);
    if (type == Q8_0) {
      const __m256i qw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
      const __m256i aw = _mm256_sign_epi8(qw, qw);  // |qw|, so the dot sees unsigned x signed
      for (int t = 0; t < T; ++t) {
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qx + t * K + b * QK));
        const __m256i p = dot8(aw, _mm256_sign_epi8(xv, qw));
        acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(dw * dx[t * nb + b]), _mm256_cvtepi32_ps(p), acc[t]);
      }
    } else {
      const float mw = block_min(blk, type, dw);
      const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + codes_offset(type)));
      // element j in the low nibble of byte j, element j + 16 in the high nibble
      const __m256i qw = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), low);
      for (int t = 0; t < T; ++t) {
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qx + t * K + b * QK));
        const __m256i p = dot8(qw, xv);
        acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(dw * dx[t * nb + b]), _mm256_cvtepi32_ps(p), acc[t]);
        min_acc[t] += mw * sx[t * nb + b];
      }
    }
  }
  for (int t = 0; t < T; ++t) out[t * out_stride] = hsum(acc[t]) + min_acc[t];
}
#else
// The same arithmetic, lane by lane (std::fma rounds once, as the vector FMA does).
template <int T>
void dot_row(const uint8_t* w, int64_t type, int64_t nb, const int8_t* qx, const float* dx, const float* sx,
             int64_t K, float* out, int64_t out_stride) {
  const int64_t bb = block_bytes(type);
  for (int t = 0; t < T; ++t) {
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    float min_acc = 0.f;
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = w + b * bb;
      const float dw = half_to_float(blk);
      const int8_t* x = qx + t * K + b * QK;
      int qw[QK];  // the block's codes in element order
      if (type == Q8_0) {
        for (int64_t j = 0; j < QK; ++j) qw[j] = reinterpret_cast<const int8_t*>(blk + 2)[j];
      } else {
        const uint8_t* q = blk + codes_offset(type);
        for (int64_t j = 0; j < QK / 2; ++j) qw[j] = q[j] & 0x0F, qw[j + QK / 2] = q[j] >> 4;
        min_acc += block_min(blk, type, dw) * sx[t * nb + b];
      }
      const float scale = dw * dx[t * nb + b];
      for (int l = 0; l < 8; ++l) {
        const int lane = qw[4 * l] * x[4 * l] + qw[4 * l + 1] * x[4 * l + 1] + qw[4 * l + 2] * x[4 * l + 2] +
                         qw[4 * l + 3] * x[4 * l + 3];
        acc[l] = std::fma(scale, static_cast<float>(lane), acc[l]);
      }
    }
    float s[4];
    for (int l = 0; l < 4; ++l) s[l] = acc[l] + acc[l + 4];
    out[t * out_stride] = ((s[0] + s[2]) + (s[1] + s[3])) + min_acc;
  }
}
#endif

#ifdef PAGODA_AVX512_VNNI
// Two weight rows (w0, w1) against T activation rows, 64-byte vectors: the rows' blocks sit in
// the two halves, each activation block is broadcast to both, so each half holds one output's 8
// lanes and does exactly what dot_row's 32-byte vector does for that output.
template <int T>
void dot_row_pair(const uint8_t* w0, const uint8_t* w1, int64_t type, int64_t nb, const int8_t* qx,
                  const float* dx, const float* sx, int64_t K, float* out, int64_t out_stride) {
  const int64_t bb = block_bytes(type);
  const __m512i low = _mm512_set1_epi8(0x0F);
  // per 16-bit lane: shift the copies in 128-bit quarters 1 and 3 right by 4 (the high nibbles)
  const __m512i nibble_shift = _mm512_set_epi64(0x0004000400040004, 0x0004000400040004, 0, 0,
                                                0x0004000400040004, 0x0004000400040004, 0, 0);
  __m512 acc[T];
  float min0[T], min1[T];
  for (int t = 0; t < T; ++t) acc[t] = _mm512_setzero_ps(), min0[t] = 0.f, min1[t] = 0.f;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* b0 = w0 + b * bb;
    const uint8_t* b1 = w1 + b * bb;
    _mm_prefetch(reinterpret_cast<const char*>(b0 + 1024), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(b1 + 1024), _MM_HINT_T0);
    const float dw0 = half_to_float(b0), dw1 = half_to_float(b1);
    const __m512 dw = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(dw0), _mm512_set1_ps(dw1));
    if (type == Q8_0) {
      const __m512i qw = _mm512_inserti64x4(
          _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b0 + 2))),
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b1 + 2)), 1);
      const __m512i aw = _mm512_abs_epi8(qw);  // |qw| (-128 reads as 128 unsigned: still exact)
      const __mmask64 negative = _mm512_movepi8_mask(qw);
      for (int t = 0; t < T; ++t) {
        const __m512i xv = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qx + t * K + b * QK)));
        const __m512i xs = _mm512_mask_sub_epi8(xv, negative, _mm512_setzero_si512(), xv);  // x * sign(qw)
        const __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), aw, xs);
        const __m512 scale = _mm512_mul_ps(dw, _mm512_set1_ps(dx[t * nb + b]));
        acc[t] = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(p), acc[t]);
      }
    } else {
      const int64_t off = codes_offset(type);
      const float mw0 = block_min(b0, type, dw0), mw1 = block_min(b1, type, dw1);
      const __m512i raw = _mm512_inserti64x4(
          _mm512_castsi256_si512(_mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b0 + off)))),
          _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b1 + off))), 1);
      const __m512i qw = _mm512_and_si512(_mm512_srlv_epi16(raw, nibble_shift), low);
      for (int t = 0; t < T; ++t) {
        const __m512i xv = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qx + t * K + b * QK)));
        const __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), qw, xv);
        const __m512 scale = _mm512_mul_ps(dw, _mm512_set1_ps(dx[t * nb + b]));
        acc[t] = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(p), acc[t]);
        min0[t] += mw0 * sx[t * nb + b];
        min1[t] += mw1 * sx[t * nb + b];
      }
    }
  }
  for (int t = 0; t < T; ++t) {
    out[t * out_stride] = hsum(_mm512_castps512_ps256(acc[t])) + min0[t];
    out[t * out_stride + 1] = hsum(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[t]), 1))) + min1[t];
  }
}
#endif

constexpr int64_t ROW_CHUNK = 16;  // weight rows kept in L1 while every activation row passes over them

// From this many activation rows on (a prefill chunk), dequantizing the weight once and running
// a library GEMM beats the integer kernel (benchmarks/README.md, "Matmul kernels"): where the
// build has AVX512-BF16 or AMX-BF16, oneDNN's bf16 GEMM (AMX tiles on Sapphire Rapids) on bf16
// copies of the int8-rounded activations and of the weight; else MKL's fp32 GEMM on exact fp32
// copies. bf16 keeps 8 significant bits, so that route rounds each weight, each activation and
// the result once more (relative error <= 2^-9 each, the size of the int8 rounding the
// activations already had; oneDNN accumulates in fp32). Not under batch invariance (deterministic inference): the integer kernel's row results
// do not depend on M, a library GEMM's do, and differ from the integer kernel's.
constexpr int64_t GEMM_MIN_ROWS = 16;
#if defined(__AMX_BF16__) || defined(__AVX512BF16__)
constexpr bool GEMM_IN_BF16 = true;
#else
constexpr bool GEMM_IN_BF16 = false;
#endif

// [N, K] of the blocks in float T (fp32: exactly d * q (+ m), as ggml dequantizes them; bf16:
// that value rounded to nearest even).
template <typename T>
at::Tensor dequantize(const uint8_t* w, int64_t type, int64_t N, int64_t K) {
  const int64_t nb = K / QK, bb = block_bytes(type);
  at::Tensor out = at::empty({N, K}, std::is_same_v<T, float> ? at::kFloat : at::kBFloat16);
  T* o = out.data_ptr<T>();
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* blk = w + (n * nb + b) * bb;
        T* dst = o + n * K + b * QK;
        const float d = half_to_float(blk);
        if (type == Q8_0) {
          const int8_t* q = reinterpret_cast<const int8_t*>(blk + 2);
          for (int64_t j = 0; j < QK; ++j) dst[j] = static_cast<T>(d * static_cast<float>(q[j]));
        } else {
          const float m = block_min(blk, type, d);
          const uint8_t* q = blk + codes_offset(type);
          for (int64_t j = 0; j < QK / 2; ++j) {
            dst[j] = static_cast<T>(d * static_cast<float>(q[j] & 0x0F) + m);
            dst[j + QK / 2] = static_cast<T>(d * static_cast<float>(q[j] >> 4) + m);
          }
        }
      }
    }
  });
  return out;
}

// The activations as the integer kernel sees them (dx * qx), in float T, so that the GEMM
// computes the same products (bf16: rounded once more).
template <typename T>
at::Tensor rounded_activations(const QuantizedActivations& a, int64_t M, int64_t K) {
  at::Tensor out = at::empty({M, K}, std::is_same_v<T, float> ? at::kFloat : at::kBFloat16);
  T* o = out.data_ptr<T>();
  at::parallel_for(0, M * (K / QK), 256, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      for (int64_t j = 0; j < QK; ++j) o[i * QK + j] = static_cast<T>(a.d[i] * static_cast<float>(a.q[i * QK + j]));
  });
  return out;
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
// The bf16 copies, 32 elements (one block) at a time: the same values as the scalar templates
// above (d * q then + m, each rounded to fp32, then to bf16 to nearest even).
inline void store_bf16(c10::BFloat16* dst, __m512 lo, __m512 hi) {
  _mm512_storeu_si512(dst, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
}

at::Tensor dequantize_bf16(const uint8_t* w, int64_t type, int64_t N, int64_t K) {
  const int64_t nb = K / QK, bb = block_bytes(type);
  at::Tensor out = at::empty({N, K}, at::kBFloat16);
  c10::BFloat16* o = out.data_ptr<c10::BFloat16>();
  at::parallel_for(0, N * nb, 256, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {  // block i of the flat [N * nb] array
      const uint8_t* blk = w + i * bb;
      const __m512 d = _mm512_set1_ps(half_to_float(blk));
      __m512 lo, hi;
      if (type == Q8_0) {
        const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
        lo = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q))));
        hi = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1))));
      } else {
        const __m512 m = _mm512_set1_ps(block_min(blk, type, _mm512_cvtss_f32(d)));
        const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + codes_offset(type)));
        const __m128i low = _mm_set1_epi8(0x0F);
        lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(raw, low)));
        hi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(raw, 4), low)));
        lo = _mm512_add_ps(_mm512_mul_ps(d, lo), m);
        hi = _mm512_add_ps(_mm512_mul_ps(d, hi), m);
      }
      store_bf16(o + i * QK, lo, hi);
    }
  });
  return out;
}

at::Tensor rounded_activations_bf16(const QuantizedActivations& a, int64_t M, int64_t K) {
  at::Tensor out = at::empty({M, K}, at::kBFloat16);
  c10::BFloat16* o = out.data_ptr<c10::BFloat16>();
  at::parallel_for(0, M * (K / QK), 256, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const __m512 d = _mm512_set1_ps(a.d[i]);
      const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q.data() + i * QK));
      store_bf16(o + i * QK, _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q)))),
                 _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1)))));
    }
  });
  return out;
}
#else
at::Tensor dequantize_bf16(const uint8_t* w, int64_t type, int64_t N, int64_t K) {
  return dequantize<c10::BFloat16>(w, type, N, K);
}
at::Tensor rounded_activations_bf16(const QuantizedActivations& a, int64_t M, int64_t K) {
  return rounded_activations<c10::BFloat16>(a, M, K);
}
#endif

// The prefill route: dequantize, then the library GEMM (see GEMM_MIN_ROWS). In bf16, the weight
// goes in tiles of rows whose copy (<= 2 MiB) stays in L2 while the GEMM reads it: a whole 1B-model
// projection would be 32 MiB, written and read back from memory (measured 2-3x slower).
at::Tensor library_gemm(const QuantizedActivations& a, const uint8_t* w, int64_t type, int64_t M, int64_t N, int64_t K) {
  if (!GEMM_IN_BF16) return at::linear(rounded_activations<float>(a, M, K), dequantize<float>(w, type, N, K));
  // oneDNN's bf16 GEMM, in row tiles so that it caches few primitives (in_row_tiles, ops.h)
  const auto gemm = [](const at::Tensor& weight) {
    return [&weight](const at::Tensor& rows) { return at::linear(rows, weight); };
  };
  const at::Tensor x = rounded_activations_bf16(a, M, K);
  const int64_t tile = std::max<int64_t>(64, (int64_t{2} << 20) / (2 * K) / 16 * 16);
  if (N <= tile) {
    const at::Tensor weight = dequantize_bf16(w, type, N, K);
    return pagoda::in_row_tiles(x, gemm(weight)).to(at::kFloat);
  }
  at::Tensor out = at::empty({M, N}, at::kFloat);
  const int64_t row_bytes = K / QK * block_bytes(type);
  for (int64_t n = 0; n < N; n += tile) {
    const int64_t rows = std::min(tile, N - n);
    const at::Tensor weight = dequantize_bf16(w + n * row_bytes, type, rows, K);
    out.narrow(1, n, rows).copy_(pagoda::in_row_tiles(x, gemm(weight)));
  }
  return out;
}

// Whether M rows take the library GEMM route (under batch invariance every row count keeps the
// integer kernel, whose rows do not depend on M).
inline bool takes_library_gemm(int64_t M) { return M >= GEMM_MIN_ROWS && !pagoda::batch_invariant(); }

// Up to 4 activation rows (T) against the weight rows n_begin .. n_end - 1: pairs of rows with
// 64-byte vectors where the build has AVX512-VNNI, else (and for an odd last row) one at a time.
struct Tile {
  const uint8_t* w;
  int64_t type, nb;
  const int8_t* qx;
  const float *dx, *sx;
  int64_t K;
  float* y;  // output row m, [T, N] with stride N
  int64_t N;

  template <int T>
  void rows(int64_t n_begin, int64_t n_end) const {
    const int64_t row_bytes = nb * block_bytes(type);
    int64_t n = n_begin;
#ifdef PAGODA_AVX512_VNNI
    for (; n + 1 < n_end; n += 2)
      dot_row_pair<T>(w + n * row_bytes, w + (n + 1) * row_bytes, type, nb, qx, dx, sx, K, y + n, N);
#endif
    for (; n < n_end; ++n) dot_row<T>(w + n * row_bytes, type, nb, qx, dx, sx, K, y + n, N);
  }
};

}  // namespace

namespace pagoda {

at::Tensor block_matmul(const at::Tensor& x, const at::Tensor& weight, int64_t type,
                        const std::optional<at::Tensor>& packed) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "block_matmul: x must be float32 [M, K]");
  if (type == pagoda::SUPERBLOCK_PACKED) return pagoda::superblock_gemm(x, weight);
  if (type == pagoda::HALF_PACKED) return pagoda::half_gemm_packed(x, weight);
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kByte, "block_matmul: weight must be uint8 [N, bytes]");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0), bb = block_bytes(type);
  TORCH_CHECK(K % QK == 0, "block_matmul: K (", K, ") must be a multiple of 32");
  const int64_t nb = K / QK;
  TORCH_CHECK(weight.size(1) == nb * bb, "block_matmul: weight rows hold ", weight.size(1), " bytes, expected ", nb * bb);
  const at::Tensor xc = x.contiguous();
  const at::Tensor wc = weight.contiguous();
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  // a copy repacked into tiles at load (block_gemm_tiles.cpp) serves every row count: its rows
  // do not depend on M, so under batch invariance too
  if (pagoda::holds_tiles(packed))
    return pagoda::block_gemm_tiles(xc, *packed, type, N);
  const QuantizedActivations a = quantize_rows(xc.data_ptr<float>(), M, K);
  const uint8_t* w = wc.data_ptr<uint8_t>();
  if (takes_library_gemm(M)) {
    // the weight packed once at load (layers/packed_weights.py: block_dequantize's values in
    // oneDNN's layout) gives library_gemm's products without dequantizing or reordering it here
    if (GEMM_IN_BF16 && packed.has_value() && packed->defined())
      return pagoda::onednn_linear(rounded_activations_bf16(a, M, K), *packed).to(at::kFloat);
    return library_gemm(a, w, type, M, N, K);
  }
  float* y = out.data_ptr<float>();
  at::parallel_for(0, (N + ROW_CHUNK - 1) / ROW_CHUNK, 1, [&](int64_t begin, int64_t end) {
    for (int64_t chunk = begin; chunk < end; ++chunk) {
      const int64_t n_begin = chunk * ROW_CHUNK, n_end = std::min(N, n_begin + ROW_CHUNK);
      for (int64_t m = 0; m < M; m += 4) {
        const Tile tile{w, type, nb, a.q.data() + m * K, a.d.data() + m * nb, a.s.data() + m * nb, K, y + m * N, N};
        switch (std::min<int64_t>(4, M - m)) {
          case 4: tile.rows<4>(n_begin, n_end); break;
          case 3: tile.rows<3>(n_begin, n_end); break;
          case 2: tile.rows<2>(n_begin, n_end); break;
          default: tile.rows<1>(n_begin, n_end);
        }
      }
    }
  });
  return out;
}

// The library GEMM route's weight for a caller that keeps it packed once (the model loader's
// packed_weights.py reorders it into oneDNN's own layout, so that no step dequantizes or reorders
// it): dequantized as library_gemm dequantizes it. block_matmul's `packed` takes the result.
at::Tensor block_dequantize(const at::Tensor& weight, int64_t type, int64_t in_features) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kByte, "block_dequantize: weight must be uint8 [N, bytes]");
  TORCH_CHECK(in_features % QK == 0 && weight.size(1) == in_features / QK * block_bytes(type),
              "block_dequantize: rows of ", weight.size(1), " bytes do not hold ", in_features, " inputs");
  const at::Tensor wc = weight.contiguous();
  if (GEMM_IN_BF16) return dequantize_bf16(wc.data_ptr<uint8_t>(), type, weight.size(0), in_features);
  return dequantize<float>(wc.data_ptr<uint8_t>(), type, weight.size(0), in_features);
}

}  // namespace pagoda

TORCH_LIBRARY_FRAGMENT(pagoda, m) {
  // packed: the weight's copy made at load (layers/packed_weights.py), either repacked for
  // tiles by block_repack_tiles (uint8; used at every row count) or made by block_dequantize
  // and oneDNN's reorder (used from GEMM_MIN_ROWS rows where the route is bf16, as pagoda::linear
  // takes a float weight's copy)
  m.def("block_matmul(Tensor x, Tensor weight, int block_type, Tensor? packed=None) -> Tensor");
  m.def("block_dequantize(Tensor weight, int block_type, int in_features) -> Tensor");
  // Which instruction set this build's integer dot products use: avx512-vnni, avx-vnni, avx2, scalar.
  m.def("block_matmul_isa() -> str", []() { return std::string(isa_path()); });
  // From how many rows (outside batch invariance) it dequantizes and runs a library GEMM, and in
  // which dtype: (GEMM_MIN_ROWS, "bf16" | "fp32").
  m.def("block_matmul_gemm() -> (int, str)", []() {
    return std::make_tuple(GEMM_MIN_ROWS, std::string(GEMM_IN_BF16 ? "bf16" : "fp32"));
  });
}

TORCH_LIBRARY_IMPL(pagoda, CPU, m) {
  m.impl("block_matmul", &pagoda::block_matmul);
  m.impl("block_dequantize", &pagoda::block_dequantize);
}
// with a packed copy that oneDNN's reorder made an Mkldnn tensor, whose dispatch key selects the kernel
TORCH_LIBRARY_IMPL(pagoda, MkldnnCPU, m) { m.impl("block_matmul", &pagoda::block_matmul); }
