"""Where programs run: the in-process engine (`Engine`) or a pagoda server (`Endpoint`).

Both offer `generate(prompt, gen) -> Generated` (blocking; safe to call from many threads at
once: the in-process engine batches concurrent calls), `prefill(prompt)` (compute a prompt's
KV so later requests share it through the prefix cache) and `role_markers(role)`.

`session_id` (optional, on `generate` and `prefill`) marks a request as a turn of a
conversation: the engine keeps what it computed pinned in the prefix cache for the session's
next turn, until `Engine.release_session`. `Endpoint` sends it as the `X-Session-ID` header
(the router's affinity header).
"""

from __future__ import annotations

import json
import threading
import uuid
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable

from pagoda.lang.ir import Gen
from pagoda.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

_MARK = "PAGODA_CONTENT_MARK"


@dataclass
class Generated:
    text: str
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens served from the prefix cache


def constraint_of(g: Gen) -> StructuredOutputsParams | None:
    if g.regex is not None:
        return StructuredOutputsParams(regex=g.regex)
    if g.choices is not None:
        return StructuredOutputsParams(choice=g.choices)
    if g.json_schema is not None:
        return StructuredOutputsParams(json=g.json_schema)
    return None


def role_markers_from(render: Callable[[list[dict], bool], str], role: str) -> tuple[str, str]:
    """The text a chat template writes before and after a `role` turn's content, found by
    rendering a conversation with and without a marked turn."""
    history = {"system": [], "user": [{"role": "system", "content": "S"}],
               "assistant": [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]}.get(role)
    if history is None:
        raise ValueError(f"unknown role {role!r}; use system, user or assistant")
    base = render(history, False) if history else ""
    full = render(history + [{"role": role, "content": _MARK}], False)
    if not full.startswith(base) or _MARK not in full:
        raise ValueError(f"cannot find the {role} turn's markers in this chat template")
    prefix, suffix = full[len(base):].split(_MARK, 1)
    return prefix, suffix


class Engine:
    """The in-process engine, driven by a background thread so concurrent programs batch."""

    def __init__(self, model: str | None = None, *, llm=None, **engine_kwargs) -> None:
        if llm is None:
            from pagoda import LLM  # deferred: loads torch (only the in-process engine needs it)

            llm = LLM(model=model, **engine_kwargs)
        self.llm = llm
        self._engine = llm.engine
        self._lock = threading.Lock()  # guards _pending (the engine locks itself)
        self._wake = threading.Event()
        self._pending: dict[str, Future] = {}
        self._markers: dict[str, tuple[str, str]] = {}
        threading.Thread(target=self._loop, name="pagoda-lang-engine", daemon=True).start()

    def generate(self, prompt: str, g: Gen, session_id: str | None = None) -> Generated:
        params = SamplingParams(max_tokens=g.max_tokens, temperature=g.temperature, top_p=g.top_p, seed=g.seed,
                                stop=g.stop, structured_outputs=constraint_of(g), output_kind=RequestOutputKind.FINAL_ONLY)
        return self._submit(prompt, params, session_id).result()

    def prefill(self, prompt: str, session_id: str | None = None) -> Generated:
        """Compute `prompt`'s KV (a one-token request); its token counts come back."""
        params = SamplingParams(max_tokens=1, temperature=0.0, output_kind=RequestOutputKind.FINAL_ONLY)
        return self._submit(prompt, params, session_id).result()

    def release_session(self, session_id: str) -> None:
        """The conversation ended: its pinned prefix becomes ordinary (evictable) cache."""
        self._engine.release_session(session_id)

    def role_markers(self, role: str) -> tuple[str, str]:
        if role not in self._markers:
            tok = self._engine.tokenizer
            self._markers[role] = role_markers_from(lambda m, gen_prompt: tok.apply_chat_template(m, gen_prompt), role)
        return self._markers[role]

    def _submit(self, prompt: str, params: SamplingParams, session_id: str | None = None) -> Future:
        future: Future = Future()
        rid = f"lang-{uuid.uuid4().hex}"
        with self._lock:
            self._pending[rid] = future
        try:
            self._engine.add_request(rid, prompt, params, session_id=session_id)  # a ValueError reaches the caller here
        except BaseException:
            with self._lock:
                self._pending.pop(rid, None)
            raise
        self._wake.set()
        return future

    def _loop(self) -> None:
        """The engine's own loop (LLMEngine.outputs) whenever work arrives. A failed step has
        aborted every request in the engine; each waiting program gets the error."""
        while True:
            self._wake.wait()
            self._wake.clear()
            try:
                for out in self._engine.outputs():
                    if out.finished:
                        with self._lock:
                            future = self._pending.pop(out.request_id)
                        future.set_result(_generated(out))
            except Exception as e:  # noqa: BLE001 - every waiting program gets the error
                with self._lock:
                    failed, self._pending = list(self._pending.values()), {}
                for future in failed:
                    future.set_exception(e)


def _generated(out) -> Generated:
    c = out.outputs[0]
    return Generated(c.text, c.finish_reason, len(out.prompt_token_ids), len(c.token_ids), out.num_cached_tokens)


class Endpoint:
    """A pagoda server (or any server with vLLM's guided_* fields) at `base_url`."""

    def __init__(self, base_url: str, model: str | None = None, api_key: str | None = None, timeout: float = 600.0) -> None:
        import httpx  # deferred: httpx loads on first use

        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.base_url = base_url.rstrip("/").removesuffix("/v1")
        self._http = httpx.Client(base_url=self.base_url, headers=headers, timeout=timeout)
        self.model = model or self._http.get("/v1/models").raise_for_status().json()["data"][0]["id"]
        self._markers: dict[str, tuple[str, str]] = {}

    def _complete(self, prompt: str, body: dict, session_id: str | None = None) -> dict:
        headers = {"X-Session-ID": session_id} if session_id is not None else None
        r = self._http.post("/v1/completions", json={"model": self.model, "prompt": prompt, **body}, headers=headers)
        if r.status_code >= 400:
            try:
                message = r.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = r.text
            raise ValueError(f"{self.base_url} answered {r.status_code}: {message}")
        return r.json()

    def generate(self, prompt: str, g: Gen, session_id: str | None = None) -> Generated:
        body: dict = {"max_tokens": g.max_tokens, "temperature": g.temperature, "top_p": g.top_p}
        if g.stop is not None:
            body["stop"] = g.stop
        if g.seed is not None:
            body["seed"] = g.seed
        if g.regex is not None:
            body["guided_regex"] = g.regex
        elif g.choices is not None:
            body["guided_choice"] = g.choices
        elif g.json_schema is not None:
            body["guided_json"] = json.loads(g.json_schema) if isinstance(g.json_schema, str) else g.json_schema
        return _generated_from_body(self._complete(prompt, body, session_id))

    def prefill(self, prompt: str, session_id: str | None = None) -> Generated:
        return _generated_from_body(self._complete(prompt, {"max_tokens": 1, "temperature": 0.0}, session_id))

    def role_markers(self, role: str) -> tuple[str, str]:
        if role not in self._markers:
            self._markers[role] = role_markers_from(self._render, role)
        return self._markers[role]

    def _render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        """The server's chat template, applied through its /tokenize and /detokenize routes."""
        tokens = self._http.post("/tokenize", json={"model": self.model, "messages": messages,
                                                    "add_generation_prompt": add_generation_prompt}).raise_for_status().json()["tokens"]
        return self._http.post("/detokenize", json={"model": self.model, "tokens": tokens}).raise_for_status().json()["prompt"]


def _generated_from_body(out: dict) -> Generated:
    choice, usage = out["choices"][0], out.get("usage") or {}
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return Generated(choice["text"], choice.get("finish_reason"), usage.get("prompt_tokens", 0),
                     usage.get("completion_tokens", 0), cached)
