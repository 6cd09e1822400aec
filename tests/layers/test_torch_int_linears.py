"""The int8 / int4 layers on torch's kernels (pagoda/layers/torch_int_linears.py) against float math
on the weight they hold: codes within half a step, exact int4 groups, the shapes the packing
refuses, and bf16 as the default activation dtype."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagoda.layers import torch_int_linears
from pagoda.layers.torch_int_linears import Int4Linear, Int8Linear


def _weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def test_int8_codes_and_scales():
    w = _weight(96, 64)
    layer = Int8Linear.from_float(w)
    assert layer.qweight.dtype == torch.int8 and layer.scales.dtype == torch.bfloat16
    # Each weight within half a step of its row's scale (the scale rounded to bf16 first).
    step = layer.scales.float()[:, None]
    assert ((layer.dequantize() - w).abs() <= step / 2 + 1e-7).all()


@pytest.mark.parametrize("cls", [Int8Linear, Int4Linear])
def test_forward_matches_float_math_on_its_weight(cls):
    w, bias = _weight(96, 64), torch.randn(96) * 0.1
    x = torch.randn(2, 5, 64)  # any leading shape
    exact = cls.from_float(w, bias, compute_dtype=torch.float32)
    want = F.linear(x, exact.dequantize(), bias)
    assert exact(x).shape == (2, 5, 96)
    torch.testing.assert_close(exact(x), want, rtol=1e-5, atol=1e-5)
    fast = cls.from_float(w, bias)  # bf16 activations: the kernels' fast path
    y = fast(x)
    assert y.dtype == torch.float32
    assert _rel(y, F.linear(x, fast.dequantize(), bias)) < 1e-2


def test_int4_groups_and_error():
    w = _weight(64, 96)
    layer = Int4Linear.from_float(w, compute_dtype=torch.float32)
    assert layer.qweight.dtype == torch.uint8 and layer.qweight.shape == (64, 48)
    assert layer.scales_and_zeros.shape == (96 // 32, 64, 2)
    # Within half a step of its group's scale.
    scale = layer.scales_and_zeros[..., 0].T.repeat_interleave(32, dim=1)
    assert ((layer.dequantize() - w).abs() <= scale / 2 + 1e-6).all()
    assert _rel(layer.dequantize(), w) < 0.1


def test_int4_from_groups_is_exact():
    g = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 16, (32, 64), generator=g)
    scale = torch.rand(32, 2, generator=g).half().float()
    zero = (torch.randn(32, 2, generator=g) * 0.1).half().float()
    layer = Int4Linear.from_groups(codes, scale, zero, compute_dtype=torch.float32)
    want = ((codes.float() - 8).reshape(32, 2, 32) * scale[..., None] + zero[..., None]).reshape(32, 64)
    assert torch.equal(layer.dequantize(), want)


def test_int4_rejects_shapes_it_cannot_pack():
    assert not Int4Linear.supports(24, 64) and not Int4Linear.supports(32, 48)
    with pytest.raises(ValueError, match="out_features % 16"):
        Int4Linear.from_groups(torch.zeros(24, 64), torch.ones(24, 2), torch.zeros(24, 2))




def test_default_compute_dtype_is_bf16():
    assert torch_int_linears.COMPUTE_DTYPE == torch.bfloat16
