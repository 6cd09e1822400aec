"""The pooling runner on a decoder (`runner="pooling"` on a tiny Llama) through `LLM`: last-token
and mean pooling of its hidden states equal transformers' `output_hidden_states` pooled the same
way, batched or not; scores are cosines of those vectors; a request for what the model cannot
give (`dimensions` on a model not trained for it, a prompt too long) and a request of the other
runner's kind are refused with a ValueError naming the problem."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagoda.engine.llm import LLM
from pagoda.pooling_params import PoolingParams
from pagoda.sampling_params import SamplingParams
from tiny_models import make_tiny_bert

PROMPTS = ["The quick brown fox jumps over the lazy dog.", "hi", "Paris is the capital of France. " * 6,
           "def main():\n    return 0\n"]


@pytest.fixture(scope="module")
def hidden_states(tiny_llama):
    """transformers' final hidden states (after the last norm) of each prompt, and its ids."""
    import transformers

    from pagoda.tokenizer import Tokenizer

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    tok = Tokenizer(tiny_llama)
    out = []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = tok.encode(prompt)
            out.append((ids, model(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0]))
    return out


@pytest.mark.parametrize("pooling", ["LAST", "MEAN"])
def test_decoder_pooling_equals_transformers_hidden_states(tiny_llama, hidden_states, pooling):
    llm = LLM(str(tiny_llama), runner="pooling", pooler_config=f'{{"pooling_type": "{pooling}"}}',
              kv_cache_memory=0.02, max_num_batched_tokens=64)  # a budget the long prompt fills alone
    try:
        together = llm.embed(PROMPTS, use_tqdm=False)
        alone = [llm.embed(p, use_tqdm=False)[0] for p in PROMPTS]
        raw = llm.encode(PROMPTS[0], PoolingParams(normalize=False), use_tqdm=False)[0]
    finally:
        llm.shutdown()
    for (ids, hidden), a, b in zip(hidden_states, together, alone):
        pooled = hidden[-1] if pooling == "LAST" else hidden.mean(0)
        assert a.prompt_token_ids == ids
        torch.testing.assert_close(a.outputs.data, F.normalize(pooled, dim=-1), atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(b.outputs.data, a.outputs.data, atol=2e-6, rtol=1e-5)
    first = hidden_states[0][1]
    torch.testing.assert_close(raw.outputs.data, first[-1] if pooling == "LAST" else first.mean(0),
                               atol=2e-5, rtol=1e-4)


@pytest.fixture(scope="module")
def embedder(tmp_path_factory):
    """A tiny sentence-transformers directory (mean pooling) whose config allows widths 8 and 16."""
    d = make_tiny_bert(tmp_path_factory.mktemp("st") / "st", seed=5, sentence_transformers="mean", matryoshka=True)
    llm = LLM(str(d))
    yield llm
    llm.shutdown()


def test_a_sentence_transformers_directory_pools_as_it_says(embedder):
    model = embedder.engine.config.model
    assert (model.runner, model.pooler.pooling_type, model.pooler.normalize) == ("pooling", "MEAN", True)
    assert model.max_model_len == 48  # sentence_bert_config.json's max_seq_length


def test_dimensions_cut_a_matryoshka_vector_then_normalize(embedder):
    full = embedder.embed("a matryoshka vector", PoolingParams(normalize=False), use_tqdm=False)[0].outputs.data
    cut = embedder.embed("a matryoshka vector", PoolingParams(dimensions=8), use_tqdm=False)[0].outputs.data
    torch.testing.assert_close(cut, F.normalize(full[:8], dim=-1))
    with pytest.raises(ValueError, match="dimensions must be one of the model's widths"):
        embedder.embed("x", PoolingParams(dimensions=12), use_tqdm=False)


def test_score_is_the_cosine_of_the_two_embeddings(embedder):
    texts = ["a cat sat", "the quick brown fox", "hello world"]
    vectors = [o.outputs.data for o in embedder.embed(texts, use_tqdm=False)]
    scores = [o.outputs.score for o in embedder.score(texts[0], texts[1:], use_tqdm=False)]
    assert scores == pytest.approx([float(F.cosine_similarity(vectors[0], v, dim=0)) for v in vectors[1:]], abs=1e-6)
    pairwise = [o.outputs.score for o in embedder.score(texts[:2], texts[1:], use_tqdm=False)]
    assert pairwise[0] == pytest.approx(scores[0], abs=1e-6)
    with pytest.raises(ValueError, match="text_1 has 2 texts and text_2 3"):
        embedder.score(texts[:2], texts, use_tqdm=False)


def test_too_long_is_refused_unless_truncated(embedder):
    long = "the quick brown fox " * 40
    with pytest.raises(ValueError, match="more than the model's maximum of 48"):
        embedder.embed(long, use_tqdm=False)
    cut = embedder.embed(long, PoolingParams(truncate_prompt_tokens=-1), use_tqdm=False)[0]
    tok = embedder.get_tokenizer()
    assert len(cut.prompt_token_ids) == 48 and cut.prompt_token_ids[-1] == tok.token_to_id("[SEP]")
    assert embedder.embed("still serving", use_tqdm=False)[0].outputs.data.shape == (32,)


def test_each_runner_refuses_the_others_requests(embedder, tiny_llm):
    with pytest.raises(ValueError, match="is an embedding model"):
        embedder.generate("hello", SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(ValueError, match="generates text: it serves no embeddings"):
        tiny_llm.embed("hello", use_tqdm=False)


def test_dimensions_on_a_model_not_trained_for_them_is_refused(tmp_path):
    plain = LLM(str(make_tiny_bert(tmp_path / "plain", seed=6)))  # no matryoshka_dimensions
    try:
        with pytest.raises(ValueError, match="dimensions: this model does not support Matryoshka"):
            plain.embed("hello", PoolingParams(dimensions=8), use_tqdm=False)
    finally:
        plain.shutdown()
