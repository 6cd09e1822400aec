"""A real `pagoda serve --kv-offload-dir`, killed with SIGKILL after traffic (no shutdown, no flush),
restarted on the same directory: it answers the shared prefix from disk (cached tokens in usage)
with the greedy output it computed cold. Files caught mid-write by the kill are temporary ones,
never read (tests/core/test_kv_tiers.py holds the torn-file cases)."""

from __future__ import annotations

import time

import httpx

from server_process import start_server, stop_process

PROMPT = " ".join(f"line {i}: the quick brown fox jumps over the lazy dog" for i in range(6))  # ~160 tokens of a 256-token context
BLOCK = 16


def _complete(base: str) -> dict:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    answer = httpx.post(f"{base}/v1/completions", json=body, timeout=120)
    assert answer.status_code == 200, answer.text
    return answer.json()


def _wait_for_files(kv_dir, n: int, timeout: float = 60) -> None:
    """Poll (not sleep for a result) until the directory holds ``n`` block files."""
    deadline = time.monotonic() + timeout
    while len(list(kv_dir.glob("*/*.kv"))) < n:
        assert time.monotonic() < deadline, f"fewer than {n} block files in {kv_dir}"
        time.sleep(0.05)


def test_a_killed_server_answers_from_disk_after_a_restart(tiny_llama, tmp_path):
    kv_dir = tmp_path / "kv"
    proc, base = start_server(tiny_llama, "--kv-offload-dir", str(kv_dir))
    try:
        cold = _complete(base)
        prompt_tokens = cold["usage"]["prompt_tokens"]
        whole = (prompt_tokens - 1) // BLOCK  # the prompt's blocks a later request can hit
        assert whole >= 4
        # the writes are in the background: wait until the prompt's files are there (polled)
        _wait_for_files(kv_dir, whole)
    finally:
        proc.kill()  # SIGKILL: no graceful shutdown, no final flush
        proc.wait()
    proc, base = start_server(tiny_llama, "--kv-offload-dir", str(kv_dir))
    try:
        warm = _complete(base)
    finally:
        stop_process(proc)
    assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] == whole * BLOCK
    assert warm["choices"][0]["text"] == cold["choices"][0]["text"]
    assert cold["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0) in (0, None)
