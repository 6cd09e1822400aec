// Paged attention on the CPU for rows that each attend over a prefix of their sequence: decode
// tokens, and (the runner's "decode-like" layout) every token of a prefill chunk, row j of a
// chunk starting at position s seeing s + j + 1 positions, its K/V already in the cache.
// With a sliding window W > 0 (Gemma 3's local layers, Mistral), a row of length L sees only its
// last min(L, W) positions: blocks wholly before the window are never read, and the softmax and
// the weighted sum run over the window alone.
//
// Reads each sequence's K/V straight from the block pool through its block table: no gather
// copy, no padding to the longest sequence. One work item per (group of runs of rows, kv head)
// handles the whole GQA group of query heads that share that kv head (in a large batch, an item
// takes every kv head of its group, block by block: WHOLE_HEADS_RUNS_PER_THREAD); a group's runs
// share leading blocks, read once for all of them (see TILE and plan() below). Keys are scored
// KEY_STRETCH positions at a time. Softmax in fp32. A row's result does not depend on the batch.
// Registered as torch.ops.pagoda.paged_decode_attention (no pybind11: it compiles faster).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "ops.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <type_traits>
#include <limits>
#include <vector>

#include "kv_codes.h"
#include "kv_rows.h"
#include "vec_math.h"

namespace {

// p[t] = exp(s[t] - max) / sum, in place.
inline void softmax(float* s, int64_t L) {
  const float sum = pagoda::exp_minus_and_sum(s, L, pagoda::max_of(s, L));
  const float inv = 1.f / sum;
  for (int64_t i = 0; i < L; ++i) s[i] *= inv;
}

// Rows of the batch that belong to one sequence's chunk (consecutive rows with the same block
// table, each seeing one position more than the one before) are attended together, up to TILE
// rows at a time (a "run"), so that each block of keys and values is read once for the whole run.
// Runs whose block tables begin with the same blocks (requests that share a cached prefix, or the
// tiles of one long chunk) are grouped into one work item that reads those shared blocks once for
// all of its rows. Tiling and grouping change only which sums are computed together, never how
// one is: for a query row,
//   score[t] = q . k_t   a multiply-add chain over d = 0..D-1 (lanes hold keys, not d),
//   softmax  over its own L scores (the order depends on L only),
//   out[d]   = sum_t p[t] * v_t[d]   a multiply-add chain over t = 0..L-1 (lanes hold d),
// so a token's attention output is the same whether it is a decode, one row of a prefill chunk,
// or the tail of a prompt after a prefix-cache hit, and whatever else is in the batch.
constexpr int64_t TILE = 16;
// A work item keeps its rows' scores (one float per query head and position) until the softmax.
// A run's stay within RUN_BUDGET floats (1 MiB, about the L2 cache; a long prefix makes runs
// shorter); a group's within GROUP_BUDGET (4 MiB): measured on SmolLM2's shapes, sharing the
// prefix's reads pays for scores that spill to the L3 cache.
constexpr int64_t RUN_BUDGET = 256 * 1024;
constexpr int64_t GROUP_BUDGET = 1024 * 1024;
// Runs are grouped only when they share at least this many whole blocks.
constexpr int64_t MIN_SHARED_BLOCKS = 4;
// From this many runs a thread, a work item covers every kv head of its runs (see plan()).
constexpr int64_t WHOLE_HEADS_RUNS_PER_THREAD = 4;

struct Run {
  int64_t row, rows;  // rows row .. row + rows - 1 of the batch: one sequence, lengths ascending
};

struct Item {
  int64_t first, count;  // runs[first .. first + count) of the plan
  int64_t shared;        // leading positions every row of every run sees in full, read once for all
  int64_t h, heads;      // kv heads h .. h + heads - 1
  int64_t cost;          // positions its rows read, per head (for ordering the queue)
};

struct Plan {
  std::vector<Run> runs;
  std::vector<Item> items;
};

#ifdef PAGODA_AVX2
// scores for NQ query vectors against T tiles of 8 keys side by side (kt[d * ldk + 8 * c + lane]),
// each a fma chain over d: T * NQ independent chains (a decode row's 3 query heads alone give 3).
template <int NQ, int T = 1>
inline void score8(const float* q, int64_t D, const float* kt, int64_t ldk, float* out, int64_t ldo) {
  __m256 acc[T][NQ];
  for (int c = 0; c < T; ++c)
    for (int i = 0; i < NQ; ++i) acc[c][i] = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; ++d) {
    for (int i = 0; i < NQ; ++i) {
      const __m256 qv = _mm256_set1_ps(q[i * D + d]);
      for (int c = 0; c < T; ++c) acc[c][i] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kt + d * ldk + 8 * c), acc[c][i]);
    }
  }
  for (int c = 0; c < T; ++c)
    for (int i = 0; i < NQ; ++i) _mm256_storeu_ps(out + i * ldo + 8 * c, acc[c][i]);
}
#endif

#ifdef __FMA__
inline float madd(float a, float b, float c) { return std::fma(a, b, c); }  // as the vector FMAs round
#else
inline float madd(float a, float b, float c) { return a * b + c; }  // no vector path here either
#endif

#if defined(__AVX512F__)
// score8's 16-lane kernel, over T tiles of 16 keys side by side (kt + 16 * c): T * NQ independent
// chains, so that the FMAs' latency is hidden where a decode row's 3 query heads alone would give
// only 3. Each score is still its own chain over d.
template <int NQ, int T = 1>
inline void score16(const float* q, int64_t D, const float* kt, int64_t ldk, float* out, int64_t ldo) {
  __m512 acc[T][NQ];
  for (int c = 0; c < T; ++c)
    for (int i = 0; i < NQ; ++i) acc[c][i] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; ++d) {
    __m512 kv[T];
    for (int c = 0; c < T; ++c) kv[c] = _mm512_loadu_ps(kt + d * ldk + 16 * c);
    for (int i = 0; i < NQ; ++i) {
      const __m512 qv = _mm512_set1_ps(q[i * D + d]);
      for (int c = 0; c < T; ++c) acc[c][i] = _mm512_fmadd_ps(qv, kv[c], acc[c][i]);
    }
  }
  for (int c = 0; c < T; ++c)
    for (int i = 0; i < NQ; ++i) _mm512_storeu_ps(out + i * ldo + 16 * c, acc[c][i]);
}
#endif

// scores of NQ query vectors against the LANES keys of kt: the 16- or the 8-lane kernel.
// With 16 lanes and few queries, TILES_FOR_FEW_QUERIES tiles of keys at a time.
template <int LANES, int NQ>
inline void score_tile(const float* q, int64_t D, const float* kt, int64_t ldk, float* out, int64_t ldo) {
#if defined(__AVX512F__)
  if constexpr (LANES == 16) score16<NQ>(q, D, kt, ldk, out, ldo);
  if constexpr (LANES == 32) score16<NQ, 2>(q, D, kt, ldk, out, ldo);
  if constexpr (LANES == 64) score16<NQ, 4>(q, D, kt, ldk, out, ldo);
#endif
#ifdef PAGODA_AVX2
  if constexpr (LANES == 8) score8<NQ>(q, D, kt, ldk, out, ldo);
#if !defined(__AVX512F__)
  if constexpr (LANES == 32) score8<NQ, 4>(q, D, kt, ldk, out, ldo);
#endif
#endif
}

// score_tile for the last `left` (< MAXQ + 1) queries: the kernel of that many
template <int LANES, int NQ>
inline void score_rest(int64_t left, const float* q, int64_t D, const float* kt, int64_t ldk, float* out, int64_t ldo) {
  if constexpr (NQ > 0) {
    if (left == NQ) score_tile<LANES, NQ>(q, D, kt, ldk, out, ldo);
    else score_rest<LANES, NQ - 1>(left, q, D, kt, ldk, out, ldo);
  }
}

// scores of q[0..nq) against the keys j.. of kt, LANES keys at a time (MAXQ queries a kernel
// call, then the remaining ones); returns the first key left over (fewer than LANES remain).
template <int LANES, int MAXQ = 8>
inline int64_t score_columns(const float* q, int64_t nq, int64_t D, const float* kt, int64_t ldk, int64_t j,
                             int64_t n, float* out, int64_t ldo) {
  for (; j + LANES <= n; j += LANES) {
    int64_t i = 0;
    for (; i + MAXQ <= nq; i += MAXQ) score_tile<LANES, MAXQ>(q + i * D, D, kt + j, ldk, out + i * ldo + j, ldo);
    score_rest<LANES, MAXQ - 1>(nq - i, q + i * D, D, kt + j, ldk, out + i * ldo + j, ldo);
  }
  return j;
}

// scores of query vectors q[0..nq) (rows of D) against n keys kt (transposed: kt[d * ldk + j])
inline void scores_block(const float* q, int64_t nq, int64_t D, const float* kt, int64_t ldk, int64_t n,
                         float* out, int64_t ldo) {
  int64_t j = 0;
#if defined(__AVX512F__)
  if (nq <= 4) j = score_columns<64, 4>(q, nq, D, kt, ldk, j, n, out, ldo);
  j = score_columns<32>(q, nq, D, kt, ldk, j, n, out, ldo);
  j = score_columns<16>(q, nq, D, kt, ldk, j, n, out, ldo);
#endif
#ifdef PAGODA_AVX2
#if !defined(__AVX512F__)
  if (nq <= 3) j = score_columns<32, 3>(q, nq, D, kt, ldk, j, n, out, ldo);
#endif
  j = score_columns<8>(q, nq, D, kt, ldk, j, n, out, ldo);
#endif
  for (; j < n; ++j)
    for (int64_t i = 0; i < nq; ++i) {
      float s = 0.f;
      for (int64_t d = 0; d < D; ++d) s = madd(q[i * D + d], kt[d * ldk + j], s);
      out[i * ldo + j] = s;
    }
}

using pagoda::BlockReader;
using pagoda::Rows;
using pagoda::transpose;
using pagoda::window_start;

// acc_i[0..D) += p_i[t] * v[t][0..D) for t = 0..n-1 in order (a fma per element), for NV query
// vectors i (acc_i = acc + i * D, p_i = p + i * ldp) that share the values: each value vector is
// loaded once for all of them, and their independent chains keep the FMA units busy.
template <int NV, typename cache_t>
inline void accumulate_block(float* acc, const float* p, int64_t ldp, const Rows<cache_t>& v, int64_t n, int64_t D) {
  int64_t d = 0;
#if defined(__AVX512F__)
  for (; d + 64 <= D; d += 64) {
    __m512 a[NV][4];
    for (int i = 0; i < NV; ++i)
      for (int c = 0; c < 4; ++c) a[i][c] = _mm512_loadu_ps(acc + i * D + d + 16 * c);
    for (int64_t t = 0; t < n; ++t) {
      const __m512 v0 = v.load16(t, d), v1 = v.load16(t, d + 16);
      const __m512 v2 = v.load16(t, d + 32), v3 = v.load16(t, d + 48);
      for (int i = 0; i < NV; ++i) {
        const __m512 pv = _mm512_set1_ps(p[i * ldp + t]);
        a[i][0] = _mm512_fmadd_ps(pv, v0, a[i][0]);
        a[i][1] = _mm512_fmadd_ps(pv, v1, a[i][1]);
        a[i][2] = _mm512_fmadd_ps(pv, v2, a[i][2]);
        a[i][3] = _mm512_fmadd_ps(pv, v3, a[i][3]);
      }
    }
    for (int i = 0; i < NV; ++i)
      for (int c = 0; c < 4; ++c) _mm512_storeu_ps(acc + i * D + d + 16 * c, a[i][c]);
  }
#endif
#ifdef PAGODA_AVX2
  // 4 vectors a query: 4 NV chains, a row's 128 bytes read at once. The weights are broadcast
  // first and each value vector is used as it is widened: 4 NV sums + NV weights + 1 vector fit
  // the 16 registers, where 4 widened vectors held at once spilled a sum to the stack.
  if constexpr (NV <= 3)
    for (; d + 32 <= D; d += 32) {
      __m256 a[NV][4];
      for (int i = 0; i < NV; ++i)
        for (int c = 0; c < 4; ++c) a[i][c] = _mm256_loadu_ps(acc + i * D + d + 8 * c);
      for (int64_t t = 0; t < n; ++t) {
        __m256 pv[NV];
        for (int i = 0; i < NV; ++i) pv[i] = _mm256_set1_ps(p[i * ldp + t]);
        for (int c = 0; c < 4; ++c) {
          const __m256 vc = v.load8(t, d + 8 * c);
          for (int i = 0; i < NV; ++i) a[i][c] = _mm256_fmadd_ps(pv[i], vc, a[i][c]);
        }
      }
      for (int i = 0; i < NV; ++i)
        for (int c = 0; c < 4; ++c) _mm256_storeu_ps(acc + i * D + d + 8 * c, a[i][c]);
    }
  for (; d + 16 <= D; d += 16) {
    __m256 a[NV][2];
    for (int i = 0; i < NV; ++i)
      for (int c = 0; c < 2; ++c) a[i][c] = _mm256_loadu_ps(acc + i * D + d + 8 * c);
    for (int64_t t = 0; t < n; ++t) {
      const __m256 v0 = v.load8(t, d), v1 = v.load8(t, d + 8);
      for (int i = 0; i < NV; ++i) {
        const __m256 pv = _mm256_set1_ps(p[i * ldp + t]);
        a[i][0] = _mm256_fmadd_ps(pv, v0, a[i][0]);
        a[i][1] = _mm256_fmadd_ps(pv, v1, a[i][1]);
      }
    }
    for (int i = 0; i < NV; ++i)
      for (int c = 0; c < 2; ++c) _mm256_storeu_ps(acc + i * D + d + 8 * c, a[i][c]);
  }
  for (; d + 8 <= D; d += 8)
    for (int i = 0; i < NV; ++i) {
      __m256 a = _mm256_loadu_ps(acc + i * D + d);
      for (int64_t t = 0; t < n; ++t) a = _mm256_fmadd_ps(_mm256_set1_ps(p[i * ldp + t]), v.load8(t, d), a);
      _mm256_storeu_ps(acc + i * D + d, a);
    }
#endif
  for (; d < D; ++d)
    for (int i = 0; i < NV; ++i) {
      float a = acc[i * D + d];
      for (int64_t t = 0; t < n; ++t) a = madd(p[i * ldp + t], v.at(t, d), a);
      acc[i * D + d] = a;
    }
}

// accumulate_block for any number of vectors, up to 4 at a time
template <typename cache_t>
inline void accumulate_vectors(int64_t nv, float* acc, const float* p, int64_t ldp, const Rows<cache_t>& v, int64_t n,
                               int64_t D) {
  for (; nv >= 4; nv -= 4, acc += 4 * D, p += 4 * ldp) accumulate_block<4>(acc, p, ldp, v, n, D);
  switch (nv) {
    case 3: accumulate_block<3>(acc, p, ldp, v, n, D); break;
    case 2: accumulate_block<2>(acc, p, ldp, v, n, D); break;
    case 1: accumulate_block<1>(acc, p, ldp, v, n, D); break;
    default: break;
  }
}


// How many whole leading blocks two rows' tables share, up to `limit`.
inline int64_t common_blocks(const int64_t* a, const int64_t* b, int64_t limit) {
  int64_t n = 0;
  while (n < limit && a[n] == b[n]) ++n;
  return n;
}

// Padded score-row length of a row of length `len` whose scores start at `base`.
inline int64_t score_width(int64_t len, int64_t base, int64_t BS) { return (len - base + BS - 1) / BS * BS; }

// Rows of the batch → runs (rows of one sequence, cut to TILE rows and to the score budget) →
// groups of runs that share leading blocks (without a window only) → work items, one per group
// and kv head, longest first (a queue that threads pull from, so a long prompt's last items do not
// end up on one thread).
Plan plan(const int64_t* tables, const int64_t* lens, int64_t B, int64_t max_blocks, int64_t Hkv, int64_t G,
          int64_t BS, int64_t window) {
  Plan p;
  for (int64_t b = 0; b < B;) {
    const int64_t base = window_start(lens[b], window) / BS * BS;
    int64_t e = b + 1;
    while (e < B && e - b < TILE && lens[e] == lens[e - 1] + 1 &&
           (e - b + 1) * G * score_width(lens[e], base, BS) <= RUN_BUDGET &&
           std::equal(tables + e * max_blocks, tables + (e + 1) * max_blocks, tables + b * max_blocks))
      ++e;
    p.runs.push_back({b, e - b});
    b = e;
  }
  // Group runs by their first block (a run's first row is its shortest): each group's leader is
  // its first run in that order, and a run joins while it shares MIN_SHARED_BLOCKS whole blocks
  // with the leader and the group's scores fit the budget.
  std::vector<int64_t> order(p.runs.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  if (window == 0)
    std::stable_sort(order.begin(), order.end(), [&](int64_t x, int64_t y) {
      return tables[p.runs[x].row * max_blocks] < tables[p.runs[y].row * max_blocks];
    });
  // at least two items per thread where there are enough runs, so that the queue can balance
  // With runs enough for every thread, an item takes all kv heads of its runs, block by block:
  // a block's heads lie side by side in the pool, so it reads one stretch of Hkv * BS rows
  // instead of Hkv stretches far apart (measured on 64 rows, 3 kv heads: ~20 % less time where
  // the sequences' blocks follow one another). Fewer runs keep one item per head, for the threads.
  const int64_t threads = at::get_num_threads();
  const int64_t heads = static_cast<int64_t>(p.runs.size()) >= WHOLE_HEADS_RUNS_PER_THREAD * threads ? Hkv : 1;
  const int64_t groups_wanted = std::max<int64_t>(1, (2 * threads * heads + Hkv - 1) / Hkv);
  const int64_t max_runs = std::max<int64_t>(1, (static_cast<int64_t>(p.runs.size()) + groups_wanted - 1) / groups_wanted);
  std::vector<Run> grouped;
  grouped.reserve(p.runs.size());
  for (size_t i = 0; i < order.size();) {
    const Run lead = p.runs[order[i]];
    const int64_t* lead_table = tables + lead.row * max_blocks;
    int64_t shared = lens[lead.row] / BS;  // whole blocks every row of the group sees
    int64_t last_len = lens[lead.row + lead.rows - 1];
    int64_t floats = lead.rows * G * score_width(last_len, 0, BS);
    int64_t cost = last_len;
    size_t j = i + 1;
    for (; window == 0 && j < order.size(); ++j) {
      const Run r = p.runs[order[j]];
      const int64_t common =
          common_blocks(lead_table, tables + r.row * max_blocks, std::min(shared, lens[r.row] / BS));
      const int64_t r_floats = r.rows * G * score_width(lens[r.row + r.rows - 1], 0, BS);
      if (common < MIN_SHARED_BLOCKS || floats + r_floats > GROUP_BUDGET || static_cast<int64_t>(j - i) >= max_runs) break;
      shared = common;
      floats += r_floats;
      cost += lens[r.row + r.rows - 1] - shared * BS;
    }
    const int64_t first = grouped.size();
    for (size_t k = i; k < j; ++k) grouped.push_back(p.runs[order[k]]);
    const int64_t count = j - i;
    const int64_t base = window_start(lens[lead.row], window) / BS * BS;
    const int64_t shared_positions = count > 1 ? shared * BS : base;  // alone, a run shares nothing
    if (count == 1) cost = last_len - window_start(lens[lead.row], window);
    for (int64_t h = 0; h < Hkv; h += heads) p.items.push_back({first, count, shared_positions, h, heads, cost * heads});
    i = j;
  }
  p.runs = std::move(grouped);
  std::stable_sort(p.items.begin(), p.items.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });
  return p;
}

// Keys are scored this many positions at a time (whole blocks): a decode row's few query heads
// against 4 tiles of 16 keys keep 12 FMA chains going where one tile kept 3 (score16).
constexpr int64_t KEY_STRETCH = 64;

// scalar_t: the queries' and the output's type; cache_t: the KV cache's (--kv-cache-dtype), which
// may be narrower: keys and values are widened to float as they are read, so the arithmetic is the
// same as over a float cache holding the same (rounded) values.
// An int8 or fp8 cache (kv_codes.h) comes with k_scales / v_scales [num_blocks, Hkv, BS]: one
// float per token and head, by which its codes are multiplied as they are widened.
template <typename scalar_t, typename cache_t>
void decode_attention_impl(const scalar_t* __restrict__ q, const cache_t* __restrict__ k_cache,
                           const cache_t* __restrict__ v_cache, const int64_t* __restrict__ tables,
                           const int64_t* __restrict__ lens, scalar_t* __restrict__ out,
                           int64_t B, int64_t Hq, int64_t Hkv, int64_t D, int64_t BS,
                           int64_t max_blocks, float scale, int64_t window,
                           const float* k_scales = nullptr, const float* v_scales = nullptr) {
  const int64_t G = Hq / Hkv;
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(lens[b] >= 1 && lens[b] <= max_blocks * BS, "paged_decode_attention: bad seq_len ", lens[b]);
  const Plan work = plan(tables, lens, B, max_blocks, Hkv, G, BS, window);
  const BlockReader<cache_t> keys{k_cache, k_scales, Hkv, BS, D}, values{v_cache, v_scales, Hkv, BS, D};
  // keys are transposed and scored a stretch of whole blocks at a time
  const int64_t stretch = std::max<int64_t>(1, KEY_STRETCH / BS) * BS;
  std::atomic<int64_t> next{0};
  const int64_t num_items = work.items.size();
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), num_items));
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    std::vector<float> qf, acc, kt(Hkv * D * stretch), scores;
    std::vector<int64_t> q_off, sc_off, ld;  // per run of the item: first query vector, first score, row stride
    for (int64_t it = next++; it < num_items; it = next++) {
      const Item& item = work.items[it];
      const Run* runs = work.runs.data() + item.first;
      // Positions before `base` (whole blocks before the first row's window) are never read; a
      // row of scores holds positions base .. its run's longest row, padded to whole blocks.
      const int64_t base = window_start(lens[runs[0].row], window) / BS * BS;
      q_off.assign(item.count + 1, 0);
      sc_off.assign(item.count + 1, 0);
      ld.assign(item.count, 0);
      for (int64_t r = 0; r < item.count; ++r) {
        ld[r] = score_width(lens[runs[r].row + runs[r].rows - 1], base, BS);
        q_off[r + 1] = q_off[r] + runs[r].rows * G;
        sc_off[r + 1] = sc_off[r] + runs[r].rows * G * ld[r];
      }
      // the item's kv heads each have their own queries, scores and sums, one after another
      const int64_t nq = q_off[item.count], ns = sc_off[item.count];
      qf.resize(item.heads * nq * D);
      acc.assign(item.heads * nq * D, 0.f);
      scores.resize(item.heads * ns);
      for (int64_t e = 0; e < item.heads; ++e) {
        const int64_t h = item.h + e;
        for (int64_t r = 0; r < item.count; ++r)
          for (int64_t i = 0; i < runs[r].rows; ++i)
            for (int64_t g = 0; g < G; ++g)
              for (int64_t d = 0; d < D; ++d)
                qf[(e * nq + q_off[r] + i * G + g) * D + d] =
                    static_cast<float>(q[((runs[r].row + i) * Hq + h * G + g) * D + d]) * scale;
      }
      // the n keys from position t0 (a stretch of up to KEY_STRETCH, whole blocks but for the
      // last) of each of the item's heads, transposed once, side by side (head e's at kt + e * D *
      // stretch), against every query of the run(s) that see them. Block by block, the heads of a
      // block one after another: they lie side by side in the pool.
      auto transpose_keys = [&](const int64_t* table, int64_t t0, int64_t n, int64_t Lmax, bool first) {
        for (int64_t j = 0; j < n; j += BS)
          for (int64_t e = 0; e < item.heads; ++e) {
            keys.prefetch_ahead(table, item.h + e, t0 + j, Lmax, first && j == 0);
            transpose(keys.rows(table[(t0 + j) / BS], item.h + e), std::min(BS, n - j), D,
                      kt.data() + e * D * stretch + j, stretch);
          }
      };
      // scores: the shared blocks once for every run, then each run's own blocks
      const int64_t* lead_table = tables + runs[0].row * max_blocks;
      for (int64_t t0 = base; t0 < item.shared; t0 += stretch) {
        const int64_t n = std::min(stretch, item.shared - t0);
        transpose_keys(lead_table, t0, n, item.shared, t0 == base);
        for (int64_t e = 0; e < item.heads; ++e)
          for (int64_t r = 0; r < item.count; ++r)
            scores_block(qf.data() + (e * nq + q_off[r]) * D, runs[r].rows * G, D, kt.data() + e * D * stretch, stretch,
                         n, scores.data() + e * ns + sc_off[r] + (t0 - base), ld[r]);
      }
      for (int64_t r = 0; r < item.count; ++r) {
        const Run run = runs[r];
        const int64_t* table = tables + run.row * max_blocks;
        const int64_t Lmax = lens[run.row + run.rows - 1];
        const int64_t start = std::max(base, item.shared);
        for (int64_t t0 = start; t0 < Lmax; t0 += stretch) {
          // whole blocks, the last one's positions past Lmax too: a row's scores past its own end
          // are never read, and whole 16-key tiles spare the narrow and scalar tails
          const int64_t n = (std::min(stretch, Lmax - t0) + BS - 1) / BS * BS;
          int64_t r0 = 0;  // rows before r0 end before this stretch (the others may end within it)
          while (lens[run.row + r0] <= t0) ++r0;
          transpose_keys(table, t0, n, Lmax, t0 == start);
          for (int64_t e = 0; e < item.heads; ++e)
            scores_block(qf.data() + (e * nq + q_off[r] + r0 * G) * D, (run.rows - r0) * G, D, kt.data() + e * D * stretch,
                         stretch, n, scores.data() + e * ns + sc_off[r] + r0 * G * ld[r] + (t0 - base), ld[r]);
        }
        // softmax over each row's own window; the positions of its run before that weigh exactly 0
        for (int64_t e = 0; e < item.heads; ++e)
          for (int64_t i = 0; i < run.rows; ++i) {
            const int64_t len = lens[run.row + i], first = window_start(len, window) - base;
            for (int64_t g = 0; g < G; ++g) {
              float* row_scores = scores.data() + e * ns + sc_off[r] + (i * G + g) * ld[r];
              std::fill(row_scores, row_scores + first, 0.f);
              softmax(row_scores + first, len - base - first);
            }
          }
      }
      // out: each query's values, a block at a time; the shared blocks once for every run
      for (int64_t t0 = base; t0 < item.shared; t0 += BS)
        for (int64_t e = 0; e < item.heads; ++e) {
          const Rows<cache_t> v = values.rows(lead_table[t0 / BS], item.h + e);
          for (int64_t r = 0; r < item.count; ++r)
            accumulate_vectors(runs[r].rows * G, acc.data() + (e * nq + q_off[r]) * D,
                               scores.data() + e * ns + sc_off[r] + (t0 - base), ld[r], v, BS, D);
        }
      for (int64_t r = 0; r < item.count; ++r) {
        const Run run = runs[r];
        const int64_t* table = tables + run.row * max_blocks;
        const int64_t Lmax = lens[run.row + run.rows - 1];
        for (int64_t t0 = std::max(base, item.shared); t0 < Lmax; t0 += BS) {
          const int64_t n = std::min(BS, Lmax - t0);
          // rows that see all n keys of this block together, then the one or two that see fewer
          int64_t i0 = 0;
          while (i0 < run.rows && lens[run.row + i0] - t0 <= 0) ++i0;
          int64_t full = i0;
          while (full < run.rows && lens[run.row + full] - t0 < n) ++full;
          for (int64_t e = 0; e < item.heads; ++e) {
            values.prefetch_ahead(table, item.h + e, t0, Lmax, t0 == std::max(base, item.shared));
            const Rows<cache_t> v = values.rows(table[t0 / BS], item.h + e);
            const float* sc = scores.data() + e * ns + sc_off[r];
            float* racc = acc.data() + (e * nq + q_off[r]) * D;
            for (int64_t i = i0; i < full; ++i)
              accumulate_vectors(G, racc + i * G * D, sc + i * G * ld[r] + (t0 - base), ld[r], v, lens[run.row + i] - t0, D);
            if (full < run.rows)
              accumulate_vectors((run.rows - full) * G, racc + full * G * D, sc + full * G * ld[r] + (t0 - base), ld[r], v,
                                 n, D);
          }
        }
      }
      for (int64_t e = 0; e < item.heads; ++e)
        for (int64_t r = 0; r < item.count; ++r)
          for (int64_t i = 0; i < runs[r].rows; ++i)
            for (int64_t g = 0; g < G; ++g)
              for (int64_t d = 0; d < D; ++d)
                out[((runs[r].row + i) * Hq + (item.h + e) * G + g) * D + d] =
                    static_cast<scalar_t>(acc[(e * nq + q_off[r] + i * G + g) * D + d]);
    }
  });
}

}  // namespace

namespace pagoda {

// q: [B, Hq, D]; k_cache, v_cache: [num_blocks, Hkv, block_size, D]; block_tables: [B, max_blocks]
// int64; seq_lens: [B] int64 (tokens to attend, the query's own included); window: a sliding
// window (each row sees its last `window` positions), 0 for none. The cache may be float32,
// bfloat16 or float16 whatever the queries' type. Returns [B, Hq, D] in the queries' type.
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                                  int64_t window, const std::optional<at::Tensor>& k_scales,
                                  const std::optional<at::Tensor>& v_scales) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.dim() == 4, "bad ranks");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "the KV cache must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong, "int64 tables");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "k and v caches differ in dtype");
  auto qc = q.contiguous();
  auto tables = block_tables.contiguous();
  auto lens = seq_lens.contiguous();
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t Hkv = k_cache.size(1), BS = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D && Hq % Hkv == 0, "head shapes do not match");
  TORCH_CHECK(window >= 0, "paged_decode_attention: bad window ", window);
  auto out = at::empty_like(qc);
  if (pagoda::is_scaled_code(k_cache.scalar_type())) {
    pagoda::check_kv_scales(k_scales, v_scales, k_cache, D);
    pagoda::dispatch_scaled_code(k_cache.scalar_type(), "paged_decode_attention", [&](auto code) {
      using code_t = decltype(code);
      PAGODA_DISPATCH_MODEL_FLOATS(q.scalar_type(), "paged_decode_attention", [&] {
        decode_attention_impl<scalar_t, code_t>(qc.data_ptr<scalar_t>(), k_cache.data_ptr<code_t>(), v_cache.data_ptr<code_t>(),
                                                tables.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), out.data_ptr<scalar_t>(),
                                                B, Hq, Hkv, D, BS, tables.size(1), static_cast<float>(scale), window,
                                                k_scales->data_ptr<float>(), v_scales->data_ptr<float>());
      });
    });
    return out;
  }
  PAGODA_DISPATCH_MODEL_FLOATS(q.scalar_type(), "paged_decode_attention", [&] {
    using q_t = scalar_t;
    PAGODA_DISPATCH_MODEL_FLOATS(k_cache.scalar_type(),
                                    "paged_decode_attention_cache", [&] {
      decode_attention_impl<q_t, scalar_t>(qc.data_ptr<q_t>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
                                           tables.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), out.data_ptr<q_t>(),
                                           B, Hq, Hkv, D, BS, tables.size(1), static_cast<float>(scale), window);
    });
  });
  return out;
}

}  // namespace pagoda

TORCH_LIBRARY(pagoda, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq_lens, float scale, int window=0, Tensor? k_scales=None, Tensor? v_scales=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagoda, CPU, m) {
  m.impl("paged_decode_attention", &pagoda::paged_decode_attention);
}
