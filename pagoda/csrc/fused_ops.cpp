// Small fused ops for the float32 CPU forward: each replaces 5-25 separate torch calls per layer,
// whose dispatch overhead (not their arithmetic) is most of a batch-1 decode step's time.
// Every op computes what the pure-torch path computes, in the same order of roundings
// (the extension is built with -ffp-contract=off, so no multiply-add is fused behind our back).
// Registered as torch.ops.pagoda.* (no pybind11: it compiles faster).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "kv_codes.h"
#include "ops.h"
#include "vec_math.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

namespace {

void check_float(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous(), name, " must be a contiguous float32 tensor");
}

}  // namespace

namespace pagoda {

// residual += x; x = weight * rmsnorm(residual)   (rows of H; in place)
void fused_add_rms_norm(at::Tensor x, at::Tensor residual, const at::Tensor& weight, double eps) {
  check_float(x, "x");
  check_float(residual, "residual");
  check_float(weight, "weight");
  const int64_t H = weight.numel(), T = x.numel() / H;
  TORCH_CHECK(residual.numel() == x.numel(), "x and residual differ in size");
  float* xs = x.data_ptr<float>();
  float* rs = residual.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      float* xr = xs + t * H;
      float* rr = rs + t * H;
      float ss = 0.f;
      for (int64_t i = 0; i < H; ++i) {
        rr[i] += xr[i];
        ss += rr[i] * rr[i];
      }
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(H) + static_cast<float>(eps));
      for (int64_t i = 0; i < H; ++i) xr[i] = w[i] * (rr[i] * inv);
    }
  });
}

// q [T, Hq, D] and k [T, Hk, D] rotated in place (rotate-half convention):
//   x[i]     = x[i] * cos[i]         - x[i + D/2] * sin[i]
//   x[i+D/2] = x[i + D/2] * cos[i+D/2] + x[i] * sin[i+D/2]
void rotary_embedding(at::Tensor q, at::Tensor k, const at::Tensor& positions, const at::Tensor& cos_cache,
                      const at::Tensor& sin_cache) {
  for (const at::Tensor* t : {&q, &k})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->dim() == 3 && t->stride(2) == 1 && t->stride(1) == t->size(2),
                "q and k must be float32 [T, heads, D] with contiguous heads (rows may be strided)");
  check_float(cos_cache, "cos_cache");
  check_float(sin_cache, "sin_cache");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous(), "positions must be int64");
  const int64_t T = q.size(0), D = q.size(2), half = D / 2;
  const int64_t heads_q = q.size(1), heads_k = k.size(1), max_pos = cos_cache.size(0);
  const int64_t q_row = q.stride(0), k_row = k.stride(0);
  TORCH_CHECK(cos_cache.size(1) == D, "rotary tables do not match head_dim");
  const int64_t* pos = positions.data_ptr<int64_t>();
  float* qs = q.data_ptr<float>();
  float* ks = k.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(pos[t] >= 0 && pos[t] < max_pos, "position ", pos[t], " out of range");
  at::parallel_for(0, T, 8, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cos_cache.data_ptr<float>() + pos[t] * D;
      const float* s = sin_cache.data_ptr<float>() + pos[t] * D;
      auto rotate = [&](float* x) {
        for (int64_t i = 0; i < half; ++i) {
          const float a = x[i], b = x[i + half];
          const float lo1 = a * c[i], lo2 = -b * s[i];
          const float hi1 = b * c[i + half], hi2 = a * s[i + half];
          x[i] = lo1 + lo2;
          x[i + half] = hi1 + hi2;
        }
      };
      for (int64_t h = 0; h < heads_q; ++h) rotate(qs + t * q_row + h * D);
      for (int64_t h = 0; h < heads_k; ++h) rotate(ks + t * k_row + h * D);
    }
  });
}

// x [T, 2I] (gate | up) → silu(gate) * up  [T, I]
at::Tensor silu_and_mul(const at::Tensor& x) {
  check_float(x, "x");
  const int64_t I = x.size(-1) / 2, T = x.numel() / (2 * I);
  at::Tensor out = at::empty({T, I}, x.options());
  const float* xs = x.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, T, 4, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* g = xs + t * 2 * I;
      silu_mul_row(g, g + I, o + t * I, I);
    }
  });
  return out;
}

// The index of the largest of n floats: the first among equal ones, and the first NaN if there
// is one (NaN counts as the largest), as torch.argmax. Two passes: the max, then where it is.
static int64_t row_argmax(const float* p, int64_t n) {
  float m = -std::numeric_limits<float>::infinity();
  bool nan = false;
  int64_t i = 0;
#ifdef PAGODA_AVX2
  __m256 mv = _mm256_set1_ps(m), unordered = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(p + i);
    unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    mv = _mm256_max_ps(mv, v);
  }
  m = hmax256(mv, m);
  nan = _mm256_movemask_ps(unordered) != 0;
#endif
  for (; i < n; ++i) {
    nan = nan || std::isnan(p[i]);
    m = std::max(m, p[i]);
  }
  if (nan)
    for (int64_t j = 0; j < n; ++j)
      if (std::isnan(p[j])) return j;
  i = 0;
#ifdef PAGODA_AVX2
  const __m256 target = _mm256_set1_ps(m);
  for (; i + 8 <= n; i += 8) {
    const int hits = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(p + i), target, _CMP_EQ_OQ));
    if (hits) return i + __builtin_ctz(hits);
  }
#endif
  for (; i < n; ++i)
    if (p[i] == m) return i;
  return 0;
}

// x [M, V] float → the index of each row's largest value [M] (greedy sampling over the logits;
// torch.argmax runs one row at a time without vectors: ~4 ms for 64 rows of a 49k vocabulary)
at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.size(1) > 0, "argmax_rows: x must be [rows, n] with n > 0");
  const at::Tensor xc = x.contiguous();
  const int64_t M = xc.size(0), V = xc.size(1);
  at::Tensor out = at::empty({M}, xc.options().dtype(at::kLong));
  const float* xs = xc.data_ptr<float>();
  int64_t* o = out.data_ptr<int64_t>();
  at::parallel_for(0, M, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) o[r] = row_argmax(xs + r * V, V);
  });
  return out;
}

// k/v [T, Hkv, D] → the paged caches [blocks, Hkv, BS, D] at slot_mapping[t] = block * BS + offset.
// fn(t, h, cell) for every (token, head) row, cell = (block * Hkv + h) * BS + offset: the row's
// index in the cache (times D for its first element, as-is for an int8 cache's scale).
template <typename F>
void for_each_cache_row(int64_t T, int64_t H, const at::Tensor& cache, const int64_t* slots, F fn) {
  const int64_t BS = cache.size(2), blocks = cache.size(0);
  for (int64_t t = 0; t < T; ++t) {
    const int64_t block = slots[t] / BS, offset = slots[t] % BS;
    TORCH_CHECK(block >= 0 && block < blocks, "slot ", slots[t], " out of range");
    for (int64_t h = 0; h < H; ++h) fn(t, h, (block * H + h) * BS + offset);
  }
}

// k, v [T, heads, D] rounded to a narrower cache (--kv-cache-dtype): as tensor.to(dtype) rounds
// (to nearest, ties to even), one (token, head) row at a time.
template <typename src_t, typename dst_t>
void write_converted(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
                     const int64_t* slots) {
  const int64_t D = k.size(2);
  const src_t* ks = k.data_ptr<src_t>();
  const src_t* vs = v.data_ptr<src_t>();
  dst_t* kd = k_cache.data_ptr<dst_t>();
  dst_t* vd = v_cache.data_ptr<dst_t>();
  for_each_cache_row(k.size(0), k.size(1), k_cache, slots, [&](int64_t t, int64_t h, int64_t cell) {
    const src_t* kr = ks + t * k.stride(0) + h * D;
    const src_t* vr = vs + t * v.stride(0) + h * D;
    for (int64_t d = 0; d < D; ++d) {
      kd[cell * D + d] = static_cast<dst_t>(static_cast<float>(kr[d]));
      vd[cell * D + d] = static_cast<dst_t>(static_cast<float>(vr[d]));
    }
  });
}

// x [T, heads, D] into an int8 or fp8 cache (kv_codes.h): each (token, head) row scaled by its
// largest magnitude over the code's largest (the scale stored beside it, 0 for a row of zeros),
// divided and rounded to nearest even: llama.cpp's q8_0 with one scale per row, or its fp8 twin.
template <typename src_t, typename code_t>
void write_scaled(const at::Tensor& x, at::Tensor& cache, at::Tensor& scales, const int64_t* slots) {
  const int64_t D = x.size(2);
  const src_t* xs = x.data_ptr<src_t>();
  code_t* qd = cache.data_ptr<code_t>();
  float* sd = scales.data_ptr<float>();
  for_each_cache_row(x.size(0), x.size(1), cache, slots, [&](int64_t t, int64_t h, int64_t cell) {
    const src_t* row = xs + t * x.stride(0) + h * D;
    float amax = 0.f;
    for (int64_t d = 0; d < D; ++d) amax = std::max(amax, std::fabs(static_cast<float>(row[d])));
    const float scale = amax / largest_code<code_t>();
    const float divisor = scale > 0.f ? scale : 1.f;
    sd[cell] = scale;
    for (int64_t d = 0; d < D; ++d) qd[cell * D + d] = encode<code_t>(static_cast<float>(row[d]) / divisor);
  });
}

void write_kv_cache(const at::Tensor& k, const at::Tensor& v, at::Tensor k_cache, at::Tensor v_cache,
                    const at::Tensor& slot_mapping, const std::optional<at::Tensor>& k_scales,
                    const std::optional<at::Tensor>& v_scales) {
  TORCH_CHECK(k.scalar_type() == v.scalar_type() && k_cache.scalar_type() == v_cache.scalar_type(), "k and v dtypes differ");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && slot_mapping.is_contiguous(), "caches must be contiguous");
  for (const at::Tensor* t : {&k, &v})
    TORCH_CHECK(t->dim() == 3 && t->stride(2) == 1 && t->stride(1) == t->size(2), "k and v must be [T, heads, D] with contiguous heads");
  if (is_scaled_code(k_cache.scalar_type())) {
    check_kv_scales(k_scales, v_scales, k_cache, k.size(2));
    at::Tensor ks = *k_scales, vs = *v_scales;
    dispatch_scaled_code(k_cache.scalar_type(), "write_kv_cache", [&](auto code) {
      using code_t = decltype(code);
      PAGODA_DISPATCH_MODEL_FLOATS(k.scalar_type(), "write_kv_cache_scaled", [&] {
        write_scaled<scalar_t, code_t>(k, k_cache, ks, slot_mapping.data_ptr<int64_t>());
        write_scaled<scalar_t, code_t>(v, v_cache, vs, slot_mapping.data_ptr<int64_t>());
      });
    });
    return;
  }
  if (k.scalar_type() != k_cache.scalar_type()) {
    PAGODA_DISPATCH_MODEL_FLOATS(k.scalar_type(), "write_kv_cache", [&] {
      using src_t = scalar_t;
      PAGODA_DISPATCH_MODEL_FLOATS(k_cache.scalar_type(),
                                      "write_kv_cache_to", [&] {
        write_converted<src_t, scalar_t>(k, v, k_cache, v_cache, slot_mapping.data_ptr<int64_t>());
      });
    });
    return;
  }
  const int64_t k_row = k.stride(0) * k.element_size(), v_row = v.stride(0) * v.element_size();
  const int64_t row = k.size(2) * k.element_size();
  auto* kd = static_cast<uint8_t*>(k_cache.data_ptr());
  auto* vd = static_cast<uint8_t*>(v_cache.data_ptr());
  const auto* ks = static_cast<const uint8_t*>(k.data_ptr());
  const auto* vs = static_cast<const uint8_t*>(v.data_ptr());
  for_each_cache_row(k.size(0), k.size(1), k_cache, slot_mapping.data_ptr<int64_t>(),
                     [&](int64_t t, int64_t h, int64_t cell) {
                       std::memcpy(kd + cell * row, ks + t * k_row + h * row, row);
                       std::memcpy(vd + cell * row, vs + t * v_row + h * row, row);
                     });
}

}  // namespace pagoda

TORCH_LIBRARY_FRAGMENT(pagoda, m) {
  m.def("fused_add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def("rotary_embedding(Tensor(a!) q, Tensor(b!) k, Tensor positions, Tensor cos_cache, Tensor sin_cache) -> ()");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("argmax_rows(Tensor x) -> Tensor");
  m.def("write_kv_cache(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping, "
        "Tensor(c!)? k_scales=None, Tensor(d!)? v_scales=None) -> ()");
}

TORCH_LIBRARY_IMPL(pagoda, CPU, m) {
  m.impl("fused_add_rms_norm", &pagoda::fused_add_rms_norm);
  m.impl("rotary_embedding", &pagoda::rotary_embedding);
  m.impl("silu_and_mul", &pagoda::silu_and_mul);
  m.impl("argmax_rows", &pagoda::argmax_rows);
  m.impl("write_kv_cache", &pagoda::write_kv_cache);
}
