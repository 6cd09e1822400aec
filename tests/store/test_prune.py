"""Deleting the blobs no manifest names (pagoda/store/prune.py)."""

from __future__ import annotations

import hashlib
import os

from pagoda.store import blobs
from pagoda.store.layout import StoreLayout, parse_ref
from pagoda.store.manifests import MODEL, Layer, build_manifest, write_manifest
from pagoda.store.prune import prune_unreferenced


def test_prune_deletes_only_unreferenced_blobs_past_the_grace(tmp_path):
    layout = StoreLayout(tmp_path)
    used = blobs.write_blob(layout, b"a model's weights")
    write_manifest(layout, parse_ref("kept"), build_manifest(layout, [Layer(MODEL, used, 17)]))
    orphan = blobs.write_blob(layout, b"uploaded, never named by a create")
    stale_tmp = layout.blobs_dir / ".tmp-dead-writer.blob"
    stale_tmp.write_bytes(b"half")
    partial = layout.blobs_dir / f"sha256-{'1' * 64}-partial"  # a pull's, resumed by the next pull
    partial.write_bytes(b"resumable")
    assert prune_unreferenced(layout, grace=3600) == []  # all younger than an hour
    later = max(os.stat(p).st_ctime for p in layout.blobs_dir.iterdir()) + 1
    removed = prune_unreferenced(layout, grace=0, now=later)
    assert sorted(removed) == sorted([layout.blob_path(orphan), stale_tmp])
    assert blobs.has_blob(layout, used) and partial.exists()
    assert len(os.listdir(layout.blobs_dir)) == 3  # the model, its config, the partial
    assert prune_unreferenced(StoreLayout(tmp_path / "none"), grace=0) == []


def test_prune_ages_a_linked_blob_by_its_link_not_its_source(tmp_path):
    """A blob hard-linked in (the catalog's GGUF) keeps its source's old mtime; the link is new."""
    layout = StoreLayout(tmp_path / "store")
    src = tmp_path / "old.gguf"
    src.write_bytes(b"GGUF weights from long ago")
    os.utime(src, (1_000_000, 1_000_000))
    digest = blobs.import_file(layout, src, "sha256:" + hashlib.sha256(src.read_bytes()).hexdigest(), link=True)
    assert os.stat(layout.blob_path(digest)).st_ino == os.stat(src).st_ino
    assert prune_unreferenced(layout, grace=60) == [] and blobs.has_blob(layout, digest)
