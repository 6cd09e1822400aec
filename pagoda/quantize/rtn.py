"""Round to nearest: the baseline, and what llama.cpp's quantizer does.

Each block of 32 gets llama.cpp's parameters (Q4_0: the largest-magnitude value maps to code -8;
Q4_1: min and max; Q8_0: amax / 127) and every weight its nearest code. No calibration data.
The bytes come from the `gguf` package's reference quantizer (``gguf.quants``, bit-exact with
ggml-quants.c), so this baseline is exactly the file llama.cpp would make from the same weights.
"""

from __future__ import annotations

import numpy as np
import torch

from pagoda.loader.gguf_writer_tensors import quantize_weight
from pagoda.quantize.grid import check_shape


def rtn_blocks(weight: torch.Tensor, qtype: str) -> np.ndarray:
    """``weight`` [N, K] as ggml ``qtype`` bytes (uint8 [N, K / 32 * block bytes])."""
    check_shape(weight)
    return quantize_weight(weight.detach().float().numpy(), qtype)
