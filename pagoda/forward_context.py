"""Batch metadata for one forward pass, reachable from any layer without threading it through
every `forward` signature (the model sees `forward(input_ids, positions)` only)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from pagoda.scoped import Scoped

@dataclass
class PrefillSeq:
    """One sequence computing `query_len` tokens starting at absolute position `start`."""

    token_start: int  # offset of its first token in the flat batch
    query_len: int
    start: int  # tokens already in the KV cache before this step (prefix / earlier chunks)
    block_table: torch.Tensor  # int64 [num_blocks_of_seq]
    # [start, end) positions of the images whose tokens attend to each other both ways (Gemma 3;
    # layers/image_attention.py); empty: causal
    image_spans: tuple[tuple[int, int], ...] = ()


@dataclass
class StateMetadata:
    """Where the step's sequences keep their recurrent state (state-space layers, e.g. Mamba-2's
    mixer): a slot of every such layer's state tensors per running request (core/state_slots.py).

    Sequences computing one token (decodes) are updated together; each longer chunk on its own.
    A sequence with nothing computed before this step (``fresh``) starts from a zero state,
    whatever its slot held before. With prefix caching, a chunk also copies its state after some
    of its tokens into snapshot slots (core/state_snapshots.py): ``saves``."""

    decode_tokens: torch.Tensor  # int64 [n]: the flat rows of the one-token sequences
    decode_slots: torch.Tensor  # int64 [n]: their state slots
    decode_fresh: torch.Tensor  # bool [n]: a one-token prompt starts from zeros
    # the others: (first flat row, tokens, slot, fresh, saves: [(after this many tokens, snapshot slot)])
    chunks: list[tuple[int, int, int, bool, list[tuple[int, int]]]]
    decode_saves: list[tuple[int, int]] = field(default_factory=list)  # (slot, snapshot slot) after the step


@dataclass
class AttentionMetadata:
    """The batch is laid out as [decode tokens ... | prefill chunks ...].

    Decodes (one query token each) are attended together in one batched call over their block
    tables; each prefill chunk is attended on its own, causally, over its cached prefix.
    """

    slot_mapping: torch.Tensor  # int64 [num_tokens]: where each token's K/V is written
    num_decodes: int = 0
    decode_block_tables: torch.Tensor | None = None  # int64 [num_decodes, max_blocks]
    decode_seq_lens: torch.Tensor | None = None  # int64 [num_decodes]: tokens each decode attends to
    prefills: list[PrefillSeq] = field(default_factory=list)
    block_size: int = 16
    # Every KV cache group's metadata (core/kv_cache_groups.py), this one first; empty: one group.
    groups: list[AttentionMetadata] = field(default_factory=list)
    # the step's LoRA adapters and their rows (layers/lora_delta.LoRABatch; not imported here, which
    # would close a cycle with the layers); None: every row runs on the base model
    lora: object | None = None
    states: StateMetadata | None = None  # None: the model keeps no recurrent state
    _decode_masks: dict[int | None, torch.Tensor] = field(default_factory=dict)
    _slot_parts: tuple[torch.Tensor, torch.Tensor] | None = None

    def for_group(self, group: int) -> AttentionMetadata:
        """The metadata of the layers of KV cache group ``group`` (their own block tables)."""
        return self.groups[group] if group else self

    def slot_blocks_and_offsets(self) -> tuple[torch.Tensor, torch.Tensor]:
        """slot_mapping split into (block id, offset in block); computed once per step."""
        if self._slot_parts is None:
            self._slot_parts = (self.slot_mapping // self.block_size, self.slot_mapping % self.block_size)
        return self._slot_parts

    def decode_mask(self, window: int | None = None) -> torch.Tensor:
        """bool [num_decodes, 1, 1, max_blocks * block_size]: the positions each decode row sees
        (its length; with a sliding ``window``, only its last ``window`` of them). Built once per
        step and window, on demand."""
        mask = self._decode_masks.get(window)
        if mask is None:
            width = self.decode_block_tables.shape[1] * self.block_size
            key_pos = torch.arange(width, device=self.decode_seq_lens.device).unsqueeze(0)
            lens = self.decode_seq_lens.unsqueeze(1)
            mask = key_pos < lens
            if window is not None:
                mask &= key_pos >= lens - window
            mask = self._decode_masks[window] = mask.view(-1, 1, 1, width)
        return mask


_current: Scoped[AttentionMetadata | None] = Scoped("pagoda_attention_metadata", None)


def get_attention_metadata() -> AttentionMetadata:
    metadata = _current.get()
    if metadata is None:
        raise RuntimeError("no forward context: the model must run inside set_attention_metadata()")
    return metadata


def set_attention_metadata(metadata: AttentionMetadata) -> contextlib.AbstractContextManager:
    """The metadata every attention layer of a forward pass reads, for the block's extent."""
    return _current.using(metadata)
