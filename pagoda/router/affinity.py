"""What ties a request to a worker: its session key and its prompt as text.

- The *session key*, in order: the `X-Session-ID` header, else the body's `user`, else (no
  explicit key) a hash of the conversation's start: the messages up to and including the
  first user message, or the first `FALLBACK_PROMPT_CHARS` characters of a completion prompt.
  The start of a conversation does not change from turn to turn, so even without a key the
  turns of one chat hash alike.
- The *prompt text*: the messages (roles and contents) or the prompt as one string, for the
  cache-aware policy's prefix tree. Token-id prompts are written as decimal ids, which keeps
  "this prompt extends that one" true of the text.
"""

from __future__ import annotations

import hashlib
import uuid
from dataclasses import dataclass
from typing import Any

import orjson
from starlette.datastructures import Headers

SESSION_HEADER = "x-session-id"
FALLBACK_PROMPT_CHARS = 256
MAX_PROMPT_CHARS = 16_384  # longer prompts are matched on this much of their start


@dataclass(frozen=True)
class RouteRequest:
    """What a policy sees of a request."""

    session_key: str | None  # explicit: X-Session-ID or `user`
    derived_key: str  # from the conversation's start, when there is no explicit key
    prompt_text: str
    prompt_tokens: tuple[int, ...] | None = None  # as the worker's engine sees them, with --tokenizer (prompt_tokens.py)

    @property
    def key(self) -> str:
        return self.session_key if self.session_key is not None else self.derived_key


def route_request(headers: Headers, body: Any) -> RouteRequest:
    """The routing view of a request; `body` is the parsed JSON (anything, if it was not JSON)."""
    body = body if isinstance(body, dict) else {}
    explicit = headers.get(SESSION_HEADER) or None
    user = body.get("user")
    if explicit is None and isinstance(user, str) and user:
        explicit = f"user:{user}"
    return RouteRequest(session_key=explicit, derived_key=_derived_key(body), prompt_text=prompt_text(body))


SESSIONS_PATH = "/v1/sessions"


def session_in_path(path: str) -> str | None:
    """The session id of a `/v1/sessions/{id}[/...]` call: its key, so every call of a server-side
    session (sessions live in one replica's memory) reaches the replica that holds it."""
    if not path.startswith(SESSIONS_PATH + "/"):
        return None
    return path[len(SESSIONS_PATH) + 1:].split("/", 1)[0] or None


def new_session_id() -> str:
    """The id the router gives a session it sees created without an X-Session-ID, sent on as that
    header: the replica names the session so, and the id's key picks the replica."""
    return f"sess-{uuid.uuid4().hex}"


def prompt_text(body: dict) -> str:
    """The prompt of a chat or completion body as one string (at most MAX_PROMPT_CHARS)."""
    messages = body.get("messages")
    if isinstance(messages, list):
        text = "".join(_message_text(m) for m in messages)
    else:
        text = _prompt_string(body.get("prompt"))
    return text[:MAX_PROMPT_CHARS]


def _derived_key(body: dict) -> str:
    messages = body.get("messages")
    if isinstance(messages, list) and messages:
        start = []
        for m in messages:
            start.append(_message_text(m))
            if isinstance(m, dict) and m.get("role") == "user":
                break
        seed = "".join(start)
    else:
        seed = _prompt_string(body.get("prompt"))[:FALLBACK_PROMPT_CHARS]
    if not seed:  # nothing to hash (an unknown route or body): no affinity
        return f"random:{uuid.uuid4().hex}"
    return "prefix:" + hashlib.blake2b(seed.encode(), digest_size=16).hexdigest()


def _message_text(message: Any) -> str:
    if not isinstance(message, dict):
        return _json(message)
    content = message.get("content")
    if isinstance(content, list):  # content parts: their text, the rest as JSON
        content = "".join(p["text"] if isinstance(p, dict) and isinstance(p.get("text"), str) else _json(p)
                          for p in content)
    elif not isinstance(content, str):
        content = _json(content) if content is not None else ""
    extra = _json(message["tool_calls"]) if message.get("tool_calls") else ""
    return f"{message.get('role', '')}\x1f{content}{extra}\x1e"


def _prompt_string(prompt: Any) -> str:
    """A completion prompt as text: a string; token ids; or the first of a batch of either."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt:
        if all(isinstance(t, int) for t in prompt):
            return "".join(f"{t} " for t in prompt)
        return _prompt_string(prompt[0])
    return ""


def _json(value: Any) -> str:
    try:
        return orjson.dumps(value, option=orjson.OPT_SORT_KEYS).decode()
    except TypeError:
        return str(value)
