"""The encrypted model container: an authenticated AES-256-GCM file holding a whole model
(`pagoda encrypt`, pagoda/security/encryption.py, writes it; pagoda/loader/encrypted_model.py
loads it).

Container format, version 1 (integers big-endian)::

    magic        8 bytes   b"PAGODAEM"
    version      u16       1
    header_len   u32
    header       header_len bytes of UTF-8 JSON: format ("gguf" | "safetensors"), chunk_size,
                 cipher ("AES-256-GCM"), kdf ({"name": "none"} or {"name": "scrypt", n, r, p}),
                 salt (32 random bytes, hex), nonce_prefix (4 random bytes, hex), members
                 ([{name, size}], in storage order), gguf_converter_version (gguf only)
    header_tag   16 bytes  the AES-GCM tag of an empty plaintext whose associated data is every
                           byte before it (nonce: nonce_prefix || FFFFFFFF || FFFFFFFF), so a wrong
                           key or an edited header is caught before anything is decrypted
    chunks       per member, in order: max(1, ceil(size / chunk_size)) chunks, each the AES-256-GCM
                 ciphertext of chunk_size plaintext bytes (the last one shorter) and its 16-byte tag;
                 nonce = nonce_prefix || member index u32 || chunk index u32;
                 AAD = b"PGDC" || SHA-256(magic .. header) || member index u32 || chunk index u32 ||
                 last-chunk flag u8

Every chunk is bound to its place (member, index, last flag) and to the header (and so to every
member's size), so a chunk cannot be edited, moved, swapped, dropped or cut short, and the file's
exact length follows from the header: a truncated file or trailing bytes are errors too.

Keys: a key file (or ``$PAGODA_MODEL_KEY``) holding 64 hex characters (what ``pagoda encrypt
--generate-key`` writes) or exactly 32 raw bytes is the 256-bit master key. Anything else is a
passphrase (surrounding whitespace stripped, at least 8 bytes), stretched with scrypt (n=2**15, r=8,
p=1) over the container's salt. The key that seals the container is
HKDF-SHA256(master key, salt=the container's salt, info=b"pagoda-model-encryption/v1"): each
container has its own key, so its deterministic nonces never repeat under one key.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from collections.abc import Iterator
from typing import Any

from pagoda.loader.model_keys import ModelKey, corrupted_error, derive_file_key, tampered_error

MAGIC = b"PAGODAEM"
VERSION = 1
DEFAULT_CHUNK_SIZE = 1 << 20
MIN_CHUNK_SIZE = 4096
MAX_CHUNK_SIZE = 64 << 20
TAG_SIZE = 16
SALT_SIZE = 32
NONCE_PREFIX_SIZE = 4
CHUNK_AAD_LABEL = b"PGDC"
CIPHER = "AES-256-GCM"

PREFIX = struct.Struct(">8sHI")  # magic, version, header_len
_MAX_HEADER = 16 << 20
HEADER_INDEX = 0xFFFFFFFF  # member and chunk index of the header tag's nonce (no member has it)
# Files that are weights: decrypted only into memory, never into the metadata directory.
WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".bin", ".pt", ".pth", ".ckpt", ".npz", ".npy", ".h5", ".msgpack",
                   ".onnx", ".pkl")


@dataclass(frozen=True)
class Member:
    index: int
    name: str
    size: int
    offset: int  # of its first chunk in the container
    chunks: int


def chunk_count(size: int, chunk_size: int) -> int:
    return max(1, math.ceil(size / chunk_size))


def chunk_nonce(prefix: bytes, member: int, chunk: int) -> bytes:
    return prefix + struct.pack(">II", member, chunk)


def chunk_aad(header_digest: bytes, member: int, chunk: int, last: bool) -> bytes:
    return CHUNK_AAD_LABEL + header_digest + struct.pack(">IIB", member, chunk, int(last))


def check_member_name(name: Any) -> str:
    """A relative POSIX path without '..' (it names a file under the metadata directory)."""
    if not isinstance(name, str) or not name or "\\" in name or "\x00" in name:
        raise ValueError(f"invalid member name {name!r}")
    parts = PurePosixPath(name).parts
    if name.startswith("/") or any(part in ("..", ".") for part in parts):
        raise ValueError(f"invalid member name {name!r}")
    return name


def is_weight_member(name: str) -> bool:
    return name.lower().endswith(WEIGHT_SUFFIXES)


def is_encrypted_model(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a file that starts with the container's magic bytes."""
    try:
        with open(path, "rb") as f:
            return f.read(len(MAGIC)) == MAGIC
    except OSError:
        return False


class EncryptedModelReader:
    """An open container whose key and header have been checked. ``read_member`` and
    ``decrypt_to_memfd`` authenticate every chunk they return; a failure is a ValueError that says
    "wrong key or corrupted/tampered model file"."""

    def __init__(self, path: str | os.PathLike, key: ModelKey) -> None:
        self.path = Path(path)
        self._fd = -1
        try:
            self._fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError as e:
            raise ValueError(f"cannot open the encrypted model {self.path}: {e}") from None
        try:
            self._open(key)
        except BaseException:
            self.close()
            raise

    def _open(self, key: ModelKey) -> None:
        from cryptography.exceptions import InvalidTag  # cryptography loads on first use
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM  # cryptography loads on first use

        path = self.path
        prefix = os.pread(self._fd, PREFIX.size, 0)
        if len(prefix) < len(MAGIC) or prefix[:len(MAGIC)] != MAGIC:
            raise ValueError(f"{path} is not a pagoda encrypted model (no {MAGIC!r} magic)")
        if len(prefix) < PREFIX.size:
            raise corrupted_error(path, "truncated inside its header")
        _, version, header_len = PREFIX.unpack(prefix)
        if version != VERSION:
            raise ValueError(f"{path}: encrypted model format version {version} is not supported "
                             f"(this pagoda reads version {VERSION})")
        if header_len > _MAX_HEADER:
            raise corrupted_error(path, f"header length {header_len} is implausible")
        header_bytes = os.pread(self._fd, header_len + TAG_SIZE, PREFIX.size)
        if len(header_bytes) < header_len + TAG_SIZE:
            raise corrupted_error(path, "truncated inside its header")
        signed = prefix + header_bytes[:header_len]
        tag = header_bytes[header_len:]
        try:
            header = json.loads(header_bytes[:header_len].decode("utf-8"))
            self._read_header(header)
        except (ValueError, KeyError, TypeError) as e:
            raise tampered_error(path, f"unreadable header ({e})") from None

        self._aes = AESGCM(derive_file_key(key, self.kdf, self.salt, path))
        try:
            self._aes.decrypt(chunk_nonce(self.nonce_prefix, HEADER_INDEX, HEADER_INDEX), tag, signed)
        except InvalidTag:
            raise tampered_error(path, f"the header does not authenticate with the key from {key.source}") from None
        self._invalid_tag = InvalidTag
        self.header_digest = hashlib.sha256(signed).digest()

        offset = len(signed) + TAG_SIZE
        members = []
        for i, (name, size) in enumerate(self._member_list):
            chunks = chunk_count(size, self.chunk_size)
            members.append(Member(i, name, size, offset, chunks))
            offset += size + chunks * TAG_SIZE
        self.members = members
        actual = os.fstat(self._fd).st_size
        if actual < offset:
            raise corrupted_error(path, f"truncated: {actual} bytes, the header promises {offset}")
        if actual > offset:
            raise corrupted_error(path, f"trailing data: {actual - offset} bytes after the last chunk")

    def _read_header(self, header: dict[str, Any]) -> None:
        if not isinstance(header, dict):
            raise ValueError("not a JSON object")
        if header.get("cipher") != CIPHER:
            raise ValueError(f"unsupported cipher {header.get('cipher')!r}")
        self.format = header["format"]
        if self.format not in ("gguf", "safetensors"):
            raise ValueError(f"unknown model format {self.format!r}")
        self.chunk_size = header["chunk_size"]
        if not isinstance(self.chunk_size, int) or not MIN_CHUNK_SIZE <= self.chunk_size <= MAX_CHUNK_SIZE:
            raise ValueError(f"invalid chunk_size {self.chunk_size!r}")
        self.salt = bytes.fromhex(header["salt"])
        self.nonce_prefix = bytes.fromhex(header["nonce_prefix"])
        if len(self.salt) != SALT_SIZE or len(self.nonce_prefix) != NONCE_PREFIX_SIZE:
            raise ValueError("invalid salt or nonce prefix")
        self.kdf = header["kdf"]
        if not isinstance(self.kdf, dict):
            raise ValueError("invalid kdf")
        members = header["members"]
        if not isinstance(members, list) or not members or len(members) >= HEADER_INDEX:
            raise ValueError("invalid member list")
        self._member_list = []
        for m in members:
            name, size = check_member_name(m["name"]), m["size"]
            if not isinstance(size, int) or size < 0:
                raise ValueError(f"invalid size {size!r} of {name!r}")
            self._member_list.append((name, size))
        if len({n for n, _ in self._member_list}) != len(self._member_list):
            raise ValueError("duplicate member names")
        self.gguf_converter_version = header.get("gguf_converter_version")
        self.header = header

    # -- reading ----------------------------------------------------------------------------
    def member(self, name: str) -> Member:
        for m in self.members:
            if m.name == name:
                return m
        raise KeyError(name)

    def iter_chunks(self, member: Member) -> Iterator[bytes]:
        """The member's plaintext, chunk by chunk, each authenticated before it is returned."""
        cs = self.chunk_size
        for i in range(member.chunks):
            plain_len = min(cs, member.size - i * cs)
            want = plain_len + TAG_SIZE
            data = os.pread(self._fd, want, member.offset + i * (cs + TAG_SIZE))
            if len(data) != want:
                raise corrupted_error(self.path, f"truncated in chunk {i} of {member.name!r}")
            last = i == member.chunks - 1
            try:
                yield self._aes.decrypt(chunk_nonce(self.nonce_prefix, member.index, i), data,
                                        chunk_aad(self.header_digest, member.index, i, last))
            except self._invalid_tag:
                raise tampered_error(self.path, f"chunk {i} of {member.name!r} does not authenticate") from None

    def read_member(self, member: Member) -> bytes:
        return b"".join(self.iter_chunks(member))

    def decrypt_to_memfd(self, member: Member) -> int:
        """A memfd (anonymous memory, close-on-exec) holding the member's plaintext, every chunk
        authenticated. The caller closes it; ``/proc/self/fd/N`` opens it like a file."""
        if not hasattr(os, "memfd_create"):
            raise ValueError("loading an encrypted model needs Linux (os.memfd_create), so that the "
                             "decrypted weights stay in memory")
        fd = os.memfd_create(f"pagoda-decrypted:{PurePosixPath(member.name).name}", os.MFD_CLOEXEC)
        try:
            for plain in self.iter_chunks(member):
                view = memoryview(plain)
                while view:
                    view = view[os.write(fd, view):]
            return fd
        except BaseException:
            os.close(fd)
            raise

    def verify(self) -> int:
        """Authenticate every chunk of every member; returns the plaintext byte count."""
        total = 0
        for m in self.members:
            for plain in self.iter_chunks(m):
                total += len(plain)
        return total

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> EncryptedModelReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


def container_summary(path: str | os.PathLike, key: ModelKey) -> dict[str, Any]:
    """Format, chunk size, KDF and members of a container (its key and header checked)."""
    with EncryptedModelReader(path, key) as reader:
        return {"format": reader.format, "chunk_size": reader.chunk_size, "kdf": reader.kdf["name"],
                "members": [(m.name, m.size) for m in reader.members]}
