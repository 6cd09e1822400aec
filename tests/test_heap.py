"""pagoda/heap.py: a CPU engine's process keeps freed activations in glibc's heap, so the next
step does not fault their pages in again; the user's own malloc settings are kept."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pagoda import heap

# A prefill step's pattern at 1,024 tokens (SmolLM2's widths): each layer allocates its
# projections' outputs (the gate_up one 12.6 MB) and frees them as the next comes. Prints the MB
# that glibc's main heap holds free once a step's tensors are all gone: memory the next step's
# tensors take without asking the kernel for pages (which it zeroes and faults in one by one).
# Page-fault counts would say the same less reliably: with transparent huge pages one fault
# stands for 512 pages, so they vary between runs.
_STEPS = """
import ctypes, sys, torch
from pagoda import heap
if sys.argv[1] == "keep":
    print(heap.keep_freed_memory(), file=sys.stderr)
class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
mallinfo2 = ctypes.CDLL(None).mallinfo2
mallinfo2.restype = MallInfo2
T = 1024
def layer(x):
    qkv = torch.empty(T, 960).fill_(1.0)
    attn = torch.empty(T, 576).fill_(1.0); del qkv
    o = torch.empty(T, 576).fill_(1.0); del attn
    gate_up = torch.empty(T, 3072).fill_(1.0)
    down = torch.empty(T, 576).fill_(1.0); del gate_up, o
    return down
def step():
    x = torch.empty(T, 576).fill_(1.0)
    for _ in range(10):
        x = layer(x)
for _ in range(3):
    step()
print(mallinfo2().fordblks / 1e6)
"""

needs_glibc = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt and mallinfo2")


def _free_mb(mode: str, **env: str) -> float:
    clean = {k: v for k, v in os.environ.items() if k not in heap.USER_VARIABLES and k != "GLIBC_TUNABLES"}
    out = subprocess.run([sys.executable, "-c", _STEPS, mode], capture_output=True, text=True, check=True,
                         env={**clean, **env})
    return float(out.stdout.strip())


@needs_glibc
def test_freed_step_memory_stays_in_the_heap():
    # kept: at least a layer's outputs (gate_up 12.6 MB and the others) wait for the next step
    assert _free_mb("keep") > 15
    # a trim threshold of 0 (the user's, kept) hands everything back: the next step faults it in again
    assert _free_mb("keep", MALLOC_TRIM_THRESHOLD_="0") < 1


@needs_glibc
def test_user_settings_are_kept(monkeypatch):
    monkeypatch.setattr(heap, "_applied", None)
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "0")
    assert heap.keep_freed_memory() == "malloc as MALLOC_TRIM_THRESHOLD_ sets it"
    assert heap.keep_freed_memory() == "malloc as MALLOC_TRIM_THRESHOLD_ sets it"  # once a process
    monkeypatch.setattr(heap, "_applied", None)
    monkeypatch.delenv("MALLOC_TRIM_THRESHOLD_")
    monkeypatch.setenv("PAGODA_KEEP_FREED_MEMORY", "0")
    assert heap.keep_freed_memory() == "malloc as PAGODA_KEEP_FREED_MEMORY=0 sets it"


def test_a_cpu_engine_applies_it(tiny_llama, monkeypatch):
    from pagoda import LLM

    monkeypatch.setattr(heap, "_applied", None)
    for name in (*heap.USER_VARIABLES, "GLIBC_TUNABLES", "PAGODA_KEEP_FREED_MEMORY"):
        monkeypatch.delenv(name, raising=False)
    LLM(model=str(tiny_llama), kv_cache_memory=0.02)
    assert heap._applied == "malloc keeps up to 512 MiB freed, heap blocks up to 32 MiB"


_UNLOAD = """
import sys, torch
from pathlib import Path
from pagoda import heap
def rss_mb():
    line = next(l for l in Path("/proc/self/status").read_text().splitlines() if l.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024
heap.keep_freed_memory()
weights = [torch.ones(2 << 20) for _ in range(32)]  # a model's 256 MiB in 8 MiB tensors, from the heap
loaded = rss_mb()
del weights
kept = rss_mb()
heap.release_freed_memory()
print(loaded - kept, loaded - rss_mb())
"""


@needs_glibc
def test_an_unloaded_models_memory_goes_back_to_the_kernel():
    """The heap keeps freed memory for the next step; an unloaded model's weights it must give
    back (the model pool's unload calls release_freed_memory)."""
    clean = {k: v for k, v in os.environ.items() if k not in heap.USER_VARIABLES and k != "GLIBC_TUNABLES"}
    out = subprocess.run([sys.executable, "-c", _UNLOAD], capture_output=True, text=True, check=True, env=clean)
    given_back_on_free, given_back_on_release = map(float, out.stdout.split())
    assert given_back_on_free < 16 and given_back_on_release > 200, out.stdout
