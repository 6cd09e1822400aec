"""The input limits every API family shares (pagoda/entrypoints/input_limits.py, issue 41): Ollama's
`template` and `format`, `options`, deeply nested bodies and `chat_template_kwargs`, each refused
with a 400 that names the limit, fast, while `/health` keeps answering. Against one real server
of the tiny model (256-token context)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import pytest

from server_process import start_server, stop_process

MODEL = "tiny"
SLOW = 5.0  # a generous bound for "refused fast"; the real times are ~0.1-0.5 s
HEALTH_LIMIT = 1.0  # the most /health may take while a bomb is in flight


@pytest.fixture(scope="module")
def served(tiny_llama):
    proc, base = start_server(tiny_llama, name=MODEL)
    yield proc, base
    stop_process(proc)


@pytest.fixture(scope="module")
def server(served) -> str:
    return served[1]


class HealthWatch:
    """Polls /health on a thread while a request is in flight; `worst` is the slowest answer."""

    def __init__(self, server: str) -> None:
        self.server, self.worst, self.polls = server, 0.0, 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        with httpx.Client(timeout=300) as client:
            while not self._done.is_set():
                start = time.monotonic()
                assert client.get(f"{self.server}/health").status_code == 200
                self.worst = max(self.worst, time.monotonic() - start)
                self.polls += 1
                self._done.wait(0.02)

    def __enter__(self) -> HealthWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()


def _post(server: str, path: str, **kwargs) -> tuple[httpx.Response, float, float]:
    """The response, its time, and the slowest /health answer while it was in flight."""
    with HealthWatch(server) as health:
        start = time.monotonic()
        r = httpx.post(f"{server}{path}", timeout=300, **kwargs)
        elapsed = time.monotonic() - start
    return r, elapsed, health.worst


def _refused(r: httpx.Response, elapsed: float, health: float, words: str) -> str:
    """The error message of a fast 400 naming `words`, checked (Ollama's or OpenAI's shape)."""
    assert r.status_code == 400, r.text[:300]
    error = r.json()["error"]
    message = error if isinstance(error, str) else error["message"]
    assert words in message, message
    assert elapsed < SLOW, f"{elapsed:.1f} s"
    assert health < HEALTH_LIMIT, f"/health took {health:.2f} s"
    return message


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


# -- Ollama's `template` -------------------------------------------------------------------------
NESTED = "{{range $.Messages}}" * 20 + "{{.Content}}" + "{{end}}" * 20  # 2^20 copies of each message
SEQUENTIAL = "{{range $.Messages}}{{range $.Messages}}{{.Content}}{{end}}{{end}}" * 480  # 31 KB, nested twice
TEMPLATE_BOMBS = [
    ("20 nested ranges", {"prompt": "hi there", "system": "s", "template": NESTED}, "ranges nested more than 2 deep"),
    ("ranges rendering 6 MB", {"prompt": "lorem ipsum " * 250, "template": SEQUENTIAL},
     "more than this model's context of 256 tokens can hold"),
    ("a 40 KB template", {"prompt": "hi", "template": "{{ .Prompt }}" + "x" * 40_000},
     "template has 40013 characters, more than the limit of 32768"),
]


def _generate(body: dict) -> dict:
    return {"model": MODEL, "stream": False, "options": {"num_predict": 1}, **body}


@pytest.mark.parametrize("label, body, words", TEMPLATE_BOMBS, ids=[b[0] for b in TEMPLATE_BOMBS])
def test_template_bombs_are_a_fast_400(server, label, body, words):
    r, elapsed, health = _post(server, "/api/generate", json=_generate(body))
    _refused(r, elapsed, health, words)


def test_template_bombs_leave_memory_as_it_was(served):
    proc, server = served
    before = _rss_mib(proc.pid)
    for _ in range(3):
        for _, body, _ in TEMPLATE_BOMBS:
            assert httpx.post(f"{server}/api/generate", json=_generate(body), timeout=300).status_code == 400
    grown = _rss_mib(proc.pid) - before
    assert grown < 64, f"RSS grew by {grown:.0f} MiB over {3 * len(TEMPLATE_BOMBS)} template bombs"


def test_a_request_template_still_renders(server):
    template = '[S]{{ .System }}[U]{{ range .Messages }}{{ if eq .Role "user" }}{{ .Content }}{{ end }}{{ end }}[A]'
    body = _generate({"prompt": "hi there", "system": "be brief", "template": template})
    r = httpx.post(f"{server}/api/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    rendered = httpx.post(f"{server}/tokenize", json={"prompt": "[S]be brief[U]hi there[A]",
                                                      "add_special_tokens": False}).json()
    assert r.json()["prompt_eval_count"] == rendered["count"]


# -- JSON schemas: Ollama's `format`, /v1's structured outputs ------------------------------------
def _deep_schema(levels: int) -> dict:
    return json.loads('{"type": "object", "properties": {"a": ' * levels + '{"type": "integer"}' + "}}" * levels)


WIDE = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(8000)}}  # ~24,000 values
DEEP_TEXT = json.dumps(_deep_schema(300))
CHAT = [{"role": "user", "content": "hi"}]
SCHEMA_BOMBS = [
    ("generate: format 300 levels deep", "/api/generate",
     _generate({"prompt": "hi", "format": _deep_schema(300)}), "format is nested more than 64 levels deep"),
    ("chat: format 300 levels deep", "/api/chat",
     {"model": MODEL, "messages": CHAT, "stream": False, "format": _deep_schema(300)},
     "format is nested more than 64 levels deep"),
    ("generate: format with 24,000 values", "/api/generate", _generate({"prompt": "hi", "format": WIDE}),
     "format has more than 20000 JSON values"),
    ("v1: guided_json text 300 levels deep", "/v1/completions",
     {"prompt": "hi", "max_tokens": 1, "guided_json": DEEP_TEXT}, "guided_json is nested more than 64 levels deep"),
    ("v1: structured_outputs.json text 300 levels deep", "/v1/completions",
     {"prompt": "hi", "max_tokens": 1, "structured_outputs": {"json": DEEP_TEXT}},
     "structured_outputs.json is nested more than 64 levels deep"),
    ("v1: response_format with 24,000 values", "/v1/chat/completions",
     {"messages": CHAT, "max_tokens": 1, "response_format": {"type": "json_schema",
                                                              "json_schema": {"name": "x", "schema": WIDE}}},
     "response_format has more than 20000 JSON values"),
]


@pytest.mark.parametrize("label, path, body, words", SCHEMA_BOMBS, ids=[b[0] for b in SCHEMA_BOMBS])
def test_schema_bombs_are_a_fast_400(server, label, path, body, words):
    r, elapsed, health = _post(server, path, json=body)
    _refused(r, elapsed, health, words)


def test_a_slow_grammar_is_built_off_the_event_loop(server):
    # Within every limit, yet xgrammar takes seconds to build it (a repeat count in a pattern).
    schema = {"type": "object", "properties": {"code": {"type": "string", "pattern": "^a{4000}$"}}}
    body = {"messages": CHAT, "max_tokens": 1, "response_format": {"type": "json_schema",
                                                                   "json_schema": {"name": "x", "schema": schema}}}
    r, _, health = _post(server, "/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text[:300]
    assert health < HEALTH_LIMIT, f"/health took {health:.2f} s"


# -- options, nesting, chat_template_kwargs --------------------------------------------------------
def _deep_body(prefix: bytes, suffix: bytes = b"}") -> bytes:
    return prefix + b"[" * 100_000 + b"]" * 100_000 + suffix


JSON = {"content-type": "application/json"}
BODY_BOMBS = [
    ("100,000 stop strings", "/api/generate",
     {"json": _generate({"prompt": "hi", "options": {"num_predict": 1, "stop": [f"s{i}" for i in range(100_000)]}})},
     "options.stop may have at most 64 strings, got 100000"),
    ("options 100 levels deep", "/api/chat",
     {"json": {"model": MODEL, "messages": CHAT, "options": {"x": json.loads("[" * 100 + "]" * 100)}}},
     "options is nested more than 64 levels deep"),
    ("generate nested past the parser", "/api/generate",
     {"content": _deep_body(b'{"model": "tiny", "prompt": "hi", "x": '), "headers": JSON},
     "the body is not valid JSON: it is nested too deeply"),
    ("chat nested past the parser", "/api/chat",
     {"content": _deep_body(b'{"model": "tiny", "messages": [{"role": "user", "content": "hi", "x": ', b"}]}"),
      "headers": JSON}, "the body is not valid JSON: it is nested too deeply"),
    ("create nested past the parser", "/api/create",
     {"content": _deep_body(b'{"model": "m2", "from": "tiny", "parameters": {"x": ', b"}}"), "headers": JSON},
     "the body is not valid JSON: it is nested too deeply"),
    ("chat_template_kwargs sets messages", "/v1/chat/completions",
     {"json": {"messages": CHAT, "max_tokens": 1, "chat_template_kwargs": {"messages": []}}},
     "chat_template_kwargs may not set 'messages'"),
    ("chat_template_kwargs sets bos_token", "/v1/chat/completions",
     {"json": {"messages": CHAT, "max_tokens": 1, "chat_template_kwargs": {"bos_token": "<s>"}}},
     "chat_template_kwargs may not set 'bos_token'"),
]


@pytest.mark.parametrize("label, path, kwargs, words", BODY_BOMBS, ids=[b[0] for b in BODY_BOMBS])
def test_adversarial_bodies_are_a_fast_400(server, label, path, kwargs, words):
    r, elapsed, health = _post(server, path, **kwargs)
    _refused(r, elapsed, health, words)
    if path.startswith("/v1"):
        assert r.json()["error"]["param"] == "chat_template_kwargs"


def test_limits_leave_room_for_ordinary_requests(server):
    options = {"num_predict": 2, "stop": [f"s{i}" for i in range(64)]}
    r = httpx.post(f"{server}/api/generate", json=_generate({"prompt": "hi", "options": options}), timeout=60)
    assert r.status_code == 200, r.text
    r = httpx.post(f"{server}/api/generate", json=_generate({"prompt": "hi", "format": _deep_schema(20)}), timeout=60)
    assert r.status_code == 200, r.text
    r = httpx.post(f"{server}/v1/chat/completions", timeout=60, json={
        "messages": CHAT, "max_tokens": 1, "chat_template_kwargs": {"enable_thinking": False}})
    assert r.status_code == 200, r.text
