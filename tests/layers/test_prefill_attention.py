"""The flash-style prefill kernel (csrc/prefill_attention.cpp) against SDPA over the same keys and
values, for every cache dtype, GQA ratio, head size, block size, window and chunk position; a row's
bits do not depend on which chunk computed it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagoda.layers.backend import read_blocks
from pagoda.layers.cpu_kernels import load_cpu_kernels
from pagoda.worker.kv_cache import SCALED_KV_DTYPES

ops = load_cpu_kernels()
pytestmark = pytest.mark.skipif(ops is None, reason="pagoda's C++ kernels cannot be built here")


def _cache(total: int, hkv: int, d: int, bs: int, dtype: torch.dtype, seed: int):
    """A shuffled block pool holding `total` positions of random keys and values (as a scaled
    cache encodes them: codes and per-(token, head) scales), and the sequence's block table."""
    from pagoda.layers.backend import quantize_rows

    g = torch.Generator().manual_seed(seed)
    nb = -(-total // bs)
    table = torch.randperm(nb + 5, generator=g)[:nb]
    caches, scales = [], []
    for _ in range(2):
        x = torch.randn(nb + 5, hkv, bs, d, generator=g)
        if dtype in SCALED_KV_DTYPES:
            codes, s = quantize_rows(x, dtype)
            caches.append(codes), scales.append(s)
        else:
            caches.append(x.to(dtype)), scales.append(None)
    return caches, scales, table


def _sdpa(q, caches, scales, table, start, scale, window):
    """SDPA over the cache's values widened to float, causal from `start`, within `window`."""
    total = start + q.shape[0]
    keys, values = (read_blocks(c, s, table, torch.float32)[:, :total] for c, s in zip(caches, scales))
    q_pos = torch.arange(start, total).unsqueeze(1)
    k_pos = torch.arange(total).unsqueeze(0)
    mask = k_pos <= q_pos
    if window:
        mask &= k_pos > q_pos - window
    out = F.scaled_dot_product_attention(q.float().transpose(0, 1), keys, values, attn_mask=mask, scale=scale,
                                         enable_gqa=True)
    return out.transpose(0, 1)


CASES = [  # (Hq, Hkv, D, block size, cached positions, chunk length, window, cache dtype)
    (9, 3, 64, 16, 0, 130, 0, torch.float32),        # SmolLM2's heads, a fresh chunk over 3 key tiles
    (9, 3, 64, 16, 200, 77, 0, torch.float16),       # over a cached prefix, ending inside a block
    (4, 4, 64, 16, 37, 1, 0, torch.bfloat16),        # no GQA, one row
    (14, 2, 64, 32, 5, 300, 0, torch.float32),       # Qwen2.5's ratio (7): a row tile of 13 positions
    (8, 2, 80, 16, 0, 97, 0, torch.float32),         # a head size of 80: padded to 96 in the tiles
    (8, 4, 128, 16, 64, 64, 0, torch.float16),       # a head size of 128, the chunk on a key tile's edge
    (6, 2, 32, 8, 150, 90, 50, torch.float32),       # a sliding window shorter than the chunk
    (6, 2, 32, 8, 0, 200, 64, torch.float16),        # a fresh chunk longer than its window
    (9, 3, 64, 16, 100, 60, 0, torch.int8),          # scaled caches: codes times per-row scales
    (9, 3, 64, 16, 100, 60, 0, torch.float8_e4m3fn),
    (9, 3, 64, 16, 30, 45, 33, torch.float8_e5m2),
]


@pytest.mark.parametrize("hq,hkv,d,bs,start,lq,window,dtype", CASES)
def test_matches_sdpa_over_the_same_values(hq, hkv, d, bs, start, lq, window, dtype):
    caches, scales, table = _cache(start + lq, hkv, d, bs, dtype, seed=hq * 7 + start)
    q = torch.randn(lq, hq, d, generator=torch.Generator().manual_seed(lq))
    out = ops.paged_prefill_attention(q, caches[0], caches[1], table, start, d**-0.5, window, scales[0], scales[1])
    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out, _sdpa(q, caches, scales, table, start, d**-0.5, window), atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("window", [0, 70])
def test_a_rows_bits_do_not_depend_on_its_chunk(window):
    """The rows of a chunk over a cached prefix are bit for bit those rows of one chunk covering the
    whole prompt: key tiles start at multiples of 64 and a row's masked keys add exact zeros."""
    caches, scales, table = _cache(300, 3, 64, 16, torch.float16, seed=1)
    q = torch.randn(300, 9, 64, generator=torch.Generator().manual_seed(2))
    whole = ops.paged_prefill_attention(q, caches[0], caches[1], table, 0, 0.125, window)
    for start in (1, 63, 64, 170):
        part = ops.paged_prefill_attention(q[start:], caches[0], caches[1], table, start, 0.125, window)
        assert torch.equal(part, whole[start:]), start
    one = ops.paged_prefill_attention(q[299:], caches[0], caches[1], table, 299, 0.125, window)
    assert torch.equal(one, whole[299:])


def test_narrow_queries_come_back_in_their_type():
    caches, scales, table = _cache(90, 2, 64, 16, torch.bfloat16, seed=3)
    q = torch.randn(90, 6, 64, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    out = ops.paged_prefill_attention(q, caches[0], caches[1], table, 0, 0.125, 0)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), _sdpa(q, caches, scales, table, 0, 0.125, 0), atol=1e-2, rtol=1e-2)


def test_bad_input_names_the_problem():
    caches, scales, table = _cache(40, 2, 64, 16, torch.float32, seed=5)
    q = torch.randn(40, 6, 64)
    with pytest.raises(RuntimeError, match="block table is too short"):
        ops.paged_prefill_attention(q, caches[0], caches[1], table[:2], 0, 0.125, 0)
    with pytest.raises(RuntimeError, match="head shapes do not match"):
        ops.paged_prefill_attention(torch.randn(40, 5, 64), caches[0], caches[1], table, 0, 0.125, 0)
    with pytest.raises(RuntimeError, match="int8 or fp8 KV cache needs its float scales"):
        codes = torch.zeros(caches[0].shape, dtype=torch.int8)
        ops.paged_prefill_attention(q, codes, codes, table, 0, 0.125, 0)
