"""F16 / BF16 GGUF weights kept as stored (layers/half_weights.py): the packed tiles hold the file's
values exactly, the GEMM sums exact products in input order on every row count, and a model served
on them gives the dequantized model's logprobs to float-order precision, and the packed weights
are kept for the next start."""

from __future__ import annotations

import pytest
import torch
from gguf_export import export_gguf

from pagoda import LLM, SamplingParams
from pagoda.layers.cpu_kernels import load_cpu_kernels
from pagoda.layers.half_weights import BF16, F16, HalfEmbedding, HalfLinear
from pagoda.loader import model_loader
from pagoda.loader.gguf_packed_weight import GGUFPackedWeight
from pagoda.loader.model_loader import load_model
from pagoda.loader.resolve import resolve_model

pytestmark = pytest.mark.skipif(load_cpu_kernels() is None, reason="pagoda's C++ kernels cannot be built here")


@pytest.mark.parametrize(("half_type", "dtype"), [(F16, torch.float16), (BF16, torch.bfloat16)])
def test_the_gemm_is_the_exact_products_summed_in_order(half_type, dtype):
    ops = load_cpu_kernels()
    g = torch.Generator().manual_seed(0)
    w = torch.randn(37, 96, generator=g).to(dtype)
    packed = ops.half_repack(w.view(torch.int16), half_type)
    assert torch.equal(ops.half_rows(packed, torch.arange(37)), w.float())
    for m in (1, 2, 3, 4, 5, 9):
        x = torch.randn(m, 96, generator=g)
        torch.testing.assert_close(ops.half_gemm(x, packed, 37), (x.double() @ w.double().T).float(),
                                   rtol=1e-5, atol=1e-5)
        assert torch.equal(ops.half_gemm(x[-1:], packed, 37), ops.half_gemm(x, packed, 37)[-1:])  # row alone = in a batch
    with pytest.raises(RuntimeError, match="the weight has 37 outputs, not 36"):
        ops.half_gemm(x, packed, 36)
    with pytest.raises(RuntimeError, match="type 2 is not F16 .1. or BF16 .30."):
        ops.half_repack(w.view(torch.int16), 2)


@pytest.mark.parametrize("qtype", ["F16", "BF16"])
def test_a_half_gguf_is_served_on_its_own_values(qtype, tiny_model_dirs, tmp_path):
    hf = tiny_model_dirs["gemma3"]  # tied embedding: the head shares the packed table
    path = export_gguf(hf, tmp_path / f"tiny-{qtype}.gguf", qtype)
    files = resolve_model(str(path))
    config = files.hf_config()
    reference = load_model(files, config, torch.float32, torch.device("cpu"), 64)
    model = load_model(files, config, torch.float32, torch.device("cpu"), 64, quantization="gguf")
    floats = dict(reference.named_modules())
    halves = {name: m for name, m in model.named_modules() if isinstance(m, HalfLinear)}
    assert len(halves) == 4 * 4 + 1  # every projection of the 4 layers, and the tied head
    for name, layer in halves.items():
        expected = floats["embed_tokens"].weight if name == "lm_head" else floats[name].weight
        assert torch.equal(layer.dequantize(), expected), name
    assert isinstance(model.embed_tokens, HalfEmbedding) and model.embed_tokens.blocks is model.lm_head.blocks
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=0, ignore_eos=True)
    exact = LLM(str(path), dtype="float32", kv_cache_memory=0.02).generate(["The quick brown fox"], params)[0]
    fast = LLM(str(path), kv_cache_memory=0.02).generate(["The quick brown fox"], params)[0]
    assert fast.outputs[0].token_ids == exact.outputs[0].token_ids
    got = [p[t].logprob for t, p in zip(fast.outputs[0].token_ids, fast.outputs[0].logprobs)]
    want = [p[t].logprob for t, p in zip(exact.outputs[0].token_ids, exact.outputs[0].logprobs)]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=1e-3, rtol=0)


def test_packed_halves_are_kept_for_the_next_start(tiny_model_dirs, tmp_path, monkeypatch):
    """As the super-block tiles: the first load writes each packed weight, the next maps them
    without reading the GGUF's values and holds the same bytes."""
    where = tmp_path / "repacked"
    monkeypatch.setattr(model_loader, "cache_directory", lambda path, rank, size: where)
    files = resolve_model(str(export_gguf(tiny_model_dirs["gemma3"], tmp_path / "tiny-F16.gguf", "F16")))
    config = files.hf_config()

    def load():
        return load_model(files, config, torch.float32, torch.device("cpu"), 64, quantization="gguf")

    first = load()
    assert len(list(where.glob("*.tiles"))) == 4 * 4 + 1  # every projection, and the tied embedding
    monkeypatch.setattr(GGUFPackedWeight, "ggml_blocks", lambda self: pytest.fail("read the GGUF's values again"))
    second = load()
    halves = [(name, m.blocks) for name, m in first.named_modules() if isinstance(m, (HalfLinear, HalfEmbedding))]
    again = dict(second.named_modules())
    for name, blocks in halves:
        assert torch.equal(again[name].blocks, blocks), name
