"""glibc's heap told to keep freed memory for the next step (CPU engines).

A prefill step allocates and frees tens of megabytes of activations a layer: SmolLM2's gate_up
output alone is 25 MB at 2,048 tokens, and every projection's output, norm and attention buffer
is a fresh tensor. glibc's malloc hands memory back to the kernel when more than M_TRIM_THRESHOLD
lies free at the top of its heap, and serves requests above M_MMAP_THRESHOLD with their own
mmap, unmapped on free; both thresholds start at 128 KiB and move with what the program frees.
When a step's tensors were all freed at its end the heap was trimmed, and the next step faulted
every page in again, the kernel zeroing each one first: removing one allocation from each layer
(the fused down projection) moved that balance so far that a long prefill got markedly slower,
and the thresholds below won it back (benchmarks/README.md, "The AVX2-only EPYC, the evening").

So a CPU engine fixes both thresholds (which also stops glibc moving them): allocations up to
32 MiB, the most glibc accepts, come from the heap, and up to 512 MiB of free memory stays in it.
The cost is that a process keeps the largest step's working set once it has had it, as a caching
allocator does. Settings the user made (GLIBC_TUNABLES' glibc.malloc.*, MALLOC_*_ variables) are
kept, and PAGODA_KEEP_FREED_MEMORY=0 turns this off. Elsewhere than glibc this does nothing.
"""

from __future__ import annotations

import ctypes
import logging
import os

from pagoda import envs

logger = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # mallopt's parameters (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc's largest on 64-bit systems (HEAP_MAX_SIZE / 2)
TRIM_THRESHOLD = 512 << 20
USER_VARIABLES = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")

_applied: str | None = None  # what keep_freed_memory did, once it has run


def _user_choice() -> str | None:
    """The variable through which the user already tuned malloc, if any."""
    if not envs.PAGODA_KEEP_FREED_MEMORY:
        return "PAGODA_KEEP_FREED_MEMORY=0"
    if "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", ""):
        return "GLIBC_TUNABLES"
    return next((name for name in USER_VARIABLES if name in os.environ), None)


def keep_freed_memory() -> str:
    """Fix glibc's trim and mmap thresholds for this process (see the module docstring), once;
    returns what was done, for the logs."""
    global _applied
    if _applied is not None:
        return _applied
    choice = _user_choice()
    if choice is not None:
        _applied = f"malloc as {choice} sets it"
    else:
        try:
            mallopt = ctypes.CDLL(None).mallopt
        except (AttributeError, OSError):
            _applied = "malloc's own thresholds (not glibc)"
        else:
            mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
            ok = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
            _applied = (f"malloc keeps up to {TRIM_THRESHOLD >> 20} MiB freed, heap blocks up to "
                        f"{MMAP_THRESHOLD >> 20} MiB" if ok else "malloc's own thresholds (mallopt refused)")
    logger.debug("heap: %s", _applied)
    return _applied


def release_freed_memory() -> bool:
    """Give the kernel back every free page of glibc's heaps, whatever the thresholds above (an
    unloaded model's weights: the engine that kept its step's working set is gone); whether
    there was a glibc to ask."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (AttributeError, OSError):
        return False
    trim.argtypes, trim.restype = (ctypes.c_size_t,), ctypes.c_int
    trim(0)
    return True
