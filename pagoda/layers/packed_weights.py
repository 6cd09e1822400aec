"""Block-quantized weights packed once at load for the kernels, in one of two forms.

**Tiles** (``block_repack_tiles``, csrc/block_gemm_tiles.cpp): the codes of 16 weight rows side
by side, 4 elements a 32-bit lane, so that one ``vpdpbusd`` (or AVX2's maddubs + madd pair)
advances 16 outputs. ``block_matmul`` given that copy runs it at every row count, from one
stream's decode to a prefill chunk, faster than the other routes (benchmarks/README.md, "On the
AVX-512 EPYC: the tile GEMM on repacked blocks, attention key stretches"), and the copy takes the
blocks' own bytes.

**bf16** (where the build's many-row route is oneDNN's bf16 GEMM: AVX512-BF16 or AMX): the weight
dequantized to bf16 as ``block_matmul`` dequantizes it and reordered into oneDNN's layout
(``torch.ops.mkldnn._reorder_linear_weight``) once: from 16 rows ``block_matmul`` runs oneDNN on
it and on the activations it rounds, without the per-call dequantization and reordering; the
blocks stay for the rows below 16. That copy costs 2 bytes a weight (SmolLM2: ~270 MB beside ~90
MB of Q4_1 blocks).

Which one a kind of CPU gets (or none: the blocks alone) is measured on its first start
(``block_packing``, kept beside the kernel build): the faster at 64 rows, the tiles only if not
slower at one row than the blocks' own kernel. ``PAGODA_BLOCK_PACKING`` (``tiles`` / ``bf16`` /
``none``) names one. A copy is made only where the copies take at most a quarter of the memory
available when the model has loaded (and not with ``PAGODA_PACK_WEIGHTS=0``).

Float32 weights get the same treatment where it measures faster (``pack_float_linears``): from 33
rows ``pagoda::linear`` hands a GEMM to a library, by default MKL's sgemm, which on AMD CPUs runs
its AVX2 code, far below oneDNN on the same fp32 weights reordered once (benchmarks/README.md,
"fp32 against transformers on an AVX-512 EPYC"). Whether oneDNN wins is measured on the first
start on a kind of CPU (``float_packing_pays``, kept beside the kernel build), not read from the
vendor: on an Intel CPU the two can be close. The copy costs 4 bytes a weight, under
the same memory rule; rows up to 32, and every row count under deterministic inference, keep
``pagoda::linear``'s own kernel on the plain weight, so one stream's decode is unchanged.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from pagoda import envs
from pagoda.layers.cpu_timing import PROJECTION_SHAPES, best_ms, kept_record, record_path
from pagoda.layers.ggml_blocks import Q4_1, BlockLinear

logger = logging.getLogger(__name__)

MEMORY_SHARE = 0.25  # packed copies may take this share of the available memory, else none is made
BATCH_HINT = 64  # the row count oneDNN chooses its layout for (any row count runs on it)


def _can_reorder(ops) -> bool:
    """The kernels and torch's oneDNN weight reordering are both there."""
    return ops is not None and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def _switched_off(what: str) -> bool:
    """PAGODA_PACK_WEIGHTS=0 turns every packed copy off."""
    if not envs.PAGODA_PACK_WEIGHTS:
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


def bf16_packing_applies(ops) -> bool:
    """Whether this build's many-row route is a bf16 GEMM that an oneDNN-packed copy can serve."""
    if not _can_reorder(ops):
        return False
    try:
        _, dtype = ops.block_matmul_gemm()
    except (AttributeError, RuntimeError):
        return False
    return dtype == "bf16"


def tiles_packing_applies(ops) -> bool:
    """Whether this build has the GEMM on blocks repacked into tiles (every build of the kernels)."""
    try:
        return ops is not None and bool(ops.block_gemm_tiles_isa())
    except (AttributeError, RuntimeError):
        return False


BLOCK_ROWS = (1, 64)  # the row counts the forms are compared at: one stream's step, a batch's
ONE_ROW_MARGIN = 1.1  # the tiles may not be slower than this at one row than the blocks' own kernel
_BLOCK_VERSION = 2  # bump when the measurement changes
BLOCK_CHOICE_FILE = "block-packing-choice.json"  # beside this CPU's kernel build (layers/cpu_timing.py)
FORMS = ("tiles", "bf16", "none")  # "none": the blocks alone (integer kernel, then dequantize + a library GEMM)


def measure_block_packing(ops) -> dict:
    """Milliseconds for the two projections in Q4_1 at each of ``BLOCK_ROWS`` rows on one thread,
    on the blocks repacked into tiles and on the blocks without a copy (or, where the build's
    many-row route is bf16, its oneDNN copy). The faster at 64 rows is kept, but the tiles only if
    they are not slower at one row than the blocks' own kernel (one stream's decode)."""
    g = torch.Generator().manual_seed(0)
    linears = [BlockLinear.from_float(torch.randn(n, k, generator=g) * 0.05, Q4_1) for n, k in PROJECTION_SHAPES]
    forms = {"tiles": [_tiles(ops, m) for m in linears], "none": [None] * len(linears)}
    if bf16_packing_applies(ops):
        forms["bf16"] = [_bf16_copy(ops, m) for m in linears]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # per core: threads that other processes preempt make a timing noise
    ms: dict[str, dict[str, float]] = {}
    try:
        for rows in BLOCK_ROWS:
            xs = [torch.randn(rows, m.in_features, generator=g) for m in linears]
            for form, copies in forms.items():
                ms.setdefault(form, {})[str(rows)] = best_ms(
                    lambda copies=copies: [ops.block_matmul(x, m.blocks, m.block_type, c)
                                           for x, m, c in zip(xs, linears, copies)], trials=12)
    finally:
        torch.set_num_threads(threads)
    many = str(BLOCK_ROWS[-1])
    choice = min(ms, key=lambda form: ms[form][many])
    if choice == "tiles" and ms["tiles"]["1"] > ONE_ROW_MARGIN * ms["none"]["1"]:
        choice = min((f for f in ms if f != "tiles"), key=lambda form: ms[form][many])
    return {"version": _BLOCK_VERSION, "torch": torch.__version__, "threads": 1, "ms": ms, "form": choice}


def block_packing(ops, quiet: bool = False) -> str:
    """The form this build gives block weights: ``"tiles"``, ``"bf16"`` or ``"none"``. Measured
    once on a kind of CPU, unless PAGODA_BLOCK_PACKING names one (``quiet``: logged at debug level)."""
    applies = {"tiles": tiles_packing_applies(ops), "bf16": bf16_packing_applies(ops), "none": True}
    asked = envs.PAGODA_BLOCK_PACKING
    if asked:
        if not applies.get(asked):
            raise ValueError(f"PAGODA_BLOCK_PACKING={asked!r}: this build can pack block weights as "
                             f"{', '.join(f for f in FORMS if applies[f])}")
        return asked
    if not applies["tiles"]:
        return "bf16" if applies["bf16"] else "none"
    record, _, _ = kept_record(BLOCK_CHOICE_FILE, _BLOCK_VERSION, lambda: measure_block_packing(ops))
    log = logger.debug if quiet else logger.info  # progressive loading asks once a layer
    log("block weights on this CPU: %s (ms for the suite at %s rows: %s)", record["form"],
        "/".join(map(str, BLOCK_ROWS)),
        ", ".join(f"{f} {'/'.join(f'{v:.3f}' for v in t.values())}" for f, t in record["ms"].items()))
    return record["form"]


def packing_applies(ops) -> bool:
    """Whether block weights can get a packed copy in this build."""
    return tiles_packing_applies(ops) or bf16_packing_applies(ops)


def _tiles(ops, module: BlockLinear) -> torch.Tensor:
    return ops.block_repack_tiles(module.blocks, module.block_type, module.in_features)


def _bf16_copy(ops, module: BlockLinear) -> torch.Tensor:
    weight = ops.block_dequantize(module.blocks, module.block_type, module.in_features)
    return torch.ops.mkldnn._reorder_linear_weight(weight, BATCH_HINT)


def packed_bytes(model: nn.Module, form: str) -> int:
    """The bytes ``form``'s copies of ``model``'s block weights take (a tied head's counted twice)."""
    linears = [m for m in model.modules() if isinstance(m, BlockLinear)]
    if form == "tiles":  # as many bytes as the blocks, padded to whole tiles of 16 rows
        return sum((m.out_features + 15) // 16 * 16 * m.blocks.shape[1] for m in linears)
    return sum(2 * m.out_features * m.in_features for m in linears)


def pack_block_linears(model: nn.Module, ops, available_bytes: int, quiet: bool = False) -> int:
    """Give every BlockLinear of ``model`` its packed copy where it pays and fits; returns the
    bytes packed (0 when none was). ``quiet``: a part of a model (progressive loading packs one
    layer at a time, with its share of ``available_bytes``), logged at debug level."""
    if not packing_applies(ops) or not any(isinstance(m, BlockLinear) for m in model.modules()) \
            or _switched_off("block weights"):
        return 0
    form = block_packing(ops, quiet)
    if form == "none":
        return 0
    total = packed_bytes(model, form)
    if not _fits("block weights", total, available_bytes):
        return 0
    copy = _tiles if form == "tiles" else _bf16_copy
    seen: dict[int, torch.Tensor] = {}  # a tied head shares the embedding's blocks
    for module in model.modules():
        if isinstance(module, BlockLinear):
            key = module.blocks.data_ptr()
            if key not in seen:
                seen[key] = copy(ops, module)
            module.packed = seen[key]
    (logger.debug if quiet else logger.info)(
        "block weights packed once: %s, %.0f MiB",
        "repacked into tiles (every row count)" if form == "tiles" else "oneDNN bf16 layout (from 16 rows)",
        total / 2**20)
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


def pack_float_linears(model: nn.Module, ops, available_bytes: int, quiet: bool = False,
                       pays: bool | None = None) -> int:
    """Give ``model``'s float32 projections (and a tied head) oneDNN-packed copies where that
    measured faster on this CPU and fits; returns the bytes packed (0 when none was). ``quiet``:
    as ``pack_block_linears``'s; ``pays``: ``float_packing_pays()``'s answer when the caller
    already has it (progressive loading asks once for every layer)."""
    if not _can_reorder(ops):
        return 0
    found = _float_weights(model)
    total = sum(4 * w.numel() for _, w in found)
    if total == 0 or _switched_off("float32 weights") or not (float_packing_pays() if pays is None else pays) \
            or not _fits("float32 weights", total, available_bytes):
        return 0
    for module, weight in found:
        module.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), BATCH_HINT)
    (logger.debug if quiet else logger.info)("float32 weights packed once for oneDNN's GEMM (from 33 rows): %.0f MiB",
                                             total / 2**20)
    return total


def drop_packed_copies(model: nn.Module) -> None:
    """Forget every packed copy of ``model``'s weights, block and float, for code that is about to
    write the weights in place (the quantizer's calibration): a copy would keep the old values.
    A fused decode stack the model runs is built again, without them."""
    for module in model.modules():
        if isinstance(module, BlockLinear):
            module.packed = None  # its attribute (read on every call), kept
        else:
            module.__dict__.pop("packed", None)
    if getattr(model, "decode_stack", None) is not None:
        model.choose_forward()
