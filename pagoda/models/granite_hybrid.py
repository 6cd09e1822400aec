"""Granite 4.0-H (``GraniteMoeHybridForCausalLM``): Mamba-2 mixers with a few attention layers,
each layer's MLP a shared SwiGLU plus, in the MoE sizes (Tiny, Small), a mixture of experts; on
the Llama classes (models/llama.py), the mixer of layers/mamba_mixer.py and the sparse block of
models/moe.py.

What differs from Bamba (models/bamba.py), as transformers' modeling_granitemoehybrid.py computes it:

- ``layer_types`` says which layers attend; attention has no rotary at all unless
  ``position_embedding_type`` is "rope" (Granite 4.0-H is "nope") and scales queries by
  ``attention_multiplier`` instead of head_dim ** -0.5;
- the MLP is ``shared_mlp`` (one fused ``input_linear``: gate rows, then up rows) plus, with
  ``num_local_experts`` > 0, ``block_sparse_moe`` (a router ``router.layer``, every expert's
  gate/up in one [E, 2I, H] ``input_linear`` and down in [E, H, I] ``output_linear``; the top k
  logits' softmax weighs them, which is the full softmax renormalized over the top k);
- the embeddings are scaled by ``embedding_multiplier``, each block's output (mixer or attention,
  then MLP) by ``residual_multiplier`` before the residual add, and the logits divided by
  ``logits_scaling``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from pagoda.distributed.parallel_state import TensorParallelGroup
from pagoda.distributed.shard_plan import ShardPlan
from pagoda.layers.mamba_mixer import Mamba2Mixer, MambaConfig
from pagoda.layers.norm import RMSNorm
from pagoda.layers.rotary import RotaryEmbedding
from pagoda.layers.stored_weights import PackedWeight
from pagoda.models.config import TransformerConfig
from pagoda.models.bamba import BambaForCausalLM, mix
from pagoda.models.llama import MLP, Attention
from pagoda.models.moe import MoEConfig, SparseMoeBlock

_ATTENTION_TYPES = ("attention", "full_attention")  # config.json's older and newer names


class NoRotary(nn.Module):
    """NoPE: queries and keys as they are."""

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        return q, k


class GraniteHybridLayer(nn.Module):
    def __init__(self, cfg: TransformerConfig, mamba: MambaConfig | None, rotary: nn.Module, plan: ShardPlan,
                 tp: TensorParallelGroup, moe: MoEConfig | None, scale: float, residual_multiplier: float) -> None:
        """``mamba``: the mixer's shape, or None for an attention layer."""
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attends = mamba is None
        if self.attends:
            self.self_attn = Attention(cfg, rotary, plan, tp, scale=scale)
        else:
            self.mamba = Mamba2Mixer(mamba)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.shared_mlp = MLP(cfg, plan, tp)
        self.block_sparse_moe = SparseMoeBlock(cfg, moe, tp) if moe is not None else None
        self.residual_multiplier = residual_multiplier

    def forward(self, positions, hidden, residual):
        hidden, residual = mix(self, positions, hidden, residual)
        hidden, residual = self.post_attention_layernorm(hidden * self.residual_multiplier, residual)
        out = self.shared_mlp(hidden)
        if self.block_sparse_moe is not None:
            out = self.block_sparse_moe(hidden) + out
        return out * self.residual_multiplier, residual


def attention_layers_of(hf_config: dict) -> list[bool]:
    types = hf_config.get("layer_types") or hf_config.get("layers_block_type")
    if not types or len(types) != hf_config["num_hidden_layers"]:
        raise ValueError("GraniteMoeHybrid: config.json needs layer_types, one per layer")
    return [t in _ATTENTION_TYPES for t in types]


class GraniteMoeHybridForCausalLM(BambaForCausalLM):
    """Bamba's model (the attention and state layers, tensor parallelism refused) with Granite's
    layers, multipliers and weight names."""

    @classmethod
    def read_config(cls, hf_config: dict) -> TransformerConfig:
        """The attention layers' shape, the dense MLP the shared one; ``num_layers`` counts the
        attention layers only (what the KV cache sizes a block by)."""
        if hf_config.get("attention_bias"):
            raise ValueError("GraniteMoeHybrid with attention_bias is not supported")
        hf = {**hf_config, "intermediate_size": hf_config["shared_intermediate_size"]}
        cfg = TransformerConfig.from_hf(hf, cls.__name__, attention_bias=False)
        return dataclasses.replace(cfg, num_layers=sum(attention_layers_of(hf_config)), sliding_windows=())

    def __init__(self, hf_config: dict, max_position: int) -> None:
        super().__init__(hf_config, max_position)
        self.embedding_multiplier = float(hf_config.get("embedding_multiplier", 1.0))
        self.logits_scaling = float(hf_config.get("logits_scaling", 1.0))

    def _build_layers(self, cfg: TransformerConfig, hf_config: dict, max_position: int, plan: ShardPlan,
                      tp: TensorParallelGroup) -> nn.ModuleList:
        rope = hf_config.get("position_embedding_type") == "rope"
        rotary = RotaryEmbedding(cfg.head_dim, max_position, cfg.rope_theta, cfg.rope_scaling) if rope else NoRotary()
        mamba = MambaConfig.from_hf(hf_config, prefix="mamba_")
        experts = int(hf_config.get("num_local_experts") or 0)
        # each expert's intermediate size is intermediate_size (the shared MLP's is its own)
        moe = MoEConfig(experts, int(hf_config["num_experts_per_tok"]), int(hf_config["intermediate_size"]), True) \
            if experts else None
        scale = float(hf_config.get("attention_multiplier", cfg.head_dim ** -0.5))
        residual = float(hf_config.get("residual_multiplier", 1.0))
        return nn.ModuleList(GraniteHybridLayer(cfg, None if attends else mamba, rotary, plan, tp, moe, scale, residual)
                             for attends in attention_layers_of(hf_config))

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().embed(input_ids) * self.embedding_multiplier

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().compute_logits(hidden) / self.logits_scaling

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | PackedWeight]]) -> None:
        """As Llama's, with Granite's fused MLP tensors cut into the gate / up / down names it loads."""
        # (Bamba's renaming of its final norm finds nothing here: Granite's is "norm")
        super().load_weights(_llama_names(weights))


def _llama_names(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in weights:
        if isinstance(tensor, PackedWeight):
            tensor = tensor.dequantize()
        if ".shared_mlp.input_linear." in name:
            gate, up = tensor.chunk(2, dim=0)
            yield name.replace(".input_linear.", ".gate_proj."), gate
            yield name.replace(".input_linear.", ".up_proj."), up
        elif ".shared_mlp.output_linear." in name:
            yield name.replace(".output_linear.", ".down_proj."), tensor
        elif ".block_sparse_moe.router.layer." in name:
            yield name.replace(".router.layer.", ".gate."), tensor
        elif ".block_sparse_moe.input_linear." in name:
            for e, expert in enumerate(tensor):
                gate, up = expert.chunk(2, dim=0)
                yield name.replace(".input_linear.", f".experts.{e}.gate_proj."), gate
                yield name.replace(".input_linear.", f".experts.{e}.up_proj."), up
        elif ".block_sparse_moe.output_linear." in name:
            for e, expert in enumerate(tensor):
                yield name.replace(".output_linear.", f".experts.{e}.down_proj."), expert
        else:
            yield name, tensor
