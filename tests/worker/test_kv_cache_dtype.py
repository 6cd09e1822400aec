"""--kv-cache-dtype: an fp32 model over a bf16 / fp16 KV cache holds twice the blocks in the same
budget, over an int8 or fp8 one (a scale per token and head) about 3.5 times, and stays close to the
fp32 cache's answers (its K/V rounded once, as they are written), through the C++ kernels (the
one-call decoder stack included, for bf16 / fp16) and the pure-torch fallback."""

from __future__ import annotations

import pytest

from pagoda import LLM, SamplingParams

PROMPTS = ["The quick brown fox", "def main():", "Once upon a time in a land far away there lived", "1, 2, 3,"]
PARAMS = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=0)


def answers(model, kv_cache_dtype: str) -> tuple[int, list]:
    llm = LLM(model=str(model), dtype="float32", kv_cache_memory=0.02, kv_cache_dtype=kv_cache_dtype)
    outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    return llm.engine.core.num_blocks, [o.outputs[0] for o in outs]


def assert_close_to(reference: list, outs: list, atol: float = 0.02, exact: bool = True, agree: float = 0.75) -> None:
    """The same greedy tokens, each chosen with a logprob within ``atol`` of the fp32 cache's. Not
    ``exact``: a continuation may part from the reference after a near tie (the random tiny
    model has many), but not before a share ``agree`` of the tokens overall, and the logprobs up
    to where they part stay within ``atol``."""
    same = total = 0
    for ref, out in zip(reference, outs, strict=True):
        if exact:
            assert out.token_ids == ref.token_ids
        parted = next((i for i, (x, y) in enumerate(zip(ref.token_ids, out.token_ids)) if x != y), len(ref.token_ids))
        same, total = same + parted, total + len(ref.token_ids)
        for a, b, token in zip(ref.logprobs[:parted], out.logprobs[:parted], ref.token_ids[:parted]):
            assert abs(a[token].logprob - b[token].logprob) < atol
    assert same >= agree * total


@pytest.fixture(scope="module")
def fp32_cache(tiny_llama):
    return answers(tiny_llama, "auto")


@pytest.mark.parametrize("kv_cache_dtype", ["bfloat16", "fp16"])
def test_narrower_cache_holds_twice_the_blocks_and_the_same_answers(tiny_llama, fp32_cache, kv_cache_dtype):
    blocks, reference = fp32_cache
    narrow_blocks, outs = answers(tiny_llama, kv_cache_dtype)
    assert narrow_blocks == 2 * blocks
    assert_close_to(reference, outs)


def test_narrower_cache_on_the_torch_fallback(tiny_llama, fp32_cache, torch_kernels_only):
    assert_close_to(fp32_cache[1], answers(tiny_llama, "bf16")[1])
    assert_close_to(fp32_cache[1], answers(tiny_llama, "int8")[1], atol=0.05, exact=False)
    assert_close_to(fp32_cache[1], answers(tiny_llama, "fp8")[1], atol=0.1, exact=False, agree=0.6)


@pytest.mark.parametrize("kv_cache_dtype, atol, agree", [("int8", 0.05, 0.75), ("fp8", 0.1, 0.6), ("fp8_e5m2", 0.2, 0.25)])
def test_scaled_cache(tiny_llama, fp32_cache, kv_cache_dtype, atol, agree):
    """int8, fp8 (e4m3) and fp8_e5m2: a byte a value and a 4-byte scale a row. int8 keeps ~7 bits
    of a row's largest value, e4m3 three mantissa bits (a value within 6.25 %), e5m2 two (12.5 %):
    on the random tiny model, whose choices are near ties, measured on a Sapphire Rapids (kernels
    and torch fallback alike) int8 / e4m3 / e5m2 held 89 / 83 / 39 % of the tokens with logprobs
    within 0.011 / 0.046 / 0.072; the bounds leave about twice that room for other CPUs' roundings.
    benchmarks/README.md has SmolLM2's figures."""
    import json

    blocks, reference = fp32_cache
    config = json.loads((tiny_llama / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    scaled_blocks, outs = answers(tiny_llama, kv_cache_dtype)
    assert abs(scaled_blocks / blocks - 4 * head_dim / (head_dim + 4)) < 1e-3  # 1 byte a value, a 4-byte scale a row
    assert_close_to(reference, outs, atol=atol, exact=False, agree=agree)


def test_unknown_kv_cache_dtype_is_refused(tiny_llama):
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        LLM(model=str(tiny_llama), dtype="float32", kv_cache_memory=0.02, kv_cache_dtype="int3")


def test_auto_gives_a_gguf_models_own_blocks_llama_cpps_fp16_cache(tiny_llama, tmp_path):
    """--quantization gguf (the GGUF's quantized weights, already not exact): 'auto' is fp16, as
    llama.cpp's default cache, so twice the blocks of fp32 fit in the budget; the same answers as
    an explicit fp16 cache, and close to an fp32 one's (up to where a continuation parts after a
    near tie of the random tiny model)."""
    from gguf_export import export_gguf

    path = export_gguf(tiny_llama, tmp_path / "tiny-q8_0.gguf", qtype="Q8_0")

    def run(kv_cache_dtype: str):
        with LLM(model=str(path), quantization="gguf", kv_cache_memory=0.02, kv_cache_dtype=kv_cache_dtype) as llm:
            outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
            return llm.engine.core.num_blocks, [o.outputs[0] for o in outs]

    (auto_blocks, auto), (fp16_blocks, fp16), (fp32_blocks, fp32) = run("auto"), run("fp16"), run("fp32")
    assert auto_blocks == fp16_blocks == 2 * fp32_blocks
    assert [o.token_ids for o in auto] == [o.token_ids for o in fp16]
    assert_close_to(fp32, auto, exact=False)
