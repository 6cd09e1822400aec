"""Activation-aware weight quantization (AWQ; Lin et al., 2023), on ggml's block grid.

Input channels that carry large activations matter more: a rounding error in their weights is
multiplied by a large input. AWQ scales such a channel's weights up by ``s`` (so they get a finer
share of their block's grid) and its inputs down by ``s``; the product is unchanged in exact
arithmetic and the division is folded into whatever produced the input, so it costs nothing at
run time:

- q/k/v (one merged weight): the input RMSNorm's weight is divided by ``s``;
- gate/up: the norm before the MLP (Gemma 3: its pre-feedforward norm);
- o: the v rows (and v bias) are divided by ``s``. With grouped-query attention one v channel
  feeds every query head of its group, so ``s`` is shared across those heads;
- down: the up rows are divided by ``s`` (``act(gate) * up`` is linear in up).

Per layer group, ``s = mean|x| ** α`` (normalized), with α from a grid of 20 in [0, 1) chosen to
minimize the error, as the paper measures it: for q/k/v, on the output of the whole attention
block (softmax and o_proj included) and for gate/up on the output of the whole MLP, both run on
the first 4,096 or so calibration tokens (quantizer.AWQ_SEARCH_CHUNKS); for o and down, on the projection's
own output, measured exactly over all calibration tokens through the input's second moment
``H`` (statistics.py): ``Σ_rows Δw H Δwᵀ``. α = 0 is plain rounding, so the search never does
worse than it on that measure. Then, as AWQ does, each block's range is clipped (ratios 1.0 …
0.55) where that lowers the block's output error (not for the q and k rows, whose errors the
attention softmax amplifies). What is kept is the block grid's own codes and fp16 parameters
(grid.py), so the file holds exactly what was searched.

The statistics are taken layer by layer (layerwise.py), with the earlier layers quantized.
Departures from the paper: the next layer's inputs are this layer's *quantized* outputs (the
reference passes the scaled float outputs on; GPTQ's reference passes the quantized ones, and
pagoda does that for both methods); under grouped-query attention o's scales are shared by the
query heads that read one v channel (the reference skips o there); the grid is ggml's Q4_0 /
Q4_1 / Q8_0 blocks of 32 rather than the paper's groups of 128 with a zero point.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pagoda.quantize import grid
from pagoda.quantize.grid import Quantized

SCALE_GRID = 20
CLIP_RATIOS = tuple(1.0 - i / 20 for i in range(10))  # 1.0 … 0.55, AWQ's max_shrink 0.5 grid


def normalized_scales(mean_abs: torch.Tensor, alpha: float) -> torch.Tensor:
    """AWQ's ``s = x ** α / sqrt(max · min)``: centred so the scales neither grow nor shrink the weight overall."""
    s = mean_abs.clamp(min=1e-4) ** alpha
    return s / (s.max() * s.min()).sqrt()


def search_scales(weight: torch.Tensor, hessian: torch.Tensor, mean_abs: torch.Tensor, qtype: str,
                  tie: torch.Tensor | None = None, block_error: Callable[[torch.Tensor], float] | None = None
                  ) -> torch.Tensor:
    """The per-input-channel scales [K] for ``weight`` [N, K] that minimize the output error.

    ``tie`` [K] maps each channel to a shared scale index (grouped-query o_proj); ``mean_abs`` is
    then averaged within each group. ``block_error``, when given, measures a candidate (the
    weight as quantized with those scales, in the original units) on the output of the whole
    block the projection is in; otherwise the projection's own output error through ``hessian``."""
    if tie is not None:
        groups = int(tie.max()) + 1
        shared = torch.zeros(groups).index_add_(0, tie, mean_abs) / torch.bincount(tie, minlength=groups).float()
        mean_abs = shared[tie]
    best_s, best_err = torch.ones_like(mean_abs), None
    for i in range(SCALE_GRID):
        s = normalized_scales(mean_abs, i / SCALE_GRID)
        approx = grid.quantize(weight * s, qtype).dequantize() / s
        err = block_error(approx) if block_error is not None else grid.output_error(weight - approx, hessian)
        if best_err is None or err < best_err:
            best_s, best_err = s, err
    return best_s


def _block_hessians(hessian: torch.Tensor) -> torch.Tensor:
    """The 32 x 32 diagonal blocks of ``hessian`` [K, K] → [K / 32, 32, 32]."""
    nb = hessian.shape[0] // grid.BLOCK
    h = hessian.reshape(nb, grid.BLOCK, nb, grid.BLOCK)
    return h[torch.arange(nb), :, torch.arange(nb), :]


def search_clip(weight: torch.Tensor, hessian: torch.Tensor, qtype: str, skip_rows: int = 0) -> torch.Tensor:
    """Per block [N, K / 32], the clip ratio with the least output error of that block (its
    inputs' 32 x 32 part of ``hessian``). The first ``skip_rows`` rows (q and k) keep 1.0."""
    n, k = weight.shape
    hb = _block_hessians(hessian)
    best = torch.ones(n, k // grid.BLOCK)
    if skip_rows >= n:
        return best
    w = weight[skip_rows:]
    blocks = w.reshape(n - skip_rows, k // grid.BLOCK, grid.BLOCK)
    best_err = torch.full_like(best[skip_rows:], float("inf"))
    for ratio in CLIP_RATIOS:
        delta = blocks - grid.quantize(w, qtype, ratio).dequantize().reshape_as(blocks)
        err = torch.einsum("nbi,bij,nbj->nb", delta, hb, delta)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best[skip_rows:] = torch.where(better, torch.full_like(err, ratio), best[skip_rows:])
    return best


def quantize(weight: torch.Tensor, hessian: torch.Tensor, qtype: str, skip_clip_rows: int = 0) -> Quantized:
    """Quantize an already scaled weight with the clipping search (``hessian``: of its scaled inputs)."""
    return grid.quantize(weight, qtype, search_clip(weight, hessian, qtype, skip_clip_rows))
