"""EngineCore: the step loop over scheduler → model runner → scheduler update.

It works on token ids only (no tokenizer, no text); the front end (LLMEngine) owns those.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from pagoda.config import EngineConfig
from pagoda.core.kv_cache_groups import KVCacheGroups
from pagoda.core.kv_cache_manager import KVCacheManager
from pagoda.core.kv_events import KVEventLog
from pagoda.core.prefill_chunks import PrefillChunking
from pagoda.core.lora_residency import LoRAResidency
from pagoda.core.scheduler import Scheduler
from pagoda.core.state_slots import StateSlots
from pagoda.core.state_snapshots import StateSnapshots
from pagoda.core.scheduler_stats import SchedulerStats
from pagoda.core.scheduler_output import SchedulerOutput
from pagoda.engine.kv_offload import hand_off, open_kv_tiers
from pagoda.models.layer_readiness import LoadFailed
from pagoda.engine.step_trace import StepTrace, radix_snapshot
from pagoda.executor import make_executor
from pagoda.outputs import TokenLogprobs
from pagoda.request import EngineCoreRequest, Request, RequestStatus
from pagoda.structured_output.manager import StructuredOutputManager, build_token_bitmask

logger = logging.getLogger(__name__)


@dataclass
class EngineCoreOutput:
    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    new_logprobs: list[TokenLogprobs] | None = None
    new_prompt_logprobs: list[TokenLogprobs] | None = None
    num_cached_tokens: int = 0
    first_scheduled_time: float | None = None  # monotonic; arrival → here is the queue time
    pooled: torch.Tensor | None = None  # a pooling request's vector (its one output, with its finish)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class RequestLimits:
    """What a request must fit, known once the core is built. Immutable, so any thread or
    process (the server's event loop) can validate requests against it."""

    max_model_len: int
    vocab_size: int
    num_blocks: int

    def validate(self, request: EngineCoreRequest) -> None:
        num_prompt_tokens = len(request.prompt_token_ids)
        if num_prompt_tokens < 1:
            raise ValueError("the prompt is empty: give at least one token")
        if request.pooling_params is not None and num_prompt_tokens > self.max_model_len:  # pooled: nothing generated
            raise ValueError(f"the input has {num_prompt_tokens} tokens, more than the model's maximum of "
                             f"{self.max_model_len} (max_model_len)")
        if request.pooling_params is None and num_prompt_tokens >= self.max_model_len:
            raise ValueError(
                f"the prompt has {num_prompt_tokens} tokens, but the model's context is "
                f"{self.max_model_len} tokens (max_model_len), which leaves no room to generate"
            )
        bad = [t for t in request.prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids must be in [0, {self.vocab_size}), got {bad[:5]}")


# What `debug_snapshot("all")` (the dashboard's view, a few times a second) holds of each view.
DASHBOARD_LIMITS = {"engine": None, "steps": 32, "requests": 25, "radix": 20}


def _open_kv_events(config: EngineConfig, kv_manager: KVCacheManager):
    """The KV events' publisher (--kv-events-config), its log attached to the KV cache manager; None when off."""
    if config.kv_events is None:
        return None
    try:
        # deferred: loads zmq and msgspec, only for a server that publishes events
        from pagoda.engine.kv_events_publisher import ZmqEventPublisher
    except ImportError as exc:
        raise ValueError(f"kv_events_config needs pyzmq and msgspec: pip install 'pagoda[kv-events]' ({exc})") from None
    publisher = ZmqEventPublisher(config.kv_events)
    kv_manager.events = KVEventLog(kv_manager.block_size)
    return publisher


def _state_slots(worker) -> StateSlots | None:
    """A state-space model's recurrent-state slots, as many as the workers allocated (None: none)."""
    if not worker.num_state_slots:
        return None
    logger.info("recurrent state: %d slots (one per running request) in %d state-space layers",
                worker.num_state_slots, len(worker.state_layers))
    return StateSlots(worker.num_state_slots)


def _state_snapshots(config: EngineConfig, worker) -> StateSnapshots | None:
    """With prefix caching, a state-space model keeps its states after cached prefixes in the slots
    after the running requests' (core/state_snapshots.py); None for any other model."""
    if not worker.num_snapshot_slots:
        return None
    return StateSnapshots(worker.num_state_slots, worker.num_snapshot_slots, config.cache.state_snapshot_interval,
                          config.cache.block_size)


class EngineCore:
    """The scheduler and an executor (its workers hold the model and the KV cache)."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        mc = config.model
        start = time.monotonic()
        self.executor = make_executor(config)
        self.load_seconds = time.monotonic() - start
        self.num_blocks = self.executor.determine_num_blocks()
        block_size = config.cache.block_size
        kv_groups = self.executor.driver_worker.kv_groups  # which layers share a block table, as the workers hold them
        capacity = _token_capacity(self.num_blocks, block_size, kv_groups, config.scheduler.max_num_batched_tokens)
        self.max_model_len = mc.max_model_len
        if capacity < self.max_model_len:
            logger.warning("KV cache holds %d tokens, less than max_model_len=%d: capping max_model_len", capacity, self.max_model_len)
            self.max_model_len = capacity
        self.executor.initialize_cache(self.num_blocks, self.max_model_len)
        self.forward_path = self.executor.driver_rpc("forward_path")  # chosen once, with the cache bound
        logger.info("forward: %s: %s", "fused C++ decode stack" if self.forward_path["fused_decode"]
                    else "Python layers every step", self.forward_path["reason"])
        if kv_groups.is_hybrid:
            logger.info("KV cache: %d blocks of %d tokens in %d groups (global layers; sliding-window layers, "
                        "window %d, in groups of %d): the windowed groups give back what their window has passed",
                        self.num_blocks, block_size, kv_groups.num_groups, kv_groups.local_window,
                        kv_groups.slots_per_block)
        cc = config.cache
        if not 0.0 <= cc.session_kv_fraction <= 1.0:
            raise ValueError(f"session_kv_fraction must be in [0, 1], got {cc.session_kv_fraction}")
        session_tokens = self.max_model_len if cc.max_session_kv_tokens is None else cc.max_session_kv_tokens
        self.kv_manager = KVCacheManager(self.num_blocks, block_size, cc.enable_prefix_caching,
                                         session_max_blocks=session_tokens // block_size,
                                         session_total_blocks=int(self.num_blocks * cc.session_kv_fraction),
                                         sliding_window=_releasable_window(config, self.model), kv_groups=kv_groups)
        self.kv_manager.snapshots = _state_snapshots(config, self.executor.driver_worker)
        self.kv_tiers = open_kv_tiers(config, self.executor.driver_worker, self.kv_manager)
        self.kv_events = _open_kv_events(config, self.kv_manager)
        sc = config.scheduler
        self.scheduler = Scheduler(
            self.kv_manager, max_num_seqs=sc.max_num_seqs, max_num_batched_tokens=sc.max_num_batched_tokens,
            max_model_len=self.max_model_len, aging_seconds=sc.aging_seconds,
            admission_pressure_threshold=sc.admission_pressure_threshold,
            spec_disable_by_batch_size=config.speculative.disable_by_batch_size if config.speculative else None,
            spec_lookahead=_spec_lookahead(config.speculative), policy=sc.policy,
            chunking=PrefillChunking(sc.long_prefill_token_threshold, sc.max_num_partial_prefills,
                                     sc.max_long_partial_prefills),
            loras=LoRAResidency(config.lora.max_loras, config.lora.max_cpu_loras) if config.lora else None,
            states=_state_slots(self.executor.driver_worker),
        )
        self.num_steps = 0
        self.vocab_size = self.model.config.vocab_size
        self.limits = RequestLimits(self.max_model_len, self.vocab_size, self.num_blocks)
        self._structured_outputs: StructuredOutputManager | None = None
        self._compiling: list[Request] = []  # constrained requests whose grammar is not compiled yet
        self.trace = StepTrace()  # the last steps and requests, for /v1/debug (engine/step_trace.py)

    @property
    def model(self) -> torch.nn.Module:
        """Rank 0's model (rank 0 always lives in this process)."""
        return self.executor.driver_worker.model

    @property
    def runner(self):
        """Rank 0's model runner (tests and benchmarks reach into it)."""
        return self.executor.driver_worker.runner

    def loading_progress(self) -> dict | None:
        """A layer-by-layer load's progress (loader/progressive_load.py; None: loaded whole), read by the server's thread."""
        return self.executor.driver_worker.loading_progress()

    def wait_until_loaded(self) -> None:
        """Return once the model is all in place; raise the loader's own error, as a whole load would."""
        readiness = self.executor.driver_worker.readiness
        try:
            if readiness is not None:
                readiness.wait_loaded()
        except LoadFailed as e:
            raise e.__cause__ from None

    def _current_forward_path(self) -> dict:
        """The forward path, chosen again once a model loading layer by layer is all in place."""
        progress = self.loading_progress()
        if progress is not None and not progress["loading"] and not self.forward_path["fused_decode"]:
            self.forward_path = self.executor.driver_rpc("forward_path")
        return self.forward_path

    def shutdown(self) -> None:
        """Stop the workers (other ranks' processes exit); the disk tier's queued writes finish first."""
        if self.kv_tiers is not None:
            self.kv_tiers.close()
        if self.kv_events is not None:
            self.kv_events.close()
        self.executor.shutdown()

    def check_health(self) -> None:
        """Raise ``WorkerFailedError`` if a worker of another rank has died."""
        self.executor.check_health()

    # -- requests ---------------------------------------------------------------------------
    def validate_request(self, request: EngineCoreRequest) -> None:
        self.limits.validate(request)

    def add_request(self, message: EngineCoreRequest) -> None:
        """Take a front end's request: the core's own ``Request`` is made here."""
        self.validate_request(message)
        request = Request.of(message)
        constraint = request.sampling_params.structured_outputs if request.sampling_params is not None else None
        grammar = self.structured_outputs.grammar_for(constraint) if constraint is not None else None
        self.scheduler.add_request(request, grammar)
        if self.kv_manager.tiers is not None:
            self.kv_manager.tiers.prefetch(request)  # read ahead from disk while it waits
        if grammar is not None:
            self._compiling.append(request)
        self.trace.arrived(request)

    @property
    def structured_outputs(self) -> StructuredOutputManager:
        """Built on the first constrained request (its token trie, ~0.7 s for a 49k vocabulary, is
        built on the compile thread, not here)."""
        if self._structured_outputs is None:
            from pagoda.tokenizer import Tokenizer  # deferred: loads tokenizers

            metadata_dir = self.config.model.files.metadata_dir
            stop_ids = Tokenizer(metadata_dir).eos_token_ids
            self._structured_outputs = StructuredOutputManager(metadata_dir, self.vocab_size, stop_ids)
        return self._structured_outputs

    def _grammar_failures(self) -> list[EngineCoreOutput]:
        """Finish requests whose grammar failed to compile; drop compiled ones from the watch list."""
        failed, pending = [], []
        for request in self._compiling:
            if request.is_finished or not request.waiting_for_grammar:
                if request.grammar.error is not None and not request.is_finished:
                    logger.error("request %s: grammar compilation failed: %s", request.request_id, request.grammar.error)
                    self.scheduler.finish_request(request.request_id, RequestStatus.FINISHED_ABORTED,
                                                  f"grammar compilation failed: {request.grammar.error}")
                    self.trace.finished(request, "abort")
                    failed.append(EngineCoreOutput(request.request_id, [], "abort", request.stop_reason))
                continue
            pending.append(request)
        self._compiling = pending
        return failed

    def abort_requests(self, request_ids: list[str]) -> None:
        self.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def finish_requests(self, request_ids: list[str], status: RequestStatus) -> None:
        """Finish requests from outside a step (abort, or a stop string the detokenizer saw)."""
        for rid in request_ids:
            request = self.scheduler.finish_request(rid, status)
            if request is not None:
                self.trace.finished(request, status.finish_reason)

    def release_sessions(self, session_ids: list[str]) -> None:
        """Sessions that ended: their pinned prefixes become ordinary cache."""
        for sid in session_ids:
            self.kv_manager.release_session(sid)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def stats(self) -> SchedulerStats:
        return self.scheduler.stats()

    def debug_snapshot(self, what: str, limit: int | None = None) -> dict:
        """The recorder's view for /v1/debug (plain data): `engine`, `steps`, `requests`, `radix`,
        or `all` of them (the dashboard's one call per update)."""
        if what == "all":  # as much as the dashboard shows
            return {name: self.debug_snapshot(name, limit) for name, limit in DASHBOARD_LIMITS.items()}
        if what == "engine":
            stats = self.stats()
            fields = {**vars(stats), "prefix_cache_hit_rate": stats.prefix_cache_hit_rate,
                      "memory_pressure": stats.memory_pressure}
            sc, cc = self.config.scheduler, self.config.cache
            config = {"max_num_seqs": sc.max_num_seqs, "max_num_batched_tokens": sc.max_num_batched_tokens,
                      "max_model_len": self.max_model_len, "block_size": cc.block_size, "num_blocks": self.num_blocks,
                      "enable_prefix_caching": cc.enable_prefix_caching, "forward": self._current_forward_path(),
                      "loading": self.loading_progress()}
            return self.trace.engine_snapshot(fields, config)
        if what == "steps":
            return {"steps": self.trace.steps_snapshot(limit or 256)}
        if what == "requests":
            return {"requests": self.trace.requests_snapshot(limit or 100)}
        if what == "radix":
            return radix_snapshot(self.kv_manager.cache, limit or 20)
        raise ValueError(f"unknown debug view {what!r}: expected engine, steps, requests, radix or all")

    # -- the step ---------------------------------------------------------------------------
    def step(self) -> list[EngineCoreOutput]:
        failed = self._grammar_failures() if self._compiling else []
        sched = self.scheduler.schedule()
        if sched.is_empty:
            if self._compiling and not failed:
                # Only requests waiting for their grammar: sleep until one compiles, not spin.
                StructuredOutputManager.wait_any([r.grammar for r in self._compiling], timeout=0.05)
            return failed
        self._attach_grammar_bitmask(sched)
        if self.kv_manager.tiers is not None:
            self.kv_manager.tiers.attach(sched)
        self.trace.begin_step(sched, self.scheduler.requests)
        result = self.executor.execute_model(sched)
        requests = self.scheduler.requests
        before = {rid: len(r.output_token_ids) for rid in sched.num_scheduled_tokens
                  if (r := requests.get(rid)) is not None}
        finished = {r.request_id: r for r in self.scheduler.update(sched, result)}
        if self.kv_events is not None:  # the step's stored and evicted blocks, to the subscribers
            self.kv_events.publish(self.kv_manager.events.take())
        if finished and self.config.kv_offload.role == "prefill":
            hand_off(self.kv_tiers, self.kv_manager.tiers)  # the blocks are shared before the answer leaves
        self.num_steps += 1
        outputs = failed
        generated = 0
        for rid in sched.num_scheduled_tokens:
            request = finished.get(rid) or requests.get(rid)
            if request is None:
                continue  # aborted while the step ran
            # what the scheduler appended: the sampled tokens, cut where a stop condition ended the run
            new_tokens = request.output_token_ids[before.get(rid, request.num_output_tokens):]
            generated += len(new_tokens)
            prompt_lps = result.prompt_logprobs.get(rid)
            if not new_tokens and prompt_lps is None and rid not in finished:
                continue
            lps = result.logprobs.get(rid)
            outputs.append(EngineCoreOutput(
                request_id=rid,
                new_token_ids=new_tokens,
                finish_reason=request.status.finish_reason if rid in finished else None,
                stop_reason=request.stop_reason,
                new_logprobs=lps[: len(new_tokens)] if lps is not None else None,
                new_prompt_logprobs=prompt_lps,
                first_scheduled_time=request.first_scheduled_time,
                num_cached_tokens=request.num_cached_tokens or 0,
                pooled=result.pooler_output.get(rid),
            ))
        self._trace_step(sched, generated, finished)
        return outputs

    def _trace_step(self, sched: SchedulerOutput, generated: int, finished: dict[str, Request]) -> None:
        """Tell the recorder how the step ended: tokens generated, the queue, finishes."""
        running = len(self.scheduler.running)
        self.trace.end_step(sched, generated, running, len(self.scheduler.requests) - running,
                            self.kv_manager.usage())
        for request in finished.values():
            self.trace.finished(request, request.status.finish_reason)

    def _attach_grammar_bitmask(self, sched: SchedulerOutput) -> None:
        """The allowed tokens of each constrained request that samples this step (at each
        position of its run, with drafts): the matchers live here, beside the scheduler that
        advances them, so the mask rides in the message."""
        rids, states, drafts = [], [], []
        for rid, num_new in sched.num_scheduled_tokens.items():
            request = self.scheduler.requests[rid]
            run = sched.scheduled_spec_tokens.get(rid, [])
            if request.grammar is not None and request.num_computed_tokens + num_new - len(run) == request.num_tokens:
                rids.append(rid)
                states.append(request.grammar)
                drafts.append(run)
        if states:
            sched.grammar_bitmask, firsts = build_token_bitmask(states, self.vocab_size, drafts)
            sched.grammar_rows = dict(zip(rids, firsts))


def _spec_lookahead(spec) -> int:
    """A draft model writes its drafts' K/V after a request's tokens when it proposes (prompt
    lookup writes nothing)."""
    return spec.num_speculative_tokens if spec is not None and spec.method == "draft_model" else 0


def _token_capacity(num_blocks: int, block_size: int, groups: KVCacheGroups, chunk_tokens: int) -> int:
    """The longest sequence the cache holds alone. With several KV cache groups, group 0 holds
    every block of it, and each other group at most its window plus a prefill chunk (vLLM's
    bound for a sliding window: the chunk's blocks are given back only after its step)."""
    if not groups.is_hybrid:
        return num_blocks * block_size

    def blocks(tokens: int) -> int:
        local = -(-min(tokens, groups.local_window - 1 + chunk_tokens) // block_size) + 1
        return -(-tokens // block_size) + local * (groups.num_groups - 1)

    low, high = 0, num_blocks * block_size  # blocks() grows with the tokens: the largest that fits
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if blocks(mid) <= num_blocks else (low, mid - 1)
    return low


def _releasable_window(config: EngineConfig, model: torch.nn.Module) -> int | None:
    """The window past which a request's KV blocks may be released: when every layer of the model
    has a sliding window (Mistral-style; Gemma 3's global layers need every block) and no draft
    model reads the same block tables with its own attention. KVCacheManager applies it only
    without prefix caching."""
    windows = getattr(model.config, "sliding_windows", ())
    if not windows or None in windows:
        return None
    if config.speculative is not None and config.speculative.method == "draft_model":
        return None
    return max(windows)
