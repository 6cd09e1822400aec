"""ggml's blocks of 32 (Q4_0, Q4_1, Q8_0) as bytes: their layout, quantizing float weights into
them and dequantizing them (torch, no kernels). The layers that multiply them: ggml_blocks.py.

- Q4_0, 18 bytes: fp16 ``d``, 16 bytes of codes; ``w = d * (q - 8)``
- Q4_1, 20 bytes: fp16 ``d``, fp16 ``m``, 16 bytes of codes; ``w = d * q + m``
- Q8_0, 34 bytes: fp16 ``d``, 32 int8 codes; ``w = d * q``

In a 4-bit block, element j sits in the low nibble of byte j and element j + 16 in the high nibble.
"""

from __future__ import annotations

import torch

BLOCK = 32
# GGMLQuantizationType values → bytes per block
Q4_0, Q4_1, Q8_0 = 2, 3, 8
BLOCK_BYTES = {Q4_0: 18, Q4_1: 20, Q8_0: 34}
TYPE_NAMES = {Q4_0: "Q4_0", Q4_1: "Q4_1", Q8_0: "Q8_0"}


def check_in_features(k: int) -> None:
    if k % BLOCK:
        raise ValueError(f"block quantization needs in_features to be a multiple of {BLOCK}, got {k}")


def _fp16_bytes(x: torch.Tensor) -> torch.Tensor:
    """[..., nb] float → [..., nb, 2] uint8 (fp16, little-endian as ggml stores it)."""
    return x.to(torch.float16).contiguous().view(torch.uint8).reshape(*x.shape, 2)


def _fp16_from(b: torch.Tensor) -> torch.Tensor:
    """[..., 2] uint8 → [...] float32."""
    return b.contiguous().view(torch.float16).squeeze(-1).float()


def quantize_q4_1(weight: torch.Tensor) -> torch.Tensor:
    """float [N, K] → Q4_1 blocks uint8 [N, K / 32 * 20]: per block ``d = (max - min) / 15``,
    ``m = min`` (both rounded to fp16 first), codes rounded against those values."""
    n, k = weight.shape
    check_in_features(k)
    g = weight.detach().float().reshape(n, k // BLOCK, BLOCK)
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)
    d = ((hi - lo) / 15.0).to(torch.float16).float()
    m = lo.to(torch.float16).float()
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round((g - m[..., None]) * inv[..., None]).clamp_(0, 15).to(torch.uint8)
    codes = q[..., :16] | (q[..., 16:] << 4)
    return torch.cat([_fp16_bytes(d), _fp16_bytes(m), codes], dim=-1).reshape(n, -1)


def quantize_q8_0(weight: torch.Tensor) -> torch.Tensor:
    """float [N, K] → Q8_0 blocks uint8 [N, K / 32 * 34]: ``d = amax / 127`` per block."""
    n, k = weight.shape
    check_in_features(k)
    g = weight.detach().float().reshape(n, k // BLOCK, BLOCK)
    d = (g.abs().amax(dim=-1) / 127.0).to(torch.float16).float()
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(g * inv[..., None]).clamp_(-127, 127).to(torch.int8).view(torch.uint8)
    return torch.cat([_fp16_bytes(d), q], dim=-1).reshape(n, -1)


def dequantize_blocks(blocks: torch.Tensor, block_type: int) -> torch.Tensor:
    """uint8 [N, bytes] of ``block_type`` blocks → float32 [N, K] (exact: fp32 of d * q + m)."""
    bb = BLOCK_BYTES[block_type]
    n = blocks.shape[0]
    b = blocks.reshape(n, -1, bb)
    d = _fp16_from(b[..., 0:2])
    if block_type == Q8_0:
        q = b[..., 2:].contiguous().view(torch.int8).float()
        return (d[..., None] * q).reshape(n, -1)
    header = 2 if block_type == Q4_0 else 4
    qs = b[..., header:]
    q = torch.cat([qs & 0x0F, qs >> 4], dim=-1).float()
    if block_type == Q4_0:
        return (d[..., None] * (q - 8.0)).reshape(n, -1)
    m = _fp16_from(b[..., 2:4])
    return (d[..., None] * q + m[..., None]).reshape(n, -1)


def q4_0_to_q4_1(blocks: torch.Tensor) -> torch.Tensor:
    """Q4_0 blocks → the same weights as Q4_1 (``m = -8 d``, exact in fp16), so that Q4_0 and Q4_1
    shards of one merged projection stack into one tensor."""
    n = blocks.shape[0]
    b = blocks.reshape(n, -1, 18)
    d = _fp16_from(b[..., 0:2])
    return torch.cat([b[..., 0:2], _fp16_bytes(-8.0 * d), b[..., 2:]], dim=-1).reshape(n, -1)
