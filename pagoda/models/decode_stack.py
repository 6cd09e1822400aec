"""The fused decode stack: the backend's implementation of a Llama-family model's layer sequence
as one C++ call (pagoda/csrc/decode_layers.cpp), for batches of decode-like rows on the CPU in
float32 (decode tokens, short chunks over a cached prefix, and under deterministic inference every
prefill chunk, each token a row of the paged kernel).

It runs the same ops in the same order as the Python layers, so outputs do not change; what goes
away is the Python between them (~40 torch calls per layer). Whether a model uses it is decided
once, when the model runner binds the KV cache (`choose_decode_stack`), logged at start-up and
reported in /v1/debug/engine with the reason; it is never switched per step, except that a batch
holding a prefill chunk runs the Python layers (the op has no causal chunk attention). Projections
whose weights were packed once at load (layers/packed_weights.py) pass those copies in, so the
stack takes their routes as the Python layers do; sliding windows (Mistral) pass to the paged
kernel per layer. Rows under LoRA adapters get their deltas inside the call, through the same op
the Python layers call (layers/lora_delta.StackRuns).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn

from pagoda.forward_context import AttentionMetadata
from pagoda.layers.ggml_blocks import BlockLinear
from pagoda.layers.packed_weights import packed_of
from pagoda.layers.half_weights import HalfLinear
from pagoda.layers.lora_delta import LoRABatch, StackRuns, kernel_takes
from pagoda.layers.superblocks import SuperBlockLinear

_FLOAT = -1  # block type of a float projection
_CACHE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # the ops widen a narrower cache as they read it


def _projection(module: nn.Module) -> tuple[torch.Tensor, int, torch.Tensor | None] | None:
    """(weight or blocks, block type, the weight's copy packed at load or None)."""
    if isinstance(module, (BlockLinear, SuperBlockLinear, HalfLinear)) and module.bias is None:
        return module.blocks, module.block_type, module.packed
    if type(module) is nn.Linear and module.bias is None and module.weight.dtype == torch.float32:
        return module.weight, _FLOAT, packed_of(module)
    return None


def _layer_projections(layer: nn.Module) -> list[tuple[str, nn.Module]]:
    """A layer's four projections, in the op's order."""
    attn, mlp = layer.self_attn, layer.mlp
    return [("qkv_proj", attn.qkv_proj), ("o_proj", attn.o_proj), ("gate_up_proj", mlp.gate_up_proj),
            ("down_proj", mlp.down_proj)]


class DecodeStack:
    def __init__(self, ops, weights: list[torch.Tensor], block_types: list[int], k_caches: list[torch.Tensor],
                 v_caches: list[torch.Tensor], rotary, cfg, packed: list[torch.Tensor | None] | None = None,
                 projections: list[nn.Module] | None = None) -> None:
        self.ops = ops  # torch.ops.pagoda
        self.weights, self.block_types = weights, block_types
        # projections' copies packed at load (float weights' oneDNN ones, blocks' tiles or bf16 ones),
        # one entry per projection ([] when there are none)
        self.packed = packed if packed and any(p is not None for p in packed) else []
        self.k_caches, self.v_caches = k_caches, v_caches
        self.rotary, self.cfg = rotary, cfg
        self.projections = projections or []  # in the op's order: their lora_key names each slot
        self._lora_runs: StackRuns | None = None  # the last step's adapters' runs

    @classmethod
    def build(cls, model: nn.Module, ops) -> DecodeStack:
        """The stack for ``model``'s layers as they are now (``unsupported(model)`` must be None)."""
        weights, types, packed, k_caches, v_caches, modules = [], [], [], [], [], []
        for layer in model.layers:
            attn = layer.self_attn
            layer_modules = [m for _, m in _layer_projections(layer)]
            modules += layer_modules
            projections = [_projection(m) for m in layer_modules]
            (qkv, t0, p0), (o, t1, p1), (gate_up, t2, p2), (down, t3, p3) = projections
            weights += [layer.input_layernorm.weight, qkv, o, layer.post_attention_layernorm.weight, gate_up, down]
            types += [t0, t1, t2, t3]
            packed += [p0, p1, p2, p3]
            k_caches.append(attn.attn.k_cache)
            v_caches.append(attn.attn.v_cache)
        return cls(ops, weights, types, k_caches, v_caches, model.layers[0].self_attn.rotary, model.config, packed,
                   modules)

    @staticmethod
    def unsupported(model: nn.Module) -> str | None:
        """Why the op cannot run ``model``'s layers as they are now, or None when it can."""
        cfg = model.config
        if cfg.qk_norm:
            return "the model normalizes q and k (qk_norm), which the fused op does not"
        if cfg.hidden_act not in ("silu", "swish"):
            return f"the MLP's activation is {cfg.hidden_act}; the fused op has SiLU only"
        if not model.layers:
            return "the model has no layers"
        if any(n.weight.dtype != torch.float32 for layer in model.layers
               for n in (layer.input_layernorm, layer.post_attention_layernorm)):
            return "the model computes in a narrower dtype than float32, which the fused op does not"
        for i, layer in enumerate(model.layers):
            attn = layer.self_attn
            for name, module in _layer_projections(layer):
                if _projection(module) is None:
                    return (f"layer {i}'s {name} ({type(module).__name__}) has a bias or a weight dtype the fused op "
                            "does not take (it takes float32 or ggml / half-precision blocks without bias)")
            if attn.attn.kv_group:
                return "the layers' KV cache has several groups; the fused op takes one block table for every layer"
            cache = attn.attn.k_cache
            if cache is None:
                return "the KV cache is not bound"
            if cache.dtype not in _CACHE_DTYPES or cache.device.type != "cpu":
                return f"the KV cache is {cache.dtype} on {cache.device.type}; the fused op reads float caches on the CPU"
        if model.layers[0].self_attn.rotary.cos_cache.dtype != torch.float32:
            return "the rotary tables are not float32"
        return None

    def applies(self, meta: AttentionMetadata) -> bool:
        """A batch of decode-like rows only: a prefill chunk takes the Python layers' causal
        attention. Rows under adapters the C++ op takes get their deltas in the op."""
        if meta.lora is None:
            self._lora_runs = None  # no adapter in the batch: let go of those of the last (they may be unloaded)
        return not meta.prefills and (meta.lora is None or self._runs(meta.lora) is not None)

    def _runs(self, lora: LoRABatch) -> StackRuns | None:
        """The step's adapters' runs for the stack's projections (kept while the adapters stay the
        same), or None where lora_add cannot take them (another dtype, or dtypes mixed)."""
        adapters = [deltas for deltas, _ in lora.groups]
        runs = self._lora_runs
        if runs is None or not runs.same_adapters(adapters):
            keys = [m.__dict__.get("lora_key", "") for m in self.projections]
            runs = self._lora_runs = StackRuns.build(adapters, keys)
        return runs if not runs.a_list or kernel_takes(runs.dtypes) else None

    def __call__(self, hidden: torch.Tensor, residual: torch.Tensor, positions: torch.Tensor,
                 meta: AttentionMetadata) -> torch.Tensor:
        cfg = self.cfg
        return self.ops.decode_layers(
            hidden, residual, positions, self.weights, self.block_types, self.packed, self.k_caches, self.v_caches,
            self.rotary.cos_cache, self.rotary.sin_cache, meta.slot_mapping, meta.decode_block_tables,
            meta.decode_seq_lens, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps,
            cfg.head_dim ** -0.5, [w or 0 for w in cfg.sliding_windows], *self._lora_args(meta.lora),
        )

    def _lora_args(self, lora: LoRABatch | None) -> tuple:
        runs = self._runs(lora) if lora is not None else None
        if runs is None or not runs.a_list:
            return [], [], [], [], [], [], [], []
        return runs.kernel_args([rows for _, rows in lora.groups])


@dataclass(frozen=True)
class ForwardPath:
    """How a model's decode batches run, chosen once per model runner (see the module docstring)."""

    fused_decode: bool
    reason: str  # on: what the stack covers; off: what keeps it off

    def as_dict(self) -> dict:
        return asdict(self)


FUSED_SCOPE = "batches of decode rows run every layer in one C++ call; a batch with a prefill chunk runs the Python layers"


def choose_decode_stack(model: nn.Module, refused: str | None = None) -> tuple[DecodeStack | None, ForwardPath]:
    """The stack for ``model`` (its KV cache bound) and the path with its reason. ``refused``: why
    the engine's configuration keeps the stack off (its option, torch.compile), if it does."""
    ops = model.backend.decode_stack_ops()
    reason = (refused
              or (None if ops is not None else "the fused op is one of pagoda's C++ kernels, not loaded on this backend")
              or model.decode_stack_unsupported()
              or DecodeStack.unsupported(model))
    if reason is not None:
        return None, ForwardPath(False, reason)
    return DecodeStack.build(model, ops), ForwardPath(True, FUSED_SCOPE)
