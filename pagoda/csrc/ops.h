// The kernels' entry points, shared by the files that register them and by decode_layers.cpp,
// which chains them for a whole decoder stack.
#pragma once

#include <ATen/ATen.h>

#include <optional>

namespace pagoda {

at::Tensor linear(const at::Tensor& x, const at::Tensor& weight,  // small_matmul.cpp
                  const std::optional<at::Tensor>& packed = std::nullopt);
bool batch_invariant();  // small_matmul.cpp: deterministic inference asked (see set_batch_invariant)
bool set_batch_invariant(bool enabled);
at::Tensor block_matmul(const at::Tensor& x, const at::Tensor& weight, int64_t type);
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

}  // namespace pagoda
