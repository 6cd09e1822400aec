"""What `--model` names: a Hugging Face directory, a .gguf file, a model in the store (`name:tag`,
registry-qualified, or `ollama:NAME[:TAG]` in Ollama's store), a catalog name, or a hub repo id."""

from __future__ import annotations

import os
from pathlib import Path
from pagoda.loader import catalog
from pagoda.loader.encrypted_container import is_encrypted_model
from pagoda.loader.encrypted_model import resolve_encrypted_model
from pagoda.loader.model_files import ModelFiles
from pagoda.store.load import resolve_store_model


def resolve_model(model: str, key_file: str | None = None) -> ModelFiles:
    """``key_file``: the key of an encrypted model (`pagoda encrypt`); without it, $PAGODA_MODEL_KEY."""
    path = Path(os.path.expanduser(model))
    if path.is_dir():
        return _resolve_dir(model, path)
    if path.is_file():
        if is_encrypted_model(path):  # recognised by its magic bytes, whatever its name
            return resolve_encrypted_model(model, path, key_file)
        if path.suffix != ".gguf":
            raise ValueError(f"{model}: a model file must be a .gguf file (or pass a Hugging Face model directory)")
        return _resolve_gguf(model, path)

    stored = resolve_store_model(model)  # ValueError for a missing ollama:NAME
    if stored is not None:
        return stored
    entry = catalog.resolve_catalog_name(model)
    if entry is not None:
        return _resolve_gguf(model, catalog.pull(entry.name))
    if _looks_like_repo_id(model):
        return _resolve_dir(model, _download_from_hub(model))
    names = ", ".join(e.name for e in catalog.CATALOG)
    raise ValueError(
        f"model {model!r} not found: it is not a local directory or .gguf file, nor a model in the store "
        f"(`pagoda list`), nor a catalog name ({names})"
    )


def _resolve_dir(name: str, path: Path) -> ModelFiles:
    if (path / "config.json").exists():
        return ModelFiles(name, path)
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return _resolve_gguf(name, ggufs[0])
    raise ValueError(f"{path} is not a model directory: no config.json (and not exactly one .gguf file)")


def _resolve_gguf(name: str, path: Path) -> ModelFiles:
    from pagoda.loader.gguf_model_dir import load_gguf_model_dir  # deferred: loads gguf, numpy

    return ModelFiles(name, load_gguf_model_dir(path), gguf_file=path)


def _looks_like_repo_id(model: str) -> bool:
    parts = model.split("/")
    return len(parts) == 2 and all(parts) and not model.startswith((".", "/", "~"))


def _download_from_hub(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download  # optional: huggingface_hub may be absent
    except ImportError:
        raise ValueError(
            f"{repo_id!r} looks like a Hugging Face repo id, but huggingface_hub is not installed "
            "(pip install 'pagoda[hub]'); or pass a local directory, a .gguf file or a catalog name"
        ) from None
    try:
        return Path(snapshot_download(
            repo_id, allow_patterns=["*.json", "*.safetensors", "*.jinja", "tokenizer*"],
        ))
    except Exception as e:  # offline, no such repo, gated, ...
        reason = " ".join(str(e).split())
        raise ValueError(
            f"could not download {repo_id!r} from the Hugging Face hub ({type(e).__name__}: {reason}). "
            "Offline? Pass a local model directory, a .gguf file, or a catalog name (`pagoda list`)."
        ) from None
