"""Float32 weights packed once at load for oneDNN's GEMM (layers/packed_weights.py): used from 33
rows, never under batch invariance, kept within memory, and answering as the plain weights do."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from pagoda.layers import packed_weights
from pagoda.layers.backend import select_backend
from pagoda.layers.cpu_kernels import load_cpu_kernels
from pagoda.layers.packed_weights import measure_float_gemm, pack_float_linears, packed_of

ops = load_cpu_kernels()
needs_kernels = pytest.mark.skipif(ops is None, reason="the C++ kernels did not build here")


@needs_kernels
def test_float_rows_take_the_packed_copy_only_past_32_rows_and_never_under_batch_invariance():
    g = torch.Generator().manual_seed(3)
    weight = torch.randn(200, 96, generator=g) * 0.05
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, 64)
    for m in (1, 32, 33, 64, 130):
        x = torch.randn(m, 96, generator=g)
        own = ops.linear(x, weight)
        with_copy = ops.linear(x, weight, packed)
        if m <= 32:  # pagoda::linear's own kernel, the copy unused
            assert torch.equal(with_copy, own), m
        else:  # oneDNN's sums: other rounding, the same products
            torch.testing.assert_close(with_copy, x @ weight.T, rtol=1e-5, atol=1e-5)
        with select_backend("cpu").batch_invariant(True):
            assert torch.equal(ops.linear(x, weight, packed), ops.linear(x, weight)), m


def test_the_float_measurement_is_kept_and_read_back(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGODA_HOME", str(tmp_path))
    calls = []
    monkeypatch.setattr(packed_weights, "measure_float_gemm", lambda: calls.append(1) or measure_float_gemm())
    first = packed_weights.float_packing_pays()
    assert packed_weights.float_choice_path().is_file()
    assert packed_weights.float_packing_pays() == first and calls == [1]  # read from the file: measured once
    record = json.loads(packed_weights.float_choice_path().read_text())
    assert record["pack"] == first and set(record["ms"]) == {"at::linear", "onednn_packed"}
    assert all(ms > 0 for ms in record["ms"].values())


@needs_kernels
def test_float_packing_respects_memory_the_switch_and_a_tied_head(monkeypatch):
    monkeypatch.setattr(packed_weights, "float_packing_pays", lambda: True)  # whatever this CPU measured

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed_tokens = nn.Embedding(64, 32)
            self.proj = nn.Linear(32, 32, bias=False)
            self.biased = nn.Linear(32, 32)  # project() leaves a bias to nn.Linear: not packed
            self.lm_head = None

    model = Tied()
    size = 4 * (64 * 32 + 32 * 32)
    assert pack_float_linears(model, ops, available_bytes=4 * size - 1) == 0
    assert packed_of(model.proj) is None
    monkeypatch.setenv("PAGODA_PACK_WEIGHTS", "0")
    assert pack_float_linears(model, ops, available_bytes=1 << 40) == 0
    monkeypatch.delenv("PAGODA_PACK_WEIGHTS")
    assert pack_float_linears(model, ops, available_bytes=4 * size) == size
    assert packed_of(model.proj) is not None and packed_of(model.embed_tokens) is not None
    assert packed_of(model.biased) is None


@needs_kernels
def test_the_engine_with_packed_float_weights_answers_as_without(tiny_llama, monkeypatch):
    """fp32 with the copies made at load (forced, whatever this CPU measured): 40 prompts decode
    at 40 rows through the one-call stack on the copies, and give the tokens of the plain weights."""
    from pagoda import LLM, SamplingParams

    monkeypatch.setattr(packed_weights, "float_packing_pays", lambda: True)
    llm = LLM(model=str(tiny_llama), dtype="float32", kv_cache_memory=0.05)
    model = llm.engine.core.model
    linears = [m for m in model.modules() if type(m) is nn.Linear]
    assert linears and all(packed_of(m) is not None for m in linears)
    prompts = [[1 + i, 7, 3 * i % 50 + 2, 11] * 10 for i in range(40)]  # 40-token prompts: prefill rows past 32
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    packed = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
    for m in linears:
        del m.packed
    model.choose_forward()  # the fused decode stack is built again, without the copies
    plain = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
    assert packed == plain


@needs_kernels
@pytest.mark.parametrize("m", [1, 17, 255, 256, 257, 600])
def test_onednn_rows_go_in_padded_tiles_and_come_back_whole(m):
    """csrc/ops.h in_row_tiles: tiles of 256 rows, the last padded to a multiple of 16."""
    g = torch.Generator().manual_seed(m)
    weight = torch.randn(80, 64, generator=g)
    x = torch.randn(m, 64, generator=g)
    y = ops.onednn_linear(x, torch.ops.mkldnn._reorder_linear_weight(weight, 64))
    assert y.shape == (m, 80) and y.is_contiguous()
    torch.testing.assert_close(y, x @ weight.T, rtol=1e-4, atol=1e-4)


@needs_kernels
def test_dropped_copies_let_weights_written_in_place_count(monkeypatch):
    monkeypatch.setattr(packed_weights, "float_packing_pays", lambda: True)
    lin = nn.Linear(64, 48, bias=False)
    model = nn.Sequential(lin)
    assert pack_float_linears(model, ops, available_bytes=1 << 40) > 0
    x = torch.randn(40, 64)  # past 32 rows: the packed copy's route
    backend = select_backend("cpu")
    with torch.no_grad():
        lin.weight.data.mul_(2)
    stale = backend.linear(x, lin.weight, packed_of(lin))
    torch.testing.assert_close(stale * 2, x @ lin.weight.T, rtol=1e-4, atol=1e-4)  # the copy kept the old values
    packed_weights.drop_packed_copies(model)
    assert packed_of(lin) is None
    torch.testing.assert_close(backend.linear(x, lin.weight, packed_of(lin)), x @ lin.weight.T, rtol=1e-4, atol=1e-4)
