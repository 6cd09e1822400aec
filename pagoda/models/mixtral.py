"""Mixtral (``MixtralForCausalLM``): Mistral's attention with a sparse block of ``num_local_experts``
experts, ``num_experts_per_tok`` of them per token, their probabilities always renormalized.

Its checkpoints name the block ``block_sparse_moe`` and the expert projections ``w1`` (gate),
``w3`` (up) and ``w2`` (down); they load under the Qwen-style names the shared block uses.
"""

from __future__ import annotations

import re

from pagoda.models.moe import MoEConfig, MoeForCausalLM, num_experts

_EXPERT_PROJECTION = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_EXPERT_NAME = re.compile(r"\.block_sparse_moe\.experts\.(\d+)\.(w[123])\.")


class MixtralForCausalLM(MoeForCausalLM):
    @classmethod
    def read_moe_config(cls, hf: dict) -> MoEConfig:
        return MoEConfig(num_experts=num_experts(hf, 8), top_k=hf.get("num_experts_per_tok", 2),
                         intermediate_size=hf["intermediate_size"], renormalize=True)

    def checkpoint_name(self, name: str) -> str:
        name = _EXPERT_NAME.sub(lambda m: f".mlp.experts.{m[1]}.{_EXPERT_PROJECTION[m[2]]}.", name)
        return name.replace(".block_sparse_moe.gate.", ".mlp.gate.")
