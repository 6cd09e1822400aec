"""The recurrent state of a state-space model's layers: one slot per running request in every
layer, beside the paged KV cache (core/state_slots.py hands the slots out).

A slot holds a Mamba-2 mixer's convolution window and its scan state, in fp32 whatever the model's
dtype: the scan accumulates into it at every token, for the whole context, and a half-precision
state would drift (transformers' chunked scan keeps it in fp32 too). Its size does not depend on
the context; the slots are taken out of the KV cache's budget before the blocks are counted.
"""

from __future__ import annotations

import math

import torch

STATE_DTYPE = torch.float32
STATE_BUDGET_SHARE = 0.5  # a hybrid's states take at most this share of the cache budget; the blocks the rest


def bytes_per_slot(layers: list) -> int:
    """One request's state in every state-space layer."""
    element = torch.empty((), dtype=STATE_DTYPE).element_size()
    return sum(math.prod(shape) * element for layer in layers for shape in layer.state_shapes())


def num_slots_for_budget(budget_bytes: int, per_slot: int, max_num_seqs: int, with_kv_cache: bool) -> int:
    """As many slots as requests may run (``max_num_seqs``), within the budget (a share of it for
    a hybrid, whose attention layers need blocks too); at least one."""
    share = budget_bytes * (STATE_BUDGET_SHARE if with_kv_cache else 1.0)
    return max(1, min(max_num_seqs, int(share // per_slot)))


def copy_states(layers: list, copies: list[tuple[int, int]]) -> None:
    """Copy slot ``src`` into slot ``dst`` in every layer, for each (src, dst)."""
    for src, dst in copies:
        for layer in layers:
            layer.conv_state[dst] = layer.conv_state[src]
            layer.ssm_state[dst] = layer.ssm_state[src]


def allocate_states(layers: list, num_slots: int, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Zeroed state tensors for every layer, bound to it (``layer.bind_state``)."""
    states = []
    for layer in layers:
        conv, ssm = (torch.zeros((num_slots, *shape), dtype=STATE_DTYPE, device=device)
                     for shape in layer.state_shapes())
        layer.bind_state(conv, ssm)
        states.append((conv, ssm))
    return states
