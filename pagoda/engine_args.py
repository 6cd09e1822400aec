"""EngineArgs: the knobs of `LLM(...)` and the `pagoda` command, each declared once, CLI option included.

Every field carries its command-line option in its metadata (`_option`): `add_cli_args` builds the
"engine" argument group from the fields and `from_cli_args` reads a parsed namespace back, so a new
knob is one field. The module is light on purpose (standard library and the model catalog, no torch,
no numpy): `pagoda --help` builds its parser from it at once. Resolving the knobs against a model
and a device is `pagoda.config.create_engine_config(args)`.
"""

from __future__ import annotations

import argparse
import typing
from dataclasses import Field, dataclass, field, fields
from types import NoneType, UnionType
from typing import Any

from pagoda.core.prefill_chunks import check_prefill_chunking
from pagoda.loader.catalog import DEFAULT_MODEL

DTYPES = ("auto", "float32", "bfloat16", "float16")
KV_CACHE_DTYPES = ("auto", "float32", "fp32", "bfloat16", "bf16", "float16", "fp16", "int8", "fp8", "fp8_e4m3",
                   "fp8_e5m2")
QUANTIZATIONS = ("auto", "none", "int8", "int4", "gguf")
DISTRIBUTED_BACKENDS = ("mp", "ray", "uni")
BLOCK_SIZES = (8, 16, 32, 64, 128)
SCHEDULING_POLICIES = ("fcfs", "priority")
KV_ROLES = ("both", "prefill", "decode")  # --kv-role: prefill/decode disaggregation (engine/kv_offload.py)
KV_WRITE_POLICIES = ("write_through", "write_through_selective")  # --kv-offload-write-policy (core/kv_tiers/link.py)
RUNNERS = ("auto", "generate", "pooling")  # --runner (loader/pooling_model.py)  # how the scheduler orders its queues (pagoda/core/scheduler.py)


def _option(help: str | None = None, **argparse_kwargs: Any) -> dict[str, Any]:
    """A field's metadata: keywords for its `add_argument` (help, choices, ...). The flag, the dest
    and the default come from the field, `type` or `action` from its type unless given here;
    `aliases` adds option strings such as "-tp"."""
    return {"cli": {"help": help, **argparse_kwargs}}


NO_OPTION: dict[str, Any] = {"cli": None}


@dataclass
class EngineArgs:
    """The engine's knobs, named as in vLLM."""

    model: str = field(default=DEFAULT_MODEL, metadata=_option(
        "HF model directory, .gguf file, catalog name, or hub repo id (default: %(default)s)"))
    # The key's file, never the key (it is pickled to engine/worker processes, which read it).
    model_key_file: str | None = field(default=None, metadata=_option(
        "key file of an encrypted model (`pagoda encrypt`); default: the key in $PAGODA_MODEL_KEY"))
    dtype: str = field(default="auto", metadata=_option(choices=DTYPES))
    max_model_len: int | None = field(default=None, metadata=_option())
    max_num_seqs: int = field(default=256, metadata=_option())
    max_num_batched_tokens: int = field(default=2048, metadata=_option())
    block_size: int = field(default=16, metadata=_option())
    kv_cache_memory: float | None = field(default=None, metadata=_option("KV cache budget in GiB (CPU)"))
    kv_cache_dtype: str = field(default="auto", metadata=_option(
        "the KV cache's dtype: auto (the model's: exact; float16 for --quantization gguf, as llama.cpp), "
        "or a narrower one: bfloat16 / float16 halve "
        "an fp32 model's cache (twice the tokens fit in --kv-cache-memory), int8 (one scale per token "
        "and head, llama.cpp's q8_0 way) takes about a quarter, as does fp8 (= fp8_e4m3; or fp8_e5m2: "
        "float codes, one scale per token and head)", choices=KV_CACHE_DTYPES))
    gpu_memory_utilization: float = field(default=0.9, metadata=_option())
    seed: int = field(default=0, metadata=_option())
    chat_template: str | None = field(default=None, metadata=_option("a chat template, or a file holding one"))
    generation_config: str = field(default="auto", metadata=_option(
        "default sampling parameters: auto reads the model's generation_config.json (its authors' settings, "
        "or a store model's PARAMETERs) for requests that do not set them; vllm ignores it; or a folder "
        "holding a generation_config.json"))
    enforce_eager: bool = field(default=False, metadata=_option("never compile the model (overrides --compile)"))
    # Off by default: measured no faster on a 2-core CPU, and compiling takes minutes
    # (benchmarks/README.md, "torch.compile").
    compile: bool = field(default=False, metadata=_option(
        "torch.compile the model between attention layers (cached in $PAGODA_HOME/inductor; "
        "off by default: measured no faster on a 2-core AVX2 CPU)"))
    fused_decode: bool = field(default=True, metadata=_option(
        "run a batch of decode rows through every layer in one C++ call where the model allows it "
        "(the start-up log and /v1/debug/engine say whether it does and why); --no-fused-decode runs "
        "the Python layers every step (default: on)"))
    progressive_load: bool = field(default=False, metadata=_option(
        "load the model one decoder layer at a time on a loader thread, so the engine and the server come up "
        "while it loads and a request's prefill runs each layer as it arrives (docs/scaling-out.md, \"Progressive "
        "warm-up\"); models it does not apply to load whole, with the reason logged (default: off, the whole "
        "model loads before the engine starts: measured no faster to a first token on 2 shared cores, "
        "benchmarks/README.md, \"Progressive loading\")"))
    enable_prefix_caching: bool = field(default=True, metadata=_option(
        "share prompt prefixes between requests through a radix tree (default: on)"))
    state_snapshot_interval: int = field(default=256, metadata=_option(
        "state-space models (Mamba-2, Bamba) with prefix caching: keep a request's recurrent state "
        "every this many tokens (rounded up to whole blocks), so a later request with the same "
        "prefix starts at the last such point (default: 256)"))
    disable_hybrid_kv_cache_manager: bool = field(default=False, metadata=_option(
        "one block table for every layer even where the model mixes global and sliding-window "
        "layers (Gemma 3); by default the windowed layers get tables of their own and give back "
        "the blocks their window has passed"))
    session_kv_fraction: float = field(default=0.5, metadata=_option(
        "share of the KV cache that sessions' pinned prefixes (/v1/sessions) may hold together; "
        "pins yield to running requests under pressure"))
    max_session_kv_tokens: int | None = field(default=None, metadata=_option(
        "tokens of its history one session may keep pinned (default: the whole context)"))
    # Batch invariance holds for float32 on the CPU with pagoda's kernels, without --compile
    # (docs/architecture.md, "Sampling and determinism"). None = pagoda.config.DETERMINISTIC_DEFAULT
    # (off: benchmarks/README.md "Deterministic inference").
    deterministic: bool | None = field(default=None, metadata=_option(
        "batch-invariant inference: a request's tokens and logprobs do not depend on prefix "
        "caching, chunking or the rest of the batch (float32 on the CPU; costs 10-12%% of "
        "offline throughput; default: off)"))
    quantization: str | None = field(default=None, metadata=_option(
        "weight-only quantization in ggml blocks on pagoda's CPU kernels: int8 = Q8_0, "
        "int4 = Q4_1 (head Q8_0); gguf keeps a GGUF's blocks as stored (Q4_0/Q4_1/Q8_0, "
        "Q4_K/Q5_K/Q6_K, IQ4_XS/IQ4_NL); none dequantizes the weights to the dtype. Default auto: "
        "gguf for a GGUF, int8 for an HF checkpoint, none where --dtype is named (exact "
        "transformers parity) or off the CPU",
        choices=QUANTIZATIONS))
    device: str | None = field(default=None, metadata=_option(
        "torch device, e.g. cpu or cuda:0 (default: cuda when available and PAGODA_DEVICE is not cpu, else cpu)"))
    # KV tiers under the prefix cache (core/kv_tiers), vLLM's offloading flags
    kv_offload_memory: float | None = field(default=None, metadata=_option(
        "GiB of host memory for KV blocks the prefix cache evicts, kept in the cache's own format (an int8 or "
        "fp8 cache's codes and scales) and promoted back on a prefix hit (default: off, or 1 GiB with "
        "--kv-offload-dir)"))
    kv_offload_dir: str | None = field(default=None, metadata=_option(
        "directory of a disk tier of KV blocks under the host-memory tier: written in the background, kept "
        "across restarts (keyed by model, KV dtype, tenant and tokens; checksummed; files 0600), shareable by "
        "replicas of one model"))
    kv_offload_disk: float = field(default=10.0, metadata=_option(
        "GiB the --kv-offload-dir tier may hold; least recently used blocks are removed first (default: %(default)s)"))
    kv_offload_url: str | None = field(default=None, metadata=_option(
        "redis://HOST:PORT of a Valkey or Redis server holding KV blocks shared by replicas (beside --kv-offload-dir: "
        "written to both, read from the directory first); its maxmemory and allkeys-lru policy are the budget"))
    kv_offload_write_policy: str = field(default="write_through", metadata=_option(
        "which blocks go below host memory (--kv-offload-dir, --kv-offload-url), SGLang HiCache's policies: "
        "write_through, every computed block as it is computed (a restart, even after a kill, finds them all); "
        "write_through_selective, a block once it is used again (a workload that never repeats a prefix writes "
        "nothing) (default: %(default)s)", choices=KV_WRITE_POLICIES))
    kv_role: str = field(default="both", metadata=_option(
        "prefill/decode disaggregation: a prefill replica computes prompts and writes their KV to the shared tier "
        "(--kv-offload-dir or --kv-offload-url) before it answers; a decode replica reads it back and generates "
        "(pagoda router --pd-disaggregation); both: a replica that does both (default: %(default)s)",
        choices=KV_ROLES))
    aging_seconds: float = field(default=30.0, metadata=_option(
        "seconds of waiting that raise a request's effective priority by one level; 0 disables aging"))
    admission_pressure_threshold: float = field(default=0.9, metadata=_option(
        "above this KV memory pressure a new request must leave a block of headroom per running request"))
    short_chunk_tokens: int = field(default=16, metadata=_option(
        "a prefill chunk of at most this many tokens over a cached prefix runs through the paged decode kernel, "
        "reading the prefix in place (with the C++ kernels a fresh prompt this short too); a longer one takes "
        "one call of the flash-style prefill kernel (SDPA without the C++ kernels)"))
    long_prefill_token_threshold: int = field(default=0, metadata=_option(
        "a prefill takes at most this many tokens per step, and a prompt longer than this is long "
        "(0: no limit but the step's budget; with --max-num-partial-prefills above 1, 0 means 4%% of "
        "the context, as in vLLM)"))
    max_num_partial_prefills: int = field(default=1, metadata=_option(
        "how many requests may be mid-prefill at once (a prompt that finishes within a step does not count)"))
    max_long_partial_prefills: int = field(default=1, metadata=_option(
        "how many of those may be long (above --long-prefill-token-threshold); fewer than "
        "--max-num-partial-prefills lets short prompts pass long ones"))
    scheduling_policy: str = field(default="priority", metadata=_option(
        "priority: requests' priorities (with --aging-seconds) order the queue and may preempt; "
        "fcfs: arrival order only, priorities ignored", choices=SCHEDULING_POLICIES))
    tensor_parallel_size: int = field(default=1, metadata=_option(
        "number of ranks (GPUs) the model is sharded over", aliases=["-tp"]))
    distributed_executor_backend: str | None = field(default=None, metadata=_option(
        "how the ranks run: uni (in this process), mp (worker processes) or ray "
        "(default: uni at --tensor-parallel-size 1, mp above)", choices=DISTRIBUTED_BACKENDS))
    nnodes: int = field(default=1, metadata=_option("number of nodes the ranks span"))
    node_rank: int = field(default=0, metadata=_option("this node's index among the --nnodes nodes"))
    master_addr: str | None = field(default=None, metadata=_option(
        "address of the node of rank 0, where the ranks meet (default: $MASTER_ADDR, else 127.0.0.1)"))
    master_port: int | None = field(default=None, metadata=_option(
        "port where the ranks meet (default: $MASTER_PORT, else a free port chosen at start-up)"))
    distributed_timeout_seconds: float = field(default=60.0, metadata=_option(
        "a collective that takes longer fails the engine instead of hanging it"))
    speculative_config: dict | str | None = field(default=None, metadata=_option(
        "speculative decoding, as JSON with vLLM's fields: {\"method\": \"ngram\", \"num_speculative_tokens\": 4, "
        "\"prompt_lookup_min\": 2, \"prompt_lookup_max\": 5} or {\"method\": \"draft_model\", \"model\": NAME, "
        "\"quantization\": ..., \"num_speculative_tokens\": 4} (num_speculative_tokens 1-5; disable_by_batch_size, "
        "default 4: no drafts above that many running requests)", type=str))
    runner: str = field(default="auto", metadata=_option(
        "what the model serves: generate (text), or pooling (embeddings, scores: /v1/embeddings, /v1/score, "
        "/v1/rerank, /api/embed); auto: pooling for an encoder (BERT) or a sentence-transformers directory "
        "(modules.json), else generate", choices=RUNNERS))
    pooler_config: str | None = field(default=None, metadata=_option(
        "the pooling runner's pooling, as JSON: {\"pooling_type\": \"MEAN\" | \"CLS\" | \"LAST\", \"normalize\": true} "
        "(default: a sentence-transformers directory's own, else CLS for an encoder, LAST for a decoder; normalized)"))
    num_threads: int | None = field(default=None, metadata=_option(
        "CPU threads the engine computes with (torch's intra-op threads; default: torch's choice, one per core)"))
    # LoRA adapters (pagoda/lora/), vLLM's knobs and defaults; the adapters themselves come with
    # each request (LoRARequest) or the server's --lora-modules
    enable_lora: bool = field(default=False, metadata=_option(
        "serve LoRA adapters over the base model, chosen per request (--lora-modules, /v1/load_lora_adapter)"))
    max_loras: int = field(default=1, metadata=_option("distinct LoRA adapters in one batch (default: %(default)s)"))
    max_lora_rank: int = field(default=16, metadata=_option(
        "the highest LoRA rank served; an adapter above it is refused (default: %(default)s)"))
    max_cpu_loras: int | None = field(default=None, metadata=_option(
        "LoRA adapters kept loaded while no request uses them (default: --max-loras)"))
    lora_dtype: str = field(default="auto", metadata=_option(
        "the adapters' dtype: auto (the model's; bfloat16 over a quantized base), float32 or bfloat16",
        choices=("auto", "float32", "bfloat16", "float16")))
    kv_events_config: str | None = field(default=None, metadata=_option(
        "publish the prefix cache's stored / removed blocks over ZMQ in vLLM's format, as vLLM's JSON: "
        "{\"enable_kv_cache_events\": true, \"publisher\": \"zmq\", \"endpoint\": \"tcp://*:5557\", "
        "\"topic\": \"kv-events\"} (needs pip install 'pagoda[kv-events]')"))
    # images in prompts (pagoda/multimodal/limits.py), vLLM's flags
    limit_mm_per_prompt: str | None = field(default=None, metadata=_option(
        "images a prompt may hold, as vLLM's JSON '{\"image\": 2}' (default: 8)"))
    max_image_pixels: int = field(default=4096 * 4096, metadata=_option(
        "the most pixels (width x height) an image may have; a larger one is a 400 (default: %(default)s)"))
    allowed_local_media_path: str | None = field(default=None, metadata=_option(
        "a directory whose files image_url may name as file:// URLs (default: none may be read)"))
    allowed_media_domains: str | None = field(default=None, metadata=_option(
        "comma-separated hosts whose http(s) image URLs are fetched (default: none; send data: URLs)"))
    extra: dict = field(default_factory=dict, metadata=NO_OPTION)

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser,
                     overrides: dict[str, dict[str, Any]] | None = None) -> argparse._ArgumentGroup:
        """Add the "engine" argument group: one option per field, `--field-name`. `overrides`:
        a command's own add_argument keywords for some fields (serve's repeatable --model)."""
        group = parser.add_argument_group("engine")
        hints = typing.get_type_hints(cls)
        for f in _option_fields(cls):
            options = {**f.metadata["cli"], **(overrides or {}).get(f.name, {})}
            flags = [f"--{f.name.replace('_', '-')}", *options.pop("aliases", [])]
            if not {"type", "action"} & options.keys():
                options.update(_argparse_kind(f, hints[f.name]))
            group.add_argument(*flags, dest=f.name, default=f.default, **options)
        return group

    @classmethod
    def from_cli_args(cls, namespace: argparse.Namespace) -> EngineArgs:
        """The EngineArgs of a namespace parsed by a parser that `add_cli_args` filled."""
        return cls(**{f.name: getattr(namespace, f.name) for f in _option_fields(cls)})

    def _validate(self) -> None:
        """Check the values that need neither the model nor the device; a ValueError names the field."""
        tp = self.tensor_parallel_size
        checks = [
            (self.max_num_seqs >= 1, "max_num_seqs", "must be >= 1"),
            (self.max_num_batched_tokens >= 1, "max_num_batched_tokens", "must be >= 1"),
            (self.block_size in BLOCK_SIZES, "block_size", f"must be one of {', '.join(map(str, BLOCK_SIZES))}"),
            (self.kv_cache_memory is None or self.kv_cache_memory > 0, "kv_cache_memory", "must be > 0 GiB"),
            (0 < self.gpu_memory_utilization <= 1, "gpu_memory_utilization", "must be in (0, 1]"),
            (self.max_model_len is None or self.max_model_len >= 1, "max_model_len", "must be >= 1"),
            (self.aging_seconds >= 0, "aging_seconds", "must be >= 0"),
            (0 < self.admission_pressure_threshold <= 1, "admission_pressure_threshold", "must be in (0, 1]"),
            (self.short_chunk_tokens >= 1, "short_chunk_tokens", "must be >= 1"),
            (self.scheduling_policy in SCHEDULING_POLICIES, "scheduling_policy",
             f"must be one of {', '.join(SCHEDULING_POLICIES)}"),
            (tp >= 1, "tensor_parallel_size", "must be >= 1"),
            (self.distributed_executor_backend in (None, *DISTRIBUTED_BACKENDS), "distributed_executor_backend",
             f"must be one of {', '.join(DISTRIBUTED_BACKENDS)}"),
            (self.distributed_executor_backend != "uni" or tp == 1, "distributed_executor_backend",
             f"must be mp or ray with tensor_parallel_size={tp} (uni runs a single rank)"),
            (self.nnodes >= 1, "nnodes", "must be >= 1"),
            (0 <= self.node_rank < self.nnodes, "node_rank", f"must be in [0, nnodes={self.nnodes})"),
            (self.nnodes < 1 or tp % self.nnodes == 0, "tensor_parallel_size",
             f"must be divisible by nnodes={self.nnodes}"),
            (self.master_port is None or 0 < self.master_port < 65536, "master_port", "must be in [1, 65535]"),
            (self.distributed_timeout_seconds > 0, "distributed_timeout_seconds", "must be > 0"),
            (self.num_threads is None or self.num_threads >= 1, "num_threads", "must be >= 1"),
            (self.max_loras >= 1, "max_loras", "must be >= 1"),
            (self.max_lora_rank >= 1, "max_lora_rank", "must be >= 1"),
            (self.max_cpu_loras is None or self.max_cpu_loras >= self.max_loras, "max_cpu_loras",
             f"must be >= max_loras ({self.max_loras})"),
            (self.kv_offload_memory is None or self.kv_offload_memory >= 0, "kv_offload_memory", "must be >= 0 GiB"),
            (self.kv_offload_disk > 0, "kv_offload_disk", "must be > 0 GiB"),
            (self.kv_offload_dir != "", "kv_offload_dir", "must name a directory"),
            (self.kv_offload_url != "", "kv_offload_url", "must name a server (redis://HOST:PORT)"),
            (self.max_image_pixels >= 1, "max_image_pixels", "must be >= 1"),
            (self.kv_role in KV_ROLES, "kv_role", f"must be one of {', '.join(KV_ROLES)}"),
            (self.kv_role == "both" or self.kv_offload_dir or self.kv_offload_url, "kv_role",
             "needs a shared KV tier to hand the KV over: --kv-offload-dir (one host; a directory in /dev/shm is "
             "shared memory) or --kv-offload-url (across hosts)"),
        ]
        for ok, name, message in checks:
            if not ok:
                raise ValueError(f"{name} {message}, got {getattr(self, name)!r}")
        check_prefill_chunking(self.long_prefill_token_threshold, self.max_num_partial_prefills,
                               self.max_long_partial_prefills)


def _option_fields(cls: type) -> list[Field]:
    return [f for f in fields(cls) if f.metadata.get("cli") is not None]


def _argparse_kind(f: Field, hint: Any) -> dict[str, Any]:
    """`type` or `action` from the field's type: a flag for a bool that defaults to False, --x/--no-x
    for one that defaults to True or None (None: the engine decides), the scalar type otherwise."""
    base = _without_none(hint)
    if base is bool:
        return {"action": "store_true"} if f.default is False else {"action": argparse.BooleanOptionalAction}
    if base in (int, float):
        return {"type": base}
    if base is str:
        return {}
    raise TypeError(f"EngineArgs.{f.name}: no CLI option for type {hint!r}; give its option a type, or NO_OPTION")


def _without_none(hint: Any) -> Any:
    """`int` for `int | None`; the hint itself otherwise."""
    if isinstance(hint, UnionType):
        args = [a for a in typing.get_args(hint) if a is not NoneType]
        if len(args) == 1:
            return args[0]
    return hint

