"""`pagoda serve` sets its OpenMP threads' spin (pagoda/threads.py) in every process that computes:
the full spin on a quiet machine with one engine team, else a short one.

libgomp prints the settings it runs with when OMP_DISPLAY_ENV=VERBOSE, once per process that
loads it, so the server's own output says what is in effect there.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import httpx
from server_process import start_server

from pagoda import threads


def _served_output(model_dir, monkeypatch, *flags: str, **env: str) -> str:
    """Everything a server printed (libgomp's settings included) around one completion."""
    for name in threads.WAIT_POLICY_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OMP_DISPLAY_ENV", "VERBOSE")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    proc, base = start_server(model_dir, *flags)
    try:
        body = {"model": "tiny", "prompt": "The quick brown fox", "max_tokens": 4, "temperature": 0}
        assert httpx.post(f"{base}/v1/completions", json=body, timeout=60).status_code == 200
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    return proc.stdout.read()


def test_server_and_engine_process_run_the_spin_chosen_at_start(tiny_llama, monkeypatch):
    out = _served_output(tiny_llama, monkeypatch, "--engine-process")
    chosen = [spin for spin in (threads.SERVER_SPIN_COUNT, threads.QUIET_SPIN_COUNT)
              if out.count(f"GOMP_SPINCOUNT = '{spin}'") == 2]  # the server process and its engine process
    assert len(chosen) == 1, out
    reason = "quiet machine" if chosen[0] == threads.QUIET_SPIN_COUNT else "busy machine"
    cpus = len(os.sched_getaffinity(0))
    # the start-up line says which and why
    assert re.search(rf"GOMP_SPINCOUNT={chosen[0]}, {reason}: \d+% of {cpus} CPUs busy", out), out


def test_the_spin_follows_the_machine_and_the_engine_teams(monkeypatch):
    cpus = len(os.sched_getaffinity(0))
    monkeypatch.setattr(threads, "busy_share", lambda cpus: 0.1)
    assert threads.choose_spin(shared_cores=False) == (threads.QUIET_SPIN_COUNT, f"quiet machine: 10% of {cpus} CPUs busy")
    assert threads.choose_spin(shared_cores=True)[0] == threads.SERVER_SPIN_COUNT  # replicas or ranks
    monkeypatch.setattr(threads, "busy_share", lambda cpus: threads.QUIET_LOAD_SHARE)
    spin, reason = threads.choose_spin(shared_cores=False)
    assert spin == threads.SERVER_SPIN_COUNT and reason.startswith("busy machine")

    # without /proc/stat, the 1-minute load average
    monkeypatch.setattr(threads, "busy_share", lambda cpus: None)
    monkeypatch.setattr(os, "getloadavg", lambda: (0.1 * cpus, 0.0, 0.0))
    assert threads.choose_spin(shared_cores=False) == (threads.QUIET_SPIN_COUNT,
                                                        f"quiet machine: load average {0.1 * cpus:.2f} on {cpus} CPUs")

    def unknown():
        raise OSError("no load average")

    monkeypatch.setattr(os, "getloadavg", unknown)
    assert threads.choose_spin(shared_cores=False) == (threads.SERVER_SPIN_COUNT, "busy machine: no load average")


def test_busy_share_sees_a_process_that_holds_a_cpu():
    """The share is what the CPUs do now: a process spinning on one CPU makes it busy, whatever
    the load average says."""
    cpu = min(os.sched_getaffinity(0))
    spinner = subprocess.Popen([sys.executable, "-c", f"import os; os.sched_setaffinity(0, {{{cpu}}}); "
                                "print('spinning', flush=True)\nwhile True: pass"], stdout=subprocess.PIPE, text=True)
    try:
        assert spinner.stdout.readline().strip() == "spinning"
        assert threads.busy_share({cpu}, 0.3) > 0.8
    finally:
        spinner.kill()
        spinner.wait()


def test_a_waiting_policy_the_user_set_is_kept(tiny_llama, monkeypatch):
    out = _served_output(tiny_llama, monkeypatch, GOMP_SPINCOUNT="12345")
    assert "GOMP_SPINCOUNT = '12345'" in out and f"GOMP_SPINCOUNT = '{threads.SERVER_SPIN_COUNT}'" not in out, out


def test_too_late_once_torch_is_loaded(monkeypatch):
    import torch  # noqa: F401 - loaded, as in this test process

    assert "torch" in sys.modules
    for name in threads.WAIT_POLICY_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    assert threads.configure_server_openmp() == {}
    assert "GOMP_SPINCOUNT" not in threads.openmp_settings()
