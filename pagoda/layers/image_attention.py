"""Prefill attention for a chunk holding images whose tokens attend to each other both ways
(Gemma 3: transformers' ``token_type_ids`` mask, OR(causal, same image) and, on a local layer,
AND the sliding window). The scheduler computes an image's run in one step
(``multimodal.inputs.fit_to_images``), so every key such a query sees is in the cache by now:
the chunk's own K/V were written before attention. One SDPA call over the sequence's keys with
the mask; chunks without images take the backend's paths."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagoda.forward_context import PrefillSeq
from pagoda.layers.backend import read_blocks


def image_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, spans: tuple[tuple[int, int], ...],
               window: int | None) -> torch.Tensor:
    """bool [queries, keys]: causal, or both in one image's span; within ``window`` if any."""
    q, k = q_pos.unsqueeze(1), k_pos.unsqueeze(0)
    mask = k <= q
    for lo, hi in spans:
        mask |= (q >= lo) & (q < hi) & (k >= lo) & (k < hi)
    if window is not None:
        mask &= k > q - window
    return mask


def image_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seq: PrefillSeq,
                            scale: float, window: int | None = None, k_scales: torch.Tensor | None = None,
                            v_scales: torch.Tensor | None = None) -> torch.Tensor:
    """q: [Lq, Hq, D] of the chunk ``seq`` → [Lq, Hq, D]."""
    total = seq.start + seq.query_len
    bs = k_cache.shape[2]
    table = seq.block_table[: -(-total // bs)]
    keys = read_blocks(k_cache, k_scales, table, q.dtype)[:, :total].unsqueeze(0)
    values = read_blocks(v_cache, v_scales, table, q.dtype)[:, :total].unsqueeze(0)
    q_pos = torch.arange(seq.start, total, device=q.device)
    mask = image_mask(q_pos, torch.arange(total, device=q.device), seq.image_spans, window)
    out = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), keys, values, attn_mask=mask, scale=scale,
                                         enable_gqa=q.shape[1] != keys.shape[1])
    return out.squeeze(0).transpose(0, 1)
