"""The tokenizer of a GGUF pagoda writes (gguf_writer.py): byte-level BPE from ``tokenizer.json``
(vocabulary, merges, token types, bos / eos / pad, the chat template), with the
``tokenizer.ggml.pre`` name that selects the same pre-tokenization in llama.cpp. A pre-tokenizer
this module does not recognise is refused rather than written as something that would split text
differently; SentencePiece / Unigram tokenizers are refused too.
"""

from __future__ import annotations

import json
from pathlib import Path

# Pre-tokenizer regexes of tokenizer.json → llama.cpp's name for the same splitting.
_LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def pre_tokenizer_name(pre_tokenizer: dict | None) -> str:
    """llama.cpp's `tokenizer.ggml.pre` for a tokenizer.json pre-tokenizer (ValueError if unknown)."""
    kinds = [p.get("type") for p in (pre_tokenizer or {}).get("pretokenizers", [pre_tokenizer or {}])]
    if kinds == ["ByteLevel"] and (pre_tokenizer or {}).get("use_regex", True):
        return "gpt-2"
    if kinds == ["Digits", "ByteLevel"] and pre_tokenizer["pretokenizers"][0].get("individual_digits"):
        return "smollm"  # digits apart, then GPT-2's regex (also starcoder's, refact's)
    if kinds and kinds[0] == "Split":
        regex = ((pre_tokenizer.get("pretokenizers") or [pre_tokenizer])[0].get("pattern") or {}).get("Regex")
        if regex == _LLAMA3_REGEX:
            return "llama-bpe"
        if regex == _QWEN2_REGEX:
            return "qwen2"
    raise ValueError(f"cannot write this tokenizer to GGUF: its pre-tokenizer ({json.dumps(pre_tokenizer)[:200]}) "
                     "is not one llama.cpp names that pagoda recognises (gpt-2, smollm, llama-bpe, qwen2)")


def add_tokenizer(writer, hf_dir: Path, config: dict) -> None:
    import gguf  # deferred: gguf loads on first use

    path = hf_dir / "tokenizer.json"
    if not path.is_file():
        raise ValueError(f"{hf_dir} has no tokenizer.json: only byte-level BPE tokenizers can be written to GGUF")
    tok = json.loads(path.read_text())
    if (tok.get("model") or {}).get("type") != "BPE":
        raise ValueError(f"cannot write this tokenizer to GGUF: {tok.get('model', {}).get('type')} tokenizers are "
                         "not supported (byte-level BPE only)")
    pre = pre_tokenizer_name(tok.get("pre_tokenizer"))
    tok_config_path = hf_dir / "tokenizer_config.json"
    tok_config = json.loads(tok_config_path.read_text()) if tok_config_path.is_file() else {}
    vocab = dict(tok["model"]["vocab"])
    special = {t["content"]: t["id"] for t in tok.get("added_tokens", []) if t.get("special", True)}
    vocab.update({t["content"]: t["id"] for t in tok.get("added_tokens", [])})
    size = max(config["vocab_size"], max(vocab.values()) + 1)
    tokens: list[str | None] = [None] * size
    for text, index in vocab.items():
        tokens[index] = text
    tokens = [text if text is not None else f"[PAD{i}]" for i, text in enumerate(tokens)]  # as llama.cpp pads
    token_types = [gguf.TokenType.CONTROL if text in special else
                   gguf.TokenType.UNUSED if text.startswith("[PAD") else gguf.TokenType.NORMAL for text in tokens]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(token_types)
    writer.add_token_merges(merges)
    for key, add in (("bos_token_id", writer.add_bos_token_id), ("eos_token_id", writer.add_eos_token_id),
                     ("pad_token_id", writer.add_pad_token_id)):
        value = config.get(key)
        if isinstance(value, list):
            value = value[0] if value else None
        if value is not None:
            add(int(value))
    writer.add_add_bos_token(bool(tok_config.get("add_bos_token", False)))
    template = tok_config.get("chat_template")
    if isinstance(template, str) and template:
        writer.add_chat_template(template)
    elif (hf_dir / "chat_template.jinja").is_file():
        writer.add_chat_template((hf_dir / "chat_template.jinja").read_text())
