"""Architecture name (config.json `architectures` or GGUF `general.architecture`) → model class."""

from __future__ import annotations

from torch import nn

from pagoda.models.llama import LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}

# GGUF general.architecture → config.json architecture name
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


def supported_architectures() -> list[str]:
    return sorted(MODEL_REGISTRY)


def resolve_architecture(hf_config: dict) -> tuple[str, type[nn.Module]]:
    names = hf_config.get("architectures") or []
    for name in names:
        if name in MODEL_REGISTRY:
            return name, MODEL_REGISTRY[name]
    raise ValueError(
        f"unsupported model architecture {names or hf_config.get('model_type')!r}; "
        f"pagoda supports: {', '.join(supported_architectures())}"
    )
