"""The quantizers' arithmetic on small matrices, against reference arithmetic written out here.

- What a file stores is what the optimizer chose: grid.pack's bytes, read back by the `gguf`
  package's own dequantizer (llama.cpp's reference), equal the values AWQ / GPTQ measured.
- ``output_error`` is the summed squared output error over the calibration inputs.
- GPTQ equals the textbook algorithm (one column at a time, explicit inverse-Hessian updates in
  float64) and GPTQ from its definition (each step's compensation solved afresh as a
  least-squares problem over the input channels not yet fixed), and never does worse than
  rounding to nearest on the calibration activations.
- AWQ's scale and clipping searches never do worse than plain rounding, which they include, on
  a projection's own output or on a whole block's.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from pagoda.quantize import awq, grid
from pagoda.quantize.gptq import DAMP, gptq
from pagoda.quantize.rtn import rtn_blocks

QTYPES = ["Q4_0", "Q4_1", "Q8_0"]


def _activations(n: int, k: int, seed: int = 0) -> torch.Tensor:
    """Correlated inputs [n, k], as a layer's inputs are."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.eye(k) + torch.randn(k, k, generator=g) / k**0.5
    return torch.randn(n, k, generator=g) @ mix


def _weight(n: int, k: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05


def _read_back(q: grid.Quantized) -> torch.Tensor:
    """The weights a GGUF reader gets from ``q``'s bytes."""
    raw = grid.pack(q).numpy()
    return torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[q.qtype]).copy())


def _rtn(weight: torch.Tensor, qtype: str) -> torch.Tensor:
    """llama.cpp's round to nearest of ``weight``, dequantized."""
    raw = rtn_blocks(weight, qtype)
    return torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype]).copy())


@pytest.mark.parametrize("qtype", QTYPES)
def test_stored_blocks_dequantize_to_what_the_optimizer_chose(qtype):
    w = _weight(16, 96)
    x = _activations(256, 96)
    hessian = x.T @ x / len(x)
    clip = torch.rand(16, 3, generator=torch.Generator().manual_seed(2)) * 0.5 + 0.5
    chosen = [grid.quantize(w, qtype), grid.quantize(w, qtype, clip), gptq(w, hessian, qtype),
              gptq(w, hessian, qtype, act_order=True), awq.quantize(w, hessian, qtype)]
    for q in chosen:
        lo, hi = grid.code_range(qtype)
        assert q.codes.min() >= lo and q.codes.max() <= hi
        assert torch.equal(q.codes, q.codes.round())
        assert torch.equal(_read_back(q), q.dequantize())  # bit for bit


def test_grid_rounding_is_llama_cpps_up_to_ties():
    """grid.quantize picks llama.cpp's block parameters (rounded to fp16 before the codes are
    chosen, so that the codes fit the stored scale); on random weights the two agree almost
    everywhere and never by more than one step."""
    w = _weight(64, 256)
    for qtype in QTYPES:
        ours, ref = grid.quantize(w, qtype).dequantize(), _rtn(w, qtype)
        step = grid.block_params(w, qtype)[0].abs().repeat_interleave(32, dim=1)
        assert ((ours - ref).abs() <= step * 1.001).all()
        assert (ours == ref).float().mean() > 0.99


def test_output_error_is_the_summed_squared_output_error():
    x = _activations(128, 64).double()
    w, approx = _weight(8, 64).double(), _weight(8, 64, seed=3).double()
    direct = ((x @ w.T - x @ approx.T) ** 2).sum()
    assert torch.allclose(grid.output_error(w - approx, x.T @ x), direct, rtol=1e-10)


def _textbook_gptq(w: torch.Tensor, hessian: torch.Tensor, qtype: str) -> torch.Tensor:
    """GPTQ as the paper states it (float64): for each column in order, round it on its block's
    grid (chosen when the block begins, from the weights as updated so far), then move the rest
    of the row by the error times the inverse Hessian's row, and drop that column from the
    inverse (its Schur complement)."""
    w = w.double().clone()
    h = hessian.double().clone()
    h += torch.eye(len(h), dtype=h.dtype) * DAMP * torch.diag(h).mean()
    hinv = torch.linalg.inv(h)
    out = torch.zeros_like(w)
    lo, hi = grid.code_range(qtype)
    for col in range(w.shape[1]):
        if col % 32 == 0:
            d, m = grid.block_params(w[:, col : col + 32].float(), qtype)
            d, m = d[:, 0].double(), (torch.zeros_like(d[:, 0]) if m is None else m[:, 0]).double()
        q = torch.round((w[:, col] - m) / d).clamp(lo, hi) * d + m
        out[:, col] = q
        err = (w[:, col] - q) / hinv[col, col]
        w[:, col:] -= err[:, None] * hinv[col, col:][None, :]
        hinv = hinv - hinv[:, col : col + 1] @ hinv[col : col + 1, :] / hinv[col, col]
    return out.float()


@pytest.mark.parametrize("qtype", QTYPES)
def test_gptq_equals_the_textbook_algorithm(qtype, monkeypatch):
    from pagoda.quantize import gptq as gptq_module

    monkeypatch.setattr(gptq_module, "LAZY_BATCH", 64)  # so that 96 columns take two lazy batches
    w = _weight(8, 96)
    x = _activations(300, 96)
    hessian = x.T @ x / len(x)
    ours = gptq(w, hessian, qtype, act_order=False).dequantize()
    ref = _textbook_gptq(w, hessian, qtype)
    # float32 vs float64 may round a rare tie the other way; everything else is the same value
    assert (ours == ref).float().mean() > 0.99
    rel = lambda a: float(grid.output_error(w - a, hessian) / grid.output_error(w, hessian))
    assert rel(ours) == pytest.approx(rel(ref), rel=0.02)


def _least_squares_gptq(w: torch.Tensor, hessian: torch.Tensor, qtype: str) -> torch.Tensor:
    """GPTQ from its definition, with no inverse-Hessian bookkeeping (float64): round input
    channel (column) j on its block's grid, then give every later column the float values that
    minimize the output error ``δ H δᵀ`` with columns 0 … j fixed at their codes, solved afresh
    as a least-squares problem: ``δ_F = -H_FF⁻¹ H_FC δ_C`` (F the free columns, C the fixed)."""
    w0 = w.double()
    h = hessian.double() + torch.eye(len(hessian), dtype=torch.float64) * DAMP * torch.diag(hessian).mean()
    current, out = w0.clone(), torch.zeros_like(w0)
    lo, hi = grid.code_range(qtype)
    for col in range(w.shape[1]):
        if col % 32 == 0:
            d, m = grid.block_params(current[:, col : col + 32].float(), qtype)
            d, m = d[:, 0].double(), (torch.zeros_like(d[:, 0]) if m is None else m[:, 0]).double()
        out[:, col] = torch.round((current[:, col] - m) / d).clamp(lo, hi) * d + m
        fixed, free = slice(0, col + 1), slice(col + 1, None)
        delta_fixed = w0[:, fixed] - out[:, fixed]
        delta_free = -torch.linalg.solve(h[free, free], h[free, fixed] @ delta_fixed.T).T
        current[:, free] = w0[:, free] - delta_free
    return out.float()


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1"])
def test_gptq_equals_least_squares_compensation(qtype):
    """The update runs along the right axis (input channels) with the right inverse: each step's
    compensation is the least-squares optimum given the columns already fixed."""
    w = _weight(6, 64, seed=3)
    x = _activations(200, 64, seed=4)
    hessian = x.T @ x / len(x)
    ours = gptq(w, hessian, qtype).dequantize()
    ref = _least_squares_gptq(w, hessian, qtype)
    assert (ours == ref).float().mean() > 0.99
    rel = lambda a: float(grid.output_error(w - a, hessian) / grid.output_error(w, hessian))
    assert rel(ours) == pytest.approx(rel(ref), rel=0.02)
    assert rel(ours) < 0.7 * rel(_rtn(w, qtype))


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("act_order", [True, False])
def test_gptq_error_is_at_most_round_to_nearest(qtype, act_order):
    w = _weight(32, 256)
    x = _activations(1024, 256)
    hessian = x.T @ x / len(x)
    gptq_err = grid.output_error(w - gptq(w, hessian, qtype, act_order=act_order).dequantize(), hessian)
    rtn_err = grid.output_error(w - _rtn(w, qtype), hessian)
    assert gptq_err < 0.8 * rtn_err


@pytest.mark.parametrize("qtype", QTYPES)
def test_awq_searches_never_do_worse_than_plain_rounding(qtype):
    w = _weight(32, 128)
    x = _activations(512, 128)
    x[:, 7] *= 20  # one salient channel
    hessian = x.T @ x / len(x)
    s = awq.search_scales(w, hessian, x.abs().mean(0), qtype)
    scaled_h = hessian / torch.outer(s, s)
    err = grid.output_error(w * s - grid.quantize(w * s, qtype).dequantize(), scaled_h)
    plain = grid.output_error(w - grid.quantize(w, qtype).dequantize(), hessian)
    assert err <= plain
    assert s.shape == (128,) and s[7] == s.max()  # the salient channel is scaled up most
    clipped = grid.output_error(w * s - awq.quantize(w * s, scaled_h, qtype).dequantize(), scaled_h)
    assert clipped <= err * 1.0001  # the block-local clip search includes ratio 1


def test_awq_scale_search_on_a_block_output():
    """With ``block_error`` the search judges a candidate on the block's output (here a SwiGLU
    MLP, as for gate/up): it never does worse there than plain rounding (α = 0), and given the
    projection's own output error it is the plain search."""
    gate_up, down = _weight(64, 128, seed=5), _weight(128, 32, seed=6)
    x = _activations(256, 128)
    x[:, 3] *= 20
    hessian = x.T @ x / len(x)
    mlp = lambda w: (torch.nn.functional.silu(x @ w[:32].T) * (x @ w[32:].T)) @ down.T
    block_error = lambda approx: float(((mlp(approx) - mlp(gate_up)) ** 2).sum())
    s = awq.search_scales(gate_up, hessian, x.abs().mean(0), "Q4_0", block_error=block_error)
    plain = grid.quantize(gate_up, "Q4_0").dequantize()
    assert block_error(grid.quantize(gate_up * s, "Q4_0").dequantize() / s) <= block_error(plain)
    assert s[3] == s.max()
    own = lambda approx: float(grid.output_error(gate_up - approx, hessian))
    assert torch.equal(awq.search_scales(gate_up, hessian, x.abs().mean(0), "Q4_0", block_error=own),
                       awq.search_scales(gate_up, hessian, x.abs().mean(0), "Q4_0"))


def test_awq_scales_shared_across_query_heads():
    """o_proj under grouped-query attention: channels that one v channel feeds share one scale."""
    x = _activations(256, 128)
    hessian = x.T @ x / len(x)
    tie = torch.arange(128) % 64  # two query heads of 64 channels read the same v head
    s = awq.search_scales(_weight(16, 128), hessian, x.abs().mean(0), "Q4_0", tie)
    assert torch.equal(s[:64], s[64:])


def test_bad_shapes_and_types_are_refused():
    with pytest.raises(ValueError, match="multiple of 32"):
        gptq(torch.zeros(4, 40), torch.eye(40), "Q4_0")
    with pytest.raises(ValueError, match="unknown block type"):
        grid.quantize(torch.zeros(4, 32), "Q5_K")
    with pytest.raises(ValueError, match="no zero point"):
        grid.qtype_for_bits(8, zero_point=True)
    with pytest.raises(ValueError, match="4 or 8"):
        grid.qtype_for_bits(3)
    assert np.dtype(np.uint8) == grid.pack(grid.quantize(torch.ones(2, 32), "Q4_0")).numpy().dtype
