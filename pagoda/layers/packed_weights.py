"""Block-quantized weights packed once at load for the many-row GEMM (prefill chunks, batches).

From 16 rows, ``block_matmul`` dequantizes a GGUF / int8 / int4 weight to bf16 and runs oneDNN's
GEMM (AMX tiles on a Sapphire Rapids); done on every call, the dequantization and oneDNN's own
reordering of the weight into its blocked layout took more than half of a batch-64 projection
(benchmarks/README.md, "Matmul kernels"). Here each ``BlockLinear`` keeps a second copy, its
weight dequantized as ``block_matmul`` dequantizes it and reordered into oneDNN's layout
(``torch.ops.mkldnn._reorder_linear_weight``) once, and those calls (``CpuKernelBackend.block_matmul``)
run ``torch.ops.mkldnn._linear_pointwise`` on it and on the activations rounded as
``block_matmul`` rounds them (``block_gemm_activations``): the same products, without the
per-call work. The
blocks stay for the rows below 16 (the integer kernel, memory-bound, reads the fewest bytes).

The copy costs 2 bytes a weight (SmolLM2: ~270 MB beside ~90 MB of Q4_1 blocks), so it is made
only where the build's GEMM is bf16, oneDNN is there, and the copies take at most a quarter of
the memory available when the model has loaded (and not with ``PAGODA_PACK_WEIGHTS=0``).
"""

from __future__ import annotations

import logging
import os

import torch
from torch import nn

from pagoda.layers.ggml_blocks import BlockLinear

logger = logging.getLogger(__name__)

MEMORY_SHARE = 0.25  # packed copies may take this share of the available memory, else none is made
BATCH_HINT = 64  # the row count oneDNN chooses its layout for (any row count runs on it)


def packing_applies(ops) -> bool:
    """Whether this build's many-row route is a bf16 GEMM that packed weights can serve."""
    if ops is None or not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        return False
    try:
        _, dtype = ops.block_matmul_gemm()
    except (AttributeError, RuntimeError):
        return False
    return dtype == "bf16"


def packed_bytes(model: nn.Module) -> int:
    return sum(2 * m.out_features * m.in_features for m in model.modules() if isinstance(m, BlockLinear))


def pack_block_linears(model: nn.Module, ops, available_bytes: int) -> int:
    """Give every BlockLinear of ``model`` its packed copy where it pays and fits; returns the
    bytes packed (0 when none was)."""
    if not packing_applies(ops):
        return 0
    if os.environ.get("PAGODA_PACK_WEIGHTS", "1") == "0":
        logger.info("block weights not packed (PAGODA_PACK_WEIGHTS=0)")
        return 0
    total = packed_bytes(model)
    if total == 0:
        return 0
    if total > MEMORY_SHARE * available_bytes:
        logger.info("block weights not packed for the many-row GEMM: %.0f MiB would pass %d %% of the %.0f MiB "
                    "available", total / 2**20, MEMORY_SHARE * 100, available_bytes / 2**20)
        return 0
    seen: dict[int, torch.Tensor] = {}  # a tied head shares the embedding's blocks
    for module in model.modules():
        if isinstance(module, BlockLinear):
            key = module.blocks.data_ptr()
            if key not in seen:
                weight = ops.block_dequantize(module.blocks, module.block_type, module.in_features)
                seen[key] = torch.ops.mkldnn._reorder_linear_weight(weight, BATCH_HINT)
            module.packed = seen[key]
    logger.info("block weights packed once for the many-row GEMM (oneDNN bf16 layout): %.0f MiB", total / 2**20)
    return total
