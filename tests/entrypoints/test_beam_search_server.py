"""`use_beam_search` through `pagoda serve` (a real subprocess on 127.0.0.1, the openai SDK):
the choices are the offline `LLM.beam_search`'s best beams, best first, on the same weights (a
tiny Llama whose end-of-sequence token often ends beams); streamed, the final beams come at the
end; what beam search cannot do is a 400 naming the field; a beam request counts its width
against `--max-num-seqs` + `--max-queue-len`."""

from __future__ import annotations

import httpx
import openai
import pytest

from pagoda import LLM, BeamSearchParams
from server_process import start_server, stop_process
from tiny_models import boost_eos, make_tiny_hf_model

PROMPT = "Once upon a time"  # on this model some beams end (finish_reason "stop"), some run out
BEAM = {"use_beam_search": True}


@pytest.fixture(scope="module")
def eos_model(tmp_path_factory):
    return boost_eos(make_tiny_hf_model("llama", tmp_path_factory.mktemp("eos_llama"), seed=11))


@pytest.fixture(scope="module")
def server(eos_model):
    # room for 4 sequences: 2 running and 2 waiting
    proc, base = start_server(eos_model, "--max-num-seqs", "2", "--max-queue-len", "2")
    yield base
    stop_process(proc)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused")


@pytest.fixture(scope="module")
def offline(eos_model):
    return LLM(model=str(eos_model), dtype="float32", kv_cache_memory=0.02)


def _expected(offline: LLM, prompt_ids: list[int], width: int, n: int, **params) -> list[tuple[str, str, float]]:
    """The offline search's best n beams as choices: (text of the generated tokens, the end of
    sequence left out; finish reason; cumulative logprob)."""
    tokenizer = offline.get_tokenizer()
    out = offline.beam_search({"prompt_token_ids": prompt_ids}, BeamSearchParams(beam_width=width, **params))[0]
    choices = []
    for seq in out.sequences[:n]:
        generated = seq.tokens[len(prompt_ids):]
        if seq.finish_reason == "stop":
            generated = generated[:-1]
        choices.append((tokenizer.decode(generated), seq.finish_reason, seq.cum_logprob))
    return choices


@pytest.mark.parametrize("n,best_of,length_penalty", [(3, None, 1.0), (2, 4, 0.0), (4, None, 2.0)])
def test_completion_choices_are_the_best_beams(client, offline, n, best_of, length_penalty):
    extra = {**BEAM, "length_penalty": length_penalty, **({"best_of": best_of} if best_of else {})}
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, n=n, temperature=0, extra_body=extra)
    expected = _expected(offline, offline.get_tokenizer().encode(PROMPT), best_of or n, n, max_tokens=8,
                         length_penalty=length_penalty)
    assert [(c.text, c.finish_reason) for c in r.choices] == [(text, reason) for text, reason, _ in expected]
    assert [c.index for c in r.choices] == list(range(n))
    assert "stop" in {c.finish_reason for c in r.choices}  # an ended beam, its end-of-sequence token left out
    assert r.usage.completion_tokens > 0


def test_streamed_beams_come_whole_at_the_end(client):
    whole = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, n=3, extra_body=BEAM)
    chunks = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, n=3, extra_body=BEAM,
                                            stream=True))
    assert sorted((c.index, c.text, c.finish_reason) for chunk in chunks for c in chunk.choices) == \
        [(c.index, c.text, c.finish_reason) for c in whole.choices]


def test_chat_choices_and_stream(client, offline, server):
    messages = [{"role": "user", "content": "Say something"}]
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, n=2, extra_body=BEAM)
    ids = offline.get_tokenizer().encode(offline.get_tokenizer().apply_chat_template(messages, True),
                                         add_special_tokens=False)
    expected = _expected(offline, ids, 2, 2, max_tokens=6)
    assert [(c.message.content, c.finish_reason) for c in r.choices] == [(t, f) for t, f, _ in expected]
    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, n=2, extra_body=BEAM,
                                            stream=True)
    content = {0: "", 1: ""}
    for chunk in stream:
        for c in chunk.choices:
            content[c.index] += c.delta.content or ""
    assert [content[0], content[1]] == [c.message.content for c in r.choices]


@pytest.mark.parametrize("body,param", [
    ({"temperature": 0.7}, "temperature"),
    ({"logprobs": 1}, "logprobs"),
    ({"n": 3, "best_of": 2}, "n"),
    ({"n": 11}, "n"),
    ({"best_of": 11}, "best_of"),
    ({"top_p": 0.5}, "top_p"),
    ({"stop": ["x"]}, "stop"),
    ({"guided_choice": ["a", "b"]}, "guided_choice"),
])
def test_what_beam_search_cannot_do_is_a_400_naming_the_field(server, body, param):
    r = httpx.post(f"{server}/v1/completions", json={"prompt": PROMPT, "max_tokens": 4, **BEAM, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_chat_refusals_and_best_of_without_beams(server):
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    r = httpx.post(f"{server}/v1/chat/completions", json={**chat, **BEAM, "logprobs": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs"
    r = httpx.post(f"{server}/v1/completions", json={"prompt": PROMPT, "max_tokens": 4, "n": 1, "best_of": 3})
    assert r.status_code == 400 and r.json()["error"]["param"] == "best_of"


def test_a_beam_request_counts_its_width_against_the_queue(server):
    """2 running + 2 waiting: a width of 4 fits, 5 does not (one sequence would fit the count)."""
    fits = httpx.post(f"{server}/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "n": 4, **BEAM})
    assert fits.status_code == 200 and len(fits.json()["choices"]) == 4
    full = httpx.post(f"{server}/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "n": 2, "best_of": 5,
                                                       **BEAM})
    assert full.status_code == 429 and full.json()["error"]["code"] == "queue_full"
    two = httpx.post(f"{server}/v1/completions", json={"prompt": [PROMPT, "Hello"], "max_tokens": 2, "n": 3, **BEAM})
    assert two.status_code == 429  # two prompts of width 3: six sequences
