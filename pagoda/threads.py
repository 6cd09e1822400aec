"""How long torch's OpenMP worker threads spin after their work, set for `pagoda serve`.

torch's CPU kernels and pagoda's run on libgomp's thread team. When a parallel region ends, its
threads spin for GOMP_SPINCOUNT iterations of `pause` before they sleep: 300,000 by default, long
enough on a CPU whose `pause` is slow that while a model decodes they never sleep. libgomp cuts the
spin to 100 iterations by itself when a process has more OpenMP threads than CPUs: so it was while
the server loaded the model on its main thread and ran it on the engine thread (two teams), and
every parallel region of a step ended in a sleep and a wake-up (engine/core_client.py;
benchmarks/README.md, "On a quiet AVX-512 EPYC: the engine thread's second OpenMP team"). A
process with one team leader (the server, whose engine thread builds and runs the model;
`--engine-process`, `--data-parallel-size` replicas, LLM.generate) gets the full spin, and on cores
shared with the event loop, the client and other programs a spinning thread holds a core that the
thread it waits for needs, which slows one stream several times over (benchmarks/README.md, "One
stream through every path"). A spin of a few hundred iterations still bridges the microseconds
between two kernels of a step, then gives the core back.

On a quiet machine the short spin costs more than it saves: every region that a worker sleeps
through ends in a futex wake-up, so the full spin serves one stream and many faster
(benchmarks/README.md, "The OpenMP spin on a quiet machine"). So the server looks at the machine as
it starts: with under QUIET_LOAD_SHARE of its CPUs busy, and one engine team on the cores (no
data-parallel replicas or tensor-parallel ranks sharing them), it keeps the full spin
(QUIET_SPIN_COUNT, libgomp's default, written out so that a spawned engine process inherits the
same choice); otherwise the short one. The start-up line says which and why.

"Busy" is what the CPUs do now, sampled from /proc/stat over BUSY_SAMPLE_S, not the 1-minute load
average (used where there is no /proc/stat): the average still counts work that ended a minute
ago, so a server started right after an install, a build or another benchmark took the short
spin for its whole life, 10-16 % slower on one stream (benchmarks/README.md, "Prefetching the
tiles, and one stream again").

libgomp reads these variables once, when it is loaded (with torch), so `configure_server_openmp`
must run before torch is imported; spawned engine processes and replicas inherit them. A waiting
policy the user set (GOMP_SPINCOUNT or OMP_WAIT_POLICY) is kept.
"""

from __future__ import annotations

import logging
import os
import sys
import time

from pagoda import envs

logger = logging.getLogger(__name__)

# Iterations of `pause` a thread spins before it sleeps (benchmarks/one_stream.py measured 500 against
# 0 (OMP_WAIT_POLICY=PASSIVE), 2,000, 20,000 and the default).
SERVER_SPIN_COUNT = 500
# The spin kept on a quiet machine: libgomp's own default.
QUIET_SPIN_COUNT = 300_000
# A machine with under this share of its CPUs busy is quiet.
QUIET_LOAD_SHARE = 0.5
# Seconds over which the CPUs' busy share is sampled at the start.
BUSY_SAMPLE_S = 0.25
# Variables that already decide the waiting policy: with any of them set, the user's choice stands.
WAIT_POLICY_VARIABLES = ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")


def _cpu_times(cpus: set[int]) -> tuple[int, int] | None:
    """(busy, total) clock ticks of ``cpus`` since boot, from /proc/stat; None where it is missing."""
    try:
        with open("/proc/stat") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    busy = total = 0
    for line in lines:
        name, *fields = line.split() or [""]
        if not name.startswith("cpu") or not name[3:].isdigit() or int(name[3:]) not in cpus:
            continue  # the total line "cpu", and the lines that are not CPUs
        ticks = [int(v) for v in fields[:8]]  # user nice system idle iowait irq softirq steal
        total += sum(ticks)
        busy += sum(ticks) - ticks[3] - ticks[4]
    return (busy, total) if total else None


def busy_share(cpus: set[int], seconds: float = BUSY_SAMPLE_S) -> float | None:
    """The share of ``cpus``' time spent busy over the next ``seconds`` (this process sleeps
    meanwhile, so it is everything else's), or None where /proc/stat cannot say."""
    before = _cpu_times(cpus)
    if before is None:
        return None
    time.sleep(seconds)
    after = _cpu_times(cpus)
    if after is None or after[1] <= before[1]:
        return None
    return (after[0] - before[0]) / (after[1] - before[1])


def quiet_machine() -> tuple[bool, str]:
    """Whether the machine is quiet now (see the module docstring), and the figures that say so."""
    cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
    share = busy_share(cpus)
    if share is not None:
        return share < QUIET_LOAD_SHARE, f"{share:.0%} of {len(cpus)} CPUs busy"
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):  # no load average here: assume the cores are shared
        return False, "no load average"
    return load < QUIET_LOAD_SHARE * len(cpus), f"load average {load:.2f} on {len(cpus)} CPUs"


def choose_spin(shared_cores: bool) -> tuple[int, str]:
    """The spin count for a server's OpenMP threads, and why."""
    if shared_cores:
        return SERVER_SPIN_COUNT, "several engine processes share the cores"
    quiet, figures = quiet_machine()
    if quiet:
        return QUIET_SPIN_COUNT, f"quiet machine: {figures}"
    return SERVER_SPIN_COUNT, f"busy machine: {figures}"


_REASON_VARIABLE = "PAGODA_OPENMP_SPIN_REASON"  # why the spin was chosen, for the start-up line


def configure_server_openmp(shared_cores: bool = False) -> dict[str, str]:
    """Set GOMP_SPINCOUNT for a server process unless the user chose a waiting policy; returns
    what was set (empty when nothing was). ``shared_cores``: several engine teams will share the
    cores (data-parallel replicas, tensor-parallel ranks), so the spin stays short. Must run
    before torch is imported."""
    if any(name in os.environ for name in WAIT_POLICY_VARIABLES):
        return {}
    if "torch" in sys.modules:
        logger.warning("torch is already loaded: its OpenMP threads keep their default waiting policy")
        return {}
    spin, reason = choose_spin(shared_cores)
    os.environ["GOMP_SPINCOUNT"] = str(spin)
    os.environ[_REASON_VARIABLE] = reason
    return {"GOMP_SPINCOUNT": os.environ["GOMP_SPINCOUNT"]}


def openmp_settings() -> str:
    """The waiting policy in effect, for the start-up line: what the environment says, else libgomp's default."""
    chosen = [f"{name}={os.environ[name]}" for name in WAIT_POLICY_VARIABLES if name in os.environ]
    if chosen and envs.PAGODA_OPENMP_SPIN_REASON:
        chosen.append(envs.PAGODA_OPENMP_SPIN_REASON)
    return ", ".join(chosen) or "libgomp's default spin"
