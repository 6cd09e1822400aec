"""RMSNorm, with the residual add fused into the same call."""

from __future__ import annotations

import torch
from torch import nn

from pagoda.layers.backend import current_backend, rms_norm


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.backend = current_backend()

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Without residual: norm(x). With residual: (norm(x + residual), x + residual); the C++
        backend computes both in place, in x's and residual's storage."""
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return self.backend.add_rms_norm(x, residual, self.weight, self.eps)
