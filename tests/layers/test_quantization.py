"""Weight-only quantization (pagoda/layers/quantization.py): a quantized output head sharing a tied
embedding, the engine end to end on the tiny model within stated bounds (with pagoda's block
kernels, and on torch's kernels where those cannot be built), and the errors for bad settings.
The layers on torch's kernels: tests/layers/test_torch_int_linears.py; the block format itself:
tests/layers/test_ggml_blocks.py."""

from __future__ import annotations

import math

import pytest
import torch
from tiny_models import make_tiny_hf_model

from pagoda import LLM, SamplingParams
from pagoda.config import create_engine_config
from pagoda.engine_args import EngineArgs
from pagoda.layers import ggml_blocks
from pagoda.layers.ggml_blocks import BlockEmbedding, BlockLinear
from pagoda.layers.quantization import check_quantization, quantize_linears, weight_bytes
from pagoda.layers.torch_int_linears import Int4Linear, Int8Embedding, Int8Linear

# Bounds on the tiny random model (hidden 64, weights ~ N(0, 0.08)), measured well inside them:
# mean |logprob - fp32 logprob| over the prompt tokens, and the relative change of perplexity.
# Block kernels: Q8_0 / Q4_1 weights, the tied head in Q8_0, and activations in int8 per block of 32.
LOGPROB_BOUND = {("torch", "int8"): 0.02, ("torch", "int4"): 0.2, ("blocks", "int8"): 0.02, ("blocks", "int4"): 0.2}
PPL_BOUND = {("torch", "int8"): 0.01, ("torch", "int4"): 0.1, ("blocks", "int8"): 0.01, ("blocks", "int4"): 0.1}
TEXT = ("Paris is the capital of France. Berlin is the capital of Germany. The quick brown fox jumps over "
        "the lazy dog. Once upon a time there was a little engine that could.")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def _tied_model(tmp_path):
    from pagoda.loader.model_loader import load_model
    from pagoda.loader.resolve import resolve_model

    files = resolve_model(str(make_tiny_hf_model("llama", tmp_path / "tied", seed=3, tie_word_embeddings=True)))
    return load_model(files, files.hf_config(), torch.float32, torch.device("cpu"), 64)


def _check_quantized_head(model, quantize) -> None:
    ids = torch.tensor([5, 17, 42])
    before_bytes = weight_bytes(model)
    embed = model.embed_tokens.weight.detach().clone()
    hidden = torch.randn(3, embed.shape[1])
    logits = model.compute_logits(hidden)
    quantize()
    assert weight_bytes(model) < before_bytes / 3
    assert _rel(model.embed_tokens(ids), embed[ids]) < 0.02
    assert _rel(model.compute_logits(hidden), logits) < 0.02


def test_quantized_head_shares_a_tied_embedding(tmp_path, torch_kernels_only):
    model = _tied_model(tmp_path)
    _check_quantized_head(model, lambda: quantize_linears(model, "int8", quantize_head=True))
    assert isinstance(model.embed_tokens, Int8Embedding) and isinstance(model.lm_head, Int8Linear)
    assert model.embed_tokens.qweight is model.lm_head.qweight  # one int8 table for both


def test_block_head_shares_a_tied_embedding(tmp_path):
    model = _tied_model(tmp_path)
    _check_quantized_head(model, lambda: quantize_linears(model, "int4"))  # the head is Q8_0 by default
    assert isinstance(model.embed_tokens, BlockEmbedding) and isinstance(model.lm_head, BlockLinear)
    assert model.embed_tokens.blocks is model.lm_head.blocks  # one Q8_0 table for both
    assert model.lm_head.block_type == ggml_blocks.Q8_0
    assert model.layers[0].mlp.down_proj.block_type == ggml_blocks.Q4_1
    float_head = _tied_model(tmp_path)
    quantize_linears(float_head, "int8", quantize_head=False)
    assert isinstance(float_head.embed_tokens, torch.nn.Embedding) and float_head.lm_head is None


# --- the engine end to end ----------------------------------------------------------------------


def _prompt_logprobs(llm: LLM, ids: list[int]) -> list[float]:
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    return [pos[tok].logprob for tok, pos in zip(ids[1:], out[0].prompt_logprobs[1:])]


def _tiny_llm(model_dir, quantization=None) -> LLM:
    # No prefix caching: a cache hit would skip the prompt logprobs of the cached positions.
    return LLM(model=str(model_dir), dtype="float32", kv_cache_memory=0.02, quantization=quantization,
               enable_prefix_caching=False)


@pytest.fixture(scope="module")
def fp32_reference(tiny_llama) -> tuple[list[int], list[float]]:
    llm = _tiny_llm(tiny_llama)
    ids = llm.get_tokenizer().encode(TEXT, add_special_tokens=False)
    return ids, _prompt_logprobs(llm, ids)


@pytest.fixture(params=["blocks", "torch"])
def kernels(request) -> str:
    """Both implementations of the modes: pagoda's block kernels, and torch's (no compiler)."""
    if request.param == "torch":
        request.getfixturevalue("torch_kernels_only")
    return request.param


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_engine_stays_within_bounds(mode, kernels, tiny_llama, fp32_reference):
    ids, ref = fp32_reference
    llm = _tiny_llm(tiny_llama, mode)
    kinds = (BlockLinear,) if kernels == "blocks" else (Int8Linear, Int4Linear)
    layers = [m for m in llm.engine.core.model.layers.modules() if isinstance(m, kinds)]
    assert len(layers) == 2 * 4  # qkv, o, gate_up, down in both layers
    got = _prompt_logprobs(llm, ids)
    mean_diff = sum(abs(a - b) for a, b in zip(ref, got)) / len(ref)
    ppl_ref, ppl = math.exp(-sum(ref) / len(ref)), math.exp(-sum(got) / len(got))
    print(f"{kernels} {mode}: mean |d logprob| {mean_diff:.4f}, perplexity {ppl_ref:.3f} -> {ppl:.3f}")
    assert mean_diff < LOGPROB_BOUND[kernels, mode]
    assert abs(ppl / ppl_ref - 1) < PPL_BOUND[kernels, mode]
    out = llm.generate(["The quick brown fox"], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 8


# --- settings -----------------------------------------------------------------------------------


def test_check_quantization_names_the_choices():
    assert check_quantization(None) is None and check_quantization("none") is None
    assert check_quantization("INT8") == "int8"
    with pytest.raises(ValueError, match=r"quantization must be one of none, int8, int4, gguf; got 'fp8'"):
        check_quantization("fp8")


def test_engine_args_reject_bad_quantization(tiny_llama):
    with pytest.raises(ValueError, match="quantization must be one of"):
        create_engine_config(EngineArgs(model=str(tiny_llama), quantization="awq"))
    with pytest.raises(ValueError, match="quantization='gguf'.*not a GGUF"):
        create_engine_config(EngineArgs(model=str(tiny_llama), quantization="gguf"))
    with pytest.raises(ValueError, match="needs device 'cpu'"):
        create_engine_config(EngineArgs(model=str(tiny_llama), quantization="int8", device="cuda"))
    config = create_engine_config(EngineArgs(model=str(tiny_llama), quantization="int4"))
    assert config.model.quantization == "int4"


def test_cli_flag_reaches_engine_args():
    from pagoda.cli import build_parser

    ns = build_parser().parse_args(["generate", "hi", "--quantization", "int8"])
    assert EngineArgs.from_cli_args(ns).quantization == "int8"
    assert EngineArgs.from_cli_args(build_parser().parse_args(["generate", "hi"])).quantization is None
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "hi", "--quantization", "int3"])

