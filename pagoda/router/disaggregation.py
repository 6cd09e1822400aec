"""Prefill / decode disaggregation (`pagoda router --pd-disaggregation --prefill URL --decode URL`).

A generation request goes first to a prefill replica (`pagoda serve --kv-role prefill`) as the same
request cut to one token and no stream: the replica computes the whole prompt and its first token,
and answers only once the prompt's KV blocks are in the shared KV tier (`--kv-offload-dir` on one
host, a directory in /dev/shm being shared memory; `--kv-offload-url redis://` across hosts, over
TCP). Then the request, unchanged, goes to a decode replica (`--kv-role decode`, the router's
ordinary workers) through the usual path (policy, retry, the SSE relay): its prefix lookup finds
the prompt's blocks in the shared tier, so it computes only the prompt's last, partial block
(fewer than a block's tokens), samples the same first token and goes on decoding.

This is vLLM's disaggregated-prefill proxy with a shared-storage connector (the first token is
sampled again on the decode side rather than carried, which costs one short forward and keeps the
decode replica's answer whole: its stream, usage, logprobs and stop handling are its own). The KV
travels as the tiers' records: a block in the cache's own format with its chain key and a
SHA-256, so a decode replica never uses a block it cannot check.

A prefill hop that fails (no prefill replica up, an error, a timeout) is logged and skipped: the
decode replica then computes the prompt itself. The answer is the same, only slower.
"""

from __future__ import annotations

import itertools
import logging
from typing import Any

import httpx

from pagoda.router.workers import Worker, WorkerRegistry

logger = logging.getLogger("pagoda.router")

GENERATE_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
PREFILL_HEADER = "x-pagoda-prefill-worker"  # on the answer: the prefill replica that computed the prompt
# what makes a request more than its prompt and first token; dropped from the prefill hop
_NOT_FOR_PREFILL = ("stream", "stream_options", "max_completion_tokens", "min_tokens", "n", "best_of")


def prefill_body(parsed: dict) -> dict:
    """The prefill hop's request: the same prompt and sampling, one token, one choice, no stream."""
    body = {k: v for k, v in parsed.items() if k not in _NOT_FOR_PREFILL}
    body["max_tokens"] = 1
    return body


class PrefillStage:
    """The prefill replicas and the hop to them before each generation request."""

    def __init__(self, urls: list[str], registry: WorkerRegistry) -> None:
        self.registry = registry
        for url in urls:
            registry.add(url)
        self._turn = itertools.count()
        self.hops = {"ok": 0, "failed": 0, "skipped": 0}

    def choose(self) -> Worker | None:
        """The available prefill replica with the fewest hops in flight (ties in turn)."""
        candidates = self.registry.available()
        if not candidates:
            return None
        turn = next(self._turn)
        return min(candidates, key=lambda w: (w.in_flight, (candidates.index(w) - turn) % len(candidates)))

    async def run(self, client: httpx.AsyncClient, path: str, parsed: Any, headers: dict[str, str]) -> str | None:
        """Prefill the request's prompt on a prefill replica; the replica's URL, or None when the
        hop was skipped or failed (the decode replica then computes the prompt itself)."""
        if path not in GENERATE_PATHS or not isinstance(parsed, dict):
            return None
        worker = self.choose()
        if worker is None:
            self._count("skipped", f"no prefill replica available: {self.registry.why_none_available()}")
            return None
        worker.in_flight += 1
        try:
            answer = await client.post(worker.url + path, json=prefill_body(parsed), headers=headers)
        except httpx.HTTPError as e:
            self.registry.record_failure(worker, repr(e), refused=isinstance(e, httpx.ConnectError))
            self._count("failed", f"{worker.url}: {type(e).__name__} {e}")
            return None
        finally:
            worker.in_flight -= 1
        if answer.status_code != 200:
            self._count("failed", f"{worker.url} answered {answer.status_code}: {answer.text[:200]}")
            return None
        self.registry.record_success(worker)
        self.hops["ok"] += 1
        return worker.url

    def _count(self, outcome: str, why: str) -> None:
        self.hops[outcome] += 1
        logger.warning("prefill hop %s (the decode replica computes the prompt): %s", outcome, why)

    def describe(self) -> dict:
        return {"prefill": [w.describe() for w in self.registry.workers.values()], "hops": dict(self.hops)}
