"""Pooling: a prompt's hidden states → one vector (the pooling runner's last step, worker/
pooling_runner.py). MEAN averages every token of the prompt, CLS takes the first, LAST the last;
then a request's ``dimensions`` keep the first n values, and the vector is scaled to unit length
where the model (or the request's ``normalize``) says so. sentence-transformers computes the
same: its Pooling module's mean over the attention mask, then its Normalize module."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagoda.pooling_params import PoolingParams


def pool(hidden: torch.Tensor, offsets, counts, pooling_type: str) -> torch.Tensor:
    """[tokens, hidden] of a step's prompts laid end to end (prompt i: ``counts[i]`` rows from
    ``offsets[i]``) → [prompts, hidden]."""
    offsets = torch.as_tensor(offsets, dtype=torch.long, device=hidden.device)
    counts = torch.as_tensor(counts, dtype=torch.long, device=hidden.device)
    if pooling_type == "CLS":
        return hidden[offsets]
    if pooling_type == "LAST":
        return hidden[offsets + counts - 1]
    if pooling_type == "MEAN":
        owner = torch.repeat_interleave(torch.arange(len(counts), device=hidden.device), counts)
        sums = hidden.new_zeros(len(counts), hidden.shape[1]).index_add_(0, owner, hidden)
        return sums / counts.unsqueeze(1).to(hidden.dtype)
    raise ValueError(f"unknown pooling type {pooling_type!r}")


def finish_vectors(vectors: torch.Tensor, params: list[PoolingParams], normalize: bool) -> list[torch.Tensor]:
    """Each request's vector as it is handed out (float32, on the CPU): cut to its ``dimensions``,
    then normalized unless its ``normalize`` (or, unset, the model's ``normalize``) says not."""
    vectors = vectors.float().cpu()
    out = []
    for vector, p in zip(vectors, params):
        if p.dimensions is not None:
            vector = vector[: p.dimensions]
        if normalize if p.normalize is None else p.normalize:
            vector = F.normalize(vector, p=2, dim=-1)
        out.append(vector.clone())  # its own storage: a row of the batch would pickle the whole batch
    return out
