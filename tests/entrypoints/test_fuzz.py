"""Fuzzing `pagoda serve` (issue 11): schemathesis over every route of /openapi.json, schema-valid
and schema-breaking bodies, then typical OpenAI SDK calls, valid and invalid. No 5xx, invalid
SDK calls raise openai.BadRequestError, and afterwards nothing is left running, waiting or
holding a KV block, and /health is 200. tools/fuzz_server.py runs the same for thousands of cases.

Budget: ~20 generated cases per route and mode with a fixed seed (about half a minute of the
two CPUs here, most of it generating the cases); generation is capped per case (n <= 2,
max_tokens <= 4) and the context is 128 tokens, so no case generates for long."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import httpx
import pytest

from pagoda.bench.servers import IDLE_METRICS, wait_idle
from server_process import start_server

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import fuzz_server  # noqa: E402

pytest.importorskip("schemathesis")

CASES_PER_ROUTE_AND_MODE = 20
SEED = 20261101
MODEL = "tiny"


@pytest.fixture(scope="module")
def server(tiny_llama):
    proc, base = start_server(tiny_llama, "--max-model-len", "128", name=MODEL)
    log = fuzz_server.drain_log(proc)
    yield base, log
    proc.terminate()
    proc.wait(timeout=30)


def _assert_idle_and_healthy(base: str) -> None:
    metrics = wait_idle(base, timeout=30)
    assert {name: metrics.get(name, 0.0) for name in IDLE_METRICS} == {name: 0 for name in IDLE_METRICS}
    assert httpx.get(f"{base}/health", timeout=10).status_code == 200


def test_schemathesis_every_route_no_5xx_nothing_left_behind(server):
    base, log = server
    report = fuzz_server.fuzz_schema(base, CASES_PER_ROUTE_AND_MODE, seed=SEED)
    print("\n".join(report.lines()))
    assert not report.failures, "\n".join(report.lines())
    routes = {"POST /v1/completions", "POST /v1/chat/completions", "POST /tokenize", "POST /detokenize",
              "GET /v1/models", "GET /health", "GET /metrics", "GET /version"}
    assert routes <= set(report.cases), report.cases
    # Both kinds of outcome were reached: accepted bodies and refused ones.
    statuses = sum(report.statuses.values(), start=Counter())
    assert statuses[200] > 0 and statuses[400] > 0
    _assert_idle_and_healthy(base)
    assert not any("Traceback" in line for line in log), "".join(log)[-3000:]


def test_openai_sdk_bodies_valid_and_invalid(server):
    base, log = server
    report = fuzz_server.run_sdk_cases(base, MODEL)
    print("\n".join(report.lines()))
    assert not report.failures, "\n".join(report.lines())
    assert report.statuses["sdk chat ok"][200] > 0 and report.statuses["sdk completions bad"][400] > 0
    _assert_idle_and_healthy(base)
    assert not any("Traceback" in line for line in log), "".join(log)[-3000:]
