"""Access control and audit on `pagoda serve`: the runtime of `--auth-config`, `--api-key` and
`--audit-log`, and the plain ASGI middleware that applies them (docs/architecture.md, "Keys,
tenants and roles").

`AccessControl` runs first for every HTTP request except the open paths (/health, /metrics,
/version, /docs, /openapi.json): it resolves `Authorization: Bearer KEY` to a `Grant` (tenant,
role, the (tenant, role) limits) or answers 401; answers 403 on the model store's write routes
and blobs unless the role is `admin`; takes a token from the requests-per-second bucket (429
with Retry-After); then runs the app with a `RequestContext` in `context.CURRENT`, which the
serving hooks read (model globs, max_tokens, concurrency and tokens per minute, priority, cache
salt, usage). When the answer is complete (a stream: when it ends) it writes the audit line.

`Access.reload` (SIGHUP) reads the file again and swaps the whole config in one assignment: a
request in flight keeps the grant it was admitted with, the next one sees the new file; a file
that does not load leaves the old config in place and logs why. The limit counters live in a
`LimitStore` that survives reloads.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import signal
import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagoda.entrypoints.openai.errors import OpenAIError
from pagoda.entrypoints.openai.middleware import error_response, is_open
from pagoda.security.audit import AuditLog, timestamp
from pagoda.security.auth import AuthConfig, AuthConfigError
from pagoda.security.context import CURRENT, Grant, RequestContext, _rate_limited
from pagoda.security.limits import LimitStore
from pagoda.security.timeouts import BodyDeadline

logger = logging.getLogger("pagoda.auth")

# The model store's write routes (Ollama's API), its uploads (/api/blobs/{digest}: POST writes a
# file, HEAD tells which blobs the store holds) and the engine's debug data (/v1/debug/...,
# pagoda/entrypoints/web): only an `admin` role may call them, refused before the body is read.
ADMIN_PATHS = frozenset({"/api/pull", "/api/push", "/api/delete", "/api/copy", "/api/create"})
LORA_PATHS = frozenset({"/v1/load_lora_adapter", "/v1/unload_lora_adapter"})  # serving a new adapter: the admin's
DEBUG_PREFIX, BLOBS_PREFIX = "/v1/debug/", "/api/blobs/"


def _admin_action(path: str) -> str | None:
    """What an admin-only path does, for the 403; None for the paths any role may call."""
    if path in ADMIN_PATHS:
        return "change the model store"
    if path in LORA_PATHS:
        return "load or unload LoRA adapters"
    if path.startswith(BLOBS_PREFIX):
        return "use the model store's blobs"
    if path.startswith(DEBUG_PREFIX):
        return "read the engine's debug data"
    return None


def unauthorized() -> OpenAIError:
    return OpenAIError("invalid or missing API key (send `Authorization: Bearer KEY`)", status=401,
                       type_="authentication_error", code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


class Access:
    """Who may do what (an auth config, or the one `--api-key`), and the audit log."""

    def __init__(self, auth_config: str | None = None, api_key: str | None = None,
                 audit: AuditLog | None = None) -> None:
        if auth_config and api_key:
            raise ValueError("give --auth-config or --api-key, not both (a key in the auth config replaces --api-key)")
        self.auth_path = auth_config
        self.config: AuthConfig | None = AuthConfig.load(auth_config) if auth_config else None
        self.api_key = api_key
        self.audit = audit
        self.limits = LimitStore()
        self.reloads = 0

    @property
    def keep_content(self) -> bool:
        return self.audit is not None and self.audit.content

    @property
    def checks_keys(self) -> bool:
        return self.config is not None or self.api_key is not None

    # -- the config file -------------------------------------------------------------------------
    def reload(self) -> bool:
        """Read the auth config again; on any error keep the one in force and log why."""
        if self.auth_path is None:
            return False
        try:
            config = AuthConfig.load(self.auth_path)
        except AuthConfigError as e:
            logger.error("auth config not reloaded, the previous one stays in force: %s", e)
            return False
        self.config = config
        self.reloads += 1
        logger.warning("auth config %s reloaded: %d role(s), %d key(s) (%d revoked)", self.auth_path,
                       len(config.roles), len(config.keys), sum(k.revoked is not None for k in config.keys.values()))
        return True

    def install_reload_signal(self) -> None:
        """SIGHUP reloads the auth config (call in the server's event loop, on the main thread)."""
        if self.auth_path is None:
            return
        try:
            asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, self.reload)
        except (NotImplementedError, RuntimeError, ValueError) as e:  # not the main thread, or no SIGHUP here
            logger.warning("SIGHUP will not reload the auth config here: %s", e)

    # -- a request -------------------------------------------------------------------------------
    def authenticate(self, authorization: str) -> Grant | None:
        """The grant of an `Authorization` header value (None with only --api-key), else a 401
        (raised as an OpenAIError)."""
        config = self.config
        token = authorization[7:].strip() if authorization[:7].lower() == "bearer " else ""
        if config is None:
            if self.api_key is not None and not secrets.compare_digest(token.encode(), self.api_key.encode()):
                raise unauthorized()
            return None
        entry = config.authenticate(token)
        if entry is None:
            raise unauthorized()
        role = config.roles[entry.role]
        return Grant(entry, role, self.limits.get(entry.tenant, role.name), config.isolate_prefix_cache)

    def grant_for_key(self, key_id: str) -> Grant | None:
        """The grant of the key with this id, as the config says now (work a key started, such
        as a batch job, runs under it); a key removed or revoked since is a 401."""
        config = self.config
        if config is None:
            return None
        entry = next((k for k in config.keys.values() if k.id == key_id and k.revoked is None), None)
        if entry is None:
            raise OpenAIError(f"the key {key_id} that created this work was revoked or removed", status=401,
                              type_="authentication_error", code="key_revoked")
        role = config.roles[entry.role]
        return Grant(entry, role, self.limits.get(entry.tenant, role.name), config.isolate_prefix_cache)

    @staticmethod
    def admit_request(grant: Grant | None, path: str | None = None) -> None:
        """403 for the store's write routes unless the role is admin; 429 past requests per second."""
        if grant is None:
            return
        role = grant.role
        action = _admin_action(path) if path is not None and not role.admin else None
        if action is not None:
            raise OpenAIError(f"the key's role `{role.name}` may not {action} (needs `admin: true`)",
                              status=403, type_="permission_error", code="admin_required")
        refusal = grant.limits.take_request(role)
        if refusal is not None:
            raise _rate_limited(*refusal)

    def context_for(self, authorization: str, path: str | None = None) -> RequestContext:
        """A request's context, its key checked and its request admitted (else the OpenAIError)."""
        ctx = RequestContext(self.authenticate(authorization), self.keep_content)
        self.admit_request(ctx.grant, path)
        return ctx

    def audit_record(self, ctx: RequestContext, status: int | None, method: str, path: str,
                     client: str | None) -> dict:
        grant = ctx.grant
        record = {
            "time": timestamp(), "method": method, "path": path, "client": client,
            "tenant": grant.tenant if grant else None, "key_id": grant.key.id if grant else None,
            "role": grant.role.name if grant else None, "model": ctx.model, "status": status,
            "prompt_tokens": ctx.prompt_tokens, "completion_tokens": ctx.completion_tokens,
            "cached_tokens": ctx.cached_tokens, "latency_ms": round((time.monotonic() - ctx.start) * 1000, 1),
            "filter_hits": ctx.filter_hits,
        }
        if ctx.prompts is not None:
            record["prompts"] = [ctx.prompts[i] for i in sorted(ctx.prompts)]
            record["outputs"] = [ctx.outputs.get(i, "") for i in sorted(ctx.prompts)]
        return record


class AccessControl:
    """The ASGI middleware of `Access` (plain ASGI, as middleware.py explains: no per-chunk relay;
    the send wrapper that reads the status is there only with an audit log)."""

    def __init__(self, app: ASGIApp, access: Access) -> None:
        self.app, self.access = app, access

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or is_open(scope["path"]):
            await self.app(scope, receive, send)
            return
        access = self.access
        audit = access.audit
        status: int | None = None
        if audit is not None:
            async def send_noting_status(message: Message) -> None:
                nonlocal status
                if message["type"] == "http.response.start":
                    status = message["status"]
                await send(message)

            out = send_noting_status
        else:
            out = send
        ctx = RequestContext(None, access.keep_content)
        try:
            if access.checks_keys:
                ctx.grant = access.authenticate(_authorization(scope))
                access.admit_request(ctx.grant, scope["path"])
        except OpenAIError as e:  # 401, 403 (admin routes), 429 (requests per second)
            await error_response(e)(scope, receive, out)
        else:
            scope.setdefault("state", {})["access"] = ctx  # request.state.access
            token = CURRENT.set(ctx)
            try:
                await self.app(scope, receive, out)
            except asyncio.CancelledError:
                status = status or 499  # the client went away
                raise
            except BaseException:
                status = status or 500
                raise
            finally:
                CURRENT.reset(token)
                ctx.release()  # a concurrency slot the answer did not give back (it normally has)
        finally:
            if audit is not None:
                client = scope.get("client")
                audit.write(access.audit_record(ctx, status, scope.get("method", ""), scope["path"],
                                                client[0] if client else None))


def _authorization(scope: Scope) -> str:
    """The `Authorization` header, or Anthropic's `x-api-key` as a bearer token."""
    headers = dict(scope["headers"])  # (lower-case names in ASGI)
    if b"authorization" in headers:
        return headers[b"authorization"].decode("latin-1")
    if b"x-api-key" in headers:
        return "Bearer " + headers[b"x-api-key"].decode("latin-1")
    return ""


def grpc_context(access: Access | None, metadata) -> RequestContext | None:
    """A gRPC call's context from its metadata (`authorization: Bearer KEY`), set as the
    current one for the call's task; None when no key is checked. Raises the OpenAIError to
    answer (401 → UNAUTHENTICATED, 403 → PERMISSION_DENIED, 429 → RESOURCE_EXHAUSTED)."""
    if access is None or not access.checks_keys:
        return None
    given = dict(metadata or ()).get("authorization", "")
    ctx = access.context_for(given)
    CURRENT.set(ctx)
    return ctx


def access_from_args(args, api_key: str | None) -> Access | None:
    """The Access of `pagoda serve`'s options; None when no key, auth config or audit log is set
    (then the server checks nothing and pays nothing)."""
    audit = None
    if getattr(args, "audit_log", None):
        audit = AuditLog(args.audit_log, args.audit_log_max_bytes, args.audit_log_backups, args.audit_log_content)
    auth_config = getattr(args, "auth_config", None)
    if auth_config and api_key and not args.api_key:  # PAGODA_API_KEY from the environment: the file wins
        logger.warning("PAGODA_API_KEY is ignored: --auth-config gives the keys")
        api_key = None
    if not (auth_config or audit):
        return None  # --api-key alone: middleware.APIKeyCheck, as before
    return Access(auth_config, api_key, audit)


def install(app, access: Access | None, read_timeout: float | None = None) -> None:
    """Put access control, the audit log and the body read deadline on a built app (before it
    starts): AccessControl outermost, then BodyDeadline; SIGHUP reloads the auth config once the
    app runs. `serving.access` lets the gRPC service check the same keys."""
    if read_timeout:
        app.add_middleware(BodyDeadline, timeout=read_timeout)
    app.state.access = access
    if getattr(app.state, "serving", None) is not None:  # (none on the front of several models)
        app.state.serving.access = access
    if access is None:
        return
    app.add_middleware(AccessControl, access=access)

    async def on_startup() -> None:
        access.install_reload_signal()

    app.router.on_startup.append(on_startup)  # the audit log stays open to the end: requests drain after shutdown
