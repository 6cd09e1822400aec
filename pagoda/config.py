"""Engine configuration: what the user asks for (EngineArgs) and what it resolves to (EngineConfig)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from pagoda.loader.resolve import ModelFiles, resolve_model
from pagoda.platform import default_device, resolve_dtype

DEFAULT_MODEL = "smollm2-135m-instruct"
DEFAULT_KV_CACHE_GIB = 2.0


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
        return EngineConfig(
            model=ModelConfig(files, hf_config, architecture, dtype, device, self.max_model_len or model_max,
                              chat_template, quantization),
            cache=CacheConfig(self.block_size, self.kv_cache_memory, self.gpu_memory_utilization, self.enable_prefix_caching),
            scheduler=SchedulerConfig(self.max_num_seqs, self.max_num_batched_tokens),
            seed=self.seed,
            enforce_eager=self.enforce_eager,
            compile=self.compile and not self.enforce_eager,
        )

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
