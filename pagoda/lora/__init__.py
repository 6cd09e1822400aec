"""LoRA adapters over a served base model (vLLM's interface): ``LoRARequest`` names an adapter
for a request, ``peft_adapter`` reads and checks PEFT's files, ``binding`` lays an adapter onto the
model's merged projections (the deltas of layers/lora_delta.py), ``config`` holds the engine's
limits. Which adapters the workers hold is the scheduler's (core/lora_residency.py)."""

from pagoda.lora.request import LoRARequest

__all__ = ["LoRARequest"]
