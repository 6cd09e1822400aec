"""EngineCore: the step loop over scheduler → model runner → scheduler update.

It works on token ids only (no tokenizer, no text); the front end (LLMEngine) owns those.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from pagoda.config import DEFAULT_KV_CACHE_GIB, EngineConfig
from pagoda.core.kv_cache_manager import KVCacheManager
from pagoda.core.scheduler import Scheduler, SchedulerStats
from pagoda.loader.model_loader import load_model
from pagoda.platform import available_memory_bytes
from pagoda.request import Request, RequestStatus
from pagoda.structured_output.manager import StructuredOutputManager
from pagoda.worker.kv_cache import GiB, allocate_kv_cache, bytes_per_block
from pagoda.worker.model_runner import ModelRunner, TokenLogprobs

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

    def validate(self, request: Request) -> None:
        if request.num_prompt_tokens < 1:
            raise ValueError("the prompt is empty: give at least one token")
        if request.num_prompt_tokens >= self.max_model_len:
            raise ValueError(
                f"the prompt has {request.num_prompt_tokens} tokens, but the model's context is "
                f"{self.max_model_len} tokens (max_model_len), which leaves no room to generate"
            )
        bad = [t for t in request.prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids must be in [0, {self.vocab_size}), got {bad[:5]}")


def _prepare_cpu_kernels() -> None:
    """Build (first run on this CPU, about a minute) or load the C++ kernels now, so the engine
    is ready when it says so: built lazily, the first request waited for the compiler."""
    from pagoda.layers.cpu_kernels import kernels_are_built, load_cpu_kernels

    if not kernels_are_built():
        logger.warning("building pagoda's CPU kernels for this CPU (once; about a minute)...")
    start = time.monotonic()
    kernels = load_cpu_kernels()
    if kernels is not None:
        logger.info("CPU kernels ready in %.1fs", time.monotonic() - start)


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        mc = config.model
        start = time.monotonic()
        torch.manual_seed(config.seed)
        if mc.device.type == "cpu":
            _prepare_cpu_kernels()
        self.model = load_model(mc.files, mc.hf_config, mc.dtype, mc.device, mc.max_model_len)
        self.load_seconds = time.monotonic() - start
        self.num_blocks = self._num_blocks()
        cfg = self.model.config
        block_size = config.cache.block_size
        self.kv_cache = allocate_kv_cache(cfg.num_layers, self.num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim, mc.dtype, mc.device)
        capacity = self.num_blocks * block_size
        self.max_model_len = mc.max_model_len
        if capacity < self.max_model_len:
            logger.warning("KV cache holds %d tokens, less than max_model_len=%d: capping max_model_len", capacity, self.max_model_len)
            self.max_model_len = capacity
        self.kv_manager = KVCacheManager(self.num_blocks, block_size, config.cache.enable_prefix_caching)
        sc = config.scheduler
        self.scheduler = Scheduler(
            self.kv_manager, max_num_seqs=sc.max_num_seqs,
            max_num_batched_tokens=sc.max_num_batched_tokens, max_model_len=self.max_model_len,
        )
        generator = torch.Generator().manual_seed(config.seed)
        self.runner = ModelRunner(self.model, self.kv_cache, block_size, mc.device, generator, compile=config.compile)
        self.num_steps = 0
        self.limits = RequestLimits(self.max_model_len, cfg.vocab_size, self.num_blocks)
        self._structured_outputs: StructuredOutputManager | None = None
        self._compiling: list[Request] = []  # constrained requests whose grammar is not compiled yet

    def _num_blocks(self) -> int:
        cfg, mc, cc = self.model.config, self.config.model, self.config.cache
        per_block = bytes_per_block(cfg.num_layers, cc.block_size, cfg.num_kv_heads, cfg.head_dim, mc.dtype)
        if mc.device.type == "cuda":
            budget = int(available_memory_bytes(mc.device) * cc.gpu_memory_utilization)
        else:
            gib = cc.kv_cache_memory_gib
            if gib is None:
                # Default: 2 GiB, but never more than half of what the machine has free.
                gib = min(DEFAULT_KV_CACHE_GIB, available_memory_bytes(mc.device) / 2 / GiB)
            budget = int(gib * GiB)
        num_blocks = budget // per_block
        if num_blocks < 1:
            raise ValueError(
                f"the KV cache budget ({budget / GiB:.3f} GiB) does not hold one block of "
                f"{cc.block_size} tokens ({per_block / 2**20:.2f} MiB); raise kv_cache_memory"
            )
        return int(num_blocks)

    # -- requests ---------------------------------------------------------------------------
    def validate_request(self, request: Request) -> None:
        self.limits.validate(request)

    def add_request(self, request: Request) -> None:
        self.validate_request(request)
        constraint = request.sampling_params.structured_outputs
        if constraint is not None:
            request.grammar = self.structured_outputs.grammar_for(constraint)
            self._compiling.append(request)
        self.scheduler.add_request(request)

    @property
    def structured_outputs(self) -> StructuredOutputManager:
        """Built on the first constrained request (xgrammar's tokenizer tables cost ~0.5 s)."""
        if self._structured_outputs is None:
            from pagoda.tokenizer import Tokenizer

            metadata_dir = self.config.model.files.metadata_dir
            stop_ids = Tokenizer(metadata_dir).eos_token_ids
            self._structured_outputs = StructuredOutputManager(metadata_dir, self.model.config.vocab_size, stop_ids)
        return self._structured_outputs

    def _grammar_failures(self) -> list[EngineCoreOutput]:
        """Finish requests whose grammar failed to compile; drop compiled ones from the watch list."""
        failed, pending = [], []
        for request in self._compiling:
            if request.is_finished or not request.waiting_for_grammar:
                if request.grammar.error is not None and not request.is_finished:
                    logger.error("request %s: grammar compilation failed: %s", request.request_id, request.grammar.error)
                    request.stop_reason = f"grammar compilation failed: {request.grammar.error}"
                    self.scheduler.finish_request(request.request_id, RequestStatus.FINISHED_ABORTED)
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
            self.scheduler.finish_request(rid, status)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def stats(self) -> SchedulerStats:
        return self.scheduler.stats()

    # -- the step ---------------------------------------------------------------------------
    def step(self) -> list[EngineCoreOutput]:
        failed = self._grammar_failures() if self._compiling else []
        sched = self.scheduler.schedule()
        if sched.is_empty:
            if self._compiling and not failed:
                # Only requests waiting for their grammar: sleep until one compiles, not spin.
                StructuredOutputManager.wait_any([r.grammar for r in self._compiling], timeout=0.05)
            return failed
        result = self.runner.execute(sched)
        finished = {r.request_id for r in self.scheduler.update(sched, result.sampled)}
        self.num_steps += 1
        outputs = failed
        for request, _ in sched.scheduled:
            rid = request.request_id
            token = result.sampled.get(rid)
            prompt_lps = result.prompt_logprobs.get(rid)
            if token is None and prompt_lps is None and rid not in finished:
                continue
            lp = result.logprobs.get(rid)
            outputs.append(EngineCoreOutput(
                request_id=rid,
                new_token_ids=[token] if token is not None else [],
                finish_reason=request.status.finish_reason if rid in finished else None,
                stop_reason=request.stop_reason,
                new_logprobs=[lp] if lp is not None else None,
                new_prompt_logprobs=prompt_lps,
                first_scheduled_time=request.first_scheduled_time,
                num_cached_tokens=request.num_cached_tokens or 0,
            ))
        return outputs
