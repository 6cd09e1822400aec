"""`LLM.beam_search` against independent references on tiny random-weight models (fp32).

Two references, because transformers' beam search and vLLM's (which pagoda follows) agree only
while no beam ends:

- transformers' own `generate(num_beams=W, do_sample=False, num_return_sequences=W)`, with the
  end-of-sequence token suppressed (`min_new_tokens`) on both sides: with no beam finishing, both
  keep the W likeliest of each step's candidates, so the beams must be the same.
- once beams end, the two differ by design (documented in docs/generation.md): transformers
  admits a finished beam only if it ranks in the step's top W and stops by its own heuristic;
  vLLM keeps every end-of-sequence candidate among each beam's top 2W, runs to max_tokens (or
  until no beam lives) and ranks finished and live beams by `cum_logprob / len ** length_penalty`
  with `len` counting the prompt. So there the reference is `_reference_beam_search` below: that
  rule written plainly over transformers' full-sequence logits (no KV cache, no engine), on a
  model whose end-of-sequence logit is boosted so that beams do end.
"""

from __future__ import annotations

import pytest
import torch

from pagoda import LLM, BeamSearchParams, SamplingParams
from tiny_models import boost_eos, make_tiny_hf_model

PROMPTS = ["Hello", "Once upon a time", "def main():", "Paris is the capital of France. Berlin is", "In 1492"]
EOS = 2  # the tiny models' <|im_end|>


def _hf(model_dir):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@torch.no_grad()
def _reference_beam_search(model, prompt_ids: list[int], width: int, max_tokens: int, length_penalty: float,
                           early_stopping: bool = False) -> list[tuple[list[int], float]]:
    """vLLM's front-end beam search, plainly: (tokens with the prompt, cumulative logprob), best first."""
    live, finished = [(list(prompt_ids), 0.0)], []
    for _ in range(max_tokens):
        candidates = []
        for tokens, cum in live:
            logprobs = torch.log_softmax(model(torch.tensor([tokens])).logits[0, -1].float(), dim=-1)
            top = torch.topk(logprobs, 2 * width)
            for value, token in zip(top.values.tolist(), top.indices.tolist()):
                (finished if token == EOS else candidates).append((tokens + [token], cum + value))
        live = sorted(candidates, key=lambda c: c[1], reverse=True)[:width]
        if early_stopping and len(finished) >= width:
            live = []
        if not live:
            break

    def score(c):  # live beams never end in EOS: it finishes them
        return c[1] / ((len(c[0]) - (c[0][-1] == EOS)) ** length_penalty)

    return sorted(finished + live, key=score, reverse=True)[:width]


@pytest.fixture(scope="module")
def eos_model(tmp_path_factory):
    """A tiny Llama whose end-of-sequence logit swings wide (tiny_models.boost_eos): beams end."""
    return boost_eos(make_tiny_hf_model("llama", tmp_path_factory.mktemp("eos_llama"), seed=11), EOS)


@pytest.fixture(scope="module")
def eos_llm(eos_model):
    return LLM(model=str(eos_model), dtype="float32", kv_cache_memory=0.02)


def test_equals_transformers_beam_search_while_no_beam_ends(tiny_llm, tiny_llama):
    width, steps = 3, 10
    tokenizer = tiny_llm.get_tokenizer()
    hf = _hf(tiny_llama)
    params = BeamSearchParams(beam_width=width, max_tokens=steps, ignore_eos=True)
    for prompt, got in zip(PROMPTS, tiny_llm.beam_search(PROMPTS, params)):
        ids = tokenizer.encode(prompt)
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), num_beams=width, num_return_sequences=width, do_sample=False,
                              max_new_tokens=steps, min_new_tokens=steps, length_penalty=1.0, pad_token_id=0)
        expected = [row.tolist() for row in out]
        assert all(EOS not in tokens[len(ids):] for tokens in expected)  # else the two rules part
        assert [s.tokens for s in got.sequences] == expected
        for seq in got.sequences:  # the cumulative logprob is the sequence's, scored by transformers
            with torch.no_grad():
                logprobs = torch.log_softmax(hf(torch.tensor([seq.tokens])).logits[0].float(), dim=-1)
            new = torch.tensor(seq.tokens[len(ids):])
            assert seq.cum_logprob == pytest.approx(logprobs[len(ids) - 1:-1].gather(1, new[:, None]).sum().item(),
                                                    abs=1e-4)
            assert seq.finish_reason == "length" and seq.text == tokenizer.decode(seq.tokens, skip_special_tokens=False)


@pytest.mark.parametrize("length_penalty,early_stopping", [(1.0, False), (0.0, False), (2.0, False), (1.0, True)])
def test_finished_beams_equal_the_reference(eos_llm, eos_model, length_penalty, early_stopping):
    width, steps = 4, 8
    hf = _hf(eos_model)
    tokenizer = eos_llm.get_tokenizer()
    params = BeamSearchParams(beam_width=width, max_tokens=steps, length_penalty=length_penalty,
                              early_stopping=early_stopping)
    ended = 0
    for prompt, got in zip(PROMPTS, eos_llm.beam_search(PROMPTS, params)):
        expected = _reference_beam_search(hf, tokenizer.encode(prompt), width, steps, length_penalty, early_stopping)
        assert [s.tokens for s in got.sequences] == [tokens for tokens, _ in expected]
        assert [s.cum_logprob for s in got.sequences] == pytest.approx([cum for _, cum in expected], abs=1e-4)
        for seq in got.sequences:
            assert (seq.finish_reason == "stop") == (seq.tokens[-1] == EOS)
        ended += sum(s.finish_reason == "stop" for s in got.sequences)
    assert ended > 0  # the boosted end-of-sequence token did end beams: the test compared the scoring


def test_width_one_is_greedy(tiny_llm):
    greedy = tiny_llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    beams = tiny_llm.beam_search(PROMPTS, BeamSearchParams(beam_width=1, max_tokens=12, ignore_eos=True))
    for g, b in zip(greedy, beams):
        assert b.sequences[0].tokens == g.prompt_token_ids + g.outputs[0].token_ids


def test_batched_equals_one_by_one_and_a_cached_prefix_changes_nothing(eos_llm):
    params = BeamSearchParams(beam_width=3, max_tokens=6)
    batched = eos_llm.beam_search(PROMPTS, params)
    alone = [eos_llm.beam_search(p, params)[0] for p in PROMPTS]  # every prefix cached by now
    assert eos_llm.engine.stats()["prefix_cache_hit_rate"] > 0
    for a, b in zip(batched, alone):
        assert [s.tokens for s in a.sequences] == [s.tokens for s in b.sequences]
        assert [s.cum_logprob for s in a.sequences] == pytest.approx([s.cum_logprob for s in b.sequences], abs=1e-5)


def test_params_are_checked():
    with pytest.raises(ValueError, match="beam_width"):
        BeamSearchParams(beam_width=11, max_tokens=4)
    with pytest.raises(ValueError, match="temperature"):
        BeamSearchParams(beam_width=2, max_tokens=4, temperature=0.7)
    with pytest.raises(ValueError, match="n must"):
        BeamSearchParams(beam_width=2, max_tokens=4, n=3)
