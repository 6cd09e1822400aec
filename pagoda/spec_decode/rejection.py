"""Verifying a proposer's drafts against the target's distribution by rejection (speculative
sampling), for a draft that is one token, not a distribution (prompt lookup, greedy drafts)."""

from __future__ import annotations

import torch


def accept_by_rejection(probs: torch.Tensor, drafts: list[int], generator: torch.Generator | None) -> list[int]:
    """Speculative sampling (Leviathan et al., Chen et al.) for a draft that is one token, not a
    distribution (prompt lookup): draft d is accepted with probability p(d), the target's; on
    rejection the token comes from p without d, renormalized, which is max(0, p - q) for q the
    point mass on d. The tokens so produced follow the target's distribution exactly. After the
    last accepted draft, one token is drawn from the target's next distribution. ``probs``:
    [len(drafts) + 1, vocab]."""
    tokens: list[int] = []
    for j, draft in enumerate(drafts):
        p = probs[j]
        if torch.rand((), generator=generator) * p.sum() < p[draft]:
            tokens.append(draft)
            continue
        residual = p.clone()
        residual[draft] = 0.0
        return tokens + [_draw(residual, generator)]
    return tokens + [_draw(probs[len(drafts)], generator)]


def _draw(weights: torch.Tensor, generator: torch.Generator | None) -> int:
    """A token with probability proportional to ``weights`` (the sampler's exponential trick)."""
    q = torch.empty_like(weights).exponential_(generator=generator)
    return int((weights / q).argmax())
