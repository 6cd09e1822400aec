// How the tile GEMMs (block_gemm_tiles.cpp, superblock_tiles.cpp) share their work among threads.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace pagoda {

constexpr int64_t RUNS_PER_THREAD = 8;  // runs of tile groups a row block is cut into, per thread

// work(group, m0, m1) for every tile group of `groups` against every block of `row_block` of the
// M activation rows. The items (a row block x a run of groups) go to whichever thread is free, in
// order (both threads on one row block, each on its own groups): on a shared machine a thread may
// lose its core for milliseconds, and the other then takes its share instead of waiting for it at
// the end, as ggml's mul_mat hands out its chunks. Which rows go together never changes a row's result.
template <typename Work>
void for_work_items(int64_t M, int64_t row_block, int64_t groups, const Work& work) {
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), groups));
  const int64_t run = std::max<int64_t>(1, groups / (threads * RUNS_PER_THREAD));
  const int64_t runs = (groups + run - 1) / run, items = (M + row_block - 1) / row_block * runs;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t item = next++; item < items; item = next++) {
      const int64_t m0 = item / runs * row_block, m1 = std::min(M, m0 + row_block);
      const int64_t g0 = item % runs * run, g1 = std::min(groups, g0 + run);
      for (int64_t g = g0; g < g1; ++g) work(g, m0, m1);
    }
  });
}

}  // namespace pagoda
