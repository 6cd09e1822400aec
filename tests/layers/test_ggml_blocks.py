"""ggml blocks (Q4_0, Q4_1, Q8_0) and the block_matmul kernel: the formats byte for byte against the
gguf library, the kernel against its own arithmetic, and the pure-torch fallback."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from pagoda.layers import ggml_blocks
from pagoda.layers.backend import select_backend
from pagoda.layers.cpu_kernels import load_cpu_kernels
from pagoda.layers.ggml_blocks import BlockLinear, dequantize_blocks

GGML = {ggml_blocks.Q4_0: GGMLQuantizationType.Q4_0, ggml_blocks.Q4_1: GGMLQuantizationType.Q4_1,
        ggml_blocks.Q8_0: GGMLQuantizationType.Q8_0}


def _weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed))


def _blocks(w: torch.Tensor, block_type: int) -> torch.Tensor:
    """Blocks from the gguf library's own quantizer (so the kernel reads what llama.cpp writes)."""
    data = quants.quantize(w.numpy(), GGML[block_type])
    return torch.from_numpy(np.ascontiguousarray(data)).view(torch.uint8).reshape(w.shape[0], -1)


def _int8_activations(x: torch.Tensor) -> torch.Tensor:
    """x as the kernel sees it: int8 per block of 32, scale amax / 127."""
    g = x.reshape(x.shape[0], -1, 32)
    d = g.abs().amax(dim=-1, keepdim=True) / 127
    q = torch.round(g / torch.where(d > 0, d, torch.ones_like(d)))
    return (q * d).reshape(x.shape)


@pytest.mark.parametrize("block_type", sorted(GGML))
def test_dequantize_matches_the_gguf_library(block_type):
    w = _weight(48, 96)
    blocks = _blocks(w, block_type)
    want = torch.from_numpy(quants.dequantize(blocks.numpy(), GGML[block_type]).reshape(48, 96))
    assert torch.equal(dequantize_blocks(blocks, block_type), want)


@pytest.mark.parametrize("block_type", [ggml_blocks.Q4_1, ggml_blocks.Q8_0])
def test_our_quantizers_write_ggml_blocks(block_type):
    w = _weight(40, 64, seed=1)
    layer = BlockLinear.from_float(w, block_type)
    decoded = torch.from_numpy(quants.dequantize(layer.blocks.numpy(), GGML[block_type]).reshape(40, 64))
    assert torch.equal(layer.dequantize(), decoded)  # the gguf library reads our bytes as we do
    steps = 15 if block_type == ggml_blocks.Q4_1 else 254
    span = w.reshape(40, 2, 32)
    step = (span.amax(-1) - span.amin(-1) if block_type == ggml_blocks.Q4_1 else 2 * span.abs().amax(-1)) / steps
    err = (layer.dequantize() - w).abs().reshape(40, 2, 32)
    assert (err <= step[..., None] * 0.5 + 2e-3 * span.abs().amax(-1, keepdim=True)).all()  # half a step (+ fp16 scales)


def test_q4_0_as_q4_1_is_the_same_weight():
    blocks = _blocks(_weight(16, 64, seed=2), ggml_blocks.Q4_0)
    assert torch.equal(dequantize_blocks(ggml_blocks.q4_0_to_q4_1(blocks), ggml_blocks.Q4_1),
                       dequantize_blocks(blocks, ggml_blocks.Q4_0))


@pytest.mark.skipif(load_cpu_kernels() is None, reason="pagoda's C++ kernels cannot be built here")
@pytest.mark.parametrize("block_type", sorted(GGML))
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 9, 64, 200])
def test_kernel_computes_int8_block_dot_products(block_type, m):
    """Below the kernel's GEMM threshold (and at every M under batch invariance) the integer
    kernel; from it, the library GEMM on the same int8-rounded activations (in bf16 where the
    build has AVX512-BF16 / AMX: then the weight, the activations and the result are rounded to
    bf16, so it is compared with that rounding's exact product)."""
    n, k = 80, 96
    blocks = _blocks(_weight(n, k), block_type)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    x[0, :32] = 0.0  # an all-zero block: scale 0, no division by it
    ops = load_cpu_kernels()
    got = ops.block_matmul(x, blocks, block_type)
    weight = dequantize_blocks(blocks, block_type)
    min_rows, dtype = ops.block_matmul_gemm()
    if m >= min_rows and dtype == "bf16":
        want = (_int8_activations(x).bfloat16().double() @ weight.bfloat16().double().T).float()
        torch.testing.assert_close(got, want, rtol=2**-8, atol=1e-4)  # + the result's own bf16 rounding
        with select_backend("cpu").batch_invariant(True):
            got_int = ops.block_matmul(x, blocks, block_type)
    else:
        got_int = got
    torch.testing.assert_close(got_int, _int8_activations(x) @ weight.T, rtol=1e-5, atol=1e-4)
    # against the float product: off only by the activations' int8 rounding (and bf16's)
    exact = x @ weight.T
    assert ((got - exact).norm() / exact.norm()).item() < 0.02


def test_fallback_without_kernels_is_the_float_product(torch_kernels_only):
    blocks = _blocks(_weight(24, 64), ggml_blocks.Q4_1)
    x = torch.randn(3, 64)
    backend = select_backend("cpu")
    assert not backend.has_cpu_kernels
    torch.testing.assert_close(backend.block_matmul(x, blocks, ggml_blocks.Q4_1),
                               x @ dequantize_blocks(blocks, ggml_blocks.Q4_1).T)


def test_block_linear_shapes_and_errors():
    w = _weight(24, 64)
    layer = BlockLinear.from_float(w, ggml_blocks.Q8_0, bias=torch.ones(24))
    y = layer(torch.randn(2, 5, 64))
    assert y.shape == (2, 5, 24) and y.dtype == torch.float32
    with pytest.raises(ValueError, match="multiple of 32"):
        BlockLinear.from_float(_weight(8, 48), ggml_blocks.Q4_1)
    with pytest.raises(ValueError, match="Q4_1 rows of 64 inputs take 40 bytes, got 36"):
        BlockLinear(torch.zeros(8, 36, dtype=torch.uint8), ggml_blocks.Q4_1, 64)
    with pytest.raises(ValueError, match="quantizing float weights to Q4_0 is not supported"):
        BlockLinear.from_float(w, ggml_blocks.Q4_0)
    if load_cpu_kernels() is not None:
        with pytest.raises(RuntimeError, match="unsupported block type 7"):
            load_cpu_kernels().block_matmul(torch.randn(1, 64), torch.zeros(8, 40, dtype=torch.uint8), 7)
