// Software prefetch of the tile GEMMs' weight streams (superblock_kernels.h, block_gemm_tiles.cpp).
//
// At a few activation rows (a stream's decode) the weights stream from memory once per step, and
// the arithmetic between the loads leaves too few of them in flight for the hardware prefetcher to
// keep up: each tile the kernel reads is a stream of its own, and each starts cold. Asking L2 for
// the bytes PREFETCH_AHEAD on made a 1B Q4_K_M's projections 0-14 % faster at one row on the
// AVX-512 EPYC, depending on the hour (benchmarks/README.md, "Prefetching the tiles"); 1 to 4 KB
// measured alike. The AVX2 paths gained nothing and do not prefetch.
#pragma once

#include <cstdint>

namespace pagoda {

constexpr int64_t PREFETCH_AHEAD = 2048;

// Asks L2 (not L1: the kernels' own loads bring the lines the last step) for `bytes` from p on. A
// prefetch never faults, so p may run past the end of a weight.
inline void prefetch_l2(const uint8_t* p, int64_t bytes) {
  for (int64_t at = 0; at < bytes; at += 64) __builtin_prefetch(p + at, 0, 2);
}

// Where to prefetch, as an offset from a stream's start, for byte `at` of the stream (already
// PREFETCH_AHEAD on): within its `length` bytes, there; past them, as far into the same stream of
// the next group, `next` bytes on (the one this thread reads next).
inline int64_t stream_ahead(int64_t at, int64_t length, int64_t next) { return at < length ? at : at - length + next; }

}  // namespace pagoda
