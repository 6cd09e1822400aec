"""Paged attention over block tables, for mixed prefill + decode batches (torch SDPA on CPU/CUDA)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.forward_context import AttentionMetadata, get_attention_metadata
from pagoda.layers.backend import current_backend, gather_blocks


class PagedAttention(nn.Module):
    """Writes this step's K/V into the paged cache and attends each query over its sequence.

    The cache of one layer is a pair of tensors [num_blocks, num_kv_heads, block_size, head_dim],
    bound once by the model runner (`bind_kv_cache`). Nothing is padded to the longest prompt:
    prefill chunks run one SDPA call each; decodes run one batched SDPA call over their gathered
    blocks with a length mask.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        self.backend = current_backend()

    def bind_kv_cache(self, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        self.k_cache, self.v_cache = k_cache, v_cache

    @torch.compiler.disable  # reads per-step metadata and loops in Python: stays eager under --compile
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [T, Hq, D], k/v: [T, Hkv, D] for the T tokens of the batch → [T, Hq * D]."""
        meta = get_attention_metadata()
        self._write_cache(k, v, meta)
        out = torch.empty_like(q)
        if meta.num_decodes:
            out[: meta.num_decodes] = self._decode(q[: meta.num_decodes], meta)
        for seq in meta.prefills:
            sl = slice(seq.token_start, seq.token_start + seq.query_len)
            out[sl] = self._prefill(q[sl], k[sl], v[sl], seq)
        return out.view(q.shape[0], self.num_heads * self.head_dim)

    def _write_cache(self, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> None:
        self.backend.write_kv(k, v, self.k_cache, self.v_cache, meta)

    def _decode(self, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.backend.decode_attention(q, self.k_cache, self.v_cache, meta, self.scale)

    def _prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq) -> torch.Tensor:
        gqa = self.num_heads != self.num_kv_heads
        qh = q.transpose(0, 1).unsqueeze(0)  # [1, Hq, Lq, D]
        if seq.start == 0:
            # Nothing cached before this chunk: attend over the fresh K/V, plain causal.
            out = F.scaled_dot_product_attention(
                qh, k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0),
                is_causal=True, scale=self.scale, enable_gqa=gqa,
            )
        else:
            total = seq.start + seq.query_len
            keys = gather_blocks(self.k_cache, seq.block_table)[:, :total].unsqueeze(0)
            values = gather_blocks(self.v_cache, seq.block_table)[:, :total].unsqueeze(0)
            q_pos = torch.arange(seq.start, total, device=q.device).unsqueeze(1)
            mask = torch.arange(total, device=q.device).unsqueeze(0) <= q_pos  # [Lq, total]
            out = F.scaled_dot_product_attention(qh, keys, values, attn_mask=mask, scale=self.scale, enable_gqa=gqa)
        return out.squeeze(0).transpose(0, 1)
