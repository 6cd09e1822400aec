"""A step's batch in the order the model sees it, and the tensors built from it.

Decode-like rows come first (single tokens, and short chunks over a cached prefix, which the
paged decode kernel reads in place), then prefill chunks; the batch is flat, never padded. The
target model runner and the draft model (spec_decode/draft_model.py) lay out their batches the
same way from the same ``InputBatch``.
"""

from __future__ import annotations

import numpy as np
import torch

from pagoda.forward_context import AttentionMetadata, StateMetadata
from pagoda.worker.input_batch import InputBatch


class BatchLayout:
    """This step's requests in batch order (decode-like first) and where their tokens sit."""

    def __init__(self, req_ids: list[str], rows: np.ndarray, counts: np.ndarray, starts: np.ndarray,
                 decode_like: np.ndarray) -> None:
        self.num_decode_like = int(decode_like.sum())
        if self.num_decode_like == len(req_ids) and int(counts.sum()) == len(req_ids):
            # a decode step: one token a request, in the order given
            self.req_ids, self.rows, self.counts, self.starts = req_ids, rows, counts, starts
            self.offsets = np.arange(len(req_ids))
            self.token_rows, self.positions = rows, starts.copy()
            return
        order = np.argsort(~decode_like, kind="stable")
        self.req_ids = [req_ids[i] for i in order]
        self.rows, self.counts, self.starts = rows[order], counts[order], starts[order]
        self.offsets = np.cumsum(self.counts) - self.counts  # first flat row of each request
        self.token_rows = np.repeat(self.rows, self.counts)  # batch row of each flat token
        self.positions = np.repeat(self.starts - self.offsets, self.counts) + np.arange(int(self.counts.sum()))


def prepare_inputs(b: InputBatch, lay: BatchLayout, backend, block_size: int,
                   device: torch.device) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """The step's token ids and positions, and the attention metadata for ``backend``: where
    each token's K/V goes (slots through the block table), the decode rows' block tables and
    lengths, and each prefill chunk's offset, length, cached prefix and blocks. With several KV
    cache groups, the metadata returned is group 0's and ``meta.groups`` holds every group's."""
    input_ids = b.token_ids[lay.token_rows, lay.positions]
    metas = [_group_metadata(b, lay, group, backend, block_size, device) for group in range(b.num_kv_groups)]
    meta = metas[0]
    meta.groups = metas
    return torch.from_numpy(input_ids), torch.from_numpy(lay.positions.copy()), meta


def _group_metadata(b: InputBatch, lay: BatchLayout, group: int, backend, block_size: int,
                    device: torch.device) -> AttentionMetadata:
    """The attention metadata of the layers of one KV cache group, through its block tables."""
    bs, tables = block_size, b.block_tables[group]
    slots = tables[lay.token_rows, lay.positions // bs] * bs + lay.positions % bs
    num_decodes = int(lay.counts[: lay.num_decode_like].sum())
    prefills = [(int(lay.offsets[i]), int(lay.counts[i]), int(lay.starts[i]), b.block_ids(int(lay.rows[i]), group))
                for i in range(lay.num_decode_like, len(lay.req_ids))]
    decode_tables = decode_seq_lens = None
    if num_decodes:
        # One row per decode-like token: its request's block table, and how many positions it sees.
        width = int(b.num_blocks[lay.rows[: lay.num_decode_like]].max())
        decode_tables = tables[lay.token_rows[:num_decodes], :width]
        decode_seq_lens = lay.positions[:num_decodes] + 1
    return backend.attention_metadata(slots, decode_tables, decode_seq_lens, prefills, bs, device)


def state_metadata(b: InputBatch, lay: BatchLayout, device: torch.device,
                   saves: dict[str, list[tuple[int, int]]]) -> StateMetadata:
    """Each request's recurrent-state slot and flat rows: the one-token requests together, the
    longer chunks one by one; a request with nothing computed before this step starts fresh.
    ``saves``: the snapshots each request's chunk writes (SchedulerOutput.state_saves)."""
    slots = b.state_slots[lay.rows]
    single = lay.counts == 1
    chunks = [(int(lay.offsets[i]), int(lay.counts[i]), int(slots[i]), bool(lay.starts[i] == 0),
               saves.get(lay.req_ids[i], [])) for i in np.flatnonzero(~single)]
    decode_saves = [(int(slots[i]), snapshot) for i in np.flatnonzero(single)
                    for _, snapshot in saves.get(lay.req_ids[i], ())]
    return StateMetadata(torch.from_numpy(lay.offsets[single]).to(device), torch.from_numpy(slots[single]).to(device),
                         torch.from_numpy(lay.starts[single] == 0).to(device), chunks, decode_saves)


def decode_like_rows(counts: np.ndarray, starts: np.ndarray, short_chunk: int, fresh: bool = False) -> np.ndarray:
    """Which requests' tokens run as decode rows: single tokens, short chunks over a cached
    prefix, and with ``fresh`` short chunks with nothing before them too (see
    ModelRunner._decode_like)."""
    short = counts <= short_chunk
    return (counts == 1) | (short if fresh else (starts > 0) & short)
