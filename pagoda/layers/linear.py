"""Float matmuls of the CPU fast path: a bias-free fp32 projection goes through
``torch.ops.pagoda.linear`` (csrc/small_matmul.cpp), a register-tiled GEMM whose row results do
not depend on how many rows share the call. It serves up to 32 rows (MKL's sgemm took twice as
long at 2-8 rows as at 1), and every M under deterministic inference (``cpu_kernels.batch_invariant``);
otherwise larger M goes to ``at::linear``. The Python layers and the one-call decoder stack both
multiply through it, so they agree exactly."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.layers.cpu_kernels import fused_kernels


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, weight)`` without bias."""
    kernels = fused_kernels(x) if x.dim() == 2 and weight.dtype == torch.float32 else None
    if kernels is not None and weight.is_contiguous():
        return kernels.linear(x, weight)
    return F.linear(x, weight)


def project(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``layer(x)``, a bias-free ``nn.Linear`` through ``linear``."""
    if type(layer) is nn.Linear and layer.bias is None:
        return linear(x, layer.weight)
    return layer(x)
