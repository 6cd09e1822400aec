"""GPTQ (Frantar et al., 2022): second-order error compensation, on ggml's block grid.

Columns (input channels) are quantized one at a time, left to right. Each column's rounding
error is spread over the columns not yet quantized, weighted by the inverse Hessian of the
calibration inputs (``H = E[x xᵀ]``, statistics.py), which is the update that minimizes the
layer's output error given the columns already fixed. As in the reference implementation:

- ``H`` is damped by 1 % of its mean diagonal (``damp``) so the Cholesky factorization holds;
  channels the calibration never activated (zero diagonal) get weight 0;
- the inverse Hessian's upper Cholesky factor gives each step's update; columns go in lazy
  batches of 128 (the error of a batch reaches the later columns in one matrix product);
- groups are ggml's blocks of 32 consecutive columns: when a block begins, its ``d`` (and ``m``)
  are chosen from the block's weights *as updated so far* (grid.block_params, fp16-rounded as the
  file stores them), and every column of the block is rounded on that grid.

``act_order=True`` quantizes columns in order of decreasing ``H`` diagonal (the most active
inputs first). The blocks are still ggml's 32 consecutive columns, so their parameters are then
fixed up front from the original weights ("static groups", as AutoGPTQ does when act-order meets
groups). On the test layers that lost more than the updated block parameters gained
(tests/quantize/test_outlier.py), so it is off by default.
"""

from __future__ import annotations

import torch

from pagoda.quantize import grid
from pagoda.quantize.grid import BLOCK, Quantized

DAMP = 0.01
LAZY_BATCH = 128


def inverse_hessian_factor(hessian: torch.Tensor, damp: float = DAMP) -> tuple[torch.Tensor, torch.Tensor]:
    """(upper Cholesky factor of ``(H + λI)⁻¹``, mask of dead channels), in float64 for stability."""
    h = hessian.double().clone()
    dead = torch.diag(h) == 0
    h[dead, dead] = 1.0
    h += torch.eye(h.shape[0], dtype=h.dtype) * (damp * torch.diag(h).mean())
    lower = torch.linalg.cholesky(h)
    inverse = torch.cholesky_inverse(lower)
    return torch.linalg.cholesky(inverse, upper=True), dead


def gptq(weight: torch.Tensor, hessian: torch.Tensor, qtype: str, damp: float = DAMP, act_order: bool = False
         ) -> Quantized:
    """``weight`` [N, K] quantized to ``qtype`` blocks with GPTQ's error compensation."""
    grid.check_shape(weight)
    n, k = weight.shape
    order = torch.argsort(torch.diag(hessian), descending=True, stable=True) if act_order else torch.arange(k)
    factor, dead = inverse_hessian_factor(hessian[order][:, order], damp)
    factor = factor.float()
    w = weight.detach().float()[:, order].clone()
    w[:, dead] = 0.0
    lo, hi = grid.code_range(qtype)
    codes = torch.zeros(n, k)
    if act_order:  # static groups: every block's grid from the original weights
        d, m = grid.block_params(weight.detach().float(), qtype)
    else:
        d = torch.zeros(n, k // BLOCK)
        m = None if qtype != "Q4_1" else torch.zeros(n, k // BLOCK)
    for start in range(0, k, LAZY_BATCH):
        stop = min(start + LAZY_BATCH, k)
        block = w[:, start:stop].clone()
        errors = torch.zeros_like(block)
        inv = factor[start:stop, start:stop]
        for i in range(stop - start):
            col = int(order[start + i])
            g = col // BLOCK
            if not act_order and col % BLOCK == 0:  # a block begins: its grid from the weights as updated so far
                d_g, m_g = grid.block_params(block[:, i : i + BLOCK], qtype)
                d[:, g] = d_g[:, 0]
                if m is not None:
                    m[:, g] = m_g[:, 0]
            shift = 0.0 if m is None else m[:, g]
            scale = d[:, g]
            inv_scale = torch.where(scale != 0, 1.0 / scale, torch.zeros_like(scale))
            q = torch.round((block[:, i] - shift) * inv_scale).clamp_(lo, hi)
            codes[:, col] = q
            err = (block[:, i] - (scale * q + shift)) / inv[i, i]
            block[:, i:] -= err[:, None] * inv[i, i:][None, :]
            errors[:, i] = err
        w[:, stop:] -= errors @ factor[start:stop, stop:]
    return Quantized(qtype, codes, d, m)
