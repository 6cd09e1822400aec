"""Responses kept on the server (`store`, the default), for `GET /v1/responses/{id}`, its input
items, and `previous_response_id`.

A stored response keeps the conversation through it (the chat messages, without the
instructions, which OpenAI does not carry to the next response) and the token ids the engine
computed for it (`KnownPrefix`), so the next response's prompt starts with exactly the tokens
the engine cached. The response ran as an engine session (`pin_id`), so its computed prefix stays
pinned in the prefix cache (core/session_pins.py) until a response continues it (the
continuation's pin covers it), it is deleted, or it idles past `--session-ttl`.

The server keeps the `--max-stored-responses` most recently used, in memory and in its state
database (state_db.py), so they outlive a restart; with `--auth-config` they are the tenant's
own, as sessions are. A response read back after a restart continues with its history encoded
afresh unless the same tokenizer (`fingerprint`) made its token ids.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from pagoda.entrypoints.openai.errors import OpenAIError
from pagoda.entrypoints.openai.known_prefix import KnownPrefix
from pagoda.entrypoints.openai.periodic import Periodic
from pagoda.entrypoints.state_db import StateDB
from pagoda.security.context import request_context

logger = logging.getLogger("pagoda.responses")


@dataclass
class StoredResponse:
    body: dict  # the response object, as GET answers it
    input_items: list[dict]  # this response's input, with ids
    history: list[dict]  # the conversation through this response, as chat messages
    prefix: KnownPrefix  # its prompt and output token ids, as the engine computed them
    tenant: str | None = None
    pinned: bool = False  # its prefix is pinned in the engine (pin_id)
    last_used: float = field(default_factory=time.monotonic)

    @property
    def id(self) -> str:
        return self.body["id"]

    @property
    def pin_id(self) -> str:
        return response_pin_id(self.tenant, self.id)

    def record(self, fingerprint: str) -> dict:
        return {"body": self.body, "input_items": self.input_items, "history": self.history,
                "token_ids": self.prefix.token_ids, "text": self.prefix.text, "fingerprint": fingerprint}

    @classmethod
    def from_record(cls, record: dict, tenant: str | None, fingerprint: str) -> "StoredResponse":
        same = record.get("fingerprint") == fingerprint  # token ids of another tokenizer mean nothing here
        prefix = KnownPrefix(record["token_ids"], record["text"]) if same else KnownPrefix()
        body = record["body"]
        if body["status"] in ("queued", "in_progress"):  # a background response the last run left unfinished
            body = {**body, "status": "failed",
                    "error": {"code": "server_restarted", "message": "the server restarted before it finished"}}
        return cls(body, record["input_items"], record["history"], prefix, tenant)


def response_pin_id(tenant: str | None, response_id: str) -> str:
    """The engine's session name for a response's prefix, unique across tenants."""
    return f"response/{tenant or ''}/{response_id}"


def caller_tenant() -> str | None:
    ctx = request_context()  # --auth-config: the key's tenant
    return ctx.tenant if ctx is not None else None


class ResponseStore:
    def __init__(self, engine, ttl: float = 1800.0, max_responses: int = 10000, db: StateDB | None = None,
                 fingerprint: str = "") -> None:
        self.engine = engine
        self.db = db
        self.fingerprint = fingerprint  # the tokenizer's identity: whose token ids a record holds
        self.ttl = ttl  # idle seconds after which a response's pinned prefix is let go
        self.max_responses = max_responses
        self.responses: OrderedDict[tuple[str | None, str], StoredResponse] = OrderedDict()  # LRU first
        self._puts = 0
        self.tasks: dict[str, asyncio.Task] = {}  # background responses being made, by id
        self._sweeper = Periodic.sweep(ttl, self.unpin_idle)

    def start(self) -> None:
        self._sweeper.start()

    def stop(self) -> None:
        self._sweeper.stop()

    def unpin_idle(self) -> None:
        limit = time.monotonic() - self.ttl
        self._unpin([r for r in self.responses.values() if r.pinned and r.last_used < limit])

    def _unpin(self, responses: list[StoredResponse]) -> None:
        for response in responses:
            response.pinned = False
        if responses:
            self.engine.release_sessions([r.pin_id for r in responses])

    def get(self, response_id: str, param: str | None = None) -> StoredResponse:
        tenant = caller_tenant()
        response = self.responses.get((tenant, response_id))  # another tenant's does not exist here
        if response is None and self.db is not None:
            record = self.db.get("response", tenant, response_id)
            if record is not None:
                response = StoredResponse.from_record(record, tenant, self.fingerprint)
                self.responses[(tenant, response_id)] = response
        if response is None:
            raise OpenAIError(f"Response with id {response_id!r} not found (it was not stored, was deleted, or is "
                              f"older than the server's last {self.max_responses} stored responses)", status=404,
                              type_="invalid_request_error", param=param, code="response_not_found")
        response.last_used = time.monotonic()
        self.responses.move_to_end((response.tenant, response.id))
        return response

    def put(self, response: StoredResponse, continued: StoredResponse | None) -> None:
        """Keep `response`; the response it continued lets its pin go (the new one's covers it)."""
        response.tenant = caller_tenant()
        self.responses[(response.tenant, response.id)] = response
        if continued is not None and continued.pinned:
            self._unpin([continued])
        while len(self.responses) > self.max_responses:
            _, oldest = self.responses.popitem(last=False)
            self._unpin([oldest] if oldest.pinned else [])
        self._persist(response)
        self._puts += 1
        if self.db is not None and self._puts % 100 == 0:
            self.db.keep_newest("response", self.max_responses)

    def finish(self, response_id: str, status: str, error: dict | None) -> None:
        """A background response that ended without an answer to store: cancelled or failed."""
        response = self.responses.get((caller_tenant(), response_id))
        if response is None or response.body["status"] != "in_progress":
            return  # stored as finished by then, or deleted
        response.body = {**response.body, "status": status, "error": error}
        self._persist(response)

    def _persist(self, response: StoredResponse) -> None:
        if self.db is not None:
            self.db.put("response", response.tenant, response.id, response.record(self.fingerprint), time.time())

    def delete(self, response_id: str) -> None:
        response = self.get(response_id)
        del self.responses[(response.tenant, response.id)]
        self._unpin([response] if response.pinned else [])
        if self.db is not None:
            self.db.delete("response", response.tenant, response.id)
