// The LoRA deltas of one projection for every adapter of a step, in one call: for each run j of
// rows [r0, r1) under an adapter with stacked A a_j and parts p (B^T bt_p, output columns out_p),
//   y[r0:r1, out_p] += (x[r0:r1] @ a_j^T)[:, rank_p] @ bt_p
// (layers/lora_delta.py). In torch that is 1 + 2 x parts calls per adapter and projection (a
// thin matmul each), whose dispatch cost was most of a mixed batch's LoRA time at 1B shapes; the
// arithmetic itself is a read of A and B, once a call. The shrink runs over A's rows, the expand
// over column chunks of B^T (bt, [rank, out]), so each weight is read once whatever the rows. The
// adapter's weights are float32 or bfloat16 (half the bytes: a decode step reads every adapter
// of the batch once); x and y are float32, and the arithmetic is float32 either way.
// Registered as torch.ops.pagoda.lora_add (no pybind11: it compiles faster).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "ops.h"

#include <array>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PAGODA_LORA_AVX2 1
#endif

namespace {

constexpr int64_t kChunk = 64;  // output columns per expand task: B^T's rows for them stay in L1

inline float to_float(float v) { return v; }
inline float to_float(at::BFloat16 v) { return static_cast<float>(v); }

#ifdef PAGODA_LORA_AVX2
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {  // a bfloat16 is a float32's high half
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
#endif

// out[i] = dot(x row i, a) for the n <= 4 rows of x (leading dimension ldx): one pass over a, and
// two independent accumulators a row, so the FMAs' latency overlaps.
template <typename W>
void dot_rows(const float* x, int64_t ldx, int64_t n, const W* a, int64_t len, float* out, int64_t ld_out) {
  int64_t k = 0;
  float sums[4] = {0.f, 0.f, 0.f, 0.f};
#ifdef PAGODA_LORA_AVX2
  __m256 acc[4][2];
  for (int i = 0; i < 4; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
  for (; k + 16 <= len; k += 16) {
    const __m256 a0 = load8(a + k), a1 = load8(a + k + 8);
    for (int64_t i = 0; i < n; ++i) {
      acc[i][0] = _mm256_fmadd_ps(_mm256_loadu_ps(x + i * ldx + k), a0, acc[i][0]);
      acc[i][1] = _mm256_fmadd_ps(_mm256_loadu_ps(x + i * ldx + k + 8), a1, acc[i][1]);
    }
  }
  for (int64_t i = 0; i < n; ++i) {
    const __m256 v = _mm256_add_ps(acc[i][0], acc[i][1]);
    __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    half = _mm_add_ps(half, _mm_movehl_ps(half, half));
    half = _mm_add_ss(half, _mm_shuffle_ps(half, half, 1));
    sums[i] = _mm_cvtss_f32(half);
  }
#endif
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = k; j < len; ++j) sums[i] += x[i * ldx + j] * to_float(a[j]);
    out[i * ld_out] = sums[i];
  }
}

// y_row[0:w] += sum over r of low[r] * bt[r * ld + 0:w], 32 columns at a time in four independent
// accumulators (one chain of rank FMAs each would wait on the FMA's latency).
template <typename W>
void expand_row(float* y, const float* low, const W* bt, int64_t ld, int64_t rank, int64_t w) {
  int64_t c = 0;
#ifdef PAGODA_LORA_AVX2
  for (; c + 32 <= w; c += 32) {
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t r = 0; r < rank; ++r) {
      const __m256 l = _mm256_set1_ps(low[r]);
      const W* row = bt + r * ld + c;
      for (int q = 0; q < 4; ++q) acc[q] = _mm256_fmadd_ps(l, load8(row + 8 * q), acc[q]);
    }
    for (int q = 0; q < 4; ++q) _mm256_storeu_ps(y + c + 8 * q, _mm256_add_ps(_mm256_loadu_ps(y + c + 8 * q), acc[q]));
  }
  for (; c + 8 <= w; c += 8) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t r = 0; r < rank; ++r) acc = _mm256_fmadd_ps(_mm256_set1_ps(low[r]), load8(bt + r * ld + c), acc);
    _mm256_storeu_ps(y + c, _mm256_add_ps(_mm256_loadu_ps(y + c), acc));
  }
#endif
  for (; c < w; ++c) {
    float acc = 0.f;
    for (int64_t r = 0; r < rank; ++r) acc += low[r] * to_float(bt[r * ld + c]);
    y[c] += acc;
  }
}

void check(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.dim() == 2 && t.stride(1) == 1, name,
              " must be a 2-D float32 tensor with contiguous rows");
}

// Every run of one projection's call: run j has adapter weights as[j] (its parts bts[part_begin[j] ..
// part_begin[j + 1]) with their column and rank offsets) and rows [row_starts[j], row_ends[j]).
struct Runs {
  at::TensorList as, bts;
  at::IntArrayRef part_begin, out_starts, rank_starts, row_starts, row_ends;
};

// Run j's shrink output row r: low[low_at[j] + i * R + r] = dot(x row r0 + i, A_j row r), its rows four at a time.
template <typename W>
void shrink(const float* xs, int64_t ldx, int64_t in, const Runs& runs, int64_t j, int64_t r, float* low) {
  const int64_t R = runs.as[j].size(0), r0 = runs.row_starts[j];
  const W* a = runs.as[j].data_ptr<W>() + r * in;
  for (int64_t i = 0, n = runs.row_ends[j] - r0; i < n; i += 4)
    dot_rows(xs + (r0 + i) * ldx, ldx, std::min<int64_t>(4, n - i), a, in, low + i * R + r, R);
}

// y[run j's rows, part p's columns c0 .. c0 + kChunk] += low_j[:, p's ranks] @ bt_p[:, those columns]
template <typename W>
void expand(float* ys, int64_t ldy, const Runs& runs, int64_t j, int64_t p, int64_t c0, const float* low) {
  const at::Tensor& bt = runs.bts[p];
  const int64_t width = bt.size(1), w = std::min(kChunk, width - c0), R = runs.as[j].size(0);
  const int64_t r0 = runs.row_starts[j], o0 = runs.out_starts[p] + c0;
  for (int64_t i = 0; i < runs.row_ends[j] - r0; ++i)
    expand_row(ys + (r0 + i) * ldy + o0, low + i * R + runs.rank_starts[p], bt.data_ptr<W>() + c0, width,
               bt.size(0), w);
}

template <typename W>
void lora_add_as(at::Tensor& y, const at::Tensor& x, const Runs& runs) {
  const int64_t num_runs = runs.as.size(), in = x.size(1), ldx = x.stride(0), ldy = y.stride(0);
  // the shrink's outputs: run j's rows x its A's rows, from offset low_at[j]
  std::vector<int64_t> low_at(num_runs + 1, 0), shrink_at(num_runs + 1, 0);
  for (int64_t j = 0; j < num_runs; ++j) {
    const at::Tensor& a = runs.as[j];
    TORCH_CHECK(a.is_contiguous() && a.scalar_type() == runs.as[0].scalar_type() && a.size(1) == in,
                "lora_add: every A must be contiguous, of one dtype, with x's columns");
    const int64_t n = runs.row_ends[j] - runs.row_starts[j];
    TORCH_CHECK(n >= 0 && runs.row_starts[j] >= 0 && runs.row_ends[j] <= x.size(0) && runs.row_ends[j] <= y.size(0),
                "lora_add: rows out of range");
    low_at[j + 1] = low_at[j] + n * a.size(0);
    shrink_at[j + 1] = shrink_at[j] + a.size(0);
  }
  // the expand's tasks: (run, part, chunk of kChunk columns), in order
  std::vector<std::array<int64_t, 3>> tasks;
  std::vector<int64_t> tasks_at(num_runs + 1, 0);  // run j's tasks begin at tasks_at[j]
  for (int64_t j = 0; j < num_runs; ++j) {
    for (int64_t p = runs.part_begin[j]; p < runs.part_begin[j + 1]; ++p) {
      const at::Tensor& bt = runs.bts[p];
      TORCH_CHECK(bt.is_contiguous() && bt.scalar_type() == runs.as[j].scalar_type() &&
                      runs.rank_starts[p] + bt.size(0) <= runs.as[j].size(0) && runs.out_starts[p] + bt.size(1) <= y.size(1),
                  "lora_add: a part out of range, or not of A's dtype");
      for (int64_t c = 0; c < bt.size(1); c += kChunk) tasks.push_back({j, p, c});
    }
    tasks_at[j + 1] = static_cast<int64_t>(tasks.size());
  }
  std::vector<float> low(low_at[num_runs]);
  const float* xs = x.data_ptr<float>();
  float* ys = y.data_ptr<float>();
  if (num_runs >= at::get_num_threads()) {
    // a run a task, its shrink then its expand: one parallel region where a projection's call has
    // two (each region's start and end cost as much as a small adapter's arithmetic); the same sums
    at::parallel_for(0, num_runs, 1, [&](int64_t begin, int64_t end) {
      for (int64_t j = begin; j < end; ++j) {
        for (int64_t r = 0; r < shrink_at[j + 1] - shrink_at[j]; ++r) shrink<W>(xs, ldx, in, runs, j, r, low.data() + low_at[j]);
        for (int64_t t = tasks_at[j]; t < tasks_at[j + 1]; ++t)
          expand<W>(ys, ldy, runs, j, tasks[t][1], tasks[t][2], low.data() + low_at[j]);
      }
    });
    return;
  }
  at::parallel_for(0, shrink_at[num_runs], 1, [&](int64_t begin, int64_t end) {
    int64_t j = 0;
    for (int64_t t = begin; t < end; ++t) {
      while (t >= shrink_at[j + 1]) ++j;
      shrink<W>(xs, ldx, in, runs, j, t - shrink_at[j], low.data() + low_at[j]);
    }
  });
  at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const auto [j, p, c0] = tasks[t];
      expand<W>(ys, ldy, runs, j, p, c0, low.data() + low_at[j]);
    }
  });
}

}  // namespace

namespace pagoda {

void lora_add(at::Tensor y, const at::Tensor& x, at::TensorList as, at::TensorList bts, at::IntArrayRef part_begin,
              at::IntArrayRef out_starts, at::IntArrayRef rank_starts, at::IntArrayRef row_starts,
              at::IntArrayRef row_ends) {
  check(y, "y");
  check(x, "x");
  TORCH_CHECK(!as.empty() && part_begin.size() == as.size() + 1 && row_starts.size() == as.size() &&
                  row_ends.size() == as.size() && out_starts.size() == bts.size() && rank_starts.size() == bts.size() &&
                  part_begin.back() == static_cast<int64_t>(bts.size()),
              "lora_add: one A and one row range a run, part_begin bounding each run's parts");
  const Runs runs{as, bts, part_begin, out_starts, rank_starts, row_starts, row_ends};
  const auto dtype = as[0].scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "lora_add: A and B must be float32 or bfloat16");
  if (dtype == at::kBFloat16)
    lora_add_as<at::BFloat16>(y, x, runs);
  else
    lora_add_as<float>(y, x, runs);
}

}  // namespace pagoda

TORCH_LIBRARY_FRAGMENT(pagoda, m) {
  m.def("lora_add(Tensor(a!) y, Tensor x, Tensor[] a_list, Tensor[] bts, int[] part_begin, int[] out_starts, "
        "int[] rank_starts, int[] row_starts, int[] row_ends) -> ()");
}

TORCH_LIBRARY_IMPL(pagoda, CPU, m) { m.impl("lora_add", &pagoda::lora_add); }
