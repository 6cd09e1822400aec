"""A Llama-family decoder stack as one C++ call (pagoda/csrc/decode_layers.cpp) for batches of
decode-like rows on the CPU in float32: decode tokens, short chunks over a cached prefix, and
under deterministic inference every prefill chunk too (each token a row of the paged kernel).

The call runs the same ops in the same order as the Python modules, so outputs do not change;
what goes away is the Python between them (~40 torch calls per layer, ~5 ms of a 18 ms batch-1
step with SmolLM2; ~10 ms of a ~90 ms batch-64 gguf step). Projections whose weights were packed
once at load (layers/packed_weights.py: float32 weights' oneDNN copies, ggml blocks' tiles or bf16
copies) pass those copies in, so the stack takes their routes as the Python layers do. Sliding windows (Mistral) pass to the paged kernel per layer. Models the op
does not cover (q/k norms, projection biases, other activations, other dtypes or devices,
torch.compile; Gemma 3 as a whole) and batches with prefill chunks take the Python layers.
"""

from __future__ import annotations

import torch
from torch import nn

from pagoda.forward_context import AttentionMetadata
from pagoda.layers.ggml_blocks import BlockLinear
from pagoda.layers.packed_weights import packed_of
from pagoda.layers.half_weights import HalfLinear
from pagoda.layers.superblocks import SuperBlockLinear

_FLOAT = -1  # block type of a float projection
_CACHE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # the ops widen a narrower cache as they read it


def _projection(module: nn.Module) -> tuple[torch.Tensor, int, torch.Tensor | None] | None:
    """(weight or blocks, block type, the weight's copy packed at load or None)."""
    if isinstance(module, (BlockLinear, SuperBlockLinear, HalfLinear)) and module.bias is None:
        return module.blocks, module.block_type, module.packed
    if type(module) is nn.Linear and module.bias is None and module.weight.dtype == torch.float32:
        return module.weight, _FLOAT, packed_of(module)
    return None


class DecodeStack:
    def __init__(self, ops, weights: list[torch.Tensor], block_types: list[int], k_caches: list[torch.Tensor],
                 v_caches: list[torch.Tensor], rotary, cfg, packed: list[torch.Tensor | None] | None = None) -> None:
        self.ops = ops  # torch.ops.pagoda
        self.weights, self.block_types = weights, block_types
        # projections' copies packed at load (float weights' oneDNN ones, blocks' tiles or bf16 ones),
        # one entry per projection ([] when there are none)
        self.packed = packed if packed and any(p is not None for p in packed) else []
        self.k_caches, self.v_caches = k_caches, v_caches
        self.rotary, self.cfg = rotary, cfg

    @classmethod
    def build(cls, model: nn.Module, ops) -> DecodeStack | None:
        """The stack for ``model``'s layers as they are now, or None where the op does not apply.
        Called by the C++ backend (layers/backend.py), which passes its ops."""
        cfg = model.config
        if cfg.qk_norm or cfg.hidden_act not in ("silu", "swish") or not model.layers:
            return None
        weights, types, packed, k_caches, v_caches = [], [], [], [], []
        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            projections = [_projection(m) for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
            norms = [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
            cache = attn.attn.k_cache
            if attn.attn.kv_group:  # several KV cache groups: the op takes one block table for every layer
                return None
            if None in projections or cache is None or cache.dtype not in _CACHE_DTYPES or cache.device.type != "cpu" \
                    or any(n.dtype != torch.float32 for n in norms):
                return None
            (qkv, t0, p0), (o, t1, p1), (gate_up, t2, p2), (down, t3, p3) = projections
            weights += [norms[0], qkv, o, norms[1], gate_up, down]
            types += [t0, t1, t2, t3]
            packed += [p0, p1, p2, p3]
            k_caches.append(cache)
            v_caches.append(attn.attn.v_cache)
        rotary = model.layers[0].self_attn.rotary
        if rotary.cos_cache.dtype != torch.float32:
            return None
        return cls(ops, weights, types, k_caches, v_caches, rotary, cfg, packed)

    def applies(self, hidden: torch.Tensor, meta: AttentionMetadata) -> bool:
        """A batch of decode rows only (the caller keeps torch.compile away from the stack)."""
        return not meta.prefills and meta.num_decodes == hidden.shape[0] and hidden.dtype == torch.float32

    def __call__(self, hidden: torch.Tensor, residual: torch.Tensor, positions: torch.Tensor,
                 meta: AttentionMetadata) -> torch.Tensor:
        cfg = self.cfg
        return self.ops.decode_layers(
            hidden, residual, positions, self.weights, self.block_types, self.packed, self.k_caches, self.v_caches,
            self.rotary.cos_cache, self.rotary.sin_cache, meta.slot_mapping, meta.decode_block_tables,
            meta.decode_seq_lens, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps,
            cfg.head_dim ** -0.5, [w or 0 for w in cfg.sliding_windows],
        )
