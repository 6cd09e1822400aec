"""The one place that asks which device this is and what it can do."""

from __future__ import annotations

import functools
import os
import platform

import torch

from pagoda import envs


@functools.cache
def cpu_flags() -> frozenset[str]:
    """CPU feature flags from /proc/cpuinfo (empty where it cannot be read)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (else what `platform` says), for benchmark records."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass

    return platform.processor()


# The flags a benchmark record keeps beside its numbers: the vector and matrix extensions.
BENCHMARK_FLAG_PREFIXES = ("avx", "fma", "amx", "sse4", "f16c")


def benchmark_cpu_flags() -> list[str]:
    return sorted(f for f in cpu_flags() if f.startswith(BENCHMARK_FLAG_PREFIXES))


def default_device() -> torch.device:
    if torch.cuda.is_available() and envs.PAGODA_DEVICE != "cpu":
        return torch.device("cuda")
    return torch.device("cpu")


def available_memory_bytes(device: torch.device) -> int:
    """Free memory on the device (CUDA) or available system memory (CPU)."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 << 30


def resident_memory_bytes() -> int:
    """This process's resident set size (Linux /proc; 0 where it cannot be read)."""
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0
