"""Hand-written CPU kernels (pagoda/csrc), compiled on first use with torch's C++ extension
builder and cached (under $PAGODA_HOME/kernels). Where no compiler is available, callers fall
back to the pure-torch path; PAGODA_DISABLE_KERNELS=1 forces that fallback."""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).resolve().parent.parent / "csrc"


@functools.cache
def load_cpu_kernels():
    """The compiled module, or None when kernels are disabled or cannot be built here."""
    if os.environ.get("PAGODA_DISABLE_KERNELS", "") not in ("", "0"):
        return None
    try:
        from torch.utils.cpp_extension import load

        from pagoda.loader.catalog import pagoda_home

        build_dir = pagoda_home() / "kernels"
        build_dir.mkdir(parents=True, exist_ok=True)
        load(
            name="pagoda_cpu_kernels",
            sources=[str(_CSRC / "paged_attention.cpp")],
            extra_cflags=["-O3", "-march=native", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            build_directory=str(build_dir),
            verbose=False,
            is_python_module=False,  # registers torch.ops.pagoda.*
        )
        import torch

        return torch.ops.pagoda
    except Exception as e:  # no compiler, no ninja, ...
        logger.warning("CPU attention kernel unavailable (%s); using the torch SDPA path", e)
        return None
