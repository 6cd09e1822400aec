"""Block-quantized weights packed once at load for the many-row GEMM (prefill chunks, batches).

From 16 rows, ``block_matmul`` dequantizes a GGUF / int8 / int4 weight to bf16 and runs oneDNN's
GEMM (AMX tiles on a Sapphire Rapids); done on every call, the dequantization and oneDNN's own
reordering of the weight into its blocked layout took more than half of a batch-64 projection
(benchmarks/README.md, "Matmul kernels"). Here each ``BlockLinear`` keeps a second copy, its
weight dequantized as ``block_matmul`` dequantizes it and reordered into oneDNN's layout
(``torch.ops.mkldnn._reorder_linear_weight``) once, and ``block_matmul`` given it (its ``packed``
argument, as ``pagoda::linear`` takes a float weight's copy) runs oneDNN on it and on the
activations it rounds as before: the same products, without the per-call work. The
blocks stay for the rows below 16 (the integer kernel, memory-bound, reads the fewest bytes).

The copy costs 2 bytes a weight (SmolLM2: ~270 MB beside ~90 MB of Q4_1 blocks), so it is made
only where the build's GEMM is bf16, oneDNN is there, and the copies take at most a quarter of
the memory available when the model has loaded (and not with ``PAGODA_PACK_WEIGHTS=0``).

Float32 weights get the same treatment where it measures faster (``pack_float_linears``): from 33
rows ``pagoda::linear`` hands a GEMM to a library, by default MKL's sgemm, which on AMD CPUs runs
its AVX2 code (measured on an AVX-512 EPYC: ~95 GFLOP/s a thread at SmolLM2's shapes, against
oneDNN's ~230 on the same fp32 weights reordered once). Whether oneDNN wins is measured on the
first start on a kind of CPU (``float_packing_pays``, kept beside the kernel build), not read from
the vendor: on a Sapphire Rapids the two were within ~10 %. The copy costs 4 bytes a weight, under
the same memory rule; rows up to 32, and every row count under deterministic inference, keep
``pagoda::linear``'s own kernel on the plain weight, so one stream's decode is unchanged.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.layers.cpu_timing import PROJECTION_SHAPES, best_ms, kept_record, record_path
from pagoda.layers.ggml_blocks import BlockLinear

logger = logging.getLogger(__name__)

MEMORY_SHARE = 0.25  # packed copies may take this share of the available memory, else none is made
BATCH_HINT = 64  # the row count oneDNN chooses its layout for (any row count runs on it)


def _can_reorder(ops) -> bool:
    """The kernels and torch's oneDNN weight reordering are both there."""
    return ops is not None and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def _switched_off(what: str) -> bool:
    """PAGODA_PACK_WEIGHTS=0 turns every packed copy off."""
    if os.environ.get("PAGODA_PACK_WEIGHTS", "1") == "0":
        logger.info("%s not packed (PAGODA_PACK_WEIGHTS=0)", what)
        return True
    return False


def _fits(what: str, total: int, available_bytes: int) -> bool:
    """The copies may take at most MEMORY_SHARE of the memory available once the model has loaded."""
    if total > MEMORY_SHARE * available_bytes:
        logger.info("%s not packed: %.0f MiB would pass %d %% of the %.0f MiB available", what, total / 2**20,
                    MEMORY_SHARE * 100, available_bytes / 2**20)
        return False
    return True


def packing_applies(ops) -> bool:
    """Whether this build's many-row route is a bf16 GEMM that packed weights can serve."""
    if not _can_reorder(ops):
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
    total = packed_bytes(model)
    if total == 0 or _switched_off("block weights") or not _fits("block weights", total, available_bytes):
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


# -- float32 weights -------------------------------------------------------------------------

FLOAT_ROWS = 64  # a batch's decode step, a prefill chunk's slice
FLOAT_MARGIN = 1.1  # oneDNN must be at least this much faster than at::linear: a noisy tie keeps one copy
_FLOAT_VERSION = 1  # bump when the measurement changes


def packed_of(module: nn.Module) -> torch.Tensor | None:
    """A float module's packed copy, or None. Read from the instance dict: ``nn.Module.__getattr__``
    (what ``getattr`` falls back to for a missing name) costs a microsecond per projection per step."""
    return module.__dict__.get("packed")


FLOAT_CHOICE_FILE = "float-gemm-choice.json"  # beside this CPU's kernel build (layers/cpu_timing.py)


def float_choice_path() -> Path:
    return record_path(FLOAT_CHOICE_FILE)


def measure_float_gemm() -> dict:
    """Milliseconds for the two projections at ``FLOAT_ROWS`` rows on one thread: at::linear (the
    plain weight) and oneDNN on the weight reordered once; and whether the copy pays."""
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, k, generator=g) * 0.05 for n, k in PROJECTION_SHAPES]
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, BATCH_HINT) for w in weights]
    xs = [torch.randn(FLOAT_ROWS, w.shape[1], generator=g) for w in weights]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # per core: threads that other processes preempt make a timing noise
    try:
        library = best_ms(lambda: [F.linear(x, w) for x, w in zip(xs, weights)], trials=12)
        onednn = best_ms(lambda: [torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")
                                  for x, p in zip(xs, packed)], trials=12)
    finally:
        torch.set_num_threads(threads)
    return {"version": _FLOAT_VERSION, "torch": torch.__version__, "threads": 1, "rows": FLOAT_ROWS,
            "ms": {"at::linear": library, "onednn_packed": onednn}, "pack": onednn * FLOAT_MARGIN < library}


def float_packing_pays() -> bool:
    """Whether oneDNN on packed fp32 weights beats at::linear on this CPU: measured once (well
    under a second), then read from its file."""
    record, _, _ = kept_record(FLOAT_CHOICE_FILE, _FLOAT_VERSION, measure_float_gemm)
    ms = record["ms"]
    logger.info("float32 GEMM from 33 rows on this CPU: %s (ms for the suite at %d rows: at::linear %.3f, "
                "oneDNN packed %.3f)", "oneDNN on weights packed at load" if record["pack"] else "at::linear",
                record["rows"], ms["at::linear"], ms["onednn_packed"])
    return bool(record["pack"])


def _float_weights(model: nn.Module) -> list[tuple[nn.Module, torch.Tensor]]:
    """The float32 weights ``pagoda::linear`` multiplies: every bias-free ``nn.Linear``'s (as
    layers/linear.py routes them) and a tied output head's embedding."""
    found = [(m, m.weight) for m in model.modules() if type(m) is nn.Linear and m.bias is None]
    embed = getattr(model, "embed_tokens", None)
    if getattr(model, "lm_head", False) is None and isinstance(embed, nn.Embedding):  # tied (models/llama.py)
        found.append((embed, embed.weight))
    return [(m, w) for m, w in found if w.dtype == torch.float32 and w.dim() == 2 and w.is_contiguous()
            and w.device.type == "cpu"]


def pack_float_linears(model: nn.Module, ops, available_bytes: int) -> int:
    """Give ``model``'s float32 projections (and a tied head) oneDNN-packed copies where that
    measured faster on this CPU and fits; returns the bytes packed (0 when none was)."""
    if not _can_reorder(ops):
        return 0
    found = _float_weights(model)
    total = sum(4 * w.numel() for _, w in found)
    if total == 0 or _switched_off("float32 weights") or not float_packing_pays() \
            or not _fits("float32 weights", total, available_bytes):
        return 0
    for module, weight in found:
        module.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), BATCH_HINT)
    logger.info("float32 weights packed once for oneDNN's GEMM (from 33 rows): %.0f MiB", total / 2**20)
    return total


def drop_packed_copies(model: nn.Module) -> None:
    """Forget every packed copy of ``model``'s weights, block and float, for code that is about to
    write the weights in place (the quantizer's calibration): a copy would keep the old values.
    The model's one-call stack is built again on its next step, without them."""
    for module in model.modules():
        if isinstance(module, BlockLinear):
            module.packed = None  # its attribute (read on every call), kept
        else:
            module.__dict__.pop("packed", None)
    if hasattr(model, "_stack_key"):
        model._stack_key = None
