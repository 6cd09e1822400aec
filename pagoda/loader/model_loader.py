"""Builds the model for an architecture and fills it with weights in the requested dtype."""

from __future__ import annotations

import torch
from torch import nn

from pagoda.layers.rotary import RotaryEmbedding
from pagoda.loader.resolve import ModelFiles
from pagoda.models.registry import resolve_architecture


def load_model(files: ModelFiles, hf_config: dict, dtype: torch.dtype, device: torch.device, max_position: int) -> nn.Module:
    _, model_cls = resolve_architecture(hf_config)
    with torch.device("meta"):
        model = model_cls(hf_config, max_position)
    model = model.to_empty(device="cpu")
    _init_buffers(model)
    model.load_weights(_weights(files, hf_config))
    return model.to(device=device, dtype=dtype).eval()


def _init_buffers(model: nn.Module) -> None:
    """Non-persistent buffers (rotary tables) are computed, not loaded: rebuild them on CPU."""
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.reset_cache()


def _weights(files: ModelFiles, hf_config: dict):
    if files.gguf_file is not None:
        from pagoda.loader.gguf import iter_gguf_weights

        return iter_gguf_weights(files.gguf_file, hf_config)
    from pagoda.loader.safetensors import iter_safetensors_weights

    return iter_safetensors_weights(files.metadata_dir)
