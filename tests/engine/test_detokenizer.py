"""Incremental detokenization across characters split over several byte-level tokens."""

from __future__ import annotations

import pytest

from pagoda.engine.detokenizer import IncrementalDetokenizer
from pagoda.tokenizer import Tokenizer

TEXTS = [
    "你好，世界。机器学习很有趣！",
    "Emoji: 😀🚀🎉 and more 👩‍👩‍👧",
    "mixed ascii 和中文 with numbers 3.14159",
    "  leading spaces and\nnew lines\n",
]


@pytest.fixture(scope="module")
def tokenizer(tiny_llama) -> Tokenizer:
    return Tokenizer(tiny_llama)


@pytest.mark.parametrize("text", TEXTS)
def test_one_token_at_a_time_rebuilds_the_text(tokenizer, text):
    prompt = tokenizer.encode("Prompt: ")
    ids = tokenizer.encode(text)
    assert len(ids) > len(text) / 3  # the tiny tokenizer splits characters into byte tokens
    detok = IncrementalDetokenizer(tokenizer, prompt)
    deltas = [detok.step([t]) for t in ids]
    deltas.append(detok.flush())
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)
    assert detok.output_text == text


def test_broken_character_at_the_end_is_flushed(tokenizer):
    ids = tokenizer.encode("ok 😀")
    detok = IncrementalDetokenizer(tokenizer, [])
    partial = ids[:-1]  # the emoji lacks its last byte
    text = "".join(detok.step([t]) for t in partial)
    assert text == "ok "
    tail = detok.flush()
    assert tail.endswith("\ufffd")  # what is left is shown, not lost


def test_a_stream_error_falls_back_to_decoding_the_window(tokenizer):
    """tokenizers' DecodeStream refuses a window whose text changed as tokens came (InvalidPrefix,
    which no tokenizer here provokes): the detokenizer then decodes the window itself and starts
    a new stream, and the text comes out whole."""
    text = "mixed ascii 和中文 with numbers"
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer, [])

    class Refusing:
        def step(self, tokenizer, token):
            raise Exception("Invalid prefix encountered")

    deltas = [detok.step([ids[0]])]
    detok._stream = Refusing()
    deltas += [detok.step([t]) for t in ids[1:4]]
    deltas += [detok.step([t]) for t in ids[4:]] + [detok.flush()]
    assert "".join(deltas) == text


def test_special_tokens_skipped_or_kept(tokenizer):
    ids = tokenizer.encode("<|im_start|>hi<|im_end|>", add_special_tokens=False)
    skip = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=True)
    keep = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=False)
    assert "".join(skip.step([t]) for t in ids) == "hi"
    assert "".join(keep.step([t]) for t in ids) == "<|im_start|>hi<|im_end|>"


@pytest.fixture(scope="module")
def byte_fallback_tokenizer(tmp_path_factory) -> Tokenizer:
    """A Llama/SentencePiece-style tokenizer: Metaspace ('▁') words and <0xNN> byte-fallback
    tokens for characters outside the vocabulary (here: all CJK and emoji)."""
    import json

    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers

    tok = HFTokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.pre_tokenizer = pre_tokenizers.Split("▁", behavior="merged_with_next")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog, mixed ascii with numbers"] * 10, trainer)
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    d = tmp_path_factory.mktemp("bytefallback")
    (d / "tokenizer.json").write_text(json.dumps(spec))
    (d / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return Tokenizer(d)


@pytest.mark.parametrize("text", TEXTS[:3])
def test_byte_fallback_tokens(byte_fallback_tokenizer, text):
    tok = byte_fallback_tokenizer
    ids = tok.encode(text, add_special_tokens=False)
    assert any(t.startswith("<0x") for t in tok.convert_ids_to_tokens(ids))
    expected = tok.decode(ids)
    detok = IncrementalDetokenizer(tok, tok.encode("the fox", add_special_tokens=False))
    deltas = [detok.step([t]) for t in ids] + [detok.flush()]
    assert not any("\ufffd" in d for d in deltas)
    # The leading space the decoder strips at the start of a string is kept mid-stream.
    assert "".join(deltas) == " " + expected
