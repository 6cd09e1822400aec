"""Continuous batching with chunked prefill, priority order and preemption by recomputation.

With ``policy="priority"`` (the default) requests are ordered by *effective* priority (higher
first), then arrival. The effective priority is the request's `priority` plus one level for every
`aging_seconds` it has spent since arrival: the starvation guard. A low-priority request overtakes
newer high-priority ones once it has waited long enough, so a steady stream of VIP traffic delays
it but cannot stall it. ``policy="fcfs"`` ignores priorities: arrival order only, and so no
priority preemption.

Each step the scheduler hands out a token budget (`max_num_batched_tokens`):
1. priority preemption: while the first waiting request outranks the lowest running one and
   cannot be admitted (no sequence slot, or not enough KV blocks), that running request is
   preempted: a high-priority arrival takes blocks from low-priority running work;
2. running requests, highest first; each gets the tokens it has not computed (1 for a decode,
   the rest of its prompt for a prefill, capped by what is left of the budget, which is how long
   prompts are chunked and mixed with decodes; `long_prefill_token_threshold` caps a prefill's
   chunk further, see prefill_chunks.py). When the KV cache has no block for one, the
   lowest, latest-arrived running request is preempted: its blocks are freed (its full blocks
   stay in the prefix cache) and it is recomputed later, keeping its generated tokens;
3. waiting requests in order while the budget, `max_num_seqs` and KV blocks allow. None is
   admitted in a step whose running requests had to preempt, and none (except one that preempted
   for priority) while memory pressure is above `admission_pressure_threshold` unless a block of
   headroom per running request remains: a new prefill must not force running work out. A
   request that would be left mid-prefill is admitted only while `max_num_partial_prefills`
   (and `max_long_partial_prefills`) allow; one that does not fit is passed over for later ones
   whose prompt finishes in this step.

The scheduler never touches tensors; it sees KV memory only through KVCacheManager. It is the
only writer of ``Request``: the workers get a plain ``SchedulerOutput`` each step (the deltas since
the last one, see scheduler_output.py) and answer with a ``ModelRunnerOutput``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagoda.core.block_tables import add_blocks, add_prefix, clear_blocks
from pagoda.core.kv_cache_manager import KVCacheManager
from pagoda.core.lora_residency import LoRAResidency
from pagoda.core.prefill_chunks import PrefillChunking, PrefillSlots
from pagoda.core.request_order import RequestOrder, background_yields, is_background
from pagoda.core.scheduler_output import SchedulerOutput
from pagoda.core.scheduler_stats import SchedulerStats, SpecDecodeCounters, scheduler_stats
from pagoda.core.state_slots import StateSlots
from pagoda.core.stop_conditions import grammar_verdict, stop_verdict
from pagoda.core.worker_deltas import WorkerDeltas
from pagoda.engine_args import EngineArgs
from pagoda.multimodal.inputs import fit_to_images
from pagoda.outputs import ModelRunnerOutput
from pagoda.request import Request, RequestStatus

if TYPE_CHECKING:
    from pagoda.structured_output.manager import GrammarState


@dataclass
class _Step:
    """The scheduler's working list for one step, before it becomes a SchedulerOutput."""

    scheduled: list[tuple[Request, int]] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    spec_tokens: dict[str, list[int]] = field(default_factory=dict)
    state_copies: list[tuple[int, int]] = field(default_factory=list)  # (kept prefix's state, request's slot)


class Scheduler:
    def __init__(self, kv_cache_manager: KVCacheManager, *, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, aging_seconds: float = EngineArgs.aging_seconds,
                 admission_pressure_threshold: float = EngineArgs.admission_pressure_threshold,
                 spec_disable_by_batch_size: int | None = None, spec_lookahead: int = 0,
                 policy: str = EngineArgs.scheduling_policy, chunking: PrefillChunking | None = None,
                 loras: LoRAResidency | None = None, states: StateSlots | None = None) -> None:
        """``spec_lookahead``: KV slots to allocate, where free, after the tokens of a request
        that samples this step, for the drafts a draft model writes when it proposes.
        ``policy``: "priority" (priorities and aging order the queues) or "fcfs" (arrival only).
        ``chunking``: the prefill chunk limits (default: none beyond the budget). ``loras``: the
        LoRA adapters the workers hold and the bound on those in one batch (None: LoRA is off).
        ``states``: a state-space model's recurrent-state slots, one per running request (None: the
        model keeps none); a request is admitted only with a free one."""
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        if max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {max_num_batched_tokens}")
        self.order = RequestOrder(policy, aging_seconds)
        self.chunking = chunking or PrefillChunking()
        self.kv = kv_cache_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.admission_pressure_threshold = admission_pressure_threshold
        self.spec_disable_by_batch_size = spec_disable_by_batch_size
        self.spec_lookahead = spec_lookahead
        self._waiting: list[Request] = []
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions_total = 0
        self.loras = loras
        self.states = states
        self.deltas = WorkerDeltas(loras)  # what the workers know of each request (and their adapters)
        self.spec = SpecDecodeCounters()

    # -- queue management -------------------------------------------------------------------
    def add_request(self, request: Request, grammar: GrammarState | None = None) -> None:
        """Queue a request; ``grammar``: its compiled constraint (structured outputs), compiling."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        request.grammar = grammar
        self.requests[request.request_id] = request
        self._waiting.append(request)

    @property
    def num_waiting(self) -> int:
        return sum(1 for r in self._waiting if not r.status.finished)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def waiting_requests(self) -> list[Request]:
        return sorted((r for r in self._waiting if not r.status.finished), key=self.order.key(time.monotonic()))

    # -- scheduling -------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Choose this step's work; the message for the workers describes it."""
        out = _Step()
        now = time.monotonic()
        self._waiting = [r for r in self._waiting if not r.status.finished]
        self._waiting.sort(key=self.order.key(now, self._waiting))
        self.running.sort(key=self.order.key(now, self.running))
        favored = self._preempt_for_priority(now, out)

        budget = self.max_num_batched_tokens
        growth_preempted = False
        yielding = background_yields(self.running, self._waiting)
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = self._chunk(request, budget)
            if num_new <= 0 or (yielding and is_background(request)):
                i += 1
                continue
            drafts = self._drafts_to_verify(request, budget) if request.spec_token_ids else []
            num_new += len(drafts)
            if not self.kv.has_room(request, num_new):  # (most decode steps: the last block has room)
                preempted_before = len(out.preempted)
                fits = self._make_room(request, num_new, out)
                growth_preempted |= len(out.preempted) > preempted_before
                if not fits:
                    break  # the request itself was preempted; everything after it is gone too
            out.scheduled.append((request, num_new))
            if drafts:
                out.spec_tokens[request.request_id] = drafts
            budget -= num_new
            i += 1

        if not growth_preempted:
            self._admit_waiting(out, budget, favored, self._partial_slots(out))
        self._allocate_lookahead(out)
        message = self.deltas.message(out.scheduled, out.preempted, out.spec_tokens)
        if self.kv.snapshots is not None:
            self.kv.snapshots.add_to(message, out.scheduled, out.state_copies)
        return message

    def _chunk(self, request: Request, budget: int) -> int:
        """Tokens of the request's rest this step computes: the chunk limits, and an image's run
        whole (its tokens attend both ways)."""
        num_new = self.chunking.chunk(request.num_tokens - request.num_computed_tokens, budget)
        return fit_to_images(request.images, request.num_computed_tokens, num_new) if request.images else num_new

    def _drafts_to_verify(self, request: Request, budget: int) -> list[int]:
        """The request's drafts that fit this step: it must be decoding (one token to compute),
        and the drafts must fit the budget, the context and what is left of max_tokens (a run of
        accepted drafts ends with one token of the target's own)."""
        drafts = request.spec_token_ids
        if not drafts or request.num_tokens - request.num_computed_tokens != 1:
            return []
        limit = self.spec_disable_by_batch_size
        if limit is not None and len(self.running) > limit:
            return []  # a big batch: verify rows would cost more than the drafts save
        room = min(budget - 1, self.max_model_len - request.num_tokens)
        max_tokens = request.sampling_params.max_tokens
        if max_tokens is not None:
            room = min(room, max_tokens - request.num_output_tokens - 1)
        drafts = drafts[: max(0, room)]
        if request.grammar is not None and drafts:
            drafts = drafts[: request.grammar.valid_prefix(drafts)]  # the mask after a refused draft is undefined
        return drafts

    def _allocate_lookahead(self, step: "_Step") -> None:
        """Slots for the drafts a draft model will write after this step's tokens, for each
        scheduled request that samples, once everything else is scheduled and only from free
        blocks: nothing is preempted, admitted later or evicted from the prefix cache for them,
        and a request without them gets fewer drafts."""
        limit = self.spec_disable_by_batch_size
        if not self.spec_lookahead or (limit is not None and len(self.running) > limit):
            return
        for request, num_new in step.scheduled:
            samples = request.num_computed_tokens + num_new >= request.num_tokens
            wanted = num_new + self.spec_lookahead
            if samples and self.kv.blocks_needed(request, wanted) <= self.kv.pool.num_free_blocks:
                add_blocks(request, self.kv.allocate_slots(request, wanted))

    def _blocks_to_admit(self, request: Request) -> int:
        first_chunk = self.chunking.chunk(request.num_tokens, self.max_num_batched_tokens)
        return self.kv.blocks_for_tokens(first_chunk)

    def _partial_slots(self, step: "_Step") -> PrefillSlots:
        """The partial-prefill slots left for new requests: the running requests that this step
        leaves mid-prefill (scheduled a chunk short of their prompt, or not reached) hold theirs."""
        slots = self.chunking.slots()
        scheduled = {request.request_id: num_new for request, num_new in step.scheduled}
        for request in self.running:
            remaining = request.num_tokens - request.num_computed_tokens
            if remaining > 1:  # (hold counts nothing for a decode: one token, or none left)
                slots.hold(remaining, remaining - scheduled.get(request.request_id, 0))
        return slots

    def _preempt_for_priority(self, now: float, out: "_Step") -> Request | None:
        """Preempt low-priority running work that stands in the way of the first waiting request."""
        head = self._first_admissible()
        if head is None or not self.running:
            return None
        favored = None
        while self.running:
            victim = self.running[-1]
            if self.order.priority(head, now) <= self.order.priority(victim, now):
                break
            no_slot = len(self.running) >= self.max_num_seqs or not self._has_state_slot()
            no_blocks = self._blocks_to_admit(head) > self.kv.num_free_blocks
            if not (no_slot or no_blocks):
                break
            self._preempt(victim)
            out.preempted.append(victim.request_id)
            favored = head
        return favored

    def _make_room(self, request: Request, num_new: int, out: "_Step") -> bool:
        """Allocate KV slots for request, preempting from the back of `running` until it fits."""
        while not add_blocks(request, self.kv.allocate_slots(request, num_new)):
            victim = self.running[-1]  # lowest priority, latest arrival
            self._preempt(victim)
            out.preempted.append(victim.request_id)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv.free(request)
        clear_blocks(request)
        self._free_state(request)  # recomputed from its tokens when it runs again
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.spec_token_ids = []
        self.num_preemptions_total += 1
        self.deltas.preempted(request.request_id)  # the workers keep its state (generator) but not its blocks
        self._waiting.append(request)
        self._waiting.sort(key=self.order.key(time.monotonic()))

    def _first_admissible(self) -> Request | None:
        """The first waiting request in order, passing over those whose grammar still compiles."""
        return next((r for r in self._waiting if not r.waiting_for_grammar), None)

    def _under_pressure(self, extra_blocks: int) -> bool:
        """Above the pressure threshold, keep a block of headroom per running request (one per
        KV cache group)."""
        if not self.running or self.kv.usage() < self.admission_pressure_threshold:
            return False
        return self.kv.num_free_blocks - extra_blocks < len(self.running) * self.kv.num_groups

    def _admit_waiting(self, out: "_Step", budget: int, favored: Request | None, slots: PrefillSlots) -> None:
        """Admit waiting requests in order. One that this step would leave mid-prefill needs a
        partial-prefill slot; without one it is passed over (it keeps its place in the queue)
        and later requests whose prompt fits whole may go. Anything else that does not fit
        (KV blocks, memory pressure) ends admission for this step."""
        for request in list(self._waiting):
            if budget <= 0 or len(self.running) >= self.max_num_seqs or not self._has_state_slot():
                return
            if request.waiting_for_grammar or (self.loras is not None and not self.loras.fits(request, self.running)):
                continue
            cached = add_prefix(request, self.kv.match_prefix(request), self.kv.block_size)
            remaining, num_new = request.num_tokens - request.num_computed_tokens, self._chunk(request, budget)
            whole = request.pooling_params is None or num_new == remaining  # a pooling prompt runs in one step
            if num_new <= 0 or not whole or not slots.take(remaining, remaining - num_new):
                self._give_back_prefix(request)
                continue
            if (request is not favored and self._under_pressure(self.kv.blocks_needed(request, num_new))) \
                    or not add_blocks(request, self.kv.allocate_slots(request, num_new)):
                self._give_back_prefix(request)
                return
            self._waiting.remove(request)
            self.kv.record_prefix_query(request, cached)  # here, not per attempt: a waiting request retries every step
            if request.num_cached_tokens is None:
                request.num_cached_tokens = cached
            request.status = RequestStatus.RUNNING
            if self.states is not None:
                request.state_slot = self.states.allocate(request.request_id)
                if cached and (copy := self.kv.snapshots.copy_for(request)):
                    out.state_copies.append(copy)
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()
            self.running.append(request)
            out.scheduled.append((request, num_new))
            budget -= num_new

    def _has_state_slot(self) -> bool:
        return self.states is None or self.states.num_free > 0

    def _free_state(self, request: Request) -> None:
        if self.states is not None:
            self.states.free(request.state_slot)
            request.state_slot = None

    def _give_back_prefix(self, request: Request) -> None:
        """Undo ``match_prefix`` for a request that stays waiting; its prefix stays cached."""
        self.kv.free(request)
        clear_blocks(request)
        request.num_computed_tokens = 0

    # -- after the model ran ----------------------------------------------------------------
    def update(self, out: SchedulerOutput, result: ModelRunnerOutput) -> list[Request]:
        """Advance counters, append sampled tokens, finish requests. Returns finished requests."""
        finished = []
        if self.kv.snapshots is not None:
            self.kv.snapshots.commit()  # the states the step saved can be found now
        self.spec.draft_seconds += result.spec_draft_seconds
        self.spec.verify_seconds += result.spec_verify_seconds
        # (looked up once: this loop runs for every request every step)
        requests, sampled, spec_tokens = self.requests, result.sampled_token_ids, out.scheduled_spec_tokens
        prompt_logprobs, proposed, kv = result.prompt_logprobs, result.spec_token_ids, self.kv
        releases = kv.releases_out_of_window
        for rid, num_new in out.num_scheduled_tokens.items():
            request = requests.get(rid)
            if request is None or request.status.finished:
                continue  # aborted while the step ran
            tokens = sampled.get(rid, [])
            drafts = spec_tokens.get(rid, ())
            # KV is valid for the last token and the accepted drafts; the rejected ones' slots
            # are written again later (the one num_computed_tokens rule rolls them back)
            rejected = len(drafts) - (len(tokens) - 1) if drafts else 0
            request.num_computed_tokens += num_new - rejected
            if prompt_logprobs:
                request.num_prompt_logprobs_done += len(prompt_logprobs.get(rid, ()))
            if drafts:
                self.spec.count(len(drafts), len(tokens) - 1)
            request.spec_token_ids = proposed.get(rid, []) if proposed else []
            stopped = self._append(request, tokens)
            if request.pooling_params is not None and request.num_computed_tokens >= request.num_tokens:
                request.status, stopped = RequestStatus.FINISHED_STOPPED, True  # pooled: its prompt was its run
            if drafts:  # a stop inside an accepted run leaves computed drafts that were never appended
                request.num_computed_tokens = min(request.num_computed_tokens, request.num_tokens - 1)
            kv.cache_computed_blocks(request)
            if releases:
                kv.release_out_of_window(request)
            if stopped:
                self._finish(request)
                finished.append(request)
        return finished

    def _append(self, request: Request, tokens: list[int]) -> bool:
        """Append the step's tokens until one stops the request; whether one did."""
        for token in tokens:
            request.append_output_token(token)
            stop = stop_verdict(request, token, self.max_model_len)
            if stop is None and request.grammar is not None:
                stop = grammar_verdict(request, token)
            if stop is not None:
                request.status, reason = stop
                if reason is not None:
                    request.stop_reason = reason
                return True
        return False

    def _finish(self, request: Request) -> None:
        if request in self.running:
            self.running.remove(request)
        self.kv.free(request, finished=True)
        clear_blocks(request)
        self._free_state(request)
        self.requests.pop(request.request_id, None)
        self.deltas.finished(request.request_id)

    def finish_request(self, request_id: str, status: RequestStatus = RequestStatus.FINISHED_ABORTED,
                       stop_reason: str | None = None) -> Request | None:
        """Finish a request from outside the step (abort, a stop string seen by the detokenizer, a
        grammar that failed to compile: ``stop_reason`` says why)."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        request.status = status
        if stop_reason is not None:
            request.stop_reason = stop_reason
        self._finish(request)
        return request

    def stats(self) -> SchedulerStats:
        return scheduler_stats(len(self.running), self.num_waiting, self.num_preemptions_total, self.kv, self.spec)
