"""Bamba (``BambaForCausalLM``): a hybrid of Mamba-2 mixers and Llama attention, on the Llama
classes of models/llama.py.

Every layer is ``x + mix(norm(x))`` then ``x + mlp(norm(x))`` (a SwiGLU MLP); ``mix`` is a
Mamba-2 mixer (layers/mamba_mixer.py) except in the layers ``attn_layer_indices`` names, where it
is Llama's attention with a partial rotary: the first half of each head rotates
(``partial_rotary_factor`` 0.5, which transformers' Bamba sets whatever the config says). The
paged KV cache holds the attention layers only; the mixers keep each request's state in its slot
(worker/state_cache.py).

Bamba is the plainest Mamba-2 + attention hybrid transformers implements; Granite 4.0-H and
Nemotron-H put the same mixer beside their own attention and MLPs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import torch
from torch import nn

from pagoda.distributed.parallel_state import TensorParallelGroup
from pagoda.distributed.shard_plan import ShardPlan
from pagoda.layers.attention import PagedAttention
from pagoda.layers.mamba_mixer import Mamba2Mixer, MambaConfig
from pagoda.layers.norm import RMSNorm
from pagoda.layers.rotary import RotaryEmbedding
from pagoda.layers.stored_weights import PackedWeight
from pagoda.models.config import TransformerConfig
from pagoda.models.llama import MLP, Attention, LlamaForCausalLM
from pagoda.models.mamba2 import refuse_tensor_parallel

_PARTIAL_ROTARY = 0.5  # transformers' BambaConfig hard-codes it


class PartialRotary(nn.Module):
    """Rotates the first ``rotary_dim`` features of each head and passes the rest, as
    transformers' apply_rotary_pos_emb does when cos / sin are narrower than the head."""

    def __init__(self, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.rotary, self.rotary_dim = rotary, rotary.head_dim

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        d = self.rotary_dim
        q_rot, k_rot = self.rotary(positions, q[..., :d].contiguous(), k[..., :d].contiguous())
        return torch.cat([q_rot, q[..., d:]], dim=-1), torch.cat([k_rot, k[..., d:]], dim=-1)


class BambaDecoderLayer(nn.Module):
    def __init__(self, cfg: TransformerConfig, mamba: MambaConfig, rotary: PartialRotary, plan: ShardPlan,
                 tp: TensorParallelGroup, attends: bool) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attends = attends
        if attends:
            self.self_attn = Attention(cfg, rotary, plan, tp)
        else:
            self.mamba = Mamba2Mixer(mamba)
        self.pre_ff_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.feed_forward = MLP(cfg, plan, tp)

    def forward(self, positions, hidden, residual):
        hidden, residual = mix(self, positions, hidden, residual)
        hidden, residual = self.pre_ff_layernorm(hidden, residual)
        return self.feed_forward(hidden), residual


def mix(layer: nn.Module, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None):
    """A hybrid layer's first half: its input norm, then its attention or its mixer. (hidden,
    residual) in and out, the residual add deferred into the next fused norm as in the Llama layer:
    the stream is hidden + residual."""
    if residual is None:  # first layer: 0 + x == x exactly
        residual = torch.zeros_like(hidden)
    hidden, residual = layer.input_layernorm(hidden, residual)
    return (layer.self_attn(positions, hidden) if layer.attends else layer.mamba(hidden)), residual


def attention_indices(hf_config: dict) -> list[int]:
    return sorted(int(i) for i in hf_config.get("attn_layer_indices") or [])


class BambaForCausalLM(LlamaForCausalLM):
    @classmethod
    def read_config(cls, hf_config: dict) -> TransformerConfig:
        """The attention layers' shape. ``num_layers`` counts the attention layers only: it is
        what the KV cache sizes a block by (core/kv_cache_groups.py)."""
        if hf_config.get("attention_bias") or hf_config.get("mlp_bias"):
            raise ValueError("Bamba with attention_bias or mlp_bias is not supported")
        hf = dict(hf_config)
        hf.pop("partial_rotary_factor", None)  # applied by PartialRotary, not refused by rope_scaling
        hf["rope_parameters"] = {k: v for k, v in (hf.get("rope_parameters") or {}).items()
                                 if k != "partial_rotary_factor"}
        cfg = TransformerConfig.from_hf(hf, cls.__name__, attention_bias=False)
        return dataclasses.replace(cfg, num_layers=len(attention_indices(hf_config)), sliding_windows=())

    def __init__(self, hf_config: dict, max_position: int) -> None:
        refuse_tensor_parallel(type(self).__name__)
        super().__init__(hf_config, max_position)

    def _build_layers(self, cfg: TransformerConfig, hf_config: dict, max_position: int, plan: ShardPlan,
                      tp: TensorParallelGroup) -> nn.ModuleList:
        rotary = PartialRotary(RotaryEmbedding(int(cfg.head_dim * _PARTIAL_ROTARY), max_position, cfg.rope_theta,
                                               cfg.rope_scaling))
        mamba, attends = MambaConfig.from_hf(hf_config, prefix="mamba_"), set(attention_indices(hf_config))
        return nn.ModuleList(BambaDecoderLayer(cfg, mamba, rotary, plan, tp, i in attends)
                             for i in range(hf_config["num_hidden_layers"]))

    def attention_layers(self) -> list[PagedAttention]:
        return [layer.self_attn.attn for layer in self.layers if layer.attends]

    def state_layers(self) -> list[Mamba2Mixer]:
        return [layer.mamba for layer in self.layers if not layer.attends]

    def decode_stack_unsupported(self) -> str | None:
        return "state-space layers: the fused op chains attention layers only"

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | PackedWeight]]) -> None:
        """As Llama's, with Bamba's final norm's name."""
        super().load_weights((name.replace("final_layernorm.", "norm."), tensor) for name, tensor in weights)
