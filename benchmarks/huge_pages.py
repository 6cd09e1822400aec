"""One activation row through a 1B Q4_K_M's 64 projections and its head (the tiles, 710 MB, more than
the L3), with the same tiles in three kinds of memory, alternated in one process: anonymous memory
in 4 KiB pages (torch's allocation), anonymous memory advised 2 MiB pages (csrc/huge_pages.h, what
the repacking now returns), and a file's private mapping (what the repacked cache maps).

    python benchmarks/huge_pages.py [--rounds 6]

Prints GB/s (bytes of tiles / the best of 3 steps) per round and kind, and how much of this
process's memory 2 MiB pages back (AnonHugePages, FilePmdMapped).
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from superblock_data import TYPE_IDS, random_blocks  # noqa: E402

from pagoda.layers.cpu_kernels import load_cpu_kernels  # noqa: E402

LAYER = ((16384, 2048, "Q4_K"), (2048, 8192, "Q6_K"), (3072, 2048, "Q4_K"), (2048, 2048, "Q4_K"))
HEAD = (49152, 2048, "Q6_K")
HUGE = 2 << 20


def small_pages(t: torch.Tensor) -> torch.Tensor:
    """A copy in anonymous memory that does not ask for huge pages."""
    m = mmap.mmap(-1, t.numel(), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    libc = ctypes.CDLL("libc.so.6")
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.madvise(ctypes.addressof(ctypes.c_char.from_buffer(m)), t.numel(), 15)  # MADV_NOHUGEPAGE
    out = torch.frombuffer(m, dtype=torch.uint8)
    out.copy_(t)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    ops = load_cpu_kernels()
    torch.set_num_threads(2)
    rng = np.random.default_rng(0)
    shapes = [s for _ in range(16) for s in LAYER] + [HEAD]
    packed = [ops.superblock_repack([torch.from_numpy(random_blocks(q, n, k, rng))], [TYPE_IDS[q]], k)
              for n, k, q in shapes]
    folder = Path(tempfile.mkdtemp())
    mapped = []
    for i, t in enumerate(packed):
        path = folder / f"{i}.tiles"
        path.write_bytes(memoryview(t.numpy()))
        mapped.append(torch.from_file(str(path), shared=False, size=t.numel(), dtype=torch.uint8))
    kinds = {"4 KiB pages": [small_pages(t) for t in packed], "2 MiB pages": packed, "file mapping": mapped}
    total = sum(t.numel() for t in packed)
    xs = {k: torch.randn(1, k) for k in (2048, 8192)}

    def step(weights):
        for (n, k, _), w in zip(shapes, weights):
            ops.superblock_gemm(xs[k], w, n)

    for weights in kinds.values():
        step(weights)
    results = {kind: [] for kind in kinds}
    for _ in range(args.rounds):
        for kind, weights in kinds.items():
            best = float("inf")
            for _ in range(3):
                t = time.perf_counter()
                step(weights)
                best = min(best, time.perf_counter() - t)
            results[kind].append(total / best / 1e9)
    for kind, v in results.items():
        print(f"{kind:13s}", " ".join(f"{x:.1f}" for x in v), f"median {sorted(v)[len(v) // 2]:.1f} GB/s")
    meminfo = [line.strip() for line in open("/proc/meminfo") if line.startswith(("AnonHugePages", "FilePmdMapped"))]
    print("; ".join(meminfo))


if __name__ == "__main__":
    main()
