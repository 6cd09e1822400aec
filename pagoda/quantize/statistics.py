"""Activation statistics of a projection's input, recorded while its layer runs.

layerwise.py runs each decoder layer over the calibration tokens with its projections
(``qkv_proj``, ``o_proj``, ``gate_up_proj``, ``down_proj``) wrapped in a ``RecordingLinear``,
which computes the same output and adds its input rows to an ``InputStatistics``:

- ``hessian``: the sum of ``x xᵀ`` over tokens. For a weight change ``ΔW`` the summed
  squared output error over the calibration tokens is ``Σ_rows Δw H Δwᵀ``, so one matrix gives
  both GPTQ's Hessian and the exact output error AWQ's searches minimize.
- ``abs_sum``: the sum of ``|x|`` per input channel (AWQ's activation salience).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import nn

from pagoda.layers.linear import project
from pagoda.layers.quantization import QUANTIZED_LINEARS


@dataclass
class InputStatistics:
    """What the calibration tokens looked like at one projection's input ([K] channels)."""

    channels: int
    tokens: int = 0
    hessian: torch.Tensor = field(init=False)
    abs_sum: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        self.hessian = torch.zeros(self.channels, self.channels)
        self.abs_sum = torch.zeros(self.channels)

    def add(self, x: torch.Tensor) -> None:
        """Add input rows ``x`` [..., K] (summed in fp32: a few hundred thousand tokens lose
        nothing that matters to the searches, and fp64 doubled the recording's cost)."""
        rows = x.detach().reshape(-1, self.channels).float()
        self.hessian.addmm_(rows.T, rows)
        self.abs_sum += rows.abs().sum(dim=0)
        self.tokens += rows.shape[0]

    def mean_hessian(self) -> torch.Tensor:
        """``E[x xᵀ]`` in float32 (the scale does not change any argmin; it keeps numbers moderate)."""
        return self.hessian / max(self.tokens, 1)

    def mean_abs(self) -> torch.Tensor:
        return self.abs_sum / max(self.tokens, 1)


class RecordingLinear(nn.Module):
    """A projection that records its inputs: the wrapped layer's output, unchanged."""

    def __init__(self, inner: nn.Module, stats: InputStatistics, backend) -> None:
        super().__init__()
        self.inner, self.stats, self.backend = inner, stats, backend

    @property
    def weight(self) -> torch.Tensor:
        return self.inner.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.stats.add(x)
        return project(self.inner, x, self.backend)


def projection_owners(model: nn.Module) -> Iterable[tuple[str, nn.Module, str]]:
    """(layer-qualified name, parent module, attribute) of every projection in the decoder layers."""
    for i, layer in enumerate(model.layers):
        for parent_name in ("self_attn", "mlp"):
            parent = getattr(layer, parent_name)
            for attr in QUANTIZED_LINEARS:
                if isinstance(getattr(parent, attr, None), nn.Linear):
                    yield f"layers.{i}.{parent_name}.{attr}", parent, attr
