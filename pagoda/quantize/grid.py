"""The value grids of ggml's blocks of 32, for quantizers that choose their own codes.

A GGUF stores a 2-D weight row by row in blocks of 32 consecutive inputs (pagoda/layers/
ggml_blocks.py has the byte layout). Each block holds fp16 parameters and small integer codes:

- Q4_0: ``w = d * q``,     q ∈ [-8, 7]      (stored as q + 8 in a nibble)
- Q4_1: ``w = d * q + m``, q ∈ [0, 15]
- Q8_0: ``w = d * q``,     q ∈ [-127, 127]  (int8)

AWQ and GPTQ work on this grid directly: ``block_params`` picks ``d`` (and ``m``) per block,
already rounded to fp16 as the file will hold them, ``quantize_codes`` rounds weights against
those values, and ``pack`` writes exactly those codes and parameters. So the weights an
optimizer measured are the weights ``dequantize`` of the file gives back, bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK = 32
QTYPES = ("Q4_0", "Q4_1", "Q8_0")
_CODE_RANGE = {"Q4_0": (-8, 7), "Q4_1": (0, 15), "Q8_0": (-127, 127)}


def qtype_for_bits(bits: int, zero_point: bool = False) -> str:
    """The block type of ``--bits`` (4: Q4_0, or Q4_1 with a zero point; 8: Q8_0)."""
    if bits == 8:
        if zero_point:
            raise ValueError("8-bit blocks (Q8_0) have no zero point: drop --zero-point")
        return "Q8_0"
    if bits == 4:
        return "Q4_1" if zero_point else "Q4_0"
    raise ValueError(f"--bits must be 4 or 8, got {bits}")


def code_range(qtype: str) -> tuple[int, int]:
    """The smallest and largest code of ``qtype``."""
    return _CODE_RANGE[qtype]


def output_error(delta: torch.Tensor, hessian: torch.Tensor) -> torch.Tensor:
    """``Σ_rows δ H δᵀ``: the summed squared output error a weight change ``delta`` [N, K] causes
    over inputs whose second moment is ``hessian`` [K, K]."""
    return ((delta @ hessian) * delta).sum()


def check_shape(weight: torch.Tensor, what: str = "weight") -> None:
    if weight.dim() != 2 or weight.shape[1] % BLOCK:
        raise ValueError(f"cannot quantize {what} of shape {tuple(weight.shape)}: blocks of {BLOCK} need a 2-D "
                         f"weight whose rows are a multiple of {BLOCK} long")


@dataclass
class Quantized:
    """A weight [N, K] on a block grid: integer ``codes`` [N, K] and per-block ``d`` and ``m``
    [N, K / 32] (``m`` is None for the symmetric types), all as the file stores them."""

    qtype: str
    codes: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None

    def dequantize(self) -> torch.Tensor:
        return dequantize(self.codes, self.d, self.m)


def _fp16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float16).float()


def block_params(weight: torch.Tensor, qtype: str, clip: torch.Tensor | float = 1.0
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(d, m) per block of ``weight`` [N, K] (or one block column [N, 32]), fp16-rounded.

    ``clip`` (a number or [N, K / 32]) shrinks the range the block covers: values past it are
    clamped to the grid's ends, which buys a finer grid for the rest (AWQ's clipping search)."""
    n, k = weight.shape
    g = weight.float().reshape(n, k // BLOCK, BLOCK)
    if qtype == "Q4_0":  # llama.cpp's choice: the largest-magnitude value maps to code -8
        extreme = g.gather(-1, g.abs().argmax(dim=-1, keepdim=True)).squeeze(-1)
        return _fp16(extreme * clip / -8.0), None
    if qtype == "Q4_1":  # clipping clamps both ends to ±clip·amax, as AWQ's search does
        bound = g.abs().amax(dim=-1) * clip
        lo, hi = torch.maximum(g.amin(dim=-1), -bound), torch.minimum(g.amax(dim=-1), bound)
        return _fp16((hi - lo) / 15.0), _fp16(lo)
    if qtype == "Q8_0":
        return _fp16(g.abs().amax(dim=-1) * clip / 127.0), None
    raise ValueError(f"unknown block type {qtype!r}: choose from {', '.join(QTYPES)}")


def _expand(p: torch.Tensor, k: int) -> torch.Tensor:
    """[N, nb] per-block values → [N, k] per-weight (k = nb * 32)."""
    return p.repeat_interleave(BLOCK, dim=-1)[..., :k]


def quantize_codes(weight: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None, qtype: str) -> torch.Tensor:
    """The nearest codes of ``weight`` [N, K] on the grid of ``d``, ``m`` ([N, K / 32]), as float."""
    lo, hi = _CODE_RANGE[qtype]
    k = weight.shape[1]
    dd = _expand(d, k)
    shifted = weight.float() if m is None else weight.float() - _expand(m, k)
    inv = torch.where(dd != 0, 1.0 / dd, torch.zeros_like(dd))
    return torch.round(shifted * inv).clamp_(lo, hi)


def dequantize(codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None) -> torch.Tensor:
    """``d * q (+ m)`` per weight, in float32 as ggml computes it."""
    k = codes.shape[1]
    w = _expand(d, k) * codes
    return w if m is None else w + _expand(m, k)


def quantize(weight: torch.Tensor, qtype: str, clip: torch.Tensor | float = 1.0) -> Quantized:
    """Round to nearest on the block grid (``clip`` as in ``block_params``)."""
    check_shape(weight)
    d, m = block_params(weight, qtype, clip)
    return Quantized(qtype, quantize_codes(weight, d, m, qtype), d, m)


def pack(q: Quantized) -> torch.Tensor:
    """The ggml bytes of ``q``: uint8 [N, K / 32 * block bytes], as a GGUF stores the tensor."""
    n, k = q.codes.shape
    nb = k // BLOCK
    fp16 = lambda x: x.to(torch.float16).contiguous().view(torch.uint8).reshape(n, nb, 2)
    codes = q.codes.reshape(n, nb, BLOCK)
    if q.qtype == "Q8_0":
        body = codes.to(torch.int8).view(torch.uint8)
        return torch.cat([fp16(q.d), body], dim=-1).reshape(n, -1)
    nibbles = (codes + 8 if q.qtype == "Q4_0" else codes).to(torch.uint8)
    body = nibbles[..., :16] | (nibbles[..., 16:] << 4)  # element j low nibble, j + 16 high (ggml's order)
    header = [fp16(q.d)] if q.qtype == "Q4_0" else [fp16(q.d), fp16(q.m)]
    return torch.cat([*header, body], dim=-1).reshape(n, -1)
