"""OLMoE (``OlmoeForCausalLM``): ``num_experts`` experts of ``intermediate_size``, the chosen
probabilities renormalized only with ``norm_topk_prob`` (off in OLMoE-1B-7B), and an attention
whose q and k norms are RMSNorms over the whole projection (all heads together, not per head),
after which q, k and v are clamped to ``[-clip_qkv, clip_qkv]`` when the config sets it.

Under tensor parallelism each rank holds its heads' part of the norm weights and the mean square
is summed over ranks (one small all-reduce each for q and k); replicated KV heads (fewer KV heads
than ranks) would be counted twice, so those shapes are refused.
"""

from __future__ import annotations

import torch

from pagoda.distributed.parallel_state import TensorParallelGroup
from pagoda.distributed.shard_plan import ShardPlan
from pagoda.layers.backend import rms_norm
from pagoda.layers.linear import project
from pagoda.layers.norm import RMSNorm
from pagoda.layers.rotary import RotaryEmbedding
from pagoda.models.config import TransformerConfig
from pagoda.models.llama import Attention
from pagoda.models.moe import MoEConfig, MoeForCausalLM, num_experts


class OlmoeAttention(Attention):
    def __init__(self, cfg: TransformerConfig, rotary: RotaryEmbedding, plan: ShardPlan, tp: TensorParallelGroup,
                 clip_qkv: float | None) -> None:
        super().__init__(cfg, rotary, plan, tp)
        if tp.is_parallel and plan.num_kv_heads * tp.world_size != cfg.num_kv_heads:
            raise ValueError(f"OLMoE's k norm spans all {cfg.num_kv_heads} KV heads: tensor_parallel_size="
                             f"{tp.world_size} must divide them")
        self.q_norm = RMSNorm(self.q_size, cfg.rms_norm_eps)  # this rank's part of the whole projection's norm
        self.k_norm = RMSNorm(self.kv_size, cfg.rms_norm_eps)
        self.eps, self.clip_qkv = cfg.rms_norm_eps, clip_qkv
        self.q_full, self.kv_full = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        qkv = project(self.qkv_proj, x, self.backend)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self._norm(q, self.q_norm.weight, self.q_full), self._norm(k, self.k_norm.weight, self.kv_full)
        if self.clip_qkv is not None:
            q, k, v = (t.clamp(-self.clip_qkv, self.clip_qkv) for t in (q, k, v))
        q = q.reshape(-1, self.num_heads, self.head_dim)
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        q, k = self.rotary(positions, q, k)
        return self.tp.all_reduce(project(self.o_proj, self.attn(q, k, v), self.backend))

    def _norm(self, x: torch.Tensor, weight: torch.Tensor, full: int) -> torch.Tensor:
        """RMSNorm over the whole projection, of which this rank holds ``x`` (its heads)."""
        if not self.tp.is_parallel:
            return rms_norm(x, weight, self.eps)
        x32 = x.float()
        mean_square = self.tp.all_reduce(x32.pow(2).sum(-1, keepdim=True)) / full
        return weight * (x32 * torch.rsqrt(mean_square + self.eps)).to(x.dtype)


class OlmoeForCausalLM(MoeForCausalLM):
    @classmethod
    def read_moe_config(cls, hf: dict) -> MoEConfig:
        return MoEConfig(num_experts=num_experts(hf, 64), top_k=hf.get("num_experts_per_tok", 8),
                         intermediate_size=hf["intermediate_size"], renormalize=bool(hf.get("norm_topk_prob", False)))

    def make_attention(self, cfg, hf_config, rotary, plan, tp, index):
        return OlmoeAttention(cfg, rotary, plan, tp, hf_config.get("clip_qkv"))

    def weight_slice(self, name: str, shape: tuple[int, ...]) -> tuple[int, int, int] | None:
        """The norm weights follow their projection's rows (this rank's heads)."""
        plan, d = self.shards, self.config.head_dim
        if name.endswith(".self_attn.q_norm.weight"):
            return 0, plan.rank * plan.num_heads * d, plan.num_heads * d
        if name.endswith(".self_attn.k_norm.weight"):
            return 0, plan.kv_head_start * d, plan.num_kv_heads * d
        return super().weight_slice(name, shape)
