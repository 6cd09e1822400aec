"""Which layers share a block table: one KV cache group for most models, several for models that
mix global and sliding-window layers (Gemma 3), so the windowed layers can give back the blocks
their window has passed while the global layers keep every block.

vLLM's hybrid allocator, in its simplest form. The pool's blocks all have the same size: one
block holds ``block_size`` tokens of K and V for ``slots_per_block`` layers (one *slot* per
layer). The global layers form group 0, one slot each; the windowed layers are split into groups
of at most as many layers (so a block holds one layer of each group in each slot). Every group
has its own block table per request, drawn from the one pool, so memory moves freely between
the global layers' growing tables and the windowed layers' short-lived ones. A layer's K/V lives
in its slot of the blocks of its group's table.

Gemma 3 270M (18 layers, 3 global): slots_per_block 3, group 0 the 3 global layers, groups 1..5
the 15 local ones. A request of N tokens holds N / block_size blocks in group 0 and, in each
local group, the blocks of its last window only (plus the one being filled).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVCacheGroups:
    layer_group: tuple[int, ...]  # each layer's group (its block table)
    layer_slot: tuple[int, ...]  # each layer's slot in a block of its group
    slots_per_block: int
    local_window: int | None = None  # the window of groups 1.. (None: one group, nothing released)

    @property
    def num_groups(self) -> int:
        return max(self.layer_group) + 1 if self.layer_group else 1

    @property
    def is_hybrid(self) -> bool:
        return self.num_groups > 1

    @classmethod
    def single(cls, num_layers: int) -> KVCacheGroups:
        """Every layer in one group: block b holds every layer's K/V for its tokens."""
        return cls(tuple([0] * num_layers), tuple(range(num_layers)), max(1, num_layers))


def plan_kv_groups(windows: list[int | None] | tuple[int | None, ...], allow_hybrid: bool = True) -> KVCacheGroups:
    """The groups for a model whose layer i has sliding window ``windows[i]`` (None: global).

    Several groups when the model mixes global layers with windowed layers of one window, and
    splitting pays: the windowed layers fill their groups with at most a quarter of their slots
    left empty (a group with fewer layers than slots wastes the rest of each of its blocks).
    Otherwise (every layer global or every layer windowed, several windows, more global layers
    than windowed ones, or ``allow_hybrid`` False) one group."""
    num_layers = len(windows)
    single = KVCacheGroups.single(num_layers)
    global_layers = [i for i, w in enumerate(windows) if w is None]
    local_layers = [i for i, w in enumerate(windows) if w is not None]
    if not allow_hybrid or not global_layers or not local_layers:
        return single
    if len({windows[i] for i in local_layers}) > 1:
        return single
    slots = len(global_layers)
    num_local_groups = -(-len(local_layers) // slots)
    empty = num_local_groups * slots - len(local_layers)
    if empty * 4 > len(local_layers):
        return single
    group, slot = [0] * num_layers, [0] * num_layers
    for j, layer in enumerate(global_layers):
        group[layer], slot[layer] = 0, j
    for j, layer in enumerate(local_layers):
        group[layer], slot[layer] = 1 + j // slots, j % slots
    return KVCacheGroups(tuple(group), tuple(slot), slots, windows[local_layers[0]])


def kv_groups_for(model_config, speculative=None, hybrid: bool = True) -> KVCacheGroups:
    """The groups of a loaded model (its ``TransformerConfig``). One group when ``hybrid`` is off
    (``--disable-hybrid-kv-cache-manager``) or a draft model runs beside it: the draft's own
    attention reads the target's group-0 block table for every one of its layers."""
    windows = tuple(getattr(model_config, "sliding_windows", ()) or ())
    if not windows:
        return KVCacheGroups.single(model_config.num_layers)
    with_draft = speculative is not None and getattr(speculative, "method", None) == "draft_model"
    return plan_kv_groups(windows, allow_hybrid=hybrid and not with_draft)
