"""Engine configuration: what the user asks for (EngineArgs) and what it resolves to (EngineConfig)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pagoda.loader.catalog import DEFAULT_MODEL  # noqa: F401 - the engine's default, re-exported
from pagoda.loader.resolve import ModelFiles, resolve_model
from pagoda.platform import default_device, resolve_dtype

DEFAULT_KV_CACHE_GIB = 2.0
# EngineArgs.deterministic when not given. Off: measured on SmolLM2 fp32 (2 threads, AVX-512), it
# cost 10-12 % of offline throughput (64 x 128/128 tokens) and up to ~30 % of a long (2048-token)
# prefill, the invariant GEMM running at ~0.65-0.9x MKL's speed from 128 rows; decode steps ~0.
DETERMINISTIC_DEFAULT = False


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

    @property
    def name(self) -> str:
        return self.files.name


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    kv_cache_memory_gib: float | None = None  # CPU budget
    gpu_memory_utilization: float = 0.9  # CUDA: fraction of free memory after the weights
    enable_prefix_caching: bool = True


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    seed: int = 0
    enforce_eager: bool = False
    compile: bool = False  # torch.compile the model between attention layers (see worker/compiled.py)
    deterministic: bool = False  # batch-invariant kernels and layout (see EngineArgs.deterministic)


@dataclass
class EngineArgs:
    """The knobs of `LLM(...)` and `pagoda serve`, named as in vLLM."""

    model: str = DEFAULT_MODEL
    dtype: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    kv_cache_memory: float | None = None  # GiB (CPU)
    gpu_memory_utilization: float = 0.9
    seed: int = 0
    chat_template: str | None = None
    enforce_eager: bool = False
    # torch.compile the model (off by default: on this project's 2-core AVX2 CPU it measured no
    # faster and costs ~70 s of compilation; see benchmarks/README.md). enforce_eager wins.
    compile: bool = False
    enable_prefix_caching: bool = True
    device: str | None = None
    quantization: str | None = None  # none | int8 | int4 | gguf (weight-only, CPU kernels)
    # Deterministic (batch-invariant) inference: a request's tokens and logprobs do not depend on
    # whether its prefix was cached, how its prompt was chunked, or what else is in the batch
    # (docs/architecture.md, "Sampling and determinism"). It holds for float32 on the CPU with
    # pagoda's kernels, without --compile. None = DETERMINISTIC_DEFAULT (off: it cost 10-12 % of
    # offline throughput, up to ~30 % of prefill time, benchmarks/README.md "Deterministic inference")
    deterministic: bool | None = None
    extra: dict = field(default_factory=dict)

    def create_engine_config(self) -> EngineConfig:
        from pagoda.models.registry import resolve_architecture

        self._validate()
        device = torch.device(self.device) if self.device else default_device()
        files = resolve_model(self.model)
        hf_config = files.hf_config()
        architecture, _ = resolve_architecture(hf_config)
        dtype = resolve_dtype(self.dtype, device)
        model_max = int(hf_config.get("max_position_embeddings") or 2048)
        if self.max_model_len is not None and self.max_model_len > model_max:
            raise ValueError(f"max_model_len={self.max_model_len} is larger than the model's context ({model_max})")
        chat_template = _read_template(self.chat_template)
        quantization = _check_quantization(self.quantization, files, device)
        if quantization is not None:
            from pagoda.loader.model_loader import QUANTIZATION_KEY

            hf_config = {**hf_config, QUANTIZATION_KEY: quantization}  # how load_model receives it
        deterministic = self._resolve_deterministic(device, dtype)
        if deterministic:
            from pagoda.forward_context import DETERMINISTIC_KEY

            hf_config = {**hf_config, DETERMINISTIC_KEY: True}  # how the model runner receives it
        return EngineConfig(
            model=ModelConfig(files, hf_config, architecture, dtype, device, self.max_model_len or model_max,
                              chat_template, quantization),
            cache=CacheConfig(self.block_size, self.kv_cache_memory, self.gpu_memory_utilization, self.enable_prefix_caching),
            scheduler=SchedulerConfig(self.max_num_seqs, self.max_num_batched_tokens),
            seed=self.seed,
            enforce_eager=self.enforce_eager,
            compile=self.compile and not self.enforce_eager,
            deterministic=deterministic,
        )

    def _resolve_deterministic(self, device: torch.device, dtype: torch.dtype) -> bool:
        """Where batch invariance holds: float32 on the CPU, through pagoda's C++ kernels, without
        torch.compile (inductor's own kernels are not batch-invariant). Asked for elsewhere, it is
        honoured as far as it goes (on the CPU every row attends through the paged kernel; on CUDA
        nothing changes), with a warning."""
        compiled = self.compile and not self.enforce_eager
        holds = device.type == "cpu" and dtype == torch.float32 and not compiled  # the kernels: see ModelRunner
        if self.deterministic is None:
            return holds and DETERMINISTIC_DEFAULT
        if self.deterministic and not holds:
            _warn_once(
                "deterministic=True: batch invariance is guaranteed only for float32 on the CPU with pagoda's "
                f"C++ kernels and without --compile (here: device={device.type}, dtype={dtype}, compile={compiled}); "
                "results may still depend on the batch and on prefix caching"
            )
        return bool(self.deterministic)

    def _validate(self) -> None:
        checks = [
            (self.max_num_seqs >= 1, "max_num_seqs", "must be >= 1"),
            (self.max_num_batched_tokens >= 1, "max_num_batched_tokens", "must be >= 1"),
            (self.block_size in (8, 16, 32, 64, 128), "block_size", "must be one of 8, 16, 32, 64, 128"),
            (self.kv_cache_memory is None or self.kv_cache_memory > 0, "kv_cache_memory", "must be > 0 GiB"),
            (0 < self.gpu_memory_utilization <= 1, "gpu_memory_utilization", "must be in (0, 1]"),
            (self.max_model_len is None or self.max_model_len >= 1, "max_model_len", "must be >= 1"),
        ]
        for ok, name, message in checks:
            if not ok:
                raise ValueError(f"{name} {message}, got {getattr(self, name)!r}")


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        logging.getLogger(__name__).warning(message)


def _check_quantization(quantization: str | None, files: ModelFiles, device: torch.device) -> str | None:
    from pagoda.layers.quantization import check_quantization

    mode = check_quantization(quantization)
    if mode is not None and device.type != "cpu":
        raise ValueError(f"quantization={mode!r} uses torch's CPU kernels; it needs device 'cpu', got {device.type!r}")
    if mode == "gguf" and files.gguf_file is None:
        raise ValueError(f"quantization='gguf' keeps a GGUF's own quantized weights, but {files.name!r} is not a GGUF file")
    return mode


def _read_template(template: str | None) -> str | None:
    """--chat-template takes a template string or a path to a file holding one."""
    if template is None:
        return None
    path = Path(template).expanduser()
    if len(template) < 4096 and path.is_file():
        return path.read_text()
    return template
