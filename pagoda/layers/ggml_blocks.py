"""Weights kept in ggml's blocks of 32 (Q4_0, Q4_1, Q8_0) and multiplied without dequantizing.

The layout is ggml's own (ggml-common.h; layers/ggml_formats.py), so a GGUF's tensors are used
byte for byte, and ``--quantization int4 | int8`` produce the same formats from float weights (Q4_1
and Q8_0, as llama.cpp's quantizer would).
The matmul (``torch.ops.pagoda.block_matmul``, pagoda/csrc/block_matmul.cpp) quantizes the
activations to int8 per block of 32 and runs integer dot products, as llama.cpp does (AVX512-VNNI,
AVX-VNNI, AVX2 or scalar, as the kernels were built; all give the same bits); from 16 rows, outside
deterministic mode, it dequantizes the weight per call and runs a library GEMM (bf16 on AMX /
AVX512-BF16 CPUs). Without the compiled kernels the layers dequantize their weight on every call
(correct, slow).
"""

from __future__ import annotations

import torch
from torch import nn

from pagoda.layers.backend import current_backend
from pagoda.layers.ggml_formats import (  # noqa: F401 - the formats' names, re-exported for the layers' users
    BLOCK, BLOCK_BYTES, Q4_0, Q4_1, Q8_0, TYPE_NAMES, check_in_features, dequantize_blocks, q4_0_to_q4_1,
    quantize_q4_1, quantize_q8_0,
)


class BlockLinear(nn.Module):
    """``y = x @ W.T + bias`` with W in ggml blocks (``blocks``: uint8 [out_features, bytes per row])."""

    def __init__(self, blocks: torch.Tensor, block_type: int, in_features: int, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        if block_type not in BLOCK_BYTES:
            raise ValueError(f"block type {block_type} is not one of {sorted(TYPE_NAMES.values())}")
        check_in_features(in_features)
        if blocks.shape[1] != in_features // BLOCK * BLOCK_BYTES[block_type]:
            raise ValueError(f"{TYPE_NAMES[block_type]} rows of {in_features} inputs take "
                             f"{in_features // BLOCK * BLOCK_BYTES[block_type]} bytes, got {blocks.shape[1]}")
        self.block_type = block_type
        self.backend = current_backend()  # block_matmul: int8 dot products with the C++ kernel
        self.in_features, self.out_features = in_features, blocks.shape[0]
        self.register_buffer("blocks", blocks.contiguous())
        self.register_buffer("bias", bias)
        self.packed: torch.Tensor | None = None  # layers/packed_weights.py: for the many-row GEMM

    @classmethod
    def from_float(cls, weight: torch.Tensor, block_type: int, bias: torch.Tensor | None = None) -> BlockLinear:
        quantize = {Q4_1: quantize_q4_1, Q8_0: quantize_q8_0}.get(block_type)
        if quantize is None:
            raise ValueError(f"quantizing float weights to {TYPE_NAMES.get(block_type, block_type)} is not supported")
        return cls(quantize(weight), block_type, weight.shape[1], None if bias is None else bias.detach())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and self.bias is None and x.dtype == torch.float32:  # the decode step's case, kept short
            return self.backend.block_matmul(x, self.blocks, self.block_type, self.packed)
        y = self.backend.block_matmul(x.reshape(-1, self.in_features), self.blocks, self.block_type, self.packed).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)

    def dequantize(self) -> torch.Tensor:
        return dequantize_blocks(self.blocks, self.block_type)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {TYPE_NAMES[self.block_type]}"


class BlockEmbedding(nn.Module):
    """An embedding table in blocks; looking up a row dequantizes it. A tied output head is a
    ``BlockLinear`` over the same ``blocks`` tensor."""

    def __init__(self, blocks: torch.Tensor, block_type: int, embedding_dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.block_type, self.embedding_dim, self.dtype = block_type, embedding_dim, dtype
        self.num_embeddings = blocks.shape[0]
        self.register_buffer("blocks", blocks)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.blocks[ids.reshape(-1)]
        return dequantize_blocks(rows, self.block_type).to(self.dtype).reshape(*ids.shape, self.embedding_dim)
