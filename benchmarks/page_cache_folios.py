"""How a repacked cache's files sit in the page cache, and how to put them in small folios again
(what a start before loader/file_pages.py, or a `cp`, left): the "before" side of its benchmark.

    python benchmarks/page_cache_folios.py DIR            # MiB of DIR's *.tiles a 2 MiB page maps
    python benchmarks/page_cache_folios.py DIR --small    # drop them, read them back in small folios

DIR is a ``$PAGODA_HOME/repacked/<cpu>/<key>`` directory (``cache_directory(gguf)`` names it). The
report maps each file as a plain reader would (no advice) and counts, with ``PAGEMAP_SCAN``, the
bytes a 2 MiB page maps: the page cache's folios, as any later mapping of the file gets them.
"""

from __future__ import annotations

import argparse
import mmap
import os
from pathlib import Path

import numpy as np

from pagoda.loader.file_pages import huge_mapped_bytes


def read_plainly(path: Path) -> int:
    """Fault ``path`` in through a mapping without advice; the bytes 2 MiB pages mapped."""
    with open(path, "rb") as f:
        mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    view = np.frombuffer(mapping, dtype=np.uint8)
    int(view[::4096].sum())
    huge = huge_mapped_bytes(view.ctypes.data, view.ctypes.data + view.size) or 0
    del view
    mapping.close()
    return huge


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("directory", type=Path)
    p.add_argument("--small", action="store_true", help="drop the files' pages and read them back in small folios")
    args = p.parse_args()
    files = sorted(args.directory.glob("*.tiles"))
    if args.small:
        for path in files:
            with open(path, "rb") as f:
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    total = sum(path.stat().st_size for path in files)
    huge = sum(read_plainly(path) for path in files)
    print(f"{args.directory}: {len(files)} files, {total >> 20} MiB, {huge >> 20} MiB of it in 2 MiB pages")


if __name__ == "__main__":
    main()
