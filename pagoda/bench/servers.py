"""Start a server to measure (pagoda, the naive transformers server, llama.cpp's) and wait until it answers."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pagoda_command(model: str, port: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "pagoda.cli", "serve", "--model", model, "--port", str(port),
            "--log-level", "warning", *extra]


def hf_naive_command(model: str, port: int, dtype: str = "auto") -> list[str]:
    return [sys.executable, "-m", "pagoda.bench.hf_server", "--model", model, "--port", str(port), "--dtype", dtype]


@contextlib.contextmanager
def running(cmd: list[str], port: int, *, ready_path: str = "/v1/models", timeout_s: float = 600) -> Iterator[str]:
    """Run `cmd` (a server on 127.0.0.1:port) until the block ends; yields its base URL.

    The server is ready when GET ready_path answers 200. Its output goes to a temporary file,
    shown in the error if it exits early.
    """
    with running_process(cmd, port, ready_path=ready_path, timeout_s=timeout_s) as (base, _proc):
        yield base


@contextlib.contextmanager
def running_process(cmd: list[str], port: int, *, ready_path: str = "/v1/models",
                    timeout_s: float = 600) -> Iterator[tuple[str, subprocess.Popen]]:
    """`running`, yielding the process too (a benchmark that reads the server's CPU time)."""
    base = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryFile(mode="w+") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ))
        try:
            deadline = time.monotonic() + timeout_s
            while True:
                if proc.poll() is not None:
                    log.seek(0)
                    raise RuntimeError(f"server exited with {proc.returncode}: {' '.join(cmd)}\n{log.read()[-2000:]}")
                try:
                    if httpx.get(base + ready_path, timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"server did not answer {ready_path} within {timeout_s:.0f} s: {' '.join(cmd)}")
                time.sleep(0.3)
            yield base, proc
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


# The gauges that say a server is idle: no request running or waiting, no KV block held by one.
IDLE_METRICS = ("pagoda:num_requests_running", "pagoda:num_requests_waiting", "pagoda:kv_cache_usage_perc")


def scrape_metrics(base_url: str) -> dict[str, float]:
    """A pagoda server's `pagoda:` samples of /metrics, summed over labels except the finish
    reason, which is kept as a suffix (`pagoda:request_success_total:abort`); histogram buckets
    and `_created` timestamps are left out."""
    out: dict[str, float] = {}
    for line in httpx.get(f"{base_url}/metrics", timeout=30).text.splitlines():
        if not line.startswith("pagoda:"):
            continue
        head, value = line.rsplit(" ", 1)
        name = head.split("{")[0]
        if "finished_reason=" in head:
            name += ":" + head.split('finished_reason="')[1].split('"')[0]
        if name.endswith(("_bucket", "_created")):
            continue
        out[name] = out.get(name, 0.0) + float(value)
    return out


def wait_idle(base_url: str, timeout: float = 60.0) -> dict[str, float]:
    """Poll /metrics until the server is idle (IDLE_METRICS all 0); returns the metrics then.
    TimeoutError with those gauges if it is not idle within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        metrics = scrape_metrics(base_url)
        idle = {name: metrics.get(name, 0.0) for name in IDLE_METRICS}
        if not any(idle.values()):
            return metrics
        if time.monotonic() > deadline:
            raise TimeoutError(f"the server is not idle after {timeout:g} s: {idle}")
        time.sleep(0.05)


def scrape_spec_decode(base_url: str) -> dict | None:
    """A pagoda server's speculative-decoding counters (per draft position too), as
    ``metrics.spec_summary`` takes them; None when the server has none (not pagoda, or no /metrics)."""
    names = {"pagoda:spec_decode_num_drafts_total": "num_drafts", "pagoda:spec_decode_num_draft_tokens_total": "draft_tokens",
             "pagoda:spec_decode_num_accepted_tokens_total": "accepted_tokens",
             "pagoda:spec_decode_draft_seconds_total": "draft_seconds",
             "pagoda:spec_decode_verify_seconds_total": "verify_seconds"}
    per_pos = {"pagoda:spec_decode_num_draft_tokens_per_pos_total": "draft_tokens_per_pos",
               "pagoda:spec_decode_num_accepted_tokens_per_pos_total": "accepted_tokens_per_pos"}
    try:
        text = httpx.get(f"{base_url}/metrics", timeout=10).text
    except httpx.HTTPError:
        return None
    out: dict = {key: 0.0 for key in names.values()} | {key: [] for key in per_pos.values()}
    found = False
    for line in text.splitlines():
        head, _, value = line.rpartition(" ")
        name = head.split("{")[0]
        if name in names:
            out[names[name]] += float(value)
            found = True
        elif name in per_pos:
            position = int(head.split('position="')[1].split('"')[0])
            values = out[per_pos[name]]
            values += [0.0] * (position + 1 - len(values))
            values[position] += float(value)
    return out if found else None
