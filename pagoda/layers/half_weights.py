"""F16 / BF16 weights (a GGUF's unquantized tensors) multiplied as stored, 2 bytes a weight.

Dequantized to float32 they took twice the memory and, one stream's decode being bound by reading
the weights, ran at half the speed of llama.cpp on the same F16 file. ``half_repack``
(pagoda/csrc/half_weights.cpp) puts 16 rows side by side once at load; ``half_gemm`` widens them
as it reads and sums the exact fp32 products in input order. Like the block layers, these need
pagoda's compiled kernels (without them the loader dequantizes).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from pagoda.layers.backend import current_backend

if TYPE_CHECKING:
    from pagoda.loader.repacked_cache import RepackCache

F16, BF16 = 1, 30  # GGMLQuantizationType values
TYPE_NAMES = {F16: "F16", BF16: "BF16"}
HALF_TYPES = frozenset(TYPE_NAMES)
PACKED = 1001  # block_matmul's block type for a packed F16 / BF16 weight (csrc/ops.h)


def header(packed: torch.Tensor) -> tuple[int, int, int]:
    """(in_features, out_features, type) of a packed weight."""
    words = packed[:32].view(torch.int64).tolist()
    return words[1], words[2], words[3]


HEADER_BYTES = 64  # csrc/half_weights.cpp's: int64 MAGIC, K, N, type
MAGIC = 0x3146414850474150


def packed_bytes(out_features: int, in_features: int) -> int:
    """The size of a packed [out_features, in_features] weight (rows padded to tiles of 16)."""
    return HEADER_BYTES + (out_features + 15) // 16 * 16 * in_features * 2


def repack(values: Callable[[], torch.Tensor], half_type: int, shape: tuple[int, int],
           cache: RepackCache | None = None, name: str = "") -> torch.Tensor:
    """``values()``: [N, K] 2-byte values (any 2-byte dtype holding the stored bits) of ``shape``
    → the packed weight. With ``cache``, the weight ``name`` packed at an earlier start is mapped
    instead, the values never read."""
    def make() -> torch.Tensor:
        return current_backend().ops.half_repack(values(), half_type)

    def expected(packed: torch.Tensor) -> bool:
        n, k = shape
        return (packed.numel() == packed_bytes(n, k) and packed[:8].view(torch.int64).item() == MAGIC
                and header(packed) == (k, n, half_type))

    return make() if cache is None else cache.get(name, expected, make)


class HalfLinear(nn.Module):
    """``y = x @ W.T + bias`` with W packed from F16 / BF16 (``blocks``: the packed tensor); it
    stands where a ``BlockLinear`` would (block type ``PACKED``, which the decode stack's
    ``block_matmul`` takes)."""

    def __init__(self, packed: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features, half_type = header(packed)
        self.block_type, self.type_name = PACKED, TYPE_NAMES[half_type]
        self.ops = current_backend().ops
        self.register_buffer("blocks", packed)
        self.register_buffer("bias", bias)
        self.packed: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and self.bias is None and x.dtype == torch.float32:
            return self.ops.half_gemm(x, self.blocks, self.out_features)
        y = self.ops.half_gemm(x.reshape(-1, self.in_features).float(), self.blocks, self.out_features).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)

    def dequantize(self) -> torch.Tensor:
        return self.ops.half_rows(self.blocks, torch.arange(self.out_features))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.type_name}"


class HalfEmbedding(nn.Module):
    """An embedding table packed from F16 / BF16; a tied output head is a ``HalfLinear`` over the
    same tensor."""

    def __init__(self, packed: torch.Tensor, dtype: torch.dtype) -> None:
        super().__init__()
        self.embedding_dim, self.num_embeddings, _ = header(packed)
        self.dtype = dtype
        self.ops = current_backend().ops
        self.register_buffer("blocks", packed)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.ops.half_rows(self.blocks, ids.reshape(-1))
        return rows.to(self.dtype).reshape(*ids.shape, self.embedding_dim)
