"""Blobs: verified on write, installed atomically, safe with concurrent writers."""

from __future__ import annotations

import hashlib
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor

import pytest

from pagoda.store import blobs
from pagoda.store.layout import StoreLayout


def test_write_verifies_and_names_by_digest(tmp_path):
    layout = StoreLayout(tmp_path)
    data = b"hello blob"
    digest = blobs.write_blob(layout, data)
    assert digest == "sha256:" + hashlib.sha256(data).hexdigest()
    assert layout.blob_path(digest).read_bytes() == data
    assert layout.blob_path(digest).name == "sha256-" + hashlib.sha256(data).hexdigest()
    assert blobs.write_blob(layout, data, expected=digest) == digest  # present: nothing rewritten
    assert blobs.has_blob(layout, digest, len(data)) and not blobs.has_blob(layout, digest, 3)
    assert blobs.verify_blob(layout, digest)


def test_digest_mismatch_is_rejected_and_leaves_nothing(tmp_path):
    layout = StoreLayout(tmp_path)
    wrong = "sha256:" + hashlib.sha256(b"something else").hexdigest()
    with pytest.raises(blobs.DigestMismatch, match="rejected"):
        blobs.write_blob(layout, b"hello", expected=wrong)
    assert os.listdir(layout.blobs_dir) == []  # no temporary file, no blob


def test_a_failed_write_leaves_no_half_blob(tmp_path):
    layout = StoreLayout(tmp_path)

    def chunks():
        yield b"x" * 1000
        raise OSError("disk gone")

    with pytest.raises(OSError):
        blobs.write_chunks(layout, chunks())
    assert os.listdir(layout.blobs_dir) == []


def test_import_file_copies_or_links(tmp_path):
    layout = StoreLayout(tmp_path / "store")
    src = tmp_path / "model.gguf"
    src.write_bytes(os.urandom(3 << 20))
    digest = blobs.import_file(layout, src)
    assert layout.blob_path(digest).read_bytes() == src.read_bytes()
    assert os.stat(layout.blob_path(digest)).st_ino != os.stat(src).st_ino  # user files are copied
    other = StoreLayout(tmp_path / "other")
    blobs.import_file(other, layout.blob_path(digest), digest, link=True)
    assert os.stat(other.blob_path(digest)).st_ino == os.stat(layout.blob_path(digest)).st_ino
    with pytest.raises(blobs.DigestMismatch):
        blobs.import_file(StoreLayout(tmp_path / "third"), src, "sha256:" + "0" * 64)


def test_read_only_store_refuses_writes(tmp_path):
    with pytest.raises(ValueError, match="read-only"):
        blobs.write_blob(StoreLayout(tmp_path, read_only=True), b"x")


def _write_many(root: str, data: bytes, rounds: int) -> int:
    layout = StoreLayout(root)
    expected = "sha256:" + hashlib.sha256(data).hexdigest()
    for _ in range(rounds):
        with blobs.BlobWriter(layout) as w:  # always a full rewrite, never the shortcut for a present blob
            for i in range(0, len(data), 1 << 16):
                w.write(data[i:i + (1 << 16)])
            w.commit(expected)
    return rounds


def _read_many(root: str, digest: str, size: int, rounds: int) -> int:
    """Read the blob ``rounds`` times once it exists (the writers keep replacing it meanwhile)."""
    import time

    layout = StoreLayout(root)
    seen = 0
    deadline = time.monotonic() + 60
    while seen < rounds and time.monotonic() < deadline:
        try:
            data = layout.blob_path(digest).read_bytes()
        except FileNotFoundError:
            continue
        assert len(data) == size and "sha256:" + hashlib.sha256(data).hexdigest() == digest
        seen += 1
    return seen


def test_concurrent_writers_of_one_blob_never_expose_a_partial_file(tmp_path):
    data = os.urandom(4 << 20)
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(3, mp_context=ctx) as pool:
        writers = [pool.submit(_write_many, str(tmp_path), data, 20) for _ in range(2)]
        reader = pool.submit(_read_many, str(tmp_path), digest, len(data), 50)
        assert [w.result(timeout=120) for w in writers] == [20, 20]
        assert reader.result(timeout=120) == 50
    assert blobs.verify_blob(StoreLayout(tmp_path), digest)
    assert sorted(os.listdir(tmp_path / "blobs")) == ["sha256-" + digest.split(":")[1]]
