"""LoRA on a mixture's experts, as PEFT trains it on transformers' fused expert weights
(``target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]``): one pair a 3-D
parameter, A ``[experts * r, in]`` (expert-major) and B ``[out, r * experts]`` (expert-minor), so
expert e's delta is ``B[:, :, e] @ A[e]`` (PEFT's ``ParamWrapper``). PEFT nests the wrappers of
one module's parameters (``experts.lora_A`` and ``experts.base_layer.lora_A``), in an order its
names do not tell; the shapes do (gate/up maps hidden → 2 x intermediate, down intermediate →
hidden, and both cannot hold at once). Each expert's pair becomes one of pagoda's per-expert
modules (``layers.3.mlp.experts.5.gate_up_proj``).
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from pagoda.lora.adapter import AdapterError, LoRAPair

_KEY = re.compile(r"^(?:base_model\.model\.)?(?:model\.)?layers\.(\d+)\.mlp\.experts\.((?:base_layer\.)*)lora_([AB])"
                  r"\.weight$")


def expert_pairs(tensors: dict[str, torch.Tensor], config: dict, hf_config: dict, root: Path,
                 scale_of) -> dict[str, LoRAPair]:
    """The per-expert pairs of ``tensors``' fused-expert keys, which are taken out of ``tensors``;
    ``scale_of(module, rank)`` gives a pair's scale."""
    wrapped: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key in [k for k in tensors if _KEY.match(k)]:
        layer, depth, half = _KEY.match(key).groups()
        wrapped.setdefault((int(layer), depth), {})[half] = tensors.pop(key).float()
    if not wrapped:
        return {}
    experts = int(hf_config.get("num_local_experts") or hf_config.get("num_experts") or 0)
    hidden = int(hf_config["hidden_size"])
    inter = int(hf_config.get("moe_intermediate_size") or hf_config["intermediate_size"])
    if experts < 1:
        raise AdapterError(f"adapter {root} adapts a mixture's experts, but the base model has none")
    pairs = {}
    for (layer, _), half in sorted(wrapped.items()):
        if set(half) != {"A", "B"}:
            raise AdapterError(f"adapter {root}: layer {layer}'s experts have lora_{''.join(half)} without the other")
        a, b = half["A"], half["B"]
        name = _which(a, b, hidden, inter)
        if name is None or a.shape[0] % experts or a.shape[0] != b.shape[1]:
            raise AdapterError(f"adapter {root} was trained for another base: layer {layer}'s experts' pair has "
                               f"shapes {tuple(a.shape)} and {tuple(b.shape)} ({experts} experts, hidden {hidden}, "
                               f"intermediate {inter})")
        rank = a.shape[0] // experts
        a_e, b_e = a.reshape(experts, rank, -1), b.reshape(b.shape[0], rank, experts)
        scale = scale_of(f"layers.{layer}.mlp.experts.{name}", rank)
        for e in range(experts):
            pairs[f"layers.{layer}.mlp.experts.{e}.{name}"] = LoRAPair(a_e[e].contiguous(),
                                                                      b_e[:, :, e].contiguous(), scale)
    return pairs


def _which(a: torch.Tensor, b: torch.Tensor, hidden: int, inter: int) -> str | None:
    if a.shape[1] == hidden and b.shape[0] == 2 * inter:
        return "gate_up_proj"
    if a.shape[1] == inter and b.shape[0] == hidden:
        return "down_proj"
    return None
