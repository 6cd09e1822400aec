"""A weight a loader hands over in its stored quantized form (``PackedWeight``, e.g. a GGUF's
blocks), and the layers such weights become as they are: stacked into one block layer for
pagoda's kernels (ggml_blocks.py, superblocks.py, half_weights.py), or, on torch's kernels, into
an ``Int4Linear`` where the stored form is exactly int4 groups (GGUF's Q4_0 / Q4_1: ``scale = d``
and ``zero = 0`` or ``m + 8 d``; the codes are copied, never re-quantized).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from pagoda.layers import ggml_blocks, half_weights, superblocks
from pagoda.layers.backend import current_backend
from pagoda.layers.ggml_blocks import BlockLinear
from pagoda.layers.half_weights import HalfLinear
from pagoda.layers.superblocks import SuperBlockLinear
from pagoda.layers.torch_int_linears import COMPUTE_DTYPE, INT4_GROUP_SIZE, Int4Linear

if TYPE_CHECKING:
    from pagoda.loader.repacked_cache import RepackCache


class PackedWeight:
    """A weight handed over by a loader in a stored quantized form (e.g. GGUF blocks).

    Where ``int4_exact`` is true, ``int4_groups`` gives that form exactly as int4 codes with a scale
    and zero per group of ``INT4_GROUP_SIZE`` (``w = (q - 8) * scale + zero``); ``dequantize`` gives
    the float32 weight in every case.
    """

    shape: tuple[int, ...]
    int4_exact: bool = False

    def dequantize(self) -> torch.Tensor:
        raise NotImplementedError

    ggml_block_type: int | None = None  # one of ggml_blocks' types when the stored form is one

    def ggml_blocks(self) -> torch.Tensor:
        """The stored blocks, uint8 [rows, bytes per row] (only where ``ggml_block_type`` is set)."""
        raise ValueError(f"{type(self).__name__} holds no ggml blocks")

    def int4_groups(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        raise ValueError(f"{type(self).__name__} has no exact int4 form")

    def rows(self, start: int, stop: int) -> PackedWeight:
        """Output rows ``start:stop`` in the same stored form (a fused checkpoint tensor's parts)."""
        raise ValueError(f"{type(self).__name__} cannot be cut into rows")


def block_kernels_available() -> bool:
    """Whether quantized layers use the block kernels (else torch's int8/int4 kernels): the
    backend of the model being built has pagoda's C++ kernels."""
    return current_backend().has_cpu_kernels


def _block_type(shards: Sequence[PackedWeight]) -> int | None:
    """The one block type ``shards`` stack into: Q4_0, Q4_1 or Q8_0 alone as they are (Q4_0 joins
    Q4_1 as Q4_1); any other mix of the types superblocks.py holds, one ``superblocks.PACKED``
    weight; else None."""
    types = {s.ggml_block_type for s in shards}
    if not shards or None in types or len({s.shape[1] for s in shards}) != 1:
        return None
    if len(types) == 1 and types <= half_weights.HALF_TYPES:
        return half_weights.PACKED
    if len(types) == 1 and types <= superblocks.BLOCK32_TYPES:
        return types.pop()
    if types <= {ggml_blocks.Q4_0, ggml_blocks.Q4_1}:
        return ggml_blocks.Q4_1
    return superblocks.PACKED if types <= superblocks.SUPERBLOCK_TYPES else None


def stacked_blocks(shards: Sequence[PackedWeight], cache: RepackCache | None = None,
                   name: str = "") -> tuple[torch.Tensor, int]:
    """``shards`` stacked along the output dimension as one (blocks, block type); super-block
    formats and F16 / BF16 as one packed weight (superblocks.repack, half_weights.repack; with
    ``cache``, as packed at an earlier start, under ``name``)."""
    block_type = _block_type(shards)
    if block_type is None:
        raise ValueError("these weights have no common ggml block form")
    if block_type == superblocks.PACKED:
        parts = [(s.ggml_blocks, s.ggml_block_type, s.shape[0]) for s in shards]
        return superblocks.repack(parts, shards[0].shape[1], cache, name), block_type
    if block_type == half_weights.PACKED:
        rows = sum(s.shape[0] for s in shards)
        packed = half_weights.repack(lambda: torch.cat([s.ggml_blocks() for s in shards]), shards[0].ggml_block_type,
                                     (rows, shards[0].shape[1]), cache, name)
        return packed, block_type
    parts = [s.ggml_blocks() if s.ggml_block_type == block_type else ggml_blocks.q4_0_to_q4_1(s.ggml_blocks())
             for s in shards]
    return torch.cat(parts), block_type


def block_linear(blocks: torch.Tensor, block_type: int, in_features: int,
                 bias: torch.Tensor | None = None) -> BlockLinear | SuperBlockLinear | HalfLinear:
    """The layer for stacked blocks of ``block_type`` (``stacked_blocks``' result)."""
    if block_type == superblocks.PACKED:
        return SuperBlockLinear(blocks, bias)
    if block_type == half_weights.PACKED:
        return HalfLinear(blocks, bias)
    return BlockLinear(blocks, block_type, in_features, bias)


def keeps_packed(shards: Sequence[PackedWeight], projection: bool = True) -> bool:
    """Whether a loader's stored shards of one weight can stay quantized: as blocks with the block
    kernels; otherwise, for projections only, as torch's int4 groups."""
    if block_kernels_available():
        return _block_type(shards) is not None
    return projection and can_pack(shards)


def can_pack(shards: Sequence[PackedWeight]) -> bool:
    """Whether ``shards`` (stacked along the output dimension, as merged QKV and gate/up are) have
    an exact int4 form the CPU packing accepts."""
    if not shards or not all(s.int4_exact for s in shards):
        return False
    in_features = {s.shape[1] for s in shards}
    return len(in_features) == 1 and Int4Linear.supports(sum(s.shape[0] for s in shards), in_features.pop())


def int4_from_packed(shards: Sequence[PackedWeight], bias: torch.Tensor | None = None,
                     compute_dtype: torch.dtype = COMPUTE_DTYPE) -> Int4Linear:
    """An Int4Linear holding ``shards`` (stacked along the output dimension) exactly as stored."""
    if not can_pack(shards):
        raise ValueError("these weights have no exact int4 form that packs")
    codes, scale, zero = (torch.cat(parts, dim=0) for parts in zip(*(s.int4_groups() for s in shards)))
    return Int4Linear.from_groups(codes, scale, zero, bias, INT4_GROUP_SIZE, compute_dtype)
