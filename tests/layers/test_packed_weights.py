"""Block weights packed once at load: the oneDNN bf16 copy gives block_matmul's own results from
16 rows; the copy repacked into tiles serves every row count with rows that do not depend on the batch."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pagoda.layers import packed_weights
from pagoda.layers.backend import select_backend
from pagoda.layers.cpu_kernels import load_cpu_kernels
from pagoda.layers.ggml_blocks import Q4_0, Q4_1, Q8_0, BlockLinear, quantize_q8_0
from pagoda.layers.packed_weights import (bf16_packing_applies, block_packing, pack_block_linears, packed_bytes,
                                          tiles_packing_applies)

ops = load_cpu_kernels()
APPLIES = {"bf16": bf16_packing_applies(ops), "tiles": tiles_packing_applies(ops)}
ROW_COUNTS = (1, 15, 16, 17, 64, 130, 400)  # 400 x 576: the tile GEMM takes the rows in two stretches


def _ask_for(form: str, monkeypatch) -> str:
    """Make pack_block_linears choose ``form``; skip where this build cannot make it."""
    if not APPLIES[form]:
        pytest.skip(f"this build makes no {form} copy of block weights")
    monkeypatch.setenv("PAGODA_BLOCK_PACKING", form)
    return form


@pytest.fixture(params=["bf16", "tiles"])
def form(request, monkeypatch) -> str:
    """Each packed form this build can make, asked for by name."""
    return _ask_for(request.param, monkeypatch)


def _linear(block_type: int, n: int, k: int, seed: int) -> BlockLinear:
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, k, generator=g) * 0.05
    if block_type == Q4_0:  # no float → Q4_0 quantizer: Q8_0 blocks' bytes re-read as Q4_0 blocks of 18 bytes
        blocks = torch.randint(0, 256, (n, k // 32 * 18), dtype=torch.uint8, generator=g)
        blocks.view(n, k // 32, 18)[:, :, 1] = 0x2C  # fp16 scale ~ 0.06
        return BlockLinear(blocks, Q4_0, k)
    return BlockLinear.from_float(weight, block_type)


def _layer_and_inputs(block_type: int, n: int, k: int) -> tuple[BlockLinear, dict[int, torch.Tensor]]:
    """A layer and an input for each of ROW_COUNTS."""
    xs = {m: torch.randn(m, k, generator=torch.Generator().manual_seed(m)) for m in ROW_COUNTS}
    return _linear(block_type, n, k, seed=n + block_type), xs


@pytest.fixture
def one_thread():
    """The packed copy and the per-call route are the same oneDNN GEMM on one thread. On two, its
    AMX kernels (Sapphire Rapids) divide the blocked and the plain weight's work differently, and
    at 400 rows the last bf16 bit of some outputs differs (a server takes one route, always)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("block_type", [Q4_0, Q4_1, Q8_0])
@pytest.mark.parametrize("n,k", [(96, 64), (4000, 576)])  # 4000 rows: block_matmul tiles its output
def test_bf16_copy_rows_equal_block_matmul_at_every_row_count(block_type, n, k, monkeypatch, one_thread):
    _ask_for("bf16", monkeypatch)
    lin, xs = _layer_and_inputs(block_type, n, k)
    before = {m: lin(x) for m, x in xs.items()}
    assert pack_block_linears(nn.Sequential(lin), ops, available_bytes=1 << 40) == 2 * n * k
    assert lin.packed is not None and lin.packed.dtype != torch.uint8
    for m, x in xs.items():
        assert torch.equal(lin(x), before[m]), m
    # three dimensions (a batch of sequences) go the same way
    assert torch.equal(lin(xs[64].view(4, 16, k)), before[64].view(4, 16, n))
    # under batch invariance every row count keeps the integer kernel, packed copy or not
    with select_backend("cpu").batch_invariant(True):
        packed_result = lin(xs[64])
        lin.packed = None
        assert torch.equal(lin(xs[64]), packed_result)


@pytest.mark.parametrize("block_type", [Q4_0, Q4_1, Q8_0])
# 90 and 100 outputs: a last tile of 10 and of 4 (both halves at once, and one half alone)
@pytest.mark.parametrize("n,k", [(96, 64), (90, 64), (100, 64), (4000, 576)])
def test_tiles_copy_serves_every_row_count_with_rows_that_ignore_the_batch(block_type, n, k, monkeypatch):
    _ask_for("tiles", monkeypatch)
    lin, xs = _layer_and_inputs(block_type, n, k)
    assert pack_block_linears(nn.Sequential(lin), ops, available_bytes=1 << 40) == lin.blocks.numel() // n * ((n + 15) // 16 * 16)
    assert lin.packed is not None and lin.packed.dtype == torch.uint8
    for m, x in xs.items():
        y = lin(x)
        assert torch.equal(y, ops.block_gemm_tiles(x, lin.packed, block_type, n)), m  # block_matmul took the copy
        assert torch.equal(y[:1], lin(x[:1])), m  # a row alone: the same bits
        assert torch.equal(y[-1:], lin(x[-1:])), m  # the last, in the last stretch of rows too
        with select_backend("cpu").batch_invariant(True):  # the integer kernel: the same products, its own order
            reference = ops.block_matmul(x, lin.blocks, block_type)
        assert (y - reference).abs().max() <= 1e-5 * reference.abs().max(), m
    # under batch invariance the copy still serves (its rows do not depend on M)
    with select_backend("cpu").batch_invariant(True):
        assert torch.equal(lin(xs[64]), ops.block_gemm_tiles(xs[64], lin.packed, block_type, n))


def test_a_tied_head_shares_the_packed_copy_and_memory_is_respected(form):
    blocks = quantize_q8_0(torch.randn(256, 64) * 0.05)
    head, other = BlockLinear(blocks, Q8_0, 64), BlockLinear(blocks, Q8_0, 64)
    model = nn.Sequential(head, other)
    total = packed_bytes(model, form)
    assert total == (2 * 2 * 256 * 64 if form == "bf16" else 2 * blocks.numel())
    # the copies may take a quarter of the available memory: not packed when they would pass it
    assert pack_block_linears(model, ops, available_bytes=4 * total - 1) == 0
    assert head.packed is None and other.packed is None
    assert pack_block_linears(model, ops, available_bytes=4 * total) > 0
    assert head.packed is other.packed


def test_the_engine_packs_at_load_and_answers_as_without(tiny_llama, form):
    """int8 weights (Q8_0 blocks) are packed at load. A batch of 20 decodes (the Python layers on
    the packed copies, not the one-call stack) gives, with the bf16 copy, the tokens it gives with
    the copies removed; with the tiles (the same products summed in another order), each
    prompt's tokens alone, and the tokens and (within 1e-3) logprobs of the integer kernel."""
    from pagoda import LLM, SamplingParams

    llm = LLM(model=str(tiny_llama), dtype="float32", quantization="int8", kv_cache_memory=0.05)
    model = llm.engine.core.model
    linears = [m for m in model.modules() if isinstance(m, BlockLinear)]
    assert linears and all(m.packed is not None for m in linears)
    prompts = [{"prompt_token_ids": [1 + i, 7, 3 * i % 50 + 2, 11]} for i in range(20)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0)

    def run(batch):
        outs = llm.generate(batch, params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs], [o.outputs[0].cumulative_logprob for o in outs]

    packed, packed_logprobs = run(prompts)
    if form == "tiles":
        assert packed[:4] == [run([p])[0][0] for p in prompts[:4]]
    for m in linears:
        m.packed = None
    model.choose_forward()  # the fused decode stack is built again without them
    if form == "bf16":
        assert packed == run(prompts)[0]
    else:  # alone, each prompt's rows (under 16) take the integer kernel: the same products, in its order
        alone = [run([p]) for p in prompts[:4]]
        assert packed[:4] == [tokens[0] for tokens, _ in alone]
        assert max(abs(a - b[0]) for a, (_, b) in zip(packed_logprobs, alone)) < 1e-3


def test_the_choice_is_measured_once_and_named_by_the_environment(monkeypatch):
    monkeypatch.setenv("PAGODA_BLOCK_PACKING", "neither")
    with pytest.raises(ValueError, match="PAGODA_BLOCK_PACKING='neither': this build can pack block weights as"):
        block_packing(ops)
    monkeypatch.setenv("PAGODA_BLOCK_PACKING", "none")
    lin = _linear(Q8_0, 96, 64, seed=3)
    assert pack_block_linears(nn.Sequential(lin), ops, available_bytes=1 << 40) == 0 and lin.packed is None
    monkeypatch.delenv("PAGODA_BLOCK_PACKING")
    chosen = block_packing(ops)
    if not APPLIES["tiles"]:
        assert chosen == ("bf16" if APPLIES["bf16"] else "none")
        return
    record = packed_weights.kept_record(packed_weights.BLOCK_CHOICE_FILE, packed_weights._BLOCK_VERSION,
                                        lambda: pytest.fail("measured twice"))[0]
    ms = record["ms"]
    assert chosen == record["form"] and set(ms) == {"tiles", "none"} | ({"bf16"} if APPLIES["bf16"] else set())
    fastest = min(ms, key=lambda form: ms[form]["64"])
    if chosen != fastest:  # only the tiles step aside, and only for losing at one row
        assert fastest == "tiles" and ms["tiles"]["1"] > packed_weights.ONE_ROW_MARGIN * ms["none"]["1"]


def test_dropped_copies_leave_the_blocks_serving(form):
    """drop_packed_copies (the quantizer's, before it writes weights in place) forgets a block
    copy, and the layer goes on through block_matmul as without one."""
    lin = _linear(Q8_0, 96, 64, seed=7)
    x = torch.randn(20, 64, generator=torch.Generator().manual_seed(7))
    plain = lin(x)
    assert pack_block_linears(nn.Sequential(lin), ops, available_bytes=1 << 40) > 0
    packed_weights.drop_packed_copies(nn.Sequential(lin))
    assert lin.packed is None
    assert torch.equal(lin(x), plain)
