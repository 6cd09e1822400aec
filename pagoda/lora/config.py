"""The engine's LoRA limits (EngineArgs' LoRA knobs, resolved)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LoRAConfig:
    max_loras: int = 1  # distinct adapters in one batch (vLLM's --max-loras)
    max_lora_rank: int = 16  # an adapter of a higher rank is refused
    # adapters the workers keep loaded while no request uses them (an LRU; in use: always kept)
    max_cpu_loras: int = 1
    dtype: torch.dtype = torch.float32  # the adapters' weights and their matmuls

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {self.max_loras}")
        if self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be >= 1, got {self.max_lora_rank}")
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")


# the id of a store model's own adapter (a Modelfile's ADAPTER), apart from those a server numbers from 1
MODEL_ADAPTER_ID = 1 << 30


def lora_config(args, model_dtype: torch.dtype, quantized: bool, pools: bool,
                model_adapter_rank: int | None = None) -> LoRAConfig | None:
    """EngineArgs' LoRA knobs resolved against the model: None unless ``enable_lora`` or the
    model carries its own adapter (``model_adapter_rank``: its rank, which the limit then admits)."""
    if not args.enable_lora and model_adapter_rank is None:
        return None
    if pools:
        raise ValueError("enable_lora: the pooling runner serves no adapters (--runner pooling)")
    if args.lora_dtype == "auto":  # the model's; over a quantized base (already approximate) bfloat16, half
        # the bytes a decode step reads for every adapter of its batch (benchmarks/README.md, "LoRA")
        dtype = torch.bfloat16 if quantized or model_dtype not in (torch.float32, torch.bfloat16) else model_dtype
    else:
        dtype = getattr(torch, args.lora_dtype)
    max_rank = max(args.max_lora_rank, model_adapter_rank or 0)
    return LoRAConfig(args.max_loras, max_rank, args.max_cpu_loras or args.max_loras, dtype)
