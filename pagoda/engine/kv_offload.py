"""Opening the KV tiers (core/kv_tiers) for an engine: checks that the engine can use them, the
model's identity for block keys, an encrypted model's KV key, then the store the driver worker
copies through and the link the KV cache manager drives; and a prefill replica's hand-off of its
finished prompts' blocks to the shared tier (``--kv-role prefill``)."""

from __future__ import annotations

import logging
from typing import Any

from pagoda.config import EngineConfig
from pagoda.core.kv_cache_manager import KVCacheManager
from pagoda.core.kv_tiers.block_hash import model_identity
from pagoda.core.kv_tiers.block_format import KVCipher, kv_key_from_model_key
from pagoda.core.kv_tiers.disk_tier import DiskTier
from pagoda.core.kv_tiers.link import KVTierLink
from pagoda.core.kv_tiers.remote_tier import RemoteTier, connect
from pagoda.core.kv_tiers.store import KVTierStore
from pagoda.core.kv_tiers.tier_stack import BlockTier, TierStack
from pagoda.worker.kv_cache import GiB

logger = logging.getLogger(__name__)


def _refusal(config: EngineConfig, worker: Any) -> str | None:
    """Why this engine cannot use KV tiers (None: it can)."""
    if not config.cache.enable_prefix_caching:
        return "they sit under the prefix cache: drop --no-enable-prefix-caching (and --runner pooling)"
    if config.parallel.tensor_parallel_size > 1:
        return "each rank would need tiers of its own: use --tensor-parallel-size 1"
    if worker.kv_groups.is_hybrid:
        return "a model with sliding-window groups (Gemma 3) is not supported: --disable-hybrid-kv-cache-manager"
    if worker.draft_model is not None:
        return "a draft model's KV cache is not offloaded: use n-gram speculation or none"
    return None


def open_kv_tiers(config: EngineConfig, worker: Any, kv_manager: KVCacheManager) -> KVTierStore | None:
    """Build the tiers of ``config.kv_offload`` under ``kv_manager`` and give the driver ``worker``
    the store; None when the tiers are off. A ValueError names what is wrong."""
    oc = config.kv_offload
    if not oc.enabled:
        return None
    why = _refusal(config, worker)
    if why is not None:
        raise ValueError(f"kv_offload: {why}")
    kv = worker.kv_cache
    identity = model_identity(config, kv.shape[3], kv.shape[5], kv.shape[1])
    cipher = _cipher(config)
    disk = DiskTier(oc.disk_dir, int(oc.disk_gib * GiB), cipher) if oc.disk_dir is not None else None
    remote = RemoteTier(connect(oc.url), cipher) if oc.url is not None else None
    lower: BlockTier | None = TierStack([disk, remote]) if disk and remote else disk or remote
    store = KVTierStore(int(oc.memory_gib * GiB), lower)
    worker.attach_kv_tiers(store)
    # a prefill replica hands every computed block over (hand_off): it writes them all through
    link = KVTierLink(store, identity, config.cache.block_size,
                      "write_through" if oc.role == "prefill" else oc.write_policy)
    # a decode replica's blocks are its own answers, which no other replica asks for: only what
    # its prefix cache lets go goes down
    link.write_through = link.write_through and oc.role != "decode"
    kv_manager.attach_tiers(link)
    logger.info("KV tiers: %.2f GiB of host memory%s%s; blocks of %.2f MiB; role %s", oc.memory_gib,
                f", {oc.disk_gib:g} GiB in {oc.disk_dir} ({disk.used_bytes / GiB:.2f} GiB there already"
                f"{', encrypted' if disk.cipher else ''})" if disk else "",
                f", the shared store {oc.url}" if remote else "", store.block_nbytes / 2**20, oc.role)
    return store


def hand_off(store: KVTierStore, link: KVTierLink) -> None:
    """A prefill replica, as requests finish: copy out the blocks they computed (the saves the next
    step would make) and wait until they are written to the shared tier, so that when the answer
    leaves, a decode replica finds every block of the prompt. It runs between steps, on the
    engine's thread, where nothing writes the KV cache; a prefill replica has no streams whose
    tokens would wait on it."""
    saves = link.take_saves()
    if saves:
        store.apply(saves, [])
    store.flush()


def _cipher(config: EngineConfig) -> KVCipher | None:
    """An encrypted model's KV is encrypted on disk under a key derived from the model's."""
    enc = config.model.files.encryption
    if enc is None:
        return None
    return KVCipher(kv_key_from_model_key(enc.key().secret, enc.header_sha256))
