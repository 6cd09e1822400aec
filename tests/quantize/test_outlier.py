"""The seed's failure mode: one input channel with huge activations, which round to nearest breaks.

Built deliberately, as such channels appear in real LLMs: channel 5's inputs are 100x the
others' and its weights 10x smaller, so it carries a large share of the layer's output while its
weights are tiny next to the rest of their block of 32. Rounding to nearest then snaps those
weights to the block's coarse grid and most of that share of the output is lost. Errors are the
layer's output error over the calibration inputs, relative to the output.

- AWQ scales the channel's weights up (and its inputs down), so they get a fine share of the
  grid: the error stays at the level of a layer without an outlier.
- GPTQ can only move an error onto channels that carry the same signal. Where the outlier is
  largely predictable from other channels (as massive activations are in LLMs), it compensates
  most of the error; where the outlier is independent of everything else it cannot (asserted
  too, so the docs' statement of that limit stays true).
"""

from __future__ import annotations

import gguf
import pytest
import torch

from pagoda.quantize import awq
from pagoda.quantize.gptq import gptq
from pagoda.quantize.rtn import rtn_blocks

N_TOKENS, IN, OUT, CHANNEL, FACTOR = 1024, 128, 64, 5, 100.0


def _layer(predictable: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs [tokens, IN], weight [OUT, IN]) with channel 5 the outlier."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N_TOKENS, IN, generator=g)
    w = torch.randn(OUT, IN, generator=g) * 0.02
    if predictable:  # mostly the sum of three other channels, plus a little of its own
        x[:, CHANNEL] = 0.9 * x[:, 40:43].sum(dim=1) / 3**0.5 + 0.1 * x[:, CHANNEL]
    x[:, CHANNEL] *= FACTOR
    w[:, CHANNEL] /= FACTOR**0.5
    return x, w


def _relative_error(x: torch.Tensor, w: torch.Tensor, approx: torch.Tensor) -> float:
    return float(((x @ (w - approx).T) ** 2).sum() / ((x @ w.T) ** 2).sum())


def _errors(x: torch.Tensor, w: torch.Tensor, qtype: str) -> dict[str, float]:
    hessian = x.T @ x / len(x)
    rtn = gguf.quants.dequantize(rtn_blocks(w, qtype), gguf.GGMLQuantizationType[qtype])
    s = awq.search_scales(w, hessian, x.abs().mean(dim=0), qtype)
    awq_approx = awq.quantize(w * s, hessian / torch.outer(s, s), qtype).dequantize() / s
    return {"rtn": _relative_error(x, w, torch.from_numpy(rtn.copy())),
            "awq": _relative_error(x, w, awq_approx),
            "gptq": _relative_error(x, w, gptq(w, hessian, qtype).dequantize())}


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1"])
def test_round_to_nearest_breaks_and_awq_keeps_an_outlier_channel(qtype):
    x, w = _layer(predictable=False)
    errors = _errors(x, w, qtype)
    g = torch.Generator().manual_seed(1)
    no_outlier = _errors(torch.randn(N_TOKENS, IN, generator=g), torch.randn(OUT, IN, generator=g) * 0.02, qtype)
    assert errors["rtn"] > 0.15  # a sixth of the output's energy or more is lost
    assert errors["rtn"] > 20 * no_outlier["rtn"]
    assert errors["awq"] < 0.01 and errors["awq"] < 1.5 * no_outlier["rtn"]  # as if there were no outlier
    assert errors["awq"] < errors["rtn"] / 20
    assert errors["gptq"] > errors["rtn"] / 2  # independent outlier: nothing to compensate with


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1"])
def test_gptq_compensates_a_predictable_outlier_channel(qtype):
    x, w = _layer(predictable=True)
    errors = _errors(x, w, qtype)
    assert errors["rtn"] > 0.15
    assert errors["gptq"] < errors["rtn"] / 4
    assert errors["awq"] < errors["rtn"] / 20
