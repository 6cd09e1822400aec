"""Scores of an embedding model, vLLM's way: the cosine similarity of two texts' vectors. Shared
by ``LLM.score`` and the server's `/v1/score` and `/v1/rerank`, so the pairing rules are one."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F


def score_pairs(text_1: str | Sequence[str], text_2: str | Sequence[str]) -> list[tuple[str, str]]:
    """The (first, second) pairs to score, as vLLM pairs them: one text against each of a list
    (1 to N), or two lists of the same length element by element (N to N)."""
    first = [text_1] if isinstance(text_1, str) else list(text_1)
    second = [text_2] if isinstance(text_2, str) else list(text_2)
    if not first:
        raise ValueError("text_1 is empty: give at least one text")
    if not second:
        raise ValueError("text_2 is empty: give at least one text")
    if len(first) == 1:
        return [(first[0], t) for t in second]
    if len(first) != len(second):
        raise ValueError(f"text_1 has {len(first)} texts and text_2 {len(second)}: give one text_1, or as many "
                         "as text_2")
    return list(zip(first, second))


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    """The cosine similarity of two vectors (whether or not they were normalized)."""
    return float(F.cosine_similarity(a.float().unsqueeze(0), b.float().unsqueeze(0)).item())
