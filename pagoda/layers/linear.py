"""Projections through the backend: a bias-free float32 ``nn.Linear`` goes through
``backend.linear`` (on the C++ backend ``torch.ops.pagoda.linear``, csrc/small_matmul.cpp, a
register-tiled GEMM whose row results do not depend on how many rows share the call; it serves up
to 32 rows, and every M under deterministic inference; from 33 rows oneDNN on the weight packed at
load where that measured faster (layers/packed_weights.py), else ``at::linear``). The Python layers
and the one-call decoder stack both multiply through it, so they agree exactly.

With LoRA on, the worker names each projection module (``lora_key``, its module path), and the
step's adapters (``AttentionMetadata.lora``, layers/lora_delta.py) add their deltas to the rows
of their requests after the base product."""

from __future__ import annotations

import torch
from torch import nn

from pagoda.forward_context import get_attention_metadata
from pagoda.layers.backend import TorchBackend
from pagoda.layers.packed_weights import packed_of


def project(layer: nn.Module, x: torch.Tensor, backend: TorchBackend) -> torch.Tensor:
    """``layer(x)``; a bias-free ``nn.Linear`` through ``backend.linear``; plus the LoRA deltas of
    the step's adapters where the layer has any."""
    if type(layer) is nn.Linear and layer.bias is None:
        y = backend.linear(x, layer.weight, packed_of(layer))
    else:
        y = layer(x)
    key = layer.__dict__.get("lora_key")  # (set on the instance only when LoRA is on: no cost otherwise)
    if key is not None:
        lora = get_attention_metadata().lora
        if lora is not None:
            y = lora.apply(key, x, y, backend)
    return y
