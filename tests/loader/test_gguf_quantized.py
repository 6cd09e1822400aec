"""GGUF weights kept quantized (``quantization="gguf"``): Q4_0 / Q4_1 blocks repacked into the int4
kernel's layout reproduce the dequantized weights exactly, and the engine's outputs follow."""

from __future__ import annotations

import json

import pytest
import torch
from gguf_export import export_gguf

from pagoda import LLM, SamplingParams
from pagoda.layers import quantization
from pagoda.layers.quantization import Int4Linear, PackedWeight, int4_from_packed
from pagoda.loader.gguf import GGUFPackedWeight, iter_gguf_weights, load_gguf_model_dir
from pagoda.loader.model_loader import load_model
from pagoda.loader.resolve import resolve_model

ARCHS = ["llama", "qwen2", "qwen3"]
QTYPES = ["Q4_0", "Q4_1"]
PROMPTS = ["The quick brown fox", "Paris is the capital of", "def main():"]
# bf16 activations and bf16-rounded scales against the fp32 dequantized path, on the tiny model:
# mean |logprob difference| over the scored tokens (measured 0.0034).
BF16_LOGPROB_BOUND = 0.02


@pytest.fixture(scope="module")
def ggufs(tiny_model_dirs, tmp_path_factory) -> dict[tuple[str, str], object]:
    root = tmp_path_factory.mktemp("gguf_q4")
    files = {(arch, q): export_gguf(tiny_model_dirs[arch], root / f"{arch}-{q}.gguf", q) for arch in ARCHS for q in QTYPES}
    return {**files, ("llama", "Q8_0"): export_gguf(tiny_model_dirs["llama"], root / "llama-Q8_0.gguf", "Q8_0")}


def _config(path) -> dict:
    return json.loads((load_gguf_model_dir(path) / "config.json").read_text())


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("arch", ARCHS)
def test_repacked_blocks_are_the_dequantized_weights(arch, qtype, ggufs):
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
        if w.shape[0] % 16 == 0:
            layer = int4_from_packed([w], compute_dtype=torch.float32)
            assert torch.equal(layer.dequantize(), floats[name]), name  # bit for bit, through the kernel


@pytest.mark.parametrize("qtype", QTYPES)
def test_gguf_mode_model_holds_the_exact_weights(qtype, ggufs, monkeypatch):
    monkeypatch.setattr(quantization, "COMPUTE_DTYPE", torch.float32)
    files = resolve_model(str(ggufs["llama", qtype]))
    config = files.hf_config()
    reference = load_model(files, config, torch.float32, torch.device("cpu"), 64)
    model = load_model(files, config, torch.float32, torch.device("cpu"), 64, quantization="gguf")
    float_layers = dict(reference.named_modules())
    packed = {name: m for name, m in model.named_modules() if isinstance(m, Int4Linear)}
    assert len(packed) == 2 * 4  # merged qkv and gate/up included
    for name, layer in packed.items():
        assert torch.equal(layer.dequantize(), float_layers[name].weight), name
    assert torch.equal(model.embed_tokens.weight, reference.embed_tokens.weight)
    assert model.packed_weights == {}  # the stored blocks are not kept once packed


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


def test_gguf_mode_greedy_matches_the_dequantized_path(ggufs, monkeypatch):
    path = str(ggufs["llama", "Q4_1"])
    args = {"dtype": "float32", "kv_cache_memory": 0.02}
    want, want_lp = _run(LLM(model=path, **args), PROMPTS)
    monkeypatch.setattr(quantization, "COMPUTE_DTYPE", torch.float32)  # exact weights, fp32 activations
    exact = LLM(model=path, quantization="gguf", **args)
    assert sum(isinstance(m, Int4Linear) for m in exact.engine.core.model.modules()) == 8
    got, got_lp = _run(exact, PROMPTS)
    assert got == want
    torch.testing.assert_close(torch.tensor(got_lp), torch.tensor(want_lp), atol=1e-4, rtol=0)
    monkeypatch.setattr(quantization, "COMPUTE_DTYPE", torch.bfloat16)  # the fast path
    fast = LLM(model=path, quantization="gguf", enable_prefix_caching=False, **args)
    assert len(_run(fast, PROMPTS)[0]) == len(PROMPTS)
    # Score fp32's continuations under the fast path: close to fp32's own logprobs.
    ids = [fast.get_tokenizer().encode(p, add_special_tokens=False) + t for p, t in zip(PROMPTS, want)]
    outs = fast.generate([{"prompt_token_ids": i} for i in ids], SamplingParams(max_tokens=1, prompt_logprobs=0),
                         use_tqdm=False)
    diffs = []
    for o, toks, lps in zip(outs, want, want_lp):
        scored = [pos[t].logprob for t, pos in zip(toks, o.prompt_logprobs[-len(toks):])]
        diffs += [abs(a - b) for a, b in zip(scored, lps)]
    print(f"bf16 gguf path: mean |d logprob| {sum(diffs) / len(diffs):.4f}")
    assert sum(diffs) / len(diffs) < BF16_LOGPROB_BOUND


def test_q8_0_is_not_kept_quantized(ggufs):
    """Q8_0's 32-wide block scales have no exact form in the int8 kernel (one scale per row)."""
    path = str(ggufs["llama", "Q8_0"])
    assert not any(isinstance(w, PackedWeight) for _, w in iter_gguf_weights(path, _config(path), keep_quantized=True))
    llm = LLM(model=path, dtype="float32", kv_cache_memory=0.02, quantization="gguf")
    assert not any(isinstance(m, Int4Linear) for m in llm.engine.core.model.modules())
    want, _ = _run(LLM(model=path, dtype="float32", kv_cache_memory=0.02), PROMPTS[:1])
    assert _run(llm, PROMPTS[:1])[0] == want
