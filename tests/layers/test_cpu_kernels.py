"""Building and loading the C++ kernels across processes (pagoda/layers/cpu_kernels.py)."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys

import pytest

from pagoda.layers import cpu_kernels

LOAD = "from pagoda.layers.cpu_kernels import load_cpu_kernels; assert load_cpu_kernels() is not None"


def test_a_lock_left_by_a_killed_build_does_not_hang_the_next_start():
    """torch's `lock` file outlives a build killed mid-way (Ctrl-C on a first start); the next
    start used to wait on it forever without a word."""
    if os.environ.get("PAGODA_DISABLE_KERNELS") or cpu_kernels.load_cpu_kernels() is None:
        pytest.skip("the C++ kernels are not built here")
    build_dir = cpu_kernels.build_directory(cpu_kernels.kernel_isa_level())
    stale = build_dir / "lock"
    with open(build_dir / "pagoda.lock", "a") as handle:  # no other build of this directory meanwhile
        fcntl.flock(handle, fcntl.LOCK_EX)
        stale.touch()  # as torch's FileBaton leaves it when its holder dies
        fcntl.flock(handle, fcntl.LOCK_UN)
    try:
        proc = subprocess.run([sys.executable, "-c", LOAD], capture_output=True, text=True, timeout=180)
    except subprocess.TimeoutExpired:
        stale.unlink(missing_ok=True)  # leave the shared kernel directory usable for the rest of the suite
        pytest.fail("loading the kernels waited on the stale lock file")
    assert proc.returncode == 0, proc.stderr
    assert not stale.exists()
