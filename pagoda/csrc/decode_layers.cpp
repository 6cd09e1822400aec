// A whole Llama decoder stack for a batch of decode-like rows, in one call: decode tokens, and
// under deterministic inference prefill chunks too (each token a row that attends through the
// paged kernel to the positions before it; its K/V is written to the cache first).
//
// At batch 1 a step's arithmetic takes ~10 ms here, and calling ~40 torch ops per layer from
// Python added ~5 ms more. This runs the same ops in the same order as the Python modules
// (pagoda/models/llama.py with the fused CPU ops), layer after layer, with no Python in between:
//   norm(x + residual) → qkv → rotary → KV write → paged attention → o → norm(x + residual)
//   → gate_up → silu * up → down   (the last two fused where down's weight is in tiles)
// so its outputs are those of the Python path bit for bit. Float32 on the CPU; each projection
// is either a float weight (pagoda::linear, as the Python layers call it) or ggml blocks
// (block_matmul, on the blocks' copy packed at load where there is one: tiles or bf16).
// `windows` holds each layer's sliding window (0: none; empty: none anywhere), as in Mistral.
// Rows under LoRA adapters get their deltas after each projection, through lora_add as the
// Python layers call it (layers/lora_delta.py), with the runs of every projection flattened:
// projection slot s (layer l, projection i: s = 4 l + i) owns runs [lora_slots[s], lora_slots[s + 1]).
#include <ATen/ATen.h>
#include <torch/library.h>

#include "ops.h"

#include <vector>

namespace {

constexpr int64_t WEIGHTS_PER_LAYER = 6;      // input norm, qkv, o, post-attention norm, gate_up, down
constexpr int64_t PROJECTIONS_PER_LAYER = 4;  // qkv, o, gate_up, down: their block types (-1 = float)

// As the Python layers project (layers/linear.py, CpuKernelBackend.block_matmul): a float weight
// through pagoda::linear, ggml blocks through block_matmul, each with its copy packed at load
// (layers/packed_weights.py) for its many-row route.
at::Tensor project(const at::Tensor& x, const at::Tensor& weight, int64_t block_type,
                   const std::optional<at::Tensor>& packed) {
  return block_type < 0 ? pagoda::linear(x, weight, packed) : pagoda::block_matmul(x, weight, block_type, packed);
}

// silu(gate) * up, then the down projection: on a weight repacked into tiles, fused
// (silu_mul_block_gemm_tiles quantizes the activations as it makes them, the same bits).
at::Tensor down_projection(const at::Tensor& gate_up, const at::Tensor& weight, int64_t block_type,
                           const std::optional<at::Tensor>& packed) {
  if (block_type == pagoda::SUPERBLOCK_PACKED) return pagoda::silu_mul_superblock_gemm(gate_up, weight);
  if (block_type >= 0 && pagoda::holds_tiles(packed))
    return pagoda::silu_mul_block_gemm_tiles(gate_up, *packed, block_type, weight.size(0));
  return project(pagoda::silu_and_mul(gate_up), weight, block_type, packed);
}

// The step's LoRA runs for every projection of the stack (see the file's comment); empty: none.
struct StackLoRA {
  at::TensorList as, bts;
  at::IntArrayRef slots, part_begin, out_starts, rank_starts, row_starts, row_ends;

  bool on(int64_t slot) const { return !slots.empty() && slots[slot + 1] > slots[slot]; }

  // y += the deltas of projection `slot` for x's rows under an adapter, as lora_add on that slot's runs alone
  void add(at::Tensor& y, const at::Tensor& x, int64_t slot) const {
    if (!on(slot)) return;
    const int64_t r0 = slots[slot], runs = slots[slot + 1] - r0, p0 = part_begin[r0], parts = part_begin[r0 + runs] - p0;
    std::vector<int64_t> begin(runs + 1);
    for (int64_t j = 0; j <= runs; ++j) begin[j] = part_begin[r0 + j] - p0;
    pagoda::lora_add(y, x, as.slice(r0, runs), bts.slice(p0, parts), begin, out_starts.slice(p0, parts),
                     rank_starts.slice(p0, parts), row_starts.slice(r0, runs), row_ends.slice(r0, runs));
  }
};

}  // namespace

namespace pagoda {

// hidden [T, H] (the embeddings) and residual [T, H] (zeros) are updated in place as the layers
// go; returns the last layer's MLP output. The caller applies the final norm, as in Python.
at::Tensor decode_layers(at::Tensor hidden, at::Tensor residual, const at::Tensor& positions,
                         at::TensorList weights, at::IntArrayRef block_types,
                         const c10::List<std::optional<at::Tensor>>& packed, at::TensorList k_caches,
                         at::TensorList v_caches, const at::Tensor& cos_cache, const at::Tensor& sin_cache,
                         const at::Tensor& slot_mapping, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                         int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps, double scale,
                         at::IntArrayRef windows, at::TensorList lora_as, at::TensorList lora_bts,
                         at::IntArrayRef lora_slots, at::IntArrayRef lora_part_begin, at::IntArrayRef lora_out_starts,
                         at::IntArrayRef lora_rank_starts, at::IntArrayRef lora_row_starts,
                         at::IntArrayRef lora_row_ends) {
  const int64_t L = static_cast<int64_t>(k_caches.size());
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == L * WEIGHTS_PER_LAYER, "decode_layers: expected ",
              L * WEIGHTS_PER_LAYER, " weights, got ", weights.size());
  TORCH_CHECK(static_cast<int64_t>(block_types.size()) == L * PROJECTIONS_PER_LAYER, "decode_layers: bad block_types");
  TORCH_CHECK(windows.empty() || static_cast<int64_t>(windows.size()) == L, "decode_layers: one window per layer");
  TORCH_CHECK(packed.empty() || static_cast<int64_t>(packed.size()) == L * PROJECTIONS_PER_LAYER,
              "decode_layers: packed holds one entry per projection, or none");
  TORCH_CHECK(lora_slots.empty() || static_cast<int64_t>(lora_slots.size()) == L * PROJECTIONS_PER_LAYER + 1,
              "decode_layers: lora_slots bounds every projection's runs, or is empty");
  const StackLoRA lora{lora_as,          lora_bts,         lora_slots,      lora_part_begin,
                       lora_out_starts, lora_rank_starts, lora_row_starts, lora_row_ends};
  const int64_t T = hidden.size(0), q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  at::Tensor x = hidden;
  for (int64_t l = 0; l < L; ++l) {
    const at::Tensor* w = weights.data() + l * WEIGHTS_PER_LAYER;
    const int64_t* types = block_types.data() + l * PROJECTIONS_PER_LAYER;
    // a projection's weight packed at load (layers/packed_weights.py), for the routes that take it
    const auto pack = [&](int64_t i) -> std::optional<at::Tensor> {
      return packed.empty() ? std::nullopt : packed.get(l * PROJECTIONS_PER_LAYER + i);
    };
    fused_add_rms_norm(x, residual, w[0], eps);
    at::Tensor qkv = project(x, w[1], types[0], pack(0));
    lora.add(qkv, x, l * PROJECTIONS_PER_LAYER);
    at::Tensor q = qkv.narrow(1, 0, q_size).view({T, num_heads, head_dim});
    at::Tensor k = qkv.narrow(1, q_size, kv_size).view({T, num_kv_heads, head_dim});
    const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({T, num_kv_heads, head_dim});
    rotary_embedding(q, k, positions, cos_cache, sin_cache);
    write_kv_cache(k, v, k_caches[l], v_caches[l], slot_mapping);
    const int64_t window = windows.empty() ? 0 : windows[l];
    const at::Tensor attn = paged_decode_attention(q, k_caches[l], v_caches[l], block_tables, seq_lens, scale, window);
    const at::Tensor attn_rows = attn.view({T, q_size});
    at::Tensor o = project(attn_rows, w[2], types[1], pack(1));
    lora.add(o, attn_rows, l * PROJECTIONS_PER_LAYER + 1);
    fused_add_rms_norm(o, residual, w[3], eps);
    at::Tensor gate_up = project(o, w[4], types[2], pack(2));
    lora.add(gate_up, o, l * PROJECTIONS_PER_LAYER + 2);
    if (lora.on(l * PROJECTIONS_PER_LAYER + 3)) {  // the delta needs silu(gate) * up itself: not fused
      const at::Tensor act = pagoda::silu_and_mul(gate_up);
      x = project(act, w[5], types[3], pack(3));
      lora.add(x, act, l * PROJECTIONS_PER_LAYER + 3);
    } else {
      x = down_projection(gate_up, w[5], types[3], pack(3));
    }
  }
  return x;
}

}  // namespace pagoda

TORCH_LIBRARY_FRAGMENT(pagoda, m) {
  m.def(
      "decode_layers(Tensor(a!) hidden, Tensor(b!) residual, Tensor positions, Tensor[] weights, int[] block_types, "
      "Tensor?[] packed, "
      "Tensor[] k_caches, Tensor[] v_caches, Tensor cos_cache, Tensor sin_cache, Tensor slot_mapping, "
      "Tensor block_tables, Tensor seq_lens, int num_heads, int num_kv_heads, int head_dim, float eps, "
      "float scale, int[] windows, Tensor[] lora_as, Tensor[] lora_bts, int[] lora_slots, int[] lora_part_begin, "
      "int[] lora_out_starts, int[] lora_rank_starts, int[] lora_row_starts, int[] lora_row_ends) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagoda, CPU, m) { m.impl("decode_layers", &pagoda::decode_layers); }
// with float32 weights packed by oneDNN (Mkldnn tensors) in `packed`
TORCH_LIBRARY_IMPL(pagoda, MkldnnCPU, m) { m.impl("decode_layers", &pagoda::decode_layers); }
