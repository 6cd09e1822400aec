"""Weights in ggml's super-block formats, multiplied without dequantizing: the K-quants (Q4_K,
Q5_K, Q6_K, what a Q4_K_M / Q5_K_M / Q6_K GGUF holds), the non-linear IQ4_XS / IQ4_NL, and the
blocks of 32 a file mixes with them (Q5_0 / Q5_1; Q4_0 / Q4_1 / Q8_0 beside another type).

At load the file's blocks are repacked once into tiles of 16 weight rows
(``torch.ops.pagoda.superblock_repack``, pagoda/csrc/superblock_formats.h) that keep each format's
scale hierarchy, so the copy takes the file's bytes (within 2 %) and replaces them: no second copy
of the weight is kept. ``superblock_gemm`` multiplies it at every row count, as the Q4_0 / Q4_1 /
Q8_0 tiles are multiplied (int8 activations per block of 32, exact integer dot products, fp32
scaling). A merged projection whose shards differ in type (a Q4_K_M file's Q4_K ``attn_q`` beside
its Q6_K ``attn_v``) is one packed weight of several parts.

These layers need pagoda's compiled kernels; without them the loader dequantizes such weights.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from pagoda.layers.backend import current_backend

if TYPE_CHECKING:
    from pagoda.loader.repacked_cache import RepackCache

Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 = 2, 3, 6, 7, 8  # GGMLQuantizationType values
Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS = 12, 13, 14, 20, 23
TYPE_NAMES = {Q4_0: "Q4_0", Q4_1: "Q4_1", Q5_0: "Q5_0", Q5_1: "Q5_1", Q8_0: "Q8_0", Q4_K: "Q4_K", Q5_K: "Q5_K",
              Q6_K: "Q6_K", IQ4_NL: "IQ4_NL", IQ4_XS: "IQ4_XS"}
# Every type these tiles hold. Q4_0 / Q4_1 / Q8_0 alone keep their own tiles (packed_weights.py);
# they join a packed weight where a file mixes them with the others (a small model's Q4_K_M:
# Q5_0 q/k beside a Q8_0 v, where rows are not whole super-blocks).
SUPERBLOCK_TYPES = frozenset(TYPE_NAMES)
BLOCK32_TYPES = frozenset({Q4_0, Q4_1, Q8_0})
PACKED = 1000  # block_matmul's block type for a packed super-block weight (csrc/ops.h)
_HEADER_WORDS = 32  # the packed tensor's header: int64 magic, K, N, parts, (type, rows) per part


def header(packed: torch.Tensor) -> tuple[int, int, list[tuple[int, int]]]:
    """(in_features, out_features, [(type, rows) per part]) of a packed weight."""
    words = packed[: 8 * _HEADER_WORDS].view(torch.int64).tolist()
    return words[1], words[2], [(words[4 + 2 * p], words[5 + 2 * p]) for p in range(words[3])]


# per type: elements in a super-block, and bytes of a tile's record for one (csrc/superblock_formats.h)
SUPER_ELEMENTS = {Q4_K: 256, Q5_K: 256, Q6_K: 256, IQ4_XS: 256, IQ4_NL: 32, Q4_0: 32, Q4_1: 32, Q5_0: 32, Q5_1: 32,
                  Q8_0: 32}
RECORD_BYTES = {Q4_K: 2368, Q5_K: 2880, Q6_K: 3360, IQ4_XS: 2208, IQ4_NL: 288, Q4_0: 288, Q4_1: 320, Q5_0: 352,
                Q5_1: 384, Q8_0: 544}
HEADER_BYTES = 8 * _HEADER_WORDS


def packed_bytes(parts: Sequence[tuple[int, int]], in_features: int) -> int:
    """The size of a packed weight of ``[(type, rows)]`` parts."""
    return HEADER_BYTES + sum((rows + 15) // 16 * (in_features // SUPER_ELEMENTS[t]) * RECORD_BYTES[t]
                              for t, rows in parts)


def repack(parts: Sequence[tuple[Callable[[], torch.Tensor], int, int]], in_features: int,
           cache: RepackCache | None = None, name: str = "") -> torch.Tensor:
    """Row-parts of stored blocks ``(blocks(), type, rows)`` (``blocks()``: uint8 [rows, bytes])
    → one packed weight; neighbouring parts of one type become one part. With ``cache``, the
    weight ``name`` packed at an earlier start is mapped instead, the blocks never read."""
    merged: list[tuple[list, int, int]] = []
    for blocks, block_type, rows in parts:
        if merged and merged[-1][1] == block_type:
            merged[-1][0].append(blocks)
            merged[-1] = (merged[-1][0], block_type, merged[-1][2] + rows)
        else:
            merged.append(([blocks], block_type, rows))
    shape = [(t, rows) for _, t, rows in merged]

    def make() -> torch.Tensor:
        stacked = [torch.cat([b() for b in group]) if len(group) > 1 else group[0]() for group, _, _ in merged]
        return current_backend().ops.superblock_repack(stacked, [t for t, _ in shape], in_features)

    def expected(packed: torch.Tensor) -> bool:
        n = sum(rows for _, rows in shape)
        return packed.numel() == packed_bytes(shape, in_features) and header(packed) == (in_features, n, shape)

    return make() if cache is None else cache.get(name, expected, make)


class SuperBlockLinear(nn.Module):
    """``y = x @ W.T + bias`` with W packed from super-block formats (``blocks``: the packed tensor).

    It stands where a ``BlockLinear`` would (block type ``PACKED``, which the decode stack's
    ``block_matmul`` takes)."""

    def __init__(self, packed: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features, parts = header(packed)
        self.block_type = PACKED
        self.types = [TYPE_NAMES[t] for t, _ in parts]
        self.backend = current_backend()
        self.register_buffer("blocks", packed)
        self.register_buffer("bias", bias)
        self.packed: torch.Tensor | None = None  # the blocks are the packed copy

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gemm = self.backend.ops.superblock_gemm
        if x.dim() == 2 and self.bias is None and x.dtype == torch.float32:
            return gemm(x, self.blocks, self.out_features)
        y = gemm(x.reshape(-1, self.in_features).float(), self.blocks, self.out_features).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)

    def dequantize(self) -> torch.Tensor:
        return self.backend.ops.superblock_rows(self.blocks, torch.arange(self.out_features))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {'+'.join(self.types)}"


class SuperBlockEmbedding(nn.Module):
    """An embedding table packed from super-block formats; a lookup dequantizes its rows. A tied
    output head is a ``SuperBlockLinear`` over the same tensor."""

    def __init__(self, packed: torch.Tensor, dtype: torch.dtype) -> None:
        super().__init__()
        k, self.num_embeddings, _ = header(packed)
        self.embedding_dim, self.dtype = k, dtype
        self.ops = current_backend().ops
        self.register_buffer("blocks", packed)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.ops.superblock_rows(self.blocks, ids.reshape(-1))
        return rows.to(self.dtype).reshape(*ids.shape, self.embedding_dim)
