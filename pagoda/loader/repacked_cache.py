"""Weights repacked at load (layers/superblocks.py's tiles, layers/half_weights.py's F16 / BF16
rows side by side), kept on disk for the next start.

Repacking a 1B model's K-quant blocks takes seconds at every start; the tiles depend only on the
file's bytes and on the repacking code, so the first start writes each packed weight under
``$PAGODA_HOME/repacked/<cpu>/<file key>/`` and later starts map those files instead of reading
and repacking the GGUF's blocks (no copy: the pages come from the page cache, in 2 MiB pages
where it can, loader/file_pages.py, and the kernel reclaims them as it would the file's).

The file key covers the GGUF's path, size and modification time, the tensor-parallel slice, and
``FORMAT_VERSION`` (bump it when the tiles' layout changes). A cached file is used only if its
header names the same parts (types and rows) and input width as the weight being loaded and its
size is the one they make; anything else is repacked and written again. ``PAGODA_REPACK_CACHE=0``
turns the cache off.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Callable
from pathlib import Path

import torch

from pagoda import envs
from pagoda.home import pagoda_home
from pagoda.layers.cpu_kernels import build_directory
from pagoda.loader.file_pages import map_in_huge_pages

logger = logging.getLogger(__name__)

FORMAT_VERSION = 2  # of csrc/superblock_formats.h's tiles and superblock_tiles.cpp's header (and half_weights.cpp's)


def cache_directory(gguf_path: Path, tp_rank: int = 0, tp_size: int = 1) -> Path | None:
    """Where this file's packed weights live (None with PAGODA_REPACK_CACHE=0)."""
    if not envs.PAGODA_REPACK_CACHE:
        return None

    resolved = Path(gguf_path).resolve()
    stat = resolved.stat()
    ident = f"{resolved}|{stat.st_size}|{stat.st_mtime_ns}|tp{tp_rank}/{tp_size}|v{FORMAT_VERSION}"
    return pagoda_home() / "repacked" / build_directory().name / hashlib.sha256(ident.encode()).hexdigest()[:24]


class RepackCache:
    """Packed weights by name in one directory; ``get`` maps a valid one or makes and writes it."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.hits = self.misses = 0

    def _path(self, name: str) -> Path:
        return self.directory / f"{name}.tiles"

    def get(self, name: str, expected: Callable[[torch.Tensor], bool], make: Callable[[], torch.Tensor]) -> torch.Tensor:
        """The packed weight ``name``: the cached one if ``expected(tensor)`` accepts it, else
        ``make()``'s, written for next time (a failed write only logs)."""
        path = self._path(name)
        if path.is_file():
            try:
                mapped = map_in_huge_pages(path)
                if expected(mapped):
                    self.hits += 1
                    return mapped
            except (OSError, RuntimeError, ValueError) as e:
                logger.info("repacked %s not reused (%s)", path, e)
        self.misses += 1
        packed = make()
        self._write(path, packed)
        return packed

    def _write(self, path: Path, packed: torch.Tensor) -> None:
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(memoryview(packed.numpy()))
            os.replace(tmp, path)  # atomic: a concurrent start sees the old file or the whole new one
        except OSError as e:
            logger.warning("could not keep the repacked weight %s (%s); the next start repacks it", path, e)
            tmp.unlink(missing_ok=True)
