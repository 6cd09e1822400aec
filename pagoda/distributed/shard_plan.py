"""Which part of each weight a tensor-parallel rank holds (Megatron-style, as vLLM and gpt-fast).

- Column-parallel (split the output rows): q/k/v and gate/up projections and their biases.
  Attention heads are divided across ranks; when there are fewer KV heads than ranks, each rank
  holds the one KV head its query heads read (replicated).
- Row-parallel (split the input columns): o_proj and down_proj; their partial outputs are summed
  by one all-reduce after attention and one after the MLP.
- Vocab-parallel: the embedding and the output head split the vocabulary rows into equal parts
  (the last part padded); a lookup is summed over ranks, logits are gathered.
- Everything else (norms) is replicated.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagoda.distributed.parallel_state import TensorParallelGroup
from pagoda.models.config import TransformerConfig


@dataclass(frozen=True)
class ShardPlan:
    rank: int
    world_size: int
    num_heads: int  # this rank's query heads
    num_kv_heads: int  # this rank's KV heads (1 when replicated)
    kv_head_start: int
    intermediate_size: int
    vocab_per_rank: int  # rows of the embedding / head on every rank (the last one padded)
    vocab_start: int
    head_dim: int
    vocab_size: int

    @classmethod
    def for_rank(cls, cfg: TransformerConfig, tp: TensorParallelGroup) -> "ShardPlan":
        n, r = tp.world_size, tp.rank  # the shapes are checked against n in config.py (check_tensor_parallel)
        if cfg.num_kv_heads >= n:
            kv_heads, kv_start = cfg.num_kv_heads // n, r * cfg.num_kv_heads // n
        else:  # fewer KV heads than ranks: rank r's query heads read KV head r * Hkv // n
            kv_heads, kv_start = 1, r * cfg.num_kv_heads // n
        per = -(-cfg.vocab_size // n)
        return cls(r, n, cfg.num_heads // n, kv_heads, kv_start, cfg.intermediate_size // n, per, r * per,
                   cfg.head_dim, cfg.vocab_size)

    @property
    def vocab_rows(self) -> int:
        """Real (unpadded) vocabulary rows on this rank."""
        return max(0, min(self.vocab_per_rank, self.vocab_size - self.vocab_start))

    def weight_slice(self, name: str, shape: tuple[int, ...]) -> tuple[int, int, int] | None:
        """(dim, start, length) of checkpoint tensor ``name`` (HF naming) on this rank; None: all."""
        d = self.head_dim
        if name.endswith(("embed_tokens.weight", "lm_head.weight")):
            return 0, self.vocab_start, self.vocab_rows
        if ".q_proj." in name:
            return 0, self.rank * self.num_heads * d, self.num_heads * d
        if ".k_proj." in name or ".v_proj." in name:
            return 0, self.kv_head_start * d, self.num_kv_heads * d
        if ".gate_proj." in name or ".up_proj." in name:
            return 0, self.rank * self.intermediate_size, self.intermediate_size
        if ".o_proj.weight" in name:
            return 1, self.rank * self.num_heads * d, self.num_heads * d
        if ".down_proj.weight" in name:
            return 1, self.rank * self.intermediate_size, self.intermediate_size
        return None

