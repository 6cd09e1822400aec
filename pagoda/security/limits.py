"""Per-tenant limits of `--auth-config` roles: requests per second (a token bucket), requests at
once, and tokens per minute (a sliding 60 s window of prompt + completion tokens).

Limits are kept per (tenant, role): every key a tenant holds under one role shares one bucket,
one concurrency count and one token window, so handing a tenant more keys does not raise its
limits, and a tenant with keys under two roles has each role's limits separately. The state
lives in a `LimitStore` that survives config reloads (SIGHUP); each check reads the limits from
the role object it is given, so a reload applies new limits to the running counts at once.

Everything runs on the server's event loop (HTTP and gRPC alike): no locks.
"""

from __future__ import annotations

import time
from collections import deque

WINDOW = 60.0  # seconds: tokens_per_minute


class TenantLimits:
    """The limit state of one (tenant, role)."""

    __slots__ = ("in_flight", "refilled", "tokens", "window", "window_total")

    def __init__(self) -> None:
        self.tokens: float | None = None  # the bucket's level; None: full (first use)
        self.refilled = time.monotonic()
        self.in_flight = 0
        self.window: deque[tuple[float, int]] = deque()  # (when, tokens) charged in the last minute
        self.window_total = 0

    # -- requests per second -------------------------------------------------------------------
    def take_request(self, role, now: float | None = None) -> tuple[str, str, float] | None:
        """One request from the token bucket; (message, code, retry after seconds) if empty."""
        rate = role.requests_per_second
        if rate is None:
            return None
        now = time.monotonic() if now is None else now
        capacity = role.bucket_size
        level = capacity if self.tokens is None else min(capacity, self.tokens + (now - self.refilled) * rate)
        self.refilled = now
        if level >= 1.0:
            self.tokens = level - 1.0
            return None
        self.tokens = level
        return (f"rate limit reached: {rate:g} requests per second (burst {capacity:g}) for role `{role.name}`",
                "rate_limit_exceeded", (1.0 - level) / rate)

    # -- concurrency and tokens per minute (checked when a request is admitted) -----------------
    def admit(self, role, now: float | None = None) -> tuple[str, str, float] | None:
        """Take one of the concurrent slots; (message, code, retry after seconds) if a limit refuses."""
        refusal = self.refusal(role, now)
        if refusal is None:
            self.in_flight += 1
        return refusal

    def refusal(self, role, now: float | None = None) -> tuple[str, str, float] | None:
        """Why `admit` would refuse a request now, taking nothing (None: it would admit it)."""
        if role.max_concurrent is not None and self.in_flight >= role.max_concurrent:
            return (f"concurrency limit reached: {role.max_concurrent} requests at once for role `{role.name}`",
                    "concurrency_limit_exceeded", 1.0)
        if role.tokens_per_minute is not None:
            now = time.monotonic() if now is None else now
            self._expire(now)
            if self.window_total >= role.tokens_per_minute:
                message = (f"token limit reached: {role.tokens_per_minute} tokens per minute (prompt + completion) "
                           f"for role `{role.name}`, {self.window_total} used in the last minute")
                return message, "token_limit_exceeded", self._seconds_until_below(role.tokens_per_minute, now)
        return None

    def release(self, n: int = 1) -> None:
        self.in_flight = max(0, self.in_flight - n)

    def charge(self, tokens: int, now: float | None = None) -> None:
        """Tokens an engine request used, counted when it ends."""
        if tokens <= 0:
            return
        now = time.monotonic() if now is None else now
        self._expire(now)
        self.window.append((now, tokens))
        self.window_total += tokens

    def _expire(self, now: float) -> None:
        window = self.window
        while window and window[0][0] <= now - WINDOW:
            self.window_total -= window.popleft()[1]

    def _seconds_until_below(self, limit: int, now: float) -> float:
        total = self.window_total
        for when, tokens in self.window:
            total -= tokens
            if total < limit:
                return max(0.0, when + WINDOW - now)
        return WINDOW


class LimitStore:
    """The TenantLimits of every (tenant, role) seen, kept across config reloads."""

    def __init__(self) -> None:
        self._limits: dict[tuple[str, str], TenantLimits] = {}

    def get(self, tenant: str, role: str) -> TenantLimits:
        limits = self._limits.get((tenant, role))
        if limits is None:
            limits = self._limits[(tenant, role)] = TenantLimits()
        return limits
