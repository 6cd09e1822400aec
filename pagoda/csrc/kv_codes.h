// A KV cache of narrow codes with one float scale per (token, head) row (--kv-cache-dtype int8,
// fp8 / fp8_e4m3, fp8_e5m2): how a row is encoded as write_kv_cache stores it, and how the paged
// attention kernel widens the codes back to float as it loads them. The Python side's twin is
// layers/backend.py:quantize_rows (SCALED_KV_DTYPES holds the same largest codes).
//
// A row's scale is its largest magnitude over the code's largest value (0 for a row of zeros);
// each value is divided by it and rounded to nearest even (fp8: clamped to the largest finite
// code first, as an e5m2 conversion would otherwise overflow to infinity). Widened, a code times
// its row's scale is the value the cache holds.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <type_traits>

#include "vec_math.h"  // PAGODA_AVX2

namespace pagoda {

template <typename code_t>
inline constexpr bool is_scaled_code_v = std::is_same_v<code_t, int8_t> ||
                                         std::is_same_v<code_t, c10::Float8_e4m3fn> ||
                                         std::is_same_v<code_t, c10::Float8_e5m2>;

// The code's largest finite magnitude: a row's largest value maps to it.
template <typename code_t>
constexpr float largest_code() {
  if constexpr (std::is_same_v<code_t, int8_t>) return 127.f;
  else if constexpr (std::is_same_v<code_t, c10::Float8_e4m3fn>) return 448.f;
  else return 57344.f;  // e5m2
}

// value / scale (already divided) → the code, rounded to nearest even.
template <typename code_t>
inline code_t encode(float scaled) {
  if constexpr (std::is_same_v<code_t, int8_t>) {
    return static_cast<int8_t>(std::nearbyint(scaled));
  } else {
    constexpr float top = largest_code<code_t>();
    return code_t(std::clamp(scaled, -top, top));
  }
}

// fp8 codes are widened through fp16, whose conversion to float the hardware does (F16C):
// e5m2 is the high byte of an fp16 with the same exponent bias, so a shift makes it exact; e4m3's
// four exponent bits and three mantissa bits, moved to fp16's places, give an fp16 of the same
// exponent field under fp16's bias (15 instead of 7) -- normal and subnormal codes alike -- so the
// value is that fp16 times 2^8, folded into the row's scale. (e4m3's NaN codes would read as 480;
// they are never written: encode clamps.)
template <typename code_t>
constexpr float fp16_rescale() {
  return std::is_same_v<code_t, c10::Float8_e4m3fn> ? 256.f : 1.f;
}

#ifdef PAGODA_AVX2
// 8 fp8 codes → their fp16 bit patterns (see fp16_rescale). e4m3: the codes sign-extended to 16
// bits and shifted left by 7 hold the exponent and mantissa at fp16's bits 7..13 and the sign at
// bits 14 and 15; clearing bit 14 leaves the fp16 (one shift and one and).
template <typename code_t>
inline __m128i fp8_to_fp16_bits(__m128i raw) {
  if constexpr (std::is_same_v<code_t, c10::Float8_e5m2>) {
    return _mm_slli_epi16(_mm_cvtepu8_epi16(raw), 8);
  } else {
    return _mm_and_si128(_mm_slli_epi16(_mm_cvtepi8_epi16(raw), 7), _mm_set1_epi16(static_cast<int16_t>(0xbf80)));
  }
}

// 8 codes at src, widened and multiplied by the row's scale.
template <typename code_t>
inline __m256 widen8(const code_t* src, float scale) {
  const __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(src));
  if constexpr (std::is_same_v<code_t, int8_t>) {
    return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(raw)), _mm256_set1_ps(scale));
  } else {
    const __m256 h = _mm256_cvtph_ps(fp8_to_fp16_bits<code_t>(raw));
    return _mm256_mul_ps(h, _mm256_set1_ps(scale * fp16_rescale<code_t>()));
  }
}
#endif

#if defined(__AVX512F__)
// 16 fp8 codes → their fp16 bit patterns, as above.
template <typename code_t>
inline __m256i fp8_to_fp16_bits_x16(__m128i raw) {
  if constexpr (std::is_same_v<code_t, c10::Float8_e5m2>) {
    return _mm256_slli_epi16(_mm256_cvtepu8_epi16(raw), 8);
  } else {
    return _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(raw), 7),
                            _mm256_set1_epi16(static_cast<int16_t>(0xbf80)));
  }
}

// 16 codes at src, widened and multiplied by the row's scale.
template <typename code_t>
inline __m512 widen16(const code_t* src, float scale) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
  if constexpr (std::is_same_v<code_t, int8_t>) {
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(raw)), _mm512_set1_ps(scale));
  } else {
    const __m512 h = _mm512_cvtph_ps(fp8_to_fp16_bits_x16<code_t>(raw));
    return _mm512_mul_ps(h, _mm512_set1_ps(scale * fp16_rescale<code_t>()));
  }
}
#endif

// Calls fn with a value of the code type that `type` names (int8, fp8 e4m3, fp8 e5m2).
template <typename F>
void dispatch_scaled_code(at::ScalarType type, const char* name, F&& fn) {
  switch (type) {
    case at::kChar: fn(int8_t{}); break;
    case at::kFloat8_e4m3fn: fn(c10::Float8_e4m3fn{}); break;
    case at::kFloat8_e5m2: fn(c10::Float8_e5m2{}); break;
    default: TORCH_CHECK(false, name, ": not a scaled KV cache dtype: ", type);
  }
}

// Runs the lambda with scalar_t set to the model's or the KV cache's float type: float32, bfloat16 or
// float16. Not float64, which no model or cache runs in: each type more multiplies the attention
// kernels' instantiations (q type x cache type) and with them the build's time.
#define PAGODA_DISPATCH_MODEL_FLOATS(TYPE, NAME, ...)                                                     \
  AT_DISPATCH_SWITCH(TYPE, NAME, AT_DISPATCH_CASE(at::ScalarType::Float, __VA_ARGS__)                     \
                         AT_DISPATCH_CASE(at::ScalarType::BFloat16, __VA_ARGS__)                          \
                             AT_DISPATCH_CASE(at::ScalarType::Half, __VA_ARGS__))

inline bool is_scaled_code(at::ScalarType type) {
  return type == at::kChar || type == at::kFloat8_e4m3fn || type == at::kFloat8_e5m2;
}

// A scaled cache's scales, as both ops take them: float, contiguous, one per row of D codes.
inline void check_kv_scales(const std::optional<at::Tensor>& k_scales, const std::optional<at::Tensor>& v_scales,
                            const at::Tensor& cache, int64_t D) {
  TORCH_CHECK(k_scales && v_scales && k_scales->scalar_type() == at::kFloat && v_scales->scalar_type() == at::kFloat &&
                  k_scales->is_contiguous() && v_scales->is_contiguous() && k_scales->numel() == cache.numel() / D &&
                  v_scales->numel() == cache.numel() / D,
              "an int8 or fp8 KV cache needs its float scales [num_blocks, kv_heads, block_size]");
}

}  // namespace pagoda
