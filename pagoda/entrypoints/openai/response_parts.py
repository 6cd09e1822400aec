"""Pieces of OpenAI response bodies that chat and completions share: the JSON and server-sent
event encoding, a choice gathered from its deltas, usage, and per-token logprobs."""

from __future__ import annotations

from dataclasses import dataclass, field

import orjson

from pagoda.entrypoints.openai.protocol import UsageInfo
from pagoda.outputs import CompletionOutput, PositionLogprobs


def dumps(data) -> bytes:
    """A response body or SSE payload as JSON: compact, UTF-8 text unescaped, keys that are not
    strings written as strings (as json.dumps does). Non-finite floats, which JSON cannot carry,
    become null (json.dumps wrote `-Infinity`, which strict parsers reject)."""
    return orjson.dumps(data, option=orjson.OPT_NON_STR_KEYS)


def sse(data: dict | str) -> bytes:
    """One server-sent event: a JSON object, or a bare string such as [DONE]."""
    return b"data: " + (data.encode() if isinstance(data, str) else dumps(data)) + b"\n\n"


@dataclass
class Sample:
    """One choice gathered from its deltas; a choice that produced nothing counts as aborted."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    finish_reason: str | None = "abort"
    stop_reason: int | str | None = None
    pieces: list[tuple[str, int]] = field(default_factory=list)  # (text, tokens) as generated: for choice_parser

    def add(self, delta: CompletionOutput) -> None:
        self.pieces.append((delta.text, len(delta.token_ids)))
        self.text += delta.text
        self.token_ids += delta.token_ids
        self.logprobs += delta.logprobs or []
        self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int, reasoning_tokens: int | None = None) -> dict:
    """OpenAI's usage; `reasoning_tokens` (with --reasoning-parser) in completion_tokens_details."""
    body = UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens,
                     prompt_tokens_details={"cached_tokens": cached_tokens}).model_dump()
    if reasoning_tokens is not None:
        body["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return body


def token_logprob_entries(token_ids: list[int], positions: list[PositionLogprobs], k: int) -> list[dict]:
    """Chat's per-token logprobs (OpenAI's `logprobs.content`; Ollama's `logprobs`): each token's
    text, logprob and UTF-8 bytes, with its top-k alternatives."""
    entries = []
    for tid, pos in zip(token_ids, positions):
        chosen = pos[tid]
        tops = [{"token": lp.decoded_token, "logprob": lp.logprob, "bytes": list(lp.decoded_token.encode())}
                for _, lp in top_k(pos, k)]
        entries.append({"token": chosen.decoded_token, "logprob": chosen.logprob,
                        "bytes": list(chosen.decoded_token.encode()), "top_logprobs": tops})
    return entries


def top_k(position: PositionLogprobs, k: int):
    """The position's top-k alternatives (ranks 1..k), most likely first."""
    return sorted(((t, lp) for t, lp in position.items() if lp.rank is not None and lp.rank <= k), key=lambda x: x[1].rank)


def cursor_page(items: list[dict], limit: int, order: str = "desc", after: str | None = None,
                before: str | None = None) -> dict:
    """OpenAI's cursor list of `items` (given newest first): `order` asc reverses them; the page
    starts past the item `after` and stops at the item `before` (ValueError for an unknown one)."""
    items = list(reversed(items)) if order == "asc" else list(items)
    ids = [item["id"] for item in items]
    for cursor, name in ((after, "after"), (before, "before")):
        if cursor is not None and cursor not in ids:
            raise ValueError(f"{name} names no item {cursor!r} in this list")
    start = ids.index(after) + 1 if after is not None else 0
    end = ids.index(before) if before is not None else len(items)
    page = items[start:end][:limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": start + len(page) < end}
