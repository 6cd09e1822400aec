"""Server-side conversations, `/v1/sessions`: each turn computes only what is new.

The seeds' failure case is a chat service that pastes the whole history into every prompt, so
each turn costs more than the last. A session keeps its history on the server, and two things
make a turn cost O(new tokens):

- *Incremental encoding.* The session keeps the token ids the engine computed through the last
  turn (its prompt and the answer as generated). The next prompt is those ids plus the encoding
  of only the text the chat template adds after them (the end of the answer's turn, the new user
  message, the generation prompt), so the prefix is exactly what the engine cached, token for
  token, and nothing old is tokenized again. When the template does not extend the old text
  (a template that rewrites earlier turns), the turn falls back to encoding it all.
- *A pinned prefix.* Each turn runs with the session's id, and the engine pins the turn's
  computed prefix in the prefix cache until the session ends (core/session_pins.py), within the
  `--session-kv-fraction` / `--max-session-kv-tokens` budgets, yielding under pressure.

When the history outgrows the context, the oldest turns are dropped, keeping the system prompt
and the latest turns, until the new prompt leaves room for the answer (`overflow: "truncate"`);
with `overflow: "summarize"` the dropped turns are first summarized by the model, and the
summary rides along in the system prompt. A turn never fails because the conversation got long;
only a single message too long for the context on its own is a 400.

Sessions live in this server's memory (a replica's, behind the router: `X-Session-ID` affinity
sends every call of a session to the replica that holds it) and in its state database
(state_db.py: a restarted server takes its sessions back, their token ids kept where the same
tokenizer made them), expire after `--session-ttl` seconds idle, and are bounded in number
(`--max-sessions`). With `--auth-config` a session id is
the tenant's own: the store keys sessions by (tenant, id), so two tenants may choose the same
`X-Session-ID` without learning of each other (a 409 names only the caller's own sessions).
"""

from __future__ import annotations

import logging
import re
import time
import uuid
from dataclasses import dataclass, field

from pydantic import ValidationError

from pagoda.entrypoints.openai.chat_images import images_in
from pagoda.entrypoints.openai.protocol import (
    ChatCompletionRequest, SessionCreateRequest, SessionMessageRequest, describe_validation_errors, now,
)
from pagoda.entrypoints.openai.errors import OpenAIError
from pagoda.entrypoints.openai.admission import Admission
from pagoda.entrypoints.openai.chat import ChatTurn
from pagoda.entrypoints.openai.known_prefix import KnownPrefix
from pagoda.entrypoints.openai.periodic import Periodic
from pagoda.entrypoints.state_db import StateDB
from pagoda.entrypoints.openai.serving import Serving
from pagoda.security.context import request_context

logger = logging.getLogger("pagoda.sessions")

SESSION_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
SUMMARY_MAX_TOKENS = 128
SUMMARY_PROMPT = ("Summarize the conversation below in a few sentences. Keep names, numbers, dates and every "
                  "decision or request the user made.")
# What a turn leaves for the answer when its request names no max_tokens: the prompt is cut so
# that at least this many tokens (or a quarter of the context, if less) remain.
DEFAULT_ANSWER_ROOM = 256
_SESSION_ONLY = {"system", "overflow", "messages"}
_RECORDED = ("id", "model", "system", "defaults", "overflow", "created", "messages", "summary", "dropped_turns",
             "tenant")


@dataclass
class ChatSession:
    id: str
    model: str
    system: str | None
    defaults: dict  # sampling fields given at creation
    overflow: str
    created: int = field(default_factory=now)
    last_used: float = field(default_factory=time.monotonic)
    messages: list[dict] = field(default_factory=list)  # user and assistant turns, oldest first
    prefix: KnownPrefix = field(default_factory=KnownPrefix)  # what the engine computed through the last turn
    summary: str | None = None  # of the turns dropped for room (overflow: summarize)
    dropped_turns: int = 0
    busy: bool = False  # a turn is running: a second message at once is a 409
    tenant: str | None = None  # --auth-config: the tenant that created it; no other tenant sees it

    @property
    def key(self) -> tuple[str | None, str]:
        """Where the store keeps it: ids are per tenant."""
        return self.tenant, self.id

    @property
    def pin_id(self) -> str:
        """The engine's name for its pinned prefix, unique across tenants ("/" is in no session
        id, so a tenant's name cannot be mistaken for one without a tenant)."""
        return self.id if self.tenant is None else f"tenant/{self.tenant}/{self.id}"

    def system_prompt(self) -> str | None:
        if self.summary is None:
            return self.system
        note = f"Summary of the earlier conversation: {self.summary}"
        return f"{self.system}\n\n{note}" if self.system else note

    def conversation(self, history: list[dict] | None = None) -> list[dict]:
        system = self.system_prompt()
        head = [{"role": "system", "content": system}] if system else []
        return head + (self.messages if history is None else history)

    def record(self, fingerprint: str) -> dict:
        fields = {name: getattr(self, name) for name in _RECORDED}
        idle = time.monotonic() - self.last_used
        return {**fields, "token_ids": self.prefix.token_ids, "text": self.prefix.text, "fingerprint": fingerprint,
                "last_used_at": time.time() - idle}

    @classmethod
    def from_record(cls, record: dict, fingerprint: str) -> "ChatSession":
        session = cls(**{name: record[name] for name in _RECORDED})
        session.last_used = time.monotonic() - max(0.0, time.time() - record["last_used_at"])
        if record.get("fingerprint") == fingerprint:  # token ids of another tokenizer mean nothing here
            session.prefix = KnownPrefix(record["token_ids"], record["text"])
        return session

    def describe(self, ttl: float) -> dict:
        return {"id": self.id, "object": "session", "model": self.model, "created": self.created,
                "expires_in": max(0.0, round(ttl - (time.monotonic() - self.last_used), 1)),
                "messages": self.conversation(), "summary": self.summary, "dropped_turns": self.dropped_turns,
                "num_tokens": len(self.prefix.token_ids)}


class ChatSessionStore:
    def __init__(self, serving: Serving, ttl: float = 1800.0, max_sessions: int = 1000, db: StateDB | None = None,
                 fingerprint: str = "") -> None:
        self.serving = serving
        self.db = db
        self.fingerprint = fingerprint  # the tokenizer's identity: whose token ids a record holds
        self.ttl = ttl
        self.max_sessions = max_sessions
        self.sessions: dict[tuple[str | None, str], ChatSession] = {}  # by (tenant, id)
        self._sweeper = Periodic.sweep(ttl, self.expire)

    # -- lifetime ---------------------------------------------------------------------------
    def start(self) -> None:
        """Take back the sessions a restart left (those not yet expired); expire idle sessions in
        the background (their pins go even if nobody calls)."""
        if self.db is not None and not self.sessions:
            for _, _, record in self.db.all("session")[-self.max_sessions:]:
                session = ChatSession.from_record(record, self.fingerprint)
                self.sessions[session.key] = session
            self.expire()
        self._sweeper.start()

    def stop(self) -> None:
        """The app shuts down (the server stops, or its model is unloaded)."""
        self._sweeper.stop()

    def expire(self) -> None:
        limit = time.monotonic() - self.ttl
        gone = [s for s in self.sessions.values() if s.last_used < limit and not s.busy]
        for session in gone:
            del self.sessions[session.key]
            self._forget(session)
        if gone:
            logger.info("%d session(s) expired", len(gone))
            self.serving.engine.release_sessions([s.pin_id for s in gone])

    def holds(self, session_id: str) -> bool:
        """Whether the caller's tenant has a session of this id here."""
        return _key(session_id) in self.sessions

    def create(self, body: SessionCreateRequest, wanted_id: str | None) -> ChatSession:
        self.expire()
        model = self.serving.check_model(body.model)
        if wanted_id is not None and not SESSION_ID.match(wanted_id):
            raise OpenAIError("X-Session-ID must be 1-128 letters, digits or ._:-", param="X-Session-ID")
        if wanted_id is not None and _key(wanted_id) in self.sessions:  # the caller's own: others' do not exist
            raise OpenAIError(f"session {wanted_id!r} already exists", status=409, type_="conflict_error",
                              code="session_exists")
        if len(self.sessions) >= self.max_sessions:
            raise OpenAIError(f"the server holds its limit of {self.max_sessions} sessions (--max-sessions); "
                              "end one (DELETE /v1/sessions/{id}) or retry later", status=429,
                              type_="rate_limit_error", code="too_many_sessions", headers={"Retry-After": "1"})
        defaults = body.model_dump(by_alias=True, exclude_unset=True, exclude=_SESSION_ONLY | {"model", "stream"})
        if defaults.get("n", 1) != 1:
            raise OpenAIError("a session answers with one choice: n must be 1", param="n")
        probe = _chat_request(defaults, [{"role": "user", "content": "."}])  # the defaults must make a valid request
        self.serving.params(probe, 1, None)
        session = ChatSession(wanted_id or f"sess-{uuid.uuid4().hex}", model, body.system, defaults, body.overflow)
        self.serving.check_input([body.system or ""], "system")  # the content filter (--moderation-words)
        if body.messages:
            session.messages = self.serving.chat_messages(body.messages)
            if images_in(session.messages):  # (a session's history is stored as text)
                raise OpenAIError("a session's messages take no images; send them to /v1/chat/completions",
                                  param="messages")
            self.serving.check_input([m["content"] for m in session.messages], "messages")
            roles = {m["role"] for m in session.messages}
            if not roles <= {"user", "assistant"}:
                raise OpenAIError("a session's earlier messages are user and assistant turns (the system prompt "
                                  "is `system`)", param="messages")
        session.tenant = _key(session.id)[0]
        self.sessions[session.key] = session
        self._save(session)
        return session

    def _save(self, session: ChatSession) -> None:
        if self.db is not None:
            self.db.put("session", session.tenant, session.id, session.record(self.fingerprint), time.time())

    def _forget(self, session: ChatSession) -> None:
        if self.db is not None:
            self.db.delete("session", session.tenant, session.id)

    def get(self, session_id: str) -> ChatSession:
        self.expire()
        session = self.sessions.get(_key(session_id))  # --auth-config: another tenant's does not exist here
        if session is None:
            raise OpenAIError(f"session {session_id!r} does not exist (it ended or expired after "
                              f"{self.ttl:g} s idle)", status=404, type_="NotFoundError", code="session_not_found")
        return session

    def delete(self, session_id: str) -> None:
        session = self.get(session_id)
        del self.sessions[session.key]
        self._forget(session)
        self.serving.engine.release_sessions([session.pin_id])

    # -- a turn -----------------------------------------------------------------------------
    async def message(self, session_id: str, body: SessionMessageRequest, admission: Admission | None):
        session = self.get(session_id)
        if session.busy:
            raise OpenAIError(f"session {session.id!r} is answering another message; send the next one after it",
                              status=409, type_="conflict_error", code="session_busy")
        fields = body.model_dump(by_alias=True, exclude_unset=True, exclude={"content", "model"})
        if fields.get("n", 1) != 1:
            raise OpenAIError("a session answers with one choice: n must be 1", param="n")
        self.serving.check_input([body.content], "content")  # the content filter (--moderation-words)
        user = {"role": "user", "content": body.content}
        settings = {**session.defaults, **fields}
        request = _chat_request(settings, session.conversation() + [user])
        if request.tools:
            raise OpenAIError("sessions do not take tools; use /v1/chat/completions for tool calls", param="tools")
        session.busy = True
        try:
            ids = await self._prompt(session, user, request)
            params = self.serving.chat_params(request, len(ids), "content")
            self.serving.check_capacity(1, admission)
            turn = ChatTurn(session.pin_id, lambda answer: self._commit(session, user, ids, answer),
                            {"session_id": session.id})
            result = await self.serving.answer_chat(request, session.model, ids, params, None, turn)
        except BaseException:
            session.busy = False
            raise
        if not request.stream:
            session.busy = False
            return result
        return self._until_done(session, result)

    @staticmethod
    async def _until_done(session: ChatSession, stream):
        """The turn's SSE stream; the session takes messages again once it ends (or is dropped)."""
        try:
            async for chunk in stream:
                yield chunk
        finally:
            session.busy = False
            session.last_used = time.monotonic()

    def _commit(self, session: ChatSession, user: dict, ids: list[int], answer) -> None:
        """A complete answer joins the history (an aborted one does not: the turn did not happen)."""
        if answer.finish_reason in (None, "abort"):
            return
        session.messages += [user, {"role": "assistant", "content": answer.text}]
        session.prefix = KnownPrefix.of(self.serving.tokenizer, ids, answer.token_ids)
        session.last_used = time.monotonic()
        self._save(session)

    async def _prompt(self, session: ChatSession, user: dict, request: ChatCompletionRequest) -> list[int]:
        """The turn's prompt ids, the oldest turns dropped (or summarized) until the answer has room."""
        wanted = request.max_completion_tokens or request.max_tokens
        room = wanted if wanted is not None else min(DEFAULT_ANSWER_ROOM, self.serving.max_model_len // 4)
        summarizing = session.overflow == "summarize"
        reserve = room + (self._summary_tokens + 32 if summarizing else 0)  # a summary joins the system prompt

        def too_long(ids: list[int], room: int) -> bool:
            return len(ids) + room > self.serving.max_model_len

        ids = self._encode(session, session.conversation() + [user], incremental=True)
        num_dropped = 0
        while too_long(ids, reserve) and num_dropped < len(session.messages):
            num_dropped += 2  # the oldest user turn and its answer
            ids = self._encode(session, session.conversation(session.messages[num_dropped:]) + [user])
        if not num_dropped:
            return ids
        if summarizing:
            session.summary = await self._summarize(session, session.messages[:num_dropped])
        session.messages = session.messages[num_dropped:]
        session.dropped_turns += num_dropped // 2
        session.prefix = KnownPrefix()  # the prefix changed: the next turn starts afresh from here
        ids = self._encode(session, session.conversation() + [user])
        while too_long(ids, room) and (session.summary or session.messages):  # a summary longer than planned
            if session.summary:
                session.summary = session.summary[len(session.summary) // 2 + 1:] or None
            else:
                session.messages = session.messages[2:]
                session.dropped_turns += 1
            ids = self._encode(session, session.conversation() + [user])
        logger.info("session %s: dropped %d turn(s) for room", session.id, num_dropped // 2)
        return ids

    def _encode(self, session: ChatSession, messages: list[dict], incremental: bool = False) -> list[int]:
        return (session.prefix if incremental else KnownPrefix()).encode(self.serving.tokenizer, self._render(messages))

    def _render(self, messages: list[dict]) -> str:
        self.serving.check_prompt_chars(sum(len(m["content"]) for m in messages), "content")
        try:
            return self.serving.tokenizer.apply_chat_template(messages, True)
        except ValueError as e:
            raise OpenAIError(str(e), param="content") from None
        except Exception as e:  # jinja TemplateError from raise_exception in the template
            raise OpenAIError(f"chat template error: {e}", param="content") from None

    @property
    def _summary_tokens(self) -> int:
        return min(SUMMARY_MAX_TOKENS, self.serving.max_model_len // 4)

    async def _summarize(self, session: ChatSession, dropped: list[dict]) -> str:
        """One generation: the earlier summary and the dropped turns, in a few sentences (the
        end of them, if all would not fit in the context)."""
        transcript = "\n".join(f"{m['role']}: {m['content']}" for m in dropped)
        if session.summary:
            transcript = f"(earlier) {session.summary}\n{transcript}"
        budget = self.serving.max_model_len - self._summary_tokens
        while True:
            ids = self.serving.tokenizer.encode_chat([{"role": "system", "content": SUMMARY_PROMPT},
                                                      {"role": "user", "content": transcript}], True)
            if len(ids) <= budget or not transcript:
                break
            transcript = transcript[len(transcript) // 2:]
        request = _chat_request({"temperature": 0.0}, [{"role": "user", "content": "."}])
        params = self.serving.params(request, max(1, min(self._summary_tokens, self.serving.max_model_len - len(ids))),
                                     None)
        text = ""
        async for _, out in self.serving.run_all([ids], [params], f"summary-{session.id}-{uuid.uuid4().hex[:8]}",
                                                 0, session.defaults.get("cache_salt")):
            text += "".join(c.text for c in out.outputs)
        return text.strip()


def _key(session_id: str) -> tuple[str | None, str]:
    """The store's key for ``session_id`` as the caller names it (its tenant's, under --auth-config)."""
    ctx = request_context()
    return (ctx.tenant if ctx is not None else None), session_id


def _chat_request(settings: dict, messages: list[dict]) -> ChatCompletionRequest:
    """A chat request of the session's settings; a bad setting is a 400 naming it."""
    try:
        return ChatCompletionRequest.model_validate({**settings, "messages": messages})
    except ValidationError as e:
        message, param = describe_validation_errors(e.errors())
        raise OpenAIError(message, param=param) from None
