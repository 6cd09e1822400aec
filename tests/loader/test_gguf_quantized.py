"""GGUF weights kept quantized (``quantization="gguf"``): the Q4_0 / Q4_1 / Q8_0 blocks, held as stored
for pagoda's block kernels or repacked into torch's int4 layout where those cannot be built,
reproduce the dequantized weights exactly, and the engine's outputs follow."""

from __future__ import annotations

import json

import pytest
import torch
from gguf_export import export_gguf

from pagoda import LLM, SamplingParams
from pagoda.layers import quantization
from pagoda.layers.ggml_blocks import BlockEmbedding, BlockLinear
from pagoda.layers.stored_weights import PackedWeight, int4_from_packed, stacked_blocks
from pagoda.layers.torch_int_linears import Int4Linear
from pagoda.loader.gguf_model_dir import load_gguf_model_dir
from pagoda.loader.gguf_packed_weight import GGUFPackedWeight
from pagoda.loader.gguf_weights import iter_gguf_weights
from pagoda.loader.model_loader import load_model
from pagoda.loader.resolve import resolve_model

ARCHS = ["llama", "qwen2", "qwen3"]
QTYPES = ["Q4_0", "Q4_1"]
PROMPTS = ["The quick brown fox", "Paris is the capital of", "def main():"]
# The fast paths against the fp32 dequantized path, on the tiny model: mean |logprob difference|
# over the scored tokens. torch's kernels: bf16 activations and scales (measured 0.0034); block
# kernels: int8 activations per block of 32.
FAST_LOGPROB_BOUND = 0.02


@pytest.fixture(scope="module")
def ggufs(tiny_model_dirs, tmp_path_factory) -> dict[tuple[str, str], object]:
    root = tmp_path_factory.mktemp("gguf_q4")
    files = {(arch, q): export_gguf(tiny_model_dirs[arch], root / f"{arch}-{q}.gguf", q) for arch in ARCHS for q in QTYPES}
    return {**files, ("llama", "Q8_0"): export_gguf(tiny_model_dirs["llama"], root / "llama-Q8_0.gguf", "Q8_0")}


def _config(path) -> dict:
    return json.loads((load_gguf_model_dir(path) / "config.json").read_text())


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("arch", ARCHS)
def test_kept_blocks_are_the_dequantized_weights(arch, qtype, ggufs):
    path = ggufs[arch, qtype]
    config = _config(path)
    floats = dict(iter_gguf_weights(path, config))
    packed = dict(iter_gguf_weights(path, config, keep_quantized=True))
    assert set(packed) == set(floats)
    kept = {name: w for name, w in packed.items() if isinstance(w, PackedWeight)}
    assert len(kept) == sum(w.dim() == 2 for w in floats.values())  # every 2-D weight, q/k un-permuted too
    for name, w in kept.items():
        assert isinstance(w, GGUFPackedWeight) and w.shape == tuple(floats[name].shape)
        assert torch.equal(w.dequantize(), floats[name]), name
        layer = BlockLinear(*stacked_blocks([w]), w.shape[1])
        assert torch.equal(layer.dequantize(), floats[name]), name  # the stored bytes, as the kernel reads them
        if w.shape[0] % 16 == 0:
            layer = int4_from_packed([w], compute_dtype=torch.float32)
            assert torch.equal(layer.dequantize(), floats[name]), name  # bit for bit, through the kernel


def _exact_models(path):
    files = resolve_model(str(path))
    config = files.hf_config()
    reference = load_model(files, config, torch.float32, torch.device("cpu"), 64)
    return reference, load_model(files, config, torch.float32, torch.device("cpu"), 64, quantization="gguf")


def _check_exact_layers(reference, model, kind) -> None:
    float_layers = dict(reference.layers.named_modules())
    packed = {name: m for name, m in model.layers.named_modules() if isinstance(m, kind)}
    assert len(packed) == 2 * 4  # merged qkv and gate/up included
    for name, layer in packed.items():
        assert torch.equal(layer.dequantize(), float_layers[name].weight), name
    assert model.packed_weights == {}  # the loader's stored blocks are dropped once used


@pytest.mark.parametrize("qtype", QTYPES + ["Q8_0"])
def test_gguf_mode_model_holds_the_exact_blocks(qtype, ggufs):
    reference, model = _exact_models(ggufs["llama", qtype])
    _check_exact_layers(reference, model, BlockLinear)
    ids = torch.arange(0, 300, 7)
    assert isinstance(model.embed_tokens, BlockEmbedding)  # the file's token_embd blocks, rows on lookup
    assert torch.equal(model.embed_tokens(ids), reference.embed_tokens(ids))
    if reference.lm_head is None:  # tied: the head reads the embedding's blocks
        assert model.lm_head.blocks is model.embed_tokens.blocks
    float_head = reference.embed_tokens if reference.lm_head is None else reference.lm_head
    assert torch.equal(model.lm_head.dequantize(), float_head.weight)


@pytest.mark.parametrize("qtype", QTYPES)
def test_gguf_mode_model_holds_the_exact_weights_on_torch_kernels(qtype, ggufs, monkeypatch, torch_kernels_only):
    monkeypatch.setattr(quantization, "COMPUTE_DTYPE", torch.float32)
    reference, model = _exact_models(ggufs["llama", qtype])
    _check_exact_layers(reference, model, Int4Linear)
    assert torch.equal(model.embed_tokens.weight, reference.embed_tokens.weight)


def test_a_merged_layer_with_a_shard_of_another_type_stays_float(ggufs):
    """q and k as Q4_0 blocks but v dequantized (as if v were Q8_0): the merged qkv cannot pack."""
    files = resolve_model(str(ggufs["llama", "Q4_0"]))
    config = files.hf_config()
    reference = load_model(files, config, torch.float32, torch.device("cpu"), 64)
    weights = [(n, w.dequantize() if n.endswith("layers.0.self_attn.v_proj.weight") else w)
               for n, w in iter_gguf_weights(files.gguf_file, config, keep_quantized=True)]
    model = load_model(files, config, torch.float32, torch.device("cpu"), 64)  # a float model to refill
    model.load_weights(weights)
    assert "layers.0.self_attn.qkv_proj.weight" not in model.packed_weights
    assert "layers.1.self_attn.qkv_proj.weight" in model.packed_weights
    assert torch.equal(model.layers[0].self_attn.qkv_proj.weight, reference.layers[0].self_attn.qkv_proj.weight)


def _run(llm: LLM, prompts) -> tuple[list[list[int]], list[list[float]]]:
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=0)
    outs = llm.generate(prompts, params, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    logprobs = [[pos[t].logprob for t, pos in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)] for o in outs]
    return tokens, logprobs


def test_gguf_mode_greedy_matches_the_dequantized_path(ggufs, monkeypatch, torch_kernels_only):
    path = str(ggufs["llama", "Q4_1"])
    args = {"dtype": "float32", "kv_cache_memory": 0.02}
    want, want_lp = _run(LLM(model=path, **args), PROMPTS)
    monkeypatch.setattr(quantization, "COMPUTE_DTYPE", torch.float32)  # exact weights, fp32 activations
    exact = LLM(model=path, quantization="gguf", kv_cache_dtype="float32", **args)  # and cache (auto: fp16 for gguf)
    assert sum(isinstance(m, Int4Linear) for m in exact.engine.core.model.modules()) == 8
    got, got_lp = _run(exact, PROMPTS)
    assert got == want
    torch.testing.assert_close(torch.tensor(got_lp), torch.tensor(want_lp), atol=1e-4, rtol=0)
    monkeypatch.setattr(quantization, "COMPUTE_DTYPE", torch.bfloat16)  # the fast path
    _check_fast_path(LLM(model=path, quantization="gguf", enable_prefix_caching=False, **args), want, want_lp)


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
def test_gguf_mode_block_kernels_stay_close_to_the_dequantized_path(qtype, ggufs):
    path = str(ggufs["llama", qtype])
    args = {"dtype": "float32", "kv_cache_memory": 0.02}
    want, want_lp = _run(LLM(model=path, **args), PROMPTS)
    fast = LLM(model=path, quantization="gguf", enable_prefix_caching=False, **args)
    assert sum(isinstance(m, BlockLinear) for m in fast.engine.core.model.modules()) == 8 + 1  # and the head
    _check_fast_path(fast, want, want_lp)


def _check_fast_path(fast: LLM, want, want_lp) -> None:
    assert len(_run(fast, PROMPTS)[0]) == len(PROMPTS)
    # Score fp32's continuations under the fast path: close to fp32's own logprobs.
    ids = [fast.get_tokenizer().encode(p, add_special_tokens=False) + t for p, t in zip(PROMPTS, want)]
    outs = fast.generate([{"prompt_token_ids": i} for i in ids], SamplingParams(max_tokens=1, prompt_logprobs=0),
                         use_tqdm=False)
    diffs = []
    for o, toks, lps in zip(outs, want, want_lp):
        scored = [pos[t].logprob for t, pos in zip(toks, o.prompt_logprobs[-len(toks):])]
        diffs += [abs(a - b) for a, b in zip(scored, lps)]
    print(f"fast gguf path: mean |d logprob| {sum(diffs) / len(diffs):.4f}")
    assert sum(diffs) / len(diffs) < FAST_LOGPROB_BOUND


def test_q8_0_stays_float_on_torch_kernels(ggufs, torch_kernels_only):
    """Q8_0's 32-wide block scales have no exact form in torch's int8 kernel (one scale per row)."""
    path = str(ggufs["llama", "Q8_0"])
    llm = LLM(model=path, dtype="float32", kv_cache_memory=0.02, quantization="gguf")
    assert not any(isinstance(m, Int4Linear) for m in llm.engine.core.model.modules())
    want, _ = _run(LLM(model=path, dtype="float32", kv_cache_memory=0.02), PROMPTS[:1])
    assert _run(llm, PROMPTS[:1])[0] == want
