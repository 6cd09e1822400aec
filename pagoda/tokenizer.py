"""Tokenizer and chat template of a model, from its metadata directory (tokenizer.json et al.).

Uses the `tokenizers` library for encoding/decoding and jinja2 (sandboxed, with Hugging Face's
template conventions) for chat templates, so transformers is not needed at run time.
"""

from __future__ import annotations

import functools
import json
from datetime import datetime
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer


def _token_text(value: Any) -> str | None:
    """tokenizer_config.json stores special tokens as a string or as {"content": ...}."""
    if isinstance(value, dict):
        return value.get("content")
    return value


def _read_json(path: Path) -> dict:
    if not path.exists():
        return {}
    try:
        return json.loads(path.read_text())
    except ValueError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None


class Tokenizer:
    def __init__(self, model_dir: Path, chat_template: str | None = None) -> None:
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.exists():
            raise ValueError(f"{model_dir} has no tokenizer.json (only fast tokenizers are supported)")
        try:
            self._tok = HFTokenizer.from_file(str(path))
        except Exception as e:
            raise ValueError(f"cannot load {path}: {e}") from None
        # A tokenizer.json may carry padding and truncation (all-MiniLM-L6-v2's: pad every text to
        # 128 tokens, cut it there): a prompt is neither padded nor silently cut; the engine's
        # limits refuse one too long for the model.
        self._tok.no_padding()
        self._tok.no_truncation()
        config = _read_json(model_dir / "tokenizer_config.json")
        generation = _read_json(model_dir / "generation_config.json")
        model_config = _read_json(model_dir / "config.json")
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.bos_token_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        self.eos_token_ids = self._eos_ids(config, generation, model_config)
        self.eos_token_id = self.eos_token_ids[0] if self.eos_token_ids else None
        self.chat_template = chat_template or self._find_template(model_dir, config)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

    def _eos_ids(self, config: dict, generation: dict, model_config: dict) -> list[int]:
        ids: list[int] = []
        for source in (generation.get("eos_token_id"), model_config.get("eos_token_id")):
            if source is None:
                continue
            ids += source if isinstance(source, list) else [source]
        if self.eos_token is not None:
            tid = self._tok.token_to_id(self.eos_token)
            if tid is not None:
                ids.insert(0, tid)
        return list(dict.fromkeys(ids))

    @staticmethod
    def _find_template(model_dir: Path, config: dict) -> str | None:
        jinja = model_dir / "chat_template.jinja"
        if jinja.exists():
            return jinja.read_text()
        template = config.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default") or next(iter(named.values()), None)
        if template is None and (model_dir / "chat_template.json").exists():
            template = _read_json(model_dir / "chat_template.json").get("chat_template")
        return template

    # -- encode / decode --------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_pair(self, text: str, pair: str) -> list[int]:
        """Two texts as one prompt, as a cross-encoder reads them ([CLS] text [SEP] pair [SEP])."""
        return self._tok.encode(text, pair).ids

    def encode_truncated(self, text: str, max_tokens: int) -> list[int]:
        """At most ``max_tokens`` ids, the text cut at its end and the special tokens kept (as
        transformers truncates: a BERT prompt still ends in [SEP]); for truncate_prompt_tokens and
        Ollama's `truncate`."""
        encoding = self._tok.encode(text, add_special_tokens=False)
        encoding.truncate(max(1, max_tokens - self._tok.num_special_tokens_to_add(False)))
        return self._tok.post_process(encoding).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    @property
    def backend(self) -> HFTokenizer:
        """The tokenizers library's object (its ``DecodeStream`` decodes through it)."""
        return self._tok

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return [self._tok.id_to_token(i) or "" for i in ids]

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    # -- chat -------------------------------------------------------------------------------
    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        if not self.chat_template:
            raise ValueError("this model has no chat template (a base model: use completions, e.g. /v1/completions); "
                             "to chat with it anyway, pass one with chat_template=... (or --chat-template)")
        _validate_messages(messages)
        template = _compile_template(self.chat_template)
        return template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            **kwargs,
        )

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> list[int]:
        # The template writes the special tokens itself (as transformers does).
        return self.encode(self.apply_chat_template(messages, add_generation_prompt, **kwargs), add_special_tokens=False)


def _validate_messages(messages: list[dict]) -> None:
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m:
            raise ValueError(f"messages[{i}] must be a dict with a 'role'")


class RenderTooLong(ValueError):
    """A template's output passed the characters it may render (render_bounded)."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"the template renders to more than {limit} characters")
        self.limit = limit


def render_bounded(template, max_chars: int, **context) -> str:
    """Render a compiled template piece by piece (Jinja's generate), stopping as soon as the text
    passes `max_chars`: a template a request sends may loop far past any context (RenderTooLong)."""
    pieces, total = [], 0
    stream = template.generate(**context)
    try:
        for piece in stream:
            total += len(piece)
            if total > max_chars:
                raise RenderTooLong(max_chars)
            pieces.append(piece)
    finally:
        stream.close()
    return "".join(pieces)


@functools.lru_cache(maxsize=1)
def _environment():
    from jinja2.exceptions import TemplateError  # deferred: jinja2 loads on first use
    from jinja2.ext import loopcontrols  # deferred: jinja2 loads on first use
    from jinja2.sandbox import ImmutableSandboxedEnvironment  # deferred: jinja2 loads on first use

    def raise_exception(message: str):
        raise TemplateError(message)

    def tojson(value, indent=None, ensure_ascii=False, sort_keys=False):
        return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def compile_template(source: str):
    """A Jinja template in pagoda's sandboxed environment (not cached: a request's own template,
    Ollama's `template` field, compiles anew each time rather than filling a cache)."""
    from jinja2.exceptions import TemplateError  # deferred: jinja2 loads on first use

    try:
        return _environment().from_string(source)
    except TemplateError as e:
        raise ValueError(f"invalid chat template: {e}") from None


_compile_template = functools.lru_cache(maxsize=16)(compile_template)  # the model's templates


def read_chat_template(template: str | None) -> str | None:
    """--chat-template takes a template string or a path to a file holding one."""
    if template is None:
        return None
    path = Path(template).expanduser()
    if len(template) < 4096 and path.is_file():
        return path.read_text()
    return template


def tokenizer_of(model: str) -> Tokenizer:
    """The tokenizer of a model named as ``--model`` takes it (a directory, a .gguf, a catalog or
    store name); never downloads. A directory holding its tokenizer.json is read as it is, without
    the loader (which brings torch: the router reads tokenizers this way too)."""
    path = Path(model).expanduser()
    if (path / "tokenizer.json").is_file():
        return Tokenizer(path)
    from pagoda.loader.resolve import resolve_model  # deferred: the loader brings torch

    return Tokenizer(resolve_model(model).metadata_dir)
