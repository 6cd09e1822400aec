"""The recurrent-state slots of a state-space model (Mamba-2 mixers), handed to running requests.

A state-space layer keeps, for each request, a fixed-size state (a convolution window and the
scan's matrix) instead of a KV entry per token. The workers allocate every such layer's state
tensors with ``num_slots`` slots (worker/state_cache.py); the scheduler gives each request a slot
when it starts running and takes it back when the request is preempted (it is recomputed from
its tokens later, into whatever slot it gets then), finishes or is aborted. A slot's old contents
are never read by its next owner: a request's first step starts from a zero state
(forward_context.StateMetadata.fresh). vLLM v1 and SGLang keep such a pool beside the paged KV
cache the same way (vLLM's ``MambaSpec``, SGLang's ``MambaPool``).
"""

from __future__ import annotations


class StateSlots:
    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"a state-space model needs at least one state slot, got {num_slots}")
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # popped from the end: slot 0 first
        self._owner: dict[int, str] = {}  # slot → the request holding it

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, request_id: str) -> int | None:
        """A free slot for the request, or None when every slot is held."""
        if not self._free:
            return None
        slot = self._free.pop()
        self._owner[slot] = request_id
        return slot

    def free(self, slot: int | None) -> None:
        """Give a slot back (None: the request held none)."""
        if slot is None:
            return
        if slot not in self._owner:
            raise ValueError(f"state slot {slot} is not held")
        del self._owner[slot]
        self._free.append(slot)

    def holder(self, slot: int) -> str | None:
        return self._owner.get(slot)
