"""Paged attention over block tables, for mixed prefill + decode batches (torch SDPA on CPU/CUDA)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.forward_context import AttentionMetadata, get_attention_metadata
from pagoda.layers.backend import current_backend, read_blocks


class PagedAttention(nn.Module):
    """Writes this step's K/V into the paged cache and attends each query over its sequence.

    The cache of one layer is a pair of tensors [num_blocks, num_kv_heads, block_size, head_dim],
    bound once by the model runner (`bind_kv_cache`). Nothing is padded to the longest prompt:
    prefill chunks run one SDPA call each; decodes run one batched SDPA call over their gathered
    blocks with a length mask.

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

    @torch.compiler.disable  # reads per-step metadata and loops in Python: stays eager under --compile
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
        gqa = self.num_heads != self.num_kv_heads
        qh = q.transpose(0, 1).unsqueeze(0)  # [1, Hq, Lq, D]
        window = self.sliding_window
        if seq.start == 0 and (window is None or seq.query_len <= window):
            # Nothing cached before this chunk, and every query sees all keys before it: plain causal.
            out = F.scaled_dot_product_attention(
                qh, k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0),
                is_causal=True, scale=self.scale, enable_gqa=gqa,
            )
        elif seq.start == 0:
            # Nothing cached, but the chunk is longer than the window: a banded causal mask.
            pos = torch.arange(seq.query_len, device=q.device)
            mask = _visible(pos.unsqueeze(1), pos.unsqueeze(0), window)
            out = F.scaled_dot_product_attention(qh, k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0),
                                                 attn_mask=mask, scale=self.scale, enable_gqa=gqa)
        else:
            total = seq.start + seq.query_len
            bs = self.k_cache.shape[2]
            # Blocks wholly before the first query's window are not gathered.
            first = 0 if window is None else max(0, seq.start - window + 1) // bs
            table = seq.block_table[first : -(-total // bs)]
            begin = first * bs
            keys = read_blocks(self.k_cache, self.k_scales, table, q.dtype)[:, : total - begin].unsqueeze(0)
            values = read_blocks(self.v_cache, self.v_scales, table, q.dtype)[:, : total - begin].unsqueeze(0)
            q_pos = torch.arange(seq.start, total, device=q.device).unsqueeze(1)
            mask = _visible(q_pos, torch.arange(begin, total, device=q.device).unsqueeze(0), window)  # [Lq, keys]
            out = F.scaled_dot_product_attention(qh, keys, values, attn_mask=mask, scale=self.scale, enable_gqa=gqa)
        return out.squeeze(0).transpose(0, 1)


def _visible(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """Which keys each query sees: causal, and within the sliding window when there is one."""
    mask = k_pos <= q_pos
    if window is not None:
        mask &= k_pos > q_pos - window
    return mask
