"""`pagoda serve` sets its OpenMP threads' short spin (pagoda/threads.py) in every process that computes.

libgomp prints the settings it runs with when OMP_DISPLAY_ENV=VERBOSE, once per process that
loads it, so the server's own output says what is in effect there.
"""

from __future__ import annotations

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


def test_server_and_engine_process_spin_briefly(tiny_llama, monkeypatch):
    out = _served_output(tiny_llama, monkeypatch, "--engine-process")
    spin = f"GOMP_SPINCOUNT = '{threads.SERVER_SPIN_COUNT}'"
    assert out.count(spin) == 2, out  # the server process and its engine process
    assert f"GOMP_SPINCOUNT={threads.SERVER_SPIN_COUNT})" in out  # the start-up line says so


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
