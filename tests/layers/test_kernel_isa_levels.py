"""block_matmul's and the tile GEMM's instruction-set paths: the build for each ISA level
(PAGODA_KERNEL_ISA) takes the path it names, and every path gives the native build's bits and the
reference arithmetic.

The fallback levels (avx512-vnni where the native build has AMX, avx-vnni, avx2, scalar) are built from block_matmul.cpp, block_gemm_tiles.cpp and
superblock_tiles.cpp (which it calls), small_matmul.cpp
(its batch-invariance switch), fused_ops.cpp (silu_and_mul, against which the down projection's
fused activation quantization is checked) and prefill_attention.cpp (the flash-style prefill kernel) alone, each in a subprocess, since two builds register the same
ops and cannot share a process. Each build is cached under $PAGODA_HOME/kernels/<cpu>-<level>-...;
the first run compiles them (20-45 s a level on a loaded 2-core machine: ~65 s for the file), later
runs load them (~3 s a level: ~10 s for the file). On a CPU whose native build takes the avx2 paths
(no AVX-512, no AVX-VNNI) the avx2 level is that build under other -march flags and is skipped."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants
from superblock_data import TYPE_IDS, kernel_cases

from pagoda.layers import cpu_kernels, ggml_blocks
from pagoda.layers.backend import select_backend
from pagoda.layers.cpu_kernels import ISA_LEVELS, load_cpu_kernels
from pagoda.layers.ggml_blocks import dequantize_blocks
from pagoda.platform import cpu_flags


REPO = Path(__file__).resolve().parents[2]
GGML = {ggml_blocks.Q4_0: GGMLQuantizationType.Q4_0, ggml_blocks.Q4_1: GGMLQuantizationType.Q4_1,
        ggml_blocks.Q8_0: GGMLQuantizationType.Q8_0}
ROWS = (1, 2, 3, 4, 5, 9, 33)  # every tile size (1-4 rows) and ragged ends
N, K = 37, 96  # an odd number of weight rows: the AVX-512 path's last row goes alone

needs_kernels = pytest.mark.skipif(load_cpu_kernels() is None, reason="pagoda's C++ kernels cannot be built here")

# In a fallback build, the integer kernel at every M (batch invariance on: no library GEMM route).
_CHILD = """
import sys, torch
from pagoda.layers.cpu_kernels import build_kernels
level, cases, superblock_cases, out = sys.argv[1:]
def half_outputs(ops):  # F16 / BF16 weights (half_weights.cpp) at 1 to 5 rows
    g = torch.Generator().manual_seed(5)
    w, x = torch.randn(37, 96, generator=g), torch.randn(5, 96, generator=g)
    return [ops.half_gemm(x[:m], ops.half_repack(w.to(d).view(torch.int16), t), 37)
            for t, d in ((1, torch.float16), (30, torch.bfloat16)) for m in (1, 4, 5)]
ops = build_kernels(level, ("block_matmul.cpp", "block_gemm_tiles.cpp", "superblock_tiles.cpp", "half_weights.cpp",
                           "small_matmul.cpp",
                           "fused_ops.cpp", "prefill_attention.cpp"))
from gguf import GGMLQuantizationType
ops.set_batch_invariant(True)
superblock = [ops.superblock_gemm(x, ops.superblock_repack([b], [int(GGMLQuantizationType[t])], x.shape[1]), b.shape[0])
              for t, x, b in torch.load(superblock_cases)]
cases = torch.load(cases)
outputs = [ops.block_matmul(x, w, t) for t, x, w in cases]
tiles = [ops.block_gemm_tiles(x, ops.block_repack_tiles(w, t, x.shape[1]), t, w.shape[0]) for t, x, w in cases]
def down(t, x, w):  # the MLP's down projection on gate_up = [x, x reversed]: fused, and in two ops
    gate_up, packed = torch.cat([x, x.flip(1)], 1), ops.block_repack_tiles(w, t, x.shape[1])
    return (ops.silu_mul_block_gemm_tiles(gate_up, packed, t, w.shape[0]),
            ops.block_gemm_tiles(ops.silu_and_mul(gate_up), packed, t, w.shape[0]))
g = torch.Generator().manual_seed(0)  # a prefill chunk of 70 over 100 cached positions, fp16 cache
attn = {"q": torch.randn(70, 9, 64, generator=g), "k": torch.randn(12, 3, 16, 64, generator=g).half(),
        "v": torch.randn(12, 3, 16, 64, generator=g).half(), "table": torch.randperm(12, generator=g)}
attn["out"] = [ops.paged_prefill_attention(attn["q"], attn["k"], attn["v"], attn["table"], 100, 0.125, w)
               for w in (0, 40)]
torch.save({"isa": ops.block_matmul_isa(), "outputs": outputs, "tiles_isa": ops.block_gemm_tiles_isa(), "tiles": tiles,
            "down": [down(t, x, w) for t, x, w in cases], "attn": attn, "superblock": superblock,
            "superblock_isa": ops.superblock_isa(), "half": half_outputs(ops)}, out)
"""


def _runs_here(level: str) -> bool:
    return all(flag in cpu_flags() for flag in ISA_LEVELS[level][1])


def _expected_native_isa() -> str:
    flags = cpu_flags()
    if {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"} <= flags:
        return "avx512-vnni"
    if {"avx2", "fma", "avx_vnni"} <= flags:
        return "avx-vnni"
    return "avx2" if {"avx2", "fma"} <= flags else "scalar"


def _int8_reference(x: torch.Tensor, blocks: torch.Tensor, block_type: int) -> torch.Tensor:
    """The kernel's arithmetic in float64: x rounded to int8 per block of 32 (scale amax / 127),
    times the exact weights."""
    g = x.double().reshape(x.shape[0], -1, 32)
    d = (x.reshape(x.shape[0], -1, 32).abs().amax(dim=-1, keepdim=True) / 127).double()
    q = torch.round(g / torch.where(d > 0, d, torch.ones_like(d)))
    return ((q * d).reshape(x.shape) @ dequantize_blocks(blocks, block_type).double().T).float()


def _cases() -> list[tuple[int, torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(13)
    cases = []
    for block_type in sorted(GGML):
        w = torch.randn(N, K, generator=g)
        blocks = torch.from_numpy(np.ascontiguousarray(quants.quantize(w.numpy(), GGML[block_type])))
        blocks = blocks.view(torch.uint8).reshape(N, -1).clone()
        if block_type == ggml_blocks.Q8_0:  # code -128 (ggml never writes it; a file may): |q| = 128 unsigned
            blocks.view(N, -1, 34)[::3, :, 2 + 5] = 0x80
        for m in ROWS:
            x = torch.randn(m, K, generator=g) * torch.rand(m, 1, generator=g) * 4
            x[0, 32:64] = 0.0  # an all-zero activation block: scale 0
            cases.append((block_type, x, blocks))
    return cases


@pytest.fixture(scope="module")
def cases(tmp_path_factory) -> tuple[Path, list]:
    path = tmp_path_factory.mktemp("isa") / "cases.pt"
    data = _cases()
    torch.save(data, path)
    return path, data


def _expected_superblock_isa() -> str:
    """The super-block GEMM's path: AMX-INT8 tiles where the CPU has them, else block_matmul's
    (AVX-VNNI builds take its AVX2 path)."""
    if {"amx_tile", "amx_int8"} <= cpu_flags() and _expected_native_isa() == "avx512-vnni":
        return "amx-int8"
    return "avx2" if _expected_native_isa() == "avx-vnni" else _expected_native_isa()


@needs_kernels
def test_native_build_takes_the_widest_path_this_cpu_has():
    assert load_cpu_kernels().block_matmul_isa() == _expected_native_isa()
    assert load_cpu_kernels().superblock_isa() == _expected_superblock_isa()
    assert f"block_matmul: {_expected_native_isa()}" in cpu_kernels.kernel_isa()


def _tiles(ops, x: torch.Tensor, blocks: torch.Tensor, block_type: int) -> torch.Tensor:
    return ops.block_gemm_tiles(x, ops.block_repack_tiles(blocks, block_type, x.shape[1]), block_type, blocks.shape[0])


@needs_kernels
def test_native_build_matches_the_reference_arithmetic(cases):
    ops = load_cpu_kernels()
    assert ops.block_gemm_tiles_isa() == _expected_native_isa()
    with select_backend("cpu").batch_invariant(True):  # the integer kernel at every M
        for block_type, x, blocks in cases[1]:
            reference = _int8_reference(x, blocks, block_type)
            torch.testing.assert_close(ops.block_matmul(x, blocks, block_type), reference, rtol=1e-5, atol=1e-4)
            torch.testing.assert_close(_tiles(ops, x, blocks, block_type), reference, rtol=1e-5, atol=1e-4)


def _silu_mul_reference(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of gate_up = [x, x reversed], in float64."""
    gate, up = x.double(), x.flip(1).double()
    return (gate / (1 + torch.exp(-gate)) * up).float()


@needs_kernels
def test_fused_down_projection_is_silu_and_mul_then_the_tiles(cases):
    """silu_mul_block_gemm_tiles (the decoder stack's down projection on tiles) quantizes silu(gate) * up
    as it computes it: the same bits as silu_and_mul's rows through block_gemm_tiles, at every row count."""
    ops = load_cpu_kernels()
    for block_type, x, blocks in cases[1]:
        gate_up = torch.cat([x, x.flip(1)], 1)
        packed = ops.block_repack_tiles(blocks, block_type, x.shape[1])
        fused = ops.silu_mul_block_gemm_tiles(gate_up, packed, block_type, blocks.shape[0])
        assert torch.equal(fused, ops.block_gemm_tiles(ops.silu_and_mul(gate_up), packed, block_type, blocks.shape[0]))
        reference = _int8_reference(_silu_mul_reference(x), blocks, block_type)
        torch.testing.assert_close(fused, reference, rtol=1e-3, atol=1e-3)
    with pytest.raises(RuntimeError, match=r"gate_up must be float32 \[M, 2K\]"):
        ops.silu_mul_block_gemm_tiles(torch.zeros(2, 97), packed, block_type, blocks.shape[0])
    with pytest.raises(RuntimeError, match="the tiles do not hold a repacked"):
        ops.silu_mul_block_gemm_tiles(torch.zeros(2, 4 * K), packed, block_type, blocks.shape[0])


@needs_kernels
@pytest.mark.parametrize("level", ["avx512-vnni", "avx-vnni", "avx2", "scalar"])
def test_fallback_build_gives_the_native_bits(level, cases, tmp_path):
    if not _runs_here(level):
        pytest.skip(f"this CPU cannot run {level}")
    if level == "avx512-vnni" and _expected_superblock_isa() != "amx-int8":
        pytest.skip("the native build takes the avx512-vnni paths on this CPU")  # only AMX's tiles differ
    if level == _expected_native_isa() == "avx2":
        # the same #ifdef paths as the native build, which every other kernel test runs (a 5-file build saved)
        pytest.skip("the native build takes the avx2 paths on this CPU")
    path, data = cases
    out, superblock_path = tmp_path / "out.pt", tmp_path / "superblock_cases.pt"
    superblock_data = kernel_cases()
    torch.save(superblock_data, superblock_path)
    subprocess.run([sys.executable, "-c", _CHILD, level, str(path), str(superblock_path), str(out)], cwd=REPO, check=True)
    result = torch.load(out)
    assert result["isa"] == result["tiles_isa"] == level
    assert result["superblock_isa"] == ("avx2" if level == "avx-vnni" else level)
    ops = load_cpu_kernels()
    g = torch.Generator().manual_seed(5)  # the child's half_outputs, here on the native build
    w, x = torch.randn(37, 96, generator=g), torch.randn(5, 96, generator=g)
    native = [ops.half_gemm(x[:m], ops.half_repack(w.to(d).view(torch.int16), t), 37)
              for t, d in ((1, torch.float16), (30, torch.bfloat16)) for m in (1, 4, 5)]
    for got, want in zip(result["half"], native, strict=True):
        assert torch.equal(got, want), level  # one fma per input, in order, on every path
    with select_backend("cpu").batch_invariant(True):  # the integer paths at every row count (no bf16 route)
        for (qtype, x, blocks), got in zip(superblock_data, result["superblock"], strict=True):
            # the super-block GEMM: every path's integer sums are exact and its float steps in one order
            packed = ops.superblock_repack([blocks], [TYPE_IDS[qtype]], x.shape[1])
            assert torch.equal(got, ops.superblock_gemm(x, packed, blocks.shape[0])), (level, qtype, x.shape[0])
    with select_backend("cpu").batch_invariant(True):
        for (block_type, x, blocks), got, tiles in zip(data, result["outputs"], result["tiles"], strict=True):
            # the integer dot products are exact and every path sums the floats in one documented order
            assert torch.equal(got, ops.block_matmul(x, blocks, block_type)), (level, block_type, x.shape[0])
            torch.testing.assert_close(got, _int8_reference(x, blocks, block_type), rtol=1e-5, atol=1e-4)
            # so does the tile GEMM, in its own order
            assert torch.equal(tiles, _tiles(ops, x, blocks, block_type)), (level, block_type, x.shape[0])
        for (block_type, x, blocks), (fused, unfused) in zip(data, result["down"], strict=True):
            # the fused down projection: that level's two ops' bits (exp is vectorized from avx2 up)
            assert torch.equal(fused, unfused), (level, block_type, x.shape[0])
            torch.testing.assert_close(fused, _int8_reference(_silu_mul_reference(x), blocks, block_type),
                                       rtol=1e-3, atol=1e-3)
    # the flash-style prefill kernel (its micro-kernel and exp vectorized from avx2 up): SDPA's results
    attn = result["attn"]
    for window, got in zip((0, 40), attn["out"], strict=True):
        keys, values = (c[attn["table"]].float().transpose(1, 2).flatten(0, 1)[:170].transpose(0, 1)
                        for c in (attn["k"], attn["v"]))
        pos = torch.arange(170)
        mask = (pos <= pos[100:, None]) & ((pos > pos[100:, None] - window) if window else True)
        expected = torch.nn.functional.scaled_dot_product_attention(
            attn["q"].transpose(0, 1), keys, values, attn_mask=mask, scale=0.125, enable_gqa=True).transpose(0, 1)
        torch.testing.assert_close(got, expected, atol=2e-6, rtol=1e-5)


def test_isa_level_errors_name_the_problem(monkeypatch):
    monkeypatch.setenv("PAGODA_KERNEL_ISA", "avx9000")
    with pytest.raises(ValueError, match="PAGODA_KERNEL_ISA='avx9000' is not one of native, avx512-vnni"):
        cpu_kernels.kernel_isa_level()
    # a CPU without AVX-512 (its flags as /proc/cpuinfo would list them) asked for the AVX-512 build
    monkeypatch.setattr("pagoda.platform.cpu_flags", lambda: frozenset({"sse2", "avx", "avx2", "fma", "f16c"}))
    monkeypatch.setenv("PAGODA_KERNEL_ISA", "avx512-vnni")
    with pytest.raises(ValueError, match="PAGODA_KERNEL_ISA=avx512-vnni: this CPU lacks avx512f avx512bw"):
        cpu_kernels.kernel_isa_level()
    monkeypatch.setenv("PAGODA_KERNEL_ISA", "avx2")
    assert cpu_kernels.kernel_isa_level() == "avx2"
