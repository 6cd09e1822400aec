"""One rank of the model: its shard of the weights, its KV cache and its model runner.

The engine core talks to workers only through an executor (pagoda/executor), by method name:
``determine_num_blocks``, ``initialize_cache``, ``execute_model``. Rank 0 (the driver) lives in
the engine's process and returns the step's ``ModelRunnerOutput``; other ranks run the same
forward passes and return nothing.
"""

from __future__ import annotations

import logging
import os
import time

import torch

from pagoda import envs
from pagoda.config import EngineConfig
from pagoda.core.scheduler_output import SchedulerOutput
from pagoda.distributed.parallel_state import SINGLE, TensorParallelGroup, init_tensor_parallel
from pagoda.layers.backend import TorchBackend, select_backend
from pagoda.loader.model_loader import load_model
from pagoda.outputs import ModelRunnerOutput
from pagoda.platform import available_memory_bytes, resident_memory_bytes
from pagoda.core.kv_cache_groups import KVCacheGroups, kv_groups_for
from pagoda.core.kv_tiers.store import KVTierStore
from pagoda.worker.kv_cache import GiB, allocate_kv_cache, allocate_kv_scales, bytes_per_block, cpu_budget_gib
from pagoda.worker.lora_weights import LoRAWeights
from pagoda.worker.model_runner import ModelRunner
from pagoda.worker.pooling_runner import PoolingRunner
from pagoda.worker.state_cache import allocate_states, bytes_per_slot, num_slots_for_budget

logger = logging.getLogger(__name__)


def prepare_backend(device: torch.device, rank: int = 0) -> TorchBackend:
    """Choose the kernels once, at start-up, so the engine is ready when it says so (built
    lazily, the first request waited for the compiler). A first build on this CPU announces
    itself (layers/cpu_kernels.py) wherever it is triggered."""
    start = time.monotonic()
    backend = select_backend(device)
    if rank == 0:
        logger.info("kernels: %s, ready in %.1fs", backend.describe(), time.monotonic() - start)
    return backend


class Worker:
    def __init__(self, config: EngineConfig, rank: int = 0, master_addr: str = "127.0.0.1",
                 master_port: int | None = None, store=None, gone=lambda: None) -> None:
        """``store``: rank 0's rendezvous store when its executor already serves one; ``gone``: why
        the start must stop (another rank died), or None."""
        self.config = config
        mc, pc = config.model, config.parallel
        self.rank = rank
        self.device = mc.device
        start = time.monotonic()
        torch.manual_seed(config.seed)
        self.backend = prepare_backend(self.device, rank)
        self.tp: TensorParallelGroup = SINGLE
        if pc.world_size > 1:
            self.tp = init_tensor_parallel(rank, pc.world_size, master_addr, master_port, self.device,
                                           pc.timeout_seconds, _shared_memory_bytes(config), store, gone)
        rss_before = resident_memory_bytes()
        self.model = load_model(mc.files, mc.hf_config, mc.dtype, self.device, mc.max_model_len,
                                quantization=mc.quantization, tp=self.tp, backend=self.backend,
                                progressive=_loads_progressively(config))
        self.readiness = getattr(self.model, "load_readiness", None)  # set when it loads layer by layer
        self.draft_model = self._load_draft()
        # what loading the shard cost (while it loads layer by layer: what it cost so far)
        self.weights_rss_bytes = resident_memory_bytes() - rss_before
        self.tp.wait_for_all()  # before any timed collective: ranks load at their own pace
        self.load_seconds = time.monotonic() - start
        # which layers share a block table; an encoder (BERT) keeps no KV cache: no layer does
        self.uses_kv_cache = getattr(self.model, "uses_kv_cache", True)
        self.kv_groups = (kv_groups_for(self.model.config, config.speculative, config.cache.hybrid_kv_cache)
                          if self.uses_kv_cache else KVCacheGroups.single(0))
        self.kv_cache_dtype = config.cache.kv_cache_dtype or mc.dtype  # --kv-cache-dtype
        self.runner: ModelRunner | None = None
        self.kv_cache: torch.Tensor | None = None
        self.kv_scales: torch.Tensor | None = None  # an int8 cache's scales
        self.kv_tiers: KVTierStore | None = None  # host memory and disk under the prefix cache (attach_kv_tiers)
        # a state-space model's layers with recurrent state, and the slots each holds (determine_num_blocks)
        self.state_layers: list = getattr(self.model, "state_layers", list)()
        self.num_state_slots = 0
        self.num_snapshot_slots = 0  # with prefix caching: as many again, for states after cached prefixes
        self.states: list[tuple[torch.Tensor, torch.Tensor]] = []

    def _load_draft(self) -> torch.nn.Module | None:
        """The draft model of speculative decoding (``method: draft_model``), whole, on the driver
        rank: only the driver proposes."""
        spec = self.config.speculative
        if spec is None or spec.draft is None or not self.tp.is_driver:
            return None
        d = spec.draft
        model = load_model(d.files, d.hf_config, d.dtype, self.device, d.max_model_len,
                           quantization=d.quantization, backend=self.backend)
        logger.info("draft model %s (%s, %s) for speculative decoding, %d tokens a step",
                    d.name, d.quantization or "no quantization", str(d.dtype).removeprefix("torch."),
                    spec.num_speculative_tokens)
        return model

    # -- KV cache ---------------------------------------------------------------------------
    def _bytes_per_block(self, num_kv_heads: int) -> int:
        """One block of every layer's K/V for ``num_kv_heads`` of the target's heads, plus the
        draft model's block (all its heads: the draft is not sharded)."""
        cfg, bs = self.model.config, self.config.cache.block_size
        size = bytes_per_block(self.kv_groups.slots_per_block, bs, num_kv_heads, cfg.head_dim, self.kv_cache_dtype)
        if self.draft_model is not None:
            d = self.draft_model.config
            size += bytes_per_block(d.num_layers, bs, d.num_kv_heads, d.head_dim, self.config.speculative.draft.dtype)
        return size

    def determine_num_blocks(self) -> int:
        """How many KV blocks the budget holds, the same on every rank.

        A block is counted with all of the model's KV heads, so the number of blocks (and so the
        tokens the engine can hold) does not change with the tensor-parallel size: each rank
        stores its share of the heads. On CUDA each rank measures its own free memory and the
        smallest answer wins."""
        cfg, cc = self.model.config, self.config.cache
        if self.state_layers:
            self.num_state_slots = self._state_slots()
            self.num_snapshot_slots = self.num_state_slots if cc.enable_prefix_caching else 0
        if not self.uses_kv_cache:
            # No cache to size: the blocks only count the tokens in flight, as many as every
            # sequence at its longest (a pooling request gives its blocks back in the step it runs).
            return self.config.scheduler.max_num_seqs * -(-self.config.model.max_model_len // cc.block_size)
        per_block = self._bytes_per_block(cfg.num_kv_heads)
        if self.device.type == "cuda":
            local = self._bytes_per_block(self.model.num_local_kv_heads)
            states = self._state_bytes()  # allocated first (initialize_cache)
            num_blocks = (int(available_memory_bytes(self.device) * cc.gpu_memory_utilization) - states) // local
            budget = num_blocks * per_block
        else:
            available = self._available_once_loaded()
            gib = cpu_budget_gib(cc.kv_cache_memory_gib, available)
            if gib * GiB > available:  # the cache's pages are taken as blocks fill: say so now
                raise ValueError(f"kv_cache_memory={gib:g} GiB is more than this machine has available "
                                 f"({available / GiB:.1f} GiB); lower --kv-cache-memory")
            budget = int(gib * GiB) - self._state_bytes()
            num_blocks = budget // per_block
        if self.tp.is_parallel:
            smallest = torch.tensor([num_blocks], dtype=torch.int64, device=self.device)
            self.tp.backend.allreduce([smallest], _min_op()).wait()
            num_blocks = int(smallest)
        if num_blocks < 1:
            raise ValueError(
                f"the KV cache budget ({budget / GiB:.3f} GiB) does not hold one block of "
                f"{cc.block_size} tokens ({per_block / 2**20:.2f} MiB); raise kv_cache_memory"
            )
        return int(num_blocks)

    def _available_once_loaded(self) -> int:
        """The memory available now, less what the layers still loading will take (their known
        size: loader/progressive_load.py), so the budget is the one a whole-model load measures."""
        loading = getattr(self.model, "loading", None)
        return available_memory_bytes(self.device) - (loading.pending_bytes() if loading is not None else 0)

    def loading_progress(self) -> dict | None:
        """How far a model loading layer by layer is (models/layer_readiness.py), or None when it
        loaded whole."""
        return self.readiness.progress() if self.readiness is not None else None

    def _state_slots(self) -> int:
        """How many requests' recurrent states the budget holds (worker/state_cache.py): on CUDA
        the slots are taken from the memory before the blocks are counted."""
        cc, per_slot = self.config.cache, bytes_per_slot(self.state_layers)
        if self.device.type == "cuda":
            budget = int(available_memory_bytes(self.device) * cc.gpu_memory_utilization)
        else:
            budget = int(cpu_budget_gib(cc.kv_cache_memory_gib, available_memory_bytes(self.device)) * GiB)
        copies = 2 if cc.enable_prefix_caching else 1  # a snapshot slot beside each running one
        return num_slots_for_budget(budget, per_slot * copies, self.config.scheduler.max_num_seqs, self.uses_kv_cache)

    def _state_bytes(self) -> int:
        return (self.num_state_slots + self.num_snapshot_slots) * bytes_per_slot(self.state_layers)

    def initialize_cache(self, num_blocks: int, max_model_len: int) -> None:
        cfg, cc = self.model.config, self.config.cache
        if self.state_layers:  # before the KV cache: on CUDA its blocks were counted after the states
            self.states = allocate_states(self.state_layers, self.num_state_slots + self.num_snapshot_slots,
                                          self.device)
        slots = self.kv_groups.slots_per_block if self.uses_kv_cache else 0  # an encoder's: an empty tensor
        heads = getattr(self.model, "num_local_kv_heads", 1)
        self.kv_cache = allocate_kv_cache(slots, num_blocks, cc.block_size, heads, cfg.head_dim, self.kv_cache_dtype,
                                          self.device)
        self.kv_scales = allocate_kv_scales(slots, num_blocks, cc.block_size, heads, self.kv_cache_dtype, self.device)
        draft = None
        if self.draft_model is not None:
            d = self.draft_model.config
            draft = (self.draft_model, allocate_kv_cache(d.num_layers, num_blocks, cc.block_size, d.num_kv_heads,
                                                         d.head_dim, self.config.speculative.draft.dtype, self.device))
        generator = torch.Generator().manual_seed(self.config.seed)
        mc = self.config.model  # the pooling runner (--runner pooling) pools instead of sampling
        runner, extra = (PoolingRunner, {"pooler": mc.pooler}) if mc.pools else (ModelRunner, {})
        if self.config.lora is not None:  # (refused with --runner pooling: config.py)
            extra["loras"] = LoRAWeights(self.model, self.config.lora, mc.hf_config)
        self.runner = runner(
            self.model, self.kv_cache, cc.block_size, self.device, max_model_len, generator,
            compile=self.config.compile, deterministic=self.config.deterministic,
            short_chunk=self.config.scheduler.short_chunk_tokens, speculative=self.config.speculative,
            is_driver=self.tp.is_driver, draft=draft, kv_groups=self.kv_groups, kv_scales=self.kv_scales,
            fused_decode=self.config.fused_decode, **extra,
        )

    def forward_path(self) -> dict:
        """How the model's decode batches run (ModelRunner.forward_path), as plain data."""
        return self.runner.forward_path.as_dict()

    # -- steps ------------------------------------------------------------------------------
    def attach_kv_tiers(self, store: KVTierStore) -> None:
        """The KV tiers (core/kv_tiers) whose copies each step's ``kv_saves`` / ``kv_loads`` ask for."""
        store.bind(self.kv_cache, self.kv_scales)
        self.kv_tiers = store

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput | None:
        if sched.kv_saves or sched.kv_loads:  # before the forward: a block let go may be written again
            self.kv_tiers.apply(sched.kv_saves, sched.kv_loads)
        out = self.runner.execute(sched)
        return out if self.tp.is_driver else None

    def memory_report(self) -> dict[str, int]:
        """This rank's weight bytes (parameters; rotary tables and other buffers are replicated), the
        resident memory that loading them added to its process, and the process's resident memory."""
        weights = sum(p.nbytes for p in self.model.parameters())
        return {"rank": self.rank, "pid": os.getpid(), "weight_bytes": weights,
                "weights_rss_bytes": self.weights_rss_bytes, "rss_bytes": resident_memory_bytes()}

    def shutdown(self, wait_for_ranks: bool = False) -> None:
        """Release the cache and leave the tensor-parallel group (``wait_for_ranks``: every rank
        is shutting down too, so meet them first; see TensorParallelGroup.close)."""
        if self.readiness is not None:
            self.readiness.cancel()  # a loader still at work stops at its next layer
        self.runner = None
        self.kv_cache = self.kv_scales = None
        self.tp.close(wait_for_ranks)


def _loads_progressively(config: EngineConfig) -> bool:
    """Whether the engine's options let the model load layer by layer (the model may still refuse:
    loader/progressive_load.py); the reason is logged when they do not."""
    if not config.progressive_load:
        return False
    reason = ("the pooling runner" if config.model.pools else
              "torch.compile traces the whole forward" if config.compile else
              "LoRA adapters bind to the loaded layers" if config.lora is not None else None)
    if reason is not None:
        logger.info("progressive loading off: %s; the model loads whole", reason)
    return reason is None


def _shared_memory_bytes(config: EngineConfig) -> int:
    """The largest tensor a step exchanges between ranks on one machine: a layer's output for
    every token of a step, or the step's logits (each rank's part of the vocabulary). 0 across
    machines: they talk through gloo."""
    pc, hf = config.parallel, config.model.hf_config
    if pc.nnodes > 1 or not envs.PAGODA_TP_SHARED_MEMORY:  # the latter: gloo, to compare
        return 0
    hidden = hf["hidden_size"] * config.scheduler.max_num_batched_tokens
    logits = config.scheduler.max_num_seqs * -(-hf["vocab_size"] // pc.world_size)
    return 4 * max(hidden, logits)


def _min_op():
    import torch.distributed as dist  # torch.distributed loads on first use

    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.MIN
    return opts


def cpu_share(rank: int, local_world_size: int) -> list[int]:
    """The cores of this process's affinity set that a local rank gets: a contiguous, equal share
    (at least one core), so ranks on one machine do not fight over cores."""
    cores = sorted(os.sched_getaffinity(0))
    per_rank = max(1, len(cores) // local_world_size)
    start = (rank % local_world_size) * per_rank % len(cores)
    return cores[start : start + per_rank]
