"""The content filter on a real `pagoda serve` of the tiny Llama (`--moderation-words`,
`--moderation-action stop|mask`): prompts with a term get 400 `content_filter` naming the list;
output is filtered as it streams, in completions and chat, streaming or not, n > 1, sessions,
Ollama's API and pagoda.lang's Endpoint; a stopped choice frees its KV at once; hits are counted.

The tiny model writes random text, so the banned terms are taken from its own greedy output
(computed first with the in-process engine, which gives the server's tokens): four letters across
a token boundary, so that a term arrives split over two chunks."""

from __future__ import annotations

import json

import httpx
import pytest
from server_process import kill_all, side_by_side, start_server

from pagoda.engine.content_filter import WordFilter, normalize

PROMPT, CLEAN = "The quick brown fox", "def main():"
CHAT = [{"role": "user", "content": "Hello there"}]
SEEDED = dict(temperature=1.0, seed=7, n=2)
MAX = 32


def _term_across_tokens(tokenizer, token_ids: list[int], text: str, avoid: str = "") -> str:
    """Four letters of `text` around a token boundary that are not in `avoid`."""
    for k in range(1, len(token_ids)):
        b = len(tokenizer.decode(token_ids[:k]))
        piece = text[b - 2:b + 2]
        if len(piece) == 4 and piece.isascii() and piece.isalpha() and normalize(piece) not in normalize(avoid):
            return piece
    raise AssertionError(f"no four letters across a token boundary in {text!r}")


@pytest.fixture(scope="module")
def ref(tiny_llm, tmp_path_factory):
    """The tiny model's own output (the server's, too), the lists made from it, and each
    reference text as the filter must hand it out (`expect(text, action)`)."""
    from pagoda import SamplingParams

    greedy = SamplingParams(temperature=0, max_tokens=MAX)
    tok = tiny_llm.engine.tokenizer
    prompt, clean = (o.outputs[0] for o in tiny_llm.generate([PROMPT, CLEAN], greedy, use_tqdm=False))
    chat = tiny_llm.chat(CHAT, greedy, use_tqdm=False)[0].outputs[0]
    seeded = tiny_llm.generate([PROMPT], SamplingParams(max_tokens=MAX, **SEEDED), use_tqdm=False)[0].outputs
    terms = [_term_across_tokens(tok, prompt.token_ids, prompt.text, clean.text),
             _term_across_tokens(tok, chat.token_ids, chat.text),
             _term_across_tokens(tok, seeded[0].token_ids, seeded[0].text, seeded[1].text)]
    work = tmp_path_factory.mktemp("moderation")
    banned, zh = work / "banned.txt", work / "zh.txt"
    banned.write_text("# terms the tiny model writes\n" + "".join(f"*{t}*\n" for t in terms))
    zh.write_text("坏蛋\n法轮功\n")
    word_filter = WordFilter.from_files([banned, zh])

    def expect(text: str, action: str) -> tuple[str, bool]:
        hits = word_filter.scan(text)
        if not hits:
            return text, False
        if action == "stop":
            return text[:hits[0].start], True
        out = list(text)
        for h in hits:
            out[h.start:h.end] = "*" * (h.end - h.start)
        return "".join(out), True

    texts = {"prompt": prompt.text, "clean": clean.text, "chat": chat.text, "seeded0": seeded[0].text,
             "seeded1": seeded[1].text}
    assert word_filter.first_list(texts["clean"]) is None and word_filter.first_list(texts["seeded1"]) is None
    return dict(texts=texts, terms=terms, files=[str(banned), str(zh)], expect=expect, filter=word_filter)


@pytest.fixture(scope="module")
def servers(tiny_llama, ref):
    """Two servers, started side by side: both lists and the default action (stop); the first
    list with --moderation-action mask."""
    stop_args = [a for f in ref["files"] for a in ("--moderation-words", f)]
    mask_args = ["--moderation-words", ref["files"][0], "--moderation-action", "mask"]
    started = side_by_side(lambda: start_server(tiny_llama, *stop_args), lambda: start_server(tiny_llama, *mask_args))
    yield [base for _, base in started]
    kill_all(started)


@pytest.fixture(scope="module")
def stop_server(servers):
    return servers[0]


@pytest.fixture(scope="module")
def mask_server(servers):
    return servers[1]


def post(base: str, path: str, body: dict, status: int = 200) -> dict:
    r = httpx.post(f"{base}{path}", json={"model": "tiny", **body}, timeout=60)
    assert r.status_code == status, r.text
    return r.json()


def stream(base: str, path: str, body: dict, on_chunk=None) -> list[dict]:
    chunks = []
    with httpx.stream("POST", f"{base}{path}", json={"model": "tiny", "stream": True, **body}, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
                if on_chunk is not None:
                    on_chunk(chunks[-1])
    return chunks


def gathered(chunks: list[dict], ref, key=lambda c: c.get("text")) -> dict[int, tuple[str, str | None]]:
    """Each choice's text and finish reason from a stream; no chunk, and no prefix of a choice's
    text, ever held a term."""
    texts: dict[int, str] = {}
    finish: dict[int, str | None] = {}
    for chunk in chunks:
        for c in chunk["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + (key(c) or "")
            assert ref["filter"].first_list(texts[c["index"]]) is None, texts[c["index"]]
            if c["finish_reason"] is not None:
                assert c["index"] not in finish  # one finish per choice
                finish[c["index"]] = c["finish_reason"]
    return {i: (texts[i], finish.get(i)) for i in texts}


def metric(base: str, name: str, **labels) -> float:
    text = httpx.get(f"{base}/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _reason(hit: bool, action: str) -> str:
    return "content_filter" if hit and action == "stop" else "length"


# -- input ----------------------------------------------------------------------------------------
def test_prompts_with_a_term_are_refused_naming_the_list(stop_server, ref, tiny_llm):
    term = ref["terms"][0]
    before = metric(stop_server, "pagoda:content_filter_hits_total", list="banned", direction="input")
    for body, path, name in [
        ({"prompt": f"say {term.upper()} now", "max_tokens": 4}, "/v1/completions", "banned"),
        ({"prompt": ["fine", f"Ｓａｙ {term}"], "max_tokens": 4}, "/v1/completions", "banned"),  # full-width
        ({"prompt": tiny_llm.engine.tokenizer.encode(f"x {term} y"), "max_tokens": 4}, "/v1/completions", "banned"),
        ({"messages": [{"role": "user", "content": "你是坏\u200b蛋"}]}, "/v1/chat/completions", "zh"),
    ]:
        error = post(stop_server, path, body, 400)["error"]
        assert error["code"] == "content_filter" and f"`{name}`" in error["message"]
        assert term not in error["message"] and "坏" not in error["message"]  # the list, not the text
    assert metric(stop_server, "pagoda:content_filter_hits_total", list="banned", direction="input") == before + 3
    r = httpx.post(f"{stop_server}/api/generate", json={"model": "tiny", "prompt": "法轮功", "stream": False}, timeout=30)
    assert r.status_code == 400 and "`zh`" in r.json()["error"]
    sid = post(stop_server, "/v1/sessions", {})["id"]
    assert post(stop_server, f"/v1/sessions/{sid}/messages", {"content": f"{term}!"}, 400)["error"]["code"] == \
        "content_filter"


# -- output: stop ---------------------------------------------------------------------------------
def test_completions_stop_at_a_term_per_prompt(stop_server, ref):
    answer = post(stop_server, "/v1/completions", {"prompt": [PROMPT, CLEAN], "max_tokens": MAX, "temperature": 0})
    for choice, key in zip(answer["choices"], ["prompt", "clean"]):
        text, hit = ref["expect"](ref["texts"][key], "stop")
        assert (choice["text"], choice["finish_reason"]) == (text, _reason(hit, "stop"))
    assert answer["choices"][0]["finish_reason"] == "content_filter"
    assert answer["usage"]["completion_tokens"] < 2 * MAX  # the stopped prompt generated no further


def test_streamed_completion_never_sends_the_term_and_frees_its_kv_at_once(stop_server, ref):
    text, hit = ref["expect"](ref["texts"]["prompt"], "stop")
    assert hit
    before = metric(stop_server, "pagoda:content_filter_hits_total", list="banned", direction="output")
    seen = {}

    def on_chunk(chunk):  # at the finish chunk, the engine request is already gone
        if chunk["choices"] and chunk["choices"][0]["finish_reason"]:
            seen["kv"] = metric(stop_server, "pagoda:kv_cache_usage_perc")
            seen["running"] = metric(stop_server, "pagoda:num_requests_running")

    # 200 tokens asked: the stop, a few tokens in, must end it long before
    chunks = stream(stop_server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 200, "temperature": 0,
                                                     "stream_options": {"include_usage": True}}, on_chunk)
    assert gathered(chunks, ref) == {0: (text, "content_filter")}
    assert seen == {"kv": 0.0, "running": 0.0}
    assert chunks[-1]["usage"]["completion_tokens"] < MAX
    assert metric(stop_server, "pagoda:content_filter_hits_total", list="banned", direction="output") == before + 1
    assert metric(stop_server, "pagoda:request_success_total", finished_reason="content_filter") >= 1


@pytest.mark.parametrize("streaming", [False, True])
def test_chat_with_n_choices_each_stopped(stop_server, ref, streaming):
    text, hit = ref["expect"](ref["texts"]["chat"], "stop")
    assert hit
    body = {"messages": CHAT, "max_tokens": MAX, "temperature": 0, "n": 2}
    if streaming:
        got = gathered(stream(stop_server, "/v1/chat/completions", body), ref,
                       key=lambda c: c["delta"].get("content"))
    else:
        got = {c["index"]: (c["message"]["content"], c["finish_reason"])
               for c in post(stop_server, "/v1/chat/completions", body)["choices"]}
    assert got == {0: (text, "content_filter"), 1: (text, "content_filter")}


@pytest.mark.parametrize("streaming", [False, True])
def test_n_choices_stop_one_by_one(stop_server, ref, streaming):
    """Choice 0 hits a term and stops; choice 1, in the same request, runs to its end."""
    body = {"prompt": PROMPT, "max_tokens": MAX, **SEEDED}
    if streaming:
        got = gathered(stream(stop_server, "/v1/completions", body), ref)
    else:
        got = {c["index"]: (c["text"], c["finish_reason"]) for c in post(stop_server, "/v1/completions", body)["choices"]}
    first, hit = ref["expect"](ref["texts"]["seeded0"], "stop")
    assert hit
    assert got == {0: (first, "content_filter"), 1: (ref["texts"]["seeded1"], "length")}
    assert metric(stop_server, "pagoda:kv_cache_usage_perc") == 0.0


def test_sessions_ollama_and_lang_are_filtered(stop_server, ref):
    text, _ = ref["expect"](ref["texts"]["chat"], "stop")
    sid = post(stop_server, "/v1/sessions", {"max_tokens": MAX, "temperature": 0})["id"]
    answer = post(stop_server, f"/v1/sessions/{sid}/messages", {"content": CHAT[0]["content"]})
    assert (answer["choices"][0]["message"]["content"], answer["choices"][0]["finish_reason"]) == (text, "content_filter")

    text, _ = ref["expect"](ref["texts"]["prompt"], "stop")
    r = httpx.post(f"{stop_server}/api/generate", json={"model": "tiny", "prompt": PROMPT, "raw": True, "stream": False,
                                                        "options": {"temperature": 0, "num_predict": MAX}}, timeout=60)
    assert (r.json()["response"], r.json()["done_reason"]) == (text, "content_filter")

    from pagoda import lang

    @lang.function
    def program(s):
        s += PROMPT
        s += lang.gen("out", max_tokens=MAX)

    state = program.run(backend=lang.Endpoint(f"{stop_server}/v1"))
    assert state["out"] == text and state.meta("out").finish_reason == "content_filter"


def test_the_openai_sdk_reads_content_filter(stop_server, ref):
    from openai import OpenAI

    client = OpenAI(base_url=f"{stop_server}/v1", api_key="unused")
    text, _ = ref["expect"](ref["texts"]["prompt"], "stop")
    c = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=MAX, temperature=0).choices[0]
    assert (c.text, c.finish_reason) == (text, "content_filter")


# -- output: mask ---------------------------------------------------------------------------------
@pytest.mark.parametrize("streaming", [False, True])
def test_mask_writes_stars_and_goes_on(mask_server, ref, streaming):
    text, hit = ref["expect"](ref["texts"]["prompt"], "mask")
    assert hit and "*" in text
    body = {"prompt": PROMPT, "max_tokens": MAX, "temperature": 0, "n": 2}
    if streaming:
        got = gathered(stream(mask_server, "/v1/completions", body), ref)
    else:
        got = {c["index"]: (c["text"], c["finish_reason"]) for c in post(mask_server, "/v1/completions", body)["choices"]}
    assert got == {0: (text, "length"), 1: (text, "length")}
    # the zh list is not on this server: its terms pass
    assert post(mask_server, "/v1/completions", {"prompt": "坏蛋", "max_tokens": 1})["choices"]
    assert metric(mask_server, "pagoda:content_filter_hits_total", list="banned", direction="output") >= 2
