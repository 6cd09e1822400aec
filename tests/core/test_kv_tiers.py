"""The KV tiers' parts on their own: block keys, the disk tier's files, the store's memory tier."""

from __future__ import annotations

import logging
import os
import stat

import pytest
import torch

from pagoda.core.kv_tiers.block_hash import chain_root, extend_chain
from pagoda.core.kv_tiers.block_format import KVCipher
from pagoda.core.kv_tiers.disk_tier import DiskTier
from pagoda.core.kv_tiers.store import KVTierStore


def _keys(identity: bytes, salt, tokens: list[int], n: int) -> list[bytes]:
    keys: list[bytes] = []
    extend_chain(keys, chain_root(identity, salt), tokens, 4, n)
    return keys


def test_keys_depend_on_model_salt_and_every_token_before():
    tokens = list(range(16))
    base = _keys(b"model-a", None, tokens, 4)
    assert len(set(base)) == 4
    assert _keys(b"model-a", None, tokens, 4) == base  # stable across calls (and processes: no hash seed)
    assert not set(_keys(b"model-b", None, tokens, 4)) & set(base)  # another model never hits
    assert not set(_keys(b"model-a", "tenant-b", tokens, 4)) & set(base)  # another tenant never hits
    changed = _keys(b"model-a", None, [99] + tokens[1:], 4)
    assert not set(changed) & set(base)  # block 0 differs: every later block's key differs too
    half = _keys(b"model-a", None, tokens, 2)
    extend_chain(half, chain_root(b"model-a", None), tokens, 4, 4)  # extended incrementally: the same keys
    assert half == base


def test_disk_files_are_0600_and_read_back(tmp_path):
    disk = DiskTier(tmp_path / "kv", 1 << 20)
    key = bytes(range(16))
    disk.write(key, b"payload" * 10)
    path = disk.path(key)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert disk.read(key) == b"payload" * 10
    assert DiskTier(tmp_path / "kv", 1 << 20).read(key) == b"payload" * 10  # a new process finds it


@pytest.mark.parametrize("damage", ["torn", "flipped", "foreign", "garbage"])
def test_a_damaged_or_foreign_file_is_refused_with_a_log_line(tmp_path, caplog, damage):
    disk = DiskTier(tmp_path / "kv", 1 << 20)
    key, other = bytes(16), bytes([1] * 16)
    disk.write(key, os.urandom(4096))
    disk.write(other, os.urandom(4096))
    path = disk.path(key)
    data = path.read_bytes()
    if damage == "torn":  # what a kill -9 mid-write would leave, were the file written in place
        path.write_bytes(data[: len(data) // 2])
    elif damage == "flipped":
        path.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    elif damage == "foreign":  # another block's file under this name
        path.write_bytes(disk.path(other).read_bytes())
    else:
        path.write_bytes(b"not a block")
    with caplog.at_level(logging.WARNING, logger="pagoda.core.kv_tiers.disk_tier"):
        assert disk.read(key) is None
    assert "refused" in caplog.text and str(path) in caplog.text
    assert not path.exists() and disk.num_refused == 1
    assert disk.read(other) is not None


def test_an_interrupted_write_leaves_only_a_temporary_file_never_read(tmp_path):
    disk = DiskTier(tmp_path / "kv", 1 << 20)
    key = bytes(range(16))
    disk.path(key).parent.mkdir()
    (disk.path(key).parent / f".{disk.path(key).name}.123.4.tmp").write_bytes(b"half")
    assert not disk.has(key) and disk.read(key) is None
    assert DiskTier(tmp_path / "kv", 1 << 20).used_bytes == 0  # a restart does not count it


def test_encrypted_payloads_open_only_with_their_key(tmp_path, caplog):
    cipher = KVCipher(bytes(32))
    disk = DiskTier(tmp_path / "kv", 1 << 20, cipher)
    key = bytes(range(16))
    secret = b"attention keys and values " * 20
    disk.write(key, secret)
    assert secret[:26] not in disk.path(key).read_bytes()
    assert disk.read(key) == secret
    assert DiskTier(tmp_path / "kv", 1 << 20).read(key) is None  # a plain model's tier refuses it
    disk.write(key, secret)
    with caplog.at_level(logging.WARNING):
        assert DiskTier(tmp_path / "kv", 1 << 20, KVCipher(bytes([7] * 32))).read(key) is None
    assert "decrypt" in caplog.text


def test_disk_budget_removes_least_recently_used(tmp_path):
    disk = DiskTier(tmp_path / "kv", 3 * 1200)
    keys = [bytes([i] * 16) for i in range(4)]
    for k in keys[:3]:
        disk.write(k, bytes(1000))
    assert disk.read(keys[0]) is not None  # used: now the most recent
    disk.write(keys[3], bytes(1000))
    assert [disk.has(k) for k in keys] == [True, False, True, True]


def _store_with_cache(memory_bytes: int, disk: DiskTier | None = None, dtype=torch.float32):
    kv = torch.randn(2, 3, 8, 2, 4, 5).to(dtype)  # [2, slots, blocks, heads, block_size, dim]
    scales = torch.rand(2, 3, 8, 2, 4) if dtype == torch.int8 else None
    store = KVTierStore(memory_bytes, disk)
    store.bind(kv, scales)
    return store, kv, scales


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_a_block_saved_and_loaded_is_the_same_bytes(dtype):
    store, kv, scales = _store_with_cache(1 << 20, dtype=dtype)
    before = kv[:, :, 2].clone(), None if scales is None else scales[:, :, 2].clone()
    store.apply([(2, b"k" * 16, True, True)], [])
    kv[:, :, 2] = 0
    if scales is not None:
        scales[:, :, 2] = 0
    assert store.pin_run([b"k" * 16, b"x" * 16]) == 1  # the run stops at the first unknown key
    store.apply([], [(b"k" * 16, 5)])
    assert torch.equal(kv[:, :, 5], before[0])
    if scales is not None:
        assert torch.equal(scales[:, :, 5], before[1])
    assert store.counters.memory_hits == 1 and store.counters.saved == 1


def test_memory_tier_keeps_its_budget_but_never_drops_a_pinned_block():
    store, kv, _ = _store_with_cache(0)
    block = store.block_nbytes
    store.memory_bytes = 2 * block
    for b in range(3):
        store.apply([(b, bytes([b] * 16), True, True)], [])
    assert not store.in_memory(bytes([0] * 16)) and store.in_memory(bytes([2] * 16))
    assert store.pin_run([bytes([1] * 16)]) == 1
    store.memory_bytes = 0
    store._trim()
    assert store.in_memory(bytes([1] * 16)) and not store.in_memory(bytes([2] * 16))


def test_written_through_blocks_reach_disk_and_come_back_after_a_restart(tmp_path):
    store, kv, _ = _store_with_cache(1 << 20, DiskTier(tmp_path / "kv", 1 << 20))
    store.apply([(1, b"a" * 16, False, True), (3, b"b" * 16, True, True)], [])
    store.close()
    assert not store.in_memory(b"a" * 16)  # written through: not kept in memory once written
    again, kv2, _ = _store_with_cache(1 << 20, DiskTier(tmp_path / "kv", 1 << 20))
    again.prefetch([b"a" * 16, b"b" * 16])
    assert again.flush(10)
    assert again.pin_run([b"a" * 16, b"b" * 16]) == 2
    again.apply([], [(b"a" * 16, 0), (b"b" * 16, 7)])
    assert torch.equal(kv2[:, :, 0], kv[:, :, 1]) and torch.equal(kv2[:, :, 7], kv[:, :, 3])
    assert again.counters.disk_hits == 2  # read ahead from disk: counted as the disk tier's hits
    again.close()
