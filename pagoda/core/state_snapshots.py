"""Prefix caching for state-space models: the recurrent state after a cached prefix.

A KV block of the prefix tree is enough for an attention layer to start after it; a state-space
layer needs its state *at* that point, which no block holds. So while a request computes its
tokens, the state after every ``interval`` tokens (a multiple of the block size: the boundaries
of the tree's blocks) is copied into a snapshot slot of the layers' state tensors (the slots after
the running requests'), keyed by the prefix it follows (its tokens and the request's prefix key,
as the tree keys its blocks). A later request whose prefix the tree holds starts at the deepest
boundary with a snapshot (``usable_blocks``, which cuts the tree's match there), from a copy of
it in its own slot (``copy_for``): a repeated system prompt longer than ``interval`` is a hit.

The snapshots are an LRU of ``num_slots`` slots, apart from the tree's blocks: a snapshot whose
blocks were evicted is never reached (a hit needs the blocks too) and ages out. A snapshot is
written during the step that computes its boundary (``plan_saves``: the worker splits the chunk
there) and can be found only once that step ran (``commit``), so no request copies it unwritten.
vLLM keeps mamba states per block in its prefix cache for the same reason; SGLang's
MambaRadixCache keeps one with a tree node.
"""

from __future__ import annotations

from collections import OrderedDict

from pagoda.core.scheduler_output import SchedulerOutput
from pagoda.request import Request


class StateSnapshots:
    def __init__(self, first_slot: int, num_slots: int, interval: int, block_size: int) -> None:
        """``first_slot``: the first snapshot slot (those before it are the running requests');
        ``interval``: tokens between snapshots, rounded up to whole blocks."""
        if num_slots < 1:
            raise ValueError(f"state snapshots need at least one slot, got {num_slots}")
        self.block_size = block_size
        self.interval = max(1, -(-interval // block_size)) * block_size
        self._free = list(range(first_slot + num_slots - 1, first_slot - 1, -1))
        self._slots: OrderedDict[tuple, int] = OrderedDict()  # prefix key → slot, least recently used first
        self._pending: dict[tuple, int] = {}  # written by the step that runs now
        self.num_hits = 0

    @staticmethod
    def _key(tokens: list[int], prefix_key: object) -> tuple:
        # the tokens themselves, not a hash of them: a dict compares keys whole, so two prefixes
        # never share a state (a hash collision would hand one request another's state)
        return prefix_key, tuple(tokens)

    def usable_blocks(self, tokens: list[int], prefix_key: object, num_blocks: int) -> int:
        """Of the first ``num_blocks`` cached blocks of ``tokens``, how many a request can start
        after: the most that end on a boundary whose state is kept (0: none)."""
        per = self.interval // self.block_size
        for n in range(num_blocks - num_blocks % per, 0, -per):
            if self._key(tokens[: n * self.block_size], prefix_key) in self._slots:
                return n
        return 0

    def copy_for(self, request: Request) -> tuple[int, int] | None:
        """(snapshot slot, the request's slot) for a request admitted after a cached prefix: its
        state starts as the prefix's. None when it computes from the start."""
        n = request.num_computed_tokens
        if n == 0:
            return None
        key = self._key(request.all_token_ids[:n], request.prefix_key)
        self._slots.move_to_end(key)
        self.num_hits += 1
        return self._slots[key], request.state_slot

    def plan_saves(self, request: Request, num_new: int) -> list[tuple[int, int]]:
        """The snapshots the request's step of ``num_new`` tokens writes: (tokens into its chunk,
        slot) at each boundary it passes whose state is not kept yet."""
        start = request.num_computed_tokens
        saves = []
        for boundary in range(start - start % self.interval + self.interval, start + num_new + 1, self.interval):
            key = self._key(request.all_token_ids[:boundary], request.prefix_key)
            if key in self._slots or key in self._pending:
                continue
            slot = self._take()
            if slot is None:
                break
            self._pending[key] = slot
            saves.append((boundary - start, slot))
        return saves

    def add_to(self, message: SchedulerOutput, scheduled: list[tuple[Request, int]],
               copies: list[tuple[int, int]]) -> None:
        """The step's state orders for the workers: the hits' copies (``copy_for``), then the
        snapshots each scheduled request's tokens write."""
        message.state_copies = copies
        for request, num_new in scheduled:
            if saves := self.plan_saves(request, num_new):
                message.state_saves[request.request_id] = saves

    def commit(self) -> None:
        """The step ran: the states it wrote can be found."""
        self._slots.update(self._pending)
        self._pending.clear()

    def _take(self) -> int | None:
        """A free slot, else the least recently used snapshot's (none while every one is pending)."""
        if self._free:
            return self._free.pop()
        if not self._slots:
            return None
        return self._slots.popitem(last=False)[1]

    def reset(self) -> None:
        """Forget every snapshot (the prefix cache was reset)."""
        self._free.extend(self._slots.values())
        self._slots.clear()
