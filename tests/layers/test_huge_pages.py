"""csrc/huge_pages.h: the packed weights the repacking makes (super-block tiles, Q4_0 / Q4_1 / Q8_0
tiles, F16 / BF16 rows) lie in memory aligned to 2 MiB and backed by 2 MiB pages where Linux
offers them, and that memory is given back with the weight."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from page_sizes import anon_huge_kib, huge_pages_offered, mapped_kib
from superblock_data import TYPE_IDS, random_blocks

from pagoda.layers.cpu_kernels import load_cpu_kernels

ops = load_cpu_kernels()
pytestmark = pytest.mark.skipif(ops is None, reason="pagoda's C++ kernels cannot be built here")
F16 = 1  # GGMLQuantizationType


def _packed(kind: str, rows: int = 2048, cols: int = 2048) -> torch.Tensor:
    rng = np.random.default_rng(0)
    if kind == "half":
        return ops.half_repack(torch.randn(rows, cols).half().view(torch.int16), F16)
    blocks = torch.from_numpy(random_blocks(kind, rows, cols, rng))
    if kind == "Q4_0":
        return ops.block_repack_tiles(blocks, TYPE_IDS[kind], cols)
    return ops.superblock_repack([blocks], [TYPE_IDS[kind]], cols)


@pytest.mark.parametrize("kind", ["Q4_K", "Q4_0", "half"])
def test_a_packed_weight_lies_in_huge_pages(kind):
    packed = _packed(kind)
    assert packed.numel() >= 2 << 20
    assert packed.data_ptr() % (2 << 20) == 0
    if not huge_pages_offered():
        pytest.skip("this kernel offers no transparent huge pages")
    assert anon_huge_kib(packed.data_ptr()) >= 2048


def test_the_memory_outlives_its_views_and_is_given_back_with_them():
    packed = _packed("Q4_0")
    view = packed[1:]  # what a caller may keep of it
    expected = view.clone()
    del packed
    assert torch.equal(view, expected)  # still mapped: the view holds the storage
    del view
    before = mapped_kib()
    for _ in range(20):  # 2.4 MB each, mapped as 4 MiB: 80 MiB more were it never given back
        _packed("Q4_0")
    assert mapped_kib() - before < 40 * 1024
