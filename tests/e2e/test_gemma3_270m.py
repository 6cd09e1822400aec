"""The real Gemma 3 270M (Q4_K_M GGUF from the catalog), end to end: greedy output equals
transformers' on the same dequantized weights through ``generate`` (a prompt past the 512-token
window included) and ``chat``; the GGUF fast path stays with it; the server answers as the
offline engine does."""

from __future__ import annotations

import pytest
import torch

from pagoda import LLM, SamplingParams

# The base model's GGUF has no chat template: Gemma's turn format, given to the engine.
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<start_of_turn>"
    "{{ 'model' if message['role'] == 'assistant' else message['role'] }}\n{{ message['content'] | trim }}"
    "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
SHORT = "The capital of France is"
# ~600 tokens: the local layers' 512-token window is in play for the last ~90 positions and the decodes
LONG = ("The history of the city goes back many centuries. " * 6 + "Each year, more people arrive. ") * 9 + \
    "In summary, the capital of France is"
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def gemma(gemma3_gguf):
    return LLM(model=str(gemma3_gguf), dtype="float32", kv_cache_memory=0.25, chat_template=GEMMA_TEMPLATE)


@pytest.fixture(scope="module")
def reference_model(gemma):
    """transformers' Gemma 3 on the same dequantized weights."""
    import transformers

    from pagoda.loader.gguf_weights import iter_gguf_weights

    files = gemma.engine.config.model.files
    config = transformers.AutoConfig.from_pretrained(files.metadata_dir)
    assert config.sliding_window == 512 and config.layer_types.count("full_attention") == 3
    with _no_init():  # every weight is loaded next: skip the random init (~10 s here)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    missing, unexpected = model.load_state_dict(dict(iter_gguf_weights(files.gguf_file, files.hf_config())), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    model.tie_weights()
    return model


def _no_init():
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # older transformers
        import contextlib

        return contextlib.nullcontext()
    return no_init_weights()


def _greedy(model, ids: list[int], n: int, eos: list[int] | None = None) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=eos,
                             **({} if eos else {"min_new_tokens": n}))
    return out[0, len(ids):].tolist()


def test_generate_equals_transformers(gemma, reference_model):
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = gemma.generate([SHORT, LONG], params, use_tqdm=False)
    assert 512 < len(outs[1].prompt_token_ids) < 700
    for out in outs:
        assert out.outputs[0].token_ids == _greedy(reference_model, out.prompt_token_ids, MAX_TOKENS)


def test_chat_equals_transformers(gemma, reference_model):
    out = gemma.chat(QUESTION, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0]
    ids = out.prompt_token_ids
    assert ids[:4] == [2, 105, 2364, 107]  # <bos> <start_of_turn> user \n: one BOS, Gemma's turn
    ref = _greedy(reference_model, ids, 12, eos=gemma.get_tokenizer().eos_token_ids)
    got = out.outputs[0].token_ids
    assert got == ref[: len(got)] and (len(got) == len(ref) or out.outputs[0].finish_reason == "stop")
    # (the base model, not the instruction-tuned one: what it answers is beside the point)


def test_gguf_fast_path_agrees(gemma3_gguf, gemma):
    """--quantization gguf keeps what it can multiply as stored: here the Q8_0 embedding, shared
    by the tied head (the Q5_0 / Q4_K / Q6_K projections are dequantized); greedy output as fp32's."""
    from pagoda.layers.ggml_blocks import BlockLinear

    fast = LLM(model=str(gemma3_gguf), dtype="float32", kv_cache_memory=0.25, quantization="gguf")
    assert isinstance(fast.engine.core.model.lm_head, BlockLinear)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in gemma.generate([SHORT, LONG], params, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in fast.generate([SHORT, LONG], params, use_tqdm=False)]
    assert got == want
    fast.shutdown()


def test_server_answers_as_the_engine(gemma3_gguf, gemma):
    import openai
    from server_process import start_server

    proc, base = start_server(gemma3_gguf, "--kv-cache-memory", "0.25", name="gemma3-270m")
    try:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused")
        out = client.completions.create(model="gemma3-270m", prompt=SHORT, max_tokens=MAX_TOKENS, temperature=0)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    expected = gemma.generate([SHORT], SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)[0]
    assert out.choices[0].text == expected.outputs[0].text
