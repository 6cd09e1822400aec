"""Deleting the blobs no manifest names.

Blobs no manifest names (an upload `/api/create` never used, a writer that died) are deleted
once older than a grace period, as Ollama prunes its store at start-up (unless OLLAMA_NOPRUNE):
the grace is what keeps a pull or a create from losing the blobs it wrote before its manifest.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

from pagoda.store.layout import StoreLayout
from pagoda.store.manifests import referenced_digests

_BLOB_NAME = re.compile(r"^sha256[-:]([0-9a-f]{64})$")


def prune_unreferenced(layout: StoreLayout, grace: float, now: float | None = None) -> list[Path]:
    """Delete the blobs no manifest in the store names, and the temporary files of writers that
    died (``.tmp-*``), last changed more than ``grace`` seconds ago; returns what was deleted.

    "Last changed" is the later of mtime and ctime: a blob hard-linked in (``import_file``) keeps
    its source's mtime, but the link and the rename onto its name set its ctime to now. A pull's
    ``-partial`` files stay (a later pull resumes them)."""
    if layout.read_only or not layout.blobs_dir.is_dir():
        return []
    used = referenced_digests(layout)
    cutoff = (time.time() if now is None else now) - grace
    removed = []
    for path in layout.blobs_dir.iterdir():
        match = _BLOB_NAME.match(path.name)
        if (match is None or match.group(1) in used) and not path.name.startswith(".tmp-"):
            continue
        try:
            st = path.lstat()
            if not path.is_file() or max(st.st_mtime, st.st_ctime) > cutoff:
                continue
            path.unlink()
        except FileNotFoundError:  # another pruner, or a writer's rename, got there first
            continue
        removed.append(path)
    return removed
