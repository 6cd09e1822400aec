"""The CPU kernels give a row the same bits whatever else shares the call (batch invariance):
pagoda::linear at any M, and paged attention for a token whether it is a decode, one row of a
prefill chunk, or in a tile with other rows of its sequence."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagoda.layers.backend import select_backend
from pagoda.layers.cpu_kernels import load_cpu_kernels

pytestmark = pytest.mark.skipif(load_cpu_kernels() is None, reason="pagoda's C++ kernels cannot be built here")


@pytest.mark.parametrize("K,N", [(576, 70), (100, 37), (64, 1)])  # K % 16 != 0: the scalar tail
def test_linear_rows_do_not_depend_on_the_batch(K, N):
    ops = load_cpu_kernels()
    g = torch.Generator().manual_seed(K + N)
    w = torch.randn(N, K, generator=g)
    probe = torch.randn(3, K, generator=g)  # three rows whose results must never change
    with select_backend("cpu").batch_invariant(True):
        alone = ops.linear(probe, w)
        for i in range(3):
            assert torch.equal(ops.linear(probe[i : i + 1], w), alone[i : i + 1])
        for M in list(range(1, 40)) + [63, 64, 65, 127, 128, 129, 200, 255, 256, 300]:
            x = torch.randn(M, K, generator=g)
            where = torch.randperm(M, generator=g)[: min(3, M)]
            x[where] = probe[: len(where)]
            y = ops.linear(x, w)
            assert torch.equal(y[where], alone[: len(where)]), f"M={M}"
            if M in (1, 33, 300):
                torch.testing.assert_close(y, F.linear(x, w), rtol=1e-5, atol=1e-4)
    with select_backend("cpu").batch_invariant(False):  # the default: up to 32 rows still this kernel, so the same bits
        assert torch.equal(ops.linear(probe, w), alone)


def test_linear_threads_do_not_change_rows():
    ops = load_cpu_kernels()
    x, w = torch.randn(97, 576), torch.randn(300, 576)
    before = torch.get_num_threads()
    try:
        with select_backend("cpu").batch_invariant(True):
            torch.set_num_threads(1)
            one = ops.linear(x, w)
            torch.set_num_threads(max(2, before))
            assert torch.equal(ops.linear(x, w), one)
    finally:
        torch.set_num_threads(before)


def _cache(num_blocks, hkv, bs, d, generator):
    k = torch.randn(num_blocks, hkv, bs, d, generator=generator)
    return k, torch.randn(num_blocks, hkv, bs, d, generator=generator)


@pytest.mark.parametrize("bs,hq,hkv,d", [(16, 9, 3, 64), (8, 4, 2, 16), (4, 6, 2, 20)])
def test_paged_attention_rows_do_not_depend_on_tiling(bs, hq, hkv, d):
    """A sequence of L tokens: each position attended alone (a decode row), as part of its whole
    prompt (rows 0..L-1), as the tail of the prompt after a cached prefix, and mixed with other
    sequences' rows, always gives the same bits; and it matches causal SDPA closely."""
    ops = load_cpu_kernels()
    g = torch.Generator().manual_seed(bs * d)
    L, nb = 45, 64
    k_cache, v_cache = _cache(nb, hkv, bs, d, g)
    blocks = torch.randperm(nb, generator=g)[: -(-L // bs)]
    table = blocks.unsqueeze(0)
    q = torch.randn(L, hq, d, generator=g)
    scale = d**-0.5

    def run(rows, tables, lens):
        return ops.paged_decode_attention(q[rows].contiguous(), k_cache, v_cache, tables, lens, scale)

    full = run(list(range(L)), table.expand(L, -1).contiguous(), torch.arange(1, L + 1))
    for p in (0, 1, 7, 8, 9, 16, 31, 44):
        alone = run([p], table, torch.tensor([p + 1]))
        assert torch.equal(alone[0], full[p]), p
    tail = run(list(range(30, L)), table.expand(L - 30, -1).contiguous(), torch.arange(31, L + 1))
    assert torch.equal(tail, full[30:])
    # interleaved with rows of another sequence (other blocks), in another order
    other = torch.randperm(nb, generator=g)[:3]
    rows, tables, lens = [], [], []
    for p in range(L - 1, -1, -3):
        rows += [p, 0]
        tables += [blocks, torch.cat([other, blocks[3:]])[: len(blocks)]]
        lens += [p + 1, 5]
    mixed = run(rows, torch.stack(tables), torch.tensor(lens))
    assert torch.equal(mixed[0::2], full[list(range(L - 1, -1, -3))])
    # close to causal attention over the contiguous K/V
    keys = k_cache[blocks].transpose(1, 2).reshape(-1, hkv, d)[:L]
    values = v_cache[blocks].transpose(1, 2).reshape(-1, hkv, d)[:L]
    ref = F.scaled_dot_product_attention(q.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),
                                         is_causal=True, scale=scale, enable_gqa=True).transpose(0, 1)
    torch.testing.assert_close(full, ref, rtol=1e-4, atol=1e-5)


def test_rows_sharing_a_cached_prefix_read_it_together_with_the_same_bits():
    """Many sequences whose tables begin with the same blocks (a shared system prompt): the kernel
    groups their rows and reads those blocks once for all of them. Each row's bits are those it
    gets alone, and those it gets when every sequence holds a private copy of the prefix (nothing
    to share); the rows also match causal SDPA closely."""
    ops = load_cpu_kernels()
    g = torch.Generator().manual_seed(7)
    bs, hq, hkv, d = 16, 9, 3, 64
    prefix_blocks, own_blocks, num_seqs = 20, 3, 24
    nb = prefix_blocks * (num_seqs + 1) + own_blocks * num_seqs
    k_cache, v_cache = _cache(nb, hkv, bs, d, g)
    order = torch.randperm(nb, generator=g)
    shared = order[:prefix_blocks]
    copies = order[prefix_blocks : prefix_blocks * (num_seqs + 1)].view(num_seqs, prefix_blocks)
    own = order[prefix_blocks * (num_seqs + 1) :].view(num_seqs, own_blocks)
    for c in copies:  # private copies hold the same keys and values
        k_cache[c], v_cache[c] = k_cache[shared], v_cache[shared]
    rows, shared_tables, private_tables, lens = [], [], [], []
    for s in range(num_seqs):
        length = prefix_blocks * bs + 1 + 5 * s % (own_blocks * bs - 1)
        # even sequences decode one token; odd ones prefill a short tail of 1-6 rows
        for r in range(1 if s % 2 == 0 else 1 + s % 6):
            lens.append(length - r)
            shared_tables.append(torch.cat([shared, own[s]]))
            private_tables.append(torch.cat([copies[s], own[s]]))
            rows.append(len(rows))
    lens = torch.tensor(lens)
    q = torch.randn(len(rows), hq, d, generator=g)
    scale = d**-0.5
    together = ops.paged_decode_attention(q, k_cache, v_cache, torch.stack(shared_tables), lens, scale)
    private = ops.paged_decode_attention(q, k_cache, v_cache, torch.stack(private_tables), lens, scale)
    assert torch.equal(together, private)
    for i in (0, 1, 5, len(rows) - 1):
        alone = ops.paged_decode_attention(q[i : i + 1], k_cache, v_cache, shared_tables[i].unsqueeze(0), lens[i : i + 1], scale)
        assert torch.equal(alone[0], together[i]), i
        table = shared_tables[i]
        keys = k_cache[table].transpose(1, 2).reshape(-1, hkv, d)[: lens[i]]
        values = v_cache[table].transpose(1, 2).reshape(-1, hkv, d)[: lens[i]]
        ref = F.scaled_dot_product_attention(q[i].unsqueeze(1), keys.transpose(0, 1), values.transpose(0, 1),
                                             scale=scale, enable_gqa=True).squeeze(1)
        torch.testing.assert_close(together[i], ref, rtol=1e-4, atol=1e-5)


def test_a_long_chunk_over_a_long_prefix_is_cut_into_shorter_runs_with_the_same_bits():
    """Rows seeing ~6,000 positions: 16 rows' scores would pass the kernel's per-run budget, so it
    cuts the chunk into shorter runs (and groups them over the shared prefix); rows keep their bits."""
    ops = load_cpu_kernels()
    g = torch.Generator().manual_seed(11)
    bs, hq, hkv, d, L, chunk = 16, 9, 3, 64, 6000, 40
    nb = -(-L // bs)
    k_cache, v_cache = _cache(nb + 2, hkv, bs, d, g)
    table = torch.randperm(nb + 2, generator=g)[:nb]
    q = torch.randn(chunk, hq, d, generator=g)
    lens = torch.arange(L - chunk + 1, L + 1)
    full = ops.paged_decode_attention(q, k_cache, v_cache, table.expand(chunk, -1).contiguous(), lens, d**-0.5)
    for i in (0, 15, 16, chunk - 1):
        alone = ops.paged_decode_attention(q[i : i + 1], k_cache, v_cache, table.unsqueeze(0), lens[i : i + 1], d**-0.5)
        assert torch.equal(alone[0], full[i]), i


@pytest.mark.parametrize("block_type", [2, 8])  # Q4_0, Q8_0
def test_block_matmul_rows_do_not_depend_on_the_batch(block_type):
    """Under batch invariance block_matmul keeps its integer kernel at any M (no switch to the
    dequantized GEMM at 128 rows)."""
    ops = load_cpu_kernels()
    g = torch.Generator().manual_seed(block_type)
    bb = {2: 18, 8: 34}[block_type]
    N, K = 40, 64
    w = torch.randint(0, 256, (N, K // 32 * bb), dtype=torch.uint8, generator=g)
    w.view(N, K // 32, bb)[:, :, 1] = 0x3C  # fp16 scale: a sane exponent (0x3Cxx ~ 1.x)
    w.view(N, K // 32, bb)[:, :, 0] = 0
    probe = torch.randn(1, K, generator=g)
    with select_backend("cpu").batch_invariant(True):
        alone = ops.block_matmul(probe, w, block_type)
        for M in (1, 5, 127, 128, 300):
            x = torch.randn(M, K, generator=g)
            x[M // 2] = probe[0]
            assert torch.equal(ops.block_matmul(x, w, block_type)[M // 2], alone[0]), M
