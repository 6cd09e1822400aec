"""Fuzz the Ollama API family of a pagoda server: generated bodies for every Ollama route (valid
shapes with random values, then arbitrary JSON in every field), and the adversarial bodies the
hardening review found (template and schema bombs, oversized option lists, deeply nested JSON).

A case fails on a 5xx or no answer; an adversarial case also fails unless it is refused with a
4xx. tools/fuzz_server.py runs this beside the OpenAI and gRPC families and watches /health.
"""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
from hypothesis import HealthCheck, Phase, given, settings, strategies as st
from hypothesis import seed as hypothesis_seed

from fuzz_report import FuzzReport

JSON = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=40),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
                    max_leaves=12)
OPTIONS = st.fixed_dictionaries({}, optional={
    "temperature": st.floats(-1, 3), "top_p": st.floats(-0.5, 1.5), "top_k": st.integers(-5, 200),
    "min_p": st.floats(-0.5, 1.5), "seed": st.integers(-2**64, 2**64), "num_predict": st.integers(-2, 4),
    "stop": st.lists(st.text(max_size=8), max_size=6), "repeat_penalty": st.floats(-1, 3),
    "presence_penalty": st.floats(-3, 3), "frequency_penalty": st.floats(-3, 3), "num_ctx": st.integers(-1, 10**6)})
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system", "tool", "bogus"]),
                                 "content": st.text(max_size=60)})
FORMAT = st.none() | st.just("json") | st.text(max_size=10) | st.just({"type": "object"}) \
    | st.just({"type": "object", "properties": {"a": {"type": "integer", "maximum": 9}}})


def _bodies(model: str) -> dict[str, st.SearchStrategy]:
    """A strategy of schema-shaped bodies per route: the fields Ollama documents, random values."""
    common = {"options": OPTIONS, "stream": st.booleans(), "keep_alive": st.sampled_from(["5m", "10s", -1, "x"]),
              "format": FORMAT, "logprobs": st.booleans(), "top_logprobs": st.integers(-1, 30)}
    return {
        "/api/generate": st.fixed_dictionaries({"model": st.sampled_from([model, "no-such-model"])}, optional={
            "prompt": st.text(max_size=80), "system": st.text(max_size=40), "raw": st.booleans(),
            "template": st.sampled_from(["{{ .Prompt }}", "{{ .System }} {{ .Prompt }}", "{{ range .Messages }}x{{ end }}",
                                         "{{ if .System }}", "{{ .Nope }}"]),
            "context": st.lists(st.integers(-5, 70000), max_size=6), **common}),
        "/api/chat": st.fixed_dictionaries({"model": st.sampled_from([model, "no-such-model"]),
                                            "messages": st.lists(MESSAGE, max_size=4)}, optional={
            "tools": st.just([{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]),
            **common}),
        "/api/show": st.fixed_dictionaries({"model": st.sampled_from([model, "no-such-model", ""])},
                                           optional={"verbose": st.booleans()}),
    }


def _nested(depth: int) -> str:
    """JSON text of an object nested `depth` deep (as text: json.dumps itself recurses too deep)."""
    return '{"a": ' * depth + "1" + "}" * depth


def _deep_schema(depth: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def adversarial_cases(model: str) -> list[tuple[str, str, str, Any]]:
    """(label, method, path, body or raw text): each must be refused with a 4xx, quickly."""
    bomb = "{{ range .Messages }}" * 20 + "{{ .Content }}" + "{{ end }}" * 20
    return [
        ("template bomb", "POST", "/api/generate", {"model": model, "prompt": "hi", "template": bomb, "stream": False}),
        ("format 450 deep", "POST", "/api/generate", {"model": model, "prompt": "hi", "format": _deep_schema(450),
                                                       "stream": False}),
        ("chat format 300 deep", "POST", "/api/chat", {"model": model, "messages": [{"role": "user", "content": "x"}],
                                                        "format": _deep_schema(300), "stream": False}),
        ("100k stop strings", "POST", "/api/generate", {"model": model, "prompt": "hi", "stream": False,
                                                         "options": {"stop": [f"s{i}" for i in range(100_000)]}}),
        ("nested generate body", "POST", "/api/generate", f'{{"model": "{model}", "prompt": {_nested(5000)}}}'),
        ("nested create body", "POST", "/api/create", f'{{"model": "x", "files": {_nested(5000)}}}'),
        ("nested chat body", "POST", "/api/chat", "[" * 100_000 + "]" * 100_000),
    ]


def _call(client: httpx.Client, method: str, path: str, body: Any) -> httpx.Response:
    if isinstance(body, str):
        return client.request(method, path, content=body, headers={"content-type": "application/json"})
    return client.request(method, path, json=body)


def run_adversarial(base_url: str, model: str, headers: dict | None = None) -> FuzzReport:
    report = FuzzReport()
    start = time.monotonic()
    with httpx.Client(base_url=base_url, headers=headers, timeout=120) as client:
        for label, method, path, body in adversarial_cases(model):
            route = f"ollama adversarial {path}"
            began = time.monotonic()
            try:
                response = _call(client, method, path, body)
            except httpx.HTTPError as e:
                report.record(route, "no answer", f"{label}: {type(e).__name__}: {e}")
                continue
            took = time.monotonic() - began
            refused = 400 <= response.status_code < 500
            report.record(route, response.status_code, None if refused and took < 5 else
                          f"{label}: {response.status_code} in {took:.1f} s {response.text[:200]!r} (want a quick 4xx)")
    report.seconds = time.monotonic() - start
    return report


def _cap(path: str, body: dict) -> None:
    """A generated body generates little: num_predict capped (or set) where options is a dict."""
    if path == "/api/show":
        return
    options = body.setdefault("options", {"num_predict": 4})
    if isinstance(options, dict):
        options["num_predict"] = min(options["num_predict"], 4) if isinstance(options.get("num_predict"), int) else 4


def _runner(client: httpx.Client, report: FuzzReport, path: str, strategy: st.SearchStrategy, cases: int,
            seed: int | None):
    @settings(max_examples=cases, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck), print_blob=False)
    @given(body=strategy)
    def run(body) -> None:
        _cap(path, body)
        try:
            # json.dumps writes NaN / Infinity as JavaScript does: the server must refuse them
            response = client.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
        except httpx.HTTPError as e:
            report.record(f"POST {path}", "no answer", f"{type(e).__name__}: {e} for {str(body)[:300]}")
            return
        status = response.status_code
        report.record(f"POST {path}", status,
                      f"{status} {response.text[:300]!r} for {str(body)[:300]}" if status >= 500 else None)

    return hypothesis_seed(seed)(run) if seed is not None else run


def fuzz_ollama(base_url: str, model: str, cases: int, seed: int | None = None,
                headers: dict | None = None) -> FuzzReport:
    """`cases` schema-shaped bodies per route, then `cases` of arbitrary JSON in their fields."""
    report = FuzzReport()
    start = time.monotonic()
    arbitrary = st.dictionaries(st.sampled_from(["model", "prompt", "messages", "options", "format", "template",
                                                 "stream", "keep_alive", "context", "tools", "raw", "system"]),
                                JSON, max_size=6)
    with httpx.Client(base_url=base_url, headers=headers, timeout=60) as client:
        for path, shaped in _bodies(model).items():
            for strategy in (shaped, arbitrary):
                _runner(client, report, path, strategy, cases, seed)()
    report.seconds = time.monotonic() - start
    return report
