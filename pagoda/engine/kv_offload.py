"""Opening the KV tiers (core/kv_tiers) for an engine: checks that the engine can use them, the
model's identity for block keys, an encrypted model's KV key, then the store the driver worker
copies through and the link the KV cache manager drives."""

from __future__ import annotations

import logging
from typing import Any

from pagoda.config import EngineConfig
from pagoda.core.kv_cache_manager import KVCacheManager
from pagoda.core.kv_tiers.block_hash import model_identity
from pagoda.core.kv_tiers.disk_tier import DiskTier, KVCipher, kv_key_from_model_key
from pagoda.core.kv_tiers.link import KVTierLink
from pagoda.core.kv_tiers.store import KVTierStore
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
    disk = None
    if oc.disk_dir is not None:
        disk = DiskTier(oc.disk_dir, int(oc.disk_gib * GiB), _cipher(config))
    store = KVTierStore(int(oc.memory_gib * GiB), disk)
    worker.attach_kv_tiers(store)
    kv_manager.attach_tiers(KVTierLink(store, identity, config.cache.block_size))
    logger.info("KV tiers: %.2f GiB of host memory%s; blocks of %.2f MiB", oc.memory_gib,
                f", {oc.disk_gib:g} GiB in {oc.disk_dir} ({disk.used_bytes / GiB:.2f} GiB there already"
                f"{', encrypted' if disk.cipher else ''})" if disk else "", store.block_nbytes / 2**20)
    return store


def _cipher(config: EngineConfig) -> KVCipher | None:
    """An encrypted model's KV is encrypted on disk under a key derived from the model's."""
    enc = config.model.files.encryption
    if enc is None:
        return None
    return KVCipher(kv_key_from_model_key(enc.key().secret, enc.header_sha256))
