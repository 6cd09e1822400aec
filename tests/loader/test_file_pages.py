"""loader/file_pages.py: a cached weight's file is mapped in 2 MiB pages, even where the page
cache held it in small folios (as an earlier start's faults, or a `cp`, leave it), and stays a
private copy of the file that is unmapped with its tensor."""

from __future__ import annotations

import mmap
import os
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from page_sizes import huge_pages_offered, mapped_kib

from pagoda.loader.file_pages import HUGE_PAGE, huge_mapped_bytes, map_in_huge_pages

SIZE = 5 * HUGE_PAGE + 12345  # two or more whole 2 MiB pages wherever the mapping starts, and a tail


def _drop(path) -> None:
    with open(path, "rb") as f:
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def _read_through_mapping(path, advise: bool) -> int:
    """Fault the whole file in through a mapping of our own; how much of it 2 MiB pages mapped."""
    with open(path, "rb") as f:
        mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    if advise:
        mapping.madvise(mmap.MADV_HUGEPAGE)
    view = np.frombuffer(mapping, dtype=np.uint8)
    int(view[::4096].sum())
    start = view.ctypes.data
    huge = huge_mapped_bytes(start, start + view.size)
    del view
    mapping.close()
    return huge or 0


@pytest.fixture
def weight_file(tmp_path):
    path = tmp_path / "weight.tiles"
    with open(path, "wb") as f:
        f.write(np.random.default_rng(0).integers(0, 256, SIZE, dtype=np.uint8).tobytes())
        os.fsync(f.fileno())  # written back: the page cache lets only clean pages go
    if not huge_pages_offered() or huge_mapped_bytes(0, 4096) is None:
        pytest.skip("this kernel gives no transparent huge pages, or cannot say which pages are (PAGEMAP_SCAN)")
    _drop(path)
    if _read_through_mapping(path, advise=True) == 0:
        pytest.skip(f"the page cache of {tmp_path}'s filesystem keeps no 2 MiB folios")
    return path


def test_a_file_cached_in_small_folios_is_mapped_in_huge_pages(weight_file):
    _drop(weight_file)
    assert _read_through_mapping(weight_file, advise=False) < 2 * HUGE_PAGE  # the small folios a plain fault reads
    tensor = map_in_huge_pages(weight_file)
    start = tensor.data_ptr()
    assert huge_mapped_bytes(start, start + SIZE) >= 2 * HUGE_PAGE  # every whole 2 MiB page of it
    assert tensor.numel() == SIZE and tensor.numpy().tobytes() == weight_file.read_bytes()
    del tensor
    again = map_in_huge_pages(weight_file)  # the page cache kept the folios read for it
    assert huge_mapped_bytes(again.data_ptr(), again.data_ptr() + SIZE) >= 2 * HUGE_PAGE
    assert not (weight_file.parent / ".small-folios").exists()  # nothing remembered where it worked


def _counting_drops(monkeypatch) -> list[int]:
    """Each POSIX_FADV_DONTNEED map_in_huge_pages asks for (passed on to the kernel)."""
    dropped: list[int] = []
    real_fadvise = os.posix_fadvise
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, *a: dropped.append(fd) or real_fadvise(fd, *a))
    return dropped


def test_a_directory_that_remembers_small_folios_is_not_read_again(weight_file, monkeypatch):
    """Where a fresh file got no 2 MiB folios, the directory says so for this kernel and no later
    file or start is dropped and read again in vain; another kernel's word does not count."""
    from pagoda.loader.file_pages import _fresh_file_gets_huge_pages

    assert _fresh_file_gets_huge_pages(weight_file.parent)  # here they are: nothing to remember
    assert [p.name for p in weight_file.parent.iterdir()] == [weight_file.name]  # the probe is gone
    marker = weight_file.parent / ".small-folios"
    marker.write_text(os.uname().release)
    dropped = _counting_drops(monkeypatch)
    _drop(weight_file)
    _read_through_mapping(weight_file, advise=False)
    count = len(dropped)
    tensor = map_in_huge_pages(weight_file)
    assert len(dropped) == count and tensor.numpy().tobytes() == weight_file.read_bytes()
    del tensor
    marker.write_text("another kernel")
    tensor = map_in_huge_pages(weight_file)
    assert len(dropped) == count + 1
    assert huge_mapped_bytes(tensor.data_ptr(), tensor.data_ptr() + SIZE) >= 2 * HUGE_PAGE


def test_a_filesystem_without_huge_folios_is_not_read_again(monkeypatch):
    """tmpfs with huge pages off (Linux's default for /dev/shm) gives small pages whatever the
    advice: its files are mapped as they are, never dropped and read again."""
    shm_setting = Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled")
    if not Path("/dev/shm").is_dir() or not shm_setting.exists() or not any(
            f"[{mode}]" in shm_setting.read_text() for mode in ("never", "deny")):
        pytest.skip("no tmpfs with huge pages off here")
    with tempfile.TemporaryDirectory(dir="/dev/shm") as where:
        paths = [Path(where) / f"{name}.tiles" for name in ("first", "second")]
        for path in paths:
            path.write_bytes(bytes(SIZE))
        dropped = _counting_drops(monkeypatch)
        tensors = [map_in_huge_pages(path) for path in paths]
        assert [t.numel() for t in tensors] == [SIZE, SIZE]
        assert len(dropped) <= 1  # at most the first, read again once in vain, and remembered


def test_the_mapping_is_a_private_copy_given_back_with_its_tensor(weight_file):
    original = weight_file.read_bytes()
    tensor = map_in_huge_pages(weight_file)
    tensor[:16] = 7  # copy on write: the file is not changed
    assert weight_file.read_bytes() == original
    view = tensor[HUGE_PAGE:]
    del tensor
    assert bytes(view[:8].numpy()) == original[HUGE_PAGE:HUGE_PAGE + 8]  # the view holds the mapping
    del view
    before = mapped_kib()
    for _ in range(10):  # 10.5 MiB each: 105 MiB more were they never unmapped
        map_in_huge_pages(weight_file)
    assert mapped_kib() - before < 40 * 1024


def test_a_small_file_is_mapped_as_it_is(tmp_path):
    path = tmp_path / "small.tiles"
    path.write_bytes(bytes(range(256)) * 16)
    tensor = map_in_huge_pages(path)
    assert tensor.dtype == torch.uint8 and tensor.numpy().tobytes() == path.read_bytes()
