"""The paged attention paths agree with plain causal attention over contiguous K/V."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagoda.forward_context import AttentionMetadata, PrefillSeq, set_attention_metadata
from pagoda.layers.attention import PagedAttention
from pagoda.layers.backend import TorchBackend
from pagoda.layers.cpu_kernels import load_cpu_kernels
from pagoda.worker.kv_cache import SCALED_KV_DTYPES


def _reference(q, k, v, scale):
    """q: [Lq, Hq, D] for the last Lq positions of k/v [L, Hkv, D]; causal."""
    Lq, L = q.shape[0], k.shape[0]
    mask = torch.arange(L).unsqueeze(0) <= torch.arange(L - Lq, L).unsqueeze(1)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                         attn_mask=mask, scale=scale, enable_gqa=True)
    return out.transpose(0, 1)


@pytest.mark.parametrize("use_kernel", [True, False])
@pytest.mark.parametrize("dtype,heads", [(torch.float32, (6, 2)), (torch.float32, (4, 4)), (torch.bfloat16, (8, 2))])
def test_mixed_batch_matches_reference(use_kernel, dtype, heads):
    if use_kernel and load_cpu_kernels() is None:
        pytest.skip("no compiler for the CPU kernel here")
    torch.manual_seed(0)
    hq, hkv = heads
    D, BS, NB = 32, 4, 64
    attn = PagedAttention(hq, hkv, D, scale=D**-0.5)
    if not use_kernel:
        attn.backend = TorchBackend()
    k_cache = torch.zeros(NB, hkv, BS, D, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    attn.bind_kv_cache(k_cache, v_cache)
    free = list(torch.randperm(NB).tolist())
    # three decodes with different cached lengths, a fresh prefill, a chunk over a cached prefix
    specs = [(9, 1), (1, 1), (17, 1), (0, 7), (5, 6)]  # (cached tokens, new tokens)
    seqs = []
    for cached, new in specs:
        total = cached + new
        blocks = [free.pop() for _ in range(-(-total // BS))]
        k = torch.randn(total, hkv, D, dtype=dtype)
        v = torch.randn(total, hkv, D, dtype=dtype)
        for p in range(cached):  # what earlier steps wrote
            k_cache[blocks[p // BS], :, p % BS] = k[p]
            v_cache[blocks[p // BS], :, p % BS] = v[p]
        seqs.append((cached, new, blocks, k, v, torch.randn(new, hq, D, dtype=dtype)))
    slots, qs, ks, vs = [], [], [], []
    for cached, new, blocks, k, v, q in seqs:
        slots += [blocks[p // BS] * BS + p % BS for p in range(cached, cached + new)]
        qs.append(q), ks.append(k[cached:]), vs.append(v[cached:])
    decodes = seqs[:3]
    max_blocks = max(len(s[2]) for s in decodes)
    tables = torch.zeros(3, max_blocks, dtype=torch.long)
    for i, s in enumerate(decodes):
        tables[i, : len(s[2])] = torch.tensor(s[2])
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots), num_decodes=3, decode_block_tables=tables,
        decode_seq_lens=torch.tensor([s[0] + 1 for s in decodes]), block_size=BS,
        prefills=[PrefillSeq(3, 7, 0, torch.tensor(seqs[3][2])), PrefillSeq(10, 6, 5, torch.tensor(seqs[4][2]))],
    )
    with set_attention_metadata(meta):
        out = attn(torch.cat(qs), torch.cat(ks), torch.cat(vs)).view(-1, hq, D)
    offset = 0
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for cached, new, blocks, k, v, q in seqs:
        expected = _reference(q.float(), k.float(), v.float(), D**-0.5)
        torch.testing.assert_close(out[offset : offset + new].float(), expected, atol=tol, rtol=tol)
        offset += new


@pytest.mark.parametrize("window", [0, 11])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
def test_a_large_batch_reads_every_head_of_a_block_together_with_the_same_results(window, cache_dtype):
    """From 4 runs a thread the kernel's work items take every kv head of their rows (csrc/
    paged_attention.cpp, plan()); each row's output is then bit for bit what it is alone (one item
    per head), and matches attention over the contiguous K/V. Some rows share a cached prefix
    (grouped items), one sequence has a chunk of rows."""
    ops = load_cpu_kernels()
    if ops is None:
        pytest.skip("no compiler for the CPU kernel here")
    torch.manual_seed(0)
    hq, hkv, d, bs = 6, 3, 32, 4
    seqs = 4 * torch.get_num_threads() + 3
    lens = [int(x) for x in torch.randint(1, 40, (seqs,))]
    lens[1] = lens[0] = 30  # these two share their first blocks
    blocks_per = [-(-n // bs) for n in lens[:-1]] + [-(-(lens[-1] + 2) // bs)]  # the last has a chunk's room
    k_cache = torch.randn(sum(blocks_per), hkv, bs, d).to(cache_dtype)
    v_cache = torch.randn(k_cache.shape).to(cache_dtype)
    order = torch.randperm(k_cache.shape[0]).tolist()
    tables = torch.zeros(seqs, max(blocks_per), dtype=torch.long)
    for i, n in enumerate(blocks_per):
        tables[i, :n] = torch.tensor([order.pop() for _ in range(n)])
    tables[1, :5] = tables[0, :5]
    # a chunk: the last sequence's rows seeing lens[-1], +1 and +2 positions, consecutive in the batch
    rows_tables = torch.cat([tables, tables[-1:].expand(2, -1)])
    rows_lens = torch.tensor(lens + [lens[-1] + 1, lens[-1] + 2])
    q = torch.randn(len(rows_lens), hq, d)
    together = ops.paged_decode_attention(q, k_cache, v_cache, rows_tables, rows_lens, d**-0.5, window)
    for i in range(seqs - 1):
        alone = ops.paged_decode_attention(q[i : i + 1], k_cache, v_cache, rows_tables[i : i + 1], rows_lens[i : i + 1],
                                           d**-0.5, window)
        assert torch.equal(together[i : i + 1], alone)
        n = int(rows_lens[i])
        first = max(0, n - window) if window else 0
        pos = torch.arange(first, n)
        keys = k_cache[rows_tables[i][pos // bs], :, pos % bs].float()
        values = v_cache[rows_tables[i][pos // bs], :, pos % bs].float()
        expected = _reference(q[i : i + 1], keys, values, d**-0.5)
        torch.testing.assert_close(together[i : i + 1], expected, atol=1e-5, rtol=1e-5)
    chunk = ops.paged_decode_attention(q[-3:], k_cache, v_cache, rows_tables[-3:], rows_lens[-3:], d**-0.5, window)
    assert torch.equal(together[-3:], chunk)


HQ, HKV, D, BS, NB = 6, 2, 32, 4, 16
BLOCKS, T = [5, 2, 11], 10  # one sequence: a prefill of 9 tokens, then a decode that reads them from the cache


def _narrow_and_wide(use_kernel: bool, cache_dtype: torch.dtype) -> tuple[PagedAttention, PagedAttention]:
    """A layer over a cache of ``cache_dtype`` (an int8 or fp8 one with its scales) and one over fp32."""
    if use_kernel and load_cpu_kernels() is None:
        pytest.skip("no compiler for the CPU kernel here")
    narrow, wide = PagedAttention(HQ, HKV, D, scale=D**-0.5), PagedAttention(HQ, HKV, D, scale=D**-0.5)
    if not use_kernel:
        narrow.backend = wide.backend = TorchBackend()
    scaled = cache_dtype in SCALED_KV_DTYPES
    scales = (torch.zeros(NB, HKV, BS), torch.zeros(NB, HKV, BS)) if scaled else (None, None)
    narrow.bind_kv_cache(torch.zeros(NB, HKV, BS, D, dtype=cache_dtype), torch.zeros(NB, HKV, BS, D, dtype=cache_dtype),
                         0, *scales)
    wide.bind_kv_cache(torch.zeros(NB, HKV, BS, D), torch.zeros(NB, HKV, BS, D))
    return narrow, wide


def _prefill_then_decode_metadata() -> tuple[AttentionMetadata, AttentionMetadata]:
    slots = torch.tensor([BLOCKS[p // BS] * BS + p % BS for p in range(T)])
    prefill = AttentionMetadata(slot_mapping=slots[:9], block_size=BS, prefills=[PrefillSeq(0, 9, 0, torch.tensor(BLOCKS))])
    decode = AttentionMetadata(slot_mapping=slots[9:], num_decodes=1, decode_block_tables=torch.tensor([BLOCKS]),
                               decode_seq_lens=torch.tensor([T]), block_size=BS)
    return prefill, decode


@pytest.mark.parametrize("use_kernel", [True, False])
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16])
def test_a_narrower_cache_is_read_as_the_rounded_values(use_kernel, cache_dtype):
    """--kv-cache-dtype: fp32 queries over a bf16 / fp16 cache. Writing rounds K/V as ``.to``
    does; attending reads them widened, so the result is the fp32 path's over a float cache
    holding those rounded values (exactly, on the C++ kernels: the same float arithmetic)."""
    narrow, wide = _narrow_and_wide(use_kernel, cache_dtype)
    torch.manual_seed(1)
    k, v, q = torch.randn(T, HKV, D), torch.randn(T, HKV, D), torch.randn(T, HQ, D)
    prefill, decode = _prefill_then_decode_metadata()
    with set_attention_metadata(prefill):
        narrow(q[:9], k[:9], v[:9])
    assert torch.equal(narrow.k_cache[BLOCKS[0]], k[:4].transpose(0, 1).to(cache_dtype))
    wide.k_cache.copy_(narrow.k_cache.float())  # the wide cache holds the same rounded values
    wide.v_cache.copy_(narrow.v_cache.float())

    def rounded(x: torch.Tensor) -> torch.Tensor:
        return x.to(cache_dtype).float()

    with set_attention_metadata(decode):
        got = narrow(q[9:], k[9:], v[9:])
    with set_attention_metadata(decode):
        want = wide(q[9:], rounded(k[9:]), rounded(v[9:]))
    if use_kernel:
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


# a code's rounding error, at most: a share of the value (half a step of its mantissa) or a share
# of the row's scale (half the smallest step: int8's 1, the fp8 formats' least subnormal)
ROUNDING = {torch.int8: (0.0, 0.5), torch.float8_e4m3fn: (2.0**-4, 2.0**-10), torch.float8_e5m2: (2.0**-3, 2.0**-17)}


@pytest.mark.parametrize("use_kernel", [True, False])
@pytest.mark.parametrize("cache_dtype", list(ROUNDING), ids=str)
def test_a_scaled_cache_holds_rows_and_their_scales(use_kernel, cache_dtype):
    """--kv-cache-dtype int8 / fp8_e4m3 / fp8_e5m2: each (token, head) row of K/V is stored as
    codes with its scale (largest magnitude / the largest code), the same on the C++ kernel and
    the torch path, and attention reads codes times scales: the fp32 path over a float cache
    holding those values."""
    from pagoda.layers.backend import quantize_rows

    narrow, wide = _narrow_and_wide(use_kernel, cache_dtype)
    torch.manual_seed(2)
    k, v, q = torch.randn(T, HKV, D), torch.randn(T, HKV, D), torch.randn(T, HQ, D)
    k[3, 1] = 0.0  # a row of zeros: scale 0, values 0
    k[2, 0, :4] = torch.tensor([1e-4, -3e-3, 40.0, 1e-6])  # small values beside a large one: fp8's subnormals
    prefill, decode = _prefill_then_decode_metadata()
    with set_attention_metadata(prefill):
        narrow(q[:9], k[:9], v[:9])
    values, scales = quantize_rows(k[:4], cache_dtype)
    assert values.dtype == cache_dtype
    assert torch.equal(narrow.k_cache[BLOCKS[0]].view(torch.uint8), values.transpose(0, 1).view(torch.uint8))
    assert torch.equal(narrow.k_scales[BLOCKS[0]], scales.transpose(0, 1)) and narrow.k_scales[BLOCKS[0], 1, 3] == 0
    relative, absolute = ROUNDING[cache_dtype]
    error = (k[:4] - values.float() * scales.unsqueeze(-1)).abs()
    assert (error <= relative * k[:4].abs() + absolute * scales.unsqueeze(-1) + 1e-7).all()
    wide.k_cache.copy_(narrow.k_cache.float() * narrow.k_scales.unsqueeze(-1))
    wide.v_cache.copy_(narrow.v_cache.float() * narrow.v_scales.unsqueeze(-1))

    def dequantized(x: torch.Tensor) -> torch.Tensor:
        values, scales = quantize_rows(x, cache_dtype)
        return values.float() * scales.unsqueeze(-1)

    with set_attention_metadata(decode):
        got = narrow(q[9:], k[9:], v[9:])
    with set_attention_metadata(decode):
        want = wide(q[9:], dequantized(k[9:]), dequantized(v[9:]))
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
def test_the_kernel_widens_every_fp8_code_as_torch_does(cache_dtype):
    """Every finite fp8 code (normal, subnormal, both zeros), read by the paged kernel from a
    cache's values at a row of one position (the output is that row times its scale), equals
    torch's own conversion: the kernel's fp16 route (kv_codes.h) is exact, in its vector paths
    and the scalar tail alike (D = 283: four 64-wide AVX-512 chunks, 16 and 8 by AVX2, 3 scalar)."""
    ops = load_cpu_kernels()
    if ops is None:
        pytest.skip("no compiler for the CPU kernel here")
    codes = torch.arange(256, dtype=torch.uint8).view(cache_dtype)
    codes = codes[codes.float().isfinite()]
    d = 283
    row = torch.cat([codes, codes[: d - len(codes)]])
    v_cache = torch.zeros(1, 1, BS, d, dtype=cache_dtype)
    v_cache[0, 0, 0] = row
    scale = 0.375
    k_scales, v_scales = torch.ones(1, 1, BS), torch.full((1, 1, BS), scale)
    out = ops.paged_decode_attention(torch.randn(1, 1, d), torch.zeros_like(v_cache), v_cache, torch.tensor([[0]]),
                                     torch.tensor([1]), 1.0, 0, k_scales, v_scales)
    assert torch.equal(out[0, 0], row.float() * scale)
