"""The request context of `--auth-config` / `--audit-log`: who is asking, under which role, and
what the request used, carried in a ContextVar from the access middleware (security/access.py)
down to the few hooks in the serving code.

The middleware sets `CURRENT` for the request's task; the tasks it starts (a streaming
response's, `Serving.run_all`'s pumps) copy the context, so every hook sees the same object.
With neither option (or only `--api-key` without an audit log) nothing sets it, and each hook
costs one `ContextVar.get` that returns None.

Hooks (each a line or two at its call site):
- `Serving.check_model`: the role may use this model name (403 `model_not_allowed`);
- `Serving.max_tokens_for`: the role's `max_tokens` (the default when a request names none; a
  request asking more gets a 400);
- `Serving.check_capacity` / `Admission.release`: the tenant's `max_concurrent` and
  `tokens_per_minute` (429 with Retry-After), held until the answer is done;
- `Serving.run_all`: the role's priority, the tenant's prefix-cache salt, the `max_tokens` cap
  as a backstop (Ollama's `num_predict`), and the tokens used (charged to `tokens_per_minute`,
  written to the audit line);
- `note_filter_hit(name)`: output filters (moderation) record what they caught, for the audit.

Nothing here imports the server: errors are built with `OpenAIError`, imported when raised.
"""

from __future__ import annotations

import time
from contextvars import ContextVar
from typing import TYPE_CHECKING

from pagoda.entrypoints.openai.errors import OpenAIError

if TYPE_CHECKING:
    from pagoda.security.auth import KeyEntry, Role
    from pagoda.security.limits import TenantLimits


class Grant:
    """What an authenticated key may do: its tenant, role and the (tenant, role) limits."""

    __slots__ = ("isolate_cache", "key", "limits", "role")

    def __init__(self, key: KeyEntry, role: Role, limits: TenantLimits, isolate_cache: bool = True) -> None:
        self.key, self.role, self.limits, self.isolate_cache = key, role, limits, isolate_cache

    @property
    def tenant(self) -> str:
        return self.key.tenant

    def may_use(self, model: str) -> bool:
        return self.role.may_use(model)


class RequestContext:
    """One HTTP request (or gRPC call): its grant (None without an auth config) and its usage."""

    __slots__ = (
        "_holding",
        "cached_tokens",
        "completion_tokens",
        "filter_hits",
        "grant",
        "model",
        "outputs",
        "prompt_tokens",
        "prompts",
        "start",
    )

    def __init__(self, grant: Grant | None = None, keep_content: bool = False) -> None:
        self.grant = grant
        self.model: str | None = None
        self.prompt_tokens = self.completion_tokens = self.cached_tokens = 0
        self.filter_hits: list[str] = []
        # --audit-log-content: the prompts' and outputs' text by prompt index (None: not kept)
        self.prompts: dict[int, str] | None = {} if keep_content else None
        self.outputs: dict[int, str] | None = {} if keep_content else None
        self._holding = 0  # concurrency slots held (check_capacity → Admission.release)
        self.start = time.monotonic()

    @property
    def tenant(self) -> str | None:
        return self.grant.tenant if self.grant is not None else None

    # -- models ----------------------------------------------------------------------------------
    def check_model(self, name: str) -> None:
        """403 unless the role may use `name` (the model name as the request gave it)."""
        self.model = name
        if self.grant is not None and not self.grant.may_use(name):
            raise _error(f"the key's role `{self.grant.role.name}` may not use the model `{name}`", 403,
                         "permission_error", "model_not_allowed", param="model")

    def visible(self, names: list[str]) -> list[str]:
        """The names of `names` this request's role may use."""
        if self.grant is None:
            return list(names)
        return [n for n in names if self.grant.may_use(n)]

    # -- max_tokens ------------------------------------------------------------------------------
    @property
    def max_tokens(self) -> int | None:
        return self.grant.role.max_tokens if self.grant is not None else None

    def check_max_tokens(self, requested: int | None) -> int | None:
        """The role's max_tokens cap (None: none); a 400 when the request asks more. A request
        that names none gets the cap (or less, when the context has less room)."""
        cap = self.max_tokens
        if cap is not None and requested is not None and requested > cap:
            raise _error(f"max_tokens is at most {cap} for this key's role `{self.grant.role.name}`, got "
                         f"{requested}", 400, "invalid_request_error", "max_tokens_exceeded", param="max_tokens")
        return cap

    # -- concurrency and tokens per minute -------------------------------------------------------
    def admit(self) -> None:
        """Take one of the tenant's concurrent slots, if its limits allow (else a 429)."""
        if self.grant is None:
            return
        refusal = self.grant.limits.admit(self.grant.role)
        if refusal is not None:
            raise _rate_limited(*refusal)
        self._holding += 1

    def check_admissible(self) -> None:
        """429 if `admit` would refuse now, taking no slot (the front of several models asks
        before it loads a model for a request the model's app would then refuse)."""
        refusal = self.grant.limits.refusal(self.grant.role) if self.grant is not None else None
        if refusal is not None:
            raise _rate_limited(*refusal)

    def release(self) -> None:
        if self._holding and self.grant is not None:
            self.grant.limits.release(self._holding)
        self._holding = 0

    # -- engine requests ---------------------------------------------------------------------
    def engine_args(self, priority: int, cache_salt: str | None) -> tuple[int, str | None]:
        """The scheduler priority and prefix-cache salt a request runs with: the role's priority
        (a request may lower it, never raise it), the tenant's own salt (a request's salt is kept
        inside the tenant's, so tenants never share cached blocks whatever they send)."""
        grant = self.grant
        if grant is None:
            return priority, cache_salt
        priority = grant.role.priority + min(priority, 0)
        if grant.isolate_cache:
            cache_salt = f"tenant/{grant.tenant}" if cache_salt is None else f"tenant/{grant.tenant}/{cache_salt}"
        return priority, cache_salt

    def cap_params(self, params) -> None:
        """The role's max_tokens on an engine request's SamplingParams (routes that cut rather
        than refuse, as Ollama's `num_predict` does)."""
        cap = self.max_tokens
        if cap is not None and params.max_tokens is not None and params.max_tokens > cap:
            params.max_tokens = cap
            params.min_tokens = min(params.min_tokens, cap)

    def on_output(self, index: int, output) -> None:
        """--audit-log-content: an engine delta's text."""
        text = "".join(c.text for c in output.outputs)
        if text:
            self.outputs[index] = self.outputs.get(index, "") + text

    def on_engine_done(self, index: int, prompt_ids: list[int], generated: int, cached: int, tokenizer) -> None:
        """One engine request ended: its tokens count for the audit and the tenant's tokens per minute."""
        self.prompt_tokens += len(prompt_ids)
        self.completion_tokens += generated
        self.cached_tokens += cached
        if self.grant is not None:
            self.grant.limits.charge(len(prompt_ids) + generated)
        if self.prompts is not None:
            try:
                self.prompts[index] = tokenizer.decode(prompt_ids, skip_special_tokens=False)
            except Exception:  # noqa: BLE001 - the audit must not fail a request
                self.prompts[index] = ""

    def note_filter_hit(self, name: str) -> None:
        self.filter_hits.append(name)


CURRENT: ContextVar[RequestContext | None] = ContextVar("pagoda_request_context", default=None)


def request_context() -> RequestContext | None:
    """The current request's context, None when no --auth-config / --audit-log is set."""
    return CURRENT.get()


def note_filter_hit(name: str) -> None:
    """For output filters (moderation): record that `name` caught something in this request, so
    the audit line lists it. A no-op outside a request or without an audit log."""
    ctx = CURRENT.get()
    if ctx is not None:
        ctx.note_filter_hit(name)


def _error(message: str, status: int, type_: str, code: str, param: str | None = None, headers: dict | None = None):
    return OpenAIError(message, status=status, type_=type_, param=param, code=code, headers=headers)


def _rate_limited(message: str, code: str, retry_after: float):
    seconds = max(1, int(retry_after + 0.999))
    return _error(f"{message}; retry in {seconds} s", 429, "rate_limit_error", code,
                  headers={"Retry-After": str(seconds)})
