"""A GGUF's tokenizer (pagoda/loader/gguf_tokenizer.py): the converted tokenizer.json encodes
like the original, tokenizer_config.json and generation_config.json say what the original's do,
and transformers loads the result."""

from __future__ import annotations

import json

import pytest

ARCHS = ["llama", "qwen2", "qwen3"]  # the architectures of conftest.py's gguf_f32
TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "In 1492, numbers like 3.14159 and 2718 appear; 1234567890",
    "你好，世界。机器学习很有趣！",
    "Emoji: 😀🚀🎉 and a family 👨‍👩‍👧",
    "<|im_start|>user\nhi there<|im_end|>\n",
    "  leading spaces\tand\ttabs\n\nnewlines  ",
]


def test_generation_config(converted):
    generation = json.loads((converted["llama"] / "generation_config.json").read_text())
    assert generation["bos_token_id"] == 1
    # eos (<|im_end|>) first; llama.cpp also stops on the control token <|endoftext|>.
    assert generation["eos_token_id"] == [2, 0]


@pytest.mark.parametrize("arch", ARCHS)
def test_tokenizer_encodes_like_original(arch, tiny_model_dirs, converted):
    from tokenizers import Tokenizer

    original = Tokenizer.from_file(str(tiny_model_dirs[arch] / "tokenizer.json"))
    ours = Tokenizer.from_file(str(converted[arch] / "tokenizer.json"))
    for text in TEXTS:
        want = original.encode(text).ids
        assert ours.encode(text).ids == want, text
        assert ours.decode(want, skip_special_tokens=False) == original.decode(want, skip_special_tokens=False)
    assert ours.encode("<|im_start|>").ids == [1]


def test_tokenizer_config(tiny_model_dirs, converted):
    original = json.loads((tiny_model_dirs["llama"] / "tokenizer_config.json").read_text())
    ours = json.loads((converted["llama"] / "tokenizer_config.json").read_text())
    for key in ("bos_token", "eos_token", "pad_token", "add_bos_token", "chat_template"):
        assert ours[key] == original[key], key


def test_transformers_loads_converted_tokenizer(converted):
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(converted["qwen2"])
    assert tok.eos_token == "<|im_end|>"
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
