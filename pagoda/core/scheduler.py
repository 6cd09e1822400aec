"""Continuous batching with chunked prefill, priority order and preemption by recomputation.

Each step the scheduler hands out a token budget (`max_num_batched_tokens`):
1. running requests first, highest priority first; each gets the tokens it has not computed
   (1 for a decode, the rest of its prompt for a prefill, capped by what is left of the budget,
   which is how long prompts are chunked and mixed with decodes);
2. when the KV cache has no block for a running request, the lowest-priority, latest-arrived
   running request is preempted: its blocks are freed and it goes back to the waiting queue
   to be recomputed later (its generated tokens are kept, so its output does not change);
3. then waiting requests in (priority desc, arrival) order, while the budget, `max_num_seqs`
   and free blocks allow. No new request is admitted in a step that had to preempt.

The scheduler never touches tensors; it sees KV memory only through KVCacheManager.
"""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass, field

from pagoda.core.kv_cache_manager import KVCacheManager
from pagoda.request import Request, RequestStatus


@dataclass
class SchedulerOutput:
    """What to run this step: each request with the number of tokens to compute for it."""

    scheduled: list[tuple[Request, int]] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class SchedulerStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float  # blocks held by requests / all blocks (unused cached blocks count as free)
    num_preemptions_total: int
    num_blocks: int = 0
    num_cached_free_blocks: int = 0  # in the prefix cache, used by nobody: reclaimable
    prefix_cache_query_tokens: int = 0
    prefix_cache_hit_tokens: int = 0

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hit_tokens / self.prefix_cache_query_tokens if self.prefix_cache_query_tokens else 0.0

    @property
    def memory_pressure(self) -> float:
        """The seed's score: (used KV memory - reclaimable cached memory) / total KV memory."""
        return self.kv_cache_usage


class Scheduler:
    def __init__(
        self,
        kv_cache_manager: KVCacheManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
    ) -> None:
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        if max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {max_num_batched_tokens}")
        self.kv = kv_cache_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self._waiting: list[tuple[tuple[int, float, int], Request]] = []  # heap by schedule_key
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions_total = 0

    # -- queue management -------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self._push_waiting(request)

    def _push_waiting(self, request: Request) -> None:
        heapq.heappush(self._waiting, (request.schedule_key, request))

    def _peek_waiting(self) -> Request | None:
        while self._waiting and self._waiting[0][1].status.finished:
            heapq.heappop(self._waiting)  # lazily drop aborted entries
        return self._waiting[0][1] if self._waiting else None

    @property
    def num_waiting(self) -> int:
        return sum(1 for _, r in self._waiting if not r.status.finished)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def waiting_requests(self) -> list[Request]:
        return [r for _, r in sorted(self._waiting) if not r.status.finished]

    # -- scheduling -------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        self.running.sort(key=lambda r: r.schedule_key)

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if num_new <= 0:
                i += 1
                continue
            if not self._make_room(request, num_new, out):
                break  # the request itself was preempted; everything after it is gone too
            out.scheduled.append((request, num_new))
            budget -= num_new
            i += 1

        if not out.preempted:
            self._admit_waiting(out, budget)
        return out

    def _make_room(self, request: Request, num_new: int, out: SchedulerOutput) -> bool:
        """Allocate KV slots for request, preempting from the back of `running` until it fits."""
        while not self.kv.allocate_slots(request, num_new):
            victim = self.running[-1]  # lowest priority, latest arrival
            self._preempt(victim)
            out.preempted.append(victim.request_id)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions_total += 1
        self._push_waiting(request)

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while budget > 0 and len(self.running) < self.max_num_seqs:
            request = self._peek_waiting()
            if request is None:
                return
            cached = self.kv.match_prefix(request)
            if request.num_cached_tokens is None:
                request.num_cached_tokens = cached
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if not self.kv.allocate_slots(request, num_new):
                self.kv.free(request)  # give back the matched prefix; it stays cached
                request.num_computed_tokens = 0
                return
            heapq.heappop(self._waiting)
            request.status = RequestStatus.RUNNING
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()
            self.running.append(request)
            out.scheduled.append((request, num_new))
            budget -= num_new

    # -- after the model ran ----------------------------------------------------------------
    def update(self, out: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """Advance counters, append sampled tokens, finish requests. Returns finished requests."""
        finished = []
        for request, num_new in out.scheduled:
            if request.status.finished:
                continue  # aborted while the step ran
            request.num_computed_tokens += num_new
            token = sampled.get(request.request_id)
            if token is None:
                continue
            request.append_output_token(token)
            if self._check_stop(request, token):
                self._finish(request)
                finished.append(request)
        return finished

    def _check_stop(self, request: Request, token: int) -> bool:
        params = request.sampling_params
        if request.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token in params.all_stop_token_ids:
                request.status = RequestStatus.FINISHED_STOPPED
                return True
            if token in params.stop_token_ids:
                request.status = RequestStatus.FINISHED_STOPPED
                request.stop_reason = token
                return True
        if params.max_tokens is not None and request.num_output_tokens >= params.max_tokens:
            request.status = RequestStatus.FINISHED_LENGTH
            return True
        if request.num_tokens >= self.max_model_len:
            request.status = RequestStatus.FINISHED_LENGTH
            return True
        return False

    def _finish(self, request: Request) -> None:
        if request in self.running:
            self.running.remove(request)
        self.kv.free(request)
        self.requests.pop(request.request_id, None)

    def finish_request(self, request_id: str, status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> Request | None:
        """Finish a request from outside the step (abort, or a stop string seen by the detokenizer)."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        request.status = status
        self._finish(request)
        return request

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=self.num_waiting,
            kv_cache_usage=self.kv.usage(),
            num_preemptions_total=self.num_preemptions_total,
            num_blocks=self.kv.pool.num_blocks,
            num_cached_free_blocks=self.kv.num_evictable_blocks,
            prefix_cache_query_tokens=self.kv.prefix_query_tokens,
            prefix_cache_hit_tokens=self.kv.prefix_hit_tokens,
        )
