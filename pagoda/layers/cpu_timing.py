"""Start-up measurements of this CPU, kept beside its kernel build.

Which route is faster (fp32 or bf16 for ``--dtype auto``, layers/dtype_choice.py; oneDNN on
packed fp32 weights or ``at::linear``, layers/packed_weights.py) depends on the CPU and is not
written in its flags, so it is timed on the first start on a kind of CPU and the record kept as a
JSON file in ``$PAGODA_HOME/kernels/<cpu>/``; later starts read it. A record carries the version
of its measurement and torch's: a change of either measures again.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from pathlib import Path

import torch

from pagoda.layers.cpu_kernels import build_directory

logger = logging.getLogger(__name__)

PROJECTION_SHAPES = ((1536, 576), (576, 1536))  # (N, K): SmolLM2-sized MLP projections, the suites' shapes


def best_ms(fn: Callable[[], object], trials: int = 15) -> float:
    """The fastest of several runs, in ms: the least disturbed by whatever else shares the CPU."""
    fn()
    best = float("inf")
    for _ in range(trials):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def record_path(name: str) -> Path:
    """This CPU's file ``name``, beside its kernel build (one directory per kind of CPU)."""
    return build_directory() / name


def kept_record(name: str, version: int, measure: Callable[[], dict]) -> tuple[dict, bool, Path]:
    """The record in this CPU's file ``name``, or a new one from ``measure()`` (which must set
    "version" and "torch"), written there; returns (record, whether measured now, the file)."""
    path = record_path(name)
    try:
        record = json.loads(path.read_text())
        if record.get("version") == version and record.get("torch") == torch.__version__:
            return record, False, path
    except (OSError, ValueError):
        pass
    record = measure()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(record, indent=1))
    except OSError as e:  # a read-only home: measure again next time
        logger.warning("could not keep the measurement in %s (%s)", path, e)
    return record, True, path
