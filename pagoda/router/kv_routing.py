"""Exact prefix routing on the workers' KV events, put together for the router: the index of
their prefix caches (kv_index.py), the subscription that feeds it (kv_events_subscriber.py) and
the prompt's token ids the policy matches against it (prompt_tokens.py).

`pagoda router --kv-events URL=ENDPOINT ... | --kv-events-port PORT --tokenizer MODEL` turns it on;
the `cache_aware` policy then prefers the worker whose cache holds the most of the prompt's
leading blocks (policies.py, "kv_prefix").
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from pagoda.router.affinity import RouteRequest
from pagoda.router.kv_index import KVBlockIndex
from pagoda.router.prompt_tokens import PromptTokens
from pagoda.tokenizer import tokenizer_of

TOKENIZE_IN_THREAD_CHARS = 2_000  # longer prompts are tokenized off the event loop


class KVRouting:
    def __init__(self, endpoints: dict[str, str], port: int | None, tokenizer: str) -> None:
        # deferred: zmq and msgspec (the kv-events extra) load only when the router subscribes
        from pagoda.router.kv_events_subscriber import KVEventsSubscriber

        self.index = KVBlockIndex()
        self.subscriber = KVEventsSubscriber(self.index, endpoints, port)
        self.tokens = PromptTokens(tokenizer_of(tokenizer))

    @classmethod
    def of(cls, endpoints: dict[str, str], port: int | None, tokenizer: str | None) -> KVRouting | None:
        """The KV routing the router's flags ask for, or None; a ValueError names a missing flag."""
        if not endpoints and port is None:
            if tokenizer is not None:
                raise ValueError("--tokenizer is for exact prefix routing: give --kv-events or --kv-events-port too")
            return None
        if tokenizer is None:
            raise ValueError("--kv-events / --kv-events-port need --tokenizer MODEL (the workers' model, to "
                             "tokenize prompts as they do)")
        return cls(endpoints, port, tokenizer)

    async def tokenized(self, route: RouteRequest, body: Any) -> RouteRequest:
        """`route` with its prompt's token ids, where the router can tell them."""
        if route.session_key is not None or not route.prompt_text:
            return route  # a session sticks to its ring; an empty prompt matches nothing
        if len(route.prompt_text) > TOKENIZE_IN_THREAD_CHARS:
            ids = await asyncio.to_thread(self.tokens.of, body)
        else:
            ids = self.tokens.of(body)
        return route if ids is None else dataclasses.replace(route, prompt_tokens=tuple(ids))
