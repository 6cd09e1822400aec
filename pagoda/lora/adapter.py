"""An adapter as pagoda holds it once read, whatever its files were: its low-rank pairs by the
module they adapt, each with its scale."""

from __future__ import annotations

from dataclasses import dataclass

import torch


class AdapterError(ValueError):
    """An adapter pagoda cannot serve on this model; the message says why."""


@dataclass(frozen=True)
class LoRAPair:
    a: torch.Tensor  # [r, in_features]
    b: torch.Tensor  # [out_features, r]
    scale: float


@dataclass(frozen=True)
class PeftAdapter:
    path: str
    rank: int  # the largest rank of any pair
    pairs: dict[str, LoRAPair]  # module path without "model." ("layers.3.self_attn.q_proj") → its pair
