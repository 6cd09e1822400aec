"""RMSNorm, with the residual add fused into the same call."""

from __future__ import annotations

import torch
from torch import nn

from pagoda.layers.cpu_kernels import fused_kernels


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Without residual: norm(x). With residual: (norm(x + residual), x + residual); on the
        fused float32 CPU path both are computed in place, in x's and residual's storage."""
        if residual is None:
            return self._norm(x)
        kernels = fused_kernels(x)
        if kernels is not None and self.weight.dtype == torch.float32 and residual.is_contiguous():
            kernels.fused_add_rms_norm(x, residual, self.weight, self.eps)  # in place on both
            return x, residual
        residual = x + residual
        return self._norm(residual), residual
