"""Synthetic prompts have the token lengths asked for; JSONL files load in their several shapes."""

from __future__ import annotations

import json

import pytest

from pagoda.bench import datasets
from pagoda.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    return Tokenizer(tiny_llama)


def test_text_prompts_are_token_exact(tokenizer):
    reqs = datasets.random_requests(6, 40, 12, tokenizer=tokenizer, seed=1)
    for r in reqs:
        assert isinstance(r.prompt, str)
        assert r.prompt_len == 40 and len(tokenizer.encode(r.prompt)) == 40
        assert r.output_len == 12
    assert len({r.prompt for r in reqs}) == 6  # no shared prompts (no accidental prefix-cache hits)
    again = datasets.random_requests(6, 40, 12, tokenizer=tokenizer, seed=1)
    assert [r.prompt for r in again] == [r.prompt for r in reqs]


def test_sampled_lengths_stay_in_range(tokenizer):
    reqs = datasets.random_requests(40, 60, 20, range_ratio=0.5, tokenizer=tokenizer, seed=3)
    in_lens = [r.prompt_len for r in reqs]
    assert all(30 <= n <= 90 for n in in_lens) and len(set(in_lens)) > 5
    assert all(len(tokenizer.encode(r.prompt)) == r.prompt_len for r in reqs)
    assert all(10 <= r.output_len <= 30 for r in reqs)
    with pytest.raises(ValueError, match="range ratio"):
        datasets.random_requests(2, 10, 10, range_ratio=1.5, tokenizer=tokenizer)


def test_token_id_prompts(tokenizer):
    reqs = datasets.random_requests(3, 25, 5, tokenizer=tokenizer, as_text=False)
    assert all(len(r.prompt) == r.prompt_len == 25 for r in reqs)
    assert all(0 <= t < tokenizer.vocab_size for r in reqs for t in r.prompt)
    big = datasets.random_requests(2, 10, 5, vocab_size=50_000, as_text=False)
    assert all(100 <= t < 49_900 for r in big for t in r.prompt)


def test_jsonl_shapes(tmp_path, tokenizer):
    path = tmp_path / "prompts.jsonl"
    rows = [
        {"prompt": "The quick brown fox", "output_len": 7},
        {"prompt_token_ids": [5, 6, 7, 8]},
        {"conversations": [{"from": "human", "value": "Paris is"}, {"from": "gpt", "value": "the capital of France."}]},
        {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    reqs = datasets.load_jsonl(path, output_len=9, tokenizer=tokenizer)
    assert [r.prompt for r in reqs] == ["The quick brown fox", [5, 6, 7, 8], "Paris is", "hello"]
    assert reqs[0].prompt_len == len(tokenizer.encode("The quick brown fox"))
    assert [r.output_len for r in reqs] == [7, 9, len(tokenizer.encode("the capital of France.", add_special_tokens=False)), 9]
    assert reqs[1].prompt_len == 4
    assert len(datasets.load_jsonl(path, output_len=9, num_prompts=2)) == 2
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": 3}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1: no prompt"):
        datasets.load_jsonl(bad, output_len=4)


def test_tokenizer_lookup_never_guesses(tiny_llama):
    assert datasets.load_tokenizer("tiny") is None  # a served model name, not a local model
    assert datasets.load_tokenizer(None) is None
    assert datasets.load_tokenizer(str(tiny_llama)).vocab_size > 100
