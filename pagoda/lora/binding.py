"""Laying a PEFT adapter onto the model as it runs: its pairs grouped by pagoda's merged
projections (q/k/v → ``qkv_proj``, gate/up → ``gate_up_proj``), each pair's B written to its part's
output columns, and, under tensor parallelism, each pair cut as the base weight is: a
column-parallel projection (q/k/v, gate/up) keeps this rank's rows of B, a row-parallel one (o,
down) this rank's columns of A, whose partial product the layer's all-reduce sums like the base's.
A fused pair (Phi-3's q/k/v or gate/up, a mixture's experts' gate/up) is cut part by part.
"""

from __future__ import annotations

import torch
from torch import nn

from pagoda.layers.lora_delta import AdapterDeltas, DeltaPart, ProjectionDelta
from pagoda.lora.adapter import AdapterError, LoRAPair, PeftAdapter

# checkpoint projection → (pagoda's merged module, its part); the others are modules of their own
_MERGED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
           "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
# the modules the deltas attach to (layers/linear.py reads their ``lora_key``)
TARGET_MODULES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def label_projections(model: nn.Module) -> int:
    """Give every projection an adapter may target its module path as ``lora_key``; how many."""
    count = 0
    for path, module in model.named_modules():
        if path.rsplit(".", 1)[-1] in TARGET_MODULES and "shared_expert" not in path:
            module.lora_key = path
            count += 1
    return count


def bind_adapter(model: nn.Module, adapter: PeftAdapter, dtype: torch.dtype) -> AdapterDeltas:
    """The adapter's deltas for this rank of ``model``, keyed by module path."""
    grouped: dict[str, list[tuple[int, int, torch.Tensor, torch.Tensor]]] = {}
    for module, pair in adapter.pairs.items():
        layer, name = module.rsplit(".", 1)
        merged, part = _MERGED.get(name, (name, None))
        path = f"{layer}.{merged}"
        target = _submodule(model, path)
        if target is None or target.__dict__.get("lora_key") != path:
            raise AdapterError(f"adapter {adapter.path} adapts {module}, which this model does not have")
        a, b = _this_rank(model, module, pair, adapter.path)
        start = _part_start(model, merged, part)
        grouped.setdefault(path, []).append((start, b.shape[0], a, b * pair.scale))
    return {path: _projection_delta(parts, dtype) for path, parts in grouped.items()}


def adapter_nbytes(deltas: AdapterDeltas) -> int:
    return sum(delta.nbytes() for delta in deltas.values())


def _submodule(model: nn.Module, path: str) -> nn.Module | None:
    try:
        return model.get_submodule(path)
    except AttributeError:
        return None


def _this_rank(model: nn.Module, module: str, pair: LoRAPair, source: str) -> tuple[torch.Tensor, torch.Tensor]:
    a, b = pair.a, pair.b
    if not model.tp.is_parallel:
        return a, b
    layer, name = module.rsplit(".", 1)
    if name in _FUSED_PARTS:  # Phi-3's fused q/k/v or gate/up, a mixture's experts' gate/up: each part's rows
        sizes = _fused_sizes(model, name, b.shape[0])
        pieces = b.split(sizes)
        return a, torch.cat([_cut(model, f"{layer}.{part}", a, piece)[1] for part, piece in zip(_FUSED_PARTS[name], pieces)])
    return _cut(model, module, a, b)


# a fused projection → the checkpoint projections it stacks, in order
_FUSED_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def _fused_sizes(model: nn.Module, name: str, rows: int) -> list[int]:
    if name == "qkv_proj":
        cfg = model.config
        return [cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim]
    return [rows // 2, rows // 2]


def _cut(model: nn.Module, module: str, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's part of a pair, as the model cuts the weight of ``module`` (its weight_slice:
    a column-parallel weight's rows are B's, a row-parallel one's columns A's)."""
    cut = model.weight_slice(f"{module}.weight", (b.shape[0], a.shape[1]))
    if cut is None:
        return a, b
    dim, start, length = cut
    return (a, b[start:start + length]) if dim == 0 else (a[:, start:start + length], b)


def _part_start(model: nn.Module, merged: str, part: int | None) -> int:
    """The first output column of part ``part`` of merged projection ``merged`` on this rank."""
    if not part:
        return 0
    plan, head_dim = model.shards, model.config.head_dim
    if merged == "qkv_proj":  # q's heads, then k's, then v's
        return plan.num_heads * head_dim + (part - 1) * plan.num_kv_heads * head_dim
    return part * plan.intermediate_size  # gate's rows, then up's


def _projection_delta(parts: list[tuple[int, int, torch.Tensor, torch.Tensor]], dtype: torch.dtype) -> ProjectionDelta:
    parts.sort(key=lambda p: p[0])
    a = torch.cat([p[2] for p in parts]).to(dtype).contiguous()
    out, rank = [], 0
    for start, size, part_a, b in parts:
        out.append(DeltaPart(start, size, rank, rank + part_a.shape[0], b.t().to(dtype).contiguous()))
        rank += part_a.shape[0]
    return ProjectionDelta(a, tuple(out))
