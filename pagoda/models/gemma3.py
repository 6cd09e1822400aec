"""Gemma 3 (``Gemma3ForCausalLM``, the text model), on the Llama layers of models/llama.py.

What differs from Llama, as transformers' modeling_gemma3.py computes it:

- interleaved attention: ``layer_types`` (or ``sliding_window_pattern``: every n-th layer global)
  marks local layers, which attend to their last ``sliding_window`` positions only
  (layers/attention.py masks every path) and rotate with ``rope_local_base_freq`` (10k); global
  layers rotate with ``rope_theta`` (1M) and its rope scaling, if any;
- q/k norms (an RMSNorm over each head) and queries scaled by ``query_pre_attn_scalar ** -0.5``;
- four norms per layer: input, post-attention (on the attention output, before the residual add),
  pre-feedforward, post-feedforward; every RMSNorm multiplies by ``1 + w``, so the loader stores
  ``1 + w`` (computed in fp32, as transformers does) in the ordinary RMSNorm's weight;
- embeddings scaled by ``sqrt(hidden_size)`` in the embedding's dtype; a tied head;
- GeGLU with the tanh-approximated GELU (``gelu_pytorch_tanh``);
- final logit soft-capping when the config sets one (Gemma 3 does not); attention soft-capping
  (Gemma 2) is refused.

The fused decode stack (models/decode_stack.py) chains the Llama layer's ops, so Gemma 3's
decode steps run the Python layers (with the C++ norm, rotary, paged-attention and block-matmul
kernels under them).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import torch
from torch import nn

from pagoda.distributed.parallel_state import TensorParallelGroup
from pagoda.distributed.shard_plan import ShardPlan
from pagoda.layers.norm import RMSNorm
from pagoda.layers.stored_weights import PackedWeight
from pagoda.layers.rotary import RotaryEmbedding
from pagoda.models.config import TransformerConfig, layer_windows
from pagoda.models.llama import MLP, Attention, LlamaForCausalLM

# Gemma3TextConfig's defaults for keys a config.json may leave out
_DEFAULT_GLOBAL_THETA, _DEFAULT_LOCAL_THETA = 1_000_000.0, 10_000.0
_DEFAULT_PATTERN, _DEFAULT_WINDOW = 6, 4096


def _scaling(params: dict) -> dict | None:
    return params if params.get("rope_type", params.get("type", "default")) != "default" else None


def rope_settings(hf: dict) -> tuple[tuple[float, dict | None], tuple[float, dict | None]]:
    """((theta, scaling) of the global layers, (theta, scaling) of the local ones), from either
    form of config.json: transformers 5's ``rope_parameters`` per layer type, or the older
    ``rope_theta`` / ``rope_scaling`` (global) and ``rope_local_base_freq`` (local)."""
    params = hf.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:
        full, local = params.get("full_attention") or {}, params.get("sliding_attention") or {}
        return ((float(full.get("rope_theta", hf.get("rope_theta", _DEFAULT_GLOBAL_THETA))), _scaling(full)),
                (float(local.get("rope_theta", hf.get("rope_local_base_freq", _DEFAULT_LOCAL_THETA))), _scaling(local)))
    theta = hf.get("rope_theta", params.get("rope_theta", _DEFAULT_GLOBAL_THETA))
    scaling = hf.get("rope_scaling") or _scaling(params)
    return (float(theta), scaling), (float(hf.get("rope_local_base_freq", _DEFAULT_LOCAL_THETA)), None)


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, cfg: TransformerConfig, rotary: RotaryEmbedding, plan: ShardPlan, tp: TensorParallelGroup,
                 index: int, scale: float) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, rotary, plan, tp, sliding_window=cfg.window(index), scale=scale)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, plan, tp)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions, hidden, residual):
        """(hidden, residual) in and out, the residual add deferred into the next fused norm as in
        the Llama layer: the stream is hidden + residual."""
        if residual is None:  # first layer: 0 + x == x exactly
            residual = torch.zeros_like(hidden)
        hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.post_attention_layernorm(self.self_attn(positions, hidden))
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual


class Gemma3ForCausalLM(LlamaForCausalLM):
    qk_norm = True

    @classmethod
    def read_config(cls, hf_config: dict) -> TransformerConfig:
        hf = dict(hf_config)
        if hf.get("attn_logit_softcapping") is not None:
            raise ValueError("Gemma attention logit soft-capping (attn_logit_softcapping) is not supported")
        if hf.get("use_bidirectional_attention"):
            raise ValueError("Gemma 3 with use_bidirectional_attention is not supported (causal only)")
        hf.setdefault("sliding_window", _DEFAULT_WINDOW)
        if not hf.get("layer_types"):
            hf.setdefault("sliding_window_pattern", _DEFAULT_PATTERN)
        cfg = TransformerConfig.from_hf(hf, cls.__name__, attention_bias=bool(hf.get("attention_bias", False)),
                                        qk_norm=True)
        (theta, scaling), _ = rope_settings(hf)
        activation = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
        return dataclasses.replace(cfg, rope_theta=theta, rope_scaling=scaling, hidden_act=activation,
                                   tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
                                   sliding_windows=layer_windows(hf, cfg.num_layers))

    def __init__(self, hf_config: dict, max_position: int) -> None:
        super().__init__(hf_config, max_position)
        self.final_logit_softcapping = hf_config.get("final_logit_softcapping")
        self.embed_scale = float(self.config.hidden_size) ** 0.5

    def _build_layers(self, cfg: TransformerConfig, hf_config: dict, max_position: int, plan: ShardPlan,
                      tp: TensorParallelGroup) -> nn.ModuleList:
        (global_theta, global_scaling), (local_theta, local_scaling) = rope_settings(hf_config)
        global_rotary = RotaryEmbedding(cfg.head_dim, max_position, global_theta, global_scaling)
        local_rotary = RotaryEmbedding(cfg.head_dim, max_position, local_theta, local_scaling)
        scale = float(hf_config.get("query_pre_attn_scalar") or cfg.head_dim) ** -0.5
        return nn.ModuleList(
            Gemma3DecoderLayer(cfg, local_rotary if cfg.window(i) else global_rotary, plan, tp, i, scale)
            for i in range(cfg.num_layers))

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = super().embed(input_ids)
        # transformers: embed(ids) * tensor(sqrt(hidden)).to(weight dtype) (sqrt(3072) is 55.5 in bf16)
        return hidden * torch.tensor(self.embed_scale, dtype=torch.float32).to(hidden.dtype)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        cap = self.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def decode_stack_unsupported(self) -> str | None:
        return "Gemma 3's layers (four norms each, GeGLU with GELU-tanh) are not the Llama layer the fused op chains"

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | PackedWeight]]) -> None:
        """As Llama's, with every RMSNorm weight stored as ``1 + w`` (Gemma's norm multiplies by it)."""

        def shifted():
            for name, tensor in weights:
                if name.endswith("norm.weight") and not isinstance(tensor, PackedWeight):
                    tensor = 1.0 + tensor.float()
                yield name, tensor

        super().load_weights(shifted())
