"""Phi-3 (``Phi3ForCausalLM``: Phi-3 / Phi-3.5 mini and medium): the Llama decoder, with a checkpoint
that stores q/k/v as one ``qkv_proj`` and gate/up as one ``gate_up_proj`` (gate rows first), a
sliding window on every layer when the config sets ``sliding_window``, and LongRoPE
(``rope_scaling`` "longrope", formerly "su") for the long-context variants (layers/rotary.py).

The fused tensors are split into the q/k/v and gate/up parts the Llama loader stacks, so tensor
parallelism and the GGUF fast path treat them as Llama's: each rank keeps its heads' and its
intermediate rows' part (the whole fused tensor is read, then cut), and a GGUF's stored blocks
are cut along whole rows. ``partial_rotary_factor`` below 1 (Phi-4-mini) is refused.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from pagoda.layers.stored_weights import PackedWeight
from pagoda.models.llama import LlamaForCausalLM

Weight = torch.Tensor | PackedWeight


def _rows(tensor: Weight, start: int, stop: int) -> Weight:
    return tensor.rows(start, stop) if isinstance(tensor, PackedWeight) else tensor[start:stop]


class Phi3ForCausalLM(LlamaForCausalLM):
    def weight_slice(self, name: str, shape: tuple[int, ...]) -> tuple[int, int, int] | None:
        if ".qkv_proj." in name or ".gate_up_proj." in name:
            return None  # read whole, cut after the split (load_weights)
        return super().weight_slice(name, shape)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, Weight]]) -> None:
        super().load_weights(part for name, tensor in weights for part in self._split(name, tensor))

    def _split(self, name: str, tensor: Weight) -> Iterator[tuple[str, Weight]]:
        """A fused tensor → its q/k/v or gate/up parts (this rank's rows of each); others as they are."""
        cfg = self.config
        if ".qkv_proj." in name:
            q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
            parts = {"q_proj": (0, q), "k_proj": (q, q + kv), "v_proj": (q + kv, q + 2 * kv)}
            fused = ".qkv_proj."
        elif ".gate_up_proj." in name:
            inter = cfg.intermediate_size
            parts = {"gate_proj": (0, inter), "up_proj": (inter, 2 * inter)}
            fused = ".gate_up_proj."
        else:
            yield name, tensor
            return
        if tensor.shape[0] != max(stop for _, stop in parts.values()):
            raise ValueError(f"checkpoint tensor {name!r} has {tensor.shape[0]} rows, expected "
                             f"{max(stop for _, stop in parts.values())}")
        for part, (start, stop) in parts.items():
            part_name = name.replace(fused, f".{part}.")
            cut = self.shards.weight_slice(part_name, (stop - start, *tensor.shape[1:])) if self.tp.is_parallel else None
            if cut is not None:  # column-parallel: a run of rows
                start, stop = start + cut[1], start + cut[1] + cut[2]
            yield part_name, _rows(tensor, start, stop)
