"""Content-addressed blobs: ``blobs/sha256-<hex>``, verified on write, never half-written.

Every write goes to a temporary file in the blobs directory (same filesystem), is hashed as it
is written, and only when the digest matches is it renamed onto its final name with
``os.replace``: a reader sees either no blob or the whole blob. Two writers of the same blob
(two pulls at once) each write their own temporary file and both renames install identical
bytes, so neither corrupts the other. A digest mismatch raises ``DigestMismatch`` and leaves
nothing behind.

Blobs no manifest names are deleted by ``pagoda.store.prune``.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import BinaryIO

from pagoda.store.layout import StoreLayout, digest_hex

CHUNK = 1 << 20


class DigestMismatch(ValueError):
    """A blob's bytes do not hash to the digest it was announced under."""


def digest_bytes(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def digest_file(path: Path, progress: Callable[[int], None] | None = None) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            h.update(block)
            if progress:
                progress(len(block))
    return "sha256:" + h.hexdigest()


def has_blob(layout: StoreLayout, digest: str, size: int | None = None) -> bool:
    """Whether the blob is present (and of ``size`` bytes, when given). Present blobs were verified
    when written, so this does not re-hash."""
    try:
        st = layout.blob_path(digest).stat()
    except FileNotFoundError:
        return False
    return size is None or st.st_size == size


class BlobWriter:
    """Write one blob: ``write()`` chunks, then ``commit(expected)``; ``abort()`` (or leaving the
    ``with`` block on an error) removes the temporary file."""

    def __init__(self, layout: StoreLayout) -> None:
        layout.check_writable()
        layout.blobs_dir.mkdir(parents=True, exist_ok=True)
        self.layout = layout
        fd, name = tempfile.mkstemp(prefix=".tmp-", suffix=".blob", dir=layout.blobs_dir)
        self._file = os.fdopen(fd, "wb")
        self.tmp_path = Path(name)
        self._hash = hashlib.sha256()
        self.size = 0

    def write(self, data: bytes) -> None:
        self._file.write(data)
        self._hash.update(data)
        self.size += len(data)

    @property
    def digest(self) -> str:
        return "sha256:" + self._hash.hexdigest()

    def commit(self, expected: str | None = None) -> str:
        """Verify against ``expected`` (if given) and install; returns the digest."""
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        digest = self.digest
        if expected is not None and digest_hex(expected) != digest_hex(digest):
            self.abort()
            raise DigestMismatch(f"blob content hashes to {digest}, expected {expected}: rejected")
        os.chmod(self.tmp_path, 0o644)
        os.replace(self.tmp_path, self.layout.blobs_dir / f"sha256-{digest_hex(digest)}")
        return digest

    def abort(self) -> None:
        with contextlib.suppress(Exception):
            self._file.close()
        with contextlib.suppress(FileNotFoundError):
            self.tmp_path.unlink()

    def __enter__(self) -> BlobWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None or not self._file.closed:  # an error, or left without commit
            self.abort()


def write_blob(layout: StoreLayout, data: bytes, expected: str | None = None) -> str:
    """Store ``data``; returns its digest (``sha256:<hex>``)."""
    return write_chunks(layout, [data], expected)


def write_chunks(layout: StoreLayout, chunks: Iterable[bytes], expected: str | None = None) -> str:
    if expected is not None and has_blob(layout, expected):
        return expected
    with BlobWriter(layout) as w:
        for chunk in chunks:
            w.write(chunk)
        return w.commit(expected)


def write_stream(layout: StoreLayout, stream: BinaryIO, expected: str | None = None,
                 progress: Callable[[int], None] | None = None) -> str:
    def chunks():
        while block := stream.read(CHUNK):
            if progress:
                progress(len(block))
            yield block

    return write_chunks(layout, chunks(), expected)


def import_file(layout: StoreLayout, src: Path, expected: str | None = None, *, link: bool = False,
                progress: Callable[[int], None] | None = None) -> str:
    """Store the file ``src``; returns its digest.

    Copies while hashing. With ``link=True`` and an ``expected`` digest already known to be right
    (the catalog's verified files, another store's blobs), hard-links instead of copying when the
    two are on one filesystem: no second copy of a large model. Blobs are never written in place,
    so a shared inode stays valid.
    """
    src = Path(src)
    if expected is not None and has_blob(layout, expected, src.stat().st_size):
        return expected
    if link and expected is not None:
        layout.check_writable()
        layout.blobs_dir.mkdir(parents=True, exist_ok=True)
        tmp = layout.blobs_dir / f".tmp-link-{os.getpid()}-{digest_hex(expected)[:16]}"
        try:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
            os.link(src, tmp)
            os.replace(tmp, layout.blobs_dir / f"sha256-{digest_hex(expected)}")
            return expected
        except OSError:  # another filesystem, or links not allowed: copy
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
    with open(src, "rb") as f:
        return write_stream(layout, f, expected, progress)


def verify_blob(layout: StoreLayout, digest: str) -> bool:
    """Re-hash a stored blob (``pagoda show --verify``, tests)."""
    path = layout.blob_path(digest)
    return path.is_file() and digest_hex(digest_file(path)) == digest_hex(digest)


def commit_file(layout: StoreLayout, path: Path, digest: str, actual: str) -> None:
    """Install a completely downloaded file (``actual`` is its digest, computed while it was
    written) as blob ``digest``; DigestMismatch (and the file removed) if they differ."""
    if digest_hex(actual) != digest_hex(digest):
        path.unlink(missing_ok=True)
        raise DigestMismatch(f"downloaded blob hashes to {actual}, expected {digest}: rejected")
    os.chmod(path, 0o644)
    os.replace(path, layout.blobs_dir / f"sha256-{digest_hex(digest)}")
