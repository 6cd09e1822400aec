// The kernels' entry points, shared by the files that register them and by decode_layers.cpp,
// which chains them for a whole decoder stack.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <optional>
#include <vector>

namespace pagoda {

at::Tensor linear(const at::Tensor& x, const at::Tensor& weight,  // small_matmul.cpp
                  const std::optional<at::Tensor>& packed = std::nullopt);
at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& packed);  // small_matmul.cpp
bool batch_invariant();  // small_matmul.cpp: deterministic inference asked (see set_batch_invariant)
bool set_batch_invariant(bool enabled);
at::Tensor block_matmul(const at::Tensor& x, const at::Tensor& weight, int64_t type,  // block_matmul.cpp
                        const std::optional<at::Tensor>& packed = std::nullopt);
at::Tensor block_gemm_tiles(const at::Tensor& x, const at::Tensor& tiles, int64_t type,  // block_gemm_tiles.cpp
                           int64_t out_features);
// Whether a block weight's copy packed at load is the tile GEMM's (uint8, block_repack_tiles),
// the route block_matmul takes at every row count (the other copy is oneDNN's bf16 / fp32).
inline bool holds_tiles(const std::optional<at::Tensor>& packed) {
  return packed.has_value() && packed->defined() && packed->scalar_type() == at::kByte;
}
// Weights in ggml's super-block formats (Q4_K ... IQ4_XS) packed at load (superblock_tiles.cpp):
// block_matmul's type SUPERBLOCK_PACKED, the packed tensor standing for the weight.
constexpr int64_t SUPERBLOCK_PACKED = 1000;
at::Tensor superblock_gemm(const at::Tensor& x, const at::Tensor& packed);
at::Tensor silu_mul_superblock_gemm(const at::Tensor& gate_up, const at::Tensor& packed);
// F16 / BF16 weights packed at load (half_weights.cpp): block_matmul's type HALF_PACKED.
constexpr int64_t HALF_PACKED = 1001;
at::Tensor half_gemm_packed(const at::Tensor& x, const at::Tensor& packed);
at::Tensor silu_mul_block_gemm_tiles(const at::Tensor& gate_up, const at::Tensor& tiles, int64_t type,
                                     int64_t out_features);  // block_gemm_tiles.cpp
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                                  int64_t window = 0, const std::optional<at::Tensor>& k_scales = std::nullopt,
                                  const std::optional<at::Tensor>& v_scales = std::nullopt);
void fused_add_rms_norm(at::Tensor x, at::Tensor residual, const at::Tensor& weight, double eps);
void rotary_embedding(at::Tensor q, at::Tensor k, const at::Tensor& positions, const at::Tensor& cos_cache,
                      const at::Tensor& sin_cache);
at::Tensor silu_and_mul(const at::Tensor& x);
void write_kv_cache(const at::Tensor& k, const at::Tensor& v, at::Tensor k_cache, at::Tensor v_cache,
                    const at::Tensor& slot_mapping, const std::optional<at::Tensor>& k_scales = std::nullopt,
                    const std::optional<at::Tensor>& v_scales = std::nullopt);

// oneDNN caches one primitive (~0.6 MiB of generated code and descriptors, measured) for every
// row count it has multiplied a weight shape by, up to 1,024 of them: a server whose batches take
// every size from 16 to 2,048 rows grew by hundreds of MiB. So the library GEMMs see few row
// counts: rows go in tiles of LIBRARY_TILE_ROWS, the last one padded with zero rows up to a
// multiple of LIBRARY_ROW_STEP (at most 16 row counts per weight shape); rows are independent,
// so the padding changes no result. `gemm` maps a tile [rows, K] to its product [rows, N].
constexpr int64_t LIBRARY_TILE_ROWS = 256;
constexpr int64_t LIBRARY_ROW_STEP = 16;

template <typename Gemm>
at::Tensor in_row_tiles(const at::Tensor& x, const Gemm& gemm) {
  const int64_t M = x.size(0);
  std::vector<at::Tensor> parts;
  for (int64_t m = 0; m < M; m += LIBRARY_TILE_ROWS) {
    const int64_t rows = std::min(LIBRARY_TILE_ROWS, M - m);
    const int64_t padded = (rows + LIBRARY_ROW_STEP - 1) / LIBRARY_ROW_STEP * LIBRARY_ROW_STEP;
    at::Tensor tile = x.narrow(0, m, rows);
    if (padded != rows) tile = at::constant_pad_nd(tile, {0, 0, 0, padded - rows});
    at::Tensor y = gemm(tile.contiguous());
    parts.push_back(padded != rows ? y.narrow(0, 0, rows) : y);
  }
  return parts.size() == 1 ? parts[0].contiguous() : at::cat(parts);
}

void lora_add(at::Tensor y, const at::Tensor& x, at::TensorList as, at::TensorList bts,  // lora_delta.cpp
              at::IntArrayRef part_begin, at::IntArrayRef out_starts, at::IntArrayRef rank_starts,
              at::IntArrayRef row_starts, at::IntArrayRef row_ends);

}  // namespace pagoda
