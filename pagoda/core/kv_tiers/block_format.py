"""A KV block as bytes at rest: the one format of the disk tier's files and the shared store's values
(``disk_tier``, ``remote_tier``), so a block is checked the same way wherever it was kept.

A record is a header, then the payload: MAGIC, a flags byte (1: encrypted), the block's key, the
payload's length (8 bytes, little-endian) and its SHA-256. The header names the key it holds (a
record copied under another name is foreign), the length and digest catch a torn or corrupted
record, and, for an encrypted model, AES-GCM with the key as associated data authenticates the
payload under a key derived from the model's.
"""

from __future__ import annotations

import hashlib
import os
import struct

from pagoda.core.kv_tiers.block_hash import KEY_BYTES

MAGIC = b"PGKV\x01"
HEADER = struct.Struct(f"<5sB{KEY_BYTES}sQ32s")
ENCRYPTED = 1


class KVCipher:
    """AES-256-GCM under a key of its own (an encrypted model's KV is sealed with the model's key:
    ``kv_key_from_model_key``). The block's key is the associated data, so a sealed payload moved
    under another name does not open."""

    def __init__(self, key: bytes) -> None:
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM  # cryptography loads only for encrypted models

        if len(key) != 32:
            raise ValueError(f"a KV cipher key is 32 bytes, got {len(key)}")
        self._aes = AESGCM(key)

    def seal(self, key: bytes, payload: bytes) -> bytes:
        nonce = os.urandom(12)
        return nonce + self._aes.encrypt(nonce, payload, key)

    def open(self, key: bytes, sealed: bytes) -> bytes:
        return self._aes.decrypt(sealed[:12], sealed[12:], key)  # raises InvalidTag when tampered


def kv_key_from_model_key(secret: bytes, container_digest: str) -> bytes:
    """A key for the KV of one encrypted model: derived from its key (raw or passphrase) and its
    container's header digest, so the model key itself never encrypts anything else."""
    return hashlib.scrypt(secret, salt=b"pagoda-kv-offload\0" + container_digest.encode(), n=2**14, r=8, p=1,
                          dklen=32)


def encode(key: bytes, payload: bytes, cipher: KVCipher | None) -> bytes:
    """The record of ``payload`` under ``key`` (sealed first when there is a cipher)."""
    if cipher is not None:
        payload = cipher.seal(key, payload)
    return HEADER.pack(MAGIC, ENCRYPTED if cipher else 0, key, len(payload), hashlib.sha256(payload).digest()) + payload


def problem(key: bytes, data: bytes, cipher: KVCipher | None) -> str | None:
    """Why ``data`` is not a record of ``key`` (None: it is)."""
    if len(data) < HEADER.size or data[:len(MAGIC)] != MAGIC:
        return "not a pagoda KV block (bad magic or too short)"
    _, flags, stored_key, length, digest = HEADER.unpack_from(data)
    if stored_key != key:
        return "foreign: its header names another block"
    if bool(flags & ENCRYPTED) != (cipher is not None):
        return "encrypted for another model" if flags & ENCRYPTED else "not encrypted, but this model's KV is"
    payload = memoryview(data)[HEADER.size:]
    if len(payload) != length:
        return f"torn write: {len(payload)} payload bytes of {length}"
    if hashlib.sha256(payload).digest() != digest:
        return "checksum mismatch (corrupted)"
    return None


def decode(key: bytes, data: bytes, cipher: KVCipher | None) -> tuple[bytes | None, str | None]:
    """(payload, None) for a sound record of ``key``, else (None, why it is refused)."""
    why = problem(key, data, cipher)
    if why is not None:
        return None, why
    payload = data[HEADER.size:]
    if cipher is None:
        return payload, None
    try:
        return cipher.open(key, payload), None
    except Exception:  # InvalidTag: another key, or tampered after its checksum was made
        return None, "it does not decrypt with this model's key"
