"""The tiers several replicas share: one directory (a budget that is the directory's, blocks another
replica wrote after this one started) and a Valkey / Redis server (the same records, checks and
encryption as on disk), with a real server process."""

from __future__ import annotations

import logging
import os
import time

import pytest

from pagoda.core.kv_tiers.block_format import ENCRYPTED, MAGIC, KVCipher
from pagoda.core.kv_tiers.disk_tier import DiskTier
from pagoda.core.kv_tiers.remote_tier import PREFIX, RemoteTier, connect
from pagoda.core.kv_tiers.tier_stack import TierStack, hits_of
from valkey_process import start_valkey, stop_valkey


@pytest.fixture(scope="module")
def valkey(tmp_path_factory):
    proc, url = start_valkey(tmp_path_factory.mktemp("valkey"))
    yield url
    stop_valkey(proc)


@pytest.fixture
def remote(valkey):
    client = connect(valkey)
    client.flushall()
    return RemoteTier(client)


def test_a_replica_finds_blocks_another_wrote_after_it_started(tmp_path):
    a, b = DiskTier(tmp_path, 1 << 20), DiskTier(tmp_path, 1 << 20)
    key = bytes(range(16))
    assert not b.has(key)
    a.write(key, b"block")
    assert b.has(key) and b.read(key) == b"block"


def test_a_shared_directory_keeps_one_budget_over_every_replica(tmp_path):
    # rescan_seconds=0: each write lists the directory (a replica does every RESCAN_SECONDS)
    a, b = DiskTier(tmp_path, 4 * 1100, rescan_seconds=0), DiskTier(tmp_path, 4 * 1100)
    keys = [bytes([i] * 16) for i in range(6)]
    for i, k in enumerate(keys[:4]):
        (a if i % 2 else b).write(k, bytes(1000))
        past = time.time() - 100 + i  # the order of use, as files' times record it
        os.utime(a.path(k), (past, past))
    a.write(keys[4], bytes(1000))  # over the directory's budget: a removes the oldest, b's file among them
    files = sorted(tmp_path.glob("*/*.kv"))
    assert sum(f.stat().st_size for f in files) <= 4 * 1100
    assert not a.has(keys[0]) and not b.has(keys[0])  # b's oldest file, removed by a
    assert a.has(keys[4])


def test_records_in_the_shared_store_read_back_and_count_hits(remote):
    key = bytes(16)
    assert not remote.has(key) and remote.read(key) is None
    remote.write(key, b"kv bytes")
    assert remote.has(key) and remote.read(key) == b"kv bytes"
    assert hits_of(remote, "remote") == 1 and hits_of(remote, "disk") == 0


@pytest.mark.parametrize("damage", ["flip", "truncate", "foreign"])
def test_a_damaged_or_foreign_value_is_refused_and_deleted(remote, caplog, damage):
    key, other = b"k" * 16, b"o" * 16
    remote.write(key, b"x" * 100)
    name = PREFIX + key.hex().encode()
    raw = remote._client.get(name)
    if damage == "flip":
        raw = raw[:-1] + bytes([raw[-1] ^ 1])
    elif damage == "truncate":
        raw = raw[:-10]
    else:
        remote.write(other, b"x" * 100)
        raw = remote._client.get(PREFIX + other.hex().encode())
    remote._client.set(name, raw)
    with caplog.at_level(logging.WARNING):
        assert remote.read(key) is None
    assert "refused" in caplog.text and remote.num_refused == 1
    assert not remote.has(key)


def test_an_encrypted_models_blocks_are_sealed_in_the_shared_store(valkey):
    client = connect(valkey)
    sealed, plain = RemoteTier(client, KVCipher(os.urandom(32))), RemoteTier(client)
    key = b"e" * 16
    sealed.write(key, b"secret kv" * 10)
    raw = client.get(PREFIX + key.hex().encode())
    assert raw[len(MAGIC)] == ENCRYPTED and b"secret kv" not in raw
    assert sealed.read(key) == b"secret kv" * 10
    assert RemoteTier(client, KVCipher(os.urandom(32))).read(key) is None  # another model's key: refused
    sealed.write(key, b"again")
    assert plain.read(key) is None  # a plain reader never takes a sealed block as its own


def test_a_stack_writes_both_and_reads_the_directory_first(tmp_path, remote):
    disk = DiskTier(tmp_path, 1 << 20)
    stack = TierStack([disk, remote])
    key = b"s" * 16
    stack.write(key, b"both")
    assert disk.has(key) and remote.has(key)
    assert stack.read(key) == b"both" and hits_of(stack, "disk") == 1 and hits_of(stack, "remote") == 0
    disk.path(key).unlink()
    assert stack.read(key) == b"both" and hits_of(stack, "remote") == 1


def test_an_unreachable_or_malformed_url_is_named(valkey):
    with pytest.raises(ValueError, match="kv_offload_url .*cannot reach"):
        connect("redis://127.0.0.1:1")
    with pytest.raises(ValueError, match="expected redis://HOST:PORT"):
        connect("http://127.0.0.1:6379")


def test_a_server_that_goes_away_costs_hits_not_the_engine(tmp_path):
    proc, url = start_valkey(tmp_path)
    tier = RemoteTier(connect(url))
    tier.write(b"g" * 16, b"x")
    stop_valkey(proc)
    assert tier.read(b"g" * 16) is None and not tier.has(b"g" * 16)
    tier.write(b"h" * 16, b"y")  # logged, not raised
    assert tier.num_errors >= 3
