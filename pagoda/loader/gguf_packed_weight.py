"""A GGUF weight kept as stored (``--quantization gguf``): ``GGUFPackedWeight``, the stored blocks
of one of the ``KEPT_QUANTIZED_TYPES`` handed to the layers as a ``PackedWeight``.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from pagoda.layers.stored_weights import PackedWeight


# GGUF types kept as stored under ``--quantization gguf``: ggml's blocks of 32, which pagoda's block
# kernels multiply as they are (pagoda/layers/ggml_blocks.py). Without those kernels, Q4_0 / Q4_1
# map exactly onto torch's int4 kernel groups, and Q8_0 is dequantized like every other type.
# The super-block formats (K-quants, IQ4) and Q5_0 / Q5_1 are repacked for pagoda's kernels
# (layers/superblocks.py), F16 / BF16 weights too (layers/half_weights.py).
KEPT_QUANTIZED_TYPES = (GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0,
                        GGMLQuantizationType.Q5_0, GGMLQuantizationType.Q5_1,
                        GGMLQuantizationType.F16, GGMLQuantizationType.BF16,
                        GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q6_K,
                        GGMLQuantizationType.IQ4_NL, GGMLQuantizationType.IQ4_XS)


class GGUFPackedWeight(PackedWeight):
    """A weight of a ``KEPT_QUANTIZED_TYPES`` type as stored: ``blocks`` is [rows, bytes per row]
    (a view of the file). The super-block formats' layouts are in pagoda/csrc/superblock_formats.h.

    Block layout (ggml-common.h): fp16 ``d``, for Q4_1 fp16 ``m``, then the codes: for the 4-bit
    types 16 bytes, element j in the low nibble of byte j and element j + 16 in the high nibble;
    for Q8_0 32 int8. ``Q4_0: w = d * (q - 8)``; ``Q4_1: w = d * q + m``; ``Q8_0: w = d * q``.
    """

    def __init__(self, ggml_type: GGMLQuantizationType, blocks: np.ndarray, shape: tuple[int, ...]) -> None:
        if ggml_type not in KEPT_QUANTIZED_TYPES:
            raise ValueError(f"{ggml_type.name} is not kept quantized (only {[t.name for t in KEPT_QUANTIZED_TYPES]})")
        self.ggml_type, self.blocks, self.shape = ggml_type, blocks, tuple(shape)
        self.int4_exact = ggml_type in (GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1)
        self.ggml_block_type = int(ggml_type)  # the GGMLQuantizationType values ggml_blocks uses

    def rows(self, start: int, stop: int) -> GGUFPackedWeight:
        return GGUFPackedWeight(self.ggml_type, self.blocks[start:stop], (stop - start, *self.shape[1:]))

    def ggml_blocks(self) -> torch.Tensor:
        """A copy of the stored rows (the file mapping is closed after loading); F16 / BF16 as
        [rows, columns] int16 holding the stored bits."""
        if self.ggml_type in (GGMLQuantizationType.F16, GGMLQuantizationType.BF16):
            return torch.from_numpy(np.array(self.blocks).view(np.int16).reshape(self.shape))
        return torch.from_numpy(np.array(self.blocks, dtype=np.uint8).reshape(self.shape[0], -1))

    def dequantize(self) -> torch.Tensor:
        w = np.asarray(dequantize(np.ascontiguousarray(self.blocks), self.ggml_type), dtype=np.float32)
        return torch.from_numpy(w.reshape(self.shape))

    def int4_groups(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if not self.int4_exact:
            return super().int4_groups()
        rows, cols = self.shape
        block_size, type_size = GGML_QUANT_SIZES[self.ggml_type]
        blocks = np.ascontiguousarray(self.blocks).reshape(rows, cols // block_size, type_size)
        d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
        header = 2 if self.ggml_type == GGMLQuantizationType.Q4_0 else 4
        qs = blocks[..., header:]
        codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(rows, cols)
        if self.ggml_type == GGMLQuantizationType.Q4_0:
            zero = np.zeros_like(d)  # d * (q - 8)
        else:
            m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
            zero = m + np.float32(8.0) * d  # d * q + m == d * (q - 8) + (m + 8 d)
        return torch.from_numpy(codes), torch.from_numpy(d), torch.from_numpy(zero)
