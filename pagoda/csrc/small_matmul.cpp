// fp32 x [M, K] @ W.T for any M, batch-invariant: every output (m, n) is computed with exactly
// the same arithmetic whatever M is and wherever row m sits in the batch.
//
// Each output is one dot product of a weight row and an activation row, in a fixed order:
//   - per-lane vector FMAs over K in steps of VL (16 lanes with AVX-512, 8 with AVX2),
//   - a fixed tree sum of the VL lanes (hsum below),
//   - then the scalar tail k = K - K % VL .. K - 1, one multiply and one add at a time.
// Without AVX2 the whole sum is the scalar loop. The kernel is register-tiled (MR activation rows
// x NR weight rows share their loads, with K innermost), but tiling only changes which sums are
// computed together, never how one is computed: a 1-row decode and a 2048-row prefill give a row
// the same bits. (Lane widths differ between machines, so results are invariant on one machine,
// not across AVX-512 and AVX2 ones.)
//
// Why not MKL: at::linear's sgemm picks its blocking and reduction order by M, so a row's sums
// change with the batch (and it took twice as long at 2-8 rows as at 1). Speed against it:
// benchmarks/README.md, "Deterministic inference". Used for both the Python layers and
// decode_layers, so the two compute the same sums (pagoda::linear; non-contiguous or non-float
// inputs go to at::linear).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include "ops.h"

#include <algorithm>
#include <atomic>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PAGODA_AVX2 1
#endif

namespace {

#if defined(__AVX512F__)
constexpr int VL = 16;
using vec = __m512;
inline vec vzero() { return _mm512_setzero_ps(); }
inline vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
inline float hsum(vec v) {
  const __m256 s8 = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
constexpr int MR = 4, NR = 6;  // 24 accumulators + 6 weight vectors + 1 activation vector of 32 registers
// out[i] = hsum(v[i]) for C vectors, 16 at a time through a transposing network that adds the
// same lanes in the same order as hsum (lane i + lane i+8, then i + i+4, i + i+2, i + i+1), so
// each result is hsum's bit for bit; it takes ~1/4 of the shuffles of C separate hsums.
inline __m512 hsum16(const __m512* a) {
  __m512 c[8], e[4], g[2];
  for (int k = 0; k < 8; ++k)  // [s8 of a[2k] | s8 of a[2k+1]]
    c[k] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * k], a[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_f32x4(a[2 * k], a[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int k = 0; k < 4; ++k)  // quarter q: s4 of a[4k + q]
    e[k] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * k], c[2 * k + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(c[2 * k], c[2 * k + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  for (int k = 0; k < 2; ++k)  // quarter q: s2 of a[8k + q], then of a[8k + 4 + q]
    g[k] = _mm512_add_ps(_mm512_shuffle_ps(e[2 * k], e[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(e[2 * k], e[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  // quarter q, element j: the sum of a[q + 4 j]
  return _mm512_add_ps(_mm512_shuffle_ps(g[0], g[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_ps(g[0], g[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

template <int C>
inline void hsum_all(const __m512* acc, float* out) {
  int i = 0;
  for (; i + 16 <= C; i += 16) {
    alignas(64) float r[16];
    _mm512_store_ps(r, hsum16(acc + i));
    for (int q = 0; q < 4; ++q)
      for (int j = 0; j < 4; ++j) out[i + q + 4 * j] = r[4 * q + j];
  }
  for (; i < C; ++i) out[i] = hsum(acc[i]);
}
#elif defined(PAGODA_AVX2)
constexpr int VL = 8;
using vec = __m256;
inline vec vzero() { return _mm256_setzero_ps(); }
inline vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
inline float hsum(vec v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
constexpr int MR = 4, NR = 3;  // 12 accumulators + 3 weight vectors + 1 activation vector of 16 registers
template <int C>
inline void hsum_all(const __m256* acc, float* out) {
  for (int i = 0; i < C; ++i) out[i] = hsum(acc[i]);
}
#else
constexpr int VL = 1;
constexpr int MR = 4, NR = 4;
#endif

// out[m * ldo + n] = x[m] . w[n] for m < TM, n < TN (x rows and w rows of K floats, contiguous).
template <int TM, int TN>
inline void tile(const float* __restrict__ x, const float* __restrict__ w, int64_t K, float* __restrict__ out,
                 int64_t ldo) {
  float sums[TM][TN];
  int64_t k = 0;
#ifdef PAGODA_AVX2
  vec acc[TM][TN];
  for (int m = 0; m < TM; ++m)
    for (int n = 0; n < TN; ++n) acc[m][n] = vzero();
  for (; k + VL <= K; k += VL) {
    vec wv[TN];
    for (int n = 0; n < TN; ++n) wv[n] = vload(w + n * K + k);
    for (int m = 0; m < TM; ++m) {
      const vec xv = vload(x + m * K + k);
      for (int n = 0; n < TN; ++n) acc[m][n] = vfma(wv[n], xv, acc[m][n]);
    }
  }
  hsum_all<TM * TN>(&acc[0][0], &sums[0][0]);
#else
  for (int m = 0; m < TM; ++m)
    for (int n = 0; n < TN; ++n) sums[m][n] = 0.f;
#endif
  for (; k < K; ++k)
    for (int m = 0; m < TM; ++m)
      for (int n = 0; n < TN; ++n) sums[m][n] += w[n * K + k] * x[m * K + k];
  for (int m = 0; m < TM; ++m)
    for (int n = 0; n < TN; ++n) out[m * ldo + n] = sums[m][n];
}

// A tile of tm <= MR rows by tn <= NR weight rows (MR <= 4, NR <= 6): the switch picks the unrolled kernel.
template <int TM>
inline void tile_n(int tn, const float* x, const float* w, int64_t K, float* out, int64_t ldo) {
  switch (tn) {
    case 6: tile<TM, 6>(x, w, K, out, ldo); break;
    case 5: tile<TM, 5>(x, w, K, out, ldo); break;
    case 4: tile<TM, 4>(x, w, K, out, ldo); break;
    case 3: tile<TM, 3>(x, w, K, out, ldo); break;
    case 2: tile<TM, 2>(x, w, K, out, ldo); break;
    default: tile<TM, 1>(x, w, K, out, ldo);
  }
}

inline void any_tile(int tm, int tn, const float* x, const float* w, int64_t K, float* out, int64_t ldo) {
  switch (tm) {
    case 4: tile_n<4>(tn, x, w, K, out, ldo); break;
    case 3: tile_n<3>(tn, x, w, K, out, ldo); break;
    case 2: tile_n<2>(tn, x, w, K, out, ldo); break;
    default: tile_n<1>(tn, x, w, K, out, ldo);
  }
}

// (Packing the operands into contiguous tile panels, as BLAS does, measured slower here: the
// rows already stream well at these K.)
at::Tensor invariant_matmul(const at::Tensor& x, const at::Tensor& w) {
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  const float* xs = x.data_ptr<float>();
  const float* ws = w.data_ptr<float>();
  float* y = out.data_ptr<float>();
  // Blocking: a thread takes a panel of NB weight rows; for each block of MB activation rows (kept
  // in L2) it sweeps NR weight rows (kept in L1) over the block's MR-row tiles.
  const int64_t NB = std::max<int64_t>(NR, (std::min<int64_t>(N, 96) / NR) * NR);
  const int64_t MB = std::max<int64_t>(MR, ((256 * 1024 / 4) / std::max<int64_t>(K, 1) / MR) * MR);
  const int64_t panels = (N + NB - 1) / NB;
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int64_t n0 = p * NB, n1 = std::min(N, n0 + NB);
      for (int64_t mb = 0; mb < M; mb += MB) {
        const int64_t mb1 = std::min(M, mb + MB);
        for (int64_t n = n0; n < n1; n += NR) {
          const int tn = static_cast<int>(std::min<int64_t>(NR, n1 - n));
          const float* wn = ws + n * K;
          int64_t m = mb;
          for (; m + MR <= mb1; m += MR) {
            if (tn == NR)
              tile<MR, NR>(xs + m * K, wn, K, y + m * N + n, N);
            else
              tile_n<MR>(tn, xs + m * K, wn, K, y + m * N + n, N);
          }
          if (m < mb1) any_tile(static_cast<int>(mb1 - m), tn, xs + m * K, wn, K, y + m * N + n, N);
        }
      }
    }
  });
  return out;
}

}  // namespace

namespace pagoda {

namespace {
std::atomic<bool> g_batch_invariant{false};
}  // namespace

bool batch_invariant() { return g_batch_invariant.load(std::memory_order_relaxed); }

// The switch of deterministic inference (the model runner sets it for each step): pagoda::linear
// takes its own kernel at any M, and block_matmul keeps its integer kernel at any M. Off, both
// hand large M (a prefill) to MKL's GEMM, whose per-row sums depend on M. Returns the old value.
bool set_batch_invariant(bool enabled) { return g_batch_invariant.exchange(enabled); }

// Rows from which a library GEMM is used when batch invariance is off (it is faster there; below,
// this kernel is: MKL's sgemm took twice as long at 2-8 rows as at 1).
constexpr int64_t SMALL_M_MAX = 32;

// oneDNN's GEMM on a weight reordered once into its blocked layout
// (torch.ops.mkldnn._reorder_linear_weight, layers/packed_weights.py), called through the
// dispatcher: torch's own op, boxed so that no C++ signature of it is copied here.
// In row tiles (in_row_tiles, ops.h), so that oneDNN's cache holds a few primitives per weight.
at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& packed) {
  static const c10::OperatorHandle op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  return in_row_tiles(x, [&](const at::Tensor& tile) {
    std::vector<c10::IValue> stack{tile, packed, c10::IValue(), c10::IValue(std::string("none")),
                                   c10::IValue(c10::List<std::optional<at::Scalar>>()), c10::IValue()};
    op.callBoxed(&stack);
    return stack[0].toTensor();
  });
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& packed) {
  const bool floats = x.dim() == 2 && x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat &&
                      x.is_contiguous() && weight.is_contiguous() && x.device().is_cpu() && weight.dim() == 2 &&
                      weight.size(1) == x.size(1);
  if (floats && (x.size(0) <= SMALL_M_MAX || batch_invariant())) return invariant_matmul(x, weight);
  // Many rows: oneDNN on the packed copy where one was made (it measured faster than MKL there), else MKL.
  if (floats && packed.has_value() && packed->defined()) return onednn_linear(x, *packed);
  return at::linear(x, weight);
}

}  // namespace pagoda

static bool set_batch_invariant_op(bool enabled) { return pagoda::set_batch_invariant(enabled); }

TORCH_LIBRARY_FRAGMENT(pagoda, m) {
  m.def("linear(Tensor x, Tensor weight, Tensor? packed=None) -> Tensor");
  m.def("onednn_linear(Tensor x, Tensor packed) -> Tensor");
  m.def("set_batch_invariant(bool enabled) -> bool", &set_batch_invariant_op);  // no tensor: one kernel for all
}

TORCH_LIBRARY_IMPL(pagoda, CPU, m) {
  m.impl("linear", &pagoda::linear);
  m.impl("onednn_linear", &pagoda::onednn_linear);
}
// A float32 weight reordered by oneDNN is an Mkldnn tensor, whose dispatch key selects the kernel
TORCH_LIBRARY_IMPL(pagoda, MkldnnCPU, m) {
  m.impl("linear", &pagoda::linear);
  m.impl("onednn_linear", &pagoda::onednn_linear);
}
