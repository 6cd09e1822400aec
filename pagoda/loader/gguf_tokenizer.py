"""A GGUF's tokenizer → ``tokenizer.json`` and ``tokenizer_config.json`` contents, and the token
ids generation ends on.

The tokenizer goes through transformers' GGUF support (slow to import, so gguf_model_dir.py
caches what this converts), with llama.cpp's behaviour laid over it: the pre-tokenizers
transformers does not map, BOS / EOS added as the file says, and the end-of-generation tokens
llama.cpp stops on.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pagoda.loader.gguf_file import GGUFFile

logger = logging.getLogger(__name__)

# Token texts llama.cpp treats as end-of-generation besides the eos id (llama-vocab.cpp).
_END_OF_GENERATION_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
                            "<EOT>", "<|end_of_text|>", "<｜end▁of▁sentence｜>")
_CONTROL_TOKEN = 3


def end_of_generation_ids(gf: GGUFFile) -> list[int]:
    """eos first, then eot/eom and the control tokens llama.cpp also stops on."""
    md = gf.metadata
    ids = [md.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    tokens, types = md.get("tokenizer.ggml.tokens") or [], md.get("tokenizer.ggml.token_type") or []
    ids += [i for i, (text, kind) in enumerate(zip(tokens, types))
            if kind == _CONTROL_TOKEN and text in _END_OF_GENERATION_TEXTS]
    return list(dict.fromkeys(i for i in ids if i is not None))


def _pre_tokenizer_fixup(pre: str | None) -> Any:
    """A pre-tokenizer for ``tokenizer.ggml.pre`` values transformers does not map (it then falls
    back to plain GPT-2 byte-level splitting), or None to keep what transformers built.

    llama.cpp's "smollm", "starcoder" and "refact" split every digit apart first, then apply the GPT-2
    regex: exactly HF's ``Digits(individual_digits=True)`` + ``ByteLevel(use_regex=True)``, which is
    what SmolLM2's own tokenizer.json says.
    """
    from tokenizers import pre_tokenizers  # deferred: tokenizers loads on first use

    if pre in ("smollm", "starcoder", "refact"):
        return pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ])
    return None


def _bos_eos_post_processor(bos: str | None, eos: str | None, vocab: Mapping[str, int]) -> Any:
    """A TemplateProcessing that adds ``bos``/``eos`` (either may be None) around each sequence."""
    from tokenizers import processors  # deferred: tokenizers loads on first use

    before = [bos] if bos else []
    after = [eos] if eos else []
    single = before + ["$A:0"] + after
    pair = single + [f"{t}:1" for t in before] + ["$B:1"] + [f"{t}:1" for t in after]
    special = [(t, vocab[t]) for t in dict.fromkeys(before + after)]
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)


def _convert_tokenizer_with_transformers(gguf_path: Path, model_type: str) -> str:
    """transformers' GGUF tokenizer conversion, as a tokenizer.json string (slow: imports transformers).

    ``model_type`` (the converted config's) names the tokenizer class where transformers knows it
    (Gemma 3's class adds its ``<mask>`` token). Where it knows none (llama, mistral, SmolLM2) the
    tokenizer fields alone are converted: AutoTokenizer would read the model's config from the
    file to find a class, parsing every field in full, one element at a time (SmolLM2: 11 s where
    the fields take 1 s; a 500k-item array a hostile 4 MB file adds: ~800 MiB), and the result is
    the same tokenizer.json."""
    from transformers import AutoTokenizer  # transformers loads on first use
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES  # transformers loads on first use

    if model_type not in TOKENIZER_MAPPING_NAMES:
        return _tokenizer_from_fields(gguf_path)
    by_type = {"tokenizer_type": model_type}

    with tempfile.TemporaryDirectory(prefix="pagoda-gguf-tok-") as tmp:
        # A directory holding only the GGUF, so nothing else next to the file can be picked up.
        link = Path(tmp) / gguf_path.name
        target = gguf_path.resolve()
        if not target.exists():  # /proc/self/fd/N of a GGUF decrypted into memory: link to the fd itself
            target = gguf_path.absolute()
        try:
            link.symlink_to(target)
        except OSError:
            shutil.copyfile(gguf_path, link)
        try:
            tok = AutoTokenizer.from_pretrained(tmp, gguf_file=gguf_path.name, **by_type)
        except Exception as exc:
            if "is not supported" in str(exc):  # an architecture transformers cannot load (olmoe)
                return _tokenizer_from_fields(link)
            raise ValueError(f"{gguf_path}: could not convert the GGUF tokenizer: {exc}") from exc
    return tok.backend_tokenizer.to_str()


def _tokenizer_from_fields(path: Path) -> str:
    """transformers' converter of a GGUF's tokenizer fields alone, for a file whose architecture
    transformers does not load (AutoTokenizer reads the model's config too)."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (  # transformers loads on first use
        convert_gguf_tokenizer,
        get_gguf_tokenizer,
    )

    try:
        architecture, fields, _ = get_gguf_tokenizer(str(path))
        backend, _ = convert_gguf_tokenizer(architecture, fields)
    except Exception as exc:
        raise ValueError(f"{path}: could not convert the GGUF tokenizer: {exc}") from exc
    return backend.to_str()


def _tokenizer_settings(gf: GGUFFile) -> dict[str, Any]:
    md = gf.metadata
    tokens = md.get("tokenizer.ggml.tokens") or []

    def text(key: str) -> str | None:
        index = md.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[index] if index is not None and 0 <= index < len(tokens) else None

    # llama.cpp adds BOS to sentencepiece ("llama") vocabularies unless the file says otherwise.
    add_bos_default = md.get("tokenizer.ggml.model") == "llama"
    return {
        "bos_token": text("bos"),
        "eos_token": text("eos"),
        "pad_token": text("padding"),
        "unk_token": text("unknown"),
        "add_bos_token": bool(md.get("tokenizer.ggml.add_bos_token", add_bos_default)),
        "add_eos_token": bool(md.get("tokenizer.ggml.add_eos_token", False)),
    }


def convert_tokenizer(gf: GGUFFile, config: Mapping[str, Any]) -> tuple[Any, dict[str, Any]]:
    """The GGUF's tokenizer (a ``tokenizers.Tokenizer``, what tokenizer.json holds) and the
    contents of its tokenizer_config.json."""
    from tokenizers import Tokenizer  # deferred: tokenizers loads on first use

    settings = _tokenizer_settings(gf)
    tokenizer = Tokenizer.from_str(_convert_tokenizer_with_transformers(gf.path, config["model_type"]))
    pre = gf.metadata.get("tokenizer.ggml.pre")
    fixed = _pre_tokenizer_fixup(pre)
    if fixed is not None:
        logger.info("%s: tokenizer.ggml.pre=%r: using digit-splitting byte-level pre-tokenizer", gf.path, pre)
        tokenizer.pre_tokenizer = fixed
    # Make tokenizer.json's own special-token handling match add_bos/add_eos, so that a plain
    # `Tokenizer.from_file(...).encode(text)` gives what llama.cpp would.
    bos = settings["bos_token"] if settings["add_bos_token"] else None
    eos = settings["eos_token"] if settings["add_eos_token"] else None
    if bos or eos:
        tokenizer.post_processor = _bos_eos_post_processor(bos, eos, tokenizer.get_vocab(with_added_tokens=True))

    tokenizer_config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **settings,
        "clean_up_tokenization_spaces": False,
        "model_max_length": config["max_position_embeddings"],
    }
    chat_template = gf.metadata.get("tokenizer.chat_template")
    if chat_template:
        tokenizer_config["chat_template"] = chat_template
    return tokenizer, tokenizer_config
