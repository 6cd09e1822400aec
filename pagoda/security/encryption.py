"""`pagoda encrypt`: sealing a model into an encrypted container, and its key files.

``pagoda encrypt MODEL -o OUT --key-file K`` seals a GGUF file or a Hugging Face directory (config,
tokenizer, ``*.safetensors``: every file) into one container; ``--model OUT --model-key-file K``
(or the key in ``$PAGODA_MODEL_KEY``) serves it. Decryption happens in memory: the weights are
decrypted into anonymous memory (a Linux ``memfd_create`` file, mapped like the file it replaces)
and never written to disk.

The container's format: pagoda/loader/encrypted_container.py; loading it:
pagoda/loader/encrypted_model.py.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagoda.home import pagoda_home
from pagoda.loader.encrypted_container import (
    CIPHER, DEFAULT_CHUNK_SIZE, HEADER_INDEX, MAGIC, MAX_CHUNK_SIZE, MIN_CHUNK_SIZE, NONCE_PREFIX_SIZE, PREFIX,
    SALT_SIZE, VERSION, chunk_aad, chunk_count, chunk_nonce, is_encrypted_model, is_weight_member,
)
from pagoda.loader.model_keys import KEY_SIZE, SCRYPT_PARAMS, ModelKey, derive_file_key
from pagoda.loader.resolve import resolve_model


def generate_key_file(path: str | os.PathLike, *, force: bool = False) -> Path:
    """Write a fresh random 256-bit key to ``path`` as 64 hex characters and a newline, mode 0600.
    Refuses to overwrite an existing file unless ``force``."""
    path = Path(os.path.expanduser(str(path)))
    flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if force else os.O_EXCL)
    try:
        fd = os.open(path, flags, 0o600)
    except FileExistsError:
        raise ValueError(f"{path} already exists; not overwriting a key (pass --force to replace it)") from None
    except OSError as e:
        raise ValueError(f"cannot create the key file {path}: {e}") from None
    try:
        os.fchmod(fd, 0o600)  # an existing file (force) keeps its mode otherwise
        os.write(fd, (secrets.token_bytes(KEY_SIZE).hex() + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    return path


@dataclass(frozen=True)
class _Source:
    name: str
    path: Path
    size: int


def _hf_dir_sources(model_dir: Path) -> list[_Source]:
    """Every regular file under the directory (symlinks followed; hidden files and directories
    skipped), metadata first, then weights, each group in name order."""
    sources = []
    for root, dirs, files in os.walk(model_dir, followlinks=True):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(files):
            if name.startswith("."):
                continue
            path = Path(root) / name
            if not path.is_file() or is_encrypted_model(path):  # e.g. an earlier container written here
                continue
            rel = path.relative_to(model_dir).as_posix()
            sources.append(_Source(rel, path, path.stat().st_size))
    sources.sort(key=lambda s: (is_weight_member(s.name), s.name))
    return sources


def _gguf_metadata_dir(gguf_path: Path, scratch: Path) -> Path:
    """The HF-style metadata pagoda converts a GGUF to: the cached conversion if there is one,
    else converted into ``scratch`` (no cache entry is left behind)."""
    from pagoda.loader import gguf_model_dir  # deferred: loads gguf, numpy

    cached = pagoda_home() / "converted" / gguf_model_dir._cache_key(gguf_path)
    if (cached / "config.json").is_file() and (cached / "tokenizer.json").is_file():
        return cached
    return gguf_model_dir.convert_gguf_metadata(gguf_path, scratch)


def _model_sources(model: Path, scratch: Path, name: str) -> tuple[str, list[_Source], dict[str, Any]]:
    if model.is_dir():
        if not (model / "config.json").is_file():
            ggufs = sorted(model.glob("*.gguf"))
            if len(ggufs) == 1:
                return _model_sources(ggufs[0], scratch, name)
            raise ValueError(f"{model} is not a model directory: no config.json (and not exactly one .gguf file)")
        sources = _hf_dir_sources(model)
        if not any(s.name.endswith(".safetensors") for s in sources):
            raise ValueError(f"no *.safetensors weights in {model}")
        return "safetensors", sources, {}
    if model.is_file():
        if is_encrypted_model(model):
            raise ValueError(f"{model} is already an encrypted model")
        if model.suffix != ".gguf":
            raise ValueError(f"{model}: a model file must be a .gguf file (or pass a Hugging Face model directory)")
        return _gguf_sources(model, _gguf_metadata_dir(model, scratch))
    # A catalog or store name (`smollm2`, `name:tag`, `ollama:NAME`): what --model would load, the
    # store's overlays (context, system prompt, template) included.

    files = resolve_model(name)
    if files.encryption is not None:
        raise ValueError(f"{name} is already an encrypted model")
    if files.gguf_file is not None:
        return _gguf_sources(Path(files.gguf_file), Path(files.metadata_dir))
    return _model_sources(Path(files.metadata_dir), scratch, name)


def _gguf_sources(gguf_path: Path, meta: Path) -> tuple[str, list[_Source], dict[str, Any]]:
    from pagoda.loader.gguf_model_dir import _CONVERTER_VERSION  # deferred: loads gguf, numpy

    sources = [_Source(p.name, p, p.stat().st_size) for p in sorted(meta.iterdir())
               if p.is_file() and not is_weight_member(p.name)]
    member = gguf_path.name if gguf_path.name.endswith(".gguf") else "model.gguf"  # store blobs: sha256-<hex>
    sources.append(_Source(member, gguf_path, gguf_path.stat().st_size))
    return "gguf", sources, {"gguf_converter_version": _CONVERTER_VERSION}


def encrypt_model(model: str | os.PathLike, out: str | os.PathLike, key: ModelKey, *,
                  chunk_size: int = DEFAULT_CHUNK_SIZE, force: bool = False,
                  progress: Callable[[int], None] | None = None) -> Path:
    """Seal ``model`` (a .gguf file, a Hugging Face directory, or a catalog / store name as
    ``--model`` takes it) into the container ``out``.

    A GGUF is stored with its HF-style metadata (config, tokenizer) converted now, so that loading
    the container never needs transformers. Written to a temporary file beside ``out``, then renamed:
    an interrupted run leaves no partial container. ``progress(n)`` is called with plaintext bytes
    as they are sealed."""
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM  # cryptography loads on first use

    model_arg = str(model)
    model = Path(os.path.expanduser(model_arg))
    out = Path(os.path.expanduser(str(out)))
    if not MIN_CHUNK_SIZE <= chunk_size <= MAX_CHUNK_SIZE:
        raise ValueError(f"chunk size must be in [{MIN_CHUNK_SIZE}, {MAX_CHUNK_SIZE}] bytes, got {chunk_size}")
    if out.exists():
        if model.exists() and out.resolve() == model.resolve():
            raise ValueError(f"the output {out} would overwrite the model it encrypts")
        if not force:
            raise ValueError(f"{out} already exists (pass --force to replace it)")
        if out.is_dir():
            raise ValueError(f"{out} is a directory")
    salt, nonce_prefix = secrets.token_bytes(SALT_SIZE), secrets.token_bytes(NONCE_PREFIX_SIZE)
    kdf = {"name": "none"} if key.kind == "raw" else {"name": "scrypt", **SCRYPT_PARAMS}
    aes = AESGCM(derive_file_key(key, kdf, salt, out))
    scratch = Path(tempfile.mkdtemp(prefix="pagoda-encrypt-"))
    tmp_path: Path | None = None
    try:
        fmt, sources, extra = _model_sources(model, scratch, model_arg)
        header = {
            "format": fmt, "cipher": CIPHER, "chunk_size": chunk_size, "kdf": kdf,
            "salt": salt.hex(), "nonce_prefix": nonce_prefix.hex(),
            "members": [{"name": s.name, "size": s.size} for s in sources], **extra,
        }
        header_json = json.dumps(header, sort_keys=True).encode()
        signed = PREFIX.pack(MAGIC, VERSION, len(header_json)) + header_json
        digest = hashlib.sha256(signed).digest()
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
        tmp_path = Path(name)
        with os.fdopen(fd, "wb") as f:
            f.write(signed)
            f.write(aes.encrypt(chunk_nonce(nonce_prefix, HEADER_INDEX, HEADER_INDEX), b"", signed))
            for index, source in enumerate(sources):
                _seal_member(f, aes, source, index, chunk_size, nonce_prefix, digest, progress)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_path, out)
        tmp_path = None
        return out
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        if tmp_path is not None:
            tmp_path.unlink(missing_ok=True)


def _seal_member(f, aes, source: _Source, index: int, chunk_size: int, nonce_prefix: bytes, digest: bytes,
                 progress: Callable[[int], None] | None) -> None:
    chunks = chunk_count(source.size, chunk_size)
    with open(source.path, "rb") as src:
        for i in range(chunks):
            plain = src.read(chunk_size)
            expected = min(chunk_size, source.size - i * chunk_size)
            if len(plain) != expected:
                raise ValueError(f"{source.path} changed while it was being encrypted")
            last = i == chunks - 1
            f.write(aes.encrypt(chunk_nonce(nonce_prefix, index, i), plain, chunk_aad(digest, index, i, last)))
            if progress is not None:
                progress(len(plain))
        if src.read(1):
            raise ValueError(f"{source.path} changed while it was being encrypted")
