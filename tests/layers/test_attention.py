"""The paged attention paths agree with plain causal attention over contiguous K/V."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagoda.forward_context import AttentionMetadata, PrefillSeq, set_attention_metadata
from pagoda.layers.attention import PagedAttention
from pagoda.layers.backend import TorchBackend
from pagoda.layers.cpu_kernels import load_cpu_kernels


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
