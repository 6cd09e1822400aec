"""`--dtype auto` on a CPU: float32 or bfloat16, whichever this CPU runs faster, measured.

A CPU's flags do not say which is faster: with AMX, bf16 matmuls are several times fp32's from a
few rows, but at one row (a single stream's decode) oneDNN's bf16 path is slower than pagoda's
fp32 kernel; on an AVX2-only CPU bf16 is emulated and slower everywhere (benchmarks/README.md,
"`--dtype auto` is measured"). So the first
start on a CPU times the two at the shapes of a small model's projections, at 1 row (one
stream's decode) and at 64 rows (a batch, a prefill chunk's slice), on one thread (threads that
other processes preempt make timings noise), and chooses bf16 only where it is at least 10 %
faster at both: fp32 stays the default wherever bf16 would slow one stream down, and it
is the exact one (greedy output equal to transformers'). The measurement (about a second) is
kept under ``$PAGODA_HOME/kernels/<cpu>/dtype-choice.json`` and reused by later starts.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.nn.functional as F

from pagoda.layers.backend import select_backend
from pagoda.layers.cpu_timing import PROJECTION_SHAPES, best_ms, kept_record, record_path
from pagoda.layers.packed_weights import BATCH_HINT, float_packing_pays

logger = logging.getLogger(__name__)

ROWS = (1, 64)
LAYERS = 8  # 8 layers of PROJECTION_SHAPES: 57 MB of fp32 weights, more than a CPU's last-level cache, so that
            # one row streams them from memory as a decode step does (where bf16's half bytes count)
MARGIN = 1.1  # bf16 must be at least this much faster: a noisy tie keeps the exact fp32
_VERSION = 2  # bump when the measurement changes, so that old choices are measured again
              # (2: fp32 on the packed copies where they pay)


CHOICE_FILE = "dtype-choice.json"  # beside this CPU's kernel build (one directory per kind of CPU)


def choice_path() -> Path:
    return record_path(CHOICE_FILE)


def measure() -> dict:
    """Milliseconds for the projection suite (LAYERS x PROJECTION_SHAPES, each output the next input) at
    each row count, fp32 (pagoda's CPU linear where its kernels load, with the packed copies
    where they pay, else torch) and bf16 (torch, oneDNN); and the choice they give."""
    backend = select_backend("cpu")
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, k, generator=g) * 0.05 for _ in range(LAYERS) for n, k in PROJECTION_SHAPES]
    # fp32 as the engine would run it: from 33 rows on copies packed for oneDNN where that measured faster
    packed = {id(w): torch.ops.mkldnn._reorder_linear_weight(w, BATCH_HINT) for w in weights} \
        if getattr(backend, "ops", None) is not None and float_packing_pays() else {}

    def fp32_linear(x, w):
        return backend.linear(x, w, packed.get(id(w)))

    suites = {"float32": (weights, fp32_linear), "bfloat16": ([w.to(torch.bfloat16) for w in weights], F.linear)}
    timings: dict[str, dict[int, float]] = {"float32": {}, "bfloat16": {}}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # per core: threads that other processes preempt make a timing noise
    try:
        for m in ROWS:
            x0 = torch.randn(m, PROJECTION_SHAPES[0][1], generator=g)
            for dtype, (ws, linear) in suites.items():
                def suite(ws=ws, linear=linear, x=x0.to(ws[0].dtype)):
                    for w in ws:
                        x = linear(x, w)
                timings[dtype][m] = best_ms(suite)
    finally:
        torch.set_num_threads(threads)
    faster = all(timings["bfloat16"][m] * MARGIN < timings["float32"][m] for m in ROWS)
    return {"version": _VERSION, "torch": torch.__version__, "threads": 1,
            "ms": {d: {str(m): t for m, t in by_rows.items()} for d, by_rows in timings.items()},
            "choice": "bfloat16" if faster else "float32"}


def _announced_measure() -> dict:
    # Said before it starts: on a first start this (and the kernel build it may trigger) is
    # most of a minute that would otherwise pass without a line.
    logger.warning("--dtype auto: timing fp32 against bf16 projections on this CPU (once; a few seconds)...")
    return measure()


def auto_cpu_dtype() -> torch.dtype:
    """The dtype `--dtype auto` means on this CPU: measured once, then read from its file."""
    record, measured, path = kept_record(CHOICE_FILE, _VERSION, _announced_measure)
    ms = record["ms"]
    logger.info("--dtype auto on this CPU: %s (%s; ms per projection suite at %s rows: fp32 %s, bf16 %s)",
                record["choice"], "measured now" if measured else f"measured before, {path}", "/".join(map(str, ROWS)),
                "/".join(f"{ms['float32'][str(m)]:.3f}" for m in ROWS),
                "/".join(f"{ms['bfloat16'][str(m)]:.3f}" for m in ROWS))
    return torch.bfloat16 if record["choice"] == "bfloat16" else torch.float32
