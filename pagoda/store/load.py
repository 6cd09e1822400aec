"""A model in a store → the files the engine loads (``ModelFiles``), with its layers applied.

The model layer is the GGUF (read in place: a blob, or the catalog's own copy of the same bytes).
Its metadata directory is the GGUF's conversion (``loader/gguf_model_dir.py``); when the model's other
layers change something, a small overlay directory beside it (``$PAGODA_HOME/converted/store-*``,
symlinks to the conversion plus the changed JSON) carries:

- ``num_ctx`` → ``max_position_embeddings`` when smaller, so ``max_model_len`` defaults to it;
- ``stop`` strings that are single tokens of the vocabulary → extra end-of-sequence ids;
- the system layer → a default system message, prepended by the chat template when the
  conversation has none;
- the template layer: Ollama templates are Go templates; ``gotemplate.to_jinja`` converts the
  common forms; when it cannot, the GGUF's own ``tokenizer.chat_template`` is used (the GGUF's
  template is preferred anyway when present, since it was written for the tokenizer);
- temperature / top_p / top_k / min_p / repeat_penalty / seed / num_predict are written to the
  overlay's ``generation_config.json`` under Hugging Face's names, where the engine reads its
  default sampling parameters (``pagoda/generation_defaults.py``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

from pagoda.loader import catalog
from pagoda.loader.model_files import ModelFiles
from pagoda.store import create, manifests, ollama_store
from pagoda.store.gotemplate import to_jinja
from pagoda.store.layout import StoreLayout, default_layout, digest_hex, parse_ref
from pagoda.store.manifests import Manifest

logger = logging.getLogger(__name__)

_OVERLAY_VERSION = 1
_SAMPLING_NAMES = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                   "repeat_penalty": "repetition_penalty", "seed": "seed", "num_predict": "max_new_tokens"}


def resolve_store_model(model: str):
    """``ModelFiles`` for ``model`` if it names a model in pagoda's store, or ``ollama:NAME`` in
    Ollama's; None if it is not a store name at all (so the caller tries the hub)."""
    if ollama_store.is_ollama_name(model):
        layout, _, manifest = create.locate(model)
        return model_files(model, layout, manifest)
    try:
        ref = parse_ref(model)
    except ValueError:
        return None
    layout = default_layout()
    manifest = manifests.read_manifest(layout, ref)
    if manifest is None:
        return None
    return model_files(model, layout, manifest)


def _catalog_copy(manifest: Manifest) -> Path | None:
    """The catalog's verified file with the same bytes as the model layer (same digest), if any:
    loading it reuses the catalog's conversion cache."""
    layer = manifest.layer(manifests.MODEL)
    for entry in catalog.CATALOG:
        if layer is not None and digest_hex(layer.digest) == entry.sha256 and catalog.is_pulled(entry.name):
            return catalog.model_path(entry)
    return None


def model_files(name: str, layout: StoreLayout, manifest: Manifest):
    from pagoda.loader.gguf_model_dir import load_gguf_model_dir  # deferred: loads gguf, numpy

    gguf_path = _catalog_copy(manifest) or create.model_path_of(layout, manifest)
    meta = load_gguf_model_dir(gguf_path)
    params = create.read_params(layout, manifest)
    system = create.read_text_layer(layout, manifest, manifests.SYSTEM)
    template = create.read_text_layer(layout, manifest, manifests.TEMPLATE)
    overlay = overlay_dir(meta, manifest.digest, params, system, template)
    adapter = manifest.layer(manifests.ADAPTER)
    return ModelFiles(name, overlay or meta, gguf_file=gguf_path,
                      adapter=layout.blob_path(adapter.digest) if adapter is not None else None)


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return {}


def _single_token_ids(meta: Path, texts: list[str]) -> list[int]:
    from tokenizers import Tokenizer  # deferred: tokenizers loads on first use

    tok = Tokenizer.from_file(str(meta / "tokenizer.json"))
    ids = []
    for text in texts:
        tid = tok.token_to_id(text)
        if tid is not None:
            ids.append(tid)
        else:
            logger.info("stop %r is not a single token: not applied (pass it as a stop string per request)", text)
    return ids


def default_system_prefix(system: str) -> str:
    """Jinja that makes ``system`` the first message when the conversation has no system message."""
    literal = json.dumps(system)  # a valid Jinja string literal (escapes are Python's)
    return ("{%- if not (messages and messages[0]['role'] == 'system') -%}"
            f"{{%- set messages = [{{'role': 'system', 'content': {literal}}}] + messages -%}}"
            "{%- endif -%}")


def overlay_contents(meta: Path, params: dict, system: str | None, template: str | None) -> dict[str, str]:
    """The files (name → text) that differ from the conversion in ``meta``; empty when none do."""
    changed: dict[str, str] = {}
    config = _read_json(meta / "config.json")
    num_ctx = params.get("num_ctx")
    if isinstance(num_ctx, int) and 0 < num_ctx < int(config.get("max_position_embeddings") or 0):
        config["max_position_embeddings"] = num_ctx
        changed["config.json"] = json.dumps(config, indent=2)
    generation = _read_json(meta / "generation_config.json")
    new_generation = dict(generation)
    stops = params.get("stop") or []
    if isinstance(stops, str):
        stops = [stops]
    stop_ids = _single_token_ids(meta, list(stops)) if stops else []
    if stop_ids:
        eos = generation.get("eos_token_id")
        eos = list(eos) if isinstance(eos, list) else ([] if eos is None else [eos])
        new_generation["eos_token_id"] = list(dict.fromkeys(eos + stop_ids))
    for ollama_name, hf_name in _SAMPLING_NAMES.items():
        if ollama_name in params:
            new_generation[hf_name] = params[ollama_name]
    if new_generation != generation:
        changed["generation_config.json"] = json.dumps(new_generation, indent=2)
    jinja = _read_json(meta / "tokenizer_config.json").get("chat_template")
    if isinstance(jinja, list):
        jinja = None
    if not jinja and template:
        try:
            jinja = to_jinja(template)
            changed["chat_template.jinja"] = jinja
        except ValueError as e:
            logger.warning("the model's TEMPLATE (a Go template) could not be converted to Jinja (%s), and its GGUF "
                           "has no chat template: chat needs --chat-template", e)
    if system and jinja:
        changed["chat_template.jinja"] = default_system_prefix(system) + jinja
    return changed


def overlay_dir(meta: Path, manifest_digest: str, params: dict, system: str | None, template: str | None) -> Path | None:
    """The overlay directory for these layers over ``meta`` (made once, atomically), or None when
    the layers change nothing."""
    changed = overlay_contents(meta, params, system, template)
    if not changed:
        return None
    root = meta.parent
    final = root / f"store-{digest_hex(manifest_digest)[:24]}-{meta.name[:12]}-v{_OVERLAY_VERSION}"
    if (final / "config.json").exists():
        return final
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-store-", dir=root))
    try:
        for entry in meta.iterdir():
            if entry.name not in changed:
                os.symlink(entry.resolve(), tmp / entry.name)
        for file_name, text in changed.items():
            (tmp / file_name).write_text(text)
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / "config.json").exists():
                raise
    finally:
        with contextlib.suppress(FileNotFoundError):
            shutil.rmtree(tmp)
    return final
