"""The mixture-of-experts block shared by Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE, and the decoder
built from it on the Llama layers (attention, norms, rotary: models/llama.py).

A sparse block replaces the dense MLP: a router (``gate``, one logit per expert) picks each token's
``top_k`` experts, and the token's output is the sum of those experts' SwiGLU MLPs weighted by
the router's softmax probabilities, renormalized over the chosen ones or not as the family says
(``renormalize``: Mixtral always; the others ``norm_topk_prob``). Qwen2-MoE adds a shared expert
that every token passes through, scaled by ``sigmoid(shared_expert_gate(x))``.

Tokens are grouped by expert (a stable sort of the (token, choice) pairs by expert id), so each
expert runs one matmul pair over all of its tokens and the Python loop goes over experts, never
tokens; the weighted outputs are summed back per token in expert order (``index_add_``), as
transformers sums them. Each expert is an ordinary module with ``gate_up_proj`` and ``down_proj``,
so the checkpoint's per-expert tensors load through the Llama loader and every quantization mode
(a GGUF's stored blocks under ``--quantization gguf``, int8 / int4) replaces each expert's
projections like the dense ones (layers/quantization.py).

Under tensor parallelism the experts shard as the dense MLP does: every rank holds every expert
with its slice of the intermediate rows (gate/up column-parallel, down row-parallel), routes every
token the same way (the router is replicated), and one all-reduce sums the ranks' partial outputs
of the whole block, shared expert included.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from pagoda.distributed.parallel_state import TensorParallelGroup
from pagoda.distributed.shard_plan import ShardPlan
from pagoda.forward_context import get_attention_metadata
from pagoda.layers.backend import TorchBackend, current_backend
from pagoda.layers.linear import project
from pagoda.layers.norm import RMSNorm
from pagoda.layers.stored_weights import PackedWeight
from pagoda.layers.rotary import RotaryEmbedding
from pagoda.models.config import TransformerConfig
from pagoda.models.llama import _GATED_ACTIVATIONS, MLP, Attention, LlamaForCausalLM


@dataclass(frozen=True)
class MoEConfig:
    num_experts: int
    top_k: int
    intermediate_size: int  # each expert's
    renormalize: bool  # divide the chosen experts' probabilities by their sum
    shared_intermediate_size: int = 0  # Qwen2-MoE's shared expert (0: none)
    sparse_layers: tuple[bool, ...] = ()  # per layer: a sparse block (else the dense MLP)

    def __post_init__(self) -> None:
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"num_experts_per_tok={self.top_k} must be between 1 and num_experts={self.num_experts}")

    def check_tensor_parallel(self, world_size: int) -> None:
        for name, size in (("the experts' intermediate size", self.intermediate_size),
                           ("the shared expert's intermediate size", self.shared_intermediate_size)):
            if size % world_size:
                raise ValueError(f"tensor_parallel_size={world_size} must divide {name} ({size})")


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] → (weights [T, k] float32, expert ids [T, k]): softmax in float32, the
    top k, renormalized over them if asked (transformers' ``*TopKRouter``)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


class ExpertMLP(nn.Module):
    """One expert (or the shared expert): ``down(act(gate(x)) * up(x))`` with gate and up merged,
    no all-reduce (the block sums every rank's part once)."""

    def __init__(self, hidden_size: int, intermediate_size: int, act_and_mul, backend: TorchBackend) -> None:
        super().__init__()
        self.backend, self.act_and_mul = backend, act_and_mul
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return project(self.down_proj, self.act_and_mul(project(self.gate_up_proj, x, self.backend)), self.backend)


class SparseMoeBlock(nn.Module):
    def __init__(self, cfg: TransformerConfig, moe: MoEConfig, tp: TensorParallelGroup) -> None:
        super().__init__()
        if cfg.hidden_act not in _GATED_ACTIVATIONS:
            raise ValueError(f"activation {cfg.hidden_act!r} is not supported ({', '.join(_GATED_ACTIVATIONS)})")
        self.tp, self.backend = tp, current_backend()
        self.top_k, self.renormalize = moe.top_k, moe.renormalize
        act = getattr(self.backend, _GATED_ACTIVATIONS[cfg.hidden_act])
        per_rank = moe.intermediate_size // tp.world_size
        self.gate = nn.Linear(cfg.hidden_size, moe.num_experts, bias=False)  # the router, replicated
        self.experts = nn.ModuleList(ExpertMLP(cfg.hidden_size, per_rank, act, self.backend)
                                     for _ in range(moe.num_experts))
        self.shared_expert = self.shared_expert_gate = None
        if moe.shared_intermediate_size:
            self.shared_expert = ExpertMLP(cfg.hidden_size, moe.shared_intermediate_size // tp.world_size, act,
                                           self.backend)
            self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)

    def router_logits(self, x: torch.Tensor) -> torch.Tensor:
        return project(self.gate, x, self.backend)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.router_logits(x), self.top_k, self.renormalize)
        out = self.experts_output(x, weights, ids)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(project(self.shared_expert_gate, x, self.backend)) * self.shared_expert(x)
        return self.tp.all_reduce(out)  # row-parallel experts: sum the ranks' parts

    def experts_output(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """sum over k of weights[t, k] * expert[ids[t, k]](x[t]), each expert one matmul pair over
        the rows routed to it."""
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)  # (token, choice) pairs grouped by expert
        rows = order // self.top_k  # the token of each pair
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        groups = x.index_select(0, rows).split(counts)
        lora = _step_lora(self.experts[0])
        if lora is None:
            parts = [expert(group) for expert, group in zip(self.experts, groups) if group.shape[0]]
        else:  # each expert's rows under their own adapters (LoRA on the experts)
            token_rows = np.split(rows.numpy(), np.cumsum(counts)[:-1])
            parts = [_under_adapters(lora.for_rows(r), expert, group)
                     for expert, group, r in zip(self.experts, groups, token_rows) if group.shape[0]]
        weighted = torch.cat(parts) * weights.reshape(-1)[order].unsqueeze(1).to(x.dtype)
        return torch.zeros_like(x).index_add_(0, rows, weighted)


def _step_lora(expert: ExpertMLP):
    """The step's LoRA batch when the experts take adapters (LoRA on, some row under one), else None."""
    if expert.gate_up_proj.__dict__.get("lora_key") is None:
        return None
    return get_attention_metadata().lora


def _under_adapters(lora, expert: ExpertMLP, group: torch.Tensor) -> torch.Tensor:
    """``expert(group)`` with the step's LoRA batch narrowed to the group's rows."""
    meta = get_attention_metadata()
    step = meta.lora
    meta.lora = lora
    try:
        return expert(group)
    finally:
        meta.lora = step


class MoeDecoderLayer(nn.Module):
    """The Llama layer with a sparse block (or, on a dense layer of a mixed model, the MLP)."""

    def __init__(self, cfg: TransformerConfig, moe: MoEConfig, attention: Attention, plan: ShardPlan,
                 tp: TensorParallelGroup, index: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = attention
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        sparse = moe.sparse_layers[index] if moe.sparse_layers else True
        self.mlp = SparseMoeBlock(cfg, moe, tp) if sparse else MLP(cfg, plan, tp)

    def forward(self, positions, hidden, residual):
        if residual is None:
            residual = torch.zeros_like(hidden)
        hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class MoeForCausalLM(LlamaForCausalLM):
    """A Llama-layout decoder whose MLPs are sparse blocks. Families say how to read their config
    (``read_moe_config``), and may rename checkpoint tensors (``checkpoint_name``) and change the
    attention (``make_attention``)."""

    def __init__(self, hf_config: dict, max_position: int) -> None:
        self.moe = self.read_moe_config(hf_config)
        super().__init__(hf_config, max_position)

    @classmethod
    def read_moe_config(cls, hf: dict) -> MoEConfig:
        raise NotImplementedError

    def _build_layers(self, cfg: TransformerConfig, hf_config: dict, max_position: int, plan: ShardPlan,
                      tp: TensorParallelGroup) -> nn.ModuleList:
        self.moe.check_tensor_parallel(tp.world_size)
        rotary = RotaryEmbedding(cfg.head_dim, max_position, cfg.rope_theta, cfg.rope_scaling)
        return nn.ModuleList(MoeDecoderLayer(cfg, self.moe, self.make_attention(cfg, hf_config, rotary, plan, tp, i),
                                             plan, tp, i) for i in range(cfg.num_layers))

    def make_attention(self, cfg: TransformerConfig, hf_config: dict, rotary: RotaryEmbedding, plan: ShardPlan,
                       tp: TensorParallelGroup, index: int) -> nn.Module:
        return Attention(cfg, rotary, plan, tp, sliding_window=cfg.window(index))

    def decode_stack_unsupported(self) -> str | None:
        return "the fused op chains dense MLPs; a mixture of experts routes each token to its own"

    def moe_blocks(self) -> list[SparseMoeBlock]:
        return [layer.mlp for layer in self.layers if isinstance(layer.mlp, SparseMoeBlock)]

    # -- weights ----------------------------------------------------------------------------
    def checkpoint_name(self, name: str) -> str:
        """The checkpoint's name for a tensor in this module's (Hugging Face) layout."""
        return name

    def weight_slice(self, name: str, shape: tuple[int, ...]) -> tuple[int, int, int] | None:
        """Experts and the shared expert: gate/up rows and down columns split into equal parts
        (their own intermediate sizes, not the dense MLP's); the rest as Llama's."""
        name = self.checkpoint_name(name)
        if ".mlp.experts." in name or ".mlp.shared_expert." in name:
            n, r = self.tp.world_size, self.tp.rank
            if ".gate_proj." in name or ".up_proj." in name:
                return 0, r * shape[0] // n, shape[0] // n
            if ".down_proj.weight" in name:
                return 1, r * shape[1] // n, shape[1] // n
        return super().weight_slice(name, shape)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | PackedWeight]]) -> None:
        super().load_weights((self.checkpoint_name(name), tensor) for name, tensor in weights)


def num_experts(hf: dict, default: int | None = None) -> int:
    """``num_experts`` or ``num_local_experts`` (transformers maps each family's name onto the other
    and writes either)."""
    value = hf.get("num_experts") or hf.get("num_local_experts") or default
    if not value:
        raise ValueError("config.json gives no num_experts / num_local_experts")
    return int(value)


def sparse_layers(hf: dict, num_layers: int) -> tuple[bool, ...]:
    """Qwen-MoE's choice of sparse layers: every ``decoder_sparse_step``-th, except ``mlp_only_layers``."""
    step = int(hf.get("decoder_sparse_step") or 1)
    dense = set(hf.get("mlp_only_layers") or ())
    return tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers))
