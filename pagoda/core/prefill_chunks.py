"""How big a prefill chunk is, and how many prompts may be half-prefilled at once (vLLM's knobs).

The step's token budget (`max_num_batched_tokens`) bounds a step's total work and so the
inter-token latency of the requests decoding in it. Inside that budget, without limits, one long
prompt takes everything the decodes leave. Three knobs, named and meant as vLLM's
``SchedulerConfig`` fields, shape that share:

- ``long_prefill_token_threshold`` (0: off): a prefill takes at most this many tokens in one
  step, as in vLLM v1. A request whose uncomputed prompt is longer is *long*.
- ``max_num_partial_prefills`` (default 1): at most this many requests may be left mid-prefill
  by a step (scheduled a chunk short of the rest of their prompt, or still prefilling and not
  reached). A request whose prompt finishes in the step does not count: a burst of short prompts
  fills the budget as before. vLLM v0 enforced this limit (v1 accepts the flag and ignores it).
- ``max_long_partial_prefills`` (default 1, at most ``max_num_partial_prefills``): how many of
  those may be long. Below ``max_num_partial_prefills`` it keeps slots for shorter prompts,
  which then jump the queue in front of long ones.

With the defaults (0, 1, 1) the scheduler behaves as it did before these knobs: a step leaves at
most the one request that met the end of the budget mid-prefill.
"""

from __future__ import annotations

from dataclasses import dataclass

# vLLM: with several partial prefills and no threshold, a prompt above 4 % of the context is long.
DEFAULT_LONG_PREFILL_FRACTION = 0.04


@dataclass(frozen=True)
class PrefillChunking:
    """The three knobs, checked. ``chunk`` and ``slots`` are what the scheduler asks of them."""

    long_prefill_token_threshold: int = 0
    max_num_partial_prefills: int = 1
    max_long_partial_prefills: int = 1

    def __post_init__(self) -> None:
        check_prefill_chunking(self.long_prefill_token_threshold, self.max_num_partial_prefills,
                               self.max_long_partial_prefills)

    def chunk(self, remaining: int, budget: int) -> int:
        """Tokens a request with ``remaining`` uncomputed tokens computes this step; a decode
        (one token) is never cut by the threshold, which is at least 1 when set."""
        cap = self.long_prefill_token_threshold
        return min(remaining, budget, cap) if cap > 0 else min(remaining, budget)

    def is_long(self, remaining: int) -> bool:
        """Longer than the threshold (with no threshold every prompt left partial is long)."""
        return remaining > self.long_prefill_token_threshold

    def slots(self) -> PrefillSlots:
        return PrefillSlots(self)


@dataclass
class PrefillSlots:
    """One step's count of requests it leaves mid-prefill, against the limits."""

    limits: PrefillChunking
    partial: int = 0
    long: int = 0

    def hold(self, remaining: int, left: int) -> None:
        """Count a running request: ``remaining`` tokens before the step, ``left`` after it. More
        than one token left is a prefill still under way (one left is the next decode)."""
        if left > 1:
            self.partial += 1
            self.long += self.limits.is_long(remaining)

    def take(self, remaining: int, left: int) -> bool:
        """Whether a new request that would leave ``left`` tokens for later may start now; if
        so it is counted."""
        if left <= 1:
            return True
        long = self.limits.is_long(remaining)
        if self.partial >= self.limits.max_num_partial_prefills or \
                (long and self.long >= self.limits.max_long_partial_prefills):
            return False
        self.hold(remaining, left)
        return True


def check_prefill_chunking(threshold: int, max_partial: int, max_long: int) -> None:
    """A ValueError naming the knob (its CLI flag's name) that is out of range."""
    if threshold < 0:
        raise ValueError(f"long_prefill_token_threshold must be >= 0 (0: no limit), got {threshold!r}")
    if max_partial < 1:
        raise ValueError(f"max_num_partial_prefills must be >= 1, got {max_partial!r}")
    if not 1 <= max_long <= max_partial:
        raise ValueError(f"max_long_partial_prefills must be >= 1 and <= max_num_partial_prefills "
                         f"({max_partial}), got {max_long!r}")


def resolve_long_prefill_threshold(threshold: int, max_partial: int, max_model_len: int) -> int:
    """vLLM's default: with several partial prefills and no threshold, 4 % of the context."""
    if max_partial > 1 and threshold == 0:
        return max(1, int(max_model_len * DEFAULT_LONG_PREFILL_FRACTION))
    return threshold
