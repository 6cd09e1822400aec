"""Fuzzing `pagoda serve`, every API family: schemathesis over every route of /openapi.json,
schema-valid and schema-breaking bodies, then typical OpenAI SDK calls, valid and invalid; Ollama
bodies, generated and adversarial (template and schema bombs: quick 400s); gRPC messages
generated from the service's descriptors. No 5xx (gRPC: no INTERNAL / UNKNOWN), invalid SDK calls
raise openai.BadRequestError, /health never takes a second meanwhile, and afterwards nothing is
left running, waiting or holding a KV block, and /health is 200. tools/fuzz_server.py runs the
same for thousands of cases.

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
from server_process import _free_port, start_server

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import fuzz_server  # noqa: E402
from fuzz_grpc import fuzz_grpc  # noqa: E402
from fuzz_ollama import fuzz_ollama, run_adversarial  # noqa: E402

pytest.importorskip("schemathesis")

CASES_PER_ROUTE_AND_MODE = 20
SEED = 20261101
MODEL = "tiny"


@pytest.fixture(scope="module")
def server(tiny_llama):
    grpc_port = _free_port()
    # --session-ttl 2: a stored response the fuzzer makes keeps its prefix pinned until then
    proc, base = start_server(tiny_llama, "--max-model-len", "128", "--grpc-port", str(grpc_port), "--session-ttl", "2",
                              name=MODEL)
    log = fuzz_server.drain_log(proc)
    yield base, log, f"127.0.0.1:{grpc_port}"
    proc.terminate()
    proc.wait(timeout=30)


def _assert_idle_and_healthy(base: str) -> None:
    metrics = wait_idle(base, timeout=30)
    assert {name: metrics.get(name, 0.0) for name in IDLE_METRICS} == {name: 0 for name in IDLE_METRICS}
    assert httpx.get(f"{base}/health", timeout=10).status_code == 200


def test_schemathesis_every_route_no_5xx_nothing_left_behind(server):
    base, log, _ = server
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
    base, log, _ = server
    report = fuzz_server.run_sdk_cases(base, MODEL)
    print("\n".join(report.lines()))
    assert not report.failures, "\n".join(report.lines())
    assert report.statuses["sdk chat ok"][200] > 0 and report.statuses["sdk completions bad"][400] > 0
    _assert_idle_and_healthy(base)
    assert not any("Traceback" in line for line in log), "".join(log)[-3000:]


def _no_stalls(watch: fuzz_server.HealthWatch) -> None:
    assert watch.times and not watch.stalls and not watch.failures, watch.line()


def test_ollama_bodies_generated_no_5xx(server):
    base, log, _ = server
    with fuzz_server.HealthWatch(base) as watch:
        report = fuzz_ollama(base, MODEL, CASES_PER_ROUTE_AND_MODE, seed=SEED)
    print("\n".join(report.lines()), "\n" + watch.line())
    assert not report.failures, "\n".join(report.lines())
    statuses = sum(report.statuses.values(), start=Counter())
    assert statuses[200] > 0 and statuses[400] > 0 and statuses[404] > 0
    _no_stalls(watch)
    _assert_idle_and_healthy(base)
    assert not any("Traceback" in line for line in log), "".join(log)[-3000:]


def test_ollama_adversarial_bodies_are_quick_4xx_and_stall_nothing(server):
    base, log, _ = server
    with fuzz_server.HealthWatch(base) as watch:
        report = run_adversarial(base, MODEL)
    print("\n".join(report.lines()), "\n" + watch.line())
    assert not report.failures, "\n".join(report.lines())
    _no_stalls(watch)
    _assert_idle_and_healthy(base)


def test_grpc_generated_messages_no_internal_errors(server):
    base, log, grpc_target = server
    with fuzz_server.HealthWatch(base) as watch:
        report = fuzz_grpc(grpc_target, CASES_PER_ROUTE_AND_MODE, seed=SEED)
    print("\n".join(report.lines()), "\n" + watch.line())
    assert not report.failures, "\n".join(report.lines())
    assert {"grpc Generate", "grpc Chat", "grpc Tokenize", "grpc Detokenize", "grpc ListModels"} <= set(report.cases)
    statuses = sum(report.statuses.values(), start=Counter())
    assert statuses["OK"] > 0 and statuses["INVALID_ARGUMENT"] > 0
    _no_stalls(watch)
    _assert_idle_and_healthy(base)
    assert not any("Traceback" in line for line in log), "".join(log)[-3000:]
