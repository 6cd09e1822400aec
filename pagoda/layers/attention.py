"""Paged attention over block tables, for mixed prefill + decode batches (the backend's kernels: C++ on CPU, SDPA)."""

from __future__ import annotations

import torch
from torch import nn

from pagoda.forward_context import AttentionMetadata, get_attention_metadata
from pagoda.layers.backend import current_backend
from pagoda.layers.image_attention import image_prefill_attention


class PagedAttention(nn.Module):
    """Writes this step's K/V into the paged cache and attends each query over its sequence.

    The cache of one layer is a pair of tensors [num_blocks, num_kv_heads, block_size, head_dim],
    bound once by the model runner (`bind_kv_cache`). Nothing is padded to the longest prompt:
    decode-like rows run one batched call (the C++ paged kernel, or SDPA over their gathered
    blocks with a length mask), and each longer prefill chunk one call of its own (the C++
    flash-style kernel reading the blocks in place, or SDPA); see the backend.

    ``sliding_window`` (Gemma 3's local layers, Mistral): a query at position p sees only keys at
    positions p - sliding_window + 1 .. p, as transformers masks them (``kv > q - window``). Every
    path applies it: the paged kernel (it never reads blocks wholly before a row's window), the
    gathered-SDPA decode fallback's mask, and both prefill paths (which gather only the blocks
    from the chunk's first window on).
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 sliding_window: int | None = None) -> None:
        super().__init__()
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be positive, got {sliding_window}")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        self.k_scales: torch.Tensor | None = None  # an int8 cache's per-(token, head) scales
        self.v_scales: torch.Tensor | None = None
        self.kv_group = 0  # whose block tables this layer reads (core/kv_cache_groups.py)
        self.backend = current_backend()

    def bind_kv_cache(self, k_cache: torch.Tensor, v_cache: torch.Tensor, kv_group: int = 0,
                      k_scales: torch.Tensor | None = None, v_scales: torch.Tensor | None = None) -> None:
        self.k_cache, self.v_cache, self.kv_group = k_cache, v_cache, kv_group
        self.k_scales, self.v_scales = k_scales, v_scales

    # Stays eager under --compile (it reads per-step metadata and loops in Python): worker/compiled.py
    # wraps it in torch.compiler.disable before tracing. Not a decorator here: that imports
    # torch._dynamo (and triton), ~1.5 s of every process's start, for servers that never compile.
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [T, Hq, D], k/v: [T, Hkv, D] for the T tokens of the batch → [T, Hq * D]."""
        meta = get_attention_metadata().for_group(self.kv_group)
        self._write_cache(k, v, meta)
        out = torch.empty_like(q)
        if meta.num_decodes:
            out[: meta.num_decodes] = self._decode(q[: meta.num_decodes], meta)
        for seq in meta.prefills:
            sl = slice(seq.token_start, seq.token_start + seq.query_len)
            out[sl] = self._prefill(q[sl], k[sl], v[sl], seq)
        return out.view(q.shape[0], self.num_heads * self.head_dim)

    def _write_cache(self, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> None:
        self.backend.write_kv(k, v, self.k_cache, self.v_cache, meta, self.k_scales, self.v_scales)

    def _decode(self, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.backend.decode_attention(q, self.k_cache, self.v_cache, meta, self.scale, self.sliding_window,
                                             self.k_scales, self.v_scales)

    def _prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq) -> torch.Tensor:
        if seq.image_spans:
            return image_prefill_attention(q, self.k_cache, self.v_cache, seq, self.scale, self.sliding_window,
                                           self.k_scales, self.v_scales)
        return self.backend.prefill_attention(q, k, v, self.k_cache, self.v_cache, seq, self.scale,
                                              self.sliding_window, self.k_scales, self.v_scales)
