"""A file mapped in 2 MiB pages: the repacked weights' cache (loader/repacked_cache.py) as the
kernels stream it.

At one activation row a decode step streams every weight from memory once, and where the mapping
is in 4 KiB pages every 4 KiB of it is a TLB miss beside the load: a 1B model's tiles, the same
bytes, streamed 1.1-1.2x as fast in 2 MiB pages on the AVX-512 EPYC (benchmarks/README.md,
"Packed weights in 2 MiB pages", "The cache's pages").

Whether a file's mapping gets 2 MiB pages is the page cache's choice, made when the file is
read in: a fault in a mapping advised ``MADV_HUGEPAGE`` reads a whole 2 MiB folio (where the
filesystem keeps large folios: ext4 from Linux 6.16, XFS), one without the advice reads small
ones, and once cached a file keeps the folios it was read in. So ``map_in_huge_pages`` advises
before the first fault, and where the file was already cached in small folios (read by an
earlier start without the advice, or by ``cp``), it lets those go and reads the file again,
once: the folios it then reads stay for later starts. Where that gives no 2 MiB pages either (a
filesystem without large folios), the directory remembers it for the running kernel.
"""

from __future__ import annotations

import ctypes
import fcntl
import logging
import mmap
import os
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
_MADV_POPULATE_READ = 22  # Linux 5.14: fault every page in, reading what is not cached
_PAGE_IS_HUGE = 1 << 6  # PAGEMAP_SCAN's category of a page mapped as part of a 2 MiB one


class _Region(ctypes.Structure):
    _fields_ = [("start", ctypes.c_uint64), ("end", ctypes.c_uint64), ("categories", ctypes.c_uint64)]


class _ScanArg(ctypes.Structure):  # struct pm_scan_arg (linux/fs.h)
    _fields_ = [(name, ctypes.c_uint64) for name in (
        "size", "flags", "start", "end", "walk_end", "vec", "vec_len", "max_pages",
        "category_inverted", "category_mask", "category_anyof_mask", "return_mask")]


_PAGEMAP_SCAN = (3 << 30) | (ctypes.sizeof(_ScanArg) << 16) | (ord("f") << 8) | 16  # _IOWR('f', 16, ...)


def huge_mapped_bytes(start: int, end: int) -> int | None:
    """How many bytes of this process's memory from ``start`` to ``end`` are mapped in 2 MiB
    pages (``PAGEMAP_SCAN``, Linux 6.7); None where the kernel cannot say."""
    regions = (_Region * 64)()
    total = 0
    try:
        with open("/proc/self/pagemap", "rb") as pagemap:
            while start < end:
                arg = _ScanArg(size=ctypes.sizeof(_ScanArg), start=start, end=end, vec=ctypes.addressof(regions),
                               vec_len=len(regions), category_mask=_PAGE_IS_HUGE, return_mask=_PAGE_IS_HUGE)
                found = fcntl.ioctl(pagemap.fileno(), _PAGEMAP_SCAN, arg)
                total += sum(regions[i].end - regions[i].start for i in range(found))
                if arg.walk_end <= start:
                    break
                start = arg.walk_end
    except OSError:
        return None
    return total


def _mapped(path: Path, size: int) -> tuple[torch.Tensor, int]:
    """The file as a private, copy-on-write uint8 tensor (as ``torch.from_file(shared=False)``),
    advised 2 MiB pages and faulted in; and how much of it 2 MiB pages map (-1: not known)."""
    with open(path, "rb") as f:
        mapping = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
    try:
        mapping.madvise(mmap.MADV_HUGEPAGE)
    except (AttributeError, OSError):  # no such advice here (not Linux, or no THP): small pages
        pass
    tensor = torch.frombuffer(mapping, dtype=torch.uint8)  # holds the mapping: unmapped with the tensor
    if size < HUGE_PAGE:
        return tensor, 0
    try:
        mapping.madvise(_MADV_POPULATE_READ)
    except OSError:  # before Linux 5.14: the kernels' loads fault it in, as the page cache has it
        return tensor, -1
    start = tensor.data_ptr()
    huge = huge_mapped_bytes(start, start + size)
    return tensor, -1 if huge is None else huge


def map_in_huge_pages(path: Path) -> torch.Tensor:
    """``path`` mapped privately as a uint8 tensor, in 2 MiB pages wherever the kernel, the
    filesystem and the file's place in the page cache allow (module docstring)."""
    size = path.stat().st_size
    tensor, huge = _mapped(path, size)
    start = tensor.data_ptr()
    whole = ((start + size) // HUGE_PAGE - (start + HUGE_PAGE - 1) // HUGE_PAGE) * HUGE_PAGE
    if huge < 0 or huge >= whole or start % HUGE_PAGE or _read_again_in_vain(path.parent):
        return tensor  # (a mapping that does not start on 2 MiB cannot take them whatever the folios)
    del tensor  # our mapping of the small folios: the page cache can let them go now
    with open(path, "rb") as f:
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    tensor, huge = _mapped(path, size)
    if huge < whole and not _fresh_file_gets_huge_pages(path.parent):
        _remember_in_vain(path.parent)  # no large folios here (overlayfs, ext4 before Linux 6.16)
    logger.debug("%s: read again for 2 MiB pages, %d of %d bytes in them", path, huge, size)
    return tensor


# Where reading a file again gave it no 2 MiB pages, and a fresh file there gets none either (so
# it was not another process holding the small folios), the directory says so for this kernel:
# later files and starts then map what is cached instead of reading every file from disk again.
_IN_VAIN = ".small-folios"


def _fresh_file_gets_huge_pages(directory: Path) -> bool:
    probe = directory / f".huge-folio-probe.{os.getpid()}"
    try:
        with open(probe, "wb") as f:
            f.write(bytes(2 * HUGE_PAGE))
            os.fsync(f.fileno())  # written back: the page cache lets only clean folios go
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        tensor, huge = _mapped(probe, 2 * HUGE_PAGE)
        return huge > 0 or tensor.data_ptr() % HUGE_PAGE != 0
    except OSError:
        return True  # cannot tell: remember nothing
    finally:
        probe.unlink(missing_ok=True)


def _read_again_in_vain(directory: Path) -> bool:
    try:
        return (directory / _IN_VAIN).read_text() == os.uname().release
    except OSError:
        return False


def _remember_in_vain(directory: Path) -> None:
    try:
        (directory / _IN_VAIN).write_text(os.uname().release)
    except OSError:  # a read-only cache: each start then tries one file again
        pass
