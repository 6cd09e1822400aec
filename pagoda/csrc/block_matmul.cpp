// Matmul against weights kept in ggml's blocks of 32 (Q4_0, Q4_1, Q8_0), never dequantized.
//
// As llama.cpp does, each activation row is quantized to int8 per block of 32 (scale dx, and
// sx = dx * sum(qx)), and each block's dot product runs in integers (AVX2 maddubs/madd), scaled
// in fp32:
//   Q4_1:  sum_b  dw * dx * (qw . qx)  +  mw * sx      (qw in 0..15, w = dw * qw + mw)
//   Q4_0:  the same with mw = -8 dw                     (w = dw * (qw - 8))
//   Q8_0:  sum_b  dw * dx * (qw . qx)                   (qw in -127..127)
// At batch 1 a decode step streams the weights once, so their bytes (4.5-5 bits per weight
// instead of 32) are what sets its speed.
// Registered as torch.ops.pagoda.block_matmul (no pybind11: it compiles faster).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "ops.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif
#if defined(__AVX2__) && defined(__FMA__)
#define PAGODA_AVX2 1
#endif

namespace {

constexpr int64_t QK = 32;                      // elements per block
enum BlockType : int64_t { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8 };  // GGMLQuantizationType values

int64_t block_bytes(int64_t type) {
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

// Activations as int8 blocks: q [M, K], d and s [M, K / 32].
struct QuantizedActivations {
  std::vector<int8_t> q;
  std::vector<float> d, s;
};

#ifdef PAGODA_AVX2
// One block of 32: the same roundings as the scalar loop below (x * inv, round half to even).
inline void quantize_block(const float* src, int8_t* q, float* d_out, float* s_out) {
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
  *d_out = d;
  *s_out = d * static_cast<float>(_mm_cvtsi128_si32(s4));
}
#endif

QuantizedActivations quantize_rows(const float* x, int64_t M, int64_t K) {
  const int64_t nb = K / QK;
  QuantizedActivations a{std::vector<int8_t>(M * K), std::vector<float>(M * nb), std::vector<float>(M * nb)};
  at::parallel_for(0, M * nb, 256, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float* src = x + i * QK;  // rows are contiguous, so block i of the flat array
#ifdef PAGODA_AVX2
      quantize_block(src, a.q.data() + i * QK, &a.d[i], &a.s[i]);
#else
      float amax = 0.f;
      for (int64_t j = 0; j < QK; ++j) amax = std::max(amax, std::fabs(src[j]));
      const float d = amax / 127.f;
      const float inv = d > 0.f ? 1.f / d : 0.f;
      int sum = 0;
      int8_t* q = a.q.data() + i * QK;
      for (int64_t j = 0; j < QK; ++j) {
        q[j] = static_cast<int8_t>(std::nearbyint(src[j] * inv));
        sum += q[j];
      }
      a.d[i] = d;
      a.s[i] = d * static_cast<float>(sum);
#endif
    }
  });
  return a;
}

#ifdef PAGODA_AVX2
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// One weight row against T activation rows (T <= 4): each weight block is unpacked once per tile.
template <int T>
void dot_row(const uint8_t* w, int64_t type, int64_t nb, const int8_t* qx, const float* dx, const float* sx,
             int64_t K, float* out, int64_t out_stride) {
  const int64_t bb = block_bytes(type);
  const __m256i ones = _mm256_set1_epi16(1);
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
      const __m256i aw = _mm256_sign_epi8(qw, qw);  // |qw|, so maddubs sees unsigned x signed
      for (int t = 0; t < T; ++t) {
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qx + t * K + b * QK));
        const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(xv, qw)), ones);
        acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(dw * dx[t * nb + b]), _mm256_cvtepi32_ps(p), acc[t]);
      }
    } else {
      const float mw = type == Q4_0 ? -8.f * dw : half_to_float(blk + 2);
      const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + (type == Q4_0 ? 2 : 4)));
      // element j in the low nibble of byte j, element j + 16 in the high nibble
      const __m256i qw = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), low);
      for (int t = 0; t < T; ++t) {
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qx + t * K + b * QK));
        const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(qw, xv), ones);
        acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(dw * dx[t * nb + b]), _mm256_cvtepi32_ps(p), acc[t]);
        min_acc[t] += mw * sx[t * nb + b];
      }
    }
  }
  for (int t = 0; t < T; ++t) out[t * out_stride] = hsum(acc[t]) + min_acc[t];
}
#else
template <int T>
void dot_row(const uint8_t* w, int64_t type, int64_t nb, const int8_t* qx, const float* dx, const float* sx,
             int64_t K, float* out, int64_t out_stride) {
  const int64_t bb = block_bytes(type);
  for (int t = 0; t < T; ++t) {
    float total = 0.f;
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = w + b * bb;
      const float dw = half_to_float(blk);
      const int8_t* x = qx + t * K + b * QK;
      int dot = 0;
      if (type == Q8_0) {
        const int8_t* q = reinterpret_cast<const int8_t*>(blk + 2);
        for (int64_t j = 0; j < QK; ++j) dot += q[j] * x[j];
        total += dw * dx[t * nb + b] * dot;
      } else {
        const float mw = type == Q4_0 ? -8.f * dw : half_to_float(blk + 2);
        const uint8_t* q = blk + (type == Q4_0 ? 2 : 4);
        for (int64_t j = 0; j < QK / 2; ++j) dot += (q[j] & 0x0F) * x[j] + (q[j] >> 4) * x[j + QK / 2];
        total += dw * dx[t * nb + b] * dot + mw * sx[t * nb + b];
      }
    }
    out[t * out_stride] = total;
  }
}
#endif

constexpr int64_t ROW_CHUNK = 16;  // weight rows kept in L1 while every activation row passes over them

// From this many activation rows on (a prefill chunk), dequantizing the weight once and running
// the BLAS fp32 GEMM beats the integer kernel: ~1-2 ms to expand a SmolLM2 projection, against
// a GEMM that is compute-bound at ~100 GFLOP/s while the integer path reaches ~60 here.
// Not under batch invariance (deterministic inference): the integer kernel's row results do not
// depend on M, the GEMM's do, and differ from the integer kernel's.
constexpr int64_t GEMM_MIN_ROWS = 128;

// fp32 [N, K] of the blocks: exactly d * q (+ m), as ggml dequantizes them.
at::Tensor dequantize(const uint8_t* w, int64_t type, int64_t N, int64_t K) {
  const int64_t nb = K / QK, bb = block_bytes(type);
  at::Tensor out = at::empty({N, K}, at::kFloat);
  float* o = out.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* blk = w + (n * nb + b) * bb;
        float* dst = o + n * K + b * QK;
        const float d = half_to_float(blk);
        if (type == Q8_0) {
          const int8_t* q = reinterpret_cast<const int8_t*>(blk + 2);
          for (int64_t j = 0; j < QK; ++j) dst[j] = d * static_cast<float>(q[j]);
        } else {
          const float m = type == Q4_0 ? -8.f * d : half_to_float(blk + 2);
          const uint8_t* q = blk + (type == Q4_0 ? 2 : 4);
          for (int64_t j = 0; j < QK / 2; ++j) {
            dst[j] = d * static_cast<float>(q[j] & 0x0F) + m;
            dst[j + QK / 2] = d * static_cast<float>(q[j] >> 4) + m;
          }
        }
      }
    }
  });
  return out;
}

// The activations as the integer kernel sees them (dx * qx), in fp32, so that both paths
// compute the same products and differ only in the order of the float sums.
at::Tensor rounded_activations(const QuantizedActivations& a, int64_t M, int64_t K) {
  at::Tensor out = at::empty({M, K}, at::kFloat);
  float* o = out.data_ptr<float>();
  at::parallel_for(0, M * (K / QK), 256, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      for (int64_t j = 0; j < QK; ++j) o[i * QK + j] = a.d[i] * static_cast<float>(a.q[i * QK + j]);
  });
  return out;
}

}  // namespace

namespace pagoda {

at::Tensor block_matmul(const at::Tensor& x, const at::Tensor& weight, int64_t type) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "block_matmul: x must be float32 [M, K]");
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kByte, "block_matmul: weight must be uint8 [N, bytes]");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0), bb = block_bytes(type);
  TORCH_CHECK(K % QK == 0, "block_matmul: K (", K, ") must be a multiple of 32");
  const int64_t nb = K / QK;
  TORCH_CHECK(weight.size(1) == nb * bb, "block_matmul: weight rows hold ", weight.size(1), " bytes, expected ", nb * bb);
  const at::Tensor xc = x.contiguous();
  const at::Tensor wc = weight.contiguous();
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  const QuantizedActivations a = quantize_rows(xc.data_ptr<float>(), M, K);
  const uint8_t* w = wc.data_ptr<uint8_t>();
  if (M >= GEMM_MIN_ROWS && !pagoda::batch_invariant()) return at::linear(rounded_activations(a, M, K), dequantize(w, type, N, K));
  float* y = out.data_ptr<float>();
  at::parallel_for(0, (N + ROW_CHUNK - 1) / ROW_CHUNK, 1, [&](int64_t begin, int64_t end) {
    for (int64_t chunk = begin; chunk < end; ++chunk) {
      const int64_t n_end = std::min(N, (chunk + 1) * ROW_CHUNK);
      for (int64_t m = 0; m < M; m += 4) {
        const int64_t t = std::min<int64_t>(4, M - m);
        const int8_t* qx = a.q.data() + m * K;
        const float* dx = a.d.data() + m * nb;
        const float* sx = a.s.data() + m * nb;
        for (int64_t n = chunk * ROW_CHUNK; n < n_end; ++n) {
          const uint8_t* row = w + n * nb * bb;
          float* o = y + m * N + n;
          switch (t) {
            case 4: dot_row<4>(row, type, nb, qx, dx, sx, K, o, N); break;
            case 3: dot_row<3>(row, type, nb, qx, dx, sx, K, o, N); break;
            case 2: dot_row<2>(row, type, nb, qx, dx, sx, K, o, N); break;
            default: dot_row<1>(row, type, nb, qx, dx, sx, K, o, N);
          }
        }
      }
    }
  });
  return out;
}

}  // namespace pagoda

TORCH_LIBRARY_FRAGMENT(pagoda, m) {
  m.def("block_matmul(Tensor x, Tensor weight, int block_type) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagoda, CPU, m) { m.impl("block_matmul", &pagoda::block_matmul); }
