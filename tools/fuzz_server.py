"""Fuzz a pagoda server, one API family after another: OpenAI (schemathesis over every route of
its /openapi.json, then typical OpenAI SDK calls), Ollama (tools/fuzz_ollama.py: generated and
adversarial bodies) and gRPC (tools/fuzz_grpc.py: messages generated from the service's
descriptors); /health is timed throughout; then check that nothing was left behind.

    python tools/fuzz_server.py                       # a tiny random model, 300 cases per route and mode
    python tools/fuzz_server.py --cases 1000 --seed 7 --families openai,ollama,grpc
    python tools/fuzz_server.py --url http://127.0.0.1:8000 --model-name smollm2-135m-instruct --families openai,ollama

Passes when no request got a 5xx (or no answer; gRPC: INTERNAL / UNKNOWN), every SDK call did
what it should (invalid ones raise openai.BadRequestError / NotFoundError), every adversarial
body got a quick 4xx, /health never took over a second, and afterwards the server is idle: no
request running or waiting, no KV block in use, /health 200. Prints cases per route, statuses
seen and times. tests/entrypoints/test_fuzz.py runs the same, smaller.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from fuzz_report import FuzzReport
from pagoda.bench.servers import IDLE_METRICS, wait_idle

FAMILIES = ("openai", "ollama", "grpc")
STALL_S = 1.0  # a /health answer slower than this is a stall: something blocked the event loop

# Generated bodies may ask for up to n=128 choices of a context's worth of tokens each: valid,
# but seconds of CPU per case. The fuzz caps what a case may generate (the fields stay present,
# so their validation is still exercised).
GENERATION_CAPS = {"n": 2, "max_tokens": 4, "max_completion_tokens": 4, "min_tokens": 2}


def cap_generation(body: Any) -> None:
    """Lower, in place, the integer fields of a generated body that set how much it generates."""
    if not isinstance(body, dict):
        return
    for name, cap in GENERATION_CAPS.items():
        value = body.get(name)
        if type(value) is int and value > cap:
            body[name] = cap


# -- schemathesis ---------------------------------------------------------------------------
def fuzz_schema(base_url: str, cases_per_operation: int, seed: int | None = None,
                modes: tuple[str, ...] = ("positive", "negative"), timeout: float = 60.0,
                headers: dict | None = None) -> FuzzReport:
    """Every operation of the server's /openapi.json, `cases_per_operation` generated cases in
    each generation mode (schema-valid bodies, then bodies that break the schema). A case fails
    on a 5xx or on no answer at all. Failing cases are recorded, not shrunk, so a run stays
    within its case budget. `headers` go with every case (`Authorization: Bearer KEY`)."""
    import requests
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hypothesis_seed
    from hypothesis.errors import Unsatisfiable
    from schemathesis import GenerationMode

    schema = schemathesis.openapi.from_url(f"{base_url}/openapi.json")
    report = FuzzReport()
    session = requests.Session()
    start = time.monotonic()
    for result in schema.get_all_operations():
        operation = result.ok()
        route = f"{operation.method.upper()} {operation.path}"
        for mode in modes:
            strategy = operation.as_strategy(generation_mode=GenerationMode(mode))

            @settings(max_examples=cases_per_operation, deadline=None, database=None, phases=[Phase.generate],
                      suppress_health_check=list(HealthCheck), print_blob=False)
            @given(case=strategy)
            def run(case) -> None:
                cap_generation(case.body)
                try:
                    response = case.call(base_url=base_url, session=session, headers=headers, timeout=timeout)
                except requests.RequestException as e:
                    report.record(route, "no answer", f"{type(e).__name__}: {e} for {_describe(case)}")
                    return
                status = response.status_code
                report.record(route, status, f"{status} {response.text[:300]!r} for {_describe(case)}"
                              if status >= 500 else None)

            if seed is not None:
                run = hypothesis_seed(seed)(run)
            try:
                run()
            except Unsatisfiable:  # nothing to break: a GET without parameters has no negative case
                pass
    report.seconds = time.monotonic() - start
    return report


def _describe(case) -> str:
    body = repr(case.body)
    return f"{case.method} {case.formatted_path} body={body[:300]}{'...' if len(body) > 300 else ''}"


# -- the OpenAI SDK's typical bodies ----------------------------------------------------------
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]}}}
ASK = [{"role": "user", "content": "Hello there"}]


def sdk_cases(model: str) -> list[tuple[str, str, dict, str]]:
    """(label, endpoint, keyword arguments, expected): expected is "ok", "bad" (400), "missing"
    (404), or "ok-or-long": ok, or a 400 context_length_exceeded where the model's context cannot
    hold the prompt (tool definitions make a long one: ~500 tokens on the tiny test model). The
    valid ones are combinations an OpenAI SDK user writes; the invalid ones the mistakes they make."""
    ok_completions = [
        {"prompt": "Once upon a time", "max_tokens": 4},
        {"prompt": ["Hello", "Paris is"], "max_tokens": 3, "n": 2, "temperature": 0.7, "top_p": 0.9, "seed": 3},
        {"prompt": "Hi", "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}},
        {"prompt": "Hi", "max_tokens": 3, "logprobs": 2, "echo": True},
        {"prompt": "Hi", "max_tokens": 3, "stop": ["\n", "."], "presence_penalty": 0.5, "frequency_penalty": -0.5,
         "logit_bias": {"5": -100, "7": 3}, "user": "u-1"},
        {"prompt": [1, 5, 9], "max_tokens": 3, "temperature": 0},
        {"prompt": "Hi", "max_tokens": 4, "extra_body": {"top_k": 5, "min_p": 0.1, "repetition_penalty": 1.2,
                                                          "min_tokens": 2, "ignore_eos": True}},
        {"prompt": "Pick:", "max_tokens": 4, "extra_body": {"guided_choice": ["yes", "no"]}},
        {"prompt": "Hi", "max_tokens": 3, "best_of": 1, "suffix": "end"},
    ]
    ok_chat = [
        {"messages": ASK, "max_tokens": 4},
        {"messages": [{"role": "system", "content": "Be brief."}, *ASK, {"role": "assistant", "content": "Hi!"},
                      {"role": "user", "content": "Again"}], "max_completion_tokens": 4, "temperature": 0},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": " you"}]}],
         "max_tokens": 3},
        {"messages": ASK, "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}, "n": 2},
        {"messages": ASK, "max_tokens": 3, "logprobs": True, "top_logprobs": 2, "seed": 1},
        {"messages": ASK, "max_tokens": 8, "response_format": {"type": "json_object"}},
        {"messages": ASK, "max_tokens": 8, "response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "integer"}}}}}},
        {"messages": ASK, "max_tokens": 4, "tools": [WEATHER_TOOL]},
        {"messages": ASK, "max_tokens": 4, "tools": [WEATHER_TOOL], "tool_choice": "none"},
        {"messages": ASK, "max_tokens": 24, "tools": [WEATHER_TOOL], "tool_choice": "required",
         "parallel_tool_calls": False},
        {"messages": ASK, "max_tokens": 24, "tools": [WEATHER_TOOL], "stream": True,
         "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
        {"messages": [*ASK, {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}], "max_tokens": 4, "tools": [WEATHER_TOOL]},
        {"messages": ASK, "max_tokens": 3, "stop": "x", "presence_penalty": 1, "metadata": {"k": "v"}, "store": False,
         "service_tier": "auto", "user": "u"},
        {"messages": [{"role": "developer", "content": "Be brief."}, *ASK], "max_tokens": 3},
    ]
    bad_completions = [
        {"prompt": "Hi", "temperature": -1}, {"prompt": "Hi", "top_p": 2}, {"prompt": "Hi", "n": 0},
        {"prompt": "Hi", "n": 1000}, {"prompt": "Hi", "max_tokens": 0}, {"prompt": "Hi", "max_tokens": 10**6},
        {"prompt": "Hi", "logprobs": 50}, {"prompt": "Hi", "stop": [f"s{i}" for i in range(100)]},
        {"prompt": "Hi", "logit_bias": {str(i): 1 for i in range(2000)}}, {"prompt": "Hi", "logit_bias": {"abc": 1}},
        {"prompt": "hello " * 2000}, {"prompt": "Hi", "presence_penalty": 5}, {"prompt": "Hi", "seed": 2**70},
        {"prompt": []}, {"prompt": [[]]}, {"prompt": "Hi", "extra_body": {"guided_regex": "[0-9"}},
        {"prompt": "Hi", "extra_body": {"top_k": -5}},
    ]
    bad_chat = [
        {"messages": []}, {"messages": [{"role": "bogus", "content": "x"}]},
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]},
        {"messages": [{"role": "user", "content": "hello " * 2000}]}, {"messages": ASK, "top_logprobs": 50, "logprobs": True},
        {"messages": ASK, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
        {"messages": ASK, "tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        {"messages": ASK, "tools": [{"type": "function", "function": {}}]},
        {"messages": ASK, "tool_choice": "required"}, {"messages": ASK, "n": 129}, {"messages": ASK, "max_tokens": 10**6},
        {"messages": [{"role": "user", "content": 5}]}, {"messages": [{"role": "tool", "content": [{}]}]},
    ]
    cases = [(f"completions ok {i}", "completions", {"model": model, **kw}, "ok") for i, kw in enumerate(ok_completions)]
    cases += [(f"chat ok {i}", "chat", {"model": model, **kw}, "ok-or-long" if "tools" in kw else "ok")
              for i, kw in enumerate(ok_chat)]
    cases += [(f"completions bad {i}", "completions", {"model": model, "max_tokens": 3, **kw}, "bad")
              for i, kw in enumerate(bad_completions)]
    cases += [(f"chat bad {i}", "chat", {"model": model, "max_tokens": 3, **kw}, "bad") for i, kw in enumerate(bad_chat)]
    cases += [("unknown model completions", "completions", {"model": "no-such-model", "prompt": "Hi"}, "missing"),
              ("unknown model chat", "chat", {"model": "no-such-model", "messages": ASK}, "missing")]
    return cases


def run_sdk_cases(base_url: str, model: str, api_key: str = "unused") -> FuzzReport:
    """Each of sdk_cases through the openai package; a case fails if the outcome is not the
    expected one (a 5xx, a 422, a 400 for a valid call, a success for an invalid one)."""
    import openai

    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key=api_key, max_retries=0, timeout=60)
    calls: dict[str, Callable[..., Any]] = {"completions": client.completions.create,
                                             "chat": client.chat.completions.create}
    expected_error = {"bad": openai.BadRequestError, "missing": openai.NotFoundError}
    report = FuzzReport()
    start = time.monotonic()
    for label, endpoint, kwargs, expected in sdk_cases(model):
        route = f"sdk {endpoint} {expected}"
        try:
            result = calls[endpoint](**kwargs)
            if kwargs.get("stream"):
                list(result)
            ok = expected.startswith("ok")
            report.record(route, 200, None if ok else f"{label}: succeeded, expected {expected}")
        except openai.APIStatusError as e:
            wanted = expected_error.get(expected)
            too_long = expected == "ok-or-long" and e.status_code == 400 and e.code == "context_length_exceeded"
            wrong = not too_long and (wanted is None or not isinstance(e, wanted))
            report.record(route, e.status_code, f"{label}: {e.status_code} {e.message[:200]}" if wrong else None)
        except openai.APIError as e:
            report.record(route, "no answer", f"{label}: {type(e).__name__}: {e}")
    report.seconds = time.monotonic() - start
    return report


# -- /health while the fuzz runs ----------------------------------------------------------------
class HealthWatch:
    """Times /health every `every` seconds on a thread until stopped: the slowest answer and how
    many took over STALL_S (a request that blocks the event loop shows here)."""

    def __init__(self, base_url: str, every: float = 0.1) -> None:
        self.times: list[float] = []
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(base_url, every), daemon=True)

    def _run(self, base_url: str, every: float) -> None:
        with httpx.Client(timeout=30) as client:
            while not self._stop.wait(every):
                began = time.monotonic()
                try:
                    status = client.get(f"{base_url}/health").status_code
                except httpx.HTTPError as e:
                    self.failures.append(f"{type(e).__name__}: {e}")
                    continue
                self.times.append(time.monotonic() - began)
                if status != 200:
                    self.failures.append(f"/health {status}")

    def __enter__(self) -> "HealthWatch":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def stalls(self) -> int:
        return sum(t > STALL_S for t in self.times)

    def line(self) -> str:
        slowest = max(self.times, default=0.0)
        return (f"/health polled {len(self.times)} times: slowest {slowest * 1000:.0f} ms, {self.stalls} over "
                f"{STALL_S:g} s, {len(self.failures)} failed")


# -- afterwards --------------------------------------------------------------------------------
def drain_log(proc) -> list[str]:
    """Read a server subprocess's output on a thread (an unread pipe would fill and block the
    server); the returned list fills as lines arrive."""
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
    return lines


TESTS = Path(__file__).resolve().parents[1] / "tests"  # server_process and tiny_models: the suite's helpers


def _start_tiny_server(max_model_len: int, name: str, grpc: bool):
    """(process, base URL, gRPC address or None) of a server of the tiny random model."""
    sys.path.insert(0, str(TESTS))
    from server_process import _free_port, start_server
    from tiny_models import make_tiny_hf_model

    model_dir = make_tiny_hf_model("llama", Path(tempfile.mkdtemp(prefix="pagoda-fuzz-")) / "llama")
    grpc_port = _free_port() if grpc else None
    proc, base = start_server(model_dir, "--max-model-len", str(max_model_len),
                              *(["--grpc-port", str(grpc_port)] if grpc_port else []), name=name)
    return proc, base, f"127.0.0.1:{grpc_port}" if grpc_port else None


def run_families(base: str, families: tuple[str, ...], args, seed: int, grpc_target: str | None) -> list[FuzzReport]:
    """Each family's fuzz in turn, printing its report; returns them."""
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else None
    reports = []
    if "openai" in families:
        print(f"schemathesis: {args.cases} cases per route and mode ({args.modes}), seed {seed}", flush=True)
        reports.append(fuzz_schema(base, args.cases, seed, tuple(args.modes.split(",")), headers=headers))
        print("\n".join(reports[-1].lines()), flush=True)
        reports.append(run_sdk_cases(base, args.model_name, args.api_key or "unused"))
        print("openai SDK calls:\n" + "\n".join(reports[-1].lines()), flush=True)
    if "ollama" in families:
        from fuzz_ollama import fuzz_ollama, run_adversarial

        reports.append(fuzz_ollama(base, args.model_name, args.cases, seed, headers=headers))
        print("ollama bodies:\n" + "\n".join(reports[-1].lines()), flush=True)
        reports.append(run_adversarial(base, args.model_name, headers=headers))
        print("ollama adversarial bodies:\n" + "\n".join(reports[-1].lines()), flush=True)
    if "grpc" in families and grpc_target:
        from fuzz_grpc import fuzz_grpc  # grpcio and the generated stubs, only for this family

        reports.append(fuzz_grpc(grpc_target, args.cases, seed, api_key=args.api_key))
        print("grpc messages:\n" + "\n".join(reports[-1].lines()), flush=True)
    return reports


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="fuzz this running server (default: start one on a tiny random model)")
    ap.add_argument("--grpc", help="with --url: its gRPC address HOST:PORT (the grpc family)")
    ap.add_argument("--families", default=",".join(FAMILIES), help="API families to fuzz, comma-separated")
    ap.add_argument("--model-name", default="tiny", help="the served model name (for the SDK calls)")
    ap.add_argument("--cases", type=int, default=300, help="generated cases per route and generation mode")
    ap.add_argument("--seed", type=int, default=None, help="hypothesis seed (default: random, printed)")
    ap.add_argument("--modes", default="positive,negative")
    ap.add_argument("--max-model-len", type=int, default=128, help="context of the started server")
    ap.add_argument("--api-key", default=None, help="with --url: the key to send (Authorization: Bearer KEY)")
    args = ap.parse_args(argv)
    families = tuple(f for f in args.families.split(",") if f)
    if unknown := set(families) - set(FAMILIES):
        ap.error(f"unknown families {sorted(unknown)}; choose from {', '.join(FAMILIES)}")
    seed = args.seed if args.seed is not None else random.randrange(2**32)
    proc, log = None, []
    base, grpc_target = args.url, args.grpc
    if base is None:
        started = time.monotonic()
        proc, base, grpc_target = _start_tiny_server(args.max_model_len, args.model_name, "grpc" in families)
        log = drain_log(proc)
        print(f"server up in {time.monotonic() - started:.1f} s at {base}", flush=True)
    try:
        with HealthWatch(base) as health_watch:
            reports = run_families(base, families, args, seed, grpc_target)
        print(health_watch.line(), flush=True)
        started = time.monotonic()
        metrics = wait_idle(base, timeout=30)
        print(f"idle after {time.monotonic() - started:.2f} s: {({name: metrics.get(name, 0.0) for name in IDLE_METRICS})}")
        health = httpx.get(f"{base}/health", timeout=10).status_code
        print(f"/health: {health}")
        ok = not any(r.failures for r in reports) and health == 200 and not health_watch.stalls \
            and not health_watch.failures
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=60)
            tracebacks = sum("Traceback" in line for line in log)
            print(f"server log: {len(log)} lines, {tracebacks} tracebacks")
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
