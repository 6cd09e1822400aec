"""The real SmolLM2-135M-Instruct (Q4_1 GGUF from the catalog), end to end."""

from __future__ import annotations

import pytest
import torch

from pagoda import LLM, SamplingParams

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
PROMPTS = [
    "What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers.",
    "Who wrote Hamlet?", "Explain gravity in one sentence.", "What is 12 times 12?",
    "Name a color of the rainbow.", "Translate 'hello' to Spanish.", "What do bees make?",
    "Give me a synonym for happy.", "What is the boiling point of water?", "Describe a cat.",
    "What is Python?", "How many legs does a spider have?", "What is the largest ocean?",
    "Say something kind.",
]


@pytest.fixture(scope="module")
def smol_fp32(smollm2_gguf):
    return LLM(model="smollm2", dtype="float32", kv_cache_memory=0.5)


@pytest.fixture(scope="module")
def reference_model(smollm2_gguf, smol_fp32):
    """transformers' Llama on the same dequantized weights."""
    import transformers

    from pagoda.loader.gguf_weights import iter_gguf_weights

    files = smol_fp32.engine.config.model.files
    config = transformers.AutoConfig.from_pretrained(files.metadata_dir)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    state = dict(iter_gguf_weights(files.gguf_file, files.hf_config()))
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    model.tie_weights()
    return model


def _chat_ids(llm: LLM, conversation) -> list[int]:
    return llm.get_tokenizer().encode_chat(conversation)


def test_chat_template_tokens_match_transformers(smollm2_gguf, smol_fp32):
    import transformers

    ref_tok = transformers.AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)
    ref_ids = ref_tok.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=True)
    ref_ids = ref_ids["input_ids"] if isinstance(ref_ids, dict) or hasattr(ref_ids, "keys") else ref_ids
    assert _chat_ids(smol_fp32, QUESTION) == list(ref_ids)


def test_greedy_chat_answer_equals_transformers(smol_fp32, reference_model):
    out = smol_fp32.chat(QUESTION, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0]
    ids = out.prompt_token_ids
    with torch.no_grad():
        ref = reference_model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False,
                                       eos_token_id=smol_fp32.get_tokenizer().eos_token_ids)
    ref_new = ref[0, len(ids):].tolist()
    got = out.outputs[0].token_ids
    assert got == ref_new[: len(got)] and (len(got) == len(ref_new) or out.outputs[0].finish_reason == "stop")
    assert "Paris" in out.outputs[0].text


def test_sixteen_prompts_batched_equal_one_at_a_time(smol_fp32):
    params = SamplingParams(temperature=0, max_tokens=24)
    conversations = [[{"role": "user", "content": p}] for p in PROMPTS]
    batched = smol_fp32.chat(conversations, params, use_tqdm=False)
    for conv, b in zip(conversations, batched):
        alone = smol_fp32.chat(conv, params, use_tqdm=False)[0]
        assert alone.outputs[0].token_ids == b.outputs[0].token_ids, conv[0]["content"]


def test_bf16_runs_and_answers(smollm2_gguf):
    llm = LLM(model="smollm2", dtype="bfloat16", kv_cache_memory=0.25)
    assert llm.engine.config.model.dtype == torch.bfloat16
    out = llm.chat(QUESTION, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0]
    assert "Paris" in out.outputs[0].text


def test_prefix_cache_hits_give_identical_answers(smol_fp32):
    system = {"role": "system", "content": "You are a careful geography tutor who answers in one short sentence. " * 4}
    questions = ["What is the capital of France?", "Name a river in Egypt.", "Where is Mount Fuji?"]
    conversations = [[system, {"role": "user", "content": q}] for q in questions]
    params = SamplingParams(temperature=0, max_tokens=16)
    smol_fp32.chat(conversations[:1], params, use_tqdm=False)  # computes the shared system prompt once
    hit = smol_fp32.chat(conversations, params, use_tqdm=False)
    assert all(o.num_cached_tokens >= 48 for o in hit)
    uncached = LLM(model="smollm2", dtype="float32", kv_cache_memory=0.25, enable_prefix_caching=False)
    miss = uncached.chat(conversations, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in hit] == [o.outputs[0].token_ids for o in miss]
    assert all(o.num_cached_tokens == 0 for o in miss)


def test_gguf_draft_model_speeds_nothing_wrong(smol_fp32):
    """The issue's pair: the GGUF SmolLM2 drafting for the fp32 one. Greedy answers equal the
    fp32 engine's without speculation, alone and batched, and the quantized copy's drafts are
    mostly accepted."""
    draft = {"method": "draft_model", "model": "smollm2", "quantization": "gguf", "num_speculative_tokens": 4}
    spec = LLM(model="smollm2", dtype="float32", kv_cache_memory=0.5, speculative_config=draft)
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    conversations = [[{"role": "user", "content": p}] for p in PROMPTS[:2]]
    want = [o.outputs[0].token_ids for o in smol_fp32.chat(conversations, params, use_tqdm=False)]
    assert [o.outputs[0].token_ids for o in spec.chat(conversations[:1], params, use_tqdm=False)] == want[:1]
    assert [o.outputs[0].token_ids for o in spec.chat(conversations, params, use_tqdm=False)] == want
    stats = spec.engine.stats()
    assert stats["spec_acceptance_rate"] > 0.8 and stats["spec_mean_accepted_length"] > 3, stats
    spec.shutdown()
