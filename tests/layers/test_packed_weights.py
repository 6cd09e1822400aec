"""Block weights packed once at load for the many-row GEMM give block_matmul's own results."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pagoda.layers import packed_weights
from pagoda.layers.backend import select_backend
from pagoda.layers.cpu_kernels import load_cpu_kernels
from pagoda.layers.ggml_blocks import Q4_0, Q4_1, Q8_0, BlockLinear, quantize_q8_0
from pagoda.layers.packed_weights import pack_block_linears, packed_bytes, packing_applies

ops = load_cpu_kernels()
pytestmark = pytest.mark.skipif(not packing_applies(ops),
                                reason="this build's many-row route is not a bf16 GEMM (no AVX512-BF16 / AMX)")


def _linear(block_type: int, n: int, k: int, seed: int) -> BlockLinear:
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, k, generator=g) * 0.05
    if block_type == Q4_0:  # no float → Q4_0 quantizer: Q8_0 blocks' bytes re-read as Q4_0 blocks of 18 bytes
        blocks = torch.randint(0, 256, (n, k // 32 * 18), dtype=torch.uint8, generator=g)
        blocks.view(n, k // 32, 18)[:, :, 1] = 0x2C  # fp16 scale ~ 0.06
        return BlockLinear(blocks, Q4_0, k)
    return BlockLinear.from_float(weight, block_type)


@pytest.mark.parametrize("block_type", [Q4_0, Q4_1, Q8_0])
@pytest.mark.parametrize("n,k", [(96, 64), (4000, 576)])  # 4000 rows: block_matmul tiles its output
def test_packed_rows_equal_block_matmul_at_every_row_count(block_type, n, k):
    lin = _linear(block_type, n, k, seed=n + block_type)
    xs = {m: torch.randn(m, k, generator=torch.Generator().manual_seed(m)) for m in (1, 15, 16, 17, 64, 130)}
    before = {m: lin(x) for m, x in xs.items()}
    assert pack_block_linears(nn.Sequential(lin), ops, available_bytes=1 << 40) == 2 * n * k
    assert lin.packed is not None
    for m, x in xs.items():
        assert torch.equal(lin(x), before[m]), m
    # three dimensions (a batch of sequences) go the same way
    assert torch.equal(lin(xs[64].view(4, 16, k)), before[64].view(4, 16, n))
    # under batch invariance every row count keeps the integer kernel, packed copy or not
    with select_backend("cpu").batch_invariant(True):
        packed_result = lin(xs[64])
        lin.packed = None
        assert torch.equal(lin(xs[64]), packed_result)


def test_a_tied_head_shares_the_packed_copy_and_memory_is_respected():
    blocks = quantize_q8_0(torch.randn(256, 64) * 0.05)
    head, other = BlockLinear(blocks, Q8_0, 64), BlockLinear(blocks, Q8_0, 64)
    model = nn.Sequential(head, other)
    assert packed_bytes(model) == 2 * 2 * 256 * 64
    # the copies may take a quarter of the available memory: not packed when they would pass it
    assert pack_block_linears(model, ops, available_bytes=4 * packed_bytes(model) - 1) == 0
    assert head.packed is None and other.packed is None
    assert pack_block_linears(model, ops, available_bytes=4 * packed_bytes(model)) > 0
    assert head.packed is other.packed


def test_the_engine_packs_at_load_and_answers_as_without(tiny_llama):
    """int8 weights (Q8_0 blocks) are packed at load; a batch of 20 decodes (the Python layers
    on the packed copies, not the one-call stack) gives the tokens it gives with them removed."""
    from pagoda import LLM, SamplingParams

    llm = LLM(model=str(tiny_llama), dtype="float32", quantization="int8", kv_cache_memory=0.05)
    model = llm.engine.core.model
    linears = [m for m in model.modules() if isinstance(m, BlockLinear)]
    assert linears and all(m.packed is not None for m in linears)
    prompts = [[1 + i, 7, 3 * i % 50 + 2, 11] for i in range(20)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    packed = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
    for m in linears:
        m.packed = None
    model._stack_key = None  # the stack is built again: no row limit now
    plain = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
    assert packed == plain



def test_dropped_copies_leave_the_blocks_serving():
    """drop_packed_copies (the quantizer's, before it writes weights in place) forgets a block
    copy, and the layer goes on through block_matmul as without one."""
    lin = _linear(Q8_0, 96, 64, seed=7)
    x = torch.randn(20, 64, generator=torch.Generator().manual_seed(7))
    plain = lin(x)
    assert pack_block_linears(nn.Sequential(lin), ops, available_bytes=1 << 40) > 0
    packed_weights.drop_packed_copies(nn.Sequential(lin))
    assert lin.packed is None
    assert torch.equal(lin(x), plain)
