"""The content filter (pagoda/engine/content_filter.py): normalization, Chinese and English lists,
word boundaries, the streaming guard (terms split across chunks never get out, in stop and mask
mode), and the in-process engine (`LLM(moderation_words=...)`, pagoda.lang's Engine) on the tiny
Llama. The server's policy is tests/security/test_moderation.py, its routes
tests/security/test_moderation_server.py."""

from __future__ import annotations

import random

import pytest

from pagoda.engine.content_filter import (
    ContentFilterError, Moderation, OutputGuard, WordFilter, normalize, read_list,
)

LISTS = {"en": ["bad word", "ass", "*fuck*", "PayPal", "café", "naïve*"], "zh": ["法轮功", "坏蛋", "ＡＢＣ测试"]}


@pytest.fixture(scope="module")
def word_filter() -> WordFilter:
    return WordFilter(LISTS)


@pytest.mark.parametrize("text, folded", [
    ("ＨＥＬＬＯ　Ｗｏｒｌｄ！", "hello world!"),  # full-width letters, ideographic space
    ("Straße", "strasse"),  # case folding
    ("b\u200bad\u00adw\ufeffo\u200drd", "badword"),  # zero-width space / soft hyphen / BOM / joiner dropped
    ("tab\tnew\nline\u00a0nbsp   runs", "tab new line nbsp runs"),  # every white space is one space
    ("Café NAÏVE Ångström", "cafe naive angstrom"),  # diacritics of Latin letters dropped
    ("z\u0336a\u0335l\u0337g\u0338o\u0489", "zalgo"),  # stacked combining marks dropped
    ("ﬁne ①②", "fine 12"),  # ligatures, circled digits
    ("раураl", "paypal"),  # Cyrillic р а у look like Latin letters
    ("ｶﾀｶﾅ 中文", "カタカナ 中文"),  # half-width katakana to full width; Chinese untouched
])
def test_normalization(text, folded):
    assert normalize(text) == folded


@pytest.mark.parametrize("text, expected", [
    ("this is a BAD  WORD here", "en"),
    ("ＢＡＤ　ＷＯＲＤ", "en"),
    ("bad\u200b word", "en"),
    ("a bad\nword", "en"),
    ("an ass.", "en"),
    ("class and passage", None),  # `ass` is an English word: only at word boundaries
    ("motherfucking", "en"),  # `*fuck*` matches inside words
    ("naïvely", "en"), ("anaive", None),  # `naïve*`: free on the right only
    ("my раураl account", "en"), ("CAFE", "en"),
    ("你是坏蛋吗", "zh"),  # Chinese terms match anywhere: no spaces between words
    ("法\u200b轮功", "zh"),
    ("abc测试", "zh"),  # the term was written full-width
    ("a good word", None), ("坏人", None),
])
def test_first_list(word_filter, text, expected):
    assert word_filter.first_list(text) == expected


def test_scan_reports_spans_in_the_original_text(word_filter):
    text = "Ｏｈ ｎｏ，坏\u200b蛋! That ﬁ BAD word."
    hits = word_filter.scan(text)
    assert [(h.list_name, h.term, text[h.start:h.end]) for h in hits] == [
        ("zh", "坏蛋", "坏\u200b蛋"), ("en", "bad word", "BAD word")]


def test_lists_from_files_combine_and_comments(tmp_path):
    (tmp_path / "banned.txt").write_text("\ufeff# a comment\n\nfoo\n  Bar baz  \n", encoding="utf-8")
    (tmp_path / "zh.txt").write_text("坏蛋\n", encoding="utf-8")
    assert read_list(tmp_path / "banned.txt") == ["foo", "Bar baz"]
    f = WordFilter.from_files([tmp_path / "banned.txt"])
    assert f.names == ["banned"] and f.num_terms == 2 and f.max_len == len("bar baz")
    both = f.combine(WordFilter.from_files([tmp_path / "zh.txt"]))
    assert both.first_list("BAR  BAZ") == "banned" and both.first_list("大坏蛋") == "zh"
    assert f.first_list("大坏蛋") is None  # combine made a new filter
    with pytest.raises(ValueError, match="cannot be read"):
        WordFilter.from_files([tmp_path / "missing.txt"])
    (tmp_path / "latin1.txt").write_bytes("caf\xe9\n".encode("latin-1"))
    with pytest.raises(ValueError, match="not UTF-8"):
        read_list(tmp_path / "latin1.txt")


def _stream(guard: OutputGuard, pieces: list[str]) -> tuple[str, list[str]]:
    """Everything the guard released, and what it had released after each piece."""
    out, seen = "", []
    for piece in pieces:
        out += guard.feed(piece)
        seen.append(out)
    out += guard.feed("", final=True)
    return out, seen


def _chunkings(text: str, rng: random.Random, count: int = 60):
    yield [text]
    yield list(text)  # one character at a time
    for _ in range(count):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, min(8, len(text) - 1))))
        yield [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


TEXTS = [
    "Well, that is a bad word, and a BAD\nWORD again; then classes.",
    "我们不要说坏蛋这个词，法轮功也不行。",
    "mixed: ＡＢＣ测试 and baD\u200b word then ﬁn fucking end",
    "nothing to see here, only a good word and a passage",
]


@pytest.mark.parametrize("text", TEXTS)
def test_stop_releases_exactly_the_text_before_the_first_term_however_it_is_chunked(word_filter, text):
    hits = word_filter.scan(text)
    expected = text[:hits[0].start] if hits else text
    rng = random.Random(text)
    for pieces in _chunkings(text, rng):
        guard = word_filter.guard("stop")
        out, seen = _stream(guard, pieces)
        assert out == expected, pieces
        assert guard.stopped == bool(hits)
        for prefix in seen:  # at no point did any part of the term get out
            assert expected.startswith(prefix)
            assert word_filter.first_list(prefix) is None
        assert guard.feed("more text bad word", final=True) == ""  # closed


@pytest.mark.parametrize("text", TEXTS)
def test_mask_writes_stars_over_every_term_however_it_is_chunked(word_filter, text):
    hits = word_filter.scan(text)
    expected = list(text)
    for h in hits:
        expected[h.start:h.end] = "*" * (h.end - h.start)
    expected = "".join(expected)
    rng = random.Random(text)
    for pieces in _chunkings(text, rng):
        guard = word_filter.guard("mask")
        out, seen = _stream(guard, pieces)
        assert out == expected, pieces
        assert not guard.stopped and len(guard.hits) == len(hits)
        for prefix in seen:
            assert expected.startswith(prefix)
    assert word_filter.first_list(expected) is None


def test_the_guard_holds_back_only_the_longest_term():
    f = WordFilter({"t": ["*abcd*"]})  # no word boundaries
    guard = f.guard("stop")
    assert guard.feed("0123456789") == "012345"  # 4 characters held: they could start the term
    assert guard.feed("ab") == "6789"[:2]
    assert guard.feed("c") == "8"
    assert guard.feed("d!") == "9"  # the term is complete: stopped before it
    assert guard.stopped and guard.hits[0].start == 10 and guard.hits[0].end == 14
    # a term at the very end is caught when the output finishes
    guard = f.guard("mask")
    assert guard.feed("xx abc") + guard.feed("d", final=True) == "xx ****"


def test_word_boundary_waits_for_the_next_character():
    f = WordFilter({"t": ["ass"]})
    guard = f.guard("stop")
    out = guard.feed("the ass") + guard.feed("ets are")  # "assets": no hit
    assert not guard.stopped
    assert out + guard.feed("", final=True) == "the assets are"
    guard = f.guard("stop")
    assert guard.feed("the ass") + guard.feed(" is") + guard.feed("", final=True) == "the "
    assert guard.stopped


def test_an_empty_filter_passes_text_through():
    guard = WordFilter({"empty": ["  ", "*", "\u200b"]}).guard("stop")  # terms that fold to nothing
    assert guard.feed("anything at all") == "anything at all"


def test_moderation_reports_hits_and_rejects_unknown_actions(word_filter):
    seen = []
    m = Moderation(word_filter, "mask", on_hit=lambda name, direction: seen.append((name, direction)))
    assert m.check_input(["fine", "坏蛋"]) == "zh"
    g = m.guard()
    g.feed("a bad word and an ass", final=True)
    assert seen == [("zh", "input"), ("en", "output"), ("en", "output")]
    with pytest.raises(ValueError, match="stop, mask"):
        Moderation(word_filter, "block")


# -- the in-process engine --------------------------------------------------------------------
def _term_across_tokens(tokenizer, token_ids: list[int], text: str) -> str:
    """Four letters of `text` that two tokens share (two on each side of a token boundary)."""
    for k in range(1, len(token_ids)):
        b = len(tokenizer.decode(token_ids[:k]))
        piece = text[b - 2:b + 2]
        if len(piece) == 4 and piece.isascii() and piece.isalpha() and text[b - 2:b] != piece[:2].upper():
            return piece
    raise AssertionError(f"no four letters across a token boundary in {text!r}")


@pytest.fixture(scope="module")
def reference(tiny_llm):
    from pagoda import SamplingParams

    out = tiny_llm.generate(["The quick brown fox"], SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
    c = out[0].outputs[0]
    return c.text, _term_across_tokens(tiny_llm.engine.tokenizer, c.token_ids, c.text)


@pytest.mark.parametrize("action", ["stop", "mask"])
def test_llm_filters_its_output_and_refuses_prompts(tiny_llama, reference, tmp_path, action):
    from pagoda import LLM, SamplingParams

    text, term = reference
    words = tmp_path / "banned.txt"
    words.write_text(f"*{term}*\n")
    llm = LLM(model=str(tiny_llama), dtype="float32", kv_cache_memory=0.02, moderation_words=[str(words)],
              moderation_action=action)
    hits = WordFilter.from_files([words]).scan(text)
    assert hits
    out = llm.generate(["The quick brown fox"] * 2, SamplingParams(temperature=0, max_tokens=32, n=2),
                       use_tqdm=False)
    for choice in (c for o in out for c in o.outputs):
        if action == "stop":
            assert choice.text == text[:hits[0].start] and choice.finish_reason == "content_filter"
            assert len(choice.token_ids) < 32  # it stopped there
        else:
            masked = list(text)
            for h in hits:
                masked[h.start:h.end] = "*" * (h.end - h.start)
            assert choice.text == "".join(masked) and choice.finish_reason == "length"
    with pytest.raises(ContentFilterError, match="banned"):
        llm.generate([f"say {term.upper()}"], SamplingParams(max_tokens=2), use_tqdm=False)
    assert llm.engine.core.stats().kv_cache_usage == 0  # the stopped requests freed their blocks

    if action == "stop":  # pagoda.lang's in-process engine, on the same LLM
        from pagoda import lang

        @lang.function
        def program(s):
            s += "The quick brown fox"
            s += lang.gen("out", max_tokens=32)

        state = program.run(backend=lang.Engine(llm=llm))
        assert state["out"] == text[:hits[0].start]
