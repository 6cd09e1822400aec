"""Qwen2-MoE (``Qwen2MoeForCausalLM``, Qwen1.5-MoE) and Qwen3-MoE (``Qwen3MoeForCausalLM``).

Both: ``num_experts`` experts of ``moe_intermediate_size``, ``num_experts_per_tok`` per token, the
chosen probabilities renormalized only with ``norm_topk_prob``; sparse blocks on every
``decoder_sparse_step``-th layer except ``mlp_only_layers`` (those keep a dense MLP of
``intermediate_size``). Qwen2-MoE: q/k/v biases (``qkv_bias``) and a shared expert of
``shared_expert_intermediate_size`` behind a sigmoid gate. Qwen3-MoE: no biases, q/k norms per head.
"""

from __future__ import annotations

from pagoda.models.moe import MoEConfig, MoeForCausalLM, num_experts, sparse_layers


def _moe_config(hf: dict, shared: int = 0) -> MoEConfig:
    return MoEConfig(num_experts=num_experts(hf), top_k=hf["num_experts_per_tok"],
                     intermediate_size=hf["moe_intermediate_size"], renormalize=bool(hf.get("norm_topk_prob", False)),
                     shared_intermediate_size=shared, sparse_layers=sparse_layers(hf, hf["num_hidden_layers"]))


class Qwen2MoeForCausalLM(MoeForCausalLM):
    @classmethod
    def read_config(cls, hf_config: dict):
        return super().read_config({**hf_config, "attention_bias": hf_config.get("qkv_bias", True)})

    @classmethod
    def read_moe_config(cls, hf: dict) -> MoEConfig:
        return _moe_config(hf, shared=int(hf.get("shared_expert_intermediate_size") or 0))


class Qwen3MoeForCausalLM(MoeForCausalLM):
    qk_norm = True

    @classmethod
    def read_moe_config(cls, hf: dict) -> MoEConfig:
        return _moe_config(hf)
