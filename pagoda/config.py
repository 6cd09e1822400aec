"""Engine configuration: what the user asks for (EngineArgs, in pagoda/engine_args.py) resolved against
the model and the device into what the engine runs with (EngineConfig)."""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from pagoda.core.kv_events import KVEventsConfig
from pagoda.core.prefill_chunks import resolve_long_prefill_threshold
from pagoda.distributed.parallel_config import (  # noqa: F401 - ParallelConfig and the check are re-exported
    ParallelConfig, check_tensor_parallel, parallel_config,
)
from pagoda.dtypes import resolve_dtype, resolve_kv_cache_dtype
from pagoda.engine_args import EngineArgs  # also re-exported: most callers import it from here
from pagoda.heap import keep_freed_memory
from pagoda.layers.auto_quantization import announce, choose_quantization
from pagoda.layers.quantization import check_quantization, is_auto, pooling_quantization
from pagoda.lora.config import LoRAConfig, lora_config
from pagoda.lora.checks import model_adapter_rank
from pagoda.loader.catalog import DEFAULT_MODEL  # noqa: F401 - the engine's default, re-exported
from pagoda.loader.model_files import ModelFiles
from pagoda.loader.pooling_model import choose_runner, sep_token_id
from pagoda.loader.resolve import resolve_model
from pagoda.models.architectures import is_recurrent
from pagoda.models.model_classes import resolve_architecture
from pagoda.multimodal.limits import ImageLimits, image_limits
from pagoda.platform import available_memory_bytes, default_device
from pagoda.pooling_params import PoolerConfig
from pagoda.spec_decode.speculative_config import SpeculativeConfig
from pagoda.tokenizer import read_chat_template
from pagoda.worker.kv_cache import GiB, bytes_per_block, cpu_budget_gib

# EngineArgs.deterministic when not given. Off: measured on SmolLM2 fp32 (2 threads, AVX-512), it
# cost 10-12 % of offline throughput (64 x 128/128 tokens) and up to ~30 % of a long (2048-token)
# prefill, the invariant GEMM running at ~0.65-0.9x MKL's speed from 128 rows; decode steps ~0.
DETERMINISTIC_DEFAULT = False


# Every default is EngineArgs' (the one declaration, CLI option included); the resolved configs
# below repeat none of them.
_ARGS = EngineArgs()


@dataclass(frozen=True)
class ModelConfig:
    files: ModelFiles
    hf_config: dict
    architecture: str
    dtype: torch.dtype
    device: torch.device
    max_model_len: int
    chat_template: str | None = None
    quantization: str | None = None  # None, "int8", "int4" or "gguf" (pagoda/layers/quantization.py)
    generation_config: str = "auto"  # where default sampling parameters come from (generation_defaults.py)
    runner: str = "generate"  # or "pooling": embeddings and scores (loader/pooling_model.py, --runner)
    pooler: PoolerConfig | None = None  # the pooling runner's pooling (pooling_params.py)

    @property
    def pools(self) -> bool:
        return self.runner == "pooling"

    @property
    def cross_encoder(self) -> bool:
        """A classifier of text pairs (a reranker): it scores pairs, it gives no embeddings."""
        return self.architecture.endswith("ForSequenceClassification")

    @property
    def name(self) -> str:
        return self.files.name


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = _ARGS.block_size
    kv_cache_memory_gib: float | None = None  # CPU budget
    gpu_memory_utilization: float = _ARGS.gpu_memory_utilization  # CUDA: fraction of free memory after the weights
    enable_prefix_caching: bool = _ARGS.enable_prefix_caching
    # Sessions (/v1/sessions): the share of KV blocks their pinned prefixes may hold together,
    # and the tokens one session may pin (None: the whole context).
    session_kv_fraction: float = _ARGS.session_kv_fraction
    max_session_kv_tokens: int | None = None
    # Separate block tables for sliding-window layers where a model mixes them with global ones
    # (core/kv_cache_groups.py); off: --disable-hybrid-kv-cache-manager
    hybrid_kv_cache: bool = True
    kv_cache_dtype: torch.dtype | None = None  # None: the model's dtype (--kv-cache-dtype auto)
    # state-space models with prefix caching: tokens between kept states (core/state_snapshots.py)
    state_snapshot_interval: int = _ARGS.state_snapshot_interval


@dataclass(frozen=True)
class KVOffloadConfig:
    """The KV tiers under the prefix cache (core/kv_tiers): host memory and an optional directory."""

    memory_gib: float = 0.0
    disk_dir: str | None = None
    disk_gib: float = _ARGS.kv_offload_disk
    url: str | None = None  # a Valkey / Redis server shared by replicas (kv_tiers/remote_tier.py)
    role: str = "both"  # prefill / decode disaggregation (--kv-role): prefill writes its blocks before it answers
    write_policy: str = "write_through"  # or write_through_selective: only blocks used again (kv_tiers/link.py)

    @property
    def enabled(self) -> bool:
        return self.memory_gib > 0 or self.disk_dir is not None or self.url is not None


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = _ARGS.max_num_seqs
    max_num_batched_tokens: int = _ARGS.max_num_batched_tokens
    aging_seconds: float = _ARGS.aging_seconds  # waiting this long raises a request's effective priority by one level; 0: off
    admission_pressure_threshold: float = _ARGS.admission_pressure_threshold  # KV pressure above which admission keeps a block per running request
    # a prefill chunk this short (fresh too, on the C++ kernels) runs as rows of the paged decode
    # kernel; a longer one takes the flash-style prefill kernel (SDPA on the torch backend)
    short_chunk_tokens: int = _ARGS.short_chunk_tokens
    # vLLM's chunking knobs (core/prefill_chunks.py): a prefill's tokens per step (0: the budget's),
    # how many requests may be mid-prefill at once, and how many of those may be long
    long_prefill_token_threshold: int = _ARGS.long_prefill_token_threshold
    max_num_partial_prefills: int = _ARGS.max_num_partial_prefills
    max_long_partial_prefills: int = _ARGS.max_long_partial_prefills
    policy: str = _ARGS.scheduling_policy  # "priority": priorities and aging order the queues; "fcfs": arrival only


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    parallel: ParallelConfig = ParallelConfig()
    speculative: SpeculativeConfig | None = None
    seed: int = _ARGS.seed
    enforce_eager: bool = _ARGS.enforce_eager
    compile: bool = _ARGS.compile  # torch.compile the model between attention layers (see worker/compiled.py)
    deterministic: bool = False  # batch-invariant kernels and layout (see EngineArgs.deterministic)
    fused_decode: bool = _ARGS.fused_decode  # decode batches may take the fused C++ stack (see EngineArgs.fused_decode)
    progressive_load: bool = _ARGS.progressive_load  # load layer by layer on a thread (loader/progressive_load.py)
    lora: LoRAConfig | None = None  # LoRA adapters are served (EngineArgs.enable_lora)
    kv_events: KVEventsConfig | None = None  # the prefix cache's events are published (--kv-events-config)
    kv_offload: KVOffloadConfig = KVOffloadConfig()
    images: ImageLimits = ImageLimits()  # what a prompt's images may be (--limit-mm-per-prompt, ...)


def create_engine_config(args: EngineArgs) -> EngineConfig:
    """Resolve `args` against the model's config and the device."""
    args._validate()
    if args.num_threads is not None:  # the engine computes in this process; OMP_NUM_THREADS for its children
        torch.set_num_threads(args.num_threads)
        os.environ["OMP_NUM_THREADS"] = str(args.num_threads)
    device = torch.device(args.device) if args.device else default_device()
    if device.type == "cpu":
        keep_freed_memory()  # the activations' heap stays between steps (pagoda/heap.py)
    files = resolve_model(args.model, key_file=args.model_key_file)
    if args.model_key_file is not None and files.encryption is None:
        _warn_once(f"--model-key-file is ignored: {args.model!r} is not an encrypted model")
    hf_config = files.hf_config()
    architecture, model_cls = resolve_architecture(hf_config)
    recurrent = is_recurrent(architecture)  # state-space layers (Mamba-2): a state slot per running request
    encoder = not getattr(model_cls, "uses_kv_cache", True) and not recurrent  # an encoder (BERT): pooling only
    if getattr(model_cls, "classifies", False):  # a cross-encoder marks a pair's second text after [SEP]
        hf_config = {**hf_config, "sep_token_id": sep_token_id(files.metadata_dir, hf_config)}
    runner = choose_runner(args.runner, files.metadata_dir, architecture, encoder, hf_config, args.pooler_config)
    pools = runner.runner == "pooling"
    # pooling: float32 on the CPU unless asked (embeddings as sentence-transformers computes them)
    dtype = resolve_dtype("float32" if pools and is_auto(args.dtype) and device.type == "cpu" else args.dtype, device)
    model_max = int(hf_config.get("max_position_embeddings") or 2048)
    if runner.max_seq_length:  # sentence-transformers' max_seq_length caps a prompt, as vLLM reads it
        model_max = min(model_max, runner.max_seq_length)
    if args.max_model_len is not None and args.max_model_len > model_max:
        raise ValueError(f"max_model_len={args.max_model_len} is larger than the model's context ({model_max})")
    parallel = parallel_config(args)
    check_tensor_parallel(parallel.tensor_parallel_size, hf_config)
    chat_template = read_chat_template(args.chat_template)
    quantization = pooling_quantization(args.quantization, encoder) if pools else \
        _check_quantization(args.quantization, files, device, args.dtype)
    if encoder and args.tensor_parallel_size > 1:
        raise ValueError(f"tensor_parallel_size={args.tensor_parallel_size}: an encoder ({architecture}) runs on one rank")
    if pools and args.speculative_config:
        raise ValueError("speculative_config: the pooling runner decodes nothing (--runner pooling)")
    if recurrent:
        _check_recurrent(args, architecture, pools)
    if quantization == "gguf" and str(args.dtype).lower() == "auto":
        dtype = torch.float32  # the block kernels' activations, and the decode stack's dtype
    deterministic = _resolve_deterministic(args, device, dtype)
    kv_dtype = resolve_kv_cache_dtype(args.kv_cache_dtype, dtype, quantization)
    max_model_len = _within_kv_budget(args.max_model_len or model_max, hf_config, args.kv_cache_memory, device,
                                      kv_dtype)
    model_config = ModelConfig(files, hf_config, architecture, dtype, device, max_model_len,
                               chat_template, quantization, args.generation_config, runner.runner, runner.pooler)
    return EngineConfig(
        model=model_config,
        # pooling: no prefix caching (a cached prefix's hidden states are not computed again, so
        # mean or first-token pooling could not see them)
        cache=CacheConfig(args.block_size, args.kv_cache_memory, args.gpu_memory_utilization,
                          args.enable_prefix_caching and not pools,
                          args.session_kv_fraction, args.max_session_kv_tokens,
                          not args.disable_hybrid_kv_cache_manager, kv_dtype, args.state_snapshot_interval),
        scheduler=_scheduler_config(args, max_model_len, pools),
        parallel=parallel,
        seed=args.seed,
        enforce_eager=args.enforce_eager,
        compile=args.compile and not args.enforce_eager,
        deterministic=deterministic,
        fused_decode=args.fused_decode,
        progressive_load=args.progressive_load,
        speculative=_speculative_config(args, model_config),
        lora=lora_config(args, dtype, quantization not in (None, "none"), pools, model_adapter_rank(files, hf_config)),
        kv_events=KVEventsConfig.parse(args.kv_events_config),
        kv_offload=KVOffloadConfig(args.kv_offload_memory if args.kv_offload_memory is not None
                                   else (1.0 if args.kv_offload_dir or args.kv_offload_url else 0.0),
                                   args.kv_offload_dir, args.kv_offload_disk, args.kv_offload_url, args.kv_role,
                                   args.kv_offload_write_policy),
        images=image_limits(args),
    )


def _within_kv_budget(max_model_len: int, hf_config: dict, kv_cache_memory: float | None, device: torch.device,
                      kv_dtype: torch.dtype) -> int:
    """``max_model_len``, capped on the CPU at the tokens the KV budget could hold at one layer's
    cost per token (at least what the engine finds once the cache is sized, when it caps again,
    exactly): the rotary tables and the batch's token rows are sized from it as the model loads,
    so a file's context_length of 16M does not become gigabytes of tables. On CUDA the budget is a
    share of the memory free after loading, not known here."""
    heads, hidden = hf_config.get("num_attention_heads"), hf_config.get("hidden_size")
    if device.type != "cpu" or not isinstance(heads, int) or not isinstance(hidden, int) or heads < 1:
        return max_model_len
    kv_heads = hf_config.get("num_key_value_heads") or heads
    head_dim = hf_config.get("head_dim") or hidden // heads
    budget = cpu_budget_gib(kv_cache_memory, available_memory_bytes(device)) * GiB
    bound = max(1, int(budget) // bytes_per_block(1, 1, kv_heads, head_dim, kv_dtype))
    if bound >= max_model_len:
        return max_model_len
    _warn_once(f"max_model_len {max_model_len} is more than the KV cache budget ({budget / GiB:.3g} GiB) could "
               f"hold; capped at {bound} tokens")
    return bound


def _scheduler_config(args: EngineArgs, max_model_len: int, pools: bool = False) -> SchedulerConfig:
    """The scheduler's knobs; with several partial prefills and no threshold, vLLM's default
    threshold (4 % of the context). A pooling request runs its whole prompt in one step, so the
    pooling runner's step budget holds at least the longest prompt."""
    threshold = resolve_long_prefill_threshold(args.long_prefill_token_threshold, args.max_num_partial_prefills,
                                               max_model_len)
    budget = max(args.max_num_batched_tokens, max_model_len) if pools else args.max_num_batched_tokens
    return SchedulerConfig(
        args.max_num_seqs, budget, args.aging_seconds, args.admission_pressure_threshold,
        args.short_chunk_tokens, long_prefill_token_threshold=threshold,
        max_num_partial_prefills=args.max_num_partial_prefills,
        max_long_partial_prefills=args.max_long_partial_prefills, policy=args.scheduling_policy,
    )


def _speculative_config(args: EngineArgs, target: ModelConfig) -> SpeculativeConfig | None:
    """The parsed speculative_config; for ``draft_model``, with the draft resolved (files,
    architecture, dtype, quantization) and checked against the target: the same tokenizer (the
    drafts are token ids) and a context at least the target's."""
    spec = SpeculativeConfig.parse(args.speculative_config)
    if spec is None or spec.method != "draft_model":
        return spec
    try:
        files = resolve_model(spec.model, key_file=args.model_key_file)  # an encrypted draft: the same key
        hf_config = files.hf_config()
        architecture, _ = resolve_architecture(hf_config)
        quantization = _check_quantization(spec.quantization, files, target.device)
    except ValueError as e:
        raise ValueError(f"speculative_config.model: {e}") from None
    dtype = resolve_dtype(spec.dtype, target.device) if spec.dtype else target.dtype
    _check_same_tokenizer(files, target.files)
    if args.tensor_parallel_size > 1:
        raise ValueError("speculative_config: a draft model with tensor_parallel_size > 1 is not supported; "
                         "use method 'ngram' or one rank")
    draft = ModelConfig(files, hf_config, architecture, dtype, target.device, target.max_model_len,
                        quantization=quantization)
    if int(hf_config.get("max_position_embeddings") or 2048) < target.max_model_len:
        raise ValueError(f"speculative_config.model: the draft's context ({hf_config.get('max_position_embeddings')}) "
                         f"is shorter than max_model_len={target.max_model_len}")
    return dataclasses.replace(spec, draft=draft)


def _check_same_tokenizer(draft: ModelFiles, target: ModelFiles) -> None:
    from tokenizers import Tokenizer as HFTokenizer  # deferred: tokenizers loads on first use

    def vocab(files: ModelFiles) -> dict[str, int]:
        path = files.metadata_dir / "tokenizer.json"
        return HFTokenizer.from_file(str(path)).get_vocab(with_added_tokens=True) if path.exists() else {}

    if vocab(draft) != vocab(target):
        raise ValueError(f"speculative_config.model: {draft.name!r} does not share the target's tokenizer "
                         f"({target.name!r}); a draft model must propose the same token ids")


def _resolve_deterministic(args: EngineArgs, device: torch.device, dtype: torch.dtype) -> bool:
    """Where batch invariance holds: float32 on the CPU, through pagoda's C++ kernels, without
    torch.compile (inductor's own kernels are not batch-invariant). Asked for elsewhere, it is
    honoured as far as it goes (on the CPU every row attends through the paged kernel; on CUDA
    nothing changes), with a warning."""
    compiled = args.compile and not args.enforce_eager
    holds = device.type == "cpu" and dtype == torch.float32 and not compiled  # the kernels: see ModelRunner
    if args.deterministic is None:
        return holds and DETERMINISTIC_DEFAULT
    if args.deterministic and not holds:
        _warn_once(
            "deterministic=True: batch invariance is guaranteed only for float32 on the CPU with pagoda's "
            f"C++ kernels and without --compile (here: device={device.type}, dtype={dtype}, compile={compiled}); "
            "results may still depend on the batch and on prefix caching"
        )
    return bool(args.deterministic)


_warned: set[str] = set()


def _check_recurrent(args: EngineArgs, architecture: str, pools: bool) -> None:
    """What a state-space model (a recurrent state per request, core/state_slots.py) does not run
    with: its state cannot be rolled back (speculative decoding), cut across ranks (its mixers are
    built whole), pooled, or moved to the KV tiers (they hold blocks, not the states kept with
    them: core/state_snapshots.py)."""
    refused = [(args.speculative_config, "speculative_config"), (args.tensor_parallel_size > 1, "tensor_parallel_size > 1"),
               (pools, "--runner pooling"), (args.enable_lora, "enable_lora"),
               (args.kv_offload_memory or args.kv_offload_dir or args.kv_offload_url, "kv_offload")]
    for value, name in refused:
        if value:
            raise ValueError(f"{name} is not supported for {architecture} (state-space layers)")
    if args.state_snapshot_interval < 1:
        raise ValueError(f"state_snapshot_interval must be >= 1 token, got {args.state_snapshot_interval}")


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        logging.getLogger(__name__).warning(message)


def _check_quantization(quantization: str | None, files: ModelFiles, device: torch.device,
                        dtype: str | torch.dtype | None = None) -> str | None:
    """The mode asked for, checked; or, for auto (the default; a draft model: none), what
    layers/auto_quantization.py picks, said at start-up."""
    if dtype is None and (quantization is None or str(quantization).lower() == "auto"):
        return None
    quantization, why = choose_quantization(quantization, files.format, device, dtype or "auto")
    if why != "asked for":
        announce(quantization, why)
    mode = check_quantization(quantization)
    if mode is not None and device.type != "cpu":
        raise ValueError(f"quantization={mode!r} uses torch's CPU kernels; it needs device 'cpu', got {device.type!r}")
    if mode == "gguf" and files.format != "gguf":
        raise ValueError(f"quantization='gguf' keeps a GGUF's own quantized weights, but {files.name!r} is not a GGUF file")
    return mode
