"""LoRA deltas added to a projection's output, batched across requests (S-LoRA / punica style).

A projection ``y = x W^T`` under an adapter becomes ``y + scale * (x A^T) B^T``. The base GEMM runs
once for the whole batch, unchanged; then, for each adapter present in the step, its rows are
taken (a slice: the model runner places them side by side), multiplied through the adapter's
low-rank pair and added back. Requests on the base model cost nothing here, and a batch of many
requests over a few adapters costs one pair of thin matmuls per adapter and projection.

pagoda merges q/k/v (and gate/up) into one projection, while PEFT trains one pair per checkpoint
projection. A ``ProjectionDelta`` therefore holds the As of every part stacked (one matmul
``x A_cat^T``) and one B per part, each written to its own run of output columns.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class DeltaPart:
    """One checkpoint projection inside a merged one: its output columns and its B."""

    out_start: int
    out_size: int
    rank_start: int  # its rows of the stacked A
    rank_end: int
    bt: torch.Tensor  # B transposed, [rank, out_size], the scale already multiplied in


@dataclass(frozen=True)
class ProjectionDelta:
    """An adapter's pair(s) for one of the model's projection modules."""

    a: torch.Tensor  # [sum of the parts' ranks, in_features]
    parts: tuple[DeltaPart, ...]

    def add_to(self, y: torch.Tensor, x: torch.Tensor, rows: slice) -> None:
        """``y[rows] += delta(x[rows])``, in place, in torch."""
        low = x[rows].to(self.a.dtype) @ self.a.t()  # a bf16 or quantized base: the adapter keeps its dtype
        for p in self.parts:
            y[rows, p.out_start:p.out_start + p.out_size] += (low[:, p.rank_start:p.rank_end] @ p.bt).to(y.dtype)

    def nbytes(self) -> int:
        return self.a.numel() * self.a.element_size() + sum(p.bt.numel() * p.bt.element_size() for p in self.parts)


# an adapter as the model runs it: projection module path (e.g. "layers.3.self_attn.qkv_proj") → its delta
AdapterDeltas = dict[str, ProjectionDelta]


# the adapter weights the C++ op (torch.ops.pagoda.lora_add) reads: one of these, the same for every run
KERNEL_DTYPES = frozenset({torch.float32, torch.bfloat16})


def kernel_takes(dtypes: set[torch.dtype] | frozenset[torch.dtype]) -> bool:
    """Whether the C++ op can add deltas whose adapter weights have ``dtypes``."""
    return len(dtypes) == 1 and dtypes <= KERNEL_DTYPES


def kernel_args(runs: list[tuple[ProjectionDelta, slice]]) -> tuple:
    """``runs`` (each adapter's delta and rows) as the C++ op takes them (``torch.ops.pagoda.lora_add``:
    the As, every run's parts in order, where each run's parts begin, their offsets, the rows)."""
    parts = [p for delta, _ in runs for p in delta.parts]
    begin = [0]
    for delta, _ in runs:
        begin.append(begin[-1] + len(delta.parts))
    return ([delta.a for delta, _ in runs], [p.bt for p in parts], begin, [p.out_start for p in parts],
            [p.rank_start for p in parts], [rows.start for _, rows in runs], [rows.stop for _, rows in runs])


class LoRABatch:
    """The adapters of one forward pass and the flat token rows each one covers."""

    def __init__(self, adapters: dict[int, AdapterDeltas], token_adapters: np.ndarray) -> None:
        """``adapters``: id → deltas of (at least) those in the step; ``token_adapters``: each flat
        row's id (0: base)."""
        self.adapters, self.token_adapters = adapters, token_adapters
        self.groups = tuple((adapters[int(i)], run) for i in np.unique(token_adapters) if i
                            for run in runs_of(token_adapters, int(i)))

    def apply(self, key: str, x: torch.Tensor, y: torch.Tensor, backend) -> torch.Tensor:
        """``y`` with every adapter's delta for projection ``key`` added to its rows, through
        ``backend.lora_add`` (one C++ call for them all on the CPU backend, torch's matmuls otherwise)."""
        runs = [(deltas[key], rows) for deltas, rows in self.groups if key in deltas]
        if runs:
            backend.lora_add(y, x, runs)
        return y

    def for_rows(self, rows: np.ndarray) -> LoRABatch | None:
        """The batch of a block that runs a subset of the rows, in ``rows``' order (a mixture's
        expert runs the tokens routed to it); None when none of them is under an adapter."""
        picked = self.token_adapters[rows]
        return LoRABatch(self.adapters, picked) if picked.any() else None


@dataclass(frozen=True)
class StackRuns:
    """Every run of a decoder stack's projections under a sequence of adapters (a step's groups),
    flattened as the one-call stack takes them (csrc/decode_layers.cpp): projection slot s owns runs
    ``[slots[s], slots[s + 1])``, run j the parts ``[part_begin[j], part_begin[j + 1])``, and
    ``run_group[j]`` is the group whose rows run j covers. It depends on the adapters only, so a
    stack keeps it while the step's adapters stay the same."""

    adapters: tuple[AdapterDeltas, ...]  # held, so that they are the ones compared by identity
    a_list: list[torch.Tensor]
    bts: list[torch.Tensor]
    slots: list[int]
    part_begin: list[int]
    out_starts: list[int]
    rank_starts: list[int]
    run_group: np.ndarray
    dtypes: frozenset[torch.dtype]  # of the adapters' weights

    @classmethod
    def build(cls, adapters: Sequence[AdapterDeltas], keys: Sequence[str]) -> StackRuns:
        """The runs of projections ``keys`` (the stack's order), each group's in the groups' order
        (that of ``LoRABatch.apply``, so the sums are added in the same order)."""
        a_list, bts, slots, part_begin, out_starts, rank_starts, run_group = [], [], [0], [0], [], [], []
        for key in keys:
            for g, deltas in enumerate(adapters):
                delta = deltas.get(key)
                if delta is None:
                    continue
                a_list.append(delta.a)
                run_group.append(g)
                for p in delta.parts:
                    bts.append(p.bt)
                    out_starts.append(p.out_start)
                    rank_starts.append(p.rank_start)
                part_begin.append(len(bts))
            slots.append(len(a_list))
        return cls(tuple(adapters), a_list, bts, slots, part_begin, out_starts, rank_starts,
                   np.asarray(run_group, dtype=np.int64), frozenset(a.dtype for a in a_list))

    def same_adapters(self, adapters: Sequence[AdapterDeltas]) -> bool:
        return len(adapters) == len(self.adapters) and all(a is b for a, b in zip(adapters, self.adapters))

    def kernel_args(self, rows: Sequence[slice]) -> tuple:
        """decode_layers' LoRA arguments for the groups' ``rows`` this step."""
        starts = np.asarray([r.start for r in rows], dtype=np.int64)[self.run_group]
        ends = np.asarray([r.stop for r in rows], dtype=np.int64)[self.run_group]
        return (self.a_list, self.bts, self.slots, self.part_begin, self.out_starts, self.rank_starts,
                starts.tolist(), ends.tolist())


def runs_of(token_adapters: np.ndarray, adapter_id: int) -> list[slice]:
    """The runs of consecutive flat rows under ``adapter_id`` (ids per token). The model runner
    places each adapter's requests side by side, so a step has one run an adapter (two when it
    also has a prefill chunk)."""
    hits = np.flatnonzero(token_adapters == adapter_id)
    breaks = np.flatnonzero(np.diff(hits) != 1) + 1
    return [slice(int(run[0]), int(run[-1]) + 1) for run in np.split(hits, breaks)]
