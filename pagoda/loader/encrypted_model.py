"""Loading an encrypted model (pagoda/loader/encrypted_container.py) without writing its weights
to disk.

Loading (``resolve_encrypted_model``, called by ``pagoda.loader.resolve.resolve_model`` when a file
starts with the magic): the tokenizer code and transformers read metadata from a directory, so the
small non-weight members (config.json, tokenizer files, chat templates; for a GGUF, the HF-style
metadata converted at encryption time) are written into a private directory (mode 0700, in
``/dev/shm`` where it exists, so in memory; else the system temp directory), removed when the
process that made it exits. Weight members (``*.safetensors``, ``*.gguf``, ...) are never written
there: ``open_encrypted_weights`` (called by ``pagoda.loader.model_loader``) decrypts them into
memfds, verifying every chunk before the first tensor is yielded, and hands their
``/proc/self/fd/N`` paths to the ordinary safetensors / GGUF readers.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pagoda.loader.encrypted_container import EncryptedModelReader, Member, is_weight_member
from pagoda.loader.model_files import EncryptedModel, ModelFiles
from pagoda.loader.model_keys import KEY_ENV, corrupted_error, load_key


_metadata_dirs: list[tuple[int, Path]] = []


def _remove_metadata_dirs() -> None:
    for pid, path in _metadata_dirs:
        if pid == os.getpid():  # not a forked child's copy of the list
            shutil.rmtree(path, ignore_errors=True)


atexit.register(_remove_metadata_dirs)


def private_metadata_dir() -> Path:
    """A new directory only this user can enter (0700), in ``/dev/shm`` (memory) where possible,
    removed when this process exits."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK | os.X_OK) else None
    try:
        path = Path(tempfile.mkdtemp(prefix="pagoda-model-meta-", dir=base))
    except OSError:
        path = Path(tempfile.mkdtemp(prefix="pagoda-model-meta-"))
    os.chmod(path, 0o700)
    _metadata_dirs.append((os.getpid(), path))
    return path


def _write_private(root: Path, name: str, data: bytes) -> None:
    target = root / name
    target.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _proc_path(fd: int) -> Path:
    return Path(f"/proc/self/fd/{fd}")


def resolve_encrypted_model(name: str, path: Path, key_file: str | os.PathLike | None = None,
                            key_env: str = KEY_ENV) -> ModelFiles:
    """``ModelFiles`` for a container: its key and header checked, its metadata members (never its
    weights) decrypted into a private directory (``private_metadata_dir``). For a GGUF container made
    by an older converter, the metadata is converted again from the GGUF decrypted into memory."""
    key_path = Path(os.path.expanduser(str(key_file))).absolute() if key_file is not None else None
    key = load_key(key_path, key_env)
    with EncryptedModelReader(path, key) as reader:
        meta_dir = private_metadata_dir()
        try:
            _decrypt_metadata(reader, meta_dir)
        except BaseException:
            shutil.rmtree(meta_dir, ignore_errors=True)
            raise
        digest = reader.header_digest.hex()
        fmt = reader.format
    encryption = EncryptedModel(Path(path).absolute(), fmt, key_path, key_env, digest)
    return ModelFiles(name, meta_dir, encryption=encryption)


def _decrypt_metadata(reader: EncryptedModelReader, meta_dir: Path) -> None:
    names = {m.name for m in reader.members}
    for m in reader.members:
        if not is_weight_member(m.name):
            _write_private(meta_dir, m.name, reader.read_member(m))
    if reader.format == "safetensors":
        if "config.json" not in names:
            raise corrupted_error(reader.path, "the model has no config.json")
        return
    from pagoda.loader.gguf_model_dir import _CONVERTER_VERSION, convert_gguf_metadata  # deferred: loads gguf, numpy

    if (reader.gguf_converter_version == _CONVERTER_VERSION and {"config.json", "tokenizer.json"} <= names):
        return
    fd = reader.decrypt_to_memfd(_gguf_member(reader))
    try:
        convert_gguf_metadata(_proc_path(fd), meta_dir)
    finally:
        os.close(fd)


def _gguf_member(reader: EncryptedModelReader) -> Member:
    ggufs = [m for m in reader.members if m.name.endswith(".gguf")]
    if len(ggufs) != 1:
        raise corrupted_error(reader.path, f"a GGUF container holds one .gguf member, found {len(ggufs)}")
    return ggufs[0]


def _safetensors_members(reader: EncryptedModelReader) -> list[Member]:
    by_name = {m.name: m for m in reader.members}
    index = by_name.get("model.safetensors.index.json")
    if index is not None:
        try:
            shards = sorted(set(json.loads(reader.read_member(index))["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{reader.path}: model.safetensors.index.json is not a valid safetensors index: {e}") from None
        missing = [s for s in shards if s not in by_name]
        if missing:
            raise ValueError(f"{reader.path}: safetensors shards listed in the index are missing: {', '.join(missing)}")
        return [by_name[s] for s in shards]
    members = [m for m in reader.members if m.name.endswith(".safetensors") and "/" not in m.name]
    if not members:
        raise ValueError(f"{reader.path}: no *.safetensors weights in the encrypted model")
    return members


def open_encrypted_weights(files: ModelFiles, hf_config: dict, *, keep_quantized: bool = False,
                           narrow=None) -> Iterator[tuple[str, Any]]:
    """The weights of an encrypted model, as ``iter_gguf_weights`` / ``iter_safetensors_weights``
    yield them. Every weight member is decrypted into memory and authenticated here, before this
    returns, so a wrong key or a tampered chunk is a ValueError before any tensor is loaded."""
    enc = files.encryption
    key = enc.key()
    with EncryptedModelReader(enc.container, key) as reader:
        if enc.header_sha256 and reader.header_digest.hex() != enc.header_sha256:
            raise ValueError(f"{enc.container} changed after it was opened (a different encrypted model)")
        members = [_gguf_member(reader)] if reader.format == "gguf" else _safetensors_members(reader)
        fds: list[int] = []
        try:
            for m in members:
                fds.append(reader.decrypt_to_memfd(m))
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        fmt = reader.format
    return iter(_DecryptedWeights(fmt, fds, hf_config, keep_quantized, narrow))


class _DecryptedWeights:
    """Iterates the weights of the decrypted members (memfds), then closes the descriptors; the
    mappings the readers made keep their memory as long as tensors use it."""

    def __init__(self, fmt: str, fds: list[int], hf_config: dict, keep_quantized: bool, narrow) -> None:
        self._fmt, self._fds, self._hf_config = fmt, fds, hf_config
        self._keep_quantized, self._narrow = keep_quantized, narrow

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        try:
            paths = [_proc_path(fd) for fd in self._fds]
            if self._fmt == "gguf":
                from pagoda.loader.gguf_weights import iter_gguf_weights  # deferred: loads gguf, numpy, torch

                yield from iter_gguf_weights(paths[0], self._hf_config, keep_quantized=self._keep_quantized,
                                             narrow=self._narrow)
            else:
                from pagoda.loader.safetensors import iter_safetensors_weights  # deferred: loads torch

                for i, path in enumerate(paths):  # each shard's memory goes back once it is read
                    yield from iter_safetensors_weights(None, narrow=self._narrow, files=[path])
                    os.close(self._fds[i])
                    self._fds[i] = -1
        finally:
            self.close()

    def close(self) -> None:
        fds, self._fds = self._fds, []
        for fd in fds:
            if fd >= 0:
                os.close(fd)

    def __del__(self) -> None:
        self.close()
