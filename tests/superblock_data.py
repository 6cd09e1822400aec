"""Random blocks of ggml's super-block formats (Q4_K, Q5_K, Q6_K, IQ4_XS, IQ4_NL) for the kernel
and loader tests: every byte random (codes, packed scales, high bits), the fp16 scales ``d`` (and
``dmin``) set to finite values of a weight's size, so that any byte pattern the format allows is
exercised. gguf-py dequantizes these formats but cannot quantize to them."""

from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from pagoda.loader.gguf_writer_tensors import BlockTensor

TYPES = ("Q4_K", "Q5_K", "Q6_K", "IQ4_XS", "IQ4_NL", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")
TYPE_IDS = {name: int(GGMLQuantizationType[name]) for name in TYPES}
# where each format keeps its fp16 d (and Q4_K / Q5_K their dmin, Q4_1 / Q5_1 their m, 2 bytes on)
_D_OFFSET = {"Q6_K": 208}
# a d that makes weights of the tiny models' size (std ~0.08) from each format's codes
_D_SCALE = {"Q4_K": 3e-4, "Q5_K": 1.5e-4, "Q6_K": 6e-5, "IQ4_XS": 6e-5, "IQ4_NL": 1.1e-3, "Q4_0": 0.017,
            "Q4_1": 0.017, "Q5_0": 0.009, "Q5_1": 0.009, "Q8_0": 0.001}
# the offset that centres d * code + m on 0 (Q4_K / Q5_K: dmin = d times it, their 6-bit scales' mean)
_CENTRE = {"Q4_K": 7.5, "Q5_K": 15.5, "Q4_1": 7.5, "Q5_1": 15.5}


def random_blocks(qtype: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 [rows, bytes per row] of ``qtype`` blocks for a [rows, cols] weight."""
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]
    if cols % block:
        raise ValueError(f"{qtype} rows take multiples of {block} columns, got {cols}")
    b = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    d = rng.uniform(0.5, 1.5, size=(rows, cols // block)) * _D_SCALE[qtype]
    at = _D_OFFSET.get(qtype, 0)
    b[..., at:at + 2] = d.astype(np.float16)[..., None].view(np.uint8)
    if qtype in _CENTRE:  # Q4_K / Q5_K's dmin, Q4_1 / Q5_1's m: weights centred on 0
        m = d * _CENTRE[qtype] * (1 if qtype.endswith("_K") else -1)
        b[..., 2:4] = m.astype(np.float16)[..., None].view(np.uint8)
    return b.reshape(rows, -1)


def dequantized(blocks: np.ndarray, qtype: str, cols: int) -> np.ndarray:
    """float32 [rows, cols]: gguf-py's dequantization (the reference)."""
    from gguf import quants

    return quants.dequantize(blocks, GGMLQuantizationType[qtype]).reshape(blocks.shape[0], cols).astype(np.float32)


def block_tensors(hf_tensors, types: dict[str, str], seed: int = 0):
    """The model's tensors with each 2-D weight replaced by random blocks: ``types`` maps a name
    fragment (``v_proj``, ``embed_tokens`` ...) to its format, ``"*"`` every other 2-D weight."""
    rng = np.random.default_rng(seed)
    for name, w in hf_tensors:
        if w.ndim != 2:
            yield name, w
            continue
        qtype = next((t for fragment, t in types.items() if fragment != "*" and fragment in name), types["*"])
        yield name, BlockTensor(random_blocks(qtype, w.shape[0], w.shape[1], rng), qtype)


def kernel_cases(seed: int = 7) -> list[tuple[str, "torch.Tensor", "torch.Tensor"]]:
    """(format, activations [M, K], blocks uint8 [N, bytes]) for every format at every kernel row
    count (1-4 rows a call, ragged ends) and tile count a call (1-4)."""
    import torch

    rng = np.random.default_rng(seed)
    g = torch.Generator().manual_seed(seed)
    cases = []
    for qtype in TYPES:
        # 37 rows: a lone last tile half; 70: one row's kernel takes 4 tiles a call, then 1;
        # from 32 rows on AMX tiles take the super-block formats where the CPU has them: 32 + 1, 16 + 4
        for n, k, rows in ((37, 512, (1, 2, 3, 4, 5, 9, 33)), (70, 256, (1, 2, 52))):
            blocks = torch.from_numpy(random_blocks(qtype, n, k, rng))
            for m in rows:
                x = torch.randn(m, k, generator=g) * torch.rand(m, 1, generator=g) * 4
                x[0, 32:64] = 0.0  # an all-zero activation block: scale 0
                cases.append((qtype, x, blocks))
    return cases


def int8_reference(x: "torch.Tensor", weight: "torch.Tensor") -> "torch.Tensor":
    """The kernels' arithmetic in float64: x rounded to int8 per block of 32 as they round it
    (d = amax / 127, codes round(x * (1 / d)), in float32), times the exact weights."""
    import torch

    g = x.reshape(x.shape[0], -1, 32)
    d = g.abs().amax(dim=-1, keepdim=True) / 127
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(g * inv)
    return ((q.double() * d.double()).reshape(x.shape) @ weight.double().T).float()
